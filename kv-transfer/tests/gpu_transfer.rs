//! Cache pools in GPU memory moving between two processes over UCX (built with `--features cuda`; run on
//! a GPU machine by `scripts/gpu-test.sh`). The receiver is this process, its pool on the last GPU; the
//! sender is `kv-peer` with its pool on GPU 0 (on a one-GPU machine both share it). With a CUDA-capable
//! libucp (the `libucx-cu13` wheel) the bytes go device to device (cuda_ipc); without one they stage
//! through host memory, and `TANDEM_REQUIRE_GPU=1` runs insist on the direct path.
//!
//! Each transfer is checked three ways: the receiver verifies every layer's checksum (computed on both
//! GPUs), the request's bytes read back through host copies hash the same on both sides, and the
//! receiver's pool returns every block.

mod common;

use std::io::Write;
use std::process::{Child, ChildStdin};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait_pool_used;
use kv_cache::{BlockPool, KvCache};
use kv_transfer::{
    ExpectRequest, KvReceiver, ReceiverConfig, SenderConfig, TransferError, TransferOutcome, TransportConfig, testkit,
};
use prost::Message;

const LAYERS: usize = 4;
const BLOCKS: usize = 160;

fn required() -> bool {
    std::env::var("TANDEM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The sender's and the receiver's GPU, or `None` (with a message) where this machine cannot run the test.
fn gpus() -> Option<(usize, usize)> {
    let n = match engine::cuda::device::device_count() {
        Ok(n) => n,
        Err(e) if !required() => {
            eprintln!("skipped: no GPU ({e}); TANDEM_REQUIRE_GPU=1 makes this a failure");
            return None;
        }
        Err(e) => panic!("GPU test could not start: {e}"),
    };
    if kv_transfer::transport::ucx::load().is_err() {
        assert!(!required(), "TANDEM_REQUIRE_GPU=1 but libucp does not load");
        eprintln!("skipped: libucp does not load");
        return None;
    }
    if required() {
        assert!(
            kv_transfer::transport::ucx::cuda_memory(),
            "TANDEM_REQUIRE_GPU=1 but the loaded libucp ({}) has no CUDA support: put libucx-cu13's lib on LD_LIBRARY_PATH",
            kv_transfer::transport::ucx::api::version()
        );
    }
    Some((0, n - 1))
}

fn device_pool(ordinal: usize, seed: u64) -> (Arc<KvCache>, Arc<BlockPool>) {
    device_pool_of(ordinal, seed, LAYERS, BLOCKS)
}

fn device_pool_of(ordinal: usize, seed: u64, layers: usize, blocks: usize) -> (Arc<KvCache>, Arc<BlockPool>) {
    let g = testkit::geometry(layers, blocks);
    let gpu = engine::cuda::Gpu::open(ordinal, &engine::cuda::kernels::default_cache_dir()).expect("open GPU");
    let cache = engine::cuda::pool::allocate(&gpu, g).expect("device pool");
    testkit::fill(&cache, seed);
    (Arc::new(cache), Arc::new(BlockPool::new(blocks)))
}

fn receiver(cache: &Arc<KvCache>, pool: &Arc<BlockPool>) -> KvReceiver {
    let g = *cache.geometry();
    let tc = TransportConfig::Ucx { tls: None, tcp_fallback: None };
    KvReceiver::start(ReceiverConfig::new(tc), cache.clone(), pool.clone(), testkit::fingerprint(&g)).unwrap()
}

fn peer(args: &[String], fault: Option<&str>) -> (Child, ChildStdin, std::sync::mpsc::Receiver<String>) {
    // A bundle run on the GPU machine names the unpacked binary (the build path does not exist there).
    let exe = std::env::var("TANDEM_KV_PEER").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kv-peer").to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    common::spawn_peer(&exe, &args, fault)
}

fn shape(device: usize) -> Vec<String> {
    shape_of(device, LAYERS, BLOCKS)
}

fn shape_of(device: usize, layers: usize, blocks: usize) -> Vec<String> {
    ["--layers", &layers.to_string(), "--blocks", &blocks.to_string(), "--device", &device.to_string()]
        .map(String::from)
        .to_vec()
}

fn json_line(out: &std::sync::mpsc::Receiver<String>, prefix: &str) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let left = until.checked_duration_since(Instant::now()).expect("the peer answered in time");
        let line = out.recv_timeout(left).expect("the peer answered in time");
        if let Some(rest) = line.strip_prefix(prefix) {
            return serde_json::from_str(rest).unwrap();
        }
        assert!(!line.starts_with("ERROR"), "{line}");
    }
}

/// Requests of 1 block, a partial one and many, into a fragmented receiver pool (blocks interleaved
/// with another request's), each verified on both GPUs and by host copies.
#[test]
fn gpu_pools_ship_between_processes_intact() {
    // Device to device, every layer is gathered on the sender's GPU and scattered on this one (they are
    // small, and the 51 blocks of the last request are scattered: 102 puts a layer), and kv-peer queues
    // the request's layers together, so its 4 layers travel as one message.
    ship_into_a_fragmented_pool(LAYERS, BLOCKS, 41, &[(1, 1), (64 * 3 + 17, 1), (64 * 50 + 5, 1)]);
}

/// Many layers of a larger request go together as a few 32 MiB gathered writes that start and end inside
/// layers (16 layers of 6000 tokens: 16 x 4.73 MB = 75.7 MB, three writes; of 1280 tokens: 16.1 MB, one),
/// land intact and are counted layer by layer (the checksums are verified per layer).
#[test]
fn gpu_layers_travel_together_in_a_few_large_writes() {
    ship_into_a_fragmented_pool(16, 200, 44, &[(6000, 3), (64 * 20, 1)]);
}

/// Ships each `(tokens, gathered writes expected)` request from `kv-peer` on GPU 0 into this process's
/// pool of `layers` x `blocks` on the last GPU, whose every other block a filler request holds.
fn ship_into_a_fragmented_pool(layers: usize, blocks: usize, seed: u64, requests: &[(usize, u64)]) {
    let Some((send_gpu, recv_gpu)) = gpus() else { return };
    let (cache, pool) = device_pool_of(recv_gpu, seed, layers, blocks);
    let recv = receiver(&cache, &pool);
    let mut args = vec!["send".to_string()];
    args.extend(shape_of(send_gpu, layers, blocks));
    let (mut child, mut stdin, out) = peer(&args, None);
    // Fragment the receiver's pool: every other block stays held by a filler request, so the only free
    // blocks are single ones (the allocator would otherwise hand out one contiguous run).
    let all: Vec<String> = (0..blocks).map(|i| format!("filler-{i}")).collect();
    for f in &all {
        pool.reserve(f, 64).unwrap();
    }
    for f in all.iter().skip(1).step_by(2) {
        pool.release(f).unwrap();
    }
    let fillers: Vec<&String> = all.iter().step_by(2).collect();
    let direct = kv_transfer::transport::ucx::cuda_memory();
    for (n, &(tokens, writes_wanted)) in requests.iter().enumerate() {
        let before = recv.stats();
        let id = format!("r{n}");
        let table = pool.reserve(&id, tokens).unwrap();
        let req = ExpectRequest {
            request_id: id.clone(),
            blocks: table.clone(),
            num_tokens: tokens,
            timeout: Duration::from_secs(30),
            verify_checksum: true,
        };
        let (desc, pending) = recv.expect(req).unwrap();
        writeln!(stdin, "DESC {}", testkit::to_hex(&desc.encode_to_vec())).unwrap();
        let sent = json_line(&out, "SENT ");
        match pending.wait_timeout(Duration::from_secs(40)).expect("an outcome") {
            Ok(TransferOutcome::Completed(c)) => assert!(c.checksum_verified, "{tokens} tokens: checksums verified"),
            other => panic!("{tokens} tokens: {other:?}"),
        }
        let got = testkit::request_digest(&cache, &table.blocks, tokens);
        assert_eq!(sent["digest"].as_str().unwrap(), format!("{got:016x}"), "{tokens} tokens: received bytes");
        let after = recv.stats();
        let gathered = after.stream_bytes_received - before.stream_bytes_received;
        let want = if direct { sent["bytes"].as_u64().unwrap() } else { 0 };
        assert_eq!(gathered, want, "request {n}, {tokens} tokens: bytes that came gathered");
        let writes = after.stream_writes_received - before.stream_writes_received;
        let writes_wanted = if direct { writes_wanted } else { 0 };
        assert_eq!(writes, writes_wanted, "request {n}, {tokens} tokens: gathered writes");
        pool.release(&id).unwrap();
    }
    for f in &fillers {
        pool.release(f).unwrap();
    }
    wait_pool_used(&pool, 0, Duration::from_secs(5));
    drop(stdin);
    assert!(child.wait().unwrap().success());
}

/// The sending process dies (SIGKILL) after layer 1 landed: the receiver fails the transfer in bounded
/// time and gets every block back.
#[test]
fn gpu_sender_killed_mid_transfer_frees_the_blocks() {
    let Some((send_gpu, recv_gpu)) = gpus() else { return };
    let (cache, pool) = device_pool(recv_gpu, 42);
    let recv = receiver(&cache, &pool);
    let tokens = 64 * 6 + 3;
    let req = ExpectRequest {
        request_id: "victim".into(),
        blocks: pool.reserve("victim", tokens).unwrap(),
        num_tokens: tokens,
        timeout: Duration::from_secs(4),
        verify_checksum: true,
    };
    let (desc, pending) = recv.expect(req).unwrap();
    let mut args = vec!["send".to_string()];
    args.extend(shape(send_gpu));
    let (mut child, mut stdin, _out) = peer(&args, Some("kill_after_layer:1"));
    writeln!(stdin, "DESC {}", testkit::to_hex(&desc.encode_to_vec())).unwrap();
    let t0 = Instant::now();
    assert!(!child.wait().unwrap().success(), "the sender must have died");
    let e = pending.wait_timeout(Duration::from_secs(10)).expect("bounded").unwrap_err();
    assert!(matches!(e, TransferError::PeerLost { .. } | TransferError::DeadlineExceeded(_)), "{e:?}");
    wait_pool_used(&pool, 0, Duration::from_secs(6));
    assert!(t0.elapsed() < Duration::from_secs(12));
}

/// The receiving process dies mid-transfer: the sender's completion fails in bounded time.
#[test]
fn gpu_receiver_killed_mid_transfer_fails_the_sender() {
    let Some((send_gpu, recv_gpu)) = gpus() else { return };
    let mut args = vec!["recv".to_string(), "--transport".into(), "ucx".into()];
    args.extend(["--tokens", "300", "--timeout-ms", "3000"].map(String::from));
    args.extend(shape(recv_gpu));
    let (child, _stdin, out) = peer(&args, None);
    let (cache, pool) = device_pool(send_gpu, 43);
    common::sender_sees_the_receiver_die(child, &out, Duration::from_secs(60), SenderConfig::default(), cache, &pool);
}
