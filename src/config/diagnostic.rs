//! One problem in a config file, with where it stands.

use std::fmt;

/// How bad a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The file is rejected.
    Error,
    /// The file is accepted (rejected under `--strict`).
    Warning,
    /// Information (e.g. a key read only at start); never rejects a file.
    Note,
}

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// Dotted path of the offending key, e.g. `tasks.agent.chain[1]`; empty for the whole file.
    pub path: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// What is wrong, in words.
    pub message: String,
}

impl Diagnostic {
    /// An error at `line:column`.
    #[must_use]
    pub fn error(path: &str, line: usize, column: usize, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            path: path.to_owned(),
            line,
            column,
            message: message.into(),
        }
    }

    /// A warning at `line:column`.
    #[must_use]
    pub fn warning(path: &str, line: usize, column: usize, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            ..Self::error(path, line, column, message)
        }
    }

    /// Formats as `FILE:LINE:COLUMN: error: message (at path)`, the form `validate` prints.
    #[must_use]
    pub fn render(&self, file: &str) -> String {
        format!("{file}:{self}")
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        };
        write!(f, "{}:{}: {sev}: {}", self.line, self.column, self.message)?;
        if !self.path.is_empty() {
            write!(f, " (at {})", self.path)?;
        }
        Ok(())
    }
}
