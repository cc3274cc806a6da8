//! The compiled, immutable configuration a request runs against, swapped
//! whole on reload.
//!
//! [`compile`] is the second config phase (named passes, every problem
//! reported at once); [`live`] holds what outlives a snapshot (health, client
//! pools, buckets, routing cursors), keyed by typed identities so an unchanged
//! target keeps its state across a reload. Settings read only at start
//! ([`Startup`]) are compiled beside the snapshot, not into it.

pub mod compile;
pub mod live;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge};

use crate::classify::ErrorTable;
use crate::config::diagnostic::Diagnostic;
pub use crate::config::{Capability, Strategy};
use crate::health::{HealthConfig, KeyHealth, KeyState, ProviderHealth, TargetHealth, Transition};
use crate::metrics::{Family, Metrics, RouteMetrics, TargetMetrics};
use crate::ratelimit::{ProviderLimits, Spender, TaskLimiter};
use crate::secret::Secret;
use crate::upstream::{Credential, Endpoint};
pub use compile::CompileOptions;
pub use live::{LiveState, TaskState};
use tokio::time::Instant;

/// Default listen address when neither the file nor `--listen` sets one.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Same-target retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max: u32,
    /// Base of the exponential backoff (full jitter).
    pub backoff: Duration,
}

/// One upstream account, compiled.
#[derive(Debug)]
pub struct Provider {
    /// Name in routes.yaml.
    pub name: String,
    /// The name as the `x-switchyard-provider` value, made once.
    pub name_header: Option<http::HeaderValue>,
    /// `base_url` without a trailing slash (half of the target identity).
    pub base_url: String,
    /// What its account-wide state is kept by, here and across replicas:
    /// `base_url` and its keys' fingerprints (never the keys).
    pub account: String,
    /// URLs, headers, protocol and pooled client.
    pub endpoint: Endpoint,
    /// Its API keys (none for a keyless upstream), in the file's order.
    pub keys: Vec<ApiKey>,
    /// How a request picks one.
    pub key_selection: KeySelection,
    /// The round-robin cursor of the pool (live, kept across reloads).
    pub key_cursor: Arc<AtomicU64>,
    /// Provider-scoped cooldowns (live, by `base_url`).
    pub health: Arc<ProviderHealth>,
    /// Per-attempt timeout.
    pub timeout: Duration,
    /// TCP + TLS connect timeout (also how long a silence before a close
    /// must last, at least 1 s, to count as a timeout rather than a reset).
    pub connect_timeout: Duration,
    /// Longest silence between stream chunks after the first.
    pub idle_timeout: Duration,
    /// Same-target retries.
    pub retry: RetryPolicy,
    /// Provider rules, then file rules, then the default table.
    pub errors: ErrorTable,
    /// How often its DOWN targets are probed (`None`: never).
    pub probe_interval: Option<Duration>,
    /// The account's rpm/tpm buckets, if limited.
    pub limits: Option<Arc<ProviderLimits>>,
    /// The share of those buckets only critical tasks may spend.
    pub reserve: f64,
    /// After a 429, how long only critical tasks may call it.
    pub shed_after_429: Option<Duration>,
    /// How it continues an assistant prefix (for `prefill` targets).
    pub prefill: Prefill,
}

/// How a provider continues an assistant prefix: one trailing assistant
/// message with the text already delivered, plus these fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prefill {
    /// Extra fields on the trailing assistant message.
    pub message_fields: serde_json::Map<String, serde_json::Value>,
    /// Extra fields on the request body.
    pub body_fields: serde_json::Map<String, serde_json::Value>,
}

/// When a task's hedge starts: a fixed delay, or a percentile of the first
/// target's observed time to first token (clamped).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum After {
    /// A fixed delay.
    Fixed(Duration),
    /// The target's observed TTFT at this quantile (0-1), within `floor..=cap`.
    Percentile {
        /// e.g. 0.95.
        quantile: f64,
        /// Never sooner than this.
        floor: Duration,
        /// Never later than this (also the delay until enough samples are seen).
        cap: Duration,
    },
}

impl std::fmt::Display for After {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            After::Fixed(d) => write!(f, "{}", humantime::format_duration(*d)),
            After::Percentile { quantile, .. } => write!(f, "p{}", quantile * 100.0),
        }
    }
}

/// A task's hedging policy (`hedge:` in routes.yaml).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HedgePolicy {
    /// When the hedge starts.
    pub after: After,
    /// Most of a minute's requests that may be hedged (0-1).
    pub max_share: f64,
}

impl HedgePolicy {
    /// The delay before the hedge, for a first target whose recent TTFT
    /// quantile is `observed` (if known).
    #[must_use]
    pub fn delay(&self, observed: impl FnOnce(f64) -> Option<Duration>) -> Duration {
        match self.after {
            After::Fixed(d) => d,
            After::Percentile {
                quantile,
                floor,
                cap,
                // Not `clamp`, which panics when floor > cap (compile refuses that).
            } => observed(quantile).map_or(cap, |d| d.max(floor).min(cap)),
        }
    }
}

/// What a task does when a stream breaks after its commit point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamRecovery {
    /// Finish the answer on the next admitted target (`mode: continue`).
    pub continues: bool,
    /// Most continuations of one stream.
    pub max_continuations: u32,
    /// Mark each seam with an SSE comment.
    pub seam_comment: bool,
}

/// A model at a provider, compiled.
#[derive(Debug)]
pub struct Target {
    /// Name in routes.yaml (the metric label).
    pub name: String,
    /// The name as the `x-switchyard-target` value, made once.
    pub name_header: Option<http::HeaderValue>,
    /// Its provider.
    pub provider: Arc<Provider>,
    /// Upstream model name written into forwarded requests.
    pub model: String,
    /// What it can do.
    pub capabilities: Vec<Capability>,
    /// Context window in tokens, if declared.
    pub max_context: Option<u64>,
    /// Longest answer in tokens, if declared.
    pub max_output: Option<u64>,
    /// Price, if declared.
    pub cost: Option<Cost>,
    /// Share for the `weighted` strategy.
    pub weight: u32,
    /// Live health, shared with every snapshot that has this identity.
    pub health: Arc<TargetHealth>,
    /// This target's own series.
    pub metrics: TargetMetrics,
    /// The embedding space its `/v1/embeddings` answers live in, if it is an
    /// embeddings target.
    pub embedding: Option<EmbeddingSpace>,
}

/// An embedding space: vectors of one model family and length. Two targets
/// of one space are interchangeable; of two spaces, never.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingSpace {
    /// The model family, e.g. `text-embedding-3-small`.
    pub family: String,
    /// Vector length.
    pub dimensions: u32,
}

impl std::fmt::Display for EmbeddingSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.family, self.dimensions)
    }
}

/// Where an API key is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// An environment variable.
    Env(String),
    /// A file (watched for rotation).
    File(PathBuf),
}

/// How a request picks a key of a provider's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySelection {
    /// Each usable key in turn.
    RoundRobin,
    /// The usable key whose last 429 is oldest (never limited first).
    LeastRecentlyLimited,
}

/// One API key of a provider.
#[derive(Debug)]
pub struct ApiKey {
    /// Its name: in metrics, logs and `/admin/targets`, never the key.
    pub name: String,
    /// Where it is read from.
    pub source: KeySource,
    /// The path of that setting in routes.yaml (for diagnostics).
    pub setting: String,
    /// The key, if it could be read (kept to scrub it from upstream text).
    pub secret: Option<Secret>,
    /// How it goes on a request, if it could be read.
    pub credential: Option<Credential>,
    /// Live: cooldowns and revocation.
    pub health: Arc<KeyHealth>,
    /// What its live state is kept by (URL, name, fingerprint; never the key).
    pub identity: live::KeyId,
    /// Its own rpm/tpm buckets, if limited.
    pub limits: Option<Arc<ProviderLimits>>,
    /// The share of those buckets only critical tasks may spend.
    pub reserve: f64,
    /// `switchyard_key_state{provider, key}`.
    pub gauge: Gauge,
}

impl ApiKey {
    /// Sets `switchyard_key_state` from its live state: 0 usable, 1 cooling
    /// down, 2 revoked, 3 unreadable (its file or variable could not be read).
    pub fn show_state(&self, now: Instant) {
        let value = if self.credential.is_none() {
            3.0
        } else {
            self.health.state(now).gauge()
        };
        self.gauge.set(value);
    }
}

/// Why no key of a provider can serve a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoKey {
    /// Rate-limited (a 429 cooldown or an empty per-key bucket) until then.
    Limited(Instant),
    /// Every key that could serve keeps only its bucket's reserve, for
    /// critical tasks, until then.
    Reserved(Instant),
    /// Every readable key not yet tried is revoked.
    Revoked,
    /// Every readable key was tried for this request.
    Exhausted,
    /// The provider names keys but none could be read: it is never called
    /// without one.
    Unreadable,
}

/// At most this many keys per provider (a [`KeySet`] holds them).
pub const MAX_KEYS: usize = 64;

/// A set of key indices of one provider (the keys a request tried).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeySet(u64);

impl KeySet {
    /// Whether key `i` is in the set.
    #[must_use]
    pub fn contains(self, i: usize) -> bool {
        i < MAX_KEYS && self.0 & (1 << i) != 0
    }

    /// Adds key `i` (ignored past [`MAX_KEYS`]).
    pub fn insert(&mut self, i: usize) {
        if i < MAX_KEYS {
            self.0 |= 1 << i;
        }
    }
}

impl Provider {
    /// Whether the file names a key source (read or not).
    #[must_use]
    pub fn wants_key(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether the file names keys and none of them could be read (such a
    /// provider is skipped, never called keyless).
    #[must_use]
    pub fn keys_unreadable(&self) -> bool {
        self.wants_key() && self.keys.iter().all(|k| k.credential.is_none())
    }

    /// Whether the file names keys and none can serve for good: each is
    /// unreadable or revoked (until a re-probe, a reload or a rotation).
    #[must_use]
    pub fn keys_out(&self, now: Instant) -> bool {
        self.wants_key()
            && self
                .keys
                .iter()
                .all(|k| k.credential.is_none() || k.health.state(now) == KeyState::Dead)
    }

    /// Every key read, to scrub from upstream text.
    pub fn secrets(&self) -> impl Iterator<Item = &str> {
        self.keys
            .iter()
            .filter_map(|k| k.secret.as_ref().map(Secret::expose))
    }

    /// The key a probe goes with: the first usable one, else the first read.
    #[must_use]
    pub fn probe_credential(&self) -> Option<&Credential> {
        let now = Instant::now();
        let readable = || self.keys.iter().filter(|k| k.credential.is_some());
        readable()
            .find(|k| k.health.state(now) == KeyState::Usable)
            .or_else(|| readable().next())
            .and_then(|k| k.credential.as_ref())
    }

    /// The key files to watch for rotation.
    pub fn key_files(&self) -> impl Iterator<Item = &std::path::Path> {
        self.keys.iter().filter_map(|k| match &k.source {
            KeySource::File(p) => Some(p.as_path()),
            KeySource::Env(_) => None,
        })
    }

    /// The key for a request of `tokens` to `model`, not one of `tried`, by the pool's
    /// selection policy: `Ok(None)` when the provider names no key (a keyless
    /// upstream). Unreadable keys are skipped like revoked ones. Checks the
    /// key's own bucket, taking nothing: the call is charged when it is sent
    /// ([`Provider::charge`]).
    ///
    /// # Errors
    /// No key can serve: each is cooling down, out of its bucket, revoked,
    /// already tried, or (all of them) unreadable.
    pub fn pick_key(
        &self,
        now: Instant,
        (model, tokens): (&str, u64),
        tried: KeySet,
        critical: bool,
    ) -> Result<Option<usize>, NoKey> {
        let n = self.keys.len();
        let readable = |i: usize| self.keys[i].credential.is_some();
        if n == 0 {
            return Ok(None);
        }
        if !(0..n).any(readable) {
            return Err(NoKey::Unreadable);
        }
        if (0..n).all(|i| !readable(i) || tried.contains(i)) {
            return Err(NoKey::Exhausted);
        }
        let start = match self.key_selection {
            KeySelection::RoundRobin => {
                let turn = self.key_cursor.fetch_add(1, Ordering::Relaxed);
                usize::try_from(turn % n as u64).unwrap_or(0)
            }
            KeySelection::LeastRecentlyLimited => 0,
        };
        let mut passed = tried;
        let mut limited: Option<Instant> = None;
        // Whether every refusal so far left only a reserve.
        let mut only_reserved = true;
        let mut note_limited = |until: Instant, reserved: bool| {
            limited = Some(limited.map_or(until, |t| t.min(until)));
            only_reserved &= reserved;
        };
        loop {
            let mut best: Option<usize> = None;
            for i in (0..n).map(|j| (start + j) % n) {
                if passed.contains(i) || !readable(i) {
                    continue;
                }
                match self.keys[i].health.state_for(now, model) {
                    KeyState::Usable => {}
                    KeyState::CoolingDown(until) => {
                        note_limited(until, false);
                        passed.insert(i);
                        continue;
                    }
                    KeyState::Dead => {
                        passed.insert(i);
                        continue;
                    }
                }
                let better = match (self.key_selection, best) {
                    (_, None) => true,
                    (KeySelection::RoundRobin, Some(_)) => false,
                    (KeySelection::LeastRecentlyLimited, Some(b)) => {
                        self.keys[i].health.last_limited() < self.keys[b].health.last_limited()
                    }
                };
                if better {
                    best = Some(i);
                }
            }
            let Some(i) = best else { break };
            let key = &self.keys[i];
            let who = Spender {
                reserve: key.reserve,
                critical,
            };
            match key.limits.as_ref().map(|l| l.check(tokens, who)) {
                Some(Err(refused)) => {
                    note_limited(now + refused.wait, refused.reserved);
                    passed.insert(i);
                }
                Some(Ok(())) | None => return Ok(Some(i)),
            }
        }
        Err(match limited {
            None => NoKey::Revoked,
            Some(until) if only_reserved => NoKey::Reserved(until),
            Some(until) => NoKey::Limited(until),
        })
    }
}

impl Provider {
    /// Charges one call of `tokens` tokens to the provider's buckets and
    /// to `key`'s: the call is being sent (admission only checked them).
    pub fn charge(&self, key: Option<usize>, tokens: u64, critical: bool) {
        if let Some(limits) = &self.limits {
            limits.charge(tokens, critical);
        }
        if let Some(limits) = key
            .and_then(|i| self.keys.get(i))
            .and_then(|k| k.limits.as_ref())
        {
            limits.charge(tokens, critical);
        }
    }
}

impl Target {
    /// Tokens a request may take here: `prompt` plus `max_tokens` (or this
    /// target's `max_output` when the request gives none). What its buckets
    /// are checked and charged with.
    #[must_use]
    pub fn call_tokens(&self, prompt: u64, max_tokens: Option<u64>) -> u64 {
        // Saturating: `max_tokens` is the client's, any non-negative integer.
        prompt.saturating_add(max_tokens.or(self.max_output).unwrap_or(0))
    }

    /// Logs a health state change and updates its metrics.
    pub fn report(&self, transition: Option<Transition>) {
        let Some(t) = transition else { return };
        tracing::info!(target = %self.name, from = t.from.as_str(), to = t.to.as_str(), "target health changed");
        self.metrics.health.set(t.to.gauge());
        self.metrics
            .transitions
            .increment((t.from.as_str(), t.to.as_str()), 1);
    }

    /// Whether it counts as available for `/readyz` and
    /// `switchyard_task_targets_available`: not DOWN, and some key of its
    /// provider readable and not revoked.
    #[must_use]
    pub fn available(&self, now: Instant) -> bool {
        self.health.state() != crate::health::State::Down && !self.provider.keys_out(now)
    }

    /// Whether it is declared able to continue an assistant prefix.
    #[must_use]
    pub fn can_prefill(&self) -> bool {
        self.capabilities.contains(&Capability::Prefill)
    }

    /// USD of `prompt` + `completion` tokens at this target's price (0 without one).
    #[must_use]
    #[allow(clippy::cast_precision_loss)]
    pub fn usd(&self, prompt: u64, completion: u64) -> f64 {
        self.cost.map_or(0.0, |c| {
            prompt as f64 / 1000.0 * c.input_per_1k + completion as f64 / 1000.0 * c.output_per_1k
        })
    }
}

/// Price of a target in USD per 1,000 tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Per 1,000 prompt tokens.
    pub input_per_1k: f64,
    /// Per 1,000 completion tokens.
    pub output_per_1k: f64,
}

/// A task's request budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// End-to-end deadline from arrival.
    pub total_timeout: Duration,
    /// Most switches to another target.
    pub max_failovers: u32,
    /// Streams: longest wait for the first content chunk from one target.
    pub first_token_timeout: Option<Duration>,
}

/// A task type, compiled.
#[derive(Debug)]
pub struct Task {
    /// Name in routes.yaml.
    pub name: String,
    /// Public names that select it.
    pub aliases: Vec<String>,
    /// The degradation chain, in order.
    pub chain: Vec<Arc<Target>>,
    /// Request budget.
    pub budget: Budget,
    /// Capabilities every target must have.
    pub requires: Vec<Capability>,
    /// How the first target is picked.
    pub strategy: Strategy,
    /// Client-facing buckets, if limited.
    pub rate_limit: Option<Arc<TaskLimiter>>,
    /// USD per clock hour fallback targets may cost, if capped.
    pub fallback_budget: Option<f64>,
    /// Live routing state, kept across reloads by task name.
    pub state: Arc<TaskState>,
    /// When answers' tool calls are validated.
    pub validate_tool_calls: crate::schema::Mode,
    /// Repairs tried on an answer that breaks the contract, in order.
    pub repairs: Vec<crate::schema::Repair>,
    /// Which work it is: only critical tasks spend what providers keep back.
    pub priority: crate::config::Priority,
    /// A batch task's queue, if it waits for quota instead of a 429.
    pub queue: Option<crate::ratelimit::Queue>,
    /// For the `to_tool` repair: the targets that may turn prose into the
    /// required call, in order.
    pub repair_targets: Vec<Arc<Target>>,
    /// Schema overrides by function name, compiled once per snapshot.
    pub tool_schemas: Arc<crate::schema::Overrides>,
    /// The contract of a request without tools or a JSON format (no call
    /// may come), made once per snapshot.
    pub bare_contract: Arc<crate::schema::Contract>,
    /// Series per chain position (same order as `chain`).
    pub routes: Vec<RouteMetrics>,
    /// Series for answers no target served (`target="none"`).
    pub unserved: RouteMetrics,
    /// `switchyard_client_cancelled_total{task}`.
    pub cancelled: Counter,
    /// What happens when a stream breaks after its commit point.
    pub stream_recovery: StreamRecovery,
    /// When a slow first attempt gets a parallel one, if ever.
    pub hedge: Option<HedgePolicy>,
    /// `switchyard_hedges_total{task, result}`.
    pub hedges: Family<&'static str>,
    /// Its cache of whole answers, if it keeps one.
    pub cache: Option<Arc<crate::cache::TaskCache>>,
    /// The embedding space of its chain, when it serves `/v1/embeddings`
    /// (every target declares the same one); `None` for a chat task.
    pub embedding: Option<EmbeddingSpace>,
}

impl Task {
    /// The chain position of `target`, if it is in the chain.
    #[must_use]
    pub fn position(&self, target: &Target) -> Option<usize> {
        self.chain.iter().position(|t| std::ptr::eq(&**t, target))
    }

    /// The series of `target` within this task (`none` if not in the chain).
    #[must_use]
    pub fn route_metrics(&self, target: Option<&Target>) -> &RouteMetrics {
        target
            .and_then(|t| self.position(t))
            .and_then(|i| self.routes.get(i))
            .unwrap_or(&self.unserved)
    }
}

/// Settings read once at start; a reload that changes one is reported, not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Startup {
    /// Listen address from the file (`--listen` overrides it).
    pub listen: SocketAddr,
    /// Separate admin address, if configured (`--admin-listen` overrides it).
    pub admin_listen: Option<SocketAddr>,
    /// Most chat requests in progress at once.
    pub max_concurrent_requests: usize,
    /// Runtimes serving connections (`runtimes`, default one per core).
    pub runtimes: usize,
    /// `telemetry.traces`: where OpenTelemetry traces go (with the `OTEL_*` environment).
    pub traces: crate::telemetry::TraceSettings,
    /// `shared_state.redis`: the store shared with the other replicas, if any.
    pub shared_state: Option<SharedStore>,
}

/// `shared_state.redis`, compiled (read at start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedStore {
    /// The server's URL, checked to be a `redis://` (or `valkey://`, unix
    /// socket) URL; it may hold a password, so it is a [`Secret`]. `None`
    /// when it could not be read (a warning): the replica stays local.
    pub url: Option<Secret>,
    /// Prefix of every key and of the pub/sub channel.
    pub key_prefix: String,
    /// Longest wait for one command or connect.
    pub timeout: Duration,
}

/// Everything a request needs, immutable; swapped whole on reload.
#[derive(Debug)]
pub struct Snapshot {
    /// Token `/admin/*` requires, if configured.
    pub admin_token: Option<Secret>,
    /// Shutdown drain limit.
    pub drain_timeout: Duration,
    /// `telemetry.access_log`: one log line per chat request.
    pub access_log: bool,
    /// Tasks by name.
    pub tasks: BTreeMap<String, Arc<Task>>,
    /// Task by name or alias.
    pub models: HashMap<String, Arc<Task>>,
    /// The fallback task for unknown model names.
    pub default_task: Option<Arc<Task>>,
    /// Targets by name.
    pub targets: BTreeMap<String, Arc<Target>>,
    /// Providers by name.
    pub providers: BTreeMap<String, Arc<Provider>>,
    /// Health thresholds.
    pub health: HealthConfig,
    /// What upstream error text may reach clients.
    pub sanitizer: Arc<crate::sanitize::Sanitizer>,
    /// FNV-1a hash of the file's text, shown in logs and metrics.
    pub hash: u64,
    /// The gateway's registry, for series resolved on the spot (rare events).
    pub metrics: Metrics,
    /// `switchyard_requests_total{task="unknown", target="none", status}`.
    pub unrouted: Family<u16>,
    /// `switchyard_ratelimited_total{scope}`.
    pub rate_limited: Family<&'static str>,
}

impl Snapshot {
    /// Whether `other` would serve exactly like this one: same file text and
    /// same API keys (a rotated key file changes the second, not the first).
    #[must_use]
    pub fn same_as(&self, other: &Snapshot) -> bool {
        self.hash == other.hash
            && self.providers.len() == other.providers.len()
            && self.providers.iter().all(|(name, p)| {
                other.providers.get(name).is_some_and(|q| {
                    p.keys.len() == q.keys.len()
                        && p.keys
                            .iter()
                            .zip(&q.keys)
                            .all(|(a, b)| a.secret == b.secret)
                })
            })
    }

    /// The task a request selects: `x-task-type` first, then `model` by task
    /// name or alias, then `default_task`.
    #[must_use]
    pub fn route(&self, task_header: Option<&str>, model: Option<&str>) -> Option<&Arc<Task>> {
        if let Some(name) = task_header {
            return self.tasks.get(name);
        }
        model
            .and_then(|m| self.models.get(m))
            .or(self.default_task.as_ref())
    }
}

/// A compiled file: the snapshot, the settings read at start, and warnings.
#[derive(Debug)]
pub struct Compiled {
    /// What requests run against.
    pub snapshot: Snapshot,
    /// Read once at start.
    pub startup: Startup,
    /// Warnings and notes (the file is accepted).
    pub warnings: Vec<Diagnostic>,
}

/// The `telemetry.traces` settings of the file at `path`, read before the
/// gateway starts (the exporter must exist before the first log line).
/// Defaults when the file cannot be read or the section is invalid: the
/// load that follows reports every problem, located.
#[must_use]
pub fn read_traces(path: &Path) -> crate::telemetry::TraceSettings {
    let Ok((parsed, _)) = crate::config::load(path) else {
        return crate::telemetry::TraceSettings::default();
    };
    let mut checks = crate::config::validate::Checks::new(&parsed.index);
    let settings = compile::trace_settings(&parsed.raw, &mut checks);
    if checks.has_errors() {
        return crate::telemetry::TraceSettings::default();
    }
    settings
}

/// Reads, parses and compiles `path` against the live state: the one
/// load-and-compile path of `serve`, reloads, `validate` and `explain`.
///
/// # Errors
/// Every problem found, located.
pub fn load(
    path: &Path,
    live: &LiveState,
    options: CompileOptions,
) -> Result<Compiled, Vec<Diagnostic>> {
    let (parsed, text) = crate::config::load(path)?;
    compile::compile(&parsed, &text, live, options)
}
