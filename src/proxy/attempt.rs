//! One upstream call, up to its commit point.
//!
//! A non-streamed answer is read whole (bounded), decoded by the target's
//! protocol adapter and classified; a streaming one is held until its first
//! content chunk (or `[DONE]`, a `finish_reason`, 64 events / 256 KiB), so
//! any failure before that can still fail over invisibly. What comes back is
//! an answer, a committed stream ([`Relay`]), or a classified failure that
//! hands the health permit back for the loop to record.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use compact_str::CompactString;
use http::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use http::StatusCode;
use http_body_util::BodyExt;
use tokio::time::{timeout_at, Instant};
use tracing::{debug, info, warn};

use super::account::Account;
use crate::body;
use crate::classify::{self, AnswerShape, AttemptOutcome, Decision, NetworkKind, Outcome, Scope};
use crate::health::{Failure, HealthConfig, Permit};
use crate::native;
use crate::schema::{CallAssembler, Contract, Repair, Violation, HOLD_MAX_TOOL_BYTES};
use crate::snapshot::{ApiKey, Provider, Snapshot, Target, Task};
use crate::sse::{self, Chunk};
use crate::telemetry::{AttemptInfo, RequestTrace};
use crate::upstream::decode::{self, Coding};
use crate::upstream::pool::Body as UpstreamBody;
use crate::upstream::{pool, Adapter, Events, LocalResource, Operation, Outgoing, SendError};

/// Events held before the commit point, at most; past this the stream commits anyway.
const HOLD_MAX_EVENTS: usize = 64;
/// How long held text waits after its finish for the usage and `[DONE]`.
const AFTER_FINISH: Duration = Duration::from_secs(1);
/// Bytes held before the commit point, at most.
const HOLD_MAX_BYTES: usize = 256 * 1024;
/// Largest non-streamed upstream answer read (and decoded); a larger one is a
/// broken upstream.
const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;
/// Silence before a close that makes it a timeout, at least (else the
/// provider's `connect_timeout`, if longer).
const SILENCE_FLOOR: Duration = Duration::from_secs(1);

/// What one attempt needs to know.
#[derive(Debug)]
pub struct Call<'a> {
    /// The snapshot the request runs against.
    pub snapshot: &'a Snapshot,
    /// Its task.
    pub task: &'a Arc<Task>,
    /// The target called.
    pub target: &'a Arc<Target>,
    /// A streaming request.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// How many choices (`n`): a stream is finished once each has.
    pub choices: u32,
    /// Sent upstream as `x-request-id`.
    pub request_id: &'a HeaderValue,
    /// The client's headers (a protocol forwards some of them).
    pub client_headers: &'a HeaderMap,
    /// When the request arrived.
    pub arrival: Instant,
    /// `total_timeout` from arrival.
    pub deadline: Instant,
    /// The tool call contract this target's answer is held to, if any.
    pub contract: Option<Arc<Contract>>,
    /// Who pays.
    pub account: &'a Account,
    /// The index of the provider key to send with, if it has a readable one.
    pub key: Option<usize>,
    /// What the request asks of the provider.
    pub op: Operation,
    /// Embeddings asked for as base64: vectors a protocol gave as numbers
    /// are encoded (an upstream may ignore the ask, or not have it).
    pub base64: bool,
    /// Counts stale-connection resends (upstream calls too).
    pub resends: &'a AtomicU32,
    /// The target speaks the client's protocol and was sent the client's
    /// body: its answer goes back as it came, beside its chat reading.
    pub native: bool,
    /// A cache keeps the answer (its chat reading).
    pub cached: bool,
}

/// How one attempt ended.
#[derive(Debug)]
pub enum Attempt {
    /// A non-streamed answer: the upstream's status and a `chat.completion` body.
    Answer {
        /// The upstream's (2xx) status.
        status: StatusCode,
        /// The answer.
        body: Bytes,
        /// How it was repaired to keep the contract, if it was.
        repaired: Option<Repair>,
        /// The answer as the target sent it, for a client of its protocol.
        native: Option<native::Answer>,
    },
    /// A stream past its commit point, ready to relay.
    Committed(Box<Commit>),
    /// A failure the error table classified.
    Failed(Failed),
    /// `total_timeout` ran out during the attempt.
    Deadline,
    /// switchyard ran out of a local resource before the request left: no
    /// upstream was called and no verdict is recorded.
    Local(LocalResource),
    /// A well-formed answer that breaks the degraded-answer contract.
    Violated(Box<Violated>),
}

/// A well-formed answer that broke the request's contract.
#[derive(Debug)]
pub struct Violated {
    /// What broke.
    pub violation: Violation,
    /// To record the verdict with.
    pub permit: Permit,
    /// What the answer said (its text and calls), for a re-ask to quote.
    pub answered: String,
    /// The completion itself, for a non-streamed answer, or the one a
    /// held stream's prose makes (a repair that keeps it replaces only its
    /// message).
    pub completion: Option<Bytes>,
}

impl Violated {
    /// The attempt it makes.
    fn attempt(
        violation: Violation,
        permit: Permit,
        answered: String,
        completion: Option<Bytes>,
    ) -> Attempt {
        Attempt::Violated(Box::new(Violated {
            violation,
            permit,
            answered,
            completion,
        }))
    }
}

impl Attempt {
    /// A failure the error table returns to the caller (its request is at
    /// fault): no other target would answer it differently.
    #[must_use]
    pub fn is_for_the_caller(&self) -> bool {
        matches!(self, Attempt::Failed(f) if f.decision.action == crate::classify::Action::Return)
    }
}

/// What the relay carries over from the commit point.
#[derive(Debug)]
pub struct RelayState {
    /// Who pays.
    pub account: Account,
    /// The target streaming.
    pub target: Arc<Target>,
    /// Health thresholds to record the verdict with.
    pub health: HealthConfig,
    /// The upstream's events.
    pub events: Events,
    /// The upstream's body.
    pub incoming: UpstreamBody,
    /// A `finish_reason` was seen.
    pub finished: bool,
    /// `[DONE]` was seen.
    pub done: bool,
    /// The body ended.
    pub eof: bool,
    /// The task's deadline.
    pub deadline: Instant,
    /// The contract still to check at the end (tool calls under validation).
    pub contract: Option<Arc<Contract>>,
    /// Tool call deltas assembled so far.
    pub calls: CallAssembler,
    /// Tool call deltas held until the calls are complete and valid.
    pub tool_held: Vec<sse::Event>,
    /// What `tool_held` holds in memory (bounded by `HOLD_MAX_TOOL_BYTES`).
    pub tool_held_bytes: usize,
    /// The key the stream was asked with (a verdict against the key goes to it).
    pub key: Option<usize>,
    /// Scrubs what an upstream error event says before the client reads it.
    pub sanitizer: Arc<crate::sanitize::Sanitizer>,
}

/// A stream at its commit point: what the relay carries on with.
#[derive(Debug)]
pub struct Commit {
    /// The upstream, its target and its state.
    pub state: RelayState,
    /// What the commit point held back, to go out first.
    pub held: Vec<sse::Event>,
    /// To record the end-of-stream verdict with.
    pub permit: Permit,
    /// How the held tool calls were repaired to keep the contract, if they were.
    pub repaired: Option<Repair>,
}

/// What follows a failed attempt, decided from its verdict alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The provider's next key, on the same target (if one can serve).
    NextKey,
    /// The same target again after the pause.
    Retry(Duration),
    /// The next target.
    Failover,
    /// The upstream's error goes back to the caller.
    Return,
}

/// The one next-step decision after a failed attempt, for the walk, the
/// hedge and a stream's continuation: `return` is the caller's; nothing is
/// tried again at or past the `deadline`; a key-scoped failure sent with a
/// key (`keyed`) moves to the next key; else a retry only if its `pause`
/// (what the retry policy offers, if anything) ends before the deadline and
/// the target will take it then (a cooldown or an open breaker turns it into
/// a failover).
#[must_use]
pub fn next_step(
    decision: &Decision,
    keyed: bool,
    pause: Option<Duration>,
    target: &Target,
    now: Instant,
    deadline: Instant,
) -> Step {
    match decision.action {
        classify::Action::Return => Step::Return,
        classify::Action::Retry | classify::Action::Failover if now >= deadline => Step::Failover,
        classify::Action::Retry | classify::Action::Failover
            if keyed && decision.scope == Scope::Key =>
        {
            Step::NextKey
        }
        classify::Action::Retry | classify::Action::Failover => pause
            .filter(|pause| {
                let at = now + *pause;
                at < deadline && target.health.unavailable(at).is_none()
            })
            .map_or(Step::Failover, Step::Retry),
    }
}

/// Records a classified failure where its rule's scope puts it: against
/// the key it was sent with (a 429 cools the key, a 401 revokes it; the
/// target is not counted), the whole provider (a cooldown for every target of
/// it), or the target (its breaker and cooldown). A key-scoped failure of a
/// call without a key counts against the target.
pub fn record(
    cfg: &HealthConfig,
    target: &Target,
    decision: &Decision,
    outcome: AttemptOutcome,
    permit: Permit,
    key: Option<usize>,
) {
    let now = Instant::now();
    let provider = &target.provider;
    if let Some(window) = provider.shed_after_429.filter(|_| decision.rate_limited) {
        // The account keeps rate limiting: what is left is the critical path's.
        provider.health.shed_until(now + window);
    }
    let used = key.and_then(|i| provider.keys.get(i));
    if let (true, None, Some(auth)) = (decision.until_reload, used, &provider.endpoint.auth) {
        // The identity the upstream refused (a Google token, AWS
        // credentials) is let go: the next call fetches it anew.
        auth.refused();
    }
    let (counted, cooldown) = match (decision.scope, used) {
        (Scope::Key, Some(api_key)) => {
            record_on_key(target, api_key, decision, now);
            (false, None)
        }
        (Scope::Provider, _) => {
            if let Some(cooldown) = decision.cooldown {
                provider
                    .health
                    .cool_down(now, cooldown, decision.rate_limited);
            }
            (decision.health, None)
        }
        (Scope::Key, None) | (Scope::Target, _) => (decision.health, decision.cooldown),
    };
    let failure = Failure::new(
        counted,
        cooldown,
        decision.rate_limited,
        Arc::clone(&decision.rule),
    );
    book(cfg, target, outcome, permit, Some(&failure));
}

/// The one place an attempt's verdict is booked against its target: the
/// attempts series, then its health (a success, or `failure`) and any state
/// change that follows.
pub fn book(
    cfg: &HealthConfig,
    target: &Target,
    outcome: AttemptOutcome,
    permit: Permit,
    failure: Option<&Failure>,
) {
    target.metrics.attempts.increment(outcome.label(), 1);
    let now = Instant::now();
    let transition = match failure {
        None => target.health.record_success(permit, now, cfg),
        Some(failure) => target.health.record_failure(permit, now, failure, cfg),
    };
    target.report(transition);
}

/// A well-formed answer that broke the request's contract: the upstream
/// answered, it is the answer that is unusable, so health does not count it.
pub fn book_violation(cfg: &HealthConfig, target: &Target, permit: Permit) {
    let failure = Failure::new(false, None, false, Arc::from("contract_violation"));
    book(
        cfg,
        target,
        AttemptOutcome::ContractViolation,
        permit,
        Some(&failure),
    );
}

fn record_on_key(target: &Target, key: &ApiKey, decision: &Decision, now: Instant) {
    let provider = &target.provider;
    key.health.record(
        now,
        decision.cooldown,
        decision.until_reload,
        decision.rate_limited,
        &target.model,
    );
    if decision.until_rotation {
        key.health.pin_revocation();
    }
    key.show_state(now);
    if decision.until_reload && decision.until_rotation {
        warn!(provider = %provider.name, key = %key.name, rule = %decision.rule,
            "API key refused; unusable until a reload or a rotation of its file");
    } else if decision.until_reload {
        warn!(provider = %provider.name, key = %key.name, rule = %decision.rule,
            "API key refused; re-probed with backoff, or back at a reload or a rotation of its file");
    } else {
        debug!(provider = %provider.name, key = %key.name, state = key.health.state(now).as_str(), "API key cooling down");
    }
}

/// What an attempt span says about its target (`number`: the request's nth call).
#[must_use]
pub fn span_info(target: &Target, number: u32, op: Operation) -> AttemptInfo<'_> {
    let url = &target.provider.endpoint.urls.chat;
    AttemptInfo {
        target: &target.name,
        provider: &target.provider.name,
        protocol: target.provider.endpoint.adapter.name(),
        model: &target.model,
        host: url.host(),
        port: url.port_u16().or(match url.scheme_str() {
            Some("https") => Some(443),
            Some(_) | None => Some(80),
        }),
        number,
        operation: op.as_str(),
    }
}

/// A classified failure.
#[derive(Debug)]
pub struct Failed {
    /// What the error table decided.
    pub decision: Decision,
    /// The typed outcome it is counted as.
    pub outcome: AttemptOutcome,
    /// The status the client would hear (an in-band error's own code).
    pub status: Option<u16>,
    /// The upstream's answer (OpenAI format), kept for `return`.
    pub answer: Option<(StatusCode, Bytes)>,
    /// To record the verdict with.
    pub permit: Permit,
}

/// One upstream call. A success records itself (a stream: at its end); a
/// failure hands the permit back to record the verdict with.
pub async fn run(call: &Call<'_>, body: Bytes, permit: Permit) -> Attempt {
    let provider = &call.target.provider;
    let started = Instant::now();
    let attempt_deadline = call.deadline.min(started + provider.timeout);
    let first_deadline = match (call.stream, call.task.budget.first_token_timeout) {
        (true, Some(ftt)) => attempt_deadline.min(started + ftt),
        _ => attempt_deadline,
    };
    let credential = call
        .key
        .and_then(|i| provider.keys.get(i))
        .and_then(|k| k.credential.as_ref());
    // The one place a call is charged to the buckets: it is sent now.
    provider.charge(
        call.key,
        call.target
            .call_tokens(call.account.prompt_estimate, call.account.max_tokens),
        call.task.priority.is_critical(),
    );
    let sent = provider.endpoint.send(Outgoing {
        op: call.op,
        model: &call.target.model,
        credential,
        body,
        request_id: Some(call.request_id),
        client: Some(call.client_headers),
        stream: call.stream,
        native: call.native,
        resends: call.resends,
    });
    let response = match timeout_at(first_deadline, sent).await {
        Err(_) => return timed_out(call, first_deadline, permit),
        Ok(Err(SendError::Upstream(kind))) => {
            let kind = silence_is_timeout(kind, started.elapsed(), provider);
            return network(call.target, kind, permit);
        }
        Ok(Err(SendError::Local(resource))) => {
            // No upstream heard it: the permit goes back unrecorded.
            drop(permit);
            return Attempt::Local(resource);
        }
        Ok(Ok(r)) => r,
    };
    call.account.trace.upstream_head(response.headers());
    if !call.stream {
        call.target
            .health
            .record_latency(Instant::now(), started.elapsed());
    }
    let is_sse = provider
        .endpoint
        .adapter_for(call.native)
        .framing()
        .is_stream(response.headers().get(CONTENT_TYPE));
    if call.stream && response.status().is_success() && is_sse {
        // Rules may claim a 2xx stream by its status or headers before a byte is read.
        let status = response.status().as_u16();
        let outcome = Outcome::Response {
            status,
            headers: response.headers(),
            body: None,
        };
        if let Some(decision) = provider.errors.classify(&outcome) {
            return Attempt::Failed(Failed {
                decision,
                outcome: AttemptOutcome::Status(status),
                status: Some(status),
                answer: None,
                permit,
            });
        }
        let (parts, incoming) = response.into_parts();
        return hold(
            call,
            &parts.headers,
            incoming,
            permit,
            first_deadline,
            started,
        )
        .await;
    }
    // Non-streaming (or an error status, which is never wrapped in a stream).
    let (parts, incoming) = response.into_parts();
    read_answer(call, parts, incoming, permit, attempt_deadline).await
}

/// `headers` with a `Retry-After` of `wait` (whole seconds, rounded up).
fn with_retry_after(headers: &HeaderMap, wait: Duration) -> HeaderMap {
    let mut with = headers.clone();
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    with.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    with
}

/// Reads a non-streamed answer whole (bounded, by the attempt's deadline),
/// undoes its content coding, and classifies it.
async fn read_answer(
    call: &Call<'_>,
    parts: http::response::Parts,
    incoming: UpstreamBody,
    permit: Permit,
    attempt_deadline: Instant,
) -> Attempt {
    let Some(coding) = Coding::of(&parts.headers) else {
        debug!(target = %call.target.name, "answer in a content coding switchyard cannot decode");
        return network(call.target, NetworkKind::Protocol, permit);
    };
    let read = timeout_at(
        attempt_deadline,
        body::read_all(incoming, MAX_UPSTREAM_BODY),
    )
    .await;
    let bytes = match read {
        Err(_) => return timed_out(call, attempt_deadline, permit),
        // Too large, or broken mid-body.
        Ok(Err(body::ReadError::TooLarge)) => {
            return network(call.target, NetworkKind::Protocol, permit)
        }
        Ok(Err(body::ReadError::Body(e))) => {
            return network(call.target, pool::body_error_kind(&e), permit)
        }
        Ok(Ok(bytes)) => bytes,
    };
    let bytes = match coding {
        Coding::Identity => bytes,
        Coding::Gzip | Coding::Deflate | Coding::Brotli | Coding::Zstd => {
            let Ok(decoded) = decode::decode_all(coding, &bytes, MAX_UPSTREAM_BODY) else {
                debug!(target = %call.target.name, ?coding, "undecodable content coding");
                return network(call.target, NetworkKind::Protocol, permit);
            };
            decoded
        }
    };
    answered(call, parts.status, &parts.headers, bytes, permit)
}

/// An error answer, read by its protocol and classified.
fn refused(
    call: &Call<'_>,
    adapter: &dyn Adapter,
    status: StatusCode,
    headers: &HeaderMap,
    bytes: Bytes,
    permit: Permit,
) -> Attempt {
    let error = adapter.decode_error(status, headers, bytes);
    let (status, bytes) = (error.status, error.body);
    let code = status.as_u16();
    // A wait advertised in the body is heard as a `Retry-After`.
    let advertised;
    let headers = match error.wait {
        Some(wait) if !headers.contains_key(http::header::RETRY_AFTER) => {
            advertised = with_retry_after(headers, wait);
            &advertised
        }
        Some(_) | None => headers,
    };
    let outcome = Outcome::Response {
        status: code,
        headers,
        body: Some(&bytes),
    };
    let decision = call.target.provider.errors.classify_failure(&outcome);
    Attempt::Failed(Failed {
        decision,
        outcome: AttemptOutcome::Status(code),
        status: Some(code),
        answer: Some((status, bytes)),
        permit,
    })
}

/// Decodes and classifies a non-streamed answer.
fn answered(
    call: &Call<'_>,
    status: StatusCode,
    headers: &HeaderMap,
    bytes: Bytes,
    permit: Permit,
) -> Attempt {
    let target = call.target;
    let adapter = target.provider.endpoint.adapter_for(call.native);
    let code = status.as_u16();
    if !status.is_success() {
        return refused(call, adapter, status, headers, bytes, permit);
    }
    if let Some((model, usage)) = facts_as_it_came(call, adapter, &bytes) {
        let whole = Whole {
            status,
            chat: None,
            native: Some(bytes),
            model,
            usage: Some(usage),
            repaired: None,
        };
        return accepted(call, headers, whole, permit);
    }
    // Kept only while the answer is as the target sent it.
    let raw = (call.native && call.op == Operation::Chat).then(|| bytes.clone());
    let model = &target.model;
    let decoded = match call.op {
        Operation::Chat => adapter.decode_answer(bytes, model),
        Operation::Embeddings => adapter.decode_embeddings(bytes, model).map(|b| {
            if call.base64 {
                crate::request::as_base64(b)
            } else {
                b
            }
        }),
        // A token count never runs through an attempt.
        Operation::CountTokens => Ok(bytes),
    };
    let bytes = match decoded {
        Ok(b) => b,
        Err(e) => {
            debug!(target = %target.name, error = %e, "undecodable answer");
            return network(target, NetworkKind::Protocol, permit);
        }
    };
    // The shape, and the model and usage for the books, read in one pass.
    let (shape, model, usage) = match call.op {
        Operation::Chat => {
            let read = classify::read_answer(&bytes);
            let model = read.model.and_then(RequestTrace::model_name);
            (read.shape, model, read.usage.and_then(sse::usage_of))
        }
        Operation::Embeddings | Operation::CountTokens => {
            let shape = classify::embeddings_shape(&bytes);
            (shape, None, sse::usage(&bytes))
        }
    };
    if shape != AnswerShape::Completion {
        return not_an_answer(target, code, headers, shape, bytes, permit);
    }
    if call.stream {
        // A whole completion where a stream was asked for (a server that
        // ignores `stream`): relayed, the client's stream reader would see
        // no events at all.
        debug!(target = %target.name, "a completion instead of the stream asked for");
        return network(target, NetworkKind::Protocol, permit);
    }
    let (bytes, repaired, permit) = match keep_contract(call, bytes, permit) {
        Ok(kept) => kept,
        Err(violated) => return Attempt::Violated(violated),
    };
    let whole = Whole {
        status,
        native: raw.filter(|_| repaired.is_none()),
        chat: Some(bytes),
        model,
        usage,
        repaired,
    };
    accepted(call, headers, whole, permit)
}

/// The model and token counts of a target's answer that goes back to the
/// client as it came, when nothing needs its chat reading: no stream, no
/// contract, no cache keeping it, no trace reading it. Then that reading is
/// never written (the adapter reads the facts from the answer itself).
fn facts_as_it_came(
    call: &Call<'_>,
    adapter: &dyn crate::upstream::Adapter,
    bytes: &[u8],
) -> Option<(Option<CompactString>, (u64, u64))> {
    let as_it_came = call.native
        && call.op == Operation::Chat
        && !call.stream
        && !call.cached
        && call.contract.is_none()
        && !crate::telemetry::tracing_on();
    if !as_it_came {
        return None;
    }
    let facts = adapter.answer_facts(bytes)?;
    let model = facts.model.as_deref().map(RequestTrace::model_named);
    Some((model, facts.usage))
}

/// A whole 2xx answer that passed its checks, for [`accepted`].
struct Whole {
    status: StatusCode,
    /// Its chat reading (`None`: the client gets `native`, nothing reads it).
    chat: Option<Bytes>,
    /// The answer as the target sent it, for a client of its protocol.
    native: Option<Bytes>,
    model: Option<CompactString>,
    usage: Option<(u64, u64)>,
    repaired: Option<Repair>,
}

/// The end of a whole answer: header rules may still claim it (body rules
/// never discard one), else it is booked a success, its tokens settled,
/// and it goes back with the provider's secrets redacted.
fn accepted(call: &Call<'_>, headers: &HeaderMap, whole: Whole, permit: Permit) -> Attempt {
    let target = call.target;
    let code = whole.status.as_u16();
    let outcome = Outcome::Response {
        status: code,
        headers,
        body: None,
    };
    if let Some(decision) = target.provider.errors.classify(&outcome) {
        return Attempt::Failed(Failed {
            decision,
            outcome: AttemptOutcome::Status(code),
            status: Some(code),
            answer: None,
            permit,
        });
    }
    let read = whole.chat.as_deref().unwrap_or_default();
    match call.op {
        Operation::Chat => call.account.trace.answer_model(read, whole.model),
        Operation::Embeddings | Operation::CountTokens => call.account.trace.answer_meta(read),
    };
    book(
        &call.snapshot.health,
        target,
        AttemptOutcome::Success,
        permit,
        None,
    );
    settle_usage(call, whole.usage, read);
    let redacted = |bytes| crate::sanitize::redact_secrets(bytes, target.provider.secrets());
    let native = whole.native.map(redacted);
    let body = match (whole.chat, &native) {
        (Some(chat), _) => redacted(chat),
        // Nothing reads the body beside the answer as it came: the same bytes.
        (None, Some(native)) => native.clone(),
        (None, None) => Bytes::new(),
    };
    Attempt::Answer {
        status: whole.status,
        body,
        repaired: whole.repaired,
        native: native.map(native::Answer),
    }
}

/// A non-streamed answer held to the request's contract, when it has one:
/// as it came, or repaired by the task's first repair that makes it keep
/// it. Else the violation, with what the answer said.
fn keep_contract(
    call: &Call<'_>,
    bytes: Bytes,
    permit: Permit,
) -> Result<(Bytes, Option<Repair>, Permit), Box<Violated>> {
    let Some(contract) = &call.contract else {
        return Ok((bytes, None, permit));
    };
    let Err(violation) = contract.check_completion(&bytes) else {
        return Ok((bytes, None, permit));
    };
    match try_repairs(call.task, call.target, &violation, |_| {
        contract.repair_completion(&bytes)
    }) {
        Some((method, fixed)) => Ok((fixed, Some(method), permit)),
        None => {
            // The provider billed the broken answer all the same.
            settle_answer(call, &bytes);
            Err(Box::new(Violated {
                violation,
                permit,
                answered: crate::schema::quoted_completion(&bytes),
                completion: Some(bytes),
            }))
        }
    }
}

/// Books a non-streamed answer's usage: as reported, else estimated from its text.
fn settle_answer(call: &Call<'_>, bytes: &[u8]) {
    settle_usage(call, sse::usage(bytes), bytes);
}

/// As [`settle_answer`], with the reported usage already read.
fn settle_usage(call: &Call<'_>, usage: Option<(u64, u64)>, bytes: &[u8]) {
    let estimate = match usage {
        Some(_) => 0,
        None => crate::tokens::estimate_completion(bytes),
    };
    call.account.settle(call.target, usage, estimate);
}

/// Tries the task's repairs, in order, on an answer of `target` that broke
/// the contract (`violation`); `repair` applies one method: `None` when it
/// has nothing to repair there, else what it made, if that keeps the
/// contract. Each real try is counted, logged with the violation (never the
/// prompt) and put on the trace. The first that works, and what it made.
pub fn try_repairs<T>(
    task: &Task,
    target: &Target,
    violation: &Violation,
    mut repair: impl FnMut(Repair) -> Option<Option<T>>,
) -> Option<(Repair, T)> {
    for &method in task.repairs.iter().filter(|m| m.is_local()) {
        let Some(fixed) = repair(method) else {
            continue;
        };
        count_repair(task, target, method, fixed.is_some(), violation);
        if let Some(fixed) = fixed {
            return Some((method, fixed));
        }
    }
    None
}

/// Counts, logs (with the violation, never the prompt) and traces one
/// repair of `target`'s answer.
pub fn count_repair(
    task: &Task,
    target: &Target,
    method: Repair,
    repaired: bool,
    violation: &Violation,
) {
    let result = if repaired { "repaired" } else { "failed" };
    info!(target = %target.name, method = method.as_str(), result, violation = %violation, "contract repair");
    task.route_metrics(Some(target))
        .repairs
        .increment((method.as_str(), result), 1);
    crate::telemetry::repaired(&target.name, method.as_str(), result);
}

/// A 2xx body that is not a chat completion is an upstream failure: the
/// file's and provider's rules on its real status (`{status: 200, body:
/// ...}`) decide first; else its in-band code (an in-band context-length
/// error reads as 400), else the 502 class.
fn not_an_answer(
    target: &Target,
    code: u16,
    headers: &HeaderMap,
    shape: AnswerShape,
    bytes: Bytes,
    permit: Permit,
) -> Attempt {
    let errors = &target.provider.errors;
    let own = Outcome::Response {
        status: code,
        headers,
        body: Some(&bytes),
    };
    let (classified, outcome) = match shape {
        AnswerShape::InBandError(c) => (
            classify::in_band_status(c, &bytes),
            AttemptOutcome::InBandError,
        ),
        AnswerShape::NotACompletion | AnswerShape::Completion => {
            (502, AttemptOutcome::InvalidAnswer)
        }
    };
    let decision = errors.classify(&own).unwrap_or_else(|| {
        errors.classify_failure(&Outcome::Response {
            status: classified,
            headers,
            body: Some(&bytes),
        })
    });
    // The client never hears a 200 for it: a `return` relays the in-band status.
    let status = StatusCode::from_u16(classified).unwrap_or(StatusCode::BAD_GATEWAY);
    Attempt::Failed(Failed {
        decision,
        outcome,
        status: Some(classified),
        answer: Some((status, bytes)),
        permit,
    })
}

/// A connection closed before any response byte after a long silence is a
/// timeout, not a reset: retrying it would multiply the wait.
fn silence_is_timeout(kind: NetworkKind, silent_for: Duration, provider: &Provider) -> NetworkKind {
    let long = provider.connect_timeout.max(SILENCE_FLOOR);
    match kind {
        NetworkKind::Reset if silent_for >= long => NetworkKind::Timeout,
        NetworkKind::Reset
        | NetworkKind::Connect
        | NetworkKind::Timeout
        | NetworkKind::Tls
        | NetworkKind::Dns
        | NetworkKind::Protocol => kind,
    }
}

/// A network failure, classified by the provider's table.
fn network(target: &Target, kind: NetworkKind, permit: Permit) -> Attempt {
    Attempt::Failed(Failed {
        decision: target
            .provider
            .errors
            .classify_failure(&Outcome::Network(kind)),
        outcome: AttemptOutcome::Network(kind),
        status: None,
        answer: None,
        permit,
    })
}

/// A timer ran out at `at`: the task's deadline, or this attempt's own limit.
fn timed_out(call: &Call<'_>, at: Instant, permit: Permit) -> Attempt {
    if at >= call.deadline {
        Attempt::Deadline
    } else {
        network(call.target, NetworkKind::Timeout, permit)
    }
}

/// What was read of a stream before its commit point.
struct Held {
    /// Events in order; `true` marks a tool call delta held for validation
    /// (it never commits the stream by itself).
    events: Vec<(sse::Event, bool)>,
    bytes: usize,
    calls: CallAssembler,
    finished: bool,
    done: bool,
    /// A chunk naming the answering model was seen (for telemetry).
    meta_seen: bool,
    /// Text is held too: the contract requires a call (prose alone breaks
    /// it) or JSON text (`response_format`), so no text goes out before
    /// the answer is checked.
    prose: bool,
}

impl Held {
    /// The completion the held events make (for a repair, a re-ask, the books).
    fn completion(&self) -> Option<Bytes> {
        let raw = chat_bytes(self.events.iter().map(|(event, _)| event));
        crate::sse::completion_of_events(&raw)
    }
}

/// The chat bytes of some events, for the readers of whole chat streams.
pub fn chat_bytes<'a>(events: impl Iterator<Item = &'a sse::Event>) -> Vec<u8> {
    let mut raw = Vec::new();
    for event in events {
        raw.extend_from_slice(&event.raw);
    }
    raw
}

/// Reads a stream up to its commit point, then hands it to a [`Relay`].
async fn hold(
    call: &Call<'_>,
    headers: &HeaderMap,
    mut incoming: UpstreamBody,
    permit: Permit,
    first_deadline: Instant,
    started: Instant,
) -> Attempt {
    let target = call.target;
    let provider = &target.provider;
    let events = Coding::of(headers).and_then(|coding| {
        Events::new(
            provider.endpoint.adapter_for(call.native),
            &target.model,
            call.include_usage,
            call.choices,
            coding,
            call.native,
        )
        .ok()
    });
    let Some(mut events) = events else {
        return network(target, NetworkKind::Protocol, permit);
    };
    let mut held = Held {
        events: Vec::new(),
        bytes: 0,
        calls: CallAssembler::default(),
        finished: false,
        done: false,
        meta_seen: false,
        prose: call
            .contract
            .as_ref()
            .is_some_and(|c| c.required().is_some() || c.checks_text()),
    };
    let mut eof = false;
    let mut last_read = started;
    let mut finished_at = None;
    loop {
        // Held text waits past its finish for the usage and `[DONE]`, briefly.
        let until = finished_at.map_or(first_deadline, |t: Instant| {
            first_deadline.min(t + AFTER_FINISH)
        });
        let frame = match timeout_at(until, incoming.frame()).await {
            Err(_) | Ok(Some(Err(_))) if held.finished => break,
            Err(_) => return timed_out(call, first_deadline, permit),
            Ok(None) => {
                eof = true;
                events.finish();
                None
            }
            Ok(Some(Err(e))) => {
                let kind = pool::body_error_kind(&e);
                let kind = silence_is_timeout(kind, last_read.elapsed(), provider);
                return network(target, kind, permit);
            }
            Ok(Some(Ok(frame))) => frame.into_data().ok(),
        };
        last_read = Instant::now();
        if let Some(data) = frame {
            if events.push(&data).is_err() || events.pending() > sse::MAX_EVENT_BYTES {
                return network(target, NetworkKind::Protocol, permit);
            }
        }
        let hold = take_events(call, headers, &mut events, &mut held, eof);
        if held.finished {
            finished_at.get_or_insert_with(Instant::now);
        }
        match hold {
            Hold::More if eof && held.finished => break,
            Hold::More if eof => {
                // The stream ended before any content, finish_reason or [DONE].
                return network(target, NetworkKind::Reset, permit);
            }
            Hold::More => {}
            Hold::Commit => break,
            Hold::Fail(decision, status, answer) => {
                return Attempt::Failed(Failed {
                    decision,
                    outcome: AttemptOutcome::StreamError,
                    status: Some(status),
                    answer,
                    permit,
                })
            }
            Hold::Malformed => return network(target, NetworkKind::Protocol, permit),
            Hold::Violated(violation) => {
                return Violated::attempt(violation, permit, String::new(), None)
            }
        }
    }
    commit(call, held, events, incoming, eof, permit, started)
}

/// Where holding a stream stands after the events read so far.
enum Hold {
    More,
    Commit,
    /// An in-band error event: its decision, the status it reads as, and the
    /// error (an OpenAI error body) to give the client if nothing else serves.
    Fail(Decision, u16, Option<(StatusCode, Bytes)>),
    Malformed,
    Violated(Violation),
}

/// Takes the complete events buffered in `events` into `held`.
fn take_events(
    call: &Call<'_>,
    headers: &HeaderMap,
    events: &mut Events,
    held: &mut Held,
    eof: bool,
) -> Hold {
    while let Some(event) = events.next_event(eof) {
        let mut commit = false;
        let mut tool = false;
        let chunk = sse::classify_event(&event);
        let empty = matches!(chunk, Chunk::Empty);
        let finishes = matches!(
            chunk,
            Chunk::Content { finished: true } | Chunk::NoContent { finished: true }
        );
        let asked = !held.meta_seen || (finishes && call.account.trace.wants_finish());
        if let (Some(data), true) = (&event.data, asked) {
            // The model that answered is in the first chunk; finish reasons in the last.
            held.meta_seen = call.account.trace.answer_meta(data.as_bytes());
        }
        match chunk {
            Chunk::Empty | Chunk::NoContent { finished: false } => {}
            Chunk::NoContent { finished: true } => held.finished = true,
            Chunk::Content { finished } => {
                held.finished |= finished;
                let (tool_delta, text) = match (&call.contract, &event.data) {
                    (Some(_), Some(data)) => held.calls.push_chunk(data),
                    _ => (false, true),
                };
                // Under validation a tool call delta commits nothing: it
                // is held until the call is complete and checked.
                tool = tool_delta && !text;
                commit = !tool && !held.prose;
            }
            // `[DONE]` before any content, tool call or finish: an empty
            // stream, no more an answer than a completion without choices.
            Chunk::Done if !held.finished && !held.events.iter().any(|(_, tool)| *tool) => {
                return Hold::Malformed
            }
            Chunk::Done => held.done = true,
            Chunk::Error { code } => {
                let data = Bytes::from(event.data.unwrap_or_default());
                let (decision, status) = in_band_verdict(call.target, code, headers, &data);
                let answer = StatusCode::from_u16(status).ok().map(|s| (s, data));
                return Hold::Fail(decision, status, answer);
            }
            Chunk::Malformed => return Hold::Malformed,
        }
        // An event with no data behind a held call (the end of an upstream
        // block a client of its protocol gets) waits with it, in order.
        let tool = tool || (empty && held.events.iter().any(|(_, tool)| *tool));
        held.bytes += event.held_bytes();
        held.events.push((event, tool));
        if tool && held.bytes > HOLD_MAX_TOOL_BYTES {
            return Hold::Violated(Violation {
                tool: None,
                detail: "tool call arguments exceed the 1 MiB hold".into(),
                schema_path: None,
            });
        }
        let full = if held.prose {
            // Held prose is bounded like held calls: by bytes, not events.
            held.bytes >= HOLD_MAX_TOOL_BYTES
        } else {
            let non_tool = held.events.iter().filter(|(_, t)| !t).count();
            non_tool >= HOLD_MAX_EVENTS || held.bytes >= HOLD_MAX_BYTES
        };
        // Held text is complete with its usage and `[DONE]` (or the end).
        let finished = held.finished && !held.prose;
        if commit || held.done || finished || (!tool && full) {
            return Hold::Commit;
        }
    }
    Hold::More
}

/// An in-band error event of `target`'s stream (before or after its commit
/// point), read by the error table as the status it carries.
pub fn in_band_verdict(
    target: &Target,
    code: Option<u16>,
    headers: &HeaderMap,
    data: &[u8],
) -> (Decision, u16) {
    let status = classify::in_band_status(code, data);
    // A wait the error itself advertises is heard as a `Retry-After`.
    let advertised;
    let headers = match classify::in_band_wait(data) {
        Some(wait) if !headers.contains_key(http::header::RETRY_AFTER) => {
            advertised = with_retry_after(headers, wait);
            &advertised
        }
        Some(_) | None => headers,
    };
    let outcome = Outcome::Response {
        status,
        headers,
        body: Some(data),
    };
    (target.provider.errors.classify_failure(&outcome), status)
}

/// The commit point: what was held goes out first, the rest is relayed.
fn commit(
    call: &Call<'_>,
    held: Held,
    events: Events,
    incoming: UpstreamBody,
    eof: bool,
    permit: Permit,
    started: Instant,
) -> Attempt {
    let target = call.target;
    let complete = held.finished || held.done;
    let mut held = held;
    let mut repaired = None;
    if let (Some(contract), true) = (&call.contract, complete) {
        // The answer is complete: check its calls before a byte goes out.
        if let Err(violation) = contract.check_calls(&held.calls.calls()) {
            match repair_held(call, contract, &mut held, &violation) {
                Some(method) => repaired = Some(method),
                None => return held_violation(call, violation, permit, &held),
            }
        } else if held.prose && contract.checks_text() && held.calls.calls().is_empty() {
            match check_held_text(call, contract, &mut held) {
                Ok(method) => repaired = method,
                Err(violation) => return held_violation(call, violation, permit, &held),
            }
        }
    }
    let (tool_held, out): (Vec<_>, Vec<_>) = held
        .events
        .into_iter()
        .partition(|(_, tool)| *tool && !complete);
    let tool_held: Vec<_> = tool_held.into_iter().map(|(event, _)| event).collect();
    let tool_held_bytes = tool_held.iter().map(sse::Event::held_bytes).sum();
    if let Some(ttft) = call.account.trace.committed() {
        call.task
            .route_metrics(Some(target))
            .ttft
            .record(ttft.as_secs_f64());
    }
    debug!(target = %target.name, ttft_ms = started.elapsed().as_millis() as u64, "stream committed");
    target
        .health
        .record_latency(Instant::now(), started.elapsed());
    Attempt::Committed(Box::new(Commit {
        state: RelayState {
            account: call.account.clone(),
            target: Arc::clone(target),
            health: call.snapshot.health,
            events,
            incoming,
            finished: held.finished,
            done: held.done,
            eof,
            deadline: call.deadline,
            contract: if complete {
                None
            } else {
                call.contract.clone()
            },
            calls: held.calls,
            tool_held,
            tool_held_bytes,
            key: call.key,
            sanitizer: Arc::clone(&call.snapshot.sanitizer),
        },
        held: out.into_iter().map(|(event, _)| event).collect(),
        permit,
        repaired,
    }))
}

/// Holds a complete held stream's text to `response_format`: `Ok` when it
/// keeps it, or once a repair made it (its text events then carry the
/// repaired text), with the method; else the violation.
fn check_held_text(
    call: &Call<'_>,
    contract: &Contract,
    held: &mut Held,
) -> Result<Option<Repair>, Violation> {
    let Some(completion) = held.completion() else {
        return Ok(None);
    };
    // Every choice is held to the format; only a single one is repaired.
    let Err(violation) = contract.check_completion(&completion) else {
        return Ok(None);
    };
    let single = serde_json::from_slice::<serde_json::Value>(&completion)
        .ok()
        .and_then(|v| Some(v.get("choices")?.as_array()?.len() == 1))
        .unwrap_or(false);
    let text = crate::sse::completion_text(&completion);
    let Some((method, fixed)) = try_repairs(call.task, call.target, &violation, |_| {
        single.then(|| contract.repair_text(&text)).flatten()
    }) else {
        return Err(violation);
    };
    let mut first = true;
    held.events = std::mem::take(&mut held.events)
        .into_iter()
        .filter_map(|(event, tool)| {
            let replaced = crate::sse::with_text(&event.raw, first.then_some(fixed.as_str()));
            let Some(replaced) = replaced else {
                return Some((event, tool));
            };
            first = false;
            // The repaired text goes out as chat (rendered for the client).
            let replaced = replaced.and_then(|r| sse::events_of(&r).pop());
            replaced.map(|r| (r, tool))
        })
        .collect();
    Ok(Some(method))
}

/// A complete held stream that broke the contract, as a re-ask quotes it
/// and as the completion a conversion of its prose into the required call
/// keeps; its usage is booked (the provider billed it all the same).
fn held_violation(call: &Call<'_>, violation: Violation, permit: Permit, held: &Held) -> Attempt {
    let completion = held.completion();
    if let Some(whole) = &completion {
        settle_answer(call, whole);
    }
    let text = completion
        .as_deref()
        .map(crate::sse::completion_text)
        .unwrap_or_default();
    let answered = crate::schema::quoted(&text, &held.calls.calls());
    Violated::attempt(violation, permit, answered, completion)
}

/// Repairs the held tool calls of a complete stream that broke the
/// contract: their deltas are replaced, where the first of them stood, by
/// one event carrying the repaired calls whole. The method that worked.
fn repair_held(
    call: &Call<'_>,
    contract: &Contract,
    held: &mut Held,
    violation: &Violation,
) -> Option<Repair> {
    let calls = held.calls.calls();
    let cut = held
        .completion()
        .is_some_and(|c| crate::schema::cut_by_limit(&c));
    let (method, events) = try_repairs(call.task, call.target, violation, |_| {
        if cut {
            // Arguments the token limit cut are unfinished: nothing to fix.
            return None;
        }
        let fixed = contract.repair_calls(&calls)?;
        let Some(fixed) = fixed else {
            return Some(None);
        };
        let tool_bytes = chat_bytes(held.events.iter().filter(|(_, t)| *t).map(|(e, _)| e));
        Some(held.calls.repaired_events(&tool_bytes, &fixed))
    })?;
    let first = held.events.iter().position(|(_, tool)| *tool)?;
    held.events.retain(|(_, tool)| !tool);
    let repaired = sse::events_of(&events).into_iter().map(|e| (e, false));
    held.events.splice(first..first, repaired);
    Some(method)
}

#[cfg(test)]
mod step_tests {
    use super::*;
    use crate::classify::Action;
    use crate::config::parse;
    use crate::snapshot::{compile::compile, CompileOptions, LiveState};

    fn target() -> Arc<Target> {
        let text = "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1' }\n\
                    targets:\n  t: { provider: p, model: m }\ntasks:\n  chat: { chain: [t] }\n";
        let parsed = parse(text).unwrap();
        let compiled = compile(
            &parsed,
            text,
            &LiveState::default(),
            CompileOptions::default(),
        );
        Arc::clone(&compiled.unwrap().snapshot.targets["t"])
    }

    fn decision(action: Action, scope: Scope) -> Decision {
        Decision {
            action,
            health: false,
            cooldown: None,
            context_window: false,
            rate_limited: false,
            wait: None,
            scope,
            until_reload: false,
            until_rotation: false,
            out_of_credit: false,
            rule: Arc::from("test"),
            advertised: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_step_refuses_a_key_switch_on_return_and_anything_past_the_deadline() {
        let t = target();
        let now = Instant::now();
        let (soon, past) = (now + Duration::from_secs(5), now);
        let ten = Duration::from_millis(10);
        let pause = Some(ten);
        let key_retry = decision(Action::Retry, Scope::Key);
        let key_return = decision(Action::Return, Scope::Key);
        assert_eq!(
            next_step(&key_retry, true, pause, &t, now, soon),
            Step::NextKey
        );
        assert_eq!(
            next_step(&key_return, true, pause, &t, now, soon),
            Step::Return
        );
        assert_eq!(
            next_step(&key_retry, true, pause, &t, now, past),
            Step::Failover
        );
        assert_eq!(
            next_step(&key_retry, false, pause, &t, now, soon),
            Step::Retry(ten)
        );
        // A pause that would end past the deadline is no retry.
        let late = now + Duration::from_millis(5);
        assert_eq!(
            next_step(&key_retry, false, pause, &t, now, late),
            Step::Failover
        );
        assert_eq!(
            next_step(&key_retry, false, None, &t, now, soon),
            Step::Failover
        );
    }
}
