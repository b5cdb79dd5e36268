//! Paged caches: the FP8 and f32 entry formats ([`format`]), the memory they live in ([`arena`]), the
//! block allocator ([`allocator`]) and per-request block tables ([`pool`]).

pub mod allocator;
pub mod arena;
pub mod format;
pub mod pool;

pub use allocator::{AllocError, BlockAllocator, BlockRun, BlockTable, runs_of};
pub use arena::{ArenaError, KvArena};
pub use format::{BLOCK_SIZE, BlockId, CacheFormat, CacheGeometry, EntryDims, LayerIdx};
pub use pool::{BlockPool, PoolError, PoolStats};

/// A pool's memory with its geometry: where each layer's latent entries and indexer blocks live.
///
/// Accessors are `unsafe` because the arena is shared: writers must own the (layer, block) range they
/// write (the block allocator hands each block to one request; within a request, each layer is written
/// by one party), and readers must not overlap a writer.
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

    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    pub fn arena(&self) -> &KvArena {
        &self.arena
    }

    fn latent_range(&self, layer: LayerIdx, block: BlockId, slot: usize) -> (usize, usize) {
        assert!(layer.index() < self.geometry.num_layers, "layer {} out of range", layer.0);
        assert!(block.index() < self.geometry.num_blocks, "block {} out of range", block.0);
        assert!(slot < BLOCK_SIZE);
        let per = self.geometry.latent_bytes_per_token();
        (self.geometry.latent_block_offset(layer, block) + slot * per, per)
    }

    fn indexer_range(&self, layer: LayerIdx, block: BlockId) -> (usize, usize) {
        assert!(layer.index() < self.geometry.num_layers, "layer {} out of range", layer.0);
        assert!(block.index() < self.geometry.num_blocks, "block {} out of range", block.0);
        (self.geometry.indexer_block_offset(layer, block), self.geometry.indexer_bytes_per_block())
    }

    /// One token's latent entry.
    ///
    /// # Safety
    /// No concurrent writer of this entry (see the type's docs).
    pub unsafe fn latent_entry(&self, layer: LayerIdx, block: BlockId, slot: usize) -> &[u8] {
        let (o, n) = self.latent_range(layer, block, slot);
        // SAFETY: forwarded contract.
        unsafe { self.arena.slice(o, n) }
    }

    /// # Safety
    /// The caller owns this entry for writing (see the type's docs).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn latent_entry_mut(&self, layer: LayerIdx, block: BlockId, slot: usize) -> &mut [u8] {
        let (o, n) = self.latent_range(layer, block, slot);
        // SAFETY: forwarded contract.
        unsafe { self.arena.slice_mut(o, n) }
    }

    /// One block of indexer keys.
    ///
    /// # Safety
    /// No concurrent writer of this block (see the type's docs).
    pub unsafe fn indexer_block(&self, layer: LayerIdx, block: BlockId) -> &[u8] {
        let (o, n) = self.indexer_range(layer, block);
        // SAFETY: forwarded contract.
        unsafe { self.arena.slice(o, n) }
    }

    /// # Safety
    /// The caller owns this block for writing (see the type's docs).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn indexer_block_mut(&self, layer: LayerIdx, block: BlockId) -> &mut [u8] {
        let (o, n) = self.indexer_range(layer, block);
        // SAFETY: forwarded contract.
        unsafe { self.arena.slice_mut(o, n) }
    }
}
