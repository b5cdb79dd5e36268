//! Per-request block tables over the allocator, shared by whoever serves requests (thread-safe).
//! Every block a request holds is released exactly once, on finish or abort; `stats` is the accounting
//! that tests and metrics use to prove nothing leaked.

use std::collections::HashMap;
use std::sync::Mutex;

use super::allocator::{AllocError, BlockAllocator, BlockTable};
use super::format::{BlockId, CacheGeometry};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("request {0} already holds cache blocks")]
    DuplicateRequest(String),
    #[error("request {0} holds no cache blocks")]
    UnknownRequest(String),
}

/// Pool occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PoolStats {
    pub total_blocks: usize,
    pub free_blocks: usize,
    pub used_blocks: usize,
    /// Requests holding blocks.
    pub requests: usize,
}

#[derive(Debug)]
struct Inner {
    alloc: BlockAllocator,
    tables: HashMap<String, BlockTable>,
}

#[derive(Debug)]
pub struct BlockPool {
    inner: Mutex<Inner>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        BlockPool { inner: Mutex::new(Inner { alloc: BlockAllocator::new(num_blocks), tables: HashMap::new() }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the allocator half-updated (its methods are
        // all-or-nothing), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves blocks for `tokens` tokens of a new request.
    pub fn reserve(&self, request_id: &str, tokens: usize) -> Result<BlockTable, PoolError> {
        self.reserve_with_prefix(request_id, &[], tokens)
    }

    /// Reserves blocks for a new request whose first blocks are `shared` (prefix-cache hits, which gain a
    /// reference) and the rest fresh.
    pub fn reserve_with_prefix(
        &self,
        request_id: &str,
        shared: &[BlockId],
        tokens: usize,
    ) -> Result<BlockTable, PoolError> {
        let mut g = self.lock();
        if g.tables.contains_key(request_id) {
            return Err(PoolError::DuplicateRequest(request_id.to_string()));
        }
        let needed = CacheGeometry::blocks_for(tokens).max(shared.len());
        let fresh = g.alloc.allocate(needed - shared.len())?;
        if let Err(e) = g.alloc.retain(shared) {
            g.alloc.release(&fresh).expect("just allocated");
            return Err(e.into());
        }
        let mut blocks = shared.to_vec();
        blocks.extend(fresh);
        let table = BlockTable::new(blocks);
        g.tables.insert(request_id.to_string(), table.clone());
        Ok(table)
    }

    /// Grows a request's table to hold `tokens` tokens (no-op when it already does).
    pub fn grow(&self, request_id: &str, tokens: usize) -> Result<BlockTable, PoolError> {
        let mut g = self.lock();
        let have = g.tables.get(request_id).ok_or_else(|| PoolError::UnknownRequest(request_id.to_string()))?.len();
        let needed = CacheGeometry::blocks_for(tokens);
        if needed > have {
            let more = g.alloc.allocate(needed - have)?;
            g.tables.get_mut(request_id).expect("checked above").blocks.extend(more);
        }
        Ok(g.tables[request_id].clone())
    }

    /// Releases every block of the request; returns how many returned to the free pool.
    pub fn release(&self, request_id: &str) -> Result<usize, PoolError> {
        let mut g = self.lock();
        let table = g.tables.remove(request_id).ok_or_else(|| PoolError::UnknownRequest(request_id.to_string()))?;
        Ok(g.alloc.release(&table.blocks)?)
    }

    pub fn table(&self, request_id: &str) -> Option<BlockTable> {
        self.lock().tables.get(request_id).cloned()
    }

    pub fn holds(&self, request_id: &str) -> bool {
        self.lock().tables.contains_key(request_id)
    }

    /// Adds references to blocks outside any request (the prefix cache's own hold).
    pub fn retain_blocks(&self, blocks: &[BlockId]) -> Result<(), PoolError> {
        Ok(self.lock().alloc.retain(blocks)?)
    }

    /// Drops references taken with `retain_blocks`.
    pub fn release_blocks(&self, blocks: &[BlockId]) -> Result<usize, PoolError> {
        Ok(self.lock().alloc.release(blocks)?)
    }

    pub fn stats(&self) -> PoolStats {
        let g = self.lock();
        PoolStats {
            total_blocks: g.alloc.num_blocks(),
            free_blocks: g.alloc.free_blocks(),
            used_blocks: g.alloc.used_blocks(),
            requests: g.tables.len(),
        }
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().alloc.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_and_release_account_for_every_block() {
        let pool = BlockPool::new(20);
        let t = pool.reserve("a", 130).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(pool.reserve("a", 1).unwrap_err(), PoolError::DuplicateRequest("a".into()));
        pool.reserve("b", 64).unwrap();
        assert_eq!(pool.stats(), PoolStats { total_blocks: 20, free_blocks: 16, used_blocks: 4, requests: 2 });
        assert_eq!(pool.release("a").unwrap(), 3);
        assert_eq!(pool.release("a").unwrap_err(), PoolError::UnknownRequest("a".into()));
        pool.release("b").unwrap();
        assert_eq!(pool.stats().free_blocks, 20);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_reservation_holds_nothing() {
        let pool = BlockPool::new(4);
        let e = pool.reserve("big", 5 * 64).unwrap_err();
        assert!(matches!(e, PoolError::Alloc(AllocError::OutOfBlocks { needed: 5, free: 4, .. })));
        assert_eq!(pool.stats().free_blocks, 4);
        assert!(!pool.holds("big"));
    }

    #[test]
    fn grow_extends_and_abort_frees_everything() {
        let pool = BlockPool::new(10);
        pool.reserve("r", 10).unwrap();
        assert_eq!(pool.grow("r", 64).unwrap().len(), 1);
        assert_eq!(pool.grow("r", 65).unwrap().len(), 2);
        assert!(pool.grow("r", 64 * 11).is_err());
        assert_eq!(pool.table("r").unwrap().len(), 2, "a failed grow keeps the table");
        pool.release("r").unwrap();
        assert_eq!(pool.stats().used_blocks, 0);
    }

    #[test]
    fn shared_prefix_blocks_outlive_the_first_request() {
        let pool = BlockPool::new(10);
        let a = pool.reserve("a", 128).unwrap();
        pool.retain_blocks(&a.blocks[..1]).unwrap(); // the prefix cache keeps block 0
        let b = pool.reserve_with_prefix("b", &a.blocks[..1], 100).unwrap();
        assert_eq!(b.blocks[0], a.blocks[0]);
        assert_eq!(b.len(), 2);
        pool.release("a").unwrap();
        pool.release("b").unwrap();
        assert_eq!(pool.stats().used_blocks, 1, "the cache's reference remains");
        pool.release_blocks(&a.blocks[..1]).unwrap();
        assert_eq!(pool.stats().used_blocks, 0);
        pool.check_invariants().unwrap();
    }
}
