#!/usr/bin/env python3
"""The official `openai` Python SDK against a running switchyard.

Run through tests/sdk/run.sh, which starts two fake upstreams
(fake_upstream.py) and switchyard in front of them (routes.template.yaml) and
passes their addresses in the environment:

    SWITCHYARD_URL      http://127.0.0.1:PORT   (switchyard)
    SWITCHYARD_CONFIG   the routes.yaml it serves (the reload tests edit it)
    FAKE_PRIMARY_URL    http://127.0.0.1:PORT   (fake upstream "primary")
    FAKE_FALLBACK_URL   http://127.0.0.1:PORT   (fake upstream "fallback")
    PRIMARY_KEY, FALLBACK_KEY   the provider keys switchyard holds
    SWITCHYARD_BIN_PATH the binary (to run `switchyard validate` on the k8s example)
    SDK_SUMMARY_FILE    optional: where to write the closing "N passed, M failed" line

Plain unittest, so only `openai` needs installing. Every SDK client is made
with max_retries=0: what a test sees is what switchyard answered, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
from openai import AsyncOpenAI, OpenAI

ROOT = Path(__file__).resolve().parents[2]
# IsolatedAsyncioTestCase runs its loop in debug mode, which logs every slow step.
logging.getLogger("asyncio").setLevel(logging.ERROR)
ENV_NEEDED = ("SWITCHYARD_URL", "FAKE_PRIMARY_URL", "FAKE_FALLBACK_URL")

SY = os.environ.get("SWITCHYARD_URL", "")
PRIMARY = os.environ.get("FAKE_PRIMARY_URL", "")
FALLBACK = os.environ.get("FAKE_FALLBACK_URL", "")
CONFIG = os.environ.get("SWITCHYARD_CONFIG", "")
PRIMARY_KEY = os.environ.get("PRIMARY_KEY", "")
FALLBACK_KEY = os.environ.get("FALLBACK_KEY", "")
CLIENT_KEY = "sk-client-key-that-must-not-travel"

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time at a place",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    },
]
EXPECTED_ARGS = [
    {"location": "Paris, France", "unit": "celsius", "call": 0},
    {"location": "Paris, France", "unit": "celsius", "call": 1},
]


def setUpModule():
    missing = [k for k in ENV_NEEDED if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: run tests/sdk/run.sh")


# ---- helpers --------------------------------------------------------------


def client(**kw) -> OpenAI:
    kw.setdefault("timeout", 10.0)
    kw.setdefault("max_retries", 0)
    return OpenAI(base_url=f"{SY}/v1", api_key=CLIENT_KEY, **kw)


def aclient(**kw) -> AsyncOpenAI:
    kw.setdefault("timeout", 10.0)
    kw.setdefault("max_retries", 0)
    return AsyncOpenAI(base_url=f"{SY}/v1", api_key=CLIENT_KEY, **kw)


def rid() -> str:
    return f"sdk-{uuid.uuid4().hex[:16]}"


def msgs(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def calls(upstream_url: str, request_id: str) -> list[dict]:
    """The chat requests an upstream saw for one x-request-id."""
    _, body = get(f"{upstream_url}/_calls")
    return [c for c in json.loads(body) if c["headers"].get("x-request-id") == request_id]


def metrics() -> dict[str, float]:
    """`/metrics` as {'name{labels}': value} (labels as printed)."""
    status, text = get(f"{SY}/metrics")
    assert status == 200, status
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(name: str, **labels) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in metrics().items():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", key)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_for(pred, timeout: float = 5.0, step: float = 0.05):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= end:
            return v
        time.sleep(step)


def script(**per_upstream) -> dict:
    """extra_body for the fake upstreams: script(primary={"status": 503})."""
    return {"fake_upstream": per_upstream}


def assemble_tool_calls(chunks) -> dict[int, dict]:
    calls_by_index: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                slot = calls_by_index.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
    return calls_by_index


# ---- plain chat -------------------------------------------------------------


class SyncChat(unittest.TestCase):
    def test_chat_by_alias(self):
        r = client().chat.completions.create(model="gpt-4o-mini", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.model, "fake-chat")  # what the serving upstream reported
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_chat_by_task_name_and_by_header(self):
        c = client()
        r = c.chat.completions.create(model="chat", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")
        # x-task-type wins over `model`: the `failover` task's first target always 503s.
        raw = c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs(), extra_headers={"x-task-type": "failover"}
        )
        self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from fallback")

    def test_headers_on_a_first_target_answer(self):
        raw = client().chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs())
        self.assertEqual(raw.status_code, 200)
        h = raw.headers
        self.assertEqual(h["x-switchyard-target"], "primary-chat")
        self.assertEqual(h["x-switchyard-provider"], "primary")
        self.assertEqual(h["x-switchyard-attempts"], "1")
        self.assertEqual(h["x-switchyard-failovers"], "0")
        self.assertEqual(h["x-switchyard-degraded"], "false")
        self.assertTrue(h.get("x-request-id"))
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from primary")

    def test_request_id_round_trip_and_provider_keys(self):
        request_id = rid()
        r = client().chat.completions.create(
            model="gpt-4o-mini", messages=msgs(), extra_headers={"x-request-id": request_id}
        )
        self.assertEqual(r._request_id, request_id)
        seen = calls(PRIMARY, request_id)
        self.assertEqual(len(seen), 1)
        # switchyard holds the keys: the upstream gets the provider's key
        # (api_key_file here), never the one the client sent.
        self.assertEqual(seen[0]["headers"].get("authorization"), f"Bearer {PRIMARY_KEY}")
        self.assertNotIn(CLIENT_KEY, json.dumps(seen[0]))
        self.assertEqual(seen[0]["body"]["model"], "fake-chat")  # rewritten to the target's model
        self.assertEqual(seen[0]["path"], "/v1/chat/completions")

    def test_sdk_parameters_are_forwarded(self):
        request_id = rid()
        client().chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            temperature=0.2,
            max_tokens=7,
            seed=42,
            stop=["\n\n"],
            user="u-1",
            metadata={"k": "v"},
            extra_headers={"x-request-id": request_id},
        )
        body = calls(PRIMARY, request_id)[0]["body"]
        self.assertEqual(body["temperature"], 0.2)
        self.assertEqual(body["max_tokens"], 7)
        self.assertEqual(body["seed"], 42)
        self.assertEqual(body["stop"], ["\n\n"])
        self.assertEqual(body["user"], "u-1")
        self.assertEqual(body["metadata"], {"k": "v"})
        self.assertEqual(body["messages"][0], {"role": "system", "content": "be brief"})

    def test_models_list(self):
        ids = {m.id for m in client().models.list()}
        self.assertTrue({"chat", "gpt-4o-mini", "failover", "all-fail", "slow", "limited"} <= ids, ids)

    def test_models_retrieve(self):
        listed = {m.id: m for m in client().models.list()}
        for name in ("chat", "gpt-4o-mini"):  # a task name, an alias
            with self.subTest(name):
                m = client().models.retrieve(name)
                self.assertEqual((m.id, m.object, m.created, m.owned_by), (name, "model", 0, "switchyard"))
                self.assertEqual(m, listed[name])
        with self.assertRaises(openai.NotFoundError) as cm:
            client().models.retrieve("no-such-model")
        self.assertEqual(cm.exception.code, "model_not_found")
        self.assertEqual(cm.exception.type, "invalid_request_error")


# ---- failover, visible in the headers -----------------------------------------


class Failover(unittest.TestCase):
    def test_failover_after_503_with_retry(self):
        request_id = rid()
        raw = client().chat.completions.with_raw_response.create(
            model="failover", messages=msgs(), extra_headers={"x-request-id": request_id}
        )
        h = raw.headers
        self.assertEqual(h["x-switchyard-target"], "fallback-chat")
        self.assertEqual(h["x-switchyard-provider"], "fallback")
        self.assertEqual(h["x-switchyard-attempts"], "3")  # 503, one retry, then the fallback
        self.assertEqual(h["x-switchyard-failovers"], "1")
        self.assertEqual(h["x-switchyard-degraded"], "true")
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from fallback")
        self.assertEqual(len(calls(PRIMARY, request_id)), 2)
        fb = calls(FALLBACK, request_id)
        self.assertEqual(len(fb), 1)
        self.assertEqual(fb[0]["headers"].get("authorization"), f"Bearer {FALLBACK_KEY}")  # api_key_env

    def test_failover_scripted_by_body(self):
        raw = client().chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"status": 500})
        )
        self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
        self.assertEqual(raw.headers["x-switchyard-attempts"], "3")
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from fallback")

    def test_in_band_error_in_a_200_fails_over(self):
        raw = client().chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"inband": 503})
        )
        self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from fallback")

    def test_429_fails_over_without_retry(self):
        raw = client().chat.completions.with_raw_response.create(model="ratelimited", messages=msgs())
        self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
        self.assertIn(raw.headers["x-switchyard-attempts"], {"1", "2"})  # 2, or 1 while primary-429 cools down
        self.assertEqual(raw.parse().choices[0].message.content, "Hello from fallback")


# ---- errors: the SDK's exception classes and status codes ----------------------


class Errors(unittest.TestCase):
    def test_unknown_model_is_not_found(self):
        with self.assertRaises(openai.NotFoundError) as cm:
            client().chat.completions.create(model="no-such-model", messages=msgs())
        e = cm.exception
        self.assertEqual(e.status_code, 404)
        self.assertEqual(e.code, "model_not_found")
        self.assertEqual(e.type, "invalid_request_error")
        self.assertIn("no-such-model", e.message)
        self.assertTrue(e.request_id)

    def test_malformed_requests_are_bad_request(self):
        c = client()
        cases = {
            "stream not a boolean": dict(model="gpt-4o-mini", messages=msgs(), extra_body={"stream": "yes"}),
            "model not a string": dict(model=123, messages=msgs()),
            "model missing": dict(model=None, messages=msgs()),
        }
        for name, kw in cases.items():
            with self.subTest(name), self.assertRaises(openai.BadRequestError) as cm:
                c.chat.completions.create(**kw)
            self.assertEqual(cm.exception.status_code, 400)
            self.assertEqual(cm.exception.code, "invalid_request")
        named = {
            "messages": dict(messages=[]),
            "messages[1].role": dict(messages=msgs() + [{"content": "no role"}]),
            "max_tokens": dict(messages=msgs(), max_tokens=-1),
        }
        for param, kw in named.items():
            with self.subTest(param), self.assertRaises(openai.BadRequestError) as cm:
                c.chat.completions.create(model="gpt-4o-mini", **kw)
            self.assertEqual(cm.exception.type, "invalid_request_error")
            self.assertEqual(cm.exception.param, param)

    def test_all_targets_failed_is_502(self):
        request_id = rid()
        with self.assertRaises(openai.InternalServerError) as cm:
            client().chat.completions.create(
                model="all-fail", messages=msgs(), extra_headers={"x-request-id": request_id}
            )
        e = cm.exception
        self.assertEqual(e.status_code, 502)
        self.assertEqual(e.code, "all_targets_failed")
        self.assertIn("503", e.message)  # names the last upstream status...
        self.assertNotIn("fake", e.message)  # ...but never quotes upstream text
        self.assertEqual(e.request_id, request_id)
        self.assertEqual(e.response.headers["x-switchyard-attempts"], "4")
        self.assertEqual(e.response.headers["x-switchyard-failovers"], "1")
        self.assertNotIn("x-switchyard-target", e.response.headers)

    def test_streaming_request_that_fails_gets_the_status_not_a_stream(self):
        with self.assertRaises(openai.InternalServerError) as cm:
            client().chat.completions.create(model="all-fail", messages=msgs(), stream=True)
        self.assertEqual(cm.exception.status_code, 502)

    def test_upstream_400_is_relayed(self):
        for stream in (False, True):  # a streaming request gets the 400 too, never a 200 stream
            with self.subTest(stream=stream):
                request_id = rid()
                with self.assertRaises(openai.BadRequestError) as cm:
                    client().chat.completions.create(
                        model="gpt-4o-mini",
                        messages=msgs(),
                        stream=stream,
                        extra_headers={"x-request-id": request_id},
                        extra_body=script(
                            primary={"status": 400, "message": "messages must not be empty", "code": "empty"}
                        ),
                    )
                e = cm.exception
                self.assertEqual(e.status_code, 400)
                self.assertEqual(e.body["message"], "messages must not be empty")  # the upstream's own words
                self.assertEqual(e.code, "empty")
                self.assertEqual(e.response.headers["x-switchyard-target"], "primary-chat")
                self.assertEqual(e.response.headers["x-switchyard-attempts"], "1")
                self.assertEqual(calls(FALLBACK, request_id), [])  # the caller's fault: no failover

    def test_upstream_422_is_relayed_as_unprocessable(self):
        with self.assertRaises(openai.UnprocessableEntityError) as cm:
            client().chat.completions.create(
                model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"status": 422})
            )
        self.assertEqual(cm.exception.status_code, 422)

    def test_upstream_html_400_is_replaced_by_an_openai_error(self):
        with self.assertRaises(openai.BadRequestError) as cm:
            client().chat.completions.create(
                model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"status": 400, "html": True})
            )
        e = cm.exception
        self.assertEqual(e.code, "upstream_rejected")
        self.assertNotIn("<html", e.message)

    def test_provider_key_is_scrubbed_from_a_relayed_error(self):
        with self.assertRaises(openai.BadRequestError) as cm:
            client().chat.completions.create(
                model="gpt-4o-mini",
                messages=msgs(),
                extra_body=script(primary={"status": 400, "message": f"bad key {PRIMARY_KEY}"}),
            )
        self.assertNotIn(PRIMARY_KEY, cm.exception.message)
        self.assertNotIn(PRIMARY_KEY, cm.exception.response.text)
        self.assertIn("*****", cm.exception.message)

    def test_unknown_path_and_wrong_method(self):
        c = client()
        with self.assertRaises(openai.NotFoundError):
            c.get("/no/such/endpoint", cast_to=object)
        with self.assertRaises(openai.APIStatusError) as cm:
            c.get("/chat/completions", cast_to=object)
        self.assertEqual(cm.exception.status_code, 405)


# ---- streaming ------------------------------------------------------------------


class Streaming(unittest.TestCase):
    def test_stream_text_is_assembled(self):
        stream = client().chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs(),
            stream=True,
            stream_options={"include_usage": True},
            extra_body=script(primary={"reply": "The quick brown fox jumps over the lazy dog."}),
        )
        text, finish, usage, n = "", None, None, 0
        for ch in stream:
            n += 1
            self.assertEqual(ch.object, "chat.completion.chunk")
            if ch.usage:
                usage = ch.usage
            for choice in ch.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        self.assertEqual(text, "The quick brown fox jumps over the lazy dog.")
        self.assertEqual(finish, "stop")
        self.assertIsNotNone(usage)
        self.assertEqual(usage.completion_tokens, 9)
        self.assertGreaterEqual(n, 11)  # role chunk, 9 words, finish, usage
        self.assertTrue(stream.response.is_closed)  # ended cleanly at [DONE]

    def test_stream_headers_via_raw_response(self):
        raw = client().chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs(), stream=True)
        self.assertTrue(raw.headers["content-type"].startswith("text/event-stream"))
        self.assertEqual(raw.headers["x-switchyard-target"], "primary-chat")
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        self.assertEqual(text, "Hello from primary")

    def test_stream_helper_final_completion(self):
        with client().chat.completions.stream(model="gpt-4o-mini", messages=msgs()) as s:
            deltas = [e.delta for e in s if e.type == "content.delta"]
            final = s.get_final_completion()
        self.assertEqual("".join(deltas), "Hello from primary")
        self.assertEqual(final.choices[0].message.content, "Hello from primary")
        self.assertEqual(final.choices[0].finish_reason, "stop")

    def test_stream_fails_over_invisibly_before_the_commit_point(self):
        cases = {
            "503 status": {"status": 503},
            "in-band error before content": {"stream_error_after": 0},
            "cut before content": {"cut_after": 0},
        }
        for name, primary in cases.items():
            with self.subTest(name):
                raw = client().chat.completions.with_raw_response.create(
                    model="gpt-4o-mini", messages=msgs(), stream=True, extra_body=script(primary=primary)
                )
                self.assertEqual(raw.status_code, 200)
                self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
                self.assertEqual(raw.headers["x-switchyard-degraded"], "true")
                chunks = list(raw.parse())
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                self.assertEqual(text, "Hello from fallback")

    def test_stream_interrupted_after_commit_raises_api_error(self):
        before = metric("switchyard_stream_interrupts_total", target="primary-chat")
        stream = client().chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs(),
            stream=True,
            extra_body=script(primary={"reply": "one two three four", "cut_after": 2}),
        )
        got = []
        with self.assertRaises(openai.APIError) as cm:
            for ch in stream:
                for choice in ch.choices:
                    got.append(choice.delta.content or "")
        e = cm.exception
        self.assertNotIsInstance(e, openai.APIStatusError)  # the status was 200
        self.assertEqual("".join(got), "one two")  # nothing replayed, nothing after the break
        self.assertEqual(e.body.get("code"), "stream_interrupted")
        self.assertIn("incomplete", e.message)
        self.assertTrue(
            wait_for(lambda: metric("switchyard_stream_interrupts_total", target="primary-chat") > before),
            "switchyard_stream_interrupts_total did not move",
        )

    def test_in_band_error_after_commit_raises_api_error(self):
        stream = client().chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs(),
            stream=True,
            extra_body=script(primary={"reply": "one two three", "stream_error_after": 1}),
        )
        got = []
        with self.assertRaises(openai.APIError) as cm:
            for ch in stream:
                got.extend(c.delta.content or "" for c in ch.choices)
        self.assertEqual("".join(got), "one")
        self.assertEqual(cm.exception.body.get("code"), "stream_interrupted")

    def test_client_closing_a_stream_counts_as_cancelled(self):
        before = metric("switchyard_client_cancelled_total", task="chat")
        stream = client().chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs(),
            stream=True,
            extra_body=script(primary={"reply": "a b c d e f g h i j k l", "chunk_delay": 0.1}),
        )
        first = next(iter(stream))
        self.assertEqual(first.object, "chat.completion.chunk")
        stream.close()
        self.assertTrue(
            wait_for(lambda: metric("switchyard_client_cancelled_total", task="chat") > before, timeout=5),
            "switchyard_client_cancelled_total{task=chat} did not move",
        )


# ---- tool calls -----------------------------------------------------------------


class Cache(unittest.TestCase):
    """Task `cached`: a repeated deterministic request is answered from the cache."""

    def ask(self, question: str, **kw):
        return client().chat.completions.with_raw_response.create(
            model="cached",
            messages=msgs(question),
            temperature=0,
            extra_headers={"x-request-id": (request_id := rid())},
            **kw,
        ), request_id

    def test_a_streamed_answer_is_cached_and_replayed_to_the_sdk_as_a_stream(self):
        question = f"stream me {uuid.uuid4().hex}"
        first, first_id = self.ask(question, stream=True, stream_options={"include_usage": True})
        self.assertEqual(first.headers["x-switchyard-cache"], "miss")
        text = "".join(c.choices[0].delta.content or "" for c in first.parse() if c.choices)
        self.assertEqual(text, "Hello from primary")
        self.assertEqual(len(calls(PRIMARY, first_id)), 1)
        replay, replay_id = self.ask(question, stream=True, stream_options={"include_usage": True})
        self.assertEqual(replay.headers["x-switchyard-cache"], "hit")
        self.assertTrue(replay.headers["content-type"].startswith("text/event-stream"))
        chunks = list(replay.parse())
        replayed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = [c.usage for c in chunks if c.usage]
        self.assertEqual(replayed, "Hello from primary")
        self.assertEqual(finishes, ["stop"])
        self.assertEqual(len(usage), 1)
        self.assertEqual(calls(PRIMARY, replay_id), [], "a hit makes no upstream call")
        # The stream helper assembles the replay like any stream.
        with client().chat.completions.stream(model="cached", messages=msgs(question), temperature=0) as s:
            final = s.get_final_completion()
        self.assertEqual(final.choices[0].message.content, "Hello from primary")
        # And a plain request is the same answer, whole, with its own id.
        plain, _ = self.ask(question)
        self.assertEqual(plain.headers["x-switchyard-cache"], "hit")
        self.assertTrue(plain.parse().id.startswith("chatcmpl-"))
        self.assertEqual(plain.parse().choices[0].message.content, "Hello from primary")

    def test_no_cache_asks_the_target_and_sampling_bypasses(self):
        question = f"fresh {uuid.uuid4().hex}"
        self.ask(question)
        raw = client().chat.completions.with_raw_response.create(
            model="cached",
            messages=msgs(question),
            temperature=0,
            extra_headers={"cache-control": "no-cache", "x-request-id": (request_id := rid())},
        )
        self.assertEqual(raw.headers["x-switchyard-cache"], "bypass")
        self.assertEqual(len(calls(PRIMARY, request_id)), 1)
        sampled = client().chat.completions.with_raw_response.create(model="cached", messages=msgs(question))
        self.assertEqual(sampled.headers["x-switchyard-cache"], "bypass")


class ToolCalls(unittest.TestCase):
    def test_tool_calls_non_stream(self):
        r = client().chat.completions.create(model="gpt-4o-mini", messages=msgs("weather?"), tools=WEATHER_TOOLS)
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        self.assertIsNone(choice.message.content)
        tcs = choice.message.tool_calls
        self.assertEqual([t.function.name for t in tcs], ["get_weather", "get_time"])
        self.assertEqual([json.loads(t.function.arguments) for t in tcs], EXPECTED_ARGS)
        self.assertTrue(all(t.id and t.type == "function" for t in tcs))

    def test_tool_calls_streamed_arguments_assemble(self):
        stream = client().chat.completions.create(
            model="gpt-4o-mini", messages=msgs("weather?"), tools=WEATHER_TOOLS, stream=True
        )
        chunks = list(stream)
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        self.assertEqual(finish, ["tool_calls"])
        assembled = assemble_tool_calls(chunks)
        self.assertEqual(sorted(assembled), [0, 1])
        self.assertEqual([assembled[i]["name"] for i in (0, 1)], ["get_weather", "get_time"])
        self.assertEqual([json.loads(assembled[i]["arguments"]) for i in (0, 1)], EXPECTED_ARGS)
        self.assertTrue(all(assembled[i]["id"] for i in (0, 1)))

    def test_tool_calls_stream_helper_and_failover(self):
        # The first tool-call delta is the commit point; a primary that 503s
        # before it is replaced by the fallback without the SDK noticing.
        request_id = rid()
        with client().chat.completions.stream(
            model="gpt-4o-mini",
            messages=msgs("weather?"),
            tools=WEATHER_TOOLS,
            extra_body=script(primary={"status": 503}),
            extra_headers={"x-request-id": request_id},
        ) as s:
            done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
            final = s.get_final_completion()
        self.assertEqual(len(calls(FALLBACK, request_id)), 1)
        self.assertEqual([json.loads(e.arguments) for e in done], EXPECTED_ARGS)
        tcs = final.choices[0].message.tool_calls
        self.assertEqual([json.loads(t.function.arguments) for t in tcs], EXPECTED_ARGS)
        self.assertTrue(tcs[0].id.startswith("call_fallback"))

    def test_tool_result_round_trip(self):
        c = client()
        first = c.chat.completions.create(model="gpt-4o-mini", messages=msgs("weather?"), tools=WEATHER_TOOLS[:1])
        call = first.choices[0].message.tool_calls[0]
        request_id = rid()
        second = c.chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs("weather?")
            + [
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
            ],
            tools=WEATHER_TOOLS[:1],
            tool_choice="none",
            extra_headers={"x-request-id": request_id},
        )
        self.assertEqual(second.choices[0].message.content, "Hello from primary")
        sent = calls(PRIMARY, request_id)[0]["body"]["messages"]
        self.assertEqual(sent[-1], {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"})
        self.assertEqual(sent[-2]["tool_calls"][0]["id"], call.id)


# ---- async ----------------------------------------------------------------------


class Async(unittest.IsolatedAsyncioTestCase):
    async def test_async_chat(self):
        async with aclient() as c:
            r = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")

    async def test_async_stream(self):
        async with aclient() as c:
            stream = await c.chat.completions.create(
                model="gpt-4o-mini",
                messages=msgs(),
                stream=True,
                extra_body=script(primary={"reply": "async streams work"}),
            )
            text = ""
            async for ch in stream:
                for choice in ch.choices:
                    text += choice.delta.content or ""
        self.assertEqual(text, "async streams work")

    async def test_async_concurrent_requests_do_not_mix(self):
        async with aclient() as c:

            async def one(i: int):
                stream = i % 2 == 1
                kw = dict(model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"reply": f"answer {i}"}))
                if not stream:
                    r = await c.chat.completions.create(**kw)
                    return r.choices[0].message.content
                s = await c.chat.completions.create(stream=True, **kw)
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

            got = await asyncio.gather(*(one(i) for i in range(16)))
        self.assertEqual(got, [f"answer {i}" for i in range(16)])

    async def test_async_errors(self):
        async with aclient() as c:
            with self.assertRaises(openai.NotFoundError):
                await c.chat.completions.create(model="no-such-model", messages=msgs())
            with self.assertRaises(openai.InternalServerError) as cm:
                await c.chat.completions.create(model="all-fail", messages=msgs())
            self.assertEqual(cm.exception.status_code, 502)

    async def test_async_raw_response_failover(self):
        async with aclient() as c:
            raw = await c.chat.completions.with_raw_response.create(model="failover", messages=msgs())
            self.assertEqual(raw.headers["x-switchyard-target"], "fallback-chat")
            self.assertEqual(raw.headers["x-switchyard-failovers"], "1")
            r = raw.parse()
        self.assertEqual(r.choices[0].message.content, "Hello from fallback")


# ---- timeouts and cancellation ---------------------------------------------------


class Cancellation(unittest.TestCase):
    def test_sdk_timeout_cancels_the_request(self):
        before = metric("switchyard_client_cancelled_total", task="slow")
        t0 = time.monotonic()
        with self.assertRaises(openai.APITimeoutError):
            client(timeout=0.5).chat.completions.create(model="slow", messages=msgs())
        self.assertLess(time.monotonic() - t0, 2.5)
        self.assertTrue(
            wait_for(lambda: metric("switchyard_client_cancelled_total", task="slow") > before),
            "switchyard_client_cancelled_total{task=slow} did not move",
        )


# ---- rate limits, tokens and cost -----------------------------------------------


class RateLimitAndUsage(unittest.TestCase):
    def test_task_rate_limit_is_a_rate_limit_error_the_sdk_can_retry(self):
        before = metric("switchyard_ratelimited_total", scope="task")
        c = client()
        c.chat.completions.create(model="limited", messages=msgs())  # takes the one token (burst 1)
        with self.assertRaises(openai.RateLimitError) as cm:
            c.chat.completions.create(model="limited", messages=msgs())
        e = cm.exception
        self.assertEqual(e.status_code, 429)
        self.assertEqual(e.code, "rate_limit_exceeded")
        retry_after = float(e.response.headers["retry-after"])
        self.assertTrue(0 < retry_after <= 2, retry_after)
        self.assertGreater(metric("switchyard_ratelimited_total", scope="task"), before)
        # The SDK's own retry honours Retry-After and then gets through.
        t0 = time.monotonic()
        r = client(max_retries=2).chat.completions.create(model="limited", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")
        self.assertLess(time.monotonic() - t0, 5)

    def test_reported_usage_counts_tokens_and_cost(self):
        def snapshot():
            return (
                metric("switchyard_tokens_total", target="primary-chat", kind="prompt"),
                metric("switchyard_tokens_total", target="primary-chat", kind="completion"),
                metric("switchyard_cost_usd_total", target="primary-chat"),
            )

        p0, c0, usd0 = snapshot()
        reply = "one two three four"
        client().chat.completions.create(
            model="gpt-4o-mini", messages=msgs(), extra_body=script(primary={"reply": reply})
        )
        stream = client().chat.completions.create(
            model="gpt-4o-mini",
            messages=msgs(),
            stream=True,
            stream_options={"include_usage": True},
            extra_body=script(primary={"reply": reply}),
        )
        usage = [ch.usage for ch in stream if ch.usage]
        self.assertEqual(usage[-1].completion_tokens, 4)
        # Both answers report prompt 5, completion 4 (the fake's usage); the cost is
        # 1 USD / 1k input + 2 USD / 1k output (routes.template.yaml).
        self.assertTrue(wait_for(lambda: snapshot()[1] - c0 >= 8), snapshot())
        p1, c1, usd1 = snapshot()
        self.assertEqual((p1 - p0, c1 - c0), (10, 8))
        self.assertAlmostEqual(usd1 - usd0, 2 * (5 * 1.0 + 4 * 2.0) / 1000, places=9)


# ---- /metrics and the example dashboard ------------------------------------------


class Metrics(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        c = client()
        c.chat.completions.create(model="gpt-4o-mini", messages=msgs())
        c.chat.completions.create(model="failover", messages=msgs())
        list(c.chat.completions.create(model="gpt-4o-mini", messages=msgs(), stream=True))
        try:
            c.chat.completions.create(model="no-such-model", messages=msgs())
        except openai.NotFoundError:
            pass

    def test_metrics_after_traffic(self):
        self.assertGreaterEqual(
            metric("switchyard_requests_total", task="chat", target="primary-chat", status="200"), 1
        )
        self.assertGreaterEqual(metric("switchyard_requests_total", task="unknown", target="none", status="404"), 1)
        self.assertGreaterEqual(metric("switchyard_request_duration_seconds_count", task="chat"), 1)
        self.assertGreaterEqual(
            metric("switchyard_time_to_first_token_seconds_bucket", task="chat", target="primary-chat", le="+Inf"), 1
        )
        self.assertGreaterEqual(metric("switchyard_upstream_attempts_total", target="primary-503", outcome="5xx"), 2)
        self.assertGreaterEqual(
            metric("switchyard_failovers_total", task="failover", to="fallback-chat", reason="5xx"), 1
        )
        # Not checked here: switchyard_config_reloads_total{result="ok"}, switchyard_config_hash and
        # switchyard_config_loaded_timestamp_seconds are missing until the first reload (the
        # initial load is recorded before the Prometheus recorder is installed); Reload checks them.

    def test_dashboard_uses_only_exported_metrics(self):
        dashboard = ROOT / "examples" / "grafana-dashboard.json"
        if not dashboard.exists():
            self.skipTest("no examples/grafana-dashboard.json")
        src = (ROOT / "src" / "metrics.rs").read_text()
        exported = set(re.findall(r'pub const \w+: &str = "(switchyard_\w+)"', src))
        self.assertGreater(len(exported), 10)
        histograms = set(re.findall(r'/// Histogram[^\n]*\n(?:///[^\n]*\n)*pub const \w+: &str = "(switchyard_\w+)"', src))
        self.assertEqual(len(histograms), 2, histograms)
        allowed = set(exported)
        for h in histograms:
            allowed |= {h + "_bucket", h + "_sum", h + "_count"}
        exprs = []

        def walk(node):
            if isinstance(node, dict):
                for k, v in node.items():
                    if k in ("expr", "query") and isinstance(v, str):
                        exprs.append(v)
                    else:
                        walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(json.loads(dashboard.read_text()))
        self.assertGreater(len(exprs), 10)
        used = {n for e in exprs for n in re.findall(r"\bswitchyard_\w+", e)}
        self.assertEqual(used - allowed, set(), "the dashboard queries metrics switchyard does not export")


# ---- the deployment examples stay valid -------------------------------------------


class Examples(unittest.TestCase):
    def test_k8s_configmap_routes_yaml_validates(self):
        """examples/k8s/configmap.yaml embeds a routes.yaml that `switchyard validate` accepts."""
        binary = os.environ.get("SWITCHYARD_BIN_PATH")
        configmap = ROOT / "examples" / "k8s" / "configmap.yaml"
        if not binary or not configmap.exists():
            self.skipTest("needs SWITCHYARD_BIN_PATH and examples/k8s/configmap.yaml")
        lines = configmap.read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.strip() == "routes.yaml: |") + 1
        body = []
        for line in lines[start:]:
            if line.strip() and not line.startswith("    "):
                break
            body.append(line[4:])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "routes.yaml"
            path.write_text("\n".join(body) + "\n")
            env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
            r = subprocess.run([binary, "validate", str(path)], capture_output=True, text=True, env=env, timeout=30)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(": ok (2 tasks, 4 targets", r.stdout)
        # Outside the pod exactly the two keys and the Redis URL are missing (warnings; errors under --strict).
        self.assertEqual(r.stdout.count(": warning: "), 3, r.stdout)
        self.assertIn("this replica will not share state (at shared_state.redis.url_file)", r.stdout)


# ---- hot reload ---------------------------------------------------------------


@unittest.skipUnless(CONFIG, "SWITCHYARD_CONFIG not set")
class Reload(unittest.TestCase):
    def setUp(self):
        self.path = Path(CONFIG)
        self.original = self.path.read_text()

    def tearDown(self):
        self.write(self.original)
        wait_for(lambda: "sdk-reloaded" not in {m.id for m in client().models.list()}, timeout=5)

    def write(self, text: str):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)  # an editor-style write-and-rename

    def test_reload_adds_an_alias_and_rejects_a_broken_file(self):
        ok_before = metric("switchyard_config_reloads_total", result="ok")
        marker = "aliases: [gpt-4o-mini]"
        self.assertIn(marker, self.original)
        self.write(self.original.replace(marker, "aliases: [gpt-4o-mini, sdk-reloaded]"))
        self.assertTrue(
            wait_for(lambda: "sdk-reloaded" in {m.id for m in client().models.list()}, timeout=5),
            "the new alias never appeared",
        )
        r = client().chat.completions.create(model="sdk-reloaded", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")
        self.assertGreater(metric("switchyard_config_reloads_total", result="ok"), ok_before)
        self.assertGreater(metric("switchyard_config_loaded_timestamp_seconds"), time.time() - 60)
        self.assertIn("switchyard_config_hash", "".join(metrics()))

        err_before = metric("switchyard_config_reloads_total", result="error")
        self.write(self.original.replace("version: 1", "version: 1\nno_such_key: true"))
        self.assertTrue(
            wait_for(lambda: metric("switchyard_config_reloads_total", result="error") > err_before, timeout=5),
            "the broken file was not counted as a failed reload",
        )
        # The old config keeps serving.
        r = client().chat.completions.create(model="sdk-reloaded", messages=msgs())
        self.assertEqual(r.choices[0].message.content, "Hello from primary")


# ---- an Anthropic-protocol upstream (fakellm), in its own file ----------------------

from test_anthropic_upstream import AnthropicUpstream  # noqa: E402,F401  (run with the rest)
from test_front_door import AnthropicFrontDoor, ResponsesFrontDoor, ResponsesTarget, VercelAiSdk  # noqa: E402,F401


# ---- runner -----------------------------------------------------------------------


def main() -> int:
    verbosity = 2 if "-v" in sys.argv[1:] else 1
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    loader = unittest.TestLoader()
    suite = (
        loader.loadTestsFromNames(names, sys.modules[__name__])
        if names
        else loader.loadTestsFromModule(sys.modules[__name__])
    )
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(suite)

    # Count tests, not subtests: a test with two failing subtests is one failure.
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
