//! The pool's memory: one contiguous byte range that the engine writes caches into and kv-transfer
//! registers with UCX (or receives into over TCP). The caller may provide it (pinned or device memory,
//! a region registered elsewhere); otherwise it is a page-aligned, zeroed host allocation.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::any::Any;
use std::ptr::NonNull;

/// Alignment of arenas this module allocates (a page, so RDMA registration covers whole pages).
pub const ARENA_ALIGN: usize = 4096;

/// A contiguous byte range with a stable address for its whole life.
///
/// Access goes through raw-pointer accessors because several parties write it at once (the backend
/// writes layer l + 1 while a transport reads layer l of the same blocks; a transport writes one
/// request's blocks while the backend reads another's). The block allocator is the synchronization:
/// a (layer, block) range is written by the one party that owns that block for that phase.
pub struct KvArena {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
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
}

impl KvArena {
    /// A zeroed, page-aligned host allocation of `len` bytes.
    pub fn new_host(len: usize) -> Result<Self, ArenaError> {
        let layout = Layout::from_size_align(len.max(1), ARENA_ALIGN).map_err(|_| ArenaError::OutOfMemory(len))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(ArenaError::OutOfMemory(len))?;
        Ok(KvArena { ptr, len, owner: Owner::Host(layout) })
    }

    /// Wraps memory the caller owns (e.g. registered or device memory).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as `owner` lives, and `owner` must be
    /// what keeps it alive (it is dropped with the arena).
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        KvArena { ptr, len, owner: Owner::External(owner) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address, for memory registration and remote addressing.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn check(&self, offset: usize, len: usize) -> Result<(), ArenaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ArenaError::OutOfRange { offset, len, size: self.len }),
        }
    }

    /// Reads `offset..offset+len`.
    ///
    /// # Safety
    /// No one may write the range while the returned slice lives.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "arena read out of range");
        // SAFETY: in range (asserted); absence of writers is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// Writes `offset..offset+len`.
    ///
    /// # Safety
    /// The caller must be the only one accessing the range while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len), "arena write out of range");
        // SAFETY: in range (asserted); exclusivity is the caller's contract.
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
        f.debug_struct("KvArena").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_arena_is_zeroed_and_page_aligned() {
        let a = KvArena::new_host(10_000).unwrap();
        assert_eq!(a.as_ptr() as usize % ARENA_ALIGN, 0);
        assert!(unsafe { a.slice(0, 10_000) }.iter().all(|&b| b == 0));
        assert!(a.check(9_999, 1).is_ok());
        assert!(a.check(9_999, 2).is_err());
        assert!(a.check(usize::MAX, 2).is_err());
    }

    #[test]
    fn external_memory_is_kept_alive_by_its_owner() {
        let mut buf = vec![7u8; 256].into_boxed_slice();
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        let arena = unsafe { KvArena::from_raw_parts(ptr, 256, Box::new(buf)) };
        unsafe { arena.slice_mut(10, 2) }.copy_from_slice(&[1, 2]);
        assert_eq!(unsafe { arena.slice(9, 4) }, &[7, 1, 2, 7]);
    }
}
