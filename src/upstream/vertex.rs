//! Vertex AI (`protocol: vertex`): two model families behind one Google
//! Cloud endpoint and one OAuth2 identity. Gemini models speak Gemini's
//! `generateContent` (the translation of [`super::gemini`]); Anthropic models
//! (`claude-…`) speak the Messages API through `rawPredict`, with
//! `anthropic_version: vertex-2023-10-16` in the body instead of a header and
//! the model in the URL instead of the body (the translation of
//! [`super::anthropic`]).

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::Value;

use super::anthropic::Anthropic;
use super::auth::{Auth, GoogleToken};
use super::gemini::Gemini;
use super::{
    Adapter, ErrorAnswer, Malformed, Operation, Place, PlaceError, StreamTranslator, TargetModel,
    Unsupported,
};
use crate::request::{ChatRequest, EmbeddingsRequest};

/// The `anthropic_version` Vertex AI's Anthropic models require in the body.
pub const VERTEX_ANTHROPIC_VERSION: &str = "vertex-2023-10-16";

/// Vertex AI (`protocol: vertex`).
#[derive(Debug)]
pub struct Vertex;

/// Whether a Vertex model is one of Anthropic's (published by `anthropic`).
fn is_claude(model: &str) -> bool {
    model.starts_with("claude")
}

impl Adapter for Vertex {
    fn name(&self) -> &'static str {
        "vertex"
    }

    fn chat_path(&self) -> &'static str {
        "publishers/google/models/{model}:generateContent (Anthropic models: publishers/anthropic/models/{model}:rawPredict)"
    }

    fn call_path(&self, op: Operation, model: &str, stream: bool) -> Option<String> {
        let (publisher, method) = match (is_claude(model), stream) {
            (true, false) => ("anthropic", "rawPredict"),
            (true, true) => ("anthropic", "streamRawPredict"),
            (false, false) => ("google", "generateContent"),
            (false, true) => ("google", "streamGenerateContent?alt=sse"),
        };
        let model = super::path_segment(model);
        match op {
            Operation::Chat => Some(format!("publishers/{publisher}/models/{model}:{method}")),
            Operation::Embeddings | Operation::CountTokens => None,
        }
    }

    fn default_base_url(&self, place: &Place<'_>) -> Result<String, String> {
        let (Some(project), Some(location)) = (place.project, place.location) else {
            return Err("`protocol: vertex` needs `project` and `location` (or `base_url`)".into());
        };
        Ok(if location == "global" {
            format!("https://aiplatform.googleapis.com/v1/projects/{project}/locations/global")
        } else {
            format!(
                "https://{location}-aiplatform.googleapis.com/v1/projects/{project}/locations/{location}"
            )
        })
    }

    fn place_keys(&self) -> &'static [&'static str] {
        &["project", "location", "credentials_file"]
    }

    fn place_required(&self) -> &'static [&'static str] {
        &["project", "location"]
    }

    fn auth(&self, place: &Place<'_>, _base_url: &str) -> Result<Option<Auth>, PlaceError> {
        GoogleToken::new(place.credentials.cloned())
            .map(|token| Some(Auth::Google(token)))
            .map_err(|e| PlaceError {
                key: Some("credentials_file"),
                message: e.0,
            })
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

    fn encode(
        &self,
        request: &ChatRequest<'_>,
        target: TargetModel<'_>,
    ) -> Result<Bytes, Unsupported> {
        if !is_claude(target.model) {
            return Gemini.encode(request, target);
        }
        let messages = Anthropic.encode(request, target)?;
        let Ok(Value::Object(mut body)) = serde_json::from_slice::<Value>(&messages) else {
            return Err(Unsupported("the Messages body is not an object".into()));
        };
        body.remove("model");
        body.insert(
            "anthropic_version".into(),
            Value::String(VERTEX_ANTHROPIC_VERSION.into()),
        );
        Ok(Bytes::from(Value::Object(body).to_string()))
    }

    fn encode_embeddings(
        &self,
        _request: &EmbeddingsRequest<'_>,
        _model: &str,
    ) -> Result<Bytes, Unsupported> {
        Err(Unsupported(
            "switchyard reaches Vertex AI embeddings through `protocol: gemini` only".into(),
        ))
    }

    fn decode_answer(&self, body: Bytes, model: &str) -> Result<Bytes, Malformed> {
        if is_claude(model) {
            Anthropic.decode_answer(body, model)
        } else {
            Gemini.decode_answer(body, model)
        }
    }

    fn decode_error(&self, status: StatusCode, headers: &HeaderMap, body: Bytes) -> ErrorAnswer {
        // Vertex answers in Google's shape for what it refuses itself (its
        // quota, its auth), in Anthropic's for what the model refused.
        let anthropic = serde_json::from_slice::<Value>(&body)
            .ok()
            .is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("error"));
        if anthropic {
            Anthropic.decode_error(status, headers, body)
        } else {
            Gemini.decode_error(status, headers, body)
        }
    }

    fn stream_translator(
        &self,
        include_usage: bool,
        model: &str,
    ) -> Option<Box<dyn StreamTranslator>> {
        if is_claude(model) {
            Anthropic.stream_translator(include_usage, model)
        } else {
            Gemini.stream_translator(include_usage, model)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_has_its_own_path() {
        let path = |model, stream| Vertex.call_path(Operation::Chat, model, stream).unwrap();
        assert_eq!(
            path("gemini-2.0-flash", false),
            "publishers/google/models/gemini-2.0-flash:generateContent"
        );
        assert_eq!(
            path("gemini-2.0-flash", true),
            "publishers/google/models/gemini-2.0-flash:streamGenerateContent?alt=sse"
        );
        assert_eq!(
            path("claude-sonnet-4@20250514", false),
            "publishers/anthropic/models/claude-sonnet-4@20250514:rawPredict"
        );
        assert_eq!(
            path("claude-sonnet-4@20250514", true),
            "publishers/anthropic/models/claude-sonnet-4@20250514:streamRawPredict"
        );
    }

    #[test]
    fn a_model_name_never_leaves_its_path_segment() {
        let path = |model| Vertex.call_path(Operation::Chat, model, false).unwrap();
        assert_eq!(
            path("claude/../../../v1beta/models/x"),
            "publishers/anthropic/models/claude%2F..%2F..%2F..%2Fv1beta%2Fmodels%2Fx:rawPredict"
        );
        assert_eq!(
            path("g?key=LEAK#x y"),
            "publishers/google/models/g%3Fkey%3DLEAK%23x%20y:generateContent"
        );
        let gemini = super::super::gemini::Gemini;
        assert_eq!(
            gemini
                .call_path(Operation::Chat, "models/g-ok?key=x", false)
                .unwrap(),
            "models/g-ok%3Fkey%3Dx:generateContent"
        );
    }

    #[test]
    fn the_endpoint_follows_the_location() {
        let place = |location| Place {
            project: Some("p"),
            location: Some(location),
            ..Place::default()
        };
        assert_eq!(
            Vertex.default_base_url(&place("us-east5")).unwrap(),
            "https://us-east5-aiplatform.googleapis.com/v1/projects/p/locations/us-east5"
        );
        assert_eq!(
            Vertex.default_base_url(&place("global")).unwrap(),
            "https://aiplatform.googleapis.com/v1/projects/p/locations/global"
        );
        assert!(Vertex.default_base_url(&Place::default()).is_err());
    }

    #[test]
    fn a_claude_body_has_the_vertex_version_and_no_model() {
        let body = br#"{"model":"x","messages":[{"role":"user","content":"hi"}],"max_tokens":10}"#;
        let request = ChatRequest::parse(body).unwrap();
        let target = TargetModel {
            model: "claude-sonnet-4@20250514",
            max_output: None,
        };
        let sent: Value =
            serde_json::from_slice(&Vertex.encode(&request, target).unwrap()).unwrap();
        assert_eq!(sent["anthropic_version"], VERTEX_ANTHROPIC_VERSION);
        assert!(sent.get("model").is_none());
        assert_eq!(sent["max_tokens"], 10);
        assert_eq!(sent["messages"][0]["role"], "user");
    }

    #[test]
    fn errors_are_read_in_whichever_shape_they_come() {
        let google = Bytes::from_static(
            br#"{"error":{"code":429,"message":"Quota exceeded","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"7s"}]}}"#,
        );
        let read = Vertex.decode_error(StatusCode::TOO_MANY_REQUESTS, &HeaderMap::new(), google);
        assert_eq!(read.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(read.wait, Some(std::time::Duration::from_secs(7)));
        let anthropic = Bytes::from_static(
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        let read = Vertex.decode_error(
            StatusCode::from_u16(529).unwrap(),
            &HeaderMap::new(),
            anthropic,
        );
        let v: Value = serde_json::from_slice(&read.body).unwrap();
        assert_eq!(v["error"]["message"], "Overloaded");
    }
}
