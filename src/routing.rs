//! Candidate selection: which targets of a task's chain may take a request,
//! why the others may not, and in which order to try them.
//!
//! In order, each exclusion with its reason:
//! 1. the task's chain;
//! 2. capabilities: what the request needs (`tools`/`functions` -> `tools`,
//!    `response_format` json -> `json_mode`, image parts -> `vision`) plus the
//!    task's `requires`;
//! 3. context window: estimated prompt tokens + `max_tokens` must fit `max_context`;
//! 4. health: DOWN (unless its half-open trial is due) and cooling-down targets;
//! 5. provider limits (checked when the attempt is about to be sent, by
//!    [`ProviderLimits::admit`], since checking takes from the bucket);
//! 6. the fallback budget: once the task's spend on non-first targets this
//!    clock hour reaches `usd_per_hour`, only the chain's first target remains.
//!
//! Then the strategy picks the first target; the rest keep chain order as the
//! failover order. Strategies other than `priority` pick among HEALTHY
//! targets before DEGRADED ones.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota};
use serde_json::Value;
use tokio::time::Instant;

use crate::health::State;
use crate::snapshot::{Target, Task};

/// How a task picks its first target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Chain order.
    Priority,
    /// Smooth weighted round robin by `weight`.
    Weighted,
    /// Each eligible target in turn.
    RoundRobin,
    /// Lowest peak-EWMA time to first byte.
    Latency,
    /// Cheapest estimated request.
    Cost,
}

impl Strategy {
    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "priority" => Some(Strategy::Priority),
            "weighted" => Some(Strategy::Weighted),
            "round_robin" => Some(Strategy::RoundRobin),
            "latency" => Some(Strategy::Latency),
            "cost" => Some(Strategy::Cost),
            _ => None,
        }
    }

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Priority => "priority",
            Strategy::Weighted => "weighted",
            Strategy::RoundRobin => "round_robin",
            Strategy::Latency => "latency",
            Strategy::Cost => "cost",
        }
    }
}

/// What a request needs from a target, read from its body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Needs {
    /// It offers `tools` or `functions`.
    pub tools: bool,
    /// It asks for a JSON `response_format`.
    pub json_mode: bool,
    /// It has image content parts.
    pub vision: bool,
    /// Estimated prompt tokens ([`crate::tokens`]).
    pub prompt_tokens: u64,
    /// `max_completion_tokens` or `max_tokens`, if given.
    pub max_tokens: Option<u64>,
}

impl Needs {
    /// Reads a chat request.
    #[must_use]
    pub fn from_request(request: &serde_json::Map<String, Value>) -> Self {
        let non_empty = |k: &str| {
            request
                .get(k)
                .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
        };
        let json_mode = request
            .get("response_format")
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str)
            .is_some_and(|t| t == "json_object" || t == "json_schema");
        let vision = request
            .get("messages")
            .and_then(Value::as_array)
            .is_some_and(|ms| {
                ms.iter().any(|m| {
                    m.get("content")
                        .and_then(Value::as_array)
                        .is_some_and(|parts| {
                            parts.iter().any(|p| {
                                matches!(
                                    p.get("type").and_then(Value::as_str),
                                    Some("image_url" | "image" | "input_image")
                                )
                            })
                        })
                })
            });
        let max_tokens = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| request.get(*k).and_then(Value::as_u64));
        Needs {
            tools: non_empty("tools") || non_empty("functions"),
            json_mode,
            vision,
            prompt_tokens: crate::tokens::estimate_request(request),
            max_tokens,
        }
    }

    /// Capability tags needed: the request's own, then the task's `requires`.
    #[must_use]
    pub fn tags<'a>(&self, task: &'a Task) -> Vec<&'a str> {
        let mut tags: Vec<&str> = Vec::new();
        if self.tools {
            tags.push("tools");
        }
        if self.json_mode {
            tags.push("json_mode");
        }
        if self.vision {
            tags.push("vision");
        }
        for r in &task.requires {
            if !tags.contains(&r.as_str()) {
                tags.push(r);
            }
        }
        tags
    }

    /// Tokens the request may take: prompt estimate plus `max_tokens` (or the
    /// target's `max_output` when the request gives none).
    #[must_use]
    pub fn total_tokens(&self, target: &Target) -> u64 {
        self.prompt_tokens + self.max_tokens.or(target.max_output).unwrap_or(0)
    }
}

/// Why a target was left out.
#[derive(Debug, Clone, PartialEq)]
pub enum Exclusion {
    /// It lacks a needed capability tag.
    MissingCapability(String),
    /// Prompt + output would not fit its context window.
    ContextWindow {
        /// Estimated tokens needed.
        needed: u64,
        /// Its `max_context`.
        max_context: u64,
    },
    /// Breaker open.
    Down,
    /// Cooling down after a 429 or a rule's `cooldown`.
    CoolingDown,
    /// Its provider's rpm/tpm bucket is empty.
    ProviderRateLimited,
    /// The task's fallback spend this hour reached `usd_per_hour`.
    FallbackBudget,
    /// Its context window is not larger than one that already said "too long".
    SmallerContext,
}

impl Exclusion {
    /// The `reason` label of `switchyard_route_exclusions_total`.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Exclusion::MissingCapability(_) => "capability",
            Exclusion::ContextWindow { .. } | Exclusion::SmallerContext => "context_window",
            Exclusion::Down => "down",
            Exclusion::CoolingDown => "cooldown",
            Exclusion::ProviderRateLimited => "provider_rate_limit",
            Exclusion::FallbackBudget => "fallback_budget",
        }
    }

    /// The rule in words, for `explain`.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Exclusion::MissingCapability(tag) => format!("lacks capability `{tag}`"),
            Exclusion::ContextWindow {
                needed,
                max_context,
            } => {
                format!("needs ~{needed} tokens, max_context is {max_context}")
            }
            Exclusion::Down => "DOWN (breaker open)".to_owned(),
            Exclusion::CoolingDown => {
                "cooling down (429 Retry-After or a rule's cooldown)".to_owned()
            }
            Exclusion::ProviderRateLimited => "provider rate limit bucket is empty".to_owned(),
            Exclusion::FallbackBudget => "fallback_budget usd_per_hour reached".to_owned(),
            Exclusion::SmallerContext => {
                "context window not larger than one that was too small".to_owned()
            }
        }
    }
}

/// The candidates for one request, in the order to try them, and the rest.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Failover order: the strategy's pick, then chain order.
    pub candidates: Vec<Arc<Target>>,
    /// Targets left out, with why.
    pub excluded: Vec<(Arc<Target>, Exclusion)>,
}

impl Plan {
    /// The plan as JSON (for `POST /admin/explain`).
    #[must_use]
    pub fn to_json(&self, task: &Task, needs: &Needs) -> Value {
        let target = |t: &Target| {
            serde_json::json!({
                "target": t.name, "provider": t.provider.name, "model": t.model,
                "state": t.health.state().as_str(),
            })
        };
        serde_json::json!({
            "task": task.name,
            "strategy": task.strategy.as_str(),
            "needs": {
                "capabilities": needs.tags(task),
                "prompt_tokens_estimate": needs.prompt_tokens,
                "max_tokens": needs.max_tokens,
            },
            "candidates": self.candidates.iter().map(|t| target(t)).collect::<Vec<_>>(),
            "excluded": self.excluded.iter().map(|(t, why)| {
                let mut v = target(t);
                v["reason"] = why.reason().into();
                v["detail"] = why.describe().into();
                v
            }).collect::<Vec<_>>(),
        })
    }

    /// The plan in words (for `switchyard explain`).
    #[must_use]
    pub fn to_text(&self, task: &Task, needs: &Needs) -> String {
        use std::fmt::Write as _;
        let tags = needs.tags(task);
        let mut out = format!(
            "task `{}` (strategy {}): needs {}; ~{} prompt tokens{}\n",
            task.name,
            task.strategy.as_str(),
            if tags.is_empty() {
                "no capabilities".to_owned()
            } else {
                tags.join(", ")
            },
            needs.prompt_tokens,
            needs
                .max_tokens
                .map(|m| format!(" + {m} max tokens"))
                .unwrap_or_default(),
        );
        out.push_str("candidates, in failover order:\n");
        if self.candidates.is_empty() {
            out.push_str("  (none)\n");
        }
        for (i, t) in self.candidates.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {}. {} ({} / {})",
                i + 1,
                t.name,
                t.provider.name,
                t.model
            );
        }
        if !self.excluded.is_empty() {
            out.push_str("excluded:\n");
            for (t, why) in &self.excluded {
                let _ = writeln!(out, "  - {}: {} [{}]", t.name, why.describe(), why.reason());
            }
        }
        out.push_str("(provider rate limits are checked when a request is sent)\n");
        out
    }
}

/// Builds the plan for a request. Health is read, not changed; the proxy
/// still asks each target's breaker for a permit before sending.
#[must_use]
pub fn plan(task: &Task, needs: &Needs, now: Instant) -> Plan {
    let tags = needs.tags(task);
    let over_budget = task
        .fallback_budget
        .is_some_and(|cap| task.state.spend_this_hour() >= cap);
    let mut eligible = Vec::with_capacity(task.chain.len());
    let mut excluded = Vec::new();
    for (i, target) in task.chain.iter().enumerate() {
        let exclusion = if let Some(tag) = tags
            .iter()
            .find(|t| !target.capabilities.iter().any(|c| c == *t))
        {
            Some(Exclusion::MissingCapability((*tag).to_owned()))
        } else if let Some(max) = target
            .max_context
            .filter(|max| needs.total_tokens(target) > *max)
        {
            Some(Exclusion::ContextWindow {
                needed: needs.total_tokens(target),
                max_context: max,
            })
        } else if target.health.cooling_down(now) {
            Some(Exclusion::CoolingDown)
        } else if target.health.state() == State::Down && !target.health.trial_due(now) {
            Some(Exclusion::Down)
        } else if over_budget && i > 0 {
            Some(Exclusion::FallbackBudget)
        } else {
            None
        };
        match exclusion {
            Some(e) => excluded.push((Arc::clone(target), e)),
            None => eligible.push(i),
        }
    }
    let first = pick(task, needs, &eligible, now);
    let mut candidates = Vec::with_capacity(eligible.len());
    if let Some(first) = first {
        candidates.push(Arc::clone(&task.chain[first]));
    }
    candidates.extend(
        eligible
            .iter()
            .filter(|i| Some(**i) != first)
            .map(|i| Arc::clone(&task.chain[*i])),
    );
    Plan {
        candidates,
        excluded,
    }
}

/// The chain position the strategy chooses first among `eligible` positions.
fn pick(task: &Task, needs: &Needs, eligible: &[usize], now: Instant) -> Option<usize> {
    if task.strategy == Strategy::Priority {
        return eligible.first().copied();
    }
    // Peers of one rank: HEALTHY before DEGRADED.
    let healthy: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|i| task.chain[*i].health.state() == State::Healthy)
        .collect();
    let pool = if healthy.is_empty() {
        eligible
    } else {
        &healthy[..]
    };
    match task.strategy {
        Strategy::Priority => pool.first().copied(),
        Strategy::RoundRobin => {
            if pool.is_empty() {
                return None;
            }
            let n = task.state.round_robin.fetch_add(1, Ordering::Relaxed);
            pool.get(usize::try_from(n % pool.len() as u64).unwrap_or(0))
                .copied()
        }
        Strategy::Weighted => task.state.smooth_weighted(task, pool),
        Strategy::Latency => pool.iter().copied().min_by(|a, b| {
            let la = task.chain[*a].health.latency_cost(now);
            let lb = task.chain[*b].health.latency_cost(now);
            la.total_cmp(&lb)
        }),
        Strategy::Cost => pool.iter().copied().min_by(|a, b| {
            let ca = estimated_cost(&task.chain[*a], needs);
            let cb = estimated_cost(&task.chain[*b], needs);
            ca.total_cmp(&cb)
        }),
    }
}

/// USD of a request at `target`, from the estimate (prompt + max output).
#[must_use]
pub fn estimated_cost(target: &Target, needs: &Needs) -> f64 {
    let out = needs.max_tokens.or(target.max_output).unwrap_or(256);
    usd(target, needs.prompt_tokens, out)
}

/// USD of `prompt` + `completion` tokens at `target`'s price (0 if it has none).
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn usd(target: &Target, prompt: u64, completion: u64) -> f64 {
    target.cost.map_or(0.0, |c| {
        prompt as f64 / 1000.0 * c.input_per_1k + completion as f64 / 1000.0 * c.output_per_1k
    })
}

/// Live routing state of a task, kept across reloads by task name.
#[derive(Debug, Default)]
pub struct TaskState {
    /// Round-robin cursor.
    pub round_robin: AtomicU64,
    /// Smooth weighted round robin: current weight per chain position.
    swrr: Mutex<Vec<i64>>,
    /// (clock hour, USD spent on non-first targets in it).
    spend: Mutex<(u64, f64)>,
}

impl TaskState {
    fn smooth_weighted(&self, task: &Task, pool: &[usize]) -> Option<usize> {
        let mut current = self.swrr.lock().unwrap_or_else(PoisonError::into_inner);
        if current.len() != task.chain.len() {
            *current = vec![0; task.chain.len()];
        }
        let mut total = 0i64;
        let mut best: Option<usize> = None;
        for &i in pool {
            let w = i64::from(task.chain[i].weight);
            current[i] += w;
            total += w;
            if best.is_none_or(|b| current[i] > current[b]) {
                best = Some(i);
            }
        }
        if let Some(b) = best {
            current[b] -= total;
        }
        best
    }

    fn hour() -> u64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 3600)
    }

    /// USD spent on fallback targets in the current clock hour.
    #[must_use]
    pub fn spend_this_hour(&self) -> f64 {
        let spend = self.spend.lock().unwrap_or_else(PoisonError::into_inner);
        if spend.0 == Self::hour() {
            spend.1
        } else {
            0.0
        }
    }

    /// Adds fallback spend.
    pub fn add_spend(&self, usd: f64) {
        let hour = Self::hour();
        let mut spend = self.spend.lock().unwrap_or_else(PoisonError::into_inner);
        if spend.0 != hour {
            *spend = (hour, 0.0);
        }
        spend.1 += usd;
    }
}

/// Task states by name; lives outside snapshots.
#[derive(Debug, Default)]
pub struct TaskStates {
    by_name: Mutex<HashMap<String, Arc<TaskState>>>,
}

impl TaskStates {
    /// The state of task `name`, created on first use.
    pub fn get(&self, name: &str) -> Arc<TaskState> {
        let mut map = self.by_name.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(map.entry(name.to_owned()).or_default())
    }
}

fn quota(per: Duration, burst: u32) -> Option<Quota> {
    Some(Quota::with_period(per)?.allow_burst(NonZeroU32::new(burst.max(1))?))
}

/// A provider account's request and token buckets.
#[derive(Debug)]
pub struct ProviderLimits {
    rpm: Option<DefaultDirectRateLimiter>,
    tpm: Option<DefaultDirectRateLimiter>,
}

impl ProviderLimits {
    /// Buckets for `rpm` requests and `tpm` tokens a minute; `burst` requests at once.
    #[must_use]
    pub fn new(rpm: Option<u32>, tpm: Option<u32>, burst: Option<u32>) -> Self {
        let per_minute = |n: u32| Duration::from_secs(60) / n.max(1);
        Self {
            rpm: rpm
                .and_then(|n| quota(per_minute(n), burst.unwrap_or(n)))
                .map(governor::RateLimiter::direct),
            tpm: tpm
                .and_then(|n| quota(per_minute(n), n))
                .map(governor::RateLimiter::direct),
        }
    }

    /// Takes one request and `tokens` tokens from the buckets; false if either
    /// cannot admit them now (the target is then skipped, as if it said 429).
    pub fn admit(&self, tokens: u64) -> bool {
        if let Some(rpm) = &self.rpm {
            if rpm.check().is_err() {
                return false;
            }
        }
        if let Some(tpm) = &self.tpm {
            let n = NonZeroU32::new(u32::try_from(tokens.max(1)).unwrap_or(u32::MAX))
                .unwrap_or(NonZeroU32::MIN);
            return matches!(tpm.check_n(n), Ok(Ok(())));
        }
        true
    }

    /// Charges tokens the upstream reported beyond the estimate (best effort:
    /// a bucket cannot be refunded when the estimate was high).
    pub fn correct(&self, extra_tokens: u64) {
        if let (Some(tpm), Some(n)) = (
            &self.tpm,
            u32::try_from(extra_tokens).ok().and_then(NonZeroU32::new),
        ) {
            let _ = tpm.check_n(n);
        }
    }
}

/// A task's client-facing buckets: one for the task, optionally one per caller.
#[derive(Debug)]
pub struct TaskLimiter {
    all: DefaultDirectRateLimiter,
    per_caller: Option<(http::HeaderName, DefaultKeyedRateLimiter<String>, usize)>,
}

impl TaskLimiter {
    /// `rps` sustained (fractional allowed), `burst` at once; per caller by
    /// `header` with at most `max_callers` tracked. `None` for a zero rate.
    #[must_use]
    pub fn new(
        rps: f64,
        burst: Option<u32>,
        per_caller: Option<(http::HeaderName, usize)>,
    ) -> Option<Self> {
        if !(rps.is_finite() && rps > 0.0) {
            return None;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let burst = burst.unwrap_or_else(|| rps.ceil().min(f64::from(u32::MAX)) as u32);
        let q = quota(Duration::from_secs_f64(1.0 / rps), burst)?;
        Some(Self {
            all: governor::RateLimiter::direct(q),
            per_caller: per_caller.map(|(h, max)| (h, governor::RateLimiter::keyed(q), max)),
        })
    }

    /// Admits one request, or says how long to wait (for `Retry-After`).
    ///
    /// # Errors
    /// The wait until the bucket admits a request, and which bucket (`task` or `caller`).
    pub fn admit(&self, headers: &http::HeaderMap) -> Result<(), (Duration, &'static str)> {
        let clock = governor::clock::DefaultClock::default();
        if let Some((header, keyed, max)) = &self.per_caller {
            let key = headers
                .get(header)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .chars()
                .take(256)
                .collect::<String>();
            if keyed.len() >= *max {
                keyed.retain_recent();
            }
            if let Err(not_until) = keyed.check_key(&key) {
                return Err((
                    not_until.wait_time_from(governor::clock::Clock::now(&clock)),
                    "caller",
                ));
            }
        }
        self.all.check().map_err(|not_until| {
            (
                not_until.wait_time_from(governor::clock::Clock::now(&clock)),
                "task",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::snapshot::{CompileOptions, LiveState, Snapshot};

    fn snapshot(tasks: &str) -> Snapshot {
        let text = format!(
            "version: 1\nproviders:\n  p: {{ base_url: 'http://127.0.0.1:9/v1' }}\n  q: {{ base_url: 'http://127.0.0.1:10/v1' }}\n\
             targets:\n  big: {{ provider: p, model: big, capabilities: [tools, json_mode, vision], max_context: 128000, weight: 3, cost: {{ input_per_1k: 0.01, output_per_1k: 0.03 }} }}\n  \
             small: {{ provider: p, model: small, capabilities: [tools], max_context: 8000, weight: 1, cost: {{ input_per_1k: 0.001, output_per_1k: 0.002 }} }}\n  \
             plain: {{ provider: q, model: plain, max_context: 4000, cost: {{ input_per_1k: 0.0001, output_per_1k: 0.0001 }} }}\n\
             tasks:\n{tasks}"
        );
        let parsed = parse(&text).unwrap();
        Snapshot::compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .unwrap()
        .0
    }

    fn names(p: &Plan) -> Vec<&str> {
        p.candidates.iter().map(|t| t.name.as_str()).collect()
    }

    #[test]
    fn capabilities_and_context_exclude_with_reasons() {
        let s = snapshot("  t: { chain: [plain, small, big] }\n");
        let task = &s.tasks["t"];
        let needs = Needs {
            tools: true,
            prompt_tokens: 7000,
            max_tokens: Some(2000),
            ..Needs::default()
        };
        let p = plan(task, &needs, Instant::now());
        assert_eq!(names(&p), ["big"]);
        assert_eq!(
            p.excluded[0].1,
            Exclusion::MissingCapability("tools".into())
        );
        assert_eq!(
            p.excluded[1].1,
            Exclusion::ContextWindow {
                needed: 9000,
                max_context: 8000
            }
        );
        let needs = Needs {
            vision: true,
            ..Needs::default()
        };
        assert_eq!(names(&plan(task, &needs, Instant::now())), ["big"]);
    }

    #[test]
    fn task_requires_adds_tags() {
        let s = snapshot("  t: { chain: [plain, small, big], requires: [json_mode] }\n");
        assert_eq!(
            names(&plan(&s.tasks["t"], &Needs::default(), Instant::now())),
            ["big"]
        );
    }

    #[test]
    fn weighted_shares_follow_weights_within_two_percent() {
        let s = snapshot("  t: { chain: [big, small], strategy: weighted }\n");
        let task = &s.tasks["t"];
        let mut big = 0;
        for _ in 0..10_000 {
            if plan(task, &Needs::default(), Instant::now()).candidates[0].name == "big" {
                big += 1;
            }
        }
        let share = f64::from(big) / 10_000.0;
        assert!((share - 0.75).abs() < 0.02, "{share}");
    }

    #[test]
    fn round_robin_rotates_and_failover_keeps_chain_order() {
        let s = snapshot("  t: { chain: [plain, small, big], strategy: round_robin }\n");
        let task = &s.tasks["t"];
        let firsts: Vec<Vec<&str>> = (0..3)
            .map(|_| {
                let p = plan(task, &Needs::default(), Instant::now());
                names(&p)
                    .into_iter()
                    .map(|n| {
                        if n == "plain" {
                            "plain"
                        } else if n == "small" {
                            "small"
                        } else {
                            "big"
                        }
                    })
                    .collect()
            })
            .collect();
        assert_eq!(firsts[0], ["plain", "small", "big"]);
        assert_eq!(firsts[1], ["small", "plain", "big"]);
        assert_eq!(firsts[2], ["big", "plain", "small"]);
    }

    #[test]
    fn cost_picks_cheapest() {
        let s = snapshot("  t: { chain: [big, small, plain], strategy: cost }\n");
        assert_eq!(
            names(&plan(&s.tasks["t"], &Needs::default(), Instant::now())),
            ["plain", "big", "small"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn latency_prefers_fast_target_once_averages_settle() {
        let s = snapshot("  t: { chain: [big, small], strategy: latency }\n");
        let task = &s.tasks["t"];
        let mut slow_picks = 0;
        for i in 0..1000 {
            let p = plan(task, &Needs::default(), Instant::now());
            let first = &p.candidates[0];
            let ttfb = if first.name == "big" {
                Duration::from_millis(400)
            } else {
                Duration::from_millis(50)
            };
            first.health.record_latency(Instant::now(), ttfb);
            if i >= 100 && first.name == "big" {
                slow_picks += 1;
            }
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        assert!(
            slow_picks < 90,
            "slow target got {slow_picks} of 900 settled picks"
        );
    }

    #[test]
    fn fallback_budget_leaves_only_the_first_target() {
        let s = snapshot("  t: { chain: [small, big], fallback_budget: { usd_per_hour: 0.5 } }\n");
        let task = &s.tasks["t"];
        assert_eq!(
            names(&plan(task, &Needs::default(), Instant::now())),
            ["small", "big"]
        );
        task.state.add_spend(0.6);
        let p = plan(task, &Needs::default(), Instant::now());
        assert_eq!(names(&p), ["small"]);
        assert_eq!(p.excluded[0].1, Exclusion::FallbackBudget);
    }

    #[test]
    fn provider_buckets_admit_then_refuse() {
        let l = ProviderLimits::new(Some(60), None, Some(2));
        assert!(l.admit(10) && l.admit(10));
        assert!(!l.admit(10), "burst of 2 spent");
        let l = ProviderLimits::new(None, Some(1000), None);
        assert!(l.admit(900));
        assert!(!l.admit(200), "tpm bucket has ~100 left");
    }

    #[test]
    fn task_limiter_refuses_with_a_wait() {
        let l = TaskLimiter::new(1.0, Some(1), None).unwrap();
        let h = http::HeaderMap::new();
        assert!(l.admit(&h).is_ok());
        let (wait, scope) = l.admit(&h).unwrap_err();
        assert_eq!(scope, "task");
        assert!(
            wait > Duration::from_millis(500) && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
    }

    #[test]
    fn needs_are_read_from_the_body() {
        let req: serde_json::Map<String, Value> = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_schema", "json_schema": {}},
            "max_completion_tokens": 77
        }))
        .unwrap();
        let n = Needs::from_request(&req);
        assert!(n.tools && n.json_mode && n.vision);
        assert_eq!(n.max_tokens, Some(77));
        let empty: serde_json::Map<String, Value> =
            serde_json::from_value(serde_json::json!({"tools": []})).unwrap();
        assert!(!Needs::from_request(&empty).tools);
    }
}
