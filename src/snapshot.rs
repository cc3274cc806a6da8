//! The compiled, immutable configuration a request runs against.
//!
//! [`Snapshot::compile`] is the second config phase: it resolves references,
//! parses durations, URLs and regexes, reads API keys, and builds the error
//! tables, reporting every problem at once through [`Checks`]. Live state
//! (health, client pools) is looked up by target identity in [`LiveState`]
//! while compiling, so an unchanged target keeps its state across a reload.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use http::Uri;

use crate::classify::{
    self, Action, Cooldown, ErrorTable, Match, NetworkKind, Rule, StatusPattern,
};
use crate::config::validate::{Checks, Diagnostic, Severity};
use crate::config::{Parsed, RawConfig, RawRule};
use crate::health::{self, HealthConfig, TargetHealth};
use crate::routing::{ProviderLimits, Strategy, TaskLimiter, TaskState};
use crate::upstream::{Clients, HttpClient};

/// Default listen address when neither the file nor `--listen` sets one.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// State that outlives snapshots: health by target identity, client pools.
#[derive(Debug, Default)]
pub struct LiveState {
    /// Health per target identity.
    pub health: health::Registry,
    /// Upstream client pools.
    pub clients: Clients,
    /// Routing state per task (round-robin cursors, weights, fallback spend).
    pub tasks: crate::routing::TaskStates,
    /// Provider buckets by (name, base_url, limits): kept while unchanged.
    pub provider_limits: Mutex<HashMap<String, Arc<ProviderLimits>>>,
    /// Client-facing task buckets by (name, limits): kept while unchanged.
    pub task_limits: Mutex<HashMap<String, Arc<TaskLimiter>>>,
}

fn shared<T>(
    map: &Mutex<HashMap<String, Arc<T>>>,
    key: String,
    make: impl FnOnce() -> Option<T>,
) -> Option<Arc<T>> {
    let mut map = map
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(found) = map.get(&key) {
        return Some(Arc::clone(found));
    }
    let made = Arc::new(make()?);
    map.insert(key, Arc::clone(&made));
    Some(made)
}

/// An API key. Prints as `*****` in every `Debug` and `Display`, so no log line
/// or dump can show it.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// Wraps a key.
    #[must_use]
    pub fn new(key: String) -> Self {
        Self(key)
    }

    /// The key itself: only for building the outgoing header.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

/// Same-target retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max: u32,
    /// Base of the exponential backoff (full jitter).
    pub backoff: Duration,
}

/// The wire protocol of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OpenAI Chat Completions (`POST {base_url}/chat/completions`): requests are forwarded as they are.
    OpenAi,
    /// Anthropic Messages (`POST {base_url}/messages`): translated both ways by [`crate::anthropic`].
    Anthropic,
}

/// The `anthropic-version` header sent unless a provider sets its own.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// One upstream account, compiled.
#[derive(Debug)]
pub struct Provider {
    /// Wire protocol.
    pub protocol: Protocol,
    /// Name in routes.yaml.
    pub name: String,
    /// `base_url` without a trailing slash (half of the target identity).
    pub base_url: String,
    /// `{base_url}/chat/completions` (OpenAI) or `{base_url}/messages` (Anthropic).
    pub chat_url: Uri,
    /// Whether the host is a DNS name (not an IP literal).
    pub host_is_name: bool,
    /// Headers sent on every call, `Authorization` included (marked sensitive).
    pub headers: HeaderMap,
    /// The API key, kept to scrub it from any upstream text passed to a client.
    pub secret: Option<Secret>,
    /// Where the key is read from, if from a file (watched for rotation).
    pub key_file: Option<std::path::PathBuf>,
    /// Per-attempt timeout.
    pub timeout: Duration,
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
    /// Pooled client.
    pub client: HttpClient,
}

/// A model at a provider, compiled.
#[derive(Debug)]
pub struct Target {
    /// Name in routes.yaml (the metric label).
    pub name: String,
    /// Its provider.
    pub provider: Arc<Provider>,
    /// Upstream model name written into forwarded requests.
    pub model: String,
    /// Capability tags.
    pub capabilities: Vec<String>,
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
    /// Capability tags every target must have.
    pub requires: Vec<String>,
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
    /// Schema overrides by function name, compiled once per snapshot.
    pub tool_schemas: Arc<crate::schema::Overrides>,
}

/// Everything a request needs, immutable; swapped whole on reload.
#[derive(Debug)]
pub struct Snapshot {
    /// Listen address from the file (the `--listen` flag overrides it).
    pub listen: SocketAddr,
    /// Separate admin address, if configured.
    pub admin_listen: Option<SocketAddr>,
    /// Token `/admin/*` requires, if configured.
    pub admin_token: Option<Secret>,
    /// Most chat requests in progress at once.
    pub max_concurrent_requests: usize,
    /// Shutdown drain limit.
    pub drain_timeout: Duration,
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
    pub sanitizer: crate::sanitize::Sanitizer,
    /// FNV-1a hash of the file's text, shown in logs and metrics.
    pub hash: u64,
}

/// Options for compiling.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompileOptions {
    /// Treat warnings (e.g. an unset `api_key_env`) as errors.
    pub strict: bool,
}

impl Snapshot {
    /// Compiles a parsed file. Returns the snapshot and its warnings.
    ///
    /// # Errors
    /// Every error found (and, under `strict`, every warning), each located.
    pub fn compile(
        parsed: &Parsed,
        text: &str,
        live: &LiveState,
        opts: CompileOptions,
    ) -> Result<(Snapshot, Vec<Diagnostic>), Vec<Diagnostic>> {
        let mut c = Checks::new(&parsed.index);
        c.diagnostics.extend(parsed.pending.iter().cloned());
        let snapshot = build(
            &parsed.raw,
            parsed.base_dir.as_deref(),
            live,
            &mut c,
            hash(text),
        );
        let failed = c.has_errors() || (opts.strict && !c.diagnostics.is_empty());
        c.diagnostics.sort_by_key(|d| (d.line, d.column));
        match snapshot {
            Some(s) if !failed => Ok((s, c.diagnostics)),
            _ => {
                let mut diags = c.diagnostics;
                if opts.strict {
                    for d in &mut diags {
                        d.severity = Severity::Error;
                    }
                }
                Err(diags)
            }
        }
    }

    /// Whether `other` would serve exactly like this one: same file text and
    /// same API keys (a rotated key file changes the second, not the first).
    #[must_use]
    pub fn same_as(&self, other: &Snapshot) -> bool {
        self.hash == other.hash
            && self.providers.len() == other.providers.len()
            && self.providers.iter().all(|(name, p)| {
                other.providers.get(name).is_some_and(|q| {
                    p.secret.as_ref().map(Secret::expose) == q.secret.as_ref().map(Secret::expose)
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

fn hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn build(
    raw: &RawConfig,
    base_dir: Option<&std::path::Path>,
    live: &LiveState,
    c: &mut Checks<'_>,
    hash: u64,
) -> Option<Snapshot> {
    match raw.version {
        None => c.error("", "missing `version` (write `version: 1` at the top)"),
        Some(1) => {}
        Some(v) => c.error(
            "version",
            format!("unsupported version {v}; this switchyard reads version 1"),
        ),
    }
    let listen = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = listen.parse::<SocketAddr>().unwrap_or_else(|_| {
        c.error(
            "listen",
            format!("bad listen address `{listen}` (expected IP:PORT, e.g. 127.0.0.1:8080)"),
        );
        SocketAddr::from(([127, 0, 0, 1], 8080))
    });

    let h = &raw.health;
    let defaults_h = HealthConfig::default();
    let health = HealthConfig {
        degraded_after: h.degraded_after.unwrap_or(defaults_h.degraded_after).max(1),
        down_after: h.down_after.unwrap_or(defaults_h.down_after).max(1),
        open_for: c.duration(
            "health.open_for",
            h.open_for.as_deref(),
            defaults_h.open_for,
        ),
        all_down_trial: match h.all_down.as_deref() {
            None | Some("trial") => true,
            Some("fail") => false,
            Some(other) => {
                c.error(
                    "health.all_down",
                    format!("unknown value `{other}`, expected `trial` or `fail`"),
                );
                true
            }
        },
        window: c.duration("health.window", h.window.as_deref(), defaults_h.window),
        min_requests: h.min_requests.unwrap_or(defaults_h.min_requests),
        failure_rate: match h.failure_rate {
            None => defaults_h.failure_rate,
            Some(r) if (0.0..=1.0).contains(&r) && r > 0.0 => r,
            Some(r) => {
                c.error(
                    "health.failure_rate",
                    format!("failure_rate {r} must be in (0, 1]"),
                );
                defaults_h.failure_rate
            }
        },
        probe_interval: probe_interval(
            c,
            "health.probe.interval",
            h.probe.as_ref(),
            defaults_h.probe_interval,
        ),
    };
    if health.down_after < health.degraded_after {
        c.error(
            "health.down_after",
            "down_after must be at least degraded_after",
        );
    }

    let admin_listen = raw.admin_listen.as_deref().and_then(|a| {
        a.parse::<SocketAddr>()
            .map_err(|_| {
                c.error(
                    "admin_listen",
                    format!("bad listen address `{a}` (expected IP:PORT)"),
                )
            })
            .ok()
    });
    let admin_token = match (&raw.admin_token_env, &raw.admin_token_file) {
        (Some(_), Some(_)) => {
            c.error(
                "admin_token_file",
                "set either admin_token_env or admin_token_file, not both",
            );
            None
        }
        (Some(var), None) => match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_owned())),
            // An admin token that was asked for but is missing must not open the
            // endpoints to everyone: refuse the file.
            _ => {
                c.error(
                    "admin_token_env",
                    format!("environment variable `{var}` is not set"),
                );
                None
            }
        },
        (None, Some(file)) => match read_small(file) {
            Ok(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_owned())),
            _ => {
                c.error(
                    "admin_token_file",
                    format!("cannot read a token from `{file}`"),
                );
                None
            }
        },
        (None, None) => None,
    };
    let max_concurrent_requests = match raw.max_concurrent_requests {
        Some(0) => {
            c.error("max_concurrent_requests", "must be at least 1");
            1
        }
        Some(n) => n,
        None => 1024,
    };
    let drain_timeout = c.duration(
        "drain_timeout",
        raw.drain_timeout.as_deref(),
        Duration::from_secs(30),
    );

    let file_rules = rules(&raw.error_classes, "error_classes", c);
    let mut defaults = file_rules.clone();
    defaults.extend(classify::default_rules());

    let mut providers = BTreeMap::new();
    for (name, p) in &raw.providers {
        let path = format!("providers.{name}");
        if let Some(provider) = provider(name, p, &path, &defaults, &health, live, c) {
            providers.insert(name.clone(), Arc::new(provider));
        }
    }

    let mut targets = BTreeMap::new();
    for (name, t) in &raw.targets {
        let path = format!("targets.{name}");
        let Some(provider) = providers.get(&t.provider) else {
            if !raw.providers.contains_key(&t.provider) {
                c.error(
                    &format!("{path}.provider"),
                    format!("unknown provider `{}`", t.provider),
                );
            }
            continue;
        };
        if t.model.trim().is_empty() {
            c.error(&format!("{path}.model"), "empty upstream model name");
        }
        targets.insert(
            name.clone(),
            Arc::new(Target {
                name: name.clone(),
                provider: Arc::clone(provider),
                model: t.model.clone(),
                capabilities: t.capabilities.clone(),
                max_context: t.max_context,
                max_output: t.max_output,
                cost: t.cost.as_ref().map(|price| {
                    if !(price.input_per_1k >= 0.0 && price.output_per_1k >= 0.0) {
                        c.error(&format!("{path}.cost"), "prices must be zero or more");
                    }
                    Cost {
                        input_per_1k: price.input_per_1k,
                        output_per_1k: price.output_per_1k,
                    }
                }),
                weight: match t.weight {
                    Some(0) => {
                        c.error(
                            &format!("{path}.weight"),
                            "weight must be at least 1 (leave the target out of the chain instead)",
                        );
                        1
                    }
                    Some(w) => w,
                    None => 1,
                },
                health: live.health.get(&provider.base_url, &t.model),
            }),
        );
    }

    let mut tasks = BTreeMap::new();
    let mut models: HashMap<String, Arc<Task>> = HashMap::new();
    let mut claimed: HashMap<String, String> = raw
        .tasks
        .keys()
        .map(|k| (k.clone(), format!("task `{k}`")))
        .collect();
    for (name, t) in &raw.tasks {
        let path = format!("tasks.{name}");
        if t.chain.is_empty() {
            c.error(
                &format!("{path}.chain"),
                "empty degradation chain: name at least one target",
            );
        }
        let mut chain = Vec::new();
        let mut seen = HashSet::new();
        for (i, target) in t.chain.iter().enumerate() {
            let tpath = format!("{path}.chain[{i}]");
            if !seen.insert(target) {
                c.error(
                    &tpath,
                    format!("target `{target}` appears twice in the chain"),
                );
            }
            match targets.get(target) {
                Some(found) => chain.push(Arc::clone(found)),
                None if raw.targets.contains_key(target) => {}
                None => c.error(&tpath, format!("unknown target `{target}`")),
            }
        }
        for (i, alias) in t.aliases.iter().enumerate() {
            let apath = format!("{path}.aliases[{i}]");
            if let Some(owner) = claimed.insert(alias.clone(), format!("task `{name}`")) {
                c.error(
                    &apath,
                    format!("alias `{alias}` is already used by {owner}"),
                );
            }
        }
        let budget = t.budget.as_ref();
        let bpath = format!("{path}.budget");
        let total_timeout = c.duration(
            &format!("{bpath}.total_timeout"),
            budget.and_then(|b| b.total_timeout.as_deref()),
            Duration::from_secs(30),
        );
        let first_token_timeout = budget
            .and_then(|b| b.first_token_timeout.as_deref())
            .map(|v| {
                c.duration(
                    &format!("{bpath}.first_token_timeout"),
                    Some(v),
                    Duration::from_secs(10),
                )
            });
        let max_failovers = budget
            .and_then(|b| b.max_failovers)
            .unwrap_or_else(|| u32::try_from(chain.len().saturating_sub(1)).unwrap_or(u32::MAX));
        let strategy = match t.strategy.as_deref() {
            None => Strategy::Priority,
            Some(s) => Strategy::parse(s).unwrap_or_else(|| {
                c.error(&format!("{path}.strategy"), format!("unknown strategy `{s}`, expected priority, weighted, round_robin, latency or cost"));
                Strategy::Priority
            }),
        };
        if strategy == Strategy::Cost {
            for (i, target) in chain.iter().enumerate() {
                if target.cost.is_none() {
                    c.error(
                        &format!("{path}.chain[{i}]"),
                        format!("strategy `cost` needs a `cost` on target `{}`", target.name),
                    );
                }
            }
        }
        let rate_limit = t.rate_limit.as_ref().and_then(|rl| {
            let lpath = format!("{path}.rate_limit");
            if !(rl.rps.is_finite() && rl.rps > 0.0) {
                c.error(&format!("{lpath}.rps"), "rps must be greater than zero");
                return None;
            }
            let per_caller = rl
                .per_caller_header
                .as_ref()
                .and_then(|h| c.header_name(&format!("{lpath}.per_caller_header"), h))
                .map(|h| (h, rl.max_callers.unwrap_or(10_000).max(1)));
            let key = format!(
                "{name}|{}|{:?}|{:?}|{:?}",
                rl.rps, rl.burst, rl.per_caller_header, rl.max_callers
            );
            shared(&live.task_limits, key, || {
                TaskLimiter::new(rl.rps, rl.burst, per_caller)
            })
        });
        let fallback_budget = t.fallback_budget.as_ref().map(|b| {
            if !(b.usd_per_hour.is_finite() && b.usd_per_hour >= 0.0) {
                c.error(
                    &format!("{path}.fallback_budget.usd_per_hour"),
                    "usd_per_hour must be zero or more",
                );
            }
            b.usd_per_hour
        });
        let known_tags = ["tools", "json_mode", "vision", "streaming"];
        for (i, tag) in t.requires.iter().enumerate() {
            if !known_tags.contains(&tag.as_str())
                && !chain.iter().any(|target| target.capabilities.contains(tag))
            {
                c.warn(
                    &format!("{path}.requires[{i}]"),
                    format!("no target in the chain has capability `{tag}`"),
                );
            }
        }
        let task = Arc::new(Task {
            name: name.clone(),
            aliases: t.aliases.clone(),
            chain,
            budget: Budget {
                total_timeout,
                max_failovers,
                first_token_timeout,
            },
            requires: t.requires.clone(),
            strategy,
            rate_limit,
            fallback_budget,
            state: live.tasks.get(name),
            validate_tool_calls: match t.validate_tool_calls.as_deref() {
                None => crate::schema::Mode::Degraded,
                Some(m) => crate::schema::Mode::parse(m).unwrap_or_else(|| {
                    c.error(
                        &format!("{path}.validate_tool_calls"),
                        format!("unknown value `{m}`, expected degraded, always or never"),
                    );
                    crate::schema::Mode::Degraded
                }),
            },
            tool_schemas: Arc::new(tool_schemas(&t.tool_schemas, &path, base_dir, c)),
        });
        models.insert(name.clone(), Arc::clone(&task));
        for alias in &t.aliases {
            models.insert(alias.clone(), Arc::clone(&task));
        }
        tasks.insert(name.clone(), task);
    }
    let default_task = raw.default_task.as_ref().and_then(|d| {
        let found = tasks.get(d).cloned();
        if found.is_none() && !raw.tasks.contains_key(d) {
            c.error("default_task", format!("unknown task `{d}`"));
        }
        found
    });
    if raw.tasks.is_empty() {
        c.warn("tasks", "no tasks: every request will get 404");
    }

    let mut messages = HashMap::new();
    for (status, text) in &raw.sanitize.messages {
        match status.parse::<u16>() {
            Ok(code) if (400..=599).contains(&code) => {
                messages.insert(code, text.clone());
            }
            _ => c.error(
                &format!("sanitize.messages.{status}"),
                format!("`{status}` is not an HTTP error status (400-599)"),
            ),
        }
    }
    let hosts: Vec<String> = providers
        .values()
        .filter_map(|p| p.chat_url.host().map(str::to_owned))
        .filter(|h| h != "127.0.0.1" && h != "localhost" && h != "[::1]")
        .collect();
    let sanitizer =
        match crate::sanitize::Sanitizer::new(&raw.sanitize.sensitive_words, &hosts, messages) {
            Ok(s) => Some(s),
            Err(e) => {
                c.error("sanitize.sensitive_words", format!("cannot compile: {e}"));
                None
            }
        };

    if c.has_errors() {
        return None;
    }
    let sanitizer = sanitizer?;
    Some(Snapshot {
        listen,
        admin_listen,
        admin_token,
        max_concurrent_requests,
        drain_timeout,
        tasks,
        models,
        default_task,
        targets,
        providers,
        health,
        sanitizer,
        hash,
    })
}

fn provider(
    name: &str,
    p: &crate::config::RawProvider,
    path: &str,
    file_rules: &[Rule],
    health: &HealthConfig,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Provider> {
    let protocol = match p.protocol.as_deref() {
        None | Some("openai") => Protocol::OpenAi,
        Some("anthropic") => Protocol::Anthropic,
        Some(other) => {
            c.error(
                &format!("{path}.protocol"),
                format!("unsupported protocol `{other}` (supported: openai, anthropic)"),
            );
            Protocol::OpenAi
        }
    };
    let base_url = p.base_url.trim_end_matches('/').to_owned();
    let base = c.url(&format!("{path}.base_url"), &base_url);
    if base.as_ref().is_some_and(|u| u.query().is_some()) {
        c.error(
            &format!("{path}.base_url"),
            "a query string in base_url would end up before the path; not supported",
        );
    }
    let endpoint = match protocol {
        Protocol::OpenAi => "chat/completions",
        Protocol::Anthropic => "messages",
    };
    let chat_url = base.and_then(|_| {
        format!("{base_url}/{endpoint}")
            .parse::<Uri>()
            .map_err(|e| c.error(&format!("{path}.base_url"), format!("bad URL: {e}")))
            .ok()
    });
    let host_is_name = chat_url.as_ref().and_then(Uri::host).is_some_and(|h| {
        h.trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_err()
    });

    let mut headers = HeaderMap::new();
    for (k, v) in &p.headers {
        let hpath = format!("{path}.headers.{k}");
        if let (Some(name), Some(value)) = (c.header_name(&hpath, k), c.header_value(&hpath, v)) {
            headers.insert(name, value);
        }
    }
    let secret = api_key(p, path, c);
    if protocol == Protocol::Anthropic && !headers.contains_key("anthropic-version") {
        headers.insert(
            "anthropic-version",
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
    }
    if let Some(key) = &secret {
        let (name, value) = match protocol {
            Protocol::OpenAi => (AUTHORIZATION, format!("Bearer {}", key.expose())),
            Protocol::Anthropic => (
                http::header::HeaderName::from_static("x-api-key"),
                key.expose().to_owned(),
            ),
        };
        match HeaderValue::from_str(&value) {
            Ok(mut v) => {
                v.set_sensitive(true);
                headers.insert(name, v);
            }
            Err(_) => c.error(
                path,
                "the API key contains characters not allowed in a header",
            ),
        }
    }

    let timeout = c.duration(
        &format!("{path}.timeout"),
        p.timeout.as_deref(),
        Duration::from_secs(30),
    );
    let connect_timeout = c.duration(
        &format!("{path}.connect_timeout"),
        p.connect_timeout.as_deref(),
        Duration::from_secs(2),
    );
    let idle_timeout = c.duration(
        &format!("{path}.idle_timeout"),
        p.idle_timeout.as_deref(),
        Duration::from_secs(30),
    );
    let retry = RetryPolicy {
        max: p.retry.as_ref().and_then(|r| r.max).unwrap_or(1),
        backoff: c.duration(
            &format!("{path}.retry.backoff"),
            p.retry.as_ref().and_then(|r| r.backoff.as_deref()),
            Duration::from_millis(200),
        ),
    };
    let limits = p.rate_limit.as_ref().and_then(|rl| {
        if rl.rpm == Some(0) || rl.tpm == Some(0) {
            c.error(
                &format!("{path}.rate_limit"),
                "rpm and tpm must be at least 1",
            );
            return None;
        }
        let key = format!("{name}|{base_url}|{:?}|{:?}|{:?}", rl.rpm, rl.tpm, rl.burst);
        shared(&live.provider_limits, key, || {
            Some(ProviderLimits::new(rl.rpm, rl.tpm, rl.burst))
        })
    });
    let mut table = rules(&p.error_classes, &format!("{path}.error_classes"), c);
    table.extend_from_slice(file_rules);
    Some(Provider {
        protocol,
        name: name.to_owned(),
        base_url,
        chat_url: chat_url?,
        host_is_name,
        headers,
        secret,
        key_file: p.api_key_file.as_ref().map(std::path::PathBuf::from),
        timeout,
        idle_timeout,
        retry,
        errors: ErrorTable::new(table),
        limits,
        probe_interval: match &p.probe {
            Some(probe) => probe_interval(
                c,
                &format!("{path}.probe.interval"),
                Some(probe),
                health.probe_interval,
            ),
            None => health.probe_interval,
        },
        client: live.clients.get(connect_timeout),
    })
}

/// Reads and compiles a task's schema override files.
fn tool_schemas(
    files: &BTreeMap<String, String>,
    task_path: &str,
    base_dir: Option<&std::path::Path>,
    c: &mut Checks<'_>,
) -> crate::schema::Overrides {
    let mut out = crate::schema::Overrides::new();
    for (function, file) in files {
        let spath = format!("{task_path}.tool_schemas.{function}");
        let full = base_dir.map_or_else(|| std::path::PathBuf::from(file), |d| d.join(file));
        let text = match std::fs::read_to_string(&full) {
            Ok(t) => t,
            Err(e) => {
                c.error(&spath, format!("cannot read `{}`: {e}", full.display()));
                continue;
            }
        };
        let schema: serde_json::Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                c.error(&spath, format!("`{}` is not JSON: {e}", full.display()));
                continue;
            }
        };
        match jsonschema::validator_for(&schema) {
            Ok(v) => {
                out.insert(function.clone(), Arc::new(v));
            }
            Err(e) => c.error(
                &spath,
                format!("`{}` is not a valid JSON Schema: {e}", full.display()),
            ),
        }
    }
    out
}

/// A probe interval: a duration, or `0` to disable probing.
fn probe_interval(
    c: &mut Checks<'_>,
    path: &str,
    probe: Option<&crate::config::RawProbe>,
    default: Option<Duration>,
) -> Option<Duration> {
    match probe.and_then(|p| p.interval.as_deref()) {
        None => default,
        Some(v) if v.trim().trim_end_matches(['s', 'm', 'h']).trim() == "0" => None,
        Some(v) => Some(c.duration(path, Some(v), Duration::from_secs(60))),
    }
}

/// Reads a key or token file: at most 64 KiB, and only a regular file (a FIFO
/// or a device such as /dev/zero would block or never end).
fn read_small(path: &str) -> std::io::Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    file.take(64 * 1024).read_to_string(&mut text)?;
    Ok(text)
}

/// Reads the provider's key from its env var or file. A missing key is a
/// warning (an error under `--strict`): the upstream will answer 401, which
/// the error table handles.
fn api_key(p: &crate::config::RawProvider, path: &str, c: &mut Checks<'_>) -> Option<Secret> {
    match (&p.api_key_env, &p.api_key_file) {
        (Some(_), Some(_)) => {
            c.error(
                &format!("{path}.api_key_file"),
                "set either api_key_env or api_key_file, not both",
            );
            None
        }
        (Some(var), None) => match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_owned())),
            _ => {
                c.warn(
                    &format!("{path}.api_key_env"),
                    format!("environment variable `{var}` is not set"),
                );
                None
            }
        },
        (None, Some(file)) => match read_small(file) {
            Ok(v) if !v.trim().is_empty() => Some(Secret::new(v.trim().to_owned())),
            Ok(_) => {
                c.warn(
                    &format!("{path}.api_key_file"),
                    format!("key file `{file}` is empty"),
                );
                None
            }
            Err(e) => {
                c.warn(
                    &format!("{path}.api_key_file"),
                    format!("cannot read key file `{file}`: {e}"),
                );
                None
            }
        },
        (None, None) => None,
    }
}

/// Compiles a list of raw rules; `base` is its path for diagnostics.
fn rules(raw: &[RawRule], base: &str, c: &mut Checks<'_>) -> Vec<Rule> {
    let mut out = Vec::new();
    for (i, r) in raw.iter().enumerate() {
        let path = format!("{base}[{i}]");
        let m = &r.matches;
        let mut matcher = Match::default();
        if let Some(status) = &m.status {
            matcher.status = statuses(status, &format!("{path}.match.status"), c);
        }
        for (j, kind) in m.network.iter().flatten().enumerate() {
            match NetworkKind::parse(kind) {
                Some(k) => matcher.network.push(k),
                None => c.error(
                    &format!("{path}.match.network[{j}]"),
                    format!("unknown network kind `{kind}`, expected one of connect, reset, timeout, tls, dns, protocol"),
                ),
            }
        }
        if let Some(body) = &m.body {
            matcher.body = c.regex(&format!("{path}.match.body"), body);
        }
        if let Some(h) = &m.header {
            let hpath = format!("{path}.match.header");
            let name = c.header_name(&format!("{hpath}.name"), &h.name);
            let re = h
                .regex
                .as_ref()
                .and_then(|r| c.regex(&format!("{hpath}.regex"), r));
            matcher.header = name.map(|n| (n, re));
        }
        let empty_list = m.network.as_ref().is_some_and(Vec::is_empty)
            || m.status
                .as_ref()
                .is_some_and(|v| v.as_sequence().is_some_and(Vec::is_empty));
        if empty_list {
            c.error(
                &format!("{path}.match"),
                "an empty `status` or `network` list matches nothing: remove it or name values",
            );
        }
        if m.status.is_none() && m.network.is_none() && m.body.is_none() && m.header.is_none() {
            c.error(
                &format!("{path}.match"),
                "a rule needs at least one test (status, network, body or header)",
            );
        }
        if !matcher.network.is_empty()
            && (m.status.is_some() || m.body.is_some() || m.header.is_some())
        {
            c.error(&format!("{path}.match"), "`network` cannot be combined with status, body or header tests: a network error has no response");
        }
        let action = Action::parse(&r.action).unwrap_or_else(|| {
            c.error(
                &format!("{path}.action"),
                format!(
                    "unknown action `{}`, expected retry, failover or return",
                    r.action
                ),
            );
            Action::Failover
        });
        let cooldown = r.cooldown.as_deref().map(|cd| {
            if cd == "retry_after" {
                Cooldown::RetryAfter(Duration::from_secs(1))
            } else {
                Cooldown::Fixed(c.duration(
                    &format!("{path}.cooldown"),
                    Some(cd),
                    Duration::from_secs(1),
                ))
            }
        });
        out.push(Rule {
            name: path,
            matcher,
            action,
            health: r.health.unwrap_or(true),
            cooldown,
            context_window: false,
        });
    }
    out
}

fn statuses(v: &serde_yaml::Value, path: &str, c: &mut Checks<'_>) -> Vec<StatusPattern> {
    let one = |v: &serde_yaml::Value, path: &str, c: &mut Checks<'_>| {
        let text = match v {
            serde_yaml::Value::Number(n) => n.to_string(),
            serde_yaml::Value::String(s) => s.clone(),
            _ => String::new(),
        };
        let p = StatusPattern::parse(&text);
        if p.is_none() {
            c.error(
                path,
                format!("bad status `{text}`: expected a code 100-599 or a class like `5xx`"),
            );
        }
        p
    };
    match v {
        serde_yaml::Value::Sequence(items) => items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| one(item, &format!("{path}[{i}]"), c))
            .collect(),
        other => one(other, path, c).into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    fn compile(text: &str) -> Result<Snapshot, Vec<Diagnostic>> {
        let parsed = parse(text)?;
        Snapshot::compile(
            &parsed,
            text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .map(|(s, _)| s)
    }

    const GOOD: &str = "version: 1\nproviders:\n  a: { base_url: 'http://127.0.0.1:9/v1/' }\ntargets:\n  t1: { provider: a, model: m1 }\n  t2: { provider: a, model: m2 }\ntasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [t1, t2]\n";

    #[test]
    fn compiles_and_routes() {
        let s = compile(GOOD).unwrap();
        let task = s.route(None, Some("gpt-4o")).unwrap();
        assert_eq!(task.name, "chat");
        assert_eq!(task.budget.max_failovers, 1);
        assert_eq!(
            task.chain[0].provider.chat_url.to_string(),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert!(s.route(None, Some("nope")).is_none());
        assert!(s.route(Some("chat"), Some("nope")).is_some());
    }

    #[test]
    fn every_semantic_problem_is_reported_with_location() {
        let text = "providers:\n  a: { base_url: 'not a url', timeout: soon }\ntargets:\n  t1: { provider: b, model: m }\ntasks:\n  x: { aliases: [dup], chain: [t9] }\n  y: { aliases: [dup], chain: [] }\n";
        let diags = compile(text).unwrap_err();
        let msgs: Vec<String> = diags.iter().map(ToString::to_string).collect();
        let joined = msgs.join("\n");
        for needle in [
            "missing `version`",
            "bad URL",
            "bad duration",
            "unknown provider `b`",
            "unknown target `t9`",
            "alias `dup`",
            "empty degradation chain",
        ] {
            assert!(joined.contains(needle), "{needle} not in\n{joined}");
        }
        let t9 = diags.iter().find(|d| d.message.contains("t9")).unwrap();
        assert_eq!((t9.line, t9.path.as_str()), (6, "tasks.x.chain[0]"));
    }

    #[test]
    fn unset_key_env_is_a_warning_or_strict_error() {
        let text = GOOD.replace(
            "base_url: 'http://127.0.0.1:9/v1/'",
            "base_url: 'http://127.0.0.1:9/v1/', api_key_env: SWITCHYARD_TEST_UNSET_VAR",
        );
        let parsed = parse(&text).unwrap();
        let (_, warnings) = Snapshot::compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .unwrap();
        assert_eq!(warnings.len(), 1);
        let errs = Snapshot::compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions { strict: true },
        )
        .unwrap_err();
        assert_eq!(errs[0].severity, Severity::Error);
    }

    #[test]
    fn bad_rules_are_rejected() {
        let text = format!("{GOOD}error_classes:\n  - match: {{ status: 7xx, network: [dns, wormhole], body: '(' }}\n    action: explode\n");
        let joined: String = compile(&text)
            .unwrap_err()
            .iter()
            .map(|d| format!("{d}\n"))
            .collect();
        for needle in [
            "bad status",
            "wormhole",
            "bad regex",
            "unknown action",
            "cannot be combined",
        ] {
            assert!(joined.contains(needle), "{needle} not in\n{joined}");
        }
    }

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("sk-live-123".into());
        assert_eq!(format!("{s} {s:?}"), "***** *****");
    }
}
