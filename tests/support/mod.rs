//! Test harness, one file per concern, all re-exported here (tests `use
//! crate::support::*`):
//!
//! - `gateway.rs`: the gateway in-process on port 0 against a routes.yaml in
//!   a temp dir, running (watcher and prober started) when returned;
//! - `requests.rs`: a plain HTTP client and the requests tests send;
//! - `routes.rs`: routes.yaml builders (`chain_config`, `Hop`/`routes`) and
//!   `compile_errors`;
//! - `sse.rs`: SSE event builders and strict readers;
//! - `observe.rs`: `/admin/targets` entries and exact `/metrics` values;
//! - `wait.rs`: bounded waits for a condition;
//! - `redis.rs`: a real `redis-server` on a free port, for shared state;
//! - `otlp.rs`: an OTLP trace collector (HTTP and gRPC) decoding spans, and
//!   one that never answers;
//! - `fake`: the fake upstreams (`Fake`, scriptable; `RawFake`, raw TCP),
//!   shared with the examples.
#![allow(dead_code)]

/// `examples/support/fake.rs`, through `examples/fake_upstream.rs`, which
/// includes it (it renders its bodies with the same functions).
pub use crate::fake_upstream::fake;

mod gateway;
mod observe;
pub mod otlp;
mod redis;
mod requests;
mod routes;
mod sse;
mod wait;

pub use gateway::*;
pub use observe::*;
pub use redis::*;
pub use requests::*;
pub use routes::*;
pub use sse::*;
pub use wait::*;
