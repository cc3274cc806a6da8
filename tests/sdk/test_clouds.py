#!/usr/bin/env python3
"""The official `openai` SDK through a real switchyard to fakes of Google's and AWS's clouds.

Providers of `protocol: gemini` (the Gemini API), `protocol: vertex` (Vertex AI:
Gemini models and Anthropic models) and `protocol: bedrock` (Bedrock Converse),
all served by one fake process, tests/sdk/fake_clouds.py, that checks what a
real cloud checks: the Gemini API key in its header (never in the URL), Google
access tokens (a service-account JWT exchange at the key's token_uri, or the
metadata server), and every Bedrock request's SigV4 signature, re-signed with
botocore's own signer. See fake_clouds.py's docstring for what it answers.

Each scenario class starts its own switchyard (`serve --listen 127.0.0.1:0
--log-format json`, the address read from its log) with its own routes.yaml
and environment: a temp HOME, no AWS_*/GOOGLE_*/GCE_* from the parent, and
the cloud credentials the scenario is about. The fake runs once per module.

    bash tests/sdk/run.sh                         # runs this module after test_openai_sdk.py
    SDK_SUITES=clouds bash tests/sdk/run.sh       # only this module
    SDK_SUITES=clouds bash tests/sdk/run.sh GeminiApi BedrockSigV4.test_stream

    # by hand, with the SDK venv (botocore, cryptography, openai installed):
    SWITCHYARD_BIN_PATH=target/debug/switchyard ~/.cache/switchyard-sdk-venv/bin/python tests/sdk/test_clouds.py -v
    ~/.cache/switchyard-sdk-venv/bin/python tests/sdk/test_clouds.py -v FakeBedrockSelfTest FakeGoogleSelfTest

The *SelfTest classes check the fakes themselves (botocore's bedrock-runtime
and sts clients against the fake) and need no switchyard.

Env: SWITCHYARD_BIN_PATH (set by run.sh) or SWITCHYARD_BIN: the binary
(default target/debug/switchyard); KEEP_LOGS=1 keeps the work dir;
SDK_SUMMARY_FILE: where to write the closing "N passed, M failed" line.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import openai
from openai import OpenAI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
logging.getLogger("asyncio").setLevel(logging.ERROR)

REGION = "us-east-1"
PROJECT = "test-project"
LOCATION = "us-central1"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
CLIENT_KEY = "sk-client-key-clouds-unused"

GEMINI_MODEL = "gemini-2.0-flash"
QUERY_MODEL = "gemini-2.0-flash?key=x"  # a `?` in a model name must stay in its path segment
VERTEX_CLAUDE = "claude-sonnet-4@20250514"
BEDROCK_CLAUDE = "us.anthropic.claude-sonnet-4-20250514-v1:0"

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather at a place",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["location"],
            },
        },
    }
]
WEATHER_ARGS = {"location": "Paris, France", "unit": "celsius"}
TOOL_RESULT = "clouds-tool-result: 18 C, cloudy"

# A 1x1 PNG: what every image test sends, as a data: URL.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
PNG_B64 = base64.b64encode(PNG).decode()
PNG_URL = f"data:image/png;base64,{PNG_B64}"
PNG_SEEN = {"media_type": "image/png", "bytes": len(PNG), "sha256": hashlib.sha256(PNG).hexdigest()}

# Provider options every test provider gets (as tests/sdk/routes.template.yaml).
TIMEOUTS = {"timeout": "5s", "connect_timeout": "1s", "retry": {"max": 1, "backoff": "10ms"}}


def _rand(n: int = 12) -> str:
    return base64.b32encode(os.urandom(n)).decode().rstrip("=")


class Secrets:
    """Every credential of the run, made up per run (and checked against the logs at the end)."""

    def __init__(self, work: Path) -> None:
        self.gemini_keys = [f"AIzaSyFAKE{_rand(10)}{i}" for i in range(5)]
        self.static = {"name": "static", "access": f"AKIA{_rand(10)[:16]}", "secret": _rand(25), "token": None}
        self.profile = {"name": "profile", "access": f"AKIA{_rand(10)[:16]}", "secret": _rand(25), "token": None}
        self.profile_default = {"access": f"AKIA{_rand(10)[:16]}", "secret": _rand(25)}  # NOT known to the fake
        self.sts_issue = {
            "access": f"ASIA{_rand(10)[:16]}",
            "secret": _rand(25),
            "token": "IQoJb3JpZ2luFAKE" + _rand(60),
        }
        self.container_issue = {
            "access": f"ASIA{_rand(10)[:16]}",
            "secret": _rand(25),
            "token": "IQoJb3JpZ2luCONT" + _rand(60),
        }
        self.container_auth = "container-auth-" + _rand(16)
        self.bedrock_api_key = "ABSKQmVkcm9ja0FQSUtleS" + _rand(30)
        self.anthropic_key = "sk-ant-api03-FAKE" + _rand(30)
        self.web_identity_token = "eyJhbGciOiJSUzI1NiJ9.fake-web-identity." + _rand(30)
        self.role_arn = "arn:aws:iam::123456789012:role/switchyard-test"
        self.token_file = work / "web-identity-token"
        self.token_file.write_text(self.web_identity_token)  # no trailing newline: read as is

        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.sa_private_key_obj = key
        self.sa_private_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        self.sa_public_pem = (
            key.public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            .decode()
        )
        self.sa_email = f"switchyard-test@{PROJECT}.iam.gserviceaccount.com"
        self.sa_key_id = os.urandom(20).hex()

    def all(self) -> dict[str, str]:
        """name -> secret string that must never be logged."""
        out = {f"gemini key {i}": k for i, k in enumerate(self.gemini_keys)}
        for label, c in (
            ("static", self.static),
            ("profile", self.profile),
            ("profile default", self.profile_default),
            ("sts", self.sts_issue),
            ("container", self.container_issue),
        ):
            out[f"{label} AWS secret key"] = c["secret"]
            if c.get("token"):
                out[f"{label} AWS session token"] = c["token"]
        out["container auth token"] = self.container_auth
        out["bedrock API key"] = self.bedrock_api_key
        out["Anthropic API key"] = self.anthropic_key
        out["web identity token"] = self.web_identity_token
        out["SA private key (PEM)"] = self.sa_private_pem
        # A line from the middle of the PEM body: a logged key in any framing still shows.
        body = [ln for ln in self.sa_private_pem.splitlines() if ln and not ln.startswith("-----")]
        out["SA private key (a PEM line)"] = body[len(body) // 2]
        return out


# Module state: set by setUpModule.
WORK: Path = Path()
FAKE = ""  # http://127.0.0.1:PORT
FAKE_HOSTPORT = ""
SECRETS: Secrets | None = None
_FAKE_PROC: subprocess.Popen | None = None
SWITCHYARD_LOGS: list[Path] = []
# What the secrets check reads besides the logs: each switchyard's /metrics (main and admin
# listener, scraped before it stops) and every error body a client of it received.
METRICS_TEXTS: list[tuple[str, str]] = []  # (where, text)
ERROR_BODIES: list[tuple[str, int, str]] = []  # (scenario, status, body)


def switchyard_bin() -> str:
    for var in ("SWITCHYARD_BIN_PATH", "SWITCHYARD_BIN"):
        if os.environ.get(var):
            return os.path.abspath(os.environ[var])
    return str(ROOT / "target" / "debug" / "switchyard")


def setUpModule():
    global WORK, FAKE, FAKE_HOSTPORT, SECRETS, _FAKE_PROC
    WORK = Path(tempfile.mkdtemp(prefix="switchyard-clouds."))
    SECRETS = s = Secrets(WORK)
    config = {
        "gemini_keys": s.gemini_keys,
        "anthropic_keys": [s.anthropic_key],
        "aws": {"region": REGION, "credentials": [s.static, s.profile], "api_keys": [s.bedrock_api_key]},
        "sts": {"role_arn": s.role_arn, "token_file": str(s.token_file), "issue": s.sts_issue},
        "container": {"auth_token": s.container_auth, "issue": s.container_issue},
        "google": {
            "project": PROJECT,
            "location": LOCATION,
            "service_accounts": [
                {"client_email": s.sa_email, "private_key_id": s.sa_key_id, "public_key_pem": s.sa_public_pem}
            ],
            "mds_email": f"default-compute@{PROJECT}.iam.gserviceaccount.com",
        },
    }
    (WORK / "fake-clouds.json").write_text(json.dumps(config, indent=1))
    port_file = WORK / "fake-clouds.port"
    _FAKE_PROC = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "fake_clouds.py"),
            "--config",
            str(WORK / "fake-clouds.json"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        stdout=open(WORK / "fake-clouds.out", "wb"),
        stderr=open(WORK / "fake-clouds.log", "wb"),
    )
    for _ in range(200):
        if port_file.exists() and port_file.read_text().strip():
            break
        if _FAKE_PROC.poll() is not None:
            break
        time.sleep(0.05)
    if not (port_file.exists() and port_file.read_text().strip()):
        raise RuntimeError(f"fake_clouds.py did not start: {(WORK / 'fake-clouds.log').read_text()[-2000:]}")
    FAKE_HOSTPORT = f"127.0.0.1:{port_file.read_text().strip()}"
    FAKE = f"http://{FAKE_HOSTPORT}"


def tearDownModule():
    if _FAKE_PROC is not None:
        _FAKE_PROC.terminate()
        try:
            _FAKE_PROC.wait(5)
        except subprocess.TimeoutExpired:
            _FAKE_PROC.kill()
    if os.environ.get("KEEP_LOGS") == "1":
        print(f"clouds work dir kept: {WORK}", file=sys.stderr)
    else:
        shutil.rmtree(WORK, ignore_errors=True)


# ---- the fake's record -------------------------------------------------------------------


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 10.0):
    """(status, headers, body bytes), errors included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def fake_state() -> dict:
    status, _, body = http("GET", f"{FAKE}/_calls")
    assert status == 200, status
    return json.loads(body)


def count(key: str) -> int:
    """Calls the fake saw, by "service:model" (e.g. "bedrock:us.anthropic...", "oauth:token_exchange")."""
    return fake_state()["counts"].get(key, 0)


def last_call(service: str, model: str | None = None) -> dict:
    for c in reversed(fake_state()["calls"]):
        if c["service"] == service and (model is None or c["model"] == model):
            return c
    raise AssertionError(f"the fake saw no {service} call for {model}")


def rejections_since(n: int) -> list[dict]:
    return fake_state()["rejections"][n:]


def control(**change) -> dict:
    """POST /_control: e.g. control(fail={"anthropic": 529}), control(fail={"anthropic": None}),
    control(mds_expires_in=242)."""
    status, _, body = http("POST", f"{FAKE}/_control", json.dumps(change).encode())
    assert status == 200, (status, body)
    return json.loads(body)


def sigv4_access_key(call: dict) -> str:
    m = re.search(r"Credential=([^/]+)/", call["headers"].get("authorization", ""))
    assert m, call["headers"].get("authorization", "")[:40]
    return m.group(1)


# ---- routes.yaml and a switchyard process ---------------------------------------------------


def to_yaml(value, indent: int = 0) -> str:
    """A tiny YAML writer: block maps, flow lists of scalars, JSON-quoted strings."""
    pad = "  " * indent
    lines = []
    for k, v in value.items():
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines.append(to_yaml(v, indent + 1))
        elif isinstance(v, list):
            lines.append(f"{pad}{k}: [{', '.join(scalar(x) for x in v)}]")
        else:
            lines.append(f"{pad}{k}: {scalar(v)}")
    return "\n".join(lines)


def scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(str(v))


def gemini_provider(key_env: str) -> dict:
    return {"protocol": "gemini", "base_url": f"{FAKE}/v1beta", "api_key_env": key_env, **TIMEOUTS}


def vertex_provider(**extra) -> dict:
    return {
        "protocol": "vertex",
        "project": PROJECT,
        "location": LOCATION,
        "base_url": f"{FAKE}/v1/projects/{PROJECT}/locations/{LOCATION}",
        **extra,
        **TIMEOUTS,
    }


def bedrock_provider(**extra) -> dict:
    return {"protocol": "bedrock", "region": REGION, "base_url": FAKE, **extra, **TIMEOUTS}


class Switchyard:
    """One switchyard process with its own routes.yaml, environment and log."""

    def __init__(
        self,
        name: str,
        providers: dict,
        targets: dict,
        tasks: dict,
        env: dict | None = None,
        routes_text: str | None = None,
    ) -> None:
        self.name = name
        self.dir = WORK / name
        self.home = self.dir / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        routes = {
            "version": 1,
            "listen": "127.0.0.1:0",
            "providers": providers,
            "targets": targets,
            "tasks": tasks,
            # Failures are scripted on purpose: keep every target healthy.
            "health": {"degraded_after": 1000, "down_after": 1000, "min_requests": 1000, "probe": {"interval": 0}},
        }
        self.config = self.dir / "routes.yaml"
        if routes_text is None:
            routes_text = f"# test_clouds.py scenario {name}\n" + to_yaml(routes) + "\n"
        self.config.write_text(routes_text)
        self.log = self.dir / "switchyard.log"
        SWITCHYARD_LOGS.append(self.log)
        bin_ = switchyard_bin()
        if not os.access(bin_, os.X_OK):
            raise RuntimeError(f"no switchyard binary at {bin_} (set SWITCHYARD_BIN_PATH, or run tests/sdk/run.sh)")
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(
                ("AWS_", "GOOGLE_", "GCE_", "CLOUDSDK_", "GEMINI_", "BEDROCK_", "SWITCHYARD_", "OTEL_", "SDK_TEST_")
            )
            and k not in ("PRIMARY_KEY", "FALLBACK_KEY")
        }
        self.env.update({"HOME": str(self.home), "RUST_LOG": "info,switchyard=debug", "NO_COLOR": "1"})
        self.env.update(env or {})
        self.proc = subprocess.Popen(
            [
                bin_,
                "serve",
                "--config",
                str(self.config),
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"),
            cwd=self.dir,
        )
        self.addr, self.admin = self._wait_addr()

    def _wait_addr(self) -> tuple[str, str | None]:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                try:
                    fields = json.loads(line).get("fields", {})
                except ValueError:
                    continue
                if fields.get("message") == "switchyard listening" and fields.get("addr"):
                    # `admin` is logged as Debug of an Option: "Some(127.0.0.1:PORT)" or "None".
                    m = re.search(r"(\d+\.\d+\.\d+\.\d+:\d+)", str(fields.get("admin") or ""))
                    return fields["addr"], m.group(1) if m else None
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(
                    f"switchyard ({self.name}) exited at start:\n{self.tail()}\n--- routes.yaml\n"
                    f"{self.config.read_text()}"
                )
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"switchyard ({self.name}) did not report its address in 15 s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def client(self, **kw) -> OpenAI:
        kw.setdefault("timeout", 15.0)
        kw.setdefault("max_retries", 0)

        def keep_error_body(response) -> None:
            if response.status_code >= 400:
                response.read()
                ERROR_BODIES.append((self.name, response.status_code, response.text))

        kw.setdefault("http_client", openai.DefaultHttpxClient(event_hooks={"response": [keep_error_body]}))
        return OpenAI(base_url=f"http://{self.addr}/v1", api_key=CLIENT_KEY, **kw)

    def scrape_metrics(self) -> None:
        """/metrics of both listeners into METRICS_TEXTS (for the secrets check)."""
        for where, addr in (("main", self.addr), ("admin", self.admin)):
            if not addr:
                continue
            status, _, body = http("GET", f"http://{addr}/metrics", timeout=5)
            text = body.decode(errors="replace")
            (self.dir / f"metrics.{where}.txt").write_text(text)
            METRICS_TEXTS.append((f"{self.name} {where} /metrics ({status})", text))

    def stop(self) -> None:
        if self.proc.poll() is None and getattr(self, "addr", None):
            try:
                self.scrape_metrics()
            except OSError as e:
                METRICS_TEXTS.append((f"{self.name}: scrape failed: {e}", ""))
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Scenario(unittest.TestCase):
    """A test class with one switchyard of its own (`sy`), started in setUpClass."""

    sy: Switchyard
    baseline: dict  # the fake's record just before this class's switchyard started

    @classmethod
    def start(
        cls,
        providers: dict | None = None,
        targets: dict | None = None,
        tasks: dict | None = None,
        env: dict | None = None,
        routes_text: str | None = None,
    ) -> None:
        cls.baseline = fake_state()
        cls.sy = Switchyard(cls.__name__, providers or {}, targets or {}, tasks or {}, env, routes_text)

    @classmethod
    def since_start(cls, key: str) -> int:
        """Calls the fake saw for `key` since this class's switchyard started (token fetches
        at start included)."""
        return count(key) - cls.baseline["counts"].get(key, 0)

    @classmethod
    def calls_since_start(cls) -> list[dict]:
        return fake_state()["calls"][len(cls.baseline["calls"]) :]

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "sy", None) is not None:
            cls.sy.stop()

    def setUp(self):
        self.rejections_before = len(fake_state()["rejections"])

    def explain(self) -> str:
        """What to print when a test fails: the fake's rejections and switchyard's log."""
        rej = rejections_since(self.rejections_before)
        return (
            f"\n--- fake rejections during this test: {json.dumps(rej, indent=1)[:3000]}"
            f"\n--- switchyard log (last 25 lines):\n{self.sy.tail(25)}"
        )

    def chat(self, model: str, messages=None, **kw):
        try:
            return self.sy.client().chat.completions.create(
                model=model, messages=messages or [{"role": "user", "content": "hi"}], **kw
            )
        except openai.APIError as e:
            self.fail(f"{model}: {type(e).__name__}: {e}{self.explain()}")

    def stream_text(self, model: str, messages=None, **kw) -> tuple[str, list]:
        chunks = []
        try:
            with self.sy.client().chat.completions.create(
                model=model, messages=messages or [{"role": "user", "content": "hi"}], stream=True, **kw
            ) as stream:
                for chunk in stream:
                    chunks.append(chunk)
        except openai.APIError as e:
            self.fail(f"{model} (stream): {type(e).__name__}: {e}{self.explain()}")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks

    def assertStreamShape(self, chunks):
        self.assertGreater(len(chunks), 1)
        self.assertTrue(all(c.object == "chat.completion.chunk" for c in chunks))
        self.assertEqual(len({c.id for c in chunks}), 1, "every chunk carries the same id")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, ["stop"])

    def assertText(self, r, text: str):
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.content, text, self.explain())
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertFalse(r.choices[0].message.tool_calls)
        self.assertIsNotNone(r.usage)
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertGreater(r.usage.completion_tokens, 0)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def tool_round_trip(self, model: str, final_text: str) -> list:
        """Tool call, then the tool's result sent back; returns the first answer's tool calls."""
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = self.chat(model, messages, tools=WEATHER)
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls", self.explain())
        calls = choice.message.tool_calls or []
        self.assertEqual(len(calls), 1, calls)
        self.assertEqual(calls[0].type, "function")
        self.assertTrue(calls[0].id)
        self.assertEqual(calls[0].function.name, "get_weather")
        self.assertEqual(json.loads(calls[0].function.arguments), WEATHER_ARGS)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": TOOL_RESULT})
        r2 = self.chat(model, messages, tools=WEATHER)
        self.assertEqual(r2.choices[0].message.content, final_text, self.explain())
        self.assertEqual(r2.choices[0].finish_reason, "stop")
        return calls


# ---- Gemini API ---------------------------------------------------------------------------------


class GeminiApi(Scenario):
    @classmethod
    def setUpClass(cls):
        k = SECRETS.gemini_keys
        cls.start(
            providers={
                "gem": gemini_provider("GEMINI_KEY"),
                # Each exhausted target on a provider (and key) of its own: a 429 cools its key down.
                "gem-x1": gemini_provider("GEMINI_KEY_X1"),
                "gem-x2": gemini_provider("GEMINI_KEY_X2"),
                "gem-x3": gemini_provider("GEMINI_KEY_X3"),
                "gem-sq": gemini_provider("GEMINI_KEY_SQ"),
            },
            targets={
                "gem-flash": {"provider": "gem", "model": GEMINI_MODEL, "capabilities": ["tools", "json_mode"]},
                "gem-exhausted": {"provider": "gem-x1", "model": "gemini-exhausted-1"},
                "gem-exhausted-2": {"provider": "gem-x2", "model": "gemini-exhausted-2"},
                "gem-exhausted-3": {"provider": "gem-x3", "model": "gemini-exhausted-3"},
                "gem-streamquota": {"provider": "gem-sq", "model": "gemini-streamquota"},
                # A model name that would smuggle a query string if it left its path segment.
                "gem-query-in-name": {"provider": "gem", "model": QUERY_MODEL},
            },
            tasks={
                "gem": {"chain": ["gem-flash"]},
                "gem-failover": {"chain": ["gem-exhausted", "gem-flash"]},
                "gem-all-exhausted": {"chain": ["gem-exhausted-2", "gem-exhausted-3"]},
                "gem-streamquota": {"chain": ["gem-streamquota"]},
                "gem-query-in-name": {"chain": ["gem-query-in-name"]},
            },
            env={
                "GEMINI_KEY": k[0],
                "GEMINI_KEY_X1": k[1],
                "GEMINI_KEY_X2": k[2],
                "GEMINI_KEY_X3": k[3],
                "GEMINI_KEY_SQ": k[4],
            },
        )

    def test_chat(self):
        r = self.chat(
            "gem",
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
            temperature=0.2,
            max_tokens=50,
        )
        self.assertText(r, f"Hello from gemini {GEMINI_MODEL}")
        self.assertEqual(r.model, GEMINI_MODEL)
        call = last_call("gemini", GEMINI_MODEL)
        self.assertEqual(call["path"], f"/v1beta/models/{GEMINI_MODEL}:generateContent")
        self.assertEqual(call["headers"].get("x-goog-api-key"), SECRETS.gemini_keys[0])
        self.assertNotIn("key=", call["path"])
        self.assertNotIn(CLIENT_KEY, json.dumps(call))
        body = call["body"]
        self.assertEqual(body["contents"], [{"role": "user", "parts": [{"text": "hi there"}]}])
        self.assertEqual(body["systemInstruction"]["parts"], [{"text": "be brief"}])
        self.assertEqual(body["generationConfig"].get("temperature"), 0.2)
        self.assertEqual(body["generationConfig"].get("maxOutputTokens"), 50)

    def test_stream(self):
        text, chunks = self.stream_text("gem")
        self.assertEqual(text, f"Hello from gemini {GEMINI_MODEL}", self.explain())
        self.assertStreamShape(chunks)
        call = last_call("gemini", GEMINI_MODEL)
        self.assertEqual(call["path"], f"/v1beta/models/{GEMINI_MODEL}:streamGenerateContent?alt=sse")

    def test_tool_round_trip(self):
        calls = self.tool_round_trip("gem", f"Got the get_weather result from gemini {GEMINI_MODEL}")
        body = last_call("gemini", GEMINI_MODEL)["body"]
        decl = body["tools"][0]["functionDeclarations"][0]
        self.assertEqual(decl["name"], "get_weather")
        # The fake checked that the functionResponse names the call; the result text must be in it.
        fr = [p["functionResponse"] for c in body["contents"] for p in c["parts"] if "functionResponse" in p]
        self.assertEqual(len(fr), 1, body["contents"])
        self.assertEqual(fr[0]["name"], "get_weather")
        self.assertIn(TOOL_RESULT, json.dumps(fr[0]["response"]))
        fc = [p["functionCall"] for c in body["contents"] for p in c["parts"] if "functionCall" in p]
        self.assertEqual(fc[0]["name"], "get_weather")
        self.assertEqual(fc[0]["args"], WEATHER_ARGS)
        self.assertNotIn(calls[0].id, [None, ""])

    def test_resource_exhausted_fails_over(self):
        x_before, ok_before = count("gemini:gemini-exhausted-1"), count(f"gemini:{GEMINI_MODEL}")
        raw = self.sy.client().chat.completions.with_raw_response.create(
            model="gem-failover", messages=[{"role": "user", "content": "hi"}]
        )
        r = raw.parse()
        self.assertEqual(r.choices[0].message.content, f"Hello from gemini {GEMINI_MODEL}", self.explain())
        self.assertEqual(raw.headers.get("x-switchyard-target"), "gem-flash")
        self.assertEqual(count("gemini:gemini-exhausted-1") - x_before, 1)
        self.assertEqual(count(f"gemini:{GEMINI_MODEL}") - ok_before, 1)

    def test_all_exhausted_is_a_429_with_retry_after(self):
        before = count("gemini:gemini-exhausted-2") + count("gemini:gemini-exhausted-3")
        with self.assertRaises(openai.RateLimitError) as cm:
            self.sy.client().chat.completions.create(
                model="gem-all-exhausted", messages=[{"role": "user", "content": "hi"}]
            )
        e = cm.exception
        self.assertEqual(e.status_code, 429)
        retry_after = e.response.headers.get("retry-after")
        self.assertIsNotNone(retry_after, dict(e.response.headers))
        self.assertGreaterEqual(int(retry_after), 1)
        self.assertEqual(count("gemini:gemini-exhausted-2") + count("gemini:gemini-exhausted-3") - before, 2)

    def test_in_stream_resource_exhausted_is_a_429_with_its_retry_info(self):
        """A 200 stream whose first event is RESOURCE_EXHAUSTED with RetryInfo 23s: nothing was
        sent yet, so the only target's refusal is the client's 429, Retry-After the 23 s Google
        advertised (not a default)."""
        before = count("gemini:gemini-streamquota")
        t0 = time.monotonic()
        with self.assertRaises(openai.RateLimitError) as cm:
            with self.sy.client().chat.completions.create(
                model="gem-streamquota", messages=[{"role": "user", "content": "hi"}], stream=True
            ) as stream:
                for _ in stream:
                    pass
        self.assertLess(time.monotonic() - t0, 10, "a quota refusal is answered at once, never waited out")
        e = cm.exception
        self.assertEqual(e.status_code, 429, self.explain())
        self.assertEqual(e.response.headers.get("retry-after"), "23", dict(e.response.headers))
        self.assertGreaterEqual(count("gemini:gemini-streamquota") - before, 1, "the fake was called")
        call = last_call("gemini", "gemini-streamquota")
        self.assertEqual(call["path"], "/v1beta/models/gemini-streamquota:streamGenerateContent?alt=sse")

    def test_query_characters_in_a_model_name_stay_in_its_path_segment(self):
        """`?key=x` in a model name is percent-encoded into the path segment: the fake gets the
        whole name as the model and no query (it answers 403 to any `key=` query)."""
        r = self.chat("gem-query-in-name")
        self.assertText(r, f"Hello from gemini {QUERY_MODEL}")
        _, chunks = self.stream_text("gem-query-in-name")
        self.assertStreamShape(chunks)
        calls = [c for c in self.calls_since_start() if c["service"] == "gemini" and c["model"] == QUERY_MODEL]
        self.assertEqual(len(calls), 2, self.explain())
        for call, op, query in zip(calls, ("generateContent", "streamGenerateContent"), ("", "alt=sse")):
            url = urllib.parse.urlsplit(call["path"])
            self.assertEqual(url.query, query, call["path"])
            self.assertEqual(url.fragment, "", call["path"])
            self.assertEqual(url.path.count("/"), 3, f"one segment for the model: {call['path']}")
            segment = url.path.rsplit("/", 1)[1]
            self.assertEqual(urllib.parse.unquote(segment), f"{QUERY_MODEL}:{op}", call["path"])
            self.assertNotIn("?key", call["path"])


# ---- Vertex AI ---------------------------------------------------------------------------------------


def sa_key_file() -> Path:
    """The service-account key file (token_uri: the fake's /token), written once."""
    s = SECRETS
    sa = WORK / "sa.json"
    sa.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": PROJECT,
                "private_key_id": s.sa_key_id,
                "private_key": s.sa_private_pem,
                "client_email": s.sa_email,
                "client_id": "113456789012345678901",
                "auth_uri": "https://accounts.google.com/o/oauth2/auth",
                "token_uri": f"{FAKE}/token",
                "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
                "client_x509_cert_url": f"https://www.googleapis.com/robot/v1/metadata/x509/{s.sa_email}",
                "universe_domain": "googleapis.com",
            },
            indent=2,
        )
    )
    os.chmod(sa, 0o600)
    return sa


class VertexServiceAccount(Scenario):
    """Vertex with a service-account key file (token_uri: the fake's /token)."""

    @classmethod
    def setUpClass(cls):
        sa = sa_key_file()
        cls.start(
            providers={"vtx": vertex_provider(credentials_file=str(sa))},
            targets={
                "vtx-gemini": {"provider": "vtx", "model": GEMINI_MODEL, "capabilities": ["tools"]},
                "vtx-claude": {"provider": "vtx", "model": VERTEX_CLAUDE, "capabilities": ["tools"]},
            },
            tasks={"vtx-gemini": {"chain": ["vtx-gemini"]}, "vtx-claude": {"chain": ["vtx-claude"]}},
            # A dead metadata server: the key file must be what is used.
            env={"GCE_METADATA_HOST": "127.0.0.1:9"},
        )

    def vertex_path(self, publisher: str, model: str, method: str) -> str:
        return f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/{publisher}/models/{model}:{method}"

    def test_gemini_chat(self):
        r = self.chat("vtx-gemini")
        self.assertText(r, f"Hello from vertex {GEMINI_MODEL}")
        call = last_call("vertex", GEMINI_MODEL)
        self.assertEqual(
            urllib.parse.unquote(call["path"]), self.vertex_path("google", GEMINI_MODEL, "generateContent")
        )
        self.assertTrue(call["headers"]["authorization"].startswith("Bearer "))
        self.assertTrue(call["auth"].endswith(SECRETS.sa_email), call["auth"])
        self.assertEqual(call["body"]["contents"], [{"role": "user", "parts": [{"text": "hi"}]}])

    def test_gemini_stream(self):
        text, chunks = self.stream_text("vtx-gemini")
        self.assertEqual(text, f"Hello from vertex {GEMINI_MODEL}", self.explain())
        self.assertStreamShape(chunks)
        call = last_call("vertex", GEMINI_MODEL)
        self.assertEqual(
            urllib.parse.unquote(call["path"]),
            self.vertex_path("google", GEMINI_MODEL, "streamGenerateContent") + "?alt=sse",
        )

    def test_gemini_tool_round_trip(self):
        self.tool_round_trip("vtx-gemini", f"Got the get_weather result from vertex {GEMINI_MODEL}")

    def test_claude_chat(self):
        r = self.chat("vtx-claude", max_tokens=64)
        self.assertText(r, f"Hello from vertex-anthropic {VERTEX_CLAUDE}")
        call = last_call("vertex-anthropic", VERTEX_CLAUDE)
        self.assertEqual(urllib.parse.unquote(call["path"]), self.vertex_path("anthropic", VERTEX_CLAUDE, "rawPredict"))
        self.assertEqual(call["body"]["anthropic_version"], "vertex-2023-10-16")
        self.assertNotIn("model", call["body"])
        self.assertEqual(call["body"]["max_tokens"], 64)

    def test_claude_stream(self):
        text, chunks = self.stream_text("vtx-claude")
        self.assertEqual(text, f"Hello from vertex-anthropic {VERTEX_CLAUDE}", self.explain())
        self.assertStreamShape(chunks)
        call = last_call("vertex-anthropic", VERTEX_CLAUDE)
        self.assertEqual(
            urllib.parse.unquote(call["path"]), self.vertex_path("anthropic", VERTEX_CLAUDE, "streamRawPredict")
        )
        self.assertIs(call["body"].get("stream"), True)

    def test_claude_tool_round_trip(self):
        self.tool_round_trip("vtx-claude", f"Got the tool result from vertex-anthropic {VERTEX_CLAUDE}")

    def test_token_is_cached(self):
        for _ in range(3):
            self.chat("vtx-gemini")
        self.chat("vtx-claude", max_tokens=16)
        exchanges = self.since_start("oauth:token_exchange")
        vertex = [c for c in self.calls_since_start() if c["service"] in ("vertex", "vertex-anthropic")]
        self.assertGreaterEqual(len(vertex), 4)
        bearers = {c["headers"].get("authorization") for c in vertex}
        auths = {c["auth"] for c in vertex}
        self.assertEqual(len(bearers), 1, f"one cached access token for every Vertex call, saw {len(bearers)}")
        if auths == {f"sa:{SECRETS.sa_email}"}:
            self.assertEqual(exchanges, 1, "three requests (and more), one JWT exchange at token_uri")
        else:
            # A self-signed JWT (google-cloud-auth's way for a key file): no exchange at all.
            self.assertEqual(auths, {f"self-signed:{SECRETS.sa_email}"})
            self.assertEqual(exchanges, 0)


class VertexMetadataServer(Scenario):
    """Vertex with Application Default Credentials from the metadata server (GCE_METADATA_HOST)."""

    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"vtx-mds": vertex_provider()},
            targets={
                "vtx-mds-gemini": {"provider": "vtx-mds", "model": "gemini-2.0-flash-001"},
                "vtx-mds-claude": {"provider": "vtx-mds", "model": "claude-3-5-haiku@20241022"},
            },
            tasks={"vtx-mds": {"chain": ["vtx-mds-gemini"]}, "vtx-mds-claude": {"chain": ["vtx-mds-claude"]}},
            env={"GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    def test_chat_and_stream_with_a_metadata_token(self):
        self.assertText(self.chat("vtx-mds"), "Hello from vertex gemini-2.0-flash-001")
        text, chunks = self.stream_text("vtx-mds")
        self.assertEqual(text, "Hello from vertex gemini-2.0-flash-001", self.explain())
        self.assertText(
            self.chat("vtx-mds-claude", max_tokens=32), "Hello from vertex-anthropic claude-3-5-haiku@20241022"
        )
        call = last_call("vertex", "gemini-2.0-flash-001")
        self.assertEqual(call["auth"], "mds")
        self.assertEqual(last_call("vertex-anthropic", "claude-3-5-haiku@20241022")["auth"], "mds")
        self.assertEqual(self.since_start("mds:token"), 1, "one metadata token for three requests (cached)")
        self.assertEqual(self.since_start("oauth:token_exchange"), 0)
        mds = last_call("mds", "token")
        self.assertEqual(mds["headers"].get("metadata-flavor"), "Google")


class VertexMetadataServerHeals(Scenario):
    """The metadata server answers the first token request with garbage (200, no JSON), then
    heals. Google's library gives up on a credential after such an answer; switchyard drops it
    and makes it anew after RETRY_AFTER_FAILURE (2 s), so Vertex recovers with no restart."""

    MODEL = "gemini-2.0-flash-heals"

    @classmethod
    def setUpClass(cls):
        control(mds_garbage=1)  # the library is built on first use: the first request meets it
        cls.start(
            providers={"vtx-heal": vertex_provider()},
            targets={"vtx-heal-gemini": {"provider": "vtx-heal", "model": cls.MODEL}},
            tasks={"vtx-heal": {"chain": ["vtx-heal-gemini"]}},
            env={"GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(mds_garbage=0)

    def test_one_garbage_token_answer_heals_without_a_restart(self):
        client = self.sy.client(timeout=10.0)
        ask = dict(model="vtx-heal", messages=[{"role": "user", "content": "hi"}])
        t0 = time.monotonic()
        with self.assertRaises(openai.APIStatusError) as cm:
            client.chat.completions.create(**ask)
        self.assertGreaterEqual(cm.exception.status_code, 500, self.explain())
        self.assertLess(time.monotonic() - t0, 5, "a garbage answer fails at once")
        self.assertEqual(self.since_start("mds:token-garbage"), 1, self.explain())
        self.assertEqual(self.since_start(f"vertex:{self.MODEL}"), 0, "no call without a token")
        # The rebuild comes 2 s after the failure: poll, bounded at 10 s (never until a restart).
        deadline = t0 + 10
        failures = 1
        while True:
            time.sleep(0.5)
            try:
                r = client.chat.completions.create(**ask)
                break
            except openai.APIStatusError as e:
                failures += 1
                if time.monotonic() > deadline:
                    self.fail(f"still {e.status_code} {time.monotonic() - t0:.1f} s after the garbage{self.explain()}")
        healed = time.monotonic() - t0
        self.assertText(r, f"Hello from vertex {self.MODEL}")
        self.assertIsNone(self.sy.proc.poll(), "the same switchyard, no restart")
        self.assertEqual(last_call("vertex", self.MODEL)["auth"], "mds")
        self.assertGreaterEqual(self.since_start("mds:token"), 1, "a good token was fetched after the garbage")
        self.assertLess(healed, 10, f"healed after {healed:.1f} s and {failures} failed requests")


class VertexRefusedTokenIsFetchedAnew(Scenario):
    """Google refuses a cached access token before it expires (revoked, rotated): the request
    it failed is the only one; the next fetches a new token instead of sending the refused one
    until its hour is up."""

    MODEL = "gemini-2.0-flash-refused"

    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"vtx-ref": vertex_provider()},
            targets={"vtx-ref-gemini": {"provider": "vtx-ref", "model": cls.MODEL}},
            tasks={"vtx-ref": {"chain": ["vtx-ref-gemini"]}},
            env={"GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    def test_a_refused_token_is_never_sent_again(self):
        self.assertText(self.chat("vtx-ref"), f"Hello from vertex {self.MODEL}")
        first = last_call("vertex", self.MODEL)["headers"]["authorization"]
        control(revoke_google_tokens=True)
        client = self.sy.client(timeout=10.0)
        ask = dict(model="vtx-ref", messages=[{"role": "user", "content": "hi"}])
        with self.assertRaises(openai.APIStatusError):
            client.chat.completions.create(**ask)
        self.assertText(self.chat("vtx-ref"), f"Hello from vertex {self.MODEL}")
        last = last_call("vertex", self.MODEL)["headers"]["authorization"]
        self.assertNotEqual(last, first, "a new token after the refusal" + self.explain())


class VertexMetadataServerHangHeals(Scenario):
    """The metadata server HANGS on the first token request (reads it, never answers; the fake
    holds it 60 s) and then heals, while the Vertex provider's own `timeout` (3 s) is shorter
    than switchyard's bound on one token fetch (5 s). The first request is cut by its 3 s and
    fails over to a Gemini API backup; the stuck fetch must still be judged at 5 s and its
    source dropped, so Vertex recovers without a restart. Before 9f9a1a4 the fetch was bounded
    inside the request: cut at 3 s, it was never judged, every later request waited on the same
    stuck fetch and was cut too, and Vertex never came back (not within the 60 s hang)."""

    MODEL = "gemini-2.0-flash-hang-heals"

    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={
                # No retry: one attempt, one fetch per request, so the timeline is the one below.
                "vtx-hang": {**vertex_provider(), "timeout": "3s", "retry": {"max": 0}},
                "gem-hang-backup": gemini_provider("GEMINI_KEY"),
            },
            targets={
                "vtx-hang-gemini": {"provider": "vtx-hang", "model": cls.MODEL},
                "gem-hang-backup-flash": {"provider": "gem-hang-backup", "model": GEMINI_MODEL},
            },
            tasks={"vtx-hang": {"chain": ["vtx-hang-gemini", "gem-hang-backup-flash"]}},
            env={"GCE_METADATA_HOST": FAKE_HOSTPORT, "GEMINI_KEY": SECRETS.gemini_keys[1]},
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(mds_hang=0)

    def ask(self, client) -> tuple[str | None, str | None]:
        """(the target that answered, its text)."""
        raw = client.chat.completions.with_raw_response.create(
            model="vtx-hang", messages=[{"role": "user", "content": "hi"}]
        )
        return raw.headers.get("x-switchyard-target"), raw.parse().choices[0].message.content

    def test_a_hung_token_fetch_cut_by_a_shorter_timeout_heals_without_a_restart(self):
        client = self.sy.client(timeout=10.0)
        # Set now, not before the start: the library is built on first use, so this
        # request's token fetch is the one that hangs (and only it: then it is healed).
        control(mds_hang=1)
        t0 = time.monotonic()
        try:
            first = self.ask(client)
        except openai.APIError as e:
            self.fail(f"the first request must fail over to the backup: {type(e).__name__}: {e}{self.explain()}")
        took = time.monotonic() - t0
        self.assertEqual(first, ("gem-hang-backup-flash", f"Hello from gemini {GEMINI_MODEL}"), self.explain())
        self.assertEqual(self.since_start("mds:token-hang"), 1, self.explain())
        self.assertEqual(control()["mds_hang"], 0, "the hang was used up: the metadata server is healed")
        self.assertEqual(self.since_start(f"vertex:{self.MODEL}"), 0, "no call without a token")
        # Cut by the provider's 3 s, not the 5 s fetch bound: the case the fix is about.
        self.assertGreaterEqual(took, 2.5, f"the hung fetch ended the first request after {took:.1f} s")
        self.assertLess(took, 5, f"the first request took {took:.1f} s: not cut by the provider's 3 s")
        # The stuck fetch is judged 5 s after it began (its own bound) and its source dropped;
        # 2 s later (RETRY_AFTER_FAILURE) the next request makes it anew, which gets a token
        # from the healed metadata server: ~7 s after t0. Polls in between fail over (each at
        # most 3 s). 15 s leaves room for a loaded machine and is still far inside the 60 s
        # the fake holds the hung request, so only switchyard's own recovery can pass it.
        deadline = t0 + 15
        polls = []
        while True:
            time.sleep(0.5)
            try:
                got = self.ask(client)
            except openai.APIError as e:
                got = (f"error {type(e).__name__}", str(e)[:200])
            polls.append((round(time.monotonic() - t0, 1), got[0]))
            if got[0] == "vtx-hang-gemini":
                break
            if time.monotonic() > deadline:
                since = time.monotonic() - t0
                self.fail(f"Vertex not back {since:.1f} s after the hang; polls {polls}{self.explain()}")
        healed = time.monotonic() - t0
        self.assertEqual(got[1], f"Hello from vertex {self.MODEL}", self.explain())
        self.assertIsNone(self.sy.proc.poll(), "the same switchyard, no restart")
        self.assertEqual(last_call("vertex", self.MODEL)["auth"], "mds", "signed with a metadata-issued token")
        self.assertGreaterEqual(self.since_start("mds:token"), 1, "a good token was fetched after the hang")
        self.assertLess(healed, 15, f"healed after {healed:.1f} s; polls {polls}")


# ---- Bedrock --------------------------------------------------------------------------------------


def static_env() -> dict:
    s = SECRETS.static
    return {
        "AWS_ACCESS_KEY_ID": s["access"],
        "AWS_SECRET_ACCESS_KEY": s["secret"],
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class BedrockSigV4(Scenario):
    """Bedrock with static keys from the environment, signed with SigV4; failures and failover."""

    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"brk": bedrock_provider(), "gem": gemini_provider("GEMINI_KEY")},
            targets={
                "brk-claude": {"provider": "brk", "model": BEDROCK_CLAUDE, "capabilities": ["tools"]},
                "brk-throttle": {"provider": "brk", "model": "anthropic.claude-throttle-v1:0"},
                "brk-unavailable": {"provider": "brk", "model": "anthropic.claude-unavailable-v1:0"},
                "brk-cut": {"provider": "brk", "model": "anthropic.claude-cut-v1:0"},
                "brk-toolong": {"provider": "brk", "model": "anthropic.claude-toolong-v1:0"},
                "gem-flash": {"provider": "gem", "model": GEMINI_MODEL, "capabilities": ["tools"]},
            },
            tasks={
                "brk": {"chain": ["brk-claude"]},
                "brk-throttled": {"chain": ["brk-throttle", "gem-flash"]},
                "brk-unavailable": {"chain": ["brk-unavailable", "gem-flash"]},
                "brk-cut": {"chain": ["brk-cut", "gem-flash"], "stream_recovery": {"mode": "continue"}},
                "brk-toolong": {"chain": ["brk-toolong", "gem-flash"]},
            },
            env={**static_env(), "GEMINI_KEY": SECRETS.gemini_keys[4]},
        )

    def test_chat(self):
        r = self.chat(
            "brk",
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=40,
            temperature=0.5,
        )
        self.assertText(r, f"Hello from bedrock {BEDROCK_CLAUDE}")
        call = last_call("bedrock", BEDROCK_CLAUDE)
        self.assertEqual(call["auth"], "sigv4:static")
        self.assertEqual(call["path"], "/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse")
        body = call["body"]
        self.assertEqual(body["messages"], [{"role": "user", "content": [{"text": "hi"}]}])
        self.assertEqual(body["system"], [{"text": "be brief"}])
        self.assertEqual(body["inferenceConfig"].get("maxTokens"), 40)
        self.assertEqual(body["inferenceConfig"].get("temperature"), 0.5)
        self.assertNotIn("x-amz-security-token", call["headers"])

    def test_stream(self):
        text, chunks = self.stream_text("brk")
        self.assertEqual(text, f"Hello from bedrock {BEDROCK_CLAUDE}", self.explain())
        self.assertStreamShape(chunks)
        self.assertEqual(
            last_call("bedrock", BEDROCK_CLAUDE)["path"],
            "/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse-stream",
        )

    def test_tool_round_trip(self):
        self.tool_round_trip("brk", f"Got the tool result from bedrock {BEDROCK_CLAUDE}")
        body = last_call("bedrock", BEDROCK_CLAUDE)["body"]
        spec = body["toolConfig"]["tools"][0]["toolSpec"]
        self.assertEqual(spec["name"], "get_weather")
        self.assertEqual(spec["inputSchema"]["json"]["required"], ["location"])
        results = [b["toolResult"] for m in body["messages"] for b in m["content"] if "toolResult" in b]
        self.assertEqual(len(results), 1)
        self.assertIn(TOOL_RESULT, json.dumps(results[0]["content"]))

    def test_tool_call_stream(self):
        chunks = []
        with self.sy.client().chat.completions.create(
            model="brk", messages=[{"role": "user", "content": "weather?"}], tools=WEATHER, stream=True
        ) as stream:
            chunks.extend(stream)
        name = "".join(
            tc.function.name or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
        )
        args = "".join(
            tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
        )
        self.assertEqual(name, "get_weather", self.explain())
        self.assertEqual(json.loads(args), WEATHER_ARGS)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, ["tool_calls"])

    def test_throttling_fails_over_to_gemini(self):
        t_before, g_before = count("bedrock:anthropic.claude-throttle-v1:0"), count(f"gemini:{GEMINI_MODEL}")
        raw = self.sy.client().chat.completions.with_raw_response.create(
            model="brk-throttled", messages=[{"role": "user", "content": "hi"}]
        )
        r = raw.parse()
        self.assertEqual(r.choices[0].message.content, f"Hello from gemini {GEMINI_MODEL}", self.explain())
        self.assertEqual(raw.headers.get("x-switchyard-target"), "gem-flash")
        self.assertGreaterEqual(count("bedrock:anthropic.claude-throttle-v1:0") - t_before, 1)
        self.assertEqual(count(f"gemini:{GEMINI_MODEL}") - g_before, 1)

    def test_unavailable_fails_over_to_gemini(self):
        u_before = count("bedrock:anthropic.claude-unavailable-v1:0")
        r = self.chat("brk-unavailable")
        self.assertEqual(r.choices[0].message.content, f"Hello from gemini {GEMINI_MODEL}", self.explain())
        # 503: retried once (retry.max 1), then failover.
        self.assertIn(count("bedrock:anthropic.claude-unavailable-v1:0") - u_before, (1, 2))

    def test_stream_cut_by_an_exception_is_never_a_silent_truncation(self):
        g_before = count(f"gemini:{GEMINI_MODEL}")
        chunks, error = [], None
        try:
            with self.sy.client().chat.completions.create(
                model="brk-cut", messages=[{"role": "user", "content": "hi"}], stream=True
            ) as stream:
                for chunk in stream:
                    chunks.append(chunk)
        except openai.APIError as e:
            error = e
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertGreaterEqual(count("bedrock:anthropic.claude-cut-v1:0"), 1)
        if error is None:
            # Continued on gemini (restart and verify: gemini's answer also begins with "Hello").
            self.assertEqual(
                text,
                f"Hello from gemini {GEMINI_MODEL}",
                f"a 200 stream without an error must be a whole answer{self.explain()}",
            )
            self.assertEqual(finishes, ["stop"])
            self.assertEqual(count(f"gemini:{GEMINI_MODEL}") - g_before, 1)
        else:
            self.assertTrue(text.startswith("Hello"), text)
            self.assertEqual(finishes, [], "an interrupted stream carries no finish")

    def test_context_too_long_is_a_400_without_failover(self):
        g_before = count(f"gemini:{GEMINI_MODEL}")
        with self.assertRaises(openai.BadRequestError) as cm:
            self.sy.client().chat.completions.create(model="brk-toolong", messages=[{"role": "user", "content": "hi"}])
        e = cm.exception
        self.assertEqual(e.status_code, 400)
        self.assertEqual(e.code, "context_length_exceeded", e.body)
        self.assertIn("Input is too long", str(e.message))
        self.assertEqual(count(f"gemini:{GEMINI_MODEL}") - g_before, 0, "no failover on a context-length error")


class BedrockApiKey(Scenario):
    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"brk-key": bedrock_provider(api_key_env="BEDROCK_KEY")},
            targets={"brk-key-nova": {"provider": "brk-key", "model": "amazon.nova-lite-v1:0"}},
            tasks={"brk-key": {"chain": ["brk-key-nova"]}},
            env={"BEDROCK_KEY": SECRETS.bedrock_api_key, "AWS_EC2_METADATA_DISABLED": "true"},
        )

    def test_bearer_key(self):
        self.assertText(self.chat("brk-key"), "Hello from bedrock amazon.nova-lite-v1:0")
        call = last_call("bedrock", "amazon.nova-lite-v1:0")
        self.assertEqual(call["auth"], "api-key")
        self.assertEqual(call["headers"]["authorization"], f"Bearer {SECRETS.bedrock_api_key}")
        self.assertNotIn("x-amz-date", call["headers"])
        text, _ = self.stream_text("brk-key")
        self.assertEqual(text, "Hello from bedrock amazon.nova-lite-v1:0")


class BedrockWebIdentity(Scenario):
    @classmethod
    def setUpClass(cls):
        s = SECRETS
        cls.start(
            providers={"brk-wi": bedrock_provider()},
            targets={"brk-wi-claude": {"provider": "brk-wi", "model": "anthropic.claude-3-haiku-20240307-v1:0"}},
            tasks={"brk-wi": {"chain": ["brk-wi-claude"]}},
            env={
                "AWS_ROLE_ARN": s.role_arn,
                "AWS_WEB_IDENTITY_TOKEN_FILE": str(s.token_file),
                "AWS_ROLE_SESSION_NAME": "switchyard-test",
                "AWS_ENDPOINT_URL_STS": FAKE,
                "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )

    def test_assumed_role_credentials(self):
        self.assertText(self.chat("brk-wi"), "Hello from bedrock anthropic.claude-3-haiku-20240307-v1:0")
        call = last_call("bedrock", "anthropic.claude-3-haiku-20240307-v1:0")
        self.assertEqual(call["auth"], "sigv4:web-identity", self.explain())
        self.assertEqual(call["headers"].get("x-amz-security-token"), SECRETS.sts_issue["token"])
        sts = last_call("sts", "AssumeRoleWithWebIdentity")
        self.assertEqual(sts["body"]["RoleArn"], SECRETS.role_arn)
        self.assertEqual(self.since_start("sts:AssumeRoleWithWebIdentity"), 1, "assumed once, then cached")
        self.assertEqual(
            self.chat("brk-wi").choices[0].message.content, "Hello from bedrock anthropic.claude-3-haiku-20240307-v1:0"
        )
        self.assertEqual(self.since_start("sts:AssumeRoleWithWebIdentity"), 1, "assumed once, then cached")


class BedrockContainerCredentials(Scenario):
    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"brk-ecs": bedrock_provider()},
            targets={"brk-ecs-llama": {"provider": "brk-ecs", "model": "meta.llama3-1-8b-instruct-v1:0"}},
            tasks={"brk-ecs": {"chain": ["brk-ecs-llama"]}},
            env={
                "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{FAKE}/container-creds",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN": SECRETS.container_auth,
                "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )

    def test_container_credentials(self):
        self.assertText(self.chat("brk-ecs"), "Hello from bedrock meta.llama3-1-8b-instruct-v1:0")
        call = last_call("bedrock", "meta.llama3-1-8b-instruct-v1:0")
        self.assertEqual(call["auth"], "sigv4:container", self.explain())
        self.assertEqual(call["headers"].get("x-amz-security-token"), SECRETS.container_issue["token"])
        self.chat("brk-ecs")
        self.assertEqual(self.since_start("container:creds"), 1, "fetched once, then cached")


class BedrockContainerCredentialsFailing(Scenario):
    """The container credentials endpoint answers 500 to every fetch while 20 Bedrock requests
    arrive at once; a Gemini API target backs Bedrock up. One fetch runs at a time and its
    failure is the answer for 2 s to those waiting, so all 20 fail over together instead of
    queueing one full fetch (the AWS SDK's own retries: ~2 s) behind another."""

    MODEL = "anthropic.claude-creds-failing-v1:0"
    N = 20

    @classmethod
    def setUpClass(cls):
        control(fail={"container": 500})
        cls.start(
            providers={
                # The default attempt timeout (30 s), not the tests' 5 s: a short one would cut
                # a queue of fetches short and hide it.
                "brk-bad": {**bedrock_provider(), "timeout": "30s"},
                "gem-backup": gemini_provider("GEMINI_KEY"),
            },
            targets={
                "brk-bad-claude": {"provider": "brk-bad", "model": cls.MODEL},
                "gem-backup-flash": {"provider": "gem-backup", "model": GEMINI_MODEL},
            },
            tasks={"brk-bad": {"chain": ["brk-bad-claude", "gem-backup-flash"]}},
            env={
                "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{FAKE}/container-creds",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN": SECRETS.container_auth,
                "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true",
                "GEMINI_KEY": SECRETS.gemini_keys[2],
            },
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(fail={"container": None})

    def test_concurrent_requests_all_fail_over_quickly(self):
        barrier = threading.Barrier(self.N, timeout=10)

        def one(_):
            client = self.sy.client(timeout=15.0)
            barrier.wait()
            t = time.monotonic()
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="brk-bad", messages=[{"role": "user", "content": "hi"}]
                )
                text = raw.parse().choices[0].message.content
                return raw.headers.get("x-switchyard-target"), text, time.monotonic() - t
            except openai.APIError as e:
                return f"error {type(e).__name__}: {e}", None, time.monotonic() - t

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(self.N) as pool:
            results = list(pool.map(one, range(self.N), timeout=30))
        batch = time.monotonic() - t0
        self.assertEqual(
            [(target, text) for target, text, _ in results],
            [("gem-backup-flash", f"Hello from gemini {GEMINI_MODEL}")] * self.N,
            self.explain(),
        )
        # A behaviour bound, not a benchmark: one shared failed fetch takes ~2 s (the AWS SDK
        # retries the 500 itself) and the whole batch ends with it; fetches queued one behind
        # another would take 20 x ~2 s (the clients give up at 15 s). 8 s leaves room for a
        # loaded machine and still tells the two apart.
        slowest = max(t for _, _, t in results)
        self.assertLess(batch, 8, f"the batch took {batch:.1f} s (slowest request {slowest:.1f} s){self.explain()}")
        self.assertEqual(self.since_start(f"bedrock:{self.MODEL}"), 0, "never sent unsigned")
        calls = self.since_start("container:failed")
        self.assertGreaterEqual(calls, 1, "the credentials endpoint was asked")
        # One fetch is 3 calls (the SDK's own retries), and its failure answers every waiter;
        # allow a second fetch for a straggler past the 2 s. A fetch per request: 20 x 3.
        self.assertLessEqual(calls, 6, f"{calls} calls to the credentials endpoint for {self.N} requests")


class BedrockProfile(Scenario):
    @classmethod
    def setUpClass(cls):
        s = SECRETS
        aws_dir = WORK / "aws-profile"
        aws_dir.mkdir(exist_ok=True)
        (aws_dir / "credentials").write_text(
            "[default]\n"
            f"aws_access_key_id = {s.profile_default['access']}\n"
            f"aws_secret_access_key = {s.profile_default['secret']}\n\n"
            "[switchyard-test]\n"
            f"aws_access_key_id = {s.profile['access']}\n"
            f"aws_secret_access_key = {s.profile['secret']}\n"
        )
        (aws_dir / "config").write_text(
            f"[default]\nregion = eu-west-1\n\n[profile switchyard-test]\nregion = {REGION}\n"
        )
        cls.start(
            providers={"brk-prof": bedrock_provider(aws_profile="switchyard-test")},
            targets={"brk-prof-mistral": {"provider": "brk-prof", "model": "mistral.mistral-large-2402-v1:0"}},
            tasks={"brk-prof": {"chain": ["brk-prof-mistral"]}},
            env={
                "AWS_SHARED_CREDENTIALS_FILE": str(aws_dir / "credentials"),
                "AWS_CONFIG_FILE": str(aws_dir / "config"),
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )

    def test_named_profile(self):
        self.assertText(self.chat("brk-prof"), "Hello from bedrock mistral.mistral-large-2402-v1:0")
        call = last_call("bedrock", "mistral.mistral-large-2402-v1:0")
        self.assertEqual(call["auth"], "sigv4:profile", self.explain())


# ---- credentials renewed before they expire ---------------------------------------------------------


class BedrockCredentialRefresh(Scenario):
    """Container credentials that expire 302 s after each fetch: switchyard keeps a set until less
    than 300 s remain, so a request 3 s later must fetch a new set and sign with it. The fake
    retires a set as soon as it issues the next (Bedrock then answers ExpiredTokenException)."""

    LIFETIME = 302

    @classmethod
    def setUpClass(cls):
        cls.start(
            providers={"brk-rot": bedrock_provider()},
            targets={"brk-rot-claude": {"provider": "brk-rot", "model": "anthropic.claude-rotating-v1:0"}},
            tasks={"brk-rot": {"chain": ["brk-rot-claude"]}},
            env={
                "AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{FAKE}/container-creds/rotating/{cls.LIFETIME}",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN": SECRETS.container_auth,
                "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true",
            },
        )

    def test_renewed_credentials_sign_the_next_request(self):
        model = "anthropic.claude-rotating-v1:0"
        self.assertText(self.chat("brk-rot"), f"Hello from bedrock {model}")
        time.sleep(3.5)  # now less than 300 s of the first set remain
        self.assertText(self.chat("brk-rot"), f"Hello from bedrock {model}")
        calls = [c for c in self.calls_since_start() if c["service"] == "bedrock" and c["model"] == model]
        self.assertEqual(len(calls), 2, "two requests, two calls: none failed and none was retried")
        self.assertEqual(self.since_start("container:rotating"), 2, "one fetch per request: the second renewed")
        first, second = (sigv4_access_key(c) for c in calls)
        self.assertNotEqual(first, second, "the second request must be signed with the renewed set")
        issued = {c["access"]: c for c in fake_state()["issued"]["aws_rotated"]}
        self.assertTrue(issued[first]["retired"], "the first set is retired: the fake would refuse it now")
        self.assertFalse(issued[second]["retired"])
        self.assertEqual(calls[1]["headers"].get("x-amz-security-token"), issued[second]["token"])
        self.assertEqual(
            [r for r in rejections_since(self.rejections_before) if r["service"] == "bedrock"], [], self.explain()
        )


class VertexTokenRefresh(Scenario):
    """Metadata-server tokens that live 242 s: google-cloud-auth's background task refreshes a
    token 240 s before it expires, i.e. ~2 s after each fetch, and publishes the new one to every
    later caller at once. The fake refuses a metadata token 1.5 s after it issued its successor,
    so a request signed with a stale token fails the test."""

    @classmethod
    def setUpClass(cls):
        control(mds_expires_in=242, mds_grace=1.5)
        cls.start(
            providers={"vtx-rot": vertex_provider()},
            targets={
                "vtx-rot-gemini": {"provider": "vtx-rot", "model": "gemini-2.0-flash-rotating"},
                "vtx-rot-claude": {"provider": "vtx-rot", "model": "claude-rotating@20250514"},
            },
            tasks={"vtx-rot": {"chain": ["vtx-rot-gemini"]}, "vtx-rot-claude": {"chain": ["vtx-rot-claude"]}},
            env={"GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(mds_expires_in=3599)

    def test_renewed_tokens_are_used_without_a_failed_request(self):
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 5.5:
            if n % 2:
                self.chat("vtx-rot-claude", max_tokens=16)
            else:
                self.chat("vtx-rot")  # self.chat fails the test on any error answer
            n += 1
            time.sleep(0.4)
        calls = [c for c in self.calls_since_start() if c["service"] in ("vertex", "vertex-anthropic")]
        self.assertEqual(len(calls), n, "every request one call: none failed, none retried")
        tokens = [c["headers"]["authorization"][len("Bearer ") :] for c in calls]
        life = fake_state()["issued"]["google_token_life"]
        order = sorted(set(tokens), key=lambda t: life[t]["issued"])
        self.assertGreaterEqual(len(order), 2, f"a renewed token must be used within 5 s; used {len(order)}")
        # Never back to an older token once a newer one was used.
        ranks = [order.index(t) for t in tokens]
        self.assertEqual(ranks, sorted(ranks), "a token older than one already used came back")
        self.assertGreaterEqual(self.since_start("mds:token"), 2)
        self.assertEqual(
            [r for r in rejections_since(self.rejections_before) if r["service"] == "vertex"], [], self.explain()
        )


# ---- images, JSON output and usage, per adapter ------------------------------------------------------


class AdapterFeatures(Scenario):
    """The same OpenAI requests through each adapter: Gemini API, Vertex Gemini, Vertex Claude, Bedrock."""

    # task -> (fake service, model)
    ROADS = {
        "f-gemini": ("gemini", "gemini-2.0-flash-features"),
        "f-vertex-gemini": ("vertex", "gemini-2.0-flash-features"),
        "f-vertex-claude": ("vertex-anthropic", "claude-features@20250514"),
        "f-bedrock": ("bedrock", "us.anthropic.claude-features-v1:0"),
    }
    CAPS = ["tools", "json_mode", "vision"]

    @classmethod
    def setUpClass(cls):
        providers = {
            "f-gem": gemini_provider("GEMINI_KEY"),
            "f-vtx": vertex_provider(credentials_file=str(sa_key_file())),
            "f-brk": bedrock_provider(),
        }
        prov = {"gemini": "f-gem", "vertex": "f-vtx", "vertex-anthropic": "f-vtx", "bedrock": "f-brk"}
        targets = {
            task: {"provider": prov[svc], "model": model, "capabilities": cls.CAPS}
            for task, (svc, model) in cls.ROADS.items()
        }
        tasks = {task: {"chain": [task]} for task in cls.ROADS}
        # Vertex Claude cannot take JSON output: a chain that goes on to Vertex Gemini.
        tasks["f-claude-then-gemini"] = {"chain": ["f-vertex-claude", "f-vertex-gemini"]}
        cls.start(
            providers=providers,
            targets=targets,
            tasks=tasks,
            env={**static_env(), "GEMINI_KEY": SECRETS.gemini_keys[4], "GCE_METADATA_HOST": "127.0.0.1:9"},
        )

    def last(self, task: str) -> dict:
        svc, model = self.ROADS[task]
        return last_call(svc, model)

    def test_image_reaches_each_adapter_in_its_own_shape(self):
        content = [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": PNG_URL}},
        ]
        for task, (svc, model) in self.ROADS.items():
            with self.subTest(task):
                r = self.chat(task, [{"role": "user", "content": content}], max_tokens=64)
                self.assertText(r, f"Hello from {svc} {model}")
                call = self.last(task)
                seen = {"source": "base64", **PNG_SEEN} if svc == "vertex-anthropic" else PNG_SEEN
                self.assertEqual(call.get("images"), [seen])
                body = call["body"]
                if svc in ("gemini", "vertex"):
                    parts = body["contents"][-1]["parts"]
                    self.assertIn({"inlineData": {"mimeType": "image/png", "data": PNG_B64}}, parts)
                    self.assertIn({"text": "What is in this picture?"}, parts)
                elif svc == "vertex-anthropic":
                    blocks = body["messages"][-1]["content"]
                    self.assertIn(
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}},
                        blocks,
                    )
                else:
                    blocks = body["messages"][-1]["content"]
                    self.assertIn({"image": {"format": "png", "source": {"bytes": PNG_B64}}}, blocks)
                # The fake counts the image into the prompt: usage must say what it said.
                self.assertEqual(r.usage.prompt_tokens, call["usage"]["prompt"])
                self.assertEqual(r.usage.completion_tokens, call["usage"]["completion"])

    SCHEMA = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "temperature": {"type": "integer"}},
        "required": ["city", "temperature"],
        "additionalProperties": False,
    }
    RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": SCHEMA}}

    def test_json_schema_output(self):
        for task in ("f-gemini", "f-vertex-gemini", "f-bedrock"):
            svc, _ = self.ROADS[task]
            with self.subTest(task):
                r = self.chat(
                    task, [{"role": "user", "content": "Weather in Paris?"}], response_format=self.RESPONSE_FORMAT
                )
                self.assertEqual(json.loads(r.choices[0].message.content), {"city": "Paris", "temperature": 18})
                call = self.last(task)
                self.assertTrue(call.get("json_output"), call["body"])
                if svc == "bedrock":
                    tf = call["body"]["outputConfig"]["textFormat"]
                    self.assertEqual(tf["type"], "json_schema")
                    self.assertEqual(tf["structure"]["jsonSchema"]["name"], "weather")
                    self.assertEqual(json.loads(tf["structure"]["jsonSchema"]["schema"]), self.SCHEMA)
                else:
                    gen = call["body"]["generationConfig"]
                    self.assertEqual(gen["responseMimeType"], "application/json")
                    rs = gen["responseSchema"]
                    self.assertEqual(rs["type"].lower(), "object")
                    self.assertEqual(set(rs["properties"]), {"city", "temperature"})
                    self.assertEqual(rs["properties"]["temperature"]["type"].lower(), "integer")
                    self.assertNotIn("additionalProperties", json.dumps(rs), "Gemini's Schema has none")

    def test_json_schema_output_on_vertex_claude_is_never_a_silent_wrong_answer(self):
        # What switchyard does: Anthropic has no response_format, so the target is skipped
        # without a call; alone in its chain, the client gets a clear 4xx.
        before = count("vertex-anthropic:claude-features@20250514")
        with self.assertRaises(openai.APIStatusError) as cm:
            self.sy.client().chat.completions.create(
                model="f-vertex-claude",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                response_format=self.RESPONSE_FORMAT,
            )
        e = cm.exception
        self.assertTrue(400 <= e.status_code < 500, (e.status_code, e.body))
        self.assertRegex(str(e.message), r"(?i)response_format|json", e.body)
        self.assertEqual(count("vertex-anthropic:claude-features@20250514") - before, 0, "no call to Claude")
        # With somewhere to go, the request is served there.
        raw = self.sy.client().chat.completions.with_raw_response.create(
            model="f-claude-then-gemini",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            response_format=self.RESPONSE_FORMAT,
        )
        self.assertEqual(raw.headers.get("x-switchyard-target"), "f-vertex-gemini")
        self.assertEqual(json.loads(raw.parse().choices[0].message.content), {"city": "Paris", "temperature": 18})
        self.assertEqual(count("vertex-anthropic:claude-features@20250514") - before, 0, "no call to Claude")

    def test_usage_plain_and_streamed_is_the_upstreams(self):
        for task in self.ROADS:
            with self.subTest(task, stream=False):
                r = self.chat(task, max_tokens=32)
                u = self.last(task)["usage"]
                self.assertEqual(
                    (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens),
                    (u["prompt"], u["completion"], u["prompt"] + u["completion"]),
                )
            with self.subTest(task, stream=True):
                text, chunks = self.stream_text(task, max_tokens=32, stream_options={"include_usage": True})
                self.assertTrue(text.startswith("Hello from"), text)
                u = self.last(task)["usage"]
                with_usage = [c for c in chunks if c.usage is not None]
                self.assertEqual(len(with_usage), 1, "one usage chunk")
                self.assertIs(chunks[-1], with_usage[0], "the usage chunk comes last")
                self.assertEqual(chunks[-1].choices, [])
                cu = chunks[-1].usage
                self.assertEqual(
                    (cu.prompt_tokens, cu.completion_tokens, cu.total_tokens),
                    (u["prompt"], u["completion"], u["prompt"] + u["completion"]),
                )


# ---- examples/claude-everywhere and examples/gemini-everywhere, pointed at the fakes -------------------


def fake_embedding(text: str, dim: int) -> list[float]:
    """The vector fake_clouds.py answers for `text` (see its gemini_embed)."""
    h = hashlib.sha256(text.encode()).digest()
    return [round((h[j % 32] - 128) / 128, 6) for j in range(dim)]


def load_example(name: str) -> dict:
    import yaml  # PyYAML: in the SDK venv (fakellm's dependency)

    return yaml.safe_load((ROOT / "examples" / name / "routes.yaml").read_text())


def dump_routes(routes: dict) -> str:
    return json.dumps(routes, indent=1)  # JSON is YAML


class ClaudeEverywhereExample(Scenario):
    """examples/claude-everywhere/routes.yaml with only the roads' endpoints and credentials
    pointed at the fakes: Anthropic API, then Bedrock, then Vertex."""

    @classmethod
    def setUpClass(cls):
        routes = load_example("claude-everywhere")
        cls.example = json.loads(json.dumps(routes))
        p = routes["providers"]
        p["anthropic"]["base_url"] = f"{FAKE}/v1"
        p["bedrock"]["base_url"] = FAKE  # region us-east-1 stays: the fake checks the SigV4 scope
        # The fake serves project test-project in us-central1: the URL says which.
        p["vertex"]["base_url"] = f"{FAKE}/v1/projects/{PROJECT}/locations/{LOCATION}"
        cls.targets = {name: t["model"] for name, t in routes["targets"].items()}
        cls.start(
            routes_text=dump_routes(routes),
            env={**static_env(), "ANTHROPIC_API_KEY": SECRETS.anthropic_key, "GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(fail={"anthropic": None, "bedrock": None})

    def test_the_example_is_what_the_brief_says(self):
        ex = self.example
        roads = ("anthropic", "bedrock", "vertex")
        self.assertEqual([ex["providers"][n]["protocol"] for n in roads], list(roads))
        self.assertEqual(ex["tasks"]["claude"]["chain"], ["claude-anthropic", "claude-bedrock", "claude-vertex"])
        self.assertTrue(ex["tasks"]["claude"]["aliases"])

    def test_anthropic_first(self):
        raw = self.sy.client().chat.completions.with_raw_response.create(
            model="claude", messages=[{"role": "user", "content": "hi"}], max_tokens=32
        )
        m = self.targets["claude-anthropic"]
        self.assertEqual(raw.headers.get("x-switchyard-target"), "claude-anthropic", self.explain())
        self.assertEqual(raw.parse().choices[0].message.content, f"Hello from anthropic {m}")
        call = last_call("anthropic", m)
        self.assertEqual(call["headers"].get("x-api-key"), SECRETS.anthropic_key)
        self.assertEqual(call["body"]["model"], m)

    def test_anthropic_overloaded_fails_over_to_bedrock_then_vertex(self):
        a, b, v = (self.targets[n] for n in ("claude-anthropic", "claude-bedrock", "claude-vertex"))
        alias = self.example["tasks"]["claude"]["aliases"][0]
        try:
            control(fail={"anthropic": 529})
            before = {k: count(k) for k in (f"anthropic:{a}", f"bedrock:{b}", f"vertex-anthropic:{v}")}
            raw = self.sy.client().chat.completions.with_raw_response.create(
                model=alias, messages=[{"role": "user", "content": "hi"}], max_tokens=32
            )
            self.assertEqual(raw.headers.get("x-switchyard-target"), "claude-bedrock", self.explain())
            self.assertEqual(raw.parse().choices[0].message.content, f"Hello from bedrock {b}")
            self.assertGreaterEqual(count(f"anthropic:{a}") - before[f"anthropic:{a}"], 1)
            self.assertEqual(count(f"bedrock:{b}") - before[f"bedrock:{b}"], 1)
            self.assertEqual(count(f"vertex-anthropic:{v}") - before[f"vertex-anthropic:{v}"], 0)
            self.assertEqual(last_call("bedrock", b)["auth"], "sigv4:static")
            # Both clouds' first roads down: Vertex answers.
            control(fail={"bedrock": 503})
            raw = self.sy.client().chat.completions.with_raw_response.create(
                model="claude", messages=[{"role": "user", "content": "hi"}], max_tokens=32
            )
            self.assertEqual(raw.headers.get("x-switchyard-target"), "claude-vertex", self.explain())
            self.assertEqual(raw.parse().choices[0].message.content, f"Hello from vertex-anthropic {v}")
            self.assertEqual(last_call("vertex-anthropic", v)["auth"], "mds")
        finally:
            control(fail={"anthropic": None, "bedrock": None})


class GeminiEverywhereExample(Scenario):
    """examples/gemini-everywhere/routes.yaml pointed at the fakes: Gemini API, then Vertex."""

    @classmethod
    def setUpClass(cls):
        routes = load_example("gemini-everywhere")
        p = routes["providers"]
        p["gemini"]["base_url"] = f"{FAKE}/v1beta"
        p["vertex"]["base_url"] = f"{FAKE}/v1/projects/{PROJECT}/locations/{LOCATION}"
        cls.targets = {name: t["model"] for name, t in routes["targets"].items()}
        cls.start(
            routes_text=dump_routes(routes),
            env={"GEMINI_API_KEY": SECRETS.gemini_keys[3], "GCE_METADATA_HOST": FAKE_HOSTPORT},
        )

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        control(fail={"gemini": None})

    def test_gemini_api_unavailable_fails_over_to_vertex(self):
        g, v = self.targets["gemini-api-flash"], self.targets["gemini-vertex-flash"]
        try:
            control(fail={"gemini": 503})
            g0, v0 = count(f"gemini:{g}"), count(f"vertex:{v}")
            raw = self.sy.client().chat.completions.with_raw_response.create(
                model="gemini", messages=[{"role": "user", "content": "hi"}]
            )
            self.assertEqual(raw.headers.get("x-switchyard-target"), "gemini-vertex-flash", self.explain())
            self.assertEqual(raw.parse().choices[0].message.content, f"Hello from vertex {v}")
            self.assertGreaterEqual(count(f"gemini:{g}") - g0, 1)
            self.assertEqual(count(f"vertex:{v}") - v0, 1)
        finally:
            control(fail={"gemini": None})
        raw = self.sy.client().chat.completions.with_raw_response.create(
            model="gemini-2.5-flash", messages=[{"role": "user", "content": "hi"}]
        )
        self.assertEqual(raw.headers.get("x-switchyard-target"), "gemini-api-flash")

    def test_embeddings_through_the_gemini_api(self):
        m = self.targets["gemini-api-embed"]
        before = count(f"gemini:{m}")
        try:
            r = self.sy.client().embeddings.create(model="embed", input=["hello", "world"], encoding_format="float")
        except openai.APIError as e:
            self.fail(f"embeddings: {e}{self.explain()}")
        self.assertEqual(len(r.data), 2)
        self.assertEqual([d.index for d in r.data], [0, 1])
        self.assertEqual(len(r.data[0].embedding), 3072)
        self.assertEqual(r.data[0].embedding, fake_embedding("hello", 3072))
        self.assertEqual(r.data[1].embedding, fake_embedding("world", 3072))
        self.assertEqual(count(f"gemini:{m}") - before, 1)
        call = last_call("gemini", m)
        self.assertEqual(call["path"], f"/v1beta/models/{m}:batchEmbedContents")
        self.assertEqual([q["content"]["parts"][0]["text"] for q in call["body"]["requests"]], ["hello", "world"])

    def test_embeddings_with_the_sdk_default_encoding_base64(self):
        """The openai SDK sends `"encoding_format": "base64"` when the caller chooses none, and
        decodes base64 float32 itself. Gemini answers numbers: switchyard encodes them, as OpenAI
        would answer, and the SDK reads the same vectors."""
        m = self.targets["gemini-api-embed"]
        before = count(f"gemini:{m}")
        raw = self.sy.client().embeddings.with_raw_response.create(model="embed", input=["hello", "world"])
        wire = json.loads(raw.http_response.text)
        self.assertIsInstance(wire["data"][0]["embedding"], str, "base64 on the wire, as asked")
        r = raw.parse()
        self.assertEqual(len(r.data), 2)
        self.assertEqual(len(r.data[0].embedding), 3072)
        self.assertEqual(count(f"gemini:{m}") - before, 1)
        want = fake_embedding("hello", 3072)
        self.assertEqual([round(x, 6) for x in r.data[0].embedding], want)


# ---- secrets never logged (runs last: classes run in name order) ----------------------------------


class ZzSecretsNotLogged(unittest.TestCase):
    def secrets(self) -> dict[str, str]:
        state = fake_state()
        secrets_ = SECRETS.all()
        for i, token in enumerate(state["issued"]["google_tokens"]):
            secrets_[f"Google access token {i}"] = token
        for i, c in enumerate(state["issued"]["aws_rotated"]):
            secrets_[f"rotated AWS secret key {i}"] = c["secret"]
            secrets_[f"rotated AWS session token {i}"] = c["token"]
        for c in state["calls"]:
            auth = c["headers"].get("authorization", "")
            if c["service"].startswith("vertex") and auth.startswith("Bearer "):
                secrets_[f"Vertex bearer ({c['auth']})"] = auth[len("Bearer ") :]
        return secrets_

    def test_no_secret_in_metrics_or_error_bodies(self):
        if not SWITCHYARD_LOGS:
            self.skipTest("no scenario ran in this process")
        secrets_ = self.secrets()
        scraped = [(where, text) for where, text in METRICS_TEXTS if text]
        self.assertTrue(scraped, f"no /metrics was scraped: {[w for w, _ in METRICS_TEXTS]}")
        self.assertTrue(
            any(" admin " in where for where, _ in scraped), "no admin-listener /metrics was scraped"
        )
        for where, text in scraped:
            self.assertIn("switchyard_", text, f"{where} does not look like switchyard's metrics")
        if any(p.parent.name == "GeminiApi" for p in SWITCHYARD_LOGS):
            # Its 429 test alone answers an error body: the capture must have seen it.
            self.assertTrue(any(n == "GeminiApi" for n, _, _ in ERROR_BODIES), "no error body was captured")
        for where, text in scraped + [(f"{n} error body ({st})", b) for n, st, b in ERROR_BODIES]:
            for name, secret in secrets_.items():
                with self.subTest(where=where, secret=name):
                    self.assertNotIn(secret, text, f"{name} appears in {where}")

    def test_no_secret_in_any_switchyard_log(self):
        logs = [p for p in SWITCHYARD_LOGS if p.exists()]
        if not logs:
            self.skipTest("no scenario ran in this process")
        secrets_ = self.secrets()
        for log in logs:
            text = log.read_text(errors="replace")
            for name, secret in secrets_.items():
                with self.subTest(log=log.parent.name, secret=name):
                    self.assertNotIn(secret, text, f"{name} appears in {log}")


# ---- the fakes themselves, with botocore (no switchyard needed) ----------------------------------


class FakeBedrockSelfTest(unittest.TestCase):
    def client(self, service="bedrock-runtime", **creds):
        import botocore.config
        import botocore.session

        if not creds:
            creds = {"aws_access_key_id": SECRETS.static["access"], "aws_secret_access_key": SECRETS.static["secret"]}
        return botocore.session.get_session().create_client(
            service,
            region_name=REGION,
            endpoint_url=FAKE,
            config=botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"}),
            **creds,
        )

    def test_converse(self):
        r = self.client().converse(modelId=BEDROCK_CLAUDE, messages=[{"role": "user", "content": [{"text": "hi"}]}])
        self.assertEqual(r["output"]["message"]["content"], [{"text": f"Hello from bedrock {BEDROCK_CLAUDE}"}])
        self.assertEqual(r["stopReason"], "end_turn")
        self.assertEqual(r["usage"]["totalTokens"], 18)
        self.assertEqual(last_call("bedrock", BEDROCK_CLAUDE)["auth"], "sigv4:static")

    def test_converse_stream(self):
        r = self.client().converse_stream(
            modelId=BEDROCK_CLAUDE, messages=[{"role": "user", "content": [{"text": "hi"}]}]
        )
        events = list(r["stream"])
        kinds = [next(iter(e)) for e in events]
        self.assertEqual(kinds[0], "messageStart")
        self.assertEqual(kinds[-2:], ["messageStop", "metadata"])
        text = "".join(e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e)
        self.assertEqual(text, f"Hello from bedrock {BEDROCK_CLAUDE}")
        self.assertEqual(events[-2]["messageStop"]["stopReason"], "end_turn")

    def test_converse_tools_plain_and_stream(self):
        tool_config = {
            "tools": [
                {"toolSpec": {"name": "get_weather", "description": "w", "inputSchema": {"json": {"type": "object"}}}}
            ]
        }
        msgs = [{"role": "user", "content": [{"text": "weather?"}]}]
        c = self.client()
        r = c.converse(modelId=BEDROCK_CLAUDE, messages=msgs, toolConfig=tool_config)
        self.assertEqual(r["stopReason"], "tool_use")
        tu = r["output"]["message"]["content"][0]["toolUse"]
        self.assertEqual((tu["name"], tu["input"]), ("get_weather", WEATHER_ARGS))
        msgs2 = msgs + [
            r["output"]["message"],
            {
                "role": "user",
                "content": [{"toolResult": {"toolUseId": tu["toolUseId"], "content": [{"text": "18 C"}]}}],
            },
        ]
        r2 = c.converse(modelId=BEDROCK_CLAUDE, messages=msgs2, toolConfig=tool_config)
        self.assertEqual(
            r2["output"]["message"]["content"][0]["text"], f"Got the tool result from bedrock {BEDROCK_CLAUDE}"
        )
        events = list(c.converse_stream(modelId=BEDROCK_CLAUDE, messages=msgs, toolConfig=tool_config)["stream"])
        start = [e["contentBlockStart"]["start"]["toolUse"] for e in events if "contentBlockStart" in e]
        self.assertEqual(start[0]["name"], "get_weather")
        args = "".join(e["contentBlockDelta"]["delta"]["toolUse"]["input"] for e in events if "contentBlockDelta" in e)
        self.assertEqual(json.loads(args), WEATHER_ARGS)

    def test_errors(self):
        from botocore.exceptions import ClientError, EventStreamError

        c = self.client()
        msgs = [{"role": "user", "content": [{"text": "hi"}]}]
        for model, code, status in (
            ("x-throttle", "ThrottlingException", 429),
            ("x-unavailable", "ServiceUnavailableException", 503),
            ("x-toolong", "ValidationException", 400),
        ):
            with self.subTest(model), self.assertRaises(ClientError) as cm:
                c.converse(modelId=model, messages=msgs)
            self.assertEqual(cm.exception.response["Error"]["Code"], code)
            self.assertEqual(cm.exception.response["ResponseMetadata"]["HTTPStatusCode"], status)
        with self.assertRaises(ClientError) as cm:
            c.converse(modelId=BEDROCK_CLAUDE, messages=[{"role": "assistant", "content": [{"text": "x"}]}])
        self.assertIn("start with a user message", str(cm.exception))
        # The cut stream: a text delta, then an exception event botocore raises.
        stream = c.converse_stream(modelId="x-cut", messages=msgs)["stream"]
        got = []
        with self.assertRaises(EventStreamError) as cm:
            for e in stream:
                got.append(e)
        self.assertEqual(cm.exception.response["Error"]["Code"], "modelStreamErrorException")
        self.assertEqual([next(iter(e)) for e in got], ["messageStart", "contentBlockDelta"])

    def test_bad_signature_and_unknown_key_are_rejected(self):
        from botocore.exceptions import ClientError

        msgs = [{"role": "user", "content": [{"text": "hi"}]}]
        bad = self.client(aws_access_key_id=SECRETS.static["access"], aws_secret_access_key="wrong" + "x" * 35)
        with self.assertRaises(ClientError) as cm:
            bad.converse(modelId=BEDROCK_CLAUDE, messages=msgs)
        self.assertEqual(cm.exception.response["Error"]["Code"], "InvalidSignatureException")
        unknown = self.client(aws_access_key_id="AKIAUNKNOWN000000000", aws_secret_access_key="y" * 40)
        with self.assertRaises(ClientError) as cm:
            unknown.converse(modelId=BEDROCK_CLAUDE, messages=msgs)
        self.assertEqual(cm.exception.response["Error"]["Code"], "UnrecognizedClientException")

    def test_api_key(self):
        url = f"{FAKE}/model/{urllib.request.quote(BEDROCK_CLAUDE, safe='')}/converse"
        body = json.dumps({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}).encode()
        status, _, out = http(
            "POST",
            url,
            body,
            {"Authorization": f"Bearer {SECRETS.bedrock_api_key}", "Content-Type": "application/json"},
        )
        self.assertEqual(status, 200, out)
        status, headers, _ = http("POST", url, body, {"Authorization": "Bearer nope"})
        self.assertEqual(status, 403)
        self.assertTrue(headers.get("x-amzn-ErrorType", "").startswith("AccessDeniedException:"))

    def test_sts_web_identity_then_converse_with_the_session(self):
        from botocore import UNSIGNED
        from botocore.config import Config
        from botocore.exceptions import ClientError
        import botocore.session

        sts = botocore.session.get_session().create_client(
            "sts", region_name=REGION, endpoint_url=FAKE, config=Config(signature_version=UNSIGNED)
        )
        with self.assertRaises(ClientError):
            sts.assume_role_with_web_identity(
                RoleArn=SECRETS.role_arn, RoleSessionName="selftest", WebIdentityToken="wrong"
            )
        r = sts.assume_role_with_web_identity(
            RoleArn=SECRETS.role_arn, RoleSessionName="selftest", WebIdentityToken=SECRETS.web_identity_token
        )
        cr = r["Credentials"]
        self.assertEqual(cr["AccessKeyId"], SECRETS.sts_issue["access"])
        self.assertEqual(cr["SessionToken"], SECRETS.sts_issue["token"])
        c = self.client(
            aws_access_key_id=cr["AccessKeyId"],
            aws_secret_access_key=cr["SecretAccessKey"],
            aws_session_token=cr["SessionToken"],
        )
        c.converse(modelId="selftest-sts", messages=[{"role": "user", "content": [{"text": "hi"}]}])
        self.assertEqual(last_call("bedrock", "selftest-sts")["auth"], "sigv4:web-identity")

    def test_container_credentials_then_converse(self):
        from botocore.exceptions import MetadataRetrievalError
        from botocore.utils import ContainerMetadataFetcher

        fetcher = ContainerMetadataFetcher()
        with self.assertRaises(MetadataRetrievalError):
            fetcher.retrieve_full_uri(f"{FAKE}/container-creds", headers={"Authorization": "wrong"})
        creds = fetcher.retrieve_full_uri(f"{FAKE}/container-creds", headers={"Authorization": SECRETS.container_auth})
        self.assertEqual(creds["AccessKeyId"], SECRETS.container_issue["access"])
        c = self.client(
            aws_access_key_id=creds["AccessKeyId"],
            aws_secret_access_key=creds["SecretAccessKey"],
            aws_session_token=creds["Token"],
        )
        c.converse(modelId="selftest-ecs", messages=[{"role": "user", "content": [{"text": "hi"}]}])
        self.assertEqual(last_call("bedrock", "selftest-ecs")["auth"], "sigv4:container")

    def test_rotating_container_credentials_retire_the_previous_set(self):
        from botocore.exceptions import ClientError
        from botocore.utils import ContainerMetadataFetcher

        fetcher = ContainerMetadataFetcher()
        url, hdr = f"{FAKE}/container-creds/rotating/302", {"Authorization": SECRETS.container_auth}
        old, new = fetcher.retrieve_full_uri(url, headers=hdr), fetcher.retrieve_full_uri(url, headers=hdr)
        self.assertNotEqual(old["AccessKeyId"], new["AccessKeyId"])
        msgs = [{"role": "user", "content": [{"text": "hi"}]}]

        def client(c):
            return self.client(
                aws_access_key_id=c["AccessKeyId"],
                aws_secret_access_key=c["SecretAccessKey"],
                aws_session_token=c["Token"],
            )

        with self.assertRaises(ClientError) as cm:
            client(old).converse(modelId="selftest-rotating", messages=msgs)
        self.assertEqual(cm.exception.response["Error"]["Code"], "ExpiredTokenException")
        client(new).converse(modelId="selftest-rotating", messages=msgs)
        self.assertEqual(last_call("bedrock", "selftest-rotating")["auth"], "sigv4:rotating")

    def test_botocore_credential_chain_with_a_profile(self):
        # botocore's own resolution of a named profile in a shared credentials file.
        import botocore.session

        d = Path(tempfile.mkdtemp(dir=WORK))
        (d / "credentials").write_text(
            f"[p]\naws_access_key_id = {SECRETS.profile['access']}\n"
            f"aws_secret_access_key = {SECRETS.profile['secret']}\n"
        )
        sess = botocore.session.Session(profile="p")
        sess.set_config_variable("credentials_file", str(d / "credentials"))
        sess.set_config_variable("config_file", str(d / "none"))
        c = sess.create_client("bedrock-runtime", region_name=REGION, endpoint_url=FAKE)
        c.converse(modelId="selftest-profile", messages=[{"role": "user", "content": [{"text": "hi"}]}])
        self.assertEqual(last_call("bedrock", "selftest-profile")["auth"], "sigv4:profile")


class FakeGoogleSelfTest(unittest.TestCase):
    def jwt(self, claims: dict, key=None) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        enc = lambda o: base64.urlsafe_b64encode(json.dumps(o).encode()).rstrip(b"=").decode()  # noqa: E731
        head = enc({"alg": "RS256", "typ": "JWT", "kid": SECRETS.sa_key_id})
        signing_input = f"{head}.{enc(claims)}"
        sig = (key or SECRETS.sa_private_key_obj).sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"

    def claims(self, **over) -> dict:
        now = int(time.time())
        c = {"iss": SECRETS.sa_email, "scope": CLOUD_PLATFORM, "aud": f"{FAKE}/token", "iat": now, "exp": now + 3600}
        c.update(over)
        return c

    def exchange(self, assertion: str):
        form = urllib.parse.urlencode(
            {"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": assertion}
        ).encode()
        return http("POST", f"{FAKE}/token", form, {"Content-Type": "application/x-www-form-urlencoded"})

    def post_json(self, path: str, body: dict, headers: dict):
        return http("POST", f"{FAKE}{path}", json.dumps(body).encode(), {"Content-Type": "application/json", **headers})

    def test_jwt_exchange_and_vertex(self):
        from cryptography.hazmat.primitives.asymmetric import rsa

        before = count("oauth:token_exchange")
        status, _, body = self.exchange(self.jwt(self.claims()))
        self.assertEqual(status, 200, body)
        tok = json.loads(body)
        self.assertEqual((tok["token_type"], tok["expires_in"] > 3000), ("Bearer", True))
        self.assertEqual(count("oauth:token_exchange") - before, 1)
        for bad in (
            self.jwt(self.claims(aud="https://example.com/token")),
            self.jwt(self.claims(scope="https://www.googleapis.com/auth/devstorage.read_only")),
            self.jwt(self.claims(exp=int(time.time()) - 600, iat=int(time.time()) - 4000)),
            self.jwt(self.claims(), key=rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        ):
            with self.subTest(bad=bad[:30]):
                self.assertEqual(self.exchange(bad)[0], 400)

        base = f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers"
        msgs = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        auth = {"Authorization": f"Bearer {tok['access_token']}"}
        status, _, out = self.post_json(f"{base}/google/models/{GEMINI_MODEL}:generateContent", msgs, auth)
        self.assertEqual(status, 200, out)
        self.assertEqual(
            json.loads(out)["candidates"][0]["content"]["parts"][0]["text"], f"Hello from vertex {GEMINI_MODEL}"
        )
        self.assertEqual(
            self.post_json(
                f"{base}/google/models/{GEMINI_MODEL}:generateContent", msgs, {"Authorization": "Bearer ya29.unknown"}
            )[0],
            401,
        )
        # A self-signed JWT (scope cloud-platform) is accepted as real Google does.
        sj = self.jwt(self.claims(aud=None, sub=SECRETS.sa_email))
        self.assertEqual(
            self.post_json(
                f"{base}/google/models/{GEMINI_MODEL}:generateContent", msgs, {"Authorization": f"Bearer {sj}"}
            )[0],
            200,
        )
        # Anthropic on Vertex.
        claude = {
            "anthropic_version": "vertex-2023-10-16",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        }
        status, _, out = self.post_json(f"{base}/anthropic/models/{VERTEX_CLAUDE}:rawPredict", claude, auth)
        self.assertEqual(status, 200, out)
        self.assertEqual(json.loads(out)["content"][0]["text"], f"Hello from vertex-anthropic {VERTEX_CLAUDE}")
        for broken in (
            {**claude, "model": VERTEX_CLAUDE},
            {k: v for k, v in claude.items() if k != "anthropic_version"},
        ):
            self.assertEqual(
                self.post_json(f"{base}/anthropic/models/{VERTEX_CLAUDE}:rawPredict", broken, auth)[0], 400
            )
        status, _, out = self.post_json(
            f"{base}/anthropic/models/{VERTEX_CLAUDE}:streamRawPredict", {**claude, "stream": True}, auth
        )
        self.assertEqual(status, 200, out)
        events = [ln[len("event: ") :] for ln in out.decode().splitlines() if ln.startswith("event: ")]
        self.assertEqual(events[0], "message_start")
        self.assertEqual(events[-1], "message_stop")

    def test_metadata_server(self):
        path = "/computeMetadata/v1/instance/service-accounts/default/token"
        self.assertEqual(http("GET", f"{FAKE}{path}")[0], 403)
        status, headers, body = http(
            "GET", f"{FAKE}{path}?scopes={urllib.parse.quote(CLOUD_PLATFORM)}", headers={"Metadata-Flavor": "Google"}
        )
        self.assertEqual(status, 200, body)
        self.assertEqual(headers.get("Metadata-Flavor"), "Google")
        self.assertEqual(set(json.loads(body)), {"access_token", "expires_in", "token_type"})
        for p, want in (
            ("/computeMetadata/v1/universe/universe-domain", b"googleapis.com"),
            (
                "/computeMetadata/v1/instance/service-accounts/default/email",
                f"default-compute@{PROJECT}.iam.gserviceaccount.com".encode(),
            ),
        ):
            self.assertEqual(http("GET", f"{FAKE}{p}", headers={"Metadata-Flavor": "Google"})[2], want)

    def test_gemini_api(self):
        path = f"/v1beta/models/{GEMINI_MODEL}"
        hdr = {"x-goog-api-key": SECRETS.gemini_keys[0]}
        msgs = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        status, _, out = self.post_json(f"{path}:generateContent", msgs, hdr)
        self.assertEqual(status, 200, out)
        r = json.loads(out)
        self.assertEqual(r["candidates"][0]["finishReason"], "STOP")
        self.assertEqual(
            r["usageMetadata"]["totalTokenCount"],
            r["usageMetadata"]["promptTokenCount"] + r["usageMetadata"]["candidatesTokenCount"],
        )
        self.assertEqual(self.post_json(f"{path}:generateContent?key={SECRETS.gemini_keys[0]}", msgs, {})[0], 403)
        self.assertEqual(self.post_json(f"{path}:generateContent", msgs, {"x-goog-api-key": "AIzaWRONG"})[0], 400)
        self.assertEqual(self.post_json(f"{path}:generateContent", {**msgs, "model": "x"}, hdr)[0], 400)
        # Stream.
        status, headers, out = self.post_json(f"{path}:streamGenerateContent?alt=sse", msgs, hdr)
        self.assertEqual(status, 200)
        self.assertTrue(headers["Content-Type"].startswith("text/event-stream"))
        datas = [json.loads(ln[len("data: ") :]) for ln in out.decode().splitlines() if ln.startswith("data: ")]
        self.assertEqual(
            "".join(d["candidates"][0]["content"]["parts"][0]["text"] for d in datas),
            f"Hello from gemini {GEMINI_MODEL}",
        )
        self.assertEqual(datas[-1]["candidates"][0]["finishReason"], "STOP")
        # Tools: a call, then a final answer when the last turn answers it.
        tools = {
            "tools": [
                {
                    "functionDeclarations": [
                        {"name": "get_weather", "description": "w", "parameters": {"type": "object"}}
                    ]
                }
            ]
        }
        r = json.loads(self.post_json(f"{path}:generateContent", {**msgs, **tools}, hdr)[2])
        fc = r["candidates"][0]["content"]["parts"][0]["functionCall"]
        self.assertEqual(fc, {"name": "get_weather", "args": WEATHER_ARGS})
        turn = {
            "contents": msgs["contents"]
            + [
                {"role": "model", "parts": [{"functionCall": fc}]},
                {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"r": "18 C"}}}]},
            ]
        }
        status, _, out = self.post_json(f"{path}:generateContent", {**turn, **tools}, hdr)
        self.assertEqual(status, 200, out)
        wrong = json.loads(json.dumps(turn))
        wrong["contents"][2]["parts"][0]["functionResponse"]["name"] = "get_time"
        self.assertEqual(self.post_json(f"{path}:generateContent", {**wrong, **tools}, hdr)[0], 400)
        # Exhausted and unavailable.
        status, _, out = self.post_json("/v1beta/models/gemini-exhausted-x:generateContent", msgs, hdr)
        self.assertEqual(status, 429)
        self.assertEqual(
            json.loads(out),
            {
                "error": {
                    "code": 429,
                    "message": "Resource has been exhausted (e.g. check quota).",
                    "status": "RESOURCE_EXHAUSTED",
                    "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}],
                }
            },
        )
        status, _, out = self.post_json("/v1beta/models/gemini-unavailable-x:generateContent", msgs, hdr)
        self.assertEqual((status, json.loads(out)["error"]["status"]), (503, "UNAVAILABLE"))


# ---- runner ----------------------------------------------------------------------------------------


def main() -> int:
    verbosity = 2 if "-v" in sys.argv[1:] else 1
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    module = sys.modules[__name__]
    loader = unittest.TestLoader()
    if names:
        # run.sh passes the same names to every SDK test module: run the ones that are ours.
        mine = [n for n in names if hasattr(module, n.split(".")[0])]
        if not mine:
            line = "0 passed, 0 failed"
            summary = os.environ.get("SDK_SUMMARY_FILE")
            Path(summary).write_text(line + "\n") if summary else print(line)
            return 0
        suite = loader.loadTestsFromNames(mine, module)
    else:
        suite = loader.loadTestsFromModule(module)
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(suite)

    def test_id(t) -> str:
        return getattr(t, "test_case", t).id()

    failed_ids = {test_id(t) for t, _ in result.failures + result.errors}
    failed_ids |= {test_id(t) for t in result.unexpectedSuccesses}
    failed = len(failed_ids)
    skipped = len(result.skipped)
    passed = max(result.testsRun - len({i for i in failed_ids if "(" not in i}) - skipped, 0)
    if result.testsRun == 0:
        failed = max(failed, 1)
    line = f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
    summary = os.environ.get("SDK_SUMMARY_FILE")
    if summary:
        Path(summary).write_text(line + "\n")
    else:
        print(line)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
