//! kv-bench's cache pools: host memory, or GPU memory through engine's CUDA pool (the `cuda` feature),
//! and the device-to-device copy baseline. Shared by kv-bench and kv-peer, which use different parts.
#![allow(dead_code)]

use std::sync::Arc;

use kv_cache::{BlockPool, CacheGeometry, KvCache};
use kv_transfer::testkit;

/// A pool for `g` filled with seeded bytes: on GPU `device`, else in host memory.
pub fn filled(g: CacheGeometry, seed: u64, device: Option<usize>) -> anyhow::Result<(Arc<KvCache>, Arc<BlockPool>)> {
    let Some(ordinal) = device else { return Ok(testkit::filled_cache(g, seed)) };
    let cache = gpu_pool(g, ordinal)?;
    testkit::fill(&cache, seed);
    Ok((Arc::new(cache), Arc::new(BlockPool::new(g.num_blocks))))
}

pub fn list(devices: &[usize]) -> String {
    devices.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

#[cfg(feature = "cuda")]
fn gpu_pool(g: CacheGeometry, ordinal: usize) -> anyhow::Result<KvCache> {
    let gpu = engine::cuda::Gpu::open(ordinal, &engine::cuda::kernels::default_cache_dir())?;
    Ok(engine::cuda::pool::allocate(&gpu, g)?)
}

#[cfg(not(feature = "cuda"))]
fn gpu_pool(_g: CacheGeometry, ordinal: usize) -> anyhow::Result<KvCache> {
    anyhow::bail!("--devices (a pool on GPU {ordinal}) needs kv-bench built with `--features cuda`")
}

/// GB/s of copying `bytes` of the sender's pool into GPU `dst` (best of 3; `None` without CUDA).
pub fn peer_copy_gbps(cache: &KvCache, src: usize, dst: usize, bytes: u64) -> Option<f64> {
    #[cfg(feature = "cuda")]
    {
        match engine::cuda::pool::peer_copy_gbps(cache, src, dst, bytes) {
            Ok(g) => return Some(g),
            Err(e) => eprintln!("kv-bench: device-to-device copy baseline: {e}"),
        }
    }
    let _ = (cache, src, dst, bytes);
    None
}
