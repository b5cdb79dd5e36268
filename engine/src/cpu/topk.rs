//! Top-k selection with PyTorch's CPU tie order.
//!
//! Exact ties in indexer scores are common, not rounding noise: a token whose every head has a negative
//! `q . k` scores exactly 0 after the ReLU, and several such zeros often straddle the top-k boundary. Which
//! of them are kept changes the attention output, so the rule must be fixed. We use the one the reference
//! implementations run on CPU: `torch.topk` over `(score, index)` pairs with the comparator "greater score",
//! which is libstdc++'s `std::nth_element` (introselect) when `k * 64 > n` and `std::partial_sort` (heap
//! select) otherwise. This module reproduces those algorithms step for step, so the selected set is exactly
//! PyTorch's, and tandem's logits can be compared bit-for-bit with a HF transformers reference
//! (tests/golden). The ranking of a query's row depends only on that row, so the rule is batch-invariant.

type Elem = (f32, usize);

#[inline]
fn greater(x: &Elem, y: &Elem) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

fn move_median_to_first(v: &mut [Elem], result: usize, a: usize, b: usize, c: usize) {
    if greater(&v[a], &v[b]) {
        if greater(&v[b], &v[c]) {
            v.swap(result, b)
        } else if greater(&v[a], &v[c]) {
            v.swap(result, c)
        } else {
            v.swap(result, a)
        }
    } else if greater(&v[a], &v[c]) {
        v.swap(result, a)
    } else if greater(&v[b], &v[c]) {
        v.swap(result, c)
    } else {
        v.swap(result, b)
    }
}

fn unguarded_partition(v: &mut [Elem], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while greater(&v[first], &v[pivot]) {
            first += 1;
        }
        last -= 1;
        while greater(&v[pivot], &v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

fn insertion_sort(v: &mut [Elem], first: usize, last: usize) {
    if first == last {
        return;
    }
    for i in first + 1..last {
        let val = v[i];
        if greater(&val, &v[first]) {
            v.copy_within(first..i, first + 1);
            v[first] = val;
        } else {
            let mut hole = i;
            while greater(&val, &v[hole - 1]) {
                v[hole] = v[hole - 1];
                hole -= 1;
            }
            v[hole] = val;
        }
    }
}

/// libstdc++ `__push_heap` on `v[first..]`.
fn push_heap(v: &mut [Elem], first: usize, mut hole: usize, top: usize, value: Elem) {
    let parent_of = |h: usize| h.saturating_sub(1) / 2;
    let mut parent = parent_of(hole);
    while hole > top && greater(&v[first + parent], &value) {
        v[first + hole] = v[first + parent];
        hole = parent;
        parent = parent_of(hole);
    }
    v[first + hole] = value;
}

/// libstdc++ `__adjust_heap` on the heap `v[first..first + len]`.
fn adjust_heap(v: &mut [Elem], first: usize, mut hole: usize, len: usize, value: Elem) {
    let top = hole;
    let mut child = hole;
    while child < (len.saturating_sub(1)) / 2 {
        child = 2 * (child + 1);
        if greater(&v[first + child], &v[first + child - 1]) {
            child -= 1;
        }
        v[first + hole] = v[first + child];
        hole = child;
    }
    if len & 1 == 0 && len >= 2 && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        v[first + hole] = v[first + child - 1];
        hole = child - 1;
    }
    push_heap(v, first, hole, top, value);
}

fn make_heap(v: &mut [Elem], first: usize, last: usize) {
    let len = last - first;
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[first + parent];
        adjust_heap(v, first, parent, len, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// libstdc++ `__heap_select(first, middle, last)`: afterwards `v[first..middle]` holds the selection.
fn heap_select(v: &mut [Elem], first: usize, middle: usize, last: usize) {
    make_heap(v, first, middle);
    for i in middle..last {
        if greater(&v[i], &v[first]) {
            // __pop_heap(first, middle, i)
            let value = v[i];
            v[i] = v[first];
            adjust_heap(v, first, 0, middle - first, value);
        }
    }
}

/// libstdc++ `std::nth_element(v.begin(), v.begin() + nth, v.end(), greater)`.
fn nth_element(v: &mut [Elem], nth: usize) {
    let (mut first, mut last) = (0usize, v.len());
    if first == last || nth == last {
        return;
    }
    let mut depth = 2 * (usize::BITS - 1 - (last - first).leading_zeros()) as usize;
    while last - first > 3 {
        if depth == 0 {
            heap_select(v, first, nth + 1, last);
            v.swap(first, nth);
            return;
        }
        depth -= 1;
        let mid = first + (last - first) / 2;
        move_median_to_first(v, first, first + 1, mid, last - 1);
        let cut = unguarded_partition(v, first + 1, last, first);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(v, first, last);
}

/// The indices of the `k` best of `scores`, ascending, as `torch.topk` on CPU selects them from a row of
/// `row_len >= scores.len()` entries whose tail is masked (-inf). All candidates when there are at most
/// `k` of them.
pub fn select(scores: &[f32], k: usize, row_len: usize) -> Vec<usize> {
    let n = scores.len();
    if n <= k {
        return (0..n).collect();
    }
    let row_len = row_len.max(n);
    let mut row: Vec<Elem> = (0..row_len).map(|i| (if i < n { scores[i] } else { f32::NEG_INFINITY }, i)).collect();
    let k = k.min(row_len);
    if k * 64 <= row_len {
        heap_select(&mut row, 0, k, row_len);
    } else {
        nth_element(&mut row, k - 1);
    }
    let mut out: Vec<usize> = row[..k].iter().map(|e| e.1).filter(|&i| i < n).collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    fn brute_force_values(scores: &[f32], k: usize) -> Vec<f32> {
        let mut v = scores.to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        v.truncate(k);
        v
    }

    #[test]
    fn selects_the_k_largest_values_on_both_algorithm_paths() {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for &(n, k) in &[(5usize, 16usize), (17, 16), (96, 16), (1023, 16), (1024, 16), (5000, 16), (300, 2), (70, 1)] {
            for _ in 0..20 {
                // Coarse values: many exact ties.
                let s: Vec<f32> = (0..n).map(|_| rng.random_range(-6..6) as f32 * 0.25).collect();
                let got = select(&s, k, n);
                assert_eq!(got.len(), k.min(n));
                assert!(got.windows(2).all(|w| w[0] < w[1]), "ascending, no duplicates");
                let mut vals: Vec<f32> = got.iter().map(|&i| s[i]).collect();
                vals.sort_by(|a, b| b.total_cmp(a));
                assert_eq!(vals, brute_force_values(&s, k), "n {n} k {k} seed {seed}");
            }
        }
    }

    #[test]
    fn masked_padding_is_never_selected_and_only_changes_tie_order() {
        let s = vec![0.0f32; 40];
        for row_len in [40, 96, 2000] {
            let got = select(&s, 16, row_len);
            assert_eq!(got.len(), 16);
            assert!(got.iter().all(|&i| i < 40));
        }
    }

    #[test]
    fn small_rows_take_everything() {
        assert_eq!(select(&[3.0, 1.0], 16, 2), vec![0, 1]);
        assert!(select(&[], 4, 0).is_empty());
    }
}
