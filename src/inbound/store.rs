//! The responses switchyard produced for Responses clients (`store`, the
//! default there), kept so that `previous_response_id` continues a
//! conversation and `GET` / `DELETE /v1/responses/{id}` answer: in process,
//! bounded by bytes, each entry living `TTL`; with `shared_state`, also in
//! the shared store (written behind the answer, read on a local miss within
//! the store's timeout), so that any replica continues a conversation. A
//! deletion is announced on the shared channel, and every replica forgets
//! its copy.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::timeout;

/// How long a stored response can be continued or fetched.
pub const TTL: Duration = Duration::from_secs(60 * 60);
/// The store's bound, in bytes of JSON held.
pub const MAX_BYTES: u64 = 64 << 20;

/// What the cache itself keeps per entry, beyond the id and the JSON
/// (moka's node, its deque and timer links, the `Bytes` handle).
const ENTRY_OVERHEAD: usize = 256;

/// A miss in the shared store is asked again after this long: the replica
/// that made the response writes it behind its answer, and a client that
/// continues at once on another replica can arrive before the write.
const WRITE_GRACE: Duration = Duration::from_millis(40);

/// How long a deleted id is remembered, so that a fetch from the shared
/// store that crossed its deletion does not bring it back.
const TOMBSTONE_TTL: Duration = Duration::from_secs(30);

/// The shared channel's notice that a response was deleted.
#[derive(Serialize, Deserialize)]
struct Deleted<'a> {
    #[serde(borrow)]
    forget_response: std::borrow::Cow<'a, str>,
}

/// One stored response.
#[derive(Debug, Deserialize)]
pub struct Stored {
    /// The response object, as the client got it (its JSON text: it is only
    /// ever sent back, and its output is the conversation's last turn).
    pub response: Box<RawValue>,
    /// The conversation before this response's output, as chat messages
    /// (without `instructions`, which a continuation does not inherit).
    #[serde(default)]
    pub earlier: Vec<Value>,
    /// The whole conversation, the response's output included, as a replica
    /// of an older version wrote it (entries live [`TTL`]).
    #[serde(default)]
    pub conversation: Option<Vec<Value>>,
}

impl Stored {
    /// A stored response's JSON: `response` (JSON text, written as it is)
    /// and the conversation before it, written without a copy of either.
    /// The response's own turn is read from its output when a continuation
    /// asks for it: most stored responses are never continued.
    #[must_use]
    pub fn json(response: &str, earlier: &[Value]) -> Bytes {
        let mut out = Vec::with_capacity(response.len() + 64);
        out.extend_from_slice(b"{\"response\":");
        out.extend_from_slice(response.as_bytes());
        out.extend_from_slice(b",\"earlier\":[");
        for (i, message) in earlier.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // Writing a `Value` into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut out, message);
        }
        out.extend_from_slice(b"]}");
        Bytes::from(out)
    }
}

/// The store (cheap to clone: one cache, one link).
#[derive(Clone)]
pub struct ResponseStore {
    /// Kept as compact JSON: what the bound counts is what is held (a
    /// `Value` tree takes several times its text).
    local: moka::sync::Cache<String, Bytes>,
    /// Ids deleted lately, here or on another replica.
    deleted: moka::sync::Cache<String, ()>,
    shared: Arc<ArcSwapOption<Link>>,
}

/// The shared store, while it is connected.
struct Link {
    conn: MultiplexedConnection,
    /// `{key_prefix}:response:`.
    prefix: String,
    /// The shared state's pub/sub channel (deletions are announced there).
    channel: String,
    timeout: Duration,
}

impl std::fmt::Debug for ResponseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStore")
            .field("entries", &self.local.entry_count())
            .field("shared", &self.shared.load().is_some())
            .finish()
    }
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(MAX_BYTES, TTL)
    }
}

impl ResponseStore {
    /// A store of at most `max_bytes`, entries living `ttl`.
    #[must_use]
    pub fn new(max_bytes: u64, ttl: Duration) -> Self {
        let cache = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|id: &String, json: &Bytes| {
                let bytes = id.len() + json.len() + ENTRY_OVERHEAD;
                u32::try_from(bytes).unwrap_or(u32::MAX)
            })
            .time_to_live(ttl)
            // Least recently used goes first. The default (TinyLFU) admits a
            // new entry only if it looks more used than the one it would
            // evict, so a full store refused the responses it had just made,
            // the likeliest to be continued.
            .eviction_policy(moka::policy::EvictionPolicy::lru())
            .build();
        Self {
            local: cache,
            deleted: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(TOMBSTONE_TTL)
                .build(),
            shared: Arc::default(),
        }
    }

    /// Shares responses through `conn` (keys under `key_prefix`, deletions
    /// announced on `channel`), each call within `limit`; `None` when the
    /// store is lost.
    pub fn link(
        &self,
        conn: Option<MultiplexedConnection>,
        key_prefix: &str,
        channel: String,
        limit: Duration,
    ) {
        self.shared.store(conn.map(|conn| {
            Arc::new(Link {
                conn,
                prefix: format!("{key_prefix}:response:"),
                channel,
                timeout: limit,
            })
        }));
    }

    /// A notice heard on the shared channel: a response deleted on some
    /// replica is forgotten here too.
    pub fn heard(&self, notice: &str) {
        if let Ok(Deleted { forget_response }) = serde_json::from_str(notice) {
            self.local.remove(forget_response.as_ref());
            self.deleted.insert(forget_response.into_owned(), ());
        }
    }

    /// Whether the shared store is linked.
    #[must_use]
    pub fn is_shared(&self) -> bool {
        self.shared.load().is_some()
    }

    /// The response stored as `id`, if this process has it.
    #[must_use]
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        let json = self.local.get(id)?;
        serde_json::from_slice(&json).ok().map(Arc::new)
    }

    /// The response stored as `id`, asking the shared store on a local miss
    /// (a failed or slow store is a miss).
    pub async fn fetch(&self, id: &str) -> Option<Arc<Stored>> {
        if let Some(found) = self.get(id) {
            return Some(found);
        }
        let link = self.shared.load_full()?;
        let mut conn = link.conn.clone();
        let key = format!("{}{id}", link.prefix);
        let mut bytes: Option<Vec<u8>> = timeout(link.timeout, conn.get(&key)).await.ok()?.ok()?;
        if bytes.is_none() {
            tokio::time::sleep(WRITE_GRACE).await;
            bytes = timeout(link.timeout, conn.get(&key)).await.ok()?.ok()?;
        }
        let bytes = Bytes::from(bytes?);
        let stored: Stored = serde_json::from_slice(&bytes).ok()?;
        if self.deleted.contains_key(id) {
            // Read just before a deletion this replica has heard of.
            return None;
        }
        self.local.insert(id.to_owned(), bytes);
        Some(Arc::new(stored))
    }

    /// Keeps `json` ([`Stored::json`]) as `id` (and writes it to the shared
    /// store behind the answer).
    pub fn put(&self, id: String, json: Bytes) {
        if let Some(link) = self.shared.load_full() {
            let key = format!("{}{id}", link.prefix);
            let bytes = json.clone();
            spawn(async move {
                let mut conn = link.conn.clone();
                let write = conn.set_ex::<_, _, ()>(key, bytes.as_ref(), TTL.as_secs());
                let _ = timeout(link.timeout, write).await;
            });
        }
        self.local.insert(id, json);
    }

    /// Forgets `id` here and in the shared store, and tells the other
    /// replicas to forget their copies (within the store's timeout: a lost
    /// store forgets it here only); whether this process had it.
    pub async fn delete(&self, id: &str) -> bool {
        let had = self.local.remove(id).is_some();
        self.deleted.insert(id.to_owned(), ());
        if let Some(link) = self.shared.load_full() {
            let notice = Deleted {
                forget_response: id.into(),
            };
            let notice = serde_json::to_string(&notice).unwrap_or_default();
            let mut pipe = redis::pipe();
            pipe.del(format!("{}{id}", link.prefix)).ignore();
            pipe.publish(&link.channel, notice).ignore();
            let mut conn = link.conn.clone();
            let _ = timeout(link.timeout, pipe.query_async::<()>(&mut conn)).await;
        }
        had
    }
}

/// Runs `work` on the current runtime, if there is one (there always is
/// while serving; a linked store outside one drops the write).
fn spawn(work: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(work);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_deletion_heard_from_another_replica_is_forgotten_here() {
        let store = ResponseStore::new(10_000, TTL);
        store.put("resp_0".into(), Stored::json("{}", &[]));
        store.heard(r#"{"from":"replica-2","record":{}}"#);
        assert!(
            store.get("resp_0").is_some(),
            "another notice forgets nothing"
        );
        for id in ["resp_1", r#"resp_"quoted"\"#] {
            store.put(id.into(), Stored::json("{}", &[]));
            let notice = Deleted {
                forget_response: id.into(),
            };
            store.heard(&serde_json::to_string(&notice).unwrap());
            assert!(store.get(id).is_none(), "{id}");
            // A fetch that crossed the deletion will not bring it back.
            assert!(store.deleted.contains_key(id), "{id}");
        }
    }

    #[tokio::test]
    async fn the_store_keeps_deletes_and_stays_within_its_bytes() {
        let store = ResponseStore::new(10_000, TTL);
        let user = json!({"role": "user", "content": "hi"});
        store.put(
            "resp_1".into(),
            Stored::json(r#"{"id": "resp_1"}"#, &[user]),
        );
        let stored = store.get("resp_1").unwrap();
        assert_eq!(stored.response.get(), r#"{"id": "resp_1"}"#);
        assert_eq!(stored.earlier, [json!({"role": "user", "content": "hi"})]);
        assert!(store.delete("resp_1").await);
        assert!(store.get("resp_1").is_none() && !store.delete("resp_1").await);
        for i in 0..1000 {
            let big = "x".repeat(100);
            let response = json!({ "t": big }).to_string();
            store.put(format!("resp_{i}"), Stored::json(&response, &[]));
        }
        store.local.run_pending_tasks();
        assert!(
            store.local.weighted_size() <= 10_000,
            "{}",
            store.local.weighted_size()
        );
        assert!(store.local.entry_count() < 1000);
        // The newest responses are the ones kept: a response just made is
        // the likeliest to be continued.
        for i in 990..1000 {
            assert!(
                store.get(&format!("resp_{i}")).is_some(),
                "resp_{i} was not kept"
            );
        }
    }
}
