//! The access-log line: one per request, never any prompt or completion text.
//!
//! Written straight into the log buffer ([`super::stderr`]) in the log
//! formatter's own layout (text or JSON), not through a `tracing` event: an
//! event's field visitors and escaping writer cost more than the rest of a
//! plain request's own work (BENCHMARKS.md, "The access line"). On a
//! terminal (coloured lines) or before the log is set up, the line goes
//! through `tracing` as before; either way `RUST_LOG` decides whether it is
//! written at all. The unit tests hold the direct layout to `tracing`'s.

use std::io::Write as _;
use std::sync::OnceLock;

use super::stderr::Batched;
use super::ACCESS_TARGET;

/// How log lines are laid out (the `--log-format` of `serve`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `tracing`'s full text format, without colours.
    Text,
    /// `tracing`'s JSON format: `timestamp`, `level`, `fields`, `target`.
    Json,
}

/// Where access lines are written directly, once the log is set up.
struct Sink {
    writer: Batched,
    layout: Layout,
}

static SINK: OnceLock<Sink> = OnceLock::new();

/// Access lines from now on go straight into `writer`, laid out as
/// `layout` (first call wins).
pub fn write_directly(writer: Batched, layout: Layout) {
    let _ = SINK.set(Sink { writer, layout });
}

/// What one request came to, as its access line shows it.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    pub request_id: &'a str,
    pub task: &'a str,
    pub target: &'a str,
    pub provider: Option<&'a str>,
    pub status: u16,
    pub attempts: u32,
    pub failovers: u32,
    pub degraded: bool,
    pub stream: bool,
    pub protocol: Option<&'a str>,
    pub cache: Option<&'a str>,
    pub duration_ms: f64,
    pub ttft_ms: Option<f64>,
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub cost_usd: Option<f64>,
    pub model: Option<&'a str>,
    pub upstream_request_id: Option<&'a str>,
    pub stream_end: Option<&'a str>,
    pub skipped: Option<&'a str>,
    pub error: Option<&'a str>,
    pub trace_id: Option<&'a str>,
}

/// One field's value.
#[derive(Debug, Clone, Copy)]
enum Value<'a> {
    Str(&'a str),
    Int(u64),
    Float(f64),
    Bool(bool),
}

impl Record<'_> {
    /// The fields in the line's order (absent ones are left out), the
    /// order of [`event`]'s.
    fn fields(&self) -> [(&'static str, Option<Value<'_>>); 22] {
        use Value::{Bool, Float, Int, Str};
        [
            ("request_id", Some(Str(self.request_id))),
            ("task", Some(Str(self.task))),
            ("target", Some(Str(self.target))),
            ("provider", self.provider.map(Str)),
            ("status", Some(Int(u64::from(self.status)))),
            ("attempts", Some(Int(u64::from(self.attempts)))),
            ("failovers", Some(Int(u64::from(self.failovers)))),
            ("degraded", Some(Bool(self.degraded))),
            ("stream", Some(Bool(self.stream))),
            ("protocol", self.protocol.map(Str)),
            ("cache", self.cache.map(Str)),
            ("duration_ms", Some(Float(self.duration_ms))),
            ("ttft_ms", self.ttft_ms.map(Float)),
            ("tokens_in", self.tokens_in.map(Int)),
            ("tokens_out", self.tokens_out.map(Int)),
            ("cost_usd", self.cost_usd.map(Float)),
            ("model", self.model.map(Str)),
            ("upstream_request_id", self.upstream_request_id.map(Str)),
            ("stream_end", self.stream_end.map(Str)),
            ("skipped", self.skipped.map(Str)),
            ("error", self.error.map(Str)),
            ("trace_id", self.trace_id.map(Str)),
        ]
    }
}

/// Logs the access line of a finished request.
pub fn write(record: &Record<'_>) {
    if !tracing::enabled!(target: ACCESS_TARGET, tracing::Level::INFO) {
        return;
    }
    let Some(sink) = SINK.get() else {
        event(record);
        return;
    };
    let now = std::time::SystemTime::now();
    sink.writer.append_with(|out| match sink.layout {
        Layout::Text => text(out, now, record),
        Layout::Json => json(out, now, record),
    });
}

/// `now` as `tracing`'s timer writes it (`2026-12-07T04:03:53.496223Z`),
/// the date and time of day laid out once a second on each thread.
fn timestamp(out: &mut Vec<u8>, now: std::time::SystemTime) {
    thread_local! {
        static SECOND: std::cell::Cell<Option<(u64, [u8; 19])>> =
            const { std::cell::Cell::new(None) };
    }
    let since = now
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let prefix = SECOND.with(|second| match second.get() {
        Some((cached, prefix)) if cached == secs => prefix,
        Some(_) | None => {
            let whole = humantime::format_rfc3339_seconds(now).to_string();
            let mut prefix = [b'0'; 19];
            if let Some(date_time) = whole.as_bytes().get(..19) {
                prefix.copy_from_slice(date_time);
            }
            second.set(Some((secs, prefix)));
            prefix
        }
    });
    out.extend_from_slice(&prefix);
    out.push(b'.');
    let mut micros = since.subsec_micros();
    let mut digits = [b'0'; 6];
    for digit in digits.iter_mut().rev() {
        // A decimal digit: `micros % 10` fits a byte.
        *digit = b'0' + u8::try_from(micros % 10).unwrap_or(0);
        micros /= 10;
    }
    out.extend_from_slice(&digits);
    out.push(b'Z');
}

fn int(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// The line as a `tracing` event: the layout [`text`] and [`json`] follow.
fn event(r: &Record<'_>) {
    tracing::info!(target: ACCESS_TARGET, parent: None,
        request_id = r.request_id,
        task = r.task,
        target = r.target,
        provider = r.provider,
        status = r.status,
        attempts = r.attempts,
        failovers = r.failovers,
        degraded = r.degraded,
        stream = r.stream,
        protocol = r.protocol,
        cache = r.cache,
        duration_ms = r.duration_ms,
        ttft_ms = r.ttft_ms,
        tokens_in = r.tokens_in,
        tokens_out = r.tokens_out,
        cost_usd = r.cost_usd,
        model = r.model,
        upstream_request_id = r.upstream_request_id,
        stream_end = r.stream_end,
        skipped = r.skipped,
        error = r.error,
        trace_id = r.trace_id,
        "request");
}

// Writes into a `Vec` cannot fail: their results are dropped below.

/// `2026-12-07T04:03:53.496223Z  INFO switchyard::access: request request_id="…" …`
fn text(out: &mut Vec<u8>, now: std::time::SystemTime, record: &Record<'_>) {
    timestamp(out, now);
    out.extend_from_slice(b"  INFO ");
    out.extend_from_slice(ACCESS_TARGET.as_bytes());
    out.extend_from_slice(b": request");
    for (name, value) in record.fields() {
        let Some(value) = value else { continue };
        out.push(b' ');
        out.extend_from_slice(name.as_bytes());
        out.push(b'=');
        match value {
            Value::Str(s) => debug_str(out, s),
            Value::Int(n) => int(out, n),
            Value::Float(x) => {
                let _ = write!(out, "{x:?}");
            }
            Value::Bool(b) => out.extend_from_slice(if b { b"true" } else { b"false" }),
        }
    }
    out.push(b'\n');
}

/// A string as `{:?}` writes it: quoted, escaped where it must be.
fn debug_str(out: &mut Vec<u8>, s: &str) {
    let plain = s
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\');
    if plain {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

/// `{"timestamp":…,"level":"INFO","fields":{"message":"request",…},"target":"switchyard::access"}`
fn json(out: &mut Vec<u8>, now: std::time::SystemTime, record: &Record<'_>) {
    out.extend_from_slice(br#"{"timestamp":""#);
    timestamp(out, now);
    out.extend_from_slice(br#"","level":"INFO","fields":{"message":"request""#);
    for (name, value) in record.fields() {
        let Some(value) = value else { continue };
        out.extend_from_slice(b",\"");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        let _ = match value {
            Value::Str(s) => serde_json::to_writer(&mut *out, s),
            Value::Int(n) => {
                int(out, n);
                Ok(())
            }
            Value::Float(x) => serde_json::to_writer(&mut *out, &x),
            Value::Bool(b) => serde_json::to_writer(&mut *out, &b),
        };
    }
    let _ = writeln!(out, r#"}},"target":"{ACCESS_TARGET}"}}"#);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use parking_lot::Mutex;

    use super::*;

    fn full() -> Record<'static> {
        Record {
            request_id: "0af7651916cd43dd8448eb211c80319c",
            task: "chat",
            target: "gpt-4o",
            provider: Some("openai"),
            status: 200,
            attempts: 2,
            failovers: 1,
            degraded: true,
            stream: true,
            protocol: Some("messages"),
            cache: Some("miss"),
            duration_ms: 812.345,
            ttft_ms: Some(0.0),
            tokens_in: Some(120),
            tokens_out: Some(u64::MAX),
            cost_usd: Some(1e-7),
            model: Some("gpt-4o-2024-08-06"),
            upstream_request_id: Some("req_123"),
            stream_end: Some("complete"),
            skipped: Some("a:down,b:capability"),
            error: Some("upstream said \"no\"\n\u{1b}[31m é \u{85}"),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
        }
    }

    fn bare() -> Record<'static> {
        Record {
            request_id: "-",
            task: "-",
            target: "-",
            provider: None,
            status: 400,
            attempts: 0,
            failovers: 0,
            degraded: false,
            stream: false,
            protocol: None,
            cache: None,
            duration_ms: 0.0,
            ttft_ms: None,
            tokens_in: None,
            tokens_out: None,
            cost_usd: None,
            model: None,
            upstream_request_id: None,
            stream_end: None,
            skipped: None,
            error: None,
            trace_id: None,
        }
    }

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The line as `tracing`'s own formatter writes [`event`].
    fn through_tracing(record: &Record<'_>, layout: Layout) -> String {
        let captured = Captured::default();
        let writer = {
            let captured = captured.clone();
            move || captured.clone()
        };
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer);
        let dispatch = match layout {
            Layout::Text => tracing::Dispatch::new(builder.finish()),
            Layout::Json => tracing::Dispatch::new(builder.json().finish()),
        };
        tracing::dispatcher::with_default(&dispatch, || event(record));
        let bytes = captured.0.lock().clone();
        String::from_utf8(bytes).unwrap()
    }

    fn direct(record: &Record<'_>, layout: Layout) -> String {
        let mut out = Vec::new();
        let now = std::time::SystemTime::now();
        match layout {
            Layout::Text => text(&mut out, now, record),
            Layout::Json => json(&mut out, now, record),
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_text_line_is_tracings_own_but_for_the_time() {
        for record in [full(), bare()] {
            let (ours, theirs) = (
                direct(&record, Layout::Text),
                through_tracing(&record, Layout::Text),
            );
            // The timestamp: the same width, a different instant.
            assert_eq!(ours.find(' '), theirs.find(' '), "{ours}\n{theirs}");
            let after_time = |s: &str| s.split_once(' ').unwrap().1.to_owned();
            assert_eq!(after_time(&ours), after_time(&theirs));
            assert!(ours.ends_with('\n') && ours.matches('\n').count() == 1);
        }
    }

    #[test]
    fn timestamps_are_laid_out_as_tracings_timer_lays_them_out() {
        let at = |secs: u64, micros: u32| {
            std::time::UNIX_EPOCH + std::time::Duration::new(secs, micros * 1000)
        };
        // The same second twice (the cached date), then the next one.
        for (secs, micros) in [
            (1_796_000_000, 7),
            (1_796_000_000, 999_999),
            (1_796_000_001, 0),
        ] {
            let mut out = Vec::new();
            timestamp(&mut out, at(secs, micros));
            let want = humantime::format_rfc3339_micros(at(secs, micros)).to_string();
            assert_eq!(String::from_utf8(out).unwrap(), want);
        }
    }

    #[test]
    fn the_json_line_is_tracings_own_but_for_the_time() {
        for record in [full(), bare()] {
            let read = |s: &str| {
                let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
                let time = v["timestamp"].take();
                assert!(time.as_str().is_some_and(|t| t.ends_with('Z')), "{s}");
                v
            };
            let ours = direct(&record, Layout::Json);
            assert_eq!(read(&ours), read(&through_tracing(&record, Layout::Json)));
            assert!(ours.ends_with('\n') && ours.matches('\n').count() == 1);
        }
    }
}
