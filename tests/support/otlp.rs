//! An in-process OTLP trace collector on 127.0.0.1: OTLP/HTTP
//! (`POST /v1/traces`, protobuf) and OTLP/gRPC (`TraceService/Export`,
//! h2c) on one port, decoded with the opentelemetry-proto crate into
//! [`Span`]s a test can look through. Plus [`BlackHole`], a collector that
//! accepts connections and never answers.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use parking_lot::Mutex;
use prost::Message;
use tokio::net::TcpListener;

/// OTLP span kinds (the proto's numbering).
pub const KIND_SERVER: i32 = 2;
pub const KIND_CLIENT: i32 = 3;
/// OTLP status code of a failed span.
pub const STATUS_ERROR: i32 = 2;

/// One exported span, flattened: ids as lowercase hex, attributes as JSON.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    pub kind: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: BTreeMap<String, serde_json::Value>,
    pub events: Vec<(String, BTreeMap<String, serde_json::Value>)>,
    pub status_code: i32,
    /// The resource's attributes (`service.name`, ...).
    pub resource: BTreeMap<String, serde_json::Value>,
    /// How it arrived: `http` or `grpc`.
    pub via: &'static str,
}

impl Span {
    /// An attribute, `Null` when absent.
    pub fn attr(&self, key: &str) -> serde_json::Value {
        self.attrs
            .get(key)
            .cloned()
            .unwrap_or(serde_json::Value::Null)
    }

    /// A string attribute, "" when absent.
    pub fn text(&self, key: &str) -> String {
        self.attr(key).as_str().unwrap_or_default().to_owned()
    }

    /// The events named `name`.
    pub fn events_named(&self, name: &str) -> Vec<&BTreeMap<String, serde_json::Value>> {
        self.events
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, a)| a)
            .collect()
    }
}

/// A running collector; stops when dropped.
pub struct Collector {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&spans);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| receive(Arc::clone(&s), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Collector { addr, spans, task }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().clone()
    }

    /// The spans of the trace whose server span has `switchyard.request_id`
    /// = `request_id`, once it and at least `children` spans under it have
    /// arrived (bounded by 10 s).
    pub async fn trace_of(&self, request_id: &str, children: usize) -> Trace {
        let mut found = None;
        super::eventually(Duration::from_secs(10), || {
            found = Trace::find(&self.spans(), request_id).filter(|t| t.attempts.len() >= children);
            std::future::ready(found.is_some())
        })
        .await;
        found.unwrap_or_else(|| {
            panic!(
                "no trace for request {request_id} with {children} attempt spans; got {:#?}",
                self.spans()
            )
        })
    }
}

/// One request's spans: its server span and the attempt spans under it, in order.
#[derive(Debug, Clone)]
pub struct Trace {
    pub server: Span,
    pub attempts: Vec<Span>,
}

impl Trace {
    fn find(spans: &[Span], request_id: &str) -> Option<Trace> {
        let server = spans
            .iter()
            .find(|s| s.text("switchyard.request_id") == request_id)?
            .clone();
        let mut attempts: Vec<Span> = spans
            .iter()
            .filter(|s| s.parent_span_id == server.span_id && s.trace_id == server.trace_id)
            .cloned()
            .collect();
        attempts.sort_by_key(|s| s.attr("switchyard.attempt").as_i64());
        Some(Trace { server, attempts })
    }
}

type Reply = Response<
    StreamBody<
        futures_util::stream::Iter<
            std::vec::IntoIter<Result<Frame<Bytes>, std::convert::Infallible>>,
        >,
    >,
>;

async fn receive(
    spans: Arc<Mutex<Vec<Span>>>,
    req: Request<Incoming>,
) -> Result<Reply, std::convert::Infallible> {
    let grpc = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let path = req.uri().path().to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let (message, via) = if grpc {
        // One length-prefixed message: a compression flag, a 4-byte length.
        (
            body.get(5..)
                .map(Bytes::copy_from_slice)
                .unwrap_or_default(),
            "grpc",
        )
    } else {
        (body, "http")
    };
    let ok = path.ends_with("/v1/traces") || path.ends_with("TraceService/Export");
    match ExportTraceServiceRequest::decode(message) {
        Ok(export) if ok => spans.lock().extend(flatten(&export, via)),
        Ok(_) | Err(_) => return Ok(answer(StatusCode::BAD_REQUEST, grpc)),
    }
    Ok(answer(StatusCode::OK, grpc))
}

/// An empty export response: protobuf for HTTP, a framed message plus
/// `grpc-status` trailers for gRPC.
fn answer(status: StatusCode, grpc: bool) -> Reply {
    let frames = if grpc {
        let mut trailers = http::HeaderMap::new();
        let code = if status.is_success() { "0" } else { "3" };
        trailers.insert("grpc-status", code.parse().unwrap());
        vec![
            Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
            Ok(Frame::trailers(trailers)),
        ]
    } else {
        vec![Ok(Frame::data(Bytes::new()))]
    };
    let mut resp = Response::new(StreamBody::new(futures_util::stream::iter(frames)));
    if grpc {
        resp.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
    } else {
        *resp.status_mut() = status;
        resp.headers_mut()
            .insert("content-type", "application/x-protobuf".parse().unwrap());
    }
    resp
}

fn flatten(export: &ExportTraceServiceRequest, via: &'static str) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in &export.resource_spans {
        let resource = rs
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        for ss in &rs.scope_spans {
            for s in &ss.spans {
                out.push(Span {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name.clone(),
                    kind: s.kind,
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                    attrs: attributes(&s.attributes),
                    events: s
                        .events
                        .iter()
                        .map(|e| (e.name.clone(), attributes(&e.attributes)))
                        .collect(),
                    status_code: s.status.as_ref().map_or(0, |st| st.code),
                    resource: resource.clone(),
                    via,
                });
            }
        }
    }
    out
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, serde_json::Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value(kv.value.as_ref())))
        .collect()
}

fn value(v: Option<&AnyValue>) -> serde_json::Value {
    use serde_json::Value as J;
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => J::from(s.clone()),
        Some(any_value::Value::BoolValue(b)) => J::from(*b),
        Some(any_value::Value::IntValue(i)) => J::from(*i),
        Some(any_value::Value::DoubleValue(d)) => J::from(*d),
        Some(any_value::Value::ArrayValue(a)) => {
            J::Array(a.values.iter().map(|v| value(Some(v))).collect())
        }
        Some(
            any_value::Value::KvlistValue(_)
            | any_value::Value::BytesValue(_)
            | any_value::Value::StringValueStrindex(_),
        )
        | None => J::Null,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A collector that accepts connections and never answers (nor closes them).
pub struct BlackHole {
    pub addr: SocketAddr,
    pub accepted: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl BlackHole {
    pub async fn start() -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(stream);
            }
        });
        BlackHole {
            addr,
            accepted,
            task,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}
