//! The indexer's top-k rule on the GPU (`engine/kernels/topk.cu`): rows of scores to ascending selected
//! positions, identical to [`crate::cpu::topk::select`] on the same scores.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::ops::{Arg, launch};
use super::{CudaError, Gpu};

/// Threads per CTA (one CTA per row); must match `TOPK_THREADS` in the kernel.
const THREADS: u32 = 1024;
/// Dynamic shared memory: `TOPK_COPIES` (8) histograms of 2048 counts and `TOPK_CAND` (8192) candidate keys.
pub const SHARED_BYTES: usize = (8 * 2048 + 8192) * 4;
/// Words per row of the first-digit histogram the indexer scorer can fill for the top-k (`TOPK_HIST_WORDS` in
/// `topk_key.cuh`): 2048 counts of a key's top 11 bits, then the row's NaN count.
pub const HIST_WORDS: usize = 2049;

/// Where a batch of selections goes: `positions [rows, k]` (ascending, then -1), how many positions each
/// row selected, and how many NaN scores each row left out.
pub struct Selections<'a> {
    pub positions: &'a mut CudaSlice<i32>,
    pub counts: &'a mut CudaSlice<i32>,
    pub nan_counts: &'a mut CudaSlice<i32>,
}

/// One launch as raw device addresses: `scores [rows, row_stride]`, `lengths [rows]`, `positions [rows, k]`,
/// `counts` and `nan_counts [rows]`.
#[derive(Debug, Clone, Copy)]
pub struct RawTopk {
    pub scores: u64,
    pub row_stride: usize,
    pub lengths: u64,
    pub rows: usize,
    pub k: usize,
    pub positions: u64,
    pub counts: u64,
    pub nan_counts: u64,
    /// 0, or the scorer's counts of these rows' first radix digit ([`super::indexer::RawScoreArgs::hist`]):
    /// the kernel then starts from them instead of its own pass over each row.
    pub pre_hist: u64,
}

/// Queues the selection of up to `k` positions of each row: row `r`'s candidates are positions
/// `0..lengths[r]` (clamped to `row_stride`).
pub fn launch_topk(gpu: &Gpu, a: &RawTopk) -> Result<(), CudaError> {
    if a.k == 0 || a.k > i32::MAX as usize {
        return Err(CudaError::Shape(format!("k = {}: must be in 1..=2^31-1", a.k)));
    }
    if a.rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{} rows: at most 2^31-1 per launch", a.rows)));
    }
    launch(
        gpu,
        "tandem_topk_rule",
        (a.rows as u32, 1, 1),
        THREADS,
        SHARED_BYTES as u32,
        &[
            Arg::P(a.scores),
            Arg::L(a.row_stride as i64),
            Arg::P(a.lengths),
            Arg::I(a.k as i32),
            Arg::P(a.positions),
            Arg::P(a.counts),
            Arg::P(a.nan_counts),
            Arg::P(a.pre_hist),
        ],
    )
}

/// Selects up to `k` positions of each of `rows` rows: row `r`'s candidates are positions
/// `0..lengths[r]` with scores at `scores[r * row_stride..]` (lengths above `row_stride` are clamped).
pub fn select_rows(
    gpu: &Gpu,
    scores: &CudaSlice<f32>,
    row_stride: usize,
    lengths: &CudaSlice<i32>,
    rows: usize,
    k: usize,
    out: Selections<'_>,
) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Shape(m));
    if k == 0 || k > i32::MAX as usize {
        return bad(format!("k = {k}: must be in 1..=2^31-1"));
    }
    if rows > 0 && scores.len() < rows * row_stride {
        return bad(format!("{} scores for {rows} rows of stride {row_stride}", scores.len()));
    }
    if lengths.len() < rows || out.counts.len() < rows || out.nan_counts.len() < rows {
        return bad(format!("lengths/counts shorter than {rows} rows"));
    }
    if out.positions.len() < rows * k {
        return bad(format!("positions hold {}, {rows} x {k} needed", out.positions.len()));
    }
    if rows == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let raw = RawTopk {
        scores: scores.device_ptr(st).0,
        row_stride,
        lengths: lengths.device_ptr(st).0,
        rows,
        k,
        positions: out.positions.device_ptr(st).0,
        counts: out.counts.device_ptr(st).0,
        nan_counts: out.nan_counts.device_ptr(st).0,
        pre_hist: 0,
    };
    launch_topk(gpu, &raw)
}

#[cfg(test)]
mod tests {
    use rand::RngExt;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cpu::topk::select_counting_nan;

    /// A row as the indexer makes them: many exact zeros (ReLU), some -0.0, a few NaN, values drawn from a
    /// small set (many ties) or continuous.
    fn row(rng: &mut ChaCha8Rng, n: usize, style: u32) -> Vec<f32> {
        (0..n)
            .map(|_| match (style, rng.random_range(0..100)) {
                (_, 0) => f32::NAN,
                (_, 1..=3) => -0.0,
                (_, 4..=30) => 0.0,
                (0, _) => [0.5f32, 1.0, 1.5, -2.0, 3.0][rng.random_range(0..5)],
                (1, _) => rng.random::<f32>() * 4.0 - 1.0,
                _ => f32::from_bits(rng.random::<u32>() & 0xbfff_ffff),
            })
            .collect()
    }

    struct Batch {
        rows: Vec<Vec<f32>>,
        stride: usize,
    }

    /// Runs the kernel over `batch` and returns each row's selection and NaN count.
    fn run(gpu: &Gpu, batch: &Batch, k: usize) -> Vec<(Vec<usize>, usize)> {
        let st = gpu.stream();
        let rows = batch.rows.len();
        let mut flat = vec![f32::NAN; rows * batch.stride];
        for (r, v) in batch.rows.iter().enumerate() {
            flat[r * batch.stride..r * batch.stride + v.len()].copy_from_slice(v);
        }
        let lengths: Vec<i32> = batch.rows.iter().map(|v| v.len() as i32).collect();
        let (scores, lens) = (st.clone_htod(&flat).unwrap(), st.clone_htod(&lengths).unwrap());
        let mut positions = st.clone_htod(&vec![i32::MIN; rows * k]).unwrap();
        let mut counts = st.clone_htod(&vec![-7i32; rows]).unwrap();
        let mut nans = st.clone_htod(&vec![-7i32; rows]).unwrap();
        let out = Selections { positions: &mut positions, counts: &mut counts, nan_counts: &mut nans };
        select_rows(gpu, &scores, batch.stride, &lens, rows, k, out).unwrap();
        let (p, c, nn) =
            (st.clone_dtoh(&positions).unwrap(), st.clone_dtoh(&counts).unwrap(), st.clone_dtoh(&nans).unwrap());
        st.synchronize().unwrap();
        (0..rows)
            .map(|r| {
                let sel = &p[r * k..(r + 1) * k];
                let count = c[r] as usize;
                assert!(sel[count..].iter().all(|&x| x == -1), "row {r}: padding after {count} must be -1");
                (sel[..count].iter().map(|&x| x as usize).collect(), nn[r] as usize)
            })
            .collect()
    }

    #[test]
    fn selections_equal_the_cpu_rule_on_tie_heavy_rows() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for k in [16usize, 2048] {
            let lens = [0, 1, k - 1, k, k + 1, 2 * k + 3, 5000, 70_001, 131_072];
            let mut rows: Vec<Vec<f32>> =
                lens.iter().enumerate().map(|(i, &n)| row(&mut rng, n, i as u32 % 3)).collect();
            // One value everywhere: the latest k positions win. The first row's threshold bucket fits the
            // kernel's shared-memory candidates, the second's does not (the select runs over the row).
            rows.push(vec![0.25; 3 * k + 5]);
            rows.push(vec![0.25; 9000]);
            // The best scores all in the first quarter, ties at the threshold in the last.
            let mut skew: Vec<f32> = (0..4 * k + 8).map(|i| if i < k / 2 { 9.0 } else { 1.0 }).collect();
            skew[4 * k..].fill(2.0);
            rows.push(skew);
            let stride = rows.iter().map(Vec::len).max().unwrap();
            let got = run(&gpu, &Batch { rows: rows.clone(), stride }, k);
            for (r, v) in rows.iter().enumerate() {
                let want = select_counting_nan(v, k);
                assert_eq!(got[r], want, "k={k} row {r} (len {}), seed {seed}", v.len());
            }
        }
    }

    #[test]
    fn hand_made_ties_follow_the_rule() {
        let Some(gpu) = Gpu::for_test() else { return };
        let k = 3;
        let rows = vec![
            vec![0.0f32; 8],                                        // all zeros: the latest three
            vec![-0.0, 0.0, -0.0, 0.0, -0.0, 1.0],                  // signed zeros tie
            vec![f32::NAN, 5.0, f32::NAN, 4.0, f32::NAN, f32::NAN], // two valid: both, NaN never
            vec![1.0, 2.0, 3.0],                                    // context == k: everything
            vec![1.0, 2.0, 3.0, 0.5],                               // context == k + 1
            vec![f32::INFINITY, f32::NEG_INFINITY, 7.0, -7.0, 0.0],
        ];
        let got = run(&gpu, &Batch { stride: 8, rows: rows.clone() }, k);
        let want = [
            (vec![5, 6, 7], 0),
            (vec![3, 4, 5], 0),
            (vec![1, 3], 4),
            (vec![0, 1, 2], 0),
            (vec![0, 1, 2], 0),
            (vec![0, 2, 4], 0),
        ];
        for (r, w) in want.iter().enumerate() {
            assert_eq!(&got[r], w, "row {r}: {:?}", rows[r]);
            assert_eq!(got[r], select_counting_nan(&rows[r], k), "row {r} vs the CPU rule");
        }
    }

    #[test]
    fn a_rows_selection_does_not_depend_on_its_batch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let k = 2048;
        let probe = row(&mut rng, 9000, 1);
        let mut first = None;
        for rows in [1usize, 63, 64, 65, 129, 256] {
            let mut batch: Vec<Vec<f32>> =
                (0..rows).map(|i| row(&mut rng, 100 + 37 * i % 8900, i as u32 % 3)).collect();
            let at = rng.random_range(0..rows);
            batch[at] = probe.clone();
            let got = run(&gpu, &Batch { rows: batch, stride: 9000 }, k).swap_remove(at);
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(&got, f, "batch of {rows}, seed {seed}"),
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_before_launch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let st = gpu.stream();
        let scores = st.alloc_zeros::<f32>(100).unwrap();
        let lens = st.alloc_zeros::<i32>(2).unwrap();
        let (mut p, mut c, mut nn) =
            (st.alloc_zeros::<i32>(8).unwrap(), st.alloc_zeros::<i32>(2).unwrap(), st.alloc_zeros::<i32>(2).unwrap());
        macro_rules! sel {
            () => {
                Selections { positions: &mut p, counts: &mut c, nan_counts: &mut nn }
            };
        }
        assert!(select_rows(&gpu, &scores, 60, &lens, 2, 4, sel!()).unwrap_err().to_string().contains("stride 60"));
        assert!(select_rows(&gpu, &scores, 50, &lens, 2, 5, sel!()).unwrap_err().to_string().contains("2 x 5"));
        assert!(select_rows(&gpu, &scores, 50, &lens, 2, 0, sel!()).is_err());
    }
}
