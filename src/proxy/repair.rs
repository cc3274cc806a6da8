//! The re-ask repair (`contract: { repair: [reask] }`): an answer that broke
//! the request's contract gets one more call to the same target, with the
//! request, the broken answer and the validation error, within the task's
//! deadline and buckets. Its answer is held to the contract again; only
//! then does the walk fail over.

use std::sync::Arc;

use bytes::Bytes;
use hyper::Response;
use serde_json::Value;
use tokio::time::Instant;
use tracing::Instrument;

use super::attempt::{self, Attempt};
use super::Walk;
use crate::body::Body;
use crate::request::ChatRequest;
use crate::routing::Admission;
use crate::schema::{Repair, Violation};
use crate::snapshot::Target;
use crate::telemetry;
use crate::upstream::{Operation, TargetModel};

/// An answer that broke the contract, as the re-ask quotes it.
struct Broken<'a> {
    /// The key it was sent with (the re-ask goes with it too).
    key: Option<usize>,
    /// What was wrong.
    violation: &'a Violation,
    /// What the answer said: its text and its calls.
    answered: &'a str,
}

impl Walk<'_> {
    /// An answer of `target` (sent with `key`) that broke the contract: the
    /// violation is booked, then the re-ask tried; its answer, if it served.
    pub(super) async fn violated_then_reask(
        &mut self,
        target: &Arc<Target>,
        key: Option<usize>,
        violated: (Violation, crate::health::Permit, String),
        admission: &mut Admission<'_>,
    ) -> Option<Response<Body>> {
        let (violation, permit, answered) = violated;
        let broken = Broken {
            key,
            violation: &violation,
            answered: &answered,
        };
        self.violated(target, violation.clone(), permit);
        self.reask(target, broken, admission).await
    }

    /// Re-asks `target` once, when the task says so and the deadline and the
    /// buckets allow; the answer if it keeps the contract.
    async fn reask(
        &mut self,
        target: &Arc<Target>,
        broken: Broken<'_>,
        admission: &mut Admission<'_>,
    ) -> Option<Response<Body>> {
        let wanted = self.task.repairs.contains(&Repair::Reask) && self.op == Operation::Chat;
        if !wanted || Instant::now() >= self.deadline {
            return None;
        }
        let body = reask_body(self.body, target, &broken)?;
        let permit = admission
            .readmit(target)
            .filter(|_| admission.recheck(target, broken.key))?;
        self.tally.attempts += 1;
        let span =
            self.account
                .trace
                .attempt(&attempt::span_info(target, self.tally.attempts, self.op));
        let call = self.call(target, broken.key);
        let outcome = attempt::run(&call, body, permit)
            .instrument(span.clone())
            .await;
        let outcome = match outcome {
            Attempt::Answer { status, body, .. } => Attempt::Answer {
                status,
                body,
                repaired: Some(Repair::Reask),
            },
            Attempt::Committed(mut commit) => {
                commit.repaired = Some(Repair::Reask);
                Attempt::Committed(commit)
            }
            failed @ (Attempt::Failed(_)
            | Attempt::Deadline
            | Attempt::Local(_)
            | Attempt::Violated { .. }) => {
                attempt::count_repair(self.task, target, Repair::Reask, false, broken.violation);
                self.reask_failed(target, failed, broken.key, &span);
                return None;
            }
        };
        attempt::count_repair(self.task, target, Repair::Reask, true, broken.violation);
        self.deliver(target, outcome, &span)
    }

    /// Books a re-ask that did not answer; the walk then fails over.
    fn reask_failed(
        &mut self,
        target: &Arc<Target>,
        outcome: Attempt,
        key: Option<usize>,
        span: &tracing::Span,
    ) {
        match outcome {
            Attempt::Failed(f) => {
                telemetry::attempt_abandoned(span, f.outcome.label(), "failover");
                let now = Instant::now();
                self.held_back_by(f.status, &f.decision, now);
                attempt::record(
                    &self.snapshot.health,
                    target,
                    &f.decision,
                    f.outcome,
                    f.permit,
                    key,
                );
            }
            Attempt::Violated { permit, .. } => {
                telemetry::attempt_abandoned(span, "contract_violation", "failover");
                attempt::book_violation(&self.snapshot.health, target, permit);
            }
            Attempt::Deadline => self.deadline_hit = true,
            Attempt::Local(resource) => self.local(resource, span),
            Attempt::Answer { .. } | Attempt::Committed(_) => {}
        }
    }
}

/// The client's request, then the broken answer and a message quoting what
/// was wrong with it, encoded for `target`'s protocol.
fn reask_body(client_body: &[u8], target: &Target, broken: &Broken<'_>) -> Option<Bytes> {
    let mut request: Value = serde_json::from_slice(client_body).ok()?;
    let messages = request.get_mut("messages")?.as_array_mut()?;
    let answered = if broken.answered.is_empty() {
        "(no answer)"
    } else {
        broken.answered
    };
    messages.push(serde_json::json!({"role": "assistant", "content": answered}));
    messages.push(serde_json::json!({
        "role": "user",
        "content": format!(
            "Your previous answer broke this request's tool contract: {}. \
             Answer again, with a tool call whose arguments are a JSON object that satisfies the tool's JSON Schema.",
            broken.violation
        ),
    }));
    let bytes = serde_json::to_vec(&request).ok()?;
    let parsed = ChatRequest::parse(&bytes).ok()?;
    let model = TargetModel {
        model: &target.model,
        max_output: target.max_output,
    };
    target.provider.endpoint.adapter.encode(&parsed, model).ok()
}
