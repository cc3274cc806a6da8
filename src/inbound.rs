//! The front door's protocols: what a client that does not speak Chat
//! Completions sends, turned into the chat request the engine runs, and the
//! engine's answer, stream and errors rendered back in the client's protocol.
//!
//! Each protocol is one file ([`messages`]: Anthropic Messages; [`responses`]:
//! OpenAI Responses) with its wire types, its request translation and its
//! renderer. This file holds what they share: the chat shapes they read
//! ([`Completion`], [`Chunk`], [`WireError`]), the [`Finish`] reason, and the
//! rewriting of a response ([`render`]): a JSON answer or error read whole, a
//! stream translated event by event as hyper pulls it (the client hanging up
//! drops the relay beneath, as on the chat path).

pub mod count;
mod lenient;
pub mod messages;
pub mod responses;
mod store;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};

use crate::body::{self, Body};
use crate::native;
pub use crate::native::Protocol;
use crate::sse;
pub use store::ResponseStore;

/// A body the protocol's translation refuses: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct Invalid {
    /// The offending field's path (`messages[0].content[1].source`).
    pub param: String,
    /// What is wrong, in words.
    pub message: String,
    /// The error code, when the protocol has one for it.
    pub code: Option<&'static str>,
}

impl Invalid {
    fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: param.into(),
            message: message.into(),
            code: None,
        }
    }

    /// Reads a body as `T`, an error naming the path serde failed at (a
    /// missing field named too).
    fn parse<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, Self> {
        // The path is tracked only to name what failed: a well-formed body
        // (nearly every one) is read once, without it.
        // serde would read an array into the struct field by field (and
        // name the struct in its error).
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(Self::field("body", "the body must be a JSON object"));
        }
        if let Ok(parsed) = serde_json::from_slice(body) {
            return Ok(parsed);
        }
        let de = &mut serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(de).map_err(|e| {
            match e.inner().classify() {
                // Broken JSON names no field: the place in the body says where.
                serde_json::error::Category::Syntax
                | serde_json::error::Category::Eof
                | serde_json::error::Category::Io => {
                    return Self::field(
                        "body",
                        format!("the body is not valid JSON: {}", e.inner()),
                    );
                }
                serde_json::error::Category::Data => {}
            }
            let path = e.path().to_string();
            let message = e.inner().to_string();
            let missing = message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(str::to_owned);
            let param = match (path.as_str(), missing) {
                (".", Some(field)) => field,
                (_, Some(field)) => format!("{path}.{field}"),
                (".", None) => "body".to_owned(),
                (_, None) => path,
            };
            // serde's position is in the body, which the caller has.
            let message = message
                .split(" at line ")
                .next()
                .unwrap_or_default()
                .to_owned();
            Self::field(param, message)
        })
    }
}

/// A body's `model` (read raw, so that its place is known too) as text.
fn model_text(raw: Option<&serde_json::value::RawValue>) -> Result<Option<String>, Invalid> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    serde_json::from_str(raw.get()).map_err(|e| {
        // serde's position is in the field, which says nothing here.
        let message = e.to_string();
        Invalid::field(
            "model",
            message.split(" at line ").next().unwrap_or_default(),
        )
    })
}

/// The chat request a front door's request becomes (typed: the compiler
/// checks its shape, and no `Value` tree is built for its top level). It is
/// written out only when something reads it ([`native::Translation`]).
#[derive(Debug, Default, Serialize)]
struct ChatBody {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    messages: ChatMessages,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<String>,
}

impl ChatBody {
    /// Its JSON text.
    fn to_bytes(&self) -> Bytes {
        // Writing these types cannot fail: string keys, and numbers as serde
        // read them from JSON (never a NaN).
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// What routing reads of it: what [`crate::request::ChatRequest`]
    /// would read of its JSON text, without writing it.
    fn facts(&self) -> native::Facts<'static> {
        let (prompt_tokens, images) =
            crate::request::estimate_values(self.messages.iter(), self.tools.as_deref());
        let json_mode = self
            .response_format
            .as_ref()
            .is_some_and(|f| matches!(f["type"].as_str(), Some("json_object" | "json_schema")));
        native::Facts {
            model: self.model.clone().map(Into::into),
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            // Neither Messages nor Responses asks for several answers.
            choices: 1,
            max_tokens: self.max_tokens,
            tools: self.tools.as_ref().is_some_and(|t| !t.is_empty()),
            json_mode,
            json_native: false,
            images,
            prompt_tokens,
        }
    }

    /// Its facts, and the translation that writes it when first read.
    fn deferred(self) -> (native::Facts<'static>, native::Translation) {
        (
            self.facts(),
            native::Translation::deferred(move || self.to_bytes()),
        )
    }
}

/// A chat request's messages: a leading one of its own (a system message),
/// then turns it may share with what keeps the conversation.
#[derive(Debug, Default)]
struct ChatMessages {
    head: Option<serde_json::Value>,
    turns: std::sync::Arc<Vec<serde_json::Value>>,
}

impl ChatMessages {
    /// `turns`, alone.
    fn of(turns: Vec<serde_json::Value>) -> Self {
        Self {
            head: None,
            turns: std::sync::Arc::new(turns),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &serde_json::Value> {
        self.head.iter().chain(self.turns.iter())
    }
}

impl Serialize for ChatMessages {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

#[derive(Debug, Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// A request translated for the engine, and what rendering its answer needs.
#[derive(Debug)]
pub struct Translated {
    /// The Chat Completions request the engine runs, written when read.
    pub chat: native::Translation,
    /// What routing reads of it.
    pub facts: native::Facts<'static>,
    /// The body a target of the client's own protocol gets, when it is not
    /// the client's as sent.
    pub native: Option<Bytes>,
    /// Where that body's `model` is.
    pub model_at: native::ModelAt,
    /// How the answer goes back.
    pub render: Render,
    /// The client asked for a stream.
    pub stream: bool,
    /// What the chat translation had to leave out, if anything: only a
    /// target of the client's protocol can serve the request (the others
    /// are skipped, reason `protocol`).
    pub untranslatable: Option<native::Untranslatable>,
}

/// How an answer goes back to the client, per protocol.
#[derive(Debug)]
pub enum Render {
    /// Anthropic Messages.
    Messages(messages::Reply),
    /// OpenAI Responses.
    Responses(responses::Reply),
    /// A stream whose renderer went to the engine ([`Render::take_stream`]):
    /// only an error is left to render here.
    Stream(Protocol),
}

impl Render {
    /// The stream renderer, for the relay to run on the events it parses;
    /// what stays renders errors.
    pub fn take_stream(&mut self) -> Option<Box<dyn native::StreamRender>> {
        let protocol = match self {
            Render::Messages(_) => Protocol::Messages,
            Render::Responses(_) => Protocol::Responses,
            Render::Stream(_) => return None,
        };
        match std::mem::replace(self, Render::Stream(protocol)) {
            Render::Messages(r) => Some(Box::new(Renderer::Messages(r.stream()))),
            Render::Responses(r) => Some(Box::new(Renderer::Responses(Box::new(r.stream())))),
            Render::Stream(_) => None,
        }
    }
}

/// Renders the engine's response in the client's protocol: an answer or an
/// error whole (a committed stream was rendered event by event by the relay,
/// [`Render::take_stream`]). Status and headers (`Retry-After`,
/// `x-should-retry`, `x-switchyard-*`) are kept.
pub async fn render(response: Response<Body>, render: Render) -> Response<Body> {
    let (mut parts, inner) = response.into_parts();
    parts.headers.remove(CONTENT_LENGTH);
    let is_stream = parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    // A stream went through the relay, which ran the client's renderer
    // (the server hands every stream request's renderer to the engine).
    if is_stream && parts.status == StatusCode::OK {
        return Response::from_parts(parts, inner);
    }
    let bytes = match inner.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    let native = parts.extensions.remove::<native::Answer>();
    let ok = parts.status == StatusCode::OK;
    let out = match (render, ok, native) {
        // The answer as its Messages target sent it.
        (Render::Messages(_), true, Some(native)) => native.0,
        (Render::Messages(r), true, None) => r.answer(&bytes),
        (Render::Messages(_), false, _) => messages::error(parts.status, &bytes),
        (Render::Responses(mut r), true, Some(native)) => r.native_answer(native.0),
        (Render::Responses(r), true, None) => r.answer(&bytes),
        // Responses errors are OpenAI's envelope already.
        (Render::Responses(_) | Render::Stream(Protocol::Chat | Protocol::Responses), false, _) => {
            bytes
        }
        (Render::Stream(Protocol::Messages), false, _) => messages::error(parts.status, &bytes),
        // A stream request answered whole: never, as the engine answers one.
        (Render::Stream(_), true, _) => bytes,
    };
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, body::full(out))
}

/// A stream renderer of one protocol.
#[derive(Debug)]
enum Renderer {
    Messages(messages::StreamReply),
    Responses(Box<responses::StreamReply>),
}

impl native::StreamRender for Renderer {
    /// One event of the chat stream, rendered into `out`; an upstream event
    /// it carries goes out as it came instead.
    fn event(&mut self, event: &sse::Event, out: &mut BytesMut) {
        match &event.upstream {
            sse::Upstream::Event { raw, data } => {
                return match self {
                    Renderer::Messages(r) => r.native(data, raw, out),
                    Renderer::Responses(r) => r.native(data, raw, out),
                }
            }
            sse::Upstream::Covered => return,
            sse::Upstream::Chat => {}
        }
        let Some(data) = event.data.as_deref() else {
            return;
        };
        if data.trim() == "[DONE]" {
            return self.done(out);
        }
        // Only an error envelope names "error" (a chunk's text may too).
        let error = data
            .contains("\"error\"")
            .then(|| serde_json::from_str::<ErrorEnvelope>(data).ok())
            .flatten();
        if let Some(error) = error {
            match self {
                Renderer::Messages(r) => r.error(&error.error, out),
                Renderer::Responses(r) => r.error(&error.error, out),
            }
            return;
        }
        // What is not a chunk (a keep-alive, a stray line) has nothing to say.
        if let Ok(chunk) = serde_json::from_str::<Chunk>(data) {
            match self {
                Renderer::Messages(r) => r.chunk(&chunk, out),
                Renderer::Responses(r) => r.chunk(&chunk, out),
            }
        }
    }

    /// `[DONE]`, or the end of the chat stream without it.
    fn done(&mut self, out: &mut BytesMut) {
        match self {
            Renderer::Messages(r) => r.done(out),
            Renderer::Responses(r) => r.done(out),
        }
    }

    fn prompt_estimate(&mut self, tokens: u64) {
        match self {
            Renderer::Messages(r) => r.prompt_estimate = tokens,
            Renderer::Responses(_) => {}
        }
    }
}

/// One server-sent event, `event:` line and JSON data, appended to `out`.
fn write_event(out: &mut BytesMut, name: &str, data: &serde_json::Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Why an answer ended, as the chat protocol says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
}

impl Finish {
    fn of(reason: Option<&str>) -> Option<Self> {
        match reason? {
            "length" => Some(Finish::Length),
            "tool_calls" | "function_call" => Some(Finish::ToolCalls),
            "content_filter" => Some(Finish::ContentFilter),
            // `stop`, and what a server calls its own normal end (`eos`).
            _ => Some(Finish::Stop),
        }
    }
}

// What the renderers read of a chat answer. The engine accepted it already
// (`classify`): a field that only describes it reads as absent when it is
// of an odd type (`lenient`), rather than leave the client an empty answer.

/// A chat completion, as far as the renderers read it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Completion {
    #[serde(deserialize_with = "lenient::text_or_empty")]
    id: String,
    #[serde(deserialize_with = "lenient::text_or_empty")]
    model: String,
    #[serde(deserialize_with = "lenient::count")]
    created: Option<u64>,
    choices: Vec<Choice>,
    #[serde(deserialize_with = "usage")]
    usage: Option<Usage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Choice {
    message: AnswerMessage,
    #[serde(deserialize_with = "lenient::text")]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct AnswerMessage {
    #[serde(deserialize_with = "lenient::content")]
    content: Option<String>,
    /// The reasoning text some servers add (DeepSeek, vLLM, sglang).
    #[serde(deserialize_with = "lenient::text")]
    reasoning_content: Option<String>,
    /// The same, as newer vLLM and OpenRouter name it.
    #[serde(deserialize_with = "lenient::text")]
    reasoning: Option<String>,
    #[serde(deserialize_with = "lenient::text")]
    refusal: Option<String>,
    #[serde(deserialize_with = "lenient::list")]
    tool_calls: Vec<ToolCall>,
}

impl AnswerMessage {
    /// The reasoning text, under either name (a server that sends both sends
    /// the same text twice).
    fn reasoning(&self) -> Option<&str> {
        reasoning(self.reasoning_content.as_deref(), self.reasoning.as_deref())
    }
}

/// `reasoning_content`, else `reasoning`, when not empty.
fn reasoning<'a>(content: Option<&'a str>, named: Option<&'a str>) -> Option<&'a str> {
    content
        .filter(|t| !t.is_empty())
        .or(named.filter(|t| !t.is_empty()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ToolCall {
    /// Empty when the server gave none: the renderer makes one.
    #[serde(deserialize_with = "lenient::text_or_empty")]
    id: String,
    function: Function,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Function {
    #[serde(deserialize_with = "lenient::text_or_empty")]
    name: String,
    #[serde(deserialize_with = "arguments_or_empty")]
    arguments: String,
}

fn arguments_or_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    lenient::arguments(d).map(Option::unwrap_or_default)
}

/// A tool call delta's `index` (some servers write it as a string).
fn tool_index<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let index = lenient::count(d)?.unwrap_or(0);
    Ok(u32::try_from(index).unwrap_or(u32::MAX))
}

/// `usage`, `None` when it is not an object of counts.
fn usage<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Usage>, D::Error> {
    Ok(Usage::deserialize(serde_json::Value::deserialize(d)?).ok())
}

/// Token counts, as chat reports them.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(default)]
struct Usage {
    #[serde(deserialize_with = "lenient::count_or_zero")]
    prompt_tokens: u64,
    #[serde(deserialize_with = "lenient::count_or_zero")]
    completion_tokens: u64,
    prompt_tokens_details: Option<PromptDetails>,
    completion_tokens_details: Option<CompletionDetails>,
}

impl Usage {
    fn cached(&self) -> u64 {
        self.prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }

    fn reasoning(&self) -> u64 {
        self.completion_tokens_details
            .and_then(|d| d.reasoning_tokens)
            .unwrap_or(0)
    }
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(default)]
struct PromptDetails {
    #[serde(deserialize_with = "lenient::count")]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(default)]
struct CompletionDetails {
    #[serde(deserialize_with = "lenient::count")]
    reasoning_tokens: Option<u64>,
}

/// One `chat.completion.chunk`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Chunk {
    #[serde(deserialize_with = "lenient::text_or_empty")]
    id: String,
    #[serde(deserialize_with = "lenient::text_or_empty")]
    model: String,
    #[serde(deserialize_with = "lenient::null_as_empty")]
    choices: Vec<ChunkChoice>,
    #[serde(deserialize_with = "usage")]
    usage: Option<Usage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ChunkChoice {
    index: u32,
    delta: Delta,
    #[serde(deserialize_with = "lenient::text")]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Delta {
    #[serde(deserialize_with = "lenient::content")]
    content: Option<String>,
    #[serde(deserialize_with = "lenient::text")]
    reasoning_content: Option<String>,
    #[serde(deserialize_with = "lenient::text")]
    reasoning: Option<String>,
    #[serde(deserialize_with = "lenient::text")]
    refusal: Option<String>,
    #[serde(deserialize_with = "lenient::list")]
    tool_calls: Vec<ToolCallDelta>,
}

impl Delta {
    /// The reasoning text, under either name.
    fn reasoning(&self) -> Option<&str> {
        reasoning(self.reasoning_content.as_deref(), self.reasoning.as_deref())
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ToolCallDelta {
    #[serde(deserialize_with = "tool_index")]
    index: u32,
    #[serde(deserialize_with = "lenient::text")]
    id: Option<String>,
    function: FunctionDelta,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FunctionDelta {
    #[serde(deserialize_with = "lenient::text")]
    name: Option<String>,
    #[serde(deserialize_with = "lenient::arguments")]
    arguments: Option<String>,
}

/// `{"error": {...}}`: an error body, or an error event in a stream.
#[derive(Debug, Deserialize)]
struct ErrorEnvelope {
    error: WireError,
}

/// OpenAI's error object.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireError {
    message: String,
    #[serde(rename = "type")]
    kind: Option<String>,
    code: Option<serde_json::Value>,
    /// The status of an upstream error that broke a stream
    /// ([`crate::sse::interrupt_events`]).
    status: Option<u16>,
}

impl WireError {
    /// The `code`, when it is a string.
    fn code(&self) -> Option<&str> {
        self.code.as_ref().and_then(serde_json::Value::as_str)
    }
}

/// A fresh id with `prefix`: 24 random hex digits, as the providers' ids look.
fn fresh_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Probe {
        #[allow(dead_code)]
        max_tokens: u64,
        #[allow(dead_code)]
        messages: Vec<ProbeMessage>,
    }
    #[derive(Debug, Deserialize)]
    struct ProbeMessage {
        #[allow(dead_code)]
        role: String,
    }

    #[test]
    fn a_refusal_names_the_field_even_when_it_is_missing() {
        let e = Invalid::parse::<Probe>(br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param, "max_tokens");
        let e = Invalid::parse::<Probe>(br#"{"max_tokens":1,"messages":[{}]}"#).unwrap_err();
        assert_eq!(e.param, "messages[0].role");
        let e = Invalid::parse::<Probe>(br#"{"max_tokens":"x","messages":[]}"#).unwrap_err();
        assert_eq!(e.param, "max_tokens");
        assert!(e.message.contains("expected u64"), "{}", e.message);
        let e = Invalid::parse::<Probe>(b"[1]").unwrap_err();
        assert_eq!(e.param, "body");
    }

    /// Requests of both front doors, in the shapes their translations take.
    const MESSAGES: [&str; 5] = [
        r#"{"model":"claude-x","max_tokens":64,"messages":[{"role":"user","content":"hello there"}]}"#,
        r#"{"model":"claude-x","max_tokens":9,"stream":true,"system":[{"type":"text","text":"Be brief."}],
            "messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},
            {"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}}]},
            {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"look","input":{"q":"x"}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a cat"}]}],
            "tools":[{"name":"look","description":"Looks.","input_schema":{"type":"object","properties":{"q":{"type":"string"}}}}]}"#,
        r#"{"max_tokens":1,"messages":[{"role":"user","content":"no model"}],"tools":[]}"#,
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"news?"}],
            "tools":[{"type":"web_search_20250305","name":"web_search"}]}"#,
        r#"{"model":"m","max_tokens":10,"messages":[{"role":"user","content":"write it"},
            {"role":"assistant","content":[{"type":"tool_use","id":"w1","name":"write",
            "input":{"path":"a.rs","code":"fn main() {\n    println!(\"say \\\"hi\\\"\");\n}\n"}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"w1","content":"ok"}]}],
            "tools":[{"name":"write","description":"Writes a file.\nLine two: \"quoted\".",
            "input_schema":{"type":"object","properties":{"code":{"type":"string"}}}}]}"#,
    ];
    const RESPONSES: [&str; 3] = [
        r#"{"model":"gpt-x","input":"hello there"}"#,
        r#"{"model":"gpt-x","stream":true,"instructions":"Be brief.","max_output_tokens":40,
            "input":[{"role":"user","content":[{"type":"input_text","text":"what is this?"},
            {"type":"input_image","image_url":"https://example.com/a.png"}]},
            {"type":"function_call","call_id":"c1","name":"look","arguments":"{\"q\":\"x\"}"},
            {"type":"function_call_output","call_id":"c1","output":"a cat"}],
            "tools":[{"type":"function","name":"look","parameters":{"type":"object"}}],
            "text":{"format":{"type":"json_object"}}}"#,
        r#"{"input":"no model","text":{"format":{"type":"text"}}}"#,
    ];

    #[test]
    fn the_facts_read_are_what_the_written_translation_reads() {
        let store = ResponseStore::default();
        let translations = MESSAGES
            .iter()
            .map(|body| messages::translate(body.as_bytes()).unwrap())
            .chain(
                RESPONSES
                    .iter()
                    .map(|body| responses::translate(body.as_bytes(), &store).unwrap()),
            );
        for t in translations {
            let view = crate::request::ChatRequest::parse(t.chat.bytes()).unwrap();
            let read = view.facts();
            let estimate = (t.facts.prompt_tokens, read.prompt_tokens);
            assert_eq!(
                native::Facts {
                    prompt_tokens: 0,
                    ..t.facts.reborrow()
                },
                native::Facts {
                    prompt_tokens: 0,
                    ..read
                },
                "{:?}",
                t.chat.bytes()
            );
            // The same estimate: routing decides alike at every door.
            assert_eq!(estimate.0, estimate.1, "{:?}", t.chat.bytes());
        }
    }

    #[test]
    fn fresh_ids_are_distinct_and_prefixed() {
        let (a, b) = (fresh_id("msg_"), fresh_id("msg_"));
        assert_ne!(a, b);
        assert!(a.starts_with("msg_") && a.len() == 28, "{a}");
    }
}
