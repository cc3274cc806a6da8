//! The other front doors: Anthropic Messages (`/v1/messages`) and OpenAI
//! Responses (`/v1/responses`) in front of the same engine as chat —
//! failover across protocols, continuation, errors in the client's envelope,
//! refusals before any upstream call, and the response store.

use serde_json::{json, Value};

use crate::support::fake::{self, Fake, Reply, Seen};
use crate::support::*;

const ANTHROPIC_TEXT: &str = include_str!("fixtures/anthropic/text_response.anthropic.json");
const ANTHROPIC_OVERLOADED: &str = include_str!("fixtures/anthropic/error_overloaded.json");

async fn messages(gw: &Gw, body: Value) -> Answer {
    let headers = [
        ("anthropic-version", "2023-06-01"),
        ("x-api-key", "sk-ant-client"),
    ];
    post_raw(gw.addr, "/v1/messages", body.to_string(), &headers).await
}

async fn responses(gw: &Gw, body: Value) -> Answer {
    post_raw(gw.addr, "/v1/responses", body.to_string(), &[]).await
}

fn hello_messages(stream: bool) -> Value {
    json!({"model": "gpt-4o", "max_tokens": 32, "stream": stream,
           "messages": [{"role": "user", "content": "hello"}]})
}

/// A hop whose provider speaks Anthropic Messages, with a key from `keys`.
fn anthropic_hop(name: &str, url: &str, keys: &tempfile::TempDir) -> Hop {
    let key = keys.path().join(name);
    std::fs::write(&key, "sk-ant-inbound-test-0123456789").unwrap();
    hop(name, url).provider(&format!(
        "protocol: anthropic\napi_key_file: {}\n",
        key.display()
    ))
}

/// The `(event, data)` pairs of an Anthropic-style SSE body.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_owned();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or_else(|_| panic!("not JSON: {d}"));
                }
            }
            (name, data)
        })
        .collect()
}

fn event_names(body: &str) -> Vec<String> {
    named_events(body).into_iter().map(|(n, _)| n).collect()
}

/// The text of a Messages stream: every `text_delta`, in order.
fn messages_text(body: &str) -> String {
    named_events(body)
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "text_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_messages_client_fails_over_from_an_overloaded_anthropic_target_to_an_openai_one() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(529, ANTHROPIC_OVERLOADED)).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(
        &[anthropic_hop("a", &a.url(), &keys), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    let headers = [
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "fine-grained-tool-streaming-2025-05-14"),
        ("x-api-key", "sk-ant-client"),
    ];
    let body = hello_messages(false).to_string();
    let ans = post_raw(gw.addr, "/v1/messages", body, &headers).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    let v = ans.json();
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"][0], json!({"type": "text", "text": "from b"}));
    assert_eq!(v["stop_reason"], "end_turn");
    // Each target got the request in its own protocol.
    let to_a = &a.seen()[0];
    assert!(to_a.uri.ends_with("/messages"), "{}", to_a.uri);
    assert_eq!(to_a.body["max_tokens"], 32);
    assert_eq!(to_a.headers["x-api-key"], "sk-ant-inbound-test-0123456789");
    // The client's Anthropic headers go to Anthropic targets only.
    assert_eq!(
        to_a.headers["anthropic-beta"],
        "fine-grained-tool-streaming-2025-05-14"
    );
    assert_eq!(to_a.headers["anthropic-version"], "2023-06-01");
    let to_b = &b.seen()[0];
    assert!(to_b.uri.ends_with("/chat/completions"), "{}", to_b.uri);
    assert!(to_b.headers.get("anthropic-beta").is_none());
    assert_eq!(
        to_b.body["messages"],
        json!([{"role": "user", "content": "hello"}])
    );
    assert_eq!(to_b.body["max_tokens"], 32);
    // The client's own key goes nowhere.
    assert!(!format!("{:?}{:?}", to_a.headers, to_b.headers).contains("sk-ant-client"));
}

#[tokio::test]
async fn a_responses_client_is_served_by_an_anthropic_target() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let gw = gateway(&routes(&[anthropic_hop("a", &a.url(), &keys)], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "hi", "instructions": "be brief",
                      "max_output_tokens": 40});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(
        v["output"][0]["content"][0]["text"],
        "Hello! How can I help you today?"
    );
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0, "{v}");
    let sent = &a.seen()[0].body;
    assert_eq!(sent["system"], "be brief");
    assert_eq!(sent["max_tokens"], 40);
}

#[tokio::test]
async fn a_messages_stream_broken_mid_answer_is_finished_by_the_next_target() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["The", " quick", " brown", " fox"],
        2,
    ))
    .await;
    // Without prefill, the next target answers afresh and the delivered
    // prefix is skipped.
    let b = Fake::always(fake::stream(
        "model-b",
        &["The", " quick", " brown", " fox"],
    ))
    .await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "stream_recovery: { mode: continue }",
        "",
    ))
    .await;
    let ans = messages(&gw, hello_messages(true)).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let body = ans.text();
    let names = event_names(&body);
    assert_eq!(
        names.first().map(String::as_str),
        Some("message_start"),
        "{body}"
    );
    assert_eq!(
        names.last().map(String::as_str),
        Some("message_stop"),
        "{body}"
    );
    assert!(!names.iter().any(|n| n == "error"), "{body}");
    assert_eq!(
        names.iter().filter(|n| *n == "message_delta").count(),
        1,
        "{body}"
    );
    assert_eq!(messages_text(&body), "The quick brown fox", "{body}");
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn a_messages_stream_broken_without_recovery_ends_in_an_error_event() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["The", " quick", " brown"],
        2,
    ))
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = messages(&gw, hello_messages(true)).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let body = ans.text();
    let events = named_events(&body);
    let (last, data) = events.last().unwrap();
    assert_eq!(last, "error", "{body}");
    assert_eq!(data["type"], "error");
    assert!(data["error"]["type"].is_string(), "{body}");
    assert!(
        !event_names(&body).iter().any(|n| n == "message_stop"),
        "{body}"
    );
    assert_eq!(messages_text(&body), "The quick", "{body}");
}

/// An Anthropic stream that says "Hello", then breaks with its own
/// `error` event: `kind` (`overloaded_error`, ...) and `message`.
fn anthropic_error_mid_stream(kind: &str, message: &str) -> Reply {
    let text = include_str!("fixtures/anthropic/stream_text.anthropic.sse");
    let first_delta = text.find("\"Hello\"").unwrap();
    let cut = first_delta + text[first_delta..].find("\n\n").unwrap() + 2;
    let error = json!({"type": "error", "error": {"type": kind, "message": message}});
    let sse = format!("{}event: error\ndata: {error}\n\n", &text[..cut]);
    anthropic_stream(&sse, None)
}

#[tokio::test]
async fn an_upstream_error_event_mid_stream_reaches_the_client_with_its_kind_and_message() {
    let keys = tempfile::tempdir().unwrap();
    for (kind, status, message) in [
        ("overloaded_error", 529, "Overloaded"),
        (
            "rate_limit_error",
            429,
            "Number of tokens has exceeded your per-minute limit",
        ),
        ("api_error", 500, "Internal server error"),
    ] {
        // Each client on a gateway of its own: the error cools the target down.
        let a = Fake::always(anthropic_error_mid_stream(kind, message)).await;
        let gw = gateway(&routes(&[anthropic_hop("a", &a.url(), &keys)], "", "")).await;
        // A Messages client, passed through: Anthropic's own kind of error.
        let ans = messages(&gw, hello_messages(true)).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        let body = ans.text();
        assert_eq!(messages_text(&body), "Hello", "{body}");
        let (last, data) = named_events(&body).pop().unwrap();
        assert_eq!(last, "error", "{body}");
        assert_eq!(data["error"]["type"], kind, "{body}");
        let said = data["error"]["message"].as_str().unwrap();
        assert!(said.contains(message), "{body}");
        let gw = gateway(&routes(&[anthropic_hop("a", &a.url(), &keys)], "", "")).await;
        // A chat client of the same target: the status and message in the interruption.
        let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
        let body = ans.text();
        let error: Value = sse_data(&body)
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|d| d.get("error").is_some())
            .unwrap_or_else(|| panic!("no error event: {body}"));
        assert_eq!(error["error"]["code"], "stream_interrupted", "{body}");
        assert_eq!(error["error"]["status"], status, "{body}");
        let said = error["error"]["message"].as_str().unwrap();
        assert!(
            said.contains(message) && said.contains("upstream_error"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn a_responses_stream_of_a_tool_call_is_the_typed_event_sequence() {
    let call = |args: &str, first: bool| {
        let mut tc = json!({"index": 0, "function": {"arguments": args}});
        if first {
            tc = json!({"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": args}});
        }
        fake::chunk_event("m", json!({"tool_calls": [tc]}), None)
    };
    let pieces = vec![
        fake::chunk_event("m", json!({"role": "assistant", "content": null}), None),
        call("{\"loc", true),
        call("ation\":\"Paris\"}", false),
        fake::chunk_event("m", json!({}), Some("tool_calls")),
        fake::SSE_DONE.to_owned(),
    ];
    let a = Fake::always(Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()).target("capabilities: [tools]")],
        "",
        "",
    ))
    .await;
    let tool = json!({"type": "function", "name": "get_weather",
                      "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}});
    let body = json!({"model": "gpt-4o", "input": "weather?", "stream": true, "tools": [tool]});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let events = named_events(&ans.text());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"response.created"), "{names:?}");
    assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
    for want in [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] {
        assert!(names.contains(&want), "{want} missing: {names:?}");
    }
    let seqs: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let (_, done) = events
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(done["arguments"], "{\"location\":\"Paris\"}");
    let (_, completed) = events.last().unwrap();
    let item = &completed["response"]["output"][0];
    assert_eq!(item["type"], "function_call");
    assert_eq!(item["call_id"], "call_1");
    assert_eq!(item["name"], "get_weather");
    // The tool went upstream as a chat function tool.
    assert_eq!(
        a.seen()[0].body["tools"][0]["function"]["name"],
        "get_weather"
    );
}

/// Parallel calls that a server numbers all 0, told apart by their ids
/// (Ollama, some vLLM builds), with a text delta between a call's fragments:
/// two whole calls for a Messages and a Responses client, the text after them.
#[tokio::test]
async fn parallel_calls_on_one_index_stay_apart_for_messages_and_responses_clients() {
    let call = |id: Option<&str>, name: &str, args: &str| {
        let mut tc = json!({"index": 0, "function": {"arguments": args}});
        if let Some(id) = id {
            tc = json!({"index": 0, "id": id, "type": "function",
                        "function": {"name": name, "arguments": args}});
        }
        fake::chunk_event("m", json!({"tool_calls": [tc]}), None)
    };
    let pieces = vec![
        fake::chunk_event("m", json!({"role": "assistant", "content": null}), None),
        call(Some("c1"), "a", "{\"x\""),
        fake::chunk_event("m", json!({"content": "\n"}), None),
        call(None, "", ":1}"),
        call(Some("c2"), "b", "{\"y\":2}"),
        fake::chunk_event("m", json!({}), Some("tool_calls")),
        fake::SSE_DONE.to_owned(),
    ];
    let a = Fake::always(Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;

    let ans = messages(&gw, hello_messages(true)).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let events = named_events(&ans.text());
    let mut blocks: Vec<(Value, String)> = Vec::new();
    for (name, data) in &events {
        match name.as_str() {
            "content_block_start" => blocks.push((data["content_block"].clone(), String::new())),
            "content_block_delta" => {
                let delta = &data["delta"];
                let piece = delta["partial_json"].as_str().or(delta["text"].as_str());
                blocks
                    .last_mut()
                    .unwrap()
                    .1
                    .push_str(piece.unwrap_or_default());
            }
            _ => {}
        }
    }
    let seen: Vec<(&str, &str, &str)> = blocks
        .iter()
        .map(|(b, got)| {
            (
                b["type"].as_str().unwrap(),
                b["id"].as_str().unwrap_or(""),
                got.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("tool_use", "c1", "{\"x\":1}"),
            ("tool_use", "c2", "{\"y\":2}"),
            ("text", "", "\n")
        ],
        "{}",
        ans.text()
    );

    let body = json!({"model": "gpt-4o", "input": "go", "stream": true});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let events = named_events(&ans.text());
    let (_, completed) = events.last().unwrap();
    let calls: Vec<(&str, &str)> = completed["response"]["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "function_call")
        .map(|item| {
            (
                item["call_id"].as_str().unwrap(),
                item["arguments"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [("c1", "{\"x\":1}"), ("c2", "{\"y\":2}")],
        "{}",
        ans.text()
    );
}

/// Codex's and the Agents SDK's input reaches a chat target in the shape
/// strict chat servers take: `developer` as `system`, and an assistant turn's
/// text and its calls as one message.
#[tokio::test]
async fn responses_input_reaches_a_chat_target_as_strict_templates_take_it() {
    let a = Fake::always(fake::completion("m", "done")).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": "/"}]});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let sent = &a.seen()[0].body["messages"];
    let roles: Vec<&str> = sent
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool"],
        "{sent}"
    );
    assert_eq!(sent[2]["content"], "Let me look.", "{sent}");
    assert_eq!(
        sent[2]["tool_calls"].as_array().map(Vec::len),
        Some(2),
        "{sent}"
    );
}

/// A chat target's refusal is a `refusal` content part for a Responses
/// client, as OpenAI's own answer holds it, not text.
#[tokio::test]
async fn a_refusal_is_a_refusal_part_for_a_responses_client() {
    let refused = fake::json(
        200,
        &json!({"id": "c", "object": "chat.completion", "created": 1,
        "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": null, "refusal": "I can't help with that."}}]})
        .to_string(),
    );
    let a = Fake::always(refused).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = responses(&gw, json!({"model": "gpt-4o", "input": "go"})).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let part = &ans.json()["output"][0]["content"][0];
    assert_eq!(part["type"], "refusal", "{}", ans.text());
    assert_eq!(part["refusal"], "I can't help with that.");
}

/// An answer the token limit cut is an `incomplete` response whose cut item
/// says so too, as OpenAI's own.
#[tokio::test]
async fn a_responses_answer_cut_by_its_limit_is_incomplete_to_its_last_item() {
    let cut = fake::json(
        200,
        &json!({"id": "c", "object": "chat.completion", "created": 1,
        "model": "m", "choices": [{"index": 0, "finish_reason": "length",
        "message": {"role": "assistant", "content": "The answer is"}}]})
        .to_string(),
    );
    let a = Fake::always(cut).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "go", "max_output_tokens": 16});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let got = ans.json();
    assert_eq!(got["status"], "incomplete", "{got}");
    assert_eq!(
        got["incomplete_details"]["reason"], "max_output_tokens",
        "{got}"
    );
    assert_eq!(got["output"][0]["status"], "incomplete", "{got}");
}

#[tokio::test]
async fn malformed_messages_requests_are_anthropic_400s_naming_the_field_with_no_upstream_call() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let user = json!({"role": "user", "content": "hi"});
    let cases = [
        (json!({"model": "gpt-4o", "messages": [user]}), "max_tokens"),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": "hi"}),
            "messages",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]}),
            "messages[0]",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8,
                   "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}),
            "messages[0]",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": [user],
                   "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "tools[0]",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8,
                   "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": [user],
                   "tools": [{"input_schema": {"type": "object"}}]}),
            "tools[0].name",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": [user],
                   "tools": [{"type": "mcp_toolset", "mcp_server_name": "wiki"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8,
                   "messages": [{"role": "user", "content": [{"type": "image",
                       "source": {"type": "base64", "media_type": "image/png"}}]}]}),
            "messages[0].content[0].source",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": "many", "messages": [user]}),
            "max_tokens",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 0, "messages": [user]}),
            "max_tokens",
        ),
        (
            json!({"model": "gpt-4o", "max_tokens": 8, "messages": [user,
                   {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
            "messages[1].content[0]",
        ),
        (json!([{"role": "user"}]), "JSON object"),
    ];
    for (body, field) in cases {
        let ans = messages(&gw, body.clone()).await;
        assert_eq!(ans.status, 400, "{body}: {}", ans.text());
        let v = ans.json();
        assert_eq!(v["type"], "error", "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(field),
            "{body}: `{message}` should name {field}"
        );
    }
    let ans = post_raw(
        gw.addr,
        "/v1/messages",
        "{not json",
        &[("x-request-id", "rid-m")],
    )
    .await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert_eq!(ans.header("x-request-id"), "rid-m");
    assert_eq!(ans.json()["error"]["type"], "invalid_request_error");
    assert_eq!(a.calls(), 0, "nothing malformed may reach an upstream");
}

#[tokio::test]
async fn malformed_responses_requests_are_400s_naming_the_param_with_no_upstream_call() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let cases = [
        (json!({"model": "gpt-4o", "input": 5}), "input", None),
        (json!({"model": "gpt-4o"}), "input", None),
        (
            json!({"model": "gpt-4o", "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_video"}]}]}),
            "input[0]",
            None,
        ),
        (
            json!({"model": "gpt-4o", "input": "x", "previous_response_id": "resp_unknown"}),
            "previous_response_id",
            Some("previous_response_not_found"),
        ),
        (
            json!({"model": "gpt-4o", "input": [{"role": "user",
                   "content": [{"type": "input_text"}]}]}),
            "input[0].content[0].text",
            None,
        ),
        (
            json!({"model": "gpt-4o", "input": "x", "tool_choice": "sometimes"}),
            "tool_choice",
            None,
        ),
        (
            json!({"model": "gpt-4o", "input": [{"type": "bogus"}]}),
            "input[0].type",
            None,
        ),
        (json!(["model", "gpt-4o"]), "body", None),
    ];
    for (body, param, code) in cases {
        let ans = post_raw(
            gw.addr,
            "/v1/responses",
            body.to_string(),
            &[("x-request-id", "rid-r")],
        )
        .await;
        assert_eq!(ans.status, 400, "{body}: {}", ans.text());
        assert_eq!(ans.header("x-request-id"), "rid-r", "{body}");
        let err = &ans.json()["error"];
        assert_eq!(err["type"], "invalid_request_error", "{body}: {err}");
        let named = err["param"].as_str().unwrap_or_default();
        assert!(
            named.starts_with(param),
            "{body}: param `{named}`, want {param}"
        );
        assert_eq!(
            err["code"],
            code.unwrap_or("invalid_request"),
            "{body}: {err}"
        );
    }
    assert_eq!(a.calls(), 0, "nothing malformed may reach an upstream");
}

#[tokio::test]
async fn a_rate_limit_is_an_anthropic_rate_limit_error_with_its_wait() {
    let limited = Reply::Json {
        status: 429,
        body: json!({"error": {"message": "slow down", "type": "rate_limit_error"}}).to_string(),
        headers: vec![("retry-after".to_owned(), "7".to_owned())],
    };
    let a = Fake::always(limited).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = messages(&gw, hello_messages(false)).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert!(!ans.header("retry-after").is_empty(), "{:?}", ans.headers);
    let v = ans.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    // The same failure to a Responses client is OpenAI's envelope.
    let ans = responses(&gw, json!({"model": "gpt-4o", "input": "hi"})).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert!(ans.json()["error"]["message"].is_string());
}

#[tokio::test]
async fn a_previous_response_id_carries_the_conversation_and_the_store_answers_get_and_delete() {
    let a = Fake::start(|n, _| fake::completion("model-a", &format!("answer {n}"))).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let first = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "hi", "instructions": "be brief"}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let second = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "and then?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.json()["previous_response_id"], id.as_str());
    // Instructions are not inherited; the turns are.
    assert_eq!(
        a.seen()[1].body["messages"],
        json!([{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "answer 0"},
               {"role": "user", "content": "and then?"}])
    );
    let got = get(gw.addr, &format!("/v1/responses/{id}")).await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json()["id"], id.as_str());
    let req = http::Request::delete(gw.url(&format!("/v1/responses/{id}")))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let deleted = client().request(req).await.unwrap();
    assert_eq!(deleted.status(), 200);
    let gone = get(gw.addr, &format!("/v1/responses/{id}")).await;
    assert_eq!(gone.status, 404);
    assert_eq!(gone.header("x-should-retry"), "false");
    // store: false keeps nothing.
    let unstored = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "x", "store": false}),
    )
    .await;
    let id = unstored.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        get(gw.addr, &format!("/v1/responses/{id}")).await.status,
        404
    );
}

#[tokio::test]
async fn count_tokens_is_the_anthropic_targets_count_when_it_answers_else_the_estimate() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::start(
        |n, seen: &Seen| match (n, seen.uri.ends_with("/messages/count_tokens")) {
            (0, true) => fake::json(200, r#"{"input_tokens": 42}"#),
            (2, true) => fake::json(
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"messages.0: bad block (key sk-ant-inbound-test-0123456789)"}}"#,
            ),
            _ => fake::error(500, "no count today"),
        },
    )
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&routes(
        &[hop("b", &b.url()), anthropic_hop("a", &a.url(), &keys)],
        "",
        "",
    ))
    .await;
    let body = json!({"model": "gpt-4o", "system": "be brief",
                      "messages": [{"role": "user", "content": "hello there"}]})
    .to_string();
    let headers = [("anthropic-beta", "token-counting-2024-11-01")];
    let counted = post_raw(gw.addr, "/v1/messages/count_tokens", body.clone(), &headers).await;
    assert_eq!(counted.status, 200, "{}", counted.text());
    assert_eq!(counted.json(), json!({"input_tokens": 42}));
    assert_eq!(counted.header("x-switchyard-token-count"), "provider");
    assert_eq!(counted.header("x-switchyard-target"), "a");
    let seen = &a.seen()[0];
    assert_eq!(seen.body["model"], "upstream-a");
    assert_eq!(seen.body["system"], "be brief");
    assert_eq!(seen.headers["anthropic-beta"], "token-counting-2024-11-01");
    assert_eq!(seen.headers["x-api-key"], "sk-ant-inbound-test-0123456789");
    // The provider fails: switchyard's estimate, said so.
    let estimated = post_raw(gw.addr, "/v1/messages/count_tokens", body.clone(), &[]).await;
    assert_eq!(estimated.status, 200, "{}", estimated.text());
    assert_eq!(estimated.header("x-switchyard-token-count"), "estimate");
    assert!(estimated.json()["input_tokens"].as_u64().unwrap() > 0);
    // The provider refuses the request itself: that is the client's answer,
    // in Anthropic's envelope, the provider's key taken out.
    let refused = post_raw(gw.addr, "/v1/messages/count_tokens", body.clone(), &[]).await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    let error = refused.json();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bad block"),
        "{error}"
    );
    assert!(!refused.text().contains("0123456789"), "{error}");
    // A task no name selects is a 404, as `/v1/messages` says it.
    let unknown = post_raw(
        gw.addr,
        "/v1/messages/count_tokens",
        body,
        &[("x-task-type", "nope")],
    )
    .await;
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    assert_eq!(unknown.json()["error"]["type"], "not_found_error");
    assert_eq!(b.calls(), 0, "a count is no chat call");
}

const CLAUDE_CODE: &str = include_str!("fixtures/anthropic/claude_code_request.json");
const THINKING_STREAM: &str = include_str!("fixtures/anthropic/stream_thinking.anthropic.sse");
const THINKING_ANSWER: &str = include_str!("fixtures/anthropic/thinking_response.anthropic.json");
const CLAUDE_CODE_HEADERS: [(&str, &str); 3] = [
    ("anthropic-version", "2023-06-01"),
    (
        "anthropic-beta",
        "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
    ),
    ("x-api-key", "sk-ant-client"),
];

/// A gateway whose task `chat`, also the default, runs `hops`, each taking tools.
async fn tool_gateway(hops: Vec<Hop>, task: &str) -> Gw {
    let hops: Vec<Hop> = hops
        .into_iter()
        .map(|h| h.target("capabilities: [tools]"))
        .collect();
    gateway(&routes(&hops, task, "default_task: chat\n")).await
}

/// `body` sent to `/v1/messages` with Claude Code's headers.
async fn claude_code(gw: &Gw, body: &str) -> Answer {
    post_raw(
        gw.addr,
        "/v1/messages",
        body.to_owned(),
        &CLAUDE_CODE_HEADERS,
    )
    .await
}

/// An Anthropic SSE body as a fake's stream, one event per write; `cut`:
/// only the first `n` events, then the connection aborts.
fn anthropic_stream(sse: &str, cut: Option<usize>) -> Reply {
    let mut pieces: Vec<String> = sse
        .split_inclusive("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(str::to_owned)
        .collect();
    if let Some(n) = cut {
        pieces.truncate(n);
    }
    Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: cut.is_some(),
    }
}

/// The `data:` payloads of an SSE body, exactly as written.
fn data_lines(body: &str) -> Vec<&str> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect()
}

/// `body` with its top-level `model` value set to `model`, nothing else moved.
fn with_model(body: &str, from: &str, to: &str) -> String {
    let was = format!("\"model\":\"{from}\"");
    assert_eq!(body.matches(&was).count(), 1);
    body.replacen(&was, &format!("\"model\":\"{to}\""), 1)
}

#[tokio::test]
async fn a_claude_code_request_goes_to_an_anthropic_target_as_sent_and_its_stream_comes_back_as_sent(
) {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(anthropic_stream(THINKING_STREAM, None)).await;
    let gw = tool_gateway(vec![anthropic_hop("a", &a.url(), &keys)], "").await;
    let ans = claude_code(&gw, CLAUDE_CODE).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "a");
    // Upstream: the client's bytes, only `model` rewritten — system blocks
    // with cache_control, 21 tools, thinking, its signature, and a field
    // switchyard does not know (`context_management`) all as sent.
    let seen = &a.seen()[0];
    let expected = with_model(CLAUDE_CODE, "claude-sonnet-4-5-20250929", "upstream-a");
    assert_eq!(std::str::from_utf8(&seen.raw).unwrap(), expected);
    assert_eq!(seen.headers["anthropic-beta"], CLAUDE_CODE_HEADERS[1].1);
    assert_eq!(seen.headers["x-api-key"], "sk-ant-inbound-test-0123456789");
    // Back: the stream byte for byte as the target wrote it (its spacing
    // included), the thinking and signature deltas among them, nothing added.
    let body = ans.text();
    assert_eq!(body, THINKING_STREAM);
}

#[tokio::test]
async fn an_anthropic_targets_whole_answer_comes_back_as_sent() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, THINKING_ANSWER)).await;
    let gw = tool_gateway(vec![anthropic_hop("a", &a.url(), &keys)], "").await;
    let request = CLAUDE_CODE.replacen("\"stream\":true", "\"stream\":false", 1);
    let ans = claude_code(&gw, &request).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    // Redacted thinking, the signature and citations are the target's bytes.
    assert_eq!(ans.text(), THINKING_ANSWER);
    assert_eq!(ans.header("content-type"), "application/json");
    let sent = with_model(&request, "claude-sonnet-4-5-20250929", "upstream-a");
    assert_eq!(std::str::from_utf8(&a.seen()[0].raw).unwrap(), sent);
}

#[tokio::test]
async fn a_claude_code_request_is_translated_for_an_openai_target_after_a_529() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(529, ANTHROPIC_OVERLOADED)).await;
    let b = Fake::always(fake::stream("model-b", &["It is", " in proxy.rs"])).await;
    let gw = tool_gateway(
        vec![anthropic_hop("a", &a.url(), &keys), hop("b", &b.url())],
        "",
    )
    .await;
    let ans = claude_code(&gw, CLAUDE_CODE).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    let body = ans.text();
    let names = event_names(&body);
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));
    assert_eq!(names.iter().filter(|n| *n == "message_delta").count(), 1);
    assert_eq!(messages_text(&body), "It is in proxy.rs");
    // The prompt's size comes first, as Anthropic says it (an estimate here:
    // the chat target counts it at the end), for Claude Code's context meter.
    let (_, start) = &named_events(&body)[0];
    let said = start["message"]["usage"]["input_tokens"].as_u64().unwrap();
    assert!(said > 1000, "{start}");
    // The Anthropic target had the client's bytes; the chat one a chat body
    // with every tool, and the tool round trip as chat messages.
    let sent = with_model(CLAUDE_CODE, "claude-sonnet-4-5-20250929", "upstream-a");
    assert_eq!(std::str::from_utf8(&a.seen()[0].raw).unwrap(), sent);
    let to_b = &b.seen()[0].body;
    assert_eq!(to_b["tools"].as_array().map(Vec::len), Some(21), "{to_b}");
    assert_eq!(to_b["messages"][0]["role"], "system");
    assert!(to_b["messages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["role"] == "tool" && m["tool_call_id"] == "toolu_01A09q90qw90lq917835lq9"));
}

#[tokio::test]
async fn an_anthropic_stream_broken_mid_text_is_finished_by_an_openai_target_in_the_same_block() {
    let keys = tempfile::tempdir().unwrap();
    // Cut after the first text delta: message_start .. text_delta "The retry logic is in src/proxy.rs."
    let a = Fake::always(anthropic_stream(THINKING_STREAM, Some(9))).await;
    // Without prefill, the next target answers afresh and the delivered
    // prefix is skipped.
    let b = Fake::always(fake::stream(
        "model-b",
        &[
            "The retry logic",
            " is in src/proxy.rs.",
            " Let me",
            " read it.",
        ],
    ))
    .await;
    let gw = tool_gateway(
        vec![anthropic_hop("a", &a.url(), &keys), hop("b", &b.url())],
        "stream_recovery: { mode: continue }",
    )
    .await;
    let ans = claude_code(&gw, CLAUDE_CODE).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let body = ans.text();
    let events = named_events(&body);
    // What the Anthropic target sent went out as it came...
    let upstream = data_lines(THINKING_STREAM);
    assert_eq!(data_lines(&body)[..9], upstream[..9], "{body}");
    // ...and the continuation carries on in the open text block (index 1).
    let rest: Vec<_> = events[9..].iter().map(|(n, d)| (n.as_str(), d)).collect();
    assert!(
        rest.iter()
            .filter(|(n, _)| *n == "content_block_delta")
            .all(|(_, d)| d["index"] == 1 && d["delta"]["type"] == "text_delta"),
        "{body}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|(n, _)| n == "content_block_start")
            .count(),
        2,
        "{body}"
    );
    assert!(!events.iter().any(|(n, _)| n == "error"), "{body}");
    assert_eq!(
        events.iter().filter(|(n, _)| n == "message_delta").count(),
        1
    );
    assert_eq!(events.last().map(|(n, _)| n.as_str()), Some("message_stop"));
    assert_eq!(
        messages_text(&body),
        "The retry logic is in src/proxy.rs. Let me read it.",
        "{body}"
    );
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn a_tool_call_held_to_the_contract_comes_back_in_the_order_the_target_sent_it() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(anthropic_stream(THINKING_STREAM, None)).await;
    let gw = tool_gateway(
        vec![anthropic_hop("a", &a.url(), &keys)],
        "validate_tool_calls: always",
    )
    .await;
    let ans = claude_code(&gw, CLAUDE_CODE).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    // The call's block end waited with the held call, not ahead of it.
    let body = ans.text();
    assert_eq!(data_lines(&body), data_lines(THINKING_STREAM), "{body}");
}

/// Blocks only Anthropic reads, as a client sends them back in later turns:
/// a server tool's call and result, a search result, a document by URL, an
/// image by file id.
fn anthropic_only_turns() -> Vec<(&'static str, Value)> {
    let user = |content: Value| json!([{"role": "user", "content": content}]);
    vec![
        (
            "messages[1].content[1].type",
            json!([
                {"role": "user", "content": "news today?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Searching."},
                    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                     "input": {"query": "news"}},
                    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                     "content": [{"type": "web_search_result", "url": "https://example.com",
                                  "title": "Example", "encrypted_content": "EqgfCioIARgB"}]},
                    {"type": "text", "text": "Here is the news.",
                     "citations": [{"type": "web_search_result_location", "url": "https://example.com",
                                    "title": "Example", "encrypted_index": "Eo8BCi", "cited_text": "news"}]}
                ]},
                {"role": "user", "content": "and?"}
            ]),
        ),
        (
            "messages[0].content[0].type",
            user(
                json!([{"type": "search_result", "source": "https://example.com/a", "title": "A",
                         "content": [{"type": "text", "text": "alpha"}]},
                        {"type": "text", "text": "sum it up"}]),
            ),
        ),
        (
            "messages[0].content[0].source.type",
            user(
                json!([{"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
                        {"type": "text", "text": "sum it up"}]),
            ),
        ),
        (
            "messages[0].content[0].source.type",
            user(
                json!([{"type": "image", "source": {"type": "file", "file_id": "file_011"}},
                        {"type": "text", "text": "what is it?"}]),
            ),
        ),
        (
            "messages[0].content[0].source.type",
            user(json!([{"type": "document", "source": {"type": "content",
                         "content": [{"type": "text", "text": "alpha"}]}},
                        {"type": "text", "text": "sum it up"}])),
        ),
    ]
}

#[tokio::test]
async fn the_mcp_connector_goes_only_to_an_anthropic_target() {
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(&[hop("b", &b.url())], "", "")).await;
    let mut body = hello_messages(false);
    body["mcp_servers"] =
        json!([{"type": "url", "url": "https://mcp.example.com/sse", "name": "x"}]);
    let ans = messages(&gw, body).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(ans.text().contains("mcp_servers"), "{}", ans.text());
    assert_eq!(b.calls(), 0);
    let mut body = hello_messages(false);
    body["mcp_servers"] = json!([]);
    assert_eq!(messages(&gw, body).await.status, 200);
}

#[tokio::test]
async fn blocks_only_anthropic_reads_go_to_an_anthropic_target_and_skip_the_others() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let both = gateway(&routes(
        &[hop("b", &b.url()), anthropic_hop("a", &a.url(), &keys)],
        "",
        "",
    ))
    .await;
    let chat_only = gateway(&routes(&[hop("b", &b.url())], "", "")).await;
    for (i, (param, turns)) in anthropic_only_turns().into_iter().enumerate() {
        let body = json!({"model": "gpt-4o", "max_tokens": 64, "messages": turns});
        let ans = messages(&both, body.clone()).await;
        assert_eq!(ans.status, 200, "{param}: {}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "a", "{param}");
        assert_eq!(a.seen()[i].body["messages"], body["messages"], "{param}");
        // Without an Anthropic target: a 400 naming the block, and no call.
        let ans = messages(&chat_only, body).await;
        assert_eq!(ans.status, 400, "{param}: {}", ans.text());
        let message = ans.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains(param), "{param}: {message}");
    }
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn a_server_tool_skips_targets_of_the_other_protocol() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    // The chat target first: it cannot run Anthropic's web search.
    let gw = gateway(&routes(
        &[
            hop("b", &b.url()).target("capabilities: [tools]"),
            anthropic_hop("a", &a.url(), &keys).target("capabilities: [tools]"),
        ],
        "",
        "",
    ))
    .await;
    let body = json!({"model": "gpt-4o", "max_tokens": 64,
        "messages": [{"role": "user", "content": "news today?"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]});
    let ans = messages(&gw, body.clone()).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "a");
    assert_eq!(a.seen()[0].body["tools"], body["tools"]);
    assert_eq!(b.calls(), 0);
    let page = get(gw.addr, "/metrics").await.text();
    assert!(
        page.contains(
            r#"switchyard_route_exclusions_total{task="chat",target="b",reason="protocol"}"#
        ),
        "{page}"
    );
    // Without an Anthropic target, a 400 that says why, and no call.
    let gw = gateway(&routes(
        &[hop("b", &b.url()).target("capabilities: [tools]")],
        "",
        "",
    ))
    .await;
    let ans = messages(&gw, body).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("web_search_20250305"), "{message}");
    // A Responses built-in tool: no target here speaks Responses.
    let ans = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "x", "tools": [{"type": "web_search"}]}),
    )
    .await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(
        ans.text().contains("built-in tool `web_search`"),
        "{}",
        ans.text()
    );
    // A built-in tool's call of an earlier turn, likewise.
    let input = json!([{"type": "web_search_call", "id": "ws_1", "status": "completed"},
                       {"role": "user", "content": "and?"}]);
    let ans = responses(&gw, json!({"model": "gpt-4o", "input": input})).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(ans.text().contains("input[0].type"), "{}", ans.text());
    assert_eq!(b.calls(), 0);
    // With a target that speaks Responses first, it is that target's.
    let a = Fake::always(fake::json(200, RESPONSES_ANSWER)).await;
    let gw = gateway(&routes(
        &[responses_hop("a", &a.url()), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    let ans = responses(&gw, json!({"model": "gpt-4o", "input": input})).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.seen()[0].body["input"], input);
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn a_tool_choice_only_responses_honours_is_a_responses_targets() {
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let chat_only = gateway(&routes(
        &[hop("b", &b.url()).target("capabilities: [tools]")],
        "",
        "",
    ))
    .await;
    let function = json!({"type": "function", "name": "f", "parameters": {"type": "object"}});
    let cases = [
        (
            json!({"type": "allowed_tools", "mode": "auto",
                "tools": [{"type": "function", "name": "f"}]}),
            400,
            "tool_choice.type",
        ),
        (
            json!({"type": "mcp", "server_label": "deepwiki"}),
            400,
            "tool_choice.type",
        ),
        (json!({"type": "function"}), 400, "tool_choice.name"),
        (json!({"name": "f"}), 400, "tool_choice"),
        (json!({"type": "function", "name": "f"}), 200, ""),
    ];
    for (choice, status, param) in cases {
        let body =
            json!({"model": "gpt-4o", "input": "x", "tools": [function], "tool_choice": choice});
        let ans = responses(&chat_only, body).await;
        assert_eq!(ans.status, status, "{choice}: {}", ans.text());
        assert!(ans.text().contains(param), "{choice}: {}", ans.text());
    }
    assert_eq!(b.calls(), 1, "only the function's choice went upstream");
    // A Responses target takes it as sent.
    let a = Fake::always(fake::json(200, RESPONSES_ANSWER)).await;
    let gw = gateway(&routes(
        &[
            hop("b", &b.url()).target("capabilities: [tools]"),
            responses_hop("a", &a.url()).target("capabilities: [tools]"),
        ],
        "",
        "",
    ))
    .await;
    let choice = json!({"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": "f"}]});
    let body = json!({"model": "gpt-4o", "input": "x", "tools": [function], "tool_choice": choice});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.seen()[0].body["tool_choice"], choice);
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn explain_reads_each_front_doors_body_and_shows_the_protocol_skip() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&routes(
        &[
            hop("b", &b.url()).target("capabilities: [tools]"),
            anthropic_hop("a", &a.url(), &keys).target("capabilities: [tools]"),
        ],
        "",
        "",
    ))
    .await;
    let with_server_tool = json!({"model": "gpt-4o", "max_tokens": 64,
        "messages": [{"role": "user", "content": "news?"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
    let path = "/admin/explain?protocol=messages";
    let ans = post_raw(gw.addr, path, with_server_tool.to_string(), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["task"], "chat");
    let candidates = v["candidates"].as_array().unwrap();
    assert_eq!(candidates[0]["target"], "b");
    assert_eq!(candidates[0]["held_back"]["reason"], "protocol", "{v}");
    assert!(candidates[1].get("held_back").is_none(), "{v}");
    // A Responses body, and a Messages body refused in its own envelope.
    let ans = post_raw(
        gw.addr,
        "/admin/explain?protocol=responses",
        json!({"model": "gpt-4o", "input": "hi"}).to_string(),
        &[],
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["needs"]["max_tokens"], Value::Null);
    let ans = post_raw(gw.addr, path, json!({"model": "gpt-4o"}).to_string(), &[]).await;
    assert_eq!(ans.status, 400);
    assert_eq!(ans.json()["error"]["type"], "invalid_request_error");
    let ans = post_raw(
        gw.addr,
        "/admin/explain?protocol=grpc",
        "{}".to_owned(),
        &[],
    )
    .await;
    assert_eq!(ans.status, 400);
    assert_eq!((a.calls(), b.calls()), (0, 0));
}

const RESPONSES_ANSWER: &str = include_str!("fixtures/responses/answer_reasoning_text.json");
const RESPONSES_STREAM: &str = include_str!("fixtures/responses/stream_reasoning_text.sse");

/// A hop whose provider also serves the Responses API.
fn responses_hop(name: &str, url: &str) -> Hop {
    hop(name, url).provider("responses: true\n")
}

/// A Responses request as an SDK sends it, with fields switchyard does not
/// read and a built-in tool only a Responses target runs.
const RESPONSES_REQUEST: &str = r#"{"model":"gpt-4o","input":[{"role":"user","content":[{"type":"input_text","text":"How should I retry?"}]}],"include":["reasoning.encrypted_content"],"reasoning":{"effort":"low"},"tools":[{"type":"web_search"}],"text":{"verbosity":"medium"},"store":true}"#;

/// A reasoning item switchyard made from a chat fallback's reasoning, sent
/// back by a stateless client (`store: false`, the last output as input),
/// is left out for a Responses target, which would refuse an id it never
/// made; the target's own reasoning items go up as sent.
#[tokio::test]
async fn reasoning_items_switchyard_made_never_reach_a_responses_target() {
    let chat = Fake::always(fake::json(
        200,
        &json!({"id": "c", "object": "chat.completion",
        "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "42", "reasoning_content": "thinking"}}]})
        .to_string(),
    ))
    .await;
    let target = Fake::always(fake::json(200, RESPONSES_ANSWER)).await;
    let gw = tool_gateway(vec![hop("c", &chat.url())], "").await;
    let first = json!({"model": "gpt-4o", "store": false, "input": "6 times 7?"});
    let ans = responses(&gw, first).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let output = ans.json()["output"].as_array().unwrap().clone();
    assert_eq!(output[0]["type"], "reasoning", "{}", ans.text());

    let gw = tool_gateway(vec![responses_hop("r", &target.url())], "").await;
    let own = json!({"type": "reasoning", "id": "rs_68af0c1e2b5c8190", "summary": [],
        "encrypted_content": "gAAAA"});
    let mut input = vec![json!({"role": "user", "content": "6 times 7?"})];
    input.extend(output);
    input.push(own.clone());
    input.push(json!({"role": "user", "content": "and 6 times 8?"}));
    let ans = responses(
        &gw,
        json!({"model": "gpt-4o", "store": false, "input": input}),
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let sent = &target.seen()[0].body;
    let kinds: Vec<&str> = sent["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap_or("message"))
        .collect();
    assert_eq!(
        kinds,
        ["message", "message", "reasoning", "message"],
        "{sent}"
    );
    assert_eq!(sent["input"][2], own, "{sent}");
    assert_eq!(sent["model"], "upstream-r", "{sent}");
}

#[tokio::test]
async fn a_responses_client_is_served_by_a_responses_target_as_sent() {
    let a = Fake::start(|_, seen| match seen.body["stream"].as_bool() {
        Some(true) => anthropic_stream(RESPONSES_STREAM, None),
        _ => fake::json(200, RESPONSES_ANSWER),
    })
    .await;
    let gw = tool_gateway(vec![responses_hop("a", &a.url())], "").await;
    let ans = post_raw(gw.addr, "/v1/responses", RESPONSES_REQUEST.to_owned(), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    // The target's bytes: encrypted reasoning, citations, fields switchyard
    // does not know.
    assert_eq!(ans.text(), RESPONSES_ANSWER);
    let seen = &a.seen()[0];
    assert_eq!(seen.uri, "/v1/responses");
    let sent = with_model(RESPONSES_REQUEST, "gpt-4o", "upstream-a");
    assert_eq!(std::str::from_utf8(&seen.raw).unwrap(), sent);

    let streamed = RESPONSES_REQUEST.replacen("\"store\":true", "\"stream\":true", 1);
    let ans = post_raw(gw.addr, "/v1/responses", streamed, &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.text(), RESPONSES_STREAM, "byte for byte");
    // Both answers were kept under the target's own ids.
    for id in [
        "resp_68af0c1e2b5c8190a1b2c3d4e5f60718",
        "resp_68af0c1e2b5c8190a1b2c3d4e5f60719",
    ] {
        let got = get(gw.addr, &format!("/v1/responses/{id}")).await;
        assert_eq!(got.status, 200, "{id}: {}", got.text());
        assert_eq!(
            got.json()["output"][1]["content"][0]["text"],
            "Retry with jittered backoff."
        );
    }
}

#[tokio::test]
async fn a_chat_client_of_a_responses_provider_goes_to_chat_completions() {
    let a = Fake::start(|_, seen| match seen.uri.as_str() {
        "/v1/responses" => fake::json(200, RESPONSES_ANSWER),
        _ => fake::completion("model-a", "hi"),
    })
    .await;
    let gw = gateway(&routes(&[responses_hop("a", &a.url())], "", "")).await;
    let ans = chat(
        gw.addr,
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.seen()[0].uri, "/v1/chat/completions");
    // A Responses client without a built-in tool: the Responses road.
    let ans = responses(&gw, json!({"model": "gpt-4o", "input": "hi"})).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.text(), RESPONSES_ANSWER);
    assert_eq!(a.seen()[1].uri, "/v1/responses");
}

#[tokio::test]
async fn a_responses_client_fails_over_from_a_responses_target_to_a_chat_one_and_keeps_its_conversation(
) {
    let a = Fake::start(|n, _| match n {
        0 => fake::json(200, RESPONSES_ANSWER),
        _ => fake::error(503, "overloaded"),
    })
    .await;
    let b = Fake::always(fake::completion("model-b", "Use a budget.")).await;
    let gw = gateway(&routes(
        &[responses_hop("a", &a.url()), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    let first = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "How should I retry?"}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let id = first.json()["id"].as_str().unwrap().to_owned();
    // The next turn: the Responses target is down, the chat one gets the
    // whole conversation (the id is none it knows).
    let second = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "And a cap?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(second.header("x-switchyard-target"), "b");
    assert_eq!(
        second.json()["output"][0]["content"][0]["text"],
        "Use a budget."
    );
    assert_eq!(
        b.seen()[0].body["messages"],
        json!([{"role": "user", "content": "How should I retry?"},
               {"role": "assistant", "content": "Retry with jittered backoff."},
               {"role": "user", "content": "And a cap?"}])
    );
    // The turn after, back on the Responses target: the conversation goes
    // as input items, without an id it never made.
    a.set(|_, _| fake::json(200, RESPONSES_ANSWER));
    let second_id = second.json()["id"].as_str().unwrap().to_owned();
    let third = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "Thanks", "previous_response_id": second_id, "store": false}),
    )
    .await;
    assert_eq!(third.status, 200, "{}", third.text());
    let sent = a.seen().last().unwrap().body.clone();
    assert!(sent.get("previous_response_id").is_none(), "{sent}");
    assert_eq!(sent["store"], false);
    let texts: Vec<_> = sent["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["role"].as_str().unwrap(), i["content"].as_str().unwrap()))
        .collect();
    assert_eq!(
        texts,
        [
            ("user", "How should I retry?"),
            ("assistant", "Retry with jittered backoff."),
            ("user", "And a cap?"),
            ("assistant", "Use a budget."),
            ("user", "Thanks"),
        ]
    );
}

#[tokio::test]
async fn a_responses_stream_broken_mid_text_is_finished_by_a_chat_target_in_the_same_item() {
    // Cut after the second text delta ("Retry", " with").
    let a = Fake::always(anthropic_stream(RESPONSES_STREAM, Some(8))).await;
    let b = Fake::always(fake::stream(
        "model-b",
        &["Retry", " with", " jittered", " backoff."],
    ))
    .await;
    let gw = gateway(&routes(
        &[responses_hop("a", &a.url()), hop("b", &b.url())],
        "stream_recovery: { mode: continue }",
        "",
    ))
    .await;
    let ans = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "How should I retry?", "stream": true}),
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let body = ans.text();
    assert_eq!(
        data_lines(&body)[..8],
        data_lines(RESPONSES_STREAM)[..8],
        "{body}"
    );
    let events = named_events(&body);
    let sequence: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(
        sequence,
        (0..events.len() as u64).collect::<Vec<_>>(),
        "{body}"
    );
    let item = "msg_68af0c22c1a08190a9b8c7d6e5f4a3b3";
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .inspect(|(_, d)| assert_eq!(d["item_id"], item, "{body}"))
        .map(|(_, d)| d["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "Retry with jittered backoff.");
    let (last, done) = events.last().unwrap();
    assert_eq!(last, "response.completed", "{body}");
    assert_eq!(
        done["response"]["id"],
        "resp_68af0c1e2b5c8190a1b2c3d4e5f60719"
    );
    assert_eq!(done["response"]["output"][0]["type"], "reasoning");
    assert_eq!(
        done["response"]["output"][1]["content"][0]["text"],
        "Retry with jittered backoff."
    );
    assert_eq!(b.calls(), 1);
}

/// A chat stream of `chunks` (each a `data:` JSON), then `[DONE]`.
fn chat_stream(chunks: &[Value]) -> Reply {
    let mut pieces: Vec<String> = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    pieces.push("data: [DONE]\n\n".into());
    Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: false,
    }
}

fn delta_chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

/// The content blocks a Messages stream makes: each block's start, with its
/// deltas folded in (text joined, tool input parsed).
fn messages_blocks(body: &str) -> Vec<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut partial: Vec<String> = Vec::new();
    for (name, data) in named_events(body) {
        match name.as_str() {
            "content_block_start" => {
                blocks.push(data["content_block"].clone());
                partial.push(String::new());
            }
            "content_block_delta" => {
                let i = data["index"].as_u64().unwrap() as usize;
                let d = &data["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => {
                        let text = blocks[i]["text"].as_str().unwrap().to_owned();
                        blocks[i]["text"] = json!(text + d["text"].as_str().unwrap());
                    }
                    "input_json_delta" => partial[i].push_str(d["partial_json"].as_str().unwrap()),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    for (block, json) in blocks.iter_mut().zip(partial) {
        if !json.is_empty() {
            block["input"] = serde_json::from_str(&json).unwrap_or_else(|_| panic!("{json}"));
        }
    }
    blocks
}

#[tokio::test]
async fn an_answer_with_odd_metadata_is_rendered_whole_in_every_protocol() {
    let odd = json!({"id": null, "object": "chat.completion", "created": "1", "model": null,
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
            "tool_calls": [{"id": null, "type": "function",
                            "function": {"name": "get_w", "arguments": {"city": "Rome"}}}]}}],
        "usage": {"prompt_tokens": null, "completion_tokens": 7.0, "total_tokens": "9"}});
    let a = Fake::always(fake::json(200, &odd.to_string())).await;
    let gw = tool_gateway(vec![hop("a", &a.url())], "").await;
    let ans = messages(&gw, hello_messages(false)).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["content"][0]["text"], "Hello there", "{v}");
    let call = &v["content"][1];
    assert_eq!(call["name"], "get_w", "{v}");
    assert_eq!(call["input"], json!({"city": "Rome"}), "{v}");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("toolu_")),
        "{v}"
    );
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 7, "{v}");
    let ans = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "hello", "store": false}),
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["output"][0]["content"][0]["text"], "Hello there", "{v}");
    assert_eq!(v["output"][1]["name"], "get_w", "{v}");
    assert!(
        v["output"][1]["call_id"]
            .as_str()
            .is_some_and(|id| !id.is_empty()),
        "{v}"
    );
    // The same oddities on every chunk of a stream.
    let odd = |delta: Value, finish: Option<&str>| {
        let mut c = delta_chunk(delta, finish);
        c["id"] = Value::Null;
        c["model"] = Value::Null;
        c["usage"] = json!({"prompt_tokens": null, "completion_tokens": 2.0});
        c
    };
    let a = Fake::always(chat_stream(&[
        odd(json!({"role": "assistant", "content": "Hel"}), None),
        odd(json!({"content": "lo"}), None),
        odd(json!({}), Some("stop")),
    ]))
    .await;
    let gw = tool_gateway(vec![hop("a", &a.url())], "").await;
    let body = messages(&gw, hello_messages(true)).await.text();
    assert_eq!(messages_text(&body), "Hello", "{body}");
}

#[tokio::test]
async fn parallel_tool_calls_interleaved_or_named_late_reach_a_messages_client_whole() {
    let call = |index: u32, id: Option<&str>, name: Option<&str>, args: &str| {
        let mut c = json!({"index": index, "function": {"arguments": args}});
        if let Some(id) = id {
            c["id"] = json!(id);
            c["type"] = json!("function");
        }
        if let Some(name) = name {
            c["function"]["name"] = json!(name);
        }
        delta_chunk(json!({"tool_calls": [c]}), None)
    };
    let interleaved = [
        call(0, Some("call_A"), Some("get_w"), ""),
        call(1, Some("call_B"), Some("get_w"), ""),
        call(0, None, None, "{\"ci"),
        call(1, None, None, "{\"city\""),
        call(0, None, None, "ty\": \"Par"),
        call(1, None, None, ": \"Rome\"}"),
        call(0, None, None, "is\"}"),
        delta_chunk(json!({}), Some("tool_calls")),
    ];
    // The id and the name in a later fragment than the first; `stop` as the finish.
    let late = [
        call(0, None, None, ""),
        call(0, Some("call_late"), Some("get_w"), "{\"city\": \"Oslo\"}"),
        delta_chunk(json!({}), Some("stop")),
    ];
    for (chunks, want) in [
        (
            &interleaved[..],
            vec![("call_A", "Paris"), ("call_B", "Rome")],
        ),
        (&late[..], vec![("call_late", "Oslo")]),
    ] {
        let a = Fake::always(chat_stream(chunks)).await;
        let gw = tool_gateway(vec![hop("a", &a.url())], "").await;
        let body = messages(&gw, hello_messages(true)).await.text();
        let blocks = messages_blocks(&body);
        let calls: Vec<(&str, &str)> = blocks
            .iter()
            .map(|b| {
                (
                    b["id"].as_str().unwrap(),
                    b["input"]["city"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(calls, want, "{body}");
        assert!(blocks.iter().all(|b| b["name"] == "get_w"), "{body}");
        let (_, delta) = named_events(&body)
            .into_iter()
            .find(|(n, _)| n == "message_delta")
            .unwrap();
        assert_eq!(delta["delta"]["stop_reason"], "tool_use", "{body}");
        // A Responses client gets each call whole, named, too.
        assert_responses_calls_whole(&gw, &want).await;
    }
}

/// A Responses client's stream of the same answer: each call whole, named,
/// with the `(call_id, city)` of `want`, its identity the same in `added`
/// and `done`, and items added in their output order.
async fn assert_responses_calls_whole(gw: &Gw, want: &[(&str, &str)]) {
    let body = post_raw(
        gw.addr,
        "/v1/responses",
        json!({"model": "gpt-4o", "input": "x", "stream": true, "store": false}).to_string(),
        &[],
    )
    .await
    .text();
    let done: Vec<(String, String)> = named_events(&body)
        .into_iter()
        .filter(|(n, d)| n == "response.output_item.done" && d["item"]["type"] == "function_call")
        .map(|(_, d)| {
            let item = &d["item"];
            let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(item["name"], "get_w", "{body}");
            (
                item["call_id"].as_str().unwrap().to_owned(),
                args["city"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(i, c)| ((*i).to_owned(), (*c).to_owned()))
        .collect();
    assert_eq!(done, want, "{body}");
    // An item's identity in `added` is the one in `done` (the openai SDK
    // raises otherwise), and items are added in their output order.
    let identity = |kind: &str| -> Vec<(Value, Value, Value, Value)> {
        named_events(&body)
            .into_iter()
            .filter(|(n, d)| n == kind && d["item"]["type"] == "function_call")
            .map(|(_, d)| {
                let item = &d["item"];
                let at = d["output_index"].clone();
                (
                    at,
                    item["id"].clone(),
                    item["call_id"].clone(),
                    item["name"].clone(),
                )
            })
            .collect()
    };
    let added = identity("response.output_item.added");
    assert_eq!(added, identity("response.output_item.done"), "{body}");
    let order: Vec<u64> = named_events(&body)
        .into_iter()
        .filter(|(n, _)| n == "response.output_item.added")
        .map(|(_, d)| d["output_index"].as_u64().unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] + 1 == w[1]), "{body}");
}

#[tokio::test]
async fn a_thinking_block_without_a_signature_never_reaches_an_anthropic_target() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let gw = gateway(&routes(&[anthropic_hop("a", &a.url(), &keys)], "", "")).await;
    let signed = json!({"type": "thinking", "thinking": "mine", "signature": "EqQBCgIYAhIM"});
    let turn = |thinking: Value| json!({"role": "assistant", "content": [thinking, {"type": "text", "text": "Hi."}]});
    // A turn another provider served (its reasoning rendered unsigned), then Claude's own.
    let body = json!({"model": "gpt-4o", "max_tokens": 64, "messages": [
        {"role": "user", "content": "hello"},
        turn(json!({"type": "thinking", "thinking": "theirs", "signature": ""})),
        {"role": "user", "content": "and?"},
        turn(signed.clone()),
        {"role": "user", "content": "so?"}]});
    let ans = messages(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let sent = &a.seen()[0].body["messages"];
    assert_eq!(
        sent[1]["content"],
        json!([{"type": "text", "text": "Hi."}]),
        "{sent}"
    );
    assert_eq!(sent[3]["content"][0], signed, "{sent}");
    assert_eq!(
        a.seen()[0].body["model"],
        "upstream-a",
        "the model rewritten too"
    );
    // A turn of unsigned reasoning alone is left out whole: Anthropic
    // refuses an empty turn.
    let body = json!({"model": "gpt-4o", "max_tokens": 64, "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "theirs", "signature": ""}]},
        {"role": "user", "content": "more"}]});
    let ans = messages(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let sent = &a.seen()[1].body["messages"];
    assert_eq!(
        sent,
        &json!([{"role": "user", "content": "hello"}, {"role": "user", "content": "more"}]),
        "{sent}"
    );
}

#[tokio::test]
async fn a_chat_targets_reasoning_streams_to_a_responses_client_as_a_reasoning_item() {
    // DeepSeek's name, vLLM's and OpenRouter's, and both at once (the same text).
    let thoughts = [
        json!({"reasoning_content": "Think"}),
        json!({"reasoning": "Think"}),
        json!({"reasoning_content": "Think", "reasoning": "Think"}),
    ];
    for thought in thoughts {
        reasoning_streams_to_a_responses_client(thought).await;
    }
}

async fn reasoning_streams_to_a_responses_client(mut thought: Value) {
    let mut rest = thought.clone();
    for text in rest.as_object_mut().unwrap().values_mut() {
        *text = json!("ing.");
    }
    thought["role"] = json!("assistant");
    let a = Fake::always(chat_stream(&[
        delta_chunk(thought, None),
        delta_chunk(rest, None),
        delta_chunk(json!({"content": "Hi"}), None),
        delta_chunk(json!({}), Some("stop")),
    ]))
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "x", "stream": true, "store": false});
    let body = post_raw(gw.addr, "/v1/responses", body.to_string(), &[])
        .await
        .text();
    let events = named_events(&body);
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.reasoning_summary_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "Thinking.", "{body}");
    let (_, done) = events
        .iter()
        .find(|(n, _)| n == "response.completed")
        .unwrap();
    let output = &done["response"]["output"];
    assert_eq!(output[0]["type"], "reasoning", "{body}");
    assert_eq!(output[0]["summary"][0]["text"], "Thinking.", "{body}");
    assert_eq!(output[1]["content"][0]["text"], "Hi", "{body}");
    // Every event's sequence number is the next one.
    let numbers: Vec<u64> = events
        .iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
}

#[tokio::test]
async fn a_responses_stream_that_fails_keeps_what_went_out_in_its_failed_response() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["The", " quick", " brown"],
        2,
    ))
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "x", "stream": true, "store": false});
    let body = post_raw(gw.addr, "/v1/responses", body.to_string(), &[])
        .await
        .text();
    let (name, failed) = named_events(&body).pop().unwrap();
    assert_eq!(name, "response.failed", "{body}");
    let item = &failed["response"]["output"][0];
    assert_eq!(item["status"], "incomplete", "{body}");
    assert_eq!(item["content"][0]["text"], "The quick", "{body}");
}

#[tokio::test]
async fn a_native_responses_stream_that_fails_lists_its_finished_items_as_sent() {
    // Cut after the second text delta: the reasoning item is done already.
    let a = Fake::always(anthropic_stream(RESPONSES_STREAM, Some(8))).await;
    let gw = gateway(&routes(&[responses_hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "How should I retry?", "stream": true});
    let body = responses(&gw, body).await.text();
    let (name, failed) = named_events(&body).pop().unwrap();
    assert_eq!(name, "response.failed", "{body}");
    let sent = named_events(RESPONSES_STREAM)
        .into_iter()
        .find(|(n, _)| n == "response.output_item.done")
        .unwrap()
        .1;
    let output = &failed["response"]["output"];
    assert_eq!(output[0], sent["item"], "{body}");
    assert_eq!(output[1]["status"], "incomplete", "{body}");
}

#[tokio::test]
async fn a_responses_targets_absurd_output_index_is_relayed_not_believed() {
    let sse = RESPONSES_STREAM.replace("\"output_index\":1", "\"output_index\":99999999999");
    assert_ne!(sse, RESPONSES_STREAM);
    let a = Fake::always(anthropic_stream(&sse, None)).await;
    let gw = gateway(&routes(&[responses_hop("a", &a.url())], "", "")).await;
    let body = json!({"model": "gpt-4o", "input": "How should I retry?", "stream": true});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.text(), sse, "byte for byte");
}

#[tokio::test]
async fn a_reask_of_a_responses_provider_goes_to_its_chat_api() {
    let call = |args: &str| {
        json!({"id": "resp_1", "object": "response", "created_at": 1, "status": "completed",
            "model": "m", "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_1",
            "name": "get_weather", "arguments": args, "status": "completed"}],
            "usage": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10}})
    };
    let fixed = json!({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
            "content": null, "tool_calls": [{"id": "call_2", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]}}]});
    let a = Fake::start(move |_, seen| {
        if seen.uri.ends_with("/responses") {
            fake::json(200, &call(r#"{"town":"Oslo"}"#).to_string())
        } else {
            fake::json(200, &fixed.to_string())
        }
    })
    .await;
    let gw = tool_gateway(
        vec![responses_hop("a", &a.url())],
        "validate_tool_calls: always\ncontract: { repair: [reask] }",
    )
    .await;
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}]);
    let ans = responses(
        &gw,
        json!({"model": "gpt-4o", "input": "weather in Oslo?", "tools": tools}),
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-repaired"), "reask");
    let seen = a.seen();
    assert_eq!(seen.len(), 2);
    assert!(
        seen[1].uri.ends_with("/chat/completions"),
        "{}",
        seen[1].uri
    );
    assert!(seen[1].body["messages"].is_array(), "{}", seen[1].body);
    assert_eq!(
        ans.json()["output"][0]["arguments"],
        "{\"city\":\"Oslo\"}",
        "{}",
        ans.text()
    );
}

#[tokio::test]
async fn an_image_in_a_responses_call_output_reaches_a_chat_target_and_needs_vision() {
    let a = Fake::always(fake::completion("model-a", "from a")).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(
        &[
            hop("a", &a.url()).target("capabilities: [tools]"),
            hop("b", &b.url()).target("capabilities: [tools, vision]"),
        ],
        "",
        "",
    ))
    .await;
    let image = "data:image/png;base64,iVBORw0KGgo=";
    let input = json!([
        {"role": "user", "content": "what is on screen?"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": image}]}]);
    let tools = json!([{"type": "function", "name": "shot", "parameters": {"type": "object"}}]);
    let body = json!({"model": "gpt-4o", "input": input, "tools": tools, "store": false});
    let ans = responses(&gw, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(
        ans.header("x-switchyard-target"),
        "b",
        "the image needs vision"
    );
    assert_eq!(a.calls(), 0);
    let messages = &b.seen()[0].body["messages"];
    assert_eq!(messages[2]["role"], "tool", "{messages}");
    assert_eq!(messages[2]["content"], "here", "{messages}");
    assert_eq!(messages[3]["role"], "user", "{messages}");
    assert_eq!(
        messages[3]["content"][0]["image_url"]["url"], image,
        "{messages}"
    );
}

#[tokio::test]
async fn a_structured_output_format_reaches_either_protocol_and_a_wrong_one_is_refused() {
    let keys = tempfile::tempdir().unwrap();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"], "additionalProperties": false});
    let ask = |format: (&str, Value)| {
        let mut body = hello_messages(false);
        body[format.0] = format.1;
        body
    };
    let ga = (
        "output_config",
        json!({"format": {"type": "json_schema", "schema": schema}}),
    );
    let beta = (
        "output_format",
        json!({"type": "json_schema", "schema": schema}),
    );
    // An Anthropic target with capabilities declared (no `json_mode` tag)
    // gets the format as sent.
    let a = Fake::always(fake::json(200, ANTHROPIC_TEXT)).await;
    let caps = "capabilities: [tools, vision]";
    let gw = gateway(&routes(
        &[anthropic_hop("a", &a.url(), &keys).target(caps)],
        "",
        "",
    ))
    .await;
    let ans = messages(&gw, ask(ga.clone())).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(
        a.seen()[0].body["output_config"]["format"]["schema"],
        schema
    );
    // A chat target gets it as `response_format`.
    let c = Fake::always(fake::completion("model-c", r#"{"city":"Oslo"}"#)).await;
    let gw = gateway(&routes(&[hop("c", &c.url())], "", "")).await;
    for (i, format) in [ga, beta].into_iter().enumerate() {
        let ans = messages(&gw, ask(format)).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        let sent = &c.seen()[i].body["response_format"];
        assert_eq!(sent["type"], "json_schema", "{sent}");
        assert_eq!(sent["json_schema"]["schema"], schema, "{sent}");
    }
    let wrong = messages(
        &gw,
        ask(("output_config", json!({"format": {"type": "xml"}}))),
    )
    .await;
    assert_eq!(wrong.status, 400, "{}", wrong.text());
    assert!(
        wrong.text().contains("output_config.format.type"),
        "{}",
        wrong.text()
    );
    assert_eq!(c.calls(), 2);
}

#[tokio::test]
async fn a_call_named_after_another_is_done_in_its_output_order() {
    let call = |index: u32, id: &str, name: Option<&str>, args: &str| {
        let mut c =
            json!({"index": index, "id": id, "type": "function", "function": {"arguments": args}});
        if let Some(name) = name {
            c["function"]["name"] = json!(name);
        }
        delta_chunk(json!({"tool_calls": [c]}), None)
    };
    let a = Fake::always(chat_stream(&[
        call(0, "call_X", None, "{\"city\": "),
        call(1, "call_Y", Some("get_w"), "{\"city\": \"Rome\"}"),
        call(0, "call_X", Some("get_w"), "\"Oslo\"}"),
        delta_chunk(json!({}), Some("tool_calls")),
    ]))
    .await;
    let gw = tool_gateway(vec![hop("a", &a.url())], "").await;
    let body = json!({"model": "gpt-4o", "input": "x", "stream": true, "store": false});
    let body = responses(&gw, body).await.text();
    let order = |kind: &str| -> Vec<(u64, String)> {
        named_events(&body)
            .into_iter()
            .filter(|(n, d)| n == kind && d["item"]["type"] == "function_call")
            .map(|(_, d)| {
                (
                    d["output_index"].as_u64().unwrap(),
                    d["item"]["call_id"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let want = vec![(0, "call_Y".to_owned()), (1, "call_X".to_owned())];
    assert_eq!(order("response.output_item.added"), want, "{body}");
    assert_eq!(order("response.output_item.done"), want, "{body}");
}
