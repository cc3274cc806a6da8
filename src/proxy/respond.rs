//! What the client is told: the `x-switchyard-*` headers, switchyard's own
//! errors in OpenAI format, and upstream errors passed on, sanitized.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use tracing::debug;

use crate::body::{self, Body};
use crate::error::{error_body, GatewayError};
use crate::snapshot::{Snapshot, Target};

/// Response header: the target that served the answer.
pub const H_TARGET: &str = "x-switchyard-target";
/// Response header: its provider.
pub const H_PROVIDER: &str = "x-switchyard-provider";
/// Response header: upstream calls made for this request.
pub const H_ATTEMPTS: &str = "x-switchyard-attempts";
/// Response header: switches to another target.
pub const H_FAILOVERS: &str = "x-switchyard-failovers";
/// Response header: `true` when the serving target is not the chain's first.
pub const H_DEGRADED: &str = "x-switchyard-degraded";
/// Request/response header: the request id (taken from the client or generated).
pub const H_REQUEST_ID: &str = "x-request-id";
/// Request header: choose a task by name.
pub const H_TASK_TYPE: &str = "x-task-type";

/// The task a request's `x-task-type` names; an empty one names none (the
/// request is routed by its `model`).
#[must_use]
pub fn task_header(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(H_TASK_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|name| !name.is_empty())
}
/// Response header: how a hedged request went (`won`: the hedge answered,
/// `lost`: the first attempt did, `cancelled`: neither).
pub const H_HEDGE: &str = "x-switchyard-hedge";
/// How an answer that broke the contract was repaired (`syntax`).
pub const H_REPAIRED: &str = "x-switchyard-repaired";
/// Response header the official SDKs read before retrying on their own.
pub const H_SHOULD_RETRY: &str = "x-should-retry";
/// Response header of a task with a cache: `hit`, `miss`, `stale` or `bypass`.
pub const H_CACHE: &str = "x-switchyard-cache";
/// Response header of a semantic hit: the cosine similarity of its prompt.
pub const H_CACHE_SIMILARITY: &str = "x-switchyard-cache-similarity";

// The same names as `HeaderName`s: inserting a `&str` name that is not a
// standard header copies it into a new allocation on every call.
const N_TARGET: HeaderName = HeaderName::from_static(H_TARGET);
const N_PROVIDER: HeaderName = HeaderName::from_static(H_PROVIDER);
const N_ATTEMPTS: HeaderName = HeaderName::from_static(H_ATTEMPTS);
const N_FAILOVERS: HeaderName = HeaderName::from_static(H_FAILOVERS);
const N_DEGRADED: HeaderName = HeaderName::from_static(H_DEGRADED);
const N_REQUEST_ID: HeaderName = HeaderName::from_static(H_REQUEST_ID);
const N_HEDGE: HeaderName = HeaderName::from_static(H_HEDGE);
const N_REPAIRED: HeaderName = HeaderName::from_static(H_REPAIRED);
const N_SHOULD_RETRY: HeaderName = HeaderName::from_static(H_SHOULD_RETRY);
const N_CACHE: HeaderName = HeaderName::from_static(H_CACHE);
const N_CACHE_SIMILARITY: HeaderName = HeaderName::from_static(H_CACHE_SIMILARITY);

/// Headers of a response switchyard makes: its own, plus the few hyper adds,
/// without growing the map.
const RESPONSE_HEADERS: usize = 12;

/// A count as a header value: the small ones (nearly every request) are
/// static, so writing them allocates nothing.
fn count_value(n: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    usize::try_from(n)
        .ok()
        .and_then(|i| SMALL.get(i))
        .map_or_else(|| HeaderValue::from(n), |s| HeaderValue::from_static(s))
}

/// How the walk along the chain went, for the headers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    /// Upstream calls made, retries included.
    pub attempts: u32,
    /// Switches to another target.
    pub failovers: u32,
}

impl Tally {
    pub(crate) fn write(self, h: &mut HeaderMap, request_id: &HeaderValue) {
        h.insert(N_ATTEMPTS, count_value(self.attempts));
        h.insert(N_FAILOVERS, count_value(self.failovers));
        h.insert(N_REQUEST_ID, request_id.clone());
    }
}

/// Says how an answer was repaired to keep the contract (`x-switchyard-repaired`).
pub fn repaired(resp: &mut Response<Body>, method: crate::schema::Repair) {
    resp.headers_mut()
        .insert(N_REPAIRED, HeaderValue::from_static(method.as_str()));
}

/// Marks how a hedged request went (`x-switchyard-hedge`).
pub fn hedge_result(resp: &mut Response<Body>, result: &'static str) {
    resp.headers_mut()
        .insert(N_HEDGE, HeaderValue::from_static(result));
}

/// Says what the task's cache did (`x-switchyard-cache`), and for an answer
/// it served, its age in seconds (`age`).
pub fn cache_result(resp: &mut Response<Body>, result: &'static str, age: Option<u64>) {
    let h = resp.headers_mut();
    h.insert(N_CACHE, HeaderValue::from_static(result));
    if let Some(age) = age {
        h.insert(http::header::AGE, HeaderValue::from(age));
    }
}

/// How similar a semantic match's prompt was (`x-switchyard-cache-similarity`).
pub fn cache_similarity(resp: &mut Response<Body>, similarity: f64) {
    if let Ok(v) = HeaderValue::from_str(&format!("{similarity:.4}")) {
        resp.headers_mut().insert(N_CACHE_SIMILARITY, v);
    }
}

/// The headers of an answer no upstream call made (a cached one).
pub fn no_calls(resp: &mut Response<Body>, request_id: &HeaderValue) {
    Tally::default().write(resp.headers_mut(), request_id);
}

/// Adds the headers of an answer served (or relayed) by `target`.
pub fn decorate(
    resp: &mut Response<Body>,
    target: &Target,
    degraded: bool,
    tally: Tally,
    request_id: &HeaderValue,
) {
    let h = resp.headers_mut();
    if let Some(v) = &target.name_header {
        h.insert(N_TARGET, v.clone());
    }
    if let Some(v) = &target.provider.name_header {
        h.insert(N_PROVIDER, v.clone());
    }
    h.insert(
        N_DEGRADED,
        HeaderValue::from_static(if degraded { "true" } else { "false" }),
    );
    tally.write(h, request_id);
}

/// A non-streamed answer: the upstream's status and body, as JSON.
#[must_use]
pub fn completion(status: StatusCode, bytes: Bytes) -> Response<Body> {
    let mut resp = Response::new(body::full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().reserve(RESPONSE_HEADERS);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// A committed stream.
#[must_use]
pub fn stream(body: Body) -> Response<Body> {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.reserve(RESPONSE_HEADERS);
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// An OpenAI-format error response made by switchyard, before or without any
/// routing. Errors that need no retry from the client (switchyard already
/// retried and failed over, or a retry cannot help) carry
/// `x-should-retry: false`, which the official SDKs honour, so a client does
/// not multiply the upstream calls; those that are worth a retry carry
/// `Retry-After`.
#[must_use]
pub fn plain_error(e: &GatewayError, request_id: &HeaderValue) -> Response<Body> {
    let mut resp = completion(e.status(), e.body());
    let h = resp.headers_mut();
    h.insert(N_REQUEST_ID, request_id.clone());
    if !e.retryable() {
        h.insert(N_SHOULD_RETRY, HeaderValue::from_static("false"));
    }
    if let Some(wait) = e.retry_after() {
        h.insert(RETRY_AFTER, HeaderValue::from(wait));
    }
    if let GatewayError::MethodNotAllowed(methods) = e {
        h.insert(http::header::ALLOW, HeaderValue::from_static(methods));
    }
    resp
}

/// switchyard's own error after routing: the configured friendly message for
/// its status, if any, and the walk's counts.
#[must_use]
pub fn gateway_error(
    snapshot: &Snapshot,
    e: &GatewayError,
    tally: Tally,
    request_id: &HeaderValue,
) -> Response<Body> {
    let mut resp = plain_error(e, request_id);
    if let Some(msg) = snapshot.sanitizer.message_for(e.status().as_u16()) {
        *resp.body_mut() = body::full(error_body(msg, e.error_type(), e.code()));
    }
    tally.write(resp.headers_mut(), request_id);
    resp
}

/// An upstream error given to the client (`return`, or a context-length
/// error with no larger target): an OpenAI-format body scrubbed of the
/// provider's keys (whole, or its first 8 / last 4 characters in a masked or
/// key-like word), sensitive words, upstream hosts and key-like strings,
/// masked ones included (with the configured friendly message, if any);
/// anything else (HTML, text) is replaced, never copied raw. The original
/// goes to the debug log, keys redacted the same way.
#[must_use]
pub fn upstream_error(
    snapshot: &Snapshot,
    status: StatusCode,
    body: &Bytes,
    target: &Target,
) -> Response<Body> {
    completion(status, upstream_error_body(snapshot, status, body, target))
}

/// A context-length error for the client, as [`upstream_error`], with
/// OpenAI's `code: context_length_exceeded` (and `param: messages`) where the
/// provider said it in words only, so that SDKs and agents recognise it.
#[must_use]
pub fn context_error(
    snapshot: &Snapshot,
    status: StatusCode,
    body: &Bytes,
    target: &Target,
) -> Response<Body> {
    let bytes = upstream_error_body(snapshot, status, body, target);
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let bytes = match v
        .get_mut("error")
        .and_then(serde_json::Value::as_object_mut)
    {
        Some(error) => {
            if !error.get("code").is_some_and(serde_json::Value::is_string) {
                error.insert("code".into(), "context_length_exceeded".into());
            }
            if error.get("param").is_none_or(serde_json::Value::is_null) {
                error.insert("param".into(), "messages".into());
            }
            Bytes::from(v.to_string())
        }
        None => bytes,
    };
    completion(status, bytes)
}

fn upstream_error_body(
    snapshot: &Snapshot,
    status: StatusCode,
    body: &Bytes,
    target: &Target,
) -> Bytes {
    let sanitizer = &snapshot.sanitizer;
    let keys: Vec<&str> = target.provider.secrets().collect();
    let body = crate::sanitize::redact_secrets(body.clone(), keys.iter().copied());
    debug!(target = %target.name, status = status.as_u16(),
        body = %sanitizer.redact_keys_in_body(&body, &keys), "upstream error returned to the client");
    sanitizer
        .clean_error_body(status.as_u16(), &body, &keys)
        .unwrap_or_else(|| {
            let reason = status.canonical_reason().unwrap_or("error");
            let generic = format!(
                "the upstream rejected the request: {} {reason}",
                status.as_u16()
            );
            let message = sanitizer.message_for(status.as_u16()).unwrap_or(&generic);
            error_body(message, "invalid_request_error", "upstream_rejected")
        })
}
