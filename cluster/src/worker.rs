//! What a worker registers: role, address, capacity, model and model fingerprint. The role and the
//! fingerprint are the `tandem.v1` types themselves (the proto crate gives them their JSON form and the
//! fingerprint its compatibility rule).

use proto::v1::{ModelFingerprint, WorkerRole};
use serde::{Deserialize, Serialize};

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
    /// Prefill or decode: reading a record, a key or a GetInfo answer refuses `Unspecified`.
    pub role: WorkerRole,
    /// gRPC address the router dials ("host:port" or "http://host:port").
    pub grpc_address: String,
    #[serde(default)]
    pub capacity: Capacity,
    /// None with static discovery until the router has asked the worker (GetInfo).
    #[serde(default)]
    pub fingerprint: Option<ModelFingerprint>,
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
            role: self.role as i32,
            fingerprint: self.fingerprint.clone(),
            max_num_seqs: self.capacity.max_num_seqs,
            kv_blocks_total: self.capacity.kv_blocks_total,
            max_model_len: self.capacity.max_model_len,
            grpc_address: self.grpc_address.clone(),
        }
    }

    /// Reads a GetInfo answer; `address` is where the router reached the worker.
    pub fn from_info(info: proto::v1::WorkerInfo, address: &str) -> Result<Self, crate::DiscoveryError> {
        let role = WorkerRole::try_from(info.role)
            .ok()
            .filter(|r| *r != WorkerRole::Unspecified)
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
            fingerprint: info.fingerprint,
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
            fingerprint: Some(ModelFingerprint {
                model_name: "tiny".into(),
                checkpoint_hash: "ab".into(),
                precision: "fp8".into(),
                block_size: 64,
                num_layers: 3,
                kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
            }),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"role\":\"prefill\""));
        assert_eq!(serde_json::from_str::<WorkerRecord>(&json).unwrap(), r);
        assert_eq!(WorkerRecord::from_info(r.to_info(), "127.0.0.1:7001").unwrap(), r);
        let unspecified = json.replace("\"prefill\"", "\"unspecified\"");
        assert!(serde_json::from_str::<WorkerRecord>(&unspecified).is_err());
        let info = proto::v1::WorkerInfo { role: WorkerRole::Unspecified as i32, ..r.to_info() };
        assert!(WorkerRecord::from_info(info, "127.0.0.1:7001").is_err());
    }
}
