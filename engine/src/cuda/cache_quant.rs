//! Quantize-on-write of the FP8 caches on the GPU (`engine/kernels/cache_quant.cu`): the 656-byte latent
//! entry and the 8448-byte indexer block, bit-identical to [`crate::cache::format`]'s encoders.

use cudarc::driver::{CudaSlice, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{CudaError, Gpu};
use crate::cache::{BLOCK_SIZE, CacheFormat, EntryDims};

/// Warps per CTA of the indexer-key kernel (one token per warp).
const INDEX_WARPS_PER_CTA: u32 = 4;

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), CudaError> {
    if cond { Ok(()) } else { Err(CudaError::Shape(what())) }
}

/// Writes `n` tokens' latents (`c [n, rank]`, rotated `k_pe [n, rope]`) into one layer's latent region
/// (`latent`, `num_blocks` blocks of 64 entries) at `slots[t] = block * 64 + offset` (-1 skips a token).
#[allow(clippy::too_many_arguments)]
pub fn quantize_latent_fp8(
    gpu: &Gpu,
    dims: EntryDims,
    c: &CudaSlice<f32>,
    k_pe: &CudaSlice<f32>,
    slots: &CudaSlice<i64>,
    n: usize,
    latent: &mut CudaViewMut<'_, u8>,
    num_blocks: usize,
) -> Result<(), CudaError> {
    let (rank, rope) = (dims.kv_lora_rank, dims.rope_dim);
    check(rank % 128 == 0 && (128..=32 * 128).contains(&rank), || {
        format!("kv_lora_rank {rank}: a multiple of 128 up to 4096")
    })?;
    check(c.len() >= n * rank, || format!("c holds {} values, {n} x {rank} needed", c.len()))?;
    check(k_pe.len() >= n * rope, || format!("k_pe holds {} values, {n} x {rope} needed", k_pe.len()))?;
    check(slots.len() >= n, || format!("{} slots for {n} tokens", slots.len()))?;
    let need = num_blocks * BLOCK_SIZE * dims.latent_bytes(CacheFormat::Fp8);
    check(latent.len() >= need, || {
        format!("latent region of {} bytes, {need} needed for {num_blocks} blocks", latent.len())
    })?;
    check(n <= i32::MAX as usize, || format!("{n} tokens in one launch"))?;
    if n == 0 {
        return Ok(());
    }
    let (n_i, rank_i, rope_i, cap) = (n as i32, rank as i32, rope as i32, (num_blocks * BLOCK_SIZE) as i64);
    let f = gpu.function("tandem_quantize_latent_fp8")?;
    let cfg =
        LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (32 * (rank / 128) as u32, 1, 1), shared_mem_bytes: 0 };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(c).arg(k_pe).arg(slots).arg(latent).arg(&n_i).arg(&rank_i).arg(&rope_i).arg(&cap);
    // SAFETY: argument types and order match the kernel; sizes were checked above, and the kernel skips
    // slots outside the region's capacity.
    gpu.profiler().time(gpu.stream(), "tandem_quantize_latent_fp8", || unsafe { b.launch(cfg) })
}

/// Writes `n` tokens' indexer keys (`keys [n, 128]`) into one layer's indexer region (`num_blocks`
/// blocks of 8448 bytes) at `slots[t]`.
pub fn quantize_index_keys_fp8(
    gpu: &Gpu,
    dims: EntryDims,
    keys: &CudaSlice<f32>,
    slots: &CudaSlice<i64>,
    n: usize,
    index_blocks: &mut CudaViewMut<'_, u8>,
    num_blocks: usize,
) -> Result<(), CudaError> {
    check(dims.index_dim == 128, || {
        format!("index_head_dim {}: the FP8 indexer block holds 128-wide keys", dims.index_dim)
    })?;
    check(keys.len() >= n * 128, || format!("keys hold {} values, {n} x 128 needed", keys.len()))?;
    check(slots.len() >= n, || format!("{} slots for {n} tokens", slots.len()))?;
    let need = num_blocks * dims.indexer_block_bytes(CacheFormat::Fp8);
    check(index_blocks.len() >= need, || format!("indexer region of {} bytes, {need} needed", index_blocks.len()))?;
    check(n <= i32::MAX as usize, || format!("{n} tokens in one launch"))?;
    if n == 0 {
        return Ok(());
    }
    let (n_i, cap) = (n as i32, (num_blocks * BLOCK_SIZE) as i64);
    let f = gpu.function("tandem_quantize_index_keys_fp8")?;
    let ctas = (n as u32).div_ceil(INDEX_WARPS_PER_CTA);
    let cfg = LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (32 * INDEX_WARPS_PER_CTA, 1, 1), shared_mem_bytes: 0 };
    let mut b = gpu.stream().launch_builder(f);
    b.arg(keys).arg(slots).arg(index_blocks).arg(&n_i).arg(&cap);
    // SAFETY: as for the latent kernel.
    gpu.profiler().time(gpu.stream(), "tandem_quantize_index_keys_fp8", || unsafe { b.launch(cfg) })
}

#[cfg(test)]
mod tests {
    use rand::RngExt;
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cache::{BlockId, CacheGeometry, LayerIdx, format};

    const POISON: u8 = 0xa5;

    /// Values over many magnitudes, with the cases that stress rounding and scales: exact zeros (the amax
    /// floor), negative zeros, values that saturate, e4m3 subnormals and ties.
    fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match rng.random_range(0..20) {
                0 => 0.0,
                1 => -0.0,
                2 => (rng.random::<f32>() - 0.5) * 1e-6,
                3 => f32::from_bits(rng.random::<u32>() & 0x807f_ffff | 0x3c00_0000),
                _ => {
                    let mag = 2f32.powi(rng.random_range(-12..12));
                    (rng.random::<f32>() * 2.0 - 1.0) * mag * if i % 97 == 0 { 1e4 } else { 1.0 }
                }
            })
            .collect()
    }

    /// Random distinct slots in a `num_blocks`-block region, with some tokens skipped (-1).
    fn slots(rng: &mut ChaCha8Rng, n: usize, num_blocks: usize) -> Vec<i64> {
        let mut all: Vec<i64> = (0..(num_blocks * BLOCK_SIZE) as i64).collect();
        all.shuffle(rng);
        all.truncate(n);
        for s in all.iter_mut() {
            if rng.random_range(0..10) == 0 {
                *s = -1;
            }
        }
        all
    }

    #[test]
    fn quantize_on_write_is_bit_identical_to_the_cpu_encoders() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let dims = EntryDims::DEEPSEEK_V32;
        let (num_layers, num_blocks) = (3, 9);
        let geo = CacheGeometry::new(CacheFormat::Fp8, dims, num_layers, num_blocks);
        let layer = LayerIdx(1);
        for n in [1usize, 63, 64, 65, 300, 9 * 64] {
            let c = values(&mut rng, n * dims.kv_lora_rank);
            let k_pe = values(&mut rng, n * dims.rope_dim);
            let keys = values(&mut rng, n * dims.index_dim);
            let slot_list = slots(&mut rng, n, num_blocks);

            // CPU: the encoders, at the same places of a poisoned arena.
            let mut want = vec![POISON; geo.total_bytes()];
            let latent_bytes = dims.latent_bytes(CacheFormat::Fp8);
            for (t, &s) in slot_list.iter().enumerate() {
                if s < 0 {
                    continue;
                }
                let (b, off) = (BlockId((s / 64) as u32), s as usize % 64);
                let at = geo.latent_block_offset(layer, b) + off * latent_bytes;
                format::encode_latent_fp8(
                    &c[t * 512..(t + 1) * 512],
                    &k_pe[t * 64..(t + 1) * 64],
                    &mut want[at..at + latent_bytes],
                );
                let at = geo.indexer_block_offset(layer, b);
                format::encode_index_key_fp8(
                    &keys[t * 128..(t + 1) * 128],
                    &mut want[at..at + geo.indexer_bytes_per_block()],
                    off,
                );
            }

            // GPU: the same inputs into a poisoned device arena.
            let st = gpu.stream();
            let mut arena = st.clone_htod(&vec![POISON; geo.total_bytes()]).unwrap();
            let (dc, dk, dkeys, dslots) = (
                st.clone_htod(&c).unwrap(),
                st.clone_htod(&k_pe).unwrap(),
                st.clone_htod(&keys).unwrap(),
                st.clone_htod(&slot_list).unwrap(),
            );
            let lat0 = geo.latent_block_offset(layer, BlockId(0));
            let idx0 = geo.indexer_block_offset(layer, BlockId(0));
            {
                let mut lat = arena.slice_mut(lat0..lat0 + geo.latent_layer_stride());
                quantize_latent_fp8(&gpu, dims, &dc, &dk, &dslots, n, &mut lat, num_blocks).unwrap();
            }
            {
                let mut idx = arena.slice_mut(idx0..idx0 + geo.indexer_layer_stride());
                quantize_index_keys_fp8(&gpu, dims, &dkeys, &dslots, n, &mut idx, num_blocks).unwrap();
            }
            let got = st.clone_dtoh(&arena).unwrap();
            st.synchronize().unwrap();
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                panic!("n={n} seed={seed}: first differing byte {i} (gpu {:#04x}, cpu {:#04x})", got[i], want[i]);
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_before_launch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let st = gpu.stream();
        let dims = EntryDims::DEEPSEEK_V32;
        let c = st.alloc_zeros::<f32>(512).unwrap();
        let k = st.alloc_zeros::<f32>(64).unwrap();
        let s = st.alloc_zeros::<i64>(1).unwrap();
        let mut region = st.alloc_zeros::<u8>(64 * 656).unwrap();
        let mut view = region.slice_mut(..);
        let e = quantize_latent_fp8(&gpu, dims, &c, &k, &s, 2, &mut view, 1).unwrap_err();
        assert!(e.to_string().contains("2 x 512"), "{e}");
        let e = quantize_latent_fp8(&gpu, dims, &c, &k, &s, 1, &mut view, 2).unwrap_err();
        assert!(e.to_string().contains("2 blocks"), "{e}");
        let odd = EntryDims { kv_lora_rank: 200, ..dims };
        assert!(quantize_latent_fp8(&gpu, odd, &c, &k, &s, 1, &mut view, 1).is_err());
    }
}
