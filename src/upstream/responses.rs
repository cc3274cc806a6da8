//! OpenAI Responses (`POST {base_url}/responses`), the second API of an
//! `openai` provider declared with `responses: true`: only a Responses
//! client's request goes this way (as sent, `model` rewritten), and its
//! answer and events come back as sent beside their chat reading
//! ([`crate::native`]). Every other request to the provider is chat.

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::chunk::{Delta, Frame, Head, Usage};
use super::{Adapter, Malformed, StreamTranslator, TargetModel, Unsupported};
use crate::native::Protocol;
use crate::request::{ChatRequest, EmbeddingsRequest};
use crate::sse::scan;

/// The Responses road of an OpenAI provider.
#[derive(Debug)]
pub struct Responses;

impl Adapter for Responses {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn chat_path(&self) -> &'static str {
        "responses"
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

    fn native(&self) -> Option<Protocol> {
        Some(Protocol::Responses)
    }

    fn encode(
        &self,
        _request: &ChatRequest<'_>,
        _target: TargetModel<'_>,
    ) -> Result<Bytes, Unsupported> {
        // A Responses request goes as sent (`routing::Admission`), never
        // through a translation.
        Err(Unsupported(
            "only a Responses request goes to /responses".into(),
        ))
    }

    fn encode_embeddings(
        &self,
        _request: &EmbeddingsRequest<'_>,
        _model: &str,
    ) -> Result<Bytes, Unsupported> {
        Err(Unsupported("the Responses API has no embeddings".into()))
    }

    fn decode_answer(&self, body: Bytes, _model: &str) -> Result<Bytes, Malformed> {
        let response: Response<'_> =
            serde_json::from_slice(&body).map_err(|e| Malformed(format!("not a response: {e}")))?;
        completion_of(&response)
    }

    fn answer_facts<'a>(&self, body: &'a [u8]) -> Option<super::AnswerFacts<'a>> {
        let response: Response<'a> = serde_json::from_slice(body).ok()?;
        answerable(&response).ok()?;
        let usage = response.usage?;
        Some(super::AnswerFacts {
            model: Some(response.model),
            usage: (usage.input_tokens, usage.output_tokens),
        })
    }

    fn stream_translator(
        &self,
        include_usage: bool,
        _model: &str,
    ) -> Option<Box<dyn StreamTranslator>> {
        Some(Box::new(ResponsesStream {
            include_usage,
            ..ResponsesStream::default()
        }))
    }
}

// ---------------------------------------------------------------------------
// The Responses wire (what the chat reading needs of it)
// ---------------------------------------------------------------------------

#[derive(Deserialize)]
struct Response<'a> {
    #[serde(borrow, default)]
    id: Cow<'a, str>,
    #[serde(default)]
    created_at: u64,
    #[serde(borrow, default)]
    model: Cow<'a, str>,
    #[serde(borrow, default)]
    status: Option<Cow<'a, str>>,
    #[serde(default)]
    incomplete_details: Option<IncompleteDetails<'a>>,
    #[serde(borrow)]
    output: Vec<Item<'a>>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct IncompleteDetails<'a> {
    #[serde(borrow, default)]
    reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Vec<Part<'a>>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<CachedDetails>,
    #[serde(default)]
    output_tokens_details: Option<ReasoningDetails>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct CachedDetails {
    #[serde(default)]
    cached_tokens: u64,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct ReasoningDetails {
    #[serde(default)]
    reasoning_tokens: u64,
}

/// One stream event: its type and the fields any type needs.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    response: Option<Response<'a>>,
    #[serde(borrow, default)]
    item: Option<Item<'a>>,
    #[serde(borrow, default)]
    item_id: Option<Cow<'a, str>>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default)]
    delta: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// A failed response's `error`, inside a `response.failed` event.
#[derive(Deserialize)]
struct Failure<'a> {
    #[serde(borrow)]
    response: FailedResponse<'a>,
}

#[derive(Deserialize)]
struct FailedResponse<'a> {
    #[serde(borrow, default)]
    error: Option<WireError<'a>>,
}

#[derive(Deserialize)]
struct WireError<'a> {
    #[serde(borrow, default)]
    code: Option<Cow<'a, str>>,
    #[serde(default)]
    message: Option<String>,
}

// ---------------------------------------------------------------------------
// The chat reading
// ---------------------------------------------------------------------------

#[derive(Serialize)]
struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: Message<'a>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall<'a>>,
}

#[derive(Serialize)]
struct ToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    arguments: &'a str,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage::new(
            u.input_tokens,
            u.output_tokens,
            u.input_tokens_details.unwrap_or_default().cached_tokens,
            u.output_tokens_details.unwrap_or_default().reasoning_tokens,
        )
    }
}

/// The chat `finish_reason` of a finished response.
fn finish_reason(response: &Response<'_>, called: bool) -> &'static str {
    let reason = response
        .incomplete_details
        .as_ref()
        .and_then(|d| d.reason.as_deref());
    match (response.status.as_deref(), reason) {
        (Some("incomplete"), Some("content_filter")) => "content_filter",
        (Some("incomplete"), _) => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// A whole response as a `chat.completion`.
/// Whether a response has a chat reading: a finished one, whose calls have
/// what a chat call needs.
fn answerable(response: &Response<'_>) -> Result<(), Malformed> {
    match response.status.as_deref() {
        Some("completed" | "incomplete") | None => {}
        Some(other) => return Err(Malformed(format!("a response with status `{other}`"))),
    }
    let call_without_id = response
        .output
        .iter()
        .any(|i| i.kind == "function_call" && (i.call_id.is_none() || i.name.is_none()));
    if call_without_id {
        return Err(Malformed("a function_call without call_id or name".into()));
    }
    Ok(())
}

fn completion_of(response: &Response<'_>) -> Result<Bytes, Malformed> {
    answerable(response)?;
    let mut text: Option<String> = None;
    let mut refusal: Option<String> = None;
    let mut tool_calls = Vec::new();
    for item in &response.output {
        match item.kind.as_ref() {
            "message" => {
                for part in &item.content {
                    match (part.kind.as_ref(), &part.text, &part.refusal) {
                        ("output_text", Some(t), _) => {
                            text.get_or_insert_with(String::new).push_str(t)
                        }
                        ("refusal", _, Some(r)) => {
                            refusal.get_or_insert_with(String::new).push_str(r);
                        }
                        _ => {}
                    }
                }
            }
            // `answerable` has refused a call without its id or name.
            "function_call" => {
                if let (Some(id), Some(name)) = (item.call_id.as_deref(), item.name.as_deref()) {
                    let arguments = item.arguments.as_deref().unwrap_or("{}");
                    tool_calls.push(ToolCall {
                        id,
                        kind: "function",
                        function: Function { name, arguments },
                    });
                }
            }
            // Reasoning and built-in tool items have no chat reading.
            _ => {}
        }
    }
    let finish_reason = finish_reason(response, !tool_calls.is_empty());
    let completion = Completion {
        id: &response.id,
        object: "chat.completion",
        created: response.created_at,
        model: &response.model,
        choices: [Choice {
            index: 0,
            message: Message {
                role: "assistant",
                content: text,
                refusal,
                tool_calls,
            },
            finish_reason,
        }],
        usage: response.usage.map(Usage::from),
    };
    serde_json::to_vec(&completion)
        .map(Bytes::from)
        .map_err(|e| Malformed(e.to_string()))
}

// ---------------------------------------------------------------------------
// Streams: Responses events -> OpenAI chunks
// ---------------------------------------------------------------------------

/// An in-band error, as the engine reads one: OpenAI's shape with the
/// status beside it.
#[derive(Serialize)]
struct InBand<'a> {
    error: InBandError<'a>,
}

#[derive(Serialize)]
struct InBandError<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    code: &'a str,
    status: u16,
}

/// A function call item of the stream.
#[derive(Debug)]
struct Call {
    item_id: String,
    output_index: Option<u64>,
    sent_arguments: bool,
}

/// Translates a Responses event stream, event by event, into chat chunks.
#[derive(Debug, Default)]
struct ResponsesStream {
    include_usage: bool,
    head: Head,
    calls: Vec<Call>,
    finished: bool,
}

impl StreamTranslator for ResponsesStream {
    fn on_event(&mut self, data: &str) -> Result<Vec<Frame>, Malformed> {
        match text_delta(data) {
            Some(delta) if !self.finished => Ok(self.text(delta, false)),
            Some(_) => Ok(Vec::new()),
            None if unread(data) => Ok(Vec::new()),
            None => self.read_event(data),
        }
    }
}

/// The event types the chat reading takes something from.
const READ_TYPES: [&str; 10] = [
    "response.created",
    "response.output_item.added",
    "response.output_text.delta",
    "response.refusal.delta",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
];

/// An event of a type the chat reading takes nothing from (a part opened,
/// an item or a text done: the whole text again), checked by the scan to be
/// one JSON object with that type, without reading it into structs.
fn unread(data: &str) -> bool {
    // The type is written first: a look at it spares the events the reading
    // takes a scan before serde reads them.
    let Some(first) = data.strip_prefix(r#"{"type":""#) else {
        return false;
    };
    let named = first.split('"').next().unwrap_or_default();
    if READ_TYPES.contains(&named) {
        return false;
    }
    let Some([kind]) = scan::fields(data, ["type"]) else {
        return false;
    };
    scan::plain_str(kind).is_some_and(|k| k.is_some_and(|k| !READ_TYPES.contains(&k)))
}

/// A `response.output_text.delta`, the event of every token, read by a scan
/// as serde would read it (its delta, if any); `None` for any other event,
/// or one the scan leaves to serde.
fn text_delta(data: &str) -> Option<Option<&str>> {
    // As OpenAI writes it, it is read by comparison.
    if let Some(read) = crate::native::responses_text_delta(data) {
        return Some(Some(read.delta));
    }
    // Its type read plain is in its text (the scan reads no escaped one): a
    // search spares every other event a scan before serde reads it.
    if !data.contains("\"response.output_text.delta\"") {
        return None;
    }
    let keys = [
        "type",
        "response",
        "item",
        "item_id",
        "output_index",
        "delta",
        "arguments",
        "code",
        "message",
    ];
    let [kind, response, item, item_id, output_index, delta, arguments, code, message] =
        scan::fields(data, keys)?;
    let absent = |f: Option<&str>| f.is_none_or(|v| v == "null");
    if kind != Some("\"response.output_text.delta\"") || !(absent(response) && absent(item)) {
        return None;
    }
    scan::plain_u64(output_index)?;
    for field in [item_id, arguments, code, message] {
        scan::plain_str(field)?;
    }
    scan::plain_str(delta)
}

impl ResponsesStream {
    /// [`StreamTranslator::on_event`], for an event read by serde.
    fn read_event(&mut self, data: &str) -> Result<Vec<Frame>, Malformed> {
        let event: Event<'_> =
            serde_json::from_str(data).map_err(|e| Malformed(format!("not an event: {e}")))?;
        if self.finished {
            return Ok(Vec::new());
        }
        let out = match event.kind.as_ref() {
            "response.created" => {
                let response = event
                    .response
                    .as_ref()
                    .ok_or_else(|| Malformed("response.created without `response`".into()))?;
                response.id.as_ref().clone_into(&mut self.head.id);
                response.model.as_ref().clone_into(&mut self.head.model);
                self.head.created = response.created_at;
                vec![self.head.role()]
            }
            "response.output_item.added" => self.item_added(&event)?,
            "response.output_text.delta" => self.text(event.delta.as_deref(), false),
            "response.refusal.delta" => self.text(event.delta.as_deref(), true),
            "response.function_call_arguments.delta" => {
                self.arguments(&event, event.delta.as_deref())
            }
            "response.function_call_arguments.done" => match self.call_of(&event) {
                Some(i) if !self.calls[i].sent_arguments => {
                    self.arguments(&event, Some(event.arguments.as_deref().unwrap_or("{}")))
                }
                _ => Vec::new(),
            },
            "response.completed" | "response.incomplete" => self.finish(event.response.as_ref()),
            "response.failed" => {
                let failure: Failure<'_> = serde_json::from_str(data)
                    .map_err(|e| Malformed(format!("bad response.failed: {e}")))?;
                let error = failure.response.error;
                let code = error
                    .as_ref()
                    .and_then(|e| e.code.as_deref())
                    .unwrap_or("server_error");
                let message = error.as_ref().and_then(|e| e.message.as_deref());
                self.finished = true;
                vec![in_band(code, message.unwrap_or("the response failed"))]
            }
            "error" => {
                self.finished = true;
                let code = event.code.as_deref().unwrap_or("server_error");
                vec![in_band(
                    code,
                    event.message.as_deref().unwrap_or("upstream error"),
                )]
            }
            // Lifecycle, part and reasoning events, and types added later.
            _ => Vec::new(),
        };
        Ok(out)
    }

    fn text(&self, delta: Option<&str>, refusal: bool) -> Vec<Frame> {
        let Some(text) = delta.filter(|t| !t.is_empty()) else {
            return Vec::new();
        };
        if !refusal {
            return vec![self.head.text(text)];
        }
        let delta = Delta {
            refusal: Some(text),
            ..Delta::default()
        };
        vec![self.head.delta(delta, None)]
    }

    /// A function call's opening chunk (other items open nothing).
    fn item_added(&mut self, event: &Event<'_>) -> Result<Vec<Frame>, Malformed> {
        let Some(item) = event.item.as_ref().filter(|i| i.kind == "function_call") else {
            return Ok(Vec::new());
        };
        let (Some(call_id), Some(name)) = (item.call_id.as_deref(), item.name.as_deref()) else {
            return Err(Malformed("a function_call without call_id or name".into()));
        };
        let index = self.calls.len();
        self.calls.push(Call {
            item_id: item.id.as_deref().unwrap_or_default().to_owned(),
            output_index: event.output_index,
            sent_arguments: false,
        });
        Ok(vec![self.head.call(index, call_id, name)])
    }

    /// The call an arguments event is about: by item id, else by output index.
    fn call_of(&self, event: &Event<'_>) -> Option<usize> {
        self.calls.iter().position(|c| {
            event.item_id.as_deref().is_some_and(|id| id == c.item_id)
                || (event.item_id.is_none() && event.output_index == c.output_index)
        })
    }

    fn arguments(&mut self, event: &Event<'_>, piece: Option<&str>) -> Vec<Frame> {
        let (Some(index), Some(piece)) = (self.call_of(event), piece.filter(|p| !p.is_empty()))
        else {
            return Vec::new();
        };
        self.calls[index].sent_arguments = true;
        vec![self.head.arguments(index, piece)]
    }

    /// The finish chunk, the usage chunk when asked for, and `[DONE]`.
    fn finish(&mut self, response: Option<&Response<'_>>) -> Vec<Frame> {
        self.finished = true;
        let called = !self.calls.is_empty();
        let reason = response.map_or(if called { "tool_calls" } else { "stop" }, |r| {
            finish_reason(r, called)
        });
        let mut out = vec![self.head.delta(Delta::default(), Some(reason))];
        let usage = response.and_then(|r| r.usage).map(Usage::from);
        if let (true, Some(usage)) = (self.include_usage, usage) {
            out.push(self.head.usage(usage));
        }
        out.push(Frame::DONE);
        out
    }
}

/// A failed response or an `error` event as an in-band error: its code's
/// status, so the error table judges it as it would the same error whole.
fn in_band(code: &str, message: &str) -> Frame {
    let (kind, status) = match code {
        "rate_limit_exceeded" => ("rate_limit_error", 429),
        "invalid_prompt" | "invalid_request_error" | "context_length_exceeded" => {
            ("invalid_request_error", 400)
        }
        "server_is_overloaded" | "slow_down" => ("server_error", 503),
        _ => ("server_error", 500),
    };
    Frame::read(&InBand {
        error: InBandError {
            message,
            kind,
            code,
            status,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> serde_json::Value {
        let bytes = Responses
            .decode_answer(Bytes::from(body.to_owned()), "m")
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn a_whole_response_reads_as_a_completion() {
        let c = chat(
            r#"{"id":"resp_1","object":"response","created_at":7,"model":"gpt-x","status":"completed",
            "output":[{"type":"reasoning","id":"rs_1","summary":[]},
              {"type":"message","id":"msg_1","role":"assistant","content":[{"type":"output_text","text":"Hel"},{"type":"output_text","text":"lo"}]},
              {"type":"function_call","id":"fc_1","call_id":"call_1","name":"f","arguments":"{\"a\":1}"}],
            "usage":{"input_tokens":5,"output_tokens":3,"input_tokens_details":{"cached_tokens":2}},"extra":{"kept":true}}"#,
        );
        assert_eq!(c["id"], "resp_1");
        assert_eq!(c["choices"][0]["message"]["content"], "Hello");
        assert_eq!(c["choices"][0]["message"]["tool_calls"][0]["id"], "call_1");
        assert_eq!(
            c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(c["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(c["usage"]["prompt_tokens"], 5);
        assert_eq!(c["usage"]["total_tokens"], 8);
        assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    }

    #[test]
    fn an_incomplete_response_finishes_by_its_reason_and_a_failed_one_is_no_answer() {
        let c = chat(
            r#"{"id":"r","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[]}"#,
        );
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert!(c["choices"][0]["message"]["content"].is_null());
        let failed = Responses.decode_answer(
            Bytes::from_static(br#"{"id":"r","status":"failed","output":[]}"#),
            "m",
        );
        assert!(failed.is_err());
        let junk = Responses.decode_answer(Bytes::from_static(b"{\"id\":1}"), "m");
        assert!(junk.is_err());
    }

    #[test]
    fn an_answers_facts_are_what_its_chat_reading_says() {
        let bodies: [&'static str; 9] = [
            r#"{"id":"r","model":"gpt","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],"usage":{"input_tokens":5,"output_tokens":2,"input_tokens_details":{"cached_tokens":1}}}"#,
            // Escapes anywhere, as encoders that escape more than JSON needs write them.
            r#"{"id":"resp_1","model":"gpt-up","status":"completed","output":[{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{}"}],"usage":{"input_tokens":5}}"#,
            r#"{"id":"r","model":"gpt","output":[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}],"usage":{"input_tokens":5}}"#,
            r#"{"id":"r","model":"gpt","status":"incomplete","output":[],"usage":{"output_tokens":3}}"#,
            r#"{"id":"r","model":"gpt","output":[{"type":"message","content":[]}]}"#,
            r#"{"id":"r","model":"gpt","output":[{"type":"function_call","name":"f"}],"usage":{"input_tokens":5}}"#,
            r#"{"id":"r","status":"failed","output":[],"usage":{"input_tokens":5}}"#,
            r#"{"id":"r","status":"in_progress","output":[],"usage":{"input_tokens":5}}"#,
            r#"{"id":1,"output":[],"usage":{"input_tokens":5}}"#,
        ];
        let read = |body: &'static str| {
            let bytes = Bytes::from_static(body.as_bytes());
            (
                Responses.answer_facts(body.as_bytes()),
                Responses.decode_answer(bytes, "m"),
            )
        };
        assert_eq!(super::super::facts_agree(bodies.map(read)), 4);
        let escaped = read(bodies[1]).0.unwrap();
        assert_eq!(escaped.model.as_deref(), Some("gpt-up"));
    }

    fn run(events: &[&str], include_usage: bool) -> Vec<String> {
        let mut t = Responses.stream_translator(include_usage, "m").unwrap();
        events
            .iter()
            .flat_map(|e| t.on_event(e).unwrap())
            .map(|b| String::from_utf8(b.raw.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn an_event_left_unread_is_one_the_reading_takes_nothing_from() {
        // Every stream event type of the Responses API, with the fields its
        // reading would look at.
        let types = [
            "response.created",
            "response.in_progress",
            "response.completed",
            "response.failed",
            "response.incomplete",
            "response.queued",
            "response.output_item.added",
            "response.output_item.done",
            "response.content_part.added",
            "response.content_part.done",
            "response.output_text.delta",
            "response.output_text.done",
            "response.refusal.delta",
            "response.refusal.done",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.reasoning_summary_text.delta",
            "response.reasoning_summary_part.added",
            "response.web_search_call.completed",
            "response.output_text.annotation.added",
            "error",
        ];
        let created = r#"{"type":"response.created","response":{"id":"r","created_at":1,"model":"m","output":[]}}"#;
        let added = r#"{"type":"response.output_item.added","output_index":0,"item":{"type":"function_call","id":"fc","call_id":"c","name":"f"}}"#;
        let mut unread_seen = 0;
        for kind in types {
            let data = format!(
                r#"{{"type":"{kind}","sequence_number":3,"item_id":"fc","output_index":0,"delta":"x","arguments":"{{}}","code":"c","message":"m","text":"t","item":{{"type":"message","id":"m"}},"response":{{"id":"r","status":"failed","error":{{"code":"server_error","message":"m"}},"output":[]}}}}"#
            );
            let mut stream = ResponsesStream::default();
            stream.read_event(created).unwrap();
            stream.read_event(added).unwrap();
            let read = stream.read_event(&data).unwrap();
            if unread(&data) {
                unread_seen += 1;
                assert!(
                    read.is_empty(),
                    "{kind} is left unread but reads into {read:?}"
                );
            } else {
                assert!(READ_TYPES.contains(&kind), "{kind}");
            }
        }
        assert_eq!(unread_seen, types.len() - READ_TYPES.len());
        // Not one object with a plain type: serde judges it.
        for data in [
            r#"{"type":"response.in_progress""#,
            r#"{"type":"response.in_progress","type":"x"}"#,
            r#"{"type":"x\u0041"}"#,
        ] {
            assert!(!unread(data), "{data}");
        }
    }

    #[test]
    fn a_text_delta_read_by_the_scan_reads_as_serde_reads_it() {
        let created = r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_9","created_at":3,"model":"m","output":[]}}"#;
        let events = [
            r#"{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi","logprobs":[],"obfuscation":"x1"}"#,
            r#"{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"delta":""}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"delta":null}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":0}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"delta":"a\"b\u00e9"}"#,
            r#"{"type":"response.output_text.delta","item_id":"m\u0073g","output_index":0,"delta":"x"}"#,
            r#"{"type":"response.output_text.delta","item_id":7,"output_index":0,"delta":"x"}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":-1,"delta":"x"}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":"0","delta":"x"}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","delta":"x","delta":"y"}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg_1","delta":"x","code":5}"#,
            r#"{"type":"response.output_text.delta","delta":"x","item":{"type":"message"}}"#,
            r#"{"type":"response.output_text.delta","delta":"x","response":{"id":"r"}}"#,
            r#"{"type":"response.output_text.delta","delta":"x"} ,"#,
            r#" { "delta" : "x" , "type" : "response.output_text.delta" } "#,
            r#"{"type":"response.refusal.delta","delta":"no"}"#,
            r#"{"type":"response.output_text.done","text":"Hi"}"#,
            r#"{"type":"response.output_text.delta","item_id":"msg","delta":"x"}"#,
        ];
        for event in events {
            let (mut by_scan, mut by_serde) =
                (ResponsesStream::default(), ResponsesStream::default());
            assert_eq!(
                by_scan.on_event(created).unwrap(),
                by_serde.read_event(created).unwrap()
            );
            let (fast, by_serde) = (by_scan.on_event(event), by_serde.read_event(event));
            super::super::assert_same_reading(event, fast, by_serde);
        }
    }

    #[test]
    fn escaped_strings_in_a_stream_read_as_their_text() {
        let out = run(
            &[
                r#"{"type":"response.created","response":{"id":"resp_\u0039","created_at":3,"model":"gpt\u002dup","output":[]}}"#,
                r#"{"type":"response.output_text.\u0064elta","item_id":"m\u0073g","output_index":0,"delta":"Hi"}"#,
                r#"{"type":"response.output_item.added","output_index":1,"item":{"type":"function_call","id":"fc\u005f1","call_id":"c\u0031","name":"get_w\u0065ather"}}"#,
            ],
            false,
        );
        let data = |i: usize| -> serde_json::Value {
            serde_json::from_str(out[i].trim().trim_start_matches("data: ")).unwrap()
        };
        assert_eq!(
            (data(0)["id"].as_str(), data(0)["model"].as_str()),
            (Some("resp_9"), Some("gpt-up"))
        );
        assert_eq!(data(1)["choices"][0]["delta"]["content"], "Hi");
        let call = &data(2)["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(
            (call["id"].as_str(), call["function"]["name"].as_str()),
            (Some("c1"), Some("get_weather"))
        );
    }

    #[test]
    fn a_stream_reads_as_chunks_with_calls_usage_and_done() {
        let out = run(
            &[
                r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_9","created_at":3,"model":"m","status":"in_progress","output":[]}}"#,
                r#"{"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_9","output":[]}}"#,
                r#"{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi"}"#,
                r#"{"type":"response.output_item.added","sequence_number":3,"output_index":1,"item":{"type":"function_call","id":"fc_1","call_id":"call_1","name":"f","arguments":""}}"#,
                r#"{"type":"response.function_call_arguments.delta","sequence_number":4,"item_id":"fc_1","output_index":1,"delta":"{\"a\":"}"#,
                r#"{"type":"response.function_call_arguments.delta","sequence_number":5,"item_id":"fc_1","output_index":1,"delta":"1}"}"#,
                r#"{"type":"response.function_call_arguments.done","sequence_number":6,"item_id":"fc_1","output_index":1,"arguments":"{\"a\":1}"}"#,
                r#"{"type":"response.completed","sequence_number":7,"response":{"id":"resp_9","status":"completed","output":[],"usage":{"input_tokens":4,"output_tokens":2}}}"#,
                r#"{"type":"response.output_text.delta","sequence_number":8,"delta":"after the end"}"#,
            ],
            true,
        );
        let data: Vec<serde_json::Value> = out
            .iter()
            .filter(|e| !e.contains("[DONE]"))
            .map(|e| serde_json::from_str(e.trim().trim_start_matches("data: ")).unwrap())
            .collect();
        assert_eq!(data[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(data[0]["id"], "resp_9");
        assert_eq!(data[1]["choices"][0]["delta"]["content"], "Hi");
        let call = &data[2]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(
            (call["index"].as_u64(), call["id"].as_str()),
            (Some(0), Some("call_1"))
        );
        assert_eq!(
            data[3]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":"
        );
        assert_eq!(
            data.len(),
            7,
            "the done event repeats no arguments: {out:?}"
        );
        assert_eq!(data[5]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(data[6]["usage"]["completion_tokens"], 2);
        assert_eq!(out.last().map(String::as_str), Some("data: [DONE]\n\n"));
    }

    fn status(event: &str) -> Option<u16> {
        let v: serde_json::Value =
            serde_json::from_str(event.trim().trim_start_matches("data: ")).unwrap();
        crate::sse::error_code(&v["error"].to_string())
    }

    #[test]
    fn a_failed_stream_is_an_in_band_error_with_its_status() {
        let out = run(
            &[
                r#"{"type":"response.created","response":{"id":"r","output":[]}}"#,
                r#"{"type":"response.failed","response":{"id":"r","status":"failed","output":[],"error":{"code":"rate_limit_exceeded","message":"slow down"}}}"#,
            ],
            false,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(status(&out[1]), Some(429));
        let out = run(
            &[r#"{"type":"error","code":"server_error","message":"boom"}"#],
            false,
        );
        assert_eq!(status(&out[0]), Some(500));
    }
}
