#!/usr/bin/env bash
# Instructions per request (BENCHMARKS.md, "Instructions per request"):
# switchyard and the floor proxy (examples/floor_proxy.rs), each run under
# valgrind's callgrind in front of the same neutral upstream (nginx returning
# a static chat completion, or a static 16-chunk SSE stream), counted over N
# requests after a warm-up. Unlike CPU time, the count does not move with the
# machine's load: it is the measure of switchyard's own work per request
# (its count minus the floor's), and the per-function table it prints is
# the stage budget (inclusive instructions per request).
#
#   examples/bench/instructions.sh                     # plain, 2,000 requests
#   MODE=stream N=1000 examples/bench/instructions.sh
#   FRONT=messages MODE=stream N=1000 examples/bench/instructions.sh
#
# FRONT picks the protocol on both sides: chat (Chat Completions to an
# OpenAI-compatible target), messages (a Messages client and an `anthropic`
# target) or responses (a Responses client and a `responses: true` target),
# the last two passed through as sent. The floor relays the same bytes.
#
# Env: MODE (plain | stream) FRONT (chat) N (2000) TOP (30 rows of the stage table)
#      SKIP_BUILD=1 SWITCHYARD_BIN FLOOR_BIN (default: the release builds)
#      OUT (/tmp/switchyard-instructions/DATE) PORT_BASE (19500)
# Installs what is missing: valgrind and nginx (apt), oha (cargo install).
# Everything listens on 127.0.0.1 and is killed on exit.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODE="${MODE:-plain}"
FRONT="${FRONT:-chat}"
N="${N:-2000}"
TOP="${TOP:-30}"
OUT="${OUT:-/tmp/switchyard-instructions/$(date +%Y%m%d-%H%M%S)}"
B="${PORT_BASE:-19500}"
P_NEUTRAL=$B P_SY=$((B + 1)) P_FLOOR=$((B + 2))
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p "$OUT/tmp"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

need_apt=()
command -v valgrind >/dev/null || need_apt+=(valgrind)
command -v nginx >/dev/null || need_apt+=(nginx-light)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing ${need_apt[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
command -v oha >/dev/null || cargo install oha --locked --version 1.16.0
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  (cd "$REPO" && cargo build --release --locked --bin switchyard --example floor_proxy)
fi
SY_BIN="${SWITCHYARD_BIN:-$REPO/target/release/switchyard}"
FLOOR_BIN="${FLOOR_BIN:-$REPO/target/release/examples/floor_proxy}"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

. "$REPO/examples/bench/neutral_bodies.sh"
cat > "$OUT/nginx.conf" <<EOF
worker_processes 1;
pid $OUT/nginx.pid;
error_log $OUT/nginx-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $OUT/tmp/body;
  proxy_temp_path $OUT/tmp/proxy;
  fastcgi_temp_path $OUT/tmp/fastcgi;
  uwsgi_temp_path $OUT/tmp/uwsgi;
  scgi_temp_path $OUT/tmp/scgi;
  server {
    listen 127.0.0.1:$P_NEUTRAL;
    keepalive_requests 1000000;
    location /plain/v1/chat/completions { default_type application/json; return 200 '$NEUTRAL_PLAIN'; }
    location /stream/v1/chat/completions { default_type text/event-stream; return 200 '$NEUTRAL_SSE'; }
    location /plain/v1/messages { default_type application/json; return 200 '$A_PLAIN'; }
    location /stream/v1/messages { default_type text/event-stream; return 200 '$A_SSE'; }
    location /plain/v1/responses { default_type application/json; return 200 '$R_PLAIN'; }
    location /stream/v1/responses { default_type text/event-stream; return 200 '$R_SSE'; }
  }
}
EOF
nginx -c "$OUT/nginx.conf" -p "$OUT" -g 'daemon off;' 2>"$OUT/nginx.log" & PIDS+=("$!")

case "$FRONT" in
  chat) PROVIDER_EXTRA='' PATH_FRONT=/v1/chat/completions ;;
  messages) PROVIDER_EXTRA=', protocol: anthropic, api_key_env: BENCH_ANTHROPIC_KEY' PATH_FRONT=/v1/messages ;;
  responses) PROVIDER_EXTRA=', responses: true' PATH_FRONT=/v1/responses ;;
  *) log "FRONT must be chat, messages or responses"; exit 2 ;;
esac
export BENCH_ANTHROPIC_KEY=bench-key
cat > "$OUT/routes.yaml" <<EOF
version: 1
listen: 127.0.0.1:$P_SY
providers:
  neutral: { base_url: 'http://127.0.0.1:$P_NEUTRAL/$MODE/v1'$PROVIDER_EXTRA }
targets:
  neutral: { provider: neutral, model: up }
tasks:
  neutral: { chain: [neutral] }
EOF
STREAM=false; [ "$MODE" = stream ] && STREAM=true
case "$FRONT" in
  responses) printf '{"model":"neutral","stream":%s,"max_output_tokens":16,"input":"hi"}' "$STREAM" ;;
  *) printf '{"model":"neutral","stream":%s,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}' "$STREAM" ;;
esac > "$OUT/body.json"

load() { # url count
  oha -n "$2" -c 4 --no-tui -m POST -H 'content-type: application/json' -D "$OUT/body.json" "$1" \
    | awk '/Success rate/ {print "success rate", $3}' >&2
}

# count NAME URL CMD...: instructions per request of CMD under callgrind
count() {
  local name=$1 url=$2; shift 2
  local file="$OUT/$name.callgrind"
  valgrind --tool=callgrind --callgrind-out-file="$file" "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  local end=$((SECONDS + 60))
  until curl -s -o /dev/null -m 2 -X POST -H 'content-type: application/json' -d @"$OUT/body.json" "$url"; do
    [ $SECONDS -ge $end ] && { log "$name did not start (see $OUT/$name.log)"; exit 1; }
    sleep 0.5
  done
  load "$url" 500
  callgrind_control -z "$pid" >/dev/null
  load "$url" "$N"
  callgrind_control -d "$pid" >/dev/null
  sleep 1
  kill -INT "$pid" 2>/dev/null || true; sleep 1; kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  local dump
  dump=$(ls -t "$file".* 2>/dev/null | head -1)
  local total
  total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
  echo "$name $((total / N)) $dump"
}

log "switchyard under callgrind ($FRONT, $MODE, $N requests)"
export RUST_LOG=info # switchyard's default level: its access line is written
read -r _ SY_IR SY_DUMP < <(count switchyard "http://127.0.0.1:$P_SY$PATH_FRONT" \
  "$SY_BIN" serve --config "$OUT/routes.yaml")
log "floor proxy under callgrind"
read -r _ FLOOR_IR _ < <(count floor "http://127.0.0.1:$P_FLOOR/$MODE$PATH_FRONT" \
  "$FLOOR_BIN" --listen "127.0.0.1:$P_FLOOR" --upstream "http://127.0.0.1:$P_NEUTRAL")

{
  echo "## Instructions per request ($FRONT, $MODE, $N requests after 500 of warm-up)"
  echo
  echo "| process | instructions per request |"
  echo "|---|---:|"
  echo "| switchyard | $SY_IR |"
  echo "| floor proxy | $FLOOR_IR |"
  echo "| switchyard minus floor (its own work) | $((SY_IR - FLOOR_IR)) |"
  echo
  echo "## switchyard: inclusive instructions per request, by function (top $TOP)"
  echo
  callgrind_annotate --inclusive=yes "$SY_DUMP" 2>/dev/null \
    | awk -v n="$N" -v top="$TOP" '
        /^ *[0-9,]+ \(/ && /switchyard::|hyper::proto|serde_json::de::from_trait|tracing_core::dispatcher/ {
          ir = $1; gsub(",", "", ir); name = $0; sub(/^[^?]*\?\?\?:/, "", name); sub(/ \[.*$/, "", name)
          if (shown++ < top) printf "| %s | %d |\n", name, ir / n
        }' | sed '1i | function | instructions |\n|---|---:|'
} | tee "$OUT/instructions.md"
