//! Hedged requests: a slow first attempt gets a parallel one on the next
//! admitted target after a delay; the first to commit wins, the other is
//! cancelled (its connection closed), and losing is not a failure. The race
//! itself is tested with paused time in `src/proxy/hedge.rs`.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

fn slow(after: Duration, reply: Reply) -> Reply {
    Reply::Delay(after, Box::new(reply))
}

fn hedging(a: &Fake, b: &Fake, hedge: &str, budget: &str) -> String {
    routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        &format!("hedge: {hedge}\n{budget}"),
        "",
    )
}

#[tokio::test]
async fn a_slow_first_attempt_is_hedged_and_the_winner_served() {
    let a = Fake::always(slow(
        Duration::from_secs(3),
        fake::completion("model-a", "slow"),
    ))
    .await;
    let b = Fake::always(fake::completion("model-b", "fast")).await;
    let gw = gateway(&hedging(&a, &b, "{ after: 100ms, max_share: 1 }", "")).await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(ans.json()["model"], "model-b", "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-hedge"), "won");
    assert_eq!(ans.header("x-switchyard-attempts"), "2");
    // The loser's connection is closed at once, and losing is no failure.
    assert!(
        wait_for(Duration::from_secs(1), || a.cancelled() == 1).await,
        "a was not cancelled"
    );
    let view = admin_target(&gw, "a").await;
    assert_eq!(
        (
            view["state"].as_str(),
            view["consecutive_failures"].as_u64()
        ),
        (Some("healthy"), Some(0))
    );
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(&m, r#"switchyard_hedges_total{task="chat",result="won"}"#),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_stream_hedge_relays_only_the_winner() {
    let a = Fake::always(slow(
        Duration::from_secs(3),
        fake::stream("model-a", &["slow", " a"]),
    ))
    .await;
    let b = Fake::always(fake::stream("model-b", &["fast", " b"])).await;
    let gw = gateway(&hedging(&a, &b, "{ after: 100ms, max_share: 1 }", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    let text = ans.text();
    assert_eq!(stream_text(&text), "fast b", "{text}");
    assert!(
        !text.contains("model-a"),
        "nothing of the loser reaches the client: {text}"
    );
    assert!(wait_for(Duration::from_secs(1), || a.cancelled() == 1).await);
}

#[tokio::test]
async fn no_hedge_when_the_first_attempt_commits_in_time() {
    let a = Fake::always(slow(
        Duration::from_millis(20),
        fake::completion("model-a", "a"),
    ))
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&hedging(&a, &b, "{ after: 300ms, max_share: 1 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a");
    assert_eq!(ans.header("x-switchyard-hedge"), "");
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn the_first_attempt_that_commits_while_the_hedge_runs_wins() {
    let a = Fake::always(slow(
        Duration::from_millis(250),
        fake::completion("model-a", "a"),
    ))
    .await;
    let b = Fake::always(slow(
        Duration::from_secs(2),
        fake::completion("model-b", "b"),
    ))
    .await;
    let gw = gateway(&hedging(&a, &b, "{ after: 100ms, max_share: 1 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a");
    assert_eq!(ans.header("x-switchyard-hedge"), "lost");
    assert!(
        wait_for(Duration::from_secs(1), || b.cancelled() == 1).await,
        "the hedge was not cancelled"
    );
}

#[tokio::test]
async fn the_rate_cap_suppresses_hedges() {
    let a = Fake::always(slow(
        Duration::from_millis(300),
        fake::completion("model-a", "a"),
    ))
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&hedging(&a, &b, "{ after: 50ms, max_share: 0 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a");
    assert_eq!(b.calls(), 0);
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_hedges_total{task="chat",result="suppressed"}"#
        ),
        Some(1.0),
        "{m}"
    );
    // With a share of 10 %, the first hedge of a minute is allowed, the next ones wait their turn.
    let gw = gateway(&hedging(&a, &b, "{ after: 50ms, max_share: 0.1 }", "")).await;
    for _ in 0..3 {
        chat(gw.addr, hello("gpt-4o")).await;
    }
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(&m, r#"switchyard_hedges_total{task="chat",result="won"}"#),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_hedges_total{task="chat",result="suppressed"}"#
        ),
        Some(2.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_callers_error_during_a_hedge_is_returned_not_failed_over() {
    // Both sides say 400 (the request is at fault), after the hedge started.
    let bad = || {
        slow(
            Duration::from_millis(300),
            fake::error(400, "unknown parameter: frobnicate"),
        )
    };
    let a = Fake::always(bad()).await;
    let b = Fake::always(bad()).await;
    let c = Fake::always(fake::completion("model-c", "must not answer")).await;
    let yaml = routes(
        &[hop("a", &a.url()), hop("b", &b.url()), hop("c", &c.url())],
        "hedge: { after: 100ms, max_share: 1 }",
        "",
    );
    let gw = gateway(&yaml).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(ans.text().contains("frobnicate"), "{}", ans.text());
    assert_eq!(c.calls(), 0, "a caller's error is not rerouted");
    // The first 400 ends the race: the other side is cancelled, not waited for.
    assert_eq!(a.calls() + b.calls(), 2);
    let m = metrics_page(&gw).await;
    assert_eq!(
        series_value(
            &m,
            r#"switchyard_failovers_total{task="chat",from="a",to="b",reason="hedge"}"#
        ),
        Some(1.0),
        "the hedge is counted where x-switchyard-failovers counts it: {m}"
    );
}

#[tokio::test]
async fn when_both_sides_fail_the_failover_says_why() {
    let down = || slow(Duration::from_millis(300), fake::error(503, "busy"));
    let a = Fake::always(down()).await;
    let b = Fake::always(down()).await;
    let c = Fake::always(fake::completion("model-c", "from c")).await;
    let yaml = routes(
        &[
            hop("a", &a.url()).provider("retry: { max: 0 }"),
            hop("b", &b.url()).provider("retry: { max: 0 }"),
            hop("c", &c.url()),
        ],
        "hedge: { after: 100ms, max_share: 1 }",
        "",
    );
    let gw = gateway(&yaml).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "c", "{}", ans.text());
    let m = metrics_page(&gw).await;
    assert!(
        m.contains(r#"switchyard_failovers_total{task="chat",from="a",to="c",reason="5xx"}"#),
        "the reason is the failure's, not a made-up timeout: {m}"
    );
}

#[tokio::test]
async fn a_first_attempt_that_fails_before_the_delay_fails_over_normally() {
    let a = Fake::always(Reply::Reset).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let gw = gateway(&hedging(&a, &b, "{ after: 1s, max_share: 1 }", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(ans.header("x-switchyard-hedge"), "");
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    assert_eq!(a.calls(), 2, "reset: retried once, then failover");
}

#[tokio::test]
async fn a_hedge_that_stalls_too_is_bounded_by_the_total_timeout() {
    let a = Fake::always(Reply::Hang).await;
    let b = Fake::always(Reply::Hang).await;
    let gw = gateway(&hedging(
        &a,
        &b,
        "{ after: 100ms, max_share: 1 }",
        "budget: { total_timeout: 800ms }",
    ))
    .await;
    let started = Instant::now();
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    let took = started.elapsed();
    assert_eq!(ans.status, 504, "{}", ans.text());
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_millis(1500),
        "{took:?}"
    );
}

#[tokio::test]
async fn an_adaptive_delay_waits_its_cap_until_the_target_is_measured() {
    let a = Fake::always(slow(
        Duration::from_millis(400),
        fake::completion("model-a", "a"),
    ))
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    // No samples yet: the delay is the cap (600 ms), so the 400 ms answer wins alone.
    let gw = gateway(&hedging(
        &a,
        &b,
        "{ after: p95, floor: 50ms, cap: 600ms, max_share: 1 }",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a");
    assert_eq!(b.calls(), 0);
    let explained = post_raw(gw.addr, "/admin/explain", hello("gpt-4o").to_string(), &[]).await;
    assert_eq!(
        explained.json()["hedge"]["after"],
        "p95",
        "{}",
        explained.text()
    );
}

#[test]
fn a_floor_above_the_cap_is_refused_where_it_is_written() {
    let url = "http://127.0.0.1:9/v1";
    let fake_pair = |hedge: &str| {
        routes(
            &[hop("a", url), hop("b", url)],
            &format!("hedge: {hedge}"),
            "",
        )
    };
    // The default cap is 2s: a floor of 3s alone is already above it.
    for (hedge, at) in [
        ("{ after: p90, floor: 3s }", "tasks.chat.hedge.floor"),
        (
            "{ after: p90, floor: 1s, cap: 500ms }",
            "tasks.chat.hedge.floor",
        ),
        ("{ after: p90, cap: 10ms }", "tasks.chat.hedge.cap"),
    ] {
        let errors = compile_errors(&fake_pair(hedge));
        assert_eq!(errors.len(), 1, "{hedge}: {errors:#?}");
        assert_eq!(errors[0].path, at, "{hedge}");
        assert!(errors[0].message.contains("above hedge.cap"), "{errors:#?}");
    }
    let equal = fake_pair("{ after: p90, floor: 2s }");
    let parsed = switchyard::config::parse(&equal).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        &equal,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    );
    assert!(compiled.is_ok(), "a floor equal to the cap is fine");
}
