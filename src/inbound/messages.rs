//! Anthropic Messages at the front door (`POST /v1/messages`, and
//! `/v1/messages/count_tokens`): the request read into typed wire structs
//! and translated into a chat request; the answer, the stream
//! (`message_start`, `content_block_*`, `message_delta`, `message_stop`,
//! `ping`, `event: error`) and errors rendered the way Anthropic sends them.
//!
//! Dropped by design when translating (README lists them): `cache_control`,
//! `top_k`, `citations`, the `thinking` config and thinking blocks of earlier
//! turns (a chat target cannot take them back). What a chat request cannot
//! carry at all (a server tool, its calls and results in earlier turns, a
//! block or source of a type only Anthropic reads) leaves the request to an
//! Anthropic target ([`Untranslatable`]); without one, a 400 names the field.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use http::StatusCode;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::native::Untranslatable;
use crate::sse::scan;

use super::{
    fresh_id, model_text, write_event, ChatBody, Chunk, Completion, Finish, Invalid, Render,
    StreamOptions, Translated, Usage, WireError,
};

/// The request, as far as the translation reads it.
#[derive(Deserialize)]
struct Request<'a> {
    /// Read raw, so its place in the body is known ([`crate::native::ModelAt`]).
    #[serde(borrow, default, deserialize_with = "crate::request::raw_even_null")]
    model: Option<&'a RawValue>,
    max_tokens: u64,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<System>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    metadata: Option<Metadata>,
    /// Remote MCP servers Anthropic calls on the model's behalf.
    #[serde(borrow, default)]
    mcp_servers: Option<&'a RawValue>,
    /// Structured outputs ([`response_format`]).
    #[serde(default)]
    output_config: Option<OutputConfig>,
    /// The structured-outputs beta's place for the same format.
    #[serde(default)]
    output_format: Option<OutputFormat>,
}

#[derive(Deserialize)]
struct OutputConfig {
    #[serde(default)]
    format: Option<OutputFormat>,
}

#[derive(Deserialize)]
struct OutputFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    schema: Option<Value>,
}

/// A structured-outputs format as chat's `response_format` (a JSON schema
/// is what both say; the name chat requires is made up).
///
/// # Errors
/// A format type other than `json_schema`, or one without its `schema`.
fn response_format(request: &Request<'_>) -> Result<Option<Value>, Invalid> {
    let (format, at) = match (&request.output_config, &request.output_format) {
        (Some(OutputConfig { format: Some(f) }), _) => (f, "output_config.format"),
        (_, Some(f)) => (f, "output_format"),
        (Some(OutputConfig { format: None }) | None, None) => return Ok(None),
    };
    match (format.kind.as_str(), &format.schema) {
        ("json_schema", Some(schema)) => Ok(Some(json!({"type": "json_schema",
            "json_schema": {"name": "output", "schema": schema}}))),
        ("json_schema", None) => Err(Invalid::field(
            format!("{at}.schema"),
            "a `json_schema` format needs its `schema`",
        )),
        (other, _) => Err(Invalid::field(
            format!("{at}.type"),
            format!("unknown format type `{other}`: `json_schema`"),
        )),
    }
}

/// `count_tokens` takes the request without `max_tokens`.
#[derive(Deserialize)]
struct CountRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<System>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of text blocks")]
enum System {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Deserialize)]
struct TextBlock {
    text: String,
}

#[derive(Deserialize)]
struct Message {
    role: Role,
    content: Content,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Role {
    User,
    Assistant,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of content blocks")]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Image {
        source: Source,
    },
    Document {
        source: Source,
        #[serde(default)]
        title: Option<String>,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<Content>,
        #[serde(default)]
        is_error: bool,
    },
    // Their text and signatures cannot go to a chat target.
    Thinking {
        #[serde(default)]
        signature: Signature,
    },
    RedactedThinking {},
    /// A block of another type (a server tool's call or result, a search
    /// result), or one of the types above that did not read as it.
    #[serde(untagged)]
    Other {
        #[serde(rename = "type")]
        kind: String,
    },
}

/// Whether a thinking block is signed (its signature is not kept).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Signature(bool);

impl<'de> Deserialize<'de> for Signature {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Signed;
        impl serde::de::Visitor<'_> for Signed {
            type Value = Signature;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a signature")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Signature, E> {
                Ok(Signature(!v.is_empty()))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Signature, E> {
                Ok(Signature(false))
            }
        }
        d.deserialize_any(Signed)
    }
}

/// Whether an assistant turn holds a thinking block without a signature.
fn unsigned_thinking(messages: &[Message]) -> bool {
    messages.iter().any(|m| match &m.content {
        Content::Blocks(blocks) => blocks.iter().any(|b| {
            matches!(
                b,
                Block::Thinking {
                    signature: Signature(false)
                }
            )
        }),
        Content::Text(_) => false,
    })
}

/// `body` with every thinking block without a signature taken out.
fn without_unsigned_thinking(body: &[u8]) -> Option<Bytes> {
    let mut request: Value = serde_json::from_slice(body).ok()?;
    let messages = request.get_mut("messages")?.as_array_mut()?;
    // A turn that held only such blocks goes too: Anthropic refuses an
    // empty one, and joins the turns around it (consecutive turns of one
    // role are one turn to it).
    messages.retain_mut(|message| {
        let Some(blocks) = message.get_mut("content").and_then(Value::as_array_mut) else {
            return true;
        };
        let before = blocks.len();
        blocks.retain(|b| {
            let signed = b["signature"].as_str().is_some_and(|s| !s.is_empty());
            b["type"] != "thinking" || signed
        });
        blocks.len() == before || !blocks.is_empty()
    });
    Some(Bytes::from(request.to_string()))
}

/// The block types [`Block`] reads: one of them read as [`Block::Other`]
/// is malformed.
const BLOCK_TYPES: [&str; 7] = [
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
];

/// A block chat cannot carry, at `at`: a 400 when its type is one
/// [`Block`] reads (so it was malformed), else it leaves the request to an
/// Anthropic target.
fn other_block(
    kind: &str,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<(), Invalid> {
    unread_type(kind, &BLOCK_TYPES, "block", at, untranslated)
}

/// A `what` (block, source) of type `kind` that did not read as one of
/// `known`: malformed if its type is one of them, else Anthropic's alone.
fn unread_type(
    kind: &str,
    known: &[&str],
    what: &str,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<(), Invalid> {
    if known.contains(&kind) {
        return Err(Invalid::field(
            at,
            format!("a `{kind}` {what} is missing a field or has one of the wrong type"),
        ));
    }
    untranslated.get_or_insert_with(|| {
        only_anthropic(format!("{at}.type"), &format!("a {what} of type `{kind}`"))
    });
    Ok(())
}

/// What chat cannot carry, at `param`: only an Anthropic target can serve it.
fn only_anthropic(param: String, what: &str) -> Untranslatable {
    let why = format!("{what} ({param}) runs only on a target that speaks Anthropic Messages");
    Untranslatable { param, why }
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Source {
    Base64 {
        media_type: String,
        data: String,
    },
    Url {
        url: String,
    },
    Text {
        data: String,
    },
    /// A file id, custom content, or a type to come: Anthropic's alone.
    #[serde(untagged)]
    Other {
        #[serde(rename = "type")]
        kind: String,
    },
}

#[derive(Deserialize)]
struct Tool {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    /// Every custom tool has one; some server tools (an MCP toolset) do not.
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
    /// Strict tool use: the call's input follows the schema exactly.
    #[serde(default)]
    strict: Option<bool>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ToolChoice {
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    Any {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    None {},
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

/// A request asks for something: at least one token, of at least one message.
///
/// # Errors
/// `max_tokens` of 0, or no messages.
fn not_empty(request: &Request<'_>) -> Result<(), Invalid> {
    if request.max_tokens == 0 {
        return Err(Invalid::field(
            "max_tokens",
            "`max_tokens` must be at least 1",
        ));
    }
    if request.messages.is_empty() {
        return Err(Invalid::field(
            "messages",
            "at least one message is required",
        ));
    }
    Ok(())
}

/// Translates a Messages request into the chat request the engine runs.
///
/// # Errors
/// The first field that is missing, of the wrong type, or that no chat
/// request can carry.
pub fn translate(body: &[u8]) -> Result<Translated, Invalid> {
    let request: Request<'_> = Invalid::parse(body)?;
    let model = model_text(request.model)?;
    not_empty(&request)?;
    let stream = request.stream.unwrap_or(false);
    let mut untranslatable = None;
    let mut tools = None;
    if let Some(defs) = &request.tools {
        let (functions, server) = chat_tools(defs)?;
        untranslatable = server;
        tools = Some(functions).filter(|f| !f.is_empty());
    }
    if request
        .mcp_servers
        .is_some_and(|m| !matches!(m.get(), "null" | "[]"))
    {
        untranslatable.get_or_insert_with(|| {
            only_anthropic("mcp_servers".into(), "the MCP connector (`mcp_servers`)")
        });
    }
    let mut messages = chat_messages(
        request.system.as_ref(),
        &request.messages,
        &mut untranslatable,
    )?;
    if messages.is_empty() {
        if untranslatable.is_none() {
            return Err(Invalid::field(
                "messages",
                "the messages say nothing a model reads (only thinking blocks)",
            ));
        }
        // All it says is Anthropic's alone: no chat target gets this body,
        // but the engine may read it (a chat request has a message).
        messages.push(json!({"role": "user", "content": ""}));
    }
    // A choice among server tools alone is the Anthropic target's to make.
    let choice = request
        .tool_choice
        .as_ref()
        .filter(|_| tools.is_some())
        .map(chat_tool_choice);
    // A thinking block with no signature (another provider's reasoning,
    // rendered by switchyard) is one Anthropic refuses: its targets get the
    // body without it.
    let native = unsigned_thinking(&request.messages)
        .then(|| without_unsigned_thinking(body))
        .flatten();
    let model_at = match native {
        Some(_) => crate::native::ModelAt::Unread,
        None => crate::request::model_at(body, request.model),
    };
    let response_format = response_format(&request)?;
    let chat = ChatBody {
        model: model.clone(),
        messages: super::ChatMessages::of(messages),
        max_tokens: Some(request.max_tokens),
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
        temperature: request.temperature,
        top_p: request.top_p,
        stop: request.stop_sequences.filter(|s| !s.is_empty()),
        tools,
        parallel_tool_calls: choice
            .as_ref()
            .and_then(|(_, parallel)| (!parallel).then_some(false)),
        tool_choice: choice.map(|(choice, _)| choice),
        user: request.metadata.and_then(|m| m.user_id),
        response_format,
        ..ChatBody::default()
    };
    let (mut facts, chat) = chat.deferred();
    // A structured-outputs format needs no `json_mode` tag: an Anthropic
    // target reads it as sent (and carries no such tag), a chat target gets
    // it as `response_format`.
    facts.json_native = facts.json_mode;
    Ok(Translated {
        chat,
        facts,
        native,
        model_at,
        stream,
        render: Render::Messages(Reply {
            model: model.unwrap_or_default(),
        }),
        untranslatable,
    })
}

/// The chat request whose prompt `count_tokens` estimates.
///
/// # Errors
/// As [`translate`].
pub fn count_request(body: &[u8]) -> Result<Bytes, Invalid> {
    let request: CountRequest = Invalid::parse(body)?;
    let mut chat = json!({
        // An estimate counts what chat can carry.
        "messages": chat_messages(request.system.as_ref(), &request.messages, &mut None)?,
    });
    if let Some(model) = request.model {
        chat["model"] = json!(model);
    }
    if let Some(tools) = &request.tools {
        chat["tools"] = Value::Array(chat_tools(tools)?.0);
    }
    Ok(Bytes::from(chat.to_string()))
}

/// The system prompt and the turns, as chat messages: a user turn's tool
/// results become `tool` messages (first, as chat wants them right after
/// the call), an assistant turn's `tool_use` blocks its `tool_calls`.
/// The system prompt and the messages as chat messages; the first block
/// chat cannot carry is named in `untranslated`.
fn chat_messages(
    system: Option<&System>,
    messages: &[Message],
    untranslated: &mut Option<Untranslatable>,
) -> Result<Vec<Value>, Invalid> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        Some(System::Text(text)) => out.push(json!({"role": "system", "content": text})),
        Some(System::Blocks(blocks)) if !blocks.is_empty() => {
            let text: Vec<&str> = blocks.iter().map(|b| b.text.as_str()).collect();
            out.push(json!({"role": "system", "content": text.join("\n\n")}));
        }
        Some(System::Blocks(_)) | None => {}
    }
    for (i, message) in messages.iter().enumerate() {
        let at = || format!("messages[{i}].content");
        match (&message.content, message.role) {
            (Content::Text(text), role) => {
                out.push(json!({"role": role_name(role), "content": text}));
            }
            (Content::Blocks(blocks), Role::User) => {
                user_turn(blocks, &at(), &mut out, untranslated)?;
            }
            (Content::Blocks(blocks), Role::Assistant) => {
                out.push(assistant_turn(blocks, &at(), untranslated)?);
            }
        }
    }
    Ok(out)
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::User => "user",
        Role::Assistant => "assistant",
    }
}

fn user_turn(
    blocks: &[Block],
    at: &str,
    out: &mut Vec<Value>,
    untranslated: &mut Option<Untranslatable>,
) -> Result<(), Invalid> {
    let mut parts = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}[{j}]");
        match block {
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
            } => {
                let (text, images) = tool_result(content.as_ref(), &at, untranslated)?;
                // Chat has no error flag on a tool result: the text says it.
                let text = if *is_error {
                    format!("Error: {text}")
                } else {
                    text
                };
                out.push(json!({"role": "tool", "tool_call_id": tool_use_id, "content": text}));
                parts.extend(images);
            }
            other @ (Block::Text { .. }
            | Block::Image { .. }
            | Block::Document { .. }
            | Block::ToolUse { .. }
            | Block::Thinking { .. }
            | Block::RedactedThinking {}
            | Block::Other { .. }) => parts.extend(user_part(other, &at, untranslated)?),
        }
    }
    if !parts.is_empty() {
        out.push(json!({"role": "user", "content": parts}));
    }
    Ok(())
}

/// A user block as a chat content part; `None` for what carries nothing a
/// chat target reads (a thinking block), or what it cannot read.
fn user_part(
    block: &Block,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<Option<Value>, Invalid> {
    Ok(match block {
        Block::Text { text } => Some(json!({"type": "text", "text": text})),
        Block::Image { source } => image_part(source, &format!("{at}.source"), untranslated)?,
        Block::Document { source, title } => {
            document_part(source, title.as_deref(), at, untranslated)?
        }
        Block::Thinking { .. } | Block::RedactedThinking {} | Block::ToolResult { .. } => None,
        Block::ToolUse { .. } => {
            return Err(Invalid::field(
                format!("{at}.type"),
                "`tool_use` blocks belong in an assistant turn",
            ))
        }
        Block::Other { kind } => {
            other_block(kind, at, untranslated)?;
            None
        }
    })
}

/// The source types [`Source`] reads: one of them read as
/// [`Source::Other`] is malformed.
const SOURCE_TYPES: [&str; 3] = ["base64", "url", "text"];

/// A source chat cannot carry, at `at` (the source): as [`other_block`].
fn other_source(
    kind: &str,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<(), Invalid> {
    unread_type(kind, &SOURCE_TYPES, "source", at, untranslated)
}

fn image_part(
    source: &Source,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<Option<Value>, Invalid> {
    let url = match source {
        Source::Base64 { media_type, data } => format!("data:{media_type};base64,{data}"),
        Source::Url { url } => url.clone(),
        Source::Text { .. } => {
            return Err(Invalid::field(
                format!("{at}.type"),
                "an image source is `base64`, `url` or `file`",
            ))
        }
        Source::Other { kind } => {
            other_source(kind, at, untranslated)?;
            return Ok(None);
        }
    };
    Ok(Some(
        json!({"type": "image_url", "image_url": {"url": url}}),
    ))
}

fn document_part(
    source: &Source,
    title: Option<&str>,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<Option<Value>, Invalid> {
    Ok(match source {
        Source::Base64 { media_type, data } => Some(json!({"type": "file", "file": {
            "filename": title.unwrap_or("document.pdf"),
            "file_data": format!("data:{media_type};base64,{data}"),
        }})),
        Source::Text { data } => Some(json!({"type": "text", "text": data})),
        // A chat target cannot fetch a URL.
        Source::Url { .. } => {
            untranslated.get_or_insert_with(|| {
                only_anthropic(format!("{at}.source.type"), "a document by `url`")
            });
            None
        }
        Source::Other { kind } => {
            other_source(kind, &format!("{at}.source"), untranslated)?;
            None
        }
    })
}

/// A tool result's text, and its images as user parts.
fn tool_result(
    content: Option<&Content>,
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<(String, Vec<Value>), Invalid> {
    let blocks = match content {
        None => return Ok((String::new(), Vec::new())),
        Some(Content::Text(text)) => return Ok((text.clone(), Vec::new())),
        Some(Content::Blocks(blocks)) => blocks,
    };
    let (mut text, mut images) = (Vec::new(), Vec::new());
    for (k, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{k}]");
        match block {
            Block::Text { text: t } => text.push(t.as_str()),
            Block::Image { source } => {
                images.extend(image_part(source, &format!("{at}.source"), untranslated)?);
            }
            Block::Document { source, title } => {
                images.extend(document_part(source, title.as_deref(), &at, untranslated)?);
            }
            Block::Other { kind } => other_block(kind, &at, untranslated)?,
            Block::ToolUse { .. }
            | Block::ToolResult { .. }
            | Block::Thinking { .. }
            | Block::RedactedThinking {} => {
                return Err(Invalid::field(
                    format!("{at}.type"),
                    "a tool result holds text, image, document and search result blocks",
                ))
            }
        }
    }
    Ok((text.join("\n"), images))
}

fn assistant_turn(
    blocks: &[Block],
    at: &str,
    untranslated: &mut Option<Untranslatable>,
) -> Result<Value, Invalid> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        match block {
            Block::Text { text: t } => text.push_str(t),
            Block::ToolUse { id, name, input } => calls.push(json!({
                "id": id, "type": "function",
                "function": {"name": name, "arguments": input.to_string()},
            })),
            Block::Other { kind } => other_block(kind, &format!("{at}[{j}]"), untranslated)?,
            Block::ToolResult { .. } => {
                return Err(Invalid::field(
                    format!("{at}[{j}].type"),
                    "`tool_result` blocks belong in a user turn",
                ))
            }
            // Earlier thinking cannot be given back to a chat target.
            Block::Thinking { .. }
            | Block::RedactedThinking {}
            | Block::Image { .. }
            | Block::Document { .. } => {}
        }
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    Ok(message)
}

/// The custom tools as chat tools, and what leaving out a server tool (only
/// an Anthropic target runs one) makes the request for other targets.
fn chat_tools(tools: &[Tool]) -> Result<(Vec<Value>, Option<Untranslatable>), Invalid> {
    let mut server = None;
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        if let Some(kind) = tool.kind.as_deref().filter(|k| *k != "custom") {
            server.get_or_insert_with(|| {
                only_anthropic(format!("tools[{i}].type"), &format!("server tool `{kind}`"))
            });
            continue;
        }
        let Some(name) = tool.name.as_deref().filter(|n| !n.is_empty()) else {
            return Err(Invalid::field(
                format!("tools[{i}].name"),
                "a tool needs a name",
            ));
        };
        let mut function = json!({
            "name": name,
            "parameters": tool.input_schema.clone().unwrap_or_else(|| json!({"type": "object"})),
        });
        if let Some(d) = &tool.description {
            function["description"] = json!(d);
        }
        if let Some(strict) = tool.strict {
            function["strict"] = json!(strict);
        }
        functions.push(json!({"type": "function", "function": function}));
    }
    Ok((functions, server))
}

/// The chat `tool_choice`, and whether parallel calls stay allowed.
fn chat_tool_choice(choice: &ToolChoice) -> (Value, bool) {
    match choice {
        ToolChoice::Auto {
            disable_parallel_tool_use,
        } => (json!("auto"), !disable_parallel_tool_use),
        ToolChoice::Any {
            disable_parallel_tool_use,
        } => (json!("required"), !disable_parallel_tool_use),
        ToolChoice::Tool {
            name,
            disable_parallel_tool_use,
        } => (
            json!({"type": "function", "function": {"name": name}}),
            !disable_parallel_tool_use,
        ),
        ToolChoice::None {} => (json!("none"), true),
    }
}

/// What rendering a Messages answer needs of its request.
#[derive(Debug)]
pub struct Reply {
    /// The model the client asked for (when the answer names none).
    model: String,
}

/// Anthropic's `stop_reason` for a chat finish; an answer with a tool call
/// stops for it whatever its server called the finish (some say `stop`).
fn stop_reason(finish: Option<Finish>, called: bool) -> Value {
    match finish {
        Some(Finish::Stop) | None if called => json!("tool_use"),
        Some(Finish::Stop) | None => json!("end_turn"),
        Some(Finish::Length) => json!("max_tokens"),
        // A client that trusts `tool_use` looks for the call: without one
        // the turn simply ended.
        Some(Finish::ToolCalls) if called => json!("tool_use"),
        Some(Finish::ToolCalls) => json!("end_turn"),
        Some(Finish::ContentFilter) => json!("refusal"),
    }
}

fn usage_of(usage: Option<&Usage>) -> Value {
    let u = usage.copied().unwrap_or_default();
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached()),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached(),
        "cache_creation_input_tokens": 0,
    })
}

fn message_id(chat_id: &str) -> String {
    match chat_id.strip_prefix("chatcmpl-") {
        Some(rest) if !rest.is_empty() => format!("msg_{rest}"),
        Some(_) | None => fresh_id("msg_"),
    }
}

impl Reply {
    /// A chat completion as a Messages answer.
    #[must_use]
    pub fn answer(&self, bytes: &[u8]) -> Bytes {
        let completion: Completion = serde_json::from_slice(bytes).unwrap_or_default();
        let choice = completion.choices.first();
        let mut content = Vec::new();
        if let Some(message) = choice.map(|c| &c.message) {
            if let Some(thinking) = message.reasoning() {
                content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
            }
            let text = message.content.as_deref().or(message.refusal.as_deref());
            if let Some(text) = text.filter(|t| !t.is_empty()) {
                content.push(json!({"type": "text", "text": text}));
            }
            for call in &message.tool_calls {
                content.push(json!({
                    "type": "tool_use", "id": tool_use_id(&call.id), "name": call.function.name,
                    "input": tool_input(&call.function.arguments),
                }));
            }
        }
        let called = choice.is_some_and(|c| !c.message.tool_calls.is_empty());
        let finish = Finish::of(choice.and_then(|c| c.finish_reason.as_deref()));
        Bytes::from(
            json!({
                "id": message_id(&completion.id),
                "type": "message",
                "role": "assistant",
                "model": self.model_of(&completion.model),
                "content": content,
                "stop_reason": stop_reason(finish, called),
                "stop_sequence": null,
                "usage": usage_of(completion.usage.as_ref()),
            })
            .to_string(),
        )
    }

    fn model_of(&self, answered: &str) -> String {
        if answered.is_empty() {
            self.model.clone()
        } else {
            answered.to_owned()
        }
    }

    /// The renderer of this request's stream.
    #[must_use]
    pub fn stream(self) -> StreamReply {
        StreamReply {
            reply: self,
            started: false,
            open: None,
            blocks: 0,
            live: None,
            held: Vec::new(),
            called: false,
            finish: None,
            usage: None,
            ended: false,
            native_index: None,
            delta_sent: false,
            slots: crate::sse::CallSlots::default(),
            held_text: String::new(),
            prompt_estimate: 0,
        }
    }
}

/// A call's id, made when its server gave none (a `tool_result` must name
/// it), in Anthropic's grammar: the client sends it back, and an Anthropic
/// target refuses an id of another provider's making (`functions.Bash:0`).
fn tool_use_id(id: &str) -> Cow<'_, str> {
    if id.is_empty() {
        Cow::Owned(fresh_id("toolu_"))
    } else {
        crate::native::tool_use_id(id)
    }
}

/// Tool arguments as the `input` object. Anthropic's `input` is always an
/// object (a client sends the block back as it got it): arguments that are
/// not a JSON object are `{}`, as a streamed call's are once the SDK reads
/// them whole. A task that must not lose them declares a tool-call contract.
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(input @ Value::Object(_)) => input,
        Ok(_) | Err(_) => json!({}),
    }
}

/// The block being streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
    /// A tool call, by its chat index.
    Tool(u32),
    /// A block the upstream opened that chat has no kind for (a tool use,
    /// a server tool's result).
    Upstream,
}

/// A Messages stream rendered from the chat stream.
#[derive(Debug)]
pub struct StreamReply {
    reply: Reply,
    started: bool,
    open: Option<Open>,
    /// Blocks started so far (the next block's index).
    blocks: u64,
    /// The tool call streamed as it comes (its chat index), in the open block.
    live: Option<u32>,
    /// The other calls, kept whole until the answer ends: chat may
    /// interleave calls' fragments, and a Messages block once closed takes
    /// no more.
    held: Vec<HeldCall>,
    /// A tool call went out.
    called: bool,
    finish: Option<Finish>,
    usage: Option<Usage>,
    ended: bool,
    /// The upstream's index of the open block, when the upstream opened it.
    native_index: Option<u64>,
    /// The upstream's own `message_delta` went out.
    delta_sent: bool,
    /// Which call each tool-call fragment belongs to.
    slots: crate::sse::CallSlots,
    /// Text that came while a call's block was open: a Messages block once
    /// closed takes no more, so it waits for the calls to end.
    held_text: String,
    /// The prompt's tokens as switchyard estimates them: `message_start`
    /// says them before the answer (clients show a context meter with
    /// them); the upstream's count follows in `message_delta`.
    pub(super) prompt_estimate: u64,
}

/// A tool call kept until its block can go out whole.
#[derive(Debug)]
struct HeldCall {
    /// Its chat index.
    index: u32,
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

/// What the stream state needs of an upstream Messages event.
#[derive(Deserialize)]
struct EventHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    index: Option<u64>,
    content_block: Option<BlockHead<'a>>,
}

#[derive(Deserialize)]
struct BlockHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
}

impl<'a> EventHead<'a> {
    /// An event's head, read by a scan (the event of every token), else by
    /// serde when the scan leaves it (an escape, a type it does not take).
    fn read(data: &'a str) -> Option<Self> {
        let delta = crate::native::messages_text_delta(data).map(|(index, _)| Self {
            kind: Cow::Borrowed("content_block_delta"),
            index: Some(index),
            content_block: None,
        });
        delta
            .or_else(|| Self::scan(data))
            .or_else(|| serde_json::from_str(data).ok())
    }

    fn scan(data: &'a str) -> Option<Self> {
        let [kind, index, block] = scan::fields(data, ["type", "index", "content_block"])?;
        let kind = scan::plain_str(kind)??;
        let index = scan::plain_u64(index)?;
        let content_block = match block {
            None | Some("null") => None,
            Some(block) => {
                let [block_kind] = scan::fields(block, ["type"])?;
                Some(BlockHead {
                    kind: Cow::Borrowed(scan::plain_str(block_kind)??),
                })
            }
        };
        Some(Self {
            kind: Cow::Borrowed(kind),
            index,
            content_block,
        })
    }
}

impl StreamReply {
    /// An upstream Messages event (its target speaks Messages), written as
    /// it came. The state follows it, so that what another target adds
    /// after a break (rendered from chat) carries on from it.
    pub(super) fn native(&mut self, data: &str, raw: &[u8], out: &mut BytesMut) {
        let Some(head) = EventHead::read(data) else {
            return;
        };
        if self.ended {
            return;
        }
        let ours = |s: &Self| s.open.is_some() && s.native_index == head.index;
        match head.kind.as_ref() {
            "message_start" if self.started => return,
            "message_start" => self.started = true,
            "content_block_start" => {
                self.close(out);
                let index = head.index.unwrap_or(self.blocks);
                self.open = Some(match head.content_block.as_ref().map(|b| b.kind.as_ref()) {
                    Some("text") => Open::Text,
                    Some("thinking") => Open::Thinking,
                    _ => Open::Upstream,
                });
                self.native_index = Some(index);
                // The upstream's index, whatever it is: the next block follows it.
                self.blocks = index.saturating_add(1);
            }
            // A block closed here (a repaired call rendered instead) takes no more.
            "content_block_delta" if !ours(self) => return,
            "content_block_stop" if !ours(self) => return,
            "content_block_stop" => {
                self.open = None;
                self.native_index = None;
            }
            "message_delta" => {
                self.close(out);
                self.delta_sent = true;
            }
            "message_stop" => {
                self.close(out);
                self.ended = true;
            }
            // `ping`, a delta of its block, and what switchyard does not know.
            _ => {}
        }
        out.extend_from_slice(raw);
    }

    fn start(&mut self, chunk: &Chunk, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        let message = json!({
            "id": message_id(&chunk.id), "type": "message", "role": "assistant",
            "model": self.reply.model_of(&chunk.model), "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_estimate, "output_tokens": 0},
        });
        write_event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": message}),
        );
        write_event(out, "ping", &json!({"type": "ping"}));
    }

    /// Opens `block` (closing the one before) unless it is the open one.
    fn open(&mut self, block: Open, start: Value, out: &mut BytesMut) {
        if self.open == Some(block) {
            return;
        }
        self.close(out);
        self.open = Some(block);
        write_event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.blocks, "content_block": start}),
        );
        self.blocks = self.blocks.saturating_add(1);
    }

    fn close(&mut self, out: &mut BytesMut) {
        self.native_index = None;
        if self.open.take().is_some() {
            let index = self.blocks.saturating_sub(1);
            write_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    fn delta(&self, delta: Value, out: &mut BytesMut) {
        let index = self.blocks.saturating_sub(1);
        write_event(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    pub(super) fn chunk(&mut self, chunk: &Chunk, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        self.start(chunk, out);
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        // Messages has one answer: choice 0.
        let Some(choice) = chunk.choices.iter().find(|c| c.index == 0) else {
            return;
        };
        let delta = &choice.delta;
        if let Some(t) = delta.reasoning() {
            let start = json!({"type": "thinking", "thinking": "", "signature": ""});
            self.open(Open::Thinking, start, out);
            self.delta(json!({"type": "thinking_delta", "thinking": t}), out);
        }
        let text = delta.content.as_deref().or(delta.refusal.as_deref());
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            if matches!(self.open, Some(Open::Tool(_))) {
                self.held_text.push_str(t);
            } else {
                self.open(Open::Text, json!({"type": "text", "text": ""}), out);
                self.delta(json!({"type": "text_delta", "text": t}), out);
            }
        }
        for call in &delta.tool_calls {
            self.tool_fragment(call, out);
        }
        if let Some(finish) = Finish::of(choice.finish_reason.as_deref()) {
            self.finish = Some(finish);
        }
    }

    /// One fragment of a chat tool call: the live call's arguments go out as
    /// they come; any other call is kept, and the first one kept goes live
    /// once its name is known and no block of another call is open.
    fn tool_fragment(&mut self, call: &super::ToolCallDelta, out: &mut BytesMut) {
        let args = call.function.arguments.as_deref().unwrap_or_default();
        let index = self.slots.slot(call.index, call.id.as_deref());
        if self.live == Some(index) && self.open == Some(Open::Tool(index)) {
            if !args.is_empty() {
                self.delta(
                    json!({"type": "input_json_delta", "partial_json": args}),
                    out,
                );
            }
            return;
        }
        let held = match self.held.iter().position(|h| h.index == index) {
            Some(at) => &mut self.held[at],
            None => {
                self.held.push(HeldCall {
                    index,
                    id: None,
                    name: None,
                    arguments: String::new(),
                });
                let last = self.held.len() - 1;
                &mut self.held[last]
            }
        };
        // An id or a name may come in a later fragment than the first.
        if held.id.is_none() {
            held.id.clone_from(&call.id);
        }
        if held.name.is_none() {
            held.name = call.function.name.clone().filter(|n| !n.is_empty());
        }
        held.arguments.push_str(args);
        let ready = self.live.is_none() && self.held.first().is_some_and(|h| h.name.is_some());
        if ready {
            let first = self.held.remove(0);
            self.live = Some(first.index);
            self.send_call(first, false, out);
        }
    }

    /// A call's block: opened, with what it has of its arguments; closed too
    /// when `whole`.
    fn send_call(&mut self, call: HeldCall, whole: bool, out: &mut BytesMut) {
        let id = call.id.unwrap_or_default();
        let start = json!({"type": "tool_use", "id": tool_use_id(&id),
            "name": call.name.unwrap_or_default(), "input": {}});
        self.open(Open::Tool(call.index), start, out);
        self.called = true;
        if !call.arguments.is_empty() {
            let delta = json!({"type": "input_json_delta", "partial_json": call.arguments});
            self.delta(delta, out);
        }
        if whole {
            self.close(out);
        }
    }

    /// The calls kept back, each as a whole block, after the open one; then
    /// the text that came while a call's block was open.
    fn send_held(&mut self, out: &mut BytesMut) {
        self.close(out);
        for call in std::mem::take(&mut self.held) {
            self.send_call(call, true, out);
        }
        if !self.held_text.is_empty() {
            let text = std::mem::take(&mut self.held_text);
            self.open(Open::Text, json!({"type": "text", "text": ""}), out);
            self.delta(json!({"type": "text_delta", "text": text}), out);
            self.close(out);
        }
    }

    pub(super) fn done(&mut self, out: &mut BytesMut) {
        if self.ended || !self.started {
            return;
        }
        self.ended = true;
        self.send_held(out);
        if self.delta_sent {
            write_event(out, "message_stop", &json!({"type": "message_stop"}));
            return;
        }
        let mut usage = usage_of(self.usage.as_ref());
        if self.usage.is_none() {
            usage = json!({"output_tokens": 0});
        }
        write_event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(self.finish, self.called), "stop_sequence": null},
                "usage": usage}),
        );
        write_event(out, "message_stop", &json!({"type": "message_stop"}));
    }

    pub(super) fn error(&mut self, error: &WireError, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        self.ended = true;
        let kind = match (error.code(), error.status.map(StatusCode::from_u16)) {
            // The upstream's own error broke it: its kind, as Anthropic names it.
            (Some("stream_interrupted"), Some(Ok(status))) => error_type(None, status),
            (Some("stream_interrupted"), _) => "api_error",
            _ => error_type(error.kind.as_deref(), StatusCode::BAD_GATEWAY),
        };
        write_event(
            out,
            "error",
            &json!({"type": "error", "error": {"type": kind, "message": error.message}}),
        );
    }
}

/// Anthropic's error `type` for a status (and OpenAI's type, where it says more).
fn error_type(openai_type: Option<&str>, status: StatusCode) -> &'static str {
    if openai_type == Some("rate_limit_error") {
        return "rate_limit_error";
    }
    match status.as_u16() {
        400 | 405 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// An error body (OpenAI's envelope, from the engine) in Anthropic's.
#[must_use]
pub fn error(status: StatusCode, bytes: &[u8]) -> Bytes {
    let wire = serde_json::from_slice::<super::ErrorEnvelope>(bytes)
        .map(|e| e.error)
        .unwrap_or_else(|_| WireError {
            message: String::from_utf8_lossy(bytes).chars().take(500).collect(),
            ..WireError::default()
        });
    envelope(error_type(wire.kind.as_deref(), status), &wire.message)
}

/// A refused request in Anthropic's envelope.
#[must_use]
pub fn invalid(e: &Invalid) -> Bytes {
    envelope("invalid_request_error", &e.to_string())
}

fn envelope(kind: &str, message: &str) -> Bytes {
    Bytes::from(json!({"type": "error", "error": {"type": kind, "message": message}}).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_structured_output_is_held_to_by_the_contract_but_asks_no_json_mode_tag() {
        let body = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],
            "output_config":{"format":{"type":"json_schema","schema":{"type":"object"}}}}"#;
        let t = translate(body).ok().unwrap();
        assert!(t.facts.json_mode && t.facts.json_native);
        assert!(!crate::routing::Needs::of(&t.facts).json_mode);
        let plain = translate(
            br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .ok()
        .unwrap();
        assert!(!plain.facts.json_mode && !plain.facts.json_native);
    }

    #[test]
    fn a_strict_tool_stays_strict_for_a_chat_target() {
        let body = br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],
            "tools":[{"name":"f","input_schema":{"type":"object"},"strict":true},{"name":"g"}]}"#;
        let t = translate(body).ok().unwrap();
        let chat: Value = serde_json::from_slice(t.chat.bytes()).unwrap();
        assert_eq!(chat["tools"][0]["function"]["strict"], true, "{chat}");
        assert!(
            chat["tools"][1]["function"].get("strict").is_none(),
            "{chat}"
        );
    }

    #[test]
    fn broken_json_is_refused_as_the_body_not_as_the_last_field_read() {
        let store = super::super::ResponseStore::default();
        let messages = translate(br#"{"model":"m","max_tokens":5,"messa"#)
            .err()
            .unwrap();
        let responses = super::super::responses::translate(br#"{"model":"m","input":"hi"#, &store)
            .err()
            .unwrap();
        for e in [messages, responses] {
            assert_eq!(e.param, "body", "{e:?}");
            assert!(e.message.starts_with("the body is not valid JSON"), "{e:?}");
        }
        let wrong_type = translate(br#"{"model":"m","max_tokens":"5","messages":[]}"#)
            .err()
            .unwrap();
        assert_eq!(wrong_type.param, "max_tokens");
    }

    #[test]
    fn a_tool_input_is_always_an_object_and_tool_use_needs_a_call() {
        assert_eq!(tool_input(r#"{"a": [1]}"#), json!({"a": [1]}));
        for not_an_object in ["", "  ", r#"{"a": tru"#, "[1]", r#""s""#, "null", "7"] {
            assert_eq!(tool_input(not_an_object), json!({}), "{not_an_object}");
        }
        assert_eq!(
            stop_reason(Some(Finish::ToolCalls), true),
            json!("tool_use")
        );
        assert_eq!(stop_reason(Some(Finish::Stop), true), json!("tool_use"));
        assert_eq!(stop_reason(None, true), json!("tool_use"));
        assert_eq!(
            stop_reason(Some(Finish::ToolCalls), false),
            json!("end_turn")
        );
    }

    #[test]
    fn the_models_place_is_read_with_the_body_and_the_rewrite_uses_it() {
        let messages = r#""max_tokens":1,"messages":[{"role":"user","content":"hi"}]"#;
        for model in [
            r#""model":"a","#,
            r#""model" : "a\"b" ,"#,
            r#""model":null,"#,
            "",
        ] {
            let body = format!("{{{model}{messages}}}");
            let t = translate(body.as_bytes()).unwrap();
            assert_ne!(t.model_at, crate::native::ModelAt::Unread, "{body}");
            let by_place = crate::request::object_with_model_at(body.as_bytes(), &t.model_at, "up");
            let by_reading = crate::request::object_with_model(body.as_bytes(), "up");
            assert_eq!(by_place, by_reading, "{body}");
            let sent: Value = serde_json::from_slice(&by_place.unwrap()).unwrap();
            assert_eq!(sent["model"], "up");
        }
        let e = translate(format!(r#"{{"model":5,{messages}}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.param, "model");
        assert!(e.message.contains("expected a string"), "{}", e.message);
    }

    #[test]
    fn an_event_head_read_by_the_scan_reads_as_serde_reads_it() {
        type Seen = Option<(String, Option<u64>, Option<String>)>;
        let seen = |head: Option<EventHead<'_>>| -> Seen {
            head.map(|h| {
                let block = h.content_block.map(|b| b.kind.into_owned());
                (h.kind.into_owned(), h.index, block)
            })
        };
        let events = [
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{"type":"thinking","thinking":""}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{"type":"t\u0065xt"}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":null}"#,
            r#"{"type":"content_block_stop","index":4294967296}"#,
            r#"{"type":"content_block_stop","index":"1"}"#,
            r#"{"type":"content_block_stop","index":null}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#,
            r#"{"type":"message_stop","type":"ping"}"#,
            r#"{"type":7}"#,
            r#"{"index":0}"#,
            r#"{"type":"ping"} {}"#,
            r#" {"type" : "ping" } "#,
            r#"{"type":"content_block_delta","index":3,"delta":{"type":"text_delta","text":"café ☕"}}"#,
            r#"{"type":"content_block_delta","index":4294967296,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":07,"delta":{"type":"text_delta","text":"x"}}"#,
        ];
        for event in events {
            let by_serde = seen(serde_json::from_str(event).ok());
            assert_eq!(seen(EventHead::read(event)), by_serde, "{event}");
            if let Some(scanned) = EventHead::scan(event) {
                assert_eq!(seen(Some(scanned)), by_serde, "{event}");
            }
        }
    }

    fn chat_of(body: &str) -> Value {
        serde_json::from_slice(translate(body.as_bytes()).unwrap().chat.bytes()).unwrap()
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_calls_and_tool_messages() {
        let chat = chat_of(
            r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":"weather?"},
            {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"checking"},{"type":"tool_use","id":"toolu_1","name":"get","input":{"q":1}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"sunny"}],"is_error":true},{"type":"text","text":"thanks"}]}],
            "tools":[{"name":"get","input_schema":{"type":"object"}}],
            "tool_choice":{"type":"any","disable_parallel_tool_use":true},"stream":true,"top_k":3}"#,
        );
        assert_eq!(
            chat["messages"][0],
            json!({"role":"system","content":"be brief"})
        );
        assert_eq!(chat["messages"][2]["content"], "checking");
        assert_eq!(
            chat["messages"][2]["tool_calls"][0]["function"]["arguments"],
            r#"{"q":1}"#
        );
        assert_eq!(
            chat["messages"][3],
            json!({"role":"tool","tool_call_id":"toolu_1","content":"Error: sunny"})
        );
        assert_eq!(chat["messages"][4]["content"][0]["text"], "thanks");
        assert_eq!(chat["tool_choice"], "required");
        assert_eq!(chat["parallel_tool_calls"], false);
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert!(chat.get("top_k").is_none());
    }

    #[test]
    fn the_sampling_and_stop_fields_carry_over_and_absent_ones_stay_absent() {
        let chat = chat_of(
            r#"{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"x"}],
            "temperature":0.5,"top_p":0.9,"stop_sequences":["END"],"metadata":{"user_id":"u1"}}"#,
        );
        let expected = json!({"model":"m","max_tokens":9,"messages":[{"role":"user","content":"x"}],
            "temperature":0.5,"top_p":0.9,"stop":["END"],"user":"u1"});
        assert_eq!(chat, expected);
        let chat = chat_of(
            r#"{"max_tokens":9,"messages":[{"role":"user","content":"x"}],"stop_sequences":[],"tool_choice":{"type":"auto"}}"#,
        );
        assert_eq!(
            chat,
            json!({"max_tokens":9,"messages":[{"role":"user","content":"x"}]})
        );
    }

    #[test]
    fn a_server_tool_is_left_for_an_anthropic_target_to_run() {
        let t = translate(
            br#"{"max_tokens":1,"messages":[{"role":"user","content":"x"}],"tool_choice":{"type":"any"},
                "tools":[{"type":"web_search_20250305","name":"web_search","max_uses":2}]}"#,
        )
        .unwrap();
        let why = t
            .untranslatable
            .expect("a server tool cannot be translated");
        assert_eq!(why.param, "tools[0].type");
        assert!(why.why.contains("web_search_20250305"), "{why:?}");
        // Chat targets are skipped for it; the chat body has no tool to choose.
        let chat: Value = serde_json::from_slice(t.chat.bytes()).unwrap();
        assert!(
            chat.get("tools").is_none() && chat.get("tool_choice").is_none(),
            "{chat}"
        );
        let plain = translate(br#"{"max_tokens":1,"messages":[{"role":"user","content":"x"}]}"#);
        assert_eq!(plain.unwrap().untranslatable, None);
    }

    #[test]
    fn what_chat_cannot_carry_is_refused_by_field() {
        let refuse = |body: &str| translate(body.as_bytes()).unwrap_err().param;
        assert_eq!(refuse(r#"{"model":"m","messages":[]}"#), "max_tokens");
        assert_eq!(refuse(r#"{"max_tokens":1}"#), "messages");
        assert_eq!(
            refuse(
                r#"{"max_tokens":1,"messages":[{"role":"user","content":"x"}],"tools":[{"input_schema":{}}]}"#
            ),
            "tools[0].name"
        );
        assert_eq!(
            refuse(r#"{"max_tokens":1,"messages":[{"role":"robot","content":"x"}]}"#),
            "messages[0].role"
        );
    }

    fn render(events: &[&str]) -> String {
        let mut r = Reply { model: "m".into() }.stream();
        let mut out = BytesMut::new();
        for e in events {
            let chunk: Chunk = serde_json::from_str(e).unwrap();
            r.chunk(&chunk, &mut out);
        }
        r.done(&mut out);
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn an_upstream_block_at_any_index_is_relayed_and_a_chat_piece_follows_it() {
        for index in [u64::from(u32::MAX), u64::from(u32::MAX) + 1, u64::MAX] {
            let mut r = Reply { model: "m".into() }.stream();
            let mut out = BytesMut::new();
            let events = [
                r#"{"type":"message_start","message":{"id":"msg_1","model":"m"}}"#.to_owned(),
                format!(
                    r#"{{"type":"content_block_start","index":{index},"content_block":{{"type":"text","text":""}}}}"#
                ),
                format!(
                    r#"{{"type":"content_block_delta","index":{index},"delta":{{"type":"text_delta","text":"Hi"}}}}"#
                ),
            ];
            let mut relayed = String::new();
            for data in &events {
                let raw = format!("event: e\ndata: {data}\n\n");
                r.native(data, raw.as_bytes(), &mut out);
                relayed.push_str(&raw);
            }
            assert_eq!(String::from_utf8(out.to_vec()).unwrap(), relayed, "{index}");
            // What another target adds after a break goes on in that block.
            let piece =
                r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"content":" more"}}]}"#;
            r.chunk(&serde_json::from_str(piece).unwrap(), &mut out);
            r.done(&mut out);
            let text = String::from_utf8(out.to_vec()).unwrap();
            assert!(
                text.contains(" more")
                    && text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_chat_stream_renders_as_anthropic_blocks() {
        let out = render(&[
            r#"{"id":"chatcmpl-1","model":"x","choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
            r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"get","arguments":"{\"a\""}}]}}]}"#,
            r#"{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]},"finish_reason":"tool_calls"}]}"#,
            r#"{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}"#,
        ]);
        let names: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(out.contains(r#""stop_reason":"tool_use""#), "{out}");
        assert!(out.contains(r#""output_tokens":3"#), "{out}");
        assert!(out.contains(r#""id":"msg_1""#), "{out}");
    }
}
