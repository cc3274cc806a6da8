//! The non-proxy endpoints and the server's own answers: models, health,
//! readiness, metrics, 404, 405, 413.

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};

use crate::support::fake::{self, Fake};
use crate::support::*;

fn two_tasks(url: &str) -> String {
    format!(
        "version: 1
providers:
  p: {{ base_url: '{url}', timeout: 2s }}
targets:
  t: {{ provider: p, model: upstream-t }}
tasks:
  chat:
    aliases: [gpt-4o, gpt-4o-mini]
    chain: [t]
  summarize:
    aliases: [claude-3-haiku]
    chain: [t]
"
    )
}

/// Checks an OpenAI-format error body and returns its `code`.
fn openai_error(ans: &Answer) -> String {
    assert!(
        ans.header("content-type").starts_with("application/json"),
        "{:?}",
        ans.headers
    );
    let v = ans.json();
    let err = &v["error"];
    assert!(err.is_object(), "{v}");
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(err["type"].is_string(), "{v}");
    err["code"].as_str().unwrap_or_default().to_owned()
}

async fn request(gw: &Gw, method: &str, path: &str, body: Bytes) -> Answer {
    let req = Request::builder()
        .method(method)
        .uri(gw.url(path))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let fut = async {
        let resp = client().request(req).await.expect("request failed");
        let (parts, body) = resp.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), fut)
        .await
        .expect("request took over 20 s")
}

#[tokio::test]
async fn models_lists_every_task_and_alias() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    for path in ["/v1/models", "/models"] {
        let ans = get(gw.addr, path).await;
        assert_eq!(ans.status, 200, "{path}: {}", ans.text());
        assert!(ans.header("content-type").starts_with("application/json"));
        let v = ans.json();
        assert_eq!(v["object"], "list");
        let mut ids: Vec<(String, String)> = v["data"]
            .as_array()
            .expect("data is a list")
            .iter()
            .map(|m| {
                assert_eq!(m["object"], "model", "{m}");
                (
                    m["id"].as_str().unwrap().to_owned(),
                    m["task"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        ids.sort();
        let mut want: Vec<(String, String)> = [
            ("chat", "chat"),
            ("gpt-4o", "chat"),
            ("gpt-4o-mini", "chat"),
            ("summarize", "summarize"),
            ("claude-3-haiku", "summarize"),
        ]
        .iter()
        .map(|(i, t)| ((*i).to_owned(), (*t).to_owned()))
        .collect();
        want.sort();
        assert_eq!(ids, want, "{path}");
    }
    assert_eq!(a.calls(), 0, "listing models calls no upstream");
}

#[tokio::test]
async fn healthz_and_readyz_answer_200() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    let ans = get(gw.addr, "/healthz").await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.json()["status"], "ok");
    let ans = get(gw.addr, "/readyz").await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["status"], "ready");
    assert!(ans.json()["config_hash"].is_string());
    assert_eq!(a.calls(), 0, "health endpoints call no upstream");
}

#[tokio::test]
async fn metrics_count_a_request() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    let ans = chat(gw.addr, hello("claude-3-haiku")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let page = get(gw.addr, "/metrics").await;
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").starts_with("text/plain"));
    let text = page.text();
    assert_eq!(
        series_value(
            &text,
            r#"switchyard_requests_total{task="summarize",target="t",status="200"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        series_value(&text, r#"switchyard_config_reloads_total{result="ok"}"#),
        Some(1.0),
        "the first load: {text}"
    );
}

#[tokio::test]
async fn unknown_path_is_404_in_openai_format() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    for (method, path) in [
        ("GET", "/nope"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/chat/completions/extra"),
    ] {
        let ans = request(&gw, method, path, Bytes::new()).await;
        assert_eq!(ans.status, 404, "{method} {path}: {}", ans.text());
        assert_eq!(openai_error(&ans), "not_found", "{method} {path}");
        assert!(!ans.header("x-request-id").is_empty());
    }
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn wrong_method_is_405_in_openai_format() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("POST", "/healthz", "GET"),
        ("POST", "/v1/responses/resp_1", "GET, DELETE"),
    ] {
        let ans = request(&gw, method, path, Bytes::new()).await;
        assert_eq!(ans.status, 405, "{method} {path}: {}", ans.text());
        assert_eq!(openai_error(&ans), "method_not_allowed", "{method} {path}");
        assert_eq!(ans.header("allow"), allow, "{method} {path}");
    }
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn an_anthropic_path_answers_a_wrong_method_or_path_in_anthropics_envelope() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    for (method, path, status, kind) in [
        ("GET", "/v1/messages", 405, "invalid_request_error"),
        (
            "GET",
            "/v1/messages/count_tokens",
            405,
            "invalid_request_error",
        ),
        ("POST", "/v1/messages/batches", 404, "not_found_error"),
        ("POST", "/v1/messages/", 404, "not_found_error"),
    ] {
        let ans = request(&gw, method, path, Bytes::new()).await;
        assert_eq!(ans.status, status, "{method} {path}: {}", ans.text());
        let body: serde_json::Value = serde_json::from_str(&ans.text()).unwrap();
        assert_eq!(body["type"], "error", "{method} {path}: {body}");
        assert_eq!(body["error"]["type"], kind, "{method} {path}: {body}");
    }
    assert_eq!(
        request(&gw, "GET", "/v1/messages", Bytes::new())
            .await
            .header("allow"),
        "POST"
    );
    // A stored response's path is one id, nothing after it.
    for path in [
        "/v1/responses/a/resp_1",
        "/v1/responses/resp_1/input_items",
        "/v1/responses/resp_1/",
    ] {
        let ans = request(&gw, "GET", path, Bytes::new()).await;
        assert_eq!(ans.status, 404, "{path}: {}", ans.text());
        assert!(
            ans.text().contains("no route for"),
            "{path}: {}",
            ans.text()
        );
    }
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn body_over_16_mib_is_413() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    // A syntactically plausible JSON prefix, then 17 MiB of padding.
    let mut body = Vec::with_capacity(17 * 1024 * 1024 + 64);
    body.extend_from_slice(br#"{"model":"gpt-4o","messages":[{"role":"user","content":""#);
    body.resize(17 * 1024 * 1024, b'x');
    body.extend_from_slice(br#""}]}"#);
    let ans = request(&gw, "POST", "/v1/chat/completions", Bytes::from(body)).await;
    assert_eq!(ans.status, 413, "{}", ans.text());
    assert_eq!(openai_error(&ans), "payload_too_large");
    assert_eq!(a.calls(), 0, "nothing forwarded");
    // The gateway still serves.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
}

/// A target whose name is no header value (not ASCII) is still counted under
/// its own name: the serving target is the walk's value, not read back from
/// `x-switchyard-target` (issue 21 item 14).
#[tokio::test]
async fn a_target_with_a_non_ascii_name_is_counted_under_its_name() {
    let a = Fake::always(fake::completion("m", "x")).await;
    let yaml = format!(
        "version: 1\nproviders:\n  p: {{ base_url: {} }}\ntargets:\n  zielmodell-größe: {{ provider: p, model: m }}\ntasks:\n  chat: {{ aliases: [gpt-4o], chain: [zielmodell-größe] }}\n",
        a.url()
    );
    let gw = gateway(&yaml).await;
    for _ in 0..2 {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        // Percent-encoded UTF-8 in the header, not raw bytes.
        assert_eq!(
            ans.header("x-switchyard-target"),
            "zielmodell-gr%C3%B6%C3%9Fe"
        );
    }
    let text = get(gw.addr, "/metrics").await.text();
    assert_eq!(
        series_value(
            &text,
            r#"switchyard_requests_total{task="chat",target="zielmodell-größe",status="200"}"#
        ),
        Some(2.0),
        "{text}"
    );
    assert!(!text.contains(r#"target="none",status="200""#), "{text}");
}

/// One listener serves HTTP/1.1 and HTTP/2 prior knowledge (h2c) alike,
/// plain answers and streams.
#[tokio::test]
async fn http2_prior_knowledge_is_served_like_http1() {
    let a = Fake::always(fake::completion("m", "hi from h2")).await;
    let gw = gateway(&two_tasks(&a.url())).await;
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    for (i, client) in [client(), h2].into_iter().enumerate() {
        let req = Request::post(gw.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(hello("gpt-4o").to_string())))
            .unwrap();
        let resp = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(req))
            .await
            .expect("answered in time")
            .expect("request failed");
        let want = if i == 0 {
            http::Version::HTTP_11
        } else {
            http::Version::HTTP_2
        };
        assert_eq!(resp.version(), want);
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "hi from h2", "{v}");
    }
    assert_eq!(a.calls(), 2);
}
