//! The OTLP trace pipeline: which collector, how, and the exporter's
//! lifecycle.
//!
//! Export is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `telemetry.traces.endpoint` is set, and
//! off with `OTEL_SDK_DISABLED=true` or an `OTEL_TRACES_EXPORTER` other than
//! `otlp`. The standard variables win over the file's keys (a deployment can
//! redirect traces without editing routes.yaml); every other `OTEL_*`
//! variable the SDK reads (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_*`,
//! `OTEL_TRACES_SAMPLER`, `OTEL_RESOURCE_ATTRIBUTES`, ...) works as documented.
//!
//! Spans are batched by the SDK's `BatchSpanProcessor` on its own thread: a
//! request only hands a finished span to a bounded queue. [`Gate`] bounds
//! that queue itself so that an overflow (a collector down or slow) is
//! dropped *and counted* here; the SDK's own drop count is not readable.
//! OTLP/HTTP goes through [`Transport`], a hyper client whose calls run on
//! the gateway's runtime (the batch thread has none), with the same rustls
//! stack as the upstream clients.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor, Tracer,
};
use opentelemetry_sdk::Resource;

use super::{Protocol, TraceSettings, EXPORT_FAILURES, SPANS_DROPPED, SPANS_EXPORTED};

/// The exporter's wait for the collector when nothing says otherwise (the OTLP default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Spans queued for export at most when `OTEL_BSP_MAX_QUEUE_SIZE` is unset (the SDK's default).
const DEFAULT_QUEUE: usize = 2048;
/// Longest wait on exit for the last spans to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest collector answer read.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The OTLP exporter refused its configuration (an unparsable endpoint, say).
    #[error("cannot build the OTLP trace exporter: {0}")]
    Build(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The trace export a process runs with, resolved from the environment and the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Wire protocol.
    pub protocol: Protocol,
    /// The endpoint to give the exporter; `None` when an `OTEL_*` variable
    /// names one (the exporter reads it itself).
    pub endpoint: Option<String>,
    /// `service.name`, unless the environment sets it.
    pub service_name: Option<String>,
    /// Per-export timeout.
    pub timeout: Duration,
    /// Spans queued for export at most.
    pub queue: usize,
    /// What in the settings was not understood (logged once at start).
    pub warnings: Vec<String>,
}

/// The export `file` and `env` ask for, if any. `env` reads a variable
/// (`std::env::var` in the binary; a map in tests).
pub fn plan(file: &TraceSettings, env: &dyn Fn(&str) -> Option<String>) -> Option<Plan> {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return None;
    }
    let mut warnings = Vec::new();
    if let Some(exporter) = var("OTEL_TRACES_EXPORTER") {
        match exporter.trim() {
            "otlp" => {}
            "none" => return None,
            other => {
                warnings.push(format!("OTEL_TRACES_EXPORTER={other} is not supported (only `otlp` and `none`); using otlp"));
            }
        }
    }
    let env_endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
        .is_some();
    if !env_endpoint && file.endpoint.is_none() {
        return None;
    }
    let protocol = match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
    {
        Some(text) => Protocol::parse(&text).unwrap_or_else(|| {
            warnings.push(format!(
                "OTLP protocol `{text}` is not supported (http/protobuf or grpc); using http/protobuf"
            ));
            Protocol::HttpProtobuf
        }),
        None => file.protocol.unwrap_or(Protocol::HttpProtobuf),
    };
    let endpoint = match (env_endpoint, &file.endpoint) {
        (true, _) | (false, None) => None,
        (false, Some(base)) => Some(signal_url(base, protocol)),
    };
    let millis = |name: &str| var(name).and_then(|v| v.trim().parse::<u64>().ok());
    let timeout = millis("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
        .or_else(|| millis("OTEL_EXPORTER_OTLP_TIMEOUT"))
        .map(Duration::from_millis)
        .or(file.timeout)
        .unwrap_or(DEFAULT_TIMEOUT);
    let named_by_env = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    let service_name = (!named_by_env).then(|| {
        file.service_name
            .clone()
            .unwrap_or_else(|| "switchyard".to_owned())
    });
    let queue = millis("OTEL_BSP_MAX_QUEUE_SIZE")
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_QUEUE);
    Some(Plan {
        protocol,
        endpoint,
        service_name,
        timeout,
        queue,
        warnings,
    })
}

/// A base URL as OTLP/HTTP wants it (`/v1/traces` appended, as for
/// `OTEL_EXPORTER_OTLP_ENDPOINT`); gRPC takes it as it is.
fn signal_url(base: &str, protocol: Protocol) -> String {
    match protocol {
        Protocol::Grpc => base.to_owned(),
        Protocol::HttpProtobuf if base.ends_with("/v1/traces") => base.to_owned(),
        Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
    }
}

/// The running exporter: the tracer provider whose batch thread sends spans.
#[derive(Debug)]
pub struct Pipeline {
    provider: SdkTracerProvider,
}

impl Pipeline {
    /// Builds the exporter for `plan`. Must run inside the gateway's tokio
    /// runtime: the exporter's connections live there.
    ///
    /// # Errors
    /// The exporter refused its configuration.
    pub fn start(plan: &Plan) -> Result<Self, ExportError> {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let exporter = Counted {
            inner: exporter(plan)?,
            in_flight: Arc::clone(&in_flight),
        };
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(plan.queue)
                    .build(),
            )
            .build();
        let gate = Gate {
            inner: batch,
            in_flight,
            limit: plan.queue,
        };
        let mut resource = Resource::builder()
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
        if let Some(name) = &plan.service_name {
            resource = resource.with_service_name(name.clone());
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(gate)
            .with_resource(resource.build())
            .build();
        super::TRACING_ON.store(true, Ordering::Relaxed);
        Ok(Self { provider })
    }

    /// The tracer the tracing layer records into.
    #[must_use]
    pub fn tracer(&self) -> Tracer {
        self.provider.tracer("switchyard")
    }

    /// Sends what is still queued and stops the exporter, waiting at most a
    /// few seconds (a collector that is down must not hold up an exit).
    /// Blocks: call it off the async runtime's threads.
    pub fn shutdown(self) {
        super::TRACING_ON.store(false, Ordering::Relaxed);
        let _ = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
    }
}

/// The OTLP exporter `plan` names.
fn exporter(plan: &Plan) -> Result<opentelemetry_otlp::SpanExporter, ExportError> {
    let built = match plan.protocol {
        Protocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_http_client(Transport::new(plan.timeout))
                .with_timeout(plan.timeout);
            if let Some(url) = &plan.endpoint {
                b = b.with_endpoint(url.clone());
            }
            b.build()?
        }
        Protocol::Grpc => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                .with_timeout(plan.timeout);
            if let Some(url) = &plan.endpoint {
                b = b.with_endpoint(url.clone());
            }
            b.build()?
        }
    };
    Ok(built)
}

/// The batch processor behind a queue bound of our own: a span that would
/// overflow it is dropped here and counted, never waited for. `in_flight`
/// counts spans queued or being exported, so the SDK's queue (of the same
/// size) never fills and never drops uncounted.
#[derive(Debug)]
struct Gate {
    inner: BatchSpanProcessor,
    in_flight: Arc<AtomicUsize>,
    limit: usize,
}

impl SpanProcessor for Gate {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            // The batch processor ignores these too; they hold no place.
            return;
        }
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= self.limit {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            SPANS_DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what it sent and failed to send, and
/// releasing the spans' places in the [`Gate`] once a batch is done.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    in_flight: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        self.in_flight.fetch_sub(n, Ordering::AcqRel);
        match &result {
            Ok(()) => SPANS_EXPORTED.fetch_add(n as u64, Ordering::Relaxed),
            Err(_) => EXPORT_FAILURES.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// OTLP/HTTP over hyper. The batch thread polls exports without a tokio
/// runtime, so each call is spawned onto the gateway's runtime (captured at
/// start) and awaited through its join handle; the timeout covers the
/// answer's body too.
#[derive(Debug, Clone)]
struct Transport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl Transport {
    fn new(timeout: Duration) -> Self {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            runtime: tokio::runtime::Handle::current(),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for Transport {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let call = async move {
            let (parts, body) = request.into_parts();
            let answer = client
                .request(Request::from_parts(parts, Full::new(body)))
                .await?;
            let (parts, body) = answer.into_parts();
            let bytes = Limited::new(body, MAX_ANSWER_BYTES).collect().await?;
            Ok::<_, HttpError>(Response::from_parts(parts, bytes.to_bytes()))
        };
        let task = self
            .runtime
            .spawn(async move { tokio::time::timeout(timeout, call).await });
        match task.await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(format!("no answer from the collector within {timeout:?}").into()),
            Err(e) => Err(Box::new(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn plan_with(file: &TraceSettings, vars: &[(&str, &str)]) -> Option<Plan> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        plan(file, &|name| vars.get(name).cloned())
    }

    #[test]
    fn export_is_off_without_an_endpoint_and_with_the_sdk_disabled() {
        let none = TraceSettings::default();
        assert!(plan_with(&none, &[]).is_none());
        assert!(plan_with(&none, &[("OTEL_SERVICE_NAME", "x")]).is_none());
        let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")];
        assert!(plan_with(&none, &env).is_some());
        let off = [env[0], ("OTEL_SDK_DISABLED", "true")];
        assert!(plan_with(&none, &off).is_none());
        let off = [env[0], ("OTEL_TRACES_EXPORTER", "none")];
        assert!(plan_with(&none, &off).is_none());
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let file = TraceSettings {
            endpoint: Some("http://file:4318".into()),
            protocol: Some(Protocol::Grpc),
            service_name: Some("from-file".into()),
            timeout: Some(Duration::from_secs(3)),
        };
        let p = plan_with(&file, &[]).unwrap();
        assert_eq!(p.endpoint.as_deref(), Some("http://file:4318"));
        assert_eq!(p.protocol, Protocol::Grpc);
        assert_eq!(p.service_name.as_deref(), Some("from-file"));
        assert_eq!(p.timeout, Duration::from_secs(3));
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_SERVICE_NAME", "from-env"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "250"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "8"),
        ];
        let p = plan_with(&file, &env).unwrap();
        assert_eq!(p.endpoint, None, "the exporter reads the variable itself");
        assert_eq!(p.protocol, Protocol::HttpProtobuf);
        assert_eq!(p.service_name, None, "the resource reads OTEL_SERVICE_NAME");
        assert_eq!(p.timeout, Duration::from_millis(250));
        assert_eq!(p.queue, 8);
    }

    #[test]
    fn defaults_and_unsupported_values() {
        let file = TraceSettings {
            endpoint: Some("http://c:4318/".into()),
            ..TraceSettings::default()
        };
        let p = plan_with(&file, &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]).unwrap();
        assert_eq!(p.protocol, Protocol::HttpProtobuf);
        assert_eq!(p.endpoint.as_deref(), Some("http://c:4318/v1/traces"));
        assert_eq!(p.service_name.as_deref(), Some("switchyard"));
        assert_eq!(p.timeout, DEFAULT_TIMEOUT);
        assert_eq!(p.queue, DEFAULT_QUEUE);
        assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
        assert_eq!(signal_url("http://c:4317", Protocol::Grpc), "http://c:4317");
        assert_eq!(
            signal_url("http://c/v1/traces", Protocol::HttpProtobuf),
            "http://c/v1/traces"
        );
    }
}
