//! Admission control: at most `max_running` requests are served at once; up to `max_queued` more wait
//! (at most `queue_timeout`); beyond that the answer is 429 with Retry-After.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;
use crate::metrics::Metrics;

pub struct Admission {
    running: Arc<Semaphore>,
    max_running: usize,
    queued: AtomicUsize,
    max_queued: usize,
    queue_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Admission {
    pub fn new(max_running: usize, max_queued: usize, queue_timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            running: Arc::new(Semaphore::new(max_running)),
            max_running,
            queued: AtomicUsize::new(0),
            max_queued,
            queue_timeout,
            metrics,
        }
    }

    /// A running slot, held until the permit drops.
    pub async fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(p) = self.running.clone().try_acquire_owned() {
            return Ok(p);
        }
        let full = || {
            ApiError::overloaded(
                format!(
                    "The server is at capacity ({} requests running, {} queued); retry after a short wait.",
                    self.max_running, self.max_queued
                ),
                1,
            )
        };
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(full());
        }
        self.metrics.queue_depth.inc();
        let r = tokio::time::timeout(self.queue_timeout, self.running.clone().acquire_owned()).await;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        self.metrics.queue_depth.dec();
        match r {
            Ok(Ok(p)) => Ok(p),
            _ => Err(full()),
        }
    }

    pub fn running(&self) -> usize {
        self.max_running - self.running.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queue_overflow_and_queue_timeout_give_429() {
        let m = Arc::new(Metrics::new().unwrap());
        let a = Arc::new(Admission::new(1, 1, Duration::from_millis(50), m));
        let held = a.admit().await.unwrap();
        assert_eq!(a.running(), 1);
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.admit().await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let over = a.admit().await.unwrap_err();
        assert_eq!(over.status.as_u16(), 429, "queue of 1 is full");
        assert_eq!(over.retry_after, Some(1));
        let timed_out = waiting.await.unwrap().unwrap_err();
        assert_eq!(timed_out.status.as_u16(), 429, "queued past the timeout");
        drop(held);
        assert!(a.admit().await.is_ok());
    }
}
