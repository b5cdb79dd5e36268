//! The cache pool in device memory and what transports reach it through.
//!
//! The pool is one plain `cuMemAlloc` allocation, not stream-ordered pool memory: UCX's CUDA transports
//! recognise it as device memory and move it GPU to GPU (cuda_ipc), where memory from a stream-ordered
//! pool would be treated as managed and staged through the host. kv-transfer reaches it through
//! [`DeviceCopy`]: host copies on a stream of their own (a copy never waits behind a forward), the
//! device's context for UCX's progress threads, and the transfer checksum computed on the GPU
//! (`engine/kernels/kv_transfer.cu`, the sum of [`crate::cache::hash`]).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg, result, sys,
};

use super::{CudaError, Gpu};
use crate::cache::{CacheGeometry, DeviceBuffer, DeviceCopy, KvArena, KvCache, QueuedCopy, hash};

/// Words (8 bytes) one CTA of the checksum kernel sums: 64 KiB, so a 26 MB layer of a 32K-token request
/// spreads over about 400 CTAs.
pub const HASH_TASK_WORDS: u64 = 8192;
/// Threads per CTA of the checksum kernel.
const HASH_THREADS: u32 = 256;
/// Bytes one CTA of the copy kernel moves (tasks split at multiples of it keep their 16-byte alignment).
pub const COPY_TASK_BYTES: u64 = 64 << 10;
/// Threads per CTA of the copy kernel.
const COPY_THREADS: u32 = 256;

/// A zeroed device pool for `geometry` on `gpu`, reachable by transports.
pub fn allocate(gpu: &Gpu, geometry: CacheGeometry) -> Result<KvCache, CudaError> {
    let bytes = geometry.total_bytes();
    let ctx = gpu.context().clone();
    let mem = DeviceAlloc::zeroed(&ctx, bytes).map_err(|e| {
        CudaError::Driver(format!(
            "cannot allocate a {} MiB cache pool on GPU {} ({} blocks of {} layers): {e}",
            bytes >> 20,
            gpu.info().ordinal,
            geometry.num_blocks,
            geometry.num_layers
        ))
    })?;
    let ptr = std::ptr::NonNull::new(mem.ptr as *mut u8)
        .ok_or_else(|| CudaError::Driver("the cache pool has a null device address".into()))?;
    let copier = Arc::new(PoolCopier {
        ctx: ctx.clone(),
        stream: ctx.new_stream()?,
        base: mem.ptr,
        len: bytes,
        hash: gpu.function("tandem_kv_hash")?.clone(),
        copy: gpu.function("tandem_kv_copy")?.clone(),
        slots: std::sync::OnceLock::new(),
    });
    let ordinal = gpu.info().ordinal as u32;
    // SAFETY: `ptr..ptr + bytes` is the allocation `mem`, which the arena owns and frees on drop.
    let arena = unsafe { KvArena::from_device(ptr, bytes, ordinal, Box::new(mem), copier) };
    KvCache::with_arena(geometry, arena).map_err(|e| CudaError::Shape(e.to_string()))
}

/// GB/s of one device-to-device copy of `bytes` from the start of `cache` (a pool on GPU `src`) into a
/// buffer on GPU `dst` (`cuMemcpyPeerAsync`, best of 3): the same-run baseline of a transfer between two
/// GPUs of a node.
pub fn peer_copy_gbps(cache: &KvCache, src: usize, dst: usize, bytes: u64) -> Result<f64, CudaError> {
    let n = (bytes as usize).min(cache.arena().len());
    let (sctx, dctx) = (CudaContext::new(src)?, CudaContext::new(dst)?);
    let buf = DeviceAlloc::zeroed(&dctx, n)?;
    if src != dst {
        // Without peer access the driver stages a peer copy through host memory.
        for (from, to) in [(&sctx, &dctx), (&dctx, &sctx)] {
            from.bind_to_thread()?;
            // SAFETY: both are live primary contexts; enabling twice reports "already enabled", ignored.
            let r = unsafe { cudarc::driver::sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
            if r != cudarc::driver::sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                r.result()?;
            }
        }
    }
    sctx.bind_to_thread()?;
    let stream = sctx.new_stream()?;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        // SAFETY: `n` bytes of the source pool and of the destination buffer, both alive until synchronized.
        unsafe {
            cudarc::driver::sys::cuMemcpyPeerAsync(
                buf.ptr,
                dctx.cu_ctx(),
                cache.arena().as_ptr() as u64,
                sctx.cu_ctx(),
                n,
                stream.cu_stream(),
            )
        }
        .result()?;
        stream.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(n as f64 / best / 1e9)
}

/// A `cuMemAlloc` allocation, freed on drop.
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
}

impl DeviceAlloc {
    fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, cudarc::driver::DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation on the bound context; zeroed before anyone reads it.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        let mem = DeviceAlloc { ctx: ctx.clone(), ptr, len: bytes };
        // SAFETY: `bytes` bytes of the allocation just made.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }?;
        Ok(mem)
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // Nothing else can use the pool now (the arena that owned it is gone); a failure here leaks it.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync on this context, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

impl DeviceBuffer for DeviceAlloc {
    fn addr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

struct PoolCopier {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    base: u64,
    len: usize,
    hash: CudaFunction,
    copy: CudaFunction,
    /// Task lists the copy kernel reads in place, made on first use (`None`: the host could not pin them).
    slots: std::sync::OnceLock<Option<Arc<TaskSlots>>>,
}

/// Task lists of the copy kernel written by the host into mapped pinned memory, which the kernel reads in
/// place: queuing a copy is then a write and a launch. Uploading each list instead (a stream-ordered
/// allocation, a copy from pageable memory, a free) made queuing a 32 MiB gather of ~1,200 pieces take
/// 35-80 us of the shipping thread, and the same of the receiver's progress thread for each scatter.
struct TaskSlots {
    ctx: Arc<CudaContext>,
    /// [`TASK_SLOTS`] lists of [`SLOT_TASKS`] tasks (3 words each), pinned and mapped.
    host: *mut u64,
    /// The device address of `host`.
    dev: u64,
    free: std::sync::Mutex<Vec<usize>>,
}

/// Task lists queued at once per pool (the sender keeps two gathers queued, a receiver a scatter per
/// landing buffer); a copy finding none free uploads its list instead.
const TASK_SLOTS: usize = 16;
/// Tasks per list: a 32 MiB chunk of single 8448-byte indexer blocks is 3,972 tasks.
const SLOT_TASKS: usize = 4096;

// SAFETY: `host` is a pinned allocation owned by the struct; slots are handed out under the mutex, and a
// slot's words are written only by the holder of its lease.
unsafe impl Send for TaskSlots {}
unsafe impl Sync for TaskSlots {}

impl TaskSlots {
    /// Pins and maps the lists on `ctx` (bound to this thread).
    fn new(ctx: &Arc<CudaContext>) -> Result<TaskSlots, cudarc::driver::DriverError> {
        let bytes = TASK_SLOTS * SLOT_TASKS * 3 * 8;
        // SAFETY: a plain pinned allocation, mapped into the device's address space.
        let host = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }? as *mut u64;
        let mut dev = 0u64;
        // SAFETY: `host` was allocated above with DEVICEMAP.
        if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }.result() {
            // SAFETY: allocated above, never handed out.
            let _ = unsafe { result::free_host(host.cast()) };
            return Err(e);
        }
        Ok(TaskSlots { ctx: ctx.clone(), host, dev, free: std::sync::Mutex::new((0..TASK_SLOTS).collect()) })
    }

    /// Writes `tasks` into a free list; `None` when none is free or they do not fit one.
    fn lease(self: &Arc<Self>, tasks: &[u64]) -> Option<SlotLease> {
        if tasks.len() > SLOT_TASKS * 3 {
            return None;
        }
        let slot = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        // SAFETY: the slot is ours until the lease is dropped, and lies inside the allocation. The launch
        // that follows orders these writes before the kernel's reads.
        unsafe { std::ptr::copy_nonoverlapping(tasks.as_ptr(), self.host.add(slot * SLOT_TASKS * 3), tasks.len()) };
        #[cfg(test)]
        PINNED_LISTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(SlotLease { slots: self.clone(), slot })
    }
}

impl Drop for TaskSlots {
    fn drop(&mut self) {
        // Every lease holds the slots, so no kernel reads them any more.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host, freed once.
            let _ = unsafe { result::free_host(self.host.cast()) };
        }
    }
}

/// A task list in use by one queued copy; dropped once the kernel is done with it.
struct SlotLease {
    slots: Arc<TaskSlots>,
    slot: usize,
}

impl SlotLease {
    fn device_addr(&self) -> u64 {
        self.slots.dev + (self.slot * SLOT_TASKS * 3 * 8) as u64
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.slots.free.lock().unwrap_or_else(|p| p.into_inner()).push(self.slot);
    }
}

/// Where a launched copy's task list lives; kept until the kernel finished.
enum TaskList {
    Pinned(SlotLease),
    Uploaded(CudaSlice<u64>),
}

impl TaskList {
    /// Gives the list up after a failed wait: the kernel may still read it, so a pinned slot is never
    /// handed out again (an uploaded list is freed in stream order, after the kernel, anyway).
    fn abandon(self) {
        if let TaskList::Pinned(lease) = self {
            std::mem::forget(lease);
        }
    }
}

/// Task lists written into pinned slots (tests check the slots are used).
#[cfg(test)]
static PINNED_LISTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl PoolCopier {
    fn check(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!("pool access {offset}+{len} outside {} bytes", self.len)),
        }
    }

    /// The checksum kernel's sum over `segments`, plus the last word's term where the stream ends inside a
    /// word (read back and added here). `None` where a segment other than the last is not whole words,
    /// or any starts off an 8-byte boundary (the kernel reads aligned words).
    fn sum(&self, segments: &[(u64, u64)]) -> Option<Result<(u64, u64), String>> {
        let (last, whole) = segments.split_last()?;
        if segments.iter().any(|(off, _)| off % 8 != 0) || whole.iter().any(|(_, len)| len % 8 != 0) {
            return None;
        }
        let total: u64 = segments.iter().map(|s| s.1).sum();
        Some(self.launch(segments, total, *last))
    }

    fn launch(&self, segments: &[(u64, u64)], total: u64, last: (u64, u64)) -> Result<(u64, u64), String> {
        let fail = |e: cudarc::driver::DriverError| e.to_string();
        // Tasks of at most HASH_TASK_WORDS whole words: (pool offset, first word's index in the stream, words).
        let mut tasks: Vec<u64> = Vec::new();
        let mut word = 0u64;
        for &(off, len) in segments {
            self.check(off as usize, len as usize)?;
            let words = len / 8;
            let mut done = 0;
            while done < words {
                let n = (words - done).min(HASH_TASK_WORDS);
                tasks.extend([off + 8 * done, word + done, n]);
                done += n;
            }
            word += words;
        }
        self.ctx.bind_to_thread().map_err(fail)?;
        let mut sum = 0u64;
        if !tasks.is_empty() {
            let n = (tasks.len() / 3) as u32;
            let d_tasks = self.stream.clone_htod(&tasks).map_err(fail)?;
            let d_sum = self.stream.alloc_zeros::<u64>(1).map_err(fail)?;
            let cfg = LaunchConfig { grid_dim: (n, 1, 1), block_dim: (HASH_THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut b = self.stream.launch_builder(&self.hash);
            b.arg(&self.base).arg(&d_tasks).arg(&d_sum);
            // SAFETY: every task's words lie inside the pool (checked above); the kernel reads them and adds
            // into the one-word sum.
            unsafe { b.launch(cfg) }.map_err(fail)?;
            sum = self.stream.clone_dtoh(&d_sum).map_err(fail)?[0];
        }
        let tail = last.1 % 8;
        if tail != 0 {
            let mut w = [0u8; 8];
            self.read(last.0 as usize + (last.1 - tail) as usize, &mut w[..tail as usize])?;
            sum = sum.wrapping_add(hash::term(u64::from_le_bytes(w), total / 8));
        }
        Ok((sum, total))
    }
}

impl DeviceCopy for PoolCopier {
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        self.check(offset, dst.len())?;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: in range (checked); `dst` outlives the synchronous copy.
        unsafe { result::memcpy_dtoh_async(dst, self.base + offset as u64, self.stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        self.stream.synchronize().map_err(|e| e.to_string())
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        self.check(offset, src.len())?;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: in range (checked); the copy completes before returning.
        unsafe { result::memcpy_htod_async(self.base + offset as u64, src, self.stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        self.stream.synchronize().map_err(|e| e.to_string())
    }

    fn bind_thread(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())
    }

    fn checksum(&self, segments: &[(u64, u64)]) -> Option<Result<u64, String>> {
        if segments.is_empty() {
            return Some(Ok(hash::finish(0, 0)));
        }
        Some(self.sum(segments)?.map(|(sum, len)| hash::finish(sum, len)))
    }

    unsafe fn copy_pieces(&self, pieces: &[(u64, u64, u64)]) -> Option<Result<(), String>> {
        let copied = self.queue_tasks(pieces).and_then(|tasks| match tasks {
            Some(list) => self.stream.synchronize().inspect_err(|_| list.abandon()),
            None => Ok(()),
        });
        Some(copied.map_err(|e| e.to_string()))
    }

    unsafe fn copy_pieces_queued(&self, pieces: &[(u64, u64, u64)]) -> Option<Result<Box<dyn QueuedCopy>, String>> {
        let queued = || -> Result<Box<dyn QueuedCopy>, cudarc::driver::DriverError> {
            let tasks = self.queue_tasks(pieces)?;
            let done = match &tasks {
                Some(_) => match self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        // The copy is launched: it must be over before the caller gives its memory back.
                        if self.stream.synchronize().is_err()
                            && let Some(list) = tasks
                        {
                            list.abandon();
                        }
                        return Err(e);
                    }
                },
                None => None,
            };
            Ok(Box::new(QueuedTasks { done, _tasks: tasks }))
        };
        Some(queued().map_err(|e| e.to_string()))
    }

    fn cuda_memory(&self) -> bool {
        true
    }

    fn alloc(&self, bytes: usize) -> Option<Result<Box<dyn DeviceBuffer>, String>> {
        Some(
            DeviceAlloc::zeroed(&self.ctx, bytes)
                .map(|b| Box::new(b) as Box<dyn DeviceBuffer>)
                .map_err(|e| format!("allocating a {bytes}-byte transfer buffer: {e}")),
        )
    }
}

/// A copy kernel's launch on the copier's stream and the event after it ([`DeviceCopy::copy_pieces_queued`]).
struct QueuedTasks {
    /// `None`: there was nothing to copy.
    done: Option<CudaEvent>,
    /// The launch's task list, given back after the kernel (dropped after `drop` waited for it).
    _tasks: Option<TaskList>,
}

impl QueuedCopy for QueuedTasks {
    fn poll(&mut self) -> Option<Result<(), String>> {
        match self.done.as_ref().map(CudaEvent::try_is_complete) {
            None | Some(Ok(true)) => Some(Ok(())),
            Some(Ok(false)) => None,
            Some(Err(e)) => Some(Err(e.to_string())),
        }
    }

    fn wait(&mut self) -> Result<(), String> {
        self.done.as_ref().map_or(Ok(()), |e| e.synchronize().map_err(|e| e.to_string()))
    }
}

impl Drop for QueuedTasks {
    fn drop(&mut self) {
        // Whoever dropped it no longer waits for the bytes, but the kernel must not outlive what it names.
        if self.wait().is_err()
            && let Some(list) = self._tasks.take()
        {
            list.abandon();
        }
    }
}

impl PoolCopier {
    /// One launch of the copy kernel over `pieces` cut into tasks of at most [`COPY_TASK_BYTES`], queued on
    /// the copier's stream; the task list it reads (`None`: nothing to copy, nothing launched).
    fn queue_tasks(&self, pieces: &[(u64, u64, u64)]) -> Result<Option<TaskList>, cudarc::driver::DriverError> {
        let mut tasks: Vec<u64> = Vec::new();
        for &(src, dst, len) in pieces {
            let mut at = 0;
            while at < len {
                let n = (len - at).min(COPY_TASK_BYTES);
                tasks.extend([src + at, dst + at, n]);
                at += n;
            }
        }
        if tasks.is_empty() {
            return Ok(None);
        }
        self.ctx.bind_to_thread()?;
        let slots = self.slots.get_or_init(|| match TaskSlots::new(&self.ctx) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::warn!(error = %e, "no pinned task lists for the cache pool's copies; uploading each");
                None
            }
        });
        let list = match slots.as_ref().and_then(|s| s.lease(&tasks)) {
            Some(lease) => TaskList::Pinned(lease),
            None => TaskList::Uploaded(self.stream.clone_htod(&tasks)?),
        };
        let n = (tasks.len() / 3) as u32;
        let cfg = LaunchConfig { grid_dim: (n, 1, 1), block_dim: (COPY_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.copy);
        let pinned_addr;
        match &list {
            TaskList::Pinned(lease) => {
                pinned_addr = lease.device_addr();
                b.arg(&pinned_addr)
            }
            TaskList::Uploaded(d) => b.arg(d),
        };
        // SAFETY: the caller's contract (copy_pieces): every range is device memory it may access; the task
        // list stays alive (returned, held until the kernel is over).
        unsafe { b.launch(cfg) }?;
        Ok(Some(list))
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cache::{CacheFormat, EntryDims};

    /// The GPU's digest of any segments equals the host's over the same bytes: segments of whole words
    /// (latent runs of 656-byte entries, 8448-byte indexer blocks, task-sized and larger), a last one
    /// ending inside a word, and the ones the kernel leaves to the host copies (`None`).
    #[test]
    fn device_checksums_equal_the_host_digest() {
        let Some(gpu) = Gpu::for_test() else { return };
        let g = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 2, 40);
        let cache = allocate(&gpu, g).unwrap();
        let arena = cache.arena();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let bytes: Vec<u8> = (0..arena.len()).map(|_| rng.random()).collect();
        unsafe { arena.copy_in(0, &bytes) }.unwrap();
        let host = |segs: &[(u64, u64)]| {
            let mut h = hash::Sum64::new();
            for &(o, l) in segs {
                h.update(&bytes[o as usize..(o + l) as usize]);
            }
            h.digest()
        };
        let big = HASH_TASK_WORDS * 8;
        let cases: Vec<Vec<(u64, u64)>> = vec![
            vec![(0, 656 * 64)],
            vec![(656 * 128, 656 * 37), (g.indexer_region_offset() as u64, 8448 * 3)],
            vec![(8, big), (big + 64, big * 2 + 8), (0, 8)],
            vec![(0, 656 * 5), (4096, 13)],
            vec![(16, 5)],
            vec![],
        ];
        for segs in &cases {
            let got = arena.device_checksum(segs).expect("whole-word segments hash on the device").unwrap();
            assert_eq!(got, host(segs), "segments {segs:?}");
        }
        // Not whole words before the end, or off an 8-byte boundary: the caller hashes host copies.
        assert!(arena.device_checksum(&[(0, 13), (4096, 8)]).is_none());
        assert!(arena.device_checksum(&[(4, 16)]).is_none());
        // Outside the pool: an error, nothing read.
        let len = arena.len() as u64;
        assert!(arena.device_checksum(&[(len - 8, 16)]).unwrap().is_err());
        // A changed byte on the device changes the digest.
        let before = arena.device_checksum(&cases[0]).unwrap().unwrap();
        unsafe { arena.copy_in(1000, &[bytes[1000] ^ 0x10]) }.unwrap();
        assert_ne!(arena.device_checksum(&cases[0]).unwrap().unwrap(), before);
    }

    /// A 2-layer, 40-block pool on `gpu` holding seeded random bytes (returned too), and a 1 MiB device
    /// buffer from its copier.
    fn random_pool(gpu: &Gpu, seed: u64) -> (KvCache, Vec<u8>, Box<dyn DeviceBuffer>) {
        let g = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 2, 40);
        let cache = allocate(gpu, g).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let bytes: Vec<u8> = (0..cache.arena().len()).map(|_| rng.random()).collect();
        unsafe { cache.arena().copy_in(0, &bytes) }.unwrap();
        let buf = cache.arena().device_copier().expect("a device pool has a copier").alloc(1 << 20).unwrap().unwrap();
        (cache, bytes, buf)
    }

    /// The first `len` bytes of `buf`, scattered into the second half of `cache`'s pool and read back from
    /// there (returns also where they landed, a pool offset).
    fn read_back(cache: &KvCache, buf: &dyn DeviceBuffer, len: u64) -> (Vec<u8>, u64) {
        let arena = cache.arena();
        let dst0 = arena.len() as u64 / 2;
        let copier = arena.device_copier().expect("a device pool has a copier");
        unsafe { copier.copy_pieces(&[(buf.addr(), arena.as_ptr() as u64 + dst0, len)]) }.unwrap().unwrap();
        let mut back = vec![0u8; len as usize];
        unsafe { arena.copy_out(dst0 as usize, &mut back) }.unwrap();
        (back, dst0)
    }

    /// Gathering scattered pieces into a buffer and scattering them back elsewhere moves exactly those
    /// bytes: aligned block-sized pieces, pieces longer than a task, and unaligned ones (the byte path).
    #[test]
    fn gathers_and_scatters_move_exactly_the_pieces() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (cache, bytes, buf) = random_pool(&gpu, 9);
        let arena = cache.arena();
        let copier = arena.device_copier().expect("a device pool has a copier");
        let base = arena.as_ptr() as u64;
        // (pool offset, length) pieces, gathered back to back into the buffer.
        let pieces =
            [(656 * 64 * 3, 656 * 64), (0, 656 * 5), (8448 * 7 + 16, 8448), (100_003, 777), (300_000, 200_000)];
        let mut at = 0u64;
        let gather: Vec<(u64, u64, u64)> = pieces
            .iter()
            .map(|&(off, len)| {
                let p = (base + off, buf.addr() + at, len);
                at += len;
                p
            })
            .collect();
        unsafe { copier.copy_pieces(&gather) }.unwrap().unwrap();
        let (back, dst0) = read_back(&cache, buf.as_ref(), at);
        let want: Vec<u8> =
            pieces.iter().flat_map(|&(off, len)| bytes[off as usize..(off + len) as usize].to_vec()).collect();
        assert_eq!(back, want);
        let mut after = vec![0u8; arena.len()];
        unsafe { arena.copy_out(0, &mut after) }.unwrap();
        assert_eq!(after[..dst0 as usize], bytes[..dst0 as usize], "nothing else changed");
        assert_eq!(after[(dst0 + at) as usize..], bytes[(dst0 + at) as usize..], "nothing else changed");
    }

    /// Queued copies read their task lists from pinned memory while lists are free; more copies queued at
    /// once than there are lists, and a list longer than one, upload theirs: every path moves exactly its
    /// pieces.
    #[test]
    fn queued_copies_past_the_pinned_lists_move_exactly_their_pieces() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (cache, bytes, buf) = random_pool(&gpu, 11);
        let arena = cache.arena();
        let copier = arena.device_copier().expect("a device pool has a copier");
        let base = arena.as_ptr() as u64;
        let pinned_before = PINNED_LISTS.load(std::sync::atomic::Ordering::Relaxed);
        // TASK_SLOTS + 4 single-piece gathers held queued together, then one of SLOT_TASKS + 900 pieces.
        let (one, small) = (4096u64, 16u64);
        let mut want = Vec::new();
        let mut queued = Vec::new();
        for i in 0..(TASK_SLOTS as u64 + 4) {
            let src = (i * 7919 * 16) % (arena.len() as u64 / 2 - one);
            queued.push(
                unsafe { copier.copy_pieces_queued(&[(base + src, buf.addr() + i * one, one)]) }.unwrap().unwrap(),
            );
            want.extend_from_slice(&bytes[src as usize..(src + one) as usize]);
        }
        let at0 = (TASK_SLOTS as u64 + 4) * one;
        let many: Vec<(u64, u64, u64)> =
            (0..(SLOT_TASKS as u64 + 900)).map(|k| (base + 64 + k * 32, buf.addr() + at0 + k * small, small)).collect();
        queued.push(unsafe { copier.copy_pieces_queued(&many) }.unwrap().unwrap());
        for k in 0..many.len() as u64 {
            let src = (64 + k * 32) as usize;
            want.extend_from_slice(&bytes[src..src + small as usize]);
        }
        // The first TASK_SLOTS found pinned lists (other tests' copies may add to the count).
        let pinned = PINNED_LISTS.load(std::sync::atomic::Ordering::Relaxed) - pinned_before;
        assert!(pinned >= TASK_SLOTS as u64, "{pinned} copies used a pinned list");
        for mut q in queued {
            q.wait().unwrap();
        }
        assert!(read_back(&cache, buf.as_ref(), want.len() as u64).0 == want, "the queued copies moved other bytes");
        // The lists came back: as many copies again find pinned lists and still move their pieces.
        let again: Vec<_> = (0..TASK_SLOTS as u64)
            .map(|i| {
                unsafe { copier.copy_pieces_queued(&[(base + i * one, buf.addr() + i * one, one)]) }.unwrap().unwrap()
            })
            .collect();
        drop(again);
        assert_eq!(read_back(&cache, buf.as_ref(), one).0, bytes[..one as usize]);
    }

    /// UCX moves the pool from its own threads: binding the context there works, and the pool is plain
    /// device memory (not a stream-ordered allocation, which UCX would stage).
    #[test]
    fn the_pool_is_plain_device_memory_bindable_on_any_thread() {
        let Some(gpu) = Gpu::for_test() else { return };
        let g = CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 1, 4);
        let cache = Arc::new(allocate(&gpu, g).unwrap());
        let c = cache.clone();
        std::thread::spawn(move || c.arena().bind_device_thread().unwrap()).join().unwrap();
        let mut pool_attr: u64 = 1;
        // SAFETY: querying a pointer attribute of our own allocation into a u64.
        let r = unsafe {
            cudarc::driver::sys::cuPointerGetAttribute(
                &mut pool_attr as *mut u64 as *mut std::ffi::c_void,
                cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                cache.arena().as_ptr() as u64,
            )
        };
        assert!(r.result().is_ok());
        assert_eq!(pool_attr, 0, "the pool must not come from a stream-ordered memory pool");
    }
}
