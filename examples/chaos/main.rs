//! The long chaos run, for manual use (the bounded one is `tests/chaos.rs`):
//! three fake upstreams with random faults, switchyard in front of them,
//! concurrent clients sending mixed streaming and non-streaming requests,
//! routes.yaml rewritten every 200 ms, one upstream killed and restarted.
//! What is checked is described in `harness.rs`. Exits 1 on any violation.
//!
//! ```text
//! cargo run --release --example chaos -- --duration 5m --clients 32 --fault-rate 0.3
//! ```
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../fake_upstream.rs"]
mod fake_upstream;

mod harness;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// Options (defaults: a longer, busier run than the CI test).
#[derive(Parser, Debug)]
#[command(about = "switchyard chaos run: random upstream faults, reloads, a killed target")]
struct Args {
    /// Length of the measured phase.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Warm-up before the start measurements.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Fault probability of the two faulty upstreams.
    #[arg(long, default_value_t = 0.3)]
    fault_rate: f64,
    /// Seed of faults and client choices.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Interval of routes.yaml rewrites.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    reload_every: Duration,
    /// When the first upstream is killed, as a fraction of the run.
    #[arg(long, default_value_t = 0.4)]
    kill_at: f64,
    /// How long it stays down.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    down_for: Duration,
    /// Content chunks per stream.
    #[arg(long, default_value_t = 16)]
    chunks: usize,
    /// Pause between chunks.
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    chunk_delay: Duration,
    /// Share of streaming requests.
    #[arg(long, default_value_t = 0.5)]
    stream_share: f64,
    /// Share of requests to the chain without a healthy target.
    #[arg(long, default_value_t = 0.25)]
    risky_share: f64,
    /// Render /metrics this often, as a Prometheus scrape would (default: never).
    #[arg(long, value_parser = humantime::parse_duration)]
    scrape_every: Option<Duration>,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let params = harness::Params {
        duration: a.duration,
        warmup: a.warmup,
        clients: a.clients,
        fault_rate: a.fault_rate,
        seed: a.seed,
        reload_every: a.reload_every,
        kill_at: a.kill_at,
        down_for: a.down_for,
        chunks: a.chunks,
        chunk_delay: a.chunk_delay,
        stream_share: a.stream_share,
        risky_share: a.risky_share,
        scrape_every: a.scrape_every,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = rt.block_on(harness::run(params));
    println!("{}", report.table);
    let problems = report.problems();
    if problems.is_empty() {
        println!("chaos run passed: no violations");
        ExitCode::SUCCESS
    } else {
        println!("chaos run FAILED, {} problems:", problems.len());
        for p in &problems {
            println!("  {p}");
        }
        ExitCode::FAILURE
    }
}
