//! The pool's memory: one contiguous byte range that the engine writes caches into and kv-transfer
//! registers with UCX (or receives into over TCP). The backend provides it (`engine::Backend::allocate_cache`):
//! a page-aligned, zeroed host allocation on the CPU, device (or pinned host) memory on a GPU. The arena
//! knows which ([`MemoryKind`]); the host accessors refuse device memory with an error. A device arena
//! built with a [`DeviceCopy`] can still be copied to and from host memory ([`KvArena::copy_out`],
//! [`KvArena::copy_in`]): that is how transports stage it through the host.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Alignment of arenas this module allocates (a page, so RDMA registration covers whole pages).
pub const ARENA_ALIGN: usize = 4096;

/// Arenas created in this process: a worker creates its pool once at startup, so this count must not
/// move while it serves (the "nothing allocated per request" invariant its tests check).
static ARENAS_CREATED: AtomicU64 = AtomicU64::new(0);

/// How many arenas this process has created so far.
pub fn arenas_created() -> u64 {
    ARENAS_CREATED.load(Ordering::Relaxed)
}

/// Where an arena's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory (DMA-able by a GPU and RDMA NICs without staging).
    PinnedHost,
    /// Memory of GPU `ordinal`: the host cannot dereference it.
    Device { ordinal: u32 },
}

impl MemoryKind {
    /// Whether the CPU may read and write the bytes through a pointer.
    pub fn host_accessible(self) -> bool {
        !matches!(self, MemoryKind::Device { .. })
    }
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::PinnedHost => f.write_str("pinned host"),
            MemoryKind::Device { ordinal } => write!(f, "device {ordinal}"),
        }
    }
}

/// Copies between an arena in device memory and host memory, for transports that stage through the host.
pub trait DeviceCopy: Send + Sync {
    /// Copies `dst.len()` bytes from `offset` of the arena into `dst`, after all device work queued
    /// before the call (the caller already waited for the layer's `LayerReady`).
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
    /// Copies `src` to `offset` of the arena; the bytes are visible to device work queued after it returns.
    fn write(&self, offset: usize, src: &[u8]) -> Result<(), String>;
    /// Makes the device's context current on the calling thread: for a library that moves the arena's
    /// memory itself from its own threads (UCX's progress threads with a CUDA-capable UCX).
    fn bind_thread(&self) -> Result<(), String> {
        Ok(())
    }
    /// The [`crate::hash`] digest of the arena's `segments` (offset, length) concatenated, computed on the
    /// device after all device work queued before the call; `None` where this device cannot (the caller
    /// then hashes copies read through [`DeviceCopy::read`]).
    fn checksum(&self, _segments: &[(u64, u64)]) -> Option<Result<u64, String>> {
        None
    }
    /// Copies each `(src, dst, len)` between device addresses (the arena and buffers from
    /// [`DeviceCopy::alloc`]) after the device work queued before the call, and returns once the bytes are
    /// in place: how a scattered request is gathered before it is sent and scattered when it lands.
    /// `None` where this device cannot.
    ///
    /// # Safety
    /// Every range lies in the arena or in a live buffer from `alloc`, and no one else accesses the
    /// destination ranges during the call.
    unsafe fn copy_pieces(&self, _pieces: &[(u64, u64, u64)]) -> Option<Result<(), String>> {
        None
    }
    /// As [`DeviceCopy::copy_pieces`], but returns once the copy is queued on the device: the handle says
    /// when the bytes are in place (how a receiver scatters a landed write without holding its UCX
    /// progress thread). By default the copy is `copy_pieces`'s, over when this returns; `None` where
    /// this device cannot copy.
    ///
    /// # Safety
    /// As [`DeviceCopy::copy_pieces`], until the handle reports the copy finished (or is waited on).
    unsafe fn copy_pieces_queued(&self, pieces: &[(u64, u64, u64)]) -> Option<Result<Box<dyn QueuedCopy>, String>> {
        // SAFETY: forwarded contract; the copy is over when it returns.
        let copied = unsafe { self.copy_pieces(pieces) }?;
        Some(copied.map(|()| Box::new(Finished) as Box<dyn QueuedCopy>))
    }
    /// `bytes` of device memory on the arena's device for transports to gather into or land in, freed
    /// when dropped; `None` where this device cannot.
    fn alloc(&self, _bytes: usize) -> Option<Result<Box<dyn DeviceBuffer>, String>> {
        None
    }
    /// Whether the arena is CUDA device memory a CUDA-capable UCX may read and write itself (a plain
    /// `cuMemAlloc` allocation). False for anything else a copier stands for (a simulated device).
    fn cuda_memory(&self) -> bool {
        false
    }
}

/// A copy queued on a device ([`DeviceCopy::copy_pieces_queued`]). Dropping it before it finished waits
/// for it.
pub trait QueuedCopy: Send {
    /// `Some` once the copy finished (or failed), without waiting; `None` while it runs.
    fn poll(&mut self) -> Option<Result<(), String>>;
    /// Waits until the copy finished.
    fn wait(&mut self) -> Result<(), String>;
}

/// A copy that was over before its handle existed (the default [`DeviceCopy::copy_pieces_queued`]).
struct Finished;

impl QueuedCopy for Finished {
    fn poll(&mut self) -> Option<Result<(), String>> {
        Some(Ok(()))
    }

    fn wait(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// The largest message a transport gathers a scattered layer into (kv-transfer's stream writes).
pub const TRANSFER_CHUNK: usize = 32 << 20;
/// Device buffers of [`TRANSFER_CHUNK`] a transport borrows per lane of a device pool (gathering on the
/// sender, landing on the receiver): device memory a backend counts in its budget.
pub const TRANSFER_BUFFERS: usize = 4;

/// Device memory a [`DeviceCopy`] lent a transport ([`DeviceCopy::alloc`]).
pub trait DeviceBuffer: Send + Sync {
    /// The device address of the first byte.
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A contiguous byte range with a stable address for its whole life.
///
/// Access goes through raw-pointer accessors because several parties write it at once (the backend
/// writes layer l + 1 while a transport reads layer l of the same blocks; a transport writes one
/// request's blocks while the backend reads another's). The block allocator is the synchronization:
/// a (layer, block) range is written by the one party that owns that block for that phase.
pub struct KvArena {
    ptr: NonNull<u8>,
    len: usize,
    kind: MemoryKind,
    owner: Owner,
    /// How the host reaches a device arena (`None`: it cannot).
    copier: Option<Arc<dyn DeviceCopy>>,
}

enum Owner {
    /// Allocated here with this layout.
    Host(Layout),
    /// Provided by the caller; dropped (and so freed) with the arena.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

// SAFETY: the arena is plain memory; concurrent access discipline is documented on the type and on
// every accessor.
unsafe impl Send for KvArena {}
unsafe impl Sync for KvArena {}

#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("cannot allocate a {0}-byte cache arena")]
    OutOfMemory(usize),
    #[error("cache arena access {offset}+{len} is outside the {size}-byte arena")]
    OutOfRange { offset: usize, len: usize, size: usize },
    #[error("the cache arena is in {0} memory, which the host cannot access")]
    NotHostAccessible(MemoryKind),
    /// The backend's [`DeviceCopy`] failed.
    #[error("copying {len} bytes at offset {offset} of the cache arena in {kind} memory: {reason}")]
    DeviceCopy { kind: MemoryKind, offset: usize, len: usize, reason: String },
}

impl KvArena {
    /// A zeroed, page-aligned host allocation of `len` bytes.
    pub fn new_host(len: usize) -> Result<Self, ArenaError> {
        let layout = Layout::from_size_align(len.max(1), ARENA_ALIGN).map_err(|_| ArenaError::OutOfMemory(len))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(ArenaError::OutOfMemory(len))?;
        ARENAS_CREATED.fetch_add(1, Ordering::Relaxed);
        Ok(KvArena { ptr, len, kind: MemoryKind::Host, owner: Owner::Host(layout), copier: None })
    }

    /// Wraps memory a backend or caller owns (pinned host memory, device memory, a registered region).
    /// Device memory wrapped here has no [`DeviceCopy`], so nothing on the host can reach it (transports
    /// refuse it); [`KvArena::from_device`] adds one.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid memory of `kind` for as long as `owner` lives, and `owner` must be
    /// what keeps it alive (it is dropped with the arena).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        kind: MemoryKind,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        ARENAS_CREATED.fetch_add(1, Ordering::Relaxed);
        KvArena { ptr, len, kind, owner: Owner::External(owner), copier: None }
    }

    /// Device memory at `ptr` (not dereferenceable here) that `copier` reads and writes; `owner` keeps it alive.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be memory of GPU `ordinal` for as long as `owner` lives, `owner` must be what
    /// keeps it alive, and `copier` must copy exactly the requested `offset..offset+len` of it.
    pub unsafe fn from_device(
        ptr: NonNull<u8>,
        len: usize,
        ordinal: u32,
        owner: Box<dyn Any + Send + Sync>,
        copier: Arc<dyn DeviceCopy>,
    ) -> Self {
        ARENAS_CREATED.fetch_add(1, Ordering::Relaxed);
        KvArena { ptr, len, kind: MemoryKind::Device { ordinal }, owner: Owner::External(owner), copier: Some(copier) }
    }

    #[inline]
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Ok when the host may dereference the arena's bytes.
    pub fn check_host(&self) -> Result<(), ArenaError> {
        if self.kind.host_accessible() { Ok(()) } else { Err(ArenaError::NotHostAccessible(self.kind)) }
    }

    /// Whether the host reaches the bytes only through copies (a device arena with a [`DeviceCopy`]).
    pub fn stages_through_host(&self) -> bool {
        !self.kind.host_accessible() && self.copier.is_some()
    }

    /// Copies `offset..offset+dst.len()` into `dst`: a `memcpy` for host kinds, the [`DeviceCopy`] for
    /// device memory (an error for a device arena without one).
    ///
    /// # Safety
    /// No one may write the range during the call: for host kinds a racing writer is a data race, as for
    /// [`KvArena::slice`]. For device memory a race garbles the bytes rather than this process, but the
    /// same discipline (block ownership, `LayerReady`) is what makes them meaningful.
    pub unsafe fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Result<(), ArenaError> {
        self.check(offset, dst.len())?;
        if self.kind.host_accessible() {
            // SAFETY: host memory, in range (checked); absence of writers is the caller's contract.
            dst.copy_from_slice(unsafe { self.host_slice(offset, dst.len()) });
            return Ok(());
        }
        let copier = self.copier.as_ref().ok_or(ArenaError::NotHostAccessible(self.kind))?;
        copier.read(offset, dst).map_err(|reason| self.copy_error(offset, dst.len(), reason))
    }

    /// Copies `src` to `offset..offset+src.len()`: a `memcpy` for host kinds, the [`DeviceCopy`] for
    /// device memory (an error for a device arena without one).
    ///
    /// # Safety
    /// The caller must be the only one accessing the range during the call (as for
    /// [`KvArena::slice_mut`]; see [`KvArena::copy_out`] for device memory).
    pub unsafe fn copy_in(&self, offset: usize, src: &[u8]) -> Result<(), ArenaError> {
        self.check(offset, src.len())?;
        if self.kind.host_accessible() {
            // SAFETY: host memory, in range (checked); exclusivity is the caller's contract.
            unsafe { self.host_slice_mut(offset, src.len()) }.copy_from_slice(src);
            return Ok(());
        }
        let copier = self.copier.as_ref().ok_or(ArenaError::NotHostAccessible(self.kind))?;
        copier.write(offset, src).map_err(|reason| self.copy_error(offset, src.len(), reason))
    }

    /// Makes a device arena's context current on the calling thread ([`DeviceCopy::bind_thread`]); nothing
    /// to do for host memory.
    pub fn bind_device_thread(&self) -> Result<(), ArenaError> {
        match &self.copier {
            Some(c) if !self.kind.host_accessible() => c.bind_thread().map_err(|reason| self.copy_error(0, 0, reason)),
            _ => Ok(()),
        }
    }

    /// The [`crate::hash`] digest of `segments` computed on the device ([`DeviceCopy::checksum`]); `None`
    /// for host memory or where the device cannot (hash the bytes on the host then).
    pub fn device_checksum(&self, segments: &[(u64, u64)]) -> Option<Result<u64, ArenaError>> {
        if self.kind.host_accessible() {
            return None;
        }
        if let Some(&(off, len)) =
            segments.iter().find(|(off, len)| off.checked_add(*len).is_none_or(|end| end > self.len as u64))
        {
            return Some(Err(ArenaError::OutOfRange { offset: off as usize, len: len as usize, size: self.len }));
        }
        let copier = self.copier.as_ref()?;
        Some(copier.checksum(segments)?.map_err(|reason| self.copy_error(0, 0, reason)))
    }

    /// Whether the arena is CUDA memory a CUDA-capable UCX moves itself ([`DeviceCopy::cuda_memory`]).
    pub fn cuda_memory(&self) -> bool {
        self.device_copier().is_some_and(|c| c.cuda_memory())
    }

    /// The arena's [`DeviceCopy`] where it is device memory (for device-side gathers, scatters and buffers).
    pub fn device_copier(&self) -> Option<&Arc<dyn DeviceCopy>> {
        self.copier.as_ref().filter(|_| !self.kind.host_accessible())
    }

    fn copy_error(&self, offset: usize, len: usize, reason: String) -> ArenaError {
        ArenaError::DeviceCopy { kind: self.kind, offset, len, reason }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address, for memory registration and remote addressing.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn check(&self, offset: usize, len: usize) -> Result<(), ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ArenaError::OutOfRange { offset, len, size: self.len }),
        }
    }

    /// Reads `offset..offset+len` of a host-accessible arena.
    ///
    /// # Safety
    /// No one may write the range while the returned slice lives.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> Result<&[u8], ArenaError> {
        self.check_host()?;
        self.check(offset, len)?;
        // SAFETY: host memory, in range (checked); absence of writers is the caller's contract.
        Ok(unsafe { self.host_slice(offset, len) })
    }

    /// Writes `offset..offset+len` of a host-accessible arena.
    ///
    /// # Safety
    /// The caller must be the only one accessing the range while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], ArenaError> {
        self.check_host()?;
        self.check(offset, len)?;
        // SAFETY: host memory, in range (checked); exclusivity is the caller's contract.
        Ok(unsafe { self.host_slice_mut(offset, len) })
    }

    /// # Safety
    /// `check_host` passed for this arena (a [`super::HostCache`] proves it); no concurrent writer.
    #[inline]
    pub(super) unsafe fn host_slice(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(self.kind.host_accessible());
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "arena read out of range");
        // SAFETY: in range (asserted), host memory (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// # Safety
    /// As `host_slice`, and the caller is the only one accessing the range.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub(super) unsafe fn host_slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(self.kind.host_accessible());
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "arena write out of range");
        // SAFETY: in range (asserted), host memory and exclusivity (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for KvArena {
    fn drop(&mut self) {
        if let Owner::Host(layout) = self.owner {
            // SAFETY: allocated in new_host with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("staged", &self.stages_through_host())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_arena_is_zeroed_and_page_aligned() {
        let a = KvArena::new_host(10_000).unwrap();
        assert_eq!(a.as_ptr() as usize % ARENA_ALIGN, 0);
        assert_eq!(a.kind(), MemoryKind::Host);
        assert!(unsafe { a.slice(0, 10_000) }.unwrap().iter().all(|&b| b == 0));
        assert!(a.check(9_999, 1).is_ok());
        assert!(a.check(9_999, 2).is_err());
        assert!(a.check(usize::MAX, 2).is_err());
    }

    #[test]
    fn external_memory_is_kept_alive_by_its_owner() {
        let mut buf = vec![7u8; 256].into_boxed_slice();
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        let arena = unsafe { KvArena::from_raw_parts(ptr, 256, MemoryKind::PinnedHost, Box::new(buf)) };
        unsafe { arena.slice_mut(10, 2) }.unwrap().copy_from_slice(&[1, 2]);
        assert_eq!(unsafe { arena.slice(9, 4) }.unwrap(), &[7, 1, 2, 7]);
        assert!(matches!(unsafe { arena.slice(250, 7) }, Err(ArenaError::OutOfRange { .. })));
    }

    #[test]
    fn host_accessors_refuse_device_memory() {
        // A stand-in pointer that is never dereferenced: the accessors must refuse before touching it.
        let arena = unsafe {
            KvArena::from_raw_parts(NonNull::dangling(), 1 << 20, MemoryKind::Device { ordinal: 3 }, Box::new(()))
        };
        assert!(!arena.kind().host_accessible());
        let e = unsafe { arena.slice(0, 16) }.unwrap_err();
        assert!(matches!(e, ArenaError::NotHostAccessible(MemoryKind::Device { ordinal: 3 })), "{e}");
        assert!(e.to_string().contains("device 3"), "{e}");
        assert!(unsafe { arena.slice_mut(0, 16) }.is_err());
    }

    /// A device stand-in: the bytes live in a private buffer only the copier reaches.
    struct FakeDevice {
        mem: std::sync::Mutex<Vec<u8>>,
        fail: bool,
    }

    impl DeviceCopy for FakeDevice {
        fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
            if self.fail {
                return Err("device lost".into());
            }
            dst.copy_from_slice(&self.mem.lock().unwrap()[offset..offset + dst.len()]);
            Ok(())
        }
        fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
            if self.fail {
                return Err("device lost".into());
            }
            self.mem.lock().unwrap()[offset..offset + src.len()].copy_from_slice(src);
            Ok(())
        }
    }

    fn device_arena(len: usize, fail: bool) -> (KvArena, Arc<FakeDevice>) {
        let dev = Arc::new(FakeDevice { mem: std::sync::Mutex::new(vec![0; len]), fail });
        // A stand-in pointer that is never dereferenced: every access goes through the copier.
        let arena = unsafe { KvArena::from_device(NonNull::dangling(), len, 0, Box::new(()), dev.clone()) };
        (arena, dev)
    }

    #[test]
    fn a_device_arena_is_reached_only_through_its_copier() {
        let (arena, dev) = device_arena(1024, false);
        assert_eq!(arena.kind(), MemoryKind::Device { ordinal: 0 });
        assert!(arena.stages_through_host());
        assert!(unsafe { arena.slice(0, 16) }.is_err(), "host accessors still refuse device memory");
        unsafe { arena.copy_in(100, &[1, 2, 3]) }.unwrap();
        assert_eq!(&dev.mem.lock().unwrap()[99..104], &[0, 1, 2, 3, 0]);
        let mut out = [9u8; 5];
        unsafe { arena.copy_out(99, &mut out) }.unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0]);
        let e = unsafe { arena.copy_out(1020, &mut out) }.unwrap_err();
        assert!(matches!(e, ArenaError::OutOfRange { offset: 1020, len: 5, size: 1024 }), "checked before the copier");
    }

    #[test]
    fn copier_failures_and_missing_copiers_are_errors_that_name_the_memory() {
        let (arena, _) = device_arena(64, true);
        let e = unsafe { arena.copy_in(8, &[1; 8]) }.unwrap_err();
        assert!(matches!(&e, ArenaError::DeviceCopy { offset: 8, len: 8, .. }), "{e}");
        assert!(e.to_string().contains("device 0") && e.to_string().contains("device lost"), "{e}");
        let raw = unsafe {
            KvArena::from_raw_parts(NonNull::dangling(), 64, MemoryKind::Device { ordinal: 2 }, Box::new(()))
        };
        assert!(!raw.stages_through_host());
        let e = unsafe { raw.copy_out(0, &mut [0; 4]) }.unwrap_err();
        assert!(matches!(e, ArenaError::NotHostAccessible(MemoryKind::Device { ordinal: 2 })), "{e}");
    }

    #[test]
    fn host_arenas_copy_with_memcpy() {
        let a = KvArena::new_host(64).unwrap();
        assert!(!a.stages_through_host());
        unsafe { a.copy_in(60, &[4, 5, 6, 7]) }.unwrap();
        let mut out = [0u8; 4];
        unsafe { a.copy_out(60, &mut out) }.unwrap();
        assert_eq!(out, [4, 5, 6, 7]);
        assert!(unsafe { a.copy_in(61, &[0; 4]) }.is_err());
    }

    #[test]
    fn every_arena_is_counted() {
        let before = arenas_created();
        let _a = KvArena::new_host(64).unwrap();
        assert!(arenas_created() > before);
    }
}
