//! Raw `routes.yaml` types, exactly as written, and parsing them with locations.
//!
//! This is the first of the two configuration phases: serde structs with
//! `deny_unknown_fields` that accept any well-formed file. Values that need a
//! semantic check (durations, URLs, regexes, references between sections) stay
//! strings here; [`crate::snapshot::compile`] turns them into typed, resolved
//! values and reports every problem at once through [`validate`]'s checkers.
//!
//! The JSON Schema ([`json_schema`]) is derived from these types; the
//! `#[schemars]` attributes and `schema_parts` make it say what validate says
//! where JSON Schema can (names, minimums, shapes of durations and URLs).

pub mod diagnostic;
pub mod locate;
mod schema_parts;
mod sweep;
mod syntax;
pub mod validate;

use std::collections::BTreeMap;
use std::path::Path;

use schemars::JsonSchema;
use serde::Deserialize;

use diagnostic::Diagnostic;
use locate::LocationIndex;
pub use sweep::Removed;

/// The whole file, version 1. Every key is documented in README.md.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Format version; must be `1`. Required.
    #[schemars(required, extend("const" = 1))]
    pub version: Option<u64>,
    /// Address the gateway listens on, `IP:PORT` (default `127.0.0.1:8080`;
    /// read at start; `--listen` overrides).
    #[schemars(regex(pattern = schema_parts::SOCKET_ADDR))]
    pub listen: Option<String>,
    /// Separate `IP:PORT` for `/admin/*` (plus `/healthz`, `/readyz`,
    /// `/metrics`); read at start; `--admin-listen` overrides.
    #[schemars(regex(pattern = schema_parts::SOCKET_ADDR))]
    pub admin_listen: Option<String>,
    /// Environment variable holding a token that `/admin/*` then requires
    /// (`Authorization: Bearer`); unset, the file is refused.
    pub admin_token_env: Option<String>,
    /// File holding that token instead; unreadable or empty, the file is refused.
    pub admin_token_file: Option<String>,
    /// Most chat requests in progress at once; more get 503 (default 1024; read at start).
    #[schemars(range(min = 1))]
    pub max_concurrent_requests: Option<usize>,
    /// Runtimes that serve connections, one `current_thread` runtime on its
    /// own thread each (default: one per core; 1: a single runtime serves
    /// connections and background work together; read at start).
    #[schemars(range(min = 1))]
    pub runtimes: Option<usize>,
    /// How long shutdown waits for in-flight requests and streams (default 30s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
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
    /// State shared with the gateway's other replicas through Redis or
    /// Valkey: target health, cooldowns, dead keys, half-open trial leases and
    /// provider limits (read at start). Without it each replica keeps its own.
    pub shared_state: Option<RawSharedState>,
}

/// State shared across replicas (`shared_state`).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSharedState {
    /// The Redis (or Valkey) server the replicas share. Required.
    #[schemars(required)]
    pub redis: Option<RawRedis>,
}

/// Where the shared store is and how long the gateway waits for it.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("oneOf" = [{ "required": ["url_env"] }, { "required": ["url_file"] }]))]
pub struct RawRedis {
    /// Environment variable holding the URL (`redis://[:password@]host:port/db`
    /// or `valkey://...`); the URL may hold a password, so it is a secret: it
    /// never appears in logs, metrics or errors. Unset, the file is refused.
    pub url_env: Option<String>,
    /// File holding the URL instead (e.g. a mounted Kubernetes Secret);
    /// unreadable or empty, the file is refused.
    pub url_file: Option<String>,
    /// Prefix of every Redis key and of the pub/sub channel (default
    /// `switchyard`); deployments sharing one server keep apart by it.
    #[schemars(regex(pattern = schema_parts::KEY_PREFIX))]
    pub key_prefix: Option<String>,
    /// Longest wait for one Redis command or connect (default 250ms); past it
    /// the store counts as down and the replica runs on its local state.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub timeout: Option<String>,
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
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub timeout: Option<String>,
}

/// What upstream error text may reach clients.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSanitize {
    /// Phrases removed from upstream error text (case-insensitive), e.g. a vendor's sales pitch.
    #[serde(default)]
    pub sensitive_words: Vec<String>,
    /// Friendly `error.message` per HTTP error status, 400-599 (`"429": "Busy, retry shortly."`).
    #[serde(default)]
    #[schemars(extend("propertyNames" = { "pattern": schema_parts::ERROR_STATUS }))]
    pub messages: BTreeMap<String, String>,
}

/// One upstream account.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(transform = schema_parts::provider_rules)]
pub struct RawProvider {
    /// Wire protocol, the name of an adapter in `upstream::ADAPTERS` (default `openai`).
    // The schema's list and description come from the registry, so a new
    // protocol needs no change here.
    #[schemars(
        with = "Option<schema_parts::Names<schema_parts::Protocols>>",
        extend("description" = schema_parts::protocol_description())
    )]
    pub protocol: Option<String>,
    /// Base URL, absolute `http://` or `https://` with a host and no query
    /// string; requests go to it plus the protocol's path (see `protocol`).
    /// Required, except for `gemini` (default
    /// `https://generativelanguage.googleapis.com/v1beta`), `vertex` (from
    /// `location` and `project`) and `bedrock` (from `region`).
    #[schemars(regex(pattern = schema_parts::HTTP_URL))]
    pub base_url: Option<String>,
    /// The AWS region (`protocol: bedrock`): where requests are signed for,
    /// and the default `base_url`
    /// (`https://bedrock-runtime.{region}.amazonaws.com`).
    pub region: Option<String>,
    /// The named profile of the AWS shared config and credentials files
    /// (`protocol: bedrock` without an API key; default: `AWS_PROFILE`, else
    /// `default`).
    pub aws_profile: Option<String>,
    /// The Google Cloud project (`protocol: vertex`).
    pub project: Option<String>,
    /// The Vertex AI location (`protocol: vertex`): a region such as
    /// `us-central1`, or `global`.
    pub location: Option<String>,
    /// A Google service-account key file (`protocol: vertex`; e.g. a mounted
    /// Secret). Unset: Application Default Credentials
    /// (`GOOGLE_APPLICATION_CREDENTIALS`, else the metadata server, as GKE
    /// Workload Identity provides; `GCE_METADATA_HOST` overrides its host).
    pub credentials_file: Option<String>,
    /// Environment variable holding the API key, sent in the protocol's key
    /// header. Unset: a warning at start (an error under `--strict`); a reload
    /// adding a provider whose key cannot be read is refused.
    pub api_key_env: Option<String>,
    /// File holding the API key instead (e.g. a mounted Kubernetes Secret),
    /// re-read on reload; unreadable or empty is as an unset `api_key_env`.
    pub api_key_file: Option<String>,
    /// A pool of keys instead of one (not with `api_key_env`/`api_key_file`):
    /// each from an env var or a file, optionally named and rate-limited.
    #[serde(default)]
    pub keys: Vec<RawKey>,
    /// How a request picks a key of the pool: `round_robin` (default) or
    /// `least_recently_limited` (the key whose last 429 is oldest).
    #[schemars(extend("enum" = ["round_robin", "least_recently_limited"]))]
    pub key_selection: Option<String>,
    /// The header the key goes in (default: the protocol's, `authorization`
    /// for `openai`, `x-api-key` for `anthropic`); e.g. `api-key` for Azure.
    #[schemars(regex(pattern = schema_parts::HEADER_NAME))]
    pub key_header: Option<String>,
    /// Text before the key in that header (default `Bearer ` for
    /// `authorization`, none for any other header).
    pub key_prefix: Option<String>,
    /// Send the key as this query parameter instead of a header.
    pub key_query: Option<String>,
    /// Query parameters on every request, e.g. `{ api-version: 2024-10-21 }`
    /// (Azure OpenAI). Never logged or shown in errors.
    #[serde(default)]
    pub query: BTreeMap<String, String>,
    /// The provider also serves the OpenAI Responses API (`POST
    /// {base_url}/responses`; `protocol: openai` only): a Responses client's
    /// request goes there as sent (`model` rewritten) and its answer comes
    /// back as the provider sent it; chat requests still go to
    /// `chat/completions`. Default false.
    #[serde(default)]
    pub responses: bool,
    /// Extra headers sent with every upstream request.
    #[serde(default)]
    #[schemars(extend(
        "propertyNames" = { "pattern": schema_parts::HEADER_NAME },
        "additionalProperties" = { "type": "string", "pattern": schema_parts::HEADER_VALUE }
    ))]
    pub headers: BTreeMap<String, String>,
    /// Per-attempt timeout (humantime, e.g. `30s`); default 30 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub timeout: Option<String>,
    /// How the provider's connections speak HTTP: `auto` (default; HTTP/2
    /// where TLS negotiates it, else HTTP/1.1), `http1` (HTTP/1.1 only) or
    /// `http2` (HTTP/2 only; over `http://` with prior knowledge, h2c).
    #[schemars(extend("enum" = ["auto", "http1", "http2"]))]
    pub http_version: Option<String>,
    /// TCP (and TLS) connect timeout; default 2 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub connect_timeout: Option<String>,
    /// Longest silence between two stream chunks after the first; default 30 s.
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub idle_timeout: Option<String>,
    /// Same-target retry policy for errors classed `retry`.
    pub retry: Option<RawRetry>,
    /// Error-class rules for this provider, tried before the top-level ones.
    #[serde(default)]
    pub error_classes: Vec<RawRule>,
    /// Active probe settings for this provider's targets (overrides `health.probe`).
    pub probe: Option<RawProbe>,
    /// The account's rate limits; a target whose bucket cannot take a request
    /// is skipped without a call.
    pub rate_limit: Option<RawProviderLimit>,
    /// How this provider is told to continue an assistant prefix (for targets
    /// with the `prefill` capability, when a task continues broken streams).
    pub prefill: Option<RawPrefill>,
    /// After a 429 from this provider, how long only `critical` tasks may
    /// call it (the others go on down their chains), e.g. `30s`.
    pub shed_after_429: Option<String>,
}

/// One key of a provider's pool.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// Its name in metrics, logs and `/admin/targets` (never the key itself;
    /// default `key0`, `key1`, ... by position).
    pub name: Option<String>,
    /// Environment variable holding the key.
    pub env: Option<String>,
    /// File holding the key (re-read when it changes).
    pub file: Option<String>,
    /// This key's own rate limits.
    pub rate_limit: Option<RawProviderLimit>,
}

/// What a target's embeddings are: failover only goes between targets of
/// the same space, since vectors of two models are not interchangeable.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawEmbedding {
    /// The model family whose vectors these are, e.g. `text-embedding-3-small`.
    pub model_family: String,
    /// Vector length.
    #[schemars(range(min = 1))]
    pub dimensions: u32,
}

/// How a provider continues an assistant prefix: the request gets one
/// trailing assistant message holding the text already delivered, plus these
/// fields.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawPrefill {
    /// Extra fields on the trailing assistant message, e.g. `{ prefix: true }`
    /// (DeepSeek, Mistral).
    #[serde(default)]
    pub message_fields: BTreeMap<String, serde_json::Value>,
    /// Extra fields on the request body, e.g. `{ continue_final_message: true,
    /// add_generation_prompt: false }` (vLLM).
    #[serde(default)]
    pub body_fields: BTreeMap<String, serde_json::Value>,
}

/// What a task does when a stream breaks after its commit point.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawStreamRecovery {
    /// `off` (default: end with an error event) or `continue` (finish the
    /// answer on the next admitted target).
    pub mode: Option<String>,
    /// Most continuations of one stream (default 1).
    pub max_continuations: Option<u32>,
    /// Mark each seam with an SSE comment (default false; for debugging: some
    /// clients mishandle comments).
    pub seam_comment: Option<bool>,
}

/// Same-target retry policy.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    /// Retries after the first attempt (default 1).
    pub max: Option<u32>,
    /// Base of the exponential backoff with full jitter (default 200ms).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub backoff: Option<String>,
}

/// One model at one provider.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawTarget {
    /// Name of a provider in `providers`.
    pub provider: String,
    /// The upstream's own model name, written into the forwarded request (not blank).
    #[schemars(regex(pattern = schema_parts::NOT_BLANK))]
    pub model: String,
    /// What the target can do: `tools`, `json_mode` and `vision` (a request
    /// that needs one skips targets without it), `prefill` (a broken stream
    /// may be continued here from the assistant prefix).
    #[serde(default)]
    pub capabilities: Vec<Capability>,
    /// Context window in tokens: prompt estimate + `max_tokens` must fit.
    pub max_context: Option<u64>,
    /// Longest answer in tokens the target produces; the output estimate
    /// (and Anthropic's `max_tokens`) when a request gives no `max_tokens`.
    pub max_output: Option<u64>,
    /// Price in USD per 1,000 tokens.
    pub cost: Option<RawCost>,
    /// Share for the `weighted` strategy, at least 1 (default 1).
    #[schemars(range(min = 1))]
    pub weight: Option<u32>,
    /// The embedding space this target's `/v1/embeddings` answers live in;
    /// a task whose chain mixes spaces is refused.
    pub embedding: Option<RawEmbedding>,
}

/// Price of a target, USD per 1,000 tokens.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCost {
    /// Per 1,000 prompt tokens (default 0).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub input_per_1k: f64,
    /// Per 1,000 completion tokens (default 0).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub output_per_1k: f64,
}

/// A task's client-facing token buckets: one for the whole task, one per
/// caller, or both (each at its own rate).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend(
    "anyOf" = [{ "required": ["rps"] }, { "required": ["per_caller"] }],
    "dependentRequired" = { "burst": ["rps"] }
))]
pub struct RawTaskLimit {
    /// Task-wide bucket over all callers: sustained requests per second (may
    /// be fractional). Absent: no task-wide bucket.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub rps: Option<f64>,
    /// Task-wide bucket size: requests allowed at once (default: `rps` rounded up; needs `rps`).
    #[schemars(range(min = 1))]
    pub burst: Option<u32>,
    /// One bucket per caller, each at this rate; a caller over it is refused
    /// without touching the task-wide bucket.
    pub per_caller: Option<RawCallerLimit>,
}

/// Per-caller buckets of a task.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCallerLimit {
    /// Request header whose value names the caller (e.g. a caller id or key
    /// hash). A request without it (or with it empty) is keyed by the
    /// client's IP address instead.
    #[schemars(regex(pattern = schema_parts::HEADER_NAME))]
    pub header: String,
    /// Sustained requests per second for each caller (may be fractional).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub rps: f64,
    /// Requests one caller may send at once (default: `rps` rounded up).
    #[schemars(range(min = 1))]
    pub burst: Option<u32>,
    /// Callers tracked before idle ones (whose buckets have refilled) are
    /// forgotten (default 10,000).
    pub max_callers: Option<usize>,
}

/// Limits of a provider account.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawProviderLimit {
    /// Requests per minute, at least 1.
    #[schemars(range(min = 1))]
    pub rpm: Option<u32>,
    /// Tokens per minute, at least 1 (prompt estimate + max_tokens, corrected by reported usage).
    #[schemars(range(min = 1))]
    pub tpm: Option<u32>,
    /// Requests allowed at once (default: `rpm`).
    #[schemars(range(min = 1))]
    pub burst: Option<u32>,
    /// The share (0 up to, not including, 1) of each bucket only `critical` tasks may spend.
    #[schemars(range(min = 0.0), extend("exclusiveMaximum" = 1.0))]
    pub reserve: Option<f64>,
}

/// Spend cap on fallback targets.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawFallbackBudget {
    /// USD per clock hour that non-first targets of the chain may cost (0 or more).
    #[schemars(range(min = 0))]
    pub usd_per_hour: f64,
}

/// A task type: what a request asks for, and where it may go.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
// `chain` reads as empty when absent (so validate reports it with the rest);
// the schema says it is required.
#[schemars(extend("required" = ["chain"]))]
pub struct RawTask {
    /// Public model names that select this task (besides its own name); each
    /// may be used once across all tasks.
    #[serde(default)]
    #[schemars(extend("uniqueItems" = true))]
    pub aliases: Vec<String>,
    /// Degradation chain: target names, tried in order. Required, non-empty,
    /// each target once.
    #[serde(default)]
    #[schemars(length(min = 1), extend("uniqueItems" = true))]
    pub chain: Vec<String>,
    /// Time and failover budget of one request.
    pub budget: Option<RawBudget>,
    /// Capabilities every target must have, on top of what the request
    /// needs; at least one target of the chain must have each.
    #[serde(default)]
    pub requires: Vec<Capability>,
    /// How the first target is chosen (default `priority`); failover then
    /// follows chain order.
    #[schemars(with = "Option<schema_parts::Names<schema_parts::Strategies>>")]
    pub strategy: Option<String>,
    /// Client-facing token buckets: task-wide, per caller, or both.
    pub rate_limit: Option<RawTaskLimit>,
    /// Spend cap on fallback targets.
    pub fallback_budget: Option<RawFallbackBudget>,
    /// Which answers' `tool_calls` are checked against the request's
    /// contract: `degraded` (default: answers from a target other than the
    /// first one chosen), `always` or `never`.
    #[schemars(with = "Option<schema_parts::Names<schema_parts::Modes>>")]
    pub validate_tool_calls: Option<String>,
    /// JSON Schema files (relative to this file's directory) that override the
    /// request's `parameters`, by function name.
    #[serde(default)]
    pub tool_schemas: BTreeMap<String, String>,
    /// What is tried on an answer that breaks the tool call contract before
    /// the failover.
    pub contract: Option<RawContract>,
    /// `critical`, `normal` (default) or `batch`: only `critical` tasks spend
    /// a bucket's `reserve` or a provider shedding after a 429.
    #[schemars(with = "Option<schema_parts::Names<schema_parts::Priorities>>")]
    pub priority: Option<String>,
    /// A `batch` task's queue: when every target it may use is out of quota
    /// or cooling down, a request waits for one instead of a 429.
    pub queue: Option<RawQueue>,
    /// What happens when a stream breaks after its commit point.
    pub stream_recovery: Option<RawStreamRecovery>,
    /// Hedged requests: when a slow first attempt gets a parallel one.
    pub hedge: Option<RawHedge>,
    /// Whole answers kept and served again, and as the last answer when no
    /// target answers (`stale_if_error`).
    pub cache: Option<RawCache>,
    /// The cache keeps answers to requests that sample too (`temperature`
    /// absent or above 0, and no `seed`); default false.
    pub cache_nondeterministic: Option<bool>,
}

/// A task's cache of whole answers.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawCache {
    /// `exact` (default): the same request, normalised. `semantic`: also
    /// a prompt that means the same (needs `semantic`).
    #[schemars(with = "Option<schema_parts::Names<schema_parts::CacheModes>>")]
    pub mode: Option<String>,
    /// How long an answer is served as fresh (default 10m).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub ttl: Option<String>,
    /// The bound of the task's entries in this process: bytes, or a size
    /// like `64MiB` or `500KB` (default 64MiB).
    #[serde(default, deserialize_with = "byte_size_text")]
    #[schemars(with = "Option<schema_parts::ByteSizeText>")]
    pub max_bytes: Option<String>,
    /// When no target answers (502, 503, 504), an answer to the same request
    /// at most this old is served instead (default: never).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub stale_if_error: Option<String>,
    /// How `mode: semantic` finds a prompt that means the same.
    pub semantic: Option<RawSemantic>,
}

/// A semantic cache's lookup by meaning.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawSemantic {
    /// The embeddings task of this file a prompt is embedded with (it fails
    /// over like any other task).
    pub embeddings: String,
    /// The least cosine similarity of two prompts' embeddings that is a hit,
    /// above 0 up to 1 (default 0.95).
    #[schemars(extend("exclusiveMinimum" = 0.0, "maximum" = 1.0))]
    pub threshold: Option<f64>,
    /// A conversation of more turns (system turns aside) is looked up
    /// exactly only (default 4).
    #[schemars(range(min = 1))]
    pub max_messages: Option<u32>,
    /// A semantic match may be served as the stale answer too (default false).
    pub stale: Option<bool>,
}

/// A batch task's queue.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawQueue {
    /// Longest wait of one request (default `60s`; the task's deadline too).
    pub max_wait: Option<String>,
    /// Most requests waiting at once (default 1000); more get 429 at once.
    #[schemars(range(min = 1))]
    pub max_depth: Option<u32>,
}

/// A task's answers that break the tool call contract.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawContract {
    /// Repairs tried, in order, before the failover: `syntax` fixes the JSON
    /// of tool call arguments (code fences, trailing commas, single quotes,
    /// unclosed brackets) without a model call.
    #[serde(default)]
    #[schemars(with = "Vec<schema_parts::Names<schema_parts::Repairs>>")]
    pub repair: Vec<String>,
    /// For `to_tool`: the target (or the task, whose chain is tried in
    /// order) that turns a prose answer into the required call.
    pub repair_target: Option<String>,
}

/// A task's hedged requests: when the first attempt has not reached its
/// commit point after `after`, the next admitted target starts in parallel;
/// the first to commit wins, the other is cancelled.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawHedge {
    /// A duration (`400ms`), or a percentile of the first target's observed
    /// time to first token: `p50` to `p99.9`.
    #[schemars(extend("pattern" = r"^(p[0-9]{1,2}(\.[0-9]+)?|[0-9].*)$"))]
    pub after: String,
    /// Adaptive `after` only: never sooner than this (default 50ms).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub floor: Option<String>,
    /// Adaptive `after` only: never later than this; also the delay until 20
    /// samples are seen (default 2s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub cap: Option<String>,
    /// Extra attempts per request: only 1 is supported (default 1).
    #[schemars(range(min = 1, max = 1))]
    pub max: Option<u32>,
    /// Most of a minute's requests of the task that may be hedged, 0-1
    /// (default 0.1).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_share: Option<f64>,
}

/// Time and failover budget of one request of a task.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    /// End-to-end deadline from the request's arrival (default 30 s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub total_timeout: Option<String>,
    /// Most switches to another target in one request (default: chain length - 1).
    pub max_failovers: Option<u32>,
    /// Streams: longest wait for the first content chunk from one target (default: none).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub first_token_timeout: Option<String>,
}

/// One error-class rule: when every given test in `match` holds, take `action`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
// `match` reads as empty when absent (so validate can say what is missing
// along with everything else); the schema says it is required.
#[schemars(extend("required" = ["match", "action"]))]
pub struct RawRule {
    /// The tests; all given ones must hold. Required, with at least one test.
    #[serde(rename = "match", default)]
    #[schemars(extend("minProperties" = 1))]
    pub matches: RawMatch,
    /// What to do: `retry` (the same target, then fail over), `failover` or
    /// `return` (the answer goes to the client).
    #[schemars(with = "schema_parts::Names<schema_parts::Actions>")]
    pub action: String,
    /// Whether the outcome counts against the target's health (default true);
    /// with `scope: key`, against the key instead.
    pub health: Option<bool>,
    /// What the failure counts against and cools down: `key` (the API key
    /// used), `target` (the model at the provider; default) or `provider`
    /// (every target of the account).
    #[schemars(extend("enum" = ["key", "target", "provider"]))]
    pub scope: Option<String>,
    /// Skip the target (or key, or provider: `scope`) for this long;
    /// `retry_after`: for as long as the upstream advertises (`Retry-After`,
    /// `retry-after-ms`, rate-limit reset headers; 1 s without one);
    /// `until_reload` (with `scope: key`): until a reload or a rotation of
    /// the key's file (a revoked key).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::CooldownText>")]
    pub cooldown: Option<String>,
    /// For a 429 whose advertised wait is at most this long and fits the
    /// deadline: wait it out and retry the same target once instead of
    /// failing over (default: off).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub wait_retry_after: Option<String>,
    /// How a key this rule revokes (`cooldown: until_reload`) comes back:
    /// `reprobe` (default: the prober re-tests it with that key, backing off
    /// from `probe.interval` to 30 times it) or `until_rotation` (only a
    /// reload or a rotation of its file).
    #[schemars(extend("enum" = ["reprobe", "until_rotation"]))]
    pub revoke: Option<String>,
}

/// The tests of an error-class rule. `network` stands alone: a network error
/// has no status, body or headers.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("dependentSchemas" = {
    "network": { "properties": { "status": false, "body": false, "header": false } }
}))]
pub struct RawMatch {
    /// Status codes (100-599) or classes: `503`, `"5xx"`, or a non-empty list of them.
    #[schemars(with = "Option<schema_parts::StatusTests>")]
    pub status: Option<serde_yaml::Value>,
    /// Network error kinds, a non-empty list: `connect`, `reset`, `timeout`,
    /// `tls`, `dns`, `protocol`.
    #[schemars(
        with = "Option<Vec<schema_parts::Names<schema_parts::NetworkKinds>>>",
        length(min = 1)
    )]
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
    #[schemars(regex(pattern = schema_parts::HEADER_NAME))]
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
    /// Consecutive counted failures before -> DOWN, breaker open (default 5;
    /// at least `degraded_after`).
    pub down_after: Option<u32>,
    /// How long a DOWN target is skipped before one half-open trial (default 20s, ±20 % jitter).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub open_for: Option<String>,
    /// What to do when every target of a chain is DOWN or cooling down:
    /// `trial` (default: try the least recently failed one anyway) or `fail` (503).
    #[schemars(with = "Option<schema_parts::Names<schema_parts::AllDownChoices>>")]
    pub all_down: Option<String>,
    /// Sliding window for the failure rate (default 30s).
    #[serde(default, deserialize_with = "duration_text")]
    #[schemars(with = "Option<schema_parts::DurationText>")]
    pub window: Option<String>,
    /// Fewest counted outcomes in the window before its rate is judged (default 10).
    pub min_requests: Option<u32>,
    /// Failure rate over the window, in (0, 1], that makes a target DEGRADED (default 0.5).
    #[schemars(range(max = 1), extend("exclusiveMinimum" = 0))]
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
    #[schemars(with = "Option<schema_parts::DurationOrOff>")]
    pub interval: Option<String>,
}

/// A capability a target declares (`capabilities`) and a request or a task
/// (`requires`) needs. Only these exist: the code derives the first three
/// from requests and uses `prefill` to continue broken streams, so any other
/// tag could never be satisfied and is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// Function calling: needed by a request with `tools` or `functions`.
    Tools,
    /// JSON mode: needed by a request with a JSON `response_format`.
    JsonMode,
    /// Image input: needed by a request with image content parts.
    Vision,
    /// Can continue an assistant prefix (a broken stream's continuation).
    Prefill,
}

impl Capability {
    /// Every capability, in the order messages list them.
    pub const ALL: [Capability; 4] = [
        Capability::Tools,
        Capability::JsonMode,
        Capability::Vision,
        Capability::Prefill,
    ];

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Tools => "tools",
            Capability::JsonMode => "json_mode",
            Capability::Vision => "vision",
            Capability::Prefill => "prefill",
        }
    }

    /// The names, for messages: `tools, json_mode, vision, prefill`.
    #[must_use]
    pub fn listed() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Capability {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Capability::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown capability `{name}`: a target can declare only {} (every target streams)",
                Capability::listed()
            ))
        })
    }
}

/// Which work a task is (`priority`): only `critical` tasks spend what
/// providers keep back (a bucket's `reserve`, a provider shedding after a 429).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    /// The core path: gets every bucket whole.
    Critical,
    /// Ordinary work (the default).
    #[default]
    Normal,
    /// Work that may wait or go elsewhere.
    Batch,
}

impl Priority {
    /// Whether it spends what providers keep back.
    #[must_use]
    pub fn is_critical(self) -> bool {
        self == Priority::Critical
    }

    /// Every priority, for parsing, messages and the JSON Schema.
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Normal, Priority::Batch];

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Normal => "normal",
            Priority::Batch => "batch",
        }
    }
}

/// How a task picks its first target (`strategy`). Defined with the raw
/// types so the JSON Schema can list the names; `snapshot::Strategy` is the
/// same type, compiled into each task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Chain order.
    Priority,
    /// Smooth weighted round robin by `weight`.
    Weighted,
    /// Each eligible target in turn.
    RoundRobin,
    /// Lowest peak-EWMA time to first byte.
    Latency,
    /// Cheapest estimated request.
    Cost,
}

impl Strategy {
    /// Every strategy, for parsing, messages and the JSON Schema.
    pub const ALL: [Strategy; 5] = [
        Strategy::Priority,
        Strategy::Weighted,
        Strategy::RoundRobin,
        Strategy::Latency,
        Strategy::Cost,
    ];

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Priority => "priority",
            Strategy::Weighted => "weighted",
            Strategy::RoundRobin => "round_robin",
            Strategy::Latency => "latency",
            Strategy::Cost => "cost",
        }
    }
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
    let text = Option::<Text>::deserialize(d)
        .map_err(|_| serde::de::Error::custom("must be a duration like `30s`, `500ms` or `2m`"))?;
    Ok(text.map(|t| match t {
        Text::S(s) => s,
        Text::U(n) => n.to_string(),
        Text::F(f) => f.to_string(),
    }))
}

fn byte_size_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Text {
        S(String),
        U(u64),
    }
    let text = Option::<Text>::deserialize(d).map_err(|_| {
        serde::de::Error::custom("must be a size like `64MiB`, `500KB` or a number of bytes")
    })?;
    Ok(text.map(|t| match t {
        Text::S(s) => s,
        Text::U(n) => n.to_string(),
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
    /// Unknown-key and type errors found while parsing. The file was read
    /// without those keys and values so that the semantic checks still run
    /// and every problem is reported in one pass; compiling fails while this
    /// is not empty.
    pub pending: Vec<Diagnostic>,
    /// What was taken out to read the rest, so compiling does not report a
    /// reference to a broken entry as unknown.
    pub removed: Removed,
}

/// Reads and parses `path`.
///
/// # Errors
/// A syntax error, located, or the rare file that cannot be read even
/// without its problems (see [`parse`]); unreadable files give one diagnostic
/// at 1:1. Type and unknown-key errors are in [`Parsed::pending`].
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
/// As [`load`]: syntax errors (one, where the parser stopped), and the rare
/// file that cannot be read at all even without its problems (not a mapping,
/// a top-level key that is not a string). Type and unknown-key errors come
/// back in [`Parsed::pending`] instead, with the rest of the file read.
pub fn parse(text: &str) -> Result<Parsed, Vec<Diagnostic>> {
    // Editors on Windows save a byte order mark; YAML allows one and it is no column.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    match LocationIndex::scan(text) {
        Ok(index) if index.duplicates().is_empty() => read(text, index),
        Err(locate::ScanError::Refused(d)) => Err(vec![d]),
        // Each syntax error said at its line, and the rest read without it.
        Ok(_) | Err(locate::ScanError::Syntax { .. }) => Err(syntax::recover(text, |rest| {
            match LocationIndex::scan(rest) {
                Ok(index) => read(rest, index).map_or_else(|d| d, |parsed| parsed.pending),
                Err(_) => Vec::new(),
            }
        })),
    }
}

/// Reads a well-formed `text`, indexed: as [`parse`].
fn read(text: &str, index: LocationIndex) -> Result<Parsed, Vec<Diagnostic>> {
    let first = match serde_yaml::from_str::<RawConfig>(text) {
        Ok(raw) => {
            return Ok(Parsed {
                raw,
                index,
                base_dir: None,
                pending: Vec::new(),
                removed: Removed::default(),
            })
        }
        Err(first) => first,
    };
    let first = || {
        let (line, column) = first.location().map_or((1, 1), |l| (l.line(), l.column()));
        vec![Diagnostic::error(
            "",
            line,
            column,
            sweep::in_words(&sweep::strip_location(&first.to_string())),
        )]
    };
    let tree = match serde_yaml::from_str::<serde_yaml::Value>(text) {
        Ok(tree) => tree,
        // What the indexing parser accepted and libyaml does not: said the same way.
        Err(e) => {
            let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
            let info = sweep::strip_location(&e.to_string());
            // A number too large for any setting: said, then the rest read
            // with it as 0 (which only its own key's checks would notice).
            let patched = (info.contains(" as u128") || info.contains(" as i128"))
                .then(|| syntax::zero_number_at(text, line, column))
                .flatten();
            let Some(patched) = patched else {
                return Err(vec![syntax::explain(text, line, column, &info).diagnostic]);
            };
            let said = Diagnostic::error(
                "",
                line,
                column,
                "this number is too large for any setting: write a smaller one",
            );
            let mut all = vec![said];
            match parse(&patched) {
                Ok(parsed) => all.extend(parsed.pending),
                Err(more) => all.extend(more),
            }
            return Err(all);
        }
    };
    match sweep::read(tree, &index) {
        Ok(read) => Ok(Parsed {
            raw: read.raw,
            index,
            base_dir: None,
            pending: read.problems,
            removed: read.removed,
        }),
        Err(problems) if problems.is_empty() => Err(first()),
        Err(problems) => Err(problems),
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

    fn schema_validator() -> jsonschema::Validator {
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../schemas/routes.schema.json")).unwrap();
        jsonschema::validator_for(&schema).unwrap()
    }

    /// Whether `validate` (parse and compile) accepts `text`.
    fn validate_accepts(text: &str) -> bool {
        parse(text).is_ok_and(|parsed| {
            crate::snapshot::compile::compile(
                &parsed,
                text,
                &crate::snapshot::LiveState::default(),
                crate::snapshot::CompileOptions::default(),
            )
            .is_ok()
        })
    }

    const SCHEMA_BASE: &str = "version: 1
providers:
  p:
    base_url: http://127.0.0.1:9/v1
    timeout: 2s
    probe: { interval: 30s }
targets:
  t: { provider: p, model: m, weight: 2 }
tasks:
  chat:
    chain: [t]
    strategy: priority
    rate_limit: { rps: 5 }
error_classes:
  - { match: { status: 503 }, action: failover, cooldown: 5s }
health:
  failure_rate: 0.5
";

    /// Edits of [`SCHEMA_BASE`] that both the schema and `validate` refuse.
    const REFUSED: &[(&str, &str)] = &[
        ("strategy: priority", "strategy: fastest"),
        ("chain: [t]", "chain: []"),
        ("    chain: [t]\n", ""),
        ("version: 1", "version: 2"),
        ("version: 1\n", ""),
        ("failure_rate: 0.5", "failure_rate: 1.5"),
        ("failure_rate: 0.5", "failure_rate: 0"),
        ("timeout: 2s", "timeout: soon"),
        ("timeout: 2s", "timeout: 0s"),
        ("timeout: 2s", "timeout: 30"),
        ("timeout: 2s", "protocol: grpc"),
        ("action: failover", "action: explode"),
        ("strategy: priority", "validate_tool_calls: sometimes"),
        ("failure_rate: 0.5", "all_down: maybe"),
        ("status: 503", "network: [wormhole]"),
        ("status: 503", "network: []"),
        ("status: 503", "status: []"),
        ("status: 503", "status: 7xx"),
        ("status: 503", "status: 503, network: [dns]"),
        ("match: { status: 503 }, ", ""),
        ("cooldown: 5s", "cooldown: 0s"),
        ("rps: 5", "rps: 0"),
        ("rps: 5", "burst: 5"),
        ("{ rps: 5 }", "{}"),
        (
            "{ rps: 5 }",
            "{ per_caller: { header: 'bad header', rps: 1 } }",
        ),
        ("weight: 2", "weight: 0"),
        ("timeout: 2s", "rate_limit: { rpm: 0 }"),
        ("timeout: 2s", "rate_limit: { rpm: 10, burst: 0 }"),
        ("{ rps: 5 }", "{ rps: 5, burst: 0 }"),
        (
            "{ rps: 5 }",
            "{ per_caller: { header: x-caller, rps: 1, burst: 0 } }",
        ),
        (
            "timeout: 2s",
            "keys: [{ name: k, env: K, rate_limit: { rpm: 10, burst: 0 } }]",
        ),
        (
            "base_url: http://127.0.0.1:9/v1",
            "base_url: ftp://127.0.0.1:9/v1",
        ),
        (
            "base_url: http://127.0.0.1:9/v1",
            "base_url: 'http://127.0.0.1:9/v1?x=1'",
        ),
        ("model: m", "model: ' '"),
        ("version: 1", "version: 1\nlisten: localhost"),
        ("version: 1", "version: 1\nmax_concurrent_requests: 0"),
        (
            "version: 1",
            "version: 1\nsanitize: { messages: { '200': fine } }",
        ),
        ("timeout: 2s", "headers: { 'bad header': x }"),
        ("model: m", "model: m, capabilities: [streaming]"),
        ("chain: [t]", "chain: [t]\n    requires: [streaming]"),
        (
            "chain: [t]",
            "chain: [t]\n    contract: { repair: [rewrite] }",
        ),
        (
            "chain: [t]",
            "chain: [t]\n    contract: { repairs: [syntax] }",
        ),
        ("chain: [t]", "chain: [t]\n    priority: urgent"),
        ("chain: [t]", "chain: [t]\n    queue: { max_depth: 0 }"),
        ("timeout: 2s", "rate_limit: { rpm: 10, reserve: 1.5 }"),
        ("timeout: 2s", "rate_limit: { rpm: 10, reserve: 1.0 }"),
    ];

    #[test]
    fn the_schema_refuses_what_validate_refuses_and_accepts_what_it_accepts() {
        let validator = schema_validator();
        let base: serde_json::Value = serde_yaml::from_str(SCHEMA_BASE).unwrap();
        assert!(
            validator.is_valid(&base),
            "{:?}",
            validator
                .iter_errors(&base)
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
        );
        assert!(validate_accepts(SCHEMA_BASE));
        for &(from, to) in REFUSED {
            assert!(SCHEMA_BASE.contains(from), "{from}");
            let text = SCHEMA_BASE.replacen(from, to, 1);
            let value: serde_json::Value = serde_yaml::from_str(&text).unwrap();
            assert!(
                !validator.is_valid(&value),
                "the schema accepts `{to}`:\n{text}"
            );
            assert!(!validate_accepts(&text), "validate accepts `{to}`:\n{text}");
        }
        let accepted = [
            ("interval: 30s", "interval: 0"),
            ("interval: 30s", "interval: '0'"),
            ("interval: 30s", "interval: 0s"),
            ("timeout: 2s", "timeout: 1m 30s"),
            ("timeout: 2s", "timeout: 1.5s"),
            ("timeout: 2s", "timeout:"),
            ("timeout: 2s", "protocol: anthropic"),
            ("cooldown: 5s", "cooldown: retry_after"),
            ("status: 503", "status: [500, '4xx']"),
            ("status: 503", "network: [dns, reset]"),
            (
                "{ rps: 5 }",
                "{ per_caller: { header: x-caller, rps: 0.5, burst: 2 } }",
            ),
            ("strategy: priority", "strategy: round_robin"),
            ("version: 1", "version: 1\nlisten: '[::1]:8080'"),
        ];
        for (from, to) in accepted {
            assert!(SCHEMA_BASE.contains(from), "{from}");
            let text = SCHEMA_BASE.replacen(from, to, 1);
            let value: serde_json::Value = serde_yaml::from_str(&text).unwrap();
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "the schema refuses `{to}`: {errors:#?}");
            assert!(validate_accepts(&text), "validate refuses `{to}`:\n{text}");
        }
    }

    #[test]
    fn the_schema_and_validate_agree_on_shared_state() {
        let validator = schema_validator();
        let url = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(url.path(), "redis://:pw@127.0.0.1:6379/0\n").unwrap();
        let with = |section: &str| {
            let text = format!("{SCHEMA_BASE}shared_state: {section}\n")
                .replace("URL", &url.path().display().to_string());
            let value: serde_json::Value = serde_yaml::from_str(&text).unwrap();
            (validator.is_valid(&value), validate_accepts(&text))
        };
        for refused in [
            "{}",
            "{ redis: { key_prefix: sw } }",
            "{ redis: { url_env: A, url_file: URL } }",
            "{ redis: { url_file: URL, key_prefix: 'a b' } }",
            "{ redis: { url_file: URL, timeout: 0s } }",
            "{ redis: { url_file: URL, colour: red } }",
        ] {
            assert_eq!(with(refused), (false, false), "{refused}");
        }
        for accepted in [
            "{ redis: { url_file: URL } }",
            "{ redis: { url_file: URL, key_prefix: 'prod:eu-1', timeout: 100ms } }",
        ] {
            assert_eq!(with(accepted), (true, true), "{accepted}");
        }
    }

    /// The routes files under `examples/`: the YAML documents with a
    /// top-level `version`, and the `routes.yaml` a ConfigMap carries.
    fn example_routes() -> Vec<(String, serde_json::Value)> {
        fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                    out.push(path);
                }
            }
        }
        let mut files = Vec::new();
        walk(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("examples"),
            &mut files,
        );
        let mut routes = Vec::new();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let value = serde_json::Value::deserialize(doc).unwrap();
                let name = file.display().to_string();
                if value.get("version").is_some() {
                    routes.push((name, value));
                } else if let Some(inner) = value["data"]["routes.yaml"].as_str() {
                    routes.push((
                        format!("{name} (data.routes.yaml)"),
                        serde_yaml::from_str(inner).unwrap(),
                    ));
                }
            }
        }
        routes
    }

    #[test]
    fn every_routes_file_under_examples_validates_against_the_schema() {
        let validator = schema_validator();
        let routes = example_routes();
        assert!(
            routes.len() >= 2,
            "{:?}",
            routes.iter().map(|r| &r.0).collect::<Vec<_>>()
        );
        for (name, value) in routes {
            let errors: Vec<String> = validator
                .iter_errors(&value)
                .map(|e| format!("{}: {e}", e.instance_path))
                .collect();
            assert!(errors.is_empty(), "{name}: {errors:#?}");
        }
    }

    #[test]
    fn wrong_type_is_located() {
        let text =
            "version: 1\ntasks:\n  a:\n    chain: [x]\n    budget: { max_failovers: lots }\n";
        let diags = parse(text).unwrap().pending;
        assert_eq!(diags.len(), 1, "{diags:?}");
        assert_eq!(diags[0].line, 5);
        assert_eq!(diags[0].path, "tasks.a.budget.max_failovers");
    }
}
