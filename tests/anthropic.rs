//! Mixed chains: an Anthropic Messages provider behind the OpenAI API,
//! against a fake upstream that answers with recorded Messages fixtures.

use std::time::Duration;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

const TEXT: &str = include_str!("fixtures/anthropic/text_response.anthropic.json");
const STREAM_TEXT: &str = include_str!("fixtures/anthropic/stream_text.anthropic.sse");
const STREAM_TOOLS: &str = include_str!("fixtures/anthropic/stream_tool_use.anthropic.sse");
const OVERLOADED: &str = include_str!("fixtures/anthropic/error_overloaded.json");
const CONTEXT: &str = include_str!("fixtures/anthropic/error_context.json");

/// An Anthropic SSE fixture as one piece per event.
fn sse(fixture: &str) -> Reply {
    let pieces = fixture
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| format!("{e}\n\n"))
        .collect();
    Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    }
}

/// Chain [a, b] where `anthropic` names which providers speak Messages.
async fn setup(a: Reply, b: Reply, anthropic: &[&str]) -> (Fake, Fake, Gw, tempfile::TempDir) {
    let (a, b) = (Fake::always(a).await, Fake::always(b).await);
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("key");
    std::fs::write(&key, "sk-ant-test-0123456789").unwrap();
    let mut cfg = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "");
    for name in anthropic {
        cfg = cfg.replace(
            &format!("  p-{name}:\n"),
            &format!(
                "  p-{name}:\n    protocol: anthropic\n    api_key_file: {}\n",
                key.display()
            ),
        );
    }
    let gw = gateway(&cfg).await;
    (a, b, gw, keys)
}

#[tokio::test]
async fn a_messages_answer_comes_back_as_a_chat_completion() {
    let (a, _b, gw, _k) = setup(fake::json(200, TEXT), fake::completion("b", "b"), &["a"]).await;
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 64, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]});
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "Hello! How can I help you today?"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let seen = &a.seen()[0];
    assert_eq!(seen.headers["x-api-key"], "sk-ant-test-0123456789");
    assert_eq!(seen.headers["anthropic-version"], "2023-06-01");
    assert!(seen.headers.get("authorization").is_none());
    assert_eq!(seen.body["system"], "be brief");
    assert_eq!(seen.body["model"], "upstream-a");
    assert_eq!(seen.body["max_tokens"], 64);
}

#[tokio::test]
async fn a_messages_stream_comes_back_as_chat_chunks() {
    let (_a, _b, gw, _k) = setup(sse(STREAM_TEXT), fake::completion("b", "b"), &["a"]).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    let text = ans.text();
    assert!(text.contains("chat.completion.chunk"), "{text}");
    assert!(!stream_text(&text).is_empty());
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(
        !text.contains("content_block_delta"),
        "no Anthropic event reaches the client"
    );
}

#[tokio::test]
async fn a_context_error_inside_a_messages_stream_reaches_the_client_in_openai_shape() {
    let event = format!(
        "event: message_start\ndata: {}\n\nevent: error\ndata: {}\n\n",
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[],"stop_reason":null,"usage":{"input_tokens":9,"output_tokens":0}}}"#,
        CONTEXT.trim()
    );
    // Both targets speak Messages and both are too small: the upstream's 400 comes back.
    let (_a, _b, gw, _k) = setup(sse(&event), sse(&event), &["a", "b"]).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    let err = &ans.json()["error"];
    assert_eq!(err["code"], "context_length_exceeded", "{err}");
    assert_eq!(err["type"], "invalid_request_error", "{err}");
    assert!(err.get("param").is_some(), "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("prompt is too long"),
        "{err}"
    );
}

#[tokio::test]
async fn a_messages_answer_without_usage_is_booked_by_estimate_not_as_zero() {
    let mut no_usage: serde_json::Value = serde_json::from_str(TEXT).unwrap();
    no_usage.as_object_mut().unwrap().remove("usage");
    let (_a, _b, gw, _k) = setup(
        fake::json(200, &no_usage.to_string()),
        fake::completion("b", "b"),
        &["a"],
    )
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert!(
        ans.json().get("usage").is_none(),
        "no counts are no usage, not zeros: {}",
        ans.text()
    );
    let m = metrics_page(&gw).await;
    let booked = |kind: &str| {
        series_value(
            &m,
            &format!(r#"switchyard_tokens_total{{target="a",kind="{kind}"}}"#),
        )
        .unwrap_or(0.0)
    };
    assert!(booked("prompt") > 0.0 && booked("completion") > 0.0, "{m}");
}

#[tokio::test]
async fn streamed_tool_use_becomes_tool_call_deltas() {
    let (_a, _b, gw, _k) = setup(sse(STREAM_TOOLS), fake::completion("b", "b"), &["a"]).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert!(text.contains("\"tool_calls\""), "{text}");
    assert!(text.contains("\"finish_reason\":\"tool_calls\""), "{text}");
}

#[tokio::test]
async fn overloaded_anthropic_retries_then_fails_over_to_openai() {
    let (a, b, gw, _k) = setup(
        fake::json(529, OVERLOADED),
        fake::completion("model-b", "from b"),
        &["a"],
    )
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (2, 1));
}

#[tokio::test]
async fn openai_failure_fails_over_to_anthropic() {
    let (_a, b, gw, _k) = setup(fake::error(503, "down"), fake::json(200, TEXT), &["b"]).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.json()["choices"][0]["message"]["content"],
        "Hello! How can I help you today?"
    );
    assert!(b.seen()[0].body.get("messages").is_some());
}

/// A tool round trip whose call was made by another provider (Kimi's and
/// DeepSeek's `functions.Bash:0`) reaches an Anthropic target with ids in
/// Anthropic's grammar, the call and its result naming each other; a
/// Messages client served by a chat target gets such ids back, too.
#[tokio::test]
async fn tool_ids_of_another_providers_making_reach_anthropic_in_its_grammar() {
    let (_a, b, gw, _k) = setup(fake::error(503, "down"), fake::json(200, TEXT), &["b"]).await;
    let body = serde_json::json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "functions.Bash:0",
            "type": "function", "function": {"name": "Bash", "arguments": "{\"cmd\":\"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.Bash:0", "content": "a.txt"}]});
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let sent = &b.seen()[0].body["messages"];
    let used = &sent[1]["content"][0];
    let result = &sent[2]["content"][0];
    assert_eq!(used["type"], "tool_use", "{sent}");
    assert_eq!(used["id"], "functions_Bash_0", "{sent}");
    assert_eq!(result["tool_use_id"], "functions_Bash_0", "{sent}");

    let call = fake::json(
        200,
        &serde_json::json!({"id": "c", "object": "chat.completion",
        "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "functions.Bash:1",
        "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]}}]})
        .to_string(),
    );
    let chat_target = Fake::always(call).await;
    let gw = gateway(&chain_config(&[("c", &chat_target.url())], "", "")).await;
    let asked = serde_json::json!({"model": "gpt-4o", "max_tokens": 64,
        "messages": [{"role": "user", "content": "list files"}]});
    let ans = post_raw(gw.addr, "/v1/messages", asked.to_string(), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(
        ans.json()["content"][0]["id"],
        "functions_Bash_1",
        "{}",
        ans.text()
    );
}

#[tokio::test]
async fn anthropic_context_error_is_returned_in_openai_format() {
    let (_a, _b, gw, _k) = setup(
        fake::json(400, CONTEXT),
        fake::json(400, CONTEXT),
        &["a", "b"],
    )
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    let err = &ans.json()["error"];
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("prompt is too long"),
        "{err}"
    );
}

/// An Anthropic error envelope sent with a 200 is an in-band error read as
/// the status Anthropic pairs with its type: `overloaded_error` is a 529
/// (retried, then failed over), `invalid_request_error` the caller's 400,
/// never a protocol failure of the upstream (issue 21 item 14).
#[tokio::test]
async fn an_anthropic_error_body_inside_a_200_is_its_in_band_status() {
    let (a, b, gw, _k) = setup(
        fake::json(200, OVERLOADED),
        fake::completion("model-b", "from b"),
        &["a"],
    )
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (2, 1), "a 529 is retried once");
    let page = metrics_page(&gw).await;
    let series = r#"switchyard_upstream_attempts_total{target="a",outcome="in_band_error"}"#;
    assert_eq!(series_value(&page, series), Some(2.0), "{page}");
    assert!(!page.contains(r#"target="a",outcome="protocol""#), "{page}");

    let invalid = r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Field required"}}"#;
    let (a, b, gw, _k) = setup(
        fake::json(200, invalid),
        fake::completion("model-b", "from b"),
        &["a"],
    )
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(
        ans.text().contains("max_tokens: Field required"),
        "{}",
        ans.text()
    );
    assert_eq!(
        (a.calls(), b.calls()),
        (1, 0),
        "the caller's error is not failed over"
    );
}
