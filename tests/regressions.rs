//! Regression tests, each named after a bug found by a review of this gateway.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake};
use crate::support::*;

/// The value of a metric line `name{labels} value` on the metrics page, 0 if absent.
fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn rejected_reload_is_logged_and_counted_once_not_in_a_loop() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let cfg = chain_config(&[("a", &a.url())], "", "");
    let gw = gateway(&cfg).await;
    let series = r#"switchyard_config_reloads_total{result="error"}"#;
    let before = metric(&get(gw.addr, "/metrics").await.text(), series);
    gw.rewrite(&cfg.replace("chain: [a]", "chain: [nope]"));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after = metric(&get(gw.addr, "/metrics").await.text(), series);
    // Other tests in this binary may reload broken files at the same time: allow
    // their few events, but a self-triggering watcher would add ~8 here.
    assert!(
        (1.0..=3.0).contains(&(after - before)),
        "{before} -> {after}"
    );
    assert_eq!(
        chat(gw.addr, hello("gpt-4o")).await.status,
        200,
        "old config still serves"
    );
}

#[tokio::test]
async fn busy_directory_does_not_postpone_a_reload() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let cfg = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "");
    let gw = gateway(&cfg).await;
    let log = gw.dir.path().join("app.log");
    let writer = tokio::spawn(async move {
        for i in 0..60 {
            let _ = std::fs::write(&log, format!("line {i}\n"));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let written = Instant::now();
    gw.rewrite(&cfg.replace("chain: [a, b]", "chain: [b]"));
    let mut switched = None;
    while written.elapsed() < Duration::from_millis(1000) {
        if chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target")
            == "b"
        {
            switched = Some(written.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writer.abort();
    assert!(
        switched.is_some(),
        "reload not applied within 1 s while another file in the directory kept changing"
    );
}

#[tokio::test]
async fn rotated_api_key_file_takes_effect_without_editing_routes() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw_dir_key = tempfile::tempdir().unwrap();
    let key = gw_dir_key.path().join("key");
    std::fs::write(&key, "sk-first\n").unwrap();
    let cfg = chain_config(
        &[("a", &a.url())],
        &format!("    api_key_file: {}\n", key.display()),
        "",
    );
    let gw = gateway(&cfg).await;
    chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(a.seen()[0].headers["authorization"], "Bearer sk-first");
    // Kubernetes-style rotation: a new file renamed over the old one.
    let tmp = gw_dir_key.path().join("..key.tmp");
    std::fs::write(&tmp, "sk-second\n").unwrap();
    std::fs::rename(&tmp, &key).unwrap();
    let mut rotated = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        chat(gw.addr, hello("gpt-4o")).await;
        if a.seen().last().unwrap().headers["authorization"] == "Bearer sk-second" {
            rotated = true;
            break;
        }
    }
    assert!(rotated, "the rotated key was not picked up within 2 s");
}

#[tokio::test]
async fn context_error_with_no_larger_target_returns_the_upstreams_400() {
    let body = r#"{"error":{"message":"This model's maximum context length is 8192 tokens","type":"invalid_request_error","code":"context_length_exceeded"}}"#;
    let a = Fake::always(fake::json(400, body)).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let cfg = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")
        .replace(
            "model: upstream-a }",
            "model: upstream-a, max_context: 8192 }",
        )
        .replace(
            "model: upstream-b }",
            "model: upstream-b, max_context: 8192 }",
        );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert_eq!(ans.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(b.calls(), 0, "same-size target is not tried");
}

#[tokio::test]
async fn own_400_and_413_are_counted_in_requests_total() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let series = r#"switchyard_requests_total{task="unknown",target="none",status="400"}"#;
    let before = metric(&get(gw.addr, "/metrics").await.text(), series);
    let ans = post_raw(gw.addr, "/v1/chat/completions", "[1,2]", &[]).await;
    assert_eq!(ans.status, 400);
    let after = metric(&get(gw.addr, "/metrics").await.text(), series);
    assert!(after > before, "{before} -> {after}");
}

#[tokio::test]
async fn missing_model_is_a_400_not_a_404() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let body = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let ans = post_raw(gw.addr, "/v1/chat/completions", body, &[]).await;
    assert_eq!(ans.status, 400);
    assert!(ans.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("model"));
}

#[tokio::test]
async fn all_down_trial_respects_retry_after() {
    let a = Fake::always(fake::Reply::Json {
        status: 429,
        body: r#"{"error":{"message":"slow down"}}"#.into(),
        headers: vec![("retry-after".into(), "30".into())],
    })
    .await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 502);
    assert_eq!(a.calls(), 1);
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(
        a.calls(),
        1,
        "a target inside its Retry-After window gets no trial"
    );
    assert!(ans.status.is_server_error());
}

#[tokio::test]
async fn first_config_load_and_every_target_show_in_metrics_from_the_start() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(
        &config,
        chain_config(&[("a", &a.url()), ("b", &a.url())], "", ""),
    )
    .unwrap();
    let served = crate::binary::Served::start(&config, dir.path(), &[]);
    let page = get(served.addr, "/metrics").await.text();
    assert!(
        page.contains(r#"switchyard_config_reloads_total{result="ok"} 1"#),
        "{page}"
    );
    assert!(page.contains("switchyard_config_hash "), "{page}");
    assert!(
        page.contains(r#"switchyard_target_health{target="a"} 0"#),
        "{page}"
    );
    assert!(
        page.contains(r#"switchyard_target_health{target="b"} 0"#),
        "{page}"
    );
}

#[test]
fn probe_interval_zero_is_not_a_type_error_next_to_another_problem() {
    let text = "version: 1\nbogus: 1\nhealth:\n  probe: { interval: 0 }\n  open_for: 30\n";
    let parsed = switchyard::config::parse(text).unwrap();
    assert_eq!(parsed.pending.len(), 1, "{:?}", parsed.pending);
    assert!(parsed.pending[0].message.contains("bogus"));
}

#[tokio::test]
async fn own_502_tells_sdks_not_to_retry_again() {
    let dead = fake::dead_url().await;
    let gw = gateway(&chain_config(&[("a", &dead)], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502);
    assert_eq!(ans.header("x-should-retry"), "false");
}

#[tokio::test]
async fn admin_listener_also_serves_health_and_metrics_for_probes() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw =
        gateway(&(chain_config(&[("a", &a.url())], "", "") + "admin_listen: 127.0.0.1:0\n")).await;
    let admin = gw.admin.unwrap();
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(get(admin, path).await.status, 200, "{path}");
    }
}

#[tokio::test]
async fn deeply_nested_reload_is_rejected_and_the_old_config_keeps_serving() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    gw.rewrite(&format!("version: 1\ntasks:\n{}x\n", "- ".repeat(20_000)));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
}

#[test]
fn absurd_durations_are_rejected() {
    let text = "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1', timeout: 300000000000y }\n";
    let err = compile_errors(text);
    assert!(err.iter().any(|d| d.line == 3), "{err:?}");
}

#[tokio::test]
async fn an_sse_event_that_never_ends_is_a_broken_stream_not_unbounded_memory() {
    let endless = fake::Reply::Stream {
        pieces: vec![format!("data: {}", "x".repeat(1_200_000)), "x".repeat(10)],
        delay: Duration::from_millis(20),
        cut: false,
    };
    let a = Fake::always(endless).await;
    let b = Fake::always(fake::stream("model-b", &["fine"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(stream_text(&ans.text()), "fine");
}
