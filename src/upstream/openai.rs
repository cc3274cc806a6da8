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
