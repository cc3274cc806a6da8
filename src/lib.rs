//! switchyard: a sidecar LLM gateway.
//!
//! It speaks the OpenAI Chat Completions protocol to the application next to
//! it and sends each request along a declared degradation chain of upstream
//! targets. Data flows one way, server -> proxy -> routing -> upstream ->
//! classify, and back (ARCHITECTURE.md draws it):
//!
//! - [`server`]: listeners, endpoints, drain, admin auth; loads the current
//!   [`snapshot`] once per request from the shared [`state`].
//! - [`proxy`]: the attempt loop (its header lists the steps); one attempt up
//!   to the commit point, the stream relay after it, the response shaping and
//!   the accounting are its submodules.
//! - [`request`]: the typed view of a chat request, parsed once; [`native`]
//!   carries a client's own protocol past translation to a target that speaks it.
//! - [`routing`]: the plan of candidates and the one admission point;
//!   [`ratelimit`] holds the token buckets it asks.
//! - [`upstream`]: the protocol adapter seam (OpenAI, Anthropic) and the
//!   pooled client; [`sse`] is SSE framing.
//! - [`classify`]: attempt outcome -> decision by the error-class table, and
//!   the end-of-stream verdict; [`health`] is the state machine those feed;
//!   [`probe`] checks DOWN targets in the background; [`shared`] keeps
//!   health, cooldowns, trial leases and provider limits in step with the
//!   other replicas through Redis, in the background too.
//! - [`schema`]: the tool call contract of degraded answers.
//! - [`config`]: raw `routes.yaml` types and their locations; [`snapshot`]
//!   compiles them in named passes; [`reload`] swaps a new one in when the
//!   file changes.
//! - [`error`], [`body`], [`secret`], [`sanitize`], [`tokens`], [`metrics`]:
//!   switchyard's own errors, response bodies, keys as a type, what upstream
//!   text may reach clients, the token estimate, metric names and registry.
//! - [`telemetry`]: the access log, OpenTelemetry spans and their OTLP export.
//! - [`cli`]: the command line.

pub mod body;
pub mod cache;
pub mod classify;
pub mod cli;
pub mod config;
pub mod error;
pub mod health;
pub mod inbound;
pub mod metrics;
pub mod native;
pub mod probe;
pub mod proxy;
pub mod ratelimit;
pub mod reload;
pub mod request;
pub mod routing;
pub mod sanitize;
pub mod schema;
pub mod secret;
pub mod server;
pub mod shared;
pub mod snapshot;
pub mod sse;
pub mod state;
pub mod telemetry;
pub mod tokens;
pub mod upstream;
