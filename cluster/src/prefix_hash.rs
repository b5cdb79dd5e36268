//! The prefix-block hash chain shared by prefill workers (prefix cache keys, reported in
//! `LoadReport.cached_prefix_hashes`) and the router's cache-aware policy.
//!
//! A prompt is cut into full blocks of [`BLOCK_TOKENS`] tokens (a partial last block has no hash).
//! Block i's hash covers its tokens and, through its parent's hash, every token before it:
//!
//! ```text
//! h(-1) = 0
//! h(i)  = first 8 bytes (little endian) of sha256( h(i-1) as u64 LE || tokens of block i as u32 LE )
//! ```
//!
//! So equal hashes mean equal prefixes, and a worker holding `h(i)` holds blocks 0..=i. sha256 keeps
//! the value identical across processes, machines and Rust versions.

use sha2::{Digest, Sha256};

/// Tokens per cache block (the cache layout's block size).
pub const BLOCK_TOKENS: usize = 64;

/// The parent hash of the first block.
pub const ROOT: u64 = 0;

/// Hash of one full block given its parent's hash.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_le_bytes(first)
}

/// Hashes of every full block of `tokens`, in order (`tokens.len() / 64` of them).
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut parent = ROOT;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            parent = block_hash(parent, block);
            parent
        })
        .collect()
}

/// How many leading blocks of `hashes` (a prompt's chain) satisfy `cached`: the matched prefix length in
/// blocks. Stops at the first miss, since a later block cannot be used without its predecessors.
pub fn matched_blocks(hashes: &[u64], cached: impl Fn(u64) -> bool) -> usize {
    hashes.iter().take_while(|h| cached(**h)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_hashes_and_divergence_changes_the_rest() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b[100] = 9999; // inside block 1
        let ha = prefix_hashes(&a);
        let hb = prefix_hashes(&b);
        assert_eq!(ha.len(), 3, "200 tokens = 3 full blocks");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2], "a block's hash depends on everything before it");
    }

    #[test]
    fn same_block_at_another_position_hashes_differently() {
        let block: Vec<u32> = vec![7; 64];
        let twice: Vec<u32> = block.iter().chain(block.iter()).copied().collect();
        let h = prefix_hashes(&twice);
        assert_ne!(h[0], h[1]);
        assert_eq!(h[0], block_hash(ROOT, &block));
        assert_eq!(h[1], block_hash(h[0], &block));
    }

    #[test]
    fn matched_blocks_stops_at_the_first_miss() {
        let h = prefix_hashes(&(0..256).collect::<Vec<u32>>());
        let cached = [h[0], h[1], h[3]];
        assert_eq!(matched_blocks(&h, |x| cached.contains(&x)), 2);
        assert_eq!(matched_blocks(&h, |_| false), 0);
    }

    #[test]
    fn hash_is_stable_across_builds() {
        // Workers and routers built at different times must agree: pin the chain's first values.
        let h = prefix_hashes(&(0..128).collect::<Vec<u32>>());
        // Computed independently with Python's hashlib from the formula in the module docs.
        assert_eq!(h, [0x15d35ced00a64d7e, 0x63430a4c6a5b43ee]);
    }
}
