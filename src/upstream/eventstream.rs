//! AWS's binary event stream (`application/vnd.amazon.eventstream`, the
//! framing of Bedrock's ConverseStream), read with AWS's own decoder, which
//! checks each message's prelude and message CRCs. Each message becomes the
//! JSON text a protocol's stream translator reads: `{"<event-type>":
//! <payload>}` for an event, `{"<exception-type>": <payload>}` for an
//! exception, so a translator sees one tagged object per message, as SSE
//! protocols give it one `data:` per event.

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::Message;
use bytes::BytesMut;

/// What one read of the stream gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// A whole message, as tagged JSON text.
    Message(String),
    /// A message that fails its CRCs or is not a JSON event: the stream is broken.
    Corrupt,
}

/// Messages out of the bytes of one stream.
#[derive(Debug, Default)]
pub struct Frames {
    buffer: BytesMut,
    decoder: MessageFrameDecoder,
    corrupt: bool,
}

impl Frames {
    /// Appends bytes read from the upstream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet form a whole message.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// The next whole message, if any. After a corrupt one nothing more is
    /// read: framing lost once cannot be found again.
    pub fn next_message(&mut self) -> Option<Read> {
        if self.corrupt {
            return None;
        }
        match self.decoder.decode_frame(&mut self.buffer) {
            Ok(DecodedFrame::Incomplete) => None,
            Ok(DecodedFrame::Complete(message)) => {
                let tagged = tagged(&message);
                if tagged.is_none() {
                    self.corrupt = true;
                }
                Some(tagged.map_or(Read::Corrupt, Read::Message))
            }
            Err(_) => {
                self.corrupt = true;
                Some(Read::Corrupt)
            }
        }
    }
}

/// `{"<type>": <payload>}` for an event or an exception, `None` for a
/// message that is neither or whose payload is not JSON.
fn tagged(message: &Message) -> Option<String> {
    let header = |name: &str| {
        message
            .headers()
            .iter()
            .find(|h| h.name().as_str() == name)
            .and_then(|h| h.value().as_string().ok())
            .map(|v| v.as_str().to_owned())
    };
    let kind = match header(":message-type").as_deref() {
        Some("event") => header(":event-type")?,
        Some("exception") => header(":exception-type")?,
        // An `error` message carries its code in a header and no JSON; it is
        // tagged as an exception, so a translator cannot take it for an
        // event type it does not know.
        Some("error") => {
            let code = header(":error-code").unwrap_or_else(|| "unknownError".into());
            let text = header(":error-message").unwrap_or_default();
            let name = if code.ends_with("Exception") {
                code
            } else {
                format!("{code}Exception")
            };
            return Some(serde_json::json!({ name: { "message": text } }).to_string());
        }
        _ => return None,
    };
    let payload = message.payload();
    let payload = if payload.is_empty() {
        "{}"
    } else {
        std::str::from_utf8(payload).ok()?
    };
    serde_json::from_str::<serde::de::IgnoredAny>(payload).ok()?;
    Some(format!("{{{}:{payload}}}", serde_json::Value::String(kind)))
}

#[cfg(test)]
mod tests {
    use super::{Frames, Read};
    use aws_smithy_eventstream::frame::write_message_to;
    use aws_smithy_types::event_stream::{Header, HeaderValue, Message};
    use bytes::Bytes;

    fn encoded(kind: &str, name: &str, payload: &str) -> Vec<u8> {
        let header = if kind == "event" {
            ":event-type"
        } else {
            ":exception-type"
        };
        let message = Message::new(Bytes::from(payload.to_owned()))
            .add_header(Header::new(
                ":message-type",
                HeaderValue::String(kind.to_owned().into()),
            ))
            .add_header(Header::new(
                header,
                HeaderValue::String(name.to_owned().into()),
            ))
            .add_header(Header::new(
                ":content-type",
                HeaderValue::String("application/json".into()),
            ));
        let mut out = Vec::new();
        write_message_to(&message, &mut out).unwrap();
        out
    }

    #[test]
    fn messages_come_out_whole_and_tagged_however_the_bytes_are_cut() {
        let mut bytes = encoded("event", "messageStart", r#"{"role":"assistant"}"#);
        bytes.extend(encoded(
            "event",
            "contentBlockDelta",
            r#"{"contentBlockIndex":0,"delta":{"text":"Hi"}}"#,
        ));
        bytes.extend(encoded(
            "exception",
            "throttlingException",
            r#"{"message":"slow down"}"#,
        ));
        let mut frames = Frames::default();
        let mut seen = Vec::new();
        for byte in &bytes {
            frames.push(std::slice::from_ref(byte));
            while let Some(read) = frames.next_message() {
                seen.push(read);
            }
        }
        assert_eq!(
            seen,
            vec![
                Read::Message(r#"{"messageStart":{"role":"assistant"}}"#.into()),
                Read::Message(
                    r#"{"contentBlockDelta":{"contentBlockIndex":0,"delta":{"text":"Hi"}}}"#.into()
                ),
                Read::Message(r#"{"throttlingException":{"message":"slow down"}}"#.into()),
            ]
        );
        assert_eq!(frames.pending(), 0);
    }

    #[test]
    fn a_message_whose_crc_fails_breaks_the_stream() {
        let mut bytes = encoded("event", "messageStop", r#"{"stopReason":"end_turn"}"#);
        let last = bytes.len() - 5;
        bytes[last] ^= 0xff; // a payload byte: the message CRC no longer matches
        bytes.extend(encoded("event", "messageStart", r#"{"role":"assistant"}"#));
        let mut frames = Frames::default();
        frames.push(&bytes);
        assert_eq!(frames.next_message(), Some(Read::Corrupt));
        assert_eq!(
            frames.next_message(),
            None,
            "nothing is read after lost framing"
        );
    }

    #[test]
    fn an_error_message_is_tagged_as_an_exception() {
        let message = Message::new(Bytes::new())
            .add_header(Header::new(
                ":message-type",
                HeaderValue::String("error".into()),
            ))
            .add_header(Header::new(
                ":error-code",
                HeaderValue::String("InternalFailure".into()),
            ))
            .add_header(Header::new(
                ":error-message",
                HeaderValue::String("boom".into()),
            ));
        let mut bytes = Vec::new();
        write_message_to(&message, &mut bytes).unwrap();
        let mut frames = Frames::default();
        frames.push(&bytes);
        assert_eq!(
            frames.next_message(),
            Some(Read::Message(
                r#"{"InternalFailureException":{"message":"boom"}}"#.into()
            ))
        );
    }

    #[test]
    fn a_payload_that_is_not_json_is_corrupt() {
        let mut frames = Frames::default();
        frames.push(&encoded("event", "contentBlockDelta", "not json"));
        assert_eq!(frames.next_message(), Some(Read::Corrupt));
    }
}
