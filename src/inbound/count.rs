//! `POST /v1/messages/count_tokens` at a provider: the first target of the
//! task whose protocol counts tokens (Anthropic) and is not DOWN is asked.
//! Its refusal of the request itself (400, 413) is the caller's answer;
//! any other failure leaves the caller to answer from switchyard's own
//! estimate. A count is no answer: it feeds neither health nor the buckets.

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

/// What the provider said of a count request.
#[derive(Debug)]
pub enum Said {
    /// It counted.
    Counted(Counted),
    /// It refused the request as malformed or too large: its status and
    /// error body (Anthropic's envelope), for the client.
    Refused(StatusCode, Bytes),
}

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
) -> Option<Said> {
    let target = task.chain.iter().find(|t| {
        t.provider.endpoint.urls.count_tokens.is_some() && t.health.state() != State::Down
    })?;
    let provider = &target.provider;
    let key = provider
        .pick_key(Instant::now(), (&target.model, 0), KeySet::default(), false)
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
        let status = response.status();
        // Its key, its model, its limits are the provider's business: the
        // estimate answers. The request's own faults are the client's.
        let refused = matches!(
            status,
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE
        );
        if status != StatusCode::OK && !refused {
            debug!(target = %target.name, status = %status, "count_tokens failed");
            return None;
        }
        let bytes = crate::body::read_all(response.into_body(), MAX_ANSWER)
            .await
            .ok()?;
        if refused {
            let bytes = crate::sanitize::redact_secrets(bytes, provider.secrets());
            let message = serde_json::from_slice::<Value>(&bytes).ok()?["error"]["message"]
                .as_str()
                .map(str::to_owned)?;
            return Some(Said::Refused(status, refused_body(status, &message)));
        }
        let tokens = serde_json::from_slice::<Value>(&bytes).ok()?["input_tokens"].as_u64()?;
        Some(Said::Counted(Counted {
            tokens,
            target: target.name.clone(),
        }))
    };
    timeout(provider.timeout, read).await.ok().flatten()
}

/// The provider's refusal (its keys already taken out), in Anthropic's
/// envelope.
fn refused_body(status: StatusCode, message: &str) -> Bytes {
    let error = serde_json::json!({"error": {"message": message}}).to_string();
    super::messages::error(status, error.as_bytes())
}
