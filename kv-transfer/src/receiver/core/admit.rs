//! Admission of receiver-mediated writes (TCP, in-process, UCX active messages): a write lands only in
//! an active transfer's own blocks (inside one layer, or a gathered write's stretch of the transfer's
//! layers), and the transfer cannot be freed while it runs.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{ReceiverCore, Transfer};
use crate::TransferError;
use crate::token::TOKEN_BYTES;

/// Why a receiver-mediated write was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The transfer is gone or no longer active (aborted, expired, completed): drop the bytes.
    Stale,
    /// The writer does not present the session's token (it is not the session's sender): drop the bytes;
    /// the transfer goes on. Counted in `ReceiverStats::dropped_untrusted`; log at debug at most, so a
    /// peer cannot flood the logs with them.
    WrongToken,
    /// The write is outside the transfer's blocks or malformed; the transfer has been failed.
    Invalid(String),
}

/// Permission to write `len` bytes at `ptr`, inside one layer of one transfer's blocks. Dropping it ends
/// the write; call `commit` first when the bytes arrived. For a device pool (`staged()`), `ptr` is a
/// device address: the bytes go in through [`WritePermit::copy_in`], or a CUDA-capable UCX writes them.
pub struct WritePermit {
    w: InFlight,
    pub ptr: *mut u8,
    pub len: usize,
    /// Where `ptr` is, from the pool base.
    offset: usize,
    staged: bool,
    layer: usize,
    latent: bool,
    committed: bool,
}

// SAFETY: the permit is the exclusive right to write its range (checked against the transfer's blocks).
unsafe impl Send for WritePermit {}

impl WritePermit {
    /// The destination bytes of a host pool.
    ///
    /// # Safety
    /// Only one slice per permit may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self) -> &mut [u8] {
        assert!(!self.staged, "a staged pool is written with copy_in");
        // SAFETY: admitted range inside the host arena, owned by this transfer, only this permit writes it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Whether the pool is device memory: write it with `copy_in`, or (CUDA memory, [`Self::cuda_memory`])
    /// let a CUDA-capable UCX write `ptr` directly.
    pub fn staged(&self) -> bool {
        self.staged
    }

    /// Whether the pool is CUDA memory a CUDA-capable UCX may write itself.
    pub fn cuda_memory(&self) -> bool {
        self.w.core.cache.arena().cuda_memory()
    }

    /// Copies `src` to `at` bytes into the permit's range, through the arena's copier for a device pool
    /// (a `memcpy` for host memory).
    pub fn copy_in(&self, at: usize, src: &[u8]) -> Result<(), String> {
        if at.checked_add(src.len()).is_none_or(|end| end > self.len) {
            return Err(format!("{}+{} outside the {}-byte write", at, src.len(), self.len));
        }
        // SAFETY: admitted range inside the arena, owned by this transfer; only this permit writes it.
        unsafe { self.w.core.cache.arena().copy_in(self.offset + at, src) }.map_err(|e| e.to_string())
    }

    /// The bytes could not be placed (the copier failed): fails the transfer with `why`. The sender is
    /// told to stop, and the blocks are freed once writes in progress (this one included) end.
    pub fn fail(self, why: &str) {
        self.w.fail("placing a write", why);
    }

    /// Records that every byte of the permit was written.
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for WritePermit {
    fn drop(&mut self) {
        if self.committed {
            let (latent, indexer) = if self.latent { (self.len as u64, 0) } else { (0, self.len as u64) };
            self.w.landed(self.layer, latent, indexer);
        }
    }
}

/// One write in progress on a transfer (a permit's): the transfer is not freed before it is dropped.
struct InFlight {
    core: Arc<ReceiverCore>,
    t: Arc<Transfer>,
}

impl InFlight {
    /// Fails the transfer: the sender is told to stop, and the blocks are freed once writes in progress
    /// (this one included) end.
    fn fail(&self, what: &str, why: &str) {
        let why = format!("request {}: {what}: {why}", self.t.request_id);
        self.core.fail(&self.t, TransferError::Transport(why.clone()), &why);
    }

    /// Counts `latent` and `indexer` bytes of `layer` as landed.
    fn landed(&self, layer: usize, latent: u64, indexer: u64) {
        self.t.latent_written[layer].fetch_add(latent, Ordering::Relaxed);
        self.t.indexer_written[layer].fetch_add(indexer, Ordering::Relaxed);
        self.core.counters.bytes_received.fetch_add(latent + indexer, Ordering::Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.t.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.core.on_quiescent(&self.t);
        }
    }
}

/// Permission to land bytes `offset..offset + len` of a transfer's stream, counted from the start of
/// layer `layer`'s (a gathered write: each layer's latent entries, then its indexer blocks, layer after
/// layer; a write may run on into the next layers) in one transfer's blocks: `pieces` are where they go,
/// as (pool offset, length), in stream order. Like a [`WritePermit`], it holds the transfer until
/// dropped; `commit` first when the bytes are in place.
pub struct StreamPermit {
    w: InFlight,
    pub pieces: Vec<(u64, u64)>,
    pub len: u64,
    /// (layer, latent bytes, indexer bytes) the write holds, layer by layer.
    layers: Vec<(usize, u64, u64)>,
    committed: bool,
}

impl StreamPermit {
    /// The pool's device copier (a stream permit exists only for a device pool).
    pub fn arena(&self) -> &kv_cache::KvArena {
        self.w.core.cache.arena()
    }

    /// The bytes could not be placed: fails the transfer with `why` (as [`WritePermit::fail`]).
    pub fn fail(self, why: &str) {
        self.w.fail("placing a gathered write", why);
    }

    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if self.committed {
            for &(layer, latent, indexer) in &self.layers {
                self.w.landed(layer, latent, indexer);
            }
            self.w.core.counters.stream_bytes_received.fetch_add(self.len, Ordering::Relaxed);
            self.w.core.counters.stream_writes_received.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl ReceiverCore {
    /// Admits a gathered write of `len` bytes at `offset` of `layer`'s stream, running on into the next
    /// layers' where it is longer, for `session` (see [`StreamPermit`]), whose writer presents `token`. As
    /// for [`ReceiverCore::admit_write`], a wrong token is refused and counted, and a range outside the
    /// transfer's stream or splitting an entry or a block fails the transfer. The destination comes from
    /// the transfer's own blocks only.
    pub fn admit_stream(
        self: &Arc<Self>,
        session: u64,
        token: &[u8; TOKEN_BYTES],
        layer: u32,
        offset: u64,
        len: u64,
    ) -> Result<StreamPermit, Refusal> {
        let w = self.enter_write(session, token)?;
        let t = w.t.clone();
        let plan = t.stream_plan.get_or_init(|| {
            let blocks: Vec<kv_cache::BlockId> = t.blocks.iter().map(|&b| kv_cache::BlockId(b)).collect();
            crate::layout::PutPlan::new(self.layout, self.layout, &blocks, &blocks, t.num_tokens as usize)
        });
        let bpl = plan.bytes_per_layer();
        let total = bpl.saturating_mul(self.geometry.num_layers as u64);
        let lo = (layer as u64).saturating_mul(bpl).saturating_add(offset);
        let hi = lo.saturating_add(len);
        let why = if layer as usize >= self.geometry.num_layers {
            Some(format!("gathered write into layer {layer} of {}", self.geometry.num_layers))
        } else if len > crate::staging::STREAM_CHUNK as u64 {
            // Refused before its pieces are mapped: a write lands in one buffer of this size.
            Some(format!("gathered write of {len} bytes, more than {}", crate::staging::STREAM_CHUNK))
        } else if len == 0 || offset >= bpl || hi > total {
            Some(format!(
                "gathered write {offset}+{len} from layer {layer} outside the transfer's {} layers of {bpl} bytes",
                self.geometry.num_layers
            ))
        } else if !plan.stream_boundary(lo) || !plan.stream_boundary(hi) {
            Some(format!("gathered write {offset}+{len} from layer {layer} splits an entry or a block"))
        } else {
            None
        };
        match why {
            None => Ok(StreamPermit {
                pieces: plan.stream_pieces(lo, hi, false),
                layers: plan.stream_layers(lo, hi),
                w,
                len,
                committed: false,
            }),
            Some(why) => Err(self.refuse(w, why)),
        }
    }

    /// Admits a receiver-mediated write of `len` bytes at pool offset `offset` for `session`, whose
    /// writer presents `token` (the session token of its Accept). A wrong token is refused (and counted)
    /// without touching the transfer (the writer is not its sender); a write outside the transfer's
    /// blocks from the token's holder fails the transfer.
    pub fn admit_write(
        self: &Arc<Self>,
        session: u64,
        token: &[u8; TOKEN_BYTES],
        offset: u64,
        len: u64,
    ) -> Result<WritePermit, Refusal> {
        let w = self.enter_write(session, token)?;
        match self.classify(&w.t, offset, len) {
            Ok((layer, latent)) => Ok(WritePermit {
                w,
                // SAFETY (of later use): classify checked the range lies inside the arena.
                ptr: self.cache.arena().as_ptr().wrapping_add(offset as usize),
                len: len as usize,
                offset: offset as usize,
                staged: self.staging.is_some(),
                layer,
                latent,
                committed: false,
            }),
            Err(why) => Err(self.refuse(w, why)),
        }
    }

    /// One more write in progress on the session's active transfer, if the writer presents the session
    /// token; a wrong token is counted and refused, an inactive transfer is stale.
    fn enter_write(self: &Arc<Self>, session: u64, token: &[u8; TOKEN_BYTES]) -> Result<InFlight, Refusal> {
        let Some(t) = self.tables().by_session.get(&session).cloned() else { return Err(Refusal::Stale) };
        if !t.session_token.matches(token) {
            self.count_dropped_untrusted(1);
            return Err(Refusal::WrongToken);
        }
        t.inflight.fetch_add(1, Ordering::SeqCst);
        let w = InFlight { core: self.clone(), t };
        if !w.t.active.load(Ordering::SeqCst) {
            return Err(Refusal::Stale);
        }
        Ok(w)
    }

    /// Ends the write `w` and fails its transfer for a write outside its blocks (`why`).
    fn refuse(self: &Arc<Self>, w: InFlight, why: String) -> Refusal {
        let t = w.t.clone();
        drop(w);
        let why = format!("request {}: {why}", t.request_id);
        self.fail(&t, TransferError::BadCompletion { request_id: t.request_id.clone(), reason: why.clone() }, &why);
        Refusal::Invalid(why)
    }

    /// (layer, is_latent) of a write, if it lies inside one layer's blocks of `t`.
    fn classify(&self, t: &Transfer, offset: u64, len: u64) -> Result<(usize, bool), String> {
        let g = &self.geometry;
        let end = offset.checked_add(len).ok_or("write range overflows")?;
        if len == 0 || end > g.total_bytes() as u64 {
            return Err(format!("write {offset}+{len} outside the pool"));
        }
        let (base, stride, unit, latent) = if offset < g.indexer_region_offset() as u64 {
            (0u64, g.latent_layer_stride() as u64, g.latent_bytes_per_block() as u64, true)
        } else {
            (
                g.indexer_region_offset() as u64,
                g.indexer_layer_stride() as u64,
                g.indexer_bytes_per_block() as u64,
                false,
            )
        };
        let rel = offset - base;
        let layer = (rel / stride) as usize;
        let in_layer = rel % stride;
        if in_layer + len > stride || layer >= g.num_layers {
            return Err(format!("write {offset}+{len} crosses a layer boundary"));
        }
        let first = in_layer / unit;
        let last = (in_layer + len - 1) / unit;
        let mut prev: Option<u32> = None;
        for b in first..=last {
            let Some(&idx) = t.block_index.get(&(b as u32)) else {
                return Err(format!("write into block {b}, which the transfer does not own"));
            };
            if prev.is_some_and(|p| p + 1 != idx) {
                return Err(format!("write spans blocks out of the request's order at block {b}"));
            }
            prev = Some(idx);
        }
        if latent
            && (!in_layer.is_multiple_of(g.latent_bytes_per_token() as u64)
                || !len.is_multiple_of(g.latent_bytes_per_token() as u64))
        {
            return Err("latent write not aligned to entries".into());
        }
        Ok((layer, latent))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testkit;
    use crate::token::TransferToken;

    fn core() -> (Arc<ReceiverCore>, tokio::runtime::Runtime) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (cache, pool) = testkit::filled_cache(testkit::geometry(2, 16), 3);
        let timings = super::super::ReceiverTimings {
            abort_ack_timeout: Duration::from_secs(1),
            quarantine: Duration::from_secs(1),
            write_stall: Duration::from_secs(1),
        };
        let core = ReceiverCore::new(
            cache,
            pool,
            testkit::fingerprint(&testkit::geometry(2, 16)),
            timings,
            rt.handle().clone(),
        );
        (Arc::new(core), rt)
    }

    /// A gathered write lands only in the transfer's own blocks, in stream order, as whole entries or
    /// blocks; anything else fails the transfer, and a stranger's is refused untouched.
    #[test]
    fn stream_writes_map_to_the_transfers_blocks_and_nothing_else() {
        let (core, _rt) = core();
        let tokens = 64 * 2 + 10;
        let blocks = vec![5u32, 3, 9];
        let deadline = Instant::now() + Duration::from_secs(60);
        let t = core.register("r", TransferToken::generate().unwrap(), tokens, blocks, deadline, false).unwrap();
        let token = *t.session_token.as_bytes();
        let g = core.geometry;
        let (entry, block) = (g.latent_bytes_per_token() as u64, g.indexer_bytes_per_block() as u64);
        let lat = tokens as u64 * entry;
        // Not yet active: stale.
        assert_eq!(core.admit_stream(t.session, &token, 1, 0, lat).err(), Some(Refusal::Stale));
        t.active.store(true, Ordering::SeqCst);
        assert_eq!(core.admit_stream(t.session, &[7; TOKEN_BYTES], 1, 0, lat).err(), Some(Refusal::WrongToken));
        // The latent part of layer 1: blocks 5, 3, 9 of that layer, in the request's order.
        let p = core.admit_stream(t.session, &token, 1, 0, lat).unwrap();
        let at = |b: u64| g.latent_layer_stride() as u64 + b * 64 * entry;
        assert_eq!(p.pieces, vec![(at(5), 64 * entry), (at(3), 64 * entry), (at(9), 10 * entry)]);
        p.commit();
        assert_eq!(t.latent_written[1].load(Ordering::Relaxed), lat);
        // The indexer part from its second block: blocks 3 and 9.
        let p = core.admit_stream(t.session, &token, 1, lat + block, 2 * block).unwrap();
        let ix = |b: u64| g.indexer_region_offset() as u64 + g.indexer_layer_stride() as u64 + b * block;
        assert_eq!(p.pieces, vec![(ix(3), block), (ix(9), block)]);
        drop(p);
        assert_eq!(t.indexer_written[1].load(Ordering::Relaxed), 0, "an uncommitted write counts nothing");
        // Splitting an entry fails the transfer; later writes find it stale.
        assert!(matches!(core.admit_stream(t.session, &token, 0, entry / 2, entry), Err(Refusal::Invalid(_))));
        assert!(!t.active.load(Ordering::SeqCst));
        assert_eq!(core.admit_stream(t.session, &token, 0, 0, entry).err(), Some(Refusal::Stale));
    }

    /// One gathered write may hold latent and indexer bytes and run on into the next layers: it counts
    /// each layer's bytes where they belong.
    #[test]
    fn stream_writes_may_cross_kinds_and_layers() {
        let (core, _rt) = core();
        let deadline = Instant::now() + Duration::from_secs(60);
        let t = core.register("r", TransferToken::generate().unwrap(), 138, vec![4, 2, 7], deadline, false).unwrap();
        t.active.store(true, Ordering::SeqCst);
        let token = *t.session_token.as_bytes();
        let (lat, ix) = (138 * 656u64, 3 * 8448u64);
        // The last entry of layer 0, its indexer blocks and the first entry of layer 1.
        let p = core.admit_stream(t.session, &token, 0, lat - 656, 656 + ix + 656).unwrap();
        assert_eq!(p.layers, vec![(0, 656, ix), (1, 656, 0)]);
        let g = core.geometry;
        let stride = g.latent_layer_stride() as u64;
        let idx = g.indexer_region_offset() as u64;
        assert_eq!(
            p.pieces,
            vec![
                (7 * 64 * 656 + 9 * 656, 656),
                (idx + 4 * 8448, 8448),
                (idx + 2 * 8448, 8448),
                (idx + 7 * 8448, 8448),
                (stride + 4 * 64 * 656, 656)
            ]
        );
        p.commit();
        assert_eq!(t.latent_written[0].load(Ordering::Relaxed), 656);
        assert_eq!(t.indexer_written[0].load(Ordering::Relaxed), ix);
        assert_eq!(t.latent_written[1].load(Ordering::Relaxed), 656);
        // The rest of both layers in one write.
        let p = core.admit_stream(t.session, &token, 0, 0, lat - 656).unwrap();
        p.commit();
        let p = core.admit_stream(t.session, &token, 1, 656, lat - 656 + ix).unwrap();
        assert_eq!(p.layers, vec![(1, lat - 656, ix)]);
        p.commit();
        for layer in 0..2 {
            assert_eq!(t.latent_written[layer].load(Ordering::Relaxed), lat);
            assert_eq!(t.indexer_written[layer].load(Ordering::Relaxed), ix);
        }
    }

    #[test]
    fn stream_writes_outside_the_transfer_or_splitting_items_fail_it() {
        let (lat, bpl) = (138 * 656u64, 138 * 656 + 3 * 8448u64);
        for (layer, offset, len) in [
            (2u32, 0u64, 656u64),
            (0, 0, 0),
            (1, 0, bpl + 656),
            (0, bpl, 656),
            (0, lat, 8448 * 4),
            (0, 0, lat + 100),
            (0, 100, 656),
            (0, 0, u64::MAX),
        ] {
            let (core, _rt) = core();
            let deadline = Instant::now() + Duration::from_secs(60);
            let t =
                core.register("r", TransferToken::generate().unwrap(), 138, vec![1, 2, 3], deadline, false).unwrap();
            t.active.store(true, Ordering::SeqCst);
            let token = *t.session_token.as_bytes();
            let r = core.admit_stream(t.session, &token, layer, offset, len);
            assert!(matches!(r, Err(Refusal::Invalid(_))), "layer {layer} {offset}+{len}");
            assert!(!t.active.load(Ordering::SeqCst));
        }
    }
}
