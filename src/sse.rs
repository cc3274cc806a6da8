//! Server-sent events, both ways: an incremental parser for upstream streams
//! that keeps each event's exact bytes (so relaying is byte for byte), the
//! reading of an OpenAI `chat.completion.chunk` that the commit point and the
//! end-of-stream verdict need, and the events switchyard writes itself.
//!
//! The parser follows the WHATWG event-stream rules that matter here: `\n`,
//! `\r\n` and `\r` line ends, events split across reads, comment lines, multi-line
//! `data:`, and a last event without its blank line at EOF.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;

pub mod scan;

/// One complete event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's exact bytes, blank line included.
    pub raw: Bytes,
    /// The `data:` lines joined by `\n`; `None` for comment/keep-alive-only events.
    pub data: Option<String>,
    /// Not an event switchyard may relay: its `data` was not UTF-8 (`data`
    /// then holds a lossy copy), or a translator could not read it.
    pub malformed: bool,
    /// What it means, when already read (a translator's chat event, or a
    /// chat chunk the stream's [`ChunkReader`] read), so that
    /// [`classify_event`] need not read it again; `None`: read the data.
    pub reading: Option<Chunk>,
    /// The upstream event a translated event was read from, when the client
    /// speaks the upstream's protocol and gets that event instead of its
    /// chat reading.
    pub upstream: Upstream,
}

/// What a client of the upstream's own protocol gets for a chat event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Upstream {
    /// The chat event itself (rendered in the client's protocol, if not chat).
    #[default]
    Chat,
    /// The upstream event it was the first reading of, as it came.
    Event {
        /// Its exact bytes.
        raw: Bytes,
        /// Its `data:`.
        data: String,
    },
    /// Nothing: a later reading of an upstream event already carried.
    Covered,
}

impl Event {
    /// Bytes it holds in memory (what a hold is bounded by).
    #[must_use]
    pub fn held_bytes(&self) -> usize {
        let upstream = match &self.upstream {
            Upstream::Event { raw, .. } => raw.len(),
            Upstream::Chat | Upstream::Covered => 0,
        };
        self.raw.len() + upstream
    }
}

/// Incremental parser: feed bytes, take complete events.
#[derive(Debug, Default)]
pub struct Parser {
    buf: BytesMut,
    /// Offset where the current line starts (everything before it is parsed).
    scanned: usize,
    /// Offset from which to look for the next line end: bytes before it were
    /// already searched, so a long line is not rescanned on every read.
    search_from: usize,
    data: Option<String>,
    /// The current event's `data` had bytes that are not UTF-8.
    not_utf8: bool,
    /// The start was checked for a byte order mark (which the SSE spec
    /// strips, and which would otherwise hide the first event's field name).
    past_bom: bool,
    /// Bytes examined looking for line ends, for the linear-time test.
    #[cfg(test)]
    examined: usize,
}

impl Parser {
    /// Appends bytes read from the upstream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet form a complete event.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, if the buffer holds one. `eof` finishes a last
    /// line that has no line end.
    pub fn next_event(&mut self, eof: bool) -> Option<Event> {
        const BOM: &[u8] = b"\xEF\xBB\xBF";
        if !self.past_bom {
            if !eof && self.buf.len() < BOM.len() && BOM.starts_with(&self.buf) {
                return None;
            }
            if self.buf.starts_with(BOM) {
                let _ = self.buf.split_to(BOM.len());
            }
            self.past_bom = true;
        }
        loop {
            let rest = &self.buf[self.scanned..];
            let skip = self
                .search_from
                .saturating_sub(self.scanned)
                .min(rest.len());
            let found = memchr::memchr2(b'\n', b'\r', &rest[skip..]).map(|i| i + skip);
            #[cfg(test)]
            {
                self.examined += found.map_or(rest.len(), |i| i + 1) - skip;
            }
            if found.is_none() {
                self.search_from = self.buf.len();
            }
            let (line_len, end_len) = match found {
                Some(i) if rest[i] == b'\r' => match rest.get(i + 1) {
                    Some(b'\n') => (i, 2),
                    Some(_) => (i, 1),
                    // A `\r` at the end may be the first half of `\r\n`: wait.
                    None if !eof => {
                        self.search_from = self.scanned + i;
                        return None;
                    }
                    None => (i, 1),
                },
                Some(i) => (i, 1),
                None if eof && !rest.is_empty() => (rest.len(), 0),
                None if eof && self.scanned > 0 => {
                    // Stream ended right after a complete line: close the event.
                    return Some(self.take_event(self.scanned).closed());
                }
                None => return None,
            };
            let line_start = self.scanned;
            self.scanned += line_len + end_len;
            if line_len == 0 {
                return Some(self.take_event(self.scanned));
            }
            let line = &self.buf[line_start..line_start + line_len];
            if let Some(value) = field(line, b"data") {
                let value = match std::str::from_utf8(value) {
                    Ok(value) => std::borrow::Cow::Borrowed(value),
                    Err(_) => {
                        // Replaced bytes: never relayed as they came.
                        self.not_utf8 = true;
                        String::from_utf8_lossy(value)
                    }
                };
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(&value);
                    }
                    None => self.data = Some(value.into_owned()),
                }
            }
            if end_len == 0 {
                return Some(self.take_event(self.scanned).closed());
            }
        }
    }

    fn take_event(&mut self, upto: usize) -> Event {
        let raw = self.buf.split_to(upto).freeze();
        self.scanned = 0;
        self.search_from = 0;
        Event {
            raw,
            data: self.data.take(),
            malformed: std::mem::take(&mut self.not_utf8),
            reading: None,
            upstream: Upstream::Chat,
        }
    }
}

impl Event {
    /// An event cut short by EOF, closed with the line end and blank line it
    /// lacked, so that whatever is written after it starts a new event.
    fn closed(mut self) -> Self {
        let mut raw = BytesMut::from(&self.raw[..]);
        if !raw.ends_with(b"\n") && !raw.ends_with(b"\r") {
            raw.extend_from_slice(b"\n");
        }
        raw.extend_from_slice(b"\n");
        self.raw = raw.freeze();
        self
    }
}

/// The value of `name: value` (one optional space after the colon), or `None`
/// for comments and other fields.
fn field<'a>(line: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let rest = line.strip_prefix(name)?;
    if rest.is_empty() {
        return Some(rest);
    }
    let value = rest.strip_prefix(b":")?;
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

/// What one upstream event means to the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// A comment or keep-alive; carries nothing.
    Empty,
    /// A chunk without content (role-only, empty delta, usage-only).
    NoContent {
        /// It carried a `finish_reason`.
        finished: bool,
    },
    /// A chunk with a non-empty text delta or a tool call delta.
    Content {
        /// It also carried a `finish_reason`.
        finished: bool,
    },
    /// `data: [DONE]`.
    Done,
    /// An in-band `{"error": ...}`; `code` is its numeric status-like code if any.
    Error {
        /// `error.code` or `error.status` when numeric (e.g. 429).
        code: Option<u16>,
    },
    /// `data:` that is not JSON.
    Malformed,
}

#[derive(Deserialize)]
struct ChunkWire<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChoiceWire<'a>>,
}

/// A chunk as far as [`classify_event`] reads it: the choices are folded
/// into two facts while they are read, so reading one allocates nothing.
#[derive(Deserialize)]
struct ChunkFacts<'a> {
    #[serde(default)]
    choices: ChoiceFacts,
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
}

/// Whether any choice carries content, whether any has finished, and
/// whether one was cut short by its server ([`RESOURCE_CUT`]).
#[derive(Default)]
struct ChoiceFacts {
    content: bool,
    finished: bool,
    cut: bool,
}

impl<'de> Deserialize<'de> for ChoiceFacts {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fold;
        impl<'de> serde::de::Visitor<'de> for Fold {
            type Value = ChoiceFacts;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ChoiceFacts, A::Error> {
                let mut facts = ChoiceFacts::default();
                while let Some(choice) = seq.next_element::<ChoiceWire<'de>>()? {
                    let finish = choice.finish_reason.map(RawValue::get);
                    facts.finished |= finish.is_some_and(|r| r != "null");
                    facts.cut |= finish.is_some_and(is_resource_cut);
                    facts.content |= choice.delta.as_ref().is_some_and(DeltaWire::has_content);
                }
                Ok(facts)
            }
        }
        d.deserialize_seq(Fold)
    }
}

#[derive(Deserialize)]
struct ChoiceWire<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaWire<'a>>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct DeltaWire<'a> {
    #[serde(default, borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<&'a RawValue>,
    #[serde(default, borrow)]
    function_call: Option<&'a RawValue>,
    #[serde(default, borrow)]
    refusal: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<std::borrow::Cow<'a, str>>,
    /// vLLM's and OpenRouter's name for `reasoning_content`.
    #[serde(default, borrow)]
    reasoning: Option<std::borrow::Cow<'a, str>>,
}

impl DeltaWire<'_> {
    /// A non-empty text, refusal or reasoning delta, or a tool or function call.
    fn has_content(&self) -> bool {
        let non_empty =
            |s: &Option<std::borrow::Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
        let present = |v: &Option<&RawValue>| v.is_some_and(|v| !matches!(v.get(), "null" | "[]"));
        non_empty(&self.content)
            || non_empty(&self.refusal)
            || non_empty(&self.reasoning_content)
            || non_empty(&self.reasoning)
            || present(&self.tool_calls)
            || present(&self.function_call)
    }
}

#[derive(Deserialize)]
struct ErrorWire {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default)]
    status: Option<serde_json::Value>,
}

/// Reads an event as an OpenAI chunk (from what its writer said it means,
/// when it said so).
#[must_use]
pub fn classify_event(event: &Event) -> Chunk {
    if event.malformed {
        return Chunk::Malformed;
    }
    if let Some(reading) = event.reading {
        return reading;
    }
    match &event.data {
        Some(data) => classify_data(data),
        None => Chunk::Empty,
    }
}

/// Reads an event's `data` as an OpenAI chunk.
#[must_use]
pub fn classify_data(data: &str) -> Chunk {
    read_data(data, scan::chunk)
}

/// Reads the events of one stream as OpenAI chunks, as [`classify_data`]
/// does, each by its difference from the last one read whole where it can.
#[derive(Debug, Default)]
pub struct ChunkReader {
    memo: scan::Memo,
}

impl ChunkReader {
    /// What [`classify_data`] reads from `data`.
    pub fn read(&mut self, data: &str) -> Chunk {
        read_data(data, |data| self.memo.chunk(data))
    }
}

/// DeepSeek's `finish_reason` for an answer its servers cut short for want
/// of resources: no finish, an upstream failure (a 503).
const RESOURCE_CUT: &str = "insufficient_system_resource";

fn read_data(data: &str, scan: impl FnOnce(&[u8]) -> Option<Chunk>) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk::Done;
    }
    if data.is_empty() {
        return Chunk::Empty;
    }
    match scan(data.as_bytes()) {
        // The scan reads any finish as a finish: serde tells a cut apart
        // (looked for in finishing chunks only, one or so a stream).
        Some(Chunk::Content { finished: true } | Chunk::NoContent { finished: true })
            if memchr::memmem::find(data.as_bytes(), RESOURCE_CUT.as_bytes()).is_some() =>
        {
            read_chunk(data)
        }
        Some(chunk) => chunk,
        None => read_chunk(data),
    }
}

/// [`classify_data`] by serde: what the byte scan leaves to it.
fn read_chunk(data: &str) -> Chunk {
    let Ok(chunk) = serde_json::from_str::<ChunkFacts<'_>>(data) else {
        return Chunk::Malformed;
    };
    if let Some(err) = chunk.error {
        return Chunk::Error {
            code: error_code(err.get()),
        };
    }
    let ChoiceFacts {
        content,
        finished,
        cut,
    } = chunk.choices;
    if cut {
        return Chunk::Error { code: Some(503) };
    }
    if content {
        Chunk::Content { finished }
    } else {
        Chunk::NoContent { finished }
    }
}

/// The indices of the choices a chunk finishes.
#[must_use]
pub fn finished_choices(data: &str) -> Vec<u32> {
    #[derive(Deserialize)]
    struct Finishing<'a> {
        #[serde(default, borrow)]
        choices: Vec<Choice<'a>>,
    }
    #[derive(Deserialize)]
    struct Choice<'a> {
        #[serde(default)]
        index: u32,
        #[serde(default, borrow)]
        finish_reason: Option<&'a RawValue>,
    }
    serde_json::from_str::<Finishing<'_>>(data.trim())
        .map(|chunk| {
            chunk
                .choices
                .iter()
                .filter(|c| c.finish_reason.is_some_and(|r| r.get() != "null"))
                .map(|c| c.index)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a raw `finish_reason` is [`RESOURCE_CUT`].
#[must_use]
pub fn is_resource_cut(raw: &str) -> bool {
    raw.strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .is_some_and(|r| r == RESOURCE_CUT)
}

/// What a content chunk delivers, for a stream that may be continued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The `delta.content` text (all choices).
    pub text: String,
    /// Only text: no tool call, function call, refusal or reasoning delta
    /// (those cannot be continued on another target).
    pub plain: bool,
}

/// Reads what a content chunk delivers.
#[must_use]
pub fn delivered(data: &str) -> Option<Delivered> {
    let chunk: ChunkWire<'_> = serde_json::from_str(data.trim()).ok()?;
    let mut out = Delivered {
        text: String::new(),
        plain: true,
    };
    for choice in &chunk.choices {
        let Some(d) = &choice.delta else { continue };
        if let Some(text) = &d.content {
            out.text.push_str(text);
        }
        let present = |v: &Option<&RawValue>| v.is_some_and(|v| !matches!(v.get(), "null" | "[]"));
        let non_empty =
            |s: &Option<std::borrow::Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
        if present(&d.tool_calls)
            || present(&d.function_call)
            || non_empty(&d.refusal)
            || non_empty(&d.reasoning_content)
            || non_empty(&d.reasoning)
        {
            out.plain = false;
        }
    }
    Some(out)
}

/// `usage.prompt_tokens` and `usage.completion_tokens` of a completion or
/// chunk, when it reports them.
#[must_use]
pub fn usage(json: &[u8]) -> Option<(u64, u64)> {
    #[derive(Deserialize)]
    struct WithUsage {
        usage: Option<Usage>,
    }
    let u = serde_json::from_slice::<WithUsage>(json).ok()?.usage?;
    Some((u.prompt_tokens, u.completion_tokens))
}

/// As [`usage`], of a `usage` object already found.
#[must_use]
pub fn usage_of(usage: &serde_json::value::RawValue) -> Option<(u64, u64)> {
    let u = serde_json::from_str::<Option<Usage>>(usage.get()).ok()??;
    Some((u.prompt_tokens, u.completion_tokens))
}

/// The token counts of OpenAI's `usage`.
#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

/// The numeric code of an OpenAI-style error object (`code` or `status`), if any.
#[must_use]
pub fn error_code(error_json: &str) -> Option<u16> {
    let e: ErrorWire = serde_json::from_str(error_json).ok()?;
    let as_code = |v: serde_json::Value| match v {
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
        serde_json::Value::String(s) => s.parse().ok(),
        serde_json::Value::Null
        | serde_json::Value::Bool(_)
        | serde_json::Value::Array(_)
        | serde_json::Value::Object(_) => None,
    };
    e.code
        .and_then(as_code)
        .or_else(|| e.status.and_then(as_code))
        .filter(|c| (100..=599).contains(c))
}

/// In a whole SSE body: the first in-band error event, as `Some(code)` (its
/// numeric code, if any); `None` when no event is an error.
#[must_use]
pub fn first_error_code(body: &[u8]) -> Option<Option<u16>> {
    let mut parser = Parser::default();
    parser.push(body);
    while let Some(event) = parser.next_event(true) {
        if let Chunk::Error { code } = classify_event(&event) {
            return Some(code);
        }
    }
    None
}

/// What an upstream's own error event said, when that event broke a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSaid {
    /// The status its error reads as (an `overloaded_error` is 529).
    pub status: u16,
    /// Its message, at most [`SAID_CHARS`] characters of it.
    pub message: String,
}

/// The longest upstream message an interruption repeats.
pub const SAID_CHARS: usize = 500;

impl UpstreamSaid {
    /// What the error event `data` (`{"error": …}`) said, read as `status`,
    /// its message passed through `clean` (which scrubs secrets) before it is
    /// cut to length, so that no cut leaves a fragment `clean` cannot know.
    #[must_use]
    pub fn of(status: u16, data: &str, clean: impl FnOnce(&str) -> String) -> Self {
        #[derive(Deserialize)]
        struct Event<'a> {
            #[serde(borrow)]
            error: Said<'a>,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Said<'a> {
            Text(#[serde(borrow)] std::borrow::Cow<'a, str>),
            Object {
                #[serde(default, borrow)]
                message: Option<std::borrow::Cow<'a, str>>,
            },
        }
        let message = match serde_json::from_str::<Event<'_>>(data).map(|e| e.error) {
            Ok(
                Said::Text(text)
                | Said::Object {
                    message: Some(text),
                },
            ) => text,
            Ok(Said::Object { message: None }) | Err(_) => "".into(),
        };
        Self {
            status,
            message: clean(&message).chars().take(SAID_CHARS).collect(),
        }
    }
}

/// The closing pair switchyard sends when a stream breaks after the commit
/// point: one OpenAI-style error event, then `data: [DONE]`. An upstream
/// error event that broke it is told in it: its message, and its status
/// (`status`), so a client's renderer can name its kind.
#[must_use]
pub fn interrupt_events(reason: &str, said: Option<&UpstreamSaid>) -> Bytes {
    let mut error = serde_json::json!({
        "message": format!("upstream stream interrupted ({reason}); the answer above is incomplete"),
        "type": "upstream_error",
        "code": "stream_interrupted",
    });
    if let Some(said) = said {
        let told = if said.message.is_empty() {
            format!("{reason}, status {}", said.status)
        } else {
            format!("{reason}, status {}: {}", said.status, said.message)
        };
        error["message"] =
            format!("upstream stream interrupted ({told}); the answer above is incomplete").into();
        error["status"] = said.status.into();
    }
    let body = serde_json::json!({ "error": error });
    Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n"))
}

/// The last events of a stream cut at switchyard's drain timeout.
#[must_use]
pub fn drain_events() -> Bytes {
    let body = serde_json::json!({
        "error": {
            "message": "switchyard is shutting down and its drain_timeout passed; the answer above is incomplete",
            "type": "server_error",
            "code": "stream_interrupted",
        }
    });
    Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n"))
}

/// The JSON data of each event in `raw` (SSE bytes), in order; what is
/// not JSON is left out.
#[must_use]
pub fn chunks_of(raw: &[u8]) -> Vec<serde_json::Value> {
    events_of(raw)
        .into_iter()
        .filter_map(|e| e.data)
        .filter_map(|d| serde_json::from_str(&d).ok())
        .collect()
}

/// The complete events of some SSE bytes.
#[must_use]
pub fn events_of(raw: &[u8]) -> Vec<Event> {
    let mut parser = Parser::default();
    parser.push(raw);
    std::iter::from_fn(|| parser.next_event(true)).collect()
}

/// The first choice's text of a `chat.completion` body (empty without one).
#[must_use]
pub fn completion_text(completion: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(completion)
        .ok()
        .and_then(|v| {
            v.pointer("/choices/0/message/content")?
                .as_str()
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// The completion a stream's events make (Chat Completions chunks, raw SSE
/// bytes): the envelope (`id`, `created`, `model`) of the first chunk,
/// each choice's text and finish, and the usage; for a re-ask or a repair
/// of a held stream. `None` without a chunk.
#[must_use]
pub fn completion_of_events(raw: &[u8]) -> Option<Bytes> {
    use serde_json::Value;
    let chunks = chunks_of(raw);
    let first = chunks.first()?;
    // By choice index: its text, its refusal and its finish.
    let mut by_choice: std::collections::BTreeMap<u64, (String, String, Value)> =
        std::collections::BTreeMap::new();
    let mut usage = Value::Null;
    for chunk in &chunks {
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let (text, refusal, finish) =
                by_choice
                    .entry(index)
                    .or_insert((String::new(), String::new(), Value::Null));
            if let Some(piece) = choice.pointer("/delta/content").and_then(Value::as_str) {
                text.push_str(piece);
            }
            if let Some(piece) = choice.pointer("/delta/refusal").and_then(Value::as_str) {
                refusal.push_str(piece);
            }
            if let Some(f) = choice.get("finish_reason").filter(|f| !f.is_null()) {
                *finish = f.clone();
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            usage = u.clone();
        }
    }
    let mut completion = serde_json::json!({
        "id": first.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion",
        "created": first.get("created").cloned().unwrap_or(Value::Null),
        "model": first.get("model").cloned().unwrap_or(Value::Null),
        "choices": by_choice.into_iter().map(|(index, (text, refusal, finish))| {
            let mut message = serde_json::json!({"role": "assistant", "content": text});
            if !refusal.is_empty() {
                message["refusal"] = refusal.into();
            }
            serde_json::json!({"index": index, "message": message, "finish_reason": finish})
        }).collect::<Vec<_>>(),
    });
    if !usage.is_null() {
        completion["usage"] = usage;
    }
    serde_json::to_vec(&completion).ok().map(Bytes::from)
}

/// One raw event with the first choice's text replaced: by `text`, or
/// taken out (`None`; an event left with nothing to say is dropped, the
/// inner `None`). The outer `None`: the event carries no text of the
/// first choice, and stays as it is.
#[must_use]
pub fn with_text(raw: &[u8], text: Option<&str>) -> Option<Option<Bytes>> {
    use serde_json::Value;
    let mut parser = Parser::default();
    parser.push(raw);
    let data = parser.next_event(true)?.data?;
    let mut chunk: Value = serde_json::from_str(&data).ok()?;
    let choice = chunk
        .get_mut("choices")?
        .as_array_mut()?
        .iter_mut()
        .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)?;
    let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
    let delta = choice.get_mut("delta")?.as_object_mut()?;
    delta.get("content").and_then(Value::as_str)?;
    match text {
        Some(t) => {
            delta.insert("content".into(), Value::from(t));
        }
        None => {
            delta.remove("content");
            let said = !delta.is_empty() || finished;
            if !said && chunk.get("usage").is_none_or(Value::is_null) {
                return Some(None);
            }
        }
    }
    Some(Some(Bytes::from(format!("data: {chunk}\n\n"))))
}

/// A whole completion as the stream that would have carried it: per
/// choice one chunk with its message (role, text, refusal, tool calls with
/// their indexes) and one with its finish, then the usage chunk when the
/// client asked for it (`include_usage`), then `[DONE]`. `None` for a body
/// that is not a completion.
#[must_use]
pub fn events_of_completion(completion: &[u8], include_usage: bool) -> Option<Bytes> {
    use serde_json::{json, Value};
    let whole: Value = serde_json::from_slice(completion).ok()?;
    let chunk = |choices: Value| {
        json!({
            "id": whole.get("id").cloned().unwrap_or(Value::Null),
            "object": "chat.completion.chunk",
            "created": whole.get("created").cloned().unwrap_or(Value::Null),
            "model": whole.get("model").cloned().unwrap_or(Value::Null),
            "choices": choices,
        })
    };
    let mut out = String::new();
    let mut push = |event: &Value| {
        out.push_str("data: ");
        out.push_str(&event.to_string());
        out.push_str("\n\n");
    };
    for choice in whole.get("choices")?.as_array()? {
        let index = choice.get("index").cloned().unwrap_or(Value::from(0));
        let message = choice.get("message").unwrap_or(&Value::Null);
        let mut delta = json!({"role": "assistant"});
        for field in ["content", "refusal", "reasoning_content", "reasoning"] {
            if let Some(v) = message.get(field).filter(|v| !v.is_null()) {
                delta[field] = v.clone();
            }
        }
        if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
            let calls: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, call)| {
                    let mut call = call.clone();
                    call["index"] = Value::from(i);
                    call
                })
                .collect();
            delta["tool_calls"] = Value::from(calls);
        }
        push(&chunk(
            json!([{"index": index, "delta": delta, "finish_reason": null}]),
        ));
        let finish = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
        push(&chunk(
            json!([{"index": index, "delta": {}, "finish_reason": finish}]),
        ));
    }
    if let Some(usage) = whole.get("usage").filter(|_| include_usage) {
        let mut last = chunk(json!([]));
        last["usage"] = usage.clone();
        push(&last);
    }
    out.push_str("data: [DONE]\n\n");
    Some(Bytes::from(out))
}

/// Largest event accepted from an upstream; a bigger one (or a line that never
/// ends) is a broken stream, not something to buffer without bound.
pub const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// The `[DONE]` sentinel, added when an upstream ends cleanly without one.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Which call a chat tool-call fragment belongs to. Chat numbers a stream's
/// calls by `index`, but some servers (Ollama, some vLLM builds) number every
/// parallel call 0 and tell them apart by `id` alone: a new id on an index
/// starts a new call. A call's number is its place in the order calls first
/// came.
#[derive(Debug, Default, Clone)]
pub struct CallSlots {
    /// (chat index, id, number) of every call so far.
    calls: Vec<(u32, String, u32)>,
}

impl CallSlots {
    /// The number of the call the fragment at `index` with `id` belongs to.
    pub fn slot(&mut self, index: u32, id: Option<&str>) -> u32 {
        let id = id.filter(|id| !id.is_empty());
        if let Some(at) = self.calls.iter().rposition(|(i, _, _)| *i == index) {
            let (_, known, number) = &mut self.calls[at];
            match id {
                None => return *number,
                // An id may come in a later fragment than the first.
                Some(id) if known.is_empty() => {
                    id.clone_into(known);
                    return *number;
                }
                Some(id) if known == id => return *number,
                Some(_) => {}
            }
        }
        let number = u32::try_from(self.calls.len()).unwrap_or(u32::MAX);
        self.calls
            .push((index, id.unwrap_or_default().to_owned(), number));
        number
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_an_upstream_error_said_is_read_in_every_shape() {
        let said = |data: &str| UpstreamSaid::of(529, data, str::to_owned).message;
        assert_eq!(
            said(r#"{"error":{"message":"Over\u006coaded","type":"x"}}"#),
            "Overloaded"
        );
        assert_eq!(said(r#"{"error":"busy"}"#), "busy");
        assert_eq!(said(r#"{"error":{"type":"x"}}"#), "");
        assert_eq!(said("not json"), "");
        let long = format!(
            r#"{{"error":{{"message":"{}"}}}}"#,
            "é".repeat(SAID_CHARS + 7)
        );
        assert_eq!(said(&long).chars().count(), SAID_CHARS);
        let told = interrupt_events(
            "upstream_error",
            Some(&UpstreamSaid::of(529, "{}", str::to_owned)),
        );
        let told = String::from_utf8(told.to_vec()).unwrap();
        assert!(told.contains(r#""status":529"#), "{told}");
        assert!(told.contains("(upstream_error, status 529)"), "{told}");
        let plain = String::from_utf8(interrupt_events("reset", None).to_vec()).unwrap();
        assert!(!plain.contains("status"), "{plain}");
    }

    #[test]
    fn an_events_text_is_replaced_or_taken_out() {
        let raw = br#"data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}

"#;
        let put = with_text(raw, Some("{}")).unwrap().unwrap();
        assert!(std::str::from_utf8(&put)
            .unwrap()
            .contains(r#""content":"{}""#));
        let out = with_text(raw, None).unwrap().unwrap();
        assert!(
            !std::str::from_utf8(&out).unwrap().contains("content"),
            "the role stays"
        );
        let text_only =
            br#"data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}

"#;
        assert_eq!(
            with_text(text_only, None),
            Some(None),
            "nothing left to say"
        );
        let finish = br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}

"#;
        assert_eq!(with_text(finish, None), None, "no text: kept as it is");
        assert_eq!(with_text(b"data: [DONE]\n\n", Some("x")), None);
    }

    #[test]
    fn a_completion_and_its_stream_make_each_other() {
        let completion = br#"{"id":"c1","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let events = events_of_completion(completion, true).unwrap();
        let text = std::str::from_utf8(&events).unwrap();
        let chunks: Vec<serde_json::Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(chunks.len(), 3, "{text}");
        let call = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(call["index"], 0);
        assert_eq!(call["function"]["arguments"], "{\"x\":1}");
        assert!(chunks[0]["choices"][0]["delta"].get("content").is_none());
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks[2]["usage"]["total_tokens"], 5);
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert!(!events_of_completion(completion, false)
            .map(|e| String::from_utf8_lossy(&e).contains("total_tokens"))
            .unwrap());
        // And back: the stream's events make the completion's text and usage.
        let prose = b"data: {\"id\":\"c2\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"}}]}\n\n\
data: {\"id\":\"c2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\n\
data: {\"id\":\"c2\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3}}\n\ndata: [DONE]\n\n";
        let whole: serde_json::Value =
            serde_json::from_slice(&completion_of_events(prose).unwrap()).unwrap();
        assert_eq!(whole["id"], "c2");
        assert_eq!(whole["choices"][0]["message"]["content"], "Hello");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop");
        assert_eq!(whole["usage"]["completion_tokens"], 2);
        assert!(completion_of_events(b"").is_none());
    }

    fn events(input: &[&[u8]]) -> Vec<Event> {
        let mut p = Parser::default();
        let mut out = Vec::new();
        for piece in input {
            p.push(piece);
            while let Some(e) = p.next_event(false) {
                out.push(e);
            }
        }
        while let Some(e) = p.next_event(true) {
            out.push(e);
        }
        out
    }

    #[test]
    fn a_byte_order_mark_at_the_start_is_dropped_even_split() {
        for input in [
            &[&b"\xEF\xBB\xBFdata: one\n\n"[..]][..],
            &[&b"\xEF"[..], b"\xBB", b"\xBFdata: one\n\n"],
        ] {
            let out = events(input);
            assert_eq!(out.len(), 1);
            assert_eq!(out[0].data.as_deref(), Some("one"));
            assert_eq!(&out[0].raw[..], b"data: one\n\n");
        }
        // Only at the start: later it is part of a line.
        let out = events(&[b"data: a\n\n\xEF\xBB\xBFdata: b\n\n"]);
        assert_eq!(out[0].data.as_deref(), Some("a"));
        assert_ne!(out.get(1).and_then(|e| e.data.as_deref()), Some("b"));
    }

    #[test]
    fn split_reads_and_line_endings() {
        let out = events(&[
            b"data: {\"a\"",
            b":1}\r",
            b"\n\r\ndata: x\r\rdata: y\n",
            b"data: z\n\n",
        ]);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(&out[0].raw[..], b"data: {\"a\":1}\r\n\r\n");
        assert_eq!(out[1].data.as_deref(), Some("x"));
        assert_eq!(out[2].data.as_deref(), Some("y\nz"));
    }

    #[test]
    fn comments_carry_no_data_and_raw_bytes_concatenate_to_input() {
        let input: &[u8] = b": keep-alive\n\ndata: a\n\n:c\ndata: b\n\ndata: last";
        let out = events(&[input]);
        assert_eq!(out[0].data, None);
        assert_eq!(out[2].data.as_deref(), Some("b"));
        assert_eq!(out[3].data.as_deref(), Some("last"));
        let joined: Vec<u8> = out.iter().flat_map(|e| e.raw.to_vec()).collect();
        assert_eq!(
            joined,
            [input, b"\n\n"].concat(),
            "the last event is closed"
        );
    }

    #[test]
    fn a_long_line_fed_in_small_pieces_is_scanned_once() {
        let mut p = Parser::default();
        p.push(b"data: ");
        for _ in 0..20_000 {
            p.push(&[b'x'; 512]);
            assert!(p.next_event(false).is_none());
        }
        p.push(b"\n\n");
        let e = p.next_event(false).unwrap();
        assert_eq!(e.data.map(|d| d.len()), Some(20_000 * 512));
        // Rescanning the line on every read would examine ~20,000 x 5 MB / 2.
        let total = 6 + 20_000 * 512 + 2;
        assert!(
            p.examined <= total,
            "{} bytes examined for {total}",
            p.examined
        );
    }

    #[test]
    fn eof_after_line_without_blank_line_closes_event() {
        let out = events(&[b"data: a\n"]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].data.as_deref(), Some("a"));
        assert_eq!(&out[0].raw[..], b"data: a\n\n");
    }

    fn chunk(data: &str) -> Chunk {
        classify_event(&Event {
            raw: Bytes::new(),
            data: Some(data.to_owned()),
            malformed: false,
            reading: None,
            upstream: crate::sse::Upstream::Chat,
        })
    }

    #[test]
    fn usage_is_read_from_bodies_and_chunks() {
        assert_eq!(
            usage(br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#),
            Some((5, 7))
        );
        assert_eq!(usage(br#"{"choices":[]}"#), None);
        assert_eq!(usage(b"nope"), None);
    }

    #[test]
    fn chunk_meanings() {
        assert_eq!(
            chunk(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
            Chunk::NoContent { finished: false }
        );
        assert_eq!(
            chunk(r#"{"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}"#),
            Chunk::Content { finished: false }
        );
        assert_eq!(
            chunk(r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#),
            Chunk::Content { finished: false }
        );
        assert_eq!(
            chunk(r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#),
            Chunk::NoContent { finished: true }
        );
        assert_eq!(
            chunk(r#"{"choices":[],"usage":{"total_tokens":3}}"#),
            Chunk::NoContent { finished: false }
        );
        assert_eq!(
            chunk(r#"{"error":{"message":"slow down","code":429}}"#),
            Chunk::Error { code: Some(429) }
        );
        assert_eq!(
            chunk(r#"{"error":{"message":"x","code":"server_error"}}"#),
            Chunk::Error { code: None }
        );
        assert_eq!(chunk("[DONE]"), Chunk::Done);
        assert_eq!(chunk("{not json"), Chunk::Malformed);
    }
}
