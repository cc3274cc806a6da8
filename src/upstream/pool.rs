//! The pooled HTTP(S) client that talks to upstream providers, and the
//! mapping of its I/O errors to [`NetworkKind`]s.
//!
//! One keep-alive pool per provider `base_url` and connect timeout, kept
//! across reloads while a snapshot uses it (so a reload never drops warm
//! connections) and dropped, with its idle connections, once none does. Idle
//! connections close after [`POOL_IDLE_TIMEOUT`] (the pool's timer is tokio's).
//! TLS is
//! rustls with the webpki root set (no dependence on the host's CA bundle).
//! A provider's `http_version` says how its connections speak HTTP: by
//! default HTTP/2 where TLS negotiates it (ALPN) and HTTP/1.1 elsewhere.
//!
//! HTTP/1.1 carries one request per connection at a time, so the client opens
//! one per concurrent request. HTTP/2 carries them all on one connection, and
//! a server caps the streams it takes at once (`SETTINGS_MAX_CONCURRENT_STREAMS`,
//! 100 to 256 at the big providers); hyper's pool never opens a second
//! connection, so a request past the cap would wait, unseen, behind streams
//! that may last minutes, and read as a slow first token. So each runtime's
//! HTTP/2 requests are spread over [`Lane`]s, each a client of its own
//! (one connection) carrying at most [`STREAMS_PER_CONNECTION`] at once.

use std::collections::HashMap;
use std::error::Error as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use parking_lot::Mutex;

use super::{LocalResource, SendError};
use crate::classify::NetworkKind;

/// The client type used for every upstream call.
pub type HttpClient = Client<Counting<HttpsConnector<HttpConnector>>, Full<Bytes>>;

/// Idle pooled connections are closed after this long (below the common 120 s
/// of provider load balancers, so we close first and never reuse a dead one).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// How a provider's connections speak HTTP (`http_version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HttpVersion {
    /// HTTP/2 where TLS negotiates it, HTTP/1.1 elsewhere.
    #[default]
    Auto,
    /// HTTP/1.1 only, also over TLS.
    Http1,
    /// HTTP/2 only: negotiated over TLS, with prior knowledge (h2c) over
    /// plain `http://`.
    Http2,
}

/// Requests one HTTP/2 connection carries at once: the floor RFC 9113 asks
/// servers to allow (`SETTINGS_MAX_CONCURRENT_STREAMS` "no smaller than
/// 100"), so no server that follows it makes one wait.
pub const STREAMS_PER_CONNECTION: usize = 100;

/// Lanes per runtime and provider: past `MAX_LANES × STREAMS_PER_CONNECTION`
/// concurrent requests, the last lane takes the rest.
const MAX_LANES: usize = 16;

/// One provider's pool: the connections of the thread that asks, so that
/// on a worker runtime (`runtimes`) a request's upstream connections are
/// that runtime's own (their tasks run on its thread); elsewhere (the
/// prober, the main runtime) the shared ones. Dropping the pool drops them
/// all, and their idle connections with them.
#[derive(Debug)]
pub struct Pool {
    connect_timeout: Duration,
    version: HttpVersion,
    /// Whether a connection may carry many requests at once (HTTP/2).
    multiplexed: bool,
    shared: OnceLock<Conns>,
    /// By worker index, made on the worker's first call.
    workers: Box<[OnceLock<Conns>]>,
}

/// One runtime's connections to a provider.
#[derive(Debug)]
// The HTTP/1.1 client stays inline: most requests read it, and a worker's
// slot held the same client before lanes existed.
#[allow(clippy::large_enum_variant)]
enum Conns {
    /// HTTP/1.1: the client opens a connection per concurrent request.
    Single(HttpClient),
    /// HTTP/2: clients of one connection each, filled in turn.
    Lanes(Box<[OnceLock<Lane>; MAX_LANES]>),
}

/// A client whose one HTTP/2 connection carries at most
/// [`STREAMS_PER_CONNECTION`] requests at once.
#[derive(Debug)]
struct Lane {
    client: HttpClient,
    in_flight: Arc<AtomicUsize>,
}

/// A request's place on a [`Lane`], held until its answer's body is
/// dropped.
#[derive(Debug)]
pub struct Stream(Arc<AtomicUsize>);

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An upstream answer's body, holding its request's place on a lane.
#[derive(Debug)]
pub struct Body {
    incoming: Incoming,
    _stream: Option<Stream>,
}

impl Body {
    /// `incoming`, holding `stream` until it is dropped.
    #[must_use]
    pub fn new(incoming: Incoming, stream: Option<Stream>) -> Self {
        Self {
            incoming,
            _stream: stream,
        }
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.get_mut().incoming).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

/// Workers with pools of their own; a worker past them uses the shared one.
const MAX_WORKER_POOLS: usize = 64;

thread_local! {
    /// The index of the worker runtime this thread is, if it is one.
    static WORKER: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Marks the calling thread as worker `index`: its requests use pools of
/// their own.
pub fn own_pools_on_this_thread(index: usize) {
    WORKER.with(|w| w.set(Some(index)));
}

impl Pool {
    fn new(connect_timeout: Duration, version: HttpVersion, tls: bool) -> Self {
        Self {
            connect_timeout,
            version,
            multiplexed: match version {
                HttpVersion::Auto => tls,
                HttpVersion::Http1 => false,
                HttpVersion::Http2 => true,
            },
            shared: OnceLock::new(),
            workers: (0..MAX_WORKER_POOLS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The client a request on this thread uses, and on HTTP/2 the place it
    /// takes on that client's connection (drop it when the answer is done).
    #[must_use]
    pub fn client(&self) -> (&HttpClient, Option<Stream>) {
        let own = WORKER
            .with(std::cell::Cell::get)
            .and_then(|i| self.workers.get(i));
        let conns = own.unwrap_or(&self.shared).get_or_init(|| {
            if self.multiplexed {
                Conns::Lanes(Box::new(std::array::from_fn(|_| OnceLock::new())))
            } else {
                Conns::Single(self.build())
            }
        });
        match conns {
            Conns::Single(client) => (client, None),
            Conns::Lanes(lanes) => self.lane(lanes),
        }
    }

    /// The first lane with room, else the last.
    fn lane<'a>(&self, lanes: &'a [OnceLock<Lane>; MAX_LANES]) -> (&'a HttpClient, Option<Stream>) {
        let open = |slot: &'a OnceLock<Lane>| {
            slot.get_or_init(|| Lane {
                client: self.build(),
                in_flight: Arc::default(),
            })
        };
        let [rest @ .., last] = lanes;
        for slot in rest {
            let lane = open(slot);
            if lane.in_flight.fetch_add(1, Ordering::Relaxed) < STREAMS_PER_CONNECTION {
                return (&lane.client, Some(Stream(Arc::clone(&lane.in_flight))));
            }
            lane.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        let lane = open(last);
        lane.in_flight.fetch_add(1, Ordering::Relaxed);
        (&lane.client, Some(Stream(Arc::clone(&lane.in_flight))))
    }

    fn build(&self) -> HttpClient {
        build(self.connect_timeout, POOL_IDLE_TIMEOUT, self.version)
    }
}

/// Upstream pools by provider `base_url` and connect timeout; lives outside
/// config snapshots.
#[derive(Default)]
pub struct Clients {
    by_provider: Mutex<HashMap<(String, Duration, HttpVersion), Arc<Pool>>>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients").finish_non_exhaustive()
    }
}

impl Clients {
    /// The pool of the provider at `base_url` whose TCP+TLS connect gives
    /// up after `connect_timeout`, speaking `version`.
    pub fn get(
        &self,
        base_url: &str,
        connect_timeout: Duration,
        version: HttpVersion,
    ) -> Arc<Pool> {
        let tls = base_url
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"));
        let mut map = self.by_provider.lock();
        Arc::clone(
            map.entry((base_url.to_owned(), connect_timeout, version))
                .or_insert_with(|| Arc::new(Pool::new(connect_timeout, version, tls))),
        )
    }

    /// Drops the pools no snapshot holds any more (a provider a reload
    /// removed), which closes their idle connections.
    pub fn prune(&self) {
        self.by_provider
            .lock()
            .retain(|_, c| Arc::strong_count(c) > 1);
    }
}

fn build(connect_timeout: Duration, idle_timeout: Duration, version: HttpVersion) -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http();
    let https = match version {
        HttpVersion::Auto => tls.enable_http1().enable_http2().wrap_connector(http),
        HttpVersion::Http1 => tls.enable_http1().wrap_connector(http),
        HttpVersion::Http2 => tls.enable_http2().wrap_connector(http),
    };
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        // Without a timer the pool never evicts idle connections.
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle_timeout)
        .pool_max_idle_per_host(256)
        .http2_only(version == HttpVersion::Http2);
    builder.build(Counting(https))
}

/// A failure on a reused connection within this long of sending is the
/// pool's (the upstream closed the connection while it sat idle, before it
/// could read the request); a later one came after the upstream held the
/// request, and is the upstream's.
const STALE_WITHIN: Duration = Duration::from_secs(1);

/// Sends the request `build` makes. A request that fails at once (within
/// [`STALE_WITHIN`]), before any byte of a response, on a *reused* pooled
/// connection (the upstream closed it while it sat idle, and the close
/// crossed our request) is sent once more, on a fresh connection:
/// that failure is the pool's, not the upstream's, so it counts against no
/// health or retry budget. It was an upstream call all the same (the
/// upstream may have read it): `resends` counts it.
///
/// # Errors
/// The request's failure, or the retry's.
pub async fn send(
    client: &HttpClient,
    build: impl Fn() -> Request<Full<Bytes>>,
    resends: &AtomicU32,
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
    match request_once(client, build()).await {
        Ok(resp) => Ok(resp),
        Err((e, true)) if !e.is_connect() => {
            tracing::debug!(error = %e, "pooled connection was closed while idle; sending again");
            resends.fetch_add(1, Ordering::Relaxed);
            request_once(client, build()).await.map_err(|(e, _)| e)
        }
        Err((e, _)) => Err(e),
    }
}

/// One try; on failure, whether it failed at once on a reused connection
/// before any response byte (a failure after the upstream held the request
/// for [`STALE_WITHIN`] is not stale: resending it would call a silent
/// upstream twice).
///
/// The connection's [`Uses`] comes with the answer (the client copies a
/// connection's extras into every response) or with the error (which names
/// its connection), so no per-request capture of the connection is needed.
async fn request_once(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, (hyper_util::client::legacy::Error, bool)> {
    let sent = tokio::time::Instant::now();
    match client.request(req).await {
        Ok(resp) => {
            if let Some(uses) = resp.extensions().get::<Uses>() {
                uses.count();
            }
            Ok(resp)
        }
        Err(e) => {
            let earlier_uses = e.connect_info().and_then(|c| {
                let mut extras = http::Extensions::new();
                c.get_extras(&mut extras);
                extras.get::<Uses>().map(Uses::count)
            });
            let stale = earlier_uses.is_some_and(|n| n > 0)
                && sent.elapsed() < STALE_WITHIN
                && request_error_kind(&e, false) == SendError::Upstream(NetworkKind::Reset);
            Err((e, stale))
        }
    }
}

/// How many requests a connection has carried, attached to it as an extra.
#[derive(Debug, Clone, Default)]
pub struct Uses(Arc<AtomicU64>);

impl Uses {
    /// Requests started on the connection before now; counts this one.
    fn count(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// A connector whose connections count their requests ([`Uses`]), so a
/// failure can tell a fresh connection from a reused one.
#[derive(Debug, Clone)]
pub struct Counting<C>(C);

/// A connection with its [`Uses`].
#[derive(Debug)]
pub struct Counted<T> {
    io: T,
    uses: Uses,
}

impl<C> tower_service::Service<Uri> for Counting<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
{
    type Response = Counted<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            connecting.await.map(|io| Counted {
                io,
                uses: Uses::default(),
            })
        })
    }
}

impl<T: Connection> Connection for Counted<T> {
    fn connected(&self) -> Connected {
        // Only what the pool reads of the inner connection's facts: the
        // TCP connector's `HttpInfo` would be inserted into every response's
        // extensions (a map and a box per request) and nothing reads it.
        let inner = self.io.connected();
        let mut bare = Connected::new().proxy(inner.is_proxied());
        if inner.is_negotiated_h2() {
            bare = bare.negotiated_h2();
        }
        bare.extra(self.uses.clone())
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

/// Maps a failed request (no response headers) to a network kind, by the
/// error kinds in its source chain, or to the local resource switchyard ran
/// out of before the request left. `host_is_name` tells a DNS failure apart
/// from other connect errors.
#[must_use]
pub fn request_error_kind(
    err: &hyper_util::client::legacy::Error,
    host_is_name: bool,
) -> SendError {
    let mut io = None;
    let mut tls = false;
    let mut unreadable = false;
    let mut source = err.source();
    while let Some(e) = source {
        if let Some(e) = e.downcast_ref::<std::io::Error>() {
            io.get_or_insert((e.kind(), e.raw_os_error()));
        }
        if let Some(e) = e.downcast_ref::<hyper::Error>() {
            unreadable |= e.is_parse() || e.is_parse_status() || e.is_parse_too_large();
        }
        if e.downcast_ref::<rustls::Error>().is_some() {
            tls = true;
        }
        source = e.source();
    }
    if tls {
        return SendError::Upstream(NetworkKind::Tls);
    }
    if let Some(resource) = io.and_then(|(kind, errno)| LocalResource::of(kind, errno)) {
        return SendError::Local(resource);
    }
    use std::io::ErrorKind as K;
    #[allow(clippy::wildcard_enum_match_arm)] // io::ErrorKind is non-exhaustive
    let kind = match io.map(|(kind, _)| kind) {
        Some(K::TimedOut) => NetworkKind::Timeout,
        Some(K::ConnectionRefused | K::NetworkUnreachable | K::HostUnreachable) => {
            NetworkKind::Connect
        }
        Some(K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof) => {
            NetworkKind::Reset
        }
        Some(_) if err.is_connect() && host_is_name => NetworkKind::Dns,
        _ if err.is_connect() => NetworkKind::Connect,
        // The upstream answered, in bytes that are no HTTP response: never
        // a stale connection, so never sent again unasked.
        _ if unreadable => NetworkKind::Protocol,
        // hyper reports a connection closed before the response as an incomplete message.
        _ => NetworkKind::Reset,
    };
    SendError::Upstream(kind)
}

/// Maps an error while reading a response body to a network kind.
#[must_use]
pub fn body_error_kind(err: &hyper::Error) -> NetworkKind {
    if err.is_parse() || err.is_user() {
        NetworkKind::Protocol
    } else {
        NetworkKind::Reset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A fake upstream that answers one request per connection and then
    /// reports (on the channel) when switchyard closes that connection.
    async fn one_answer_then_watch_close() -> (String, tokio::sync::mpsc::Receiver<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (closed, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let closed = closed.clone();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    sock.write_all(answer).await.unwrap();
                    // Keep-alive: the connection now sits idle in the pool.
                    while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {}
                    let _ = closed.send(()).await;
                });
            }
        });
        (url, rx)
    }

    async fn call_once(client: &HttpClient, url: &str) {
        let resends = AtomicU32::new(0);
        let build = || Request::get(url).body(Full::new(Bytes::new())).unwrap();
        let resp = send(client, build, &resends).await.unwrap();
        assert_eq!(resp.status(), 200);
        // Read the body so the connection goes back to the pool.
        http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap();
    }

    /// An upstream that answers its first request well and every later one on
    /// the same connection with bytes that are no HTTP response; counts the
    /// requests it read.
    async fn good_then_unreadable() -> (String, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicU64::new(0));
        let seen_requests = Arc::clone(&requests);
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let requests = Arc::clone(&seen_requests);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let mut answered = 0;
                    while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {
                        requests.fetch_add(1, Ordering::Relaxed);
                        let answer: &[u8] = if answered == 0 {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                        } else {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\nok"
                        };
                        answered += 1;
                        if sock.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, requests)
    }

    #[tokio::test]
    async fn an_unreadable_answer_on_a_reused_connection_is_never_sent_again() {
        let (url, requests) = good_then_unreadable().await;
        let client = build(
            Duration::from_secs(1),
            Duration::from_secs(30),
            HttpVersion::Auto,
        );
        call_once(&client, &url).await;
        let resends = AtomicU32::new(0);
        let build = || {
            Request::post(url.as_str())
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap()
        };
        let err = send(&client, build, &resends).await.unwrap_err();
        assert_eq!(
            request_error_kind(&err, false),
            SendError::Upstream(NetworkKind::Protocol)
        );
        assert_eq!(resends.load(Ordering::Relaxed), 0);
        assert_eq!(requests.load(Ordering::Relaxed), 2, "the POST went up once");
    }

    #[tokio::test]
    async fn an_idle_pooled_connection_is_closed_after_the_idle_timeout() {
        let (url, mut closed) = one_answer_then_watch_close().await;
        let client = build(
            Duration::from_secs(1),
            Duration::from_millis(200),
            HttpVersion::Auto,
        );
        call_once(&client, &url).await;
        // The client is still alive, so only the idle timer can close it.
        let seen = tokio::time::timeout(Duration::from_secs(10), closed.recv()).await;
        assert!(
            matches!(seen, Ok(Some(()))),
            "the idle connection was never closed"
        );
        drop(client);
    }

    #[tokio::test]
    async fn a_pool_no_snapshot_holds_is_dropped_with_its_connections() {
        let (url, mut closed) = one_answer_then_watch_close().await;
        let (kept_url, mut kept_closed) = one_answer_then_watch_close().await;
        let clients = Clients::default();
        let removed = clients.get(&url, Duration::from_secs(1), HttpVersion::Auto);
        let kept = clients.get(&kept_url, Duration::from_secs(1), HttpVersion::Auto);
        call_once(removed.client().0, &url).await;
        call_once(kept.client().0, &kept_url).await;
        drop(removed); // the snapshot that named this provider is gone
        clients.prune();
        let seen = tokio::time::timeout(Duration::from_secs(10), closed.recv()).await;
        assert!(
            matches!(seen, Ok(Some(()))),
            "the removed provider's connection stayed open"
        );
        // The provider still in use keeps its pool (and its warm connection).
        assert!(Arc::ptr_eq(
            &kept,
            &clients.get(&kept_url, Duration::from_secs(1), HttpVersion::Auto)
        ));
        assert!(kept_closed.try_recv().is_err());
    }
}
