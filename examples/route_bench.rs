//! Cost of a routing decision: `routing::plan` for a 10-target chain, per
//! strategy, without the token estimate (measured separately).
//!
//! Run: `cargo run --release --example route_bench`
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tokio::time::Instant;

use switchyard::config::parse;
use switchyard::request::ChatRequest;
use switchyard::routing::{plan, Needs};
use switchyard::snapshot::{compile::compile, CompileOptions, LiveState};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut yaml = String::from(
        "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1' }\ntargets:\n",
    );
    for i in 0..10 {
        yaml.push_str(&format!(
            "  t{i}: {{ provider: p, model: m{i}, capabilities: [tools, json_mode], max_context: 128000, weight: {}, cost: {{ input_per_1k: 0.00{i}, output_per_1k: 0.01 }} }}\n",
            i + 1
        ));
    }
    yaml.push_str("tasks:\n");
    let chain = (0..10)
        .map(|i| format!("t{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    for s in ["priority", "weighted", "round_robin", "latency", "cost"] {
        yaml.push_str(&format!(
            "  {s}: {{ chain: [{chain}], strategy: {s}, requires: [tools] }}\n"
        ));
    }
    let parsed = parse(&yaml).map_err(|d| format!("{d:?}"))?;
    let snapshot = compile(
        &parsed,
        &yaml,
        &LiveState::default(),
        CompileOptions::default(),
    )
    .map_err(|d| format!("{d:?}"))?
    .snapshot;
    let needs = Needs {
        tools: true,
        prompt_tokens: 1200,
        max_tokens: Some(500),
        ..Needs::default()
    };
    let n = 200_000u32;
    println!("routing::plan, 10-target chain, {n} decisions per strategy");
    for (name, task) in &snapshot.tasks {
        let now = tokio::time::Instant::now();
        for _ in 0..10_000 {
            std::hint::black_box(plan(task, &needs, now));
        }
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(plan(task, std::hint::black_box(&needs), now));
        }
        println!(
            "{name:<12} {:>7.2} µs/decision",
            t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
        );
    }
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. ".repeat(2300)}]
    })
    .to_string();
    let t = Instant::now();
    for _ in 0..200 {
        let request = ChatRequest::parse(std::hint::black_box(body.as_bytes()))?;
        std::hint::black_box(Needs::of(&request.facts()));
    }
    println!(
        "token estimate of a ~100 KB prompt: {:.1} µs",
        t.elapsed().as_secs_f64() * 1e6 / 200.0
    );
    Ok(())
}
