//! Metric names, their descriptions, and the Prometheus exporter.
//!
//! Label values come only from config names (task, target) and fixed enums
//! (outcome, reason, result), never from request contents, so cardinality is
//! bounded by the config. Every metric is documented in README.md.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Counter `{task, target, status}`: requests answered, by final status.
/// `target` is the serving target, or `none`.
pub const REQUESTS: &str = "switchyard_requests_total";
/// Histogram `{task, target}`: seconds from arrival to the response head (streams: to commit);
/// `target` is the serving target or `none`.
pub const REQUEST_DURATION: &str = "switchyard_request_duration_seconds";
/// Histogram `{task, target}`: seconds from arrival to the first content chunk of a stream.
pub const TIME_TO_FIRST_TOKEN: &str = "switchyard_time_to_first_token_seconds";
/// Counter `{target, outcome}`: upstream attempts by outcome (`success`, a status
/// class like `5xx`, a network kind, `stream_error`, `cancelled`).
pub const UPSTREAM_ATTEMPTS: &str = "switchyard_upstream_attempts_total";
/// Counter `{task, from, to, reason}`: switches from one target to the next.
pub const FAILOVERS: &str = "switchyard_failovers_total";
/// Counter `{task, target, reason}`: targets excluded or skipped without a call
/// (`capability`, `context_window`, `down`, `cooldown`, `provider_rate_limit`, `fallback_budget`).
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
/// Counter `{target}`: malformed events dropped from a committed stream.
pub const STREAM_MALFORMED: &str = "switchyard_stream_malformed_events_total";
/// Counter `{task, target}`: answers that broke the degraded-answer contract (tool calls).
pub const CONTRACT_VIOLATIONS: &str = "switchyard_contract_violations_total";
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

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process-wide Prometheus recorder once and returns its handle.
/// `None` if another recorder was installed first (e.g. by an embedding program).
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".to_owned()),
                    &[
                        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    ],
                )
                .ok()?
                .install_recorder()
                .ok()?;
            describe();
            Some(handle)
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        REQUESTS,
        "Requests answered, by task, serving target and final HTTP status."
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Arrival to response head (streams: to the commit point)."
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Arrival to the first content chunk of a stream."
    );
    describe_counter!(
        UPSTREAM_ATTEMPTS,
        "Upstream attempts by target and outcome."
    );
    describe_counter!(
        FAILOVERS,
        "Switches from one target to the next, by reason."
    );
    describe_counter!(
        SKIPPED,
        "Targets skipped without a network call, by reason."
    );
    describe_counter!(
        STREAM_INTERRUPTS,
        "Streams broken after the first content byte reached the client."
    );
    describe_counter!(
        STREAM_MALFORMED,
        "Malformed events dropped from committed streams."
    );
    describe_counter!(
        CLIENT_CANCELLED,
        "Requests whose client hung up before the answer was complete."
    );
    describe_gauge!(
        TARGET_HEALTH,
        "Target health: 0 healthy, 1 degraded, 2 down."
    );
    describe_counter!(BREAKER_TRANSITIONS, "Health state changes per target.");
    describe_counter!(PROBES, "Active probes of DOWN targets by result.");
    describe_counter!(CONFIG_RELOADS, "Config loads and reloads by result.");
    describe_gauge!(
        CONFIG_HASH,
        "Content hash of the loaded config (low 48 bits)."
    );
    describe_gauge!(
        CONFIG_LOADED_AT,
        Unit::Seconds,
        "Unix time the loaded config was applied."
    );
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
