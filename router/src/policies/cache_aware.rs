//! Prefill: send a prompt where its longest prefix is cached (hash chain over the templated prompt, so
//! every message counts), unless that worker's queue is much longer than the idlest worker's, in which
//! case balance wins (as SGLang's cache-aware policy does).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Load, Policy, Request, argmin};

pub struct CacheAware {
    /// How many more queued tokens than the idlest worker the best-cached worker may have.
    balance_tokens: u64,
    rotate: AtomicUsize,
}

impl CacheAware {
    pub fn new(balance_tokens: u64) -> Self {
        Self { balance_tokens, rotate: AtomicUsize::new(0) }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn wants_prefix_hashes(&self) -> bool {
        true
    }

    fn select(&self, candidates: &[&dyn Candidate], request: &Request<'_>) -> Option<usize> {
        let idle = argmin(candidates, self.rotate.fetch_add(1, Ordering::Relaxed), Load::prefill_score)?;
        if request.prefix_hashes.is_empty() {
            return Some(idle);
        }
        let mut best: Option<(usize, usize, f64)> = None;
        for (i, c) in candidates.iter().enumerate() {
            let matched = c.cached_blocks(request.prefix_hashes);
            let score = c.load().prefill_score();
            let better = match best {
                None => matched > 0,
                Some((_, m, s)) => matched > m || (matched == m && score < s),
            };
            if better && matched > 0 {
                best = Some((i, matched, score));
            }
        }
        let Some((b, _, best_score)) = best else { return Some(idle) };
        let idle_score = candidates[idle].load().prefill_score();
        Some(if best_score <= idle_score + self.balance_tokens as f64 { b } else { idle })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fake, refs};
    use super::*;
    use cluster::prefix_hash::prefix_hashes;

    #[test]
    fn longest_cached_prefix_wins_while_load_is_balanced() {
        let prompt: Vec<u32> = (0..64 * 4).collect();
        let h = prefix_hashes(&prompt);
        let mut w = [fake("a", Load::default()), fake("b", Load::default()), fake("c", Load::default())];
        w[0].cached.extend(&h[..1]);
        w[2].cached.extend(&h[..3]);
        w[2].load.queued_tokens = 1000;
        let p = CacheAware::new(4096);
        let req = Request { prefix_hashes: &h, prompt_tokens: prompt.len() };
        assert_eq!(p.select(&refs(&w), &req), Some(2));
    }

    #[test]
    fn an_overloaded_cache_holder_loses_to_the_idlest_worker() {
        let prompt: Vec<u32> = (0..128).collect();
        let h = prefix_hashes(&prompt);
        let mut w = [fake("hot", Load { queued_tokens: 50_000, ..Default::default() }), fake("idle", Load::default())];
        w[0].cached.extend(&h);
        let req = Request { prefix_hashes: &h, prompt_tokens: prompt.len() };
        assert_eq!(CacheAware::new(4096).select(&refs(&w), &req), Some(1));
    }

    #[test]
    fn a_divergent_conversation_only_matches_its_shared_blocks() {
        let a: Vec<u32> = (0..256).collect();
        let mut b = a.clone();
        b[70] = 1; // diverges in block 1
        let (ha, hb) = (prefix_hashes(&a), prefix_hashes(&b));
        let mut w = [fake("x", Load::default()), fake("y", Load::default())];
        w[0].cached.extend(&ha[..1]);
        w[1].cached.extend(&ha);
        // y holds all of a's blocks, but b shares only block 0 with a: a tie at one block, broken by load.
        w[1].load.queued_tokens = 10;
        let req = Request { prefix_hashes: &hb, prompt_tokens: b.len() };
        assert_eq!(CacheAware::new(4096).select(&refs(&w), &req), Some(0));
    }

    #[test]
    fn without_cached_blocks_it_is_least_loaded() {
        let h = prefix_hashes(&(0..64).collect::<Vec<u32>>());
        let w = [fake("a", Load { queued_tokens: 9, ..Default::default() }), fake("b", Load::default())];
        let req = Request { prefix_hashes: &h, prompt_tokens: 64 };
        assert_eq!(CacheAware::new(4096).select(&refs(&w), &req), Some(1));
    }
}
