//! Model fingerprints: two workers exchange caches only when their fingerprints are compatible (the rule
//! is `ModelFingerprint::check_compatible`, the one the router pairs workers by); and a worker's own
//! fingerprint must describe its cache.

use kv_cache::{BLOCK_SIZE, CacheGeometry};
use proto::v1::ModelFingerprint;

use crate::TransferError;

/// Checks that a worker's own fingerprint describes its cache (a misconfigured worker fails at start-up,
/// not on its first request).
pub fn check_own_fingerprint(fp: &ModelFingerprint, geometry: &CacheGeometry) -> Result<(), TransferError> {
    let bad = |why: String| Err(TransferError::FingerprintMismatch(format!("own fingerprint: {why}")));
    if fp.checkpoint_hash.is_empty() {
        return bad("empty checkpoint hash".into());
    }
    if fp.precision != geometry.format.name() {
        return bad(format!("precision {:?} but the cache format is {:?}", fp.precision, geometry.format.name()));
    }
    if fp.block_size as usize != BLOCK_SIZE {
        return bad(format!("block size {} but caches use {BLOCK_SIZE}", fp.block_size));
    }
    if fp.num_layers as usize != geometry.num_layers {
        return bad(format!("{} layers but the cache has {}", fp.num_layers, geometry.num_layers));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_cache::{CacheFormat, EntryDims};

    fn fp() -> ModelFingerprint {
        ModelFingerprint {
            model_name: "m".into(),
            checkpoint_hash: "abcdef0123456789".into(),
            precision: "fp8".into(),
            block_size: 64,
            num_layers: 62,
        }
    }

    #[test]
    fn own_fingerprint_must_describe_the_cache() {
        let g = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 62, 4);
        check_own_fingerprint(&fp(), &g).unwrap();
        let g32 = CacheGeometry::new(CacheFormat::F32, EntryDims::DEEPSEEK_V32, 62, 4);
        assert!(check_own_fingerprint(&fp(), &g32).is_err());
        let g61 = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 61, 4);
        assert!(check_own_fingerprint(&fp(), &g61).is_err());
    }
}
