//! The model: everything that computes or formats, nothing that talks to a network.
//!
//! - [`config`]: the HF `config.json` of a DeepSeek-V3.2 checkpoint.
//! - [`cache`]: the paged cache formats (656-byte FP8 MLA entry, 8448-byte indexer block) and the block
//!   allocator whose arena kv-transfer registers with UCX.

pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod fp8;

pub use config::ModelConfig;
