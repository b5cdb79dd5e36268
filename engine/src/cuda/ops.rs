//! Device buffers, the per-call workspace and typed launches of the model kernels (`engine/kernels/model.cu`)
//! the CUDA backend is built from. Pointers cross into kernels as raw device addresses: every launch
//! wrapper checks the shapes it is given against the buffers' sizes where it can, and the backend's
//! batch checks (`crate::backend::check_item`) guarantee the rest (block ids inside the pool, positions
//! inside the block tables).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

use super::{CudaError, Gpu};

/// Launch arguments (what the kernels take by value).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device address (0 for a null pointer).
    P(u64),
    I(i32),
    L(i64),
    F(f32),
    D(f64),
    /// A TMA tensor map, by value (`__grid_constant__`).
    T(super::gemm::TensorMap),
}

/// A device allocation of `T`s with its address.
pub struct DBuf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
    len: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits> DBuf<T> {
    /// `len` zeroed values (at least one, so the address is valid).
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CudaError> {
        let slice = stream.alloc_zeros::<T>(len.max(1))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(DBuf { slice, ptr, len })
    }

    /// A copy of `data` on the device.
    pub fn upload(stream: &Arc<CudaStream>, data: &[T]) -> Result<Self, CudaError> {
        let mut b = Self::zeros(stream, data.len())?;
        if !data.is_empty() {
            stream.memcpy_htod(data, &mut b.slice)?;
        }
        Ok(b)
    }
}

impl<T> DBuf<T> {
    #[inline]
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The address of element `i`.
    #[inline]
    pub fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<T>()) as u64
    }

    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

/// Bytes a workspace chunk starts with.
const CHUNK: usize = 64 << 20;
/// Alignment of every workspace allocation.
const ALIGN: usize = 256;

/// A position in a [`Workspace`] ([`Workspace::mark`], [`Workspace::rewind`]).
#[derive(Clone, Copy, Debug)]
pub struct WorkspaceMark {
    chunk: usize,
    used: usize,
}

/// The per-call workspace: chunks of device memory handed out by a bump pointer and reset at the start of
/// every forward call (work on the one stream is ordered, so the next call may reuse the bytes at once).
/// It grows by a chunk when a call needs more than it has ever needed and never shrinks, so after the
/// first calls at the serving limits nothing is allocated.
pub struct Workspace {
    chunks: Vec<DBuf<u8>>,
    chunk: usize,
    used: usize,
    /// Growing is an error (while a CUDA graph is captured: an allocation would become part of it).
    frozen: bool,
}

impl Workspace {
    pub fn new() -> Self {
        Workspace { chunks: Vec::new(), chunk: 0, used: 0, frozen: false }
    }

    /// Makes growing an error (`true`) or allowed again.
    pub fn set_frozen(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    /// Makes sure the first chunk holds at least `bytes` (startup reservation).
    pub fn reserve(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<(), CudaError> {
        if self.chunks.first().is_none_or(|c| c.len() < bytes) {
            let c = DBuf::zeros(stream, bytes.max(CHUNK))?;
            self.chunks.insert(0, c);
        }
        Ok(())
    }

    pub fn reset(&mut self) {
        self.chunk = 0;
        self.used = 0;
    }

    /// Where the next [`take`](Self::take) starts.
    pub fn mark(&self) -> WorkspaceMark {
        WorkspaceMark { chunk: self.chunk, used: self.used }
    }

    /// Hands back everything taken since `mark` (a decoder layer's intermediates once the layer is issued).
    /// The work is on one stream, so a later kernel that reuses the bytes runs after every kernel that used
    /// them.
    pub fn rewind(&mut self, mark: WorkspaceMark) {
        debug_assert!((mark.chunk, mark.used) <= (self.chunk, self.used), "a workspace mark from the future");
        self.chunk = mark.chunk;
        self.used = mark.used;
    }

    /// The device address a mark stands for (where the next take after it starts; a chunk inserted in
    /// front by [`reserve`](Self::reserve) moves the chunks, so a mark's parts alone do not name an address).
    pub fn address(&self, mark: WorkspaceMark) -> u64 {
        self.chunks.get(mark.chunk).map_or(0, |c| c.ptr() + mark.used as u64)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(DBuf::bytes).sum()
    }

    /// `n` uninitialized `T`s.
    pub fn take<T>(&mut self, stream: &Arc<CudaStream>, n: usize) -> Result<u64, CudaError> {
        let bytes = (n * std::mem::size_of::<T>()).max(1).next_multiple_of(ALIGN);
        loop {
            if let Some(c) = self.chunks.get(self.chunk) {
                if self.used + bytes <= c.len() {
                    let p = c.ptr() + self.used as u64;
                    self.used += bytes;
                    return Ok(p);
                }
                self.chunk += 1;
                self.used = 0;
                continue;
            }
            if self.frozen {
                return Err(CudaError::Shape(format!(
                    "the workspace would grow by {bytes} bytes while it may not (a CUDA graph capture)"
                )));
            }
            let chunk = DBuf::zeros(stream, bytes.max(CHUNK))?;
            if !self.chunks.is_empty() {
                // Past what was reserved at start: the serving limits' estimate was short for this batch.
                tracing::warn!(
                    held_bytes = self.bytes(),
                    added_bytes = chunk.bytes(),
                    "the GPU workspace grows beyond its start-up reservation"
                );
            }
            self.chunks.push(chunk);
        }
    }

    /// A copy of host values (inputs of a call: tokens, positions, block tables).
    pub fn upload<T: DeviceRepr>(&mut self, stream: &Arc<CudaStream>, data: &[T]) -> Result<u64, CudaError> {
        let p = self.take::<T>(stream, data.len())?;
        if !data.is_empty() {
            stream.context().bind_to_thread()?;
            // SAFETY: `p` has room for `data` (just taken); a pageable source is copied before the call returns.
            unsafe { cudarc::driver::result::memcpy_htod_async(p, data, stream.cu_stream()) }?;
        }
        Ok(p)
    }
}

impl Default for Workspace {
    fn default() -> Self {
        Self::new()
    }
}

/// Launches `name` on the GPU's stream.
pub fn launch(
    gpu: &Gpu,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
) -> Result<(), CudaError> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    if grid.1 > 65_535 || grid.2 > 65_535 {
        return Err(CudaError::Shape(format!("{name}: grid {grid:?} exceeds 65535 in y or z")));
    }
    let f = gpu.function(name)?;
    let mut b = gpu.stream().launch_builder(f);
    for a in args {
        match a {
            Arg::P(v) => b.arg(v),
            Arg::I(v) => b.arg(v),
            Arg::L(v) => b.arg(v),
            Arg::F(v) => b.arg(v),
            Arg::D(v) => b.arg(v),
            Arg::T(v) => b.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
    // SAFETY: every caller passes the kernel's parameters in order with their C types (checked against
    // engine/kernels/model.cu by the GPU tests), and buffers sized for the launch.
    gpu.profiler().time(gpu.stream(), name, || unsafe { b.launch(cfg) })
}

/// Blocks of a grid-stride elementwise launch over `n` values.
pub fn elementwise_grid(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1)
}
