//! Answers already paid for: a task's cache of whole answers (`cache:` in
//! `routes.yaml`), found by the request as it affects the answer
//! ([`key`]), served instead of an upstream call while fresh (`ttl`), and
//! as the last answer when the walk ends without one (`stale_if_error`).
//!
//! Each task's entries live in process, bounded by bytes (moka, with the
//! entry's size as its weight), and outlive reloads that keep the task's
//! bounds. With `shared_state` they are also written to the shared store
//! (compressed, under the key prefix, expiring with the entry) behind the
//! answer, and read from it on a local miss within the store's timeout: a
//! replica serves what another paid for, and a store that is down or slow
//! is a miss, never an error.
//!
//! Only whole answers are kept: a `200` completion the walk delivered, or a
//! stream that ended complete on the target it started on ([`Collector`]).
//! Errors, interrupted or continued streams and answers that broke the tool
//! call contract never reach [`Fill`].

mod collect;
pub mod key;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use bytes::{Bytes, BytesMut};
use metrics::{Counter, Gauge};
use redis::aio::MultiplexedConnection;
use redis::AsyncCommands;
use serde_json::Value;
use tokio::time::timeout;

pub use collect::Collector;
pub use key::{Directives, Key, Keyed, Prompt};

use crate::metrics::{self as m, Family, Metrics};
use crate::native::Protocol;

/// The values of `cache.mode`.
pub const MODES: &[&str] = &["exact", "semantic"];

/// What a task's semantic index may hold beyond its answers: prompt vectors,
/// at most this share of `max_bytes` (the oldest go first).
const INDEX_SHARE: u64 = 4;

/// What the cache itself keeps per entry beyond the answer (moka's node,
/// its deque and timer links, the key, the `Arc`, the allocator's share):
/// measured, 20,000 entries of 255-byte answers grew a young process's RSS
/// by about 1,040 bytes each (BENCHMARKS.md, "The cache").
const ENTRY_OVERHEAD: usize = 768;

/// A task's `cache:` as compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// How long an answer is served as fresh.
    pub ttl: Duration,
    /// How old an answer may be and still be served when no target
    /// answers (zero: never).
    pub stale_if_error: Duration,
    /// The bound of the task's entries, in bytes.
    pub max_bytes: u64,
    /// Requests that sample (`temperature` absent or above 0, no `seed`)
    /// are cached too (`cache_nondeterministic`).
    pub nondeterministic: bool,
    /// `mode: semantic`: a stored answer to a prompt that means the same.
    pub semantic: Option<SemanticPolicy>,
}

/// `cache.semantic` as compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticPolicy {
    /// The embeddings task a prompt is embedded with.
    pub embeddings: String,
    /// The least cosine similarity of a hit.
    pub threshold: f64,
    /// A conversation of more turns is looked up exactly only.
    pub max_messages: usize,
    /// A semantic match may be the stale answer too.
    pub stale: bool,
}

/// A prompt's place in the semantic index: the rest of its request, and
/// its embedding.
#[derive(Debug, Clone)]
pub struct Near {
    /// The key of the request without its conversation.
    pub rest: Key,
    /// The conversation's embedding.
    pub vector: Arc<[f32]>,
}

impl Near {
    /// The cosine similarity of two prompts' vectors (`None`: other sizes).
    fn similarity(&self, other: &Near) -> Option<f64> {
        use simsimd::SpatialSimilarity as _;
        // simsimd gives the cosine distance, 1 - similarity.
        f32::cosine(&self.vector, &other.vector).map(|d| 1.0 - d)
    }

    fn bytes(&self) -> u64 {
        (self.vector.len() * std::mem::size_of::<f32>()) as u64 + 64
    }
}

/// One indexed prompt and the answer it got.
#[derive(Debug)]
struct Indexed {
    near: Near,
    key: Key,
}

impl Policy {
    /// How long an entry is kept: fresh, then for the stale answer.
    #[must_use]
    pub fn retention(&self) -> Duration {
        self.ttl.max(self.stale_if_error)
    }
}

/// One stored answer: a `chat.completion`, its `id` left out so that each
/// hit gets its own.
#[derive(Debug)]
pub struct Entry {
    /// The completion's JSON up to its `id` value, and after it.
    head: Bytes,
    tail: Bytes,
    /// Unix milliseconds when it was stored (replicas agree on wall time).
    stored_at: u64,
    /// Its usage as the target reported it, for the tokens a hit saves.
    usage: Option<(u64, u64)>,
    /// What it cost, in USD, for the cost a hit saves.
    usd: f64,
}

impl Entry {
    /// A whole completion as an entry; `None` for a body that is not one (no
    /// choice, a choice without its finish), or that is no answer to replay:
    /// a choice a content filter stopped, or one with nothing in it.
    fn of(mut completion: Value, usd: f64, stored_at: u64) -> Option<Self> {
        let choices = completion.get("choices")?.as_array()?;
        let whole = !choices.is_empty() && choices.iter().all(replayable);
        if !whole || completion.get("error").is_some() {
            return None;
        }
        let usage = completion.get("usage").map(|u| {
            let n = |f: &str| u.get(f).and_then(Value::as_u64).unwrap_or(0);
            (n("prompt_tokens"), n("completion_tokens"))
        });
        // A placeholder no answer can contain marks where each hit's id goes.
        let placeholder = format!("switchyard-cache-{:032x}", rand::random::<u128>());
        completion["id"] = Value::String(placeholder.clone());
        let json = serde_json::to_vec(&completion).ok()?;
        let at = memchr::memmem::find(&json, placeholder.as_bytes())?;
        let json = Bytes::from(json);
        Some(Self {
            head: json.slice(..at),
            tail: json.slice(at + placeholder.len()..),
            stored_at,
            usage,
            usd,
        })
    }

    /// The completion with a fresh `id`.
    #[must_use]
    pub fn completion(&self) -> Bytes {
        let id = format!("chatcmpl-{:024x}", rand::random::<u128>() >> 32);
        let mut out = BytesMut::with_capacity(self.head.len() + id.len() + self.tail.len());
        out.extend_from_slice(&self.head);
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&self.tail);
        out.freeze()
    }

    /// How old it is.
    #[must_use]
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.stored_at))
    }

    /// Bytes it holds, as the bound counts them.
    fn weight(&self) -> u32 {
        let bytes = self.head.len() + self.tail.len() + ENTRY_OVERHEAD;
        u32::try_from(bytes).unwrap_or(u32::MAX)
    }

    /// Its form in the shared store: compressed JSON.
    fn to_wire(&self) -> Option<Vec<u8>> {
        let mut completion = Vec::with_capacity(self.head.len() + self.tail.len() + 2);
        completion.extend_from_slice(&self.head);
        completion.extend_from_slice(b"cached");
        completion.extend_from_slice(&self.tail);
        let completion: Value = serde_json::from_slice(&completion).ok()?;
        let wire = serde_json::json!({"completion": completion, "stored_at": self.stored_at, "usd": self.usd});
        zstd::bulk::compress(&serde_json::to_vec(&wire).ok()?, 3).ok()
    }

    fn from_wire(bytes: &[u8]) -> Option<Self> {
        // The bound of what one answer may be when decompressed.
        const MAX_WIRE: usize = 16 << 20;
        let json = zstd::bulk::decompress(bytes, MAX_WIRE).ok()?;
        let mut wire: Value = serde_json::from_slice(&json).ok()?;
        let stored_at = wire.get("stored_at")?.as_u64()?;
        let usd = wire.get("usd").and_then(Value::as_f64).unwrap_or(0.0);
        Self::of(wire.get_mut("completion")?.take(), usd, stored_at)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A task's entries in process: kept across reloads while the task's
/// bounds stay (`snapshot::live`).
#[derive(Debug)]
pub struct Store {
    local: moka::sync::Cache<Key, Arc<Entry>>,
    /// The semantic index: prompts and their answers' keys, oldest first,
    /// with the bytes they hold and their bound.
    index: parking_lot::RwLock<(std::collections::VecDeque<Indexed>, u64)>,
    index_max_bytes: u64,
}

impl Store {
    /// A store of at most `max_bytes`, each entry kept `retention`.
    #[must_use]
    pub fn new(max_bytes: u64, retention: Duration) -> Self {
        let local = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &Key, entry: &Arc<Entry>| entry.weight())
            .time_to_live(retention)
            .build();
        Self {
            local,
            index: parking_lot::RwLock::default(),
            index_max_bytes: max_bytes / INDEX_SHARE,
        }
    }

    /// Indexes the prompt `near` of the answer kept as `key`.
    fn index(&self, near: Near, key: Key) {
        let mut index = self.index.write();
        index.1 += near.bytes();
        index.0.push_back(Indexed { near, key });
        while index.1 > self.index_max_bytes {
            let Some(old) = index.0.pop_front() else {
                break;
            };
            index.1 = index.1.saturating_sub(old.near.bytes());
        }
    }

    /// The kept answers whose prompts are at least `threshold` similar to
    /// `near`'s (and agree on the rest of the request), the most similar first.
    fn nearest(&self, near: &Near, threshold: f64) -> Vec<(f64, Key)> {
        let index = self.index.read();
        let mut found: Vec<(f64, Key)> = index
            .0
            .iter()
            .filter(|i| i.near.rest == near.rest)
            .filter_map(|i| Some((i.near.similarity(near)?, i.key)))
            .filter(|(similarity, _)| *similarity >= threshold)
            .collect();
        found.sort_by(|a, b| b.0.total_cmp(&a.0));
        found
    }
}

/// The shared store, while `shared_state` is connected (one per gateway).
#[derive(Default)]
pub struct Link(ArcSwapOption<Shared>);

struct Shared {
    conn: MultiplexedConnection,
    /// `{key_prefix}:cache:`.
    prefix: String,
    timeout: Duration,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Link")
            .field(&self.0.load().is_some())
            .finish()
    }
}

impl Link {
    /// Shares entries through `conn` (keys under `key_prefix`), each call
    /// within `limit`; `None` when the store is lost.
    pub fn set(&self, conn: Option<MultiplexedConnection>, key_prefix: &str, limit: Duration) {
        self.0.store(conn.map(|conn| {
            Arc::new(Shared {
                conn,
                prefix: format!("{key_prefix}:cache:"),
                timeout: limit,
            })
        }));
    }
}

impl Shared {
    fn key(&self, key: &Key) -> String {
        use std::fmt::Write as _;
        let mut name = String::with_capacity(self.prefix.len() + 64);
        name.push_str(&self.prefix);
        for byte in key {
            let _ = write!(name, "{byte:02x}");
        }
        name
    }
}

/// A task's cache: its policy, its entries, its series.
#[derive(Debug)]
pub struct TaskCache {
    /// What `cache:` says.
    pub policy: Policy,
    task: String,
    store: Arc<Store>,
    link: Arc<Link>,
    metrics: CacheMetrics,
}

#[derive(Debug)]
struct CacheMetrics {
    requests: Family<&'static str>,
    entries: Gauge,
    bytes: Gauge,
    saved_prompt: Counter,
    saved_completion: Counter,
    saved_usd: Gauge,
}

/// What the cache makes of one request, before the walk.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    keyed: Option<Keyed>,
    /// Look for a stored answer.
    lookup: bool,
    /// Keep this answer.
    store: bool,
    /// The oldest fresh answer the client takes.
    max_age: Duration,
}

impl Ask {
    /// Whether a stored answer is looked for (else the request bypasses the cache).
    #[must_use]
    pub fn lookup(&self) -> bool {
        self.lookup
    }
}

/// A stored answer found for a request.
#[derive(Debug)]
pub struct Hit {
    /// The answer.
    pub entry: Arc<Entry>,
    /// Its age when found.
    pub age: Duration,
    /// For a semantic match, how similar its prompt was.
    pub similarity: Option<f64>,
}

impl TaskCache {
    /// The cache of `task`, on `store`, sharing through `link`.
    #[must_use]
    pub fn new(
        task: &str,
        policy: Policy,
        store: Arc<Store>,
        link: Arc<Link>,
        metrics: &Metrics,
    ) -> Self {
        let label = || [("task", task.to_owned().into())];
        let kind = |k: &'static str| [("task", task.to_owned().into()), ("kind", k.into())];
        let metrics = CacheMetrics {
            requests: metrics.family(m::CACHE_REQUESTS, &label(), &["result"]),
            entries: metrics.gauge(m::CACHE_ENTRIES, &label()),
            bytes: metrics.gauge(m::CACHE_BYTES, &label()),
            saved_prompt: metrics.counter(m::CACHE_SAVED_TOKENS, &kind("prompt")),
            saved_completion: metrics.counter(m::CACHE_SAVED_TOKENS, &kind("completion")),
            saved_usd: metrics.gauge(m::CACHE_SAVED_COST, &label()),
        };
        Self {
            policy,
            task: task.to_owned(),
            store,
            link,
            metrics,
        }
    }

    /// Reads a request: its key (from the client's own body, so that what a
    /// translation leaves out still counts, and the client `headers` that go
    /// upstream as sent, `forwarded`), whether it may be looked up and
    /// stored (a sampling request only with `cache_nondeterministic`; the
    /// client's `Cache-Control`).
    #[must_use]
    pub fn ask(
        &self,
        protocol: Protocol,
        body: &[u8],
        headers: &http::HeaderMap,
        forwarded: &http::HeaderMap,
    ) -> Ask {
        let keyed = key::of(&self.task, protocol, body, forwarded);
        let cacheable =
            keyed.is_some_and(|k| k.keepable && (!k.samples || self.policy.nondeterministic));
        let directives = Directives::of(headers);
        let max_age = directives.max_age.map_or(self.policy.ttl, |s| {
            self.policy.ttl.min(Duration::from_secs(s))
        });
        Ask {
            keyed,
            lookup: cacheable && !directives.no_cache,
            store: cacheable && !directives.no_store,
            max_age,
        }
    }

    /// A fresh answer for the request, if one is stored (here, else in the
    /// shared store).
    pub async fn fresh(&self, ask: &Ask) -> Option<Hit> {
        if !ask.lookup {
            return None;
        }
        let hit = self.find(ask.keyed?.key).await?;
        (hit.age <= ask.max_age).then_some(hit)
    }

    /// An answer at most `stale_if_error` old, for a request no target
    /// answered (whatever the client's `no-cache`: it asked for a fresh
    /// answer, and none can be had).
    pub async fn stale(&self, ask: &Ask) -> Option<Hit> {
        let keyed = ask.keyed.filter(|k| k.keepable)?;
        if self.policy.stale_if_error.is_zero() || (keyed.samples && !self.policy.nondeterministic)
        {
            return None;
        }
        let hit = self.find(keyed.key).await?;
        (hit.age <= self.policy.stale_if_error).then_some(hit)
    }

    async fn find(&self, key: Key) -> Option<Hit> {
        let entry = match self.store.local.get(&key) {
            Some(entry) => entry,
            None => self.fetch(key).await?,
        };
        let age = entry.age();
        Some(Hit {
            entry,
            age,
            similarity: None,
        })
    }

    /// The prompt a semantic lookup embeds: when the task looks up by
    /// meaning, the request may be cached, and its conversation has no more
    /// turns than `max_messages`.
    #[must_use]
    pub fn prompt(
        &self,
        ask: &Ask,
        protocol: Protocol,
        body: &[u8],
        chat: &[u8],
    ) -> Option<Prompt> {
        let semantic = self.policy.semantic.as_ref()?;
        if !(ask.lookup || ask.store) {
            return None;
        }
        let prompt = key::prompt(&self.task, protocol, body, chat)?;
        (prompt.turns <= semantic.max_messages && !prompt.text.is_empty()).then_some(prompt)
    }

    /// A fresh answer to a prompt that means the same as `near`'s.
    #[must_use]
    pub fn similar(&self, ask: &Ask, near: &Near) -> Option<Hit> {
        let semantic = self.policy.semantic.as_ref()?;
        if !ask.lookup {
            return None;
        }
        self.nearest(near, semantic.threshold, ask.max_age)
    }

    /// An answer at most `stale_if_error` old to a prompt that means the
    /// same, when the task lets a semantic match be the stale answer.
    #[must_use]
    pub fn similar_stale(&self, near: &Near) -> Option<Hit> {
        let semantic = self.policy.semantic.as_ref().filter(|s| s.stale)?;
        if self.policy.stale_if_error.is_zero() {
            return None;
        }
        self.nearest(near, semantic.threshold, self.policy.stale_if_error)
    }

    fn nearest(&self, near: &Near, threshold: f64, max_age: Duration) -> Option<Hit> {
        self.store
            .nearest(near, threshold)
            .into_iter()
            .find_map(|(similarity, key)| {
                let entry = self.store.local.get(&key)?;
                let age = entry.age();
                (age <= max_age).then_some(Hit {
                    entry,
                    age,
                    similarity: Some(similarity),
                })
            })
    }

    /// An entry another replica stored, if the shared store has it in time.
    async fn fetch(&self, key: Key) -> Option<Arc<Entry>> {
        let shared = self.link.0.load_full()?;
        let mut conn = shared.conn.clone();
        let read = conn.get::<_, Option<Vec<u8>>>(shared.key(&key));
        let bytes = timeout(shared.timeout, read).await.ok()?.ok()??;
        let entry = Arc::new(Entry::from_wire(&bytes)?);
        if entry.age() < self.policy.retention() {
            self.store.local.insert(key, Arc::clone(&entry));
        }
        Some(entry)
    }

    /// Where the walk's answer goes, if it may be kept; `prompt_tokens`
    /// stands in for the usage of an answer that reports none.
    #[must_use]
    pub fn fill(self: &Arc<Self>, ask: &Ask, prompt_tokens: u64) -> Option<Fill> {
        let keyed = ask.keyed.filter(|_| ask.store)?;
        Some(Fill {
            cache: Arc::clone(self),
            key: keyed.key,
            prompt_tokens,
            near: None,
        })
    }

    /// Counts a request by what the cache did for it: `hit`, `miss`,
    /// `stale` or `bypass`.
    pub fn count(&self, result: &'static str) {
        self.metrics.requests.increment(result, 1);
    }

    /// Counts what a hit saved: its tokens and their cost.
    pub fn saved(&self, entry: &Entry) {
        if let Some((prompt, completion)) = entry.usage {
            self.metrics.saved_prompt.increment(prompt);
            self.metrics.saved_completion.increment(completion);
        }
        if entry.usd > 0.0 {
            self.metrics.saved_usd.increment(entry.usd);
        }
    }

    fn put(&self, key: Key, entry: Entry) {
        // One answer never takes more than an eighth of the bound: a huge
        // one would evict the rest (and moka evicts in batches, after it).
        if u64::from(entry.weight()) > self.policy.max_bytes / 8 {
            return;
        }
        let entry = Arc::new(entry);
        if let Some(shared) = self.link.0.load_full() {
            let ttl_ms = u64::try_from(self.policy.retention().as_millis()).unwrap_or(u64::MAX);
            if let (Some(wire), Ok(runtime)) =
                (entry.to_wire(), tokio::runtime::Handle::try_current())
            {
                runtime.spawn(async move {
                    let mut conn = shared.conn.clone();
                    let write = conn.pset_ex::<_, _, ()>(shared.key(&key), wire, ttl_ms);
                    let _ = timeout(shared.timeout, write).await;
                });
            }
        }
        self.store.local.insert(key, entry);
    }

    /// Sets the entries and bytes gauges (at each scrape: moka settles its
    /// counts in batches).
    pub fn publish(&self) {
        self.store.local.run_pending_tasks();
        self.metrics
            .entries
            .set(self.store.local.entry_count() as f64);
        self.metrics
            .bytes
            .set(self.store.local.weighted_size() as f64);
    }
}

/// Where one request's answer is kept, if it turns out whole.
#[derive(Debug)]
pub struct Fill {
    cache: Arc<TaskCache>,
    key: Key,
    /// The request's prompt estimate.
    prompt_tokens: u64,
    /// Its prompt's place in the semantic index, when it was embedded.
    near: Option<Near>,
}

impl Fill {
    /// Indexes the answer under its prompt's embedding too.
    #[must_use]
    pub fn near(mut self, near: Option<Near>) -> Self {
        self.near = near;
        self
    }

    /// A whole non-streamed answer (a `chat.completion` body); `usd` prices
    /// its usage.
    pub fn answer(self, body: &[u8], usd: impl Fn(u64, u64) -> f64) {
        let Ok(completion) = serde_json::from_slice::<Value>(body) else {
            return;
        };
        self.keep(completion, usd);
    }

    /// A stream that ended complete, as its collector folded it.
    pub fn stream(self, collected: Collector, usd: impl Fn(u64, u64) -> f64) {
        if let Some(completion) = collected.completion() {
            self.keep(completion, usd);
        }
    }

    fn keep(self, mut completion: Value, usd: impl Fn(u64, u64) -> f64) {
        if completion.get("usage").is_none_or(|u| !u.is_object()) {
            // A replay owes a client that asks for usage its chunk: the
            // estimate stands in, as it does in the accounting.
            let answered = estimated_completion(&completion);
            completion["usage"] = serde_json::json!({
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": answered,
                "total_tokens": self.prompt_tokens + answered,
            });
        }
        let cost = completion.get("usage").map_or(0.0, |u| {
            let n = |f: &str| u.get(f).and_then(Value::as_u64).unwrap_or(0);
            usd(n("prompt_tokens"), n("completion_tokens"))
        });
        if let Some(entry) = Entry::of(completion, cost, now_ms()) {
            self.cache.put(self.key, entry);
            if let Some(near) = self.near {
                self.cache.store.index(near, self.key);
            }
        }
    }
}

/// Whether a choice is an answer worth replaying: finished, not by a content
/// filter, and with text, a refusal or a tool call in it.
fn replayable(choice: &Value) -> bool {
    let finish = choice.get("finish_reason").and_then(Value::as_str);
    let message = choice.get("message").unwrap_or(&Value::Null);
    let said = |field: &str| {
        message
            .get(field)
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
    };
    let called = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|calls| !calls.is_empty())
        || message.get("function_call").is_some_and(Value::is_object);
    finish.is_some_and(|f| f != "content_filter") && (said("content") || said("refusal") || called)
}

/// The completion tokens of an answer's text and tool call arguments, estimated.
fn estimated_completion(completion: &Value) -> u64 {
    let choices = completion.get("choices").and_then(Value::as_array);
    let text = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .map_or(0, crate::tokens::estimate_text)
    };
    choices
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("message"))
        .map(|m| {
            let calls = m.get("tool_calls").and_then(Value::as_array);
            let arguments: u64 = calls
                .into_iter()
                .flatten()
                .map(|c| text(c.pointer("/function/arguments")))
                .sum();
            text(m.get("content")) + arguments
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(max_bytes: u64) -> Arc<TaskCache> {
        with_policy(max_bytes, None)
    }

    fn with_policy(max_bytes: u64, semantic: Option<SemanticPolicy>) -> Arc<TaskCache> {
        let policy = Policy {
            ttl: Duration::from_secs(600),
            stale_if_error: Duration::from_secs(3600),
            max_bytes,
            nondeterministic: false,
            semantic,
        };
        let store = Arc::new(Store::new(max_bytes, policy.retention()));
        let metrics = Metrics::new();
        Arc::new(TaskCache::new("t", policy, store, Arc::default(), &metrics))
    }

    fn asked(cache: &TaskCache, body: &str, cache_control: Option<&str>) -> Ask {
        let mut headers = http::HeaderMap::new();
        if let Some(v) = cache_control {
            headers.insert(http::header::CACHE_CONTROL, v.parse().unwrap());
        }
        cache.ask(
            Protocol::Chat,
            body.as_bytes(),
            &headers,
            &http::HeaderMap::new(),
        )
    }

    const ASK: &str = r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
    const ANSWER: &str = r#"{"id":"up-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;

    #[tokio::test]
    async fn a_whole_answer_is_served_again_with_a_fresh_id() {
        let cache = cache(1 << 20);
        let ask = asked(&cache, ASK, None);
        assert!(cache.fresh(&ask).await.is_none());
        cache
            .fill(&ask, 1)
            .unwrap()
            .answer(ANSWER.as_bytes(), |_, _| 0.5);
        let first = cache.fresh(&ask).await.unwrap().entry.completion();
        let second = cache.fresh(&ask).await.unwrap().entry.completion();
        let (a, b): (Value, Value) = (
            serde_json::from_slice(&first).unwrap(),
            serde_json::from_slice(&second).unwrap(),
        );
        assert_ne!(a["id"], b["id"]);
        assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(a["choices"], b["choices"]);
        assert_eq!(a["choices"][0]["message"]["content"], "hello");
        assert_eq!(cache.fresh(&ask).await.unwrap().entry.usd, 0.5);
    }

    #[tokio::test]
    async fn the_client_skips_the_lookup_or_the_write_and_sampling_is_not_cached() {
        let cache = cache(1 << 20);
        let no_store = asked(&cache, ASK, Some("no-store"));
        assert!(no_store.lookup && cache.fill(&no_store, 1).is_none());
        let no_cache = asked(&cache, ASK, Some("no-cache"));
        cache
            .fill(&no_cache, 1)
            .unwrap()
            .answer(ANSWER.as_bytes(), |_, _| 0.0);
        assert!(
            cache.fresh(&no_cache).await.is_none(),
            "no-cache: no lookup"
        );
        assert!(cache.fresh(&asked(&cache, ASK, None)).await.is_some());
        let sampling = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let ask = asked(&cache, sampling, None);
        assert!(!ask.lookup && cache.fill(&ask, 1).is_none());
        assert!(cache.stale(&ask).await.is_none());
    }

    #[tokio::test]
    async fn errors_and_unfinished_answers_are_never_kept() {
        let cache = cache(1 << 20);
        let ask = asked(&cache, ASK, None);
        for body in [
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"id":"x","choices":[]}"#,
            r#"{"id":"x","choices":[{"index":0,"message":{"content":"hal"},"finish_reason":null}]}"#,
            // No answer to replay: a filter stopped it, or nothing is in it.
            r#"{"id":"x","choices":[{"index":0,"message":{"content":"par"},"finish_reason":"content_filter"}]}"#,
            r#"{"id":"x","choices":[{"index":0,"message":{"content":""},"finish_reason":"stop"}]}"#,
            r#"{"id":"x","choices":[{"index":0,"message":{"content":null,"tool_calls":[]},"finish_reason":"stop"}]}"#,
            "not json",
        ] {
            cache
                .fill(&ask, 1)
                .unwrap()
                .answer(body.as_bytes(), |_, _| 0.0);
            assert!(cache.fresh(&ask).await.is_none(), "{body}");
        }
    }

    #[test]
    fn the_byte_bound_holds_under_ten_thousand_distinct_entries() {
        let max_bytes = 256 * 1024;
        let cache = cache(max_bytes);
        for i in 0..10_000 {
            let body =
                format!(r#"{{"messages":[{{"role":"user","content":"q{i}"}}],"temperature":0}}"#);
            let ask = asked(&cache, &body, None);
            let entry = Entry::of(serde_json::from_str(ANSWER).unwrap(), 0.0, now_ms()).unwrap();
            cache.put(ask.keyed.unwrap().key, entry);
        }
        cache.store.local.run_pending_tasks();
        let held = cache.store.local.weighted_size();
        assert!(held <= max_bytes, "{held} bytes held");
        assert!(
            cache.store.local.entry_count() > 100,
            "the bound is used, not emptied"
        );
    }

    fn semantic(max_bytes: u64) -> Arc<TaskCache> {
        let semantic = SemanticPolicy {
            embeddings: "embed".into(),
            threshold: 0.9,
            max_messages: 2,
            stale: false,
        };
        with_policy(max_bytes, Some(semantic))
    }

    fn near(cache: &TaskCache, body: &str, vector: &[f32]) -> (Ask, Near) {
        let ask = asked(cache, body, None);
        let prompt = cache
            .prompt(&ask, Protocol::Chat, body.as_bytes(), body.as_bytes())
            .unwrap();
        let near = Near {
            rest: prompt.rest,
            vector: vector.into(),
        };
        (ask, near)
    }

    #[test]
    fn a_prompt_that_means_the_same_is_a_hit_above_the_threshold_and_a_miss_below() {
        let cache = semantic(1 << 20);
        let q = |text: &str| {
            format!(r#"{{"messages":[{{"role":"user","content":"{text}"}}],"temperature":0}}"#)
        };
        let (ask, first) = near(&cache, &q("capital of France?"), &[1.0, 0.0, 0.0]);
        assert!(cache.similar(&ask, &first).is_none(), "nothing kept yet");
        cache
            .fill(&ask, 1)
            .unwrap()
            .near(Some(first))
            .answer(ANSWER.as_bytes(), |_, _| 0.0);
        let (ask, close) = near(&cache, &q("France's capital?"), &[0.99, 0.1, 0.0]);
        let hit = cache.similar(&ask, &close).expect("cos 0.995 is above 0.9");
        assert!(hit.similarity.unwrap() > 0.99, "{:?}", hit.similarity);
        let (ask, far) = near(&cache, &q("how tall is Everest?"), &[0.3, 0.95, 0.0]);
        assert!(cache.similar(&ask, &far).is_none(), "cos 0.3 is below");
        // The same prompt with other parameters is another question.
        let other = r#"{"messages":[{"role":"user","content":"capital of France?"}],"temperature":0,"max_tokens":1}"#;
        let (ask, same_words) = near(&cache, other, &[1.0, 0.0, 0.0]);
        assert!(cache.similar(&ask, &same_words).is_none());
        // Vectors of another size never match.
        let (ask, other_size) = near(&cache, &q("capital of France?"), &[1.0, 0.0]);
        assert!(cache.similar(&ask, &other_size).is_none());
    }

    #[test]
    fn a_long_conversation_is_looked_up_exactly_only_and_the_index_is_bounded() {
        let cache = semantic(64 * 1024);
        let long = r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}],"temperature":0}"#;
        let ask = asked(&cache, long, None);
        assert!(cache
            .prompt(&ask, Protocol::Chat, long.as_bytes(), long.as_bytes())
            .is_none());
        let body = r#"{"messages":[{"role":"user","content":"x"}],"temperature":0}"#;
        for i in 0..1000 {
            let (ask, n) = near(&cache, body, &[i as f32; 64]);
            cache.store.index(n, ask.keyed.unwrap().key);
        }
        let index = cache.store.index.read();
        assert!(index.1 <= 64 * 1024 / INDEX_SHARE, "{} bytes", index.1);
        assert!(index.0.len() > 10);
    }

    #[test]
    fn an_entry_survives_the_shared_store_s_wire_form() {
        let entry = Entry::of(serde_json::from_str(ANSWER).unwrap(), 0.25, 42).unwrap();
        let back = Entry::from_wire(&entry.to_wire().unwrap()).unwrap();
        assert_eq!(
            (back.stored_at, back.usd, back.usage),
            (42, 0.25, Some((3, 2)))
        );
        let (a, b): (Value, Value) = (
            serde_json::from_slice(&entry.completion()).unwrap(),
            serde_json::from_slice(&back.completion()).unwrap(),
        );
        assert_eq!(a["choices"], b["choices"]);
        assert!(Entry::from_wire(b"garbage").is_none());
    }
}
