//! The second config phase: a parsed file becomes a [`Snapshot`] in named
//! passes, each reporting what it finds into one [`Checks`], so one run
//! reports every problem in the file.
//!
//! 1. [`check_version`]
//! 2. [`startup_settings`]: read once at start (`listen`, `admin_listen`,
//!    `max_concurrent_requests`, `telemetry.traces` in [`trace_settings`],
//!    `shared_state` in [`shared_store`])
//! 3. [`health_settings`], [`admin_token`], `drain_timeout`
//! 4. [`error_rules`]: the file's `error_classes`
//! 5. [`providers`]: URL, protocol adapter, key, timeouts, limits, rules
//! 6. [`targets`]: models at providers, with their live health
//! 7. [`tasks`]: chains, budgets, strategies, limits, contracts
//! 8. [`sanitizer`]
//!
//! Reads from the environment and from files happen only in the helpers
//! [`env_secret`], [`file_secret`] and [`schema_file`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Uri;

use super::live::{CallerLimitKey, KeyId, LiveState, ProviderLimitsKey, TaskLimitKey};
use super::{
    After, ApiKey, Budget, Capability, Compiled, Cost, EmbeddingSpace, HedgePolicy, KeySelection,
    KeySource, Prefill, Provider, RetryPolicy, SharedStore, Snapshot, Startup, Strategy,
    StreamRecovery, Target, Task, DEFAULT_LISTEN, MAX_KEYS,
};
use crate::classify::{
    self, Action, Cooldown, ErrorTable, Match, NetworkKind, Rule, Scope, StatusPattern,
};
use crate::config::diagnostic::{Diagnostic, Severity};
use crate::config::validate::Checks;
use crate::config::{Parsed, RawConfig, RawProvider, RawRule, RawTask};
use crate::health::{AllDown, HealthConfig, TargetId};
use crate::metrics::{self as m, RouteMetrics};
use crate::ratelimit::{ProviderLimits, Rate, TaskLimiter};
use crate::secret::Secret;
use crate::telemetry::{Protocol, TraceSettings};
use crate::upstream::pool::HttpVersion;
use crate::upstream::{self, Credential, Endpoint, Urls};

/// Options for compiling.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompileOptions {
    /// Treat warnings (e.g. an unset `api_key_env`) as errors.
    pub strict: bool,
}

/// Compiles a parsed file. Returns the snapshot, its startup settings and
/// its warnings.
///
/// # Errors
/// Every error found (and, under `strict`, every warning), each located.
pub fn compile(
    parsed: &Parsed,
    text: &str,
    live: &LiveState,
    opts: CompileOptions,
) -> Result<Compiled, Vec<Diagnostic>> {
    let mut c = Checks::reading(&parsed.index, &parsed.removed).in_dir(parsed.base_dir.as_deref());
    c.diagnostics.extend(parsed.pending.iter().cloned());
    let raw = &parsed.raw;
    check_version(raw, &mut c);
    check_names(raw, &mut c);
    let startup = startup_settings(raw, &mut c);
    let health = health_settings(raw, &mut c);
    let admin_token = admin_token(raw, &mut c);
    let drain_timeout = c.duration(
        "drain_timeout",
        raw.drain_timeout.as_deref(),
        Duration::from_secs(30),
    );
    let file_rules = error_rules(&raw.error_classes, "error_classes", &mut c);
    let providers = providers(raw, &file_rules, &health, live, &mut c);
    let targets = targets(raw, &providers, live, &mut c);
    let (tasks, models) = tasks(raw, &targets, live, &mut c);
    let default_task = raw.default_task.as_ref().and_then(|d| {
        let found = tasks.get(d).cloned();
        if found.is_none() && !raw.tasks.contains_key(d) && !c.gone(&format!("tasks.{d}")) {
            c.error("default_task", format!("unknown task `{d}`"));
        }
        found
    });
    let sanitizer = sanitizer(raw, &providers, &mut c);

    let warned = c
        .diagnostics
        .iter()
        .any(|d| d.severity == Severity::Warning);
    let failed = c.has_errors() || (opts.strict && warned);
    c.diagnostics.sort_by_key(|d| (d.line, d.column));
    let (Some(sanitizer), false) = (sanitizer, failed) else {
        let mut diags = c.diagnostics;
        if opts.strict {
            for d in diags.iter_mut().filter(|d| d.severity == Severity::Warning) {
                d.severity = Severity::Error;
            }
        }
        return Err(diags);
    };
    let metrics = live.metrics.clone();
    Ok(Compiled {
        snapshot: Snapshot {
            admin_token,
            drain_timeout,
            access_log: raw.telemetry.access_log.unwrap_or(true),
            tasks,
            models,
            default_task,
            targets,
            providers,
            health,
            sanitizer: Arc::new(sanitizer),
            hash: hash(text),
            unrouted: metrics.family(
                m::REQUESTS,
                &[("task", "unknown".into()), ("target", "none".into())],
                &["status"],
            ),
            rate_limited: metrics.family(m::RATE_LIMITED, &[], &["scope"]),
            metrics,
        },
        startup,
        warnings: c.diagnostics,
    })
}

/// FNV-1a of the file's text: shown by `validate`, `/readyz` and a gauge; also
/// the stable names of live state in the shared store.
#[must_use]
pub fn hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Pass 1: `version: 1`.
fn check_version(raw: &RawConfig, c: &mut Checks<'_>) {
    match raw.version {
        // A wrongly typed version was reported as such.
        None if c.gone("version") => {}
        None => c.error("", "missing `version` (write `version: 1` at the top)"),
        Some(1) => {}
        Some(v) => c.error(
            "version",
            format!("unsupported version {v}; this switchyard reads version 1"),
        ),
    }
}

/// Pass 2: the settings read once at start. Each one present gets a note
/// saying so, since a reload cannot apply it.
fn startup_settings(raw: &RawConfig, c: &mut Checks<'_>) -> Startup {
    let listen_text = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
    let listen = listen_text.parse::<SocketAddr>().unwrap_or_else(|_| {
        c.error(
            "listen",
            format!("bad listen address `{listen_text}` (expected IP:PORT, e.g. 127.0.0.1:8080)"),
        );
        SocketAddr::from(([127, 0, 0, 1], 8080))
    });
    let admin_listen = raw.admin_listen.as_deref().and_then(|a| {
        a.parse::<SocketAddr>()
            .map_err(|_| {
                c.error(
                    "admin_listen",
                    format!("bad listen address `{a}` (expected IP:PORT)"),
                );
            })
            .ok()
    });
    let max_concurrent_requests = match raw.max_concurrent_requests {
        Some(0) => {
            c.error("max_concurrent_requests", "must be at least 1");
            1
        }
        Some(n) => n,
        None => 1024,
    };
    let runtimes = match raw.runtimes {
        Some(0) => {
            c.error("runtimes", "at least 1 runtime serves connections");
            1
        }
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
    };
    for (key, set) in [
        ("listen", raw.listen.is_some()),
        ("admin_listen", raw.admin_listen.is_some()),
        (
            "max_concurrent_requests",
            raw.max_concurrent_requests.is_some(),
        ),
        ("runtimes", raw.runtimes.is_some()),
    ] {
        if set {
            c.note(
                key,
                format!("`{key}` is read at start: a changed value takes a restart, not a reload"),
            );
        }
    }
    Startup {
        listen,
        admin_listen,
        max_concurrent_requests,
        runtimes,
        traces: trace_settings(raw, c),
        shared_state: shared_store(raw, c),
    }
}

/// The default `shared_state.redis.key_prefix`.
const DEFAULT_KEY_PREFIX: &str = "switchyard";
/// The default `shared_state.redis.timeout`.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(250);

/// Pass 2c: `shared_state.redis`. The URL is a secret (it may hold a
/// password): no message here quotes it.
fn shared_store(raw: &RawConfig, c: &mut Checks<'_>) -> Option<SharedStore> {
    let section = raw.shared_state.as_ref()?;
    c.note(
        "shared_state",
        "`shared_state` is read at start: a changed value takes a restart, not a reload",
    );
    let Some(r) = &section.redis else {
        if !c.gone("shared_state.redis") {
            c.error(
                "shared_state",
                "missing `redis` (`shared_state: { redis: { url_env: VAR } }`)",
            );
        }
        return None;
    };
    let base = "shared_state.redis";
    let url = match (&r.url_env, &r.url_file) {
        (Some(_), Some(_)) => {
            c.error(
                &format!("{base}.url_file"),
                "set either url_env or url_file, not both",
            );
            None
        }
        // As an unreadable API key: a warning (an error under --strict),
        // and the replica runs on local state, as when the store is down.
        (Some(var), None) => env_secret(var).or_else(|| {
            c.warn(
                &format!("{base}.url_env"),
                format!(
                    "environment variable `{var}` is not set: this replica will not share state"
                ),
            );
            None
        }),
        (None, Some(file)) => file_secret(&c.file(file)).ok().flatten().or_else(|| {
            c.warn(
                &format!("{base}.url_file"),
                format!("cannot read a URL from `{file}`: this replica will not share state"),
            );
            None
        }),
        (None, None)
            if c.gone(&format!("{base}.url_env")) || c.gone(&format!("{base}.url_file")) =>
        {
            None
        }
        (None, None) => {
            c.error(base, "missing `url_env` or `url_file`");
            None
        }
    };
    let setting = if r.url_env.is_some() {
        "url_env"
    } else {
        "url_file"
    };
    let url = url.filter(|u| check_store_url(u, &format!("{base}.{setting}"), c));
    let both_given = r.url_env.is_some() && r.url_file.is_some();
    let key_prefix = r
        .key_prefix
        .clone()
        .unwrap_or_else(|| DEFAULT_KEY_PREFIX.into());
    let prefix_ok = !key_prefix.is_empty()
        && key_prefix.len() <= 64
        && key_prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if !prefix_ok {
        c.error(
            &format!("{base}.key_prefix"),
            "must be 1-64 letters, digits or `_ . : -`",
        );
    }
    let timeout = c.duration(
        &format!("{base}.timeout"),
        r.timeout.as_deref(),
        DEFAULT_STORE_TIMEOUT,
    );
    (!both_given).then_some(SharedStore {
        url,
        key_prefix,
        timeout,
    })
}

/// Whether `url` is one the Redis client can connect to; the message names
/// the setting, never the URL.
fn check_store_url(url: &Secret, at: &str, c: &mut Checks<'_>) -> bool {
    let Some(parsed) = redis::parse_redis_url(url.expose()) else {
        c.error(
            at,
            "the URL is not a redis:// or valkey:// URL (its text is not shown: it may hold a password)",
        );
        return false;
    };
    if matches!(parsed.scheme(), "rediss" | "valkeys") {
        c.error(
            at,
            "TLS (rediss://, valkeys://) is not supported by this build; use redis:// on a private network",
        );
        return false;
    }
    if redis::Client::open(url.expose()).is_err() {
        c.error(
            at,
            "the Redis client refuses the URL (its text is not shown: it may hold a password)",
        );
        return false;
    }
    true
}

/// Pass 2b: `telemetry.traces`, the OTLP export (the `OTEL_*` environment,
/// read when the exporter starts, takes precedence).
pub fn trace_settings(raw: &RawConfig, c: &mut Checks<'_>) -> TraceSettings {
    let Some(t) = &raw.telemetry.traces else {
        return TraceSettings::default();
    };
    c.note(
        "telemetry.traces",
        "`telemetry.traces` is read at start: a changed value takes a restart, not a reload",
    );
    let endpoint = t.endpoint.as_deref().and_then(|e| {
        c.url("telemetry.traces.endpoint", e)
            .map(|_| e.trim_end_matches('/').to_owned())
    });
    let protocol = t.protocol.as_deref().and_then(|p| {
        let parsed = Protocol::parse(p);
        if parsed.is_none() {
            c.error(
                "telemetry.traces.protocol",
                format!("unknown protocol `{p}` (expected `http/protobuf` or `grpc`)"),
            );
        }
        parsed
    });
    let service_name = t.service_name.clone().filter(|n| {
        let ok = !n.trim().is_empty();
        if !ok {
            c.error("telemetry.traces.service_name", "must not be empty");
        }
        ok
    });
    let timeout = t
        .timeout
        .as_deref()
        .map(|_| {
            c.duration(
                "telemetry.traces.timeout",
                t.timeout.as_deref(),
                Duration::ZERO,
            )
        })
        .filter(|d| !d.is_zero());
    TraceSettings {
        endpoint,
        protocol,
        service_name,
        timeout,
    }
}

/// Pass 3a: `health:`.
fn health_settings(raw: &RawConfig, c: &mut Checks<'_>) -> HealthConfig {
    let h = &raw.health;
    let defaults = HealthConfig::default();
    let health = HealthConfig {
        degraded_after: h.degraded_after.unwrap_or(defaults.degraded_after).max(1),
        down_after: h.down_after.unwrap_or(defaults.down_after).max(1),
        open_for: c.duration("health.open_for", h.open_for.as_deref(), defaults.open_for),
        all_down_trial: match h.all_down.as_deref().map(|a| (a, AllDown::parse(a))) {
            None | Some((_, Some(AllDown::Trial))) => true,
            Some((_, Some(AllDown::Fail))) => false,
            Some((other, None)) => {
                c.error(
                    "health.all_down",
                    format!("unknown value `{other}`, expected `trial` or `fail`"),
                );
                true
            }
        },
        window: c.duration("health.window", h.window.as_deref(), defaults.window),
        min_requests: h.min_requests.unwrap_or(defaults.min_requests),
        failure_rate: match h.failure_rate {
            None => defaults.failure_rate,
            Some(r) if r > 0.0 && r <= 1.0 => r,
            Some(r) => {
                c.error(
                    "health.failure_rate",
                    format!("failure_rate {r} must be in (0, 1]"),
                );
                defaults.failure_rate
            }
        },
        probe_interval: probe_interval(
            c,
            "health.probe.interval",
            h.probe.as_ref(),
            defaults.probe_interval,
        ),
    };
    let both_read = c.intact("health.down_after") && c.intact("health.degraded_after");
    if health.down_after < health.degraded_after && both_read {
        c.error(
            "health.down_after",
            "down_after must be at least degraded_after",
        );
    }
    health
}

/// Pass 3b: the admin token. One that was asked for but is missing must not
/// open the endpoints to everyone: the file is refused.
fn admin_token(raw: &RawConfig, c: &mut Checks<'_>) -> Option<Secret> {
    match (&raw.admin_token_env, &raw.admin_token_file) {
        (Some(_), Some(_)) => {
            c.error(
                "admin_token_file",
                "set either admin_token_env or admin_token_file, not both",
            );
            None
        }
        (Some(var), None) => env_secret(var).or_else(|| {
            c.error(
                "admin_token_env",
                format!("environment variable `{var}` is not set"),
            );
            None
        }),
        (None, Some(file)) => match file_secret(&c.file(file)) {
            Ok(Some(token)) => Some(token),
            Ok(None) | Err(_) => {
                c.error(
                    "admin_token_file",
                    format!("cannot read a token from `{file}`"),
                );
                None
            }
        },
        (None, None) => None,
    }
}

/// A secret from the environment variable `var`, trimmed; `None` if unset or blank.
fn env_secret(var: &str) -> Option<Secret> {
    std::env::var(var)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .map(Secret::new)
}

/// A secret from a file, trimmed: at most 64 KiB, and only a regular file (a
/// FIFO or a device such as /dev/zero would block or never end). `Ok(None)`
/// for an empty file.
fn file_secret(path: &Path) -> std::io::Result<Option<Secret>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    file.take(64 * 1024).read_to_string(&mut text)?;
    let text = text.trim();
    Ok((!text.is_empty()).then(|| Secret::new(text.to_owned())))
}

/// A JSON Schema file named by a task's `tool_schemas`, compiled.
fn schema_file(path: &Path) -> Result<jsonschema::Validator, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    let schema: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("`{shown}` is not JSON: {e}"))?;
    jsonschema::validator_for(&schema)
        .map_err(|e| format!("`{shown}` is not a valid JSON Schema: {e}"))
}

/// Pass 4: a list of raw rules; `base` is its path for diagnostics.
fn error_rules(raw: &[RawRule], base: &str, c: &mut Checks<'_>) -> Vec<Rule> {
    raw.iter()
        .enumerate()
        .map(|(i, r)| error_rule(r, &format!("{base}[{i}]"), c))
        .collect()
}

fn error_rule(r: &RawRule, path: &str, c: &mut Checks<'_>) -> Rule {
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
    check_rule_shape(r, path, &matcher, c);
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
        if cd == "until_reload" {
            Cooldown::UntilReload
        } else if cd == "retry_after" {
            Cooldown::RetryAfter(Duration::from_secs(1))
        } else {
            Cooldown::Fixed(c.duration(
                &format!("{path}.cooldown"),
                Some(cd),
                Duration::from_secs(1),
            ))
        }
    });
    let wait_retry_after = r.wait_retry_after.as_deref().map(|w| {
        c.duration(
            &format!("{path}.wait_retry_after"),
            Some(w),
            Duration::from_secs(1),
        )
    });
    let scope = match r.scope.as_deref() {
        None => Scope::Target,
        Some(s) => Scope::parse(s).unwrap_or_else(|| {
            c.error(
                &format!("{path}.scope"),
                format!("unknown scope `{s}`, expected key, target or provider"),
            );
            Scope::Target
        }),
    };
    let until_rotation = revoke(r, path, cooldown, c);
    if cooldown == Some(Cooldown::UntilReload) && scope != Scope::Key {
        c.error(
            &format!("{path}.cooldown"),
            "`until_reload` cools down a key (a revoked one); set `scope: key`",
        );
    }
    Rule {
        name: Arc::from(path),
        matcher,
        action,
        health: r.health.unwrap_or(true),
        cooldown,
        context_window: false,
        wait_retry_after,
        scope,
        until_rotation,
        out_of_credit: false,
    }
}

/// A rule's `revoke`: whether a key it revokes stays out until a rotation
/// (`until_rotation`) instead of being re-probed (`reprobe`, the default).
fn revoke(r: &RawRule, path: &str, cooldown: Option<Cooldown>, c: &mut Checks<'_>) -> bool {
    let until_rotation = match r.revoke.as_deref() {
        None | Some("reprobe") => false,
        Some("until_rotation") => true,
        Some(other) => {
            c.error(
                &format!("{path}.revoke"),
                format!("unknown revoke `{other}`, expected reprobe or until_rotation"),
            );
            false
        }
    };
    if r.revoke.is_some() && cooldown != Some(Cooldown::UntilReload) {
        c.error(
            &format!("{path}.revoke"),
            "`revoke` says how a revoked key comes back; it needs `cooldown: until_reload`",
        );
    }
    until_rotation
}

/// A rule's tests must be able to match something, and only in combinations
/// an outcome can have.
fn check_rule_shape(r: &RawRule, path: &str, matcher: &Match, c: &mut Checks<'_>) {
    let m = &r.matches;
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
    // A test taken out for its type would make these two about what is left.
    if !c.intact(&format!("{path}.match")) {
        return;
    }
    if m.status.is_none() && m.network.is_none() && m.body.is_none() && m.header.is_none() {
        c.error(
            &format!("{path}.match"),
            "a rule needs at least one test (status, network, body or header)",
        );
    }
    if !matcher.network.is_empty() && (m.status.is_some() || m.body.is_some() || m.header.is_some())
    {
        c.error(&format!("{path}.match"), "`network` cannot be combined with status, body or header tests: a network error has no response");
    }
}

fn statuses(v: &serde_yaml::Value, path: &str, c: &mut Checks<'_>) -> Vec<StatusPattern> {
    let one = |v: &serde_yaml::Value, path: &str, c: &mut Checks<'_>| {
        let text = match v {
            serde_yaml::Value::Number(n) => n.to_string(),
            serde_yaml::Value::String(s) => s.clone(),
            serde_yaml::Value::Null
            | serde_yaml::Value::Bool(_)
            | serde_yaml::Value::Sequence(_)
            | serde_yaml::Value::Mapping(_)
            | serde_yaml::Value::Tagged(_) => String::new(),
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
        other @ (serde_yaml::Value::Null
        | serde_yaml::Value::Bool(_)
        | serde_yaml::Value::Number(_)
        | serde_yaml::Value::String(_)
        | serde_yaml::Value::Mapping(_)
        | serde_yaml::Value::Tagged(_)) => one(other, path, c).into_iter().collect(),
    }
}

/// Pass 5: every provider.
fn providers(
    raw: &RawConfig,
    file_rules: &[Rule],
    health: &HealthConfig,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> BTreeMap<String, Arc<Provider>> {
    // Provider rules, then the file's, then the defaults.
    let mut shared_rules = file_rules.to_vec();
    shared_rules.extend(classify::default_rules());
    raw.providers
        .iter()
        .filter_map(|(name, p)| {
            let path = format!("providers.{name}");
            provider(name, p, &path, &shared_rules, health, live, c)
                .map(|provider| (name.clone(), Arc::new(provider)))
        })
        .collect()
}

fn provider(
    name: &str,
    p: &RawProvider,
    path: &str,
    shared_rules: &[Rule],
    health: &HealthConfig,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Provider> {
    let duration = |c: &mut Checks<'_>, key: &str, value: Option<&str>, default: u64| {
        c.duration(
            &format!("{path}.{key}"),
            value,
            Duration::from_millis(default),
        )
    };
    let timeout = duration(c, "timeout", p.timeout.as_deref(), 30_000);
    let connect_timeout = duration(c, "connect_timeout", p.connect_timeout.as_deref(), 2_000);
    let idle_timeout = duration(c, "idle_timeout", p.idle_timeout.as_deref(), 30_000);
    let retry = RetryPolicy {
        max: p.retry.as_ref().and_then(|r| r.max).unwrap_or(1),
        backoff: duration(
            c,
            "retry.backoff",
            p.retry.as_ref().and_then(|r| r.backoff.as_deref()),
            200,
        ),
    };
    let credentials = credentials_file(p, path, c);
    let place = place(p, credentials.as_ref());
    let adapter = protocol(p, path, c);
    let base_url = base_url(p, adapter, &place, path, c)?;
    let endpoint = adapter.and_then(|adapter| {
        let at = Located {
            adapter,
            base_url: &base_url,
            place: &place,
            path,
        };
        endpoint(p, &at, connect_timeout, live, c)
    });
    let keys = endpoint
        .as_ref()
        .map(|e| keys(name, p, path, &base_url, e, live, c))
        .unwrap_or_default();
    let limits = provider_limits(name, &base_url, p, path, live, c);
    let mut rules = error_rules(&p.error_classes, &format!("{path}.error_classes"), c);
    rules.extend_from_slice(shared_rules);
    let probe_interval = match &p.probe {
        Some(probe) => probe_interval(
            c,
            &format!("{path}.probe.interval"),
            Some(probe),
            health.probe_interval,
        ),
        None => health.probe_interval,
    };
    // Checked also when the endpoint was refused: every error in one run.
    let key_selection = key_selection(p, path, c);
    let reserve = reserve(
        p.rate_limit.as_ref(),
        &format!("{path}.rate_limit.reserve"),
        c,
    );
    let shed_after_429 = p.shed_after_429.as_deref().map(|text| {
        c.duration(
            &format!("{path}.shed_after_429"),
            Some(text),
            Duration::ZERO,
        )
    });
    let account = account_of(&base_url, &keys);
    Some(Provider {
        name: name.to_owned(),
        name_header: name_header(name),
        endpoint: endpoint?,
        key_selection,
        key_cursor: live.key_cursors.get((base_url.clone(), keys.len())),
        health: live.providers.get(account.clone()),
        account,
        base_url,
        keys,
        timeout,
        connect_timeout,
        idle_timeout,
        retry,
        errors: ErrorTable::new(rules),
        probe_interval,
        limits,
        reserve,
        shed_after_429,
        prefill: prefill(p),
    })
}

/// The fields a provider's continuation prefill sets (`prefill`).
fn prefill(p: &RawProvider) -> Prefill {
    p.prefill
        .as_ref()
        .map(|raw| Prefill {
            message_fields: raw.message_fields.clone().into_iter().collect(),
            body_fields: raw.body_fields.clone().into_iter().collect(),
        })
        .unwrap_or_default()
}

/// Where a provider is, as its settings say.
fn place<'a>(
    p: &'a RawProvider,
    credentials: Option<&'a serde_json::Value>,
) -> upstream::Place<'a> {
    upstream::Place {
        region: p.region.as_deref(),
        project: p.project.as_deref(),
        location: p.location.as_deref(),
        aws_profile: p.aws_profile.as_deref(),
        credentials,
    }
}

/// The protocol a provider names (`openai` when it names none).
fn protocol(
    p: &RawProvider,
    path: &str,
    c: &mut Checks<'_>,
) -> Option<&'static dyn upstream::Adapter> {
    match p.protocol.as_deref() {
        None => Some(upstream::ADAPTERS[0]),
        Some(name) => upstream::adapter(name).or_else(|| {
            c.error(
                &format!("{path}.protocol"),
                format!(
                    "unsupported protocol `{name}` (supported: {})",
                    upstream::adapter_names()
                ),
            );
            None
        }),
    }
}

/// `base_url` as set (without a trailing `/`), else the protocol's default
/// for the provider's place; the place settings the protocol does not read
/// are refused.
fn base_url(
    p: &RawProvider,
    adapter: Option<&'static dyn upstream::Adapter>,
    place: &upstream::Place<'_>,
    path: &str,
    c: &mut Checks<'_>,
) -> Option<String> {
    let Some(adapter) = adapter else {
        return p
            .base_url
            .as_deref()
            .map(|u| u.trim_end_matches('/').to_owned());
    };
    let set = [
        ("region", p.region.is_some()),
        ("aws_profile", p.aws_profile.is_some()),
        ("project", p.project.is_some()),
        ("location", p.location.is_some()),
        ("credentials_file", p.credentials_file.is_some()),
    ];
    if !place_values_are_names(p, path, c) {
        return None;
    }
    for (key, _) in set
        .iter()
        .filter(|(key, set)| *set && !adapter.place_keys().contains(key))
    {
        c.error(
            &format!("{path}.{key}"),
            format!("`{key}` is not a setting of `protocol: {}`", adapter.name()),
        );
    }
    match &p.base_url {
        Some(url) => Some(url.trim_end_matches('/').to_owned()),
        // Its own error (a wrong type) was reported already.
        None if c.gone(&format!("{path}.base_url")) => None,
        None => adapter
            .default_base_url(place)
            .map_err(|e| c.error(path, e))
            .ok(),
    }
}

/// Whether a provider's region, project and location are the names a cloud
/// gives them (they go into its URL: a `/`, `#` or `:` there would take the
/// requests, and the token with them, somewhere else).
fn place_values_are_names(p: &RawProvider, path: &str, c: &mut Checks<'_>) -> bool {
    let name = |v: &str| {
        !v.is_empty()
            && v.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    // Project ids may be domain-scoped (`example.com:my-project`), and only
    // ever go into the path.
    let project = |v: &str| {
        !v.is_empty()
            && v.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b':')
            })
    };
    let mut good = true;
    for (key, value, ok, allowed) in [
        (
            "region",
            p.region.as_deref(),
            name as fn(&str) -> bool,
            "`-`",
        ),
        ("location", p.location.as_deref(), name, "`-`"),
        ("project", p.project.as_deref(), project, "`-`, `.` and `:`"),
    ] {
        if let Some(value) = value.filter(|v| !ok(v)) {
            good = false;
            c.error(
                &format!("{path}.{key}"),
                format!("`{value}` is not a {key} name (lowercase letters, digits and {allowed})"),
            );
        }
    }
    good
}

/// The JSON of a provider's `credentials_file`, read now (and at each reload).
fn credentials_file(p: &RawProvider, path: &str, c: &mut Checks<'_>) -> Option<serde_json::Value> {
    let file = c.file(p.credentials_file.as_deref()?);
    let at = format!("{path}.credentials_file");
    let text = std::fs::read_to_string(&file)
        .map_err(|e| c.error(&at, format!("cannot read `{}`: {e}", file.display())))
        .ok()?;
    // Never the text in a message: it holds a private key.
    serde_json::from_str(&text)
        .map_err(|e| {
            c.error(
                &at,
                format!(
                    "`{}` is not JSON (line {}, column {})",
                    file.display(),
                    e.line(),
                    e.column()
                ),
            );
        })
        .ok()
}

/// A provider's protocol and where it is.
struct Located<'a> {
    adapter: &'static dyn upstream::Adapter,
    base_url: &'a str,
    place: &'a upstream::Place<'a>,
    path: &'a str,
}

/// A provider's protocol, URLs and headers (the keys come per request).
fn endpoint(
    p: &RawProvider,
    at: &Located<'_>,
    connect_timeout: Duration,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Endpoint> {
    let Located {
        adapter,
        base_url,
        place,
        path,
    } = *at;
    let url_path = format!("{path}.base_url");
    let base = c.url(&url_path, base_url);
    if base.as_ref().is_some_and(|u| u.query().is_some()) {
        c.error(
            &url_path,
            "a query string in base_url would end up before the path; not supported",
        );
    }
    let mut headers = HeaderMap::new();
    for (k, v) in &p.headers {
        let hpath = format!("{path}.headers.{k}");
        if k.eq_ignore_ascii_case("accept-encoding") {
            check_accept_encoding(&hpath, v, c);
        }
        if let (Some(name), Some(value)) = (c.header_name(&hpath, k), c.header_value(&hpath, v)) {
            headers.insert(name, value);
        }
    }
    for (name, value) in adapter.required_headers() {
        if !headers.contains_key(*name) {
            headers.insert(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
    }
    let native = second_api(p, adapter, path, c);
    let version = http_version(p, path, c);
    let query = query_string(&p.query);
    // A base URL already refused is not refused again with its paths.
    let urls = base.and_then(|_| {
        urls(base_url, adapter, native, &query)
            .map_err(|e| c.error(&url_path, format!("bad URL: {e}")))
            .ok()
    })?;
    if let Some(host) = crate::upstream::host_header(&urls.chat) {
        if !headers.contains_key(http::header::HOST) {
            headers.insert(http::header::HOST, host);
        }
    }
    let host_is_name = urls.chat.host().is_some_and(|h| {
        h.trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_err()
    });
    let keyless = p.api_key_env.is_none() && p.api_key_file.is_none() && p.keys.is_empty();
    let auth = if keyless {
        provider_auth(adapter, place, base_url, live)
            .map_err(|e| match e.key {
                Some(key) => c.error(&format!("{path}.{key}"), e.message),
                None => c.error(path, e.message),
            })
            .ok()?
    } else {
        None
    };
    Some(Endpoint {
        adapter,
        native,
        urls,
        headers,
        host_is_name,
        auth,
        client: live.clients.get(base_url, connect_timeout, version),
    })
}

/// A keyless provider's credential source, the one a previous snapshot made
/// when nothing it depends on changed.
fn provider_auth(
    adapter: &'static dyn upstream::Adapter,
    place: &upstream::Place<'_>,
    base_url: &str,
    live: &LiveState,
) -> Result<Option<Arc<upstream::auth::Auth>>, upstream::PlaceError> {
    let identity = format!(
        "{}\n{base_url}\n{:?}\n{:?}\n{:?}\n{:?}\n{:x}",
        adapter.name(),
        place.region,
        place.project,
        place.location,
        place.aws_profile,
        place.credentials.map_or(0, |json| hash(&json.to_string())),
    );
    let mut refused = None;
    let auth = live.auths.get_or_make(identity, || {
        adapter
            .auth(place, base_url)
            .map_err(|e| refused = Some(e))
            .ok()
            .flatten()
    });
    match refused {
        Some(e) => Err(e),
        None => Ok(auth),
    }
}

/// The provider's second API (`responses: true`: an `openai` provider that
/// also serves the Responses API).
fn second_api(
    p: &RawProvider,
    adapter: &'static dyn upstream::Adapter,
    path: &str,
    c: &mut Checks<'_>,
) -> Option<&'static dyn upstream::Adapter> {
    if !p.responses {
        return None;
    }
    if adapter.name() != "openai" {
        c.error(
            &format!("{path}.responses"),
            format!(
                "`responses: true` is for `protocol: openai` providers, not `{}`",
                adapter.name()
            ),
        );
        return None;
    }
    Some(&upstream::responses::Responses)
}

/// The URLs of a provider's operations, with `query` (already encoded) appended.
fn urls(
    base_url: &str,
    adapter: &dyn upstream::Adapter,
    native: Option<&dyn upstream::Adapter>,
    query: &str,
) -> Result<Urls, http::uri::InvalidUri> {
    let url = |path: &str| {
        let sep = if query.is_empty() { "" } else { "?" };
        format!("{base_url}/{path}{sep}{query}").parse::<Uri>()
    };
    // A protocol that makes its paths per call has none fixed: its URLs here
    // are the base's, for the host and for whether an operation is served.
    let per_call = adapter
        .call_path(upstream::Operation::Chat, "model", false)
        .is_some();
    let fixed = |path: &str| if per_call { url("") } else { url(path) };
    Ok(Urls {
        base: base_url.to_owned(),
        query: query.to_owned(),
        chat: fixed(adapter.chat_path())?,
        embeddings: adapter.embeddings_path().map(fixed).transpose()?,
        count_tokens: adapter.count_tokens_path().map(fixed).transpose()?,
        native: native.map(|a| url(a.chat_path())).transpose()?,
    })
}

/// `a=1&b=2`, percent-encoded.
fn query_string(params: &BTreeMap<String, String>) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{}={}", percent_encode(k), percent_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Names end up in metric labels, log fields and headers: a control
/// character (a CR, a tab) in one would break them.
fn check_names(raw: &RawConfig, c: &mut Checks<'_>) {
    let sections = [
        ("providers", raw.providers.keys().collect::<Vec<_>>()),
        ("targets", raw.targets.keys().collect()),
        ("tasks", raw.tasks.keys().collect()),
    ];
    for (section, names) in sections {
        for name in names
            .into_iter()
            .filter(|n| n.chars().any(char::is_control))
        {
            c.error(
                &format!("{section}.{name}"),
                format!("the name {name:?} holds a control character: names go into metric labels, logs and headers"),
            );
        }
    }
}

/// Percent-encodes all but the unreserved characters of RFC 3986.
/// A name as an `x-switchyard-*` header value: as written when it is
/// ASCII, else percent-encoded UTF-8 (raw bytes would reach clients as
/// Latin-1).
fn name_header(name: &str) -> Option<http::HeaderValue> {
    if name.is_ascii() {
        http::HeaderValue::from_str(name).ok()
    } else {
        http::HeaderValue::from_str(&percent_encode(name)).ok()
    }
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// How a provider's connections speak HTTP.
fn http_version(p: &RawProvider, path: &str, c: &mut Checks<'_>) -> HttpVersion {
    match p.http_version.as_deref() {
        None | Some("auto") => HttpVersion::Auto,
        Some("http1") => HttpVersion::Http1,
        Some("http2") => HttpVersion::Http2,
        Some(other) => {
            c.error(
                &format!("{path}.http_version"),
                format!("unknown HTTP version `{other}`, expected auto, http1 or http2"),
            );
            HttpVersion::Auto
        }
    }
}

/// A provider's key selection policy.
fn key_selection(p: &RawProvider, path: &str, c: &mut Checks<'_>) -> KeySelection {
    match p.key_selection.as_deref() {
        None | Some("round_robin") => KeySelection::RoundRobin,
        Some("least_recently_limited") => KeySelection::LeastRecentlyLimited,
        Some(other) => {
            c.error(
                &format!("{path}.key_selection"),
                format!("unknown key selection `{other}`, expected round_robin or least_recently_limited"),
            );
            KeySelection::RoundRobin
        }
    }
}

/// One key as the file declares it.
struct KeySpec {
    name: String,
    source: KeySource,
    /// The path of the source setting (`...api_key_env`, `...keys[1].file`).
    setting: String,
    /// The path of the key's entry, for its other settings.
    at: String,
    rate_limit: Option<crate::config::RawProviderLimit>,
}

/// Where each key is read from: the single `api_key_env`/`api_key_file`, or
/// the `keys` pool.
fn key_sources(p: &RawProvider, path: &str, c: &mut Checks<'_>) -> Vec<KeySpec> {
    let single = match (&p.api_key_env, &p.api_key_file) {
        (Some(_), Some(_)) => {
            c.error(
                &format!("{path}.api_key_file"),
                "set either api_key_env or api_key_file, not both",
            );
            None
        }
        (Some(var), None) => Some((KeySource::Env(var.clone()), format!("{path}.api_key_env"))),
        (None, Some(file)) => Some((
            KeySource::File(c.file(file)),
            format!("{path}.api_key_file"),
        )),
        (None, None) => None,
    };
    if single.is_some() && !p.keys.is_empty() {
        c.error(
            &format!("{path}.keys"),
            "set either `keys` or api_key_env/api_key_file, not both",
        );
    }
    if let Some((source, setting)) = single {
        return vec![KeySpec {
            name: "default".to_owned(),
            source,
            setting,
            at: path.to_owned(),
            rate_limit: None,
        }];
    }
    if p.keys.len() > MAX_KEYS {
        c.error(
            &format!("{path}.keys"),
            format!(
                "at most {MAX_KEYS} keys per provider ({} given)",
                p.keys.len()
            ),
        );
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, k) in p.keys.iter().enumerate().take(MAX_KEYS) {
        let at = format!("{path}.keys[{i}]");
        let name = k.name.clone().unwrap_or_else(|| format!("key{i}"));
        if !seen.insert(name.clone()) {
            c.error(
                &format!("{at}.name"),
                format!("key name `{name}` appears twice"),
            );
        }
        let (source, setting) = match (&k.env, &k.file) {
            (Some(var), None) => (KeySource::Env(var.clone()), format!("{at}.env")),
            (None, Some(file)) => (KeySource::File(c.file(file)), format!("{at}.file")),
            (Some(_), Some(_)) | (None, None) => {
                c.error(&at, "a key needs exactly one of `env` or `file`");
                continue;
            }
        };
        out.push(KeySpec {
            name,
            source,
            setting,
            at,
            rate_limit: k.rate_limit.clone(),
        });
    }
    out
}

/// A provider's keys, each read, with its credential and live state.
fn keys(
    provider: &str,
    p: &RawProvider,
    path: &str,
    base_url: &str,
    endpoint: &Endpoint,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Vec<ApiKey> {
    let mut out = Vec::new();
    for KeySpec {
        name,
        source,
        setting,
        at,
        rate_limit,
    } in key_sources(p, path, c)
    {
        let secret = read_key(&source, &setting, c);
        let credential = secret
            .as_ref()
            .and_then(|s| credential(p, path, endpoint, s, c));
        let id = KeyId {
            base_url: base_url.to_owned(),
            name: name.clone(),
            fingerprint: secret.as_ref().map_or(0, |s| hash(s.expose())),
        };
        let limits = rate_limit.as_ref().and_then(|rl| {
            if !provider_limit_sizes(rl, &format!("{at}.rate_limit"), c) {
                return None;
            }
            // Known by the same name on every replica (never the key: its fingerprint).
            let shared = format!(
                "key\n{}\n{}\n{:016x}\n{:?}\n{:?}\n{:?}",
                id.base_url, id.name, id.fingerprint, rl.rpm, rl.tpm, rl.burst
            );
            live.key_limits
                .get_or_make((id.clone(), rl.rpm, rl.tpm, rl.burst), || {
                    Some(ProviderLimits::new(rl.rpm, rl.tpm, rl.burst).identified(hash(&shared)))
                })
        });
        let health = live.keys.get(id.clone());
        let gauge = live.metrics.gauge(
            m::KEY_STATE,
            &[
                ("provider", provider.to_owned().into()),
                ("key", name.clone().into()),
            ],
        );
        let reserve = reserve(rate_limit.as_ref(), &format!("{at}.rate_limit.reserve"), c);
        out.push(ApiKey {
            reserve,
            gauge,
            health,
            identity: id,
            name,
            source,
            setting,
            secret,
            credential,
            limits,
        });
        if let Some(key) = out.last() {
            key.show_state(tokio::time::Instant::now());
        }
    }
    out
}

/// Reads one key. A missing key is a warning (an error under `--strict`):
/// the upstream will answer 401, which the error table handles.
fn read_key(source: &KeySource, at: &str, c: &mut Checks<'_>) -> Option<Secret> {
    match source {
        KeySource::Env(var) => env_secret(var).or_else(|| {
            c.warn(at, format!("environment variable `{var}` is not set"));
            None
        }),
        KeySource::File(file) => match file_secret(file) {
            Ok(Some(key)) => Some(key),
            Ok(None) => {
                c.warn(at, format!("key file `{}` is empty", file.display()));
                None
            }
            Err(e) => {
                c.warn(
                    at,
                    format!("cannot read key file `{}`: {e}", file.display()),
                );
                None
            }
        },
    }
}

/// How a key goes on a request: the provider's key header (with its prefix),
/// or its query parameter.
fn credential(
    p: &RawProvider,
    path: &str,
    endpoint: &Endpoint,
    secret: &Secret,
    c: &mut Checks<'_>,
) -> Option<Credential> {
    if let Some(param) = &p.key_query {
        let mut params = p.query.clone();
        params.insert(param.clone(), secret.expose().to_owned());
        return urls(
            &endpoint.urls.base,
            endpoint.adapter,
            endpoint.native,
            &query_string(&params),
        )
        .ok()
        .map(|urls| Credential::Query(Box::new(urls)));
    }
    let (default_name, default_prefix) = endpoint.adapter.key_header();
    let name = p.key_header.as_deref().unwrap_or(default_name);
    let prefix = p
        .key_prefix
        .as_deref()
        .unwrap_or(if name.eq_ignore_ascii_case(default_name) {
            default_prefix
        } else {
            ""
        });
    let name = c.header_name(&format!("{path}.key_header"), name)?;
    match HeaderValue::from_str(&format!("{prefix}{}", secret.expose())) {
        Ok(mut value) => {
            value.set_sensitive(true);
            Some(Credential::Header(name, value))
        }
        Err(_) => {
            c.error(
                path,
                "the API key contains characters not allowed in a header",
            );
            None
        }
    }
}

/// An `accept-encoding` a provider sends may only ask for codings switchyard
/// decodes.
fn check_accept_encoding(path: &str, value: &str, c: &mut Checks<'_>) {
    for token in value.split(',') {
        let coding = token
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if !coding.is_empty()
            && coding != "*"
            && !crate::upstream::decode::DECODABLE.contains(&coding.as_str())
        {
            c.error(
                path,
                format!(
                    "switchyard cannot decode the content coding `{coding}` (it decodes {})",
                    crate::upstream::decode::DECODABLE.join(", ")
                ),
            );
        }
    }
}

/// `rpm`, `tpm` and `burst` of a provider's (or key's) limit are at least 1;
/// says whether they are.
fn provider_limit_sizes(
    rl: &crate::config::RawProviderLimit,
    at: &str,
    c: &mut Checks<'_>,
) -> bool {
    let zero_rate = rl.rpm == Some(0) || rl.tpm == Some(0);
    if zero_rate {
        c.error(at, "rpm and tpm must be at least 1");
    }
    burst_at_least_one(rl.burst, &format!("{at}.burst"), c) && !zero_rate
}

/// The share of a bucket kept for critical tasks: 0 to 1 (excluded).
fn reserve(rl: Option<&crate::config::RawProviderLimit>, at: &str, c: &mut Checks<'_>) -> f64 {
    let Some(share) = rl.and_then(|rl| rl.reserve) else {
        return 0.0;
    };
    if rl.is_some_and(|rl| rl.rpm.is_none() && rl.tpm.is_none()) {
        c.warn(
            at,
            "a reserve without `rpm` or `tpm` keeps nothing: there is no bucket",
        );
    }
    if (0.0..1.0).contains(&share) {
        // Rounded up, a reserve can keep a small bucket whole.
        let capacity = rl.and_then(|rl| rl.burst.or(rl.rpm)).unwrap_or(0);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let kept = (f64::from(capacity) * share).ceil() as u32;
        if share > 0.0 && capacity > 0 && kept >= capacity {
            c.warn(at, format!("a reserve of {share} keeps all {capacity} of the bucket: normal and batch tasks never get this target"));
        }
        share
    } else {
        c.error(at, "reserve is the share of the bucket kept for critical tasks: from 0 up to (not including) 1");
        0.0
    }
}

/// A bucket of 0 would refuse every request: `burst` is at least 1.
fn burst_at_least_one(burst: Option<u32>, at: &str, c: &mut Checks<'_>) -> bool {
    if burst == Some(0) {
        c.error(
            at,
            "burst must be at least 1 (a bucket of 0 refuses every request)",
        );
        return false;
    }
    true
}

/// The account's buckets, kept across reloads while account and limits stay.
fn provider_limits(
    name: &str,
    base_url: &str,
    p: &RawProvider,
    path: &str,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Arc<ProviderLimits>> {
    let rl = p.rate_limit.as_ref()?;
    if !provider_limit_sizes(rl, &format!("{path}.rate_limit"), c) {
        return None;
    }
    let key = ProviderLimitsKey {
        name: name.to_owned(),
        base_url: base_url.to_owned(),
        rpm: rl.rpm,
        tpm: rl.tpm,
        burst: rl.burst,
    };
    let shared = format!(
        "provider\n{name}\n{base_url}\n{:?}\n{:?}\n{:?}",
        rl.rpm, rl.tpm, rl.burst
    );
    live.provider_limits.get_or_make(key, || {
        Some(ProviderLimits::new(rl.rpm, rl.tpm, rl.burst).identified(hash(&shared)))
    })
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

/// Pass 6: every target, with the live health of its identity.
fn targets(
    raw: &RawConfig,
    providers: &BTreeMap<String, Arc<Provider>>,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> BTreeMap<String, Arc<Target>> {
    let mut targets = BTreeMap::new();
    for (name, t) in &raw.targets {
        let path = format!("targets.{name}");
        let Some(provider) = providers.get(&t.provider) else {
            // A provider with a problem of its own has been reported already.
            let broken = raw.providers.contains_key(&t.provider)
                || c.gone(&format!("providers.{}", t.provider));
            if !broken {
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
        let cost = t.cost.as_ref().map(|price| {
            if !(price.input_per_1k >= 0.0 && price.output_per_1k >= 0.0) {
                c.error(&format!("{path}.cost"), "prices must be zero or more");
            }
            Cost {
                input_per_1k: price.input_per_1k,
                output_per_1k: price.output_per_1k,
            }
        });
        let weight = match t.weight {
            Some(0) => {
                c.error(
                    &format!("{path}.weight"),
                    "weight must be at least 1 (leave the target out of the chain instead)",
                );
                1
            }
            Some(w) => w,
            None => 1,
        };
        if provider.endpoint.adapter.name() == "anthropic"
            && t.capabilities.contains(&Capability::JsonMode)
        {
            c.warn(
                &format!("{path}.capabilities"),
                "the Anthropic Messages API has no JSON mode: requests with a JSON `response_format` skip this target",
            );
        }
        let id = TargetId {
            base_url: provider.base_url.clone(),
            model: t.model.clone(),
        };
        let target = Target {
            name: name.clone(),
            name_header: name_header(name),
            provider: Arc::clone(provider),
            model: t.model.clone(),
            capabilities: t.capabilities.clone(),
            max_context: t.max_context,
            max_output: t.max_output,
            cost,
            weight,
            health: live.health.get(&id),
            metrics: live.metrics.target(name),
            embedding: embedding(t, provider, &path, c),
        };
        targets.insert(name.clone(), Arc::new(target));
    }
    targets
}

/// A target's embedding space; its protocol must have embeddings.
fn embedding(
    t: &crate::config::RawTarget,
    provider: &Provider,
    path: &str,
    c: &mut Checks<'_>,
) -> Option<EmbeddingSpace> {
    let raw = t.embedding.as_ref()?;
    let adapter = provider.endpoint.adapter;
    if adapter.embeddings_path().is_none() {
        c.error(
            &format!("{path}.embedding"),
            format!("protocol `{}` has no embeddings endpoint", adapter.name()),
        );
    }
    if raw.model_family.trim().is_empty() {
        c.error(
            &format!("{path}.embedding.model_family"),
            "empty model family",
        );
    }
    if raw.dimensions == 0 {
        c.error(
            &format!("{path}.embedding.dimensions"),
            "dimensions must be at least 1",
        );
    }
    Some(EmbeddingSpace {
        family: raw.model_family.clone(),
        dimensions: raw.dimensions,
    })
}

/// A task's `requires`: each capability must be had by some target of the
/// chain, else the task could never serve a request. Checked only when every
/// target of the chain was read with its capabilities (a broken one has its
/// own error already).
fn requires(t: &RawTask, path: &str, chain: &[Arc<Target>], c: &mut Checks<'_>) {
    let whole = chain.len() == t.chain.len()
        && chain
            .iter()
            .all(|target| !c.gone(&format!("targets.{}.capabilities", target.name)));
    if !whole || chain.is_empty() {
        return;
    }
    for (i, tag) in t.requires.iter().enumerate() {
        if !chain.iter().any(|target| target.capabilities.contains(tag)) {
            c.error(
                &format!("{path}.requires[{i}]"),
                format!(
                    "no target in the chain ({}) has capability `{tag}`, so every request would be refused: add it to a target's `capabilities` or drop it here",
                    t.chain.join(", ")
                ),
            );
        }
    }
}

/// A chain's embedding space: every target's the same, or none has one.
/// Vectors from two spaces are not interchangeable, so a chain mixing them
/// (or mixing embeddings and chat targets) is refused.
fn chain_embedding(
    chain: &[Arc<Target>],
    path: &str,
    c: &mut Checks<'_>,
) -> Option<EmbeddingSpace> {
    let first = chain.first()?;
    for (i, target) in chain.iter().enumerate().skip(1) {
        if target.embedding != first.embedding {
            let show = |t: &Target| {
                t.embedding.as_ref().map_or_else(
                    || "chat (no `embedding`)".to_owned(),
                    |e| format!("embedding {e}"),
                )
            };
            c.error(
                &format!("{path}.chain[{i}]"),
                format!(
                    "target `{}` is {} but `{}` is {}: a chain fails over only within one embedding space",
                    target.name,
                    show(target),
                    first.name,
                    show(first)
                ),
            );
        }
    }
    first.embedding.clone()
}

/// Tasks by name, and by name or alias.
type Tasks = (BTreeMap<String, Arc<Task>>, HashMap<String, Arc<Task>>);

/// Pass 7: every task, and the table of names and aliases that select one.
fn tasks(
    raw: &RawConfig,
    targets: &BTreeMap<String, Arc<Target>>,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Tasks {
    let mut tasks = BTreeMap::new();
    let mut models: HashMap<String, Arc<Task>> = HashMap::new();
    let mut claimed: HashMap<String, String> = raw
        .tasks
        .keys()
        .map(|k| (k.clone(), format!("task `{k}`")))
        .collect();
    for (name, t) in &raw.tasks {
        let path = format!("tasks.{name}");
        for (i, alias) in t.aliases.iter().enumerate() {
            if let Some(owner) = claimed.insert(alias.clone(), format!("task `{name}`")) {
                c.error(
                    &format!("{path}.aliases[{i}]"),
                    format!("alias `{alias}` is already used by {owner}"),
                );
            }
        }
        let task = Arc::new(task(name, t, &path, raw, targets, live, c));
        for id in std::iter::once(name).chain(&t.aliases) {
            models.insert(id.clone(), Arc::clone(&task));
        }
        tasks.insert(name.clone(), task);
    }
    if raw.tasks.is_empty() {
        c.warn("tasks", "no tasks: every request will get 404");
    }
    (tasks, models)
}

#[allow(clippy::too_many_arguments)]
fn task(
    name: &str,
    t: &RawTask,
    path: &str,
    raw: &RawConfig,
    targets: &BTreeMap<String, Arc<Target>>,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Task {
    let chain = chain(t, path, raw, targets, c);
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
    requires(t, path, &chain, c);
    let tool_schemas = Arc::new(tool_schemas(&t.tool_schemas, path, c));
    let fallback_budget = t.fallback_budget.as_ref().map(|b| {
        if !(b.usd_per_hour.is_finite() && b.usd_per_hour >= 0.0) {
            c.error(
                &format!("{path}.fallback_budget.usd_per_hour"),
                "usd_per_hour must be zero or more",
            );
        }
        b.usd_per_hour
    });
    let validate_tool_calls = match t.validate_tool_calls.as_deref() {
        None => crate::schema::Mode::Degraded,
        Some(mode) => crate::schema::Mode::parse(mode).unwrap_or_else(|| {
            c.error(
                &format!("{path}.validate_tool_calls"),
                format!("unknown value `{mode}`, expected degraded, always or never"),
            );
            crate::schema::Mode::Degraded
        }),
    };
    let repairs = repairs(t, path, c);
    let metrics = &live.metrics;
    let embedding = chain_embedding(&chain, path, c);
    // The tool call contract is a chat answer's: no such series for embeddings.
    let chat = embedding.is_none();
    Task {
        name: name.to_owned(),
        aliases: t.aliases.clone(),
        budget: budget(t, path, chain.len(), c),
        requires: t.requires.clone(),
        strategy,
        rate_limit: task_limits(name, t, path, live, c),
        fallback_budget,
        state: live.tasks.get(name.to_owned()),
        validate_tool_calls,
        repair_targets: repair_targets(t, path, raw, targets, &repairs, c),
        repairs,
        priority: match t.priority.as_deref() {
            None => crate::config::Priority::Normal,
            Some(name) => crate::config::Priority::parse(name).unwrap_or_else(|| {
                c.error(
                    &format!("{path}.priority"),
                    format!("unknown priority `{name}`, expected critical, normal or batch"),
                );
                crate::config::Priority::Normal
            }),
        },
        queue: queue(name, t, path, live, c),
        bare_contract: Arc::new(crate::schema::Contract::bare(&tool_schemas)),
        tool_schemas,
        routes: chain
            .iter()
            .map(|target| metrics.route(name, &target.name, chat))
            .collect::<Vec<RouteMetrics>>(),
        unserved: metrics.route(name, "none", chat),
        cancelled: metrics.counter(m::CLIENT_CANCELLED, &[("task", name.to_owned().into())]),
        stream_recovery: stream_recovery(t, path, c),
        hedge: hedge(t, path, c),
        hedges: metrics.family(m::HEDGES, &[("task", name.to_owned().into())], &["result"]),
        cache: cache(name, t, path, (chat, raw), live, c),
        embedding,
        chain,
    }
}

/// A batch task's queue.
fn queue(
    name: &str,
    t: &RawTask,
    path: &str,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<crate::ratelimit::Queue> {
    let raw = t.queue.as_ref()?;
    if t.priority.as_deref() != Some("batch") {
        c.error(
            &format!("{path}.queue"),
            "only a `priority: batch` task waits in a queue",
        );
        return None;
    }
    let max_wait = c.duration(
        &format!("{path}.queue.max_wait"),
        raw.max_wait.as_deref(),
        Duration::from_secs(60),
    );
    let max_depth = raw.max_depth.unwrap_or(1000);
    if max_depth == 0 {
        c.error(
            &format!("{path}.queue.max_depth"),
            "a queue holds at least 1 request (no queue: leave `queue` out)",
        );
    }
    let label = [("task", name.to_owned().into())];
    let metrics = &live.metrics;
    let line = live.queues.get_or_make(name.to_owned(), || {
        Some(crate::ratelimit::Line::new(
            metrics.gauge(m::QUEUE_DEPTH, &label),
            (
                metrics.histogram(m::QUEUE_WAIT, &label),
                metrics.counter(m::QUEUE_FULL, &label),
            ),
        ))
    })?;
    Some(crate::ratelimit::Queue::new(
        max_wait,
        max_depth.max(1),
        line,
    ))
}

/// A task's repairs of answers that break the contract, in order.
fn repairs(t: &RawTask, path: &str, c: &mut Checks<'_>) -> Vec<crate::schema::Repair> {
    use crate::schema::Repair;
    let raw = t.contract.as_ref().map_or(&[][..], |k| &k.repair[..]);
    let mut repairs = Vec::with_capacity(raw.len());
    for (i, name) in raw.iter().enumerate() {
        match Repair::parse(name) {
            Some(r) if !repairs.contains(&r) => repairs.push(r),
            Some(_) => c.error(
                &format!("{path}.contract.repair[{i}]"),
                format!("`{name}` is listed twice"),
            ),
            None => {
                let known: Vec<&str> = Repair::ALL.iter().map(|r| r.as_str()).collect();
                c.error(
                    &format!("{path}.contract.repair[{i}]"),
                    format!("unknown repair `{name}`, expected {}", known.join(", ")),
                );
            }
        }
    }
    repairs
}

/// The targets of `to_tool`: `repair_target` names a target, or a task
/// whose chain is tried in order; each must declare `tools`.
fn repair_targets(
    t: &RawTask,
    path: &str,
    raw: &RawConfig,
    targets: &BTreeMap<String, Arc<Target>>,
    repairs: &[crate::schema::Repair],
    c: &mut Checks<'_>,
) -> Vec<Arc<Target>> {
    let wants = repairs.contains(&crate::schema::Repair::ToTool);
    let named = t.contract.as_ref().and_then(|k| k.repair_target.as_deref());
    let at = format!("{path}.contract.repair_target");
    let name = match (wants, named) {
        (false, None) => return Vec::new(),
        (true, None) => {
            c.error(&format!("{path}.contract.repair"), "`to_tool` needs a `repair_target`: the target or task that turns prose into the call");
            return Vec::new();
        }
        (false, Some(_)) => {
            c.error(
                &at,
                "`repair_target` is only used by the `to_tool` repair: add it to `repair`",
            );
            return Vec::new();
        }
        (true, Some(name)) => name,
    };
    let names: Vec<String> = if targets.contains_key(name) {
        vec![name.to_owned()]
    } else if let Some(task) = raw.tasks.get(name) {
        task.chain.clone()
    } else {
        c.error(&at, format!("unknown target or task `{name}`"));
        return Vec::new();
    };
    let mut out = Vec::new();
    for n in names {
        // An unknown name in a task's chain is that task's error already.
        let Some(target) = targets.get(n.as_str()) else {
            continue;
        };
        if target
            .capabilities
            .contains(&crate::config::Capability::Tools)
        {
            out.push(Arc::clone(target));
        } else {
            c.error(&at, format!("target `{n}` cannot make tool calls: it does not declare the `tools` capability"));
        }
    }
    out
}

/// A task's cache, on the store its bounds keep across reloads.
fn cache(
    name: &str,
    t: &RawTask,
    path: &str,
    (chat, config): (bool, &RawConfig),
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Arc<crate::cache::TaskCache>> {
    let Some(raw) = t.cache.as_ref() else {
        if t.cache_nondeterministic.is_some() {
            c.warn(
                &format!("{path}.cache_nondeterministic"),
                "the task has no `cache`: this has no effect",
            );
        }
        return None;
    };
    let cpath = format!("{path}.cache");
    let semantic = semantic(raw, &cpath, config, c);
    if !chat {
        c.error(
            &cpath,
            "only a chat task caches answers (this chain serves embeddings)",
        );
        return None;
    }
    let max_bytes = match raw.max_bytes.as_deref() {
        None => 64 << 20,
        Some(text) => match text.trim().parse::<bytesize::ByteSize>() {
            Ok(size) if size.as_u64() >= 1024 => size.as_u64(),
            Ok(_) => {
                c.error(&format!("{cpath}.max_bytes"), "a cache holds at least 1KiB");
                return None;
            }
            Err(_) => {
                c.error(
                    &format!("{cpath}.max_bytes"),
                    format!("bad size `{text}`: write bytes, or a number and a unit like `64MiB`"),
                );
                return None;
            }
        },
    };
    let policy = crate::cache::Policy {
        ttl: c.duration(
            &format!("{cpath}.ttl"),
            raw.ttl.as_deref(),
            Duration::from_secs(600),
        ),
        stale_if_error: c.duration(
            &format!("{cpath}.stale_if_error"),
            raw.stale_if_error.as_deref(),
            Duration::ZERO,
        ),
        max_bytes,
        nondeterministic: t.cache_nondeterministic.unwrap_or(false),
        semantic,
    };
    if !policy.stale_if_error.is_zero() && policy.stale_if_error <= policy.ttl {
        c.warn(
            &format!("{cpath}.stale_if_error"),
            "not longer than `ttl`: every answer young enough to be served stale is still fresh (only a client's no-cache or max-age reaches it); make it longer",
        );
    }
    if policy.semantic.as_ref().is_some_and(|s| s.stale) && policy.stale_if_error.is_zero() {
        c.warn(
            &format!("{cpath}.semantic.stale"),
            "there is no `stale_if_error`: no answer is ever served stale",
        );
    }
    let id = (name.to_owned(), max_bytes, policy.retention());
    let store = live.caches.get_or_make(id, || {
        Some(crate::cache::Store::new(max_bytes, policy.retention()))
    })?;
    let link = Arc::clone(&live.cache_link);
    Some(Arc::new(crate::cache::TaskCache::new(
        name,
        policy,
        store,
        link,
        &live.metrics,
    )))
}

/// A cache's `mode` and, for `semantic`, how it looks up by meaning: an
/// embeddings task of the file, a threshold in (0, 1], at least 1 turn.
fn semantic(
    raw: &crate::config::RawCache,
    cpath: &str,
    config: &RawConfig,
    c: &mut Checks<'_>,
) -> Option<crate::cache::SemanticPolicy> {
    let semantic = match (raw.mode.as_deref(), &raw.semantic) {
        (None | Some("exact"), None) => return None,
        (Some("semantic"), Some(semantic)) => semantic,
        (None | Some("exact"), Some(_)) => {
            c.error(
                &format!("{cpath}.semantic"),
                "`semantic` is read only with `mode: semantic`",
            );
            return None;
        }
        (Some("semantic"), None) => {
            c.error(
                &format!("{cpath}.mode"),
                "`mode: semantic` needs `semantic: { embeddings: TASK }`",
            );
            return None;
        }
        (Some(other), _) => {
            c.error(
                &format!("{cpath}.mode"),
                format!("unknown cache mode `{other}`, expected exact or semantic"),
            );
            return None;
        }
    };
    let spath = format!("{cpath}.semantic");
    let name = &semantic.embeddings;
    let embeds = config.tasks.get(name).map(|task| {
        task.chain
            .iter()
            .all(|t| config.targets.get(t).is_some_and(|t| t.embedding.is_some()))
    });
    match embeds {
        None => c.error(
            &format!("{spath}.embeddings"),
            format!("unknown task `{name}`"),
        ),
        Some(false) => c.error(
            &format!("{spath}.embeddings"),
            format!(
                "task `{name}` does not serve embeddings: its targets declare no `embedding` space"
            ),
        ),
        Some(true) => {}
    }
    let threshold = semantic.threshold.unwrap_or(0.95);
    if !(threshold > 0.0 && threshold <= 1.0) {
        c.error(
            &format!("{spath}.threshold"),
            "a cosine similarity above 0, up to 1",
        );
    }
    let max_messages = semantic.max_messages.unwrap_or(4);
    if max_messages == 0 {
        c.error(
            &format!("{spath}.max_messages"),
            "at least 1 turn is looked up by meaning",
        );
    }
    Some(crate::cache::SemanticPolicy {
        embeddings: name.clone(),
        threshold,
        max_messages: max_messages as usize,
        stale: semantic.stale.unwrap_or(false),
    })
}

/// A task's hedging policy.
fn hedge(t: &RawTask, path: &str, c: &mut Checks<'_>) -> Option<HedgePolicy> {
    let raw = t.hedge.as_ref()?;
    let hpath = format!("{path}.hedge");
    let after = match raw.after.trim().strip_prefix('p') {
        Some(pct) => {
            let quantile = pct.parse::<f64>().ok().map(|p| p / 100.0);
            let Some(quantile) = quantile.filter(|q| *q > 0.0 && *q < 1.0) else {
                c.error(
                    &format!("{hpath}.after"),
                    format!("bad percentile `{}`: expected p50 to p99.9", raw.after),
                );
                return None;
            };
            let floor = c.duration(
                &format!("{hpath}.floor"),
                raw.floor.as_deref(),
                Duration::from_millis(50),
            );
            let cap = c.duration(
                &format!("{hpath}.cap"),
                raw.cap.as_deref(),
                Duration::from_secs(2),
            );
            if floor > cap {
                let at = if raw.floor.is_some() { "floor" } else { "cap" };
                c.error(
                    &format!("{hpath}.{at}"),
                    format!(
                        "hedge.floor ({}) is above hedge.cap ({}): the delay is clamped to [floor, cap]",
                        humantime::format_duration(floor),
                        humantime::format_duration(cap)
                    ),
                );
            }
            After::Percentile {
                quantile,
                floor,
                cap,
            }
        }
        None => After::Fixed(c.duration(
            &format!("{hpath}.after"),
            Some(&raw.after),
            Duration::from_secs(1),
        )),
    };
    if raw.max.is_some_and(|m| m != 1) {
        c.error(
            &format!("{hpath}.max"),
            "only one hedge per request is supported: `max: 1`",
        );
    }
    let max_share = raw.max_share.unwrap_or(0.1);
    if !(0.0..=1.0).contains(&max_share) {
        c.error(&format!("{hpath}.max_share"), "max_share must be in [0, 1]");
    }
    Some(HedgePolicy { after, max_share })
}

/// What a task does when a stream breaks after its commit point.
fn stream_recovery(t: &RawTask, path: &str, c: &mut Checks<'_>) -> StreamRecovery {
    let Some(raw) = &t.stream_recovery else {
        return StreamRecovery::default();
    };
    let continues = match raw.mode.as_deref() {
        None | Some("off") => false,
        Some("continue") => true,
        Some(other) => {
            c.error(
                &format!("{path}.stream_recovery.mode"),
                format!("unknown mode `{other}`, expected off or continue"),
            );
            false
        }
    };
    StreamRecovery {
        continues,
        max_continuations: raw.max_continuations.unwrap_or(1),
        seam_comment: raw.seam_comment.unwrap_or(false),
    }
}

/// A task's degradation chain, resolved.
fn chain(
    t: &RawTask,
    path: &str,
    raw: &RawConfig,
    targets: &BTreeMap<String, Arc<Target>>,
    c: &mut Checks<'_>,
) -> Vec<Arc<Target>> {
    if t.chain.is_empty() && c.intact(&format!("{path}.chain")) {
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
            // Its own entry has the problem, already reported.
            None if raw.targets.contains_key(target) || c.gone(&format!("targets.{target}")) => {}
            None => c.error(&tpath, format!("unknown target `{target}`")),
        }
    }
    chain
}

fn budget(t: &RawTask, path: &str, chain_len: usize, c: &mut Checks<'_>) -> Budget {
    let budget = t.budget.as_ref();
    let bpath = format!("{path}.budget");
    Budget {
        total_timeout: c.duration(
            &format!("{bpath}.total_timeout"),
            budget.and_then(|b| b.total_timeout.as_deref()),
            Duration::from_secs(30),
        ),
        max_failovers: budget
            .and_then(|b| b.max_failovers)
            .unwrap_or_else(|| u32::try_from(chain_len.saturating_sub(1)).unwrap_or(u32::MAX)),
        first_token_timeout: budget
            .and_then(|b| b.first_token_timeout.as_deref())
            .map(|v| {
                c.duration(
                    &format!("{bpath}.first_token_timeout"),
                    Some(v),
                    Duration::from_secs(10),
                )
            }),
    }
}

/// The task's client-facing buckets, kept across reloads while its limits stay.
fn task_limits(
    name: &str,
    t: &RawTask,
    path: &str,
    live: &LiveState,
    c: &mut Checks<'_>,
) -> Option<Arc<TaskLimiter>> {
    let rl = t.rate_limit.as_ref()?;
    let lpath = format!("{path}.rate_limit");
    let positive = |c: &mut Checks<'_>, key: &str, rps: f64| {
        let usable = Rate { rps, burst: None }.is_usable();
        if !(rps.is_finite() && rps > 0.0) {
            c.error(&format!("{lpath}.{key}"), "rps must be greater than zero");
        } else if !usable {
            c.error(
                &format!("{lpath}.{key}"),
                format!("rps {rps} is too small or too large for a token bucket"),
            );
        }
        usable
    };
    let task_rate = rl.rps.map(|rps| Rate {
        rps,
        burst: rl.burst,
    });
    let mut ok = task_rate.is_none_or(|r| positive(c, "rps", r.rps));
    ok &= burst_at_least_one(rl.burst, &format!("{lpath}.burst"), c);
    // With a key taken out for its type, the shape checks would be about what is left.
    let whole = c.intact(&lpath);
    if whole && rl.rps.is_none() && rl.burst.is_some() {
        c.error(
            &format!("{lpath}.burst"),
            "`burst` sizes the task-wide bucket and needs `rps` (a caller's burst goes under `per_caller`)",
        );
        ok = false;
    }
    let per_caller = rl.per_caller.as_ref().and_then(|pc| {
        let rate_ok = positive(c, "per_caller.rps", pc.rps)
            & burst_at_least_one(pc.burst, &format!("{lpath}.per_caller.burst"), c);
        let header = c.header_name(&format!("{lpath}.per_caller.header"), &pc.header);
        let rate = Rate {
            rps: pc.rps,
            burst: pc.burst,
        };
        rate_ok
            .then_some(header)
            .flatten()
            .map(|h| (h, rate, pc.max_callers.unwrap_or(10_000)))
    });
    if rl.per_caller.is_some() && per_caller.is_none() {
        ok = false;
    }
    if whole && rl.rps.is_none() && rl.per_caller.is_none() {
        c.error(
            &lpath,
            "a rate_limit needs `rps` (task-wide), `per_caller`, or both",
        );
        ok = false;
    }
    if !(ok && whole) {
        return None;
    }
    let key = TaskLimitKey {
        task: name.to_owned(),
        task_rate: task_rate.map(|r| (r.rps.to_bits(), r.burst)),
        per_caller: rl.per_caller.as_ref().map(|pc| CallerLimitKey {
            header: pc.header.clone(),
            rps_bits: pc.rps.to_bits(),
            burst: pc.burst,
            max_callers: pc.max_callers,
        }),
    };
    live.task_limits
        .get_or_make(key, || TaskLimiter::new(task_rate, per_caller))
}

/// Reads and compiles a task's schema override files.
fn tool_schemas(
    files: &BTreeMap<String, String>,
    task_path: &str,
    c: &mut Checks<'_>,
) -> crate::schema::Overrides {
    let mut out = crate::schema::Overrides::new();
    for (function, file) in files {
        let full = c.file(file);
        match schema_file(&full) {
            Ok(v) => {
                out.insert(function.clone(), Arc::new(v));
            }
            Err(e) => c.error(&format!("{task_path}.tool_schemas.{function}"), e),
        }
    }
    out
}

/// Pass 8: what upstream error text may reach clients.
fn sanitizer(
    raw: &RawConfig,
    providers: &BTreeMap<String, Arc<Provider>>,
    c: &mut Checks<'_>,
) -> Option<crate::sanitize::Sanitizer> {
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
        .filter_map(|p| p.endpoint.urls.chat.host().map(str::to_owned))
        .filter(|h| h != "127.0.0.1" && h != "localhost" && h != "[::1]")
        .collect();
    crate::sanitize::Sanitizer::new(&raw.sanitize.sensitive_words, &hosts, messages)
        .map_err(|e| c.error("sanitize.sensitive_words", format!("cannot compile: {e}")))
        .ok()
}

/// What a provider's account-wide state (its cooldown) is kept by: its URL and
/// its keys' fingerprints, so that two accounts on one URL (two keys of one
/// vendor, declared as two providers) never hold each other back.
fn account_of(base_url: &str, keys: &[ApiKey]) -> String {
    let mut prints: Vec<u64> = keys.iter().map(|k| k.identity.fingerprint).collect();
    prints.sort_unstable();
    prints.dedup();
    prints.iter().fold(base_url.to_owned(), |mut id, print| {
        id.push_str(&format!(" {print:016x}"));
        id
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    fn compile_text(text: &str) -> Result<Snapshot, Vec<Diagnostic>> {
        let parsed = parse(text)?;
        compile(
            &parsed,
            text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .map(|c| c.snapshot)
    }

    const GOOD: &str = "version: 1\nproviders:\n  a: { base_url: 'http://127.0.0.1:9/v1/' }\ntargets:\n  t1: { provider: a, model: m1 }\n  t2: { provider: a, model: m2 }\ntasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [t1, t2]\n";

    #[test]
    fn compiles_and_routes() {
        let s = compile_text(GOOD).unwrap();
        let task = s.route(None, Some("gpt-4o")).unwrap();
        assert_eq!(task.name, "chat");
        assert_eq!(task.budget.max_failovers, 1);
        assert_eq!(
            task.chain[0].provider.endpoint.urls.chat.to_string(),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert!(s.route(None, Some("nope")).is_none());
        assert!(s.route(Some("chat"), Some("nope")).is_some());
    }

    #[test]
    fn every_semantic_problem_is_reported_with_location() {
        let text = "providers:\n  a: { base_url: 'not a url', timeout: soon }\ntargets:\n  t1: { provider: b, model: m }\ntasks:\n  x: { aliases: [dup], chain: [t9] }\n  y: { aliases: [dup], chain: [] }\n";
        let diags = compile_text(text).unwrap_err();
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
        let compiled = compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions::default(),
        )
        .unwrap();
        assert_eq!(compiled.warnings.len(), 1);
        let errs = compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions { strict: true },
        )
        .unwrap_err();
        assert_eq!(errs[0].severity, Severity::Error);
    }

    #[test]
    fn startup_settings_get_a_note_that_never_fails_strict() {
        let text = format!("{GOOD}listen: 127.0.0.1:9999\nmax_concurrent_requests: 3\n");
        let parsed = parse(&text).unwrap();
        let compiled = compile(
            &parsed,
            &text,
            &LiveState::default(),
            CompileOptions { strict: true },
        )
        .unwrap();
        assert_eq!(compiled.startup.max_concurrent_requests, 3);
        assert_eq!(compiled.warnings.len(), 2, "{:?}", compiled.warnings);
        assert!(compiled
            .warnings
            .iter()
            .all(|d| d.severity == Severity::Note && d.message.contains("takes a restart")));
    }

    #[test]
    fn bad_rules_are_rejected() {
        let text = format!("{GOOD}error_classes:\n  - match: {{ status: 7xx, network: [dns, wormhole], body: '(' }}\n    action: explode\n");
        let joined: String = compile_text(&text)
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
}
