//! The decode worker: reserves cache blocks for a request, receives its caches from a prefill worker
//! (kv-transfer), then decodes it with continuous batching (sparse decode over the FP8 cache, MTP
//! speculative decoding) and streams tokens back on the request's `Decode` stream.
//!
//! - [`service`]: the `tandem.v1.DecodeWorker` gRPC service (Decode stream, Abort, GetLoad, GetInfo).
//! - [`admission`]: the reservation policy (prompt + growth, a watermark per running request).
//! - [`scheduler`]: the decode batcher on the shared compute loop: admit, grow or preempt, step, stream.
//! - [`metrics`]: Prometheus metrics (pool usage, MTP acceptance, transfer times, preemptions).

pub mod admission;
pub mod metrics;
pub mod scheduler;
pub mod service;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use proto::v1::decode_worker_server::DecodeWorkerServer;
use worker::{Drain, LoadedModel, ServeArgs};

/// `decode-worker` flags.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "decode-worker", version, about = "tandem decode worker")]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// How long a reservation waits for the prefill worker's transfer, unless the request says otherwise.
    #[arg(long, env = "TANDEM_TRANSFER_TIMEOUT_MS", default_value_t = 30_000)]
    pub transfer_timeout_ms: u64,
    /// Decode without MTP speculative decoding.
    #[arg(long, env = "TANDEM_NO_MTP")]
    pub no_mtp: bool,
    /// Ask prefill workers for per-layer checksums and verify them.
    #[arg(long, env = "TANDEM_VERIFY_CHECKSUM")]
    pub verify_checksum: bool,
    /// Blocks kept free for every running request's growth before a new request is admitted.
    #[arg(long, env = "TANDEM_GROWTH_WATERMARK", default_value_t = 1)]
    pub growth_watermark_blocks: usize,
}

/// Runs the decode worker until SIGTERM/SIGINT, then drains (with `--check-config`: validates and returns).
/// A device failure ends it at once with an error naming the failure.
pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.transfer_timeout_ms > 0, "--transfer-timeout-ms must be at least 1");
    match LoadedModel::load_unless_checking(&args.serve, "decode-worker").await? {
        Some(model) => serve(args, Arc::new(model)).await,
        None => Ok(()),
    }
}

/// Serves an already loaded model (`run` after loading; tests pass a fake backend's).
pub async fn serve(args: Args, model: Arc<LoadedModel>) -> anyhow::Result<()> {
    let receiver = kv_transfer::KvReceiver::start(
        kv_transfer::ReceiverConfig::new(args.serve.transport_config()),
        model.cache.clone(),
        model.pool.clone(),
        model.fingerprint.clone(),
    )
    .context("starting the kv-transfer receiver")?;
    let drain = Drain::new();
    let (metrics, metrics_addr) = worker::metrics::start(
        args.serve.metrics_listen,
        drain.clone(),
        model.backend.clone(),
        metrics::DecodeMetrics::new,
    )
    .await?;
    let sched = scheduler::Scheduler::start(
        model.clone(),
        metrics.clone(),
        drain.clone(),
        !args.no_mtp,
        args.serve.max_num_seqs,
    )
    .context("starting the decode loop")?;
    let (listener, record) = worker::server::bind(&args.serve, &model, proto::v1::WorkerRole::Decode).await?;
    let svc = service::DecodeService::new(service::Shared {
        model: model.clone(),
        receiver,
        scheduler: sched,
        drain: drain.clone(),
        metrics,
        record: record.clone(),
        admission: admission::Policy {
            max_num_seqs: args.serve.max_num_seqs,
            growth_watermark_blocks: args.growth_watermark_blocks,
            max_model_len: model.max_model_len,
        },
        transfer_timeout: Duration::from_millis(args.transfer_timeout_ms),
        verify_checksum: args.verify_checksum,
    });
    worker::server::serve_until_drained(
        DecodeWorkerServer::new(svc),
        listener,
        &args.serve,
        record,
        drain,
        metrics_addr,
        &model.name,
    )
    .await
}
