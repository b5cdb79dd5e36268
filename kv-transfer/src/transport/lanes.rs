//! Striping one link's data over several lanes (UCX workers with their own progress threads, or TCP
//! connections), so one request is not bound by one memcpy/cma/socket stream on one core.
//!
//! Lane 0 also carries the control messages; a flush completes once every lane flushed, and messages
//! that must follow the data (completion, abort acknowledgement) go out on lane 0 only after that.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::TransferError;

/// Puts are cut into pieces of about this size and dealt over the lanes by bytes ([`LaneDealer`]).
pub const STRIPE_BYTES: u64 = 1 << 20;

/// Lanes per link when neither the configuration nor `TANDEM_KV_LANES` says: a quarter of the cores, at
/// least 2 where there are 2 cores, at most 8 (two lanes on a 2- to 11-core machine, four on a 16-core
/// host). Two lanes on the 2-core VM: a same-host receiver's two progress threads place active messages
/// in parallel, 13.5-14.5 GB/s at 8K-32K tokens against 8.6-9.0 with one (bench/RESULTS.md, D11); three or
/// four lanes were slower there (10-12 GB/s).
pub fn default_lanes() -> usize {
    if let Some(n) = std::env::var("TANDEM_KV_LANES").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        return n.clamp(1, 64);
    }
    lanes_for_cores(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

fn lanes_for_cores(cores: usize) -> usize {
    (cores / 4).max(cores.min(2)).clamp(1, 8)
}

/// Lanes per link for a pool in GPU memory that UCX moves itself (cuda_ipc), when neither the
/// configuration nor `TANDEM_KV_LANES` says: one. On the H200 pair one lane moved a 32K-token request at
/// 326 GB/s and 2 to 16 lanes at 171-178 (bench/RESULTS.md, "GPU to GPU"): the copies of several UCX
/// workers into one GPU slow each other down, and one lane's thread keeps NVLink busy.
pub const DEVICE_LANES: usize = 1;

/// The lane count for a link: `configured`, else `TANDEM_KV_LANES`, else [`DEVICE_LANES`] where the pool
/// is GPU memory moved by a CUDA-capable UCX (`device_direct`), else [`default_lanes`].
pub fn for_pool(configured: Option<usize>, device_direct: bool) -> usize {
    let env = std::env::var("TANDEM_KV_LANES").ok().and_then(|v| v.trim().parse::<usize>().ok());
    match configured.or(env) {
        Some(n) => n.clamp(1, 64),
        None if device_direct => DEVICE_LANES,
        None => default_lanes(),
    }
}

/// Resolves a configured lane count (`None`: [`default_lanes`]).
pub fn lanes_or_default(lanes: Option<usize>) -> usize {
    lanes.map(|n| n.clamp(1, 64)).unwrap_or_else(default_lanes)
}

/// Where a piece of a put may be cut: both the latent entry (656 B) and the indexer block (8448 B)
/// divide this, so a piece of either region stays aligned to whole entries or blocks.
const CUT_UNIT: u64 = 346_368;

/// Splits `len` bytes into pieces of about [`STRIPE_BYTES`], each a multiple of a whole latent entry and
/// indexer block except the last; yields (offset, length) pairs.
pub fn pieces(len: u64, lanes: usize) -> impl Iterator<Item = (u64, u64)> {
    split(len, piece_bytes(lanes))
}

/// The piece size [`pieces`] cuts at: whole puts on one lane.
pub fn piece_bytes(lanes: usize) -> u64 {
    if lanes > 1 { STRIPE_BYTES.div_ceil(CUT_UNIT) * CUT_UNIT } else { u64::MAX }
}

/// Splits `len` bytes into pieces of `piece` bytes (the last one shorter); yields (offset, length) pairs.
pub fn split(len: u64, piece: u64) -> impl Iterator<Item = (u64, u64)> {
    let piece = piece.max(1);
    let n = if len == 0 { 0 } else { len.div_ceil(piece.min(len)) };
    (0..n).map(move |i| {
        let off = i * piece.min(len);
        (off, piece.min(len - off))
    })
}

/// Deals one session's pieces over the lanes by bytes: each piece goes to the lane with the fewest bytes
/// dealt so far (ties: the first counting from the session's own starting lane, so concurrent sessions start
/// on different lanes). A request's puts alternate between a large and a small region (a layer's latent
/// entries, 672 KB at 1K tokens, and its indexer blocks, 135 KB), so plain round-robin over two lanes put
/// every latent piece on one lane and every indexer piece on the other: one lane carried 83% of the bytes,
/// and a 1K-token request moved barely faster on two lanes than on one (D11, bench/RESULTS.md).
pub struct LaneDealer {
    start: usize,
    dealt: Mutex<Vec<u64>>,
}

impl LaneDealer {
    pub fn new(start: usize) -> Self {
        LaneDealer { start, dealt: Mutex::new(Vec::new()) }
    }

    /// The lane (below `lanes`) for the next piece of `len` bytes.
    pub fn deal(&self, lanes: usize, len: u64) -> usize {
        let lanes = lanes.max(1);
        let mut dealt = self.dealt.lock().unwrap_or_else(|p| p.into_inner());
        if dealt.len() != lanes {
            dealt.clear();
            dealt.resize(lanes, 0);
        }
        let lane = (0..lanes).map(|i| (self.start % lanes + i) % lanes).min_by_key(|&l| dealt[l]).unwrap_or(0);
        dealt[lane] += len;
        lane
    }
}

/// Requests smaller than this per lane stay on one lane (their flush then wakes one progress thread).
pub const SPREAD_MIN_BYTES: u64 = 4 * STRIPE_BYTES;

/// Per lane: puts issued, and how many of them a completed flush covers. A flush skips lanes whose
/// every put issued so far is already covered (only flushes that *completed* count, so a flush another
/// session has in flight is never relied on).
pub struct LaneEpochs {
    issued: Vec<std::sync::atomic::AtomicU64>,
    covered: Vec<std::sync::atomic::AtomicU64>,
}

impl LaneEpochs {
    pub fn new(lanes: usize) -> Self {
        let z = || (0..lanes).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
        LaneEpochs { issued: z(), covered: z() }
    }

    /// Call before handing a put to `lane`.
    pub fn note_put(&self, lane: usize) {
        self.issued[lane].fetch_add(1, Ordering::AcqRel);
    }

    /// The epoch a flush of `lane` issued now would cover, or `None` when nothing is left to cover.
    pub fn pending(&self, lane: usize) -> Option<u64> {
        let i = self.issued[lane].load(Ordering::Acquire);
        (self.covered[lane].load(Ordering::Acquire) < i).then_some(i)
    }

    /// A flush of `lane` that covered `epoch` completed.
    pub fn covered(&self, lane: usize, epoch: u64) {
        self.covered[lane].fetch_max(epoch, Ordering::AcqRel);
    }
}

type Then = Box<dyn FnOnce(Result<(), TransferError>) + Send>;

/// Joins the flushes of several lanes; `then` runs once, on the thread that finished the last one, with
/// the first error if any lane failed.
pub struct FlushJoin {
    left: AtomicUsize,
    error: Mutex<Option<TransferError>>,
    then: Mutex<Option<Then>>,
}

impl FlushJoin {
    pub fn new(parts: usize, then: impl FnOnce(Result<(), TransferError>) + Send + 'static) -> std::sync::Arc<Self> {
        let j = std::sync::Arc::new(FlushJoin {
            left: AtomicUsize::new(parts),
            error: Mutex::new(None),
            then: Mutex::new(Some(Box::new(then))),
        });
        if parts == 0 {
            j.run(Ok(()));
        }
        j
    }

    /// One lane's flush finished.
    pub fn part(&self, r: Result<(), TransferError>) {
        if let Err(e) = r {
            self.error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let r = match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            self.run(r);
        }
    }

    fn run(&self, r: Result<(), TransferError>) {
        let f = self.then.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(f) = f {
            f(r);
        }
    }
}

/// A UCX node address as exchanged in descriptors and handshakes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddress<'a> {
    /// The node's id (the header of its control messages).
    pub origin: u64,
    /// Which machine (and IPC/PID namespaces) the node runs on: equal ids can share memory.
    pub host: u64,
    /// UCP worker address per lane; lane 0 is the control lane.
    pub lanes: Vec<&'a [u8]>,
}

/// The wire form of a UCX node address with its lanes: origin id and host id (8 bytes LE each), then per
/// lane a 4-byte LE length and that lane's UCP worker address.
pub fn encode_address(origin: u64, host: u64, lanes: &[&[u8]]) -> Vec<u8> {
    let mut out = origin.to_le_bytes().to_vec();
    out.extend_from_slice(&host.to_le_bytes());
    for l in lanes {
        out.extend_from_slice(&(l.len() as u32).to_le_bytes());
        out.extend_from_slice(l);
    }
    out
}

/// An address from [`encode_address`]; `None` when malformed.
pub fn decode_address(bytes: &[u8]) -> Option<NodeAddress<'_>> {
    let word = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    let (origin, host) = (word(0)?, word(8)?);
    let mut rest = &bytes[16..];
    let mut lanes = Vec::new();
    while !rest.is_empty() {
        let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        lanes.push(rest.get(4..4 + n)?);
        rest = &rest[4 + n..];
    }
    (!lanes.is_empty() && lanes.iter().all(|l| !l.is_empty())).then_some(NodeAddress { origin, host, lanes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_lanes_by_cores() {
        let by: Vec<usize> = [1, 2, 3, 4, 8, 11, 12, 16, 32, 64, 128].into_iter().map(lanes_for_cores).collect();
        assert_eq!(by, [1, 2, 2, 2, 2, 2, 3, 4, 8, 8, 8]);
    }

    #[test]
    fn pieces_cover_the_put_in_aligned_pieces() {
        for len in [0u64, 656, 656 * 3, 8448 * 7, 5 << 20, (40 << 20) + 656 * 5] {
            let ps: Vec<(u64, u64)> = pieces(len, 4).collect();
            assert_eq!(ps.iter().map(|p| p.1).sum::<u64>(), len);
            let mut at = 0;
            for (i, &(off, l)) in ps.iter().enumerate() {
                assert_eq!(off, at);
                at += l;
                if i + 1 < ps.len() {
                    assert_eq!(l % 656, 0);
                    assert_eq!(l % 8448, 0);
                }
            }
        }
        assert_eq!(pieces(5 << 20, 1).count(), 1);
        assert_eq!(split(10, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4), (8, 2)]);
    }

    #[test]
    fn dealing_by_bytes_loads_every_lane_evenly() {
        // A 1K-token request's pieces: 62 layers of latent entries then indexer blocks.
        let (latent, indexer) = (1024 * 656, 16 * 8448);
        for lanes in [2usize, 3, 4] {
            let d = LaneDealer::new(5);
            let mut load = vec![0u64; lanes];
            for _ in 0..62 {
                for len in [latent, indexer] {
                    load[d.deal(lanes, len)] += len;
                }
            }
            let (lo, hi) = (*load.iter().min().unwrap(), *load.iter().max().unwrap());
            assert!(hi - lo <= latent, "{lanes} lanes: {load:?}");
        }
        // Equal pieces go round-robin from the session's starting lane.
        let d = LaneDealer::new(3);
        assert_eq!((0..4).map(|_| d.deal(2, 10)).collect::<Vec<_>>(), vec![1, 0, 1, 0]);
        assert_eq!(LaneDealer::new(0).deal(1, 10), 0);
    }

    #[test]
    fn epochs_skip_only_lanes_a_completed_flush_covered() {
        let e = LaneEpochs::new(2);
        assert_eq!(e.pending(0), None);
        e.note_put(1);
        e.note_put(1);
        let at = e.pending(1).unwrap();
        assert_eq!(at, 2);
        e.note_put(1);
        e.covered(1, at);
        assert_eq!(e.pending(1), Some(3), "a put after the flush began is not covered");
        e.covered(1, 3);
        e.covered(1, 2);
        assert_eq!(e.pending(1), None);
    }

    #[test]
    fn addresses_round_trip_and_reject_garbage() {
        let a = encode_address(42, 7, &[b"abc", b"de"]);
        assert_eq!(decode_address(&a), Some(NodeAddress { origin: 42, host: 7, lanes: vec![&b"abc"[..], &b"de"[..]] }));
        assert_eq!(decode_address(&a[..a.len() - 1]), None);
        assert_eq!(decode_address(&42u64.to_le_bytes()), None);
        assert_eq!(decode_address(&[0u8; 16]), None);
        assert_eq!(decode_address(b"short"), None);
    }

    #[test]
    fn flush_join_runs_once_with_the_first_error() {
        let hits = std::sync::Arc::new(Mutex::new(Vec::new()));
        let h = hits.clone();
        let j = FlushJoin::new(3, move |r| h.lock().unwrap().push(r.is_ok()));
        j.part(Ok(()));
        j.part(Err(TransferError::Transport("x".into())));
        assert!(hits.lock().unwrap().is_empty());
        j.part(Ok(()));
        assert_eq!(*hits.lock().unwrap(), vec![false]);
        let h = hits.clone();
        FlushJoin::new(0, move |r| h.lock().unwrap().push(r.is_ok()));
        assert_eq!(*hits.lock().unwrap(), vec![false, true]);
    }
}
