//! Model fingerprints: two workers exchange caches only when they serve the very same model with the very
//! same cache format. The served name is informational (aliases are fine); everything that changes bytes
//! must match.

use kv_cache::{BLOCK_SIZE, CacheGeometry};
use proto::v1::ModelFingerprint;

use crate::TransferError;

/// Refuses `theirs` unless checkpoint hash, precision, block size and layer count equal `ours`.
pub fn check_fingerprint(ours: &ModelFingerprint, theirs: &ModelFingerprint) -> Result<(), TransferError> {
    let mut diffs = Vec::new();
    if theirs.checkpoint_hash.is_empty() {
        diffs.push("peer sent no checkpoint hash".to_string());
    } else if ours.checkpoint_hash != theirs.checkpoint_hash {
        diffs.push(format!("checkpoint hash {} != {}", short(&ours.checkpoint_hash), short(&theirs.checkpoint_hash)));
    }
    if ours.precision != theirs.precision {
        diffs.push(format!("precision {:?} != {:?}", ours.precision, theirs.precision));
    }
    if ours.block_size != theirs.block_size {
        diffs.push(format!("block size {} != {}", ours.block_size, theirs.block_size));
    }
    if ours.num_layers != theirs.num_layers {
        diffs.push(format!("layer count {} != {}", ours.num_layers, theirs.num_layers));
    }
    if diffs.is_empty() { Ok(()) } else { Err(TransferError::FingerprintMismatch(diffs.join("; "))) }
}

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

fn short(h: &str) -> &str {
    &h[..h.len().min(12)]
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
    fn identical_fingerprints_match_and_the_name_is_informational() {
        let mut other = fp();
        other.model_name = "alias".into();
        check_fingerprint(&fp(), &other).unwrap();
    }

    #[test]
    fn every_byte_relevant_field_is_compared() {
        type Edit = fn(&mut ModelFingerprint);
        let cases: [(&str, Edit); 5] = [
            ("checkpoint hash", |f| f.checkpoint_hash = "ffff".into()),
            ("precision", |f| f.precision = "full".into()),
            ("block size", |f| f.block_size = 128),
            ("layer count", |f| f.num_layers = 61),
            ("no checkpoint hash", |f| f.checkpoint_hash.clear()),
        ];
        for (what, edit) in cases {
            let mut other = fp();
            edit(&mut other);
            let e = check_fingerprint(&fp(), &other).unwrap_err();
            assert!(e.to_string().contains(what), "{what}: {e}");
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
