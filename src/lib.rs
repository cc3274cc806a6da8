//! switchyard: a sidecar LLM gateway.
//!
//! It speaks the OpenAI Chat Completions protocol to the application next to
//! it and sends each request along a declared degradation chain of upstream
//! targets. The request path, module by module:
//!
//! 1. [`server`] accepts the request and loads the current [`snapshot`] once.
//! 2. [`proxy`] parses it, routes it to a task, and walks the task's chain:
//!    [`health`] skips targets known to be down, [`upstream`] makes the call,
//!    [`classify`] decides retry / failover / return by the error-class table,
//!    and [`sse`] holds a stream until its commit point, then relays it.
//! 3. [`error`] shapes switchyard's own answers in OpenAI format; [`metrics`]
//!    counts everything.
//!
//! [`config`] parses `routes.yaml` with locations; [`snapshot`] compiles it;
//! [`probe`] checks DOWN targets in the background; [`reload`] swaps a new one in when the file changes; [`cli`] is the
//! command line.

pub mod anthropic;
pub mod classify;
pub mod cli;
pub mod config;
pub mod error;
pub mod health;
pub mod metrics;
pub mod probe;
pub mod proxy;
pub mod reload;
pub mod routing;
pub mod sanitize;
pub mod schema;
pub mod server;
pub mod snapshot;
pub mod sse;
pub mod tokens;
pub mod upstream;
