//! What the front door refuses before any upstream call (malformed bodies,
//! non-JSON media types), what skips an Anthropic target, key fragments in
//! relayed errors and logs, `GET /v1/models/{id}`, and the CLI's exit codes,
//! counts and log colours.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};

use crate::binary::{self, Served};
use crate::support::fake::{self, Fake};
use crate::support::*;
use crate::support::{hop, routes};

/// POSTs `body` with the given `Content-Type` (none if `None`).
async fn post_typed(
    addr: SocketAddr,
    path: &str,
    body: &str,
    content_type: Option<&str>,
) -> Answer {
    let mut req = Request::post(format!("http://{addr}{path}"));
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let fut = async {
        let resp = client().request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("request took over 20 s")
}

/// Asserts an OpenAI-format `invalid_request_error` and returns its `error`.
fn invalid_request(ans: &Answer, status: u16, what: &str) -> serde_json::Value {
    assert_eq!(ans.status, status, "{what}: {}", ans.text());
    let err = ans.json()["error"].clone();
    assert_eq!(err["type"], "invalid_request_error", "{what}: {err}");
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {err}"
    );
    err
}

// ----- (15) requests that cannot be right -----

#[tokio::test]
async fn malformed_requests_get_400_naming_the_field_without_an_upstream_call() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let user = r#"{"role":"user","content":"hi"}"#;
    let cases = [
        (r#"{"model":"gpt-4o"}"#.to_owned(), "messages"),
        (
            r#"{"model":"gpt-4o","messages":"hi"}"#.to_owned(),
            "messages",
        ),
        (
            r#"{"model":"gpt-4o","messages":{"role":"user"}}"#.to_owned(),
            "messages",
        ),
        (r#"{"model":"gpt-4o","messages":[]}"#.to_owned(), "messages"),
        (
            format!(r#"{{"model":"gpt-4o","messages":[{user},"hi"]}}"#),
            "messages[1]",
        ),
        (
            format!(r#"{{"model":"gpt-4o","messages":[{user},{user},{{"content":"x"}}]}}"#),
            "messages[2].role",
        ),
        (
            format!(r#"{{"model":"gpt-4o","messages":[{{"role":3,"content":"x"}},{user}]}}"#),
            "messages[0].role",
        ),
        (
            format!(r#"{{"model":"gpt-4o","stream":"true","messages":[{user}]}}"#),
            "stream",
        ),
        (
            format!(r#"{{"model":"gpt-4o","stream":1,"messages":[{user}]}}"#),
            "stream",
        ),
        (
            format!(r#"{{"model":"gpt-4o","max_tokens":-5,"messages":[{user}]}}"#),
            "max_tokens",
        ),
        (
            format!(r#"{{"model":"gpt-4o","max_tokens":"100","messages":[{user}]}}"#),
            "max_tokens",
        ),
        (
            format!(r#"{{"model":"gpt-4o","max_completion_tokens":1.5,"messages":[{user}]}}"#),
            "max_completion_tokens",
        ),
    ];
    for (body, param) in &cases {
        let ans = post_raw(gw.addr, "/v1/chat/completions", body.clone(), &[]).await;
        let err = invalid_request(&ans, 400, body);
        assert_eq!(err["param"], *param, "{body}: {err}");
        assert_eq!(err["code"], "invalid_request", "{body}: {err}");
    }
    for body in ["[1,2]", "\"hi\"", "", "{\"model\":"] {
        let ans = post_raw(gw.addr, "/v1/chat/completions", body, &[]).await;
        let err = invalid_request(&ans, 400, body);
        assert!(err["param"].is_null(), "{body}: {err}");
    }
    assert_eq!(a.calls(), 0, "nothing malformed reaches the upstream");
    // A null counts as absent, as in OpenAI's API; the same request is served.
    let body =
        format!(r#"{{"model":"gpt-4o","stream":null,"max_tokens":null,"messages":[{user}]}}"#);
    let ans = post_raw(gw.addr, "/v1/chat/completions", body, &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 1);
    // A null `model` is replaced, not joined by a second `model` key.
    let body = format!(r#"{{"model":null,"messages":[{user}]}}"#);
    let ans = post_raw(
        gw.addr,
        "/v1/chat/completions",
        body,
        &[("x-task-type", "chat")],
    )
    .await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.seen()[1].body["model"], "upstream-a");
}

#[tokio::test]
async fn only_json_media_types_are_read() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let body = hello("gpt-4o").to_string();
    for refused in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonl",
        "text/json",
        "",
    ] {
        let ans = post_typed(gw.addr, "/v1/chat/completions", &body, Some(refused)).await;
        let err = invalid_request(&ans, 415, refused);
        assert_eq!(err["code"], "unsupported_media_type", "{refused}: {err}");
    }
    assert_eq!(a.calls(), 0, "nothing refused reaches the upstream");
    let mut served = 0;
    for accepted in [
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("Application/JSON;charset=UTF-8"),
        Some("application/vnd.switchyard+json"),
        None,
    ] {
        let ans = post_typed(gw.addr, "/v1/chat/completions", &body, accepted).await;
        assert_eq!(ans.status, 200, "{accepted:?}: {}", ans.text());
        served += 1;
        assert_eq!(a.calls(), served);
    }
}

#[tokio::test]
async fn admin_explain_refuses_the_same_requests() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let body = r#"{"model":"gpt-4o","messages":[{"content":"no role"}]}"#;
    let ans = post_raw(gw.addr, "/admin/explain", body, &[]).await;
    assert_eq!(
        invalid_request(&ans, 400, body)["param"],
        "messages[0].role"
    );
    let body = hello("gpt-4o").to_string();
    let ans = post_typed(gw.addr, "/admin/explain", &body, Some("text/plain")).await;
    assert_eq!(
        invalid_request(&ans, 415, "text/plain")["code"],
        "unsupported_media_type"
    );
    let ans = post_typed(gw.addr, "/admin/explain", &body, None).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 0);
}

// ----- (16) what skips an Anthropic target -----

/// A chain of `hops`, where those named in `anthropic` speak Messages, with a key file.
async fn mixed(hops: &[(&str, &Fake)], anthropic: &[&str]) -> (Gw, tempfile::TempDir) {
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("key");
    std::fs::write(&key, "sk-ant-test-0123456789").unwrap();
    let hops: Vec<_> = hops
        .iter()
        .map(|(name, f)| {
            // Each claims JSON mode: only the protocol can rule a target out.
            let h = hop(name, &f.url()).target("capabilities: [json_mode]");
            if anthropic.contains(name) {
                h.provider(&format!(
                    "protocol: anthropic\napi_key_file: {}",
                    key.display()
                ))
            } else {
                h
            }
        })
        .collect();
    (gateway(&routes(&hops, "", "")).await, keys)
}

/// Requests whose answer a Messages response could not carry.
fn unanswerable_by_anthropic() -> Vec<(&'static str, serde_json::Value)> {
    let messages = serde_json::json!([{"role": "user", "content": "say hi"}]);
    vec![
        (
            "audio",
            serde_json::json!({"model": "gpt-4o", "messages": messages,
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
        ),
        (
            "audio",
            serde_json::json!({"model": "gpt-4o", "messages": messages, "modalities": ["audio"]}),
        ),
        (
            "logprobs",
            serde_json::json!({"model": "gpt-4o", "messages": messages, "logprobs": true}),
        ),
        (
            "top_logprobs",
            serde_json::json!({"model": "gpt-4o", "messages": messages,
            "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "response_format",
            serde_json::json!({"model": "gpt-4o", "messages": messages,
            "response_format": {"type": "json_object"}}),
        ),
        (
            "response_format",
            serde_json::json!({"model": "gpt-4o", "messages": messages,
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "greeting", "schema": {"type": "object"}}}}),
        ),
    ]
}

#[tokio::test]
async fn audio_json_or_logprobs_skip_an_anthropic_target_for_an_openai_one() {
    let a = Fake::always(fake::json(
        200,
        include_str!("fixtures/anthropic/text_response.anthropic.json"),
    ))
    .await;
    // JSON, so that it keeps a `response_format` contract too.
    let from_b = r#"{"text": "from b"}"#;
    let b = Fake::always(fake::completion("model-b", from_b)).await;
    let (gw, _keys) = mixed(&[("a", &a), ("b", &b)], &["a"]).await;
    let cases = unanswerable_by_anthropic();
    for (what, body) in &cases {
        let ans = chat(gw.addr, body.clone()).await;
        assert_eq!(ans.status, 200, "{what}: {}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b", "{what}");
        assert_eq!(ans.json()["choices"][0]["message"]["content"], from_b);
    }
    assert_eq!((a.calls(), b.calls()), (0, cases.len()));
    let page = get(gw.addr, "/metrics").await.text();
    assert!(
        page.contains(
            r#"switchyard_route_exclusions_total{task="chat",target="a",reason="protocol"}"#
        ),
        "{page}"
    );
    // An ordinary request still goes to the Anthropic target first.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "a", "{}", ans.text());
}

#[tokio::test]
async fn an_anthropic_only_chain_answers_400_naming_why() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let (gw, _keys) = mixed(&[("a", &a)], &["a"]).await;
    for (what, body) in unanswerable_by_anthropic() {
        let ans = chat(gw.addr, body).await;
        let err = invalid_request(&ans, 400, what);
        let message = err["message"].as_str().unwrap();
        assert!(message.contains(what), "{what}: {message}");
        assert!(message.contains("Anthropic"), "{what}: {message}");
    }
    assert_eq!(a.calls(), 0);
}

// ----- (17) key fragments in relayed errors and logs -----

/// The provider's key in these tests: its first 8 and last 4 characters are
/// what a masked echo would show.
const KEY: &str = "Zq8rT2vW9xY4zA6bC8dE0fGhJk7m";
const KEY_HEAD: &str = "Zq8rT2vW";
const KEY_TAIL: &str = "Jk7m";

/// OpenAI's wording for a wrong key, showing `shown`.
fn incorrect_key(shown: &str) -> String {
    serde_json::json!({"error": {
        "message": format!("Incorrect API key provided: {shown}. You can find your API key at https://platform.openai.com/account/api-keys."),
        "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}})
    .to_string()
}

/// What a provider may echo of a key, and the fragments that must not reach anyone.
fn masked_echoes() -> Vec<(String, [&'static str; 2])> {
    vec![
        (
            "sk-proj-abcd****************wxyz".to_owned(),
            ["sk-proj-abcd", "wxyz"],
        ),
        (
            format!("{KEY_HEAD}****************{KEY_TAIL}"),
            [KEY_HEAD, KEY_TAIL],
        ),
        (format!("{KEY_HEAD}…"), [KEY_HEAD, KEY_HEAD]),
        (format!("...{KEY_TAIL}"), [KEY_TAIL, KEY_TAIL]),
        (
            format!("{KEY_HEAD}xxxxxxxxxxxxxxxx{KEY_TAIL}"),
            [KEY_HEAD, KEY_TAIL],
        ),
    ]
}

/// routes.yaml: one target with `KEY` in a key file, 401 returned to the client.
fn key_config(url: &str, dir: &Path) -> String {
    let key = dir.join("key");
    std::fs::write(&key, KEY).unwrap();
    let a = hop("a", url).provider(&format!("api_key_file: {}", key.display()));
    let rules =
        "error_classes:\n  - match: { status: 401 }\n    action: return\n    health: false\n";
    routes(&[a], "", rules)
}

#[tokio::test]
async fn masked_key_fragments_never_reach_the_client() {
    let dir = tempfile::tempdir().unwrap();
    for (shown, fragments) in masked_echoes() {
        let a = Fake::always(fake::json(401, &incorrect_key(&shown))).await;
        let gw = gateway(&key_config(&a.url(), dir.path())).await;
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 401, "{shown}: {}", ans.text());
        let text = ans.text();
        for fragment in fragments {
            assert!(
                !text.contains(fragment),
                "{fragment} of {shown} leaked: {text}"
            );
        }
        let message = ans.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.starts_with("Incorrect API key provided: "),
            "{message}"
        );
        assert!(message.ends_with("/account/api-keys."), "{message}");
        assert_eq!(ans.json()["error"]["code"], "invalid_api_key");
    }
}

#[tokio::test]
async fn ordinary_upstream_error_text_is_relayed_unchanged() {
    let message = "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.";
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}});
    let a = Fake::always(fake::json(400, &body.to_string())).await;
    let dir = tempfile::tempdir().unwrap();
    let gw = gateway(&key_config(&a.url(), dir.path())).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert_eq!(ans.json()["error"]["message"], message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_key_fragments_never_reach_the_debug_log() {
    let a = Fake::always(fake::json(
        401,
        &incorrect_key(&format!("{KEY_HEAD}…{KEY_TAIL}")),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, key_config(&a.url(), dir.path())).unwrap();
    let served = Served::start(&config, dir.path(), &[("RUST_LOG", "switchyard=debug")]);
    let ans = chat(served.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 401, "{}", ans.text());
    // Log lines reach stderr within a flush (25 ms).
    let mut log = String::new();
    wait_blocking(Duration::from_secs(5), || {
        log = served.log();
        log.contains("upstream error returned to the client")
    });
    assert!(
        log.contains("upstream error returned to the client"),
        "{log}"
    );
    assert!(log.contains("Incorrect API key provided"), "{log}");
    for fragment in [KEY_HEAD, KEY_TAIL] {
        assert!(!log.contains(fragment), "{fragment} in the log:\n{log}");
    }
}

// ----- (21) GET /v1/models/{id} -----

#[tokio::test]
async fn a_model_is_retrieved_by_task_name_or_alias() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let listed = get(gw.addr, "/v1/models").await.json();
    for (path, id) in [
        ("/v1/models/chat", "chat"),
        ("/v1/models/gpt-4o", "gpt-4o"),
        ("/models/gpt-4o", "gpt-4o"),
        ("/v1/models/gpt%2D4o", "gpt-4o"),
    ] {
        let ans = get(gw.addr, path).await;
        assert_eq!(ans.status, 200, "{path}: {}", ans.text());
        assert!(ans.header("content-type").starts_with("application/json"));
        let v = ans.json();
        assert_eq!(v["id"], id, "{v}");
        assert_eq!(v["object"], "model");
        assert_eq!(v["created"], 0);
        assert_eq!(v["owned_by"], "switchyard");
        let in_list = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id);
        assert_eq!(in_list, Some(&v), "the same object as in the list");
    }
    for path in ["/v1/models/gpt-5", "/models/nope", "/v1/models/chat/extra"] {
        let ans = get(gw.addr, path).await;
        let err = invalid_request(&ans, 404, path);
        assert_eq!(err["code"], "model_not_found", "{path}: {err}");
    }
    let ans = post_raw(gw.addr, "/v1/models/chat", "{}", &[]).await;
    assert_eq!(ans.status, 405, "{}", ans.text());
    assert_eq!(a.calls(), 0);
}

// ----- (20) explain's exit code, validate's counts -----

const ONE_OF_EACH: &str = "version: 1
providers:
  p: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: p, model: m, max_context: 8000 }
tasks:
  chat: { chain: [t] }
";

fn describe(out: &std::process::Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn explain_exits_one_when_no_candidate_remains() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(&path, ONE_OF_EACH).unwrap();
    let path = path.display().to_string();
    let fits = binary::run(&["explain", "--config", &path, "--task", "chat"], &[]);
    assert_eq!(fits.status.code(), Some(0), "{}", describe(&fits));
    for extra in [&["--tools"][..], &["--prompt-tokens", "9000"][..]] {
        let mut args = vec!["explain", "--config", &path, "--task", "chat"];
        args.extend_from_slice(extra);
        let out = binary::run(&args, &[]);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {}", describe(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("  (none)"),
            "the plan is still printed: {text}"
        );
        assert!(text.contains("t: "), "with the reason: {text}");
    }
}

#[test]
fn explain_names_an_unknown_task_even_with_a_default_task() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(&path, format!("{ONE_OF_EACH}default_task: chat\n")).unwrap();
    let path = path.display().to_string();
    let out = binary::run(&["explain", "--config", &path, "--task", "nope"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no task or alias `nope`") && err.contains("default_task `chat`"),
        "{err}"
    );
    let known = binary::run(&["explain", "--config", &path, "--task", "chat"], &[]);
    assert_eq!(known.status.code(), Some(0), "{}", describe(&known));
}

#[test]
fn validate_counts_are_singular_for_one() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one.yaml");
    std::fs::write(&one, ONE_OF_EACH).unwrap();
    let out = binary::run(&["validate", &one.display().to_string()], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!("{}: ok (1 task, 1 target, config hash ", one.display());
    assert!(text.starts_with(&want), "{text}");

    let two = dir.path().join("two.yaml");
    let more = ONE_OF_EACH.replace(
        "tasks:\n",
        "  u: { provider: p, model: n }\ntasks:\n  other: { chain: [u] }\n",
    );
    std::fs::write(&two, more).unwrap();
    let out = binary::run(&["validate", &two.display().to_string()], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(": ok (2 tasks, 2 targets, config hash "),
        "{}",
        describe(&out)
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, ONE_OF_EACH.replace("chain: [t]", "chain: [t9]")).unwrap();
    let out = binary::run(&["validate", &bad.display().to_string()], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}: invalid (1 error)", bad.display())),
        "{}",
        describe(&out)
    );
}

// ----- (23b) no colour off a terminal -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_have_no_colour_when_stderr_is_a_file() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, chain_config(&[("a", &a.url())], "", "")).unwrap();
    // An empty NO_COLOR counts as unset: colour would be on, were it not
    // for stderr being a file.
    let mut served = Served::start(
        &config,
        dir.path(),
        &[("NO_COLOR", ""), ("RUST_LOG", "debug")],
    );
    let ans = chat(served.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    served.terminate(Duration::from_secs(5));
    let log = served.log();
    assert!(log.contains("switchyard listening"), "{log}");
    assert!(!log.contains("\x1b["), "ANSI escapes in a file:\n{log:?}");
}

/// Runs `switchyard serve` on a pseudo-terminal (util-linux `script`) until it
/// fails to bind a taken port, after logging the warning of an unset key
/// variable; returns what the terminal showed.
#[cfg(target_os = "linux")]
fn serve_on_a_terminal(config: &Path, no_color: &str) -> String {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let command = format!(
        "{} serve --config {} --listen {addr}",
        binary::BIN,
        config.display()
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("NO_COLOR", no_color)
        .env_remove("SWITCHYARD_FRONT_DOOR_UNSET_KEY")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run script(1)");
    drop(taken);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[cfg(target_os = "linux")]
#[test]
fn no_color_turns_colour_off_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    let text = ONE_OF_EACH.replace(
        "base_url: 'http://127.0.0.1:9/v1'",
        "base_url: 'http://127.0.0.1:9/v1', api_key_env: SWITCHYARD_FRONT_DOOR_UNSET_KEY",
    );
    std::fs::write(&config, text).unwrap();
    let coloured = serve_on_a_terminal(&config, "");
    assert!(
        coloured.contains("SWITCHYARD_FRONT_DOOR_UNSET_KEY"),
        "{coloured:?}"
    );
    assert!(
        coloured.contains("\x1b["),
        "a terminal gets colour: {coloured:?}"
    );
    let plain = serve_on_a_terminal(&config, "1");
    assert!(
        plain.contains("SWITCHYARD_FRONT_DOOR_UNSET_KEY"),
        "{plain:?}"
    );
    assert!(!plain.contains("\x1b["), "NO_COLOR is honoured: {plain:?}");
}
