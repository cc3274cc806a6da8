//! OpenAI Chat Completions <-> Anthropic Messages, as pure translation: no I/O.
//!
//! The request side turns a parsed OpenAI chat request into a `POST /v1/messages`
//! body (`x-api-key` and `anthropic-version: 2023-06-01` are the caller's
//! business). The response side turns a Messages response, an error body, or a
//! stream event by event back into what an OpenAI client expects.
//!
//! What does not map is handled on purpose, never silently wrong: OpenAI fields
//! Anthropic has no counterpart for are dropped (Anthropic rejects unknown
//! fields), while request content that would change meaning if dropped (audio
//! or file parts, `n > 1`, non-function tools) and asks the answer could not
//! carry (audio output, `logprobs`, `top_logprobs`) are a [`TranslateError`].
//! Anthropic `thinking` blocks are not passed to the client.

use std::borrow::Cow;

use bytes::Bytes;
use http::HeaderName;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chunk::{self, now_secs, Delta, Frame, Head};
use super::non_null;
use super::translate::{
    content_parts, data_url, function_tools, image_url, inline_file, invalid, max_tokens,
    messages_with_roles, part_kind, push_turn, refuse_untranslatable, stop_sequences, tool_call,
    unsupported, wire, TranslateError, Turn,
};
use super::{Adapter, Malformed, TargetModel, Unsupported};
use crate::native::Protocol;
use crate::request::{ChatRequest, EmbeddingsRequest};
use crate::sse::scan;

/// The protocol's name in a refusal.
const API: &str = "the Anthropic Messages API";

/// The `anthropic-version` header sent unless a provider sets its own.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `max_tokens` sent when neither the request nor the target's `max_output`
/// gives one (the Messages API requires it).
const DEFAULT_MAX_TOKENS: u64 = 4096;

/// The Anthropic Messages protocol (`protocol: anthropic`).
#[derive(Debug)]
pub struct Anthropic;

impl Adapter for Anthropic {
    fn name(&self) -> &'static str {
        "anthropic"
    }

    fn chat_path(&self) -> &'static str {
        "messages"
    }

    fn required_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[("anthropic-version", ANTHROPIC_VERSION)]
    }

    fn key_header(&self) -> (&'static str, &'static str) {
        ("x-api-key", "")
    }

    fn forwarded_headers(&self) -> &'static [HeaderName] {
        static FORWARDED: [HeaderName; 2] = [
            HeaderName::from_static("anthropic-version"),
            HeaderName::from_static("anthropic-beta"),
        ];
        &FORWARDED
    }

    fn embeddings_path(&self) -> Option<&'static str> {
        None
    }

    fn native(&self) -> Option<Protocol> {
        Some(Protocol::Messages)
    }

    fn count_tokens_path(&self) -> Option<&'static str> {
        Some("messages/count_tokens")
    }

    fn encode(
        &self,
        request: &ChatRequest<'_>,
        target: TargetModel<'_>,
    ) -> Result<Bytes, Unsupported> {
        let object = request
            .to_object()
            .map_err(|e| Unsupported(e.to_string()))?;
        let body = to_messages_request(
            &object,
            target.model,
            target.max_output.unwrap_or(DEFAULT_MAX_TOKENS),
        )
        .map_err(|e| e.refusal(API))?;
        Ok(Bytes::from(body.to_string()))
    }

    fn encode_embeddings(
        &self,
        _request: &EmbeddingsRequest<'_>,
        _model: &str,
    ) -> Result<Bytes, Unsupported> {
        Err(Unsupported(
            "the anthropic protocol has no embeddings".into(),
        ))
    }

    fn decode_answer(&self, body: Bytes, _model: &str) -> Result<Bytes, Malformed> {
        // An error envelope inside a 2xx is an in-band error, read like the
        // status Anthropic pairs with its type (an `overloaded_error` as 529).
        match from_messages_response(&body) {
            Ok(chat) => Ok(chat),
            Err(TranslateError::Upstream { kind, message }) => {
                Ok(Bytes::from(in_band_error(&kind, message).to_string()))
            }
            Err(e) => Err(Malformed(e.to_string())),
        }
    }

    fn answer_facts<'a>(&self, body: &'a [u8]) -> Option<super::AnswerFacts<'a>> {
        answer_facts(body)
    }

    fn decode_error(
        &self,
        status: http::StatusCode,
        _headers: &http::HeaderMap,
        body: Bytes,
    ) -> super::ErrorAnswer {
        super::ErrorAnswer {
            status,
            body: to_openai_error(&body).unwrap_or(body),
            wait: None,
        }
    }

    fn stream_translator(
        &self,
        include_usage: bool,
        _model: &str,
    ) -> Option<Box<dyn super::StreamTranslator>> {
        Some(Box::new(MessagesStream::new(include_usage)))
    }
}

// ---------------------------------------------------------------------------
// Request: OpenAI -> Anthropic
// ---------------------------------------------------------------------------

/// OpenAI chat request (the parsed JSON object) -> Anthropic Messages request body.
/// `model` is the upstream model name; `default_max_tokens` is used when the request has neither max_tokens nor max_completion_tokens (Anthropic requires it).
///
/// System and developer messages become the top-level `system` (joined by a
/// blank line); consecutive same-role turns are merged; `tool` messages become
/// `tool_result` blocks in a user turn. `temperature` is clamped to
/// Anthropic's 0..=1. OpenAI fields without an Anthropic counterpart are
/// dropped, unless the answer could not honour them (audio output, log probabilities).
pub fn to_messages_request(
    openai: &Map<String, Value>,
    model: &str,
    default_max_tokens: u64,
) -> Result<Value, TranslateError> {
    let messages = openai
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("`messages` must be an array"))?;

    let (system, turns) = conversation(messages)?;
    if turns.is_empty() {
        return Err(invalid("no user or assistant message with content"));
    }

    let mut out = Map::new();
    out.insert("model".into(), Value::from(model));
    if !system.is_empty() {
        out.insert("system".into(), Value::from(system.join("\n\n")));
    }
    let messages: Vec<Value> = turns.into_iter().map(turn_json).collect();
    out.insert("messages".into(), Value::Array(messages));
    out.insert(
        "max_tokens".into(),
        Value::from(max_tokens(openai)?.unwrap_or(default_max_tokens)),
    );

    unanswerable(openai)?;
    if let Some(stop) = stop_sequences(openai)? {
        out.insert("stop_sequences".into(), stop);
    }
    if let Some(t) = non_null(openai, "temperature") {
        let f = t
            .as_f64()
            .ok_or_else(|| invalid("`temperature` must be a number"))?;
        let v = if (0.0..=1.0).contains(&f) {
            t.clone()
        } else {
            Value::from(f.clamp(0.0, 1.0))
        };
        out.insert("temperature".into(), v);
    }
    if let Some(p) = non_null(openai, "top_p") {
        if !p.is_number() {
            return Err(invalid("`top_p` must be a number"));
        }
        out.insert("top_p".into(), p.clone());
    }
    if let Some(s) = non_null(openai, "stream") {
        let s = s
            .as_bool()
            .ok_or_else(|| invalid("`stream` must be a boolean"))?;
        out.insert("stream".into(), Value::Bool(s));
    }
    if let Some(user) = non_null(openai, "user").and_then(Value::as_str) {
        out.insert("metadata".into(), json!({ "user_id": user }));
    }

    add_tools(openai, &mut out)?;
    Ok(Value::Object(out))
}

/// Asks whose answer a Messages response could not carry: more than one
/// choice, audio output, JSON output, log probabilities. Dropping them would hand the
/// client an answer without what it asked for, so the target is skipped.
fn unanswerable(openai: &Map<String, Value>) -> Result<(), TranslateError> {
    if let Some(n) = non_null(openai, "n") {
        if n.as_u64().is_none_or(|n| n > 1) {
            return Err(unsupported(format!("`n` = {n}")));
        }
    }
    refuse_untranslatable(openai)?;
    // Messages has no JSON mode: dropped, the answer would be prose where
    // the client asked for JSON (or JSON to a schema).
    let json_output = non_null(openai, "response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|kind| kind != "text");
    if json_output {
        return Err(unsupported(
            "JSON output (`response_format` other than `text`)",
        ));
    }
    Ok(())
}

/// The system texts and the merged turns of the OpenAI messages.
fn conversation(messages: &[Value]) -> Result<(Vec<String>, Vec<Turn>), TranslateError> {
    let mut system: Vec<String> = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    for read in messages_with_roles(messages) {
        let (at, message, role) = read?;
        match role {
            "system" | "developer" => system.extend(system_texts(message.get("content"), &at)?),
            "user" => push_turn(
                &mut turns,
                "user",
                user_blocks(message.get("content"), &at)?,
            ),
            "assistant" => push_turn(&mut turns, "assistant", assistant_blocks(message, &at)?),
            "tool" => push_turn(&mut turns, "user", vec![tool_result(message, &at)?]),
            other => return Err(unsupported(format!("{at}: role `{other}`"))),
        }
    }
    Ok((system, turns))
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as Messages fields.
fn add_tools(
    openai: &Map<String, Value>,
    out: &mut Map<String, Value>,
) -> Result<(), TranslateError> {
    let tools = match non_null(openai, "tools") {
        Some(t) => tools(t)?,
        None => Vec::new(),
    };
    if !tools.is_empty() {
        let parallel = match non_null(openai, "parallel_tool_calls") {
            Some(p) => p
                .as_bool()
                .ok_or_else(|| invalid("`parallel_tool_calls` must be a boolean"))?,
            None => true,
        };
        let choice = match non_null(openai, "tool_choice") {
            Some(c) => Some(tool_choice(c)?),
            None if !parallel => Some(json!({ "type": "auto" })),
            None => None,
        };
        out.insert("tools".into(), Value::Array(tools));
        if let Some(mut choice) = choice {
            let kind = choice.get("type").and_then(Value::as_str).unwrap_or("");
            if !parallel && kind != "none" {
                choice["disable_parallel_tool_use"] = Value::Bool(true);
            }
            out.insert("tool_choice".into(), choice);
        }
    }
    Ok(())
}

/// A turn as JSON; a lone text block is sent as a plain string.
fn turn_json(turn: Turn) -> Value {
    let content = match turn.blocks.as_slice() {
        [only] if only.get("type").and_then(Value::as_str) == Some("text") => {
            only.get("text").cloned().unwrap_or_default()
        }
        _ => Value::Array(turn.blocks),
    };
    json!({ "role": turn.role, "content": content })
}

fn text_block(text: &str) -> Value {
    json!({ "type": "text", "text": text })
}

fn system_texts(content: Option<&Value>, at: &str) -> Result<Vec<String>, TranslateError> {
    let mut out = Vec::new();
    for (j, part) in content_parts(content, at)?.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) if !t.is_empty() => out.push(t.to_owned()),
            ("text", _) => {}
            (kind, _) => {
                return Err(unsupported(format!(
                    "{at}: `{kind}` part in a system message"
                )))
            }
        }
    }
    Ok(out)
}

fn user_blocks(content: Option<&Value>, at: &str) -> Result<Vec<Value>, TranslateError> {
    let mut out = Vec::new();
    for (j, part) in content_parts(content, at)?.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) => {
                if !t.is_empty() {
                    out.push(text_block(t));
                }
            }
            ("image_url", _) => out.push(image_block(part, &at)?),
            ("file", _) => out.push(document_block(part, &at)?),
            (kind, _) => return Err(unsupported(format!("{at}: `{kind}` content part"))),
        }
    }
    Ok(out)
}

/// `{"type":"image_url","image_url":{"url":...}}` -> an Anthropic image block.
fn image_block(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let url = image_url(part, at)?;
    if url.starts_with("data:") {
        let (media_type, data) = data_url(url, at)?;
        Ok(json!({
            "type": "image",
            "source": { "type": "base64", "media_type": media_type, "data": data },
        }))
    } else if url.starts_with("https://") || url.starts_with("http://") {
        Ok(json!({ "type": "image", "source": { "type": "url", "url": url } }))
    } else {
        Err(unsupported(format!(
            "{at}: image URL scheme (only data:, http: and https:)"
        )))
    }
}

/// `{"type":"file","file":{"file_data":"data:application/pdf;base64,…"}}` ->
/// an Anthropic document block (its file name as the title). Anthropic
/// reads a PDF this way; other file types are not translated.
fn document_block(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let (media_type, data, filename) = inline_file(part, at)?;
    if !media_type.eq_ignore_ascii_case("application/pdf") {
        return Err(unsupported(format!(
            "{at}: file type `{media_type}` (only PDF)"
        )));
    }
    let mut block = json!({
        "type": "document",
        "source": { "type": "base64", "media_type": "application/pdf", "data": data },
    });
    if let Some(title) = filename.filter(|f| !f.is_empty()) {
        block["title"] = json!(title);
    }
    Ok(block)
}

fn assistant_blocks(message: &Map<String, Value>, at: &str) -> Result<Vec<Value>, TranslateError> {
    if non_null(message, "function_call").is_some() {
        return Err(unsupported(format!(
            "{at}: legacy `function_call` (use `tool_calls`)"
        )));
    }
    let mut out = Vec::new();
    for (j, part) in content_parts(message.get("content"), at)?
        .into_iter()
        .enumerate()
    {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text" | "refusal", Some(t)) => {
                if !t.is_empty() {
                    out.push(text_block(t));
                }
            }
            ("refusal", None) => {}
            (kind, _) => {
                return Err(unsupported(format!(
                    "{at}: `{kind}` part in an assistant message"
                )))
            }
        }
    }
    let calls = match non_null(message, "tool_calls") {
        None => &[][..],
        Some(Value::Array(calls)) => calls.as_slice(),
        Some(_) => return Err(invalid(format!("{at}.tool_calls must be an array"))),
    };
    for (k, call) in calls.iter().enumerate() {
        out.push(tool_use_block(call, &format!("{at}.tool_calls[{k}]"))?);
    }
    Ok(out)
}

fn tool_use_block(call: &Value, at: &str) -> Result<Value, TranslateError> {
    let call = tool_call(call, at)?;
    let id = crate::native::tool_use_id(call.id);
    Ok(json!({ "type": "tool_use", "id": id, "name": call.name, "input": call.input }))
}

fn tool_result(message: &Map<String, Value>, at: &str) -> Result<Value, TranslateError> {
    let id = message
        .get("tool_call_id")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.tool_call_id must be a string")))?;
    let mut block = Map::new();
    block.insert("type".into(), Value::from("tool_result"));
    block.insert(
        "tool_use_id".into(),
        Value::from(crate::native::tool_use_id(id).as_ref()),
    );
    match message.get("content") {
        Some(Value::String(s)) if !s.is_empty() => {
            block.insert("content".into(), Value::from(s.as_str()));
        }
        content @ Some(Value::Array(_)) => {
            let blocks = user_blocks(content, at)?;
            if !blocks.is_empty() {
                block.insert("content".into(), Value::Array(blocks));
            }
        }
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => {
            return Err(invalid(format!(
                "{at}.content must be a string or an array"
            )))
        }
    }
    Ok(Value::Object(block))
}

fn tools(tools: &Value) -> Result<Vec<Value>, TranslateError> {
    let read = function_tools(tools)?;
    Ok(read
        .into_iter()
        .map(|tool| {
            let mut out = Map::new();
            out.insert("name".into(), Value::from(tool.name));
            if let Some(d) = tool.description {
                out.insert("description".into(), Value::from(d));
            }
            let schema = tool
                .parameters
                .cloned()
                .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
            out.insert("input_schema".into(), schema);
            Value::Object(out)
        })
        .collect())
}

fn tool_choice(choice: &Value) -> Result<Value, TranslateError> {
    match choice {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(json!({ "type": "auto" })),
            "required" => Ok(json!({ "type": "any" })),
            "none" => Ok(json!({ "type": "none" })),
            other => Err(invalid(format!("`tool_choice` = `{other}`"))),
        },
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid("`tool_choice` object must be {\"type\":\"function\",\"function\":{\"name\":...}}")
                })?;
            Ok(json!({ "type": "tool", "name": name }))
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => {
            Err(invalid("`tool_choice` must be a string or an object"))
        }
    }
}

// ---------------------------------------------------------------------------
// Response: Anthropic -> OpenAI
// ---------------------------------------------------------------------------

/// Anthropic `usage` (a message's, or a stream event's).
#[derive(Debug, Default, Deserialize)]
struct Usage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    /// Whether the upstream gave any count.
    fn known(&self) -> bool {
        self.input_tokens.is_some() || self.output_tokens.is_some()
    }

    /// OpenAI counts cached prompt tokens in `prompt_tokens`; Anthropic's
    /// `input_tokens` leaves out cache writes and reads.
    fn prompt_tokens(&self) -> Option<u64> {
        // Saturating: the counts are the upstream's, and may be absurd.
        let input = self.input_tokens?;
        Some(
            input
                .saturating_add(self.cache_creation_input_tokens.unwrap_or(0))
                .saturating_add(self.cache_read_input_tokens.unwrap_or(0)),
        )
    }
}

/// Anthropic `stop_reason` -> OpenAI `finish_reason`, as text.
fn finish_reason_str(stop_reason: Option<&str>) -> Option<&'static str> {
    match stop_reason? {
        "max_tokens" | "model_context_window_exceeded" => Some("length"),
        "tool_use" => Some("tool_calls"),
        "refusal" => Some("content_filter"),
        // end_turn, stop_sequence, pause_turn and anything newer.
        _ => Some("stop"),
    }
}

/// The `{"type":"error","error":{...}}` body, if it is one: (type, message).
fn anthropic_error(body: &[u8]) -> Option<(String, String)> {
    #[derive(Deserialize)]
    struct Wire {
        #[serde(rename = "type")]
        kind: String,
        error: ErrorBody,
    }
    let w: Wire = serde_json::from_slice(body).ok()?;
    (w.kind == "error").then(|| (w.error.kind, w.error.message.unwrap_or_default()))
}

/// The `error` of Anthropic's error envelope.
#[derive(Deserialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    message: Option<String>,
}

/// Anthropic error type -> HTTP status (Anthropic's documented pairs; unknown -> 500).
fn status_of(kind: &str) -> u16 {
    match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "timeout_error" => 504,
        "overloaded_error" => 529,
        _ => 500,
    }
}

/// Anthropic error (type, message) -> OpenAI (`type`, `code`).
fn openai_error_names(kind: &str, message: &str) -> (&'static str, &'static str) {
    match kind {
        "invalid_request_error" if crate::classify::is_context_length(message) => {
            ("invalid_request_error", "context_length_exceeded")
        }
        "invalid_request_error" => ("invalid_request_error", "invalid_request"),
        "authentication_error" => ("authentication_error", "invalid_api_key"),
        "billing_error" => ("insufficient_quota", "insufficient_quota"),
        "permission_error" => ("permission_error", "permission_denied"),
        "not_found_error" => ("not_found_error", "not_found"),
        "request_too_large" => ("invalid_request_error", "request_too_large"),
        "rate_limit_error" => ("rate_limit_error", "rate_limit_exceeded"),
        "timeout_error" => ("server_error", "timeout"),
        "overloaded_error" => ("server_error", "overloaded"),
        _ => ("server_error", "server_error"),
    }
}

/// An Anthropic error that came in-band (a stream's `error` event, or an
/// error body with a 2xx status). The client may get it as its error body:
/// OpenAI's shape and string code, with the status (which classifies it)
/// beside them.
fn in_band_error(kind: &str, message: String) -> Value {
    let (error_type, code) = openai_error_names(kind, &message);
    json!({
        "error": {
            "message": message,
            "type": error_type,
            "code": code,
            "param": null,
            "status": status_of(kind),
        }
    })
}

/// A Messages answer, as the chat reading reads it.
#[derive(Deserialize)]
struct Reply<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    id: Option<Cow<'a, str>>,
    model: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Vec<Block<'a>>,
    stop_reason: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Usage,
    error: Option<ErrorBody>,
}

/// One read of a 2xx body: a message with its id and model, or why it is
/// none (an error envelope is the upstream's error).
fn read_reply(body: &[u8]) -> Result<Reply<'_>, TranslateError> {
    let m: Reply<'_> = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            TranslateError::InvalidResponse(format!("not a Messages response: {e}"))
        }
        serde_json::error::Category::Io
        | serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof => TranslateError::Json(e),
    })?;
    match (m.kind.as_deref(), &m.error) {
        (Some("error"), Some(error)) => {
            return Err(TranslateError::Upstream {
                kind: error.kind.clone(),
                message: error.message.clone().unwrap_or_default(),
            })
        }
        (None | Some("message"), _) => {}
        (Some(other), _) => {
            return Err(TranslateError::InvalidResponse(format!(
                "`type` is {other:?}, not \"message\""
            )))
        }
    }
    if m.id.is_none() || m.model.is_none() {
        return Err(TranslateError::InvalidResponse(
            "not a Messages response: no `id` or `model`".into(),
        ));
    }
    Ok(m)
}

/// [`super::Adapter::answer_facts`]: an answer [`from_messages_response`]
/// would read, with counts.
fn answer_facts(body: &[u8]) -> Option<super::AnswerFacts<'_>> {
    let m = read_reply(body).ok()?;
    read_blocks(&m.content).ok()?;
    m.usage.known().then(|| super::AnswerFacts {
        usage: (
            m.usage.prompt_tokens().unwrap_or(0),
            m.usage.output_tokens.unwrap_or(0),
        ),
        model: m.model,
    })
}

/// Anthropic Messages response body -> OpenAI `chat.completion` JSON (bytes).
///
/// Text blocks are concatenated into `message.content` (`null` when there is
/// no text but there are tool calls); `tool_use` blocks become `tool_calls`;
/// `thinking` and other block types are dropped. `prompt_tokens` includes
/// cache reads and writes, and cache reads are also reported as
/// `prompt_tokens_details.cached_tokens`.
pub fn from_messages_response(body: &[u8]) -> Result<Bytes, TranslateError> {
    let m = read_reply(body)?;
    let (text, tool_calls) = read_blocks(&m.content)?;
    let content = (tool_calls.is_empty() || !text.is_empty()).then_some(text);
    let usage = m.usage.known().then(|| {
        chunk::Usage::new(
            m.usage.prompt_tokens().unwrap_or(0),
            m.usage.output_tokens.unwrap_or(0),
            m.usage.cache_read_input_tokens.unwrap_or(0),
            0,
        )
    });
    let (id, model) = (m.id.unwrap_or_default(), m.model.unwrap_or_default());
    let completion = wire::Completion {
        id: &id,
        object: "chat.completion",
        created: now_secs(),
        model: &model,
        choices: &[wire::Choice {
            index: 0,
            message: wire::Message {
                role: "assistant",
                content,
                reasoning_content: None,
                tool_calls,
            },
            logprobs: None,
            finish_reason: finish_reason_str(m.stop_reason.as_deref()),
        }],
        usage,
    };
    serde_json::to_vec(&completion)
        .map(Bytes::from)
        .map_err(TranslateError::Json)
}

/// A block of a Messages response's `content` (the fields read of any type).
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    input: Option<&'a serde_json::value::RawValue>,
}

/// A response's text (concatenated) and tool calls; a tool call the client
/// cannot answer (no id) or cannot run (no name) is no answer.
fn read_blocks(content: &[Block<'_>]) -> Result<(String, Vec<wire::ToolCall>), TranslateError> {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in content {
        match block.kind.as_deref() {
            Some("text") => text.push_str(block.text.as_deref().unwrap_or_default()),
            Some("tool_use") => {
                let arguments = match block.input.map(|raw| raw.get().trim_start()) {
                    None => "{}".to_owned(),
                    Some("null") => "{}".to_owned(),
                    Some(object) if object.starts_with('{') => object.to_owned(),
                    Some(_) => {
                        return Err(TranslateError::InvalidResponse(
                            "a tool_use block's input is not an object".into(),
                        ))
                    }
                };
                tool_calls.push(wire::ToolCall {
                    id: tool_use_field(&block.id, "id")?,
                    kind: "function",
                    function: wire::Function {
                        name: tool_use_field(&block.name, "name")?,
                        arguments,
                    },
                });
            }
            _ => {}
        }
    }
    Ok((text, tool_calls))
}

/// A `tool_use` block's `id` or `name` (`what`): a call without one is no answer.
fn tool_use_field(value: &Option<Cow<'_, str>>, what: &str) -> Result<String, TranslateError> {
    value
        .as_deref()
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| {
            TranslateError::InvalidResponse(format!("a tool_use block without `{what}`"))
        })
}

/// An Anthropic error body -> an OpenAI-format error body {"error":{"message","type","code"}} (keeps the message;
/// a context-length invalid_request_error keeps words like "prompt is too long" so the gateway's context-window
/// detection, which looks for phrases like "prompt is too long" / "context length", still matches). None if not an Anthropic error.
///
/// `code` is an OpenAI-style string (`context_length_exceeded`,
/// `rate_limit_exceeded`, `invalid_api_key`, `overloaded`, ...); the message is
/// passed through unchanged.
#[must_use]
pub fn to_openai_error(body: &[u8]) -> Option<Bytes> {
    let (kind, message) = anthropic_error(body)?;
    let (error_type, code) = openai_error_names(&kind, &message);
    let v = json!({
        "error": { "message": message, "type": error_type, "code": code, "param": null }
    });
    Some(Bytes::from(v.to_string()))
}

// ---------------------------------------------------------------------------
// Streams: Anthropic SSE -> OpenAI chunks
// ---------------------------------------------------------------------------

/// An open `tool_use` block of the stream.
#[derive(Debug)]
struct ToolBlock {
    /// Anthropic's content block index.
    block: u64,
    /// OpenAI's `tool_calls[].index` (counts tool blocks only).
    index: usize,
    /// Whether any non-empty `arguments` piece was sent.
    sent_arguments: bool,
}

/// One stream event: its type and what any type needs, borrowed from the
/// event's text (no tree is built).
#[derive(Deserialize)]
struct StreamEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    message: Option<StartMessage<'a>>,
    #[serde(borrow, default)]
    content_block: Option<BlockStart<'a>>,
    #[serde(borrow, default)]
    delta: Option<EventDelta<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct StartMessage<'a> {
    #[serde(borrow, default)]
    id: Cow<'a, str>,
    #[serde(borrow, default)]
    model: Cow<'a, str>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct BlockStart<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct EventDelta<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    partial_json: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    stop_reason: Option<Cow<'a, str>>,
}

/// Translates an Anthropic SSE stream, event by event, into OpenAI `chat.completion.chunk` SSE events.
#[derive(Debug)]
pub struct MessagesStream {
    include_usage: bool,
    head: Head,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    /// Any count arrived: without one there is no usage chunk (zeros would
    /// be booked as the truth).
    usage_seen: bool,
    tools: Vec<ToolBlock>,
    finished: bool,
}

impl super::StreamTranslator for MessagesStream {
    fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, Malformed> {
        MessagesStream::on_event(self, data).map_err(|e| Malformed(e.to_string()))
    }
}

impl MessagesStream {
    /// `include_usage`: the client asked `stream_options.include_usage` (emit a final usage chunk with empty choices).
    #[must_use]
    pub fn new(include_usage: bool) -> Self {
        Self {
            include_usage,
            head: Head {
                created: now_secs(),
                ..Head::default()
            },
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            usage_seen: false,
            tools: Vec::new(),
            finished: false,
        }
    }

    /// One upstream event's `data:` JSON (Anthropic puts the event type in data.type too, so the `event:` line is not needed).
    /// Returns zero or more complete OpenAI SSE events as raw bytes, each exactly `data: {json}\n\n`, and `data: [DONE]\n\n` after message_stop.
    /// An Anthropic `error` event becomes `data: {"error":{"message","type","code": <numeric status by status_of>}}\n\n`
    /// (the gateway reads a numeric `code` as an in-band status). `ping` produces nothing.
    ///
    /// Unknown event types, thinking/signature deltas and events after
    /// `message_stop` produce nothing. A tool call whose input streamed no
    /// JSON at all gets `"{}"` as its arguments when its block stops.
    pub fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, TranslateError> {
        let text = crate::native::messages_text_delta(data).map(|(_, text)| Some(text));
        match text.or_else(|| text_delta(data)) {
            Some(Some(t)) if !t.is_empty() && !self.finished => Ok(vec![self.head.text(t)]),
            Some(_) => Ok(Vec::new()),
            None => self.read_event(data),
        }
    }

    /// [`MessagesStream::on_event`], for an event read by serde.
    fn read_event(&mut self, data: &str) -> Result<Vec<Frame>, TranslateError> {
        let event: StreamEvent<'_> = serde_json::from_str(data)?;
        if self.finished {
            return Ok(Vec::new());
        }
        let out = match event.kind.as_ref() {
            "message_start" => {
                let message = event.message.ok_or_else(|| {
                    TranslateError::InvalidResponse("message_start without `message`".into())
                })?;
                message.id.as_ref().clone_into(&mut self.head.id);
                message.model.as_ref().clone_into(&mut self.head.model);
                self.take_usage(message.usage.as_ref());
                vec![self.head.role()]
            }
            "content_block_start" => self.block_start(&event)?,
            "content_block_delta" => self.block_delta(&event)?,
            "content_block_stop" => {
                let block = block_index(&event)?;
                match self.tools.iter_mut().find(|t| t.block == block) {
                    Some(tool) if !tool.sent_arguments => {
                        tool.sent_arguments = true;
                        vec![self.head.arguments(tool.index, "{}")]
                    }
                    _ => Vec::new(),
                }
            }
            "message_delta" => {
                self.take_usage(event.usage.as_ref());
                let stop = event.delta.as_ref().and_then(|d| d.stop_reason.as_deref());
                vec![self.head.delta(Delta::default(), finish_reason_str(stop))]
            }
            "message_stop" => {
                self.finished = true;
                let mut out = Vec::new();
                if self.include_usage && self.usage_seen {
                    let usage = chunk::Usage::new(
                        self.prompt_tokens,
                        self.completion_tokens,
                        self.cached_tokens,
                        0,
                    );
                    out.push(self.head.usage(usage));
                }
                out.push(Frame::DONE);
                out
            }
            "error" => {
                let (kind, message) = anthropic_error(data.as_bytes()).ok_or_else(|| {
                    TranslateError::InvalidResponse("malformed error event".into())
                })?;
                vec![Frame::read(&in_band_error(&kind, message))]
            }
            // "ping" and event types added later.
            _ => Vec::new(),
        };
        Ok(out)
    }

    /// `content_block_start`: a text block's first text, or a tool call's opening chunk.
    fn block_start(&mut self, event: &StreamEvent<'_>) -> Result<Vec<Frame>, TranslateError> {
        let Some(block) = &event.content_block else {
            return Ok(Vec::new());
        };
        let out = match block.kind.as_ref() {
            "text" => match block.text.as_deref() {
                Some(t) if !t.is_empty() => vec![self.head.text(t)],
                _ => Vec::new(),
            },
            "tool_use" => {
                let index = self.tools.len();
                self.tools.push(ToolBlock {
                    block: block_index(event)?,
                    index,
                    sent_arguments: false,
                });
                let (id, name) = (
                    tool_use_field(&block.id, "id")?,
                    tool_use_field(&block.name, "name")?,
                );
                vec![self.head.call(index, &id, &name)]
            }
            _ => Vec::new(),
        };
        Ok(out)
    }

    /// `content_block_delta`: text, or a piece of a tool call's arguments.
    fn block_delta(&mut self, event: &StreamEvent<'_>) -> Result<Vec<Frame>, TranslateError> {
        let Some(delta) = &event.delta else {
            return Ok(Vec::new());
        };
        let out = match delta.kind.as_deref() {
            Some("text_delta") => match delta.text.as_deref() {
                Some(t) if !t.is_empty() => vec![self.head.text(t)],
                _ => Vec::new(),
            },
            Some("input_json_delta") => {
                let piece = delta.partial_json.as_deref().unwrap_or_default();
                let block = block_index(event)?;
                match self.tools.iter_mut().find(|t| t.block == block) {
                    Some(tool) if !piece.is_empty() => {
                        tool.sent_arguments = true;
                        vec![self.head.arguments(tool.index, piece)]
                    }
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        };
        Ok(out)
    }

    /// Reads token counts from a message_start or message_delta `usage`.
    fn take_usage(&mut self, usage: Option<&Usage>) {
        let Some(u) = usage else {
            return;
        };
        self.usage_seen |= u.known();
        if let Some(p) = u.prompt_tokens() {
            self.prompt_tokens = p;
            self.cached_tokens = u.cache_read_input_tokens.unwrap_or(0);
        }
        if let Some(o) = u.output_tokens {
            self.completion_tokens = o;
        }
    }
}

/// A `content_block_delta` of text, the event of every token, read by a
/// scan as serde would read it (its text, if any); `None` for any other
/// event, or one the scan leaves to serde.
fn text_delta(data: &str) -> Option<Option<&str>> {
    let keys = [
        "type",
        "index",
        "message",
        "content_block",
        "delta",
        "usage",
    ];
    let [kind, index, message, block, delta, usage] = scan::fields(data, keys)?;
    let absent = |f: Option<&str>| f.is_none_or(|v| v == "null");
    if kind != Some("\"content_block_delta\"")
        || !(absent(message) && absent(block) && absent(usage))
    {
        return None;
    }
    scan::plain_u64(index)?;
    let keys = ["type", "text", "partial_json", "stop_reason"];
    let [kind, text, partial_json, stop_reason] = scan::fields(delta?, keys)?;
    if kind != Some("\"text_delta\"") {
        return None;
    }
    scan::plain_str(partial_json)?;
    scan::plain_str(stop_reason)?;
    scan::plain_str(text)
}

/// The Anthropic content block `index` of an event.
fn block_index(event: &StreamEvent<'_>) -> Result<u64, TranslateError> {
    event.index.ok_or_else(|| {
        TranslateError::InvalidResponse("content block event without `index`".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_str!(concat!("../../tests/fixtures/anthropic/", $name))
        };
    }

    fn object(text: &str) -> Map<String, Value> {
        let Value::Object(o) = serde_json::from_str(text).unwrap() else {
            panic!("not an object: {text}")
        };
        o
    }

    fn request(v: Value) -> Result<Value, TranslateError> {
        let Value::Object(o) = v else {
            panic!("not an object")
        };
        to_messages_request(&o, "claude-x", 1000)
    }

    /// Parses produced JSON and zeroes `created` (the expected fixtures say
    /// 0) after checking that it is a current Unix time.
    fn without_created(text: &[u8]) -> Value {
        let mut v: Value = serde_json::from_slice(text).unwrap();
        if let Some(c) = v.get("created") {
            assert!(c.as_u64().unwrap() > 1_600_000_000, "created = {c}");
            v["created"] = json!(0);
        }
        v
    }

    fn parse(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    /// The `data:` payloads of an SSE fixture.
    fn sse_data(text: &str) -> Vec<&str> {
        text.split("\n\n")
            .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
            .collect()
    }

    #[test]
    fn a_tool_call_without_id_name_or_object_input_is_no_answer() {
        let answer = |block: Value| {
            let body = json!({ "type": "message", "id": "m", "model": "c",
                "content": [block], "stop_reason": "tool_use" });
            from_messages_response(body.to_string().as_bytes())
        };
        for bad in [
            json!({ "type": "tool_use", "name": "f", "input": {} }),
            json!({ "type": "tool_use", "id": "", "name": "f", "input": {} }),
            json!({ "type": "tool_use", "id": "t1", "input": {} }),
            json!({ "type": "tool_use", "id": "t1", "name": "f", "input": "not an object" }),
        ] {
            assert!(
                matches!(answer(bad.clone()), Err(TranslateError::InvalidResponse(_))),
                "{bad}"
            );
        }
        assert!(
            answer(json!({ "type": "tool_use", "id": "t1", "name": "f", "input": {} })).is_ok()
        );
        let mut t = MessagesStream::new(false);
        let start = r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","name":"f","input":{}}}"#;
        assert!(t.on_event(start).is_err(), "a streamed call without an id");
    }

    #[test]
    fn a_stream_without_counts_has_no_usage_chunk() {
        let mut t = MessagesStream::new(true);
        let start = r#"{"type":"message_start","message":{"id":"m","type":"message","role":"assistant","model":"c","content":[]}}"#;
        let mut out = Vec::new();
        for data in [
            start,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"hi"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"}}"#,
            r#"{"type":"message_stop"}"#,
        ] {
            out.extend(t.on_event(data).unwrap());
        }
        let all: String = out
            .iter()
            .map(|b| String::from_utf8_lossy(&b.raw))
            .collect();
        assert!(!all.contains("usage"), "{all}");
        assert!(all.ends_with("data: [DONE]\n\n"), "{all}");
    }

    fn run_stream(text: &str, include_usage: bool) -> Vec<String> {
        let mut t = MessagesStream::new(include_usage);
        let mut out = Vec::new();
        for data in sse_data(text) {
            for event in t.on_event(data).unwrap() {
                let s = String::from_utf8(event.raw.to_vec()).unwrap();
                assert!(s.starts_with("data: ") && s.ends_with("\n\n"), "{s:?}");
                assert_eq!(s.matches("\n\n").count(), 1, "one event per item: {s:?}");
                out.push(s["data: ".len()..s.len() - 2].to_owned());
            }
        }
        out
    }

    #[test]
    fn absurd_usage_counts_saturate_instead_of_wrapping() {
        let u = Usage {
            input_tokens: Some(u64::MAX),
            output_tokens: Some(u64::MAX),
            cache_creation_input_tokens: Some(5),
            cache_read_input_tokens: Some(u64::MAX),
        };
        assert_eq!(u.prompt_tokens(), Some(u64::MAX));
        assert_eq!(
            serde_json::to_value(chunk::Usage::new(u64::MAX, u64::MAX, 0, 0)).unwrap()
                ["total_tokens"],
            u64::MAX
        );
    }

    #[test]
    fn chat_request_translates() {
        let openai = object(fixture!("chat_request.openai.json"));
        let got = to_messages_request(&openai, "claude-sonnet-4-5", 4096).unwrap();
        let want: Value = serde_json::from_str(fixture!("chat_request.anthropic.json")).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn tools_request_translates() {
        let openai = object(fixture!("tools_request.openai.json"));
        let got = to_messages_request(&openai, "claude-sonnet-4-5", 4096).unwrap();
        let want: Value = serde_json::from_str(fixture!("tools_request.anthropic.json")).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn an_answers_facts_are_what_its_chat_reading_says() {
        let bodies = [
            fixture!("text_response.anthropic.json"),
            fixture!("tool_use_response.anthropic.json"),
            r#"{"id":"m","type":"message","model":"c","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":5,"cache_creation_input_tokens":2,"cache_read_input_tokens":3,"output_tokens":7}}"#,
            r#"{"id":"m","model":"c","content":[],"usage":{"output_tokens":7}}"#,
            r#"{"id":"m","type":"message","model":"c","content":[{"type":"text","text":"hi"}]}"#,
            r#"{"id":"m","type":"message","model":"c","content":[{"type":"tool_use","name":"f","input":{}}],"usage":{"input_tokens":1}}"#,
            r#"{"id":"m","type":"message","model":"c","content":[],"stop_reason":7,"usage":{"input_tokens":1}}"#,
            r#"{"type":"message","model":"c","content":[],"usage":{"input_tokens":1}}"#,
            r#"{"type":"error","error":{"type":"overloaded_error","message":"busy"},"usage":{"input_tokens":1}}"#,
            r#"{"type":"completion","id":"m","model":"c","usage":{"input_tokens":1}}"#,
            r#"{"id":"m","model":"c","usage":{"input_tokens":1}} trailing"#,
        ];
        let read = |body: &'static str| {
            (
                answer_facts(body.as_bytes()),
                from_messages_response(body.as_bytes()),
            )
        };
        assert_eq!(super::super::facts_agree(bodies.map(read)), 4);
    }

    #[test]
    fn text_response_translates() {
        let got =
            from_messages_response(fixture!("text_response.anthropic.json").as_bytes()).unwrap();
        let want = parse(fixture!("text_response.openai.json"));
        assert_eq!(without_created(&got), want);
    }

    #[test]
    fn tool_use_response_translates() {
        let got = from_messages_response(fixture!("tool_use_response.anthropic.json").as_bytes())
            .unwrap();
        let got = without_created(&got);
        let want = parse(fixture!("tool_use_response.openai.json"));
        // `arguments` is JSON text: compare it parsed, then the rest exactly.
        let args = |v: &Value, i: usize| -> Value {
            let a = v["choices"][0]["message"]["tool_calls"][i]["function"]["arguments"]
                .as_str()
                .unwrap();
            serde_json::from_str(a).unwrap()
        };
        let (mut got, mut want) = (got, want);
        for i in 0..2 {
            assert_eq!(args(&got, i), args(&want, i));
            got["choices"][0]["message"]["tool_calls"][i]["function"]["arguments"] = json!("");
            want["choices"][0]["message"]["tool_calls"][i]["function"]["arguments"] = json!("");
        }
        assert_eq!(got, want);
    }

    #[test]
    fn tool_only_response_has_null_content() {
        let body = json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{ "type": "tool_use", "id": "toolu_1", "name": "f", "input": { "a": 1 } }],
            "stop_reason": "tool_use", "usage": { "input_tokens": 1, "output_tokens": 2 }
        });
        let got = without_created(&from_messages_response(body.to_string().as_bytes()).unwrap());
        assert_eq!(got["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(got["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            got["usage"],
            json!({ "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3 })
        );
    }

    #[test]
    fn stop_reasons_map() {
        for (anthropic, openai) in [
            ("end_turn", json!("stop")),
            ("stop_sequence", json!("stop")),
            ("max_tokens", json!("length")),
            ("tool_use", json!("tool_calls")),
            ("refusal", json!("content_filter")),
        ] {
            let body = json!({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [{ "type": "text", "text": "x" }], "stop_reason": anthropic,
                "usage": { "input_tokens": 1, "output_tokens": 1 }
            });
            let got: Value = serde_json::from_slice(
                &from_messages_response(body.to_string().as_bytes()).unwrap(),
            )
            .unwrap();
            assert_eq!(got["choices"][0]["finish_reason"], openai, "{anthropic}");
        }
    }

    #[test]
    fn bad_responses_are_errors() {
        assert!(matches!(
            from_messages_response(fixture!("error_overloaded.json").as_bytes()),
            Err(TranslateError::Upstream { kind, .. }) if kind == "overloaded_error"
        ));
        assert!(matches!(
            from_messages_response(b"{nope"),
            Err(TranslateError::Json(_))
        ));
        assert!(matches!(
            from_messages_response(br#"{"type":"message"}"#),
            Err(TranslateError::InvalidResponse(_))
        ));
    }

    #[test]
    fn stream_text_translates() {
        let got = run_stream(fixture!("stream_text.anthropic.sse"), false);
        let want = sse_data(fixture!("stream_text.openai.sse"));
        assert_eq!(got.len(), want.len(), "{got:#?}");
        for (g, w) in got.iter().zip(&want) {
            if *w == "[DONE]" {
                assert_eq!(g, w);
            } else {
                assert_eq!(without_created(g.as_bytes()), parse(w));
            }
        }
        let created: Vec<Value> = got[..got.len() - 1]
            .iter()
            .map(|g| serde_json::from_str::<Value>(g).unwrap()["created"].clone())
            .collect();
        assert!(
            created.windows(2).all(|w| w[0] == w[1]),
            "one `created` per stream"
        );
    }

    #[test]
    fn a_text_delta_read_by_the_scan_reads_as_serde_reads_it() {
        let start = [
            r#"{"type":"message_start","message":{"id":"msg_1","model":"claude"}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        ];
        let events = [
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":null}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a\"b\n"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\ud83d\ude00"}}"#,
            r#" { "type" : "content_block_delta" , "index" : 7 , "delta" : { "text" : "x" , "type" : "text_delta" } } "#,
            r#"{"type":"content_block_delta","index":"0","delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":-1,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":1.0,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":99999999999999999999,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":5}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","text":"b"}}"#,
            r#"{"type":"content_block_delta","type":"ping","index":0,"delta":{"type":"text_delta","text":"a"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","stop_reason":7}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","extra":[1,{"b":null}]}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":null}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"},"usage":{"output_tokens":"x"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"},"message":{"id":"m"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}} x"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
            r#"{"type":"content_block_delta","\u0069ndex":"x","delta":{"type":"text_delta","text":"a"}}"#,
            r#"{"type":"ping"}"#,
            r#"[1]"#,
            r#"{"type":"content_block_delta","index":12,"delta":{"type":"text_delta","text":"café ☕ </b>"}}"#,
            r#"{"type":"content_block_delta","index":12,"delta":{"type":"text_delta","text":"caf\u00e9"}}"#,
            r#"{"type":"content_block_delta","index":01,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":00,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}} "#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"b"}}"#,
            "{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tab\there\"}}",
        ];
        for event in events {
            let (mut by_scan, mut by_serde) =
                (MessagesStream::new(true), MessagesStream::new(true));
            by_serde.head.created = by_scan.head.created;
            for e in start {
                assert_eq!(
                    by_scan.on_event(e).unwrap(),
                    by_serde.read_event(e).unwrap()
                );
            }
            let (fast, by_serde) = (by_scan.on_event(event), by_serde.read_event(event));
            super::super::assert_same_reading(event, fast, by_serde);
        }
        // After the message's end a text delta is read into nothing.
        let mut stream = MessagesStream::new(true);
        stream.on_event(r#"{"type":"message_stop"}"#).unwrap();
        let late = r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"late"}}"#;
        assert!(stream.on_event(late).unwrap().is_empty());
    }

    #[test]
    fn stream_tool_use_assembles() {
        let got = run_stream(fixture!("stream_tool_use.anthropic.sse"), true);
        assert_eq!(got.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = got[..got.len() - 1]
            .iter()
            .map(|g| serde_json::from_str(g).unwrap())
            .collect();

        let mut text = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let mut finish = Vec::new();
        for c in &chunks[..chunks.len() - 1] {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert_eq!(c["id"], "msg_014p7gG3wDgGV9EUtLvnow3U");
            assert_eq!(c["model"], "claude-sonnet-4-5-20250929");
            let choice = &c["choices"][0];
            assert_eq!(choice["index"], 0);
            if !choice["finish_reason"].is_null() {
                finish.push(choice["finish_reason"].clone());
            }
            let delta = &choice["delta"];
            if let Some(t) = delta["content"].as_str() {
                text.push_str(t);
            }
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                let i = usize::try_from(call["index"].as_u64().unwrap()).unwrap();
                if i == calls.len() {
                    assert_eq!(call["type"], "function");
                    calls.push(Default::default());
                }
                let entry = &mut calls[i];
                if let Some(id) = call["id"].as_str() {
                    entry.0.push_str(id);
                }
                if let Some(name) = call["function"]["name"].as_str() {
                    entry.1.push_str(name);
                }
                if let Some(a) = call["function"]["arguments"].as_str() {
                    entry.2.push_str(a);
                }
            }
        }
        assert_eq!(
            text,
            "Okay, let's check the weather for San Francisco, CA: And the time there:"
        );
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].0, "toolu_01T1x1fJ34qAmk2tNTrN7Up6");
        assert_eq!(calls[0].1, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].2).unwrap(),
            json!({ "location": "San Francisco, CA", "unit": "fahrenheit" })
        );
        assert_eq!(calls[1].0, "toolu_01GhT5kR8aNvYw3QmLp2XcBz");
        assert_eq!(calls[1].1, "get_time");
        assert_eq!(calls[1].2, "{}");
        assert_eq!(finish, vec![json!("tool_calls")]);

        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({
                "prompt_tokens": 500, "completion_tokens": 89, "total_tokens": 589,
                "prompt_tokens_details": { "cached_tokens": 28 }
            })
        );
    }

    #[test]
    fn stream_edges() {
        let mut t = MessagesStream::new(false);
        assert!(t.on_event(r#"{"type":"ping"}"#).unwrap().is_empty());
        assert!(t
            .on_event(r#"{"type":"some_future_event"}"#)
            .unwrap()
            .is_empty());
        assert!(matches!(t.on_event("{oops"), Err(TranslateError::Json(_))));
        assert!(t
            .on_event(r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#)
            .unwrap()
            .is_empty());
        let out = t.on_event(r#"{"type":"message_stop"}"#).unwrap();
        assert_eq!(out, vec![Frame::DONE]);
        assert!(t.on_event(r#"{"type":"message_stop"}"#).unwrap().is_empty());
    }

    #[test]
    fn stream_error_event_is_openai_shaped_and_carries_numeric_status() {
        let mut t = MessagesStream::new(true);
        let out = t
            .on_event(fixture!("error_overloaded.json").trim())
            .unwrap();
        assert_eq!(out.len(), 1);
        let s = std::str::from_utf8(&out[0].raw).unwrap();
        let body: Value =
            serde_json::from_str(s.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(body["error"]["code"], "overloaded");
        assert_eq!(body["error"]["param"], Value::Null);
        assert_eq!(body["error"]["status"], json!(529));
        assert_eq!(body["error"]["message"], "Overloaded");
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(
            crate::sse::error_code(&body["error"].to_string()),
            Some(529),
            "the gateway reads it as an in-band status"
        );

        let out = t
            .on_event(fixture!("error_rate_limit.json").trim())
            .unwrap();
        let s = std::str::from_utf8(&out[0].raw).unwrap();
        assert!(s.contains(r#""status":429"#), "{s}");
        let body = &s["data: ".len()..].trim_end();
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(crate::sse::error_code(&v["error"].to_string()), Some(429));
    }

    /// The status an error body's type maps to.
    fn error_status(body: &[u8]) -> Option<u16> {
        anthropic_error(body).map(|(kind, _)| status_of(&kind))
    }

    #[test]
    fn error_statuses() {
        assert_eq!(
            error_status(fixture!("error_overloaded.json").as_bytes()),
            Some(529)
        );
        assert_eq!(
            error_status(fixture!("error_rate_limit.json").as_bytes()),
            Some(429)
        );
        assert_eq!(
            error_status(fixture!("error_auth.json").as_bytes()),
            Some(401)
        );
        assert_eq!(
            error_status(fixture!("error_context.json").as_bytes()),
            Some(400)
        );
        for (kind, status) in [
            ("permission_error", 403),
            ("not_found_error", 404),
            ("request_too_large", 413),
            ("api_error", 500),
            ("billing_error", 402),
            ("timeout_error", 504),
            ("brand_new_error", 500),
        ] {
            let body = json!({ "type": "error", "error": { "type": kind, "message": "m" } });
            assert_eq!(
                error_status(body.to_string().as_bytes()),
                Some(status),
                "{kind}"
            );
        }
        // An OpenAI error body, a message and junk are not Anthropic errors.
        let openai = br#"{"error":{"message":"x","type":"invalid_request_error","code":null}}"#;
        assert_eq!(error_status(openai), None);
        assert_eq!(
            error_status(fixture!("text_response.anthropic.json").as_bytes()),
            None
        );
        assert_eq!(error_status(b"<html>502</html>"), None);
        assert_eq!(to_openai_error(openai), None);
    }

    #[test]
    fn errors_become_openai_errors() {
        let conv = |body: &str| -> Value {
            serde_json::from_slice(&to_openai_error(body.as_bytes()).unwrap()).unwrap()
        };
        let e = conv(fixture!("error_context.json"));
        assert_eq!(
            e["error"]["message"],
            "prompt is too long: 210000 tokens > 200000 maximum"
        );
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["code"], "context_length_exceeded");
        assert!(crate::classify::is_context_length(&e.to_string()));

        let e = conv(fixture!("error_rate_limit.json"));
        assert_eq!(e["error"]["type"], "rate_limit_error");
        assert_eq!(e["error"]["code"], "rate_limit_exceeded");
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("This request would exceed"));
        assert!(!crate::classify::is_context_length(&e.to_string()));

        let e = conv(fixture!("error_auth.json"));
        assert_eq!(
            e["error"],
            json!({ "message": "invalid x-api-key", "type": "authentication_error", "code": "invalid_api_key", "param": null })
        );
        let e = conv(fixture!("error_overloaded.json"));
        assert_eq!(e["error"]["code"], "overloaded");

        let plain = conv(
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Field required"}}"#,
        );
        assert_eq!(plain["error"]["code"], "invalid_request");
    }

    #[test]
    fn tool_choice_variants() {
        let tools = json!([{ "type": "function", "function": { "name": "f" } }]);
        for (choice, want) in [
            (json!("auto"), json!({ "type": "auto" })),
            (json!("required"), json!({ "type": "any" })),
            (json!("none"), json!({ "type": "none" })),
            (
                json!({ "type": "function", "function": { "name": "f" } }),
                json!({ "type": "tool", "name": "f" }),
            ),
        ] {
            let got = request(json!({
                "messages": [{ "role": "user", "content": "hi" }],
                "tools": tools, "tool_choice": choice,
            }))
            .unwrap();
            assert_eq!(got["tool_choice"], want);
        }
        // Parallel calls off without a tool_choice; tool_choice without tools is dropped.
        let got = request(json!({
            "messages": [{ "role": "user", "content": "hi" }],
            "tools": tools, "parallel_tool_calls": false,
        }))
        .unwrap();
        assert_eq!(
            got["tool_choice"],
            json!({ "type": "auto", "disable_parallel_tool_use": true })
        );
        let got = request(json!({
            "messages": [{ "role": "user", "content": "hi" }], "tool_choice": "auto", "tools": [],
        }))
        .unwrap();
        assert!(got.get("tool_choice").is_none() && got.get("tools").is_none());
        assert!(matches!(
            request(
                json!({ "messages": [{ "role": "user", "content": "hi" }], "tools": tools, "tool_choice": "sometimes" })
            ),
            Err(TranslateError::InvalidRequest(_))
        ));
    }

    #[test]
    fn request_parameters() {
        let base = |extra: Value| {
            let mut v = json!({ "messages": [{ "role": "user", "content": "hi" }] });
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            request(v).unwrap()
        };
        let got = base(json!({}));
        assert_eq!(
            got,
            json!({ "model": "claude-x", "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 1000 })
        );
        assert_eq!(base(json!({ "max_tokens": 7 }))["max_tokens"], 7);
        assert_eq!(
            base(json!({ "max_tokens": 7, "max_completion_tokens": 9 }))["max_tokens"],
            9
        );
        assert_eq!(base(json!({ "max_tokens": null }))["max_tokens"], 1000);
        assert_eq!(base(json!({ "stop": "x" }))["stop_sequences"], json!(["x"]));
        assert_eq!(
            base(json!({ "stop": ["a", "b"] }))["stop_sequences"],
            json!(["a", "b"])
        );
        assert!(base(json!({ "stop": [] })).get("stop_sequences").is_none());
        assert_eq!(
            base(json!({ "temperature": 1.7 }))["temperature"],
            json!(1.0)
        );
        assert_eq!(base(json!({ "temperature": 0 }))["temperature"], json!(0));
        assert_eq!(base(json!({ "stream": false }))["stream"], json!(false));
        assert_eq!(base(json!({ "n": 1 })).get("n"), None);
    }

    #[test]
    fn request_errors() {
        let bad_args = request(json!({ "messages": [
            { "role": "user", "content": "hi" },
            { "role": "assistant", "tool_calls": [
                { "id": "call_1", "type": "function", "function": { "name": "f", "arguments": "{\"a\": " } }
            ] },
        ] }));
        assert!(
            matches!(&bad_args, Err(TranslateError::ToolArguments { id, .. }) if id == "call_1"),
            "{bad_args:?}"
        );
        let not_object = request(json!({ "messages": [
            { "role": "assistant", "tool_calls": [
                { "id": "call_2", "type": "function", "function": { "name": "f", "arguments": "[1]" } }
            ] },
        ] }));
        assert!(matches!(
            not_object,
            Err(TranslateError::ToolArguments { .. })
        ));

        assert!(matches!(
            request(json!({})),
            Err(TranslateError::InvalidRequest(_))
        ));
        assert!(matches!(
            request(json!({ "messages": [{ "role": "system", "content": "only" }] })),
            Err(TranslateError::InvalidRequest(_))
        ));
        assert!(matches!(
            request(json!({ "messages": [{ "role": "function", "name": "f", "content": "x" }] })),
            Err(TranslateError::Unsupported(_))
        ));
        assert!(matches!(
            request(json!({ "messages": [{ "role": "user", "content": "hi" }], "n": 2 })),
            Err(TranslateError::Unsupported(_))
        ));
        let audio = json!({ "messages": [{ "role": "user", "content": [
            { "type": "input_audio", "input_audio": { "data": "AAAA", "format": "wav" } }
        ] }] });
        assert!(matches!(
            request(audio),
            Err(TranslateError::Unsupported(_))
        ));
        let not_base64 = json!({ "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": "data:image/svg+xml,<svg/>" } }
        ] }] });
        assert!(matches!(
            request(not_base64),
            Err(TranslateError::Unsupported(_))
        ));
        assert!(matches!(
            request(json!({ "messages": [{ "role": "user", "content": "hi" }],
                "tools": [{ "type": "code_interpreter" }] })),
            Err(TranslateError::Unsupported(_))
        ));
    }

    #[test]
    fn a_pdf_file_part_becomes_a_document_block_and_other_files_are_unsupported() {
        let file = |file: Value| {
            json!({ "messages": [{ "role": "user", "content": [
            { "type": "text", "text": "read this" }, { "type": "file", "file": file }] }] })
        };
        let got = request(file(json!({ "filename": "a.pdf",
            "file_data": "data:application/pdf;base64,JVBERi0=" })))
        .unwrap();
        assert_eq!(
            got["messages"][0]["content"][1],
            json!({ "type": "document", "title": "a.pdf",
                "source": { "type": "base64", "media_type": "application/pdf", "data": "JVBERi0=" } })
        );
        for other in [
            json!({ "file_data": "data:text/csv;base64,YSxi" }),
            json!({ "file_id": "file-1" }),
            json!({ "file_data": "https://x/a.pdf" }),
        ] {
            let got = request(file(other.clone()));
            assert!(
                matches!(got, Err(TranslateError::Unsupported(_))),
                "{other}: {got:?}"
            );
        }
    }

    #[test]
    fn asks_the_answer_could_not_carry_are_unsupported() {
        let hi = || json!([{ "role": "user", "content": "hi" }]);
        let unsupported = [
            json!({ "messages": hi(), "audio": { "voice": "alloy", "format": "wav" } }),
            json!({ "messages": hi(), "modalities": ["text", "audio"] }),
            json!({ "messages": hi(), "logprobs": true }),
            json!({ "messages": hi(), "top_logprobs": 3 }),
            json!({ "messages": hi(), "response_format": { "type": "json_object" } }),
            json!({ "messages": hi(), "response_format": { "type": "json_schema",
                "json_schema": { "name": "x", "schema": { "type": "object" } } } }),
        ];
        for body in unsupported {
            let got = request(body.clone());
            assert!(
                matches!(got, Err(TranslateError::Unsupported(_))),
                "{body}: {got:?}"
            );
        }
        let fine = json!({ "messages": hi(), "audio": null, "modalities": ["text"],
            "logprobs": false, "top_logprobs": null, "response_format": { "type": "text" } });
        let got = request(fine).unwrap();
        for dropped in [
            "audio",
            "modalities",
            "logprobs",
            "top_logprobs",
            "response_format",
        ] {
            assert!(got.get(dropped).is_none(), "{got}");
        }
    }

    #[test]
    fn empty_messages_are_skipped_and_neighbours_merged() {
        let got = request(json!({ "messages": [
            { "role": "user", "content": "a" },
            { "role": "assistant", "content": "" },
            { "role": "user", "content": "b" },
        ] }))
        .unwrap();
        assert_eq!(
            got["messages"],
            json!([{ "role": "user", "content": [
                { "type": "text", "text": "a" }, { "type": "text", "text": "b" }
            ] }])
        );
    }
}
