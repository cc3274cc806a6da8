//! Traces and the access log, from the real binary: `switchyard serve` with
//! the standard `OTEL_*` variables pointed at an in-process collector
//! (`support::otlp`). Each test has its own process, collector and request
//! ids, so nothing here races another test's spans.

use std::time::Duration;

use crate::binary::Served;
use crate::support::fake::{self, Fake, Reply};
use crate::support::otlp::{BlackHole, Collector, Trace, KIND_CLIENT, KIND_SERVER, STATUS_ERROR};
use crate::support::*;

/// A traceparent a caller could send: trace id, its span id, sampled.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// `switchyard serve` on `yaml`, exporting to `endpoint` every 20 ms.
fn serve(
    yaml: &str,
    endpoint: &str,
    args: &[&str],
    extra: &[(&str, &str)],
) -> (Served, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let mut envs = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "20"),
        ("RUST_LOG", "info"),
    ];
    envs.extend_from_slice(extra);
    let served = Served::start_with(&config, dir.path(), args, &envs);
    (served, dir)
}

/// POSTs `body` with `x-request-id: id` (and more headers).
async fn send(served: &Served, id: &str, body: serde_json::Value, more: &[(&str, &str)]) -> Answer {
    let mut headers = vec![("x-request-id", id)];
    headers.extend_from_slice(more);
    post_raw(
        served.addr,
        "/v1/chat/completions",
        body.to_string(),
        &headers,
    )
    .await
}

fn reply_with_id(status: u16, body: &str, upstream_id: &str) -> Reply {
    Reply::Json {
        status,
        body: body.to_owned(),
        headers: vec![("x-request-id".to_owned(), upstream_id.to_owned())],
    }
}

/// The server span's attributes every request has.
fn assert_server(t: &Trace, status: i64, attempts: i64, failovers: i64) {
    let s = &t.server;
    assert_eq!(s.kind, KIND_SERVER, "{s:#?}");
    assert_eq!(s.name, "chat gpt-4o");
    assert_eq!(s.text("gen_ai.operation.name"), "chat");
    assert_eq!(s.text("gen_ai.request.model"), "gpt-4o");
    assert_eq!(s.text("switchyard.task"), "chat");
    assert_eq!(s.attr("http.response.status_code"), status);
    assert_eq!(s.attr("switchyard.attempts"), attempts);
    assert_eq!(s.attr("switchyard.failovers"), failovers);
    assert_eq!(s.resource["service.name"], "switchyard");
    for a in &t.attempts {
        assert_eq!(a.kind, KIND_CLIENT, "{a:#?}");
        assert_eq!(a.trace_id, s.trace_id);
        assert_eq!(a.text("gen_ai.operation.name"), "chat");
        assert_eq!(a.text("gen_ai.provider.name"), "openai");
        assert_eq!(a.text("server.address"), "127.0.0.1");
    }
    assert_eq!(t.attempts.len() as i64, attempts, "{:#?}", t.attempts);
}

/// The traceparent the upstream got: (trace id, parent span id).
fn upstream_parent(seen: &fake::Seen) -> (String, String) {
    let tp = seen.headers["traceparent"].to_str().unwrap().to_owned();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!(parts[0], "00", "{tp}");
    (parts[1].to_owned(), parts[2].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_success_is_one_server_span_over_one_attempt() {
    let collector = Collector::start().await;
    let body = fake::completion_json("model-a-2024", "hi", 2);
    let a = Fake::always(reply_with_id(200, &body, "up-req-1")).await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let ans = send(&served, "t-direct", hello("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());

    let t = collector.trace_of("t-direct", 1).await;
    assert_server(&t, 200, 1, 0);
    let s = &t.server;
    assert!(s.parent_span_id.is_empty(), "no caller trace: a root span");
    assert_eq!(s.text("gen_ai.response.model"), "model-a-2024");
    assert_eq!(s.attr("gen_ai.usage.input_tokens"), 5);
    assert_eq!(s.attr("gen_ai.usage.output_tokens"), 2);
    assert_eq!(
        s.attr("gen_ai.response.finish_reasons"),
        serde_json::json!(["stop"])
    );
    assert_eq!(s.text("switchyard.target"), "a");
    assert_eq!(s.attr("switchyard.degraded"), false);
    assert_eq!(s.text("switchyard.upstream.request_id"), "up-req-1");
    assert_ne!(s.status_code, STATUS_ERROR);
    let a1 = &t.attempts[0];
    assert_eq!(a1.name, "chat upstream-a");
    assert_eq!(a1.text("gen_ai.request.model"), "upstream-a");
    assert_eq!(a1.text("gen_ai.response.model"), "model-a-2024");
    assert_eq!(a1.attr("switchyard.attempt"), 1);
    assert_eq!(a1.text("switchyard.target"), "a");
    assert_eq!(a1.text("switchyard.outcome"), "success");
    assert_eq!(a1.text("switchyard.upstream.request_id"), "up-req-1");
    assert_eq!(a1.attr("http.response.status_code"), 200);
    assert_eq!(a1.attr("gen_ai.usage.output_tokens"), 2);
    assert!(
        a1.start_ns >= s.start_ns && a1.end_ns <= s.end_ns,
        "{a1:#?} in {s:#?}"
    );
    // The upstream's parent is the attempt span, in the same trace.
    let (trace, parent) = upstream_parent(&a.seen()[0]);
    assert_eq!((trace, parent), (s.trace_id.clone(), a1.span_id.clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_then_a_failover_shows_each_attempt_with_its_rule_and_action() {
    let collector = Collector::start().await;
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::completion("model-b", "from b")).await;
    let yaml = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "");
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let ans = send(&served, "t-failover", hello("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());

    let t = collector.trace_of("t-failover", 3).await;
    assert_server(&t, 200, 3, 1);
    assert_eq!(t.server.text("switchyard.target"), "b");
    assert_eq!(t.server.attr("switchyard.degraded"), true);
    let actions: Vec<(String, String, String, serde_json::Value)> = t
        .attempts
        .iter()
        .map(|s| {
            (
                s.text("switchyard.target"),
                s.text("switchyard.rule"),
                s.text("switchyard.action"),
                s.attr("http.response.status_code"),
            )
        })
        .collect();
    let rule = "default:5xx-transient".to_owned();
    assert_eq!(
        actions,
        vec![
            ("a".into(), rule.clone(), "retry".into(), 503.into()),
            ("a".into(), rule, "failover".into(), 503.into()),
            ("b".into(), String::new(), String::new(), 200.into()),
        ]
    );
    for failed in &t.attempts[..2] {
        assert_eq!(failed.text("error.type"), "5xx");
        assert_eq!(failed.status_code, STATUS_ERROR);
    }
    let failovers = t.server.events_named("failover");
    assert_eq!(failovers.len(), 1, "{:#?}", t.server.events);
    assert_eq!(failovers[0]["switchyard.from"], "a");
    assert_eq!(failovers[0]["switchyard.to"], "b");
    assert_eq!(failovers[0]["switchyard.reason"], "5xx");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_400_is_returned_not_a_server_error() {
    let collector = Collector::start().await;
    let a = Fake::always(fake::error(400, "bad prompt")).await;
    let b = Fake::always(fake::completion("model-b", "unused")).await;
    let yaml = chain_config(&[("a", &a.url()), ("b", &b.url())], "", "");
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let ans = send(&served, "t-400", hello("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert_eq!(b.calls(), 0);

    let t = collector.trace_of("t-400", 1).await;
    assert_server(&t, 400, 1, 0);
    assert_eq!(t.server.text("error.type"), "400");
    assert_ne!(
        t.server.status_code, STATUS_ERROR,
        "the caller's error is not the server's"
    );
    let a1 = &t.attempts[0];
    assert_eq!(a1.text("switchyard.action"), "return");
    assert_eq!(a1.text("switchyard.rule"), "default:client-error");
    assert_eq!(a1.text("error.type"), "4xx");
    assert_eq!(a1.attr("http.response.status_code"), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_records_its_time_to_first_token_and_its_end() {
    let collector = Collector::start().await;
    let a = Fake::always(Reply::Stream {
        pieces: fake::sse_events("model-s", &["Hello", " there"]),
        delay: Duration::from_millis(60),
        cut: false,
    })
    .await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let ans = send(&served, "t-stream", hello_stream("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert!(ans.text().contains("[DONE]"));

    let t = collector.trace_of("t-stream", 1).await;
    assert_server(&t, 200, 1, 0);
    let s = &t.server;
    let ttft = s
        .attr("switchyard.time_to_first_token_ms")
        .as_f64()
        .unwrap();
    let total = (s.end_ns - s.start_ns) as f64 / 1e6;
    // The role chunk and the first word each wait 60 ms; the rest 3 × 60 ms more.
    assert!(ttft >= 100.0, "ttft {ttft} ms");
    assert!(
        total >= ttft + 100.0,
        "span {total} ms, ttft {ttft} ms: the span covers the stream"
    );
    assert_eq!(s.attr("switchyard.stream"), true);
    assert_eq!(s.text("switchyard.stream.end"), "complete");
    assert_eq!(s.text("gen_ai.response.model"), "model-s");
    assert_eq!(
        s.attr("gen_ai.response.finish_reasons"),
        serde_json::json!(["stop"])
    );
    let a1 = &t.attempts[0];
    let commit = a1.events_named("commit");
    assert_eq!(commit.len(), 1, "{:#?}", a1.events);
    assert_eq!(a1.text("switchyard.stream.end"), "complete");
    assert!(
        a1.end_ns >= s.end_ns - 50_000_000,
        "the attempt span lasts to the stream's end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incoming_traceparent_is_the_parent_and_goes_upstream() {
    let collector = Collector::start().await;
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let more = [
        ("traceparent", traceparent.as_str()),
        ("tracestate", "vendor=abc"),
    ];
    let ans = send(&served, "t-parent", hello("gpt-4o"), &more).await;
    assert_eq!(ans.status, 200, "{}", ans.text());

    let t = collector.trace_of("t-parent", 1).await;
    assert_eq!(t.server.trace_id, CALLER_TRACE);
    assert_eq!(t.server.parent_span_id, CALLER_SPAN);
    let seen = &a.seen()[0];
    let (trace, parent) = upstream_parent(seen);
    assert_eq!(trace, CALLER_TRACE);
    assert_eq!(parent, t.attempts[0].span_id);
    assert_eq!(seen.headers["tracestate"], "vendor=abc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_go_over_grpc_too() {
    let collector = Collector::start().await;
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let grpc = [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_SERVICE_NAME", "sidecar-7"),
    ];
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &grpc);
    let ans = send(&served, "t-grpc", hello("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let t = collector.trace_of("t-grpc", 1).await;
    assert_eq!(t.server.via, "grpc");
    assert_eq!(t.server.resource["service.name"], "sidecar-7");
    assert_eq!(t.attempts[0].text("switchyard.outcome"), "success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skipped_targets_are_events_with_their_reason() {
    let collector = Collector::start().await;
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let b = Fake::always(fake::completion("model-b", "hi")).await;
    // `a` cannot take the request (no `tools` capability): excluded, never called.
    let yaml = routes(
        &[
            hop("a", &a.url()),
            hop("b", &b.url()).target("capabilities: [tools]"),
        ],
        "",
        "",
    );
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let body = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    let ans = send(&served, "t-skip", body, &[]).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let t = collector.trace_of("t-skip", 1).await;
    let skips = t.server.events_named("skip");
    assert_eq!(skips.len(), 1, "{:#?}", t.server.events);
    assert_eq!(skips[0]["switchyard.target"], "a");
    assert_eq!(skips[0]["switchyard.skip_reason"], "capability");
    assert_eq!(t.attempts[0].text("switchyard.target"), "b");
}

/// The binary serving `yaml` with `--log-format json` (and the directory
/// that holds the file, to keep while it runs).
fn json_logging(yaml: &str) -> (Served, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let served = Served::start_with(&config, dir.path(), &["--log-format", "json"], &[]);
    (served, dir)
}

/// The JSON access-log lines in a `--log-format json` stderr.
fn access_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "switchyard::access")
        .map(|v| v["fields"].clone())
        .collect()
}

/// The access line names the targets left out without a call, and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_names_the_targets_skipped_and_why() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let yaml = routes(
        &[
            hop("a", &a.url()),
            hop("b", &b.url()).target("capabilities: [tools]"),
        ],
        "",
        "",
    );
    let (served, _dir) = json_logging(&yaml);
    let body = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    let ans = send(&served, "log-skip", body, &[]).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    let plain = send(
        &served,
        "log-plain",
        serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
        &[],
    )
    .await;
    assert_eq!(plain.status, 200);
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 2
    });
    assert!(written, "{}", served.log());
    assert_eq!(lines[0]["skipped"], "a:capability", "{lines:#?}");
    assert!(
        lines[1].get("skipped").is_none(),
        "nothing skipped: {lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_one_line_per_request_and_no_text() {
    let a = Fake::start(|n, _| match n {
        0 => fake::completion("model-a-v2", "SECRET-COMPLETION-TEXT"),
        _ => fake::error(503, "down"),
    })
    .await;
    let yaml = routes(
        &[hop("a", &a.url()).provider("retry: { max: 0 }")],
        "",
        "telemetry:\n  access_log: true\n",
    );
    let (served, _dir) = json_logging(&yaml);
    let prompt = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "SECRET-PROMPT-TEXT"}]});
    let ok = send(&served, "log-ok", prompt.clone(), &[]).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let failed = send(&served, "log-fail", prompt, &[]).await;
    assert_eq!(failed.status, 502, "{}", failed.text());
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 2
    });
    assert!(written, "{}", served.log());
    assert_eq!(lines.len(), 2, "{lines:#?}");

    let ok = &lines[0];
    assert_eq!(ok["message"], "request");
    assert_eq!(ok["request_id"], "log-ok");
    assert_eq!(ok["task"], "chat");
    assert_eq!(ok["target"], "a");
    assert_eq!(ok["provider"], "p-a");
    assert_eq!(ok["status"], 200);
    assert_eq!(ok["attempts"], 1);
    assert_eq!(ok["failovers"], 0);
    assert_eq!(ok["degraded"], false);
    assert_eq!(ok["stream"], false);
    assert_eq!(ok["tokens_in"], 5);
    assert_eq!(ok["tokens_out"], 2);
    assert_eq!(ok["cost_usd"], 0.0);
    assert_eq!(ok["model"], "model-a-v2");
    assert!(ok["duration_ms"].as_f64().unwrap() > 0.0, "{ok}");
    assert!(
        ok.get("error").is_none() && ok.get("trace_id").is_none(),
        "{ok}"
    );

    let bad = &lines[1];
    assert_eq!(bad["request_id"], "log-fail");
    assert_eq!(bad["status"], 502);
    assert_eq!(bad["target"], "-");
    assert_eq!(bad["attempts"], 1);
    assert_eq!(bad["error"], "all_targets_failed");
    assert!(bad.get("tokens_in").is_none(), "{bad}");

    let log = served.log();
    assert!(
        !log.contains("SECRET-PROMPT-TEXT") && !log.contains("SECRET-COMPLETION-TEXT"),
        "{log}"
    );
}

/// A hedged request's line books the answer's usage, not the estimate of
/// the attempt it cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_requests_access_line_has_the_winners_usage() {
    let a = Fake::always(Reply::Delay(
        Duration::from_secs(3),
        Box::new(fake::completion("model-a", "slow")),
    ))
    .await;
    let b = Fake::always(fake::completion("model-b", "fast")).await;
    let yaml = routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "hedge: { after: 100ms, max_share: 1 }",
        "telemetry:\n  access_log: true\n",
    );
    let (served, _dir) = json_logging(&yaml);
    let prompt = serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user",
        "content": "a prompt long enough that its estimate is not the reported five tokens"}]});
    let ans = send(&served, "hedged", prompt, &[]).await;
    assert_eq!(ans.header("x-switchyard-hedge"), "won", "{}", ans.text());
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        !lines.is_empty()
    });
    assert!(written, "{}", served.log());
    let line = &lines[0];
    assert_eq!(line["target"], "b", "{line}");
    assert_eq!(
        (&line["tokens_in"], &line["tokens_out"]),
        (&5.into(), &2.into()),
        "{line}"
    );
}

/// The Messages and Responses doors name their protocol on the access line
/// (Chat Completions, the default, has no field); the engine's fields are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_names_the_inbound_protocol() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let (served, _dir) = json_logging(&routes(&[hop("a", &a.url())], "", ""));
    let user = serde_json::json!([{"role": "user", "content": "x"}]);
    let doors = [
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "gpt-4o", "messages": user}),
        ),
        (
            "/v1/messages",
            serde_json::json!({"model": "gpt-4o", "max_tokens": 8, "messages": user}),
        ),
        (
            "/v1/responses",
            serde_json::json!({"model": "gpt-4o", "input": "x"}),
        ),
    ];
    for (i, (path, body)) in doors.iter().enumerate() {
        let id = format!("door-{i}");
        let ans = post_raw(
            served.addr,
            path,
            body.to_string(),
            &[("x-request-id", &id)],
        )
        .await;
        assert_eq!(ans.status, 200, "{path}: {}", ans.text());
    }
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 3
    });
    assert!(written, "{}", served.log());
    let protocols: Vec<&str> = lines
        .iter()
        .map(|l| l["protocol"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(protocols, ["-", "messages", "responses"], "{lines:#?}");
    for line in &lines {
        assert_eq!(line["target"], "a", "{line}");
        assert_eq!(line["tokens_out"], 2, "{line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_access_line_is_written_at_its_end_with_its_verdict() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["one", "two", "three"],
        2,
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, chain_config(&[("a", &a.url())], "", "")).unwrap();
    let served = Served::start(&config, dir.path(), &[]);
    let ans = send(&served, "log-stream", hello_stream("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200);
    assert!(ans.text().contains("stream_interrupted"), "{}", ans.text());
    let mut line = None;
    wait_blocking(Duration::from_secs(5), || {
        line = served
            .log()
            .lines()
            .find(|l| l.contains("switchyard::access") && l.contains("log-stream"))
            .map(str::to_owned);
        line.is_some()
    });
    let line = line.unwrap_or_else(|| panic!("no access line:\n{}", served.log()));
    for field in [
        "status=200",
        "stream=true",
        "stream_end=\"reset\"",
        "ttft_ms=",
        "attempts=1",
        "task=\"chat\"",
    ] {
        assert!(line.contains(field), "{field} missing: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_streams_access_line_names_the_target_that_finished_it() {
    let words = ["The", " quick", " brown", " fox"];
    let a = Fake::always(fake::stream_cut_after("model-a", &words, 2)).await;
    let b = Fake::always(fake::stream("model-b", &words)).await;
    let yaml = routes(
        &[
            hop("a", &a.url()),
            hop("b", &b.url()).target("max_context: 1000"),
        ],
        "stream_recovery: { mode: continue }",
        "",
    );
    let (served, _dir) = json_logging(&yaml);
    let ans = send(&served, "log-continued", hello_stream("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200);
    assert_eq!(
        stream_text(&ans.text()),
        "The quick brown fox",
        "{}",
        ans.text()
    );
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        !lines.is_empty()
    });
    assert!(written, "{}", served.log());
    let line = &lines[0];
    assert_eq!(line["request_id"], "log-continued");
    assert_eq!(line["target"], "b", "{line}");
    assert_eq!(line["provider"], "p-b", "{line}");
    // The calls the head counted at the commit point, and the continuation.
    let at_commit: u64 = ans.header("x-switchyard-attempts").parse().unwrap();
    assert_eq!(line["attempts"], at_commit + 1, "{line}");
    assert_eq!(line["failovers"], 1, "{line}");
    assert_eq!(line["degraded"], true, "{line}");
    assert_eq!(line["stream_end"], "complete", "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_stream_has_a_span_for_the_attempt_that_finished_it() {
    let collector = Collector::start().await;
    let words = ["The", " quick", " brown", " fox"];
    let a = Fake::always(fake::stream_cut_after("model-a", &words, 2)).await;
    let b = Fake::always(Reply::Stream {
        pieces: fake::sse_events("model-b", &words),
        delay: Duration::from_millis(30),
        cut: false,
    })
    .await;
    let yaml = routes(
        &[
            hop("a", &a.url()),
            hop("b", &b.url()).target("max_context: 1000"),
        ],
        "stream_recovery: { mode: continue }",
        "",
    );
    let (served, _dir) = serve(&yaml, &collector.endpoint(), &[], &[]);
    let ans = send(&served, "t-continued", hello_stream("gpt-4o"), &[]).await;
    assert_eq!(ans.status, 200);
    assert_eq!(stream_text(&ans.text()), "The quick brown fox");

    let t = collector.trace_of("t-continued", 2).await;
    assert_server(&t, 200, 2, 1);
    let s = &t.server;
    assert_eq!(s.text("switchyard.target"), "b", "{s:#?}");
    assert_eq!(s.text("switchyard.stream.end"), "complete");
    let seam = s.events_named("continuation");
    assert_eq!(seam.len(), 1, "{:#?}", s.events);
    assert_eq!(seam[0]["switchyard.from"], "a");
    assert_eq!(seam[0]["switchyard.to"], "b");
    assert_eq!(seam[0]["switchyard.mode"], "restart");
    assert_eq!(seam[0]["switchyard.delivered_chars"], "The quick".len());

    let (broken, finisher) = (&t.attempts[0], &t.attempts[1]);
    assert_eq!(broken.text("switchyard.target"), "a");
    assert_eq!(broken.text("switchyard.stream.end"), "reset");
    assert_eq!(broken.status_code, STATUS_ERROR);
    assert_eq!(finisher.text("switchyard.target"), "b");
    assert_eq!(finisher.attr("switchyard.attempt"), 2);
    assert_eq!(finisher.text("switchyard.outcome"), "success");
    assert_eq!(finisher.events_named("commit").len(), 1);
    assert_eq!(finisher.text("switchyard.stream.end"), "complete");
    assert_ne!(finisher.status_code, STATUS_ERROR, "{finisher:#?}");
    assert!(broken.start_ns < finisher.start_ns);
    // The time to first token is the first commit's, not the seam's.
    let ttft = s
        .attr("switchyard.time_to_first_token_ms")
        .as_f64()
        .unwrap();
    let seam_ms = (finisher.start_ns - s.start_ns) as f64 / 1e6;
    assert!(ttft <= seam_ms, "ttft {ttft} ms, seam at {seam_ms} ms");
    // b's upstream call is a child of its own attempt span.
    let (trace, parent) = upstream_parent(&b.seen()[0]);
    assert_eq!(
        (trace, parent),
        (s.trace_id.clone(), finisher.span_id.clone())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_body_is_logged_as_499_not_as_a_bad_request() {
    use tokio::io::AsyncWriteExt;
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let (served, _dir) = json_logging(&chain_config(&[("a", &a.url())], "", ""));
    let mut tcp = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: gone-mid-body\r\ncontent-length: 100\r\n\r\n{\"mod",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(tcp);
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        !lines.is_empty()
    });
    assert!(written, "{}", served.log());
    assert_eq!(lines[0]["request_id"], "gone-mid-body");
    assert_eq!(lines[0]["status"], 499, "{}", lines[0]);
    assert_eq!(lines[0]["error"], "client_cancelled", "{}", lines[0]);
    assert_eq!(a.calls(), 0);
}

/// Sends a streaming request with id `id` over raw TCP, reads `wait` of
/// the answer, then hangs up.
async fn hang_up_after(served: &Served, id: &str, wait: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = hello_stream("gpt-4o").to_string();
    let mut tcp = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: {id}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let _ = tokio::time::timeout(wait, async {
        loop {
            if tcp.read(&mut buf).await.unwrap_or(0) == 0 {
                break;
            }
        }
    })
    .await;
    drop(tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_or_after_the_commit_point_is_logged_with_its_calls() {
    // Each event 200 ms apart: the role chunk by 200 ms, the first word (the
    // commit point) by 400 ms, the end by 1.4 s.
    let a = Fake::always(Reply::Stream {
        pieces: fake::sse_events("model-a", &["one", "two", "three", "four"]),
        delay: Duration::from_millis(200),
        cut: false,
    })
    .await;
    let (served, _dir) = json_logging(&chain_config(&[("a", &a.url())], "", ""));
    hang_up_after(&served, "gone-early", Duration::from_millis(250)).await;
    hang_up_after(&served, "gone-late", Duration::from_millis(700)).await;
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 2
    });
    assert!(written, "{}", served.log());
    let line = |id: &str| {
        lines
            .iter()
            .find(|l| l["request_id"] == id)
            .unwrap_or_else(|| panic!("{id}: {lines:?}"))
            .clone()
    };
    let early = line("gone-early");
    assert_eq!(early["status"], 499, "{early}");
    assert_eq!(early["attempts"], 1, "the upstream call it made: {early}");
    let late = line("gone-late");
    assert_eq!(late["status"], 200, "{late}");
    assert_eq!(late["attempts"], 1, "{late}");
    assert_eq!(late["stream_end"], "client_gone", "{late}");
}

/// Serves `yaml` (plus a 500 ms `drain_timeout`), starts a stream, sends
/// SIGTERM once `started` is in it, and reads it to its end: what the client
/// got, and the log. The process must exit 0.
async fn stream_through_a_drain(yaml: &str, started: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut served, _dir) = json_logging(&format!("{yaml}drain_timeout: 500ms\n"));
    let body = hello_stream("gpt-4o").to_string();
    let mut tcp = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: drained\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(started) {
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf))
            .await
            .expect("the stream started")
            .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let pid = served.child.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(sent.unwrap().success());
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n) = tcp.read(&mut buf).await {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let mut status = None;
    wait_blocking(Duration::from_secs(5), || {
        status = served.child.try_wait().unwrap();
        status.is_some()
    });
    let status = status.expect("exited after SIGTERM");
    assert_eq!(status.code(), Some(0), "{}", served.log());
    (String::from_utf8_lossy(&got).into_owned(), served.log())
}

/// What a stream cut by the drain must show: the error event and `[DONE]`
/// to the client, `stream_end=drain` in the log, no client hang-up.
fn assert_drained(text: &str, log: &str) {
    assert!(text.contains("stream_interrupted"), "{text}");
    assert!(text.contains("drain_timeout passed"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    let lines = access_lines(log);
    let line = lines
        .iter()
        .find(|l| l["request_id"] == "drained")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(line["stream_end"], "drain", "{line}");
    assert!(!log.contains("client hung up mid-stream"), "{log}");
}

/// A stream still running when `drain_timeout` passes at shutdown ends with
/// an error event its client can see, and is logged as a drain, not as a
/// client that hung up (issue 21 item 11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_at_the_drain_timeout_ends_with_an_error_event_and_is_logged_as_drain() {
    let words = ["w"; 40];
    let a = Fake::always(Reply::Stream {
        pieces: fake::sse_events("model-a", &words),
        delay: Duration::from_millis(150),
        cut: false,
    })
    .await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let (text, log) = stream_through_a_drain(&yaml, "\"w\"").await;
    assert_drained(&text, &log);
    assert_eq!(a.calls(), 1);
}

/// The drain also cuts a stream whose continuation is still waiting for the
/// next target (found by an adversarial run: the connection just closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_being_continued_at_the_drain_timeout_is_cut_as_a_drain() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["one", " two", " three"],
        2,
    ))
    .await;
    let b = Fake::always(Reply::Hang).await;
    let yaml = routes(
        &[hop("a", &a.url()), hop("b", &b.url())],
        "stream_recovery: { mode: continue }",
        "",
    );
    let (text, log) = stream_through_a_drain(&yaml, "two").await;
    assert_drained(&text, &log);
    assert_eq!(b.calls(), 1, "the continuation was under way");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_can_be_turned_off() {
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let yaml = routes(
        &[hop("a", &a.url())],
        "",
        "telemetry: { access_log: false }\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let served = Served::start(&config, dir.path(), &[]);
    assert_eq!(
        send(&served, "log-off", hello("gpt-4o"), &[]).await.status,
        200
    );
    // The line would be on stderr within a flush (25 ms) of the answer:
    // give it several.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !served.log().contains("switchyard::access"),
        "{}",
        served.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_never_slows_a_request() {
    let hole = BlackHole::start().await;
    let a = Fake::always(fake::completion("model-a", "hi")).await;
    let yaml = chain_config(&[("a", &a.url())], "", "");
    let env = [
        ("OTEL_BSP_MAX_QUEUE_SIZE", "8"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "1500"),
    ];
    let (mut served, _dir) = serve(&yaml, &hole.endpoint(), &[], &env);
    let mut slowest = Duration::ZERO;
    let started = tokio::time::Instant::now();
    for i in 0..60 {
        let t = tokio::time::Instant::now();
        let ans = send(&served, &format!("hole-{i}"), hello("gpt-4o"), &[]).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        slowest = slowest.max(t.elapsed());
    }
    let total = started.elapsed();
    assert!(
        hole.accepted.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the exporter tried"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "slowest request {slowest:?}"
    );
    assert!(
        total < Duration::from_secs(10),
        "60 requests took {total:?}"
    );
    let page = get(served.addr, "/metrics").await.text();
    let dropped = series_value(&page, "switchyard_trace_spans_dropped_total").unwrap_or(0.0);
    assert!(
        dropped >= 60.0,
        "60 requests × 2 spans through a queue of 8: {dropped} dropped\n{page}"
    );
    // The exit flush gives up on the silent collector within its bound.
    let status = tokio::task::block_in_place(|| served.terminate(Duration::from_secs(10)));
    assert_eq!(status.code(), Some(0), "{}", served.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_targets_are_all_down_shows_zero_available() {
    let a = Fake::always(fake::error(503, "down")).await;
    let yaml = routes(
        &[hop("a", &a.url()).provider("retry: { max: 0 }")],
        "",
        "health: { degraded_after: 1, down_after: 1 }\n",
    );
    let gw = gateway(&yaml).await;
    let series = "switchyard_task_targets_available{task=\"chat\"}";
    assert_eq!(metric(&gw, series).await, 1.0);
    assert_eq!(chat(gw.addr, hello("gpt-4o")).await.status, 502);
    assert_eq!(
        metric(&gw, series).await,
        0.0,
        "{}",
        metrics_page(&gw).await
    );
}

/// The metric names `src/metrics.rs` exports (histograms with their series).
fn exported_metrics() -> std::collections::BTreeSet<String> {
    let src = include_str!("../src/metrics.rs");
    let mut names = std::collections::BTreeSet::new();
    let mut histogram = false;
    for line in src.lines() {
        if line.starts_with("/// Histogram") {
            histogram = true;
        }
        if let Some(rest) = line.strip_prefix("pub const ") {
            if let Some(name) = rest
                .split('"')
                .nth(1)
                .filter(|n| n.starts_with("switchyard_"))
            {
                names.insert(name.to_owned());
                if histogram {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
            }
            histogram = false;
        }
    }
    names
}

#[test]
fn the_alert_rules_are_well_formed_and_use_only_exported_metrics() {
    let text = include_str!("../examples/prometheus/alerts.yaml");
    let doc: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
    let exported = exported_metrics();
    assert!(
        exported.contains("switchyard_request_duration_seconds_bucket"),
        "{exported:?}"
    );
    let mut alerts = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        assert!(group["name"].is_string());
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            let expr = rule["expr"].as_str().expect("expr");
            let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
            assert!(
                ["critical", "warning", "info"].contains(&severity),
                "{name}: {severity}"
            );
            assert!(rule["annotations"]["summary"].is_string(), "{name}");
            if let Some(f) = rule["for"].as_str() {
                assert!(f.ends_with('m') || f.ends_with('s'), "{name}: for {f}");
            }
            let used = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("switchyard_"));
            for metric in used {
                assert!(
                    exported.contains(metric),
                    "{name} uses {metric}, which switchyard does not export"
                );
            }
            alerts.push(name.to_owned());
        }
    }
    for wanted in [
        "SwitchyardTargetFailingOver",
        "SwitchyardTaskAllTargetsDown",
        "SwitchyardRequestsSlow",
        "SwitchyardStreamInterruptsRising",
        "SwitchyardConfigReloadFailed",
        // The dead-key placeholder became this alert once keys had a state.
        "SwitchyardProviderKeyRevoked",
        "SwitchyardSharedStateDown",
    ] {
        assert!(
            alerts.iter().any(|a| a == wanted),
            "{wanted} missing: {alerts:?}"
        );
    }
    assert!(
        text.contains("> 0.2") && text.contains(">= 60"),
        "the seeds' thresholds"
    );
}

#[test]
fn the_telemetry_section_is_checked_and_located() {
    let text = "version: 1\ntelemetry:\n  access_log: false\n  traces:\n    endpoint: collector:4318\n    protocol: http/json\n    timeout: soon\n";
    let errors: Vec<String> = compile_errors(text)
        .iter()
        .filter(|d| d.severity == switchyard::config::diagnostic::Severity::Error)
        .map(|d| format!("{}:{} {}", d.line, d.column, d.message))
        .collect();
    assert_eq!(errors.len(), 3, "{errors:#?}");
    assert!(errors[0].starts_with("5:15 bad URL"), "{errors:#?}");
    assert!(
        errors[1].starts_with("6:15 unknown protocol `http/json`"),
        "{errors:#?}"
    );
    assert!(errors[2].starts_with("7:14 bad duration"), "{errors:#?}");
    let good = "version: 1\ntelemetry:\n  traces: { endpoint: 'http://c:4317/', protocol: grpc, service_name: gw, timeout: 2s }\n";
    let parsed = switchyard::config::parse(good).unwrap();
    let compiled = switchyard::snapshot::compile::compile(
        &parsed,
        good,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    )
    .unwrap();
    let t = &compiled.startup.traces;
    assert_eq!(t.endpoint.as_deref(), Some("http://c:4317"));
    assert_eq!(t.protocol, Some(switchyard::telemetry::Protocol::Grpc));
    assert_eq!(t.service_name.as_deref(), Some("gw"));
    assert_eq!(t.timeout, Some(Duration::from_secs(2)));
    assert!(compiled.snapshot.access_log, "on by default");
}

/// A batch request served after a wait in its queue is logged as served:
/// the 429 its first walk came to is not its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_served_after_its_queue_is_logged_without_the_first_walks_error() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let yaml = format!(
        "version: 1
providers:
  pa: {{ base_url: '{}', rate_limit: {{ rpm: 60, burst: 1 }} }}
targets:
  a: {{ provider: pa, model: upstream-a }}
tasks:
  nightly: {{ aliases: [gpt-4o], chain: [a], priority: batch, queue: {{ max_wait: 5s }} }}
",
        a.url()
    );
    let (served, _dir) = json_logging(&yaml);
    let hello =
        serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]});
    assert_eq!(
        send(&served, "q-first", hello.clone(), &[]).await.status,
        200
    );
    let waited = send(&served, "q-waited", hello, &[]).await;
    assert_eq!(waited.status, 200, "{}", waited.text());
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 2
    });
    assert!(written, "{}", served.log());
    assert_eq!(lines[1]["request_id"], "q-waited");
    assert_eq!(lines[1]["status"], 200);
    assert!(lines[1].get("error").is_none(), "{lines:#?}");
}

/// A task's cache says on the access line what it did: a hit has no target
/// and no attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_says_what_the_cache_did() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let yaml = routes(&[hop("a", &a.url())], "cache: { ttl: 10m }", "");
    let (served, _dir) = json_logging(&yaml);
    let body = serde_json::json!({"model": "gpt-4o", "temperature": 0,
        "messages": [{"role": "user", "content": "x"}]});
    for id in ["cache-0", "cache-1"] {
        let ans = post_raw(
            served.addr,
            "/v1/chat/completions",
            body.to_string(),
            &[("x-request-id", id)],
        )
        .await;
        assert_eq!(ans.status, 200, "{}", ans.text());
    }
    let mut lines = Vec::new();
    let written = wait_blocking(Duration::from_secs(5), || {
        lines = access_lines(&served.log());
        lines.len() >= 2
    });
    assert!(written, "{}", served.log());
    assert_eq!(
        (lines[0]["cache"].as_str(), lines[0]["target"].as_str()),
        (Some("miss"), Some("a"))
    );
    assert_eq!(
        (lines[1]["cache"].as_str(), lines[1]["target"].as_str()),
        (Some("hit"), Some("-"))
    );
    assert_eq!(lines[1]["attempts"], 0, "{}", lines[1]);
    assert_eq!(a.calls(), 1);
}
