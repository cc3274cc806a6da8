//! What replicas share of health, and merging in what another replica saw.
//!
//! Each shared piece is state, not an event: a target's DOWN (with when its
//! breaker reopens) or its recovery, and its cooldowns; a key's cooldown and
//! revocation; a provider's cooldown. Merging is idempotent and tolerates
//! any order: cooldowns and reopen times take the later end, and DOWN
//! against recovery goes to the later verdict, so a view applied twice, late,
//! or after a newer local verdict changes nothing it should not.
//!
//! The half-open trial gate ([`TargetHealth::set_trial_leases`],
//! [`TargetHealth::grant_trial`], [`TargetHealth::trial_state`]) is what the
//! lease keeper drives; `admit` only reads it.

use tokio::time::Instant;

use super::{change, KeyHealth, ProviderHealth, State, TargetHealth, Transition, Window};

/// What a replica shares of a target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetView {
    /// DOWN (breaker open); else serving.
    pub down: bool,
    /// When that verdict was reached (`None`: never DOWN).
    pub since: Option<Instant>,
    /// When the breaker lets a half-open trial through (DOWN only).
    pub reopen_at: Option<Instant>,
    /// A rate limit's cooldown (429, an advertised wait) ends then.
    pub limited_until: Option<Instant>,
    /// Another rule's cooldown ends then.
    pub paused_until: Option<Instant>,
}

/// A merge's effect: the view before and after, and the state change it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Merged<V> {
    /// The local view before the merge.
    pub before: V,
    /// The local view after it.
    pub after: V,
    /// The state change, if the merge made one (to log and count).
    pub transition: Option<Transition>,
}

/// Where a DOWN target's half-open trial stands, for the lease keeper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrialState {
    /// The breaker is open.
    pub down: bool,
    /// When it lets a trial through.
    pub reopen_at: Option<Instant>,
    /// A trial is on its way.
    pub in_flight: bool,
    /// This replica holds an unused grant.
    pub granted: bool,
    /// A request found the trial due but not granted since the last look.
    pub wanted: bool,
}

/// Keeps the later of two ends.
fn later(slot: &mut Option<Instant>, other: Option<Instant>) {
    if let Some(o) = other {
        *slot = Some(slot.map_or(o, |s| s.max(o)));
    }
}

impl TargetHealth {
    /// What this replica would share of the target now.
    #[must_use]
    pub fn shared_view(&self) -> TargetView {
        view(&self.lock())
    }

    /// Merges another replica's view: its cooldowns and a later reopen time
    /// always; its DOWN if this replica has not recovered since, its recovery
    /// if this replica has not gone DOWN since.
    pub fn merge(&self, remote: &TargetView, now: Instant) -> Merged<TargetView> {
        let mut inner = self.lock();
        let before = view(&inner);
        later(&mut inner.limited_until, remote.limited_until);
        later(&mut inner.paused_until, remote.paused_until);
        let mut transition = None;
        match (remote.down, remote.since.map(|at| at.min(now))) {
            (true, Some(at)) if inner.state == State::Down => {
                later(&mut inner.reopen_at, remote.reopen_at);
                later(&mut inner.last_failure, Some(at));
            }
            (true, Some(at)) if inner.recovered_at.is_none_or(|r| at > r) => {
                inner.reopen_at = remote.reopen_at;
                later(&mut inner.last_failure, Some(at));
                transition = change(&mut inner, State::Down, now);
                inner.last_change = at;
            }
            (false, Some(at)) if inner.state == State::Down && at > inner.last_change => {
                inner.consecutive_failures = 0;
                inner.reopen_at = None;
                inner.window = Window::default();
                transition = change(&mut inner, State::Healthy, now);
                inner.last_change = at;
                inner.recovered_at = Some(at);
            }
            (true | false, _) => {}
        }
        Merged {
            before,
            after: view(&inner),
            transition,
        }
    }

    /// Turns the shared trial gate on (the store is connected: a due trial
    /// waits for [`TargetHealth::grant_trial`]) or off (local single flight).
    pub fn set_trial_leases(&self, on: bool) {
        let mut inner = self.lock();
        inner.leases = on;
        if !on {
            inner.granted_until = None;
        }
    }

    /// Lets this replica take the half-open trial until `until` (the keeper
    /// holds the cross-replica lease for at least that long).
    pub fn grant_trial(&self, until: Instant) {
        let mut inner = self.lock();
        if inner.state == State::Down {
            inner.granted_until = Some(until);
        }
    }

    /// Where the trial stands; clears the "wanted" mark.
    pub fn trial_state(&self, now: Instant) -> TrialState {
        let mut inner = self.lock();
        let down = inner.state == State::Down;
        TrialState {
            down,
            reopen_at: inner.reopen_at.filter(|_| down),
            in_flight: inner.trial_in_flight,
            granted: down && inner.granted_until.is_some_and(|t| now < t),
            wanted: std::mem::take(&mut inner.trial_wanted) && down,
        }
    }
}

fn view(inner: &super::Inner) -> TargetView {
    let down = inner.state == State::Down;
    TargetView {
        down,
        since: if down {
            Some(inner.last_change)
        } else {
            inner.recovered_at
        },
        reopen_at: inner.reopen_at.filter(|_| down),
        limited_until: inner.limited_until,
        paused_until: inner.paused_until,
    }
}

/// What a replica shares of an API key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyView {
    /// A cooldown of the whole key ends then.
    pub cooldown_until: Option<Instant>,
    /// Rate limits' cooldowns (429s), by model, and when each ends.
    pub limited: Vec<(Box<str>, Instant)>,
    /// Revoked (401/403).
    pub dead: bool,
    /// When `dead` last changed (`None`: never revoked).
    pub since: Option<Instant>,
    /// Revoked by a `revoke: until_rotation` rule: no replica re-probes it.
    pub pinned: bool,
}

impl KeyHealth {
    /// What this replica would share of the key now.
    #[must_use]
    pub fn shared_view(&self) -> KeyView {
        let inner = self.inner.lock();
        KeyView {
            cooldown_until: inner.cooldown_until,
            limited: inner.limited.clone(),
            dead: inner.dead,
            since: inner.dead_changed,
            pinned: inner.pinned,
        }
    }

    /// Merges another replica's view: the later cooldown end, and its
    /// revocation (or revival) when it is newer than this replica's.
    pub fn merge(&self, remote: &KeyView, now: Instant) -> Merged<KeyView> {
        let before = self.shared_view();
        {
            let mut inner = self.inner.lock();
            later(&mut inner.cooldown_until, remote.cooldown_until);
            for (model, until) in &remote.limited {
                inner.limit(model, *until, now);
            }
            if let Some(at) = remote.since.map(|at| at.min(now)) {
                if remote.dead != inner.dead && inner.dead_changed.is_none_or(|d| at > d) {
                    inner.set_dead(remote.dead, at);
                }
            }
            // A pin is the stricter word on the same revocation.
            if remote.pinned && remote.dead && inner.dead {
                inner.pinned = true;
            }
        }
        Merged {
            before,
            after: self.shared_view(),
            transition: None,
        }
    }
}

/// What a replica shares of a provider account: its cooldown's end and
/// whether only a rate limit's, and until when it sheds non-critical work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProviderView {
    /// The cooldown's end, and whether only a rate limit's.
    pub cooldown: Option<(Instant, bool)>,
    /// `shed_after_429`'s end.
    pub shed_until: Option<Instant>,
}

impl ProviderHealth {
    /// What this replica would share of the account now.
    #[must_use]
    pub fn shared_view(&self) -> ProviderView {
        ProviderView {
            cooldown: *self.cooldown.lock(),
            shed_until: *self.shed_until.lock(),
        }
    }

    /// Merges another replica's view: the later ends win.
    pub fn merge(&self, remote: ProviderView) -> Merged<ProviderView> {
        let before = self.shared_view();
        if let Some((until, limited)) = remote.cooldown {
            let mut c = self.cooldown.lock();
            if c.is_none_or(|(t, _)| until > t) {
                *c = Some((until, limited));
            }
        }
        if let Some(until) = remote.shed_until {
            self.shed_until(until);
        }
        Merged {
            before,
            after: self.shared_view(),
            transition: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::health::{Failure, HealthConfig, Unavailable};

    fn down(h: &Arc<TargetHealth>, cfg: &HealthConfig) {
        let f = Failure {
            counted: true,
            cooldown: None,
            rate_limited: false,
            class: Arc::from("x"),
            jitter: 0.0,
        };
        let p = h.admit(Instant::now()).unwrap();
        h.record_failure(p, Instant::now(), &f, cfg);
    }

    #[tokio::test(start_paused = true)]
    async fn a_remote_down_applies_then_a_later_recovery_undoes_it() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        let seen = Arc::new(TargetHealth::new(Instant::now()));
        down(&seen, &cfg);
        let remote = seen.shared_view();
        assert!(remote.down && remote.reopen_at.is_some());
        let other = Arc::new(TargetHealth::new(Instant::now()));
        tokio::time::advance(Duration::from_millis(5)).await;
        let m = other.merge(&remote, Instant::now());
        assert_eq!(m.transition.map(|t| t.to), Some(State::Down));
        assert_eq!(m.after, remote, "the same view on both replicas");
        assert!(matches!(
            other.admit(Instant::now()),
            Err(Unavailable::Down { .. })
        ));
        assert_eq!(other.merge(&remote, Instant::now()).transition, None);
        // The first replica recovers (a probe); the other follows.
        tokio::time::advance(Duration::from_secs(1)).await;
        seen.record_probe(Instant::now(), true);
        let up = seen.shared_view();
        assert!(!up.down);
        let m = other.merge(&up, Instant::now());
        assert_eq!(m.transition.map(|t| t.to), Some(State::Healthy));
        // The old DOWN arriving late changes nothing.
        assert_eq!(other.merge(&remote, Instant::now()).transition, None);
        assert_eq!(other.state(), State::Healthy);
    }

    #[tokio::test(start_paused = true)]
    async fn a_local_down_newer_than_a_remote_recovery_stays() {
        let cfg = HealthConfig {
            down_after: 1,
            ..HealthConfig::default()
        };
        let remote = TargetView {
            since: Some(Instant::now()),
            ..TargetView::default()
        };
        tokio::time::advance(Duration::from_millis(10)).await;
        let h = Arc::new(TargetHealth::new(Instant::now()));
        down(&h, &cfg);
        assert_eq!(h.merge(&remote, Instant::now()).transition, None);
        assert_eq!(h.state(), State::Down);
    }

    #[tokio::test(start_paused = true)]
    async fn cooldowns_and_reopen_times_take_the_later_end() {
        let now = Instant::now();
        let h = TargetHealth::new(now);
        let remote = TargetView {
            limited_until: Some(now + Duration::from_secs(3)),
            ..TargetView::default()
        };
        let m = h.merge(&remote, now);
        assert_ne!(m.before, m.after);
        assert!(matches!(
            h.unavailable(now),
            Some(Unavailable::CoolingDown {
                rate_limited: true,
                ..
            })
        ));
        let earlier = TargetView {
            limited_until: Some(now + Duration::from_secs(1)),
            ..TargetView::default()
        };
        let m = h.merge(&earlier, now);
        assert_eq!(m.before, m.after, "an earlier end changes nothing");
    }

    #[tokio::test(start_paused = true)]
    async fn with_leases_a_due_trial_waits_for_a_grant_and_takes_it_once() {
        let cfg = HealthConfig {
            down_after: 1,
            open_for: Duration::from_secs(1),
            ..HealthConfig::default()
        };
        let h = Arc::new(TargetHealth::new(Instant::now()));
        h.set_trial_leases(true);
        down(&h, &cfg);
        tokio::time::advance(Duration::from_secs(2)).await;
        let now = Instant::now();
        assert!(h.trial_due(now), "the breaker is due");
        assert!(h.admit(now).is_err(), "but no grant yet");
        assert!(h.unavailable(now).is_some());
        let st = h.trial_state(now);
        assert!(st.down && st.wanted && !st.granted && !st.in_flight);
        assert!(!h.trial_state(now).wanted, "the mark is cleared");
        h.grant_trial(now + Duration::from_secs(1));
        assert!(h.trial_state(now).granted);
        let trial = h.admit(now).unwrap();
        assert!(trial.trial);
        assert!(h.admit(now).is_err(), "one trial per grant");
        drop(trial);
        assert!(
            h.admit(now).is_err(),
            "a dropped trial does not renew the grant"
        );
        h.set_trial_leases(false);
        assert!(
            h.admit(now).is_ok(),
            "without the store: local single flight"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn keys_and_providers_merge_by_their_later_verdict() {
        let now = Instant::now();
        let dead = KeyHealth::default();
        dead.record(now, None, true, false, "m");
        let k = KeyHealth::default();
        tokio::time::advance(Duration::from_millis(5)).await;
        k.merge(&dead.shared_view(), Instant::now());
        assert_eq!(k.state(Instant::now()), crate::health::KeyState::Dead);
        tokio::time::advance(Duration::from_millis(5)).await;
        k.revive();
        k.merge(&dead.shared_view(), Instant::now());
        assert_eq!(
            k.state(Instant::now()),
            crate::health::KeyState::Usable,
            "the revival is newer"
        );
        let p = ProviderHealth::default();
        let until = Instant::now() + Duration::from_secs(9);
        let view = |cooldown, shed_until| ProviderView {
            cooldown,
            shed_until,
        };
        p.merge(view(Some((until, true)), None));
        assert_eq!(p.shared_view(), view(Some((until, true)), None));
        let earlier = until - Duration::from_secs(1);
        p.merge(view(Some((earlier, false)), Some(earlier)));
        assert_eq!(p.shared_view(), view(Some((until, true)), Some(earlier)));
        p.merge(view(None, Some(until)));
        assert_eq!(
            p.shedding(Instant::now()),
            Some(until),
            "the later shedding wins"
        );
    }
}
