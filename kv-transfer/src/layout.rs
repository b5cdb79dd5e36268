//! Cache layout on the wire and the put plan: which byte ranges of which layer go where.
//!
//! A request's blocks are merged into runs that are consecutive on both sides (source and destination
//! block ids both increase by one), so a fresh pool ships each layer as two puts (latent, indexer). The
//! latent run of the last block carries only the request's tokens (a partial block ships
//! `tokens % 64` entries); indexer blocks always ship whole (values and scales are split inside a block).

use kv_cache::hash::Sum64;
use kv_cache::{BLOCK_SIZE, BlockId, CacheGeometry, LayerIdx};
use proto::v1::{CacheLayout, MemoryRegion};

/// kv-transfer reads and writes host pools through host pointers (TCP and in-process copies, UCX host
/// registrations, checksums), and device pools through their `DeviceCopy`, staged through host memory
/// ([`crate::staging`]). A device pool without a copier cannot be reached at all: both sides refuse it,
/// with the reason.
pub fn check_reachable(cache: &kv_cache::KvCache) -> Result<(), crate::TransferError> {
    let kind = cache.memory_kind();
    if kind.host_accessible() || cache.stages_through_host() {
        Ok(())
    } else {
        Err(crate::TransferError::Transport(format!(
            "the cache pool is in {kind} memory without a DeviceCopy: kv-transfer moves host memory only, \
             or device memory staged through host memory by the backend's copier (KvArena::from_device)"
        )))
    }
}

/// Logs, once per sender or receiver, that its device pool has host staging buffers (used by TCP,
/// in-process and a UCX without CUDA; a CUDA-capable UCX moves CUDA memory itself, which its transport
/// logs at start).
pub(crate) fn log_staging(side: &str, cache: &kv_cache::KvCache) {
    if cache.stages_through_host() {
        tracing::info!(
            side,
            memory = %cache.memory_kind(),
            buffer_bytes = crate::staging::STAGE_BYTES,
            "kv-transfer: the cache pool is in device memory; transports that cannot move it stage it through \
             reused host buffers"
        );
    }
}

/// The wire description of `g`.
pub fn layout_of(g: &CacheGeometry) -> CacheLayout {
    CacheLayout {
        block_size: BLOCK_SIZE as u32,
        num_layers: g.num_layers as u32,
        latent_bytes_per_token: g.latent_bytes_per_token() as u32,
        indexer_bytes_per_block: g.indexer_bytes_per_block() as u32,
        num_blocks: g.num_blocks as u32,
        latent_offset: 0,
        latent_layer_stride: g.latent_layer_stride() as u64,
        indexer_offset: g.indexer_region_offset() as u64,
        indexer_layer_stride: g.indexer_layer_stride() as u64,
    }
}

/// Checks that a peer's layout can hold our entries and is internally consistent.
pub fn check_layout(local: &CacheGeometry, remote: &CacheLayout) -> Result<(), String> {
    let want = layout_of(local);
    if remote.block_size != want.block_size {
        return Err(format!("block size {} != {}", remote.block_size, want.block_size));
    }
    if remote.num_layers != want.num_layers {
        return Err(format!("{} layers, this side has {}", remote.num_layers, want.num_layers));
    }
    if remote.latent_bytes_per_token != want.latent_bytes_per_token {
        return Err(format!(
            "latent entry of {} bytes, this side has {}",
            remote.latent_bytes_per_token, want.latent_bytes_per_token
        ));
    }
    if remote.indexer_bytes_per_block != want.indexer_bytes_per_block {
        return Err(format!(
            "indexer block of {} bytes, this side has {}",
            remote.indexer_bytes_per_block, want.indexer_bytes_per_block
        ));
    }
    let latent_block = remote.latent_bytes_per_token as u64 * BLOCK_SIZE as u64;
    let nb = remote.num_blocks as u64;
    if remote.latent_layer_stride < nb * latent_block
        || remote.indexer_layer_stride < nb * remote.indexer_bytes_per_block as u64
    {
        return Err("layer strides smaller than a layer's blocks".into());
    }
    Ok(())
}

/// Consecutive blocks on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub src: BlockId,
    pub dst: BlockId,
    pub blocks: u32,
    /// Tokens of the request in this run (less than `blocks * 64` only in the last run).
    pub tokens: u32,
}

/// One contiguous copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Put {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// The request's runs plus both sides' layouts: everything needed to address any layer.
#[derive(Debug, Clone)]
pub struct PutPlan {
    pub runs: Vec<Run>,
    pub num_tokens: usize,
    pub num_blocks: usize,
    src: CacheLayout,
    dst: CacheLayout,
}

impl PutPlan {
    /// Merges `src[i] -> dst[i]` (first `blocks_for(num_tokens)` entries) into maximal runs.
    pub fn new(
        src: CacheLayout,
        dst: CacheLayout,
        src_blocks: &[BlockId],
        dst_blocks: &[BlockId],
        num_tokens: usize,
    ) -> Self {
        let n = CacheGeometry::blocks_for(num_tokens);
        debug_assert!(src_blocks.len() >= n && dst_blocks.len() >= n);
        let mut runs: Vec<Run> = Vec::new();
        for i in 0..n {
            let tokens = (num_tokens - i * BLOCK_SIZE).min(BLOCK_SIZE) as u32;
            match runs.last_mut() {
                Some(r) if r.src.0 + r.blocks == src_blocks[i].0 && r.dst.0 + r.blocks == dst_blocks[i].0 => {
                    r.blocks += 1;
                    r.tokens += tokens;
                }
                _ => runs.push(Run { src: src_blocks[i], dst: dst_blocks[i], blocks: 1, tokens }),
            }
        }
        PutPlan { runs, num_tokens, num_blocks: n, src, dst }
    }

    pub fn latent_bytes_per_layer(&self) -> u64 {
        self.num_tokens as u64 * self.dst.latent_bytes_per_token as u64
    }

    pub fn indexer_bytes_per_layer(&self) -> u64 {
        self.num_blocks as u64 * self.dst.indexer_bytes_per_block as u64
    }

    /// The size of one item a piece of a put must not split: a latent entry or an indexer block.
    pub fn unit_bytes(&self, latent: bool) -> u64 {
        if latent { self.dst.latent_bytes_per_token as u64 } else { self.dst.indexer_bytes_per_block as u64 }
    }

    pub fn bytes_per_layer(&self) -> u64 {
        self.latent_bytes_per_layer() + self.indexer_bytes_per_layer()
    }

    /// The layer's latent puts, then its indexer puts, in token order.
    pub fn layer_puts(&self, layer: LayerIdx) -> impl Iterator<Item = Put> + '_ {
        let l = layer.0 as u64;
        let lat = move |c: &CacheLayout, b: BlockId| {
            c.latent_offset
                + l * c.latent_layer_stride
                + b.0 as u64 * c.latent_bytes_per_token as u64 * BLOCK_SIZE as u64
        };
        let idx = move |c: &CacheLayout, b: BlockId| {
            c.indexer_offset + l * c.indexer_layer_stride + b.0 as u64 * c.indexer_bytes_per_block as u64
        };
        let latent = self.runs.iter().map(move |r| Put {
            src_offset: lat(&self.src, r.src),
            dst_offset: lat(&self.dst, r.dst),
            len: r.tokens as u64 * self.dst.latent_bytes_per_token as u64,
        });
        let indexer = self.runs.iter().map(move |r| Put {
            src_offset: idx(&self.src, r.src),
            dst_offset: idx(&self.dst, r.dst),
            len: r.blocks as u64 * self.dst.indexer_bytes_per_block as u64,
        });
        latent.chain(indexer)
    }

    /// The pieces of range `lo..hi` of the request's stream, as (pool offset, length) on the source side
    /// (`src`) or the destination side. A layer's stream is its puts' bytes back to back: the latent
    /// entries of its tokens in order, then its indexer blocks in order; the request's stream is its
    /// layers' streams back to back, layer 0 first (byte `o` of layer `l`'s stream is byte
    /// `l * bytes_per_layer() + o`). It is the same on both sides whatever the block ids (the checksums
    /// cover it too), so a range of it names the same bytes there.
    pub fn stream_pieces(&self, lo: u64, hi: u64, src: bool) -> Vec<(u64, u64)> {
        let bpl = self.bytes_per_layer();
        let mut out: Vec<(u64, u64)> = Vec::new();
        if bpl == 0 || lo >= hi {
            return out;
        }
        for layer in lo / bpl..hi.div_ceil(bpl) {
            let base_at = layer * bpl;
            let mut at = base_at;
            for p in self.layer_puts(LayerIdx(layer as u32)) {
                let (start, end) = (at.max(lo), (at + p.len).min(hi));
                if start < end {
                    let base = if src { p.src_offset } else { p.dst_offset };
                    match out.last_mut() {
                        // Consecutive in the pool too (a run split only on the other side): one piece.
                        Some((o, l)) if *o + *l == base + (start - at) => *l += end - start,
                        _ => out.push((base + (start - at), end - start)),
                    }
                }
                at += p.len;
                if at >= hi {
                    break;
                }
            }
        }
        out
    }

    /// Whether request-stream offset `at` falls between items: not inside a latent entry or an
    /// indexer block of its layer (a layer's end is a boundary).
    pub fn stream_boundary(&self, at: u64) -> bool {
        self.stream_floor(at) == at
    }

    /// The last item boundary at or before request-stream offset `at`.
    fn stream_floor(&self, at: u64) -> u64 {
        let (bpl, lat) = (self.bytes_per_layer(), self.latent_bytes_per_layer());
        if bpl == 0 {
            return at;
        }
        let (layer, off) = (at / bpl, at % bpl);
        let off =
            if off <= lat { off - off % self.unit_bytes(true) } else { off - (off - lat) % self.unit_bytes(false) };
        layer * bpl + off
    }

    /// The first item boundary after request-stream offset `at` (which is a boundary).
    fn stream_next(&self, at: u64) -> u64 {
        let (bpl, lat) = (self.bytes_per_layer(), self.latent_bytes_per_layer());
        let off = at % bpl.max(1);
        at + if off < lat { self.unit_bytes(true) } else { self.unit_bytes(false) }
    }

    /// Request-stream range `lo..hi` (item boundaries) cut into ranges of at most `max` bytes (at least
    /// one item each) that split no latent entry or indexer block: how gathered layers travel. A range
    /// may hold latent and indexer bytes, and end in a later layer than it starts.
    pub fn stream_chunks(&self, lo: u64, hi: u64, max: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = lo;
        while at < hi {
            let mut end = at.saturating_add(max).min(hi);
            if end < hi {
                end = self.stream_floor(end);
                if end <= at {
                    end = self.stream_next(at).min(hi);
                }
            }
            out.push((at, end));
            at = end;
        }
        out
    }

    /// The (layer, latent bytes, indexer bytes) that request-stream range `lo..hi` holds, layer by layer.
    pub fn stream_layers(&self, lo: u64, hi: u64) -> Vec<(usize, u64, u64)> {
        let (bpl, lat) = (self.bytes_per_layer(), self.latent_bytes_per_layer());
        if bpl == 0 || lo >= hi {
            return Vec::new();
        }
        (lo / bpl..hi.div_ceil(bpl))
            .map(|layer| {
                let (a, b) = (lo.max(layer * bpl) - layer * bpl, hi.min((layer + 1) * bpl) - layer * bpl);
                let latent = b.min(lat).saturating_sub(a.min(lat));
                (layer as usize, latent, b - a - latent)
            })
            .collect()
    }

    /// Puts per layer (a measure of how scattered the request's blocks are on either side).
    pub fn layer_put_count(&self) -> usize {
        2 * self.runs.len()
    }
}

/// Checks descriptor block ids and token count against a layout: every id inside the pool, no id twice,
/// exactly as many blocks as the tokens need.
pub fn check_blocks(layout: &CacheLayout, blocks: &[u32], num_tokens: u32) -> Result<(), (bool, String)> {
    if num_tokens == 0 {
        return Err((false, "num_tokens is 0".into()));
    }
    let need = (num_tokens as usize).div_ceil(layout.block_size.max(1) as usize);
    if blocks.len() != need {
        return Err((false, format!("{} tokens need {need} blocks, got {}", num_tokens, blocks.len())));
    }
    let mut seen = std::collections::HashSet::with_capacity(blocks.len());
    for &b in blocks {
        if b >= layout.num_blocks {
            return Err((true, format!("block {b} outside the pool of {} blocks", layout.num_blocks)));
        }
        if !seen.insert(b) {
            return Err((true, format!("block {b} appears twice")));
        }
    }
    Ok(())
}

/// The region holding `addr..addr+len`, if any. Regions come from the receiver's `Accept`: one whose end
/// does not fit in 64 bits holds nothing.
pub fn region_for(regions: &[MemoryRegion], addr: u64, len: u64) -> Option<usize> {
    let end = addr.checked_add(len)?;
    regions
        .iter()
        .position(|r| addr >= r.remote_addr && r.remote_addr.checked_add(r.length).is_some_and(|r_end| end <= r_end))
}

/// The [`kv_cache::hash`] digest of a layer's shipped bytes: `segments` in order (latent runs, then
/// indexer runs), read from `base + offset`.
///
/// # Safety
/// Every segment must be inside the memory at `base`, with no concurrent writer.
pub unsafe fn checksum_segments(base: *const u8, segments: impl Iterator<Item = (u64, u64)>) -> u64 {
    let mut h = Sum64::new();
    for (off, len) in segments {
        // SAFETY: forwarded contract.
        h.update(unsafe { std::slice::from_raw_parts(base.add(off as usize), len as usize) });
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_cache::{CacheFormat, EntryDims};

    fn geo(blocks: usize) -> CacheGeometry {
        CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 3, blocks)
    }

    #[test]
    fn the_request_stream_names_the_same_bytes_on_both_sides() {
        let g = geo(40);
        let l = layout_of(&g);
        let b = |v: &[u32]| v.iter().map(|&x| BlockId(x)).collect::<Vec<_>>();
        let (src, dst) = (b(&[3, 4, 5, 9, 10, 20, 21]), b(&[30, 31, 7, 8, 9, 2, 1]));
        let tokens = 64 * 6 + 5;
        let plan = PutPlan::new(l, l, &src, &dst, tokens);
        let (bpl, lat) = (plan.bytes_per_layer(), plan.latent_bytes_per_layer());
        let layers = g.num_layers as u64;
        // Every chunking of any span of whole layers covers it once and maps to the puts' own bytes, on
        // either side; chunks may cross from one layer into the next.
        for (l0, l1) in [(1u64, 2u64), (0, layers), (2, 3)] {
            let (lo, hi) = (l0 * bpl, l1 * bpl);
            for max in [1u64, 656 * 100, 8448 * 3, bpl + 7, 1 << 30] {
                let chunks = plan.stream_chunks(lo, hi, max);
                assert_eq!(chunks.first().map(|c| c.0), Some(lo));
                assert_eq!(chunks.last().map(|c| c.1), Some(hi));
                assert!(chunks.windows(2).all(|w| w[0].1 == w[1].0), "back to back");
                assert!(chunks.iter().all(|&(a, z)| z - a <= max.max(8448)), "at most max, or one item");
                for side in [true, false] {
                    let mut got = Vec::new();
                    for &(a, z) in &chunks {
                        let p = plan.stream_pieces(a, z, side);
                        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), z - a);
                        got.extend(p);
                    }
                    let mut want: Vec<(u64, u64)> = (l0..l1)
                        .flat_map(|layer| plan.layer_puts(LayerIdx(layer as u32)).collect::<Vec<_>>())
                        .map(|p| (if side { p.src_offset } else { p.dst_offset }, p.len))
                        .collect();
                    // Pieces may merge or split differently; compare byte by byte.
                    let flat = |v: &mut Vec<(u64, u64)>| v.iter().flat_map(|&(o, l)| o..o + l).collect::<Vec<_>>();
                    assert_eq!(flat(&mut got), flat(&mut want), "layers {lo}..{hi}, max {max}, src side {side}");
                }
                // Chunks never split an entry or a block.
                for &(a, z) in &chunks {
                    for at in [a, z] {
                        let off = at % bpl;
                        let whole = if off <= lat { off.is_multiple_of(656) } else { (off - lat).is_multiple_of(8448) };
                        assert!(whole && plan.stream_boundary(at), "offset {at} (layer offset {off})");
                    }
                }
                // The bytes each chunk holds per layer add up to the layers' own.
                let mut per_layer = vec![(0u64, 0u64); layers as usize];
                for &(a, z) in &chunks {
                    for (layer, latent, indexer) in plan.stream_layers(a, z) {
                        per_layer[layer].0 += latent;
                        per_layer[layer].1 += indexer;
                    }
                }
                for (layer, &(latent, indexer)) in per_layer.iter().enumerate() {
                    let inside = (l0..l1).contains(&(layer as u64));
                    let want = if inside { (lat, plan.indexer_bytes_per_layer()) } else { (0, 0) };
                    assert_eq!((latent, indexer), want, "layer {layer}, max {max}");
                }
            }
        }
        assert!(!plan.stream_boundary(bpl + 655) && !plan.stream_boundary(lat + 8447));
        assert!(plan.stream_boundary(0) && plan.stream_boundary(lat) && plan.stream_boundary(2 * bpl));
    }

    #[test]
    fn a_region_whose_end_overflows_holds_nothing() {
        // Found by tests/fuzz.rs: a descriptor region ending past 2^64 overflowed the bounds check.
        let r = |remote_addr, length| MemoryRegion { remote_addr, length, rkey: Vec::new() };
        assert_eq!(region_for(&[r(u64::MAX - 10, 100)], u64::MAX - 5, 1), None);
        assert_eq!(region_for(&[r(1 << 40, u64::MAX)], 1 << 41, 8), None);
        assert_eq!(region_for(&[r(0, 16), r(100, 50)], 120, 30), Some(1));
        assert_eq!(region_for(&[r(100, 50)], 120, u64::MAX), None);
    }

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    #[test]
    fn runs_merge_only_where_both_sides_are_consecutive() {
        let (s, d) = (layout_of(&geo(20)), layout_of(&geo(30)));
        let p = PutPlan::new(s, d, &ids(&[0, 1, 2, 7, 8]), &ids(&[10, 11, 5, 6, 7]), 5 * 64 - 10);
        let got: Vec<(u32, u32, u32, u32)> = p.runs.iter().map(|r| (r.src.0, r.dst.0, r.blocks, r.tokens)).collect();
        assert_eq!(got, vec![(0, 10, 2, 128), (2, 5, 1, 64), (7, 6, 2, 118)]);
        assert_eq!(p.latent_bytes_per_layer(), (5 * 64 - 10) * 656);
        assert_eq!(p.indexer_bytes_per_layer(), 5 * 8448);
    }

    #[test]
    fn layer_puts_address_both_geometries_and_cover_exactly_the_request() {
        let (gs, gd) = (geo(20), geo(30));
        let p = PutPlan::new(layout_of(&gs), layout_of(&gd), &ids(&[3, 4]), &ids(&[8, 9]), 100);
        let puts: Vec<Put> = p.layer_puts(LayerIdx(2)).collect();
        assert_eq!(puts.len(), 2, "one contiguous run: one latent put and one indexer put");
        assert_eq!(puts[0].src_offset as usize, gs.latent_block_offset(LayerIdx(2), BlockId(3)));
        assert_eq!(puts[0].dst_offset as usize, gd.latent_block_offset(LayerIdx(2), BlockId(8)));
        assert_eq!(puts[0].len, 100 * 656, "a partial last block ships only its tokens");
        assert_eq!(puts[1].src_offset as usize, gs.indexer_block_offset(LayerIdx(2), BlockId(3)));
        assert_eq!(puts[1].dst_offset as usize, gd.indexer_block_offset(LayerIdx(2), BlockId(8)));
        assert_eq!(puts[1].len, 2 * 8448);
        let total: u64 = puts.iter().map(|p| p.len).sum();
        assert_eq!(total, p.bytes_per_layer());
    }

    #[test]
    fn a_prompt_shorter_than_a_block_ships_one_partial_block() {
        let g = geo(4);
        let p = PutPlan::new(layout_of(&g), layout_of(&g), &ids(&[1]), &ids(&[2]), 5);
        let puts: Vec<Put> = p.layer_puts(LayerIdx(0)).collect();
        assert_eq!(puts.iter().map(|p| p.len).collect::<Vec<_>>(), vec![5 * 656, 8448]);
    }

    #[test]
    fn block_checks_catch_range_duplicates_and_counts() {
        let l = layout_of(&geo(10));
        assert!(check_blocks(&l, &[0, 1], 100).is_ok());
        assert!(check_blocks(&l, &[0, 10], 100).unwrap_err().0, "out of range");
        assert!(check_blocks(&l, &[3, 3], 100).unwrap_err().0, "duplicate");
        assert!(!check_blocks(&l, &[0], 100).unwrap_err().0, "too few blocks");
        assert!(!check_blocks(&l, &[0, 1, 2], 100).unwrap_err().0, "too many blocks");
        assert!(check_blocks(&l, &[], 0).is_err());
    }

    #[test]
    fn layouts_must_agree_on_entry_sizes_and_layers() {
        let g = geo(10);
        check_layout(&g, &layout_of(&geo(99))).unwrap();
        let f32 = CacheGeometry::new(CacheFormat::F32, EntryDims::DEEPSEEK_V32, 3, 10);
        assert!(check_layout(&g, &layout_of(&f32)).unwrap_err().contains("latent entry"));
        let l4 = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 4, 10);
        assert!(check_layout(&g, &layout_of(&l4)).unwrap_err().contains("layers"));
        let mut bad = layout_of(&g);
        bad.latent_layer_stride = 1;
        assert!(check_layout(&g, &bad).is_err());
    }
}
