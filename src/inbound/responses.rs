//! OpenAI Responses at the front door (`POST /v1/responses`, and `GET` /
//! `DELETE /v1/responses/{id}`): the request read into typed wire structs and
//! translated into a chat request (with the stored conversation of
//! `previous_response_id` before its input); the answer as a `response`
//! object and the stream as the typed event sequence, each event with its
//! `sequence_number`; what was produced kept in the [`ResponseStore`] unless
//! `store: false`.
//!
//! Built-in tools (`web_search`, `file_search`, ...) and input items chat
//! cannot carry leave the request to targets that speak Responses (the
//! others are skipped, reason `protocol`). `reasoning` input items are
//! dropped from the chat translation (a chat target cannot take them back).
//! A Responses target gets the client's body ([`Translated::native`]: with
//! a stored conversation as items instead of `previous_response_id`), and its
//! own answer and events go back as sent and are kept under its ids.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::native::Untranslatable;
use crate::sse::scan;

use super::store::Stored;
use super::{
    fresh_id, model_text, write_event, ChatBody, Chunk, Completion, Finish, Invalid, Render,
    ResponseStore, StreamOptions, Translated, Usage, WireError,
};

#[derive(Deserialize)]
struct Request<'a> {
    /// Read raw, so its place in the body is known ([`crate::native::ModelAt`]).
    #[serde(borrow, default, deserialize_with = "crate::request::raw_even_null")]
    model: Option<&'a RawValue>,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    text: Option<TextConfig>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    reasoning: Option<Reasoning>,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    user: Option<String>,
    /// State only the provider's own Responses API keeps ([`provider_state`]).
    #[serde(borrow, default)]
    conversation: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    background: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of input items")]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// One input item; which fields it needs depends on its `type`.
#[derive(Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<ItemContent>,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    output: Option<ItemContent>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    image_url: Option<String>,
    #[serde(default)]
    detail: Option<String>,
    #[serde(default)]
    file_data: Option<String>,
    #[serde(default)]
    filename: Option<String>,
}

#[derive(Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
    #[serde(default)]
    strict: Option<bool>,
}

#[derive(Deserialize, Clone)]
#[serde(
    untagged,
    expecting = "`auto`, `none`, `required` or a function to call"
)]
enum ToolChoice {
    Mode(String),
    Function {
        #[serde(rename = "type")]
        kind: String,
        name: String,
    },
    /// A built-in tool's, `allowed_tools`, `mcp`: only a Responses target
    /// honours it ([`hosted_choice`]).
    Other(Map<String, Value>),
}

#[derive(Deserialize)]
struct TextConfig {
    #[serde(default)]
    format: Option<Format>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Format {
    Text {},
    JsonObject {},
    JsonSchema {
        name: String,
        schema: Value,
        #[serde(default)]
        strict: Option<bool>,
        #[serde(default)]
        description: Option<String>,
    },
}

#[derive(Deserialize)]
struct Reasoning {
    #[serde(default)]
    effort: Option<String>,
}

/// Translates a Responses request into the chat request the engine runs;
/// the conversation of `previous_response_id` comes from `store`.
///
/// # Errors
/// The first field that is missing, of the wrong type, or that no chat
/// request can carry; an unknown or expired `previous_response_id`.
pub fn translate(body: &[u8], store: &ResponseStore) -> Result<Translated, Invalid> {
    let request: Request<'_> = Invalid::parse(body)?;
    let model = model_text(request.model)?;
    let mut conversation = match &request.previous_response_id {
        Some(id) => store
            .get(id)
            .map(|stored| conversation_of(&stored))
            .ok_or_else(|| Invalid {
                param: "previous_response_id".into(),
                message: format!("Previous response with id '{id}' not found (switchyard keeps responses for {} s).", super::store::TTL.as_secs()),
                code: Some("previous_response_not_found"),
            })?,
        None => Vec::new(),
    };
    let earlier = conversation.len();
    let mut untranslated = None;
    match &request.input {
        Some(Input::Text(text)) => conversation.push(json!({"role": "user", "content": text})),
        Some(Input::Items(items)) => untranslated = input_items(items, &mut conversation)?,
        None => {}
    }
    if conversation.is_empty() && untranslated.is_none() {
        return Err(Invalid::field("input", "an input is required"));
    }
    let conversation = std::sync::Arc::new(conversation);
    let turns = if conversation.is_empty() {
        // All it says is a Responses target's alone: no chat target gets
        // this body, but the engine may read it (a chat request has a message).
        std::sync::Arc::new(vec![json!({"role": "user", "content": ""})])
    } else {
        std::sync::Arc::clone(&conversation)
    };
    let messages = super::ChatMessages {
        head: (request.instructions.as_ref())
            .map(|instructions| json!({"role": "system", "content": instructions})),
        turns,
    };
    let chat = chat_request(&request, model.clone(), messages)?;
    choice_has_tools(&request)?;
    not_in_background(&request)?;
    let untranslatable = built_in_tool(request.tools.as_deref())
        .or(hosted_choice(request.tool_choice.as_ref())?)
        .or(provider_state(&request))
        .or(untranslated);
    let echo = Echo::of(&request);
    // A target of the client's own protocol gets the conversation whole: a
    // response switchyard keeps is no id that target knows.
    // Reasoning items switchyard made from a chat target's reasoning, sent
    // back, are no items it knows either: they are left out for it.
    let native = match &request.previous_response_id {
        Some(_) => native_body(body, &conversation[..earlier]),
        None if memchr::memmem::find(body, MINTED_REASONING.as_bytes()).is_some() => {
            native_body(body, &[])
        }
        None => None,
    };
    let model_at = match native {
        Some(_) => crate::native::ModelAt::Unread,
        None => crate::request::model_at(body, request.model),
    };
    let (facts, chat) = chat.deferred();
    Ok(Translated {
        chat,
        facts,
        native,
        model_at,
        stream: request.stream.unwrap_or(false),
        render: Render::Responses(Reply {
            id: fresh_id("resp_"),
            created_at: now_secs(),
            model: model.unwrap_or_default(),
            store: request.store.unwrap_or(true).then(|| store.clone()),
            conversation,
            echo,
        }),
        untranslatable,
    })
}

/// The client's body for a Responses target when it continues a stored
/// conversation: `previous_response_id` replaced by the conversation's items
/// before the input, the rest as sent.
fn native_body(body: &[u8], earlier: &[Value]) -> Option<Bytes> {
    let mut object: Map<String, Value> = serde_json::from_slice(body).ok()?;
    object.remove("previous_response_id");
    let mut input = input_items_of(earlier);
    match object.remove("input") {
        Some(Value::String(text)) => {
            input.push(json!({"type": "message", "role": "user", "content": text}));
        }
        Some(Value::Array(items)) => input.extend(items),
        Some(_) | None => {}
    }
    input.retain(|item| !minted_reasoning(item));
    object.insert("input".into(), Value::Array(input));
    Some(Bytes::from(Value::Object(object).to_string()))
}

/// The id prefix of the reasoning items switchyard makes from a chat
/// target's reasoning (OpenAI's own ids are `rs_` and hex digits).
const MINTED_REASONING: &str = "rs_sy_";

/// A reasoning item switchyard made: no Responses target knows its id, and
/// it carries no `encrypted_content` to stand for itself.
fn minted_reasoning(item: &Value) -> bool {
    item["type"] == "reasoning"
        && item["id"]
            .as_str()
            .is_some_and(|id| id.starts_with(MINTED_REASONING))
        && item["encrypted_content"].is_null()
}

/// Chat messages (a stored conversation) as Responses input items.
fn input_items_of(messages: &[Value]) -> Vec<Value> {
    let mut items = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m["role"].as_str().unwrap_or("user");
        if role == "tool" {
            items.push(json!({"type": "function_call_output",
                "call_id": m["tool_call_id"], "output": m["content"]}));
            continue;
        }
        match &m["content"] {
            Value::String(text) => {
                items.push(json!({"type": "message", "role": role, "content": text}));
            }
            Value::Array(parts) => {
                let parts: Vec<Value> = parts.iter().filter_map(input_part_of).collect();
                items.push(json!({"type": "message", "role": role, "content": parts}));
            }
            // An assistant turn of calls only has no text.
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => {}
        }
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            items.push(json!({"type": "function_call", "call_id": call["id"],
                "name": f["name"], "arguments": f["arguments"]}));
        }
    }
    items
}

/// A chat content part as a Responses input part.
fn input_part_of(part: &Value) -> Option<Value> {
    match part["type"].as_str()? {
        "text" => Some(json!({"type": "input_text", "text": part["text"]})),
        "image_url" => {
            let mut image = json!({"type": "input_image", "image_url": part["image_url"]["url"]});
            if let Some(detail) = part["image_url"]["detail"].as_str() {
                image["detail"] = json!(detail);
            }
            Some(image)
        }
        "file" => Some(json!({"type": "input_file",
            "file_data": part["file"]["file_data"], "filename": part["file"]["filename"]})),
        _ => None,
    }
}

/// A built-in tool (`web_search`, `file_search`, ...): only a target that
/// speaks Responses runs one, so every other is skipped for the request.
fn built_in_tool(tools: Option<&[Tool]>) -> Option<Untranslatable> {
    let (i, tool) = tools?
        .iter()
        .enumerate()
        .find(|(_, t)| t.kind != "function")?;
    Some(only_responses(
        format!("tools[{i}].type"),
        &format!("built-in tool `{}`", tool.kind),
    ))
}

/// A `tool_choice` naming what is not a function (a built-in tool,
/// `allowed_tools`, an MCP server's tool): only a Responses target honours it.
///
/// # Errors
/// A function's choice without a `name`, or a choice without a `type`.
fn hosted_choice(choice: Option<&ToolChoice>) -> Result<Option<Untranslatable>, Invalid> {
    let kind = match choice {
        None => return Ok(None),
        Some(ToolChoice::Mode(mode)) if matches!(mode.as_str(), "auto" | "none" | "required") => {
            return Ok(None)
        }
        Some(ToolChoice::Mode(mode)) => {
            return Err(Invalid::field(
                "tool_choice",
                format!(
                    "unknown `tool_choice` `{mode}`: `auto`, `none`, `required` or a tool to call"
                ),
            ))
        }
        Some(ToolChoice::Function { kind, .. }) if kind == "function" => return Ok(None),
        Some(ToolChoice::Function { kind, .. }) => kind.as_str(),
        Some(ToolChoice::Other(choice)) => match choice.get("type").and_then(Value::as_str) {
            Some("function") => {
                return Err(Invalid::field("tool_choice.name", "missing field `name`"))
            }
            Some(kind) => kind,
            None => return Err(Invalid::field("tool_choice.type", "missing field `type`")),
        },
    };
    Ok(Some(only_responses(
        "tool_choice.type".into(),
        &format!("a `tool_choice` of type `{kind}`"),
    )))
}

/// A `tool_choice` that demands a function call needs tools to call.
///
/// # Errors
/// `required` or a named function without `tools`.
fn choice_has_tools(request: &Request<'_>) -> Result<(), Invalid> {
    let demands_a_call = match &request.tool_choice {
        Some(ToolChoice::Mode(mode)) => mode == "required",
        Some(ToolChoice::Function { kind, .. }) => kind == "function",
        Some(ToolChoice::Other(_)) | None => false,
    };
    if demands_a_call && request.tools.as_ref().is_none_or(Vec::is_empty) {
        return Err(Invalid::field(
            "tool_choice",
            "`tool_choice` asks for a function call but the request has no `tools`",
        ));
    }
    Ok(())
}

/// What the provider's own Responses API keeps and chat has no words for:
/// a conversation object, a stored prompt. A chat target would answer as if
/// it were not there (a fresh start).
fn provider_state(request: &Request<'_>) -> Option<Untranslatable> {
    let field = if request.conversation.is_some() {
        "conversation"
    } else if request.prompt.is_some() {
        "prompt"
    } else {
        return None;
    };
    Some(only_responses(field.into(), &format!("`{field}`")))
}

/// A run in the background is answered `queued` and then polled, fetched
/// and cancelled at the provider; switchyard answers `GET` from its own
/// store and fails over, so it cannot keep that promise.
///
/// # Errors
/// `background: true`.
fn not_in_background(request: &Request<'_>) -> Result<(), Invalid> {
    if request.background == Some(true) {
        return Err(Invalid::field(
            "background",
            "switchyard does not run responses in the background: send the request without `background` (or `stream: true`)",
        ));
    }
    Ok(())
}

/// What chat cannot carry, at `param`: only a Responses target can serve it.
fn only_responses(param: String, what: &str) -> Untranslatable {
    let why = format!("{what} ({param}) runs only on a target that speaks OpenAI Responses");
    Untranslatable { param, why }
}

fn chat_request(
    request: &Request<'_>,
    model: Option<String>,
    messages: super::ChatMessages,
) -> Result<ChatBody, Invalid> {
    let stream = request.stream == Some(true);
    let tools = request
        .tools
        .as_deref()
        .map(chat_tools)
        .transpose()?
        .filter(|functions| !functions.is_empty());
    // A choice among built-in tools alone is for a Responses target to make.
    let tool_choice = match request.tool_choice.as_ref().filter(|_| tools.is_some()) {
        Some(choice) => Some(chat_tool_choice(choice)?),
        None => None,
    };
    Ok(ChatBody {
        model,
        messages,
        max_tokens: request.max_output_tokens,
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        temperature: request.temperature,
        top_p: request.top_p,
        parallel_tool_calls: request.parallel_tool_calls.filter(|_| tools.is_some()),
        tools,
        tool_choice,
        response_format: request
            .text
            .as_ref()
            .and_then(|t| t.format.as_ref())
            .and_then(response_format),
        reasoning_effort: request.reasoning.as_ref().and_then(|r| r.effort.clone()),
        user: request.user.clone(),
        ..ChatBody::default()
    })
}

/// Input items as chat messages, appended to `out`: consecutive
/// `function_call` items become one assistant turn's calls.
/// The items as chat messages, and why the first item chat cannot carry (a
/// built-in tool's call, an item reference) leaves the request to a target
/// of the client's protocol, if one is there.
fn input_items(items: &[Item], out: &mut Vec<Value>) -> Result<Option<Untranslatable>, Invalid> {
    let mut untranslated = None;
    // The images (and files) of a run of call outputs: chat's tool messages
    // carry text, so they follow the run as one user message.
    let mut media = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if item.kind.as_deref() != Some("function_call_output") && !media.is_empty() {
            out.push(json!({"role": "user", "content": std::mem::take(&mut media)}));
        }
        match item.kind.as_deref() {
            None | Some("message") => out.push(message_item(item, &at, &mut untranslated)?),
            Some("function_call") => {
                let call = json!({
                    "id": required(item.call_id.as_ref(), &at, "call_id")?,
                    "type": "function",
                    "function": {
                        "name": required(item.name.as_ref(), &at, "name")?,
                        "arguments": item.arguments.clone().unwrap_or_default(),
                    },
                });
                // The calls of a turn join its text: two assistant messages
                // in a row are refused by strict chat templates (Mistral, Kimi).
                match out.last_mut().and_then(Value::as_object_mut) {
                    Some(last) if last.get("role").is_some_and(|r| r == "assistant") => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            Some(calls) => calls.push(call),
                            None => {
                                last.insert("tool_calls".into(), json!([call]));
                            }
                        }
                    }
                    Some(_) | None => out
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => {
                let output = match &item.output {
                    Some(ItemContent::Text(text)) => text.clone(),
                    Some(ItemContent::Parts(parts)) => {
                        output_media(parts, &at, &mut media, &mut untranslated);
                        parts_text(parts)
                    }
                    None => {
                        return Err(Invalid::field(
                            format!("{at}.output"),
                            "missing field `output`",
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": required(item.call_id.as_ref(), &at, "call_id")?, "content": output}));
            }
            // Reasoning of earlier turns cannot be given back to a chat target.
            Some("reasoning") => {}
            Some(other) => {
                untranslated.get_or_insert_with(|| {
                    only_responses(
                        format!("{at}.type"),
                        &format!("input item of type `{other}`"),
                    )
                });
            }
        }
    }
    if !media.is_empty() {
        out.push(json!({"role": "user", "content": media}));
    }
    Ok(untranslated)
}

/// A call output's parts other than text, as chat content parts, into
/// `media`; one chat cannot read is named in `untranslated`.
fn output_media(
    parts: &[Part],
    at: &str,
    media: &mut Vec<Value>,
    untranslated: &mut Option<Untranslatable>,
) {
    for (j, part) in parts.iter().enumerate() {
        if matches!(part.kind.as_str(), "input_text" | "output_text" | "text") {
            continue;
        }
        match chat_part(part, &format!("{at}.output[{j}]")) {
            Ok(part) => media.push(part),
            Err(why) => {
                untranslated.get_or_insert(why);
            }
        }
    }
}

fn required<'a>(value: Option<&'a String>, at: &str, field: &str) -> Result<&'a String, Invalid> {
    value.ok_or_else(|| Invalid::field(format!("{at}.{field}"), format!("missing field `{field}`")))
}

/// A message item as a chat message; a part no chat target can read is left
/// out of it and named in `untranslated` (the request then goes only to a
/// Responses target), never dropped silently.
fn message_item(
    item: &Item,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<Value, Invalid> {
    let role = required(item.role.as_ref(), at, "role")?;
    if !matches!(role.as_str(), "user" | "assistant" | "system" | "developer") {
        return Err(Invalid::field(
            format!("{at}.role"),
            format!("unknown role `{role}`: user, assistant, system or developer"),
        ));
    }
    let content = match &item.content {
        None => {
            return Err(Invalid::field(
                format!("{at}.content"),
                "missing field `content`",
            ))
        }
        Some(ItemContent::Text(text)) => json!(text),
        Some(ItemContent::Parts(parts)) if textless(parts).is_some() => {
            let j = textless(parts).unwrap_or_default();
            return Err(Invalid::field(
                format!("{at}.content[{j}].text"),
                "missing field `text`",
            ));
        }
        // An assistant turn's content is its text.
        Some(ItemContent::Parts(parts)) if role == "assistant" => json!(parts_text(parts)),
        Some(ItemContent::Parts(parts)) => {
            let mut chat = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match chat_part(part, &format!("{at}.content[{j}]")) {
                    Ok(part) => chat.push(part),
                    Err(why) => {
                        untranslated.get_or_insert(why);
                    }
                }
            }
            Value::Array(chat)
        }
    };
    // Chat servers that know no `developer` (vLLM, SGLang) refuse it; every
    // chat target reads its instructions as `system`.
    let role = if role == "developer" { "system" } else { role };
    Ok(json!({"role": role, "content": content}))
}

/// The first text part without its `text`, if any.
fn textless(parts: &[Part]) -> Option<usize> {
    parts.iter().position(|p| {
        matches!(p.kind.as_str(), "input_text" | "output_text" | "text") && p.text.is_none()
    })
}

fn parts_text(parts: &[Part]) -> String {
    parts
        .iter()
        .filter_map(|p| p.text.as_deref().or(p.refusal.as_deref()))
        .collect::<Vec<_>>()
        .join("")
}

/// A content part as a chat part, or why no chat target can read it.
fn chat_part(part: &Part, at: &str) -> Result<Value, Untranslatable> {
    let only_responses = |what: &str| only_responses(at.to_owned(), what);
    match part.kind.as_str() {
        "input_text" | "output_text" | "text" => {
            Ok(json!({"type": "text", "text": part.text.clone().unwrap_or_default()}))
        }
        "input_image" => {
            let url = part
                .image_url
                .as_ref()
                .ok_or_else(|| only_responses("an image without `image_url` (a file id)"))?;
            let mut image = json!({"url": url});
            if let Some(detail) = &part.detail {
                image["detail"] = json!(detail);
            }
            Ok(json!({"type": "image_url", "image_url": image}))
        }
        "input_file" => {
            let data = part
                .file_data
                .as_ref()
                .ok_or_else(|| only_responses("a file without `file_data` (a file id or url)"))?;
            Ok(
                json!({"type": "file", "file": {"file_data": data, "filename": part.filename.clone().unwrap_or_else(|| "file".into())}}),
            )
        }
        other => Err(only_responses(&format!("a content part of type `{other}`"))),
    }
}

/// The function tools as chat tools (built-in ones are left out: see
/// [`built_in_tool`]).
fn chat_tools(tools: &[Tool]) -> Result<Vec<Value>, Invalid> {
    tools
        .iter()
        .enumerate()
        .filter(|(_, tool)| tool.kind == "function")
        .map(|(i, tool)| {
            let name = tool
                .name
                .as_ref()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    Invalid::field(format!("tools[{i}].name"), "a function tool needs a name")
                })?;
            let mut function = json!({
                "name": name,
                "parameters": tool.parameters.clone().unwrap_or_else(|| json!({"type": "object"})),
            });
            if let Some(d) = &tool.description {
                function["description"] = json!(d);
            }
            if let Some(strict) = tool.strict {
                function["strict"] = json!(strict);
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

fn chat_tool_choice(choice: &ToolChoice) -> Result<Value, Invalid> {
    match choice {
        ToolChoice::Mode(mode) if matches!(mode.as_str(), "auto" | "none" | "required") => {
            Ok(json!(mode))
        }
        ToolChoice::Function { kind, name } if kind == "function" => {
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        // Never sent: the request is a Responses target's alone (`hosted_choice`).
        ToolChoice::Other(_) => Ok(json!("auto")),
        ToolChoice::Function { kind, .. } if kind != "function" => Ok(json!("auto")),
        ToolChoice::Mode(_) | ToolChoice::Function { .. } => Err(Invalid::field(
            "tool_choice",
            "`auto`, `none`, `required` or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

fn response_format(format: &Format) -> Option<Value> {
    match format {
        Format::Text {} => None,
        Format::JsonObject {} => Some(json!({"type": "json_object"})),
        Format::JsonSchema {
            name,
            schema,
            strict,
            description,
        } => {
            let mut spec = json!({"name": name, "schema": schema});
            if let Some(s) = strict {
                spec["strict"] = json!(s);
            }
            if let Some(d) = description {
                spec["description"] = json!(d);
            }
            Some(json!({"type": "json_schema", "json_schema": spec}))
        }
    }
}

/// The request's settings, echoed in the response object as OpenAI does.
#[derive(Debug)]
struct Echo(Map<String, Value>);

impl Echo {
    fn of(request: &Request<'_>) -> Self {
        let text = match request.text.as_ref().and_then(|t| t.format.as_ref()) {
            Some(Format::JsonObject {}) => json!({"format": {"type": "json_object"}}),
            Some(Format::JsonSchema {
                name,
                schema,
                strict,
                ..
            }) => {
                json!({"format": {"type": "json_schema", "name": name, "schema": schema, "strict": strict}})
            }
            Some(Format::Text {}) | None => json!({"format": {"type": "text"}}),
        };
        let tools: Vec<Value> = request
            .tools
            .iter()
            .flatten()
            .map(|t| {
                json!({
                    "type": t.kind, "name": t.name, "description": t.description,
                    "parameters": t.parameters, "strict": t.strict,
                })
            })
            .collect();
        let tool_choice = match &request.tool_choice {
            None => json!("auto"),
            Some(ToolChoice::Mode(m)) => json!(m),
            Some(ToolChoice::Function { kind, name }) => json!({"type": kind, "name": name}),
            Some(ToolChoice::Other(choice)) => Value::Object(choice.clone()),
        };
        let mut echo = Map::new();
        echo.insert("instructions".into(), json!(request.instructions));
        echo.insert("max_output_tokens".into(), json!(request.max_output_tokens));
        echo.insert(
            "metadata".into(),
            Value::Object(request.metadata.clone().unwrap_or_default()),
        );
        echo.insert(
            "parallel_tool_calls".into(),
            json!(request.parallel_tool_calls.unwrap_or(true)),
        );
        echo.insert(
            "previous_response_id".into(),
            json!(request.previous_response_id),
        );
        echo.insert("reasoning".into(), json!({"effort": request.reasoning.as_ref().and_then(|r| r.effort.clone()), "summary": null}));
        echo.insert("store".into(), json!(request.store.unwrap_or(true)));
        echo.insert(
            "temperature".into(),
            json!(request.temperature.unwrap_or(1.0)),
        );
        echo.insert("text".into(), text);
        echo.insert("tool_choice".into(), tool_choice);
        echo.insert("tools".into(), Value::Array(tools));
        echo.insert("top_p".into(), json!(request.top_p.unwrap_or(1.0)));
        echo.insert("truncation".into(), json!("disabled"));
        echo.insert("user".into(), json!(request.user));
        Self(echo)
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What rendering a Responses answer needs of its request.
#[derive(Debug)]
pub struct Reply {
    id: String,
    created_at: u64,
    model: String,
    /// Where the response is kept, unless `store: false`.
    store: Option<ResponseStore>,
    /// The conversation so far (the previous response's, then this input),
    /// shared with the chat translation.
    conversation: std::sync::Arc<Vec<Value>>,
    echo: Echo,
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    InProgress,
    Completed,
    Incomplete(&'static str),
    Failed,
}

impl Status {
    fn of(finish: Option<Finish>) -> Self {
        match finish {
            Some(Finish::Length) => Status::Incomplete("max_output_tokens"),
            Some(Finish::ContentFilter) => Status::Incomplete("content_filter"),
            Some(Finish::Stop | Finish::ToolCalls) | None => Status::Completed,
        }
    }
}

fn usage_of(usage: Option<&Usage>) -> Value {
    let Some(u) = usage else {
        return Value::Null;
    };
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached()},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning()},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The conversation a stored response continues: the turns before it, then
/// the assistant turn its output makes.
fn conversation_of(stored: &Stored) -> Vec<Value> {
    #[derive(Deserialize)]
    struct Made<'a> {
        #[serde(borrow, default)]
        output: Vec<&'a RawValue>,
    }
    if let Some(whole) = &stored.conversation {
        return whole.clone();
    }
    let output = serde_json::from_str::<Made<'_>>(stored.response.get())
        .map(|made| made.output)
        .unwrap_or_default();
    let mut conversation = Vec::with_capacity(stored.earlier.len() + 1);
    conversation.extend(stored.earlier.iter().cloned());
    conversation.push(assistant_of_made(&output));
    conversation
}

/// A response object's `id`. The text was read whole before it gets here
/// (as the answer's facts, or as its stream event), so where OpenAI writes
/// the id, first, the first key answers; else a scan finds it, and serde
/// reads one the scan steps aside from (an escape in it).
fn response_id(response: &str) -> Option<Cow<'_, str>> {
    #[derive(Deserialize)]
    struct Made<'a> {
        #[serde(borrow)]
        id: Option<Cow<'a, str>>,
    }
    if let Some(rest) = response.strip_prefix(r#"{"id":""#) {
        let id = rest.get(..scan::plain_len(rest));
        if let Some(id) = id.filter(|id| rest.as_bytes().get(id.len()) == Some(&b'"')) {
            return Some(Cow::Borrowed(id));
        }
    }
    if let Some([id]) = scan::fields(response, ["id"]) {
        if let Some(Some(id)) = scan::plain_str(id) {
            return Some(Cow::Borrowed(id));
        }
    }
    serde_json::from_str::<Made<'_>>(response).ok()?.id
}

/// The assistant turn the output items of a response make (each read into
/// borrowed structs; an item that does not read is left out).
fn assistant_of_made(output: &[&RawValue]) -> Value {
    #[derive(Deserialize)]
    struct Item<'a> {
        #[serde(rename = "type", borrow, default)]
        kind: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        content: Vec<Part<'a>>,
        #[serde(borrow, default)]
        call_id: Option<&'a RawValue>,
        #[serde(borrow, default)]
        name: Option<&'a RawValue>,
        #[serde(borrow, default)]
        arguments: Option<&'a RawValue>,
    }
    #[derive(Deserialize)]
    struct Part<'a> {
        #[serde(borrow, default)]
        text: Option<&'a RawValue>,
        #[serde(borrow, default)]
        refusal: Option<&'a RawValue>,
    }
    let string =
        |raw: Option<&RawValue>| raw.and_then(|r| serde_json::from_str::<String>(r.get()).ok());
    let value = |raw: Option<&RawValue>| {
        raw.and_then(|r| serde_json::from_str(r.get()).ok())
            .unwrap_or(Value::Null)
    };
    let (mut text, mut calls) = (String::new(), Vec::new());
    for item in output
        .iter()
        .filter_map(|i| serde_json::from_str::<Item<'_>>(i.get()).ok())
    {
        match item.kind.as_deref() {
            Some("message") => {
                for part in &item.content {
                    if let Some(piece) = string(part.text).or_else(|| string(part.refusal)) {
                        text.push_str(&piece);
                    }
                }
            }
            Some("function_call") => {
                let (id, name) = (value(item.call_id), value(item.name));
                calls.push(chat_call(&id, &name, &value(item.arguments)));
            }
            _ => {}
        }
    }
    assistant_turn(text, calls)
}

/// A chat tool call, from a function call item's fields.
fn chat_call(call_id: &Value, name: &Value, arguments: &Value) -> Value {
    json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// The assistant message of `text` (none when empty) and tool `calls`.
fn assistant_turn(text: String, calls: Vec<Value>) -> Value {
    let content = if text.is_empty() {
        Value::Null
    } else {
        Value::String(text)
    };
    let mut assistant = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        assistant["tool_calls"] = Value::Array(calls);
    }
    assistant
}

fn message_item_out(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
        "arguments": arguments, "status": status})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [{"type": "summary_text", "text": text}]})
}

impl Reply {
    fn object(&self, model: &str, status: Status, output: Vec<Value>, usage: Value) -> Value {
        let (status, incomplete) = match status {
            Status::InProgress => ("in_progress", Value::Null),
            Status::Completed => ("completed", Value::Null),
            Status::Incomplete(reason) => ("incomplete", json!({"reason": reason})),
            Status::Failed => ("failed", Value::Null),
        };
        let mut object = json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": null, "incomplete_details": incomplete,
            "model": if model.is_empty() { self.model.as_str() } else { model },
            "output": output, "usage": usage,
        });
        if let Some(map) = object.as_object_mut() {
            map.extend(self.echo.0.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        object
    }

    /// Keeps the finished response and its conversation, unless `store: false`.
    fn keep(&self, response: &str) {
        let Some(store) = &self.store else {
            return;
        };
        let json = Stored::json(response, &self.conversation);
        store.put(self.id.clone(), json);
    }

    /// A Responses target's own answer, as it sent it (kept in the store
    /// under its id).
    #[must_use]
    pub fn native_answer(&mut self, native: Bytes) -> Bytes {
        if self.store.is_some() {
            if let Ok(text) = std::str::from_utf8(&native) {
                self.keep_native(text);
            }
        }
        native
    }

    /// Keeps a response a Responses target made (its JSON text), under its
    /// own id. Only its id is read: the rest is kept as it came.
    fn keep_native(&mut self, response: &str) {
        let Some(id) = response_id(response) else {
            return;
        };
        id.as_ref().clone_into(&mut self.id);
        self.keep(response);
    }

    /// A chat completion as a `response` object (kept in the store).
    #[must_use]
    pub fn answer(&self, bytes: &[u8]) -> Bytes {
        let completion: Completion = serde_json::from_slice(bytes).unwrap_or_default();
        let choice = completion.choices.first();
        let mut output = Vec::new();
        if let Some(message) = choice.map(|c| &c.message) {
            if let Some(r) = message.reasoning() {
                output.push(reasoning_item(&fresh_id(MINTED_REASONING), r));
            }
            let text = message.content.as_deref().filter(|t| !t.is_empty());
            let refusal = message.refusal.as_deref().filter(|r| !r.is_empty());
            match (text, refusal) {
                (Some(text), _) => {
                    output.push(message_item_out(&fresh_id("msg_"), text, "completed"))
                }
                // A refusal is its own content part, as OpenAI's SDKs read it.
                (None, Some(refusal)) => output.push(json!({"type": "message",
                    "id": fresh_id("msg_"), "status": "completed", "role": "assistant",
                    "content": [{"type": "refusal", "refusal": refusal}]})),
                (None, None) => {}
            }
            for call in &message.tool_calls {
                let f = &call.function;
                // A `function_call_output` must name the call: one is made
                // when its server gave none.
                let call_id = match call.id.as_str() {
                    "" => &fresh_id("call_"),
                    id => id,
                };
                output.push(call_item(
                    &fresh_id("fc_"),
                    call_id,
                    &f.name,
                    &f.arguments,
                    "completed",
                ));
            }
        }
        let status = Status::of(Finish::of(choice.and_then(|c| c.finish_reason.as_deref())));
        if let (Status::Incomplete(_), Some(last)) = (&status, output.last_mut()) {
            // The item the limit cut is as incomplete as the response.
            if last.get("status").is_some() {
                last["status"] = "incomplete".into();
            }
        }
        let response = self.object(
            &completion.model,
            status,
            output,
            usage_of(completion.usage.as_ref()),
        );
        let response = response.to_string();
        self.keep(&response);
        Bytes::from(response)
    }

    /// The renderer of this request's stream.
    #[must_use]
    pub fn stream(self) -> StreamReply {
        StreamReply {
            reply: self,
            sequence: 0,
            model: String::new(),
            started: false,
            reasoning: None,
            text: None,
            calls: Vec::new(),
            slots: crate::sse::CallSlots::default(),
            output: Vec::new(),
            finish: None,
            usage: None,
            ended: false,
        }
    }
}

/// The message item being streamed.
#[derive(Debug)]
struct TextItem {
    id: String,
    output_index: usize,
    text: String,
}

/// How far past the output items seen so far an upstream's `output_index`
/// may point.
const MAX_ITEMS_AHEAD: usize = 64;

/// A finished output item.
#[derive(Debug, Clone)]
enum Output {
    /// Written by the renderer.
    Made(Value),
    /// A Responses target's own JSON text, as it sent it (read already as
    /// JSON): read again only if the stream fails and its `response.failed`
    /// lists it.
    Native(Box<str>),
}

impl Output {
    fn value(&self) -> Value {
        match self {
            Output::Made(item) => item.clone(),
            Output::Native(raw) => serde_json::from_str(raw).unwrap_or(Value::Null),
        }
    }
}

/// A function call being streamed.
#[derive(Debug)]
struct CallItem {
    chat_index: u32,
    id: String,
    /// Whether its `output_item.added` went out: from then on its identity
    /// (`call_id`, `name`) is fixed, as a client checks `done` against it.
    announced: bool,
    output_index: usize,
    call_id: String,
    name: String,
    arguments: String,
}

/// A Responses stream rendered from the chat stream.
#[derive(Debug)]
pub struct StreamReply {
    reply: Reply,
    sequence: u64,
    model: String,
    started: bool,
    /// The open reasoning item (a chat target's `reasoning_content`).
    reasoning: Option<TextItem>,
    text: Option<TextItem>,
    calls: Vec<CallItem>,
    /// Which call each chat tool-call fragment belongs to.
    slots: crate::sse::CallSlots,
    /// The finished output items, by output index.
    output: Vec<Option<Output>>,
    finish: Option<Finish>,
    usage: Option<Usage>,
    ended: bool,
}

/// What the stream state needs of an upstream Responses event.
struct EventHead<'a> {
    kind: Cow<'a, str>,
    sequence_number: Option<u64>,
    output_index: Option<usize>,
    item_id: Option<Cow<'a, str>>,
    delta: Option<Cow<'a, str>>,
    /// The JSON text of `item` and `response`.
    item: Option<&'a str>,
    response: Option<&'a str>,
}

/// [`EventHead`] as serde reads it.
#[derive(Deserialize)]
struct WireHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default)]
    output_index: Option<usize>,
    #[serde(borrow, default)]
    item_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    item: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

impl<'a> EventHead<'a> {
    /// An event's head, read by a scan (the event of every token), else by
    /// serde when the scan leaves it (an escape, a type it does not take).
    fn read(data: &'a str) -> Option<Self> {
        if let Some(d) = crate::native::responses_text_delta(data) {
            return Some(Self {
                kind: Cow::Borrowed("response.output_text.delta"),
                sequence_number: Some(d.sequence_number),
                output_index: Some(usize::try_from(d.output_index).ok()?),
                item_id: Some(Cow::Borrowed(d.item_id)),
                delta: Some(Cow::Borrowed(d.delta)),
                item: None,
                response: None,
            });
        }
        if let Some(head) = Self::scan(data) {
            return Some(head);
        }
        let wire: WireHead<'a> = serde_json::from_str(data).ok()?;
        Some(Self {
            kind: wire.kind,
            sequence_number: wire.sequence_number,
            output_index: wire.output_index,
            item_id: wire.item_id,
            delta: wire.delta,
            item: wire.item.map(RawValue::get),
            response: wire.response.map(RawValue::get),
        })
    }

    fn scan(data: &'a str) -> Option<Self> {
        let keys = [
            "type",
            "sequence_number",
            "output_index",
            "item_id",
            "delta",
            "item",
            "response",
        ];
        let [kind, sequence_number, output_index, item_id, delta, item, response] =
            scan::fields(data, keys)?;
        let output_index = match scan::plain_u64(output_index)? {
            Some(n) => Some(usize::try_from(n).ok()?),
            None => None,
        };
        let raw = |f: Option<&'a str>| f.filter(|v| *v != "null");
        Some(Self {
            kind: Cow::Borrowed(scan::plain_str(kind)??),
            sequence_number: scan::plain_u64(sequence_number)?,
            output_index,
            item_id: scan::plain_str(item_id)?.map(Cow::Borrowed),
            delta: scan::plain_str(delta)?.map(Cow::Borrowed),
            item: raw(item),
            response: raw(response),
        })
    }
}

/// What the stream state needs of an output item.
#[derive(Deserialize)]
struct ItemHead {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    id: String,
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

impl StreamReply {
    /// An upstream Responses event (its target speaks Responses), written as
    /// it came. The state follows it, so that what another target adds after
    /// a break (rendered from chat) carries on from it: the same response id,
    /// the next sequence numbers, the open message item.
    pub(super) fn native(&mut self, data: &str, raw: &[u8], out: &mut BytesMut) {
        let Some(head) = EventHead::read(data) else {
            return;
        };
        if self.ended {
            return;
        }
        out.extend_from_slice(raw);
        if let Some(n) = head.sequence_number {
            self.sequence = n + 1;
        }
        let item = || {
            head.item
                .and_then(|i| serde_json::from_str::<ItemHead>(i).ok())
        };
        match head.kind.as_ref() {
            "response.created" => {
                self.started = true;
                #[derive(Deserialize)]
                struct Created<'a> {
                    #[serde(borrow)]
                    id: Option<Cow<'a, str>>,
                    #[serde(borrow)]
                    model: Option<Cow<'a, str>>,
                }
                let created = head
                    .response
                    .and_then(|r| serde_json::from_str::<Created<'_>>(r).ok());
                if let Some(Created { id, model }) = created {
                    if let Some(id) = id {
                        id.as_ref().clone_into(&mut self.reply.id);
                    }
                    if let Some(model) = model {
                        model.as_ref().clone_into(&mut self.model);
                    }
                }
            }
            "response.output_item.added" => {
                if let (Some(item), Some(index)) = (item(), head.output_index) {
                    self.native_item(item, index);
                }
            }
            "response.output_text.delta" => {
                let open = self
                    .text
                    .as_mut()
                    .filter(|t| head.item_id.as_deref() == Some(t.id.as_str()));
                if let (Some(text), Some(delta)) = (open, head.delta.as_deref()) {
                    text.text.push_str(delta);
                }
            }
            "response.function_call_arguments.delta" => {
                let id = head.item_id.as_deref();
                let call = self.calls.iter_mut().find(|c| Some(c.id.as_str()) == id);
                if let (Some(call), Some(delta)) = (call, head.delta.as_deref()) {
                    call.arguments.push_str(delta);
                }
            }
            "response.output_item.done" => {
                #[derive(Deserialize)]
                struct Done<'a> {
                    #[serde(borrow, default)]
                    id: Option<Cow<'a, str>>,
                }
                let done = head.item.and_then(|i| {
                    let id = serde_json::from_str::<Done<'_>>(i).ok()?.id;
                    Some((id, Box::<str>::from(i)))
                });
                if let (Some((id, done)), Some(index)) = (done, head.output_index) {
                    let id = id.as_deref().unwrap_or_default();
                    if self.text.as_ref().is_some_and(|t| t.id == id) {
                        self.text = None;
                    }
                    self.calls.retain(|c| c.id != id);
                    if let Some(slot) = self.output.get_mut(index) {
                        *slot = Some(Output::Native(done));
                    }
                }
            }
            "response.completed" | "response.incomplete" => {
                self.ended = true;
                if let Some(response) = head.response {
                    self.reply.keep_native(response);
                }
            }
            "response.failed" | "error" => self.ended = true,
            _ => {}
        }
    }

    /// An output item the upstream opened: its place in the output, and the
    /// message or call that a continuation's deltas would go on in.
    fn native_item(&mut self, item: ItemHead, index: usize) {
        // The upstream's index sizes the list: one far past the items so far
        // is not believed (it is relayed, not kept).
        if index > self.output.len().saturating_add(MAX_ITEMS_AHEAD) {
            return;
        }
        if self.output.len() <= index {
            self.output.resize(index + 1, None);
        }
        match item.kind.as_str() {
            "message" => {
                self.text = Some(TextItem {
                    id: item.id,
                    output_index: index,
                    text: String::new(),
                });
            }
            "function_call" => {
                let chat_index = u32::try_from(self.calls.len()).unwrap_or(u32::MAX);
                self.calls.push(CallItem {
                    chat_index,
                    id: item.id,
                    announced: true,
                    output_index: index,
                    call_id: item.call_id.unwrap_or_default(),
                    name: item.name.unwrap_or_default(),
                    arguments: String::new(),
                });
            }
            _ => {}
        }
    }

    fn emit(&mut self, out: &mut BytesMut, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        write_event(out, kind, &data);
    }

    fn start(&mut self, chunk: &Chunk, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        self.model.clone_from(&chunk.model);
        let response = self
            .reply
            .object(&self.model, Status::InProgress, Vec::new(), Value::Null);
        self.emit(out, "response.created", json!({"response": response}));
        self.emit(out, "response.in_progress", json!({"response": response}));
    }

    /// A new item, its id made with `prefix`, at the end of the output.
    fn next_item(&mut self, prefix: &str) -> TextItem {
        self.output.push(None);
        TextItem {
            id: fresh_id(prefix),
            output_index: self.output.len() - 1,
            text: String::new(),
        }
    }

    /// Reasoning text, in a reasoning item's summary (as the answer has it).
    fn reasoning_delta(&mut self, delta: &str, out: &mut BytesMut) {
        if self.reasoning.is_none() {
            self.close_text(out);
            let item = self.next_item(MINTED_REASONING);
            let (id, index) = (item.id.clone(), item.output_index);
            self.reasoning = Some(item);
            let added = json!({"type": "reasoning", "id": id, "summary": []});
            self.emit(
                out,
                "response.output_item.added",
                json!({"output_index": index, "item": added}),
            );
            self.emit(out, "response.reasoning_summary_part.added", json!({"item_id": id,
                "output_index": index, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}));
        }
        let Some(item) = &mut self.reasoning else {
            return;
        };
        item.text.push_str(delta);
        let (id, index) = (item.id.clone(), item.output_index);
        self.emit(
            out,
            "response.reasoning_summary_text.delta",
            json!({"item_id": id,
            "output_index": index, "summary_index": 0, "delta": delta}),
        );
    }

    fn close_reasoning(&mut self, out: &mut BytesMut) {
        let Some(item) = self.reasoning.take() else {
            return;
        };
        let (id, index, text) = (item.id.as_str(), item.output_index, item.text.as_str());
        self.emit(
            out,
            "response.reasoning_summary_text.done",
            json!({"item_id": id,
            "output_index": index, "summary_index": 0, "text": text}),
        );
        self.emit(out, "response.reasoning_summary_part.done", json!({"item_id": id,
            "output_index": index, "summary_index": 0, "part": {"type": "summary_text", "text": text}}));
        let done = reasoning_item(id, text);
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.output[index] = Some(Output::Made(done));
    }

    fn open_text(&mut self, out: &mut BytesMut) -> usize {
        if let Some(item) = &self.text {
            return item.output_index;
        }
        self.close_reasoning(out);
        let item = self.next_item("msg_");
        let added = json!({"type": "message", "id": item.id, "status": "in_progress", "role": "assistant", "content": []});
        let (id, index) = (item.id.clone(), item.output_index);
        self.text = Some(item);
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        self.emit(
            out,
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        );
        index
    }

    fn close_text(&mut self, out: &mut BytesMut) {
        let Some(item) = self.text.take() else {
            return;
        };
        let (id, index) = (item.id.as_str(), item.output_index);
        self.emit(out, "response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": item.text, "logprobs": []}));
        self.emit(
            out,
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0,
            "part": {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}}),
        );
        let done = message_item_out(id, &item.text, "completed");
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.output[index] = Some(Output::Made(done));
    }

    pub(super) fn chunk(&mut self, chunk: &Chunk, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        self.start(chunk, out);
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        let Some(choice) = chunk.choices.iter().find(|c| c.index == 0) else {
            return;
        };
        let delta = &choice.delta;
        if let Some(r) = delta.reasoning() {
            self.reasoning_delta(r, out);
        }
        let text = delta.content.as_deref().or(delta.refusal.as_deref());
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            let index = self.open_text(out);
            if let Some(item) = &mut self.text {
                item.text.push_str(t);
            }
            let id = self.text.as_ref().map(|i| i.id.clone()).unwrap_or_default();
            self.emit(out, "response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": []}));
        }
        for call in &delta.tool_calls {
            self.call_delta(call, out);
        }
        if let Some(finish) = Finish::of(choice.finish_reason.as_deref()) {
            self.finish = Some(finish);
        }
    }

    /// A chat tool call's fragment. The call's item is announced once its
    /// name is known (a server may send the name, or the id, in a later
    /// fragment than the first); the arguments that came before go out then.
    fn call_delta(&mut self, call: &super::ToolCallDelta, out: &mut BytesMut) {
        let number = self.slots.slot(call.index, call.id.as_deref());
        let at = match self.calls.iter().position(|c| c.chat_index == number) {
            Some(at) => at,
            None => {
                self.calls.push(CallItem {
                    chat_index: number,
                    id: fresh_id("fc_"),
                    announced: false,
                    output_index: 0,
                    call_id: String::new(),
                    name: String::new(),
                    arguments: String::new(),
                });
                self.calls.len() - 1
            }
        };
        let item = &mut self.calls[at];
        if !item.announced {
            if item.name.is_empty() {
                item.name = call.function.name.clone().unwrap_or_default();
            }
            if let (true, Some(id)) = (item.call_id.is_empty(), call.id.as_ref()) {
                item.call_id.clone_from(id);
            }
        }
        let fragment = call.function.arguments.as_deref().filter(|a| !a.is_empty());
        if let Some(fragment) = fragment {
            item.arguments.push_str(fragment);
        }
        match (item.announced, fragment) {
            (false, _) if item.name.is_empty() => {}
            (false, _) => self.announce_call(at, out),
            (true, Some(fragment)) => {
                let (id, index) = (item.id.clone(), item.output_index);
                self.emit(
                    out,
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": fragment}),
                );
            }
            (true, None) => {}
        }
    }

    /// The `output_item.added` of the call at `at` (its `call_id` made if no
    /// fragment named it), then the arguments it holds as one delta.
    fn announce_call(&mut self, at: usize, out: &mut BytesMut) {
        self.close_reasoning(out);
        self.close_text(out);
        let output_index = self.output.len();
        self.output.push(None);
        let Some(item) = self.calls.get_mut(at) else {
            return;
        };
        item.announced = true;
        item.output_index = output_index;
        if item.call_id.is_empty() {
            item.call_id = fresh_id("call_");
        }
        let added = call_item(&item.id, &item.call_id, &item.name, "", "in_progress");
        let (id, arguments) = (item.id.clone(), item.arguments.clone());
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": output_index, "item": added}),
        );
        if !arguments.is_empty() {
            self.emit(
                out,
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": output_index, "delta": arguments}),
            );
        }
    }

    pub(super) fn done(&mut self, out: &mut BytesMut) {
        if self.ended || !self.started {
            return;
        }
        self.ended = true;
        self.close_reasoning(out);
        self.close_text(out);
        for at in 0..self.calls.len() {
            if !self.calls[at].announced {
                self.announce_call(at, out);
            }
        }
        let mut calls = std::mem::take(&mut self.calls);
        // A call announced late has a later place than one named first.
        calls.sort_by_key(|c| c.output_index);
        for item in calls {
            self.emit(out, "response.function_call_arguments.done", json!({"item_id": item.id, "output_index": item.output_index, "name": item.name, "arguments": item.arguments}));
            let done = call_item(
                &item.id,
                &item.call_id,
                &item.name,
                &item.arguments,
                "completed",
            );
            self.emit(
                out,
                "response.output_item.done",
                json!({"output_index": item.output_index, "item": done}),
            );
            self.output[item.output_index] = Some(Output::Made(done));
        }
        let output: Vec<Value> = self.output.iter().flatten().map(Output::value).collect();
        let status = Status::of(self.finish);
        let response =
            self.reply
                .object(&self.model, status, output, usage_of(self.usage.as_ref()));
        self.reply.keep(&response.to_string());
        let kind = match status {
            Status::Incomplete(_) => "response.incomplete",
            Status::InProgress | Status::Completed | Status::Failed => "response.completed",
        };
        self.emit(out, kind, json!({"response": response}));
    }

    pub(super) fn error(&mut self, error: &WireError, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        self.ended = true;
        let code = error
            .code()
            .or(error.kind.as_deref())
            .unwrap_or("server_error")
            .to_owned();
        self.emit(
            out,
            "error",
            json!({"code": code, "message": error.message, "param": null}),
        );
        if self.started {
            // What went out before the error, the open items as incomplete.
            let mut output: Vec<Option<Value>> = self
                .output
                .iter()
                .map(|o| o.as_ref().map(Output::value))
                .collect();
            if let Some(r) = &self.reasoning {
                output[r.output_index] = Some(reasoning_item(&r.id, &r.text));
            }
            if let Some(text) = &self.text {
                output[text.output_index] =
                    Some(message_item_out(&text.id, &text.text, "incomplete"));
            }
            for c in self.calls.iter().filter(|c| c.announced) {
                let item = call_item(&c.id, &c.call_id, &c.name, &c.arguments, "incomplete");
                output[c.output_index] = Some(item);
            }
            let output: Vec<Value> = output.into_iter().flatten().collect();
            let mut response = self.reply.object(
                &self.model,
                Status::Failed,
                output,
                usage_of(self.usage.as_ref()),
            );
            response["error"] = json!({"code": code, "message": error.message});
            self.emit(out, "response.failed", json!({"response": response}));
        }
    }
}

/// A refused request in OpenAI's envelope.
#[must_use]
pub fn invalid(e: &Invalid) -> Bytes {
    Bytes::from(
        json!({"error": {"message": e.message, "type": "invalid_request_error",
            "param": e.param, "code": e.code.unwrap_or("invalid_request")}})
        .to_string(),
    )
}

/// The `previous_response_id` of a Responses request body, if it names one
/// (to fetch it from the shared store before the request is translated).
#[must_use]
pub fn previous_response_id(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Previous {
        previous_response_id: Option<String>,
    }
    serde_json::from_slice::<Previous>(body)
        .ok()?
        .previous_response_id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_output_reads_as_the_assistant_turn_it_made() {
        let cases = [
            (
                r#"[{"type":"message","id":"m","content":[{"type":"output_text","text":"Hello","annotations":[]},{"type":"output_text","text":" there"}]}]"#,
                json!({"role": "assistant", "content": "Hello there"}),
            ),
            (
                r#"[{"type":"reasoning","summary":[]},{"type":"message","content":[{"type":"refusal","refusal":"no"}]}]"#,
                json!({"role": "assistant", "content": "no"}),
            ),
            (
                r#"[{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},{"type":"function_call","call_id":"c2","name":"g"}]"#,
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": null}},
                ]}),
            ),
            (
                r#"[{"type":"message","content":[{"text":"caf\u00e9"},{"text":5,"refusal":"r"}]},{"type":"web_search_call","id":"ws"}]"#,
                json!({"role": "assistant", "content": "cafér"}),
            ),
            (r#"[]"#, json!({"role": "assistant", "content": null})),
        ];
        for (output, turn) in cases {
            let raw: Vec<&RawValue> = serde_json::from_str(output).unwrap();
            assert_eq!(assistant_of_made(&raw), turn, "{output}");
        }
    }

    #[test]
    fn a_response_id_is_found_by_the_scan_and_by_serde_past_an_escape() {
        let cases = [
            (r#"{"id":"resp_1","output":[]}"#, Some("resp_1")),
            (
                "{\n  \"object\": \"response\",\n  \"id\": \"resp_2\"\n}",
                Some("resp_2"),
            ),
            (r#"{"id":"resp_\u0033"}"#, Some("resp_3")),
            (r#"{"output":[]}"#, None),
            (r#"{"id":null}"#, None),
            (r#"{"object":"response","id":"resp_1""#, None),
            (r#"{"object":"response","id":"a","id":"b"}"#, None),
        ];
        for (response, id) in cases {
            assert_eq!(response_id(response).as_deref(), id, "{response}");
        }
    }

    #[test]
    fn an_event_head_read_by_the_scan_reads_as_serde_reads_it() {
        type Seen = Option<(
            String,
            Option<u64>,
            Option<usize>,
            Option<String>,
            Option<String>,
        )>;
        type Raw = (Option<String>, Option<String>);
        let seen = |head: Option<EventHead<'_>>| -> (Seen, Raw) {
            let Some(h) = head else {
                return (None, (None, None));
            };
            let raw =
                |v: Option<&str>| v.map(|v| serde_json::from_str::<Value>(v).unwrap().to_string());
            let owned = |v: Option<Cow<'_, str>>| v.map(Cow::into_owned);
            let (item, response) = (raw(h.item), raw(h.response));
            let fields = (
                h.kind.into_owned(),
                h.sequence_number,
                h.output_index,
                owned(h.item_id),
                owned(h.delta),
            );
            (Some(fields), (item, response))
        };
        let by_serde = |event: &str| {
            let wire: Option<WireHead<'_>> = serde_json::from_str(event).ok();
            seen(wire.map(|w| EventHead {
                kind: w.kind,
                sequence_number: w.sequence_number,
                output_index: w.output_index,
                item_id: w.item_id,
                delta: w.delta,
                item: w.item.map(RawValue::get),
                response: w.response.map(RawValue::get),
            }))
        };
        let events = [
            r#"{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi","logprobs":[]}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","delta":"a\nb"}"#,
            r#"{"type":"response.output_text.delta","item_id":"m\u0073g","delta":"x"}"#,
            r#"{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"type":"message","id":"msg_1"}}"#,
            r#"{"type":"response.output_item.done","output_index":0,"item":null}"#,
            r#"{"type":"response.completed","sequence_number":9,"response":{"id":"resp_1","output":[]}}"#,
            r#"{"type":"response.completed","sequence_number":-9}"#,
            r#"{"type":"response.completed","sequence_number":1.5}"#,
            r#"{"type":"response.completed","output_index":"1"}"#,
            r#"{"type":"x","delta":"a","delta":"b"}"#,
            r#"{"type":"x","delta":5}"#,
            r#"{"type":null}"#,
            r#"{"type":"x"} x"#,
        ];
        for event in events {
            let expected = by_serde(event);
            assert_eq!(seen(EventHead::read(event)), expected, "{event}");
            if let Some(scanned) = EventHead::scan(event) {
                assert_eq!(seen(Some(scanned)), expected, "{event}");
            }
        }
    }

    fn chat_of(body: &str, store: &ResponseStore) -> (Value, Reply) {
        let t = translate(body.as_bytes(), store).unwrap();
        let Render::Responses(reply) = t.render else {
            unreachable!()
        };
        (serde_json::from_slice(t.chat.bytes()).unwrap(), reply)
    }

    #[test]
    fn items_become_chat_messages_and_calls_merge_into_one_turn() {
        let store = ResponseStore::default();
        let (chat, _) = chat_of(
            r#"{"model":"m","instructions":"be brief","input":[
              {"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_image","image_url":"data:x","detail":"low"}]},
              {"type":"reasoning","id":"rs_1","summary":[]},
              {"type":"function_call","call_id":"c1","name":"a","arguments":"{}"},
              {"type":"function_call","call_id":"c2","name":"b","arguments":"{}"},
              {"type":"function_call_output","call_id":"c1","output":"one"}],
              "tools":[{"type":"function","name":"a","parameters":{"type":"object"}}],
              "text":{"format":{"type":"json_schema","name":"s","schema":{"type":"object"},"strict":true}},
              "max_output_tokens":50,"reasoning":{"effort":"low"}}"#,
            &store,
        );
        let m = &chat["messages"];
        assert_eq!(m[0], json!({"role":"system","content":"be brief"}));
        assert_eq!(
            m[1]["content"][1]["image_url"],
            json!({"url":"data:x","detail":"low"})
        );
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            m[3],
            json!({"role":"tool","tool_call_id":"c1","content":"one"})
        );
        assert_eq!(chat["response_format"]["json_schema"]["name"], "s");
        assert_eq!(chat["max_tokens"], 50);
        assert_eq!(chat["reasoning_effort"], "low");
    }

    #[test]
    fn a_previous_response_continues_its_conversation_and_an_unknown_one_is_refused() {
        let store = ResponseStore::default();
        let (_, reply) = chat_of(r#"{"model":"m","instructions":"x","input":"hi"}"#, &store);
        let answer = reply.answer(br#"{"id":"c","model":"m","choices":[{"message":{"content":"hello"},"finish_reason":"stop"}]}"#);
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["output"][0]["content"][0]["text"], "hello");
        let id = answer["id"].as_str().unwrap();
        let (chat, _) = chat_of(
            &format!(r#"{{"model":"m","input":"more","previous_response_id":"{id}"}}"#),
            &store,
        );
        assert_eq!(
            chat["messages"],
            json!([{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}])
        );
        let e = translate(
            br#"{"input":"x","previous_response_id":"resp_gone"}"#,
            &store,
        )
        .unwrap_err();
        assert_eq!(
            (e.param.as_str(), e.code),
            ("previous_response_id", Some("previous_response_not_found"))
        );
    }

    #[test]
    fn a_built_in_tool_is_left_for_a_responses_target_to_run() {
        let store = ResponseStore::default();
        let body =
            br#"{"input":"x","tools":[{"type":"function","name":"f"},{"type":"web_search"}]}"#;
        let t = translate(body, &store).unwrap();
        let why = t
            .untranslatable
            .expect("a built-in tool cannot be translated");
        assert_eq!(why.param, "tools[1].type");
        assert!(why.why.contains("`web_search` (tools[1].type)"), "{why:?}");
        let chat: Value = serde_json::from_slice(t.chat.bytes()).unwrap();
        assert_eq!(chat["tools"].as_array().map(Vec::len), Some(1), "{chat}");
    }

    #[test]
    fn state_only_the_provider_keeps_is_left_for_a_responses_target() {
        let store = ResponseStore::default();
        let left = |extra: &str| {
            let body = format!(r#"{{"input":"x"{extra}}}"#);
            let t = translate(body.as_bytes(), &store).unwrap();
            t.untranslatable.map(|why| why.param)
        };
        assert_eq!(
            left(r#","conversation":"conv_1""#).as_deref(),
            Some("conversation")
        );
        assert_eq!(
            left(r#","conversation":{"id":"conv_1"}"#).as_deref(),
            Some("conversation")
        );
        assert_eq!(
            left(r#","prompt":{"id":"pmpt_1"}"#).as_deref(),
            Some("prompt")
        );
        assert_eq!(left(r#","background":false,"conversation":null"#), None);
        let refused = |extra: &str| {
            let body = format!(r#"{{"input":"x"{extra}}}"#);
            translate(body.as_bytes(), &store).err().map(|e| e.param)
        };
        assert_eq!(
            refused(r#","tool_choice":"required""#).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            refused(r#","tool_choice":{"type":"function","name":"f"},"tools":[]"#).as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            refused(r#","background":true"#).as_deref(),
            Some("background")
        );
        let tools = r#","tools":[{"type":"function","name":"f"}]"#;
        assert_eq!(
            refused(&format!(r#","tool_choice":"required"{tools}"#)),
            None
        );
    }

    #[test]
    fn a_part_chat_cannot_read_is_left_for_a_responses_target() {
        let store = ResponseStore::default();
        for (part, said) in [
            (r#"{"type":"input_image","file_id":"file_1"}"#, "file id"),
            (
                r#"{"type":"input_file","file_url":"https://x/y.pdf"}"#,
                "file id or url",
            ),
            (r#"{"type":"input_audio","data":"AAAA"}"#, "`input_audio`"),
        ] {
            let body = format!(
                r#"{{"input":[{{"role":"user","content":[{{"type":"input_text","text":"hi"}},{part}]}}]}}"#
            );
            let t = translate(body.as_bytes(), &store).unwrap();
            let why = t.untranslatable.expect("a chat target cannot read it");
            assert_eq!(why.param, "input[0].content[1]");
            assert!(why.why.contains(said), "{why:?}");
            let chat: Value = serde_json::from_slice(t.chat.bytes()).unwrap();
            assert_eq!(
                chat["messages"][0]["content"],
                json!([{"type":"text","text":"hi"}]),
                "the readable parts stay for the translation: {chat}"
            );
        }
    }

    #[test]
    fn what_chat_cannot_carry_is_refused_by_field() {
        let store = ResponseStore::default();
        let refuse = |body: &str| translate(body.as_bytes(), &store).unwrap_err().param;
        assert_eq!(refuse(r#"{"input":5}"#), "input");
        assert_eq!(
            refuse(r#"{"input":"x","tools":[{"type":"function"}]}"#),
            "tools[0].name"
        );
        assert_eq!(
            refuse(r#"{"input":[{"type":"function_call","name":"a"}]}"#),
            "input[0].call_id"
        );
        assert_eq!(refuse(r#"{"model":"m"}"#), "input");
    }

    #[test]
    fn a_chat_stream_renders_as_numbered_response_events() {
        let store = ResponseStore::default();
        let (_, reply) = chat_of(r#"{"model":"m","input":"hi","stream":true}"#, &store);
        let mut r = reply.stream();
        let mut out = BytesMut::new();
        for e in [
            r#"{"id":"c","model":"x","choices":[{"index":0,"delta":{"content":"He"}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}]}"#,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}"#,
        ] {
            r.chunk(&serde_json::from_str(e).unwrap(), &mut out);
        }
        r.done(&mut out);
        let events: Vec<Value> = String::from_utf8(out.to_vec())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i);
        }
        let last = &events[9]["response"];
        assert_eq!(last["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(last["usage"]["total_tokens"], 3);
        assert!(store.get(last["id"].as_str().unwrap()).is_some());
    }
}
