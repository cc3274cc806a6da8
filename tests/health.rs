//! Health state machine end to end: thresholds take a target out of rotation,
//! DOWN targets get no traffic, probes restore reachable ones, state survives
//! reloads by identity.

use std::time::Duration;

use crate::support::fake::{self, Fake, Seen};
use crate::support::*;

fn is_probe(s: &Seen) -> bool {
    s.body["max_tokens"] == 1 && s.body["messages"][0]["content"] == "ping"
}

fn real_calls(f: &Fake) -> usize {
    f.seen().iter().filter(|s| !is_probe(s)).count()
}

fn probes(f: &Fake) -> usize {
    f.seen().iter().filter(|s| is_probe(s)).count()
}

fn config(a: &str, b: &str, health: &str) -> String {
    chain_config(&[("a", a), ("b", b)], "", "")
        .replace("retry: { max: 1, backoff: 10ms }", "retry: { max: 0 }")
        + health
}

/// Waits (up to 3 s) until `target`'s state is `state`.
async fn wait_for_state(gw: &Gw, target: &str, state: &str) -> bool {
    eventually(Duration::from_secs(3), || async {
        admin_target(gw, target).await["state"] == state
    })
    .await
}

#[tokio::test]
async fn failing_target_is_taken_out_then_restored_by_a_probe() {
    let a = Fake::always(fake::error(503, "down")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&config(
        &a.url(),
        &b.url(),
        "health: { degraded_after: 2, down_after: 3, open_for: 60s, probe: { interval: 300ms } }\n",
    ))
    .await;
    for _ in 0..3 {
        assert_eq!(
            chat(gw.addr, hello("gpt-4o"))
                .await
                .header("x-switchyard-target"),
            "b"
        );
    }
    let st = admin_target(&gw, "a").await;
    assert_eq!(st["state"], "down", "{st}");
    assert_eq!(st["consecutive_failures"], 3);
    assert_eq!(st["last_error_class"], "default:5xx-transient");
    assert!(st["next_trial_in_seconds"].as_f64().unwrap() > 40.0);

    // While DOWN: no real request reaches a, and nothing fails over (0 failovers).
    for _ in 0..20 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.header("x-switchyard-target"), "b");
        assert_eq!(ans.header("x-switchyard-failovers"), "0");
    }
    assert_eq!(real_calls(&a), 3, "DOWN target got traffic");
    let ready = get(gw.addr, "/readyz").await;
    assert_eq!(ready.status, 200, "b still routes");

    // a recovers; a probe (not a client request) notices and restores it.
    a.set(|_, _| fake::completion("model-a", "a"));
    assert!(
        wait_for_state(&gw, "a", "healthy").await,
        "probe did not restore a"
    );
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    assert!(a.seen().iter().any(is_probe));

    // This gateway's own registry: every count is exactly this test's.
    let page = metrics_page(&gw).await;
    let value = |series: &str| {
        series_value(&page, series).unwrap_or_else(|| panic!("no {series} in\n{page}"))
    };
    for (from, to) in [
        ("healthy", "degraded"),
        ("degraded", "down"),
        ("down", "healthy"),
    ] {
        assert_eq!(
            value(&format!(
                r#"switchyard_breaker_transitions_total{{target="a",from="{from}",to="{to}"}}"#
            )),
            1.0,
            "{from} -> {to}"
        );
    }
    assert_eq!(
        value(r#"switchyard_probes_total{target="a",result="reachable"}"#),
        1.0,
        "the first reachable probe restores a, and a healthy target is not probed"
    );
    let unreachable = series_value(
        &page,
        r#"switchyard_probes_total{target="a",result="unreachable"}"#,
    )
    .unwrap_or(0.0);
    assert_eq!(
        probes(&a) as f64,
        unreachable + 1.0,
        "every probe a saw is counted"
    );
    assert_eq!(
        value(r#"switchyard_target_health{target="a"}"#),
        0.0,
        "healthy"
    );
    assert_eq!(
        value(r#"switchyard_target_health{target="b"}"#),
        0.0,
        "healthy"
    );
}

#[tokio::test]
async fn a_401_probe_counts_as_reachable() {
    let a = Fake::always(fake::error(401, "revoked")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&config(
        &a.url(),
        &b.url(),
        "health: { down_after: 1, degraded_after: 1, open_for: 60s, probe: { interval: 200ms } }\n",
    ))
    .await;
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "b"
    );
    assert_eq!(admin_target(&gw, "a").await["state"], "down");
    assert!(
        wait_for_state(&gw, "a", "healthy").await,
        "a reachable upstream must not stay down"
    );
}

#[tokio::test]
async fn probe_interval_zero_disables_probing() {
    let a = Fake::always(fake::error(503, "x")).await;
    // A witness, DOWN too, whose own provider probes every 100 ms: once it has
    // been probed twice, the prober has had its rounds and skipped `a`.
    let w = Fake::always(fake::error(503, "x")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let no_retry = "retry: { max: 0 }";
    let hops = [
        hop("a", &a.url()).provider(no_retry),
        hop("w", &w.url()).provider("retry: { max: 0 }\nprobe: { interval: 100ms }"),
        hop("b", &b.url()).provider(no_retry),
    ];
    let health =
        "health: { down_after: 1, degraded_after: 1, open_for: 60s, probe: { interval: 0 } }\n";
    let gw = gateway(&routes(&hops, "", health)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert_eq!(admin_target(&gw, "a").await["state"], "down");
    assert_eq!(admin_target(&gw, "w").await["state"], "down");
    assert!(
        wait_for(Duration::from_secs(3), || probes(&w) >= 2).await,
        "the witness was not probed"
    );
    assert_eq!(a.calls(), 1, "no probes");
}

#[tokio::test]
async fn half_open_trial_restores_after_open_for() {
    let a = Fake::always(fake::error(503, "x")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&config(
        &a.url(),
        &b.url(),
        "health: { down_after: 1, degraded_after: 1, open_for: 300ms, probe: { interval: 0 } }\n",
    ))
    .await;
    chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "b"
    );
    assert_eq!(a.calls(), 1);
    a.set(|_, _| fake::completion("model-a", "a"));
    let waiting = admin_target(&gw, "a").await["next_trial_in_seconds"].clone();
    assert!(waiting.as_f64().unwrap() > 0.0, "{waiting}");
    // The next request must come once open_for (300 ms, ±20 % jitter) has
    // passed, to be the half-open trial: wait until the breaker says it is due.
    assert!(
        eventually(Duration::from_secs(1), || async {
            admin_target(&gw, "a").await["next_trial_in_seconds"] == 0.0
        })
        .await,
        "no trial due within 1 s of open_for: 300ms"
    );
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    assert_eq!(admin_target(&gw, "a").await["state"], "healthy");
}

#[tokio::test]
async fn all_down_trial_or_fail() {
    let a = Fake::always(fake::error(503, "x")).await;
    let b = Fake::always(fake::error(503, "x")).await;
    let h = "health: { down_after: 1, degraded_after: 1, open_for: 60s, probe: { interval: 0 } }\n";
    let gw = gateway(&config(&a.url(), &b.url(), h)).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 502);
    assert_eq!((a.calls(), b.calls()), (1, 1));
    // Both DOWN: the default `trial` still tries the least recently failed (a).
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 502);
    assert_eq!((a.calls(), b.calls()), (2, 1));

    let gw = gateway(&config(
        &a.url(),
        &b.url(),
        &h.replace("open_for: 60s", "open_for: 60s, all_down: fail"),
    ))
    .await;
    chat(gw.addr, hello("gpt-4o")).await;
    let (ca, cb) = (a.calls(), b.calls());
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 503);
    assert_eq!(ans.json()["error"]["code"], "no_target_available");
    assert_eq!(
        (a.calls(), b.calls()),
        (ca, cb),
        "no call when all are down and all_down is fail"
    );
    assert_eq!(get(gw.addr, "/readyz").await.status, 503);
}

#[tokio::test]
async fn health_survives_reload_by_identity() {
    let a = Fake::always(fake::error(503, "x")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let h = "health: { down_after: 1, degraded_after: 1, open_for: 60s, probe: { interval: 0 } }\n";
    let cfg = config(&a.url(), &b.url(), h);
    let gw = gateway(&cfg).await;
    chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(admin_target(&gw, "a").await["state"], "down");

    // Same identity (URL + model), new alias: still DOWN.
    gw.rewrite(&cfg.replace("aliases: [gpt-4o]", "aliases: [gpt-4o, extra]"));
    assert!(
        wait_for(Duration::from_secs(2), || gw
            .app
            .snapshot
            .load()
            .models
            .contains_key("extra"))
        .await,
        "reload applied"
    );
    assert_eq!(admin_target(&gw, "a").await["state"], "down");

    // New identity (other upstream model): starts HEALTHY.
    gw.rewrite(&cfg.replace("model: upstream-a", "model: upstream-a2"));
    assert!(
        eventually(Duration::from_secs(2), || async {
            admin_target(&gw, "a").await["model"] == "upstream-a2"
        })
        .await,
        "reload applied"
    );
    assert_eq!(admin_target(&gw, "a").await["state"], "healthy");
}
