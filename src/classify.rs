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
        /// The body, or its first bytes; `None` where body rules must not
        /// apply (a chat completion, a stream not read yet).
        body: Option<&'a [u8]>,
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
    /// The upstream's advertised wait ([`advertised_wait`]), else the given default.
    RetryAfter(Duration),
    /// Until the config is reloaded or the key's file rotated (a revoked key).
    UntilReload,
}

/// What a failure counts against and cools down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// The API key used (a 429 may be one key's limit; a 401 one revoked key).
    /// For a provider without keys, the target.
    Key,
    /// The model at the provider (5xx, timeouts, network errors).
    #[default]
    Target,
    /// Every target of the provider (an account-wide quota).
    Provider,
}

impl Scope {
    /// Every scope, by its `routes.yaml` name.
    pub const ALL: [Scope; 3] = [Scope::Key, Scope::Target, Scope::Provider];

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Key => "key",
            Scope::Target => "target",
            Scope::Provider => "provider",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
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
    /// A regex the body must not match (the default rules' own test).
    pub unless_body: Option<Regex>,
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
                    // No body to test: a completion (body rules never discard
                    // an answer), or a stream not read yet.
                    let Some(body) = body else { return false };
                    let scanned = &body[..body.len().min(BODY_SCAN_LIMIT)];
                    let text = String::from_utf8_lossy(scanned);
                    if !re.is_match(&text)
                        || self.unless_body.as_ref().is_some_and(|u| u.is_match(&text))
                    {
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
    /// A 429 advertising a wait at most this long is waited out and retried
    /// on the same target instead of failing over (`wait_retry_after`).
    pub wait_retry_after: Option<Duration>,
    /// What the failure counts against and cools down.
    pub scope: Scope,
    /// A key it revokes (`cooldown: until_reload`) stays revoked until a
    /// reload or a rotation, never re-probed (`revoke: until_rotation`).
    pub until_rotation: bool,
    /// The account is out of credit: a failure of the provider even when it
    /// says 429 (OpenAI's `insufficient_quota`), never a rate limit whose
    /// wait the caller could sit out.
    pub out_of_credit: bool,
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
    /// The outcome is a rate limit (a 429): its cooldown is a rate limit's.
    pub rate_limited: bool,
    /// Wait this long and retry the same target (a 429 whose advertised wait
    /// fits the rule's `wait_retry_after`).
    pub wait: Option<Duration>,
    /// What the failure counts against and cools down.
    pub scope: Scope,
    /// Unusable until a reload (`cooldown: until_reload`): a revoked key.
    pub until_reload: bool,
    /// Such a key is not re-probed (`revoke: until_rotation`).
    pub until_rotation: bool,
    /// The provider's account is out of credit (the rule's `out_of_credit`).
    pub out_of_credit: bool,
    /// Name of the rule that decided (for the per-attempt log line).
    pub rule: Arc<str>,
    /// The wait the answer's headers advertise (`Retry-After` and its
    /// kin), whatever the rule does with it: a returned answer keeps it.
    pub advertised: Option<Duration>,
}

impl Decision {
    /// The decision for a failure no rule claims: fail over, counted.
    fn unmatched(rule: &'static str) -> Self {
        Self {
            action: Action::Failover,
            health: true,
            cooldown: None,
            context_window: false,
            rate_limited: false,
            wait: None,
            scope: Scope::Target,
            until_reload: false,
            until_rotation: false,
            out_of_credit: false,
            rule: Arc::from(rule),
            advertised: None,
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
            let (status, advertised) = match outcome {
                Outcome::Response {
                    status, headers, ..
                } => (Some(*status), advertised_wait(headers)),
                Outcome::Network(_) => (None, None),
            };
            let rate_limited = status == Some(429) && !rule.out_of_credit;
            return Some(Decision {
                action: rule.action,
                health: rule.health,
                cooldown: rule.cooldown.and_then(|c| cooldown_for(c, advertised)),
                scope: rule.scope,
                until_reload: rule.cooldown == Some(Cooldown::UntilReload),
                until_rotation: rule.until_rotation,
                out_of_credit: rule.out_of_credit,
                context_window: rule.context_window,
                rate_limited,
                wait: rule
                    .wait_retry_after
                    .zip(advertised)
                    .filter(|(limit, wait)| rate_limited && wait <= limit)
                    .map(|(_, wait)| wait),
                rule: Arc::clone(&rule.name),
                advertised,
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

fn cooldown_for(c: Cooldown, advertised: Option<Duration>) -> Option<Duration> {
    match c {
        Cooldown::Fixed(d) => Some(d),
        Cooldown::RetryAfter(default) => Some(advertised.unwrap_or(default)),
        Cooldown::UntilReload => None,
    }
}

/// Longest advertised wait honoured.
const MAX_ADVERTISED_WAIT: Duration = Duration::from_secs(3600);

/// The wait an upstream advertises, the longest of every form that applies:
/// `Retry-After` (seconds or an HTTP-date, RFC 9110 §10.2.3), `retry-after-ms`,
/// OpenAI's `x-ratelimit-reset-{requests,tokens}` (durations such as `1s`,
/// `6m0s`, `20ms`) when the matching `x-ratelimit-remaining-*` is 0, and
/// Anthropic's `anthropic-ratelimit-*-reset` (RFC 3339) when the matching
/// `-remaining` is 0 or absent. Times in the past give zero; capped at one hour.
#[must_use]
pub fn advertised_wait(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let exhausted = |name: &str| text(name).is_some_and(|v| v == "0");
    let mut waits = vec![
        text(RETRY_AFTER.as_str()).and_then(retry_after_value),
        text("retry-after-ms")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .map(|ms| Duration::from_secs_f64(ms.min(1e9) / 1000.0)),
    ];
    for kind in ["requests", "tokens"] {
        if exhausted(&format!("x-ratelimit-remaining-{kind}")) {
            waits.push(text(&format!("x-ratelimit-reset-{kind}")).and_then(go_duration));
        }
    }
    for kind in ["requests", "tokens", "input-tokens", "output-tokens"] {
        let remaining = text(&format!("anthropic-ratelimit-{kind}-remaining"));
        if remaining.is_none_or(|r| r == "0") {
            waits.push(
                text(&format!("anthropic-ratelimit-{kind}-reset"))
                    .and_then(|t| humantime::parse_rfc3339(t).ok())
                    .map(until),
            );
        }
    }
    waits
        .into_iter()
        .flatten()
        .max()
        .map(|d| d.min(MAX_ADVERTISED_WAIT))
}

/// `Retry-After`: delta-seconds (a fraction tolerated) or an HTTP-date.
fn retry_after_value(text: &str) -> Option<Duration> {
    if let Ok(secs) = text.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(1e9)));
    }
    httpdate::parse_http_date(text).ok().map(until)
}

/// Time from now until `at` (zero if it has passed).
fn until(at: SystemTime) -> Duration {
    at.duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

/// A Go `time.Duration` string as OpenAI sends it: `1s`, `6m0s`, `20ms`, `1h2m3.5s`.
fn go_duration(text: &str) -> Option<Duration> {
    let mut total = 0.0f64;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let value: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    total
        .is_finite()
        .then(|| Duration::from_secs_f64(total.min(1e9)))
}

/// How providers say "the prompt is longer than the context window": OpenAI
/// (`context_length_exceeded`, "maximum context length is"), Anthropic
/// ("prompt is too long", "exceed context limit"), vLLM and sglang ("maximum
/// context length", "longer than the model's context length"), Gemini ("input
/// token count ... exceeds the maximum number of tokens"), llama.cpp
/// ("exceeds the available context size"), Mistral ("too large for model
/// with ... maximum context length"), Bedrock ("input is too long"), GitHub
/// Copilot ("prompt token count of ... exceeds the limit",
/// `model_max_prompt_tokens_exceeded`), Hugging Face TGI ("`inputs` tokens +
/// `max_new_tokens` must be <= 4096", with a 422). Every protocol adapter and
/// the default table use this one list.
pub const CONTEXT_LENGTH_PHRASES: &[&str] = &[
    r"context[_ ]length",
    r"context window",
    r"maximum context",
    r"context size",
    r"context limit",
    r"prompt is too long",
    r"input is too long",
    r"too many tokens",
    r"exceeds? the (model'?s? )?(max|context)",
    r"exceeds the maximum number of tokens",
    r"input token count.{0,40}exceeds",
    r"longer than the model'?s? context",
    r"reduce the length of the messages",
    r"prompt token count.{0,40}exceeds",
    r"max_prompt_tokens",
    r"inputs.{0,2} tokens \+ .{0,2}max_new_tokens",
];

/// The phrases as one case-insensitive regex.
fn context_length_regex() -> &'static Regex {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| {
        let pattern = format!("(?i){}", CONTEXT_LENGTH_PHRASES.join("|"));
        #[allow(clippy::expect_used)] // a constant list, compiled by a unit test
        Regex::new(&pattern).expect("the context-length phrases compile")
    })
}

/// Whether an error text says the prompt is longer than the context window.
#[must_use]
pub fn is_context_length(text: &str) -> bool {
    context_length_regex().is_match(text)
}

/// How providers say "the account is out of credit or quota": OpenAI
/// (`insufficient_quota`, "exceeded your current quota"), DeepSeek and
/// others ("insufficient balance"), Anthropic ("credit balance is too low"),
/// OpenRouter ("insufficient credits"), and a plain "payment required".
pub const OUT_OF_CREDIT_PHRASES: &[&str] = &[
    r"insufficient[_ ]quota",
    r"insufficient[_ ](account[_ ])?balance",
    r"insufficient[_ ]credits?",
    r"credit balance is too low",
    // OpenAI's "You exceeded your current quota", Moonshot's
    // `exceeded_current_quota_error`; not a bare "quota exceeded", which
    // Google's APIs say of a per-minute rate limit.
    r"exceeded[_ ](your[_ ])?current[_ ]quota",
    r"payment[_ ]required",
];

/// What a rate limit says and an empty account does not: Google's APIs word
/// a per-minute limit as OpenAI words an empty account ("You exceeded your
/// current quota"), but with their status and the wait (`RetryInfo`).
fn rate_limit_regex() -> &'static Regex {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| {
        #[allow(clippy::expect_used)] // a constant, compiled by a unit test
        Regex::new(r#"RESOURCE_EXHAUSTED|retryDelay|"code":"rate_limit_exceeded""#)
            .expect("the rate-limit words compile")
    })
}

/// How long the default rules hold back a provider that is out of credit.
pub const OUT_OF_CREDIT_COOLDOWN: Duration = Duration::from_secs(600);

/// The out-of-credit phrases as one case-insensitive regex.
fn out_of_credit_regex() -> &'static Regex {
    static RE: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    RE.get_or_init(|| {
        let pattern = format!("(?i){}", OUT_OF_CREDIT_PHRASES.join("|"));
        #[allow(clippy::expect_used)] // a constant list, compiled by a unit test
        Regex::new(&pattern).expect("the out-of-credit phrases compile")
    })
}

/// The default error-class table, as rules tried after the file's own (its
/// one description is README.md's "The error-class table").
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
            wait_retry_after: None,
            until_rotation: false,
            out_of_credit: false,
            scope: Scope::Target,
        };
    vec![
        rule("timeout", vec![], vec![Timeout], Action::Failover, true),
        rule(
            "network",
            vec![],
            vec![Connect, Reset, Dns, Tls, Protocol],
            Action::Retry,
            true,
        ),
        // An account out of credit is the provider's problem, not the
        // caller's: every target of it is held back, the chain moves on.
        // Before the transient 5xx: a 502 that says so is no passing blip.
        Rule {
            cooldown: Some(Cooldown::Fixed(OUT_OF_CREDIT_COOLDOWN)),
            scope: Scope::Provider,
            out_of_credit: true,
            ..rule("402", vec![Code(402)], vec![], Action::Failover, false)
        },
        Rule {
            matcher: Match {
                status: vec![Class(4), Class(5)],
                body: Some(out_of_credit_regex().clone()),
                unless_body: Some(rate_limit_regex().clone()),
                ..Match::default()
            },
            cooldown: Some(Cooldown::Fixed(OUT_OF_CREDIT_COOLDOWN)),
            scope: Scope::Provider,
            out_of_credit: true,
            ..rule("out-of-credit", vec![], vec![], Action::Failover, false)
        },
        rule(
            "5xx-transient",
            vec![Code(500), Code(502), Code(503), Code(504), Code(529)],
            vec![],
            Action::Retry,
            true,
        ),
        Rule {
            cooldown: Some(Cooldown::RetryAfter(Duration::from_secs(1))),
            scope: Scope::Key,
            ..rule("429", vec![Code(429)], vec![], Action::Failover, false)
        },
        Rule {
            cooldown: Some(Cooldown::UntilReload),
            scope: Scope::Key,
            ..rule(
                "auth",
                vec![Code(401), Code(403)],
                vec![],
                Action::Failover,
                true,
            )
        },
        // The upstream gave up waiting for switchyard's request: nothing the
        // caller can change, so it is transient like a reset, not a 4xx to return.
        rule("408", vec![Code(408)], vec![], Action::Retry, true),
        rule("404", vec![Code(404)], vec![], Action::Failover, true),
        Rule {
            matcher: Match {
                status: vec![Code(400), Code(413), Code(422)],
                body: Some(context_length_regex().clone()),
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

/// The wait an in-band error advertises in its own `error.retry_after`
/// (seconds; a translation puts it there from the provider's own form, as
/// Google's `RetryInfo`), capped at an hour.
#[must_use]
pub fn in_band_wait(error: &[u8]) -> Option<Duration> {
    // Most in-band errors name no wait: a byte scan before any parse.
    memchr::memmem::find(error, b"\"retry_after\"")?;
    let v: serde_json::Value = serde_json::from_slice(error).ok()?;
    let secs = v.get("error")?.get("retry_after")?.as_u64()?;
    Some(Duration::from_secs(secs).min(MAX_ADVERTISED_WAIT))
}

/// The status an in-band error (a 2xx body or a stream event carrying
/// `{"error": ...}`) is classified as: its own numeric code, else 400 when it
/// says the context is too long, else 502.
#[must_use]
pub fn in_band_status(code: Option<u16>, error_text: &[u8]) -> u16 {
    code.unwrap_or_else(|| {
        if is_context_length(&String::from_utf8_lossy(error_text)) {
            400
        } else {
            502
        }
    })
}

/// What a 2xx non-streamed body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerShape {
    /// An answer: a chat completion (a JSON object with a non-empty
    /// `choices` array), or embeddings (a non-empty `data` array).
    Completion,
    /// `{"error": ...}` (as JSON, or as an SSE error event) with its numeric code, if any.
    InBandError(Option<u16>),
    /// Anything else: JSON without `choices`, HTML, an empty body, a stream.
    NotACompletion,
}

/// How many entries an array has, counted without keeping them; each
/// must be a choice. And whether a choice's server cut it short
/// ([`crate::sse::is_resource_cut`]).
struct Entries(usize, bool);
impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Count;
        impl<'de> serde::de::Visitor<'de> for Count {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Entries, A::Error> {
                let (mut n, mut cut) = (0, false);
                while let Some(Choice { cut: this }) = seq.next_element::<Choice>()? {
                    n += 1;
                    cut |= this;
                }
                Ok(Entries(n, cut))
            }
        }
        d.deserialize_seq(Count)
    }
}
/// A choice: an object whose `message` is an object (its fields unread),
/// and whether its `finish_reason` says its server cut it short.
struct Choice {
    cut: bool,
}
impl<'de> serde::Deserialize<'de> for Choice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Choice;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a choice with a message object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Choice, A::Error> {
                let (mut message, mut cut) = (false, false);
                while let Some(key) = map.next_key::<ChoiceKey>()? {
                    match key {
                        ChoiceKey::Message => {
                            map.next_value::<ObjectOnly>()?;
                            message = true;
                        }
                        ChoiceKey::FinishReason => {
                            let raw = map.next_value::<&'de serde_json::value::RawValue>()?;
                            cut = crate::sse::is_resource_cut(raw.get());
                        }
                        ChoiceKey::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                if message {
                    Ok(Choice { cut })
                } else {
                    Err(serde::de::Error::missing_field("message"))
                }
            }
        }
        d.deserialize_map(Fields)
    }
}
/// A choice's key, of those read (read without a copy).
enum ChoiceKey {
    Message,
    FinishReason,
    Other,
}
impl<'de> serde::Deserialize<'de> for ChoiceKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = ChoiceKey;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<ChoiceKey, E> {
                Ok(match key {
                    "message" => ChoiceKey::Message,
                    "finish_reason" => ChoiceKey::FinishReason,
                    _ => ChoiceKey::Other,
                })
            }
        }
        d.deserialize_identifier(Name)
    }
}

/// Any JSON object, skipped; anything else is an error.
struct ObjectOnly;
impl<'de> serde::Deserialize<'de> for ObjectOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Skip;
        impl<'de> serde::de::Visitor<'de> for Skip {
            type Value = ObjectOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ObjectOnly, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(ObjectOnly)
            }
        }
        d.deserialize_map(Skip)
    }
}

/// Reads a 2xx non-streamed body: only a chat completion is an answer.
#[must_use]
pub fn answer_shape(body: &[u8]) -> AnswerShape {
    read_answer(body).shape
}

/// A 2xx chat body read once: its [`AnswerShape`], and what the books need
/// of it, raw (`sse::usage_of` reads the usage).
#[derive(Debug, Clone, Copy)]
pub struct AnswerRead<'a> {
    pub shape: AnswerShape,
    /// `model`.
    pub model: Option<&'a serde_json::value::RawValue>,
    /// `usage`.
    pub usage: Option<&'a serde_json::value::RawValue>,
}

/// Reads a 2xx chat body as [`answer_shape`] describes, in the same pass
/// keeping its `model` and `usage`.
#[must_use]
pub fn read_answer(body: &[u8]) -> AnswerRead<'_> {
    use serde_json::value::RawValue;
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        error: Option<&'a RawValue>,
        #[serde(default)]
        choices: Option<Entries>,
        #[serde(borrow, default)]
        model: Option<&'a RawValue>,
        #[serde(borrow, default)]
        usage: Option<&'a RawValue>,
    }
    let shape_only = |shape| AnswerRead {
        shape,
        model: None,
        usage: None,
    };
    // Skipped strings are not checked by the JSON reader: a body that is not
    // UTF-8 is no answer to relay (the check runs at memory speed).
    if std::str::from_utf8(body).is_err() {
        return shape_only(AnswerShape::NotACompletion);
    }
    let text = body.trim_ascii_start();
    if text.starts_with(b"data:") || text.starts_with(b"event:") {
        // A stream sent to a non-streaming request: an error event is an
        // in-band error; anything else is not an answer to this request.
        return shape_only(
            crate::sse::first_error_code(text)
                .map_or(AnswerShape::NotACompletion, AnswerShape::InBandError),
        );
    }
    let Ok(probe) = serde_json::from_slice::<Probe<'_>>(text) else {
        return shape_only(AnswerShape::NotACompletion);
    };
    let shape = match probe {
        // An answer its server cut short is no answer: a 503, as it says.
        Probe {
            choices: Some(Entries(_, true)),
            ..
        } => AnswerShape::InBandError(Some(503)),
        Probe {
            choices: Some(Entries(n, false)),
            ..
        } if n > 0 => AnswerShape::Completion,
        Probe { error: Some(e), .. } if e.get() != "null" => {
            AnswerShape::InBandError(crate::sse::error_code(e.get()))
        }
        Probe { .. } => AnswerShape::NotACompletion,
    };
    AnswerRead {
        shape,
        model: probe.model,
        usage: probe.usage,
    }
}

/// Reads a 2xx embeddings body: only a JSON object with a non-empty `data`
/// array is an answer (an in-band error reads as one, as for completions).
#[must_use]
pub fn embeddings_shape(body: &[u8]) -> AnswerShape {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        error: Option<&'a serde_json::value::RawValue>,
        #[serde(default)]
        data: Option<Vec<serde::de::IgnoredAny>>,
    }
    match serde_json::from_slice::<Probe<'_>>(body.trim_ascii_start()) {
        Ok(Probe { data: Some(d), .. }) if !d.is_empty() => AnswerShape::Completion,
        Ok(Probe { error: Some(e), .. }) if e.get() != "null" => {
            AnswerShape::InBandError(crate::sse::error_code(e.get()))
        }
        Ok(_) | Err(_) => AnswerShape::NotACompletion,
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
    /// A 2xx body that is not a chat completion (no `choices`, HTML, empty).
    InvalidAnswer,
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
            AttemptOutcome::InvalidAnswer => "invalid_answer",
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
    /// A restarted continuation contradicted the text already delivered.
    Diverged,
    /// The client hung up.
    ClientGone,
    /// switchyard's own `drain_timeout` passed while the stream ran.
    Drain,
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
    /// A restarted continuation contradicted the text already delivered.
    Diverged,
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
            Interruption::Diverged => "diverged",
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
    /// Cut at switchyard's drain timeout: no one's failure either, but the
    /// client gets an error event (its answer is incomplete).
    Drained,
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
        StreamEnd::Diverged => StreamVerdict::Interrupted(Interruption::Diverged),
        StreamEnd::ClientGone => StreamVerdict::ClientGone,
        StreamEnd::Drain => StreamVerdict::Drained,
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
            body: Some(body.as_bytes()),
        })
    }

    #[test]
    fn googles_per_minute_limit_is_a_rate_limit_though_worded_as_an_empty_account() {
        let t = ErrorTable::new(default_rules());
        let openai = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        let d = status(&t, 429, openai).unwrap();
        assert!(d.out_of_credit && !d.rate_limited, "{d:?}");
        let gemini = r#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message":"You exceeded your current quota, please check your plan and billing details.","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"40s"}]}}"#;
        let d = status(&t, 429, gemini).unwrap();
        assert!(!d.out_of_credit && d.rate_limited, "{d:?}");
        assert_eq!(d.scope, Scope::Key);
        // The same limit as the Gemini adapter translates it.
        let translated = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"rate_limit_error","code":"rate_limit_exceeded","param":null}}"#;
        let d = status(&t, 429, translated).unwrap();
        assert!(!d.out_of_credit && d.rate_limited, "{d:?}");
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
        let d = status(&t, 408, "").unwrap();
        assert_eq!((d.action, d.health), (Action::Retry, true));
        assert_eq!(status(&t, 409, "").unwrap().action, Action::Return);
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
        assert_eq!(advertised_wait(&h), Some(Duration::from_secs(7)));
        let later = SystemTime::now() + Duration::from_secs(30);
        h.insert(RETRY_AFTER, httpdate::fmt_http_date(later).parse().unwrap());
        let d = advertised_wait(&h).unwrap();
        assert!(
            d > Duration::from_secs(27) && d <= Duration::from_secs(30),
            "{d:?}"
        );
    }

    #[test]
    fn choices_must_be_choices_and_the_body_utf8() {
        use AnswerShape::{Completion, NotACompletion};
        for body in [
            &br#"{"choices":[1]}"#[..],
            br#"{"choices":[{"message":null}]}"#,
            br#"{"choices":[{"index":0}]}"#,
            br#"{"choices":[{"message":"hi"}]}"#,
            br#"{"choices":[{"message":{"content":"ok"}},2]}"#,
            b"{\"choices\":[{\"message\":{\"content\":\"\xff\xfe\"}}]}",
        ] {
            assert_eq!(
                answer_shape(body),
                NotACompletion,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            answer_shape(
                br#"{"choices":[{"index":0,"message":{"role":"assistant","tool_calls":[]},"finish_reason":"tool_calls"}]}"#
            ),
            Completion
        );
    }

    #[test]
    fn one_read_of_an_answer_keeps_its_model_and_usage_and_odd_ones_spoil_nothing() {
        let read = read_answer(
            br#"{"model":"gpt-4o","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":8}}"#,
        );
        assert_eq!(read.shape, AnswerShape::Completion);
        assert_eq!(read.model.map(|m| m.get()), Some(r#""gpt-4o""#));
        assert_eq!(read.usage.and_then(crate::sse::usage_of), Some((5, 8)));
        // Odd types in the books' fields leave the answer an answer, unbooked.
        let odd =
            read_answer(br#"{"model":7,"choices":[{"message":{}}],"usage":{"prompt_tokens":"5"}}"#);
        assert_eq!(odd.shape, AnswerShape::Completion);
        assert_eq!(odd.usage.and_then(crate::sse::usage_of), None);
        let null = read_answer(br#"{"choices":[{"message":{}}],"usage":null}"#);
        assert_eq!(null.usage.and_then(crate::sse::usage_of), None);
        assert!(read_answer(b"data: {}\n\n").model.is_none());
    }

    #[test]
    fn only_a_completion_is_an_answer() {
        use AnswerShape::{Completion, InBandError, NotACompletion};
        assert_eq!(
            answer_shape(br#"{"error":{"message":"quota","code":429}}"#),
            InBandError(Some(429))
        );
        assert_eq!(
            answer_shape(br#"{"error":{"message":"balance exhausted"}}"#),
            InBandError(None)
        );
        assert_eq!(
            answer_shape(br#"{"choices":[{"message":{"content":"{\"error\":1}"}}]}"#),
            Completion
        );
        assert_eq!(
            answer_shape(br#"{"choices":[],"error":null}"#),
            NotACompletion
        );
        assert_eq!(
            answer_shape(br#"{"code":1008,"msg":"Insufficient balance"}"#),
            NotACompletion
        );
        assert_eq!(
            answer_shape(b"<html>502 Bad Gateway</html>"),
            NotACompletion
        );
        assert_eq!(answer_shape(b""), NotACompletion);
        assert_eq!(answer_shape(b"[1,2]"), NotACompletion);
        assert_eq!(
            answer_shape(b"data: {\"error\":{\"message\":\"overloaded\",\"code\":529}}\n\n"),
            InBandError(Some(529))
        );
        assert_eq!(
            answer_shape(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"),
            NotACompletion
        );
    }

    #[test]
    fn every_form_of_advertised_wait_and_the_longest_wins() {
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            h
        };
        let secs = |h: &HeaderMap| advertised_wait(h).map(|d| d.as_millis());
        assert_eq!(secs(&headers(&[("retry-after", "7")])), Some(7000));
        assert_eq!(secs(&headers(&[("retry-after-ms", "250")])), Some(250));
        assert_eq!(
            secs(&headers(&[
                ("retry-after", "1"),
                ("retry-after-ms", "2500")
            ])),
            Some(2500)
        );
        // OpenAI's resets count only when the matching remaining count is 0.
        let openai = [
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-remaining-tokens", "12"),
            ("x-ratelimit-reset-tokens", "59m"),
        ];
        assert_eq!(secs(&headers(&openai)), Some(360_000));
        assert_eq!(
            secs(&headers(&[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "20ms")
            ])),
            Some(20)
        );
        let later = SystemTime::now() + Duration::from_secs(30);
        let rfc3339 = humantime::format_rfc3339(later).to_string();
        let d = advertised_wait(&headers(&[
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", &rfc3339),
        ]))
        .unwrap();
        assert!(
            d > Duration::from_secs(28) && d <= Duration::from_secs(30),
            "{d:?}"
        );
        assert_eq!(secs(&headers(&[("retry-after", "99999")])), Some(3_600_000));
        assert_eq!(secs(&headers(&[("retry-after", "soon")])), None);
        assert_eq!(
            go_duration("1h2m3.5s"),
            Some(Duration::from_secs_f64(3723.5))
        );
        assert_eq!(go_duration("3x"), None);
    }

    #[test]
    fn an_in_band_error_may_advertise_its_wait() {
        let wait = |text: &str| in_band_wait(text.as_bytes());
        assert_eq!(
            wait(r#"{"error":{"message":"quota","status":429,"retry_after":7}}"#),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            wait(r#"{"error":{"retry_after":99999999}}"#),
            Some(MAX_ADVERTISED_WAIT)
        );
        assert_eq!(
            wait(r#"{"error":{"message":"no wait","status":429}}"#),
            None
        );
        assert_eq!(wait(r#"{"error":{"retry_after":"soon"}}"#), None);
    }

    #[test]
    fn context_length_in_every_phrasing() {
        for text in [
            r#"{"error":{"code":"context_length_exceeded"}}"#,
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "prompt is too long: 210000 tokens > 200000 maximum",
            "input length and `max_tokens` exceed context limit: 187000 + 20000 > 200000",
            "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
            "The input token count (1234567) exceeds the maximum number of tokens allowed (1048576).",
            "the request exceeds the available context size, try increasing it",
            "Prompt contains 40000 tokens, too large for model with 32768 maximum context length",
            "Input is too long for requested model.",
            "prompt token count of 125516 exceeds the limit of 64000",
            r#"{"error":{"code":"model_max_prompt_tokens_exceeded"}}"#,
            "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
        ] {
            assert!(is_context_length(text), "{text}");
        }
        assert!(!is_context_length(
            "Invalid value for 'temperature': must be at most 2"
        ));
        let t = ErrorTable::new(default_rules());
        for code in [400, 413, 422] {
            let d = status(&t, code, "prompt is too long").unwrap();
            assert!(d.context_window, "{code}");
        }
        assert_eq!(in_band_status(None, b"maximum context length is 4096"), 400);
        assert_eq!(in_band_status(None, b"overloaded"), 502);
        assert_eq!(in_band_status(Some(429), b"maximum context length"), 429);
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
            body: Some(b""),
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
