//! Active probes: every DOWN target gets a minimal real request (`max_tokens:
//! 1`, one short user message) each `probe.interval`, through its provider's
//! client, key and timeout. The same tick lets a DEGRADED target whose
//! sliding window went quiet become HEALTHY again.
//!
//! Any status below 500 counts as reachable and restores the target (seed
//! lesson: judging by 200 would read a 401 or a "balance exhausted" body as
//! an outage and keep a reachable upstream down forever; the error table, not
//! the prober, decides what such answers mean for real traffic).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout, Instant};
use tracing::{debug, info};

use crate::classify::{Outcome, Scope};
use crate::request::{ChatRequest, EmbeddingsRequest};
use crate::snapshot::{Provider, Snapshot, Target};
use crate::state::App;
use crate::upstream::{Operation, Outgoing, TargetModel};

/// The probe request, in the client's protocol; each target's adapter encodes it.
const PROBE: &[u8] = br#"{"max_tokens":1,"messages":[{"role":"user","content":"ping"}]}"#;

/// The probe of an embeddings target.
const EMBEDDINGS_PROBE: &[u8] = br#"{"input":"ping"}"#;

/// How often the prober looks for DOWN targets that are due.
const TICK: Duration = Duration::from_millis(100);

/// Runs the prober until the returned handle is aborted.
pub fn spawn(app: Arc<App>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let snapshot = app.snapshot.load_full();
            let now = Instant::now();
            for provider in snapshot.providers.values() {
                // Cooldowns end on their own; the gauge follows.
                for key in &provider.keys {
                    key.show_state(now);
                }
                reprobe_keys(&snapshot, provider, now);
            }
            for target in snapshot.targets.values() {
                // A DEGRADED target whose window went quiet is healthy again.
                target.report(target.health.forget(now, &snapshot.health));
                let Some(interval) = target.provider.probe_interval else {
                    continue;
                };
                if target.health.claim_probe(now, interval) {
                    tokio::spawn(probe(Arc::clone(target)));
                }
            }
        }
    })
}

/// How much longer than `probe.interval` a revoked key's re-probes may get
/// apart (1 min doubling to 30 min by default).
const KEY_BACKOFF_FACTOR: u32 = 30;

/// Spawns the re-probe of each revoked key of `provider` that is due: the
/// probe request with that key, through the first target of the provider.
fn reprobe_keys(snapshot: &Snapshot, provider: &Arc<Provider>, now: Instant) {
    let Some(first) = provider.probe_interval else {
        return;
    };
    let max = first.saturating_mul(KEY_BACKOFF_FACTOR);
    let Some(target) = snapshot
        .targets
        .values()
        .find(|t| Arc::ptr_eq(&t.provider, provider))
    else {
        return;
    };
    for (i, key) in provider.keys.iter().enumerate() {
        if key.credential.is_some() && key.health.claim_reprobe(now, first, max) {
            tokio::spawn(reprobe_key(Arc::clone(target), i, max));
        }
    }
}

/// Re-tests revoked key `index` of `target`'s provider: the provider
/// accepts it when the answer is not one its error table revokes a key for
/// (a 2xx, or a 4xx such as a 429: the key authenticated); a 5xx or a
/// network error proves nothing and backs off like a refusal.
async fn reprobe_key(target: Arc<Target>, index: usize, max: Duration) {
    let provider = &target.provider;
    let Some(key) = provider.keys.get(index) else {
        return;
    };
    let accepted = match probe_body(&target) {
        Some((op, body)) => {
            let resends = std::sync::atomic::AtomicU32::new(0);
            let call = provider.endpoint.send(Outgoing {
                op,
                model: &target.model,
                credential: key.credential.as_ref(),
                body,
                request_id: None,
                client: None,
                stream: false,
                native: false,
                resends: &resends,
            });
            match timeout(provider.timeout, call).await {
                Ok(Ok(resp)) => {
                    let status = resp.status().as_u16();
                    let outcome = Outcome::Response {
                        status,
                        headers: resp.headers(),
                        body: None,
                    };
                    status < 500
                        && provider
                            .errors
                            .classify(&outcome)
                            .is_none_or(|d| !(d.until_reload && d.scope == Scope::Key))
                }
                Ok(Err(_)) | Err(_) => false,
            }
        }
        None => false,
    };
    let now = Instant::now();
    if key.health.record_reprobe(now, accepted, max) {
        info!(provider = %provider.name, key = %key.name, "re-probe: the provider accepts the revoked key again");
    } else {
        debug!(provider = %provider.name, key = %key.name, accepted, "re-probe of a revoked key");
    }
    key.show_state(now);
}

/// The probe request in `target`'s protocol, and where it goes.
fn probe_body(target: &Target) -> Option<(Operation, bytes::Bytes)> {
    let endpoint = &target.provider.endpoint;
    let model = TargetModel {
        model: &target.model,
        max_output: Some(1),
    };
    match target.embedding {
        None => ChatRequest::parse(PROBE)
            .ok()
            .and_then(|request| endpoint.adapter.encode(&request, model).ok())
            .map(|body| (Operation::Chat, body)),
        Some(_) => EmbeddingsRequest::parse(EMBEDDINGS_PROBE)
            .ok()
            .and_then(|request| {
                endpoint
                    .adapter
                    .encode_embeddings(&request, &target.model)
                    .ok()
            })
            .map(|body| (Operation::Embeddings, body)),
    }
}

/// Sends one probe and records its verdict. Returns whether it was reachable.
pub async fn probe(target: Arc<Target>) -> bool {
    let endpoint = &target.provider.endpoint;
    // A provider whose keys could not be read is never called keyless.
    let body = probe_body(&target).filter(|_| !target.provider.keys_unreadable());
    let reachable = match body {
        Some((op, body)) => {
            // Only the status matters; the body is dropped unread (a hostile
            // upstream could send gigabytes).
            let credential = target.provider.probe_credential();
            let resends = std::sync::atomic::AtomicU32::new(0);
            let call = endpoint.send(Outgoing {
                op,
                model: &target.model,
                credential,
                body,
                request_id: None,
                client: None,
                stream: false,
                native: false,
                resends: &resends,
            });
            match timeout(target.provider.timeout, call).await {
                Ok(Ok(resp)) => resp.status().as_u16() < 500,
                Ok(Err(_)) | Err(_) => false,
            }
        }
        None => false,
    };
    let result = if reachable {
        "reachable"
    } else {
        "unreachable"
    };
    debug!(target = %target.name, result, "probe");
    target.metrics.probes.increment(result, 1);
    let transition = target.health.record_probe(Instant::now(), reachable);
    if transition.is_some() {
        info!(target = %target.name, "probe found the target reachable");
    }
    target.report(transition);
    reachable
}
