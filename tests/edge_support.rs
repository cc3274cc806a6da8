//! Helpers for the error-class, budget and stream-edge tests: a routes.yaml
//! builder with per-target provider settings, admin-endpoint lookups, bounded
//! waits, SSE event builders, and a raw-TCP fake upstream whose writes (and
//! response headers) are exactly what the test scripts.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::fake::Reply;
use crate::support::{get, Gw};

/// One hop of a chain: a target on its own provider `p-{name}`.
pub struct Hop {
    name: String,
    url: String,
    provider: String,
    target: String,
}

/// A hop named `name` whose provider points at `url`.
pub fn hop(name: &str, url: &str) -> Hop {
    Hop {
        name: name.to_owned(),
        url: url.to_owned(),
        provider: String::new(),
        target: String::new(),
    }
}

impl Hop {
    /// Adds YAML under the provider (written unindented; indented here).
    /// A `timeout`, `connect_timeout` or `retry` key given here replaces the default.
    pub fn provider(mut self, yaml: &str) -> Self {
        for line in yaml.lines() {
            self.provider.push_str("    ");
            self.provider.push_str(line);
            self.provider.push('\n');
        }
        self
    }

    /// Adds inline fields to the target, e.g. `max_context: 8000`.
    pub fn target(mut self, fields: &str) -> Self {
        self.target.push_str(", ");
        self.target.push_str(fields);
        self
    }
}

/// A routes.yaml with one task `chat` (alias `gpt-4o`) over `hops` in order.
/// `task` is YAML under the task (unindented), `top` is appended at top level.
pub fn routes(hops: &[Hop], task: &str, top: &str) -> String {
    let defaults = [
        ("timeout", "2s"),
        ("connect_timeout", "500ms"),
        ("retry", "{ max: 1, backoff: 10ms }"),
    ];
    let mut y = String::from("version: 1\nproviders:\n");
    for h in hops {
        y.push_str(&format!("  p-{}:\n    base_url: {}\n", h.name, h.url));
        for (key, value) in defaults {
            let given = h.provider.lines().any(|l| {
                l.strip_prefix("    ")
                    .is_some_and(|r| r.starts_with(&format!("{key}:")))
            });
            if !given {
                y.push_str(&format!("    {key}: {value}\n"));
            }
        }
        y.push_str(&h.provider);
    }
    y.push_str("targets:\n");
    for h in hops {
        y.push_str(&format!(
            "  {0}: {{ provider: p-{0}, model: upstream-{0}{1} }}\n",
            h.name, h.target
        ));
    }
    let names: Vec<&str> = hops.iter().map(|h| h.name.as_str()).collect();
    y.push_str(&format!(
        "tasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [{}]\n",
        names.join(", ")
    ));
    for line in task.lines() {
        y.push_str("    ");
        y.push_str(line);
        y.push('\n');
    }
    y.push_str(top);
    y
}

/// The `/admin/targets` entry of one target.
pub async fn admin_target(gw: &Gw, name: &str) -> serde_json::Value {
    let ans = get(gw.addr, "/admin/targets").await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    ans.json()["targets"]
        .as_array()
        .expect("targets list")
        .iter()
        .find(|t| t["target"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no target {name} in {}", ans.text()))
}

/// Polls `cond` every 10 ms until it holds or `within` passes; returns whether it held.
pub async fn wait_for(mut cond: impl FnMut() -> bool, within: Duration) -> bool {
    let rounds = within.as_millis() / 10 + 1;
    for _ in 0..rounds {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

// ----- SSE building -----

/// A `chat.completion.chunk` JSON with one choice.
pub fn chunk_json(model: &str, delta: serde_json::Value, finish: Option<&str>) -> String {
    serde_json::json!({
        "id": "chatcmpl-edge", "object": "chat.completion.chunk", "created": 1, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
    })
    .to_string()
}

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

// ----- a raw TCP fake upstream -----

/// A fake upstream that answers every request with the same scripted bytes:
/// each step waits its delay, then is written with one `write_all` (TCP_NODELAY).
/// Responses are close-delimited, so what the test writes is exactly what the
/// gateway reads, split where the test split it.
pub struct RawFake {
    pub addr: SocketAddr,
    calls: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawFake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The head of a close-delimited 200 SSE response with extra header lines.
pub fn sse_head(extra_headers: &[(&str, &str)]) -> String {
    let mut head = String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n");
    for (k, v) in extra_headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("connection: close\r\n\r\n");
    head
}

impl RawFake {
    /// Starts a fake that writes `steps` (delay, bytes) for every request, then closes.
    pub async fn start(steps: Vec<(Duration, Vec<u8>)>) -> RawFake {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind raw fake");
        let addr = listener.local_addr().expect("addr");
        let calls = Arc::new(AtomicUsize::new(0));
        let c = Arc::clone(&calls);
        let steps = Arc::new(steps);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let c = Arc::clone(&c);
                let steps = Arc::clone(&steps);
                tokio::spawn(async move {
                    let _ = serve_raw(stream, &c, &steps).await;
                });
            }
        });
        RawFake { addr, calls, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

async fn serve_raw(
    mut stream: TcpStream,
    calls: &AtomicUsize,
    steps: &[(Duration, Vec<u8>)],
) -> std::io::Result<()> {
    // Read the request head and its content-length body (bounded: 1 MiB).
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 1 << 20 {
            return Ok(());
        }
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
        .min(1 << 20);
    while buf.len() < head_end + length {
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    calls.fetch_add(1, Ordering::SeqCst);
    for (delay, bytes) in steps {
        if !delay.is_zero() {
            tokio::time::sleep(*delay).await;
        }
        stream.write_all(bytes).await?;
        stream.flush().await?;
    }
    stream.shutdown().await
}
