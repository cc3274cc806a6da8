//! State that outlives snapshots, keyed by typed identities: health by target
//! identity, client pools by connect timeout, provider buckets by account and
//! limits, task buckets and routing state by task name, and the gateway's
//! metrics registry. A reload that keeps an identity keeps its state.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use parking_lot::Mutex;

use crate::health;
use crate::metrics::Metrics;
use crate::ratelimit::{ProviderLimits, TaskLimiter};
use crate::upstream::pool::Clients;

/// What a provider's buckets are kept by: the account and its limits. A
/// change of either starts fresh buckets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProviderLimitsKey {
    /// Provider name.
    pub name: String,
    /// Its `base_url`.
    pub base_url: String,
    /// `rate_limit.rpm`.
    pub rpm: Option<u32>,
    /// `rate_limit.tpm`.
    pub tpm: Option<u32>,
    /// `rate_limit.burst`.
    pub burst: Option<u32>,
}

/// What a task's client-facing buckets are kept by: a change of any limit
/// starts fresh buckets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TaskLimitKey {
    /// Task name.
    pub task: String,
    /// `rate_limit.rps` as its bits (an f64 has no `Eq`), and `rate_limit.burst`.
    pub task_rate: Option<(u64, Option<u32>)>,
    /// `rate_limit.per_caller`.
    pub per_caller: Option<CallerLimitKey>,
}

/// The per-caller part of a [`TaskLimitKey`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallerLimitKey {
    /// `per_caller.header`.
    pub header: String,
    /// `per_caller.rps`, as its bits.
    pub rps_bits: u64,
    /// `per_caller.burst`.
    pub burst: Option<u32>,
    /// `per_caller.max_callers`.
    pub max_callers: Option<usize>,
}

/// What an API key's state is kept by: its provider's URL, its name, and a
/// fingerprint of the key (never the key): a rotated key starts fresh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// The provider's `base_url`.
    pub base_url: String,
    /// The key's name.
    pub name: String,
    /// FNV-1a of the key material (0 for a key that could not be read).
    pub fingerprint: u64,
}

/// A key's own buckets are kept while the key and its rpm, tpm and burst stay.
pub type KeyLimitsKey = (KeyId, Option<u32>, Option<u32>, Option<u32>);

/// Key-pool cursors, by provider `base_url` and pool size.
pub type Cursors = Keyed<(String, usize), AtomicU64>;

/// State that outlives snapshots.
#[derive(Debug, Default)]
pub struct LiveState {
    /// Per API key: cooldowns and revocations.
    pub keys: Keyed<KeyId, crate::health::KeyHealth>,
    /// Per key: its own rpm/tpm buckets, kept while the key and its limits stay.
    pub key_limits: Keyed<KeyLimitsKey, ProviderLimits>,
    /// Per provider `base_url`: provider-scoped cooldowns.
    pub providers: Keyed<String, crate::health::ProviderHealth>,
    /// Round-robin cursors of key pools.
    pub key_cursors: Cursors,
    /// Health per target identity.
    pub health: health::Registry,
    /// Upstream client pools.
    pub clients: Clients,
    /// Providers' credential sources (a cached token, AWS credentials), by
    /// protocol, place and a fingerprint of the credentials file, so a
    /// reload keeps what they fetched.
    pub auths: Keyed<String, crate::upstream::auth::Auth>,
    /// Routing state per task (round-robin cursors, weights, fallback spend).
    pub tasks: Keyed<String, TaskState>,
    /// The waiting line of each batch task's queue, by task name.
    pub queues: Keyed<String, crate::ratelimit::Line>,
    /// Provider buckets: kept while the account and its limits are unchanged.
    pub provider_limits: Keyed<ProviderLimitsKey, ProviderLimits>,
    /// Client-facing task buckets: kept while the task's limits are unchanged.
    pub task_limits: Keyed<TaskLimitKey, TaskLimiter>,
    /// Each task's cached answers, kept while its name and bounds stay.
    pub caches: Keyed<(String, u64, Duration), crate::cache::Store>,
    /// The shared store the caches write to and read from, while connected.
    pub cache_link: Arc<crate::cache::Link>,
    /// The gateway's metrics registry.
    pub metrics: Metrics,
    /// Whether the last reload was rejected (so the next good file, even the
    /// last good text again, is logged as the fix).
    pub config_rejected: std::sync::atomic::AtomicBool,
}

impl LiveState {
    /// After a reload was applied: revoked keys get another chance (the
    /// operator may have fixed the account), and state no snapshot uses any
    /// more is dropped.
    pub fn reloaded(&self) {
        self.keys.for_each(crate::health::KeyHealth::revive);
        self.health.prune();
        self.keys.prune();
        self.key_limits.prune();
        self.providers.prune();
        self.key_cursors.prune();
        self.tasks.prune();
        self.queues.prune();
        self.caches.prune();
        self.provider_limits.prune();
        self.task_limits.prune();
        self.clients.prune();
        self.auths.prune();
    }
}

/// Shared values by key, created on first use.
#[derive(Debug)]
pub struct Keyed<K, V> {
    map: Mutex<HashMap<K, Arc<V>>>,
}

impl<K, V> Default for Keyed<K, V> {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash, V> Keyed<K, V> {
    /// The value for `key`, made by `make` if there is none (`None` if `make` gives none).
    pub fn get_or_make(&self, key: K, make: impl FnOnce() -> Option<V>) -> Option<Arc<V>> {
        let mut map = self.map.lock();
        if let Some(found) = map.get(&key) {
            return Some(Arc::clone(found));
        }
        let made = Arc::new(make()?);
        map.insert(key, Arc::clone(&made));
        Some(made)
    }
}

impl<K: Eq + Hash, V> Keyed<K, V> {
    /// Calls `f` on every value (e.g. to revive every key after a reload).
    pub fn for_each(&self, mut f: impl FnMut(&V)) {
        for v in self.map.lock().values() {
            f(v);
        }
    }

    /// Forgets the values no snapshot holds any more.
    pub fn prune(&self) {
        self.map.lock().retain(|_, v| Arc::strong_count(v) > 1);
    }
}

impl<K: Eq + Hash, V: Default> Keyed<K, V> {
    /// The value for `key`, created with its default on first use.
    pub fn get(&self, key: K) -> Arc<V> {
        let mut map = self.map.lock();
        Arc::clone(map.entry(key).or_default())
    }
}

/// Live routing state of a task, kept across reloads by task name.
#[derive(Debug, Default)]
pub struct TaskState {
    /// Round-robin cursor.
    round_robin: AtomicU64,
    /// Smooth weighted round robin: current weight per chain position.
    swrr: Mutex<Vec<i64>>,
    /// (clock hour, USD spent on non-first targets in it).
    spend: Mutex<(u64, f64)>,
    /// Requests and hedges of the current one-minute window, for the hedge rate cap.
    hedges: Mutex<HedgeWindow>,
}

impl TaskState {
    /// The next value of the round-robin cursor.
    pub fn next_turn(&self) -> u64 {
        self.round_robin.fetch_add(1, Ordering::Relaxed)
    }

    /// Smooth weighted round robin (nginx's): each of `pool`'s (position,
    /// weight) gains its weight, the largest current weight wins and pays the
    /// total back. `positions` is the chain length.
    pub fn smooth_weighted(&self, positions: usize, pool: &[(usize, i64)]) -> Option<usize> {
        let mut current = self.swrr.lock();
        if current.len() != positions {
            *current = vec![0; positions];
        }
        let mut total = 0i64;
        let mut best: Option<usize> = None;
        for &(i, w) in pool {
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

    /// Counts one request of a hedging task in the current window.
    pub fn count_request(&self) {
        let mut h = self.hedges.lock();
        h.roll(Instant::now());
        h.requests = h.requests.saturating_add(1);
    }

    /// Takes one hedge if this minute's hedges stay within `max_share` of
    /// its requests (at least one a minute, unless `max_share` is 0); false
    /// when the cap suppresses it.
    pub fn take_hedge(&self, max_share: f64) -> bool {
        let mut h = self.hedges.lock();
        h.roll(Instant::now());
        let allowed = (max_share * f64::from(h.requests.max(1))).floor().max(1.0);
        if max_share <= 0.0 || f64::from(h.hedges + 1) > allowed {
            return false;
        }
        h.hedges += 1;
        true
    }

    fn hour() -> u64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 3600)
    }

    /// USD spent on fallback targets in the current clock hour.
    #[must_use]
    pub fn spend_this_hour(&self) -> f64 {
        let spend = self.spend.lock();
        if spend.0 == Self::hour() {
            spend.1
        } else {
            0.0
        }
    }

    /// Adds fallback spend.
    pub fn add_spend(&self, usd: f64) {
        let hour = Self::hour();
        let mut spend = self.spend.lock();
        if spend.0 != hour {
            *spend = (hour, 0.0);
        }
        spend.1 += usd;
    }
}

/// One minute of a hedging task's requests and hedges. The window starts at
/// the first request after the last one ended (not on the clock's minute, so
/// the cap does not reset in the middle of a burst).
#[derive(Debug, Default)]
struct HedgeWindow {
    start: Option<Instant>,
    requests: u32,
    hedges: u32,
}

impl HedgeWindow {
    /// Starts a new window when there is none or the current one is a minute old.
    fn roll(&mut self, now: Instant) {
        let over = self
            .start
            .is_none_or(|s| now.duration_since(s) >= Duration::from_secs(60));
        if over {
            *self = HedgeWindow {
                start: Some(now),
                ..HedgeWindow::default()
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_hedge_cap_holds_for_a_minute_from_the_first_request_then_starts_again() {
        let state = TaskState::default();
        for _ in 0..20 {
            state.count_request();
        }
        assert!(state.take_hedge(0.1), "10 % of 20 requests: two hedges");
        assert!(state.take_hedge(0.1));
        assert!(!state.take_hedge(0.1), "a third is over the share");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(!state.take_hedge(0.1), "still the same window");
        tokio::time::advance(Duration::from_secs(1)).await;
        state.count_request();
        assert!(state.take_hedge(0.1), "a new window allows at least one");
        assert!(!state.take_hedge(0.1));
        assert!(!state.take_hedge(0.0), "a share of 0 never hedges");
    }
}
