//! `POST /v1/messages/count_tokens` at a provider: the first target of the
//! task whose protocol counts tokens (Anthropic) and is not DOWN is asked;
//! any failure leaves the caller to answer from switchyard's own estimate.
//! A count is no answer: it feeds neither health nor the buckets.

use std::sync::atomic::AtomicU32;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::Value;
use tokio::time::{timeout, Instant};
use tracing::debug;

use crate::health::State;
use crate::snapshot::{KeySet, Task};
use crate::upstream::{Operation, Outgoing};

/// Largest count answer read (it is one small JSON object).
const MAX_ANSWER: usize = 64 * 1024;

/// A provider's count of a prompt.
#[derive(Debug)]
pub struct Counted {
    /// `input_tokens`, as the provider counted them.
    pub tokens: u64,
    /// The target that counted.
    pub target: String,
}

/// Asks the task's first counting target for `body`'s count (the client's
/// request, already validated), with `model` set to the target's.
pub async fn at_provider(
    task: &Task,
    client: &HeaderMap,
    body: &[u8],
    request_id: &HeaderValue,
) -> Option<Counted> {
    let target = task.chain.iter().find(|t| {
        t.provider.endpoint.urls.count_tokens.is_some() && t.health.state() != State::Down
    })?;
    let provider = &target.provider;
    let key = provider
        .pick_key(Instant::now(), 0, KeySet::default(), false)
        .ok()?;
    let credential = key
        .and_then(|i| provider.keys.get(i))
        .and_then(|k| k.credential.as_ref());
    let mut object: serde_json::Map<String, Value> = serde_json::from_slice(body).ok()?;
    object.insert("model".into(), Value::String(target.model.clone()));
    let resends = AtomicU32::new(0);
    let sent = provider.endpoint.send(Outgoing {
        op: Operation::CountTokens,
        model: &target.model,
        credential,
        body: Bytes::from(Value::Object(object).to_string()),
        request_id: Some(request_id),
        client: Some(client),
        stream: false,
        native: true,
        resends: &resends,
    });
    let read = async {
        let response = sent.await.ok()?;
        if response.status() != StatusCode::OK {
            debug!(target = %target.name, status = %response.status(), "count_tokens refused");
            return None;
        }
        let bytes = crate::body::read_all(response.into_body(), MAX_ANSWER)
            .await
            .ok()?;
        serde_json::from_slice::<Value>(&bytes).ok()?["input_tokens"].as_u64()
    };
    let tokens = timeout(provider.timeout, read).await.ok().flatten()?;
    Some(Counted {
        tokens,
        target: target.name.clone(),
    })
}
