//! The provider's and keys' rate-limit buckets are charged exactly for the
//! calls that are sent: a target admitted then dropped (`max_failovers`), or
//! refused by another bucket, charges nothing; a same-target retry charges
//! one more call. Each test spends a bucket one way and reads the spend back
//! through the next request.

use crate::support::fake::{self, Fake};
use crate::support::*;

/// `hello` asking for more tokens than a 1000-tpm bucket ever holds.
fn too_big() -> serde_json::Value {
    let mut body = hello("gpt-4o");
    body["max_tokens"] = serde_json::json!(5000);
    body
}

#[tokio::test]
async fn a_target_dropped_by_max_failovers_is_not_charged() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let hops = [
        hop("a", &a.url()),
        hop("b", &b.url()).provider("rate_limit: { rpm: 1, burst: 1 }"),
    ];
    let only_b = "  only-b:\n    chain: [b]\n";
    let gw = gateway(&routes(&hops, "budget: { max_failovers: 0 }", only_b)).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
    assert_eq!((a.calls(), b.calls()), (2, 0), "b is never called");
    // b's one request a minute is still there: nothing was sent to b.
    let ans = chat(gw.addr, hello("only-b")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn a_provider_refusal_charges_no_key() {
    let keys = tempfile::tempdir().unwrap();
    let file = keys.path().join("one.key");
    std::fs::write(&file, "k-1").unwrap();
    let a = Fake::always(fake::completion("upstream-a", "ok")).await;
    let provider = format!(
        "rate_limit: {{ tpm: 1000 }}\nkeys:\n  - {{ name: one, file: '{}', rate_limit: {{ rpm: 1, burst: 1 }} }}",
        file.display()
    );
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(&provider)], "", "")).await;
    let ans = chat(gw.addr, too_big()).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(a.calls(), 0);
    // The key's one request a minute was not spent by the refused one.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn a_tpm_refusal_charges_no_request() {
    let a = Fake::always(fake::completion("upstream-a", "ok")).await;
    let limits = "rate_limit: { rpm: 1, burst: 1, tpm: 1000 }";
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(limits)], "", "")).await;
    let ans = chat(gw.addr, too_big()).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(a.calls(), 0);
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn a_same_target_retry_is_charged() {
    let a = Fake::start(|n, _| match n {
        0 => fake::error(503, "busy"),
        _ => fake::completion("upstream-a", "ok"),
    })
    .await;
    let limits = "rate_limit: { rpm: 2, burst: 2 }";
    let gw = gateway(&routes(&[hop("a", &a.url()).provider(limits)], "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(a.calls(), 2, "one retry");
    // Two calls were sent: the bucket of two is empty.
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 429, "{}", ans.text());
    assert_eq!(a.calls(), 2, "spent calls equal calls sent");
}

#[tokio::test]
async fn a_retry_the_bucket_refuses_is_not_sent() {
    let a = Fake::always(fake::error(503, "busy")).await;
    let b = Fake::always(fake::completion("upstream-b", "from b")).await;
    let hops = [
        hop("a", &a.url()).provider("rate_limit: { rpm: 1, burst: 1 }"),
        hop("b", &b.url()),
    ];
    let gw = gateway(&routes(&hops, "", "")).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(
        a.calls(),
        1,
        "the retry would overdraw a's bucket: failed over instead"
    );
}
