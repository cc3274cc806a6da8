//! Per-target health: one small state machine that is both the three health
//! states (HEALTHY / DEGRADED / DOWN) and the circuit breaker (closed / open /
//! half-open), plus the cooldown a 429 asks for.
//!
//! ```text
//!            degraded_after fails             down_after fails
//!  HEALTHY ───────────────────▶ DEGRADED ─────────────────────▶ DOWN (open)
//!     ▲  ◀──────── success ────────┘                              │ open_for ±20 %
//!     │                                                           ▼
//!     └────────────── trial succeeds ─────────────────── one half-open trial
//!                                        trial fails ──▶ DOWN, timer restarted
//! ```
//!
//! State is keyed by target identity (provider base URL + upstream model) in a
//! [`Registry`] that outlives config snapshots, so a reload keeps it. Every
//! method takes `now` so tests drive time by hand.
//!
//! With `shared_state`, other replicas' verdicts are merged in ([`merge`]),
//! and a DOWN target's half-open trial also needs a lease grant: the
//! background keeper holds the Redis lease and grants the trial here, so
//! `admit` itself never waits on the network.

pub mod merge;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use tokio::time::Instant;

/// What a chain whose targets are all DOWN does (`health.all_down`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllDown {
    /// Try the least recently failed target anyway.
    Trial,
    /// Answer 503.
    Fail,
}

impl AllDown {
    /// Every choice, for parsing and the JSON Schema.
    pub const ALL: [AllDown; 2] = [AllDown::Trial, AllDown::Fail];

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            AllDown::Trial => "trial",
            AllDown::Fail => "fail",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

/// Health thresholds and timing, from `health:` in routes.yaml.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthConfig {
    /// Consecutive counted failures before DEGRADED (default 3).
    pub degraded_after: u32,
    /// Consecutive counted failures before DOWN (default 5).
    pub down_after: u32,
    /// How long DOWN lasts before a half-open trial (default 20 s, ±20 % jitter).
    pub open_for: Duration,
    /// Whether a chain whose targets are all DOWN still tries one (default true).
    pub all_down_trial: bool,
    /// Sliding window for the failure rate (default 30 s).
    pub window: Duration,
    /// Fewest counted outcomes in the window before the rate is judged (default 10).
    pub min_requests: u32,
    /// Failure rate in the window (0.0-1.0) at which HEALTHY -> DEGRADED (default 0.5).
    pub failure_rate: f64,
    /// How often a DOWN target is probed (default 60 s; `None` disables probing).
    pub probe_interval: Option<Duration>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            degraded_after: 3,
            down_after: 5,
            open_for: Duration::from_secs(20),
            all_down_trial: true,
            window: Duration::from_secs(30),
            min_requests: 10,
            failure_rate: 0.5,
            probe_interval: Some(Duration::from_secs(60)),
        }
    }
}

/// The three states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Serving normally.
    Healthy,
    /// Serving, ranked after healthy peers.
    Degraded,
    /// Breaker open: no traffic but one half-open trial after `open_for`.
    Down,
}

impl State {
    /// Lower-case name for logs, metrics and the admin endpoint.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::Degraded => "degraded",
            State::Down => "down",
        }
    }

    /// The value of the `switchyard_target_health` gauge.
    #[must_use]
    pub fn gauge(self) -> f64 {
        match self {
            State::Healthy => 0.0,
            State::Degraded => 1.0,
            State::Down => 2.0,
        }
    }
}

/// Why a target may not be tried now, and until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unavailable {
    /// Breaker open (or its half-open trial is taken); `until` is when a
    /// trial is due (now, if one is in flight).
    Down {
        /// When the next half-open trial may go.
        until: Instant,
    },
    /// Cooling down after a 429 or a rule's `cooldown`.
    CoolingDown {
        /// When the cooldown ends.
        until: Instant,
        /// Only rate limits (429s, an advertised wait) hold it back.
        rate_limited: bool,
    },
}

impl Unavailable {
    /// Metric/log label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Unavailable::Down { .. } => "down",
            Unavailable::CoolingDown { .. } => "cooldown",
        }
    }

    /// When the target may be tried again.
    #[must_use]
    pub fn until(self) -> Instant {
        match self {
            Unavailable::Down { until } | Unavailable::CoolingDown { until, .. } => until,
        }
    }
}

/// A state change, returned so the caller can log it and count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: State,
    /// After.
    pub to: State,
}

#[derive(Debug)]
struct Inner {
    state: State,
    consecutive_failures: u32,
    reopen_at: Option<Instant>,
    trial_in_flight: bool,
    /// A rate limit's cooldown (429, an advertised wait) ends then.
    limited_until: Option<Instant>,
    /// Any other rule's cooldown ends then.
    paused_until: Option<Instant>,
    last_failure: Option<Instant>,
    last_change: Instant,
    /// When it last left DOWN (a newer DOWN from another replica still applies).
    recovered_at: Option<Instant>,
    /// Trials need a grant (shared state is connected).
    leases: bool,
    /// The lease keeper granted this replica the half-open trial until then.
    granted_until: Option<Instant>,
    /// A request found the trial due but not granted (the keeper then asks for the lease).
    trial_wanted: bool,
    last_class: Option<Arc<str>>,
    last_probe: Option<Instant>,
    window: Window,
    /// Peak-EWMA of time to first byte, seconds, and when it was last updated.
    latency: Option<(f64, Instant)>,
    /// The last [`TTFT_SAMPLES`] times to first byte, seconds (for hedging's percentiles).
    ttft: VecDeque<f32>,
}

/// How many recent times to first byte a target keeps.
const TTFT_SAMPLES: usize = 256;
/// Fewest samples before a percentile is trusted.
const MIN_TTFT_SAMPLES: usize = 20;

/// Decay time of the latency average: older samples weigh `e^(-age/τ)`.
const LATENCY_TAU: Duration = Duration::from_secs(10);

/// Counted outcomes per second over the sliding window.
#[derive(Debug, Default)]
struct Window {
    /// (second since the target's epoch, successes, failures), oldest first.
    buckets: VecDeque<(u64, u32, u32)>,
}

impl Window {
    fn record(&mut self, second: u64, ok: bool, span: u64) {
        self.prune(second, span);
        match self.buckets.back_mut() {
            Some((s, good, bad)) if *s == second => {
                if ok {
                    *good += 1;
                } else {
                    *bad += 1;
                }
            }
            _ => self
                .buckets
                .push_back((second, u32::from(ok), u32::from(!ok))),
        }
    }

    fn prune(&mut self, second: u64, span: u64) {
        while self
            .buckets
            .front()
            .is_some_and(|(s, ..)| s + span <= second)
        {
            self.buckets.pop_front();
        }
    }

    /// (counted outcomes, failure rate) in the window ending at `second`.
    fn rate(&mut self, second: u64, span: u64) -> (u32, f64) {
        self.prune(second, span);
        let (good, bad) = self
            .buckets
            .iter()
            .fold((0u32, 0u32), |(g, b), (_, g2, b2)| (g + g2, b + b2));
        let total = good + bad;
        (
            total,
            if total == 0 {
                0.0
            } else {
                f64::from(bad) / f64::from(total)
            },
        )
    }
}

/// Health of one target. Cheap to share; every update takes a short lock.
#[derive(Debug)]
pub struct TargetHealth {
    inner: Mutex<Inner>,
    /// Origin of the window's second buckets.
    epoch: Instant,
}

/// Permission to send one attempt. A half-open trial permit that is dropped
/// without a result (the client hung up) frees the trial slot again.
#[derive(Debug)]
pub struct Permit {
    health: Arc<TargetHealth>,
    trial: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.trial {
            self.health.lock().trial_in_flight = false;
        }
    }
}

/// A read-only view for the admin endpoint.
#[derive(Debug, Clone)]
pub struct HealthView {
    /// Current state.
    pub state: State,
    /// Counted failures since the last success.
    pub consecutive_failures: u32,
    /// Rule that classified the last failure.
    pub last_class: Option<Arc<str>>,
    /// Failure rate over the sliding window (counted outcomes only).
    pub window_failure_rate: f64,
    /// Counted outcomes in the sliding window.
    pub window_requests: u32,
    /// Time since the last state change.
    pub since_change: Duration,
    /// Time until a half-open trial is allowed (DOWN only).
    pub next_trial_in: Option<Duration>,
    /// Time left of a cooldown.
    pub cooldown_left: Option<Duration>,
}

impl TargetHealth {
    /// A healthy target.
    #[must_use]
    pub fn new(now: Instant) -> Self {
        Self {
            inner: Mutex::new(Inner {
                state: State::Healthy,
                consecutive_failures: 0,
                reopen_at: None,
                trial_in_flight: false,
                limited_until: None,
                paused_until: None,
                last_failure: None,
                last_change: now,
                recovered_at: None,
                leases: false,
                granted_until: None,
                trial_wanted: false,
                last_class: None,
                last_probe: None,
                window: Window::default(),
                latency: None,
                ttft: VecDeque::with_capacity(TTFT_SAMPLES),
            }),
            epoch: now,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Current state.
    #[must_use]
    pub fn state(&self) -> State {
        self.lock().state
    }

    /// Whether a DOWN target's half-open trial could be taken now.
    #[must_use]
    pub fn trial_due(&self, now: Instant) -> bool {
        let inner = self.lock();
        inner.state == State::Down
            && !inner.trial_in_flight
            && inner.reopen_at.is_none_or(|t| now >= t)
    }

    /// Records a time to first byte (peak-EWMA: a slower sample counts at once,
    /// a faster one pulls the average down with the decay time τ = 10 s).
    pub fn record_latency(&self, now: Instant, sample: Duration) {
        let mut inner = self.lock();
        if inner.ttft.len() == TTFT_SAMPLES {
            inner.ttft.pop_front();
        }
        #[allow(clippy::cast_possible_truncation)]
        inner.ttft.push_back(sample.as_secs_f64() as f32);
        let sample = sample.as_secs_f64();
        inner.latency = Some(match inner.latency {
            None => (sample, now),
            Some((avg, at)) if sample > avg => (sample, at.max(now)),
            Some((avg, at)) => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                let w = (-age / LATENCY_TAU.as_secs_f64()).exp();
                (avg * w + sample * (1.0 - w), now)
            }
        });
    }

    /// The `quantile` (0-1) of the recent times to first byte, once at least
    /// 20 are known.
    #[must_use]
    pub fn ttft_quantile(&self, quantile: f64) -> Option<Duration> {
        let mut samples: Vec<f32> = {
            let inner = self.lock();
            if inner.ttft.len() < MIN_TTFT_SAMPLES {
                return None;
            }
            inner.ttft.iter().copied().collect()
        };
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((samples.len() as f64 - 1.0) * quantile.clamp(0.0, 1.0)).round() as usize;
        let (_, at, _) = samples.select_nth_unstable_by(rank, f32::total_cmp);
        Some(Duration::from_secs_f64(f64::from(*at).max(0.0)))
    }

    /// The latency strategy's cost: the peak-EWMA in seconds; 0 for a target
    /// never measured, so each target gets tried and measured.
    #[must_use]
    pub fn latency_cost(&self, _now: Instant) -> f64 {
        self.lock().latency.map_or(0.0, |(avg, _)| avg)
    }

    /// Whether a cooldown (429 `Retry-After`, a rule's `cooldown`) is running.
    #[must_use]
    pub fn cooling_down(&self, now: Instant) -> bool {
        self.lock().cooldown(now).is_some()
    }

    /// Why the target may not be tried now, if it may not: a cooldown first
    /// (it holds even a DOWN target back), then an open breaker.
    #[must_use]
    pub fn unavailable(&self, now: Instant) -> Option<Unavailable> {
        let inner = self.lock();
        if let Some(cooling) = inner.cooldown(now) {
            return Some(cooling);
        }
        match inner.state {
            State::Down if inner.trial_in_flight => Some(Unavailable::Down { until: now }),
            State::Down => inner
                .reopen_at
                .filter(|t| now < *t)
                .map(|until| Unavailable::Down { until })
                .or_else(|| {
                    (!inner.trial_granted(now)).then_some(Unavailable::Down { until: now })
                }),
            State::Healthy | State::Degraded => None,
        }
    }

    /// When this target last failed (for choosing a trial when all are DOWN).
    #[must_use]
    pub fn last_failure(&self) -> Option<Instant> {
        self.lock().last_failure
    }

    /// Asks to send one attempt now. DOWN targets admit one half-open trial at a
    /// time once `reopen_at` has passed; cooling-down targets admit nothing.
    ///
    /// # Errors
    /// Why the target may not be tried now.
    pub fn admit(self: &Arc<Self>, now: Instant) -> Result<Permit, Unavailable> {
        let mut inner = self.lock();
        if let Some(cooling) = inner.cooldown(now) {
            return Err(cooling);
        }
        match inner.state {
            State::Healthy | State::Degraded => Ok(Permit {
                health: Arc::clone(self),
                trial: false,
            }),
            State::Down => {
                if inner.trial_in_flight {
                    return Err(Unavailable::Down { until: now });
                }
                if let Some(until) = inner.reopen_at.filter(|t| now < *t) {
                    return Err(Unavailable::Down { until });
                }
                if !inner.trial_granted(now) {
                    // Another replica may hold the lease: the keeper asks for it.
                    inner.trial_wanted = true;
                    return Err(Unavailable::Down { until: now });
                }
                inner.granted_until = None;
                inner.trial_in_flight = true;
                Ok(Permit {
                    health: Arc::clone(self),
                    trial: true,
                })
            }
        }
    }

    /// Forces a trial even though the breaker is open: used when every target of
    /// a chain is DOWN and `health.all_down` is `trial`. Never past a cooldown:
    /// an upstream that asked for a wait gets it.
    #[must_use]
    pub fn force_trial(self: &Arc<Self>, now: Instant) -> Option<Permit> {
        let mut inner = self.lock();
        if inner.cooldown(now).is_some() {
            return None;
        }
        let trial = inner.state == State::Down && !inner.trial_in_flight;
        if trial {
            inner.trial_in_flight = true;
        }
        Some(Permit {
            health: Arc::clone(self),
            trial,
        })
    }

    /// A quiet window forgets: a DEGRADED target with no counted failure for a
    /// whole `window` is HEALTHY again (else a target that gets no traffic,
    /// as a DEGRADED one under most strategies, could never come back).
    pub fn forget(&self, now: Instant, cfg: &HealthConfig) -> Option<Transition> {
        let mut inner = self.lock();
        if inner.state != State::Degraded {
            return None;
        }
        let quiet = inner
            .last_failure
            .is_none_or(|t| now.saturating_duration_since(t) >= cfg.window);
        if !quiet || self.rate_exceeded(&mut inner, now, cfg) {
            return None;
        }
        inner.consecutive_failures = 0;
        change(&mut inner, State::Healthy, now)
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    /// Whether the window's failure rate is over the threshold.
    fn rate_exceeded(&self, inner: &mut Inner, now: Instant, cfg: &HealthConfig) -> bool {
        let (total, rate) = inner
            .window
            .rate(self.second(now), cfg.window.as_secs().max(1));
        total >= cfg.min_requests && rate >= cfg.failure_rate
    }

    /// Records a success: the count resets and the target is HEALTHY (or
    /// stays DEGRADED while the window's failure rate is over the threshold).
    pub fn record_success(
        &self,
        mut permit: Permit,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<Transition> {
        let mut inner = self.lock();
        if std::mem::take(&mut permit.trial) {
            inner.trial_in_flight = false;
        }
        inner.consecutive_failures = 0;
        inner.reopen_at = None;
        let second = self.second(now);
        inner
            .window
            .record(second, true, cfg.window.as_secs().max(1));
        let to = if self.rate_exceeded(&mut inner, now, cfg) {
            State::Degraded
        } else {
            State::Healthy
        };
        change(&mut inner, to, now)
    }

    /// Claims the next active probe of a DOWN target: true when `interval`
    /// has passed since the last probe (or since it went down), and then the
    /// interval restarts, so concurrent callers never probe twice.
    pub fn claim_probe(&self, now: Instant, interval: Duration) -> bool {
        let mut inner = self.lock();
        let since = inner
            .last_probe
            .map_or(inner.last_change, |p| p.max(inner.last_change));
        // A target that asked for a wait is not called before it ends, not even by a probe.
        let due = inner.state == State::Down
            && inner.cooldown(now).is_none()
            && now.saturating_duration_since(since) >= interval;
        if due {
            inner.last_probe = Some(now);
        }
        due
    }

    /// Records an active probe. A reachable upstream (any status below 500)
    /// is restored to HEALTHY with a fresh window; an unreachable one stays DOWN.
    pub fn record_probe(&self, now: Instant, reachable: bool) -> Option<Transition> {
        let mut inner = self.lock();
        inner.last_probe = Some(now);
        if !reachable || inner.state != State::Down {
            return None;
        }
        inner.consecutive_failures = 0;
        inner.reopen_at = None;
        inner.window = Window::default();
        change(&mut inner, State::Healthy, now)
    }

    /// Records a failed attempt. `counted` is the error class's `health` flag;
    /// `cooldown` is how long to skip the target. `jitter` is in `[-1.0, 1.0]`
    /// and spreads the reopen time by ±20 % of `open_for`.
    pub fn record_failure(
        &self,
        mut permit: Permit,
        now: Instant,
        failure: &Failure,
        cfg: &HealthConfig,
    ) -> Option<Transition> {
        let mut inner = self.lock();
        let was_trial = std::mem::take(&mut permit.trial);
        if was_trial {
            inner.trial_in_flight = false;
        }
        if let Some(cd) = failure.cooldown {
            let until = now + cd;
            let slot = if failure.rate_limited {
                &mut inner.limited_until
            } else {
                &mut inner.paused_until
            };
            *slot = Some(slot.map_or(until, |t| t.max(until)));
        }
        if !failure.counted {
            return None;
        }
        inner.last_failure = Some(now);
        inner.last_class = Some(Arc::clone(&failure.class));
        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
        let second = self.second(now);
        inner
            .window
            .record(second, false, cfg.window.as_secs().max(1));
        let n = inner.consecutive_failures;
        let to = if was_trial || n >= cfg.down_after {
            State::Down
        } else if n >= cfg.degraded_after || self.rate_exceeded(&mut inner, now, cfg) {
            State::Degraded
        } else {
            inner.state
        };
        if to == State::Down && (was_trial || inner.state != State::Down) {
            let spread = cfg.open_for.as_secs_f64() * 0.2 * failure.jitter.clamp(-1.0, 1.0);
            let open = Duration::from_secs_f64((cfg.open_for.as_secs_f64() + spread).max(0.0));
            inner.reopen_at = Some(now + open);
        }
        change(&mut inner, to, now)
    }

    /// A snapshot for the admin endpoint.
    #[must_use]
    pub fn view(&self, now: Instant, cfg: &HealthConfig) -> HealthView {
        let mut inner = self.lock();
        let (window_requests, window_failure_rate) = inner
            .window
            .rate(self.second(now), cfg.window.as_secs().max(1));
        HealthView {
            window_failure_rate,
            window_requests,
            state: inner.state,
            consecutive_failures: inner.consecutive_failures,
            last_class: inner.last_class.clone(),
            since_change: now.saturating_duration_since(inner.last_change),
            next_trial_in: match inner.state {
                State::Down => inner.reopen_at.map(|t| t.saturating_duration_since(now)),
                State::Healthy | State::Degraded => None,
            },
            cooldown_left: inner.cooldown(now).map(|u| u.until() - now),
        }
    }
}

/// One counted or uncounted failure, as the error-class table decided it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Counts against health.
    pub counted: bool,
    /// Skip the target for this long.
    pub cooldown: Option<Duration>,
    /// The cooldown is a rate limit's (a 429, an advertised wait): the client
    /// hears 429, not 503, when that is all that stands in the way.
    pub rate_limited: bool,
    /// Name of the rule, kept as the "last error class".
    pub class: Arc<str>,
    /// In `[-1.0, 1.0]`: where in the ±20 % band the reopen time falls.
    pub jitter: f64,
}

impl Failure {
    /// A failure of rule `class`, its reopen time drawn anywhere in the band.
    #[must_use]
    pub fn new(
        counted: bool,
        cooldown: Option<Duration>,
        rate_limited: bool,
        class: Arc<str>,
    ) -> Self {
        Failure {
            counted,
            cooldown,
            rate_limited,
            class,
            jitter: rand::random::<f64>() * 2.0 - 1.0,
        }
    }
}

impl Inner {
    /// Whether this replica may take a due half-open trial: always without
    /// shared leases, else only while the keeper's grant lasts.
    fn trial_granted(&self, now: Instant) -> bool {
        !self.leases || self.granted_until.is_some_and(|t| now < t)
    }

    /// The running cooldown, if any: another rule's pause wins over a rate
    /// limit's (the client must not be told "just slow down" then).
    fn cooldown(&self, now: Instant) -> Option<Unavailable> {
        let running = |t: Option<Instant>| t.filter(|t| now < *t);
        match (running(self.paused_until), running(self.limited_until)) {
            (Some(paused), limited) => Some(Unavailable::CoolingDown {
                until: limited.map_or(paused, |l| l.max(paused)),
                rate_limited: false,
            }),
            (None, Some(until)) => Some(Unavailable::CoolingDown {
                until,
                rate_limited: true,
            }),
            (None, None) => None,
        }
    }
}

fn change(inner: &mut Inner, to: State, now: Instant) -> Option<Transition> {
    if inner.state == to {
        return None;
    }
    let from = inner.state;
    inner.state = to;
    inner.last_change = now;
    if to != State::Down {
        inner.granted_until = None;
        if from == State::Down {
            inner.recovered_at = Some(now);
        }
    }
    Some(Transition { from, to })
}

/// Whether an API key can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// It can.
    Usable,
    /// Cooling down after a 429 (or a rule's cooldown) until then.
    CoolingDown(Instant),
    /// Revoked (a 401/403): unusable until a reload or a rotation of its file.
    Dead,
}

impl KeyState {
    /// The `switchyard_key_state` gauge value: 0 usable, 1 cooling down, 2 dead.
    #[must_use]
    pub fn gauge(self) -> f64 {
        match self {
            KeyState::Usable => 0.0,
            KeyState::CoolingDown(_) => 1.0,
            KeyState::Dead => 2.0,
        }
    }

    /// Lower-case name for `/admin/targets` and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Usable => "usable",
            KeyState::CoolingDown(_) => "cooling_down",
            KeyState::Dead => "dead",
        }
    }
}

#[derive(Debug, Default)]
struct KeyInner {
    /// A cooldown of the whole key (a rule's, not a rate limit's).
    cooldown_until: Option<Instant>,
    /// Rate limits' cooldowns, by model: providers count their limits per
    /// model (OpenAI, Anthropic, Gemini, Bedrock), so a 429 for one model
    /// leaves the key to the others.
    limited: Vec<(Box<str>, Instant)>,
    dead: bool,
    /// When `dead` last changed (the later of two replicas' verdicts wins).
    dead_changed: Option<Instant>,
    last_limited: Option<Instant>,
    /// A revoked key's next re-probe, and the backoff that led to it.
    reprobe: Option<(Instant, Duration)>,
    /// A re-probe of it is in flight.
    probing: bool,
    /// Revoked by a `revoke: until_rotation` rule: never re-probed.
    pinned: bool,
}

impl KeyInner {
    /// Holds the key back for `model` until `until` (the later end wins);
    /// ended cooldowns are let go.
    pub(crate) fn limit(&mut self, model: &str, until: Instant, now: Instant) {
        self.limited.retain(|(_, end)| *end > now);
        match self.limited.iter_mut().find(|(m, _)| &**m == model) {
            Some((_, end)) => *end = (*end).max(until),
            None => self.limited.push((model.into(), until)),
        }
    }

    /// Sets the verdict; a key that is no longer revoked forgets its re-probes.
    fn set_dead(&mut self, dead: bool, at: Instant) {
        self.dead = dead;
        self.dead_changed = Some(at);
        if !dead {
            self.reprobe = None;
            self.pinned = false;
        }
    }
}

/// Live state of one API key: its cooldowns, whether it is revoked, and when
/// it was last rate-limited (for `least_recently_limited`).
#[derive(Debug, Default)]
pub struct KeyHealth {
    inner: Mutex<KeyInner>,
}

impl KeyHealth {
    /// Whether the key can serve at `now`, any model (cooling down while a
    /// cooldown of any model lasts; for its gauge and `/admin`).
    #[must_use]
    pub fn state(&self, now: Instant) -> KeyState {
        let inner = self.inner.lock();
        let latest = inner.limited.iter().map(|(_, until)| *until).max();
        Self::state_of(&inner, now, latest)
    }

    /// Whether the key can serve `model` at `now`.
    #[must_use]
    pub fn state_for(&self, now: Instant, model: &str) -> KeyState {
        let inner = self.inner.lock();
        let limited = inner.limited.iter().find(|(m, _)| &**m == model);
        Self::state_of(&inner, now, limited.map(|(_, until)| *until))
    }

    fn state_of(inner: &KeyInner, now: Instant, limited: Option<Instant>) -> KeyState {
        if inner.dead {
            return KeyState::Dead;
        }
        match inner.cooldown_until.max(limited).filter(|t| now < *t) {
            Some(until) => KeyState::CoolingDown(until),
            None => KeyState::Usable,
        }
    }

    /// When it last answered 429, if ever.
    #[must_use]
    pub fn last_limited(&self) -> Option<Instant> {
        self.inner.lock().last_limited
    }

    /// Records a key-scoped failure: a cooldown, a revocation, or both. A
    /// rate limit's cooldown holds the key back for `model` only.
    pub fn record(
        &self,
        now: Instant,
        cooldown: Option<Duration>,
        revoked: bool,
        rate_limited: bool,
        model: &str,
    ) {
        let mut inner = self.inner.lock();
        if let Some(cd) = cooldown {
            let until = now + cd;
            if rate_limited {
                inner.limit(model, until, now);
            } else {
                inner.cooldown_until = Some(inner.cooldown_until.map_or(until, |t| t.max(until)));
            }
        }
        if rate_limited {
            inner.last_limited = Some(now);
        }
        if revoked && !inner.dead {
            inner.set_dead(true, now);
        }
    }

    /// Keeps a revoked key out until a reload or a rotation: no re-probes
    /// (`revoke: until_rotation`).
    pub fn pin_revocation(&self) {
        let mut inner = self.inner.lock();
        if inner.dead {
            inner.pinned = true;
        }
    }

    /// A reload (or a rotated key file) brings a revoked key back.
    pub fn revive(&self) {
        let mut inner = self.inner.lock();
        if inner.dead {
            inner.set_dead(false, Instant::now());
        }
    }

    /// Claims the next re-probe of a revoked key: its first comes `first`
    /// after the prober first sees it revoked, each failed one doubles the
    /// wait up to `max`. One at a time; true when the caller is to send it.
    pub fn claim_reprobe(&self, now: Instant, first: Duration, max: Duration) -> bool {
        let mut inner = self.inner.lock();
        if !inner.dead || inner.probing || inner.pinned {
            return false;
        }
        match inner.reprobe {
            None => {
                inner.reprobe = Some((now + first, first.min(max)));
                false
            }
            Some((at, _)) if now >= at => {
                inner.probing = true;
                true
            }
            Some(_) => false,
        }
    }

    /// Records a re-probe: an accepted key is usable again (a newer verdict,
    /// shared with the other replicas); a refused one waits twice as long,
    /// up to `max`. Returns whether the key came back.
    pub fn record_reprobe(&self, now: Instant, accepted: bool, max: Duration) -> bool {
        let mut inner = self.inner.lock();
        inner.probing = false;
        if !inner.dead {
            return false;
        }
        if accepted {
            inner.set_dead(false, now);
            return true;
        }
        let backoff = inner
            .reprobe
            .map_or(max, |(_, b)| b.saturating_mul(2).min(max));
        inner.reprobe = Some((now + backoff, backoff));
        false
    }
}

/// Live state of a provider account: a provider-scoped cooldown (an
/// account-wide quota) that holds back every target of it.
#[derive(Debug, Default)]
pub struct ProviderHealth {
    /// (until, a rate limit's), the latest end.
    cooldown: Mutex<Option<(Instant, bool)>>,
    /// Until when non-critical work keeps off the account after its last
    /// rate limit (`shed_after_429`), here or on another replica.
    shed_until: Mutex<Option<Instant>>,
    /// The provider's own words when it said the account is out of credit
    /// (status, body), until its cooldown ends: what the caller is told while
    /// the account is held back, rather than a wait that will not help.
    out_of_credit: Mutex<Option<(Instant, u16, bytes::Bytes)>>,
}

impl ProviderHealth {
    /// The account answered a rate limit: non-critical work keeps off it
    /// until `until` (the later end wins).
    pub fn shed_until(&self, until: Instant) {
        let mut s = self.shed_until.lock();
        if s.is_none_or(|t| t < until) {
            *s = Some(until);
        }
    }

    /// Until when non-critical work keeps off the account; `None` when
    /// that has passed.
    #[must_use]
    pub fn shedding(&self, now: Instant) -> Option<Instant> {
        (*self.shed_until.lock()).filter(|&until| now < until)
    }

    /// Holds every target of the account back for `cooldown`.
    pub fn cool_down(&self, now: Instant, cooldown: Duration, rate_limited: bool) {
        let until = now + cooldown;
        let mut c = self.cooldown.lock();
        *c = Some(match *c {
            Some((t, limited)) if t >= until => (t, limited),
            Some(_) | None => (until, rate_limited),
        });
    }

    /// The account said it is out of credit: its answer is kept for the
    /// callers that come while it is held back, until `until`.
    pub fn out_of_credit(&self, until: Instant, status: u16, body: bytes::Bytes) {
        *self.out_of_credit.lock() = Some((until, status, body));
    }

    /// The out-of-credit answer the account gave, while it is held back for it.
    #[must_use]
    pub fn credit_answer(&self, now: Instant) -> Option<(u16, bytes::Bytes)> {
        self.unavailable(now)?;
        let kept = self.out_of_credit.lock();
        kept.as_ref()
            .filter(|(until, _, _)| now < *until)
            .map(|(_, status, body)| (*status, body.clone()))
    }

    /// Why the account's targets may not be tried now, if so.
    #[must_use]
    pub fn unavailable(&self, now: Instant) -> Option<Unavailable> {
        let c = *self.cooldown.lock();
        c.filter(|(until, _)| now < *until)
            .map(|(until, rate_limited)| Unavailable::CoolingDown {
                until,
                rate_limited,
            })
    }
}

/// A target's identity: what health follows across reloads. Renaming a
/// target keeps it; pointing it at another URL or model starts it fresh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TargetId {
    /// The provider's `base_url`, without a trailing slash.
    pub base_url: String,
    /// The upstream model name.
    pub model: String,
}

/// Where a target's health lives across reloads: keyed by identity.
#[derive(Debug, Default)]
pub struct Registry {
    by_identity: Mutex<HashMap<TargetId, Arc<TargetHealth>>>,
}

impl Registry {
    /// The health of the target `id`, created HEALTHY the first time that
    /// identity is seen.
    pub fn get(&self, id: &TargetId) -> Arc<TargetHealth> {
        let mut map = self.by_identity.lock();
        Arc::clone(
            map.entry(id.clone())
                .or_insert_with(|| Arc::new(TargetHealth::new(Instant::now()))),
        )
    }

    /// Forgets identities no snapshot uses any more (only the registry holds them).
    pub fn prune(&self) {
        self.by_identity
            .lock()
            .retain(|_, h| Arc::strong_count(h) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(class: &str) -> Failure {
        Failure {
            counted: true,
            cooldown: None,
            rate_limited: false,
            class: Arc::from(class),
            jitter: 0.0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn thresholds_then_trial_then_recovery() {
        let cfg = HealthConfig::default();
        let h = Arc::new(TargetHealth::new(Instant::now()));
        let mut transitions = Vec::new();
        for _ in 0..5 {
            let p = h.admit(Instant::now()).unwrap();
            transitions.extend(h.record_failure(p, Instant::now(), &fail("x"), &cfg));
        }
        assert_eq!(
            transitions,
            vec![
                Transition {
                    from: State::Healthy,
                    to: State::Degraded
                },
                Transition {
                    from: State::Degraded,
                    to: State::Down
                },
            ]
        );
        assert!(matches!(
            h.admit(Instant::now()).unwrap_err(),
            Unavailable::Down { .. }
        ));
        tokio::time::advance(Duration::from_secs(20)).await;
        let trial = h.admit(Instant::now()).unwrap();
        assert!(trial.trial);
        assert!(
            matches!(
                h.admit(Instant::now()).unwrap_err(),
                Unavailable::Down { .. }
            ),
            "single flight"
        );
        let t = h.record_success(trial, Instant::now(), &cfg);
        assert_eq!(
            t,
            Some(Transition {
                from: State::Down,
                to: State::Healthy
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failed_trial_restarts_the_timer_and_dropped_trial_frees_the_slot() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        let p = h.admit(Instant::now()).unwrap();
        h.record_failure(p, Instant::now(), &fail("x"), &cfg);
        tokio::time::advance(Duration::from_secs(21)).await;
        drop(h.admit(Instant::now()).unwrap());
        let trial = h.admit(Instant::now()).unwrap();
        assert!(trial.trial);
        h.record_failure(trial, Instant::now(), &fail("x"), &cfg);
        tokio::time::advance(Duration::from_secs(19)).await;
        assert!(h.admit(Instant::now()).is_err());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(h.admit(Instant::now()).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn jitter_stays_within_twenty_percent() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        for jitter in [-1.0, -0.5, 0.0, 0.7, 1.0, 5.0] {
            let h = Arc::new(TargetHealth::new(Instant::now()));
            let p = h.admit(Instant::now()).unwrap();
            let f = Failure {
                jitter,
                ..fail("x")
            };
            h.record_failure(p, Instant::now(), &f, &cfg);
            let wait = h.view(Instant::now(), &cfg).next_trial_in.unwrap();
            assert!(
                wait >= Duration::from_secs(16) && wait <= Duration::from_secs(24),
                "{wait:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn uncounted_failures_only_cool_down() {
        let cfg = HealthConfig::default();
        let h = Arc::new(TargetHealth::new(Instant::now()));
        for _ in 0..10 {
            if let Ok(p) = h.admit(Instant::now()) {
                let f = Failure {
                    counted: false,
                    cooldown: Some(Duration::from_secs(2)),
                    rate_limited: true,
                    ..fail("429")
                };
                h.record_failure(p, Instant::now(), &f, &cfg);
            }
        }
        assert_eq!(h.state(), State::Healthy);
        assert!(matches!(
            h.admit(Instant::now()).unwrap_err(),
            Unavailable::CoolingDown {
                rate_limited: true,
                ..
            }
        ));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(h.admit(Instant::now()).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn failure_rate_over_the_window_degrades_and_expires() {
        let cfg = HealthConfig {
            min_requests: 4,
            failure_rate: 0.5,
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        // fail, ok, fail, ok: never 3 in a row, but half of 4 failed.
        let mut last = None;
        for i in 0..4 {
            let p = h.admit(Instant::now()).unwrap();
            last = if i % 2 == 0 {
                h.record_failure(p, Instant::now(), &fail("x"), &cfg)
            } else {
                h.record_success(p, Instant::now(), &cfg)
            }
            .or(last);
        }
        assert_eq!(h.state(), State::Degraded, "{last:?}");
        assert_eq!(h.view(Instant::now(), &cfg).window_requests, 4);
        tokio::time::advance(Duration::from_secs(31)).await;
        let p = h.admit(Instant::now()).unwrap();
        h.record_success(p, Instant::now(), &cfg);
        assert_eq!(h.state(), State::Healthy, "old outcomes left the window");
    }

    #[tokio::test(start_paused = true)]
    async fn probes_restore_reachable_down_targets_only() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        let interval = Duration::from_secs(60);
        assert!(
            !h.claim_probe(Instant::now(), interval),
            "healthy targets are not probed"
        );
        let p = h.admit(Instant::now()).unwrap();
        h.record_failure(p, Instant::now(), &fail("x"), &cfg);
        assert!(!h.claim_probe(Instant::now(), interval));
        tokio::time::advance(interval).await;
        assert!(h.claim_probe(Instant::now(), interval));
        assert!(
            !h.claim_probe(Instant::now(), interval),
            "one probe per interval"
        );
        assert_eq!(h.record_probe(Instant::now(), false), None);
        tokio::time::advance(interval).await;
        assert!(h.claim_probe(Instant::now(), interval));
        let t = h.record_probe(Instant::now(), true);
        assert_eq!(
            t,
            Some(Transition {
                from: State::Down,
                to: State::Healthy
            })
        );
        assert!(h.admit(Instant::now()).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn single_flight_trial_under_concurrency() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        let p = h.admit(Instant::now()).unwrap();
        h.record_failure(p, Instant::now(), &fail("x"), &cfg);
        tokio::time::advance(Duration::from_secs(30)).await;
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let h = Arc::clone(&h);
            tasks.push(tokio::spawn(async move { h.admit(Instant::now()).ok() }));
        }
        let mut held = Vec::new();
        for t in tasks {
            held.extend(t.await.unwrap());
        }
        assert_eq!(held.len(), 1);
        assert!(held[0].trial);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_window_forgets_a_degraded_target() {
        let cfg = HealthConfig {
            min_requests: 2,
            window: Duration::from_secs(5),
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        for _ in 0..2 {
            let p = h.admit(Instant::now()).unwrap();
            h.record_failure(p, Instant::now(), &fail("x"), &cfg);
        }
        assert_eq!(h.state(), State::Degraded, "two of two failed");
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(h.forget(Instant::now(), &cfg), None, "not quiet yet");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(
            h.forget(Instant::now(), &cfg),
            Some(Transition {
                from: State::Degraded,
                to: State::Healthy
            })
        );
        assert_eq!(h.view(Instant::now(), &cfg).consecutive_failures, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cooldown_holds_back_trials_and_probes_and_says_its_kind() {
        let cfg = HealthConfig {
            down_after: 1,
            open_for: Duration::from_secs(1),
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        let p = h.admit(Instant::now()).unwrap();
        let f = Failure {
            cooldown: Some(Duration::from_secs(7)),
            rate_limited: true,
            ..fail("429")
        };
        h.record_failure(p, Instant::now(), &f, &cfg);
        tokio::time::advance(Duration::from_secs(2)).await;
        let now = Instant::now();
        assert!(h.force_trial(now).is_none(), "the upstream asked for 7 s");
        assert!(!h.claim_probe(now, Duration::from_millis(1)));
        let Some(Unavailable::CoolingDown {
            until,
            rate_limited: true,
        }) = h.unavailable(now)
        else {
            panic!("{:?}", h.unavailable(now))
        };
        assert_eq!(until - now, Duration::from_secs(5));
        // Another rule's pause on top is not "only a rate limit" any more.
        let p = h.force_trial(now + Duration::from_secs(6));
        assert!(p.is_some());
        let f = Failure {
            counted: false,
            cooldown: Some(Duration::from_secs(60)),
            rate_limited: false,
            ..fail("401")
        };
        h.record_failure(p.unwrap(), now, &f, &cfg);
        assert!(matches!(
            h.unavailable(now),
            Some(Unavailable::CoolingDown {
                rate_limited: false,
                ..
            })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_revoked_key_is_reprobed_with_a_doubling_backoff_and_comes_back() {
        let (first, max) = (Duration::from_secs(60), Duration::from_secs(1800));
        let k = KeyHealth::default();
        assert!(!k.claim_reprobe(Instant::now(), first, max), "a usable key");
        k.record(Instant::now(), None, true, false, "m");
        assert!(!k.claim_reprobe(Instant::now(), first, max), "scheduled");
        let mut waits = Vec::new();
        let mut last = Instant::now();
        for _ in 0..8 {
            let mut steps = 0;
            while !k.claim_reprobe(Instant::now(), first, max) {
                tokio::time::advance(Duration::from_secs(1)).await;
                steps += 1;
                assert!(steps < 4000, "a re-probe is due in time");
            }
            assert!(
                !k.claim_reprobe(Instant::now(), first, max),
                "one at a time"
            );
            waits.push((Instant::now() - last).as_secs());
            last = Instant::now();
            assert!(!k.record_reprobe(Instant::now(), false, max));
            assert_eq!(k.state(Instant::now()), KeyState::Dead);
        }
        assert_eq!(waits, [60, 120, 240, 480, 960, 1800, 1800, 1800]);
        while !k.claim_reprobe(Instant::now(), first, max) {
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        let since = k.shared_view().since;
        assert!(k.record_reprobe(Instant::now(), true, max));
        assert_eq!(k.state(Instant::now()), KeyState::Usable);
        assert!(k.shared_view().since > since, "a newer verdict, to share");
        // Revoked again, it starts over at the first wait.
        k.record(Instant::now(), None, true, false, "m");
        assert!(!k.claim_reprobe(Instant::now(), first, max));
        tokio::time::advance(first).await;
        assert!(k.claim_reprobe(Instant::now(), first, max));
    }

    #[test]
    fn ttft_quantiles_need_enough_samples() {
        let h = TargetHealth::new(Instant::now());
        for ms in 1..=19 {
            h.record_latency(Instant::now(), Duration::from_millis(ms * 10));
        }
        assert_eq!(h.ttft_quantile(0.95), None);
        h.record_latency(Instant::now(), Duration::from_millis(200));
        let p95 = h.ttft_quantile(0.95).unwrap();
        assert!(
            p95 >= Duration::from_millis(189) && p95 <= Duration::from_millis(201),
            "{p95:?}"
        );
        let p50 = h.ttft_quantile(0.5).unwrap();
        assert!(
            p50 >= Duration::from_millis(99) && p50 <= Duration::from_millis(111),
            "{p50:?}"
        );
    }
}
