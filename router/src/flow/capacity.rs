//! Waiting for decode capacity. When every decode worker refuses a reservation for lack of room
//! (its sequence slots or its cache blocks), the request waits here, bounded, and tries again when a
//! request ends somewhere (or every [`RECHECK`]), instead of failing at once:
//! - a new request waits at most `--queue-timeout-secs`, and only while fewer than
//!   `--max-queued-requests` wait; past either bound it gets 429 with Retry-After;
//! - a preempted request (its stream already open) waits at most `--preempted-wait-secs`, and new
//!   requests let it go first, so a continuation is not starved by fresh arrivals.
//!
//! The decode worker's admission watermark still decides what fits; this only decides when to ask again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Longest time between two tries of a waiting request (capacity also frees without a request ending
/// here: another router's request, or a worker's own preemption).
const RECHECK: Duration = Duration::from_millis(250);

pub struct CapacityWait {
    freed: Notify,
    waiting: AtomicUsize,
    preempted_waiting: AtomicUsize,
    max_waiting: usize,
    fresh_wait: Duration,
    preempted_wait: Duration,
}

/// A request's place among the waiters; leaves on drop.
pub struct Waiter<'a> {
    wait: &'a CapacityWait,
    preempted: bool,
    pub deadline: Instant,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.wait.waiting.fetch_sub(1, Ordering::SeqCst);
        if self.preempted {
            self.wait.preempted_waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl CapacityWait {
    pub fn new(max_waiting: usize, fresh_wait: Duration, preempted_wait: Duration) -> Self {
        Self {
            freed: Notify::new(),
            waiting: AtomicUsize::new(0),
            preempted_waiting: AtomicUsize::new(0),
            max_waiting,
            fresh_wait,
            preempted_wait,
        }
    }

    /// A request released decode capacity: waiting requests try again.
    pub fn freed(&self) {
        self.freed.notify_waiters();
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Joins the waiters, or None when the request may not wait (no wait time, or the queue is full;
    /// a preempted request is never refused for the length). `until` keeps the deadline of an earlier
    /// wait of the same request (it waited, tried, and found every worker full again); `None` starts one.
    pub fn enter(&self, preempted: bool, until: Option<Instant>) -> Option<Waiter<'_>> {
        let limit = if preempted { self.preempted_wait } else { self.fresh_wait };
        if limit.is_zero() {
            return None;
        }
        let n = self.waiting.fetch_add(1, Ordering::SeqCst);
        if !preempted && n >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        if preempted {
            self.preempted_waiting.fetch_add(1, Ordering::SeqCst);
        }
        Some(Waiter { wait: self, preempted, deadline: until.unwrap_or_else(|| Instant::now() + limit) })
    }

    /// Waits for the next chance to try again; false once the deadline passed.
    pub async fn next_try(&self, w: &Waiter<'_>) -> bool {
        loop {
            let left = w.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            tokio::select! {
                _ = self.freed.notified() => {}
                _ = tokio::time::sleep(left.min(RECHECK)) => {}
            }
            // Continuations first: a new request tries only while no preempted one waits.
            if w.preempted || self.preempted_waiting.load(Ordering::SeqCst) == 0 {
                return Instant::now() < w.deadline;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_length_bounds_new_requests_but_not_continuations() {
        let w = CapacityWait::new(1, Duration::from_secs(1), Duration::from_secs(1));
        let a = w.enter(false, None).expect("room for one");
        assert!(w.enter(false, None).is_none(), "the second new request is refused");
        let p = w.enter(true, None).expect("a continuation always waits");
        assert_eq!(w.waiting(), 2);
        drop((a, p));
        assert_eq!(w.waiting(), 0);
        assert!(CapacityWait::new(9, Duration::ZERO, Duration::ZERO).enter(false, None).is_none(), "no wait time");
    }

    #[tokio::test]
    async fn a_waiter_gives_up_at_its_deadline() {
        let w = CapacityWait::new(4, Duration::from_millis(100), Duration::from_secs(1));
        let a = w.enter(false, None).unwrap();
        let t = Instant::now();
        while w.next_try(&a).await {}
        assert!(t.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_continuation_that_leaves_the_queue_no_longer_holds_back_new_requests() {
        let w = CapacityWait::new(4, Duration::from_secs(5), Duration::from_secs(5));
        // While a preempted request waits, a new one is not let through ...
        let p = w.enter(true, None).unwrap();
        let n = w.enter(false, None).unwrap();
        w.freed();
        assert!(tokio::time::timeout(Duration::from_millis(400), w.next_try(&n)).await.is_err());
        // ... and once it leaves (its attempt runs), the new one tries at the next chance.
        drop(p);
        w.freed();
        assert!(tokio::time::timeout(Duration::from_millis(400), w.next_try(&n)).await.unwrap());
        drop(n);
        assert_eq!(w.waiting(), 0);
    }

    #[test]
    fn a_request_that_waits_again_keeps_its_first_deadline() {
        let w = CapacityWait::new(4, Duration::from_secs(60), Duration::from_secs(60));
        let first = w.enter(false, None).unwrap().deadline;
        let again = w.enter(false, Some(first)).unwrap();
        assert_eq!(again.deadline, first, "waits between tries add up to one bound");
    }
}
