//! The workers the router knows: followed from discovery, polled for load and health.

mod breaker;
mod handle;
mod health;
mod pool;

pub use breaker::Breaker;
pub use handle::{HandleSettings, InFlight, WorkerHandle};
pub use pool::{PoolSettings, WorkerPool};

/// Whether a gRPC failure points at the worker (counts toward its circuit breaker) rather than at the
/// request or at load.
pub fn is_worker_fault(status: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(status.code(), Unavailable | Internal | Unknown | DeadlineExceeded | DataLoss | Cancelled)
}

/// A failed call's reason for logs: the status message and, for a connection that failed (a refused
/// port, a TLS handshake), what its error chain says, with a hint naming the TLS flag to fix. `tls`: the
/// router dials workers over TLS, where a worker hanging up right away usually refused the router's
/// certificate (TLS 1.3 reports that only after the handshake, and HTTP/2 then just sees a closed
/// connection); the worker's log names the reason.
pub fn status_reason(status: &tonic::Status, tls: bool) -> String {
    let Some(cause) = std::error::Error::source(status) else { return status.message().to_owned() };
    let d = tls::diagnose::diagnose(cause);
    match d.cause {
        tls::diagnose::Cause::Closed if tls => {
            format!(
                "{}: {} ({}; see the worker's log)",
                status.message(),
                d.detail,
                tls::diagnose::CLOSED_AFTER_HANDSHAKE
            )
        }
        _ => format!("{}: {d}", status.message()),
    }
}
