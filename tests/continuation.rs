//! Finishing the answer: a stream broken after its commit point continues on
//! the next target (`stream_recovery: { mode: continue }`), by prefill or by
//! restart-and-verify, as one seamless stream, and never with text that
//! contradicts what the client already has.

use std::time::Duration;

use serde_json::Value;

use crate::support::fake::{self, Fake, Reply, Seen};
use crate::support::*;

const WORDS: [&str; 4] = ["The", " quick", " brown", " fox"];

/// A stream of `words` from a fake whose chunks carry the id `id`.
fn stream_with_id(id: &str, words: &[&str]) -> Reply {
    Reply::Stream {
        pieces: fake::sse_events("model-b", words)
            .into_iter()
            .map(|p| p.replace("chatcmpl-fake", id))
            .collect(),
        delay: Duration::ZERO,
        cut: false,
    }
}

/// `a` sends the role chunk and the first two words, then breaks.
async fn breaking_primary() -> Fake {
    Fake::always(fake::stream_cut_after("model-a", &WORDS, 2)).await
}

fn recovering(a: &Fake, b: &Fake, b_fields: &str, task: &str) -> String {
    let task = format!("stream_recovery: {{ mode: continue }}\n{task}");
    routes(
        &[hop("a", &a.url()), hop("b", &b.url()).target(b_fields)],
        &task,
        "",
    )
}

/// The `data:` payloads of a stream, parsed (`[DONE]` as a string).
fn events(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::from(d.as_str())))
        .collect()
}

/// The envelope promises: one id and created, one role chunk, one finish, one [DONE].
fn assert_one_stream(body: &str) {
    let evs = events(body);
    let chunks: Vec<&Value> = evs.iter().filter(|e| e.is_object()).collect();
    let ids: std::collections::BTreeSet<String> =
        chunks.iter().map(|c| c["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one id: {ids:?}\n{body}");
    let created: std::collections::BTreeSet<String> =
        chunks.iter().map(|c| c["created"].to_string()).collect();
    assert_eq!(created.len(), 1, "{body}");
    let roles = chunks
        .iter()
        .filter(|c| !c["choices"][0]["delta"]["role"].is_null())
        .count();
    assert_eq!(roles, 1, "one role chunk:\n{body}");
    let finishes = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "one finish chunk:\n{body}");
    assert_eq!(body.matches("data: [DONE]").count(), 1, "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(!body.contains("stream_interrupted"), "{body}");
}

#[tokio::test]
async fn a_prefill_target_continues_exactly_the_delivered_text() {
    let a = breaking_primary().await;
    let b = Fake::start(|_, seen: &Seen| {
        let last = seen.body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .cloned();
        match last {
            Some(m) if m["role"] == "assistant" => {
                stream_with_id("chatcmpl-b", &[" brown", " fox"])
            }
            _ => fake::error(500, "expected a prefill"),
        }
    })
    .await;
    let cfg = recovering(&a, &b, "capabilities: [prefill]", "").replace(
        "  p-b:\n",
        "  p-b:\n    prefill: { message_fields: { prefix: true } }\n",
    );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    // The fallback got the original messages plus exactly the delivered text.
    let sent = &b.seen()[0].body;
    let messages = sent["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{sent}");
    assert_eq!(
        messages[0],
        serde_json::json!({"role": "user", "content": "hello"})
    );
    assert_eq!(
        messages[1],
        serde_json::json!({"role": "assistant", "content": "The quick", "prefix": true})
    );
    assert_eq!(sent["model"], "upstream-b");
    // The chunks after the seam say which model finished the answer.
    assert!(events(&ans.text()).iter().any(|e| e["model"] == "model-b"));
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_stream_continuations_total{task="chat",from="a",to="b",mode="prefill",result="completed"}"#
        ),
        Some(1.0),
        "{m}"
    );
    // The broken target's failure is recorded as always.
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_stream_interrupts_total{target="a",reason="reset"}"#
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_restart_that_begins_with_the_delivered_text_hides_it() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(&a, &b, "max_context: 1000", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    let sent = &b.seen()[0].body;
    assert_eq!(
        sent["messages"].as_array().unwrap().len(),
        1,
        "the original request"
    );
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_stream_continuations_total{task="chat",from="a",to="b",mode="restart",result="completed"}"#
        ),
        Some(1.0),
        "{m}"
    );
    // The client's first token came from a: b's commit is no time to first token.
    let ttft_count = |target: &str| {
        series_value(
            &m,
            &format!(
                r#"switchyard_time_to_first_token_seconds_count{{task="chat",target="{target}"}}"#
            ),
        )
    };
    assert_eq!(ttft_count("a"), Some(1.0), "{m}");
    assert_eq!(ttft_count("b").unwrap_or(0.0), 0.0, "{m}");
}

#[tokio::test]
async fn a_restart_that_diverges_ends_with_the_error_event_and_no_contradiction() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &["A", " slow", " dog"])).await;
    let gw = gateway(&recovering(&a, &b, "max_context: 1000", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert_eq!(stream_text(&text), "The quick", "{text}");
    assert!(!text.contains("slow") && !text.contains("dog"), "{text}");
    assert!(text.contains("stream_interrupted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let m = metrics_page(&gw).await;
    assert!(m.contains(r#"mode="restart",result="diverged"} 1"#), "{m}");
}

#[tokio::test]
async fn a_prefill_target_writes_only_what_is_left_of_the_clients_output_limit() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &[" brown", " fox"])).await;
    let cfg = recovering(&a, &b, "capabilities: [prefill]", "");
    let gw = gateway(&cfg).await;
    for limit in ["max_tokens", "max_completion_tokens"] {
        let mut ask = hello_stream("gpt-4o");
        ask[limit] = serde_json::json!(40);
        let ans = chat(gw.addr, ask).await;
        assert_eq!(
            stream_text(&ans.text()),
            "The quick brown fox",
            "{}",
            ans.text()
        );
    }
    for (seen, limit) in b.seen().iter().zip(["max_tokens", "max_completion_tokens"]) {
        let left = seen.body[limit].as_u64().unwrap();
        // "The quick" is 2 tokens or a few more by the estimate.
        assert!((30..40).contains(&left), "{limit}: {left}");
    }
}

#[tokio::test]
async fn a_target_that_rejects_the_prefill_is_restarted_and_the_rejection_never_shows() {
    let a = breaking_primary().await;
    let b = Fake::start(|_, seen: &Seen| {
        let prefixed = seen.body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .is_some_and(|m| m["role"] == "assistant");
        if prefixed {
            fake::error(400, "assistant prefill is not supported for this model")
        } else {
            stream_with_id("chatcmpl-b", &WORDS)
        }
    })
    .await;
    let gw = gateway(&recovering(&a, &b, "capabilities: [prefill]", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    assert!(!ans.text().contains("prefill"), "{}", ans.text());
    assert_eq!(b.calls(), 2, "the prefill, then the restart");
}

#[tokio::test]
async fn a_stall_after_the_commit_point_is_continued() {
    // The role chunk and two words, then 600 ms of silence (idle_timeout is 300 ms).
    let hang = Fake::start(|_, _| {
        let head = fake::sse_events("model-a", &WORDS)[..3].concat();
        Reply::Stream {
            pieces: vec![head, String::new()],
            delay: Duration::from_millis(600),
            cut: false,
        }
    })
    .await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let cfg = recovering(&hang, &b, "", "").replacen(
        "    timeout: 2s\n",
        "    timeout: 2s\n    idle_timeout: 300ms\n",
        1,
    );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_stream_interrupts_total{target="a",reason="idle_timeout"}"#
        ),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn no_continuation_once_a_tool_call_delta_went_out() {
    let call = serde_json::json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"ci"}}]});
    let a = Fake::always(Reply::Stream {
        pieces: vec![
            fake::chunk_event(
                "model-a",
                serde_json::json!({"role": "assistant", "content": ""}),
                None,
            ),
            fake::chunk_event(
                "model-a",
                serde_json::json!({"content": "Let me check."}),
                None,
            ),
            fake::chunk_event("model-a", call, None),
        ],
        delay: Duration::ZERO,
        cut: true,
    })
    .await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(
        &recovering(
            &a,
            &b,
            "capabilities: [tools]",
            "validate_tool_calls: never",
        )
        .replace(
            "  a: { provider: p-a, model: upstream-a",
            "  a: { provider: p-a, model: upstream-a, capabilities: [tools]",
        ),
    )
    .await;
    let body = serde_json::json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]});
    let ans = chat(gw.addr, body).await;
    assert!(ans.text().contains("stream_interrupted"), "{}", ans.text());
    assert_eq!(b.calls(), 0, "a tool call in flight is never continued");
}

#[tokio::test]
async fn the_budget_bounds_continuations_and_a_second_break_ends_the_stream() {
    let a = breaking_primary().await;
    // b restarts, matches, then breaks too after one more word.
    let b = Fake::always(Reply::Stream {
        pieces: fake::sse_events("model-b", &WORDS)[..4].to_vec(),
        delay: Duration::ZERO,
        cut: true,
    })
    .await;
    let c = Fake::always(stream_with_id("chatcmpl-c", &WORDS)).await;
    let hops = [hop("a", &a.url()), hop("b", &b.url()), hop("c", &c.url())];
    let gw = gateway(&routes(
        &hops,
        "stream_recovery: { mode: continue, max_continuations: 1 }",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert_eq!(stream_text(&text), "The quick brown", "{text}");
    assert!(text.contains("stream_interrupted"), "{text}");
    assert_eq!(c.calls(), 0, "max_continuations: 1");
    let m = metrics_page(&gw).await;
    assert!(
        m.contains(r#"to="b",mode="restart",result="interrupted"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn usage_comes_once_and_the_seam_comment_is_opt_in() {
    let a = breaking_primary().await;
    let mut pieces: Vec<String> = fake::sse_events("model-b", &WORDS)
        .into_iter()
        .map(|p| p.replace("chatcmpl-fake", "chatcmpl-b"))
        .collect();
    let usage = r#"data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":7,"model":"model-b","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}"#;
    pieces.insert(pieces.len() - 1, format!("{usage}\n\n"));
    let b = Fake::always(Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    })
    .await;
    let gw = gateway(&recovering(&a, &b, "", "").replace(
        "stream_recovery: { mode: continue }",
        "stream_recovery: { mode: continue, seam_comment: true }",
    ))
    .await;
    let mut body = hello_stream("gpt-4o");
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert_one_stream(&text);
    let usages: Vec<Value> = events(&text)
        .into_iter()
        .filter(|e| e.get("usage").is_some_and(|u| !u.is_null()))
        .collect();
    assert_eq!(usages.len(), 1, "{text}");
    assert_eq!(usages[0]["usage"]["completion_tokens"], 4);
    assert!(
        text.contains(": switchyard continued this answer from a on b (restart)"),
        "{text}"
    );
}

#[tokio::test]
async fn off_by_default_a_break_ends_the_stream_as_before() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(stream_text(&ans.text()), "The quick");
    assert!(ans.text().contains("stream_interrupted"));
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn explain_shows_whether_a_task_continues() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(&a, &b, "", "")).await;
    let ans = post_raw(gw.addr, "/admin/explain", hello("gpt-4o").to_string(), &[]).await;
    assert_eq!(
        ans.json()["stream_recovery"]["mode"],
        "continue",
        "{}",
        ans.text()
    );
    assert_eq!(ans.json()["stream_recovery"]["max_continuations"], 1);
}

/// A real provider's answer to a model it does not serve.
fn model_not_found(model: &Value) -> Reply {
    fake::json(
        404,
        &serde_json::json!({"error": {"message": format!("The model `{model}` does not exist"),
            "type": "invalid_request_error", "code": "model_not_found"}})
        .to_string(),
    )
}

/// A fake that serves only `model`, answering `reply` to what it accepts
/// and 404 `model_not_found` to any other model.
async fn serving_only(model: &'static str, reply: fn(&Seen) -> Reply) -> Fake {
    Fake::start(move |_, seen: &Seen| {
        if seen.body["model"] == model {
            reply(seen)
        } else {
            model_not_found(&seen.body["model"])
        }
    })
    .await
}

/// No attempt at `target` was booked as anything but a success.
fn assert_never_failed(m: &str, target: &str) {
    let prefix = format!(r#"switchyard_upstream_attempts_total{{target="{target}","#);
    let failed: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with(&prefix) && !l.contains(r#"outcome="success""#))
        .collect();
    assert!(failed.is_empty(), "{target} counted failed: {failed:?}");
}

#[tokio::test]
async fn a_restart_goes_with_the_continuing_targets_model() {
    let a = breaking_primary().await;
    let b = serving_only("upstream-b", |_| stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(&a, &b, "max_context: 1000", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    assert_eq!(b.seen()[0].body["model"], "upstream-b", "not the alias");
    let m = metrics_page(&gw).await;
    assert_never_failed(&m, "b");
    assert!(m.contains(r#"mode="restart",result="completed"} 1"#), "{m}");
}

#[tokio::test]
async fn a_rejected_prefill_restarts_with_the_continuing_targets_model() {
    // The public failover suite's "fallback rejects prefill": b serves only
    // its own model and refuses an assistant prefix.
    let a = breaking_primary().await;
    let b = serving_only("upstream-b", |seen| {
        let prefixed = seen.body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .is_some_and(|m| m["role"] == "assistant");
        if prefixed {
            fake::error(400, "assistant prefill is not supported for this model")
        } else {
            stream_with_id("chatcmpl-b", &WORDS)
        }
    })
    .await;
    let gw = gateway(&recovering(&a, &b, "capabilities: [prefill]", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    let seen = b.seen();
    assert_eq!(seen.len(), 2, "the prefill, then the restart");
    assert!(
        seen.iter().all(|s| s.body["model"] == "upstream-b"),
        "{:?}",
        seen.iter().map(|s| &s.body).collect::<Vec<_>>()
    );
}

/// An Anthropic Messages stream of `words`.
fn messages_stream(words: &[&str]) -> Reply {
    let event = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let mut pieces = vec![
        event(
            "message_start",
            serde_json::json!({"type": "message_start", "message": {"id": "msg_b", "type": "message",
                "role": "assistant", "content": [], "model": "upstream-b", "stop_reason": null,
                "usage": {"input_tokens": 5, "output_tokens": 1}}}),
        ),
        event(
            "content_block_start",
            serde_json::json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
        ),
    ];
    for w in words {
        pieces.push(event(
            "content_block_delta",
            serde_json::json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": w}}),
        ));
    }
    pieces.push(event(
        "content_block_stop",
        serde_json::json!({"type": "content_block_stop", "index": 0}),
    ));
    pieces.push(event(
        "message_delta",
        serde_json::json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 4}}),
    ));
    pieces.push(event(
        "message_stop",
        serde_json::json!({"type": "message_stop"}),
    ));
    Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    }
}

#[tokio::test]
async fn a_restart_on_an_anthropic_target_is_a_messages_request() {
    let a = breaking_primary().await;
    let b = Fake::start(|_, seen: &Seen| {
        let messages = seen.uri.ends_with("/messages")
            && seen.body["model"] == "upstream-b"
            && seen.body["max_tokens"].is_u64();
        if messages {
            messages_stream(&WORDS)
        } else {
            model_not_found(&seen.body["model"])
        }
    })
    .await;
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("key");
    std::fs::write(&key, "sk-ant-test-0123456789").unwrap();
    let cfg = recovering(&a, &b, "max_context: 1000", "").replace(
        "  p-b:\n",
        &format!(
            "  p-b:\n    protocol: anthropic\n    api_key_file: {}\n",
            key.display()
        ),
    );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    let seen = &b.seen()[0];
    assert_eq!(seen.headers["x-api-key"], "sk-ant-test-0123456789");
    assert!(seen.body.get("stream_options").is_none(), "{}", seen.body);
    assert_never_failed(&metrics_page(&gw).await, "b");
}

/// `a` delivers `delivered` (one chunk per piece), then breaks; `b`
/// restarts with `restart`. The client's stream.
async fn restarted(delivered: &[&str], restart: &'static [&'static str]) -> (String, String) {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        delivered,
        delivered.len(),
    ))
    .await;
    let b = Fake::always(stream_with_id("chatcmpl-b", restart)).await;
    let gw = gateway(&recovering(&a, &b, "max_context: 1000", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(b.calls(), 1, "{}", ans.text());
    (ans.text(), metrics_page(&gw).await)
}

fn assert_diverged(text: &str, m: &str, delivered: &str) {
    assert_eq!(stream_text(text), delivered, "{text}");
    assert!(text.contains("stream_interrupted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(m.contains(r#"mode="restart",result="diverged"} 1"#), "{m}");
}

#[tokio::test]
async fn a_restart_that_indents_differently_diverges() {
    let (text, m) = restarted(
        &["if x:\n", "        return"],
        &["if x:\n", "  return", " None"],
    )
    .await;
    assert!(!text.contains("None"), "{text}");
    assert_diverged(&text, &m, "if x:\n        return");
}

#[tokio::test]
async fn a_restart_that_joins_delivered_words_diverges() {
    let (text, m) = restarted(
        &["I have", " 1", " 0"],
        &["I have", " 10", " apples", " today"],
    )
    .await;
    assert!(!text.contains("apples"), "{text}");
    assert_diverged(&text, &m, "I have 1 0");
}

#[tokio::test]
async fn a_restart_that_differs_only_in_whitespace_at_the_seam_continues() {
    // The client has "The quick " (its space at the seam); the restart puts
    // two spaces after "quick": neither is sent twice.
    let (text, m) = restarted(&["The", " quick "], &["The", " quick", "  brown", " fox"]).await;
    assert_eq!(stream_text(&text), "The quick brown fox", "{text}");
    assert_one_stream(&text);
    assert!(m.contains(r#"mode="restart",result="completed"} 1"#), "{m}");
    // And a seam where the restart moved the space to the other side.
    let (text, _) = restarted(&["The", " quick"], &["The", " quick ", "brown", " fox"]).await;
    assert_eq!(stream_text(&text), "The quick brown fox", "{text}");
    assert_one_stream(&text);
}

/// A chunk of choice `index`.
fn choice_event(index: u64, delta: Value) -> String {
    let chunk = serde_json::json!({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1,
        "model": "model-a", "choices": [{"index": index, "delta": delta, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

/// `a` streams two choices, interleaved, then breaks; `b` could take over.
/// The client's stream and how often `b` was called.
async fn two_choices_break(n: Option<u64>) -> (String, usize) {
    let role = serde_json::json!({"role": "assistant", "content": ""});
    let a = Fake::always(Reply::Stream {
        pieces: vec![
            choice_event(0, role.clone()),
            choice_event(1, role),
            choice_event(0, serde_json::json!({"content": "The"})),
            choice_event(1, serde_json::json!({"content": "A"})),
            choice_event(0, serde_json::json!({"content": " quick"})),
        ],
        delay: Duration::ZERO,
        cut: true,
    })
    .await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(&a, &b, "capabilities: [prefill]", "")).await;
    let mut body = hello_stream("gpt-4o");
    if let Some(n) = n {
        body["n"] = Value::from(n);
    }
    let ans = chat(gw.addr, body).await;
    (ans.text(), b.calls())
}

#[tokio::test]
async fn a_stream_of_several_choices_is_not_continued() {
    let (text, b_calls) = two_choices_break(Some(2)).await;
    assert!(text.contains("stream_interrupted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(b_calls, 0, "n > 1 ends as a broken stream:\n{text}");
    // Also when the request did not ask for them but the upstream sent them.
    let (text, b_calls) = two_choices_break(None).await;
    assert!(text.contains("stream_interrupted"), "{text}");
    assert_eq!(
        b_calls, 0,
        "a second choice ends as a broken stream:\n{text}"
    );
}

/// A chunk finishing choice `index`.
fn choice_finish(index: u64) -> String {
    let chunk = serde_json::json!({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1,
        "model": "model-a", "choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]});
    format!("data: {chunk}\n\n")
}

/// `n: 2`, one choice finished, the other cut: (the client's stream,
/// whether the last piece is a cut or `[DONE]`).
async fn one_of_two_finished(last: &str, cut: bool) -> String {
    let mut pieces = vec![
        choice_event(
            0,
            serde_json::json!({"role": "assistant", "content": "Zero"}),
        ),
        choice_event(
            1,
            serde_json::json!({"role": "assistant", "content": "One"}),
        ),
        choice_finish(0),
        choice_event(1, serde_json::json!({"content": " and half of"})),
    ];
    if !last.is_empty() {
        pieces.push(last.to_owned());
    }
    let a = Fake::always(Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut,
    })
    .await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(&a, &b, "", "")).await;
    let mut body = hello_stream("gpt-4o");
    body["n"] = Value::from(2);
    chat(gw.addr, body).await.text()
}

#[tokio::test]
async fn a_stream_of_two_choices_is_whole_only_when_both_finish() {
    // Cut, or ended without `[DONE]`, after only choice 0 finished: broken.
    for cut in [true, false] {
        let text = one_of_two_finished("", cut).await;
        assert!(text.contains("stream_interrupted"), "cut {cut}: {text}");
    }
    // Both finished, then the body ends without `[DONE]`: whole.
    let text = one_of_two_finished(&choice_finish(1), false).await;
    assert!(!text.contains("stream_interrupted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

/// `b`'s restart: the delivered words, then a call of `name` with `arguments`.
fn restart_then_call(name: &str, arguments: &str) -> Reply {
    let mut pieces = fake::sse_events("model-b", &WORDS);
    // Drop b's own finish and [DONE]: the call comes before them.
    pieces.truncate(pieces.len() - 2);
    let call = serde_json::json!({"tool_calls": [{"index": 0, "id": "call_b", "type": "function",
        "function": {"name": name, "arguments": arguments}}]});
    pieces.push(fake::chunk_event("model-b", call, None));
    pieces.push(fake::chunk_event(
        "model-b",
        serde_json::json!({}),
        Some("tool_calls"),
    ));
    pieces.push(fake::SSE_DONE.to_owned());
    Reply::Stream {
        pieces: pieces
            .into_iter()
            .map(|p| p.replace("chatcmpl-fake", "chatcmpl-b"))
            .collect(),
        delay: Duration::ZERO,
        cut: false,
    }
}

async fn continued_with_tools(b_reply: Reply) -> (String, Fake, Gw) {
    let a = breaking_primary().await;
    let b = Fake::always(b_reply).await;
    let gw = gateway(&recovering(&a, &b, "capabilities: [tools]", "").replace(
        "  a: { provider: p-a, model: upstream-a",
        "  a: { provider: p-a, model: upstream-a, capabilities: [tools]",
    ))
    .await;
    let body = serde_json::json!({"model": "gpt-4o", "stream": true,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]});
    let ans = chat(gw.addr, body).await;
    (ans.text(), b, gw)
}

/// A continuing target is a degraded one: its tool calls are held and held
/// to the request's contract like any fallback's (found by an adversarial
/// run: a broken call from the continuing target reached the client as a
/// clean 200 stream).
#[tokio::test]
async fn a_continuing_targets_tool_call_is_held_to_the_contract() {
    let (text, b, gw) = continued_with_tools(restart_then_call("rm_rf", "{not json")).await;
    assert_eq!(b.calls(), 1, "{text}");
    assert!(
        !text.contains("rm_rf"),
        "the broken call never reaches the client: {text}"
    );
    assert!(
        text.contains("stream_interrupted") && text.contains("contract_violation"),
        "{text}"
    );
    let m = metrics_page(&gw).await;
    let violations = r#"switchyard_contract_violations_total{task="chat",target="b"}"#;
    assert_eq!(series_value(&m, violations), Some(1.0), "{m}");

    let (text, _b, _gw) =
        continued_with_tools(restart_then_call("get_weather", r#"{"city":"Oslo"}"#)).await;
    assert_eq!(stream_text(&text), "The quick brown fox", "{text}");
    assert!(
        text.contains(r#"{\"city\":\"Oslo\"}"#),
        "the valid call is released: {text}"
    );
    assert_one_stream(&text);
}

/// A restart that says something else ends the stream, but the restarting
/// target answered: it is not counted against its health, so continuing
/// streams do not push a healthy fallback DOWN (found by an adversarial run).
#[tokio::test]
async fn a_diverging_restart_does_not_count_against_the_restarting_target() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &["A", " slow", " dog"])).await;
    // One counted failure would make a target DEGRADED.
    let health = "health: { degraded_after: 1, down_after: 3 }\n";
    let gw = gateway(&(recovering(&a, &b, "max_context: 1000", "") + health)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert!(ans.text().contains("stream_interrupted"), "{}", ans.text());
    assert_eq!(b.calls(), 1);
    let b_state = admin_target(&gw, "b").await;
    assert_eq!(b_state["state"], "healthy", "{b_state}");
    assert_eq!(b_state["consecutive_failures"], 0, "{b_state}");
    let a_state = admin_target(&gw, "a").await;
    assert_eq!(
        a_state["state"], "degraded",
        "the broken stream is a's: {a_state}"
    );
}

/// A restart whose whole answer is exactly the delivered text completes
/// the stream (its finish goes out), not a divergence.
#[tokio::test]
async fn a_restart_that_ends_exactly_at_the_delivered_text_completes_the_stream() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS[..2])).await;
    let gw = gateway(&recovering(&a, &b, "max_context: 1000", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert_eq!(stream_text(&text), "The quick", "{text}");
    assert_one_stream(&text);
}

/// A continuation is a switch to another target: `max_failovers` bounds it
/// like any failover (found by an adversarial run: it was ignored).
#[tokio::test]
async fn max_failovers_bounds_continuations_too() {
    let a = breaking_primary().await;
    let b = Fake::always(stream_with_id("chatcmpl-b", &WORDS)).await;
    let gw = gateway(&recovering(
        &a,
        &b,
        "max_context: 1000",
        "budget: { max_failovers: 0 }",
    ))
    .await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert!(ans.text().contains("stream_interrupted"), "{}", ans.text());
    assert_eq!(b.calls(), 0);
}

/// A prefill goes without the delivered text's trailing whitespace (which
/// Anthropic refuses in a final assistant message), and the whitespace the
/// target then begins with is not sent twice (found by an adversarial run).
#[tokio::test]
async fn a_prefill_leaves_out_trailing_whitespace_and_the_seam_keeps_one_space() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["The ", "quick ", "brown"],
        2,
    ))
    .await;
    let b = Fake::start(|_, seen: &Seen| {
        let last = seen.body["messages"]
            .as_array()
            .and_then(|m| m.last())
            .cloned();
        match last {
            Some(m) if m["role"] == "assistant" => {
                stream_with_id("chatcmpl-b", &[" brown", " fox"])
            }
            _ => fake::error(500, "expected a prefill"),
        }
    })
    .await;
    let cfg = recovering(&a, &b, "capabilities: [prefill]", "");
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    assert_one_stream(&ans.text());
    let sent = &b.seen()[0].body;
    let last = sent["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["content"], "The quick", "{sent}");
}
