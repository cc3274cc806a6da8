//! SSE for stream tests: event builders with any line ending, a fake reply of
//! exact pieces, and strict readers of what the gateway relayed.

use std::time::Duration;

use super::fake::{chunk_json, Reply};

/// A complete event `data: {json}` with line ending `eol`.
pub fn event(json: &str, eol: &str) -> String {
    format!("data: {json}{eol}{eol}")
}

/// The role-only first chunk.
pub fn role(model: &str, eol: &str) -> String {
    event(
        &chunk_json(model, serde_json::json!({"role": "assistant"}), None),
        eol,
    )
}

/// A content chunk.
pub fn content(model: &str, text: &str, eol: &str) -> String {
    event(
        &chunk_json(model, serde_json::json!({"content": text}), None),
        eol,
    )
}

/// The finish chunk (empty delta, `finish_reason: stop`).
pub fn finish(model: &str, eol: &str) -> String {
    event(&chunk_json(model, serde_json::json!({}), Some("stop")), eol)
}

/// `data: [DONE]`.
pub fn done(eol: &str) -> String {
    format!("data: [DONE]{eol}{eol}")
}

/// A fake stream reply of exactly these pieces, `delay` before each.
pub fn pieces(pieces: Vec<String>, delay: Duration) -> Reply {
    Reply::Stream {
        pieces,
        delay,
        cut: false,
    }
}

/// Splits `s` at the given byte offsets (sorted, deduplicated, in range).
pub fn cut_at(s: &str, points: &[usize]) -> Vec<String> {
    let mut points: Vec<usize> = points
        .iter()
        .copied()
        .filter(|p| *p > 0 && *p < s.len())
        .collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for p in points {
        out.push(s[last..p].to_owned());
        last = p;
    }
    out.push(s[last..].to_owned());
    out
}

/// The text content of an SSE answer: the concatenated `delta.content`s.
pub fn stream_text(body: &str) -> String {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// The data of each event of an SSE body, parsed with a strict reading of
/// the WHATWG rules (`\n`, `\r\n`, `\r`; multi-line data joined by `\n`);
/// comment-only events are left out.
pub fn sse_data(body: &str) -> Vec<String> {
    let normalized = body.replace("\r\n", "\n").replace('\r', "\n");
    let mut out = Vec::new();
    let mut data: Option<String> = None;
    for line in normalized.split('\n') {
        if line.is_empty() {
            if let Some(d) = data.take() {
                out.push(d);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("data") {
            let value = rest
                .strip_prefix(':')
                .map_or("", |v| v.strip_prefix(' ').unwrap_or(v));
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_owned()),
            }
        }
    }
    if let Some(d) = data {
        out.push(d);
    }
    out
}

/// The concatenated `delta.content` of an SSE body (any line endings).
pub fn sse_text(body: &str) -> String {
    sse_data(body)
        .iter()
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}
