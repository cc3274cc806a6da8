//! The responses switchyard produced for Responses clients (`store`, the
//! default there), kept so that `previous_response_id` continues a
//! conversation and `GET` / `DELETE /v1/responses/{id}` answer: in process,
//! bounded by bytes, each entry living `TTL`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// How long a stored response can be continued or fetched.
pub const TTL: Duration = Duration::from_secs(60 * 60);
/// The store's bound, in bytes of JSON held.
pub const MAX_BYTES: u64 = 64 << 20;

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    /// The response object, as the client got it.
    pub response: Value,
    /// The conversation up to and including this response's output, as chat
    /// messages (without `instructions`, which a continuation does not inherit).
    pub conversation: Vec<Value>,
}

/// The store (cheap to clone: one cache).
#[derive(Clone)]
pub struct ResponseStore(moka::sync::Cache<String, Arc<Stored>>);

impl std::fmt::Debug for ResponseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStore")
            .field("entries", &self.0.entry_count())
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
            .weigher(|id: &String, stored: &Arc<Stored>| {
                let bytes = id.len()
                    + json_len(&stored.response)
                    + stored.conversation.iter().map(json_len).sum::<usize>();
                u32::try_from(bytes).unwrap_or(u32::MAX)
            })
            .time_to_live(ttl)
            .build();
        Self(cache)
    }

    /// The response stored as `id`, if it is still there.
    #[must_use]
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.0.get(id)
    }

    /// Keeps `stored` as `id`.
    pub fn put(&self, id: String, stored: Stored) {
        self.0.insert(id, Arc::new(stored));
    }

    /// Forgets `id`; whether it was there.
    pub fn delete(&self, id: &str) -> bool {
        self.0.remove(id).is_some()
    }
}

/// The length of a value's JSON text, without writing it anywhere.
fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_store_keeps_deletes_and_stays_within_its_bytes() {
        let store = ResponseStore::new(10_000, TTL);
        store.put(
            "resp_1".into(),
            Stored {
                response: json!({"id": "resp_1"}),
                conversation: vec![json!({"role": "user", "content": "hi"})],
            },
        );
        assert_eq!(store.get("resp_1").unwrap().conversation.len(), 1);
        assert!(store.delete("resp_1"));
        assert!(store.get("resp_1").is_none() && !store.delete("resp_1"));
        for i in 0..1000 {
            let big = "x".repeat(100);
            store.put(
                format!("resp_{i}"),
                Stored {
                    response: json!({"t": big}),
                    conversation: vec![],
                },
            );
        }
        store.0.run_pending_tasks();
        assert!(
            store.0.weighted_size() <= 10_000,
            "{}",
            store.0.weighted_size()
        );
        assert!(store.0.entry_count() < 1000);
    }
}
