#!/usr/bin/env python3
"""The official `openai` SDK through switchyard to an Anthropic-protocol upstream.

The upstream is fakellm (PyPI, third-party), a mock of both the OpenAI and the
Anthropic API, started by tests/sdk/run.sh with the rules in
tests/sdk/fakellm.yaml. routes.template.yaml gives it as provider
`anthropic-mock` (`protocol: anthropic`), so switchyard must translate each
Chat Completions request into POST /v1/messages and the Messages answer (JSON
or SSE events) back into Chat Completions objects. What the SDK sees is
checked here; fakellm's own record (/_fakellm/stats) shows which of its APIs
was called and which rule matched, i.e. what switchyard actually sent.

test_openai_sdk.py imports the test class, so run.sh runs it with the rest
(`bash tests/sdk/run.sh AnthropicUpstream` runs only these).

Env: SWITCHYARD_URL, FAKELLM_URL (set by run.sh).
"""

from __future__ import annotations

import json
import os
import unittest
import urllib.request
import uuid

from openai import OpenAI

SY = os.environ.get("SWITCHYARD_URL", "")
FAKELLM = os.environ.get("FAKELLM_URL", "")
MODEL = "claude-mock"  # alias of task `claude`, chain [anthropic-chat] on provider anthropic-mock
UPSTREAM_MODEL = "claude-sdk-test"

# Must match tests/sdk/fakellm.yaml.
HELLO_ANSWER = "Bonjour! fakellm answering over the Anthropic Messages API."
WEATHER_ANSWER = "According to the tool it is 18 degrees and cloudy in Lyon."
WEATHER_ARGS = {"location": "Lyon, France", "unit": "celsius"}
TOOL_PREAMBLE = "Let me check the weather."  # a text block before the tool_use block
TOOL_RESULT = "sdk-weather-result: 18 C, cloudy"

GET_WEATHER = [
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


def client() -> OpenAI:
    return OpenAI(base_url=f"{SY}/v1", api_key="sk-client-key-anthropic-test", timeout=10.0, max_retries=0)


def unique(text: str) -> str:
    # fakellm keeps conversation state per first user message: one per test.
    return f"{text} [{uuid.uuid4().hex[:8]}]"


def fakellm_last() -> dict:
    """The most recent request fakellm recorded: api, model, stream, matched_rule."""
    with urllib.request.urlopen(f"{FAKELLM}/_fakellm/stats", timeout=5) as r:
        recent = json.load(r)["recent"]
    assert recent, "fakellm recorded no request"
    return recent[0]


@unittest.skipUnless(SY and FAKELLM, "SWITCHYARD_URL / FAKELLM_URL not set (run tests/sdk/run.sh)")
class AnthropicUpstream(unittest.TestCase):
    def assertUpstream(self, rule: str, stream: bool):
        last = fakellm_last()
        self.assertEqual(last["api"], "anthropic", f"switchyard did not call /v1/messages: {last}")
        self.assertEqual(last["model"], UPSTREAM_MODEL, last)
        self.assertEqual(last["stream"], stream, last)
        self.assertEqual(last["matched_rule"], rule, last)

    def first_tool_turn(self, text: str):
        return client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], tools=GET_WEATHER
        )

    # (1)
    def test_text(self):
        r = client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": unique("hello there")}], max_tokens=64
        )
        self.assertEqual(r.object, "chat.completion")
        self.assertTrue(r.id)
        self.assertEqual(len(r.choices), 1)
        choice = r.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertEqual(choice.message.content, HELLO_ANSWER)
        self.assertFalse(choice.message.tool_calls)
        self.assertEqual(choice.finish_reason, "stop")
        self.assertIsNotNone(r.usage)
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertGreater(r.usage.completion_tokens, 0)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertUpstream("sdk_hello", stream=False)

    # (2)
    def test_text_stream(self):
        chunks = []
        with client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": unique("hello again")}], stream=True
        ) as stream:
            for chunk in stream:  # ends without an exception: the stream closed cleanly
                chunks.append(chunk)
        self.assertGreater(len(chunks), 1)
        self.assertTrue(all(c.object == "chat.completion.chunk" for c in chunks))
        self.assertEqual(len({c.id for c in chunks}), 1, "every chunk carries the same id")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, HELLO_ANSWER)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, ["stop"])
        roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
        self.assertEqual(roles[:1], ["assistant"])
        self.assertUpstream("sdk_hello", stream=True)

    # (3)
    def test_tool_call(self):
        r = self.first_tool_turn(unique("What is the weather in Lyon?"))
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        self.assertEqual(choice.message.content, TOOL_PREAMBLE)
        calls = choice.message.tool_calls
        self.assertEqual(len(calls or []), 1, calls)
        self.assertEqual(calls[0].type, "function")
        self.assertTrue(calls[0].id)
        self.assertEqual(calls[0].function.name, "get_weather")
        self.assertEqual(json.loads(calls[0].function.arguments), WEATHER_ARGS)
        self.assertUpstream("sdk_weather_tool_call", stream=False)

    # (4)
    def test_tool_call_stream(self):
        calls: dict[int, dict] = {}
        finishes = []
        text = ""
        with client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": unique("Weather in Lyon, streamed?")}],
            tools=GET_WEATHER,
            stream=True,
        ) as stream:
            for chunk in stream:
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                if c.finish_reason:
                    finishes.append(c.finish_reason)
                text += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    acc = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    acc["id"] += tc.id or ""
                    if tc.function:
                        acc["name"] += tc.function.name or ""
                        acc["arguments"] += tc.function.arguments or ""
        self.assertEqual(finishes, ["tool_calls"])
        self.assertEqual(text, TOOL_PREAMBLE)
        # Anthropic's tool_use is content block 1 here; OpenAI's tool call index is 0.
        self.assertEqual(list(calls), [0], calls)
        self.assertTrue(calls[0]["id"])
        self.assertEqual(calls[0]["name"], "get_weather")
        self.assertEqual(json.loads(calls[0]["arguments"]), WEATHER_ARGS)
        self.assertUpstream("sdk_weather_tool_call", stream=True)

    # (5)
    def test_tool_result_turn(self):
        question = unique("What is the weather in Lyon? Use the tool.")
        first = self.first_tool_turn(question)
        call = first.choices[0].message.tool_calls[0]
        messages = [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
        ]
        r = client().chat.completions.create(model=MODEL, messages=messages, tools=GET_WEATHER)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].message.content, WEATHER_ANSWER)
        self.assertFalse(r.choices[0].message.tool_calls)
        # The rule needs the tool result right after the assistant turn: switchyard
        # sent the tool message as a tool_result block in the right place.
        self.assertUpstream("sdk_weather_after_tool_result", stream=False)

        # The same turn streamed.
        with client().chat.completions.create(
            model=MODEL, messages=messages, tools=GET_WEATHER, stream=True
        ) as stream:
            chunks = [c for c in stream if c.choices]
        self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks), WEATHER_ANSWER)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason], ["stop"])
        self.assertUpstream("sdk_weather_after_tool_result", stream=True)


if __name__ == "__main__":
    unittest.main()
