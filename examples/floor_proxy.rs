//! The floor switchyard is measured against: the minimal reverse proxy a
//! tokio + hyper user would write. Every request (method, path, headers,
//! body streamed through) goes to one upstream over hyper-util's pooled
//! legacy `Client` (HTTP/1.1 keep-alive); the answer comes back as it
//! arrives (status, headers, body frames one by one). No parsing, no
//! buffering, no routing: what is left is the cost of tokio, hyper and the
//! kernel, which `examples/bench/run.sh` subtracts from switchyard's.
//!
//! ```text
//! cargo run --release --example floor_proxy -- \
//!     --listen 127.0.0.1:9100 --upstream http://127.0.0.1:9001 --runtime per-core
//! ```
//!
//! `--runtime multi`: one multi-thread (work-stealing) runtime, one listener.
//! `--runtime per-core` (default): `--threads` (default: one per core)
//! `current_thread` runtimes, each on its own thread with its own listener on
//! the same port (`SO_REUSEPORT`: the kernel spreads connections) and its own
//! upstream client, so a request and its upstream call stay on one thread.
//! It prints `listening on ADDR` once every listener accepts.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::time::Duration;

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http::header::{self, HeaderMap};
use http::uri::{Authority, Scheme, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpSocket};

type BoxError = Box<dyn Error + Send + Sync>;
/// The upstream client: request bodies are the client's own, streamed through.
type Upstream = Client<HttpConnector, Incoming>;
/// The upstream's body as it comes, or a short error of our own.
type Answer = Response<Either<Incoming, Full<Bytes>>>;

#[derive(Parser, Debug)]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long)]
    listen: SocketAddr,
    /// The upstream, `http://HOST:PORT`; request paths are kept.
    #[arg(long)]
    upstream: Uri,
    #[arg(long, value_enum, default_value_t = Model::PerCore)]
    runtime: Model,
    /// Worker threads (both models); default: the number of cores.
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Model {
    Multi,
    PerCore,
}

/// Where requests go: the upstream's scheme and authority.
#[derive(Clone)]
struct Target {
    scheme: Scheme,
    authority: Authority,
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let parts = args.upstream.clone().into_parts();
    let target = Target {
        scheme: parts.scheme.unwrap_or(Scheme::HTTP),
        authority: parts
            .authority
            .ok_or("--upstream needs a host: http://HOST:PORT")?,
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    match args.runtime {
        Model::Multi => multi(args.listen, target, threads),
        Model::PerCore => per_core(args.listen, target, threads),
    }
}

/// One work-stealing runtime; connections and upstream calls go anywhere.
fn multi(listen: SocketAddr, target: Target, threads: usize) -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(listen).await?;
        println!("listening on {}", listener.local_addr()?);
        serve(listener, upstream(), target).await;
        Ok(())
    })
}

/// `threads` single-threaded runtimes, each accepting on a listener of its own.
fn per_core(listen: SocketAddr, target: Target, threads: usize) -> Result<(), BoxError> {
    // Bind every socket here, so port 0 resolves once and all share it.
    let first = reuseport_socket(listen)?;
    let addr = first.local_addr()?;
    let mut sockets = vec![first];
    for _ in 1..threads {
        sockets.push(reuseport_socket(addr)?);
    }
    // Each worker reports once its listener accepts (or why it could not).
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for (i, socket) in sockets.into_iter().enumerate() {
        let (target, ready_tx) = (target.clone(), ready_tx.clone());
        let thread = std::thread::Builder::new().name(format!("floor-{i}"));
        handles.push(thread.spawn(move || worker(socket, target, ready_tx))?);
    }
    drop(ready_tx);
    for _ in 0..threads {
        ready.recv()??;
    }
    println!("listening on {addr}");
    for handle in handles {
        handle.join().map_err(|_| "a worker thread panicked")?;
    }
    Ok(())
}

/// One worker thread: its own runtime, listener and upstream client.
fn worker(socket: TcpSocket, target: Target, ready: Sender<std::io::Result<()>>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return drop(ready.send(Err(e))),
    };
    runtime.block_on(async move {
        // `listen` registers the socket with this thread's runtime: it runs here.
        let listener = match socket.listen(4096) {
            Ok(listener) => listener,
            Err(e) => return drop(ready.send(Err(e))),
        };
        let _ = ready.send(Ok(()));
        serve(listener, upstream(), target).await;
    });
}

/// A bound (not yet listening) socket with `SO_REUSEPORT` set.
fn reuseport_socket(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// A pooled HTTP/1.1 keep-alive client (`TokioExecutor` spawns its
/// connection tasks on the runtime that calls it).
fn upstream() -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// Accepts connections and serves each on a task of the calling runtime.
async fn serve(listener: TcpListener, client: Upstream, target: Target) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait rather than spin.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (client, target) = (client.clone(), target.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| proxy(client.clone(), target.clone(), req));
            // Errors here are clients going away mid-request: nothing to do.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Forwards one request and hands back the upstream's answer as it streams.
async fn proxy(
    client: Upstream,
    target: Target,
    req: Request<Incoming>,
) -> Result<Answer, BoxError> {
    let (mut head, body) = req.into_parts();
    let mut uri = std::mem::take(&mut head.uri).into_parts();
    uri.scheme = Some(target.scheme);
    uri.authority = Some(target.authority);
    head.uri = Uri::from_parts(uri)?;
    strip_hop_by_hop(&mut head.headers);
    match client.request(Request::from_parts(head, body)).await {
        Ok(answer) => {
            let (mut head, body) = answer.into_parts();
            strip_hop_by_hop(&mut head.headers);
            Ok(Response::from_parts(head, Either::Left(body)))
        }
        Err(e) => {
            eprintln!("upstream: {e}");
            let mut answer = Response::new(Either::Right(Full::from("upstream unreachable\n")));
            *answer.status_mut() = StatusCode::BAD_GATEWAY;
            Ok(answer)
        }
    }
}

/// Headers of one connection, not of the message (RFC 9110 section 7.6.1):
/// each hop sets its own. (A full proxy also drops the headers `Connection`
/// names; nothing the benchmark sends names any.)
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}
