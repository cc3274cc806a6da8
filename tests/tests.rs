//! One integration test binary: the real gateway, in-process, against fake
//! upstreams on 127.0.0.1.
// A failed unwrap in a test is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

/// The fast fake upstream of the benchmarks and the chaos suite; it brings
/// the shared scriptable fake along (`support::fake` is its `fake`), so that
/// `examples/support/fake.rs` is compiled once here.
#[path = "../examples/fake_upstream.rs"]
mod fake_upstream;

mod architecture;

mod binary;
mod failover;
mod streaming;

mod cli;
mod clouds;
mod embeddings;
mod endpoints;
mod reload;
mod resources;
mod secrets;

mod admin;
mod anthropic;
mod bucket_spend;
mod budgets;
mod cache;
mod chaos;
mod config_semantics;
mod continuation;
mod contract;
mod error_classes;
mod front_door;
mod health;
mod hedging;
mod inbound;
mod keys;
mod readme;
mod regressions;
mod routing;
mod runtimes;
mod sanitize;
mod semantics;
mod shared_state;
mod stream_edges;
mod telemetry;
mod upstream_http;
mod walk_decisions;
