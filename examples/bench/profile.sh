#!/usr/bin/env bash
# Where switchyard's CPU goes: a flame graph of the gateway under load against
# the neutral upstream of run.sh's `neutral` paths (nginx `return 200` of a
# static completion, or of a static 16-chunk SSE body), and a flat summary.
#
#   examples/bench/profile.sh                 # plain requests, wrk -c64, 8 s sampled
#   MODE=sse CONC=64 examples/bench/profile.sh
#
# Needs perf (Debian: linux-perf), nginx, wrk, and inferno
# (`cargo install inferno`) for the SVG; builds `--profile profiling` (the
# release build with debug info). Samples with `-e cpu-clock` (no hardware
# counters on a VM) and DWARF call graphs. Output in $OUT: perf.data,
# folded stacks, flame.svg, top.txt. Ports 18591-18593 on 127.0.0.1.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE="${MODE:-plain}"
CONC="${CONC:-64}"
SECS="${SECS:-8}"
OUT="${OUT:-/tmp/switchyard-profile/$(date +%Y%m%d-%H%M%S)-$MODE}"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
mkdir -p "$OUT"
(cd "$REPO" && cargo build --profile profiling --locked --bin switchyard)
BIN="$TARGET_DIR/profiling/switchyard"

. "$REPO/examples/bench/neutral_bodies.sh"
cat > "$OUT/up.conf" <<EOF
worker_processes 1;
pid $OUT/up.pid;
error_log $OUT/up.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  server {
    listen 127.0.0.1:18591;
    location /plain/v1/chat/completions { default_type application/json; return 200 '$NEUTRAL_PLAIN'; }
    location /sse/v1/chat/completions { default_type text/event-stream; return 200 '$NEUTRAL_SSE'; }
  }
}
EOF
cat > "$OUT/routes.yaml" <<EOF
version: 1
providers:
  plain: { base_url: "http://127.0.0.1:18591/plain/v1" }
  sse: { base_url: "http://127.0.0.1:18591/sse/v1" }
targets:
  tp: { provider: plain, model: up }
  ts: { provider: sse, model: up }
tasks:
  plain: { chain: [tp] }
  sse: { chain: [ts] }
EOF
stream=false; [ "$MODE" = sse ] && stream=true
printf 'wrk.method="POST"\nwrk.headers["content-type"]="application/json"\nwrk.body=%s\n' \
  "'{\"model\":\"$MODE\",\"stream\":$stream,\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}'" > "$OUT/load.lua"
nginx -c "$OUT/up.conf"
RUST_LOG=warn "$BIN" serve --config "$OUT/routes.yaml" --listen 127.0.0.1:18593 2>"$OUT/switchyard.log" &
SY=$!
trap 'kill $SY 2>/dev/null; kill "$(cat "$OUT/up.pid")" 2>/dev/null' EXIT
sleep 1
URL=http://127.0.0.1:18593/v1/chat/completions
wrk -t2 -c"$CONC" -d2s -s "$OUT/load.lua" "$URL" >/dev/null
wrk -t2 -c"$CONC" -d$((SECS + 3))s -s "$OUT/load.lua" "$URL" > "$OUT/wrk.txt" &
WRK=$!
sleep 1
perf record -e cpu-clock -F 2000 --call-graph dwarf,32768 -p "$SY" -o "$OUT/perf.data" -- sleep "$SECS"
wait "$WRK"
perf report -i "$OUT/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null | grep -v '^#' | head -60 > "$OUT/top.txt"
if command -v inferno-collapse-perf >/dev/null; then
  perf script -i "$OUT/perf.data" 2>/dev/null | inferno-collapse-perf > "$OUT/folded.txt"
  inferno-flamegraph --title "switchyard $MODE c=$CONC" < "$OUT/folded.txt" > "$OUT/flame.svg"
fi
tail -3 "$OUT/wrk.txt"
echo "profile: $OUT (top.txt, flame.svg)"
