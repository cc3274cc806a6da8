//! Streams at their edges: first-token and idle timeouts, cancellation before
//! the first token, and SSE framing quirks that must be relayed correctly
//! (split events, `\r\n`, comments, multi-line data, usage chunks, a missing
//! final blank line, malformed events before and after the commit point).

use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake, RawFake};
use crate::support::*;

const M: &str = "model-a";

/// A one-target gateway streaming `parts` (`delay` before each piece).
async fn one(parts: Vec<String>, delay: Duration) -> (Fake, Gw) {
    let a = Fake::always(pieces(parts, delay)).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    (a, gw)
}

/// A stream request to the chain [a (at `a_url`), b] is served by a healthy
/// `b`, in full.
async fn fails_over_to_b(a_url: &str) {
    let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
    let gw = gateway(&routes(&[hop("a", a_url), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert_eq!(sse_text(&ans.text()), "from b");
}

// ----- timeouts and cancellation -----

#[tokio::test]
async fn reasoning_under_either_name_is_a_first_token() {
    // a thinks aloud from 200ms (vLLM and OpenRouter name it `reasoning`,
    // DeepSeek `reasoning_content`); its answer comes after the 300ms
    // first_token_timeout. Thinking is a first token: a is not abandoned.
    for field in ["reasoning", "reasoning_content"] {
        let thought = |text: &str| {
            let chunk = serde_json::json!({"id": "c", "object": "chat.completion.chunk",
                "created": 1, "model": M, "choices": [{"index": 0,
                "delta": {field: text}, "finish_reason": null}]});
            event(&chunk.to_string(), "\n")
        };
        let a_parts = vec![
            role(M, "\n"),
            thought("Let me"),
            thought(" think."),
            content(M, "Answer", "\n"),
            finish(M, "\n"),
            done("\n"),
        ];
        let a = Fake::always(pieces(a_parts, Duration::from_millis(150))).await;
        let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
        let gw = gateway(&routes(
            &[hop("a", &a.url()), hop("b", &b.url())],
            "budget: { first_token_timeout: 400ms }",
            "",
        ))
        .await;
        let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
        assert_eq!(ans.header("x-switchyard-target"), "a", "{field}");
        let text = ans.text();
        assert!(
            text.contains(" think.") && text.contains("Answer"),
            "{field}: {text}"
        );
        assert_eq!(b.calls(), 0, "{field}");
    }
}

#[tokio::test]
async fn first_token_timeout_after_a_role_only_chunk_fails_over() {
    // a: headers at once, the role chunk at 200ms, content not before 400ms,
    // then keep-alives (so the fake notices the closed connection).
    let mut a_parts = vec![role(M, "\n"), content(M, "never", "\n")];
    a_parts.extend((0..8).map(|_| ": ping\n\n".to_owned()));
    let a = Fake::always(pieces(a_parts, Duration::from_millis(200))).await;
    let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "budget: { first_token_timeout: 300ms }",
        "",
    ))
    .await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.text(),
        fake::sse_events("model-b", &["from", " b"]).concat(),
        "only b's stream, nothing of a's role chunk"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(700),
        "{took:?}"
    );
    assert_eq!((a.calls(), b.calls()), (1, 1), "a timeout is not retried");
    assert!(
        wait_for(Duration::from_millis(1500), || a.cancelled() == 1).await,
        "a's abandoned stream is closed"
    );
}

#[tokio::test]
async fn idle_timeout_after_content_ends_with_error_event_and_done() {
    // Piece 1 (role + "one") at 500ms commits; piece 2 would come 500ms later,
    // past the 300ms idle timeout.
    let parts = vec![
        format!("{}{}", role(M, "\n"), content(M, "one", "\n")),
        content(M, " two", "\n"),
        finish(M, "\n"),
        done("\n"),
    ];
    let a = Fake::always(pieces(parts, Duration::from_millis(500))).await;
    let b = Fake::always(fake::stream("model-b", &["must not appear"])).await;
    let hops = [
        hop("a", &a.url()).provider("idle_timeout: 300ms"),
        hop("b", &b.url()),
    ];
    let gw = gateway(&routes(&hops, "", "")).await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 200);
    let text = ans.text();
    let expected_prefix = format!("{}{}", role(M, "\n"), content(M, "one", "\n"));
    assert!(text.starts_with(&expected_prefix), "{text}");
    let tail = &text[expected_prefix.len()..];
    let data = sse_data(tail);
    assert_eq!(data.len(), 2, "error event then [DONE]: {tail}");
    let err: serde_json::Value = serde_json::from_str(&data[0]).expect("error event is JSON");
    assert_eq!(err["error"]["code"], "stream_interrupted", "{tail}");
    assert_eq!(data[1], "[DONE]");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(sse_text(&text), "one");
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(1000),
        "{took:?}"
    );
    assert_eq!(
        b.calls(),
        0,
        "never replayed elsewhere after the commit point"
    );
}

#[tokio::test]
async fn a_stream_that_breaks_after_its_finish_is_complete_not_continued() {
    // Content and its finish, then the connection is aborted before `[DONE]`.
    let a = Fake::always(fake::Reply::Stream {
        pieces: vec![
            format!("{}{}", role(M, "\n"), content(M, "one", "\n")),
            finish(M, "\n"),
        ],
        delay: Duration::ZERO,
        cut: true,
    })
    .await;
    let b = Fake::always(fake::stream("model-b", &["must not appear"])).await;
    let hops = [hop("a", &a.url()), hop("b", &b.url())];
    let gw = gateway(&routes(&hops, "stream_recovery: { mode: continue }", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    let text = ans.text();
    assert!(!text.contains("stream_interrupted"), "{text}");
    assert_eq!(sse_text(&text), "one");
    assert_eq!(text.matches("finish_reason\":\"stop").count(), 1, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(b.calls(), 0, "a whole answer is not continued");
    let m = metrics_page(&gw).await;
    assert!(!m.contains("switchyard_stream_interrupts_total{"), "{m}");
    assert_eq!(admin_target(&gw, "a").await["state"], "healthy");
}

#[tokio::test]
async fn a_stream_that_stalls_after_its_finish_is_complete() {
    // The answer and its finish at 400 ms; `[DONE]` would come 400 ms later,
    // past the 300 ms idle timeout.
    let parts = vec![
        format!(
            "{}{}{}",
            role(M, "\n"),
            content(M, "one", "\n"),
            finish(M, "\n")
        ),
        done("\n"),
    ];
    let a = Fake::always(pieces(parts, Duration::from_millis(400))).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider("idle_timeout: 300ms")],
        "",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert!(!text.contains("stream_interrupted"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(sse_text(&text), "one");
}

#[tokio::test]
async fn client_cancel_while_waiting_for_the_first_token_closes_the_upstream() {
    // Headers, a role chunk, then only keep-alives: stalled before content.
    let mut parts = vec![role(M, "\n")];
    parts.extend((0..60).map(|_| ": ping\n\n".to_owned()));
    let a = Fake::always(pieces(parts, Duration::from_millis(50))).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let addr = gw.addr;
    let mut req = tokio::spawn(async move { chat(addr, hello_stream("gpt-4o")).await });
    assert!(
        wait_for(Duration::from_secs(1), || a.calls() == 1).await,
        "request reached a"
    );
    // The scenario: a stall of 150 ms (three keep-alives) with no content, over
    // which the client's answer must stay incomplete.
    assert!(
        tokio::time::timeout(Duration::from_millis(150), &mut req)
            .await
            .is_err(),
        "nothing is sent before the first token"
    );
    req.abort();
    let aborted = Instant::now();
    assert!(
        wait_for(Duration::from_secs(1), || a.cancelled() == 1).await,
        "upstream not cancelled within 1s"
    );
    assert!(aborted.elapsed() < Duration::from_secs(1));
    assert_eq!(a.calls(), 1);
    let view = admin_target(&gw, "a").await;
    assert_eq!(view["consecutive_failures"], 0, "no one's failure: {view}");
}

// ----- framing edge cases -----

#[tokio::test]
async fn events_split_mid_event_and_mid_crlf_are_relayed_byte_for_byte() {
    let whole = [
        role(M, "\r\n"),
        content(M, "Hel", "\r\n"),
        content(M, "lo", "\r\n"),
        finish(M, "\r\n"),
        done("\r\n"),
    ]
    .concat();
    // Cut between every `\r` and its `\n`, and inside every JSON object.
    let mut points: Vec<usize> = whole.match_indices('\r').map(|(i, _)| i + 1).collect();
    points.extend(whole.match_indices("choices").map(|(i, _)| i + 3));
    let parts = cut_at(&whole, &points);
    assert!(parts.len() >= 14, "{}", parts.len());
    assert!(parts.iter().any(|p| p.ends_with('\r')));
    let (_a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.text(), whole);
    assert_eq!(sse_text(&ans.text()), "Hello");
}

#[tokio::test]
async fn raw_tcp_writes_cut_anywhere_are_relayed_byte_for_byte() {
    // Close-delimited body: each write below is one TCP segment to the gateway.
    let whole = [
        ": hello\n\n".to_owned(),
        role(M, "\r\n"),
        content(M, "split", "\r\n"),
        content(M, " me", "\n"),
        finish(M, "\r\n"),
        done("\r\n"),
    ]
    .concat();
    let mut steps = vec![(Duration::ZERO, fake::sse_head(&[]).into_bytes())];
    let bytes = whole.as_bytes();
    // 7-byte writes hit every position class: mid-field, mid-JSON, mid-`\r\n`.
    for piece in bytes.chunks(7) {
        steps.push((Duration::from_millis(3), piece.to_vec()));
    }
    let a = RawFake::start(steps).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.text(), whole);
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn crlf_line_endings_are_relayed_byte_for_byte() {
    let parts = vec![
        role(M, "\r\n"),
        content(M, "one", "\r\n"),
        content(M, " two", "\r\n"),
        finish(M, "\r\n"),
        done("\r\n"),
    ];
    let (_a, gw) = one(parts.clone(), Duration::ZERO).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), parts.concat());
    assert_eq!(sse_text(&ans.text()), "one two");
    assert!(!ans.text().contains("stream_interrupted"));
}

#[tokio::test]
async fn comments_and_keep_alives_are_relayed_and_do_not_commit() {
    let b_words = ["from", " b"];
    // Before content: keep-alives only, then the stream breaks -> failover.
    let a = Fake::always(fake::Reply::Stream {
        pieces: vec![": ping\n\n".into(), role(M, "\n"), ": ping\n\n".into()],
        delay: Duration::ZERO,
        cut: true,
    })
    .await;
    let b = Fake::always(fake::stream("model-b", &b_words)).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), fake::sse_events("model-b", &b_words).concat());
    assert_eq!((a.calls(), b.calls()), (2, 1), "a reset: retried once");

    // Comments before, between and inside events are relayed as they are.
    let parts = vec![
        ": ping\n\n".to_owned(),
        role(M, "\n"),
        ":\n\n".to_owned(),
        format!(": note\n{}", content(M, "hi", "\n")),
        ": keep-alive\n\n".to_owned(),
        content(M, " there", "\n"),
        finish(M, "\n"),
        ": bye\n\n".to_owned(),
        done("\n"),
    ];
    let (_a, gw) = one(parts.clone(), Duration::ZERO).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), parts.concat());
    assert_eq!(sse_text(&ans.text()), "hi there");
}

#[tokio::test]
async fn multi_line_data_is_relayed_and_commits() {
    let first = "data: {\"choices\":[{\"index\":0,\ndata: \"delta\":{\"content\":\"multi\"}}]}\n\n";
    let second = "data: {\"choices\":[{\"index\":0,\r\ndata: \"delta\":{\"content\":\" line\"},\r\ndata: \"finish_reason\":\"stop\"}]}\r\n\r\n";
    let parts = vec![
        role(M, "\n"),
        first.to_owned(),
        second.to_owned(),
        done("\n"),
    ];
    let (_a, gw) = one(parts.clone(), Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), parts.concat());
    assert_eq!(sse_text(&ans.text()), "multi line");
}

#[tokio::test]
async fn usage_chunk_with_empty_choices_before_done_is_relayed() {
    let usage = event(
        r#"{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":1,"model":"model-a","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#,
        "\n",
    );
    let parts = vec![
        role(M, "\n"),
        content(M, "hi", "\n"),
        finish(M, "\n"),
        usage.clone(),
        done("\n"),
    ];
    let (_a, gw) = one(parts.clone(), Duration::ZERO).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), parts.concat());

    // The same without [DONE]: the usage chunk is kept and [DONE] is added.
    let parts = vec![
        role(M, "\n"),
        content(M, "hi", "\n"),
        finish(M, "\n"),
        usage,
    ];
    let (_a, gw) = one(parts.clone(), Duration::ZERO).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.text(), format!("{}data: [DONE]\n\n", parts.concat()));
}

#[tokio::test]
async fn last_event_without_blank_line_after_finish_gets_closed_and_done() {
    let finish_json = fake::chunk_json(M, serde_json::json!({}), Some("stop"));
    let head = vec![role(M, "\n"), content(M, "hi", "\n")];
    let mut parts = head.clone();
    parts.push(format!("data: {finish_json}"));
    let (_a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        ans.text(),
        format!("{}data: {finish_json}\n\ndata: [DONE]\n\n", head.concat())
    );
    assert!(!ans.text().contains("stream_interrupted"));
}

#[tokio::test]
async fn last_event_with_one_line_end_after_finish_gets_exactly_one_blank_line() {
    let finish_json = fake::chunk_json(M, serde_json::json!({}), Some("stop"));
    let head = vec![role(M, "\n"), content(M, "hi", "\n")];
    let mut parts = head.clone();
    parts.push(format!("data: {finish_json}\n"));
    let (_a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        ans.text(),
        format!("{}data: {finish_json}\n\ndata: [DONE]\n\n", head.concat())
    );
}

#[tokio::test]
async fn unterminated_last_event_that_is_also_the_commit_point_is_closed() {
    // Content and finish in one last event with no line end: it is read only
    // at EOF, before the commit point, so it is held rather than relayed.
    let last = fake::chunk_json(M, serde_json::json!({"content": "hi"}), Some("stop"));
    let parts = vec![role(M, "\n"), format!("data: {last}")];
    let (_a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(
        ans.text(),
        format!("{}data: {last}\n\ndata: [DONE]\n\n", role(M, "\n"))
    );
    assert_eq!(
        sse_data(&ans.text()).last().map(String::as_str),
        Some("[DONE]")
    );
}

#[tokio::test]
async fn unterminated_content_at_eof_before_commit_still_gets_a_readable_interrupt() {
    // No finish_reason: the stream is truncated, and the client must see the
    // content, then the stream_interrupted event, then [DONE], as three events.
    let last = fake::chunk_json(M, serde_json::json!({"content": "hi"}), None);
    let parts = vec![role(M, "\n"), format!("data: {last}")];
    let (_a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    let data = sse_data(&text);
    assert_eq!(data.len(), 4, "{text}");
    assert_eq!(data[1], last, "{text}");
    let err: serde_json::Value = serde_json::from_str(&data[2]).expect("error event");
    assert_eq!(err["error"]["code"], "stream_interrupted");
    assert_eq!(data[3], "[DONE]");
}

#[tokio::test]
async fn unterminated_trailing_comment_after_finish_does_not_swallow_done() {
    let parts = vec![
        role(M, "\n"),
        content(M, "hi", "\n"),
        finish(M, "\n"),
        ": bye".to_owned(),
    ];
    let (_a, gw) = one(parts.clone(), Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert!(text.starts_with(&parts[..3].concat()), "{text}");
    assert_eq!(
        sse_data(&text).last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

#[tokio::test]
async fn malformed_event_after_content_is_dropped_and_the_stream_goes_on() {
    let good = [role(M, "\n"), content(M, "before", "\n")];
    let rest = [content(M, " after", "\n"), finish(M, "\n"), done("\n")];
    let mut parts: Vec<String> = good.to_vec();
    parts.push("data: {\"choices\":[{\"delta\":{\"content\":\"trunc\n\n".to_owned());
    parts.extend(rest.iter().cloned());
    let (a, gw) = one(parts, Duration::from_millis(2)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.text(), format!("{}{}", good.concat(), rest.concat()));
    assert_eq!(sse_text(&ans.text()), "before after");
    assert!(!ans.text().contains("stream_interrupted"));
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn malformed_event_before_content_fails_over() {
    let a = Fake::always(pieces(
        vec![
            role(M, "\n"),
            "data: {not json at all\n\n".to_owned(),
            content(M, "never", "\n"),
            finish(M, "\n"),
            done("\n"),
        ],
        Duration::ZERO,
    ))
    .await;
    let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.text(),
        fake::sse_events("model-b", &["from", " b"]).concat()
    );
    // A protocol error is a network-class failure: retried once, then failover.
    assert_eq!((a.calls(), b.calls()), (2, 1));
    assert_eq!(admin_target(&gw, "a").await["consecutive_failures"], 2);
}

/// An SSE answer of `events` (some not UTF-8), then a close.
async fn raw_stream(events: &[&[u8]]) -> RawFake {
    let mut bytes = fake::sse_head(&[]).into_bytes();
    for e in events {
        bytes.extend_from_slice(e);
    }
    RawFake::start(vec![(Duration::ZERO, bytes)]).await
}

#[tokio::test]
async fn a_chunk_that_is_not_utf8_before_content_fails_over() {
    let role = role(M, "\n");
    let a = raw_stream(&[
        role.as_bytes(),
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\xff\xfe\"}}]}\n\n",
        b"data: [DONE]\n\n",
    ])
    .await;
    fails_over_to_b(&a.url()).await;
}

#[tokio::test]
async fn a_chunk_that_is_not_utf8_after_content_is_dropped_never_relayed() {
    let good = [role(M, "\n"), content(M, "before", "\n")];
    let rest = [content(M, " after", "\n"), finish(M, "\n"), done("\n")];
    let mut events: Vec<&[u8]> = good.iter().map(|e| e.as_bytes()).collect();
    events.push(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\xff\"}}]}\n\n");
    events.extend(rest.iter().map(|e| e.as_bytes()));
    let a = raw_stream(&events).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert!(
        std::str::from_utf8(&ans.body).is_ok(),
        "the client gets UTF-8 only"
    );
    assert_eq!(ans.text(), format!("{}{}", good.concat(), rest.concat()));
}

#[tokio::test]
async fn a_stream_of_nothing_but_done_fails_over() {
    for events in [vec![done("\n")], vec![role(M, "\n"), done("\n")]] {
        let a = Fake::always(pieces(events.clone(), Duration::ZERO)).await;
        fails_over_to_b(&a.url()).await;
    }
    // An empty answer that says it finished is an answer.
    let a = Fake::always(pieces(
        vec![role(M, "\n"), finish(M, "\n"), done("\n")],
        Duration::ZERO,
    ))
    .await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "a", "{}", ans.text());
}

#[tokio::test]
async fn a_whole_completion_where_a_stream_was_asked_for_fails_over() {
    let a = Fake::always(fake::completion("model-a", "not a stream")).await;
    fails_over_to_b(&a.url()).await;
    // Alone, it is a 502 the client can read, never JSON on a stream.
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
}

/// A Gemini stream whose counts come in an event of their own after the
/// finish (as Gemini 3 sends them): the client's usage chunk has them, and
/// the stream still ends with `[DONE]` when the body ends.
#[tokio::test]
async fn a_gemini_streams_usage_after_its_finish_reaches_the_client() {
    let events = [
        r#"{"candidates":[{"content":{"parts":[{"text":"Hi there"}],"role":"model"}}]}"#,
        r#"{"candidates":[{"content":{"parts":[],"role":"model"},"finishReason":"STOP"}]}"#,
        r#"{"usageMetadata":{"promptTokenCount":11,"candidatesTokenCount":2,"totalTokenCount":13}}"#,
    ];
    let g = Fake::always(fake::Reply::Stream {
        pieces: events.iter().map(|e| format!("data: {e}\n\n")).collect(),
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("gemini.key");
    std::fs::write(&key, "gemini-test-key-0123456789").unwrap();
    let provider = format!("protocol: gemini\napi_key_file: {}\n", key.display());
    let gw = gateway(&routes(&[hop("g", &g.url()).provider(&provider)], "", "")).await;
    let body = serde_json::json!({"model": "gpt-4o", "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}]});
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let text = ans.text();
    assert_eq!(stream_text(&text), "Hi there", "{text}");
    assert!(text.contains(r#""prompt_tokens":11"#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

/// A stream without usage is booked by its content chunks, the first ones
/// (held at the commit point) included.
#[tokio::test]
async fn a_stream_without_usage_books_every_content_chunk() {
    let a = Fake::always(fake::stream("model-a", &["one", " two", " three"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(stream_text(&ans.text()), "one two three");
    let booked = eventually(Duration::from_secs(3), || async {
        metric(
            &gw,
            r#"switchyard_tokens_total{target="a",kind="completion"}"#,
        )
        .await
            == 3.0
    })
    .await;
    assert!(booked, "{}", metrics_page(&gw).await);
}
