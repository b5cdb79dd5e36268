//! Per-worker circuit breaker. Request failures that point at the worker (transport errors, UNAVAILABLE,
//! INTERNAL, timeouts) count; after `threshold` in a row the worker is skipped for `open_for`, then one
//! trial request decides whether it is back (closed) or skipped again (open).

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { trial_out: bool },
}

#[derive(Debug)]
pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    open_for: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self { state: Mutex::new(State::Closed { failures: 0 }), threshold: threshold.max(1), open_for }
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// Whether a request may be sent now (an open breaker whose time is up turns half-open).
    pub fn available(&self) -> bool {
        self.with(|s| match *s {
            State::Closed { .. } => true,
            State::Open { until } if Instant::now() >= until => {
                *s = State::HalfOpen { trial_out: false };
                true
            }
            State::Open { .. } => false,
            State::HalfOpen { trial_out } => !trial_out,
        })
    }

    /// Called when a request is sent: a half-open breaker lets exactly one through.
    pub fn on_send(&self) {
        self.with(|s| {
            if let State::HalfOpen { .. } = *s {
                *s = State::HalfOpen { trial_out: true };
            }
        })
    }

    pub fn success(&self) {
        self.with(|s| *s = State::Closed { failures: 0 })
    }

    /// Returns true when this failure opened the breaker.
    pub fn failure(&self) -> bool {
        let open = State::Open { until: Instant::now() + self.open_for };
        self.with(|s| match *s {
            State::Closed { failures } if failures + 1 >= self.threshold => {
                *s = open;
                true
            }
            State::Closed { failures } => {
                *s = State::Closed { failures: failures + 1 };
                false
            }
            State::HalfOpen { .. } => {
                *s = open;
                true
            }
            State::Open { .. } => false,
        })
    }

    pub fn is_open(&self) -> bool {
        self.with(|s| matches!(*s, State::Open { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_lets_one_trial_through() {
        let b = Breaker::new(2, Duration::from_millis(30));
        assert!(!b.failure());
        assert!(b.available());
        assert!(b.failure(), "second failure in a row opens");
        assert!(!b.available());
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.available(), "half-open after the open period");
        b.on_send();
        assert!(!b.available(), "only one trial at a time");
        b.success();
        assert!(b.available() && !b.is_open());
    }

    #[test]
    fn a_failed_trial_opens_again_and_success_resets_the_count() {
        let b = Breaker::new(2, Duration::from_millis(10));
        b.failure();
        b.success();
        assert!(!b.failure(), "count was reset by the success");
        b.failure();
        std::thread::sleep(Duration::from_millis(15));
        assert!(b.available());
        b.on_send();
        assert!(b.failure());
        assert!(!b.available());
    }
}
