//! The error-class table as data: top-level and per-provider rules (status
//! code and class, network kind, body regex, header), their order, each
//! action; cooldowns and `Retry-After`; the context-window fallback; 200s
//! that carry an error. Every test checks what the client got and how many
//! calls each upstream saw.

use std::time::{Duration, SystemTime};

use crate::support::fake::{self, Fake, RawFake, Reply};
use crate::support::*;

/// A reply with a status, JSON body and extra headers.
fn with_headers(status: u16, body: &str, headers: &[(&str, &str)]) -> Reply {
    Reply::Json {
        status,
        body: body.to_owned(),
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

async fn ok_fake(name: &str) -> Fake {
    Fake::always(fake::completion(
        &format!("model-{name}"),
        &format!("from {name}"),
    ))
    .await
}

// ----- match kinds -----

#[tokio::test]
async fn status_code_rule_replaces_the_default_retry() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { status: 503 }\n    action: failover\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 1, "the rule says failover: no same-target retry");
    assert_eq!(b.calls(), 1);
    assert_eq!(ans.header("x-switchyard-attempts"), "2");
    // A status the rule does not name still follows the default table (retry once).
    a.set(|_, _| fake::error(502, "bad gateway"));
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(a.calls(), 3, "502 is retried once by the default table");
    assert_eq!(b.calls(), 2);
    // Both rules' failures count: three make a DEGRADED (the default threshold).
    assert_eq!(admin_target(&gw, "a").await["state"], "degraded");
    assert_eq!(
        metric(&gw, r#"switchyard_target_health{target="a"}"#).await,
        1.0
    );
}

#[tokio::test]
async fn an_upstream_408_is_retried_then_failed_over_never_returned() {
    let a = Fake::always(fake::error(408, "request timeout")).await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(a.calls(), 2, "retried once on a, like a reset");
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn status_class_rule_returns_the_upstream_answer() {
    let a = Fake::always(fake::error(500, "kaput")).await;
    let b = ok_fake("b").await;
    let top =
        "error_classes:\n  - match: { status: \"5xx\" }\n    action: return\n    health: false\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 500, "{}", ans.text());
    assert_eq!(ans.json()["error"]["message"], "kaput");
    assert_eq!(ans.header("x-switchyard-target"), "a");
    assert_eq!(a.calls(), 1);
    assert_eq!(b.calls(), 0);
    let view = admin_target(&gw, "a").await;
    assert_eq!(view["consecutive_failures"], 0, "health: false: {view}");
    // The class covers any 5xx, not only the listed defaults.
    a.set(|_, _| fake::error(507, "full"));
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 507);
    assert_eq!((a.calls(), b.calls()), (2, 0));
}

#[tokio::test]
async fn return_action_on_503_gives_the_client_the_503() {
    let a = Fake::always(fake::error(503, "maintenance window")).await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { status: 503 }\n    action: return\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 503, "{}", ans.text());
    assert_eq!(ans.json()["error"]["message"], "maintenance window");
    assert_eq!(ans.header("x-switchyard-failovers"), "0");
    assert_eq!(ans.header("x-switchyard-attempts"), "1");
    assert_eq!(a.calls(), 1);
    assert_eq!(b.calls(), 0, "return never reaches the secondary");
}

#[tokio::test]
async fn network_rule_fails_over_without_retry_and_without_health() {
    // Default table: a refused connection is retried once, and counts.
    let dead = fake::dead_url().await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("dead", &dead), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.header("x-switchyard-attempts"),
        "3",
        "default: dead target tried twice, then b"
    );
    assert_eq!(admin_target(&gw, "dead").await["consecutive_failures"], 2);
    drop(gw);

    // With the rule: one attempt at the dead target, not counted against it.
    let top = "error_classes:\n  - match: { network: [connect] }\n    action: failover\n    health: false\n";
    let gw = gateway(&routes(&[hop("dead", &dead), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.header("x-switchyard-attempts"),
        "2",
        "dead target not retried"
    );
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    let view = admin_target(&gw, "dead").await;
    assert_eq!(view["consecutive_failures"], 0, "{view}");
    assert_eq!(view["state"], "healthy");
    assert_eq!(b.calls(), 2);
}

#[tokio::test]
async fn body_regex_rule_fails_over_a_200_that_says_insufficient_balance() {
    let balance = r#"{"code":1008,"msg":"Insufficient balance, please recharge"}"#;
    let a = Fake::start(move |n, _| {
        if n == 0 {
            fake::json(200, balance)
        } else {
            fake::completion("model-a", "from a")
        }
    })
    .await;
    let b = ok_fake("b").await;
    let top =
        "error_classes:\n  - match: { body: \"(?i)insufficient balance\" }\n    action: failover\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-b");
    assert!(!ans.text().contains("balance"), "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (1, 1));
    // A normal 200 from the same target does not match the regex: served.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a");
    assert_eq!((a.calls(), b.calls()), (2, 1));

    // Without the rule the same 200 is still not a chat completion: never a
    // success. Read as the 502 it carries, it says the account is out of
    // credit: failed over at once (no retry) and the provider held back.
    let a2 = Fake::always(fake::json(200, balance)).await;
    let gw2 = gateway(&routes(&[hop("a", &a2.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw2.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.json()["model"], "model-b", "{}", ans.text());
    assert!(!ans.text().contains("balance"));
    assert_eq!(a2.calls(), 1, "out of credit: no retry");
    let ans = chat(gw2.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(a2.calls(), 1, "the provider cools down");
}

#[tokio::test]
async fn header_rule_matches_name_and_value_regex() {
    let a = Fake::start(|n, _| {
        let state = if n == 0 {
            "overloaded; retry later"
        } else {
            "ok"
        };
        with_headers(
            200,
            &fake::completion_body("model-a", "from a"),
            &[("X-Vendor-State", state)],
        )
    })
    .await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { header: { name: X-Vendor-State, regex: \"^overloaded\" } }\n    action: failover\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b", "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (1, 1));
    // Same header, value not matching: success from a.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-a", "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (2, 1));
}

#[tokio::test]
async fn header_presence_rule_without_regex() {
    let a = Fake::always(with_headers(
        403,
        r#"{"error":{"message":"region blocked"}}"#,
        &[("x-region-blocked", "1")],
    ))
    .await;
    let b = ok_fake("b").await;
    // 403 fails over by default; the header rule turns it into `return`.
    let top =
        "error_classes:\n  - match: { header: { name: x-region-blocked } }\n    action: return\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 403, "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (1, 0));
}

#[tokio::test]
async fn header_rule_applies_to_a_streaming_200() {
    let mut body = String::new();
    for e in [
        role("model-a", "\n"),
        content("model-a", "from a", "\n"),
        finish("model-a", "\n"),
        done("\n"),
    ] {
        body.push_str(&e);
    }
    let a = RawFake::start(vec![(
        Duration::ZERO,
        format!(
            "{}{body}",
            fake::sse_head(&[("x-vendor-state", "overloaded")])
        )
        .into_bytes(),
    )])
    .await;
    let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
    let top = "error_classes:\n  - match: { header: { name: x-vendor-state, regex: \"^overloaded\" } }\n    action: failover\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(
        ans.text(),
        fake::sse_events("model-b", &["from", " b"]).concat()
    );
    assert_eq!((a.calls(), b.calls()), (1, 1));
}

// ----- order -----

#[tokio::test]
async fn provider_rule_is_tried_before_the_top_level_rule() {
    let a = Fake::always(fake::error(503, "busy a")).await;
    let b = Fake::always(fake::error(503, "busy b")).await;
    let c = ok_fake("c").await;
    let top = "error_classes:\n  - match: { status: 503 }\n    action: return\n";
    let a_rules = "error_classes:\n  - match: { status: 503 }\n    action: failover\n";
    let hops = [
        hop("a", &a.url()).provider(a_rules),
        hop("b", &b.url()),
        hop("c", &c.url()),
    ];
    let gw = gateway(&routes(&hops, "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    // a: its own rule (failover, no retry); b: the top-level rule (return).
    assert_eq!(ans.status, 503, "{}", ans.text());
    assert_eq!(ans.json()["error"]["message"], "busy b");
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls(), c.calls()), (1, 1, 0));
}

#[tokio::test]
async fn first_matching_rule_of_a_list_decides() {
    let a = Fake::start(|n, _| {
        if n == 0 {
            fake::error(503, "first")
        } else {
            fake::error(502, "second")
        }
    })
    .await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { status: 503 }\n    action: return\n  - match: { status: \"5xx\" }\n    action: failover\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 503);
    assert_eq!((a.calls(), b.calls()), (1, 0));
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!(
        (a.calls(), b.calls()),
        (2, 1),
        "5xx rule: failover, no retry"
    );
}

// ----- cooldown and Retry-After -----

#[tokio::test]
async fn rule_cooldown_skips_the_target_without_a_call() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = ok_fake("b").await;
    let top =
        "error_classes:\n  - match: { status: 503 }\n    action: failover\n    cooldown: 2s\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (1, 1));
    let left = admin_target(&gw, "a").await["cooldown_seconds_left"]
        .as_f64()
        .expect("cooling down");
    assert!(left > 1.0 && left <= 2.0, "{left}");
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-attempts"), "1");
    assert_eq!(ans.header("x-switchyard-failovers"), "0");
    assert_eq!((a.calls(), b.calls()), (1, 2), "a skipped without a call");
}

#[tokio::test]
async fn retry_after_seconds_on_429_is_honoured() {
    let a = Fake::always(with_headers(
        429,
        r#"{"error":{"message":"slow down"}}"#,
        &[("retry-after", "30")],
    ))
    .await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        (a.calls(), b.calls()),
        (1, 1),
        "429: failover without retry"
    );
    let view = admin_target(&gw, "a").await;
    let left = view["cooldown_seconds_left"]
        .as_f64()
        .expect("cooling down");
    assert!(left > 25.0 && left <= 30.0, "{view}");
    assert_eq!(view["consecutive_failures"], 0, "429 is not breakage");
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        (a.calls(), b.calls()),
        (1, 2),
        "a not called within Retry-After"
    );
}

#[tokio::test]
async fn retry_after_http_date_on_429_is_honoured() {
    let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(40));
    let a = Fake::always(with_headers(
        429,
        r#"{"error":{"message":"slow down"}}"#,
        &[("retry-after", at.as_str())],
    ))
    .await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (1, 1));
    let left = admin_target(&gw, "a").await["cooldown_seconds_left"]
        .as_f64()
        .expect("cooling down");
    assert!(left > 30.0 && left <= 40.0, "{left}");
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (1, 2));
}

#[tokio::test]
async fn retry_after_absent_cools_down_for_the_default_second() {
    let a = Fake::always(fake::error(429, "slow down")).await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    chat(gw.addr, hello("gpt-4o")).await;
    let left = admin_target(&gw, "a").await["cooldown_seconds_left"]
        .as_f64()
        .expect("cooling down");
    assert!(left > 0.5 && left <= 1.0, "{left}");
    assert_eq!((a.calls(), b.calls()), (1, 1));
}

#[tokio::test]
async fn retry_after_cooldown_rule_reads_the_header_of_a_503() {
    let a = Fake::always(with_headers(
        503,
        r#"{"error":{"message":"maintenance"}}"#,
        &[("Retry-After", "20")],
    ))
    .await;
    let b = ok_fake("b").await;
    let top = "error_classes:\n  - match: { status: 503 }\n    action: failover\n    cooldown: retry_after\n";
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", top)).await;
    chat(gw.addr, hello("gpt-4o")).await;
    let left = admin_target(&gw, "a").await["cooldown_seconds_left"]
        .as_f64()
        .expect("cooling down");
    assert!(left > 15.0 && left <= 20.0, "{left}");
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!((a.calls(), b.calls()), (1, 2));
}

// ----- context window -----

#[tokio::test]
async fn context_window_error_goes_to_a_larger_window_only() {
    let body = r#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":"context_length_exceeded"}}"#;
    let small = Fake::always(fake::json(400, body)).await;
    let same = ok_fake("same").await;
    let big = ok_fake("big").await;
    let hops = [
        hop("small", &small.url()).target("max_context: 8000"),
        hop("same", &same.url()).target("max_context: 8000"),
        hop("big", &big.url()).target("max_context: 128000"),
    ];
    let gw = gateway(&routes(&hops, "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-big");
    assert_eq!(ans.header("x-switchyard-target"), "big");
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    assert_eq!(ans.header("x-switchyard-attempts"), "2");
    assert_eq!(small.calls(), 1, "no retry of a context-window error");
    assert_eq!(same.calls(), 0, "same-size window skipped without a call");
    assert_eq!(big.calls(), 1);
    let view = admin_target(&gw, "small").await;
    assert_eq!(view["consecutive_failures"], 0, "not breakage: {view}");
}

#[tokio::test]
async fn an_undeclared_window_is_larger_than_a_declared_one() {
    // Copilot's words for it, then TGI's (a 422).
    let copilot = r#"{"error":{"message":"prompt token count of 125516 exceeds the limit of 64000","code":"model_max_prompt_tokens_exceeded"}}"#;
    let tgi = r#"{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`","error_type":"validation"}"#;
    for (status, body) in [(400, copilot), (422, tgi)] {
        let small = Fake::always(fake::json(status, body)).await;
        let open = ok_fake("open").await;
        let hops = [
            hop("small", &small.url()).target("max_context: 64000"),
            hop("open", &open.url()),
        ];
        let gw = gateway(&routes(&hops, "", "")).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{status}: {}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "open");
        assert_eq!((small.calls(), open.calls()), (1, 1));
    }
    // When the window that failed was undeclared, none is larger.
    let body = r#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":"context_length_exceeded"}}"#;
    let first = Fake::always(fake::json(400, body)).await;
    let second = ok_fake("second").await;
    let gw = gateway(&routes(
        &[hop("first", &first.url()), hop("second", &second.url())],
        "",
        "",
    ))
    .await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert_eq!((first.calls(), second.calls()), (1, 0));
}

#[tokio::test]
async fn context_window_error_with_no_larger_candidate_fails() {
    let body = r#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":"context_length_exceeded"}}"#;
    let small = Fake::always(fake::json(400, body)).await;
    let same = ok_fake("same").await;
    let hops = [
        hop("small", &small.url()).target("max_context: 8000"),
        hop("same", &same.url()).target("max_context: 8000"),
    ];
    let gw = gateway(&routes(&hops, "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert!(!ans.status.is_success(), "{}", ans.text());
    assert_eq!((small.calls(), same.calls()), (1, 0));
}

// ----- 200 with an error body -----

#[tokio::test]
async fn in_band_429_in_a_200_fails_over_like_a_429() {
    let a = Fake::always(fake::json(
        200,
        r#"{"error":{"message":"quota exhausted","code":429}}"#,
    ))
    .await;
    let b = ok_fake("b").await;
    let gw = gateway(&routes(&[hop("a", &a.url()), hop("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["model"], "model-b");
    assert!(!ans.text().contains("quota"), "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (1, 1), "no retry, like a 429");
    let view = admin_target(&gw, "a").await;
    assert_eq!(view["consecutive_failures"], 0, "{view}");
    assert!(view["cooldown_seconds_left"].as_f64().is_some(), "{view}");
    // Cooling down like a 429: the next request does not call a.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.json()["model"], "model-b");
    assert_eq!((a.calls(), b.calls()), (1, 2));
}

/// A 429 the table returns (README's "Conservative" table) reaches the client
/// with the wait the upstream advertised, so its SDK waits that long.
#[tokio::test]
async fn a_returned_429_keeps_its_retry_after() {
    let limited = Reply::Json {
        status: 429,
        body: r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#.into(),
        headers: vec![("retry-after".into(), "7".into())],
    };
    let a = Fake::always(limited).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let rule =
        "error_classes:\n  - match: { status: 429 }\n    action: return\n    health: false\n";
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", rule)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(ans.header("retry-after"), "7");
    assert_eq!(b.calls(), 0);
}
