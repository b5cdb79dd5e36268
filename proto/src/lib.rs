//! `tandem.v1`: the gRPC services and messages every tandem process speaks.
//!
//! - [`v1::generate_server`] / [`v1::generate_client`]: the client-facing front door (router).
//! - [`v1::prefill_worker_server`] / [`v1::decode_worker_server`]: router -> worker RPCs.
//! - [`v1::TransferDescriptor`]: the decode worker's reserved blocks, as handed to kv-transfer.
//! - [`v1::ModelFingerprint`] and [`v1::WorkerRole`] are the types the router, the workers, discovery
//!   and kv-transfer all use: the fingerprint carries the one compatibility rule
//!   ([`check_compatible`](v1::ModelFingerprint::check_compatible)) and the kv-transfer protocol a worker
//!   speaks ([`KV_TRANSFER_PROTOCOL`]), the role its name ("prefill", "decode"); both are stored as JSON in
//!   discovery records.
//! - [`refusal`]: the typed reason a worker attaches to its error status (`no_room`), which the router reads
//!   instead of the status message.
//!
//! - [`redact`]: the messages that carry a kv-transfer token print it as `<redacted>` in `Debug`.
//!
//! The `.proto` files under `proto/tandem/v1/` document every field.

mod fingerprint;
pub mod redact;
pub mod refusal;
mod role;

pub use fingerprint::{FingerprintMismatch, KV_TRANSFER_PROTOCOL};

pub mod v1 {
    tonic::include_proto!("tandem.v1");
}
