#!/usr/bin/env python3
"""Fakes of the clouds switchyard's `gemini`, `vertex` and `bedrock` providers call.

    python3 fake_clouds.py --config CONFIG.json [--host 127.0.0.1] [--port 0] [--port-file PATH]

One process, one port (0: the OS picks; the bound port is written to
--port-file atomically, and `fake clouds listening on HOST:PORT` is printed).
Needs `botocore` (the SigV4 check) and `cryptography` (the JWT check);
tests/sdk/run.sh installs both into the SDK venv. Used by test_clouds.py.

What it serves, by path:

  POST /v1beta/models/{model}:generateContent            Gemini API
  POST /v1beta/models/{model}:streamGenerateContent?alt=sse
  POST /v1beta/models/{model}:batchEmbedContents
      auth: header `x-goog-api-key` must be one of `gemini_keys`; a `key=`
      query parameter is REJECTED (403), so a key in the URL shows.
  POST /v1/projects/{p}/locations/{l}/publishers/google/models/{m}:generateContent
  POST /v1/projects/{p}/locations/{l}/publishers/google/models/{m}:streamGenerateContent?alt=sse
  POST /v1/projects/{p}/locations/{l}/publishers/anthropic/models/{m}:rawPredict
  POST /v1/projects/{p}/locations/{l}/publishers/anthropic/models/{m}:streamRawPredict
      Vertex AI. auth: `Authorization: Bearer T` where T was issued by /token
      or the metadata server below, or is a self-signed service-account JWT
      (RS256 by a configured service account's key, `scope` with
      cloud-platform or `aud` https://aiplatform.googleapis.com/), which real
      Google also accepts and which google-cloud-auth 1.x sends for a
      service-account key. Anthropic: the body must carry
      `"anthropic_version": "vertex-2023-10-16"` and no `model`.
  POST /token                         OAuth 2.0 JWT-bearer exchange (service-account
                                      `token_uri`): RS256 verified with the SA's
                                      public key; iss, aud (this URL or Google's
                                      https://oauth2.googleapis.com/token), scope, exp.
  GET  /computeMetadata/v1/...        GCE metadata server (needs `Metadata-Flavor: Google`):
                                      instance/service-accounts/default/token[?scopes=],
                                      .../default/email, .../default/scopes,
                                      .../default/?recursive=true,
                                      universe/universe-domain, project/project-id
  POST /v1/messages                   the Anthropic Messages API: `x-api-key` one of
                                      `anthropic_keys`, an `anthropic-version` header,
                                      `model` in the body (service "anthropic")
  POST /model/{modelId}/converse      AWS Bedrock Converse (JSON)
  POST /model/{modelId}/converse-stream   (application/vnd.amazon.eventstream)
      auth: SigV4 (service `bedrock`, the configured region), checked by
      re-signing with botocore's own SigV4Auth at the request's X-Amz-Date
      over the headers its SignedHeaders lists (host and x-amz-date required;
      x-amz-security-token too with temporary credentials), for any configured
      or issued credential set; or `Authorization: Bearer KEY` for a
      configured Bedrock API key.
  POST / (Action=AssumeRoleWithWebIdentity)   AWS STS (query protocol, XML answer)
  GET  /container-creds                       ECS/EKS container credentials
                                              (`Authorization` must be the token)
  GET  /container-creds/rotating/{seconds}    a NEW set on every fetch, its Expiration
                                              `seconds` away; issuing it retires every earlier
                                              rotating set (Bedrock answers ExpiredTokenException
                                              for a retired or expired set)
  GET  /_calls                        {"counts": {...}, "calls": [...], "rejections": [...],
                                       "issued": {...}}: what was called, by service and model
  POST /_reset                        forget calls, counts and rejections (not issued credentials)
  POST /_control                      switches, merged: {"fail": {ROAD: STATUS or null}} makes a road
                                      answer STATUS whatever the model (ROAD: gemini, vertex,
                                      vertex-anthropic, anthropic, bedrock; `container`: both
                                      container-credentials paths, recorded as container:failed);
                                      {"mds_expires_in": N}
                                      the metadata server's token lifetime (default 3599);
                                      {"mds_grace": S}: a metadata token is refused S s after its
                                      successor was issued (default 1.5);
                                      {"mds_garbage": N}: the next N metadata token requests
                                      answer 200 with the body `\x00\x01garbage{` (recorded as
                                      mds:token-garbage), then it heals;
                                      {"mds_hang": N}: the next N metadata token requests hang:
                                      the connection is held, never answered, for `mds_hang_seconds`
                                      (default 60; sooner if the client hangs up), then closed
                                      (recorded as mds:token-hang), then it heals;
                                      {"revoke_google_tokens": true}: every Google token issued so
                                      far is refused (401) from now on. Answers the switches.
  GET  /_health                       200 ok

Behaviour by model name / model id (a substring anywhere in it):
  exhausted     Gemini/Vertex: 429 RESOURCE_EXHAUSTED with a RetryInfo of 7s
  throttle      Bedrock: 429 ThrottlingException
  unavailable   503 (UNAVAILABLE / ServiceUnavailableException)
  toolong       400 context too long (Gemini INVALID_ARGUMENT "input token count ...
                exceeds the maximum number of tokens"; Bedrock ValidationException
                "Input is too long for requested model.")
  cut           streams: an error after the first text delta (Bedrock: a
                modelStreamErrorException event; Gemini/Vertex: an SSE `error`
                object and the end of the stream); plain requests answer normally
  streamquota   Gemini/Vertex streams: a 200 whose FIRST event is an SSE `error`
                429 RESOURCE_EXHAUSTED with a RetryInfo of 23s, then the end of
                the stream (no text at all); plain requests answer normally
  otherwise     a text answer "Hello from SERVICE MODEL"; a function/tool call
                to the first declared tool when the request declares tools and
                its last turn is not a tool result; "Got the NAME result from
                SERVICE MODEL" when the last turn is a tool result (checked: it
                must answer a call the previous assistant turn made, by name for
                Gemini, by id for Bedrock and Anthropic).

What every answered call also records in /_calls (beside the request): `images` (each
image the request carried, checked: base64 that decodes, PNG bytes when it says PNG;
Gemini `inlineData`, Anthropic `image` source base64/url, Converse `image.source.bytes`),
`json_output` and `schema` (Gemini `responseMimeType: application/json` with
`responseSchema`; Converse `outputConfig.textFormat` json_schema, its schema JSON text
parsed; the answer is then JSON fitting the schema), and `usage` ({"prompt",
"completion"}: the token counts the answer reports; an image adds to the prompt's).

The CONFIG file (JSON; every key optional):
  {"gemini_keys": ["..."], "anthropic_keys": ["..."],
   "aws": {"region": "us-east-1",
           "credentials": [{"name": "static", "access": "AKIA...", "secret": "...", "token": null}],
           "api_keys": ["..."]},
   "sts": {"role_arn": "arn:...", "token_file": "/path", "issue": {"access","secret","token"}},
   "container": {"auth_token": "...", "issue": {"access","secret","token"}},
   "google": {"project": "test-project", "location": "us-central1",
              "service_accounts": [{"client_email", "private_key_id", "public_key_pem"}],
              "mds_email": "..."}}
Credentials the STS or the container endpoint issue are accepted by Bedrock
from then on (as real AWS would).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import re
import secrets
import select
import socket
import struct
import sys
import threading
import time
import urllib.parse
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

MAX_CALLS = 2000
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
VERTEX_ANTHROPIC_VERSION = "vertex-2023-10-16"
GOOGLE_TOKEN_AUDIENCES = (
    "https://oauth2.googleapis.com/token",
    "https://www.googleapis.com/oauth2/v4/token",
    "https://accounts.google.com/o/oauth2/token",
)
AMZ_FMT = "%Y%m%dT%H%M%SZ"

# Google's field names (GenerateContentRequest); an unknown one is a 400 there.
GEMINI_REQUEST_KEYS = {
    "contents",
    "tools",
    "toolConfig",
    "safetySettings",
    "systemInstruction",
    "generationConfig",
    "cachedContent",
    "labels",
}
# ConverseRequest's body members (modelId is in the URI); Bedrock refuses others.
CONVERSE_KEYS = {
    "messages",
    "system",
    "inferenceConfig",
    "toolConfig",
    "guardrailConfig",
    "additionalModelRequestFields",
    "promptVariables",
    "additionalModelResponseFieldPaths",
    "requestMetadata",
    "performanceConfig",
    "serviceTier",
    "outputConfig",
}
ANTHROPIC_KEYS = {
    "anthropic_version",
    "messages",
    "max_tokens",
    "system",
    "tools",
    "tool_choice",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "thinking",
}
# A stream event padding field, as real Bedrock adds to every event payload.
BEDROCK_PAD = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0"


def words(text: str) -> list[str]:
    """Splits text into stream deltas that join back to it exactly."""
    parts = re.findall(r"\s*\S+", text)
    if not parts:
        return [text] if text else []
    tail = text[len("".join(parts)) :]
    if tail:
        parts[-1] += tail
    return parts


def b64url_decode(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_image(media_type: str, data, bad) -> dict:
    """A base64 image as a cloud takes it: decodable, and its bytes the type it claims
    (PNG only is checked by content). Returns what /_calls records of it."""
    if not isinstance(data, str) or not data:
        raise bad(f"fake: image data must be a non-empty base64 string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise bad("fake: image data is not valid base64") from None
    if media_type in ("image/png", "png") and not raw.startswith(PNG_MAGIC):
        raise bad(f"fake: image declared {media_type} but its bytes are not a PNG")
    return {"media_type": media_type, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def json_for_schema(schema) -> object:
    """A value that fits a (simple) JSON schema: what a model constrained to it answers."""
    if not isinstance(schema, dict):
        return {}
    t = schema.get("type")
    t = t.lower() if isinstance(t, str) else t
    if t == "object" or "properties" in schema:
        return {k: json_for_schema(v) for k, v in (schema.get("properties") or {}).items()}
    if t == "array":
        return [json_for_schema(schema.get("items") or {})]
    if t in ("integer", "number"):
        return 18
    if t == "boolean":
        return True
    if schema.get("enum"):
        return schema["enum"][0]
    return "Paris"


def iso_z(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- AWS event stream (application/vnd.amazon.eventstream) --------------------------------


def es_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude (total length, headers length), prelude CRC32,
    headers (string-typed, type 7), payload, message CRC32 (of everything before it)."""
    hb = b""
    for name, value in headers.items():
        n, v = name.encode(), value.encode()
        hb += bytes([len(n)]) + n + bytes([7]) + struct.pack(">H", len(v)) + v
    total = 4 + 4 + 4 + len(hb) + len(payload) + 4
    prelude = struct.pack(">II", total, len(hb))
    head = prelude + struct.pack(">I", zlib.crc32(prelude) & 0xFFFFFFFF)
    msg = head + hb + payload
    return msg + struct.pack(">I", zlib.crc32(msg) & 0xFFFFFFFF)


def es_event(event_type: str, payload: dict) -> bytes:
    body = dict(payload)
    body["p"] = BEDROCK_PAD[: 1 + len(event_type) % len(BEDROCK_PAD)]
    return es_message(
        {":event-type": event_type, ":content-type": "application/json", ":message-type": "event"},
        json.dumps(body).encode(),
    )


def es_exception(exception_type: str, message: str, **extra) -> bytes:
    return es_message(
        {":exception-type": exception_type, ":content-type": "application/json", ":message-type": "exception"},
        json.dumps({"message": message, **extra}).encode(),
    )


def server_side_signer():
    """botocore's SigV4Auth, choosing headers as the server does: every header the request
    lists in SignedHeaders (botocore as a client leaves out some, e.g. user-agent,
    traceparent, expect; a signer that includes them is still right)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import HTTPHeaders

    class ServerSideSigV4Auth(SigV4Auth):
        def headers_to_sign(self, request):
            header_map = HTTPHeaders()
            for name, value in request.headers.items():
                header_map[name.lower()] = value
            return header_map

    return ServerSideSigV4Auth


# ---- state ---------------------------------------------------------------------------------


class State:
    def __init__(self, config: dict) -> None:
        self.lock = threading.Lock()
        self.sign_lock = threading.Lock()
        self.config = config
        self.calls: list[dict] = []
        self.counts: dict[str, int] = {}
        self.rejections: list[dict] = []
        self.google_tokens: dict[str, str] = {}  # token -> how it was issued ("sa:EMAIL", "mds")
        # token -> {"expires": epoch, "retired": epoch or None}: a token is refused past either
        # (a metadata-server token is retired `mds_grace` s after its successor is issued).
        self.google_token_life: dict[str, dict] = {}
        # Switched by POST /_control (see the docstring): failures by road, the metadata
        # server's token lifetime and the grace an old token keeps after a successor.
        self.control: dict = {
            "fail": {},
            "mds_expires_in": 3599,
            "mds_grace": 1.5,
            "mds_garbage": 0,
            "mds_hang": 0,
            "mds_hang_seconds": 60,
        }
        self.control.update(config.get("control") or {})
        self.anthropic_keys = set(config.get("anthropic_keys") or [])
        aws = config.get("aws") or {}
        self.region = aws.get("region", "us-east-1")
        self.aws_creds: dict[str, dict] = {}  # access key id -> {name, access, secret, token}
        for c in aws.get("credentials") or []:
            self.aws_creds[c["access"]] = dict(c)
        self.bedrock_api_keys = set(aws.get("api_keys") or [])
        self.gemini_keys = set(config.get("gemini_keys") or [])
        g = config.get("google") or {}
        self.project = g.get("project", "test-project")
        self.location = g.get("location", "us-central1")
        self.service_accounts = {sa["client_email"]: sa for sa in g.get("service_accounts") or []}
        self.mds_email = g.get("mds_email", "default-sa@test-project.iam.gserviceaccount.com")

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def record(self, service: str, model: str, path: str, headers, body, auth: str = "") -> dict:
        """Records a call; the returned dict takes what the answer says later (`usage`,
        `images`, `json_output`) for /_calls."""
        entry = {
            "service": service,
            "model": model,
            "path": path,
            "auth": auth,
            "headers": {k.lower(): v for k, v in headers.items()},
            "body": body,
        }
        with self.lock:
            key = f"{service}:{model}" if model else service
            self.counts[key] = self.counts.get(key, 0) + 1
            self.calls.append(entry)
            del self.calls[:-MAX_CALLS]
        return entry

    def note(self, entry: dict, **fields) -> None:
        with self.lock:
            entry.update(fields)

    def failing(self, road: str) -> int | None:
        """The status POST /_control set for `road` (gemini, vertex, vertex-anthropic,
        anthropic, bedrock), if any."""
        with self.lock:
            return (self.control.get("fail") or {}).get(road)

    def reject(self, service: str, path: str, status: int, reason: str) -> None:
        with self.lock:
            self.rejections.append({"service": service, "path": path, "status": status, "reason": reason})
            del self.rejections[:-MAX_CALLS]
        sys.stderr.write(f"fake clouds: {service} {path}: {status} {reason}\n")

    def snapshot(self) -> dict:
        with self.lock:
            return json.loads(
                json.dumps(
                    {
                        "counts": self.counts,
                        "calls": self.calls,
                        "rejections": self.rejections,
                        "control": self.control,
                        "issued": {
                            "google_tokens": self.google_tokens,
                            "google_token_life": self.google_token_life,
                            "aws_access_keys": sorted(self.aws_creds),
                            # Sets the fake made up itself (rotating container credentials).
                            "aws_rotated": [c for c in self.aws_creds.values() if c.get("name") == "rotating"],
                        },
                    }
                )
            )

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.counts.clear()
            self.rejections.clear()


class Reject(Exception):
    """An answer other than the happy one: status, headers, body."""

    def __init__(self, status: int, body: bytes, headers: dict | None = None, reason: str = "") -> None:
        super().__init__(reason or body.decode(errors="replace"))
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.reason = reason


def google_error(status: int, gstatus: str, message: str, details: list | None = None) -> Reject:
    err = {"code": status, "message": message, "status": gstatus}
    if details is not None:
        err["details"] = details
    return Reject(status, json.dumps({"error": err}).encode(), {"Content-Type": "application/json"}, message)


def aws_error(status: int, etype: str, message: str, namespace: str = "com.amazon.bedrock") -> Reject:
    return Reject(
        status,
        json.dumps({"message": message}).encode(),
        {
            "Content-Type": "application/json",
            "x-amzn-ErrorType": f"{etype}:http://internal.amazon.com/coral/{namespace}/",
        },
        f"{etype}: {message}",
    )


def sts_error(code: str, message: str, status: int = 400) -> Reject:
    xml = (
        '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
        f"<Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>"
        f"<RequestId>{secrets.token_hex(8)}</RequestId></ErrorResponse>"
    )
    return Reject(status, xml.encode(), {"Content-Type": "text/xml"}, f"{code}: {message}")


# ---- the handler ---------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-clouds/1"
    state: State  # set on the subclass

    def log_message(self, fmt, *args):  # quiet
        if os.environ.get("FAKE_CLOUDS_VERBOSE"):
            sys.stderr.write("[fake clouds] " + (fmt % args) + "\n")

    # ---- plumbing ----------------------------------------------------------------------------

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, obj, headers: dict | None = None) -> None:
        self.send(status, json.dumps(obj).encode(), headers)

    def start_chunked(self, status: int, content_type: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def json_body(self, raw: bytes, err) -> dict:
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise err("the body is not JSON") from None
        if not isinstance(body, dict):
            raise err("the body is not a JSON object")
        return body

    # ---- dispatch ----------------------------------------------------------------------------

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def dispatch(self, method: str) -> None:
        raw = self.read_body() if method == "POST" else b""
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        service = "?"
        try:
            if path == "/_health":
                return self.send(200, b"ok", {"Content-Type": "text/plain"})
            if path == "/_calls":
                return self.send_json(200, self.state.snapshot())
            if path == "/_reset" and method == "POST":
                self.state.reset()
                return self.send_json(200, {"ok": True})
            if path == "/_control" and method == "POST":
                change = json.loads(raw or b"{}")
                with self.state.lock:
                    if change.pop("revoke_google_tokens", None):
                        # Every Google token issued so far is refused from now on.
                        for life in self.state.google_token_life.values():
                            life["retired"] = time.time() - 1
                    fail = dict(self.state.control.get("fail") or {})
                    for road, status in (change.pop("fail", None) or {}).items():
                        if status is None:
                            fail.pop(road, None)
                        else:
                            fail[road] = int(status)
                    self.state.control.update(change, fail=fail)
                    now = dict(self.state.control)
                return self.send_json(200, now)
            if path == "/" and method == "GET" and self.headers.get("Metadata-Flavor"):
                service = "mds"  # the metadata server's root, as clients ping it
                return self.send(
                    200, b"computeMetadata/\n", {"Content-Type": "application/text", "Metadata-Flavor": "Google"}
                )
            if path.startswith("/computeMetadata/"):
                service = "mds"
                return self.metadata(method, path, query)
            if path == "/token" and method == "POST":
                service = "oauth"
                return self.oauth_token(raw)
            if path == "/container-creds" and method == "GET":
                service = "container"
                return self.container_creds()
            if path.startswith("/container-creds/rotating/") and method == "GET":
                service = "container"
                return self.container_creds_rotating(int(path.rsplit("/", 1)[1]))
            if path == "/v1/messages" and method == "POST":
                service = "anthropic"
                return self.anthropic_api(raw)
            if path.startswith("/v1beta/") and method == "POST":
                service = "gemini"
                return self.gemini(path, query, raw)
            if path.startswith("/v1/projects/") and method == "POST":
                service = "vertex"
                return self.vertex(path, query, raw)
            if path.startswith("/model/") and method == "POST":
                service = "bedrock"
                return self.bedrock(path, raw)
            if path in ("/", "/sts", "/sts/") and method == "POST":
                service = "sts"
                return self.sts(raw, query)
            raise Reject(404, json.dumps({"error": f"fake clouds: no route {method} {path}"}).encode())
        except Reject as r:
            self.state.reject(service, self.path, r.status, r.reason or r.body.decode(errors="replace"))
            self.send(r.status, r.body, r.headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---- Google: auth ------------------------------------------------------------------------

    def issue_google_token(self, how: str, expires_in: int = 3599) -> str:
        token = f"ya29.fake-{how.split(':')[0]}-{secrets.token_urlsafe(24)}"
        now = time.time()
        with self.state.lock:
            if how == "mds":
                # Its successor retires every earlier metadata-server token after a grace.
                grace = float(self.state.control.get("mds_grace", 1.5))
                for t, life in self.state.google_token_life.items():
                    if self.state.google_tokens.get(t) == "mds" and life["retired"] is None:
                        life["retired"] = now + grace
            self.state.google_tokens[token] = how
            self.state.google_token_life[token] = {"issued": now, "expires": now + expires_in, "retired": None}
        return token

    def verify_jwt(self, jwt: str, err) -> tuple[dict, dict]:
        """(header, claims) of an RS256 JWT signed by a configured service account."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        parts = jwt.split(".")
        if len(parts) != 3:
            raise err("not a JWT (three dot-separated parts)")
        try:
            header = json.loads(b64url_decode(parts[0]))
            claims = json.loads(b64url_decode(parts[1]))
            sig = b64url_decode(parts[2])
        except ValueError:
            raise err("the JWT's parts are not base64url JSON") from None
        if header.get("alg") != "RS256":
            raise err(f"JWT alg {header.get('alg')!r}, want RS256")
        sa = self.state.service_accounts.get(claims.get("iss"))
        if sa is None:
            raise err(f"JWT iss {claims.get('iss')!r} is no known service account")
        if header.get("kid") not in (None, sa.get("private_key_id")):
            raise err(f"JWT kid {header.get('kid')!r} is not the key's private_key_id")
        key = serialization.load_pem_public_key(sa["public_key_pem"].encode())
        try:
            key.verify(sig, f"{parts[0]}.{parts[1]}".encode(), padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            raise err("the JWT's RS256 signature does not verify with the service account's public key") from None
        now = time.time()
        exp, iat = claims.get("exp"), claims.get("iat")
        if not isinstance(exp, (int, float)) or exp < now - 60:
            raise err(f"JWT exp {exp!r} is missing or past")
        if not isinstance(iat, (int, float)) or iat > now + 300 or exp - iat > 3600 + 60:
            raise err(f"JWT iat {iat!r} is missing, in the future, or more than an hour before exp")
        return header, claims

    def oauth_token(self, raw: bytes) -> None:
        def err(msg):
            return Reject(
                400,
                json.dumps({"error": "invalid_grant", "error_description": msg}).encode(),
                {"Content-Type": "application/json"},
                msg,
            )

        ctype = self.headers.get("Content-Type", "")
        if not ctype.startswith("application/x-www-form-urlencoded"):
            raise err(f"Content-Type {ctype!r}, want application/x-www-form-urlencoded")
        form = urllib.parse.parse_qs(raw.decode(), keep_blank_values=True)
        if form.get("grant_type") != [JWT_BEARER]:
            raise err(f"grant_type {form.get('grant_type')!r}, want {JWT_BEARER}")
        assertion = (form.get("assertion") or [""])[0]
        _, claims = self.verify_jwt(assertion, err)
        # Google's endpoint takes its own URL as aud (google-auth always sends the default
        # https://oauth2.googleapis.com/token, whatever the key's token_uri); this one is at the token_uri.
        want_aud = {f"http://{self.headers.get('Host')}/token", *GOOGLE_TOKEN_AUDIENCES}
        if claims.get("aud") not in want_aud:
            raise err(f"JWT aud {claims.get('aud')!r}, want the token_uri or Google's token URL ({sorted(want_aud)})")
        if CLOUD_PLATFORM not in str(claims.get("scope", "")).split():
            raise err(f"JWT scope {claims.get('scope')!r} lacks {CLOUD_PLATFORM}")
        token = self.issue_google_token(f"sa:{claims['iss']}")
        self.state.record("oauth", "token_exchange", self.path, self.headers, {"iss": claims["iss"]})
        self.send_json(200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})

    def metadata(self, method: str, path: str, query: dict) -> None:
        flavor = {"Metadata-Flavor": "Google"}
        if self.headers.get("Metadata-Flavor") != "Google":
            raise Reject(
                403,
                b"Missing Metadata-Flavor:Google header.",
                {"Content-Type": "text/html", **flavor},
                "no Metadata-Flavor: Google",
            )
        if method != "GET":
            raise Reject(405, b"method not allowed", {"Content-Type": "text/plain", **flavor})
        sa = "/computeMetadata/v1/instance/service-accounts/"
        m = re.fullmatch(re.escape(sa) + r"(default|[^/]+@[^/]+)(/.*)?", path)
        if m:
            rest = m.group(2) or "/"
            if rest == "/token":
                with self.state.lock:
                    garbage = int(self.state.control.get("mds_garbage") or 0)
                    if garbage > 0:
                        self.state.control["mds_garbage"] = garbage - 1
                if garbage > 0:
                    # A broken metadata server: 200, its flavor header, and no JSON at all.
                    self.state.record("mds", "token-garbage", self.path, self.headers, None)
                    return self.send(200, b"\x00\x01garbage{", {"Content-Type": "application/json", **flavor})
                with self.state.lock:
                    hang = int(self.state.control.get("mds_hang") or 0)
                    if hang > 0:
                        self.state.control["mds_hang"] = hang - 1
                    hang_for = float(self.state.control.get("mds_hang_seconds", 60))
                if hang > 0:
                    # A stuck metadata server: the request was read, no answer ever comes.
                    self.state.record("mds", "token-hang", self.path, self.headers, None)
                    return self.hold(hang_for)
                scopes = (query.get("scopes") or [""])[0]
                if scopes and CLOUD_PLATFORM not in scopes.split(","):
                    raise Reject(
                        400,
                        f"scopes {scopes!r} lack {CLOUD_PLATFORM}".encode(),
                        {"Content-Type": "text/plain", **flavor},
                    )
                with self.state.lock:
                    expires_in = int(self.state.control.get("mds_expires_in", 3599))
                token = self.issue_google_token("mds", expires_in)
                self.state.record("mds", "token", self.path, self.headers, {"scopes": scopes})
                return self.send_json(
                    200,
                    {"access_token": token, "expires_in": expires_in, "token_type": "Bearer"},
                    {"Content-Type": "application/json", **flavor},
                )
            self.state.record("mds", rest.strip("/") or "account", self.path, self.headers, None)
            if rest == "/email":
                return self.send(200, self.state.mds_email.encode(), {"Content-Type": "text/plain", **flavor})
            if rest == "/scopes":
                return self.send(200, (CLOUD_PLATFORM + "\n").encode(), {"Content-Type": "text/plain", **flavor})
            if rest == "/aliases":
                return self.send(200, b"default\n", {"Content-Type": "text/plain", **flavor})
            if rest == "/":
                if query.get("recursive") == ["true"]:
                    return self.send_json(
                        200,
                        {"aliases": ["default"], "email": self.state.mds_email, "scopes": [CLOUD_PLATFORM]},
                        {"Content-Type": "application/json", **flavor},
                    )
                return self.send(
                    200, b"aliases\nemail\nidentity\nscopes\ntoken\n", {"Content-Type": "text/plain", **flavor}
                )
        simple = {
            "/computeMetadata/v1/universe/universe-domain": "googleapis.com",
            "/computeMetadata/v1/project/project-id": self.state.project,
            "/computeMetadata/v1/instance/zone": f"projects/123456789/zones/{self.state.location}-a",
            "/computeMetadata/v1/": "instance/\nproject/\nuniverse/\n",
            "/computeMetadata/v1/instance/service-accounts/": "default/\n" + self.state.mds_email + "/\n",
        }
        if path in simple:
            self.state.record("mds", path.rsplit("/", 1)[-1] or "root", self.path, self.headers, None)
            return self.send(200, simple[path].encode(), {"Content-Type": "text/plain", **flavor})
        raise Reject(404, b"not found", {"Content-Type": "text/plain", **flavor}, f"no metadata at {path}")

    def hold(self, seconds: float) -> None:
        """Holds the connection without a byte of answer for `seconds` (bounded), or until
        the client hangs up, then closes it (this thread only; the server serves on)."""
        deadline = time.monotonic() + seconds
        sock = self.connection
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            readable, _, _ = select.select([sock], [], [], min(left, 0.5))
            if readable:
                try:
                    if not sock.recv(1, socket.MSG_PEEK):
                        break  # the client hung up
                except OSError:
                    break
                time.sleep(min(left, 0.5))  # bytes of a next request: still no answer
        self.close_connection = True

    def vertex_bearer(self) -> str:
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            raise google_error(401, "UNAUTHENTICATED", "Request is missing required authentication credential.")
        token = auth[len("Bearer ") :]
        with self.state.lock:
            how = self.state.google_tokens.get(token)
            life = self.state.google_token_life.get(token)
        if how:
            now = time.time()
            if life and now > life["expires"]:
                raise google_error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials: expired")
            if life and life["retired"] is not None and now > life["retired"]:
                raise google_error(
                    401,
                    "UNAUTHENTICATED",
                    "Request had invalid authentication credentials (fake: a retired token, "
                    f"{now - life['retired']:.1f} s past its grace after a successor was issued)",
                )
            return how

        def err(msg):
            return google_error(401, "UNAUTHENTICATED", f"Request had invalid authentication credentials: {msg}")

        if token.count(".") == 2:  # a self-signed service-account JWT
            _, claims = self.verify_jwt(token, err)
            scope_ok = CLOUD_PLATFORM in str(claims.get("scope", "")).split()
            aud_ok = str(claims.get("aud", "")).rstrip("/") == "https://aiplatform.googleapis.com"
            if not (scope_ok or aud_ok):
                raise err(f"self-signed JWT has neither scope {CLOUD_PLATFORM} nor aud aiplatform")
            return f"self-signed:{claims['iss']}"
        raise err("unknown access token")

    # ---- Gemini API / Vertex (Google) ---------------------------------------------------------

    def gemini(self, path: str, query: dict, raw: bytes) -> None:
        if "key" in query:
            raise google_error(
                403,
                "PERMISSION_DENIED",
                "fake: the API key came in the URL (key=); it must travel in x-goog-api-key only",
            )
        key = self.headers.get("x-goog-api-key")
        if not key:
            raise google_error(
                403,
                "PERMISSION_DENIED",
                "Method doesn't allow unregistered callers (callers without established identity). "
                "Please use API Key or other form of API consumer identity to call this API.",
            )
        if key not in self.state.gemini_keys:
            raise google_error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.")
        m = re.fullmatch(r"/v1beta/models/([^/:]+):(\w+)", path)
        if not m:
            raise google_error(404, "NOT_FOUND", f"fake: no Gemini API method at {path}")
        model, op = urllib.parse.unquote(m.group(1)), m.group(2)
        self.google_generate("gemini", model, op, query, raw, auth="api-key", vertex=False)

    def vertex(self, path: str, query: dict, raw: bytes) -> None:
        m = re.fullmatch(
            r"/v1/projects/([^/]+)/locations/([^/]+)/publishers/(google|anthropic)/models/([^/:]+):(\w+)", path
        )
        if not m:
            raise google_error(404, "NOT_FOUND", f"fake: no Vertex method at {path}")
        project, location, publisher, model, op = m.groups()
        model = urllib.parse.unquote(model)
        if (project, location) != (self.state.project, self.state.location):
            raise google_error(
                403,
                "PERMISSION_DENIED",
                f"fake: project/location {project}/{location}, want {self.state.project}/{self.state.location}",
            )
        if "key" in query:
            raise google_error(400, "INVALID_ARGUMENT", "fake: a key= query parameter on Vertex")
        how = self.vertex_bearer()
        if publisher == "anthropic":
            if op not in ("rawPredict", "streamRawPredict"):
                raise google_error(404, "NOT_FOUND", f"fake: method {op} not served for anthropic")
            return self.anthropic_messages("vertex-anthropic", model, op == "streamRawPredict", raw, how)
        self.google_generate("vertex", model, op, query, raw, auth=how, vertex=True)

    def google_generate(
        self, service: str, model: str, op: str, query: dict, raw: bytes, auth: str, vertex: bool
    ) -> None:
        def bad(msg):
            return google_error(400, "INVALID_ARGUMENT", msg)

        body = self.json_body(raw, bad)
        entry = self.state.record(service, model, self.path, self.headers, body, auth)
        failing = self.state.failing(service)
        if failing:
            raise google_error(failing, "UNAVAILABLE", f"fake: {service} is switched to fail ({failing})")
        if op == "batchEmbedContents" and not vertex:
            return self.gemini_embed(model, body, bad)
        if op not in ("generateContent", "streamGenerateContent"):
            raise google_error(404, "NOT_FOUND", f"fake: method {op} not served")
        stream = op == "streamGenerateContent"
        if stream and query.get("alt") != ["sse"]:
            raise bad("fake: streamGenerateContent without alt=sse (switchyard reads SSE)")
        unknown = set(body) - GEMINI_REQUEST_KEYS
        if unknown:
            name = sorted(unknown)[0]
            raise bad(f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.')
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            raise bad("* GenerateContentRequest.contents: contents is not specified")
        for i, c in enumerate(contents):
            role = c.get("role")
            if role not in ("user", "model", "function") and not (role is None and not vertex):
                raise bad(f"Please use a valid role: user, model. (contents[{i}].role = {role!r})")
            if not isinstance(c.get("parts"), list) or not c["parts"]:
                raise bad(f"* GenerateContentRequest.contents[{i}].parts: contents.parts must not be empty.")
        si = body.get("systemInstruction")
        if si is not None and not (isinstance(si, dict) and isinstance(si.get("parts"), list)):
            raise bad("fake: systemInstruction must be a Content ({parts: [...]})")
        images = []
        for c in contents:
            for part in c["parts"]:
                if "inlineData" in part or "inline_data" in part:
                    blob = part.get("inlineData") or part.get("inline_data")
                    mime = blob.get("mimeType") or blob.get("mime_type")
                    if not mime:
                        raise bad("* GenerateContentRequest.contents[].parts[].inline_data.mime_type: required")
                    if mime.startswith("image/"):
                        images.append(check_image(mime, blob.get("data"), bad))
        gen = body.get("generationConfig") or {}
        json_schema = None
        if "responseSchema" in gen or "responseJsonSchema" in gen:
            if gen.get("responseMimeType") != "application/json":
                raise bad("response_mime_type: must be application/json when response_schema is set")
            json_schema = gen.get("responseSchema") or gen.get("responseJsonSchema")
            if not isinstance(json_schema, dict) or "type" not in json_schema:
                raise bad("* GenerationConfig.response_schema: a Schema object with a type is required")
        self.state.note(
            entry, images=images, json_output=gen.get("responseMimeType") == "application/json", schema=json_schema
        )

        if "exhausted" in model:
            raise google_error(
                429,
                "RESOURCE_EXHAUSTED",
                "Resource has been exhausted (e.g. check quota).",
                [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}],
            )
        if "unavailable" in model:
            raise google_error(503, "UNAVAILABLE", "The model is overloaded. Please try again later.")
        if "toolong" in model:
            raise bad("The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).")

        declarations = [
            d
            for t in body.get("tools") or []
            for d in (t.get("functionDeclarations") or t.get("function_declarations") or [])
        ]
        last = contents[-1]
        responses = [p["functionResponse"] for p in last["parts"] if "functionResponse" in p]
        label = f"{service} {model}"
        if responses:
            prev = contents[-2] if len(contents) >= 2 else {}
            called = [p["functionCall"].get("name") for p in prev.get("parts", []) if "functionCall" in p]
            for fr in responses:
                if not fr.get("name"):
                    raise bad(
                        "* GenerateContentRequest.contents[].parts[].function_response.name: Name cannot be empty."
                    )
                if fr["name"] not in called:
                    raise bad(
                        f"fake: functionResponse name {fr['name']!r} answers no functionCall of the previous "
                        f"model turn (calls: {called})"
                    )
                if not isinstance(fr.get("response"), dict):
                    raise bad("Invalid JSON payload received. functionResponse.response must be an object (Struct).")
            if len(responses) != len(called):
                raise bad(
                    f"Please ensure that the number of function response parts is equal to the number of "
                    f"function call parts of the function call turn ({len(responses)} != {len(called)})."
                )
            parts = [{"text": f"Got the {responses[0]['name']} result from {label}"}]
            finish = "STOP"
        elif declarations and (body.get("toolConfig") or {}).get("functionCallingConfig", {}).get("mode") != "NONE":
            d = declarations[0]
            parts = [{"functionCall": {"name": d["name"], "args": {"location": "Paris, France", "unit": "celsius"}}}]
            finish = "STOP"
        elif gen.get("responseMimeType") == "application/json":
            parts = [{"text": json.dumps(json_for_schema(json_schema) if json_schema else {"answer": label})}]
            finish = "STOP"
        else:
            parts = [{"text": f"Hello from {label}"}]
            finish = "STOP"

        prompt_tokens = 8 + 250 * len(images)
        text = "".join(p.get("text", "") for p in parts)
        out_tokens = max(len(words(text)), 1) + (5 if "functionCall" in parts[0] else 0)
        usage = {
            "promptTokenCount": prompt_tokens,
            "candidatesTokenCount": out_tokens,
            "totalTokenCount": prompt_tokens + out_tokens,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt_tokens}],
        }
        self.state.note(entry, usage={"prompt": prompt_tokens, "completion": out_tokens})
        response_id = secrets.token_urlsafe(16)
        common = {"modelVersion": model, "responseId": response_id}
        if vertex:
            common["createTime"] = dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z")
        if not stream:
            return self.send_json(
                200,
                {
                    "candidates": [
                        {
                            "content": {"parts": parts, "role": "model"},
                            "finishReason": finish,
                            "avgLogprobs": -0.0123,
                            "index": 0,
                        }
                    ],
                    "usageMetadata": usage,
                    **common,
                },
            )
        # Stream: text in word pieces (one GenerateContentResponse per `data:`), the last
        # chunk with finishReason and the full usage; a function call comes whole.
        self.start_chunked(200, "text/event-stream")
        if "streamquota" in model:
            # Quota refused in-band: the status is 200, the first (and only) event an error.
            err = {
                "error": {
                    "code": 429,
                    "message": "Resource has been exhausted (e.g. check quota).",
                    "status": "RESOURCE_EXHAUSTED",
                    "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "23s"}],
                }
            }
            self.chunk(f"data: {json.dumps(err)}\r\n\r\n".encode())
            return self.end_chunked()
        if "text" in parts[0]:
            pieces = words(parts[0]["text"])
        else:
            pieces = [None]
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            cand = {"content": {"parts": [{"text": piece}] if piece is not None else parts, "role": "model"}}
            if final:
                cand["finishReason"] = finish
            elif not vertex:
                cand["index"] = 0
            chunk = {"candidates": [cand], **common}
            if final:
                chunk["usageMetadata"] = usage
            elif not vertex:
                chunk["usageMetadata"] = {"promptTokenCount": prompt_tokens, "totalTokenCount": prompt_tokens}
            self.chunk(f"data: {json.dumps(chunk)}\r\n\r\n".encode())
            if "cut" in model and i == 0 and not final:
                err = {
                    "error": {"code": 503, "message": "The service is currently unavailable.", "status": "UNAVAILABLE"}
                }
                self.chunk(f"data: {json.dumps(err)}\r\n\r\n".encode())
                break
            time.sleep(0.005)
        self.end_chunked()

    def gemini_embed(self, model: str, body: dict, bad) -> None:
        reqs = body.get("requests")
        if not isinstance(reqs, list) or not reqs:
            raise bad("* BatchEmbedContentsRequest.requests: requests is not specified")
        out = []
        for i, r in enumerate(reqs):
            if r.get("model") != f"models/{model}":
                raise bad(f"requests[{i}].model {r.get('model')!r} must be models/{model}")
            text = "".join(p.get("text", "") for p in (r.get("content") or {}).get("parts") or [])
            default_dim = 3072 if "gemini-embedding" in model else 768 if "text-embedding" in model else 8
            dim = int(r.get("outputDimensionality") or default_dim)
            h = hashlib.sha256(text.encode()).digest()
            out.append({"values": [round((h[j % 32] - 128) / 128, 6) for j in range(dim)]})
        self.send_json(200, {"embeddings": out})

    # ---- Vertex: Anthropic ---------------------------------------------------------------------

    def anthropic_api(self, raw: bytes) -> None:
        """The Anthropic Messages API itself (`POST /v1/messages`, `x-api-key`)."""

        def err(status, etype, msg):
            return Reject(
                status,
                json.dumps({"type": "error", "error": {"type": etype, "message": msg}}).encode(),
                {"Content-Type": "application/json", "request-id": f"req_{secrets.token_hex(8)}"},
                msg,
            )

        key = self.headers.get("x-api-key")
        if not key or key not in self.state.anthropic_keys:
            raise err(401, "authentication_error", "invalid x-api-key")
        if not self.headers.get("anthropic-version"):
            raise err(400, "invalid_request_error", "anthropic-version: header is required")
        body = self.json_body(raw, lambda m: err(400, "invalid_request_error", m))
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise err(400, "invalid_request_error", "model: Field required")
        self.anthropic_messages("anthropic", model, bool(body.get("stream")), raw, "api-key")

    def anthropic_messages(self, service: str, model: str, stream: bool, raw: bytes, how: str) -> None:
        """Anthropic Messages: on Vertex (`vertex-anthropic`: model in the URL,
        `anthropic_version` in the body) or the Anthropic API (`anthropic`)."""
        vertex = service == "vertex-anthropic"

        def bad(msg):
            return Reject(
                400,
                json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": msg}}).encode(),
                {"Content-Type": "application/json"},
                msg,
            )

        body = self.json_body(raw, bad)
        entry = self.state.record(service, model, self.path, self.headers, body, how)
        allowed = ANTHROPIC_KEYS if vertex else (ANTHROPIC_KEYS - {"anthropic_version"}) | {"model", "service_tier"}
        if vertex and "model" in body:
            raise bad("model: Extra inputs are not permitted (on Vertex the model is in the URL)")
        if vertex and body.get("anthropic_version") != VERTEX_ANTHROPIC_VERSION:
            raise bad(f"anthropic_version {body.get('anthropic_version')!r}, want {VERTEX_ANTHROPIC_VERSION!r}")
        unknown = set(body) - allowed
        if unknown:
            raise bad(f"{sorted(unknown)[0]}: Extra inputs are not permitted")
        if not isinstance(body.get("max_tokens"), int):
            raise bad("max_tokens: Field required")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or msgs[0].get("role") != "user":
            raise bad('messages: the first message must use the "user" role')
        if vertex and stream and body.get("stream") is not True:
            raise bad('fake: streamRawPredict without "stream": true')
        if vertex and not stream and body.get("stream"):
            raise bad('fake: rawPredict with "stream": true')
        images = []
        for i, msg in enumerate(msgs):
            for b in msg.get("content") if isinstance(msg.get("content"), list) else []:
                if isinstance(b, dict) and b.get("type") == "image":
                    src = b.get("source") or {}
                    if src.get("type") == "base64":
                        if src.get("media_type") not in ("image/jpeg", "image/png", "image/gif", "image/webp"):
                            raise bad(f"messages.{i}: image source.media_type {src.get('media_type')!r}")
                        images.append({"source": "base64", **check_image(src["media_type"], src.get("data"), bad)})
                    elif src.get("type") == "url":
                        images.append({"source": "url", "url": src.get("url")})
                    else:
                        raise bad(f"messages.{i}: image source.type {src.get('type')!r}")
        self.state.note(entry, images=images)
        failing = self.state.failing(service)
        if failing:
            raise Reject(
                failing,
                json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}).encode(),
                {"Content-Type": "application/json"},
                f"fake: {service} is switched to fail ({failing})",
            )
        if "exhausted" in model:
            raise google_error(
                429,
                "RESOURCE_EXHAUSTED",
                "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model "
                f"with base model: anthropic-{model}. Please submit a quota increase request.",
            )
        if "unavailable" in model:
            raise Reject(
                529,
                json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}).encode(),
                {"Content-Type": "application/json"},
                "overloaded",
            )

        label = f"{service} {model}"
        last = msgs[-1]
        content = last.get("content")
        results = (
            [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
            if isinstance(content, list)
            else []
        )
        if results:
            prev = msgs[-2] if len(msgs) >= 2 else {}
            ids = [
                b.get("id") for b in prev.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_use"
            ]
            for r in results:
                if r.get("tool_use_id") not in ids:
                    raise bad(
                        f"messages: tool_result {r.get('tool_use_id')!r} answers no tool_use of the previous turn"
                    )
            blocks = [{"type": "text", "text": f"Got the tool result from {label}"}]
            stop = "end_turn"
        elif body.get("tools") and (body.get("tool_choice") or {}).get("type") != "none":
            t = body["tools"][0]
            blocks = [
                {
                    "type": "tool_use",
                    "id": f"toolu_vrtx_{secrets.token_hex(8)}",
                    "name": t["name"],
                    "input": {"location": "Paris, France", "unit": "celsius"},
                }
            ]
            stop = "tool_use"
        else:
            blocks = [{"type": "text", "text": f"Hello from {label}"}]
            stop = "end_turn"
        msg_id = f"msg_vrtx_{secrets.token_hex(10)}" if vertex else f"msg_{secrets.token_hex(12)}"
        upstream_model = model.replace("@", "-")
        usage = {"input_tokens": 12 + 300 * len(images), "output_tokens": 9}
        self.state.note(entry, usage={"prompt": usage["input_tokens"], "completion": usage["output_tokens"]})
        if not stream:
            return self.send_json(
                200,
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": upstream_model,
                    "content": blocks,
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": usage,
                },
            )

        def ev(name, data):
            self.chunk(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        self.start_chunked(200, "text/event-stream")
        ev(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": upstream_model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 1},
                },
            },
        )
        ev("ping", {"type": "ping"})
        for i, b in enumerate(blocks):
            if b["type"] == "text":
                ev(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
                )
                for n, piece in enumerate(words(b["text"])):
                    ev(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": piece}},
                    )
                    if "cut" in model and n == 0:
                        ev("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
                        return self.end_chunked()
            else:
                ev(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}},
                    },
                )
                args = json.dumps(b["input"])
                for j in range(0, len(args), 7):
                    ev(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": args[j : j + 7]},
                        },
                    )
            ev("content_block_stop", {"type": "content_block_stop", "index": i})
        ev(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 9},
            },
        )
        ev("message_stop", {"type": "message_stop"})
        self.end_chunked()

    # ---- AWS: auth -----------------------------------------------------------------------------

    def aws_auth(self, raw: bytes) -> str:
        """Checks the request's Bedrock API key or SigV4 signature; returns how it authenticated."""
        st = self.state
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            if auth[len("Bearer ") :] in st.bedrock_api_keys:
                return "api-key"
            raise aws_error(
                403, "AccessDeniedException", "Authentication failed: Please make sure your API Key is valid."
            )
        m = re.fullmatch(
            r"AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
            r"SignedHeaders=([a-z0-9;_.-]+),\s*Signature=([0-9a-f]{64})",
            auth,
        )
        if not m:
            raise aws_error(
                403,
                "MissingAuthenticationTokenException" if not auth else "IncompleteSignatureException",
                f"fake: no SigV4 Authorization header (got {auth[:40]!r})",
                "com.amazon.coral.service",
            )
        access, date, region, service, signed, _sig = m.groups()
        if region != st.region or service != "bedrock":
            raise aws_error(
                403,
                "InvalidSignatureException",
                f"Credential should be scoped to a valid region/service: {region}/{service}, want {st.region}/bedrock",
                "com.amazon.coral.service",
            )
        with st.lock:
            cred = st.aws_creds.get(access)
        if cred is None:
            raise aws_error(
                403,
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
                "com.amazon.coral.service",
            )
        if cred.get("retired") or (cred.get("expires") and time.time() > cred["expires"]):
            raise aws_error(
                403,
                "ExpiredTokenException",
                "The security token included in the request is expired "
                f"(fake: {'retired by a newer set' if cred.get('retired') else 'past its Expiration'}).",
                "com.amazon.coral.service",
            )
        amz_date = self.headers.get("X-Amz-Date", "")
        try:
            when = dt.datetime.strptime(amz_date, AMZ_FMT)
        except ValueError:
            raise aws_error(
                403,
                "IncompleteSignatureException",
                f"fake: X-Amz-Date {amz_date!r} is not {AMZ_FMT}",
                "com.amazon.coral.service",
            ) from None
        if amz_date[:8] != date:
            raise aws_error(
                403,
                "InvalidSignatureException",
                "Date in Credential scope does not match X-Amz-Date",
                "com.amazon.coral.service",
            )
        skew = abs((when.replace(tzinfo=dt.timezone.utc) - dt.datetime.now(dt.timezone.utc)).total_seconds())
        if skew > 300:
            raise aws_error(
                403,
                "InvalidSignatureException",
                f"Signature expired: X-Amz-Date is {skew:.0f} s off",
                "com.amazon.coral.service",
            )
        if cred.get("token") and self.headers.get("X-Amz-Security-Token") != cred["token"]:
            raise aws_error(
                403,
                "UnrecognizedClientException",
                "The security token included in the request is invalid (X-Amz-Security-Token).",
                "com.amazon.coral.service",
            )
        names = signed.split(";")
        if "host" not in names or "x-amz-date" not in names:
            raise aws_error(
                403,
                "InvalidSignatureException",
                f"fake: SignedHeaders {signed} lack host or x-amz-date",
                "com.amazon.coral.service",
            )
        hdrs = {}
        for name in names:
            value = self.headers.get(name)
            if value is None:
                raise aws_error(
                    403,
                    "InvalidSignatureException",
                    f"fake: signed header {name} is not in the request",
                    "com.amazon.coral.service",
                )
            hdrs[name] = value
        declared = self.headers.get("X-Amz-Content-SHA256")
        if declared is not None and declared != hashlib.sha256(raw).hexdigest():
            raise aws_error(
                400,
                "XAmzContentSHA256Mismatch",
                "The provided 'x-amz-content-sha256' header does not match what was computed.",
                "com.amazon.coral.service",
            )

        # Re-sign with botocore at the request's own time, over exactly the headers the
        # request says it signed, and compare.
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        req = AWSRequest(
            method=self.command, url=f"http://{self.headers.get('Host')}{self.path}", data=raw, headers=hdrs
        )
        signer = server_side_signer()(
            Credentials(cred["access"], cred["secret"], cred.get("token")), "bedrock", st.region
        )
        with st.sign_lock, mock.patch("botocore.auth.get_current_datetime", return_value=when):
            signer.add_auth(req)
        want = req.headers["Authorization"]
        norm = lambda s: re.sub(r",\s*", ", ", s.strip())  # noqa: E731
        if norm(want) != norm(auth):
            raise aws_error(
                403,
                "InvalidSignatureException",
                "The request signature we calculated does not match the signature you provided. Check your AWS "
                f"Secret Access Key and signing method. (fake: botocore signed {want!r}, the request had {auth!r})",
                "com.amazon.coral.service",
            )
        return f"sigv4:{cred.get('name', access)}"

    def sts(self, raw: bytes, query: dict) -> None:
        form = urllib.parse.parse_qs(raw.decode(errors="replace"), keep_blank_values=True)
        for k, v in query.items():
            form.setdefault(k, v)
        one = lambda k: (form.get(k) or [None])[0]  # noqa: E731
        cfg = self.state.config.get("sts") or {}
        self.state.record(
            "sts",
            one("Action") or "?",
            self.path,
            self.headers,
            {k: ("<token>" if k == "WebIdentityToken" else v[0]) for k, v in form.items()},
        )
        if one("Action") != "AssumeRoleWithWebIdentity":
            raise sts_error("InvalidAction", f"fake: action {one('Action')!r} not served")
        if one("Version") != "2011-06-15":
            raise sts_error("InvalidParameterValue", f"Version {one('Version')!r}, want 2011-06-15")
        if not one("RoleSessionName"):
            raise sts_error("ValidationError", "RoleSessionName is required")
        if cfg.get("role_arn") and one("RoleArn") != cfg["role_arn"]:
            raise sts_error(
                "AccessDenied", f"Not authorized to perform sts:AssumeRoleWithWebIdentity on {one('RoleArn')!r}", 403
            )
        want = open(cfg["token_file"]).read() if cfg.get("token_file") else None
        if want is None or one("WebIdentityToken") != want:
            raise sts_error("InvalidIdentityToken", "Couldn't retrieve verification key from your identity provider")
        issue = cfg["issue"]
        with self.state.lock:
            self.state.aws_creds[issue["access"]] = {"name": "web-identity", **issue}
        exp = iso_z(time.time() + 3600)
        role = one("RoleArn").replace(":iam::", ":sts::").replace(":role/", ":assumed-role/")
        assumed_arn = f"{role}/{one('RoleSessionName')}"
        xml = f"""<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <AssumeRoleWithWebIdentityResult>
    <SubjectFromWebIdentityToken>system:serviceaccount:default:switchyard</SubjectFromWebIdentityToken>
    <Audience>sts.amazonaws.com</Audience>
    <AssumedRoleUser>
      <Arn>{assumed_arn}</Arn>
      <AssumedRoleId>AROA3XFRBF535PLBIFPI4:{one("RoleSessionName")}</AssumedRoleId>
    </AssumedRoleUser>
    <Credentials>
      <SessionToken>{issue["token"]}</SessionToken>
      <SecretAccessKey>{issue["secret"]}</SecretAccessKey>
      <Expiration>{exp}</Expiration>
      <AccessKeyId>{issue["access"]}</AccessKeyId>
    </Credentials>
    <Provider>arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/FAKE</Provider>
  </AssumeRoleWithWebIdentityResult>
  <ResponseMetadata>
    <RequestId>{secrets.token_hex(16)}</RequestId>
  </ResponseMetadata>
</AssumeRoleWithWebIdentityResponse>
"""
        self.send(200, xml.encode(), {"Content-Type": "text/xml"})

    def container_failing(self) -> None:
        """POST /_control {"fail": {"container": STATUS}}: the endpoint answers STATUS."""
        failing = self.state.failing("container")
        if failing:
            self.state.record("container", "failed", self.path, self.headers, None)
            raise Reject(
                failing,
                json.dumps({"code": "InternalError", "message": f"fake: container credentials ({failing})"}).encode(),
                reason=f"container credentials: switched to fail ({failing})",
            )

    def container_creds(self) -> None:
        self.container_failing()
        cfg = self.state.config.get("container") or {}
        self.state.record("container", "creds", self.path, self.headers, None)
        if not cfg or self.headers.get("Authorization") != cfg.get("auth_token"):
            raise Reject(
                401,
                json.dumps({"code": "Unauthorized", "message": "fake: wrong or missing Authorization"}).encode(),
                reason="container credentials: bad Authorization",
            )
        issue = cfg["issue"]
        with self.state.lock:
            self.state.aws_creds[issue["access"]] = {"name": "container", **issue}
        self.send_json(
            200,
            {
                "RoleArn": "arn:aws:iam::123456789012:role/fake-task-role",
                "AccessKeyId": issue["access"],
                "SecretAccessKey": issue["secret"],
                "Token": issue["token"],
                "Expiration": iso_z(time.time() + 3600),
            },
        )

    def container_creds_rotating(self, lifetime: int) -> None:
        """A new credential set on every fetch, valid `lifetime` s; issuing it retires
        every earlier rotating set (Bedrock refuses those from then on)."""
        self.container_failing()
        cfg = self.state.config.get("container") or {}
        self.state.record("container", "rotating", self.path, self.headers, None)
        if not cfg or self.headers.get("Authorization") != cfg.get("auth_token"):
            raise Reject(
                401,
                json.dumps({"code": "Unauthorized", "message": "fake: wrong or missing Authorization"}).encode(),
                reason="container credentials: bad Authorization",
            )
        expires = time.time() + lifetime
        issue = {
            "name": "rotating",
            "access": "ASIA" + secrets.token_hex(8).upper(),
            "secret": secrets.token_urlsafe(30),
            "token": "IQoJb3JpZ2luROT" + secrets.token_urlsafe(48),
            "expires": expires,
            "retired": False,
        }
        with self.state.lock:
            for c in self.state.aws_creds.values():
                if c.get("name") == "rotating":
                    c["retired"] = True
            self.state.aws_creds[issue["access"]] = issue
        self.send_json(
            200,
            {
                "RoleArn": "arn:aws:iam::123456789012:role/fake-task-role",
                "AccessKeyId": issue["access"],
                "SecretAccessKey": issue["secret"],
                "Token": issue["token"],
                "Expiration": iso_z(expires),
            },
        )

    # ---- Bedrock Converse ------------------------------------------------------------------------

    def bedrock(self, path: str, raw: bytes) -> None:
        m = re.fullmatch(r"/model/([^/]+)/(converse|converse-stream)", path)
        if not m:
            raise aws_error(404, "UnknownOperationException", f"fake: no Bedrock operation at {path}")
        model = urllib.parse.unquote(m.group(1))
        stream = m.group(2) == "converse-stream"
        how = self.aws_auth(raw)

        def bad(msg):
            return aws_error(400, "ValidationException", msg)

        body = self.json_body(raw, bad)
        entry = self.state.record("bedrock", model, self.path, self.headers, body, how)
        unknown = set(body) - CONVERSE_KEYS
        if unknown:
            raise bad(
                f"Malformed input request: extraneous key [{sorted(unknown)[0]}] is not permitted, "
                "please reformat your input and try again."
            )
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("The model returned the following errors: messages: at least one message is required")
        if msgs[0].get("role") != "user":
            raise bad(
                "A conversation must start with a user message. Try again with a conversation that starts "
                "with a user message."
            )
        for i, msg in enumerate(msgs):
            if msg.get("role") not in ("user", "assistant"):
                raise bad(f"messages.{i}.role: must be user or assistant")
            if i and msg.get("role") == msgs[i - 1].get("role"):
                raise bad(
                    "A conversation must alternate between user and assistant roles. Make sure the "
                    "conversation alternates between user and assistant roles and try again."
                )
            if not isinstance(msg.get("content"), list) or not msg["content"]:
                raise bad(f"messages.{i}.content: must be a non-empty list of content blocks")
            for b in msg["content"]:
                if not isinstance(b, dict) or len(b) != 1:
                    raise bad(f"messages.{i}.content: each content block is a union with exactly one member: {b!r}")
        system = body.get("system")
        if system is not None and not (isinstance(system, list) and all(isinstance(s, dict) for s in system)):
            raise bad("system: must be a list of SystemContentBlock")
        images = []
        for i, msg in enumerate(msgs):
            for b in msg["content"]:
                if "image" in b:
                    img = b["image"]
                    if img.get("format") not in ("png", "jpeg", "gif", "webp"):
                        raise bad(f"messages.{i}: image.format {img.get('format')!r} is not png, jpeg, gif or webp")
                    src = img.get("source") or {}
                    if set(src) != {"bytes"} and set(src) != {"s3Location"}:
                        raise bad(f"messages.{i}: image.source is a union: bytes or s3Location ({sorted(src)})")
                    if "bytes" in src:
                        images.append(check_image(f"image/{img['format']}", src["bytes"], bad))
        # OutputConfig.textFormat (botocore's shape): {type: json_schema, structure: {jsonSchema:
        # {schema: "<JSON text>", name?, description?}}}.
        schema = None
        out_cfg = body.get("outputConfig")
        if out_cfg is not None:
            tf = out_cfg.get("textFormat") if isinstance(out_cfg, dict) else None
            if set(out_cfg) - {"textFormat", "effort"}:
                raise bad(f"outputConfig: unknown member {sorted(set(out_cfg) - {'textFormat', 'effort'})}")
            if tf is not None:
                if tf.get("type") != "json_schema" or set(tf) != {"type", "structure"}:
                    raise bad(f"outputConfig.textFormat: type json_schema and structure required, got {tf!r}")
                js = (tf.get("structure") or {}).get("jsonSchema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), str):
                    raise bad("outputConfig.textFormat.structure.jsonSchema.schema: a JSON string is required")
                if set(js) - {"schema", "name", "description"}:
                    raise bad(f"jsonSchema: unknown member {sorted(set(js) - {'schema', 'name', 'description'})}")
                try:
                    schema = json.loads(js["schema"])
                except ValueError:
                    raise bad("outputConfig.textFormat.structure.jsonSchema.schema is not valid JSON") from None
        self.state.note(entry, images=images, json_output=schema is not None, schema=schema)
        failing = self.state.failing("bedrock")
        if failing:
            raise aws_error(failing, "ServiceUnavailableException", f"fake: bedrock is switched to fail ({failing})")

        if "throttle" in model:
            raise aws_error(429, "ThrottlingException", "Too many requests, please wait before trying again.")
        if "unavailable" in model:
            raise aws_error(503, "ServiceUnavailableException", "Bedrock is unable to process your request.")
        if "toolong" in model:
            raise bad("Input is too long for requested model.")

        tools = [t["toolSpec"] for t in (body.get("toolConfig") or {}).get("tools") or [] if "toolSpec" in t]
        last = msgs[-1]
        results = [b["toolResult"] for b in last["content"] if "toolResult" in b]
        label = f"bedrock {model}"
        if results:
            prev = msgs[-2] if len(msgs) >= 2 else {}
            ids = [b["toolUse"].get("toolUseId") for b in prev.get("content", []) if "toolUse" in b]
            for r in results:
                if r.get("toolUseId") not in ids:
                    raise bad(
                        f"fake: toolResult {r.get('toolUseId')!r} answers no toolUse of the previous turn ({ids})"
                    )
                if not isinstance(r.get("content"), list):
                    raise bad("toolResult.content must be a list of ToolResultContentBlock")
            if not tools:
                raise bad("The toolConfig field must be defined when using toolUse and toolResult content blocks.")
            blocks = [{"text": f"Got the tool result from {label}"}]
            stop = "end_turn"
        elif tools:
            blocks = [
                {
                    "toolUse": {
                        "toolUseId": f"tooluse_{secrets.token_urlsafe(16)}",
                        "name": tools[0]["name"],
                        "input": {"location": "Paris, France", "unit": "celsius"},
                    }
                }
            ]
            stop = "tool_use"
        elif schema is not None:
            blocks = [{"text": json.dumps(json_for_schema(schema))}]
            stop = "end_turn"
        else:
            blocks = [{"text": f"Hello from {label}"}]
            stop = "end_turn"
        usage = {"inputTokens": 11 + 400 * len(images), "outputTokens": 7}
        usage["totalTokens"] = usage["inputTokens"] + usage["outputTokens"]
        self.state.note(entry, usage={"prompt": usage["inputTokens"], "completion": usage["outputTokens"]})
        if not stream:
            return self.send_json(
                200,
                {
                    "output": {"message": {"role": "assistant", "content": blocks}},
                    "stopReason": stop,
                    "usage": usage,
                    "metrics": {"latencyMs": 123},
                },
                {"Content-Type": "application/json", "x-amzn-RequestId": secrets.token_hex(16)},
            )

        self.start_chunked(200, "application/vnd.amazon.eventstream", {"x-amzn-RequestId": secrets.token_hex(16)})
        self.chunk(es_event("messageStart", {"role": "assistant"}))
        for i, b in enumerate(blocks):
            if "text" in b:
                for n, piece in enumerate(words(b["text"])):
                    self.chunk(es_event("contentBlockDelta", {"contentBlockIndex": i, "delta": {"text": piece}}))
                    if "cut" in model and n == 0:
                        self.chunk(
                            es_exception(
                                "modelStreamErrorException",
                                "The model stream was interrupted (fake cut).",
                                originalStatusCode=500,
                                originalMessage="fake cut",
                            )
                        )
                        return self.end_chunked()
                    time.sleep(0.005)
            else:
                tu = b["toolUse"]
                self.chunk(
                    es_event(
                        "contentBlockStart",
                        {
                            "contentBlockIndex": i,
                            "start": {"toolUse": {"toolUseId": tu["toolUseId"], "name": tu["name"]}},
                        },
                    )
                )
                args = json.dumps(tu["input"])
                for j in range(0, len(args), 9):
                    self.chunk(
                        es_event(
                            "contentBlockDelta",
                            {"contentBlockIndex": i, "delta": {"toolUse": {"input": args[j : j + 9]}}},
                        )
                    )
            self.chunk(es_event("contentBlockStop", {"contentBlockIndex": i}))
        self.chunk(es_event("messageStop", {"stopReason": stop}))
        self.chunk(es_event("metadata", {"usage": usage, "metrics": {"latencyMs": 123}}))
        self.end_chunked()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.environ.get("FAKE_CLOUDS_CONFIG"), help="the JSON config (see above)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    args = ap.parse_args()
    config = json.load(open(args.config)) if args.config else {}

    handler = type("BoundHandler", (Handler,), {"state": State(config)})
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"fake clouds listening on {host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
