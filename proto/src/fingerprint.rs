//! The one compatibility rule for model fingerprints (stated on `tandem.v1.ModelFingerprint`): the router
//! pairs workers by it, and kv-transfer's sender and receiver refuse a transfer by it.

use crate::v1::ModelFingerprint;

/// Why two fingerprints are incompatible: every differing field, `; `-separated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintMismatch(String);

impl std::fmt::Display for FingerprintMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FingerprintMismatch {}

impl ModelFingerprint {
    /// Ok when `peer`'s caches are the bytes this worker's caches are: checkpoint hash (never empty),
    /// precision, block size and layer count equal. The served name is not compared.
    pub fn check_compatible(&self, peer: &ModelFingerprint) -> Result<(), FingerprintMismatch> {
        let mut diffs = Vec::new();
        if self.checkpoint_hash.is_empty() {
            diffs.push("no checkpoint hash here".to_string());
        }
        if peer.checkpoint_hash.is_empty() {
            diffs.push("peer sent no checkpoint hash".to_string());
        } else if !self.checkpoint_hash.is_empty() && self.checkpoint_hash != peer.checkpoint_hash {
            diffs.push(format!("checkpoint hash {} != {}", short(&self.checkpoint_hash), short(&peer.checkpoint_hash)));
        }
        if self.precision != peer.precision {
            diffs.push(format!("precision {:?} != {:?}", self.precision, peer.precision));
        }
        if self.block_size != peer.block_size {
            diffs.push(format!("block size {} != {}", self.block_size, peer.block_size));
        }
        if self.num_layers != peer.num_layers {
            diffs.push(format!("layer count {} != {}", self.num_layers, peer.num_layers));
        }
        if diffs.is_empty() { Ok(()) } else { Err(FingerprintMismatch(diffs.join("; "))) }
    }

    /// [`check_compatible`](Self::check_compatible) as a yes/no.
    pub fn is_compatible(&self, peer: &ModelFingerprint) -> bool {
        self.check_compatible(peer).is_ok()
    }
}

/// A hash's first 12 characters (or fewer), enough to tell two apart in a message.
fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn identical_fingerprints_are_compatible_and_the_served_name_is_not_compared() {
        let mut alias = fp();
        alias.model_name = "alias".into();
        fp().check_compatible(&alias).unwrap();
        assert!(alias.is_compatible(&fp()));
    }

    #[test]
    fn every_byte_relevant_field_is_compared_and_named() {
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
            for e in [fp().check_compatible(&other).unwrap_err(), other.check_compatible(&fp()).unwrap_err()] {
                assert!(e.to_string().contains(what), "{what}: {e}");
            }
        }
    }

    #[test]
    fn two_empty_checkpoint_hashes_are_not_a_match() {
        let mut a = fp();
        a.checkpoint_hash.clear();
        assert!(!a.is_compatible(&a.clone()));
    }
}
