//! Fidelity before translation: when a client speaks its target's own
//! protocol (a Messages client and an `anthropic` provider), the request goes
//! up as the client sent it (only `model` rewritten) and the answer comes back
//! as the target sent it, so thinking signatures, `cache_control`, citations
//! and fields switchyard does not know survive.
//!
//! The engine still reads every answer as chat (the commit point, the verdict,
//! continuation and the tool-call contract do not change): a native answer
//! travels beside its chat reading. A whole answer rides in the response's
//! extensions ([`Answer`]); a stream's upstream events ride on the chat
//! events they were read into ([`crate::sse::Upstream`]), and the front
//! door's renderer writes them out instead of rendering the chat. Only a
//! client of the same protocol ever gets such a stream.

use bytes::{Bytes, BytesMut};

/// The protocol a client speaks at the front door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OpenAI Chat Completions (`/v1/chat/completions`): the engine's own.
    Chat,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
    /// OpenAI Responses (`/v1/responses`).
    Responses,
}

impl Protocol {
    /// Its name in the access log.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Chat => "chat",
            Protocol::Messages => "messages",
            Protocol::Responses => "responses",
        }
    }
}

/// A Messages `content_block_delta` of text exactly as Anthropic writes it
/// (compact, its keys in its order): the event of every token, so both its
/// translator and the client's renderer read it first this way, for a few
/// comparisons. Its block index and text; `None` for anything else, which
/// their full readings take (they agree with this one where it answers).
#[must_use]
pub fn messages_text_delta(data: &str) -> Option<(u64, &str)> {
    let rest = data.strip_prefix(r#"{"type":"content_block_delta","index":"#)?;
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (index, rest) = rest.split_at(digits);
    // JSON writes no leading zero.
    if index.is_empty() || (index.len() > 1 && index.starts_with('0')) {
        return None;
    }
    let index = index.parse().ok()?;
    let text = rest
        .strip_prefix(r#","delta":{"type":"text_delta","text":""#)?
        .strip_suffix(r#""}}"#)?;
    // One JSON string, read as it is: no quote, escape or control character.
    crate::sse::scan::is_plain(text).then_some((index, text))
}

/// A Responses `response.output_text.delta` exactly as OpenAI writes it
/// (compact, its keys in its order, `logprobs` and `obfuscation` optional):
/// the event of every token, read by comparison by its translator and the
/// client's renderer alike (as [`messages_text_delta`]). `None` for anything
/// else, which their full readings take (they agree with this one where it
/// answers).
#[must_use]
pub fn responses_text_delta(data: &str) -> Option<ResponsesTextDelta<'_>> {
    let rest = data.strip_prefix(r#"{"type":"response.output_text.delta","sequence_number":"#)?;
    let (sequence_number, rest) = json_u64(rest)?;
    let (item_id, rest) = plain_string(rest.strip_prefix(r#","item_id":""#)?)?;
    let (output_index, rest) = json_u64(rest.strip_prefix(r#","output_index":"#)?)?;
    let (_, rest) = json_u64(rest.strip_prefix(r#","content_index":"#)?)?;
    let (delta, rest) = plain_string(rest.strip_prefix(r#","delta":""#)?)?;
    let rest = rest.strip_prefix(r#","logprobs":[]"#).unwrap_or(rest);
    let rest = match rest.strip_prefix(r#","obfuscation":""#) {
        Some(pad) => plain_string(pad)?.1,
        None => rest,
    };
    (rest == "}").then_some(ResponsesTextDelta {
        sequence_number,
        item_id,
        output_index,
        delta,
    })
}

/// What [`responses_text_delta`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponsesTextDelta<'a> {
    pub sequence_number: u64,
    pub item_id: &'a str,
    pub output_index: u64,
    pub delta: &'a str,
}

/// A JSON number that is a `u64` as JSON writes it (no sign, no leading
/// zero, no fraction), and what follows it.
fn json_u64(text: &str) -> Option<(u64, &str)> {
    let bytes = text.as_bytes();
    let digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || (digits > 1 && bytes[0] == b'0') {
        return None;
    }
    if matches!(bytes.get(digits), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    let mut n: u64 = 0;
    for &b in &bytes[..digits] {
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some((n, &text[digits..]))
}

/// The text of a JSON string whose opening quote is read already, when it
/// has no escape (nor a control character), and what follows its closing quote.
fn plain_string(text: &str) -> Option<(&str, &str)> {
    let end = crate::sse::scan::plain_len(text);
    let rest = text[end..].strip_prefix('"')?;
    Some((&text[..end], rest))
}

/// The client's own body, as the server hands it to the engine: what its
/// front door read of it, and its chat translation, written only when
/// something reads it.
#[derive(Debug)]
pub struct Body {
    /// What the client speaks.
    pub protocol: Protocol,
    /// Its body, as sent.
    pub bytes: Bytes,
    /// What the translation had to leave out, if anything: then only a
    /// target of `protocol` can serve the request.
    pub untranslatable: Option<Untranslatable>,
    /// Where its `model` is, as the front door's reading found it.
    pub model_at: ModelAt,
    /// What routing reads of it.
    pub facts: Facts<'static>,
    /// Its chat translation.
    pub chat: Translation,
}

/// What the engine reads of a request before a target is chosen, as the
/// front door read it from the client's body (a chat request's own view
/// says the same of itself, `ChatRequest::facts`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts<'a> {
    /// The model (or task) asked for.
    pub model: Option<std::borrow::Cow<'a, str>>,
    /// It asks for a stream.
    pub stream: bool,
    /// A stream's usage is asked for (`stream_options.include_usage`).
    pub include_usage: bool,
    /// How many choices it asks for (`n`; 1 when not given).
    pub choices: u32,
    /// The most output tokens it asks for.
    pub max_tokens: Option<u64>,
    /// It offers tools.
    pub tools: bool,
    /// It asks for a JSON answer.
    pub json_mode: bool,
    /// That JSON format is the client's protocol's own (a Messages
    /// structured output): a target of that protocol reads it as sent, so
    /// routing asks no target for the `json_mode` tag; the contract still
    /// holds the answer to it.
    pub json_native: bool,
    /// It holds an image.
    pub images: bool,
    /// Estimated prompt tokens (`crate::tokens`).
    pub prompt_tokens: u64,
}

impl Facts<'_> {
    /// The same facts, borrowing the model.
    #[must_use]
    pub fn reborrow(&self) -> Facts<'_> {
        Facts {
            model: self.model.as_deref().map(std::borrow::Cow::Borrowed),
            ..*self
        }
    }
}

/// A request's chat translation: the canonical request, written as a Chat
/// Completions body when first asked for (a target of another protocol is
/// tried, or the contract, the cache or continuation reads it), else never.
pub struct Translation {
    written: std::sync::OnceLock<Bytes>,
    write: Box<dyn Fn() -> Bytes + Send + Sync>,
}

impl Translation {
    /// A translation `write` writes when it is first read.
    #[must_use]
    pub fn deferred(write: impl Fn() -> Bytes + Send + Sync + 'static) -> Self {
        Self {
            written: std::sync::OnceLock::new(),
            write: Box::new(write),
        }
    }

    /// The Chat Completions body, written now if it was not yet.
    #[must_use]
    pub fn bytes(&self) -> &Bytes {
        self.written.get_or_init(|| (self.write)())
    }
}

impl std::fmt::Debug for Translation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Translation")
            .field("written", &self.written.get().is_some())
            .finish_non_exhaustive()
    }
}

/// Where a body's top-level `model` value lies, as the reader that parsed
/// the body found it (so that rewriting it needs no second read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ModelAt {
    /// Not known: found by reading the body again.
    #[default]
    Unread,
    /// The body has no `model`.
    Absent,
    /// Its value's bytes, quotes included.
    At(std::ops::Range<usize>),
}

/// What a translation into chat had to leave out, and the client's field
/// that says it: only a target of the client's protocol can serve it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untranslatable {
    /// The field (`tools[1].type`, `input[0].content[2]`).
    pub param: String,
    /// Why, in words (naming the field too).
    pub why: String,
}

impl Body {
    /// The view the request path reads.
    #[must_use]
    pub fn request(&self) -> Request<'_> {
        Request {
            protocol: self.protocol,
            body: &self.bytes,
            untranslatable: self.untranslatable.as_ref(),
            model_at: &self.model_at,
        }
    }
}

/// The client's own body, for a target that speaks its protocol.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// What the client speaks.
    pub protocol: Protocol,
    /// Its body, as sent.
    pub body: &'a [u8],
    /// Why a target of another protocol cannot serve it, if one cannot.
    pub untranslatable: Option<&'a Untranslatable>,
    /// Where its `model` is.
    pub model_at: &'a ModelAt,
}

/// A whole answer as the target sent it (secrets redacted), in the extensions
/// of the response whose body is its chat reading.
#[derive(Debug, Clone)]
pub struct Answer(pub Bytes);

/// Renders a committed chat stream in the client's protocol, event by event:
/// the front door's renderer, which the relay runs on the events it has
/// parsed already (no second parse of the stream).
pub trait StreamRender: Send + Sync + std::fmt::Debug {
    /// One event of the chat stream (or an upstream event it carries),
    /// rendered into `out`.
    fn event(&mut self, event: &crate::sse::Event, out: &mut BytesMut);

    /// The end of the chat stream (`[DONE]` seen or not).
    fn done(&mut self, out: &mut BytesMut);

    /// switchyard's estimate of the prompt's tokens, for a protocol that
    /// says them before the answer (Anthropic's `message_start`).
    fn prompt_estimate(&mut self, _tokens: u64) {}
}

/// Renders every event of `raw` (chat SSE bytes) into `out`.
pub fn render_events(render: &mut dyn StreamRender, raw: &[u8], out: &mut BytesMut) {
    let mut parser = crate::sse::Parser::default();
    parser.push(raw);
    while let Some(event) = parser.next_event(true) {
        render.event(&event, out);
    }
}

/// Longest tool-use id Bedrock's Converse takes (Anthropic's is the same
/// grammar, with no stated limit).
const TOOL_USE_ID_MAX: usize = 64;

/// A tool call's id as Anthropic and Bedrock accept it (`[A-Za-z0-9_-]{1,64}`):
/// another provider's id (`functions.Bash:0`, as Kimi and DeepSeek write
/// them) has its other characters replaced by `_`, and one too long is cut,
/// with a hash of the whole, so a call and its result still name each other
/// and two ids stay apart. An id already valid is kept as it is.
#[must_use]
pub fn tool_use_id(id: &str) -> std::borrow::Cow<'_, str> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !id.is_empty() && id.len() <= TOOL_USE_ID_MAX && id.chars().all(allowed) {
        return std::borrow::Cow::Borrowed(id);
    }
    let mut clean: String = id
        .chars()
        .map(|c| if allowed(c) { c } else { '_' })
        .collect();
    if clean.is_empty() || clean.len() > TOOL_USE_ID_MAX {
        // FNV-1a of the original: stable on every replica and every turn.
        let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        clean.truncate(TOOL_USE_ID_MAX - 17);
        clean.push_str(&format!("_{hash:016x}"));
    }
    std::borrow::Cow::Owned(clean)
}

#[cfg(test)]
mod tests {

    #[test]
    fn tool_use_ids_keep_to_anthropics_grammar() {
        use super::tool_use_id;
        assert_eq!(tool_use_id("toolu_01A-b"), "toolu_01A-b");
        assert!(matches!(
            tool_use_id("call_1"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(tool_use_id("functions.Bash:0"), "functions_Bash_0");
        let long = "x".repeat(100);
        let longer = format!("{long}y");
        let (a, b) = (tool_use_id(&long), tool_use_id(&longer));
        assert_eq!(a.len(), 64);
        assert_ne!(a, b, "two long ids stay apart");
        assert_eq!(tool_use_id(""), tool_use_id(""));
        for id in ["", "a.b", &long, "ünï"] {
            let clean = tool_use_id(id);
            assert!(!clean.is_empty() && clean.len() <= 64, "{id}: {clean}");
            assert!(
                clean
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'),
                "{clean}"
            );
        }
    }
    use super::{messages_text_delta, responses_text_delta};

    #[test]
    fn a_text_delta_as_anthropic_writes_it_is_read_by_comparison() {
        let delta = |index: &str, text: &str| {
            format!(
                r#"{{"type":"content_block_delta","index":{index},"delta":{{"type":"text_delta","text":"{text}"}}}}"#
            )
        };
        assert_eq!(
            messages_text_delta(&delta("0", "Hello")),
            Some((0, "Hello"))
        );
        assert_eq!(messages_text_delta(&delta("12", "")), Some((12, "")));
        assert_eq!(
            messages_text_delta(&delta("3", "café ☕")),
            Some((3, "café ☕"))
        );
        // What the full readings take: an escape, a control character, a
        // number JSON does not write, another spacing or order, more after it.
        for (index, text) in [
            ("0", r"a\nb"),
            ("0", "a\tb"),
            ("01", "x"),
            ("", "x"),
            ("-1", "x"),
        ] {
            assert_eq!(
                messages_text_delta(&delta(index, text)),
                None,
                "{index} {text}"
            );
        }
        for data in [
            r#"{"type": "content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"index":0,"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}} "#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","text":"x"}}"#,
            r#"{"type":"content_block_delta","index":99999999999999999999,"delta":{"type":"text_delta","text":"x"}}"#,
        ] {
            assert_eq!(messages_text_delta(data), None, "{data}");
        }
    }

    #[test]
    fn a_text_delta_as_openai_writes_it_is_read_by_comparison_as_serde_reads_it() {
        #[derive(serde::Deserialize)]
        struct Wire {
            #[serde(rename = "type")]
            kind: String,
            sequence_number: u64,
            item_id: String,
            output_index: u64,
            delta: String,
        }
        let event = |seq: &str, delta: &str, tail: &str| {
            format!(
                r#"{{"type":"response.output_text.delta","sequence_number":{seq},"item_id":"msg_1","output_index":0,"content_index":0,"delta":"{delta}"{tail}}}"#
            )
        };
        let read = [
            event("4", "Hello", ""),
            event("0", "", r#","logprobs":[]"#),
            event("17", "café ☕", r#","logprobs":[],"obfuscation":"Xy3kQ""#),
            event("9", "x", r#","obfuscation":"p""#),
        ];
        for data in &read {
            let fast = responses_text_delta(data).unwrap_or_else(|| panic!("{data}"));
            let wire: Wire = serde_json::from_str(data).unwrap();
            assert_eq!(wire.kind, "response.output_text.delta");
            let by_serde = (
                wire.sequence_number,
                wire.item_id.as_str(),
                wire.output_index,
                wire.delta.as_str(),
            );
            assert_eq!(
                (
                    fast.sequence_number,
                    fast.item_id,
                    fast.output_index,
                    fast.delta
                ),
                by_serde
            );
        }
        // What the full readings take: an escape, a control character, a
        // number JSON does not write, more keys, another order or spacing.
        let left = [
            event("4", r"a\nb", ""),
            event("4", r#"a\"b"#, ""),
            event("4", r"a\tb", ""),
            event("4", "tab\there", ""),
            event("04", "x", ""),
            event("4.0", "x", ""),
            event("-4", "x", ""),
            event("99999999999999999999", "x", ""),
            event("4", "x", r#","logprobs":[{"token":"x"}]"#),
            event("4", "x", r#","obfuscation":"a\u0041""#),
            event("4", "x", r#","extra":1"#),
            event("4", "x", " "),
            r#"{"sequence_number":4,"type":"response.output_text.delta","item_id":"m","output_index":0,"content_index":0,"delta":"x"}"#.to_owned(),
            r#"{"type": "response.output_text.delta","sequence_number":4,"item_id":"m","output_index":0,"content_index":0,"delta":"x"}"#.to_owned(),
        ];
        for data in &left {
            assert_eq!(responses_text_delta(data), None, "{data}");
        }
    }
}
