//! The worker with the lowest load score (prefill: queued tokens).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Load, Policy, Request, argmin};

pub struct LeastLoaded {
    score: fn(&Load) -> f64,
    rotate: AtomicUsize,
}

impl LeastLoaded {
    pub fn new(score: fn(&Load) -> f64) -> Self {
        Self { score, rotate: AtomicUsize::new(0) }
    }
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&self, candidates: &[&dyn Candidate], _: &Request<'_>) -> Option<usize> {
        argmin(candidates, self.rotate.fetch_add(1, Ordering::Relaxed), self.score)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fake, refs};
    use super::*;

    #[test]
    fn picks_fewest_queued_tokens_and_counts_router_in_flight() {
        let w = [
            fake("a", Load { queued_tokens: 500, ..Default::default() }),
            fake("b", Load { queued_tokens: 100, ..Default::default() }),
            fake("c", Load { in_flight_tokens: 800, in_flight: 1, ..Default::default() }),
        ];
        let p = LeastLoaded::new(Load::prefill_score);
        for _ in 0..3 {
            assert_eq!(p.select(&refs(&w), &Request::default()), Some(1));
        }
    }

    #[test]
    fn ties_are_spread() {
        let w = [fake("a", Load::default()), fake("b", Load::default())];
        let p = LeastLoaded::new(Load::prefill_score);
        let picks: std::collections::HashSet<usize> =
            (0..4).map(|_| p.select(&refs(&w), &Request::default()).unwrap()).collect();
        assert_eq!(picks.len(), 2);
    }
}
