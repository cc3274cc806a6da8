//! Test harness: the gateway started in-process on port 0 against a
//! routes.yaml in a temp dir ([`gateway`]), a plain HTTP client
//! ([`requests`]), routes.yaml builders ([`routes`]), SSE builders and
//! readers ([`sse`]), admin lookups ([`observe`]), bounded waits ([`wait`]),
//! and the fake upstreams ([`fake`], shared with the examples). Tests
//! `use crate::support::*`.
#![allow(dead_code)]

/// `examples/support/fake.rs`, through `examples/fake_upstream.rs`, which
/// includes it (it renders its bodies with the same functions).
pub use crate::fake_upstream::fake;

mod gateway;
mod observe;
mod requests;
mod routes;
mod sse;
mod wait;

pub use gateway::*;
pub use observe::*;
pub use requests::*;
pub use routes::*;
pub use sse::*;
pub use wait::*;
