//! Worker selection policies: one file per policy behind [`Policy`], built by [`prefill_policy`] and
//! [`decode_policy`] from the `--prefill-policy` / `--decode-policy` flags.
//!
//! Policies see workers through [`Candidate`] (load, cached prefix), so they are tested without a network.

mod cache_aware;
mod least_kv;
mod least_loaded;
mod power_of_two;
mod round_robin;

pub use cache_aware::CacheAware;
pub use least_kv::LeastKv;
pub use least_loaded::LeastLoaded;
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

use crate::config::{DecodePolicyKind, PrefillPolicyKind};

/// A worker's load as the router knows it: the last report plus the router's own in-flight counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests the router has sent and not yet seen finish.
    pub in_flight: u32,
    /// Prompt tokens of those requests.
    pub in_flight_tokens: u64,
    pub running: u32,
    pub queued: u32,
    pub queued_tokens: u64,
    pub kv_blocks_total: u32,
    pub kv_blocks_free: u32,
}

impl Load {
    /// Prefill pressure in tokens: what is queued there (the router's own count when it is fresher), plus
    /// the request count as a tie-breaker.
    pub fn prefill_score(&self) -> f64 {
        self.queued_tokens.max(self.in_flight_tokens) as f64 + f64::from(self.in_flight.max(self.running + self.queued))
    }

    /// Decode pressure: fraction of KV blocks in use, nudged by requests sent since the last report.
    pub fn decode_score(&self) -> f64 {
        let used = if self.kv_blocks_total > 0 {
            f64::from(self.kv_blocks_total - self.kv_blocks_free.min(self.kv_blocks_total))
                / f64::from(self.kv_blocks_total)
        } else {
            0.0
        };
        used + f64::from(self.in_flight) * 1e-3
    }
}

pub trait Candidate {
    fn id(&self) -> &str;
    fn load(&self) -> Load;
    /// Leading blocks of a prompt (given as its prefix-hash chain) this worker holds in its prefix cache.
    fn cached_blocks(&self, hashes: &[u64]) -> usize;
}

/// What a policy may look at about the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    /// cluster::prefix_hash chain of the prompt's full blocks.
    pub prefix_hashes: &'a [u64],
    pub prompt_tokens: usize,
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Index into `candidates` (all eligible and compatible), or None when it is empty.
    fn select(&self, candidates: &[&dyn Candidate], request: &Request<'_>) -> Option<usize>;
    /// Whether the policy uses prefix hashes (the router skips hashing otherwise).
    fn wants_prefix_hashes(&self) -> bool {
        false
    }
}

pub fn prefill_policy(kind: PrefillPolicyKind, cache_balance_tokens: u64) -> Box<dyn Policy> {
    match kind {
        PrefillPolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PrefillPolicyKind::LeastLoaded => Box::new(LeastLoaded::new(Load::prefill_score)),
        PrefillPolicyKind::PowerOfTwo => Box::new(PowerOfTwo::new(Load::prefill_score)),
        PrefillPolicyKind::CacheAware => Box::new(CacheAware::new(cache_balance_tokens)),
    }
}

pub fn decode_policy(kind: DecodePolicyKind) -> Box<dyn Policy> {
    match kind {
        DecodePolicyKind::LeastKv => Box::new(LeastKv::default()),
        DecodePolicyKind::PowerOfTwo => Box::new(PowerOfTwo::new(Load::decode_score)),
        DecodePolicyKind::RoundRobin => Box::new(RoundRobin::default()),
    }
}

/// Index of the lowest score; ties go to the first at or after `start` (so equal workers share work).
pub(crate) fn argmin(candidates: &[&dyn Candidate], start: usize, score: impl Fn(&Load) -> f64) -> Option<usize> {
    let n = candidates.len();
    (0..n)
        .map(|k| (start + k) % n)
        .map(|i| (i, score(&candidates[i].load())))
        .fold(None, |best, (i, s)| match best {
            Some((_, bs)) if bs <= s => best,
            _ => Some((i, s)),
        })
        .map(|(i, _)| i)
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use std::collections::HashSet;

    /// A fake worker for policy tests.
    pub struct Fake {
        pub id: String,
        pub load: Load,
        pub cached: HashSet<u64>,
    }

    pub fn fake(id: &str, load: Load) -> Fake {
        Fake { id: id.into(), load, cached: HashSet::new() }
    }

    impl Candidate for Fake {
        fn id(&self) -> &str {
            &self.id
        }
        fn load(&self) -> Load {
            self.load
        }
        fn cached_blocks(&self, hashes: &[u64]) -> usize {
            cluster::prefix_hash::matched_blocks(hashes, |h| self.cached.contains(&h))
        }
    }

    pub fn refs(f: &[Fake]) -> Vec<&dyn Candidate> {
        f.iter().map(|x| x as &dyn Candidate).collect()
    }
}
