//! What a worker registers: role, address, capacity, model and model fingerprint.

use serde::{Deserialize, Serialize};

/// Which side of a prefill/decode pair a worker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }

    pub fn to_proto(self) -> proto::v1::WorkerRole {
        match self {
            Self::Prefill => proto::v1::WorkerRole::Prefill,
            Self::Decode => proto::v1::WorkerRole::Decode,
        }
    }

    pub fn from_proto(r: proto::v1::WorkerRole) -> Option<Self> {
        match r {
            proto::v1::WorkerRole::Prefill => Some(Self::Prefill),
            proto::v1::WorkerRole::Decode => Some(Self::Decode),
            proto::v1::WorkerRole::Unspecified => None,
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The exact model a worker serves (mirrors `tandem.v1.ModelFingerprint`). Workers are paired only
/// when their fingerprints are equal.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint {
    pub model_name: String,
    pub checkpoint_hash: String,
    pub precision: String,
    pub block_size: u32,
    pub num_layers: u32,
}

impl From<proto::v1::ModelFingerprint> for Fingerprint {
    fn from(f: proto::v1::ModelFingerprint) -> Self {
        Self {
            model_name: f.model_name,
            checkpoint_hash: f.checkpoint_hash,
            precision: f.precision,
            block_size: f.block_size,
            num_layers: f.num_layers,
        }
    }
}

impl From<Fingerprint> for proto::v1::ModelFingerprint {
    fn from(f: Fingerprint) -> Self {
        Self {
            model_name: f.model_name,
            checkpoint_hash: f.checkpoint_hash,
            precision: f.precision,
            block_size: f.block_size,
            num_layers: f.num_layers,
        }
    }
}

/// How much work a worker takes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Requests running at once (decode batch / concurrent prefills).
    pub max_num_seqs: u32,
    /// Cache blocks in the pool.
    pub kv_blocks_total: u32,
    /// Longest prompt + output, in tokens.
    pub max_model_len: u32,
}

/// One worker's registration, stored as JSON under its discovery key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    pub id: String,
    pub role: WorkerRole,
    /// gRPC address the router dials ("host:port" or "http://host:port").
    pub grpc_address: String,
    #[serde(default)]
    pub capacity: Capacity,
    /// None with static discovery until the router has asked the worker (GetInfo).
    #[serde(default)]
    pub fingerprint: Option<Fingerprint>,
}

impl WorkerRecord {
    /// The served model name, when known.
    pub fn model_name(&self) -> Option<&str> {
        self.fingerprint.as_ref().map(|f| f.model_name.as_str())
    }

    /// The `WorkerInfo` a worker returns from GetInfo.
    pub fn to_info(&self) -> proto::v1::WorkerInfo {
        proto::v1::WorkerInfo {
            worker_id: self.id.clone(),
            role: self.role.to_proto() as i32,
            fingerprint: self.fingerprint.clone().map(Into::into),
            max_num_seqs: self.capacity.max_num_seqs,
            kv_blocks_total: self.capacity.kv_blocks_total,
            max_model_len: self.capacity.max_model_len,
            grpc_address: self.grpc_address.clone(),
        }
    }

    /// Reads a GetInfo answer; `address` is where the router reached the worker.
    pub fn from_info(info: proto::v1::WorkerInfo, address: &str) -> Result<Self, crate::DiscoveryError> {
        let role = proto::v1::WorkerRole::try_from(info.role)
            .ok()
            .and_then(WorkerRole::from_proto)
            .ok_or_else(|| crate::DiscoveryError::InvalidRecord(format!("{address}: role {} unknown", info.role)))?;
        Ok(Self {
            id: if info.worker_id.is_empty() { address.to_owned() } else { info.worker_id },
            role,
            grpc_address: address.to_owned(),
            capacity: Capacity {
                max_num_seqs: info.max_num_seqs,
                kv_blocks_total: info.kv_blocks_total,
                max_model_len: info.max_model_len,
            },
            fingerprint: info.fingerprint.map(Into::into),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_survives_json_and_get_info_round_trips() {
        let r = WorkerRecord {
            id: "p0".into(),
            role: WorkerRole::Prefill,
            grpc_address: "127.0.0.1:7001".into(),
            capacity: Capacity { max_num_seqs: 8, kv_blocks_total: 100, max_model_len: 4096 },
            fingerprint: Some(Fingerprint {
                model_name: "tiny".into(),
                checkpoint_hash: "ab".into(),
                precision: "fp8".into(),
                block_size: 64,
                num_layers: 3,
            }),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"role\":\"prefill\""));
        assert_eq!(serde_json::from_str::<WorkerRecord>(&json).unwrap(), r);
        assert_eq!(WorkerRecord::from_info(r.to_info(), "127.0.0.1:7001").unwrap(), r);
    }
}
