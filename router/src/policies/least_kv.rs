//! Decode: the worker with the lowest KV-cache usage (requests sent since its last report count too).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Load, Policy, Request, argmin};

#[derive(Default)]
pub struct LeastKv {
    rotate: AtomicUsize,
}

impl Policy for LeastKv {
    fn name(&self) -> &'static str {
        "least-kv"
    }

    fn select(&self, candidates: &[&dyn Candidate], _: &Request<'_>) -> Option<usize> {
        argmin(candidates, self.rotate.fetch_add(1, Ordering::Relaxed), Load::decode_score)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fake, refs};
    use super::*;

    #[test]
    fn picks_the_emptiest_cache_by_fraction_not_by_count() {
        let w = [
            // 100 free of 1000 (90% used)
            fake("big", Load { kv_blocks_total: 1000, kv_blocks_free: 100, ..Default::default() }),
            // 60 free of 100 (40% used)
            fake("small", Load { kv_blocks_total: 100, kv_blocks_free: 60, ..Default::default() }),
        ];
        assert_eq!(LeastKv::default().select(&refs(&w), &Request::default()), Some(1));
    }

    #[test]
    fn requests_in_flight_break_ties_between_stale_reports() {
        let r = Load { kv_blocks_total: 100, kv_blocks_free: 50, ..Default::default() };
        let w = [fake("a", Load { in_flight: 3, ..r }), fake("b", Load { in_flight: 1, ..r })];
        assert_eq!(LeastKv::default().select(&refs(&w), &Request::default()), Some(1));
    }
}
