//! One chat request's telemetry: the fields of its access-log line and,
//! with tracing on, its OpenTelemetry spans.
//!
//! A [`RequestTrace`] is made when the request arrives and shared (one
//! `Arc`) by everything that learns something about it: the walk (task,
//! serving target, counts), the attempts (the upstream's request id, the
//! model that answered), the accounting (tokens, cost) and, for a stream,
//! the relay (time to first token, the end-of-stream verdict). When the last
//! holder lets go — the response head is out, or the stream has ended — the
//! access-log line is written and the server span gets its attributes and
//! ends. So a line is written exactly once for every request, cancelled ones
//! included.
//!
//! Span layout (GenAI semantic conventions, plus `switchyard.*`):
//!
//! ```text
//! chat {requested model}     SERVER  one per request; parent: the caller's traceparent
//!   ├ event skip             a target left out without a call, and why
//!   ├ chat {upstream model}  CLIENT  attempt 1: rule and action when it failed
//!   ├ event failover         from, to, reason
//!   └ chat {upstream model}  CLIENT  attempt 2, ...; its context goes upstream as traceparent
//! ```
//!
//! Later kinds of attempt (a continuation after a broken stream, a hedged
//! second call) are further CLIENT spans made with [`RequestTrace::attempt`]
//! and told apart by an attribute (`switchyard.attempt.kind`); events on the
//! server span about them go through [`event`]. Neither exists yet.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use compact_str::CompactString;
use http::header::{HeaderMap, HeaderValue};
use opentelemetry::trace::{Status, TraceContextExt};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{tracing_on, OTEL_TARGET};

/// Response headers that carry an upstream's own id for the call, in the
/// order they are looked for (OpenAI, Azure / others, Anthropic).
const UPSTREAM_ID_HEADERS: [&str; 3] = ["x-request-id", "request-id", "anthropic-request-id"];
/// Longest upstream id or model name recorded (the rest is cut).
const MAX_TEXT: usize = 128;

/// One request's telemetry record; clones share it.
#[derive(Debug, Clone)]
pub struct RequestTrace(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// The span log lines of the request carry (`request{request_id=...}`).
    log: Span,
    /// The server span; `Span::none()` with tracing off.
    span: Span,
    request_id: HeaderValue,
    arrival: Instant,
    access_log: bool,
    fields: Mutex<Fields>,
}

/// What is known about the request so far. Names and ids are
/// `CompactString`s: the usual ones (24 bytes or less) are stored inline, so
/// recording them allocates nothing on the hot path.
#[derive(Debug, Default)]
struct Fields {
    task: Option<CompactString>,
    requested_model: Option<CompactString>,
    stream: bool,
    status: u16,
    target: Option<CompactString>,
    provider: Option<CompactString>,
    attempts: u32,
    failovers: u32,
    degraded: bool,
    error: Option<Cow<'static, str>>,
    ttft: Option<Duration>,
    /// Prompt and completion tokens (reported, else estimated) and their cost.
    usage: Option<(u64, u64, f64)>,
    model: Option<CompactString>,
    /// Kept with tracing on only (the access log does not show them).
    finish_reasons: Vec<String>,
    upstream_id: Option<CompactString>,
    stream_end: Option<&'static str>,
    /// Targets left out without a call, as `target:reason,...`.
    skipped: String,
    /// GenAI's operation name (`chat`, `embeddings`); `chat` until routed.
    operation: Option<&'static str>,
    /// The client's protocol at the front door, when not Chat Completions
    /// (`messages`, `responses`).
    protocol: Option<&'static str>,
    /// What a task's cache did for it (`hit`, `miss`, `stale`, `bypass`).
    cache: Option<&'static str>,
}

/// What the attempt spans need to know about their target.
#[derive(Debug, Clone, Copy)]
pub struct AttemptInfo<'a> {
    /// The target's name in routes.yaml.
    pub target: &'a str,
    /// Its provider's name.
    pub provider: &'a str,
    /// The provider's protocol (`openai`, `anthropic`): `gen_ai.provider.name`.
    pub protocol: &'static str,
    /// The upstream's model name.
    pub model: &'a str,
    /// The upstream's host and port.
    pub host: Option<&'a str>,
    /// The port, if the URL names or implies one.
    pub port: Option<u16>,
    /// 1 for the request's first upstream call, then 2, 3, ... across targets.
    pub number: u32,
    /// GenAI's operation name: `chat` or `embeddings`.
    pub operation: &'static str,
}

/// What the loop decided about a failed attempt.
#[derive(Debug, Clone, Copy)]
pub struct AttemptFailure<'a> {
    /// The outcome label (`5xx`, `reset`, `in_band_error`, ...): `error.type`.
    pub outcome: &'static str,
    /// The upstream status, if it answered one.
    pub status: Option<u16>,
    /// The error-class rule that classified it.
    pub rule: &'a str,
    /// What happens next: `retry`, `failover` or `return`.
    pub action: &'static str,
}

impl RequestTrace {
    /// The record of a request that just arrived, whose log lines carry
    /// `log` (which gets a `trace_id` field with tracing on). With tracing
    /// on, its server span too: the child of the caller's `traceparent` if
    /// valid, else a new trace's root.
    #[must_use]
    pub fn start(
        headers: &HeaderMap,
        request_id: &HeaderValue,
        arrival: Instant,
        access_log: bool,
        log: Span,
    ) -> Self {
        let span = if tracing_on() {
            // Inside `log`, so that log lines written in it (relayed streams
            // included) still carry the request's id.
            let span = log.in_scope(|| {
                tracing::info_span!(target: OTEL_TARGET, "request",
                    otel.name = "chat", otel.kind = "server")
            });
            if let Some(parent) = super::extract(headers) {
                let _ = span.set_parent(parent);
            }
            let id = String::from_utf8_lossy(request_id.as_bytes()).into_owned();
            span.set_attribute("switchyard.request_id", id);
            let cx = span.context();
            log.record(
                "trace_id",
                tracing::field::display(cx.span().span_context().trace_id()),
            );
            span
        } else {
            Span::none()
        };
        Self(Arc::new(Inner {
            log,
            span,
            request_id: request_id.clone(),
            arrival,
            access_log,
            fields: Mutex::new(Fields::default()),
        }))
    }

    /// The server span, to run the request in (disabled with tracing off).
    #[must_use]
    pub fn span(&self) -> &Span {
        &self.0.span
    }

    /// The span the request's log lines carry; a relayed stream enters it
    /// around its attempt span, which log lines do not show.
    #[must_use]
    pub fn log_span(&self) -> &Span {
        &self.0.log
    }

    /// The trace id, with tracing on (for log lines).
    #[must_use]
    pub fn trace_id(&self) -> Option<String> {
        if self.0.span.is_disabled() {
            return None;
        }
        let cx = self.0.span.context();
        let id = cx.span().span_context().trace_id();
        Some(id.to_string())
    }

    /// The task the request selected, the model it asked for, and whether it streams.
    pub fn routed(
        &self,
        operation: &'static str,
        task: &str,
        requested_model: Option<&str>,
        stream: bool,
    ) {
        let mut f = self.0.fields.lock();
        f.task = Some(task.into());
        f.requested_model = requested_model.map(clip);
        f.stream = stream;
        f.operation = Some(operation);
        if !self.0.span.is_disabled() {
            // GenAI's `{operation} {model}`; the span started on arrival,
            // before the body named the model, so it is renamed.
            let name = format!("{operation} {}", requested_model.map_or(task, clip_str));
            self.0.span.context().span().update_name(name);
        }
    }

    /// The protocol the client speaks, when it is not Chat Completions.
    pub fn protocol(&self, protocol: &'static str) {
        self.0.fields.lock().protocol = Some(protocol);
    }

    /// What the task's cache did for the request.
    pub fn cache(&self, result: &'static str) {
        self.0.fields.lock().cache = Some(result);
    }

    /// The status the client got (a stream: at its commit point).
    pub fn status(&self, status: u16) {
        self.0.fields.lock().status = status;
    }

    /// Who served and how the walk went.
    pub fn served(
        &self,
        target: Option<(&str, &str)>,
        attempts: u32,
        failovers: u32,
        degraded: bool,
    ) {
        let mut f = self.0.fields.lock();
        f.target = target.map(|(t, _)| t.into());
        f.provider = target.map(|(_, p)| p.into());
        f.attempts = attempts;
        f.failovers = failovers;
        f.degraded = degraded;
    }

    /// The walk's counts so far, unless the record has more already (it was
    /// told who served, or a continuation added calls).
    pub fn at_least(&self, attempts: u32, failovers: u32) {
        let mut f = self.0.fields.lock();
        f.attempts = f.attempts.max(attempts);
        f.failovers = f.failovers.max(failovers);
    }

    /// Upstream calls made after the walk (a continuation's): counted on the
    /// record; returns the count, the last call's number.
    pub fn more_attempts(&self, calls: u32) -> u32 {
        let mut f = self.0.fields.lock();
        f.attempts = f.attempts.saturating_add(calls);
        f.attempts
    }

    /// A broken stream carried on by another target: the record names the
    /// target that finished the answer.
    pub fn continued(&self, target: &str, provider: &str) {
        let mut f = self.0.fields.lock();
        f.target = Some(target.into());
        f.provider = Some(provider.into());
        f.failovers += 1;
        f.degraded = true;
    }

    /// Targets the walk left out without a call, and why (each once).
    pub fn skipped(&self, skipped: &[(CompactString, &'static str)]) {
        if skipped.is_empty() {
            return;
        }
        let mut f = self.0.fields.lock();
        for (target, reason) in skipped {
            let entry = format!("{target}:{reason}");
            if !f.skipped.split(',').any(|e| e == entry) {
                if !f.skipped.is_empty() {
                    f.skipped.push(',');
                }
                f.skipped.push_str(&entry);
            }
        }
    }

    /// The walk starts again (after a wait in a queue): the error it
    /// answered before is not the request's any more.
    pub fn walk_again(&self) {
        self.0.fields.lock().error = None;
    }

    /// switchyard's own error code (`all_targets_failed`, ...): `error.type`.
    pub fn error(&self, code: &'static str) {
        self.0.fields.lock().error = Some(Cow::Borrowed(code));
    }

    /// Tokens booked for the answer, and their cost; also on the current
    /// (attempt) span.
    pub fn usage(&self, input: u64, output: u64, usd: f64) {
        self.0.fields.lock().usage = Some((input, output, usd));
        if tracing_on() {
            let span = Span::current();
            span.set_attribute("gen_ai.usage.input_tokens", to_i64(input));
            span.set_attribute("gen_ai.usage.output_tokens", to_i64(output));
        }
    }

    /// A stream reached its commit point: the time to first token, and an
    /// event on the current (attempt) span. Returns the time to first token
    /// the first time; `None` when a continuation commits again (the
    /// client's first token was the first commit's).
    pub fn committed(&self) -> Option<Duration> {
        let ttft = self.0.arrival.elapsed();
        let first = {
            let mut f = self.0.fields.lock();
            let first = f.ttft.is_none();
            f.ttft.get_or_insert(ttft);
            first
        };
        if tracing_on() {
            let ttft_ms = KeyValue::new("switchyard.time_to_first_token_ms", millis(ttft));
            event("commit", vec![ttft_ms]);
        }
        first.then_some(ttft)
    }

    /// An answer's body (a completion) or one stream chunk: the model that
    /// answered and the finish reasons, on the record and the current span.
    /// Only parsed when something will show it; says whether it named a
    /// model (or nothing needs one), so a stream stops asking.
    pub fn answer_meta(&self, json: &[u8]) -> bool {
        if !self.0.access_log && !tracing_on() {
            return true;
        }
        let tracing = tracing_on();
        // Without spans only the model is shown: the choices are not read.
        let meta = if tracing {
            serde_json::from_slice::<Meta<'_>>(json)
        } else {
            serde_json::from_slice::<ModelOnly<'_>>(json).map(|m| Meta {
                model: m.model.and_then(text),
                choices: Vec::new(),
            })
        };
        let Ok(meta) = meta else {
            return false;
        };
        let model = meta.model.as_deref().map(clip);
        let reasons: Vec<String> = meta
            .choices
            .iter()
            .filter_map(|c| c.finish_reason.as_deref().map(|r| clip_str(r).to_owned()))
            .collect();
        if tracing {
            let span = Span::current();
            if let Some(model) = &model {
                span.set_attribute("gen_ai.response.model", model.to_string());
            }
            if !reasons.is_empty() {
                span.set_attribute("gen_ai.response.finish_reasons", string_array(&reasons));
            }
        }
        let named = model.is_some();
        let mut f = self.0.fields.lock();
        if model.is_some() {
            f.model = model;
        }
        if !reasons.is_empty() {
            f.finish_reasons = reasons;
        }
        named
    }

    /// Whether a stream's finishing chunk has anything to show: its finish
    /// reasons (spans only), or the model when no chunk named it yet.
    #[must_use]
    pub fn wants_finish(&self) -> bool {
        tracing_on() || (self.0.access_log && self.0.fields.lock().model.is_none())
    }

    /// As [`RequestTrace::answer_meta`], with the answer's `model` already
    /// read (by `classify::read_answer`): only spans, which show the finish
    /// reasons too, read the answer again.
    pub fn answer_model(&self, json: &[u8], model: Option<CompactString>) -> bool {
        if tracing_on() {
            return self.answer_meta(json);
        }
        let named = model.is_some();
        if self.0.access_log && named {
            self.0.fields.lock().model = model;
        }
        named
    }

    /// A model name as the access log and the spans keep it (clipped),
    /// read from its raw JSON.
    #[must_use]
    pub fn model_name(raw: &RawValue) -> Option<CompactString> {
        text(raw).map(|m| clip(&m))
    }

    /// A model name as the access log and the spans keep it (clipped).
    #[must_use]
    pub fn model_named(name: &str) -> CompactString {
        clip(name)
    }

    /// An upstream's response head: its own request id, on the record and
    /// the current (attempt) span.
    pub fn upstream_head(&self, headers: &HeaderMap) {
        let Some(id) = UPSTREAM_ID_HEADERS
            .iter()
            .find_map(|name| headers.get(*name)?.to_str().ok())
            .map(clip)
        else {
            return;
        };
        if tracing_on() {
            Span::current().set_attribute("switchyard.upstream.request_id", id.to_string());
        }
        self.0.fields.lock().upstream_id = Some(id);
    }

    /// How a committed stream ended (`complete`, `client_gone` or the
    /// interruption's reason); an interruption marks the current span failed.
    pub fn stream_end(&self, verdict: &'static str, interrupted: bool) {
        self.0.fields.lock().stream_end = Some(verdict);
        if tracing_on() {
            let span = Span::current();
            span.set_attribute("switchyard.stream.end", verdict);
            if interrupted {
                span.set_attribute("error.type", "stream_interrupted");
                span.set_status(Status::error(format!("stream interrupted: {verdict}")));
            }
        }
    }

    /// A CLIENT span for one upstream call, a child of the current span;
    /// disabled with tracing off. Run the call in it (`Instrument`).
    #[must_use]
    pub fn attempt(&self, a: &AttemptInfo<'_>) -> Span {
        if self.0.span.is_disabled() {
            return Span::none();
        }
        let span = tracing::info_span!(target: OTEL_TARGET, "attempt",
            otel.name = %format_args!("{} {}", a.operation, clip_str(a.model)), otel.kind = "client");
        span.set_attribute("gen_ai.operation.name", a.operation);
        span.set_attribute("gen_ai.provider.name", a.protocol);
        span.set_attribute("gen_ai.system", a.protocol);
        span.set_attribute("gen_ai.request.model", clip_str(a.model).to_owned());
        span.set_attribute("switchyard.target", a.target.to_owned());
        span.set_attribute("switchyard.provider", a.provider.to_owned());
        span.set_attribute("switchyard.attempt", i64::from(a.number));
        if let Some(host) = a.host {
            span.set_attribute("server.address", host.to_owned());
        }
        if let Some(port) = a.port {
            span.set_attribute("server.port", i64::from(port));
        }
        span
    }
}

/// A failed attempt: its outcome, the rule that classified it and the action
/// the loop takes, on its span.
pub fn attempt_failed(span: &Span, failure: &AttemptFailure<'_>) {
    if span.is_disabled() {
        return;
    }
    span.set_attribute("error.type", failure.outcome);
    span.set_attribute("switchyard.outcome", failure.outcome);
    span.set_attribute("switchyard.rule", failure.rule.to_owned());
    span.set_attribute("switchyard.action", failure.action);
    if let Some(status) = failure.status {
        span.set_attribute("http.response.status_code", i64::from(status));
    }
    span.set_status(Status::error(format!(
        "{} ({}): {}",
        failure.outcome, failure.rule, failure.action
    )));
}

/// An attempt that answered (or committed its stream) with `status`.
pub fn attempt_served(span: &Span, status: u16) {
    if span.is_disabled() {
        return;
    }
    span.set_attribute("switchyard.outcome", "success");
    span.set_attribute("http.response.status_code", i64::from(status));
}

/// An attempt that ran out of the task's deadline, or whose answer broke
/// the tool call contract (`outcome`: `deadline`, `contract_violation`).
pub fn attempt_abandoned(span: &Span, outcome: &'static str, action: &'static str) {
    if span.is_disabled() {
        return;
    }
    span.set_attribute("error.type", outcome);
    span.set_attribute("switchyard.outcome", outcome);
    span.set_attribute("switchyard.action", action);
    span.set_status(Status::error(outcome));
}

/// An event with attributes on the current span (the server span during the
/// walk, an attempt span during a call). Nothing with tracing off.
pub fn event(name: &'static str, attributes: Vec<KeyValue>) {
    if tracing_on() {
        Span::current().add_event(name, attributes);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let elapsed = self.arrival.elapsed();
        let f = self.fields.get_mut();
        if f.status == 0 {
            // Nothing was answered: the client went away first (nginx's 499).
            f.status = 499;
            // Whatever an earlier walk answered, nothing reached the client.
            f.error = Some(Cow::Borrowed("client_cancelled"));
        }
        if f.error.is_none() && f.status >= 400 {
            f.error = Some(Cow::Owned(f.status.to_string()));
        }
        let trace_id = (!self.span.is_disabled()).then(|| {
            record_server_span(&self.span, f, elapsed);
            // A span ends when it was last exited: a stream's server span
            // was last entered at its commit point, so it is entered once
            // more now, to end with the stream.
            drop(self.span.enter());
            self.span
                .context()
                .span()
                .span_context()
                .trace_id()
                .to_string()
        });
        if self.access_log {
            access_line(&self.request_id, f, elapsed, trace_id.as_deref());
        }
    }
}

/// Writes what the request came to onto its server span, which then ends.
fn record_server_span(span: &Span, f: &Fields, elapsed: Duration) {
    let set = |key: &'static str, value: Value| span.set_attribute(key, value);
    let operation = f.operation.unwrap_or("chat");
    set("gen_ai.operation.name", operation.into());
    set("http.request.method", "POST".into());
    let route = match (operation, f.protocol) {
        (_, Some("messages")) => "/v1/messages",
        (_, Some("responses")) => "/v1/responses",
        ("embeddings", _) => "/v1/embeddings",
        _ => "/v1/chat/completions",
    };
    set("http.route", route.into());
    set("http.response.status_code", i64::from(f.status).into());
    set("switchyard.attempts", i64::from(f.attempts).into());
    set("switchyard.failovers", i64::from(f.failovers).into());
    set("switchyard.degraded", f.degraded.into());
    set("switchyard.stream", f.stream.into());
    set("switchyard.duration_ms", millis(elapsed).into());
    if let Some(cache) = f.cache {
        set("switchyard.cache", cache.into());
    }
    let text = |key: &'static str, value: &Option<CompactString>| {
        if let Some(v) = value {
            set(key, v.to_string().into());
        }
    };
    text("gen_ai.request.model", &f.requested_model);
    text("gen_ai.response.model", &f.model);
    text("switchyard.task", &f.task);
    text("switchyard.target", &f.target);
    text("switchyard.provider", &f.provider);
    text("switchyard.upstream.request_id", &f.upstream_id);
    if let Some((input, output, usd)) = f.usage {
        set("gen_ai.usage.input_tokens", to_i64(input).into());
        set("gen_ai.usage.output_tokens", to_i64(output).into());
        set("switchyard.cost_usd", usd.into());
    }
    if !f.finish_reasons.is_empty() {
        set(
            "gen_ai.response.finish_reasons",
            string_array(&f.finish_reasons),
        );
    }
    if let Some(ttft) = f.ttft {
        set("switchyard.time_to_first_token_ms", millis(ttft).into());
    }
    if let Some(end) = f.stream_end {
        set("switchyard.stream.end", end.into());
    }
    if let Some(error) = &f.error {
        set("error.type", error.to_string().into());
    }
    // A server span fails on the server's errors, not the caller's (HTTP
    // semantic conventions); a broken stream fails it whatever its status.
    let interrupted = f
        .stream_end
        .is_some_and(|e| e != "complete" && e != "client_gone");
    if f.status >= 500 || interrupted {
        let why = f.error.as_deref().unwrap_or("stream_interrupted");
        span.set_status(Status::error(why.to_owned()));
    }
}

/// The access-log line of a finished request.
fn access_line(request_id: &HeaderValue, f: &Fields, elapsed: Duration, trace_id: Option<&str>) {
    let (tokens_in, tokens_out, cost_usd) = match f.usage {
        Some((i, o, usd)) => (Some(i), Some(o), Some(usd)),
        None => (None, None, None),
    };
    super::access::write(&super::access::Record {
        request_id: request_id.to_str().unwrap_or("-"),
        task: f.task.as_deref().unwrap_or("-"),
        target: f.target.as_deref().unwrap_or("-"),
        provider: f.provider.as_deref(),
        status: f.status,
        attempts: f.attempts,
        failovers: f.failovers,
        degraded: f.degraded,
        stream: f.stream,
        protocol: f.protocol,
        cache: f.cache,
        duration_ms: millis(elapsed),
        ttft_ms: f.ttft.map(millis),
        tokens_in,
        tokens_out,
        cost_usd,
        model: f.model.as_deref(),
        upstream_request_id: f.upstream_id.as_deref(),
        stream_end: f.stream_end,
        skipped: (!f.skipped.is_empty()).then_some(f.skipped.as_str()),
        error: f.error.as_deref(),
        trace_id,
    });
}

/// The parts of a completion or chunk the telemetry shows (strings borrowed
/// from the body unless they hold escapes).
#[derive(Deserialize)]
struct Meta<'a> {
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    choices: Vec<MetaChoice<'a>>,
}

#[derive(Deserialize)]
struct MetaChoice<'a> {
    #[serde(borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// What the access log alone needs of an answer: the model's raw JSON (a
/// `Cow` inside an `Option` would always be copied).
#[derive(Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
}

/// A raw JSON string, borrowed when it holds no escapes.
fn text(raw: &RawValue) -> Option<Cow<'_, str>> {
    match serde_json::from_str::<&str>(raw.get()) {
        Ok(plain) => Some(Cow::Borrowed(plain)),
        Err(_) => serde_json::from_str::<String>(raw.get())
            .ok()
            .map(Cow::Owned),
    }
}

/// Milliseconds with microsecond precision.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// At most [`MAX_TEXT`] characters of an upstream-supplied string.
fn clip(text: &str) -> CompactString {
    clip_str(text).into()
}

fn clip_str(text: &str) -> &str {
    match text.char_indices().nth(MAX_TEXT) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

fn string_array(items: &[String]) -> Value {
    Value::Array(Array::String(
        items.iter().cloned().map(StringValue::from).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_reads_model_and_finish_reasons_of_completions_and_chunks() {
        let m: Meta = serde_json::from_slice(
            br#"{"model":"m-1","choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}"#,
        )
        .unwrap();
        assert_eq!(m.model.as_deref(), Some("m-1"));
        assert_eq!(m.choices[0].finish_reason.as_deref(), Some("stop"));
        let m: Meta = serde_json::from_slice(br#"{"choices":[{"delta":{}}]}"#).unwrap();
        assert!(m.model.is_none() && m.choices[0].finish_reason.is_none());
    }

    #[test]
    fn the_model_alone_is_read_borrowed_and_escapes_still_decode() {
        let m: ModelOnly = serde_json::from_slice(br#"{"choices":[],"model":"m-1"}"#).unwrap();
        assert!(matches!(m.model.and_then(text), Some(Cow::Borrowed("m-1"))));
        let m: ModelOnly = serde_json::from_slice(br#"{"model":"m\u002d2"}"#).unwrap();
        assert_eq!(m.model.and_then(text).as_deref(), Some("m-2"));
        let m: ModelOnly = serde_json::from_slice(br#"{"model":7}"#).unwrap();
        assert!(m.model.and_then(text).is_none());
    }

    #[test]
    fn long_upstream_text_is_clipped() {
        assert_eq!(clip(&"é".repeat(300)).chars().count(), MAX_TEXT);
        assert_eq!(clip("short"), "short");
        assert!((millis(Duration::from_micros(1500)) - 1.5).abs() < 1e-9);
    }
}
