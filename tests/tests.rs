//! One integration test binary: the real gateway, in-process, against fake
//! upstreams on 127.0.0.1.
// A failed unwrap in a test is a failed test, which is what it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

mod architecture;

mod binary;
mod failover;
mod streaming;

mod cli;
mod endpoints;
mod reload;
mod resources;
mod secrets;

mod admin;
mod anthropic;
mod budgets;
mod chaos;
mod config_semantics;
mod contract;
mod edge_support;
mod error_classes;
mod health;
mod readme;
mod regressions;
mod routing;
mod sanitize;
mod stream_edges;
