//! Which targets of a task's chain may take a request, in which order, and
//! the one place where each is admitted before a call.
//!
//! [`plan`] is pure selection (also what `explain` prints). In order, each
//! exclusion with its reason:
//! 1. the task's chain;
//! 2. capabilities: what the request needs (`tools`/`functions` -> `tools`,
//!    `response_format` json -> `json_mode`, image parts -> `vision`) plus the
//!    task's `requires`;
//! 3. context window: estimated prompt tokens + `max_tokens` must fit `max_context`;
//! 4. health: DOWN (unless its half-open trial is due) and cooling-down targets;
//! 5. the fallback budget: once the task's spend on non-first targets this
//!    clock hour reaches `usd_per_hour`, only the chain's first target remains.
//!
//! Then the strategy picks the first target; the rest keep chain order as the
//! failover order. Strategies other than `priority` pick among HEALTHY
//! targets before DEGRADED ones.
//!
//! [`Admission`] walks a plan for the attempt loop and hands out the next
//! target already admitted: past the context floor a context-length error set,
//! holding a health permit (the half-open trial is single-flight), expressible
//! in its protocol (the body is encoded here), and within its provider's
//! rpm/tpm bucket. Each exclusion is counted where it is decided. When every
//! candidate was DOWN and nothing was tried, it offers the least recently
//! failed one as a trial (`health.all_down: trial`).

use std::sync::Arc;

use bytes::Bytes;
use compact_str::CompactString;
use serde_json::Value;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::health::{Permit, State, Unavailable};
use crate::native::{self, Facts};
use crate::ratelimit::Spender;
use crate::request::{EmbeddingsRequest, Prompt};
use crate::snapshot::{Capability, KeySet, NoKey, Snapshot, Strategy, Target, Task};
use crate::upstream::{Operation, TargetModel, Unsupported};

/// Share of first picks (under strategies other than `priority`) in which
/// DEGRADED targets compete with HEALTHY ones.
const DEGRADED_SHARE: f64 = 0.1;

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
    /// What a request with `facts` needs.
    #[must_use]
    pub fn of(facts: &Facts<'_>) -> Self {
        Needs {
            tools: facts.tools,
            json_mode: facts.json_mode && !facts.json_native,
            vision: facts.images,
            prompt_tokens: facts.prompt_tokens,
            max_tokens: facts.max_tokens,
        }
    }

    /// Capability tags needed: the request's own, then the task's `requires`.
    #[must_use]
    pub fn tags(&self, task: &Task) -> Vec<Capability> {
        let mut tags: Vec<Capability> = Vec::new();
        if self.tools {
            tags.push(Capability::Tools);
        }
        if self.json_mode {
            tags.push(Capability::JsonMode);
        }
        if self.vision {
            tags.push(Capability::Vision);
        }
        for r in &task.requires {
            if !tags.contains(r) {
                tags.push(*r);
            }
        }
        tags
    }

    /// Tokens the request may take: prompt estimate plus `max_tokens` (or the
    /// target's `max_output` when the request gives none).
    #[must_use]
    pub fn total_tokens(&self, target: &Target) -> u64 {
        target.call_tokens(self.prompt_tokens, self.max_tokens)
    }
}

/// Why a target was left out.
#[derive(Debug, Clone, PartialEq)]
pub enum Exclusion {
    /// It lacks a needed capability tag.
    MissingCapability(Capability),
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
    /// Its provider is cooling down (a provider-scoped rule: an account quota).
    ProviderCoolingDown,
    /// Every usable key of its provider is cooling down or out of its bucket.
    KeysLimited,
    /// Every key of its provider is revoked (401/403 until a reload or rotation).
    KeysRevoked,
    /// Its provider names keys but none of them could be read (never sent keyless).
    KeysUnreadable,
    /// The task's fallback spend this hour reached `usd_per_hour`.
    FallbackBudget,
    /// What is left of a bucket (its `reserve`), or of a provider that keeps
    /// rate limiting (`shed_after_429`), is kept for critical tasks.
    Reserved,
    /// Its context window is not larger than one that already said "too long".
    SmallerContext,
    /// Its protocol cannot express the request (e.g. `n > 1` for Anthropic).
    Unsupported(String),
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
            Exclusion::ProviderCoolingDown => "provider_cooldown",
            Exclusion::KeysLimited => "keys_limited",
            Exclusion::KeysRevoked => "keys_revoked",
            Exclusion::KeysUnreadable => "keys_unreadable",
            Exclusion::FallbackBudget => "fallback_budget",
            Exclusion::Reserved => "reserved",
            Exclusion::Unsupported(_) => "protocol",
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
            Exclusion::ProviderCoolingDown => {
                "its provider is cooling down (a provider-scoped rule)".to_owned()
            }
            Exclusion::KeysLimited => {
                "every key of its provider is rate-limited or cooling down".to_owned()
            }
            Exclusion::KeysRevoked => {
                "every key of its provider is revoked (until a reload or a key rotation)".to_owned()
            }
            Exclusion::KeysUnreadable => {
                "no key of its provider could be read (it is never called without one)".to_owned()
            }
            Exclusion::FallbackBudget => "fallback_budget usd_per_hour reached".to_owned(),
            Exclusion::Reserved => "kept for critical tasks (reserve or shed_after_429)".to_owned(),
            Exclusion::SmallerContext => {
                "context window not larger than one that was too small".to_owned()
            }
            Exclusion::Unsupported(why) => {
                format!("its protocol cannot express the request: {why}")
            }
        }
    }

    /// Whether the exclusion is about the request itself (no target of the
    /// chain could ever take it), not about the targets' state.
    #[must_use]
    pub fn is_about_the_request(&self) -> bool {
        match self {
            Exclusion::MissingCapability(_) | Exclusion::ContextWindow { .. } => true,
            Exclusion::Down
            | Exclusion::CoolingDown
            | Exclusion::ProviderRateLimited
            | Exclusion::ProviderCoolingDown
            | Exclusion::KeysLimited
            | Exclusion::KeysRevoked
            | Exclusion::KeysUnreadable
            | Exclusion::FallbackBudget
            | Exclusion::Reserved
            | Exclusion::SmallerContext
            | Exclusion::Unsupported(_) => false,
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
    /// The target a healthy chain would have served from: the chain's first
    /// under `priority`, else the strategy's pick (for `x-switchyard-degraded`
    /// and the `degraded` contract mode).
    #[must_use]
    pub fn first_choice(&self, task: &Task) -> Option<Arc<Target>> {
        match task.strategy {
            Strategy::Priority => task.chain.first().cloned(),
            Strategy::Weighted | Strategy::RoundRobin | Strategy::Latency | Strategy::Cost => {
                self.candidates.first().cloned()
            }
        }
    }

    /// The request-side exclusion that left nothing to try, if that is what
    /// happened (for 400 `no_eligible_target`).
    #[must_use]
    pub fn ineligible(&self) -> Option<&Exclusion> {
        let stateful = self.excluded.iter().any(|(_, why)| *why == Exclusion::Down);
        if !self.candidates.is_empty() || stateful {
            return None;
        }
        let mut about =
            (self.excluded.iter().map(|(_, why)| why)).filter(|why| why.is_about_the_request());
        let first = about.next()?;
        // Every window too small: the largest says how far the prompt is over.
        let window = |why: &Exclusion| {
            if let Exclusion::ContextWindow { max_context, .. } = why {
                Some(*max_context)
            } else {
                None
            }
        };
        if window(first).is_none() {
            return Some(first);
        }
        let mut largest = first;
        for why in about {
            match (window(why), window(largest)) {
                (Some(w), Some(l)) if w > l => largest = why,
                (Some(_), _) => {}
                (None, _) => return Some(first),
            }
        }
        Some(largest)
    }

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
            "stream_recovery": {
                "mode": if task.stream_recovery.continues { "continue" } else { "off" },
                "max_continuations": task.stream_recovery.max_continuations,
            },
            "hedge": task.hedge.map(|h| serde_json::json!({
                "after": h.after.to_string(),
                "max_share": h.max_share,
            })),
            "needs": {
                "capabilities": needs.tags(task),
                "prompt_tokens_estimate": needs.prompt_tokens,
                "max_tokens": needs.max_tokens,
            },
            "candidates": self.candidates.iter().map(|t| {
                let mut v = target(t);
                if let Some(why) = held_back(task, t, needs, Instant::now()) {
                    v["held_back"] = serde_json::json!({
                        "reason": why.reason(), "detail": why.describe(),
                    });
                }
                v
            }).collect::<Vec<_>>(),
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
                tags.iter()
                    .map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            needs.prompt_tokens,
            needs
                .max_tokens
                .map(|m| format!(" + {m} max tokens"))
                .unwrap_or_default(),
        );
        if task.stream_recovery.continues {
            let _ = writeln!(
                out,
                "a stream broken after its commit point continues on the next candidate (at most {} time(s))",
                task.stream_recovery.max_continuations
            );
        }
        if let Some(h) = task.hedge {
            let _ = writeln!(
                out,
                "a first attempt not committed after {} gets a hedge on the next candidate (at most {} % of a minute's requests)",
                h.after,
                h.max_share * 100.0
            );
        }
        out.push_str("candidates, in failover order:\n");
        if self.candidates.is_empty() {
            out.push_str("  (none)\n");
        }
        for (i, t) in self.candidates.iter().enumerate() {
            let held = held_back(task, t, needs, Instant::now())
                .map(|why| format!(": held back now, {} [{}]", why.describe(), why.reason()))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "  {}. {} ({} / {}){held}",
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

/// Why admission would pass over `target`, a candidate of the plan, now
/// without calling it: its provider cooling down or shedding after a 429,
/// or its provider's buckets (only the reserve left, or empty). Reads,
/// takes and counts nothing (for `explain`; keys are not looked at).
#[must_use]
pub fn held_back(task: &Task, target: &Target, needs: &Needs, now: Instant) -> Option<Exclusion> {
    let provider = &target.provider;
    if provider.health.unavailable(now).is_some() {
        return Some(Exclusion::ProviderCoolingDown);
    }
    let critical = task.priority.is_critical();
    if !critical && provider.shed_after_429.is_some() && provider.health.shedding(now).is_some() {
        return Some(Exclusion::Reserved);
    }
    let who = Spender {
        reserve: provider.reserve,
        critical,
    };
    match provider
        .limits
        .as_ref()?
        .peek(needs.total_tokens(target), who)
    {
        Ok(()) => None,
        Err(refused) if refused.reserved => Some(Exclusion::Reserved),
        Err(_) => Some(Exclusion::ProviderRateLimited),
    }
}

/// Builds the plan for a request. Health is read, not changed.
#[must_use]
pub fn plan(task: &Task, needs: &Needs, now: Instant) -> Plan {
    let tags = needs.tags(task);
    let over_budget = task
        .fallback_budget
        .is_some_and(|cap| task.state.spend_this_hour() >= cap);
    let mut eligible = Vec::with_capacity(task.chain.len());
    let mut excluded = Vec::new();
    for (i, target) in task.chain.iter().enumerate() {
        let exclusion = if let Some(tag) = tags.iter().find(|t| !target.capabilities.contains(t)) {
            Some(Exclusion::MissingCapability(*tag))
        } else if let Some(max) = target
            .max_context
            .filter(|max| needs.total_tokens(target) > *max)
        {
            Some(Exclusion::ContextWindow {
                needed: needs.total_tokens(target),
                max_context: max,
            })
        } else if target.provider.keys_unreadable() {
            Some(Exclusion::KeysUnreadable)
        } else if target.health.cooling_down(now) {
            Some(Exclusion::CoolingDown)
        } else if target.health.state() == State::Down && !target.health.trial_due(now) {
            Some(Exclusion::Down)
        } else if over_budget && i > 0 && task.strategy == Strategy::Priority {
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
    if over_budget && task.strategy != Strategy::Priority {
        // The strategy's pick is the ordinary route; its failovers are the
        // fallbacks the budget caps.
        for i in eligible.iter().filter(|i| Some(**i) != first) {
            excluded.push((Arc::clone(&task.chain[*i]), Exclusion::FallbackBudget));
        }
        eligible.retain(|i| Some(*i) == first);
    }
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
    // Peers of one rank: HEALTHY before DEGRADED, but a DEGRADED target
    // keeps a small share of first picks, so a success can bring it back.
    let healthy: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|i| task.chain[*i].health.state() == State::Healthy)
        .collect();
    let degraded_turn = rand::random::<f64>() < DEGRADED_SHARE;
    let pool = if healthy.is_empty() || degraded_turn {
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
            let n = task.state.next_turn();
            pool.get(usize::try_from(n % pool.len() as u64).unwrap_or(0))
                .copied()
        }
        Strategy::Weighted => {
            let weights: Vec<(usize, i64)> = pool
                .iter()
                .map(|&i| (i, i64::from(task.chain[i].weight)))
                .collect();
            task.state.smooth_weighted(task.chain.len(), &weights)
        }
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
    target.usd(needs.prompt_tokens, out)
}

/// Why the targets that could have served did not, as far as the client's
/// answer goes: rate limits (answered 429, with the earliest end), other
/// unavailability (DOWN, a rule's cooldown: 503), or a real failure.
#[derive(Debug, Clone, Copy, Default)]
pub struct Holdbacks {
    /// The earliest end of a rate limit that held a target back.
    pub limited: Option<Instant>,
    /// The earliest time a DOWN or paused target may be tried again.
    pub unavailable: Option<Instant>,
    /// Some attempt failed for real (an error, not a wait).
    pub failed: bool,
    /// A target was skipped because every key of its provider is revoked
    /// (no wait would help: not a 429).
    pub revoked: bool,
}

impl Holdbacks {
    /// A target held back by a rate limit until `until`.
    pub fn limited(&mut self, until: Instant) {
        self.limited = Some(self.limited.map_or(until, |t| t.min(until)));
    }

    /// A target unavailable (DOWN, paused) until `until`.
    pub fn unavailable(&mut self, until: Instant) {
        self.unavailable = Some(self.unavailable.map_or(until, |t| t.min(until)));
    }

    /// A target skipped or refused for `why`.
    pub fn held(&mut self, why: Unavailable) {
        match why {
            Unavailable::CoolingDown {
                until,
                rate_limited: true,
            } => self.limited(until),
            Unavailable::CoolingDown {
                until,
                rate_limited: false,
            }
            | Unavailable::Down { until } => self.unavailable(until),
        }
    }
}

/// What a request asks for, as the protocol adapters encode it.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    /// A chat completion.
    Chat(&'a Prompt<'a>),
    /// Embeddings.
    Embeddings(&'a EmbeddingsRequest<'a>),
}

impl Payload<'_> {
    /// The provider operation it calls.
    #[must_use]
    pub fn operation(self) -> Operation {
        match self {
            Payload::Chat(_) => Operation::Chat,
            Payload::Embeddings(_) => Operation::Embeddings,
        }
    }

    /// Embeddings asked for as base64 (`encoding_format: base64`).
    #[must_use]
    pub fn base64(self) -> bool {
        match self {
            Payload::Chat(_) => false,
            Payload::Embeddings(request) => request.base64,
        }
    }
}

/// A target admitted for one attempt (and its same-target retries).
#[derive(Debug)]
pub struct Admitted {
    /// The target.
    pub target: Arc<Target>,
    /// Its health permit for the first attempt.
    pub permit: Permit,
    /// The request encoded for the target's protocol.
    pub body: Bytes,
    /// The index of the provider key to send with (`None`: no readable key).
    pub key: Option<usize>,
}

/// Walks a plan for one request, handing out admitted targets.
#[derive(Debug)]
pub struct Admission<'a> {
    snapshot: &'a Snapshot,
    task: &'a Task,
    needs: &'a Needs,
    request: Payload<'a>,
    candidates: std::vec::IntoIter<Arc<Target>>,
    /// DOWN targets seen (for the all-down trial).
    down: Vec<Arc<Target>>,
    /// After a context-length error: only larger windows qualify.
    context_floor: Option<u64>,
    /// Why the last target the protocol could not express was skipped.
    unsupported: Option<String>,
    /// The client's field behind it, when the request said what only its
    /// own protocol can ([`crate::native::Untranslatable`]).
    unsupported_param: Option<String>,
    trial_offered: bool,
    /// What held skipped targets back.
    holdbacks: Holdbacks,
    /// Targets left out without a call, and why: for the access log.
    skipped: Vec<(CompactString, &'static str)>,
}

impl<'a> Admission<'a> {
    /// Starts walking `plan`, counting the exclusions it decided.
    #[must_use]
    pub fn new(
        snapshot: &'a Snapshot,
        task: &'a Task,
        plan: Plan,
        needs: &'a Needs,
        request: Payload<'a>,
    ) -> Self {
        let mut down = Vec::new();
        let mut holdbacks = Holdbacks::default();
        let now = Instant::now();
        let mut skipped = Vec::new();
        for (target, why) in &plan.excluded {
            skip(task, target, why);
            skipped.push((CompactString::from(target.name.as_str()), why.reason()));
            if matches!(why, Exclusion::Down | Exclusion::CoolingDown) {
                if let Some(held) = target.health.unavailable(now) {
                    holdbacks.held(held);
                }
            }
            if *why == Exclusion::Down {
                down.push(Arc::clone(target));
            }
            if *why == Exclusion::KeysUnreadable {
                holdbacks.revoked = true;
            }
        }
        Self {
            snapshot,
            task,
            needs,
            request,
            candidates: plan.candidates.into_iter(),
            down,
            context_floor: None,
            unsupported: None,
            unsupported_param: None,
            trial_offered: false,
            holdbacks,
            skipped,
        }
    }

    /// What held the skipped targets back so far.
    #[must_use]
    pub fn holdbacks(&self) -> Holdbacks {
        self.holdbacks
    }

    /// A permit for a same-target retry of `target`: its breaker or a
    /// cooldown may have closed it since the last attempt.
    #[must_use]
    pub fn readmit(&self, target: &Arc<Target>) -> Option<Permit> {
        target.health.admit(Instant::now()).ok()
    }

    /// Whether another call of `target` with `key` fits its provider's and
    /// the key's buckets now (a same-target retry, or one on the next key).
    /// Nothing is charged here: the call is, when it is sent
    /// ([`crate::snapshot::Provider::charge`]).
    pub fn recheck(&mut self, target: &Target, key: Option<usize>) -> bool {
        let tokens = self.needs.total_tokens(target);
        let key = key.and_then(|i| target.provider.keys.get(i));
        if let Some((limits, reserve)) = key.and_then(|k| Some((k.limits.as_ref()?, k.reserve))) {
            if let Err(refused) = limits.check(tokens, self.spender(reserve)) {
                self.snapshot.rate_limited.increment("key", 1);
                self.holdbacks.limited(Instant::now() + refused.wait);
                return false;
            }
        }
        self.provider_fits(target)
    }

    /// Whether a call of `target` fits its provider's buckets (all of them,
    /// checked before any is charged); a refusal is counted and held back.
    fn provider_fits(&mut self, target: &Target) -> bool {
        self.provider_refusal(target).is_none()
    }

    /// Why the provider's buckets refuse a call of `target` now, if they do:
    /// a rate limit, or only the reserve kept for critical tasks.
    fn provider_refusal(&mut self, target: &Target) -> Option<Exclusion> {
        let limits = target.provider.limits.as_ref()?;
        let tokens = self.needs.total_tokens(target);
        let who = self.spender(target.provider.reserve);
        let refused = limits.check(tokens, who).err()?;
        self.holdbacks.limited(Instant::now() + refused.wait);
        if refused.reserved {
            return Some(Exclusion::Reserved);
        }
        self.snapshot.rate_limited.increment("provider", 1);
        Some(Exclusion::ProviderRateLimited)
    }

    /// Whether the task is critical: it spends what providers keep back.
    fn critical(&self) -> bool {
        self.task.priority.is_critical()
    }

    /// This task as a spender of a bucket that keeps `reserve`.
    fn spender(&self, reserve: f64) -> Spender {
        Spender {
            reserve,
            critical: self.critical(),
        }
    }

    /// After a context-length error at `target`: only larger windows from now on.
    pub fn raise_context_floor(&mut self, target: &Target) {
        self.context_floor = Some(window(target));
    }

    /// Whether some target was DOWN (skipped, or offered as the all-down trial).
    #[must_use]
    pub fn saw_down(&self) -> bool {
        !self.down.is_empty()
    }

    /// Why a target's protocol could not express the request, if one could not.
    pub fn take_unsupported(&mut self) -> Option<(String, Option<String>)> {
        let why = self.unsupported.take()?;
        Some((why, self.unsupported_param.take()))
    }

    /// The next admitted target. `nothing_tried`: no attempt was made yet, so
    /// an all-DOWN chain may still get its one trial.
    pub fn next(&mut self, nothing_tried: bool) -> Option<Admitted> {
        while let Some(target) = self.candidates.next() {
            if let Some(admitted) = self.admit(target) {
                return Some(admitted);
            }
        }
        if !nothing_tried || !self.snapshot.health.all_down_trial || self.trial_offered {
            return None;
        }
        self.trial_offered = true;
        self.all_down()
    }

    fn admit(&mut self, target: Arc<Target>) -> Option<Admitted> {
        if self
            .context_floor
            .is_some_and(|floor| window(&target) <= floor)
        {
            self.skip(&target, &Exclusion::SmallerContext);
            return None;
        }
        let permit = self.gate(&target)?;
        let body = self.encode(&target)?;
        self.finish(target, permit, body)
    }

    /// Admits `target` for a call of its own outside the plan (a repair by
    /// another target), `body` already encoded for it: the same provider
    /// cooldown, breaker, key and bucket checks as a candidate's.
    pub fn admit_with(&mut self, target: Arc<Target>, body: Bytes) -> Option<Admitted> {
        let permit = self.gate(&target)?;
        self.finish(target, permit, body)
    }

    /// A target's provider cooldown and breaker: its permit, if they let it be called.
    fn gate(&mut self, target: &Arc<Target>) -> Option<Permit> {
        let now = Instant::now();
        if let Some(why) = target.provider.health.unavailable(now) {
            self.holdbacks.held(why);
            self.skip(target, &Exclusion::ProviderCoolingDown);
            return None;
        }
        let shed = target.provider.shed_after_429.is_some() && !self.critical();
        if let Some(until) = shed.then(|| target.provider.health.shedding(now)).flatten() {
            // The account keeps rate limiting: what is left is the critical path's.
            self.holdbacks.limited(until);
            self.skip(target, &Exclusion::Reserved);
            return None;
        }
        match target.health.admit(Instant::now()) {
            Ok(p) => Some(p),
            Err(why) => {
                self.holdbacks.held(why);
                let exclusion = match why {
                    Unavailable::Down { .. } => Exclusion::Down,
                    Unavailable::CoolingDown { .. } => Exclusion::CoolingDown,
                };
                self.skip(target, &exclusion);
                if exclusion == Exclusion::Down {
                    self.down.push(Arc::clone(target));
                }
                None
            }
        }
    }

    /// The key and the provider's bucket: the admitted call.
    fn finish(&mut self, target: Arc<Target>, permit: Permit, body: Bytes) -> Option<Admitted> {
        let key = self.key(&target)?;
        if let Some(why) = self.provider_refusal(&target) {
            self.skip(&target, &why);
            return None;
        }
        Some(Admitted {
            target,
            permit,
            body,
            key,
        })
    }

    /// Another key of `target`'s provider after a key-scoped failure (none
    /// of `tried`), if one can serve now: the cheapest recovery, same model.
    pub fn next_key(&mut self, target: &Target, tried: KeySet) -> Option<usize> {
        let tokens = self.needs.total_tokens(target);
        match target.provider.pick_key(
            Instant::now(),
            (&target.model, tokens),
            tried,
            self.critical(),
        ) {
            Ok(Some(key)) => Some(key),
            Ok(None) | Err(NoKey::Revoked | NoKey::Exhausted | NoKey::Unreadable) => None,
            Err(NoKey::Limited(until)) => {
                self.holdbacks.limited(until);
                self.snapshot.rate_limited.increment("key", 1);
                None
            }
            Err(NoKey::Reserved(until)) => {
                self.holdbacks.limited(until);
                None
            }
        }
    }

    /// The key a first attempt at `target` goes with: `None` skips the
    /// target (no key can serve); `Some(None)` sends without a key.
    fn key(&mut self, target: &Target) -> Option<Option<usize>> {
        let tokens = self.needs.total_tokens(target);
        let why = match target.provider.pick_key(
            Instant::now(),
            (&target.model, tokens),
            KeySet::default(),
            self.critical(),
        ) {
            Ok(key) => return Some(key),
            Err(NoKey::Limited(until)) => {
                self.holdbacks.limited(until);
                self.snapshot.rate_limited.increment("key", 1);
                Exclusion::KeysLimited
            }
            Err(NoKey::Reserved(until)) => {
                self.holdbacks.limited(until);
                Exclusion::Reserved
            }
            Err(NoKey::Revoked | NoKey::Exhausted) => {
                self.holdbacks.revoked = true;
                Exclusion::KeysRevoked
            }
            Err(NoKey::Unreadable) => {
                self.holdbacks.revoked = true;
                Exclusion::KeysUnreadable
            }
        };
        self.skip(target, &why);
        None
    }

    /// The request in `target`'s protocol; a request it cannot express skips it.
    fn encode(&mut self, target: &Target) -> Option<Bytes> {
        let model = TargetModel {
            model: &target.model,
            max_output: target.max_output,
        };
        let endpoint = &target.provider.endpoint;
        let encoded = match self.request {
            Payload::Chat(request) => match request.native {
                // The client's own protocol: its body as sent, `model` rewritten.
                Some(native) if endpoint.native_protocol() == Some(native.protocol) => {
                    crate::request::object_with_model_at(native.body, native.model_at, model.model)
                        .ok_or_else(|| Unsupported("the body is not a JSON object".into()))
                }
                // What only the client's protocol can say: its targets alone serve it.
                Some(native::Request {
                    untranslatable: Some(u),
                    ..
                }) => {
                    self.unsupported_param = Some(u.param.clone());
                    Err(Unsupported(u.why.clone()))
                }
                Some(_) | None => request
                    .read(|view| endpoint.adapter_for(false).encode(view, model))
                    .unwrap_or_else(|| {
                        Err(Unsupported("its chat translation did not read".into()))
                    }),
            },
            Payload::Embeddings(request) => {
                endpoint.adapter.encode_embeddings(request, &target.model)
            }
        };
        match encoded {
            Ok(body) => Some(body),
            Err(why) => {
                self.skip(target, &Exclusion::Unsupported(why.0.clone()));
                self.unsupported = Some(why.0);
                None
            }
        }
    }

    /// Every candidate was DOWN: rather than fail without trying, give the
    /// least recently failed one a trial. (Cooling-down targets asked not to
    /// be called, and are not: the trial is for open breakers.)
    fn all_down(&mut self) -> Option<Admitted> {
        let floor = self.context_floor;
        let now = Instant::now();
        let target = self
            .down
            .iter()
            .filter(|t| floor.is_none_or(|min| window(t) > min))
            .filter(|t| !t.health.cooling_down(now))
            .min_by_key(|t| t.health.last_failure())
            .cloned()?;
        let permit = target.health.force_trial(now)?;
        info!(task = %self.task.name, target = %target.name, "all targets unavailable; trying the least recently failed");
        let body = self.encode(&target)?;
        let key = self.key(&target)?;
        Some(Admitted {
            target,
            permit,
            body,
            key,
        })
    }
}

/// Counts a target left out without a call.
impl Admission<'_> {
    /// Leaves `target` out without a call: counted, and kept for the access log.
    fn skip(&mut self, target: &Target, why: &Exclusion) {
        skip(self.task, target, why);
        self.skipped
            .push((CompactString::from(target.name.as_str()), why.reason()));
    }

    /// The targets left out without a call so far, and why (`reason`).
    #[must_use]
    pub fn skipped(&self) -> &[(CompactString, &'static str)] {
        &self.skipped
    }
}

fn skip(task: &Task, target: &Target, why: &Exclusion) {
    debug!(target = %target.name, reason = why.reason(), "target skipped without a call: {}", why.describe());
    crate::telemetry::skipped(&target.name, why.reason());
    task.route_metrics(Some(target))
        .exclusions
        .increment(why.reason(), 1);
}

/// A target's context window as routing reads it: one it does not declare is
/// unbounded, after a context-length error as when a plan is made.
fn window(target: &Target) -> u64 {
    target.max_context.unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::parse;
    use crate::request::ChatRequest;
    use crate::snapshot::{compile::compile, CompileOptions, LiveState, Snapshot};

    fn snapshot(tasks: &str) -> Snapshot {
        let text = format!(
            "version: 1\nproviders:\n  p: {{ base_url: 'http://127.0.0.1:9/v1' }}\n  q: {{ base_url: 'http://127.0.0.1:10/v1' }}\n\
             targets:\n  big: {{ provider: p, model: big, capabilities: [tools, json_mode, vision], max_context: 128000, weight: 3, cost: {{ input_per_1k: 0.01, output_per_1k: 0.03 }} }}\n  \
             small: {{ provider: p, model: small, capabilities: [tools], max_context: 8000, weight: 1, cost: {{ input_per_1k: 0.001, output_per_1k: 0.002 }} }}\n  \
             plain: {{ provider: q, model: plain, max_context: 4000, cost: {{ input_per_1k: 0.0001, output_per_1k: 0.0001 }} }}\n\
             tasks:\n{tasks}"
        );
        let parsed = parse(&text).unwrap();
        compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .unwrap()
        .snapshot
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
            Exclusion::MissingCapability(Capability::Tools)
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
    fn over_budget_a_rotating_strategy_keeps_its_pick_and_drops_only_failovers() {
        let s = snapshot(
            "  t: { chain: [small, big], strategy: round_robin, fallback_budget: { usd_per_hour: 0.5 } }\n",
        );
        let task = &s.tasks["t"];
        task.state.add_spend(0.6);
        let picks: Vec<Vec<String>> = (0..4)
            .map(|_| {
                let p = plan(task, &Needs::default(), Instant::now());
                names(&p).iter().map(|n| (*n).to_owned()).collect()
            })
            .collect();
        // Each plan is the strategy's own pick alone, and both still get picked.
        assert!(picks.iter().all(|p| p.len() == 1), "{picks:?}");
        assert!(picks.iter().any(|p| p == &["big"]), "{picks:?}");
        assert!(picks.iter().any(|p| p == &["small"]), "{picks:?}");
    }

    #[test]
    fn needs_are_read_from_the_request() {
        let body = br#"{
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_schema", "json_schema": {}},
            "max_completion_tokens": 77
        }"#;
        let n = Needs::of(&ChatRequest::parse(body).unwrap().facts());
        assert!(n.tools && n.json_mode && n.vision);
        assert_eq!(n.max_tokens, Some(77));
        let empty =
            ChatRequest::parse(br#"{"tools": [], "messages": [{"role": "user"}]}"#).unwrap();
        assert!(!Needs::of(&empty.facts()).tools);
    }
}
