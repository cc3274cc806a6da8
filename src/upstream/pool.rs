//! The pooled HTTP(S) client that talks to upstream providers, and the
//! mapping of its I/O errors to [`NetworkKind`]s.
//!
//! One keep-alive pool per provider `base_url` and connect timeout, kept
//! across reloads while a snapshot uses it (so a reload never drops warm
//! connections) and dropped, with its idle connections, once none does. Idle
//! connections close after [`POOL_IDLE_TIMEOUT`] (the pool's timer is tokio's).
//! TLS is
//! rustls with the webpki root set (no dependence on the host's CA bundle);
//! HTTP/2 is negotiated by ALPN where the upstream offers it.

use std::collections::HashMap;
use std::error::Error as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
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

/// One provider's pool: the client of the thread that asks, so that on a
/// worker runtime (`runtimes`) a request's upstream connections are that
/// runtime's own (their tasks run on its thread); elsewhere (the prober,
/// the main runtime) the shared one. Dropping the pool drops them all, and
/// their idle connections with them.
#[derive(Debug)]
pub struct Pool {
    connect_timeout: Duration,
    shared: HttpClient,
    /// By worker index, made on the worker's first call.
    workers: Box<[std::sync::OnceLock<HttpClient>]>,
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
    fn new(connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            shared: build(connect_timeout, POOL_IDLE_TIMEOUT),
            workers: (0..MAX_WORKER_POOLS)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        }
    }

    /// The client a request on this thread uses.
    #[must_use]
    pub fn client(&self) -> &HttpClient {
        let own = WORKER
            .with(std::cell::Cell::get)
            .and_then(|i| self.workers.get(i));
        match own {
            Some(slot) => slot.get_or_init(|| build(self.connect_timeout, POOL_IDLE_TIMEOUT)),
            None => &self.shared,
        }
    }
}

/// Upstream pools by provider `base_url` and connect timeout; lives outside
/// config snapshots.
#[derive(Default)]
pub struct Clients {
    by_provider: Mutex<HashMap<(String, Duration), Arc<Pool>>>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients").finish_non_exhaustive()
    }
}

impl Clients {
    /// The pooled client of the provider at `base_url` whose TCP+TLS connect
    /// gives up after `connect_timeout`.
    pub fn get(&self, base_url: &str, connect_timeout: Duration) -> Arc<Pool> {
        let mut map = self.by_provider.lock();
        Arc::clone(
            map.entry((base_url.to_owned(), connect_timeout))
                .or_insert_with(|| Arc::new(Pool::new(connect_timeout))),
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

fn build(connect_timeout: Duration, idle_timeout: Duration) -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        // Without a timer the pool never evicts idle connections.
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(idle_timeout)
        .pool_max_idle_per_host(256)
        .build(Counting(https))
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
    let mut source = err.source();
    while let Some(e) = source {
        if let Some(e) = e.downcast_ref::<std::io::Error>() {
            io.get_or_insert((e.kind(), e.raw_os_error()));
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

    #[tokio::test]
    async fn an_idle_pooled_connection_is_closed_after_the_idle_timeout() {
        let (url, mut closed) = one_answer_then_watch_close().await;
        let client = build(Duration::from_secs(1), Duration::from_millis(200));
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
        let removed = clients.get(&url, Duration::from_secs(1));
        let kept = clients.get(&kept_url, Duration::from_secs(1));
        call_once(removed.client(), &url).await;
        call_once(kept.client(), &kept_url).await;
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
            &clients.get(&kept_url, Duration::from_secs(1))
        ));
        assert!(kept_closed.try_recv().is_err());
    }
}
