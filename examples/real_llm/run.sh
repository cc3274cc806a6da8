#!/usr/bin/env bash
# switchyard in front of two real LLM servers (Gemma 3 270M, llama-cpp-python),
# driven by the official openai SDK; the primary is SIGKILLed half-way, mid-stream.
#
#   cargo build --release && examples/real_llm/run.sh        # from the repo root
#
# Installs the LLM servers itself on first use (examples/peers/peers.sh setup llm).
# Env: SWITCHYARD_BIN (./target/release/switchyard)
#      PEERS_VENV (~/.cache/switchyard-peers/venv)  LOG_DIR (mktemp -d)
#      N (12 requests besides the mid-stream one)  LLM_THREADS (1 per server)
set -euo pipefail
LOG_PREFIX=switchyard-real-llm
# shellcheck source=examples/real_llm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_llms
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
