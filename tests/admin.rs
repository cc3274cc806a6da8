//! Hardening: the admin listener and token, the concurrency cap, the drain timeout.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

#[tokio::test]
async fn admin_listener_serves_admin_only_and_the_main_one_stops_serving_it() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw =
        gateway(&(chain_config(&[("a", &a.url())], "", "") + "admin_listen: 127.0.0.1:0\n")).await;
    let admin = gw.admin.expect("admin listener bound");
    assert_eq!(get(admin, "/admin/targets").await.status, 200);
    assert_eq!(
        get(admin, "/v1/models").await.status,
        404,
        "the API is not on the admin listener"
    );
    assert_eq!(
        get(gw.addr, "/admin/targets").await.status,
        404,
        "admin moved off the main listener"
    );
    assert_eq!(
        get(gw.addr, "/metrics").await.status,
        200,
        "metrics stay where scrapers look"
    );
    assert_eq!(get(gw.addr, "/readyz").await.status, 200);
}

#[tokio::test]
async fn admin_token_is_required_when_configured() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "s3cret-admin\n").unwrap();
    let cfg = chain_config(&[("a", &a.url())], "", "")
        + &format!("admin_token_file: {}\n", token.display());
    let gw = gateway(&cfg).await;
    let ans = get(gw.addr, "/admin/targets").await;
    assert_eq!(ans.status, 401);
    assert_eq!(ans.json()["error"]["code"], "unauthorized");
    assert_eq!(
        get_with(
            gw.addr,
            "/admin/targets",
            &[("authorization", "Bearer wrong")]
        )
        .await
        .status,
        401
    );
    assert_eq!(
        get_with(
            gw.addr,
            "/admin/targets",
            &[("authorization", "Bearer s3cret-admin")]
        )
        .await
        .status,
        200
    );
}

#[tokio::test]
async fn a_missing_admin_token_rejects_the_config() {
    let text = "version: 1\nadmin_token_env: SWITCHYARD_TEST_NO_SUCH_TOKEN_VAR\n";
    let err = compile_errors(text);
    assert!(
        err.iter()
            .any(|d| d.line == 2 && d.message.contains("not set")),
        "{err:?}"
    );
}

#[tokio::test]
async fn over_the_concurrency_cap_gets_503_with_retry_after() {
    let a = Fake::always(Reply::Delay(
        Duration::from_millis(500),
        Box::new(fake::completion("m", "slow")),
    ))
    .await;
    let gw =
        gateway(&(chain_config(&[("a", &a.url())], "", "") + "max_concurrent_requests: 1\n")).await;
    let addr = gw.addr;
    let first = tokio::spawn(async move { chat(addr, hello("gpt-4o")).await.status });
    assert!(
        wait_for(Duration::from_millis(500), || a.calls() == 1).await,
        "the first request reached the upstream"
    );
    let second = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(second.status, 503);
    assert_eq!(second.header("retry-after"), "1");
    assert_eq!(second.json()["error"]["code"], "overloaded");
    assert_eq!(
        second.header("x-should-retry"),
        "",
        "an overload is worth retrying: no `x-should-retry: false`"
    );
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(
        chat(gw.addr, hello("gpt-4o")).await.status,
        200,
        "the slot is free again"
    );
    assert_eq!(a.calls(), 2);
}

#[tokio::test]
async fn bodies_still_arriving_hold_no_slot_of_the_concurrency_cap() {
    use tokio::io::AsyncWriteExt;
    let a = Fake::always(fake::completion("m", "hi")).await;
    let gw =
        gateway(&(chain_config(&[("a", &a.url())], "", "") + "max_concurrent_requests: 2\n")).await;
    // Five uploads stalled after their first byte: more than the cap.
    let mut stalled = Vec::new();
    for _ in 0..5 {
        let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        tcp.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
        )
        .await
        .unwrap();
        stalled.push(tcp);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    drop(stalled);
}

#[tokio::test]
async fn shutdown_waits_for_in_flight_requests_at_most_drain_timeout() {
    let a = Fake::always(Reply::Hang).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(
        &config,
        chain_config(&[("a", &a.url())], "", "") + "drain_timeout: 300ms\n",
    )
    .unwrap();
    let gw = switchyard::server::Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse().unwrap()),
        Default::default(),
    )
    .await
    .unwrap();
    let addr = gw.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gw.run(async {
        let _ = stopped.await;
    }));
    let hanging = tokio::spawn(async move { chat(addr, hello("gpt-4o")).await });
    assert!(
        wait_for(Duration::from_millis(500), || a.calls() == 1).await,
        "the request is in flight"
    );
    let started = Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(3), server)
        .await
        .expect("server stopped")
        .unwrap()
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_millis(800),
        "{took:?}"
    );
    hanging.abort();
}
