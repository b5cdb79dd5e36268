#![allow(dead_code)]
//! A real tandem cluster for end-to-end tests: router, prefill and decode workers as separate processes
//! of the `tandem` binary (`tandem router|prefill-worker|decode-worker`), etcd discovery, kv-transfer over
//! UCX (tcp transport). Every process is killed when the `Cluster` is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::etcd::Etcd;

pub const MODEL_NAME: &str = "tiny";

/// The tiny checkpoint, generated once per test binary.
pub fn model() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| gen_tiny(1)).path()
}

/// The tiny checkpoint with two MTP layers (only the first is served), generated once per test binary.
pub fn model_with_two_mtp_layers() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| gen_tiny(2)).path()
}

fn gen_tiny(mtp_layers: usize) -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["gen-tiny", d.path().to_str().unwrap(), "--seed", "0", "--mtp-layers", &mtp_layers.to_string()])
        .output()
        .expect("gen-tiny runs");
    assert!(out.status.success(), "gen-tiny: {}", String::from_utf8_lossy(&out.stderr));
    d
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub grpc: String,
    pub metrics: Option<String>,
    log: PathBuf,
}

impl Proc {
    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

pub struct Cluster {
    pub etcd: Etcd,
    pub procs: Vec<Proc>,
    pub http: String,
    pub cluster: String,
    /// The checkpoint every process serves.
    pub model: PathBuf,
    /// The router's command line, for a restart on the same ports.
    router_args: Vec<String>,
    dir: tempfile::TempDir,
}

/// Extra flags and environment for one worker.
#[derive(Default, Clone)]
pub struct Spec {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl Spec {
    pub fn args(args: &[&str]) -> Spec {
        Spec { args: args.iter().map(|s| s.to_string()).collect(), env: Vec::new() }
    }
}

impl Cluster {
    /// etcd plus a router; add workers with `add_worker`. None (test skipped) without etcd.
    pub fn start() -> Option<Cluster> {
        Cluster::start_with_model(model())
    }

    /// As `start`, serving the checkpoint in `model`.
    pub fn start_with_model(model: &Path) -> Option<Cluster> {
        Cluster::start_with_router_args(model, &[])
    }

    /// As `start_with_model`, with more router flags.
    pub fn start_with_router_args(model: &Path, extra: &[String]) -> Option<Cluster> {
        let etcd = Etcd::start()?;
        let dir = tempfile::tempdir().expect("tempdir");
        let cluster = format!("e2e-{}", std::process::id());
        let mut c = Cluster {
            etcd,
            procs: Vec::new(),
            http: String::new(),
            cluster,
            model: model.to_path_buf(),
            router_args: Vec::new(),
            dir,
        };
        let port = free_port();
        let mut args: Vec<String> = [
            "router",
            "--model",
            model.to_str().unwrap(),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--grpc-port",
            &free_port().to_string(),
            "--discovery",
            "etcd",
            "--etcd",
            &c.etcd.client_url,
            "--cluster",
            &c.cluster,
            "--health-interval-ms",
            "200",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend_from_slice(extra);
        c.spawn("router", &args, &[], false);
        c.router_args = args;
        c.http = format!("http://127.0.0.1:{port}");
        Some(c)
    }

    /// Stops the router (SIGTERM and a wait for its graceful exit, or SIGKILL as a crash) and starts a new
    /// one on the same ports.
    pub fn restart_router(&mut self, graceful: bool) {
        let i = self.procs.iter().position(|p| p.name == "router").expect("a router");
        let mut old = self.procs.remove(i);
        if graceful {
            // SAFETY: kill(2) on a process this harness started.
            unsafe { libc::kill(old.child.id() as i32, libc::SIGTERM) };
        } else {
            let _ = old.child.kill();
        }
        let _ = old.child.wait();
        let _ = std::fs::rename(&old.log, self.dir.path().join(format!("router-{}.log", old.child.id())));
        let args = self.router_args.clone();
        self.spawn("router", &args, &[], false);
    }

    fn spawn(&mut self, name: &str, args: &[String], env: &[(String, String)], wait_ready: bool) -> usize {
        let log = self.dir.path().join(format!("{name}.log"));
        let logf = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(logf);
        cmd.env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tandem");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("{\"event\":\"ready\"") {
                    let _ = tx.send(line);
                }
            }
        });
        let mut p = Proc { name: name.to_string(), child, grpc: String::new(), metrics: None, log };
        if wait_ready {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("{name} not ready:\n{}", p.log_tail()));
            let v: serde_json::Value = serde_json::from_str(&line).expect("ready json");
            p.grpc = v["grpc"].as_str().unwrap_or_default().to_string();
            p.metrics = v["metrics"].as_str().map(str::to_string);
        }
        self.procs.push(p);
        self.procs.len() - 1
    }

    /// Starts a worker (`role` = "prefill" or "decode") registered in this cluster's etcd.
    pub fn add_worker(&mut self, role: &str, name: &str, spec: Spec) -> usize {
        let mut args: Vec<String> = [
            &format!("{role}-worker"),
            "--model",
            self.model.to_str().unwrap(),
            "--served-model-name",
            MODEL_NAME,
            "--worker-id",
            name,
            "--discovery",
            "etcd",
            "--etcd",
            &self.etcd.client_url,
            "--cluster",
            &self.cluster,
            "--lease-ttl-secs",
            "3",
            "--metrics-listen",
            "127.0.0.1:0",
            "--kv-transport",
            "ucx",
            "--ucx-tls",
            "tcp",
            "--drain-timeout-s",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if !spec.args.iter().any(|a| a == "--kv-blocks") {
            args.extend(["--kv-blocks".to_string(), "512".to_string()]);
        }
        args.extend(spec.args);
        self.spawn(name, &args, &spec.env, true)
    }

    pub fn proc(&self, name: &str) -> &Proc {
        self.procs.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no process {name}"))
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self, name: &str) {
        let p = self.procs.iter_mut().find(|p| p.name == name).expect("process");
        let _ = p.child.kill();
        let _ = p.child.wait();
    }

    /// Waits until the router sees `prefill` and `decode` healthy workers and is ready.
    pub async fn wait_healthy(&self, prefill: usize, decode: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(m) = get_text(&format!("{}/metrics", self.http)).await {
                let healthy = |role: &str| {
                    m.lines()
                        .filter(|l| {
                            l.starts_with("tandem_router_worker_healthy") && l.contains(&format!("role=\"{role}\""))
                        })
                        .filter(|l| l.trim_end().ends_with(" 1"))
                        .count()
                };
                if healthy("prefill") == prefill && healthy("decode") == decode {
                    return;
                }
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self.procs.iter().map(|p| format!("== {}\n{}", p.name, p.log_tail())).collect();
                panic!("cluster not healthy ({prefill} prefill, {decode} decode) in time\n{}", logs.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The router's sample `series` (a metric name and its labels as Prometheus prints them), if exported.
    pub async fn router_metric(&self, series: &str) -> Option<f64> {
        let text = get_text(&format!("{}/metrics", self.http)).await.ok()?;
        let line = text.lines().find(|l| l.strip_prefix(series).is_some_and(|rest| rest.starts_with(' ')))?;
        line.rsplit(' ').next()?.parse().ok()
    }

    /// One metric's value on a worker (sum over label sets), or None.
    pub async fn worker_metric(&self, name: &str, metric: &str) -> Option<f64> {
        let url = format!("http://{}/metrics", self.proc(name).metrics.as_ref()?);
        let text = get_text(&url).await.ok()?;
        let vals: Vec<f64> = text
            .lines()
            .filter(|l| {
                l.starts_with(metric) && (l.len() == metric.len() || matches!(l.as_bytes()[metric.len()], b' ' | b'{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!vals.is_empty()).then(|| vals.iter().sum())
    }

    /// The logs of the routers stopped by `restart_router`.
    pub fn old_router_logs(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(self.dir.path()).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("router-") {
                out += &format!("== {name}\n{}\n", std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        out
    }

    pub fn logs(&self) -> String {
        self.procs.iter().map(|p| format!("== {}\n{}", p.name, p.log_tail())).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
    }
}

pub async fn get_text(url: &str) -> Result<String, reqwest::Error> {
    reqwest::Client::new().get(url).timeout(Duration::from_secs(5)).send().await?.text().await
}

/// Single-process greedy reference: `tandem generate` on the same checkpoint and prompt ids.
pub fn generate_reference(prompt_ids: &[u32], max_tokens: u32, no_mtp: bool) -> serde_json::Value {
    generate_reference_on(model(), prompt_ids, max_tokens, no_mtp)
}

/// `generate_reference` on the checkpoint in `model`.
pub fn generate_reference_on(model: &Path, prompt_ids: &[u32], max_tokens: u32, no_mtp: bool) -> serde_json::Value {
    let ids: Vec<String> = prompt_ids.iter().map(|i| i.to_string()).collect();
    let mut args = vec![
        "generate".to_string(),
        "--model".into(),
        model.to_str().unwrap().into(),
        "--prompt-ids".into(),
        ids.join(","),
        "--max-tokens".into(),
        max_tokens.to_string(),
        "--ignore-eos".into(),
        "--json".into(),
    ];
    if no_mtp {
        args.push("--no-mtp".into());
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tandem")).args(&args).output().expect("tandem generate");
    assert!(out.status.success(), "generate: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("generate json")
}

/// Fresh prompt token ids (avoiding the special ids 0..7), with BOS first.
pub fn prompt_ids(n: usize, salt: u64) -> Vec<u32> {
    let mut s =
        (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64) ^ salt ^ 0x9e37;
    let mut v = vec![0u32];
    while v.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.push(7 + (s % 1200) as u32);
    }
    v
}
