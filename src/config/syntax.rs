//! YAML syntax errors in the user's words, at the line that is wrong, and
//! the rest of a file with syntax errors still checked.
//!
//! A YAML parser stops where the structure it reads breaks, which is often
//! after the real mistake (the next key, the end of the file) and in its own
//! terms ("mapping values are not allowed in this context"). [`explain`]
//! looks at the text up to that point for the usual causes: a tab in the
//! indentation, a bracket or quote never closed (or closed twice), a line
//! whose indentation matches none of the keys around it, a list item among
//! keys. It says which, at that line.
//!
//! [`recover`] then leaves that line out (with the lines indented under it)
//! and reads the file again, until it parses: each further syntax error is
//! reported the same way, and once the rest parses, its unknown keys and
//! wrongly typed values are reported too, except in the entry that held a
//! left-out line (whose problems may come from leaving it out). The
//! semantic checks (references between sections, values) need the whole
//! file and do not run.

use super::diagnostic::Diagnostic;
use super::locate::{LocationIndex, ScanError};

/// Most syntax errors reported for one file.
const MAX_SYNTAX_ERRORS: usize = 20;

/// The sections whose keys are entry names (`providers.NAME`).
const NAMED_SECTIONS: [&str; 3] = ["providers", "targets", "tasks"];

/// A syntax error explained: what to say, and which line to leave out to
/// read the rest.
pub(super) struct Explained {
    /// The error, at the line that is wrong.
    pub diagnostic: Diagnostic,
    /// 1-based line to leave out (with the lines indented under it).
    pub line: usize,
}

/// One line of the file, as indentation sees it.
#[derive(Debug, Clone, Default)]
struct Line {
    /// Leading spaces and tabs.
    indent: usize,
    /// The text after the indentation, without a trailing comment.
    content: String,
    /// Inside a flow collection, a quoted value or a block scalar at its
    /// start, or blank, or only a comment: not a line of the block structure.
    skip: bool,
    /// Whether the leading whitespace holds a tab.
    tab: bool,
    /// Nothing but whitespace or a comment.
    blank: bool,
}

/// Where brackets and quotes stand up to a point of the text.
#[derive(Debug, Default)]
struct Brackets {
    /// Flow brackets opened and not closed: (char, 1-based line, 1-based column).
    open: Vec<(char, usize, usize)>,
    /// A closing bracket with nothing open.
    stray: Option<(char, usize, usize)>,
    /// A bracket still open when a closer of the other kind came: the
    /// opener, and the closer's character.
    crossed: Option<((char, usize, usize), char)>,
    /// A quote opened and not closed on its own line.
    quote: Option<(char, usize, usize)>,
}

/// Splits `text` into lines and says which belong to the block structure.
fn lines(text: &str) -> Vec<Line> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut block_scalar: Option<usize> = None;
    for raw in text.split('\n') {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        let lead: String = raw
            .chars()
            .take_while(|c| *c == ' ' || *c == '\t')
            .collect();
        let indent = lead.chars().count();
        let rest: String = raw.chars().skip(indent).collect();
        let blank = rest.is_empty() || rest.starts_with('#');
        let mut line = Line {
            indent,
            tab: lead.contains('\t'),
            skip: blank || depth > 0 || quote.is_some(),
            blank,
            ..Line::default()
        };
        if let Some(parent) = block_scalar {
            if blank || indent > parent {
                line.skip = true;
                out.push(line);
                continue;
            }
            block_scalar = None;
        }
        let content = strip_comment(&rest, &mut depth, &mut quote);
        if !line.skip && depth == 0 && quote.is_none() && opens_block_scalar(&content) {
            block_scalar = Some(indent);
        }
        line.content = content;
        out.push(line);
    }
    out
}

/// The line's text without its comment, following brackets and quotes.
fn strip_comment(rest: &str, depth: &mut usize, quote: &mut Option<char>) -> String {
    let mut content = String::new();
    let mut prev = ' ';
    for c in rest.chars() {
        match *quote {
            Some(q) if c == q => *quote = None,
            Some(_) => {}
            None if c == '#' && prev.is_whitespace() => break,
            None if (c == '"' || c == '\'') && starts_value(&content) => *quote = Some(c),
            None if c == '[' || c == '{' => *depth += 1,
            None if c == ']' || c == '}' => *depth = depth.saturating_sub(1),
            None => {}
        }
        content.push(c);
        prev = c;
    }
    // A single-quoted value never spans lines in a routes.yaml worth reading.
    if *quote == Some('\'') {
        *quote = None;
    }
    content.trim_end().to_owned()
}

/// Whether a quote after `before` (the line's text so far) starts a value.
fn starts_value(before: &str) -> bool {
    let last = before.trim_end().chars().last();
    matches!(last, None | Some(':' | '-' | '[' | '{' | ',' | '?'))
}

/// `key: |`, `key: >-`, `- |`: the lines indented under it are text.
fn opens_block_scalar(content: &str) -> bool {
    let value = content
        .rsplit_once(": ")
        .map(|(_, v)| v)
        .or_else(|| content.strip_prefix("- "))
        .unwrap_or("");
    let mut chars = value.trim().chars();
    matches!(chars.next(), Some('|' | '>')) && chars.all(|c| matches!(c, '-' | '+' | '1'..='9'))
}

/// Brackets and quotes of `text` before 1-based `line`:`column`.
fn brackets(text: &str, line: usize, column: usize) -> Brackets {
    let mut b = Brackets::default();
    for (l, raw) in text.split('\n').enumerate().map(|(i, r)| (i + 1, r)) {
        if l > line {
            break;
        }
        let mut before = String::new();
        let mut prev = ' ';
        for (c0, ch) in raw.chars().enumerate() {
            let col = c0 + 1;
            if l == line && col > column {
                break;
            }
            match b.quote {
                Some((q, ..)) if ch == q => b.quote = None,
                Some(_) => {}
                None if ch == '#' && prev.is_whitespace() => break,
                None if (ch == '"' || ch == '\'') && starts_value(&before) => {
                    b.quote = Some((ch, l, col));
                }
                None if ch == '[' || ch == '{' => b.open.push((ch, l, col)),
                None if ch == ']' || ch == '}' => {
                    let opener = if ch == ']' { '[' } else { '{' };
                    match b.open.last() {
                        Some((o, ..)) if *o == opener => {
                            b.open.pop();
                        }
                        Some(&open) => {
                            b.crossed.get_or_insert((open, ch));
                        }
                        None => {
                            b.stray.get_or_insert((ch, l, col));
                        }
                    }
                }
                None => {}
            }
            before.push(ch);
            prev = ch;
        }
        // Quotes are reported on their own line; the parser may go on.
        if b.quote.is_some_and(|(_, ql, _)| ql < line) && l < line {
            return b;
        }
    }
    b
}

/// What a parser's error at 1-based `line`:`column` (its message `info`)
/// means, at the line that is wrong.
pub(super) fn explain(text: &str, line: usize, column: usize, info: &str) -> Explained {
    let all = lines(text);
    let at = |line: usize, column: usize, message: String| Explained {
        diagnostic: Diagnostic::error("", line, column, format!("YAML syntax error: {message}")),
        line,
    };
    let upto = line.min(all.len()).max(1);
    if info.contains("tab") || info.contains("valid YAML whitespace") {
        if let Some(e) = tab(text, &all, upto) {
            return at(e.0, e.1, e.2);
        }
    }
    if info.contains("quoted scalar") {
        if let Some((q, l, c)) = quote_at(text, line, column) {
            return at(l, c, format!("this quoted value is never closed: add the closing {q} (a value that goes on to the next lines must indent them more than its key)"));
        }
    }
    let b = brackets(text, line, column);
    if let Some((q, l, c)) = b.quote {
        return at(
            l,
            c,
            format!("this quoted value is never closed: add the closing {q} on this line"),
        );
    }
    if let Some(((ch, l, c), came)) = b.crossed {
        let closer = if ch == '[' { ']' } else { '}' };
        return at(
            l,
            c,
            format!("this `{ch}` is never closed: add `{closer}` before the `{came}` that follows"),
        );
    }
    if let Some((ch, l, c)) = b.stray {
        let opener = if ch == ']' { '[' } else { '{' };
        return at(
            l,
            c,
            format!("this `{ch}` closes nothing: no `{opener}` is open here"),
        );
    }
    if let Some(&(ch, l, c)) = b.open.iter().rev().find(|(_, l, _)| *l < line) {
        let closer = if ch == '[' { ']' } else { '}' };
        let what = if ch == '[' { "a list" } else { "a mapping" };
        return at(l, c, format!("this `{ch}` is never closed: {what} written in `{ch} {closer}` must end with `{closer}`"));
    }
    if let Some((l, c, message)) = missing_space(&all, upto) {
        return at(l, c, message);
    }
    if let Some((l, message)) = indentation(&all, upto) {
        return at(l, all[l - 1].indent + 1, message);
    }
    at(line, column, plain(info))
}

/// The last line up to `upto` written `key:value`, with no space after the
/// colon: YAML reads it as one word, not as a key and its value.
fn missing_space(all: &[Line], upto: usize) -> Option<(usize, usize, String)> {
    let (i, line) = all
        .iter()
        .enumerate()
        .take(upto)
        .filter(|(_, l)| !l.skip && kind(&l.content) == Kind::Key)
        .filter(|(_, l)| !l.content.contains(": ") && !l.content.ends_with(':'))
        .filter_map(|(i, l)| {
            let (key, value) = l.content.split_once(':')?;
            let is_key = !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            (is_key && !value.starts_with(char::is_whitespace)).then_some((i, l))
        })
        .next_back()?;
    let (key, value) = line.content.split_once(':')?;
    let column = line.indent + key.chars().count() + 1;
    Some((
        i + 1,
        column,
        format!("this `:` has no space after it, so YAML reads `{key}:{value}` as one word, not as a key and its value: write `{key}: {value}`"),
    ))
}

/// A tab in the indentation (or after a `:`), on `upto` or before it.
fn tab(text: &str, all: &[Line], upto: usize) -> Option<(usize, usize, String)> {
    let raw: Vec<&str> = text.split('\n').collect();
    // The parser may stop in the value that runs into the tab's line.
    let next = (upto < all.len()).then_some(upto + 1);
    for l in std::iter::once(upto).chain(next).chain((1..upto).rev()) {
        let line = raw.get(l - 1)?;
        if all[l - 1].tab {
            let col = line.chars().position(|c| c == '\t').unwrap_or(0) + 1;
            return Some((
                l,
                col,
                "this line is indented with a tab: YAML indents with spaces only".to_owned(),
            ));
        }
        if let Some(i) = line.find(":\t") {
            let col = line[..i].chars().count() + 2;
            return Some((
                l,
                col,
                "a tab follows `:` here: write a space after `:`".to_owned(),
            ));
        }
    }
    None
}

/// The quote that opens the value at (or before) 1-based `line`:`column`.
fn quote_at(text: &str, line: usize, column: usize) -> Option<(char, usize, usize)> {
    let raw = text.split('\n').nth(line.checked_sub(1)?)?;
    let found = raw.chars().nth(column.checked_sub(1)?);
    match found {
        Some(q @ ('"' | '\'')) => Some((q, line, column)),
        _ => None,
    }
}

/// The kind of a line of the block structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `key: value` or `key:`.
    Key,
    /// `- item`.
    Item,
}

fn kind(content: &str) -> Kind {
    if content == "-" || content.starts_with("- ") {
        Kind::Item
    } else {
        Kind::Key
    }
}

/// Whether a line opens a nested block: `key:` or `-` with nothing after
/// (or only an anchor or a tag, `key: &base`).
fn opens(content: &str) -> bool {
    let value = content
        .rsplit_once(": ")
        .map(|(_, v)| v)
        .or_else(|| content.strip_prefix("- "))
        .map(str::trim);
    let only_anchor =
        value.is_some_and(|v| v.starts_with(['&', '!']) && !v.contains(char::is_whitespace));
    content.ends_with(':') || content == "-" || only_anchor
}

/// Whether a line reads as structure (a key or an item), not as the
/// continuation of a long plain value.
fn structural(content: &str) -> bool {
    kind(content) == Kind::Item || content.ends_with(':') || content.contains(": ")
}

/// The first line up to `upto` whose indentation fits none of the keys
/// around it, with what is wrong with it.
fn indentation(all: &[Line], upto: usize) -> Option<(usize, String)> {
    let mut stack: Vec<(usize, Kind)> = Vec::new();
    let mut prev: Option<&Line> = None;
    for (i, line) in all.iter().enumerate().take(upto) {
        if line.skip {
            continue;
        }
        let (indent, k) = (line.indent, kind(&line.content));
        let prev_opens = prev.is_none_or(|p| opens(&p.content));
        match stack.last().copied() {
            None => stack.push((indent, k)),
            Some((top, _)) if indent > top => {
                if !prev_opens {
                    if !structural(&line.content) {
                        continue;
                    }
                    if let Some(found) = dip(all, i, indent) {
                        return Some(found);
                    }
                    let above = prev.map_or(0, |p| p.indent);
                    return Some((i + 1, format!("this line is indented more than the keys around it ({}, where the line above has {above} and already has a value): line it up with the keys it belongs with, or, if it belongs under the line above, remove that line's value", spaces(indent))));
                }
                stack.push((indent, k));
            }
            Some((top, top_kind)) => {
                if indent == top && k == Kind::Item && top_kind == Kind::Key && prev_opens {
                    // `key:` then `- item` at the key's own indentation.
                    stack.push((indent, k));
                } else {
                    let mut above = top;
                    while stack.last().is_some_and(|(t, _)| *t > indent) {
                        above = stack.pop().map_or(above, |(t, _)| t);
                    }
                    if let Some(message) = fits(&mut stack, indent, k, above) {
                        return Some((i + 1, message));
                    }
                }
            }
        }
        if k == Kind::Item {
            let inner = line.content[1..].trim_start();
            if !inner.is_empty() && structural(inner) {
                let offset = line.content.len() - inner.len();
                stack.push((indent + offset, kind(inner)));
            }
        }
        prev = Some(line);
    }
    None
}

/// Line `i` (0-based), at `indent`, comes back to the indentation of the
/// lines above the one before it: that one is the line indented too little.
fn dip(all: &[Line], i: usize, indent: usize) -> Option<(usize, String)> {
    let mut above = all[..i].iter().enumerate().rev().filter(|(_, l)| !l.skip);
    let (p, prev) = above.next()?;
    let (_, before) = above.next()?;
    (before.indent == indent && prev.indent < indent).then(|| {
        (p + 1, format!("this line is indented less than the keys around it ({}, where the lines above and below it have {indent}): line it up with them (if its indentation is right, the lines after it are indented too much)", spaces(prev.indent)))
    })
}

/// Whether a line at `indent` of kind `k` fits the level now on top of
/// `stack` (after popping deeper levels; `above` is the last popped).
fn fits(stack: &mut Vec<(usize, Kind)>, indent: usize, k: Kind, above: usize) -> Option<String> {
    match stack.last().copied() {
        Some((top, top_kind)) if top == indent => {
            if top_kind == k {
                return None;
            }
            let n = stack.len();
            if n >= 2 && stack[n - 2] == (indent, k) {
                // The list written at its key's indentation has ended.
                stack.pop();
                return None;
            }
            Some(if k == Kind::Item {
                "this line is a list item (`- ...`) among the keys of a mapping: a mapping holds `key: value` lines, a list `- item` lines, and they cannot be mixed at one indentation".to_owned()
            } else {
                "this line is a key among the items of a list: a list holds `- item` lines; indent the key under an item, or start it with `- `".to_owned()
            })
        }
        below => {
            let below = below.map_or(0, |(t, _)| t);
            Some(format!("this line is indented differently from the keys around it ({}, where they have {above} or {below}): line it up with the keys it belongs with", spaces(indent)))
        }
    }
}

/// `1 space`, `3 spaces`.
fn spaces(n: usize) -> String {
    if n == 1 {
        "1 space".to_owned()
    } else {
        format!("{n} spaces")
    }
}

/// `text` with the number that starts at 1-based `line`:`column` written
/// as `0`; `None` when no number starts there.
pub(super) fn zero_number_at(text: &str, line: usize, column: usize) -> Option<String> {
    let mut rows: Vec<String> = text.split('\n').map(str::to_owned).collect();
    let row = rows.get_mut(line.checked_sub(1)?)?;
    let start: usize = row
        .chars()
        .take(column.checked_sub(1)?)
        .map(char::len_utf8)
        .sum();
    let rest = row.get(start..)?;
    let digits = rest
        .char_indices()
        .take_while(|(i, c)| c.is_ascii_digit() || (*i == 0 && matches!(c, '-' | '+')))
        .count();
    if digits == 0 {
        return None;
    }
    row.replace_range(start..start + digits, "0");
    Some(rows.join("\n"))
}

/// A parser message that no cause above explains, in plainer words.
fn plain(info: &str) -> String {
    if info.contains("mapping values are not allowed") {
        "this value holds `: ` (a colon and a space), which YAML reads as another key: put the value in quotes".to_owned()
    } else if info.contains("did not find expected key") || info.contains("expected '-' indicator")
    {
        "this line does not fit the structure above it: check its indentation against the keys around it".to_owned()
    } else {
        info.to_owned()
    }
}

/// The lines to leave out for the error at 1-based `line`: it and the lines
/// indented under it.
fn subtree(all: &[Line], line: usize) -> std::ops::Range<usize> {
    let start = line - 1;
    if start >= all.len() {
        return start..start;
    }
    // Lines under a tab-indented one are their own: each tab is reported.
    if all[start].tab {
        return start..start + 1;
    }
    let width = all[start].indent;
    let mut end = start + 1;
    while all.get(end).is_some_and(|l| l.blank || l.indent > width) {
        end += 1;
    }
    start..end
}

/// The indentation of line `i` (0-based) as the structure sees it. A tab
/// has no width: a tab-indented line is taken for a child of an opening line
/// above it, else for its sibling.
fn width(all: &[Line], i: usize) -> usize {
    let above = all[..i].iter().rev().find(|l| !l.skip);
    match above {
        Some(a) if all[i].tab => a.indent + usize::from(opens(&a.content)),
        _ => all[i].indent,
    }
}

/// The entry holding 1-based `line` (`providers.a`, `listen`), by the keys
/// indented less above it; empty when none can be told.
fn entry_of(all: &[Line], line: usize) -> String {
    let key = |l: &Line| -> Option<String> {
        if kind(&l.content) == Kind::Item {
            return None;
        }
        let k = l.content.split_once(':').map_or("", |(k, _)| k).trim();
        Some(k.trim_matches(['"', '\'']).to_owned()).filter(|k| !k.is_empty())
    };
    let Some(own) = all.get(line - 1) else {
        return String::new();
    };
    let mut path = vec![key(own)];
    let mut limit = width(all, line - 1);
    for l in all[..line - 1].iter().rev() {
        if limit == 0 {
            break;
        }
        if !l.skip && l.indent < limit {
            path.push(key(l));
            limit = l.indent;
        }
    }
    path.reverse();
    // Up to the first unknown step; a named section's entry, else the section.
    let known: Vec<String> = path.into_iter().map_while(|k| k).collect();
    let depth = match known.first() {
        Some(s) if NAMED_SECTIONS.contains(&s.as_str()) => 2,
        _ => 1,
    };
    known.into_iter().take(depth).collect::<Vec<_>>().join(".")
}

/// Whether a problem found in the rest of the file is about `entry`: the
/// same path, below it or above it.
fn about(path: &str, entry: &str) -> bool {
    let under = |p: &str, a: &str| {
        p.len() > a.len() && p.starts_with(a) && matches!(p.as_bytes()[a.len()], b'.' | b'[')
    };
    entry.is_empty() || path.is_empty() || path == entry || under(path, entry) || under(entry, path)
}

/// Every syntax error of `text` explained, then (once the rest parses with
/// the offending lines left out) the problems `read` finds in the rest,
/// except in the entries that held a left-out line.
pub(super) fn recover<F>(text: &str, read: F) -> Vec<Diagnostic>
where
    F: Fn(&str) -> Vec<Diagnostic>,
{
    let mut rows: Vec<String> = text.split('\n').map(str::to_owned).collect();
    let mut found: Vec<Diagnostic> = Vec::new();
    let mut entries: Vec<String> = Vec::new();
    for _ in 0..MAX_SYNTAX_ERRORS {
        let current = rows.join("\n");
        let errors: Vec<Explained> = match LocationIndex::scan(&current) {
            Err(ScanError::Refused(d)) => {
                found.push(d);
                break;
            }
            Err(ScanError::Syntax { line, column, info }) => {
                vec![explain(&current, line, column, &info)]
            }
            Ok(index) if !index.duplicates().is_empty() => index
                .duplicates()
                .iter()
                .map(|d| Explained {
                    diagnostic: d.clone(),
                    line: d.line,
                })
                .collect(),
            Ok(_) => {
                found.extend(
                    read(&current)
                        .into_iter()
                        .filter(|d| !entries.iter().any(|e| about(&d.path, e))),
                );
                break;
            }
        };
        let all = lines(&current);
        let mut progress = false;
        for mut e in errors {
            e.line = e.line.max(1);
            entries.push(entry_of(&all, e.line));
            for row in subtree(&all, e.line) {
                if let Some(r) = rows.get_mut(row) {
                    progress |= !r.is_empty();
                    r.clear();
                }
            }
            found.push(e.diagnostic);
        }
        if !progress {
            break;
        }
    }
    found.sort_by_key(|d| (d.line, d.column));
    found.dedup();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_by_the_keys_indented_less() {
        let text = "version: 1\nproviders:\n  a:\n    base_url: x\n     timeout: 2s\nlisten: x\n";
        let all = lines(text);
        assert_eq!(entry_of(&all, 5), "providers.a");
        assert_eq!(entry_of(&all, 3), "providers.a");
        assert_eq!(entry_of(&all, 6), "listen");
        assert_eq!(subtree(&all, 3), 2..5);
        assert!(about("providers.a.timeout", "providers.a"));
        assert!(about("providers", "providers.a"));
        assert!(!about("providers.ab", "providers.a"));
        assert!(!about("tasks.t", "providers.a"));
    }

    #[test]
    fn any_one_broken_line_of_the_example_is_explained_without_a_panic() {
        let example = include_str!("../../routes.yaml");
        let rows: Vec<&str> = example.split('\n').collect();
        for i in 0..rows.len() {
            for edit in 0..6 {
                let mut broken: Vec<String> = rows.iter().map(|r| (*r).to_owned()).collect();
                let row = &mut broken[i];
                match edit {
                    0 => row.insert(0, ' '),
                    1 => row.insert(0, '\t'),
                    2 => row.push_str(" ["),
                    3 => row.push_str(" \"x"),
                    4 => row.push_str(": y: z"),
                    _ => {
                        row.drain(..row.len().min(1));
                    }
                }
                let text = broken.join("\n");
                if let Err(diags) = super::super::parse(&text) {
                    assert!(!diags.is_empty(), "line {}: {text}", i + 1);
                    assert!(diags.iter().all(|d| d.line >= 1 && d.column >= 1));
                }
            }
        }
    }

    #[test]
    fn well_formed_files_have_no_misindented_line() {
        let shapes = "a: &base\n  x: 1\nb:\n- one\n- two: 2\n  three: 3\nc:\n  - match:\n      status: 503\n    action: failover\n  -   k: v\n      j: w\nd: \"two\n  lines\"\ne: >-\n    folded\n    text\nf:\n    deep: 1\n";
        assert!(serde_yaml::from_str::<serde_yaml::Value>(shapes).is_ok());
        for text in [shapes, include_str!("../../routes.yaml")] {
            let all = lines(text);
            assert_eq!(indentation(&all, all.len()), None, "{text}");
        }
    }

    #[test]
    fn block_scalars_and_flows_are_not_structure() {
        let text = "a: |\n  text: here\n    more\nb: [x,\n   y]\nc: 1\n";
        let all = lines(text);
        assert!(all[1].skip && all[2].skip && all[4].skip);
        assert!(!all[3].skip && !all[5].skip);
        assert_eq!(indentation(&all, all.len()), None);
    }
}
