//! The failover demo: two fake upstreams in this process — `primary`, which
//! fails in a different way on each request, and a healthy `fallback` — and
//! switchyard in front of them. Prints, per request, what the primary did,
//! which target answered and how many attempts and failovers it took.
//!
//! Run: `cargo run --example failover_demo`
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/fake.rs"]
mod fake;

use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use fake::{Fake, Reply};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;

/// (scenario, what the primary does, streaming request)
const SCENARIOS: &[(&str, &str, bool)] = &[
    ("ok", "answers", false),
    ("ok", "streams an answer", true),
    ("503", "503 Service Unavailable", false),
    ("reset", "resets the connection", false),
    ("400", "400 bad request", false),
    ("hang", "hangs past its 300ms timeout", false),
    ("cut-early", "stream cut before content", true),
    ("cut-late", "stream cut after 2 words", true),
    ("ok", "- (breaker open: DOWN)", false),
    ("wait", "", false),
    ("ok", "answers the half-open trial", true),
    ("429", "429, Retry-After: 1", false),
    ("ok", "- (cooling down after 429)", false),
];

fn primary_reply(scenario: &str, stream: bool) -> Reply {
    let words = ["Hello", " from", " the", " primary"];
    match scenario {
        "503" => fake::error(503, "overloaded"),
        "reset" => Reply::Reset,
        "429" => Reply::Json {
            status: 429,
            body: r#"{"error":{"message":"rate limited","type":"rate_limit"}}"#.into(),
            headers: vec![("retry-after".into(), "1".into())],
        },
        "400" => fake::error(400, "messages must not be empty"),
        "hang" => Reply::Hang,
        "cut-early" => fake::stream_cut_after("primary-model", &words, 0),
        "cut-late" => fake::stream_cut_after("primary-model", &words, 2),
        _ if stream => fake::stream("primary-model", &words),
        _ => fake::completion("primary-model", "Hello from the primary"),
    }
}

/// The demo's routes.yaml: `primary` (fast timeout, one retry) then `fallback`.
fn demo_config(primary: &str, fallback: &str) -> String {
    format!(
        r#"version: 1
providers:
  vendor-a: {{ base_url: "{primary}", timeout: 300ms, retry: {{ max: 1, backoff: 20ms }} }}
  vendor-b: {{ base_url: "{fallback}", timeout: 5s }}
targets:
  primary: {{ provider: vendor-a, model: big-model }}
  fallback: {{ provider: vendor-b, model: small-model }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [primary, fallback]
    budget: {{ total_timeout: 5s, max_failovers: 1 }}
health: {{ degraded_after: 3, down_after: 8, open_for: 1s }}
"#
    )
}

/// What the demo runs and the table's column heads.
fn print_header(addr: std::net::SocketAddr) {
    println!(
        "switchyard on http://{addr}, task `chat` (alias gpt-4o), chain [primary -> fallback]"
    );
    println!(
        "health: DEGRADED after 3 counted failures, DOWN after 8, half-open trial after 1 s\n"
    );
    println!(
        "{:>2}  {:<6}  {:<30} {:>5}  {:>6}  {:<9} {:>8} {:>9} {:>5}  answer",
        "#", "kind", "primary does", "calls", "status", "served by", "attempts", "failovers", "ms"
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let primary = Fake::start(|_, seen| {
        let scenario = seen.body["demo_scenario"]
            .as_str()
            .unwrap_or("ok")
            .to_owned();
        let stream = seen.body["stream"].as_bool().unwrap_or(false);
        primary_reply(&scenario, stream)
    })
    .await;
    let fallback = Fake::start(|_, seen| {
        if seen.body["stream"].as_bool().unwrap_or(false) {
            fake::stream("fallback-model", &["Hello", " from", " the", " fallback"])
        } else {
            fake::completion("fallback-model", "Hello from the fallback")
        }
    })
    .await;

    let dir = std::env::temp_dir().join(format!("switchyard-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("routes.yaml");
    std::fs::write(&config, demo_config(&primary.url(), &fallback.url()))?;

    let gateway = Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse()?),
        CompileOptions::default(),
    )
    .await?;
    let addr = gateway.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.run(async {
        let _ = stopped.await;
    }));
    print_header(addr);

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut n = 0;
    for (scenario, does, stream) in SCENARIOS {
        if *scenario == "wait" {
            println!("    ... waiting 1.3 s for the breaker's open_for (1 s, ±20 % jitter) ...");
            tokio::time::sleep(Duration::from_millis(1300)).await;
            continue;
        }
        n += 1;
        let body = serde_json::json!({
            "model": "gpt-4o",
            "stream": stream,
            "messages": [{"role": "user", "content": "hello"}],
            "demo_scenario": scenario,
        });
        let calls_before = primary.calls();
        let req = Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let started = Instant::now();
        let resp = client.request(req).await?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await?.to_bytes();
        let ms = started.elapsed().as_millis();
        let h = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        let text = String::from_utf8_lossy(&bytes);
        let answer = if *stream && parts.status.is_success() {
            summarize_stream(&text)
        } else {
            summarize_json(&text)
        };
        let primary_calls = primary.calls() - calls_before;
        println!(
            "{n:>2}  {:<6}  {does:<30} {primary_calls:>5}  {:>6}  {:<9} {:>8} {:>9} {ms:>5}  {answer}",
            if *stream { "stream" } else { "chat" },
            parts.status.as_u16(),
            h("x-switchyard-target"),
            h("x-switchyard-attempts"),
            h("x-switchyard-failovers"),
        );
    }
    println!(
        "\nprimary was called {} times, fallback {} times.",
        primary.calls(),
        fallback.calls()
    );
    let _ = stop.send(());
    let _ = server.await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn summarize_json(text: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
    if let Some(content) = v["choices"][0]["message"]["content"].as_str() {
        return format!("{content:?}");
    }
    format!("error: {}", v["error"]["message"].as_str().unwrap_or(text))
}

fn summarize_stream(text: &str) -> String {
    let mut out = String::new();
    let mut interrupted = false;
    for data in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
        if v.get("error").is_some() {
            interrupted = true;
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            out.push_str(c);
        }
    }
    if interrupted {
        format!("{out:?} + error event (stream interrupted), [DONE]")
    } else {
        format!("{out:?} (streamed)")
    }
}
