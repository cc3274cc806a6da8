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
use std::sync::atomic::Ordering;
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

impl Pair {
    fn covers(self, need: Pair) -> bool {
        self.requests >= need.requests && self.tokens >= need.tokens
    }
}

/// Why the buckets refused a call, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Until the buckets could admit it.
    pub wait: Duration,
    /// Only the reserve kept for critical work is left: a critical call
    /// would fit.
    pub reserved: bool,
}

impl Refusal {
    fn limited(wait: Duration) -> Self {
        Self {
            wait,
            reserved: false,
        }
    }
}

/// One pool's part of a keeper tick: what to take from the shared
/// buckets, and what an idle replica gives back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Block {
    /// To take from the shared buckets.
    pub take: Pair,
    /// To put back (already taken out of the allowance).
    pub give_back: Pair,
}

/// What the keeper asks of the shared buckets: a block for any work (never
/// leased below the buckets' reserve) and one for critical work only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lease {
    /// For any work, above the reserve.
    pub any: Block,
    /// For critical work, from the reserve too.
    pub critical: Block,
    /// The reserve: what leases for any work leave in each bucket.
    pub kept: Pair,
}

impl Lease {
    /// Nothing to take or give back.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.any == Block::default() && self.critical == Block::default()
    }
}

/// Who asks the buckets for a call: critical work may spend the reserve
/// (and its own lease of it); other work leaves `reserve` of each bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spender {
    /// The share of each bucket kept for critical work (the config's `reserve`).
    pub reserve: f64,
    /// The task is `critical`.
    pub critical: bool,
}

impl Spender {
    /// Work that keeps no reserve (or a bucket without one).
    pub const ANY: Spender = Spender {
        reserve: 0.0,
        critical: false,
    };
}

/// What the shared buckets granted of a [`Lease`], and their word on when
/// they have tokens again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Grant {
    /// Of the block for any work.
    pub any: Pair,
    /// Of the block for critical work.
    pub critical: Pair,
    /// Until the emptier bucket has a token above its reserve.
    pub wait: Duration,
    /// Until the emptier bucket has a token at all.
    pub critical_wait: Duration,
    /// The reserve cut what was asked for any work.
    pub reserved: bool,
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
    /// Leased above the reserve: any work spends it.
    any: Pool,
    /// Leased for critical work (from the reserve too): only it spends it.
    critical: Pool,
    /// The next slot of the pools' demand rings.
    slot: usize,
    /// The largest token ask seen (one request must fit the allowance).
    largest: u64,
    /// Tokens the upstream reported beyond the estimate (or spent beyond
    /// the allowance), still to charge.
    debt: u64,
    /// Requests spent beyond the allowance, still to charge.
    owed: u64,
    /// The shared buckets' last word on when they have tokens again, above
    /// the reserve and at all.
    wait: Duration,
    critical_wait: Duration,
    /// The last lease for any work was cut by the reserve.
    reserved: bool,
}

/// Leased tokens of one kind, and the demand that sizes the lease.
#[derive(Debug, Default)]
struct Pool {
    /// Leased and not yet spent.
    held: Pair,
    /// Asked for since the keeper last looked (admitted or not).
    demand: Pair,
    /// The demand of the keeper's last [`PEAK_TICKS`] ticks (a ring), whose
    /// busiest tick sizes the lease: one quiet tick must not shrink it.
    recent: [Pair; PEAK_TICKS],
    /// Since when nothing was asked.
    idle_since: Option<Instant>,
}

impl Pool {
    /// Closes the tick into ring slot `slot`: the busiest recent tick, and
    /// whether the pool sat unused long enough to give its surplus back.
    fn tick(&mut self, slot: usize, now: Instant) -> (Pair, bool) {
        let tick = std::mem::take(&mut self.demand);
        self.recent[slot] = tick;
        if tick == Pair::default() {
            self.idle_since.get_or_insert(now);
        } else {
            self.idle_since = None;
        }
        let peak = Pair {
            requests: self.recent.iter().map(|p| p.requests).max().unwrap_or(0),
            tokens: self.recent.iter().map(|p| p.tokens).max().unwrap_or(0),
        };
        let idle = self
            .idle_since
            .is_some_and(|t| now.saturating_duration_since(t) >= IDLE_BEFORE_GIVING_BACK);
        (peak, idle)
    }

    /// Takes `give_back` out of what is held: it goes back to the store.
    fn give(&mut self, block: &Block) {
        self.held.requests -= block.give_back.requests;
        self.held.tokens -= block.give_back.tokens;
    }
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

    /// What each bucket keeps for critical work when `share` of it is
    /// reserved: rounded up.
    #[must_use]
    pub fn kept(&self, share: f64) -> Pair {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let of = |b: Option<Bucket>| b.map_or(0, |b| (b.capacity as f64 * share).ceil() as u64);
        Pair {
            requests: of(self.spec.requests),
            tokens: of(self.spec.tokens),
        }
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

    /// Whether one request of `tokens` tokens fits every bucket now, taking
    /// nothing: a target is checked against all its buckets (provider and
    /// key, requests and tokens) first, and charged only when the call is
    /// sent ([`charge`](Self::charge)). Only critical work may take a
    /// bucket below its reserve. With the shared store connected, against
    /// this replica's allowance (and counted as its demand).
    ///
    /// # Errors
    /// How long until the buckets could admit the request, and whether
    /// only the reserve held it back.
    pub fn check(&self, tokens: u64, who: Spender) -> Result<(), Refusal> {
        self.ask(tokens, who, true)
    }

    /// As [`check`](Self::check), counting no demand: for `explain`.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn peek(&self, tokens: u64, who: Spender) -> Result<(), Refusal> {
        self.ask(tokens, who, false)
    }

    fn ask(&self, tokens: u64, who: Spender, count: bool) -> Result<(), Refusal> {
        let kept = self.kept(who.reserve);
        let critical = who.critical && kept != Pair::default();
        {
            let mut shared = self.shared.lock();
            if shared.on {
                return shared.check(&self.spec, tokens, critical, count);
            }
        }
        self.check_local(tokens, if who.critical { Pair::default() } else { kept })
    }

    /// The local buckets' answer, keeping `kept` in each.
    fn check_local(&self, tokens: u64, kept: Pair) -> Result<(), Refusal> {
        let local = self.local.lock();
        let now = Instant::now();
        let fits = |keep: Pair| {
            let requests = local
                .requests
                .map_or(Ok(()), |b| b.fits(now, 1 + keep.requests));
            let tokens = local
                .tokens
                .map_or(Ok(()), |b| b.fits(now, tokens.max(1) + keep.tokens));
            match (requests, tokens) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(a), Err(b)) => Err(a.max(b)),
                (Err(wait), Ok(())) | (Ok(()), Err(wait)) => Err(wait),
            }
        };
        fits(kept).map_err(|wait| Refusal {
            wait,
            reserved: kept != Pair::default() && fits(Pair::default()).is_ok(),
        })
    }

    /// Spends one request and `tokens` tokens: a call is being sent. Never
    /// refuses (a call checked a moment ago by a concurrent request may
    /// overdraw a bucket a little; the overdraft delays the next ones).
    /// Critical work spends its own lease first.
    pub fn charge(&self, tokens: u64, critical: bool) {
        {
            let mut shared = self.shared.lock();
            if shared.on {
                shared.spend(&self.spec, tokens, critical);
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
                    let paid = shared.any.held.tokens.min(extra_tokens);
                    shared.any.held.tokens -= paid;
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

    /// The keeper's next lease, from this replica's demand: for each pool,
    /// keep twice its busiest tick of the last second, at least two ticks
    /// of the bucket's refill and one request of the largest size seen, at
    /// most a tenth of the bucket (so idle replicas hoard little); take
    /// what is missing (and any debt, with the block for any work), and
    /// give back a surplus that sat unused for a second. `reserve` is the
    /// share of each bucket leases for any work leave; the critical pool is
    /// leased only where there is one and `critical_work` (a critical task
    /// may call these buckets) keeps a standing share of it, so the first
    /// critical request waits for no tick; else it holds nothing.
    pub fn plan_lease(&self, now: Instant, reserve: f64, critical_work: bool) -> Lease {
        let kept = self.kept(reserve);
        let mut a = self.shared.lock();
        if !a.on {
            return Lease::default();
        }
        let slot = a.slot;
        a.slot = (slot + 1) % PEAK_TICKS;
        let (peak, idle) = a.any.tick(slot, now);
        let (critical_peak, critical_idle) = a.critical.tick(slot, now);
        let when = (critical_work, critical_idle);
        let mut lease = Lease {
            kept,
            ..Lease::default()
        };
        if let Some(b) = self.spec.requests {
            let (take, back) = block(b, 1, peak.requests, a.any.held.requests, idle);
            lease.any.take.requests = take.saturating_add(a.owed);
            lease.any.give_back.requests = back;
            if kept.requests > 0 {
                let held = a.critical.held.requests;
                let (take, back) = critical_block(b, 1, critical_peak.requests, held, when);
                lease.critical.take.requests = take;
                lease.critical.give_back.requests = back;
            }
        }
        if let Some(b) = self.spec.tokens {
            let floor = a.largest.max(1);
            let (take, back) = block(b, floor, peak.tokens, a.any.held.tokens, idle);
            lease.any.take.tokens = take.saturating_add(a.debt);
            lease.any.give_back.tokens = back;
            if kept.tokens > 0 {
                let held = a.critical.held.tokens;
                let (take, back) = critical_block(b, floor, critical_peak.tokens, held, when);
                lease.critical.take.tokens = take;
                lease.critical.give_back.tokens = back;
            }
        }
        a.any.give(&lease.any);
        a.critical.give(&lease.critical);
        lease
    }

    /// Adds what the shared buckets granted of a lease (perhaps less than
    /// asked), and their word on when they have tokens again.
    pub fn granted(&self, g: Grant) {
        let mut a = self.shared.lock();
        if !a.on {
            return;
        }
        let paid = a.debt.min(g.any.tokens);
        a.debt -= paid;
        let owed = a.owed.min(g.any.requests);
        a.owed -= owed;
        a.any.held.requests = a.any.held.requests.saturating_add(g.any.requests - owed);
        a.any.held.tokens = a.any.held.tokens.saturating_add(g.any.tokens - paid);
        a.critical.held.requests = a.critical.held.requests.saturating_add(g.critical.requests);
        a.critical.held.tokens = a.critical.held.tokens.saturating_add(g.critical.tokens);
        a.wait = g.wait;
        a.critical_wait = g.critical_wait;
        a.reserved = g.reserved;
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

/// The critical pool's block: as [`block`] while critical work is
/// `standing` (`idle`: its pool sat unused), else everything held goes back.
fn critical_block(
    b: Bucket,
    floor: u64,
    demand: u64,
    held: u64,
    (standing, idle): (bool, bool),
) -> (u64, u64) {
    if standing {
        block(b, floor, demand, held, idle)
    } else {
        (0, held)
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

    /// Whether the allowance holds one request and `tokens` tokens for
    /// this kind of work (counted as its pool's demand when `count`);
    /// spends nothing.
    fn check(
        &mut self,
        spec: &LimitSpec,
        tokens: u64,
        critical: bool,
        count: bool,
    ) -> Result<(), Refusal> {
        let need = Self::need(spec, tokens);
        if spec.tokens.is_some_and(|b| need.tokens > b.capacity) {
            // More tokens than a minute's worth: it never fits.
            return Err(Refusal::limited(Duration::from_secs(60)));
        }
        if count {
            let pool = if critical {
                &mut self.critical
            } else {
                &mut self.any
            };
            pool.demand.requests += need.requests;
            pool.demand.tokens = pool.demand.tokens.saturating_add(need.tokens);
            self.largest = self.largest.max(need.tokens);
        }
        if !critical {
            return if self.any.held.covers(need) {
                Ok(())
            } else {
                Err(Refusal {
                    wait: self.wait.max(MIN_SHARED_WAIT),
                    reserved: self.reserved,
                })
            };
        }
        let both = Pair {
            requests: self.any.held.requests + self.critical.held.requests,
            tokens: self
                .any
                .held
                .tokens
                .saturating_add(self.critical.held.tokens),
        };
        if both.covers(need) {
            return Ok(());
        }
        Err(Refusal::limited(self.critical_wait.max(MIN_SHARED_WAIT)))
    }

    /// Spends one request and `tokens` tokens of the allowance (critical
    /// work its own pool first); what it does not hold is owed, taken from
    /// the next grants.
    fn spend(&mut self, spec: &LimitSpec, tokens: u64, critical: bool) {
        let mut need = Self::need(spec, tokens);
        if critical {
            let pool = &mut self.critical.held;
            let requests = pool.requests.min(need.requests);
            let paid = pool.tokens.min(need.tokens);
            pool.requests -= requests;
            pool.tokens -= paid;
            need.requests -= requests;
            need.tokens -= paid;
        }
        let requests = self.any.held.requests.min(need.requests);
        self.any.held.requests -= requests;
        self.owed = self.owed.saturating_add(need.requests - requests);
        let paid = self.any.held.tokens.min(need.tokens);
        self.any.held.tokens -= paid;
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
/// (no polling: each sleeps until then), at most `max_wait`. The waiting
/// line itself outlives reloads (by task name), so a reload neither loses
/// its count nor lets a second line form beside it.
#[derive(Debug)]
pub struct Queue {
    /// Longest wait of one request.
    pub max_wait: Duration,
    max_depth: usize,
    line: std::sync::Arc<Line>,
}

/// The requests waiting in a task's queue: live state, kept across reloads.
#[derive(Debug)]
pub struct Line {
    depth: std::sync::atomic::AtomicUsize,
    /// Whose turn it is: tokio's mutex hands itself over in arrival order.
    turn: tokio::sync::Mutex<()>,
    gauge: metrics::Gauge,
    waited: metrics::Histogram,
    full: metrics::Counter,
}

impl Line {
    /// An empty line, shown by `gauge`, its waits in `waited`, its refusals in `full`.
    #[must_use]
    pub fn new(
        gauge: metrics::Gauge,
        (waited, full): (metrics::Histogram, metrics::Counter),
    ) -> Self {
        gauge.set(0.0);
        Self {
            depth: std::sync::atomic::AtomicUsize::new(0),
            turn: tokio::sync::Mutex::new(()),
            gauge,
            waited,
            full,
        }
    }
}

/// A place in a [`Queue`]; leaving it (drop) frees it.
#[derive(Debug)]
pub struct Place<'a>(&'a Line);

impl Queue {
    /// The queue of `line`, at most `max_depth` waiting, each at most `max_wait`.
    #[must_use]
    pub fn new(max_wait: Duration, max_depth: u32, line: std::sync::Arc<Line>) -> Self {
        Self {
            max_wait,
            max_depth: usize::try_from(max_depth).unwrap_or(usize::MAX),
            line,
        }
    }

    /// A place in the queue; `None` when it is full.
    pub fn enter(&self) -> Option<Place<'_>> {
        let line = &*self.line;
        let taken = line
            .depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d < self.max_depth).then_some(d + 1)
            })
            .is_ok();
        if !taken {
            line.full.increment(1);
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        line.gauge.set(line.depth.load(Ordering::Acquire) as f64);
        Some(Place(line))
    }

    /// Waits for this place's turn, then until `until`.
    pub async fn wait_until(&self, place: &Place<'_>, until: tokio::time::Instant) {
        let started = tokio::time::Instant::now();
        let _turn = place.0.turn.lock().await;
        tokio::time::sleep_until(until).await;
        place.0.waited.record(started.elapsed().as_secs_f64());
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
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

    /// Checks, then charges: what admission and the call do.
    fn admit(l: &ProviderLimits, tokens: u64) -> Result<(), Duration> {
        l.check(tokens, Spender::ANY).map_err(|r| r.wait)?;
        l.charge(tokens, false);
        Ok(())
    }

    #[test]
    fn provider_buckets_admit_then_refuse() {
        let l = ProviderLimits::new(Some(60), None, Some(2));
        assert!(admit(&l, 10).is_ok() && admit(&l, 10).is_ok());
        let wait = admit(&l, 10).unwrap_err();
        assert!(wait <= Duration::from_secs(1), "burst of 2 spent: {wait:?}");
        let l = ProviderLimits::new(None, Some(1000), None);
        assert!(admit(&l, 900).is_ok());
        assert!(admit(&l, 200).is_err(), "tpm bucket has ~100 left");
    }

    #[tokio::test(start_paused = true)]
    async fn checking_takes_nothing_and_a_refused_bucket_charges_none() {
        let l = ProviderLimits::new(Some(60), Some(1000), Some(1));
        for _ in 0..5 {
            assert!(l.check(10, Spender::ANY).is_ok(), "checks spend nothing");
        }
        // The tpm bucket refuses: the rpm bucket is not charged either.
        assert!(l.check(2000, Spender::ANY).is_err());
        l.charge(10, false);
        let wait = l.check(10, Spender::ANY).unwrap_err().wait;
        assert_eq!(wait, Duration::from_secs(1), "one request a second");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(l.check(10, Spender::ANY).is_ok());
        // A charge never refuses; an overdraft delays the next call.
        l.charge(10, false);
        l.charge(10, false);
        assert_eq!(
            l.check(10, Spender::ANY).unwrap_err().wait,
            Duration::from_secs(2)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_allowance_is_spent_only_by_charges() {
        let l = ProviderLimits::new(Some(600), None, Some(20));
        l.set_shared(true);
        l.granted(Grant {
            any: Pair {
                requests: 1,
                tokens: 0,
            },
            ..Grant::default()
        });
        assert!(
            l.check(1, Spender::ANY).is_ok() && l.check(1, Spender::ANY).is_ok(),
            "checks spend nothing"
        );
        l.charge(1, false);
        assert!(
            l.check(1, Spender::ANY).is_err(),
            "the one leased request is spent"
        );
        // Spent beyond the allowance: owed, taken from the next grant.
        l.charge(1, false);
        l.granted(Grant {
            any: Pair {
                requests: 1,
                tokens: 0,
            },
            ..Grant::default()
        });
        assert!(
            l.check(1, Spender::ANY).is_err(),
            "the grant paid what was owed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_allowance_admits_only_what_was_leased() {
        let l = ProviderLimits::new(Some(600), Some(10_000), Some(100));
        l.set_shared(true);
        assert!(admit(&l, 10).is_err(), "nothing leased yet");
        let lease = l.plan_lease(Instant::now(), 0.0, false);
        assert_eq!(lease.any.take.requests, 2, "two ticks of a demand of 1");
        assert_eq!(lease.any.take.tokens, 20);
        l.granted(Grant {
            any: Pair {
                requests: 1,
                tokens: 20,
            },
            ..Grant::default()
        });
        assert!(admit(&l, 10).is_ok());
        assert_eq!(
            admit(&l, 10).unwrap_err(),
            MIN_SHARED_WAIT,
            "the one request leased is spent"
        );
        // A reported overshoot is charged: from what is held, then as debt.
        l.correct(500);
        let lease = l.plan_lease(Instant::now(), 0.0, false);
        assert!(lease.any.take.tokens >= 490, "{lease:?}");
        // An idle replica gives back all but one request's worth.
        l.granted(Grant {
            any: Pair {
                requests: 9,
                tokens: 1000,
            },
            ..Grant::default()
        });
        let _ = l.plan_lease(Instant::now(), 0.0, false);
        tokio::time::advance(IDLE_BEFORE_GIVING_BACK).await;
        let lease = l.plan_lease(Instant::now(), 0.0, false);
        assert_eq!(lease.any.give_back.requests, 8);
        assert!(lease.any.give_back.tokens > 0);
        // Off the store: the local buckets again, and nothing held.
        l.set_shared(false);
        assert!(admit(&l, 10).is_ok());
        assert_eq!(l.plan_lease(Instant::now(), 0.0, false), Lease::default());
    }

    /// The keeper's tick against a bucket with room: what it asks is granted.
    fn tick(l: &ProviderLimits) {
        let lease = l.plan_lease(Instant::now(), 0.0, false);
        l.granted(Grant {
            any: lease.any.take,
            ..Grant::default()
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_tick_does_not_shrink_the_lease_below_a_burst_of_traffic() {
        // 6000 rpm (100 a second), 100 at once; one replica sending about
        // 20 a second, unevenly: 0 to 3 requests a tick.
        let l = ProviderLimits::new(Some(6000), None, Some(100));
        l.set_shared(true);
        assert!(admit(&l, 0).is_err(), "nothing leased yet");
        tick(&l);
        let mut refused = 0;
        for n in [1, 0, 0, 3, 1, 0, 2, 0, 0, 0, 3, 1, 2, 0, 3] {
            for _ in 0..n {
                refused += usize::from(admit(&l, 0).is_err());
            }
            tick(&l);
        }
        assert_eq!(
            refused, 0,
            "a replica far under the limit is refused nothing"
        );
        // The standing allowance stays small: a tenth of the bucket at most.
        let held = l.shared.lock().any.held.requests;
        assert!(held <= 10, "{held}");
    }

    const NORMAL: Spender = Spender {
        reserve: 0.4,
        critical: false,
    };
    const CRITICAL: Spender = Spender {
        reserve: 0.4,
        critical: true,
    };

    #[tokio::test(start_paused = true)]
    async fn the_reserve_is_kept_for_critical_work_and_a_refusal_says_so() {
        // 5 at once, 40 % (2) kept.
        let l = ProviderLimits::new(Some(60), None, Some(5));
        for _ in 0..3 {
            assert!(l.check(1, NORMAL).is_ok());
            l.charge(1, false);
        }
        let refused = l.check(1, NORMAL).unwrap_err();
        assert!(refused.reserved, "only the reserve is left");
        for _ in 0..2 {
            assert!(l.check(1, CRITICAL).is_ok());
            l.charge(1, true);
        }
        let refused = l.check(1, CRITICAL).unwrap_err();
        assert!(!refused.reserved, "the bucket itself is empty");
        assert_eq!(refused.wait, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_reserve_is_leased_for_critical_work_only() {
        let l = ProviderLimits::new(Some(600), None, Some(100));
        l.set_shared(true);
        assert!(l.check(1, NORMAL).is_err() && l.check(1, CRITICAL).is_err());
        let lease = l.plan_lease(Instant::now(), 0.4, true);
        assert_eq!(lease.kept.requests, 40, "what leases for any work leave");
        assert_eq!(lease.any.take.requests, 2, "two ticks of a demand of 1");
        assert_eq!(lease.critical.take.requests, 2);
        // The store held the ask for any work back at the reserve.
        l.granted(Grant {
            critical: lease.critical.take,
            wait: Duration::from_secs(5),
            reserved: true,
            ..Grant::default()
        });
        let refused = l.check(1, NORMAL).unwrap_err();
        assert!(refused.reserved);
        assert_eq!(refused.wait, Duration::from_secs(5));
        assert!(l.check(1, CRITICAL).is_ok());
        l.charge(1, true);
        assert_eq!(
            l.shared.lock().critical.held.requests,
            1,
            "spent from its own lease"
        );
        // No critical task calls it any more (a reload): its lease goes back.
        let lease = l.plan_lease(Instant::now(), 0.4, false);
        assert_eq!(lease.critical.give_back.requests, 1);
        let lease = l.plan_lease(Instant::now(), 0.4, false);
        assert_eq!(lease.critical, Block::default());
        // A bucket without a reserve leases one pool: critical work asks from it.
        let l = ProviderLimits::new(Some(600), None, Some(100));
        l.set_shared(true);
        let unreserved = Spender {
            reserve: 0.0,
            critical: true,
        };
        assert!(l.check(1, unreserved).is_err());
        let lease = l.plan_lease(Instant::now(), 0.0, true);
        assert_eq!(lease.critical, Block::default());
        assert_eq!(lease.any.take.requests, 2);
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
