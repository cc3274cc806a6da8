//! Hedged requests ("The Tail at Scale", Dean and Barroso): when the first
//! attempt has not reached its commit point after a delay, the next admitted
//! target starts in parallel; the first to commit wins and the other is
//! dropped at once (its connection closes, so its upstream stops
//! generating). Losing is not a failure: the slow target's health is untouched.
//!
//! [`race`] is the timing core, generic over the two attempts so it is tested
//! with paused time; the walk (`proxy.rs`) feeds it real attempts.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Which of the two attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The first attempt.
    Primary,
    /// The hedge.
    Hedge,
}

/// How a race went.
#[derive(Debug)]
pub struct Raced<O> {
    /// The primary's result, if it finished (the loser's future is dropped).
    pub primary: Option<O>,
    /// The hedge's result, if one started and finished.
    pub hedge: Option<O>,
    /// Whether the hedge started.
    pub hedged: bool,
    /// The side whose result is an answer, if one is.
    pub winner: Option<Side>,
}

/// Runs `primary`; if it has not finished after `after`, asks `start_hedge`
/// for a second attempt (`None`: not allowed or no target, keep waiting) and
/// runs both. The first result that `is_answer` accepts wins and the other
/// future is dropped at once; a failure waits for the other side.
pub async fn race<O, P, H, S>(
    primary: P,
    after: Duration,
    start_hedge: S,
    is_answer: impl Fn(&O) -> bool,
) -> Raced<O>
where
    P: Future<Output = O>,
    H: Future<Output = O>,
    S: FnOnce() -> Option<H>,
{
    tokio::pin!(primary);
    let timer = tokio::time::sleep_until(Instant::now() + after);
    tokio::select! {
        biased;
        out = &mut primary => {
            let winner = is_answer(&out).then_some(Side::Primary);
            return Raced { primary: Some(out), hedge: None, hedged: false, winner };
        }
        () = timer => {}
    }
    let Some(hedge) = start_hedge() else {
        let out = primary.await;
        let winner = is_answer(&out).then_some(Side::Primary);
        return Raced {
            primary: Some(out),
            hedge: None,
            hedged: false,
            winner,
        };
    };
    tokio::pin!(hedge);
    let mut raced = Raced {
        primary: None,
        hedge: None,
        hedged: true,
        winner: None,
    };
    loop {
        let primary_open = raced.primary.is_none();
        let hedge_open = raced.hedge.is_none();
        if !primary_open && !hedge_open {
            return raced;
        }
        tokio::select! {
            out = &mut primary, if primary_open => {
                let won = is_answer(&out);
                raced.primary = Some(out);
                if won {
                    raced.winner = Some(Side::Primary);
                    return raced;
                }
            }
            out = &mut hedge, if hedge_open => {
                let won = is_answer(&out);
                raced.hedge = Some(out);
                if won {
                    raced.winner = Some(Side::Hedge);
                    return raced;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{After, HedgePolicy};

    async fn after(
        ms: u64,
        out: Result<&'static str, &'static str>,
    ) -> Result<&'static str, &'static str> {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        out
    }

    fn answer(o: &Result<&str, &str>) -> bool {
        o.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_primary_in_time_runs_alone() {
        let mut started = false;
        let r = race(
            after(50, Ok("a")),
            Duration::from_millis(100),
            || {
                started = true;
                Some(after(10, Ok("b")))
            },
            answer,
        )
        .await;
        assert!(!r.hedged && !started);
        assert_eq!((r.winner, r.primary), (Some(Side::Primary), Some(Ok("a"))));
    }

    #[tokio::test(start_paused = true)]
    async fn the_hedge_fires_after_the_delay_and_the_first_answer_wins() {
        let t0 = Instant::now();
        let r = race(
            after(3000, Ok("slow")),
            Duration::from_millis(100),
            || Some(after(150, Ok("fast"))),
            answer,
        )
        .await;
        assert!(r.hedged);
        assert_eq!(r.winner, Some(Side::Hedge));
        assert_eq!(r.hedge, Some(Ok("fast")));
        assert!(r.primary.is_none(), "the slow one was dropped, not awaited");
        assert_eq!(t0.elapsed(), Duration::from_millis(250));
    }

    #[tokio::test(start_paused = true)]
    async fn a_primary_that_commits_while_the_hedge_runs_wins() {
        let r = race(
            after(200, Ok("a")),
            Duration::from_millis(100),
            || Some(after(500, Ok("b"))),
            answer,
        )
        .await;
        assert_eq!(r.winner, Some(Side::Primary));
        assert!(r.hedge.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_after_the_hedge_fired_waits_for_the_other() {
        let r = race(
            after(150, Err("reset")),
            Duration::from_millis(100),
            || Some(after(300, Ok("b"))),
            answer,
        )
        .await;
        assert_eq!(r.winner, Some(Side::Hedge));
        assert_eq!(r.primary, Some(Err("reset")));
        let r = race(
            after(150, Err("reset")),
            Duration::from_millis(100),
            || Some(after(100, Err("503"))),
            answer,
        )
        .await;
        assert_eq!(r.winner, None);
        assert_eq!((r.primary, r.hedge), (Some(Err("reset")), Some(Err("503"))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_primary_failure_before_the_delay_is_not_hedged() {
        let r = race(
            after(20, Err("reset")),
            Duration::from_millis(100),
            || Some(after(1, Ok("b"))),
            answer,
        )
        .await;
        assert!(!r.hedged);
        assert_eq!(r.primary, Some(Err("reset")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_suppressed_hedge_keeps_waiting_for_the_primary() {
        let r = race(
            after(400, Ok("a")),
            Duration::from_millis(100),
            || None::<std::future::Ready<_>>,
            answer,
        )
        .await;
        assert!(!r.hedged);
        assert_eq!(r.winner, Some(Side::Primary));
    }

    #[test]
    fn an_adaptive_delay_is_clamped_and_waits_for_samples() {
        let p = HedgePolicy {
            after: After::Percentile {
                quantile: 0.95,
                floor: Duration::from_millis(100),
                cap: Duration::from_secs(2),
            },
            max_share: 0.1,
        };
        assert_eq!(
            p.delay(|_| Some(Duration::from_millis(20))),
            Duration::from_millis(100)
        );
        assert_eq!(
            p.delay(|_| Some(Duration::from_millis(700))),
            Duration::from_millis(700)
        );
        assert_eq!(
            p.delay(|_| Some(Duration::from_secs(9))),
            Duration::from_secs(2)
        );
        assert_eq!(p.delay(|_| None), Duration::from_secs(2));
    }
}
