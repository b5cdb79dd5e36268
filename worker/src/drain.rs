//! Draining: on SIGTERM a worker refuses new work (UNAVAILABLE, so the router retries elsewhere),
//! finishes what it has, deregisters and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub struct Drain {
    draining: AtomicBool,
    inflight: AtomicUsize,
    idle: Notify,
}

/// Held while a request is in flight.
pub struct InflightGuard(Arc<Drain>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn new() -> Arc<Drain> {
        Arc::new(Drain::default())
    }

    /// A guard for a new request, or the gRPC status to answer while draining.
    pub fn admit(self: &Arc<Self>) -> Result<InflightGuard, tonic::Status> {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = InflightGuard(self.clone());
        if self.draining.load(Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("worker is draining (shutting down); retry on another worker"));
        }
        Ok(guard)
    }

    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Waits until nothing is in flight, at most `timeout`; returns whether it got there.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.idle.notified();
                if self.inflight() == 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: draining"),
                    _ = int.recv() => tracing::info!("SIGINT: draining"),
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
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
        let refused = d.admit().err().expect("refused while draining");
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert_eq!(d.inflight(), 1, "a refused request is not counted");
        assert!(!d.wait_idle(Duration::from_millis(20)).await, "one request still running");
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait_idle(Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        assert!(waiter.await.unwrap());
        assert_eq!(d.inflight(), 0);
    }
}
