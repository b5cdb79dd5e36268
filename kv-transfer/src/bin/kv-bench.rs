//! kv-bench: moves one request's caches (latent + indexer, L layers) between two processes, repeatedly,
//! and prints GB/s and ms per request next to `ucx_perftest` on the same UCX transport and message size.
//!
//! `kv-bench --transport {ucx,tcp} [--tokens N[,N..]] [--layers L] [--json]`
//!
//! The bench re-executes itself as the receiving process (hidden `--serve`); this process is the sender.
//! Time per request runs from `begin` (handshake) to the receiver's verified completion; descriptor
//! delivery (the router's job) is not timed. The perftest message size is the request's per-layer message:
//! the mean put size (each layer one latent and one indexer put into a fresh pool), or one layer for a
//! scattered device table (see `msg` in `run`). The per-request overhead
//! (handshake + completion, without data movement) goes to stderr as a JSON line.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Parser;
use kv_cache::{CacheGeometry, LayerIdx};
use kv_transfer::testkit;
use kv_transfer::transport::ucx::DataPath;

#[path = "kv-bench/baseline.rs"]
mod baseline;
#[path = "kv-bench/device.rs"]
mod device;
use baseline::MaybeCopier;
use kv_transfer::{
    ExpectRequest, KvReceiver, KvSender, ReceiverConfig, SenderConfig, TransferOutcome, TransportConfig, TransportKind,
};
use prost::Message;
use proto::v1::{GeneratedToken, TransferDescriptor};

#[derive(Parser, Debug)]
#[command(about = "kv-transfer bandwidth and overhead benchmark (two processes, loopback)")]
struct Args {
    /// ucx (libucp; UCX_TLS applies) or tcp (tokio).
    #[arg(long)]
    transport: TransportKind,
    /// Prompt tokens per request; several sizes comma-separated. Default: 1K, 8K, 32K, 128K.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<usize>,
    /// Cached layers (DeepSeek-V3.2: 61 + 1 MTP).
    #[arg(long, default_value_t = 62)]
    layers: usize,
    /// Timed requests per size (after one warm-up); fewer when a size would take over --budget-s.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    #[arg(long, default_value_t = 8.0)]
    budget_s: f64,
    /// One JSON line per size on stdout.
    #[arg(long)]
    json: bool,
    /// Skip the ucx_perftest baseline.
    #[arg(long)]
    no_perftest: bool,
    /// Skip the like-for-like references (perftest over a request-sized buffer, memcpy).
    #[arg(long)]
    no_baselines: bool,
    /// Allow one-sided UCX puts in both processes (sets TANDEM_UCX_ONE_SIDED_PUTS=1: the trusted-network
    /// mode, where the receiver cannot keep writes inside a transfer's blocks). Default: every write is
    /// an active message the receiver places.
    #[arg(long)]
    one_sided_puts: bool,
    /// Cache pools in GPU memory: `S,R` = the sender's and the receiver's GPU (needs the `cuda` feature).
    /// Default: host memory. Adds a device-to-device copy of the same bytes as a baseline.
    #[arg(long, value_delimiter = ',', num_args = 1)]
    devices: Vec<usize>,
    /// Scattered block tables on both sides: pools of twice the blocks with every other block held, so
    /// every block of a request is its own run (a busy pool's worst case). Default: a fresh pool's
    /// contiguous blocks.
    #[arg(long)]
    scattered: bool,
    /// Internal: run as the receiving process with a pool of this many blocks.
    #[arg(long, hide = true)]
    serve: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    // UCX logs to stdout by default; keep stdout for this tool's own lines.
    if std::env::var_os("UCX_LOG_FILE").is_none() {
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("UCX_LOG_FILE", "stderr") };
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let mut args = Args::parse();
    if args.one_sided_puts {
        // SAFETY: still single-threaded (the subscriber starts no thread); the serving child inherits it.
        unsafe { std::env::set_var("TANDEM_UCX_ONE_SIDED_PUTS", "1") };
    }
    if args.tokens.is_empty() {
        args.tokens = vec![1024, 8192, 32768, 131072];
    }
    if let Some(blocks) = args.serve {
        return serve(&args, blocks);
    }
    if args.transport == TransportKind::InProc {
        bail!("kv-bench measures two processes: use --transport ucx or tcp");
    }
    run(&args)
}

fn transport_config(kind: TransportKind) -> TransportConfig {
    match kind {
        TransportKind::Ucx => TransportConfig::Ucx { tls: None, tcp_fallback: None },
        k => TransportConfig::of_kind(k),
    }
}

/// The receiving process: `REQ <tokens>` on stdin -> `DESC <hex>`, then `DONE ok|<error>` once the
/// transfer finished and its blocks were released.
fn serve(args: &Args, blocks: usize) -> anyhow::Result<()> {
    let g = testkit::geometry(args.layers, blocks);
    let (cache, pool) = device::filled(g, 11, args.devices.get(1).copied())?; // every page touched, like a warm worker
    if args.scattered {
        scatter(&pool)?;
    }
    let recv = KvReceiver::start(
        ReceiverConfig::new(transport_config(args.transport)),
        cache,
        pool.clone(),
        testkit::fingerprint(&g),
    )?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", recv.transport())?;
    out.flush()?;
    for (i, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line?;
        let Some(n) = line.strip_prefix("REQ ") else { continue };
        let mut words = n.split_whitespace();
        let tokens: usize = words.next().unwrap_or_default().parse()?;
        let verify_checksum = words.next() == Some("verify");
        let id = format!("bench-{i}");
        let table = pool.reserve(&id, tokens)?;
        let req = ExpectRequest {
            request_id: id.clone(),
            blocks: table,
            num_tokens: tokens,
            timeout: Duration::from_secs(120),
            verify_checksum,
        };
        let (desc, pending) = recv.expect(req)?;
        writeln!(out, "DESC {}", testkit::to_hex(&desc.encode_to_vec()))?;
        out.flush()?;
        let status = match pending.wait_timeout(Duration::from_secs(130)) {
            Some(Ok(TransferOutcome::Completed(_))) => {
                pool.release(&id)?;
                "ok".to_string()
            }
            Some(Ok(TransferOutcome::Released(_))) => "released".to_string(),
            Some(Err(e)) => e.to_string(),
            None => "no outcome".to_string(),
        };
        writeln!(out, "DONE {status}")?;
        out.flush()?;
    }
    Ok(())
}

struct Peer {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Peer {
    fn line(&mut self, prefix: &str) -> anyhow::Result<String> {
        for l in self.lines.by_ref() {
            let l = l?;
            if let Some(rest) = l.strip_prefix(prefix) {
                return Ok(rest.to_string());
            }
        }
        bail!("the receiving process exited before sending {prefix:?}")
    }

    /// `verify`: the receiver checks every layer's checksum (the warm-up request: proves the bytes
    /// landed intact, untimed).
    fn descriptor(&mut self, tokens: usize, verify: bool) -> anyhow::Result<TransferDescriptor> {
        writeln!(self.stdin, "REQ {tokens}{}", if verify { " verify" } else { "" })?;
        let hex = self.line("DESC ")?;
        Ok(TransferDescriptor::decode(testkit::from_hex(&hex).context("bad descriptor hex")?.as_slice())?)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One timed request: begin, put every layer, complete; returns the wall time.
fn one(
    sender: &KvSender,
    peer: &mut Peer,
    pool: &kv_cache::BlockPool,
    tokens: usize,
    layers: usize,
    verify: bool,
) -> anyhow::Result<Duration> {
    let desc = peer.descriptor(tokens, verify)?;
    let src = pool.reserve(&desc.request_id, tokens)?;
    let t0 = Instant::now();
    let r = (|| {
        let s = sender.begin(&desc, &src)?;
        for l in 0..layers {
            s.put_layer(LayerIdx(l as u32))?;
        }
        s.complete(GeneratedToken { token_id: 1, logprobs: None }, None)
    })();
    let dt = t0.elapsed();
    pool.release(&desc.request_id)?;
    r.map_err(|e| anyhow!("transfer failed: {e}"))?;
    let done = peer.line("DONE ")?;
    if done != "ok" {
        bail!("receiver: {done}");
    }
    Ok(dt)
}

/// Holds every other block of `pool` (see `--scattered`).
fn scatter(pool: &kv_cache::BlockPool) -> anyhow::Result<()> {
    let n = pool.stats().total_blocks;
    for i in 0..n {
        pool.reserve(&format!("scatter-{i}"), 1)?;
    }
    for i in (1..n).step_by(2) {
        pool.release(&format!("scatter-{i}"))?;
    }
    Ok(())
}

fn run(args: &Args) -> anyhow::Result<()> {
    let max_tokens = *args.tokens.iter().max().unwrap_or(&1024);
    let blocks = CacheGeometry::blocks_for(max_tokens) * if args.scattered { 2 } else { 1 };
    let g = testkit::geometry(args.layers, blocks);
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "--transport",
            args.transport.as_str(),
            "--layers",
            &args.layers.to_string(),
            "--serve",
            &blocks.to_string(),
        ])
        .arg("--tokens")
        .arg(max_tokens.to_string())
        .args(if args.devices.is_empty() { vec![] } else { vec!["--devices".to_string(), device::list(&args.devices)] })
        .args(if args.scattered { vec!["--scattered"] } else { vec![] })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the receiving process")?;
    let stdin = child.stdin.take().context("child stdin")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut peer = Peer { child, stdin, lines: BufReader::new(stdout).lines() };
    let served = peer.line("READY ")?;
    let (cache, pool) = device::filled(g, 3, args.devices.first().copied())?;
    if args.scattered {
        scatter(&pool)?;
    }
    let sender = KvSender::new(SenderConfig::default(), cache.clone(), testkit::fingerprint(&g))?;
    let label = args.transport.as_str().to_string();
    if served != args.transport.as_str() {
        eprintln!("kv-bench: the receiver serves {served} (UCX could not be loaded): results are for {served}");
    }
    let tls = match args.transport {
        TransportKind::Tcp => Some("tcp".to_string()),
        _ => std::env::var("UCX_TLS").ok(),
    };
    let device_direct = !args.devices.is_empty() && served == "ucx" && kv_transfer::transport::ucx::cuda_memory();
    let lanes = kv_transfer::transport::lanes::for_pool(None, device_direct);
    let puts = kv_transfer::transport::ucx::one_sided_puts_from_env().map_err(|e| anyhow!(e))?;
    let data_path = match served.as_str() {
        // Both processes run on this host and read the same variables: puts only where both allow them.
        "ucx" => match DataPath::from_env().map_err(|e| anyhow!(e))?.resolve(None, true, lanes) {
            DataPath::Put if puts => "put",
            _ => "am",
        },
        _ => "-",
    };
    let mut copy = baseline::Copier::new(&cache, args.no_baselines || !args.devices.is_empty());
    // Overhead: handshake + completion of a 1-token, 1-layer-sized request.
    let overhead = overhead_us(&sender, &mut peer, &pool, args)?;
    eprintln!(
        "{}",
        serde_json::json!({"transport": label, "lanes": lanes, "data_path": data_path, "overhead_us_median": overhead.0, "overhead_us_p99": overhead.1, "note": "handshake (begin) + completion (complete after the data landed), 1-token requests"})
    );
    if !args.json {
        println!(
            "{:>8} {:>7} {:>14} {:>9} {:>10} {:>12} {:>7}",
            "tokens", "layers", "bytes", "GB/s", "ms/req", "perftest GB/s", "ratio"
        );
    }
    for &tokens in &args.tokens {
        let nb = CacheGeometry::blocks_for(tokens) as u64;
        let bytes = args.layers as u64
            * (tokens as u64 * g.latent_bytes_per_token() as u64 + nb * g.indexer_bytes_per_block() as u64);
        // Warm-up (connections, registration caches), checksummed end to end, then one plain request: the
        // checksum pass leaves both GPUs idle for tens of milliseconds, and on the H200 pair the first
        // request after it paid 0.2 ms more in its first gather and last scatter.
        one(&sender, &mut peer, &pool, tokens, args.layers, true).context("warm-up request (checksums verified)")?;
        one(&sender, &mut peer, &pool, tokens, args.layers, false).context("warm-up request")?;
        let mut times = Vec::new();
        let start = Instant::now();
        while times.len() < args.reps.max(1) && (times.len() < 3 || start.elapsed().as_secs_f64() < args.budget_s) {
            times.push(one(&sender, &mut peer, &pool, tokens, args.layers, false)?);
        }
        let mean = times.iter().map(Duration::as_secs_f64).sum::<f64>() / times.len() as f64;
        // The median too: on a shared host one request's thread wake-ups can cost a millisecond.
        let mut sorted: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let gbps = bytes as f64 / mean / 1e9;
        // The request's per-layer message: a put per layer and region, or (a scattered device table) one
        // layer. Kept as the ratio's baseline since the first device measurements, though device layers
        // now travel gathered, several to a message of up to 32 MiB; `perftest_cold_gbps` is one
        // request-sized message.
        let msg = if args.scattered && device_direct {
            (bytes / args.layers as u64).min(kv_transfer::staging::STREAM_CHUNK as u64)
        } else {
            bytes / (2 * args.layers as u64)
        };
        let gpus = match args.devices[..] {
            [s, r] => Some((s, r)),
            _ => None,
        };
        let perf = if args.no_perftest { None } else { perftest_gbps(tls.as_deref(), gpus, msg, bytes) };
        let ratio = perf.map(|p| gbps / p);
        // Like-for-like references (not the ratio): perftest streaming a buffer as large as the
        // request (capped at 1 GiB) instead of re-sending one cache-resident message, and plain DRAM
        // copies of the same bytes on 1 and `lanes` threads.
        let cold =
            if args.no_perftest || args.no_baselines { None } else { perftest_cold_gbps(tls.as_deref(), gpus, bytes) };
        let (memcpy1, memcpy_n) = (copy.gbps(bytes, 1), copy.gbps(bytes, lanes));
        // Between GPUs: the same bytes copied device to device (cuMemcpyPeer), in one piece.
        let peer = match (&args.devices[..], args.no_baselines) {
            ([s, r], false) => device::peer_copy_gbps(&cache, *s, *r, bytes),
            _ => None,
        };
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "transport": label, "tokens": tokens, "layers": args.layers, "bytes": bytes,
                    "gbps": round(gbps), "ms_per_request": round(mean * 1e3), "perftest_gbps": perf.map(round),
                    "ms_per_request_median": round(median * 1e3),
                    "ratio": ratio.map(round), "lanes": lanes, "data_path": data_path,
                    "perftest_cold_gbps": cold.map(round), "ratio_cold": cold.map(|c| round(gbps / c)),
                    "memcpy_gbps": memcpy1.map(round),
                    "memcpy_lanes_gbps": memcpy_n.map(round),
                    "devices": args.devices, "scattered": args.scattered, "peer_copy_gbps": peer.map(round),
                    "ratio_peer_copy": peer.map(|p| round(gbps / p)),
                })
            );
        } else {
            println!(
                "{tokens:>8} {:>7} {bytes:>14} {gbps:>9.3} {:>10.3} {:>12} {:>7}",
                args.layers,
                mean * 1e3,
                perf.map(|p| format!("{p:.3}")).unwrap_or("-".into()),
                ratio.map(|r| format!("{r:.3}")).unwrap_or("-".into())
            );
        }
    }
    Ok(())
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Handshake + completion of a 1-token request: `begin` plus `complete` once every layer's (tiny) data
/// has already landed, so neither includes data movement. Median and p99 over 200 requests, in us.
fn overhead_us(
    sender: &KvSender,
    peer: &mut Peer,
    pool: &kv_cache::BlockPool,
    args: &Args,
) -> anyhow::Result<(f64, f64)> {
    let mut v = Vec::new();
    for i in 0..220 {
        let desc = peer.descriptor(1, false)?;
        let src = pool.reserve(&desc.request_id, 1)?;
        let t0 = Instant::now();
        let s = sender.begin(&desc, &src);
        let handshake = t0.elapsed();
        let r = s.and_then(|s| {
            for l in 0..args.layers {
                s.put_layer(LayerIdx(l as u32))?;
            }
            std::thread::sleep(Duration::from_millis(3));
            let t1 = Instant::now();
            s.complete(GeneratedToken { token_id: 1, logprobs: None }, None).map(|_| t1.elapsed())
        });
        pool.release(&desc.request_id)?;
        let completion = r.map_err(|e| anyhow!("transfer failed: {e}"))?;
        let done = peer.line("DONE ")?;
        if done != "ok" {
            bail!("receiver: {done}");
        }
        if i >= 20 {
            v.push((handshake + completion).as_secs_f64() * 1e6);
        }
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok((round(v[v.len() / 2]), round(v[v.len() * 99 / 100])))
}

/// GPUs of a device run: (sender's, receiver's).
type Gpus = Option<(usize, usize)>;

/// ucx_perftest on loopback: the better of ucp_put_bw and tag_bw for `msg`-byte messages, in GB/s. Between
/// GPUs (`gpus`): CUDA memory on both sides, each process seeing only its GPU (as `CUDA_VISIBLE_DEVICES`
/// pins it; UCX still moves the bytes GPU to GPU over cuda_ipc), the better of ucp_am_bw (what kv-transfer
/// sends) and tag_bw.
fn perftest_gbps(tls: Option<&str>, gpus: Gpus, msg: u64, bytes: u64) -> Option<f64> {
    let iters = (bytes.max(2 << 30) / msg.max(1)).clamp(50, 20_000);
    perftest_best(tls, gpus, msg, iters, (iters / 10).max(5))
}

/// The same with one message as large as the request (at most 1 GiB): the buffer streams from DRAM.
fn perftest_cold_gbps(tls: Option<&str>, gpus: Gpus, bytes: u64) -> Option<f64> {
    let msg = bytes.min(1 << 30);
    perftest_best(tls, gpus, msg, ((2u64 << 30) / msg).clamp(2, 10), 1)
}

fn perftest_best(tls: Option<&str>, gpus: Gpus, msg: u64, iters: u64, warmup: u64) -> Option<f64> {
    let mut best: Option<f64> = None;
    let tests = if gpus.is_some() { ["ucp_am_bw", "tag_bw"] } else { ["ucp_put_bw", "tag_bw"] };
    for test in tests {
        match perftest_once(tls, gpus, test, msg, iters, warmup) {
            Ok(g) => best = Some(best.map_or(g, |b: f64| b.max(g))),
            Err(e) => eprintln!("kv-bench: ucx_perftest {test} {msg} B: {e}"),
        }
    }
    best
}

/// A ucx_perftest client still running by then is killed; its output so far is still read (UCX 1.13
/// over tcp can print its `Final:` line for huge emulated puts and then hang in teardown).
const PERFTEST_DEADLINE: Duration = Duration::from_secs(30);

/// Runs `cmd` with its output collected; the flag says it outlived `deadline` and was killed.
fn output_within(mut cmd: Command, deadline: Duration) -> anyhow::Result<(std::process::Output, bool)> {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    // The pipes are drained while it runs, so a chatty child never blocks on a full pipe.
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(deadline) {
        Ok(out) => Ok((out?, false)),
        Err(_) => {
            // SAFETY: plain kill(2) of our own child, which has not been reaped (the waiting thread
            // still holds it), so the pid cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            Ok((rx.recv()??, true))
        }
    }
}

fn perftest_once(tls: Option<&str>, gpus: Gpus, test: &str, msg: u64, iters: u64, warmup: u64) -> anyhow::Result<f64> {
    let port = 20000 + (std::process::id() % 20000) as u16 + (msg % 97) as u16;
    let env = |c: &mut Command| {
        if let Some(t) = tls {
            c.env("UCX_TLS", t);
        }
    };
    let mut server = Command::new("ucx_perftest");
    server.args(["-p", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::null());
    env(&mut server);
    if let Some((_, r)) = gpus {
        server.env("CUDA_VISIBLE_DEVICES", r.to_string());
    }
    let mut server = server.spawn().context("ucx_perftest not found (apt install ucx-utils)")?;
    let mut last = String::new();
    let mut result = Err(anyhow!("no result"));
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(150));
        let mut c = Command::new("ucx_perftest");
        c.args(["127.0.0.1", "-p", &port.to_string(), "-t", test, "-s", &msg.to_string()]).args([
            "-n",
            &iters.to_string(),
            "-w",
            &warmup.to_string(),
        ]);
        env(&mut c);
        if let Some((s, _)) = gpus {
            c.env("CUDA_VISIBLE_DEVICES", s.to_string()).args(["-m", "cuda,cuda"]);
        }
        let (out, killed) = output_within(c, PERFTEST_DEADLINE)?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if let Some(line) = text.lines().find(|l| l.starts_with("Final:")) {
            // Final: iterations, latency 50%/avg/overall (us), bandwidth avg/overall (MB/s), msg rates.
            let f: Vec<f64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            result = f.get(5).map(|mbs| mbs * 1048576.0 / 1e9).ok_or_else(|| anyhow!("unparsable: {line}"));
            break;
        }
        last = format!("{}{}", text, String::from_utf8_lossy(&out.stderr));
        if killed {
            last = format!("killed after {} s without a result", PERFTEST_DEADLINE.as_secs());
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    result.map_err(|e| anyhow!("{e}; last output: {}", last.lines().last().unwrap_or("")))
}
