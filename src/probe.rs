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

use crate::request::{ChatRequest, EmbeddingsRequest};
use crate::snapshot::Target;
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
                    key.gauge.set(key.health.state(now).gauge());
                }
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

/// Sends one probe and records its verdict. Returns whether it was reachable.
pub async fn probe(target: Arc<Target>) -> bool {
    let endpoint = &target.provider.endpoint;
    let model = TargetModel {
        model: &target.model,
        max_output: Some(1),
    };
    // An embeddings target is probed where it serves.
    let (op, body) = match target.embedding {
        None => (
            Operation::Chat,
            ChatRequest::parse(PROBE)
                .ok()
                .and_then(|request| endpoint.adapter.encode(&request, model).ok()),
        ),
        Some(_) => (
            Operation::Embeddings,
            EmbeddingsRequest::parse(EMBEDDINGS_PROBE)
                .ok()
                .and_then(|request| {
                    endpoint
                        .adapter
                        .encode_embeddings(&request, &target.model)
                        .ok()
                }),
        ),
    };
    // A provider whose keys could not be read is never called keyless.
    let body = body.filter(|_| !target.provider.keys_unreadable());
    let reachable = match body {
        Some(body) => {
            // Only the status matters; the body is dropped unread (a hostile
            // upstream could send gigabytes).
            let credential = target.provider.probe_credential();
            let resends = std::sync::atomic::AtomicU32::new(0);
            let call = endpoint.send(Outgoing {
                op,
                credential,
                body,
                request_id: None,
                stream: false,
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
