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

use super::attempt::{self, Attempt, Call, Violated};
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
    /// violation is booked, then the re-ask and the conversion to a tool
    /// call tried, as the task says; the answer of the first that served.
    pub(super) async fn violated_then_reask(
        &mut self,
        target: &Arc<Target>,
        key: Option<usize>,
        violated: Violated,
        admission: &mut Admission<'_>,
    ) -> Option<Response<Body>> {
        let Violated {
            violation,
            permit,
            answered,
            completion,
        } = violated;
        let broken = Broken {
            key,
            violation: &violation,
            answered: &answered,
        };
        self.violated(target, violation.clone(), permit);
        if let Some(resp) = self.reask(target, &broken, admission).await {
            return Some(resp);
        }
        let completion = completion?;
        self.convert_to_tool(target, &broken, &completion, admission)
            .await
    }

    /// The call of a repair: switchyard's own chat request, encoded for the
    /// target's chat API whatever the client speaks (a provider's second
    /// API, Responses, is not where it goes), and its answer rendered from
    /// the repair, never passed on as the target sent it.
    fn repair_call<'c>(&'c self, target: &'c Arc<Target>, key: Option<usize>) -> Call<'c> {
        Call {
            native: false,
            ..self.call(target, key)
        }
    }

    /// Re-asks `target` once, when the task says so and the deadline and the
    /// buckets allow; the answer if it keeps the contract.
    async fn reask(
        &mut self,
        target: &Arc<Target>,
        broken: &Broken<'_>,
        admission: &mut Admission<'_>,
    ) -> Option<Response<Body>> {
        let wanted = self.task.repairs.contains(&Repair::Reask) && self.op == Operation::Chat;
        if !wanted || Instant::now() >= self.deadline {
            return None;
        }
        let body = reask_body(self.prompt?.bytes(), target, broken)?;
        let permit = admission
            .readmit(target)
            .filter(|_| admission.recheck(target, broken.key))?;
        self.tally.attempts += 1;
        let span =
            self.account
                .trace
                .attempt(&attempt::span_info(target, self.tally.attempts, self.op));
        let call = self.repair_call(target, broken.key);
        let outcome = attempt::run(&call, body, permit)
            .instrument(span.clone())
            .await;
        let outcome = match outcome {
            Attempt::Answer { status, body, .. } => Attempt::Answer {
                status,
                body,
                repaired: Some(Repair::Reask),
                native: None,
            },
            Attempt::Committed(mut commit) => {
                commit.repaired = Some(Repair::Reask);
                Attempt::Committed(commit)
            }
            failed @ (Attempt::Failed(_)
            | Attempt::Deadline
            | Attempt::Local(_)
            | Attempt::Violated(_)) => {
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
            Attempt::Violated(v) => {
                telemetry::attempt_abandoned(span, "contract_violation", "failover");
                attempt::book_violation(&self.snapshot.health, target, v.permit);
            }
            Attempt::Deadline => {
                // The deadline, not the broken answer, ended the request: 504.
                self.deadline_hit = true;
                self.violation = None;
            }
            Attempt::Local(resource) => self.local(resource, span),
            Attempt::Answer { .. } | Attempt::Committed(_) => {}
        }
    }
}

impl Walk<'_> {
    /// Turns `target`'s prose, where the request required a call, into that
    /// call: the task's `repair_target`s in order, each asked to produce
    /// exactly it from the answer. The answer stays `target`'s, its message
    /// now the call (a stream's held prose too: it goes out as a stream).
    async fn convert_to_tool(
        &mut self,
        target: &Arc<Target>,
        broken: &Broken<'_>,
        completion: &Bytes,
        admission: &mut Admission<'_>,
    ) -> Option<Response<Body>> {
        let contract = self.contract_for(target)?;
        let required = contract.required()?;
        let wanted = self.task.repairs.contains(&Repair::ToTool);
        if !wanted || broken.answered.trim().is_empty() {
            return None;
        }
        let request = to_tool_request(&contract, required, broken.answered)?;
        for repairer in self.task.repair_targets.clone() {
            if Instant::now() >= self.deadline {
                return None;
            }
            let Some(body) = encode_for(&request, &repairer) else {
                continue;
            };
            let Some(admitted) = admission.admit_with(Arc::clone(&repairer), body) else {
                continue;
            };
            self.tally.attempts += 1;
            let span = self.account.trace.attempt(&attempt::span_info(
                &repairer,
                self.tally.attempts,
                self.op,
            ));
            let mut call = self.repair_call(&repairer, admitted.key);
            call.contract = Some(Arc::clone(&contract));
            call.stream = false;
            let outcome = attempt::run(&call, admitted.body, admitted.permit)
                .instrument(span.clone())
                .await;
            let Attempt::Answer { status, body, .. } = outcome else {
                attempt::count_repair(self.task, target, Repair::ToTool, false, broken.violation);
                self.reask_failed(&repairer, outcome, admitted.key, &span);
                continue;
            };
            let kept = crate::schema::with_calls_of(completion, &body)
                .filter(|whole| contract.check_completion(whole).is_ok());
            attempt::count_repair(
                self.task,
                target,
                Repair::ToTool,
                kept.is_some(),
                broken.violation,
            );
            let Some(whole) = kept else {
                continue;
            };
            // The answer is `target`'s: its model, not the repairer's.
            self.account.trace.answer_meta(&whole);
            let answer = Attempt::Answer {
                status,
                body: whole,
                repaired: Some(Repair::ToTool),
                native: None,
            };
            return self.deliver(target, answer, &span);
        }
        None
    }
}

/// The request that asks a repair target for exactly the required call
/// (`required`: `None` any offered tool) made of `answered`.
fn to_tool_request(
    contract: &crate::schema::Contract,
    required: Option<&str>,
    answered: &str,
) -> Option<Vec<u8>> {
    let tool_choice = match required {
        Some(name) => serde_json::json!({"type": "function", "function": {"name": name}}),
        None => Value::from("required"),
    };
    let request = serde_json::json!({
        "model": "repair",
        "stream": false,
        "messages": [
            {"role": "system", "content": "Turn the assistant's answer below into exactly one call of the tool you are given. Take its arguments only from that answer; do not answer anything else."},
            {"role": "user", "content": answered},
        ],
        "tools": contract.tools(required),
        "tool_choice": tool_choice,
    });
    serde_json::to_vec(&request).ok()
}

/// An OpenAI-format request body encoded for `target`'s protocol.
fn encode_for(request: &[u8], target: &Target) -> Option<Bytes> {
    let parsed = ChatRequest::parse(request).ok()?;
    let model = TargetModel {
        model: &target.model,
        max_output: target.max_output,
    };
    target.provider.endpoint.adapter.encode(&parsed, model).ok()
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
    let ask = if broken.violation.tool.is_some() {
        "Answer again, with a tool call whose arguments are a JSON object that satisfies the tool's JSON Schema."
    } else {
        "Answer again, with only the JSON the requested response format asks for."
    };
    messages.push(serde_json::json!({
        "role": "user",
        "content": format!(
            "Your previous answer broke this request's contract: {}. {ask}",
            broken.violation
        ),
    }));
    encode_for(&serde_json::to_vec(&request).ok()?, target)
}
