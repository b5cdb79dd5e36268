//! Draining: on SIGTERM a worker refuses new work (UNAVAILABLE, so the router retries elsewhere),
//! finishes what it has, deregisters and exits. A device failure ([`Drain::fail`]) skips the finishing:
//! the process's GPU context is unusable, so the worker deregisters at once and exits with the reason.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use engine::EngineError;
use tokio::sync::{Notify, watch};

pub struct Drain {
    draining: AtomicBool,
    inflight: AtomicUsize,
    idle: Notify,
    /// Why the worker cannot serve anymore; set once, by [`Drain::fail`].
    failure: watch::Sender<Option<String>>,
}

/// Whether a backend error leaves this process's device unusable (a sticky CUDA error such as an illegal
/// address or an ECC error, device memory exhausted) or its expert-parallel group down: the worker must
/// stop, not only fail the batch.
pub fn is_fatal(e: &EngineError) -> bool {
    matches!(e, EngineError::Device(_) | EngineError::GroupDown(_))
}

/// The error every request that a worker failure ends is given.
pub fn failed_request_error(reason: &str) -> String {
    format!("{reason}; the worker is shutting down")
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
        Arc::new(Drain {
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            failure: watch::Sender::new(None),
        })
    }

    /// A guard for a new request, or the gRPC status to answer while draining or failed.
    pub fn admit(self: &Arc<Self>) -> Result<InflightGuard, tonic::Status> {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = InflightGuard(self.clone());
        if self.draining.load(Ordering::SeqCst) {
            return Err(tonic::Status::unavailable(match self.failure() {
                Some(reason) => format!("worker failed ({reason}); retry on another worker"),
                None => "worker is draining (shutting down); retry on another worker".into(),
            }));
        }
        Ok(guard)
    }

    /// The worker cannot serve anymore (its device failed): refuses new work from now on and wakes
    /// [`serve_until_drained`](crate::server::serve_until_drained), which deregisters and stops without
    /// waiting for in-flight requests. The caller fails those itself. The first reason wins.
    pub fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.draining.store(true, Ordering::SeqCst);
        self.failure.send_if_modified(|f| {
            if f.is_some() {
                return false;
            }
            *f = Some(reason);
            true
        });
    }

    /// Why the worker failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Resolves with the reason once [`Drain::fail`] is called.
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.subscribe();
        // The sender lives in `self`, so the wait ends only with a reason.
        rx.wait_for(Option::is_some).await.ok().and_then(|f| f.clone()).unwrap_or_default()
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

    #[tokio::test]
    async fn a_failure_refuses_new_work_naming_the_reason_and_wakes_the_waiter_once() {
        let d = Drain::new();
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.failed().await })
        };
        let running = d.admit().expect("admitted before the failure");
        d.fail("device failure in a decode step: device: ECC error");
        d.fail("a later reason");
        assert_eq!(waiter.await.unwrap(), "device failure in a decode step: device: ECC error");
        assert!(d.is_draining());
        let refused = d.admit().err().expect("refused after the failure");
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert!(refused.message().contains("ECC error"), "{}", refused.message());
        // Already failed: resolves at once.
        assert!(d.failed().await.contains("ECC error"));
        drop(running);
    }

    #[test]
    fn only_device_errors_are_fatal() {
        assert!(is_fatal(&EngineError::Device("illegal address".into())));
        assert!(is_fatal(&EngineError::GroupDown("rank 1 lost".into())));
        assert!(!is_fatal(&EngineError::InvalidInput("bad token".into())));
        assert!(!is_fatal(&EngineError::Unsupported("fp4".into())));
    }
}
