//! A fast fake OpenAI Chat Completions upstream with fault injection, for
//! benchmarks and chaos runs.
//!
//! ```text
//! cargo run --release --example fake_upstream -- --listen 127.0.0.1:9001
//! cargo run --release --example fake_upstream -- --listen 127.0.0.1:9002 \
//!     --chunks 16 --chunk-delay 5ms --fault-rate 0.2 --seed 7
//! curl -s 127.0.0.1:9001/v1/chat/completions -H 'x-fake-fault: status=503,retry-after=2' \
//!     -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'
//! ```
//!
//! `POST /v1/chat/completions` (or `/chat/completions`) answers a completion,
//! or a `text/event-stream` when the body has `"stream": true`: a role chunk,
//! `--chunks` content chunks `--chunk-delay` apart, a `finish_reason` chunk
//! and `data: [DONE]`. Content chunk *i* carries the text `[seq i] ` (the
//! non-streaming answer is the same text in one piece), so a client can prove
//! that no text was repeated, dropped or reordered. Bodies are rendered once
//! at start, by the renderers of the tests' and the demo's fake
//! (`examples/support/fake.rs`), so there is one definition of a fake
//! completion and chunk; a request costs one body read and a byte scan for
//! `"stream"`.
//! `GET /healthz`, `GET /v1/models` and `GET /stats` (requests and faults by
//! kind, JSON) answer too. It speaks HTTP/1.1 and HTTP/2 with prior
//! knowledge (h2c) on the same port.
//!
//! **Faults.** A fault spec is a comma-separated list of:
//!
//! | item | effect |
//! |---|---|
//! | `ok` | no fault |
//! | `status=N` | answer N with an OpenAI-format error body |
//! | `retry-after=S` | add `Retry-After: S` (alone: implies `status=429`) |
//! | `reset` | close the connection before any response |
//! | `reset-after-headers` | send 200 headers, then close the connection |
//! | `hang` | never answer (until the client goes away) |
//! | `slow-first=D` | streams: role chunk at once, first content after D; otherwise answer after D |
//! | `cut-after=N` | streams: close the connection after N content chunks; otherwise after half the body |
//! | `error-200` | 200 whose body (or first SSE event) is `{"error": {..., "code": 503}}` |
//! | `delay=D` | wait D before answering |
//! | `chunks=N`, `chunk-delay=D` | this request's stream shape (not a fault) |
//!
//! Durations are humantime (`500ms`, `2s`). Which spec applies to a request,
//! first match wins: the request header `x-fake-fault: SPEC`; `--fault SPEC`
//! (every request); `--schedule 'SPEC*N;SPEC*N;...'` (a cycle over the
//! request count, e.g. `ok*90;status=503*10`); `--fault-rate R` (each request
//! faults with probability R, drawing uniformly from `--fault-mix
//! 'SPEC;SPEC;...'`, deterministic per request number for a given `--seed`).
//!
//! The same file is compiled into the chaos suite (`examples/chaos/`,
//! `tests/chaos.rs`), which starts [`Upstream`]s in-process, kills and
//! restarts them, and reads the per-request fault journal.
// A demo and bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

/// The scriptable fake of the tests and the demo, for its body renderers.
#[path = "support/fake.rs"]
pub mod fake;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use clap::Parser;
use http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;
use tokio::sync::watch;
use tokio::time::Sleep;

/// The random fault mix used with `--fault-rate` unless `--fault-mix` is given.
pub const DEFAULT_MIX: &str = "status=500;status=502;status=503;status=529;status=429,retry-after=1;\
status=401;status=404;reset;reset-after-headers;hang;slow-first=2s;cut-after=0;cut-after=3;error-200";

/// Command line of the `fake_upstream` binary.
#[derive(Parser, Debug, Clone)]
#[command(about = "A fast fake OpenAI chat upstream with fault injection")]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9001")]
    pub listen: SocketAddr,
    /// `model` reported in answers.
    #[arg(long, default_value = "fake-model")]
    pub model: String,
    /// Content chunks per stream.
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// Pause between two content chunks of a stream.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub chunk_delay: Duration,
    /// Pause before every answer (time to response headers).
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub latency: Duration,
    /// A fault spec applied to every request.
    #[arg(long)]
    pub fault: Option<String>,
    /// Probability that a request gets a fault from `--fault-mix`.
    #[arg(long, default_value_t = 0.0)]
    pub fault_rate: f64,
    /// `;`-separated fault specs drawn uniformly with `--fault-rate`.
    #[arg(long, default_value = DEFAULT_MIX)]
    pub fault_mix: String,
    /// A cycle of `SPEC*COUNT` steps separated by `;`, by request number.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Seed of the fault draw.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Runtime worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// What to do to one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fault {
    /// Answer this status with an error body.
    pub status: Option<u16>,
    /// `Retry-After` header value.
    pub retry_after: Option<String>,
    /// Close before headers.
    pub reset: bool,
    /// Close after headers.
    pub reset_after_headers: bool,
    /// Never answer.
    pub hang: bool,
    /// Delay of the first content chunk.
    pub slow_first: Option<Duration>,
    /// Close a stream after this many content chunks.
    pub cut_after: Option<usize>,
    /// In-band error with a 200.
    pub error_200: bool,
    /// Delay before answering.
    pub delay: Option<Duration>,
    /// Stream shape override.
    pub chunks: Option<usize>,
    /// Stream shape override.
    pub chunk_delay: Option<Duration>,
}

/// Fault kinds, for counters and the journal (index into [`KINDS`]).
pub const KINDS: [&str; 9] = [
    "ok",
    "status",
    "reset",
    "reset-after-headers",
    "hang",
    "slow-first",
    "cut-after",
    "error-200",
    "delay",
];

impl Fault {
    /// Parses `item,item,...` (see the module docs).
    ///
    /// # Errors
    /// An unknown item or a bad value.
    pub fn parse(spec: &str) -> Result<Fault, String> {
        let mut f = Fault::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (item, None),
            };
            let need = || value.ok_or_else(|| format!("`{key}` needs a value"));
            let dur = || humantime::parse_duration(need()?).map_err(|e| format!("`{key}`: {e}"));
            let num = || {
                need()?
                    .parse::<usize>()
                    .map_err(|e| format!("`{key}`: {e}"))
            };
            match key {
                "ok" => {}
                "status" => {
                    let s = num()?;
                    if !(100..=999).contains(&s) {
                        return Err(format!("status {s} out of range"));
                    }
                    f.status = Some(u16::try_from(s).map_err(|e| e.to_string())?);
                }
                "retry-after" => f.retry_after = Some(need()?.to_owned()),
                "reset" => f.reset = true,
                "reset-after-headers" => f.reset_after_headers = true,
                "hang" => f.hang = true,
                "slow-first" => f.slow_first = Some(dur()?),
                "cut-after" => f.cut_after = Some(num()?),
                "error-200" => f.error_200 = true,
                "delay" => f.delay = Some(dur()?),
                "chunks" => f.chunks = Some(num()?),
                "chunk-delay" => f.chunk_delay = Some(dur()?),
                other => return Err(format!("unknown fault `{other}`")),
            }
        }
        if f.retry_after.is_some() && f.status.is_none() {
            f.status = Some(429);
        }
        Ok(f)
    }

    /// The kind counted for this fault (index into [`KINDS`]).
    #[must_use]
    pub fn kind(&self) -> usize {
        if self.reset {
            2
        } else if self.hang {
            4
        } else if self.status.is_some_and(|s| !(200..300).contains(&s)) {
            1
        } else if self.error_200 {
            7
        } else if self.reset_after_headers {
            3
        } else if self.cut_after.is_some() {
            6
        } else if self.slow_first.is_some() {
            5
        } else if self.delay.is_some() {
            8
        } else {
            0
        }
    }
}

/// Parses `SPEC;SPEC;...`.
///
/// # Errors
/// The first bad spec.
pub fn parse_mix(mix: &str) -> Result<Vec<Fault>, String> {
    mix.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(Fault::parse)
        .collect()
}

/// Parses `SPEC*N;SPEC*N;...` (`*N` defaults to 1).
///
/// # Errors
/// A bad spec or count.
pub fn parse_schedule(s: &str) -> Result<Vec<(Fault, u64)>, String> {
    s.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|step| {
            let (spec, n) = match step.rsplit_once('*') {
                Some((spec, n)) => (
                    spec,
                    n.trim()
                        .parse::<u64>()
                        .map_err(|e| format!("`{step}`: {e}"))?,
                ),
                None => (step, 1),
            };
            Ok((Fault::parse(spec)?, n.max(1)))
        })
        .collect()
}

/// How an [`Upstream`] behaves.
#[derive(Clone, Debug)]
pub struct Behaviour {
    /// `model` in answers.
    pub model: String,
    /// Content chunks per stream.
    pub chunks: usize,
    /// Pause between content chunks.
    pub chunk_delay: Duration,
    /// Pause before every answer.
    pub latency: Duration,
    /// Applied to every request.
    pub fault: Option<Fault>,
    /// Cycle by request number.
    pub schedule: Vec<(Fault, u64)>,
    /// Probability of a random fault.
    pub fault_rate: f64,
    /// Random faults to draw from.
    pub mix: Vec<Fault>,
    /// Seed of the draw.
    pub seed: u64,
    /// Record the fault applied to each request with an `x-request-id`
    /// (for the chaos suite; the caller takes entries out with
    /// [`Upstream::journal_take`]).
    pub journal: bool,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            model: "fake-model".into(),
            chunks: 8,
            chunk_delay: Duration::ZERO,
            latency: Duration::ZERO,
            fault: None,
            schedule: Vec::new(),
            fault_rate: 0.0,
            mix: parse_mix(DEFAULT_MIX).expect("default mix parses"),
            seed: 1,
            journal: false,
        }
    }
}

impl Behaviour {
    /// From the command line.
    ///
    /// # Errors
    /// A bad fault spec.
    pub fn from_args(a: &Args) -> Result<Self, String> {
        Ok(Behaviour {
            model: a.model.clone(),
            chunks: a.chunks,
            chunk_delay: a.chunk_delay,
            latency: a.latency,
            fault: a.fault.as_deref().map(Fault::parse).transpose()?,
            schedule: a
                .schedule
                .as_deref()
                .map(parse_schedule)
                .transpose()?
                .unwrap_or_default(),
            fault_rate: a.fault_rate,
            mix: parse_mix(&a.fault_mix)?,
            seed: a.seed,
            journal: false,
        })
    }
}

/// One attempt as the fake saw it (journal entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    /// Index into [`KINDS`].
    pub kind: usize,
    /// The injected status, if any.
    pub status: Option<u16>,
}

/// Requests and faults so far.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Chat requests received.
    pub requests: u64,
    /// Per [`KINDS`] entry.
    pub by_kind: [u64; KINDS.len()],
}

/// Bodies rendered once.
struct Rendered {
    completion: Bytes,
    /// role chunk, content chunks, finish chunk, `[DONE]`.
    frames: Arc<Vec<Bytes>>,
}

/// The completion and the stream of `chunks` content chunks, content chunk
/// *i* saying `[seq i] `, rendered by the shared fake (`support/fake.rs`).
fn render(model: &str, chunks: usize) -> Rendered {
    let texts: Vec<String> = (0..chunks).map(|i| format!("[seq {i}] ")).collect();
    let words: Vec<&str> = texts.iter().map(String::as_str).collect();
    let completion = fake::completion_json(model, &texts.concat(), chunks);
    let frames = fake::sse_events(model, &words)
        .into_iter()
        .map(Bytes::from)
        .collect();
    Rendered {
        completion: Bytes::from(completion),
        frames: Arc::new(frames),
    }
}

struct Shared {
    b: Behaviour,
    rendered: Rendered,
    schedule_len: u64,
    requests: AtomicU64,
    by_kind: [AtomicU64; KINDS.len()],
    journal: Mutex<HashMap<String, Vec<Served>>>,
}

/// A running fake upstream. [`Upstream::kill`] (or dropping it) stops it and
/// closes every connection at once, as a crashed process would.
pub struct Upstream {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    /// Bumped to close every open connection (the listener stays).
    generation: watch::Sender<u64>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.generation.send_modify(|g| *g += 1);
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Upstream {
    /// Binds `addr` (port 0 for any; `SO_REUSEADDR`, so a killed upstream can
    /// be restarted on its port) and serves in the current runtime.
    ///
    /// # Errors
    /// If the address cannot be bound.
    pub async fn start(addr: SocketAddr, b: Behaviour) -> std::io::Result<Upstream> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let listener = socket.listen(4096)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            rendered: render(&b.model, b.chunks),
            schedule_len: b.schedule.iter().map(|(_, n)| n).sum(),
            b,
            requests: AtomicU64::new(0),
            by_kind: Default::default(),
            journal: Mutex::new(HashMap::new()),
        });
        let (stop, mut stopped) = watch::channel(false);
        let (generation, generations) = watch::channel(0u64);
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = stopped.wait_for(|v| *v) => break,
                };
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let s = Arc::clone(&s);
                let mut generations = generations.clone();
                let born = *generations.borrow_and_update();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| serve(Arc::clone(&s), req));
                    // HTTP/1.1, or HTTP/2 with prior knowledge (h2c).
                    let serving = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    );
                    let conn = serving.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = generations.wait_for(|g| *g != born) => {}
                    }
                });
            }
        });
        Ok(Upstream {
            addr,
            shared,
            stop,
            generation,
            task: Some(task),
        })
    }

    /// Stops listening and drops every open connection; returns once the
    /// port is free.
    pub async fn kill(mut self) {
        let _ = self.stop.send(true);
        self.generation.send_modify(|g| *g += 1);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    /// Closes every open connection at once; keeps listening.
    pub fn drop_connections(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// `http://ADDR/v1`, the `base_url` for routes.yaml.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Requests and faults so far.
    #[must_use]
    pub fn stats(&self) -> Stats {
        let mut by_kind = [0; KINDS.len()];
        for (o, c) in by_kind.iter_mut().zip(&self.shared.by_kind) {
            *o = c.load(Ordering::Relaxed);
        }
        Stats {
            requests: self.shared.requests.load(Ordering::Relaxed),
            by_kind,
        }
    }

    /// Removes and returns what this upstream did to requests with this
    /// `x-request-id` (with [`Behaviour::journal`]).
    #[must_use]
    pub fn journal_take(&self, request_id: &str) -> Vec<Served> {
        self.shared
            .journal
            .lock()
            .remove(request_id)
            .unwrap_or_default()
    }

    /// Entries not yet taken.
    #[must_use]
    pub fn journal_len(&self) -> usize {
        self.shared.journal.lock().len()
    }
}

/// SplitMix64: a fast, well-mixed hash of the request number and seed.
#[must_use]
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number in [0, 1) from a hash.
#[must_use]
pub fn unit(h: u64) -> f64 {
    // 53 random bits: exact in an f64.
    #[allow(clippy::cast_precision_loss)]
    let x = (h >> 11) as f64;
    x / (1u64 << 53) as f64
}

impl Shared {
    fn pick(&self, n: u64) -> Option<Fault> {
        if let Some(f) = &self.b.fault {
            return Some(f.clone());
        }
        if self.schedule_len > 0 {
            let mut i = n % self.schedule_len;
            for (f, count) in &self.b.schedule {
                if i < *count {
                    return Some(f.clone());
                }
                i -= count;
            }
        }
        if self.b.fault_rate > 0.0 && !self.b.mix.is_empty() {
            let h = splitmix(self.b.seed ^ splitmix(n));
            if unit(h) < self.b.fault_rate {
                let pick = splitmix(h) % self.b.mix.len() as u64;
                return Some(self.b.mix[usize::try_from(pick).unwrap_or(0)].clone());
            }
        }
        None
    }
}

/// The connection is closed on purpose (a reset).
#[derive(Debug)]
pub struct Abort;

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected connection reset")
    }
}

impl std::error::Error for Abort {}

/// `"stream"` followed by `:` and `true` (whitespace allowed): cheaper than
/// parsing the JSON, and good enough for a fake.
fn wants_stream(body: &[u8]) -> bool {
    let key = b"\"stream\"";
    let mut rest = body;
    while let Some(i) = rest.windows(key.len()).position(|w| w == key) {
        let after = &rest[i + key.len()..];
        let mut j = 0;
        while j < after.len() && after[j].is_ascii_whitespace() {
            j += 1;
        }
        if after.get(j) == Some(&b':') {
            j += 1;
            while j < after.len() && after[j].is_ascii_whitespace() {
                j += 1;
            }
            return after[j..].starts_with(b"true");
        }
        rest = after;
    }
    false
}

fn json_response(status: StatusCode, body: Bytes) -> Response<FakeBody> {
    let mut resp = Response::new(FakeBody::Full(Some(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn error_json(status: u16, message: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"error": {"message": message, "type": "fake_error", "code": status, "param": null}})
            .to_string(),
    )
}

async fn serve(s: Arc<Shared>, req: Request<Incoming>) -> Result<Response<FakeBody>, Abort> {
    let path = req.uri().path();
    if req.method() != Method::POST {
        return Ok(get_endpoint(&s, path));
    }
    if !path.ends_with("/chat/completions") {
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            error_json(404, "not found"),
        ));
    }
    chat(&s, req).await
}

/// `GET /healthz`, `/stats`, `/v1/models`; 404 otherwise.
fn get_endpoint(s: &Shared, path: &str) -> Response<FakeBody> {
    match path {
        "/healthz" => json_response(StatusCode::OK, Bytes::from_static(b"{\"status\":\"ok\"}")),
        "/stats" | "/_fake/stats" => {
            let by_kind: serde_json::Map<String, serde_json::Value> = KINDS
                .iter()
                .zip(&s.by_kind)
                .map(|(k, c)| ((*k).to_owned(), c.load(Ordering::Relaxed).into()))
                .collect();
            let v = serde_json::json!({
                "requests": s.requests.load(Ordering::Relaxed), "by_kind": by_kind,
            });
            json_response(StatusCode::OK, Bytes::from(v.to_string()))
        }
        "/v1/models" | "/models" => json_response(
            StatusCode::OK,
            Bytes::from(
                serde_json::json!({"object": "list", "data": [{"id": s.b.model, "object": "model", "created": 1, "owned_by": "fake"}]})
                    .to_string(),
            ),
        ),
        _ => json_response(StatusCode::NOT_FOUND, error_json(404, "not found")),
    }
}

/// A chat request: picks its fault (the `x-fake-fault` header first), counts
/// and journals it, then answers.
async fn chat(s: &Shared, req: Request<Incoming>) -> Result<Response<FakeBody>, Abort> {
    let header_fault = req
        .headers()
        .get("x-fake-fault")
        .map(|v| Fault::parse(v.to_str().unwrap_or("?")));
    let request_id = if s.b.journal {
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    } else {
        None
    };
    let body = match req.into_body().collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => return Err(Abort),
    };
    let stream = wants_stream(&body);
    let n = s.requests.fetch_add(1, Ordering::Relaxed);
    let fault = match header_fault {
        Some(Ok(f)) => Some(f),
        Some(Err(e)) => {
            return Ok(json_response(
                StatusCode::BAD_REQUEST,
                error_json(400, &format!("bad x-fake-fault: {e}")),
            ))
        }
        None => s.pick(n),
    };
    let fault = fault.unwrap_or_default();
    s.record(&fault, request_id);
    answer(s, &fault, stream).await
}

impl Shared {
    /// Counts the fault by kind and journals it under the request id.
    fn record(&self, fault: &Fault, request_id: Option<String>) {
        let kind = fault.kind();
        self.by_kind[kind].fetch_add(1, Ordering::Relaxed);
        if let Some(id) = request_id {
            let injected = fault.status.filter(|s| !(200..300).contains(s));
            self.journal.lock().entry(id).or_default().push(Served {
                kind,
                status: injected,
            });
        }
    }
}

/// The answer to a chat request with this fault (the default: none).
async fn answer(s: &Shared, fault: &Fault, stream: bool) -> Result<Response<FakeBody>, Abort> {
    let wait = s.b.latency + fault.delay.unwrap_or_default();
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    if fault.hang {
        std::future::pending::<()>().await;
    }
    if fault.reset {
        return Err(Abort);
    }
    if let Some(status) = fault.status.filter(|s| !(200..300).contains(s)) {
        return Ok(error_status(status, fault.retry_after.as_deref()));
    }
    if fault.error_200 {
        return Ok(in_band_error(stream));
    }
    if stream {
        Ok(stream_answer(s, fault))
    } else {
        Ok(completion_answer(s, fault).await)
    }
}

/// An injected error status, with `Retry-After` if given.
fn error_status(status: u16, retry_after: Option<&str>) -> Response<FakeBody> {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = json_response(code, error_json(status, "injected fault"));
    if let Some(ra) = retry_after.and_then(|v| HeaderValue::from_str(v).ok()) {
        resp.headers_mut().insert("retry-after", ra);
    }
    resp
}

/// A 200 whose body (or first SSE event) is an error with code 503.
fn in_band_error(stream: bool) -> Response<FakeBody> {
    let err = error_json(503, "injected in-band error");
    if stream {
        let mut b = BytesMut::from(&b"data: "[..]);
        b.extend_from_slice(&err);
        b.extend_from_slice(b"\n\n");
        return sse_response(FakeBody::Full(Some(b.freeze())));
    }
    json_response(StatusCode::OK, err)
}

/// The non-streaming answer: the whole completion, or (`reset-after-headers`,
/// `cut-after`) its content-length promised and the body cut short.
async fn completion_answer(s: &Shared, fault: &Fault) -> Response<FakeBody> {
    if let Some(d) = fault.slow_first {
        tokio::time::sleep(d).await;
    }
    let full = s.rendered.completion.clone();
    let cut = if fault.reset_after_headers {
        Some(0)
    } else {
        fault.cut_after.map(|_| full.len() / 2)
    };
    let Some(keep) = cut else {
        return json_response(StatusCode::OK, full);
    };
    let mut resp = json_response(StatusCode::OK, Bytes::new());
    resp.headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(full.len()));
    *resp.body_mut() = FakeBody::Stream(StreamBody {
        frames: Arc::new(vec![full.slice(..keep)]),
        next: 0,
        end: usize::from(keep > 0),
        slow_first: None,
        chunk_delay: Duration::ZERO,
        sleep: None,
        waited: false,
        abort: true,
    });
    resp
}

/// The streaming answer: the rendered frames (re-rendered for a `chunks`
/// override), paced, and cut short by `reset-after-headers` or `cut-after`.
fn stream_answer(s: &Shared, fault: &Fault) -> Response<FakeBody> {
    let chunks = fault.chunks.unwrap_or(s.b.chunks);
    let frames = if chunks == s.b.chunks {
        Arc::clone(&s.rendered.frames)
    } else {
        render(&s.b.model, chunks).frames
    };
    let end = if fault.reset_after_headers {
        0
    } else if let Some(k) = fault.cut_after {
        // role chunk + k content chunks
        (1 + k).min(frames.len())
    } else {
        frames.len()
    };
    sse_response(FakeBody::Stream(StreamBody {
        frames,
        next: 0,
        end,
        slow_first: fault.slow_first,
        chunk_delay: fault.chunk_delay.unwrap_or(s.b.chunk_delay),
        sleep: None,
        waited: false,
        abort: fault.reset_after_headers || fault.cut_after.is_some(),
    }))
}

fn sse_response(body: FakeBody) -> Response<FakeBody> {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    resp.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    resp
}

/// A response body: known bytes, or pre-rendered frames with pauses and an
/// optional abort at the end.
pub enum FakeBody {
    /// Taken once.
    Full(Option<Bytes>),
    /// Frames `next..end` of `frames`.
    Stream(StreamBody),
}

/// See [`FakeBody::Stream`].
pub struct StreamBody {
    frames: Arc<Vec<Bytes>>,
    next: usize,
    end: usize,
    slow_first: Option<Duration>,
    chunk_delay: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    waited: bool,
    abort: bool,
}

/// Pause before an abort, so that what was sent is flushed first (a reset
/// after N chunks must arrive after the N chunks).
const FLUSH_PAUSE: Duration = Duration::from_millis(2);

impl StreamBody {
    /// Pause before frame `i`: frame 1 is the first content chunk; content
    /// chunks 2.. come `chunk_delay` apart.
    fn pause_before(&self, i: usize) -> Duration {
        let last_content = self.frames.len().saturating_sub(3);
        match i {
            0 => Duration::ZERO,
            1 => self.slow_first.unwrap_or_default(),
            i if i <= last_content => self.chunk_delay,
            _ => Duration::ZERO,
        }
    }
}

impl hyper::body::Body for FakeBody {
    type Data = Bytes;
    type Error = Abort;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Abort>>> {
        let s = match &mut *self {
            FakeBody::Full(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            FakeBody::Stream(s) => s,
        };
        loop {
            if let Some(sleep) = s.sleep.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                s.sleep = None;
                s.waited = true;
            }
            if s.next >= s.end {
                if s.abort {
                    if !s.waited {
                        s.sleep = Some(Box::pin(tokio::time::sleep(FLUSH_PAUSE)));
                        continue;
                    }
                    return Poll::Ready(Some(Err(Abort)));
                }
                return Poll::Ready(None);
            }
            let pause = s.pause_before(s.next);
            if !pause.is_zero() && !s.waited {
                s.sleep = Some(Box::pin(tokio::time::sleep(pause)));
                continue;
            }
            s.waited = false;
            let frame = s.frames[s.next].clone();
            s.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(frame))));
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            FakeBody::Full(b) => b.is_none(),
            FakeBody::Stream(_) => false,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            FakeBody::Full(Some(b)) => hyper::body::SizeHint::with_exact(b.len() as u64),
            FakeBody::Full(None) => hyper::body::SizeHint::with_exact(0),
            FakeBody::Stream(_) => hyper::body::SizeHint::default(),
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let behaviour = match Behaviour::from_args(&args) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("fake_upstream: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fake_upstream: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let up = match Upstream::start(args.listen, behaviour).await {
            Ok(u) => u,
            Err(e) => {
                eprintln!("fake_upstream: cannot listen on {}: {e}", args.listen);
                return std::process::ExitCode::FAILURE;
            }
        };
        eprintln!(
            "fake_upstream: listening on {} (chunks {}, chunk delay {:?}, fault rate {})",
            up.url(),
            args.chunks,
            args.chunk_delay,
            args.fault_rate
        );
        shutdown_signal().await;
        let stats = up.stats();
        eprintln!("fake_upstream: {} requests", stats.requests);
        up.kill().await;
        std::process::ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        let f = Fault::parse("status=503,retry-after=2").unwrap();
        assert_eq!(f.status, Some(503));
        assert_eq!(f.retry_after.as_deref(), Some("2"));
        assert_eq!(
            Fault::parse("retry-after=1").unwrap().status,
            Some(429),
            "retry-after alone implies 429"
        );
        assert!(Fault::parse("explode").is_err());
        assert_eq!(parse_mix(DEFAULT_MIX).unwrap().len(), 14);
        let s = parse_schedule("ok*3;status=503*2").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].1, 3);
    }

    #[test]
    fn bodies_carry_sequence_markers() {
        let r = render("fake-model", 3);
        let v: serde_json::Value = serde_json::from_slice(&r.completion).unwrap();
        assert_eq!(v["model"], "fake-model");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            "[seq 0] [seq 1] [seq 2] "
        );
        assert_eq!(v["usage"]["completion_tokens"], 3);
        assert_eq!(r.frames.len(), 6, "role, 3 content chunks, finish, [DONE]");
        for i in 0..3 {
            let event = std::str::from_utf8(&r.frames[1 + i]).unwrap();
            let data = event.strip_prefix("data: ").unwrap().trim_end();
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            assert_eq!(v["choices"][0]["delta"]["content"], format!("[seq {i}] "));
        }
        assert_eq!(&r.frames[5][..], b"data: [DONE]\n\n");
    }

    #[test]
    fn stream_flag_is_found() {
        assert!(wants_stream(br#"{"stream":true}"#));
        assert!(wants_stream(br#"{"a":"stream", "stream" : true}"#));
        assert!(!wants_stream(br#"{"stream":false}"#));
        assert!(!wants_stream(br#"{"model":"m"}"#));
    }
}
