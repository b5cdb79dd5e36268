//! Graceful drain, shared by both workers: on SIGTERM a worker stops admitting requests (and says so in
//! `LoadReport.draining`, so the router stops picking it), finishes what it has, deregisters, then exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
}

/// Counts one admitted request until dropped.
pub struct DrainGuard(Arc<Drain>);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Admits a request, or None once draining (answer it with a retryable UNAVAILABLE).
    pub fn admit(self: &Arc<Self>) -> Option<DrainGuard> {
        if self.is_draining() {
            return None;
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        // Re-check: a drain that started in between must not miss this request.
        if self.is_draining() {
            drop(DrainGuard(self.clone()));
            return None;
        }
        Some(DrainGuard(self.clone()))
    }

    /// Starts draining; idempotent.
    pub fn start(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Waits until no admitted request is left, at most `limit`. Returns whether it got there.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.idle.notified();
                if self.in_flight() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn draining_refuses_new_work_and_waits_for_the_old() {
        let d = Drain::new();
        let a = d.admit().expect("admitted before drain");
        d.start();
        assert!(d.admit().is_none(), "refused while draining");
        assert!(!d.wait_idle(Duration::from_millis(20)).await, "one request still running");
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait_idle(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        assert!(waiter.await.unwrap());
        assert_eq!(d.in_flight(), 0);
    }
}
