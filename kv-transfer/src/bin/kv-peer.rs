//! The other process of kv-transfer's cross-process tests (and a manual debugging aid): a receiver that
//! prints descriptors and outcomes, or a sender that ships the descriptors it reads. One line per event on
//! stdout: `DESC <hex TransferDescriptor>`, `OUTCOME <json>`, `SENT <json>`, `ERROR <message>`.
//! Honours `TANDEM_KV_FAULT` in builds with the fault-injection feature (every `cargo test` build).

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kv_cache::LayerIdx;
use kv_transfer::testkit;
use kv_transfer::transport::ucx::DataPath;
use kv_transfer::{
    ExpectRequest, KvReceiver, KvSender, ReceiverConfig, SenderConfig, TransferOutcome, TransportConfig, TransportKind,
};
use prost::Message;
use proto::v1::{GeneratedToken, TransferDescriptor};

#[path = "kv-bench/device.rs"]
mod device;

#[derive(Parser)]
#[command(about = "kv-transfer test peer: one side of a transfer in its own process")]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Serve a receiver: reserve, print a descriptor per request, print each outcome.
    Recv {
        #[arg(long)]
        transport: TransportKind,
        /// UCX_TLS override for the UCX context.
        #[arg(long)]
        tls: Option<String>,
        #[command(flatten)]
        cache: CacheShape,
        #[arg(long, default_value_t = 300)]
        tokens: usize,
        #[arg(long, default_value_t = 1)]
        requests: usize,
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
        /// UCX nodes placing active-message writes (default: TANDEM_KV_LANES or by cores).
        #[arg(long)]
        lanes: Option<usize>,
        /// Accept one-sided UCX puts from senders that passed the handshake (default:
        /// TANDEM_UCX_ONE_SIDED_PUTS, else off).
        #[arg(long)]
        one_sided_puts: bool,
    },
    /// Ship every descriptor read from stdin (`DESC <hex>` lines), all layers, then complete.
    Send {
        #[arg(long)]
        tls: Option<String>,
        #[command(flatten)]
        cache: CacheShape,
        /// UCX data path: auto, put or am (default: TANDEM_UCX_DATA_PATH, else auto). `put` needs
        /// --one-sided-puts.
        #[arg(long)]
        data_path: Option<DataPath>,
        /// Allow one-sided UCX puts (default: TANDEM_UCX_ONE_SIDED_PUTS, else off).
        #[arg(long)]
        one_sided_puts: bool,
        /// Lanes per receiver (default: TANDEM_KV_LANES or by cores).
        #[arg(long)]
        lanes: Option<usize>,
    },
}

/// The cache each peer builds: the two must agree, as a descriptor names blocks and layers of the receiver's.
#[derive(clap::Args)]
struct CacheShape {
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 64)]
    blocks: usize,
    /// The pool in this GPU's memory (needs the `cuda` feature); default: host memory.
    #[arg(long)]
    device: Option<usize>,
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> anyhow::Result<()> {
    // UCX logs to stdout by default; keep stdout for this tool's own lines.
    if std::env::var_os("UCX_LOG_FILE").is_none() {
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("UCX_LOG_FILE", "stderr") };
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    match Args::parse().role {
        Role::Recv { transport, tls, cache, tokens, requests, timeout_ms, lanes, one_sided_puts } => {
            let g = testkit::geometry(cache.layers, cache.blocks);
            let (cache, pool) = device::filled(g, 1, cache.device)?;
            let tc = match transport {
                TransportKind::Ucx => TransportConfig::Ucx { tls, tcp_fallback: None },
                k => TransportConfig::of_kind(k),
            };
            let rc =
                ReceiverConfig { lanes, one_sided_puts: one_sided_puts.then_some(true), ..ReceiverConfig::new(tc) };
            let recv = KvReceiver::start(rc, cache.clone(), pool.clone(), testkit::fingerprint(&g))?;
            for i in 0..requests {
                let id = format!("peer-{i}");
                let table = pool.reserve(&id, tokens)?;
                let req = ExpectRequest {
                    request_id: id.clone(),
                    blocks: table,
                    num_tokens: tokens,
                    timeout: Duration::from_millis(timeout_ms),
                    verify_checksum: true,
                };
                let (desc, pending) = recv.expect(req)?;
                say(format!("DESC {}", testkit::to_hex(&desc.encode_to_vec())));
                let outcome = pending.wait_timeout(Duration::from_millis(timeout_ms) + Duration::from_secs(5));
                let json = match outcome {
                    Some(Ok(TransferOutcome::Completed(c))) => {
                        let blocks = pool.table(&id).map(|t| t.blocks).unwrap_or_default();
                        let digest = testkit::request_digest(&cache, &blocks, tokens);
                        pool.release(&id)?;
                        serde_json::json!({"completed": c.request_id, "checksum_verified": c.checksum_verified,
                            "digest": format!("{digest:016x}")})
                    }
                    Some(Ok(TransferOutcome::Released(r))) => serde_json::json!({"released": r.request_id}),
                    Some(Err(e)) => serde_json::json!({"error": e.to_string()}),
                    None => serde_json::json!({"error": "no outcome"}),
                };
                say(format!("OUTCOME {json}"));
            }
        }
        Role::Send { tls, cache, data_path, lanes, one_sided_puts } => {
            let g = testkit::geometry(cache.layers, cache.blocks);
            let (cache, pool) = device::filled(g, 2, cache.device)?;
            let cfg = SenderConfig {
                ucx_tls: tls,
                ucx_data_path: data_path,
                ucx_one_sided_puts: one_sided_puts.then_some(true),
                lanes,
                ..Default::default()
            };
            let sender = KvSender::new(cfg, cache.clone(), testkit::fingerprint(&g))?;
            let sender = Arc::new(sender);
            for line in std::io::stdin().lock().lines() {
                let line = line?;
                let Some(hex) = line.strip_prefix("DESC ") else { continue };
                let desc = TransferDescriptor::decode(testkit::from_hex(hex).context("bad hex")?.as_slice())?;
                let src = pool.reserve(&desc.request_id, desc.num_tokens as usize)?;
                let digest = testkit::request_digest(&cache, &src.blocks, desc.num_tokens as usize);
                let r = (|| {
                    let s = sender.begin(&desc, &src)?;
                    // Every layer queued before the shipping thread may read the first: they go as if
                    // written together (gathered device layers then travel together, deterministically).
                    let gate = Arc::new(testkit::Gate::default());
                    let queued = (0..g.num_layers).try_for_each(|l| {
                        s.put_layer_when(LayerIdx(l as u32), kv_cache::LayerReady::pending(gate.clone()))
                    });
                    gate.open();
                    queued?;
                    s.complete(GeneratedToken { token_id: 1, logprobs: None }, None)
                })();
                pool.release(&desc.request_id)?;
                match r {
                    Ok(rep) => say(format!(
                        "SENT {}",
                        serde_json::json!({"bytes": rep.bytes, "digest": format!("{digest:016x}")})
                    )),
                    Err(e) => say(format!("ERROR {e}")),
                }
            }
        }
    }
    Ok(())
}
