//! The pooled HTTP(S) client that talks to upstream providers, and the
//! mapping of its I/O errors to [`NetworkKind`]s.
//!
//! One keep-alive pool per distinct connect timeout, shared by every provider
//! and kept across reloads, so a reload never drops warm connections. TLS is
//! rustls with the webpki root set (no dependence on the host's CA bundle);
//! HTTP/2 is negotiated by ALPN where the upstream offers it.

use std::collections::HashMap;
use std::error::Error as _;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;

use crate::classify::NetworkKind;

/// The client type used for every upstream call.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Idle pooled connections are closed after this long (below the common 120 s
/// of provider load balancers, so we close first and never reuse a dead one).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Upstream clients by connect timeout; lives outside config snapshots.
#[derive(Default)]
pub struct Clients {
    by_connect_timeout: Mutex<HashMap<Duration, HttpClient>>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients").finish_non_exhaustive()
    }
}

impl Clients {
    /// A pooled client whose TCP+TLS connect gives up after `connect_timeout`.
    pub fn get(&self, connect_timeout: Duration) -> HttpClient {
        let mut map = self.by_connect_timeout.lock();
        map.entry(connect_timeout)
            .or_insert_with(|| build(connect_timeout))
            .clone()
    }
}

fn build(connect_timeout: Duration) -> HttpClient {
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
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(256)
        .build(https)
}

/// Maps a failed request (no response headers) to a network kind, by the
/// error kinds in its source chain. `host_is_name` tells a DNS failure apart
/// from other connect errors.
#[must_use]
pub fn request_error_kind(
    err: &hyper_util::client::legacy::Error,
    host_is_name: bool,
) -> NetworkKind {
    let mut io_kind = None;
    let mut tls = false;
    let mut source = err.source();
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            io_kind.get_or_insert(io.kind());
        }
        if e.downcast_ref::<rustls::Error>().is_some() {
            tls = true;
        }
        source = e.source();
    }
    if tls {
        return NetworkKind::Tls;
    }
    use std::io::ErrorKind as K;
    #[allow(clippy::wildcard_enum_match_arm)] // io::ErrorKind is non-exhaustive
    match io_kind {
        Some(K::TimedOut) => NetworkKind::Timeout,
        Some(
            K::ConnectionRefused | K::AddrNotAvailable | K::NetworkUnreachable | K::HostUnreachable,
        ) => NetworkKind::Connect,
        Some(K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof) => {
            NetworkKind::Reset
        }
        Some(_) if err.is_connect() && host_is_name => NetworkKind::Dns,
        _ if err.is_connect() => NetworkKind::Connect,
        // hyper reports a connection closed before the response as an incomplete message.
        _ => NetworkKind::Reset,
    }
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
