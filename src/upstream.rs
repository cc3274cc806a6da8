//! Upstream providers: the protocol adapter seam, and one provider's
//! endpoint (URL, headers with the key, pooled client).
//!
//! A protocol is one [`Adapter`]: how to encode a chat request for a target,
//! decode its answer and its error bodies into OpenAI format, and translate
//! its stream events into `chat.completion.chunk`s. Each lives in its own file
//! under `upstream/`; adding a protocol is one new file and one line in
//! [`ADAPTERS`]. Nothing outside this module matches on a protocol.

pub mod anthropic;
pub mod auth;
pub mod bedrock;
pub mod chunk;
pub mod decode;
pub mod eventstream;
pub mod gemini;
pub mod openai;
pub mod pool;
pub mod responses;
pub mod translate;
pub mod vertex;

use std::borrow::Cow;
use std::sync::atomic::AtomicU32;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, ACCEPT_ENCODING, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::Full;

use crate::classify::NetworkKind;
use crate::native::Protocol;
use crate::request::{ChatRequest, EmbeddingsRequest};
use crate::sse::{Chunk, Upstream};

/// Every protocol, by its `routes.yaml` name.
pub const ADAPTERS: &[&dyn Adapter] = &[
    &openai::OpenAi,
    &anthropic::Anthropic,
    &gemini::Gemini,
    &vertex::Vertex,
    &bedrock::Bedrock,
];

/// The adapter named `name` in `routes.yaml`, if there is one.
#[must_use]
pub fn adapter(name: &str) -> Option<&'static dyn Adapter> {
    ADAPTERS.iter().copied().find(|a| a.name() == name)
}

/// The names of every protocol, for messages.
#[must_use]
pub fn adapter_names() -> String {
    ADAPTERS
        .iter()
        .map(|a| a.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A model name as one path segment: everything but the unreserved
/// characters and `@` (Vertex AI's `model@version`) percent-encoded, so a
/// name can never end the path, start a query or climb out of its segment
/// (an ARN's `:` and `/`, a `?` or `#` in a name).
#[must_use]
pub fn path_segment(model: &str) -> String {
    let mut out = String::with_capacity(model.len() + 8);
    for byte in model.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b'@') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A field of a chat request object unless absent or `null` (a translation
/// treats both alike, as OpenAI does).
pub(crate) fn non_null<'a>(
    obj: &'a serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Option<&'a serde_json::Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// The client headers any protocol forwards, copied out of `client` (for a
/// stream's continuation, which outlives the request's own headers).
#[must_use]
pub fn forwardable(client: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for name in ADAPTERS.iter().flat_map(|a| a.forwarded_headers()) {
        for value in client.get_all(name) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// What a target contributes to an encoded request.
#[derive(Debug, Clone, Copy)]
pub struct TargetModel<'a> {
    /// The upstream's model name.
    pub model: &'a str,
    /// The target's `max_output`, for protocols that require a `max_tokens`.
    pub max_output: Option<u64>,
}

/// A request this protocol cannot express (the target is skipped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsupported(pub String);

/// An upstream answer that is not what its protocol promises.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// One wire protocol.
pub trait Adapter: Send + Sync + std::fmt::Debug {
    /// The `protocol:` value in routes.yaml.
    fn name(&self) -> &'static str;

    /// The path under `base_url` that chat requests go to (for a protocol
    /// with [`Adapter::call_path`], its shape, for the docs).
    fn chat_path(&self) -> &'static str;

    /// The path of one call under `base_url`, for a protocol that puts the
    /// model or the stream mode in the URL (Gemini, Vertex AI, Bedrock); a
    /// query string in it is kept. `None`: the fixed paths.
    fn call_path(&self, _op: Operation, _model: &str, _stream: bool) -> Option<String> {
        None
    }

    /// How its streams are framed.
    fn framing(&self) -> Framing {
        Framing::Sse
    }

    /// `base_url` when the provider sets none, from where it is (a cloud's
    /// region, project and location).
    ///
    /// # Errors
    /// What the provider must set instead (`base_url`, or the place).
    fn default_base_url(&self, _place: &Place<'_>) -> Result<String, String> {
        Err(format!(
            "missing field `base_url` (`protocol: {}` has no default)",
            self.name()
        ))
    }

    /// The provider settings of [`Place`] this protocol reads (any other set
    /// is refused).
    fn place_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// The settings of [`Place`] that stand in for `base_url` together (for
    /// the JSON Schema; [`Adapter::default_base_url`] says so to `validate`).
    fn place_required(&self) -> &'static [&'static str] {
        &[]
    }

    /// Where the provider's identity comes from when it has no key of its
    /// own (`None`: it is sent without one).
    ///
    /// # Errors
    /// The place or the credentials file cannot make one.
    fn auth(&self, _place: &Place<'_>, _base_url: &str) -> Result<Option<auth::Auth>, PlaceError> {
        Ok(None)
    }

    /// Headers this protocol needs on every request (set unless the provider's
    /// `headers` already has them).
    fn required_headers(&self) -> &'static [(&'static str, &'static str)];

    /// Client headers of this protocol that go upstream as sent (a client of
    /// the same protocol choosing its API version or beta features).
    fn forwarded_headers(&self) -> &'static [HeaderName] {
        &[]
    }

    /// The header that carries the API key by default, and the text before it.
    fn key_header(&self) -> (&'static str, &'static str);

    /// The path under `base_url` of embeddings requests, if the protocol has them.
    fn embeddings_path(&self) -> Option<&'static str>;

    /// The front-door protocol this one is, if it is one: a client of it is
    /// served its own bytes ([`crate::native`]).
    fn native(&self) -> Option<Protocol> {
        None
    }

    /// Path of the token-count operation under `base_url`, if it has one.
    fn count_tokens_path(&self) -> Option<&'static str> {
        None
    }

    /// The request body for `target`.
    ///
    /// # Errors
    /// The request uses something this protocol cannot express.
    fn encode(
        &self,
        request: &ChatRequest<'_>,
        target: TargetModel<'_>,
    ) -> Result<Bytes, Unsupported>;

    /// The embeddings request body for the target's `model`.
    ///
    /// # Errors
    /// The protocol has no embeddings.
    fn encode_embeddings(
        &self,
        request: &EmbeddingsRequest<'_>,
        model: &str,
    ) -> Result<Bytes, Unsupported>;

    /// A 2xx body as a `chat.completion` JSON; `model`: the target's.
    ///
    /// # Errors
    /// The body is not an answer of this protocol.
    fn decode_answer(&self, body: Bytes, model: &str) -> Result<Bytes, Malformed>;

    /// What the engine reads of a 2xx body that goes back as it came (to a
    /// client of this protocol, with nothing to check against its chat
    /// reading), read without writing that reading. `None` where only
    /// [`Adapter::decode_answer`] can judge the body, or it gives no counts.
    fn answer_facts<'a>(&self, _body: &'a [u8]) -> Option<AnswerFacts<'a>> {
        None
    }

    /// A 2xx embeddings body in OpenAI's shape (as is, for a protocol whose
    /// embeddings are OpenAI's).
    ///
    /// # Errors
    /// The body is not an embeddings answer of this protocol.
    fn decode_embeddings(&self, body: Bytes, _model: &str) -> Result<Bytes, Malformed> {
        Ok(body)
    }

    /// An error answer in OpenAI format, with the status it stands for and
    /// any wait it advertises in its body (as is, when the protocol's errors
    /// already are OpenAI's).
    fn decode_error(&self, status: StatusCode, _headers: &HeaderMap, body: Bytes) -> ErrorAnswer {
        ErrorAnswer {
            status,
            body,
            wait: None,
        }
    }

    /// A translator of stream events, or `None` when the events already are
    /// `chat.completion.chunk`s; `model`: the target's.
    fn stream_translator(
        &self,
        include_usage: bool,
        model: &str,
    ) -> Option<Box<dyn StreamTranslator>>;
}

/// An upstream's error answer, read ([`Adapter::decode_error`]).
#[derive(Debug, Clone)]
pub struct ErrorAnswer {
    /// The status it stands for (a protocol may send a 400 for a rate limit).
    pub status: StatusCode,
    /// In OpenAI's error shape when the protocol has its own.
    pub body: Bytes,
    /// A wait the body advertises (Google's `RetryInfo.retryDelay`), beside
    /// the headers' own.
    pub wait: Option<std::time::Duration>,
}

/// Where a provider is and how it proves who it is, for protocols whose
/// endpoint and identity follow from it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Place<'a> {
    /// `aws_profile:`, a profile of the AWS shared files.
    pub aws_profile: Option<&'a str>,
    /// The JSON of `credentials_file:`, read.
    pub credentials: Option<&'a serde_json::Value>,
    /// A cloud region (`region:`; Bedrock's `us-east-1`).
    pub region: Option<&'a str>,
    /// A cloud project (`project:`; Vertex AI's).
    pub project: Option<&'a str>,
    /// A cloud location (`location:`; Vertex AI's `us-central1` or `global`).
    pub location: Option<&'a str>,
}

/// A provider's place settings that cannot work, and the one at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PlaceError {
    /// The setting at fault (`region`, `credentials_file`), if one is.
    pub key: Option<&'static str>,
    /// What is wrong, never with a secret.
    pub message: String,
}

/// How a protocol frames its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Server-sent events (`text/event-stream`).
    Sse,
    /// AWS's binary event stream (`application/vnd.amazon.eventstream`),
    /// each message with its CRCs.
    AwsEventStream,
}

impl Framing {
    /// Whether a response's `content-type` is a stream of this framing.
    #[must_use]
    pub fn is_stream(self, content_type: Option<&HeaderValue>) -> bool {
        let Some(value) = content_type.and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let expected = match self {
            Framing::Sse => "text/event-stream",
            Framing::AwsEventStream => "application/vnd.amazon.eventstream",
        };
        value
            .get(..expected.len())
            .is_some_and(|v| v.eq_ignore_ascii_case(expected))
    }
}

/// Translates one protocol's stream, event by event, into OpenAI chunk events.
pub trait StreamTranslator: Send + std::fmt::Debug {
    /// One upstream event's `data:`. Returns zero or more complete OpenAI SSE
    /// events (`data: ...\n\n`), `data: [DONE]` included at the end.
    ///
    /// # Errors
    /// The data is not an event of this protocol.
    fn on_event(&mut self, data: &str) -> Result<Vec<chunk::Frame>, Malformed>;

    /// The upstream's body ended: what the translation held for the end (a
    /// protocol whose stream has no end event of its own).
    fn on_end(&mut self) -> Vec<chunk::Frame> {
        Vec::new()
    }
}

/// What a request asks of a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// A chat completion.
    Chat,
    /// Embeddings.
    Embeddings,
    /// A prompt's token count (Anthropic's `messages/count_tokens`), never
    /// part of a walk.
    CountTokens,
}

impl Operation {
    /// GenAI's operation name: `chat`, `embeddings` or `count_tokens`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Chat => "chat",
            Operation::Embeddings => "embeddings",
            Operation::CountTokens => "count_tokens",
        }
    }
}

/// The URLs of a provider's operations (with its query parameters).
#[derive(Debug, Clone)]
pub struct Urls {
    /// `base_url`, without a trailing `/`, for the paths made per call
    /// ([`Adapter::call_path`]).
    pub base: String,
    /// The query string every call carries (encoded; a query key included).
    pub query: String,
    /// `{base_url}/{chat_path}?{query}`.
    pub chat: Uri,
    /// `{base_url}/{embeddings_path}?{query}`, if the protocol has embeddings.
    pub embeddings: Option<Uri>,
    /// `{base_url}/{count_tokens_path}?{query}`, if the protocol counts tokens.
    pub count_tokens: Option<Uri>,
    /// The chat URL of the provider's second API, for a client of its
    /// protocol ([`Endpoint::native`]).
    pub native: Option<Uri>,
}

impl Urls {
    /// `{base}/{path}` with the query string (after the path's own, if any).
    ///
    /// # Errors
    /// The result is not a URI (a model name with characters a path cannot hold).
    pub fn join(&self, path: &str) -> Result<Uri, http::uri::InvalidUri> {
        let sep = match (self.query.is_empty(), path.contains('?')) {
            (true, _) => "",
            (false, true) => "&",
            (false, false) => "?",
        };
        format!("{}/{path}{sep}{}", self.base, self.query).parse()
    }

    /// The URL of `op`, if the provider serves it.
    #[must_use]
    pub fn of(&self, op: Operation) -> Option<&Uri> {
        match op {
            Operation::Chat => Some(&self.chat),
            Operation::Embeddings => self.embeddings.as_ref(),
            Operation::CountTokens => self.count_tokens.as_ref(),
        }
    }
}

/// How one API key goes on a request: in a header (marked sensitive), or in
/// the query string (its own URLs, never logged).
#[derive(Clone)]
pub enum Credential {
    /// A header and its value.
    Header(HeaderName, HeaderValue),
    /// URLs with the key as a query parameter.
    Query(Box<Urls>),
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Header(name, _) => write!(f, "Header({name}: *****)"),
            Credential::Query(_) => f.write_str("Query(*****)"),
        }
    }
}

/// One request to send ([`Endpoint::send`]).
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// What it asks for.
    pub op: Operation,
    /// The target's model (in the URL, for some protocols).
    pub model: &'a str,
    /// The key it goes with, if the provider has one.
    pub credential: Option<&'a Credential>,
    /// The encoded body.
    pub body: Bytes,
    /// Sent as `x-request-id`.
    pub request_id: Option<&'a HeaderValue>,
    /// The client's headers, for those the protocol forwards.
    pub client: Option<&'a HeaderMap>,
    /// A streaming request.
    pub stream: bool,
    /// A chat request in the client's own protocol, for the provider's
    /// second API when it has one ([`Endpoint::native`]).
    pub native: bool,
    /// Counts a resend on a fresh connection after a stale pooled one
    /// failed (an upstream call the caller's tally must include).
    pub resends: &'a AtomicU32,
}

/// The `Host` of a plain-HTTP endpoint, made once: the pooled client would
/// otherwise format the same value into a new allocation for every request
/// (`host` or `host:port` for a port that is not 80, as it writes it). HTTPS
/// endpoints get none, so HTTP/2 (by ALPN) keeps its `:authority` alone.
#[must_use]
pub fn host_header(url: &Uri) -> Option<HeaderValue> {
    if url.scheme_str() != Some("http") {
        return None;
    }
    let host = url.host()?;
    let value = match url.port() {
        Some(port) if port.as_u16() != 80 => format!("{host}:{port}"),
        Some(_) | None => host.to_owned(),
    };
    HeaderValue::from_str(&value).ok()
}

/// Sent upstream with the request's id.
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// One provider's way in: URLs, headers, protocol and pooled client. The key
/// comes per request ([`Credential`]): a provider may hold several.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The wire protocol.
    pub adapter: &'static dyn Adapter,
    /// The provider's second API, if it has one, which serves the clients of
    /// its protocol (an `openai` provider with `responses: true`: the
    /// Responses API).
    pub native: Option<&'static dyn Adapter>,
    /// Where each operation goes (without a key in the query).
    pub urls: Urls,
    /// Sent on every call.
    pub headers: HeaderMap,
    /// Whether the host is a DNS name (to tell DNS failures from others).
    pub host_is_name: bool,
    /// Where the provider's identity comes from when it is not a key of the
    /// pool (a Google token, AWS SigV4).
    pub auth: Option<std::sync::Arc<auth::Auth>>,
    /// The pooled client.
    pub client: std::sync::Arc<pool::Pool>,
}

/// Why a request got no response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The upstream, or the road to it, failed: the error table judges it.
    #[error("upstream {}", .0.as_str())]
    Upstream(NetworkKind),
    /// switchyard itself ran out of something before the request left: no
    /// provider's failure, and no other target would fare better.
    #[error("{0}")]
    Local(LocalResource),
}

/// A resource of this process or host that ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LocalResource {
    /// `EMFILE` / `ENFILE`: the process's (or system's) descriptor limit.
    #[error("too many open files")]
    FileDescriptors,
    /// `EADDRNOTAVAIL` on connect: no free local port.
    #[error("no free local port")]
    Ports,
    /// `ENOMEM` / `ENOBUFS`: the kernel could not allocate a socket or buffer.
    #[error("out of memory for sockets")]
    Memory,
}

impl LocalResource {
    /// The resource an I/O error says ran out (errno values are Linux's).
    #[must_use]
    pub fn of(kind: std::io::ErrorKind, errno: Option<i32>) -> Option<Self> {
        const ENOMEM: i32 = 12;
        const ENFILE: i32 = 23;
        const EMFILE: i32 = 24;
        const EADDRNOTAVAIL: i32 = 99;
        const ENOBUFS: i32 = 105;
        match (kind, errno) {
            (_, Some(ENFILE | EMFILE)) => Some(LocalResource::FileDescriptors),
            (std::io::ErrorKind::AddrNotAvailable, _) | (_, Some(EADDRNOTAVAIL)) => {
                Some(LocalResource::Ports)
            }
            (std::io::ErrorKind::OutOfMemory, _) | (_, Some(ENOMEM | ENOBUFS)) => {
                Some(LocalResource::Memory)
            }
            _ => None,
        }
    }
}

impl Endpoint {
    /// The front-door protocol whose clients this provider serves as they
    /// speak, if any.
    #[must_use]
    pub fn native_protocol(&self) -> Option<Protocol> {
        self.native.unwrap_or(self.adapter).native()
    }

    /// The adapter of a call: the second API's for a client of its protocol.
    #[must_use]
    pub fn adapter_for(&self, native: bool) -> &'static dyn Adapter {
        match self.native {
            Some(adapter) if native => adapter,
            Some(_) | None => self.adapter,
        }
    }

    /// Sends one request: `POST` to its operation's URL with the
    /// provider's headers, the key, a JSON body, the request id and, for
    /// streams, `accept: text/event-stream`.
    ///
    /// # Errors
    /// No response head: the failure as a network kind (a protocol error for
    /// an operation the provider does not serve), or the local resource that
    /// ran out.
    pub async fn send(&self, out: Outgoing<'_>) -> Result<Response<pool::Body>, SendError> {
        let Outgoing {
            op,
            model,
            credential,
            body,
            request_id,
            client,
            stream,
            native,
            resends,
        } = out;
        let urls = match credential {
            Some(Credential::Query(urls)) => urls,
            Some(Credential::Header(..)) | None => &self.urls,
        };
        let adapter = self.adapter_for(native);
        let per_call = match adapter.call_path(op, model, stream) {
            Some(path) => Some(
                urls.join(&path)
                    .map_err(|_| SendError::Upstream(NetworkKind::Protocol))?,
            ),
            None => None,
        };
        let second = urls
            .native
            .as_ref()
            .filter(|_| native && op == Operation::Chat);
        let url = per_call
            .as_ref()
            .or(second)
            .or_else(|| urls.of(op))
            .ok_or(SendError::Upstream(NetworkKind::Protocol))?;
        let ready = match &self.auth {
            Some(auth) => Some(auth.ready().await.map_err(|e| {
                tracing::warn!(error = %e, "provider credentials unavailable");
                SendError::Upstream(NetworkKind::Connect)
            })?),
            None => None,
        };
        let build = || {
            let mut req = Request::new(Full::new(body.clone()));
            *req.method_mut() = Method::POST;
            *req.uri_mut() = url.clone();
            let h = req.headers_mut();
            // Sized for what follows, so the map is allocated once and never grows.
            h.reserve(self.headers.len() + 6);
            for (name, value) in &self.headers {
                h.append(name.clone(), value.clone());
            }
            if let Some(Credential::Header(name, value)) = credential {
                h.insert(name.clone(), value.clone());
            }
            h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            // Never ask for a coding we would have to undo on every request; a
            // provider's `headers` may ask for one switchyard decodes.
            if !h.contains_key(ACCEPT_ENCODING) {
                h.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
            }
            if let Some(id) = request_id {
                h.insert(X_REQUEST_ID, id.clone());
            }
            if let Some(client) = client {
                for name in adapter.forwarded_headers() {
                    if let Some(value) = client.get(name) {
                        h.insert(name.clone(), value.clone());
                    }
                }
            }
            if stream && adapter.framing() == Framing::Sse {
                h.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
            }
            // The attempt's span as the upstream's parent (tracing on only).
            crate::telemetry::inject(h);
            // Last: a signature covers every header set before it.
            if let (Some(auth), Some(ready)) = (&self.auth, &ready) {
                auth.apply(ready, &mut req, &body);
            }
            req
        };
        let (client, stream) = self.client.client();
        match pool::send(client, build, resends).await {
            Ok(response) => Ok(response.map(|incoming| pool::Body::new(incoming, stream))),
            Err(e) => Err(pool::request_error_kind(&e, self.host_is_name)),
        }
    }
}

/// What the engine reads of a whole answer: an answer it is (as its chat
/// reading would be), the model it names, and its token counts.
#[derive(Debug, PartialEq, Eq)]
pub struct AnswerFacts<'a> {
    /// The model the upstream says answered.
    pub model: Option<Cow<'a, str>>,
    /// Prompt and completion tokens, as the chat reading would count them.
    pub usage: (u64, u64),
}

/// An upstream stream as OpenAI chunk events: SSE framing, then (for a
/// protocol with its own events) translation event by event, so the commit
/// point, the relay and the end-of-stream verdict work alike for every
/// protocol.
#[derive(Debug)]
pub struct Events {
    decoder: decode::Decoder,
    framer: Framer,
    translator: Option<Box<dyn StreamTranslator>>,
    /// The client speaks this protocol: each upstream event rides on its
    /// first translation ([`crate::sse::Upstream`]).
    native: bool,
    ready: std::collections::VecDeque<crate::sse::Event>,
    /// Reads chat chunks that come as they are (no translator).
    chunks: crate::sse::ChunkReader,
    /// For a request of several choices, those finished so far.
    choices: Option<Choices>,
    /// The translator was told the body ended.
    ended: bool,
}

/// The choices of a several-choice stream (`n > 1`) that have finished: a
/// chunk that finishes one reads as a finish only once every one has, so a
/// stream cut after its first choice finished is not taken for a whole one.
#[derive(Debug)]
struct Choices {
    asked: usize,
    finished: std::collections::BTreeSet<u32>,
}

impl Choices {
    fn settle(&mut self, event: &mut crate::sse::Event) {
        let (Some(reading), Some(data)) = (event.reading, &event.data) else {
            return;
        };
        let (Chunk::Content { finished: true } | Chunk::NoContent { finished: true }) = reading
        else {
            return;
        };
        self.finished.extend(crate::sse::finished_choices(data));
        if self.finished.len() < self.asked {
            event.reading = Some(match reading {
                Chunk::Content { .. } => Chunk::Content { finished: false },
                Chunk::NoContent { .. } => Chunk::NoContent { finished: false },
                Chunk::Empty | Chunk::Done | Chunk::Error { .. } | Chunk::Malformed => reading,
            });
        }
    }
}

/// A stream's framing, read into events.
#[derive(Debug)]
enum Framer {
    Sse(crate::sse::Parser),
    Aws(eventstream::Frames),
}

impl Framer {
    fn push(&mut self, bytes: &[u8]) {
        match self {
            Framer::Sse(parser) => parser.push(bytes),
            Framer::Aws(frames) => frames.push(bytes),
        }
    }

    fn pending(&self) -> usize {
        match self {
            Framer::Sse(parser) => parser.pending(),
            Framer::Aws(frames) => frames.pending(),
        }
    }

    /// The next event: an SSE event as it came, or a binary message as an
    /// event with its tagged JSON for `data` (nothing raw to pass on).
    fn next_event(&mut self, eof: bool) -> Option<crate::sse::Event> {
        match self {
            Framer::Sse(parser) => parser.next_event(eof),
            Framer::Aws(frames) => {
                let (data, malformed) = match frames.next_message()? {
                    eventstream::Read::Message(data) => (Some(data), false),
                    eventstream::Read::Corrupt => (None, true),
                };
                Some(crate::sse::Event {
                    raw: Bytes::new(),
                    data,
                    malformed,
                    reading: None,
                    upstream: Upstream::Chat,
                })
            }
        }
    }
}

/// Most bytes one compressed read may decode to (the parser then bounds
/// each event at [`crate::sse::MAX_EVENT_BYTES`]).
const MAX_DECODED_READ: usize = 16 * 1024 * 1024;

impl Events {
    /// Events of a stream in `adapter`'s protocol whose body has `coding`,
    /// of `choices` choices; `native`: the client speaks that protocol, and
    /// gets its events.
    ///
    /// # Errors
    /// Only if a decoder cannot be set up.
    pub fn new(
        adapter: &dyn Adapter,
        model: &str,
        include_usage: bool,
        choices: u32,
        coding: decode::Coding,
        native: bool,
    ) -> std::io::Result<Self> {
        let translator = adapter.stream_translator(include_usage, model);
        let framer = match adapter.framing() {
            Framing::Sse => Framer::Sse(crate::sse::Parser::default()),
            Framing::AwsEventStream => Framer::Aws(eventstream::Frames::default()),
        };
        Ok(Self {
            decoder: decode::Decoder::new(coding, MAX_DECODED_READ, true)?,
            framer,
            native: native && translator.is_some(),
            translator,
            ready: std::collections::VecDeque::new(),
            chunks: crate::sse::ChunkReader::default(),
            choices: (choices > 1).then(|| Choices {
                asked: choices as usize,
                finished: std::collections::BTreeSet::new(),
            }),
            ended: false,
        })
    }

    /// Appends bytes read from the upstream (decoded first, if encoded).
    ///
    /// # Errors
    /// Corrupt encoded data, or one read that decodes to more than 16 MiB.
    pub fn push(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.decoder.is_identity() {
            self.framer.push(bytes);
            return Ok(());
        }
        let decoded = self.decoder.push(bytes)?;
        self.framer.push(&decoded);
        Ok(())
    }

    /// The body ended: what the decoder still held goes to the framer. A
    /// compressed body cut short keeps the events it had (the stream's own
    /// end, or its lack, is the verdict).
    pub fn finish(&mut self) {
        if self.decoder.is_identity() {
            return;
        }
        match self.decoder.finish_in_place() {
            Ok(last) => self.framer.push(&last),
            Err(e) => tracing::debug!(error = %e, "compressed stream ended short"),
        }
    }

    /// Bytes held that do not yet form a complete event.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.framer.pending()
    }

    /// Puts events back to be read first, in order (a continuation's events
    /// held at its commit point go through the same reading as the rest).
    pub fn requeue(&mut self, events: Vec<crate::sse::Event>) {
        for event in events.into_iter().rev() {
            self.ready.push_front(event);
        }
    }

    /// The next complete event, if any; `eof` closes a last unterminated one.
    /// Data a translator cannot read comes out as a malformed event.
    pub fn next_event(&mut self, eof: bool) -> Option<crate::sse::Event> {
        let mut event = self.read_event(eof)?;
        if let Some(choices) = &mut self.choices {
            choices.settle(&mut event);
        }
        Some(event)
    }

    fn read_event(&mut self, eof: bool) -> Option<crate::sse::Event> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(e);
            }
            let Some(mut event) = self.framer.next_event(eof) else {
                self.end_translation(eof);
                return self.ready.pop_front();
            };
            let Some(translator) = &mut self.translator else {
                // Chat chunks as they came: read here, once, for every reader.
                if let (false, Some(data)) = (event.malformed, &event.data) {
                    event.reading = Some(self.chunks.read(data));
                }
                return Some(event);
            };
            if event.malformed {
                return Some(event);
            }
            // Comments and `event:`-only lines carry nothing to translate.
            let Some(data) = event.data.as_deref() else {
                continue;
            };
            let Ok(frames) = translator.on_event(data) else {
                return Some(crate::sse::Event {
                    raw: Bytes::new(),
                    data: None,
                    malformed: true,
                    reading: None,
                    upstream: Upstream::Chat,
                });
            };
            let mut upstream = if self.native {
                Upstream::Event {
                    raw: event.raw,
                    data: event.data.unwrap_or_default(),
                }
            } else {
                Upstream::Chat
            };
            // An event read into nothing still goes to a client of its
            // protocol: as an event with nothing to read.
            if frames.is_empty() && self.native {
                self.ready.push_back(crate::sse::Event {
                    raw: Bytes::new(),
                    data: None,
                    malformed: false,
                    reading: Some(Chunk::Empty),
                    upstream,
                });
                continue;
            }
            for f in frames {
                let covered = if self.native {
                    Upstream::Covered
                } else {
                    Upstream::Chat
                };
                self.ready.push_back(crate::sse::Event {
                    data: Some(f.data().to_owned()),
                    raw: f.raw,
                    malformed: false,
                    reading: Some(f.reading),
                    upstream: std::mem::replace(&mut upstream, covered),
                });
            }
        }
    }
}

impl Events {
    /// At the body's end, once: the frames the translator held for it.
    fn end_translation(&mut self, eof: bool) {
        let Some(translator) = self.translator.as_mut().filter(|_| eof && !self.ended) else {
            return;
        };
        self.ended = true;
        let upstream = if self.native {
            Upstream::Covered
        } else {
            Upstream::Chat
        };
        for f in translator.on_end() {
            self.ready.push_back(crate::sse::Event {
                data: Some(f.data().to_owned()),
                raw: f.raw,
                malformed: false,
                reading: Some(f.reading),
                upstream: upstream.clone(),
            });
        }
    }
}

/// Asserts two readings of one stream event (a fast one and serde's) agree:
/// the same chunks, or both refuse it.
#[cfg(test)]
fn assert_same_reading<A: std::fmt::Debug, B: std::fmt::Debug>(
    event: &str,
    fast: Result<Vec<chunk::Frame>, A>,
    by_serde: Result<Vec<chunk::Frame>, B>,
) {
    match (fast, by_serde) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "{event}"),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("{event}: {a:?} against {b:?}"),
    }
}

/// Checks each adapter's [`AnswerFacts`] of a body against what the engine
/// reads of the body's chat reading (`Err`: the translation refuses it):
/// facts only where there is an answer, the same model and counts, and no
/// facts only where the answer has no counts. How many had facts.
#[cfg(test)]
fn facts_agree<E: std::fmt::Debug>(
    reads: impl IntoIterator<Item = (Option<AnswerFacts<'static>>, Result<Bytes, E>)>,
) -> usize {
    let mut with_facts = 0;
    for (facts, chat) in reads {
        let by_chat = chat.ok().and_then(|chat| {
            let read = crate::classify::read_answer(&chat);
            let model = read
                .model
                .and_then(|m| serde_json::from_str::<String>(m.get()).ok());
            let usage = read.usage.and_then(crate::sse::usage_of);
            (read.shape == crate::classify::AnswerShape::Completion).then_some((model, usage))
        });
        match (facts, by_chat) {
            (Some(facts), Some((model, usage))) => {
                assert_eq!(facts.model.as_deref(), model.as_deref());
                assert_eq!(Some(facts.usage), usage);
                with_facts += 1;
            }
            // No counts: only the chat reading (and the estimate) books it.
            (None, Some((_, usage))) => assert_eq!(usage, None),
            (None, None) => {}
            (Some(facts), None) => panic!("facts of a body with no chat reading: {facts:?}"),
        }
    }
    with_facts
}

#[cfg(test)]
mod tests {
    use super::LocalResource;
    use std::io::{Error, ErrorKind};

    fn of(e: &Error) -> Option<LocalResource> {
        LocalResource::of(e.kind(), e.raw_os_error())
    }

    #[test]
    fn only_this_hosts_own_shortages_are_local() {
        assert_eq!(
            of(&Error::from_raw_os_error(24)),
            Some(LocalResource::FileDescriptors)
        );
        assert_eq!(
            of(&Error::from_raw_os_error(23)),
            Some(LocalResource::FileDescriptors)
        );
        assert_eq!(
            of(&Error::from(ErrorKind::AddrNotAvailable)),
            Some(LocalResource::Ports)
        );
        assert_eq!(
            of(&Error::from_raw_os_error(105)),
            Some(LocalResource::Memory)
        );
        // The upstream's side of the road is the error table's to judge.
        for kind in [
            ErrorKind::ConnectionRefused,
            ErrorKind::ConnectionReset,
            ErrorKind::TimedOut,
        ] {
            assert_eq!(of(&Error::from(kind)), None, "{kind:?}");
        }
        assert_eq!(of(&Error::from_raw_os_error(111)), None, "ECONNREFUSED");
    }
}
