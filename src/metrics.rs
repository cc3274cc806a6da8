//! Metric names, their descriptions, and one Prometheus registry per gateway.
//!
//! Each gateway owns its [`Metrics`] (no process-wide recorder), so two
//! gateways in one process — tests, an embedding program — never see each
//! other's counts. Handles for a task's or a target's series are resolved when
//! a snapshot is compiled ([`TargetMetrics`], [`RouteMetrics`]); series whose
//! label takes one of a few fixed values are resolved on first use and cached
//! ([`Family`]), so the request path never builds a metric key.
//!
//! Label values come only from config names (task, target) and fixed enums
//! (outcome, reason, result), never from request contents, so cardinality is
//! bounded by the config. Every metric is documented in README.md.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use parking_lot::RwLock;

/// Counter `{task, target, status}`: requests answered, by final status.
/// `target` is the serving target, or `none`.
pub const REQUESTS: &str = "switchyard_requests_total";
/// Histogram `{task, target}`: seconds from arrival to the response head (streams: to commit);
/// `target` is the serving target or `none`.
pub const REQUEST_DURATION: &str = "switchyard_request_duration_seconds";
/// Histogram `{task, target}`: seconds from arrival to the first content chunk of a stream.
pub const TIME_TO_FIRST_TOKEN: &str = "switchyard_time_to_first_token_seconds";
/// Counter `{target, outcome}`: upstream attempts by outcome (`success`, a status
/// class like `5xx`, a network kind, `in_band_error`, `stream_error`, ...).
pub const UPSTREAM_ATTEMPTS: &str = "switchyard_upstream_attempts_total";
/// Counter `{task, from, to, reason}`: switches from one target to the next.
pub const FAILOVERS: &str = "switchyard_failovers_total";
/// Counter `{task, target, reason}`: targets excluded or skipped without a call.
pub const SKIPPED: &str = "switchyard_route_exclusions_total";
/// Counter `{scope}`: requests refused by a token bucket (`task`, `caller`: answered 429;
/// `provider`: that target skipped).
pub const RATE_LIMITED: &str = "switchyard_ratelimited_total";
/// Counter `{target, kind}`: tokens reported by upstreams (`prompt`, `completion`).
pub const TOKENS: &str = "switchyard_tokens_total";
/// `{task, target}`: USD spent, from reported usage and the target's `cost`. Only
/// ever increases, but exported as a gauge: the metrics crate's counters are integers.
pub const COST: &str = "switchyard_cost_usd_total";
/// Counter `{target, reason}`: streams broken after the commit point.
pub const STREAM_INTERRUPTS: &str = "switchyard_stream_interrupts_total";
/// Counter `{task, from, to, mode, result}`: broken streams continued on
/// another target (`mode`: prefill, restart; `result`: completed,
/// interrupted, diverged, failed).
pub const STREAM_CONTINUATIONS: &str = "switchyard_stream_continuations_total";
/// Counter `{task, result}`: hedged first attempts: `won` (the hedge answered
/// first), `lost` (the first attempt did), `cancelled` (neither answered),
/// `suppressed` (due, but the rate cap, the failover budget or the lack of
/// another admitted target held it back).
pub const HEDGES: &str = "switchyard_hedges_total";
/// Gauge `{provider, key}`: an API key's state: 0 usable, 1 cooling down
/// (a 429), 2 revoked (a 401/403; until a reload or a rotation of its file),
/// 3 unreadable.
pub const KEY_STATE: &str = "switchyard_key_state";
/// Counter `{target}`: malformed events dropped from a committed stream.
pub const STREAM_MALFORMED: &str = "switchyard_stream_malformed_events_total";
/// Counter `{task, target}`: answers that broke the degraded-answer contract (tool calls).
pub const CONTRACT_VIOLATIONS: &str = "switchyard_contract_violations_total";
/// `switchyard_queue_depth{task}`.
pub const QUEUE_DEPTH: &str = "switchyard_queue_depth";
/// `switchyard_queue_wait_seconds{task}`.
pub const QUEUE_WAIT: &str = "switchyard_queue_wait_seconds";
/// `switchyard_queue_full_total{task}`.
pub const QUEUE_FULL: &str = "switchyard_queue_full_total";
/// `switchyard_contract_repairs_total{task, target, method, result}`.
pub const CONTRACT_REPAIRS: &str = "switchyard_contract_repairs_total";
/// Counter `{task}`: requests whose client hung up before the answer was complete.
pub const CLIENT_CANCELLED: &str = "switchyard_client_cancelled_total";
/// Gauge `{target}`: 0 healthy, 1 degraded, 2 down.
pub const TARGET_HEALTH: &str = "switchyard_target_health";
/// Counter `{target, from, to}`: health state changes.
pub const BREAKER_TRANSITIONS: &str = "switchyard_breaker_transitions_total";
/// Counter `{target, result}`: active probes of DOWN targets, `reachable` or `unreachable`.
pub const PROBES: &str = "switchyard_probes_total";
/// Counter `{result}`: config loads and reloads, `ok` or `error`.
pub const CONFIG_RELOADS: &str = "switchyard_config_reloads_total";
/// Gauge: the loaded config's content hash (low 48 bits, as shown by `validate` and `/readyz`).
pub const CONFIG_HASH: &str = "switchyard_config_hash";
/// Gauge: Unix time (seconds) the loaded config was applied.
pub const CONFIG_LOADED_AT: &str = "switchyard_config_loaded_timestamp_seconds";

/// Gauge `{task}`: targets of the task's chain that are available (not DOWN, a key usable), set at each
/// scrape (0: none is, and `/readyz` says so too).
pub const TASK_TARGETS_AVAILABLE: &str = "switchyard_task_targets_available";
/// Counter: spans dropped because the trace export queue was full (collector
/// down or slow); process-wide, shown with tracing on.
pub const TRACE_SPANS_DROPPED: &str = "switchyard_trace_spans_dropped_total";
/// Counter: spans the collector accepted; process-wide, shown with tracing on.
pub const TRACE_SPANS_EXPORTED: &str = "switchyard_trace_spans_exported_total";
/// Counter: trace export calls that failed; process-wide, shown with tracing on.
pub const TRACE_EXPORT_FAILURES: &str = "switchyard_trace_export_failures_total";
/// Gauge: 1 while the `shared_state` store is connected, 0 while the replica
/// runs on local state (only with `shared_state`).
pub const SHARED_STATE_UP: &str = "switchyard_shared_state_up";
/// Counter `{direction}`: shared facts `published` to the store, or
/// `applied` from another replica (health, cooldowns, keys).
pub const SHARED_STATE_UPDATES: &str = "switchyard_shared_state_updates_total";
/// Counter `{result}`: half-open trial leases asked for: `won` (this replica
/// tries the target), `lost` (another replica holds it).
pub const SHARED_STATE_LEASES: &str = "switchyard_shared_state_trial_leases_total";

/// Counter `{task, result}`: chat requests of a task with a `cache`, by what
/// the cache did: `hit`, `miss`, `stale` (served when no target answered) or
/// `bypass` (not looked up: a sampling request, or `Cache-Control: no-cache`).
pub const CACHE_REQUESTS: &str = "switchyard_cache_requests_total";
/// Gauge `{task}`: answers held in the task's cache (this process).
pub const CACHE_ENTRIES: &str = "switchyard_cache_entries";
/// Gauge `{task}`: bytes held in the task's cache, as its `max_bytes` counts them.
pub const CACHE_BYTES: &str = "switchyard_cache_bytes";
/// Counter `{task, kind}`: tokens cache hits did not spend (`prompt`, `completion`).
pub const CACHE_SAVED_TOKENS: &str = "switchyard_cache_saved_tokens_total";
/// Counter `{task}` (a float gauge, like the cost): USD cache hits did not spend.
pub const CACHE_SAVED_COST: &str = "switchyard_cache_saved_cost_usd_total";

/// Bucket bounds of every `_seconds` histogram.
const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// One gateway's metrics registry. Cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct Metrics {
    recorder: Arc<PrometheusRecorder>,
    handle: PrometheusHandle,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A new, empty registry with every metric described.
    #[must_use]
    pub fn new() -> Self {
        // Only fails for an empty bucket list, and the list is a constant.
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), SECONDS_BUCKETS)
            .unwrap_or_else(|_| PrometheusBuilder::new())
            .build_recorder();
        let handle = recorder.handle();
        let metrics = Self {
            recorder: Arc::new(recorder),
            handle,
        };
        metrics.describe();
        metrics
    }

    /// The Prometheus text exposition of every series.
    #[must_use]
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// [`Metrics::render`] without the gauges of tasks, targets and keys the
    /// loaded config no longer names (their handles outlive a reload).
    #[must_use]
    pub fn render_named(&self, named: &Named) -> String {
        retain_named(&self.handle.render(), named)
    }

    /// Drains histogram samples into their buckets. Without a scrape or this,
    /// the recorder keeps every sample: an unscraped sidecar would grow.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    fn key(name: &'static str, labels: &[(&'static str, SharedString)]) -> Key {
        Key::from_parts(
            name,
            labels
                .iter()
                .map(|(k, v)| Label::new(*k, v.clone()))
                .collect::<Vec<_>>(),
        )
    }

    /// The counter `name{labels}`. For rare events; hot paths hold handles.
    pub fn counter(&self, name: &'static str, labels: &[(&'static str, SharedString)]) -> Counter {
        self.recorder
            .register_counter(&Self::key(name, labels), &metadata())
    }

    /// The gauge `name{labels}`.
    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, SharedString)]) -> Gauge {
        self.recorder
            .register_gauge(&Self::key(name, labels), &metadata())
    }

    /// The histogram `name{labels}`.
    pub fn histogram(
        &self,
        name: &'static str,
        labels: &[(&'static str, SharedString)],
    ) -> Histogram {
        self.recorder
            .register_histogram(&Self::key(name, labels), &metadata())
    }

    /// A counter family `name{fixed.., varying=K}` resolved per value on first use.
    #[must_use]
    pub fn family<K: LabelValues>(
        &self,
        name: &'static str,
        fixed: &[(&'static str, SharedString)],
        varying: &'static [&'static str],
    ) -> Family<K> {
        Family {
            metrics: self.clone(),
            name,
            fixed: fixed.to_vec(),
            varying,
            cache: RwLock::new(Vec::new()),
        }
    }

    /// Handles for one target's own series.
    #[must_use]
    pub fn target(&self, name: &str) -> TargetMetrics {
        let label = [("target", SharedString::from(name.to_owned()))];
        TargetMetrics {
            attempts: self.family(UPSTREAM_ATTEMPTS, &label, &["outcome"]),
            interrupts: self.family(STREAM_INTERRUPTS, &label, &["reason"]),
            transitions: self.family(BREAKER_TRANSITIONS, &label, &["from", "to"]),
            probes: self.family(PROBES, &label, &["result"]),
            malformed: self.counter(STREAM_MALFORMED, &label),
            health: self.gauge(TARGET_HEALTH, &label),
            prompt_tokens: self.counter(
                TOKENS,
                &[label[0].clone(), ("kind", SharedString::from("prompt"))],
            ),
            completion_tokens: self.counter(
                TOKENS,
                &[label[0].clone(), ("kind", SharedString::from("completion"))],
            ),
        }
    }

    /// Handles for the series of `target` (or `none`) within `task`;
    /// `switchyard_contract_violations_total` only for a `chat` task (an
    /// embeddings task has no tool call contract: no series).
    #[must_use]
    pub fn route(&self, task: &str, target: &str, chat: bool) -> RouteMetrics {
        let labels = [
            ("task", SharedString::from(task.to_owned())),
            ("target", SharedString::from(target.to_owned())),
        ];
        RouteMetrics {
            requests: self.family(REQUESTS, &labels, &["status"]),
            duration: self.histogram(REQUEST_DURATION, &labels),
            ttft: self.histogram(TIME_TO_FIRST_TOKEN, &labels),
            cost: self.gauge(COST, &labels),
            violations: if chat {
                self.counter(CONTRACT_VIOLATIONS, &labels)
            } else {
                Counter::noop()
            },
            exclusions: self.family(SKIPPED, &labels, &["reason"]),
            repairs: self.family(CONTRACT_REPAIRS, &labels, &["method", "result"]),
        }
    }

    fn describe(&self) {
        let r = &*self.recorder;
        for &(kind, name, text) in DESCRIPTIONS {
            match kind {
                Kind::Counter => r.describe_counter(name.into(), None, text.into()),
                Kind::Seconds => {
                    r.describe_histogram(name.into(), Some(Unit::Seconds), text.into());
                }
                Kind::Gauge => r.describe_gauge(name.into(), None, text.into()),
                Kind::GaugeSeconds => {
                    r.describe_gauge(name.into(), Some(Unit::Seconds), text.into());
                }
            }
        }
    }
}

/// What each series is, for `# HELP` lines.
const DESCRIPTIONS: &[(Kind, &str, &str)] = &[
    (
        Kind::Counter,
        REQUESTS,
        "Requests answered, by task, serving target and final HTTP status.",
    ),
    (
        Kind::Counter,
        UPSTREAM_ATTEMPTS,
        "Upstream attempts by target and outcome.",
    ),
    (
        Kind::Counter,
        FAILOVERS,
        "Switches from one target to the next, by reason.",
    ),
    (
        Kind::Counter,
        SKIPPED,
        "Targets skipped without a network call, by reason.",
    ),
    (
        Kind::Counter,
        RATE_LIMITED,
        "Requests refused by a token bucket, by scope.",
    ),
    (
        Kind::Counter,
        TOKENS,
        "Tokens by target and kind, from reported usage.",
    ),
    (
        Kind::Counter,
        STREAM_INTERRUPTS,
        "Streams broken after the first content byte reached the client.",
    ),
    (Kind::Counter, HEDGES, "Hedged first attempts, by result."),
    (
        Kind::Counter,
        STREAM_CONTINUATIONS,
        "Broken streams continued on another target, by mode and result.",
    ),
    (
        Kind::Counter,
        STREAM_MALFORMED,
        "Malformed events dropped from committed streams.",
    ),
    (
        Kind::Counter,
        CONTRACT_VIOLATIONS,
        "Answers whose tool calls broke the request's contract.",
    ),
    (
        Kind::Gauge,
        QUEUE_DEPTH,
        "Requests of a batch task waiting for quota or a cooldown's end.",
    ),
    (
        Kind::Seconds,
        QUEUE_WAIT,
        "How long queued requests of a batch task waited.",
    ),
    (
        Kind::Counter,
        QUEUE_FULL,
        "Requests of a batch task answered 429 because its queue was full.",
    ),
    (
        Kind::Counter,
        CONTRACT_REPAIRS,
        "Repairs of answers that broke the contract, by method and result.",
    ),
    (
        Kind::Counter,
        CLIENT_CANCELLED,
        "Requests whose client hung up before the answer was complete.",
    ),
    (
        Kind::Counter,
        BREAKER_TRANSITIONS,
        "Health state changes per target.",
    ),
    (
        Kind::Counter,
        PROBES,
        "Active probes of DOWN targets by result.",
    ),
    (
        Kind::Counter,
        CONFIG_RELOADS,
        "Config loads and reloads by result.",
    ),
    (
        Kind::Counter,
        TRACE_SPANS_DROPPED,
        "Spans dropped because the trace export queue was full.",
    ),
    (
        Kind::Counter,
        TRACE_SPANS_EXPORTED,
        "Spans the trace collector accepted.",
    ),
    (
        Kind::Counter,
        TRACE_EXPORT_FAILURES,
        "Trace export calls that failed.",
    ),
    (
        Kind::Gauge,
        SHARED_STATE_UP,
        "1 while the shared-state store is connected, 0 while running on local state.",
    ),
    (
        Kind::Counter,
        SHARED_STATE_UPDATES,
        "Shared health facts published to the store or applied from other replicas.",
    ),
    (
        Kind::Counter,
        SHARED_STATE_LEASES,
        "Half-open trial leases asked for, won or lost to another replica.",
    ),
    (
        Kind::Counter,
        CACHE_REQUESTS,
        "Requests of a task with a cache, by what the cache did: hit, miss, stale or bypass.",
    ),
    (
        Kind::Gauge,
        CACHE_ENTRIES,
        "Answers held in the task's cache.",
    ),
    (
        Kind::Gauge,
        CACHE_BYTES,
        "Bytes held in the task's cache, as max_bytes counts them.",
    ),
    (
        Kind::Counter,
        CACHE_SAVED_TOKENS,
        "Tokens that cache hits did not spend, by kind.",
    ),
    (
        Kind::Gauge,
        CACHE_SAVED_COST,
        "USD that cache hits did not spend, from the stored answer's usage x cost.",
    ),
    (
        Kind::Seconds,
        REQUEST_DURATION,
        "Arrival to response head (streams: to the commit point).",
    ),
    (
        Kind::Seconds,
        TIME_TO_FIRST_TOKEN,
        "Arrival to the first content chunk of a stream.",
    ),
    (
        Kind::Gauge,
        TARGET_HEALTH,
        "Target health: 0 healthy, 1 degraded, 2 down.",
    ),
    (
        Kind::Gauge,
        KEY_STATE,
        "API key state: 0 usable, 1 cooling down, 2 revoked, 3 unreadable.",
    ),
    (
        Kind::Gauge,
        COST,
        "USD spent by task and target, from usage x cost.",
    ),
    (
        Kind::Gauge,
        TASK_TARGETS_AVAILABLE,
        "Targets of the task's chain that are available: not DOWN, and a key of its provider readable and not revoked (set at each scrape).",
    ),
    (
        Kind::Gauge,
        CONFIG_HASH,
        "Content hash of the loaded config (low 48 bits).",
    ),
    (
        Kind::GaugeSeconds,
        CONFIG_LOADED_AT,
        "Unix time the loaded config was applied.",
    ),
];

/// How a series is described.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Counter,
    Seconds,
    Gauge,
    GaugeSeconds,
}

fn metadata() -> Metadata<'static> {
    Metadata::new(module_path!(), metrics::Level::INFO, None)
}

/// What can stand in for the varying labels of a [`Family`].
pub trait LabelValues: Copy + Eq {
    /// The label values, in the family's `varying` order.
    fn values(self) -> Vec<SharedString>;
}

impl LabelValues for &'static str {
    fn values(self) -> Vec<SharedString> {
        vec![SharedString::const_str(self)]
    }
}

impl LabelValues for u16 {
    fn values(self) -> Vec<SharedString> {
        vec![SharedString::from(self.to_string())]
    }
}

impl LabelValues for (&'static str, &'static str) {
    fn values(self) -> Vec<SharedString> {
        vec![
            SharedString::const_str(self.0),
            SharedString::const_str(self.1),
        ]
    }
}

/// Counters that differ in a few labels with a small, fixed set of values
/// (an outcome, a reason, a status): each resolved once, then found by a
/// short scan under a read lock.
pub struct Family<K> {
    metrics: Metrics,
    name: &'static str,
    fixed: Vec<(&'static str, SharedString)>,
    varying: &'static [&'static str],
    cache: RwLock<Vec<(K, Counter)>>,
}

impl<K> std::fmt::Debug for Family<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family").field("name", &self.name).finish()
    }
}

impl<K: LabelValues> Family<K> {
    /// Adds `by` to the series for `key`.
    pub fn increment(&self, key: K, by: u64) {
        if let Some((_, c)) = self.cache.read().iter().find(|(k, _)| *k == key) {
            c.increment(by);
            return;
        }
        let mut cache = self.cache.write();
        if let Some((_, c)) = cache.iter().find(|(k, _)| *k == key) {
            c.increment(by);
            return;
        }
        let mut labels = self.fixed.clone();
        labels.extend(self.varying.iter().copied().zip(key.values()));
        let counter = self.metrics.counter(self.name, &labels);
        counter.increment(by);
        cache.push((key, counter));
    }
}

/// One target's own series (`{target}` plus fixed-valued labels).
#[derive(Debug)]
pub struct TargetMetrics {
    /// `switchyard_upstream_attempts_total{target, outcome}`.
    pub attempts: Family<&'static str>,
    /// `switchyard_stream_interrupts_total{target, reason}`.
    pub interrupts: Family<&'static str>,
    /// `switchyard_breaker_transitions_total{target, from, to}`.
    pub transitions: Family<(&'static str, &'static str)>,
    /// `switchyard_probes_total{target, result}`.
    pub probes: Family<&'static str>,
    /// `switchyard_stream_malformed_events_total{target}`.
    pub malformed: Counter,
    /// `switchyard_target_health{target}`.
    pub health: Gauge,
    /// `switchyard_tokens_total{target, kind="prompt"}`.
    pub prompt_tokens: Counter,
    /// `switchyard_tokens_total{target, kind="completion"}`.
    pub completion_tokens: Counter,
}

/// The series of one target (or `none`) within one task.
#[derive(Debug)]
pub struct RouteMetrics {
    /// `switchyard_requests_total{task, target, status}`.
    pub requests: Family<u16>,
    /// `switchyard_request_duration_seconds{task, target}`.
    pub duration: Histogram,
    /// `switchyard_time_to_first_token_seconds{task, target}`.
    pub ttft: Histogram,
    /// `switchyard_cost_usd_total{task, target}`.
    pub cost: Gauge,
    /// `switchyard_contract_violations_total{task, target}` (a no-op for an
    /// embeddings task).
    pub violations: Counter,
    /// `switchyard_route_exclusions_total{task, target, reason}`.
    pub exclusions: Family<&'static str>,
    /// `switchyard_contract_repairs_total{task, target, method, result}`
    /// (series appear with the first repair tried).
    pub repairs: Family<(&'static str, &'static str)>,
}

/// The status-class label of an HTTP status: `2xx`, `4xx`, `5xx`.
#[must_use]
pub fn status_class(status: u16) -> &'static str {
    match status / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// What the loaded config names: a per-task, per-target or per-key gauge of
/// anything else is left out of the page (a reload removed it; its last value
/// would keep an alert firing).
#[derive(Debug, Default)]
pub struct Named {
    /// Task names.
    pub tasks: std::collections::HashSet<String>,
    /// Target names (`none` is always named).
    pub targets: std::collections::HashSet<String>,
    /// `(provider, key)` names.
    pub keys: std::collections::HashSet<(String, String)>,
}

/// The gauges that describe the present state of a task, target or key.
const LIVE_GAUGES: &[&str] = &[
    TASK_TARGETS_AVAILABLE,
    TARGET_HEALTH,
    KEY_STATE,
    COST,
    QUEUE_DEPTH,
    CACHE_ENTRIES,
    CACHE_BYTES,
];

impl Named {
    fn keeps(&self, labels: &[(String, String)]) -> bool {
        let get = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let task = get("task").is_none_or(|t| self.tasks.contains(t));
        let target = get("target").is_none_or(|t| t == "none" || self.targets.contains(t));
        let key = match (get("provider"), get("key")) {
            (Some(p), Some(k)) => self.keys.contains(&(p.to_owned(), k.to_owned())),
            _ => true,
        };
        task && target && key
    }
}

/// The name and labels of one exposition line (`None` for comments and
/// lines that do not parse).
fn parse_series(line: &str) -> Option<(&str, Vec<(String, String)>)> {
    if line.starts_with('#') {
        return None;
    }
    let end = line.find(['{', ' '])?;
    let name = &line[..end];
    let mut labels = Vec::new();
    if line[end..].starts_with('{') {
        let mut chars = line[end + 1..].chars();
        loop {
            let mut key = String::new();
            for c in chars.by_ref() {
                match c {
                    '=' => break,
                    '}' => return Some((name, labels)),
                    ',' => {}
                    c => key.push(c),
                }
            }
            if chars.next()? != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()? {
                    '\\' => match chars.next()? {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    '"' => break,
                    c => value.push(c),
                }
            }
            labels.push((key, value));
        }
    }
    Some((name, labels))
}

/// `page` without the [`LIVE_GAUGES`] series of what `named` does not name.
fn retain_named(page: &str, named: &Named) -> String {
    let mut out = String::with_capacity(page.len());
    for line in page.split_inclusive('\n') {
        let stale = parse_series(line.trim_end())
            .is_some_and(|(name, labels)| LIVE_GAUGES.contains(&name) && !named.keeps(&labels));
        if !stale {
            out.push_str(line);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_registries_do_not_share_counts() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.target("t").attempts.increment("success", 3);
        assert!(a
            .render()
            .contains(r#"switchyard_upstream_attempts_total{target="t",outcome="success"} 3"#));
        assert!(!b.render().contains("switchyard_upstream_attempts_total{"));
    }

    #[test]
    fn a_family_resolves_each_value_once() {
        let m = Metrics::new();
        let f = m.family::<(&str, &str)>(BREAKER_TRANSITIONS, &[], &["from", "to"]);
        f.increment(("healthy", "down"), 1);
        f.increment(("healthy", "down"), 1);
        f.increment(("down", "healthy"), 1);
        assert_eq!(f.cache.read().len(), 2);
        let page = m.render();
        assert!(
            page.contains(r#"switchyard_breaker_transitions_total{from="healthy",to="down"} 2"#),
            "{page}"
        );
    }

    #[test]
    fn gauges_of_what_the_config_no_longer_names_are_left_out() {
        let m = Metrics::new();
        m.gauge(TASK_TARGETS_AVAILABLE, &[("task", "gone".into())])
            .set(0.0);
        m.gauge(TASK_TARGETS_AVAILABLE, &[("task", "kept".into())])
            .set(1.0);
        m.target("old").health.set(2.0);
        m.target("t\"x").health.set(1.0);
        m.gauge(KEY_STATE, &[("provider", "p".into()), ("key", "k1".into())])
            .set(2.0);
        m.gauge(KEY_STATE, &[("provider", "p".into()), ("key", "k2".into())])
            .set(0.0);
        m.target("old").attempts.increment("success", 1);
        let named = Named {
            tasks: ["kept".to_owned()].into(),
            targets: ["t\"x".to_owned()].into(),
            keys: [("p".to_owned(), "k2".to_owned())].into(),
        };
        let page = m.render_named(&named);
        assert!(
            page.contains(r#"switchyard_task_targets_available{task="kept"} 1"#),
            "{page}"
        );
        assert!(!page.contains(r#"task="gone""#), "{page}");
        assert!(
            !page.contains(r#"switchyard_target_health{target="old"}"#),
            "{page}"
        );
        assert!(
            page.contains(r#"switchyard_target_health{target="t\"x"} 1"#),
            "{page}"
        );
        assert!(!page.contains(r#"key="k1""#), "{page}");
        assert!(page.contains(r#"key="k2""#), "{page}");
        // Counters are totals: they stay.
        assert!(
            page.contains(r#"switchyard_upstream_attempts_total{target="old""#),
            "{page}"
        );
    }
}
