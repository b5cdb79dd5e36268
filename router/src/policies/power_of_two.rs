//! Two workers at random, the less loaded of them: near least-loaded quality without every router
//! herding onto the same worker between load reports.

use rand::RngExt;

use super::{Candidate, Load, Policy, Request};

pub struct PowerOfTwo {
    score: fn(&Load) -> f64,
}

impl PowerOfTwo {
    pub fn new(score: fn(&Load) -> f64) -> Self {
        Self { score }
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power-of-two"
    }

    fn select(&self, candidates: &[&dyn Candidate], _: &Request<'_>) -> Option<usize> {
        let n = candidates.len();
        match n {
            0 => None,
            1 => Some(0),
            _ => {
                let mut rng = rand::rng();
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                let (sa, sb) = ((self.score)(&candidates[a].load()), (self.score)(&candidates[b].load()));
                Some(if sb < sa { b } else { a })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fake, refs};
    use super::*;

    #[test]
    fn never_picks_the_most_loaded_of_three_and_both_others_get_work() {
        let w = [
            fake("busy", Load { queued_tokens: 10_000, ..Default::default() }),
            fake("a", Load { queued_tokens: 10, ..Default::default() }),
            fake("b", Load { queued_tokens: 20, ..Default::default() }),
        ];
        let p = PowerOfTwo::new(Load::prefill_score);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[p.select(&refs(&w), &Request::default()).unwrap()] += 1;
        }
        assert_eq!(seen[0], 0, "{seen:?}");
        assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
        assert!(seen[1] > seen[2], "the lighter one wins its pairings: {seen:?}");
    }
}
