//! Hot reload: watch the config file's directory, debounce, prepare a new
//! snapshot (may fail), then swap it in (cannot fail).
//!
//! The parent directory is watched rather than the file, because editors save
//! by writing a new file and renaming it over the old one, and Kubernetes
//! updates a mounted ConfigMap by swapping a `..data` symlink: neither shows
//! up as a write to the original inode. Any event in the directory schedules
//! a check; the check applies the file only if its content changed. A file
//! that fails to parse or validate is never applied: the old snapshot keeps
//! serving and every problem is logged with file:line:column.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::config::{self, validate::Diagnostic};
use crate::metrics as m;
use crate::server::App;
use crate::snapshot::{CompileOptions, LiveState, Snapshot};

/// Quiet time after the last file event before the file is read: editors and
/// ConfigMap updates produce bursts of events for one logical change.
const DEBOUNCE: Duration = Duration::from_millis(150);

/// Reads, parses, validates and compiles `path` against the live state.
/// Warnings are logged.
///
/// # Errors
/// Every problem found, located.
pub fn prepare(
    path: &Path,
    live: &LiveState,
    options: CompileOptions,
) -> Result<Snapshot, Vec<Diagnostic>> {
    let (parsed, text) = config::load(path)?;
    let (snapshot, warnings) = Snapshot::compile(&parsed, &text, live, options)?;
    for w in &warnings {
        warn!("{}", w.render(&path.display().to_string()));
    }
    Ok(snapshot)
}

/// Sets the config info gauge to the snapshot's hash.
pub fn publish_info(snapshot: &Snapshot) {
    metrics::gauge!(m::CONFIG_INFO, "hash" => format!("{:016x}", snapshot.hash)).set(1.0);
}

/// Keeps the watcher alive; dropping it stops reloading.
pub struct WatchGuard {
    _watcher: RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts watching `app.config_path`'s directory.
///
/// # Errors
/// If the platform watcher cannot be created or the directory watched.
pub fn watch(app: Arc<App>) -> Result<WatchGuard, notify::Error> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = tx.send(());
        }
    })?;
    let dir = match app.config_path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    let task = tokio::spawn(debounce_loop(app, rx));
    Ok(WatchGuard {
        _watcher: watcher,
        task,
    })
}

async fn debounce_loop(app: Arc<App>, mut rx: mpsc::UnboundedReceiver<()>) {
    while rx.recv().await.is_some() {
        // Wait until the burst is over.
        while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {}
        reload_now(&app);
    }
}

/// Re-reads the file and swaps it in if it changed and is valid. Returns
/// whether a new snapshot was applied.
pub fn reload_now(app: &App) -> bool {
    let path = app.config_path.display().to_string();
    let current = app.snapshot.load();
    match prepare(&app.config_path, &app.live, app.options) {
        Ok(next) if next.hash == current.hash => false,
        Ok(next) => {
            info!(config = %path, hash = format_args!("{:016x}", next.hash), "config reloaded");
            metrics::gauge!(m::CONFIG_INFO, "hash" => format!("{:016x}", current.hash)).set(0.0);
            publish_info(&next);
            app.snapshot.store(Arc::new(next));
            app.live.health.prune();
            metrics::counter!(m::CONFIG_RELOADS, "result" => "ok").increment(1);
            true
        }
        Err(diags) => {
            for d in &diags {
                error!("{}", d.render(&path));
            }
            error!(config = %path, problems = diags.len(), "config rejected; the previous config keeps serving");
            metrics::counter!(m::CONFIG_RELOADS, "result" => "error").increment(1);
            false
        }
    }
}
