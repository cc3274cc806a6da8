//! Verdicts: what an attempt's outcome means, decided apart from the code
//! that produced it.
//!
//! - [`ErrorTable::classify`]: a response head and body, or a network error,
//!   -> a [`Decision`] (retry / failover / return, whether health counts it,
//!   a cooldown). The table is data: a provider's own rules, then the file's
//!   top-level `error_classes`, then the built-in default table
//!   ([`default_rules`], documented in README.md). The first rule whose every
//!   test holds decides; a 2xx answer no rule claims is a success.
//! - [`end_of_stream`]: how a committed stream ended -> a [`StreamVerdict`]
//!   (linkerd2-proxy's `ClassifyEos` is the model: a 200 that dies half-way is
//!   a failure, decided when the stream ends).
//! - [`AttemptOutcome`]: the typed label every attempt is counted under.
//!
//! Health, metrics and the failover loop consume these; none of them decides
//! on its own what an outcome means.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, HeaderName, RETRY_AFTER};
use regex::Regex;

/// What went wrong below HTTP, as a kind (never a message string).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NetworkKind {
    /// TCP connect refused or unreachable.
    Connect,
    /// The connection was reset or closed mid-exchange.
    Reset,
    /// No response (headers, first token or next chunk) in time.
    Timeout,
    /// TLS handshake or certificate failure.
    Tls,
    /// Name resolution failed.
    Dns,
    /// The upstream spoke broken HTTP or broken SSE.
    Protocol,
}

impl NetworkKind {
    /// Every kind, for validation messages and the JSON Schema.
    pub const ALL: [NetworkKind; 6] = [
        NetworkKind::Connect,
        NetworkKind::Reset,
        NetworkKind::Timeout,
        NetworkKind::Tls,
        NetworkKind::Dns,
        NetworkKind::Protocol,
    ];

    /// The name used in `routes.yaml` and in metric labels.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkKind::Connect => "connect",
            NetworkKind::Reset => "reset",
            NetworkKind::Timeout => "timeout",
            NetworkKind::Tls => "tls",
            NetworkKind::Dns => "dns",
            NetworkKind::Protocol => "protocol",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// The outcome of one upstream attempt, as far as classification needs it.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    /// No usable HTTP response.
    Network(NetworkKind),
    /// An HTTP response (or an in-band stream error carrying a status-like code).
    Response {
        /// Status code (for an in-band error: its numeric code, else the HTTP status).
        status: u16,
        /// Response headers.
        headers: &'a HeaderMap,
        /// The body, or its first bytes.
        body: &'a [u8],
    },
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Try the same target again (up to the provider's `retry.max`), then fail over.
    Retry,
    /// Try the next candidate of the chain.
    Failover,
    /// Give this answer to the client as it is.
    Return,
}

impl Action {
    /// Every action, for parsing and the JSON Schema.
    pub const ALL: [Action; 3] = [Action::Retry, Action::Failover, Action::Return];

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Retry => "retry",
            Action::Failover => "failover",
            Action::Return => "return",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

/// How long to skip a target after a matching outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cooldown {
    /// A fixed time.
    Fixed(Duration),
    /// The upstream's `Retry-After` (seconds or HTTP-date), else the given default.
    RetryAfter(Duration),
}

/// A status test: one code or a class such as `5xx`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusPattern {
    /// Exactly this code.
    Code(u16),
    /// Any code in `n00..=n99`.
    Class(u16),
}

impl StatusPattern {
    fn matches(self, status: u16) -> bool {
        match self {
            StatusPattern::Code(c) => c == status,
            StatusPattern::Class(c) => status / 100 == c,
        }
    }

    /// Parses `503` or `5xx`.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        if let Some(class) = s.strip_suffix("xx").or_else(|| s.strip_suffix("XX")) {
            return class
                .parse::<u16>()
                .ok()
                .filter(|c| (1..=5).contains(c))
                .map(StatusPattern::Class);
        }
        s.parse::<u16>()
            .ok()
            .filter(|c| (100..=599).contains(c))
            .map(StatusPattern::Code)
    }
}

/// The tests of one rule; all given tests must hold.
#[derive(Debug, Clone, Default)]
pub struct Match {
    /// Any of these statuses (empty: any status, but only HTTP responses if other tests need them).
    pub status: Vec<StatusPattern>,
    /// Any of these network kinds.
    pub network: Vec<NetworkKind>,
    /// A regex over the body.
    pub body: Option<Regex>,
    /// A header, and optionally a regex over its value.
    pub header: Option<(HeaderName, Option<Regex>)>,
}

/// The largest body prefix a `body` regex looks at; error bodies are small and
/// scanning a long 200 answer on every request would cost more than it finds.
pub const BODY_SCAN_LIMIT: usize = 64 * 1024;

impl Match {
    fn matches(&self, outcome: &Outcome<'_>) -> bool {
        match *outcome {
            Outcome::Network(kind) => {
                !self.network.is_empty()
                    && self.network.contains(&kind)
                    && self.status.is_empty()
                    && self.body.is_none()
                    && self.header.is_none()
            }
            Outcome::Response {
                status,
                headers,
                body,
            } => {
                if !self.network.is_empty() {
                    return false;
                }
                if !self.status.is_empty() && !self.status.iter().any(|p| p.matches(status)) {
                    return false;
                }
                if let Some(re) = &self.body {
                    let scanned = &body[..body.len().min(BODY_SCAN_LIMIT)];
                    if !re.is_match(&String::from_utf8_lossy(scanned)) {
                        return false;
                    }
                }
                if let Some((name, re)) = &self.header {
                    let Some(value) = headers.get(name) else {
                        return false;
                    };
                    if let Some(re) = re {
                        if !value.to_str().is_ok_and(|v| re.is_match(v)) {
                            return false;
                        }
                    }
                }
                // A rule with no status test never turns a success into a failure
                // unless it tests the body or a header of that success.
                !(self.status.is_empty()
                    && self.body.is_none()
                    && self.header.is_none()
                    && (200..300).contains(&status))
            }
        }
    }
}

/// One row of the error-class table.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Where the rule comes from, for logs: `providers.a.error_classes[0]`,
    /// `error_classes[2]` or `default:5xx`.
    pub name: Arc<str>,
    /// The tests.
    pub matcher: Match,
    /// What to do.
    pub action: Action,
    /// Whether the outcome counts against the target's health.
    pub health: bool,
    /// How long to skip the target afterwards.
    pub cooldown: Option<Cooldown>,
    /// A context-window error: fail over only to a larger `max_context`.
    pub context_window: bool,
}

/// The decision for one failed attempt.
#[derive(Debug, Clone)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Whether it counts against the target's health.
    pub health: bool,
    /// Skip the target for this long.
    pub cooldown: Option<Duration>,
    /// Fail over only to a larger context window.
    pub context_window: bool,
    /// Name of the rule that decided (for the per-attempt log line).
    pub rule: Arc<str>,
}

impl Decision {
    /// The decision for a failure no rule claims: fail over, counted.
    fn unmatched(rule: &'static str) -> Self {
        Self {
            action: Action::Failover,
            health: true,
            cooldown: None,
            context_window: false,
            rule: Arc::from(rule),
        }
    }
}

/// A compiled table: provider rules, file rules, then the defaults.
#[derive(Debug, Clone, Default)]
pub struct ErrorTable {
    rules: Vec<Rule>,
}

impl ErrorTable {
    /// A table that tries `rules` in order.
    #[must_use]
    pub fn new(rules: Vec<Rule>) -> Self {
        Self { rules }
    }

    /// Classifies an outcome. `None` means success (a 2xx no rule claims).
    /// A non-2xx that no rule claims fails over and counts against health.
    #[must_use]
    pub fn classify(&self, outcome: &Outcome<'_>) -> Option<Decision> {
        if let Some(rule) = self.rules.iter().find(|r| r.matcher.matches(outcome)) {
            return Some(Decision {
                action: rule.action,
                health: rule.health,
                cooldown: rule.cooldown.map(|c| cooldown_for(c, outcome)),
                context_window: rule.context_window,
                rule: Arc::clone(&rule.name),
            });
        }
        match outcome {
            Outcome::Response { status, .. } if (200..300).contains(status) => None,
            Outcome::Response { .. } | Outcome::Network(_) => {
                Some(Decision::unmatched("default:unmatched"))
            }
        }
    }

    /// Classifies an outcome already known to be a failure (an in-band error
    /// event in a stream): one whose code reads as a success still fails over.
    #[must_use]
    pub fn classify_failure(&self, outcome: &Outcome<'_>) -> Decision {
        self.classify(outcome)
            .unwrap_or_else(|| Decision::unmatched("default:stream_error"))
    }
}

fn cooldown_for(c: Cooldown, outcome: &Outcome<'_>) -> Duration {
    match c {
        Cooldown::Fixed(d) => d,
        Cooldown::RetryAfter(default) => match outcome {
            Outcome::Response { headers, .. } => retry_after(headers).unwrap_or(default),
            Outcome::Network(_) => default,
        },
    }
}

/// Reads `Retry-After` as delta-seconds or an HTTP-date (RFC 9110 §10.2.3).
/// Dates in the past give zero; values are capped at one hour.
#[must_use]
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let d = if let Ok(secs) = text.parse::<u64>() {
        Duration::from_secs(secs)
    } else {
        let at = httpdate::parse_http_date(text).ok()?;
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
    };
    Some(d.min(Duration::from_secs(3600)))
}

/// Phrases providers use for "prompt longer than the context window"
/// (OpenAI `context_length_exceeded`, Anthropic "prompt is too long", vLLM, llama.cpp).
pub const CONTEXT_WINDOW_PATTERN: &str = r"(?i)context[_ ]length|context window|maximum context|prompt is too long|too many tokens|exceeds? the (model'?s? )?(max|context)";

/// The default error-class table (the design's, documented in README.md), as
/// rules tried after the file's own.
///
/// | outcome | action | health |
/// |---|---|---|
/// | timeout before response headers | failover | yes |
/// | connect / reset / DNS / TLS / protocol error | retry once, then failover | yes |
/// | 500, 502, 503, 504, 529 | retry once, then failover | yes |
/// | 429 | failover, cool down for `Retry-After` (default 1 s) | no |
/// | 401, 403, 404 | failover | yes |
/// | 400 saying the context is too long | failover to a larger context | no |
/// | 400, 413, 422 | return to client | no |
/// | other 4xx | return to client | no |
/// | other 5xx, anything else | failover | yes |
///
/// # Panics
/// Never: the one regex is a constant tested below.
#[must_use]
pub fn default_rules() -> Vec<Rule> {
    use NetworkKind::{Connect, Dns, Protocol, Reset, Timeout, Tls};
    use StatusPattern::{Class, Code};
    let rule =
        |name: &str, status: Vec<StatusPattern>, network: Vec<NetworkKind>, action, health| Rule {
            name: Arc::from(format!("default:{name}")),
            matcher: Match {
                status,
                network,
                ..Match::default()
            },
            action,
            health,
            cooldown: None,
            context_window: false,
        };
    #[allow(clippy::expect_used)]
    let context = Regex::new(CONTEXT_WINDOW_PATTERN).expect("constant regex compiles");
    vec![
        rule("timeout", vec![], vec![Timeout], Action::Failover, true),
        rule(
            "network",
            vec![],
            vec![Connect, Reset, Dns, Tls, Protocol],
            Action::Retry,
            true,
        ),
        rule(
            "5xx-transient",
            vec![Code(500), Code(502), Code(503), Code(504), Code(529)],
            vec![],
            Action::Retry,
            true,
        ),
        Rule {
            cooldown: Some(Cooldown::RetryAfter(Duration::from_secs(1))),
            ..rule("429", vec![Code(429)], vec![], Action::Failover, false)
        },
        rule(
            "auth",
            vec![Code(401), Code(403)],
            vec![],
            Action::Failover,
            true,
        ),
        rule("404", vec![Code(404)], vec![], Action::Failover, true),
        Rule {
            matcher: Match {
                status: vec![Code(400)],
                body: Some(context),
                ..Match::default()
            },
            context_window: true,
            ..rule("context-window", vec![], vec![], Action::Failover, false)
        },
        rule(
            "client-error",
            vec![Class(4)],
            vec![],
            Action::Return,
            false,
        ),
        rule("5xx", vec![Class(5)], vec![], Action::Failover, true),
    ]
}

/// For a 2xx JSON body that is really an error (`{"error": ...}` without
/// `choices`): `Some(code)` with its numeric code, if any.
#[must_use]
pub fn in_band_error(body: &[u8]) -> Option<Option<u16>> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
        choices: Option<serde::de::IgnoredAny>,
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    let probe: Probe<'_> = serde_json::from_slice(body).ok()?;
    match (probe.error, probe.choices) {
        (Some(e), None) if e.get() != "null" => Some(crate::sse::error_code(e.get())),
        _ => None,
    }
}

/// What one attempt came to, as counted in `switchyard_upstream_attempts_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// An answer was given (a non-streamed body, or a stream that finished).
    Success,
    /// An HTTP status the table classified as a failure.
    Status(u16),
    /// No usable response.
    Network(NetworkKind),
    /// A 2xx body that is really an error (`{"error": ...}` without `choices`).
    InBandError,
    /// An in-band error event before a stream's commit point.
    StreamError,
    /// A committed stream that broke.
    StreamInterrupted,
    /// A well-formed answer that broke the request's tool call contract.
    ContractViolation,
}

impl AttemptOutcome {
    /// The `outcome` label (also the `reason` of a failover).
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            AttemptOutcome::Success => "success",
            AttemptOutcome::Status(s) => crate::metrics::status_class(s),
            AttemptOutcome::Network(k) => k.as_str(),
            AttemptOutcome::InBandError => "in_band_error",
            AttemptOutcome::StreamError => "stream_error",
            AttemptOutcome::StreamInterrupted => "stream_interrupted",
            AttemptOutcome::ContractViolation => "contract_violation",
        }
    }
}

/// What the relay saw last of a committed stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// `data: [DONE]`.
    Done,
    /// The body ended; `finished` says whether a `finish_reason` was seen.
    Eof {
        /// A chunk carried a `finish_reason`.
        finished: bool,
    },
    /// The connection broke mid-body.
    BodyError,
    /// No chunk for the provider's `idle_timeout`.
    Idle,
    /// The task's `total_timeout` passed.
    Deadline,
    /// An in-band `{"error": ...}` event.
    InBandError,
    /// An event (or a line) over the size limit.
    EventTooLarge,
    /// Tool calls held for validation broke the contract.
    ContractViolation,
    /// The client hung up.
    ClientGone,
}

/// Why a committed stream counts as broken (the `reason` label of
/// `switchyard_stream_interrupts_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    /// The connection broke.
    Reset,
    /// EOF without `finish_reason` or `[DONE]`.
    Truncated,
    /// No chunk for `idle_timeout`.
    IdleTimeout,
    /// An in-band error event.
    UpstreamError,
    /// `total_timeout` passed.
    Deadline,
    /// An event over the size limit.
    EventTooLarge,
    /// The held tool calls broke the contract.
    ContractViolation,
}

impl Interruption {
    /// The `reason` label, also written in the error event the client gets.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Interruption::Reset => "reset",
            Interruption::Truncated => "truncated",
            Interruption::IdleTimeout => "idle_timeout",
            Interruption::UpstreamError => "upstream_error",
            Interruption::Deadline => "deadline",
            Interruption::EventTooLarge => "event_too_large",
            Interruption::ContractViolation => "contract_violation",
        }
    }
}

/// The end-of-stream verdict that health, metrics and the client's stream consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamVerdict {
    /// The answer is complete; `add_done` when the upstream ended cleanly
    /// without `[DONE]` (switchyard adds it at once).
    Complete {
        /// Send `data: [DONE]` on the upstream's behalf.
        add_done: bool,
    },
    /// Broken after the commit point: ends with an error event, counts
    /// against the target's health, never replayed.
    Interrupted(Interruption),
    /// The client left: no one's failure.
    ClientGone,
}

/// Classifies how a committed stream ended.
#[must_use]
pub fn end_of_stream(end: StreamEnd) -> StreamVerdict {
    match end {
        StreamEnd::Done => StreamVerdict::Complete { add_done: false },
        StreamEnd::Eof { finished: true } => StreamVerdict::Complete { add_done: true },
        StreamEnd::Eof { finished: false } => StreamVerdict::Interrupted(Interruption::Truncated),
        StreamEnd::BodyError => StreamVerdict::Interrupted(Interruption::Reset),
        StreamEnd::Idle => StreamVerdict::Interrupted(Interruption::IdleTimeout),
        StreamEnd::Deadline => StreamVerdict::Interrupted(Interruption::Deadline),
        StreamEnd::InBandError => StreamVerdict::Interrupted(Interruption::UpstreamError),
        StreamEnd::EventTooLarge => StreamVerdict::Interrupted(Interruption::EventTooLarge),
        StreamEnd::ContractViolation => StreamVerdict::Interrupted(Interruption::ContractViolation),
        StreamEnd::ClientGone => StreamVerdict::ClientGone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(table: &ErrorTable, code: u16, body: &str) -> Option<Decision> {
        let headers = HeaderMap::new();
        table.classify(&Outcome::Response {
            status: code,
            headers: &headers,
            body: body.as_bytes(),
        })
    }

    #[test]
    fn default_table_rows() {
        let t = ErrorTable::new(default_rules());
        let d = status(&t, 503, "").unwrap();
        assert_eq!((d.action, d.health), (Action::Retry, true));
        let d = status(&t, 429, "").unwrap();
        assert_eq!((d.action, d.health), (Action::Failover, false));
        assert_eq!(d.cooldown, Some(Duration::from_secs(1)));
        assert_eq!(status(&t, 401, "").unwrap().action, Action::Failover);
        assert_eq!(status(&t, 404, "").unwrap().action, Action::Failover);
        assert_eq!(status(&t, 400, "bad").unwrap().action, Action::Return);
        assert_eq!(status(&t, 422, "").unwrap().action, Action::Return);
        assert_eq!(status(&t, 413, "").unwrap().action, Action::Return);
        let d = status(&t, 400, r#"{"error":{"code":"context_length_exceeded"}}"#).unwrap();
        assert!(d.context_window);
        assert_eq!(d.action, Action::Failover);
        assert!(status(&t, 200, "{}").is_none());
        let d = t.classify(&Outcome::Network(NetworkKind::Timeout)).unwrap();
        assert_eq!(d.action, Action::Failover);
        let d = t.classify(&Outcome::Network(NetworkKind::Reset)).unwrap();
        assert_eq!(d.action, Action::Retry);
    }

    #[test]
    fn retry_after_both_forms() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        let later = SystemTime::now() + Duration::from_secs(30);
        h.insert(RETRY_AFTER, httpdate::fmt_http_date(later).parse().unwrap());
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(27) && d <= Duration::from_secs(30),
            "{d:?}"
        );
    }

    #[test]
    fn in_band_errors_are_recognised() {
        assert_eq!(
            in_band_error(br#"{"error":{"message":"quota","code":429}}"#),
            Some(Some(429))
        );
        assert_eq!(
            in_band_error(br#"{"error":{"message":"balance exhausted"}}"#),
            Some(None)
        );
        assert_eq!(in_band_error(br#"{"choices":[],"error":null}"#), None);
        assert_eq!(
            in_band_error(br#"{"choices":[{"message":{"content":"{\"error\":1}"}}]}"#),
            None
        );
        assert_eq!(in_band_error(b"[1,2]"), None);
    }

    #[test]
    fn end_of_stream_verdicts() {
        assert_eq!(
            end_of_stream(StreamEnd::Done),
            StreamVerdict::Complete { add_done: false }
        );
        assert_eq!(
            end_of_stream(StreamEnd::Eof { finished: true }),
            StreamVerdict::Complete { add_done: true }
        );
        assert_eq!(
            end_of_stream(StreamEnd::Eof { finished: false }),
            StreamVerdict::Interrupted(Interruption::Truncated)
        );
        assert_eq!(
            end_of_stream(StreamEnd::ClientGone),
            StreamVerdict::ClientGone
        );
        assert_eq!(Interruption::IdleTimeout.label(), "idle_timeout");
    }

    #[test]
    fn in_band_failures_always_fail_over() {
        let t = ErrorTable::new(default_rules());
        let headers = HeaderMap::new();
        let d = t.classify_failure(&Outcome::Response {
            status: 200,
            headers: &headers,
            body: b"",
        });
        assert_eq!(d.action, Action::Failover);
        assert_eq!(&*d.rule, "default:stream_error");
    }

    #[test]
    fn status_patterns_parse() {
        assert_eq!(StatusPattern::parse("5xx"), Some(StatusPattern::Class(5)));
        assert_eq!(StatusPattern::parse("429"), Some(StatusPattern::Code(429)));
        assert_eq!(StatusPattern::parse("9xx"), None);
        assert_eq!(StatusPattern::parse("700"), None);
    }
}
