//! Listeners, endpoints and graceful shutdown.
//!
//! One listener serves HTTP/1.1 (keep-alive) and HTTP/2 prior knowledge
//! (h2c). Each request loads the current snapshot once (`ArcSwap::load_full`)
//! and keeps it to the end, so a reload never changes a request half-way.
//!
//! | endpoint | answer |
//! |---|---|
//! | `POST /v1/chat/completions` | the proxy pipeline ([`crate::proxy`]) |
//! | `POST /v1/embeddings` | the same pipeline, for embeddings tasks |
//! | `GET /v1/models` | tasks and aliases as OpenAI model objects |
//! | `GET /v1/models/{id}` | one of them, or 404 `model_not_found` |
//! | `GET /healthz` | 200 while the process serves |
//! | `GET /readyz` | 200 when every task has a target that is not DOWN, else 503 |
//! | `GET /metrics` | Prometheus text |
//! | `GET /admin/targets` | health per target |
//! | `POST /admin/explain` | the routing plan for a request body |
//!
//! `/admin/*` is served on `admin_listen` when set (and then not on the main
//! listener, which keeps health and metrics too, so the main listener can stay
//! on loopback while probes and scrapers use the admin one), else on the main
//! listener to loopback clients only; with an
//! admin token configured it also needs `Authorization: Bearer <token>`.
//!
//! The endpoints that take a body (`/v1/chat/completions`, `/v1/embeddings`,
//! `/admin/explain`)
//! read it as JSON: a `Content-Type` of `application/json` (any parameters),
//! `application/*+json`, or none at all; anything else is refused with 415
//! before the body is read ([`json_body`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument};

use crate::body::{self, Body};
use crate::config::diagnostic::Diagnostic;
use crate::error::GatewayError;
use crate::inbound::{self, Protocol};
use crate::native;
use crate::proxy::{self, respond};
use crate::reload;
use crate::request::ChatRequest;
use crate::snapshot::{self as snap, CompileOptions, LiveState, Snapshot};
use crate::state::App;
use crate::telemetry::RequestTrace;

mod conn;
mod workers;

/// Largest request body accepted; larger gets 413.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// A client must send its request head within this time (slowloris guard).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A client must send its whole request body within this time.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Most request headers accepted (HTTP/1: more gets 431).
const MAX_HEADERS: usize = 100;
/// Largest request head in bytes.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config file is invalid; every problem is listed.
    #[error("{}", render_diagnostics(.path, .diagnostics))]
    Config {
        /// The file.
        path: String,
        /// Its problems.
        diagnostics: Vec<Diagnostic>,
    },
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The file watcher could not start.
    #[error("cannot watch the config directory: {0}")]
    Watch(#[from] notify::Error),
}

fn render_diagnostics(path: &str, diags: &[Diagnostic]) -> String {
    diags
        .iter()
        .map(|d| d.render(path))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A gateway bound to its listeners, ready to serve.
pub struct Gateway {
    app: Arc<App>,
    listener: TcpListener,
    admin: Option<TcpListener>,
}

/// Which listener a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The main listener: the API, health, metrics (and admin when there is no admin listener).
    Main,
    /// The `admin_listen` listener: `/admin/*` only.
    Admin,
}

impl Gateway {
    /// Loads `config` and binds `listen` (or the file's `listen:`), plus the
    /// file's `admin_listen` if set.
    ///
    /// # Errors
    /// An invalid config (every problem, located) or a failed bind.
    pub async fn bind(
        config: &Path,
        listen: Option<SocketAddr>,
        options: CompileOptions,
    ) -> Result<Self, StartError> {
        Self::bind_with(config, listen, None, options).await
    }

    /// As [`Gateway::bind`], with `admin_listen` overriding the file's.
    ///
    /// # Errors
    /// An invalid config (every problem, located) or a failed bind.
    pub async fn bind_with(
        config: &Path,
        listen: Option<SocketAddr>,
        admin_listen: Option<SocketAddr>,
        options: CompileOptions,
    ) -> Result<Self, StartError> {
        let live = LiveState::default();
        let display = config.display().to_string();
        let compiled =
            snap::load(config, &live, options).map_err(|diagnostics| StartError::Config {
                path: display.clone(),
                diagnostics,
            })?;
        reload::log_warnings(config, &compiled);
        reload::count(&live.metrics, true);
        reload::publish_info(&compiled.snapshot);
        let startup = compiled.startup;
        let addr = listen.unwrap_or(startup.listen);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        let admin = match admin_listen.or(startup.admin_listen) {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| StartError::Bind { addr, source })?,
            ),
            None => None,
        };
        let app = Arc::new(App {
            inflight: Arc::new(Semaphore::new(startup.max_concurrent_requests)),
            admin_separate: admin.is_some(),
            responses: crate::inbound::ResponseStore::default(),
            drain: crate::body::Drain::default(),
            snapshot: ArcSwap::from_pointee(compiled.snapshot),
            live,
            config_path: config.to_path_buf(),
            options,
            startup,
        });
        Ok(Self {
            app,
            listener,
            admin,
        })
    }

    /// The bound address (useful with port 0).
    ///
    /// # Errors
    /// If the socket has no local address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The admin listener's address, if there is one.
    #[must_use]
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Shared state, for embedding and tests.
    #[must_use]
    pub fn app(&self) -> Arc<App> {
        Arc::clone(&self.app)
    }

    /// Serves until `shutdown` resolves, watching the config file for changes;
    /// then stops accepting and lets in-flight requests and streams finish, for
    /// at most the config's `drain_timeout`.
    ///
    /// # Errors
    /// If the config watcher cannot start.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
        let _watcher = reload::watch(Arc::clone(&self.app))?;
        // A change written between `bind` and now had no watcher to see it.
        // Read here, before the first connection, rather than on a blocking
        // thread: that thread's malloc arena would keep ~1.4 MB resident in
        // an idle gateway.
        reload::reload_now(&self.app);
        let prober = crate::probe::spawn(Arc::clone(&self.app));
        let shared = crate::shared::spawn(Arc::clone(&self.app));
        // The Prometheus recorder keeps every histogram sample until it is
        // drained: by a scrape of /metrics, or by this upkeep. Without it an
        // unscraped sidecar grows by ~20 bytes per request, forever.
        // It also drops the upstream pools of providers a reload removed that
        // a request in flight still held at the reload.
        let app = Arc::clone(&self.app);
        let upkeep = tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                app.metrics().upkeep();
                app.live.clients.prune();
            }
        });
        let mut workers = workers::Workers::start(self.app.startup.runtimes, &self.app);
        let here = Server::new(Arc::clone(&self.app));
        tokio::pin!(shutdown);
        loop {
            let (accepted, kind) = tokio::select! {
                a = self.listener.accept() => (a, Listener::Main),
                a = accept_opt(self.admin.as_ref()) => (a, Listener::Admin),
                () = &mut shutdown => break,
            };
            let (stream, peer) = match accepted {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            if let Some(stream) = workers.hand(stream, peer, kind) {
                here.serve(stream, peer, kind);
            }
        }
        drop(self.listener);
        drop(self.admin);
        prober.abort();
        upkeep.abort();
        if let Some(shared) = shared {
            shared.abort();
        }
        let drain = self.app.snapshot.load().drain_timeout;
        info!(drain_timeout = ?drain, "shutting down: draining in-flight requests");
        tokio::join!(here.drain(), workers.drain());
        Ok(())
    }
}

/// Serves connections on the runtime it runs on, and drains them.
struct Server {
    app: Arc<App>,
    builders: Arc<conn::Builders>,
    graceful: GracefulShutdown,
}

impl Server {
    fn new(app: Arc<App>) -> Self {
        let limits = conn::Limits {
            header_read: HEADER_READ_TIMEOUT,
            max_headers: MAX_HEADERS,
            max_head_bytes: MAX_HEAD_BYTES,
        };
        Self {
            app,
            builders: Arc::new(conn::Builders::new(&limits)),
            graceful: GracefulShutdown::new(),
        }
    }

    /// Serves one accepted connection (a task of the current runtime).
    fn serve(&self, stream: tokio::net::TcpStream, peer: SocketAddr, kind: Listener) {
        let app = Arc::clone(&self.app);
        let service = service_fn(move |req| {
            let app = Arc::clone(&app);
            // Not boxed: hyper then keeps the request's future apart from the
            // connection's (a few KB less per open stream), but moving the
            // whole future into the box copies tens of KB per request.
            async move { Ok::<_, Infallible>(handle(app, req, peer, kind).await) }
        });
        let builders = Arc::clone(&self.builders);
        // Counted in by the drain from here, while the first bytes are awaited.
        let watcher = self.graceful.watcher();
        tokio::spawn(async move {
            let sniffed = conn::sniff(&stream, HEADER_READ_TIMEOUT).await;
            let io = TokioIo::new(stream);
            let _ = match sniffed {
                conn::Sniffed::Http1 => {
                    let conn = builders.http1.serve_connection(io, service);
                    watcher.watch(conn).await.map_err(drop)
                }
                conn::Sniffed::Http2 => {
                    let conn = builders.http2.serve_connection(io, service);
                    watcher.watch(conn).await.map_err(drop)
                }
                conn::Sniffed::Silent => Ok(()),
            };
        });
    }

    /// Lets in-flight requests and streams finish, for at most the
    /// config's `drain_timeout`; then cuts the streams still running.
    async fn drain(self) {
        let drain = self.app.snapshot.load().drain_timeout;
        let drained = self.graceful.shutdown();
        tokio::pin!(drained);
        tokio::select! {
            () = &mut drained => debug!("drained"),
            () = tokio::time::sleep(drain) => {
                warn!("drain timeout; cutting the streams still running and closing remaining connections");
                // Streams end with a `drain` error event, so their clients
                // learn the answer is incomplete; give the last bytes a moment.
                self.app.drain.cut();
                let _ = tokio::time::timeout(DRAIN_CUT_GRACE, drained).await;
            }
        }
    }
}

/// How long the streams cut at the drain timeout get to write their last event.
const DRAIN_CUT_GRACE: Duration = Duration::from_millis(100);

async fn accept_opt(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Whether the request may use `/admin/*`: on the admin listener, or from a
/// loopback client on the main one when there is no admin listener; and with
/// the configured token, if any.
fn admin_allowed(
    app: &App,
    kind: Listener,
    peer: SocketAddr,
    headers: &http::HeaderMap,
) -> Result<(), StatusCode> {
    let reachable = match kind {
        Listener::Admin => true,
        Listener::Main => !app.admin_separate && peer.ip().to_canonical().is_loopback(),
    };
    if !reachable {
        return Err(StatusCode::NOT_FOUND);
    }
    let snapshot = app.snapshot.load();
    let Some(token) = &snapshot.admin_token else {
        return Ok(());
    };
    let given = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if token.matches(given) {
        Ok(())
    } else {
        Err(StatusCode::UNAUTHORIZED)
    }
}

/// Routes one request to its endpoint.
async fn handle(
    app: Arc<App>,
    req: Request<Incoming>,
    peer: SocketAddr,
    kind: Listener,
) -> Response<Body> {
    let arrival = Instant::now();
    let request_id = req
        .headers()
        .get(respond::H_REQUEST_ID)
        .filter(|v| v.len() <= 128 && v.to_str().is_ok_and(|s| !s.is_empty()))
        .cloned()
        .unwrap_or_else(new_request_id);
    // A clone of the URI shares its bytes: the path outlives `req` without a copy.
    let uri = req.uri().clone();
    let path = uri.path();
    let not_found = || GatewayError::NotFound(path.chars().take(200).collect());
    if path.starts_with("/admin/") {
        if let Err(status) = admin_allowed(&app, kind, peer, req.headers()) {
            let e = if status == StatusCode::UNAUTHORIZED {
                GatewayError::Unauthorized
            } else {
                not_found()
            };
            return respond::plain_error(&e, &request_id);
        }
    }
    // An Anthropic client hears a wrong path or method in its own envelope.
    let protocol = match path.starts_with("/v1/messages") {
        true => Protocol::Messages,
        false => Protocol::Chat,
    };
    let endpoint = match route(req.method(), path) {
        Some(Ok(endpoint)) if kind != Listener::Admin || endpoint.on_admin_listener() => endpoint,
        Some(Err(e)) if kind != Listener::Admin || path.starts_with("/admin/") => {
            return plain_error_in(protocol, &e, &request_id)
        }
        Some(_) | None => return plain_error_in(protocol, &not_found(), &request_id),
    };
    match endpoint {
        Endpoint::Proxied(api) => proxied(&app, api, req, peer.ip(), request_id, arrival).await,
        Endpoint::CountTokens => count_tokens(&app, req, &request_id).await,
        Endpoint::StoredResponse => stored_response(&app, req.method(), path, &request_id).await,
        Endpoint::Models => json(StatusCode::OK, &models(&app.snapshot.load())),
        Endpoint::Model => match model_id(path) {
            Some(id) => model(&app.snapshot.load(), &id, &request_id),
            None => respond::plain_error(&not_found(), &request_id),
        },
        Endpoint::Healthz => json(StatusCode::OK, &serde_json::json!({"status": "ok"})),
        Endpoint::Readyz => readiness(&app.snapshot.load()),
        Endpoint::Metrics => {
            crate::telemetry::publish(app.metrics());
            let snapshot = app.snapshot.load();
            publish_availability(&snapshot);
            let page = app.metrics().render_named(&named(&snapshot));
            let mut resp = Response::new(body::full(Bytes::from(page)));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            resp
        }
        Endpoint::AdminTargets => json(StatusCode::OK, &targets(&app.snapshot.load())),
        Endpoint::AdminExplain => {
            let snapshot = app.snapshot.load_full();
            let (parts, incoming) = req.into_parts();
            let protocol = explained_protocol(parts.uri.query());
            match json_body(&parts.headers, incoming).await {
                Ok(bytes) => match protocol {
                    Some(protocol) => {
                        let asked = Asked {
                            protocol,
                            headers: &parts.headers,
                            body: &bytes,
                        };
                        explain(&snapshot, &app.responses, &asked, &request_id)
                    }
                    None => respond::plain_error(
                        &GatewayError::bad_request(
                            "`protocol` must be chat, messages or responses",
                        ),
                        &request_id,
                    ),
                },
                Err(e) => respond::plain_error(&e, &request_id),
            }
        }
    }
}

/// What a path serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    /// Served by the proxy, in the endpoint's protocol.
    Proxied(Api),
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// `GET` / `DELETE /v1/responses/{id}`.
    StoredResponse,
    /// `GET /v1/models`.
    Models,
    /// `GET /v1/models/{id}`.
    Model,
    /// `GET /healthz`.
    Healthz,
    /// `GET /readyz`.
    Readyz,
    /// `GET /metrics`.
    Metrics,
    /// `GET /admin/targets`.
    AdminTargets,
    /// `POST /admin/explain`.
    AdminExplain,
}

impl Endpoint {
    /// Whether the admin listener serves it too (health, metrics, admin).
    fn on_admin_listener(self) -> bool {
        match self {
            Endpoint::Healthz
            | Endpoint::Readyz
            | Endpoint::Metrics
            | Endpoint::AdminTargets
            | Endpoint::AdminExplain => true,
            Endpoint::Proxied(_)
            | Endpoint::CountTokens
            | Endpoint::StoredResponse
            | Endpoint::Models
            | Endpoint::Model => false,
        }
    }
}

/// The route table: each path (the OpenAI ones also without `/v1`), the
/// methods it answers, and its endpoint. A path ending in `/` is a prefix:
/// what follows is an id.
const ROUTES: [(&str, Methods, Endpoint); 19] = [
    ("/v1/chat/completions", POST, Endpoint::Proxied(Api::Chat)),
    ("/chat/completions", POST, Endpoint::Proxied(Api::Chat)),
    ("/v1/messages", POST, Endpoint::Proxied(Api::Messages)),
    ("/v1/messages/count_tokens", POST, Endpoint::CountTokens),
    ("/v1/responses", POST, Endpoint::Proxied(Api::Responses)),
    ("/responses", POST, Endpoint::Proxied(Api::Responses)),
    ("/v1/responses/", GET_DELETE, Endpoint::StoredResponse),
    ("/responses/", GET_DELETE, Endpoint::StoredResponse),
    ("/v1/embeddings", POST, Endpoint::Proxied(Api::Embeddings)),
    ("/embeddings", POST, Endpoint::Proxied(Api::Embeddings)),
    ("/v1/models", GET, Endpoint::Models),
    ("/models", GET, Endpoint::Models),
    ("/v1/models/", GET, Endpoint::Model),
    ("/models/", GET, Endpoint::Model),
    ("/healthz", GET, Endpoint::Healthz),
    ("/readyz", GET, Endpoint::Readyz),
    ("/metrics", GET, Endpoint::Metrics),
    ("/admin/targets", GET, Endpoint::AdminTargets),
    ("/admin/explain", POST, Endpoint::AdminExplain),
];

/// The methods a path answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Methods {
    Post,
    Get,
    GetDelete,
}
const POST: Methods = Methods::Post;
const GET: Methods = Methods::Get;
const GET_DELETE: Methods = Methods::GetDelete;

/// The endpoint of `path`, or 405 when it answers another method; `None`
/// for no such path.
fn route(method: &Method, path: &str) -> Option<Result<Endpoint, GatewayError>> {
    let (_, methods, endpoint) =
        ROUTES
            .iter()
            .find(|(at, _, endpoint)| match at.strip_suffix('/') {
                Some(_) => path.strip_prefix(at).is_some_and(|id| {
                    // A model's id may hold slashes (`org/model`); a response's is one segment.
                    !id.is_empty() && (*endpoint == Endpoint::Model || !id.contains('/'))
                }),
                None => path == *at,
            })?;
    Some(allowed(method, *methods, *endpoint))
}

fn allowed(
    method: &Method,
    methods: Methods,
    endpoint: Endpoint,
) -> Result<Endpoint, GatewayError> {
    let (ok, allow) = match methods {
        Methods::Post => (method == Method::POST, "POST"),
        Methods::Get => (method == Method::GET, "GET"),
        Methods::GetDelete => (
            method == Method::GET || method == Method::DELETE,
            "GET, DELETE",
        ),
    };
    if ok {
        Ok(endpoint)
    } else {
        Err(GatewayError::MethodNotAllowed(allow))
    }
}

/// The endpoints served by the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/messages` (Anthropic Messages, translated).
    Messages,
    /// `POST /v1/responses` (OpenAI Responses, translated).
    Responses,
    /// `POST /v1/embeddings`.
    Embeddings,
}

impl Api {
    /// The protocol its clients speak.
    fn protocol(self) -> Protocol {
        match self {
            Api::Chat | Api::Embeddings => Protocol::Chat,
            Api::Messages => Protocol::Messages,
            Api::Responses => Protocol::Responses,
        }
    }
}

/// A proxied request: a slot of the concurrency cap, the body, then the
/// proxy, told the client's address `peer`. The slot is held until the
/// response body ends (a stream keeps it).
async fn proxied(
    app: &App,
    api: Api,
    req: Request<Incoming>,
    peer: std::net::IpAddr,
    request_id: HeaderValue,
    arrival: Instant,
) -> Response<Body> {
    let snapshot = app.snapshot.load_full();
    let span = tracing::info_span!("request", request_id = %request_id.to_str().unwrap_or("-"),
        trace_id = tracing::field::Empty);
    let trace = RequestTrace::start(
        req.headers(),
        &request_id,
        arrival,
        snapshot.access_log,
        span,
    );
    let protocol = api.protocol();
    if protocol != Protocol::Chat {
        trace.protocol(protocol.as_str());
    }
    let rejected = |e: &GatewayError, request_id: &HeaderValue| {
        snapshot.unrouted.increment(e.status().as_u16(), 1);
        trace.status(e.status().as_u16());
        trace.error(e.code());
        plain_error_in(protocol, e, request_id)
    };
    let (parts, incoming) = req.into_parts();
    let bytes = match json_body(&parts.headers, incoming).await {
        Ok(bytes) => bytes,
        Err(e) => return rejected(&e, &request_id),
    };
    // The cap counts requests at work, not bodies still arriving: slow
    // uploads cannot hold every slot (each is bounded by the body timeout).
    let Ok(permit) = Arc::clone(&app.inflight).try_acquire_owned() else {
        return rejected(&GatewayError::Overloaded, &request_id);
    };
    let (bytes, native, mut translation) = match translated(app, api, bytes).await {
        Ok(translated) => translated,
        Err(mut refusal) => {
            refusal
                .headers_mut()
                .insert(respond::H_REQUEST_ID, request_id.clone());
            snapshot.unrouted.increment(400, 1);
            trace.status(400);
            trace.error("invalid_request");
            return refusal;
        }
    };
    let (log_span, server_span) = (trace.log_span().clone(), trace.span().clone());
    let exchange = proxy::Exchange {
        snapshot: Arc::clone(&snapshot),
        headers: &parts.headers,
        peer,
        body: bytes,
        native,
        render: translation
            .as_mut()
            .filter(|t| t.stream)
            .and_then(|t| t.render.take_stream()),
        request_id,
        arrival,
        trace: trace.clone(),
        drain: &app.drain,
    };
    // The server span innermost: routing and the attempts record into it,
    // and log lines still find the request's id further out.
    let response = match api {
        Api::Chat | Api::Messages | Api::Responses => {
            proxy::chat_completions(exchange)
                .instrument(server_span)
                .instrument(log_span)
                .await
        }
        Api::Embeddings => {
            proxy::embeddings(exchange)
                .instrument(server_span)
                .instrument(log_span)
                .await
        }
    };
    trace.status(response.status().as_u16());
    let response = match translation {
        Some(t) => inbound::render(response, t.render).await,
        None => response,
    };
    response.map(|inner| body::holding(inner, permit))
}

/// A Messages or Responses request's side of the exchange.
struct Translation {
    /// How its answer goes back.
    render: inbound::Render,
    /// It asked for a stream.
    stream: bool,
}

/// The body as sent, and for a Messages or Responses request read by its
/// front door (or refused with its 400, in its protocol) its own body for
/// the engine (with its chat translation, written when read) and its
/// [`Translation`]; chat and embeddings as they came.
#[allow(clippy::result_large_err)] // the refusal is the response itself
async fn translated(
    app: &App,
    api: Api,
    bytes: Bytes,
) -> Result<(Bytes, Option<native::Body>, Option<Translation>), Response<Body>> {
    let refused = |bytes: Bytes| {
        let mut resp = json_bytes(StatusCode::BAD_REQUEST, bytes);
        resp.headers_mut()
            .insert(respond::H_SHOULD_RETRY, HeaderValue::from_static("false"));
        resp
    };
    let t = match api {
        Api::Chat | Api::Embeddings => return Ok((bytes, None, None)),
        Api::Messages => inbound::messages::translate(&bytes)
            .map_err(|e| refused(inbound::messages::invalid(&e)))?,
        Api::Responses => {
            let previous = app
                .responses
                .is_shared()
                .then(|| inbound::responses::previous_response_id(&bytes));
            if let Some(id) = previous.flatten() {
                // Another replica's response, if this one does not have it.
                app.responses.fetch(&id).await;
            }
            inbound::responses::translate(&bytes, &app.responses)
                .map_err(|e| refused(inbound::responses::invalid(&e)))?
        }
    };
    let native = native::Body {
        protocol: api.protocol(),
        bytes: t.native.unwrap_or_else(|| bytes.clone()),
        untranslatable: t.untranslatable,
        model_at: t.model_at,
        facts: t.facts,
        chat: t.chat,
    };
    let translation = Translation {
        render: t.render,
        stream: t.stream,
    };
    Ok((bytes, Some(native), Some(translation)))
}

/// switchyard's own error in the client's protocol.
fn plain_error_in(
    protocol: Protocol,
    e: &GatewayError,
    request_id: &HeaderValue,
) -> Response<Body> {
    let mut resp = respond::plain_error(e, request_id);
    match protocol {
        Protocol::Messages => {
            *resp.body_mut() = body::full(inbound::messages::error(e.status(), &e.body()));
        }
        Protocol::Chat | Protocol::Responses => {}
    }
    resp
}

/// `POST /v1/messages/count_tokens`: the count of the task's Anthropic
/// target when one answers, else switchyard's estimate of the prompt
/// (`x-switchyard-token-count: estimate`), in Anthropic's shape.
async fn count_tokens(
    app: &App,
    req: Request<Incoming>,
    request_id: &HeaderValue,
) -> Response<Body> {
    let (parts, incoming) = req.into_parts();
    let bytes = match json_body(&parts.headers, incoming).await {
        Ok(bytes) => bytes,
        Err(e) => return plain_error_in(Protocol::Messages, &e, request_id),
    };
    let chat = match inbound::messages::count_request(&bytes) {
        Ok(chat) => chat,
        Err(e) => return json_bytes(StatusCode::BAD_REQUEST, inbound::messages::invalid(&e)),
    };
    let request = match ChatRequest::parse(&chat) {
        Ok(request) => request,
        Err(e) => {
            let e = inbound::Invalid {
                param: e.param.map(|p| p.into_owned()).unwrap_or_default(),
                message: e.message,
                code: None,
            };
            return json_bytes(StatusCode::BAD_REQUEST, inbound::messages::invalid(&e));
        }
    };
    let snapshot = app.snapshot.load();
    let task_header = respond::task_header(&parts.headers);
    let Some(task) = snapshot.route(task_header, request.model.as_deref()) else {
        // As `/v1/messages` answers the same body.
        let e = match task_header.or(request.model.as_deref()) {
            Some(asked) => GatewayError::UnknownModel(asked.chars().take(128).collect()),
            None => GatewayError::bad_request("`model` is required (or an `x-task-type` header)"),
        };
        return plain_error_in(Protocol::Messages, &e, request_id);
    };
    let counted = match inbound::count::at_provider(task, &parts.headers, &bytes, request_id).await
    {
        Some(inbound::count::Said::Refused(status, body)) => {
            let mut resp = json_bytes(status, body);
            resp.headers_mut()
                .insert(respond::H_REQUEST_ID, request_id.clone());
            return resp;
        }
        Some(inbound::count::Said::Counted(counted)) => Some(counted),
        None => None,
    };
    let (tokens, source) = match &counted {
        Some(c) => (c.tokens, "provider"),
        None => (request.prompt_tokens, "estimate"),
    };
    let mut resp = json(StatusCode::OK, &serde_json::json!({"input_tokens": tokens}));
    resp.headers_mut()
        .insert(H_TOKEN_COUNT, HeaderValue::from_static(source));
    if let Some(name) = counted.and_then(|c| HeaderValue::try_from(c.target).ok()) {
        resp.headers_mut().insert(respond::H_TARGET, name);
    }
    resp.headers_mut()
        .insert(respond::H_REQUEST_ID, request_id.clone());
    resp
}

/// Says where a `count_tokens` answer came from.
const H_TOKEN_COUNT: &str = "x-switchyard-token-count";

/// `GET` / `DELETE /v1/responses/{id}`, from the response store.
async fn stored_response(
    app: &App,
    method: &Method,
    path: &str,
    request_id: &HeaderValue,
) -> Response<Body> {
    let id = path.rsplit('/').next().unwrap_or_default();
    let found = match app.responses.fetch(id).await {
        Some(_) if method == Method::DELETE => {
            app.responses.delete(id).await;
            let deleted = serde_json::json!({"id": id, "object": "response", "deleted": true});
            Some(Bytes::from(deleted.to_string()))
        }
        Some(stored) => Some(Bytes::copy_from_slice(stored.response.get().as_bytes())),
        None => None,
    };
    let mut resp = match found {
        Some(bytes) => json_bytes(StatusCode::OK, bytes),
        None => {
            let mut resp = json(
                StatusCode::NOT_FOUND,
                &serde_json::json!({"error": {
                    "message": format!("No response found with id '{}'.", id.chars().take(100).collect::<String>()),
                    "type": "invalid_request_error", "param": null, "code": "not_found"}}),
            );
            // As every other 404: asking again will not find it.
            resp.headers_mut()
                .insert(respond::H_SHOULD_RETRY, HeaderValue::from_static("false"));
            resp
        }
    };
    resp.headers_mut()
        .insert(respond::H_REQUEST_ID, request_id.clone());
    resp
}

/// Reads a JSON request body ([`read_body`]) after checking its media type:
/// `application/json` with any parameters (a charset, say), a structured
/// `application/*+json` type, or no `Content-Type` at all (curl and some
/// clients send none) are read; anything else is 415, unread.
async fn json_body(headers: &http::HeaderMap, incoming: Incoming) -> Result<Bytes, GatewayError> {
    if let Some(value) = headers.get(CONTENT_TYPE) {
        let text = String::from_utf8_lossy(value.as_bytes());
        if !is_json_media_type(&text) {
            return Err(GatewayError::UnsupportedMediaType(
                text.chars().take(100).collect(),
            ));
        }
    }
    read_body(headers, incoming).await
}

/// Whether a `Content-Type` value names JSON: `application/json` or
/// `application/SUBTYPE+json`, case-insensitive, parameters ignored.
fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or_default().trim();
    // Compared without case and without a lowercased copy.
    let Some(subtype) = essence
        .get(..12)
        .filter(|p| p.eq_ignore_ascii_case("application/"))
        .and_then(|_| essence.get(12..))
    else {
        return false;
    };
    if subtype.eq_ignore_ascii_case("json") {
        return true;
    }
    let cut = subtype.len().saturating_sub(5);
    match (subtype.get(..cut), subtype.get(cut..)) {
        (Some(name), Some(suffix)) if suffix.eq_ignore_ascii_case("+json") => {
            !name.is_empty() && !name.contains('/')
        }
        (Some(_) | None, Some(_) | None) => false,
    }
}

/// Reads a request body: at most [`MAX_BODY_BYTES`] (refused early on a
/// larger `Content-Length`), within [`BODY_READ_TIMEOUT`].
async fn read_body(
    headers: &http::HeaderMap,
    mut incoming: Incoming,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        discard(&mut incoming, declared).await;
        return Err(GatewayError::PayloadTooLarge(MAX_BODY_BYTES));
    }
    let read = body::read_all(&mut incoming, MAX_BODY_BYTES);
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, read)
        .await
        .map_err(|_| GatewayError::BodyTimeout(BODY_READ_TIMEOUT))?;
    match read {
        Ok(bytes) => Ok(bytes),
        Err(body::ReadError::TooLarge) => {
            discard(&mut incoming, declared).await;
            Err(GatewayError::PayloadTooLarge(MAX_BODY_BYTES))
        }
        // hyper's only body errors are the connection's: the client went away
        // (or broke the framing, which no one is left to hear about either).
        Err(body::ReadError::Body(_)) => Err(GatewayError::ClientGone),
    }
}

/// The most of an oversized body read and thrown away, so that a client
/// still sending it gets to read its 413 rather than a broken pipe (hyper
/// closes a connection whose request body is left unread).
const MAX_DISCARDED_BYTES: u64 = 64 << 20;

/// Reads the rest of a body that will not be used, up to
/// [`MAX_DISCARDED_BYTES`] and within [`BODY_READ_TIMEOUT`].
async fn discard(incoming: &mut Incoming, declared: Option<u64>) {
    use http_body_util::BodyExt as _;
    if declared.is_some_and(|n| n > MAX_DISCARDED_BYTES) {
        return;
    }
    let drained = async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = incoming.frame().await {
            seen += frame.data_ref().map_or(0, |d| d.len() as u64);
            if seen > MAX_DISCARDED_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(BODY_READ_TIMEOUT, drained).await;
}

/// `?protocol=` of `/admin/explain`: whose body it is (chat when absent).
fn explained_protocol(query: Option<&str>) -> Option<Protocol> {
    let asked = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("protocol="));
    match asked {
        None | Some("chat") => Some(Protocol::Chat),
        Some("messages") => Some(Protocol::Messages),
        Some("responses") => Some(Protocol::Responses),
        Some(_) => None,
    }
}

/// A request body `/admin/explain` is asked about.
struct Asked<'a> {
    protocol: Protocol,
    headers: &'a http::HeaderMap,
    body: &'a [u8],
}

/// `POST /admin/explain`: the routing plan for a request body of any front
/// door's protocol, against the live health of its targets. A target that
/// cannot express the request (a server tool towards another protocol) is
/// `held_back` with reason `protocol`, as the walk would skip it.
fn explain(
    s: &Snapshot,
    store: &inbound::ResponseStore,
    asked: &Asked<'_>,
    request_id: &HeaderValue,
) -> Response<Body> {
    let (chat, untranslatable) = match asked.protocol {
        Protocol::Chat => (Bytes::copy_from_slice(asked.body), None),
        Protocol::Messages => match inbound::messages::translate(asked.body) {
            Ok(t) => (t.chat.bytes().clone(), t.untranslatable),
            Err(e) => return json_bytes(StatusCode::BAD_REQUEST, inbound::messages::invalid(&e)),
        },
        Protocol::Responses => match inbound::responses::translate(asked.body, store) {
            Ok(t) => (t.chat.bytes().clone(), t.untranslatable),
            Err(e) => return json_bytes(StatusCode::BAD_REQUEST, inbound::responses::invalid(&e)),
        },
    };
    let request = match ChatRequest::parse(&chat) {
        Ok(r) => r,
        Err(e) => {
            let e = GatewayError::BadRequest {
                message: e.message,
                param: e.param,
            };
            return respond::plain_error(&e, request_id);
        }
    };
    let task_header = respond::task_header(asked.headers);
    let model = request.model.as_deref();
    let Some(task) = s.route(task_header, model) else {
        let asked = task_header.or(model).unwrap_or("(none)");
        return respond::plain_error(
            &GatewayError::UnknownModel(asked.chars().take(128).collect()),
            request_id,
        );
    };
    let needs = crate::routing::Needs::of(&request.facts());
    let plan = crate::routing::plan(task, &needs, Instant::now());
    let mut v = plan.to_json(task, &needs);
    if let (Some(why), Some(candidates)) = (untranslatable, v["candidates"].as_array_mut()) {
        for c in candidates {
            let speaks = c["target"]
                .as_str()
                .and_then(|name| s.targets.get(name))
                .is_some_and(|t| t.provider.endpoint.native_protocol() == Some(asked.protocol));
            if !speaks {
                c["held_back"] = serde_json::json!({"reason": "protocol", "detail": why.why});
            }
        }
    }
    json(StatusCode::OK, &v)
}

fn new_request_id() -> HeaderValue {
    // 32 lowercase hex digits, written in place (one allocation: the value's own).
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = [0u8; 32];
    let mut n = rand::random::<u128>();
    for digit in id.iter_mut().rev() {
        *digit = HEX[(n & 0xf) as usize];
        n >>= 4;
    }
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    json_bytes(status, Bytes::from(v.to_string()))
}

fn json_bytes(status: StatusCode, bytes: Bytes) -> Response<Body> {
    let mut resp = Response::new(body::full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn models(s: &Snapshot) -> serde_json::Value {
    let mut data = Vec::new();
    for task in s.tasks.values() {
        for id in std::iter::once(&task.name).chain(&task.aliases) {
            data.push(model_object(id, &task.name));
        }
    }
    serde_json::json!({"object": "list", "data": data})
}

/// The model id of a `GET /v1/models/{id}` (or `/models/{id}`) path,
/// percent-decoded (an SDK escapes what a path cannot hold).
fn model_id(path: &str) -> Option<String> {
    let raw = path
        .strip_prefix("/v1/models/")
        .or_else(|| path.strip_prefix("/models/"))
        .filter(|id| !id.is_empty())?;
    Some(percent_decode(raw))
}

/// `%XX` escapes decoded; a malformed escape is kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The OpenAI model object of a task name or alias, as `/v1/models` lists it.
fn model_object(id: &str, task: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id, "object": "model", "created": 0, "owned_by": "switchyard", "task": task,
    })
}

/// `GET /v1/models/{id}`: the model object of a task name or alias, else 404.
fn model(s: &Snapshot, id: &str, request_id: &HeaderValue) -> Response<Body> {
    match s.models.get(id) {
        Some(task) => json(StatusCode::OK, &model_object(id, &task.name)),
        None => respond::plain_error(
            &GatewayError::UnknownModel(id.chars().take(128).collect()),
            request_id,
        ),
    }
}

/// The tasks, targets and keys `s` names: only their gauges are on `/metrics`.
fn named(s: &Snapshot) -> crate::metrics::Named {
    crate::metrics::Named {
        tasks: s.tasks.keys().cloned().collect(),
        targets: s.targets.keys().cloned().collect(),
        keys: s
            .providers
            .iter()
            .flat_map(|(p, provider)| provider.keys.iter().map(|k| (p.clone(), k.name.clone())))
            .collect(),
    }
}

/// `switchyard_task_targets_available{task}`: what `/readyz` judges, as a
/// gauge an alert can watch (set when scraped, so it is always current);
/// and the size of each task's cache.
fn publish_availability(s: &Snapshot) {
    let now = Instant::now();
    for task in s.tasks.values() {
        let up = task
            .chain
            .iter()
            .filter(|target| target.available(now))
            .count();
        s.metrics
            .gauge(
                crate::metrics::TASK_TARGETS_AVAILABLE,
                &[("task", task.name.clone().into())],
            )
            .set(up as f64);
        if let Some(cache) = &task.cache {
            cache.publish();
        }
    }
}

fn readiness(s: &Snapshot) -> Response<Body> {
    let now = Instant::now();
    let unroutable: Vec<&str> = s
        .tasks
        .values()
        .filter(|t| t.chain.iter().all(|target| !target.available(now)))
        .map(|t| t.name.as_str())
        .collect();
    if unroutable.is_empty() {
        json(
            StatusCode::OK,
            &serde_json::json!({"status": "ready", "config_hash": format!("{:016x}", s.hash)}),
        )
    } else {
        json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({"status": "not_ready", "tasks_without_target": unroutable}),
        )
    }
}

fn targets(s: &Snapshot) -> serde_json::Value {
    let now = Instant::now();
    let list: Vec<serde_json::Value> = s
        .targets
        .values()
        .map(|t| {
            let v = t.health.view(now, &s.health);
            let keys: Vec<serde_json::Value> = t
                .provider
                .keys
                .iter()
                .map(|k| key_view(k, &t.model, now))
                .collect();
            serde_json::json!({
                "target": t.name,
                "provider": t.provider.name,
                "model": t.model,
                "state": v.state.as_str(),
                "consecutive_failures": v.consecutive_failures,
                "last_error_class": v.last_class.as_deref(),
                "window_failure_rate": v.window_failure_rate,
                "window_requests": v.window_requests,
                "seconds_since_change": v.since_change.as_secs_f64(),
                "next_trial_in_seconds": v.next_trial_in.map(|d| d.as_secs_f64()),
                "cooldown_seconds_left": v.cooldown_left.map(|d| d.as_secs_f64()),
                "provider_cooldown_seconds_left": t.provider.health.unavailable(now).map(|u| u.until().saturating_duration_since(now).as_secs_f64()),
                "keys": keys,
            })
        })
        .collect();
    serde_json::json!({"targets": list})
}

/// A key as `/admin/targets` shows it under a target (its state for the
/// target's model): its name and state, never the key.
fn key_view(key: &crate::snapshot::ApiKey, model: &str, now: Instant) -> serde_json::Value {
    let key_state = key.health.state_for(now, model);
    let state = if key.credential.is_none() {
        "unreadable"
    } else {
        key_state.as_str()
    };
    let left = match key_state {
        crate::health::KeyState::CoolingDown(until) => {
            Some(until.saturating_duration_since(now).as_secs_f64())
        }
        crate::health::KeyState::Usable | crate::health::KeyState::Dead => None,
    };
    serde_json::json!({"name": key.name, "state": state, "cooldown_seconds_left": left})
}
