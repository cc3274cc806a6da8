//! The chat request as the gateway reads it: a typed view parsed once from
//! the request bytes, borrowing from them.
//!
//! Routing, the token estimate, the tool call contract and the protocol
//! adapters read this view, never a JSON tree. The bytes themselves are kept
//! for forwarding: an OpenAI-compatible target gets them as the client sent
//! them, with only `model` rewritten in place ([`ChatRequest::with_model`]).

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::native::{self, Facts, ModelAt};
use crate::tokens;

mod embeddings;
pub use embeddings::{as_base64, EmbeddingsRequest};

/// Why a body is not a request the gateway can take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The offending field, for OpenAI's `error.param`: a top-level name
    /// (`stream`) or a path into the messages (`messages[2].role`).
    pub param: Option<Cow<'static, str>>,
    /// What is wrong, in words.
    pub message: String,
}

impl RequestError {
    fn field(param: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            message: message.into(),
        }
    }
}

/// The top level as raw values: each field the gateway reads is parsed on its
/// own below, so an error names its field.
#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct Wire<'a> {
    /// Kept even when `null`: its bytes are what [`ChatRequest::with_model`]
    /// replaces, or the forwarded body would hold `model` twice.
    #[serde(borrow, default, deserialize_with = "raw_even_null")]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    functions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_choice: Option<&'a RawValue>,
    #[serde(borrow, default)]
    function_call: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response_format: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
}

/// One message, as far as the gateway reads it.
#[derive(Debug)]
pub struct Message<'a> {
    /// `system`, `developer`, `user`, `assistant`, `tool` (or whatever string
    /// the client sent: the upstream judges roles it does not know).
    pub role: Cow<'a, str>,
    /// The content, raw (a string, an array of parts, or null).
    pub content: Option<&'a RawValue>,
    /// An assistant turn's tool calls, raw.
    pub tool_calls: Option<&'a RawValue>,
    /// The author name, when it is a string.
    pub name: Option<Cow<'a, str>>,
}

/// One message as raw values, so a wrong type names its field.
#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct WireMessage<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
}

/// A content part, as far as the gateway reads it.
#[derive(Debug, Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// Content part types that carry an image.
const IMAGE_PARTS: [&str; 3] = ["image_url", "image", "input_image"];

/// The parsed view of one chat request.
#[derive(Debug)]
pub struct ChatRequest<'a> {
    body: &'a [u8],
    /// `model`, if given.
    pub model: Option<Cow<'a, str>>,
    /// Byte range of `model`'s value (quotes included) in the body.
    model_span: Option<Range<usize>>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `n`: how many choices (1 when not given).
    pub choices: u32,
    /// The messages (at least one).
    pub messages: Vec<Message<'a>>,
    /// `tools`, raw.
    pub tools: Option<&'a RawValue>,
    /// Legacy `functions`, raw.
    pub functions: Option<&'a RawValue>,
    /// `tool_choice`, raw.
    pub tool_choice: Option<&'a RawValue>,
    /// Legacy `function_call`, raw.
    pub function_call: Option<&'a RawValue>,
    /// `response_format` asks for JSON (`json_object` or `json_schema`).
    pub json_mode: bool,
    /// `response_format` as sent (the contract reads its schema).
    pub response_format: Option<&'a RawValue>,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    /// Some message has an image part.
    pub images: bool,
    /// Estimated prompt tokens ([`crate::tokens`]).
    pub prompt_tokens: u64,
}

impl<'a> ChatRequest<'a> {
    /// Parses a request body, refusing what cannot be a chat request: a body
    /// that is not a JSON object; `messages` missing, not an array, empty, or
    /// with an entry that is not an object or has no string `role`; `model`
    /// not a string; `stream` not a boolean; `max_tokens` /
    /// `max_completion_tokens` not a non-negative integer. A `null` field
    /// counts as absent, as in OpenAI's API.
    ///
    /// # Errors
    /// The first such problem, naming its field.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        let wire: Wire<'a> = object(body)?;
        let model = model(wire.model)?;
        let stream = match wire.stream {
            None => false,
            Some(raw) => serde_json::from_str::<bool>(raw.get())
                .map_err(|_| RequestError::field("stream", "`stream` must be a boolean"))?,
        };
        let messages = messages(wire.messages)?;
        let max_completion_tokens =
            token_limit(wire.max_completion_tokens, "max_completion_tokens")?;
        let max_tokens = token_limit(wire.max_tokens, "max_tokens")?;
        let choices = choices(wire.n)?;
        let mut request = Self {
            body,
            model,
            model_span: wire.model.and_then(|raw| span_in(body, raw)),
            stream,
            include_usage: wire.stream_options.is_some_and(include_usage),
            choices,
            images: messages.iter().any(has_image),
            messages,
            tools: wire.tools,
            functions: wire.functions,
            tool_choice: wire.tool_choice,
            function_call: wire.function_call,
            json_mode: wire.response_format.is_some_and(asks_for_json),
            response_format: wire.response_format,
            max_tokens: max_completion_tokens.or(max_tokens),
            prompt_tokens: 0,
        };
        request.prompt_tokens = request.estimate_prompt_tokens();
        request.tool_choice_has_tools()?;
        Ok(request)
    }

    /// A `tool_choice` that demands a call (`required`, a named function)
    /// needs tools to call: no answer could keep it.
    fn tool_choice_has_tools(&self) -> Result<(), RequestError> {
        let Some(choice) = self.tool_choice else {
            return Ok(());
        };
        let demands_a_call = match choice.get().trim() {
            "null" | "\"auto\"" | "\"none\"" => false,
            // "required", or an object naming a function (or allowed tools).
            _ => true,
        };
        if demands_a_call && !self.offers_tools() {
            return Err(RequestError::field(
                "tool_choice",
                "`tool_choice` asks for a tool call but the request has no `tools`",
            ));
        }
        Ok(())
    }

    /// The request's bytes, as the client sent them.
    #[must_use]
    pub fn body(&self) -> &'a [u8] {
        self.body
    }

    /// What routing reads of it.
    #[must_use]
    pub fn facts(&self) -> Facts<'_> {
        Facts {
            model: self.model.as_deref().map(Cow::Borrowed),
            stream: self.stream,
            include_usage: self.include_usage,
            choices: self.choices,
            max_tokens: self.max_tokens,
            tools: self.offers_tools(),
            json_mode: self.json_mode,
            json_native: false,
            images: self.images,
            prompt_tokens: self.prompt_tokens,
        }
    }

    /// The body with `model` set to `model`: the client's bytes with only that
    /// value replaced (or the key added first when the client sent none).
    #[must_use]
    pub fn with_model(&self, model: &str) -> Bytes {
        with_model(self.body, self.model_span.as_ref(), model)
    }

    /// Whether the request offers tools (`tools` or legacy `functions`, non-empty).
    #[must_use]
    pub fn offers_tools(&self) -> bool {
        self.tools.is_some_and(non_empty) || self.functions.is_some_and(non_empty)
    }

    /// The whole body as a JSON object, for adapters that rebuild the request
    /// in another protocol.
    ///
    /// # Errors
    /// Never for a body that [`ChatRequest::parse`] accepted.
    pub fn to_object(
        &self,
    ) -> Result<serde_json::Map<String, serde_json::Value>, serde_json::Error> {
        serde_json::from_slice(self.body)
    }

    /// Prompt tokens: every message's text parts, images, tool calls and
    /// names, and the `tools` definitions, plus per-message framing.
    fn estimate_prompt_tokens(&self) -> u64 {
        let mut total = tokens::REPLY_PRIMING;
        for m in &self.messages {
            total += tokens::PER_MESSAGE + content_tokens(m.content);
            if let Some(calls) = m.tool_calls {
                total += tokens::estimate_text(calls.get());
            }
            if let Some(name) = &m.name {
                total += tokens::estimate_text(name);
            }
        }
        for defs in [self.tools, self.functions].into_iter().flatten() {
            total += tokens::estimate_text(defs.get());
        }
        total
    }
}

/// A chat request as the walk reads it: routing's facts at once, and the
/// typed view of its chat body when something reads that. A chat client's
/// view is read at once; a request in another protocol has its chat
/// translation written only when a target of another protocol is tried, or
/// the contract, the cache, a repair or continuation reads it.
#[derive(Debug)]
pub struct Prompt<'a> {
    /// What routing reads.
    pub facts: Facts<'a>,
    /// The client's own body, when it spoke another protocol.
    pub native: Option<native::Request<'a>>,
    /// Where its chat body comes from.
    source: Source<'a>,
}

/// The prompt estimate and whether an image is in it, for chat `messages`
/// and `tools` not yet written out (a front door's translation): what
/// [`ChatRequest`]'s estimate reads of their JSON text once written. Text
/// and parts are read from the values as that reading reads them; tool
/// calls and tool definitions, which it estimates as JSON text, are written
/// for it (only a request that has them pays).
#[must_use]
pub fn estimate_values<'v>(
    messages: impl IntoIterator<Item = &'v serde_json::Value>,
    tools: Option<&[serde_json::Value]>,
) -> (u64, bool) {
    use serde_json::Value;
    let mut total = tokens::REPLY_PRIMING;
    let mut images = false;
    for m in messages {
        total += tokens::PER_MESSAGE;
        match &m["content"] {
            Value::String(text) => total += tokens::estimate_text(text),
            Value::Array(parts) => {
                for part in parts {
                    let kind = part["type"].as_str().unwrap_or_default();
                    if IMAGE_PARTS.contains(&kind) {
                        images = true;
                        total += tokens::PER_IMAGE;
                    } else {
                        total += part["text"].as_str().map_or(0, tokens::estimate_text);
                    }
                }
            }
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => {}
        }
        if let Some(calls) = m.get("tool_calls") {
            total += json_tokens(calls);
        }
        if let Some(name) = m.get("name").and_then(Value::as_str) {
            total += tokens::estimate_text(name);
        }
    }
    total += tools.map_or(0, json_tokens);
    (total, images)
}

/// Estimated tokens of `value` written as compact JSON, as a chat body
/// writes it.
fn json_tokens<T: serde::Serialize + ?Sized>(value: &T) -> u64 {
    // Writing JSON values into a String cannot fail.
    tokens::estimate_text(&serde_json::to_string(value).unwrap_or_default())
}

/// Where a [`Prompt`]'s chat body comes from.
#[derive(Debug)]
enum Source<'a> {
    /// The chat client's own, and its view.
    Chat(&'a Bytes, ChatRequest<'a>),
    /// Another protocol's request's translation.
    Native(&'a native::Translation),
}

impl<'a> Prompt<'a> {
    /// A chat request, `view` read already from `body`.
    #[must_use]
    pub fn chat(view: ChatRequest<'a>, body: &'a Bytes) -> Self {
        Self {
            facts: Facts {
                model: view.model.clone(),
                ..view.facts()
            },
            native: None,
            source: Source::Chat(body, view),
        }
    }

    /// A request in another protocol, `body`, its chat translation unwritten.
    #[must_use]
    pub fn native(body: &'a native::Body) -> Self {
        Self {
            facts: body.facts.reborrow(),
            native: Some(body.request()),
            source: Source::Native(&body.chat),
        }
    }

    /// The chat body: the client's, or its translation (written now if it
    /// was not yet).
    #[must_use]
    pub fn bytes(&self) -> &'a Bytes {
        match &self.source {
            Source::Chat(body, _) => body,
            Source::Native(translation) => translation.bytes(),
        }
    }

    /// `read` on the typed view of the chat body: a chat client's, or its
    /// translation written and read now (read again on each call: only a
    /// target of another protocol, the contract and continuation ask, rarely
    /// more than once a request). `None` if the translation does not read as
    /// a chat request, which no front door writes.
    pub fn read<R>(&self, read: impl FnOnce(&ChatRequest<'_>) -> R) -> Option<R> {
        match &self.source {
            Source::Chat(_, view) => Some(read(view)),
            Source::Native(translation) => ChatRequest::parse(translation.bytes())
                .ok()
                .map(|view| read(&view)),
        }
    }
}

/// A string as a JSON string literal: as is between quotes when it needs no
/// escape (model names never do), else serialised.
enum Quoted<'a> {
    Plain(&'a str),
    Escaped(String),
}

impl<'a> Quoted<'a> {
    fn of(text: &'a str) -> Self {
        let plain = text
            .bytes()
            .all(|b| (0x20..0x80).contains(&b) && b != b'"' && b != b'\\');
        if plain {
            Self::Plain(text)
        } else {
            Self::Escaped(serde_json::Value::from(text).to_string())
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Plain(text) => text.len() + 2,
            Self::Escaped(json) => json.len(),
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Self::Plain(text) => {
                out.push(b'"');
                out.extend_from_slice(text.as_bytes());
                out.push(b'"');
            }
            Self::Escaped(json) => out.extend_from_slice(json.as_bytes()),
        }
    }
}

/// Keeps a parsed string borrowed when its JSON text had no escapes.
fn borrow_if_plain<'a>(raw: &'a RawValue, parsed: Cow<'a, str>) -> Cow<'a, str> {
    let text = raw.get();
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if inner == parsed => Cow::Borrowed(inner),
        _ => parsed,
    }
}

/// A present field as its raw value, `null` included (serde's `Option`
/// would read `null` as absent).
///
/// # Errors
/// As serde's for a JSON value.
pub fn raw_even_null<'de, D>(d: D) -> Result<Option<&'de RawValue>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    <&'de RawValue>::deserialize(d).map(Some)
}

/// Reads `body` as a JSON object into `T`.
fn object<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RequestError> {
    let not_object = |detail: String| RequestError {
        param: None,
        message: format!("body is not a JSON object: {detail}"),
    };
    // serde would read a JSON array into the struct field by field.
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => return Err(not_object("it does not start with `{`".into())),
        None => return Err(not_object("it is empty".into())),
    }
    serde_json::from_slice(body).map_err(|e| not_object(e.to_string()))
}

/// `model`: a string, or absent (`null` counts as absent).
fn model(raw: Option<&RawValue>) -> Result<Option<Cow<'_, str>>, RequestError> {
    match raw.filter(|raw| raw.get() != "null") {
        None => Ok(None),
        Some(raw) => string(raw)
            .map(Some)
            .ok_or_else(|| RequestError::field("model", "`model` must be a string")),
    }
}

/// Any JSON object `body` with its top-level `model` set to `model`, only
/// that value replaced (the key added first when it has none); `None` when
/// `body` is not a JSON object.
#[must_use]
pub fn object_with_model(body: &[u8], model: &str) -> Option<Bytes> {
    #[derive(serde::Deserialize)]
    struct Model<'a> {
        // `null` kept: replaced, not written beside a second `model`.
        #[serde(borrow, default, deserialize_with = "raw_even_null")]
        model: Option<&'a RawValue>,
    }
    let found: Model<'_> = serde_json::from_slice(body).ok()?;
    let span = found.model.and_then(|raw| span_in(body, raw));
    Some(with_model(body, span.as_ref(), model))
}

/// [`object_with_model`] for a body whose `model` a reader found already
/// (a front door's): `body` must then have a field beside `model`.
#[must_use]
pub fn object_with_model_at(body: &[u8], at: &ModelAt, model: &str) -> Option<Bytes> {
    match at {
        ModelAt::Unread => object_with_model(body, model),
        ModelAt::Absent => Some(with_model(body, None, model)),
        ModelAt::At(span) => Some(with_model(body, Some(span), model)),
    }
}

/// Where `raw`, a body's `model` as read by a reader that keeps `null`
/// ([`raw_even_null`]) from `body`, lies.
#[must_use]
pub fn model_at(body: &[u8], raw: Option<&RawValue>) -> ModelAt {
    match raw {
        None => ModelAt::Absent,
        Some(raw) => span_in(body, raw).map_or(ModelAt::Unread, ModelAt::At),
    }
}

/// `body` (a JSON object with at least one other field) with `model` set to
/// `model`: only the value at `span` replaced, or the key added first.
fn with_model(body: &[u8], span: Option<&Range<usize>>, model: &str) -> Bytes {
    let quoted = Quoted::of(model);
    let (head, tail, key): (&[u8], &[u8], &[u8]) = match span {
        Some(span) => (&body[..span.start], &body[span.end..], b""),
        None => {
            // The body parsed as an object, so it starts (after blanks) with
            // `{`, and it has a required field, so a comma always follows.
            let open = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
            (&body[..open], &body[open..], b"\"model\":")
        }
    };
    let comma: &[u8] = if key.is_empty() { b"" } else { b"," };
    // Sized exactly: a `Vec` that is full becomes `Bytes` without another allocation.
    let mut out =
        Vec::with_capacity(head.len() + key.len() + quoted.len() + comma.len() + tail.len());
    out.extend_from_slice(head);
    out.extend_from_slice(key);
    quoted.write(&mut out);
    out.extend_from_slice(comma);
    out.extend_from_slice(tail);
    Bytes::from(out)
}

/// A raw value as a string (borrowed when it has no escapes), if it is one.
fn string(raw: &RawValue) -> Option<Cow<'_, str>> {
    // A string without escapes borrows (serde's `Cow` would always copy).
    if let Ok(plain) = serde_json::from_str::<&str>(raw.get()) {
        return Some(Cow::Borrowed(plain));
    }
    serde_json::from_str::<Cow<'_, str>>(raw.get())
        .ok()
        .map(|s| borrow_if_plain(raw, s))
}

/// `messages`: a non-empty array of objects, each with a string `role`.
fn messages(raw: Option<&RawValue>) -> Result<Vec<Message<'_>>, RequestError> {
    let Some(raw) = raw else {
        return Err(RequestError::field("messages", "`messages` is required"));
    };
    let entries: Vec<&RawValue> = serde_json::from_str(raw.get())
        .map_err(|_| RequestError::field("messages", "`messages` must be an array"))?;
    if entries.is_empty() {
        return Err(RequestError::field(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    entries
        .into_iter()
        .enumerate()
        .map(|(i, entry)| message(i, entry))
        .collect()
}

/// `messages[i]`.
fn message(i: usize, raw: &RawValue) -> Result<Message<'_>, RequestError> {
    let at = format!("messages[{i}]");
    if !raw.get().trim_start().starts_with('{') {
        let message = format!("`{at}` must be an object");
        return Err(RequestError::field(at, message));
    }
    let wire: WireMessage<'_> = serde_json::from_str(raw.get()).map_err(|e| {
        let message = format!("`{at}` is not a message: {e}");
        RequestError::field(at.clone(), message)
    })?;
    let Some(role) = wire.role.and_then(string) else {
        let param = format!("{at}.role");
        let message = format!("`{param}` must be a string");
        return Err(RequestError::field(param, message));
    };
    Ok(Message {
        role,
        content: wire.content,
        tool_calls: wire.tool_calls,
        // Only the token estimate reads it; a wrong type is the upstream's to judge.
        name: wire.name.and_then(string),
    })
}

/// `n`: how many choices, at least 1 (1 when not given).
fn choices(raw: Option<&RawValue>) -> Result<u32, RequestError> {
    match raw.map(|r| serde_json::from_str::<Option<u64>>(r.get())) {
        None | Some(Ok(None)) => Ok(1),
        Some(Ok(Some(n))) if n >= 1 => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
        Some(_) => Err(RequestError::field(
            "n",
            "`n` must be an integer of at least 1",
        )),
    }
}

/// `max_tokens` / `max_completion_tokens`, when given.
fn token_limit(raw: Option<&RawValue>, field: &'static str) -> Result<Option<u64>, RequestError> {
    raw.map(|raw| {
        serde_json::from_str::<u64>(raw.get()).map_err(|_| {
            RequestError::field(field, format!("`{field}` must be a non-negative integer"))
        })
    })
    .transpose()
}

/// Where `raw` (a slice of `body`) stands in `body`.
fn span_in(body: &[u8], raw: &RawValue) -> Option<Range<usize>> {
    let start = (raw.get().as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start + raw.get().len();
    (end <= body.len()).then_some(start..end)
}

/// Whether a raw value is present: not `null`, and not an empty array.
fn non_empty(raw: &RawValue) -> bool {
    let text = raw.get().trim();
    if text == "null" {
        return false;
    }
    match text.strip_prefix('[') {
        Some(rest) => !rest.trim_start().starts_with(']'),
        None => true,
    }
}

fn include_usage(raw: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Options {
        #[serde(default)]
        include_usage: Option<bool>,
    }
    serde_json::from_str::<Options>(raw.get())
        .ok()
        .and_then(|o| o.include_usage)
        .unwrap_or(false)
}

fn asks_for_json(raw: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Format<'a> {
        #[serde(rename = "type", borrow, default)]
        kind: Option<Cow<'a, str>>,
    }
    serde_json::from_str::<Format<'_>>(raw.get())
        .ok()
        .and_then(|f| f.kind)
        .is_some_and(|k| k == "json_object" || k == "json_schema")
}

/// The content parts of a message, when its content is an array.
fn parts<'a>(content: Option<&'a RawValue>) -> Vec<Part<'a>> {
    content
        .filter(|raw| raw.get().trim_start().starts_with('['))
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or_default()
}

fn has_image(m: &Message<'_>) -> bool {
    parts(m.content)
        .iter()
        .any(|p| p.kind.as_deref().is_some_and(|k| IMAGE_PARTS.contains(&k)))
}

fn content_tokens(content: Option<&RawValue>) -> u64 {
    let Some(raw) = content else { return 0 };
    let text = raw.get().trim_start();
    if text.starts_with('"') {
        return serde_json::from_str::<Cow<'_, str>>(raw.get())
            .map_or(0, |s| tokens::estimate_text(&s));
    }
    parts(Some(raw))
        .iter()
        .map(|p| match p.kind.as_deref() {
            Some(k) if IMAGE_PARTS.contains(&k) => tokens::PER_IMAGE,
            _ => p.text.as_deref().map_or(0, tokens::estimate_text),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> ChatRequest<'_> {
        ChatRequest::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn reads_what_routing_needs() {
        let r = parse(
            r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},
            "messages":[{"role":"user","content":[{"type":"text","text":"what"},{"type":"image_url","image_url":{"url":"x"}}]}],
            "tools":[{"type":"function","function":{"name":"f"}}],
            "response_format":{"type":"json_schema","json_schema":{}},"max_completion_tokens":77,"max_tokens":5}"#,
        );
        assert_eq!(r.model.as_deref(), Some("gpt-4o"));
        assert!(r.stream && r.include_usage && r.images && r.json_mode && r.offers_tools());
        assert_eq!(r.max_tokens, Some(77));
        assert!(r.prompt_tokens > tokens::PER_IMAGE, "{}", r.prompt_tokens);
        let hi = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert!(!parse(&format!(r#"{{"tools":[ ],{hi}}}"#)).offers_tools());
        assert!(!parse(&format!(r#"{{"tools":null,"functions":[],{hi}}}"#)).offers_tools());
    }

    #[test]
    fn estimate_counts_messages_images_and_tools() {
        let r = parse(
            r#"{"messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}"#,
        );
        let n = r.prompt_tokens;
        assert!(n > tokens::PER_IMAGE + 2 * tokens::PER_MESSAGE + 10, "{n}");
    }

    /// The `error.param` a body is refused with.
    fn refused(body: &str) -> Option<String> {
        ChatRequest::parse(body.as_bytes())
            .unwrap_err()
            .param
            .map(Cow::into_owned)
    }

    #[test]
    fn wrong_types_name_their_field() {
        let user = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(
            refused(&format!(r#"{{"model":1,{user}}}"#)).as_deref(),
            Some("model")
        );
        assert_eq!(
            refused(&format!(r#"{{"stream":"yes",{user}}}"#)).as_deref(),
            Some("stream")
        );
        for field in ["max_tokens", "max_completion_tokens"] {
            for bad in ["-1", "1.5", "\"8\"", "true"] {
                let body = format!(r#"{{"{field}":{bad},{user}}}"#);
                assert_eq!(refused(&body).as_deref(), Some(field), "{body}");
            }
        }
        for bad in ["0", "-1", "1.5", "\"2\"", "true"] {
            let body = format!(r#"{{"n":{bad},{user}}}"#);
            assert_eq!(refused(&body).as_deref(), Some("n"), "{body}");
        }
        for fine in ["1", "3", "null"] {
            assert!(ChatRequest::parse(format!(r#"{{"n":{fine},{user}}}"#).as_bytes()).is_ok());
        }
        let e = ChatRequest::parse(b"[1]").unwrap_err();
        assert!(e.message.starts_with("body is not a JSON object"), "{e}");
        assert_eq!(e.param, None);
        assert!(ChatRequest::parse(br#"{"model":"a","model":"b"}"#).is_err());
    }

    #[test]
    fn a_tool_choice_that_demands_a_call_needs_tools() {
        let user = r#""messages":[{"role":"user","content":"hi"}]"#;
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        for demand in [
            r#""required""#,
            r#"{"type":"function","function":{"name":"f"}}"#,
        ] {
            let without = format!(r#"{{"tool_choice":{demand},{user}}}"#);
            assert_eq!(
                refused(&without).as_deref(),
                Some("tool_choice"),
                "{without}"
            );
            let with = format!(r#"{{"tool_choice":{demand},{tools},{user}}}"#);
            assert!(ChatRequest::parse(with.as_bytes()).is_ok(), "{with}");
        }
        for harmless in [r#""auto""#, r#""none""#, "null"] {
            let body = format!(r#"{{"tool_choice":{harmless},{user}}}"#);
            assert!(ChatRequest::parse(body.as_bytes()).is_ok(), "{body}");
        }
    }

    #[test]
    fn messages_must_be_a_list_of_messages_with_roles() {
        let cases = [
            (r#"{"model":"m"}"#, "messages"),
            (r#"{"messages":null}"#, "messages"),
            (r#"{"messages":{"role":"user"}}"#, "messages"),
            (r#"{"messages":[]}"#, "messages"),
            (r#"{"messages":[{"role":"user"},"hi"]}"#, "messages[1]"),
            (
                r#"{"messages":[{"role":"user"},{"role":"user"},{"content":"x"}]}"#,
                "messages[2].role",
            ),
            (r#"{"messages":[{"role":7}]}"#, "messages[0].role"),
            (r#"{"messages":[{"role":null}]}"#, "messages[0].role"),
        ];
        for (body, param) in cases {
            assert_eq!(refused(body).as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn nulls_count_as_absent_and_odd_names_pass() {
        let r = parse(
            r#"{"model":null,"stream":null,"max_tokens":null,"max_completion_tokens":null,
            "messages":[{"role":"user","content":null,"name":5}]}"#,
        );
        assert!(r.model.is_none() && !r.stream && r.max_tokens.is_none());
        assert_eq!(r.messages[0].role, "user");
        assert!(r.messages[0].name.is_none());
        assert_eq!(
            parse(r#"{"max_tokens":0,"messages":[{"role":"x"}]}"#).max_tokens,
            Some(0)
        );
    }

    #[test]
    fn only_model_is_rewritten() {
        let body = r#"{ "messages": [{"role":"user"}], "model" : "gpt-4o", "temperature":0.5 }"#;
        let out = parse(body).with_model("up-\"x\"");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{ "messages": [{"role":"user"}], "model" : "up-\"x\"", "temperature":0.5 }"#
        );
        let out = parse(r#" {"messages":[{"role":"user"}]}"#).with_model("m");
        assert_eq!(&out[..], br#" {"model":"m","messages":[{"role":"user"}]}"#);
        let out = parse(r#"{"model":null,"messages":[{"role":"user"}]}"#).with_model("m");
        assert_eq!(&out[..], br#"{"model":"m","messages":[{"role":"user"}]}"#);
        let escaped = parse(r#"{"model":"g\u0070t","messages":[{"role":"user"}]}"#);
        assert_eq!(escaped.model.as_deref(), Some("gpt"));
        // Another protocol's body: its `null` model replaced too, never doubled.
        let out = object_with_model(br#"{"model":null,"max_tokens":1}"#, "m").unwrap();
        assert_eq!(&out[..], br#"{"model":"m","max_tokens":1}"#);
    }
}
