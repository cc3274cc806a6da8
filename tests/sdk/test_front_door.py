#!/usr/bin/env python3
"""The other clients at the front door: the official `anthropic` SDK against
switchyard's /v1/messages, and the `openai` SDK's Responses API against
/v1/responses, both served by the OpenAI-compatible fakes of run.sh
(fake_upstream.py) through the same engine as chat.

test_openai_sdk.py imports these classes, so run.sh runs them with the rest
(`bash tests/sdk/run.sh AnthropicFrontDoor ResponsesFrontDoor` runs only these).

Env: SWITCHYARD_URL, FAKE_PRIMARY_URL, FAKE_FALLBACK_URL (set by run.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import unittest
import urllib.request
import uuid

import anthropic
import openai
import pydantic
from openai import OpenAI

SY = os.environ.get("SWITCHYARD_URL", "")
PRIMARY = os.environ.get("FAKE_PRIMARY_URL", "")
FALLBACK = os.environ.get("FAKE_FALLBACK_URL", "")

WEATHER = {
    "name": "get_weather",
    "description": "Weather at a place",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["location"],
    },
}
# What tests/sdk/fakellm.yaml answers to "hello" (task `claude`, alias claude-mock).
ANTHROPIC_HELLO = "Bonjour! fakellm answering over the Anthropic Messages API."
# What fake_upstream.py answers for the first tool of a request.
FAKE_ARGS = {"location": "Paris, France", "unit": "celsius", "call": 0}


def claude(**kw) -> anthropic.Anthropic:
    kw.setdefault("timeout", 10.0)
    kw.setdefault("max_retries", 0)
    return anthropic.Anthropic(base_url=SY, api_key="sk-ant-client-key-not-forwarded", **kw)


def oai(**kw) -> OpenAI:
    kw.setdefault("timeout", 10.0)
    kw.setdefault("max_retries", 0)
    return OpenAI(base_url=f"{SY}/v1", api_key="sk-client-key-not-forwarded", **kw)


def rid() -> str:
    return f"front-{uuid.uuid4().hex[:16]}"


def upstream_calls(url: str, request_id: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/_calls", timeout=5) as r:
        seen = json.loads(r.read())
    return [c for c in seen if c["headers"].get("x-request-id") == request_id]


class AnthropicFrontDoor(unittest.TestCase):
    """anthropic.Anthropic(base_url=switchyard): Messages in, chat targets behind."""

    def test_an_anthropic_target_behind_a_messages_client(self):
        # Messages in, chat in the engine, Messages out to fakellm and back.
        hello = f"hello [{uuid.uuid4().hex[:8]}]"
        r = claude().messages.create(model="claude-mock", max_tokens=64, messages=[{"role": "user", "content": hello}])
        self.assertEqual(r.content[0].text, ANTHROPIC_HELLO)
        with claude().messages.stream(
            model="claude-mock", max_tokens=64, messages=[{"role": "user", "content": hello + " again"}]
        ) as stream:
            final = stream.get_final_message()
        self.assertEqual(final.content[0].text, ANTHROPIC_HELLO)
        self.assertEqual(final.stop_reason, "end_turn")

    def test_messages_create_is_served_in_anthropic_shape(self):
        r = claude().messages.create(
            model="gpt-4o-mini",
            max_tokens=64,
            system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hello"}],
        )
        self.assertIsInstance(r, anthropic.types.Message)
        self.assertEqual(r.role, "assistant")
        self.assertEqual(r.content[0].type, "text")
        self.assertEqual(r.content[0].text, "Hello from primary")
        self.assertEqual(r.stop_reason, "end_turn")
        self.assertGreater(r.usage.output_tokens, 0)
        self.assertTrue(r.id.startswith("msg_"), r.id)

    def test_a_stream_accumulates_into_the_final_message(self):
        with claude().messages.stream(
            model="gpt-4o-mini", max_tokens=64, messages=[{"role": "user", "content": "hello"}]
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        self.assertEqual(text, "Hello from primary")
        self.assertEqual(final.content[0].text, "Hello from primary")
        self.assertEqual(final.stop_reason, "end_turn")
        self.assertGreater(final.usage.output_tokens, 0)

    def test_a_tool_use_round_trip(self):
        request_id = rid()
        first = claude().messages.create(
            model="gpt-4o-mini",
            max_tokens=64,
            tools=[WEATHER],
            messages=[{"role": "user", "content": "weather in Paris?"}],
            extra_headers={"x-request-id": request_id},
        )
        self.assertEqual(first.stop_reason, "tool_use")
        use = [b for b in first.content if b.type == "tool_use"]
        self.assertEqual(len(use), 1)
        self.assertEqual(use[0].name, "get_weather")
        self.assertEqual(use[0].input, FAKE_ARGS)
        # The second turn, without tools: the fake answers text, and shows
        # what it got: the call and its result as chat messages.
        second_id = rid()
        second = claude().messages.create(
            model="gpt-4o-mini",
            max_tokens=64,
            messages=[
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": first.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "18 C"}],
                },
            ],
            extra_headers={"x-request-id": second_id},
        )
        self.assertEqual(second.content[0].text, "Hello from primary")
        sent = upstream_calls(PRIMARY, second_id)[-1]["body"]["messages"]
        self.assertEqual(sent[1]["tool_calls"][0]["id"], use[0].id)
        self.assertEqual(json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]), FAKE_ARGS)
        self.assertEqual(sent[2], {"role": "tool", "tool_call_id": use[0].id, "content": "18 C"})

    def test_a_streamed_tool_call_arrives_as_a_tool_use_block(self):
        with claude().messages.stream(
            model="gpt-4o-mini", max_tokens=64, tools=[WEATHER],
            messages=[{"role": "user", "content": "weather?"}],
        ) as stream:
            final = stream.get_final_message()
        use = [b for b in final.content if b.type == "tool_use"]
        self.assertEqual(use[0].input, FAKE_ARGS)
        self.assertEqual(final.stop_reason, "tool_use")

    def test_count_tokens_is_estimated(self):
        raw = claude().messages.with_raw_response.count_tokens(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hello there, how are you today?"}]
        )
        self.assertEqual(raw.headers.get("x-switchyard-token-count"), "estimate")
        self.assertGreater(raw.parse().input_tokens, 3)

    def test_a_rate_limit_is_a_rate_limit_error_with_its_wait(self):
        c = claude()
        body = dict(model="limited", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        with self.assertRaises(anthropic.RateLimitError) as caught:
            for _ in range(5):
                c.messages.create(**body)
        e = caught.exception
        self.assertEqual(e.status_code, 429)
        self.assertEqual(e.body["error"]["type"], "rate_limit_error")
        self.assertIsNotNone(e.response.headers.get("retry-after"))

    def test_a_failed_walk_is_an_api_error_the_sdk_does_not_retry(self):
        c = claude(max_retries=3)
        started = time.monotonic()
        with self.assertRaises(anthropic.APIStatusError) as caught:
            c.messages.create(model="all-fail", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        e = caught.exception
        self.assertGreaterEqual(e.status_code, 500)
        self.assertEqual(e.body["type"], "error")
        self.assertIn(e.body["error"]["type"], ("api_error", "overloaded_error"))
        self.assertEqual(e.response.headers.get("x-should-retry"), "false")
        # x-should-retry: false: the SDK's backoff (0.5 s and up) never ran.
        self.assertLess(time.monotonic() - started, 3.0)

    def test_a_malformed_request_is_a_bad_request_naming_the_field(self):
        with self.assertRaises(anthropic.BadRequestError) as caught:
            claude().messages.create(model="gpt-4o-mini", max_tokens=8, messages=[{"role": "robot", "content": "x"}])
        self.assertEqual(caught.exception.body["error"]["type"], "invalid_request_error")
        self.assertIn("messages[0].role", caught.exception.body["error"]["message"])

    def test_a_claude_code_shaped_stream_is_parsed_after_failover(self):
        # System blocks with cache_control, thinking on, many tools and the
        # beta header, as Claude Code sends them; the chain's first target
        # fails and the chat fallback's streamed tool call comes back as a
        # tool_use block the SDK accumulates.
        tools = [WEATHER] + [
            {"name": f"Tool{i}", "description": "a tool", "input_schema": {"type": "object"}}
            for i in range(21)
        ]
        system = [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ]
        with claude().messages.stream(
            model="failover",
            max_tokens=2048,
            system=system,
            tools=tools,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": [{"type": "text", "text": "weather?",
                                                    "cache_control": {"type": "ephemeral"}}]}],
            extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"},
        ) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        self.assertEqual(events[0], "message_start", events)
        self.assertEqual(final.stop_reason, "tool_use")
        calls = [b for b in final.content if b.type == "tool_use"]
        # The fake calls the first tools offered, one block each.
        self.assertEqual((calls[0].name, calls[0].input), ("get_weather", FAKE_ARGS))
        self.assertEqual([c.name for c in calls[1:]], ["Tool0"][: len(calls) - 1])
        self.assertEqual(len({c.id for c in calls}), len(calls))

    def test_failover_serves_a_messages_client(self):
        r = claude().messages.with_raw_response.create(
            model="failover", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        self.assertEqual(r.headers.get("x-switchyard-target"), "fallback-chat")
        self.assertEqual(r.parse().content[0].text, "Hello from fallback")


class Answer(pydantic.BaseModel):
    city: str
    degrees: int


class ResponsesFrontDoor(unittest.TestCase):
    """openai.OpenAI().responses against switchyard."""

    def test_an_anthropic_target_behind_a_responses_client(self):
        r = oai().responses.create(model="claude-mock", input=f"hello [{uuid.uuid4().hex[:8]}]")
        self.assertEqual(r.output_text, ANTHROPIC_HELLO)
        self.assertEqual(r.status, "completed")

    def test_a_plain_response(self):
        r = oai().responses.create(model="gpt-4o-mini", input="hello", instructions="be brief")
        self.assertEqual(r.status, "completed")
        self.assertEqual(r.output_text, "Hello from primary")
        self.assertTrue(r.id.startswith("resp_"), r.id)
        self.assertGreater(r.usage.output_tokens, 0)
        fetched = oai().responses.retrieve(r.id)
        self.assertEqual(fetched.output_text, "Hello from primary")

    def test_a_stream_of_typed_events(self):
        events = list(oai().responses.create(model="gpt-4o-mini", input="hello", stream=True))
        kinds = [e.type for e in events]
        self.assertEqual(kinds[0], "response.created")
        self.assertEqual(kinds[-1], "response.completed")
        self.assertIn("response.output_text.delta", kinds)
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assertEqual(events[-1].response.output_text, "Hello from primary")

    def test_the_stream_helper_gives_the_final_response(self):
        with oai().responses.stream(model="gpt-4o-mini", input="hello") as stream:
            for _ in stream:
                pass
            final = stream.get_final_response()
        self.assertEqual(final.output_text, "Hello from primary")

    def test_function_tools_round_trip_with_previous_response_id(self):
        tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}]
        first = oai().responses.create(model="gpt-4o-mini", input="weather?", tools=tools)
        calls = [o for o in first.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1)
        self.assertEqual(json.loads(calls[0].arguments), FAKE_ARGS)
        request_id = rid()
        second = oai().responses.create(
            model="gpt-4o-mini",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}],
            extra_headers={"x-request-id": request_id},
        )
        self.assertEqual(second.output_text, "Hello from primary")
        sent = upstream_calls(PRIMARY, request_id)[-1]["body"]["messages"]
        self.assertEqual([m["role"] for m in sent], ["user", "assistant", "tool"])
        self.assertEqual(sent[1]["tool_calls"][0]["id"], calls[0].call_id)
        self.assertEqual(sent[2]["content"], "18 C")

    def test_an_unknown_previous_response_is_a_clear_400(self):
        with self.assertRaises(openai.BadRequestError) as caught:
            oai().responses.create(model="gpt-4o-mini", input="x", previous_response_id="resp_never")
        self.assertEqual(caught.exception.code, "previous_response_not_found")

    def test_store_false_keeps_nothing(self):
        r = oai().responses.create(model="gpt-4o-mini", input="hello", store=False)
        with self.assertRaises(openai.NotFoundError):
            oai().responses.retrieve(r.id)

    def test_parse_with_a_pydantic_model(self):
        r = oai().responses.parse(model="gpt-4o-mini", input="weather in Paris as JSON", text_format=Answer)
        self.assertEqual(r.output_parsed, Answer(city="sample", degrees=1))

    def test_a_wrong_input_type_is_a_400_naming_it(self):
        with self.assertRaises(openai.BadRequestError) as caught:
            oai().responses.create(model="gpt-4o-mini", input=5)
        self.assertEqual(caught.exception.param, "input")

    def test_failover_serves_a_responses_client(self):
        raw = oai().responses.with_raw_response.create(model="failover", input="hi")
        self.assertEqual(raw.headers.get("x-switchyard-target"), "fallback-chat")
        self.assertEqual(raw.parse().output_text, "Hello from fallback")


class ResponsesTarget(unittest.TestCase):
    """openai.OpenAI().responses against a provider's own Responses API
    (`responses: true`, fake_upstream.py's /responses), failing over to chat."""

    def test_a_plain_response_is_the_targets(self):
        request_id = rid()
        r = oai().responses.create(model="responses-road", input="hello", extra_headers={"x-request-id": request_id})
        self.assertEqual(r.output_text, "Hello from primary over Responses")
        self.assertTrue(r.id.startswith("resp_primary_"), r.id)
        self.assertEqual(upstream_calls(PRIMARY, request_id)[-1]["path"], "/v1/responses")
        self.assertEqual(oai().responses.retrieve(r.id).output_text, "Hello from primary over Responses")

    def test_the_stream_helper_parses_the_targets_events(self):
        with oai().responses.stream(model="responses-road", input="hello") as stream:
            events = list(stream)
            final = stream.get_final_response()
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assertEqual(final.output_text, "Hello from primary over Responses")

    def test_a_tool_round_trip_continues_with_the_conversation_not_the_id(self):
        tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}]
        first = oai().responses.create(model="responses-road", input="weather?", tools=tools)
        calls = [o for o in first.output if o.type == "function_call"]
        self.assertEqual(json.loads(calls[0].arguments), FAKE_ARGS)
        request_id = rid()
        second = oai().responses.create(
            model="responses-road",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}],
            extra_headers={"x-request-id": request_id},
        )
        # The fake refuses any previous_response_id: switchyard sent the turns.
        self.assertEqual(second.output_text, "Hello from primary over Responses")
        sent = upstream_calls(PRIMARY, request_id)[-1]["body"]
        self.assertNotIn("previous_response_id", sent)
        kinds = [i.get("type") for i in sent["input"]]
        self.assertEqual(kinds, ["message", "function_call", "function_call_output"])
        self.assertEqual(sent["input"][1]["call_id"], calls[0].call_id)

    def test_failover_to_a_chat_target(self):
        raw = oai().responses.with_raw_response.create(
            model="responses-road", input="hi", extra_body={"fake_upstream": {"primary": {"status": 503}}}
        )
        self.assertEqual(raw.headers.get("x-switchyard-target"), "fallback-chat")
        self.assertEqual(raw.parse().output_text, "Hello from fallback")

    def test_a_cut_stream_is_finished_by_the_chat_target(self):
        stream = oai().responses.create(
            model="responses-road",
            input="hello",
            stream=True,
            extra_body={"fake_upstream": {"primary": {"cut_after": 2, "reply": "Hello from fallback"}}},
        )
        events = list(stream)
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assertEqual(events[-1].type, "response.completed")
        self.assertTrue(events[-1].response.id.startswith("resp_primary_"))
        self.assertEqual(events[-1].response.output_text, "Hello from fallback")


class VercelAiSdk(unittest.TestCase):
    """The Vercel AI SDK's default provider, `openai(model)` (the Responses API),
    run by node (tests/sdk/vercel/front_door.mjs, installed by run.sh)."""

    def run_script(self, model: str) -> dict:
        script = os.path.join(os.environ["VERCEL_SDK_DIR"], "front_door.mjs")
        env = {**os.environ, "VERCEL_MODEL": model}
        done = subprocess.run(["node", script], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def test_generate_text_stream_text_and_a_tool_round_trip(self):
        got = self.run_script("gpt-4o-mini")
        self.assertEqual(got["plain"]["text"], "Hello from primary")
        self.assertEqual(got["plain"]["finishReason"], "stop")
        self.assertGreater(got["plain"]["outputTokens"], 0)
        self.assertEqual(got["stream"], {"text": "Hello from primary", "finishReason": "stop"})
        # The model called the tool; the SDK ran it and sent the result back.
        self.assertEqual(got["tool"]["steps"], 2, got)
        self.assertEqual(got["tool"]["calls"], [{"name": "get_weather", "input": FAKE_ARGS}])
        self.assertEqual(got["tool"]["results"], 1)

    def test_failover_serves_the_vercel_client(self):
        got = self.run_script("failover")
        self.assertEqual(got["plain"]["text"], "Hello from fallback")
        self.assertEqual(got["stream"]["text"], "Hello from fallback")


if __name__ == "__main__":
    unittest.main()
