//! The indexer's top-k rule (docs/model.md §2.3, §2.6), as a pure function on one query's row of scores: the
//! reference every backend's selection must equal.
//!
//! Exact ties in indexer scores are common, not rounding noise: a key whose every head has a negative
//! `q . k` scores exactly 0 after the ReLU, and several such zeros often straddle the top-k boundary. Which
//! of them are kept changes the attention output, so the order is part of the model's definition:
//! - keys rank by score, larger first, compared as IEEE values (-0.0 == +0.0);
//! - among equal scores the later logical position (closer to the query) ranks first;
//! - NaN scores are never selected (and are counted, see [`nan_scores_total`]);
//! - a causal context of at most `k` keys selects all of them without consulting the scores (the dense
//!   case: a backend need not compute scores there);
//! - the selection is emitted in ascending position, so attention sums in one order.
//!
//! Positions are logical token positions `0..=query`, never cache slots; the caller maps them to slots
//! through the block table after selection. The ranking of a row depends only on that row, so the rule is
//! batch-invariant. On a GPU a radix select that keeps the latest positions of the threshold bucket
//! implements it at no extra cost.

use std::cmp::Ordering;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

static NAN_SCORES: AtomicU64 = AtomicU64::new(0);

/// NaN indexer scores seen (and left unselected) by this process since it started.
pub fn nan_scores_total() -> u64 {
    NAN_SCORES.load(AtomicOrdering::Relaxed)
}

/// `a` ranks before `b`: larger score, then later position. Scores are not NaN.
#[inline]
fn rank(a: &(f32, usize), b: &(f32, usize)) -> Ordering {
    // `+ 0.0` turns -0.0 into +0.0, so total_cmp agrees with IEEE comparison on non-NaN values.
    (b.0 + 0.0).total_cmp(&(a.0 + 0.0)).then(b.1.cmp(&a.1))
}

/// One query's selection over `scores[s]`, `s` the logical key positions `0..scores.len()`: at most `k`
/// positions, ascending, and the number of NaN scores left out.
pub fn select_counting_nan(scores: &[f32], k: usize) -> (Vec<usize>, usize) {
    let n = scores.len();
    if n <= k {
        return ((0..n).collect(), 0);
    }
    let mut cand: Vec<(f32, usize)> =
        scores.iter().copied().enumerate().filter(|(_, s)| !s.is_nan()).map(|(i, s)| (s, i)).collect();
    let nan = n - cand.len();
    if cand.len() > k {
        if k == 0 {
            cand.clear();
        } else {
            cand.select_nth_unstable_by(k - 1, rank);
            cand.truncate(k);
        }
    }
    let mut out: Vec<usize> = cand.into_iter().map(|(_, i)| i).collect();
    out.sort_unstable();
    (out, nan)
}

/// [`select_counting_nan`], adding the NaN scores to the process-wide count.
pub fn select(scores: &[f32], k: usize) -> Vec<usize> {
    let (out, nan) = select_counting_nan(scores, k);
    if nan > 0 {
        NAN_SCORES.fetch_add(nan as u64, AtomicOrdering::Relaxed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngExt;

    /// The rule written as a full sort: score descending (-0.0 == +0.0), position descending, NaN out.
    fn by_full_sort(scores: &[f32], k: usize) -> Vec<usize> {
        if scores.len() <= k {
            return (0..scores.len()).collect();
        }
        let mut idx: Vec<usize> = (0..scores.len()).filter(|&i| !scores[i].is_nan()).collect();
        idx.sort_by(|&a, &b| {
            let (x, y) = (scores[a], scores[b]);
            if x == y {
                b.cmp(&a)
            } else if x > y {
                Ordering::Less
            } else {
                Ordering::Greater
            }
        });
        idx.truncate(k);
        idx.sort_unstable();
        idx
    }

    #[test]
    fn equals_a_full_sort_on_rows_full_of_ties() {
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for &(n, k) in &[(5usize, 16usize), (17, 16), (96, 16), (1023, 16), (5000, 16), (300, 2), (70, 1), (40, 0)] {
            for _ in 0..20 {
                // Coarse values: many exact ties; some -0.0 and NaN.
                let s: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..20) {
                        0 => -0.0,
                        1 => f32::NAN,
                        v => (v as f32 - 10.0) * 0.25,
                    })
                    .collect();
                let got = select_counting_nan(&s, k).0;
                assert!(got.windows(2).all(|w| w[0] < w[1]), "ascending, no duplicates");
                assert_eq!(got, by_full_sort(&s, k), "n {n} k {k} seed {seed}");
            }
        }
    }

    #[test]
    fn all_zero_scores_select_the_latest_positions() {
        let s = vec![0.0f32; 40];
        assert_eq!(select_counting_nan(&s, 16).0, (24..40).collect::<Vec<_>>());
    }

    #[test]
    fn negative_and_positive_zero_tie() {
        // Positions 0..4 score -0.0, 4..8 +0.0: equal, so the later ones win whatever the sign.
        let mut s = vec![-0.0f32; 4];
        s.extend([0.0f32; 4]);
        assert_eq!(select_counting_nan(&s, 3).0, vec![5, 6, 7]);
        let mut s = vec![0.0f32; 4];
        s.extend([-0.0f32; 4]);
        assert_eq!(select_counting_nan(&s, 3).0, vec![5, 6, 7]);
        // A strictly larger score still beats a later tie.
        let s = [1.0f32, -0.0, 0.0, -0.0];
        assert_eq!(select_counting_nan(&s, 2).0, vec![0, 3]);
    }

    #[test]
    fn nan_scores_are_never_selected_and_are_counted() {
        let s = [f32::NAN, 1.0, f32::NAN, -5.0, 2.0, f32::NAN];
        assert_eq!(select_counting_nan(&s, 2), (vec![1, 4], 3));
        // Fewer real candidates than k: only those.
        assert_eq!(select_counting_nan(&s, 4), (vec![1, 3, 4], 3));
        let before = nan_scores_total();
        assert_eq!(select(&s, 4), vec![1, 3, 4]);
        assert!(nan_scores_total() >= before + 3);
    }

    #[test]
    fn context_of_k_takes_everything_and_k_plus_one_drops_the_earliest_tie() {
        let k = 16;
        let s = vec![0.0f32; k];
        assert_eq!(select_counting_nan(&s, k), ((0..k).collect(), 0));
        // At context == k the scores are not consulted (the dense case), NaN included.
        let mut with_nan = s.clone();
        with_nan[3] = f32::NAN;
        assert_eq!(select_counting_nan(&with_nan, k), ((0..k).collect(), 0));
        let s = vec![0.0f32; k + 1];
        assert_eq!(select_counting_nan(&s, k).0, (1..=k).collect::<Vec<_>>());
        // ... unless the earliest is strictly larger.
        let mut s = vec![0.0f32; k + 1];
        s[0] = 1e-30;
        let mut want = vec![0];
        want.extend(2..=k);
        assert_eq!(select_counting_nan(&s, k).0, want);
    }

    #[test]
    fn small_rows_take_everything() {
        assert_eq!(select(&[3.0, 1.0], 16), vec![0, 1]);
        assert!(select(&[], 4).is_empty());
    }
}
