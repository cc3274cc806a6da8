//! The embeddings request (`POST /v1/embeddings`) as the gateway reads it:
//! `model` and `input` checked, the rest forwarded as the client sent it.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{model, object, raw_even_null, span_in, string, with_model, RequestError};
use crate::tokens;

#[derive(Deserialize)]
#[serde(expecting = "a JSON object")]
struct Wire<'a> {
    #[serde(borrow, default, deserialize_with = "raw_even_null")]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    encoding_format: Option<&'a RawValue>,
    #[serde(borrow, default)]
    dimensions: Option<&'a RawValue>,
}

/// The parsed view of one embeddings request.
#[derive(Debug)]
pub struct EmbeddingsRequest<'a> {
    body: &'a [u8],
    /// `model`, if given.
    pub model: Option<Cow<'a, str>>,
    model_span: Option<Range<usize>>,
    /// Estimated input tokens.
    pub input_tokens: u64,
    /// `encoding_format: base64`: the vectors go back as base64 float32.
    pub base64: bool,
}

impl<'a> EmbeddingsRequest<'a> {
    /// Parses a request body, refusing what cannot be an embeddings request:
    /// not a JSON object; `input` missing, empty, or not a string, an array
    /// of strings, of token ids, or of arrays of token ids; `model` not a
    /// string; `encoding_format` not `float` or `base64`; `dimensions` not a
    /// positive integer.
    ///
    /// # Errors
    /// The first such problem, naming its field.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        let wire: Wire<'a> = object(body)?;
        let model = model(wire.model)?;
        let input_tokens = input_tokens(wire.input)?;
        let mut base64 = false;
        if let Some(raw) = wire.encoding_format.filter(|r| r.get() != "null") {
            let format = string(raw);
            base64 = format.as_deref() == Some("base64");
            if !matches!(format.as_deref(), Some("float" | "base64")) {
                return Err(RequestError::field(
                    "encoding_format",
                    "`encoding_format` must be `float` or `base64`",
                ));
            }
        }
        if let Some(raw) = wire.dimensions.filter(|r| r.get() != "null") {
            if !serde_json::from_str::<u32>(raw.get()).is_ok_and(|d| d > 0) {
                return Err(RequestError::field(
                    "dimensions",
                    "`dimensions` must be a positive integer",
                ));
            }
        }
        Ok(Self {
            body,
            model,
            model_span: wire.model.and_then(|raw| span_in(body, raw)),
            input_tokens,
            base64,
        })
    }

    /// The body with `model` set to `model`, the rest as the client sent it.
    #[must_use]
    pub fn with_model(&self, model: &str) -> Bytes {
        with_model(self.body, self.model_span.as_ref(), model)
    }

    /// The body as a JSON object, for a protocol that rewrites it whole.
    ///
    /// # Errors
    /// Only if the body is not a JSON object (parse checked it is).
    pub fn to_object(
        &self,
    ) -> Result<serde_json::Map<String, serde_json::Value>, serde_json::Error> {
        serde_json::from_slice(self.body)
    }
}

/// An OpenAI embeddings answer with each vector given as numbers turned into
/// base64 of little-endian float32, as `encoding_format: base64` asks;
/// vectors already in base64, and bodies that are no such answer, as they are.
#[must_use]
pub fn as_base64(body: Bytes) -> Bytes {
    use base64::Engine as _;
    // The common case, an upstream that honoured the ask, costs a byte scan.
    let numbers = memchr::memmem::find(&body, b"\"embedding\":[").is_some()
        || memchr::memmem::find(&body, b"\"embedding\": [").is_some();
    if !numbers {
        return body;
    }
    let Ok(mut answer) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    let Some(data) = answer.get_mut("data").and_then(|d| d.as_array_mut()) else {
        return body;
    };
    let mut changed = false;
    for item in data {
        let Some(vector) = item.get("embedding").and_then(|e| e.as_array()) else {
            continue;
        };
        let mut bytes = Vec::with_capacity(vector.len() * 4);
        for x in vector {
            let Some(x) = x.as_f64() else {
                return body;
            };
            #[allow(clippy::cast_possible_truncation)] // float32 is the format
            bytes.extend_from_slice(&(x as f32).to_le_bytes());
        }
        let text = base64::engine::general_purpose::STANDARD.encode(&bytes);
        item["embedding"] = serde_json::Value::String(text);
        changed = true;
    }
    if !changed {
        return body;
    }
    Bytes::from(answer.to_string())
}

/// One `input` entry as it may be written.
#[derive(Deserialize)]
#[serde(untagged)]
enum Item<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    // Only the shape matters: the ids are forwarded as sent.
    Token(#[expect(dead_code, reason = "read to check the shape only")] u64),
    Tokens(Vec<u64>),
}

/// `input`'s estimated tokens, checking its shape.
fn input_tokens(raw: Option<&RawValue>) -> Result<u64, RequestError> {
    let bad = || {
        RequestError::field(
            "input",
            "`input` must be a string, an array of strings, an array of token ids or an array of token id arrays",
        )
    };
    let Some(raw) = raw.filter(|r| r.get() != "null") else {
        return Err(RequestError::field("input", "`input` is required"));
    };
    let items: Vec<Item<'_>> = match serde_json::from_str::<Item<'_>>(raw.get()) {
        Ok(Item::Text(text)) => vec![Item::Text(text)],
        Ok(Item::Tokens(ids)) => vec![Item::Tokens(ids)],
        Ok(Item::Token(_)) => return Err(bad()),
        Err(_) => serde_json::from_str(raw.get()).map_err(|_| bad())?,
    };
    let empty = |item: &Item<'_>| matches!(item, Item::Tokens(ids) if ids.is_empty());
    if items.is_empty() || items.iter().any(empty) {
        return Err(RequestError::field("input", "`input` must not be empty"));
    }
    let mut total = 0u64;
    let mut kinds = [false; 3];
    for item in &items {
        let (kind, n) = match item {
            Item::Text(text) => (0, tokens::estimate_text(text)),
            Item::Token(_) => (1, 1),
            Item::Tokens(ids) => (2, ids.len() as u64),
        };
        kinds[kind] = true;
        total += n;
    }
    if kinds.iter().filter(|k| **k).count() > 1 {
        return Err(bad());
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    #[test]
    fn vectors_given_as_numbers_become_base64_float32() {
        let answer = bytes::Bytes::from_static(
            br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[1.0,-0.5]},{"object":"embedding","index":1,"embedding":"AACAPw=="}],"model":"m"}"#,
        );
        let out: serde_json::Value = serde_json::from_slice(&super::as_base64(answer)).unwrap();
        // 1.0f32 = 00 00 80 3f, -0.5f32 = 00 00 00 bf (little-endian).
        assert_eq!(out["data"][0]["embedding"], "AACAPwAAAL8=");
        assert_eq!(
            out["data"][1]["embedding"], "AACAPw==",
            "already base64: as it was"
        );
        assert_eq!(out["model"], "m");
        let junk = bytes::Bytes::from_static(b"not json");
        assert_eq!(super::as_base64(junk.clone()), junk);
    }

    use super::*;

    #[test]
    fn every_input_shape_is_read_and_the_rest_is_kept() {
        for body in [
            r#"{"model":"e","input":"hello world"}"#,
            r#"{"model":"e","input":["a","b"]}"#,
            r#"{"model":"e","input":[1,2,3]}"#,
            r#"{"model":"e","input":[[1,2],[3]],"encoding_format":"base64","dimensions":256}"#,
        ] {
            let r = EmbeddingsRequest::parse(body.as_bytes()).unwrap();
            assert!(r.input_tokens >= 1, "{body}");
            let out = r.with_model("text-embedding-3-small");
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["model"], "text-embedding-3-small");
            let mut expected: serde_json::Value = serde_json::from_str(body).unwrap();
            expected["model"] = "text-embedding-3-small".into();
            assert_eq!(v, expected);
        }
    }

    #[test]
    fn bad_requests_name_their_field() {
        for (body, param) in [
            (r#"{"model":"e"}"#, "input"),
            (r#"{"model":"e","input":[]}"#, "input"),
            (r#"{"model":"e","input":[[1],[]]}"#, "input"),
            (r#"{"model":"e","input":{"a":1}}"#, "input"),
            (r#"{"model":"e","input":["a",1]}"#, "input"),
            (r#"{"model":"e","input":7}"#, "input"),
            (r#"{"model":3,"input":"x"}"#, "model"),
            (
                r#"{"input":"x","encoding_format":"int8"}"#,
                "encoding_format",
            ),
            (r#"{"input":"x","dimensions":0}"#, "dimensions"),
        ] {
            let e = EmbeddingsRequest::parse(body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
        let e = EmbeddingsRequest::parse(b"[1]").unwrap_err();
        assert_eq!(e.param, None);
    }
}
