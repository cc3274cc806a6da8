//! OpenAI Chat Completions <-> Google Gemini `generateContent`, as pure
//! translation: no I/O.
//!
//! The request side turns a parsed OpenAI chat request into the body of
//! `models/{model}:generateContent` (the same body serves
//! `:streamGenerateContent?alt=sse`); the URL, the key and the headers are
//! the caller's business. The response side turns a `GenerateContentResponse`,
//! a Google error body, or a stream event by event back into what an OpenAI
//! client expects. Embeddings go to `:batchEmbedContents` and back.
//!
//! What does not map is handled on purpose, never silently wrong: OpenAI
//! fields Gemini has no counterpart for are dropped (Gemini rejects unknown
//! fields), while content that would change meaning if dropped (unknown
//! content parts, non-function tools, legacy `functions`) and asks the answer
//! could not carry (audio output, `logprobs`, several choices in a stream)
//! are a [`TranslateError`].
//!
//! Two things Gemini does differently shape the code:
//! - It has no explicit end of stream: the event carrying a `finishReason`
//!   ends it, and [`GeminiStream`] writes the finish, usage and `[DONE]` there.
//! - Gemini 3 rejects a replayed `functionCall` without its `thoughtSignature`,
//!   which an OpenAI client never holds: every replayed call carries Google's
//!   documented sentinel `skip_thought_signature_validator` (older models
//!   accept and ignore it).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::chunk::{self, completion_id, now_secs, Delta, Frame, Head};
use super::non_null;
use super::translate::{
    content_parts, data_url, function_tools, image_url, invalid, max_tokens, messages_with_roles,
    part_kind, push_turn, refuse_untranslatable, stop_sequences, tool_call, unsupported, wire,
    ToolCall, TranslateError, Turn,
};
use super::Malformed;

/// The `thoughtSignature` sent with every replayed `functionCall` part: Google's
/// documented sentinel for a call whose real signature was not kept.
const SKIP_SIGNATURE: &str = "skip_thought_signature_validator";

/// The protocol's name in a refusal.
const API: &str = "the Gemini API";

/// The status an in-band error gets when it names none (as the gateway reads
/// an in-band error without a code).
const IN_BAND_FALLBACK_STATUS: u16 = 502;

/// The Gemini API (`protocol: gemini`), and the Gemini road of Vertex AI.
#[derive(Debug)]
pub struct Gemini;

/// The Gemini API's endpoint.
pub const GEMINI_BASE_URL: &str = "https://generativelanguage.googleapis.com/v1beta";

/// A model name as the URL wants it (`models/` is the path's own).
fn bare(model: &str) -> &str {
    model.strip_prefix("models/").unwrap_or(model)
}

impl super::Adapter for Gemini {
    fn name(&self) -> &'static str {
        "gemini"
    }

    fn chat_path(&self) -> &'static str {
        "models/{model}:generateContent"
    }

    fn call_path(&self, op: super::Operation, model: &str, stream: bool) -> Option<String> {
        let model = super::path_segment(bare(model));
        match (op, stream) {
            (super::Operation::Chat, false) => Some(format!("models/{model}:generateContent")),
            (super::Operation::Chat, true) => {
                Some(format!("models/{model}:streamGenerateContent?alt=sse"))
            }
            (super::Operation::Embeddings, _) => Some(format!("models/{model}:batchEmbedContents")),
            (super::Operation::CountTokens, _) => None,
        }
    }

    fn default_base_url(&self, _place: &super::Place<'_>) -> Result<String, String> {
        Ok(GEMINI_BASE_URL.to_owned())
    }

    fn required_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }

    fn key_header(&self) -> (&'static str, &'static str) {
        ("x-goog-api-key", "")
    }

    fn embeddings_path(&self) -> Option<&'static str> {
        Some("models/{model}:batchEmbedContents")
    }

    fn encode(
        &self,
        request: &crate::request::ChatRequest<'_>,
        target: super::TargetModel<'_>,
    ) -> Result<Bytes, super::Unsupported> {
        let object = request
            .to_object()
            .map_err(|e| super::Unsupported(e.to_string()))?;
        let body = to_gemini_request(&object, target.max_output).map_err(|e| e.refusal(API))?;
        Ok(Bytes::from(body.to_string()))
    }

    fn encode_embeddings(
        &self,
        request: &crate::request::EmbeddingsRequest<'_>,
        model: &str,
    ) -> Result<Bytes, super::Unsupported> {
        let object = request
            .to_object()
            .map_err(|e| super::Unsupported(e.to_string()))?;
        let body = to_embed_request(&object, bare(model)).map_err(|e| e.refusal(API))?;
        Ok(Bytes::from(body.to_string()))
    }

    fn decode_answer(&self, body: Bytes, model: &str) -> Result<Bytes, super::Malformed> {
        from_gemini_response(&body, model).map_err(|e| super::Malformed(e.to_string()))
    }

    fn decode_embeddings(&self, body: Bytes, model: &str) -> Result<Bytes, super::Malformed> {
        from_embed_response(&body, model).map_err(|e| super::Malformed(e.to_string()))
    }

    fn decode_error(
        &self,
        status: http::StatusCode,
        _headers: &http::HeaderMap,
        body: Bytes,
    ) -> super::ErrorAnswer {
        let (code, body, wait) = decode_error(status.as_u16(), &body);
        super::ErrorAnswer {
            status: http::StatusCode::from_u16(code).unwrap_or(status),
            body,
            wait,
        }
    }

    fn stream_translator(
        &self,
        include_usage: bool,
        model: &str,
    ) -> Option<Box<dyn super::StreamTranslator>> {
        Some(Box::new(GeminiStream::new(include_usage, model)))
    }
}

// ---------------------------------------------------------------------------
// Request: OpenAI -> Gemini
// ---------------------------------------------------------------------------

/// OpenAI chat request object -> Gemini `generateContent` body (same body for
/// `streamGenerateContent`). `max_output` is the target's limit, sent as
/// `maxOutputTokens` when the request gives neither `max_completion_tokens`
/// nor `max_tokens`.
///
/// System and developer messages become `systemInstruction` (joined by a
/// blank line); `assistant` turns are Gemini's `model` turns; consecutive
/// same-role turns are merged; `tool` messages become `functionResponse`
/// parts of a `user` turn, named by the assistant tool call they answer.
/// `parallel_tool_calls`, `logit_bias`, `user`, `metadata`, `store`,
/// `stream_options` and other unknown fields are dropped: Gemini has no
/// counterpart and rejects unknown fields.
///
/// # Errors
/// A malformed request ([`TranslateError::InvalidRequest`],
/// [`TranslateError::ToolArguments`]) or one Gemini cannot express
/// ([`TranslateError::Unsupported`]).
pub fn to_gemini_request(
    chat: &Map<String, Value>,
    max_output: Option<u64>,
) -> Result<Value, TranslateError> {
    let messages = chat
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("`messages` must be an array"))?;
    unanswerable(chat)?;
    if non_null(chat, "functions").is_some() || non_null(chat, "function_call").is_some() {
        return Err(unsupported(
            "legacy `functions` / `function_call` (use `tools` / `tool_choice`)",
        ));
    }
    let (system, turns) = conversation(messages)?;
    if turns.is_empty() {
        return Err(invalid("no user or assistant message with content"));
    }
    let mut out = Map::new();
    let contents: Vec<Value> = turns
        .into_iter()
        .map(|t| json!({ "role": t.role, "parts": t.blocks }))
        .collect();
    out.insert("contents".into(), Value::Array(contents));
    if !system.is_empty() {
        out.insert(
            "systemInstruction".into(),
            json!({ "parts": [{ "text": system.join("\n\n") }] }),
        );
    }
    add_tools(chat, &mut out)?;
    let config = generation_config(chat, max_output)?;
    if !config.is_empty() {
        out.insert("generationConfig".into(), Value::Object(config));
    }
    Ok(Value::Object(out))
}

/// Asks whose answer Gemini could not give: audio output, log probabilities,
/// several choices in one stream (a chunk has one choice index here), and
/// web search (a tool Gemini has, but not under this request's terms).
fn unanswerable(chat: &Map<String, Value>) -> Result<(), TranslateError> {
    refuse_untranslatable(chat)?;
    if non_null(chat, "web_search_options").is_some() {
        return Err(unsupported("`web_search_options`"));
    }
    let stream = non_null(chat, "stream").and_then(Value::as_bool) == Some(true);
    let several = non_null(chat, "n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n > 1);
    if stream && several {
        return Err(unsupported("`n` > 1 with `stream`"));
    }
    Ok(())
}

/// The system texts and the merged turns of the OpenAI messages.
fn conversation(messages: &[Value]) -> Result<(Vec<String>, Vec<Turn>), TranslateError> {
    let mut system: Vec<String> = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    // Tool call id -> function name, for the tool messages that answer them.
    let mut names: HashMap<String, String> = HashMap::new();
    for read in messages_with_roles(messages) {
        let (at, message, role) = read?;
        match role {
            "system" | "developer" => system.extend(system_texts(message.get("content"), &at)?),
            "user" => push_turn(&mut turns, "user", user_parts(message.get("content"), &at)?),
            "assistant" => {
                let parts = assistant_parts(message, &at, &mut names)?;
                push_turn(&mut turns, "model", parts);
            }
            "tool" => push_turn(
                &mut turns,
                "user",
                vec![tool_response(message, &at, &names)?],
            ),
            "function" => {
                return Err(unsupported(format!(
                    "{at}: legacy `function` role (use `tool` messages)"
                )))
            }
            other => return Err(unsupported(format!("{at}: role `{other}`"))),
        }
    }
    Ok((system, turns))
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

fn text_part(text: &str) -> Value {
    json!({ "text": text })
}

fn user_parts(content: Option<&Value>, at: &str) -> Result<Vec<Value>, TranslateError> {
    let mut out = Vec::new();
    for (j, part) in content_parts(content, at)?.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) => {
                if !t.is_empty() {
                    out.push(text_part(t));
                }
            }
            ("image_url", _) => out.push(image_part(part, &at)?),
            ("input_audio", _) => out.push(audio_part(part, &at)?),
            ("file", _) => out.push(file_part(part, &at)?),
            (kind, _) => return Err(unsupported(format!("{at}: `{kind}` content part"))),
        }
    }
    Ok(out)
}

fn inline_data(mime_type: &str, data: &str) -> Value {
    json!({ "inlineData": { "mimeType": mime_type, "data": data } })
}

/// An image's media type from its URL's extension (query and fragment
/// ignored); `image/jpeg` when it says nothing (Gemini requires one).
fn image_mime(url: &str) -> &'static str {
    let path = url.split(['?', '#']).next().unwrap_or_default();
    let ext = path
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "webp" => "image/webp",
        "gif" => "image/gif",
        "heic" => "image/heic",
        "heif" => "image/heif",
        _ => "image/jpeg",
    }
}

/// `{"type":"image_url","image_url":{"url":...}}` -> `inlineData` (a data
/// URL) or `fileData` (an http(s) or `gs://` URL, which Gemini fetches).
fn image_part(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let url = image_url(part, at)?;
    if url.starts_with("data:") {
        let (mime, data) = data_url(url, at)?;
        Ok(inline_data(mime, data))
    } else if ["https://", "http://", "gs://"]
        .iter()
        .any(|s| url.starts_with(s))
    {
        Ok(json!({ "fileData": { "mimeType": image_mime(url), "fileUri": url } }))
    } else {
        Err(unsupported(format!(
            "{at}: image URL scheme (only data:, http:, https: and gs:)"
        )))
    }
}

/// `{"type":"input_audio","input_audio":{"data","format"}}` -> `inlineData`.
fn audio_part(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let audio = part
        .get("input_audio")
        .ok_or_else(|| invalid(format!("{at}: input_audio part without `input_audio`")))?;
    let data = audio
        .get("data")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.input_audio.data must be a string")))?;
    let mime = match audio.get("format").and_then(Value::as_str) {
        Some("wav") => "audio/wav",
        Some("mp3") => "audio/mp3",
        Some(other) => return Err(unsupported(format!("{at}: audio format `{other}`"))),
        None => return Err(invalid(format!("{at}.input_audio.format must be a string"))),
    };
    Ok(inline_data(mime, data))
}

/// `{"type":"file","file":{"file_data":"data:..."}}` -> `inlineData`; an
/// uploaded `file_id` means nothing to Gemini.
fn file_part(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let file = part
        .get("file")
        .ok_or_else(|| invalid(format!("{at}: file part without `file`")))?;
    match file.get("file_data").and_then(Value::as_str) {
        Some(url) if url.starts_with("data:") => {
            let (mime, data) = data_url(url, at)?;
            Ok(inline_data(mime, data))
        }
        Some(_) => Err(unsupported(format!(
            "{at}: `file_data` that is not a data URL"
        ))),
        None if file.get("file_id").is_some() => {
            Err(unsupported(format!("{at}: file by `file_id`")))
        }
        None => Err(invalid(format!("{at}: file part without `file_data`"))),
    }
}

/// An assistant message's text and tool calls, as `model` parts; each call's
/// name is noted under its id for the tool messages that answer it.
fn assistant_parts(
    message: &Map<String, Value>,
    at: &str,
    names: &mut HashMap<String, String>,
) -> Result<Vec<Value>, TranslateError> {
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
                    out.push(text_part(t));
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
        let (id, name, part) = function_call_part(call, &format!("{at}.tool_calls[{k}]"))?;
        names.insert(id, name);
        out.push(part);
    }
    Ok(out)
}

/// One OpenAI tool call -> (id, name, Gemini `functionCall` part).
fn function_call_part(call: &Value, at: &str) -> Result<(String, String, Value), TranslateError> {
    let ToolCall { id, name, input } = tool_call(call, at)?;
    let part = json!({
        "functionCall": { "name": name, "args": input, "id": id },
        "thoughtSignature": SKIP_SIGNATURE,
    });
    Ok((id.to_owned(), name.to_owned(), part))
}

/// A `tool` message -> a `functionResponse` part, named by the earlier
/// assistant tool call whose id it answers. Its content is the response as
/// is when it is a JSON object, else `{"content": <text>}`.
fn tool_response(
    message: &Map<String, Value>,
    at: &str,
    names: &HashMap<String, String>,
) -> Result<Value, TranslateError> {
    let id = message
        .get("tool_call_id")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.tool_call_id must be a string")))?;
    let name = names.get(id).ok_or_else(|| {
        invalid(format!(
            "{at}.tool_call_id `{id}` answers no earlier assistant tool call"
        ))
    })?;
    let mut text = String::new();
    for (j, part) in content_parts(message.get("content"), at)?
        .into_iter()
        .enumerate()
    {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) => text.push_str(t),
            (kind, _) => {
                return Err(unsupported(format!(
                    "{at}: `{kind}` part in a tool message"
                )))
            }
        }
    }
    let response = match serde_json::from_str::<Value>(&text) {
        Ok(object @ Value::Object(_)) => object,
        Ok(_) | Err(_) => json!({ "content": text }),
    };
    Ok(json!({ "functionResponse": { "name": name, "id": id, "response": response } }))
}

/// `tools` and `tool_choice` as Gemini's `tools` and `toolConfig`. Gemini has
/// no switch for parallel calls: `parallel_tool_calls` is dropped (a client
/// must handle several calls in one answer anyway).
fn add_tools(
    chat: &Map<String, Value>,
    out: &mut Map<String, Value>,
) -> Result<(), TranslateError> {
    let declarations = match non_null(chat, "tools") {
        Some(t) => function_declarations(t)?,
        None => Vec::new(),
    };
    if declarations.is_empty() {
        return Ok(());
    }
    out.insert(
        "tools".into(),
        json!([{ "functionDeclarations": declarations }]),
    );
    if let Some(choice) = non_null(chat, "tool_choice") {
        out.insert(
            "toolConfig".into(),
            json!({ "functionCallingConfig": function_calling_config(choice)? }),
        );
    }
    Ok(())
}

fn function_declarations(tools: &Value) -> Result<Vec<Value>, TranslateError> {
    let read = function_tools(tools)?;
    let mut out = Vec::with_capacity(read.len());
    for tool in read {
        let mut declaration = Map::new();
        declaration.insert("name".into(), Value::from(tool.name));
        if let Some(d) = tool.description {
            declaration.insert("description".into(), Value::from(d));
        }
        if let Some(p) = tool.parameters {
            let schema = clean_schema(p, &format!("{}.function.parameters", tool.at))?;
            // Gemini rejects an OBJECT with empty `properties`: a function
            // without parameters has none at all.
            if schema.get("properties").is_some() {
                declaration.insert("parameters".into(), schema);
            }
        }
        out.push(Value::Object(declaration));
    }
    Ok(out)
}

/// OpenAI `tool_choice` -> Gemini `functionCallingConfig`.
fn function_calling_config(choice: &Value) -> Result<Value, TranslateError> {
    match choice {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(json!({ "mode": "AUTO" })),
            "none" => Ok(json!({ "mode": "NONE" })),
            "required" => Ok(json!({ "mode": "ANY" })),
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
            Ok(json!({ "mode": "ANY", "allowedFunctionNames": [name] }))
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => {
            Err(invalid("`tool_choice` must be a string or an object"))
        }
    }
}

// ---------------------------------------------------------------------------
// JSON Schema -> Gemini Schema (an OpenAPI 3.0 subset)
// ---------------------------------------------------------------------------

/// Keywords Gemini's `Schema` accepts as they are. Every other keyword is
/// dropped (`$schema`, `additionalProperties`, `strict`, `$id`, `examples`,
/// `uniqueItems`, ...): they constrain validation, and Gemini rejects them.
const SCHEMA_KEYS: &[&str] = &[
    "title",
    "description",
    "nullable",
    "required",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minLength",
    "maxLength",
    "pattern",
    "example",
    "default",
    "minimum",
    "maximum",
    "propertyOrdering",
];

/// The `format`s Gemini accepts (others are dropped: a hint, not a shape).
const SCHEMA_FORMATS: &[&str] = &["enum", "date-time", "int32", "int64", "float", "double"];

/// How deep `$ref`s and subschemas may nest (a recursive `$ref` never ends).
const MAX_SCHEMA_DEPTH: usize = 32;

/// A JSON Schema (tool parameters, a response schema) as Gemini's `Schema`:
/// `$ref`s into `$defs`/`definitions` inlined, a one-element `allOf` merged,
/// `oneOf` read as `anyOf`, a `null` type (in `type` or `anyOf`) as
/// `nullable`, `const` as a one-value `enum`, unknown keywords dropped.
/// Recursive `$ref`s, external `$ref`s, several-element `allOf` and
/// several non-null types are [`TranslateError::Unsupported`].
fn clean_schema(schema: &Value, at: &str) -> Result<Value, TranslateError> {
    let defs = schema
        .get("$defs")
        .or_else(|| schema.get("definitions"))
        .and_then(Value::as_object);
    clean(schema, defs, at, 0)
}

fn clean(
    schema: &Value,
    defs: Option<&Map<String, Value>>,
    at: &str,
    depth: usize,
) -> Result<Value, TranslateError> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(unsupported(format!(
            "{at}: schema nested too deep (a recursive `$ref`?)"
        )));
    }
    let obj = match schema {
        Value::Object(o) => o,
        Value::Bool(true) => return Ok(Value::Object(Map::new())),
        Value::Null
        | Value::Bool(false)
        | Value::Number(_)
        | Value::String(_)
        | Value::Array(_) => return Err(invalid(format!("{at}: a schema must be an object"))),
    };
    if let Some(merged) = inlined(obj, defs, at)? {
        return clean(&Value::Object(merged), defs, at, depth + 1);
    }
    let mut out = Map::new();
    for (key, value) in obj {
        match key.as_str() {
            "type" => schema_type(value, &mut out, at)?,
            "properties" => {
                let props = value
                    .as_object()
                    .ok_or_else(|| invalid(format!("{at}.properties must be an object")))?;
                let mut cleaned = Map::new();
                for (name, sub) in props {
                    let sub = clean(sub, defs, &format!("{at}.properties.{name}"), depth + 1)?;
                    cleaned.insert(name.clone(), sub);
                }
                if !cleaned.is_empty() {
                    out.insert("properties".into(), Value::Object(cleaned));
                }
            }
            "items" if value.is_array() => {
                return Err(unsupported(format!("{at}.items: a tuple (array) schema")))
            }
            "items" => {
                let items = clean(value, defs, &format!("{at}.items"), depth + 1)?;
                out.insert("items".into(), items);
            }
            "anyOf" | "oneOf" => any_of(value, defs, &mut out, &format!("{at}.{key}"), depth)?,
            // Gemini's enums are of strings: a numeric one is dropped (a
            // validation hint) rather than answered with a 400.
            "enum"
                if value
                    .as_array()
                    .is_some_and(|v| v.iter().all(Value::is_string)) =>
            {
                out.insert("enum".into(), value.clone());
            }
            "const" if value.is_string() => {
                out.insert("enum".into(), json!([value]));
            }
            "format" if value.as_str().is_some_and(|f| SCHEMA_FORMATS.contains(&f)) => {
                out.insert("format".into(), value.clone());
            }
            k if SCHEMA_KEYS.contains(&k) => {
                out.insert(key.clone(), value.clone());
            }
            _ => {}
        }
    }
    Ok(Value::Object(out))
}

/// The schema a `$ref` or a one-element `allOf` stands for, with the
/// siblings (a `description`, say) laid over it; `None` for a plain schema.
fn inlined(
    obj: &Map<String, Value>,
    defs: Option<&Map<String, Value>>,
    at: &str,
) -> Result<Option<Map<String, Value>>, TranslateError> {
    let (key, target) = if let Some(r) = obj.get("$ref") {
        let r = r
            .as_str()
            .ok_or_else(|| invalid(format!("{at}.$ref must be a string")))?;
        let name = r
            .strip_prefix("#/$defs/")
            .or_else(|| r.strip_prefix("#/definitions/"))
            .ok_or_else(|| unsupported(format!("{at}: `$ref` `{r}`")))?;
        let target = defs
            .and_then(|d| d.get(name))
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("{at}: `$ref` `{r}` names no definition")))?;
        ("$ref", target)
    } else if let Some(all) = obj.get("allOf") {
        match all.as_array().map(Vec::as_slice) {
            Some([Value::Object(one)]) => ("allOf", one),
            _ => return Err(unsupported(format!("{at}: `allOf` of several schemas"))),
        }
    } else {
        return Ok(None);
    };
    let mut merged = target.clone();
    for (k, v) in obj {
        if k != key {
            merged.insert(k.clone(), v.clone());
        }
    }
    Ok(Some(merged))
}

/// `type`: a name as is; `[T, "null"]` as `T` and `nullable`.
fn schema_type(
    value: &Value,
    out: &mut Map<String, Value>,
    at: &str,
) -> Result<(), TranslateError> {
    match value {
        Value::String(_) => {
            out.insert("type".into(), value.clone());
        }
        Value::Array(types) => {
            let nullable = types.iter().any(|t| t.as_str() == Some("null"));
            let rest: Vec<&Value> = types
                .iter()
                .filter(|t| t.as_str() != Some("null"))
                .collect();
            match rest.as_slice() {
                [one] if one.is_string() => {
                    out.insert("type".into(), (*one).clone());
                }
                _ => return Err(unsupported(format!("{at}.type: {value}"))),
            }
            if nullable {
                out.insert("nullable".into(), Value::Bool(true));
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => {
            return Err(invalid(format!("{at}.type must be a string or an array")))
        }
    }
    Ok(())
}

/// `anyOf` / `oneOf`: null members become `nullable`; a single member left
/// is merged into the schema; several stay an `anyOf`.
fn any_of(
    value: &Value,
    defs: Option<&Map<String, Value>>,
    out: &mut Map<String, Value>,
    at: &str,
    depth: usize,
) -> Result<(), TranslateError> {
    let members = value
        .as_array()
        .ok_or_else(|| invalid(format!("{at} must be an array")))?;
    let mut kept = Vec::with_capacity(members.len());
    for (i, member) in members.iter().enumerate() {
        if member.get("type").and_then(Value::as_str) == Some("null") {
            out.insert("nullable".into(), Value::Bool(true));
            continue;
        }
        kept.push(clean(member, defs, &format!("{at}[{i}]"), depth + 1)?);
    }
    match kept.len() {
        0 => {}
        1 => {
            if let Some(Value::Object(one)) = kept.pop() {
                out.extend(one);
            }
        }
        _ => {
            out.insert("anyOf".into(), Value::Array(kept));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// generationConfig
// ---------------------------------------------------------------------------

/// OpenAI sampling and output fields -> Gemini `generationConfig`.
fn generation_config(
    chat: &Map<String, Value>,
    max_output: Option<u64>,
) -> Result<Map<String, Value>, TranslateError> {
    let mut out = Map::new();
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
    ] {
        if let Some(v) = non_null(chat, from) {
            let f = v
                .as_f64()
                .ok_or_else(|| invalid(format!("`{from}` must be a number")))?;
            // Not every Gemini model takes penalties: a neutral one is not sent.
            let neutral = from.ends_with("_penalty") && f == 0.0;
            if !neutral {
                out.insert(to.into(), v.clone());
            }
        }
    }
    if let Some(n) = max_tokens(chat)?.or(max_output) {
        out.insert("maxOutputTokens".into(), Value::from(n));
    }
    if let Some(stop) = stop_sequences(chat)? {
        out.insert("stopSequences".into(), stop);
    }
    if let Some(n) = non_null(chat, "n") {
        let n = n
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| invalid("`n` must be a positive integer"))?;
        if n > 1 {
            out.insert("candidateCount".into(), Value::from(n));
        }
    }
    if let Some(seed) = non_null(chat, "seed") {
        if seed.as_i64().is_none() {
            return Err(invalid("`seed` must be an integer"));
        }
        out.insert("seed".into(), seed.clone());
    }
    response_format(chat, &mut out)?;
    if let Some(effort) = non_null(chat, "reasoning_effort") {
        out.insert(
            "thinkingConfig".into(),
            json!({ "thinkingBudget": thinking_budget(effort)? }),
        );
    }
    Ok(out)
}

/// `response_format`: JSON mode as `responseMimeType`, a JSON schema also as
/// `responseSchema` (cleaned like tool parameters).
fn response_format(
    chat: &Map<String, Value>,
    out: &mut Map<String, Value>,
) -> Result<(), TranslateError> {
    let Some(format) = non_null(chat, "response_format") else {
        return Ok(());
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some("json_object") => {
            out.insert("responseMimeType".into(), Value::from("application/json"));
        }
        Some("json_schema") => {
            out.insert("responseMimeType".into(), Value::from("application/json"));
            let schema = format.get("json_schema").and_then(|s| s.get("schema"));
            if let Some(schema) = schema.filter(|s| !s.is_null()) {
                let cleaned = clean_schema(schema, "response_format.json_schema.schema")?;
                out.insert("responseSchema".into(), cleaned);
            }
        }
        Some(other) => return Err(unsupported(format!("`response_format` type `{other}`"))),
        None => return Err(invalid("`response_format` must have a `type`")),
    }
    Ok(())
}

/// `reasoning_effort` -> `thinkingConfig.thinkingBudget` in tokens: `none` and
/// `minimal` 0 (no thinking; Gemini 2.5 Pro cannot turn it off and answers
/// 400), `low` 1024, `medium` 8192, `high` 24576 (Flash's ceiling). Thought
/// summaries (`includeThoughts`) are not asked for: the budget is the ask.
fn thinking_budget(effort: &Value) -> Result<u64, TranslateError> {
    match effort.as_str() {
        Some("none" | "minimal") => Ok(0),
        Some("low") => Ok(1024),
        Some("medium") => Ok(8192),
        Some("high") => Ok(24576),
        Some(other) => Err(unsupported(format!("`reasoning_effort` = `{other}`"))),
        None => Err(invalid("`reasoning_effort` must be a string")),
    }
}

// ---------------------------------------------------------------------------
// Response: Gemini -> OpenAI
// ---------------------------------------------------------------------------

/// A `GenerateContentResponse` (an answer, or one stream event), or an error
/// envelope: one read of the body.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reply {
    #[serde(default)]
    candidates: Vec<Candidate>,
    prompt_feedback: Option<PromptFeedback>,
    usage_metadata: Option<UsageMetadata>,
    model_version: Option<String>,
    response_id: Option<String>,
    error: Option<GoogleError>,
}

impl Reply {
    /// Whether it has anything of a `GenerateContentResponse` (`{}` or an
    /// object of some other API has not).
    fn is_answer(&self) -> bool {
        !self.candidates.is_empty()
            || self.prompt_feedback.is_some()
            || self.usage_metadata.is_some()
            || self.model_version.is_some()
            || self.response_id.is_some()
    }

    /// The reason the prompt was blocked, when no candidate came back.
    fn blocked(&self) -> Option<&str> {
        self.prompt_feedback
            .as_ref()
            .and_then(|f| f.block_reason.as_deref())
            .filter(|_| self.candidates.is_empty())
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Candidate {
    content: Option<Content>,
    finish_reason: Option<String>,
    index: Option<u32>,
}

#[derive(Deserialize)]
struct Content {
    #[serde(default)]
    parts: Vec<Part>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Part {
    text: Option<String>,
    #[serde(default)]
    thought: bool,
    function_call: Option<FunctionCall>,
}

#[derive(Deserialize)]
struct FunctionCall {
    name: Option<String>,
    args: Option<Box<RawValue>>,
    id: Option<String>,
}

impl FunctionCall {
    /// (id, name, arguments as JSON text): Gemini's id or a generated one,
    /// `{}` for absent or `null` args. A call without a name cannot be run,
    /// and args that are not an object are no arguments: no answer.
    fn read(&self) -> Result<(String, &str, String), TranslateError> {
        let name = self
            .name
            .as_deref()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                TranslateError::InvalidResponse("a functionCall without `name`".into())
            })?;
        let arguments = match self.args.as_deref().map(|raw| raw.get().trim()) {
            None | Some("null") => "{}".to_owned(),
            Some(object) if object.starts_with('{') => object.to_owned(),
            Some(_) => {
                return Err(TranslateError::InvalidResponse(
                    "a functionCall's args is not an object".into(),
                ))
            }
        };
        let id = match self.id.as_deref().filter(|id| !id.is_empty()) {
            Some(id) => id.to_owned(),
            None => format!("call_{:016x}", rand::random::<u64>()),
        };
        Ok((id, name, arguments))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PromptFeedback {
    block_reason: Option<String>,
}

/// Gemini `usageMetadata`.
#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "camelCase")]
struct UsageMetadata {
    prompt_token_count: Option<u64>,
    candidates_token_count: Option<u64>,
    thoughts_token_count: Option<u64>,
    cached_content_token_count: Option<u64>,
    tool_use_prompt_token_count: Option<u64>,
}

impl UsageMetadata {
    /// As OpenAI counts: the prompt includes cached and tool-use prompt
    /// tokens, the completion includes thoughts (also `reasoning_tokens`).
    /// `None` without any count (no usage is not zero usage).
    fn to_openai(self) -> Option<chunk::Usage> {
        if self.prompt_token_count.is_none() && self.candidates_token_count.is_none() {
            return None;
        }
        let thoughts = self.thoughts_token_count.unwrap_or(0);
        Some(chunk::Usage::new(
            self.prompt_token_count
                .unwrap_or(0)
                .saturating_add(self.tool_use_prompt_token_count.unwrap_or(0)),
            self.candidates_token_count
                .unwrap_or(0)
                .saturating_add(thoughts),
            self.cached_content_token_count.unwrap_or(0),
            thoughts,
        ))
    }
}

/// Gemini `finishReason` -> OpenAI `finish_reason`; `calls`: the candidate
/// made function calls.
///
/// `MAX_TOKENS` is `length`; the safety family (`SAFETY`, `RECITATION`,
/// `BLOCKLIST`, `PROHIBITED_CONTENT`, `SPII`, `LANGUAGE`, the `IMAGE_*`
/// ones) is `content_filter`. Everything else (`STOP`, `OTHER`,
/// `MALFORMED_FUNCTION_CALL`, `UNEXPECTED_TOOL_CALL`, unknown) is `stop`,
/// or `tool_calls` when the candidate did call: OpenAI has no reason for a
/// call the model botched, and its answer carries no call.
fn finish_reason(reason: &str, calls: bool) -> &'static str {
    match reason {
        "MAX_TOKENS" => "length",
        "SAFETY"
        | "RECITATION"
        | "BLOCKLIST"
        | "PROHIBITED_CONTENT"
        | "SPII"
        | "LANGUAGE"
        | "IMAGE_SAFETY"
        | "IMAGE_PROHIBITED_CONTENT"
        | "IMAGE_RECITATION" => "content_filter",
        _ if calls => "tool_calls",
        _ => "stop",
    }
}

/// Reads a body: not JSON is [`TranslateError::Json`], JSON of another shape
/// [`TranslateError::InvalidResponse`].
fn read_reply(body: &[u8]) -> Result<Reply, TranslateError> {
    serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            TranslateError::InvalidResponse(format!("not a GenerateContentResponse: {e}"))
        }
        serde_json::error::Category::Io
        | serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof => TranslateError::Json(e),
    })
}

/// Gemini `GenerateContentResponse` body -> OpenAI `chat.completion` JSON
/// bytes. `model` is the target's model name (Gemini's `modelVersion` wins
/// when present).
///
/// Each candidate is a choice: its text parts concatenated are the content
/// (`null` when there is no text but there are tool calls), `thought` parts
/// the `reasoning_content`, `functionCall` parts the `tool_calls`. A prompt
/// blocked before any candidate is an empty answer with `finish_reason`
/// `content_filter`, not an error.
///
/// A Google error envelope inside a 2xx is returned as `Ok`: the OpenAI
/// in-band error body `{"error":{"message","type","code","param":null,
/// "status":N}}`, `N` the HTTP status its Google `status` maps to.
///
/// # Errors
/// The body is not JSON ([`TranslateError::Json`]) or not a
/// `GenerateContentResponse` ([`TranslateError::InvalidResponse`]).
pub fn from_gemini_response(body: &[u8], model: &str) -> Result<Bytes, TranslateError> {
    let reply = match read_reply(body) {
        Ok(reply) => reply,
        // Vertex's `[{"error": ...}]`.
        Err(e) => match google_error(body) {
            Some(error) => return Ok(Bytes::from(in_band_error(&error).to_string())),
            None => return Err(e),
        },
    };
    if let Some(error) = &reply.error {
        return Ok(Bytes::from(in_band_error(error).to_string()));
    }
    if !reply.is_answer() {
        return Err(TranslateError::InvalidResponse(
            "not a GenerateContentResponse: no `candidates` or `promptFeedback`".into(),
        ));
    }
    if let Some(error) = reply
        .candidates
        .iter()
        .find_map(|c| botched(c.finish_reason.as_deref()))
    {
        return Ok(Bytes::from(error.to_string()));
    }
    let plain_stop = |c: &Candidate| c.finish_reason.as_deref().is_none_or(|r| r == "STOP");
    if !reply.candidates.is_empty()
        && reply
            .candidates
            .iter()
            .all(|c| plain_stop(c) && !says_something(c))
    {
        return Ok(Bytes::from(empty_answer().to_string()));
    }
    // Without a candidate, only a blocked prompt is an answer (an empty one
    // that says so); usage alone is none, as it is in a stream.
    if reply.candidates.is_empty() && reply.blocked().is_none() {
        return Err(TranslateError::InvalidResponse(
            "a GenerateContentResponse without a candidate or a block reason".into(),
        ));
    }
    let mut choices = Vec::with_capacity(reply.candidates.len().max(1));
    for (i, candidate) in reply.candidates.iter().enumerate() {
        let index = candidate
            .index
            .unwrap_or_else(|| u32::try_from(i).unwrap_or(u32::MAX));
        choices.push(read_candidate(candidate, index)?);
    }
    if choices.is_empty() {
        // Blocked: an empty answer says so.
        let reason = "content_filter";
        choices.push(wire::Choice {
            index: 0,
            message: wire::Message {
                role: "assistant",
                content: Some(String::new()),
                reasoning_content: None,
                tool_calls: Vec::new(),
            },
            logprobs: None,
            finish_reason: Some(reason),
        });
    }
    let id = reply.response_id.clone().unwrap_or_else(completion_id);
    let completion = wire::Completion {
        id: &id,
        object: "chat.completion",
        created: now_secs(),
        model: reply.model_version.as_deref().unwrap_or(model),
        choices: &choices,
        usage: reply.usage_metadata.and_then(UsageMetadata::to_openai),
    };
    serde_json::to_vec(&completion)
        .map(Bytes::from)
        .map_err(TranslateError::Json)
}

/// One candidate as a choice.
fn read_candidate(candidate: &Candidate, index: u32) -> Result<wire::Choice, TranslateError> {
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut tool_calls = Vec::new();
    let parts = candidate.content.as_ref().map_or(&[][..], |c| &c.parts);
    for part in parts {
        if let Some(call) = &part.function_call {
            let (id, name, arguments) = call.read()?;
            tool_calls.push(wire::ToolCall {
                id,
                kind: "function",
                function: wire::Function {
                    name: name.to_owned(),
                    arguments,
                },
            });
        } else if let Some(t) = &part.text {
            if part.thought {
                reasoning.push_str(t);
            } else {
                text.push_str(t);
            }
        }
    }
    let reason = candidate.finish_reason.as_deref().unwrap_or("STOP");
    Ok(wire::Choice {
        index,
        finish_reason: Some(finish_reason(reason, !tool_calls.is_empty())),
        message: wire::Message {
            role: "assistant",
            content: (tool_calls.is_empty() || !text.is_empty()).then_some(text),
            reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
            tool_calls,
        },
        logprobs: None,
    })
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// The `error` of Google's envelope (`google.rpc.Status` as JSON).
#[derive(Deserialize, Debug, Default)]
struct GoogleError {
    code: Option<i64>,
    #[serde(default)]
    message: String,
    status: Option<String>,
    #[serde(default)]
    details: Vec<Value>,
}

impl GoogleError {
    /// The `@type`-suffixed detail, e.g. `google.rpc.RetryInfo`.
    fn detail(&self, kind: &str) -> Option<&Value> {
        self.details.iter().find(|d| {
            d.get("@type")
                .and_then(Value::as_str)
                .is_some_and(|t| t.ends_with(kind))
        })
    }

    /// The wait `RetryInfo.retryDelay` advertises.
    fn retry_delay(&self) -> Option<Duration> {
        self.detail("google.rpc.RetryInfo")?
            .get("retryDelay")?
            .as_str()
            .and_then(proto_duration)
    }

    /// Whether `ErrorInfo` says the API key is bad (Gemini's answer to a bad
    /// key is a 400 `INVALID_ARGUMENT` "API key not valid").
    fn bad_key(&self) -> bool {
        self.detail("google.rpc.ErrorInfo")
            .and_then(|d| d.get("reason"))
            .and_then(Value::as_str)
            .is_some_and(|r| r == "API_KEY_INVALID")
    }

    /// (HTTP status, OpenAI `type`, OpenAI `code`): by the `status` name, else
    /// by the numeric `code`, else by `fallback` (the HTTP status).
    fn classify(&self, fallback: u16) -> (u16, &'static str, &'static str) {
        let message = self.message.as_str();
        let by_name = match self.status.as_deref() {
            _ if self.bad_key() => Some((401, "authentication_error", "invalid_api_key")),
            Some("INVALID_ARGUMENT" | "OUT_OF_RANGE")
                if crate::classify::is_context_length(message) =>
            {
                Some((400, "invalid_request_error", "context_length_exceeded"))
            }
            Some("INVALID_ARGUMENT" | "OUT_OF_RANGE") => {
                Some((400, "invalid_request_error", "invalid_request"))
            }
            Some("FAILED_PRECONDITION") => {
                Some((400, "invalid_request_error", "failed_precondition"))
            }
            Some("UNAUTHENTICATED") => Some((401, "authentication_error", "invalid_api_key")),
            Some("PERMISSION_DENIED") => Some((403, "permission_error", "permission_denied")),
            Some("NOT_FOUND") => Some((404, "not_found_error", "not_found")),
            Some("ALREADY_EXISTS" | "ABORTED") => Some((409, "invalid_request_error", "conflict")),
            Some("RESOURCE_EXHAUSTED") => Some((429, "rate_limit_error", "rate_limit_exceeded")),
            Some("UNIMPLEMENTED") => Some((501, "server_error", "not_implemented")),
            Some("UNAVAILABLE") => Some((503, "server_error", "service_unavailable")),
            Some("DEADLINE_EXCEEDED") => Some((504, "server_error", "timeout")),
            Some("INTERNAL" | "UNKNOWN" | "DATA_LOSS" | "CANCELLED") => {
                Some((500, "server_error", "server_error"))
            }
            Some(_) | None => None,
        };
        by_name.unwrap_or_else(|| {
            let status = self
                .code
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (400..=599).contains(c))
                .unwrap_or(fallback);
            let (kind, code) = names_of_status(status, message);
            (status, kind, code)
        })
    }
}

/// OpenAI (`type`, `code`) of an HTTP status, for an error with no `status`
/// name this file knows.
fn names_of_status(status: u16, message: &str) -> (&'static str, &'static str) {
    match status {
        400 | 413 if crate::classify::is_context_length(message) => {
            ("invalid_request_error", "context_length_exceeded")
        }
        401 => ("authentication_error", "invalid_api_key"),
        403 => ("permission_error", "permission_denied"),
        404 => ("not_found_error", "not_found"),
        429 => ("rate_limit_error", "rate_limit_exceeded"),
        400..=499 => ("invalid_request_error", "invalid_request"),
        _ => ("server_error", "server_error"),
    }
}

/// A protobuf `Duration` in JSON: decimal seconds with an `s` (`"30s"`,
/// `"1.5s"`, `"0.200s"`, at most nanosecond precision).
fn proto_duration(text: &str) -> Option<Duration> {
    let number = text.trim().strip_suffix('s')?;
    let (secs, frac) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (secs.is_empty() && frac.is_empty()) || !digits(secs) || !digits(frac) || frac.len() > 9 {
        return None;
    }
    let secs: u64 = if secs.is_empty() {
        0
    } else {
        secs.parse().ok()?
    };
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().ok()?
    };
    Some(Duration::new(secs, nanos))
}

/// The Google error envelope of a body: `{"error":{...}}`, or the first of
/// the `[{"error":{...}}]` Vertex sometimes sends.
fn google_error(body: &[u8]) -> Option<GoogleError> {
    #[derive(Deserialize)]
    struct Envelope {
        error: GoogleError,
    }
    // The list first: serde reads a struct from a sequence too, so an
    // `Envelope` would take `[{"error":..}]` as its fields, in order.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Body {
        Many(Vec<Envelope>),
        One(Envelope),
    }
    match serde_json::from_slice::<Body>(body).ok()? {
        Body::One(e) => Some(e.error),
        Body::Many(list) => list.into_iter().next().map(|e| e.error),
    }
}

/// Gemini's finish for a function call its model botched: the answer holds
/// no call and no text, so it is no answer (a 502 of the upstream's, retried
/// and failed over like one), not an empty `stop`.
const MALFORMED_CALL: &str = "MALFORMED_FUNCTION_CALL";

/// The in-band error a [`MALFORMED_CALL`] finish becomes.
fn malformed_call() -> Value {
    json!({"error": {"message": "the model's function call was malformed (finishReason MALFORMED_FUNCTION_CALL)",
        "type": "upstream_error", "code": "malformed_function_call", "param": null, "status": 502}})
}

/// Finishes that leave no answer, whatever the candidate holds: a call the
/// model botched, or a call of a tool the request did not declare.
fn botched(reason: Option<&str>) -> Option<Value> {
    match reason? {
        MALFORMED_CALL => Some(malformed_call()),
        "UNEXPECTED_TOOL_CALL" => Some(json!({"error": {
            "message": "the model called a tool the request did not declare (finishReason UNEXPECTED_TOOL_CALL)",
            "type": "upstream_error", "code": "unexpected_tool_call", "param": null, "status": 502}})),
        _ => None,
    }
}

/// A plain finish with nothing in it (no text, no call: Gemini's known empty
/// answer) is no answer either: a 502 of the upstream's, failed over.
fn empty_answer() -> Value {
    json!({"error": {"message": "the model finished without an answer (no text, no tool call)",
        "type": "upstream_error", "code": "empty_answer", "param": null, "status": 502}})
}

/// Whether a candidate holds anything for the client: text or a call.
fn says_something(candidate: &Candidate) -> bool {
    let parts = candidate.content.as_ref().map_or(&[][..], |c| &c.parts);
    parts.iter().any(|p| {
        p.function_call.is_some()
            || (!p.thought && p.text.as_deref().is_some_and(|t| !t.is_empty()))
    })
}

/// A Google error that came in-band (a 2xx body or a stream event): OpenAI's
/// shape and string code, with the status (which classifies it) beside them.
fn in_band_error(error: &GoogleError) -> Value {
    let (status, kind, code) = error.classify(IN_BAND_FALLBACK_STATUS);
    let mut v = json!({
        "error": {
            "message": error.message,
            "type": kind,
            "code": code,
            "param": null,
            "status": status,
        }
    });
    // The wait `RetryInfo` asks, for the engine to honour as a `Retry-After`
    // (whole seconds, rounded up), as it does for an error status.
    if let (Some(wait), Some(e)) = (error.retry_delay(), v.get_mut("error")) {
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        e["retry_after"] = secs.into();
    }
    v
}

/// A Google error body (any status) -> (the status the client should see, the
/// OpenAI-format error JSON bytes, the wait `RetryInfo.retryDelay` advertises).
///
/// The status is the one Google's `status` name maps to (`RESOURCE_EXHAUSTED`
/// 429, `UNAVAILABLE` 503, `DEADLINE_EXCEEDED` 504, `INVALID_ARGUMENT` and
/// `FAILED_PRECONDITION` 400, `UNAUTHENTICATED` 401, ...), else the body's
/// numeric `code`, else `status`. A 400 whose message says the input is over
/// the token limit gets code `context_length_exceeded`; a bad API key (a 400
/// `INVALID_ARGUMENT` with `ErrorInfo` `API_KEY_INVALID`) is a 401
/// `invalid_api_key`. The message is kept as is. A body that is no Google
/// error comes back unchanged, with `status`.
#[must_use]
pub fn decode_error(status: u16, body: &[u8]) -> (u16, Bytes, Option<Duration>) {
    let Some(error) = google_error(body) else {
        return (status, Bytes::copy_from_slice(body), None);
    };
    let (mapped, kind, code) = error.classify(status);
    let v = json!({
        "error": { "message": error.message, "type": kind, "code": code, "param": null }
    });
    (mapped, Bytes::from(v.to_string()), error.retry_delay())
}

// ---------------------------------------------------------------------------
// Streams: Gemini SSE -> OpenAI chunks
// ---------------------------------------------------------------------------

/// Translates `streamGenerateContent?alt=sse`, event by event (each `data:`
/// a whole `GenerateContentResponse` holding a delta), into OpenAI
/// `chat.completion.chunk` events.
///
/// Only the first candidate is read (several choices in a stream are refused
/// at the request). Thought parts are not passed on: the chunk writer has no
/// `reasoning_content` delta.
#[derive(Debug)]
pub struct GeminiStream {
    include_usage: bool,
    head: Head,
    /// The role chunk went out (with the first answer event).
    started: bool,
    /// Tool calls opened so far (the next call's OpenAI index).
    calls: usize,
    /// The latest usage counts (Gemini repeats them, cumulative, per event).
    usage: Option<chunk::Usage>,
    /// Text or a call came (a plain finish before either is no answer).
    said: bool,
    /// The finish chunk went out: later events may only bring the usage
    /// (Gemini 3 sends it in an event of its own), then the body ends.
    finished: bool,
    /// `[DONE]` went out.
    done: bool,
}

impl super::StreamTranslator for GeminiStream {
    fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, Malformed> {
        GeminiStream::on_event(self, data).map_err(|e| Malformed(e.to_string()))
    }

    fn on_end(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        if self.finished && !self.done {
            self.done = true;
            if let Some(usage) = self.usage.filter(|_| self.include_usage) {
                out.push(self.head.usage(usage));
            }
            out.push(Frame::DONE);
        }
        out
    }
}

impl GeminiStream {
    /// `include_usage`: the client asked `stream_options.include_usage` (a
    /// usage chunk with empty choices before `[DONE]`); `model`: the target's
    /// model name (Gemini's `modelVersion` wins when present).
    #[must_use]
    pub fn new(include_usage: bool, model: &str) -> Self {
        Self {
            include_usage,
            head: Head {
                created: now_secs(),
                model: model.to_owned(),
                ..Head::default()
            },
            started: false,
            calls: 0,
            usage: None,
            said: false,
            finished: false,
            done: false,
        }
    }

    /// One event's `data:` -> zero or more chunk frames: the role chunk
    /// first, then text and tool calls (a `functionCall` arrives whole: its
    /// opening and its arguments), and, on the event carrying a
    /// `finishReason` (or a blocked prompt), the finish chunk, the usage
    /// chunk if asked and `[DONE]`. An `{"error": ...}` event becomes an
    /// OpenAI in-band error frame with its numeric `status`.
    ///
    /// # Errors
    /// The data is not JSON, or not a `GenerateContentResponse`.
    pub fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, TranslateError> {
        if self.done {
            return Ok(Vec::new());
        }
        let reply = read_reply(data.as_bytes())?;
        if self.finished {
            // Past the finish, only the usage counts (sent with [DONE] at the end).
            if let Some(usage) = reply.usage_metadata.and_then(UsageMetadata::to_openai) {
                self.usage = Some(usage);
            }
            return Ok(Vec::new());
        }
        if let Some(error) = &reply.error {
            return Ok(vec![Frame::read(&in_band_error(error))]);
        }
        if !reply.is_answer() {
            return Err(TranslateError::InvalidResponse(
                "a stream event that is no GenerateContentResponse".into(),
            ));
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            self.head.id = reply.response_id.clone().unwrap_or_else(completion_id);
            if let Some(version) = &reply.model_version {
                version.clone_into(&mut self.head.model);
            }
            out.push(self.head.role());
        }
        if let Some(usage) = reply.usage_metadata.and_then(UsageMetadata::to_openai) {
            self.usage = Some(usage);
        }
        let first = reply.candidates.iter().find(|c| c.index.unwrap_or(0) == 0);
        if let Some(error) = first.and_then(|c| botched(c.finish_reason.as_deref())) {
            out.push(Frame::read(&error));
            return Ok(out);
        }
        if let Some(candidate) = first {
            self.said |= says_something(candidate);
            if candidate.finish_reason.as_deref() == Some("STOP") && !self.said {
                out.push(Frame::read(&empty_answer()));
                return Ok(out);
            }
        }
        let mut reason = reply.blocked().map(|_| "content_filter");
        if let Some(candidate) = first {
            self.candidate_frames(candidate, &mut out)?;
            reason = candidate
                .finish_reason
                .as_deref()
                .map(|r| finish_reason(r, self.calls > 0));
        }
        if let Some(reason) = reason {
            self.finish(reason, &mut out);
        }
        Ok(out)
    }

    /// A candidate's text pieces and whole function calls.
    fn candidate_frames(
        &mut self,
        candidate: &Candidate,
        out: &mut Vec<Frame>,
    ) -> Result<(), TranslateError> {
        let parts = candidate.content.as_ref().map_or(&[][..], |c| &c.parts);
        for part in parts {
            if let Some(call) = &part.function_call {
                let (id, name, arguments) = call.read()?;
                let index = self.calls;
                self.calls += 1;
                out.push(self.head.call(index, &id, name));
                out.push(self.head.arguments(index, &arguments));
            } else if let Some(t) = part.text.as_deref().filter(|t| !t.is_empty()) {
                out.push(if part.thought {
                    self.head.reasoning(t)
                } else {
                    self.head.text(t)
                });
            }
        }
        Ok(())
    }

    /// The end: the finish chunk, the usage chunk if asked (and known), `[DONE]`.
    /// The finish chunk; the usage and `[DONE]` wait for the body's end
    /// ([`super::StreamTranslator::on_end`]), as usage may still come.
    fn finish(&mut self, reason: &str, out: &mut Vec<Frame>) {
        self.finished = true;
        out.push(self.head.delta(Delta::default(), Some(reason)));
    }
}

// ---------------------------------------------------------------------------
// Embeddings
// ---------------------------------------------------------------------------

/// OpenAI embeddings request object -> Gemini `batchEmbedContents` body for
/// `model`: one request per input text, `dimensions` as
/// `outputDimensionality`.
///
/// # Errors
/// No text input ([`TranslateError::InvalidRequest`]); token-array inputs
/// ([`TranslateError::Unsupported`]: Gemini embeds text). Gemini answers
/// numbers: `encoding_format: base64` is the gateway's to honour, after.
pub fn to_embed_request(openai: &Map<String, Value>, model: &str) -> Result<Value, TranslateError> {
    let texts: Vec<&str> = match non_null(openai, "input") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(invalid("`input` must not be empty"))
        }
        Some(Value::Array(items)) => {
            if items.iter().any(|i| i.is_number() || i.is_array()) {
                return Err(unsupported("token-array `input`"));
            }
            items
                .iter()
                .map(|i| {
                    i.as_str()
                        .ok_or_else(|| invalid("`input` items must be strings"))
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) | None => return Err(invalid("`input` must be a string or an array of strings")),
    };
    match non_null(openai, "encoding_format").map(|f| f.as_str()) {
        None | Some(Some("float" | "base64")) => {}
        Some(other) => {
            return Err(unsupported(format!(
                "`encoding_format` = {}",
                other.unwrap_or("(not a string)")
            )))
        }
    }
    let dimensions = match non_null(openai, "dimensions") {
        Some(d) => Some(
            d.as_u64()
                .filter(|d| *d > 0)
                .ok_or_else(|| invalid("`dimensions` must be a positive integer"))?,
        ),
        None => None,
    };
    let model = if model.starts_with("models/") {
        model.to_owned()
    } else {
        format!("models/{model}")
    };
    let requests: Vec<Value> = texts
        .into_iter()
        .map(|text| {
            let mut request = json!({ "model": model, "content": { "parts": [{ "text": text }] } });
            if let (Some(d), Some(obj)) = (dimensions, request.as_object_mut()) {
                obj.insert("outputDimensionality".into(), Value::from(d));
            }
            request
        })
        .collect();
    Ok(json!({ "requests": requests }))
}

/// Gemini `batchEmbedContents` response (`{"embeddings":[{"values":[..]}]}`)
/// -> OpenAI embeddings list JSON bytes. The vectors are copied as sent
/// (no float is re-printed); Gemini reports no token counts, so `usage` is
/// zeros.
///
/// # Errors
/// A Google error envelope ([`TranslateError::Upstream`]), a body that is not
/// JSON ([`TranslateError::Json`]) or not that shape
/// ([`TranslateError::InvalidResponse`]).
pub fn from_embed_response(body: &[u8], model: &str) -> Result<Bytes, TranslateError> {
    #[derive(Deserialize)]
    struct Batch<'a> {
        #[serde(borrow)]
        embeddings: Option<Vec<Embedding<'a>>>,
        error: Option<GoogleError>,
    }
    #[derive(Deserialize)]
    struct Embedding<'a> {
        #[serde(borrow)]
        values: &'a RawValue,
    }
    #[derive(serde::Serialize)]
    struct Item<'a> {
        object: &'static str,
        index: usize,
        embedding: &'a RawValue,
    }
    #[derive(serde::Serialize)]
    struct List<'a> {
        object: &'static str,
        data: Vec<Item<'a>>,
        model: &'a str,
        usage: ZeroUsage,
    }
    #[derive(serde::Serialize)]
    struct ZeroUsage {
        prompt_tokens: u64,
        total_tokens: u64,
    }
    let batch: Batch<'_> = serde_json::from_slice(body)?;
    if let Some(error) = batch.error {
        let (status, _, _) = error.classify(IN_BAND_FALLBACK_STATUS);
        return Err(TranslateError::Upstream {
            kind: error.status.unwrap_or_else(|| status.to_string()),
            message: error.message,
        });
    }
    let embeddings = batch.embeddings.ok_or_else(|| {
        TranslateError::InvalidResponse("not a batchEmbedContents response: no `embeddings`".into())
    })?;
    let mut data = Vec::with_capacity(embeddings.len());
    for (index, e) in embeddings.iter().enumerate() {
        if !e.values.get().trim_start().starts_with('[') {
            return Err(TranslateError::InvalidResponse(format!(
                "embeddings[{index}].values is not an array"
            )));
        }
        data.push(Item {
            object: "embedding",
            index,
            embedding: e.values,
        });
    }
    let list = List {
        object: "list",
        data,
        model,
        usage: ZeroUsage {
            prompt_tokens: 0,
            total_tokens: 0,
        },
    };
    serde_json::to_vec(&list)
        .map(Bytes::from)
        .map_err(TranslateError::Json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::Chunk as Reading;

    fn request(v: Value) -> Result<Value, TranslateError> {
        let Value::Object(o) = v else {
            panic!("not an object")
        };
        to_gemini_request(&o, Some(2048))
    }

    fn answer(body: &Value) -> Value {
        let bytes = from_gemini_response(body.to_string().as_bytes(), "gemini-target").unwrap();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        v
    }

    fn frame_json(frame: &Frame) -> Value {
        serde_json::from_str(frame.data()).unwrap()
    }

    fn unsupported_naming(result: Result<Value, TranslateError>, what: &str) {
        match result {
            Err(TranslateError::Unsupported(m)) => assert!(m.contains(what), "{m} vs {what}"),
            other => panic!("expected Unsupported({what}), got {other:?}"),
        }
    }

    #[test]
    fn usage_without_a_candidate_is_no_answer_but_a_blocked_prompt_is() {
        for body in [
            r#"{"candidates":[],"usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":5}}"#,
            r#"{"usageMetadata":{"promptTokenCount":7},"modelVersion":"gemini-2.5-flash"}"#,
        ] {
            let got = from_gemini_response(body.as_bytes(), "gemini");
            assert!(
                matches!(got, Err(TranslateError::InvalidResponse(_))),
                "{body}"
            );
        }
        let blocked =
            r#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":7}}"#;
        let got: Value =
            serde_json::from_slice(&from_gemini_response(blocked.as_bytes(), "gemini").unwrap())
                .unwrap();
        assert_eq!(
            got["choices"][0]["finish_reason"], "content_filter",
            "{got}"
        );
    }

    #[test]
    fn system_turns_and_images_translate() {
        let got = request(json!({
            "model": "x",
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "developer", "content": [{ "type": "text", "text": "Use French." }] },
                { "role": "user", "content": "Hello" },
                { "role": "user", "content": [
                    { "type": "text", "text": "What is in these?" },
                    { "type": "image_url", "image_url": { "url": "data:image/png;base64,iVBORw0KGgo=" } },
                    { "type": "image_url", "image_url": { "url": "https://example.com/cat.WEBP?size=2" } },
                    { "type": "image_url", "image_url": { "url": "https://example.com/photo" } }
                ]},
                { "role": "assistant", "content": "Un chat." },
                { "role": "user", "content": "Merci" }
            ],
            "temperature": 0.3,
            "top_p": 0.9,
            "stop": "END",
            "user": "dropped",
            "stream_options": { "include_usage": true }
        }))
        .unwrap();
        let want = json!({
            "systemInstruction": { "parts": [{ "text": "Be brief.\n\nUse French." }] },
            "contents": [
                { "role": "user", "parts": [
                    { "text": "Hello" },
                    { "text": "What is in these?" },
                    { "inlineData": { "mimeType": "image/png", "data": "iVBORw0KGgo=" } },
                    { "fileData": { "mimeType": "image/webp", "fileUri": "https://example.com/cat.WEBP?size=2" } },
                    { "fileData": { "mimeType": "image/jpeg", "fileUri": "https://example.com/photo" } }
                ]},
                { "role": "model", "parts": [{ "text": "Un chat." }] },
                { "role": "user", "parts": [{ "text": "Merci" }] }
            ],
            "generationConfig": {
                "temperature": 0.3, "topP": 0.9, "stopSequences": ["END"], "maxOutputTokens": 2048
            }
        });
        assert_eq!(got, want);
    }

    #[test]
    fn audio_and_file_parts_are_inline_data() {
        let got = request(json!({ "messages": [{ "role": "user", "content": [
            { "type": "input_audio", "input_audio": { "data": "UklGRg==", "format": "wav" } },
            { "type": "input_audio", "input_audio": { "data": "SUQz", "format": "mp3" } },
            { "type": "file", "file": { "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0=" } }
        ]}]}))
        .unwrap();
        assert_eq!(
            got["contents"][0]["parts"],
            json!([
                { "inlineData": { "mimeType": "audio/wav", "data": "UklGRg==" } },
                { "inlineData": { "mimeType": "audio/mp3", "data": "SUQz" } },
                { "inlineData": { "mimeType": "application/pdf", "data": "JVBERi0=" } }
            ])
        );
        let part = |p: Value| request(json!({ "messages": [{ "role": "user", "content": [p] }] }));
        unsupported_naming(
            part(json!({ "type": "file", "file": { "file_id": "file-1" } })),
            "file_id",
        );
        unsupported_naming(
            part(
                json!({ "type": "input_audio", "input_audio": { "data": "x", "format": "flac" } }),
            ),
            "flac",
        );
        unsupported_naming(
            part(json!({ "type": "video_url", "video_url": "x" })),
            "video_url",
        );
        unsupported_naming(
            part(json!({ "type": "image_url", "image_url": { "url": "ftp://h/a.png" } })),
            "scheme",
        );
        unsupported_naming(
            part(json!({ "type": "image_url", "image_url": { "url": "data:image/png,raw" } })),
            "base64",
        );
    }

    #[test]
    fn a_tool_round_trip_translates_with_names_looked_up() {
        let got = request(json!({
            "messages": [
                { "role": "user", "content": "Weather in Paris and Rome?" },
                { "role": "assistant", "content": "Checking.", "tool_calls": [
                    { "id": "call_a", "type": "function",
                      "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } },
                    { "id": "call_b", "type": "function",
                      "function": { "name": "get_time", "arguments": "" } }
                ]},
                { "role": "tool", "tool_call_id": "call_b", "content": "14:00" },
                { "role": "tool", "tool_call_id": "call_a",
                  "content": [{ "type": "text", "text": "{\"temp_c\": 21}" }] },
                { "role": "user", "content": "Thanks" }
            ]
        }))
        .unwrap();
        let contents = got["contents"].as_array().unwrap();
        assert_eq!(contents.len(), 3, "{got}");
        assert_eq!(
            contents[1],
            json!({ "role": "model", "parts": [
                { "text": "Checking." },
                { "functionCall": { "name": "get_weather", "args": { "city": "Paris" }, "id": "call_a" },
                  "thoughtSignature": SKIP_SIGNATURE },
                { "functionCall": { "name": "get_time", "args": {}, "id": "call_b" },
                  "thoughtSignature": SKIP_SIGNATURE }
            ]})
        );
        assert_eq!(
            contents[2],
            json!({ "role": "user", "parts": [
                { "functionResponse": { "name": "get_time", "id": "call_b",
                                        "response": { "content": "14:00" } } },
                { "functionResponse": { "name": "get_weather", "id": "call_a",
                                        "response": { "temp_c": 21 } } },
                { "text": "Thanks" }
            ]})
        );
    }

    #[test]
    fn tool_messages_and_calls_that_do_not_fit_are_errors() {
        let orphan = request(json!({ "messages": [
            { "role": "user", "content": "hi" },
            { "role": "tool", "tool_call_id": "call_x", "content": "r" }
        ]}));
        match orphan {
            Err(TranslateError::InvalidRequest(m)) => {
                assert!(m.contains("messages[1].tool_call_id"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        for args in ["[1,2]", "{not json"] {
            let bad = request(json!({ "messages": [
                { "role": "user", "content": "hi" },
                { "role": "assistant", "tool_calls": [
                    { "id": "c1", "type": "function", "function": { "name": "f", "arguments": args } }
                ]}
            ]}));
            assert!(
                matches!(&bad, Err(TranslateError::ToolArguments { id, .. }) if id == "c1"),
                "{args}: {bad:?}"
            );
        }
        unsupported_naming(
            request(json!({ "messages": [{ "role": "function", "name": "f", "content": "r" }] })),
            "function",
        );
        unsupported_naming(
            request(json!({ "messages": [{ "role": "user", "content": "hi" }],
                            "functions": [{ "name": "f" }] })),
            "functions",
        );
    }

    #[test]
    fn tool_choice_variants_map() {
        let tools = json!([{ "type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": { "type": "object", "properties": { "city": { "type": "string" } },
                            "required": ["city"] } } }]);
        let with = |choice: Value| {
            request(json!({ "messages": [{ "role": "user", "content": "hi" }],
                            "tools": tools, "tool_choice": choice }))
        };
        for (choice, want) in [
            (json!("auto"), json!({ "mode": "AUTO" })),
            (json!("none"), json!({ "mode": "NONE" })),
            (json!("required"), json!({ "mode": "ANY" })),
            (
                json!({ "type": "function", "function": { "name": "get_weather" } }),
                json!({ "mode": "ANY", "allowedFunctionNames": ["get_weather"] }),
            ),
        ] {
            let got = with(choice.clone()).unwrap();
            assert_eq!(got["toolConfig"]["functionCallingConfig"], want, "{choice}");
            assert_eq!(
                got["tools"][0]["functionDeclarations"][0]["parameters"]["required"],
                json!(["city"])
            );
        }
        assert!(matches!(
            with(json!("sometimes")),
            Err(TranslateError::InvalidRequest(_))
        ));
        let no_choice = request(json!({ "messages": [{ "role": "user", "content": "hi" }],
                                        "tools": tools }))
        .unwrap();
        assert!(no_choice.get("toolConfig").is_none());
        unsupported_naming(
            request(json!({ "messages": [{ "role": "user", "content": "hi" }],
                            "tools": [{ "type": "web_search" }] })),
            "web_search",
        );
    }

    #[test]
    fn schemas_are_cleaned_to_gemini_subset() {
        let parameters = json!({
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "additionalProperties": false,
            "strict": true,
            "$defs": { "Unit": { "type": "string", "enum": ["c", "f"] } },
            "properties": {
                "unit": { "$ref": "#/$defs/Unit", "description": "Temperature unit" },
                "city": { "type": ["string", "null"], "format": "uri", "minLength": 1 },
                "when": { "type": "string", "format": "date-time" },
                "days": { "anyOf": [{ "type": "integer", "minimum": 1 }, { "type": "null" }] },
                "kind": { "const": "forecast" },
                "tags": { "type": "array", "items": { "type": "string" }, "uniqueItems": true },
                "opts": { "allOf": [{ "type": "object", "properties": { "x": { "type": "number" } } }] },
                "any": { "oneOf": [{ "type": "string" }, { "type": "number" }] },
                "level": { "type": "integer", "enum": [1, 2, 3] }
            },
            "required": ["city"]
        });
        let got = request(json!({ "messages": [{ "role": "user", "content": "hi" }],
            "tools": [{ "type": "function", "function": { "name": "f", "strict": true,
                                                         "parameters": parameters } }] }))
        .unwrap();
        let want = json!({
            "type": "object",
            "properties": {
                "unit": { "type": "string", "enum": ["c", "f"], "description": "Temperature unit" },
                "city": { "type": "string", "nullable": true, "minLength": 1 },
                "when": { "type": "string", "format": "date-time" },
                "days": { "type": "integer", "minimum": 1, "nullable": true },
                "kind": { "enum": ["forecast"] },
                "tags": { "type": "array", "items": { "type": "string" } },
                "opts": { "type": "object", "properties": { "x": { "type": "number" } } },
                "any": { "anyOf": [{ "type": "string" }, { "type": "number" }] },
                "level": { "type": "integer" }
            },
            "required": ["city"]
        });
        assert_eq!(
            got["tools"][0]["functionDeclarations"][0]["parameters"],
            want
        );

        let no_params = request(json!({ "messages": [{ "role": "user", "content": "hi" }],
            "tools": [{ "type": "function", "function": { "name": "now",
                "parameters": { "type": "object", "properties": {} } } }] }))
        .unwrap();
        assert_eq!(
            no_params["tools"][0]["functionDeclarations"][0],
            json!({ "name": "now" })
        );

        let recursive = json!({ "type": "object", "$defs": { "Node": { "type": "object",
            "properties": { "next": { "$ref": "#/$defs/Node" } } } },
            "properties": { "head": { "$ref": "#/$defs/Node" } } });
        unsupported_naming(clean_schema(&recursive, "p"), "recursive");
        unsupported_naming(
            clean_schema(&json!({ "$ref": "https://example.com/s.json" }), "p"),
            "$ref",
        );
        unsupported_naming(
            clean_schema(
                &json!({ "allOf": [{ "type": "object" }, { "required": ["a"] }] }),
                "p",
            ),
            "allOf",
        );
        unsupported_naming(
            clean_schema(
                &json!({ "type": "array", "items": [{ "type": "string" }] }),
                "p",
            ),
            "tuple",
        );
        unsupported_naming(
            clean_schema(&json!({ "type": ["string", "integer"] }), "p"),
            "type",
        );
    }

    #[test]
    fn generation_config_maps_every_field() {
        let base = || json!({ "messages": [{ "role": "user", "content": "hi" }] });
        let with = |fields: Value| {
            let mut r = base();
            for (k, v) in fields.as_object().unwrap() {
                r[k] = v.clone();
            }
            request(r).unwrap()["generationConfig"].clone()
        };
        assert_eq!(
            with(
                json!({ "max_tokens": 10, "max_completion_tokens": 20, "n": 2, "seed": 7,
                         "presence_penalty": 0.5, "frequency_penalty": 0,
                         "stop": ["a", "b"], "response_format": { "type": "json_object" } })
            ),
            json!({ "maxOutputTokens": 20, "candidateCount": 2, "seed": 7, "presencePenalty": 0.5,
                    "stopSequences": ["a", "b"], "responseMimeType": "application/json" })
        );
        assert_eq!(with(json!({ "max_tokens": 10 }))["maxOutputTokens"], 10);
        let Value::Object(o) = base() else { panic!() };
        assert!(to_gemini_request(&o, None)
            .unwrap()
            .get("generationConfig")
            .is_none());
        for (effort, budget) in [
            ("minimal", 0),
            ("none", 0),
            ("low", 1024),
            ("medium", 8192),
            ("high", 24576),
        ] {
            assert_eq!(
                with(json!({ "reasoning_effort": effort }))["thinkingConfig"],
                json!({ "thinkingBudget": budget }),
                "{effort}"
            );
        }
        let schema = with(
            json!({ "response_format": { "type": "json_schema", "json_schema": {
            "name": "r", "strict": true, "schema": { "type": "object", "additionalProperties": false,
                "properties": { "a": { "type": "string" } }, "required": ["a"] } } } }),
        );
        assert_eq!(schema["responseMimeType"], "application/json");
        assert_eq!(
            schema["responseSchema"],
            json!({ "type": "object", "properties": { "a": { "type": "string" } }, "required": ["a"] })
        );
    }

    #[test]
    fn asks_the_answer_cannot_carry_are_unsupported() {
        let with = |k: &str, v: Value| {
            let mut r = json!({ "messages": [{ "role": "user", "content": "hi" }] });
            r[k] = v;
            request(r)
        };
        unsupported_naming(with("logprobs", json!(true)), "logprobs");
        unsupported_naming(with("top_logprobs", json!(3)), "top_logprobs");
        unsupported_naming(with("modalities", json!(["text", "audio"])), "audio");
        unsupported_naming(with("audio", json!({ "voice": "alloy" })), "audio");
        unsupported_naming(with("reasoning_effort", json!("extreme")), "extreme");
        assert!(with("logprobs", json!(false)).is_ok());
        let mut r =
            json!({ "messages": [{ "role": "user", "content": "hi" }], "n": 2, "stream": true });
        unsupported_naming(request(r.clone()), "stream");
        r["stream"] = json!(false);
        assert_eq!(request(r).unwrap()["generationConfig"]["candidateCount"], 2);
        assert!(matches!(
            request(json!({ "messages": [{ "role": "system", "content": "only" }] })),
            Err(TranslateError::InvalidRequest(_))
        ));
    }

    /// The text answer of Google's `generateContent` reference example.
    #[test]
    fn a_text_answer_translates() {
        let got = answer(&json!({
            "candidates": [{
                "content": { "parts": [{ "text": "Once upon a time, in a land far away..." }], "role": "model" },
                "finishReason": "STOP",
                "avgLogprobs": -0.2542
            }],
            "usageMetadata": {
                "promptTokenCount": 8, "candidatesTokenCount": 12, "totalTokenCount": 20,
                "promptTokensDetails": [{ "modality": "TEXT", "tokenCount": 8 }]
            },
            "modelVersion": "gemini-2.0-flash",
            "responseId": "mAitaPvXK8SIqtsP6dPkoAU"
        }));
        assert_eq!(got["id"], "mAitaPvXK8SIqtsP6dPkoAU");
        assert_eq!(got["object"], "chat.completion");
        assert_eq!(got["model"], "gemini-2.0-flash");
        assert_eq!(
            got["choices"],
            json!([{ "index": 0, "logprobs": null, "finish_reason": "stop",
                "message": { "role": "assistant", "content": "Once upon a time, in a land far away..." } }])
        );
        assert_eq!(
            got["usage"],
            json!({ "prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20 })
        );
    }

    /// Google's function-calling example: a call without an id.
    #[test]
    fn a_function_call_answer_translates() {
        let got = answer(&json!({
            "candidates": [{
                "content": { "role": "model", "parts": [
                    { "functionCall": { "name": "find_theaters",
                        "args": { "movie": "Barbie", "location": "Mountain View, CA" } } },
                    { "functionCall": { "name": "now", "id": "fc_2" } }
                ]},
                "finishReason": "STOP"
            }]
        }));
        assert_eq!(got["model"], "gemini-target");
        assert!(got["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert!(got.get("usage").is_none());
        let choice = &got["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], Value::Null);
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "find_theaters");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(
            args,
            json!({ "movie": "Barbie", "location": "Mountain View, CA" })
        );
        assert_eq!(calls[1]["id"], "fc_2");
        assert_eq!(calls[1]["function"]["arguments"], "{}");
    }

    #[test]
    fn every_finish_reason_class_maps() {
        for (gemini, openai) in [
            ("STOP", "stop"),
            ("MAX_TOKENS", "length"),
            ("SAFETY", "content_filter"),
            ("RECITATION", "content_filter"),
            ("BLOCKLIST", "content_filter"),
            ("PROHIBITED_CONTENT", "content_filter"),
            ("SPII", "content_filter"),
            ("IMAGE_SAFETY", "content_filter"),
            ("LANGUAGE", "content_filter"),
            ("OTHER", "stop"),
            ("FINISH_REASON_UNSPECIFIED", "stop"),
            ("SOMETHING_NEW", "stop"),
        ] {
            let got = answer(&json!({ "candidates": [{
                "content": { "parts": [{ "text": "x" }], "role": "model" }, "finishReason": gemini }] }));
            assert_eq!(got["choices"][0]["finish_reason"], openai, "{gemini}");
        }
        // A botched call is no answer: an in-band 502, in a stream too.
        let body =
            json!({ "candidates": [{ "finishReason": "MALFORMED_FUNCTION_CALL", "index": 0 }] });
        let got: Value = serde_json::from_slice(
            &from_gemini_response(body.to_string().as_bytes(), "gemini-target").unwrap(),
        )
        .unwrap();
        assert_eq!(got["error"]["status"], 502, "{got}");
        let mut stream = GeminiStream::new(false, "gemini-target");
        let frames = stream.on_event(&body.to_string()).unwrap();
        let last = frame_json(frames.last().unwrap());
        assert_eq!(last["error"]["code"], "malformed_function_call", "{last}");
        // So is a call of a tool never declared, and a plain finish with
        // nothing for the client in it (reasoning alone included).
        for (body, code) in [
            (
                json!({ "candidates": [{ "finishReason": "UNEXPECTED_TOOL_CALL", "index": 0 }] }),
                "unexpected_tool_call",
            ),
            (
                json!({ "candidates": [{ "content": { "role": "model" }, "finishReason": "STOP", "index": 0 }] }),
                "empty_answer",
            ),
            (
                json!({ "candidates": [{ "content": { "parts": [{ "text": "hm", "thought": true }], "role": "model" },
                    "finishReason": "STOP", "index": 0 }] }),
                "empty_answer",
            ),
        ] {
            let got: Value = serde_json::from_slice(
                &from_gemini_response(body.to_string().as_bytes(), "gemini-target").unwrap(),
            )
            .unwrap();
            assert_eq!(got["error"]["code"], code, "{got}");
            assert_eq!(got["error"]["status"], 502, "{got}");
            let mut stream = GeminiStream::new(false, "gemini-target");
            let frames = stream.on_event(&body.to_string()).unwrap();
            let last = frame_json(frames.last().unwrap());
            assert_eq!(last["error"]["code"], code, "{last}");
        }
        // A candidate cut by safety carries no content at all.
        let cut = answer(&json!({ "candidates": [{ "finishReason": "SAFETY", "index": 0 }] }));
        assert_eq!(cut["choices"][0]["message"]["content"], "");
        assert_eq!(finish_reason("MAX_TOKENS", true), "length");
    }

    #[test]
    fn a_blocked_prompt_is_an_empty_filtered_answer() {
        let got = answer(&json!({
            "promptFeedback": { "blockReason": "SAFETY", "safetyRatings": [
                { "category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH" } ] },
            "usageMetadata": { "promptTokenCount": 8, "totalTokenCount": 8 },
            "modelVersion": "gemini-1.5-flash"
        }));
        assert_eq!(got["choices"][0]["finish_reason"], "content_filter");
        assert_eq!(got["choices"][0]["message"]["content"], "");
        assert_eq!(got["usage"]["prompt_tokens"], 8);
        assert_eq!(got["usage"]["completion_tokens"], 0);
    }

    #[test]
    fn thoughts_cache_and_candidates_are_read() {
        let got = answer(&json!({
            "candidates": [
                { "content": { "role": "model", "parts": [
                    { "text": "**Weighing** the options", "thought": true },
                    { "text": "Forty", "thoughtSignature": "c2ln" },
                    { "text": "-two." }
                ]}, "finishReason": "STOP", "index": 0 },
                { "content": { "role": "model", "parts": [{ "text": "42" }] },
                  "finishReason": "MAX_TOKENS", "index": 1 }
            ],
            "usageMetadata": { "promptTokenCount": 100, "candidatesTokenCount": 20,
                "thoughtsTokenCount": 30, "cachedContentTokenCount": 64, "totalTokenCount": 150 },
            "modelVersion": "gemini-2.5-flash"
        }));
        let m = &got["choices"][0]["message"];
        assert_eq!(m["content"], "Forty-two.");
        assert_eq!(m["reasoning_content"], "**Weighing** the options");
        assert_eq!(got["choices"][1]["index"], 1);
        assert_eq!(got["choices"][1]["message"]["content"], "42");
        assert_eq!(got["choices"][1]["finish_reason"], "length");
        assert_eq!(
            got["usage"],
            json!({ "prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150,
                    "prompt_tokens_details": { "cached_tokens": 64 },
                    "completion_tokens_details": { "reasoning_tokens": 30 } })
        );
    }

    #[test]
    fn an_error_inside_a_2xx_is_an_in_band_error_body() {
        let body = json!({ "error": { "code": 429, "status": "RESOURCE_EXHAUSTED",
            "message": "Resource has been exhausted (e.g. check quota)." } });
        let bytes = from_gemini_response(body.to_string().as_bytes(), "m").unwrap();
        let got: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            got["error"],
            json!({ "message": "Resource has been exhausted (e.g. check quota).",
                    "type": "rate_limit_error", "code": "rate_limit_exceeded",
                    "param": null, "status": 429 })
        );
        assert_eq!(crate::sse::error_code(&got["error"].to_string()), Some(429));
        let vertex = format!("[{body}]");
        let bytes = from_gemini_response(vertex.as_bytes(), "m").unwrap();
        let got: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(got["error"]["status"], 429);
    }

    #[test]
    fn bad_answers_are_errors() {
        let read = |b: &str| from_gemini_response(b.as_bytes(), "m");
        assert!(matches!(
            read("<html>502</html>"),
            Err(TranslateError::Json(_))
        ));
        assert!(matches!(
            read("{}"),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            read("[1]"),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            read(r#"{"candidates":"no"}"#),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            read(
                r#"{"candidates":[{"content":{"parts":[{"functionCall":{"name":"f","args":[1]}}]}}]}"#
            ),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            read(r#"{"candidates":[{"content":{"parts":[{"functionCall":{"args":{}}}]}}]}"#),
            Err(TranslateError::InvalidResponse(_))
        ));
    }

    /// The frames of `events`, then of the body's end.
    fn run(stream: &mut GeminiStream, events: &[&str]) -> Vec<Frame> {
        let mut frames: Vec<Frame> = events
            .iter()
            .flat_map(|e| GeminiStream::on_event(stream, e).unwrap())
            .collect();
        frames.extend(crate::upstream::StreamTranslator::on_end(stream));
        frames
    }

    /// Gemini 3 sends the counts in an event of their own after the finish:
    /// they are the usage chunk, before `[DONE]`.
    #[test]
    fn usage_sent_after_the_finish_is_the_usage_chunk() {
        let mut stream = GeminiStream::new(true, "gemini-target");
        let frames = run(
            &mut stream,
            &[
                r#"{"candidates":[{"content":{"parts":[{"text":"Hi"}],"role":"model"}}]}"#,
                r#"{"candidates":[{"content":{"parts":[],"role":"model"},"finishReason":"STOP"}]}"#,
                r#"{"usageMetadata":{"promptTokenCount":5,"candidatesTokenCount":1,"totalTokenCount":6}}"#,
            ],
        );
        let json: Vec<Value> = frames[..frames.len() - 1].iter().map(frame_json).collect();
        assert_eq!(json[2]["choices"][0]["finish_reason"], "stop", "{json:#?}");
        assert_eq!(json[3]["usage"]["prompt_tokens"], 5, "{json:#?}");
        assert_eq!(json[3]["usage"]["completion_tokens"], 1, "{json:#?}");
        assert_eq!(frames.last(), Some(&Frame::DONE));
        assert_eq!(frames.len(), 5);
    }

    /// Events in the shape `streamGenerateContent?alt=sse` sends: usage on
    /// every event, the finish and the final counts on the last.
    #[test]
    fn a_stream_with_text_a_call_and_usage_translates() {
        let events = [
            r#"{"candidates": [{"content": {"parts": [{"text": "Let me"}],"role": "model"},"index": 0}],"usageMetadata": {"promptTokenCount": 28,"totalTokenCount": 28},"modelVersion": "gemini-2.5-flash","responseId": "resp-1"}"#,
            r#"{"candidates": [{"content": {"parts": [{"text": "thinking about it", "thought": true}],"role": "model"},"index": 0}],"modelVersion": "gemini-2.5-flash","responseId": "resp-1"}"#,
            r#"{"candidates": [{"content": {"parts": [{"text": " check."},{"functionCall": {"name": "get_weather","args": {"location": "Boston"}}, "thoughtSignature": "CiQB"}],"role": "model"},"finishReason": "STOP","index": 0}],"usageMetadata": {"promptTokenCount": 28,"candidatesTokenCount": 5,"thoughtsTokenCount": 7,"totalTokenCount": 40},"modelVersion": "gemini-2.5-flash","responseId": "resp-1"}"#,
        ];
        let mut stream = GeminiStream::new(true, "gemini-target");
        let frames = run(&mut stream, &events);
        let json: Vec<Value> = frames[..frames.len() - 1].iter().map(frame_json).collect();
        assert_eq!(frames.len(), 9, "{json:#?}");
        assert_eq!(
            json[0]["choices"][0]["delta"],
            json!({ "role": "assistant", "content": "" })
        );
        assert_eq!(json[0]["id"], "resp-1");
        assert_eq!(json[0]["model"], "gemini-2.5-flash");
        assert_eq!(json[1]["choices"][0]["delta"]["content"], "Let me");
        assert_eq!(
            json[2]["choices"][0]["delta"],
            json!({ "reasoning_content": "thinking about it" })
        );
        assert_eq!(json[3]["choices"][0]["delta"]["content"], " check.");
        let call = &json[4]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(call["index"], 0);
        assert_eq!(call["function"]["name"], "get_weather");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        let args = &json[5]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(args["function"]["arguments"], r#"{"location": "Boston"}"#);
        assert_eq!(json[6]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            json[7]["usage"],
            json!({ "prompt_tokens": 28, "completion_tokens": 12, "total_tokens": 40,
                    "completion_tokens_details": { "reasoning_tokens": 7 } })
        );
        assert_eq!(frames[8], Frame::DONE);
        for frame in &frames {
            assert_eq!(
                frame.reading,
                crate::sse::classify_data(frame.data()),
                "{frame:?}"
            );
        }
        // After [DONE], even junk is ignored.
        assert!(stream.on_event("not json").unwrap().is_empty());
    }

    #[test]
    fn a_stream_without_include_usage_ends_plainly() {
        let mut stream = GeminiStream::new(false, "gemini-target");
        let frames = run(
            &mut stream,
            &[
                r#"{"candidates":[{"content":{"parts":[{"text":"The"}],"role":"model"}}]}"#,
                r#"{"candidates":[{"content":{"parts":[{"text":" end."}],"role":"model"},"finishReason":"MAX_TOKENS"}],"usageMetadata":{"promptTokenCount":5,"candidatesTokenCount":2,"totalTokenCount":7}}"#,
            ],
        );
        assert_eq!(frames.len(), 5);
        assert_eq!(frame_json(&frames[0])["model"], "gemini-target");
        assert_eq!(
            frame_json(&frames[3])["choices"][0]["finish_reason"],
            "length"
        );
        assert_eq!(frames[3].reading, Reading::NoContent { finished: true });
        assert_eq!(frames[4], Frame::DONE);
        let all: String = frames
            .iter()
            .map(|f| String::from_utf8_lossy(&f.raw))
            .collect();
        assert!(!all.contains("usage"), "{all}");
    }

    #[test]
    fn a_stream_of_a_blocked_prompt_ends_filtered() {
        let mut stream = GeminiStream::new(true, "m");
        let frames = run(
            &mut stream,
            &[
                r#"{"promptFeedback":{"blockReason":"PROHIBITED_CONTENT"},"usageMetadata":{"promptTokenCount":9,"totalTokenCount":9}}"#,
            ],
        );
        assert_eq!(frames.len(), 4);
        assert_eq!(
            frame_json(&frames[1])["choices"][0]["finish_reason"],
            "content_filter"
        );
        assert_eq!(frame_json(&frames[2])["usage"]["prompt_tokens"], 9);
        assert_eq!(frames[3], Frame::DONE);
    }

    #[test]
    fn a_stream_error_event_is_an_in_band_error_frame() {
        let mut stream = GeminiStream::new(false, "m");
        let frames = run(
            &mut stream,
            &[
                r#"{"error": {"code": 503, "message": "The model is overloaded. Please try again later.", "status": "UNAVAILABLE"}}"#,
            ],
        );
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].reading, Reading::Error { code: Some(503) });
        let e = frame_json(&frames[0]);
        assert_eq!(e["error"]["type"], "server_error");
        assert_eq!(e["error"]["code"], "service_unavailable");
        assert_eq!(e["error"]["param"], Value::Null);
        assert_eq!(
            e["error"]["message"],
            "The model is overloaded. Please try again later."
        );
    }

    #[test]
    fn malformed_stream_events_are_malformed() {
        use super::super::StreamTranslator;
        let mut stream = GeminiStream::new(false, "m");
        for bad in ["not json", "{}", "[1,2]", r#"{"candidates": 3}"#] {
            assert!(
                StreamTranslator::on_event(&mut stream, bad).is_err(),
                "{bad}"
            );
        }
        let ok = StreamTranslator::on_event(
            &mut stream,
            r#"{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"}}]}"#,
        )
        .unwrap();
        assert_eq!(ok.len(), 2, "role and text after the malformed ones");
    }

    fn decoded(status: u16, body: &Value) -> (u16, Value, Option<Duration>) {
        let (s, bytes, wait) = decode_error(status, body.to_string().as_bytes());
        (s, serde_json::from_slice(&bytes).unwrap(), wait)
    }

    fn quota_body() -> Value {
        json!({ "error": {
            "code": 429,
            "message": "You exceeded your current quota, please check your plan and billing details.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                { "@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
                    { "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                      "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                      "quotaValue": "10" } ] },
                { "@type": "type.googleapis.com/google.rpc.Help", "links": [
                    { "description": "Learn more", "url": "https://ai.google.dev/gemini-api/docs/rate-limits" } ] },
                { "@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47s" }
            ] } })
    }

    #[test]
    fn resource_exhausted_with_retry_info_is_a_429_with_its_wait() {
        let (status, e, wait) = decoded(429, &quota_body());
        assert_eq!(status, 429);
        assert_eq!(wait, Some(Duration::from_secs(47)));
        // Worded as OpenAI words an empty account, it is still read as the
        // per-minute limit it is: the key cools, the account is not held back.
        let table = crate::classify::ErrorTable::new(crate::classify::default_rules());
        let (_, bytes, _) = decode_error(429, quota_body().to_string().as_bytes());
        let headers = http::HeaderMap::new();
        let outcome = crate::classify::Outcome::Response {
            status: 429,
            headers: &headers,
            body: Some(&bytes),
        };
        let d = table.classify(&outcome).unwrap();
        assert!(d.rate_limited && !d.out_of_credit, "{d:?}");
        assert_eq!(
            e,
            json!({ "error": { "message": "You exceeded your current quota, please check your plan and billing details.",
                "type": "rate_limit_error", "code": "rate_limit_exceeded", "param": null } })
        );
    }

    #[test]
    fn google_status_names_map() {
        let one = |http: u16, status: &str, message: &str| {
            decoded(
                http,
                &json!({ "error": { "code": http, "message": message, "status": status } }),
            )
        };
        let (s, e, wait) = one(
            503,
            "UNAVAILABLE",
            "The model is overloaded. Please try again later.",
        );
        assert_eq!((s, wait), (503, None));
        assert_eq!(e["error"]["type"], "server_error");
        let (s, e, _) = one(400, "INVALID_ARGUMENT",
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).");
        assert_eq!(s, 400);
        assert_eq!(e["error"]["code"], "context_length_exceeded");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        let (_, e, _) = one(
            400,
            "INVALID_ARGUMENT",
            "Request contains an invalid argument.",
        );
        assert_eq!(e["error"]["code"], "invalid_request");
        for (http, status, want, code) in [
            (504, "DEADLINE_EXCEEDED", 504, "timeout"),
            (500, "INTERNAL", 500, "server_error"),
            (403, "PERMISSION_DENIED", 403, "permission_denied"),
            (401, "UNAUTHENTICATED", 401, "invalid_api_key"),
            (404, "NOT_FOUND", 404, "not_found"),
            (400, "FAILED_PRECONDITION", 400, "failed_precondition"),
            // The name wins over a status that says less.
            (500, "RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
        ] {
            let (s, e, _) = one(http, status, "m");
            assert_eq!(
                (s, e["error"]["code"].as_str().unwrap()),
                (want, code),
                "{status}"
            );
        }
        // A bad key is Gemini's 400 INVALID_ARGUMENT with ErrorInfo API_KEY_INVALID.
        let (s, e, _) = decoded(
            400,
            &json!({ "error": { "code": 400,
            "message": "API key not valid. Please pass a valid API key.", "status": "INVALID_ARGUMENT",
            "details": [{ "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                          "reason": "API_KEY_INVALID", "domain": "googleapis.com" }] } }),
        );
        assert_eq!(
            (s, e["error"]["code"].as_str().unwrap()),
            (401, "invalid_api_key")
        );
        // No name: the body's code, else the HTTP status.
        assert_eq!(
            decoded(500, &json!({ "error": { "code": 429, "message": "m" } })).0,
            429
        );
        assert_eq!(decoded(502, &json!({ "error": { "message": "m" } })).0, 502);
    }

    #[test]
    fn an_array_wrapped_vertex_error_is_read() {
        let body = r#"[{
  "error": {
    "code": 429,
    "message": "Resource exhausted. Please try again later. Please refer to https://cloud.google.com/vertex-ai/generative-ai/docs/error-code-429 for more details.",
    "status": "RESOURCE_EXHAUSTED"
  }
}
]"#;
        let (s, bytes, wait) = decode_error(429, body.as_bytes());
        let e: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!((s, wait), (429, None));
        assert_eq!(e["error"]["code"], "rate_limit_exceeded");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("Resource exhausted."), "{message:?}");
    }

    #[test]
    fn junk_error_bodies_pass_through() {
        for junk in [
            &b"<html>502 Bad Gateway</html>"[..],
            b"",
            br#"{"error":"oops"}"#,
            b"[]",
        ] {
            let (s, bytes, wait) = decode_error(502, junk);
            assert_eq!((s, &bytes[..], wait), (502, junk, None));
        }
    }

    #[test]
    fn protobuf_durations_parse() {
        for (text, want) in [
            ("30s", Some(Duration::from_secs(30))),
            ("1.5s", Some(Duration::from_millis(1500))),
            ("0.200s", Some(Duration::from_millis(200))),
            ("47.434392449s", Some(Duration::new(47, 434_392_449))),
            (".5s", Some(Duration::from_millis(500))),
            ("30", None),
            ("-1s", None),
            ("s", None),
            ("1.0000000001s", None),
            ("abc", None),
        ] {
            assert_eq!(proto_duration(text), want, "{text}");
        }
    }

    #[test]
    fn embeddings_requests_translate() {
        let to = |v: Value, model: &str| {
            let Value::Object(o) = v else { panic!() };
            to_embed_request(&o, model)
        };
        assert_eq!(
            to(json!({ "model": "x", "input": ["a", "b"], "dimensions": 256, "encoding_format": "float" }),
               "gemini-embedding-001").unwrap(),
            json!({ "requests": [
                { "model": "models/gemini-embedding-001", "content": { "parts": [{ "text": "a" }] },
                  "outputDimensionality": 256 },
                { "model": "models/gemini-embedding-001", "content": { "parts": [{ "text": "b" }] },
                  "outputDimensionality": 256 }
            ]})
        );
        assert_eq!(
            to(json!({ "input": "one" }), "models/text-embedding-004").unwrap(),
            json!({ "requests": [{ "model": "models/text-embedding-004",
                                   "content": { "parts": [{ "text": "one" }] } }] })
        );
        unsupported_naming(to(json!({ "input": [1, 2, 3] }), "m"), "token");
        unsupported_naming(to(json!({ "input": [[1, 2], [3]] }), "m"), "token");
        unsupported_naming(
            to(json!({ "input": "a", "encoding_format": "int8" }), "m"),
            "int8",
        );
        assert!(to(json!({ "input": "a", "encoding_format": "base64" }), "m").is_ok());
        assert!(matches!(
            to(json!({ "input": [] }), "m"),
            Err(TranslateError::InvalidRequest(_))
        ));
        assert!(matches!(
            to(json!({}), "m"),
            Err(TranslateError::InvalidRequest(_))
        ));
    }

    #[test]
    fn embeddings_responses_translate() {
        let body =
            br#"{"embeddings": [{"values": [0.0123, -0.98765432101234567]}, {"values": [1e-7]}]}"#;
        let got = from_embed_response(body, "gemini-embedding-001").unwrap();
        let text = std::str::from_utf8(&got).unwrap();
        assert!(
            text.contains("-0.98765432101234567"),
            "floats copied as sent: {text}"
        );
        let v: Value = serde_json::from_slice(&got).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["model"], "gemini-embedding-001");
        assert_eq!(
            v["data"][1],
            json!({ "object": "embedding", "index": 1, "embedding": [1e-7] })
        );
        assert_eq!(v["data"][0]["embedding"][0], json!(0.0123));
        assert_eq!(v["usage"], json!({ "prompt_tokens": 0, "total_tokens": 0 }));
        let err = br#"{"error":{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED"}}"#;
        assert!(matches!(
            from_embed_response(err, "m"),
            Err(TranslateError::Upstream { ref kind, ref message })
                if kind == "RESOURCE_EXHAUSTED" && message == "quota"
        ));
        assert!(matches!(
            from_embed_response(b"{}", "m"),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            from_embed_response(br#"{"embeddings":[{"values":3}]}"#, "m"),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            from_embed_response(b"nope", "m"),
            Err(TranslateError::Json(_))
        ));
    }
}
