//! Config semantics to the letter: per-caller rate limits isolate callers
//! (by header, else by client address), `validate` reports every entry's
//! problems in one run, and a reload never adds a provider without its key.

use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::fake::{self, Fake};
use crate::support::*;

// ----- per-caller rate limits -----

/// POSTs a chat request to the gateway from the local address `from` (any
/// 127.0.0.0/8 address works on Linux loopback), with `headers`.
async fn chat_from(gw: &Gw, from: &str, headers: &[(&str, &str)]) -> Answer {
    let mut connector = HttpConnector::new();
    connector.set_local_address(Some(from.parse::<IpAddr>().unwrap()));
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let mut req =
        Request::post(gw.url("/v1/chat/completions")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(hello("gpt-4o").to_string())))
        .unwrap();
    let fut = async {
        let (parts, body) = client.request(req).await.unwrap().into_parts();
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

/// The value of `switchyard_ratelimited_total{scope=...}` (0 if absent).
async fn rate_limited(gw: &Gw, scope: &str) -> f64 {
    let prefix = format!("switchyard_ratelimited_total{{scope=\"{scope}\"}} ");
    get(gw.addr, "/metrics")
        .await
        .text()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// One target `a` answering every request; the task gets `rate_limit`.
async fn limited(rate_limit: &str) -> (Fake, Gw) {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let gw = gateway(&chain_config(
        &[("a", &a.url())],
        "",
        &format!("    rate_limit: {rate_limit}\n"),
    ))
    .await;
    (a, gw)
}

#[tokio::test]
async fn a_caller_over_its_limit_never_gets_another_caller_refused() {
    // The task-wide bucket (4) holds exactly both callers' bursts (2 each):
    // had A's refused requests drawn from it, B would be refused too.
    let (a, gw) =
        limited("{ rps: 0.1, burst: 4, per_caller: { header: x-caller, rps: 0.1, burst: 2 } }")
            .await;
    let mut statuses = Vec::new();
    for _ in 0..10 {
        let ans = chat_from(&gw, "127.0.0.1", &[("x-caller", "alice")]).await;
        if ans.status == 429 {
            let retry: u64 = ans.header("retry-after").parse().unwrap();
            assert!((1..=10).contains(&retry), "{retry}");
        }
        statuses.push(ans.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429, 429, 429, 429, 429]);
    for _ in 0..2 {
        let ans = chat_from(&gw, "127.0.0.1", &[("x-caller", "bob")]).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
    }
    assert_eq!(rate_limited(&gw, "caller").await, 8.0);
    assert_eq!(rate_limited(&gw, "task").await, 0.0);
    assert_eq!(a.calls(), 4);
}

#[tokio::test]
async fn requests_without_the_caller_header_are_limited_per_address() {
    let (_a, gw) = limited("{ per_caller: { header: x-caller, rps: 0.1, burst: 1 } }").await;
    assert_eq!(chat_from(&gw, "127.0.0.1", &[]).await.status, 200);
    let refused = chat_from(&gw, "127.0.0.1", &[]).await;
    assert_eq!(refused.status, 429);
    assert!(!refused.header("retry-after").is_empty());
    assert_eq!(
        chat_from(&gw, "127.0.0.1", &[("x-caller", "")])
            .await
            .status,
        429,
        "an empty header is no header"
    );
    assert_eq!(
        chat_from(&gw, "127.0.0.2", &[]).await.status,
        200,
        "another address has its own bucket"
    );
    assert_eq!(
        chat_from(&gw, "127.0.0.1", &[("x-caller", "127.0.0.1")])
            .await
            .status,
        200,
        "a caller named by the header never shares an address's bucket"
    );
    assert_eq!(rate_limited(&gw, "caller").await, 2.0);
}

#[tokio::test]
async fn the_task_wide_bucket_still_applies_when_set() {
    let (a, gw) =
        limited("{ rps: 0.1, burst: 1, per_caller: { header: x-caller, rps: 100, burst: 100 } }")
            .await;
    assert_eq!(
        chat_from(&gw, "127.0.0.1", &[("x-caller", "alice")])
            .await
            .status,
        200
    );
    let ans = chat_from(&gw, "127.0.0.1", &[("x-caller", "bob")]).await;
    assert_eq!(ans.status, 429, "the task-wide bucket is spent");
    assert_eq!(ans.json()["error"]["type"], "rate_limit_error");
    let retry: u64 = ans.header("retry-after").parse().unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    assert_eq!(rate_limited(&gw, "task").await, 1.0);
    assert_eq!(a.calls(), 1);
}

#[test]
fn the_old_task_level_caller_keys_are_unknown() {
    let text = "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1' }\ntargets:\n  t: { provider: p, model: m }\ntasks:\n  chat:\n    chain: [t]\n    rate_limit: { rps: 1, per_caller_header: x-caller, max_callers: 5 }\n";
    let diags = compile_errors(text);
    let all: Vec<String> = diags.iter().map(ToString::to_string).collect();
    assert_eq!(diags.len(), 2, "{all:#?}");
    assert!(
        all[0].starts_with("9:27:") && all[0].contains("unknown field `per_caller_header`"),
        "{all:#?}"
    );
    assert!(all[1].starts_with("9:56:") && all[1].contains("max_callers"));
    assert!(
        all.iter()
            .all(|d| d.contains("moved to `per_caller: { header, rps, burst, max_callers }`")),
        "{all:#?}"
    );
}

#[test]
fn rate_limit_shapes_that_limit_nothing_or_misplace_burst_are_errors() {
    let base = "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1' }\ntargets:\n  t: { provider: p, model: m }\ntasks:\n  chat:\n    chain: [t]\n";
    for (limit, needle) in [
        ("{}", "needs `rps` (task-wide), `per_caller`, or both"),
        (
            "{ burst: 3, per_caller: { header: x-caller, rps: 1 } }",
            "needs `rps`",
        ),
        (
            "{ per_caller: { header: x-caller, rps: 0 } }",
            "greater than zero",
        ),
        (
            "{ per_caller: { header: 'bad header', rps: 1 } }",
            "bad header name",
        ),
        ("{ rps: 1e-300 }", "too small or too large"),
        (
            "{ per_caller: { header: x-caller, rps: 1e300 } }",
            "too small or too large",
        ),
    ] {
        let text = format!("{base}    rate_limit: {limit}\n");
        let joined: String = compile_errors(&text)
            .iter()
            .map(|d| format!("{d}\n"))
            .collect();
        assert!(
            joined.contains(needle),
            "{limit}: {needle} not in\n{joined}"
        );
    }
}

// ----- validate: every entry's problems in one run -----

/// Line and column (1-based) of the first occurrence of `needle` in `text`.
fn at(text: &str, needle: &str) -> (usize, usize) {
    let offset = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle} not in text"));
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = offset - before.rfind('\n').map_or(0, |n| n + 1) + 1;
    (line, column)
}

fn rendered(diags: &[switchyard::config::diagnostic::Diagnostic]) -> Vec<String> {
    diags.iter().map(ToString::to_string).collect()
}

#[test]
fn wrong_types_in_two_providers_and_an_unknown_target_are_all_reported() {
    let text = "version: 1
providers:
  a:
    base_url: http://127.0.0.1:9/v1
    retry: { max: x }
  b:
    base_url: http://127.0.0.1:9/v1
    headers: [one, two]
targets:
  ta: { provider: a, model: m }
  tb: { provider: b, model: m }
tasks:
  chat: { chain: [ta, tb, nope] }
";
    let diags = compile_errors(text);
    let all = rendered(&diags);
    assert_eq!(diags.len(), 3, "{all:#?}");
    let where_ = |d: &switchyard::config::diagnostic::Diagnostic| (d.line, d.column);
    assert_eq!(where_(&diags[0]), at(text, "max: x"), "{all:#?}");
    assert_eq!(diags[0].path, "providers.a.retry.max");
    assert!(
        diags[0].message.contains("must be a whole number"),
        "{all:#?}"
    );
    assert_eq!(where_(&diags[1]), at(text, "headers"), "{all:#?}");
    assert_eq!(diags[1].path, "providers.b.headers");
    assert!(diags[1].message.contains("must be a mapping"), "{all:#?}");
    assert_eq!(where_(&diags[2]), at(text, "nope"), "{all:#?}");
    assert_eq!(diags[2].path, "tasks.chat.chain[2]");
    assert!(
        diags[2].message.contains("unknown target `nope`"),
        "{all:#?}"
    );
}

#[test]
fn a_provider_whose_base_url_has_the_wrong_type_is_not_also_unknown() {
    let text = "version: 1
providers:
  a:
    base_url: [http://127.0.0.1:9/v1]
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [t], strategy: fastest }
";
    let diags = compile_errors(text);
    let all = rendered(&diags);
    assert_eq!(diags.len(), 2, "{all:#?}");
    assert_eq!((diags[0].line, diags[0].column), at(text, "base_url"));
    assert!(diags[0].message.contains("must be text"), "{all:#?}");
    assert!(
        diags[1].message.contains("unknown strategy `fastest`"),
        "the task is still checked: {all:#?}"
    );
    for bogus in ["unknown provider", "missing field", "unknown target"] {
        assert!(!all.iter().any(|d| d.contains(bogus)), "{bogus}: {all:#?}");
    }
}

#[test]
fn a_field_really_missing_is_reported_once_and_its_entry_is_not_unknown() {
    let text = "version: 1
providers:
  a: { timeout: 2s }
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [t] }
";
    let all = rendered(&compile_errors(text));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("3:3:") && all[0].contains("missing field `base_url`"),
        "{all:#?}"
    );
}

#[test]
fn a_bad_base_url_is_reported_once() {
    for url in ["3", "not a url", "ftp://host/v1", "http://"] {
        let text = format!(
            "version: 1
providers:
  a: {{ base_url: '{url}' }}
targets:
  t: {{ provider: a, model: m }}
tasks:
  chat: {{ chain: [t] }}
"
        );
        let all = rendered(&compile_errors(&text));
        assert_eq!(all.len(), 1, "{url}: {all:#?}");
        assert!(
            all[0].starts_with("3:18:") && all[0].contains("bad URL"),
            "{all:#?}"
        );
    }
}

#[test]
fn a_bucket_of_zero_is_refused_where_it_is_written() {
    let text = "version: 1
providers:
  a:
    base_url: 'http://127.0.0.1:9/v1'
    rate_limit: { rpm: 60, burst: 0 }
    keys: [{ name: k1, env: K1, rate_limit: { rpm: 10, burst: 0 } }]
targets:
  t: { provider: a, model: m }
tasks:
  chat:
    chain: [t]
    rate_limit: { rps: 1, burst: 0, per_caller: { header: x-caller, rps: 1, burst: 0 } }
";
    let all = rendered(&compile_errors(text));
    let at = |path: &str| {
        all.iter()
            .any(|d| d.contains("burst must be at least 1") && d.contains(&format!("(at {path})")))
    };
    for path in [
        "providers.a.rate_limit.burst",
        "providers.a.keys[0].rate_limit.burst",
        "tasks.chat.rate_limit.burst",
        "tasks.chat.rate_limit.per_caller.burst",
    ] {
        assert!(at(path), "{path}: {all:#?}");
    }
}

#[test]
fn a_byte_order_mark_is_no_column_and_no_second_document() {
    let body = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [t] }
";
    let with_bom = format!("\u{feff}{body}");
    let parsed = switchyard::config::parse(&with_bom).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        &with_bom,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    );
    assert!(compiled.is_ok(), "{:#?}", compiled.err());
    // Locations on the first line are the editor's, as without the mark.
    let broken = format!("\u{feff}version: 2\n{}", &body["version: 1\n".len()..]);
    let all = rendered(&compile_errors(&broken));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(all[0].starts_with("1:10:"), "{all:#?}");
}

#[test]
fn list_items_after_a_removed_one_keep_their_own_locations() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [{ t: 1 }, nope], aliases: [7, ok, also-ok], budget: { max_failovers: lots } }
error_classes:
  - { match: { status: 500 }, action: [failover] }
  - { match: { status: 7xx }, action: failover }
";
    let diags = compile_errors(text);
    let all = rendered(&diags);
    let find = |needle: &str| {
        diags
            .iter()
            .find(|d| d.message.contains(needle))
            .unwrap_or_else(|| panic!("{needle}: {all:#?}"))
    };
    let nope = find("unknown target `nope`");
    assert_eq!((nope.line, nope.column), at(text, "nope"), "{all:#?}");
    assert_eq!(nope.path, "tasks.chat.chain[1]");
    let status = find("bad status `7xx`");
    assert_eq!((status.line, status.column), at(text, "7xx"), "{all:#?}");
    assert_eq!(status.path, "error_classes[1].match.status");
    let item = find("must be text, not a mapping");
    assert_eq!(item.path, "tasks.chat.chain[0]", "{all:#?}");
    assert_eq!((item.line, item.column), at(text, "{ t: 1 }"), "{all:#?}");
    let action = find("must be text, not a list");
    assert_eq!(action.path, "error_classes[0].action", "{all:#?}");
    assert_eq!(
        (action.line, action.column),
        at(text, "action: [failover]"),
        "{all:#?}"
    );
    assert!(
        all.iter().any(|d| d.contains("(at tasks.chat.aliases[0])")),
        "{all:#?}"
    );
    assert!(
        all.iter()
            .any(|d| d.contains("(at tasks.chat.budget.max_failovers)")),
        "{all:#?}"
    );
    assert!(
        !all.iter()
            .any(|d| d.contains("empty degradation chain") || d.contains("missing field")),
        "{all:#?}"
    );
    assert_eq!(diags.len(), 6, "{all:#?}");
}

/// Issue 18d: a value of the wrong type is said in the user's words (not
/// serde's `invalid type: ..., expected u32`) and located at its key, also
/// when the value stands on another line.
#[test]
fn type_errors_say_what_the_value_must_be_at_its_key() {
    let text = "version: 1
max_concurrent_requests: lots
providers:
  a:
    base_url: http://127.0.0.1:9/v1
    timeout:
      - 30
    retry:
      max: -1
    headers: [x]
targets:
  t:
    provider: a
    model:
      - m
    capabilities: tools
    max_context: 1.5
    cost: { input_per_1k: cheap, output_per_1k: 1 }
tasks:
  chat:
    chain: [t]
    budget: 5
    stream_recovery: { seam_comment: maybe }
telemetry: { access_log: 'yes' }
";
    let diags = compile_errors(text);
    let all = rendered(&diags);
    let cases = [
        (
            "max_concurrent_requests",
            "max_concurrent_requests:",
            "must be a whole number (0 or more), not \"lots\"",
        ),
        (
            "providers.a.timeout",
            "timeout:",
            "must be a duration like `30s`",
        ),
        (
            "providers.a.retry.max",
            "max: -1",
            "must be a whole number from 0 to 4294967295, not -1",
        ),
        (
            "providers.a.headers",
            "headers:",
            "must be a mapping of keys",
        ),
        ("targets.t.model", "model:", "must be text"),
        ("targets.t.capabilities", "capabilities:", "must be a list"),
        (
            "targets.t.max_context",
            "max_context:",
            "must be a whole number (0 or more), not 1.5",
        ),
        (
            "targets.t.cost.input_per_1k",
            "input_per_1k",
            "must be a number, not \"cheap\"",
        ),
        ("tasks.chat.budget", "budget:", "must be a mapping of keys"),
        (
            "tasks.chat.stream_recovery.seam_comment",
            "seam_comment",
            "must be true or false, not \"maybe\"",
        ),
        (
            "telemetry.access_log",
            "access_log",
            "must be true or false",
        ),
    ];
    for (path, key, words) in cases {
        let d = diags
            .iter()
            .find(|d| d.path == path)
            .unwrap_or_else(|| panic!("{path}: {all:#?}"));
        assert!(d.message.contains(words), "{path}: {words} not in {all:#?}");
        assert_eq!((d.line, d.column), at(text, key), "{path}: {all:#?}");
    }
    for serde_words in ["invalid type", "invalid value", "expected u", "untagged"] {
        assert!(
            !all.iter().any(|d| d.contains(serde_words)),
            "{serde_words}: {all:#?}"
        );
    }
}

/// Issue 14b: capabilities are a closed set. An unknown tag (`streaming`:
/// every target streams) is refused at the tag, in a target's
/// `capabilities` and in a task's `requires`, naming the valid ones; and a
/// required capability that no target of the chain has is refused, since
/// it would exclude every target at runtime.
#[test]
fn unknown_and_unsatisfiable_capabilities_are_refused_at_the_tag() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: a, model: m, capabilities: [tools, streaming] }
  u: { provider: a, model: m2, capabilities: [tools] }
tasks:
  chat: { chain: [t, u], requires: [streaming] }
  json: { chain: [t, u], requires: [tools, json_mode] }
  fine: { chain: [t, u], requires: [tools] }
";
    let diags = compile_errors(text);
    let all = rendered(&diags);
    assert_eq!(diags.len(), 3, "{all:#?}");
    let find = |path: &str| {
        diags
            .iter()
            .find(|d| d.path == path)
            .unwrap_or_else(|| panic!("{path}: {all:#?}"))
    };
    let declared = find("targets.t.capabilities[1]");
    assert_eq!((declared.line, declared.column), at(text, "streaming] }"));
    let required = find("tasks.chat.requires[0]");
    let (line, column) = at(text, "requires: [streaming]");
    assert_eq!((required.line, required.column), (line, column + 11));
    for d in [declared, required] {
        assert!(
            d.message.contains("unknown capability `streaming`"),
            "{all:#?}"
        );
        assert!(
            d.message.contains("tools, json_mode, vision, prefill"),
            "{all:#?}"
        );
        assert_eq!(d.severity, switchyard::config::diagnostic::Severity::Error);
    }
    let unmet = find("tasks.json.requires[1]");
    let (line, column) = at(text, "json_mode] }");
    assert_eq!((unmet.line, unmet.column), (line, column), "{all:#?}");
    assert!(
        unmet
            .message
            .contains("no target in the chain (t, u) has capability `json_mode`"),
        "{all:#?}"
    );
    assert_eq!(
        unmet.severity,
        switchyard::config::diagnostic::Severity::Error
    );
}

/// Issue 18a: a YAML syntax error is said in the user's words, at the line
/// that is wrong (the parser often stops a line or more later), for each
/// kind of mistake: indentation, a tab, an unclosed quote or bracket, a
/// stray bracket, a list item among keys, a duplicate key.
#[test]
fn syntax_errors_are_said_in_words_at_the_line_that_is_wrong() {
    let head = "version: 1\nproviders:\n  a:\n    base_url: http://127.0.0.1:9/v1\n";
    let cases: &[(&str, &str, &str)] = &[
        // (the rest of the file, what is wrong (located), words)
        (
            "     timeout: 2s\ntasks: {}\n",
            "     timeout",
            "indented more than the keys around it",
        ),
        (
            "   timeout: 2s\ntasks: {}\n",
            "   timeout",
            "indented differently from the keys around it",
        ),
        (
            "\n    # a comment\n      timeout: 2s\ntasks: {}\n",
            "      timeout",
            "indented more than the keys around it",
        ),
        (
            "    headers:\n      x-a: '1'\n     x-b: '2'\ntasks: {}\n",
            "     x-b",
            "indented differently from the keys around it",
        ),
        (
            "\ttimeout: 2s\ntasks: {}\n",
            "\ttimeout",
            "indented with a tab",
        ),
        ("    timeout:\t2s\ntasks: {}\n", "\t2s", "a tab follows `:`"),
        (
            "    timeout: \"2s\ntasks: {}\n",
            "\"2s",
            "quoted value is never closed",
        ),
        (
            "    headers: { x-a: '1'\ntasks: {}\n",
            "{ x-a",
            "this `{` is never closed",
        ),
        (
            "tasks:\n  chat:\n    chain: [a, b\n    strategy: cost\n",
            "[a, b",
            "this `[` is never closed",
        ),
        (
            "tasks:\n  chat:\n    chain: [a, b]]\n",
            "]\n",
            "this `]` closes nothing",
        ),
        (
            "tasks:\n  chat: { chain: [a, b }\n",
            "[a, b",
            "this `[` is never closed: add `]` before the `}`",
        ),
        ("  - b\n", "- b", "a list item (`- ...`) among the keys"),
        ("    model: a: b\n", ": b", "put the value in quotes"),
        (
            "    timeout:60s\n    retry: { max: 1 }\n  b:\n    base_url: http://x\ntasks: {}\n",
            ":60s",
            "this `:` has no space after it, so YAML reads `timeout:60s` as one word",
        ),
        (
            "    retry: { max: 1 }\n  timeout: 2s\n    connect_timeout: 1s\ntasks: {}\n",
            "  timeout",
            "indented less than the keys around it (2 spaces, where the lines above and below it have 4)",
        ),
        (
            "    base_url: http://x\n",
            "base_url: http://x",
            "duplicate key `base_url`: it is written already on line 4",
        ),
    ];
    for &(rest, wrong, words) in cases {
        let text = format!("{head}{rest}");
        let diags = switchyard::config::parse(&text).unwrap_err();
        let all = rendered(&diags);
        assert_eq!(diags.len(), 1, "{text}\n{all:#?}");
        let (line, column) = at(&text, wrong);
        let column = column + wrong.len() - wrong.trim_start_matches([' ', '\n']).len();
        assert_eq!(
            (diags[0].line, diags[0].column),
            (line, column),
            "{text}\n{all:#?}"
        );
        assert!(diags[0].message.contains(words), "{text}\n{all:#?}");
        for raw in [
            "mapping values are not allowed",
            "did not find expected",
            "while parsing",
            "while scanning",
            "invalid indentation",
        ] {
            assert!(!diags[0].message.contains(raw), "{text}\n{all:#?}");
        }
    }
}

/// Issue 18a: a syntax error does not stop the other checks. The offending
/// line (with what is indented under it) is left out and the file read
/// again: further syntax errors, and the unknown keys and wrongly typed
/// values of the rest, are reported in the same run; nothing is said about
/// the entry that held a left-out line.
#[test]
fn a_syntax_error_does_not_hide_the_rest_of_the_file() {
    let text = "version: 1
max_concurrent_requests: lots
providers:
  a:
    base_url: http://127.0.0.1:9/v1
     timeout: 2s
    retry: { max: x }
  b:
    base_url: http://127.0.0.1:9/v1
    retry: { max: y }
targets:
\tt: { provider: a, model: m }
  u: { provider: a, model: m, weight: lots, colour: red }
tasks:
  chat:
    chain: [t, \"u]
    strategy: fastest
  other: { chain: [t] }
  other: { chain: [u] }
";
    let diags = switchyard::config::parse(text).unwrap_err();
    let all = rendered(&diags);
    let expected = [
        ("max_concurrent_requests: lots", "must be a whole number"),
        ("     timeout", "indented more than the keys around it"),
        ("max: y", "must be a whole number"),
        ("\tt:", "indented with a tab"),
        ("weight: lots", "must be a whole number"),
        ("colour", "unknown field `colour`"),
        ("\"u]", "quoted value is never closed"),
        ("other: { chain: [u] }", "duplicate key `other`"),
    ];
    assert_eq!(diags.len(), expected.len(), "{all:#?}");
    for (d, (wrong, words)) in diags.iter().zip(expected) {
        let (line, column) = at(text, wrong);
        let column = column + wrong.len() - wrong.trim_start_matches(' ').len();
        assert_eq!((d.line, d.column), (line, column), "{wrong}: {all:#?}");
        assert!(d.message.contains(words), "{wrong}: {all:#?}");
    }
}

// ----- reload: never add a provider without its key -----

/// The value of `switchyard_config_reloads_total{result=...}` (0 if absent).
async fn reloads(gw: &Gw, result: &str) -> f64 {
    let prefix = format!("switchyard_config_reloads_total{{result=\"{result}\"}} ");
    get(gw.addr, "/metrics")
        .await
        .text()
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A file with targets `a` (on `p-a`) and, if `b_key_env` is given, `b` on
/// `p-b` reading its key from that variable; task `chat` with `chain`.
/// routes.yaml with provider `p-a` and, if `b_key` is given (a key line such
/// as `api_key_env: VAR`), provider `p-b` with that key.
fn keyed(a: &Fake, b: &Fake, b_key: Option<&str>, chain: &str) -> String {
    let mut y = format!(
        "version: 1\nproviders:\n  p-a: {{ base_url: '{}', timeout: 2s }}\n",
        a.url()
    );
    if let Some(key) = b_key {
        y.push_str(&format!("  p-b:\n    base_url: '{}'\n    {key}\n", b.url()));
    }
    y.push_str("targets:\n  a: { provider: p-a, model: upstream-a }\n");
    if b_key.is_some() {
        y.push_str("  b: { provider: p-b, model: upstream-b }\n");
    }
    y.push_str(&format!(
        "tasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [{chain}]\n"
    ));
    y
}

const UNSET_KEY: &str = "SWITCHYARD_CONFIG_SEMANTICS_UNSET_KEY";
const UNSET_KEY_LINE: &str = "api_key_env: SWITCHYARD_CONFIG_SEMANTICS_UNSET_KEY";

#[tokio::test]
async fn a_reload_adding_a_provider_whose_key_cannot_be_read_is_refused() {
    assert!(std::env::var_os(UNSET_KEY).is_none());
    let text = reload_refused_for_new_key(UNSET_KEY_LINE, "api_key_env").await;
    assert!(text.contains(UNSET_KEY), "{text}");
}

#[tokio::test]
async fn a_reload_adding_a_provider_whose_key_file_is_missing_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not-mounted-yet");
    let line = format!("api_key_file: '{}'", missing.display());
    let text = reload_refused_for_new_key(&line, "api_key_file").await;
    assert!(text.contains("not-mounted-yet"), "{text}");
}

/// Rewrites a one-provider config to add `p-b` with `key_line` (a key it
/// cannot read) first in the chain, checks that the reload is refused and
/// the old chain keeps serving, and returns the one diagnostic, rendered.
async fn reload_refused_for_new_key(key_line: &str, field: &str) -> String {
    let a = Fake::always(fake::completion("upstream-a", "from a")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let gw = gateway(&keyed(&a, &b, None, "a")).await;
    let before = reloads(&gw, "error").await;
    let text = keyed(&a, &b, Some(key_line), "b, a");
    gw.rewrite(&text);
    let mut refused = false;
    for _ in 0..150 {
        if reloads(&gw, "error").await > before {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused, "the reload was not refused within 3 s");
    for _ in 0..3 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "a");
        assert_eq!(ans.header("x-switchyard-attempts"), "1");
    }
    assert_eq!(b.calls(), 0, "the new chain never served");
    assert!(!gw.app.snapshot.load().providers.contains_key("p-b"));
    // What the reload logged, one line per diagnostic.
    let diags = switchyard::reload::prepare(&gw.app).unwrap_err();
    let all = rendered(&diags);
    assert_eq!(diags.len(), 1, "{all:#?}");
    assert_eq!(diags[0].path, format!("providers.p-b.{field}"));
    let value = key_line.split_once(": ").map_or(key_line, |(_, v)| v);
    assert_eq!((diags[0].line, diags[0].column), at(&text, value));
    assert!(
        diags[0]
            .message
            .contains("of the new provider `p-b` cannot be read")
            && diags[0].message.contains("keeping the old config"),
        "{all:#?}"
    );
    diags[0].message.clone()
}

#[tokio::test]
async fn a_provider_without_its_key_since_the_start_does_not_block_reloads() {
    let a = Fake::always(fake::completion("upstream-a", "from a")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    // At start an unreadable key is only a warning (and its provider is
    // skipped, never called keyless).
    let gw = gateway(&keyed(&a, &b, Some(UNSET_KEY_LINE), "b, a")).await;
    assert_eq!(
        chat(gw.addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "a"
    );
    assert_eq!(b.calls(), 0);
    gw.rewrite(&keyed(&a, &b, Some(UNSET_KEY_LINE), "a, b"));
    let mut applied = false;
    for _ in 0..150 {
        if reloads(&gw, "ok").await >= 2.0 {
            applied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(applied, "the reload was not applied within 3 s");
    assert_eq!(reloads(&gw, "error").await, 0.0);
}

/// A duration the parser cannot read is said in words, not as the
/// library's byte offsets.
#[test]
fn a_bad_duration_says_what_is_wrong_in_words() {
    for (value, words) in [
        ("lots", "a number is missing"),
        ("60", "the unit is missing"),
        ("5 parsecs", "`parsecs` is not a unit"),
    ] {
        let text = format!(
            "version: 1\nproviders:\n  a: {{ base_url: 'http://127.0.0.1:9/v1', timeout: '{value}' }}\ntargets:\n  t: {{ provider: a, model: m }}\ntasks:\n  chat: {{ chain: [t] }}\n"
        );
        let diags = compile_errors(&text);
        let all = rendered(&diags);
        assert!(
            all.iter()
                .any(|d| d.contains(words) && d.contains("like `500ms`")),
            "{value}: {all:#?}"
        );
        assert!(
            !all.iter()
                .any(|d| d.contains(" at 0") || d.contains("expected number")),
            "{all:#?}"
        );
    }
}

/// Numbers too large are said so in words at their key, and the rest of the
/// file is still checked (found by an adversarial run: a huge `max_context`
/// was a parser message called a syntax error that hid everything else).
#[test]
fn numbers_too_large_are_said_in_words() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: a, model: m, max_context: 99999999999999999999 }
tasks:
  chat: { chain: [t], budget: { max_failovers: 99999999999 } }
  other: { chain: [t], colour: red }
";
    let diags = match switchyard::config::parse(text) {
        Err(d) => d,
        Ok(_) => compile_errors(text),
    };
    let all = rendered(&diags);
    let joined = all.join("\n");
    assert!(
        joined.contains("5:44: error: this number is too large"),
        "{joined}"
    );
    assert!(
        !joined.contains("u128") && !joined.contains("any YAML value"),
        "{joined}"
    );
    assert!(
        joined.contains("from 0 to 4294967295, not 99999999999"),
        "{joined}"
    );
    assert!(
        joined.contains("colour"),
        "the rest is still checked: {joined}"
    );
}

/// A name with a control character would break metric labels and logs.
#[test]
fn a_name_with_a_control_character_is_refused() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  \"t\\r\": { provider: a, model: m }
tasks:
  chat: { chain: [\"t\\r\"] }
";
    let all = rendered(&compile_errors(text));
    assert!(
        all.iter()
            .any(|d| d.starts_with("5:3:") && d.contains("control character")),
        "{all:#?}"
    );
}

/// Only a batch task queues.
#[test]
fn a_queue_needs_a_batch_task() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [t], queue: { max_wait: 5s } }
";
    let all = rendered(&compile_errors(text));
    assert!(
        all.iter()
            .any(|d| d.contains("only a `priority: batch` task waits in a queue")),
        "{all:#?}"
    );
}

/// A reserve that, rounded up, keeps a small bucket whole is said so.
#[test]
fn a_reserve_that_keeps_the_whole_bucket_is_a_warning() {
    let text = "version: 1
providers:
  a: { base_url: 'http://127.0.0.1:9/v1', rate_limit: { rpm: 60, burst: 2, reserve: 0.6 } }
targets:
  t: { provider: a, model: m }
tasks:
  chat: { chain: [t] }
";
    let parsed = switchyard::config::parse(text).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        text,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    );
    let Ok(compiled) = compiled else {
        panic!("a warning, not an error")
    };
    assert!(
        compiled
            .warnings
            .iter()
            .any(|w| w.message.contains("keeps all 2 of the bucket")),
        "{:?}",
        compiled.warnings
    );
}

#[test]
fn a_responses_road_is_for_openai_providers_only() {
    let text = |protocol: &str| {
        format!("version: 1\nproviders:\n  p: {{ base_url: 'http://127.0.0.1:9/v1', protocol: {protocol}, responses: true }}\ntargets:\n  t: {{ provider: p, model: m }}\ntasks:\n  chat:\n    chain: [t]\n")
    };
    let openai = text("openai");
    let parsed = switchyard::config::parse(&openai).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        &openai,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    );
    assert!(compiled.is_ok());
    let diags = compile_errors(&text("anthropic"));
    let all: Vec<String> = diags.iter().map(ToString::to_string).collect();
    assert_eq!(diags.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("3:") && all[0].contains("`responses: true` is for `protocol: openai`"),
        "{all:#?}"
    );
}

#[test]
fn status_keyed_messages_read_alike_beside_a_type_error_elsewhere() {
    let yaml = routes(
        &[hop("a", "http://127.0.0.1:9").provider("retry: { max: x }")],
        "",
        "sanitize: { messages: { 503: busy, 200: hi } }\n",
    );
    let errors = compile_errors(&yaml);
    let paths: Vec<&str> = errors.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(
        paths,
        ["providers.p-a.retry.max", "sanitize.messages.200"],
        "{errors:?}"
    );
    assert!(
        errors[1].message.contains("not an HTTP error status"),
        "{errors:?}"
    );
}
