//! What the endpoints, the reloader and the prober share: the current
//! snapshot (swapped whole on reload), the live state that outlives
//! snapshots, the settings the gateway started with, and its handles.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;

use crate::metrics::Metrics;
use crate::snapshot::{CompileOptions, LiveState, Snapshot, Startup};

/// Shared state of one running gateway.
#[derive(Debug)]
pub struct App {
    /// The current configuration; replaced whole on reload.
    pub snapshot: ArcSwap<Snapshot>,
    /// Health, pools, buckets and the metrics registry, kept across reloads.
    pub live: LiveState,
    /// The file reloads read.
    pub config_path: PathBuf,
    /// Compile options for reloads.
    pub options: CompileOptions,
    /// The startup-only settings as the file gave them at start (a reload
    /// that changes one is reported, not applied).
    pub startup: Startup,
    /// Cuts the streams still running when `drain_timeout` passes.
    pub drain: crate::body::Drain,
    /// Slots for chat requests in progress (`max_concurrent_requests`).
    pub inflight: Arc<Semaphore>,
    /// Whether `/admin/*` is on its own listener (and so not on the main one).
    pub admin_separate: bool,
    /// The responses kept for Responses clients (`previous_response_id`).
    pub responses: crate::inbound::ResponseStore,
}

impl App {
    /// The gateway's metrics registry.
    #[must_use]
    pub fn metrics(&self) -> &Metrics {
        &self.live.metrics
    }
}
