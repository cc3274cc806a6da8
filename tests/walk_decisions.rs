//! The walk, the hedge and a stream's continuation decide what follows a
//! failed attempt by one function (`attempt::next_step`): a continuation
//! takes the walk's decisions (no key switch on `return`, a context-length
//! error raises the context floor).

use crate::support::fake::{self, Fake};
use crate::support::*;

const WORDS: [&str; 4] = ["The", " quick", " brown", " fox"];

#[tokio::test]
async fn a_continuation_does_not_switch_key_on_a_key_scoped_return() {
    let keys = tempfile::tempdir().unwrap();
    let mut pool = String::from("keys:\n");
    for name in ["one", "two"] {
        let file = keys.path().join(format!("{name}.key"));
        std::fs::write(&file, format!("k-{name}")).unwrap();
        pool.push_str(&format!(
            "  - {{ name: {name}, file: '{}' }}\n",
            file.display()
        ));
    }
    pool.push_str(
        "error_classes:\n  - { match: { status: 429 }, action: return, scope: key, health: false }\n",
    );
    let a = Fake::always(fake::stream_cut_after("model-a", &WORDS, 2)).await;
    let b = Fake::always(fake::error(429, "slow down")).await;
    let cfg = routes(
        &[hop("a", &a.url()), hop("b", &b.url()).provider(&pool)],
        "stream_recovery: { mode: continue }",
        "",
    );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert_eq!(a.calls(), 1);
    assert_eq!(
        b.calls(),
        1,
        "`return` is not retried on the next key: {}",
        ans.text()
    );
}

#[tokio::test]
async fn a_continuation_context_error_skips_smaller_windows() {
    let a = Fake::always(fake::stream_cut_after("model-a", &WORDS, 2)).await;
    let b = Fake::always(fake::error(
        400,
        "This model's maximum context length is 8000 tokens",
    ))
    .await;
    let c = Fake::always(fake::stream_cut_after("model-c", &WORDS, 4)).await;
    let cfg = routes(
        &[
            hop("a", &a.url()),
            hop("b", &b.url()).target("max_context: 8000"),
            hop("c", &c.url()).target("max_context: 4000"),
        ],
        "stream_recovery: { mode: continue }",
        "",
    );
    let gw = gateway(&cfg).await;
    let ans = chat(gw.addr, hello_stream("gpt-4o")).await;
    assert_eq!(ans.status, 200);
    assert!(b.calls() >= 1, "{}", ans.text());
    assert_eq!(
        c.calls(),
        0,
        "a smaller window than b's is not tried: {}",
        ans.text()
    );
}
