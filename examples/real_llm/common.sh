# Shared by run.sh and continue.sh (sourced, not run): paths, the peers venv
# (examples/peers/peers.sh),
# process cleanup, readiness polling, and the two llama-cpp-python servers.
# The caller sets LOG_PREFIX (its temp dir's name) and `set -euo pipefail`.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BIN="${SWITCHYARD_BIN:-$ROOT/target/release/switchyard}"
PEERS="$ROOT/examples/peers/peers.sh"
export PEERS_VENV="${PEERS_VENV:-$HOME/.cache/switchyard-peers/venv}"
PY="$PEERS_VENV/bin/python"
LOG_DIR="${LOG_DIR:-$(mktemp -d -t "$LOG_PREFIX.XXXXXX")}"
mkdir -p "$LOG_DIR"
export LLM_THREADS="${LLM_THREADS:-1}" LLM_VERBOSE="${LLM_VERBOSE:-False}"

[ -x "$BIN" ] || { echo "no switchyard binary at $BIN (cargo build --release, or set SWITCHYARD_BIN)" >&2; exit 1; }

PIDS=()
# shellcheck disable=SC2317  # called by the trap
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

# start_llms: the primary on :18080 and the fallback on :18081 (PRIMARY and
# FALLBACK hold their pids), both answering.
start_llms() {
  # setup once (idempotent: seconds once the venv holds everything).
  "$PEERS" setup llm >"$LOG_DIR/setup.log" 2>&1 || { echo "peers setup failed; see $LOG_DIR/setup.log" >&2; exit 1; }
  # Assemble the GGUF once: two servers starting together would race on the file.
  echo "model: $("$PEERS" gguf)"
  "$PEERS" llm 18080 >"$LOG_DIR/primary.log" 2>&1 & PRIMARY=$!; PIDS+=("$PRIMARY")
  "$PEERS" llm 18081 >"$LOG_DIR/fallback.log" 2>&1 & FALLBACK=$!; PIDS+=("$FALLBACK")
  wait_ready http://127.0.0.1:18080/v1/models "$PRIMARY" 120
  wait_ready http://127.0.0.1:18081/v1/models "$FALLBACK" 120
}
