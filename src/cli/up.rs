//! `tandem up`: a whole cluster on this machine. Starts the worker processes (this same binary
//! re-executed as `tandem prefill-worker` / `tandem decode-worker`), waits for each to report ready, starts
//! the router pointed at them (static discovery, or etcd with `--etcd`), prints the URL and a curl line,
//! and on Ctrl-C stops everything (SIGTERM, so workers drain, then SIGKILL after a grace period).
//!
//! It supervises, as Kubernetes restarts a pod: a process that dies is logged and started again with
//! the same arguments after a backoff (1 s, doubling to 30 s; reset after a minute of running), while
//! the others keep serving. Workers listen on fixed ports, so the router's static list stays valid.
//! Without `--model` it serves the tiny DeepSeek-V3.2-architecture checkpoint, generated on first run
//! and cached. `--tls-*` (mutual TLS between the router and the workers) and `--etcd-*` (TLS and
//! credentials for `--etcd`) are passed to every process; the files are checked before anything starts.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (default: the tiny model, generated on first run into the cache directory), or a
    /// synthetic model built by each worker from a seed (`synthetic:v32[,...]`, engine::synthetic; the
    /// router reads and writes its text with the tiny tokenizer: for measurements).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Router address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// OpenAI-compatible HTTP port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// tandem.v1.Generate gRPC port.
    #[arg(long, default_value_t = 8001)]
    pub grpc_port: u16,
    /// Prefill worker processes.
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode worker processes.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Expert parallelism of the prefill workers (GPU only): groups of this many consecutive workers, one
    /// GPU each, split the routed experts (`--ep` of each worker). --prefill must be a multiple of it.
    #[arg(long, default_value_t = 1)]
    pub prefill_ep: usize,
    /// Expert parallelism of the decode workers, as --prefill-ep. A group's ranks restart together: when one
    /// dies, the others leave the group, their requests continue on other decode workers, and all rejoin.
    #[arg(long, default_value_t = 1)]
    pub decode_ep: usize,
    /// etcd endpoint(s): workers register there and the router follows them (default: static discovery).
    #[arg(long)]
    pub etcd: Option<String>,
    /// kv-transfer transport: ucx (TCP when libucp is absent), tcp.
    #[arg(long, default_value = "ucx")]
    pub kv_transport: String,
    /// fp8 or full.
    #[arg(long, default_value = "fp8")]
    pub precision: String,
    /// Where the workers run the model: cpu; cuda (workers spread over every GPU, sharing GPUs when there
    /// are more workers than GPUs); cuda:N (every worker on GPU N).
    #[arg(long, default_value = "cpu")]
    pub device: engine::Device,
    /// Fraction of its GPU's memory each worker uses (GPU only; default 0.9 split evenly between the workers
    /// that share a GPU). Workers sharing a GPU must not ask for more than 1 in total.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    #[arg(long)]
    pub max_model_len: Option<usize>,
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Cache blocks (64 tokens each) per worker.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Chat template file replacing the checkpoint's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Require this bearer token on the router (handed to it in its environment, not on its command line,
    /// where `ps` would show it).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<router::ApiKey>,
    /// Decode without MTP speculative decoding.
    #[arg(long)]
    pub no_mtp: bool,
    /// Seconds to wait for each process to become ready.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout: u64,
    /// Mutual TLS between the router and the workers: the CA (PEM) every process trusts. Workers then
    /// require the router's certificate.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// The certificate (PEM) every process uses: workers serve it, the router presents it. It must name
    /// 127.0.0.1 (or --tls-server-name) and allow server and client use.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// The name the router checks in the workers' certificate instead of 127.0.0.1.
    #[arg(long)]
    pub tls_server_name: Option<String>,
    /// With --etcd over TLS: the CA (PEM) that signed etcd's certificate (use https:// endpoints).
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate and key (PEM) for an etcd with --client-cert-auth.
    #[arg(long)]
    pub etcd_cert: Option<PathBuf>,
    #[arg(long)]
    pub etcd_key: Option<PathBuf>,
    /// etcd user; its password from --etcd-password-file or TANDEM_ETCD_PASSWORD (inherited by every
    /// process), never from the command line.
    #[arg(long)]
    pub etcd_user: Option<String>,
    #[arg(long)]
    pub etcd_password_file: Option<PathBuf>,
}

impl Args {
    /// The TLS and etcd flags every process gets.
    fn security_flags(&self) -> Vec<String> {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        let mut v = Vec::new();
        for (flag, val) in [
            ("--tls-ca", path(&self.tls_ca)),
            ("--tls-cert", path(&self.tls_cert)),
            ("--tls-key", path(&self.tls_key)),
            ("--etcd-ca", path(&self.etcd_ca)),
            ("--etcd-cert", path(&self.etcd_cert)),
            ("--etcd-key", path(&self.etcd_key)),
            ("--etcd-user", self.etcd_user.clone()),
            ("--etcd-password-file", path(&self.etcd_password_file)),
        ] {
            if let Some(x) = val {
                v.extend([flag.to_string(), x]);
            }
        }
        v
    }

    /// The TLS files, checked as the workers and the router will (a bad file stops `up` before it starts
    /// anything).
    fn check_tls(&self) -> anyhow::Result<()> {
        let tls = tls::TlsArgs { ca: self.tls_ca.clone(), cert: self.tls_cert.clone(), key: self.tls_key.clone() };
        tls.server().context("the workers' TLS")?;
        tls.client(self.tls_server_name.as_deref()).context("the router's TLS")?;
        let etcd_flags = self.etcd_ca.is_some() || self.etcd_cert.is_some() || self.etcd_user.is_some();
        anyhow::ensure!(self.etcd.is_some() || !etcd_flags, "--etcd-ca/--etcd-cert/--etcd-user need --etcd");
        Ok(())
    }
}

/// The tiny model's served name.
pub const TINY_NAME: &str = "tandem-tiny";

/// Where the tiny model is cached (`$XDG_CACHE_HOME/tandem` or `~/.cache/tandem`).
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tandem")
}

/// The tiny model, generated into the cache on first use.
pub fn tiny_model() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!("tiny-v{}-seed0", env!("CARGO_PKG_VERSION")));
    if engine::checkpoint::Checkpoint::open(&dir).is_ok() && dir.join("tokenizer.json").exists() {
        return Ok(dir);
    }
    eprintln!("generating the tiny model into {} (first run)", dir.display());
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    super::gen_tiny::write(&tmp, 0)?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).with_context(|| format!("moving the tiny model into {}", dir.display()))?;
    Ok(dir)
}

/// First restart delay; it doubles per consecutive crash up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that ran this long before dying starts over at [`FIRST_BACKOFF`].
const STABLE_RUN: Duration = Duration::from_secs(60);

/// A child process with its output forwarded, prefixed by its name.
struct Proc {
    name: String,
    args: Vec<String>,
    /// Environment added to the child's (secrets stay off its command line).
    env: Vec<(String, String)>,
    child: Child,
    started: Instant,
    /// Consecutive crashes (each one doubles the restart delay).
    crashes: u32,
    /// When a dead process is started again.
    restart_at: Option<Instant>,
}

fn start_child(
    name: &str,
    args: &[String],
    env: &[(String, String)],
    ready: Option<mpsc::Sender<(String, String)>>,
) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = Command::new(exe)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    forward(name, child.stderr.take().expect("piped"), None);
    forward(name, child.stdout.take().expect("piped"), ready);
    Ok(child)
}

fn spawn(name: &str, args: &[String], ready: Option<mpsc::Sender<(String, String)>>) -> anyhow::Result<Proc> {
    spawn_with_env(name, args, &[], ready)
}

fn spawn_with_env(
    name: &str,
    args: &[String],
    env: &[(String, String)],
    ready: Option<mpsc::Sender<(String, String)>>,
) -> anyhow::Result<Proc> {
    let child = start_child(name, args, env, ready)?;
    Ok(Proc {
        name: name.to_string(),
        args: args.to_vec(),
        env: env.to_vec(),
        child,
        started: Instant::now(),
        crashes: 0,
        restart_at: None,
    })
}

/// The restart delay after `crashes` consecutive crashes.
fn backoff(crashes: u32) -> Duration {
    FIRST_BACKOFF.saturating_mul(1 << crashes.min(16)).min(MAX_BACKOFF)
}

/// Notices dead processes and starts them again once their backoff passed.
fn supervise(procs: &mut [Proc]) {
    let now = Instant::now();
    for p in procs.iter_mut() {
        if let Some(at) = p.restart_at {
            if now < at {
                continue;
            }
            match start_child(&p.name, &p.args, &p.env, None) {
                Ok(child) => {
                    eprintln!("[{}] restarted (restart {})", p.name, p.crashes);
                    p.child = child;
                    p.started = now;
                    p.restart_at = None;
                }
                Err(e) => {
                    let delay = backoff(p.crashes);
                    p.crashes += 1;
                    eprintln!("[{}] could not be restarted ({e:#}); trying again in {delay:?}", p.name);
                    p.restart_at = Some(now + delay);
                }
            }
            continue;
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            if p.started.elapsed() >= STABLE_RUN {
                p.crashes = 0;
            }
            let delay = backoff(p.crashes);
            p.crashes += 1;
            eprintln!(
                "[{}] exited ({status}) after {:.1} s; restarting in {delay:?} (crash {} in a row); the rest of the cluster keeps serving",
                p.name,
                p.started.elapsed().as_secs_f64(),
                p.crashes
            );
            p.restart_at = Some(now + delay);
        }
    }
}

/// A free TCP port on the loopback interface (for a worker that must keep its address across restarts).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Prints a child's lines as `[name] line`; the first `{"event":"ready",...}` line goes to `ready`.
fn forward(name: &str, out: impl Read + Send + 'static, ready: Option<mpsc::Sender<(String, String)>>) {
    let name = name.to_string();
    std::thread::spawn(move || {
        let mut ready = ready;
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("{\"event\":\"ready\"")
                && let Some(tx) = ready.take()
            {
                let _ = tx.send((name.clone(), line));
                continue;
            }
            eprintln!("[{name}] {line}");
        }
    });
}

/// The ready lines' gRPC addresses of `n` workers; fails as soon as one of `procs` exits (a bad flag or
/// file, refused etcd credentials: its log lines above say why).
fn wait_ready(
    rx: &mpsc::Receiver<(String, String)>,
    n: usize,
    timeout: Duration,
    procs: &mut [Proc],
) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + timeout;
    let mut addrs = Vec::new();
    while addrs.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(!left.is_zero(), "workers did not become ready within {timeout:?}");
        let (name, line) = match rx.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(x) => x,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(name) = exited(procs) {
                    bail!("{name} exited during start-up (see its log lines above)");
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("workers did not become ready"),
        };
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{name}: bad ready line {line}"))?;
        let grpc = v["grpc"].as_str().with_context(|| format!("{name}: no grpc address in {line}"))?;
        addrs.push(grpc.to_string());
    }
    Ok(addrs)
}

/// GET `path` on host:port; the status code.
fn http_status(host: &str, port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect((host, port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The name of a child that has exited, if any.
fn exited(procs: &mut [Proc]) -> Option<String> {
    procs.iter_mut().find_map(|p| matches!(p.child.try_wait(), Ok(Some(_))).then(|| p.name.clone()))
}

fn terminate(procs: &mut [Proc], grace: Duration) {
    // A process waiting for its restart was already reaped: its pid may belong to someone else now.
    for p in procs.iter().filter(|p| p.restart_at.is_none()) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    for p in procs.iter_mut() {
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    eprintln!("[{}] did not stop in time; killing", p.name);
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// Where each worker runs (prefill workers first, then decode) and the memory fraction it takes: one
/// GPU each while there are enough, shared round-robin otherwise (each worker then takes its share of
/// 0.9 of the GPU unless `--gpu-memory-utilization` says otherwise). On the CPU: the CPU, no fraction.
pub fn placements(a: &Args, gpus: usize) -> anyhow::Result<Vec<(engine::Device, Option<f64>)>> {
    let workers = a.prefill + a.decode;
    let ordinals: Vec<u32> = match a.device {
        engine::Device::Cpu => return Ok(vec![(engine::Device::Cpu, a.gpu_memory_utilization); workers]),
        // `cuda` spreads over every GPU; `cuda:N` pins every worker to GPU N.
        engine::Device::Cuda(0) if gpus > 1 => (0..workers).map(|i| (i % gpus) as u32).collect(),
        engine::Device::Cuda(n) => vec![n; workers],
    };
    for (role, first, n, ep) in [("prefill", 0, a.prefill, a.prefill_ep), ("decode", a.prefill, a.decode, a.decode_ep)]
    {
        if ep <= 1 {
            continue;
        }
        for g in 0..n / ep {
            let gpus: Vec<u32> = ordinals[first + g * ep..first + (g + 1) * ep].to_vec();
            let distinct: std::collections::HashSet<u32> = gpus.iter().copied().collect();
            anyhow::ensure!(
                distinct.len() == ep,
                "--{role}-ep {ep}: the ranks of {role} group {g} would share GPUs {gpus:?} (each rank needs its own \
                 GPU: use --device cuda on a machine with at least {ep} GPUs)"
            );
        }
    }
    let mut sharing = std::collections::HashMap::<u32, usize>::new();
    for &o in &ordinals {
        *sharing.entry(o).or_default() += 1;
    }
    if let Some(u) = a.gpu_memory_utilization
        && let Some((o, n)) = sharing.iter().find(|(_, n)| **n as f64 * u > 1.0 + 1e-9)
    {
        bail!(
            "{n} workers share GPU {o}: --gpu-memory-utilization {u} each would take {:.2} of it (at most 1); \
             lower it or run fewer workers",
            *n as f64 * u
        );
    }
    Ok(ordinals
        .into_iter()
        .map(|o| (engine::Device::Cuda(o), Some(a.gpu_memory_utilization.unwrap_or(0.9 / sharing[&o] as f64))))
        .collect())
}

/// Checks the expert-parallel flags.
fn check_ep(a: &Args) -> anyhow::Result<()> {
    for (role, n, ep) in [("prefill", a.prefill, a.prefill_ep), ("decode", a.decode, a.decode_ep)] {
        anyhow::ensure!(ep >= 1, "--{role}-ep must be at least 1");
        anyhow::ensure!(
            n.is_multiple_of(ep),
            "--{role} {n} is not a multiple of --{role}-ep {ep} (each group has {ep} workers)"
        );
        anyhow::ensure!(
            ep == 1 || matches!(a.device, engine::Device::Cuda(_)),
            "--{role}-ep {ep}: expert parallelism runs on GPUs (--device cuda)"
        );
        anyhow::ensure!(
            ep == 1 || a.precision == "fp8",
            "--{role}-ep {ep}: expert parallelism runs the FP8 experts (--precision fp8)"
        );
    }
    Ok(())
}

/// Each worker's `--ep` (prefill workers first, then decode): rank `i % ep` of its group, whose leader
/// listens on the group's own port.
fn ep_specs(a: &Args) -> anyhow::Result<Vec<Option<String>>> {
    let mut specs = Vec::new();
    for (n, ep) in [(a.prefill, a.prefill_ep), (a.decode, a.decode_ep)] {
        let mut port = 0;
        for i in 0..n {
            if ep <= 1 {
                specs.push(None);
                continue;
            }
            if i % ep == 0 {
                port = free_port()?;
            }
            specs.push(Some(format!("{}/{ep}@127.0.0.1:{port}", i % ep)));
        }
    }
    Ok(specs)
}

fn worker_args(a: &Args, role: &str, model: &Path, port: u16, place: (engine::Device, Option<f64>)) -> Vec<String> {
    let mut v = vec![
        role.to_string(),
        "--model".into(),
        model.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--kv-transport".into(),
        a.kv_transport.clone(),
        "--precision".into(),
        a.precision.clone(),
        "--device".into(),
        place.0.to_string(),
    ];
    let mut opt = |flag: &str, val: Option<String>| {
        if let Some(x) = val {
            v.push(flag.into());
            v.push(x);
        }
    };
    opt("--max-model-len", a.max_model_len.map(|x| x.to_string()));
    opt("--max-num-seqs", a.max_num_seqs.map(|x| x.to_string()));
    opt("--max-num-batched-tokens", a.max_num_batched_tokens.map(|x| x.to_string()));
    opt("--kv-blocks", a.kv_blocks.map(|x| x.to_string()));
    opt("--gpu-memory-utilization", place.1.map(|x| x.to_string()));
    opt("--served-model-name", a.served_model_name.clone());
    if let Some(e) = &a.etcd {
        v.extend(["--discovery".into(), "etcd".into(), "--etcd".into(), e.clone()]);
    }
    v.extend(a.security_flags());
    if a.no_mtp && role == "decode-worker" {
        v.push("--no-mtp".into());
    }
    v
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if a.prefill == 0 || a.decode == 0 {
        bail!("--prefill and --decode must each be at least 1");
    }
    check_ep(&a)?;
    a.check_tls()?;
    engine::device::check_available(a.device)?;
    let gpus = match a.device {
        engine::Device::Cpu => 0,
        engine::Device::Cuda(_) => engine::cuda::device::device_count()?,
    };
    let place = placements(&a, gpus)?;
    if a.device != engine::Device::Cpu {
        for (i, (d, u)) in place.iter().enumerate() {
            let role = if i < a.prefill { format!("prefill-{i}") } else { format!("decode-{}", i - a.prefill) };
            eprintln!("{role}: {d}, --gpu-memory-utilization {:.3}", u.unwrap_or(0.9));
        }
    }
    let mut a = a;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => {
            a.served_model_name.get_or_insert_with(|| TINY_NAME.to_string());
            tiny_model()?
        }
    };
    match model.to_str().filter(|m| engine::synthetic::is_synthetic(m)) {
        // Built by each worker from its seed; the router serves it with the tiny tokenizer.
        Some(m) => {
            m.parse::<engine::synthetic::SyntheticSpec>().map_err(|e| anyhow::anyhow!("--model {e}"))?;
        }
        None => {
            engine::ModelConfig::from_path(&model)
                .with_context(|| format!("{} is not a servable checkpoint", model.display()))?;
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing the Ctrl-C handler")?;
    }
    let mut procs: Vec<Proc> = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        let timeout = Duration::from_secs(a.ready_timeout);
        let (tx, rx) = mpsc::channel();
        let ep = ep_specs(&a)?;
        let with_ep = |mut args: Vec<String>, spec: &Option<String>| {
            if let Some(s) = spec {
                args.extend(["--ep".into(), s.clone()]);
            }
            args
        };
        for (i, &p) in place[..a.prefill].iter().enumerate() {
            let args = with_ep(worker_args(&a, "prefill-worker", &model, free_port()?, p), &ep[i]);
            procs.push(spawn(&format!("prefill-{i}"), &args, Some(tx.clone()))?);
        }
        let prefill = wait_ready(&rx, a.prefill, timeout, &mut procs)?;
        for (i, &p) in place[a.prefill..].iter().enumerate() {
            let args = with_ep(worker_args(&a, "decode-worker", &model, free_port()?, p), &ep[a.prefill + i]);
            procs.push(spawn(&format!("decode-{i}"), &args, Some(tx.clone()))?);
        }
        let decode = wait_ready(&rx, a.decode, timeout, &mut procs)?;
        let mut r = vec![
            "router".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--host".into(),
            a.host.clone(),
            "--port".into(),
            a.port.to_string(),
            "--grpc-port".into(),
            a.grpc_port.to_string(),
        ];
        match &a.etcd {
            Some(e) => r.extend(["--discovery".into(), "etcd".into(), "--etcd".into(), e.clone()]),
            None => r.extend([
                "--discovery".into(),
                "static".into(),
                "--prefill".into(),
                prefill.join(","),
                "--decode".into(),
                decode.join(","),
            ]),
        }
        r.extend(a.security_flags());
        for (flag, val) in [
            ("--max-model-len", a.max_model_len.map(|x| x.to_string())),
            ("--served-model-name", a.served_model_name.clone()),
            ("--chat-template", a.chat_template.as_ref().map(|p| p.display().to_string())),
            ("--tls-server-name", a.tls_server_name.clone()),
        ] {
            if let Some(v) = val {
                r.push(flag.into());
                r.push(v);
            }
        }
        let env: Vec<(String, String)> =
            a.api_key.iter().map(|k| ("TANDEM_API_KEY".to_string(), k.0.clone())).collect();
        procs.push(spawn_with_env("router", &r, &env, None)?);
        let deadline = Instant::now() + timeout;
        while http_status(&a.host, a.port, "/ready") != Some(200) {
            if Instant::now() > deadline {
                bail!("the router did not become ready on {}:{} within {timeout:?}", a.host, a.port);
            }
            if let Some(name) = exited(&mut procs) {
                bail!("{name} exited during start-up (see its log lines above)");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let name = a.served_model_name.clone().unwrap_or_else(|| {
            model
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                // A synthetic model: the router serves it under its spec.
                .unwrap_or_else(|| model.display().to_string())
        });
        let auth = a.api_key.as_ref().map(|k| format!(" -H 'Authorization: Bearer {}'", k.0)).unwrap_or_default();
        println!("\ntandem is up: {} prefill + {} decode workers, model {name}", a.prefill, a.decode);
        println!("  OpenAI API:  http://{}:{}/v1", a.host, a.port);
        println!("  gRPC:        {}:{}", a.host, a.grpc_port);
        println!("  metrics:     http://{}:{}/metrics", a.host, a.port);
        println!(
            "\ncurl http://{}:{}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'\n",
            a.host, a.port
        );
        println!("Ctrl-C stops the cluster. A process that dies is restarted (with backoff).");
        loop {
            if stop.load(Ordering::SeqCst) {
                eprintln!("stopping the cluster");
                return Ok(());
            }
            supervise(&mut procs);
            std::thread::sleep(Duration::from_millis(200));
        }
    })();
    // The router first (no new requests), then the workers drain.
    procs.reverse();
    terminate(&mut procs, Duration::from_secs(20));
    result.map(|()| ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn args(extra: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("up").chain(extra.iter().copied())).unwrap().a
    }

    #[test]
    fn workers_get_a_gpu_each_or_share_with_split_memory() {
        use engine::Device::{Cpu, Cuda};
        let p = placements(&args(&["--device", "cuda"]), 1).unwrap();
        assert_eq!(p, vec![(Cuda(0), Some(0.45)), (Cuda(0), Some(0.45))], "one GPU: prefill and decode share it");
        let p = placements(&args(&["--device", "cuda", "--decode", "3"]), 2).unwrap();
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![Cuda(0), Cuda(1), Cuda(0), Cuda(1)]);
        assert!(p.iter().all(|x| x.1 == Some(0.45)));
        let p = placements(&args(&["--device", "cuda", "--decode", "3"]), 8).unwrap();
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![Cuda(0), Cuda(1), Cuda(2), Cuda(3)]);
        assert!(p.iter().all(|x| x.1 == Some(0.9)));
        let p = placements(&args(&["--device", "cuda:3", "--gpu-memory-utilization", "0.3"]), 8).unwrap();
        assert_eq!(p, vec![(Cuda(3), Some(0.3)), (Cuda(3), Some(0.3))]);
        let e = placements(&args(&["--device", "cuda", "--gpu-memory-utilization", "0.6"]), 1).unwrap_err();
        assert!(e.to_string().contains("2 workers share GPU 0"), "{e}");
        assert_eq!(placements(&args(&[]), 0).unwrap(), vec![(Cpu, None), (Cpu, None)]);
    }

    #[test]
    fn expert_parallel_groups_get_a_gpu_per_rank_and_a_leader_each() {
        use engine::Device::Cuda;
        // Two GPUs: prefill on GPU 0, the decode group's ranks on GPUs 1 and 0.
        let a = args(&["--device", "cuda", "--decode", "2", "--decode-ep", "2"]);
        check_ep(&a).unwrap();
        let p = placements(&a, 2).unwrap();
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![Cuda(0), Cuda(1), Cuda(0)]);
        let specs = ep_specs(&a).unwrap();
        assert_eq!(specs[0], None);
        let (d0, d1) = (specs[1].clone().unwrap(), specs[2].clone().unwrap());
        assert!(d0.starts_with("0/2@127.0.0.1:") && d1.starts_with("1/2@127.0.0.1:"), "{d0} {d1}");
        assert_eq!(d0.split('@').nth(1), d1.split('@').nth(1), "one leader per group");
        // Two groups of two: two leaders.
        let a = args(&["--device", "cuda", "--prefill", "2", "--prefill-ep", "2", "--decode", "4", "--decode-ep", "2"]);
        check_ep(&a).unwrap();
        let specs = ep_specs(&a).unwrap();
        let leader = |i: usize| specs[i].as_ref().unwrap().split('@').nth(1).unwrap().to_string();
        assert_eq!(leader(2), leader(3));
        assert_ne!(leader(3), leader(4));
        assert_ne!(leader(0), leader(2), "prefill and decode groups are separate");
        placements(&a, 8).unwrap();
        // One GPU cannot hold two ranks of a group.
        let e = placements(&args(&["--device", "cuda", "--decode", "2", "--decode-ep", "2"]), 1).unwrap_err();
        assert!(e.to_string().contains("would share GPUs [0, 0]"), "{e}");
        for (flags, want) in [
            (&["--decode", "3", "--decode-ep", "2", "--device", "cuda"][..], "not a multiple of --decode-ep 2"),
            (&["--decode", "2", "--decode-ep", "2"][..], "runs on GPUs"),
            (&["--decode-ep", "0"][..], "at least 1"),
            (&["--decode", "2", "--decode-ep", "2", "--device", "cuda", "--precision", "full"][..], "FP8"),
        ] {
            let e = check_ep(&args(flags)).unwrap_err();
            assert!(e.to_string().contains(want), "{flags:?}: {e}");
        }
    }

    #[test]
    fn tls_and_etcd_flags_reach_every_process_and_bad_combinations_stop_up_first() {
        let a = args(&[
            "--tls-ca",
            "ca.pem",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--etcd",
            "https://e:2379",
            "--etcd-ca",
            "eca.pem",
            "--etcd-user",
            "tandem",
            "--etcd-password-file",
            "pw",
        ]);
        let w = worker_args(&a, "decode-worker", Path::new("/m"), 1, (engine::Device::Cpu, None)).join(" ");
        for want in ["--tls-ca ca.pem", "--tls-cert c.pem", "--tls-key k.pem", "--etcd-ca eca.pem"] {
            assert!(w.contains(want), "{want} in {w}");
        }
        assert!(w.contains("--etcd-user tandem --etcd-password-file pw"), "{w}");
        let err = args(&["--tls-cert", "c.pem"]).check_tls().unwrap_err();
        assert!(format!("{err:#}").contains("--tls-key"), "{err:#}");
        let err = args(&["--etcd-user", "u"]).check_tls().unwrap_err();
        assert!(err.to_string().contains("need --etcd"), "{err}");
    }
}
