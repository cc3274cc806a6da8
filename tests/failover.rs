//! Non-streaming routing and failover by the default error-class table.

use std::time::Duration;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

async fn pair(primary: Reply) -> (Fake, Fake, Gw) {
    let a = Fake::always(primary).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    (a, b, gw)
}

#[tokio::test]
async fn healthy_primary_serves_and_request_is_forwarded_faithfully() {
    let (a, b, gw) = pair(fake::completion("model-a", "from a")).await;
    let body = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.2, "x_vendor_field": {"keep": [1, 2]}});
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(
        ans.json()["model"],
        "model-a",
        "body model is what the upstream reported"
    );
    assert_eq!(ans.header("x-switchyard-target"), "a");
    assert_eq!(ans.header("x-switchyard-provider"), "p-a");
    assert_eq!(ans.header("x-switchyard-attempts"), "1");
    assert_eq!(ans.header("x-switchyard-failovers"), "0");
    assert_eq!(ans.header("x-switchyard-degraded"), "false");
    assert!(!ans.header("x-request-id").is_empty());
    let seen = &a.seen()[0];
    assert_eq!(seen.body["model"], "upstream-a");
    assert_eq!(
        seen.body["x_vendor_field"],
        serde_json::json!({"keep": [1, 2]})
    );
    assert_eq!(seen.body["temperature"], 0.2);
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn five_hundreds_retry_once_then_fail_over() {
    for status in [500, 502, 503, 504, 529] {
        let (a, b, gw) = pair(fake::error(status, "boom")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "status {status}: {}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
        assert_eq!(ans.header("x-switchyard-degraded"), "true");
        assert_eq!(ans.json()["model"], "model-b");
        assert_eq!(a.calls(), 2, "status {status}: one try plus one retry");
        assert_eq!(b.calls(), 1);
        assert_eq!(ans.header("x-switchyard-attempts"), "3");
        assert_eq!(ans.header("x-switchyard-failovers"), "1");
    }
}

#[tokio::test]
async fn rate_limit_fails_over_without_retry() {
    let (a, b, gw) = pair(fake::error(429, "slow down")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 1);
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn connection_refused_fails_over() {
    let dead = fake::dead_url().await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&chain_config(&[("a", &dead), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn reset_before_headers_fails_over() {
    let (a, b, gw) = pair(Reply::Reset).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 2, "network errors retry once");
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn timeout_fails_over_without_retry() {
    let a = Fake::always(Reply::Hang).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let cfg = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")
        .replace("timeout: 2s", "timeout: 200ms");
    let gw = gateway(&cfg).await;
    let started = tokio::time::Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 1);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        wait_for(Duration::from_millis(100), || a.cancelled() == 1).await,
        "the abandoned upstream call is closed"
    );
}

#[tokio::test]
async fn client_errors_are_returned_as_is_without_failover() {
    for status in [400, 413, 422] {
        let (a, b, gw) = pair(fake::error(status, "your request is wrong")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status.as_u16(), status);
        assert_eq!(ans.json()["error"]["message"], "your request is wrong");
        assert_eq!(ans.header("x-switchyard-target"), "a");
        assert_eq!(a.calls(), 1);
        assert_eq!(b.calls(), 0, "status {status} must not fail over");
    }
}

#[tokio::test]
async fn non_json_upstream_error_is_never_copied_raw() {
    let (_a, _b, gw) = pair(Reply::Json {
        status: 400,
        body: "<html>nginx internal-host-7.vendor.example</html>".into(),
        headers: vec![],
    })
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400);
    assert!(!ans.text().contains("internal-host"), "{}", ans.text());
    assert!(ans.json()["error"]["message"].is_string());
}

#[tokio::test]
async fn all_targets_failing_gives_502_with_last_status() {
    let a = Fake::always(fake::error(503, "down")).await;
    let b = Fake::always(fake::error(401, "bad key")).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502);
    let err = &ans.json()["error"];
    assert_eq!(err["code"], "all_targets_failed");
    assert!(err["message"].as_str().unwrap().contains("401"), "{err}");
    assert!(
        !ans.text().contains("bad key"),
        "upstream text is not copied"
    );
    assert_eq!(a.calls(), 2);
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn budget_exhausted_gives_504_near_the_deadline() {
    let a = Fake::always(Reply::Hang).await;
    let cfg = chain_config(
        &[("a", &a.url())],
        "",
        "    budget: { total_timeout: 300ms }\n",
    );
    let gw = gateway(&cfg).await;
    let started = tokio::time::Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 504, "{}", ans.text());
    assert_eq!(ans.json()["error"]["code"], "deadline_exceeded");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(350),
        "{took:?}"
    );
}

#[tokio::test]
async fn unknown_model_is_404_and_malformed_json_is_400() {
    let (a, _b, gw) = pair(fake::completion("m", "x")).await;
    let ans = chat(gw.addr, hello("no-such-model")).await;
    assert_eq!(ans.status, 404);
    assert_eq!(ans.json()["error"]["code"], "model_not_found");
    let ans = post_raw(gw.addr, "/v1/chat/completions", "{not json", &[]).await;
    assert_eq!(ans.status, 400);
    assert_eq!(ans.json()["error"]["type"], "invalid_request_error");
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn task_header_selects_the_task() {
    let (a, _b, gw) = pair(fake::completion("model-a", "x")).await;
    let ans = post_raw(
        gw.addr,
        "/v1/chat/completions",
        hello("whatever").to_string(),
        &[("x-task-type", "chat")],
    )
    .await;
    assert_eq!(ans.status, 200);
    assert_eq!(a.calls(), 1);
    // An empty header names no task: `model` routes.
    let ans = post_raw(
        gw.addr,
        "/v1/chat/completions",
        hello("gpt-4o").to_string(),
        &[("x-task-type", " ")],
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 2);
}

#[tokio::test]
async fn client_hang_up_cancels_the_upstream_call() {
    let a = Fake::always(Reply::Hang).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let addr = gw.addr;
    let req = tokio::spawn(async move { chat(addr, hello("gpt-4o")).await });
    assert!(
        wait_for(Duration::from_secs(1), || a.calls() == 1).await,
        "the request reached the upstream"
    );
    req.abort();
    assert!(
        wait_for(Duration::from_secs(1), || a.cancelled() == 1).await,
        "the upstream saw its connection close"
    );
    assert_eq!(a.calls(), 1);
}
