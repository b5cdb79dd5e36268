//! The GPU side: CUDA C kernels compiled by NVRTC at start-up ([`kernels`], [`nvrtc`]), the device they
//! run on ([`device`]) and one Rust module per kernel family with its launch checks ([`cache_quant`], [`gemm`],
//! [`bf16_mma`], [`moe`], [`indexer`], [`topk`], [`sparse_mla`]).
//!
//! Everything loads the CUDA libraries at run time (cudarc's dynamic loading): a binary built without
//! CUDA runs anywhere, and a missing library or GPU is a clear [`CudaError`], never a panic and never a
//! silent fall-back to the CPU.

pub mod backend;
pub mod balance;
pub mod bf16_mma;
pub mod cache_quant;
pub mod device;
pub mod ep;
pub mod gemm;
pub mod graphs;
pub mod indexer;
pub mod kernels;
pub mod moe;
pub mod nvrtc;
pub mod ops;
pub mod pool;
pub mod profile;
pub mod sample;
pub mod sass;
pub mod sparse_mla;
pub mod topk;
pub mod weights;

use std::path::Path;

pub use backend::CudaBackend;
pub use device::{Gpu, GpuInfo};
pub use kernels::{Arch, External, FAMILIES, Family};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("NVRTC is not available: {0}")]
    NoNvrtc(String),
    #[error("no usable GPU: {0}")]
    NoGpu(String),
    #[error("kernel headers: {0}")]
    MissingHeaders(String),
    #[error("unsupported GPU architecture {0}")]
    UnsupportedArch(String),
    #[error("kernel `{unit}` failed to compile:\n{log}")]
    Compile { unit: String, log: String },
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("bad kernel arguments: {0}")]
    Shape(String),
}

impl CudaError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        CudaError::Io { path: path.display().to_string(), source }
    }
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// Whether tests that need a GPU must fail rather than skip where none is found (`TANDEM_REQUIRE_GPU=1`,
/// set by `scripts/gpu-test.sh run`).
pub fn gpu_required() -> bool {
    std::env::var("TANDEM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}
