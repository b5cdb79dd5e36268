//! Sparse MLA decode over the FP8 latent cache on the GPU (`engine/kernels/sparse_mla.cu`): each query's
//! absorbed q (576 bf16 per head) attends to its selected tokens' 656-byte entries, read through the block
//! table and dequantized in the kernel, with bf16 wgmma on the tensor cores (docs/model.md §2.2, §4).
//!
//! A query is a row of the decode step (a token, or its MTP draft, which sees one more position); each has
//! its own selection, causal length and block-table row. The work of a query is split into pieces of
//! [`SPLIT_TILES`] tiles of 64 selected tokens, a model constant: a query's splits depend only on its own
//! selection length, and [`launch`] adds them in split order, so its output does not depend on the batch.
//!
//! Prefill chunks take the staged form ([`stage`], then [`launch_staged`]): the chunk's context is converted
//! once per layer into bf16 rows, and the kernel copies each selected row (into FlashMLA's swizzled tile
//! layout) instead of gathering and dequantizing its FP8 entry, with the same wgmma instructions on the same
//! values, so the same bits (docs/model.md §2.2).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr};

use super::ops::{Arg, launch as launch_kernel};
use super::{CudaError, Gpu};
use crate::cache::BLOCK_SIZE;

/// The latent's dimensions: the FP8 entry's 512 quantized values plus 64 bf16 rope values.
pub const RANK: usize = 512;
pub const ROPE: usize = 64;
pub const DQK: usize = RANK + ROPE;
/// Bytes of one cache entry (SPEC §4).
pub const ENTRY: usize = 656;
/// Selected tokens per tile, heads per CTA.
pub const TILE: usize = 64;
pub const HEAD_BLOCK: usize = 64;
/// Tiles a CTA reduces before its result is combined with the query's other splits. 32 tiles is
/// DeepSeek-V3.2's whole top-k (2048): one split, no combine, on the serving path (bench/RESULTS.md shows
/// what smaller splits cost and give).
pub const SPLIT_TILES: usize = 32;
const THREADS: u32 = 384;

/// Must match `SMLA_SHARED_BYTES`: q (9 tiles of 64 x 64 bf16), two K/V buffers of 64 tokens x 576 bf16,
/// P (64 x 64 bf16), selected flags, rescale and normalizer rows, six mbarriers, alignment slack.
pub const SHARED_BYTES: usize = 73_728 + 2 * 73_728 + 8_192 + 512 + 256 + 256 + 48 + 1024;

/// The kernel a launch of `heads` heads takes: exactly two head blocks (DeepSeek-V3.2's 128 heads) run as
/// pairs of CTAs that share the gathering and dequantization of every tile (a cluster of two); any other
/// head count runs a CTA per head block.
pub fn kernel_for(heads: usize) -> &'static str {
    if heads.div_ceil(HEAD_BLOCK) == 2 { "tandem_sparse_mla_decode_pair" } else { "tandem_sparse_mla_decode" }
}

/// Splits of a query whose selection list holds `topk` entries.
pub const fn max_splits(topk: usize, split_tiles: usize) -> usize {
    let s = topk.div_ceil(TILE).div_ceil(split_tiles);
    if s == 0 { 1 } else { s }
}

/// One launch's device buffers as raw addresses (the backend's workspace hands out addresses).
#[derive(Debug, Clone, Copy)]
pub struct RawArgs {
    /// Absorbed queries, bf16 `[queries, heads, 576]`: `W_UK^T q_nope` (512) then `q_pe` (64).
    pub q: u64,
    pub queries: usize,
    pub heads: usize,
    /// One layer's latent region: `num_blocks` blocks of 64 entries of [`ENTRY`] bytes.
    pub latent: u64,
    pub num_blocks: usize,
    /// Physical block ids `[rows, max_blocks]`, logical block order.
    pub block_table: u64,
    pub max_blocks: usize,
    /// 0 (query `i` reads table row `i`), or `[queries]` table rows.
    pub query_row: u64,
    /// `[queries]` causal lengths: positions at or past a query's length are not attended to.
    pub ctx_len: u64,
    /// `[queries, topk]` selected positions; -1 (or any position outside the context) is skipped.
    pub sel: u64,
    pub topk: usize,
    /// 0, or `[queries]`: only the first `min(sel_len, topk)` entries of a query's list are read.
    pub sel_len: u64,
    pub split_tiles: usize,
    /// Softmax scale (`softmax_scale()`, mscale^2 included).
    pub scale: f32,
    /// `[queries, heads, 512]`: f32, or bf16 with `out_bf16`.
    pub out: u64,
    pub out_bf16: bool,
    /// 0, or `[queries, heads]` f32 log-sum-exp of the logits (-inf where nothing is selected).
    pub lse: u64,
    /// Where splits leave their results when a query has more than one: `queries * max_splits * heads * 512`
    /// f32 and `queries * max_splits * heads` f32 (0 when `max_splits(topk, split_tiles)` is 1).
    pub part_o: u64,
    pub part_lse: u64,
}

/// The staged prefill form's context rows: [`stage`] writes one per context position (its entry's values
/// as the decode kernel's producer stores them, bf16), [`launch_staged`] reads them.
#[derive(Debug, Clone, Copy)]
pub struct Staged {
    /// bf16 rows of [`DQK`] values, `rows` of them.
    pub rows_ptr: u64,
    pub rows: usize,
    /// `[queries]` i32: the row of each query's position 0 (its request's first staged row).
    pub row_base: u64,
}

/// Bytes of one staged row.
pub const STAGED_ROW_BYTES: usize = DQK * 2;

/// Queues the conversion of the entries at `slots` (`[rows]` i64 cache slots, block * 64 + offset; a slot
/// outside the region's `num_blocks` blocks or negative gives zeros) into `out`, `rows` staged rows.
pub fn stage(gpu: &Gpu, latent: u64, num_blocks: usize, slots: u64, rows: usize, out: u64) -> Result<(), CudaError> {
    if rows > i32::MAX as usize || num_blocks > i32::MAX as usize / BLOCK_SIZE {
        return Err(CudaError::Shape(format!("{rows} staged rows over {num_blocks} blocks")));
    }
    if rows == 0 {
        return Ok(());
    }
    if latent == 0 || slots == 0 || out == 0 {
        return Err(CudaError::Shape("staging needs the latent region, the slots and the output".into()));
    }
    launch_kernel(
        gpu,
        "tandem_sparse_mla_stage",
        (rows.div_ceil(4) as u32, 1, 1),
        256,
        0,
        &[Arg::P(latent), Arg::I(num_blocks as i32), Arg::P(slots), Arg::I(rows as i32), Arg::P(out)],
    )
}

/// [`launch`] over staged rows instead of the cache (`a.latent`, `a.num_blocks`, `a.block_table`,
/// `a.max_blocks` and `a.query_row` are not read): a query's position `p` is row `row_base[q] + p`, read only
/// where it is selected, inside the query's causal length and below `st.rows`. The output has the bits of
/// [`launch`] over the cache the rows were staged from, where every staged slot lay inside the pool (a slot
/// outside it stages zeros, which this form attends to and [`launch`] masks out; the backend stages only its
/// requests' own blocks).
pub fn launch_staged(gpu: &Gpu, a: &RawArgs, st: &Staged) -> Result<(), CudaError> {
    if st.rows > i32::MAX as usize {
        return Err(CudaError::Shape(format!("{} staged rows: at most {}", st.rows, i32::MAX)));
    }
    if a.queries > 0 && (st.row_base == 0 || (st.rows > 0 && st.rows_ptr == 0)) {
        return Err(CudaError::Shape("the staged form needs its rows and each query's first row".into()));
    }
    let staged = RawArgs {
        latent: st.rows_ptr,
        num_blocks: st.rows,
        block_table: 0,
        max_blocks: 0,
        query_row: st.row_base,
        ..*a
    };
    launch_as(gpu, &staged, STAGED_KERNEL, 1)
}

/// The staged form's kernel.
const STAGED_KERNEL: &str = "tandem_sparse_mla_prefill";

/// Queues the attention of every query: `out[q, h] = sum_t softmax_t(scale * q[q, h] . k_t) c_t` over the
/// query's selected, in-context tokens whose table entries lie in `0..num_blocks` (zeros, and an lse of
/// -inf, when there are none). Nothing outside the region and the given arrays is read.
pub fn launch(gpu: &Gpu, a: &RawArgs) -> Result<(), CudaError> {
    launch_as(gpu, a, kernel_for(a.heads), BLOCK_SIZE)
}

/// [`launch`] with the kernel named (the tests check that the forms give the same bits); `a.num_blocks` counts
/// units of `rows_per_block` rows (cache blocks of [`BLOCK_SIZE`] entries, or single staged rows), which the
/// kernel indexes as i32.
fn launch_as(gpu: &Gpu, a: &RawArgs, kernel: &str, rows_per_block: usize) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Shape(m));
    if a.heads == 0 || a.topk == 0 || a.split_tiles == 0 {
        return bad(format!(
            "{} heads, top-k {}, {} tiles per split: each must be at least 1",
            a.heads, a.topk, a.split_tiles
        ));
    }
    if a.queries > 65_535 || a.heads.div_ceil(HEAD_BLOCK) > 65_535 {
        return bad(format!("{} queries of {} heads: at most 65535 queries and head blocks", a.queries, a.heads));
    }
    let splits = max_splits(a.topk, a.split_tiles);
    if splits > 65_535 || a.topk > i32::MAX as usize || a.num_blocks > i32::MAX as usize / rows_per_block {
        return bad(format!("top-k {} ({splits} splits), {} blocks", a.topk, a.num_blocks));
    }
    if splits > 1 && (a.part_o == 0 || a.part_lse == 0) {
        return bad(format!("{splits} splits a query need split buffers"));
    }
    if a.queries == 0 {
        return Ok(());
    }
    if kernel == "tandem_sparse_mla_decode_pair" && a.heads.div_ceil(HEAD_BLOCK) != 2 {
        return bad(format!("the pair kernel takes two head blocks, not {} heads", a.heads));
    }
    launch_kernel(
        gpu,
        kernel,
        (a.heads.div_ceil(HEAD_BLOCK) as u32, a.queries as u32, splits as u32),
        THREADS,
        SHARED_BYTES as u32,
        &[
            Arg::P(a.q),
            Arg::I(a.heads as i32),
            Arg::P(a.latent),
            Arg::I(a.num_blocks as i32),
            Arg::P(a.block_table),
            Arg::I(a.max_blocks as i32),
            Arg::P(a.query_row),
            Arg::P(a.ctx_len),
            Arg::P(a.sel),
            Arg::I(a.topk as i32),
            Arg::P(a.sel_len),
            Arg::I(a.split_tiles as i32),
            Arg::F(a.scale),
            Arg::P(a.out),
            Arg::I(a.out_bf16 as i32),
            Arg::P(a.lse),
            Arg::P(a.part_o),
            Arg::P(a.part_lse),
            Arg::I(splits as i32),
        ],
    )?;
    if splits > 1 {
        launch_kernel(
            gpu,
            "tandem_sparse_mla_combine",
            (a.heads as u32, a.queries as u32, 1),
            128,
            0,
            &[
                Arg::P(a.part_o),
                Arg::P(a.part_lse),
                Arg::I(a.heads as i32),
                Arg::I(splits as i32),
                Arg::P(a.sel_len),
                Arg::I(a.topk as i32),
                Arg::I(a.split_tiles as i32),
                Arg::P(a.out),
                Arg::I(a.out_bf16 as i32),
                Arg::P(a.lse),
            ],
        )?;
    }
    Ok(())
}

/// One batch of queries for [`decode`], in device slices.
pub struct Args<'a> {
    /// bf16 bits `[queries, heads, 576]`.
    pub q: &'a CudaSlice<u16>,
    pub heads: usize,
    pub latent: &'a CudaView<'a, u8>,
    pub num_blocks: usize,
    /// `[queries, max_blocks]`: each query its own table row.
    pub block_table: &'a CudaSlice<i32>,
    pub max_blocks: usize,
    pub ctx_len: &'a CudaSlice<i32>,
    /// `[queries, topk]`.
    pub sel: &'a CudaSlice<i32>,
    pub topk: usize,
    pub sel_len: Option<&'a CudaSlice<i32>>,
    pub split_tiles: usize,
    pub scale: f32,
}

/// [`launch`] over checked device slices: the f32 output `[queries, heads, 512]` and lse `[queries, heads]`.
pub fn decode(gpu: &Gpu, a: &Args<'_>) -> Result<(CudaSlice<f32>, CudaSlice<f32>), CudaError> {
    decode_as(gpu, a, kernel_for(a.heads))
}

fn decode_as(gpu: &Gpu, a: &Args<'_>, kernel: &str) -> Result<(CudaSlice<f32>, CudaSlice<f32>), CudaError> {
    let bad = |m: String| Err(CudaError::Shape(m));
    let queries = a.ctx_len.len();
    if a.q.len() < queries * a.heads * DQK {
        return bad(format!("q holds {} values, {queries} queries x {} heads x {DQK} needed", a.q.len(), a.heads));
    }
    if a.latent.len() < a.num_blocks * BLOCK_SIZE * ENTRY {
        return bad(format!("latent region of {} bytes for {} blocks", a.latent.len(), a.num_blocks));
    }
    if a.block_table.len() < queries * a.max_blocks || a.sel.len() < queries * a.topk {
        return bad(format!("block table/selections shorter than {queries} queries"));
    }
    if a.sel_len.is_some_and(|s| s.len() < queries) {
        return bad(format!("selection lengths shorter than {queries} queries"));
    }
    let st = gpu.stream();
    let splits = max_splits(a.topk, a.split_tiles);
    let out = st.alloc_zeros::<f32>((queries * a.heads * RANK).max(1))?;
    let lse = st.alloc_zeros::<f32>((queries * a.heads).max(1))?;
    let part_o = st.alloc_zeros::<f32>(if splits > 1 { queries * splits * a.heads * RANK } else { 1 })?;
    let part_lse = st.alloc_zeros::<f32>(if splits > 1 { queries * splits * a.heads } else { 1 })?;
    let raw = RawArgs {
        q: a.q.device_ptr(st).0,
        queries,
        heads: a.heads,
        latent: a.latent.device_ptr(st).0,
        num_blocks: a.num_blocks,
        block_table: a.block_table.device_ptr(st).0,
        max_blocks: a.max_blocks,
        query_row: 0,
        ctx_len: a.ctx_len.device_ptr(st).0,
        sel: a.sel.device_ptr(st).0,
        topk: a.topk,
        sel_len: a.sel_len.map_or(0, |s| s.device_ptr(st).0),
        split_tiles: a.split_tiles,
        scale: a.scale,
        out: out.device_ptr(st).0,
        out_bf16: false,
        lse: lse.device_ptr(st).0,
        part_o: part_o.device_ptr(st).0,
        part_lse: part_lse.device_ptr(st).0,
    };
    launch_as(gpu, &raw, kernel, BLOCK_SIZE)?;
    Ok((out, lse))
}

#[cfg(test)]
mod tests {
    use rand::seq::SliceRandom;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cache::format::{decode_latent_fp8, encode_latent_fp8};

    /// A pool of random entries (values drawn as the reference kernels' tests draw them: randn / 10 plus an
    /// offset, quantized by the cache writer's encoder), and queries over it.
    struct Case {
        heads: usize,
        num_blocks: usize,
        max_blocks: usize,
        topk: usize,
        pool: Vec<u8>,
        /// Per query: q (bf16 bits), table row, causal length, selection (topk entries, -1 padded).
        q: Vec<Vec<u16>>,
        table: Vec<Vec<i32>>,
        ctx: Vec<i32>,
        sel: Vec<Vec<i32>>,
        sel_len: Option<Vec<i32>>,
    }

    fn case(rng: &mut ChaCha8Rng, heads: usize, ctxs: &[usize], topk: usize) -> Case {
        let max_blocks = ctxs.iter().map(|c| c.div_ceil(BLOCK_SIZE)).max().unwrap_or(1).max(1);
        let num_blocks = max_blocks * ctxs.len().max(1) + 3;
        let off = (rng.random::<f32>() - 0.5) / 10.0;
        let mut normal = crate::tiny::Normal(ChaCha8Rng::seed_from_u64(rng.random()));
        let mut pool = vec![0u8; num_blocks * BLOCK_SIZE * ENTRY];
        for e in pool.chunks_mut(ENTRY) {
            let c: Vec<f32> = (0..RANK).map(|_| normal.sample(0.1) + off).collect();
            let k: Vec<f32> = (0..ROPE).map(|_| normal.sample(0.1) + off).collect();
            encode_latent_fp8(&c, &k, e);
        }
        let mut q = Vec::new();
        let mut table = Vec::new();
        let mut sel = Vec::new();
        for &ctx in ctxs {
            q.push((0..heads * DQK).map(|_| half::bf16::from_f32(normal.sample(1.0)).to_bits()).collect());
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            ids.shuffle(rng);
            ids.truncate(max_blocks);
            table.push(ids);
            let mut pos: Vec<i32> = (0..ctx as i32).collect();
            pos.shuffle(rng);
            pos.truncate(topk);
            pos.sort_unstable();
            pos.resize(topk, -1);
            sel.push(pos);
        }
        Case {
            heads,
            num_blocks,
            max_blocks,
            topk,
            pool,
            q,
            table,
            ctx: ctxs.iter().map(|&c| c as i32).collect(),
            sel,
            sel_len: None,
        }
    }

    /// The attention of every query in f64 over the decoded (dequantized) cache: `[queries][heads * 512]`.
    fn reference(c: &Case, scale: f32) -> Vec<Vec<f64>> {
        (0..c.q.len())
            .map(|i| {
                let n = c.sel_len.as_ref().map_or(c.topk, |l| (l[i].max(0) as usize).min(c.topk));
                let mut keys = Vec::new();
                for &p in &c.sel[i][..n] {
                    if p < 0 || p >= c.ctx[i] {
                        continue;
                    }
                    let b = c.table[i][p as usize / BLOCK_SIZE];
                    if b < 0 || b as usize >= c.num_blocks {
                        continue;
                    }
                    let e = &c.pool[(b as usize * BLOCK_SIZE + p as usize % BLOCK_SIZE) * ENTRY..][..ENTRY];
                    let (mut cv, mut kv) = (vec![0f32; RANK], vec![0f32; ROPE]);
                    decode_latent_fp8(e, &mut cv, &mut kv);
                    cv.extend(kv);
                    keys.push(cv);
                }
                let mut out = vec![0f64; c.heads * RANK];
                if keys.is_empty() {
                    return out;
                }
                for h in 0..c.heads {
                    let q: Vec<f64> =
                        c.q[i][h * DQK..(h + 1) * DQK].iter().map(|&b| half::bf16::from_bits(b).to_f64()).collect();
                    let logits: Vec<f64> = keys
                        .iter()
                        .map(|k| q.iter().zip(k).map(|(a, b)| a * *b as f64).sum::<f64>() * scale as f64)
                        .collect();
                    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for (k, wk) in keys.iter().zip(&w) {
                        for d in 0..RANK {
                            out[h * RANK + d] += wk / sum * k[d] as f64;
                        }
                    }
                }
                out
            })
            .collect()
    }

    fn run(gpu: &Gpu, c: &Case, split_tiles: usize, scale: f32) -> Vec<Vec<f32>> {
        run_as(gpu, c, split_tiles, scale, kernel_for(c.heads))
    }

    fn run_as(gpu: &Gpu, c: &Case, split_tiles: usize, scale: f32, kernel: &str) -> Vec<Vec<f32>> {
        let st = gpu.stream();
        let q = st.clone_htod(&c.q.concat()).unwrap();
        let pool = st.clone_htod(&c.pool).unwrap();
        let view = pool.slice(..);
        let table = st.clone_htod(&c.table.concat()).unwrap();
        let ctx = st.clone_htod(&c.ctx).unwrap();
        let sel = st.clone_htod(&c.sel.concat()).unwrap();
        let sel_len = c.sel_len.as_ref().map(|l| st.clone_htod(l).unwrap());
        let args = Args {
            q: &q,
            heads: c.heads,
            latent: &view,
            num_blocks: c.num_blocks,
            block_table: &table,
            max_blocks: c.max_blocks,
            ctx_len: &ctx,
            sel: &sel,
            topk: c.topk,
            sel_len: sel_len.as_ref(),
            split_tiles,
            scale,
        };
        let (out, _) = decode_as(gpu, &args, kernel).unwrap();
        let host = st.clone_dtoh(&out).unwrap();
        host.chunks(c.heads * RANK).take(c.q.len()).map(|x| x.to_vec()).collect()
    }

    /// docs/model.md §6 (SPEC §6): elementwise abs 1e-3 or rel 2/128, and diff <= 5e-6, no NaN.
    fn check(got: &[f32], want: &[f64], what: &str) {
        assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(err < 1e-3 || err < 2.0 / 128.0 * w.abs(), "{what}: element {i}: {g} vs {w}");
        }
        let (ab, aa) = got
            .iter()
            .zip(want)
            .fold((0f64, 0f64), |(ab, aa), (&g, &w)| (ab + g as f64 * w, aa + (g as f64).powi(2) + w * w));
        let diff = if aa == 0.0 { 0.0 } else { 1.0 - 2.0 * ab / aa };
        assert!(diff <= 5e-6, "{what}: diff {diff:e}");
    }

    const SCALE: f32 = 0.041_666_67; // 1 / sqrt(576)

    #[test]
    fn matches_the_f64_reference_within_the_sparse_decode_tolerance() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        // Context below, at and above top-k, not a multiple of 64, length 1 and 0; 128 heads (two CTAs).
        let c = case(&mut rng, 128, &[1, 0, 63, 300, 2047, 2048, 2049, 5000], 2048);
        let want = reference(&c, SCALE);
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        for split in [SPLIT_TILES, 4, 1] {
            let got = run(&gpu, &c, split, SCALE);
            for (i, g) in got.iter().enumerate() {
                check(g, &want[i], &format!("query {i} (context {}), split {split}, seed {seed}", c.ctx[i]));
            }
            // The pair form (two CTAs sharing each tile's dequantization) and the single form: same bits.
            let single = run_as(&gpu, &c, split, SCALE, "tandem_sparse_mla_decode");
            assert!(bits(&got) == bits(&single), "pair and single forms differ, split {split}, seed {seed}");
        }
    }

    #[test]
    fn few_heads_short_selections_and_invalid_entries() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        // The tiny model's 4 heads and top-k 32; 192 heads (a partial last head block).
        for (heads, topk) in [(4, 32), (192, 256)] {
            let mut c = case(&mut rng, heads, &[40, 700, 1, 129], topk);
            // A draft row that sees one position more than the row before it, -1 holes, positions past the
            // context and a table entry outside the pool (all skipped), a short explicit selection length.
            c.sel[1][3] = -1;
            c.sel[1][5] = c.ctx[1] + 7;
            c.table[2][0] = c.num_blocks as i32 + 5;
            c.sel_len = Some(vec![topk as i32, 17, topk as i32, 0]);
            let want = reference(&c, SCALE);
            for split in [SPLIT_TILES, 1] {
                for (i, got) in run(&gpu, &c, split, SCALE).iter().enumerate() {
                    check(got, &want[i], &format!("{heads} heads, query {i}, split {split}, seed {seed}"));
                }
            }
            // Nothing usable: zeros, never NaN.
            let out = run(&gpu, &c, SPLIT_TILES, SCALE);
            assert!(out[2].iter().all(|&v| v == 0.0) && out[3].iter().all(|&v| v == 0.0), "seed {seed}");
        }
    }

    #[test]
    fn a_querys_output_does_not_depend_on_its_batch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let base = case(&mut rng, 128, &[3000], 2048);
        let filler = case(&mut rng, 128, &[3000, 2500, 4000], 2048);
        let alone = run(&gpu, &base, SPLIT_TILES, SCALE)[0].clone();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Batch sizes around the launch's edges (64 queries = 128 CTAs, about one per SM).
        for b in [2usize, 63, 64, 65, 128, 129, 256] {
            let pick = |v: &Vec<Vec<i32>>| (0..b).map(|i| v[i % 3].clone()).collect::<Vec<_>>();
            let mut c = Case {
                heads: 128,
                num_blocks: filler.num_blocks + base.num_blocks,
                max_blocks: filler.max_blocks.max(base.max_blocks),
                topk: 2048,
                pool: [filler.pool.clone(), base.pool.clone()].concat(),
                q: (0..b).map(|i| filler.q[i % 3].clone()).collect(),
                table: pick(&filler.table),
                ctx: (0..b).map(|i| filler.ctx[i % 3]).collect(),
                sel: pick(&filler.sel),
                sel_len: None,
            };
            // The base query at position b / 2, its table rebased onto its blocks after the filler's.
            let at = b / 2;
            c.q[at] = base.q[0].clone();
            c.sel[at] = base.sel[0].clone();
            c.ctx[at] = base.ctx[0];
            c.table[at] = base.table[0].iter().map(|&t| t + filler.num_blocks as i32).collect();
            for t in &mut c.table {
                t.resize(c.max_blocks, -1);
            }
            let got = run(&gpu, &c, SPLIT_TILES, SCALE);
            assert_eq!(bits(&got[at]), bits(&alone), "batch {b}: seed {seed}");
            // The staged form (prefill) in the same batch: the gathering form's bits alone.
            let (staged, _) = run_staged(&gpu, &c, SPLIT_TILES, SCALE);
            assert_eq!(bits(&staged[at]), bits(&alone), "batch {b}, staged form: seed {seed}");
        }
    }

    /// The staged form over `c`: each query's context rows staged from its table (positions 0..ctx), one
    /// block of rows a query, then [`launch_staged`]; the f32 outputs and the staged rows.
    fn run_staged(gpu: &Gpu, c: &Case, split_tiles: usize, scale: f32) -> (Vec<Vec<f32>>, Vec<u16>) {
        let st = gpu.stream();
        let mut slots: Vec<i64> = Vec::new();
        let mut base: Vec<i32> = Vec::new();
        for (i, &ctx) in c.ctx.iter().enumerate() {
            base.push(slots.len() as i32);
            slots.extend(
                (0..ctx as usize)
                    .map(|p| c.table[i][p / BLOCK_SIZE] as i64 * BLOCK_SIZE as i64 + (p % BLOCK_SIZE) as i64),
            );
        }
        let n = slots.len();
        let q = st.clone_htod(&c.q.concat()).unwrap();
        let pool = st.clone_htod(&c.pool).unwrap();
        let slots_d = st.clone_htod(&slots).unwrap();
        let base_d = st.clone_htod(&base).unwrap();
        let rows = st.alloc_zeros::<u16>((n * DQK).max(1)).unwrap();
        let ctx = st.clone_htod(&c.ctx).unwrap();
        let sel = st.clone_htod(&c.sel.concat()).unwrap();
        let sel_len = c.sel_len.as_ref().map(|l| st.clone_htod(l).unwrap());
        let queries = c.ctx.len();
        let splits = max_splits(c.topk, split_tiles);
        let out = st.alloc_zeros::<f32>(queries * c.heads * RANK).unwrap();
        let part_o = st.alloc_zeros::<f32>(if splits > 1 { queries * splits * c.heads * RANK } else { 1 }).unwrap();
        let part_lse = st.alloc_zeros::<f32>(if splits > 1 { queries * splits * c.heads } else { 1 }).unwrap();
        let p = |b: &CudaSlice<u8>| b.device_ptr(st).0;
        stage(gpu, p(&pool), c.num_blocks, slots_d.device_ptr(st).0, n, rows.device_ptr(st).0).unwrap();
        let raw = RawArgs {
            q: q.device_ptr(st).0,
            queries,
            heads: c.heads,
            latent: 0,
            num_blocks: 0,
            block_table: 0,
            max_blocks: 0,
            query_row: 0,
            ctx_len: ctx.device_ptr(st).0,
            sel: sel.device_ptr(st).0,
            topk: c.topk,
            sel_len: sel_len.as_ref().map_or(0, |s| s.device_ptr(st).0),
            split_tiles,
            scale,
            out: out.device_ptr(st).0,
            out_bf16: false,
            lse: 0,
            part_o: if splits > 1 { part_o.device_ptr(st).0 } else { 0 },
            part_lse: if splits > 1 { part_lse.device_ptr(st).0 } else { 0 },
        };
        let staged = Staged { rows_ptr: rows.device_ptr(st).0, rows: n, row_base: base_d.device_ptr(st).0 };
        launch_staged(gpu, &raw, &staged).unwrap();
        let host = st.clone_dtoh(&out).unwrap();
        let outs = host.chunks(c.heads * RANK).map(|x| x.to_vec()).collect();
        (outs, st.clone_dtoh(&rows).unwrap())
    }

    #[test]
    fn the_staged_form_gives_the_gathering_forms_bits() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // DeepSeek-V3.2's 128 heads (the gathering pair form) and top-k; the tiny model's 4 heads and top-k
        // 32; 192 heads (a partial head block).
        for (heads, topk, ctxs) in [
            (128, 2048, vec![3000, 2047, 2048, 2049, 64, 1, 4097]),
            (4, 32, vec![40, 700, 1, 129]),
            (192, 256, vec![300, 77]),
        ] {
            let mut c = case(&mut rng, heads, &ctxs, topk);
            // -1 holes, a position past the context, short and empty explicit selection lengths.
            c.sel[0][3] = -1;
            c.sel[1][5] = c.ctx[1] + 7;
            let mut lens = vec![topk as i32; ctxs.len()];
            lens[1] = 17;
            lens[ctxs.len() - 1] = 0;
            c.sel_len = Some(lens);
            for split in [SPLIT_TILES, 1] {
                let want = run(&gpu, &c, split, SCALE);
                let (got, _) = run_staged(&gpu, &c, split, SCALE);
                for i in 0..ctxs.len() {
                    assert!(
                        bits(&got[i]) == bits(&want[i]),
                        "{heads} heads, query {i}, split {split}: the staged form differs, seed {seed}"
                    );
                }
            }
        }
        // A staged row is what the gathering producer stores: the entry's values times 2^-56, exactly.
        let c = case(&mut rng, 4, &[70], 32);
        let (_, rows) = run_staged(&gpu, &c, SPLIT_TILES, SCALE);
        for p in [0usize, 5, 63, 64, 69] {
            let slot = c.table[0][p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE;
            let (mut cv, mut kv) = (vec![0f32; RANK], vec![0f32; ROPE]);
            decode_latent_fp8(&c.pool[slot * ENTRY..(slot + 1) * ENTRY], &mut cv, &mut kv);
            let want: Vec<f32> = cv.iter().chain(&kv).map(|v| v * 2f32.powi(-56)).collect();
            let got: Vec<f32> =
                rows[p * DQK..(p + 1) * DQK].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
            assert_eq!(got, want, "staged row {p}, seed {seed}");
        }
    }

    #[test]
    fn staging_a_slot_outside_the_pool_gives_zeros() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, _) = crate::cpu::test_support::rng();
        let c = case(&mut rng, 4, &[8], 32);
        let st = gpu.stream();
        let pool = st.clone_htod(&c.pool).unwrap();
        let slots = st.clone_htod(&[-1i64, (c.num_blocks * BLOCK_SIZE) as i64, 3]).unwrap();
        // Poisoned first: the kernel must write the zeros itself (the backend's workspace is not zeroed).
        let rows = st.clone_htod(&vec![0xffffu16; 3 * DQK]).unwrap();
        stage(&gpu, pool.device_ptr(st).0, c.num_blocks, slots.device_ptr(st).0, 3, rows.device_ptr(st).0).unwrap();
        let h = st.clone_dtoh(&rows).unwrap();
        assert!(h[..2 * DQK].iter().all(|&b| b == 0), "slots -1 and past the pool");
        assert!(h[2 * DQK..].iter().any(|&b| b != 0), "slot 3 holds an entry");
    }

    #[test]
    fn bad_shapes_are_errors() {
        let Some(gpu) = Gpu::for_test() else { return };
        let raw = RawArgs {
            q: 0,
            queries: 1,
            heads: 0,
            latent: 0,
            num_blocks: 1,
            block_table: 0,
            max_blocks: 1,
            query_row: 0,
            ctx_len: 0,
            sel: 0,
            topk: 2048,
            sel_len: 0,
            split_tiles: 32,
            scale: 1.0,
            out: 0,
            out_bf16: false,
            lse: 0,
            part_o: 0,
            part_lse: 0,
        };
        assert!(launch(&gpu, &raw).is_err(), "0 heads");
        assert!(launch(&gpu, &RawArgs { heads: 128, split_tiles: 4, ..raw }).is_err(), "splits without buffers");
        assert!(launch(&gpu, &RawArgs { heads: 128, queries: 70_000, ..raw }).is_err(), "too many queries");
        let staged = Staged { rows_ptr: 0, rows: 4, row_base: 0 };
        assert!(launch_staged(&gpu, &RawArgs { heads: 128, ..raw }, &staged).is_err(), "staged rows without addresses");
        assert!(stage(&gpu, 0, 1, 0, 4, 0).is_err(), "staging without buffers");
        assert!(stage(&gpu, 0, 1, 0, 0, 0).is_ok(), "nothing to stage");
    }
}
