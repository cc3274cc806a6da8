//! The task budget: `max_failovers`, the retry bound per target, the
//! `total_timeout` deadline, and backoff that would overrun the deadline.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

#[tokio::test]
async fn max_failovers_stops_the_chain() {
    let a = Fake::always(fake::error(401, "bad key a")).await;
    let b = Fake::always(fake::error(401, "bad key b")).await;
    let c = Fake::always(fake::completion("model-c", "from c")).await;
    let hops = [hop("a", &a.url()), hop("b", &b.url()), hop("c", &c.url())];
    let gw = gateway(&routes(&hops, "budget: { max_failovers: 1 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!(ans.json()["error"]["code"], "all_targets_failed");
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    assert_eq!(ans.header("x-switchyard-attempts"), "2");
    assert_eq!((a.calls(), b.calls(), c.calls()), (1, 1, 0));
}

#[tokio::test]
async fn max_failovers_zero_means_the_first_target_only() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "budget: { max_failovers: 0 }",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!(
        (a.calls(), b.calls()),
        (2, 0),
        "retried once, never failed over"
    );
}

#[tokio::test]
async fn retries_and_failovers_bound_the_total_attempts() {
    let busy = || Fake::always(fake::error(503, "busy"));
    let (a, b, c) = (busy().await, busy().await, busy().await);
    let retry = "retry: { max: 2, backoff: 5ms }";
    let hops = [
        hop("a", &a.url()).provider(retry),
        hop("b", &b.url()).provider(retry),
        hop("c", &c.url()).provider(retry),
    ];
    // Default max_failovers: chain length - 1 = 2 -> 3 targets x 3 attempts.
    let gw = gateway(&routes(&hops, "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!((a.calls(), b.calls(), c.calls()), (3, 3, 3));
    assert_eq!(ans.header("x-switchyard-attempts"), "9");
    assert_eq!(ans.header("x-switchyard-failovers"), "2");
    // Three counted failures (the default degraded_after) each: all DEGRADED.
    assert_eq!(health_gauges(&gw).await, [1.0, 1.0, 1.0]);
    drop(gw);

    // max_failovers 1 -> 2 targets x 3 attempts, the third never called.
    let (a, b, c) = (busy().await, busy().await, busy().await);
    let hops = [
        hop("a", &a.url()).provider(retry),
        hop("b", &b.url()).provider(retry),
        hop("c", &c.url()).provider(retry),
    ];
    let gw = gateway(&routes(&hops, "budget: { max_failovers: 1 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!((a.calls(), b.calls(), c.calls()), (3, 3, 0));
    assert_eq!(ans.header("x-switchyard-attempts"), "6");
    assert_eq!(health_gauges(&gw).await, [1.0, 1.0, 0.0], "c untouched");
}

/// `switchyard_target_health` of targets a, b and c (0 healthy, 1 degraded, 2 down).
async fn health_gauges(gw: &Gw) -> [f64; 3] {
    let page = metrics_page(gw).await;
    ["a", "b", "c"].map(|t| {
        series_value(
            &page,
            &format!(r#"switchyard_target_health{{target="{t}"}}"#),
        )
        .unwrap_or_else(|| panic!("no health gauge of {t} in\n{page}"))
    })
}

#[tokio::test]
async fn total_timeout_gives_504_on_time_and_tries_nothing_after() {
    let a = Fake::always(Reply::Hang).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "budget: { total_timeout: 400ms }",
        "",
    ))
    .await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 504, "{}", ans.text());
    assert_eq!(ans.json()["error"]["code"], "deadline_exceeded");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(450),
        "{took:?}"
    );
    assert_eq!((a.calls(), b.calls()), (1, 0), "no hop after the deadline");
    assert!(
        wait_for(Duration::from_secs(1), || a.cancelled() == 1).await,
        "the hanging upstream call is closed"
    );
}

#[tokio::test]
async fn a_body_that_arrives_past_the_deadline_opens_no_upstream_call() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = Fake::always(fake::completion("model-a", "from a")).await;
    let gw = gateway(&routes(
        &[hop("a", &a.url())],
        "budget: { total_timeout: 200ms }",
        "",
    ))
    .await;
    let body = hello("gpt-4o").to_string();
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&body.as_bytes()[..10]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tcp.write_all(&body.as_bytes()[10..]).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(answer.contains("deadline_exceeded"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("x-switchyard-attempts: 0\r\n"),
        "{answer}"
    );
    assert_eq!(a.calls(), 0, "no upstream call after the deadline");
    let m = metrics_page(&gw).await;
    assert!(
        !m.contains("switchyard_upstream_attempts_total{target=\"a\""),
        "no attempt booked against a: {m}"
    );
}

#[tokio::test]
async fn streaming_total_timeout_gives_504_on_time() {
    // Headers at once, then nothing: the deadline, not first_token_timeout, ends it.
    let a = Fake::always(pieces(
        vec![role("model-a", "\n"), content("model-a", "late", "\n")],
        Duration::from_secs(5),
    ))
    .await;
    let gw = gateway(&routes(
        &[hop("a", &a.url())],
        "budget: { total_timeout: 400ms, first_token_timeout: 2s }",
        "",
    ))
    .await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 504, "{}", ans.text());
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(450),
        "{took:?}"
    );
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn backoff_that_would_overrun_the_deadline_is_not_slept() {
    // retry.backoff 10s (full jitter, capped at 10s) against a 1s budget: the
    // drawn backoff overruns the deadline ~90 % of the time and must then not
    // be slept; when it fits it may be slept, but never past the deadline.
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let hops = [
        hop("a", &a.url()).provider("retry: { max: 1, backoff: 10s }"),
        hop("b", &b.url()),
    ];
    let gw = gateway(&routes(&hops, "budget: { total_timeout: 1s }", "")).await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1100), "{took:?}");
    if a.calls() == 1 {
        // The backoff did not fit: no sleep, straight to b.
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
        assert!(took < Duration::from_millis(300), "slept anyway: {took:?}");
        assert_eq!(b.calls(), 1);
    } else {
        // The jitter drew a backoff that fit the time left.
        assert_eq!(a.calls(), 2);
        assert!(ans.status == 200 || ans.status == 504, "{}", ans.text());
    }
}

#[tokio::test]
async fn per_target_timeout_fails_over_with_time_left() {
    // a hangs; its own 300ms per-attempt timeout ends the attempt well inside
    // the 1s budget, so b gets the time left and serves.
    let a = Fake::always(Reply::Hang).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let hops = [
        hop("a", &a.url()).provider("timeout: 300ms"),
        hop("b", &b.url()),
    ];
    let gw = gateway(&routes(&hops, "budget: { total_timeout: 1s }", "")).await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(600),
        "{took:?}"
    );
    assert_eq!((a.calls(), b.calls()), (1, 1));
}
