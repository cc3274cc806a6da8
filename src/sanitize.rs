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
    /// Things that look like API keys or bearer tokens.
    keys: Regex,
    /// Friendly messages by HTTP status.
    messages: HashMap<u16, String>,
}

/// Keys and tokens as providers issue them: `sk-…`, `sk-ant-…`, `AKIA…`,
/// `Bearer …`, and long unbroken base64/hex runs.
const KEY_PATTERN: &str = r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}|\b(?:sk|pk|rk|ak|key)[-_][A-Za-z0-9_-]{12,}|\bAKIA[0-9A-Z]{16}\b|\b[A-Za-z0-9+/_-]{40,}={0,2}";

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
            messages,
        })
    }

    /// A friendly message configured for `status`, if any.
    #[must_use]
    pub fn message_for(&self, status: u16) -> Option<&str> {
        self.messages.get(&status).map(String::as_str)
    }

    /// Removes only key-like strings (for logging an upstream's original text).
    #[must_use]
    pub fn redact_keys(&self, text: &str) -> String {
        self.keys.replace_all(text, REDACTED).into_owned()
    }

    /// Scrubs one string.
    #[must_use]
    pub fn clean_text(&self, text: &str) -> String {
        let text = self.keys.replace_all(text, REDACTED);
        match &self.words {
            Some(words) => words.replace_all(&text, REDACTED).into_owned(),
            None => text.into_owned(),
        }
    }

    /// Scrubs an upstream OpenAI-format error body (every string in it), and
    /// puts the configured message for `status` in `error.message`. `None` if
    /// the body is not such an error: the caller then writes its own.
    #[must_use]
    /// `secret` is the provider's key, removed from the decoded strings too (a
    /// JSON body may carry it escaped, e.g. `\/` or `\u0073`).
    pub fn clean_error_body(
        &self,
        status: u16,
        body: &[u8],
        secret: Option<&str>,
    ) -> Option<Bytes> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        if !v.get("error").is_some_and(Value::is_object) {
            return None;
        }
        self.clean_value(&mut v, secret.filter(|s| s.len() >= 4));
        if let (Some(msg), Some(err)) = (self.message_for(status), v.get_mut("error")) {
            err["message"] = Value::String(msg.to_owned());
        }
        Some(Bytes::from(v.to_string()))
    }

    fn clean_value(&self, v: &mut Value, secret: Option<&str>) {
        match v {
            Value::String(s) => {
                if let Some(key) = secret {
                    *s = s.replace(key, REDACTED);
                }
                *s = self.clean_text(s);
            }
            Value::Array(items) => items.iter_mut().for_each(|i| self.clean_value(i, secret)),
            Value::Object(map) => map.values_mut().for_each(|i| self.clean_value(i, secret)),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
}

/// Replaces every occurrence of `key` in upstream bytes (a hostile or
/// careless upstream may echo the provider's key in an error message).
#[must_use]
pub fn redact_secret(body: Bytes, key: Option<&str>) -> Bytes {
    let Some(key) = key.map(str::as_bytes).filter(|k| k.len() >= 4) else {
        return body;
    };
    if !body.windows(key.len()).any(|w| w == key) {
        return body;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut rest = &body[..];
    while let Some(i) = rest.windows(key.len()).position(|w| w == key) {
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
    fn words_hosts_and_keys_are_removed() {
        let out = s().clean_text(
            "VendorCloud quota hit for key sk-live-abcdefghijklmnop via https://api.vendor-a.example/v1. \
             upgrade to pro at console.vendor.example. Authorization: Bearer abc.def.ghi123",
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
        let out = s().clean_error_body(429, body, None).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["error"]["message"], "The model is busy; retry shortly.");
        let out = s()
            .clean_error_body(400, br#"{"error":{"message":"VendorCloud: bad"}}"#, None)
            .unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("VendorCloud"));
        assert!(s().clean_error_body(400, b"<html>", None).is_none());
        // The key escaped in JSON (`\/`) is still found once decoded.
        let body = br#"{"error":{"message":"bad key sk\/proj\/AbC+dEf"}}"#;
        let out = s()
            .clean_error_body(400, body, Some("sk/proj/AbC+dEf"))
            .unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("AbC"), "{out:?}");
    }

    #[test]
    fn keys_are_redacted_from_returned_bodies() {
        let out = redact_secret(
            Bytes::from_static(b"bad key sk-abc, really sk-abc!"),
            Some("sk-abc"),
        );
        assert_eq!(&out[..], b"bad key *****, really *****!");
    }

    #[test]
    fn ordinary_text_survives() {
        let t = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.";
        assert_eq!(s().clean_text(t), t);
    }
}
