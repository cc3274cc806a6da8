//! Bounded waits for a condition, instead of sleeping and hoping.

use std::time::Duration;

/// Polls `cond` every 10 ms until it holds or `within` passes; returns whether it held.
pub async fn wait_for(mut cond: impl FnMut() -> bool, within: Duration) -> bool {
    let rounds = within.as_millis() / 10 + 1;
    for _ in 0..rounds {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}
