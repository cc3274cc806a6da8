//! What the translations from OpenAI chat into another protocol
//! (`anthropic`, `gemini`, `bedrock`) share: their error type and the
//! readers of a chat request's messages, so each translation holds only what
//! its protocol does differently.

use serde_json::{Map, Value};

use super::{non_null, Unsupported};

/// Errors translating between OpenAI chat and a target's protocol.
#[derive(Debug, thiserror::Error)]
pub enum TranslateError {
    /// The OpenAI request is malformed (the client's fault).
    // The client's 400 says "invalid request" already.
    #[error("{0}")]
    InvalidRequest(String),
    /// The OpenAI request uses something the target's protocol cannot
    /// express ([`TranslateError::refusal`] names the protocol).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// An assistant tool call's `arguments` is not a JSON object.
    #[error("tool call `{id}`: arguments are not a JSON object: {reason}")]
    ToolArguments {
        /// The tool call's id.
        id: String,
        /// Why the arguments were rejected.
        reason: String,
    },
    /// The upstream body or stream event is not valid JSON.
    #[error("upstream sent invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The upstream JSON is not the expected shape of its protocol.
    #[error("unexpected upstream response: {0}")]
    InvalidResponse(String),
    /// The upstream answered with its protocol's error body instead of an
    /// answer.
    #[error("upstream error ({kind}): {message}")]
    Upstream {
        /// The protocol's name for the error (`overloaded_error`,
        /// `RESOURCE_EXHAUSTED`).
        kind: String,
        /// The upstream's message.
        message: String,
    },
}

impl TranslateError {
    /// This error as an adapter's refusal of a request, naming the `api`
    /// that cannot express it.
    pub fn refusal(self, api: &str) -> Unsupported {
        match self {
            Self::Unsupported(what) => Unsupported(format!("not supported by {api}: {what}")),
            other @ (Self::InvalidRequest(_)
            | Self::ToolArguments { .. }
            | Self::Json(_)
            | Self::InvalidResponse(_)
            | Self::Upstream { .. }) => Unsupported(other.to_string()),
        }
    }
}

/// A malformed request.
pub fn invalid(msg: impl Into<String>) -> TranslateError {
    TranslateError::InvalidRequest(msg.into())
}

/// A request the target's protocol cannot express.
pub fn unsupported(msg: impl Into<String>) -> TranslateError {
    TranslateError::Unsupported(msg.into())
}

/// One turn of the target's conversation being built: a role and its
/// content blocks (or parts).
pub struct Turn {
    pub role: &'static str,
    pub blocks: Vec<Value>,
}

/// Each chat message with its place in the request (`messages[i]`) and
/// its role.
///
/// # Errors
/// A message that is not an object, or has no role.
pub fn messages_with_roles(
    messages: &[Value],
) -> impl Iterator<Item = Result<(String, &Map<String, Value>, &str), TranslateError>> {
    messages.iter().enumerate().map(|(i, message)| {
        let at = format!("messages[{i}]");
        let message = message
            .as_object()
            .ok_or_else(|| invalid(format!("{at} must be an object")))?;
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("{at}.role must be a string")))?;
        Ok((at, message, role))
    })
}

/// Appends blocks to the last turn if it has the same role, else starts a
/// turn: the three protocols want user and assistant turns to alternate.
/// Messages that end up with no content are skipped (all three reject them).
pub fn push_turn(turns: &mut Vec<Turn>, role: &'static str, blocks: Vec<Value>) {
    if blocks.is_empty() {
        return;
    }
    match turns.last_mut() {
        Some(last) if last.role == role => last.blocks.extend(blocks),
        Some(_) | None => turns.push(Turn { role, blocks }),
    }
}

/// The content parts of a message (a string counts as one text part).
///
/// # Errors
/// `content` is neither a string nor an array.
pub fn content_parts<'a>(
    content: Option<&'a Value>,
    at: &str,
) -> Result<Vec<&'a Value>, TranslateError> {
    match content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(s @ Value::String(_)) => Ok(vec![s]),
        Some(Value::Array(items)) => Ok(items.iter().collect()),
        Some(Value::Bool(_) | Value::Number(_) | Value::Object(_)) => Err(invalid(format!(
            "{at}.content must be a string or an array"
        ))),
    }
}

/// The part's type, and its text if it is a text or refusal part (or a bare
/// string).
///
/// # Errors
/// A part without a `type`, or a text part without its `text`.
pub fn part_kind<'a>(
    part: &'a Value,
    at: &str,
) -> Result<(&'a str, Option<&'a str>), TranslateError> {
    if let Some(s) = part.as_str() {
        return Ok(("text", Some(s)));
    }
    let kind = part
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}: content part without a `type`")))?;
    let text = match kind {
        "text" => Some(
            part.get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("{at}: text part without `text`")))?,
        ),
        "refusal" => part.get("refusal").and_then(Value::as_str),
        _ => None,
    };
    Ok((kind, text))
}

/// An `image_url` part's URL (`{"image_url":{"url":…}}`, or the older bare
/// string).
///
/// # Errors
/// The part has no URL.
pub fn image_url<'a>(part: &'a Value, at: &str) -> Result<&'a str, TranslateError> {
    let image = part.get("image_url");
    image
        .and_then(|i| i.get("url"))
        .or(image)
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}: image_url part without a url")))
}

/// A `data:` URL's media type and base64 payload.
///
/// # Errors
/// Not a data URL, or not base64 with a media type (all three protocols
/// take exactly that): unsupported; no `,`: malformed.
pub fn data_url<'a>(url: &'a str, at: &str) -> Result<(&'a str, &'a str), TranslateError> {
    let rest = url
        .strip_prefix("data:")
        .ok_or_else(|| unsupported(format!("{at}: a URL that is not a base64 data URL")))?;
    let (meta, data) = rest
        .split_once(',')
        .ok_or_else(|| invalid(format!("{at}: malformed data URL")))?;
    let mut params = meta.split(';');
    let media_type = params.next().unwrap_or_default();
    if media_type.is_empty() || !params.any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(unsupported(format!(
            "{at}: data URL that is not base64 with a media type"
        )));
    }
    Ok((media_type, data))
}

/// A `file` part's inline file (`{"file":{"file_data":"data:…;base64,…",
/// "filename":…}}`): its media type, base64 payload and file name.
///
/// # Errors
/// No `file`: malformed. An uploaded `file_id` (OpenAI's storage, which no
/// other provider reads) or a `file_data` that is not a base64 data URL:
/// unsupported.
pub fn inline_file<'a>(
    part: &'a Value,
    at: &str,
) -> Result<(&'a str, &'a str, Option<&'a str>), TranslateError> {
    let file = part
        .get("file")
        .ok_or_else(|| invalid(format!("{at}: file part without `file`")))?;
    let Some(url) = file.get("file_data").and_then(Value::as_str) else {
        return Err(unsupported(format!(
            "{at}: file without `file_data` (an uploaded `file_id`)"
        )));
    };
    let (media_type, data) = data_url(url, &format!("{at}.file.file_data"))?;
    Ok((
        media_type,
        data,
        file.get("filename").and_then(Value::as_str),
    ))
}

/// An assistant message's tool call, read.
pub struct ToolCall<'a> {
    pub id: &'a str,
    pub name: &'a str,
    /// The arguments as a JSON object (`{}` when they are empty).
    pub input: Value,
}

/// Reads an assistant message's tool call (`tool_calls[N]`, at `at`).
///
/// # Errors
/// No id or name (malformed), arguments that are not a JSON object
/// ([`TranslateError::ToolArguments`]), or a call that is not a function
/// call (unsupported).
pub fn tool_call<'a>(call: &'a Value, at: &str) -> Result<ToolCall<'a>, TranslateError> {
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.id must be a string")))?;
    let kind = call
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    if kind != "function" {
        return Err(unsupported(format!("{at}: tool call type `{kind}`")));
    }
    let (function, name) = named_function(call, at)?;
    let bad = |reason: String| TranslateError::ToolArguments {
        id: id.to_owned(),
        reason,
    };
    let input = match function.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).map_err(|e| bad(e.to_string()))?
        }
        Some(_) => return Err(bad("`arguments` is not a string".into())),
    };
    if !input.is_object() {
        return Err(bad("valid JSON but not an object".into()));
    }
    Ok(ToolCall { id, name, input })
}

/// A tool call's or a tool's `function`, and its name.
fn named_function<'a>(holder: &'a Value, at: &str) -> Result<(&'a Value, &'a str), TranslateError> {
    let function = holder
        .get("function")
        .ok_or_else(|| invalid(format!("{at}.function is missing")))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(format!("{at}.function.name must be a string")))?;
    Ok((function, name))
}

/// A function tool of the request, read.
pub struct FunctionTool<'a> {
    /// Where it is in the request (`tools[i]`).
    pub at: String,
    pub name: &'a str,
    pub description: Option<&'a str>,
    /// Its JSON Schema, when it has one (`null` counts as none).
    pub parameters: Option<&'a Value>,
}

/// Reads the request's `tools`: function tools only.
///
/// # Errors
/// `tools` is not an array, a tool has no function name, or its parameters
/// are not an object (malformed); a tool other than a function (unsupported).
pub fn function_tools(tools: &Value) -> Result<Vec<FunctionTool<'_>>, TranslateError> {
    let tools = tools
        .as_array()
        .ok_or_else(|| invalid("`tools` must be an array"))?;
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "function" {
            return Err(unsupported(format!("{at}: tool type `{kind}`")));
        }
        let (function, name) = named_function(tool, &at)?;
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => None,
            Some(p) if p.is_object() => Some(p),
            Some(_) => {
                return Err(invalid(format!(
                    "{at}.function.parameters must be an object"
                )))
            }
        };
        out.push(FunctionTool {
            at,
            name,
            description: function.get("description").and_then(Value::as_str),
            parameters,
        });
    }
    Ok(out)
}

/// The request's output limit: `max_completion_tokens`, else `max_tokens`.
///
/// # Errors
/// The limit is not a non-negative integer.
pub fn max_tokens(chat: &Map<String, Value>) -> Result<Option<u64>, TranslateError> {
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(v) = non_null(chat, key) {
            let n = v
                .as_u64()
                .ok_or_else(|| invalid(format!("`{key}` must be a non-negative integer")))?;
            return Ok(Some(n));
        }
    }
    Ok(None)
}

/// `stop` as a list of stop sequences; `None` when absent or empty.
///
/// # Errors
/// `stop` is neither a string nor a list of strings.
pub fn stop_sequences(chat: &Map<String, Value>) -> Result<Option<Value>, TranslateError> {
    let bad = || invalid("`stop` must be a string or a list of strings");
    let list = match non_null(chat, "stop") {
        None => return Ok(None),
        Some(Value::String(s)) => vec![Value::from(s.as_str())],
        Some(Value::Array(items)) => {
            if items.iter().any(|s| !s.is_string()) {
                return Err(bad());
            }
            items.clone()
        }
        Some(Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_)) => {
            return Err(bad())
        }
    };
    Ok((!list.is_empty()).then_some(Value::Array(list)))
}

/// Refuses what no translated protocol can answer: audio output and log
/// probabilities.
///
/// # Errors
/// The request asks for one of them.
pub fn refuse_untranslatable(chat: &Map<String, Value>) -> Result<(), TranslateError> {
    let audio_modality = non_null(chat, "modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|m| m.as_str() == Some("audio")));
    if audio_modality || non_null(chat, "audio").is_some() {
        return Err(unsupported(
            "audio output (`audio` / `modalities: [\"audio\"]`)",
        ));
    }
    if non_null(chat, "top_logprobs").is_some() {
        return Err(unsupported("`top_logprobs`"));
    }
    if non_null(chat, "logprobs").is_some_and(|v| v.as_bool() != Some(false)) {
        return Err(unsupported("`logprobs`"));
    }
    Ok(())
}

/// The OpenAI `chat.completion` a translated answer is written as.
pub mod wire {
    use serde::Serialize;

    use crate::upstream::chunk::Usage;

    #[derive(Serialize)]
    pub struct Completion<'a> {
        pub id: &'a str,
        pub object: &'static str,
        pub created: u64,
        pub model: &'a str,
        pub choices: &'a [Choice],
        // No counts is no `usage`, not zeros: the gateway then books its estimate.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub usage: Option<Usage>,
    }

    #[derive(Serialize)]
    pub struct Choice {
        pub index: u32,
        pub message: Message,
        pub logprobs: Option<()>,
        pub finish_reason: Option<&'static str>,
    }

    #[derive(Serialize)]
    pub struct Message {
        pub role: &'static str,
        pub content: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub reasoning_content: Option<String>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pub tool_calls: Vec<ToolCall>,
    }

    #[derive(Serialize)]
    pub struct ToolCall {
        pub id: String,
        #[serde(rename = "type")]
        pub kind: &'static str,
        pub function: Function,
    }

    #[derive(Serialize)]
    pub struct Function {
        pub name: String,
        pub arguments: String,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn turns_of_one_role_merge_and_empty_messages_vanish() {
        let mut turns = Vec::new();
        push_turn(&mut turns, "user", vec![json!(1)]);
        push_turn(&mut turns, "user", vec![json!(2)]);
        push_turn(&mut turns, "assistant", Vec::new());
        push_turn(&mut turns, "assistant", vec![json!(3)]);
        let shape: Vec<_> = turns.iter().map(|t| (t.role, t.blocks.len())).collect();
        assert_eq!(shape, [("user", 2), ("assistant", 1)]);
    }

    #[test]
    fn data_urls_are_read_or_refused_by_kind() {
        assert_eq!(
            data_url("data:image/png;base64,AAAA", "p").unwrap(),
            ("image/png", "AAAA")
        );
        for refused in ["data:image/png,AAAA", "data:;base64,AAAA", "gs://b/o.png"] {
            assert!(
                matches!(data_url(refused, "p"), Err(TranslateError::Unsupported(_))),
                "{refused}"
            );
        }
        assert!(matches!(
            data_url("data:image/png;base64", "p"),
            Err(TranslateError::InvalidRequest(_))
        ));
    }

    #[test]
    fn tool_call_arguments_must_be_an_object() {
        let call = |args: Value| json!({ "id": "c1", "type": "function", "function": { "name": "f", "arguments": args } });
        let object = call(json!("{\"a\":1}"));
        let read = tool_call(&object, "t").unwrap();
        assert_eq!(
            (read.id, read.name, read.input),
            ("c1", "f", json!({ "a": 1 }))
        );
        assert_eq!(tool_call(&call(json!(" ")), "t").unwrap().input, json!({}));
        for bad in [json!("[1]"), json!("{oops"), json!(7)] {
            assert!(matches!(
                tool_call(&call(bad), "t"),
                Err(TranslateError::ToolArguments { ref id, .. }) if id == "c1"
            ));
        }
        let custom = json!({ "id": "c1", "type": "custom", "custom": {} });
        assert!(matches!(
            tool_call(&custom, "t"),
            Err(TranslateError::Unsupported(_))
        ));
    }

    #[test]
    fn refusals_name_the_api_and_other_errors_keep_their_words() {
        let refused = unsupported("`n` = 2").refusal("the Gemini API");
        assert_eq!(refused.0, "not supported by the Gemini API: `n` = 2");
        assert_eq!(invalid("bad `stop`").refusal("x").0, "bad `stop`");
    }
}
