//! The chat chunk events a protocol's stream translator writes, as typed
//! wire structs (the compiler checks their shape; no `Value` tree is built
//! per event).

use crate::sse::Chunk as Reading;
use bytes::Bytes;
use serde::Serialize;

/// A chat event a translator wrote, with what the engine reads of it: the
/// writer knows, so the commit point and the relay never parse it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// `data: {json}\n\n`.
    pub raw: Bytes,
    /// What [`crate::sse::classify_data`] would read from it.
    pub reading: Reading,
}

impl Frame {
    /// The last event of every chat stream.
    pub const DONE: Frame = Frame {
        raw: Bytes::from_static(b"data: [DONE]\n\n"),
        reading: Reading::Done,
    };

    /// One SSE event carrying `v`, read as the engine reads any event (for
    /// the rare ones whose reading is not known by construction: errors).
    #[must_use]
    pub fn read(v: &impl Serialize) -> Frame {
        let raw = sse(v);
        let reading = Reading::Empty;
        let mut frame = Frame { raw, reading };
        frame.reading = crate::sse::classify_data(frame.data());
        frame
    }

    /// Its `data:` (every frame is one `data: {json}\n\n` line, by construction).
    #[must_use]
    pub fn data(&self) -> &str {
        let json = self.raw.get(6..self.raw.len().saturating_sub(2));
        json.and_then(|j| std::str::from_utf8(j).ok())
            .unwrap_or_default()
    }
}

/// What every chunk of one stream repeats.
#[derive(Debug, Default)]
pub struct Head {
    /// The answer's id.
    pub id: String,
    /// Unix seconds, one value per stream.
    pub created: u64,
    /// The model the upstream says answered.
    pub model: String,
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: &'a [Choice<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    delta: Delta<'a>,
    finish_reason: Option<&'a str>,
}

/// One chunk's `delta`.
#[derive(Serialize, Default)]
pub struct Delta<'a> {
    /// `assistant`, on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// A piece of the text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    /// A piece of a refusal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<&'a str>,
    /// Reasoning text, as OpenAI-compatible reasoning models stream it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    /// Pieces of tool calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<[CallDelta<'a>; 1]>,
}

impl Delta<'_> {
    /// What the engine counts as content: non-empty text or refusal, or a
    /// tool call (as [`crate::sse::classify_data`] reads it).
    fn has_content(&self) -> bool {
        let non_empty = |s: Option<&str>| s.is_some_and(|s| !s.is_empty());
        non_empty(self.content)
            || non_empty(self.refusal)
            || non_empty(self.reasoning_content)
            || self.tool_calls.is_some()
    }
}

/// A piece of one tool call: its opening (id, name) or its arguments.
#[derive(Serialize)]
pub struct CallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// OpenAI's `usage`.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<Cached>,
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<Reasoning>,
}

#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
struct Cached {
    cached_tokens: u64,
}

#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
struct Reasoning {
    reasoning_tokens: u64,
}

impl Usage {
    /// From counts (saturating: they are the upstream's, and may be absurd);
    /// zero cached or reasoning tokens are left out.
    #[must_use]
    pub fn new(prompt: u64, completion: u64, cached: u64, reasoning: u64) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            prompt_tokens_details: (cached > 0).then_some(Cached {
                cached_tokens: cached,
            }),
            completion_tokens_details: (reasoning > 0).then_some(Reasoning {
                reasoning_tokens: reasoning,
            }),
        }
    }
}

impl Head {
    /// A chunk of `delta` (and the answer's finish, on its last).
    #[must_use]
    pub fn delta(&self, delta: Delta<'_>, finish_reason: Option<&str>) -> Frame {
        let finished = finish_reason.is_some();
        let reading = if delta.has_content() {
            Reading::Content { finished }
        } else {
            Reading::NoContent { finished }
        };
        let choices = [Choice {
            index: 0,
            delta,
            finish_reason,
        }];
        Frame {
            raw: self.event(&choices, None),
            reading,
        }
    }

    /// The opening chunk: the role, and empty content.
    #[must_use]
    pub fn role(&self) -> Frame {
        self.delta(
            Delta {
                role: Some("assistant"),
                content: Some(""),
                ..Delta::default()
            },
            None,
        )
    }

    /// A piece of text: the chunk of every token, so written by hand, byte
    /// for byte as [`Head::delta`] writes it.
    #[must_use]
    pub fn text(&self, text: &str) -> Frame {
        let mut out = Vec::with_capacity(160 + self.id.len() + self.model.len() + text.len());
        out.extend_from_slice(b"data: {\"id\":");
        json_string(&mut out, &self.id);
        out.extend_from_slice(b",\"object\":\"chat.completion.chunk\",\"created\":");
        // Writing a number into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &self.created);
        out.extend_from_slice(b",\"model\":");
        json_string(&mut out, &self.model);
        out.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
        json_string(&mut out, text);
        out.extend_from_slice(b"},\"finish_reason\":null}]}\n\n");
        let reading = if text.is_empty() {
            Reading::NoContent { finished: false }
        } else {
            Reading::Content { finished: false }
        };
        Frame {
            raw: Bytes::from(out),
            reading,
        }
    }

    /// A piece of reasoning text.
    #[must_use]
    pub fn reasoning(&self, text: &str) -> Frame {
        self.delta(
            Delta {
                reasoning_content: Some(text),
                ..Delta::default()
            },
            None,
        )
    }

    /// The opening of tool call `index`.
    #[must_use]
    pub fn call(&self, index: usize, id: &str, name: &str) -> Frame {
        let call = CallDelta {
            index,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: "",
            },
        };
        self.calls(call)
    }

    /// A piece of tool call `index`'s arguments.
    #[must_use]
    pub fn arguments(&self, index: usize, piece: &str) -> Frame {
        let call = CallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: piece,
            },
        };
        self.calls(call)
    }

    fn calls(&self, call: CallDelta<'_>) -> Frame {
        self.delta(
            Delta {
                tool_calls: Some([call]),
                ..Delta::default()
            },
            None,
        )
    }

    /// The usage chunk (no choices), as `stream_options.include_usage` asks.
    #[must_use]
    pub fn usage(&self, usage: Usage) -> Frame {
        Frame {
            raw: self.event(&[], Some(usage)),
            reading: Reading::NoContent { finished: false },
        }
    }

    fn event(&self, choices: &[Choice<'_>], usage: Option<Usage>) -> Bytes {
        sse(&Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        })
    }
}

/// Seconds since the Unix epoch, a chat answer's `created` (0 if the clock
/// is before it).
#[must_use]
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh `chatcmpl-` id, for an answer whose protocol gives none.
#[must_use]
pub fn completion_id() -> String {
    format!("chatcmpl-{:024x}", rand::random::<u128>() >> 32)
}

/// `text` as a JSON string, as serde_json writes it: between quotes as it
/// is when nothing in it needs an escape (nearly every piece of text).
fn json_string(out: &mut Vec<u8>, text: &str) {
    if text.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        // Writing a string into a Vec cannot fail.
        let _ = serde_json::to_writer(out, text);
    }
}

/// One SSE event carrying `v`.
#[must_use]
pub fn sse(v: &impl Serialize) -> Bytes {
    let mut out = Vec::with_capacity(192);
    out.extend_from_slice(b"data: ");
    // Serializing these structs cannot fail (string keys, no maps).
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(frame: &Frame) -> serde_json::Value {
        let s = std::str::from_utf8(&frame.raw).unwrap();
        serde_json::from_str(
            s.strip_prefix("data: ")
                .unwrap()
                .strip_suffix("\n\n")
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn chunks_have_the_chat_shape() {
        let head = Head {
            id: "x".into(),
            created: 3,
            model: "m".into(),
        };
        let role = data(&head.role());
        assert_eq!(role["object"], "chat.completion.chunk");
        assert_eq!(
            role["choices"][0]["delta"],
            serde_json::json!({"role": "assistant", "content": ""})
        );
        assert!(role["choices"][0]["finish_reason"].is_null());
        let call = data(&head.call(1, "c", "f"));
        assert_eq!(
            call["choices"][0]["delta"]["tool_calls"][0],
            serde_json::json!({"index": 1, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}})
        );
        let end = data(&head.delta(Delta::default(), Some("stop")));
        assert_eq!(end["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(end["choices"][0]["finish_reason"], "stop");
        let usage = data(&head.usage(Usage::new(5, 2, 0, 1)));
        assert_eq!(usage["choices"], serde_json::json!([]));
        assert_eq!(
            usage["usage"],
            serde_json::json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                "completion_tokens_details": {"reasoning_tokens": 1}})
        );
    }

    #[test]
    fn a_text_chunk_is_written_as_serde_writes_it() {
        let texts = [
            "",
            "tok ",
            "quote \" and \\ slash /",
            "line\nbreak\ttab\u{1}\u{1f}",
            "caf\u{e9} \u{1f600} \u{7f}",
            "</script>",
        ];
        for (id, model) in [("x", "m"), ("msg_\"1", "claude\n"), ("", "")] {
            let head = Head {
                id: id.into(),
                created: 1_700_000_000,
                model: model.into(),
            };
            for text in texts {
                let by_serde = head.delta(
                    Delta {
                        content: Some(text),
                        ..Delta::default()
                    },
                    None,
                );
                assert_eq!(head.text(text), by_serde, "{text:?}");
            }
        }
    }

    #[test]
    fn each_frame_says_what_the_engine_would_read() {
        let head = Head::default();
        let frames = [
            head.role(),
            head.text("hi"),
            head.text(""),
            head.call(0, "c", "f"),
            head.arguments(0, "{}"),
            head.delta(
                Delta {
                    refusal: Some("no"),
                    ..Delta::default()
                },
                None,
            ),
            head.delta(Delta::default(), Some("stop")),
            head.delta(
                Delta {
                    content: Some("last"),
                    ..Delta::default()
                },
                Some("length"),
            ),
            head.usage(Usage::new(1, 2, 0, 0)),
            Frame::read(&serde_json::json!({"error": {"message": "slow", "code": 429}})),
            Frame::DONE,
        ];
        for frame in frames {
            let text = std::str::from_utf8(&frame.raw).unwrap();
            let data = text.strip_prefix("data: ").unwrap().trim_end();
            assert_eq!(frame.reading, crate::sse::classify_data(data), "{text}");
        }
        assert_eq!(
            Frame::read(&serde_json::json!({"error": {"code": 429}})).reading,
            Reading::Error { code: Some(429) }
        );
    }
}
