//! A plain HTTP client for the gateway, and the requests tests send.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

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
