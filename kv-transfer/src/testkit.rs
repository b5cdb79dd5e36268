//! Helpers shared by the tests, the bench and the cross-process test peer (not part of the API).

use std::sync::Arc;

use kv_cache::{BlockPool, CacheFormat, CacheGeometry, EntryDims, KvCache};
use proto::v1::ModelFingerprint;

/// A fingerprint matching `g`.
pub fn fingerprint(g: &CacheGeometry) -> ModelFingerprint {
    ModelFingerprint {
        model_name: "test-model".into(),
        checkpoint_hash: "0123456789abcdef0123456789abcdef".into(),
        precision: g.format.name().into(),
        block_size: 64,
        num_layers: g.num_layers as u32,
    }
}

pub fn geometry(layers: usize, blocks: usize) -> CacheGeometry {
    CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, layers, blocks)
}

/// A host cache whose every byte is pseudo-random (seeded), plus a pool over it.
pub fn filled_cache(g: CacheGeometry, seed: u64) -> (Arc<KvCache>, Arc<BlockPool>) {
    let cache = KvCache::new_host(g).expect("allocate test cache");
    fill(&cache, seed);
    let pool = Arc::new(BlockPool::new(g.num_blocks));
    (Arc::new(cache), pool)
}

/// Overwrites the whole arena with a seeded xorshift stream (fast, and never all-equal bytes).
pub fn fill(cache: &KvCache, seed: u64) {
    let len = cache.arena().len();
    // SAFETY: test setup, no concurrent access.
    let bytes = unsafe { cache.arena().slice_mut(0, len) }.expect("a host test cache");
    let mut x = seed | 1;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Encodes a descriptor as one hex line (for passing between processes on stdio).
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}
