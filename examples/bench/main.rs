//! Stream timing probe for `examples/bench/run.sh`: time to the first content
//! byte (TTFT) and to the end of streamed chat completions, at a given
//! concurrency, over keep-alive connections. oha measures throughput and
//! whole-response latency; it cannot see when the first chunk of a body
//! arrives, which is what this adds.
//!
//! ```text
//! cargo run --release --example bench -- --url http://127.0.0.1:19010/v1/chat/completions \
//!     --model one --concurrency 16 --duration 5s
//! ```
//!
//! Prints one JSON line: `requests`, `errors`, `ttft_p50_us`, `ttft_p99_us`,
//! `total_p50_us`, `total_p99_us`. The first content byte is the first body
//! frame containing `[seq ` (the fake upstream's content marker), so role
//! chunks and headers do not count.
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use clap::Parser;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Options.
#[derive(Parser, Debug, Clone)]
#[command(about = "TTFT of streamed chat completions under concurrency")]
struct Args {
    /// Chat completions URL.
    #[arg(long)]
    url: String,
    /// `model` to ask for.
    #[arg(long, default_value = "fake-model")]
    model: String,
    /// Concurrent connections (one request at a time each).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// How long to send.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Extra request header, `name: value` (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
}

#[derive(Default)]
struct Samples {
    ttft: Vec<Duration>,
    total: Vec<Duration>,
    errors: usize,
}

fn pct_us(v: &mut [Duration], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i].as_secs_f64() * 1e6
}

async fn worker(args: Args, until: Instant) -> Samples {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = Bytes::from(format!(
        r#"{{"model":"{}","stream":true,"max_tokens":16,"messages":[{{"role":"user","content":"hello"}}]}}"#,
        args.model
    ));
    let mut s = Samples::default();
    while Instant::now() < until {
        let mut req = Request::post(&args.url).header("content-type", "application/json");
        for h in &args.headers {
            if let Some((k, v)) = h.split_once(':') {
                req = req.header(k.trim(), v.trim());
            }
        }
        let Ok(req) = req.body(Full::new(body.clone())) else {
            s.errors += 1;
            continue;
        };
        let started = Instant::now();
        let Ok(resp) = client.request(req).await else {
            s.errors += 1;
            continue;
        };
        if resp.status() != 200 {
            s.errors += 1;
            let _ = resp.into_body().collect().await;
            continue;
        }
        let mut body = resp.into_body();
        let mut first = None;
        let mut failed = false;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if first.is_none() {
                        if let Some(d) = f.data_ref() {
                            if d.windows(5).any(|w| w == b"[seq ") {
                                first = Some(started.elapsed());
                            }
                        }
                    }
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        match first {
            Some(t) if !failed => {
                s.ttft.push(t);
                s.total.push(started.elapsed());
            }
            _ => s.errors += 1,
        }
    }
    s
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let until = Instant::now() + args.duration;
    let tasks: Vec<_> = (0..args.concurrency.max(1))
        .map(|_| tokio::spawn(worker(args.clone(), until)))
        .collect();
    let mut all = Samples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            all.ttft.extend(s.ttft);
            all.total.extend(s.total);
            all.errors += s.errors;
        }
    }
    println!(
        "{{\"requests\":{},\"errors\":{},\"ttft_p50_us\":{:.1},\"ttft_p99_us\":{:.1},\"total_p50_us\":{:.1},\"total_p99_us\":{:.1}}}",
        all.ttft.len(),
        all.errors,
        pct_us(&mut all.ttft, 0.5),
        pct_us(&mut all.ttft, 0.99),
        pct_us(&mut all.total, 0.5),
        pct_us(&mut all.total, 0.99),
    );
}
