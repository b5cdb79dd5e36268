//! Reading and writing one request's cache entries in either format.
//!
//! Every function here touches only blocks of the request's own table (`blocks`), which the block
//! allocator gave to that request alone; within a call, a layer is written by this backend only. That is
//! the exclusivity `HostCache`'s unsafe accessors ask for.

use crate::cache::{self, BLOCK_SIZE, BlockId, CacheFormat, HostCache, LayerIdx, format};
use crate::fp8;

#[inline]
fn slot(blocks: &[BlockId], pos: usize) -> (BlockId, usize) {
    (blocks[pos / BLOCK_SIZE], pos % BLOCK_SIZE)
}

/// Writes position `pos`'s latent `c` and rotated `k_pe`.
pub fn write_latent(cache: &HostCache<'_>, layer: LayerIdx, blocks: &[BlockId], pos: usize, c: &[f32], k_pe: &[f32]) {
    let (b, s) = slot(blocks, pos);
    // SAFETY: see the module docs: the request owns block `b` and this layer is ours to write.
    let out = unsafe { cache.latent_entry_mut(layer, b, s) };
    match cache.geometry().format {
        CacheFormat::Fp8 => format::encode_latent_fp8(c, k_pe, out),
        CacheFormat::F32 => format::encode_latent_f32(c, k_pe, out),
    }
}

/// Writes position `pos`'s indexer key.
pub fn write_index_key(cache: &HostCache<'_>, layer: LayerIdx, blocks: &[BlockId], pos: usize, key: &[f32]) {
    let (b, s) = slot(blocks, pos);
    // SAFETY: see the module docs.
    let block = unsafe { cache.indexer_block_mut(layer, b) };
    match cache.geometry().format {
        CacheFormat::Fp8 => format::encode_index_key_fp8(key, block, s),
        CacheFormat::F32 => format::encode_index_key_f32(key, block, s),
    }
}

/// Dequantized latents and rope keys of positions `positions` (in that order): `c [n, rank]`, `k_pe [n, rope]`.
pub fn read_latents(
    cache: &HostCache<'_>,
    layer: LayerIdx,
    blocks: &[BlockId],
    positions: impl ExactSizeIterator<Item = usize>,
) -> (Vec<f32>, Vec<f32>) {
    let dims = cache.geometry().dims;
    let (rank, rope) = (dims.kv_lora_rank, dims.rope_dim);
    let n = positions.len();
    let mut c = vec![0f32; n * rank];
    let mut kpe = vec![0f32; n * rope];
    for (i, pos) in positions.enumerate() {
        let (b, s) = slot(blocks, pos);
        // SAFETY: see the module docs; entries of positions already written are not written concurrently.
        let bytes = unsafe { cache.latent_entry(layer, b, s) };
        let (ci, ki) = (&mut c[i * rank..(i + 1) * rank], &mut kpe[i * rope..(i + 1) * rope]);
        match cache.geometry().format {
            CacheFormat::Fp8 => format::decode_latent_fp8(bytes, ci, ki),
            CacheFormat::F32 => format::decode_latent_f32(bytes, ci, ki),
        }
    }
    (c, kpe)
}

/// Indexer keys of positions `0..ctx`: values `[ctx, dim]` as multiplied by the scorer (decoded e4m3 codes
/// for FP8, raw f32 otherwise) and per-token scales (1 for f32).
pub fn read_index_keys(cache: &HostCache<'_>, layer: LayerIdx, blocks: &[BlockId], ctx: usize) -> (Vec<f32>, Vec<f32>) {
    let dim = cache.geometry().dims.index_dim;
    let mut vals = vec![0f32; ctx * dim];
    let mut scales = vec![1f32; ctx];
    for (bi, &b) in blocks.iter().enumerate().take(ctx.div_ceil(BLOCK_SIZE)) {
        // SAFETY: see the module docs.
        let block = unsafe { cache.indexer_block(layer, b) };
        for s in 0..BLOCK_SIZE.min(ctx - bi * BLOCK_SIZE) {
            let pos = bi * BLOCK_SIZE + s;
            let out = &mut vals[pos * dim..(pos + 1) * dim];
            match cache.geometry().format {
                CacheFormat::Fp8 => {
                    let (codes, sc) = cache::format::index_key_fp8(block, dim, s);
                    for (o, &q) in out.iter_mut().zip(codes) {
                        *o = fp8::e4m3_to_f32(q);
                    }
                    scales[pos] = sc;
                }
                CacheFormat::F32 => format::index_key_f32(block, dim, s, out),
            }
        }
    }
    (vals, scales)
}
