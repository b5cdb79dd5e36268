//! A router in front of worker doubles, on free ports, with a tiny model directory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use proto::v1::WorkerRole;

use super::double::{self, Double, Fabric, Script};

pub const MODEL: &str = "tiny-test";
pub const MAX_MODEL_LEN: u32 = 512;
pub const REPLY: &str = "Hello world! The answer is 42.";

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: router::Args,
}

pub struct Options {
    pub prefill: usize,
    pub decode: usize,
    pub args: Vec<String>,
    pub script: Option<Script>,
    /// Checkpoint hash of each decode double (default all "h1"); prefill doubles use "h1".
    pub decode_hashes: Vec<&'static str>,
    pub wait_ready: bool,
    /// The max_model_len every worker double reports (default 4096, above the router's 512).
    pub worker_max_model_len: Option<u32>,
    /// Every double serves TLS with this configuration (the router then needs `--tls-*` in `args`).
    pub worker_tls: Option<tls::ServerTls>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefill: 1,
            decode: 1,
            args: Vec::new(),
            script: None,
            decode_hashes: Vec::new(),
            wait_ready: true,
            worker_max_model_len: None,
            worker_tls: None,
        }
    }
}

pub struct Cluster {
    pub router: Option<router::RouterHandle>,
    pub base: String,
    pub grpc: String,
    pub prefill: Vec<Double>,
    pub decode: Vec<Double>,
    pub tokenizer: Arc<text::Tokenizer>,
    pub http: reqwest::Client,
    pub model_dir: tempfile::TempDir,
}

/// Writes tokenizer.json, tokenizer_config.json and config.json of a tiny model.
pub fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    text::tiny::write_files(dir.path()).unwrap();
    let cfg = serde_json::json!({ "max_position_embeddings": MAX_MODEL_LEN, "vocab_size": 1280 });
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

pub fn reply_script(tok: &text::Tokenizer) -> Script {
    let mut ids = tok.encode(REPLY, false).unwrap();
    ids.push(tok.eos_id().unwrap());
    Arc::new(move |_prompt: &[u32]| ids.clone())
}

pub fn router_args(
    model_dir: &std::path::Path,
    prefill: &[String],
    decode: &[String],
    extra: &[String],
) -> router::Args {
    let mut argv: Vec<String> = vec!["tandem-router".into(), "--model".into(), model_dir.display().to_string()];
    argv.extend(["--served-model-name".into(), MODEL.into(), "--health-interval-ms".into(), "100".into()]);
    for p in prefill {
        argv.extend(["--prefill".into(), p.clone()]);
    }
    for d in decode {
        argv.extend(["--decode".into(), d.clone()]);
    }
    argv.extend(extra.iter().cloned());
    Cli::try_parse_from(argv).unwrap().args
}

impl Cluster {
    pub async fn start(o: Options) -> Cluster {
        let model_dir = model_dir();
        let tokenizer = Arc::new(text::Tokenizer::from_dir(model_dir.path()).unwrap());
        let script = o.script.clone().unwrap_or_else(|| reply_script(&tokenizer));
        let eos = tokenizer.eos_id().unwrap();
        let fabric = Arc::new(Fabric::default());
        let spawn = |name: String, role: WorkerRole, hash: &str| {
            let (fp, script, fabric, tls) =
                (double::fingerprint(MODEL, hash), script.clone(), fabric.clone(), o.worker_tls.clone());
            async move { double::spawn_tls(&name, role, script, eos, fabric, fp, tls).await }
        };
        let mut prefill = Vec::new();
        for i in 0..o.prefill {
            prefill.push(spawn(format!("p{i}"), WorkerRole::Prefill, "h1").await);
        }
        let mut decode = Vec::new();
        for i in 0..o.decode {
            let hash = o.decode_hashes.get(i).copied().unwrap_or("h1");
            decode.push(spawn(format!("d{i}"), WorkerRole::Decode, hash).await);
        }
        if let Some(len) = o.worker_max_model_len {
            for d in prefill.iter().chain(&decode) {
                d.knobs.max_model_len.store(len, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let p: Vec<String> = prefill.iter().map(|d| d.grpc_address()).collect();
        let d: Vec<String> = decode.iter().map(|d| d.grpc_address()).collect();
        let args = router_args(model_dir.path(), &p, &d, &o.args);
        let http_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router = router::start_with_listeners(args, http_l, Some(grpc_l)).await.unwrap();
        let base = format!("http://{}", router.http_addr);
        let grpc = format!("http://{}", router.grpc_addr.unwrap());
        let http = reqwest::Client::builder().tcp_nodelay(true).build().unwrap();
        let c = Cluster { router: Some(router), base, grpc, prefill, decode, tokenizer, http, model_dir };
        if o.wait_ready {
            c.wait_ready(Duration::from_secs(10)).await;
        }
        c
    }

    pub async fn wait_ready(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            if let Ok(r) = self.http.get(format!("{}/ready", self.base)).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(start.elapsed() < limit, "router not ready within {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the router counts every double healthy (`/ready` needs only one pair; a test that
    /// relies on trying every worker must not run while one is still being identified).
    pub async fn wait_all_healthy(&self, limit: Duration) {
        let want = self.prefill.len() + self.decode.len();
        let start = Instant::now();
        loop {
            let m = self.http.get(self.url("/metrics")).send().await.unwrap().text().await.unwrap();
            let healthy =
                m.lines().filter(|l| l.starts_with("tandem_router_worker_healthy{") && l.ends_with(" 1")).count();
            if healthy >= want {
                return;
            }
            assert!(start.elapsed() < limit, "{healthy} of {want} workers healthy after {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// POST JSON; returns (status, headers, body text).
    pub async fn post(&self, path: &str, body: serde_json::Value) -> (u16, reqwest::header::HeaderMap, String) {
        let r = self.http.post(self.url(path)).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        (status, headers, r.text().await.unwrap())
    }

    pub async fn post_json(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        let (s, _, t) = self.post(path, body).await;
        (s, serde_json::from_str(&t).unwrap_or_else(|e| panic!("not JSON ({e}): {t}")))
    }

    pub async fn shutdown(mut self) {
        if let Some(r) = self.router.take() {
            r.shutdown().await;
        }
    }
}

/// Splits an SSE body into its `data:` payloads, checking the framing on the way.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|b| b.strip_prefix("data: ").unwrap_or_else(|| panic!("event without 'data: ': {b:?}")).to_owned())
        .collect()
}

impl Cluster {
    /// POST JSON with extra headers; returns (status, headers, JSON body).
    pub async fn post_headers_json(
        &self,
        path: &str,
        body: serde_json::Value,
        headers: &[(&str, &str)],
    ) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
        let mut r = self.http.post(self.url(path)).json(&body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        let r = r.send().await.unwrap();
        let (s, h) = (r.status().as_u16(), r.headers().clone());
        (s, h, r.json().await.unwrap())
    }
}

/// Polls `cond` until it holds or `limit` passes; returns whether it held. For effects that happen in
/// background tasks (aborts, health marks), so tests do not depend on fixed sleeps on a busy machine.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
