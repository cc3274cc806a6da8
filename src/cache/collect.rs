//! A streamed answer put back together as the completion it made, so that a
//! stream can be cached whole: text, refusal and tool calls per choice,
//! each choice's finish, the usage.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// The most answer text a stream may carry and still be cached.
const MAX_COLLECTED_BYTES: usize = 4 << 20;

/// The chunks of one stream, folded as they go by.
#[derive(Debug, Default)]
pub struct Collector {
    /// `id`, `created`, `model`, `system_fingerprint` of the first chunk.
    envelope: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    usage: Option<Value>,
    bytes: usize,
    /// Something was not a chunk, or the answer is too long: not cached.
    spoiled: bool,
}

#[derive(Debug, Default)]
struct Choice {
    content: Option<String>,
    refusal: Option<String>,
    /// The reasoning some servers stream beside the answer (`reasoning_content`).
    reasoning: Option<String>,
    calls: BTreeMap<u64, Call>,
    /// Which call each fragment belongs to.
    slots: crate::sse::CallSlots,
    finish: Option<Value>,
}

#[derive(Debug, Default)]
struct Call {
    id: Option<Value>,
    name: String,
    arguments: String,
}

impl Collector {
    /// One chunk's `data`, as the client got it.
    pub fn push(&mut self, data: &str) {
        if self.spoiled || data.trim() == "[DONE]" {
            return;
        }
        self.bytes += data.len();
        let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(data) else {
            self.spoiled = true;
            return;
        };
        // Log probabilities are not replayed: a stream that carries them is not kept.
        let logprobs = chunk
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.get("logprobs").is_some_and(|l| !l.is_null()))
            });
        if self.bytes > MAX_COLLECTED_BYTES || chunk.contains_key("error") || logprobs {
            self.spoiled = true;
            return;
        }
        if self.envelope.is_empty() {
            for field in ["id", "created", "model", "system_fingerprint"] {
                if let Some(v) = chunk.get(field).filter(|v| !v.is_null()) {
                    self.envelope.insert(field.to_owned(), v.clone());
                }
            }
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(usage.clone());
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            self.choices.entry(index).or_default().fold(choice);
        }
    }

    /// The completion the stream made, if it is whole: at least one
    /// choice, each with its finish.
    #[must_use]
    pub fn completion(self) -> Option<Value> {
        let whole = !self.spoiled
            && !self.choices.is_empty()
            && self.choices.values().all(|c| c.finish.is_some());
        if !whole {
            return None;
        }
        let mut completion = self.envelope;
        completion.insert("object".into(), json!("chat.completion"));
        let choices = self
            .choices
            .into_iter()
            .map(|(index, c)| c.into_json(index))
            .collect();
        completion.insert("choices".into(), Value::Array(choices));
        if let Some(usage) = self.usage {
            completion.insert("usage".into(), usage);
        }
        Some(Value::Object(completion))
    }
}

impl Choice {
    fn fold(&mut self, choice: &Value) {
        if let Some(f) = choice.get("finish_reason").filter(|f| !f.is_null()) {
            self.finish = Some(f.clone());
        }
        let Some(delta) = choice.get("delta") else {
            return;
        };
        // A server that names reasoning both ways sends the same text twice.
        let reasoning = match delta.get("reasoning_content") {
            Some(Value::String(_)) => "reasoning_content",
            Some(_) | None => "reasoning",
        };
        for (field, into) in [
            ("content", &mut self.content),
            ("refusal", &mut self.refusal),
            (reasoning, &mut self.reasoning),
        ] {
            if let Some(piece) = delta.get(field).and_then(Value::as_str) {
                into.get_or_insert_with(String::new).push_str(piece);
            }
        }
        let calls = delta.get("tool_calls").and_then(Value::as_array);
        for (position, call) in calls.into_iter().flatten().enumerate() {
            let index = call
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            let id = call.get("id").and_then(Value::as_str);
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            let index = u64::from(self.slots.slot(index, id));
            let slot = self.calls.entry(index).or_default();
            if let Some(id) = call.get("id").filter(|v| !v.is_null()) {
                slot.id = Some(id.clone());
            }
            let function = call.get("function");
            let text = |field: &str| function.and_then(|f| f.get(field)).and_then(Value::as_str);
            if let Some(name) = text("name") {
                slot.name.push_str(name);
            }
            if let Some(arguments) = text("arguments") {
                slot.arguments.push_str(arguments);
            }
        }
    }

    fn into_json(self, index: u64) -> Value {
        let mut message = json!({"role": "assistant", "content": self.content});
        if let Some(refusal) = self.refusal {
            message["refusal"] = json!(refusal);
        }
        if let Some(reasoning) = self.reasoning {
            message["reasoning_content"] = json!(reasoning);
        }
        if !self.calls.is_empty() {
            let calls: Vec<Value> = self
                .calls
                .into_values()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            message["tool_calls"] = Value::Array(calls);
        }
        json!({"index": index, "message": message, "finish_reason": self.finish})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_of_text_and_tool_calls_folds_into_its_completion() {
        let mut c = Collector::default();
        for data in [
            r#"{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get","arguments":"{\"a\""}}]}}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]}}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
            "[DONE]",
        ] {
            c.push(data);
        }
        let completion = c.completion().unwrap();
        assert_eq!(
            completion,
            json!({"id":"c1","created":5,"model":"m","object":"chat.completion",
                "choices":[{"index":0,"finish_reason":"tool_calls","message":{
                    "role":"assistant","content":"Hello",
                    "tool_calls":[{"id":"call_1","type":"function","function":{"name":"get","arguments":"{\"a\":1}"}}]}}],
                "usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}})
        );
    }

    #[test]
    fn a_stream_without_its_finish_or_with_an_error_is_not_whole() {
        let mut unfinished = Collector::default();
        unfinished.push(r#"{"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}"#);
        assert!(unfinished.completion().is_none());
        let mut errored = Collector::default();
        errored.push(
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}"#,
        );
        errored.push(r#"{"error":{"message":"overloaded"}}"#);
        assert!(errored.completion().is_none());
        let mut garbage = Collector::default();
        garbage.push("not json");
        assert!(garbage.completion().is_none());
    }
}
