#!/usr/bin/env bash
# The stream-continuation run: two llama-cpp-python servers with the same
# model (Gemma 3 270M), switchyard with `stream_recovery: continue`; the
# primary is SIGKILLed in the middle of a long temperature-0 stream and the
# fallback finishes it (restart and verify). Prints whether the client's text
# is byte-identical to an uninterrupted run, and the seam from the log.
#
#   cargo build --release && examples/real_llm/continue.sh     # from the repo root
#
# Env as run.sh: SWITCHYARD_BIN PEERS_VENV LOG_DIR LLM_THREADS; AFTER (8 chunks)
set -euo pipefail
LOG_PREFIX=switchyard-continue
# shellcheck source=examples/real_llm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_llms
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
