//! Upstream error text reaching clients is scrubbed: configured sensitive
//! words, upstream host names, key-like strings; friendly messages per status.

use crate::support::fake::{self, Fake};
use crate::support::*;

const SANITIZE: &str = "sanitize:\n  sensitive_words: ['Top up at console.vendor.example', VendorCloud]\n  messages:\n    \"429\": The assistant is busy, please retry shortly.\n    \"502\": The assistant is unavailable right now.\n";

#[tokio::test]
async fn returned_upstream_errors_are_scrubbed() {
    let body = serde_json::json!({"error": {
        "message": "VendorCloud: prompt rejected for key sk-proj-0123456789abcdefghij at upstream.vendor.internal. Top up at console.vendor.example",
        "type": "invalid_request_error", "code": "bad_prompt"}});
    let a = Fake::always(fake::json(400, &body.to_string())).await;
    let cfg = chain_config(&[("a", &a.url())], "", "") + SANITIZE;
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 400);
    let text = ans.text();
    for leaked in ["VendorCloud", "sk-proj", "console.vendor.example", "Top up"] {
        assert!(!text.contains(leaked), "{leaked} leaked: {text}");
    }
    assert!(
        text.contains("prompt rejected"),
        "the useful part stays: {text}"
    );
    assert_eq!(ans.json()["error"]["code"], "bad_prompt");
}

/// An upstream error event that breaks a stream after its first token is
/// repeated in the interruption: scrubbed as a returned error is, in every
/// protocol the client may speak.
#[tokio::test]
async fn an_error_event_that_breaks_a_stream_is_scrubbed_before_it_is_repeated() {
    let said = "VendorCloud: Incorrect API key provided: sk-proj-****9876; also sk-live-ABCDEFGHIJKLMNOPQRSTUVWX";
    let error = serde_json::json!({"error": {"message": said, "code": 500}});
    let a = Fake::always(fake::Reply::Stream {
        pieces: vec![
            fake::chunk_event("m", serde_json::json!({"content": "partial"}), None),
            format!("data: {error}\n\n"),
        ],
        delay: std::time::Duration::ZERO,
        cut: false,
    })
    .await;
    let cfg = chain_config(&[("a", &a.url())], "", "") + SANITIZE;
    let gw = gateway(&cfg).await;
    let messages = serde_json::json!({"model": "gpt-4o", "max_tokens": 16, "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let responses = serde_json::json!({"model": "gpt-4o", "stream": true, "input": "hi"});
    for (path, body) in [
        ("/v1/chat/completions", hello_stream("gpt-4o")),
        ("/v1/messages", messages),
        ("/v1/responses", responses),
    ] {
        let ans = post_raw(gw.addr, path, body.to_string(), &[]).await;
        assert_eq!(ans.status, 200, "{path}: {}", ans.text());
        let text = ans.text();
        assert!(text.contains("partial"), "{path}: {text}");
        for leaked in ["VendorCloud", "sk-proj", "9876", "sk-live", "ABCDEFGH"] {
            assert!(!text.contains(leaked), "{path}: {leaked} leaked: {text}");
        }
        assert!(
            text.contains("Incorrect API key provided"),
            "{path}: {text}"
        );
    }
}

#[tokio::test]
async fn friendly_messages_replace_upstream_and_own_ones() {
    let a = Fake::always(fake::error(429, "VendorCloud rate limit for org-123")).await;
    let rule =
        "error_classes:\n  - match: { status: 429 }\n    action: return\n    health: false\n";
    let gw = gateway(&(chain_config(&[("a", &a.url())], "", "") + SANITIZE + rule)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429);
    assert_eq!(
        ans.json()["error"]["message"],
        "The assistant is busy, please retry shortly."
    );

    let dead = fake::dead_url().await;
    let gw = gateway(&(chain_config(&[("a", &dead)], "", "") + SANITIZE)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502);
    assert_eq!(
        ans.json()["error"]["message"],
        "The assistant is unavailable right now."
    );
    assert_eq!(
        ans.json()["error"]["code"],
        "all_targets_failed",
        "the code stays machine-readable"
    );
}

#[tokio::test]
async fn bad_sanitize_status_is_rejected_with_location() {
    let text = "version: 1\nproviders: {}\ntargets: {}\ntasks: {}\nsanitize:\n  messages:\n    \"200\": fine\n";
    let diags = compile_errors(text);
    assert!(
        diags
            .iter()
            .any(|d| d.line == 7 && d.message.contains("not an HTTP error status")),
        "{diags:?}"
    );
}
