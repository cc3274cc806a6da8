//! What upstream text may reach a client: error bodies scrubbed of configured
//! sensitive words (a vendor's sales pitch or console URL), upstream host
//! names and anything that looks like a key, with per-status friendly
//! messages when configured.
//!
//! The seeds' lesson: a provider's raw error ("balance exhausted, top up at
//! console.vendor.example, key sk-…") shown to end users leaks the vendor,
//! the account and sometimes the key. The original goes to the debug log,
//! with keys redacted.

use std::collections::HashMap;

use bytes::Bytes;
use regex::Regex;
use serde_json::Value;

/// Text that replaces whatever was removed.
const REDACTED: &str = "[redacted]";

/// Compiled `sanitize:` settings plus the upstream hosts of the config.
#[derive(Debug, Clone)]
pub struct Sanitizer {
    /// Sensitive words and upstream host names, case-insensitive.
    words: Option<Regex>,
    /// Things that look like API keys or bearer tokens, masked or not.
    keys: Regex,
    /// Words of text ([`TOKEN_PATTERN`]).
    tokens: Regex,
    /// Friendly messages by HTTP status.
    messages: HashMap<u16, String>,
}

/// Keys and tokens as providers issue them: `sk-…`, `sk-ant-…`, `AKIA…`,
/// `Bearer …`, and long unbroken base64/hex runs; and their masked forms, as
/// providers echo them in "incorrect API key" errors: a key prefix with
/// masking anywhere after it (`sk-abc*****1234`, `sk-proj-****...abcd`,
/// `sk-abc…1234`), and any run of key characters touching three or more `*`
/// or `•` (`abcd****wxyz`). Masking keeps a key's first and last characters,
/// which are enough to tell whose key it is.
const KEY_PATTERN: &str = concat!(
    r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}",
    r"|\b(?:sk|pk|rk|ak|key)[-_][A-Za-z0-9_-]*(?:(?:[*•●…]|\.{2,})+[A-Za-z0-9_-]*)+",
    r"|\b(?:sk|pk|rk|ak|key)[-_][A-Za-z0-9_-]{12,}",
    r"|\bAKIA[0-9A-Z]{16}\b",
    r"|[A-Za-z0-9_-]*(?:[A-Za-z0-9_-]{2}[*•●]{3,}|[*•●]{3,}[A-Za-z0-9_-]{2})[A-Za-z0-9_*•●-]*",
    r"|\b[A-Za-z0-9+/_-]{40,}={0,2}",
);

/// A word of upstream text, for finding fragments of the provider's key.
const TOKEN_PATTERN: &str = r#"[^\s"'`,;:()\[\]{}<>]+"#;

/// Characters providers mask a key's middle with.
const MASKS: [char; 4] = ['*', '•', '●', '…'];

/// The fewest characters a key needs before its first 8 and last 4 are
/// treated as identifying fragments (shorter keys are only removed whole).
const FRAGMENT_MIN_KEY: usize = 12;
/// Consecutive characters of a key that name it wherever they appear (the
/// length of the head a fragment is recognised by).
const KEY_RUN: usize = 8;

impl Sanitizer {
    /// Builds a sanitizer from configured words, upstream hosts and messages.
    ///
    /// # Errors
    /// Only if the combined pattern cannot compile (it is built from escaped
    /// literals, so in practice a size limit).
    pub fn new(
        words: &[String],
        hosts: &[String],
        messages: HashMap<u16, String>,
    ) -> Result<Self, regex::Error> {
        let mut literals: Vec<String> = words
            .iter()
            .chain(hosts)
            .filter(|w| !w.trim().is_empty())
            .map(|w| regex::escape(w.trim()))
            .collect();
        // Longest first, so a host is removed whole before a word inside it.
        literals.sort_by_key(|w| std::cmp::Reverse(w.len()));
        let words = if literals.is_empty() {
            None
        } else {
            Some(Regex::new(&format!("(?i){}", literals.join("|")))?)
        };
        Ok(Self {
            words,
            keys: Regex::new(KEY_PATTERN)?,
            tokens: Regex::new(TOKEN_PATTERN)?,
            messages,
        })
    }

    /// A friendly message configured for `status`, if any.
    #[must_use]
    pub fn message_for(&self, status: u16) -> Option<&str> {
        self.messages.get(&status).map(String::as_str)
    }

    /// Removes only keys (for logging an upstream's original text): each of
    /// the provider's own `secrets` whole, words holding its first 8 or last 4
    /// characters next to masking or inside a key-like word, and anything
    /// key-like, masked or not.
    #[must_use]
    pub fn redact_keys(&self, text: &str, secrets: &[&str]) -> String {
        let mut text = text.to_owned();
        for key in secrets.iter().filter(|s| s.len() >= 4) {
            text = text.replace(key, REDACTED);
            text = self.redact_fragments(&text, key);
        }
        self.keys.replace_all(&text, REDACTED).into_owned()
    }

    /// `body` for the debug log: keys redacted as [`Sanitizer::redact_keys`],
    /// inside each decoded JSON string when it is JSON (an escaped key, say
    /// `\u0073k-...`, is found too), else in its text.
    #[must_use]
    pub fn redact_keys_in_body(&self, body: &[u8], secrets: &[&str]) -> String {
        fn walk(s: &Sanitizer, v: &mut Value, secrets: &[&str]) {
            match v {
                Value::String(text) => *text = s.redact_keys(text, secrets),
                Value::Array(items) => items.iter_mut().for_each(|i| walk(s, i, secrets)),
                Value::Object(map) => map.values_mut().for_each(|i| walk(s, i, secrets)),
                Value::Null | Value::Bool(_) | Value::Number(_) => {}
            }
        }
        match serde_json::from_slice::<Value>(body) {
            Ok(mut v) => {
                walk(self, &mut v, secrets);
                v.to_string()
            }
            Err(_) => self.redact_keys(&String::from_utf8_lossy(body), secrets),
        }
    }

    /// Scrubs one string: keys as [`Sanitizer::redact_keys`], then the
    /// sensitive words and upstream hosts.
    #[must_use]
    pub fn clean_text(&self, text: &str, secrets: &[&str]) -> String {
        let text = self.redact_keys(text, secrets);
        match &self.words {
            Some(words) => words.replace_all(&text, REDACTED).into_owned(),
            None => text,
        }
    }

    /// Words that hold `key`'s first 8 or last 4 characters and are masked
    /// (`sk-proj-…`, `****wxyz`) or key-like: such a word names the key even
    /// when the rest of it is hidden. The same four characters in ordinary
    /// words are left alone.
    fn redact_fragments(&self, text: &str, key: &str) -> String {
        if key.len() < FRAGMENT_MIN_KEY {
            return text.to_owned();
        }
        let (Some(head), Some(tail)) = (key.get(..8), key.get(key.len() - 4..)) else {
            return text.to_owned();
        };
        self.tokens
            .replace_all(text, |m: &regex::Captures<'_>| {
                let word = &m[0];
                // A sentence's full stop is not part of the word.
                let (word, stop) = match word.strip_suffix('.') {
                    Some(w) if !w.ends_with('.') => (w, "."),
                    Some(_) | None => (word, ""),
                };
                let named = word.contains(head) || word.contains(tail);
                // A run of the key's own characters names it, whatever is around it.
                if has_key_run(word, key) || (named && (is_masked(word) || is_key_like(word))) {
                    format!("{REDACTED}{stop}")
                } else {
                    m[0].to_owned()
                }
            })
            .into_owned()
    }

    /// Scrubs an upstream OpenAI-format error body (every string in it), and
    /// puts the configured message for `status` in `error.message`. `None` if
    /// the body is not such an error: the caller then writes its own.
    #[must_use]
    /// `secrets` are the provider's keys, removed from the decoded strings too
    /// (a JSON body may carry one escaped, e.g. `\/` or `\u0073`).
    pub fn clean_error_body(&self, status: u16, body: &[u8], secrets: &[&str]) -> Option<Bytes> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        if !v.get("error").is_some_and(Value::is_object) {
            v = openai_envelope(v, status)?;
        }
        self.clean_value(&mut v, secrets);
        if let (Some(msg), Some(err)) = (self.message_for(status), v.get_mut("error")) {
            err["message"] = Value::String(msg.to_owned());
        }
        Some(Bytes::from(v.to_string()))
    }

    fn clean_value(&self, v: &mut Value, secrets: &[&str]) {
        match v {
            Value::String(s) => *s = self.clean_text(s, secrets),
            Value::Array(items) => items.iter_mut().for_each(|i| self.clean_value(i, secrets)),
            Value::Object(map) => map.values_mut().for_each(|i| self.clean_value(i, secrets)),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
}

/// The error of a server that answers in the shape vLLM and sglang use
/// (`{"object": "error", "message", "type", "param", "code": 400}`), Hugging
/// Face TGI's (`{"error": "...", "error_type"}`) or FastAPI's (`{"detail":
/// "..."}`, or its validation list `{"detail": [{"loc", "msg"}]}`), in
/// OpenAI's envelope; `None` for a body with no such text.
fn openai_envelope(mut v: Value, status: u16) -> Option<Value> {
    let message = ["message", "error", "detail"]
        .iter()
        .find_map(|key| v.get(*key).filter(|m| m.is_string()))
        .cloned()
        .or_else(|| validation_list(v.get("detail")?).map(Value::String))?;
    let text = |key: &str, v: &mut Value| {
        v.get_mut(key)
            .map(Value::take)
            .filter(Value::is_string)
            .unwrap_or(Value::Null)
    };
    // Their `type` is a Python exception's name (`BadRequestError`) and their
    // numeric `code` the status again: OpenAI's are words, by status.
    let (param, code) = (text("param", &mut v), text("code", &mut v));
    let kind = kind_of(status);
    Some(
        serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": code}}),
    )
}

/// FastAPI's (pydantic's) validation errors as one line: each `msg`, after
/// the place its `loc` names (`body.messages.0.content: Field required`).
fn validation_list(detail: &Value) -> Option<String> {
    let said: Vec<String> = detail
        .as_array()?
        .iter()
        .filter_map(|item| {
            let msg = item.get("msg")?.as_str()?;
            let loc: Vec<String> = (item.get("loc").and_then(Value::as_array))
                .into_iter()
                .flatten()
                .map(|part| {
                    part.as_str()
                        .map_or_else(|| part.to_string(), str::to_owned)
                })
                .collect();
            Some(match loc.is_empty() {
                true => msg.to_owned(),
                false => format!("{}: {msg}", loc.join(".")),
            })
        })
        .collect();
    (!said.is_empty()).then(|| said.join("; "))
}

/// OpenAI's error `type` for a status.
fn kind_of(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Whether `word` holds [`KEY_RUN`] or more consecutive characters of `key`
/// (a key split by a space, or quoted from its middle).
fn has_key_run(word: &str, key: &str) -> bool {
    word.len() >= KEY_RUN
        && key
            .as_bytes()
            .windows(KEY_RUN)
            .any(|run| word.as_bytes().windows(KEY_RUN).any(|w| w == run))
}

/// Whether a word has a key's middle masked out: a mask character, or dots.
fn is_masked(word: &str) -> bool {
    word.contains(MASKS) || word.contains("..")
}

/// Whether a word looks like a key: 12 or more key characters, letters and
/// digits both (so `max_context_length_exceeded` is not one).
fn is_key_like(word: &str) -> bool {
    word.len() >= FRAGMENT_MIN_KEY
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '+' | '='))
        && word.chars().any(|c| c.is_ascii_digit())
        && word.chars().any(|c| c.is_ascii_alphabetic())
}

/// Replaces every occurrence of each of `keys` in upstream bytes (a hostile
/// or careless upstream may echo the provider's key in an error message).
#[must_use]
pub fn redact_secrets<'a>(body: Bytes, keys: impl IntoIterator<Item = &'a str>) -> Bytes {
    keys.into_iter().fold(body, redact_secret)
}

fn redact_secret(body: Bytes, key: &str) -> Bytes {
    let key = key.as_bytes();
    // Runs on every answer: `memmem` finds nothing at memory speed.
    if key.len() < 4 || memchr::memmem::find(&body, key).is_none() {
        return body;
    }
    let finder = memchr::memmem::Finder::new(key);
    let mut out = Vec::with_capacity(body.len());
    let mut rest = &body[..];
    while let Some(i) = finder.find(rest) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(b"*****");
        rest = &rest[i + key.len()..];
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s() -> Sanitizer {
        Sanitizer::new(
            &[
                "Upgrade to Pro at console.vendor.example".into(),
                "VendorCloud".into(),
            ],
            &["api.vendor-a.example".into()],
            HashMap::from([(429, "The model is busy; retry shortly.".to_owned())]),
        )
        .unwrap()
    }

    #[test]
    fn runs_of_the_key_are_redacted_wherever_they_stand() {
        let key = "sk-test-SECRETSECRET1234";
        for text in [
            "key sk-test-SECRET SECRET1234 refused",
            "middle SECRETSECRET leaked",
            "xSECRETSECRETx and SECRETSECRET12",
        ] {
            let out = s().redact_keys(text, &[key]);
            assert!(!out.contains("SECRETSE"), "{text} -> {out}");
        }
        assert_eq!(
            s().redact_keys("ordinary words SECRET and 1234", &[key]),
            "ordinary words SECRET and 1234"
        );
    }

    #[test]
    fn the_debug_body_is_redacted_inside_escaped_json_strings() {
        let key = "sk-test-SECRETSECRET1234";
        let body = br#"{"error":{"message":"bad key sk-test-SECRETSECRET1234"}}"#;
        let out = s().redact_keys_in_body(body, &[key]);
        assert!(!out.contains("ECRETSECRET"), "{out}");
        assert!(out.contains("bad key"), "{out}");
        let text = s().redact_keys_in_body(b"<html>sk-test-SECRETSECRET1234</html>", &[key]);
        assert!(!text.contains("SECRETSECRET"), "{text}");
    }

    #[test]
    fn words_hosts_and_keys_are_removed() {
        let out = s().clean_text(
            "VendorCloud quota hit for key sk-live-abcdefghijklmnop via https://api.vendor-a.example/v1. \
             upgrade to pro at console.vendor.example. Authorization: Bearer abc.def.ghi123",
            &[],
        );
        assert!(
            !out.contains("VendorCloud") && !out.contains("vendor-a") && !out.contains("console."),
            "{out}"
        );
        assert!(
            !out.contains("sk-live") && !out.contains("abc.def"),
            "{out}"
        );
        assert!(out.contains("quota hit"), "{out}");
    }

    #[test]
    fn friendly_message_replaces_the_upstream_one() {
        let body =
            br#"{"error":{"message":"VendorCloud says slow down","type":"rate_limit","code":"x"}}"#;
        let out = s().clean_error_body(429, body, &[]).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["error"]["message"], "The model is busy; retry shortly.");
        let out = s()
            .clean_error_body(400, br#"{"error":{"message":"VendorCloud: bad"}}"#, &[])
            .unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("VendorCloud"));
        assert!(s().clean_error_body(400, b"<html>", &[]).is_none());
        // The key escaped in JSON (`\/`) is still found once decoded.
        let body = br#"{"error":{"message":"bad key sk\/proj\/AbC+dEf"}}"#;
        let out = s()
            .clean_error_body(400, body, &["sk/proj/AbC+dEf"])
            .unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("AbC"), "{out:?}");
    }

    #[test]
    fn keys_are_redacted_from_returned_bodies() {
        let out = redact_secrets(
            Bytes::from_static(b"bad key sk-abc, really sk-abc! and sk-def"),
            ["sk-abc", "sk-def"],
        );
        assert_eq!(&out[..], b"bad key *****, really *****! and *****");
    }

    #[test]
    fn ordinary_text_survives() {
        let key: &[&str] = &["sk-test-Q7rT9vW2xY4zA6bC8dE0wxyz"];
        for t in [
            "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.",
            "Rate limit reached for gpt-4o in organization org-abc on tokens per min (TPM): Limit 30000.",
            "Invalid value for 'max_tokens': must be **positive**... see https://platform.openai.com/docs.",
            "Loading… the key-value store is busy; context_length_exceeded",
        ] {
            assert_eq!(s().clean_text(t, &[]), t);
            assert_eq!(s().clean_text(t, key), t);
            assert_eq!(s().redact_keys(t, key), t);
        }
    }

    /// OpenAI's own wording for a wrong key, with the key masked.
    fn incorrect_key(shown: &str) -> String {
        format!(
            "Incorrect API key provided: {shown}. You can find your API key at https://platform.openai.com/account/api-keys."
        )
    }

    #[test]
    fn masked_keys_are_redacted_without_knowing_the_key() {
        for shown in [
            "sk-proj-abcd****************wxyz",
            "sk-abc*****1234",
            "sk-proj-****...abcd",
            "sk-abc…1234",
            "sk-ant-api03-...AbCd",
            "abcd****************wxyz",
            "****************wxyz",
            "Ab3d••••••••Wx9z",
        ] {
            for out in [
                s().clean_text(&incorrect_key(shown), &[]),
                s().redact_keys(&incorrect_key(shown), &[]),
            ] {
                assert_eq!(
                    out,
                    incorrect_key(REDACTED),
                    "{shown} left something behind"
                );
            }
        }
    }

    #[test]
    fn fragments_of_the_providers_own_key_are_redacted() {
        let key = "Ab3dE5gH9k2LmN0pQrSt7wxyz";
        for shown in [
            "Ab3dE5gH…",
            "Ab3dE5gH...7wxyz",
            "...7wxyz",
            "Ab3dE5gHxxxxxxxxxxxxxxxx",
            "XXXXXXXXXXXXXXXXXXXX7wxyz",
            "key_Ab3dE5gH",
        ] {
            let text = incorrect_key(shown);
            for out in [
                s().clean_text(&text, &[key]),
                s().redact_keys(&text, &[key]),
            ] {
                assert!(
                    !out.contains("Ab3dE5gH") && !out.contains("wxyz"),
                    "{shown}: {out}"
                );
                assert!(
                    out.starts_with("Incorrect API key provided: [redacted]"),
                    "{out}"
                );
                assert!(out.ends_with("/account/api-keys."), "{out}");
            }
        }
        // A fragment on its own, neither masked nor in a key-like word, says
        // too little to be worth mangling the text.
        assert!(s()
            .clean_text("key ending in 7wxyz", &[key])
            .contains("7wxyz"));
    }
}
