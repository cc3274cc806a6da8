//! The shape ARCHITECTURE.md promises, checked on the source text: no module
//! of `src/` reaches, through its imports, a module that imports it (a parent
//! and its own submodules aside), and no function outside test modules is
//! over 100 lines. Run alone: `cargo test --test tests architecture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest function allowed, in lines from `fn` to its closing brace.
const MAX_FUNCTION_LINES: usize = 100;

/// Module path (`proxy::attempt`, `` for the crate root) -> file.
fn modules() -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(&src).unwrap().with_extension("");
            let mut name = rel
                .to_string_lossy()
                .replace(std::path::MAIN_SEPARATOR, "::");
            if let Some(parent) = name.strip_suffix("::mod") {
                name = parent.to_owned();
            }
            if name == "lib" || name == "main" {
                name.clear();
            }
            (name, f)
        })
        .collect()
}

/// The text with comments, string and char literals blanked (newlines kept),
/// and `#[cfg(test)] mod … { … }` blocks removed.
fn code(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').map_or(text.len(), |n| i + n);
            i = end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(text.len(), |n| i + n + 2);
            out.extend(text[i..end].chars().filter(|c| *c == '\n'));
            i = end;
        } else if let Some(hashes) = raw_string_start(rest) {
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes + usize::from(rest.starts_with('b'));
            let end = text[body..]
                .find(&close)
                .map_or(text.len(), |n| body + n + close.len());
            out.push_str("\"\"");
            out.extend(text[i..end].chars().filter(|c| *c == '\n'));
            i = end;
        } else if rest.starts_with('"') || rest.starts_with("b\"") {
            let mut j = i + if rest.starts_with('b') { 2 } else { 1 };
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            out.extend(text[i..j.min(text.len())].chars().filter(|c| *c == '\n'));
            i = (j + 1).min(text.len());
        } else if let Some(len) = char_literal(rest) {
            out.push_str("' '");
            i += len;
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    strip_test_modules(&out)
}

fn raw_string_start(rest: &str) -> Option<usize> {
    let r = rest.strip_prefix('b').unwrap_or(rest).strip_prefix('r')?;
    let hashes = r.len() - r.trim_start_matches('#').len();
    r[hashes..].starts_with('"').then_some(hashes)
}

fn char_literal(rest: &str) -> Option<usize> {
    let b = rest.as_bytes();
    if b.first() != Some(&b'\'') {
        return None;
    }
    if b.get(1) == Some(&b'\\') {
        return rest[2..].find('\'').map(|n| n + 3);
    }
    let c = rest[1..].chars().next()?;
    (rest[1 + c.len_utf8()..].starts_with('\'')).then_some(2 + c.len_utf8())
}

fn strip_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_mod = trimmed.starts_with("mod ") || trimmed.starts_with("pub mod ");
        match (is_mod, after.find('{')) {
            (true, Some(open)) => {
                out.push_str(&rest[..at]);
                let end = matching_brace(&after[open..]).map_or(after.len(), |n| open + n);
                rest = &after[end..];
            }
            _ => {
                out.push_str(&rest[..at + "#[cfg(test)]".len()]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Index just past the brace that closes the one `text` starts with.
fn matching_brace(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The modules `code` (of module `me`) refers to through `crate::` and `super::` paths.
fn references(me: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut paths = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        paths.push(path_after(&code[at + "crate::".len()..]));
    }
    // `use crate::{a::X, b}` lists.
    for (at, _) in code.match_indices("use crate::{") {
        let list = &code[at + "use crate::{".len()..];
        let list = &list[..list.find(';').unwrap_or(list.len())];
        for item in list.split([',', '{', '}']) {
            paths.push(path_after(item.trim()));
        }
    }
    let parent = me.rsplit_once("::").map_or("", |(p, _)| p);
    for (at, _) in code.match_indices("super::") {
        let tail = path_after(&code[at + "super::".len()..]);
        paths.push(if parent.is_empty() {
            tail
        } else {
            format!("{parent}::{tail}")
        });
    }
    paths
        .into_iter()
        .filter_map(|p| resolve(&p, known))
        .filter(|m| m != me)
        .collect()
}

fn path_after(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect::<String>()
        .trim_end_matches(':')
        .to_owned()
}

/// The longest known module that `path` starts with.
fn resolve(path: &str, known: &BTreeSet<String>) -> Option<String> {
    let mut parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    while !parts.is_empty() {
        let candidate = parts.join("::");
        if known.contains(&candidate) {
            return Some(candidate);
        }
        parts.pop();
    }
    None
}

/// Whether one module is the other's ancestor (those may refer to each other).
fn related(a: &str, b: &str) -> bool {
    a.is_empty()
        || b.is_empty()
        || a.starts_with(&format!("{b}::"))
        || b.starts_with(&format!("{a}::"))
}

fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules();
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    modules
        .iter()
        .map(|(name, file)| {
            let code = code(&std::fs::read_to_string(file).unwrap());
            let refs = references(name, &code, &known)
                .into_iter()
                .filter(|to| !related(name, to))
                .collect();
            (name.clone(), refs)
        })
        .collect()
}

/// A path of imports from `from` back to itself, if there is one.
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_owned(), vec![from.to_owned()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in graph.get(&node).into_iter().flatten() {
            if next == from {
                let mut cycle = path.clone();
                cycle.push(from.to_owned());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_module_imports_one_that_imports_it() {
    let graph = import_graph();
    assert!(graph.contains_key("proxy") && graph.contains_key("routing"));
    assert!(
        graph["proxy"].contains("routing"),
        "the reader sees proxy -> routing: {:?}",
        graph["proxy"]
    );
    let cycles: Vec<String> = graph
        .keys()
        .filter_map(|m| cycle_through(&graph, m))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_checker_sees_a_cycle_when_there_is_one() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(
        cycle_through(&graph, "a").unwrap(),
        ["a", "b", "c", "a"].map(str::to_owned)
    );
    assert!(cycle_through(&graph, "d").is_none());
}

#[test]
fn no_function_in_src_is_over_100_lines() {
    let mut long = Vec::new();
    for (name, file) in modules() {
        let code = code(&std::fs::read_to_string(&file).unwrap());
        let mut from = 0;
        while let Some(at) = code[from..].find("fn ") {
            let start = from + at;
            from = start + 3;
            let word_start = start == 0 || !code.as_bytes()[start - 1].is_ascii_alphanumeric();
            let Some(open) = code[start..].find(['{', ';']) else {
                continue;
            };
            if !word_start || code.as_bytes()[start + open] == b';' {
                continue;
            }
            let Some(len) = matching_brace(&code[start + open..]) else {
                continue;
            };
            let body = &code[start..start + open + len];
            let lines = body.lines().count();
            if lines > MAX_FUNCTION_LINES {
                let fn_name = path_after(&code[start + 3..]);
                long.push(format!("{name}::{fn_name}: {lines} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines:\n{}",
        long.join("\n")
    );
}

/// An attempt's verdict is booked in one place (`proxy::attempt::book`: the
/// attempts series, the target's health, its report), so no caller can book
/// it differently (issue 21 item 12): nothing else in `src/` increments the
/// attempts series or records a target's success or failure.
#[test]
fn a_verdict_is_booked_only_by_attempt_book() {
    let booking = [
        "attempts.increment(",
        ".record_success(",
        ".record_failure(",
    ];
    let mut elsewhere = Vec::new();
    for (name, file) in modules() {
        let code = code(&std::fs::read_to_string(&file).unwrap());
        let allowed = match name.as_str() {
            // `book` itself; the health module and the shared state's merge
            // apply verdicts (their own and other replicas'), not book them.
            "proxy::attempt" => code
                .find("pub fn book(")
                .map(|at| at..at + matching_brace(&code[at..]).unwrap_or(0)),
            "health" | "health::merge" | "shared::replica" | "metrics" => Some(0..code.len()),
            _ => None,
        };
        for pattern in booking {
            for (at, _) in code.match_indices(pattern) {
                if !allowed.as_ref().is_some_and(|r| r.contains(&at)) {
                    let line = code[..at].lines().count();
                    elsewhere.push(format!("{name}:{line}: {pattern}"));
                }
            }
        }
    }
    assert!(
        elsewhere.is_empty(),
        "verdicts booked outside attempt::book:\n{}",
        elsewhere.join("\n")
    );
}
