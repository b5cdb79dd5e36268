//! What both worker roles share, so that neither binary imports the other:
//!
//! - [`args::ServeArgs`]: the serving flags (model, precision, pool size, batching limits, discovery,
//!   kv-transfer transport), flattened into each role's command line.
//! - [`model::LoadedModel`]: the backend, the cache pool and the model fingerprint.
//! - [`register`]: registration with etcd (lease kept alive, re-registered after outages) with
//!   `--discovery etcd`; static discovery otherwise.
//! - [`drain::Drain`]: SIGTERM handling: finish in-flight work, refuse new work, deregister, exit; and a
//!   device failure ([`drain::Drain::fail`]): deregister at once and exit non-zero with the reason.
//! - [`metrics`]: the Prometheus `/metrics` endpoint.
//! - [`convert`]: tandem.v1 <-> engine conversions (sampling parameters, generated tokens).
//! - [`server`]: bind, serve with gRPC health, register, announce ready, drain on SIGTERM, stop at once
//!   on a device failure.
//! - [`validate`]: request id and token checks both services apply.
//! - [`compute_loop`]: the compute thread both roles run (commands, abort, idle wait, release).
//! - `fake_backend` (feature `fake-backend`): a fast deterministic backend for the roles' tests, which can
//!   fail a chosen call (a device failure or an input error).

pub mod args;
pub mod compute_loop;
pub mod convert;
pub mod drain;
#[cfg(feature = "fake-backend")]
pub mod fake_backend;
pub mod metrics;
pub mod model;
pub mod server;
pub mod validate;

use std::time::Duration;

pub use args::ServeArgs;
pub use drain::Drain;
pub use model::LoadedModel;

/// Sends UCX's own log lines to stderr (UCX writes them to stdout by default, where workers print their
/// machine-readable ready line). `stderr` is UCX's name for the stream itself: a path such as
/// `/dev/stderr` would be opened with truncation, wiping a log file that stderr is redirected to.
/// Call first thing in `main`, before any thread exists.
pub fn ucx_logs_to_stderr() {
    if std::env::var_os("UCX_LOG_FILE").is_none() {
        // SAFETY: called at the start of main, while the process is single-threaded.
        unsafe { std::env::set_var("UCX_LOG_FILE", "stderr") };
    }
}

/// A worker binary's `main` once its flags are parsed and its logging is on: runs `serve` on a tokio
/// runtime; an error is printed as `binary: error` and the exit code is a failure.
pub fn run_main(binary: &str, serve: impl std::future::Future<Output = anyhow::Result<()>>) -> std::process::ExitCode {
    match tokio::runtime::Runtime::new().map_err(anyhow::Error::from).and_then(|rt| rt.block_on(serve)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{binary}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Registers the worker with `--discovery etcd` (the handle keeps the lease alive); `None` with static
/// discovery, where the router learns about the worker from its own flags and `GetInfo`.
pub async fn register(
    args: &ServeArgs,
    record: cluster::WorkerRecord,
) -> anyhow::Result<Option<cluster::Registration>> {
    if args.discovery.kind == cluster::DiscoveryKind::Static {
        return Ok(None);
    }
    let discovery = cluster::connect(args.discovery.config(Vec::new(), Vec::new())).await?;
    let mut reg = discovery.register(record).await?;
    if !reg.wait_registered(Duration::from_secs(5)).await {
        tracing::warn!(state = ?reg.state(), "not registered in etcd yet; retrying in the background");
    }
    Ok(Some(reg))
}
