//! Automatic prefix caching of full blocks: a block is keyed by the hash chain of its tokens and every
//! token before it (`cluster::prefix_hash`), so a later request with the same prefix reuses the block
//! instead of recomputing it. The cache holds one pool reference per cached block; least recently used
//! entries are dropped when the pool runs short.
//!
//! One subtlety: the MTP layer's entry at a block's last position depends on the token *after* the block
//! (MTP position p reads token p + 1). So an entry also records that next token, and a hit requires the
//! new request to continue the block with the same token.

use std::collections::HashMap;

use engine::cache::{BLOCK_SIZE, BlockId, BlockPool};

struct Entry {
    block: BlockId,
    next_token: u32,
    last_used: u64,
}

#[derive(Default)]
pub struct PrefixCache {
    map: HashMap<u64, Entry>,
    tick: u64,
}

impl PrefixCache {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Cached leading blocks of `tokens` (with their chain `hashes`). At most `limit` blocks: at least
    /// one token must be left to compute so the last position has logits.
    pub fn lookup(&mut self, hashes: &[u64], tokens: &[u32], limit: usize) -> Vec<BlockId> {
        self.tick += 1;
        let mut out = Vec::new();
        for (k, h) in hashes.iter().enumerate().take(limit) {
            let next = tokens.get((k + 1) * BLOCK_SIZE).copied();
            match self.map.get_mut(h) {
                Some(e) if Some(e.next_token) == next => {
                    e.last_used = self.tick;
                    out.push(e.block);
                }
                _ => break,
            }
        }
        out
    }

    /// Caches the full blocks of a prefilled request: block k of `blocks` holds tokens `64k..64k+64` of
    /// `tokens`, which must include the token after the last cached block (the first sampled token when
    /// the prompt ends on a block boundary). Takes a pool reference for each new entry.
    pub fn insert(&mut self, pool: &BlockPool, hashes: &[u64], blocks: &[BlockId], tokens: &[u32]) {
        self.tick += 1;
        for (k, h) in hashes.iter().enumerate() {
            let Some(&next_token) = tokens.get((k + 1) * BLOCK_SIZE) else { break };
            if let Some(e) = self.map.get_mut(h) {
                e.last_used = self.tick;
                continue;
            }
            if pool.retain_blocks(&blocks[k..k + 1]).is_ok() {
                self.map.insert(*h, Entry { block: blocks[k], next_token, last_used: self.tick });
            }
        }
    }

    /// Drops least recently used entries until the pool has `needed` free blocks or the cache is empty.
    /// Returns how many entries were dropped.
    pub fn evict_until(&mut self, pool: &BlockPool, needed: usize) -> usize {
        let mut order: Vec<(u64, u64)> = self.map.iter().map(|(h, e)| (e.last_used, *h)).collect();
        order.sort_unstable();
        let mut dropped = 0;
        for (_, h) in order {
            if pool.stats().free_blocks >= needed {
                break;
            }
            if let Some(e) = self.map.remove(&h) {
                let _ = pool.release_blocks(&[e.block]);
                dropped += 1;
            }
        }
        dropped
    }

    /// Cached hashes, most recently used first, at most `limit` (reported to the router).
    pub fn hashes(&self, limit: usize) -> Vec<u64> {
        let mut v: Vec<(u64, u64)> = self.map.iter().map(|(h, e)| (e.last_used, *h)).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.into_iter().take(limit).map(|(_, h)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cluster::prefix_hash::prefix_hashes;

    #[test]
    fn hits_need_the_same_prefix_and_the_same_next_token() {
        let pool = BlockPool::new(16);
        let mut c = PrefixCache::default();
        let a: Vec<u32> = (0..200).collect();
        let t = pool.reserve("a", a.len()).unwrap();
        let ha = prefix_hashes(&a);
        c.insert(&pool, &ha, &t.blocks, &a);
        assert_eq!(c.len(), 3, "three full blocks, each followed by a known token");
        pool.release("a").unwrap();
        assert_eq!(pool.stats().used_blocks, 3, "the cache keeps its blocks");

        let mut b = a[..150].to_vec();
        b.extend(1000..1100);
        let hb = prefix_hashes(&b);
        assert_eq!(c.lookup(&hb, &b, 10), t.blocks[..2].to_vec());
        // Block 1 is followed by a different token in c: block 1's MTP entry does not fit it.
        let mut d = a[..128].to_vec();
        d.push(5000);
        assert_eq!(c.lookup(&prefix_hashes(&d), &d, 10), t.blocks[..1].to_vec());
        // The limit keeps a token to compute.
        assert_eq!(c.lookup(&ha, &a, 1).len(), 1);
    }

    #[test]
    fn eviction_returns_blocks_least_recently_used_first() {
        let pool = BlockPool::new(4);
        let mut c = PrefixCache::default();
        let a: Vec<u32> = (0..130).collect();
        let t = pool.reserve("a", a.len()).unwrap();
        c.insert(&pool, &prefix_hashes(&a), &t.blocks, &a);
        pool.release("a").unwrap();
        assert_eq!(pool.stats().free_blocks, 2);
        assert_eq!(c.evict_until(&pool, 3), 1);
        assert_eq!(pool.stats().free_blocks, 3);
        assert_eq!(c.evict_until(&pool, 10), 1);
        assert!(c.is_empty());
        assert_eq!(pool.stats().free_blocks, 4);
        pool.check_invariants().unwrap();
    }
}
