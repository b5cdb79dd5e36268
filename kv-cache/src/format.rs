//! Byte layouts of one token's cache entries (docs/model.md §4) and the geometry of a whole pool.
//!
//! FP8 MLA latent entry, 656 bytes per token per layer (FlashMLA's sparse FP8 format):
//!
//! | bytes    | content                                                        |
//! |----------|----------------------------------------------------------------|
//! | 0..512   | 512 x e4m3: the normed latent `c`, 4 tiles of 128               |
//! | 512..528 | 4 x fp32 tile scales (ue8m0 powers of two)                      |
//! | 528..656 | 64 x bf16 `k_pe`, RoPE applied, not quantized                   |
//!
//! FP8 indexer key block, 8448 bytes per 64 tokens per layer: `[64 x 128 e4m3][64 x fp32 scale]`.
//!
//! The full-precision path stores f32: latent `[c (512) | k_pe (64)]` (2304 bytes), indexer key block
//! `[64 x 128 f32]` (32768 bytes).

use serde::{Deserialize, Serialize};

use crate::fp8;

/// Tokens per cache block.
pub const BLOCK_SIZE: usize = 64;
/// Latent values per FP8 quantization tile.
pub const LATENT_TILE: usize = 128;

/// How cache entries are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheFormat {
    /// FP8 latent + bf16 rope (656 B/token) and FP8 indexer keys (132 B/token).
    Fp8,
    /// f32 everything, for comparison with reference implementations.
    F32,
}

impl CacheFormat {
    #[inline]
    pub fn name(self) -> &'static str {
        match self {
            CacheFormat::Fp8 => "fp8",
            CacheFormat::F32 => "full",
        }
    }
}

/// A cache block's id in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

impl BlockId {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A cached layer: decoder layers first, then MTP layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LayerIdx(pub u32);

impl LayerIdx {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Dimensions of the cached vectors (from the model config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryDims {
    /// Latent width (kv_lora_rank, 512).
    pub kv_lora_rank: usize,
    /// RoPE key width (qk_rope_head_dim, 64).
    pub rope_dim: usize,
    /// Indexer key width (index_head_dim, 128).
    pub index_dim: usize,
}

impl EntryDims {
    /// DeepSeek-V3.2's dimensions: the 656-byte and 8448-byte formats.
    pub const DEEPSEEK_V32: EntryDims = EntryDims { kv_lora_rank: 512, rope_dim: 64, index_dim: 128 };

    #[inline]
    pub fn latent_bytes(&self, format: CacheFormat) -> usize {
        match format {
            CacheFormat::Fp8 => self.kv_lora_rank + 4 * (self.kv_lora_rank / LATENT_TILE) + 2 * self.rope_dim,
            CacheFormat::F32 => 4 * (self.kv_lora_rank + self.rope_dim),
        }
    }

    #[inline]
    pub fn indexer_bytes_per_token(&self, format: CacheFormat) -> usize {
        match format {
            CacheFormat::Fp8 => self.index_dim + 4,
            CacheFormat::F32 => 4 * self.index_dim,
        }
    }

    #[inline]
    pub fn indexer_block_bytes(&self, format: CacheFormat) -> usize {
        BLOCK_SIZE * self.indexer_bytes_per_token(format)
    }
}

/// Where everything lives in a pool arena: all layers' latent blocks, then all layers' indexer blocks.
/// Layer l's blocks are contiguous, so a run of consecutive block ids in one layer is one contiguous range
/// (one RDMA put).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheGeometry {
    pub format: CacheFormat,
    pub dims: EntryDims,
    pub num_layers: usize,
    pub num_blocks: usize,
}

impl CacheGeometry {
    #[inline]
    pub fn new(format: CacheFormat, dims: EntryDims, num_layers: usize, num_blocks: usize) -> Self {
        CacheGeometry { format, dims, num_layers, num_blocks }
    }

    #[inline]
    pub fn block_size(&self) -> usize {
        BLOCK_SIZE
    }

    #[inline]
    pub fn latent_bytes_per_token(&self) -> usize {
        self.dims.latent_bytes(self.format)
    }

    #[inline]
    pub fn latent_bytes_per_block(&self) -> usize {
        BLOCK_SIZE * self.latent_bytes_per_token()
    }

    #[inline]
    pub fn indexer_bytes_per_block(&self) -> usize {
        self.dims.indexer_block_bytes(self.format)
    }

    /// Cache bytes one token costs across all layers.
    #[inline]
    pub fn bytes_per_token(&self) -> usize {
        self.num_layers * (self.latent_bytes_per_token() + self.dims.indexer_bytes_per_token(self.format))
    }

    #[inline]
    pub fn latent_layer_stride(&self) -> usize {
        self.num_blocks * self.latent_bytes_per_block()
    }

    /// Offset of the indexer region (after every layer's latent blocks).
    #[inline]
    pub fn indexer_region_offset(&self) -> usize {
        self.num_layers * self.latent_layer_stride()
    }

    #[inline]
    pub fn indexer_layer_stride(&self) -> usize {
        self.num_blocks * self.indexer_bytes_per_block()
    }

    #[inline]
    pub fn total_bytes(&self) -> usize {
        self.indexer_region_offset() + self.num_layers * self.indexer_layer_stride()
    }

    /// Byte offset of block `block`'s latent entries in layer `layer`.
    #[inline]
    pub fn latent_block_offset(&self, layer: LayerIdx, block: BlockId) -> usize {
        debug_assert!(layer.index() < self.num_layers && block.index() < self.num_blocks);
        layer.index() * self.latent_layer_stride() + block.index() * self.latent_bytes_per_block()
    }

    /// Byte offset of block `block`'s indexer keys in layer `layer`.
    #[inline]
    pub fn indexer_block_offset(&self, layer: LayerIdx, block: BlockId) -> usize {
        debug_assert!(layer.index() < self.num_layers && block.index() < self.num_blocks);
        self.indexer_region_offset()
            + layer.index() * self.indexer_layer_stride()
            + block.index() * self.indexer_bytes_per_block()
    }

    /// Blocks needed to hold `tokens` tokens.
    #[inline]
    pub fn blocks_for(tokens: usize) -> usize {
        tokens.div_ceil(BLOCK_SIZE)
    }
}

/// Encodes one token's latent entry in the FP8 format. `out` is exactly `latent_bytes(Fp8)` long.
#[inline]
pub fn encode_latent_fp8(c: &[f32], k_pe: &[f32], out: &mut [u8]) {
    let rank = c.len();
    let tiles = rank / LATENT_TILE;
    debug_assert_eq!(out.len(), rank + 4 * tiles + 2 * k_pe.len());
    let (vals, rest) = out.split_at_mut(rank);
    let (scales, rope) = rest.split_at_mut(4 * tiles);
    for t in 0..tiles {
        let r = t * LATENT_TILE..(t + 1) * LATENT_TILE;
        let s = fp8::quantize_group(&c[r.clone()], &mut vals[r], true);
        scales[4 * t..4 * t + 4].copy_from_slice(&s.to_le_bytes());
    }
    for (i, &v) in k_pe.iter().enumerate() {
        rope[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
    }
}

/// Decodes an FP8 latent entry into `c` (dequantized) and `k_pe`.
#[inline]
pub fn decode_latent_fp8(bytes: &[u8], c: &mut [f32], k_pe: &mut [f32]) {
    let rank = c.len();
    let tiles = rank / LATENT_TILE;
    let (vals, rest) = bytes.split_at(rank);
    let (scales, rope) = rest.split_at(4 * tiles);
    for t in 0..tiles {
        let s = f32::from_le_bytes(scales[4 * t..4 * t + 4].try_into().expect("4-byte scale"));
        for i in t * LATENT_TILE..(t + 1) * LATENT_TILE {
            c[i] = fp8::e4m3_to_f32(vals[i]) * s;
        }
    }
    for (i, v) in k_pe.iter_mut().enumerate() {
        *v = half::bf16::from_le_bytes([rope[2 * i], rope[2 * i + 1]]).to_f32();
    }
}

/// Encodes one token's latent entry in the f32 format.
#[inline]
pub fn encode_latent_f32(c: &[f32], k_pe: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), 4 * (c.len() + k_pe.len()));
    for (o, v) in out.chunks_exact_mut(4).zip(c.iter().chain(k_pe)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

#[inline]
pub fn decode_latent_f32(bytes: &[u8], c: &mut [f32], k_pe: &mut [f32]) {
    for (v, b) in c.iter_mut().chain(k_pe.iter_mut()).zip(bytes.chunks_exact(4)) {
        *v = f32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
}

/// Writes token `slot`'s indexer key into an FP8 indexer block (values at `slot * dim`, scale after all values).
#[inline]
pub fn encode_index_key_fp8(key: &[f32], block: &mut [u8], slot: usize) {
    let dim = key.len();
    debug_assert_eq!(block.len(), BLOCK_SIZE * (dim + 4));
    debug_assert_eq!(dim % 128, 0);
    // One scale per token: index_head_dim is one 128-wide group in DeepSeek-V3.2. Wider keys would need
    // more scales per token; the config check keeps dim a multiple of 128 and the format has one slot.
    let s = fp8::quantize_group(key, &mut block[slot * dim..(slot + 1) * dim], true);
    let at = BLOCK_SIZE * dim + 4 * slot;
    block[at..at + 4].copy_from_slice(&s.to_le_bytes());
}

/// Reads token `slot`'s FP8 indexer key: e4m3 codes and scale.
#[inline]
pub fn index_key_fp8(block: &[u8], dim: usize, slot: usize) -> (&[u8], f32) {
    let at = BLOCK_SIZE * dim + 4 * slot;
    let s = f32::from_le_bytes(block[at..at + 4].try_into().expect("4-byte scale"));
    (&block[slot * dim..(slot + 1) * dim], s)
}

#[inline]
pub fn encode_index_key_f32(key: &[f32], block: &mut [u8], slot: usize) {
    let dim = key.len();
    for (o, v) in block[slot * dim * 4..(slot + 1) * dim * 4].chunks_exact_mut(4).zip(key) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

#[inline]
pub fn index_key_f32(block: &[u8], dim: usize, slot: usize, out: &mut [f32]) {
    for (v, b) in out.iter_mut().zip(block[slot * dim * 4..(slot + 1) * dim * 4].chunks_exact(4)) {
        *v = f32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
    }

    fn fresh_seed() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(7)
    }

    #[test]
    fn deepseek_formats_have_the_spec_sizes() {
        let d = EntryDims::DEEPSEEK_V32;
        assert_eq!(d.latent_bytes(CacheFormat::Fp8), 656);
        assert_eq!(d.indexer_block_bytes(CacheFormat::Fp8), 8448);
        assert_eq!(d.latent_bytes(CacheFormat::F32), 2304);
        let g = CacheGeometry::new(CacheFormat::Fp8, d, 61, 10);
        assert_eq!(g.bytes_per_token(), 61 * 788);
    }

    #[test]
    fn latent_entry_puts_scales_at_512_and_rope_at_528() {
        let seed = fresh_seed();
        let mut c = rand_vec(512, seed, 3.0);
        // Tile 2 is much larger than the others, so its scale must differ.
        for v in &mut c[256..384] {
            *v *= 100.0;
        }
        let k_pe = rand_vec(64, seed + 1, 2.0);
        let mut buf = vec![0u8; 656];
        encode_latent_fp8(&c, &k_pe, &mut buf);
        let scale = |t: usize| f32::from_le_bytes(buf[512 + 4 * t..516 + 4 * t].try_into().unwrap());
        for t in 0..4 {
            let amax = c[t * 128..(t + 1) * 128].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scale(t), fp8::group_scale(amax, true), "tile {t} scale");
        }
        assert!(scale(2) > scale(0) * 32.0);
        for i in 0..64 {
            let b = half::bf16::from_le_bytes([buf[528 + 2 * i], buf[529 + 2 * i]]);
            assert_eq!(b, half::bf16::from_f32(k_pe[i]), "rope {i} (seed {seed})");
        }
        // Value byte i is e4m3(c[i] / scale(tile)).
        for i in [0usize, 127, 128, 300, 511] {
            assert_eq!(buf[i], fp8::f32_to_e4m3(c[i] / scale(i / 128)), "value byte {i}");
        }
    }

    #[test]
    fn latent_round_trip_error_is_within_e4m3_precision() {
        let seed = fresh_seed();
        let c = rand_vec(512, seed, 5.0);
        let k_pe = rand_vec(64, seed ^ 9, 5.0);
        let mut buf = vec![0u8; 656];
        encode_latent_fp8(&c, &k_pe, &mut buf);
        let (mut c2, mut r2) = (vec![0f32; 512], vec![0f32; 64]);
        decode_latent_fp8(&buf, &mut c2, &mut r2);
        for t in 0..4 {
            let s = f32::from_le_bytes(buf[512 + 4 * t..516 + 4 * t].try_into().unwrap());
            for i in t * 128..(t + 1) * 128 {
                // e4m3 keeps 3 mantissa bits: relative error <= 2^-4, absolute <= half a subnormal step.
                let tol = c[i].abs() / 16.0 + s / 1024.0;
                assert!((c[i] - c2[i]).abs() <= tol, "c[{i}] {} vs {} (seed {seed})", c[i], c2[i]);
            }
        }
        for i in 0..64 {
            assert!((k_pe[i] - r2[i]).abs() <= k_pe[i].abs() / 256.0, "k_pe[{i}]");
        }
        // Re-encoding the decoded entry is the identity (scales are powers of two).
        let mut buf2 = vec![0u8; 656];
        encode_latent_fp8(&c2, &r2, &mut buf2);
        assert_eq!(buf, buf2);
    }

    #[test]
    fn indexer_block_keeps_values_then_scales() {
        let seed = fresh_seed();
        let mut block = vec![0u8; 8448];
        let keys: Vec<Vec<f32>> = (0..64).map(|s| rand_vec(128, seed + s, 1.0 + s as f32)).collect();
        for (slot, k) in keys.iter().enumerate() {
            encode_index_key_fp8(k, &mut block, slot);
        }
        for (slot, k) in keys.iter().enumerate() {
            let (codes, s) = index_key_fp8(&block, 128, slot);
            assert_eq!(codes.as_ptr() as usize - block.as_ptr() as usize, slot * 128);
            let scale_at = 64 * 128 + 4 * slot;
            assert_eq!(s.to_le_bytes(), block[scale_at..scale_at + 4]);
            for i in 0..128 {
                let v = fp8::e4m3_to_f32(codes[i]) * s;
                assert!((v - k[i]).abs() <= k[i].abs() / 16.0 + s / 1024.0);
            }
        }
    }

    #[test]
    fn f32_formats_round_trip_exactly() {
        let c = rand_vec(512, 3, 1.0);
        let r = rand_vec(64, 4, 1.0);
        let mut buf = vec![0u8; 2304];
        encode_latent_f32(&c, &r, &mut buf);
        let (mut c2, mut r2) = (vec![0f32; 512], vec![0f32; 64]);
        decode_latent_f32(&buf, &mut c2, &mut r2);
        assert_eq!((c, r), (c2, r2));
        let k = rand_vec(128, 5, 1.0);
        let mut block = vec![0u8; 64 * 512];
        encode_index_key_f32(&k, &mut block, 17);
        let mut k2 = vec![0f32; 128];
        index_key_f32(&block, 128, 17, &mut k2);
        assert_eq!(k, k2);
    }

    #[test]
    fn geometry_keeps_a_layers_blocks_contiguous() {
        let g = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 3, 8);
        let l1 = LayerIdx(1);
        assert_eq!(g.latent_block_offset(l1, BlockId(3)) + 656 * 64, g.latent_block_offset(l1, BlockId(4)));
        assert_eq!(g.indexer_block_offset(LayerIdx(0), BlockId(0)), 3 * 8 * 656 * 64);
        assert_eq!(g.indexer_block_offset(LayerIdx(2), BlockId(7)) + 8448, g.total_bytes());
    }
}
