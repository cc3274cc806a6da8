//! OpenAI Chat Completions <-> AWS Bedrock Converse, as pure translation: no I/O.
//!
//! The request side turns a parsed OpenAI chat request into the body of
//! `POST /model/{modelId}/converse` (or `converse-stream`): the model id is in
//! the URL, SigV4 signing and the binary event-stream framing are the
//! adapter's business. The response side turns a Converse answer, an error
//! body, or a stream (one decoded event-stream message at a time, as
//! `{"<event-type>": <payload>}`) back into what an OpenAI client expects.
//!
//! The wire shapes are botocore's `bedrock-runtime/2023-09-30/service-2.json`.
//! What does not map is handled on purpose, never silently wrong: OpenAI
//! fields with no Converse counterpart are dropped (`top_k`, `seed`,
//! `presence_penalty`, `parallel_tool_calls`, `user`, ...), while content and
//! asks the answer could not honour (audio, http image URLs, `n > 1`,
//! `logprobs`, JSON mode without a schema, non-function tools) are a
//! [`TranslateError`], so the engine skips the target.
//!
//! Two mappings are model-specific, because Converse has no general field for
//! them: `reasoning_effort` becomes Anthropic's `thinking` in
//! `additionalModelRequestFields` ([`to_converse_request`] does not know the
//! model, so the adapter drops it for a model id that is not Anthropic's). Reasoning text, whole or
//! streamed, is passed on as `reasoning_content`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::chunk::{self, completion_id, now_secs, Delta, Frame, Head};
use super::non_null;
use super::translate;
use super::translate::{
    content_parts, data_url, function_tools, image_url, inline_file, invalid, max_tokens,
    messages_with_roles, part_kind, push_turn, refuse_untranslatable, stop_sequences, unsupported,
    wire, TranslateError, Turn,
};
use super::Malformed;

/// AWS Bedrock's Converse API (`protocol: bedrock`).
#[derive(Debug)]
pub struct Bedrock;

/// The service name Bedrock's runtime signs for.
const SIGNING_NAME: &str = "bedrock";

/// The protocol's name in a refusal.
const API: &str = "the Bedrock Converse API";

/// The region of a Bedrock runtime URL (`bedrock-runtime.{region}.amazonaws.com`,
/// or its FIPS twin), if it is one.
fn region_of(base_url: &str) -> Option<&str> {
    let host = base_url
        .split_once("://")
        .map_or(base_url, |(_, rest)| rest)
        .split(['/', ':'])
        .next()?;
    let rest = host
        .strip_prefix("bedrock-runtime.")
        .or_else(|| host.strip_prefix("bedrock-runtime-fips."))?;
    let (region, domain) = rest.split_once('.')?;
    domain.starts_with("amazonaws.").then_some(region)
}

impl super::Adapter for Bedrock {
    fn name(&self) -> &'static str {
        "bedrock"
    }

    fn chat_path(&self) -> &'static str {
        "model/{modelId}/converse"
    }

    fn call_path(&self, op: super::Operation, model: &str, stream: bool) -> Option<String> {
        let method = if stream {
            "converse-stream"
        } else {
            "converse"
        };
        match op {
            super::Operation::Chat => {
                Some(format!("model/{}/{method}", super::path_segment(model)))
            }
            super::Operation::Embeddings | super::Operation::CountTokens => None,
        }
    }

    fn framing(&self) -> super::Framing {
        super::Framing::AwsEventStream
    }

    fn default_base_url(&self, place: &super::Place<'_>) -> Result<String, String> {
        place
            .region
            .map(|region| format!("https://bedrock-runtime.{region}.amazonaws.com"))
            .ok_or_else(|| "`protocol: bedrock` needs `region` (or `base_url`)".to_owned())
    }

    fn place_keys(&self) -> &'static [&'static str] {
        &["region", "aws_profile"]
    }

    fn place_required(&self) -> &'static [&'static str] {
        &["region"]
    }

    fn auth(
        &self,
        place: &super::Place<'_>,
        base_url: &str,
    ) -> Result<Option<super::auth::Auth>, super::PlaceError> {
        let region = match (place.region, region_of(base_url)) {
            (Some(set), Some(url)) if set != url => {
                return Err(super::PlaceError {
                    key: Some("region"),
                    message: format!(
                        "`region` is {set} but base_url is Bedrock's in {url}: every signature would be refused"
                    ),
                })
            }
            (Some(region), _) | (None, Some(region)) => region,
            (None, None) => {
                return Err(super::PlaceError {
                    key: None,
                    message: "`protocol: bedrock` signs requests for a region: set `region`".into(),
                })
            }
        };
        Ok(Some(super::auth::Auth::SigV4(super::auth::SigV4::new(
            region,
            SIGNING_NAME,
            place.aws_profile,
        ))))
    }

    fn required_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }

    fn key_header(&self) -> (&'static str, &'static str) {
        ("authorization", "Bearer ")
    }

    fn embeddings_path(&self) -> Option<&'static str> {
        None
    }

    fn encode(
        &self,
        request: &crate::request::ChatRequest<'_>,
        target: super::TargetModel<'_>,
    ) -> Result<Bytes, super::Unsupported> {
        let object = request
            .to_object()
            .map_err(|e| super::Unsupported(e.to_string()))?;
        let mut body =
            to_converse_request(&object, target.max_output).map_err(|e| e.refusal(API))?;
        // `thinking` is Anthropic's field: another family refuses it.
        if !target.model.contains("anthropic.") {
            if let Some(body) = body.as_object_mut() {
                body.remove("additionalModelRequestFields");
            }
        }
        Ok(Bytes::from(body.to_string()))
    }

    fn encode_embeddings(
        &self,
        _request: &crate::request::EmbeddingsRequest<'_>,
        _model: &str,
    ) -> Result<Bytes, super::Unsupported> {
        Err(super::Unsupported(
            "switchyard reaches Bedrock's Converse API, which has no embeddings".into(),
        ))
    }

    fn decode_answer(&self, body: Bytes, model: &str) -> Result<Bytes, super::Malformed> {
        match from_converse_response(&body, model) {
            Ok(chat) => Ok(chat),
            // An exception in a 2xx body (`{"__type": "ThrottlingException"}`)
            // is an in-band error, read like the status it stands for.
            Err(e) => in_band_answer(&body).ok_or_else(|| super::Malformed(e.to_string())),
        }
    }

    fn decode_error(
        &self,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        body: Bytes,
    ) -> super::ErrorAnswer {
        let kind = headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok());
        let (code, body, wait) = decode_error(status.as_u16(), kind, &body);
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
        Some(Box::new(ConverseStream::new(include_usage, model)))
    }
}

// ---------------------------------------------------------------------------
// Request: OpenAI -> Converse
// ---------------------------------------------------------------------------

/// OpenAI chat request object -> Converse request body (the modelId is in the URL, not the body).
///
/// System and developer messages become `system` text blocks; consecutive
/// same-role turns are merged; `tool` messages become `toolResult` blocks in
/// a user turn. `maxTokens` is the request's, else `max_output` if given,
/// else absent (Converse then uses the model's maximum). `temperature` is
/// clamped to Converse's 0..=1. A conversation that starts with an assistant
/// turn is sent as is (Bedrock answers 400: the caller's problem).
///
/// `tool_choice: "none"` drops the tools (Converse has no "none"), unless the
/// conversation holds `toolUse`/`toolResult` blocks: Bedrock then requires a
/// `toolConfig`, so the tools are kept with Converse's default choice, auto.
/// `response_format` `json_schema` becomes `outputConfig.textFormat` (the
/// schema as a JSON string, as the API wants); `json_object` has no schema to
/// give, so it is unsupported. `reasoning_effort` low/medium/high becomes
/// `additionalModelRequestFields.thinking` with 1024/4096/16384 budget tokens
/// (Anthropic's documented form on Bedrock), left out when the request's own
/// settings would make Claude reject it: a `maxTokens` not above the budget,
/// a `temperature` other than 1, a `topP` below 0.95, or a forced tool.
pub fn to_converse_request(
    chat: &Map<String, Value>,
    max_output: Option<u64>,
) -> Result<Value, TranslateError> {
    let messages = chat
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("`messages` must be an array"))?;
    unanswerable(chat)?;
    let (system, turns) = conversation(messages)?;
    if turns.is_empty() {
        return Err(invalid("no user or assistant message with content"));
    }
    let history_has_tools = turns
        .iter()
        .flat_map(|t| &t.blocks)
        .any(|b| b.get("toolUse").is_some() || b.get("toolResult").is_some());

    let mut out = Map::new();
    let messages: Vec<Value> = turns
        .into_iter()
        .map(|t| json!({ "role": t.role, "content": t.blocks }))
        .collect();
    out.insert("messages".into(), Value::Array(messages));
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    let inference = inference_config(chat, max_output)?;
    let (tool_config, forced) = tool_config(chat, history_has_tools)?;
    let thinking = thinking(chat, &inference, forced)?;
    if !inference.is_empty() {
        out.insert("inferenceConfig".into(), Value::Object(inference));
    }
    if let Some(config) = tool_config {
        out.insert("toolConfig".into(), config);
    }
    if let Some(config) = output_config(chat)? {
        out.insert("outputConfig".into(), config);
    }
    if let Some(thinking) = thinking {
        out.insert(
            "additionalModelRequestFields".into(),
            json!({ "thinking": thinking }),
        );
    }
    Ok(Value::Object(out))
}

/// Asks whose answer a Converse response could not carry: more than one
/// choice, audio output, log probabilities. Dropping them would hand the
/// client an answer without what it asked for, so the target is skipped.
fn unanswerable(chat: &Map<String, Value>) -> Result<(), TranslateError> {
    if let Some(n) = non_null(chat, "n") {
        if n.as_u64().is_none_or(|n| n > 1) {
            return Err(unsupported(format!("`n` = {n}")));
        }
    }
    refuse_untranslatable(chat)
}

/// The system blocks and the merged turns of the OpenAI messages.
fn conversation(messages: &[Value]) -> Result<(Vec<Value>, Vec<Turn>), TranslateError> {
    let mut system: Vec<Value> = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    for read in messages_with_roles(messages) {
        let (at, message, role) = read?;
        match role {
            "system" | "developer" => system.extend(system_blocks(message.get("content"), &at)?),
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

/// A text block, or none for blank text (Bedrock rejects a blank `text`).
fn text_block(text: &str) -> Option<Value> {
    (!text.trim().is_empty()).then(|| json!({ "text": text }))
}

fn system_blocks(content: Option<&Value>, at: &str) -> Result<Vec<Value>, TranslateError> {
    let mut out = Vec::new();
    for (j, part) in content_parts(content, at)?.into_iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) => out.extend(text_block(t)),
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
            ("text", Some(t)) => out.extend(text_block(t)),
            ("image_url", _) => out.push(image_block(part, &at)?),
            ("file", _) => out.push(document_block(part, &at)?),
            (kind, _) => return Err(unsupported(format!("{at}: `{kind}` content part"))),
        }
    }
    Ok(out)
}

/// `{"type":"image_url","image_url":{"url":...}}` -> a Converse image block.
/// Converse takes image bytes (base64 in JSON) or an S3 location, never an
/// http(s) URL: fetching it is not a translator's job, so it is unsupported.
fn image_block(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let url = image_url(part, at)?;
    if url.starts_with("https://") || url.starts_with("http://") {
        return Err(unsupported(format!(
            "{at}: image by URL (Converse takes image bytes or S3 only)"
        )));
    }
    let (media_type, data) = data_url(url, at)?;
    let format = match media_type.to_ascii_lowercase().as_str() {
        "image/png" => "png",
        "image/jpeg" | "image/jpg" => "jpeg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        other => return Err(unsupported(format!("{at}: image type `{other}`"))),
    };
    Ok(json!({ "image": { "format": format, "source": { "bytes": data } } }))
}

/// `{"type":"file","file":{"file_data":"data:application/pdf;base64,...","filename":...}}`
/// -> a Converse document block. Uploaded files (`file_id`) are OpenAI's
/// storage, which Bedrock cannot read.
fn document_block(part: &Value, at: &str) -> Result<Value, TranslateError> {
    let (media_type, data, filename) = inline_file(part, at)?;
    let format = match media_type.to_ascii_lowercase().as_str() {
        "application/pdf" => "pdf",
        "text/csv" => "csv",
        "text/html" => "html",
        "text/plain" => "txt",
        "text/markdown" => "md",
        "application/msword" => "doc",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document" => "docx",
        "application/vnd.ms-excel" => "xls",
        "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet" => "xlsx",
        other => return Err(unsupported(format!("{at}: file type `{other}`"))),
    };
    let name = document_name(filename);
    Ok(json!({ "document": { "format": format, "name": name, "source": { "bytes": data } } }))
}

/// A document name Bedrock accepts: only alphanumerics, single whitespace,
/// hyphens, parentheses and square brackets, at most 200 characters (the
/// extension is dropped: the format says it).
fn document_name(filename: Option<&str>) -> String {
    let stem = filename
        .map(|f| f.rsplit_once('.').map_or(f, |(stem, _)| stem))
        .unwrap_or_default();
    let mut name = String::new();
    for c in stem.chars() {
        let c = match c {
            c if c.is_alphanumeric() || matches!(c, '-' | '(' | ')' | '[' | ']') => c,
            c if c.is_whitespace() => ' ',
            _ => '-',
        };
        if !(c == ' ' && (name.is_empty() || name.ends_with(' '))) {
            name.push(c);
        }
    }
    let name: String = name.trim_end().chars().take(200).collect();
    let name = name.trim_end();
    if name.is_empty() {
        "document".to_owned()
    } else {
        name.to_owned()
    }
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
            ("text" | "refusal", Some(t)) => out.extend(text_block(t)),
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

/// An OpenAI tool call -> `{"toolUse":{toolUseId, name, input}}`; Converse
/// wants the input as a JSON object, OpenAI sends it as JSON text.
fn tool_use_block(call: &Value, at: &str) -> Result<Value, TranslateError> {
    let call = translate::tool_call(call, at)?;
    let id = crate::native::tool_use_id(call.id);
    Ok(json!({ "toolUse": { "toolUseId": id, "name": call.name, "input": call.input } }))
}

/// A `tool` message -> a `toolResult` block. Text that is a JSON object goes
/// as a `json` block, anything else as `text`. An empty result is `{"json":{}}`:
/// Bedrock rejects blank text, and an empty object says "nothing" without
/// inventing words. No `status`: OpenAI has no error flag for tool results.
fn tool_result(message: &Map<String, Value>, at: &str) -> Result<Value, TranslateError> {
    let id = message
        .get("tool_call_id")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.tool_call_id must be a string")))?;
    let mut content = Vec::new();
    for (j, part) in content_parts(message.get("content"), at)?
        .into_iter()
        .enumerate()
    {
        let at = format!("{at}.content[{j}]");
        match part_kind(part, &at)? {
            ("text", Some(t)) if t.trim().is_empty() => {}
            ("text", Some(t)) => content.push(match serde_json::from_str::<Value>(t) {
                Ok(object @ Value::Object(_)) => json!({ "json": object }),
                Ok(_) | Err(_) => json!({ "text": t }),
            }),
            (kind, _) => return Err(unsupported(format!("{at}: `{kind}` part in a tool result"))),
        }
    }
    if content.is_empty() {
        content.push(json!({ "json": {} }));
    }
    let id = crate::native::tool_use_id(id);
    Ok(json!({ "toolResult": { "toolUseId": id, "content": content } }))
}

/// `maxTokens`, `temperature`, `topP`, `stopSequences`.
fn inference_config(
    chat: &Map<String, Value>,
    max_output: Option<u64>,
) -> Result<Map<String, Value>, TranslateError> {
    let mut out = Map::new();
    if let Some(n) = max_tokens(chat)?.or(max_output) {
        out.insert("maxTokens".into(), Value::from(n));
    }
    if let Some(t) = non_null(chat, "temperature") {
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
    if let Some(p) = non_null(chat, "top_p") {
        if !p.is_number() {
            return Err(invalid("`top_p` must be a number"));
        }
        out.insert("topP".into(), p.clone());
    }
    if let Some(stop) = stop_sequences(chat)? {
        out.insert("stopSequences".into(), stop);
    }
    Ok(out)
}

/// OpenAI's `tool_choice`, read.
enum Choice {
    None,
    Auto,
    Any,
    Tool(String),
}

/// `toolConfig` (if any), and whether it forces a tool call.
fn tool_config(
    chat: &Map<String, Value>,
    history_has_tools: bool,
) -> Result<(Option<Value>, bool), TranslateError> {
    let tools = match non_null(chat, "tools") {
        Some(t) => tool_specs(t)?,
        None => Vec::new(),
    };
    let choice = non_null(chat, "tool_choice").map(tool_choice).transpose()?;
    if tools.is_empty() {
        return Ok((None, false));
    }
    let choice = match choice {
        Some(Choice::None) if !history_has_tools => return Ok((None, false)),
        // Kept for the history's sake; auto is Converse's default.
        Some(Choice::None) | None => None,
        Some(Choice::Auto) => Some(json!({ "auto": {} })),
        Some(Choice::Any) => Some(json!({ "any": {} })),
        Some(Choice::Tool(name)) => Some(json!({ "tool": { "name": name } })),
    };
    let forced = choice
        .as_ref()
        .is_some_and(|c| c.get("any").is_some() || c.get("tool").is_some());
    let mut config = Map::new();
    config.insert("tools".into(), Value::Array(tools));
    if let Some(choice) = choice {
        config.insert("toolChoice".into(), choice);
    }
    Ok((Some(Value::Object(config)), forced))
}

fn tool_specs(tools: &Value) -> Result<Vec<Value>, TranslateError> {
    let read = function_tools(tools)?;
    Ok(read
        .into_iter()
        .map(|tool| {
            let mut spec = Map::new();
            spec.insert("name".into(), Value::from(tool.name));
            // Converse's description must be non-empty.
            if let Some(d) = tool.description.filter(|d| !d.is_empty()) {
                spec.insert("description".into(), Value::from(d));
            }
            let schema = tool
                .parameters
                .cloned()
                .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
            spec.insert("inputSchema".into(), json!({ "json": schema }));
            json!({ "toolSpec": spec })
        })
        .collect())
}

fn tool_choice(choice: &Value) -> Result<Choice, TranslateError> {
    match choice {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(Choice::Auto),
            "required" => Ok(Choice::Any),
            "none" => Ok(Choice::None),
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
            Ok(Choice::Tool(name.to_owned()))
        }
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => {
            Err(invalid("`tool_choice` must be a string or an object"))
        }
    }
}

/// `response_format` -> `outputConfig` (botocore's `OutputConfig.textFormat`:
/// `{"type":"json_schema","structure":{"jsonSchema":{"schema":"<JSON text>",...}}}`).
fn output_config(chat: &Map<String, Value>) -> Result<Option<Value>, TranslateError> {
    let Some(format) = non_null(chat, "response_format") else {
        return Ok(None);
    };
    let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" => Ok(None),
        "json_schema" => {
            let spec = format.get("json_schema");
            let schema = spec
                .and_then(|s| s.get("schema"))
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    unsupported("`response_format` json_schema without a `schema` object")
                })?;
            let mut json_schema = Map::new();
            json_schema.insert("schema".into(), Value::from(schema.to_string()));
            for key in ["name", "description"] {
                if let Some(v) = spec.and_then(|s| s.get(key)).and_then(Value::as_str) {
                    json_schema.insert(key.into(), Value::from(v));
                }
            }
            Ok(Some(json!({
                "textFormat": { "type": "json_schema", "structure": { "jsonSchema": json_schema } }
            })))
        }
        // JSON without a schema: Converse only constrains to a schema.
        other => Err(unsupported(format!(
            "JSON output (`response_format` type `{other}`)"
        ))),
    }
}

/// `reasoning_effort` -> Anthropic's `thinking` (see [`to_converse_request`]).
fn thinking(
    chat: &Map<String, Value>,
    inference: &Map<String, Value>,
    forced_tool: bool,
) -> Result<Option<Value>, TranslateError> {
    let Some(effort) = non_null(chat, "reasoning_effort") else {
        return Ok(None);
    };
    let effort = effort
        .as_str()
        .ok_or_else(|| invalid("`reasoning_effort` must be a string"))?;
    let budget: u64 = match effort {
        "low" => 1024,
        "medium" => 4096,
        "high" => 16384,
        // "minimal", "none" and values Claude has no budget for.
        _ => return Ok(None),
    };
    let number = |key: &str| inference.get(key).and_then(Value::as_f64);
    let too_few_tokens = inference
        .get("maxTokens")
        .and_then(Value::as_u64)
        .is_some_and(|max| max <= budget);
    let sampling =
        number("temperature").is_some_and(|t| t != 1.0) || number("topP").is_some_and(|p| p < 0.95);
    if too_few_tokens || sampling || forced_tool {
        return Ok(None);
    }
    Ok(Some(json!({ "type": "enabled", "budget_tokens": budget })))
}

// ---------------------------------------------------------------------------
// Response: Converse -> OpenAI
// ---------------------------------------------------------------------------

/// Converse `TokenUsage` (an answer's, or a stream's `metadata`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TokenUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_write_input_tokens: Option<u64>,
}

impl TokenUsage {
    /// OpenAI's usage: `prompt_tokens` counts cache reads and writes (which
    /// Converse's `inputTokens` leaves out), cache reads are `cached_tokens`.
    /// `None` without counts: the gateway then books its estimate, not zeros.
    fn to_openai(&self) -> Option<chunk::Usage> {
        if self.input_tokens.is_none() && self.output_tokens.is_none() {
            return None;
        }
        let read = self.cache_read_input_tokens.unwrap_or(0);
        // Saturating: the counts are the upstream's, and may be absurd.
        let prompt = self
            .input_tokens
            .unwrap_or(0)
            .saturating_add(read)
            .saturating_add(self.cache_write_input_tokens.unwrap_or(0));
        Some(chunk::Usage::new(
            prompt,
            self.output_tokens.unwrap_or(0),
            read,
            0,
        ))
    }
}

/// Converse `stopReason` -> OpenAI `finish_reason`. `malformed_model_output`,
/// `malformed_tool_use` and reasons added later read as `stop`: OpenAI has
/// no word for them, and the content is what it is. An answer that `called`
/// a tool says `tool_calls` whatever stop its model named (some say
/// `end_turn`): agent loops look for the call by that finish.
/// Stop reasons that leave no answer: the model's output or its tool call
/// could not be read (an in-band 502 of the upstream's, failed over), not a
/// `stop` with whatever came before.
fn botched(stop_reason: Option<&str>) -> Option<Value> {
    let (code, what) = match stop_reason? {
        "malformed_tool_use" => ("malformed_tool_use", "the model's tool call was malformed"),
        "malformed_model_output" => ("malformed_model_output", "the model's output was malformed"),
        _ => return None,
    };
    Some(
        json!({"error": {"message": format!("{what} (stopReason {code})"),
        "type": "upstream_error", "code": code, "param": null, "status": 502}}),
    )
}

fn finish_reason(stop_reason: &str, called: bool) -> &'static str {
    match stop_reason {
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "guardrail_intervened" | "content_filtered" => "content_filter",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// One read of an answer body: a Converse response, or an error body.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Reply<'a> {
    #[serde(borrow)]
    output: Option<Output<'a>>,
    #[serde(borrow)]
    stop_reason: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: TokenUsage,
    #[serde(borrow, alias = "Message")]
    message: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Output<'a> {
    #[serde(borrow)]
    message: Option<OutputMessage<'a>>,
}

#[derive(Deserialize)]
struct OutputMessage<'a> {
    #[serde(borrow, default)]
    content: Vec<Block<'a>>,
}

/// A `ContentBlock` union member of an answer (the ones read).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Block<'a> {
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_use: Option<ToolUse<'a>>,
    #[serde(borrow)]
    reasoning_content: Option<ReasoningContent<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ToolUse<'a> {
    #[serde(borrow)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReasoningContent<'a> {
    #[serde(borrow)]
    reasoning_text: Option<ReasoningText<'a>>,
}

#[derive(Deserialize)]
struct ReasoningText<'a> {
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
}

/// Converse response JSON -> OpenAI `chat.completion` JSON bytes; `model`: the target's model id.
///
/// Text blocks are concatenated into `message.content` (`null` when there is
/// no text but there are tool calls); `reasoningContent` text goes to
/// `message.reasoning_content` (redacted reasoning is dropped); `toolUse`
/// blocks become `tool_calls` with the input as JSON text. An error body
/// (`{"message": ...}` with no `output`) is [`TranslateError::InvalidResponse`].
pub fn from_converse_response(body: &[u8], model: &str) -> Result<Bytes, TranslateError> {
    let reply: Reply<'_> = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            TranslateError::InvalidResponse(format!("not a Converse response: {e}"))
        }
        serde_json::error::Category::Io
        | serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof => TranslateError::Json(e),
    })?;
    if let Some(error) = botched(reply.stop_reason.as_deref()) {
        return Ok(Bytes::from(error.to_string()));
    }
    let Some(message) = reply.output.and_then(|o| o.message) else {
        return Err(TranslateError::InvalidResponse(match reply.message {
            Some(m) => format!("an error body: {m}"),
            None => "not a Converse response: no `output.message`".into(),
        }));
    };
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut tool_calls = Vec::new();
    for block in message.content {
        if let Some(t) = block.text {
            text.push_str(&t);
        }
        if let Some(t) = block
            .reasoning_content
            .and_then(|r| r.reasoning_text)
            .and_then(|r| r.text)
        {
            reasoning.push_str(&t);
        }
        if let Some(call) = block.tool_use {
            tool_calls.push(tool_call(call)?);
        }
    }
    let called = !tool_calls.is_empty();
    let completion = wire::Completion {
        id: &completion_id(),
        object: "chat.completion",
        created: now_secs(),
        model,
        choices: &[wire::Choice {
            index: 0,
            message: wire::Message {
                role: "assistant",
                content: (tool_calls.is_empty() || !text.is_empty()).then_some(text),
                reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                tool_calls,
            },
            logprobs: None,
            finish_reason: (reply.stop_reason.as_deref()).map(|r| finish_reason(r, called)),
        }],
        usage: reply.usage.to_openai(),
    };
    serde_json::to_vec(&completion)
        .map(Bytes::from)
        .map_err(TranslateError::Json)
}

/// A `toolUse` block -> an OpenAI tool call; one the client cannot answer
/// (no id), cannot run (no name) or whose input is not an object is no answer.
fn tool_call(call: ToolUse<'_>) -> Result<wire::ToolCall, TranslateError> {
    let arguments = match call.input.map(|raw| raw.get().trim()) {
        None | Some("null") => "{}".to_owned(),
        Some(object) if object.starts_with('{') => object.to_owned(),
        Some(_) => {
            return Err(TranslateError::InvalidResponse(
                "a toolUse block's input is not an object".into(),
            ))
        }
    };
    Ok(wire::ToolCall {
        id: tool_use_field(call.tool_use_id.as_deref(), "toolUseId")?,
        kind: "function",
        function: wire::Function {
            name: tool_use_field(call.name.as_deref(), "name")?,
            arguments,
        },
    })
}

/// A `toolUse`'s `toolUseId` or `name` (`what`): a call without one is no answer.
fn tool_use_field(value: Option<&str>, what: &str) -> Result<String, TranslateError> {
    value
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| TranslateError::InvalidResponse(format!("a toolUse without `{what}`")))
}

// ---------------------------------------------------------------------------
// Errors: Bedrock exceptions -> OpenAI errors
// ---------------------------------------------------------------------------

/// A Bedrock exception, by name (`ThrottlingException` in a header or
/// `__type`, `throttlingException` as a stream event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exception {
    Throttling,
    ServiceQuotaExceeded,
    ServiceUnavailable,
    ModelNotReady,
    ModelTimeout,
    InternalServer,
    AccessDenied,
    /// The credentials or their signature (not the account's permissions).
    Auth,
    ResourceNotFound,
    Validation,
    ModelError,
    ModelStreamError,
    Unknown,
}

impl Exception {
    fn parse(name: &str) -> Self {
        match name.to_ascii_lowercase().as_str() {
            "throttlingexception" | "throttling" | "toomanyrequestsexception" => Self::Throttling,
            "servicequotaexceededexception" => Self::ServiceQuotaExceeded,
            "serviceunavailableexception" | "serviceunavailable" => Self::ServiceUnavailable,
            "modelnotreadyexception" => Self::ModelNotReady,
            "modeltimeoutexception" => Self::ModelTimeout,
            "internalserverexception" | "internalfailure" => Self::InternalServer,
            "accessdeniedexception" => Self::AccessDenied,
            "unrecognizedclientexception"
            | "invalidsignatureexception"
            | "incompletesignatureexception"
            | "expiredtokenexception"
            | "missingauthenticationtokenexception"
            | "invalidclienttokenid"
            | "signaturedoesnotmatch" => Self::Auth,
            "resourcenotfoundexception" => Self::ResourceNotFound,
            "validationexception" => Self::Validation,
            "modelerrorexception" => Self::ModelError,
            "modelstreamerrorexception" => Self::ModelStreamError,
            _ => Self::Unknown,
        }
    }
}

/// Bedrock's ways of saying "the prompt is longer than the context window"
/// that [`crate::classify::is_context_length`] does not know ("Input is too
/// long for requested model" and "prompt is too long" it does).
const BEDROCK_CONTEXT_PHRASES: &[&str] = &["too many input tokens", "input tokens exceeded"];

/// Whether an error text says the prompt is longer than the context window.
fn is_context_length(text: &str) -> bool {
    if crate::classify::is_context_length(text) {
        return true;
    }
    let lower = text.to_ascii_lowercase();
    BEDROCK_CONTEXT_PHRASES.iter().any(|p| lower.contains(p))
}

/// What an OpenAI client is told of one error: status, `type`, `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ErrorNames {
    status: u16,
    kind: &'static str,
    code: &'static str,
}

fn names(status: u16, kind: &'static str, code: &'static str) -> ErrorNames {
    ErrorNames { status, kind, code }
}

/// The names of an exception; `status` is the one to judge by when the
/// exception does not decide it (unknown names, a model stream error's
/// original status), `text` its message.
fn error_names(exception: Exception, status: u16, text: &str) -> ErrorNames {
    match exception {
        // A quota Bedrock may send as a 400 still clears with time: a rate limit.
        Exception::Throttling | Exception::ServiceQuotaExceeded => {
            names(429, "rate_limit_error", "rate_limit_exceeded")
        }
        Exception::ServiceUnavailable => names(503, "server_error", "service_unavailable"),
        Exception::ModelNotReady => names(503, "server_error", "model_not_ready"),
        Exception::ModelTimeout => names(504, "server_error", "timeout"),
        Exception::InternalServer => names(500, "server_error", "server_error"),
        Exception::AccessDenied => names(403, "permission_error", "permission_denied"),
        Exception::Auth => names(401, "authentication_error", "invalid_api_key"),
        Exception::ResourceNotFound => names(404, "not_found_error", "not_found"),
        Exception::Validation => by_status(400, text),
        // 424 from Bedrock: the model failed, not the request.
        Exception::ModelError if is_context_length(text) => context_length(),
        Exception::ModelError => names(502, "server_error", "model_error"),
        Exception::ModelStreamError | Exception::Unknown => by_status(status, text),
    }
}

fn context_length() -> ErrorNames {
    names(400, "invalid_request_error", "context_length_exceeded")
}

/// The names of an error known only by its status (and message).
fn by_status(status: u16, text: &str) -> ErrorNames {
    match status {
        400..=428 | 430..=499 if is_context_length(text) => context_length(),
        401 => names(401, "authentication_error", "invalid_api_key"),
        403 => names(403, "permission_error", "permission_denied"),
        404 => names(404, "not_found_error", "not_found"),
        408 | 504 => names(status, "server_error", "timeout"),
        429 => names(429, "rate_limit_error", "rate_limit_exceeded"),
        400..=499 => names(status, "invalid_request_error", "invalid_request"),
        503 => names(503, "server_error", "service_unavailable"),
        500..=599 => names(status, "server_error", "server_error"),
        // Not an error status: the upstream failed to say what went wrong.
        _ => names(502, "server_error", "server_error"),
    }
}

/// The exception name in an `x-amzn-ErrorType` value (`Name:http://...`) or
/// a body's `__type` (`namespace#Name`).
fn exception_name(text: &str) -> &str {
    let before_colon = text.split(':').next().unwrap_or_default();
    before_colon.rsplit('#').next().unwrap_or_default().trim()
}

/// A Bedrock error body's fields (restJson: `message`, sometimes `Message`).
#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default, alias = "Message")]
    message: Option<String>,
    #[serde(rename = "__type", default)]
    kind: Option<String>,
    #[serde(default)]
    code: Option<Value>,
}

/// A Bedrock error response -> (the status the client should see, OpenAI-format error JSON bytes, advertised wait if any).
/// `error_type`: the `x-amzn-ErrorType` header value if present (e.g. "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"), else the body's `__type`/`code` fields.
///
/// The advertised wait is always `None`: no Bedrock exception shape carries
/// one (service-2.json), and Bedrock sends no `Retry-After` of its own. A body
/// that is neither JSON with a message nor named by the header is returned
/// as is, with its status. A named exception with an unreadable body gets
/// its name as the message.
#[must_use]
pub fn decode_error(
    status: u16,
    error_type: Option<&str>,
    body: &[u8],
) -> (u16, Bytes, Option<Duration>) {
    let parsed = serde_json::from_slice::<ErrorBody>(body).ok();
    let from_header = error_type.map(exception_name).filter(|n| !n.is_empty());
    let from_body = parsed.as_ref().and_then(|b| {
        let code = b.code.as_ref().and_then(Value::as_str);
        b.kind
            .as_deref()
            .or(code)
            .map(exception_name)
            .filter(|n| !n.is_empty())
    });
    let name = from_header.or(from_body);
    let message = parsed.as_ref().and_then(|b| b.message.clone());
    let message = match (name, message) {
        (None, None) => return (status, Bytes::copy_from_slice(body), None),
        (_, Some(message)) => message,
        (Some(name), None) => name.to_owned(),
    };
    let exception = name.map_or(Exception::Unknown, Exception::parse);
    let n = error_names(exception, status, &message);
    let v = json!({
        "error": { "message": message, "type": n.kind, "code": n.code, "param": null }
    });
    (n.status, Bytes::from(v.to_string()), None)
}

/// A 2xx body that names an exception, as the chat error the engine reads
/// in-band (its status beside OpenAI's fields), or `None`.
fn in_band_answer(body: &[u8]) -> Option<Bytes> {
    let named = serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .is_some_and(|b| b.kind.is_some());
    if !named {
        return None;
    }
    let (status, error, _) = decode_error(500, None, body);
    let mut error: Value = serde_json::from_slice(&error).ok()?;
    error
        .get_mut("error")?
        .as_object_mut()?
        .insert("status".into(), status.into());
    Some(Bytes::from(error.to_string()))
}

// ---------------------------------------------------------------------------
// Streams: ConverseStream events -> OpenAI chunks
// ---------------------------------------------------------------------------

/// An open `toolUse` block of the stream.
#[derive(Debug)]
struct ToolBlock {
    /// Converse's `contentBlockIndex`.
    block: u64,
    /// OpenAI's `tool_calls[].index` (counts tool blocks only).
    index: usize,
    /// Whether any non-empty `arguments` piece was sent.
    sent_arguments: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockStartEvent<'a> {
    content_block_index: Option<u64>,
    #[serde(borrow)]
    start: Option<BlockStart<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockStart<'a> {
    #[serde(borrow)]
    tool_use: Option<ToolUseStart<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ToolUseStart<'a> {
    #[serde(borrow)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockDeltaEvent<'a> {
    content_block_index: Option<u64>,
    #[serde(borrow)]
    delta: Option<BlockDelta<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockDelta<'a> {
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tool_use: Option<ToolUseDelta<'a>>,
    /// A piece of streamed reasoning, shaped as a whole answer's
    /// `reasoningText` (its `signature` and `redactedContent` pieces are not
    /// text, and are dropped).
    #[serde(borrow)]
    reasoning_content: Option<ReasoningText<'a>>,
}

#[derive(Deserialize)]
struct ToolUseDelta<'a> {
    #[serde(borrow)]
    input: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockStopEvent {
    content_block_index: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MessageStopEvent<'a> {
    #[serde(borrow)]
    stop_reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct MetadataEvent {
    #[serde(default)]
    usage: TokenUsage,
}

/// An exception event's payload (`modelStreamErrorException` has the
/// original status and message too).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ExceptionEvent<'a> {
    #[serde(borrow, alias = "Message")]
    message: Option<Cow<'a, str>>,
    original_status_code: Option<u64>,
    #[serde(borrow)]
    original_message: Option<Cow<'a, str>>,
}

/// A content block event's `contentBlockIndex`.
fn block_index(index: Option<u64>) -> Result<u64, TranslateError> {
    index.ok_or_else(|| {
        TranslateError::InvalidResponse("content block event without `contentBlockIndex`".into())
    })
}

/// ConverseStream events -> chat chunk frames.
///
/// The role chunk comes first (at `messageStart`, or before the first other
/// chunk if that never came). `messageStop` gives the finish chunk; the
/// stream ends at `metadata`, which follows it: the usage chunk (when
/// `include_usage` and the counts are there), then `Frame::DONE`. Waiting for
/// `metadata` even without `include_usage` keeps one end for both cases; a
/// stream cut after `messageStop` is the engine's end-of-stream handling's.
/// Reasoning deltas produce nothing ([`chunk::Delta`] has no
/// `reasoning_content`). Exception events become an in-band chat error.
#[derive(Debug)]
pub struct ConverseStream {
    include_usage: bool,
    head: Head,
    /// The role chunk was sent.
    opened: bool,
    tools: Vec<ToolBlock>,
    /// `Frame::DONE` was sent: later events produce nothing.
    finished: bool,
}

impl super::StreamTranslator for ConverseStream {
    fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, Malformed> {
        ConverseStream::on_event(self, data).map_err(|e| Malformed(e.to_string()))
    }
}

impl ConverseStream {
    /// `include_usage`: the client asked `stream_options.include_usage`;
    /// `model`: the target's model id (Converse events do not name it).
    #[must_use]
    pub fn new(include_usage: bool, model: &str) -> Self {
        Self {
            include_usage,
            head: Head {
                id: completion_id(),
                created: now_secs(),
                model: model.to_owned(),
            },
            opened: false,
            tools: Vec::new(),
            finished: false,
        }
    }

    /// One decoded event-stream message, as `{"<event-type>": <payload>}`.
    /// Unknown event types produce nothing; data that is not JSON, not an
    /// object of one member, or a known event without its required fields
    /// is an error.
    pub fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, TranslateError> {
        let event: BTreeMap<Cow<'_, str>, &RawValue> = serde_json::from_str(data)?;
        let mut members = event.into_iter();
        let (Some((kind, payload)), None) = (members.next(), members.next()) else {
            return Err(TranslateError::InvalidResponse(
                "a stream event is an object with one member".into(),
            ));
        };
        if self.finished {
            return Ok(Vec::new());
        }
        let payload = payload.get();
        // serde would read a struct from an array too: a payload that is no
        // object is a broken stream, never an event with nothing in it.
        if !payload.starts_with('{') {
            return Err(TranslateError::InvalidResponse(format!(
                "the payload of `{kind}` is not an object"
            )));
        }
        match kind.as_ref() {
            "messageStart" => Ok(self.open()),
            "contentBlockStart" => self.block_start(serde_json::from_str(payload)?),
            "contentBlockDelta" => self.block_delta(serde_json::from_str(payload)?),
            "contentBlockStop" => self.block_stop(&serde_json::from_str(payload)?),
            "messageStop" => {
                let stop: MessageStopEvent<'_> = serde_json::from_str(payload)?;
                if let Some(error) = botched(stop.stop_reason.as_deref()) {
                    return Ok(vec![Frame::read(&error)]);
                }
                let stop_reason = stop.stop_reason.as_deref().unwrap_or_default();
                let reason = finish_reason(stop_reason, !self.tools.is_empty());
                let frame = self.head.delta(Delta::default(), Some(reason));
                Ok(self.emit(frame))
            }
            "metadata" => {
                let metadata: MetadataEvent = serde_json::from_str(payload)?;
                self.finished = true;
                let mut out = Vec::new();
                if let Some(usage) = metadata.usage.to_openai().filter(|_| self.include_usage) {
                    out.push(self.head.usage(usage));
                }
                out.push(Frame::DONE);
                Ok(out)
            }
            name if name.ends_with("Exception") => {
                let exception: ExceptionEvent<'_> = serde_json::from_str(payload)?;
                Ok(vec![Frame::read(&in_band_error(name, &exception))])
            }
            // Event types added later.
            _ => Ok(Vec::new()),
        }
    }

    /// The role chunk, the first time.
    fn open(&mut self) -> Vec<Frame> {
        if std::mem::replace(&mut self.opened, true) {
            Vec::new()
        } else {
            vec![self.head.role()]
        }
    }

    /// `frame`, after the role chunk if that was not sent yet.
    fn emit(&mut self, frame: Frame) -> Vec<Frame> {
        let mut out = self.open();
        out.push(frame);
        out
    }

    /// `contentBlockStart`: a tool call's opening chunk (other blocks open with their delta).
    fn block_start(&mut self, event: BlockStartEvent<'_>) -> Result<Vec<Frame>, TranslateError> {
        let Some(tool) = event.start.and_then(|s| s.tool_use) else {
            return Ok(Vec::new());
        };
        let block = block_index(event.content_block_index)?;
        let id = tool_use_field(tool.tool_use_id.as_deref(), "toolUseId")?;
        let name = tool_use_field(tool.name.as_deref(), "name")?;
        let index = self.tools.len();
        self.tools.push(ToolBlock {
            block,
            index,
            sent_arguments: false,
        });
        let frame = self.head.call(index, &id, &name);
        Ok(self.emit(frame))
    }

    /// `contentBlockDelta`: text, or a piece of a tool call's input.
    fn block_delta(&mut self, event: BlockDeltaEvent<'_>) -> Result<Vec<Frame>, TranslateError> {
        let Some(delta) = event.delta else {
            return Ok(Vec::new());
        };
        if let Some(text) = delta.text.filter(|t| !t.is_empty()) {
            let frame = self.head.text(&text);
            return Ok(self.emit(frame));
        }
        if let Some(text) = delta
            .reasoning_content
            .and_then(|r| r.text)
            .filter(|t| !t.is_empty())
        {
            let frame = self.head.reasoning(&text);
            return Ok(self.emit(frame));
        }
        let Some(piece) = delta
            .tool_use
            .and_then(|t| t.input)
            .filter(|p| !p.is_empty())
        else {
            return Ok(Vec::new());
        };
        let block = block_index(event.content_block_index)?;
        let Some(tool) = self.tools.iter_mut().find(|t| t.block == block) else {
            return Ok(Vec::new());
        };
        tool.sent_arguments = true;
        let frame = self.head.arguments(tool.index, &piece);
        Ok(self.emit(frame))
    }

    /// `contentBlockStop`: a tool call that streamed no input gets `{}`.
    fn block_stop(&mut self, event: &BlockStopEvent) -> Result<Vec<Frame>, TranslateError> {
        let block = block_index(event.content_block_index)?;
        let Some(tool) = self
            .tools
            .iter_mut()
            .find(|t| t.block == block && !t.sent_arguments)
        else {
            return Ok(Vec::new());
        };
        tool.sent_arguments = true;
        let frame = self.head.arguments(tool.index, "{}");
        Ok(self.emit(frame))
    }
}

/// An exception event as the chat error the engine reads in-band: OpenAI's
/// shape and string code, with the status (which classifies it) beside them.
fn in_band_error(name: &str, exception: &ExceptionEvent<'_>) -> Value {
    let message = exception
        .message
        .as_deref()
        .or(exception.original_message.as_deref())
        .unwrap_or(name);
    let original = exception
        .original_status_code
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (400..=599).contains(s));
    let text = format!(
        "{message} {}",
        exception.original_message.as_deref().unwrap_or_default()
    );
    let n = error_names(Exception::parse(name), original.unwrap_or(500), &text);
    json!({
        "error": {
            "message": message,
            "type": n.kind,
            "code": n.code,
            "param": null,
            "status": n.status,
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_exception_in_a_2xx_body_is_an_in_band_error_and_a_non_object_event_breaks_the_stream() {
        use super::super::Adapter as _;
        let answer = super::Bedrock
            .decode_answer(
                bytes::Bytes::from_static(br#"{"__type":"ThrottlingException","message":"slow"}"#),
                "m",
            )
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(v["error"]["status"], 429);
        assert_eq!(v["error"]["message"], "slow");
        let mut stream = super::ConverseStream::new(false, "m");
        stream
            .on_event(r#"{"messageStart":{"role":"assistant"}}"#)
            .unwrap();
        for payload in ["[1,2]", "\"str\"", "42", "null"] {
            let event = format!(r#"{{"contentBlockDelta":{payload}}}"#);
            assert!(stream.on_event(&event).is_err(), "{payload}");
        }
    }

    use super::*;

    fn request(v: Value) -> Result<Value, TranslateError> {
        let Value::Object(o) = v else {
            panic!("not an object")
        };
        to_converse_request(&o, None)
    }

    fn answer(v: &Value) -> Value {
        let got = from_converse_response(v.to_string().as_bytes(), "anthropic.claude-x").unwrap();
        serde_json::from_slice(&got).unwrap()
    }

    /// A Converse answer with `content` and `stopReason` (botocore's shape).
    fn converse_answer(content: Value, stop: &str) -> Value {
        json!({
            "output": { "message": { "role": "assistant", "content": content } },
            "stopReason": stop,
            "usage": { "inputTokens": 10, "outputTokens": 5, "totalTokens": 15 },
            "metrics": { "latencyMs": 321 }
        })
    }

    fn frame_json(frame: &Frame) -> Value {
        if *frame == Frame::DONE {
            return json!("[DONE]");
        }
        serde_json::from_str(frame.data()).unwrap()
    }

    fn run(t: &mut ConverseStream, events: &[Value]) -> Vec<Value> {
        events
            .iter()
            .flat_map(|e| t.on_event(&e.to_string()).unwrap())
            .map(|f| frame_json(&f))
            .collect()
    }

    fn error_json(bytes: &Bytes) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn system_and_turns_are_merged() {
        let got = request(json!({
            "model": "x",
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "developer", "content": [{ "type": "text", "text": "Use metric." }] },
                { "role": "user", "content": "Hi" },
                { "role": "user", "content": [{ "type": "text", "text": "there" }, { "type": "text", "text": "  " }] },
                { "role": "assistant", "content": "Hello." },
                { "role": "assistant", "content": "" },
                { "role": "assistant", "content": [{ "type": "refusal", "refusal": "No." }] },
                { "role": "user", "content": "Why?" }
            ],
            "stream": true, "user": "u1", "seed": 3, "top_k": 5
        }))
        .unwrap();
        assert_eq!(
            got,
            json!({
                "system": [{ "text": "Be brief." }, { "text": "Use metric." }],
                "messages": [
                    { "role": "user", "content": [{ "text": "Hi" }, { "text": "there" }] },
                    { "role": "assistant", "content": [{ "text": "Hello." }, { "text": "No." }] },
                    { "role": "user", "content": [{ "text": "Why?" }] }
                ]
            })
        );
        // Starting with the assistant is passed through for Bedrock to judge.
        let got = request(json!({ "messages": [
            { "role": "assistant", "content": "I start." },
            { "role": "user", "content": "ok" }
        ]}))
        .unwrap();
        assert_eq!(got["messages"][0]["role"], "assistant");
        assert!(matches!(
            request(json!({ "messages": [{ "role": "system", "content": "s" }] })),
            Err(TranslateError::InvalidRequest(_))
        ));
        assert!(matches!(
            request(json!({ "messages": "hi" })),
            Err(TranslateError::InvalidRequest(_))
        ));
        assert!(matches!(
            request(json!({ "messages": [{ "role": "function", "content": "x" }] })),
            Err(TranslateError::Unsupported(_))
        ));
    }

    #[test]
    fn images_are_bytes_and_urls_are_unsupported() {
        let user = |url: &str| {
            request(json!({ "messages": [{ "role": "user", "content": [
                { "type": "text", "text": "What is this?" },
                { "type": "image_url", "image_url": { "url": url, "detail": "high" } }
            ]}]}))
        };
        let got = user("data:image/png;base64,iVBORw0KGgo=").unwrap();
        assert_eq!(
            got["messages"][0]["content"][1],
            json!({ "image": { "format": "png", "source": { "bytes": "iVBORw0KGgo=" } } })
        );
        let got = user("data:image/jpg;base64,/9j/4AAQ").unwrap();
        assert_eq!(got["messages"][0]["content"][1]["image"]["format"], "jpeg");
        let got = user("data:image/webp;base64,UklGR").unwrap();
        assert_eq!(got["messages"][0]["content"][1]["image"]["format"], "webp");
        for bad in [
            "https://example.com/cat.png",
            "http://example.com/cat.png",
            "data:image/svg+xml;base64,PHN2Zz4=",
            "data:image/png,raw",
            "ftp://example.com/cat.png",
        ] {
            assert!(
                matches!(user(bad), Err(TranslateError::Unsupported(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn pdf_files_are_documents_and_audio_is_unsupported() {
        let file = |file: Value| {
            request(json!({ "messages": [{ "role": "user", "content": [
                { "type": "file", "file": file },
                { "type": "text", "text": "Summarize." }
            ]}]}))
        };
        let got = file(json!({
            "filename": "Q3 report_final  (v2).pdf",
            "file_data": "data:application/pdf;base64,JVBERi0xLjQ="
        }))
        .unwrap();
        assert_eq!(
            got["messages"][0]["content"][0],
            json!({ "document": { "format": "pdf", "name": "Q3 report-final (v2)",
                "source": { "bytes": "JVBERi0xLjQ=" } } })
        );
        let got = file(json!({ "file_data": "data:application/pdf;base64,JVBERi0=" })).unwrap();
        assert_eq!(
            got["messages"][0]["content"][0]["document"]["name"],
            "document"
        );
        assert!(matches!(
            file(json!({ "file_id": "file-abc" })),
            Err(TranslateError::Unsupported(_))
        ));
        assert!(matches!(
            file(json!({ "file_data": "data:application/zip;base64,UEsDBA==" })),
            Err(TranslateError::Unsupported(_))
        ));
        let audio = request(json!({ "messages": [{ "role": "user", "content": [
            { "type": "input_audio", "input_audio": { "data": "UklGR", "format": "wav" } }
        ]}]}));
        assert!(matches!(audio, Err(TranslateError::Unsupported(_))));
        assert_eq!(document_name(Some("a/b\\c.d.pdf")), "a-b-c-d");
        assert_eq!(document_name(Some(&"x".repeat(300))).len(), 200);
    }

    fn tool_history() -> Vec<Value> {
        vec![
            json!({ "role": "user", "content": "Weather in Paris and Rome?" }),
            json!({ "role": "assistant", "content": "Checking.", "tool_calls": [
                { "id": "tooluse_1", "type": "function",
                  "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } },
                { "id": "call_2", "type": "function",
                  "function": { "name": "get_weather", "arguments": "" } }
            ]}),
            json!({ "role": "tool", "tool_call_id": "tooluse_1", "content": "{\"temp\":21}" }),
            json!({ "role": "tool", "tool_call_id": "call_2", "content": [{ "type": "text", "text": "sunny" }] }),
            json!({ "role": "user", "content": "Thanks" }),
        ]
    }

    #[test]
    fn tool_calls_and_results_round_trip() {
        let got = request(json!({ "messages": tool_history() })).unwrap();
        assert_eq!(
            got["messages"][1],
            json!({ "role": "assistant", "content": [
                { "text": "Checking." },
                { "toolUse": { "toolUseId": "tooluse_1", "name": "get_weather", "input": { "city": "Paris" } } },
                { "toolUse": { "toolUseId": "call_2", "name": "get_weather", "input": {} } }
            ]})
        );
        assert_eq!(
            got["messages"][2],
            json!({ "role": "user", "content": [
                { "toolResult": { "toolUseId": "tooluse_1", "content": [{ "json": { "temp": 21 } }] } },
                { "toolResult": { "toolUseId": "call_2", "content": [{ "text": "sunny" }] } },
                { "text": "Thanks" }
            ]})
        );
        assert_eq!(got["messages"].as_array().unwrap().len(), 3);
        let empty = request(json!({ "messages": [
            { "role": "tool", "tool_call_id": "t", "content": "" },
            { "role": "tool", "tool_call_id": "u", "content": "[1,2]" }
        ]}))
        .unwrap();
        assert_eq!(
            empty["messages"][0]["content"],
            json!([
                { "toolResult": { "toolUseId": "t", "content": [{ "json": {} }] } },
                { "toolResult": { "toolUseId": "u", "content": [{ "text": "[1,2]" }] } }
            ])
        );
        for bad in [json!("[1,2]"), json!("{oops"), json!({ "a": 1 })] {
            let got = request(json!({ "messages": [{ "role": "assistant", "tool_calls": [
                { "id": "c1", "type": "function", "function": { "name": "f", "arguments": bad } }
            ]}]}));
            assert!(
                matches!(got, Err(TranslateError::ToolArguments { ref id, .. }) if id == "c1"),
                "{got:?}"
            );
        }
    }

    #[test]
    fn tool_choice_variants() {
        let tools = json!([{ "type": "function", "function": {
            "name": "get_weather", "description": "Weather by city",
            "parameters": { "type": "object", "properties": { "city": { "type": "string" } } }
        }}, { "type": "function", "function": { "name": "ping", "description": "" } }]);
        let with = |choice: Value, messages: Vec<Value>| {
            let mut req = json!({ "messages": messages, "tools": tools });
            if !choice.is_null() {
                req["tool_choice"] = choice;
            }
            request(req).unwrap()
        };
        let hi = || vec![json!({ "role": "user", "content": "hi" })];
        let got = with(Value::Null, hi());
        assert_eq!(
            got["toolConfig"],
            json!({ "tools": [
                { "toolSpec": { "name": "get_weather", "description": "Weather by city",
                    "inputSchema": { "json": { "type": "object", "properties": { "city": { "type": "string" } } } } } },
                { "toolSpec": { "name": "ping",
                    "inputSchema": { "json": { "type": "object", "properties": {} } } } }
            ]})
        );
        let choice = |c: Value| with(c, hi())["toolConfig"]["toolChoice"].clone();
        assert_eq!(choice(json!("auto")), json!({ "auto": {} }));
        assert_eq!(choice(json!("required")), json!({ "any": {} }));
        assert_eq!(
            choice(json!({ "type": "function", "function": { "name": "ping" } })),
            json!({ "tool": { "name": "ping" } })
        );
        assert!(with(json!("none"), hi()).get("toolConfig").is_none());
        // History with tool blocks: Bedrock needs the toolConfig; auto by default.
        let got = with(json!("none"), tool_history());
        assert_eq!(got["toolConfig"]["tools"].as_array().unwrap().len(), 2);
        assert!(got["toolConfig"].get("toolChoice").is_none());
        let bad = request(json!({ "messages": hi(), "tools": [{ "type": "web_search" }] }));
        assert!(matches!(bad, Err(TranslateError::Unsupported(_))));
        let bad = request(json!({ "messages": hi(), "tools": tools, "tool_choice": "sometimes" }));
        assert!(matches!(bad, Err(TranslateError::InvalidRequest(_))));
        // No tools: no toolConfig, whatever the choice.
        let got = request(json!({ "messages": hi(), "tools": [], "tool_choice": "required" }));
        assert!(got.unwrap().get("toolConfig").is_none());
    }

    #[test]
    fn inference_config_maps() {
        let base = || json!({ "messages": [{ "role": "user", "content": "hi" }] });
        let config = |extra: Value, max_output: Option<u64>| {
            let mut req = base();
            for (k, v) in extra.as_object().unwrap() {
                req[k] = v.clone();
            }
            let Value::Object(o) = req else { panic!() };
            to_converse_request(&o, max_output).unwrap()["inferenceConfig"].clone()
        };
        assert_eq!(
            config(
                json!({ "max_completion_tokens": 300, "max_tokens": 100, "temperature": 0.4,
                        "top_p": 0.9, "stop": ["END", "STOP"] }),
                Some(50)
            ),
            json!({ "maxTokens": 300, "temperature": 0.4, "topP": 0.9, "stopSequences": ["END", "STOP"] })
        );
        assert_eq!(
            config(
                json!({ "max_tokens": 100, "temperature": 1.7, "stop": "END" }),
                None
            ),
            json!({ "maxTokens": 100, "temperature": 1.0, "stopSequences": ["END"] })
        );
        assert_eq!(config(json!({}), Some(2048)), json!({ "maxTokens": 2048 }));
        assert_eq!(config(json!({ "stop": [] }), None), Value::Null);
        for bad in [
            json!({ "max_tokens": -1 }),
            json!({ "temperature": "hot" }),
            json!({ "top_p": "x" }),
            json!({ "stop": 5 }),
            json!({ "stop": [1] }),
        ] {
            let mut req = base();
            for (k, v) in bad.as_object().unwrap() {
                req[k] = v.clone();
            }
            assert!(
                matches!(request(req), Err(TranslateError::InvalidRequest(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn asks_the_answer_could_not_carry_are_unsupported() {
        let with = |key: &str, value: Value| {
            let mut req = json!({ "messages": [{ "role": "user", "content": "hi" }] });
            req[key] = value;
            request(req)
        };
        for (key, value) in [
            ("n", json!(2)),
            ("logprobs", json!(true)),
            ("top_logprobs", json!(3)),
            ("modalities", json!(["text", "audio"])),
            ("audio", json!({ "voice": "alloy", "format": "mp3" })),
            ("response_format", json!({ "type": "json_object" })),
            (
                "response_format",
                json!({ "type": "json_schema", "json_schema": { "name": "x" } }),
            ),
        ] {
            assert!(
                matches!(
                    with(key, value.clone()),
                    Err(TranslateError::Unsupported(_))
                ),
                "{key}: {value}"
            );
        }
        assert!(with("n", json!(1)).is_ok());
        assert!(with("logprobs", json!(false)).is_ok());
        assert!(with("response_format", json!({ "type": "text" }))
            .unwrap()
            .get("outputConfig")
            .is_none());
    }

    #[test]
    fn json_schema_becomes_output_config() {
        let schema = json!({ "type": "object", "properties": { "name": { "type": "string" } },
            "required": ["name"], "additionalProperties": false });
        let got = request(json!({
            "messages": [{ "role": "user", "content": "Extract." }],
            "response_format": { "type": "json_schema",
                "json_schema": { "name": "person", "strict": true, "schema": schema } }
        }))
        .unwrap();
        let format = &got["outputConfig"]["textFormat"];
        assert_eq!(format["type"], "json_schema");
        let json_schema = &format["structure"]["jsonSchema"];
        assert_eq!(json_schema["name"], "person");
        // The API takes the schema as JSON text.
        let text = json_schema["schema"].as_str().unwrap();
        assert_eq!(serde_json::from_str::<Value>(text).unwrap(), schema);
    }

    #[test]
    fn reasoning_effort_becomes_claude_thinking() {
        let with = |extra: Value| {
            let mut req = json!({ "messages": [{ "role": "user", "content": "Think." }] });
            for (k, v) in extra.as_object().unwrap() {
                req[k] = v.clone();
            }
            request(req).unwrap()
        };
        for (effort, budget) in [("low", 1024), ("medium", 4096), ("high", 16384)] {
            let got = with(json!({ "reasoning_effort": effort }));
            assert_eq!(
                got["additionalModelRequestFields"],
                json!({ "thinking": { "type": "enabled", "budget_tokens": budget } }),
                "{effort}"
            );
        }
        for extra in [
            json!({ "reasoning_effort": "minimal" }),
            json!({ "reasoning_effort": "high", "max_tokens": 16384 }),
            json!({ "reasoning_effort": "low", "temperature": 0.2 }),
            json!({ "reasoning_effort": "low", "top_p": 0.5 }),
            json!({ "reasoning_effort": "low", "tool_choice": "required",
                    "tools": [{ "type": "function", "function": { "name": "f" } }] }),
        ] {
            assert!(
                with(extra.clone())
                    .get("additionalModelRequestFields")
                    .is_none(),
                "{extra}"
            );
        }
        assert!(
            with(json!({ "reasoning_effort": "low", "max_tokens": 2000, "temperature": 1 }))
                .get("additionalModelRequestFields")
                .is_some()
        );
    }

    #[test]
    fn answer_with_text_tool_use_and_reasoning() {
        let got = answer(&converse_answer(
            json!([
                { "reasoningContent": { "reasoningText": { "text": "The user wants", "signature": "sig" } } },
                { "reasoningContent": { "redactedContent": "AAEC" } },
                { "text": "Let me check " },
                { "text": "the weather." },
                { "toolUse": { "toolUseId": "tooluse_abc", "name": "get_weather", "input": { "city": "Paris" } } },
                { "toolUse": { "toolUseId": "tooluse_def", "name": "ping", "input": {} } }
            ]),
            "tool_use",
        ));
        assert!(got["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert!(got["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(got["object"], "chat.completion");
        assert_eq!(got["model"], "anthropic.claude-x");
        let message = &got["choices"][0]["message"];
        assert_eq!(message["content"], "Let me check the weather.");
        assert_eq!(message["reasoning_content"], "The user wants");
        assert_eq!(message["tool_calls"][0]["id"], "tooluse_abc");
        assert_eq!(message["tool_calls"][0]["type"], "function");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
        let args = message["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(args).unwrap(),
            json!({ "city": "Paris" })
        );
        assert_eq!(message["tool_calls"][1]["function"]["arguments"], "{}");
        assert_eq!(got["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            got["usage"],
            json!({ "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15 })
        );

        let tool_only = answer(&converse_answer(
            json!([{ "toolUse": { "toolUseId": "t", "name": "f", "input": {} } }]),
            "tool_use",
        ));
        assert_eq!(tool_only["choices"][0]["message"]["content"], Value::Null);
        assert!(tool_only["choices"][0]["message"]
            .get("reasoning_content")
            .is_none());
        let empty = answer(&converse_answer(json!([]), "end_turn"));
        assert_eq!(empty["choices"][0]["message"]["content"], "");
    }

    #[test]
    fn every_stop_reason_maps() {
        for (stop, finish) in [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("tool_use", "tool_calls"),
            ("max_tokens", "length"),
            ("model_context_window_exceeded", "length"),
            ("guardrail_intervened", "content_filter"),
            ("content_filtered", "content_filter"),
            ("a_future_reason", "stop"),
        ] {
            let got = answer(&converse_answer(json!([{ "text": "x" }]), stop));
            assert_eq!(got["choices"][0]["finish_reason"], finish, "{stop}");
            let call = json!([{ "toolUse": { "toolUseId": "t1", "name": "f", "input": {} } }]);
            let got = answer(&converse_answer(call, stop));
            let with_call = if finish == "stop" {
                "tool_calls"
            } else {
                finish
            };
            assert_eq!(
                got["choices"][0]["finish_reason"], with_call,
                "{stop} with a call"
            );
        }
    }

    /// Output or a call the model botched is no answer (an in-band 502,
    /// failed over), whatever came before it, plain and streamed.
    #[test]
    fn malformed_stop_reasons_are_no_answer() {
        for stop in ["malformed_model_output", "malformed_tool_use"] {
            let call = json!([{ "text": "x" }, { "toolUse": { "toolUseId": "t1", "name": "f", "input": {} } }]);
            let got = answer(&converse_answer(call, stop));
            assert_eq!(got["error"]["code"], stop, "{got}");
            assert_eq!(got["error"]["status"], 502, "{got}");
            let mut t = ConverseStream::new(false, "m");
            let frames = run(
                &mut t,
                &[
                    json!({ "messageStart": { "role": "assistant" } }),
                    json!({ "contentBlockDelta": { "contentBlockIndex": 0, "delta": { "text": "x" } } }),
                    json!({ "messageStop": { "stopReason": stop } }),
                ],
            );
            let last = frames.last().unwrap();
            assert_eq!(last["error"]["code"], stop, "{frames:?}");
        }
    }

    #[test]
    fn usage_counts_cache_reads_and_writes_in_the_prompt() {
        let mut body = converse_answer(json!([{ "text": "x" }]), "end_turn");
        body["usage"] = json!({ "inputTokens": 12, "outputTokens": 40, "totalTokens": 1552,
            "cacheReadInputTokens": 1000, "cacheWriteInputTokens": 500 });
        assert_eq!(
            answer(&body)["usage"],
            json!({ "prompt_tokens": 1512, "completion_tokens": 40, "total_tokens": 1552,
                "prompt_tokens_details": { "cached_tokens": 1000 } })
        );
        body.as_object_mut().unwrap().remove("usage");
        assert!(answer(&body).get("usage").is_none(), "no counts, no usage");
        let absurd = TokenUsage {
            input_tokens: Some(u64::MAX),
            output_tokens: Some(1),
            cache_read_input_tokens: Some(u64::MAX),
            cache_write_input_tokens: None,
        };
        assert_eq!(
            absurd.to_openai(),
            Some(chunk::Usage::new(u64::MAX, 1, u64::MAX, 0))
        );
    }

    #[test]
    fn bad_answers_are_errors() {
        let got = from_converse_response(br#"{"message":"The security token is invalid."}"#, "m");
        assert!(
            matches!(got, Err(TranslateError::InvalidResponse(ref m)) if m.contains("security token")),
            "{got:?}"
        );
        assert!(matches!(
            from_converse_response(b"{nope", "m"),
            Err(TranslateError::Json(_))
        ));
        assert!(matches!(
            from_converse_response(br#"{"stopReason":"end_turn"}"#, "m"),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(matches!(
            from_converse_response(br#"{"output":[]}"#, "m"),
            Err(TranslateError::InvalidResponse(_))
        ));
        for bad in [
            json!({ "toolUse": { "name": "f", "input": {} } }),
            json!({ "toolUse": { "toolUseId": "", "name": "f", "input": {} } }),
            json!({ "toolUse": { "toolUseId": "t", "input": {} } }),
            json!({ "toolUse": { "toolUseId": "t", "name": "f", "input": [1] } }),
        ] {
            let body = converse_answer(json!([bad]), "tool_use");
            assert!(
                matches!(
                    from_converse_response(body.to_string().as_bytes(), "m"),
                    Err(TranslateError::InvalidResponse(_))
                ),
                "{bad}"
            );
        }
    }

    /// A ConverseStream as the adapter hands it over: text, reasoning, one tool use.
    fn stream_events() -> Vec<Value> {
        vec![
            json!({ "messageStart": { "role": "assistant" } }),
            json!({ "contentBlockDelta": { "contentBlockIndex": 0,
                "delta": { "reasoningContent": { "text": "hmm" } } } }),
            json!({ "contentBlockStop": { "contentBlockIndex": 0 } }),
            json!({ "contentBlockDelta": { "contentBlockIndex": 1, "delta": { "text": "Let me " } } }),
            json!({ "contentBlockDelta": { "contentBlockIndex": 1, "delta": { "text": "check." } } }),
            json!({ "contentBlockStop": { "contentBlockIndex": 1 } }),
            json!({ "contentBlockStart": { "contentBlockIndex": 2,
                "start": { "toolUse": { "toolUseId": "tooluse_x", "name": "get_weather" } } } }),
            json!({ "contentBlockDelta": { "contentBlockIndex": 2,
                "delta": { "toolUse": { "input": "{\"city\":" } } } }),
            json!({ "contentBlockDelta": { "contentBlockIndex": 2,
                "delta": { "toolUse": { "input": "\"Paris\"}" } } } }),
            json!({ "contentBlockStop": { "contentBlockIndex": 2 } }),
            json!({ "contentBlockStart": { "contentBlockIndex": 3,
                "start": { "toolUse": { "toolUseId": "tooluse_y", "name": "ping" } } } }),
            json!({ "contentBlockStop": { "contentBlockIndex": 3 } }),
            json!({ "messageStop": { "stopReason": "tool_use" } }),
            json!({ "metadata": { "usage": { "inputTokens": 30, "outputTokens": 12, "totalTokens": 62,
                "cacheReadInputTokens": 20 }, "metrics": { "latencyMs": 812 } } }),
        ]
    }

    #[test]
    fn a_full_stream_translates() {
        let mut t = ConverseStream::new(true, "anthropic.claude-x");
        let out = run(&mut t, &stream_events());
        let deltas: Vec<Value> = out
            .iter()
            .filter(|c| c.get("choices").is_some_and(|c| c[0].is_object()))
            .map(|c| c["choices"][0]["delta"].clone())
            .collect();
        assert_eq!(
            deltas,
            vec![
                json!({ "role": "assistant", "content": "" }),
                json!({ "reasoning_content": "hmm" }),
                json!({ "content": "Let me " }),
                json!({ "content": "check." }),
                json!({ "tool_calls": [{ "index": 0, "id": "tooluse_x", "type": "function",
                    "function": { "name": "get_weather", "arguments": "" } }] }),
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "{\"city\":" } }] }),
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "\"Paris\"}" } }] }),
                json!({ "tool_calls": [{ "index": 1, "id": "tooluse_y", "type": "function",
                    "function": { "name": "ping", "arguments": "" } }] }),
                json!({ "tool_calls": [{ "index": 1, "function": { "arguments": "{}" } }] }),
                json!({}),
            ]
        );
        assert_eq!(out.len(), deltas.len() + 2);
        let finish = &out[deltas.len() - 1];
        assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
        let usage = &out[out.len() - 2];
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({ "prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62,
                "prompt_tokens_details": { "cached_tokens": 20 } })
        );
        assert_eq!(out[out.len() - 1], json!("[DONE]"));
        let ids: Vec<&Value> = out[..out.len() - 1].iter().map(|c| &c["id"]).collect();
        assert!(ids.iter().all(|id| *id == ids[0]), "one id per stream");
        assert_eq!(out[0]["model"], "anthropic.claude-x");
        assert_eq!(out[0]["object"], "chat.completion.chunk");
        // After [DONE], nothing.
        assert!(t
            .on_event(r#"{"contentBlockDelta":{"contentBlockIndex":0,"delta":{"text":"late"}}}"#)
            .unwrap()
            .is_empty());

        let mut t = ConverseStream::new(false, "m");
        let out = run(&mut t, &stream_events());
        assert!(out.iter().all(|c| c.get("usage").is_none()), "{out:?}");
        assert_eq!(out.last(), Some(&json!("[DONE]")));
        assert_eq!(
            out[out.len() - 2]["choices"][0]["finish_reason"],
            "tool_calls"
        );
    }

    #[test]
    fn stream_edges() {
        let mut t = ConverseStream::new(true, "m");
        // Content before any messageStart still opens with the role.
        let out = run(
            &mut t,
            &[
                json!({ "contentBlockDelta": { "contentBlockIndex": 0, "delta": { "text": "Hi" } } }),
            ],
        );
        assert_eq!(out[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(out[1]["choices"][0]["delta"]["content"], "Hi");
        assert!(t
            .on_event(r#"{"messageStart":{"role":"assistant"}}"#)
            .unwrap()
            .is_empty());
        assert!(t
            .on_event(r#"{"someFutureEvent":{"x":1}}"#)
            .unwrap()
            .is_empty());
        assert!(matches!(t.on_event("{oops"), Err(TranslateError::Json(_))));
        assert!(matches!(
            t.on_event(r#"{"a":{},"b":{}}"#),
            Err(TranslateError::InvalidResponse(_))
        ));
        assert!(t.on_event("{}").is_err());
        assert!(t.on_event(r#"["messageStart"]"#).is_err());
        let no_id =
            r#"{"contentBlockStart":{"contentBlockIndex":1,"start":{"toolUse":{"name":"f"}}}}"#;
        assert!(t.on_event(no_id).is_err());
        assert!(t
            .on_event(r#"{"contentBlockStop":{}}"#)
            .is_err_and(|e| matches!(e, TranslateError::InvalidResponse(_))));
        // A metadata without counts: no usage chunk, even when asked.
        let out = run(
            &mut t,
            &[json!({ "metadata": { "metrics": { "latencyMs": 1 } } })],
        );
        assert_eq!(out, vec![json!("[DONE]")]);
        // Through the trait, errors are Malformed.
        let mut boxed: Box<dyn super::super::StreamTranslator> =
            Box::new(ConverseStream::new(false, "m"));
        assert!(boxed.on_event("not json").is_err());
        assert_eq!(boxed.on_event(r#"{"newThing":{}}"#), Ok(Vec::new()));
    }

    #[test]
    fn stream_exceptions_are_in_band_errors() {
        let error = |data: Value| {
            let mut t = ConverseStream::new(true, "m");
            let out = t.on_event(&data.to_string()).unwrap();
            assert_eq!(out.len(), 1);
            assert_eq!(
                out[0].reading,
                crate::sse::classify_data(out[0].data()),
                "read as the engine reads it"
            );
            frame_json(&out[0])["error"].clone()
        };
        let e = error(
            json!({ "throttlingException": { "message": "Too many requests, please wait before trying again." } }),
        );
        assert_eq!(
            e,
            json!({ "message": "Too many requests, please wait before trying again.",
                "type": "rate_limit_error", "code": "rate_limit_exceeded", "param": null, "status": 429 })
        );
        assert_eq!(crate::sse::error_code(&e.to_string()), Some(429));
        let e =
            error(json!({ "serviceUnavailableException": { "message": "Service unavailable" } }));
        assert_eq!(e["status"], 503);
        let e = error(json!({ "internalServerException": { "message": "boom" } }));
        assert_eq!(
            (e["status"].clone(), e["type"].clone()),
            (json!(500), json!("server_error"))
        );
        let e = error(
            json!({ "modelStreamErrorException": { "message": "Model failed",
            "originalStatusCode": 529, "originalMessage": "Overloaded" } }),
        );
        assert_eq!(e["status"], 529);
        assert_eq!(e["message"], "Model failed");
        let e = error(json!({ "modelStreamErrorException": { "message": "Model failed" } }));
        assert_eq!(e["status"], 500);
        let e = error(
            json!({ "validationException": { "message": "Input is too long for requested model." } }),
        );
        assert_eq!(e["status"], 400);
        assert_eq!(e["code"], "context_length_exceeded");
        let e = error(json!({ "validationException": { "message": "Malformed input request" } }));
        assert_eq!(e["code"], "invalid_request");
        let e = error(
            json!({ "modelStreamErrorException": { "message": "Model error",
            "originalStatusCode": 400, "originalMessage": "prompt is too long: 210000 tokens > 200000 maximum" } }),
        );
        assert_eq!(
            (e["status"].clone(), e["code"].clone()),
            (json!(400), json!("context_length_exceeded"))
        );
        let e = error(json!({ "brandNewException": {} }));
        assert_eq!(
            (e["status"].clone(), e["message"].clone()),
            (json!(500), json!("brandNewException"))
        );
    }

    fn decoded(status: u16, header: Option<&str>, body: &Value) -> (u16, Value) {
        let (status, bytes, wait) = decode_error(status, header, body.to_string().as_bytes());
        assert_eq!(wait, None);
        (status, error_json(&bytes)["error"].clone())
    }

    #[test]
    fn error_families_from_the_header() {
        // Sent status, exception, status, OpenAI type, OpenAI code.
        let table = "
            429 ThrottlingException 429 rate_limit_error rate_limit_exceeded
            400 ServiceQuotaExceededException 429 rate_limit_error rate_limit_exceeded
            503 ServiceUnavailableException 503 server_error service_unavailable
            429 ModelNotReadyException 503 server_error model_not_ready
            408 ModelTimeoutException 504 server_error timeout
            500 InternalServerException 500 server_error server_error
            403 AccessDeniedException 403 permission_error permission_denied
            403 UnrecognizedClientException 401 authentication_error invalid_api_key
            403 InvalidSignatureException 401 authentication_error invalid_api_key
            403 ExpiredTokenException 401 authentication_error invalid_api_key
            404 ResourceNotFoundException 404 not_found_error not_found
            400 ValidationException 400 invalid_request_error invalid_request
            424 ModelErrorException 502 server_error model_error
            418 TeapotException 418 invalid_request_error invalid_request";
        let body = json!({ "message": "m" });
        let mut rows = 0;
        for row in table.lines().filter(|l| !l.trim().is_empty()) {
            let [sent, name, status, kind, code] = row.split_whitespace().collect::<Vec<_>>()[..]
            else {
                panic!("{row}")
            };
            let header = format!("{name}:http://internal.amazon.com/coral/com.amazon.bedrock/");
            let (got, e) = decoded(sent.parse().unwrap(), Some(&header), &body);
            assert_eq!(got, status.parse::<u16>().unwrap(), "{name}");
            assert_eq!(
                (e["type"].as_str(), e["code"].as_str()),
                (Some(kind), Some(code)),
                "{name}"
            );
            assert_eq!(e["message"], "m");
            assert_eq!(e["param"], Value::Null);
            rows += 1;
        }
        assert_eq!(rows, 14);
    }

    #[test]
    fn error_families_from_the_body() {
        for (sent, body, status, code) in [
            (
                429,
                json!({ "__type": "com.amazon.bedrock#ThrottlingException", "message": "Too many tokens per day." }),
                429,
                "rate_limit_exceeded",
            ),
            (
                403,
                json!({ "__type": "com.amazon.coral.service#UnrecognizedClientException",
                        "Message": "The security token included in the request is invalid." }),
                401,
                "invalid_api_key",
            ),
            (
                400,
                json!({ "__type": "ValidationException", "message": "The model returned the following errors: Input is too long for requested model." }),
                400,
                "context_length_exceeded",
            ),
            (
                400,
                json!({ "code": "ValidationException", "message": "Too many input tokens. Max input tokens: 8192, request input token count: 9000" }),
                400,
                "context_length_exceeded",
            ),
            (
                503,
                json!({ "__type": "ServiceUnavailableException" }),
                503,
                "service_unavailable",
            ),
            // No name: judged by status and message.
            (
                403,
                json!({ "message": "Missing Authentication Token" }),
                403,
                "permission_denied",
            ),
            (
                400,
                json!({ "message": "prompt is too long: 210000 tokens > 200000 maximum" }),
                400,
                "context_length_exceeded",
            ),
        ] {
            let (got, e) = decoded(sent, None, &body);
            assert_eq!((got, e["code"].as_str().unwrap()), (status, code), "{body}");
        }
        let (_, e) = decoded(
            503,
            None,
            &json!({ "__type": "ServiceUnavailableException" }),
        );
        assert_eq!(e["message"], "ServiceUnavailableException");
        // The header wins over the body.
        let (status, _) = decoded(
            400,
            Some("ThrottlingException"),
            &json!({ "__type": "ValidationException", "message": "x" }),
        );
        assert_eq!(status, 429);
    }

    #[test]
    fn bedrock_context_length_phrasings_are_detected() {
        for text in [
            "Input is too long for requested model.",
            "prompt is too long: 210000 tokens > 200000 maximum",
            "Too many input tokens. Max input tokens: 8192",
            "Input Tokens Exceeded: Number of input tokens exceeds maximum length",
            "This model's maximum context length is 8192 tokens.",
        ] {
            assert!(is_context_length(text), "{text}");
        }
        assert!(!is_context_length(
            "Malformed input request: #: extraneous key [top_k]"
        ));
        assert!(!is_context_length("Too many requests, please wait."));
        // A context-length ModelErrorException is the request's, not the model's.
        let (status, e) = decoded(
            424,
            Some("ModelErrorException"),
            &json!({ "message": "prompt is too long", "originalStatusCode": 400 }),
        );
        assert_eq!(
            (status, e["code"].clone()),
            (400, json!("context_length_exceeded"))
        );
    }

    #[test]
    fn junk_error_bodies_pass_through() {
        for body in [&b"<html>502 Bad Gateway</html>"[..], b"", b"{}", b"[1]"] {
            let (status, bytes, wait) = decode_error(502, None, body);
            assert_eq!((status, &bytes[..], wait), (502, body, None));
        }
        // A named exception with an unreadable body still maps.
        let (status, bytes, _) =
            decode_error(429, Some("ThrottlingException:http://x/"), b"<html>");
        assert_eq!(status, 429);
        assert_eq!(
            error_json(&bytes)["error"]["message"],
            "ThrottlingException"
        );
        assert_eq!(
            exception_name("com.amazon.coral.validate#ValidationException"),
            "ValidationException"
        );
        assert_eq!(
            exception_name("ThrottlingException:http://internal.amazon.com/coral/"),
            "ThrottlingException"
        );
    }
}
