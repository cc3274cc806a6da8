//! Reading a file that serde cannot read whole: every unknown key and every
//! value of the wrong type is recorded, taken out of the value tree, and the
//! rest read again, so one run reports every entry's problems and the
//! semantic checks still run on what is left.
//!
//! serde stops at the first problem of whatever it deserializes, so each
//! section entry (and each other top-level key) is read on its own, and the
//! sweep repeats until nothing is left to take out. An entry that taking a
//! value out leaves unreadable (a required field gone) is taken out whole;
//! [`Removed`] remembers all of it, so that compiling neither reports a
//! reference to a broken entry as unknown nor points a later list item at
//! the wrong line.

use std::collections::{BTreeMap, BTreeSet};

use serde::de::DeserializeOwned;
use serde_yaml::Value;

use super::diagnostic::Diagnostic;
use super::locate::LocationIndex;
use super::{RawConfig, RawProvider, RawTarget, RawTask};

/// Most sweeps of one file. Each sweep takes out at least one value per
/// entry that still has a problem, so this bounds the work on a hostile file.
const MAX_SWEEPS: usize = 256;

/// One step of a path in the value tree.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// A mapping key.
    Key(String),
    /// A list item, counted in the tree as it is now (after removals).
    Item(usize),
}

/// Dotted form: `providers.a.retry.max`, `tasks.t.chain[1]`.
fn dotted(path: &[Step]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Key(k) if out.is_empty() => out.push_str(k),
            Step::Key(k) => {
                out.push('.');
                out.push_str(k);
            }
            Step::Item(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// What reading took out of the file so that the rest could be read: values
/// of the wrong type, unknown keys, and entries left unreadable without them.
#[derive(Debug, Default, Clone)]
pub struct Removed {
    /// Dotted paths, as in the file, of the values taken out.
    paths: BTreeSet<String>,
    /// Per list (its dotted path in the file), the file's indices of the
    /// items taken out, ascending.
    items: BTreeMap<String, Vec<usize>>,
}

impl Removed {
    /// Nothing removed.
    pub const NONE: Removed = Removed {
        paths: BTreeSet::new(),
        items: BTreeMap::new(),
    };

    /// Whether nothing was taken out.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// The file's own dotted path for `path`, a path into what was read (whose
    /// list indices count only the items left).
    #[must_use]
    pub fn original(&self, path: &str) -> String {
        if self.items.is_empty() {
            return path.to_owned();
        }
        let mut out = String::new();
        let mut rest = path;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']').map(|c| open + c);
            let index = close.and_then(|c| rest[open + 1..c].parse::<usize>().ok());
            match (close, index) {
                (Some(close), Some(i)) => {
                    out.push_str(&rest[..open]);
                    let i = self.file_index(&out, i);
                    out.push_str(&format!("[{i}]"));
                    rest = &rest[close + 1..];
                }
                _ => {
                    out.push_str(&rest[..=open]);
                    rest = &rest[open + 1..];
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// The file's index of the `i`-th item left in `list`.
    fn file_index(&self, list: &str, i: usize) -> usize {
        self.items.get(list).map_or(i, |gone| {
            gone.iter()
                .fold(i, |index, &g| if g <= index { index + 1 } else { index })
        })
    }

    /// Whether the value at `path` (the file's) was taken out, itself or
    /// with an ancestor: anything said about it follows from that removal.
    #[must_use]
    pub fn gone(&self, path: &str) -> bool {
        self.paths.iter().any(|p| p == path || is_under(path, p))
    }

    /// Whether nothing at, above or below `path` (the file's) was taken out:
    /// a check of how the parts of a value fit together means something only
    /// then.
    #[must_use]
    pub fn intact(&self, path: &str) -> bool {
        !self.gone(path) && !self.paths.iter().any(|p| is_under(p, path))
    }

    /// Records that the value at `path` (in the tree as it is now) is taken
    /// out; returns the file's dotted path of it.
    fn record(&mut self, path: &[Step]) -> String {
        let file_path = match path.split_last() {
            Some((Step::Item(i), parent)) => {
                let list = self.original(&dotted(parent));
                let i = self.file_index(&list, *i);
                let gone = self.items.entry(list.clone()).or_default();
                let at = gone.partition_point(|&g| g < i);
                gone.insert(at, i);
                format!("{list}[{i}]")
            }
            Some((Step::Key(_), _)) | None => self.original(&dotted(path)),
        };
        self.paths.insert(file_path.clone());
        file_path
    }
}

/// Whether dotted `path` is strictly below dotted `ancestor`.
fn is_under(path: &str, ancestor: &str) -> bool {
    !ancestor.is_empty()
        && path.len() > ancestor.len()
        && path.starts_with(ancestor)
        && matches!(path.as_bytes()[ancestor.len()], b'.' | b'[')
}

/// Takes the value at `path` out of `tree`.
fn take(tree: &mut Value, path: &[Step]) -> Option<Value> {
    let (last, parent) = path.split_last()?;
    let mut node = tree;
    for step in parent {
        node = match step {
            Step::Key(k) => node.get_mut(k.as_str())?,
            Step::Item(i) => node.get_mut(*i)?,
        };
    }
    match last {
        Step::Key(k) => node.as_mapping_mut()?.remove(k.as_str()),
        Step::Item(i) => {
            let list = node.as_sequence_mut()?;
            (*i < list.len()).then(|| list.remove(*i))
        }
    }
}

/// What one sweep found in one entry.
struct Problem {
    /// What to tell the user (`None` when it follows from an earlier removal).
    diagnostic: Option<Diagnostic>,
    /// The value to take out so that the entry can be read again.
    remove: Option<Vec<Step>>,
}

/// A file read despite its problems.
pub(super) struct Read {
    /// What was left, read.
    pub raw: RawConfig,
    /// Every problem found, located, in file order.
    pub problems: Vec<Diagnostic>,
    /// What was taken out to read the rest.
    pub removed: Removed,
}

/// Reads `tree` (the file as a YAML value), taking out what cannot be read.
///
/// # Errors
/// Every problem found, when the file cannot be read even so (it is not a
/// mapping, a top-level key is not a string, or the sweeps ran out).
pub(super) fn read(tree: Value, index: &LocationIndex) -> Result<Read, Vec<Diagnostic>> {
    let mut tree = text_keys(tree);
    let mut removed = Removed::default();
    let mut problems: Vec<Diagnostic> = Vec::new();
    let sorted = |mut d: Vec<Diagnostic>| {
        d.sort_by_key(|d| (d.line, d.column));
        d
    };
    for _ in 0..MAX_SWEEPS {
        let found = sweep(&tree, index, &removed);
        if found.is_empty() {
            return match serde_yaml::from_value::<RawConfig>(tree) {
                Ok(raw) => Ok(Read {
                    raw,
                    problems: sorted(problems),
                    removed,
                }),
                // The sweep reads every key the way this would: not expected.
                Err(e) => {
                    problems.push(Diagnostic::error("", 1, 1, strip_location(&e.to_string())));
                    Err(sorted(problems))
                }
            };
        }
        let mut stuck = false;
        for problem in found {
            problems.extend(problem.diagnostic);
            // Entries are disjoint subtrees, so one removal never moves another's path.
            match problem.remove {
                Some(path) if take(&mut tree, &path).is_some() => {
                    removed.record(&path);
                }
                Some(_) | None => stuck = true,
            }
        }
        if stuck {
            break;
        }
    }
    Err(sorted(problems))
}

/// `tree` with its number and boolean mapping keys as text (`503:` is the
/// key `"503"`), as serde reads them from the file's text: so a map keyed by
/// status codes reads alike whether or not something else made the file go
/// through the sweep.
fn text_keys(tree: Value) -> Value {
    match tree {
        Value::Mapping(map) => Value::Mapping(
            map.into_iter()
                .map(|(key, value)| {
                    let key = match key {
                        Value::Number(n) => Value::String(n.to_string()),
                        Value::Bool(b) => Value::String(b.to_string()),
                        other @ (Value::Null
                        | Value::String(_)
                        | Value::Sequence(_)
                        | Value::Mapping(_)
                        | Value::Tagged(_)) => other,
                    };
                    (key, text_keys(value))
                })
                .collect(),
        ),
        Value::Sequence(items) => Value::Sequence(items.into_iter().map(text_keys).collect()),
        Value::Tagged(mut tagged) => {
            tagged.value = text_keys(tagged.value);
            Value::Tagged(tagged)
        }
        other @ (Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_)) => other,
    }
}

/// Reads each entry of the named-map sections, and each other top-level key,
/// on its own, and says what to take out of each that cannot be read.
fn sweep(tree: &Value, index: &LocationIndex, removed: &Removed) -> Vec<Problem> {
    let mut sw = Sweep {
        index,
        removed,
        found: Vec::new(),
    };
    let Value::Mapping(top) = tree else {
        sw.stuck("the file must be a mapping of keys (version, providers, targets, tasks, ...)");
        return sw.found;
    };
    for (key, value) in top {
        let Some(name) = key.as_str() else {
            sw.stuck("top-level keys must be strings");
            continue;
        };
        let section = [Step::Key(name.to_owned())];
        match (name, value.as_mapping()) {
            ("providers", Some(entries)) => sw.entries::<RawProvider>(&section, entries),
            ("targets", Some(entries)) => sw.entries::<RawTarget>(&section, entries),
            ("tasks", Some(entries)) => sw.entries::<RawTask>(&section, entries),
            // Any other key is read as the whole file holding only it: its
            // type is the file's, and an unknown key is serde's own error.
            _ => {
                let mut alone = serde_yaml::Mapping::new();
                alone.insert(key.clone(), value.clone());
                sw.check::<RawConfig>(&[], &Value::Mapping(alone));
            }
        }
    }
    sw.found
}

struct Sweep<'a> {
    index: &'a LocationIndex,
    removed: &'a Removed,
    found: Vec<Problem>,
}

impl Sweep<'_> {
    /// A problem of the whole file: nothing can be taken out to fix it.
    fn stuck(&mut self, message: &str) {
        self.found.push(Problem {
            diagnostic: Some(Diagnostic::error("", 1, 1, message)),
            remove: None,
        });
    }

    /// The entries of a named-map section, each on its own.
    fn entries<T: DeserializeOwned>(&mut self, section: &[Step], entries: &serde_yaml::Mapping) {
        for (name, entry) in entries {
            let name = name
                .as_str()
                .map_or_else(|| format!("{name:?}"), str::to_owned);
            let mut at = section.to_vec();
            at.push(Step::Key(name));
            self.check::<T>(&at, entry);
        }
    }

    /// Deserializes `value` (at `base`) as `T`; on failure records the
    /// problem, located at the deepest path serde reached (the offending key
    /// itself for an unknown key), and what to take out: the unknown key,
    /// the wrongly typed value, or the entry a required field is missing from.
    fn check<T: DeserializeOwned>(&mut self, base: &[Step], value: &Value) {
        let Err(err) = serde_path_to_error::deserialize::<_, T>(value.clone()) else {
            return;
        };
        let mut path = base.to_vec();
        for segment in err.path().iter() {
            match segment {
                serde_path_to_error::Segment::Seq { index } => path.push(Step::Item(*index)),
                serde_path_to_error::Segment::Map { key } => path.push(Step::Key(key.clone())),
                serde_path_to_error::Segment::Enum { .. }
                | serde_path_to_error::Segment::Unknown => {}
            }
        }
        let mut message = in_words(&strip_location(&err.inner().to_string()));
        // serde names the key in backticks; for an unknown key the path may or
        // may not end with it already.
        let named = message
            .split('`')
            .nth(1)
            .map(str::to_owned)
            .unwrap_or_default();
        if message.starts_with("unknown field `") {
            if path.last() != Some(&Step::Key(named.clone())) {
                path.push(Step::Key(named));
            }
            message.push_str(moved_hint(&path));
        } else if message.starts_with("missing field `") {
            // A required field taken out for its type leaves the entry
            // unreadable: take the entry out too, but say nothing more.
            let field = format!("{}.{named}", self.removed.original(&dotted(&path)));
            if self.removed.gone(&field) {
                self.found.push(Problem {
                    diagnostic: None,
                    remove: Some(path),
                });
                return;
            }
        }
        let file_path = self.removed.original(&dotted(&path));
        let (line, column) = self.index.key_or_value(&file_path);
        self.found.push(Problem {
            diagnostic: Some(Diagnostic::error(&file_path, line, column, message)),
            remove: Some(path),
        });
    }
}

/// Where a key that an older routes.yaml had went, for its unknown-key error.
fn moved_hint(path: &[Step]) -> &'static str {
    let moved = match path {
        [Step::Key(tasks), Step::Key(_), Step::Key(limit), Step::Key(key)] => {
            tasks == "tasks"
                && limit == "rate_limit"
                && matches!(key.as_str(), "per_caller_header" | "max_callers")
        }
        _ => false,
    };
    if moved {
        "; per-caller limits moved to `per_caller: { header, rps, burst, max_callers }`"
    } else {
        ""
    }
}

/// A serde type error (`invalid type: string "x", expected u32`) in the
/// user's words (`must be a whole number (0 or more), not "x"`); any other
/// message as it is.
pub(super) fn in_words(message: &str) -> String {
    let parsed = ["invalid type: ", "invalid value: "]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.rsplit_once(", expected "));
    if let Some((got, expected)) = parsed {
        if let Some(want) = wanted(expected) {
            let value = found(got);
            let scalar = ["integer", "floating", "boolean"]
                .iter()
                .any(|kind| got.starts_with(kind));
            return if want == TEXT && scalar {
                format!("{want}, not {value} (write '{value}' to make it text)")
            } else {
                format!("{want}, not {value}")
            };
        }
    }
    if let Some(rest) = message.strip_prefix("unknown variant ") {
        if let Some((got, valid)) = rest.split_once(", expected one of ") {
            return format!("{got} is not one of {}", valid.replace('`', ""));
        }
    }
    message.to_owned()
}

/// What a string field asks for.
const TEXT: &str = "must be text";

/// What serde's `expected ...` asks for, as a rule the value breaks.
fn wanted(expected: &str) -> Option<String> {
    let words = match expected {
        "u8" => "must be a whole number from 0 to 255",
        "u16" => "must be a whole number from 0 to 65535",
        "u32" => "must be a whole number from 0 to 4294967295",
        "u64" | "u128" | "usize" => "must be a whole number (0 or more)",
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "must be a whole number",
        "f32" | "f64" => "must be a number",
        "a boolean" => "must be true or false",
        "a string" | "a borrowed string" => TEXT,
        "a character" => "must be a single character",
        "a sequence" => "must be a list (e.g. `[a, b]`)",
        "a map" => "must be a mapping of keys (e.g. `{ key: value }`)",
        "unit" => "must be empty",
        _ if expected.starts_with("struct ") => "must be a mapping of keys (e.g. `{ key: value }`)",
        _ => return None,
    };
    Some(words.to_owned())
}

/// serde's description of the value found (`string "x"`, `integer `-1``), as
/// the user wrote it.
fn found(got: &str) -> String {
    let quoted = |s: &str| s.trim_matches('`').to_owned();
    match got.split_once(' ') {
        Some(("string", text)) => text.to_owned(),
        Some(("integer" | "boolean" | "character", v)) => quoted(v),
        Some(("floating", v)) => quoted(v.trim_start_matches("point ")),
        _ => match got {
            "sequence" => "a list".to_owned(),
            "map" => "a mapping".to_owned(),
            "unit value" | "unit" => "nothing (null)".to_owned(),
            other => other.to_owned(),
        },
    }
}

/// serde_yaml appends " at line L column C" to its messages; we print locations ourselves.
pub(super) fn strip_location(message: &str) -> String {
    match message.find(" at line ") {
        Some(i) => message[..i].to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_primitive_type_error_is_said_in_words() {
        let cases = [
            (
                "invalid type: string \"x\", expected u8",
                "must be a whole number from 0 to 255, not \"x\"",
            ),
            (
                "invalid value: integer `70000`, expected u16",
                "must be a whole number from 0 to 65535, not 70000",
            ),
            (
                "invalid value: integer `-1`, expected u32",
                "must be a whole number from 0 to 4294967295, not -1",
            ),
            (
                "invalid type: floating point `1.5`, expected u64",
                "must be a whole number (0 or more), not 1.5",
            ),
            (
                "invalid type: map, expected usize",
                "must be a whole number (0 or more), not a mapping",
            ),
            (
                "invalid type: boolean `true`, expected i64",
                "must be a whole number, not true",
            ),
            (
                "invalid type: string \"x\", expected i8",
                "must be a whole number, not \"x\"",
            ),
            (
                "invalid type: string \"x\", expected f32",
                "must be a number, not \"x\"",
            ),
            (
                "invalid type: sequence, expected f64",
                "must be a number, not a list",
            ),
            (
                "invalid type: string \"yes\", expected a boolean",
                "must be true or false, not \"yes\"",
            ),
            (
                "invalid type: integer `7`, expected a string",
                "must be text, not 7 (write '7' to make it text)",
            ),
            (
                "invalid type: map, expected a string",
                "must be text, not a mapping",
            ),
            (
                "invalid type: string \"ab\", expected a character",
                "must be a single character, not \"ab\"",
            ),
            (
                "invalid type: string \"a\", expected a sequence",
                "must be a list (e.g. `[a, b]`), not \"a\"",
            ),
            (
                "invalid type: sequence, expected a map",
                "must be a mapping of keys (e.g. `{ key: value }`), not a list",
            ),
            (
                "invalid type: integer `5`, expected struct RawBudget",
                "must be a mapping of keys (e.g. `{ key: value }`), not 5",
            ),
            (
                "unknown field `x`, expected `a`",
                "unknown field `x`, expected `a`",
            ),
        ];
        for (serde, words) in cases {
            assert_eq!(in_words(serde), words, "{serde}");
        }
    }

    fn key(k: &str) -> Step {
        Step::Key(k.to_owned())
    }

    #[test]
    fn removed_list_items_translate_back_to_the_files_indices() {
        let mut r = Removed::default();
        // File list a: [x0, x1, x2, x3, x4]; take out x1, then (now at 2) x3.
        assert_eq!(r.record(&[key("a"), Step::Item(1)]), "a[1]");
        assert_eq!(r.record(&[key("a"), Step::Item(2)]), "a[3]");
        assert_eq!(r.original("a[0]"), "a[0]");
        assert_eq!(r.original("a[1].b"), "a[2].b");
        assert_eq!(r.original("a[2]"), "a[4]");
        assert_eq!(r.original("c[1]"), "c[1]");
        assert!(r.gone("a[3].b") && !r.gone("a[2]") && !r.gone("a"));
        assert!(!r.intact("a") && r.intact("a[2]"));
    }

    #[test]
    fn gone_and_intact_see_ancestors_and_descendants_apart() {
        let mut r = Removed::default();
        r.record(&[key("providers"), key("gpt-4.1")]);
        r.record(&[key("tasks"), key("t"), key("budget"), key("max_failovers")]);
        assert!(r.gone("providers.gpt-4.1") && r.gone("providers.gpt-4.1.base_url"));
        assert!(!r.gone("providers.gpt-4") && !r.gone("providers"));
        assert!(!r.gone("tasks.t.budget") && !r.intact("tasks.t.budget"));
        assert!(r.intact("tasks.t.chain") && r.intact("version"));
    }

    #[test]
    fn a_file_of_many_broken_items_ends_with_what_it_found() {
        let mut text = String::from("version: 1\nerror_classes:\n");
        for _ in 0..300 {
            text.push_str("  - { action: [x] }\n");
        }
        let tree: Value = serde_yaml::from_str(&text).unwrap();
        let index = LocationIndex::build(&text).unwrap();
        let problems = read(tree, &index).err().unwrap();
        assert!(problems.len() >= MAX_SWEEPS / 2, "{}", problems.len());
    }
}
