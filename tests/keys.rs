//! Key pools: failures scoped to the key that caused them (a 429 cools the
//! key, a 401 revokes it until a reload or rotation), the next key tried on
//! the same target before any failover, per-key buckets, provider-scoped
//! cooldowns, and Azure-shaped providers (query parameters, the key's header
//! or query parameter) whose key never leaks.

use std::path::Path;
use std::time::Duration;

use crate::binary::{free_addr, Served};
use crate::support::fake::{self, Fake, Reply, Seen};
use crate::support::*;

/// Writes one key file per `(name, key)` in `dir`; returns the YAML `keys:`
/// list for them (with `extra` inline fields on each).
fn key_files(dir: &Path, keys: &[(&str, &str)], extra: &str) -> String {
    let mut yaml = String::from("keys:\n");
    for (name, key) in keys {
        let file = dir.join(format!("{name}.key"));
        std::fs::write(&file, key).unwrap();
        yaml.push_str(&format!(
            "  - {{ name: {name}, file: '{}'{extra} }}\n",
            file.display()
        ));
    }
    yaml
}

fn bearer(seen: &Seen) -> String {
    seen.headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn limited(retry_after: &str) -> Reply {
    Reply::Json {
        status: 429,
        body: r#"{"error":{"message":"Rate limit reached for requests","type":"requests","code":"rate_limit_exceeded"}}"#.into(),
        headers: vec![("retry-after".into(), retry_after.into())],
    }
}

fn keys_of(target: &serde_json::Value) -> Vec<(String, String)> {
    target["keys"]
        .as_array()
        .expect("a keys list")
        .iter()
        .map(|k| {
            (
                k["name"].as_str().unwrap().to_owned(),
                k["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_429_on_one_key_moves_the_request_to_the_next_key_without_a_failover() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::start(|_, seen| match bearer(seen).as_str() {
        "Bearer key-one" => limited("30"),
        _ => fake::completion("upstream-a", "from key two"),
    })
    .await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let pool = key_files(keys.path(), &[("one", "key-one"), ("two", "key-two")], "");
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider(&pool), hop("b", &b.url())],
        "",
        "",
    ))
    .await;

    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "a");
    assert_eq!(ans.header("x-switchyard-failovers"), "0");
    assert_eq!(ans.header("x-switchyard-attempts"), "2");
    let used: Vec<String> = a.seen().iter().map(bearer).collect();
    assert_eq!(used, ["Bearer key-one", "Bearer key-two"]);

    // Key one cools down (30 s); the next requests go to key two at once.
    for _ in 0..3 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200);
        assert_eq!(ans.header("x-switchyard-attempts"), "1");
    }
    let used: Vec<String> = a.seen().iter().map(bearer).collect();
    assert_eq!(used[2..], ["Bearer key-two"; 3]);
    assert_eq!(b.calls(), 0, "the target itself never failed over");
    let target = admin_target(&gw, "a").await;
    assert_eq!(target["state"], "healthy", "{target}");
    assert_eq!(
        keys_of(&target),
        [
            ("one".to_owned(), "cooling_down".to_owned()),
            ("two".to_owned(), "usable".to_owned())
        ]
    );
    let page = metrics_page(&gw).await;
    assert_eq!(
        series_value(&page, r#"switchyard_key_state{provider="p-a",key="one"}"#),
        Some(1.0),
        "{page}"
    );
    assert!(!page.contains("key-one") && !page.contains("key-two"));
}

#[tokio::test]
async fn a_revoked_key_is_skipped_until_its_file_rotates() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::start(|_, seen| match bearer(seen).as_str() {
        "Bearer old-one" => fake::error(401, "Incorrect API key provided"),
        _ => fake::completion("upstream-a", "ok"),
    })
    .await;
    let pool = key_files(keys.path(), &[("one", "old-one"), ("two", "key-two")], "");
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&pool)], "", "")).await;

    for _ in 0..6 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
    }
    let used: Vec<String> = a.seen().iter().map(bearer).collect();
    assert_eq!(
        used.iter().filter(|k| *k == "Bearer old-one").count(),
        1,
        "the revoked key was sent once: {used:?}"
    );
    let target = admin_target(&gw, "a").await;
    assert_eq!(
        target["state"], "healthy",
        "a key's 401 is not the target's"
    );
    assert_eq!(keys_of(&target)[0], ("one".to_owned(), "dead".to_owned()));
    let page = metrics_page(&gw).await;
    assert_eq!(
        series_value(&page, r#"switchyard_key_state{provider="p-a",key="one"}"#),
        Some(2.0)
    );

    // The operator rotates key one's file: it serves again.
    std::fs::write(keys.path().join("one.key"), "new-one").unwrap();
    let back = eventually(Duration::from_secs(10), || async {
        keys_of(&admin_target(&gw, "a").await)[0].1 == "usable"
    })
    .await;
    assert!(back, "the rotated key is usable again");
    for _ in 0..4 {
        assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    }
    let used: Vec<String> = a.seen().iter().map(bearer).collect();
    assert!(used.contains(&"Bearer new-one".to_owned()), "{used:?}");
    assert_eq!(used.iter().filter(|k| *k == "Bearer old-one").count(), 1);
}

#[tokio::test]
async fn when_every_key_is_limited_the_target_is_skipped_and_the_chain_fails_over() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(limited("30")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let pool = key_files(keys.path(), &[("one", "k-1"), ("two", "k-2")], "");
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider(&pool), hop("b", &b.url())],
        "",
        "",
    ))
    .await;

    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    assert_eq!(a.calls(), 2, "each key was tried once before the failover");

    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        a.calls(),
        2,
        "a target without a usable key is skipped, not called"
    );
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_route_exclusions_total{task="chat",target="a",reason="keys_limited"}"#
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_chain_whose_keys_are_all_limited_answers_429_with_the_earliest_wait() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::start(|_, seen| match bearer(seen).as_str() {
        "Bearer k-1" => limited("40"),
        _ => limited("20"),
    })
    .await;
    let pool = key_files(keys.path(), &[("one", "k-1"), ("two", "k-2")], "");
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&pool)], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    let wait: u64 = ans.header("retry-after").parse().unwrap();
    assert!(
        (19..=20).contains(&wait),
        "the earliest key frees up in 20 s: {wait}"
    );
    // Nothing is sent while both cool down; the answer is still a 429.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429);
    assert_eq!(a.calls(), 2);
}

#[tokio::test]
async fn each_key_has_its_own_rpm_bucket() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::completion("upstream-a", "ok")).await;
    let b = Fake::always(fake::completion("upstream-b", "ok")).await;
    let pool = key_files(
        keys.path(),
        &[("one", "k-1"), ("two", "k-2")],
        ", rate_limit: { rpm: 1 }",
    );
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider(&pool), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    let served: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let ans = chat(gw.addr, hello("gpt-4o")).await;
            assert_eq!(ans.status, 200);
            v.push(ans.header("x-switchyard-target"));
        }
        v
    };
    assert_eq!(
        served,
        ["a", "a", "b"],
        "one request per key, then a is out"
    );
    let mut used: Vec<String> = a.seen().iter().map(bearer).collect();
    used.sort();
    assert_eq!(used, ["Bearer k-1", "Bearer k-2"]);
}

#[tokio::test]
async fn least_recently_limited_prefers_keys_that_were_never_limited() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::start(|n, seen| match (n, bearer(seen).as_str()) {
        // Key one's 429 advertises no wait: it is usable again at once, but
        // it was the last one limited.
        (0, _) => limited("0"),
        _ => fake::completion("upstream-a", "ok"),
    })
    .await;
    let pool = key_files(
        keys.path(),
        &[("one", "k-1"), ("two", "k-2"), ("three", "k-3")],
        "",
    );
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider(&format!("key_selection: least_recently_limited\n{pool}"))],
        "",
        "",
    ))
    .await;
    for _ in 0..4 {
        assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    }
    let used: Vec<String> = a.seen().iter().map(bearer).collect();
    assert_eq!(used[0], "Bearer k-1");
    assert!(
        used[1..].iter().all(|k| k != "Bearer k-1"),
        "the limited key waits behind the others: {used:?}"
    );
}

#[tokio::test]
async fn a_provider_scoped_rule_holds_back_every_target_of_the_provider() {
    let shared = Fake::start(|_, seen| match seen.body["model"].as_str() {
        Some("m1") => fake::error(429, "You exceeded your current quota"),
        _ => fake::completion("m2", "never"),
    })
    .await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let yaml = format!(
        "version: 1
providers:
  acct:
    base_url: '{}'
    error_classes:
      - {{ match: {{ status: 429, body: 'quota' }}, action: failover, scope: provider, cooldown: 60s }}
  other: {{ base_url: '{}' }}
targets:
  one: {{ provider: acct, model: m1 }}
  two: {{ provider: acct, model: m2 }}
  b: {{ provider: other, model: upstream-b }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [one, two, b] }}
",
        shared.url(),
        b.url()
    );
    let gw = gateway(&yaml).await;
    for _ in 0..2 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
    assert_eq!(
        shared.calls(),
        1,
        "the account's other target was never called"
    );
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_route_exclusions_total{task="chat",target="two",reason="provider_cooldown"}"#
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn an_azure_shaped_provider_gets_its_query_path_and_api_key_header() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::completion("gpt-4o", "from azure")).await;
    let file = keys.path().join("azure.key");
    std::fs::write(&file, "azure-key-123\n").unwrap();
    let provider = format!(
        "key_header: api-key\nquery: {{ api-version: '2024-10-21' }}\napi_key_file: '{}'",
        file.display()
    );
    let base = format!(
        "{}/openai/deployments/gpt4o-prod",
        a.url().trim_end_matches("/v1")
    );
    let gw = gateway(&routes(&[hop("a", &base).provider(&provider)], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let seen = &a.seen()[0];
    assert_eq!(
        seen.uri,
        "/openai/deployments/gpt4o-prod/chat/completions?api-version=2024-10-21"
    );
    assert_eq!(seen.headers["api-key"], "azure-key-123");
    assert!(seen.headers.get("authorization").is_none());
}

#[tokio::test]
async fn a_key_can_go_in_the_query_string_with_other_parameters() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::completion("m", "ok")).await;
    let pool = key_files(keys.path(), &[("one", "q/k+1"), ("two", "q-k-2")], "");
    let provider = format!("key_query: key\nquery: {{ alt: json }}\n{pool}");
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&provider)], "", "")).await;
    for _ in 0..2 {
        assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 200);
    }
    let mut uris: Vec<String> = a.seen().iter().map(|s| s.uri.clone()).collect();
    uris.sort();
    assert_eq!(
        uris,
        [
            "/v1/chat/completions?alt=json&key=q%2Fk%2B1",
            "/v1/chat/completions?alt=json&key=q-k-2"
        ]
    );
    assert!(a
        .seen()
        .iter()
        .all(|s| s.headers.get("authorization").is_none()));
}

/// A key in a URL's query string shows up nowhere: not in the answer to a
/// connection error, not in an upstream's echo of the URL, not in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_the_query_string_never_leaks() {
    const KEY: &str = "qsSECRET987zyx";
    let echo = Fake::start(|_, seen| {
        fake::error(400, &format!("no deployment at {} (key {KEY})", seen.uri))
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    std::fs::write(&key, KEY).unwrap();
    let dead = free_addr();
    let yaml = format!(
        "version: 1
providers:
  gone:
    base_url: 'http://{dead}/v1'
    key_query: code
    query: {{ api-version: '1' }}
    api_key_file: '{key}'
    connect_timeout: 300ms
  echo:
    base_url: '{}'
    key_query: code
    api_key_file: '{key}'
targets:
  gone: {{ provider: gone, model: m }}
  echo: {{ provider: echo, model: m }}
tasks:
  down: {{ aliases: [m-gone], chain: [gone] }}
  echo: {{ aliases: [m-echo], chain: [echo] }}
",
        echo.url(),
        key = key.display()
    );
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let mut served = Served::start(&config, dir.path(), &[("RUST_LOG", "debug")]);
    let mut everything = String::new();
    for model in ["m-gone", "m-echo"] {
        let ans = chat(served.addr, hello(model)).await;
        assert!(ans.status.is_client_error() || ans.status.is_server_error());
        everything.push_str(&format!("{:?}\n{}\n", ans.headers, ans.text()));
    }
    for path in ["/metrics", "/admin/targets"] {
        everything.push_str(&get(served.addr, path).await.text());
    }
    assert_eq!(echo.calls(), 1);
    assert!(
        echo.seen()[0].uri.contains(KEY),
        "the upstream did get the key"
    );
    let status = tokio::task::block_in_place(|| served.terminate(Duration::from_secs(5)));
    assert_eq!(status.code(), Some(0));
    everything.push_str(&std::fs::read_to_string(dir.path().join("stderr.log")).unwrap());
    assert!(
        everything.contains("upstream attempt failed"),
        "{everything}"
    );
    for fragment in [KEY, "SECRET987"] {
        assert!(
            !everything.contains(fragment),
            "`{fragment}` leaked:\n{everything}"
        );
    }
}

fn pool_config(provider: &str, top: &str) -> String {
    format!(
        "version: 1
providers:
  p:
    base_url: 'http://127.0.0.1:9/v1'
{provider}
targets:
  t: {{ provider: p, model: m }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [t] }}
{top}"
    )
}

fn problems(text: &str) -> Vec<(String, String)> {
    compile_errors(text)
        .into_iter()
        .map(|d| (d.path, d.message))
        .collect()
}

#[test]
fn key_pools_that_cannot_work_are_refused_where_they_are_written() {
    let cases = [
        (
            "    keys:\n      - { name: a, env: A, file: /k }\n",
            "providers.p.keys[0]",
            "exactly one of `env` or `file`",
        ),
        (
            "    keys:\n      - { name: a, env: A }\n      - { name: a, env: B }\n",
            "providers.p.keys[1].name",
            "appears twice",
        ),
        (
            "    api_key_env: A\n    keys:\n      - { env: B }\n",
            "providers.p.keys",
            "not both",
        ),
        (
            "    key_selection: random\n",
            "providers.p.key_selection",
            "round_robin or least_recently_limited",
        ),
        (
            "    keys:\n      - { env: A, rate_limit: { rpm: 0 } }\n",
            "providers.p.keys[0].rate_limit",
            "at least 1",
        ),
    ];
    for (provider, path, says) in cases {
        let found = problems(&pool_config(provider, ""));
        assert!(
            found.iter().any(|(p, m)| p == path && m.contains(says)),
            "{provider}: expected `{says}` at {path}, got {found:?}"
        );
    }
    let many: String = (0..65)
        .map(|i| format!("      - {{ env: K{i} }}\n"))
        .collect();
    let found = problems(&pool_config(&format!("    keys:\n{many}"), ""));
    assert!(
        found
            .iter()
            .any(|(p, m)| p == "providers.p.keys" && m.contains("at most 64")),
        "{found:?}"
    );
}

#[test]
fn until_reload_is_a_key_cooldown() {
    let rule = "error_classes:\n  - { match: { status: 401 }, action: failover, cooldown: until_reload }\n";
    let found = problems(&pool_config("", rule));
    assert!(
        found
            .iter()
            .any(|(p, m)| p == "error_classes[0].cooldown" && m.contains("scope: key")),
        "{found:?}"
    );
    let rule = "error_classes:\n  - { match: { status: 401 }, action: failover, scope: account }\n";
    let found = problems(&pool_config("", rule));
    assert!(
        found.iter().any(|(p, _)| p == "error_classes[0].scope"),
        "{found:?}"
    );
}

#[test]
fn the_azure_example_validates() {
    let text = include_str!("../examples/azure/routes.yaml");
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/routes.schema.json")).unwrap();
    let doc: serde_json::Value = serde_yaml::from_str(text).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let parsed = switchyard::config::parse(text).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        text,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e:?}"));
    let azure = &compiled.snapshot.providers["azure"];
    assert_eq!(
        azure.endpoint.urls.chat.to_string(),
        "https://my-resource.openai.azure.com/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"
    );
    assert_eq!(
        compiled.snapshot.tasks["embed"]
            .embedding
            .as_ref()
            .map(|e| e.dimensions),
        Some(1536)
    );
}

/// A chain `[one, two]` of provider `acct` (serving `reply` for model m1),
/// then `b` of another provider: an out-of-credit answer on `one` must fail
/// over to `b` and hold back `two` (same account) without calling it.
async fn out_of_credit_fails_over_and_cools_the_provider(reply: Reply, stream: bool) {
    let acct = Fake::start(move |_, seen| match seen.body["model"].as_str() {
        Some("m1") => reply.clone(),
        _ => fake::completion("m2", "never"),
    })
    .await;
    let b = Fake::start(move |_, _| {
        if stream {
            fake::stream("upstream-b", &["from", " b"])
        } else {
            fake::completion("upstream-b", "from b")
        }
    })
    .await;
    let yaml = format!(
        "version: 1
providers:
  acct: {{ base_url: '{}' }}
  other: {{ base_url: '{}' }}
targets:
  one: {{ provider: acct, model: m1 }}
  two: {{ provider: acct, model: m2 }}
  b: {{ provider: other, model: upstream-b }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [one, two, b] }}
",
        acct.url(),
        b.url()
    );
    let gw = gateway(&yaml).await;
    let body = if stream {
        hello_stream("gpt-4o")
    } else {
        hello("gpt-4o")
    };
    for _ in 0..2 {
        let ans = chat(gw.addr, body.clone()).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
    assert_eq!(acct.calls(), 1, "the account is held back after its answer");
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_route_exclusions_total{task="chat",target="two",reason="provider_cooldown"}"#
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn a_402_payment_required_fails_over_and_cools_the_provider_down() {
    out_of_credit_fails_over_and_cools_the_provider(fake::error(402, "Payment Required"), false)
        .await;
}

#[tokio::test]
async fn an_in_band_402_stream_error_fails_over_and_cools_the_provider_down() {
    let reply = pieces(
        vec![event(
            r#"{"error":{"message":"insufficient balance","code":402}}"#,
            "\n",
        )],
        Duration::ZERO,
    );
    out_of_credit_fails_over_and_cools_the_provider(reply, true).await;
}

#[tokio::test]
async fn insufficient_quota_texts_on_400_and_429_fail_over_and_cool_the_provider_down() {
    let quota = Reply::Json {
        status: 429,
        body: r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#.into(),
        headers: vec![("retry-after".into(), "1".into())],
    };
    out_of_credit_fails_over_and_cools_the_provider(quota, false).await;
    let credit = fake::json(
        400,
        r#"{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API."}}"#,
    );
    out_of_credit_fails_over_and_cools_the_provider(credit, false).await;
}

/// An account alone in its chain says it is out of credit: the callers that
/// come while it is held back get its own billing answer, not to be retried,
/// rather than a 503 that asks them to wait out a cooldown.
#[tokio::test]
async fn while_an_out_of_credit_account_is_held_back_callers_get_its_billing_answer() {
    let quota = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#;
    let acct = Fake::always(fake::json(429, quota)).await;
    let ok = Fake::always(fake::completion("upstream-b", "from b")).await;
    let gw = gateway(&routes(
        &[hop("a", &acct.url()), hop("b", &ok.url())],
        "",
        "",
    ))
    .await;
    let alone = gateway(&routes(&[hop("a", &acct.url())], "", "")).await;
    for (i, body) in [hello("gpt-4o"), hello("gpt-4o"), hello_stream("gpt-4o")]
        .into_iter()
        .enumerate()
    {
        let ans = chat(alone.addr, body).await;
        assert_eq!(ans.status, 429, "request {i}: {}", ans.text());
        assert_eq!(ans.header("x-should-retry"), "false", "request {i}");
        assert!(ans.header("retry-after").is_empty(), "request {i}");
        assert!(ans.text().contains("insufficient_quota"), "{}", ans.text());
        assert!(!ans.header("x-request-id").is_empty(), "request {i}");
    }
    assert_eq!(acct.calls(), 1, "held back after its first answer");
    // With a fallback in the chain, the fallback serves: the kept answer is
    // only for a chain with nothing else to try.
    for _ in 0..2 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
}

/// Two accounts of one vendor (one URL, each its own key, declared as two
/// providers): the one out of credit is held back, the other keeps serving.
#[tokio::test]
async fn an_account_out_of_credit_never_holds_back_another_account_on_the_same_url() {
    let quota = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#;
    let vendor = Fake::start(move |_, seen| {
        if bearer(seen) == "Bearer sk-empty-account" {
            fake::json(429, quota)
        } else {
            fake::completion("m", "from the funded account")
        }
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let empty = key_files(dir.path(), &[("empty", "sk-empty-account")], "");
    let funded = key_files(dir.path(), &[("funded", "sk-funded-account")], "");
    let indent = |keys: &str| {
        keys.lines()
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    };
    let yaml = format!(
        "version: 1
providers:
  empty:
    base_url: '{url}'
{}  funded:
    base_url: '{url}'
{}targets:
  a: {{ provider: empty, model: m }}
  b: {{ provider: funded, model: m }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [a, b] }}
",
        indent(&empty),
        indent(&funded),
        url = vendor.url()
    );
    let gw = gateway(&yaml).await;
    for _ in 0..3 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
    assert_eq!(vendor.calls(), 4, "a once, then b each time");
}

/// Providers count rate limits per model: a 429 for the big model leaves the
/// key to the small one, which serves (the common "pro, then flash" chain on
/// one key), and the big model is skipped on that key for the wait.
#[tokio::test]
async fn a_rate_limit_for_one_model_leaves_the_key_to_the_others() {
    let vendor = Fake::start(move |_, seen| match seen.body["model"].as_str() {
        Some("m-big") => limited("30"),
        _ => fake::completion("m-small", "from the small model"),
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let keys = key_files(dir.path(), &[("only", "sk-only-key")], "");
    let keys: String = keys.lines().map(|l| format!("    {l}\n")).collect();
    let yaml = format!(
        "version: 1
providers:
  vendor:
    base_url: '{}'
{keys}targets:
  big: {{ provider: vendor, model: m-big }}
  small: {{ provider: vendor, model: m-small }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [big, small] }}
",
        vendor.url()
    );
    let gw = gateway(&yaml).await;
    for _ in 0..2 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "small");
    }
    let big_calls = vendor
        .seen()
        .iter()
        .filter(|s| s.body["model"] == "m-big")
        .count();
    assert_eq!(
        big_calls, 1,
        "the big model is held back on the key for its wait"
    );
    let targets = get(gw.addr, "/admin/targets").await.json();
    let state = |name: &str| {
        let t = targets["targets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["target"] == name)
            .unwrap()
            .clone();
        t["keys"][0]["state"].as_str().unwrap().to_owned()
    };
    assert_eq!(state("big"), "cooling_down", "{targets}");
    assert_eq!(state("small"), "usable", "{targets}");
}

#[tokio::test]
async fn a_provider_whose_key_file_cannot_be_read_is_skipped_never_called_keyless() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::completion("upstream-a", "keyless")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let missing = keys.path().join("missing.key");
    let pool = format!(
        "keys:\n  - {{ name: gone, file: '{}' }}\n",
        missing.display()
    );
    let gw = gateway(&routes(
        &[hop("a", &a.url()).provider(&pool), hop("b", &b.url())],
        "",
        "",
    ))
    .await;
    for _ in 0..2 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b");
    }
    assert_eq!(a.calls(), 0, "never sent without its key");
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_route_exclusions_total{task="chat",target="a",reason="keys_unreadable"}"#
        )
        .await,
        2.0
    );
    let explained = post_raw(gw.addr, "/admin/explain", hello("gpt-4o").to_string(), &[]).await;
    assert!(
        explained.text().contains("keys_unreadable"),
        "{}",
        explained.text()
    );
    // Alone in its chain it answers 503, still without a call.
    let alone = gateway(&routes(&[hop("a", &a.url()).provider(&pool)], "", "")).await;
    let ans = chat(alone.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 503, "{}", ans.text());
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn a_transient_401_on_every_key_heals_by_reprobing_each_key() {
    let keys = tempfile::tempdir().unwrap();
    // An auth blip: each key's first call gets a 401, then the upstream is fine.
    let a = Fake::always(fake::completion("upstream-a", "ok")).await;
    let refused = std::sync::Arc::new(parking_lot::Mutex::new(std::collections::HashSet::new()));
    let blip = std::sync::Arc::clone(&refused);
    a.set(move |_, seen| {
        if blip.lock().insert(bearer(seen)) {
            fake::error(401, "Incorrect API key provided")
        } else {
            fake::completion("upstream-a", "ok")
        }
    });
    let pool = key_files(keys.path(), &[("one", "key-one"), ("two", "key-two")], "");
    let provider = format!("{pool}probe: {{ interval: 1s }}\n");
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&provider)], "", "")).await;

    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "a 401 on each key: {}", ans.text());
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 503, "both keys revoked: {}", ans.text());
    assert_eq!(
        get(gw.addr, "/readyz").await.status,
        503,
        "no key can serve"
    );
    assert_eq!(
        metric(&gw, r#"switchyard_task_targets_available{task="chat"}"#).await,
        0.0
    );
    // Each key is re-probed on its own and comes back.
    let back = eventually(Duration::from_secs(10), || async {
        keys_of(&admin_target(&gw, "a").await)
            .iter()
            .all(|(_, state)| state == "usable")
    })
    .await;
    assert!(back, "{:?}", keys_of(&admin_target(&gw, "a").await));
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(get(gw.addr, "/readyz").await.status, 200);
    assert_eq!(
        metric(&gw, r#"switchyard_task_targets_available{task="chat"}"#).await,
        1.0
    );
}

#[tokio::test]
async fn a_revoke_until_rotation_rule_keeps_the_key_out_without_reprobes() {
    let keys = tempfile::tempdir().unwrap();
    let a = Fake::always(fake::error(401, "Incorrect API key provided")).await;
    let pool = key_files(keys.path(), &[("one", "key-one")], "");
    let provider = format!(
        "{pool}probe: {{ interval: 100ms }}\nerror_classes:\n  - {{ match: {{ status: 401 }}, action: failover, scope: key, cooldown: until_reload, revoke: until_rotation }}\n"
    );
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&provider)], "", "")).await;
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 502);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(a.calls(), 1, "never re-probed");
    assert_eq!(keys_of(&admin_target(&gw, "a").await)[0].1, "dead");
}

#[test]
fn revoke_needs_a_revoking_rule_and_a_known_value() {
    let found = problems(&pool_config(
        "    error_classes:\n      - { match: { status: 401 }, action: failover, revoke: until_rotation }\n      - { match: { status: 403 }, action: failover, scope: key, cooldown: until_reload, revoke: never }\n",
        "",
    ));
    assert!(
        found
            .iter()
            .any(|(path, msg)| path.ends_with("error_classes[0].revoke")
                && msg.contains("until_reload")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|(path, msg)| path.ends_with("error_classes[1].revoke")
                && msg.contains("until_rotation")),
        "{found:?}"
    );
}

/// An out-of-credit error event after the commit point (text already sent)
/// ends the stream as interrupted, but is read by the error table like one
/// before it: the provider cools down and its health is not counted (found
/// by an adversarial run: it counted as a broken stream of a healthy target).
#[tokio::test]
async fn an_out_of_credit_error_after_the_commit_point_cools_the_provider_not_its_health() {
    let mut events = fake::sse_events("m1", &["Hello", " there"]);
    events.truncate(2);
    events.push(event(
        r#"{"error":{"message":"Insufficient balance","code":402}}"#,
        "\n",
    ));
    let acct = Fake::always(pieces(events, Duration::ZERO)).await;
    let b = Fake::always(fake::stream("upstream-b", &["from", " b"])).await;
    let yaml = format!(
        "version: 1
providers:
  acct: {{ base_url: '{}', retry: {{ max: 0 }} }}
  other: {{ base_url: '{}' }}
targets:
  one: {{ provider: acct, model: m1 }}
  b: {{ provider: other, model: upstream-b }}
tasks:
  chat: {{ aliases: [gpt-4o], chain: [one, b] }}
health: {{ degraded_after: 1, down_after: 1 }}
",
        acct.url(),
        b.url()
    );
    let gw = gateway(&yaml).await;
    let broken = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert!(broken.text().contains("Hello"), "{}", broken.text());
    assert!(
        broken.text().contains("stream_interrupted"),
        "{}",
        broken.text()
    );
    let next = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(next.header("x-switchyard-target"), "b", "{}", next.text());
    assert_eq!(acct.calls(), 1, "the account is held back");
    let one = admin_target(&gw, "one").await;
    assert_eq!(one["state"], "healthy", "{one}");
    assert!(
        one["provider_cooldown_seconds_left"]
            .as_f64()
            .unwrap_or(0.0)
            > 500.0,
        "{one}"
    );
}

/// OpenAI's out-of-quota answer sent with a 5xx status, or as a 200 body
/// without a code, is read by the out-of-credit rule before the transient
/// 5xx one: not retried, the provider cools down (found by an adversarial
/// run: it was retried and counted against health).
#[tokio::test]
async fn an_out_of_quota_body_with_a_5xx_status_is_out_of_credit_not_transient() {
    let quota = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#;
    out_of_credit_fails_over_and_cools_the_provider(fake::json(502, quota), false).await;
    out_of_credit_fails_over_and_cools_the_provider(fake::json(200, quota), false).await;
}

/// A key whose bucket keeps only its reserve skips the target for normal
/// tasks with reason `reserved` (not `keys_limited`), while a critical task
/// still spends it (issue 24 part 2).
#[tokio::test]
async fn a_keys_reserve_is_kept_for_critical_tasks_and_said_so() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let dir = tempfile::tempdir().unwrap();
    let keys = key_files(
        dir.path(),
        &[("k1", "sk-one-0000000000000000")],
        ", rate_limit: { rpm: 6, burst: 5, reserve: 0.4 }",
    );
    let keys = keys.replace('\n', "\n    ");
    let yaml = format!(
        "version: 1
providers:
  pa:
    base_url: '{}'
    {keys}
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
    );
    let gw = gateway(&yaml).await;
    let target = |model: &str| {
        let addr = gw.addr;
        let body = hello(model);
        async move { chat(addr, body).await.header("x-switchyard-target") }
    };
    for _ in 0..3 {
        assert_eq!(target("gpt-4o").await, "a");
    }
    assert_eq!(target("gpt-4o").await, "b", "the rest is the key's reserve");
    assert_eq!(target("core").await, "a", "a critical task spends it");
    let m = metrics_page(&gw).await;
    let reserved =
        r#"switchyard_route_exclusions_total{task="normal",target="a",reason="reserved"}"#;
    assert_eq!(series_value(&m, reserved), Some(1.0), "{m}");
    let limited =
        r#"switchyard_route_exclusions_total{task="normal",target="a",reason="keys_limited"}"#;
    assert_eq!(series_value(&m, limited).unwrap_or(0.0), 0.0, "{m}");
}
