//! Finishing an answer whose stream broke after its commit point, on the next
//! admitted target of the chain (`stream_recovery: { mode: continue }`).
//!
//! Two ways, chosen per target:
//! - **prefill**: a target with the `prefill` capability gets the original
//!   messages plus one trailing assistant message holding exactly the text
//!   already delivered (and its provider's `prefill` fields), and what it
//!   generates is relayed;
//! - **restart and verify**: any other target gets the original request,
//!   encoded for it as a first attempt would be (its model, protocol); its
//!   output is held until it has produced at least the delivered text; if it
//!   begins with exactly that text (whitespace at the seam aside) the
//!   prefix is dropped and the rest relayed, else the stream ends with the
//!   interruption event: the client never sees text that contradicts what it
//!   already has. A target that rejects a prefill (4xx) is restarted instead.
//!
//! The client sees one stream ([`Splice`]): the committed `id` and `created`
//! on every chunk, no second role chunk, one finish chunk, one `[DONE]`. No
//! continuation of a stream with more than one choice, nor once a tool call,
//! refusal or reasoning delta went out, nor while the answer's tool calls are
//! under validation.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::StatusCode;
use opentelemetry::KeyValue;
use serde_json::{Map, Value};
use tokio::time::Instant;
use tracing::{debug, info, Instrument};

use super::account::Account;
use super::attempt::{self, Attempt, Call, Commit, Failed};
use crate::classify::{AttemptOutcome, Interruption};
use crate::health::Permit;
use crate::metrics as m;
use crate::request::{ChatRequest, Prompt};
use crate::routing::{self, Admission, Needs, Payload};
use crate::snapshot::{KeySet, Snapshot, Target, Task};
use crate::sse::{self, Event};
use crate::telemetry::{self, AttemptFailure, RequestTrace};
use crate::upstream::{Operation, TargetModel};

/// How a continuation asks its target to go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// An assistant prefix the target continues.
    Prefill,
    /// The original request, its output verified against what was delivered.
    Restart,
}

impl Mode {
    /// The `mode` label.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Mode::Prefill => "prefill",
            Mode::Restart => "restart",
        }
    }
}

/// The committed stream's `id` and `created`, kept on every chunk after a seam.
#[derive(Debug, Clone, PartialEq)]
struct Envelope {
    id: Value,
    created: Value,
}

/// What one stream needs to be continued: owned, since the relay outlives
/// the request handler.
#[derive(Debug)]
pub struct Recovery {
    snapshot: Arc<Snapshot>,
    task: Arc<Task>,
    origin: Origin,
    /// Targets this stream was served or tried on: never continued on.
    tried: Vec<Arc<Target>>,
    /// The text delivered so far.
    transcript: String,
    /// Only text went out so far.
    continuable: bool,
    envelope: Option<Envelope>,
    used: u32,
    resends: AtomicU32,
}

/// The request a stream belongs to, as a continuation needs it.
#[derive(Debug)]
pub struct Origin {
    /// The client's request, as it sent it.
    pub body: Bytes,
    /// Sent upstream as `x-request-id`.
    pub request_id: HeaderValue,
    /// The client's headers a protocol forwards ([`crate::upstream::forwardable`]).
    pub client_headers: HeaderMap,
    /// When the request arrived.
    pub arrival: Instant,
    /// `total_timeout` from arrival.
    pub deadline: Instant,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The request's telemetry record.
    pub trace: RequestTrace,
    /// The request's first choice (what is not is fallback spend).
    pub first_choice: Option<Arc<Target>>,
    /// The request's tool call contract, when its task validates degraded
    /// answers: a continuing target's answer is one, held to it like any.
    pub contract: Option<Arc<crate::schema::Contract>>,
    /// Switches to another target the task's `max_failovers` still allows
    /// (each continuation is one).
    pub failovers_left: u32,
}

/// A continuation that committed: its stream, and how to rewrite it.
#[derive(Debug)]
pub struct Resumed {
    /// The new upstream, past its commit point.
    pub commit: Commit,
    /// Rewrites its events into the client's stream.
    pub splice: Splice,
    /// The seam, for the metric and the log.
    pub seam: Seam,
    /// The span of the attempt that took over, which the relay runs in from
    /// now on (disabled with tracing off).
    pub span: tracing::Span,
}

/// One seam: where a stream was continued.
#[derive(Debug, Clone)]
pub struct Seam {
    /// The target that broke.
    pub from: Arc<Target>,
    /// The target that continues.
    pub to: Arc<Target>,
    /// How.
    pub mode: Mode,
}

impl Recovery {
    /// The continuation context of a stream served by `served`, when its task
    /// continues broken streams.
    #[must_use]
    pub fn new(
        snapshot: Arc<Snapshot>,
        task: Arc<Task>,
        origin: Origin,
        tried: Vec<Arc<Target>>,
    ) -> Option<Self> {
        // One transcript cannot stand for several choices: a stream of
        // `n > 1` breaks as with `mode: off`.
        let continues = task.stream_recovery.continues && !several_choices(&origin.body);
        continues.then(|| Self {
            snapshot,
            task,
            origin,
            tried,
            transcript: String::new(),
            continuable: true,
            envelope: None,
            used: 0,
            resends: AtomicU32::new(0),
        })
    }

    /// Notes an event that went out to the client.
    pub fn observe(&mut self, data: &str) {
        if self.envelope.is_none() {
            if let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(data) {
                if let (Some(id), Some(created)) = (chunk.get("id"), chunk.get("created")) {
                    self.envelope = Some(Envelope {
                        id: id.clone(),
                        created: created.clone(),
                    });
                }
            }
        }
        if self.continuable && beyond_first_choice(data) {
            // The upstream sent another choice than asked for: nothing to
            // continue one transcript with.
            self.continuable = false;
        }
        match sse::delivered(data) {
            Some(d) if d.plain => self.transcript.push_str(&d.text),
            Some(_) => self.continuable = false,
            None => {}
        }
    }

    /// Whether a stream broken for `why` may be continued now.
    #[must_use]
    pub fn can_continue(&self, why: Interruption, under_validation: bool) -> bool {
        let recoverable = match why {
            Interruption::Reset
            | Interruption::Truncated
            | Interruption::IdleTimeout
            | Interruption::UpstreamError
            | Interruption::EventTooLarge => true,
            Interruption::Deadline | Interruption::ContractViolation | Interruption::Diverged => {
                false
            }
        };
        recoverable
            && self.continuable
            && !under_validation
            && !self.transcript.is_empty()
            && self.used < self.task.stream_recovery.max_continuations
            && self.used < self.origin.failovers_left
            && Instant::now() < self.origin.deadline
    }

    /// How many characters of text went out.
    #[must_use]
    pub fn delivered_chars(&self) -> usize {
        self.transcript.chars().count()
    }

    /// Whether seams are marked with an SSE comment.
    #[must_use]
    pub fn seam_comment(&self) -> bool {
        self.task.stream_recovery.seam_comment
    }

    /// Counts a seam's result in `switchyard_stream_continuations_total`.
    pub fn count(&self, seam: &Seam, result: &'static str) {
        self.snapshot
            .metrics
            .counter(
                m::STREAM_CONTINUATIONS,
                &[
                    ("task", self.task.name.clone().into()),
                    ("from", seam.from.name.clone().into()),
                    ("to", seam.to.name.clone().into()),
                    ("mode", seam.mode.label().into()),
                    ("result", result.into()),
                ],
            )
            .increment(1);
    }

    /// Counts a continuation that found no target to take over.
    pub fn count_failed(&self, from: &Target) {
        self.snapshot
            .metrics
            .counter(
                m::STREAM_CONTINUATIONS,
                &[
                    ("task", self.task.name.clone().into()),
                    ("from", from.name.clone().into()),
                    ("to", "none".into()),
                    ("mode", "none".into()),
                    ("result", "failed".into()),
                ],
            )
            .increment(1);
    }

    /// Finds the next admitted target and gets it past its commit point.
    ///
    /// # Errors
    /// No target could take over (none left, each failed, the deadline).
    pub async fn resume(&mut self, broken: &Arc<Target>) -> Result<Resumed, ()> {
        self.used += 1;
        let body = self.origin.body.clone();
        let request = Prompt::chat(ChatRequest::parse(&body).map_err(|_| ())?, &body);
        let needs = Needs::of(&request.facts);
        let task = Arc::clone(&self.task);
        let snapshot = Arc::clone(&self.snapshot);
        let mut plan = routing::plan(&task, &needs, Instant::now());
        // Exclusions were counted when the request was planned; tried targets are out.
        plan.excluded.clear();
        plan.candidates
            .retain(|t| !self.tried.iter().any(|u| Arc::ptr_eq(t, u)));
        let mut admission = Admission::new(&snapshot, &task, plan, &needs, Payload::Chat(&request));
        let account = Account {
            task: Arc::clone(&task),
            prompt_estimate: needs.prompt_tokens,
            max_tokens: needs.max_tokens,
            trace: self.origin.trace.clone(),
            first_choice: self.origin.first_choice.clone(),
        };
        while let Some(admitted) = admission.next(false) {
            let target = Arc::clone(&admitted.target);
            self.tried.push(Arc::clone(&target));
            let turn = Turn {
                mode: if target.can_prefill() {
                    Mode::Prefill
                } else {
                    Mode::Restart
                },
                key: admitted.key,
                keys: KeySet::default(),
                restart: admitted.body,
            };
            let on = On {
                snapshot: &snapshot,
                task: &task,
                account: &account,
                target: &target,
            };
            match self
                .take_over(&on, turn, admitted.permit, &mut admission)
                .await
            {
                TakeOver::Committed(commit, mode, span) => {
                    let seam = Seam {
                        from: Arc::clone(broken),
                        to: target,
                        mode,
                    };
                    self.origin.trace.span().in_scope(|| {
                        let delivered = i64::try_from(self.delivered_chars()).unwrap_or(i64::MAX);
                        telemetry::event(
                            "continuation",
                            vec![
                                KeyValue::new("switchyard.from", seam.from.name.clone()),
                                KeyValue::new("switchyard.to", seam.to.name.clone()),
                                KeyValue::new("switchyard.mode", mode.label()),
                                KeyValue::new("switchyard.delivered_chars", delivered),
                            ],
                        );
                    });
                    let splice = self.splice(mode, &seam.from, &seam.to);
                    return Ok(Resumed {
                        commit: *commit,
                        splice,
                        seam,
                        span,
                    });
                }
                TakeOver::Failed => {}
                TakeOver::Deadline => return Err(()),
            }
        }
        Err(())
    }

    /// One target's turn: its attempts (another key, a restart after a
    /// rejected prefill) until one commits or it has none left. Each attempt
    /// is an upstream call on the request's record and has its own span.
    async fn take_over(
        &self,
        on: &On<'_>,
        mut turn: Turn,
        permit: Permit,
        admission: &mut Admission<'_>,
    ) -> TakeOver {
        let target = on.target;
        let mut permit = Some(permit);
        while let Some(p) = permit.take() {
            if let Some(k) = turn.key {
                turn.keys.insert(k);
            }
            let sent = match turn.mode {
                Mode::Prefill => self.prefill_body(target),
                Mode::Restart => None,
            };
            let (sent, prefilled) = match sent {
                Some(b) => (b, true),
                // The request as admission encoded it for this target, like a
                // first attempt: its model, its protocol, its provider's fields.
                None => (turn.restart.clone(), false),
            };
            turn.mode = if prefilled {
                Mode::Prefill
            } else {
                Mode::Restart
            };
            let span = self.attempt_span(target);
            let call = self.call(on.snapshot, on.task, target, on.account, turn.key);
            let outcome = attempt::run(&call, sent, p).instrument(span.clone()).await;
            let trace = &self.origin.trace;
            trace.more_attempts(self.resends.swap(0, Ordering::Relaxed));
            match outcome {
                Attempt::Committed(commit) => {
                    telemetry::attempt_served(&span, StatusCode::OK.as_u16());
                    return TakeOver::Committed(commit, turn.mode, span);
                }
                Attempt::Failed(failed) => {
                    let (outcome, status) = (failed.outcome.label(), failed.status);
                    let rule = Arc::clone(&failed.decision.rule);
                    permit = turn.after_failure(
                        on.snapshot,
                        target,
                        failed,
                        prefilled,
                        admission,
                        self.origin.deadline,
                    );
                    let action = if permit.is_some() {
                        "retry"
                    } else {
                        "failover"
                    };
                    let failure = AttemptFailure {
                        outcome,
                        status,
                        rule: &rule,
                        action,
                    };
                    telemetry::attempt_failed(&span, &failure);
                }
                Attempt::Answer { .. } => {
                    // A whole body to a streaming request cannot be spliced
                    // in (attempt::run books it as a protocol failure first).
                    let invalid = AttemptOutcome::InvalidAnswer.label();
                    telemetry::attempt_abandoned(&span, invalid, "failover");
                }
                Attempt::Deadline => {
                    telemetry::attempt_abandoned(&span, "deadline", "return");
                    return TakeOver::Deadline;
                }
                Attempt::Local(resource) => {
                    // switchyard's own shortage: no target's failure, and no other would fare better.
                    tracing::warn!(target = %target.name, error = %resource, "continuation not sent: switchyard is out of a local resource");
                    telemetry::attempt_abandoned(&span, "local_resources", "return");
                    return TakeOver::Deadline;
                }
                Attempt::Violated(v) => {
                    tracing::warn!(target = %target.name, violation = %v.violation, "continuation breaks the tool call contract");
                    attempt::book_violation(&on.snapshot.health, target, v.permit);
                    telemetry::attempt_abandoned(&span, "contract_violation", "failover");
                }
            }
        }
        TakeOver::Failed
    }

    /// The span of one continuation attempt: a child of the request's span
    /// (not of the broken attempt's, which the relay runs in), numbered on
    /// from the request's attempts.
    fn attempt_span(&self, target: &Target) -> tracing::Span {
        let trace = &self.origin.trace;
        let number = trace.more_attempts(1);
        trace
            .span()
            .in_scope(|| trace.attempt(&attempt::span_info(target, number, Operation::Chat)))
    }

    fn call<'c>(
        &'c self,
        snapshot: &'c Snapshot,
        task: &'c Arc<Task>,
        target: &'c Arc<Target>,
        account: &'c Account,
        key: Option<usize>,
    ) -> Call<'c> {
        Call {
            key,
            op: Operation::Chat,
            base64: false,
            // The client's headers went out long ago: nothing to add a resend to.
            resends: &self.resends,
            snapshot,
            task,
            target,
            stream: true,
            include_usage: self.origin.include_usage,
            // Only a one-choice stream is continued.
            choices: 1,
            request_id: &self.origin.request_id,
            client_headers: &self.origin.client_headers,
            arrival: self.origin.arrival,
            deadline: self.origin.deadline,
            contract: self.origin.contract.clone(),
            account,
            // A continuation's body is switchyard's own (the prefill).
            native: false,
            cached: false,
        }
    }

    /// The original request plus one trailing assistant message holding the
    /// delivered text (and the provider's prefill fields), in `target`'s protocol.
    fn prefill_body(&self, target: &Target) -> Option<Bytes> {
        let Ok(Value::Object(mut request)) = serde_json::from_slice::<Value>(&self.origin.body)
        else {
            return None;
        };
        let prefill = &target.provider.prefill;
        // Without trailing whitespace, which Anthropic refuses in a final
        // assistant message (the splice drops the whitespace the target then
        // begins with: the client has it already).
        let delivered = self.transcript.trim_end();
        if delivered.is_empty() {
            return None;
        }
        let mut message = Map::new();
        message.insert("role".into(), Value::from("assistant"));
        message.insert("content".into(), Value::from(delivered));
        message.extend(prefill.message_fields.clone());
        match request.get_mut("messages") {
            Some(Value::Array(messages)) => messages.push(Value::Object(message)),
            _ => return None,
        }
        // The client's output limit covers the whole answer: the target
        // writes only what is left of it (the estimate over-counts, so the
        // answer stays within the limit).
        let spent = crate::tokens::estimate_text(delivered);
        for limit in ["max_tokens", "max_completion_tokens"] {
            if let Some(left) = request.get(limit).and_then(Value::as_u64) {
                request.insert(limit.into(), Value::from(left.saturating_sub(spent).max(1)));
            }
        }
        request.extend(prefill.body_fields.clone());
        let bytes = serde_json::to_vec(&request).ok()?;
        let view = ChatRequest::parse(&bytes).ok()?;
        request_body_for(&view, target)
    }

    fn splice(&self, mode: Mode, from: &Target, to: &Target) -> Splice {
        info!(task = %self.task.name, from = %from.name, to = %to.name, mode = mode.label(),
            delivered_chars = self.delivered_chars(), "continuing the stream on the next target");
        let trimmed = self.transcript.len() != self.transcript.trim_end().len();
        Splice {
            envelope: self.envelope.clone(),
            verify: (mode == Mode::Restart).then(|| Verify {
                delivered: self.transcript.clone(),
                produced: String::new(),
            }),
            skip_space: mode == Mode::Prefill && trimmed,
        }
    }
}

/// Whether the request asks for more than one choice (`n > 1`).
fn several_choices(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Wire {
        n: Option<serde_json::Number>,
    }
    serde_json::from_slice::<Wire>(body)
        .ok()
        .and_then(|w| w.n)
        .is_some_and(|n| n.as_u64() != Some(1))
}

/// Whether a chunk carries a choice other than the first (`index` > 0).
fn beyond_first_choice(data: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Chunk {
        #[serde(default)]
        choices: Vec<Choice>,
    }
    #[derive(serde::Deserialize)]
    struct Choice {
        #[serde(default)]
        index: Option<serde_json::Number>,
    }
    serde_json::from_str::<Chunk>(data.trim()).is_ok_and(|c| {
        c.choices
            .iter()
            .any(|choice| choice.index.as_ref().is_some_and(|i| i.as_u64() != Some(0)))
    })
}

/// `request` encoded for `target`'s protocol.
fn request_body_for(request: &ChatRequest<'_>, target: &Target) -> Option<Bytes> {
    let model = TargetModel {
        model: &target.model,
        max_output: target.max_output,
    };
    target.provider.endpoint.adapter.encode(request, model).ok()
}

/// What the splice makes of one event of the continuing upstream.
#[derive(Debug, PartialEq, Eq)]
pub enum Spliced {
    /// Nothing goes out (a second role chunk, the hidden prefix).
    Drop,
    /// The event's own bytes go out.
    Raw,
    /// This `data:` goes out instead.
    Data(String),
    /// The restarted answer contradicts what was delivered.
    Diverged,
}

/// The restart-and-verify state: the delivered text to find again.
#[derive(Debug)]
struct Verify {
    delivered: String,
    produced: String,
}

/// Rewrites the continuing upstream's events into the client's stream.
#[derive(Debug)]
pub struct Splice {
    envelope: Option<Envelope>,
    /// Restart mode, until the delivered text is found again.
    verify: Option<Verify>,
    /// Prefill mode after a prefill sent without the delivered text's
    /// trailing whitespace: the whitespace the target begins with is dropped.
    skip_space: bool,
}

impl Splice {
    /// One event of the continuing upstream.
    pub fn event(&mut self, event: &Event) -> Spliced {
        let Some(data) = event.data.as_deref() else {
            return Spliced::Raw;
        };
        if data.trim() == "[DONE]" {
            return if self.verify.is_some() {
                Spliced::Diverged
            } else {
                Spliced::Raw
            };
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(data) else {
            return Spliced::Raw;
        };
        if chunk.contains_key("error") {
            return Spliced::Raw;
        }
        let finished = chunk_finished(&chunk);
        if self.verify.is_some() {
            match self.verify_text(&mut chunk, finished) {
                Some(Spliced::Data(_)) | None => {}
                Some(other) => return other,
            }
        }
        if self.skip_space {
            let text = chunk_text(&chunk);
            let rest = text.trim_start();
            if !rest.is_empty() {
                self.skip_space = false;
            }
            if rest.len() != text.len() {
                let rest = rest.to_owned();
                set_chunk_text(&mut chunk, &rest);
                if rest.is_empty() && !finished {
                    return Spliced::Drop;
                }
            }
        }
        if only_role(&chunk) {
            return Spliced::Drop;
        }
        if let Some(envelope) = &self.envelope {
            chunk.insert("id".into(), envelope.id.clone());
            chunk.insert("created".into(), envelope.created.clone());
        }
        Spliced::Data(Value::Object(chunk).to_string())
    }

    /// Restart mode: holds content until the delivered text is found, then
    /// lets the rest of that chunk through. `None` once verified.
    fn verify_text(&mut self, chunk: &mut Map<String, Value>, finished: bool) -> Option<Spliced> {
        let verify = self.verify.as_mut()?;
        let text = chunk_text(chunk);
        verify.produced.push_str(&text);
        match seam_match(&verify.delivered, &verify.produced) {
            SeamMatch::Diverged => Some(Spliced::Diverged),
            SeamMatch::Short if finished => {
                if verify.produced.trim_end() != verify.delivered.trim_end() {
                    return Some(Spliced::Diverged);
                }
                // The restart's whole answer is what the client has: it is
                // complete, and only its finish goes out.
                self.verify = None;
                set_chunk_text(chunk, "");
                None
            }
            SeamMatch::Short => Some(Spliced::Drop),
            SeamMatch::Found(at) => {
                let rest = verify.produced[at..].to_owned();
                self.verify = None;
                set_chunk_text(chunk, &rest);
                if rest.is_empty() && !finished {
                    Some(Spliced::Drop)
                } else {
                    None
                }
            }
        }
    }
}

/// Where the delivered text stands in the produced one.
#[derive(Debug, PartialEq, Eq)]
enum SeamMatch {
    /// Not enough produced yet.
    Short,
    /// The produced text contradicts the delivered one.
    Diverged,
    /// The delivered text ends at this byte of the produced one.
    Found(usize),
}

/// Whether `produced` begins with `delivered`, exactly up to the seam: only
/// whitespace *at* the seam (tokenizers split spaces differently there) may
/// differ; any other difference, whitespace inside the delivered text
/// included, contradicts what the client has.
fn seam_match(delivered: &str, produced: &str) -> SeamMatch {
    let core = delivered.trim_end();
    let Some(after) = produced.strip_prefix(core) else {
        return if core.starts_with(produced) {
            SeamMatch::Short
        } else {
            SeamMatch::Diverged
        };
    };
    if core.len() == delivered.len() {
        return SeamMatch::Found(core.len());
    }
    // The client already has whitespace at the seam: the restart's own
    // whitespace there is not sent too, and where it ends is known only
    // once something else follows.
    let rest = after.trim_start();
    if rest.is_empty() {
        return SeamMatch::Short;
    }
    SeamMatch::Found(produced.len() - rest.len())
}

fn chunk_finished(chunk: &Map<String, Value>) -> bool {
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|cs| cs.iter().any(|c| !c["finish_reason"].is_null()))
}

fn chunk_text(chunk: &Map<String, Value>) -> String {
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect()
}

fn set_chunk_text(chunk: &mut Map<String, Value>, text: &str) {
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for (i, choice) in choices.iter_mut().enumerate() {
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                if delta.contains_key("content") {
                    delta.insert(
                        "content".into(),
                        Value::from(if i == 0 { text } else { "" }),
                    );
                }
            }
        }
    }
}

/// A chunk that only opens the assistant turn again.
fn only_role(chunk: &Map<String, Value>) -> bool {
    let Some(Value::Array(choices)) = chunk.get("choices") else {
        return false;
    };
    !choices.is_empty()
        && choices.iter().all(|c| {
            c["finish_reason"].is_null()
                && c["delta"].as_object().is_some_and(|d| {
                    d.iter().all(|(k, v)| match k.as_str() {
                        "role" => true,
                        "content" => v.as_str().is_none_or(str::is_empty),
                        _ => v.is_null(),
                    })
                })
        })
}

/// What a continuation attempt runs against.
struct On<'a> {
    snapshot: &'a Snapshot,
    task: &'a Arc<Task>,
    account: &'a Account,
    target: &'a Arc<Target>,
}

/// How a target's turn ended.
enum TakeOver {
    /// Past its commit point, in `mode`, its attempt's span.
    Committed(Box<Commit>, Mode, tracing::Span),
    /// Its attempts failed; the next target may try.
    Failed,
    /// The request's deadline passed.
    Deadline,
}

/// One target's turn at taking over a broken stream.
struct Turn {
    mode: Mode,
    /// The key the next attempt goes with.
    key: Option<usize>,
    /// The keys tried on this target.
    keys: KeySet,
    /// The original request encoded for this target (what a restart sends).
    restart: Bytes,
}

impl Turn {
    /// Records a failed attempt and says whether the target gets another:
    /// with the provider's next key after a key-scoped failure (the walk's
    /// own decision, [`attempt::next_step`]: never on `return`, never past
    /// the `deadline`), or as a restart after a rejected prefill (before the
    /// deadline). A context-length error raises the admission's floor, as in
    /// the walk; each call again must fit the buckets it is charged to.
    fn after_failure(
        &mut self,
        snapshot: &Snapshot,
        target: &Arc<Target>,
        failed: Failed,
        prefilled: bool,
        admission: &mut Admission<'_>,
        deadline: Instant,
    ) -> Option<Permit> {
        let rejected = prefilled && failed.status.is_some_and(|s| (400..500).contains(&s));
        let now = Instant::now();
        let step = attempt::next_step(
            &failed.decision,
            self.key.is_some(),
            None,
            target,
            now,
            deadline,
        );
        if failed.decision.context_window {
            admission.raise_context_floor(target);
        }
        attempt::record(
            &snapshot.health,
            target,
            &failed.decision,
            failed.outcome,
            failed.permit,
            self.key,
        );
        if step == attempt::Step::NextKey {
            // Another key of the same provider first.
            self.key = admission.next_key(target, self.keys);
            let key = self.key?;
            return admission
                .readmit(target)
                .filter(|_| admission.recheck(target, Some(key)));
        }
        if rejected && now < deadline {
            // Unable to prefill after all: restart and verify on it instead.
            debug!(target = %target.name, "prefill rejected; restarting and verifying");
            self.mode = Mode::Restart;
            return admission
                .readmit(target)
                .filter(|_| admission.recheck(target, self.key));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> Event {
        Event {
            raw: Bytes::from(format!("data: {data}\n\n")),
            data: Some(data.to_owned()),
            malformed: false,
            reading: None,
            upstream: crate::sse::Upstream::Chat,
        }
    }

    fn chunk(id: &str, delta: Value, finish: Option<&str>) -> String {
        serde_json::json!({"id": id, "object": "chat.completion.chunk", "created": 9, "model": "fallback",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        .to_string()
    }

    fn envelope() -> Option<Envelope> {
        Some(Envelope {
            id: Value::from("first"),
            created: Value::from(1),
        })
    }

    #[test]
    fn the_seam_is_found_whitespace_at_the_seam_aside() {
        assert_eq!(seam_match("Hello wor", "Hello world"), SeamMatch::Found(9));
        assert_eq!(seam_match("Hello ", "Hello world"), SeamMatch::Found(6));
        assert_eq!(seam_match("Hello ", "Hello   world"), SeamMatch::Found(8));
        assert_eq!(seam_match("Hello\n", "Helloworld"), SeamMatch::Found(5));
        assert_eq!(seam_match("Hello", "Hello world"), SeamMatch::Found(5));
        assert_eq!(seam_match("Hello ", "Hello "), SeamMatch::Short);
        assert_eq!(seam_match("Hello world", "Hello"), SeamMatch::Short);
        assert_eq!(seam_match("Hello world", "Help"), SeamMatch::Diverged);
    }

    #[test]
    fn whitespace_inside_the_delivered_text_must_match() {
        assert_eq!(
            seam_match("Hello  world", "Hello world, again"),
            SeamMatch::Diverged
        );
        assert_eq!(
            seam_match("if x:\n        return", "if x:\n  return None"),
            SeamMatch::Diverged
        );
        assert_eq!(
            seam_match("I have 1 0", "I have 10 apples"),
            SeamMatch::Diverged
        );
        assert_eq!(seam_match("I have 1 0", "I have 1"), SeamMatch::Short);
        assert_eq!(seam_match("I have 1 0", "I have 10"), SeamMatch::Diverged);
    }

    #[test]
    fn a_restart_hides_the_delivered_prefix_and_keeps_one_envelope() {
        let mut s = Splice {
            envelope: envelope(),
            verify: Some(Verify {
                delivered: "The quick brown".into(),
                produced: String::new(),
            }),
            skip_space: false,
        };
        let role = chunk(
            "second",
            serde_json::json!({"role": "assistant", "content": ""}),
            None,
        );
        assert_eq!(s.event(&event(&role)), Spliced::Drop);
        let a = chunk("second", serde_json::json!({"content": "The quick"}), None);
        assert_eq!(s.event(&event(&a)), Spliced::Drop);
        let b = chunk("second", serde_json::json!({"content": " brown fox"}), None);
        let Spliced::Data(out) = s.event(&event(&b)) else {
            panic!("the rest of the chunk goes out")
        };
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], " fox");
        assert_eq!(
            (v["id"].as_str(), v["created"].as_u64()),
            (Some("first"), Some(1))
        );
        assert_eq!(v["model"], "fallback", "the model that finished the answer");
        let done = Event {
            raw: Bytes::from_static(b"data: [DONE]\n\n"),
            data: Some("[DONE]".into()),
            malformed: false,
            reading: None,
            upstream: crate::sse::Upstream::Chat,
        };
        assert_eq!(s.event(&done), Spliced::Raw);
    }

    #[test]
    fn a_restart_that_contradicts_or_stops_short_diverges() {
        let verify = || {
            Some(Verify {
                delivered: "The quick brown".into(),
                produced: String::new(),
            })
        };
        let mut s = Splice {
            envelope: envelope(),
            verify: verify(),
            skip_space: false,
        };
        let other = chunk("x", serde_json::json!({"content": "A slow"}), None);
        assert_eq!(s.event(&event(&other)), Spliced::Diverged);
        let mut s = Splice {
            envelope: envelope(),
            verify: verify(),
            skip_space: false,
        };
        let short = chunk(
            "x",
            serde_json::json!({"content": "The quick"}),
            Some("stop"),
        );
        assert_eq!(s.event(&event(&short)), Spliced::Diverged);
    }

    #[test]
    fn after_a_prefill_without_trailing_space_the_targets_leading_space_is_dropped() {
        let mut s = Splice {
            envelope: envelope(),
            verify: None,
            skip_space: true,
        };
        let space = chunk("second", serde_json::json!({"content": " "}), None);
        assert_eq!(s.event(&event(&space)), Spliced::Drop);
        let word = chunk("second", serde_json::json!({"content": " brown fox"}), None);
        let Spliced::Data(out) = s.event(&event(&word)) else {
            panic!()
        };
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], "brown fox");
        let next = chunk("second", serde_json::json!({"content": " jumps"}), None);
        let Spliced::Data(out) = s.event(&event(&next)) else {
            panic!()
        };
        assert!(
            out.contains(r#"" jumps""#),
            "only the seam's whitespace: {out}"
        );
    }

    #[test]
    fn a_prefill_continuation_passes_text_and_drops_the_second_role_chunk() {
        let mut s = Splice {
            envelope: envelope(),
            verify: None,
            skip_space: false,
        };
        let role = chunk("second", serde_json::json!({"role": "assistant"}), None);
        assert_eq!(s.event(&event(&role)), Spliced::Drop);
        let more = chunk("second", serde_json::json!({"content": " fox"}), None);
        let Spliced::Data(out) = s.event(&event(&more)) else {
            panic!()
        };
        assert!(out.contains(r#""id":"first""#), "{out}");
        let finish = chunk("second", serde_json::json!({}), Some("stop"));
        assert!(matches!(s.event(&event(&finish)), Spliced::Data(_)));
    }
}
