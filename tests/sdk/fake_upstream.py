#!/usr/bin/env python3
"""A scriptable fake OpenAI Chat Completions upstream, standard library only.

    python3 fake_upstream.py --name primary [--host 127.0.0.1] [--port 0] [--port-file PATH]

It binds the port (0: the OS picks a free one), writes the bound port to
--port-file (atomically, via rename) and prints `fake upstream NAME listening
on HOST:PORT` on stdout. Used by tests/sdk/run.sh; also handy by hand.

Endpoints
  POST .../chat/completions   an OpenAI chat completion, plain or streamed (SSE,
                              chunked transfer encoding), text or tool calls
  POST .../responses          an OpenAI Responses answer (a `response` object, or
                              the typed event stream): "Hello from NAME over
                              Responses", or one `function_call` per function
                              tool (at most two); `fake_upstream` scripts
                              `status` and `cut_after` as for chat. A request
                              with `previous_response_id` is a 400
                              `previous_response_not_found`: this fake keeps
                              nothing, so a gateway must send the conversation.
  GET  .../models             one model object
  GET  /_calls                every chat request seen so far (newest last):
                              {"name", "path", "headers", "body"}
  GET  /_health               200 "ok"

What a chat request gets is scripted by the request itself:

* by the upstream model name (what switchyard writes into `model`):
    fail-NNN      status NNN with an OpenAI-format error body (e.g. fail-503)
    html-NNN      status NNN with an HTML body (not OpenAI format)
    inband-NNN    200 whose JSON body is {"error": {"code": NNN, ...}}
    slow-MS       answers normally after MS milliseconds
* by a body field `fake_upstream` (the SDK's `extra_body`): an object keyed by
  upstream name (`--name`), or "*" for every upstream, whose value may hold
    status      int     answer this status with an OpenAI-format error body
    message     str     the error message for `status` (default: "fake NAME error NNN")
    error_type  str     the error `type` (default: invalid_request_error for 4xx)
    code        any     the error `code` (default: null)
    retry_after str     a Retry-After header on the error
    html        bool    with `status`: an HTML body instead of JSON
    inband      int     200 whose body is {"error": {"code": N, ...}} (no `choices`)
    delay       float   seconds to wait before the response head
    reply       str     the assistant text (default: "Hello from NAME")
    chunk_delay float   seconds between stream chunks
    cut_after   int     streams: drop the connection after this many content chunks
    stream_error_after int  streams: send an in-band {"error": ...} event after
                        this many content chunks (0: before any content)
    model       str     the `model` reported in the answer (default: the request's)
  e.g. extra_body={"fake_upstream": {"primary": {"status": 503}}}

A request whose `response_format` is a `json_schema` (and no scripted
`reply`) is answered with JSON that fits the schema (sample_of).

Tool calls: a request with `tools` (and `tool_choice` not "none") is answered
with one call per tool (at most two), arguments
{"location": "Paris, France", "unit": "celsius", "call": I}; streamed, the
arguments arrive in small fragments, the way OpenAI sends them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_CALLS = 2000


class State:
    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.counter = 0

    def record(self, path: str, headers, body) -> int:
        with self.lock:
            self.counter += 1
            self.calls.append(
                {
                    "name": self.name,
                    "path": path,
                    "headers": {k.lower(): v for k, v in headers.items()},
                    "body": body,
                }
            )
            del self.calls[:-MAX_CALLS]
            return self.counter


def error_json(status: int, message: str, etype: str | None = None, code=None) -> bytes:
    if etype is None:
        etype = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()


def sample_of(schema: dict):
    """A value that fits a JSON schema (what a model asked for JSON answers)."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: sample_of(v) for k, v in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [sample_of(schema.get("items") or {})]
    return {"string": "sample", "integer": 1, "number": 1.5, "boolean": True}.get(kind, None)


def words(text: str) -> list[str]:
    """Splits text into stream deltas that join back to it exactly."""
    parts = re.findall(r"\s*\S+", text)
    if not parts:
        return [text] if text else []
    tail = text[len("".join(parts)) :]
    if tail:
        parts[-1] += tail
    return parts


def tool_calls_for(tools: list, call_prefix: str) -> list[dict]:
    calls = []
    for i, tool in enumerate(tools[:2]):
        fn = (tool or {}).get("function") or {}
        args = json.dumps({"location": "Paris, France", "unit": "celsius", "call": i})
        calls.append(
            {
                "id": f"call_{call_prefix}_{i}",
                "type": "function",
                "function": {"name": fn.get("name", f"tool_{i}"), "arguments": args},
            }
        )
    return calls


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-openai/1"
    state: State  # set on the subclass

    def log_message(self, fmt, *args):  # quiet
        if os.environ.get("FAKE_UPSTREAM_VERBOSE"):
            sys.stderr.write(f"[{self.state.name}] " + (fmt % args) + "\n")

    # ---- plumbing -------------------------------------------------------
    def send_bytes(self, status: int, body: bytes, ctype="application/json", headers=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def event(self, obj) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        self.chunk(f"data: {payload}\n\n".encode())

    def drop(self) -> None:
        """Abort the connection mid-body (no terminating chunk)."""
        self.wfile.flush()
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close_connection = True

    # ---- endpoints ------------------------------------------------------
    def do_GET(self):
        if self.path == "/_calls":
            with self.state.lock:
                body = json.dumps(self.state.calls).encode()
            return self.send_bytes(200, body)
        if self.path == "/_health":
            return self.send_bytes(200, b"ok", "text/plain")
        if self.path.endswith("/models"):
            return self.send_bytes(
                200,
                json.dumps(
                    {
                        "object": "list",
                        "data": [{"id": "fake-chat", "object": "model", "created": 0, "owned_by": self.state.name}],
                    }
                ).encode(),
            )
        self.send_bytes(404, error_json(404, f"no route for GET {self.path}"))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not self.path.endswith(("/chat/completions", "/responses")):
            return self.send_bytes(404, error_json(404, f"no route for POST {self.path}"))
        try:
            req = json.loads(raw or b"null")
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            self.state.record(self.path, self.headers, raw.decode("utf-8", "replace"))
            return self.send_bytes(400, error_json(400, "fake upstream: body is not a JSON object"))
        n = self.state.record(self.path, self.headers, req)
        try:
            if self.path.endswith("/responses"):
                return self.responses_api(req, n)
            self.chat(req, n)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def chat(self, req: dict, n: int) -> None:
        name = self.state.name
        model = str(req.get("model") or "")
        scripts = req.get("fake_upstream") or {}
        script = dict(scripts.get("*") or {}) if isinstance(scripts, dict) else {}
        if isinstance(scripts, dict):
            script.update(scripts.get(name) or {})

        m = re.fullmatch(r"(fail|html|inband|slow)-(\d+)", model)
        if m:
            kind, num = m.group(1), int(m.group(2))
            if kind == "fail":
                script.setdefault("status", num)
            elif kind == "html":
                script.setdefault("status", num)
                script.setdefault("html", True)
            elif kind == "inband":
                script.setdefault("inband", num)
            else:
                script.setdefault("delay", num / 1000.0)

        if script.get("delay"):
            time.sleep(float(script["delay"]))

        status = script.get("status")
        if status:
            status = int(status)
            headers = {}
            if script.get("retry_after") is not None:
                headers["Retry-After"] = str(script["retry_after"])
            if script.get("html"):
                body = f"<html><body><h1>{status} from {name}</h1></body></html>".encode()
                return self.send_bytes(status, body, "text/html", headers)
            msg = script.get("message") or f"fake {name} error {status}"
            return self.send_bytes(
                status, error_json(status, msg, script.get("error_type"), script.get("code")), headers=headers
            )
        if script.get("inband"):
            code = int(script["inband"])
            body = json.dumps({"error": {"message": f"fake {name} in-band error", "code": code}}).encode()
            return self.send_bytes(200, body)

        reply = script.get("reply", f"Hello from {name}")
        fmt = req.get("response_format") or {}
        if "reply" not in script and fmt.get("type") == "json_schema":
            reply = json.dumps(sample_of(fmt.get("json_schema", {}).get("schema", {})))
        shown_model = script.get("model") or model or "fake-chat"
        tools = req.get("tools") or []
        use_tools = bool(tools) and req.get("tool_choice") != "none"
        cid = f"chatcmpl-{name}-{n}"
        created = int(time.time())
        if req.get("stream"):
            return self.stream(req, script, cid, created, shown_model, reply, use_tools, tools, n)

        if use_tools:
            message = {"role": "assistant", "content": None, "tool_calls": tool_calls_for(tools, f"{name}{n}")}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": reply}
            finish = "stop"
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": shown_model,
            "system_fingerprint": f"fp_{name}",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": len(words(reply)),
                "total_tokens": 5 + len(words(reply)),
            },
        }
        self.send_bytes(200, json.dumps(body).encode(), headers={"x-fake-upstream": name})

    def responses_api(self, req: dict, n: int) -> None:
        name = self.state.name
        scripts = req.get("fake_upstream") or {}
        script = dict(scripts.get("*") or {}) if isinstance(scripts, dict) else {}
        if isinstance(scripts, dict):
            script.update(scripts.get(name) or {})
        if script.get("status"):
            status = int(script["status"])
            return self.send_bytes(status, error_json(status, f"fake {name} error {status}"))
        if req.get("previous_response_id"):
            body = error_json(400, "Previous response not found.", code="previous_response_not_found")
            return self.send_bytes(400, body)
        rid, created, model = f"resp_{name}_{n}", int(time.time()), str(req.get("model") or "")
        reply = script.get("reply", f"Hello from {name} over Responses")
        tools = [t for t in req.get("tools") or [] if (t or {}).get("type") == "function"]
        if tools and req.get("tool_choice") != "none":
            output = []
            for i, tool in enumerate(tools[:2]):
                args = json.dumps({"location": "Paris, France", "unit": "celsius", "call": i})
                output.append({"type": "function_call", "id": f"fc_{name}{n}_{i}", "call_id": f"call_{name}{n}_{i}",
                               "name": tool.get("name", f"tool_{i}"), "arguments": args, "status": "completed"})
        else:
            part = {"type": "output_text", "text": reply, "annotations": [], "logprobs": []}
            output = [{"type": "message", "id": f"msg_{name}{n}", "status": "completed", "role": "assistant",
                       "content": [part]}]
        response = {"id": rid, "object": "response", "created_at": created, "status": "completed", "error": None,
                    "incomplete_details": None, "model": model, "output": output, "parallel_tool_calls": True,
                    "tool_choice": "auto", "tools": req.get("tools") or [], "store": True, "text": {"format": {"type": "text"}},
                    "usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": len(words(reply)), "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 5 + len(words(reply))}}
        if not req.get("stream"):
            return self.send_bytes(200, json.dumps(response).encode(), headers={"x-fake-upstream": name})
        self.responses_stream(response, script)

    def responses_stream(self, response: dict, script: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        seq = [0]

        def emit(kind: str, **fields) -> None:
            data = {"type": kind, "sequence_number": seq[0], **fields}
            seq[0] += 1
            self.chunk(f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode())

        begun = dict(response, status="in_progress", output=[], usage=None)
        emit("response.created", response=begun)
        emit("response.in_progress", response=begun)
        cut_after = script.get("cut_after")
        sent = 0
        for i, item in enumerate(response["output"]):
            if item["type"] == "function_call":
                emit("response.output_item.added", output_index=i, item=dict(item, arguments="", status="in_progress"))
                args = item["arguments"]
                for j in range(0, len(args), 7):
                    emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=args[j : j + 7])
                emit("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=args)
                emit("response.output_item.done", output_index=i, item=item)
                continue
            part = item["content"][0]
            emit("response.output_item.added", output_index=i, item=dict(item, status="in_progress", content=[]))
            emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=dict(part, text=""))
            for w in words(part["text"]):
                if cut_after is not None and sent == int(cut_after):
                    return self.drop()
                emit("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=w, logprobs=[])
                sent += 1
            emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
            emit("response.output_item.done", output_index=i, item=item)
        emit("response.completed", response=response)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def stream(self, req, script, cid, created, model, reply, use_tools, tools, n) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-fake-upstream", self.state.name)
        self.end_headers()

        def chunk(delta: dict, finish=None) -> dict:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": f"fp_{self.state.name}",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        cut_after = script.get("cut_after")
        err_after = script.get("stream_error_after")
        pause = float(script.get("chunk_delay") or 0)

        # A role-only first chunk, as OpenAI sends: not content, so switchyard holds it.
        self.event(chunk({"role": "assistant", "content": ""}))
        if use_tools:
            pieces = []
            for i, call in enumerate(tool_calls_for(tools, f"{self.state.name}{n}")):
                args = call["function"]["arguments"]
                head = {
                    "index": i,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""},
                }
                pieces.append({"tool_calls": [head]})
                for j in range(0, len(args), 7):
                    pieces.append({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 7]}}]})
            finish = "tool_calls"
        else:
            pieces = [{"content": w} for w in words(reply)]
            finish = "stop"

        sent = 0
        for delta in pieces:
            if err_after is not None and sent == int(err_after):
                self.event(
                    {"error": {"message": f"fake {self.state.name} stream error", "type": "server_error", "code": 500}}
                )
                return self.end_chunks()
            if cut_after is not None and sent == int(cut_after):
                return self.drop()
            if pause:
                time.sleep(pause)
            self.event(chunk(delta))
            sent += 1
        if err_after is not None and sent == int(err_after):
            self.event(
                {"error": {"message": f"fake {self.state.name} stream error", "type": "server_error", "code": 500}}
            )
            return self.end_chunks()
        if cut_after is not None and sent == int(cut_after):
            return self.drop()
        self.event(chunk({}, finish))
        opts = req.get("stream_options") or {}
        if opts.get("include_usage"):
            self.event(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": sent, "total_tokens": 5 + sent},
                }
            )
        self.event("[DONE]")
        self.end_chunks()

    def end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    args = ap.parse_args(argv)

    handler = type("BoundHandler", (Handler,), {"state": State(args.name)})
    server = Server((args.host, args.port), handler)
    port = server.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)
    print(f"fake upstream {args.name} listening on {args.host}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
