//! Token buckets (governor): a task's client-facing bucket and its per-caller
//! buckets, and a provider account's requests- and tokens-per-minute buckets.
//! Routing asks them; it never keeps counts of its own.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota};

fn quota(per: Duration, burst: u32) -> Option<Quota> {
    Some(Quota::with_period(per)?.allow_burst(NonZeroU32::new(burst.max(1))?))
}

/// A provider account's request and token buckets.
#[derive(Debug)]
pub struct ProviderLimits {
    rpm: Option<DefaultDirectRateLimiter>,
    tpm: Option<DefaultDirectRateLimiter>,
}

impl ProviderLimits {
    /// Buckets for `rpm` requests and `tpm` tokens a minute; `burst` requests at once.
    #[must_use]
    pub fn new(rpm: Option<u32>, tpm: Option<u32>, burst: Option<u32>) -> Self {
        let per_minute = |n: u32| Duration::from_secs(60) / n.max(1);
        Self {
            rpm: rpm
                .and_then(|n| quota(per_minute(n), burst.unwrap_or(n)))
                .map(governor::RateLimiter::direct),
            tpm: tpm
                .and_then(|n| quota(per_minute(n), n))
                .map(governor::RateLimiter::direct),
        }
    }

    /// Takes one request and `tokens` tokens from the buckets, unless either
    /// cannot admit them now (the target is then skipped, as if it said 429).
    ///
    /// # Errors
    /// How long until the buckets could admit the request.
    pub fn admit(&self, tokens: u64) -> Result<(), Duration> {
        let clock = governor::clock::DefaultClock::default();
        let now = governor::clock::Clock::now(&clock);
        if let Some(rpm) = &self.rpm {
            rpm.check().map_err(|until| until.wait_time_from(now))?;
        }
        if let Some(tpm) = &self.tpm {
            let n = NonZeroU32::new(u32::try_from(tokens.max(1)).unwrap_or(u32::MAX))
                .unwrap_or(NonZeroU32::MIN);
            return match tpm.check_n(n) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(until)) => Err(until.wait_time_from(now)),
                // More tokens than a minute's worth: it never fits.
                Err(_) => Err(Duration::from_secs(60)),
            };
        }
        Ok(())
    }

    /// Charges tokens the upstream reported beyond the estimate (best effort:
    /// a bucket cannot be refunded when the estimate was high).
    pub fn correct(&self, extra_tokens: u64) {
        if let (Some(tpm), Some(n)) = (
            &self.tpm,
            u32::try_from(extra_tokens).ok().and_then(NonZeroU32::new),
        ) {
            let _ = tpm.check_n(n);
        }
    }
}

/// A task's client-facing buckets: one for the task, optionally one per caller.
#[derive(Debug)]
pub struct TaskLimiter {
    all: DefaultDirectRateLimiter,
    per_caller: Option<(http::HeaderName, DefaultKeyedRateLimiter<String>, usize)>,
}

impl TaskLimiter {
    /// `rps` sustained (fractional allowed), `burst` at once; per caller by
    /// `header` with at most `max_callers` tracked. `None` for a zero rate.
    #[must_use]
    pub fn new(
        rps: f64,
        burst: Option<u32>,
        per_caller: Option<(http::HeaderName, usize)>,
    ) -> Option<Self> {
        if !(rps.is_finite() && rps > 0.0) {
            return None;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let burst = burst.unwrap_or_else(|| rps.ceil().min(f64::from(u32::MAX)) as u32);
        let q = quota(Duration::from_secs_f64(1.0 / rps), burst)?;
        Some(Self {
            all: governor::RateLimiter::direct(q),
            per_caller: per_caller.map(|(h, max)| (h, governor::RateLimiter::keyed(q), max)),
        })
    }

    /// Admits one request, or says how long to wait (for `Retry-After`).
    ///
    /// # Errors
    /// The wait until the bucket admits a request, and which bucket (`task` or `caller`).
    pub fn admit(&self, headers: &http::HeaderMap) -> Result<(), (Duration, &'static str)> {
        let clock = governor::clock::DefaultClock::default();
        if let Some((header, keyed, max)) = &self.per_caller {
            let key = headers
                .get(header)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .chars()
                .take(256)
                .collect::<String>();
            if keyed.len() >= *max {
                keyed.retain_recent();
            }
            if let Err(not_until) = keyed.check_key(&key) {
                return Err((
                    not_until.wait_time_from(governor::clock::Clock::now(&clock)),
                    "caller",
                ));
            }
        }
        self.all.check().map_err(|not_until| {
            (
                not_until.wait_time_from(governor::clock::Clock::now(&clock)),
                "task",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_buckets_admit_then_refuse() {
        let l = ProviderLimits::new(Some(60), None, Some(2));
        assert!(l.admit(10).is_ok() && l.admit(10).is_ok());
        let wait = l.admit(10).unwrap_err();
        assert!(wait <= Duration::from_secs(1), "burst of 2 spent: {wait:?}");
        let l = ProviderLimits::new(None, Some(1000), None);
        assert!(l.admit(900).is_ok());
        assert!(l.admit(200).is_err(), "tpm bucket has ~100 left");
    }

    #[test]
    fn task_limiter_refuses_with_a_wait() {
        let l = TaskLimiter::new(1.0, Some(1), None).unwrap();
        let h = http::HeaderMap::new();
        assert!(l.admit(&h).is_ok());
        let (wait, scope) = l.admit(&h).unwrap_err();
        assert_eq!(scope, "task");
        assert!(
            wait > Duration::from_millis(500) && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
    }
}
