//! What a cached answer is found by: the task, the client's protocol and the
//! request as it affects the answer, normalised; whether the request samples;
//! and what the client's `Cache-Control` allows.

use http::header::{HeaderMap, CACHE_CONTROL};
use ring::digest;
use serde_json::{Map, Value};

use crate::native::Protocol;

/// A cache key: SHA-256 of the normalised request.
pub type Key = [u8; 32];

/// Fields that do not change the answer: left out of the key. Everything
/// else counts, so a field switchyard does not know can only cost a hit,
/// never serve an answer to another question.
const NOT_IN_KEY: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// The key of one request body, and whether the request samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keyed {
    /// The key.
    pub key: Key,
    /// It samples: `temperature` absent (the providers' default is 1) or
    /// above 0, and no `seed`.
    pub samples: bool,
    /// A stored answer can stand for it: not when it asks for `logprobs`
    /// (a replayed stream cannot carry them), nor when a number in it is too
    /// large to be read exactly (two such requests could share a key).
    pub keepable: bool,
}

/// The key of `body` (a JSON object) in `task` for a client of `protocol`,
/// with the client's `headers` that go upstream as sent (`forwarded`: an
/// `anthropic-beta` changes the answer); `None` for a body that is not a
/// JSON object.
#[must_use]
pub fn of(task: &str, protocol: Protocol, body: &[u8], forwarded: &HeaderMap) -> Option<Keyed> {
    let Value::Object(mut fields) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    for name in NOT_IN_KEY {
        fields.remove(*name);
    }
    let temperature = fields.get("temperature").and_then(Value::as_f64);
    let seeded = fields.get("seed").is_some_and(|s| !s.is_null());
    let samples = !seeded && temperature.is_none_or(|t| t > 0.0);
    let logprobs = fields
        .get("logprobs")
        .is_some_and(|l| l != &Value::Bool(false) && !l.is_null())
        || fields.get("top_logprobs").is_some_and(|l| !l.is_null());
    let mut headers = Map::new();
    for (name, value) in forwarded {
        let value = Value::String(String::from_utf8_lossy(value.as_bytes()).into_owned());
        match headers.get_mut(name.as_str()) {
            Some(Value::Array(values)) => values.push(value),
            Some(_) | None => {
                headers.insert(name.as_str().to_owned(), Value::Array(vec![value]));
            }
        }
    }
    fields.insert(" headers".into(), Value::Object(headers));
    let (key, exact) = digest_of(task, protocol, &fields, body.len());
    Some(Keyed {
        key,
        samples,
        keepable: exact && !logprobs,
    })
}

/// SHA-256 of the task, the protocol and `fields` written canonically, and
/// whether every number in them was read exactly.
fn digest_of(
    task: &str,
    protocol: Protocol,
    fields: &Map<String, Value>,
    size: usize,
) -> (Key, bool) {
    let mut canonical = Canonical {
        out: Vec::with_capacity(size + 64),
        exact: true,
    };
    canonical.out.extend_from_slice(task.as_bytes());
    canonical.out.push(0);
    canonical
        .out
        .extend_from_slice(protocol.as_str().as_bytes());
    canonical.out.push(0);
    canonical.object(fields);
    let mut key = [0u8; 32];
    key.copy_from_slice(digest::digest(&digest::SHA256, &canonical.out).as_ref());
    (key, canonical.exact)
}

/// What a semantic lookup compares: everything but the conversation, as a
/// key (a stored answer matches only a request that agrees on it), and the
/// conversation as the text that is embedded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The key of the request without its conversation (system turns stay in).
    pub rest: Key,
    /// The conversation's turns, a line each (`role: text`).
    pub text: String,
    /// How many turns (system turns aside).
    pub turns: usize,
}

/// The prompt of a request: `body` the client's own (of `protocol`), `chat`
/// its chat reading (the same body for a chat client), whose turns are
/// read; `None` when either is not a JSON object.
#[must_use]
pub fn prompt(task: &str, protocol: Protocol, body: &[u8], chat: &[u8]) -> Option<Prompt> {
    let Value::Object(mut rest) = serde_json::from_slice::<Value>(body).ok()? else {
        return None;
    };
    let Value::Object(chat) = serde_json::from_slice::<Value>(chat).ok()? else {
        return None;
    };
    for name in NOT_IN_KEY {
        rest.remove(*name);
    }
    // The conversation of each protocol (a Responses conversation goes on
    // from its `previous_response_id`: the chat reading has it whole).
    for name in ["messages", "input", "previous_response_id"] {
        rest.remove(name);
    }
    let (system, turns): (Vec<&Value>, Vec<&Value>) = chat
        .get("messages")
        .and_then(Value::as_array)
        .map(|m| m.iter().partition(|m| is_system(m)))
        .unwrap_or_default();
    rest.insert(
        " system".into(),
        Value::Array(system.into_iter().cloned().collect()),
    );
    // A picture, a sound or a file is not in the text that is embedded: a
    // conversation with one is looked up exactly only.
    let text: Vec<String> = turns.iter().map(|m| turn_text(m)).collect::<Option<_>>()?;
    Some(Prompt {
        rest: digest_of(task, protocol, &rest, body.len()).0,
        turns: text.len(),
        text: text.join("\n"),
    })
}

fn is_system(message: &Value) -> bool {
    matches!(
        message.get("role").and_then(Value::as_str),
        Some("system" | "developer")
    )
}

/// One chat turn as a line: its role (and `name`), its text, its tool
/// calls; `None` for a turn with a part that is not text.
fn turn_text(message: &Value) -> Option<String> {
    let role = message.get("role").and_then(Value::as_str);
    let mut line = String::from(role.unwrap_or("user"));
    if let Some(name) = message.get("name").and_then(Value::as_str) {
        line.push_str(&format!(" ({name})"));
    }
    line.push_str(": ");
    match message.get("content") {
        Some(Value::String(text)) => line.push_str(text),
        Some(Value::Array(parts)) => {
            for part in parts {
                line.push_str(part.get("text").and_then(Value::as_str)?);
            }
        }
        Some(_) | None => {}
    }
    let calls = message.get("tool_calls").and_then(Value::as_array);
    for function in calls
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("function"))
    {
        let field = |f: &str| function.get(f).and_then(Value::as_str).unwrap_or_default();
        line.push_str(&format!(" {}({})", field("name"), field("arguments")));
    }
    Some(line)
}

/// JSON with every object's keys in order, no whitespace, a `null` field
/// left out (it counts as absent) and an integral number written as an
/// integer (`0.0` is `0`): one spelling per request, whatever the client's
/// key order and formatting. Strings are written as serde_json reads them
/// (message text exactly).
struct Canonical {
    out: Vec<u8>,
    /// No number was too large to be read exactly.
    exact: bool,
}

impl Canonical {
    fn value(&mut self, value: &Value) {
        match value {
            Value::Object(fields) => self.object(fields),
            Value::Array(items) => {
                self.out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    self.value(item);
                }
                self.out.push(b']');
            }
            Value::Number(n) => self.number(n),
            Value::Null | Value::Bool(_) | Value::String(_) => {
                // Writing a scalar into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut self.out, value);
            }
        }
    }

    fn number(&mut self, n: &serde_json::Number) {
        /// 2^53: past it an f64 no longer holds every integer.
        const EXACT: f64 = 9_007_199_254_740_992.0;
        match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) if f.fract() == 0.0 && f.abs() < EXACT => {
                // An integral value below 2^53 converts exactly.
                #[allow(clippy::cast_possible_truncation)]
                let whole = f as i64;
                self.out.extend_from_slice(whole.to_string().as_bytes());
            }
            Some(f) => {
                self.exact &= f.abs() < EXACT;
                let _ = serde_json::to_writer(&mut self.out, n);
            }
            None => {
                let _ = serde_json::to_writer(&mut self.out, n);
            }
        }
    }

    fn object(&mut self, fields: &Map<String, Value>) {
        let mut names: Vec<&String> = fields
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, _)| k)
            .collect();
        names.sort_unstable();
        self.out.push(b'{');
        for (i, name) in names.into_iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            let _ = serde_json::to_writer(&mut self.out, name);
            self.out.push(b':');
            if let Some(value) = fields.get(name) {
                self.value(value);
            }
        }
        self.out.push(b'}');
    }
}

/// What the client's `Cache-Control` allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Directives {
    /// `no-cache` (or `max-age=0`): no stored answer, ask a target.
    pub no_cache: bool,
    /// `no-store`: keep nothing of this answer.
    pub no_store: bool,
    /// `max-age=N`: a stored answer at most N seconds old.
    pub max_age: Option<u64>,
}

impl Directives {
    /// The directives of every `Cache-Control` header of the request.
    #[must_use]
    pub fn of(headers: &HeaderMap) -> Self {
        let mut d = Directives::default();
        let values = headers.get_all(CACHE_CONTROL).iter();
        for directive in values
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
        {
            let directive = directive.trim().to_ascii_lowercase();
            match directive.split_once('=') {
                Some(("max-age", n)) => {
                    d.max_age = n.trim().trim_matches('"').parse().ok();
                    d.no_cache |= d.max_age == Some(0);
                }
                Some(_) => {}
                None if directive == "no-cache" => d.no_cache = true,
                None if directive == "no-store" => d.no_store = true,
                None => {}
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> Keyed {
        of("t", Protocol::Chat, body.as_bytes(), &HeaderMap::new()).unwrap()
    }

    #[test]
    fn key_order_formatting_and_fields_that_do_not_change_the_answer_are_not_in_the_key() {
        let a = key(r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"temperature":0}"#);
        let b = key(
            r#"{ "temperature": 0, "messages": [ {"content": "hi", "role": "user"} ],
                 "model": "b", "stream": true, "user": "u1", "metadata": {"x": "y"},
                 "stream_options": {"include_usage": true} }"#,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn what_changes_the_answer_changes_the_key() {
        let base = r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0"#;
        let k = |extra: &str| key(&format!("{base}{extra}}}")).key;
        let plain = k("");
        for extra in [
            r#","max_tokens":5"#,
            r#","tools":[{"type":"function","function":{"name":"f"}}]"#,
            r#","tool_choice":"none""#,
            r#","response_format":{"type":"json_object"}"#,
            r#","top_p":0.5"#,
            r#","stop":["x"]"#,
            r#","n":2"#,
            r#","seed":1"#,
        ] {
            assert_ne!(k(extra), plain, "{extra}");
        }
        // Message text exactly as sent: a trailing space is another question.
        assert_ne!(
            key(r#"{"messages":[{"role":"user","content":"hi "}],"temperature":0}"#).key,
            plain
        );
        let other_task = of(
            "u",
            Protocol::Chat,
            format!("{base}}}").as_bytes(),
            &HeaderMap::new(),
        )
        .unwrap();
        let other_protocol = of(
            "t",
            Protocol::Messages,
            format!("{base}}}").as_bytes(),
            &HeaderMap::new(),
        )
        .unwrap();
        assert_ne!(other_task.key, plain);
        assert_ne!(other_protocol.key, plain);
    }

    #[test]
    fn numbers_and_nulls_have_one_spelling_and_what_cannot_be_read_exactly_is_not_kept() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(
            key(&format!(r#"{{{m},"temperature":0}}"#)).key,
            key(&format!(r#"{{{m},"temperature":0.0,"max_tokens":null}}"#)).key
        );
        assert_ne!(
            key(&format!(r#"{{{m},"temperature":0}}"#)).key,
            key(&format!(r#"{{{m},"temperature":0.5}}"#)).key
        );
        assert!(key(&format!(r#"{{{m},"seed":7}}"#)).keepable);
        assert!(!key(&format!(r#"{{{m},"seed":18446744073709551616}}"#)).keepable);
        assert!(!key(&format!(r#"{{{m},"temperature":0,"logprobs":true}}"#)).keepable);
        assert!(!key(&format!(r#"{{{m},"temperature":0,"top_logprobs":2}}"#)).keepable);
        assert!(key(&format!(r#"{{{m},"temperature":0,"logprobs":false}}"#)).keepable);
    }

    #[test]
    fn a_header_that_goes_upstream_as_sent_is_in_the_key() {
        let body = br#"{"messages":[{"role":"user","content":"hi"}],"temperature":0}"#;
        let mut beta = HeaderMap::new();
        beta.insert("anthropic-beta", "a".parse().unwrap());
        let plain = of("t", Protocol::Messages, body, &HeaderMap::new()).unwrap();
        let with_a = of("t", Protocol::Messages, body, &beta).unwrap();
        beta.insert("anthropic-beta", "b".parse().unwrap());
        let with_b = of("t", Protocol::Messages, body, &beta).unwrap();
        assert_ne!(plain.key, with_a.key);
        assert_ne!(with_a.key, with_b.key);
    }

    #[test]
    fn a_request_samples_without_a_seed_unless_its_temperature_is_zero() {
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert!(key(&format!("{{{m}}}")).samples, "absent: the default is 1");
        assert!(key(&format!(r#"{{{m},"temperature":0.7}}"#)).samples);
        assert!(!key(&format!(r#"{{{m},"temperature":0}}"#)).samples);
        assert!(!key(&format!(r#"{{{m},"temperature":0.9,"seed":7}}"#)).samples);
        assert!(of("t", Protocol::Chat, b"[1]", &HeaderMap::new()).is_none());
    }

    #[test]
    fn a_prompt_is_the_conversation_and_its_rest_is_everything_else() {
        let p = |body: &str| prompt("t", Protocol::Chat, body.as_bytes(), body.as_bytes()).unwrap();
        let a = p(
            r#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"capital of France?"}],"temperature":0}"#,
        );
        let b = p(
            r#"{"temperature":0,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"France's capital?"}]}],"stream":true}"#,
        );
        assert_eq!(a.rest, b.rest, "the same request but for its turns");
        assert_eq!((a.text.as_str(), a.turns), ("user: capital of France?", 1));
        assert_eq!(b.text, "user: France's capital?");
        let other_system = p(
            r#"{"messages":[{"role":"system","content":"be long"},{"role":"user","content":"capital of France?"}],"temperature":0}"#,
        );
        let other_params = p(
            r#"{"messages":[{"role":"user","content":"capital of France?"}],"temperature":0,"max_tokens":3}"#,
        );
        assert_ne!(other_system.rest, a.rest, "a system turn is not the prompt");
        assert_ne!(other_params.rest, a.rest);
        let turns = p(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"42"}]}"#,
        );
        assert_eq!(turns.turns, 3);
        let named = p(r#"{"messages":[{"role":"user","name":"alice","content":"hi"}]}"#);
        assert_eq!(named.text, "user (alice): hi");
        let image = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"https://x/a.png"}}]}]}"#;
        assert!(
            prompt("t", Protocol::Chat, image.as_bytes(), image.as_bytes()).is_none(),
            "a picture is not in the text: exact only"
        );
        assert_eq!(turns.text, "user: hi\nassistant:  f({})\ntool: 42");
    }

    #[test]
    fn cache_control_directives_are_read_from_every_header() {
        let mut h = HeaderMap::new();
        assert_eq!(Directives::of(&h), Directives::default());
        h.append(CACHE_CONTROL, "No-Cache".parse().unwrap());
        h.append(
            CACHE_CONTROL,
            "private, no-store, max-age=30".parse().unwrap(),
        );
        let d = Directives::of(&h);
        assert!(d.no_cache && d.no_store);
        assert_eq!(d.max_age, Some(30));
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, "max-age=0".parse().unwrap());
        assert!(Directives::of(&h).no_cache);
    }
}
