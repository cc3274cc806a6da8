//! Raw `routes.yaml` types, exactly as written, and parsing them with locations.
//!
//! This is the first of the two configuration phases: serde structs with
//! `deny_unknown_fields` that accept any well-formed file. Values that need a
//! semantic check (durations, URLs, regexes, references between sections) stay
//! strings here; [`crate::snapshot::compile`] turns them into typed, resolved
//! values and reports every problem at once through [`validate`]'s checkers.

pub mod diagnostic;
pub mod locate;
pub mod validate;

use std::collections::BTreeMap;
use std::path::Path;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use diagnostic::Diagnostic;
use locate::LocationIndex;

/// The whole file, version 1. Every key is documented in README.md.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Format version; must be `1`. Required.
    pub version: Option<u64>,
    /// Address the gateway listens on, e.g. `127.0.0.1:8080`.
    pub listen: Option<String>,
    /// Separate address for `/admin/*` (read at start; `--admin-listen` overrides).
    pub admin_listen: Option<String>,
    /// Environment variable holding a token that `/admin/*` then requires (`Authorization: Bearer`).
    pub admin_token_env: Option<String>,
    /// File holding that token instead.
    pub admin_token_file: Option<String>,
    /// Most chat requests in progress at once; more get 503 (default 1024; read at start).
    pub max_concurrent_requests: Option<usize>,
    /// How long shutdown waits for in-flight requests and streams (default 30s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub drain_timeout: Option<String>,
    /// Upstream accounts by name: URL, key, timeouts, retry policy.
    #[serde(default)]
    pub providers: BTreeMap<String, RawProvider>,
    /// Targets by name: one upstream model at one provider.
    #[serde(default)]
    pub targets: BTreeMap<String, RawTarget>,
    /// Task types by name: aliases, degradation chain, budget.
    #[serde(default)]
    pub tasks: BTreeMap<String, RawTask>,
    /// Task used when a request names neither a known task nor alias.
    pub default_task: Option<String>,
    /// Error-class rules tried in order before the built-in default table.
    #[serde(default)]
    pub error_classes: Vec<RawRule>,
    /// Health thresholds and circuit breaker timing.
    #[serde(default)]
    pub health: RawHealth,
    /// What upstream error text may reach clients.
    #[serde(default)]
    pub sanitize: RawSanitize,
    /// The access log and OpenTelemetry traces.
    #[serde(default)]
    pub telemetry: RawTelemetry,
}

/// The access log and OpenTelemetry trace export.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// One structured log line per chat request, at info (default true; applied on reload).
    pub access_log: Option<bool>,
    /// OTLP trace export (read at start). The standard `OTEL_*` environment
    /// variables take precedence over these keys.
    pub traces: Option<RawTraces>,
}

/// OTLP trace export.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTraces {
    /// Collector base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` (e.g.
    /// `http://otel-collector:4318`; `/v1/traces` is appended for HTTP).
    /// Setting it turns export on.
    pub endpoint: Option<String>,
    /// `http/protobuf` (default) or `grpc`, as `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub protocol: Option<String>,
    /// The `service.name` resource attribute (default `switchyard`), as `OTEL_SERVICE_NAME`.
    pub service_name: Option<String>,
    /// Longest wait for the collector per export (default 10s), as `OTEL_EXPORTER_OTLP_TIMEOUT`.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub timeout: Option<String>,
}

/// What upstream error text may reach clients.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSanitize {
    /// Phrases removed from upstream error text (case-insensitive), e.g. a vendor's sales pitch.
    #[serde(default)]
    pub sensitive_words: Vec<String>,
    /// Friendly `error.message` per HTTP status (`"429": "Busy, retry shortly."`).
    #[serde(default)]
    pub messages: BTreeMap<String, String>,
}

/// One upstream account.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawProvider {
    /// Wire protocol: `openai` (the default; OpenAI Chat Completions) or
    /// `anthropic` (the Messages API, translated both ways).
    pub protocol: Option<String>,
    /// Base URL; requests go to `{base_url}/chat/completions` (`openai`) or
    /// `{base_url}/messages` (`anthropic`).
    pub base_url: String,
    /// Environment variable holding the API key (sent as `Authorization: Bearer`
    /// for `openai`, `x-api-key` for `anthropic`).
    pub api_key_env: Option<String>,
    /// File holding the API key (e.g. a mounted Kubernetes Secret); re-read on reload.
    pub api_key_file: Option<String>,
    /// Extra headers sent with every upstream request.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Per-attempt timeout (humantime, e.g. `30s`); default 30 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub timeout: Option<String>,
    /// TCP (and TLS) connect timeout; default 2 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub connect_timeout: Option<String>,
    /// Longest silence between two stream chunks after the first; default 30 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub idle_timeout: Option<String>,
    /// Same-target retry policy for errors classed `retry`.
    pub retry: Option<RawRetry>,
    /// Error-class rules for this provider, tried before the top-level ones.
    #[serde(default)]
    pub error_classes: Vec<RawRule>,
    /// Active probe settings for this provider's targets (overrides `health.probe`).
    pub probe: Option<RawProbe>,
    /// The account's rate limits; a request that does not fit is not sent.
    pub rate_limit: Option<RawProviderLimit>,
}

/// Same-target retry policy.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    /// Retries after the first attempt (default 1).
    pub max: Option<u32>,
    /// Base of the exponential backoff with full jitter (default 200ms).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub backoff: Option<String>,
}

/// One model at one provider.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    /// Name of a provider in `providers`.
    pub provider: String,
    /// The upstream's own model name, written into the forwarded request.
    pub model: String,
    /// Free capability tags; `tools`, `json_mode`, `vision`, `streaming` mean something to routing.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Context window in tokens: prompt estimate + `max_tokens` must fit.
    pub max_context: Option<u64>,
    /// Longest answer in tokens the target produces.
    pub max_output: Option<u64>,
    /// Price in USD per 1,000 tokens.
    pub cost: Option<RawCost>,
    /// Share for the `weighted` strategy (default 1).
    pub weight: Option<u32>,
}

/// Price of a target, USD per 1,000 tokens.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCost {
    /// Per 1,000 prompt tokens.
    #[serde(default)]
    pub input_per_1k: f64,
    /// Per 1,000 completion tokens.
    #[serde(default)]
    pub output_per_1k: f64,
}

/// A token bucket for clients of a task.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTaskLimit {
    /// Sustained requests per second (may be fractional).
    pub rps: f64,
    /// Bucket size: requests allowed at once (default: `rps` rounded up).
    pub burst: Option<u32>,
    /// Also one bucket per caller, keyed by this request header's value.
    pub per_caller_header: Option<String>,
    /// Most callers tracked at once (default 10,000); the least recent are dropped.
    pub max_callers: Option<usize>,
}

/// Limits of a provider account.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawProviderLimit {
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens per minute (prompt estimate + max_tokens, corrected by reported usage).
    pub tpm: Option<u32>,
    /// Requests allowed at once (default: `rpm`).
    pub burst: Option<u32>,
}

/// Spend cap on fallback targets.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawFallbackBudget {
    /// USD per clock hour that non-first targets of the chain may cost.
    pub usd_per_hour: f64,
}

/// A task type: what a request asks for, and where it may go.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTask {
    /// Public model names that select this task (besides its own name).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Degradation chain: target names, tried in order.
    #[serde(default)]
    pub chain: Vec<String>,
    /// Time and failover budget of one request.
    pub budget: Option<RawBudget>,
    /// Capability tags every target must have, on top of what the request needs.
    #[serde(default)]
    pub requires: Vec<String>,
    /// How the first target is chosen: `priority` (default), `weighted`,
    /// `round_robin`, `latency` or `cost`; failover then follows chain order.
    pub strategy: Option<String>,
    /// Client-facing token bucket.
    pub rate_limit: Option<RawTaskLimit>,
    /// Spend cap on fallback targets.
    pub fallback_budget: Option<RawFallbackBudget>,
    /// When answers' `tool_calls` are validated: `degraded` (default), `always`, `never`.
    pub validate_tool_calls: Option<String>,
    /// JSON Schema files (relative to this file's directory) that override the
    /// request's `parameters`, by function name.
    #[serde(default)]
    pub tool_schemas: BTreeMap<String, String>,
}

/// Time and failover budget of one request of a task.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    /// End-to-end deadline from the request's arrival (default 30 s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub total_timeout: Option<String>,
    /// Most switches to another target in one request (default: chain length - 1).
    pub max_failovers: Option<u32>,
    /// Streams: longest wait for the first content chunk from one target (default: none).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub first_token_timeout: Option<String>,
}

/// One error-class rule: when every given test in `match` holds, take `action`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    /// The tests; all given ones must hold. An empty match matches everything.
    #[serde(rename = "match", default)]
    pub matches: RawMatch,
    /// `retry`, `failover` or `return`.
    pub action: String,
    /// Whether the outcome counts against the target's health (default true).
    pub health: Option<bool>,
    /// Skip the target for this long (`retry_after` = the wait the upstream
    /// advertises: `Retry-After`, `retry-after-ms`, rate-limit reset headers).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub cooldown: Option<String>,
    /// For a 429 whose advertised wait is at most this long and fits the
    /// deadline: wait it out and retry the same target once instead of
    /// failing over (default: off).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub wait_retry_after: Option<String>,
}

/// The tests of an error-class rule.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    /// Status codes or classes: `503`, `"5xx"`, or a list of them.
    #[schemars(with = "Option<serde_json::Value>")]
    pub status: Option<serde_yaml::Value>,
    /// Network error kinds: `connect`, `reset`, `timeout`, `tls`, `dns`, `protocol`.
    pub network: Option<Vec<String>>,
    /// Regex over the response body (error bodies and small 200 bodies).
    pub body: Option<String>,
    /// A response header and a regex over its value.
    pub header: Option<RawHeaderMatch>,
}

/// A header test of an error-class rule.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawHeaderMatch {
    /// Header name, case-insensitive.
    pub name: String,
    /// Regex over the header's value; absent means "header present".
    pub regex: Option<String>,
}

/// Health thresholds and breaker timing (see the state machine in README.md).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    /// Consecutive counted failures before HEALTHY -> DEGRADED (default 3).
    pub degraded_after: Option<u32>,
    /// Consecutive counted failures before -> DOWN, breaker open (default 5).
    pub down_after: Option<u32>,
    /// How long a DOWN target is skipped before one half-open trial (default 20s, ±20 % jitter).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub open_for: Option<String>,
    /// What to do when every target of a chain is DOWN: `trial` (default) or `fail`.
    pub all_down: Option<String>,
    /// Sliding window for the failure rate (default 30s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub window: Option<String>,
    /// Fewest counted outcomes in the window before its rate is judged (default 10).
    pub min_requests: Option<u32>,
    /// Failure rate (0.0-1.0) over the window that makes a target DEGRADED (default 0.5).
    pub failure_rate: Option<f64>,
    /// Active probing of DOWN targets.
    pub probe: Option<RawProbe>,
}

/// Active probe settings.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawProbe {
    /// How often a DOWN target is probed (default 60s; `0` disables).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<DurationText>")]
    pub interval: Option<String>,
}

/// Schema of a duration: humantime text (`30s`, `1m 30s`) or a bare number.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum DurationText {
    /// `250ms`, `30s`, `2m`.
    Text(String),
    /// `0` (where zero means "off").
    Number(u64),
}

/// The JSON Schema of routes.yaml, as `schemas/routes.schema.json` holds it.
#[must_use]
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(RawConfig);
    serde_json::to_string_pretty(&schema).unwrap_or_default() + "\n"
}

/// Reads a duration as written: a humantime string, or a bare number (which
/// `Snapshot::compile` then reports unless it is `0` where `0` means "off").
/// Accepting both here keeps `interval: 0` and `timeout: 30` from being type
/// errors that would hide the file's other problems.
fn duration_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        S(String),
        U(u64),
        F(f64),
    }
    Ok(Option::<Text>::deserialize(d)?.map(|t| match t {
        Text::S(s) => s,
        Text::U(n) => n.to_string(),
        Text::F(f) => f.to_string(),
    }))
}

/// A parsed file: its raw form plus the index that locates any path in it.
#[derive(Debug)]
pub struct Parsed {
    /// The raw configuration.
    pub raw: RawConfig,
    /// Locations of every key and value, for semantic diagnostics.
    pub index: LocationIndex,
    /// The file's directory, for relative paths in it (`None` for text parsed on its own).
    pub base_dir: Option<std::path::PathBuf>,
    /// Unknown-key errors found while parsing. The file was parsed without
    /// those keys so that the semantic checks still run and every problem is
    /// reported in one pass; compiling fails while this is not empty.
    pub pending: Vec<Diagnostic>,
}

/// Reads and parses `path`.
///
/// # Errors
/// Every syntax, type and unknown-key problem found, each with line and column.
/// Unreadable files give one diagnostic at 1:1.
pub fn load(path: &Path) -> Result<(Parsed, String), Vec<Diagnostic>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![Diagnostic::error(
            "",
            1,
            1,
            format!("cannot read file: {e}"),
        )]
    })?;
    let mut parsed = parse(&text)?;
    parsed.base_dir = path.parent().map(Path::to_path_buf);
    Ok((parsed, text))
}

/// Parses the text of a `routes.yaml`.
///
/// # Errors
/// As [`load`]: syntax errors (one, where the parser stopped), then type and
/// unknown-key errors for every section entry that has one.
pub fn parse(text: &str) -> Result<Parsed, Vec<Diagnostic>> {
    let index = LocationIndex::build(text).map_err(|d| vec![d])?;
    if let Some(dup) = index.duplicates().first() {
        return Err(vec![dup.clone()]);
    }
    match serde_yaml::from_str::<RawConfig>(text) {
        Ok(raw) => Ok(Parsed {
            raw,
            index,
            base_dir: None,
            pending: Vec::new(),
        }),
        Err(first) => {
            let first = || {
                let (line, column) = first.location().map_or((1, 1), |l| (l.line(), l.column()));
                vec![Diagnostic::error(
                    "",
                    line,
                    column,
                    strip_location(&first.to_string()),
                )]
            };
            let Ok(mut value) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
                return Err(first());
            };
            // serde stops at the first problem of a map; sweep each section entry
            // on its own, and while unknown keys are the only problems, drop them
            // and sweep again, so one pass reports every unknown key and the
            // semantic checks still run on the rest.
            let mut pending: Vec<Diagnostic> = Vec::new();
            for _ in 0..64 {
                let (diags, unknown) = sweep(value.clone(), &index);
                if diags.is_empty() {
                    break;
                }
                let only_unknown = unknown.len() == diags.len();
                pending.extend(diags);
                if !only_unknown || remove_keys(&mut value, &unknown).is_none() {
                    break;
                }
                if let Ok(raw) = serde_yaml::from_value::<RawConfig>(value.clone()) {
                    pending.sort_by_key(|d| (d.line, d.column));
                    return Ok(Parsed {
                        raw,
                        index,
                        base_dir: None,
                        pending,
                    });
                }
            }
            if pending.is_empty() {
                return Err(first());
            }
            pending.sort_by_key(|d| (d.line, d.column));
            Err(pending)
        }
    }
}

/// Removes the keys at `paths` (dotted, with `[i]` for list items) from `value`.
fn remove_keys(value: &mut serde_yaml::Value, paths: &[String]) -> Option<()> {
    for path in paths {
        let (parent, key) = path.rsplit_once('.').unwrap_or(("", path.as_str()));
        let mut node = &mut *value;
        for segment in parent.split('.').filter(|s| !s.is_empty()) {
            let (name, indices) = match segment.find('[') {
                Some(i) => (&segment[..i], &segment[i..]),
                None => (segment, ""),
            };
            node = node.get_mut(name)?;
            for index in indices.split(['[', ']']).filter(|s| !s.is_empty()) {
                node = node.get_mut(index.parse::<usize>().ok()?)?;
            }
        }
        node.as_mapping_mut()?.remove(key)?;
    }
    Some(())
}

/// Deserializes each top-level key (and each entry of the named-map sections)
/// separately, collecting every error with its location. Also returns the
/// paths of the unknown keys among them.
fn sweep(value: serde_yaml::Value, index: &LocationIndex) -> (Vec<Diagnostic>, Vec<String>) {
    let mut sw = Sweep {
        index,
        diags: Vec::new(),
        unknown: Vec::new(),
    };
    let serde_yaml::Value::Mapping(top) = value else {
        sw.diags.push(Diagnostic::error(
            "",
            1,
            1,
            "the file must be a mapping of keys (version, providers, targets, tasks, ...)",
        ));
        return (sw.diags, sw.unknown);
    };
    for (key, value) in top {
        let Some(key) = key.as_str() else {
            sw.diags.push(Diagnostic::error(
                "",
                1,
                1,
                "top-level keys must be strings",
            ));
            continue;
        };
        match key {
            "providers" => sw.map::<RawProvider>(key, value),
            "targets" => sw.map::<RawTarget>(key, value),
            "tasks" => sw.map::<RawTask>(key, value),
            "version" => sw.check::<Option<u64>>(key, value),
            "listen" | "default_task" | "admin_listen" | "admin_token_env" | "admin_token_file"
            | "drain_timeout" => {
                sw.check::<Option<String>>(key, value);
            }
            "max_concurrent_requests" => sw.check::<Option<usize>>(key, value),
            "error_classes" => sw.check::<Vec<RawRule>>(key, value),
            "health" => sw.check::<RawHealth>(key, value),
            "sanitize" => sw.check::<RawSanitize>(key, value),
            other => {
                let (line, column) = index.key_or_value(other);
                sw.unknown.push(other.to_owned());
                sw.diags.push(Diagnostic::error(
                    other,
                    line,
                    column,
                    format!("unknown field `{other}`, expected one of `version`, `listen`, `admin_listen`, `admin_token_env`, `admin_token_file`, `max_concurrent_requests`, `drain_timeout`, `providers`, `targets`, `tasks`, `default_task`, `error_classes`, `health`, `sanitize`"),
                ));
            }
        }
    }
    sw.diags.sort_by_key(|d| (d.line, d.column));
    (sw.diags, sw.unknown)
}

struct Sweep<'a> {
    index: &'a LocationIndex,
    diags: Vec<Diagnostic>,
    unknown: Vec<String>,
}

impl Sweep<'_> {
    fn map<T: DeserializeOwned>(&mut self, section: &str, value: serde_yaml::Value) {
        match value {
            serde_yaml::Value::Mapping(entries) => {
                for (name, entry) in entries {
                    let name = name
                        .as_str()
                        .map_or_else(|| format!("{name:?}"), str::to_owned);
                    self.check::<T>(&format!("{section}.{name}"), entry);
                }
            }
            serde_yaml::Value::Null => {}
            other @ (serde_yaml::Value::Bool(_)
            | serde_yaml::Value::Number(_)
            | serde_yaml::Value::String(_)
            | serde_yaml::Value::Sequence(_)
            | serde_yaml::Value::Tagged(_)) => {
                self.check::<BTreeMap<String, T>>(section, other);
            }
        }
    }

    /// Deserializes `value` as `T`; on failure records one diagnostic located
    /// at the deepest path serde reached (the offending key itself for unknown
    /// keys).
    fn check<T: DeserializeOwned>(&mut self, base: &str, value: serde_yaml::Value) {
        let Err(err) = serde_path_to_error::deserialize::<_, T>(value) else {
            return;
        };
        let mut path = base.to_owned();
        for segment in err.path().iter() {
            match segment {
                serde_path_to_error::Segment::Seq { index } => path.push_str(&format!("[{index}]")),
                serde_path_to_error::Segment::Map { key } => {
                    path.push('.');
                    path.push_str(key);
                }
                serde_path_to_error::Segment::Enum { .. }
                | serde_path_to_error::Segment::Unknown => {}
            }
        }
        let message = strip_location(&err.inner().to_string());
        // serde names an unknown key in backticks; the path may or may not end with it.
        let unknown_key = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split('`').next())
            .map(|field| {
                if path.ends_with(&format!(".{field}")) {
                    path.clone()
                } else {
                    format!("{path}.{field}")
                }
            });
        let located = unknown_key.as_deref().unwrap_or(&path);
        let (line, column) = self.index.key_or_value(located);
        if let Some(key) = &unknown_key {
            self.unknown.push(key.clone());
        }
        self.diags
            .push(Diagnostic::error(located, line, column, message));
    }
}

/// serde_yaml appends " at line L column C" to its messages; we print locations ourselves.
fn strip_location(message: &str) -> String {
    match message.find(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unknown_key_is_reported_with_its_location() {
        let text = "version: 1\nproviders:\n  a:\n    base_url: http://x\n    colour: red\ntargets:\n  t: { provider: a, model: m, flavour: 1 }\ntasks: {}\n";
        let diags = parse(text).unwrap().pending;
        assert_eq!(diags.len(), 2, "{diags:?}");
        assert_eq!((diags[0].line, diags[0].column), (5, 5));
        assert!(diags[0].message.contains("colour"));
        assert_eq!(diags[1].line, 7);
        assert!(diags[1].message.contains("flavour"));
    }

    #[test]
    fn several_unknown_keys_in_one_map_and_semantic_problems_come_together() {
        let text = "version: 1\nproviders:\n  a:\n    base_url: http://x\n    colour: red\n    size: 3\n    timeout: soon\ntargets: {}\ntasks:\n  t: { chain: [nope] }\n";
        let parsed = parse(text).unwrap();
        assert_eq!(parsed.pending.len(), 2, "{:?}", parsed.pending);
        let diags = crate::snapshot::compile::compile(
            &parsed,
            text,
            &crate::snapshot::LiveState::default(),
            crate::snapshot::CompileOptions::default(),
        )
        .unwrap_err();
        let all: Vec<String> = diags.iter().map(ToString::to_string).collect();
        assert_eq!(diags.len(), 4, "{all:#?}");
        assert!(
            all[0].starts_with("5:5:") && all[0].contains("colour"),
            "{all:#?}"
        );
        assert!(all[1].starts_with("6:5:") && all[1].contains("size"));
        assert!(all[2].contains("bad duration"));
        assert!(all[3].contains("unknown target `nope`"));
    }

    #[test]
    fn syntax_error_has_a_location() {
        let diags = parse("version: 1\nproviders: [\n").unwrap_err();
        assert_eq!(diags.len(), 1);
        assert!(diags[0].line >= 2, "{diags:?}");
    }

    #[test]
    fn checked_in_schema_is_current() {
        let checked_in = include_str!("../schemas/routes.schema.json");
        assert!(
            checked_in == json_schema(),
            "schemas/routes.schema.json is stale: run `cargo run -- schema > schemas/routes.schema.json`"
        );
    }

    #[test]
    fn example_routes_yaml_validates_against_the_schema() {
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../schemas/routes.schema.json")).unwrap();
        let example: serde_json::Value =
            serde_yaml::from_str(include_str!("../routes.yaml")).unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&example)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{errors:#?}");
        let bad: serde_json::Value = serde_yaml::from_str("version: 1\nprovidres: {}\n").unwrap();
        assert!(
            !validator.is_valid(&bad),
            "unknown keys are schema errors too"
        );
    }

    #[test]
    fn wrong_type_is_located() {
        let text =
            "version: 1\ntasks:\n  a:\n    chain: [x]\n    budget: { max_failovers: lots }\n";
        let diags = parse(text).unwrap_err();
        assert_eq!(diags.len(), 1, "{diags:?}");
        assert_eq!(diags[0].line, 5);
        assert_eq!(diags[0].path, "tasks.a.budget.max_failovers");
    }
}
