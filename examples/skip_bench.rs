//! What a DOWN target costs: latency of requests through a chain `[b]` versus
//! `[a, b]` where `a` is DOWN (breaker open) and skipped without a call.
//!
//! Run: `cargo run --release --example skip_bench [REQUESTS]` (default 5000,
//! sequential, keep-alive, against an in-process fake upstream).
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/fake.rs"]
mod fake;

use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use fake::Fake;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;

async fn start(
    yaml: &str,
    dir: &std::path::Path,
    name: &str,
) -> Result<std::net::SocketAddr, Box<dyn std::error::Error>> {
    let path = dir.join(name);
    std::fs::create_dir_all(&path)?;
    let config = path.join("routes.yaml");
    std::fs::write(&config, yaml)?;
    let gw = Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse()?),
        CompileOptions::default(),
    )
    .await?;
    let addr = gw.local_addr()?;
    tokio::spawn(gw.run(std::future::pending()));
    Ok(addr)
}

async fn measure(
    addr: std::net::SocketAddr,
    n: usize,
) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = Bytes::from(r#"{"model":"chat","messages":[{"role":"user","content":"hello"}]}"#);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let req = Request::post(format!("http://{addr}/v1/chat/completions"))
            .body(Full::new(body.clone()))?;
        let t = Instant::now();
        let resp = client.request(req).await?;
        let ok = resp.status().is_success();
        resp.into_body().collect().await?;
        out.push(t.elapsed());
        if !ok {
            return Err("request failed".into());
        }
    }
    out.sort();
    Ok(out)
}

fn pct(v: &[Duration], p: f64) -> f64 {
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5000);
    let b = Fake::always(fake::completion("model-b", "ok")).await;
    let dead = fake::dead_url().await;
    let dir = std::env::temp_dir().join(format!("switchyard-skip-bench-{}", std::process::id()));
    let common =
        "health: { down_after: 3, degraded_after: 2, open_for: 1h, probe: { interval: 0 } }\n";
    let one = format!(
        "version: 1\nproviders:\n  pb: {{ base_url: '{}' }}\ntargets:\n  b: {{ provider: pb, model: m }}\ntasks:\n  chat: {{ chain: [b] }}\n{common}",
        b.url()
    );
    let two = format!(
        "version: 1\nproviders:\n  pa: {{ base_url: '{dead}', retry: {{ max: 0 }} }}\n  pb: {{ base_url: '{}' }}\ntargets:\n  a: {{ provider: pa, model: m }}\n  b: {{ provider: pb, model: m }}\ntasks:\n  chat: {{ chain: [a, b] }}\n{common}",
        b.url()
    );
    let direct = b.addr;
    let g1 = start(&one, &dir, "one").await?;
    let g2 = start(&two, &dir, "two").await?;
    // Take `a` down: three refused connects.
    measure(g2, 3).await?;
    let warm = n / 10;
    measure(direct, warm).await?;
    measure(g1, warm).await?;
    measure(g2, warm).await?;
    let d = measure(direct, n).await?;
    let r1 = measure(g1, n).await?;
    let r2 = measure(g2, n).await?;
    println!("{n} sequential requests each, keep-alive, fake upstream in-process");
    println!("{:<32} {:>9} {:>9}", "path", "p50 µs", "p99 µs");
    for (name, v) in [
        ("direct to fake", &d),
        ("switchyard, chain [b]", &r1),
        ("switchyard, chain [a DOWN, b]", &r2),
    ] {
        println!("{name:<32} {:>9.1} {:>9.1}", pct(v, 0.5), pct(v, 0.99));
    }
    println!(
        "cost of the DOWN target: p50 {:+.1} µs, p99 {:+.1} µs",
        pct(&r2, 0.5) - pct(&r1, 0.5),
        pct(&r2, 0.99) - pct(&r1, 0.99)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
