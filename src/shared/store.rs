//! The Redis side: one multiplexed connection for commands and one pub/sub
//! subscription, every call bounded by `timeout`; the Lua scripts of the
//! half-open trial lease and of the shared token buckets. Errors carry a
//! fixed description, never the server's URL.

use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{MultiplexedConnection, PubSubStream};
use redis::{AsyncConnectionConfig, Client, RedisError, Script};
use tokio::time::timeout;

use super::record::{Message, Names};
use crate::ratelimit::{Grant, Lease, ProviderLimits};

/// Why the store cannot be used now.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A call took longer than `timeout`.
    #[error("no answer within the timeout")]
    Timeout,
    /// The client said no (a category such as "I/O error", never the URL).
    #[error("{0}")]
    Redis(String),
    /// The subscription ended (the server went away).
    #[error("the subscription ended")]
    Closed,
}

impl From<RedisError> for StoreError {
    fn from(e: RedisError) -> Self {
        let what = if e.is_timeout() {
            "timed out"
        } else if e.is_connection_refusal() {
            "connection refused"
        } else if e.is_connection_dropped() {
            "connection dropped"
        } else {
            e.category()
        };
        StoreError::Redis(what.to_owned())
    }
}

/// Takes a lease (`SET NX PX`), or renews it when this replica holds it.
/// KEYS[1] the lease, ARGV[1] the holder, ARGV[2] milliseconds. 1: held.
const ACQUIRE: &str = r"
local v = redis.call('GET', KEYS[1])
if v == false then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  return 1
end
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// Lets a lease this replica holds go (ARGV[2] = 0) or keeps it for
/// ARGV[2] more milliseconds (a failed trial: until the breaker reopens).
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if tonumber(ARGV[2]) > 0 then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Token buckets on the server's clock: for each KEYS[i], ARGV holds
/// (capacity, refill per millisecond, ask, reserve, critical ask) from
/// 5i-4; then the key TTL in ms. A positive ask takes up to that many whole
/// tokens without going below the reserve, a positive critical ask up to
/// that many from what is left; a negative one puts them back (never above
/// capacity). Returns, per bucket: granted, ms until a token above the
/// reserve, critically granted, ms until any token, and 1 when the reserve
/// cut the ask.
const BUCKETS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = ARGV[#KEYS * 5 + 1]
local out = {}
for i = 1, #KEYS do
  local at = (i - 1) * 5
  local cap = tonumber(ARGV[at + 1])
  local rate = tonumber(ARGV[at + 2])
  local ask = tonumber(ARGV[at + 3])
  local keep = tonumber(ARGV[at + 4])
  local critical = tonumber(ARGV[at + 5])
  local b = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens = tonumber(b[1])
  local ts = tonumber(b[2])
  if tokens == nil or ts == nil then
    tokens = cap
    ts = now
  end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
  local grant = 0
  local reserved = 0
  if ask > 0 then
    grant = math.max(0, math.min(ask, math.floor(tokens - keep)))
    tokens = tokens - grant
    if grant < ask and keep > 0 and tokens >= 1 then
      reserved = 1
    end
  elseif ask < 0 then
    tokens = math.min(cap, tokens - ask)
  end
  local kept = 0
  if critical > 0 then
    kept = math.min(critical, math.floor(tokens))
    tokens = tokens - kept
  elseif critical < 0 then
    tokens = math.min(cap, tokens - critical)
  end
  redis.call('HSET', KEYS[i], 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[i], ttl)
  local wait = 0
  if tokens < keep + 1 then
    wait = math.ceil((keep + 1 - tokens) / rate)
  end
  local any = 0
  if tokens < 1 then
    any = math.ceil((1 - tokens) / rate)
  end
  out[#out + 1] = grant
  out[#out + 1] = wait
  out[#out + 1] = kept
  out[#out + 1] = any
  out[#out + 1] = reserved
end
return out
";

/// Most records one reconcile reads (a bound on a hostile or shared server).
const MAX_RECONCILE: usize = 100_000;

/// A connected store.
pub struct Store {
    conn: MultiplexedConnection,
    timeout: Duration,
    names: Names,
    acquire: Script,
    release: Script,
    buckets: Script,
}

/// A call bounded by the store's timeout.
async fn bounded<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, RedisError>>,
) -> Result<T, StoreError> {
    match timeout(limit, call).await {
        Ok(r) => r.map_err(StoreError::from),
        Err(_) => Err(StoreError::Timeout),
    }
}

impl Store {
    /// Connects (commands, then the subscription to the channel).
    ///
    /// # Errors
    /// The server cannot be reached, refuses, or is slower than `limit`.
    pub async fn connect(
        client: &Client,
        names: Names,
        limit: Duration,
    ) -> Result<(Store, PubSubStream), StoreError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(limit))
            .set_response_timeout(Some(limit));
        let conn = bounded(
            limit,
            client.get_multiplexed_async_connection_with_config(&config),
        )
        .await?;
        let mut pubsub = bounded(limit, client.get_async_pubsub()).await?;
        bounded(limit, pubsub.subscribe(names.channel())).await?;
        let store = Store {
            conn,
            timeout: limit,
            names,
            acquire: Script::new(ACQUIRE),
            release: Script::new(RELEASE),
            buckets: Script::new(BUCKETS),
        };
        Ok((store, pubsub.into_on_message()))
    }

    /// A handle on the command connection, for what shares through the
    /// store outside this module's records (the response store).
    #[must_use]
    pub fn connection(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// The key names.
    #[must_use]
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// Answers within the timeout, or not.
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn ping(&mut self) -> Result<(), StoreError> {
        let cmd = redis::cmd("PING");
        let call = cmd.query_async::<String>(&mut self.conn);
        bounded(self.timeout, call).await.map(|_| ())
    }

    /// Stores each message's record (with its TTL) and publishes it, in one
    /// round trip.
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn publish(&mut self, messages: &[(Message, Duration)]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for (m, ttl) in messages {
            let text = serde_json::to_string(m).unwrap_or_default();
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
            pipe.cmd("SET")
                .arg(self.names.record(&m.record))
                .arg(&text)
                .arg("PX")
                .arg(ms)
                .ignore();
            pipe.cmd("PUBLISH")
                .arg(self.names.channel())
                .arg(&text)
                .ignore();
        }
        let call = pipe.query_async::<()>(&mut self.conn);
        bounded(self.timeout, call).await
    }

    /// Every record under the prefix (for the reconcile after a connect).
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn records(&mut self) -> Result<Vec<Message>, StoreError> {
        let mut keys = Vec::new();
        for pattern in self.names.record_patterns() {
            let mut cursor = 0u64;
            loop {
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(500);
                let call = cmd.query_async::<(u64, Vec<String>)>(&mut self.conn);
                let (next, found) = bounded(self.timeout, call).await?;
                keys.extend(found);
                cursor = next;
                if cursor == 0 || keys.len() >= MAX_RECONCILE {
                    break;
                }
            }
        }
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(500) {
            let mut cmd = redis::cmd("MGET");
            cmd.arg(chunk);
            let call = cmd.query_async::<Vec<Option<String>>>(&mut self.conn);
            let values = bounded(self.timeout, call).await?;
            out.extend(
                values
                    .into_iter()
                    .flatten()
                    .filter_map(|v| serde_json::from_str::<Message>(&v).ok()),
            );
        }
        Ok(out)
    }

    /// Takes (or renews) the trial lease of `target_id` for `hold`; whether
    /// this replica holds it.
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn acquire(
        &mut self,
        target_id: &str,
        holder: &str,
        hold: Duration,
    ) -> Result<bool, StoreError> {
        let ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut call = self.acquire.key(self.names.lease(target_id));
        call.arg(holder).arg(ms);
        let won = bounded(self.timeout, call.invoke_async::<i64>(&mut self.conn)).await?;
        Ok(won == 1)
    }

    /// Lets the lease go, or (`keep` > 0) keeps it that much longer.
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn release(
        &mut self,
        target_id: &str,
        holder: &str,
        keep: Duration,
    ) -> Result<(), StoreError> {
        let ms = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX);
        let mut call = self.release.key(self.names.lease(target_id));
        call.arg(holder).arg(ms);
        bounded(self.timeout, call.invoke_async::<i64>(&mut self.conn))
            .await
            .map(|_| ())
    }

    /// Takes `lease` from (or gives it back to) the shared buckets of
    /// `limits`: what was granted, and when the buckets have tokens again.
    ///
    /// # Errors
    /// As [`Store::connect`].
    pub async fn lease_tokens(
        &mut self,
        limits: &ProviderLimits,
        lease: &Lease,
    ) -> Result<Grant, StoreError> {
        let signed = |take: u64, back: u64| {
            i64::try_from(take).unwrap_or(i64::MAX) - i64::try_from(back).unwrap_or(i64::MAX)
        };
        let (spec, kept) = (limits.spec(), lease.kept);
        let dims = [
            (
                spec.requests,
                kept.requests,
                signed(lease.any.take.requests, lease.any.give_back.requests),
                signed(
                    lease.critical.take.requests,
                    lease.critical.give_back.requests,
                ),
            ),
            (
                spec.tokens,
                kept.tokens,
                signed(lease.any.take.tokens, lease.any.give_back.tokens),
                signed(lease.critical.take.tokens, lease.critical.give_back.tokens),
            ),
        ];
        let mut call = self.buckets.prepare_invoke();
        let mut ttl_ms = 0u64;
        for (name, (bucket, keep, ask, critical)) in ["requests", "tokens"].iter().zip(dims) {
            let Some(b) = bucket else { continue };
            call.key(self.names.limit(limits.identity(), name));
            #[allow(clippy::cast_precision_loss)]
            let per_ms = b.per_minute as f64 / 60_000.0;
            call.arg(b.capacity)
                .arg(per_ms)
                .arg(ask)
                .arg(keep)
                .arg(critical);
            // A full refill, and a grace: then nothing is left behind.
            let refill = b.capacity.saturating_mul(60_000) / b.per_minute.max(1);
            ttl_ms = ttl_ms.max(refill.saturating_add(60_000));
        }
        call.arg(ttl_ms.max(1));
        let out = bounded(self.timeout, call.invoke_async::<Vec<i64>>(&mut self.conn)).await?;
        let mut grant = Grant::default();
        let mut at = out.chunks(5);
        let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
        for (i, (bucket, ..)) in dims.iter().enumerate() {
            if bucket.is_none() {
                continue;
            }
            let Some(&[any, wait, critical, critical_wait, reserved]) = at.next() else {
                break;
            };
            let (any, critical) = (
                u64::try_from(any).unwrap_or(0),
                u64::try_from(critical).unwrap_or(0),
            );
            if i == 0 {
                grant.any.requests = any;
                grant.critical.requests = critical;
            } else {
                grant.any.tokens = any;
                grant.critical.tokens = critical;
            }
            grant.wait = grant.wait.max(ms(wait));
            grant.critical_wait = grant.critical_wait.max(ms(critical_wait));
            grant.reserved |= reserved == 1;
        }
        Ok(grant)
    }
}

/// What the subscription carries.
#[derive(Debug)]
pub enum Heard {
    /// Another replica's fact (health, keys, cooldowns).
    Fact(Message),
    /// Anything else, as its text: a notice for another part of the state
    /// (the response store's deletions).
    Other(String),
}

/// The next message of the subscription.
///
/// # Errors
/// [`StoreError::Closed`] once it ends.
pub async fn next_message(stream: &mut PubSubStream) -> Result<Heard, StoreError> {
    let msg = stream.next().await.ok_or(StoreError::Closed)?;
    let text: String = msg.get_payload().unwrap_or_default();
    Ok(match serde_json::from_str(&text) {
        Ok(message) => Heard::Fact(message),
        Err(_) => Heard::Other(text),
    })
}
