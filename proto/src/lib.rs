//! `tandem.v1`: the gRPC services and messages every tandem process speaks.
//!
//! - [`v1::generate_server`] / [`v1::generate_client`]: the client-facing front door (router).
//! - [`v1::prefill_worker_server`] / [`v1::decode_worker_server`]: router -> worker RPCs.
//! - [`v1::TransferDescriptor`]: the decode worker's reserved blocks, as handed to kv-transfer.
//!
//! The `.proto` files under `proto/tandem/v1/` document every field.

pub mod v1 {
    tonic::include_proto!("tandem.v1");
}
