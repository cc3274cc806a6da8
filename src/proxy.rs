//! The attempt loop of `POST /v1/chat/completions`. [`chat_completions`]
//! runs these steps, in this order:
//!
//! 1. **parse** ([`ChatRequest::parse`]): the body becomes a typed view (400 naming the field).
//! 2. **route** ([`route`]): a task by `x-task-type`, else `model` (name or
//!    alias), else `default_task` (404 if none).
//! 3. **front door** ([`front_door`]): the caller's token bucket, then the
//!    task's (429 with `Retry-After`, nothing sent upstream).
//! 4. **plan** ([`routing::plan`]): the chain filtered and ordered; 400
//!    `no_eligible_target` when no target could ever take the request.
//! 5. **walk** ([`Walk::run`]): [`routing::Admission`] hands out the next
//!    target already admitted; [`Walk::try_target`] calls it
//!    ([`attempt::run`], up to the commit point) and retries it (exponential
//!    backoff, full jitter, never past the deadline) while the error table says
//!    `retry`; `failover` moves on (at most `max_failovers` times); `return`
//!    hands the upstream's client error back. A stream past its commit point
//!    is relayed ([`stream`]) and never replayed.
//! 6. **give up** ([`Walk::give_up`]): nothing served: switchyard's own error
//!    says why (504, 502, 503, the upstream's context-length 400, ...).
//! 7. **respond** ([`respond`]) and **account** ([`account`]): headers, request metrics.
//!
//! The client hanging up drops this future, which drops the upstream request
//! (closing its connection) and counts as `client_cancelled`, against no target.

pub mod account;
pub mod attempt;
mod cached;
pub mod continuation;
pub mod hedge;
mod repair;
pub mod respond;
pub mod stream;

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument};

use crate::body::Body;
use crate::classify::{Action, AttemptOutcome, Decision, Scope};
use crate::error::GatewayError;
use crate::native::{self, Protocol};
use crate::request::{ChatRequest, EmbeddingsRequest, Prompt};
use crate::routing::{self, Admission, Admitted, Holdbacks, Needs, Payload};
use crate::schema::{Contract, Mode as ValidateMode, Violation};
use crate::snapshot::{KeySet, Snapshot, Target, Task};
use crate::telemetry::{self, AttemptFailure, RequestTrace};
use crate::upstream::{self, Operation};
use account::{Account, CancelGuard};
use attempt::{Attempt, Call, Failed, Step};
use continuation::{Origin, Recovery};
use respond::Tally;
use stream::Relay;

/// Longest backoff between two retries of one target.
const BACKOFF_CAP: Duration = Duration::from_secs(10);

/// One client request as the server hands it over.
#[derive(Debug)]
pub struct Exchange<'a> {
    /// The config it runs against.
    pub snapshot: Arc<Snapshot>,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's address (its rate-limit bucket when it sends no caller header).
    pub peer: IpAddr,
    /// The request body, as sent.
    pub body: Bytes,
    /// The request's id (sent upstream, echoed back).
    pub request_id: HeaderValue,
    /// When it arrived.
    pub arrival: Instant,
    /// The client's own body, when it spoke another protocol ([`crate::native`]).
    pub native: Option<native::Body>,
    /// Its telemetry record.
    pub trace: RequestTrace,
    /// The drain's cut, for a stream still running at `drain_timeout`.
    pub drain: &'a crate::body::Drain,
    /// Renders a stream in the client's protocol when it speaks another.
    pub render: Option<Box<dyn native::StreamRender>>,
}

/// Handles one `POST /v1/chat/completions` (and the other front doors'
/// requests, whose chat translation is read only when something needs it).
pub async fn chat_completions(mut x: Exchange<'_>) -> Response<Body> {
    let render = x.render.take();
    let request = match &x.native {
        Some(native) => Prompt::native(native),
        None => match ChatRequest::parse(&x.body) {
            Ok(r) => Prompt::chat(r, &x.body),
            Err(e) => return rejected(&x, &e.into()),
        },
    };
    let facts = &request.facts;
    let task = match route(&x, facts.model.as_deref()) {
        Ok(task) => task,
        Err(e) => return rejected(&x, &e),
    };
    x.trace
        .routed("chat", &task.name, facts.model.as_deref(), facts.stream);
    if let Some(space) = &task.embedding {
        let why = format!(
            "task `{}` serves embeddings ({space}): send them to /v1/embeddings",
            task.name
        );
        return refused(&x, &task, &GatewayError::bad_request(why));
    }
    // Only a request with tools or a JSON format has a contract to read;
    // any other's is the task's bare one: no call may come.
    let contract = match task.validate_tool_calls {
        ValidateMode::Never => None,
        ValidateMode::Degraded | ValidateMode::Always if facts.tools || facts.json_mode => {
            let read = request.read(|view| Contract::from_request(view, &task.tool_schemas));
            let Some(contract) = read else {
                return refused(&x, &task, &untranslated());
            };
            contract.map(Arc::new)
        }
        ValidateMode::Degraded | ValidateMode::Always => Some(Arc::clone(&task.bare_contract)),
    };
    let shape = Shape {
        payload: Payload::Chat(&request),
        stream: facts.stream,
        include_usage: facts.include_usage,
        choices: facts.choices,
        contract,
        render,
    };
    serve(&x, &task, Needs::of(facts), shape).await
}

/// A front door's translation that does not read as a chat request: never
/// made (each front door writes a request the chat parser reads), but not a
/// panic if it were.
fn untranslated() -> GatewayError {
    GatewayError::bad_request("the request has no chat translation switchyard can read")
}

/// Handles one `POST /v1/embeddings`: the same tasks, chains, health and
/// limits, on a task whose chain is one embedding space.
pub async fn embeddings(x: Exchange<'_>) -> Response<Body> {
    let request = match EmbeddingsRequest::parse(&x.body) {
        Ok(r) => r,
        Err(e) => return rejected(&x, &e.into()),
    };
    let task = match route(&x, request.model.as_deref()) {
        Ok(task) => task,
        Err(e) => return rejected(&x, &e),
    };
    x.trace
        .routed("embeddings", &task.name, request.model.as_deref(), false);
    if task.embedding.is_none() {
        let why = format!(
            "task `{}` serves chat completions: no target of its chain declares an `embedding` space",
            task.name
        );
        return refused(&x, &task, &GatewayError::bad_request(why));
    }
    let needs = Needs {
        prompt_tokens: request.input_tokens,
        max_tokens: Some(0),
        ..Needs::default()
    };
    let shape = Shape {
        payload: Payload::Embeddings(&request),
        stream: false,
        include_usage: false,
        choices: 1,
        contract: None,
        render: None,
    };
    serve(&x, &task, needs, shape).await
}

/// What kind of request a walk serves.
struct Shape<'a> {
    payload: Payload<'a>,
    stream: bool,
    include_usage: bool,
    /// How many choices (`n`).
    choices: u32,
    /// The tool call contract, when the task validates tool calls.
    contract: Option<Arc<Contract>>,
    /// The client's stream renderer, when it speaks another protocol.
    render: Option<Box<dyn native::StreamRender>>,
}

/// Steps 3 to 7 for a routed request.
async fn serve(
    x: &Exchange<'_>,
    task: &Arc<Task>,
    needs: Needs,
    shape: Shape<'_>,
) -> Response<Body> {
    let snapshot = &x.snapshot;
    if let Err(e) = front_door(snapshot, task, x.headers, x.peer) {
        let resp = respond::plain_error(&e, &x.request_id);
        account::answered(task, None, resp.status().as_u16(), x.arrival);
        return resp;
    }
    let mut render = shape.render;
    if let Some(render) = &mut render {
        render.prompt_estimate(needs.prompt_tokens);
    }
    let mut cached = cached::Cached::of(task, x.headers, &shape.payload, needs.prompt_tokens);
    let reply = cached::Reply {
        stream: shape.stream,
        include_usage: shape.include_usage,
        request_id: &x.request_id,
        trace: &x.trace,
    };
    if let Some(cached) = &mut cached {
        if let Some(resp) = cached.fresh(x, &reply, &mut render).await {
            account::answered(task, None, resp.status().as_u16(), x.arrival);
            return resp;
        }
    }
    let guard = CancelGuard::new(task);
    let plan = routing::plan(task, &needs, Instant::now());
    let mut walk = Walk {
        snapshot,
        shared: snapshot,
        prompt: match shape.payload {
            Payload::Chat(prompt) => Some(prompt),
            Payload::Embeddings(_) => None,
        },
        tried: Vec::new(),
        task,
        op: shape.payload.operation(),
        base64: shape.payload.base64(),
        stream: shape.stream,
        include_usage: shape.include_usage,
        choices: shape.choices,
        resends: AtomicU32::new(0),
        request_id: &x.request_id,
        client_headers: x.headers,
        arrival: x.arrival,
        drain: x.drain,
        deadline: x.arrival + task.budget.total_timeout,
        contract: shape.contract,
        render,
        fill: cached.as_ref().and_then(cached::Cached::fill),
        native: match shape.payload {
            Payload::Chat(prompt) => prompt.native.map(|n| n.protocol),
            Payload::Embeddings(_) => None,
        },
        account: Account {
            task: Arc::clone(task),
            prompt_estimate: needs.prompt_tokens,
            max_tokens: needs.max_tokens,
            trace: x.trace.clone(),
            first_choice: plan.first_choice(task),
        },
        tally: Tally::default(),
        holdbacks: Holdbacks::default(),
        last_status: None,
        deadline_hit: false,
        served: None,
        local_failure: None,
        violation: None,
        hedge_result: None,
        context_answer: None,
        credit_answer: None,
    };
    let response = walk.planned(plan, &needs, shape.payload).await;
    let response = match &cached {
        Some(cached) => cached.after(response, &reply, walk.render.take()).await,
        None => response,
    };
    guard.disarm();
    // The serving target as a value: a name that is no header value (not
    // ASCII) must still be counted under its own name.
    let served = walk.served.take();
    let served = served.as_deref();
    account::answered(task, served, response.status().as_u16(), x.arrival);
    walk.account.trace.served(
        served.map(|t| (t.name.as_str(), t.provider.name.as_str())),
        walk.tally.attempts,
        walk.tally.failovers,
        served.is_some_and(|t| walk.degraded(t)),
    );
    response
}

/// How long an answer says to wait before a target may serve: a 429, or a
/// 503 `no_target_available`, with `Retry-After`.
fn worth_waiting(resp: &Response<Body>) -> Option<Duration> {
    let waits = matches!(resp.status().as_u16(), 429 | 503);
    let seconds = resp
        .headers()
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .parse::<u64>()
        .ok()?;
    waits.then(|| Duration::from_secs(seconds))
}

/// Step 2: the task a request selects: by `x-task-type`, else `model`.
///
/// # Errors
/// 404 for a name no task answers to, 400 when nothing names a task.
fn route(x: &Exchange<'_>, model: Option<&str>) -> Result<Arc<Task>, GatewayError> {
    let task_header = respond::task_header(x.headers);
    x.snapshot
        .route(task_header, model)
        .cloned()
        .ok_or_else(|| match task_header.or(model) {
            Some(asked) => GatewayError::UnknownModel(asked.chars().take(128).collect()),
            None => GatewayError::bad_request("`model` is required (or an `x-task-type` header)"),
        })
}

/// A routed request the task cannot take (counted under the task).
fn refused(x: &Exchange<'_>, task: &Task, e: &GatewayError) -> Response<Body> {
    let resp = respond::plain_error(e, &x.request_id);
    account::answered(task, None, resp.status().as_u16(), x.arrival);
    resp
}

/// Step 3: the task's client-facing buckets: the caller's own (by header,
/// else by `peer`), then the task-wide one.
///
/// # Errors
/// 429 with the wait until the bucket admits a request.
fn front_door(
    snapshot: &Snapshot,
    task: &Task,
    headers: &HeaderMap,
    peer: IpAddr,
) -> Result<(), GatewayError> {
    let Some(limiter) = &task.rate_limit else {
        return Ok(());
    };
    limiter.admit(headers, peer).map_err(|(wait, scope)| {
        snapshot.rate_limited.increment(scope, 1);
        GatewayError::RateLimited(wait)
    })
}

/// A request refused before it reached a task: counted under task `unknown`.
fn rejected(x: &Exchange<'_>, e: &GatewayError) -> Response<Body> {
    x.snapshot.unrouted.increment(e.status().as_u16(), 1);
    respond::plain_error(e, &x.request_id)
}

/// How trying one target (with its retries) ended.
enum TargetEnd {
    Served(Response<Body>),
    Deadline,
    /// switchyard ran out of a local resource: no target would fare better.
    Local,
    /// Give up on this target; `reason` labels the failover that follows.
    Exhausted {
        reason: &'static str,
    },
}

/// The reason an attempt was abandoned when switchyard itself ran out of a resource.
const LOCAL_FAILURE: &str = "local_resources";

/// One request's walk along the chain.
struct Walk<'a> {
    snapshot: &'a Snapshot,
    /// The same snapshot, to hand to a stream that outlives this walk.
    shared: &'a Arc<Snapshot>,
    /// The chat request (a continued stream sends it again, a repair quotes it).
    prompt: Option<&'a Prompt<'a>>,
    /// Targets called so far, in order.
    tried: Vec<Arc<Target>>,
    task: &'a Arc<Task>,
    /// What the request asks of the providers.
    op: Operation,
    /// Embeddings asked for as base64.
    base64: bool,
    /// A streaming request.
    stream: bool,
    /// `stream_options.include_usage`.
    include_usage: bool,
    /// How many choices (`n`).
    choices: u32,
    /// Stale-connection resends of the attempt just made (upstream calls too).
    resends: AtomicU32,
    request_id: &'a HeaderValue,
    client_headers: &'a HeaderMap,
    drain: &'a crate::body::Drain,
    arrival: Instant,
    deadline: Instant,
    /// The request's tool contract, when the task validates tool calls.
    contract: Option<Arc<Contract>>,
    /// The client's protocol, when its own body is at hand for a target
    /// that speaks it.
    native: Option<Protocol>,
    /// The client's stream renderer, for the stream that commits.
    render: Option<Box<dyn native::StreamRender>>,
    /// Where a whole answer is kept, when the task caches and the request may be.
    fill: Option<crate::cache::Fill>,
    account: Account,
    tally: Tally,
    /// What held attempted targets back (rate limits) or that one failed for real.
    holdbacks: Holdbacks,
    last_status: Option<u16>,
    deadline_hit: bool,
    /// The target whose answer (or error, for the caller) the response is.
    served: Option<Arc<Target>>,
    /// switchyard ran out of a local resource (descriptors, ports): its own
    /// 503, never a provider's failure.
    local_failure: Option<crate::upstream::LocalResource>,
    /// The last contract violation seen.
    violation: Option<Violation>,
    /// How the hedge went, when one ran (`won`, `lost`, `cancelled`).
    hedge_result: Option<&'static str>,
    /// An upstream's context-length error, and the attempt count when it came:
    /// the client's answer if no larger window got to try.
    context_answer: Option<KeptAnswer>,
    /// The last out-of-credit error, if the last failure was one.
    credit_answer: Option<KeptAnswer>,
}

impl Drop for Walk<'_> {
    fn drop(&mut self) {
        // A walk cut short (the client hung up before an answer) made its
        // upstream calls all the same: the request's record counts them.
        self.account
            .trace
            .at_least(self.tally.attempts, self.tally.failovers);
    }
}

impl Walk<'_> {
    /// Steps 4 to 6 on `plan`: why no target could ever take the request,
    /// or the walk (and a batch task's waits in its queue).
    async fn planned(
        &mut self,
        plan: routing::Plan,
        needs: &Needs,
        payload: Payload<'_>,
    ) -> Response<Body> {
        if let Some(why) = plan.ineligible() {
            return self.error(&GatewayError::NoEligibleTarget {
                why: why.describe(),
                too_long: matches!(why, routing::Exclusion::ContextWindow { .. }),
            });
        }
        let mut admission = Admission::new(self.snapshot, self.task, plan, needs, payload);
        let first = self.run(&mut admission).await;
        match &self.task.queue {
            Some(queue) => self.queued(queue, first, needs, payload).await,
            None => first,
        }
    }

    /// A batch task's answer that says a wait would help (429, or 503 with a
    /// `Retry-After`): the request waits in the task's queue, in arrival
    /// order, until then (within `max_wait` and the deadline) and walks
    /// again, as often as that holds. A full queue keeps the answer as it is.
    async fn queued(
        &mut self,
        queue: &crate::ratelimit::Queue,
        first: Response<Body>,
        needs: &Needs,
        payload: Payload<'_>,
    ) -> Response<Body> {
        let mut resp = first;
        let Some(wait) = worth_waiting(&resp) else {
            return resp;
        };
        let Some(place) = queue.enter() else {
            return resp;
        };
        let give_up = self.deadline.min(Instant::now() + queue.max_wait);
        let mut wait = Some(wait);
        while let Some(w) = wait {
            let until = (Instant::now() + w).min(give_up);
            if until >= give_up && Instant::now() + w > give_up {
                break;
            }
            queue.wait_until(&place, until).await;
            self.again();
            let plan = routing::plan(self.task, needs, Instant::now());
            let mut admission = Admission::new(self.snapshot, self.task, plan, needs, payload);
            resp = self.run(&mut admission).await;
            wait = worth_waiting(&resp);
        }
        resp
    }

    /// Ready for another walk after a wait: what held the last one back is
    /// judged anew.
    fn again(&mut self) {
        self.account.trace.walk_again();
        self.holdbacks = Holdbacks::default();
        self.last_status = None;
        self.deadline_hit = false;
        self.local_failure = None;
        self.served = None;
    }

    /// Step 5: the outer (failover) loop.
    /// Walks `admission`'s candidates; what it left out goes to the access log.
    async fn run(&mut self, admission: &mut Admission<'_>) -> Response<Body> {
        let resp = self.walk_chain(admission).await;
        self.account.trace.skipped(admission.skipped());
        resp
    }

    async fn walk_chain(&mut self, admission: &mut Admission<'_>) -> Response<Body> {
        let mut previous: Option<(Arc<Target>, &'static str)> = None;
        let mut tries_after_violation = 0;
        loop {
            if self.violation.is_some() && tries_after_violation >= 1 {
                // A violation gets one more candidate, not the whole chain.
                break;
            }
            if Instant::now() >= self.deadline {
                // A request body that arrived past the deadline opens no upstream call.
                self.deadline_hit = true;
                break;
            }
            let Some(admitted) = admission.next(self.tally.attempts == 0) else {
                break;
            };
            if self.violation.is_some() {
                tries_after_violation += 1;
            }
            if let Some((from, reason)) = &previous {
                if self.tally.failovers >= self.task.budget.max_failovers {
                    debug!(task = %self.task.name, "max_failovers reached");
                    break;
                }
                self.failover(from, &admitted.target, reason);
            }
            let target = Arc::clone(&admitted.target);
            match self.try_target(admitted, admission).await {
                TargetEnd::Served(resp) => return resp,
                TargetEnd::Deadline => {
                    self.deadline_hit = true;
                    break;
                }
                TargetEnd::Local => break,
                TargetEnd::Exhausted { reason } => previous = Some((target, reason)),
            }
        }
        self.give_up(admission)
    }

    fn failover(&mut self, from: &Target, to: &Target, reason: &'static str) {
        self.tally.failovers += 1;
        info!(task = %self.task.name, from = %from.name, to = %to.name, reason, "failover");
        telemetry::failover(&from.name, &to.name, reason);
        self.snapshot
            .metrics
            .counter(
                crate::metrics::FAILOVERS,
                &[
                    ("task", self.task.name.clone().into()),
                    ("from", from.name.clone().into()),
                    ("to", to.name.clone().into()),
                    ("reason", reason.into()),
                ],
            )
            .increment(1);
    }

    /// Step 5a: the inner (retry) loop on one target.
    async fn try_target(&mut self, admitted: Admitted, admission: &mut Admission<'_>) -> TargetEnd {
        let Admitted {
            target,
            permit,
            body,
            key,
        } = admitted;
        let mut permit = Some(permit);
        let mut reason = "unknown";
        let mut tries = Tries::on_key(key);
        loop {
            if let Some(pause) = tries.pause.take() {
                permit = retry_permit(pause, &target, tries.key, admission).await;
            }
            let Some(p) = permit.take() else { break };
            let first = self.tally.attempts == 0;
            self.tally.attempts += 1;
            if !self.tried.iter().any(|t| Arc::ptr_eq(t, &target)) {
                self.tried.push(Arc::clone(&target));
            }
            let span = self.account.trace.attempt(&attempt::span_info(
                &target,
                self.tally.attempts,
                self.op,
            ));
            let outcome = match (first, self.task.hedge) {
                (true, Some(policy)) => {
                    let primary = Racer {
                        target: &target,
                        key: tries.key,
                        span: &span,
                    };
                    match self
                        .hedged(primary, body.clone(), p, policy, admission)
                        .await
                    {
                        Hedged::Alone(outcome) => outcome,
                        Hedged::Won {
                            target,
                            attempt,
                            span,
                        } => {
                            let served = self.deliver(&target, attempt, &span);
                            return served.map_or(TargetEnd::Deadline, TargetEnd::Served);
                        }
                        Hedged::Returned(resp) => return TargetEnd::Served(resp),
                        Hedged::BothFailed { reason } => return TargetEnd::Exhausted { reason },
                    }
                }
                (true, None) | (false, _) => {
                    let call = self.call(&target, tries.key);
                    attempt::run(&call, body.clone(), p)
                        .instrument(span.clone())
                        .await
                }
            };
            // A stale pooled connection's resend was an upstream call too.
            self.tally.attempts += self.resends.swap(0, Ordering::Relaxed);
            match outcome {
                answer @ (Attempt::Answer { .. } | Attempt::Committed(_)) => {
                    let served = self.deliver(&target, answer, &span);
                    return served.map_or(TargetEnd::Deadline, TargetEnd::Served);
                }
                Attempt::Deadline => {
                    telemetry::attempt_abandoned(&span, "deadline", "return");
                    return TargetEnd::Deadline;
                }
                Attempt::Local(resource) => {
                    // Never sent: not an upstream call (`x-switchyard-attempts`).
                    self.tally.attempts = self.tally.attempts.saturating_sub(1);
                    self.local(resource, &span);
                    return TargetEnd::Local;
                }
                Attempt::Violated(violated) => {
                    telemetry::attempt_abandoned(&span, "contract_violation", "failover");
                    let served = self.violated_then_reask(&target, tries.key, *violated, admission);
                    if let Some(resp) = served.await {
                        return TargetEnd::Served(resp);
                    }
                    return TargetEnd::Exhausted {
                        reason: AttemptOutcome::ContractViolation.label(),
                    };
                }
                Attempt::Failed(failed) => {
                    reason = failed.outcome.label();
                    match self.failed(&target, failed, &mut tries, admission, &span) {
                        Next::Retry => {}
                        Next::Failover => break,
                        Next::Return(resp) => return TargetEnd::Served(resp),
                    }
                }
            }
        }
        TargetEnd::Exhausted { reason }
    }

    /// An answer from `target` (a body, or a committed stream) as the
    /// client's response; `None` for anything else.
    fn deliver(
        &mut self,
        target: &Arc<Target>,
        attempt: Attempt,
        span: &tracing::Span,
    ) -> Option<Response<Body>> {
        let (resp, repaired) = match attempt {
            Attempt::Answer {
                status,
                body,
                repaired,
                native,
            } => {
                telemetry::attempt_served(span, status.as_u16());
                if let (Some(fill), StatusCode::OK) = (self.fill.take(), status) {
                    fill.answer(&body, |prompt, completion| target.usd(prompt, completion));
                }
                let mut resp = self.whole_answer(status, body);
                if let Some(native) = native {
                    resp.extensions_mut().insert(native);
                }
                (resp, repaired)
            }
            Attempt::Committed(commit) => {
                telemetry::attempt_served(span, StatusCode::OK.as_u16());
                let repaired = commit.repaired;
                let origin = Origin {
                    // Written for a task that continues streams only.
                    body: match self.prompt {
                        Some(prompt) if self.task.stream_recovery.continues => {
                            prompt.bytes().clone()
                        }
                        Some(_) | None => Bytes::new(),
                    },
                    request_id: self.request_id.clone(),
                    client_headers: upstream::forwardable(self.client_headers),
                    arrival: self.arrival,
                    deadline: self.deadline,
                    include_usage: self.include_usage,
                    trace: self.account.trace.clone(),
                    first_choice: self.account.first_choice.clone(),
                    contract: self.contract.clone(),
                    failovers_left: self
                        .task
                        .budget
                        .max_failovers
                        .saturating_sub(self.tally.failovers),
                };
                let recovery = Recovery::new(
                    Arc::clone(self.shared),
                    Arc::clone(self.task),
                    origin,
                    self.tried.clone(),
                )
                .map(Box::new);
                let relay_span = if telemetry::tracing_on() {
                    span.clone()
                } else {
                    tracing::Span::current()
                };
                let drain = self.drain.watch();
                let render = self.render.take();
                let fill = self.fill.take();
                let relay = Relay::new(*commit, recovery, relay_span, drain, render, fill);
                (respond::stream(relay.into_body()), repaired)
            }
            Attempt::Failed(_) | Attempt::Deadline | Attempt::Local(_) | Attempt::Violated(_) => {
                return None
            }
        };
        let mut resp = self.serve(resp, target);
        if let Some(method) = repaired {
            respond::repaired(&mut resp, method);
        }
        Some(resp)
    }

    /// A whole answer: as it came, or, to a client that asked for a stream
    /// (a repaired held stream), as the stream that carries it.
    fn whole_answer(&mut self, status: StatusCode, body: Bytes) -> Response<Body> {
        let events = self
            .stream
            .then(|| crate::sse::events_of_completion(&body, self.include_usage))
            .flatten();
        let Some(mut events) = events else {
            return respond::completion(status, body);
        };
        if let Some(mut render) = self.render.take() {
            let mut out = bytes::BytesMut::new();
            native::render_events(render.as_mut(), &events, &mut out);
            render.done(&mut out);
            events = out.freeze();
        }
        self.account.trace.committed();
        self.account.trace.stream_end("complete", false);
        respond::stream(crate::body::full(events))
    }

    /// The first attempt of a hedging task, raced against the next admitted
    /// target if it has not committed after the policy's delay.
    async fn hedged(
        &mut self,
        primary: Racer<'_>,
        body: Bytes,
        permit: crate::health::Permit,
        policy: crate::snapshot::HedgePolicy,
        admission: &mut Admission<'_>,
    ) -> Hedged {
        self.task.state.count_request();
        let delay = policy.delay(|q| primary.target.health.ttft_quantile(q));
        let budget_left = self.tally.failovers < self.task.budget.max_failovers;
        let mut hedge: Option<(Arc<Target>, Option<usize>, tracing::Span)> = None;
        let mut suppressed = false;
        let raced = {
            let walk: &Walk<'_> = self;
            let call = walk.call(primary.target, primary.key);
            let start = || {
                if !budget_left || !walk.task.state.take_hedge(policy.max_share) {
                    suppressed = true;
                    return None;
                }
                let Some(admitted) = admission.next(false) else {
                    suppressed = true;
                    return None;
                };
                let span = walk.account.trace.attempt(&attempt::span_info(
                    &admitted.target,
                    walk.tally.attempts + 1,
                    walk.op,
                ));
                hedge = Some((Arc::clone(&admitted.target), admitted.key, span.clone()));
                Some(
                    async move {
                        let call = walk.call(&admitted.target, admitted.key);
                        attempt::run(&call, admitted.body, admitted.permit).await
                    }
                    .instrument(span),
                )
            };
            let first = attempt::run(&call, body, permit).instrument(primary.span.clone());
            // An error the caller must hear (a 400) ends the race like an
            // answer: the other side was sent the same request.
            hedge::race(first, delay, start, |a| {
                matches!(a, Attempt::Answer { .. } | Attempt::Committed(_)) || a.is_for_the_caller()
            })
            .await
        };
        if suppressed {
            self.task.hedges.increment("suppressed", 1);
        }
        let (Some((target, key, span)), true) = (hedge, raced.hedged) else {
            // Not hedged: the primary ran alone to its end.
            return match raced.primary {
                Some(outcome) => Hedged::Alone(outcome),
                None => Hedged::Alone(Attempt::Deadline),
            };
        };
        let hedge = Racer {
            target: &target,
            key,
            span: &span,
        };
        self.settle_race(primary, hedge, raced, admission)
    }

    /// After a race that hedged: books both sides and says who answered.
    fn settle_race(
        &mut self,
        primary: Racer<'_>,
        hedge: Racer<'_>,
        raced: hedge::Raced<Attempt>,
        admission: &mut Admission<'_>,
    ) -> Hedged {
        self.tally.attempts += 1 + self.resends.swap(0, Ordering::Relaxed);
        self.tried.push(Arc::clone(hedge.target));
        info!(task = %self.task.name, primary = %primary.target.name, hedge = %hedge.target.name, "hedged the first attempt");
        self.failover(primary.target, hedge.target, "hedge");
        let hedge::Raced {
            primary: p_out,
            hedge: h_out,
            winner,
            ..
        } = raced;
        let mut won = None;
        let mut returned = None;
        let mut reason = AttemptOutcome::Network(crate::classify::NetworkKind::Timeout).label();
        for (side, racer, out) in [
            (hedge::Side::Primary, primary, p_out),
            (hedge::Side::Hedge, hedge, h_out),
        ] {
            match out {
                Some(answer @ (Attempt::Answer { .. } | Attempt::Committed(_)))
                    if winner == Some(side) =>
                {
                    won = Some((racer, answer));
                }
                Some(failure) => {
                    let (label, for_caller) = self.raced_failure(racer, failure, admission);
                    reason = label;
                    if returned.is_none() {
                        returned = for_caller;
                    }
                }
                None => {
                    // Cancelled before it answered: no one's failure; its prompt was still sent.
                    telemetry::attempt_abandoned(racer.span, "cancelled", "hedge");
                    self.account.settle_abandoned(racer.target);
                }
            }
        }
        let result = match (winner, &won) {
            (Some(hedge::Side::Hedge), Some(_)) => "won",
            (Some(hedge::Side::Primary), Some(_)) => "lost",
            (_, None) | (None, Some(_)) => "cancelled",
        };
        self.task.hedges.increment(result, 1);
        self.hedge_result = Some(result);
        match (won, returned) {
            (Some((racer, attempt)), _) => Hedged::Won {
                target: Arc::clone(racer.target),
                attempt,
                span: racer.span.clone(),
            },
            (None, Some(resp)) => Hedged::Returned(resp),
            (None, None) => Hedged::BothFailed { reason },
        }
    }

    /// A side of a hedged race that ended without an answer: recorded like
    /// any failed attempt, with no retry. Returns its outcome label and, for
    /// an error the caller must hear (the table says `return`), the response.
    fn raced_failure(
        &mut self,
        racer: Racer<'_>,
        outcome: Attempt,
        admission: &mut Admission<'_>,
    ) -> (&'static str, Option<Response<Body>>) {
        let target = racer.target;
        match outcome {
            Attempt::Failed(failed) => {
                let Failed {
                    decision,
                    outcome,
                    status,
                    answer,
                    permit,
                } = failed;
                let now = Instant::now();
                self.held_back_by(status, &decision, now);
                // A raced side is not tried again: return or fail over.
                let step = attempt::next_step(&decision, false, None, target, now, self.deadline);
                let action = match step {
                    Step::Return => "return",
                    Step::NextKey | Step::Retry(_) | Step::Failover => "failover",
                };
                info!(target = %target.name, outcome = outcome.label(), rule = %decision.rule, next = action, "hedged attempt failed");
                let failure = AttemptFailure {
                    outcome: outcome.label(),
                    status,
                    rule: &decision.rule,
                    action,
                };
                telemetry::attempt_failed(racer.span, &failure);
                attempt::record(
                    &self.snapshot.health,
                    target,
                    &decision,
                    outcome,
                    permit,
                    racer.key,
                );
                if decision.context_window {
                    self.context_error(target, answer.as_ref(), admission);
                }
                let wait = decision.advertised;
                let for_caller =
                    (step == Step::Return).then(|| self.returned(target, answer, wait));
                (outcome.label(), for_caller)
            }
            Attempt::Violated(v) => {
                telemetry::attempt_abandoned(racer.span, "contract_violation", "failover");
                self.violated(target, v.violation, v.permit);
                (AttemptOutcome::ContractViolation.label(), None)
            }
            Attempt::Deadline => {
                telemetry::attempt_abandoned(racer.span, "deadline", "return");
                self.deadline_hit = true;
                ("deadline", None)
            }
            Attempt::Local(resource) => {
                self.local(resource, racer.span);
                (LOCAL_FAILURE, None)
            }
            Attempt::Answer { .. } | Attempt::Committed(_) => ("success", None),
        }
    }

    /// switchyard could not send the attempt (out of descriptors or ports):
    /// nothing is recorded against the target, and the walk answers 503.
    fn local(&mut self, resource: crate::upstream::LocalResource, span: &tracing::Span) {
        warn!(task = %self.task.name, error = %resource, "attempt not sent: switchyard is out of a local resource");
        telemetry::attempt_abandoned(span, LOCAL_FAILURE, "return");
        self.local_failure = Some(resource);
    }

    /// What a failure tells the walk's final answer: the last upstream
    /// status, and whether a rate limit (until when) or a real failure held
    /// the request back.
    fn held_back_by(&mut self, status: Option<u16>, decision: &Decision, now: Instant) {
        self.last_status = status.or(self.last_status);
        match (decision.rate_limited, decision.cooldown) {
            (true, Some(cooldown)) => self.holdbacks.limited(now + cooldown),
            (true, None) | (false, _) => self.holdbacks.failed = true,
        }
    }

    /// The upstream's own error, for the caller (the table said `return`),
    /// with the wait it advertised when it is a 429 or a 503: the client's
    /// SDK waits that long rather than by its own backoff.
    fn returned(
        &mut self,
        target: &Arc<Target>,
        answer: Option<(StatusCode, Bytes)>,
        advertised: Option<Duration>,
    ) -> Response<Body> {
        let (status, bytes) = answer.unwrap_or((StatusCode::BAD_GATEWAY, Bytes::new()));
        let mut resp = respond::upstream_error(self.snapshot, status, &bytes, target);
        if let (429 | 503, Some(wait)) = (status.as_u16(), advertised) {
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        self.serve(resp, target)
    }

    /// A context-length error from `target`: only larger windows are tried
    /// from here, and its answer is kept for the client in case none is left.
    fn context_error(
        &mut self,
        target: &Arc<Target>,
        answer: Option<&(StatusCode, Bytes)>,
        admission: &mut Admission<'_>,
    ) {
        admission.raise_context_floor(target);
        self.context_answer = answer.map(|a| KeptAnswer::of(a, target, self.tally.attempts));
    }

    /// What one attempt of `target` needs.
    fn call<'c>(&'c self, target: &'c Arc<Target>, key: Option<usize>) -> Call<'c> {
        Call {
            key,
            op: self.op,
            base64: self.base64,
            resends: &self.resends,
            snapshot: self.snapshot,
            task: self.task,
            target,
            stream: self.stream,
            include_usage: self.include_usage,
            choices: self.choices,
            request_id: self.request_id,
            client_headers: self.client_headers,
            arrival: self.arrival,
            deadline: self.deadline,
            contract: self.contract_for(target),
            account: &self.account,
            native: self.native.is_some()
                && target.provider.endpoint.native_protocol() == self.native,
            cached: self.fill.is_some(),
        }
    }

    /// The contract to hold `target`'s answer to, per the task's
    /// `validate_tool_calls` (`degraded`: not the first choice).
    fn contract_for(&self, target: &Arc<Target>) -> Option<Arc<Contract>> {
        let contract = self.contract.as_ref()?;
        let applies = match self.task.validate_tool_calls {
            ValidateMode::Always => true,
            ValidateMode::Never => false,
            ValidateMode::Degraded => self.degraded(target),
        };
        applies.then(|| Arc::clone(contract))
    }

    /// Whether `target` is not the one a healthy chain would have served from.
    fn degraded(&self, target: &Target) -> bool {
        self.account
            .first_choice
            .as_ref()
            .is_none_or(|first| !std::ptr::eq(&**first, target))
    }

    /// An answer (or a relayed upstream error) from `target`, with its headers.
    fn serve(&mut self, mut resp: Response<Body>, target: &Arc<Target>) -> Response<Body> {
        self.served = Some(Arc::clone(target));
        let degraded = self.degraded(target);
        respond::decorate(&mut resp, target, degraded, self.tally, self.request_id);
        if let Some(result) = self.hedge_result {
            respond::hedge_result(&mut resp, result);
        }
        resp
    }

    /// A well-formed answer that broke the contract: the upstream answered,
    /// it is the answer that is unusable, so health does not count it.
    fn violated(&mut self, target: &Target, violation: Violation, permit: crate::health::Permit) {
        warn!(target = %target.name, violation = %violation, "answer breaks the tool call contract");
        self.task
            .route_metrics(Some(target))
            .violations
            .increment(1);
        attempt::book_violation(&self.snapshot.health, target, permit);
        self.violation = Some(violation);
    }

    /// Records a classified failure and says what comes next.
    fn failed(
        &mut self,
        target: &Arc<Target>,
        failed: Failed,
        tries: &mut Tries,
        admission: &mut Admission<'_>,
        span: &tracing::Span,
    ) -> Next {
        let Failed {
            decision,
            outcome,
            status,
            answer,
            permit,
        } = failed;
        attempt::record(
            &self.snapshot.health,
            target,
            &decision,
            outcome,
            permit,
            tries.key,
        );
        let now = Instant::now();
        self.held_back_by(status, &decision, now);
        self.credit_answer = answer
            .as_ref()
            .filter(|_| decision.out_of_credit)
            .map(|a| KeptAnswer::of(a, target, self.tally.attempts));
        if let (Some(kept), Scope::Provider, Some(cooldown)) =
            (&self.credit_answer, decision.scope, decision.cooldown)
        {
            let health = &target.provider.health;
            health.out_of_credit(now + cooldown, kept.status.as_u16(), kept.body.clone());
        }
        // What really happens next: the provider's next key after a
        // key-scoped failure (if one can serve); else a retry only if the
        // pause fits the deadline and the target will take it.
        let pause = tries.pause_after(&decision, &target.provider.retry);
        let step_with =
            |keyed| attempt::next_step(&decision, keyed, pause, target, now, self.deadline);
        let mut step = step_with(tries.key.is_some());
        let mut switch = None;
        if step == Step::NextKey {
            switch = admission.next_key(target, tries.keys);
            if switch.is_none() {
                step = step_with(false);
            }
        }
        let next = match step {
            Step::NextKey => "next_key",
            Step::Return => "return",
            Step::Retry(_) => "retry",
            Step::Failover => "failover",
        };
        info!(target = %target.name, attempt = self.tally.attempts, outcome = outcome.label(),
            rule = %decision.rule, next, "upstream attempt failed");
        let failure = AttemptFailure {
            outcome: outcome.label(),
            status,
            rule: &decision.rule,
            action: next,
        };
        telemetry::attempt_failed(span, &failure);
        if let Some(key) = switch {
            tries.switch_key(key);
            return Next::Retry;
        }
        if decision.context_window {
            self.context_error(target, answer.as_ref(), admission);
        }
        match step {
            Step::Return => Next::Return(self.returned(target, answer, decision.advertised)),
            Step::Retry(pause) => {
                tries.take(&decision, pause);
                Next::Retry
            }
            Step::Failover | Step::NextKey => Next::Failover,
        }
    }

    /// Step 6: nothing was served; switchyard's own answer says why.
    fn give_up(&mut self, admission: &mut Admission<'_>) -> Response<Body> {
        let held = admission.holdbacks();
        let now = Instant::now();
        let limited = self.holdbacks.limited.into_iter().chain(held.limited).min();
        if let Some(resource) = self.local_failure {
            return self.error(&GatewayError::LocalResources(resource.to_string()));
        }
        if self.tally.attempts == 0 && !self.deadline_hit {
            if let Some((message, param)) = admission.take_unsupported() {
                let e = GatewayError::BadRequest {
                    message,
                    param: param.map(Into::into),
                };
                return self.error(&e);
            }
        }
        if !self.holdbacks.failed && !self.deadline_hit && self.violation.is_none() {
            // Nothing failed: only waits stood in the way. Rate limits alone
            // are a 429; anything else that could not be tried (revoked keys
            // included) is a 503.
            if let Some(resp) = self.out_of_credit(now) {
                return resp;
            }
            let wait = |until: Instant| until.saturating_duration_since(now);
            return match (limited, held.unavailable, held.revoked) {
                (Some(until), None, false) => self.error(&GatewayError::RateLimited(wait(until))),
                (limited, unavailable, _) => self.error(&GatewayError::NoTargetAvailable {
                    retry_after: limited.into_iter().chain(unavailable).min().map(wait),
                }),
            };
        }
        if let Some(v) = self.violation.take() {
            return self.error(&GatewayError::ContractViolation(v.to_string()));
        }
        if let Some(answer) = self.context_answer.take() {
            if answer.attempts == self.tally.attempts {
                // No larger context window got to try: the upstream's own
                // context-length error tells the caller what to change.
                let resp = respond::context_error(
                    self.snapshot,
                    answer.status,
                    &answer.body,
                    &answer.target,
                );
                return self.serve(resp, &answer.target);
            }
        }
        if let Some(answer) = self.credit_answer.take() {
            if answer.attempts == self.tally.attempts {
                // The provider says its account is out of credit: that, not
                // a rate limit to wait out, is why nothing answered.
                let mut resp = respond::upstream_error(
                    self.snapshot,
                    answer.status,
                    &answer.body,
                    &answer.target,
                );
                resp.headers_mut()
                    .insert(respond::H_SHOULD_RETRY, HeaderValue::from_static("false"));
                return self.serve(resp, &answer.target);
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

    /// Every target of the chain is held back because its provider said its
    /// account is out of credit: the provider's own answer (kept from when it
    /// said so) tells the caller more than a wait would, and not to retry.
    fn out_of_credit(&self, now: Instant) -> Option<Response<Body>> {
        let mut answers = self.task.chain.iter().map(|target| {
            let kept = target.provider.health.credit_answer(now)?;
            Some((target, kept))
        });
        let (target, (status, body)) = answers.next()??;
        if !answers.all(|kept| kept.is_some()) {
            return None;
        }
        let status = StatusCode::from_u16(status).ok()?;
        let mut resp = respond::upstream_error(self.snapshot, status, &body, target);
        let headers = resp.headers_mut();
        headers.insert(respond::H_SHOULD_RETRY, HeaderValue::from_static("false"));
        self.tally.write(headers, self.request_id);
        warn!(task = %self.task.name, target = %target.name, status = status.as_u16(),
            "no target tried: every provider of the chain is out of credit");
        self.account.trace.error("out_of_credit");
        Some(resp)
    }

    fn error(&self, e: &GatewayError) -> Response<Body> {
        warn!(task = %self.task.name, attempts = self.tally.attempts, code = e.code(), "{e}");
        self.account.trace.error(e.code());
        respond::gateway_error(self.snapshot, e, self.tally, self.request_id)
    }
}

/// An upstream error that tells the caller more than switchyard's own would,
/// and the attempt count when it came: a context-length error (the answer
/// if no larger window got to try), or an account out of credit (the answer
/// if it was the last failure).
struct KeptAnswer {
    status: StatusCode,
    body: Bytes,
    target: Arc<Target>,
    attempts: u32,
}

impl KeptAnswer {
    fn of((status, body): &(StatusCode, Bytes), target: &Arc<Target>, attempts: u32) -> Self {
        Self {
            status: *status,
            body: body.clone(),
            target: Arc::clone(target),
            attempts,
        }
    }
}

/// One side of a hedged race: its target, key and attempt span.
#[derive(Clone, Copy)]
struct Racer<'s> {
    target: &'s Arc<Target>,
    key: Option<usize>,
    span: &'s tracing::Span,
}

/// How a hedging task's first attempt went.
enum Hedged {
    /// No hedge ran: the primary's own outcome, handled as usual.
    Alone(Attempt),
    /// A hedge ran and this target answered first.
    Won {
        target: Arc<Target>,
        attempt: Attempt,
        span: tracing::Span,
    },
    /// A hedge ran and one side's error is the caller's to hear (a 400).
    Returned(Response<Body>),
    /// A hedge ran and both sides failed (both recorded); the last one's reason.
    BothFailed { reason: &'static str },
}

/// What follows a failed attempt.
enum Next {
    /// The same target again, after [`Tries::pause`].
    Retry,
    Failover,
    Return(Response<Body>),
}

/// The same-target retries of one target: `retry.max` counted ones with
/// backoff, plus one waited-out 429 (`wait_retry_after`), plus one per other
/// key of the provider after key-scoped failures.
#[derive(Debug, Default)]
struct Tries {
    /// The key the next attempt goes with.
    key: Option<usize>,
    /// Every key tried on this target.
    keys: KeySet,
    /// Counted retries taken.
    counted: u32,
    /// The one waited retry was taken.
    waited: bool,
    /// The pause before the next attempt.
    pause: Option<Duration>,
}

impl Tries {
    fn on_key(key: Option<usize>) -> Self {
        let mut keys = KeySet::default();
        if let Some(k) = key {
            keys.insert(k);
        }
        Self {
            key,
            keys,
            ..Self::default()
        }
    }

    /// The next attempt goes with `key`, at once.
    fn switch_key(&mut self, key: usize) {
        self.keys.insert(key);
        self.key = Some(key);
        self.pause = Some(Duration::ZERO);
    }

    /// The pause a retry after `decision` would take, if one is allowed.
    fn pause_after(
        &self,
        decision: &Decision,
        policy: &crate::snapshot::RetryPolicy,
    ) -> Option<Duration> {
        match (decision.wait, decision.action) {
            (_, Action::Return) => None,
            (Some(wait), Action::Retry | Action::Failover) if !self.waited => Some(wait),
            (Some(_) | None, Action::Retry) if self.counted < policy.max => {
                Some(full_jitter(policy.backoff, self.counted + 1))
            }
            (Some(_) | None, Action::Retry | Action::Failover) => None,
        }
    }

    /// Takes the retry `pause_after` offered.
    fn take(&mut self, decision: &Decision, pause: Duration) {
        if decision.wait.is_some() && !self.waited {
            self.waited = true;
        } else {
            self.counted += 1;
        }
        self.pause = Some(pause);
    }
}

/// A retry of `target` after `pause`: a call too, so it must pass the
/// breaker and fit the buckets it is charged to.
async fn retry_permit(
    pause: Duration,
    target: &Arc<Target>,
    key: Option<usize>,
    admission: &mut Admission<'_>,
) -> Option<crate::health::Permit> {
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
    admission
        .readmit(target)
        .filter(|_| admission.recheck(target, key))
}

/// Exponential backoff with full jitter: uniform in `[0, base * 2^(n-1)]`, capped.
fn full_jitter(base: Duration, retry: u32) -> Duration {
    let exp = base
        .saturating_mul(1u32 << (retry - 1).min(16))
        .min(BACKOFF_CAP);
    exp.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_jitter_is_bounded() {
        for n in 1..20 {
            assert!(full_jitter(Duration::from_millis(100), n) <= BACKOFF_CAP);
        }
        assert!(full_jitter(Duration::from_millis(100), 1) <= Duration::from_millis(100));
    }
}
