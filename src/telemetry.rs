//! What operators see of each request beyond the metrics: one access-log
//! line per chat request, and (opt-in) OpenTelemetry traces exported over
//! OTLP with W3C trace context propagated in and out.
//!
//! - [`request`]: [`RequestTrace`], one request's record: its server span,
//!   its attempt spans and the fields of its access-log line, written when
//!   the request (or its stream) ends.
//! - [`export`]: the OTLP pipeline (opentelemetry-otlp, batched on its own
//!   thread, a bounded queue whose overflow is dropped and counted), built
//!   from the standard `OTEL_*` environment and the `telemetry.traces`
//!   section, and flushed on exit.
//!
//! Spans meant for OpenTelemetry use the tracing target [`OTEL_TARGET`]: the
//! log formatter never sees them (so log lines look the same with tracing on
//! or off), and the OpenTelemetry layer sees nothing else. With tracing off
//! no such span is created at all, so the request path formats no field.
//! This module is a leaf: it knows names and numbers, not snapshots.

pub mod access;
pub mod export;
pub mod request;
pub mod stderr;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::KeyValue;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::metrics::{self as m, Metrics};

pub use request::{
    attempt_abandoned, attempt_failed, attempt_served, event, AttemptFailure, AttemptInfo,
    RequestTrace,
};

/// The tracing target of the spans (and span events) exported to OpenTelemetry.
pub const OTEL_TARGET: &str = "switchyard::otel";
/// The tracing target of the access log.
pub const ACCESS_TARGET: &str = "switchyard::access";

/// Set once when the OTLP pipeline is installed; read on the request path.
static TRACING_ON: AtomicBool = AtomicBool::new(false);
/// Spans dropped because the export queue was full (process-wide).
static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);
/// Spans handed to the collector successfully.
static SPANS_EXPORTED: AtomicU64 = AtomicU64::new(0);
/// Export calls that failed (collector down, slow, or refusing).
static EXPORT_FAILURES: AtomicU64 = AtomicU64::new(0);

/// Whether OpenTelemetry traces are being exported by this process.
#[must_use]
pub fn tracing_on() -> bool {
    TRACING_ON.load(Ordering::Relaxed)
}

/// The wire protocol of the OTLP exporter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (`http/protobuf`, the default).
    HttpProtobuf,
    /// OTLP/gRPC (`grpc`).
    Grpc,
}

impl Protocol {
    /// The protocol named as `OTEL_EXPORTER_OTLP_PROTOCOL` names it.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "http/protobuf" => Some(Self::HttpProtobuf),
            "grpc" => Some(Self::Grpc),
            _ => None,
        }
    }

    /// Its `OTEL_EXPORTER_OTLP_PROTOCOL` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }
}

/// The `telemetry.traces` section as compiled (read at start).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceSettings {
    /// Collector base URL.
    pub endpoint: Option<String>,
    /// Wire protocol.
    pub protocol: Option<Protocol>,
    /// `service.name`.
    pub service_name: Option<String>,
    /// Per-export timeout.
    pub timeout: Option<Duration>,
}

/// The OpenTelemetry context of an incoming request's `traceparent` /
/// `tracestate`, if it carries a valid one.
#[must_use]
pub fn extract(headers: &HeaderMap) -> Option<opentelemetry::Context> {
    use opentelemetry::trace::TraceContextExt;
    let cx = TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

/// Writes the current span's context (an attempt span, when called from an
/// upstream call) as `traceparent` / `tracestate`. Nothing with tracing off,
/// or outside a traced request (the prober).
pub fn inject(headers: &mut HeaderMap) {
    if !tracing_on() {
        return;
    }
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new()
        .inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers));
}

/// A target left out without a call, as an event on the request's span
/// (routing calls this where it counts the exclusion).
pub fn skipped(target: &str, reason: &'static str) {
    if !tracing_on() {
        return;
    }
    tracing::Span::current().add_event(
        "skip",
        vec![
            KeyValue::new("switchyard.target", target.to_owned()),
            KeyValue::new("switchyard.skip_reason", reason),
        ],
    );
}

/// A repair of an answer that broke the contract, as an event on the
/// current span.
pub fn repaired(target: &str, method: &'static str, result: &'static str) {
    if !tracing_on() {
        return;
    }
    tracing::Span::current().add_event(
        "contract_repair",
        vec![
            KeyValue::new("switchyard.target", target.to_owned()),
            KeyValue::new("switchyard.repair.method", method),
            KeyValue::new("switchyard.repair.result", result),
        ],
    );
}

/// A switch to another target, as an event on the request's span.
pub fn failover(from: &str, to: &str, reason: &'static str) {
    if !tracing_on() {
        return;
    }
    tracing::Span::current().add_event(
        "failover",
        vec![
            KeyValue::new("switchyard.from", from.to_owned()),
            KeyValue::new("switchyard.to", to.to_owned()),
            KeyValue::new("switchyard.reason", reason),
        ],
    );
}

/// Sets the exporter's process-wide counters on a gateway's registry (at
/// each scrape), when traces are exported.
pub fn publish(metrics: &Metrics) {
    if !tracing_on() {
        return;
    }
    let set = |name: &'static str, counter: &AtomicU64| {
        metrics
            .counter(name, &[])
            .absolute(counter.load(Ordering::Relaxed));
    };
    set(m::TRACE_SPANS_DROPPED, &SPANS_DROPPED);
    set(m::TRACE_SPANS_EXPORTED, &SPANS_EXPORTED);
    set(m::TRACE_EXPORT_FAILURES, &EXPORT_FAILURES);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocols_parse_by_their_otel_names() {
        assert_eq!(
            Protocol::parse("http/protobuf"),
            Some(Protocol::HttpProtobuf)
        );
        assert_eq!(Protocol::parse("grpc"), Some(Protocol::Grpc));
        assert_eq!(Protocol::parse("http/json"), None);
        assert_eq!(Protocol::Grpc.as_str(), "grpc");
    }

    #[test]
    fn a_valid_traceparent_is_extracted_and_a_broken_one_is_not() {
        let mut h = HeaderMap::new();
        h.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        );
        assert!(extract(&h).is_some());
        h.insert("traceparent", http::HeaderValue::from_static("00-zz-01"));
        assert!(extract(&h).is_none());
        assert!(extract(&HeaderMap::new()).is_none());
    }
}
