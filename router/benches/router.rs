//! Router overhead benchmark (issue 4 item 7). Run: `cargo bench -p router --bench router -- --json`
//! (see bench/router/README.md). Worker doubles run in this process; the router runs as its own
//! process (the real `tandem-router` binary, static discovery) so its CPU time can be read from /proc.
//!
//! For each concurrency (1, 64, 1024) it measures the same work twice: through the router (HTTP, raw
//! keep-alive HTTP/1.1 client) and directly (the router's gRPC calls made by the load generator itself:
//! Decode -> Reserved -> Prefill -> tokens). Added latency = router - direct.

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::v1::decode_event::Event as Ev;
use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{DecodeRequest, PrefillRequest, SamplingParams, WorkerRole};
use serde_json::{Value, json};
use support::double::{self, Double, Fabric};
use support::harness::{MODEL, model_dir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::Channel;

mod raw_http {
    //! A minimal HTTP/1.1 keep-alive client, so the load generator costs little CPU next to the router.
    use super::*;

    pub struct Conn {
        stream: TcpStream,
        buf: Vec<u8>,
    }

    fn find(h: &[u8], n: &[u8]) -> Option<usize> {
        h.windows(n.len()).position(|w| w == n)
    }

    impl Conn {
        pub async fn connect(addr: &str) -> Conn {
            let stream = TcpStream::connect(addr).await.expect("connect router");
            stream.set_nodelay(true).unwrap();
            Conn { stream, buf: Vec::with_capacity(16 * 1024) }
        }

        async fn fill(&mut self) -> bool {
            let mut tmp = [0u8; 16 * 1024];
            match self.stream.read(&mut tmp).await {
                Ok(0) | Err(_) => false,
                Ok(n) => {
                    self.buf.extend_from_slice(&tmp[..n]);
                    true
                }
            }
        }

        pub async fn send(&mut self, host: &str, path: &str, body: &str) {
            let req = format!(
                "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            self.stream.write_all(req.as_bytes()).await.unwrap();
        }

        /// Reads one Content-Length response; returns the status.
        pub async fn read_response(&mut self) -> u16 {
            loop {
                if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
                    let status: u16 = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                        .unwrap_or(0);
                    while self.buf.len() < end + 4 + len {
                        assert!(self.fill().await, "connection closed mid-body");
                    }
                    self.buf.drain(..end + 4 + len);
                    return status;
                }
                assert!(self.fill().await, "connection closed before the response");
            }
        }

        /// Reads a chunked SSE response; returns the arrival time of each `data: {` event.
        pub async fn read_sse(&mut self) -> Vec<Instant> {
            let mut times = Vec::new();
            let mut scanned = 0;
            loop {
                while let Some(i) = find(&self.buf[scanned..], b"data: ") {
                    let at = scanned + i;
                    if self.buf.get(at + 6) == Some(&b'{') {
                        times.push(Instant::now());
                    }
                    scanned = at + 6;
                }
                if let Some(end) = find(&self.buf, b"data: [DONE]") {
                    while find(&self.buf[end..], b"0\r\n\r\n").is_none() {
                        assert!(self.fill().await);
                    }
                    self.buf.clear();
                    return times;
                }
                scanned = scanned.max(self.buf.len().saturating_sub(6));
                assert!(self.fill().await, "stream closed before [DONE]");
            }
        }
    }
}

/// The worker doubles run in their own process (this benchmark re-executed with `--serve-doubles`), as
/// real workers do: a "direct" client in the doubles' own process would skip the cross-process wake-ups
/// that every real client pays, and understate what the router adds.
struct Workers {
    child: Child,
    /// The doubles process's stdin: `interval US` lines set the decode token interval.
    control: std::process::ChildStdin,
    prefill_addr: String,
    decode_addr: String,
    prefill: PrefillWorkerClient<Channel>,
    decode: DecodeWorkerClient<Channel>,
}

impl Workers {
    fn start() -> Workers {
        let mut child = Command::new(std::env::current_exe().expect("own executable"))
            .arg("--serve-doubles")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the worker doubles");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)
            .expect("doubles' addresses");
        let mut it = line.split_whitespace().skip(1);
        let (prefill_addr, decode_addr) = (it.next().unwrap().to_owned(), it.next().unwrap().to_owned());
        // The same HTTP/2 settings as the router's worker channels (see workers/handle.rs).
        let ch = |a: &str| {
            Channel::from_shared(format!("http://{a}"))
                .unwrap()
                .tcp_nodelay(true)
                .initial_connection_window_size(Some(64 << 20))
                .initial_stream_window_size(Some(1 << 20))
                .connect_lazy()
        };
        Workers {
            control: child.stdin.take().unwrap(),
            prefill: PrefillWorkerClient::new(ch(&prefill_addr)),
            decode: DecodeWorkerClient::new(ch(&decode_addr)),
            prefill_addr,
            decode_addr,
            child,
        }
    }

    fn clients(&self) -> Clients {
        Clients { prefill: self.prefill.clone(), decode: self.decode.clone() }
    }

    fn set_token_interval_us(&mut self, us: u64) {
        use std::io::Write;
        writeln!(self.control, "interval {us}").and_then(|_| self.control.flush()).expect("doubles control");
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// gRPC clients of the doubles, for the direct runs.
struct Clients {
    prefill: PrefillWorkerClient<Channel>,
    decode: DecodeWorkerClient<Channel>,
}

/// `--serve-doubles`: runs a prefill and a decode double, prints `ADDR <prefill> <decode>`, applies
/// `interval US` lines from stdin, exits when stdin closes.
fn serve_doubles() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let dir = model_dir();
        let tok = text::Tokenizer::from_dir(dir.path()).unwrap();
        let fabric = Arc::new(Fabric::default());
        let script = support::harness::reply_script(&tok);
        let eos = tok.eos_id().unwrap();
        let fp = double::fingerprint(MODEL, "h1");
        let p = double::spawn("p0", WorkerRole::Prefill, script.clone(), eos, fabric.clone(), fp.clone()).await;
        let d: Double = double::spawn("d0", WorkerRole::Decode, script, eos, fabric, fp).await;
        println!("ADDR {} {}", p.grpc_address(), d.grpc_address());
        let knobs = d.knobs.clone();
        tokio::task::spawn_blocking(move || {
            for line in std::io::stdin().lines().map_while(Result::ok) {
                if let Some(us) = line.strip_prefix("interval ").and_then(|v| v.trim().parse().ok()) {
                    knobs.token_interval_us.store(us, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
        .await
        .unwrap();
        drop((p, d));
    });
}

struct Router {
    child: Child,
    addr: String,
}

impl Router {
    fn start(model: &std::path::Path, prefill: &str, decode: &str) -> Router {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        // TANDEM_ROUTER_BIN: run a copied binary (e.g. on another machine) instead of the one cargo built.
        let bin = std::env::var("TANDEM_ROUTER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tandem-router").to_owned());
        let child = Command::new(bin)
            .args(["--model", &model.display().to_string(), "--served-model-name", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--disable-grpc", "--prefill", prefill, "--decode", decode])
            .args(["--max-running-requests", "4096", "--prefill-policy", "cache-aware"])
            .env("RUST_LOG", std::env::var("TANDEM_ROUTER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn tandem-router (built by cargo bench)");
        Router { child, addr: format!("127.0.0.1:{port}") }
    }

    /// utime + stime of the router process, in microseconds.
    fn cpu_us(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        let after = stat.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks: u64 =
            f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0) + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        ticks * 10_000 // CLK_TCK = 100 on Linux
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One request the direct way: what the router does, minus HTTP, templating and detokenization.
/// Returns (time to first token, arrival times of token events).
async fn direct_once(w: &Clients, prompt: &[u32], max_tokens: u32, i: u64) -> (Duration, Vec<Instant>) {
    let start = Instant::now();
    let sampling = SamplingParams { max_tokens, ..Default::default() };
    let rid = format!("direct-{i}");
    let mut dc = w.decode.clone();
    let mut stream = dc
        .decode(DecodeRequest {
            request_id: rid.clone(),
            token_ids: prompt.to_vec(),
            sampling: Some(sampling.clone()),
            num_prompt_tokens: prompt.len() as u32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Ev::Reserved(r)) = stream.message().await.unwrap().unwrap().event else { panic!("no Reserved") };
    let mut pc = w.prefill.clone();
    let pre = PrefillRequest {
        request_id: rid,
        token_ids: prompt.to_vec(),
        sampling: Some(sampling),
        transfer: r.transfer,
        num_prompt_tokens: prompt.len() as u32,
        ..Default::default()
    };
    let resp = pc.prefill(pre).await.unwrap().into_inner();
    let ttft = start.elapsed();
    let mut times = vec![Instant::now()];
    if !resp.finished {
        while let Some(ev) = stream.message().await.unwrap() {
            // Read to the trailers (past Finished), as the router does, so the stream is not reset.
            if let Some(Ev::Tokens(_)) = ev.event {
                times.push(Instant::now());
            }
        }
        // The decode stream's first event repeats the prefill token.
        times.remove(1.min(times.len() - 1));
    }
    (ttft, times)
}

struct Point {
    requests: u64,
    seconds: f64,
    lat_ms: Vec<f64>,
    ttft_ms: Vec<f64>,
    itl_ms: Vec<f64>,
}

/// Runs `conc` clients for `dur`, through the router or directly.
async fn run_point(
    w: &Arc<Clients>,
    router: Option<&str>,
    conc: usize,
    dur: Duration,
    stream: bool,
    max_tokens: u32,
    prompt: Arc<Vec<u32>>,
) -> Point {
    let deadline = Instant::now() + dur;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..conc {
        let w = w.clone();
        let router = router.map(str::to_owned);
        let prompt = prompt.clone();
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut ttft, mut itl) = (Vec::new(), Vec::new(), Vec::new());
            let mut n = 0u64;
            let body =
                json!({"model": MODEL, "prompt": *prompt, "max_tokens": max_tokens, "stream": stream}).to_string();
            let mut conn = match &router {
                Some(a) => Some(raw_http::Conn::connect(a).await),
                None => None,
            };
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let times = match (&mut conn, &router) {
                    (Some(conn), Some(host)) => {
                        conn.send(host, "/v1/completions", &body).await;
                        if stream {
                            conn.read_sse().await
                        } else {
                            assert_eq!(conn.read_response().await, 200);
                            vec![Instant::now()]
                        }
                    }
                    _ => direct_once(&w, &prompt, max_tokens, (c as u64) << 32 | n).await.1,
                };
                lat.push(ms(t0.elapsed()));
                if let Some(first) = times.first() {
                    ttft.push(ms(*first - t0));
                }
                itl.extend(times.windows(2).map(|p| ms(p[1] - p[0])));
                n += 1;
            }
            (n, lat, ttft, itl)
        }));
    }
    let mut p = Point { requests: 0, seconds: 0.0, lat_ms: Vec::new(), ttft_ms: Vec::new(), itl_ms: Vec::new() };
    for t in tasks {
        let (n, l, f, i) = t.await.unwrap();
        p.requests += n;
        p.lat_ms.extend(l);
        p.ttft_ms.extend(f);
        p.itl_ms.extend(i);
    }
    p.seconds = start.elapsed().as_secs_f64();
    p
}

fn summary(p: &mut Point) -> Value {
    json!({
        "requests": p.requests,
        "requests_per_s": (p.requests as f64 / p.seconds).round(),
        "latency_p50_ms": pct(&mut p.lat_ms, 0.5),
        "latency_p99_ms": pct(&mut p.lat_ms, 0.99),
        "ttft_p50_ms": pct(&mut p.ttft_ms, 0.5),
        "ttft_p99_ms": pct(&mut p.ttft_ms, 0.99),
        "itl_p50_ms": pct(&mut p.itl_ms, 0.5),
        "itl_p99_ms": pct(&mut p.itl_ms, 0.99),
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--serve-doubles") {
        return serve_doubles();
    }
    let json_out = args.iter().any(|a| a == "--json");
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this without it: then a short smoke
    // run that checks the benchmark works and writes no results file.
    let smoke = !args.iter().any(|a| a == "--bench");
    let secs: f64 = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(if smoke { 0.3 } else { 4.0 });
    let levels: Vec<usize> = args
        .iter()
        .position(|a| a == "--concurrency")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| if smoke { vec![1, 8] } else { vec![1, 64, 1024] });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let args2 = args.clone();
    rt.block_on(async move {
        let args = args2;
        let dir = model_dir();
        let tok = text::Tokenizer::from_dir(dir.path()).unwrap();
        let mut workers = Workers::start();
        let prompt = Arc::new(tok.encode_prompt("Say hello to the benchmark").unwrap());
        let router = Router::start(dir.path(), &workers.prefill_addr, &workers.decode_addr);
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if let Ok(r) = http.get(format!("http://{}/ready", router.addr)).send().await
                && r.status() == 200
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let dur = Duration::from_secs_f64(secs);
        let mut results = Vec::new();
        // Short non-streaming requests: 4 output tokens, no pacing.
        for &conc in &levels {
            workers.set_token_interval_us(0);
            let w = Arc::new(workers.clients());
            let mut direct = run_point(&w, None, conc, dur, false, 4, prompt.clone()).await;
            let cpu0 = router.cpu_us();
            let mut via = run_point(&w, Some(&router.addr), conc, dur, false, 4, prompt.clone()).await;
            let cpu = router.cpu_us() - cpu0;
            let (d, r) = (summary(&mut direct), summary(&mut via));
            let added = |k: &str| r[k].as_f64().unwrap_or(f64::NAN) - d[k].as_f64().unwrap_or(f64::NAN);
            let row = json!({
                "kind": "short_non_streaming", "concurrency": conc, "max_tokens": 4,
                "router": r.clone(), "direct": d.clone(),
                "added_latency_p50_ms": added("latency_p50_ms"), "added_latency_p99_ms": added("latency_p99_ms"),
                "router_cpu_us_per_request": cpu as f64 / via.requests.max(1) as f64,
            });
            eprintln!("{row}");
            results.push(row);
        }
        // Streams at a fixed rate: 50 tokens/s per stream (20 ms apart), 32 tokens each.
        for &conc in &levels {
            workers.set_token_interval_us(20_000);
            let w = Arc::new(workers.clients());
            let mut direct = run_point(&w, None, conc, dur, true, 32, prompt.clone()).await;
            let cpu0 = router.cpu_us();
            let mut via = run_point(&w, Some(&router.addr), conc, dur, true, 32, prompt.clone()).await;
            let cpu = router.cpu_us() - cpu0;
            let (d, r) = (summary(&mut direct), summary(&mut via));
            let added = |k: &str| r[k].as_f64().unwrap_or(f64::NAN) - d[k].as_f64().unwrap_or(f64::NAN);
            let row = json!({
                "kind": "stream_50_tok_per_s", "concurrency": conc, "max_tokens": 32,
                "router": r.clone(), "direct": d.clone(),
                "added_ttft_p50_ms": added("ttft_p50_ms"), "added_ttft_p99_ms": added("ttft_p99_ms"),
                "added_itl_p99_ms": added("itl_p99_ms"),
                "router_cpu_us_per_request": cpu as f64 / via.requests.max(1) as f64,
            });
            eprintln!("{row}");
            results.push(row);
        }
        let out = json!({
            "bench": "router",
            "machine": std::env::var("TANDEM_BENCH_MACHINE").unwrap_or_else(|_| "2-core VM (load generator, router and worker doubles share the 2 cores)".into()),
            "seconds_per_point": secs,
            "router_log_level": "warn",
            "results": results,
        });
        let default_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/router/results.json").to_owned();
        let path = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
        let path = match path {
            Some(p) => p,
            None if smoke => {
                eprintln!("smoke run (no --bench): no results file written");
                return;
            }
            None => default_path,
        };
        if let Ok(s) = serde_json::to_string_pretty(&out) {
            match std::fs::write(&path, s + "\n") {
                Ok(()) => eprintln!("wrote {path}"),
                Err(e) => eprintln!("cannot write {path}: {e}"),
            }
        }
        if json_out {
            println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        }
    });
}
