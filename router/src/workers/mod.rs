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
