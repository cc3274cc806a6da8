//! The value checkers of the semantic passes (durations, URLs, regexes,
//! headers), collecting located [`Diagnostic`]s.
//!
//! Compilation (`crate::snapshot::compile`) calls these checkers for every
//! value, so one pass reports every problem in the file, each with the dotted
//! path and line:column where it stands.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::Uri;
use regex::Regex;

use super::diagnostic::{Diagnostic, Severity};
use super::locate::LocationIndex;
use super::Removed;

/// Longest duration accepted anywhere: longer ones are mistakes, and would
/// overflow deadline arithmetic.
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Collects diagnostics while a config is compiled.
///
/// Paths given to it are paths into what parsing read; when parsing took
/// values out ([`Removed`]), they are turned back into the file's own paths
/// (list indices included) before they are located, and nothing is said
/// about a value that was taken out: its own error was reported already.
pub struct Checks<'a> {
    index: &'a LocationIndex,
    removed: &'a Removed,
    /// The file's directory: relative paths in it are relative to it.
    base_dir: Option<&'a Path>,
    /// Everything found so far, in the order found.
    pub diagnostics: Vec<Diagnostic>,
}

impl<'a> Checks<'a> {
    /// A collector that locates paths with `index`.
    #[must_use]
    pub fn new(index: &'a LocationIndex) -> Self {
        static NOTHING: Removed = Removed::NONE;
        Self::reading(index, &NOTHING)
    }

    /// A collector for a file that parsing took `removed` out of.
    #[must_use]
    pub fn reading(index: &'a LocationIndex, removed: &'a Removed) -> Self {
        Self {
            index,
            removed,
            base_dir: None,
            diagnostics: Vec::new(),
        }
    }

    /// The same collector, for a file in `dir` (`None`: text parsed on its own).
    #[must_use]
    pub fn in_dir(mut self, dir: Option<&'a Path>) -> Self {
        self.base_dir = dir;
        self
    }

    /// A path the file names (a key file, a schema), relative to the file's
    /// directory unless absolute, as an operator reading the file expects.
    #[must_use]
    pub fn file(&self, name: &str) -> PathBuf {
        match self.base_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    }

    /// Whether the value at `path` was taken out while parsing (its own
    /// problem already reported): a reference to it is not "unknown".
    #[must_use]
    pub fn gone(&self, path: &str) -> bool {
        self.removed.gone(&self.removed.original(path))
    }

    /// Whether parsing took nothing out at, above or below `path`: only then
    /// does a check of how its parts fit together mean something.
    #[must_use]
    pub fn intact(&self, path: &str) -> bool {
        self.removed.intact(&self.removed.original(path))
    }

    /// Records `severity` at `path` (at its value, else its key, when
    /// `value_first`), unless the value there was taken out while parsing.
    fn record(
        &mut self,
        severity: Severity,
        path: &str,
        value_first: bool,
        message: impl Into<String>,
    ) {
        let path = self.removed.original(path);
        if self.removed.gone(&path) {
            return;
        }
        let (line, column) = if value_first {
            self.index.value_or_key(&path)
        } else {
            self.index.key_or_value(&path)
        };
        let mut d = Diagnostic::error(&path, line, column, message);
        d.severity = severity;
        self.diagnostics.push(d);
    }

    /// Records an error at the value of `path`.
    pub fn error(&mut self, path: &str, message: impl Into<String>) {
        self.record(Severity::Error, path, true, message);
    }

    /// Records a note at the value (or key) of `path`: information that never
    /// rejects a file, not even under `--strict`.
    pub fn note(&mut self, path: &str, message: impl Into<String>) {
        self.record(Severity::Note, path, false, message);
    }

    /// Records a warning at the value of `path`.
    pub fn warn(&mut self, path: &str, message: impl Into<String>) {
        self.record(Severity::Warning, path, true, message);
    }

    /// Whether any error (not warning) was recorded.
    #[must_use]
    pub fn has_errors(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.severity == Severity::Error)
    }

    /// A humantime duration (`250ms`, `30s`, `1m 30s`), or `default` when absent.
    pub fn duration(&mut self, path: &str, value: Option<&str>, default: Duration) -> Duration {
        match value {
            None => default,
            Some(text) => match humantime::parse_duration(text) {
                Ok(d) if d > MAX_DURATION => {
                    self.error(
                        path,
                        format!("duration `{text}` is too long (at most 30 days)"),
                    );
                    default
                }
                Ok(d) if !d.is_zero() => d,
                Ok(_) => {
                    self.error(path, "duration must be greater than zero");
                    default
                }
                Err(e) => {
                    self.error(
                        path,
                        format!(
                            "bad duration `{text}`: {}; write a number and a unit, like `500ms`, `30s` or `2m`",
                            duration_problem(&e)
                        ),
                    );
                    default
                }
            },
        }
    }

    /// An absolute `http://` or `https://` URL with a host.
    pub fn url(&mut self, path: &str, text: &str) -> Option<Uri> {
        match text.parse::<Uri>() {
            Ok(uri)
                if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() =>
            {
                Some(uri)
            }
            Ok(_) => {
                self.error(
                    path,
                    format!("bad URL `{text}`: must be absolute http:// or https:// with a host"),
                );
                None
            }
            Err(e) => {
                self.error(path, format!("bad URL `{text}`: {e}"));
                None
            }
        }
    }

    /// A regular expression (Rust `regex` syntax).
    pub fn regex(&mut self, path: &str, text: &str) -> Option<Regex> {
        match Regex::new(text) {
            Ok(r) => Some(r),
            Err(e) => {
                self.error(path, format!("bad regex: {}", one_line(&e.to_string())));
                None
            }
        }
    }

    /// An HTTP header name.
    pub fn header_name(&mut self, path: &str, text: &str) -> Option<HeaderName> {
        match HeaderName::from_bytes(text.as_bytes()) {
            Ok(n) => Some(n),
            Err(_) => {
                self.error(path, format!("bad header name `{text}`"));
                None
            }
        }
    }

    /// An HTTP header value (visible ASCII and spaces).
    pub fn header_value(&mut self, path: &str, text: &str) -> Option<HeaderValue> {
        match HeaderValue::from_str(text) {
            Ok(v) => Some(v),
            Err(_) => {
                self.error(
                    path,
                    "bad header value: only visible ASCII and spaces are allowed",
                );
                None
            }
        }
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// What is wrong with a duration, in words (not the parser's byte offsets).
fn duration_problem(e: &humantime::DurationError) -> String {
    use humantime::DurationError as E;
    match e {
        E::Empty => "it is empty".to_owned(),
        E::NumberExpected(_) => "a number is missing".to_owned(),
        E::InvalidCharacter(_) => "it holds a character no duration has".to_owned(),
        E::UnknownUnit { unit, .. } if unit.is_empty() => "the unit is missing".to_owned(),
        E::UnknownUnit { unit, .. } => format!("`{unit}` is not a unit (use ms, s, m or h)"),
        E::NumberOverflow => "the number is too large".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_collect_every_problem() {
        let idx = LocationIndex::build("a: 1\nb: 2\n").unwrap();
        let mut c = Checks::new(&idx);
        c.duration("a", Some("soon"), Duration::from_secs(1));
        c.url("b", "ftp://x");
        c.regex("b", "(");
        assert_eq!(c.diagnostics.len(), 3);
        assert_eq!(c.diagnostics[0].line, 1);
        assert_eq!(c.diagnostics[1].line, 2);
        assert!(c.has_errors());
    }

    #[test]
    fn zero_duration_is_rejected() {
        let idx = LocationIndex::default();
        let mut c = Checks::new(&idx);
        assert_eq!(
            c.duration("x", Some("0s"), Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert!(c.has_errors());
    }
}
