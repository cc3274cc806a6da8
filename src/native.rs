//! Fidelity before translation: when a client speaks its target's own
//! protocol (a Messages client and an `anthropic` provider), the request goes
//! up as the client sent it (only `model` rewritten) and the answer comes back
//! as the target sent it, so thinking signatures, `cache_control`, citations
//! and fields switchyard does not know survive.
//!
//! The engine still reads every answer as chat (the commit point, the verdict,
//! continuation and the tool-call contract do not change): a native answer
//! travels beside its chat reading. A whole answer rides in the response's
//! extensions ([`Answer`]); a stream's upstream events ride in SSE comment
//! lines on the chat events they were read into ([`carry`]), which the front
//! door's renderer writes out instead of rendering the chat ([`carried`]).
//! Only a client of the same protocol ever gets such a stream.

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

/// The client's own body, as the server hands it to the engine beside its
/// chat translation.
#[derive(Debug, Clone)]
pub struct Body {
    /// What the client speaks.
    pub protocol: Protocol,
    /// Its body, as sent.
    pub bytes: Bytes,
    /// What the translation had to leave out, if anything: then only a
    /// target of `protocol` can serve the request.
    pub untranslatable: Option<String>,
}

impl Body {
    /// The view the request path reads.
    #[must_use]
    pub fn request(&self) -> Request<'_> {
        Request {
            protocol: self.protocol,
            body: &self.bytes,
            untranslatable: self.untranslatable.as_deref(),
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
    pub untranslatable: Option<&'a str>,
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
}

/// Renders every event of `raw` (chat SSE bytes) into `out`.
pub fn render_events(render: &mut dyn StreamRender, raw: &[u8], out: &mut BytesMut) {
    let mut parser = crate::sse::Parser::default();
    parser.push(raw);
    while let Some(event) = parser.next_event(true) {
        render.event(&event, out);
    }
}

/// The comment that starts each line of a carried upstream event.
const MARK: &[u8] = b":native:";

/// Prefixes the chat events one upstream event (`data`) was read into with
/// that event, as comment lines: on the first of `frames`, or on an event of
/// its own when it was read into none. The rest are marked as covered by it.
pub fn carry(data: &str, frames: Vec<Bytes>) -> Vec<Bytes> {
    if frames.is_empty() {
        let mut out = BytesMut::with_capacity(data.len() + MARK.len() + 3);
        mark(data, &mut out);
        out.extend_from_slice(b"\n");
        return vec![out.freeze()];
    }
    let mut carried = Vec::with_capacity(frames.len());
    for (i, frame) in frames.into_iter().enumerate() {
        let mut out = BytesMut::with_capacity(frame.len() + data.len() + MARK.len() + 2);
        if i == 0 {
            mark(data, &mut out);
        } else {
            out.extend_from_slice(MARK);
            out.extend_from_slice(b"\n");
        }
        out.extend_from_slice(&frame);
        carried.push(out.freeze());
    }
    carried
}

fn mark(data: &str, out: &mut BytesMut) {
    for line in data.split('\n') {
        out.extend_from_slice(MARK);
        out.extend_from_slice(b" ");
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\n");
    }
}

/// What an event's comment lines carry, if it carries anything: `Some(None)`
/// for a chat event covered by an upstream event carried before it.
#[must_use]
pub fn carried(raw: &[u8]) -> Option<Option<String>> {
    if !raw.starts_with(MARK) {
        return None;
    }
    let mut data: Option<String> = None;
    for line in raw.split(|b| *b == b'\n') {
        let Some(rest) = line.strip_prefix(MARK) else {
            break;
        };
        let Some(text) = rest.strip_prefix(b" ") else {
            continue;
        };
        let text = String::from_utf8_lossy(text);
        match &mut data {
            None => data = Some(text.into_owned()),
            Some(joined) => {
                joined.push('\n');
                joined.push_str(&text);
            }
        }
    }
    Some(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(data: &str) -> Bytes {
        Bytes::from(format!("data: {data}\n\n"))
    }

    #[test]
    fn an_event_rides_on_its_first_frame_and_covers_the_rest() {
        let event = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"}}"#;
        let out = carry(event, vec![frame("{\"a\":1}"), frame("{\"b\":2}")]);
        assert_eq!(out.len(), 2);
        assert_eq!(carried(&out[0]), Some(Some(event.to_owned())));
        assert!(out[0].ends_with(b"data: {\"a\":1}\n\n"));
        assert_eq!(carried(&out[1]), Some(None));
        assert!(out[1].ends_with(b"data: {\"b\":2}\n\n"));
        // The chat reading is untouched for the engine's SSE parser.
        let mut parser = crate::sse::Parser::default();
        parser.push(&out[0]);
        let parsed = parser.next_event(false).expect("an event");
        assert_eq!(parsed.data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(parsed.raw, out[0]);
    }

    #[test]
    fn an_event_read_into_nothing_is_an_event_of_comments_alone() {
        let out = carry("{\"type\":\"ping\"}\n{\"x\":1}", Vec::new());
        assert_eq!(out.len(), 1);
        assert_eq!(
            carried(&out[0]),
            Some(Some("{\"type\":\"ping\"}\n{\"x\":1}".to_owned()))
        );
        let mut parser = crate::sse::Parser::default();
        parser.push(&out[0]);
        let parsed = parser.next_event(false).expect("an event");
        assert_eq!(parsed.data, None);
        assert_eq!(carried(b"data: {}\n\n"), None);
    }
}
