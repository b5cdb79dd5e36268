//! The routed experts on the tensor cores: the (token, slot) pairs the router picked are grouped by expert
//! (`engine/kernels/moe.cu`), and each of gate, up and down is one grouped FP8 GEMM over every expert at
//! once (`gemm.cu`, "Grouped products"): row tiles of one expert each, listed on the device, so an expert
//! with 3 tokens costs one partial tile and no padding rows.
//!
//! The launch is sized for the most tiles any routing of the batch can need ([`tile_slots`]) and reads the
//! grouping from device memory: nothing goes back to the host, and a step can be captured in a CUDA graph.
//!
//! Batch invariance: a pair's row is quantized from its token's row alone, and its products are computed as
//! a plain GEMM computes a row (the weight shape's chains, in K order); which tile or position it lands in,
//! the other rows and the tile's height and width change nothing (checked bit for bit against plain products
//! of each expert by `gemm::tests::grouped_rows_equal_each_experts_plain_product`, tiles of 64 and 128 rows).
//! The combine adds a token's experts in slot order.

use super::ops::{Arg, Workspace, elementwise_grid, launch};
use super::weights::{DLinear, DMlp, act_quant};
use super::{CudaError, Gpu, gemm};
use crate::config::{ModelConfig, ScoringFunc};

/// Threads of the planning CTA.
const PLAN_THREADS: u32 = 1024;
/// Most experts one grouping takes: the planning CTA's 12 bytes per expert plus its 8 static bytes stay
/// within the default 48 KiB of shared memory.
pub const MAX_EXPERTS: usize = (48 * 1024 - 8) / 12;

/// The most row tiles of `tile_rows` rows a grouped product of `pairs` rows over `experts` matrices can
/// need: every used expert's last tile may be partial.
pub fn tile_slots(pairs: usize, experts: usize, tile_rows: usize) -> usize {
    if pairs == 0 { 0 } else { pairs.div_ceil(tile_rows) + experts.min(pairs) }
}

/// The grouped GEMM's tile height for `pairs` rows over `experts` matrices: 64 rows (the decode tile,
/// gemm::Plan::bm) where the experts average at most 64 pairs, else 128. Every tile height gives the same
/// bits, so the choice may depend on the batch.
pub fn tile_rows(pairs: usize, experts: usize) -> usize {
    if gemm::small_tiles() && pairs <= gemm::BM_SMALL * experts { gemm::BM_SMALL } else { gemm::BM }
}

/// Workspace bytes of [`group`] and [`forward`] beyond the f32 buffers the per-pair path also needs: the
/// grouping's indices (slot of pair, source row, pair of row, cursors, tiles) and the two quantized
/// activations with their scales.
pub fn workspace_bytes(pairs: usize, experts: usize, hidden: usize, inter: usize) -> usize {
    let pad = |k: usize| k.div_ceil(gemm::BK) * gemm::BK;
    let ld = gemm::scale_ld(pairs);
    4 * (experts + 3 * pairs + 3 * tile_slots(pairs, experts, gemm::BM_SMALL))
        + pairs * (pad(hidden) + pad(inter))
        + 4 * ld * (pad(hidden) + pad(inter)) / gemm::BK
        + 4 * 256 // the workspace's alignment slack per buffer, roughly
}

/// A batch's pairs grouped by expert, in device memory.
#[derive(Debug, Clone, Copy)]
pub struct Grouping {
    /// Pairs (= rows of the grouped layout, those routed to no expert at the end, unused).
    pub pairs: usize,
    /// i32 `[pairs]`: the grouped row of pair p, or -1 (no expert).
    pub slot_of_pair: u64,
    /// i32 `[pairs]`: the token whose activations grouped row r takes.
    pub src_row: u64,
    /// i32 `[tile_slots][3]`: {first row, expert or -1, end row} per row tile of at most `tile_rows` rows.
    pub tiles: u64,
    pub tile_slots: usize,
    /// The GEMM's tile height the tiles are cut for ([`tile_rows`]).
    pub tile_rows: usize,
    /// i32: the grouped rows in use (the last expert's cursor, once scattered).
    pub used: u64,
    /// i32 `[pairs]`: the pair grouped row r holds (rows past `used`: unset).
    pub pair_of_row: u64,
}

/// Groups the `pairs` expert ids `ids` (i32, token-major, `k` per token) by expert, in row tiles of `rows`
/// (64 or 128; `None`: [`tile_rows`]).
pub fn group(
    gpu: &Gpu,
    ws: &mut Workspace,
    ids: u64,
    pairs: usize,
    k: usize,
    experts: usize,
    rows: Option<usize>,
) -> Result<Grouping, CudaError> {
    let rows = rows.unwrap_or_else(|| tile_rows(pairs, experts));
    // The planning CTA keeps three ints per expert in shared memory, within the 48 KiB default.
    if experts == 0
        || k == 0
        || !pairs.is_multiple_of(k)
        || experts > MAX_EXPERTS
        || ![gemm::BM_SMALL, gemm::BM].contains(&rows)
    {
        return Err(CudaError::Shape(format!(
            "moe: {pairs} pairs of {k} slots over {experts} experts in tiles of {rows} rows"
        )));
    }
    let s = gpu.stream();
    let slots = tile_slots(pairs, experts, rows);
    let cursor = ws.take::<i32>(s, experts)?;
    let slot_of_pair = ws.take::<i32>(s, pairs.max(1))?;
    let src_row = ws.take::<i32>(s, pairs.max(1))?;
    let tiles = ws.take::<i32>(s, 3 * slots.max(1))?;
    let pair_of_row = ws.take::<i32>(s, pairs.max(1))?;
    let used = cursor + 4 * (experts as u64 - 1);
    let g = Grouping { pairs, slot_of_pair, src_row, tiles, tile_slots: slots, tile_rows: rows, used, pair_of_row };
    if pairs == 0 {
        return Ok(g);
    }
    launch(
        gpu,
        "tandem_moe_plan",
        (1, 1, 1),
        PLAN_THREADS,
        (12 * experts) as u32,
        &[
            Arg::P(ids),
            Arg::I(pairs as i32),
            Arg::I(experts as i32),
            Arg::P(cursor),
            Arg::P(src_row),
            Arg::P(tiles),
            Arg::I(slots as i32),
            Arg::I(rows as i32),
        ],
    )?;
    let sms = gpu.info().multiprocessors.max(1) as usize;
    launch(
        gpu,
        "tandem_moe_scatter",
        (pairs.div_ceil(256).min(4 * sms) as u32, 1, 1),
        256,
        0,
        &[
            Arg::P(ids),
            Arg::I(pairs as i32),
            Arg::I(k as i32),
            Arg::I(experts as i32),
            Arg::P(cursor),
            Arg::P(slot_of_pair),
            Arg::P(src_row),
            Arg::P(pair_of_row),
        ],
    )?;
    Ok(g)
}

/// Routes `tokens` rows of gate logits `[tokens, n_routed_experts]` by `cfg`'s rule (docs/model.md §2.4;
/// `bias`: the e_score_correction_bias, 0 for none) into `ids` and `weights` `[tokens, k]` (ids ascending).
/// One CTA per token, a thread per expert (`tandem_route`).
pub fn route(
    gpu: &Gpu,
    cfg: &ModelConfig,
    logits: u64,
    bias: u64,
    tokens: usize,
    ids: u64,
    weights: u64,
) -> Result<(), CudaError> {
    let k = cfg.num_experts_per_tok;
    let experts = cfg.n_routed_experts;
    if experts == 0 || experts > 512 || cfg.n_group > 64 || cfg.n_group > experts || k > 32 {
        return Err(CudaError::Shape(format!(
            "routing {experts} experts in {} groups, {k} per token: 1 to 512 in at most 64 (and at most one group \
             per expert), 32 per token",
            cfg.n_group
        )));
    }
    launch(
        gpu,
        "tandem_route",
        (tokens as u32, 1, 1),
        experts.next_multiple_of(32) as u32,
        0,
        &[
            Arg::P(logits),
            Arg::P(bias),
            Arg::I(tokens as i32),
            Arg::I(cfg.n_routed_experts as i32),
            Arg::I(cfg.n_group as i32),
            Arg::I(cfg.topk_group as i32),
            Arg::I(k as i32),
            Arg::I((cfg.scoring_func == ScoringFunc::Sigmoid) as i32),
            Arg::I(cfg.norm_topk_prob as i32),
            Arg::F(cfg.routed_scaling_factor),
            Arg::P(ids),
            Arg::P(weights),
        ],
    )
}

/// Where a combine finds each pair's output row.
#[derive(Debug, Clone, Copy)]
pub enum PairRows {
    /// bf16 rows, pair p at row `slot[p]` (-1: none): the grouped experts and expert parallelism.
    Bf16 { rows: u64, slot: u64 },
    /// f32 rows, pair p at row p (the per-pair path), rounded to bf16 first with `round_bf16` (FP8 experts).
    F32 { rows: u64, round_bf16: bool },
}

/// `y [rows, hidden]` f32 = each row's pair outputs times `weights [rows, k]`, added in slot order, plus
/// `shared` (f32 `[rows, hidden]`, or 0). bf16 pairs: `tandem_moe_combine_bf16`, 8 channels a thread.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    pairs: PairRows,
    weights: u64,
    shared: u64,
    y: u64,
    rows: usize,
    k: usize,
    hidden: usize,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    let mut args = vec![Arg::P(0), Arg::P(weights), Arg::P(shared), Arg::P(y), Arg::I(k as i32), Arg::I(hidden as i32)];
    let (name, grid, threads) = match pairs {
        PairRows::Bf16 { rows: p, slot } => {
            args[0] = Arg::P(p);
            args.push(Arg::P(slot));
            ("tandem_moe_combine_bf16", (rows as u32, hidden.div_ceil(8 * 128) as u32, 1), 128)
        }
        PairRows::F32 { rows: p, round_bf16 } => {
            args[0] = Arg::P(p);
            args.extend([Arg::P(0), Arg::I(round_bf16 as i32)]);
            ("tandem_moe_combine", (rows as u32, 1, 1), 256)
        }
    };
    launch(gpu, name, grid, threads, 0, &args)
}

/// Whether the backend runs the routed experts grouped (the default; `TANDEM_MOE_GROUPED=0` runs one FP8
/// dot-product kernel per (token, expert) pair instead, the path the grouped one is checked against).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_MOE_GROUPED").map_or(true, |v| v != "0"))
}

/// Whether `m`'s stacked experts can run grouped: FP8 with DeepSeek's 128 x 128 blocks (their tensor maps
/// were encoded at load).
pub fn supported(m: &DMlp) -> bool {
    [&m.gate, &m.up, &m.down].iter().all(|l| matches!(l, DLinear::Fp8 { block: [128, 128], maps: Some(_), .. }))
}

/// `y [pairs, out] f32 (bf16 with bf16_out) = qa . w_e^T` per grouped row, `w_e` the row's expert's matrix
/// of the stacked `lin`, in output tiles `tile` (64 or 128) wide, or as wide as the batch calls for
/// (`None`): the same bits either way. With `out_rows` (device i32 `[pairs]`, 0 for none) grouped row r is
/// stored at row `out_rows[r]` of `y`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_linear(
    gpu: &Gpu,
    lin: &DLinear,
    qa: u64,
    sa_t: u64,
    scale_ld: usize,
    g: &Grouping,
    y: u64,
    bf16_out: bool,
    out_rows: u64,
    tile: Option<usize>,
) -> Result<(), CudaError> {
    let tile = tile.unwrap_or_else(|| {
        // The slots' rows: 64-row slots count half a 128-row tile, so 64-wide tiles (twice the CTAs) are taken
        // until half the slots fill the SMs - how the RESULTS.md measurements ran (the width never changes bits).
        gemm::tile_n(g.tile_slots * g.tile_rows, lin.out_features(), gpu.info().multiprocessors as usize)
    });
    let DLinear::Fp8 { codes, scales, out, inp, kpad, block: [128, 128], maps: Some(maps), .. } = lin else {
        return Err(CudaError::Shape(format!(
            "moe: grouped experts need FP8 weights with 128 x 128 blocks and K of at most {} (gemm::MAX_K_BLOCKS)",
            gemm::MAX_K_BLOCKS * gemm::BK
        )));
    };
    let groups = lin.groups();
    if groups == 0 || groups * out * kpad != codes.len() {
        return Err(CudaError::Shape(format!("moe: {} weight bytes are not matrices of {out} x {kpad}", codes.len())));
    }
    // Register stores: a grouped tile's rows end at its expert's, inside the TMA box.
    let plan = gemm::Plan { bm: g.tile_rows, tile, chains: gemm::chains(*out, *kpad), split: false, tma_store: false };
    let raw = gemm::RawGemm {
        qa,
        sa_t,
        scale_ld,
        w: codes.ptr(),
        ws: scales.ptr(),
        scale_cols: inp.div_ceil(gemm::BK),
        y,
        part: 0,
        bf16_out,
        rows: g.pairs,
        n: *out,
        kpad: *kpad,
        w_maps: Some(**maps),
        row_tiles: g.tiles,
        tile_slots: g.tile_slots,
        groups,
        out_rows,
    };
    gemm::launch(gpu, &raw, plan)
}

/// `down(silu(gate(x)) * up(x))` of every pair's expert into `y [pairs, hidden]` bf16, row
/// `slot_of_pair[p]` for pair p (the combine reads it there). `x [tokens, hidden]` f32.
pub fn forward(gpu: &Gpu, ws: &mut Workspace, m: &DMlp, x: u64, g: &Grouping, y: u64) -> Result<(), CudaError> {
    if g.pairs == 0 {
        return Ok(());
    }
    let (hidden, kpad_h, ue8m0_h) = fp8_dims(&m.gate)?;
    let ld = gemm::scale_ld(g.pairs);
    let (qa, sa) = act_quant(gpu, ws, x, g.pairs, hidden, kpad_h, ue8m0_h, ld, g.src_row)?;
    forward_quantized(gpu, ws, m, qa, sa, ld, g, y, 0)
}

/// `(in_features, kpad, ue8m0)` of an FP8 expert matrix.
pub fn fp8_dims(l: &DLinear) -> Result<(usize, usize, bool), CudaError> {
    match l {
        DLinear::Fp8 { inp, kpad, ue8m0, .. } => Ok((*inp, *kpad, *ue8m0)),
        DLinear::Dense { .. } | DLinear::Bf16 { .. } => {
            Err(CudaError::Shape("moe: grouped experts need FP8 weights".into()))
        }
    }
}

/// [`forward`] from the grouped rows already quantized: `qa [pairs, kpad]` FP8 codes with their scales
/// `sa [kpad / 128, ld]` (expert parallelism gathers them from the ranks' dispatch records). With
/// `out_rows` (0 for none) grouped row r's output goes to row `out_rows[r]` of `y`.
#[allow(clippy::too_many_arguments)]
pub fn forward_quantized(
    gpu: &Gpu,
    ws: &mut Workspace,
    m: &DMlp,
    qa: u64,
    sa: u64,
    ld: usize,
    g: &Grouping,
    y: u64,
    out_rows: u64,
) -> Result<(), CudaError> {
    if g.pairs == 0 {
        return Ok(());
    }
    let s = gpu.stream();
    let (inter, kpad_i, ue8m0_i) = fp8_dims(&m.down)?;
    let gate = ws.take::<f32>(s, g.pairs * inter)?;
    let up = ws.take::<f32>(s, g.pairs * inter)?;
    grouped_linear(gpu, &m.gate, qa, sa, ld, g, gate, false, 0, None)?;
    grouped_linear(gpu, &m.up, qa, sa, ld, g, up, false, 0, None)?;
    let n = g.pairs * inter;
    launch(
        gpu,
        "tandem_silu_mul",
        elementwise_grid(n),
        256,
        0,
        &[Arg::P(gate), Arg::P(up), Arg::P(gate), Arg::L(n as i64)],
    )?;
    let (qh, sh) = act_quant(gpu, ws, gate, g.pairs, inter, kpad_i, ue8m0_i, ld, 0)?;
    grouped_linear(gpu, &m.down, qh, sh, ld, g, y, true, out_rows, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_slots_cover_every_routing() {
        assert_eq!(tile_slots(0, 256, 128), 0);
        // One token, 8 experts: 8 partial tiles.
        assert_eq!(tile_slots(8, 256, 128), 1 + 8);
        // Every expert used, one of them with the rest: ceil(pairs / 128) full tiles plus a partial per expert.
        for rows in [64, 128] {
            for (pairs, experts) in [(2048, 256), (65536, 256), (300, 4), (129, 1)] {
                let worst = (0..experts)
                    .map(|e| if e == 0 { pairs - (experts - 1).min(pairs - 1) } else { usize::from(e < pairs) })
                    .map(|c: usize| c.div_ceil(rows))
                    .sum::<usize>();
                assert!(
                    tile_slots(pairs, experts, rows) >= worst,
                    "{pairs} pairs over {experts} experts: {worst} tiles"
                );
            }
        }
        // Decode-sized groupings take the 64-row tile (unless TANDEM_GEMM_SMALL_TILES=0).
        if gemm::small_tiles() {
            assert_eq!(tile_rows(64 * 8, 32), 64);
            assert_eq!(tile_rows(8, 256), 64);
        }
        assert_eq!(tile_rows(4096 * 8, 32), 128);
    }
}
