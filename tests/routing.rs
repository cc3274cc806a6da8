//! Routing end to end: capability and context exclusions, token buckets on
//! both sides, the fallback budget, and explain.

use crate::support::fake::{self, Fake};
use crate::support::*;

fn two(a: &str, b: &str, a_fields: &str, b_fields: &str, task_extra: &str) -> String {
    chain_config(&[("a", a), ("b", b)], "", task_extra)
        .replace(
            "model: upstream-a }",
            &format!("model: upstream-a{a_fields} }}"),
        )
        .replace(
            "model: upstream-b }",
            &format!("model: upstream-b{b_fields} }}"),
        )
}

fn with_tools() -> serde_json::Value {
    serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
}

#[tokio::test]
async fn requests_with_tools_skip_targets_without_the_capability() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&two(&a.url(), &b.url(), "", ", capabilities: [tools]", "")).await;
    let ans = chat(gw.addr, with_tools()).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.header("x-switchyard-failovers"),
        "0",
        "an exclusion is not a failover"
    );
    assert_eq!(a.calls(), 0);
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_route_exclusions_total{task="chat",target="a",reason="capability"}"#
        )
        .await,
        1.0,
        "the request with tools only: {}",
        metrics_page(&gw).await
    );
}

#[tokio::test]
async fn no_capable_target_is_a_400_naming_the_capability() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&two(&a.url(), &b.url(), "", "", "")).await;
    let ans = chat(gw.addr, with_tools()).await;
    assert_eq!(ans.status, 400);
    assert_eq!(ans.json()["error"]["code"], "no_eligible_target");
    assert!(ans.text().contains("tools"));
    assert_eq!(a.calls() + b.calls(), 0);
}

#[tokio::test]
async fn prompts_too_long_for_a_window_skip_that_target() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&two(
        &a.url(),
        &b.url(),
        ", max_context: 200",
        ", max_context: 100000",
        "",
    ))
    .await;
    let long = "word ".repeat(400);
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 50, "messages": [{"role": "user", "content": long}]});
    assert_eq!(chat(gw.addr, body).await.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 0);
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    // Too long for every window: a 400 an agent trims on, as an upstream's
    // own, naming the largest window, and nothing goes up.
    let longer = "word ".repeat(120_000);
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 50, "messages": [{"role": "user", "content": longer}]});
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    let err = &ans.json()["error"];
    assert_eq!(err["code"], "context_length_exceeded", "{err}");
    assert_eq!(err["param"], "messages", "{err}");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("max_context is 100000"),
        "{err}"
    );
    assert_eq!((a.calls(), b.calls()), (1, 1));
}

#[tokio::test]
async fn task_bucket_answers_429_with_retry_after_and_sends_nothing() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(
        &[("a", &a.url())],
        "",
        "    rate_limit: { rps: 0.5, burst: 1 }\n",
    ))
    .await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429);
    assert_eq!(ans.json()["error"]["type"], "rate_limit_error");
    let retry: u64 = ans.header("retry-after").parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn provider_bucket_skips_the_target_without_a_call() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let cfg = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "").replacen(
        "    retry: { max: 1, backoff: 10ms }\n",
        "    retry: { max: 1, backoff: 10ms }\n    rate_limit: { rpm: 1, burst: 1 }\n",
        1,
    );
    let gw = gateway(&cfg).await;
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 1, "over its provider's rpm, a is not called");
    assert_eq!(
        metric(&gw, r#"switchyard_ratelimited_total{scope="provider"}"#).await,
        1.0,
        "{}",
        metrics_page(&gw).await
    );
}

#[tokio::test]
async fn fallback_budget_cuts_off_fallbacks_once_spent() {
    let a = Fake::always(fake::error(503, "down")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    // The fake reports 5 prompt + 2 completion tokens: 0.007 USD at 1 USD/1k.
    let cfg = two(
        &a.url(),
        &b.url(),
        "",
        ", cost: { input_per_1k: 1.0, output_per_1k: 1.0 }",
        "    fallback_budget: { usd_per_hour: 0.005 }\n",
    ) + "health: { degraded_after: 100, down_after: 100 }\n";
    let gw = gateway(&cfg).await;
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "b"
    );
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!(
        b.calls(),
        1,
        "b is a fallback and the hour's budget is spent"
    );
    let page = metrics_page(&gw).await;
    let value = |series: &str| series_value(&page, series);
    assert_eq!(
        value(
            r#"switchyard_route_exclusions_total{task="chat",target="b",reason="fallback_budget"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        value(r#"switchyard_cost_usd_total{task="chat",target="b"}"#),
        Some(0.007),
        "{page}"
    );
    assert_eq!(
        value(r#"switchyard_tokens_total{target="b",kind="completion"}"#),
        Some(2.0),
        "{page}"
    );
    assert_eq!(
        value(r#"switchyard_tokens_total{target="b",kind="prompt"}"#),
        Some(5.0),
        "{page}"
    );
}

#[tokio::test]
async fn admin_explain_shows_candidates_and_exclusions() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&two(&a.url(), &b.url(), "", ", capabilities: [tools]", "")).await;
    let ans = post_raw(gw.addr, "/admin/explain", with_tools().to_string(), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let v = ans.json();
    assert_eq!(v["candidates"][0]["target"], "b");
    assert_eq!(v["excluded"][0]["target"], "a");
    assert_eq!(v["excluded"][0]["reason"], "capability");
    assert_eq!(a.calls() + b.calls(), 0, "explain sends nothing");
}

#[test]
fn explain_command_prints_order_and_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(
        &path,
        "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1' }\ntargets:\n  \
         small: { provider: p, model: s, max_context: 8000 }\n  \
         tooled: { provider: p, model: t, capabilities: [tools], max_context: 8000 }\n  \
         big: { provider: p, model: b, capabilities: [tools], max_context: 128000 }\n\
         tasks:\n  agent: { chain: [small, tooled, big] }\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["explain", "--config"])
        .arg(&path)
        .args([
            "--task",
            "agent",
            "--tools",
            "--prompt-tokens",
            "7000",
            "--max-tokens",
            "2000",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1. big"), "{text}");
    assert!(
        text.contains("small: lacks capability `tools` [capability]"),
        "{text}"
    );
    assert!(
        text.contains("tooled: needs ~9000 tokens, max_context is 8000 [context_window]"),
        "{text}"
    );
}

/// Under `round_robin` (and `weighted`), the strategy's ordinary picks are
/// not fallbacks: they spend no fallback budget and are never cut off by it;
/// only failovers from the pick are (issue 21 item 14).
#[tokio::test]
async fn a_rotating_strategys_own_picks_spend_no_fallback_budget() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    // Each answer costs 0.007 USD, over the whole budget.
    let price = ", cost: { input_per_1k: 1.0, output_per_1k: 1.0 }";
    let cfg = two(
        &a.url(),
        &b.url(),
        price,
        price,
        "    strategy: round_robin\n    fallback_budget: { usd_per_hour: 0.005 }\n",
    );
    let gw = gateway(&cfg).await;
    for _ in 0..4 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-failovers"), "0");
    }
    assert_eq!((a.calls(), b.calls()), (2, 2), "both keep their turns");
    let page = metrics_page(&gw).await;
    assert!(!page.contains(r#"reason="fallback_budget""#), "{page}");
}

/// Provider `pa` (at `a`, with `pa_extra`) and `pb` (at `b`); task `normal`
/// = [a, b] and task `core` = [a] (critical).
fn prioritized(a: &Fake, b: &Fake, pa_extra: &str) -> String {
    format!(
        "version: 1
providers:
  pa: {{ base_url: '{}', retry: {{ max: 0 }}{pa_extra} }}
  pb: {{ base_url: '{}' }}
targets:
  a: {{ provider: pa, model: upstream-a }}
  b: {{ provider: pb, model: upstream-b }}
tasks:
  normal: {{ aliases: [gpt-4o], chain: [a, b] }}
  core: {{ chain: [a], priority: critical }}
",
        a.url(),
        b.url()
    )
}

/// A bucket's `reserve` is spent by critical tasks only: normal requests
/// skip the target once what is left is the reserve (reason `reserved`) and
/// go on down their chain, while a critical one still gets it (issue 24
/// part 2).
#[tokio::test]
async fn a_buckets_reserve_is_kept_for_critical_tasks() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    // 5 at once, 2 of them (40 %) kept; a refill every 10 s.
    let gw = gateway(&prioritized(
        &a,
        &b,
        ", rate_limit: { rpm: 6, burst: 5, reserve: 0.4 }",
    ))
    .await;
    let served = |body: serde_json::Value| {
        let addr = gw.addr;
        async move { chat(addr, body).await.header("x-switchyard-target") }
    };
    for _ in 0..3 {
        assert_eq!(served(hello("gpt-4o")).await, "a");
    }
    assert_eq!(
        served(hello("gpt-4o")).await,
        "b",
        "the rest is the reserve"
    );
    // explain says why, for a normal request and not for a critical one.
    let explain = |model: &str| {
        let body = hello(model).to_string();
        let addr = gw.addr;
        async move {
            let ans = post_raw(addr, "/admin/explain", body, &[]).await;
            ans.json()["candidates"][0]["held_back"].clone()
        }
    };
    assert_eq!(explain("gpt-4o").await["reason"], "reserved");
    assert!(explain("core").await.is_null());
    assert_eq!(
        served(hello("core")).await,
        "a",
        "a critical task spends it"
    );
    assert_eq!(served(hello("core")).await, "a");
    let ans = chat(gw.addr, hello("core")).await;
    assert_eq!(
        ans.status,
        429,
        "the bucket itself is empty now: {}",
        ans.text()
    );
    assert_eq!(a.calls(), 5);
    let m = metrics_page(&gw).await;
    let reserved =
        r#"switchyard_route_exclusions_total{task="normal",target="a",reason="reserved"}"#;
    assert_eq!(series_value(&m, reserved), Some(1.0), "{m}");
}

/// After a 429 from a provider with `shed_after_429`, only critical tasks
/// call it for that window (issue 24 part 2).
#[tokio::test]
async fn a_provider_that_rate_limits_sheds_non_critical_work() {
    let a = Fake::start(|n, _| match n {
        0 => fake::error(429, "slow down"),
        _ => fake::completion("model-a", "a"),
    })
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&prioritized(&a, &b, ", shed_after_429: 30s")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    // Past the 429's own 1 s cooldown: only the shedding holds a back.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    let ans = chat(gw.addr, hello("core")).await;
    assert_eq!(ans.header("x-switchyard-target"), "a", "{}", ans.text());
    assert_eq!(a.calls(), 2);
    let m = metrics_page(&gw).await;
    let reserved =
        r#"switchyard_route_exclusions_total{task="normal",target="a",reason="reserved"}"#;
    assert_eq!(series_value(&m, reserved), Some(1.0), "{m}");
}

/// Task `nightly` (alias `gpt-4o`): batch, [a] alone, with a queue of one
/// waiting at most 5 s; `a`'s provider allows `rpm`, one at once.
fn batch_queue(a: &Fake, rpm: u32) -> String {
    format!(
        "version: 1
providers:
  pa: {{ base_url: '{}', rate_limit: {{ rpm: {rpm}, burst: 1 }} }}
targets:
  a: {{ provider: pa, model: upstream-a }}
tasks:
  nightly:
    aliases: [gpt-4o]
    chain: [a]
    priority: batch
    queue: {{ max_wait: 5s, max_depth: 1 }}
",
        a.url()
    )
}

/// A batch task with a queue waits for its provider's quota instead of a
/// 429, in arrival order, up to `max_depth` waiting: one more gets its 429 at
/// once (issue 24 part 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_task_waits_in_its_queue_for_quota_instead_of_a_429() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let yaml = batch_queue(&a, 60);
    let gw = gateway(&yaml).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    let started = tokio::time::Instant::now();
    let (one, two) = tokio::join!(
        chat(gw.addr, hello("gpt-4o")),
        chat(gw.addr, hello("gpt-4o"))
    );
    let mut statuses = [one.status.as_u16(), two.status.as_u16()];
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [200, 429],
        "one waited, the queue was full for the other"
    );
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(500),
        "{waited:?}"
    );
    assert!(waited < std::time::Duration::from_secs(4), "{waited:?}");
    assert_eq!(a.calls(), 2);
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(&m, r#"switchyard_queue_wait_seconds_count{task="nightly"}"#),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        series_value(&m, r#"switchyard_queue_depth{task="nightly"}"#),
        Some(0.0),
        "{m}"
    );
    let full = r#"switchyard_queue_full_total{task="nightly"}"#;
    assert_eq!(series_value(&m, full), Some(1.0), "{m}");
}

/// A reload keeps a batch task's queue: the requests already waiting still
/// count against `max_depth`, and the depth says so (issue 24 part 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_requests_waiting_in_a_queue() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let yaml = batch_queue(&a, 30);
    let gw = gateway(&yaml).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    let addr = gw.addr;
    let waiting = tokio::spawn(async move { chat(addr, hello("gpt-4o")).await });
    let depth = || {
        let page = gw.app.metrics().render();
        series_value(&page, r#"switchyard_queue_depth{task="nightly"}"#)
    };
    assert!(
        eventually(std::time::Duration::from_secs(2), || async {
            depth() == Some(1.0)
        })
        .await
    );
    gw.rewrite(&format!("{yaml}# edited\n"));
    assert!(
        eventually(std::time::Duration::from_secs(3), || async {
            reloads(&gw, "ok").await >= 2.0
        })
        .await
    );
    assert_eq!(depth(), Some(1.0), "the waiting request is still counted");
    let refused = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(
        refused.status,
        429,
        "the queue is still full: {}",
        refused.text()
    );
    assert_eq!(waiting.await.unwrap().status, 200);
    assert_eq!(depth(), Some(0.0));
}
