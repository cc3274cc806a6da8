//! Regression tests, each named after a bug found by a review of this gateway.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::fake::{self, Fake};
use crate::support::*;

#[tokio::test]
async fn rejected_reload_is_logged_and_counted_once_not_in_a_loop() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let cfg = chain_config(&[("a", &a.url())], "", "");
    let gw = gateway(&cfg).await;
    assert_eq!(reloads(&gw, "error").await, 0.0);
    gw.rewrite(&cfg.replace("chain: [a]", "chain: [nope]"));
    assert!(
        eventually(Duration::from_secs(3), || async {
            reloads(&gw, "error").await >= 1.0
        })
        .await,
        "the rejected file was not counted within 3 s"
    );
    // The scenario: a watcher set off by its own reads would reject the file
    // again every 150 ms debounce; over 1 s it would count about 6 more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(reloads(&gw, "error").await, 1.0, "counted once");
    assert_eq!(reloads(&gw, "ok").await, 1.0, "only the first load");
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
    let writes = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let writes = Arc::clone(&writes);
        async move {
            for i in 0..60 {
                let _ = std::fs::write(&log, format!("line {i}\n"));
                writes.fetch_add(1, Ordering::SeqCst);
                // The scenario: a write every 25 ms, well inside the 150 ms
                // debounce, so a debounce that restarted on every event would
                // never fire.
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    });
    let busy = || writes.load(Ordering::SeqCst) >= 4;
    assert!(
        wait_for(Duration::from_secs(1), busy).await,
        "the directory is busy"
    );
    gw.rewrite(&cfg.replace("chain: [a, b]", "chain: [b]"));
    let switched = eventually(Duration::from_millis(1000), || async {
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target")
            == "b"
    })
    .await;
    assert!(
        writes.load(Ordering::SeqCst) < 60,
        "the directory was still busy when the reload was applied"
    );
    writer.abort();
    assert!(
        switched,
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
    let rotated = eventually(Duration::from_secs(2), || async {
        chat(gw.addr, hello("gpt-4o")).await;
        a.seen().last().unwrap().headers["authorization"] == "Bearer sk-second"
    })
    .await;
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
    assert_eq!(metric(&gw, series).await, 0.0);
    let ans = post_raw(gw.addr, "/v1/chat/completions", "[1,2]", &[]).await;
    assert_eq!(ans.status, 400);
    assert_eq!(metric(&gw, series).await, 1.0);
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
    // A rate limit reaches the caller as what it is: 429 and its wait.
    let first = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(first.status, 429, "{}", first.text());
    assert_eq!(first.header("retry-after"), "30");
    assert_eq!(a.calls(), 1);
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(
        a.calls(),
        1,
        "a target inside its Retry-After window gets no trial"
    );
    assert_eq!(ans.status, 429, "{}", ans.text());
    let wait: u64 = ans.header("retry-after").parse().unwrap();
    assert!((29..=30).contains(&wait), "{wait}");
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
    let value = |series: &str| series_value(&page, series);
    assert_eq!(
        value(r#"switchyard_config_reloads_total{result="ok"}"#),
        Some(1.0),
        "{page}"
    );
    assert!(value("switchyard_config_hash").is_some(), "{page}");
    assert_eq!(
        value(r#"switchyard_target_health{target="a"}"#),
        Some(0.0),
        "{page}"
    );
    assert_eq!(
        value(r#"switchyard_target_health{target="b"}"#),
        Some(0.0),
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
    assert!(
        eventually(Duration::from_secs(3), || async {
            reloads(&gw, "error").await == 1.0
        })
        .await,
        "the nested file was not rejected within 3 s"
    );
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    assert_eq!(reloads(&gw, "ok").await, 1.0, "only the first load");
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

#[tokio::test]
async fn a_vllm_context_length_error_reaches_the_caller_as_openais_context_length_exceeded() {
    // vLLM and sglang answer errors at the top level, their `code` the status.
    let body = r#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#;
    let a = Fake::always(fake::json(400, body)).await;
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    let err = &ans.json()["error"];
    assert_eq!(err["code"], "context_length_exceeded", "{err}");
    assert_eq!(err["type"], "invalid_request_error", "{err}");
    assert_eq!(err["param"], "messages", "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 4096"),
        "{err}"
    );
    // Any other error of that shape keeps its words, in OpenAI's envelope.
    let other = r#"{"object":"error","message":"temperature must be at most 2","type":"BadRequestError","param":"temperature","code":400}"#;
    let b = Fake::always(fake::json(400, other)).await;
    let gw = gateway(&routes(&[hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400);
    let err = &ans.json()["error"];
    assert_eq!(err["message"], "temperature must be at most 2", "{err}");
    assert_eq!(err["param"], "temperature", "{err}");
    assert_eq!(err["code"], serde_json::Value::Null, "{err}");
    // So do Hugging Face TGI's (a 422) and FastAPI's.
    for (status, body, words) in [
        (
            422,
            r#"{"error":"Input validation error: `temperature` must be strictly positive","error_type":"validation"}"#,
            "`temperature` must be strictly positive",
        ),
        (
            400,
            r#"{"detail":"stop must have at most 4 items"}"#,
            "stop must have at most 4 items",
        ),
        // FastAPI's own 422: pydantic's list of what failed, and where.
        (
            422,
            r#"{"detail":[{"type":"missing","loc":["body","messages",0,"content"],"msg":"Field required","input":{}}]}"#,
            "body.messages.0.content: Field required",
        ),
    ] {
        let c = Fake::always(fake::json(status, body)).await;
        let gw = gateway(&routes(&[hop("c", &c.url())], "", "")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status.as_u16(), status);
        let err = &ans.json()["error"];
        assert!(err["message"].as_str().unwrap().contains(words), "{err}");
        assert_eq!(err["type"], "invalid_request_error", "{err}");
    }
}

#[tokio::test]
async fn an_account_out_of_quota_is_not_a_rate_limit_to_wait_out() {
    let quota = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
    let a = Fake::always(fake::json(429, quota)).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    for _ in 0..3 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
    // Asked once, not retried, then held back with its whole provider.
    assert_eq!(a.calls(), 1);
    // Alone, its own error goes back: not a 429 of switchyard's with a wait
    // that would not help, and not one an SDK should retry.
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(ans.json()["error"]["code"], "insufficient_quota");
    assert_eq!(ans.header("x-should-retry"), "false");
    assert_eq!(ans.header("retry-after"), "");
}

#[tokio::test]
async fn an_absurd_usage_count_is_booked_clamped_and_never_wraps_a_counter() {
    let absurd = fake::completion_body("m", "hi").replace(
        r#""completion_tokens":2"#,
        r#""completion_tokens":18446744073709551615"#,
    );
    let a = Fake::always(fake::json(200, &absurd)).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let booked = || async {
        let page = metrics_page(&gw).await;
        series_value(
            &page,
            r#"switchyard_tokens_total{target="a",kind="completion"}"#,
        )
        .unwrap_or(0.0)
    };
    let mut seen = Vec::new();
    for _ in 0..3 {
        assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
        seen.push(booked().await);
    }
    // u64::MAX added to a counter wraps it to one below where it was.
    let step = 4_294_967_296.0;
    assert_eq!(seen, [step, 2.0 * step, 3.0 * step], "booked: {seen:?}");
}

#[tokio::test]
async fn an_answer_its_server_cut_short_for_want_of_resources_is_no_answer() {
    // DeepSeek's finish_reason when its inference servers give up mid-answer.
    let cut = "insufficient_system_resource";
    let whole = fake::completion_body("deepseek-chat", "half an ans").replace(
        r#""finish_reason":"stop""#,
        &format!(r#""finish_reason":"{cut}""#),
    );
    assert!(whole.contains(cut), "{whole}");
    let mut pieces = fake::sse_events("deepseek-chat", &["half", " an"]);
    let last_chunk = pieces.len() - 2;
    pieces[last_chunk] = fake::chunk_event("deepseek-chat", serde_json::json!({}), Some(cut));
    let a = Fake::start(move |_, seen| {
        if seen.body["stream"] == true {
            fake::Reply::Stream {
                pieces: pieces.clone(),
                delay: Duration::ZERO,
                cut: false,
            }
        } else {
            fake::json(200, &whole)
        }
    })
    .await;
    let b = Fake::always(fake::completion("model-b", "whole")).await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    // Streamed, the cut comes after the first tokens went out: the stream
    // ends as an interruption, never as a clean finish.
    let gw = gateway(&routes(&[hop("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert!(ans.text().contains(r#""error""#), "{}", ans.text());
    assert!(!ans.text().contains(cut), "{}", ans.text());
}
