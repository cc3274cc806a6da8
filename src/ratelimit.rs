//! Token buckets (governor): a task's client-facing buckets (task-wide and
//! per caller, each at its own rate), and a provider account's requests- and
//! tokens-per-minute buckets (checked apart from charged: a call is charged
//! only when it is sent).
//! Routing asks them; it never keeps counts of its own.
//!
//! With `shared_state`, a provider's (or key's) buckets live in the shared
//! store and this replica spends an [`Allowance`] leased from them in small
//! blocks by the background keeper ([`ProviderLimits::plan_lease`],
//! [`ProviderLimits::granted`]); `admit` only ever touches the local
//! allowance. While the store is away the local governor buckets apply.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota};
use parking_lot::Mutex;
use tokio::time::Instant;

fn quota(per: Duration, burst: u32) -> Option<Quota> {
    Some(Quota::with_period(per)?.allow_burst(NonZeroU32::new(burst.max(1))?))
}

/// A provider account's request and token buckets.
#[derive(Debug)]
pub struct ProviderLimits {
    /// The local rpm and tpm buckets.
    local: Mutex<Local>,
    /// The buckets' sizes, for the shared ones.
    spec: LimitSpec,
    /// Who these buckets are in the shared store (the same on every replica).
    identity: u64,
    /// What this replica leased from the shared buckets.
    shared: Mutex<Allowance>,
}

/// One bucket's size: `capacity` at once, refilled by `per_minute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Most at once (a full bucket).
    pub capacity: u64,
    /// Refill per minute.
    pub per_minute: u64,
}

/// A limiter's buckets: requests (rpm, with its burst) and tokens (tpm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitSpec {
    /// `rpm`, `burst`.
    pub requests: Option<Bucket>,
    /// `tpm`.
    pub tokens: Option<Bucket>,
}

/// Requests and tokens: held, asked for, leased or given back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pair {
    /// Requests.
    pub requests: u64,
    /// Tokens.
    pub tokens: u64,
}

/// What the keeper asks of the shared buckets: blocks to lease, and what an
/// idle replica gives back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    /// To take from the shared buckets.
    pub take: Pair,
    /// To put back (already taken out of the allowance).
    pub give_back: Pair,
}

/// How long an allowance must sit unused before its surplus goes back.
const IDLE_BEFORE_GIVING_BACK: Duration = Duration::from_secs(1);
/// Ticks of demand the lease is sized by (about a second of 50 ms ticks).
const PEAK_TICKS: usize = 20;
/// A lease holds at least the bucket's refill over this long (two keeper
/// ticks), so a replica's standing share of a fast bucket is not one request.
const REFILL_HEADROOM_MS: u64 = 100;
/// The wait a refused request is told at least: about one keeper tick.
const MIN_SHARED_WAIT: Duration = Duration::from_millis(50);

/// The part of the shared buckets this replica holds.
#[derive(Debug, Default)]
struct Allowance {
    /// The store is connected: admit from here, not from governor.
    on: bool,
    /// Leased and not yet spent.
    held: Pair,
    /// Asked for since the keeper last looked (admitted or not).
    demand: Pair,
    /// The demand of the keeper's last [`PEAK_TICKS`] ticks (a ring), whose
    /// busiest tick sizes the lease: one quiet tick must not shrink it.
    recent: [Pair; PEAK_TICKS],
    /// The ring's next slot.
    slot: usize,
    /// The largest token ask seen (one request must fit the allowance).
    largest: u64,
    /// Tokens the upstream reported beyond the estimate (or spent beyond
    /// the allowance), still to charge.
    debt: u64,
    /// Requests spent beyond the allowance, still to charge.
    owed: u64,
    /// The shared buckets' last word on when they have tokens again.
    wait: Duration,
    /// Since when nothing was asked.
    idle_since: Option<Instant>,
}

impl ProviderLimits {
    /// Buckets for `rpm` requests and `tpm` tokens a minute; `burst` requests at once.
    #[must_use]
    pub fn new(rpm: Option<u32>, tpm: Option<u32>, burst: Option<u32>) -> Self {
        let spec = LimitSpec {
            requests: rpm.map(|n| Bucket {
                capacity: u64::from(burst.unwrap_or(n).max(1)),
                per_minute: u64::from(n.max(1)),
            }),
            tokens: tpm.map(|n| Bucket {
                capacity: u64::from(n.max(1)),
                per_minute: u64::from(n.max(1)),
            }),
        };
        Self {
            local: Mutex::new(Local {
                requests: spec.requests.map(Gcra::new),
                tokens: spec.tokens.map(Gcra::new),
            }),
            spec,
            identity: 0,
            shared: Mutex::new(Allowance::default()),
        }
    }

    /// The same buckets, known in the shared store as `identity` (a hash of
    /// the account or key and its limits: the same on every replica).
    #[must_use]
    pub fn identified(mut self, identity: u64) -> Self {
        self.identity = identity;
        self
    }

    /// Who these buckets are in the shared store.
    #[must_use]
    pub fn identity(&self) -> u64 {
        self.identity
    }

    /// The buckets' sizes.
    #[must_use]
    pub fn spec(&self) -> LimitSpec {
        self.spec
    }

    /// Takes one request and `tokens` tokens from the buckets, unless either
    /// cannot admit them now: [`check`](Self::check) then
    /// [`charge`](Self::charge).
    ///
    /// # Errors
    /// How long until the buckets could admit the request.
    pub fn admit(&self, tokens: u64) -> Result<(), Duration> {
        self.check(tokens)?;
        self.charge(tokens);
        Ok(())
    }

    /// Whether one request of `tokens` tokens fits every bucket now, taking
    /// nothing: a target is checked against all its buckets (provider and
    /// key, requests and tokens) first, and charged only when the call is
    /// sent ([`charge`](Self::charge)). With the shared store connected,
    /// against this replica's allowance (and counted as its demand).
    ///
    /// # Errors
    /// How long until the buckets could admit the request.
    pub fn check(&self, tokens: u64) -> Result<(), Duration> {
        self.check_keeping(tokens, 0.0)
    }

    /// As [`check`](Self::check), keeping `reserve` (a share of each local
    /// bucket, rounded up) for critical work: a call that would leave less
    /// than that does not fit. The shared allowance keeps no reserve (it is
    /// this replica's lease, not the bucket).
    ///
    /// # Errors
    /// How long until the buckets could admit the request and keep the reserve.
    pub fn check_keeping(&self, tokens: u64, reserve: f64) -> Result<(), Duration> {
        {
            let mut shared = self.shared.lock();
            if shared.on {
                return shared.check(&self.spec, tokens);
            }
        }
        let local = self.local.lock();
        let now = Instant::now();
        let keep = |b: &Gcra| {
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let kept = (b.capacity as f64 * reserve.clamp(0.0, 1.0)).ceil() as u64;
            kept
        };
        let requests = local.requests.map_or(Ok(()), |b| b.fits(now, 1 + keep(&b)));
        let tokens = local
            .tokens
            .map_or(Ok(()), |b| b.fits(now, tokens.max(1) + keep(&b)));
        match (requests, tokens) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(a), Err(b)) => Err(a.max(b)),
            (Err(wait), Ok(())) | (Ok(()), Err(wait)) => Err(wait),
        }
    }

    /// Spends one request and `tokens` tokens: a call is being sent. Never
    /// refuses (a call checked a moment ago by a concurrent request may
    /// overdraw a bucket a little; the overdraft delays the next ones).
    pub fn charge(&self, tokens: u64) {
        {
            let mut shared = self.shared.lock();
            if shared.on {
                shared.spend(&self.spec, tokens);
                return;
            }
        }
        let mut local = self.local.lock();
        let now = Instant::now();
        if let Some(b) = &mut local.requests {
            b.spend(now, 1);
        }
        if let Some(b) = &mut local.tokens {
            b.spend(now, tokens.max(1));
        }
    }

    /// Charges tokens the upstream reported beyond the estimate (best effort:
    /// a bucket cannot be refunded when the estimate was high).
    pub fn correct(&self, extra_tokens: u64) {
        {
            let mut shared = self.shared.lock();
            if shared.on {
                if self.spec.tokens.is_some() {
                    let paid = shared.held.tokens.min(extra_tokens);
                    shared.held.tokens -= paid;
                    shared.debt = shared.debt.saturating_add(extra_tokens - paid);
                }
                return;
            }
        }
        if extra_tokens > 0 {
            if let Some(b) = &mut self.local.lock().tokens {
                b.spend(Instant::now(), extra_tokens);
            }
        }
    }
}

/// The local buckets (while the shared store is away, or without one).
#[derive(Debug, Default)]
struct Local {
    requests: Option<Gcra>,
    tokens: Option<Gcra>,
}

/// One token bucket as a generic cell rate algorithm: each unit costs
/// `interval`; `capacity` units at once. Checking and spending are apart,
/// so several buckets can all be checked before any is charged.
#[derive(Debug, Clone, Copy)]
struct Gcra {
    interval: Duration,
    capacity: u64,
    /// The theoretical arrival time: when the bucket is full again.
    tat: Option<Instant>,
}

impl Gcra {
    fn new(b: Bucket) -> Self {
        Self {
            interval: Duration::from_secs(60)
                / u32::try_from(b.per_minute.max(1)).unwrap_or(u32::MAX),
            capacity: b.capacity.max(1),
            tat: None,
        }
    }

    fn cost(&self, n: u64) -> Duration {
        self.interval
            .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Whether `n` units fit now; else how long until they do.
    fn fits(&self, now: Instant, n: u64) -> Result<(), Duration> {
        if n > self.capacity {
            // More than the bucket holds: it never fits.
            return Err(Duration::from_secs(60));
        }
        let tat = self.tat.map_or(now, |t| t.max(now));
        let full = self.cost(self.capacity);
        let after = tat + self.cost(n);
        match (after - now).checked_sub(full) {
            Some(wait) if !wait.is_zero() => Err(wait),
            Some(_) | None => Ok(()),
        }
    }

    /// Spends `n` units (perhaps beyond the bucket: later ones wait longer).
    fn spend(&mut self, now: Instant, n: u64) {
        let tat = self.tat.map_or(now, |t| t.max(now));
        self.tat = Some(tat + self.cost(n));
    }
}

impl ProviderLimits {
    /// Switches between the shared buckets (`on`: the store is connected)
    /// and the local ones. Either way the allowance starts empty: leased
    /// tokens are the shared buckets', and a replica off the store has no
    /// claim on them.
    pub fn set_shared(&self, on: bool) {
        let mut shared = self.shared.lock();
        if shared.on != on {
            *shared = Allowance {
                on,
                ..Allowance::default()
            };
        }
    }

    /// Whether requests are admitted from the shared allowance.
    #[must_use]
    pub fn shared_on(&self) -> bool {
        self.shared.lock().on
    }

    /// The keeper's next lease, from this replica's demand: keep twice its
    /// busiest tick of the last second, at least two ticks of the bucket's
    /// refill and one request of the largest size seen, at most a tenth of
    /// the bucket (so idle replicas hoard little); take what is missing (and
    /// any token debt), and give back a surplus that sat unused for a second.
    pub fn plan_lease(&self, now: Instant) -> Lease {
        let mut a = self.shared.lock();
        if !a.on {
            return Lease::default();
        }
        let tick = std::mem::take(&mut a.demand);
        let slot = a.slot;
        a.recent[slot] = tick;
        a.slot = (slot + 1) % PEAK_TICKS;
        let demand = Pair {
            requests: a.recent.iter().map(|p| p.requests).max().unwrap_or(0),
            tokens: a.recent.iter().map(|p| p.tokens).max().unwrap_or(0),
        };
        if tick == Pair::default() {
            a.idle_since.get_or_insert(now);
        } else {
            a.idle_since = None;
        }
        let idle = a
            .idle_since
            .is_some_and(|t| now.saturating_duration_since(t) >= IDLE_BEFORE_GIVING_BACK);
        let mut lease = Lease::default();
        if let Some(b) = self.spec.requests {
            let (take, back) = block(b, 1, demand.requests, a.held.requests, idle);
            lease.take.requests = take.saturating_add(a.owed);
            lease.give_back.requests = back;
        }
        if let Some(b) = self.spec.tokens {
            let (take, back) = block(b, a.largest.max(1), demand.tokens, a.held.tokens, idle);
            lease.take.tokens = take.saturating_add(a.debt);
            lease.give_back.tokens = back;
        }
        a.held.requests -= lease.give_back.requests;
        a.held.tokens -= lease.give_back.tokens;
        lease
    }

    /// Adds what the shared buckets granted of a lease (perhaps less than
    /// asked), and their word on when they have tokens again.
    pub fn granted(&self, granted: Pair, wait: Duration) {
        let mut a = self.shared.lock();
        if !a.on {
            return;
        }
        let paid = a.debt.min(granted.tokens);
        a.debt -= paid;
        let owed = a.owed.min(granted.requests);
        a.owed -= owed;
        a.held.requests = a.held.requests.saturating_add(granted.requests - owed);
        a.held.tokens = a.held.tokens.saturating_add(granted.tokens - paid);
        a.wait = wait;
    }
}

/// One bucket's block: (to take, to give back), keeping twice the busiest
/// tick's `demand`, at least `floor` and the bucket's refill over
/// [`REFILL_HEADROOM_MS`] (what an idle replica keeps standing), at most a
/// tenth of the bucket (or `floor`).
fn block(b: Bucket, floor: u64, demand: u64, held: u64, idle: bool) -> (u64, u64) {
    let cap = (b.capacity / 10).max(floor.min(b.capacity));
    let floor = floor
        .max(b.per_minute.div_ceil(60_000 / REFILL_HEADROOM_MS))
        .min(cap);
    let want = demand.saturating_mul(2).clamp(floor, cap);
    if held < want {
        (want - held, 0)
    } else if idle && held > floor {
        (0, held - floor)
    } else {
        (0, 0)
    }
}

impl Allowance {
    /// What one request of `tokens` tokens takes of the allowance.
    fn need(spec: &LimitSpec, tokens: u64) -> Pair {
        Pair {
            requests: u64::from(spec.requests.is_some()),
            tokens: if spec.tokens.is_some() {
                tokens.max(1)
            } else {
                0
            },
        }
    }

    /// Whether the allowance holds one request and `tokens` tokens (counted
    /// as demand either way); spends nothing.
    fn check(&mut self, spec: &LimitSpec, tokens: u64) -> Result<(), Duration> {
        let need = Self::need(spec, tokens);
        if spec.tokens.is_some_and(|b| need.tokens > b.capacity) {
            // More tokens than a minute's worth: it never fits.
            return Err(Duration::from_secs(60));
        }
        self.demand.requests += need.requests;
        self.demand.tokens = self.demand.tokens.saturating_add(need.tokens);
        self.largest = self.largest.max(need.tokens);
        if self.held.requests >= need.requests && self.held.tokens >= need.tokens {
            return Ok(());
        }
        Err(self.wait.max(MIN_SHARED_WAIT))
    }

    /// Spends one request and `tokens` tokens of the allowance; what it
    /// does not hold is owed, taken from the next grants.
    fn spend(&mut self, spec: &LimitSpec, tokens: u64) {
        let need = Self::need(spec, tokens);
        let requests = self.held.requests.min(need.requests);
        self.held.requests -= requests;
        self.owed = self.owed.saturating_add(need.requests - requests);
        let paid = self.held.tokens.min(need.tokens);
        self.held.tokens -= paid;
        self.debt = self.debt.saturating_add(need.tokens - paid);
    }
}

/// One bucket's rate: `rps` sustained (fractional allowed), `burst` at once
/// (default: `rps` rounded up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Sustained requests per second.
    pub rps: f64,
    /// Requests allowed at once; `None` for `rps` rounded up.
    pub burst: Option<u32>,
}

impl Rate {
    /// Whether a bucket can hold this rate: positive, and neither so slow
    /// nor so fast that the time between two tokens is not a `Duration`.
    #[must_use]
    pub fn is_usable(self) -> bool {
        self.quota().is_some()
    }

    /// The governor quota, `None` for a rate that is not usable.
    fn quota(self) -> Option<Quota> {
        if !(self.rps.is_finite() && self.rps > 0.0) {
            return None;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let burst = self
            .burst
            .unwrap_or_else(|| self.rps.ceil().min(f64::from(u32::MAX)) as u32);
        // `from_secs_f64` would panic on a period too long to represent.
        quota(Duration::try_from_secs_f64(1.0 / self.rps).ok()?, burst)
    }
}

/// Who a per-caller bucket belongs to. The two kinds never share a bucket,
/// so a header value that spells an address cannot drain that address's bucket.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Caller {
    /// The value of the caller header (at most 256 characters).
    Header(String),
    /// The client's address, for requests without the header.
    Addr(IpAddr),
}

/// The per-caller buckets of a task.
#[derive(Debug)]
struct Callers {
    header: http::HeaderName,
    buckets: DefaultKeyedRateLimiter<Caller>,
    max: usize,
}

/// A task's client-facing buckets: optionally one for the whole task, and
/// optionally one per caller, each with its own rate.
#[derive(Debug)]
pub struct TaskLimiter {
    all: Option<DefaultDirectRateLimiter>,
    per_caller: Option<Callers>,
}

impl TaskLimiter {
    /// A task-wide bucket at `task` (if any) and, if `per_caller` is given,
    /// one bucket per value of its header at its own rate, at most
    /// `max_callers` tracked. `None` when a given rate is not positive or
    /// neither bucket is asked for.
    #[must_use]
    pub fn new(
        task: Option<Rate>,
        per_caller: Option<(http::HeaderName, Rate, usize)>,
    ) -> Option<Self> {
        let all = match task {
            Some(rate) => Some(governor::RateLimiter::direct(rate.quota()?)),
            None => None,
        };
        let per_caller = match per_caller {
            Some((header, rate, max)) => Some(Callers {
                header,
                buckets: governor::RateLimiter::keyed(rate.quota()?),
                max: max.max(1),
            }),
            None => None,
        };
        (all.is_some() || per_caller.is_some()).then_some(Self { all, per_caller })
    }

    /// Admits one request from `peer`, or says how long to wait (for
    /// `Retry-After`). The caller's own bucket is asked first: a caller over
    /// its limit is refused without taking anything from the task-wide bucket,
    /// so it cannot starve other callers. A request without the caller header
    /// (or with an empty one) is keyed by `peer`.
    ///
    /// # Errors
    /// The wait until the bucket admits a request, and which bucket (`task` or `caller`).
    pub fn admit(
        &self,
        headers: &http::HeaderMap,
        peer: IpAddr,
    ) -> Result<(), (Duration, &'static str)> {
        let clock = governor::clock::DefaultClock::default();
        let wait = |not_until: governor::NotUntil<_>| {
            not_until.wait_time_from(governor::clock::Clock::now(&clock))
        };
        if let Some(callers) = &self.per_caller {
            let key = headers
                .get(&callers.header)
                .map(|v| {
                    String::from_utf8_lossy(v.as_bytes())
                        .chars()
                        .take(256)
                        .collect::<String>()
                })
                .filter(|v| !v.is_empty())
                .map_or_else(|| Caller::Addr(peer.to_canonical()), Caller::Header);
            if callers.buckets.len() >= callers.max {
                callers.buckets.retain_recent();
            }
            callers
                .buckets
                .check_key(&key)
                .map_err(|n| (wait(n), "caller"))?;
        }
        match &self.all {
            Some(all) => all.check().map_err(|n| (wait(n), "task")),
            None => Ok(()),
        }
    }
}

/// A batch task's queue: requests that found every target out of quota or
/// cooling down wait, in arrival order, for the earliest time one may serve
/// (no polling: each sleeps until then), at most `max_wait`.
#[derive(Debug)]
pub struct Queue {
    /// Longest wait of one request.
    pub max_wait: Duration,
    max_depth: usize,
    depth: std::sync::atomic::AtomicUsize,
    /// Whose turn it is: tokio's mutex hands itself over in arrival order.
    turn: tokio::sync::Mutex<()>,
    gauge: metrics::Gauge,
    waited: metrics::Histogram,
    full: metrics::Counter,
}

/// A place in a [`Queue`]; leaving it (drop) frees it.
#[derive(Debug)]
pub struct Place<'a>(&'a Queue);

impl Queue {
    /// An empty queue of at most `max_depth` waiting requests.
    #[must_use]
    pub fn new(
        max_wait: Duration,
        max_depth: u32,
        gauge: metrics::Gauge,
        (waited, full): (metrics::Histogram, metrics::Counter),
    ) -> Self {
        gauge.set(0.0);
        Self {
            max_wait,
            max_depth: usize::try_from(max_depth).unwrap_or(usize::MAX),
            depth: std::sync::atomic::AtomicUsize::new(0),
            turn: tokio::sync::Mutex::new(()),
            gauge,
            waited,
            full,
        }
    }

    /// A place in the queue; `None` when it is full.
    pub fn enter(&self) -> Option<Place<'_>> {
        use std::sync::atomic::Ordering;
        let taken = self
            .depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d < self.max_depth).then_some(d + 1)
            })
            .is_ok();
        if !taken {
            self.full.increment(1);
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        self.gauge.set(self.depth.load(Ordering::Acquire) as f64);
        Some(Place(self))
    }

    /// Waits for this place's turn, then until `until`.
    pub async fn wait_until(&self, _place: &Place<'_>, until: tokio::time::Instant) {
        let started = tokio::time::Instant::now();
        let _turn = self.turn.lock().await;
        tokio::time::sleep_until(until).await;
        self.waited.record(started.elapsed().as_secs_f64());
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        let left = self
            .0
            .depth
            .fetch_sub(1, Ordering::AcqRel)
            .saturating_sub(1);
        #[allow(clippy::cast_precision_loss)]
        self.0.gauge.set(left as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_buckets_admit_then_refuse() {
        let l = ProviderLimits::new(Some(60), None, Some(2));
        assert!(l.admit(10).is_ok() && l.admit(10).is_ok());
        let wait = l.admit(10).unwrap_err();
        assert!(wait <= Duration::from_secs(1), "burst of 2 spent: {wait:?}");
        let l = ProviderLimits::new(None, Some(1000), None);
        assert!(l.admit(900).is_ok());
        assert!(l.admit(200).is_err(), "tpm bucket has ~100 left");
    }

    #[tokio::test(start_paused = true)]
    async fn checking_takes_nothing_and_a_refused_bucket_charges_none() {
        let l = ProviderLimits::new(Some(60), Some(1000), Some(1));
        for _ in 0..5 {
            assert!(l.check(10).is_ok(), "checks spend nothing");
        }
        // The tpm bucket refuses: the rpm bucket is not charged either.
        assert!(l.check(2000).is_err());
        l.charge(10);
        let wait = l.check(10).unwrap_err();
        assert_eq!(wait, Duration::from_secs(1), "one request a second");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(l.check(10).is_ok());
        // A charge never refuses; an overdraft delays the next call.
        l.charge(10);
        l.charge(10);
        assert_eq!(l.check(10).unwrap_err(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_allowance_is_spent_only_by_charges() {
        let l = ProviderLimits::new(Some(600), None, Some(20));
        l.set_shared(true);
        l.granted(
            Pair {
                requests: 1,
                tokens: 0,
            },
            Duration::ZERO,
        );
        assert!(
            l.check(1).is_ok() && l.check(1).is_ok(),
            "checks spend nothing"
        );
        l.charge(1);
        assert!(l.check(1).is_err(), "the one leased request is spent");
        // Spent beyond the allowance: owed, taken from the next grant.
        l.charge(1);
        l.granted(
            Pair {
                requests: 1,
                tokens: 0,
            },
            Duration::ZERO,
        );
        assert!(l.check(1).is_err(), "the grant paid what was owed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_allowance_admits_only_what_was_leased() {
        let l = ProviderLimits::new(Some(600), Some(10_000), Some(100));
        l.set_shared(true);
        assert!(l.admit(10).is_err(), "nothing leased yet");
        let lease = l.plan_lease(Instant::now());
        assert_eq!(lease.take.requests, 2, "two ticks of a demand of 1");
        assert_eq!(lease.take.tokens, 20);
        l.granted(
            Pair {
                requests: 1,
                tokens: 20,
            },
            Duration::ZERO,
        );
        assert!(l.admit(10).is_ok());
        assert_eq!(
            l.admit(10).unwrap_err(),
            MIN_SHARED_WAIT,
            "the one request leased is spent"
        );
        // A reported overshoot is charged: from what is held, then as debt.
        l.correct(500);
        let lease = l.plan_lease(Instant::now());
        assert!(lease.take.tokens >= 490, "{lease:?}");
        // An idle replica gives back all but one request's worth.
        l.granted(
            Pair {
                requests: 9,
                tokens: 1000,
            },
            Duration::ZERO,
        );
        let _ = l.plan_lease(Instant::now());
        tokio::time::advance(IDLE_BEFORE_GIVING_BACK).await;
        let lease = l.plan_lease(Instant::now());
        assert_eq!(lease.give_back.requests, 8);
        assert!(lease.give_back.tokens > 0);
        // Off the store: the local buckets again, and nothing held.
        l.set_shared(false);
        assert!(l.admit(10).is_ok());
        assert_eq!(l.plan_lease(Instant::now()), Lease::default());
    }

    /// The keeper's tick against a bucket with room: what it asks is granted.
    fn tick(l: &ProviderLimits) {
        let lease = l.plan_lease(Instant::now());
        l.granted(lease.take, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_tick_does_not_shrink_the_lease_below_a_burst_of_traffic() {
        // 6000 rpm (100 a second), 100 at once; one replica sending about
        // 20 a second, unevenly: 0 to 3 requests a tick.
        let l = ProviderLimits::new(Some(6000), None, Some(100));
        l.set_shared(true);
        assert!(l.admit(0).is_err(), "nothing leased yet");
        tick(&l);
        let mut refused = 0;
        for n in [1, 0, 0, 3, 1, 0, 2, 0, 0, 0, 3, 1, 2, 0, 3] {
            for _ in 0..n {
                refused += usize::from(l.admit(0).is_err());
            }
            tick(&l);
        }
        assert_eq!(
            refused, 0,
            "a replica far under the limit is refused nothing"
        );
        // The standing allowance stays small: a tenth of the bucket at most.
        let held = l.shared.lock().held.requests;
        assert!(held <= 10, "{held}");
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn one_per_second() -> Rate {
        Rate {
            rps: 1.0,
            burst: Some(1),
        }
    }

    #[test]
    fn task_limiter_refuses_with_a_wait() {
        let l = TaskLimiter::new(Some(one_per_second()), None).unwrap();
        let h = http::HeaderMap::new();
        assert!(l.admit(&h, LOCAL).is_ok());
        let (wait, scope) = l.admit(&h, LOCAL).unwrap_err();
        assert_eq!(scope, "task");
        assert!(
            wait > Duration::from_millis(500) && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
    }

    fn caller(name: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert("x-caller", http::HeaderValue::from_str(name).unwrap());
        h
    }

    #[test]
    fn a_caller_over_its_limit_takes_nothing_from_the_task_bucket() {
        let per_caller = (
            http::HeaderName::from_static("x-caller"),
            one_per_second(),
            100,
        );
        let task = Rate {
            rps: 1.0,
            burst: Some(2),
        };
        let l = TaskLimiter::new(Some(task), Some(per_caller)).unwrap();
        assert!(l.admit(&caller("a"), LOCAL).is_ok());
        for _ in 0..10 {
            assert_eq!(l.admit(&caller("a"), LOCAL).unwrap_err().1, "caller");
        }
        assert!(
            l.admit(&caller("b"), LOCAL).is_ok(),
            "one task token left for b"
        );
        assert_eq!(l.admit(&caller("c"), LOCAL).unwrap_err().1, "task");
    }

    #[test]
    fn requests_without_the_header_are_keyed_by_address_apart_from_headers() {
        let per_caller = (
            http::HeaderName::from_static("x-caller"),
            one_per_second(),
            100,
        );
        let l = TaskLimiter::new(None, Some(per_caller)).unwrap();
        let none = http::HeaderMap::new();
        let other = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));
        assert!(l.admit(&none, LOCAL).is_ok());
        assert_eq!(l.admit(&none, LOCAL).unwrap_err().1, "caller");
        assert!(
            l.admit(&caller(""), other).is_ok(),
            "an empty header counts as none"
        );
        assert!(
            l.admit(&caller("127.0.0.1"), LOCAL).is_ok(),
            "a header value never shares an address's bucket"
        );
        let mapped = IpAddr::V6(std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped());
        assert_eq!(l.admit(&none, mapped).unwrap_err().1, "caller");
    }

    #[test]
    fn no_bucket_or_a_zero_rate_is_no_limiter() {
        assert!(TaskLimiter::new(None, None).is_none());
        let zero = Rate {
            rps: 0.0,
            burst: None,
        };
        assert!(TaskLimiter::new(Some(zero), None).is_none());
        for rps in [1e-300, 1e300] {
            let rate = Rate { rps, burst: None };
            assert!(!rate.is_usable(), "{rps}");
            assert!(TaskLimiter::new(Some(rate), None).is_none());
        }
    }
}
