//! Streaming: relay, commit point, failover before it, interruption after it.

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

#[tokio::test]
async fn stream_is_relayed_byte_for_byte() {
    let words = ["Hello", " there", ", friend", "."];
    let a = Fake::always(fake::stream("model-a", &words)).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert!(ans.header("content-type").starts_with("text/event-stream"));
    assert_eq!(ans.header("x-switchyard-target"), "a");
    assert_eq!(ans.text(), fake::sse_events("model-a", &words).concat());
}

#[tokio::test]
async fn break_before_first_content_fails_over_invisibly() {
    let a = Fake::always(fake::stream_cut_after("model-a", &["never"], 0)).await;
    let b = Fake::always(fake::stream("model-b", &["from", " b"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        ans.text(),
        fake::sse_events("model-b", &["from", " b"]).concat(),
        "one clean stream from b"
    );
}

#[tokio::test]
async fn error_status_on_stream_fails_over_and_is_never_wrapped() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::stream("model-b", &["ok"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(stream_text(&ans.text()), "ok");
    assert_eq!(a.calls(), 2);

    let a = Fake::always(fake::error(400, "bad")).await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 400);
    assert!(ans.header("content-type").starts_with("application/json"));
}

#[tokio::test]
async fn break_after_first_content_ends_with_error_event_and_never_replays() {
    let words = ["one", " two", " three"];
    let a = Fake::always(fake::stream_cut_after("model-a", &words, 2)).await;
    let b = Fake::always(fake::stream("model-b", &["must", " not", " appear"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    let text = ans.text();
    assert_eq!(
        stream_text(&text),
        "one two",
        "nothing repeated, nothing from b"
    );
    assert!(text.contains("\"code\":\"stream_interrupted\""), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(
        !text.contains("\"finish_reason\":\"stop\""),
        "no invented finish"
    );
    assert_eq!(b.calls(), 0);
}

#[tokio::test]
async fn in_band_error_before_content_fails_over() {
    let pieces = vec![
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n".to_owned(),
        "data: {\"error\":{\"message\":\"rate limited\",\"code\":429}}\n\n".to_owned(),
    ];
    let a = Fake::always(Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let b = Fake::always(fake::stream("model-b", &["fine"])).await;
    let gw = gateway(&chain_config(&[("a", &a.url()), ("b", &b.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(stream_text(&ans.text()), "fine");
    assert_eq!(a.calls(), 1, "an in-band 429 is a 429: no retry");
}

#[tokio::test]
async fn missing_done_after_finish_is_added() {
    let mut pieces = fake::sse_events("model-a", &["hi"]);
    pieces.pop();
    let a = Fake::always(Reply::Stream {
        pieces,
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert!(ans.text().ends_with("data: [DONE]\n\n"));
    assert!(!ans.text().contains("stream_interrupted"));
}
