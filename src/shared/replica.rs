//! One replica's side of the sync, without I/O: which local state each
//! shared id names, what was last published, which trial leases it holds;
//! and from those, what to publish, which leases to take or let go, which
//! token blocks to lease, and how a message from another replica merges in.
//!
//! What was last published is what this replica believes the others know.
//! A local change shows as a view that differs from it, and is published on
//! the next tick; a merged message whose "before" matched it moves it along
//! (the merge is what the others already know), so nothing is echoed back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge};
use tokio::time::Instant;

use super::record::{self, Clock, Message, Names, Record};
use crate::health::merge::{KeyView, ProviderView, TargetView};
use crate::health::{KeyHealth, ProviderHealth, TargetHealth, TargetId};
use crate::metrics::{self as m, Metrics};
use crate::ratelimit::{Lease, ProviderLimits};
use crate::snapshot::{Snapshot, Target};

/// How long the lease holder's grant lets a request take the trial.
pub const GRANT_WINDOW: Duration = Duration::from_secs(1);
/// After losing a lease to another replica, wait this long before asking again.
const RETRY_LOST_LEASE: Duration = Duration::from_millis(250);

/// The replicas of one target identity (several names may share it).
struct TargetEntry {
    health: Arc<TargetHealth>,
    targets: Vec<Arc<Target>>,
    /// The provider's attempt timeout: a lease covers a trial that long.
    timeout: Duration,
}

/// One key identity and its gauges.
struct KeyEntry {
    health: Arc<KeyHealth>,
    gauges: Vec<Gauge>,
}

/// The local state of one snapshot, by shared id.
#[derive(Default)]
struct Index {
    targets: BTreeMap<String, TargetEntry>,
    keys: HashMap<String, KeyEntry>,
    providers: HashMap<String, Arc<ProviderHealth>>,
    /// Each limiter with the reserve its buckets keep, and whether a
    /// critical task may call them.
    limits: Vec<(Arc<ProviderLimits>, f64, bool)>,
}

impl Index {
    fn of(snapshot: &Snapshot) -> Self {
        let mut index = Index::default();
        for target in snapshot.targets.values() {
            let id = Names::target_id(&TargetId {
                base_url: target.provider.base_url.clone(),
                model: target.model.clone(),
            });
            index
                .targets
                .entry(id)
                .or_insert_with(|| TargetEntry {
                    health: Arc::clone(&target.health),
                    targets: Vec::new(),
                    timeout: target.provider.timeout,
                })
                .targets
                .push(Arc::clone(target));
        }
        let critical: std::collections::HashSet<&str> = snapshot
            .tasks
            .values()
            .filter(|t| t.priority.is_critical())
            .flat_map(|t| t.chain.iter().chain(&t.repair_targets))
            .map(|t| t.provider.name.as_str())
            .collect();
        for provider in snapshot.providers.values() {
            let critical = critical.contains(provider.name.as_str());
            index.providers.insert(
                Names::provider_id(&provider.account),
                Arc::clone(&provider.health),
            );
            let limits = provider.limits.iter().map(|l| (l, provider.reserve)).chain(
                provider
                    .keys
                    .iter()
                    .filter_map(|k| k.limits.as_ref().map(|l| (l, k.reserve))),
            );
            for (l, reserve) in limits {
                if !index
                    .limits
                    .iter()
                    .any(|(o, ..)| o.identity() == l.identity())
                {
                    index.limits.push((Arc::clone(l), reserve, critical));
                }
            }
            for key in &provider.keys {
                index
                    .keys
                    .entry(Names::key_id(&key.identity))
                    .or_insert_with(|| KeyEntry {
                        health: Arc::clone(&key.health),
                        gauges: Vec::new(),
                    })
                    .gauges
                    .push(key.gauge.clone());
            }
        }
        index
    }
}

/// What to do about one trial lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAction {
    /// Take it for `hold` (a request here wants the due trial).
    Acquire {
        /// The target's shared id.
        id: String,
        /// How long the lease lasts: the grant window and a trial.
        hold: Duration,
    },
    /// Let it go (`keep` zero) or keep it that long (until the breaker reopens).
    Release {
        /// The target's shared id.
        id: String,
        /// How much longer the lease stays.
        keep: Duration,
    },
}

/// The counters of the sync.
struct Counters {
    published: Counter,
    applied: Counter,
    won: Counter,
    lost: Counter,
}

/// One replica's view of the sync.
pub struct Replica {
    /// This replica's random id (its own messages come back and are ignored).
    pub id: String,
    index: Index,
    snapshot: usize,
    connected: bool,
    targets: HashMap<String, TargetView>,
    keys: HashMap<String, KeyView>,
    providers: HashMap<String, ProviderView>,
    holds: HashMap<String, Instant>,
    retry_at: HashMap<String, Instant>,
    counters: Counters,
}

impl Replica {
    /// A replica with a fresh random id, counting into `metrics`.
    #[must_use]
    pub fn new(metrics: &Metrics) -> Self {
        let counter = |name, label: &'static str, value: &'static str| {
            metrics.counter(name, &[(label, value.into())])
        };
        Self {
            id: format!("{:016x}", rand::random::<u64>()),
            index: Index::default(),
            snapshot: 0,
            connected: false,
            targets: HashMap::new(),
            keys: HashMap::new(),
            providers: HashMap::new(),
            holds: HashMap::new(),
            retry_at: HashMap::new(),
            counters: Counters {
                published: counter(m::SHARED_STATE_UPDATES, "direction", "published"),
                applied: counter(m::SHARED_STATE_UPDATES, "direction", "applied"),
                won: counter(m::SHARED_STATE_LEASES, "result", "won"),
                lost: counter(m::SHARED_STATE_LEASES, "result", "lost"),
            },
        }
    }

    /// Follows the current snapshot (a reload brings new targets and keys).
    pub fn refresh(&mut self, snapshot: &Arc<Snapshot>) {
        let ptr = Arc::as_ptr(snapshot) as usize;
        if ptr != self.snapshot {
            self.snapshot = ptr;
            self.index = Index::of(snapshot);
            // What no snapshot names any more is forgotten here too.
            let index = &self.index;
            self.targets.retain(|id, _| index.targets.contains_key(id));
            self.keys.retain(|id, _| index.keys.contains_key(id));
            self.providers
                .retain(|id, _| index.providers.contains_key(id));
            self.switch(self.connected);
        }
    }

    /// The store came (`on`) or went: trial gates and allowances follow.
    /// On a (re)connect every local fact is published again, since the
    /// store may have lost them (a restart without persistence).
    pub fn set_connected(&mut self, on: bool) {
        self.connected = on;
        self.holds.clear();
        self.retry_at.clear();
        if on {
            self.targets.clear();
            self.keys.clear();
            self.providers.clear();
        }
        self.switch(on);
    }

    fn switch(&self, on: bool) {
        for e in self.index.targets.values() {
            e.health.set_trial_leases(on);
        }
        for (l, ..) in &self.index.limits {
            l.set_shared(on);
        }
    }

    /// The local facts that changed since they were last published, as
    /// messages with their TTLs.
    pub fn changes(&mut self, c: &Clock) -> Vec<(Message, Duration)> {
        let mut out = Vec::new();
        for (id, e) in &self.index.targets {
            let v = e.health.shared_view();
            if self.targets.get(id).copied().unwrap_or_default() != v {
                self.targets.insert(id.clone(), v);
                out.push(Record::target(id.clone(), &v, c));
            }
        }
        for (id, e) in &self.index.keys {
            let v = e.health.shared_view();
            if self.keys.get(id) != Some(&v)
                && (self.keys.contains_key(id) || v != KeyView::default())
            {
                out.push(Record::key(id.clone(), &v, c));
                self.keys.insert(id.clone(), v);
            }
        }
        for (id, h) in &self.index.providers {
            let v = h.shared_view();
            if self.providers.get(id).copied().unwrap_or_default() != v {
                self.providers.insert(id.clone(), v);
                out.push(Record::provider(id.clone(), v, c));
            }
        }
        self.counters.published.increment(out.len() as u64);
        out.into_iter()
            .map(|record| {
                let ttl = record.ttl(c);
                let message = Message {
                    from: self.id.clone(),
                    record,
                };
                (message, ttl)
            })
            .collect()
    }

    /// Merges another replica's fact; whether it named local state.
    pub fn apply(&mut self, message: Message, c: &Clock) -> bool {
        if message.from == self.id {
            return false;
        }
        let applied = match message.record {
            Record::Target {
                id,
                down,
                since,
                reopen_at,
                limited_until,
                paused_until,
            } => self.apply_target(
                &id,
                &record::target_view(c, down, since, reopen_at, (limited_until, paused_until)),
                c.now,
            ),
            Record::Key {
                id,
                cooldown_until,
                limited,
                dead,
                since,
                pinned,
            } => self.apply_key(
                &id,
                &record::key_view(c, (cooldown_until, &limited), (dead, pinned), since),
                c.now,
            ),
            Record::Provider {
                id,
                until,
                rate_limited,
                shed_until,
            } => self.apply_provider(
                &id,
                record::provider_view(c, until, rate_limited, shed_until),
            ),
        };
        if applied {
            self.counters.applied.increment(1);
        }
        applied
    }

    fn apply_target(&mut self, id: &str, remote: &TargetView, now: Instant) -> bool {
        let Some(e) = self.index.targets.get(id) else {
            return false;
        };
        let merged = e.health.merge(remote, now);
        if self.targets.get(id).copied().unwrap_or_default() == merged.before {
            self.targets.insert(id.to_owned(), merged.after);
        }
        if merged.transition.is_some() {
            for t in &e.targets {
                tracing::debug!(target = %t.name, "health change from another replica");
                t.report(merged.transition);
            }
        }
        true
    }

    fn apply_key(&mut self, id: &str, remote: &KeyView, now: Instant) -> bool {
        let Some(e) = self.index.keys.get(id) else {
            return false;
        };
        let merged = e.health.merge(remote, now);
        let published = self.keys.get(id).cloned().unwrap_or_default();
        if published == merged.before {
            self.keys.insert(id.to_owned(), merged.after);
        }
        let gauge = e.health.state(now).gauge();
        for g in &e.gauges {
            g.set(gauge);
        }
        true
    }

    fn apply_provider(&mut self, id: &str, remote: ProviderView) -> bool {
        let Some(h) = self.index.providers.get(id) else {
            return false;
        };
        let merged = h.merge(remote);
        if self.providers.get(id).copied().unwrap_or_default() == merged.before {
            self.providers.insert(id.to_owned(), merged.after);
        }
        true
    }

    /// The trial leases to take or let go now. A lease is asked for only
    /// where a request found the trial due and not granted; one held is let
    /// go when the target recovered or the grant went unused, and kept until
    /// the breaker reopens when the trial failed (so no other replica tries
    /// before then).
    pub fn lease_work(&mut self, now: Instant) -> Vec<LeaseAction> {
        let mut out = Vec::new();
        self.holds
            .retain(|id, _| self.index.targets.contains_key(id));
        for (id, e) in &self.index.targets {
            let st = e.health.trial_state(now);
            if self.holds.contains_key(id) {
                let keep = if !st.down {
                    Some(Duration::ZERO)
                } else if let Some(reopen) = st.reopen_at.filter(|r| *r > now) {
                    Some(reopen - now)
                } else if st.in_flight || st.granted {
                    None
                } else {
                    Some(Duration::ZERO)
                };
                if let Some(keep) = keep {
                    self.holds.remove(id);
                    out.push(LeaseAction::Release {
                        id: id.clone(),
                        keep,
                    });
                }
                continue;
            }
            let due = st.down && !st.in_flight && st.reopen_at.is_none_or(|r| r <= now);
            let may = self.retry_at.get(id).is_none_or(|t| now >= *t);
            if st.wanted && due && may {
                out.push(LeaseAction::Acquire {
                    id: id.clone(),
                    hold: GRANT_WINDOW + e.timeout + Duration::from_secs(1),
                });
            }
        }
        out
    }

    /// What the store said to an acquire: the holder grants its trial.
    pub fn leased(&mut self, id: &str, won: bool, now: Instant) {
        let Some(e) = self.index.targets.get(id) else {
            return;
        };
        if won {
            self.counters.won.increment(1);
            e.health.grant_trial(now + GRANT_WINDOW);
            self.holds.insert(id.to_owned(), now);
            self.retry_at.remove(id);
        } else {
            self.counters.lost.increment(1);
            self.retry_at.insert(id.to_owned(), now + RETRY_LOST_LEASE);
        }
    }

    /// The token blocks to lease (or give back) now, per limiter.
    pub fn limit_work(&self, now: Instant) -> Vec<(Arc<ProviderLimits>, Lease)> {
        self.index
            .limits
            .iter()
            .filter_map(|(l, reserve, critical)| {
                let lease = l.plan_lease(now, *reserve, *critical);
                (!lease.is_empty()).then(|| (Arc::clone(l), lease))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Failure, State};
    use crate::snapshot::{compile::compile, CompileOptions, LiveState};

    fn snapshot(live: &LiveState) -> Arc<Snapshot> {
        let text = "version: 1\nproviders:\n  p: { base_url: 'http://127.0.0.1:9/v1', rate_limit: { rpm: 60 } }\n\
                    targets:\n  t: { provider: p, model: m }\ntasks:\n  chat: { chain: [t] }\n\
                    health: { degraded_after: 1, down_after: 1, open_for: 1s }\n";
        let parsed = crate::config::parse(text).unwrap();
        Arc::new(
            compile(&parsed, text, live, CompileOptions::default())
                .unwrap()
                .snapshot,
        )
    }

    fn fail(snapshot: &Snapshot, health: &Arc<TargetHealth>) {
        let f = Failure {
            counted: true,
            cooldown: None,
            rate_limited: false,
            class: Arc::from("x"),
            jitter: 0.0,
        };
        if let Ok(p) = health.admit(Instant::now()) {
            health.record_failure(p, Instant::now(), &f, &snapshot.health);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_wanted_trial_is_leased_granted_once_and_held_until_the_breaker_reopens() {
        let live = LiveState::default();
        let snap = snapshot(&live);
        let health = Arc::clone(&snap.targets["t"].health);
        let mut r = Replica::new(&live.metrics);
        r.refresh(&snap);
        r.set_connected(true);
        fail(&snap, &health);
        assert_eq!(r.changes(&Clock::now()).len(), 1, "the DOWN is published");
        assert!(r.changes(&Clock::now()).is_empty(), "once");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(
            r.lease_work(Instant::now()).is_empty(),
            "no request wants it yet"
        );
        assert!(
            health.admit(Instant::now()).is_err(),
            "due, but not granted"
        );
        let work = r.lease_work(Instant::now());
        let [LeaseAction::Acquire { id, hold }] = work.as_slice() else {
            panic!("{work:?}")
        };
        assert!(*hold > GRANT_WINDOW);
        r.leased(id, true, Instant::now());
        assert!(
            r.lease_work(Instant::now()).is_empty(),
            "granted, not used yet: kept"
        );
        fail(&snap, &health);
        assert_eq!(health.state(), State::Down);
        let work = r.lease_work(Instant::now());
        let [LeaseAction::Release { keep, .. }] = work.as_slice() else {
            panic!("{work:?}")
        };
        assert!(
            *keep >= Duration::from_millis(700),
            "held until the reopen: {keep:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn another_replicas_fact_merges_without_an_echo_and_its_own_is_ignored() {
        let (one, two) = (LiveState::default(), LiveState::default());
        let (s1, s2) = (snapshot(&one), snapshot(&two));
        let (mut r1, mut r2) = (Replica::new(&one.metrics), Replica::new(&two.metrics));
        for (r, s) in [(&mut r1, &s1), (&mut r2, &s2)] {
            r.refresh(s);
            r.set_connected(true);
        }
        fail(&s1, &s1.targets["t"].health);
        let sent = r1.changes(&Clock::now());
        assert_eq!(sent.len(), 1);
        assert!(
            !r1.apply(sent[0].0.clone(), &Clock::now()),
            "its own message"
        );
        assert!(r2.apply(sent[0].0.clone(), &Clock::now()));
        assert_eq!(s2.targets["t"].health.state(), State::Down);
        assert!(r2.changes(&Clock::now()).is_empty(), "nothing echoed back");
        // The limiter is on its shared allowance: a standing block is asked for.
        let work = r2.limit_work(Instant::now());
        assert_eq!(work.len(), 1);
        assert_eq!(
            work[0].1.any.take.requests, 1,
            "one request's standing allowance"
        );
        r2.set_connected(false);
        assert!(!s2.providers["p"].limits.as_ref().unwrap().shared_on());
    }
}
