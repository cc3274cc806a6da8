//! Who pays for an answer, and what a request is counted as: token and cost
//! metrics, the task's fallback spend, the provider's tokens-per-minute
//! correction, and the per-request series.

use std::sync::Arc;

use tokio::time::Instant;

use crate::snapshot::{Target, Task};
use crate::telemetry::RequestTrace;

/// The most tokens one answer is booked for, prompt and completion each: an
/// upstream's count beyond it is absurd (no model's context holds it), and
/// the counters it adds to must not wrap on it.
const MAX_BOOKED_TOKENS: u64 = 1 << 32;

/// Books one answer's usage.
#[derive(Debug, Clone)]
pub struct Account {
    /// The task the request ran in.
    pub task: Arc<Task>,
    /// The request's prompt estimate.
    pub prompt_estimate: u64,
    /// The request's `max_tokens`, if given.
    pub max_tokens: Option<u64>,
    /// The request's telemetry record (its access-log line, its spans).
    pub trace: RequestTrace,
    /// The target a healthy chain would have served the request from (the
    /// chain's first under `priority`, else the strategy's pick): every
    /// other target's spend is fallback spend.
    pub first_choice: Option<Arc<Target>>,
}

impl Account {
    /// Books usage: the upstream's report, else the prompt estimate and
    /// `completion_estimate` (a stream's content chunks, an answer's text).
    pub fn settle(&self, target: &Target, usage: Option<(u64, u64)>, completion_estimate: u64) {
        let (prompt, completion, usd) = self.book(target, usage, completion_estimate);
        self.trace.usage(prompt, completion, usd);
    }

    /// Books the prompt of a call abandoned before it answered (a hedged
    /// request's loser): spent, but not the request's answer, so the access
    /// log keeps the answer's usage.
    pub fn settle_abandoned(&self, target: &Target) {
        self.book(target, None, 0);
    }

    /// The metrics, spend and limits of one call's usage; its tokens and cost.
    fn book(
        &self,
        target: &Target,
        usage: Option<(u64, u64)>,
        completion_estimate: u64,
    ) -> (u64, u64, f64) {
        let (prompt, completion) = usage.unwrap_or((self.prompt_estimate, completion_estimate));
        let prompt = prompt.min(MAX_BOOKED_TOKENS);
        let completion = completion.min(MAX_BOOKED_TOKENS);
        target.metrics.prompt_tokens.increment(prompt);
        target.metrics.completion_tokens.increment(completion);
        let usd = target.usd(prompt, completion);
        if usd > 0.0 {
            self.task.route_metrics(Some(target)).cost.increment(usd);
        }
        let first = self
            .first_choice
            .as_ref()
            .is_some_and(|f| std::ptr::eq(&**f, target));
        if !first {
            self.task.state.add_spend(usd);
        }
        if let Some(limits) = &target.provider.limits {
            // Saturating: the client's max_tokens and the upstream's counts may be absurd.
            let charged = self
                .prompt_estimate
                .saturating_add(self.max_tokens.or(target.max_output).unwrap_or(0));
            limits.correct(prompt.saturating_add(completion).saturating_sub(charged));
        }
        (prompt, completion, usd)
    }
}

/// Counts one answered request of `task` served by `target` (or none).
pub fn answered(task: &Task, target: Option<&Target>, status: u16, arrival: Instant) {
    let route = task.route_metrics(target);
    route.duration.record(arrival.elapsed().as_secs_f64());
    route.requests.increment(status, 1);
}

/// Counts a request whose future was dropped (the client hung up) before it
/// finished: against no target.
pub struct CancelGuard<'a> {
    task: &'a Task,
    armed: bool,
}

impl<'a> CancelGuard<'a> {
    /// Armed until [`CancelGuard::disarm`].
    #[must_use]
    pub fn new(task: &'a Task) -> Self {
        Self { task, armed: true }
    }

    /// The request finished: nothing to count.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(task = %self.task.name, "client cancelled the request");
            self.task.cancelled.increment(1);
        }
    }
}
