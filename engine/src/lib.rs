//! The model: everything that computes or formats, nothing that talks to a network.
//!
//! - [`config`]: the HF `config.json` of a DeepSeek-V3.2 checkpoint.
//! - [`checkpoint`]: sharded safetensors, tensor names and shapes, FP8 block scales, `verify`.
//! - [`cache`]: the paged cache formats (656-byte FP8 MLA entry, 8448-byte indexer block) and the block
//!   allocator whose arena kv-transfer registers with UCX (the `kv-cache` crate, re-exported).
//! - [`backend`]: the trait every backend implements; [`cpu`]: the CPU reference backend;
//!   [`device`]: `--device cpu|cuda[:N]` and the factory, the one place a backend is constructed.
//! - [`memory`]: the backend's memory budget and the pool size it leaves.
//! - [`cuda`]: the GPU side: NVRTC-compiled kernels with an on-disk cache, the device, launch wrappers.
//! - [`rope`], [`fp8`]: shared numerics; [`tolerance`]: how results are compared.

#![recursion_limit = "256"]

pub mod backend;
/// The paged cache layouts (the `kv-cache` crate, shared with kv-transfer).
pub use kv_cache as cache;
pub use kv_cache::fp8;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod eplb;
pub mod generate;
pub mod lockstep;
pub mod memory;
pub mod rope;
pub mod sampling;
pub mod synthetic;
pub mod tiny;
pub mod tolerance;

pub use backend::{
    AttnForm, Backend, DecodeGraphs, DeviceRows, EngineError, EpRank, ExpertBalance, Fence, GpuBusy, KernelTime,
    LayerReady, Logits, MtpInput, Precision, SeqInput, SeqOutput, StepInput, StepSamples,
};
pub use config::ModelConfig;
pub use device::Device;
