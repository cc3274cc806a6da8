//! One runtime per core (`runtimes`): connections are spread over the
//! worker runtimes, and what must stay one for all of them stays exact.

use std::time::Duration;

use crate::support::fake::{self, Fake};
use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_rpm_holds_exactly_over_every_runtime() {
    let a = Fake::always(fake::completion("model-a", "a")).await;
    let yaml = routes(
        &[hop("a", &a.url()).provider("rate_limit: { rpm: 40, burst: 40 }")],
        "",
        "runtimes: 3\n",
    );
    let gw = gateway(&yaml).await;
    // Each request on a connection of its own, all at once: the acceptor
    // hands them to the three runtimes in turn.
    let sent: Vec<_> = (0..120)
        .map(|_| {
            let addr = gw.addr;
            tokio::spawn(async move { chat(addr, hello("gpt-4o")).await.status.as_u16() })
        })
        .collect();
    let mut ok = 0;
    for s in sent {
        match s.await.unwrap() {
            200 => ok += 1,
            429 | 503 => {}
            other => panic!("unexpected status {other}"),
        }
    }
    // 40 at once, plus at most one refilled (40 a minute) while they ran.
    assert!((40..=41).contains(&ok), "{ok} answered");
    assert_eq!(a.calls(), ok, "every call the bucket allowed, and no other");
    // The gateway serves again once the bucket refills (a token each 1.5 s;
    // polled, since when the last token went depends on the burst's timing).
    let addr = gw.addr;
    assert!(
        eventually(Duration::from_secs(5), || async move {
            chat(addr, hello("gpt-4o")).await.status == 200
        })
        .await,
        "served again after the refill"
    );
}

#[test]
fn runtimes_is_at_least_one() {
    let yaml = routes(&[hop("a", "http://127.0.0.1:9")], "", "runtimes: 0\n");
    let errors = compile_errors(&yaml);
    assert!(errors.iter().any(|d| d.path == "runtimes"), "{errors:?}");
}
