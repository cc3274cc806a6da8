//! What hedging buys: time to first token through switchyard when the primary
//! target's first token takes 100 ms for 9 requests in 10 and 3 s for the
//! tenth, and a healthy backup answers in 150 ms; with no hedge, a fixed
//! `after`, and adaptive (percentile) ones. Prints p50 / p95 / p99 time to
//! first token and the extra upstream calls per configuration.
//!
//! Run: `cargo run --release --example hedge_bench [REQUESTS] [CONCURRENCY]`
//! (default 2000 streaming requests at concurrency 16, in-process fakes on
//! 127.0.0.1; about two minutes).
// A bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/fake.rs"]
mod fake;
#[path = "support/gateway.rs"]
mod gateway;

use gateway::start;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fake::{Fake, Reply};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

const SLOW_EVERY: usize = 10;
/// The first content of every fake answer.
const FIRST: &[u8] = br#""content":"hello""#;

fn routes(primary: &str, backup: &str, hedge: &str) -> String {
    format!(
        "version: 1
providers:
  primary: {{ base_url: '{primary}', timeout: 10s, retry: {{ max: 0 }} }}
  backup: {{ base_url: '{backup}', timeout: 10s, retry: {{ max: 0 }} }}
targets:
  p: {{ provider: primary, model: m }}
  b: {{ provider: backup, model: m }}
tasks:
  chat:
    chain: [p, b]
    budget: {{ total_timeout: 20s }}
{hedge}
"
    )
}

/// Time to the first content byte of a streamed answer.
async fn one(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: std::net::SocketAddr,
) -> Duration {
    let body = Bytes::from_static(
        br#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"hello"}]}"#,
    );
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .body(Full::new(body))
        .unwrap();
    let started = Instant::now();
    let resp = client.request(req).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let mut body = resp.into_body();
    let mut ttft = None;
    let mut seen = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame: Frame<Bytes> = frame.unwrap();
        if let Ok(data) = frame.into_data() {
            seen.extend_from_slice(&data);
            // The first content chunk carries the first word.
            if ttft.is_none() && seen.windows(FIRST.len()).any(|w| w == FIRST) {
                ttft = Some(started.elapsed());
            }
        }
    }
    ttft.unwrap_or_else(|| started.elapsed())
}

fn pct(v: &[Duration], q: f64) -> f64 {
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

async fn run(name: &str, hedge: &str, n: usize, concurrency: usize) {
    let primary = Fake::start(|i, _| {
        let ttft = if i % SLOW_EVERY == SLOW_EVERY - 1 {
            3000
        } else {
            100
        };
        Reply::Delay(
            Duration::from_millis(ttft),
            Box::new(fake::stream("m", &["hello", " there"])),
        )
    })
    .await;
    let backup = Fake::always(Reply::Delay(
        Duration::from_millis(150),
        Box::new(fake::stream("m", &["hello", " there"])),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let addr = start(&routes(&primary.url(), &backup.url(), hedge), dir.path()).await;
    let client = Arc::new(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let client = Arc::clone(&client);
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = w;
            while i < n {
                out.push(one(&client, addr).await);
                i += concurrency;
            }
            out
        }));
    }
    let mut all = Vec::with_capacity(n);
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all.sort();
    let calls = primary.calls() + backup.calls();
    println!(
        "| {name} | {n} | {:.0} | {:.0} | {:.0} | {:.1} % |",
        pct(&all, 0.5),
        pct(&all, 0.95),
        pct(&all, 0.99),
        (calls as f64 - n as f64) / n as f64 * 100.0
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let concurrency: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(16);
    println!("primary TTFT 100 ms (9 in 10) / 3 s (1 in 10), backup 150 ms; {n} streams at concurrency {concurrency}");
    println!("| hedge | requests | p50 TTFT ms | p95 ms | p99 ms | extra upstream calls |");
    println!("|---|---|---|---|---|---|");
    run("none", "", n, concurrency).await;
    run(
        "after: 200ms",
        "    hedge: { after: 200ms, max_share: 0.15 }",
        n,
        concurrency,
    )
    .await;
    run(
        "after: p90 (floor 120ms, cap 1s)",
        "    hedge: { after: p90, floor: 120ms, cap: 1s, max_share: 0.15 }",
        n,
        concurrency,
    )
    .await;
    run(
        "after: p80 (floor 120ms, cap 1s)",
        "    hedge: { after: p80, floor: 120ms, cap: 1s, max_share: 0.15 }",
        n,
        concurrency,
    )
    .await;
}
