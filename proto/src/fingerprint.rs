//! The one compatibility rule for model fingerprints (stated on `tandem.v1.ModelFingerprint`): the router
//! pairs workers by it, and kv-transfer's sender and receiver refuse a transfer by it.

use crate::v1::ModelFingerprint;

/// The kv-transfer protocol this build speaks (`ModelFingerprint::kv_transfer_protocol`). Raise it with
/// every change that makes old and new workers unable to transfer to each other (a field moved or
/// required, a message sequence changed). 4: a gathered write (UCX `AM_STREAM`, device pools) may run
/// on past its first layer's stream into the next layers' (a receiver of 3 refuses it). 3: layer
/// checksums are `kv_cache::hash` digests (a sum a GPU computes in parallel) instead of xxh3. 2: 16-byte transfer and session tokens, memory keys only in
/// `TransferAccept`. 1 (0 on the wire: the field did not exist): 64-bit tokens, keys in the descriptor.
pub const KV_TRANSFER_PROTOCOL: u32 = 4;

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
    /// Ok when `peer`'s caches are the bytes this worker's caches are and the two can move them: checkpoint
    /// hash (never empty), precision, block size, layer count and kv-transfer protocol equal. The served
    /// name is not compared.
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
        if self.kv_transfer_protocol != peer.kv_transfer_protocol {
            diffs.push(format!(
                "kv-transfer protocol {} != {} (a rolling upgrade pairs only workers of one protocol)",
                protocol_name(self.kv_transfer_protocol),
                protocol_name(peer.kv_transfer_protocol)
            ));
        }
        if diffs.is_empty() { Ok(()) } else { Err(FingerprintMismatch(diffs.join("; "))) }
    }

    /// [`check_compatible`](Self::check_compatible) as a yes/no.
    pub fn is_compatible(&self, peer: &ModelFingerprint) -> bool {
        self.check_compatible(peer).is_ok()
    }
}

/// A protocol number as a person reads it (0 is the unversioned protocol 1).
fn protocol_name(p: u32) -> String {
    if p == 0 { "1 (unversioned)".into() } else { p.to_string() }
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
            kv_transfer_protocol: KV_TRANSFER_PROTOCOL,
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
        let cases: [(&str, Edit); 7] = [
            ("checkpoint hash", |f| f.checkpoint_hash = "ffff".into()),
            ("precision", |f| f.precision = "full".into()),
            ("block size", |f| f.block_size = 128),
            ("layer count", |f| f.num_layers = 61),
            ("no checkpoint hash", |f| f.checkpoint_hash.clear()),
            ("1 (unversioned)", |f| f.kv_transfer_protocol = 0),
            ("kv-transfer protocol", |f| f.kv_transfer_protocol = KV_TRANSFER_PROTOCOL + 1),
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

    #[test]
    fn records_from_before_the_protocol_field_read_as_the_unversioned_protocol() {
        let old = r#"{"model_name":"m","checkpoint_hash":"abcdef0123456789","precision":"fp8","block_size":64,"num_layers":62}"#;
        let fp_old: ModelFingerprint = serde_json::from_str(old).unwrap();
        assert_eq!(fp_old.kv_transfer_protocol, 0);
        let e = fp().check_compatible(&fp_old).unwrap_err().to_string();
        assert!(e.contains(&format!("kv-transfer protocol {KV_TRANSFER_PROTOCOL} != 1 (unversioned)")), "{e}");
        let json = serde_json::to_string(&fp()).unwrap();
        assert_eq!(serde_json::from_str::<ModelFingerprint>(&json).unwrap(), fp());
    }
}
