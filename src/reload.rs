//! Hot reload: watch the config file's directory, debounce, prepare a new
//! snapshot (may fail), then swap it in (cannot fail).
//!
//! The parent directory is watched rather than the file, because editors save
//! by writing a new file and renaming it over the old one, and Kubernetes
//! updates a mounted ConfigMap or Secret by swapping a `..data` symlink:
//! neither shows up as a write to the original inode. Only events that touch
//! the config file, a provider's `api_key_file` (its directory is watched
//! too, so a rotated Secret takes effect) or a `..`-prefixed Kubernetes entry
//! count; reading the file ourselves (an access event) never does. A change
//! is applied when the text or any key differs. A file that fails to parse or
//! validate, or that would leave a provider without its API key (one that had
//! a key, or one added whose key cannot be read), is never applied: the old
//! snapshot keeps serving, every problem is logged with file:line:column, and
//! it is counted once per change.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use crate::config::diagnostic::{Diagnostic, Severity};
use crate::metrics as m;
use crate::snapshot::{self, ApiKey, Compiled, Snapshot, Startup};
use crate::state::App;

/// Settle time after the first relevant event before the file is read: editors
/// and ConfigMap updates produce bursts of events for one logical change. Fixed
/// from the first event, so a busy directory cannot postpone a reload.
const DEBOUNCE: Duration = Duration::from_millis(150);
/// How long, and how often, a config file that is empty or missing is waited
/// for before the reload reads it anyway (and reports it).
const SETTLE: Duration = Duration::from_millis(250);
const SETTLE_TRIES: usize = 4;

/// Logs a compiled file's warnings (notes are for `validate`).
pub fn log_warnings(path: &Path, compiled: &Compiled) {
    for w in &compiled.warnings {
        if w.severity == Severity::Warning {
            warn!("{}", w.render(&path.display().to_string()));
        }
    }
}

/// Sets the config gauges for a newly applied snapshot.
pub fn publish_info(snapshot: &Snapshot) {
    let metrics = &snapshot.metrics;
    // The low 48 bits are exact in an f64: enough to tell configs apart.
    #[allow(clippy::cast_precision_loss)]
    metrics
        .gauge(m::CONFIG_HASH, &[])
        .set((snapshot.hash & 0xffff_ffff_ffff) as f64);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    metrics.gauge(m::CONFIG_LOADED_AT, &[]).set(now);
    // Every target's gauge exists from the start, so "healthy" differs from "no data".
    for target in snapshot.targets.values() {
        target.metrics.health.set(target.health.state().gauge());
    }
}

/// Counts a load or reload by its result.
pub fn count(app_metrics: &crate::metrics::Metrics, ok: bool) {
    let result = if ok { "ok" } else { "error" };
    app_metrics
        .counter(m::CONFIG_RELOADS, &[("result", result.into())])
        .increment(1);
}

/// Keeps the watcher alive; dropping it stops reloading.
pub struct WatchGuard {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The watcher and what it watches.
struct Watches {
    watcher: RecommendedWatcher,
    dirs: HashSet<PathBuf>,
    names: HashSet<OsString>,
}

impl Watches {
    /// Watches the config's directory and every key file's directory of the
    /// current snapshot (adding only what is new).
    fn update(&mut self, app: &App) {
        let snapshot = app.snapshot.load();
        let mut files = vec![app.config_path.clone()];
        files.extend(
            snapshot
                .providers
                .values()
                .flat_map(|p| p.key_files().map(Path::to_path_buf)),
        );
        for file in files {
            if let Some(name) = file.file_name() {
                self.names.insert(name.to_owned());
            }
            let dir = match file.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !self.dirs.contains(&dir) {
                match self.watcher.watch(&dir, RecursiveMode::NonRecursive) {
                    Ok(()) => {
                        self.dirs.insert(dir);
                    }
                    Err(e) => warn!(dir = %dir.display(), error = %e, "cannot watch directory"),
                }
            }
        }
    }

    fn relevant(&self, event: &notify::Event) -> bool {
        event.paths.iter().any(|p| {
            p.file_name()
                .is_some_and(|n| self.names.contains(n) || n.to_string_lossy().starts_with(".."))
        })
    }
}

/// Starts watching `app.config_path`'s directory (and key files' directories).
///
/// # Errors
/// If the platform watcher cannot be created or the config directory watched.
pub fn watch(app: Arc<App>) -> Result<WatchGuard, notify::Error> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event {
            if !event.kind.is_access() {
                let _ = tx.send(event);
            }
        }
    })?;
    // The config directory must be watchable; key file directories are best effort.
    let dir = match app.config_path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    let mut watches = Watches {
        watcher,
        dirs: HashSet::from([dir]),
        names: HashSet::new(),
    };
    watches.update(&app);
    let task = tokio::spawn(debounce_loop(app, rx, watches, Hangup::new()));
    Ok(WatchGuard { task })
}

/// SIGHUP, an operator's usual way to say "reload": it reloads as a change to
/// the file does (without it, the signal's default action kills the process
/// mid-stream).
struct Hangup(#[cfg(unix)] Option<tokio::signal::unix::Signal>);

impl Hangup {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Self(signal(SignalKind::hangup()).ok())
        }
        #[cfg(not(unix))]
        Self()
    }

    /// Resolves at the next SIGHUP; never, where there is none.
    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = &mut self.0 {
            if signal.recv().await.is_some() {
                return;
            }
        }
        std::future::pending::<()>().await;
    }
}

async fn debounce_loop(
    app: Arc<App>,
    mut rx: mpsc::UnboundedReceiver<notify::Event>,
    mut watches: Watches,
    mut hangup: Hangup,
) {
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) if watches.relevant(&event) => {}
                Some(_) => continue,
                None => return,
            },
            () = hangup.next() => info!("SIGHUP received: reloading the config"),
        }
        tokio::time::sleep(DEBOUNCE).await;
        while rx.try_recv().is_ok() {}
        // A file truncated before it is written (a plain `>` save) or deleted
        // before it is recreated is a save in progress, not a broken config:
        // give it a moment before judging it (a file that stays empty is).
        for _ in 0..SETTLE_TRIES {
            if !being_written(&app.config_path) {
                break;
            }
            tokio::time::sleep(SETTLE).await;
            while rx.try_recv().is_ok() {}
        }
        // Reading and compiling may take a while on a large file: keep it off
        // the threads that serve requests.
        let app2 = Arc::clone(&app);
        let applied = tokio::task::spawn_blocking(move || reload_now(&app2))
            .await
            .unwrap_or(false);
        if applied {
            watches.update(&app);
        }
    }
}

/// Whether the config file looks mid-save: missing, or empty.
fn being_written(path: &Path) -> bool {
    std::fs::metadata(path).map_or(true, |m| m.len() == 0)
}

/// Re-reads the file and swaps it in if it changed (text or keys) and is
/// valid. Returns whether a new snapshot was applied.
pub fn reload_now(app: &App) -> bool {
    let path = app.config_path.display().to_string();
    let rejected = &app.live.config_rejected;
    // No guard of the serving snapshot is held past this test: the reload
    // must drop what only the old one used (its upstream pools) at once.
    match prepare(app) {
        Ok(next) if next.snapshot.same_as(&app.snapshot.load()) => {
            if rejected.swap(false, Ordering::Relaxed) {
                info!(config = %path, hash = format_args!("{:016x}", next.snapshot.hash),
                    "config fixed: the good config is loaded again (the same as the one serving)");
            }
            false
        }
        Ok(next) => {
            log_warnings(&app.config_path, &next);
            warn_startup_changes(&app.startup, &next.startup);
            let fixed = rejected.swap(false, Ordering::Relaxed);
            info!(config = %path, hash = format_args!("{:016x}", next.snapshot.hash), after_rejection = fixed, "config reloaded");
            publish_info(&next.snapshot);
            app.snapshot.store(Arc::new(next.snapshot));
            app.live.reloaded();
            count(app.metrics(), true);
            true
        }
        Err(diags) => {
            for d in &diags {
                match d.severity {
                    Severity::Error => error!("{}", d.render(&path)),
                    Severity::Warning => warn!("{}", d.render(&path)),
                    Severity::Note => {}
                }
            }
            // Counted as `validate` counts them: the errors that reject the file.
            let errors = diags
                .iter()
                .filter(|d| matches!(d.severity, Severity::Error))
                .count();
            error!(config = %path, errors, "config rejected; the previous config keeps serving");
            rejected.store(true, Ordering::Relaxed);
            count(app.metrics(), false);
            false
        }
    }
}

/// The prepare half of a reload: reads and compiles the file against the
/// live state, and refuses it if it would leave a provider without its key
/// (see `keeps_keys`). Nothing changes either way.
///
/// # Errors
/// Every problem of the file, or the providers whose key it would lose.
pub fn prepare(app: &App) -> Result<Compiled, Vec<Diagnostic>> {
    let current = app.snapshot.load();
    snapshot::load(&app.config_path, &app.live, app.options)
        .and_then(|next| keeps_keys(&current, next))
}

/// A reload must not leave a key unread where it was read: a key file that
/// vanished (a Secret unmounted mid-rotation) must not turn a working key
/// into a missing one, and a key added (or a provider added) whose key cannot
/// be read would answer nothing but 401s. At start an unreadable key is a
/// warning, since there is no old config to keep; a key that has been
/// unreadable since then keeps being allowed.
fn keeps_keys(current: &Snapshot, next: Compiled) -> Result<Compiled, Vec<Diagnostic>> {
    let mut refused = Vec::new();
    for (name, q) in &next.snapshot.providers {
        let before = current.providers.get(name);
        for key in q.keys.iter().filter(|k| k.secret.is_none()) {
            let old = before.and_then(|p| p.keys.iter().find(|k| k.name == key.name));
            if old.is_some_and(|k| k.secret.is_some()) {
                // At the setting, where the compile warning saying why stands.
                let (line, column) = next
                    .warnings
                    .iter()
                    .find(|w| w.path == key.setting)
                    .map_or((1, 1), |w| (w.line, w.column));
                refused.push(Diagnostic::error(
                    &key.setting,
                    line,
                    column,
                    format!("key `{}` of provider `{name}` was read and now cannot be; keeping the old config", key.name),
                ));
            } else if old.is_none() {
                refused.push(unread_key(name, key, before.is_none(), &next.warnings));
            }
        }
    }
    if refused.is_empty() {
        Ok(next)
    } else {
        Err(refused)
    }
}

/// The refusal of a key that cannot be read, where the compile warning
/// saying why stands.
fn unread_key(name: &str, key: &ApiKey, added: bool, warnings: &[Diagnostic]) -> Diagnostic {
    let why = warnings
        .iter()
        .find(|w| w.path == key.setting)
        .map_or_else(|| Diagnostic::error(&key.setting, 1, 1, ""), Clone::clone);
    let what = if added {
        "the new provider"
    } else {
        "a new key of provider"
    };
    let mut refusal = Diagnostic::error(
        &why.path,
        why.line,
        why.column,
        format!("API key `{}` of {what} `{name}` cannot be read", key.name),
    );
    if !why.message.is_empty() {
        refusal.message.push_str(&format!(" ({})", why.message));
    }
    refusal.message.push_str("; keeping the old config");
    refusal
}

/// Says which startup-only settings a reload changed: they stay as they were
/// until a restart.
fn warn_startup_changes(running: &Startup, file: &Startup) {
    if running.listen != file.listen {
        warn!(running = %running.listen, file = %file.listen, "`listen` changed: it is read at start; restart to apply it");
    }
    if running.admin_listen != file.admin_listen {
        warn!(running = ?running.admin_listen, file = ?file.admin_listen, "`admin_listen` changed: it is read at start; restart to apply it");
    }
    if running.shared_state != file.shared_state {
        // Never the values: the URL may hold a password.
        warn!("`shared_state` changed: it is read at start; restart to apply it");
    }
    if running.traces != file.traces {
        warn!("`telemetry.traces` changed: it is read at start; restart to apply it");
    }
    if running.runtimes != file.runtimes {
        warn!(
            running = running.runtimes,
            file = file.runtimes,
            "`runtimes` changed: it is read at start; restart to apply it"
        );
    }
    if running.max_concurrent_requests != file.max_concurrent_requests {
        warn!(
            running = running.max_concurrent_requests,
            file = file.max_concurrent_requests,
            "`max_concurrent_requests` changed: it is read at start; restart to apply it"
        );
    }
}
