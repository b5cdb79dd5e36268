//! Shared set-up for the kv-transfer integration tests: a receiver and a sender over one transport, with
//! random source caches and poisoned destination caches.
#![allow(dead_code)]

pub mod cases;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::{BlockPool, BlockTable, CacheGeometry, KvCache, LayerIdx};
use kv_transfer::testkit;
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
}

impl Kind {
    pub fn base(&self) -> &Kind {
        match self {
            Kind::Striped(k, _) => k.base(),
            k => k,
        }
    }

    pub fn lanes(&self) -> usize {
        match self {
            Kind::Striped(_, n) => *n,
            _ => 1,
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

    pub fn receiver_config(&self) -> ReceiverConfig {
        ReceiverConfig { lanes: Some(self.lanes()), ..ReceiverConfig::new(self.receiver_transport()) }
    }

    pub fn sender_config(&self) -> SenderConfig {
        let mut c = SenderConfig { lanes: Some(self.lanes()), ..SenderConfig::default() };
        c.ucx_tls = self.tls().map(str::to_string);
        c.ucx_data_path = self.data_path();
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
    let (rcache, rpool) = testkit::filled_cache(rg, seed ^ 0xdead);
    let (scache, spool) = testkit::filled_cache(sg, seed);
    let mut rc = kind.receiver_config();
    rc.quarantine = o.quarantine;
    rc.abort_ack_timeout = o.abort_ack_timeout;
    let recv = KvReceiver::start(rc, rcache.clone(), rpool.clone(), testkit::fingerprint(&rg)).expect("receiver");
    assert_eq!(recv.transport(), kind.transport_kind(), "the receiver must serve the transport under test");
    let scfg = o.sender.unwrap_or_else(|| kind.sender_config());
    let sender = KvSender::new(scfg, scache.clone(), testkit::fingerprint(&sg)).expect("sender");
    Some(Pair { kind: kind.clone(), recv, rcache, rpool, sender, scache, spool })
}

/// xxh3 of a whole arena (detects any write).
pub fn arena_hash(c: &KvCache) -> u64 {
    // SAFETY: tests read only when no transfer writes.
    xxhash_rust_free_hash(unsafe { c.arena().slice(0, c.arena().len()) }.expect("a host arena"))
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

/// Asserts every byte of the request landed: latent entries of tokens 0..n and whole indexer blocks.
pub fn assert_landed(p: &Pair, desc: &TransferDescriptor, src: &BlockTable) {
    let g: &CacheGeometry = p.rcache.geometry();
    let n = desc.num_tokens as usize;
    for l in 0..g.num_layers {
        let layer = LayerIdx(l as u32);
        for t in 0..n {
            let (sb, slot) = src.slot(t).unwrap();
            let db = kv_cache::BlockId(desc.block_ids[t / 64]);
            // SAFETY: the transfer finished; nobody writes.
            let (sc, rc) = (p.scache.host().unwrap(), p.rcache.host().unwrap());
            let (a, b) = unsafe { (sc.latent_entry(layer, sb, slot), rc.latent_entry(layer, db, slot)) };
            assert!(a == b, "layer {l} token {t}: latent entry differs");
        }
        for (i, &d) in desc.block_ids.iter().enumerate() {
            let (sc, rc) = (p.scache.host().unwrap(), p.rcache.host().unwrap());
            let (a, b) =
                unsafe { (sc.indexer_block(layer, src.blocks[i]), rc.indexer_block(layer, kv_cache::BlockId(d))) };
            assert!(a == b, "layer {l} block {i}: indexer block differs");
        }
    }
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
