//! Shared set-up for the kv-transfer integration tests: a receiver and a sender over one transport, with
//! random source caches and poisoned destination caches, in host memory or in a simulated device
//! (`testkit::SimulatedDevice`: reachable only through its `DeviceCopy`).
#![allow(dead_code)]

pub mod cases;

/// Every scenario of [`cases`] as one test each, in a module `$m`, over transport `$kind`.
#[allow(unused_macros)]
macro_rules! transport_tests {
    ($m:ident, $kind:expr) => {
        mod $m {
            use super::*;
            use $crate::common::cases;
            #[test]
            fn completes_with_partial_last_block() {
                cases::completes_with_partial_last_block(&$kind)
            }
            #[test]
            fn prompt_shorter_than_one_block() {
                cases::prompt_shorter_than_one_block(&$kind)
            }
            #[test]
            fn long_prompt_128k_tokens() {
                cases::long_prompt_128k_tokens(&$kind)
            }
            #[test]
            fn release_frees_the_reservation() {
                cases::release_frees_the_reservation(&$kind)
            }
            #[test]
            fn deadline_expires_without_a_sender() {
                cases::deadline_expires_without_a_sender(&$kind)
            }
            #[test]
            fn deadline_mid_transfer_and_no_late_write() {
                cases::deadline_mid_transfer_and_no_late_write(&$kind)
            }
            #[test]
            fn client_abort_mid_transfer() {
                cases::client_abort_mid_transfer(&$kind)
            }
            #[test]
            fn sender_abort() {
                cases::sender_abort(&$kind)
            }
            #[test]
            fn bad_descriptors_rejected_before_any_write() {
                cases::bad_descriptors_rejected_before_any_write(&$kind)
            }
            #[test]
            fn incomplete_sessions_are_refused() {
                cases::incomplete_sessions_are_refused(&$kind)
            }
            #[test]
            fn layers_wait_for_their_completion_marker() {
                cases::layers_wait_for_their_completion_marker(&$kind)
            }
            #[test]
            fn layers_stream_as_their_markers_are_reached() {
                cases::layers_stream_as_their_markers_are_reached(&$kind)
            }
            #[test]
            fn concurrent_requests() {
                cases::concurrent_requests(&$kind)
            }
        }
    };
}

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::{BlockPool, BlockTable, CacheGeometry, KvCache, LayerIdx};
use kv_transfer::testkit::{self, SimulatedDevice};
use kv_transfer::transport::ucx::DataPath;
use kv_transfer::{KvReceiver, KvSender, ReceiverConfig, SenderConfig, TransportConfig, TransportKind};
use proto::v1::TransferDescriptor;

/// A transport under test. UCX variants carry the UCX_TLS value they force; `Striped` ships every
/// request over several lanes (UCX nodes on both sides, or TCP connections).
#[derive(Debug, Clone)]
pub enum Kind {
    InProc,
    Tcp,
    Ucx(&'static str),
    /// UCX with receiver-placed active-message data instead of one-sided puts.
    UcxAm(&'static str),
    /// `.0` with `.1` lanes per link on both sides (the other variants use one).
    Striped(Box<Kind>, usize),
    /// `.0` with the caches of `.1` in (simulated) device memory, staged through host memory.
    Device(Box<Kind>, OnDevice),
}

/// Which side's pool is in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDevice {
    Sender,
    Receiver,
    Both,
}

impl Kind {
    pub fn base(&self) -> &Kind {
        match self {
            Kind::Striped(k, _) | Kind::Device(k, _) => k.base(),
            k => k,
        }
    }

    pub fn lanes(&self) -> usize {
        match self {
            Kind::Striped(_, n) => *n,
            Kind::Device(k, _) => k.lanes(),
            _ => 1,
        }
    }

    /// (sender, receiver): whether each side's pool is in device memory.
    pub fn on_device(&self) -> (bool, bool) {
        match self {
            Kind::Device(_, d) => (*d != OnDevice::Receiver, *d != OnDevice::Sender),
            Kind::Striped(k, _) => k.on_device(),
            _ => (false, false),
        }
    }

    pub fn tls(&self) -> Option<&'static str> {
        match self.base() {
            Kind::Ucx(tls) | Kind::UcxAm(tls) => Some(tls),
            _ => None,
        }
    }

    pub fn data_path(&self) -> Option<DataPath> {
        match self.base() {
            Kind::Ucx(_) => Some(DataPath::Put),
            Kind::UcxAm(_) => Some(DataPath::ActiveMessage),
            _ => None,
        }
    }

    pub fn transport_kind(&self) -> TransportKind {
        match self.base() {
            Kind::InProc => TransportKind::InProc,
            Kind::Tcp => TransportKind::Tcp,
            _ => TransportKind::Ucx,
        }
    }

    fn receiver_transport(&self) -> TransportConfig {
        match self.tls() {
            Some(tls) => TransportConfig::Ucx { tls: Some(tls.to_string()), tcp_fallback: None },
            None => TransportConfig::of_kind(self.transport_kind()),
        }
    }

    /// Whether the sender ships one-sided puts (and the receiver accepts them): `Ucx` variants.
    pub fn one_sided_puts(&self) -> bool {
        self.data_path() == Some(DataPath::Put)
    }

    pub fn receiver_config(&self) -> ReceiverConfig {
        ReceiverConfig {
            lanes: Some(self.lanes()),
            one_sided_puts: Some(self.one_sided_puts()),
            ..ReceiverConfig::new(self.receiver_transport())
        }
    }

    pub fn sender_config(&self) -> SenderConfig {
        let mut c = SenderConfig { lanes: Some(self.lanes()), ..SenderConfig::default() };
        c.ucx_tls = self.tls().map(str::to_string);
        c.ucx_data_path = self.data_path();
        c.ucx_one_sided_puts = Some(self.one_sided_puts());
        c
    }

    /// Whether this transport can run here; prints why not.
    pub fn available(&self) -> bool {
        if self.tls().is_some()
            && let Err(e) = kv_transfer::ucx_available()
        {
            // Under CI (scripts/test.sh installs UCX) a missing libucp must fail, not pass silently.
            assert!(std::env::var_os("CI").is_none(), "libucp is not available under CI: {e}");
            eprintln!("SKIPPED: libucp is not available ({e}); install libucx0 to run the UCX tests");
            return false;
        }
        true
    }
}

pub struct Pair {
    pub kind: Kind,
    pub recv: KvReceiver,
    pub rcache: Arc<KvCache>,
    pub rpool: Arc<BlockPool>,
    pub sender: KvSender,
    pub scache: Arc<KvCache>,
    pub spool: Arc<BlockPool>,
    /// The simulated devices behind device pools.
    pub sdev: Option<Arc<SimulatedDevice>>,
    pub rdev: Option<Arc<SimulatedDevice>>,
}

pub struct Opts {
    pub layers: usize,
    pub recv_blocks: usize,
    pub send_blocks: usize,
    pub sender: Option<SenderConfig>,
    pub quarantine: Duration,
    pub abort_ack_timeout: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            layers: 4,
            recv_blocks: 64,
            send_blocks: 64,
            sender: None,
            quarantine: Duration::from_millis(300),
            abort_ack_timeout: Duration::from_millis(500),
        }
    }
}

pub fn pair(kind: &Kind, o: Opts) -> Option<Pair> {
    if !kind.available() {
        return None;
    }
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let rg = testkit::geometry(o.layers, o.recv_blocks);
    let sg = testkit::geometry(o.layers, o.send_blocks);
    let (send_dev, recv_dev) = kind.on_device();
    let (rcache, rpool, rdev) = cache(rg, seed ^ 0xdead, recv_dev);
    let (scache, spool, sdev) = cache(sg, seed, send_dev);
    let mut rc = kind.receiver_config();
    rc.quarantine = o.quarantine;
    rc.abort_ack_timeout = o.abort_ack_timeout;
    let recv = KvReceiver::start(rc, rcache.clone(), rpool.clone(), testkit::fingerprint(&rg)).expect("receiver");
    assert_eq!(recv.transport(), kind.transport_kind(), "the receiver must serve the transport under test");
    let scfg = o.sender.unwrap_or_else(|| kind.sender_config());
    let sender = KvSender::new(scfg, scache.clone(), testkit::fingerprint(&sg)).expect("sender");
    Some(Pair { kind: kind.clone(), recv, rcache, rpool, sender, scache, spool, sdev, rdev })
}

/// A filled test cache in host memory, or in a simulated device.
fn cache(g: CacheGeometry, seed: u64, device: bool) -> (Arc<KvCache>, Arc<BlockPool>, Option<Arc<SimulatedDevice>>) {
    if device {
        let (c, p, d) = testkit::device_cache(g, seed);
        assert_eq!(c.memory_kind(), kv_cache::MemoryKind::Device { ordinal: 0 });
        assert!(c.host().is_err(), "host accessors must refuse the simulated device");
        (c, p, Some(d))
    } else {
        let (c, p) = testkit::filled_cache(g, seed);
        (c, p, None)
    }
}

/// `len` bytes at `offset` of a cache, host or device.
pub fn read(c: &KvCache, offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    // SAFETY: tests read only bytes no transfer writes at the time.
    unsafe { c.arena().copy_out(offset, &mut v) }.expect("read the test cache");
    v
}

/// Writes `bytes` at `offset` of a cache, host or device.
pub fn write(c: &KvCache, offset: usize, bytes: &[u8]) {
    // SAFETY: tests write only bytes nobody else touches at the time.
    unsafe { c.arena().copy_in(offset, bytes) }.expect("write the test cache");
}

/// xxh3 of a whole arena (detects any write).
pub fn arena_hash(c: &KvCache) -> u64 {
    xxhash_rust_free_hash(&read(c, 0, c.arena().len()))
}

fn xxhash_rust_free_hash(b: &[u8]) -> u64 {
    // FNV-1a over 8-byte words: enough to notice a changed byte, no extra dependency.
    let mut h: u64 = 0xcbf29ce484222325;
    for w in b.chunks(8) {
        let mut x = [0u8; 8];
        x[..w.len()].copy_from_slice(w);
        h ^= u64::from_le_bytes(x);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Asserts every byte of the request landed: latent entries of tokens 0..n and whole indexer blocks
/// (read through `copy_out`, so host and device pools alike).
pub fn assert_landed(p: &Pair, desc: &TransferDescriptor, src: &BlockTable) {
    for l in 0..p.rcache.geometry().num_layers {
        assert_layer_landed(p, desc, src, LayerIdx(l as u32));
    }
}

/// `assert_landed` for one layer.
pub fn assert_layer_landed(p: &Pair, desc: &TransferDescriptor, src: &BlockTable, layer: LayerIdx) {
    assert!(layer_landed(p, desc, src, layer).is_ok(), "{}", layer_landed(p, desc, src, layer).unwrap_err());
}

/// Whether one layer of the request is byte-identical on both sides (else what differs).
pub fn layer_landed(p: &Pair, desc: &TransferDescriptor, src: &BlockTable, layer: LayerIdx) -> Result<(), String> {
    let (sg, rg) = (p.scache.geometry(), p.rcache.geometry());
    let (n, per) = (desc.num_tokens as usize, rg.latent_bytes_per_token());
    for (i, &d) in desc.block_ids.iter().enumerate() {
        let (sb, db) = (src.blocks[i], kv_cache::BlockId(d));
        let tokens = (n - i * 64).min(64);
        let a = read(&p.scache, sg.latent_block_offset(layer, sb), tokens * per);
        let b = read(&p.rcache, rg.latent_block_offset(layer, db), tokens * per);
        if a != b {
            return Err(format!("layer {} block {i}: latent entries differ", layer.0));
        }
        let ib = rg.indexer_bytes_per_block();
        let a = read(&p.scache, sg.indexer_block_offset(layer, sb), ib);
        let b = read(&p.rcache, rg.indexer_block_offset(layer, db), ib);
        if a != b {
            return Err(format!("layer {} block {i}: indexer block differs", layer.0));
        }
    }
    Ok(())
}

/// Waits until the receiver pool holds exactly `used` blocks (freeing may trail the outcome a little).
pub fn wait_pool_used(pool: &BlockPool, used: usize, within: Duration) {
    let until = Instant::now() + within;
    loop {
        let s = pool.stats();
        if s.used_blocks == used {
            pool.check_invariants().unwrap();
            return;
        }
        assert!(Instant::now() < until, "pool still holds {} blocks (want {used}): {s:?}", s.used_blocks);
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reserves `tokens` on both sides; the receiver first takes `skip` blocks so ids differ between sides.
pub fn reserve(p: &Pair, id: &str, tokens: usize) -> (BlockTable, BlockTable) {
    let dst = p.rpool.reserve(id, tokens).unwrap();
    let src = p.spool.reserve(id, tokens).unwrap();
    (dst, src)
}

/// Puts every layer.
pub fn put_all(s: &kv_transfer::SendSession, layers: usize) {
    for l in 0..layers {
        s.put_layer(LayerIdx(l as u32)).unwrap();
    }
}

/// The sender's side of "the receiving kv-peer dies mid-transfer": reads the peer's `DESC` line (within
/// `within`), sends layers 0 and 1 of a 300-token request from `cache` / `pool` through `config`, kills the
/// peer, then sends layers 2 and 3 and completes. The completion must fail (a lost peer, the deadline or the
/// transport) within 4.5 s of the kill: the descriptor's 3 s deadline plus the reply grace of 1 s.
pub fn sender_sees_the_receiver_die(
    mut child: std::process::Child,
    out: &std::sync::mpsc::Receiver<String>,
    within: Duration,
    config: SenderConfig,
    cache: Arc<KvCache>,
    pool: &BlockPool,
) {
    use prost::Message;
    let line = out.recv_timeout(within).expect("descriptor line");
    let hex = line.strip_prefix("DESC ").unwrap();
    let desc = TransferDescriptor::decode(testkit::from_hex(hex).unwrap().as_slice()).unwrap();
    let g = *cache.geometry();
    let sender = KvSender::new(config, cache, testkit::fingerprint(&g)).unwrap();
    let src = pool.reserve("s", 300).unwrap();
    let s = sender.begin(&desc, &src).unwrap();
    s.put_layer(LayerIdx(0)).unwrap();
    s.put_layer(LayerIdx(1)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap();
    child.wait().unwrap();
    let t0 = Instant::now();
    let _ = s.put_layer(LayerIdx(2));
    let _ = s.put_layer(LayerIdx(3));
    let r = s.complete(proto::v1::GeneratedToken { token_id: 1, logprobs: None }, None);
    let e = r.expect_err("the receiver is dead");
    assert!(
        matches!(
            e,
            kv_transfer::TransferError::PeerLost { .. }
                | kv_transfer::TransferError::DeadlineExceeded(_)
                | kv_transfer::TransferError::Transport(_)
        ),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_millis(4500), "took {:?}", t0.elapsed());
}

/// Starts the `kv-peer` binary `exe` with `args` (and the fault knob `TANDEM_KV_FAULT` = `fault`, or none);
/// its stdout lines arrive on the channel.
pub fn spawn_peer(
    exe: &str,
    args: &[&str],
    fault: Option<&str>,
) -> (std::process::Child, std::process::ChildStdin, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    cmd.stderr(std::process::Stdio::inherit());
    match fault {
        Some(f) => cmd.env("TANDEM_KV_FAULT", f),
        None => cmd.env_remove("TANDEM_KV_FAULT"),
    };
    let mut child = cmd.spawn().expect("spawn kv-peer");
    let stdin = child.stdin.take().expect("piped stdin");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, stdin, rx)
}
