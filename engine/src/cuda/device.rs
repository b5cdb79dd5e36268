//! One GPU: its context and stream, and every kernel family compiled for its architecture and loaded.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, sys};
use cudarc::nvrtc::Ptx;

use super::kernels::{self, Arch};
use super::{CudaError, gpu_required};

/// What the device reports, for logs and test summaries.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub multiprocessors: i32,
}

/// A GPU with tandem's kernels loaded. Creating one compiles (or finds in the disk cache) every family,
/// so a worker that holds a `Gpu` has every kernel ready.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: GpuInfo,
    arch: Arch,
    functions: HashMap<&'static str, CudaFunction>,
    profiler: super::profile::Profiler,
    busy: super::profile::BusyTimer,
}

/// Number of CUDA devices, or why there are none (no driver library, no device).
pub fn device_count() -> Result<usize, CudaError> {
    // SAFETY: only tries dlopen on cudarc's candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoGpu("the CUDA driver library (libcuda.so.1) is not installed".into()));
    }
    let n = CudaContext::device_count().map_err(|e| CudaError::NoGpu(format!("cuInit/cuDeviceGetCount: {e}")))?;
    if n <= 0 {
        return Err(CudaError::NoGpu("the CUDA driver reports no device".into()));
    }
    Ok(n as usize)
}

impl Gpu {
    /// Opens device `ordinal` and loads every kernel family, compiling through the cache in `cache_dir`.
    pub fn open(ordinal: usize, cache_dir: &Path) -> Result<Self, CudaError> {
        let n = device_count()?;
        if ordinal >= n {
            return Err(CudaError::NoGpu(format!("device {ordinal} requested, {n} present")));
        }
        let ctx = CudaContext::new(ordinal)?;
        let compute_capability = ctx.compute_capability()?;
        let info = GpuInfo {
            ordinal,
            name: ctx.name()?,
            compute_capability,
            total_memory: ctx.total_mem()?,
            multiprocessors: ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        };
        let arch = Arch::for_compute_capability(compute_capability.0, compute_capability.1)?;
        let mut functions = HashMap::new();
        for compiled in kernels::compile_all(&arch, cache_dir)? {
            let module = ctx.load_module(Ptx::from_binary(compiled.cubin))?;
            for &f in compiled.family.functions {
                functions.insert(f, module.load_function(f)?);
            }
        }
        // Kernels whose dynamic shared memory passes the 48 KiB default.
        for (name, bytes) in [
            ("tandem_indexer_scores", super::indexer::MAX_SHARED_BYTES),
            ("tandem_topk_rule", super::topk::SHARED_BYTES),
            ("tandem_topk_split_plan", super::topk::SHARED_BYTES),
            ("tandem_topk_split_resolve", super::topk::RESOLVE_SHARED_BYTES),
            ("tandem_sparse_mla_decode", super::sparse_mla::SHARED_BYTES),
            ("tandem_sparse_mla_decode_pair", super::sparse_mla::SHARED_BYTES),
            ("tandem_sparse_mla_prefill", super::sparse_mla::SHARED_BYTES),
            ("tandem_gemm_bf16_mma", super::bf16_mma::SHARED_BYTES),
        ]
        .into_iter()
        .chain(super::gemm::KERNELS)
        {
            let f = functions.get(name).ok_or_else(|| CudaError::Driver(format!("kernel `{name}` is not loaded")))?;
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
        }
        let stream = ctx.new_stream()?;
        Ok(Gpu { ctx, stream, info, arch, functions, profiler: Default::default(), busy: Default::default() })
    }

    /// Device 0 for a GPU test: `None` (with a message) where there is no GPU, unless the run requires one
    /// (`TANDEM_REQUIRE_GPU=1`), where that is a failure.
    pub fn for_test() -> Option<Self> {
        let cache = std::env::temp_dir().join("tandem-test-kernels");
        match Gpu::open(0, &cache) {
            Ok(g) => Some(g),
            Err(e) if !gpu_required() && matches!(e, CudaError::NoGpu(_)) => {
                eprintln!("skipped: no GPU ({e}); TANDEM_REQUIRE_GPU=1 makes this a failure");
                None
            }
            Err(e) => panic!("GPU test could not start: {e}"),
        }
    }

    /// Per-kernel timing of the launches (engine::cuda::profile).
    pub fn profiler(&self) -> &super::profile::Profiler {
        &self.profiler
    }

    /// The calls' GPU spans (engine::cuda::profile::BusyTimer).
    pub fn busy(&self) -> &super::profile::BusyTimer {
        &self.busy
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded entry point (names are listed in [`kernels::FAMILIES`]).
    pub fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::Driver(format!("kernel `{name}` is not loaded")))
    }
}
