//! A budget of audio by wall time: what a stream coming from someone we do not control (a
//! network client) may spend, at most real time plus a bounded catch-up; and the
//! [`TokenBucket`] it is made of, which the server also uses for rates of messages and sessions.
//!
//! [`RealTime`] is a token bucket counted in samples: it fills at the stream's rate (times a
//! factor), holds at most `catch_up` of audio, and starts full. A consumer asks it before doing
//! the work a piece of audio costs (decoding it, framing it, stepping a model on it) and drops
//! the piece when the bucket cannot pay: a client that sends faster than real time, or a
//! compressed packet that claims hours of audio, costs no more than a client that talks. Pure
//! code: the clock is passed in, so the tests need no sleeping.

use std::time::{Duration, Instant};

/// Asked before each piece of audio is decoded: may `samples` more be spent?
pub trait Budget {
    /// Takes `samples` from the budget and says yes, or takes nothing and says no.
    fn take(&mut self, samples: usize) -> bool;
}

/// No limit: for streams we made ourselves (files, tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unlimited;

impl Budget for Unlimited {
    fn take(&mut self, _samples: usize) -> bool {
        true
    }
}

/// A token bucket: fills at `per_second`, holds at most `capacity`, starts full.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_second: f64,
    capacity: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(per_second: f64, capacity: f64) -> Self {
        TokenBucket {
            per_second: per_second.max(0.0),
            capacity: capacity.max(0.0),
            tokens: capacity.max(0.0),
            last: None,
        }
    }

    /// Takes `amount` at the instant `now` and says yes, or takes nothing and says no.
    pub fn take_at(&mut self, amount: f64, now: Instant) -> bool {
        if let Some(last) = self.last {
            let dt = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + dt * self.per_second).min(self.capacity);
        }
        self.last = Some(now.max(self.last.unwrap_or(now)));
        if amount <= self.tokens {
            self.tokens -= amount;
            true
        } else {
            false
        }
    }

    /// Whether the bucket would be full at `now` (nothing taken that has not come back).
    pub fn is_full_at(&self, now: Instant) -> bool {
        let dt = self
            .last
            .map_or(0.0, |l| now.saturating_duration_since(l).as_secs_f64());
        self.tokens + dt * self.per_second >= self.capacity
    }
}

/// At most `factor` × real time, with up to `catch_up` of audio ahead.
#[derive(Debug, Clone)]
pub struct RealTime {
    bucket: TokenBucket,
    refused: u64,
}

impl RealTime {
    /// A budget for a stream of `rate` samples per second, spent at most `factor` times as fast
    /// as it plays (1.0: real time), with `catch_up` of audio allowed ahead (a burst after a
    /// network stall). It starts full.
    pub fn new(rate: u32, factor: f64, catch_up: Duration) -> Self {
        let capacity = (rate as f64 * catch_up.as_secs_f64()).max(1.0);
        RealTime {
            bucket: TokenBucket::new(rate as f64 * factor, capacity),
            refused: 0,
        }
    }

    /// [`Budget::take`] at the instant `now`.
    pub fn take_at(&mut self, samples: usize, now: Instant) -> bool {
        let ok = self.bucket.take_at(samples as f64, now);
        if !ok {
            self.refused += samples as u64;
        }
        ok
    }

    /// Samples refused so far.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

impl Budget for RealTime {
    fn take(&mut self, samples: usize) -> bool {
        self.take_at(samples, Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_bounded_and_real_time_is_kept() {
        let t0 = Instant::now();
        let mut b = RealTime::new(24_000, 1.0, Duration::from_secs(1));
        // The catch-up allowance at once, then nothing more at the same instant.
        let mut taken = 0;
        while b.take_at(480, t0) {
            taken += 480;
        }
        assert_eq!(taken, 24_000);
        assert_eq!(b.refused(), 480);
        // One second later, one second more: a client at real time is never refused.
        for i in 1..=250 {
            let now = t0 + Duration::from_millis(1000 + 20 * i);
            assert!(b.take_at(480, now), "20 ms packet {i} at real time");
        }
        // A client at twice real time over 10 s gets real time plus the allowance, no more.
        let mut b = RealTime::new(24_000, 1.0, Duration::from_secs(1));
        let mut got = 0usize;
        for i in 0..1000 {
            if b.take_at(480, t0 + Duration::from_millis(10 * i)) {
                got += 480;
            }
        }
        let ceiling = 24_000 * 10 + 24_000;
        assert!(got <= ceiling && got >= ceiling - 960, "{got}");
    }

    #[test]
    fn one_huge_claim_is_refused_without_spending_the_budget() {
        let t0 = Instant::now();
        let mut b = RealTime::new(24_000, 1.0, Duration::from_millis(500));
        assert!(!b.take_at(24_000 * 3600, t0));
        assert!(b.take_at(12_000, t0), "the allowance is intact");
        assert!(!b.take_at(1, t0));
    }
}
