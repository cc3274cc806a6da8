//! The wire format of shared state: what a record in Redis and a pub/sub
//! message hold, the names of the keys, and times as wall-clock milliseconds
//! (an `Instant` means nothing to another process).
//!
//! Names are `{prefix}:target:{id}`, `{prefix}:key:{id}`,
//! `{prefix}:provider:{id}`, `{prefix}:lease:{target id}`,
//! `{prefix}:limit:{identity}:{requests|tokens}` and the channel
//! `{prefix}:events`. An id is a hash of the identity (a target's base URL
//! and model, a provider's base URL) or, for a key, the hash of its
//! provider's URL, its name and its fingerprint: never key material.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::health::merge::{KeyView, ProviderView, TargetView};
use crate::health::TargetId;
use crate::snapshot::compile::hash;
use crate::snapshot::live::KeyId;

/// How long a record outlives the end it carries: a replica that connects a
/// little later still learns it, and nothing is left for long once every
/// replica is gone.
pub const RECORD_GRACE: Duration = Duration::from_secs(60);
/// How long a revoked key's record lasts (a replica that starts later still
/// skips the key; a reload that revives it publishes the revival).
pub const DEAD_KEY_TTL: Duration = Duration::from_secs(3600);

/// Now, on both clocks, to convert between them.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// The monotonic clock.
    pub now: Instant,
    /// The wall clock, in milliseconds since the Unix epoch.
    pub wall_ms: u64,
}

impl Clock {
    /// Reads both clocks.
    #[must_use]
    pub fn now() -> Self {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            now: Instant::now(),
            wall_ms: u64::try_from(wall.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// `at` in wall-clock milliseconds.
    #[must_use]
    pub fn to_ms(&self, at: Instant) -> u64 {
        if at >= self.now {
            let ahead = u64::try_from((at - self.now).as_millis()).unwrap_or(u64::MAX);
            self.wall_ms.saturating_add(ahead)
        } else {
            let behind = u64::try_from((self.now - at).as_millis()).unwrap_or(u64::MAX);
            self.wall_ms.saturating_sub(behind)
        }
    }

    /// Wall-clock `ms` on this process's clock (`None` before it can say).
    #[must_use]
    pub fn from_ms(&self, ms: u64) -> Option<Instant> {
        if ms >= self.wall_ms {
            Some(self.now + Duration::from_millis(ms - self.wall_ms))
        } else {
            self.now
                .checked_sub(Duration::from_millis(self.wall_ms - ms))
        }
    }

    /// How long from now until `ms` (zero if past).
    #[must_use]
    pub fn until(&self, ms: u64) -> Duration {
        Duration::from_millis(ms.saturating_sub(self.wall_ms))
    }
}

/// One shared fact, as stored and as sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A target's breaker and cooldowns.
    Target {
        /// [`Names::target_id`].
        id: String,
        /// DOWN (breaker open).
        down: bool,
        /// When that verdict was reached.
        since: Option<u64>,
        /// When the breaker lets a trial through.
        reopen_at: Option<u64>,
        /// A rate limit's cooldown ends then.
        limited_until: Option<u64>,
        /// Another rule's cooldown ends then.
        paused_until: Option<u64>,
    },
    /// An API key's cooldown and revocation.
    Key {
        /// [`Names::key_id`].
        id: String,
        /// A cooldown of the whole key ends then.
        cooldown_until: Option<u64>,
        /// Rate limits' cooldowns by model, and their ends (absent in older
        /// records).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        limited: Vec<(String, u64)>,
        /// Revoked.
        dead: bool,
        /// When `dead` last changed.
        since: Option<u64>,
        /// Revoked until a rotation: never re-probed (absent in older records).
        #[serde(default)]
        pinned: bool,
    },
    /// A provider account's cooldown.
    Provider {
        /// [`Names::provider_id`].
        id: String,
        /// The cooldown ends then.
        until: Option<u64>,
        /// Only a rate limit's.
        rate_limited: bool,
        /// Non-critical work keeps off it until then (`shed_after_429`;
        /// absent in older records).
        #[serde(default)]
        shed_until: Option<u64>,
    },
}

/// A record with who sent it (a replica ignores its own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The sending replica's random id.
    pub from: String,
    /// The fact.
    pub record: Record,
}

impl Record {
    /// A target's view, in wall-clock time.
    #[must_use]
    pub fn target(id: String, v: &TargetView, c: &Clock) -> Self {
        Record::Target {
            id,
            down: v.down,
            since: v.since.map(|t| c.to_ms(t)),
            reopen_at: v.reopen_at.map(|t| c.to_ms(t)),
            limited_until: v.limited_until.map(|t| c.to_ms(t)),
            paused_until: v.paused_until.map(|t| c.to_ms(t)),
        }
    }

    /// A key's view, in wall-clock time.
    #[must_use]
    pub fn key(id: String, v: &KeyView, c: &Clock) -> Self {
        Record::Key {
            id,
            cooldown_until: v.cooldown_until.map(|t| c.to_ms(t)),
            limited: (v.limited.iter())
                .map(|(model, until)| (model.to_string(), c.to_ms(*until)))
                .collect(),
            dead: v.dead,
            since: v.since.map(|t| c.to_ms(t)),
            pinned: v.pinned,
        }
    }

    /// A provider's view, in wall-clock time.
    #[must_use]
    pub fn provider(id: String, v: ProviderView, c: &Clock) -> Self {
        Record::Provider {
            id,
            until: v.cooldown.map(|(t, _)| c.to_ms(t)),
            rate_limited: v.cooldown.is_some_and(|(_, limited)| limited),
            shed_until: v.shed_until.map(|t| c.to_ms(t)),
        }
    }

    /// How long the record is kept: the latest end it carries plus
    /// [`RECORD_GRACE`] (a revoked key: [`DEAD_KEY_TTL`]).
    #[must_use]
    pub fn ttl(&self, c: &Clock) -> Duration {
        let ends: Vec<Option<u64>> = match self {
            Record::Target {
                reopen_at,
                limited_until,
                paused_until,
                ..
            } => vec![*reopen_at, *limited_until, *paused_until],
            Record::Key { dead: true, .. } => return DEAD_KEY_TTL,
            Record::Key {
                cooldown_until,
                limited,
                ..
            } => (limited.iter().map(|(_, until)| Some(*until)))
                .chain([*cooldown_until])
                .collect(),
            Record::Provider {
                until, shed_until, ..
            } => vec![*until, *shed_until],
        };
        let latest = ends.into_iter().flatten().max().unwrap_or(0);
        c.until(latest) + RECORD_GRACE
    }
}

/// Wall-clock milliseconds as an instant of this process; a time it cannot
/// place is dropped.
fn at(c: &Clock, ms: Option<u64>) -> Option<Instant> {
    ms.and_then(|ms| c.from_ms(ms))
}

/// A target record as a local view.
#[must_use]
pub fn target_view(
    c: &Clock,
    down: bool,
    since: Option<u64>,
    reopen_at: Option<u64>,
    cooldowns: (Option<u64>, Option<u64>),
) -> TargetView {
    TargetView {
        down,
        since: at(c, since),
        reopen_at: at(c, reopen_at),
        limited_until: at(c, cooldowns.0),
        paused_until: at(c, cooldowns.1),
    }
}

/// A key record as a local view.
#[must_use]
pub fn key_view(
    c: &Clock,
    (cooldown_until, limited): (Option<u64>, &[(String, u64)]),
    (dead, pinned): (bool, bool),
    since: Option<u64>,
) -> KeyView {
    KeyView {
        cooldown_until: at(c, cooldown_until),
        limited: (limited.iter())
            .filter_map(|(model, ms)| Some((model.as_str().into(), at(c, Some(*ms))?)))
            .collect(),
        dead,
        since: at(c, since),
        pinned,
    }
}

/// A provider record as a local view.
#[must_use]
pub fn provider_view(
    c: &Clock,
    until: Option<u64>,
    rate_limited: bool,
    shed_until: Option<u64>,
) -> ProviderView {
    ProviderView {
        cooldown: at(c, until).map(|t| (t, rate_limited)),
        shed_until: at(c, shed_until),
    }
}

/// The names of one deployment's keys, under its `key_prefix`.
#[derive(Debug, Clone)]
pub struct Names {
    prefix: String,
}

impl Names {
    /// Names under `prefix`.
    #[must_use]
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// A target's id: the hash of its base URL and model.
    #[must_use]
    pub fn target_id(id: &TargetId) -> String {
        format!("{:016x}", hash(&format!("{}\n{}", id.base_url, id.model)))
    }

    /// A key's id: its provider URL's hash, its name and its fingerprint.
    #[must_use]
    pub fn key_id(id: &KeyId) -> String {
        format!(
            "{:016x}:{}:{:016x}",
            hash(&id.base_url),
            id.name,
            id.fingerprint
        )
    }

    /// A provider account's id: the hash of its account (its base URL and
    /// its keys' fingerprints).
    #[must_use]
    pub fn provider_id(account: &str) -> String {
        format!("{:016x}", hash(account))
    }

    /// Where a record is kept.
    #[must_use]
    pub fn record(&self, r: &Record) -> String {
        let p = &self.prefix;
        match r {
            Record::Target { id, .. } => format!("{p}:target:{id}"),
            Record::Key { id, .. } => format!("{p}:key:{id}"),
            Record::Provider { id, .. } => format!("{p}:provider:{id}"),
        }
    }

    /// The patterns that find every record (for the reconcile).
    #[must_use]
    pub fn record_patterns(&self) -> [String; 3] {
        let p = &self.prefix;
        [
            format!("{p}:target:*"),
            format!("{p}:key:*"),
            format!("{p}:provider:*"),
        ]
    }

    /// The pub/sub channel.
    #[must_use]
    pub fn channel(&self) -> String {
        format!("{}:events", self.prefix)
    }

    /// A target's half-open trial lease.
    #[must_use]
    pub fn lease(&self, target_id: &str) -> String {
        format!("{}:lease:{target_id}", self.prefix)
    }

    /// A limiter's shared bucket (`dimension`: `requests` or `tokens`).
    #[must_use]
    pub fn limit(&self, identity: u64, dimension: &str) -> String {
        format!("{}:limit:{identity:016x}:{dimension}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn times_survive_the_trip_through_the_wall_clock() {
        let c = Clock::now();
        let later = c.now + Duration::from_millis(1500);
        let back = c.from_ms(c.to_ms(later)).unwrap();
        assert!(back.max(later) - back.min(later) <= Duration::from_millis(1));
        assert_eq!(c.until(c.wall_ms + 250), Duration::from_millis(250));
        assert_eq!(c.until(c.wall_ms - 250), Duration::ZERO);
    }

    #[tokio::test]
    async fn records_round_trip_and_expire_after_their_latest_end() {
        let c = Clock::now();
        let r = Record::Target {
            id: "ab".into(),
            down: true,
            since: Some(c.wall_ms),
            reopen_at: Some(c.wall_ms + 20_000),
            limited_until: Some(c.wall_ms + 5_000),
            paused_until: None,
        };
        let m = Message {
            from: "r1".into(),
            record: r.clone(),
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains(r#""kind":"target""#), "{text}");
        assert_eq!(serde_json::from_str::<Message>(&text).unwrap(), m);
        assert_eq!(r.ttl(&c), Duration::from_secs(80));
        let dead = Record::Key {
            id: "k".into(),
            cooldown_until: None,
            limited: Vec::new(),
            dead: true,
            since: Some(c.wall_ms),
            pinned: false,
        };
        assert_eq!(dead.ttl(&c), DEAD_KEY_TTL);
    }

    #[test]
    fn names_are_prefixed_and_hold_no_key_material() {
        let n = Names::new("prod");
        let key = KeyId {
            base_url: "https://api.example/v1".into(),
            name: "main".into(),
            fingerprint: 0xfeed,
        };
        let id = Names::key_id(&key);
        assert!(id.ends_with(":main:000000000000feed"), "{id}");
        let r = Record::Key {
            id,
            cooldown_until: None,
            limited: Vec::new(),
            dead: false,
            since: None,
            pinned: false,
        };
        assert!(n.record(&r).starts_with("prod:key:"));
        assert!(!n.record(&r).contains("api.example"));
        let t = TargetId {
            base_url: "https://api.example/v1".into(),
            model: "m".into(),
        };
        assert_eq!(Names::target_id(&t).len(), 16);
        assert_eq!(n.channel(), "prod:events");
        assert_eq!(
            n.limit(1, "requests"),
            "prod:limit:0000000000000001:requests"
        );
    }
}
