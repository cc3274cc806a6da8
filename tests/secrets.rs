//! The provider's API key never reaches a client or a log line, even when a
//! hostile upstream echoes it back in error bodies, headers and stream events.
//! Runs the real binary so its stderr (RUST_LOG=debug) can be searched.

use std::time::Duration;

use crate::binary::{self, Served};
use crate::support::fake::{self, Fake, Reply, Seen};
use crate::support::*;

const KEY_VAR: &str = "SWITCHYARD_TEST_KEY";
const KEY: &str = "sk-live-SECRET123";
/// What must appear nowhere.
const NEEDLE: &str = "SECRET123";

fn echo_error(status: u16, message: &str) -> Reply {
    Reply::Json {
        status,
        body: serde_json::json!({"error": {
            "message": format!("{message} {KEY}"),
            "type": "invalid_request_error",
            "code": status,
            "param": KEY,
        }})
        .to_string(),
        headers: vec![
            ("x-echo-key".into(), KEY.into()),
            (
                "www-authenticate".into(),
                format!("Bearer realm=\"api\", error=\"invalid_token\", key=\"{KEY}\""),
            ),
        ],
    }
}

fn chunk(delta: &str) -> String {
    fake::chunk_event("m", serde_json::json!({"content": delta}), None)
}

fn error_event(code: u16) -> String {
    format!(
        "data: {}\n\n",
        serde_json::json!({"error": {"message": format!("key {KEY} revoked"), "code": code}})
    )
}

/// The hostile upstream: the last user message names the scenario.
fn script(_: usize, seen: &Seen) -> Reply {
    let scenario = seen.body["messages"][0]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    match scenario.as_str() {
        "401" => echo_error(401, "invalid api key"),
        "403" => echo_error(403, "no access for key"),
        "400" => echo_error(400, "bad request for key"),
        "422" => echo_error(422, "cannot process request with key"),
        "html-400" => Reply::Json {
            status: 400,
            body: format!("<html>bad key {KEY}</html>"),
            headers: vec![],
        },
        "in-band" => fake::json(
            200,
            &serde_json::json!({"error": {"message": format!("balance exhausted for {KEY}")}})
                .to_string(),
        ),
        "500" => echo_error(500, "internal error while checking"),
        "stream-early" => Reply::Stream {
            pieces: vec![error_event(401)],
            delay: Duration::ZERO,
            cut: false,
        },
        "stream-late" => Reply::Stream {
            pieces: vec![chunk("partial"), error_event(500)],
            delay: Duration::ZERO,
            cut: false,
        },
        // A model (or a proxy in front of it) that repeats the key it was sent.
        "echo" => fake::completion("m", &format!("your key is {KEY}")),
        "echo-stream" => Reply::Stream {
            pieces: vec![
                chunk("your key is "),
                chunk(KEY),
                fake::chunk_event("m", serde_json::json!({}), Some("stop")),
            ],
            delay: Duration::ZERO,
            cut: false,
        },
        _ => fake::completion("m", "fine"),
    }
}

fn config(url: &str) -> String {
    format!(
        "version: 1
providers:
  p-a:
    base_url: '{url}'
    api_key_env: {KEY_VAR}
    timeout: 2s
    retry: {{ max: 1, backoff: 5ms }}
targets:
  a: {{ provider: p-a, model: upstream-a }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [a]
health: {{ degraded_after: 50, down_after: 100 }}
"
    )
}

/// Status line, headers and body of an answer, as one text to search.
fn dump(what: &str, ans: &Answer) -> String {
    let mut s = format!("== {what}: {}\n", ans.status);
    for (k, v) in &ans.headers {
        s.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
    }
    s.push_str(&ans.text());
    s.push('\n');
    s
}

/// The answer to `scenario` revoked the key (visible in `/admin/targets`);
/// a reload brings it back for the next scenario.
async fn revive_key(addr: std::net::SocketAddr, path: &std::path::Path, url: &str, scenario: &str) {
    let targets = get(addr, "/admin/targets").await.json();
    assert_eq!(
        targets["targets"][0]["keys"][0]["state"], "dead",
        "{scenario}"
    );
    std::fs::write(path, format!("{}# after {scenario}\n", config(url))).unwrap();
    let revived = eventually(Duration::from_secs(10), || async {
        let targets = get(addr, "/admin/targets").await.json();
        targets["targets"][0]["keys"][0]["state"] == "usable"
    })
    .await;
    assert!(revived, "the key came back after the reload ({scenario})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_never_appears_in_responses_metrics_or_logs() {
    let a = Fake::start(script).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(&path, config(&a.url())).unwrap();
    let envs = [(KEY_VAR, KEY), ("RUST_LOG", "debug")];

    // `validate` reads the key too.
    let out = binary::run(
        &["validate", "--strict", &path.display().to_string()],
        &envs,
    );
    assert_eq!(out.status.code(), Some(0));
    let validate_out = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!validate_out.contains(NEEDLE), "validate: {validate_out}");

    let mut served = Served::start(&path, dir.path(), &envs);
    let addr = served.addr;

    let scenarios: [(&str, bool, u16); 12] = [
        ("ok", false, 200),
        ("echo", false, 200),
        ("echo-stream", true, 200),
        ("401", false, 502),
        ("403", false, 502),
        ("400", false, 400),
        ("422", false, 422),
        ("html-400", false, 400),
        ("in-band", false, 502),
        ("500", false, 502),
        ("stream-early", true, 502),
        ("stream-late", true, 200),
    ];
    let mut leaks = Vec::new();
    let mut everything = String::new();
    for (scenario, stream, status) in scenarios {
        let body = serde_json::json!({"model": "gpt-4o", "stream": stream,
            "messages": [{"role": "user", "content": scenario}]});
        let ans = chat(addr, body).await;
        let text = dump(scenario, &ans);
        assert_eq!(ans.status.as_u16(), status, "{text}");
        if text.contains(NEEDLE) {
            leaks.push(format!("response to `{scenario}`:\n{text}"));
        }
        if scenario == "400" {
            // The path under test: an OpenAI-format client error is returned
            // as is, so the upstream's own text reaches the client.
            let msg = ans.json()["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(msg.starts_with("bad request for key"), "{text}");
        }
        everything.push_str(&text);
        if ["401", "403", "stream-early"].contains(&scenario) {
            revive_key(addr, &path, &a.url(), scenario).await;
        }
    }
    for path in [
        "/metrics",
        "/admin/targets",
        "/readyz",
        "/v1/models",
        "/healthz",
    ] {
        let ans = get(addr, path).await;
        let text = dump(path, &ans);
        if text.contains(NEEDLE) {
            leaks.push(format!("GET {path}:\n{text}"));
        }
        everything.push_str(&text);
    }

    let status = tokio::task::block_in_place(|| served.terminate(Duration::from_secs(5)));
    assert_eq!(status.code(), Some(0));
    let log = served.log();
    assert!(
        log.contains("DEBUG") && log.contains("upstream attempt failed"),
        "the log was captured at debug level:\n{log}"
    );
    for line in log.lines().filter(|l| l.contains(NEEDLE)) {
        leaks.push(format!("stderr: {line}"));
    }

    // The upstream did get the key, as a bearer token, every time.
    let seen = a.seen();
    assert!(seen.len() >= scenarios.len());
    for s in &seen {
        assert_eq!(
            s.headers
                .get("authorization")
                .map(|v| v.to_str().unwrap().to_owned()),
            Some(format!("Bearer {KEY}"))
        );
    }
    // And the client-facing answers are still informative where they should be.
    assert!(everything.contains("all_targets_failed"));
    assert!(everything.contains("stream_interrupted"));

    assert!(
        leaks.is_empty(),
        "the API key leaked:\n{}",
        leaks.join("\n")
    );
}
