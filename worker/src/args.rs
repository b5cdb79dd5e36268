//! Serving flags shared by both worker roles (each flag also reads a `TANDEM_*` environment variable).

use std::net::SocketAddr;
use std::path::PathBuf;

use engine::{Device, Precision};
use kv_transfer::TransportKind;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Checkpoint directory (HF layout: config.json, safetensors shards + index), or a synthetic model built in
    /// memory (`synthetic:v32[,...]`, engine::synthetic).
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// fp8: block-scaled FP8 weights, activations and caches; full: f32 (for comparisons).
    #[arg(long, env = "TANDEM_PRECISION", default_value = "fp8")]
    pub precision: Precision,
    /// Where the model runs: cpu, or cuda[:N] (the CUDA backend on GPU N).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// Expert parallelism: this worker is rank RANK of a group of WORLD workers, one GPU each, that split
    /// the routed experts and step in lockstep (`RANK/WORLD@HOST:PORT`; rank 0 listens on HOST:PORT and
    /// the others connect to it). Each rank is a worker of its own (its requests, caches and address).
    /// When one rank fails, every rank of the group exits and is restarted (docs/model.md §5.1).
    #[arg(long, env = "TANDEM_EP")]
    pub ep: Option<String>,
    /// Expert parallelism: the longest one forward pass may take before the group is declared down (a rank
    /// lost or hung). Above the longest prefill chunk.
    #[arg(long, env = "TANDEM_EP_STEP_TIMEOUT_SECS", default_value_t = 10.0)]
    pub ep_step_timeout_secs: f64,
    /// Expert parallelism: how long the ranks wait for each other at start-up.
    #[arg(long, env = "TANDEM_EP_START_TIMEOUT_SECS", default_value_t = 300.0)]
    pub ep_start_timeout_secs: f64,
    /// Expert parallelism: balance the experts' load at run time (EPLB: hot experts copied into spare
    /// slots, experts moved between ranks; docs/model.md §5.2). Off, the loads are still counted and logged.
    #[arg(long, env = "TANDEM_EPLB")]
    pub eplb: bool,
    /// Load balancing: spare expert slots per rank, for copies of hot experts.
    #[arg(long, env = "TANDEM_EPLB_REDUNDANT", default_value_t = 0)]
    pub eplb_redundant: usize,
    /// Load balancing: busy steps between two looks at the loads.
    #[arg(long, env = "TANDEM_EPLB_INTERVAL", default_value_t = 256)]
    pub eplb_interval: usize,
    /// Load balancing: looks whose loads a placement is computed from.
    #[arg(long, env = "TANDEM_EPLB_WINDOW", default_value_t = 4)]
    pub eplb_window: usize,
    /// Load balancing: GPUs per node of the group, for the hierarchical policy (default: one node).
    #[arg(long, env = "TANDEM_EPLB_GPUS_PER_NODE")]
    pub eplb_gpus_per_node: Option<usize>,
    /// Load balancing: a layer moves only where that lowers its busiest GPU's load over the mean by at
    /// least this fraction.
    #[arg(long, env = "TANDEM_EPLB_MIN_GAIN", default_value_t = 0.05)]
    pub eplb_min_gain: f64,
    /// Expert parallelism: dual-batch overlap of the main passes (two micro-batches, each one's exchanges
    /// under the other's compute): `auto` (prefill passes of at least 1024 rows on the largest rank, where
    /// each rank holds at most 16 routed experts a layer; decode never), `on`, `off`, or
    /// `auto:DECODE_ROWS,PREFILL_ROWS` (the 16-expert limit holds for it too). Every rank of a group must
    /// have the same setting (the rendezvous refuses one that differs).
    #[arg(long, env = "TANDEM_DBO", default_value = "auto")]
    pub dbo: String,
    /// The model name clients send; defaults to the checkpoint directory's name.
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// gRPC listen address (port 0 picks a free one; the chosen address is logged and registered).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// host:port the router should dial (default: the listen address; required when listening on all
    /// interfaces, e.g. the pod IP in Kubernetes).
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
    /// TLS on the gRPC port (`--tls-cert`/`--tls-key`; with `--tls-ca` clients must present a certificate
    /// signed by it). Plaintext when none is given.
    #[command(flatten)]
    pub tls: tls::TlsArgs,
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
    /// Host put in TCP kv-transfer descriptors, which prefill workers dial (default: the --kv-listen IP;
    /// required when --kv-listen is on all interfaces, e.g. the pod IP in Kubernetes).
    #[arg(long, env = "TANDEM_KV_ADVERTISE_HOST")]
    pub kv_advertise_host: Option<String>,
    /// Overrides UCX_TLS for kv-transfer (e.g. "tcp", "sm").
    #[arg(long, env = "TANDEM_UCX_TLS")]
    pub ucx_tls: Option<String>,
    /// Seconds a draining worker waits for in-flight requests after SIGTERM.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// CPU backend compute threads (default: one per core).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub log: logging::LogArgs,
    /// Validate every argument, print the result and exit (0 when valid) without loading the model or
    /// binding anything. The model directory itself is checked by `tandem verify`.
    #[arg(long, env = "TANDEM_CHECK_CONFIG")]
    pub check_config: bool,
}

/// Checks a `host:port` flag value: a non-empty host and a non-zero port.
pub fn check_host_port(flag: &str, v: &str) -> anyhow::Result<()> {
    let ok = v.rsplit_once(':').is_some_and(|(h, p)| {
        let h = h.trim_start_matches('[').trim_end_matches(']');
        !h.is_empty() && !h.contains(char::is_whitespace) && p.parse::<u16>().is_ok_and(|p| p > 0)
    });
    anyhow::ensure!(ok, "{flag} {v:?}: expected HOST:PORT with a non-zero port");
    Ok(())
}

impl ServeArgs {
    /// Checks what clap cannot, before anything is loaded or bound (`--check-config` stops after this).
    /// Messages name the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.kv_blocks != Some(0), "--kv-blocks must be at least 1");
        anyhow::ensure!(
            self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0,
            "--gpu-memory-utilization must be in (0, 1], got {}",
            self.gpu_memory_utilization
        );
        anyhow::ensure!(self.max_num_seqs > 0, "--max-num-seqs must be at least 1");
        anyhow::ensure!(self.max_num_batched_tokens > 0, "--max-num-batched-tokens must be at least 1");
        anyhow::ensure!(self.max_model_len != Some(0), "--max-model-len must be at least 1");
        anyhow::ensure!(self.threads != Some(0), "--threads must be at least 1");
        self.ep_config()?;
        anyhow::ensure!(!self.model.as_os_str().is_empty(), "--model must name a checkpoint directory");
        if let Some(m) = self.model.to_str().filter(|m| engine::synthetic::is_synthetic(m)) {
            m.parse::<engine::synthetic::SyntheticSpec>().map_err(|e| anyhow::anyhow!("--model {e}"))?;
        }
        if let Some(a) = &self.advertise {
            check_host_port("--advertise", a)?;
        } else {
            anyhow::ensure!(
                !self.listen.ip().is_unspecified(),
                "--listen {} is on all interfaces: give --advertise HOST:PORT (the address routers dial, e.g. the pod IP)",
                self.listen
            );
        }
        if let Some(h) = &self.kv_advertise_host {
            anyhow::ensure!(
                (!h.is_empty() && !h.contains([':', '/'])) || h.parse::<std::net::IpAddr>().is_ok(),
                "--kv-advertise-host {h:?}: expected a host name or IP address (no port)"
            );
        } else {
            anyhow::ensure!(
                self.kv_transport == TransportKind::InProc || !self.kv_listen.ip().is_unspecified(),
                "--kv-listen {} is on all interfaces: give --kv-advertise-host HOST (the address prefill workers dial)",
                self.kv_listen
            );
        }
        if let Some(tls) = &self.ucx_tls {
            anyhow::ensure!(!tls.trim().is_empty(), "--ucx-tls must not be empty");
        }
        if self.kv_transport == TransportKind::Ucx {
            // TANDEM_UCX_DATA_PATH=put without TANDEM_UCX_ONE_SIDED_PUTS=1, or a bad value.
            kv_transfer::transport::ucx::check_env(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
        }
        self.grpc_tls()?;
        self.discovery.validate().map_err(anyhow::Error::msg)
    }

    /// The gRPC port's TLS, its files read and checked (`None`: plaintext).
    pub fn grpc_tls(&self) -> anyhow::Result<Option<tls::ServerTls>> {
        Ok(self.tls.server()?)
    }

    /// "off", "tls" (server certificate only) or "mutual" (client certificates required).
    fn tls_mode(&self) -> &'static str {
        match (&self.tls.cert, &self.tls.ca) {
            (None, _) => "off",
            (Some(_), None) => "tls",
            (Some(_), Some(_)) => "mutual",
        }
    }

    /// The `--check-config` report: prints that `role`'s arguments are valid.
    pub fn report_config_ok(&self, role: &str) {
        println!(
            "{}",
            serde_json::json!({"event": "config-ok", "role": role, "model": self.model.display().to_string(),
                "listen": self.listen.to_string(), "advertise": self.advertise,
                "discovery": self.discovery.kind.as_str(), "tls": self.tls_mode()})
        );
    }

    pub fn served_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| self.model.display().to_string())
        })
    }

    /// The expert-parallel group this worker joins (`--ep`), checked.
    pub fn ep_config(&self) -> anyhow::Result<Option<engine::cuda::ep::EpConfig>> {
        let eplb = engine::eplb::EplbConfig {
            rebalance: self.eplb,
            redundant: self.eplb_redundant,
            interval: self.eplb_interval,
            window: self.eplb_window,
            gpus_per_node: self.eplb_gpus_per_node,
            min_gain: self.eplb_min_gain,
        };
        let dbo = engine::cuda::ep::Dbo::parse(&self.dbo).map_err(|e| anyhow::anyhow!("--dbo {e}"))?;
        let Some(spec) = &self.ep else {
            // Ignored, not refused: `tandem up` passes its environment (TANDEM_EPLB, TANDEM_DBO) to every
            // worker, expert-parallel or not.
            if eplb != engine::eplb::EplbConfig::default() || dbo != engine::cuda::ep::Dbo::default() {
                tracing::warn!("--eplb* and --dbo apply to expert-parallel groups: without --ep they do nothing");
            }
            return Ok(None);
        };
        let mut cfg = engine::cuda::ep::EpConfig::parse(spec).map_err(|e| anyhow::anyhow!("--ep {e}"))?;
        anyhow::ensure!(
            matches!(self.device, Device::Cuda(_)),
            "--ep {spec}: expert parallelism runs on GPUs (--device cuda:N), not on {}",
            self.device
        );
        anyhow::ensure!(
            self.precision == Precision::Fp8,
            "--ep {spec}: expert parallelism runs the FP8 experts (--precision fp8)"
        );
        let secs = |flag: &str, v: f64| -> anyhow::Result<std::time::Duration> {
            anyhow::ensure!(v.is_finite() && v > 0.0 && v <= 86_400.0, "{flag} must be in (0, 86400] seconds, got {v}");
            Ok(std::time::Duration::from_secs_f64(v))
        };
        cfg.step_timeout = secs("--ep-step-timeout-secs", self.ep_step_timeout_secs)?;
        cfg.timeout = secs("--ep-start-timeout-secs", self.ep_start_timeout_secs)?;
        // The spare slots against the model's experts are checked where the model is known (the backend).
        eplb.check_settings(cfg.world).map_err(|e| anyhow::anyhow!("--eplb settings: {e}"))?;
        cfg.eplb = eplb;
        cfg.dbo = dbo;
        Ok(Some(cfg))
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
        let tcp = kv_transfer::TcpConfig { listen: self.kv_listen, advertise_host: self.kv_advertise_host.clone() };
        match self.kv_transport {
            TransportKind::Ucx => {
                kv_transfer::TransportConfig::Ucx { tls: self.ucx_tls.clone(), tcp_fallback: Some(tcp) }
            }
            TransportKind::Tcp => kv_transfer::TransportConfig::Tcp(tcp),
            TransportKind::InProc => kv_transfer::TransportConfig::InProc,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(extra: &[&str]) -> ServeArgs {
        let argv = ["w", "--model", "/models/m"].into_iter().chain(extra.iter().copied());
        Cli::try_parse_from(argv).unwrap().serve
    }

    #[test]
    fn all_interfaces_need_an_advertised_address() {
        assert!(parse(&[]).validate().is_ok(), "loopback defaults are valid");
        let err = parse(&["--listen", "0.0.0.0:8100"]).validate().unwrap_err().to_string();
        assert!(err.contains("--advertise"), "{err}");
        assert!(parse(&["--listen", "0.0.0.0:8100", "--advertise", "10.1.2.3:8100"]).validate().is_ok());
        let err = parse(&["--advertise", "10.1.2.3"]).validate().unwrap_err().to_string();
        assert!(err.contains("--advertise"), "{err}");

        let err = parse(&["--kv-listen", "0.0.0.0:9000"]).validate().unwrap_err().to_string();
        assert!(err.contains("--kv-advertise-host"), "{err}");
        let ok = parse(&["--kv-listen", "0.0.0.0:9000", "--kv-advertise-host", "10.1.2.3"]);
        assert!(ok.validate().is_ok());
        let err = parse(&["--kv-advertise-host", "10.1.2.3:9000"]).validate().unwrap_err().to_string();
        assert!(err.contains("no port"), "{err}");
    }

    #[test]
    fn a_synthetic_model_spec_is_checked_with_the_flags() {
        let with = |m: &str| Cli::try_parse_from(["w", "--model", m]).unwrap().serve.validate();
        assert!(with("synthetic:v32,layers=8,experts=32").is_ok());
        let err = with("synthetic:v32,layers=zero").unwrap_err().to_string();
        assert!(err.contains("--model") && err.contains("layers=zero"), "{err}");
    }

    #[test]
    fn expert_parallel_flags_are_checked_before_anything_loads() {
        let cfg = parse(&["--device", "cuda:1", "--ep", "1/2@10.0.0.5:29500", "--ep-step-timeout-secs", "30"])
            .ep_config()
            .unwrap()
            .unwrap();
        assert_eq!((cfg.rank, cfg.world, cfg.leader.as_str()), (1, 2, "10.0.0.5:29500"));
        assert_eq!(cfg.step_timeout, std::time::Duration::from_secs(30));
        assert!(parse(&[]).ep_config().unwrap().is_none());
        for (flags, want) in [
            (&["--ep", "0/2@127.0.0.1:29500"][..], "runs on GPUs"),
            (&["--device", "cuda", "--ep", "2/2@127.0.0.1:29500"][..], "rank 2 is not one of 2 ranks"),
            (&["--device", "cuda", "--ep", "0/2"][..], "RANK/WORLD@HOST:PORT"),
            (&["--device", "cuda", "--ep", "0/2@h:1", "--precision", "full"][..], "--precision fp8"),
            (&["--device", "cuda", "--ep", "0/2@h:1", "--ep-step-timeout-secs", "0"][..], "--ep-step-timeout-secs"),
        ] {
            let err = parse(flags).validate().unwrap_err().to_string();
            assert!(err.contains("--ep") && err.contains(want), "{flags:?}: {err}");
        }
    }

    #[test]
    fn load_balancing_flags_reach_the_group_or_are_refused_with_the_reason() {
        let ep = ["--device", "cuda", "--ep", "0/2@h:1"];
        let with = |extra: &[&str]| parse(&[&ep[..], extra].concat());
        let cfg = with(&["--eplb", "--eplb-redundant", "2", "--eplb-interval", "64"]).ep_config().unwrap().unwrap();
        assert!(cfg.eplb.rebalance && cfg.eplb.redundant == 2 && cfg.eplb.interval == 64 && cfg.eplb.window == 4);
        assert!(!with(&[]).ep_config().unwrap().unwrap().eplb.rebalance, "off by default");
        for (flags, want) in [
            (&["--eplb-interval", "0"][..], "at least 1"),
            (&["--eplb-min-gain", "1.5"][..], "minimum gain"),
            (&["--eplb-gpus-per-node", "3"][..], "nodes of 3"),
        ] {
            let err = with(flags).validate().unwrap_err().to_string();
            assert!(err.contains("--eplb settings") && err.contains(want), "{flags:?}: {err}");
        }
        // Without --ep (a worker `tandem up` started with TANDEM_EPLB in its environment) they do nothing.
        assert!(parse(&["--eplb", "--dbo", "on"]).ep_config().unwrap().is_none());
        assert_eq!(with(&["--dbo", "off"]).ep_config().unwrap().unwrap().dbo, engine::cuda::ep::Dbo::Off);
        assert!(with(&["--dbo", "sometimes"]).validate().unwrap_err().to_string().contains("--dbo"));
        assert!(parse(&["--dbo", "sometimes"]).validate().unwrap_err().to_string().contains("--dbo"));
    }

    #[test]
    fn the_advertised_kv_host_goes_into_tcp_descriptors() {
        let a = parse(&["--kv-transport", "tcp", "--kv-listen", "0.0.0.0:0", "--kv-advertise-host", "decode-0.tandem"]);
        match a.transport_config() {
            kv_transfer::TransportConfig::Tcp(t) => assert_eq!(t.advertise_host.as_deref(), Some("decode-0.tandem")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tls_and_etcd_files_are_read_at_validation_and_named_when_unreadable() {
        let err = parse(&["--tls-cert", "/nonexistent/w.crt", "--tls-key", "/nonexistent/w.key"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--tls-cert /nonexistent/w.crt: cannot read it"), "{err}");
        let err = parse(&["--tls-ca", "/nonexistent/ca.pem"]).validate().unwrap_err().to_string();
        assert!(err.contains("needs --tls-cert and --tls-key"), "{err}");
        let etcd = ["--discovery", "etcd", "--etcd", "https://etcd:2379", "--etcd-ca", "/nonexistent/etcd-ca.pem"];
        let err = parse(&etcd).validate().unwrap_err().to_string();
        assert!(err.contains("--etcd-ca /nonexistent/etcd-ca.pem: cannot read it"), "{err}");
        let user = ["--discovery", "etcd", "--etcd-user", "w", "--etcd-password-file", "/nonexistent/pw"];
        let err = parse(&user).validate().unwrap_err().to_string();
        assert!(err.contains("--etcd-password-file /nonexistent/pw: cannot read it"), "{err}");
    }

    #[test]
    fn zero_sizes_and_bad_discovery_are_refused_by_name() {
        for (flags, name) in [
            (&["--kv-blocks", "0"][..], "--kv-blocks"),
            (&["--max-num-seqs", "0"][..], "--max-num-seqs"),
            (&["--max-model-len", "0"][..], "--max-model-len"),
            (&["--threads", "0"][..], "--threads"),
            (&["--discovery", "etcd", "--etcd", "etcd"][..], "--etcd"),
        ] {
            let err = parse(flags).validate().unwrap_err().to_string();
            assert!(err.contains(name), "{flags:?}: {err}");
        }
    }
}
