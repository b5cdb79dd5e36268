//! Model fingerprints: two workers exchange caches only when their fingerprints are compatible (the rule
//! is `ModelFingerprint::check_compatible`, the one the router pairs workers by, kv-transfer protocol
//! included); and a worker's own fingerprint must describe its cache and this build's protocol.

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
    if fp.kv_transfer_protocol != proto::KV_TRANSFER_PROTOCOL {
        // The router pairs workers by it: one that advertises another protocol would be paired wrongly.
        return bad(format!(
            "kv-transfer protocol {} but this build speaks {}",
            fp.kv_transfer_protocol,
            proto::KV_TRANSFER_PROTOCOL
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit;
    use kv_cache::{CacheFormat, EntryDims};

    #[test]
    fn own_fingerprint_must_describe_the_cache() {
        let g = testkit::geometry(62, 4);
        let fp = testkit::fingerprint(&g);
        check_own_fingerprint(&fp, &g).unwrap();
        let g32 = CacheGeometry::new(CacheFormat::F32, EntryDims::DEEPSEEK_V32, 62, 4);
        assert!(check_own_fingerprint(&fp, &g32).is_err());
        assert!(check_own_fingerprint(&fp, &testkit::geometry(61, 4)).is_err());
        let unhashed = ModelFingerprint { checkpoint_hash: String::new(), ..fp.clone() };
        assert!(check_own_fingerprint(&unhashed, &g).is_err());
        let unversioned = ModelFingerprint { kv_transfer_protocol: 0, ..fp };
        assert!(check_own_fingerprint(&unversioned, &g).is_err());
    }
}
