//! Lightning-indexer scores on the GPU (`engine/kernels/indexer.cu`), decode and prefill: FP8 queries
//! against the paged FP8 key blocks through a block table, the products as FP8 wgmma on the tensor cores,
//! the heads summed in [`crate::cpu::indexer::head_sum`]'s order. Rows that share a block table (a token and
//! its MTP draft, the tokens of a prefill chunk) are scored in groups of up to [`MAX_GROUP`], so each key
//! block read from memory serves all of them.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr};

use super::ops::{Arg, launch};
use super::topk::HIST_WORDS;
use super::{CudaError, Gpu};
use crate::cache::BLOCK_SIZE;

/// Must match `IDX_BLOCKS_PER_CTA` (the grid: 8 blocks a CTA; in large launches groups, and single queries
/// over tables of 1024 blocks or more, take 16 and the surplus CTAs leave at once), `IDX_THREADS` and
/// `IDX_MAX_Q` in the kernel.
const BLOCKS_PER_CTA: usize = 8;
/// `IDX_BLOCKS_PER_CTA_GROUP`: the most blocks a CTA scores (its table entries in shared memory).
const MAX_BLOCKS_PER_CTA: usize = 16;
/// `IDX_STAGES` and `IDX_STAGES_GROUP4`: key stages of a launch whose largest group has `max_q` rows.
const fn stages(max_q: usize) -> usize {
    if max_q >= 4 { 2 } else { 3 }
}
/// `IDX_STAGE_BYTES`: a stage holds one 8448-byte block, 1024-byte aligned.
const STAGE_BYTES: usize = 9216;
const THREADS: u32 = 128;
/// The FP8 indexer block holds 128-wide keys; the MMA takes 64 heads (fewer are padded in the kernel).
pub const DIM: usize = 128;
pub const MAX_HEADS: usize = 64;
/// Rows of one request a CTA scores together.
pub const MAX_GROUP: usize = 4;

/// Dynamic shared memory of a launch whose largest group has `max_q` rows: slack to align the tiles to 1024
/// bytes, key stages of one 8448-byte block each (1024-byte aligned), q tiles of 8 KiB, the stages'
/// mbarriers, the CTA's checked table entries and the rows' lengths, the head weights, and each row's
/// first-digit counts (16-bit, two a word).
pub const fn shared_bytes(max_q: usize) -> usize {
    1024 + stages(max_q) * STAGE_BYTES
        + max_q * BLOCK_SIZE * DIM
        + stages(max_q) * 8
        + (MAX_BLOCKS_PER_CTA + MAX_GROUP) * 4
        + max_q * MAX_HEADS * 4
        + max_q * HIST_WORDS.div_ceil(2) * 4
}

/// The most blocks an indexer region may hold: the kernel addresses a block's first row of the tensor map
/// (66 rows a block) with a 32-bit signed coordinate.
pub const MAX_REGION_BLOCKS: usize = i32::MAX as usize / (BLOCK_SIZE + 2);

/// What the kernel may ask for (set on the function when the GPU is opened).
pub const MAX_SHARED_BYTES: usize = max(shared_bytes(MAX_GROUP), shared_bytes(MAX_GROUP - 1));

const fn max(a: usize, b: usize) -> usize {
    if a > b { a } else { b }
}

/// The scorer's groups, flattened `(first row, rows)` pairs, of `runs`: each run is a request's consecutive
/// rows in position order (`first`, `rows`), all reading the block table of the run's last row. Every
/// group is at most [`MAX_GROUP`] rows of one run, so a row's group depends only on its own request.
pub fn groups(runs: impl IntoIterator<Item = (usize, usize)>) -> Vec<i32> {
    let mut out = Vec::new();
    for (first, rows) in runs {
        let mut r = 0;
        while r < rows {
            let n = MAX_GROUP.min(rows - r);
            out.extend([(first + r) as i32, n as i32]);
            r += n;
        }
    }
    out
}

/// One launch's device buffers as raw addresses (the backend's workspace hands out addresses).
#[derive(Debug, Clone, Copy)]
pub struct RawScoreArgs {
    /// e4m3 codes `[rows, heads, 128]`.
    pub q: u64,
    /// Head weights `[rows, heads]`, every scale folded in (`weights_proj * heads^-0.5 * q_scale * 128^-0.5`).
    pub w: u64,
    /// At most 64; the kernel pads to 64 with zero heads (a zero head adds +0.0).
    pub heads: usize,
    /// One layer's indexer region: `num_blocks` blocks of 8448 bytes.
    pub index_blocks: u64,
    pub num_blocks: usize,
    /// Physical block ids `[rows, max_blocks]`, logical block order.
    pub block_table: u64,
    pub max_blocks: usize,
    /// Causal context length of each row.
    pub lengths: u64,
    /// [`groups`]' output on the device, `ngroups` pairs whose largest group has `max_q` rows.
    pub groups: u64,
    pub ngroups: usize,
    pub max_q: usize,
    /// `[rows, score_stride]`: row `r`'s scores at `r * score_stride`.
    pub scores: u64,
    pub score_stride: usize,
    /// 0, or [`HIST_WORDS`] zeroed words per row: the scorer counts each score's first radix digit of the
    /// top-k rule there (the top-k's [`super::topk::RawTopk::pre_hist`]).
    pub hist: u64,
}

/// Queues the scores of every row of `a.groups`: `scores[r * score_stride + s]` for `s < lengths[r]` (lengths
/// are clamped to `score_stride`). A table entry outside `0..num_blocks` (a caller's bug) gives NaN scores
/// for its 64 positions; whatever the table holds, no block outside the region is read.
pub fn launch_scores(gpu: &Gpu, a: &RawScoreArgs) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Shape(m));
    if a.num_blocks == 0 {
        return bad("an indexer region of 0 blocks".into());
    }
    if a.heads == 0 || a.heads > MAX_HEADS {
        return bad(format!("{} indexer heads: 1 to {MAX_HEADS}", a.heads));
    }
    if a.max_q == 0 || a.max_q > MAX_GROUP {
        return bad(format!("groups of {} rows: 1 to {MAX_GROUP}", a.max_q));
    }
    if a.ngroups > 65_535 || a.max_blocks > i32::MAX as usize {
        return bad(format!("{} groups (at most 65535 per launch), {} table entries a row", a.ngroups, a.max_blocks));
    }
    // The kernel's TMA row coordinate (66 rows a block) is a 32-bit signed integer.
    if a.num_blocks > MAX_REGION_BLOCKS {
        return bad(format!("an indexer region of {} blocks: at most {MAX_REGION_BLOCKS}", a.num_blocks));
    }
    if a.score_stride > a.max_blocks * BLOCK_SIZE {
        return bad(format!(
            "score stride {}: at most max_blocks x 64 = {}",
            a.score_stride,
            a.max_blocks * BLOCK_SIZE
        ));
    }
    if a.ngroups == 0 || a.score_stride == 0 {
        return Ok(());
    }
    // The region as the kernel's TMA boxes read it (encoded once per region and thread, then cached).
    let keys = super::gemm::TensorMap::index_blocks(a.index_blocks, a.num_blocks)?;
    launch(
        gpu,
        "tandem_indexer_scores",
        (a.max_blocks.div_ceil(BLOCKS_PER_CTA) as u32, a.ngroups as u32, 1),
        THREADS,
        shared_bytes(a.max_q) as u32,
        &[
            Arg::T(keys),
            Arg::P(a.q),
            Arg::P(a.w),
            Arg::I(a.heads as i32),
            Arg::P(a.block_table),
            Arg::I(a.max_blocks as i32),
            Arg::I(a.num_blocks as i32),
            Arg::P(a.lengths),
            Arg::P(a.groups),
            Arg::I(a.max_q as i32),
            Arg::P(a.scores),
            Arg::L(a.score_stride as i64),
            Arg::P(a.hist),
        ],
    )
}

/// One batch of rows for [`decode_scores`], in device slices.
pub struct ScoreArgs<'a> {
    /// e4m3 codes `[rows, heads, 128]`.
    pub q: &'a CudaSlice<u8>,
    /// Head weights `[rows, heads]`.
    pub w: &'a CudaSlice<f32>,
    pub heads: usize,
    /// One layer's indexer region: `num_blocks` blocks of 8448 bytes.
    pub index_blocks: &'a CudaView<'a, u8>,
    pub num_blocks: usize,
    /// Physical block ids `[rows, max_blocks]`, logical block order.
    pub block_table: &'a CudaSlice<i32>,
    pub max_blocks: usize,
    /// Causal context length of each row.
    pub lengths: &'a CudaSlice<i32>,
    pub rows: usize,
    /// [`groups`]' output: pairs of (first row, rows) over `0..rows`.
    pub groups: &'a CudaSlice<i32>,
    /// Where to count the top-k's first digit ([`RawScoreArgs::hist`]), zeroed, `rows x HIST_WORDS`.
    pub hist: Option<&'a CudaSlice<u32>>,
}

/// [`launch_scores`] over checked device slices.
pub fn decode_scores(
    gpu: &Gpu,
    a: &ScoreArgs<'_>,
    scores: &mut CudaSlice<f32>,
    score_stride: usize,
) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Shape(m));
    if a.q.len() < a.rows * a.heads * DIM || a.w.len() < a.rows * a.heads {
        return bad(format!("q/w hold {}/{} values, {} rows x {} heads needed", a.q.len(), a.w.len(), a.rows, a.heads));
    }
    if a.index_blocks.len() < a.num_blocks * BLOCK_SIZE * (DIM + 4) {
        return bad(format!("indexer region of {} bytes for {} blocks", a.index_blocks.len(), a.num_blocks));
    }
    if a.block_table.len() < a.rows * a.max_blocks || a.lengths.len() < a.rows {
        return bad(format!("block table/lengths shorter than {} rows x {} blocks", a.rows, a.max_blocks));
    }
    if scores.len() < a.rows * score_stride {
        return bad(format!("{} scores for {} rows of stride {score_stride}", scores.len(), a.rows));
    }
    if a.hist.is_some_and(|h| h.len() < a.rows * HIST_WORDS) {
        return bad(format!("a first-digit histogram needs {} words per row", HIST_WORDS));
    }
    let st = gpu.stream();
    let host_groups = st.clone_dtoh(a.groups)?;
    if host_groups.len() % 2 != 0 {
        return bad("groups are (first row, rows) pairs".into());
    }
    let mut max_q = 1;
    for p in host_groups.chunks(2) {
        let (first, n) = (p[0] as usize, p[1] as usize);
        if p[0] < 0 || n == 0 || n > MAX_GROUP || first + n > a.rows {
            return bad(format!("group ({}, {}) outside {} rows or over {MAX_GROUP}", p[0], p[1], a.rows));
        }
        max_q = max_q.max(n);
    }
    let raw = RawScoreArgs {
        q: a.q.device_ptr(st).0,
        w: a.w.device_ptr(st).0,
        heads: a.heads,
        index_blocks: a.index_blocks.device_ptr(st).0,
        num_blocks: a.num_blocks,
        block_table: a.block_table.device_ptr(st).0,
        max_blocks: a.max_blocks,
        lengths: a.lengths.device_ptr(st).0,
        groups: a.groups.device_ptr(st).0,
        ngroups: host_groups.len() / 2,
        max_q,
        scores: scores.device_ptr(st).0,
        score_stride,
        hist: a.hist.map_or(0, |h| h.device_ptr(st).0),
    };
    launch_scores(gpu, &raw)
}

#[cfg(test)]
mod tests {
    use rand::RngExt;
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cpu::indexer::scores as cpu_scores;
    use crate::fp8::e4m3_to_f32;

    const BLOCK_BYTES: usize = BLOCK_SIZE * (DIM + 4);

    /// An e4m3 code: any finite one, or (exact) one of +-1.0, +-1.5, whose products (1, 1.5, 2.25) and
    /// 128-term sums need at most 11 significant bits: exact in any order and within the FP8 tensor cores'
    /// accumulator precision, so the GPU and the CPU must agree bit for bit.
    fn code(rng: &mut ChaCha8Rng, exact: bool) -> u8 {
        if exact {
            (rng.random::<u8>() & 0x80) | (7 << 3) | (rng.random::<u8>() & 4)
        } else {
            loop {
                let c = rng.random::<u8>();
                if c & 0x7f != 0x7f {
                    return c;
                }
            }
        }
    }

    struct Case {
        heads: usize,
        num_blocks: usize,
        pool: Vec<u8>,
        rows: Vec<Row>,
    }

    struct Row {
        q: Vec<u8>,
        w: Vec<f32>,
        table: Vec<i32>,
        len: usize,
    }

    impl Case {
        /// Rows `rows` take row `from`'s block table (rows of one request: a group shares one table).
        fn share_table(&mut self, rows: std::ops::Range<usize>, from: usize) {
            let table = self.rows[from].table.clone();
            for r in &mut self.rows[rows] {
                r.table = table.clone();
            }
        }
    }

    fn case(rng: &mut ChaCha8Rng, heads: usize, lens: &[usize], exact: bool) -> Case {
        let max_blocks = lens.iter().map(|l| l.div_ceil(BLOCK_SIZE)).max().unwrap_or(1).max(1);
        let num_blocks = max_blocks * 2 + 3;
        let mut pool = vec![0u8; num_blocks * BLOCK_BYTES];
        for b in 0..num_blocks {
            let blk = &mut pool[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            for v in &mut blk[..BLOCK_SIZE * DIM] {
                *v = code(rng, exact);
            }
            for s in 0..BLOCK_SIZE {
                let scale = 2f32.powi(rng.random_range(-8..4));
                blk[BLOCK_SIZE * DIM + 4 * s..BLOCK_SIZE * DIM + 4 * s + 4].copy_from_slice(&scale.to_le_bytes());
            }
        }
        let rows = lens
            .iter()
            .map(|&len| {
                let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
                ids.shuffle(rng);
                ids.truncate(max_blocks);
                Row {
                    q: (0..heads * DIM).map(|_| code(rng, exact)).collect(),
                    w: (0..heads).map(|_| rng.random::<f32>() * 2.0 - 0.7).collect(),
                    table: ids,
                    len,
                }
            })
            .collect();
        Case { heads, num_blocks, pool, rows }
    }

    /// The CPU backend's scores of one row: keys decoded in logical order through the block table.
    fn cpu_row(c: &Case, r: &Row, real_heads: usize) -> Vec<f32> {
        let q: Vec<f32> = r.q[..real_heads * DIM].iter().map(|&b| e4m3_to_f32(b)).collect();
        let mut keys = Vec::with_capacity(r.len * DIM);
        let mut scales = Vec::with_capacity(r.len);
        for s in 0..r.len {
            let blk = &c.pool[r.table[s / BLOCK_SIZE] as usize * BLOCK_BYTES..][..BLOCK_BYTES];
            let off = s % BLOCK_SIZE;
            keys.extend(blk[off * DIM..(off + 1) * DIM].iter().map(|&b| e4m3_to_f32(b)));
            let at = BLOCK_SIZE * DIM + 4 * off;
            scales.push(f32::from_le_bytes(blk[at..at + 4].try_into().unwrap()));
        }
        cpu_scores(&q, &r.w[..real_heads], &keys, &scales, r.len, DIM)
    }

    /// Every row its own group (each row of these cases has its own block table).
    fn gpu_scores(gpu: &Gpu, c: &Case) -> Vec<Vec<f32>> {
        gpu_scores_grouped(gpu, c, &groups((0..c.rows.len()).map(|r| (r, 1))))
    }

    fn gpu_scores_grouped(gpu: &Gpu, c: &Case, grouping: &[i32]) -> Vec<Vec<f32>> {
        let d = OnDevice::new(gpu, c);
        let host = gpu.stream().clone_dtoh(&d.score(gpu, grouping, None)).unwrap();
        c.rows.iter().enumerate().map(|(i, r)| host[i * d.stride..i * d.stride + r.len].to_vec()).collect()
    }

    /// A case's buffers on the device.
    struct OnDevice {
        q: CudaSlice<u8>,
        w: CudaSlice<f32>,
        table: CudaSlice<i32>,
        lens: CudaSlice<i32>,
        pool: CudaSlice<u8>,
        heads: usize,
        num_blocks: usize,
        rows: usize,
        max_blocks: usize,
        stride: usize,
    }

    impl OnDevice {
        fn new(gpu: &Gpu, c: &Case) -> Self {
            let st = gpu.stream();
            let max_blocks = c.rows[0].table.len();
            OnDevice {
                q: st.clone_htod(&c.rows.iter().flat_map(|r| r.q.clone()).collect::<Vec<u8>>()).unwrap(),
                w: st.clone_htod(&c.rows.iter().flat_map(|r| r.w.clone()).collect::<Vec<f32>>()).unwrap(),
                table: st.clone_htod(&c.rows.iter().flat_map(|r| r.table.clone()).collect::<Vec<i32>>()).unwrap(),
                lens: st.clone_htod(&c.rows.iter().map(|r| r.len as i32).collect::<Vec<i32>>()).unwrap(),
                pool: st.clone_htod(&c.pool).unwrap(),
                heads: c.heads,
                num_blocks: c.num_blocks,
                rows: c.rows.len(),
                max_blocks,
                stride: max_blocks * BLOCK_SIZE,
            }
        }

        /// Scores `[rows, stride]` (NaN where a row is shorter), the first digits counted into `hist`.
        fn score(&self, gpu: &Gpu, grouping: &[i32], hist: Option<&CudaSlice<u32>>) -> CudaSlice<f32> {
            let st = gpu.stream();
            let view = self.pool.slice(..);
            let mut out = st.clone_htod(&vec![f32::NAN; self.rows * self.stride]).unwrap();
            let args = ScoreArgs {
                q: &self.q,
                w: &self.w,
                heads: self.heads,
                index_blocks: &view,
                num_blocks: self.num_blocks,
                block_table: &self.table,
                max_blocks: self.max_blocks,
                lengths: &self.lens,
                rows: self.rows,
                groups: &st.clone_htod(grouping).unwrap(),
                hist,
            };
            decode_scores(gpu, &args, &mut out, self.stride).unwrap();
            out
        }
    }

    #[test]
    fn exact_products_give_the_cpu_scores_bit_for_bit() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for heads in [64usize, 8, 4] {
            let c = case(&mut rng, heads, &[1, 63, 64, 65, 700, 2049], true);
            for (r, got) in c.rows.iter().zip(gpu_scores(&gpu, &c)) {
                let want = cpu_row(&c, r, heads);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "heads {heads} len {} seed {seed}",
                    r.len
                );
            }
        }
    }

    /// Launches of at least 1024 CTAs take 16 key blocks a CTA for groups of queries and for single queries
    /// over tables of at least 1024 blocks: each row still gets the CPU's bits.
    #[test]
    fn wide_spans_of_large_launches_give_the_cpu_scores_bit_for_bit() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        // A prefill group of four causal rows and a decode pair, each sharing a table, and six single rows:
        // eight groups over tables of 1100 blocks, 8 x 138 CTAs.
        let top = 1100 * BLOCK_SIZE;
        let lens = vec![
            top - 3,
            top - 2,
            top - 1,
            top,
            top - 64,
            top - 63,
            top,
            top - 1,
            top - 100,
            70_001,
            64 * 1024,
            top - 7,
        ];
        let mut c = case(&mut rng, 8, &lens, true);
        c.share_table(0..4, 3);
        c.share_table(4..5, 5);
        let grouping = groups([(0, 4), (4, 2)].into_iter().chain((6..lens.len()).map(|r| (r, 1))));
        assert!(grouping.len() / 2 * c.rows[0].table.len().div_ceil(BLOCKS_PER_CTA) >= 1024);
        for (r, got) in gpu_scores_grouped(&gpu, &c, &grouping).iter().enumerate() {
            let want = cpu_row(&c, &c.rows[r], 8);
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r} len {} (seed {seed})",
                c.rows[r].len
            );
        }
    }

    #[test]
    fn zero_padded_heads_change_nothing() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        // The tiny model's 4 heads, padded to 8 with zero queries and weights.
        let mut c = case(&mut rng, 8, &[300, 64], true);
        for r in &mut c.rows {
            r.q[4 * DIM..].fill(0);
            r.w[4..].fill(0.0);
        }
        for (r, got) in c.rows.iter().zip(gpu_scores(&gpu, &c)) {
            let want = cpu_row(&c, r, 4);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}");
        }
    }

    #[test]
    fn any_fp8_inputs_stay_within_the_indexer_tolerance() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let c = case(&mut rng, 64, &[5000, 129, 3], false);
        for (r, got) in c.rows.iter().zip(gpu_scores(&gpu, &c)) {
            let want = cpu_row(&c, r, 64);
            let (ab, aa) = got.iter().zip(&want).fold((0f64, 0f64), |(ab, aa), (&a, &b)| {
                (ab + a as f64 * b as f64, aa + (a as f64).powi(2) + (b as f64).powi(2))
            });
            let diff = 1.0 - 2.0 * ab / aa;
            // docs/model.md §6: indexer logits diff < 1e-3. The tensor cores sum the 128 products in
            // another order than the CPU, so only rounding differs: far below the bound.
            assert!(diff < 1e-6, "len {}: diff {diff:e} (seed {seed})", r.len);
            assert!(got.iter().all(|v| v.is_finite()), "seed {seed}");
        }
    }

    #[test]
    fn a_rows_scores_do_not_depend_on_its_batch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let probe = case(&mut rng, 64, &[1000], false);
        let mut first: Option<Vec<u32>> = None;
        for rows in [1usize, 63, 64, 65, 129] {
            // Row 0 has the probe's length, so every table has the probe's 16 blocks.
            let lens: Vec<usize> = (0..rows).map(|i| if i == 0 { 1000 } else { 1 + (i * 131) % 1000 }).collect();
            let mut c = case(&mut rng, 64, &lens, false);
            // The probe row, with its own keys copied into the blocks its table names.
            let at = rng.random_range(0..rows);
            let row = Row {
                q: probe.rows[0].q.clone(),
                w: probe.rows[0].w.clone(),
                table: c.rows[at].table.clone(),
                len: 1000,
            };
            for (lb, &phys) in row.table.iter().enumerate().take(1000usize.div_ceil(BLOCK_SIZE)) {
                let src = probe.rows[0].table[lb] as usize * BLOCK_BYTES;
                c.pool[phys as usize * BLOCK_BYTES..][..BLOCK_BYTES]
                    .copy_from_slice(&probe.pool[src..src + BLOCK_BYTES]);
            }
            c.rows[at] = row;
            let got: Vec<u32> = gpu_scores(&gpu, &c).swap_remove(at).iter().map(|v| v.to_bits()).collect();
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(&got, f, "batch of {rows} (seed {seed})"),
            }
        }
    }

    #[test]
    fn rows_of_one_request_score_the_same_in_any_grouping() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for exact in [true, false] {
            // A prefill chunk: 11 consecutive causal rows of one request (one table), then a decode pair.
            let lens: Vec<usize> = (0..11).map(|i| 1990 + 7 * i).chain([300, 301]).collect();
            let mut c = case(&mut rng, 64, &lens, exact);
            c.share_table(0..11, 10);
            c.share_table(11..12, 12);
            let single = gpu_scores(&gpu, &c);
            let grouped = gpu_scores_grouped(&gpu, &c, &groups([(0, 11), (11, 2)]));
            for (r, (a, b)) in single.iter().zip(&grouped).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "row {r} exact {exact} (seed {seed})");
                if exact {
                    assert_eq!(bits(a), bits(&cpu_row(&c, &c.rows[r], 64)), "row {r} vs the CPU (seed {seed})");
                }
            }
        }
        assert_eq!(groups([(0, 11), (11, 2)]), vec![0, 4, 4, 4, 8, 3, 11, 2]);
    }

    /// The top-k rule's first radix digit of a score (`topk_key.cuh`), or `HIST_WORDS - 1` for NaN.
    fn first_digit(v: f32) -> usize {
        if v.is_nan() {
            return HIST_WORDS - 1;
        }
        let b = if v == 0.0 { 0 } else { v.to_bits() };
        let key = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
        (key >> 21) as usize
    }

    #[test]
    fn the_scorer_counts_the_topk_first_digit_and_the_topk_starts_from_it() {
        use super::super::topk::{RawTopk, SPLIT_WORDS, launch_topk};
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let st = gpu.stream();
        // Long rows (the top-k has work to do), one with a table entry outside the region (NaN scores).
        let mut c = case(&mut rng, 64, &[5000, 2049, 3100, 64], false);
        c.rows[2].table[3] = c.num_blocks as i32 + 9;
        // Rows 0 and 1 share a table and are scored as a pair (the m64n128 path), rows 2 and 3 alone.
        c.share_table(1..2, 0);
        let d = OnDevice::new(&gpu, &c);
        let (rows, stride) = (d.rows, d.stride);
        let hist = st.alloc_zeros::<u32>(rows * HIST_WORDS).unwrap();
        let scores = d.score(&gpu, &groups([(0, 2), (2, 1), (3, 1)]), Some(&hist));
        let (got_hist, host) = (st.clone_dtoh(&hist).unwrap(), st.clone_dtoh(&scores).unwrap());
        for (r, row) in c.rows.iter().enumerate() {
            let mut want = vec![0u32; HIST_WORDS];
            for &v in &host[r * stride..r * stride + row.len] {
                want[first_digit(v)] += 1;
            }
            assert_eq!(&got_hist[r * HIST_WORDS..(r + 1) * HIST_WORDS], &want[..], "row {r} (seed {seed})");
        }
        // The top-k from the scorer's counts selects what it selects from its own pass.
        let k = 2048;
        // Both forms of the top-k (one CTA per row; the split form, which plans from the counts).
        let plans = st.alloc_zeros::<u32>(rows * SPLIT_WORDS).unwrap();
        let select = |pre: u64, split: u64| {
            let (pos, counts, nans) = (
                st.alloc_zeros::<i32>(rows * k).unwrap(),
                st.alloc_zeros::<i32>(rows).unwrap(),
                st.alloc_zeros::<i32>(rows).unwrap(),
            );
            let raw = RawTopk {
                scores: scores.device_ptr(st).0,
                row_stride: stride,
                lengths: d.lens.device_ptr(st).0,
                rows,
                k,
                positions: pos.device_ptr(st).0,
                counts: counts.device_ptr(st).0,
                nan_counts: nans.device_ptr(st).0,
                pre_hist: pre,
                split,
            };
            launch_topk(&gpu, &raw).unwrap();
            (st.clone_dtoh(&pos).unwrap(), st.clone_dtoh(&counts).unwrap(), st.clone_dtoh(&nans).unwrap())
        };
        let (own, from_scorer) = (select(0, 0), select(hist.device_ptr(st).0, 0));
        assert!(own == from_scorer, "seed {seed}");
        let split = select(hist.device_ptr(st).0, plans.device_ptr(st).0);
        assert!(own == split, "the split form differs (seed {seed})");
        assert_eq!(own.2[2], 64, "the bad block's 64 NaN scores are counted (seed {seed})");
    }

    #[test]
    fn a_table_entry_outside_the_region_gives_nan_scores_not_a_stray_read() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let mut c = case(&mut rng, 64, &[200], true);
        let bad = c.num_blocks as i32 + 5;
        let good = c.rows[0].table[1];
        c.rows[0].table[1] = bad;
        let got = gpu_scores(&gpu, &c).swap_remove(0);
        assert!(got[64..128].iter().all(|v| v.is_nan()), "block 1's positions are NaN (seed {seed})");
        c.rows[0].table[1] = good;
        let want = cpu_row(&c, &c.rows[0], 64);
        for s in (0..64).chain(128..200) {
            assert_eq!(got[s].to_bits(), want[s].to_bits(), "position {s} (seed {seed})");
        }
    }
}
