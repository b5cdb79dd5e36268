//! Serving flags shared by both worker roles (each flag also reads a `TANDEM_*` environment variable).

use std::net::SocketAddr;
use std::path::PathBuf;

use engine::{Device, Precision};
use kv_transfer::TransportKind;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Checkpoint directory (HF layout: config.json, safetensors shards + index).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// fp8: block-scaled FP8 weights, activations and caches; full: f32 (for comparisons).
    #[arg(long, env = "TANDEM_PRECISION", default_value = "fp8")]
    pub precision: Precision,
    /// Where the model runs: cpu, or cuda[:N] (GPU N; the CUDA backend is not built yet).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// The model name clients send; defaults to the checkpoint directory's name.
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// gRPC listen address (port 0 picks a free one; the chosen address is logged and registered).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// host:port the router should dial (default: the listen address).
    #[arg(long, env = "TANDEM_ADVERTISE")]
    pub advertise: Option<String>,
    /// Unique worker id (default: role-hostname-pid).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Prometheus /metrics (and /health) listen address; off when absent.
    #[arg(long, env = "TANDEM_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Discovery: `--discovery etcd` registers the worker under /tandem/<cluster>/workers/; with `static`
    /// (the default) it registers nowhere and the router is given its address.
    #[command(flatten)]
    pub discovery: cluster::DiscoveryArgs,
    /// Longest prompt + output in tokens (default: the model's max_position_embeddings, capped by the pool).
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Most requests running at once (decode batch size; concurrent prefills).
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Token budget of one prefill batch (longer prompts are chunked).
    #[arg(long, env = "TANDEM_MAX_NUM_BATCHED_TOKENS", default_value_t = 4096)]
    pub max_num_batched_tokens: usize,
    /// Cache blocks (64 tokens each, every layer) in this worker's pool. CPU: the pool size (default
    /// 2048). GPU: by default what --gpu-memory-utilization leaves after the backend's budget; when
    /// given, an exact size that must fit there.
    #[arg(long, env = "TANDEM_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Fraction of the GPU's memory this worker uses (weights, activations at --max-num-batched-tokens,
    /// graphs, communication buffers, and the cache pool in what remains). Not used on the CPU.
    #[arg(long, env = "TANDEM_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// kv-transfer transport: ucx (TCP fallback when libucp is absent), tcp or inproc.
    #[arg(long, env = "TANDEM_KV_TRANSPORT", default_value = "ucx")]
    pub kv_transport: TransportKind,
    /// Where the decode worker's TCP kv-transfer listener binds (TCP transport and UCX fallback).
    #[arg(long, env = "TANDEM_KV_LISTEN", default_value = "127.0.0.1:0")]
    pub kv_listen: SocketAddr,
    /// Overrides UCX_TLS for kv-transfer (e.g. "tcp", "sm").
    #[arg(long, env = "TANDEM_UCX_TLS")]
    pub ucx_tls: Option<String>,
    /// Seconds a draining worker waits for in-flight requests after SIGTERM.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// CPU backend compute threads (default: one per core).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
}

impl ServeArgs {
    pub fn served_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| self.model.display().to_string())
        })
    }

    /// The backend this worker builds.
    pub fn backend_options(&self) -> engine::device::BackendOptions {
        engine::device::BackendOptions { device: self.device, precision: self.precision, threads: self.threads }
    }

    pub fn worker_id(&self, role: &str) -> String {
        self.worker_id.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "local".into());
            format!("{role}-{host}-{}", std::process::id())
        })
    }

    /// The kv-transfer transport configuration for a receiver.
    pub fn transport_config(&self) -> kv_transfer::TransportConfig {
        let tcp = kv_transfer::TcpConfig { listen: self.kv_listen, advertise_host: None };
        match self.kv_transport {
            TransportKind::Ucx => {
                kv_transfer::TransportConfig::Ucx { tls: self.ucx_tls.clone(), tcp_fallback: Some(tcp) }
            }
            TransportKind::Tcp => kv_transfer::TransportConfig::Tcp(tcp),
            TransportKind::InProc => kv_transfer::TransportConfig::InProc,
        }
    }
}
