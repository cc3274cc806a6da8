//! Active probes: every DOWN target gets a minimal real request (`max_tokens:
//! 1`, one short user message) each `probe.interval`, through its provider's
//! client, key and timeout.
//!
//! Any status below 500 counts as reachable and restores the target (seed
//! lesson: judging by 200 would read a 401 or a "balance exhausted" body as
//! an outage and keep a reachable upstream down forever; the error table, not
//! the prober, decides what such answers mean for real traffic).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{timeout, Instant};
use tracing::{debug, info};

use crate::metrics as m;
use crate::proxy::log_transition;
use crate::server::App;
use crate::snapshot::Target;
use crate::upstream;

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
            for target in snapshot.targets.values() {
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
    let provider = &target.provider;
    let body = serde_json::json!({
        "model": target.model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "ping"}],
    });
    let reachable =
        match upstream::chat_request(provider, Bytes::from(body.to_string()), None, false) {
            Ok(req) => {
                let call = async {
                    let resp = provider.client.request(req).await.ok()?;
                    // Only the status matters; the body is dropped unread (a hostile
                    // upstream could send gigabytes).
                    Some(resp.status())
                };
                match timeout(provider.timeout, call).await {
                    Ok(Some(status)) => status.as_u16() < 500,
                    _ => false,
                }
            }
            Err(_) => false,
        };
    let result = if reachable {
        "reachable"
    } else {
        "unreachable"
    };
    debug!(target = %target.name, result, "probe");
    metrics::counter!(m::PROBES, "target" => target.name.clone(), "result" => result).increment(1);
    if let Some(t) = target.health.record_probe(Instant::now(), reachable) {
        info!(target = %target.name, "probe found the target reachable");
        log_transition(&target, t);
    }
    reachable
}
