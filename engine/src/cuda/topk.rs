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

/// The split form: positions per slice CTA (`TOPK_SLICE`), threads of a slice CTA, the longest row stride it
/// takes (`TOPK_MAX_SLICES` slices), the threshold-bucket candidates a row may collect (`TOPK_SPLIT_CAP`) and
/// the words of a row's plan record (`TOPK_SPLIT_WORDS`: 16 fields, 3 x 64 per-slice counts, the candidates).
const SLICE: usize = 4096;
const SLICE_THREADS: u32 = 256;
pub const MAX_SPLIT_STRIDE: usize = 64 * SLICE;
const SPLIT_CAP: usize = 16_384;
pub const SPLIT_WORDS: usize = 16 + 3 * 64 + SPLIT_CAP;
/// Dynamic shared memory of the split form's resolve step: a histogram and the candidates' keys and positions.
pub const RESOLVE_SHARED_BYTES: usize = (2048 + 2 * SPLIT_CAP) * 4;
/// Rows up to which a caller may pick the split form (see [`split_applies`]).
pub const SPLIT_MAX_ROWS: usize = 512;

/// Whether the CUDA backend runs the split form for `rows` rows of `row_stride` scores and `k`: where it
/// was measured faster (H100, `bench/gpu/indexer_bench.py`, both forms on every decode shape): its four
/// launches cost ~15 us whatever the rows' length, the single form's one CTA per row ~15 us at 8K, ~33 us
/// at 32K and ~90 us at 128K positions up to a wave of rows. So: rows longer than `k` up to
/// [`MAX_SPLIT_STRIDE`], at most [`SPLIT_MAX_ROWS`] of them, and either at least 64K positions, or at least
/// 16K positions and at most one row per 512 positions (32K: up to 64 rows). The selections are the same in
/// either form, so the choice may depend on the batch.
pub fn split_applies(rows: usize, row_stride: usize, k: usize) -> bool {
    let fits = rows <= SPLIT_MAX_ROWS && row_stride > k && row_stride <= MAX_SPLIT_STRIDE;
    fits && (row_stride >= 16 * SLICE || (row_stride >= 4 * SLICE && rows <= row_stride / 512))
}

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
    /// 0 (the single form: one CTA per row), or `[rows][SPLIT_WORDS]` u32 of workspace for the split form
    /// (where [`split_applies`]): one CTA per row plans each row from its histogram, CTAs of 4096 positions
    /// count and collect the threshold bucket, one CTA per row resolves the threshold and each slice's
    /// output offset, and the slice CTAs emit. Both forms give the same selections (the rule decides them
    /// exactly); a row whose threshold bucket holds more than 16384 keys is finished by the plan step in the
    /// single form's way.
    pub split: u64,
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
    let common = [
        Arg::P(a.scores),
        Arg::L(a.row_stride as i64),
        Arg::P(a.lengths),
        Arg::I(a.k as i32),
        Arg::P(a.positions),
        Arg::P(a.counts),
        Arg::P(a.nan_counts),
    ];
    // Rows no longer than k select everything without reading a score: the single form does that alone.
    if a.split == 0 || a.row_stride <= a.k {
        let args: Vec<Arg> = common.iter().copied().chain([Arg::P(a.pre_hist)]).collect();
        return launch(gpu, "tandem_topk_rule", (a.rows as u32, 1, 1), THREADS, SHARED_BYTES as u32, &args);
    }
    if a.row_stride > MAX_SPLIT_STRIDE || a.rows > 65_535 {
        return Err(CudaError::Shape(format!(
            "split top-k: {} rows of stride {} (at most 65535 rows of at most {MAX_SPLIT_STRIDE})",
            a.rows, a.row_stride
        )));
    }
    let rows = a.rows as u32;
    let slices = (a.row_stride.div_ceil(SLICE) as u32, rows, 1);
    let plan: Vec<Arg> = common.iter().copied().chain([Arg::P(a.pre_hist), Arg::P(a.split)]).collect();
    launch(gpu, "tandem_topk_split_plan", (rows, 1, 1), THREADS, SHARED_BYTES as u32, &plan)?;
    let rows_args = [Arg::P(a.scores), Arg::L(a.row_stride as i64), Arg::P(a.lengths)];
    let scan: Vec<Arg> = rows_args.iter().copied().chain([Arg::P(a.split)]).collect();
    launch(gpu, "tandem_topk_split_scan", slices, SLICE_THREADS, 0, &scan)?;
    let resolve: Vec<Arg> = common.iter().copied().chain([Arg::P(a.split)]).collect();
    launch(gpu, "tandem_topk_split_resolve", (rows, 1, 1), THREADS, RESOLVE_SHARED_BYTES as u32, &resolve)?;
    let emit: Vec<Arg> =
        rows_args.iter().copied().chain([Arg::I(a.k as i32), Arg::P(a.positions), Arg::P(a.split)]).collect();
    launch(gpu, "tandem_topk_split_emit", slices, SLICE_THREADS, 0, &emit)
}

/// Which form of the kernels [`select_rows`] runs (the same selections either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// One CTA per row.
    Single,
    /// The split form (see [`RawTopk::split`]), with its workspace allocated for the call.
    Split,
}

/// Selects up to `k` positions of each of `rows` rows: row `r`'s candidates are positions
/// `0..lengths[r]` with scores at `scores[r * row_stride..]` (lengths above `row_stride` are clamped).
#[allow(clippy::too_many_arguments)]
pub fn select_rows(
    gpu: &Gpu,
    scores: &CudaSlice<f32>,
    row_stride: usize,
    lengths: &CudaSlice<i32>,
    rows: usize,
    k: usize,
    out: Selections<'_>,
    form: Form,
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
    if form == Form::Split && row_stride > MAX_SPLIT_STRIDE {
        return bad(format!("split top-k: row stride {row_stride} above {MAX_SPLIT_STRIDE}"));
    }
    if rows == 0 {
        return Ok(());
    }
    let st = gpu.stream();
    let plans = match form {
        Form::Single => None,
        Form::Split => Some(st.alloc_zeros::<u32>(rows * SPLIT_WORDS)?),
    };
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
        split: plans.as_ref().map_or(0, |p| p.device_ptr(st).0),
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
    fn run(gpu: &Gpu, batch: &Batch, k: usize, form: Form) -> Vec<(Vec<usize>, usize)> {
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
        select_rows(gpu, &scores, batch.stride, &lens, rows, k, out, form).unwrap();
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
            for form in [Form::Single, Form::Split] {
                let got = run(&gpu, &Batch { rows: rows.clone(), stride }, k, form);
                for (r, v) in rows.iter().enumerate() {
                    let want = select_counting_nan(v, k);
                    assert_eq!(got[r], want, "k={k} row {r} (len {}), {form:?}, seed {seed}", v.len());
                }
            }
        }
    }

    /// The split form's own edges: rows of 1..4 slices and partial last slices, a threshold bucket taken
    /// whole, ties at the threshold spread over several slices (the earliest left out, across slices), a
    /// bucket over its 16384 candidates (the plan step finishes that row), rows that take everything
    /// because of NaNs, and a row stride that is not a multiple of 4 (scalar loads).
    #[test]
    fn the_split_form_follows_the_rule_across_slices() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let k = 2048;
        let mut rows: Vec<Vec<f32>> = [4097usize, 8191, 12_288, 16_385, 40_000, 131_071]
            .iter()
            .enumerate()
            .map(|(i, &n)| row(&mut rng, n, i as u32 % 3))
            .collect();
        // 2048 distinct large scores, one per 8 positions, the rest small: the bucket of the smallest of them
        // is taken whole or nearly so.
        rows.push(
            (0..20_000usize)
                .map(|i| if i.is_multiple_of(8) && i / 8 < 2048 { 100.0 + i as f32 } else { 0.5 })
                .collect(),
        );
        // Ties at the threshold in every slice: 1000 sure keys, then the value 1.0 at every 5th position.
        let tie = |i: usize| match i {
            0..1000 => 9.0,
            _ if i.is_multiple_of(5) => 1.0,
            _ => -1.0,
        };
        rows.push((0..30_000).map(tie).collect());
        // One value everywhere (bucket of 20000 > 16384 candidates: the single form's path).
        rows.push(vec![0.25; 20_000]);
        // Mostly NaN: what is left is fewer than k, everything is taken.
        rows.push((0..10_000).map(|i| if i % 7 == 0 { i as f32 } else { f32::NAN }).collect());
        for stride in [131_071usize, 131_072] {
            let batch = Batch { rows: rows.clone(), stride };
            let got = run(&gpu, &batch, k, Form::Split);
            for (r, v) in rows.iter().enumerate() {
                let want = select_counting_nan(v, k);
                assert_eq!(got[r], want, "row {r} (len {}), stride {stride}, seed {seed}", v.len());
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
        for form in [Form::Single, Form::Split] {
            let got = run(&gpu, &Batch { stride: 8, rows: rows.clone() }, k, form);
            check_hand_made(&rows, &got, k);
        }
    }

    fn check_hand_made(rows: &[Vec<f32>], got: &[(Vec<usize>, usize)], k: usize) {
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
            for form in [Form::Single, Form::Split] {
                let got = run(&gpu, &Batch { rows: batch.clone(), stride: 9000 }, k, form).swap_remove(at);
                match &first {
                    None => first = Some(got),
                    Some(f) => assert_eq!(&got, f, "batch of {rows}, {form:?}, seed {seed}"),
                }
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
        let single = Form::Single;
        let err = |r: Result<(), CudaError>| r.unwrap_err().to_string();
        assert!(err(select_rows(&gpu, &scores, 60, &lens, 2, 4, sel!(), single)).contains("stride 60"));
        assert!(err(select_rows(&gpu, &scores, 50, &lens, 2, 5, sel!(), single)).contains("2 x 5"));
        assert!(select_rows(&gpu, &scores, 50, &lens, 2, 0, sel!(), single).is_err());
        let big = st.alloc_zeros::<f32>(2 * (MAX_SPLIT_STRIDE + 1)).unwrap();
        let (mut p2, stride) = (st.alloc_zeros::<i32>(8).unwrap(), MAX_SPLIT_STRIDE + 1);
        let out = Selections { positions: &mut p2, counts: &mut c, nan_counts: &mut nn };
        assert!(err(select_rows(&gpu, &big, stride, &lens, 2, 4, out, Form::Split)).contains("split top-k"));
    }
}
