//! Where every key and value of a YAML document is: dotted paths to line:column.
//!
//! serde_yaml reports locations only for the first type error, so semantic
//! checks look paths such as `tasks.agent.chain[1]` up here instead.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

use super::diagnostic::Diagnostic;

/// Largest config file accepted, in bytes.
pub const MAX_FILE_BYTES: usize = 1024 * 1024;
/// Deepest nesting accepted (a real routes.yaml needs about 6).
pub const MAX_DEPTH: usize = 32;
/// Most YAML aliases accepted (each can expand to a whole subtree).
pub const MAX_ALIASES: usize = 64;

/// Why a text could not be indexed.
#[derive(Debug)]
pub enum ScanError {
    /// A YAML syntax error, as the parser reports it.
    Syntax {
        /// 1-based line where the parser stopped.
        line: usize,
        /// 1-based column where the parser stopped.
        column: usize,
        /// The parser's own message.
        info: String,
    },
    /// A file refused whole: too large, too deep, too many aliases.
    Refused(Diagnostic),
}

/// Maps paths (`providers.a.base_url`, `tasks.t.chain[0]`) to 1-based
/// (line, column) of the key and of the value.
#[derive(Debug, Default)]
pub struct LocationIndex {
    keys: HashMap<String, (usize, usize)>,
    values: HashMap<String, (usize, usize)>,
    duplicates: Vec<Diagnostic>,
}

impl LocationIndex {
    /// Indexes `text`.
    ///
    /// # Errors
    /// A YAML syntax error, in the parser's words where it stopped
    /// (`config::parse` says it in the user's words, at the line that is
    /// wrong), or a file refused for its size or shape.
    pub fn build(text: &str) -> Result<Self, Diagnostic> {
        Self::scan(text).map_err(|e| match e {
            ScanError::Syntax { line, column, info } => {
                Diagnostic::error("", line, column, format!("YAML syntax error: {info}"))
            }
            ScanError::Refused(d) => d,
        })
    }

    /// Indexes `text`, a syntax error left as the parser reports it.
    ///
    /// # Errors
    /// As [`Self::build`], the syntax error where the parser stopped.
    pub fn scan(text: &str) -> Result<Self, ScanError> {
        if text.len() > MAX_FILE_BYTES {
            return Err(ScanError::Refused(Diagnostic::error(
                "",
                1,
                1,
                format!("the file is larger than {MAX_FILE_BYTES} bytes"),
            )));
        }
        let mut builder = Builder::default();
        let mut parser = Parser::new_from_str(text);
        let mut aliases = 0usize;
        // Events one by one, not `Parser::load`: that recurses once per nesting
        // level and a hostile file could overflow the stack.
        loop {
            let (event, mark) = parser.next_token().map_err(|e| ScanError::Syntax {
                line: e.marker().line(),
                column: e.marker().col() + 1,
                info: e.info().to_owned(),
            })?;
            match event {
                Event::StreamEnd => break,
                Event::MappingStart(..) | Event::SequenceStart(..)
                    if builder.stack.len() >= MAX_DEPTH =>
                {
                    return Err(ScanError::Refused(Diagnostic::error(
                        "",
                        mark.line(),
                        mark.col() + 1,
                        format!("nesting deeper than {MAX_DEPTH} levels"),
                    )));
                }
                Event::Alias(_) => {
                    aliases += 1;
                    // Each alias may expand to a whole subtree: a few are fine, many are a bomb.
                    if aliases > MAX_ALIASES {
                        return Err(ScanError::Refused(Diagnostic::error(
                            "",
                            mark.line(),
                            mark.col() + 1,
                            format!("more than {MAX_ALIASES} YAML aliases"),
                        )));
                    }
                }
                Event::Nothing
                | Event::StreamStart
                | Event::DocumentStart
                | Event::DocumentEnd
                | Event::Scalar(..)
                | Event::SequenceStart(..)
                | Event::SequenceEnd
                | Event::MappingStart(..)
                | Event::MappingEnd => {}
            }
            builder.on_event(event, mark);
        }
        Ok(builder.index)
    }

    /// Location of the value at `path`, else of its key, else of the nearest
    /// ancestor that exists, else 1:1.
    #[must_use]
    pub fn value_or_key(&self, path: &str) -> (usize, usize) {
        self.lookup(path, true)
    }

    /// Location of the key at `path` (for unknown or duplicate keys), else as
    /// [`Self::value_or_key`].
    #[must_use]
    pub fn key_or_value(&self, path: &str) -> (usize, usize) {
        self.lookup(path, false)
    }

    /// Whether `path` exists in the document.
    #[must_use]
    pub fn contains(&self, path: &str) -> bool {
        self.keys.contains_key(path) || self.values.contains_key(path)
    }

    /// Keys written twice in one mapping (YAML forbids it; serde would keep the last).
    #[must_use]
    pub fn duplicates(&self) -> &[Diagnostic] {
        &self.duplicates
    }

    fn lookup(&self, path: &str, value_first: bool) -> (usize, usize) {
        let mut path = path;
        loop {
            if path.is_empty() {
                return (1, 1);
            }
            let (first, second) = if value_first {
                (&self.values, &self.keys)
            } else {
                (&self.keys, &self.values)
            };
            if let Some(loc) = first.get(path).or_else(|| second.get(path)) {
                return *loc;
            }
            match path.rfind(['.', '[']) {
                Some(i) => path = &path[..i],
                None => return (1, 1),
            }
        }
    }
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, next: usize },
}

#[derive(Default)]
struct Builder {
    index: LocationIndex,
    stack: Vec<Frame>,
}

impl Builder {
    /// The path of the node that starts now, as a child of the top frame.
    fn child_path(&mut self) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Map { path, key }) => key.take().map(|k| join(path, &k)),
            Some(Frame::Seq { path, next }) => {
                let p = format!("{path}[{next}]");
                *next += 1;
                Some(p)
            }
        }
    }

    fn expecting_key(&self) -> bool {
        matches!(self.stack.last(), Some(Frame::Map { key: None, .. }))
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn loc(mark: Marker) -> (usize, usize) {
    (mark.line(), mark.col() + 1)
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        match ev {
            Event::Scalar(text, ..) if self.expecting_key() => {
                let Some(Frame::Map { path, key }) = self.stack.last_mut() else {
                    return;
                };
                let full = join(path, &text);
                // The keys under a duplicate are no duplicates of their own.
                let under_duplicate = self.index.duplicates.iter().any(|d| {
                    full.len() > d.path.len()
                        && full.starts_with(&d.path)
                        && matches!(full.as_bytes()[d.path.len()], b'.' | b'[')
                });
                let earlier = self.index.keys.insert(full.clone(), loc(mark));
                if let Some((first, _)) = earlier.filter(|_| !under_duplicate) {
                    let (line, column) = loc(mark);
                    self.index.duplicates.push(Diagnostic::error(
                        &full,
                        line,
                        column,
                        format!("duplicate key `{text}`: it is written already on line {first} of this mapping, and a key may be written once; remove one"),
                    ));
                }
                *key = Some(text);
            }
            Event::Scalar(..) | Event::Alias(_) => {
                if let Some(p) = self.child_path() {
                    self.index.values.insert(p, loc(mark));
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                // A complex (non-scalar) key gets no path; its contents are not indexed.
                let in_list = matches!(self.stack.last(), Some(Frame::Seq { .. }));
                let path = if self.expecting_key() {
                    "?".to_owned()
                } else {
                    self.child_path().unwrap_or_default()
                };
                // A list item has no key to be located by: locate it where it starts.
                if in_list {
                    self.index.values.insert(path.clone(), loc(mark));
                }
                // Block collections are marked where their first entry starts,
                // which reads badly in a message: locate them by their key instead.
                self.stack.push(if matches!(ev, Event::MappingStart(..)) {
                    Frame::Map { path, key: None }
                } else {
                    Frame::Seq { path, next: 0 }
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_to_one_based_locations() {
        let idx = LocationIndex::build("a:\n  b: 1\n  c: [x, y]\n").unwrap();
        assert_eq!(idx.key_or_value("a.b"), (2, 3));
        assert_eq!(idx.value_or_key("a.b"), (2, 6));
        assert_eq!(idx.value_or_key("a.c[1]"), (3, 10));
        assert_eq!(idx.value_or_key("a.nope"), idx.value_or_key("a"));
        let idx = LocationIndex::build("a:\n  - { b: 1 }\n  - [x]\n").unwrap();
        assert_eq!(idx.value_or_key("a[0]"), (2, 5));
        assert_eq!(idx.value_or_key("a[1]"), (3, 5));
    }

    #[test]
    fn hostile_files_are_refused_not_crashed_on() {
        let deep = format!("version: 1\ntasks:\n{}x\n", "- ".repeat(6000));
        let d = LocationIndex::build(&deep).unwrap_err();
        assert!(d.message.contains("nesting"), "{d}");
        let mut bomb = String::from("a: &a [x, x]\n");
        for i in 0..100 {
            bomb.push_str(&format!("k{i}: *a\n"));
        }
        assert!(LocationIndex::build(&bomb)
            .unwrap_err()
            .message
            .contains("aliases"));
    }

    #[test]
    fn duplicate_keys_are_reported() {
        let idx = LocationIndex::build("a: 1\nb: 2\na: 3\n").unwrap();
        assert_eq!(idx.duplicates().len(), 1);
        assert_eq!(idx.duplicates()[0].line, 3);
    }
}
