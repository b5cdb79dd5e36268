//! Each worker in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, Policy, Request};

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(&self, candidates: &[&dyn Candidate], _: &Request<'_>) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        Some(self.next.fetch_add(1, Ordering::Relaxed) % candidates.len())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fake, refs};
    use super::*;

    #[test]
    fn visits_every_worker_in_turn() {
        let w = [fake("a", Default::default()), fake("b", Default::default()), fake("c", Default::default())];
        let p = RoundRobin::default();
        let picks: Vec<usize> = (0..6).map(|_| p.select(&refs(&w), &Request::default()).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(p.select(&[], &Request::default()), None);
    }
}
