//! The per-request pipeline of `POST /v1/chat/completions`, as one function
//! ([`chat_completions`]) whose steps are:
//!
//! 1. **Parse** the body as a JSON object (400 if it is not); read `model` and `stream`.
//! 2. **Route** to a task by `x-task-type`, else `model` (name or alias), else
//!    `default_task` (404 if none).
//! 3. **Walk the degradation chain** in order. A target that is DOWN or cooling
//!    down is skipped without a network call; after a context-window error only
//!    larger `max_context` targets qualify.
//! 4. **Attempt** (inner loop): send, classify the outcome with the provider's
//!    error table; `retry` tries the same target again (exponential backoff,
//!    full jitter, never past the deadline) up to `retry.max` times; `failover`
//!    moves on (at most `max_failovers` times); `return` hands the upstream's
//!    client error back as is. Every attempt gets at most the time left of
//!    `total_timeout`; when it runs out the client gets 504 at once.
//! 5. **Streams** are held until the commit point (the first chunk with content),
//!    so any failure before it fails over invisibly. After it, bytes are relayed
//!    as they arrive; a break ends the stream with an error event and
//!    `data: [DONE]` and is never replayed.
//! 6. If every target of the chain was skipped, the least recently failed one
//!    gets a trial (`health.all_down: trial`), else 503.
//! 7. **Respond** with `x-switchyard-*` headers; errors in OpenAI format.
//!
//! The client hanging up drops this future, which drops the upstream request
//! (closing its connection) and counts as `client_cancelled`, against no target.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};
use tracing::{debug, info, warn, Instrument};

use crate::anthropic;
use crate::classify::{Action, Decision, NetworkKind, Outcome};
use crate::error::{error_body, GatewayError};
use crate::health::{Failure, Permit, Transition, Unavailable};
use crate::metrics as m;
use crate::routing::{self, Exclusion, Needs, Strategy};
use crate::schema::{CallAssembler, Contract, Mode as ValidateMode, Violation};
use crate::server::{channel_body, full_body, Body};
use crate::snapshot::{Protocol, Snapshot, Target, Task};
use crate::sse::{self, Chunk};
use crate::upstream;

/// Events held before the commit point, at most; past this the stream commits anyway.
const HOLD_MAX_EVENTS: usize = 64;
/// Bytes held before the commit point, at most.
const HOLD_MAX_BYTES: usize = 256 * 1024;
/// Bytes of tool call deltas held for validation, at most; a larger call is a violation.
const HOLD_MAX_TOOL_BYTES: usize = 1024 * 1024;
/// Largest non-streamed upstream answer read; a larger one is a broken upstream.
const MAX_UPSTREAM_BODY: usize = 64 * 1024 * 1024;
/// `max_tokens` sent to an Anthropic target when neither the request nor the
/// target's `max_output` gives one (the Messages API requires it).
const DEFAULT_ANTHROPIC_MAX_TOKENS: u64 = 4096;
/// Relayed bytes batched before a write to the client, at most.
const BATCH_MAX_BYTES: usize = 64 * 1024;
/// Longest backoff between two retries of one target.
const BACKOFF_CAP: Duration = Duration::from_secs(10);

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

/// Handles one chat completion request against `snapshot`.
pub async fn chat_completions(
    snapshot: Arc<Snapshot>,
    headers: &HeaderMap,
    body: Bytes,
    request_id: HeaderValue,
    arrival: Instant,
) -> Response<Body> {
    // 1. Parse.
    let mut request: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(map) => map,
        Err(e) => {
            let e = GatewayError::BadRequest(format!("body is not a JSON object: {e}"));
            return rejected(&e, &request_id);
        }
    };
    let model = match request.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            let e = GatewayError::BadRequest("`model` must be a string".into());
            return rejected(&e, &request_id);
        }
    };
    let stream = match request.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            let e = GatewayError::BadRequest("`stream` must be a boolean".into());
            return rejected(&e, &request_id);
        }
    };

    // 2. Route.
    let task_header = headers.get(H_TASK_TYPE).and_then(|v| v.to_str().ok());
    let Some(task) = snapshot.route(task_header, model.as_deref()).cloned() else {
        let e = match task_header.or(model.as_deref()) {
            Some(asked) => GatewayError::UnknownModel(asked.chars().take(128).collect()),
            None => {
                GatewayError::BadRequest("`model` is required (or an `x-task-type` header)".into())
            }
        };
        return rejected(&e, &request_id);
    };

    if let Some(limiter) = &task.rate_limit {
        if let Err((wait, scope)) = limiter.admit(headers) {
            metrics::counter!(m::RATE_LIMITED, "scope" => scope).increment(1);
            metrics::counter!(m::REQUESTS, "task" => task.name.clone(), "target" => "none", "status" => "429").increment(1);
            let mut resp = plain_error(&GatewayError::RateLimited(wait), &request_id);
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(wait.as_secs_f64().ceil().max(1.0) as u64),
            );
            return resp;
        }
    }
    let needs = Needs::from_request(&request);
    let contract = match task.validate_tool_calls {
        ValidateMode::Never => None,
        _ => Contract::from_request(&request, &task.tool_schemas).map(Arc::new),
    };

    let mut run = Run {
        snapshot: &snapshot,
        task: &task,
        request: &mut request,
        stream,
        request_id: &request_id,
        arrival,
        deadline: arrival + task.budget.total_timeout,
        attempts: 0,
        failovers: 0,
        last_status: None,
        deadline_hit: false,
        needs,
        first_choice: None,
        contract,
        violation: None,
        untranslatable: None,
    };
    let mut guard = CancelGuard {
        task: &task.name,
        armed: true,
    };
    let response = run.walk_chain().await;
    guard.armed = false;
    let status = response.status();
    let target = response
        .headers()
        .get(H_TARGET)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    metrics::histogram!(m::REQUEST_DURATION, "task" => task.name.clone(), "target" => target.clone())
        .record(arrival.elapsed().as_secs_f64());
    metrics::counter!(m::REQUESTS, "task" => task.name.clone(), "target" => target, "status" => status.as_str().to_owned())
        .increment(1);
    response
}

/// Counts a request whose future was dropped (the client hung up) before it finished.
struct CancelGuard<'a> {
    task: &'a str,
    armed: bool,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            info!(task = self.task, "client cancelled the request");
            metrics::counter!(m::CLIENT_CANCELLED, "task" => self.task.to_owned()).increment(1);
        }
    }
}

/// How one attempt ended.
enum AttemptEnd {
    /// An answer to give the client (non-stream body, or a committed stream).
    Success(Response<Body>),
    /// A failure the error table classified.
    Failed {
        decision: Decision,
        label: String,
        status: Option<u16>,
        /// The upstream's answer, kept for `return`.
        answer: Option<(StatusCode, Bytes)>,
        /// To record the verdict with.
        permit: Permit,
    },
    /// `total_timeout` ran out during the attempt.
    Deadline,
    /// A well-formed answer that breaks the degraded-answer contract.
    Violated {
        violation: Violation,
        permit: Permit,
    },
}

/// How trying one target (with its retries) ended.
enum TargetEnd {
    Served(Response<Body>),
    Deadline,
    /// Give up on this target; `context_window` restricts the next ones, and
    /// `context_answer` is the upstream's context-length error, given to the
    /// client if no larger target gets to try.
    Exhausted {
        context_window: bool,
        reason: String,
        context_answer: Option<Response<Body>>,
    },
}

/// The state of one request's walk along the chain.
struct Run<'a> {
    snapshot: &'a Snapshot,
    task: &'a Arc<Task>,
    request: &'a mut Map<String, Value>,
    stream: bool,
    request_id: &'a HeaderValue,
    arrival: Instant,
    deadline: Instant,
    attempts: u32,
    failovers: u32,
    last_status: Option<u16>,
    deadline_hit: bool,
    /// What the request needs of a target.
    needs: Needs,
    /// The target a healthy chain would have served from (for `x-switchyard-degraded`).
    first_choice: Option<Arc<Target>>,
    /// The request's tool contract, when the task validates tool calls.
    contract: Option<Arc<Contract>>,
    /// The last contract violation seen.
    violation: Option<Violation>,
    /// Why a target could not take the request in its protocol, if one could not.
    untranslatable: Option<String>,
}

impl Run<'_> {
    /// Step 3 and 6: the outer (failover) loop.
    async fn walk_chain(&mut self) -> Response<Body> {
        let task = Arc::clone(self.task);
        let plan = routing::plan(&task, &self.needs, Instant::now());
        let mut down: Vec<Arc<Target>> = Vec::new();
        for (target, why) in &plan.excluded {
            skip(&task, target, why);
            if *why == Exclusion::Down {
                down.push(Arc::clone(target));
            }
        }
        if plan.candidates.is_empty() && down.is_empty() && !plan.excluded.is_empty() {
            if let Some((_, why)) = plan.excluded.iter().find(|(_, w)| {
                matches!(
                    w,
                    Exclusion::MissingCapability(_) | Exclusion::ContextWindow { .. }
                )
            }) {
                return self.error(&GatewayError::NoEligibleTarget(why.describe()));
            }
        }
        self.first_choice = match task.strategy {
            Strategy::Priority => task.chain.first().cloned(),
            _ => plan.candidates.first().cloned(),
        };

        let mut min_context: Option<u64> = None;
        let mut previous: Option<(Arc<Target>, String)> = None;
        let mut context_answer: Option<(Response<Body>, u32)> = None;
        let mut tries_after_violation = 0;
        for target in &plan.candidates {
            if self.violation.is_some() && tries_after_violation >= 1 {
                // A violation gets one more candidate, not the whole chain.
                break;
            }
            if let Some(min) = min_context {
                if target.max_context.unwrap_or(0) <= min {
                    skip(&task, target, &Exclusion::SmallerContext);
                    continue;
                }
            }
            let permit = match target.health.admit(Instant::now()) {
                Ok(p) => p,
                Err(why) => {
                    let why = match why {
                        Unavailable::Down => Exclusion::Down,
                        Unavailable::CoolingDown => Exclusion::CoolingDown,
                    };
                    skip(&task, target, &why);
                    if why == Exclusion::Down {
                        down.push(Arc::clone(target));
                    }
                    continue;
                }
            };
            if let Some(limits) = &target.provider.limits {
                if !limits.admit(self.needs.total_tokens(target)) {
                    skip(&task, target, &Exclusion::ProviderRateLimited);
                    metrics::counter!(m::RATE_LIMITED, "scope" => "provider").increment(1);
                    continue;
                }
            }
            if self.violation.is_some() {
                tries_after_violation += 1;
            }
            if let Some((from, reason)) = &previous {
                if self.failovers >= task.budget.max_failovers {
                    debug!(task = %task.name, "max_failovers reached");
                    break;
                }
                self.failovers += 1;
                info!(task = %task.name, from = %from.name, to = %target.name, reason = %reason, "failover");
                metrics::counter!(m::FAILOVERS, "task" => task.name.clone(), "from" => from.name.clone(),
                    "to" => target.name.clone(), "reason" => reason.clone())
                .increment(1);
            }
            match self.try_target(target, permit).await {
                TargetEnd::Served(resp) => return resp,
                TargetEnd::Deadline => {
                    self.deadline_hit = true;
                    break;
                }
                TargetEnd::Exhausted {
                    context_window,
                    reason,
                    context_answer: answer,
                } => {
                    if context_window {
                        min_context = Some(target.max_context.unwrap_or(0));
                        context_answer = answer.map(|a| (a, self.attempts));
                    }
                    previous = Some((Arc::clone(target), reason));
                }
            }
        }

        if self.attempts == 0 && !down.is_empty() && !self.deadline_hit {
            if !self.snapshot.health.all_down_trial {
                return self.error(&GatewayError::NoTargetAvailable);
            }
            // Every candidate is DOWN: rather than fail without trying, give the
            // least recently failed one a trial. (Cooling-down targets asked not
            // to be called: they are not in `down`.)
            let trial = down
                .iter()
                .filter(|t| min_context.is_none_or(|min| t.max_context.unwrap_or(0) > min))
                .min_by_key(|t| t.health.last_failure());
            if let Some(target) = trial {
                info!(task = %task.name, target = %target.name, "all targets unavailable; trying the least recently failed");
                let permit = target.health.force_trial();
                match self.try_target(target, permit).await {
                    TargetEnd::Served(resp) => return resp,
                    TargetEnd::Deadline => self.deadline_hit = true,
                    TargetEnd::Exhausted { .. } => {}
                }
            }
        }
        if self.attempts == 0 && !self.deadline_hit {
            if let Some(why) = self.untranslatable.take() {
                return self.error(&GatewayError::BadRequest(why));
            }
            return self.error(&GatewayError::NoTargetAvailable);
        }
        if let Some(v) = self.violation.take() {
            return self.error(&GatewayError::ContractViolation(v.to_string()));
        }
        if let Some((answer, attempts_then)) = context_answer {
            if attempts_then == self.attempts {
                // No larger context window got to try: the upstream's own
                // context-length error tells the caller what to change.
                return answer;
            }
        }
        if self.deadline_hit || Instant::now() >= self.deadline {
            return self.error(&GatewayError::DeadlineExceeded(
                self.task.budget.total_timeout,
            ));
        }
        self.error(&GatewayError::AllTargetsFailed {
            last_status: self.last_status,
        })
    }

    /// Step 4: the inner (retry) loop on one target.
    async fn try_target(&mut self, target: &Arc<Target>, permit: Permit) -> TargetEnd {
        let provider = &target.provider;
        let body = match provider.protocol {
            Protocol::OpenAi => {
                self.request
                    .insert("model".to_owned(), Value::String(target.model.clone()));
                serde_json::to_vec(&*self.request)
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }
            Protocol::Anthropic => anthropic::to_messages_request(
                self.request,
                &target.model,
                target.max_output.unwrap_or(DEFAULT_ANTHROPIC_MAX_TOKENS),
            )
            .map_err(|e| e.to_string())
            .and_then(|v| {
                serde_json::to_vec(&v)
                    .map(Bytes::from)
                    .map_err(|e| e.to_string())
            }),
        };
        let body = match body {
            Ok(b) => b,
            Err(why) => {
                // This target cannot express the request (e.g. `n > 1` for
                // Anthropic): skip it; if nothing else can, the client hears why.
                debug!(target = %target.name, %why, "request not translatable for this target");
                self.untranslatable = Some(why);
                return TargetEnd::Exhausted {
                    context_window: false,
                    reason: "untranslatable".to_owned(),
                    context_answer: None,
                };
            }
        };
        let mut permit = Some(permit);
        let mut reason = String::from("unknown");
        let mut context_window = false;
        let mut context_answer = None;
        for retry in 0..=provider.retry.max {
            if retry > 0 {
                let backoff = full_jitter(provider.retry.backoff, retry);
                if Instant::now() + backoff >= self.deadline {
                    debug!(target = %target.name, "retry backoff would overrun the deadline; failing over");
                    break;
                }
                tokio::time::sleep(backoff).await;
                permit = target.health.admit(Instant::now()).ok();
            }
            let Some(p) = permit.take() else { break };
            self.attempts += 1;
            match self.attempt(target, body.clone(), p).await {
                AttemptEnd::Success(resp) => return TargetEnd::Served(self.decorate(resp, target)),
                AttemptEnd::Deadline => return TargetEnd::Deadline,
                AttemptEnd::Violated {
                    violation,
                    permit: p,
                } => {
                    warn!(target = %target.name, violation = %violation, "answer breaks the tool call contract");
                    metrics::counter!(m::CONTRACT_VIOLATIONS, "task" => self.task.name.clone(), "target" => target.name.clone())
                        .increment(1);
                    metrics::counter!(m::UPSTREAM_ATTEMPTS, "target" => target.name.clone(), "outcome" => "contract_violation")
                        .increment(1);
                    // The upstream answered; it is the answer that is unusable: no health count.
                    let failure = Failure {
                        counted: false,
                        cooldown: None,
                        class: "contract_violation",
                        jitter: 0.0,
                    };
                    target.health.record_failure(
                        p,
                        Instant::now(),
                        &failure,
                        &self.snapshot.health,
                    );
                    self.violation = Some(violation);
                    return TargetEnd::Exhausted {
                        context_window: false,
                        reason: "contract_violation".to_owned(),
                        context_answer: None,
                    };
                }
                AttemptEnd::Failed {
                    decision,
                    label,
                    status,
                    answer,
                    permit: p,
                } => {
                    self.last_status = status.or(self.last_status);
                    let next = match decision.action {
                        Action::Retry if retry < provider.retry.max => "retry",
                        Action::Return => "return",
                        Action::Retry | Action::Failover => "failover",
                    };
                    info!(target = %target.name, attempt = self.attempts, outcome = %label,
                        rule = %decision.rule, next, "upstream attempt failed");
                    metrics::counter!(m::UPSTREAM_ATTEMPTS, "target" => target.name.clone(), "outcome" => label.clone())
                        .increment(1);
                    let failure = Failure {
                        counted: decision.health,
                        cooldown: decision.cooldown,
                        class: &decision.rule,
                        jitter: rand::random::<f64>() * 2.0 - 1.0,
                    };
                    if let Some(t) = target.health.record_failure(
                        p,
                        Instant::now(),
                        &failure,
                        &self.snapshot.health,
                    ) {
                        log_transition(target, t);
                    }
                    reason = label;
                    context_window = decision.context_window;
                    if context_window {
                        context_answer = answer.as_ref().map(|(status, bytes)| {
                            self.decorate(self.returned_error(*status, bytes, target), target)
                        });
                    }
                    match decision.action {
                        Action::Return => {
                            let (status, bytes) =
                                answer.unwrap_or((StatusCode::BAD_GATEWAY, Bytes::new()));
                            return TargetEnd::Served(
                                self.decorate(self.returned_error(status, &bytes, target), target),
                            );
                        }
                        Action::Failover => break,
                        Action::Retry => {}
                    }
                }
            }
        }
        TargetEnd::Exhausted {
            context_window,
            reason,
            context_answer,
        }
    }

    /// One upstream call. A success records itself (a stream: at its end);
    /// a failure hands the permit back to record the verdict with.
    async fn attempt(&self, target: &Arc<Target>, body: Bytes, permit: Permit) -> AttemptEnd {
        let provider = &target.provider;
        let started = Instant::now();
        let attempt_deadline = self.deadline.min(started + provider.timeout);
        let first_deadline = match (self.stream, self.task.budget.first_token_timeout) {
            (true, Some(ftt)) => attempt_deadline.min(started + ftt),
            _ => attempt_deadline,
        };
        let timed_out = |at: Instant, permit| {
            if at >= self.deadline {
                AttemptEnd::Deadline
            } else {
                network_failure(target, NetworkKind::Timeout, permit)
            }
        };

        let Ok(req) = upstream::chat_request(provider, body, Some(self.request_id), self.stream)
        else {
            return network_failure(target, NetworkKind::Protocol, permit);
        };

        let response = match timeout_at(first_deadline, provider.client.request(req)).await {
            Err(_) => return timed_out(first_deadline, permit),
            Ok(Err(e)) => {
                let kind = upstream::request_error_kind(&e, provider.host_is_name);
                return network_failure(target, kind, permit);
            }
            Ok(Ok(r)) => r,
        };
        if !self.stream {
            target
                .health
                .record_latency(Instant::now(), started.elapsed());
        }

        let is_sse = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if self.stream && response.status().is_success() && is_sse {
            // Rules may claim a 2xx stream by its status or headers before a byte is read.
            let outcome = Outcome::Response {
                status: response.status().as_u16(),
                headers: response.headers(),
                body: &[],
            };
            if let Some(decision) = provider.errors.classify(&outcome) {
                return AttemptEnd::Failed {
                    decision,
                    label: m::status_class(response.status().as_u16()).to_owned(),
                    status: Some(response.status().as_u16()),
                    answer: None,
                    permit,
                };
            }
            return self
                .stream_attempt(target, response, permit, first_deadline, started)
                .await;
        }

        // Non-streaming (or an error status, which is never wrapped in a stream).
        let (parts, incoming) = response.into_parts();
        let bytes = match timeout_at(
            attempt_deadline,
            Limited::new(incoming, MAX_UPSTREAM_BODY).collect(),
        )
        .await
        {
            Err(_) => return timed_out(attempt_deadline, permit),
            Ok(Err(e)) => {
                // Too large, or broken mid-body.
                let kind = e
                    .downcast_ref::<hyper::Error>()
                    .map_or(NetworkKind::Protocol, upstream::body_error_kind);
                return network_failure(target, kind, permit);
            }
            Ok(Ok(c)) => c.to_bytes(),
        };
        let bytes = match (target.provider.protocol, parts.status.is_success()) {
            (Protocol::OpenAi, _) => bytes,
            (Protocol::Anthropic, true) => match anthropic::from_messages_response(&bytes) {
                Ok(b) => b,
                Err(e) => {
                    debug!(target = %target.name, error = %e, "untranslatable Anthropic answer");
                    return network_failure(target, NetworkKind::Protocol, permit);
                }
            },
            (Protocol::Anthropic, false) => anthropic::to_openai_error(&bytes).unwrap_or(bytes),
        };
        let status = parts.status.as_u16();
        let classified_status = if parts.status.is_success() {
            in_band_error(&bytes).map_or(status, |code| code.unwrap_or(502))
        } else {
            status
        };
        let outcome = Outcome::Response {
            status: classified_status,
            headers: &parts.headers,
            body: &bytes,
        };
        match provider.errors.classify(&outcome) {
            None => {
                if let Some(contract) = self.contract_for(target) {
                    if let Err(violation) = contract.check_completion(&bytes) {
                        return AttemptEnd::Violated { violation, permit };
                    }
                }
                if let Some(t) =
                    target
                        .health
                        .record_success(permit, Instant::now(), &self.snapshot.health)
                {
                    log_transition(target, t);
                }
                attempt_ok(target);
                self.account().settle(target, sse::usage(&bytes), 0);
                let mut resp = Response::new(full_body(bytes));
                *resp.status_mut() = parts.status;
                copy_content_type(&parts.headers, resp.headers_mut());
                AttemptEnd::Success(resp)
            }
            Some(decision) => AttemptEnd::Failed {
                label: if classified_status == status {
                    m::status_class(status).to_owned()
                } else {
                    "in_band_error".to_owned()
                },
                decision,
                // An in-band error names its own status; the client hears that one.
                status: Some(classified_status),
                answer: Some((parts.status, bytes)),
                permit,
            },
        }
    }

    /// Step 5: read a stream up to its commit point; then hand it to a relay task.
    async fn stream_attempt(
        &self,
        target: &Arc<Target>,
        response: Response<Incoming>,
        permit: Permit,
        first_deadline: Instant,
        started: Instant,
    ) -> AttemptEnd {
        let (parts, mut incoming) = response.into_parts();
        let include_usage = self
            .request
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let mut parser = UpstreamEvents::new(target.provider.protocol, include_usage);
        // Events held until the commit point, in order; `true` marks a tool call
        // delta held for validation (it never commits the stream by itself).
        let mut held: Vec<(Bytes, bool)> = Vec::new();
        let mut held_bytes = 0usize;
        let contract = self.contract_for(target);
        let mut calls = CallAssembler::default();
        let mut finished = false;
        let mut done = false;
        let mut eof = false;
        let committed = 'read: loop {
            let frame = match timeout_at(first_deadline, incoming.frame()).await {
                Err(_) if first_deadline >= self.deadline => return AttemptEnd::Deadline,
                Err(_) => return network_failure(target, NetworkKind::Timeout, permit),
                Ok(None) => {
                    eof = true;
                    None
                }
                Ok(Some(Err(e))) => {
                    return network_failure(target, upstream::body_error_kind(&e), permit)
                }
                Ok(Some(Ok(frame))) => frame.into_data().ok(),
            };
            if let Some(data) = frame {
                parser.push(&data);
                if parser.pending() > sse::MAX_EVENT_BYTES {
                    return network_failure(target, NetworkKind::Protocol, permit);
                }
            }
            while let Some(event) = parser.next_event(eof) {
                let mut commit = false;
                let mut tool = false;
                match sse::classify_event(&event) {
                    Chunk::Empty | Chunk::NoContent { finished: false } => {}
                    Chunk::NoContent { finished: true } => finished = true,
                    Chunk::Content { finished: f } => {
                        finished |= f;
                        let (tool_delta, text) = match (&contract, &event.data) {
                            (Some(_), Some(data)) => calls.push_chunk(data),
                            _ => (false, true),
                        };
                        // Under validation a tool call delta commits nothing: it
                        // is held until the call is complete and checked.
                        tool = tool_delta && !text;
                        commit = !tool;
                    }
                    Chunk::Done => done = true,
                    Chunk::Error { code } => {
                        let data = event.data.unwrap_or_default();
                        let outcome = Outcome::Response {
                            status: code.unwrap_or(502),
                            headers: &parts.headers,
                            body: data.as_bytes(),
                        };
                        let decision =
                            target
                                .provider
                                .errors
                                .classify(&outcome)
                                .unwrap_or_else(|| Decision {
                                    action: Action::Failover,
                                    health: true,
                                    cooldown: None,
                                    context_window: false,
                                    rule: "default:stream_error".to_owned(),
                                });
                        return AttemptEnd::Failed {
                            decision,
                            label: "stream_error".to_owned(),
                            status: code,
                            answer: None,
                            permit,
                        };
                    }
                    Chunk::Malformed => {
                        return network_failure(target, NetworkKind::Protocol, permit)
                    }
                }
                held_bytes += event.raw.len();
                held.push((event.raw, tool));
                if tool && held_bytes > HOLD_MAX_TOOL_BYTES {
                    let violation = Violation {
                        tool: None,
                        detail: "tool call arguments exceed the 1 MiB hold".into(),
                        schema_path: None,
                    };
                    return AttemptEnd::Violated { violation, permit };
                }
                let non_tool = held.iter().filter(|(_, t)| !t).count();
                if commit
                    || done
                    || finished
                    || (!tool && (non_tool >= HOLD_MAX_EVENTS || held_bytes >= HOLD_MAX_BYTES))
                {
                    break 'read true;
                }
            }
            if eof {
                break false;
            }
        };
        if !committed {
            // The stream ended before any content, finish_reason or [DONE].
            return network_failure(target, NetworkKind::Reset, permit);
        }
        // What goes out now, and which tool deltas stay held for the relay.
        let mut out = BytesMut::new();
        let mut tool_held = BytesMut::new();
        let complete = finished || done;
        if let (Some(contract), true) = (&contract, complete) {
            // The answer is complete: check its calls before a byte goes out.
            if let Err(violation) = contract.check_calls(&calls.calls()) {
                return AttemptEnd::Violated { violation, permit };
            }
        }
        for (raw, tool) in held {
            if tool && !complete {
                tool_held.extend_from_slice(&raw);
            } else {
                out.extend_from_slice(&raw);
            }
        }

        metrics::histogram!(m::TIME_TO_FIRST_TOKEN, "task" => self.task.name.clone(), "target" => target.name.clone())
            .record(self.arrival.elapsed().as_secs_f64());
        debug!(target = %target.name, ttft_ms = started.elapsed().as_millis() as u64, "stream committed");
        let (tx, body) = channel_body();
        target
            .health
            .record_latency(Instant::now(), started.elapsed());
        let relay = Relay {
            account: self.account(),
            usage: None,
            content_chunks: 0,
            tx,
            target: Arc::clone(target),
            task: self.task.name.clone(),
            parser,
            incoming,
            finished,
            done,
            eof,
            deadline: self.deadline,
            health: self.snapshot.health,
            contract: if complete { None } else { contract },
            calls,
            tool_held,
        };
        tokio::spawn(
            relay
                .run(out.freeze(), permit)
                .instrument(tracing::Span::current()),
        );
        let mut resp = Response::new(body);
        copy_content_type(&parts.headers, resp.headers_mut());
        resp.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        AttemptEnd::Success(resp)
    }

    /// The contract to hold `target`'s answer to, per the task's
    /// `validate_tool_calls` (`degraded`: not the first choice).
    fn contract_for(&self, target: &Arc<Target>) -> Option<Arc<Contract>> {
        let contract = self.contract.as_ref()?;
        let applies = match self.task.validate_tool_calls {
            ValidateMode::Always => true,
            ValidateMode::Never => false,
            ValidateMode::Degraded => self
                .first_choice
                .as_ref()
                .is_none_or(|f| !Arc::ptr_eq(f, target)),
        };
        applies.then(|| Arc::clone(contract))
    }

    fn account(&self) -> Account {
        Account {
            task: Arc::clone(self.task),
            prompt_estimate: self.needs.prompt_tokens,
            max_tokens: self.needs.max_tokens,
        }
    }

    fn decorate(&self, mut resp: Response<Body>, target: &Target) -> Response<Body> {
        let degraded = self
            .first_choice
            .as_ref()
            .is_none_or(|first| !std::ptr::eq(Arc::as_ptr(first), target));
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&target.name) {
            h.insert(H_TARGET, v);
        }
        if let Ok(v) = HeaderValue::from_str(&target.provider.name) {
            h.insert(H_PROVIDER, v);
        }
        h.insert(
            H_DEGRADED,
            HeaderValue::from_static(if degraded { "true" } else { "false" }),
        );
        self.counters(h);
        resp
    }

    fn counters(&self, h: &mut HeaderMap) {
        h.insert(H_ATTEMPTS, HeaderValue::from(self.attempts));
        h.insert(H_FAILOVERS, HeaderValue::from(self.failovers));
        h.insert(H_REQUEST_ID, self.request_id.clone());
    }

    fn error(&self, e: &GatewayError) -> Response<Body> {
        warn!(task = %self.task.name, attempts = self.attempts, code = e.code(), "{e}");
        let mut resp = plain_error(e, self.request_id);
        if let Some(msg) = self.snapshot.sanitizer.message_for(e.status().as_u16()) {
            *resp.body_mut() = full_body(error_body(msg, e.error_type(), e.code()));
        }
        self.counters(resp.headers_mut());
        resp
    }

    /// An upstream error given to the client (`return`, or a context-length
    /// error with no larger target): an OpenAI-format body scrubbed of the
    /// provider's key, sensitive words, upstream hosts and key-like strings
    /// (with the configured friendly message, if any); anything else (HTML,
    /// text) is replaced, never copied raw. The original goes to the debug log.
    fn returned_error(&self, status: StatusCode, body: &Bytes, target: &Target) -> Response<Body> {
        let sanitizer = &self.snapshot.sanitizer;
        let body = redact(body.clone(), target.provider.secret.as_ref());
        debug!(target = %target.name, status = status.as_u16(),
            body = %sanitizer.redact_keys(&String::from_utf8_lossy(&body)), "upstream error returned to the client");
        let bytes = sanitizer
            .clean_error_body(
                status.as_u16(),
                &body,
                target
                    .provider
                    .secret
                    .as_ref()
                    .map(crate::snapshot::Secret::expose),
            )
            .unwrap_or_else(|| {
                let reason = status.canonical_reason().unwrap_or("error");
                let generic = format!(
                    "the upstream rejected the request: {} {reason}",
                    status.as_u16()
                );
                let message = sanitizer.message_for(status.as_u16()).unwrap_or(&generic);
                error_body(message, "invalid_request_error", "upstream_rejected")
            });
        let mut resp = Response::new(full_body(bytes));
        *resp.status_mut() = status;
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        resp
    }
}

/// Upstream SSE events as OpenAI chunks: parsed, and for an Anthropic
/// provider translated event by event, so the commit point, the relay and the
/// end-of-stream verdict work the same for both protocols.
struct UpstreamEvents {
    parser: sse::Parser,
    translator: Option<anthropic::StreamTranslator>,
    ready: std::collections::VecDeque<sse::Event>,
}

impl UpstreamEvents {
    fn new(protocol: Protocol, include_usage: bool) -> Self {
        Self {
            parser: sse::Parser::default(),
            translator: (protocol == Protocol::Anthropic)
                .then(|| anthropic::StreamTranslator::new(include_usage)),
            ready: std::collections::VecDeque::new(),
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.parser.push(bytes);
    }

    fn pending(&self) -> usize {
        self.parser.pending()
    }

    fn next_event(&mut self, eof: bool) -> Option<sse::Event> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(e);
            }
            let event = self.parser.next_event(eof)?;
            let Some(translator) = &mut self.translator else {
                return Some(event);
            };
            // Comments and `event:`-only lines carry nothing to translate.
            let Some(data) = &event.data else { continue };
            match translator.on_event(data) {
                Ok(frames) => {
                    for raw in frames {
                        let data = std::str::from_utf8(&raw)
                            .ok()
                            .and_then(|t| t.strip_prefix("data: "))
                            .map(|t| t.trim_end().to_owned());
                        self.ready.push_back(sse::Event { raw, data });
                    }
                }
                // Data that is not a Messages event reads as a malformed event.
                Err(_) => {
                    return Some(sse::Event {
                        raw: Bytes::new(),
                        data: Some("{".to_owned()),
                    })
                }
            }
        }
    }
}

/// Who pays for an answer: token and cost metrics, the task's fallback
/// spend, and the provider's tokens-per-minute correction.
#[derive(Clone)]
struct Account {
    task: Arc<Task>,
    prompt_estimate: u64,
    max_tokens: Option<u64>,
}

impl Account {
    /// Books usage: the upstream's report, else the prompt estimate and one
    /// token per content chunk.
    fn settle(&self, target: &Target, usage: Option<(u64, u64)>, content_chunks: u64) {
        let (prompt, completion) = usage.unwrap_or((self.prompt_estimate, content_chunks));
        let name = target.name.clone();
        metrics::counter!(m::TOKENS, "target" => name.clone(), "kind" => "prompt")
            .increment(prompt);
        metrics::counter!(m::TOKENS, "target" => name.clone(), "kind" => "completion")
            .increment(completion);
        let usd = routing::usd(target, prompt, completion);
        if usd > 0.0 {
            metrics::gauge!(m::COST, "task" => self.task.name.clone(), "target" => name)
                .increment(usd);
        }
        let first = self
            .task
            .chain
            .first()
            .is_some_and(|f| std::ptr::eq(Arc::as_ptr(f), target));
        if !first {
            self.task.state.add_spend(usd);
        }
        if let Some(limits) = &target.provider.limits {
            let charged = self.prompt_estimate + self.max_tokens.or(target.max_output).unwrap_or(0);
            limits.correct((prompt + completion).saturating_sub(charged));
        }
    }
}

/// Streams after the commit point: relays events as they arrive and decides
/// the end-of-stream verdict for health and metrics.
struct Relay {
    /// The contract still to check at the end of the stream (tool calls under validation).
    contract: Option<Arc<Contract>>,
    calls: CallAssembler,
    /// Tool call deltas held until the calls are complete and valid.
    tool_held: BytesMut,
    account: Account,
    usage: Option<(u64, u64)>,
    content_chunks: u64,
    tx: mpsc::Sender<Bytes>,
    target: Arc<Target>,
    task: String,
    parser: UpstreamEvents,
    incoming: Incoming,
    finished: bool,
    done: bool,
    eof: bool,
    deadline: Instant,
    health: crate::health::HealthConfig,
}

/// How a committed stream ended.
enum Verdict {
    Complete,
    Interrupted(&'static str),
    ClientGone,
}

impl Relay {
    async fn run(mut self, held: Bytes, permit: Permit) {
        let verdict = self.relay(held).await;
        let target = Arc::clone(&self.target);
        self.account
            .settle(&target, self.usage, self.content_chunks);
        match verdict {
            Verdict::Complete => {
                attempt_ok(&target);
                if let Some(t) = target
                    .health
                    .record_success(permit, Instant::now(), &self.health)
                {
                    log_transition(&target, t);
                }
            }
            Verdict::Interrupted(reason) => {
                warn!(target = %target.name, reason, "stream interrupted after the commit point");
                metrics::counter!(m::STREAM_INTERRUPTS, "target" => target.name.clone(), "reason" => reason).increment(1);
                metrics::counter!(m::UPSTREAM_ATTEMPTS, "target" => target.name.clone(), "outcome" => "stream_interrupted")
                    .increment(1);
                let _ = self.tx.send(sse::interrupt_events(reason)).await;
                let failure = Failure {
                    counted: true,
                    cooldown: None,
                    class: "stream_interrupted",
                    jitter: rand::random::<f64>() * 2.0 - 1.0,
                };
                if let Some(t) =
                    target
                        .health
                        .record_failure(permit, Instant::now(), &failure, &self.health)
                {
                    log_transition(&target, t);
                }
            }
            Verdict::ClientGone => {
                info!(task = %self.task, target = %target.name, "client hung up mid-stream");
                metrics::counter!(m::CLIENT_CANCELLED, "task" => self.task.clone()).increment(1);
                drop(permit);
            }
        }
    }

    /// Sends what is batched; `Some(ClientGone)` if the client went away.
    async fn flush(&self, batch: &mut BytesMut) -> Option<Verdict> {
        if batch.is_empty() || self.send(batch.split().freeze()).await {
            None
        } else {
            Some(Verdict::ClientGone)
        }
    }

    async fn send(&self, bytes: Bytes) -> bool {
        bytes.is_empty() || self.tx.send(bytes).await.is_ok()
    }

    /// At the end of the answer: checks the held tool calls and sends them if
    /// they keep the contract. `Some(verdict)` ends the stream.
    async fn release_tool_calls(&mut self) -> Option<Verdict> {
        let contract = self.contract.take()?;
        if let Err(v) = contract.check_calls(&self.calls.calls()) {
            warn!(target = %self.target.name, violation = %v, "tool call breaks the contract after text was sent");
            metrics::counter!(m::CONTRACT_VIOLATIONS, "task" => self.task.clone(), "target" => self.target.name.clone())
                .increment(1);
            return Some(Verdict::Interrupted("contract_violation"));
        }
        let held = std::mem::take(&mut self.tool_held).freeze();
        if self.send(held).await {
            None
        } else {
            Some(Verdict::ClientGone)
        }
    }

    async fn relay(&mut self, held: Bytes) -> Verdict {
        if !self.send(held).await {
            return Verdict::ClientGone;
        }
        // Events parsed from one upstream read go out in one write: fewer
        // syscalls and frames, the same bytes, no added wait.
        let mut batch = BytesMut::new();
        loop {
            while let Some(event) = self.parser.next_event(self.eof) {
                if self.done {
                    break;
                }
                match sse::classify_event(&event) {
                    Chunk::Malformed => {
                        debug!(target = %self.target.name, "dropping malformed event");
                        metrics::counter!(m::STREAM_MALFORMED, "target" => self.target.name.clone()).increment(1);
                        continue;
                    }
                    Chunk::Error { .. } => {
                        return self
                            .flush(&mut batch)
                            .await
                            .unwrap_or(Verdict::Interrupted("upstream_error"));
                    }
                    Chunk::Done => self.done = true,
                    Chunk::Content { finished } => {
                        self.content_chunks += 1;
                        self.finished |= finished;
                        if let (Some(_), Some(data)) = (&self.contract, &event.data) {
                            let (tool, text) = self.calls.push_chunk(data);
                            if tool && !text && !finished {
                                self.tool_held.extend_from_slice(&event.raw);
                                if self.tool_held.len() > HOLD_MAX_TOOL_BYTES {
                                    return self
                                        .flush(&mut batch)
                                        .await
                                        .unwrap_or(Verdict::Interrupted("contract_violation"));
                                }
                                continue;
                            }
                        }
                    }
                    Chunk::NoContent { finished } => {
                        if let Some(data) = &event.data {
                            if data.contains("\"usage\"") {
                                self.usage = sse::usage(data.as_bytes()).or(self.usage);
                            }
                        }
                        self.finished |= finished
                    }
                    Chunk::Empty => {}
                }
                if (self.finished || self.done) && self.contract.is_some() {
                    if let Some(verdict) = self.flush(&mut batch).await {
                        return verdict;
                    }
                    if let Some(verdict) = self.release_tool_calls().await {
                        return verdict;
                    }
                }
                batch.extend_from_slice(&event.raw);
            }
            if self.done || self.eof {
                if let Some(verdict) = self.flush(&mut batch).await {
                    return verdict;
                }
            }
            if self.done {
                return Verdict::Complete;
            }
            if self.eof {
                if self.finished {
                    if let Some(verdict) = self.release_tool_calls().await {
                        return verdict;
                    }
                    // Ended cleanly without the sentinel: add it, never wait for it.
                    return if self.send(Bytes::from_static(sse::DONE)).await {
                        Verdict::Complete
                    } else {
                        Verdict::ClientGone
                    };
                }
                return Verdict::Interrupted("truncated");
            }
            // hyper hands a chunked body over one frame (one HTTP chunk; most
            // upstreams send one SSE event per chunk) at a time. Frames it has
            // already read join this batch (after one scheduler turn for its
            // connection task to decode the next); the batch goes out when the
            // next frame must be waited for.
            let mut ready = None;
            if batch.len() < BATCH_MAX_BYTES {
                ready = futures_util::FutureExt::now_or_never(self.incoming.frame());
                if ready.is_none() && !batch.is_empty() {
                    tokio::task::yield_now().await;
                    ready = futures_util::FutureExt::now_or_never(self.incoming.frame());
                }
            }
            let idle_deadline = self
                .deadline
                .min(Instant::now() + self.target.provider.idle_timeout);
            let frame = if let Some(f) = ready {
                Ok(f)
            } else {
                if let Some(verdict) = self.flush(&mut batch).await {
                    return verdict;
                }
                tokio::select! {
                    () = self.tx.closed() => return Verdict::ClientGone,
                    f = timeout_at(idle_deadline, self.incoming.frame()) => f,
                }
            };
            match frame {
                Err(_) if idle_deadline >= self.deadline => {
                    return Verdict::Interrupted("deadline")
                }
                Err(_) => return Verdict::Interrupted("idle_timeout"),
                Ok(None) => self.eof = true,
                Ok(Some(Err(_))) => {
                    return self
                        .flush(&mut batch)
                        .await
                        .unwrap_or(Verdict::Interrupted("reset"))
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.parser.push(&data);
                        if self.parser.pending() > sse::MAX_EVENT_BYTES {
                            return self
                                .flush(&mut batch)
                                .await
                                .unwrap_or(Verdict::Interrupted("event_too_large"));
                        }
                    }
                }
            }
        }
    }
}

fn network_failure(target: &Target, kind: NetworkKind, permit: Permit) -> AttemptEnd {
    let decision = target
        .provider
        .errors
        .classify(&Outcome::Network(kind))
        .unwrap_or_else(|| Decision {
            action: Action::Failover,
            health: true,
            cooldown: None,
            context_window: false,
            rule: "default:unmatched".to_owned(),
        });
    AttemptEnd::Failed {
        decision,
        label: kind.as_str().to_owned(),
        status: None,
        answer: None,
        permit,
    }
}

fn attempt_ok(target: &Target) {
    metrics::counter!(m::UPSTREAM_ATTEMPTS, "target" => target.name.clone(), "outcome" => "success").increment(1);
}

fn skip(task: &Task, target: &Target, why: &Exclusion) {
    debug!(target = %target.name, reason = why.reason(), "target skipped without a call: {}", why.describe());
    metrics::counter!(m::SKIPPED, "task" => task.name.clone(), "target" => target.name.clone(), "reason" => why.reason())
        .increment(1);
}

/// Logs a health state change and updates its metrics.
pub fn log_transition(target: &Target, t: Transition) {
    info!(target = %target.name, from = t.from.as_str(), to = t.to.as_str(), "target health changed");
    metrics::gauge!(m::TARGET_HEALTH, "target" => target.name.clone()).set(t.to.gauge());
    metrics::counter!(m::BREAKER_TRANSITIONS, "target" => target.name.clone(),
        "from" => t.from.as_str(), "to" => t.to.as_str())
    .increment(1);
}

/// Exponential backoff with full jitter: uniform in `[0, base * 2^(n-1)]`, capped.
fn full_jitter(base: Duration, retry: u32) -> Duration {
    let exp = base
        .saturating_mul(1u32 << (retry - 1).min(16))
        .min(BACKOFF_CAP);
    exp.mul_f64(rand::random::<f64>())
}

/// For a 2xx JSON body that is really an error (`{"error": ...}` without
/// `choices`): `Some(code)` with its numeric code, if any.
fn in_band_error(body: &[u8]) -> Option<Option<u16>> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
        choices: Option<serde::de::IgnoredAny>,
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    let probe: Probe<'_> = serde_json::from_slice(body).ok()?;
    match (probe.error, probe.choices) {
        (Some(e), None) if e.get() != "null" => Some(sse::error_code(e.get())),
        _ => None,
    }
}

/// Sets the content type switchyard answers with. Upstream header values are
/// never copied: a hostile upstream could put anything in them.
fn copy_content_type(from: &HeaderMap, to: &mut HeaderMap) {
    let is_sse = from
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    to.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(if is_sse {
            "text/event-stream"
        } else {
            "application/json"
        }),
    );
}

/// Replaces every occurrence of the provider's key in upstream text (a hostile
/// or careless upstream may echo it in an error message).
fn redact(body: Bytes, secret: Option<&crate::snapshot::Secret>) -> Bytes {
    let Some(key) = secret
        .map(|s| s.expose().as_bytes())
        .filter(|k| k.len() >= 4)
    else {
        return body;
    };
    if !body.windows(key.len()).any(|w| w == key) {
        return body;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut rest = &body[..];
    while let Some(i) = rest.windows(key.len()).position(|w| w == key) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(b"*****");
        rest = &rest[i + key.len()..];
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

/// A request refused before it reached a task: counted under task `unknown`.
#[must_use]
pub fn rejected(e: &GatewayError, request_id: &HeaderValue) -> Response<Body> {
    metrics::counter!(m::REQUESTS, "task" => "unknown", "target" => "none", "status" => e.status().as_str().to_owned())
        .increment(1);
    plain_error(e, request_id)
}

/// An OpenAI-format error response made by switchyard. Errors that switchyard
/// already retried and failed over on carry `x-should-retry: false`, which the
/// official SDKs honour, so a client does not multiply the upstream calls.
#[must_use]
pub fn plain_error(e: &GatewayError, request_id: &HeaderValue) -> Response<Body> {
    let mut resp = Response::new(full_body(e.body()));
    *resp.status_mut() = e.status();
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp.headers_mut()
        .insert(HeaderName::from_static(H_REQUEST_ID), request_id.clone());
    if matches!(
        e,
        GatewayError::AllTargetsFailed { .. }
            | GatewayError::DeadlineExceeded(_)
            | GatewayError::NoTargetAvailable
    ) {
        resp.headers_mut().insert(
            HeaderName::from_static("x-should-retry"),
            HeaderValue::from_static("false"),
        );
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_band_errors_are_recognised() {
        assert_eq!(
            in_band_error(br#"{"error":{"message":"quota","code":429}}"#),
            Some(Some(429))
        );
        assert_eq!(
            in_band_error(br#"{"error":{"message":"balance exhausted"}}"#),
            Some(None)
        );
        assert_eq!(in_band_error(br#"{"choices":[],"error":null}"#), None);
        assert_eq!(
            in_band_error(br#"{"choices":[{"message":{"content":"{\"error\":1}"}}]}"#),
            None
        );
        assert_eq!(in_band_error(b"[1,2]"), None);
    }

    #[test]
    fn keys_are_redacted_from_returned_bodies() {
        let key = crate::snapshot::Secret::new("sk-abc".into());
        let out = redact(
            Bytes::from_static(b"bad key sk-abc, really sk-abc!"),
            Some(&key),
        );
        assert_eq!(&out[..], b"bad key *****, really *****!");
    }

    #[test]
    fn full_jitter_is_bounded() {
        for n in 1..20 {
            assert!(full_jitter(Duration::from_millis(100), n) <= BACKOFF_CAP);
        }
        assert!(full_jitter(Duration::from_millis(100), 1) <= Duration::from_millis(100));
    }
}
