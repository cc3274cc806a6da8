//! `http_version`: HTTP/2 to upstreams, and the streams one connection
//! carries.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::watch;

use crate::support::*;

/// An upstream that speaks HTTP/2 only, with prior knowledge (h2c), and
/// takes at most `limit` streams at once on a connection, as a provider's
/// edge does. Each stream gets its first content chunk at once and its
/// end once `release` is set.
struct H2Upstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
}

async fn h2_upstream(limit: u32) -> H2Upstream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let (release, released) = watch::channel(false);
    let counted = Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let released = released.clone();
            let service = service_fn(move |_req| {
                let released = released.clone();
                async move { Ok::<_, Infallible>(held_stream(released)) }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(limit)
                    .serve_connection(TokioIo::new(sock), service),
            );
        }
    });
    H2Upstream {
        addr,
        connections,
        release,
    }
}

type Held = StreamBody<
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send>>,
>;

/// A chat stream: role and content at once, the finish once released.
fn held_stream(released: watch::Receiver<bool>) -> http::Response<Held> {
    let first = Bytes::from(role("m", "\n") + &content("m", "first", "\n"));
    let rest = Bytes::from(finish("m", "\n") + &done("\n"));
    let frames = futures_util::stream::unfold(
        (0u8, released, first, rest),
        |(step, mut released, first, rest)| async move {
            match step {
                0 => Some((Ok(Frame::data(first.clone())), (1, released, first, rest))),
                1 => {
                    let _ = released.wait_for(|r| *r).await;
                    Some((Ok(Frame::data(rest.clone())), (2, released, first, rest)))
                }
                _ => None,
            }
        },
    );
    http::Response::builder()
        .header("content-type", "text/event-stream")
        .body(StreamBody::new(Box::pin(frames) as std::pin::Pin<Box<_>>))
        .unwrap()
}

/// Opens a stream through the gateway, counts it in `started` once its
/// first content arrives, and returns its whole text.
async fn open_stream(gateway: SocketAddr, started: Arc<AtomicUsize>) -> String {
    let req = http::Request::post(format!("http://{gateway}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(hello_stream("gpt-4o").to_string())))
        .unwrap();
    let mut body = client().request(req).await.unwrap().into_body();
    let mut text = String::new();
    let mut counted = false;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
        }
        if !counted && text.contains("first") {
            counted = true;
            started.fetch_add(1, Ordering::SeqCst);
        }
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_one_http2_connections_limit_start_on_another() {
    let upstream = h2_upstream(100).await;
    let url = format!("http://{}/v1", upstream.addr);
    let yaml = routes(
        &[hop("a", &url).provider("http_version: http2\ntimeout: 30s")],
        "",
        // One runtime: every stream is that runtime's, on its connections.
        "runtimes: 1\n",
    );
    let gw = gateway(&yaml).await;
    let started = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = (0..130)
        .map(|_| tokio::spawn(open_stream(gw.addr, Arc::clone(&started))))
        .collect();
    // The upstream holds every stream open: a stream past a connection's
    // 100 starts only if it went on another connection.
    let all_started = eventually(Duration::from_secs(10), || {
        let started = Arc::clone(&started);
        async move { started.load(Ordering::SeqCst) == 130 }
    })
    .await;
    let seen = started.load(Ordering::SeqCst);
    upstream.release.send_replace(true);
    for stream in streams {
        let text = tokio::time::timeout(Duration::from_secs(20), stream)
            .await
            .expect("every stream ends once released")
            .unwrap();
        assert!(
            text.contains("first") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
    }
    assert!(all_started, "only {seen} of 130 streams started");
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 2);
}

#[test]
fn a_refused_base_url_hides_no_other_error_of_its_provider() {
    let yaml = routes(
        &[hop("a", "ftp://127.0.0.1:9/v1")
            .provider("key_selection: random\nhttp_version: h3\nshed_after_429: soon")],
        "",
        "",
    );
    let errors = compile_errors(&yaml);
    for key in [
        "base_url",
        "key_selection",
        "http_version",
        "shed_after_429",
    ] {
        let path = format!("providers.p-a.{key}");
        assert!(errors.iter().any(|d| d.path == path), "{path}: {errors:?}");
    }
}

#[test]
fn http_version_is_one_of_three() {
    let yaml = routes(
        &[hop("a", "http://127.0.0.1:9").provider("http_version: h3")],
        "",
        "",
    );
    let errors = compile_errors(&yaml);
    assert!(
        errors
            .iter()
            .any(|d| d.path == "providers.p-a.http_version" && d.message.contains("http2")),
        "{errors:?}"
    );
}
