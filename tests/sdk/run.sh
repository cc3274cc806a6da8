#!/usr/bin/env bash
# The official openai Python SDK against a real switchyard binary in front of
# two fake upstreams (tests/sdk/fake_upstream.py) and the third-party mock
# fakellm (PyPI) as an Anthropic-protocol upstream (tests/sdk/fakellm.yaml,
# tests in test_anthropic_upstream.py); the anthropic SDK and the Responses API
# as clients of switchyard's other front doors (test_front_door.py). From the repo root:
#
#   bash tests/sdk/run.sh                 # builds target/debug/switchyard (cargo build) unless SWITCHYARD_BIN is set
#   bash tests/sdk/run.sh Streaming       # only some tests (unittest names: Class or Class.test_name)
#
# Env: SWITCHYARD_BIN  a switchyard binary to test instead of building one
#      SDK_VENV        the venv with openai (default ~/.cache/switchyard-sdk-venv; made if missing)
#      PYTHON          the python that makes the venv (default python3, >= 3.9)
#      VERCEL_SDK_DIR  where the Vercel AI SDK is installed with npm (default ~/.cache/switchyard-sdk-node)
#      KEEP_LOGS=1     keep the work dir (routes.yaml, logs) after the run
#      SDK_TIMEOUT     seconds for the test run itself (default 180)
#      SDK_SUITES      which test modules run (default "openai clouds"): `openai` is
#                      test_openai_sdk.py (with the modules it imports), `clouds` is
#                      test_clouds.py (Gemini API, Vertex AI, Bedrock through
#                      tests/sdk/fake_clouds.py; it starts switchyards of its own)
#      SDK_CLOUDS_TIMEOUT  seconds for test_clouds.py (default 240)
#
# Everything listens on 127.0.0.1 ports the OS picks (port 0): the fakes write
# theirs to a file, switchyard's bound address is read from its JSON log.
# The last line of the output is "N passed, M failed" (also on a setup failure).
set -euo pipefail

OPENAI_VERSION=3.57.0 # the version examples/real_llm and the peers venv use
FAKELLM_VERSION=0.3.5 # third-party mock of the OpenAI + Anthropic APIs (the peers use it too)
ANTHROPIC_VERSION=2.17.0 # the anthropic SDK as a client of /v1/messages (test_front_door.py)
BOTOCORE_VERSION=1.44.18 # test_clouds.py: fake_clouds.py checks SigV4 with botocore's signer; self-tests use its clients
CRYPTOGRAPHY_VERSION=51.0.1 # test_clouds.py: the service-account RSA key, and the fake's JWT check
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${SDK_VENV:-$HOME/.cache/switchyard-sdk-venv}"
WORK="$(mktemp -d -t switchyard-sdk.XXXXXX)"
PIDS=()

# shellcheck disable=SC2317  # called by the trap
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "${KEEP_LOGS:-0}" = 1 ]; then
    echo "logs kept in $WORK" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# setup_failed MESSAGE [LOG]: explain, show the log, and end with the summary line CI reads.
setup_failed() {
  echo "sdk tests: setup failed: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then
    echo "--- $2 (last 40 lines) ---" >&2
    tail -n 40 "$2" >&2
  fi
  echo "0 passed, 1 failed"
  exit 1
}

# ---- the venv with the openai SDK -------------------------------------------
PY="$VENV/bin/python"
if ! "$PY" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  echo "== installing openai==$OPENAI_VERSION into $VENV"
  if [ ! -x "$PY" ]; then
    "${PYTHON:-python3}" -m venv "$VENV" >"$WORK/venv.log" 2>&1 || setup_failed "cannot create a venv at $VENV" "$WORK/venv.log"
  fi
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet "openai==$OPENAI_VERSION" >"$WORK/pip.log" 2>&1 ||
    setup_failed "pip install openai==$OPENAI_VERSION failed" "$WORK/pip.log"
fi

if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('fakellm') != '$FAKELLM_VERSION')" 2>/dev/null; then
  echo "== installing fakellm==$FAKELLM_VERSION into $VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet "fakellm==$FAKELLM_VERSION" "openai==$OPENAI_VERSION" \
    >"$WORK/pip-fakellm.log" 2>&1 || setup_failed "pip install fakellm==$FAKELLM_VERSION failed" "$WORK/pip-fakellm.log"
fi

if ! "$PY" -c "import anthropic, pydantic, sys; sys.exit(anthropic.__version__ != '$ANTHROPIC_VERSION')" 2>/dev/null; then
  echo "== installing anthropic==$ANTHROPIC_VERSION into $VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet "anthropic==$ANTHROPIC_VERSION" "openai==$OPENAI_VERSION" \
    >"$WORK/pip-anthropic.log" 2>&1 || setup_failed "pip install anthropic==$ANTHROPIC_VERSION failed" "$WORK/pip-anthropic.log"
fi

if ! "$PY" -c "import botocore, cryptography, sys; sys.exit(botocore.__version__ != '$BOTOCORE_VERSION' or cryptography.__version__ != '$CRYPTOGRAPHY_VERSION')" 2>/dev/null; then
  echo "== installing botocore==$BOTOCORE_VERSION cryptography==$CRYPTOGRAPHY_VERSION into $VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet "botocore==$BOTOCORE_VERSION" \
    "cryptography==$CRYPTOGRAPHY_VERSION" "openai==$OPENAI_VERSION" >"$WORK/pip-clouds.log" 2>&1 ||
    setup_failed "pip install botocore==$BOTOCORE_VERSION cryptography==$CRYPTOGRAPHY_VERSION failed" "$WORK/pip-clouds.log"
fi

# ---- the Vercel AI SDK (npm), in a directory of its own ------------------------
# test_front_door.py's VercelAiSdk runs tests/sdk/vercel/front_door.mjs there.
NODE_DIR="${VERCEL_SDK_DIR:-$HOME/.cache/switchyard-sdk-node}"
command -v node >/dev/null && command -v npm >/dev/null ||
  setup_failed "node and npm are needed for the Vercel AI SDK tests (.ci/run installs Debian's nodejs and npm)"
mkdir -p "$NODE_DIR"
if ! cmp -s "$HERE/vercel/package.json" "$NODE_DIR/package.json" || [ ! -d "$NODE_DIR/node_modules/ai" ]; then
  echo "== installing the Vercel AI SDK (npm) into $NODE_DIR"
  cp "$HERE/vercel/package.json" "$NODE_DIR/package.json"
  (cd "$NODE_DIR" && npm install --no-audit --no-fund --no-package-lock --silent) >"$WORK/npm.log" 2>&1 ||
    setup_failed "npm install of the Vercel AI SDK failed" "$WORK/npm.log"
fi
cp "$HERE/vercel/front_door.mjs" "$NODE_DIR/front_door.mjs"

# ---- the switchyard binary --------------------------------------------------
if [ -n "${SWITCHYARD_BIN:-}" ]; then
  BIN="$SWITCHYARD_BIN"
else
  # Always ask cargo: a no-op when the binary is current, and never a stale binary.
  echo "== cargo build (debug)"
  (cd "$ROOT" && cargo build --locked --quiet --bin switchyard) >"$WORK/build.log" 2>&1 ||
    setup_failed "cargo build failed" "$WORK/build.log"
  TARGET_DIR="$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps 2>/dev/null |
    "$PY" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')" ||
    TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
  BIN="$TARGET_DIR/debug/switchyard"
fi
[ -x "$BIN" ] || setup_failed "no switchyard binary at $BIN"
echo "== switchyard: $BIN ($("$BIN" --version 2>/dev/null || echo '?'))"

# ---- two fake upstreams on OS-chosen ports ------------------------------------
for name in primary fallback; do
  "$PY" "$HERE/fake_upstream.py" --name "$name" --port 0 --port-file "$WORK/$name.port" \
    >"$WORK/$name.log" 2>&1 &
  PIDS+=("$!")
done
for name in primary fallback; do
  for _ in $(seq 100); do [ -s "$WORK/$name.port" ] && break; sleep 0.05; done
  [ -s "$WORK/$name.port" ] || setup_failed "fake upstream $name did not start" "$WORK/$name.log"
done
PRIMARY_PORT="$(cat "$WORK/primary.port")"
FALLBACK_PORT="$(cat "$WORK/fallback.port")"

# ---- fakellm (third-party Anthropic + OpenAI mock) on an OS-chosen port -----------
# uvicorn takes a port number, not a port file: let the OS pick a free one, then
# pass it (a tiny race with other processes; a bind failure shows in the log).
MOCK_PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
FAKELLM_CONFIG="$HERE/fakellm.yaml" "$PY" -m uvicorn fakellm.server:app --host 127.0.0.1 --port "$MOCK_PORT" \
  --log-level warning --no-access-log >"$WORK/fakellm.log" 2>&1 &
MOCK_PID=$!
PIDS+=("$MOCK_PID")
"$PY" - "http://127.0.0.1:$MOCK_PORT/_fakellm/stats" "$MOCK_PID" <<'EOF' || setup_failed "fakellm did not answer on :$MOCK_PORT in 20 s" "$WORK/fakellm.log"
import os, sys, time, urllib.request
for _ in range(200):
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit(1)  # it exited (e.g. the port was taken meanwhile)
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=1) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit(1)
EOF

# ---- routes.yaml, keys, validate ------------------------------------------------
export PRIMARY_KEY="sk-sdk-primary-$RANDOM$RANDOM-from-file"
export FALLBACK_KEY="sk-sdk-fallback-$RANDOM$RANDOM-from-env"
export SDK_TEST_FALLBACK_KEY="$FALLBACK_KEY"
export SDK_TEST_ANTHROPIC_KEY="sk-ant-sdk-$RANDOM$RANDOM-dummy" # fakellm accepts any key
export SDK_TEST_LIMITED_KEY="sk-sdk-limited-$RANDOM$RANDOM-from-env" # primary-limited: a key of its own
printf '%s\n' "$PRIMARY_KEY" >"$WORK/primary.key"
mkdir -p "$WORK/config"
sed -e "s|@PRIMARY_PORT@|$PRIMARY_PORT|" -e "s|@FALLBACK_PORT@|$FALLBACK_PORT|" \
  -e "s|@PRIMARY_KEY_FILE@|$WORK/primary.key|" -e "s|@ANTHROPIC_MOCK_PORT@|$MOCK_PORT|" \
  "$HERE/routes.template.yaml" >"$WORK/config/routes.yaml"
"$BIN" validate --strict "$WORK/config/routes.yaml" >"$WORK/validate.log" 2>&1 ||
  setup_failed "switchyard validate --strict rejected the test routes.yaml" "$WORK/validate.log"
sed 's/^/   /' "$WORK/validate.log"

# ---- switchyard on an OS-chosen port ---------------------------------------------
RUST_LOG="${RUST_LOG:-info}" "$BIN" serve --config "$WORK/config/routes.yaml" --listen 127.0.0.1:0 \
  --log-format json 2>"$WORK/switchyard.log" >/dev/null &
SY_PID=$!
PIDS+=("$SY_PID")
ADDR=""
for _ in $(seq 200); do
  ADDR="$("$PY" - "$WORK/switchyard.log" <<'EOF'
import json, sys
for line in open(sys.argv[1], errors="replace"):
    try:
        fields = json.loads(line).get("fields", {})
    except ValueError:
        continue
    if fields.get("message") == "switchyard listening" and fields.get("addr"):
        print(fields["addr"])
        break
EOF
)"
  [ -n "$ADDR" ] && break
  kill -0 "$SY_PID" 2>/dev/null || setup_failed "switchyard exited at start" "$WORK/switchyard.log"
  sleep 0.05
done
[ -n "$ADDR" ] || setup_failed "switchyard did not report its address in 10 s" "$WORK/switchyard.log"
"$PY" - "http://$ADDR/healthz" <<'EOF' || setup_failed "switchyard /healthz did not answer 200" "$WORK/switchyard.log"
import sys, time, urllib.request
for _ in range(100):
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=1) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.05)
sys.exit(1)
EOF
echo "== switchyard on $ADDR, fakes: primary :$PRIMARY_PORT, fallback :$FALLBACK_PORT, fakellm (anthropic-mock) :$MOCK_PORT (work dir $WORK)"

# ---- the tests ----------------------------------------------------------------------
export SWITCHYARD_URL="http://$ADDR"
export SWITCHYARD_CONFIG="$WORK/config/routes.yaml"
export SWITCHYARD_BIN_PATH="$BIN"
export FAKE_PRIMARY_URL="http://127.0.0.1:$PRIMARY_PORT"
export FAKE_FALLBACK_URL="http://127.0.0.1:$FALLBACK_PORT"
export FAKELLM_URL="http://127.0.0.1:$MOCK_PORT"
export SDK_SUMMARY_FILE="$WORK/summary"
export VERCEL_SDK_DIR="$NODE_DIR"
export PYTHONDONTWRITEBYTECODE=1
SUITES=" ${SDK_SUITES:-openai clouds} "
status=0
if [[ "$SUITES" == *" openai "* ]]; then
  # In the background and waited for, so that INT/TERM reach the trap at once.
  timeout -k 5 "${SDK_TIMEOUT:-180}" "$PY" "$HERE/test_openai_sdk.py" -v "$@" 2>&1 &
  TESTS_PID=$!
  PIDS+=("$TESTS_PID")
  wait "$TESTS_PID" || status=$?

  if [ "$status" -ne 0 ]; then
    echo "--- switchyard log, last 40 lines ($WORK/switchyard.log) ---"
    tail -n 40 "$WORK/switchyard.log" || true
    echo "--- fakellm log, last 20 lines ($WORK/fakellm.log) ---"
    tail -n 20 "$WORK/fakellm.log" || true
    [ "$status" -eq 124 ] && echo "sdk tests: timed out after ${SDK_TIMEOUT:-180} s"
  fi
  kill -0 "$SY_PID" 2>/dev/null || { echo "sdk tests: switchyard died during the run"; status=1; }
  if [ ! -s "$SDK_SUMMARY_FILE" ]; then
    echo "0 passed, 1 failed" >"$SDK_SUMMARY_FILE"
    [ "$status" -ne 0 ] || status=1
  fi
fi

# ---- test_clouds.py: Gemini API, Vertex AI and Bedrock (fakes in fake_clouds.py) -------------
# It starts its fake and one switchyard per scenario itself (the binary: SWITCHYARD_BIN_PATH),
# and runs only those of the names given on the command line that are its own.
if [[ "$SUITES" == *" clouds "* ]]; then
  clouds_status=0
  SDK_SUMMARY_FILE="$WORK/summary-clouds" timeout -k 5 "${SDK_CLOUDS_TIMEOUT:-240}" \
    "$PY" "$HERE/test_clouds.py" -v "$@" 2>&1 &
  TESTS_PID=$!
  PIDS+=("$TESTS_PID")
  wait "$TESTS_PID" || clouds_status=$?
  [ "$clouds_status" -eq 124 ] && echo "sdk tests: test_clouds.py timed out after ${SDK_CLOUDS_TIMEOUT:-240} s"
  [ -s "$WORK/summary-clouds" ] || echo "0 passed, 1 failed" >"$WORK/summary-clouds"
  [ "$clouds_status" -eq 0 ] || status=$clouds_status
fi

# The last line: the modules' counts added up.
"$PY" - "$SDK_SUMMARY_FILE" "$WORK/summary-clouds" <<'EOF' || { echo "0 passed, 1 failed"; [ "$status" -ne 0 ] || status=1; }
import re, sys
total = {"passed": 0, "failed": 0, "skipped": 0}
seen = False
for path in sys.argv[1:]:
    try:
        line = open(path).read().strip()
    except OSError:
        continue
    seen = True
    for n, what in re.findall(r"(\d+) (passed|failed|skipped)", line):
        total[what] += int(n)
if not seen:
    sys.exit(1)
print(f"{total['passed']} passed, {total['failed']} failed" + (f", {total['skipped']} skipped" if total["skipped"] else ""))
EOF
exit "$status"
