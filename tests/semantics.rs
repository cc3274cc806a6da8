//! Failure semantics to the letter: rate limits and unavailability reach the
//! caller as what they are, a 200 is an answer only if it is one, context
//! windows in all their shapes, health that never gets stuck, and pooled
//! connections that fail for the pool's reasons count nowhere.

use std::io::Write as _;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::support::fake::{self, Fake, RawFake, Reply};
use crate::support::*;

fn reply(status: u16, body: &str, headers: &[(&str, &str)]) -> Reply {
    Reply::Json {
        status,
        body: body.to_owned(),
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

const SLOW_DOWN: &str = r#"{"error":{"message":"slow down","type":"rate_limit_error"}}"#;

async fn ok_fake(name: &str) -> Fake {
    Fake::always(fake::completion(
        &format!("model-{name}"),
        &format!("from {name}"),
    ))
    .await
}

fn retry_after(ans: &Answer) -> u64 {
    ans.header("retry-after")
        .parse()
        .unwrap_or_else(|_| panic!("no Retry-After: {:?}", ans.headers))
}

// ----- 1, 2, 5: rate limits and unavailability reach the caller -----

#[tokio::test]
async fn a_rate_limited_target_answers_429_with_its_wait_not_502() {
    let a = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "7")])).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(retry_after(&ans), 7);
    assert_eq!(ans.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(ans.header("x-should-retry"), "", "a 429 stays retryable");
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn every_target_rate_limited_gives_the_earliest_wait() {
    let a = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "9")])).await;
    let b = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "4")])).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(retry_after(&ans), 4);
    assert_eq!((a.calls(), b.calls()), (1, 1));
    // Both now cool down: nothing is called, and the answer is still a 429.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429);
    assert!(
        (3..=4).contains(&retry_after(&ans)),
        "{}",
        retry_after(&ans)
    );
    assert_eq!((a.calls(), b.calls()), (1, 1));
}

#[tokio::test]
async fn a_rate_limit_next_to_a_real_failure_is_a_502() {
    let a = Fake::always(fake::error(500, "kaput")).await;
    let b = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "4")])).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!(ans.header("x-should-retry"), "false");
}

#[tokio::test]
async fn a_cooling_target_gets_no_trial_and_nothing_to_try_is_503_with_a_wait() {
    // `a` counts its 429 against health (so it is DOWN too) and asks for 30 s;
    // `b` is DOWN with a 2 s breaker.
    let a = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "30")])).await;
    let b = Fake::always(fake::error(500, "kaput")).await;
    let hops = [
        hop("a", &a.url()).provider(
            "error_classes:\n  - { match: { status: 429 }, action: failover, health: true, cooldown: retry_after }",
        ),
        hop("b", &b.url()).provider("retry: { max: 0 }"),
    ];
    for all_down in ["trial", "fail"] {
        let top = format!("health: {{ down_after: 1, degraded_after: 1, open_for: 2s, all_down: {all_down}, probe: {{ interval: 0 }} }}\n");
        let gw = gateway(&routes(&hops, "", &top)).await;
        let (a0, b0) = (a.calls(), b.calls());
        let first = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(first.status, 502, "{}", first.text());
        assert_eq!((a.calls(), b.calls()), (a0 + 1, b0 + 1));
        let second = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(
            a.calls(),
            a0 + 1,
            "a target inside its advertised wait is never called"
        );
        if all_down == "trial" {
            // Both DOWN, `a` also cooling: the trial goes to `b`, never to `a`.
            assert_eq!(b.calls(), b0 + 2, "the breaker-DOWN one gets the trial");
            assert_eq!(second.status, 502);
        } else {
            // Nothing can be tried: 503 and the time to the earliest
            // half-open trial (b's, 2 s ±20 %), not a's 30 s.
            assert_eq!(b.calls(), b0 + 1);
            assert_eq!(second.status, 503, "{}", second.text());
            assert_eq!(second.json()["error"]["code"], "no_target_available");
            assert!(
                (1..=3).contains(&retry_after(&second)),
                "{}",
                retry_after(&second)
            );
            assert_eq!(
                second.header("x-should-retry"),
                "",
                "a Retry-After says a retry then can help: no `x-should-retry: false` beside it"
            );
        }
    }
}

#[tokio::test]
async fn errors_already_retried_say_so_and_retryable_ones_do_not() {
    let tool_call = serde_json::json!({
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "drop_tables", "arguments": "{}"}}]}}]
    })
    .to_string();
    let a = Fake::always(fake::json(200, &tool_call)).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()).target("capabilities: [tools]")],
        "validate_tool_calls: always",
        "",
    ))
    .await;
    let body = serde_json::json!({
        "model": "gpt-4o", "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    });
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!(ans.json()["error"]["type"], "degraded_contract_violation");
    assert_eq!(
        ans.header("x-should-retry"),
        "false",
        "the SDKs retried it 3 times"
    );
    // The task's own bucket: 429, retryable.
    let limited = gateway(&routes(
        &[hop("a", &a.url())],
        "rate_limit: { rps: 0.01, burst: 1 }",
        "",
    ))
    .await;
    let _ = chat(limited.addr, hello("gpt-4o")).await;
    let ans = chat(limited.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429);
    assert_eq!(ans.header("x-should-retry"), "");
    assert!(retry_after(&ans) >= 1);
}

// ----- 3: every form of advertised wait -----

async fn cooldown_after(headers: &[(&str, &str)]) -> (Answer, f64) {
    let a = Fake::always(reply(429, SLOW_DOWN, headers)).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let left = admin_target(&gw, "a").await["cooldown_seconds_left"]
        .as_f64()
        .unwrap_or_default();
    (ans, left)
}

#[tokio::test]
async fn every_form_of_advertised_wait_is_read_and_the_longest_wins() {
    let (ans, left) = cooldown_after(&[
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "6m0s"),
        ("x-ratelimit-remaining-tokens", "100"),
        ("x-ratelimit-reset-tokens", "59m"),
    ])
    .await;
    assert_eq!(
        retry_after(&ans),
        360,
        "only the exhausted count's reset applies"
    );
    assert!(left > 355.0, "{left}");
    let (ans, _) = cooldown_after(&[("retry-after-ms", "2500"), ("retry-after", "1")]).await;
    assert_eq!(retry_after(&ans), 3, "2.5 s, in whole seconds");
    let reset = humantime::format_rfc3339(std::time::SystemTime::now() + Duration::from_secs(20));
    let (ans, left) = cooldown_after(&[
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", &reset.to_string()),
    ])
    .await;
    assert!(
        (19..=20).contains(&retry_after(&ans)),
        "{}",
        retry_after(&ans)
    );
    assert!(left > 18.0, "{left}");
}

// ----- 4: a short wait is worth waiting for -----

const WAIT_RULE: &str = "error_classes:\n  - match: { status: 429 }\n    action: failover\n    health: false\n    cooldown: retry_after\n    wait_retry_after: 2s\n";

#[tokio::test]
async fn wait_retry_after_waits_out_a_short_429_on_the_same_target() {
    let a = Fake::start(|n, _| {
        if n == 0 {
            reply(429, SLOW_DOWN, &[("retry-after-ms", "300")])
        } else {
            fake::completion("model-a", "after the wait")
        }
    })
    .await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "",
        WAIT_RULE,
    ))
    .await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-a");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!((a.calls(), b.calls()), (2, 0));
    assert_eq!(ans.header("x-switchyard-failovers"), "0");
}

#[tokio::test]
async fn a_wait_longer_than_the_limit_or_off_by_default_fails_over() {
    let long = Fake::always(reply(429, SLOW_DOWN, &[("retry-after", "5")])).await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(
        &[hop("a", &long.url()), hop("b", &b.url())],
        "",
        WAIT_RULE,
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(long.calls(), 1, "5 s is over wait_retry_after 2s");
    let short = Fake::always(reply(429, SLOW_DOWN, &[("retry-after-ms", "100")])).await;
    let gw = gateway(&routes(
        &[hop("a", &short.url()), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(short.calls(), 1, "no wait without the option");
    // Within wait_retry_after, but past what is left of the task's deadline.
    let past_deadline = Fake::always(reply(429, SLOW_DOWN, &[("retry-after-ms", "1500")])).await;
    let gw = gateway(&routes(
        &[hop("a", &past_deadline.url()), hop("b", &b.url())],
        "budget: { total_timeout: 1s }",
        WAIT_RULE,
    ))
    .await;
    // Waiting would end in the deadline's 504; failing over at once serves.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(
        past_deadline.calls(),
        1,
        "a wait that outlives the deadline is not taken"
    );
}

// ----- 6, 7: a 200 is an answer only if it is one -----

#[tokio::test]
async fn a_200_that_is_not_a_completion_fails_over_and_is_never_relayed() {
    let bodies: [(&str, &str); 5] = [
        (
            r#"{"object":"chat.completion","id":"x"}"#,
            "application/json",
        ),
        ("<html><body>502 Bad Gateway</body></html>", "text/html"),
        ("", "application/json"),
        (r#"{"choices":null}"#, "application/json"),
        (
            "data: {\"error\":{\"message\":\"overloaded\"}}\n\n",
            "text/event-stream",
        ),
    ];
    for (body, content_type) in bodies {
        let a = Fake::always(reply(200, body, &[("content-type", content_type)])).await;
        let b = ok_fake("b").await;
        let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{body:?}: {}", ans.text());
        assert_eq!(ans.json()["model"], "model-b", "{body:?}");
        // One target only: never a 200, always OpenAI-format JSON.
        let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 502, "{body:?}: {}", ans.text());
        assert_eq!(ans.header("content-type"), "application/json");
        assert!(ans.json()["error"]["code"].is_string(), "{}", ans.text());
    }
}

#[tokio::test]
async fn an_sse_error_event_sent_to_a_plain_request_keeps_its_code() {
    let a = Fake::always(reply(
        200,
        "data: {\"error\":{\"message\":\"slow\",\"code\":429}}\n\n",
        &[("content-type", "text/event-stream"), ("retry-after", "5")],
    ))
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(retry_after(&ans), 5);
}

#[tokio::test]
async fn a_200_rule_wins_over_the_built_in_reading_and_never_discards_a_completion() {
    let quota = r#"{"error":{"message":"Insufficient balance, please top up","code":402}}"#;
    let a = Fake::start(move |n, _| {
        if n == 0 {
            fake::json(200, quota)
        } else {
            fake::completion("model-a", "we never mention insufficient balance, honest")
        }
    })
    .await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { status: 200, body: '(?i)insufficient (balance|quota)' }\n    action: failover\n    cooldown: 10m\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b", "{}", ans.text());
    let view = admin_target(&gw, "a").await;
    assert_eq!(view["last_error_class"], "error_classes[0]", "{view}");
    assert!(
        view["cooldown_seconds_left"].as_f64().unwrap() > 500.0,
        "{view}"
    );
    // A completion that merely mentions the phrase is an answer.
    let gw2 = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw2.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a", "{}", ans.text());
    assert_eq!(a.calls(), 2);
}

// ----- 8: content encodings -----

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn raw_response(content_type: &str, encoding: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-encoding: {encoding}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

#[tokio::test]
async fn compressed_answers_are_decoded_before_anything_reads_them() {
    let completion = fake::completion_body("model-a", "unzipped");
    let a = RawFake::start(vec![(
        Duration::ZERO,
        raw_response("application/json", "gzip", &gzip(completion.as_bytes())),
    )])
    .await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{:?}", ans.body);
    assert_eq!(ans.json()["choices"][0]["message"]["content"], "unzipped");
    assert_eq!(ans.header("content-encoding"), "");
    // A stream, brotli-compressed.
    let sse: String = fake::sse_events("model-a", &["br", "otli"]).concat();
    let mut packed = Vec::new();
    {
        let mut w = brotli::CompressorWriter::new(&mut packed, 4096, 5, 22);
        w.write_all(sse.as_bytes()).unwrap();
    }
    let s = RawFake::start(vec![(
        Duration::ZERO,
        raw_response("text/event-stream", "br", &packed),
    )])
    .await;
    let gw = gateway(&routes(&[hop("a", &s.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(stream_text(&ans.text()), "brotli", "{}", ans.text());
    assert!(ans.text().ends_with("data: [DONE]\n\n"));
    // A gzip stream in one body: its last events are what the decoder gives
    // back only when the body ends; they are no cut stream.
    let sse: String = fake::sse_events("model-a", &["g", "zip"]).concat();
    let s = RawFake::start(vec![(
        Duration::ZERO,
        raw_response("text/event-stream", "gzip", &gzip(sse.as_bytes())),
    )])
    .await;
    let gw = gateway(&routes(&[hop("a", &s.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(stream_text(&ans.text()), "gzip", "{}", ans.text());
    assert!(ans.text().ends_with("data: [DONE]\n\n"), "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-attempts"), "1");
}

#[tokio::test]
async fn switchyard_asks_for_no_coding_and_refuses_one_it_cannot_decode() {
    let a = ok_fake("a").await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(a.seen()[0].headers["accept-encoding"], "identity");
    let bad = routes(
        &[hop("a", &a.url()).provider("headers: { accept-encoding: compress }")],
        "",
        "",
    );
    let errors = compile_errors(&bad);
    assert!(
        errors.iter().any(|d| d.message.contains("`compress`")),
        "{errors:?}"
    );
}

// ----- 9, 10: context windows in all their shapes -----

fn context_chain(small: &str, big: &str) -> String {
    routes(
        &[
            hop("small", small).target("max_context: 4000"),
            hop("big", big).target("max_context: 128000"),
        ],
        "",
        "",
    )
}

#[tokio::test]
async fn context_length_errors_are_recognised_whatever_their_status_and_wording() {
    for (status, message) in [
        (413, "prompt is too long: 210000 tokens > 200000 maximum"),
        (400, "The input (5000 tokens) is longer than the model's context length (4096 tokens)."),
        (400, "The input token count (1234567) exceeds the maximum number of tokens allowed (1048576)."),
        (400, "the request exceeds the available context size, try increasing it"),
    ] {
        let small = Fake::always(fake::error(status, message)).await;
        let big = ok_fake("big").await;
        let gw = gateway(&context_chain(&small.url(), &big.url())).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.json()["model"], "model-big", "{message}: {}", ans.text());
        assert_eq!(small.calls(), 1, "{message}: no same-target retry");
        assert_eq!(admin_target(&gw, "small").await["state"], "healthy", "not a health failure");
    }
}

#[tokio::test]
async fn a_context_error_inside_a_stream_with_no_larger_target_is_the_upstreams_400() {
    for event in [
        r#"{"error":{"message":"This model's maximum context length is 4096 tokens","code":400}}"#,
        r#"{"error":{"message":"prompt is too long: 5000 tokens > 4096 maximum"}}"#,
    ] {
        let a = Fake::always(Reply::Stream {
            pieces: vec![format!("data: {event}\n\n")],
            delay: Duration::ZERO,
            cut: false,
        })
        .await;
        let gw = gateway(&routes(
            &[hop("a", &a.url()).target("max_context: 4096")],
            "",
            "",
        ))
        .await;
        let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
        assert_eq!(ans.status, 400, "{event}: {}", ans.text());
        assert_eq!(ans.header("content-type"), "application/json");
        assert!(ans.text().contains("tokens"), "{}", ans.text());
        assert_eq!(a.calls(), 1);
    }
}

// ----- 11: health never gets stuck -----

#[tokio::test]
async fn a_degraded_target_gets_its_full_share_back_after_a_quiet_window() {
    let a = Fake::start(|n, _| {
        if n < 2 {
            fake::error(500, "transient")
        } else {
            fake::completion("model-a", "a")
        }
    })
    .await;
    let b = ok_fake("b").await;
    let hops = [
        hop("a", &a.url())
            .provider("retry: { max: 0 }")
            .target("weight: 200"),
        hop("b", &b.url()).target("weight: 100"),
    ];
    let top = "health: { min_requests: 2, failure_rate: 0.5, window: 1s, degraded_after: 5, down_after: 10 }\n";
    let gw = gateway(&routes(&hops, "strategy: weighted", top)).await;
    // Two transient 500s make `a` DEGRADED by its failure rate.
    while a.calls() < 2 {
        chat(gw.addr, hello("gpt-4o")).await;
    }
    assert_eq!(admin_target(&gw, "a").await["state"], "degraded");
    // The window forgets: no request needed to bring it back.
    let mut healthy = false;
    for _ in 0..60 {
        if admin_target(&gw, "a").await["state"] == "healthy" {
            healthy = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(healthy, "a quiet window must forget the failures");
    let before = a.calls();
    for _ in 0..300 {
        chat(gw.addr, hello("gpt-4o")).await;
    }
    let share = a.calls() - before;
    assert!(
        (190..=210).contains(&share),
        "a served {share} of 300 (weight 200 of 300)"
    );
}

// ----- 12, 13: the pool's failures and long silences -----

/// A keep-alive upstream that answers the first request of each connection
/// and closes the connection when a second one arrives on it (as if its idle
/// timeout had fired just as the request crossed).
async fn closes_reused_connections() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    closes_reused_connections_after(Duration::ZERO).await
}

/// [`closes_reused_connections`], but the second request on a connection is
/// held in silence for `hold` before the close.
async fn closes_reused_connections_after(
    hold: Duration,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&requests);
    let body = fake::completion_body("model-a", "fresh");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let seen = std::sync::Arc::clone(&seen);
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                for n in 0.. {
                    let mut got = 0;
                    while !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf[got..]).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => got += k,
                        }
                    }
                    seen.fetch_add(1, Ordering::SeqCst);
                    if n > 0 {
                        tokio::time::sleep(hold).await;
                        return; // drop: close without a response
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(body.as_bytes()).await;
                }
            });
        }
    });
    (addr, requests)
}

#[tokio::test]
async fn a_pooled_connection_closed_while_idle_is_resent_outside_health_and_retries() {
    let (addr, requests) = closes_reused_connections().await;
    let url = format!("http://{addr}/v1");
    // One runtime: each request must find the last one's pooled connection
    // (every runtime pools its own).
    let gw = gateway(&routes(
        &[hop("a", &url).provider("retry: { max: 0 }")],
        "",
        "runtimes: 1\n",
    ))
    .await;
    for i in 0..3 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "request {i}: {}", ans.text());
        // `retry.max: 0`, yet the resend went: it is not a retry. It was an
        // upstream call (the upstream read it), so the header counts it.
        let calls = if i == 0 { "1" } else { "2" };
        assert_eq!(ans.header("x-switchyard-attempts"), calls, "request {i}");
    }
    // Requests 2 and 3 each met a stale connection, then a fresh one.
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 5);
    let view = admin_target(&gw, "a").await;
    assert_eq!(view["consecutive_failures"], 0, "{view}");
    assert_eq!(view["window_requests"].as_u64(), Some(3), "{view}");
    let metrics = get(gw.addr, "/metrics").await.text();
    assert!(!metrics.contains(r#"outcome="reset""#), "{metrics}");
}

/// A reused connection whose upstream holds the request in silence, then
/// closes, was not stale: the request is not sent again on a fresh
/// connection (the caller would wait two holds); it fails over after one.
#[tokio::test]
async fn a_silence_then_a_close_on_a_reused_connection_is_not_resent() {
    use std::sync::atomic::Ordering;
    let (addr, requests) = closes_reused_connections_after(Duration::from_millis(2500)).await;
    let url = format!("http://{addr}/v1");
    let b = ok_fake("b").await;
    let gw = gateway(&routes(
        &[
            hop("a", &url).provider("timeout: 10s\nretry: { max: 0 }"),
            hop("b", &b.url()),
        ],
        "",
        // One runtime: the second request reuses the first's connection.
        "runtimes: 1\n",
    ))
    .await;
    let first = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(first.json()["model"], "model-a", "{}", first.text());
    let started = tokio::time::Instant::now();
    let second = chat(gw.addr, hello("gpt-4o")).await;
    let waited = started.elapsed();
    assert_eq!(second.json()["model"], "model-b", "{}", second.text());
    assert_eq!(
        requests.load(Ordering::SeqCst),
        2,
        "the held request was sent again"
    );
    assert_eq!(
        second.header("x-switchyard-attempts"),
        "2",
        "a once, then b"
    );
    // One hold (2.5 s), not two.
    assert!(waited < Duration::from_millis(4500), "waited {waited:?}");
}

#[tokio::test]
async fn a_long_silence_then_a_close_is_a_timeout_not_a_reset() {
    // Reads the request, says nothing for 1.5 s, closes.
    let silent = RawFake::start(vec![(Duration::from_millis(1500), Vec::new())]).await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(
        &[
            hop("a", &silent.url()).provider("timeout: 10s"),
            hop("b", &b.url()),
        ],
        "",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b", "{}", ans.text());
    assert_eq!(
        silent.calls(),
        1,
        "a timeout is not retried on the same target"
    );
    let metrics = get(gw.addr, "/metrics").await.text();
    assert!(
        metrics.contains(r#"switchyard_upstream_attempts_total{target="a",outcome="timeout"} 1"#),
        "{metrics}"
    );
    // A close at once is still a reset, retried once.
    let reset = RawFake::start(vec![(Duration::ZERO, Vec::new())]).await;
    let gw = gateway(&routes(
        &[hop("a", &reset.url()), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(reset.calls(), 2);
}

// ----- 23: log lines say what happens next -----

#[test]
fn the_log_says_failover_when_a_cooldown_refuses_the_retry() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (a, b) = rt.block_on(async {
        (
            Fake::always(fake::error(503, "busy")).await,
            ok_fake("b").await,
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    let top = "error_classes:\n  - match: { status: 503 }\n    action: retry\n    cooldown: 30s\n";
    std::fs::write(
        &config,
        routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top),
    )
    .unwrap();
    let served = crate::binary::Served::start(&config, dir.path(), &[("RUST_LOG", "info")]);
    let ans = rt.block_on(chat(served.addr, hello("gpt-4o")));
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(a.calls(), 1, "the cooldown refused the retry");
    // Log lines reach stderr within a flush (25 ms).
    let mut log = String::new();
    crate::support::wait_blocking(std::time::Duration::from_secs(5), || {
        log = served.log();
        log.contains("upstream attempt failed")
    });
    let line = log
        .lines()
        .find(|l| l.contains("upstream attempt failed"))
        .unwrap_or_else(|| panic!("no attempt line in:\n{log}"));
    assert!(
        line.contains("failover") && !line.contains("retry\""),
        "{line}"
    );
}
