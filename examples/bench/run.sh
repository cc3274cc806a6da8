#!/usr/bin/env bash
# Overhead benchmark of switchyard (results: BENCHMARKS.md).
#
#   examples/bench/run.sh                  # everything, ~15 min on 2 cores
#   DURATION=3 REPEAT=1 examples/bench/run.sh          # quick look
#   PATHS="direct switchyard-1" MODES=plain CONCURRENCY=64 examples/bench/run.sh
#
# One run measures, with oha (HTTP load generator, keep-alive), non-streaming
# and streaming chat completions at each concurrency, REPEAT times DURATION
# seconds per point (the median is reported), on these paths to the same fast
# fake upstream (examples/fake_upstream.rs):
#   direct        the fake itself (the floor)
#   switchyard-1  switchyard, chain [live]
#   switchyard-3  switchyard, chain [dead1, dead2, live]: the first two refuse
#                 connections and are DOWN (breaker open) after the warm-up
#   nginx         nginx reverse proxy (keep-alive upstream, no buffering):
#                 "any proxy hop"
#   litellm       LiteLLM proxy, group `one` (same as switchyard-1) and group
#                 `three` (orders 1-3 = dead1, dead2, live) for the 3-chain
# and, against a neutral upstream (nginx, 1 worker, `return 200` of a static
# completion and a static 16-chunk SSE body: no fake, no Rust on the far side,
# the usual side-by-side against nginx):
#   neutral                the neutral upstream itself (the floor)
#   nginx-neutral          nginx proxy_pass (2 workers) in front of it
#   switchyard-neutral     switchyard, chain [neutral]
#   switchyard-neutral-3   switchyard, chain [dead1, dead2, neutral] (two DOWN)
#   switchyard-neutral-messages   a Messages client (/v1/messages) and an
#                          `anthropic` target on the neutral upstream (static
#                          Anthropic answers): the pass-through, as sent both ways
#   switchyard-neutral-responses  a Responses client (/v1/responses) and the
#                          chat target: translated both ways
#   switchyard-neutral-responses-native  a Responses client and a provider with
#                          `responses: true` on the neutral upstream (static
#                          Responses answers): the pass-through, as sent both ways
#   nginx-neutral-messages, nginx-neutral-responses  nginx proxy_pass relaying
#                          those same Anthropic and Responses answers: each
#                          pass-through's own plain proxy hop
#   switchyard-neutral-cached  switchyard, chain [neutral] with a `cache`: after
#                          the first request every one is a hit (no upstream call)
#   floor-neutral-multi    the floor of our own stack: the minimal tokio + hyper
#                          reverse proxy (examples/floor_proxy.rs) in front of it,
#                          one multi-thread runtime (switchyard's `runtimes: 1`)
#   floor-neutral-percore  the same proxy, one current_thread runtime per core,
#                          each with its own SO_REUSEPORT listener and upstream
#                          pool (switchyard's default model); switchyard's CPU
#                          per request minus this one's is switchyard's own work
# Every row has the proxy's CPU per request (user+system from /proc): the
# number a sidecar is judged by.
# plus, for streams, TTFT per path with the `bench` example; switchyard's RSS
# idle and with 1,000 concurrent open streams; a long stream (LONG_CHUNKS
# chunks LONG_DELAY apart, LONG_STREAMS of them, 64 at a time) through
# switchyard and nginx, for the CPU per relayed chunk; and a reload storm under
# full load (routes.yaml rewritten every 200 ms during a c=64 run: must fail nothing).
#
# Installs what is missing: oha (cargo install, ~6 min), nginx (apt),
# LiteLLM (examples/peers/peers.sh setup, a venv). Every server listens on
# 127.0.0.1 and is killed (by PID) on exit. Results: $OUT/results.md
# (tables), $OUT/points.tsv (every repetition), raw oha JSON next to them.
#
# Env: DURATION (5) REPEAT (3) CONCURRENCY ("1 16 64") MODES ("plain stream")
#      PATHS ("direct switchyard-1 switchyard-3 nginx litellm neutral nginx-neutral
#             switchyard-neutral switchyard-neutral-3 switchyard-neutral-messages
#             switchyard-neutral-responses switchyard-neutral-responses-native
#             nginx-neutral-messages nginx-neutral-responses switchyard-neutral-cached
#             floor-neutral-multi floor-neutral-percore")
#      CACHE_ENTRIES (10000): distinct answers kept, for the memory per cache entry
#      LONG_CHUNKS (1000) LONG_DELAY (5ms) LONG_STREAMS (128; 0 skips the long stream)
#      CHUNKS (16) CHUNK_DELAY (0ms) per stream; OPEN_STREAMS (1000) TTFT_DURATION (3)
#      OUT (/tmp/switchyard-bench/DATE) PORT_BASE (19000) PEERS_VENV (~/.cache/switchyard-peers/venv)
#      CARGO_TARGET_DIR (target) SKIP_BUILD=1 to use existing binaries
#      SWITCHYARD_BIN (the release build) to measure another switchyard binary
#      SY_RUNTIMES: switchyard's `runtimes` (default: its own, one per core)
#      SY_ACCESS_LOG=false: switchyard without its access log (`telemetry: { access_log: false }`)
#      SCRAPE_EVERY (15): seconds between GET /metrics, as Prometheus would (0: never;
#      switchyard at 97bc620 keeps every histogram sample until the next scrape)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/examples/bench"
DURATION="${DURATION:-5}"
REPEAT="${REPEAT:-3}"
CONCURRENCY="${CONCURRENCY:-1 16 64}"
MODES="${MODES:-plain stream}"
PATHS="${PATHS:-direct switchyard-1 switchyard-3 nginx litellm neutral nginx-neutral switchyard-neutral switchyard-neutral-3 switchyard-neutral-messages switchyard-neutral-responses switchyard-neutral-responses-native nginx-neutral-messages nginx-neutral-responses switchyard-neutral-cached floor-neutral-multi floor-neutral-percore}"
LONG_CHUNKS="${LONG_CHUNKS:-1000}"
LONG_DELAY="${LONG_DELAY:-5ms}"
LONG_STREAMS="${LONG_STREAMS:-128}"
CHUNKS="${CHUNKS:-16}"
CHUNK_DELAY="${CHUNK_DELAY:-0ms}"
OPEN_STREAMS="${OPEN_STREAMS:-1000}"
TTFT_DURATION="${TTFT_DURATION:-3}"
SCRAPE_EVERY="${SCRAPE_EVERY:-15}"
PEERS="$REPO/examples/peers/peers.sh"
PEERS_VENV="${PEERS_VENV:-$HOME/.cache/switchyard-peers/venv}"
export PEERS_VENV
OUT="${OUT:-/tmp/switchyard-bench/$(date +%Y%m%d-%H%M%S)}"
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
B="${PORT_BASE:-19000}"
P_FAKE=$((B + 1)) P_SLOW=$((B + 2)) P_DEAD1=$((B + 3)) P_DEAD2=$((B + 4))
P_SY=$((B + 10)) P_NGINX=$((B + 20)) P_LITELLM=$((B + 30))
P_NEUTRAL=$((B + 5)) P_LONG=$((B + 6)) P_NGINX_NEUTRAL=$((B + 21)) P_NGINX_LONG=$((B + 22))
P_FLOOR_MULTI=$((B + 40)) P_FLOOR_PERCORE=$((B + 41))
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p "$OUT"
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
has() { [[ " $PATHS " == *" $1 "* ]]; }
has_neutral() { [[ " $PATHS " == *" neutral"* || " $PATHS " == *"-neutral"* ]]; }

# ---- install what is missing ----
if ! command -v oha >/dev/null; then
  log "installing oha 1.16.0 (cargo install, ~6 min on 2 cores)"
  cargo install oha --locked --version 1.16.0
fi
if { has nginx || has_neutral; } && ! command -v nginx >/dev/null; then
  log "installing nginx (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
fi
if has litellm; then
  log "LiteLLM venv ($PEERS setup)"
  "$PEERS" setup >&2
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  log "building switchyard, fake_upstream, bench and floor_proxy (release)"
  (cd "$REPO" && cargo build --release --locked --bin switchyard --example fake_upstream --example bench \
    --example floor_proxy)
fi
SY_BIN="${SWITCHYARD_BIN:-$TARGET_DIR/release/switchyard}"
FAKE_BIN="$TARGET_DIR/release/examples/fake_upstream"
PROBE_BIN="$TARGET_DIR/release/examples/bench"
FLOOR_BIN="$TARGET_DIR/release/examples/floor_proxy"

# ---- servers ----
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "${RELOADER:-}" ] && kill "$RELOADER" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_http() { # url seconds
  local end=$((SECONDS + $2))
  until curl -s -o /dev/null -m 1 "$1"; do
    [ $SECONDS -ge "$end" ] && { log "timeout waiting for $1"; return 1; }
    sleep 0.2
  done
}

"$FAKE_BIN" --listen "127.0.0.1:$P_FAKE" --chunks "$CHUNKS" --chunk-delay "$CHUNK_DELAY" \
  2>"$OUT/fake.log" & FAKE_PID=$!; PIDS+=("$FAKE_PID")
# streams that stay open ~60 s, for the open-streams RSS point
"$FAKE_BIN" --listen "127.0.0.1:$P_SLOW" --chunks 120 --chunk-delay 500ms \
  2>"$OUT/fake-slow.log" & PIDS+=("$!")
# long streams, for the CPU per relayed chunk
if [ "$LONG_STREAMS" != 0 ]; then
  "$FAKE_BIN" --listen "127.0.0.1:$P_LONG" --chunks "$LONG_CHUNKS" --chunk-delay "$LONG_DELAY" \
    2>"$OUT/fake-long.log" & PIDS+=("$!")
fi

# the neutral upstream: nginx returning a static completion and a static SSE body
if has_neutral; then
  mkdir -p "$OUT/neutral/tmp"
  . "$HERE/neutral_bodies.sh"
  cat > "$OUT/neutral/nginx.conf" <<EOF
worker_processes 1;
pid $OUT/neutral/nginx.pid;
error_log $OUT/neutral/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $OUT/neutral/tmp/body;
  proxy_temp_path $OUT/neutral/tmp/proxy;
  fastcgi_temp_path $OUT/neutral/tmp/fastcgi;
  uwsgi_temp_path $OUT/neutral/tmp/uwsgi;
  scgi_temp_path $OUT/neutral/tmp/scgi;
  server {
    listen 127.0.0.1:$P_NEUTRAL backlog=4096;
    keepalive_requests 1000000;
    location = /healthz { return 200 'ok'; }
    location /plain/v1/chat/completions { default_type application/json; return 200 '$NEUTRAL_PLAIN'; }
    location /sse/v1/chat/completions { default_type text/event-stream; return 200 '$NEUTRAL_SSE'; }
    location /anthropic-plain/v1/messages { default_type application/json; return 200 '$A_PLAIN'; }
    location /anthropic-sse/v1/messages { default_type text/event-stream; return 200 '$A_SSE'; }
    location /responses-plain/v1/responses { default_type application/json; return 200 '$R_PLAIN'; }
    location /responses-sse/v1/responses { default_type text/event-stream; return 200 '$R_SSE'; }
  }
}
EOF
  nginx -c "$OUT/neutral/nginx.conf" -p "$OUT/neutral" -g 'daemon off;' 2>"$OUT/neutral/stderr.log" &
  NEUTRAL_PID=$!; PIDS+=("$NEUTRAL_PID")
fi

routes() { # variant: 0 or 1 (the reload storm alternates; they differ only in a comment and timeout)
  cat <<EOF
# switchyard bench config, variant $1
version: 1
listen: 127.0.0.1:$P_SY
${SY_RUNTIMES:+runtimes: $SY_RUNTIMES}
${SY_ACCESS_LOG:+telemetry: { access_log: $SY_ACCESS_LOG \}}
providers:
  live: { base_url: 'http://127.0.0.1:$P_FAKE/v1', timeout: 3$1s }
  dead1: { base_url: 'http://127.0.0.1:$P_DEAD1/v1' }
  dead2: { base_url: 'http://127.0.0.1:$P_DEAD2/v1' }
  slow: { base_url: 'http://127.0.0.1:$P_SLOW/v1', timeout: 300s, idle_timeout: 60s }
  long: { base_url: 'http://127.0.0.1:$P_LONG/v1', timeout: 300s, idle_timeout: 60s }
  neutral-plain: { base_url: 'http://127.0.0.1:$P_NEUTRAL/plain/v1' }
  neutral-sse: { base_url: 'http://127.0.0.1:$P_NEUTRAL/sse/v1' }
  neutral-anthropic-plain: { base_url: 'http://127.0.0.1:$P_NEUTRAL/anthropic-plain/v1', protocol: anthropic, api_key_env: BENCH_ANTHROPIC_KEY }
  neutral-anthropic-sse: { base_url: 'http://127.0.0.1:$P_NEUTRAL/anthropic-sse/v1', protocol: anthropic, api_key_env: BENCH_ANTHROPIC_KEY }
  neutral-responses-plain: { base_url: 'http://127.0.0.1:$P_NEUTRAL/responses-plain/v1', responses: true }
  neutral-responses-sse: { base_url: 'http://127.0.0.1:$P_NEUTRAL/responses-sse/v1', responses: true }
targets:
  live: { provider: live, model: fake-model }
  dead1: { provider: dead1, model: fake-model }
  dead2: { provider: dead2, model: fake-model }
  slow: { provider: slow, model: fake-model }
  long: { provider: long, model: fake-model }
  neutral-plain: { provider: neutral-plain, model: up }
  neutral-sse: { provider: neutral-sse, model: up }
  neutral-anthropic-plain: { provider: neutral-anthropic-plain, model: up }
  neutral-anthropic-sse: { provider: neutral-anthropic-sse, model: up }
  neutral-responses-plain: { provider: neutral-responses-plain, model: up }
  neutral-responses-sse: { provider: neutral-responses-sse, model: up }
tasks:
  one: { chain: [live] }
  three: { chain: [dead1, dead2, live] }
  slow: { chain: [slow], budget: { total_timeout: 300s } }
  long: { chain: [long], budget: { total_timeout: 300s } }
  neutral-plain: { chain: [neutral-plain] }
  neutral-sse: { chain: [neutral-sse] }
  neutral-plain-3: { chain: [dead1, dead2, neutral-plain] }
  neutral-sse-3: { chain: [dead1, dead2, neutral-sse] }
  neutral-anthropic-plain: { chain: [neutral-anthropic-plain] }
  neutral-anthropic-sse: { chain: [neutral-anthropic-sse] }
  neutral-responses-plain: { chain: [neutral-responses-plain] }
  neutral-responses-sse: { chain: [neutral-responses-sse] }
  neutral-plain-cached: { chain: [neutral-plain], cache: { ttl: 1h, max_bytes: 256MiB }, cache_nondeterministic: true }
  neutral-sse-cached: { chain: [neutral-sse], cache: { ttl: 1h }, cache_nondeterministic: true }
EOF
}
mkdir -p "$OUT/sy"
export BENCH_ANTHROPIC_KEY=sk-ant-bench-not-a-real-key # the neutral upstream reads no key
routes 0 > "$OUT/sy/routes.yaml"
"$SY_BIN" validate "$OUT/sy/routes.yaml" >&2
RUST_LOG="${SY_LOG:-info}" "$SY_BIN" serve --config "$OUT/sy/routes.yaml" 2>"$OUT/switchyard.log" &
SY_PID=$!; PIDS+=("$SY_PID")

if has nginx || has_neutral || [ "$LONG_STREAMS" != 0 ]; then
  mkdir -p "$OUT/nginx/tmp"
  cat > "$OUT/nginx/nginx.conf" <<EOF
worker_processes auto;
pid $OUT/nginx/nginx.pid;
error_log $OUT/nginx/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $OUT/nginx/tmp/body;
  proxy_temp_path $OUT/nginx/tmp/proxy;
  fastcgi_temp_path $OUT/nginx/tmp/fastcgi;
  uwsgi_temp_path $OUT/nginx/tmp/uwsgi;
  scgi_temp_path $OUT/nginx/tmp/scgi;
  upstream fake { server 127.0.0.1:$P_FAKE; keepalive 256; keepalive_requests 1000000; }
  upstream neutral { server 127.0.0.1:$P_NEUTRAL; keepalive 256; keepalive_requests 1000000; }
  upstream long { server 127.0.0.1:$P_LONG; keepalive 256; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$P_NGINX_NEUTRAL backlog=4096;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://neutral;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
  server {
    listen 127.0.0.1:$P_NGINX_LONG backlog=4096;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://long;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
  server {
    listen 127.0.0.1:$P_NGINX backlog=4096;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://fake;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
EOF
  nginx -c "$OUT/nginx/nginx.conf" -p "$OUT/nginx" -g 'daemon off;' 2>"$OUT/nginx/stderr.log" &
  NGINX_PID=$!; PIDS+=("$NGINX_PID")
fi

# the floor: the minimal tokio + hyper proxy, in each runtime model, on the neutral upstream
if has floor-neutral-multi; then
  "$FLOOR_BIN" --listen "127.0.0.1:$P_FLOOR_MULTI" --upstream "http://127.0.0.1:$P_NEUTRAL" \
    --runtime multi >"$OUT/floor-multi.log" 2>&1 & FLOOR_MULTI_PID=$!; PIDS+=("$FLOOR_MULTI_PID")
fi
if has floor-neutral-percore; then
  "$FLOOR_BIN" --listen "127.0.0.1:$P_FLOOR_PERCORE" --upstream "http://127.0.0.1:$P_NEUTRAL" \
    --runtime per-core >"$OUT/floor-percore.log" 2>&1 & FLOOR_PERCORE_PID=$!; PIDS+=("$FLOOR_PERCORE_PID")
fi

if has litellm; then
  SY_BENCH_LIVE="http://127.0.0.1:$P_FAKE/v1" SY_BENCH_DEAD1="http://127.0.0.1:$P_DEAD1/v1" \
  SY_BENCH_DEAD2="http://127.0.0.1:$P_DEAD2/v1" LITELLM_CONFIG="$HERE/litellm_config.yaml" \
  "$PEERS" litellm "$P_LITELLM" >"$OUT/litellm.log" 2>&1 &
  LITELLM_PID=$!; PIDS+=("$LITELLM_PID")
fi

wait_http "127.0.0.1:$P_FAKE/healthz" 20
wait_http "127.0.0.1:$P_SLOW/healthz" 20
wait_http "127.0.0.1:$P_SY/healthz" 30
[ -n "${NGINX_PID:-}" ] && wait_http "127.0.0.1:$P_NGINX/healthz" 20
has_neutral && wait_http "127.0.0.1:$P_NEUTRAL/healthz" 20
# through the floor proxies to the neutral upstream's /healthz
has floor-neutral-multi && wait_http "127.0.0.1:$P_FLOOR_MULTI/healthz" 20
has floor-neutral-percore && wait_http "127.0.0.1:$P_FLOOR_PERCORE/healthz" 20
has litellm && wait_http "127.0.0.1:$P_LITELLM/health/liveliness" 120

if [ "$SCRAPE_EVERY" != 0 ]; then
  ( while sleep "$SCRAPE_EVERY"; do curl -s -o /dev/null -m 5 "127.0.0.1:$P_SY/metrics"; done ) &
  SCRAPER=$!; PIDS+=("$SCRAPER")
fi

# ---- /proc helpers ----
HZ="$(getconf CLK_TCK)"
tree() { # pid and its descendants
  local p=$1 c
  echo "$p"
  for c in $(pgrep -P "$p" 2>/dev/null); do tree "$c"; done
}
cpu_ticks() { # utime+stime of a process tree
  local t=0 p
  for p in $(tree "$1"); do
    t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$t"
}
mem_kib() { # field (VmRSS|VmHWM) summed over a process tree
  local t=0 p v
  for p in $(tree "$1"); do
    v=$(awk -v f="$2:" '$1==f {print $2}' "/proc/$p/status" 2>/dev/null || true)
    t=$((t + ${v:-0}))
  done
  echo "$t"
}

# ---- targets ----
body() { # model stream [path]: a Chat Completions body (also a valid Messages one), or a Responses one
  case "${3:-}" in
    *responses*) printf '{"model":"%s","stream":%s,"max_output_tokens":16,"input":"hello"}' "$1" "$2" ;;
    *) printf '{"model":"%s","stream":%s,"max_tokens":16,"messages":[{"role":"user","content":"hello"}]}' "$1" "$2" ;;
  esac
}
path_info() { # path mode -> "url model pid"
  local sub=plain; [ "${2:-plain}" = stream ] && sub=sse
  case "$1" in
    neutral) echo "http://127.0.0.1:$P_NEUTRAL/$sub/v1/chat/completions up ${NEUTRAL_PID:-}" ;;
    nginx-neutral) echo "http://127.0.0.1:$P_NGINX_NEUTRAL/$sub/v1/chat/completions up ${NGINX_PID:-}" ;;
    nginx-neutral-messages) echo "http://127.0.0.1:$P_NGINX_NEUTRAL/anthropic-$sub/v1/messages up ${NGINX_PID:-}" ;;
    nginx-neutral-responses) echo "http://127.0.0.1:$P_NGINX_NEUTRAL/responses-$sub/v1/responses up ${NGINX_PID:-}" ;;
    floor-neutral-multi) echo "http://127.0.0.1:$P_FLOOR_MULTI/$sub/v1/chat/completions up ${FLOOR_MULTI_PID:-}" ;;
    floor-neutral-percore) echo "http://127.0.0.1:$P_FLOOR_PERCORE/$sub/v1/chat/completions up ${FLOOR_PERCORE_PID:-}" ;;
    switchyard-neutral) echo "http://127.0.0.1:$P_SY/v1/chat/completions neutral-$sub $SY_PID" ;;
    switchyard-neutral-3) echo "http://127.0.0.1:$P_SY/v1/chat/completions neutral-$sub-3 $SY_PID" ;;
    switchyard-neutral-cached) echo "http://127.0.0.1:$P_SY/v1/chat/completions neutral-$sub-cached $SY_PID" ;;
    switchyard-neutral-messages) echo "http://127.0.0.1:$P_SY/v1/messages neutral-anthropic-$sub $SY_PID" ;;
    switchyard-neutral-responses) echo "http://127.0.0.1:$P_SY/v1/responses neutral-$sub $SY_PID" ;;
    switchyard-neutral-responses-native) echo "http://127.0.0.1:$P_SY/v1/responses neutral-responses-$sub $SY_PID" ;;
    direct) echo "http://127.0.0.1:$P_FAKE/v1/chat/completions fake-model $FAKE_PID" ;;
    switchyard-1) echo "http://127.0.0.1:$P_SY/v1/chat/completions one $SY_PID" ;;
    switchyard-3) echo "http://127.0.0.1:$P_SY/v1/chat/completions three $SY_PID" ;;
    nginx) echo "http://127.0.0.1:$P_NGINX/v1/chat/completions fake-model ${NGINX_PID:-}" ;;
    litellm) echo "http://127.0.0.1:$P_LITELLM/v1/chat/completions one ${LITELLM_PID:-}" ;;
    litellm-3) echo "http://127.0.0.1:$P_LITELLM/v1/chat/completions three ${LITELLM_PID:-}" ;;
  esac
}
EXPANDED=()
for p in $PATHS; do EXPANDED+=("$p"); [ "$p" = litellm ] && EXPANDED+=("litellm-3"); done

run_oha() { # url body conc secs raw -> "rps p50_us p99_us ok bad"
  oha -z "${4}s" -c "$3" -t 30s -m POST -T application/json -d "$2" \
    --no-tui --output-format json "$1" > "$5" 2>"$5.err" || true
  python3 - "$5" "$4" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    print("0 0 0 0 1"); sys.exit()
secs = float(sys.argv[2])
codes = d.get("statusCodeDistribution") or {}
ok = sum(v for k, v in codes.items() if k.startswith("2"))
bad = sum(v for k, v in codes.items() if not k.startswith("2"))
# requests cut by the end of the run are not failures
errs = sum(v for k, v in (d.get("errorDistribution") or {}).items() if "deadline" not in k and "aborted" not in k)
p = d.get("latencyPercentiles") or {}
print(f"{ok/secs:.1f} {1e6*(p.get('p50') or 0):.0f} {1e6*(p.get('p99') or 0):.0f} {ok} {bad+errs}")
EOF
}

# ---- warm-up: connections, LiteLLM's lazy imports, and the dead targets DOWN ----
log "idle RSS, then warm-up"
sleep 1
SY_IDLE_RSS=$(mem_kib "$SY_PID" VmRSS)
for p in "${EXPANDED[@]}"; do
  for mode in $MODES; do
    stream=false; [ "$mode" = stream ] && stream=true
    read -r url model pid <<<"$(path_info "$p" "$mode")"
    run_oha "$url" "$(body "$model" "$stream" "$p")" 4 2 "$OUT/warmup-$p-$mode.json" >/dev/null
  done
done
SY_WARM_RSS=$(mem_kib "$SY_PID" VmRSS)
curl -s "127.0.0.1:$P_SY/admin/targets" > "$OUT/sy-targets-after-warmup.json" || true

# ---- switchyard: memory per cached answer (early, on a young heap) ----
CACHE_ENTRIES="${CACHE_ENTRIES:-10000}"
BEFORE_CACHE_RSS=0; AFTER_CACHE_RSS=0; CACHE_HELD_BYTES=0; CACHE_HELD=0
if has switchyard-neutral-cached; then
  log "cache: $CACHE_ENTRIES distinct answers kept"
  BEFORE_CACHE_RSS=$(mem_kib "$SY_PID" VmRSS)
  python3 - "$P_SY" "$CACHE_ENTRIES" <<'EOF'
import http.client, json, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
for i in range(n):
    body = json.dumps({"model": "neutral-plain-cached", "max_tokens": 16,
                       "messages": [{"role": "user", "content": f"distinct question {i}"}]})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    conn.getresponse().read()
EOF
  AFTER_CACHE_RSS=$(mem_kib "$SY_PID" VmRSS)
  page=$(curl -s "127.0.0.1:$P_SY/metrics")
  CACHE_HELD_BYTES=$(awk '/^switchyard_cache_bytes\{task="neutral-plain-cached"\}/ {print $2}' <<<"$page")
  CACHE_HELD=$(awk '/^switchyard_cache_entries\{task="neutral-plain-cached"\}/ {print $2}' <<<"$page")
fi

# ---- the matrix ----
printf 'mode\tpath\tconc\trep\trps\tp50_us\tp99_us\tok\tbad\tcpu_s_per_1000\n' > "$OUT/points.tsv"
for mode in $MODES; do
  stream=false; [ "$mode" = stream ] && stream=true
  for p in "${EXPANDED[@]}"; do
    read -r url model pid <<<"$(path_info "$p" "$mode")"
    b="$(body "$model" "$stream" "$p")"
    for c in $CONCURRENCY; do
      for rep in $(seq 1 "$REPEAT"); do
        t0=$(cpu_ticks "$pid")
        read -r rps p50 p99 ok bad <<<"$(run_oha "$url" "$b" "$c" "$DURATION" "$OUT/$mode-$p-c$c-r$rep.json")"
        t1=$(cpu_ticks "$pid")
        cpu=$(awk -v d=$((t1 - t0)) -v hz="$HZ" -v n="$ok" 'BEGIN{ if (n>0) printf "%.4f", d/hz/n*1000; else print "nan" }')
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$p" "$c" "$rep" "$rps" "$p50" "$p99" "$ok" "$bad" "$cpu" >> "$OUT/points.tsv"
        log "$mode $p c=$c #$rep: $rps req/s p50 ${p50}µs p99 ${p99}µs ok $ok bad $bad cpu ${cpu}s/1000"
      done
    done
  done
done

# ---- TTFT of streams ----
printf 'path\tconc\trep\trequests\terrors\tttft_p50_us\tttft_p99_us\ttotal_p50_us\ttotal_p99_us\n' > "$OUT/ttft.tsv"
if [[ " $MODES " == *" stream "* ]]; then
  for p in "${EXPANDED[@]}"; do
    # the probe counts the fake's `[seq ` marker: only the fake's paths
    case "$p" in *neutral*) continue ;; esac
    read -r url model pid <<<"$(path_info "$p" stream)"
    for c in $CONCURRENCY; do
      for rep in $(seq 1 "$REPEAT"); do
        j=$("$PROBE_BIN" --url "$url" --model "$model" --concurrency "$c" --duration "${TTFT_DURATION}s")
        python3 - "$p" "$c" "$rep" "$j" >> "$OUT/ttft.tsv" <<'EOF'
import json, sys
d = json.loads(sys.argv[4])
print("\t".join([sys.argv[1], sys.argv[2], sys.argv[3]] + [str(d[k]) for k in
      ("requests", "errors", "ttft_p50_us", "ttft_p99_us", "total_p50_us", "total_p99_us")]))
EOF
        log "ttft $p c=$c #$rep: $j"
      done
    done
  done
fi

# ---- long streams: CPU per relayed chunk, switchyard and nginx ----
printf 'path\trep\tstreams\tchunks_per_stream\tcpu_s\tcpu_us_per_chunk\n' > "$OUT/long.tsv"
if [ "$LONG_STREAMS" != 0 ]; then
  long_row() { # name url model pid rep
    local t0 t1 ok
    t0=$(cpu_ticks "$4")
    oha -n "$LONG_STREAMS" -c 64 -t 300s -m POST -T application/json -d "$(body "$3" true)" \
      --no-tui --output-format json "$2" > "$OUT/long-$1-r$5.json" 2>"$OUT/long-$1-r$5.err" || true
    t1=$(cpu_ticks "$4")
    ok=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(v for k,v in (d.get("statusCodeDistribution") or {}).items() if k.startswith("2")))' "$OUT/long-$1-r$5.json" 2>/dev/null || echo 0)
    # events per stream: role, LONG_CHUNKS contents, finish, [DONE]
    awk -v n="$ok" -v ch=$((LONG_CHUNKS + 3)) -v d=$((t1 - t0)) -v hz="$HZ" -v p="$1" -v r="$5" \
      'BEGIN{ c=d/hz; printf "%s\t%s\t%s\t%s\t%.2f\t%s\n", p, r, n, ch, c, (n>0 ? sprintf("%.3f", c/(n*ch)*1e6) : "nan") }' >> "$OUT/long.tsv"
    log "long stream $1 #$5: $(tail -1 "$OUT/long.tsv")"
  }
  for rep in $(seq 1 "$REPEAT"); do
    long_row switchyard "http://127.0.0.1:$P_SY/v1/chat/completions" long "$SY_PID" "$rep"
    [ -n "${NGINX_PID:-}" ] && long_row nginx "http://127.0.0.1:$P_NGINX_LONG/v1/chat/completions" fake-model "$NGINX_PID" "$rep"
  done
fi

# ---- switchyard: RSS with OPEN_STREAMS concurrent open streams ----
log "switchyard with $OPEN_STREAMS open streams"
BEFORE_OPEN_RSS=$(mem_kib "$SY_PID" VmRSS)
oha -z 20s -c "$OPEN_STREAMS" -t 300s -m POST -T application/json -d "$(body slow true)" \
  --no-tui --output-format json "http://127.0.0.1:$P_SY/v1/chat/completions" > "$OUT/open-streams.json" 2>&1 &
OHA_OPEN=$!
OPEN_RSS=0; OPEN_CONNS=0
for i in $(seq 1 15); do
  sleep 1
  r=$(mem_kib "$SY_PID" VmRSS); [ "$r" -gt "$OPEN_RSS" ] && OPEN_RSS=$r
  n=$(ss -Htn state established "( sport = :$P_SY )" 2>/dev/null | wc -l); [ "$n" -gt "$OPEN_CONNS" ] && OPEN_CONNS=$n
done
kill "$OHA_OPEN" 2>/dev/null || true; wait "$OHA_OPEN" 2>/dev/null || true
sleep 2
AFTER_OPEN_RSS=$(mem_kib "$SY_PID" VmRSS)

# ---- switchyard: reload storm under full load ----
log "reload storm: routes.yaml rewritten every 200 ms during a c=64 run"
reloads_ok() { curl -s "127.0.0.1:$P_SY/metrics" | awk '/^switchyard_config_reloads_total\{result="ok"\}/ {print $2}'; }
R0=$(reloads_ok)
(
  i=0
  while true; do
    i=$((i + 1)); routes $((i % 2)) > "$OUT/sy/.routes.yaml.tmp"; mv "$OUT/sy/.routes.yaml.tmp" "$OUT/sy/routes.yaml"; sleep 0.2
  done
) & RELOADER=$!
STORM_SECS=$((DURATION * 2))
read -r s_rps s_p50 s_p99 s_ok s_bad <<<"$(run_oha "http://127.0.0.1:$P_SY/v1/chat/completions" "$(body one false)" 64 "$STORM_SECS" "$OUT/reload-storm-plain.json")"
read -r t_rps t_p50 t_p99 t_ok t_bad <<<"$(run_oha "http://127.0.0.1:$P_SY/v1/chat/completions" "$(body one true)" 64 "$STORM_SECS" "$OUT/reload-storm-stream.json")"
kill "$RELOADER" 2>/dev/null || true; wait "$RELOADER" 2>/dev/null || true; RELOADER=""
sleep 0.5
R1=$(reloads_ok)

# ---- the floor: switchyard beside the minimal tokio + hyper proxy ----
floor_table() { # markdown, from points.tsv; nothing when no floor row was measured
  # switchyard's runtime model: `runtimes: 1` is one multi-thread runtime
  local same=floor-neutral-percore
  [ "${SY_RUNTIMES:-}" = 1 ] && same=floor-neutral-multi
  python3 - "$OUT/points.tsv" "$same" <<'EOF'
import csv, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
with open(sys.argv[1]) as f:
    for r in csv.DictReader(f, delimiter="\t"):
        rows[(r["mode"], r["path"], int(r["conc"]))].append(r)
same = sys.argv[2]
if not any(k[1].startswith("floor-") for k in rows):
    sys.exit()


def med(key, col):
    v = [float(r[col]) for r in rows.get(key, []) if r[col] not in ("nan", "")]
    return statistics.median(v) if v else float("nan")


def fmt(x, nd=0):
    return "-" if x != x else f"{x:,.{nd}f}"


paths = ["neutral", "nginx-neutral", "floor-neutral-multi", "floor-neutral-percore", "switchyard-neutral"]
concs = sorted({k[2] for k in rows})
print("## the floor: a minimal tokio + hyper proxy on the neutral upstream\n")
print("floor-neutral-* = examples/floor_proxy.rs (hyper-util's pooled client, bodies streamed "
      "through, no parsing). \"switchyard minus floor\" = switchyard-neutral's CPU per request "
      f"minus {same}'s (the same runtime model): switchyard's own work, in µs per request.\n")
print("| mode | path | conc | req/s | p50 µs | p99 µs | CPU s/1000 req | switchyard minus floor, µs/req |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for mode in ("plain", "stream"):
    for p in paths:
        for c in concs:
            key = (mode, p, c)
            if key not in rows:
                continue
            cpu = med(key, "cpu_s_per_1000")
            own = "-"
            if p == "switchyard-neutral":
                # CPU s per 1,000 requests is ms per request: x1000, µs per request
                own = fmt(1000 * (cpu - med((mode, same, c), "cpu_s_per_1000")), 1)
            print(f"| {mode} | {p} | {c} | {fmt(med(key, 'rps'))} | {fmt(med(key, 'p50_us'))} | "
                  f"{fmt(med(key, 'p99_us'))} | {fmt(cpu, 4)} | {own} |")
print()
EOF
}

# ---- peaks ----
SY_HWM=$(mem_kib "$SY_PID" VmHWM)
FAKE_HWM=$(mem_kib "$FAKE_PID" VmHWM)
NGINX_HWM=$( [ -n "${NGINX_PID:-}" ] && mem_kib "$NGINX_PID" VmHWM || echo 0)
LITELLM_HWM=$( [ -n "${LITELLM_PID:-}" ] && mem_kib "$LITELLM_PID" VmHWM || echo 0)
SY_ERRORS=$(grep -c ' ERROR ' "$OUT/switchyard.log" || true)

cat > "$OUT/extra.env" <<EOF
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
nproc=$(nproc)
mem=$(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)
cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)
loadavg=$(cut -d' ' -f1-3 /proc/loadavg)
duration=$DURATION
repeat=$REPEAT
chunks=$CHUNKS
chunk_delay=$CHUNK_DELAY
scrape_every=$SCRAPE_EVERY
oha=$(oha --version 2>/dev/null | head -1)
nginx=$(nginx -v 2>&1 | head -1)
litellm=$("$PEERS_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>/dev/null || echo -)
sy_idle_rss_kib=$SY_IDLE_RSS
sy_warm_rss_kib=$SY_WARM_RSS
sy_before_open_streams_rss_kib=$BEFORE_OPEN_RSS
sy_open_streams=$OPEN_STREAMS
sy_open_streams_conns=$OPEN_CONNS
sy_open_streams_rss_kib=$OPEN_RSS
sy_after_open_streams_rss_kib=$AFTER_OPEN_RSS
sy_hwm_kib=$SY_HWM
sy_cache_entries_sent=$CACHE_ENTRIES
sy_cache_entries_held=${CACHE_HELD:-0}
sy_cache_bytes_held=${CACHE_HELD_BYTES:-0}
sy_before_cache_rss_kib=$BEFORE_CACHE_RSS
sy_after_cache_rss_kib=$AFTER_CACHE_RSS
fake_hwm_kib=$FAKE_HWM
nginx_hwm_kib=$NGINX_HWM
litellm_hwm_kib=$LITELLM_HWM
storm_secs=$STORM_SECS
storm_reloads=$(awk -v a="${R0:-0}" -v b="${R1:-0}" 'BEGIN{print b-a}')
storm_plain="$s_rps $s_p50 $s_p99 $s_ok $s_bad"
storm_stream="$t_rps $t_p50 $t_p99 $t_ok $t_bad"
sy_error_log_lines=$SY_ERRORS
EOF
python3 "$HERE/summarize.py" "$OUT" > "$OUT/results.md"
floor_table >> "$OUT/results.md"
cat "$OUT/results.md"
log "results: $OUT/results.md"
