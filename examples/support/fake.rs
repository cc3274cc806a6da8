//! A scriptable fake OpenAI-compatible upstream on 127.0.0.1, for the demo and
//! the integration tests (which include this file with `#[path]`).
//!
//! A script decides each reply from the call number and the request: JSON
//! with any status and headers, an SSE stream (clean or cut), a reset before
//! headers, a hang, or a delay before any of those. The fake counts calls,
//! records what it was sent, and counts requests whose client went away
//! before the reply was complete (cancellation reaching the upstream).
//!
//! [`RawFake`] is the same idea one level down: a raw TCP upstream that
//! writes scripted bytes (status line and headers included), split and
//! paced exactly as the test says.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// One scripted reply.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A complete response.
    Json {
        /// HTTP status.
        status: u16,
        /// Body text.
        body: String,
        /// Extra headers.
        headers: Vec<(String, String)>,
    },
    /// A `text/event-stream` 200: each string is written as its own chunk,
    /// `delay` apart. With `cut`, the connection is aborted after the last one.
    Stream {
        /// Raw SSE pieces.
        pieces: Vec<String>,
        /// Pause before each piece.
        delay: Duration,
        /// Abort the connection instead of ending the body.
        cut: bool,
    },
    /// Close the connection without a response.
    Reset,
    /// Never answer (until the client goes away).
    Hang,
    /// Wait, then reply.
    Delay(Duration, Box<Reply>),
}

/// What the fake saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The request's path and query, e.g. `/v1/chat/completions?api-version=1`.
    pub uri: String,
    /// Request headers.
    pub headers: HeaderMap,
    /// The JSON body (Null if it was not JSON).
    pub body: serde_json::Value,
    /// The body's bytes, as they came.
    pub raw: Bytes,
}

/// How many requests [`Fake::seen`] keeps (the first ones).
pub const SEEN_LIMIT: usize = 1000;

type Script = Box<dyn FnMut(usize, &Seen) -> Reply + Send>;

struct Shared {
    calls: AtomicUsize,
    cancelled: AtomicUsize,
    seen: Mutex<Vec<Seen>>,
    script: Mutex<Script>,
}

/// A running fake upstream. Stops when dropped.
pub struct Fake {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fake {
    /// Starts a fake whose replies come from `script(call_index, request)`.
    pub async fn start(script: impl FnMut(usize, &Seen) -> Reply + Send + 'static) -> Fake {
        Self::start_on("127.0.0.1:0".parse().expect("literal address"), script).await
    }

    /// As [`Fake::start`], on a chosen address (to restart on the same port).
    pub async fn start_on(
        addr: SocketAddr,
        script: impl FnMut(usize, &Seen) -> Reply + Send + 'static,
    ) -> Fake {
        let listener = TcpListener::bind(addr).await.expect("bind fake upstream");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared {
            calls: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            seen: Mutex::new(Vec::new()),
            script: Mutex::new(Box::new(script)),
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| serve(Arc::clone(&s), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Fake { addr, shared, task }
    }

    /// A fake that always gives the same reply.
    pub async fn always(reply: Reply) -> Fake {
        Self::start(move |_, _| reply.clone()).await
    }

    /// The base URL to put in `routes.yaml`.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Requests received so far.
    pub fn calls(&self) -> usize {
        self.shared.calls.load(Ordering::SeqCst)
    }

    /// Requests whose client went away before the reply was complete.
    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    /// The first [`SEEN_LIMIT`] requests received.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().clone()
    }

    /// Replaces the script.
    pub fn set(&self, script: impl FnMut(usize, &Seen) -> Reply + Send + 'static) {
        *self.shared.script.lock() = Box::new(script);
    }
}

/// A URL where nothing listens (connection refused).
pub async fn dead_url() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    format!("http://{addr}/v1")
}

/// Counts a cancellation if dropped while armed.
struct CancelCount(Arc<Shared>, bool);

impl Drop for CancelCount {
    fn drop(&mut self) {
        if self.1 {
            self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[derive(Debug)]
pub struct Abort;
impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scripted abort")
    }
}
impl std::error::Error for Abort {}

async fn serve(s: Arc<Shared>, req: http::Request<Incoming>) -> Result<Response<FakeBody>, Abort> {
    let headers = req.headers().clone();
    let uri = req
        .uri()
        .path_and_query()
        .map_or_else(String::new, ToString::to_string);
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let seen = Seen {
        uri,
        headers,
        body: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        raw: bytes,
    };
    let n = s.calls.fetch_add(1, Ordering::SeqCst);
    let reply = (s.script.lock())(n, &seen);
    {
        let mut log = s.seen.lock();
        // Keep the first requests only: enough for any assertion, bounded under load.
        if log.len() < SEEN_LIMIT {
            log.push(seen);
        }
    }
    let mut guard = CancelCount(Arc::clone(&s), true);
    let mut reply = reply;
    loop {
        match reply {
            Reply::Delay(d, next) => {
                tokio::time::sleep(d).await;
                reply = *next;
            }
            Reply::Hang => std::future::pending::<()>().await,
            Reply::Reset => {
                guard.1 = false;
                return Err(Abort);
            }
            Reply::Json {
                status,
                body,
                headers,
            } => {
                guard.1 = false;
                let mut resp = Response::new(FakeBody::full(body));
                *resp.status_mut() =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                resp.headers_mut()
                    .insert("content-type", "application/json".parse().expect("static"));
                for (k, v) in headers {
                    if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.as_bytes()), v.parse())
                    {
                        resp.headers_mut().insert(k, v);
                    }
                }
                return Ok(resp);
            }
            Reply::Stream { pieces, delay, cut } => {
                guard.1 = false;
                let (tx, rx) = mpsc::channel::<Result<Bytes, Abort>>(1);
                let s2 = Arc::clone(&s);
                tokio::spawn(async move {
                    for piece in pieces {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        if tx.send(Ok(Bytes::from(piece))).await.is_err() {
                            s2.cancelled.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                    if cut {
                        // hyper flushes what it buffered only when the body goes
                        // pending; an abort straight after the last piece could
                        // drop those pieces unsent and turn "cut after n words"
                        // into "cut before any".
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let _ = tx.send(Err(Abort)).await;
                    }
                });
                let mut resp = Response::new(FakeBody::Channel(rx));
                resp.headers_mut()
                    .insert("content-type", "text/event-stream".parse().expect("static"));
                return Ok(resp);
            }
        }
    }
}

/// The fake's response body.
pub enum FakeBody {
    /// Known bytes (taken once).
    Full(Option<Bytes>),
    /// Pieces from a task; an `Err` aborts the connection.
    Channel(mpsc::Receiver<Result<Bytes, Abort>>),
}

impl FakeBody {
    fn full(s: String) -> Self {
        FakeBody::Full(Some(Bytes::from(s)))
    }
}

impl hyper::body::Body for FakeBody {
    type Data = Bytes;
    type Error = Abort;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Abort>>> {
        match &mut *self {
            FakeBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            FakeBody::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data))),
        }
    }
}

// ----- reply builders -----

/// A 200 chat completion whose text is `text` and whose `model` is `model`.
pub fn completion(model: &str, text: &str) -> Reply {
    json(200, &completion_body(model, text))
}

/// The JSON of a chat completion (usage: 5 prompt and 2 completion tokens).
pub fn completion_body(model: &str, text: &str) -> String {
    completion_json(model, text, 2)
}

/// The JSON of a chat completion whose usage reports 5 prompt tokens and
/// `completion_tokens` completion tokens. The one definition of a fake
/// completion: the tests, the demo and `examples/fake_upstream.rs` render theirs here.
pub fn completion_json(model: &str, text: &str, completion_tokens: usize) -> String {
    serde_json::json!({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens, "total_tokens": 5 + completion_tokens}
    })
    .to_string()
}

/// The JSON of a `chat.completion.chunk` with one choice. The one definition
/// of a fake chunk: [`sse_events`], the tests' SSE builders and
/// `examples/fake_upstream.rs` render theirs here.
pub fn chunk_json(model: &str, delta: serde_json::Value, finish: Option<&str>) -> String {
    serde_json::json!({
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
    })
    .to_string()
}

/// One chunk as an SSE event: `data: {chunk}\n\n`.
pub fn chunk_event(model: &str, delta: serde_json::Value, finish: Option<&str>) -> String {
    format!("data: {}\n\n", chunk_json(model, delta, finish))
}

/// Any status with a JSON body.
pub fn json(status: u16, body: &str) -> Reply {
    Reply::Json {
        status,
        body: body.to_owned(),
        headers: Vec::new(),
    }
}

/// An OpenAI-format error reply.
pub fn error(status: u16, message: &str) -> Reply {
    json(
        status,
        &serde_json::json!({"error": {"message": message, "type": "error", "code": status}})
            .to_string(),
    )
}

/// The SSE events of a streamed answer: a role chunk, one content chunk per
/// word, a finish chunk, `[DONE]`.
pub fn sse_events(model: &str, words: &[&str]) -> Vec<String> {
    let mut out = vec![chunk_event(
        model,
        serde_json::json!({"role": "assistant", "content": ""}),
        None,
    )];
    for w in words {
        out.push(chunk_event(model, serde_json::json!({"content": w}), None));
    }
    out.push(chunk_event(model, serde_json::json!({}), Some("stop")));
    out.push(SSE_DONE.to_owned());
    out
}

/// The last event of a stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// A clean stream of `words`.
pub fn stream(model: &str, words: &[&str]) -> Reply {
    Reply::Stream {
        pieces: sse_events(model, words),
        delay: Duration::ZERO,
        cut: false,
    }
}

/// A stream that sends the role chunk and the first `n` words, then aborts.
pub fn stream_cut_after(model: &str, words: &[&str], n: usize) -> Reply {
    let mut pieces = sse_events(model, words);
    pieces.truncate(1 + n);
    Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: true,
    }
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
