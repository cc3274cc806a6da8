//! Test harness: the gateway started in-process on port 0 against a
//! routes.yaml in a temp dir, a plain HTTP client, and the fake upstream.
#![allow(dead_code)]

#[path = "../../examples/support/fake.rs"]
pub mod fake;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;
use tokio::sync::oneshot;

/// A running gateway; stops when dropped.
pub struct Gw {
    pub addr: SocketAddr,
    /// The admin listener, when the config has `admin_listen`.
    pub admin: Option<SocketAddr>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    pub app: std::sync::Arc<switchyard::state::App>,
}

impl Drop for Gw {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Gw {
    /// Rewrites routes.yaml atomically (write a temp file, rename over), as editors do.
    pub fn rewrite(&self, yaml: &str) {
        let tmp = self.dir.path().join(".routes.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.config).unwrap();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Starts the gateway on `yaml`.
pub async fn gateway(yaml: &str) -> Gw {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let gw = Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse().unwrap()),
        CompileOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("gateway did not start:\n{e}"));
    let addr = gw.local_addr().unwrap();
    let admin = gw.admin_addr();
    let app = gw.app();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(gw.run(async {
        let _ = rx.await;
    }));
    Gw {
        addr,
        admin,
        dir,
        config,
        stop: Some(tx),
        app,
    }
}

/// A routes.yaml with one task `chat` (alias `gpt-4o`) whose chain is the
/// given (name, url) targets in order, each on its own provider.
pub fn chain_config(targets: &[(&str, &str)], extra_provider: &str, budget: &str) -> String {
    let mut y = String::from("version: 1\nproviders:\n");
    for (name, url) in targets {
        y.push_str(&format!(
            "  p-{name}:\n    base_url: {url}\n    timeout: 2s\n    connect_timeout: 500ms\n    retry: {{ max: 1, backoff: 10ms }}\n{extra_provider}"
        ));
    }
    y.push_str("targets:\n");
    for (name, _) in targets {
        y.push_str(&format!(
            "  {name}: {{ provider: p-{name}, model: upstream-{name} }}\n"
        ));
    }
    let names: Vec<&str> = targets.iter().map(|(n, _)| *n).collect();
    y.push_str(&format!(
        "tasks:\n  chat:\n    aliases: [gpt-4o]\n    chain: [{}]\n{budget}",
        names.join(", ")
    ));
    y
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {}", self.text()))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// POSTs raw bytes to the gateway and reads the whole answer (bounded by 20 s).
pub async fn post_raw(
    addr: SocketAddr,
    path: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req =
        Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let fut = async {
        let resp = client().request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("request took over 20 s")
}

/// POSTs a chat request.
pub async fn chat(addr: SocketAddr, body: serde_json::Value) -> Answer {
    post_raw(addr, "/v1/chat/completions", body.to_string(), &[]).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Answer {
    get_with(addr, path, &[]).await
}

pub async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Answer {
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::new())).unwrap();
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

pub fn hello(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hello"}]})
}

pub fn hello_stream(model: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hello"}]})
}

/// The text content of an SSE answer: the concatenated `delta.content`s.
pub fn stream_text(body: &str) -> String {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// Parses and compiles `text` (a whole routes.yaml), expecting it to be rejected.
pub fn compile_errors(text: &str) -> Vec<switchyard::config::diagnostic::Diagnostic> {
    let parsed = switchyard::config::parse(text).unwrap();
    switchyard::snapshot::compile::compile(
        &parsed,
        text,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    )
    .map(|_| ())
    .unwrap_err()
}
