//! The block allocator: hands out cache blocks as few contiguous runs as it can (so shipping a request is a
//! few large puts, not thousands of small ones), with reference counts for blocks shared through the
//! prefix cache. Free space is kept as coalesced runs indexed by start and by length.

use std::collections::{BTreeMap, BTreeSet};

use super::format::{BLOCK_SIZE, BlockId};

/// Consecutive block ids `start .. start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    pub start: BlockId,
    pub len: u32,
}

impl BlockRun {
    pub fn end(&self) -> u32 {
        self.start.0 + self.len
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("out of cache blocks: {needed} needed, {free} free of {total}")]
    OutOfBlocks { needed: usize, free: usize, total: usize },
    #[error("block {0} is not allocated (double free?)")]
    NotAllocated(u32),
    #[error("block {0} is outside the pool of {1} blocks")]
    OutOfRange(u32, usize),
}

#[derive(Debug)]
pub struct BlockAllocator {
    refcounts: Vec<u32>,
    /// Free runs: start -> len.
    by_start: BTreeMap<u32, u32>,
    /// Free runs: (len, start), for best-fit.
    by_len: BTreeSet<(u32, u32)>,
    free: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks <= u32::MAX as usize, "block ids are u32");
        let mut a = BlockAllocator {
            refcounts: vec![0; num_blocks],
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free: 0,
        };
        if num_blocks > 0 {
            a.insert_run(0, num_blocks as u32);
        }
        a.free = num_blocks;
        a
    }

    pub fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.free
    }

    pub fn used_blocks(&self) -> usize {
        self.num_blocks() - self.free
    }

    /// Number of free runs (fragmentation indicator).
    pub fn free_runs(&self) -> usize {
        self.by_start.len()
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts.get(block.index()).copied().unwrap_or(0)
    }

    fn insert_run(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn remove_run(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
    }

    /// Allocates `n` blocks (refcount 1), all or nothing. Prefers the smallest single free run that fits;
    /// otherwise takes the largest runs first, so the result has as few runs as possible.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, AllocError> {
        if n > self.free {
            return Err(AllocError::OutOfBlocks { needed: n, free: self.free, total: self.num_blocks() });
        }
        let mut out = Vec::with_capacity(n);
        let mut left = n as u32;
        while left > 0 {
            let (len, start) = match self.by_len.range((left, 0)..).next() {
                Some(&fit) => fit,
                None => *self.by_len.iter().next_back().expect("free count says a run exists"),
            };
            let take = len.min(left);
            self.remove_run(start, len);
            if take < len {
                self.insert_run(start + take, len - take);
            }
            for b in start..start + take {
                self.refcounts[b as usize] = 1;
                out.push(BlockId(b));
            }
            left -= take;
        }
        self.free -= n;
        Ok(out)
    }

    /// Adds a reference to allocated blocks (a second request sharing a cached prefix).
    pub fn retain(&mut self, blocks: &[BlockId]) -> Result<(), AllocError> {
        for &b in blocks {
            self.check_allocated(b)?;
        }
        for &b in blocks {
            self.refcounts[b.index()] += 1;
        }
        Ok(())
    }

    fn check_allocated(&self, b: BlockId) -> Result<(), AllocError> {
        match self.refcounts.get(b.index()) {
            None => Err(AllocError::OutOfRange(b.0, self.num_blocks())),
            Some(0) => Err(AllocError::NotAllocated(b.0)),
            Some(_) => Ok(()),
        }
    }

    /// Drops one reference from each block; blocks reaching zero return to the free runs. All or nothing:
    /// a block that is not allocated (counting repeats in `blocks`) fails the call and changes nothing.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<usize, AllocError> {
        let mut pending: BTreeMap<u32, u32> = BTreeMap::new();
        for &b in blocks {
            self.check_allocated(b)?;
            let drops = pending.entry(b.0).or_insert(0);
            *drops += 1;
            if *drops > self.refcounts[b.index()] {
                return Err(AllocError::NotAllocated(b.0));
            }
        }
        let mut freed = 0;
        for (b, drops) in pending {
            let rc = &mut self.refcounts[b as usize];
            *rc -= drops;
            if *rc == 0 {
                self.free_one(b);
                freed += 1;
            }
        }
        self.free += freed;
        Ok(freed)
    }

    fn free_one(&mut self, b: u32) {
        let mut start = b;
        let mut len = 1;
        if let Some((&ps, &pl)) = self.by_start.range(..b).next_back()
            && ps + pl == b
        {
            self.remove_run(ps, pl);
            start = ps;
            len += pl;
        }
        if let Some(&nl) = self.by_start.get(&(b + 1)) {
            self.remove_run(b + 1, nl);
            len += nl;
        }
        self.insert_run(start, len);
    }

    /// Checks the internal invariants (tests and debug assertions).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut counted = 0usize;
        let mut prev_end: Option<u32> = None;
        for (&s, &l) in &self.by_start {
            if l == 0 {
                return Err(format!("empty run at {s}"));
            }
            if let Some(pe) = prev_end
                && s <= pe
            {
                return Err(format!("run at {s} overlaps or touches the previous one (uncoalesced)"));
            }
            if !self.by_len.contains(&(l, s)) {
                return Err(format!("run {s}+{l} missing from the length index"));
            }
            for b in s..s + l {
                if self.refcounts[b as usize] != 0 {
                    return Err(format!("free block {b} has refcount {}", self.refcounts[b as usize]));
                }
            }
            counted += l as usize;
            prev_end = Some(s + l);
        }
        if self.by_len.len() != self.by_start.len() {
            return Err("run indexes disagree".into());
        }
        let zero = self.refcounts.iter().filter(|&&r| r == 0).count();
        if counted != self.free || zero != self.free {
            return Err(format!("free count {} but runs hold {counted} and {zero} blocks have refcount 0", self.free));
        }
        Ok(())
    }
}

/// A request's blocks in token order: token `t` lives in `blocks[t / 64]`, slot `t % 64`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new(blocks: Vec<BlockId>) -> Self {
        BlockTable { blocks }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Tokens the table can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.len() * BLOCK_SIZE
    }

    /// (block, slot) of token position `pos`, if the table covers it.
    pub fn slot(&self, pos: usize) -> Option<(BlockId, usize)> {
        self.blocks.get(pos / BLOCK_SIZE).map(|&b| (b, pos % BLOCK_SIZE))
    }

    /// Consecutive block ids merged into runs, in table order.
    pub fn runs(&self) -> Vec<BlockRun> {
        runs_of(&self.blocks)
    }
}

/// Merges consecutive ids into runs, keeping order.
pub fn runs_of(blocks: &[BlockId]) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some(r) if r.end() == b.0 => r.len += 1,
            _ => runs.push(BlockRun { start: b, len: 1 }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn fresh_allocation_is_one_run() {
        let mut a = BlockAllocator::new(100);
        let b = a.allocate(40).unwrap();
        assert_eq!(runs_of(&b), vec![BlockRun { start: BlockId(0), len: 40 }]);
        assert_eq!(a.free_blocks(), 60);
        a.check_invariants().unwrap();
    }

    #[test]
    fn best_fit_keeps_requests_contiguous_in_a_fragmented_pool() {
        let mut a = BlockAllocator::new(100);
        let x = a.allocate(10).unwrap();
        let _y = a.allocate(30).unwrap();
        let z = a.allocate(20).unwrap();
        a.release(&x).unwrap(); // free: [0,10) [60,100)
        a.release(&z).unwrap(); // free: [0,10) [40,100) coalesced
        a.check_invariants().unwrap();
        assert_eq!(a.free_runs(), 2);
        let small = a.allocate(8).unwrap();
        assert_eq!(runs_of(&small).len(), 1);
        assert_eq!(small[0], BlockId(0), "best fit takes the small hole");
        let big = a.allocate(45).unwrap();
        assert_eq!(runs_of(&big).len(), 1);
        // Not enough in any one run: largest runs first.
        let rest = a.allocate(17).unwrap();
        assert_eq!(runs_of(&rest).len(), 2);
        a.check_invariants().unwrap();
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut a = BlockAllocator::new(10);
        a.allocate(7).unwrap();
        let e = a.allocate(4).unwrap_err();
        assert_eq!(e, AllocError::OutOfBlocks { needed: 4, free: 3, total: 10 });
        assert_eq!(a.free_blocks(), 3);
        a.check_invariants().unwrap();
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut a = BlockAllocator::new(10);
        let b = a.allocate(3).unwrap();
        a.release(&b[..1]).unwrap();
        assert_eq!(a.release(&b).unwrap_err(), AllocError::NotAllocated(0));
        assert_eq!(a.free_blocks(), 8, "the failed release freed nothing");
        // The same block twice in one call with refcount 1 is a double free too.
        assert_eq!(a.release(&[b[1], b[1]]).unwrap_err(), AllocError::NotAllocated(1));
        assert_eq!(a.release(&[BlockId(99)]).unwrap_err(), AllocError::OutOfRange(99, 10));
        a.check_invariants().unwrap();
    }

    #[test]
    fn shared_blocks_free_on_last_release() {
        let mut a = BlockAllocator::new(10);
        let b = a.allocate(4).unwrap();
        a.retain(&b[..2]).unwrap();
        assert_eq!(a.release(&b).unwrap(), 2);
        assert_eq!(a.refcount(b[0]), 1);
        assert_eq!(a.release(&b[..2]).unwrap(), 2);
        assert_eq!(a.free_blocks(), 10);
        assert_eq!(a.free_runs(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn random_workload_never_leaks_or_corrupts() {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut a = BlockAllocator::new(500);
        let mut live: Vec<Vec<BlockId>> = Vec::new();
        for _ in 0..3000 {
            if rng.random_bool(0.55) {
                let n = rng.random_range(1..40);
                if let Ok(b) = a.allocate(n) {
                    let mut sorted = b.clone();
                    sorted.sort();
                    sorted.dedup();
                    assert_eq!(sorted.len(), n, "duplicate block handed out (seed {seed})");
                    live.push(b);
                }
            } else if !live.is_empty() {
                let i = rng.random_range(0..live.len());
                let b = live.swap_remove(i);
                a.release(&b).unwrap();
            }
            a.check_invariants().unwrap_or_else(|e| panic!("{e} (seed {seed})"));
        }
        for b in live.drain(..) {
            a.release(&b).unwrap();
        }
        assert_eq!(a.free_blocks(), 500);
        assert_eq!(a.free_runs(), 1, "everything coalesces back (seed {seed})");
    }

    #[test]
    fn table_maps_positions_to_slots() {
        let t = BlockTable::new(vec![BlockId(5), BlockId(6), BlockId(9)]);
        assert_eq!(t.slot(0), Some((BlockId(5), 0)));
        assert_eq!(t.slot(64), Some((BlockId(6), 0)));
        assert_eq!(t.slot(191), Some((BlockId(9), 63)));
        assert_eq!(t.slot(192), None);
        assert_eq!(t.runs(), vec![BlockRun { start: BlockId(5), len: 2 }, BlockRun { start: BlockId(9), len: 1 }]);
    }
}
