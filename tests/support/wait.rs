//! Bounded waits for a condition, instead of sleeping and hoping: each polls
//! until the condition holds or the bound passes, and says which it was.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Polls `cond` every 10 ms until it holds or `within` passes; returns whether it held.
pub async fn wait_for(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let rounds = within.as_millis() / 10 + 1;
    for _ in 0..rounds {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}

/// Polls the async `cond` (a request to the gateway, say) every 20 ms until
/// it holds or `within` passes; returns whether it held.
pub async fn eventually<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if cond().await {
            return true;
        }
        if started.elapsed() >= within {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// [`wait_for`] for blocking code (a child process): polls `cond` every
/// 20 ms on this thread until it holds or `within` passes.
pub fn wait_blocking(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if started.elapsed() >= within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
