//! The prefill worker: batches incoming prefills under a token budget (long prompts in chunks), reuses
//! cached prefix blocks, runs the dense indexer + MLA prefill and the MTP prefill, samples the first token
//! and the MTP draft, and ships each layer's caches to the decode worker's reserved blocks as soon as the
//! layer is done (kv-transfer).
//!
//! - [`service`]: the `tandem.v1.PrefillWorker` gRPC service.
//! - [`scheduler`]: the prefill batcher on the shared compute loop; handshakes and completions on helper
//!   threads.
//! - [`prefix_cache`]: automatic prefix caching of full blocks.
//! - [`metrics`]: Prometheus metrics.
//! - [`fault`]: the test builds' stall of the first batch (`TANDEM_PREFILL_FAULT`).

pub mod fault;
pub mod metrics;
pub mod prefix_cache;
pub mod scheduler;
pub mod service;

use std::sync::Arc;

use anyhow::Context;
use proto::v1::prefill_worker_server::PrefillWorkerServer;
use worker::{Drain, LoadedModel, ServeArgs};

/// `prefill-worker` flags.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "prefill-worker", version, about = "tandem prefill worker")]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Do not reuse cached prefix blocks.
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
}

/// Runs the prefill worker until SIGTERM/SIGINT, then drains (with `--check-config`: validates and returns).
/// A device failure ends it at once with an error naming the failure.
pub async fn run(args: Args) -> anyhow::Result<()> {
    match LoadedModel::load_unless_checking(&args.serve, "prefill-worker").await? {
        Some(model) => serve(args, Arc::new(model)).await,
        None => Ok(()),
    }
}

/// Serves an already loaded model (`run` after loading; tests pass a fake backend's).
pub async fn serve(args: Args, model: Arc<LoadedModel>) -> anyhow::Result<()> {
    let sender = kv_transfer::KvSender::new(
        kv_transfer::SenderConfig { ucx_tls: args.serve.ucx_tls.clone(), ..Default::default() },
        model.cache.clone(),
        model.fingerprint.clone(),
    )
    .context("starting the kv-transfer sender")?;
    let drain = Drain::new();
    let (metrics, metrics_addr) = worker::metrics::start(
        args.serve.metrics_listen,
        drain.clone(),
        model.backend.clone(),
        metrics::PrefillMetrics::new,
    )
    .await?;
    let scheduler = scheduler::Scheduler::start(
        model.clone(),
        sender,
        metrics,
        drain.clone(),
        scheduler::Config {
            max_num_seqs: args.serve.max_num_seqs,
            max_num_batched_tokens: args.serve.max_num_batched_tokens,
            prefix_caching: !args.no_prefix_caching,
            fault: fault::Fault::from_env().map_err(anyhow::Error::msg)?,
        },
        tokio::runtime::Handle::current(),
    )
    .context("starting the prefill loop")?;
    let (listener, record) = worker::server::bind(&args.serve, &model, proto::v1::WorkerRole::Prefill).await?;
    let svc = service::PrefillService { model: model.clone(), scheduler, drain: drain.clone(), record: record.clone() };
    worker::server::serve_until_drained(
        PrefillWorkerServer::new(svc),
        listener,
        &args.serve,
        record,
        drain,
        metrics_addr,
        &model.name,
    )
    .await
}
