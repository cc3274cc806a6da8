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
        if let Some(raw) = wire.encoding_format.filter(|r| r.get() != "null") {
            if !matches!(string(raw).as_deref(), Some("float" | "base64")) {
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
