#!/usr/bin/env bash
# What telemetry costs: the same streamed load (examples/bench, 8 at a time,
# 5 s per run after a 4 s warm-up) through switchyard against the fast fake
# upstream, in three set-ups, interleaved, $REPS times each:
#   A  access log off, tracing off
#   B  access log on (the default), tracing off
#   C  access log on, traces exported over OTLP/HTTP (to the fake, which
#      answers any POST with a 200)
# Needs the release builds:
#   cargo build --release --locked --bin switchyard --example fake_upstream --example bench
# Prints one JSON line per run: requests, ttft and total p50/p99 in µs.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
T="${CARGO_TARGET_DIR:-$REPO/target}/release"
REPS="${REPS:-3}"
WORK="$(mktemp -d)"
cd "$WORK"
"$T/examples/fake_upstream" --listen 127.0.0.1:19101 --threads 1 > fake.log 2>&1 &
FAKE=$!
trap 'kill $FAKE 2>/dev/null || true; rm -rf "$WORK"' EXIT
sleep 0.5
cfg() {
  cat > "routes-$1.yaml" <<Y
version: 1
providers:
  f: { base_url: "http://127.0.0.1:19101/v1" }
targets:
  t: { provider: f, model: m }
tasks:
  one: { chain: [t] }
telemetry: { access_log: $2 }
Y
}
cfg A false; cfg B true; cfg C true
URL=http://127.0.0.1:19110/v1/chat/completions
for rep in $(seq 1 "$REPS"); do
  for c in A B C; do
    env=()
    if [ "$c" = C ]; then env=(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:19101/v1/chat/completions); fi
    env "${env[@]}" "$T/switchyard" serve --config "routes-$c.yaml" --listen 127.0.0.1:19110 2> "sy-$c.log" &
    SY=$!
    sleep 0.7
    "$T/examples/bench" --url "$URL" --model one --concurrency 8 --duration 4s > /dev/null
    echo "$c $rep $("$T/examples/bench" --url "$URL" --model one --concurrency 8 --duration 5s)"
    kill -TERM "$SY"; wait "$SY" || true
  done
done
