//! Secrets as a type: an API key or admin token that prints as `*****` in
//! every `Debug` and `Display`, so no log line, panic message or dump can show
//! it by accident. The only way to the text is [`Secret::expose`].

use std::fmt;

/// A key or token.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a key.
    #[must_use]
    pub fn new(key: String) -> Self {
        Self(key)
    }

    /// The key itself: only for building an outgoing header and for scrubbing
    /// it from upstream text.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` equals the secret, compared in constant time.
    #[must_use]
    pub fn matches(&self, given: &str) -> bool {
        let (a, b) = (given.as_bytes(), self.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*****")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints() {
        let s = Secret::new("sk-live-123".into());
        assert_eq!(format!("{s} {s:?}"), "***** *****");
    }

    #[test]
    fn matches_only_itself() {
        let s = Secret::new("token".into());
        assert!(s.matches("token"));
        assert!(!s.matches("toke"));
        assert!(!s.matches("tokex"));
    }
}
