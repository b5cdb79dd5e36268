//! Paged caches, shared by the engine and kv-transfer (which therefore does not compile the model):
//! the FP8 and f32 entry formats ([`format`], with the e4m3 numerics of [`fp8`]), the memory they live
//! in ([`arena`]), the block allocator ([`allocator`]), per-request block tables ([`pool`]) and the
//! completion marker of a layer's cache writes ([`ready`]). The engine re-exports this crate as
//! `engine::cache`.

pub mod allocator;
pub mod arena;
pub mod format;
pub mod fp8;
pub mod hash;
pub mod pool;
pub mod ready;

pub use allocator::{AllocError, BlockAllocator, BlockRun, BlockTable, runs_of};
pub use arena::{
    ArenaError, DeviceBuffer, DeviceCopy, KvArena, MemoryKind, QueuedCopy, TRANSFER_BUFFERS, TRANSFER_CHUNK,
    arenas_created,
};
pub use format::{BLOCK_SIZE, BlockId, CacheFormat, CacheGeometry, EntryDims, LayerIdx};
pub use pool::{BlockPool, PoolError, PoolStats};
pub use ready::{Fence, FenceError, LayerReady};

/// A pool's memory with its geometry: where each layer's latent entries and indexer blocks live.
/// The host reads and writes entries through [`KvCache::host`], which refuses device memory; a device
/// pool built with [`KvArena::from_device`] is copied in and out through its [`DeviceCopy`].
#[derive(Debug)]
pub struct KvCache {
    geometry: CacheGeometry,
    arena: KvArena,
}

impl KvCache {
    /// A zeroed host pool for `geometry`.
    pub fn new_host(geometry: CacheGeometry) -> Result<Self, ArenaError> {
        Ok(KvCache { arena: KvArena::new_host(geometry.total_bytes())?, geometry })
    }

    /// A pool over caller-provided memory (at least `geometry.total_bytes()` long).
    pub fn with_arena(geometry: CacheGeometry, arena: KvArena) -> Result<Self, ArenaError> {
        arena.check(0, geometry.total_bytes())?;
        Ok(KvCache { geometry, arena })
    }

    #[inline]
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    pub fn arena(&self) -> &KvArena {
        &self.arena
    }

    /// Where the pool's bytes live.
    pub fn memory_kind(&self) -> MemoryKind {
        self.arena.kind()
    }

    /// Whether transports reach the pool only through [`KvArena::copy_out`] / [`KvArena::copy_in`] (device
    /// memory with a [`DeviceCopy`]), staging it through host memory.
    pub fn stages_through_host(&self) -> bool {
        self.arena.stages_through_host()
    }

    /// Entry accessors for a pool the host can dereference; an error for device memory.
    #[inline]
    pub fn host(&self) -> Result<HostCache<'_>, ArenaError> {
        self.arena.check_host()?;
        Ok(HostCache { cache: self })
    }
}

/// A host-accessible pool: holding one proves the arena is host (or pinned host) memory.
///
/// Accessors are `unsafe` because the arena is shared: writers must own the (layer, block) range they
/// write (the block allocator hands each block to one request; within a request, each layer is written
/// by one party), and readers must not overlap a writer.
#[derive(Debug, Clone, Copy)]
pub struct HostCache<'a> {
    cache: &'a KvCache,
}

impl<'a> HostCache<'a> {
    #[inline]
    pub fn geometry(&self) -> &'a CacheGeometry {
        &self.cache.geometry
    }

    #[inline]
    fn latent_range(&self, layer: LayerIdx, block: BlockId, slot: usize) -> (usize, usize) {
        let g = self.geometry();
        assert!(layer.index() < g.num_layers, "layer {} out of range", layer.0);
        assert!(block.index() < g.num_blocks, "block {} out of range", block.0);
        assert!(slot < BLOCK_SIZE);
        let per = g.latent_bytes_per_token();
        (g.latent_block_offset(layer, block) + slot * per, per)
    }

    #[inline]
    fn indexer_range(&self, layer: LayerIdx, block: BlockId) -> (usize, usize) {
        let g = self.geometry();
        assert!(layer.index() < g.num_layers, "layer {} out of range", layer.0);
        assert!(block.index() < g.num_blocks, "block {} out of range", block.0);
        (g.indexer_block_offset(layer, block), g.indexer_bytes_per_block())
    }

    /// One token's latent entry.
    ///
    /// # Safety
    /// No concurrent writer of this entry (see the type's docs).
    #[inline]
    pub unsafe fn latent_entry(&self, layer: LayerIdx, block: BlockId, slot: usize) -> &'a [u8] {
        let (o, n) = self.latent_range(layer, block, slot);
        // SAFETY: host memory (this type's invariant); the rest is the forwarded contract.
        unsafe { self.cache.arena.host_slice(o, n) }
    }

    /// # Safety
    /// The caller owns this entry for writing (see the type's docs).
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn latent_entry_mut(&self, layer: LayerIdx, block: BlockId, slot: usize) -> &'a mut [u8] {
        let (o, n) = self.latent_range(layer, block, slot);
        // SAFETY: host memory (this type's invariant); the rest is the forwarded contract.
        unsafe { self.cache.arena.host_slice_mut(o, n) }
    }

    /// One block of indexer keys.
    ///
    /// # Safety
    /// No concurrent writer of this block (see the type's docs).
    #[inline]
    pub unsafe fn indexer_block(&self, layer: LayerIdx, block: BlockId) -> &'a [u8] {
        let (o, n) = self.indexer_range(layer, block);
        // SAFETY: host memory (this type's invariant); the rest is the forwarded contract.
        unsafe { self.cache.arena.host_slice(o, n) }
    }

    /// # Safety
    /// The caller owns this block for writing (see the type's docs).
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn indexer_block_mut(&self, layer: LayerIdx, block: BlockId) -> &'a mut [u8] {
        let (o, n) = self.indexer_range(layer, block);
        // SAFETY: host memory (this type's invariant); the rest is the forwarded contract.
        unsafe { self.cache.arena.host_slice_mut(o, n) }
    }
}
