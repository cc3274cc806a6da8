//! OpenAI Chat Completions (`POST {base_url}/chat/completions`): the client's
//! own protocol, so requests go as they came with `model` rewritten, and
//! answers, errors and stream events come back untranslated.

use bytes::Bytes;

use super::{Adapter, Malformed, StreamTranslator, TargetModel, Unsupported};
use crate::request::{ChatRequest, EmbeddingsRequest};

/// The OpenAI-compatible protocol (`protocol: openai`, the default).
#[derive(Debug)]
pub struct OpenAi;

impl Adapter for OpenAi {
    fn name(&self) -> &'static str {
        "openai"
    }

    fn chat_path(&self) -> &'static str {
        "chat/completions"
    }

    fn required_headers(&self) -> &'static [(&'static str, &'static str)] {
        &[]
    }

    fn key_header(&self) -> (&'static str, &'static str) {
        ("authorization", "Bearer ")
    }

    fn embeddings_path(&self) -> Option<&'static str> {
        Some("embeddings")
    }

    fn encode(
        &self,
        request: &ChatRequest<'_>,
        target: TargetModel<'_>,
    ) -> Result<Bytes, Unsupported> {
        if refuses_max_tokens(target.model) {
            if let Some(body) = with_completion_limit(request, target.model) {
                return Ok(body);
            }
        }
        Ok(request.with_model(target.model))
    }

    fn encode_embeddings(
        &self,
        request: &EmbeddingsRequest<'_>,
        model: &str,
    ) -> Result<Bytes, Unsupported> {
        Ok(request.with_model(model))
    }

    fn decode_answer(&self, body: Bytes, _model: &str) -> Result<Bytes, Malformed> {
        Ok(body)
    }

    fn stream_translator(
        &self,
        _include_usage: bool,
        _model: &str,
    ) -> Option<Box<dyn StreamTranslator>> {
        None
    }
}

/// OpenAI's reasoning models (o1, o3, o4-mini, the gpt-5 family) refuse
/// `max_tokens` ("Use 'max_completion_tokens' instead") with a 400, which
/// every client of another protocol sends through its translation, and many
/// chat clients still send.
fn refuses_max_tokens(model: &str) -> bool {
    let family = |prefix: &str| {
        model
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
    };
    model.starts_with("gpt-5")
        || ["o1", "o3", "o4", "o4-mini", "o3-mini"]
            .into_iter()
            .any(family)
}

/// The body with `max_tokens` as `max_completion_tokens` (kept if both are
/// given) and `model` rewritten; `None` when it has no `max_tokens`.
fn with_completion_limit(request: &ChatRequest<'_>, model: &str) -> Option<Bytes> {
    let mut object = request.to_object().ok()?;
    let limit = object.remove("max_tokens")?;
    if !limit.is_null() {
        object.entry("max_completion_tokens").or_insert(limit);
    }
    object.insert("model".into(), model.into());
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_models_get_max_completion_tokens() {
        for (model, renamed) in [
            ("o1", true),
            ("o3-mini", true),
            ("o4-mini-2025-04-16", true),
            ("gpt-5", true),
            ("gpt-5-mini", true),
            ("gpt-4o", false),
            ("o1x", false),
            ("llama-3.1-8b", false),
        ] {
            assert_eq!(refuses_max_tokens(model), renamed, "{model}");
        }
        let body = br#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
        let request = ChatRequest::parse(body).unwrap();
        let sent = OpenAi
            .encode(
                &request,
                TargetModel {
                    model: "o3-mini",
                    max_output: None,
                },
            )
            .unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(sent["max_completion_tokens"], 64, "{sent}");
        assert!(sent.get("max_tokens").is_none(), "{sent}");
        assert_eq!(sent["model"], "o3-mini");
        let both = br#"{"model":"m","max_tokens":64,"max_completion_tokens":80,"messages":[{"role":"user","content":"hi"}]}"#;
        let request = ChatRequest::parse(both).unwrap();
        let sent = OpenAi
            .encode(
                &request,
                TargetModel {
                    model: "gpt-5",
                    max_output: None,
                },
            )
            .unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(sent["max_completion_tokens"], 80, "{sent}");
        assert!(sent.get("max_tokens").is_none(), "{sent}");
        // Any other model gets the body as sent.
        let sent = OpenAi
            .encode(
                &ChatRequest::parse(body).unwrap(),
                TargetModel {
                    model: "gpt-4o",
                    max_output: None,
                },
            )
            .unwrap();
        assert!(std::str::from_utf8(&sent)
            .unwrap()
            .contains(r#""max_tokens":64"#));
    }
}
