//! The FP8 block-scaled GEMM on Hopper (`engine/kernels/gemm.cu`): `y = (qa . w^T)` with 1 x 128 activation
//! scales and 128 x 128 weight-block scales (docs/model.md §2.1), e4m3 wgmma on the tensor cores fed by TMA,
//! f32 or bf16 out.
//!
//! Operands reach the kernel as TMA tensor maps ([`TensorMap`]): the activation codes `[rows, kpad]` and
//! the weight codes `[n, kpad]` (K-major, 128-byte swizzle, zero fill past the edges), and the activation
//! scales in the transposed layout `[kpad / 128, scale_ld]` that `tandem_act_quant` writes when given a
//! scale stride ([`scale_ld`]), so one K block's scales of 128 rows are one contiguous TMA box.
//!
//! Batch invariance: an output element is the same operations in every launch (four k32 steps per K block,
//! promoted in K order into one f32 accumulator per chain, the weight shape's chains added left to right);
//! what depends on M (the tile height [`Plan::bm`], the width [`tile_n`], whether the chains run split, the
//! persistent grid) changes which CTA computes it, not its bits (tested).

use cudarc::driver::{DeviceRepr, PushKernelArg, sys};

use super::ops::Arg;
use super::{CudaError, Gpu};

/// Rows of an output tile, K per block (and per activation scale).
pub const BM: usize = 128;
pub const BK: usize = 128;
/// Rows of a small product's tile ([`Plan::bm`]): one consumer warpgroup, and the shared memory of the
/// 128-row tile's second half of activations as more stages of weights in flight.
pub const BM_SMALL: usize = 64;

/// Whether small products take [`BM_SMALL`]-row tiles (the default; `TANDEM_GEMM_SMALL_TILES=0` keeps every
/// product on 128-row tiles: the same bits, for A/B measurements).
pub fn small_tiles() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_GEMM_SMALL_TILES").map_or(true, |v| v != "0"))
}

/// The most K blocks a product may have: a consumer warpgroup keeps its unit's weight scales in shared
/// memory (`GEMM_MAX_KB`; K up to 32768).
pub const MAX_K_BLOCKS: usize = 256;

/// Threads per CTA: a producer warpgroup and a consumer warpgroup per 64 rows of the tile.
const fn threads(bm: usize) -> u32 {
    (128 * (1 + bm / 64)) as u32
}

/// Whether plain products on 128-row tiles store their output through shared memory with TMA (the default;
/// `TANDEM_GEMM_TMA_STORE=0` keeps the register stores: the same bits, for A/B measurements).
pub fn tma_store() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TANDEM_GEMM_TMA_STORE").map_or(true, |v| v != "0"))
}

/// Pipeline stages per tile height, width and output type (`GEMM_STAGES_128_F32`, `GEMM_STAGES_128_BF16`,
/// `GEMM_STAGES_64_F32`, `GEMM_STAGES_64_BF16`, `GEMM_STAGES_M64_128`, `GEMM_STAGES_M64_64` in the kernel): as
/// many as fit the shared memory, beside a 128-row tile's output tile (the TMA store's).
pub const fn stages(bm: usize, bn: usize, bf16_out: bool) -> usize {
    match (bm, bn, bf16_out) {
        (BM, 128, false) => 4,
        (BM, 128, true) => 5,
        (BM, _, false) => 7,
        (BM, _, true) => 8,
        (_, 128, _) => 9,
        _ => 13,
    }
}

/// Row scales per TMA box (`GEMM_SA_BOX`): a row tile's 128, loaded from its first row rounded down to a
/// multiple of 4 (a box starts 16-byte aligned; a grouped product's row tiles start at any row).
pub const SCALE_BOX: usize = BM + 4;

/// Must match the kernel's layout: alignment slack, the stages (A [bm x 128] + B [bn x 128] codes), a 128-row
/// tile's output tile (f32 or bf16), one K block's row scales per stage (a box, in a slot of a multiple of 128
/// bytes), two mbarriers per stage, and (16-byte aligned) each consumer warpgroup's weight scales.
pub const fn smem_bytes(bm: usize, bn: usize, bf16_out: bool) -> usize {
    let out = if bm == BM { bm * bn * if bf16_out { 2 } else { 4 } } else { 0 };
    1024 + stages(bm, bn, bf16_out) * (bm * BK + bn * BK + (SCALE_BOX * 4).next_multiple_of(128) + 16)
        + out
        + 16
        + bm / 64 * MAX_K_BLOCKS * 4
}

/// Row stride of the transposed activation scales for `rows` rows (a multiple of 4 floats: TMA strides are
/// multiples of 16 bytes).
pub const fn scale_ld(rows: usize) -> usize {
    rows.div_ceil(4) * 4
}

/// Output tile width for an `m x n` product: 128 where 128-wide tiles give every SM one, else 64. Only the
/// grid and the CTA that computes an element depend on it.
pub fn tile_n(m: usize, n: usize, sms: usize) -> usize {
    if m.div_ceil(BM) * n.div_ceil(128) >= sms { 128 } else { 64 }
}

/// The SM count chains are sized for: an H100's (132, an H200's too). Fixed, not the device's, so that every
/// GPU computes a weight shape's products with the same chains and the same bits (a prefill worker's caches
/// and a decode worker's steps agree even on different GPU models).
pub const CHAIN_SMS: usize = 132;

/// Chains of a weight shape: K is cut into this many fixed ranges, each summed in K order, and the chains
/// are added left to right (docs/model.md §2.1). A function of the weight shape only, never of M or the
/// device: enough chains that a one-row-tile product of 64-wide tiles gives each of [`CHAIN_SMS`] SMs a unit
/// (up to 16, and at most one per K block). Every launch of the shape computes the same chains, split or not.
pub fn chains(n: usize, kpad: usize) -> usize {
    let pairs = n.div_ceil(64).div_ceil(2).max(1);
    ((CHAIN_SMS / 2) / pairs).clamp(1, 16).min((kpad / BK).max(1))
}

/// The smallest weight (codes, bytes) whose small products split: DeepSeek-V3.2's smallest projection, the
/// indexer's wk (0.9 MB), gains 1.5x from splitting on an H100 (bench/RESULTS.md); the tiny model's weights
/// (at most 128 KB) are launch-bound, where the combine's launch costs more than the split saves.
pub const SPLIT_MIN_BYTES: usize = 512 << 10;

/// How one product runs: the tile height and width, the weight shape's chains, whether the chains run as
/// separate units (`split`: each writes its sum to a partial buffer, a second kernel adds them in chain
/// order; for products too small to fill the GPU otherwise) or one after another inside each tile, and how
/// the output is stored. Every plan gives the same bits: a 64-row tile runs the same wgmma per 64 rows as a
/// 128-row one, with one consumer warpgroup instead of two and the shared memory they free as more stages
/// in flight; a stored value is the same whichever way it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Rows of a tile: [`BM`], or [`BM_SMALL`] for products of at most that many rows (decode): their
    /// weights stream through more stages instead of beside 128-row activation tiles of padding.
    pub bm: usize,
    pub tile: usize,
    pub chains: usize,
    pub split: bool,
    /// A plain unsplit product on 128-row tiles writes each output tile into shared memory and stores it
    /// with TMA, asynchronously (full 128-byte lines; the consumers go on with their next tile): measured
    /// up to 1.6x faster from M = 1024 than each thread storing its registers (small K; 1.0-1.05x at large K;
    /// bench/RESULTS.md). Ignored elsewhere, and where TMA cannot address the output ([`stores_with_tma`]).
    pub tma_store: bool,
}

impl Plan {
    pub fn new(rows: usize, n: usize, kpad: usize, sms: usize) -> Self {
        let chains = chains(n, kpad);
        // Split where an unsplit launch would leave SMs idle, and only for up to two row tiles: the chains'
        // partial sums cost 8 bytes per row, column and chain (measured on kv_a, 13 chains: 1.4x faster
        // than unsplit at M <= 256, 1.8x slower at 1024).
        // Weights under SPLIT_MIN_BYTES stay unsplit: their time is the launches', which a second kernel
        // (the combine) only adds to.
        let idle = rows.div_ceil(BM) * n.div_ceil(64).div_ceil(2) < sms / 2;
        let split = chains > 1 && idle && rows <= 2 * BM && n * kpad >= SPLIT_MIN_BYTES;
        let bm = if rows <= BM_SMALL && small_tiles() { BM_SMALL } else { BM };
        Plan { bm, tile: if split { 64 } else { tile_n(rows, n, sms) }, chains, split, tma_store: tma_store() }
    }

    /// f32 values of the partial buffer a split launch needs (0 when not split).
    pub fn partial_len(&self, rows: usize, n: usize) -> usize {
        if self.split { self.chains * rows * n } else { 0 }
    }
}

/// The entry point for a tile height, width, output type and whether the chains run one after another inside
/// each tile (`chained`: more than one chain, unsplit). 128-row tiles have a kernel without in-tile chains,
/// whose consumers keep no running total (64 registers a thread that the K loop's addresses then use: with
/// the loop's other changes 1.1-1.15x at M >= 1024, bench/RESULTS.md), and one with them; 64-row tiles one
/// kernel for both. `None`: no such tile.
pub fn kernel_name(bm: usize, bn: usize, bf16_out: bool, chained: bool) -> Option<&'static str> {
    Some(match (bm, bn, bf16_out, chained) {
        (128, 128, false, false) => "tandem_gemm_fp8_n128_f32",
        (128, 128, true, false) => "tandem_gemm_fp8_n128_bf16",
        (128, 64, false, false) => "tandem_gemm_fp8_n64_f32",
        (128, 64, true, false) => "tandem_gemm_fp8_n64_bf16",
        (128, 128, false, true) => "tandem_gemm_fp8_n128_f32_chains",
        (128, 128, true, true) => "tandem_gemm_fp8_n128_bf16_chains",
        (128, 64, false, true) => "tandem_gemm_fp8_n64_f32_chains",
        (128, 64, true, true) => "tandem_gemm_fp8_n64_bf16_chains",
        (64, 128, false, _) => "tandem_gemm_fp8_m64_n128_f32",
        (64, 128, true, _) => "tandem_gemm_fp8_m64_n128_bf16",
        (64, 64, false, _) => "tandem_gemm_fp8_m64_n64_f32",
        (64, 64, true, _) => "tandem_gemm_fp8_m64_n64_bf16",
        _ => return None,
    })
}

/// Every entry point with its dynamic shared memory (the device raises each one's limit at load).
pub const KERNELS: [(&str, usize); 12] = [
    ("tandem_gemm_fp8_n128_f32", smem_bytes(128, 128, false)),
    ("tandem_gemm_fp8_n128_bf16", smem_bytes(128, 128, true)),
    ("tandem_gemm_fp8_n64_f32", smem_bytes(128, 64, false)),
    ("tandem_gemm_fp8_n64_bf16", smem_bytes(128, 64, true)),
    ("tandem_gemm_fp8_n128_f32_chains", smem_bytes(128, 128, false)),
    ("tandem_gemm_fp8_n128_bf16_chains", smem_bytes(128, 128, true)),
    ("tandem_gemm_fp8_n64_f32_chains", smem_bytes(128, 64, false)),
    ("tandem_gemm_fp8_n64_bf16_chains", smem_bytes(128, 64, true)),
    ("tandem_gemm_fp8_m64_n128_f32", smem_bytes(64, 128, false)),
    ("tandem_gemm_fp8_m64_n128_bf16", smem_bytes(64, 128, true)),
    ("tandem_gemm_fp8_m64_n64_f32", smem_bytes(64, 64, false)),
    ("tandem_gemm_fp8_m64_n64_bf16", smem_bytes(64, 64, true)),
];

type MapKey = (u64, u32, usize, usize, usize, usize, u32);
/// Encoded maps kept per thread (cleared when full).
const MAP_CACHE: usize = 4096;
thread_local! {
    static MAPS: std::cell::RefCell<std::collections::HashMap<MapKey, TensorMap>> = Default::default();
}

/// A CUDA tensor map, passed to the kernel by value (`__grid_constant__`).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct TensorMap(sys::CUtensorMap);

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorMap(..)")
    }
}

// SAFETY: a plain 128-byte struct the kernel declares with the same size and a compatible alignment
// (`TandemTensorMap` in sync.cuh).
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// A 2-D map of `rows x cols` elements of `dtype` (`elem` bytes each) at `ptr` with row stride `ld`
    /// elements, loaded in boxes of `box_rows x box_cols`.
    #[allow(clippy::too_many_arguments)]
    fn encode(
        ptr: u64,
        dtype: sys::CUtensorMapDataType,
        elem: usize,
        rows: usize,
        cols: usize,
        ld: usize,
        box_rows: usize,
        box_cols: usize,
        swizzle: sys::CUtensorMapSwizzle,
    ) -> Result<Self, CudaError> {
        if !ptr.is_multiple_of(16) || !(ld * elem).is_multiple_of(16) || rows == 0 || cols == 0 {
            return Err(CudaError::Shape(format!(
                "tensor map: address {ptr:#x} and row stride {} bytes must be 16-byte aligned, {rows} x {cols} \
                 non-empty",
                ld * elem
            )));
        }
        // A map is a pure function of these arguments; encoding one costs ~5 us of host time, which a
        // decode step would pay for every activation of every linear (the workspace hands out the same
        // addresses step after step), so encoded maps are kept per thread.
        let key = (ptr, dtype as u32, rows, cols, ld, box_rows * 1024 + box_cols, swizzle as u32);
        if let Some(m) = MAPS.with(|c| c.borrow().get(&key).copied()) {
            return Ok(m);
        }
        let dims = [cols as u64, rows as u64];
        let strides = [(ld * elem) as u64];
        let boxes = [box_cols as u32, box_rows as u32];
        let elem_strides = [1u32, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer argument points at a live array of the rank's length; the driver only writes
        // `map`.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                dtype,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver(format!("cuTensorMapEncodeTiled ({rows} x {cols}, box {box_rows}): {r:?}")));
        }
        // SAFETY: the driver initialized it (zeroed before, so no uninitialized bytes either way).
        let map = TensorMap(unsafe { map.assume_init() });
        MAPS.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= MAP_CACHE {
                c.clear();
            }
            c.insert(key, map);
        });
        Ok(map)
    }

    /// FP8 codes `[rows, kpad]`, boxes of `box_rows x 128` bytes in the 128-byte swizzle wgmma reads.
    pub fn codes(ptr: u64, rows: usize, kpad: usize, box_rows: usize) -> Result<Self, CudaError> {
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            1,
            rows,
            kpad,
            kpad,
            box_rows,
            BK,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    }

    /// An indexer region of `num_blocks` 8448-byte blocks as rows of 128 bytes (a block is 66: its 64 keys,
    /// then 2 rows of scales), boxes of one block in the 128-byte swizzle wgmma reads
    /// (`engine/kernels/indexer.cu`).
    pub fn index_blocks(ptr: u64, num_blocks: usize) -> Result<Self, CudaError> {
        let rows = crate::cache::BLOCK_SIZE + 2;
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            1,
            num_blocks * rows,
            BK,
            BK,
            rows,
            BK,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    }

    /// A product's output `[rows, n]`, f32 or bf16, for the TMA store: boxes of 64 rows x one 128-byte row
    /// (32 f32 or 64 bf16 columns) in the 128-byte swizzle. An error where TMA cannot address it (an address
    /// or a row stride that is not a multiple of 16 bytes).
    pub fn output(ptr: u64, rows: usize, n: usize, bf16_out: bool) -> Result<Self, CudaError> {
        let (dtype, elem) = if bf16_out {
            (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2)
        } else {
            (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4)
        };
        Self::encode(ptr, dtype, elem, rows, n, n, 64, 128 / elem, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
    }

    /// Transposed activation scales `[groups, ld]` f32 of `rows` rows, boxes of one K block's [`SCALE_BOX`]
    /// rows.
    pub fn scales(ptr: u64, groups: usize, rows: usize, ld: usize) -> Result<Self, CudaError> {
        Self::encode(
            ptr,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            4,
            groups,
            rows,
            ld,
            1,
            SCALE_BOX,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
        )
    }
}

/// One product's device buffers as raw addresses.
#[derive(Clone, Copy)]
pub struct RawGemm {
    /// e4m3 activation codes `[rows, kpad]`, zero past K.
    pub qa: u64,
    /// Their scales, transposed: `[kpad / 128, scale_ld]` f32 (row `r`'s scale of K block `g` at
    /// `g * scale_ld + r`).
    pub sa_t: u64,
    pub scale_ld: usize,
    /// e4m3 weight codes `[n, kpad]` and their 128 x 128 block scales `[ceil(n / 128), scale_cols]`.
    pub w: u64,
    pub ws: u64,
    pub scale_cols: usize,
    /// `[rows, n]` f32, or bf16 with `bf16_out`.
    pub y: u64,
    /// A split launch's chain sums: [`Plan::partial_len`] f32 (0 when the plan is not split).
    pub part: u64,
    pub bf16_out: bool,
    pub rows: usize,
    pub n: usize,
    pub kpad: usize,
    /// `w`'s maps for 64- and 128-wide tiles when the caller keeps them ([`TensorMap::codes`] of `w`,
    /// `groups * n`, `kpad` with boxes of 64 and 128 rows); encoded here otherwise.
    pub w_maps: Option<[TensorMap; 2]>,
    /// A grouped product (the routed experts, [`super::moe`]): `w` and `ws` stack `groups` matrices of `n`
    /// rows, and `row_tiles` (device, `tile_slots` x {first row, matrix or -1, end row} i32) says which
    /// rows each row tile covers and which matrix they take. 0 / 1 / 0 for a plain product.
    pub row_tiles: u64,
    pub tile_slots: usize,
    pub groups: usize,
    /// Grouped products: i32 `[rows]`, the row of `y` each grouped row is stored at (0: row r at r).
    pub out_rows: u64,
}

/// Whether a launch of `plan` stores its output with TMA ([`Plan::tma_store`]): a plain unsplit product on
/// 128-row tiles whose output rows TMA can address (16-byte aligned address and row stride; the tiny model's
/// odd widths are not), else each thread stores its registers.
pub fn stores_with_tma(a: &RawGemm, plan: Plan) -> bool {
    let elem = if a.bf16_out { 2 } else { 4 };
    plan.tma_store
        && plan.bm == BM
        && !plan.split
        && a.row_tiles == 0
        && a.out_rows == 0
        && a.y.is_multiple_of(16)
        && (a.n * elem).is_multiple_of(16)
}

/// Queues `y = qa . w^T` with the block scales, as `plan` says (normally [`Plan::new`]; the tests force
/// others).
pub fn launch(gpu: &Gpu, a: &RawGemm, plan: Plan) -> Result<(), CudaError> {
    if a.rows == 0 || a.n == 0 {
        return Ok(());
    }
    if a.kpad == 0
        || !a.kpad.is_multiple_of(BK)
        || a.kpad / BK > MAX_K_BLOCKS
        || a.scale_ld < a.rows
        || !a.scale_ld.is_multiple_of(4)
    {
        return Err(CudaError::Shape(format!(
            "gemm: kpad {} must be a positive multiple of {BK} of at most {} K blocks, scale_ld {} a multiple of 4 of \
             at least rows {}",
            a.kpad, MAX_K_BLOCKS, a.scale_ld, a.rows
        )));
    }
    if a.scale_cols < a.kpad / BK {
        return Err(CudaError::Shape(format!("gemm: {} weight scale columns for kpad {}", a.scale_cols, a.kpad)));
    }
    if plan.tile != 64 && plan.tile != 128 {
        return Err(CudaError::Shape(format!("gemm: tile width {} (64 or 128)", plan.tile)));
    }
    let Some(kernel) = kernel_name(plan.bm, plan.tile, a.bf16_out, plan.chains > 1 && !plan.split) else {
        return Err(CudaError::Shape(format!("gemm: tile height {} ({BM_SMALL} or {BM})", plan.bm)));
    };
    if plan.chains == 0 || plan.chains > a.kpad / BK {
        return Err(CudaError::Shape(format!("gemm: {} chains over {} K blocks", plan.chains, a.kpad / BK)));
    }
    if plan.split && a.part == 0 {
        return Err(CudaError::Shape("gemm: a split launch needs its partial buffer".into()));
    }
    if plan.split && plan.chains < 2 {
        // One chain's unit would store into y, which the combine then overwrites from an unwritten `part`.
        return Err(CudaError::Shape("gemm: a split launch needs at least two chains".into()));
    }
    let grouped = a.row_tiles != 0;
    if a.groups == 0
        || (grouped && (plan.split || a.tile_slots == 0))
        || (!grouped && (a.groups != 1 || a.out_rows != 0))
    {
        return Err(CudaError::Shape(format!(
            "gemm: a grouped product needs row tiles ({}) and is never split, a plain one has no output rows; {} \
             matrices",
            a.tile_slots, a.groups
        )));
    }
    if [a.qa, a.sa_t, a.w, a.ws, a.y].contains(&0) {
        return Err(CudaError::Shape("gemm: a null operand".into()));
    }
    let sms = gpu.info().multiprocessors.max(2) as usize;
    let (bm, bn) = (plan.bm, plan.tile);
    let ta = TensorMap::codes(a.qa, a.rows, a.kpad, bm / 2)?;
    let tb = match a.w_maps {
        Some(m) => m[usize::from(bn == 128)],
        None => TensorMap::codes(a.w, a.groups * a.n, a.kpad, bn)?,
    };
    let tsa = TensorMap::scales(a.sa_t, a.kpad / BK, a.rows, a.scale_ld)?;
    // The output's map for the TMA store, or (unused) the activations' in its place.
    let tma = stores_with_tma(a, plan);
    let ty = if tma { TensorMap::output(a.y, a.rows, a.n, a.bf16_out)? } else { ta };
    // Persistent clusters of two CTAs, one CTA per SM at most; each unit is a row tile and two column tiles
    // (and one chain of them when split).
    let row_tiles = if grouped { a.tile_slots } else { a.rows.div_ceil(bm) };
    let units = row_tiles * a.n.div_ceil(bn).div_ceil(2) * if plan.split { plan.chains } else { 1 };
    let clusters = units.min(sms / 2);
    let f = gpu.function(kernel)?;
    let part = if plan.split { a.part } else { 0 };
    let (scale_cols, chains) = (a.scale_cols as i32, plan.chains as i32);
    let (rows, n, kpad) = (a.rows as i32, a.n as i32, a.kpad as i32);
    let mut b = gpu.stream().launch_builder(f);
    b.arg(&ta).arg(&tb).arg(&tsa).arg(&ty).arg(&a.ws).arg(&scale_cols).arg(&a.y).arg(&part).arg(&chains);
    let (tile_slots, tma_flag) = (a.tile_slots as i32, i32::from(tma));
    b.arg(&rows).arg(&n).arg(&kpad).arg(&a.row_tiles).arg(&tile_slots).arg(&a.out_rows).arg(&tma_flag);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (2 * clusters as u32, 1, 1),
        block_dim: (threads(bm), 1, 1),
        shared_mem_bytes: smem_bytes(bm, bn, a.bf16_out) as u32,
    };
    // SAFETY: the parameters follow GEMM_PARAMS' order and types; the tensor maps cover exactly the buffers
    // the caller sized for these shapes, and TMA never reads or writes outside a map; a split launch writes
    // `partial_len` values of `part`.
    // The routed experts' launches apart from the dense ones in a kernel profile.
    let label: std::borrow::Cow<'_, str> =
        if grouped && gpu.profiler().is_on() { format!("{kernel} (grouped)").into() } else { kernel.into() };
    gpu.profiler().time(gpu.stream(), &label, || unsafe { b.launch(cfg) })?;
    if plan.split {
        let count = (a.rows * a.n) as i64;
        let name = if a.bf16_out { "tandem_gemm_fp8_combine_bf16" } else { "tandem_gemm_fp8_combine_f32" };
        super::ops::launch(
            gpu,
            name,
            ((count as usize).div_ceil(256).min(4 * sms) as u32, 1, 1),
            256,
            0,
            &[Arg::P(a.part), Arg::I(chains), Arg::L(count), Arg::P(a.y)],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::RngExt;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cpu::linear::{ACT_GROUP, Fp8Linear};
    use crate::cuda::ops::{Arg, DBuf, launch as launch_kernel};
    use crate::fp8::e4m3_to_f32;

    struct Weights {
        codes: Vec<u8>,
        scales: Vec<f32>,
        out: usize,
        inp: usize,
    }

    /// Weight codes: any finite e4m3 code, or (`exact`) one of +-1, +-1.5; block scales powers of two.
    fn weights(rng: &mut ChaCha8Rng, out: usize, inp: usize, exact: bool) -> Weights {
        let codes = (0..out * inp)
            .map(|_| {
                loop {
                    let c = if exact {
                        (rng.random::<u8>() & 0x80) | (7 << 3) | (rng.random::<u8>() & 4)
                    } else {
                        rng.random::<u8>()
                    };
                    if c & 0x7f != 0x7f {
                        break c;
                    }
                }
            })
            .collect();
        let scales =
            (0..out.div_ceil(BK) * inp.div_ceil(BK)).map(|_| (-(rng.random_range(0..4) as f32)).exp2()).collect();
        Weights { codes, scales, out, inp }
    }

    /// Activations: random, or (`exact`) +-1 or +-1.5 times a power of two per 128-channel group (the group
    /// quantizes to codes +-256 / +-384 with no rounding).
    fn activations(rng: &mut ChaCha8Rng, rows: usize, inp: usize, exact: bool) -> Vec<f32> {
        let mut x = vec![0f32; rows * inp];
        for (i, v) in x.iter_mut().enumerate() {
            *v = if exact {
                let e = ((i % inp) / ACT_GROUP + i / inp) % 3;
                let m = if rng.random::<bool>() { 1.0 } else { 1.5 };
                let s = if rng.random::<bool>() { 1.0 } else { -1.0 };
                s * m * (e as f32).exp2()
            } else {
                (rng.random::<f32>() * 2.0 - 1.0) * 8.0
            };
        }
        x
    }

    fn sms(gpu: &Gpu) -> usize {
        gpu.info().multiprocessors as usize
    }

    /// The default plan of a product, with `edit` applied.
    fn plan(gpu: &Gpu, rows: usize, w: &Weights, edit: impl Fn(&mut Plan)) -> Plan {
        let mut p = Plan::new(rows, w.out, w.inp.div_ceil(BK) * BK, sms(gpu));
        edit(&mut p);
        p
    }

    /// The GPU's product of `x [rows, inp]` (quantized by tandem_act_quant into the transposed scale layout)
    /// and the weights, as f32 (bf16 outputs widened).
    fn gpu_forward(gpu: &Gpu, x: &[f32], rows: usize, w: &Weights, plan: Plan, bf16: bool) -> Vec<f32> {
        let s = gpu.stream();
        let kpad = w.inp.div_ceil(BK) * BK;
        let groups = kpad / BK;
        let ld = scale_ld(rows);
        let mut padded = vec![0u8; w.out * kpad];
        for r in 0..w.out {
            padded[r * kpad..r * kpad + w.inp].copy_from_slice(&w.codes[r * w.inp..(r + 1) * w.inp]);
        }
        let dx = DBuf::upload(s, x).unwrap();
        let dw = DBuf::upload(s, &padded).unwrap();
        let dws = DBuf::upload(s, &w.scales).unwrap();
        let qa = DBuf::<u8>::zeros(s, rows * kpad).unwrap();
        let sa = DBuf::<f32>::zeros(s, groups * ld).unwrap();
        launch_kernel(
            gpu,
            "tandem_act_quant",
            (groups as u32, rows.min(65535) as u32, 1),
            32,
            0,
            &[
                Arg::P(dx.ptr()),
                Arg::I(w.inp as i32),
                Arg::I(kpad as i32),
                Arg::I(1),
                Arg::P(qa.ptr()),
                Arg::P(sa.ptr()),
                Arg::I(ld as i32),
                Arg::I(rows as i32),
                Arg::P(0),
            ],
        )
        .unwrap();
        let part = DBuf::<f32>::zeros(s, plan.partial_len(rows, w.out)).unwrap();
        let raw = |y: u64, bf16_out| RawGemm {
            qa: qa.ptr(),
            sa_t: sa.ptr(),
            scale_ld: ld,
            w: dw.ptr(),
            ws: dws.ptr(),
            scale_cols: w.inp.div_ceil(BK),
            y,
            part: part.ptr(),
            bf16_out,
            rows,
            n: w.out,
            kpad,
            w_maps: None,
            row_tiles: 0,
            tile_slots: 0,
            groups: 1,
            out_rows: 0,
        };
        if bf16 {
            let y = DBuf::<u16>::zeros(s, rows * w.out).unwrap();
            launch(gpu, &raw(y.ptr(), true), plan).unwrap();
            s.clone_dtoh(y.slice()).unwrap().iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect()
        } else {
            let y = DBuf::<f32>::zeros(s, rows * w.out).unwrap();
            launch(gpu, &raw(y.ptr(), false), plan).unwrap();
            s.clone_dtoh(y.slice()).unwrap()
        }
    }

    fn cpu_forward(x: &[f32], rows: usize, w: &Weights) -> Vec<f32> {
        Fp8Linear::new(&w.codes, w.scales.clone(), w.out, w.inp, [BK, BK], true).forward(x, rows)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Exact inputs: every product and 128-term sum needs at most 11 significant bits and every scale is a
    /// power of two, so rounding cannot separate the tensor cores from the CPU's f32 sums (nor chains summed
    /// apart from one sequential sum): the GPU must give the CPU function's bits. Covers partial K blocks
    /// (192 = 1.5 blocks), partial column tiles (130, 576), partial row tiles, both tile heights and widths,
    /// split and unsplit chains, and both output types.
    #[test]
    fn exact_products_give_the_cpu_result_bit_for_bit() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for (rows, inp, out) in [(1, 256, 300), (77, 192, 130), (200, 512, 576), (129, 1536, 256)] {
            let w = weights(&mut rng, out, inp, true);
            let x = activations(&mut rng, rows, inp, true);
            let want = cpu_forward(&x, rows, &w);
            let want16: Vec<f32> = want.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            let chains = plan(&gpu, rows, &w, |_| {}).chains;
            for (bm, tile, split, tma) in [
                (BM, 64, false, true),
                (BM, 128, false, true),
                (BM, 128, false, false),
                (BM, 64, true, true),
                (BM_SMALL, 64, false, true),
                (BM_SMALL, 128, true, true),
            ] {
                let p = plan(&gpu, rows, &w, |p| {
                    p.bm = bm;
                    p.tile = tile;
                    p.split = split && p.chains > 1;
                    p.tma_store = tma;
                });
                let what = format!(
                    "{rows}x{inp}x{out} tile {bm}x{tile} split {} of {chains} chains, TMA store {tma} (seed {seed})",
                    p.split
                );
                assert_eq!(bits(&gpu_forward(&gpu, &x, rows, &w, p, false)), bits(&want), "{what}");
                assert_eq!(bits(&gpu_forward(&gpu, &x, rows, &w, p, true)), bits(&want16), "bf16 out {what}");
            }
        }
    }

    /// The TMA store (128-row tiles of plain products) writes the same bits as the register stores, f32 and
    /// bf16, both tile widths, partial row tiles and column tiles past `n`; where TMA cannot address the
    /// output (a row of an odd number of bf16 values) the launch takes the register stores.
    #[test]
    fn the_tma_store_writes_what_the_register_stores_write() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for (rows, inp, out) in [(300, 2048, 1536), (129, 512, 576), (200, 384, 200), (1000, 1024, 2304)] {
            let w = weights(&mut rng, out, inp, false);
            let x = activations(&mut rng, rows, inp, false);
            for tile in [64, 128] {
                for bf16 in [false, true] {
                    let with = plan(&gpu, rows, &w, |p| {
                        p.bm = BM;
                        p.tile = tile;
                        p.split = false;
                        p.tma_store = true;
                    });
                    let without = Plan { tma_store: false, ..with };
                    let a = RawGemm { y: 256, n: out, bf16_out: bf16, ..unit_raw() };
                    assert!(stores_with_tma(&a, with) && !stores_with_tma(&a, without));
                    let what = format!("{rows}x{inp}x{out} tile {tile} bf16 {bf16} (seed {seed})");
                    assert_eq!(
                        bits(&gpu_forward(&gpu, &x, rows, &w, with, bf16)),
                        bits(&gpu_forward(&gpu, &x, rows, &w, without, bf16)),
                        "{what}"
                    );
                }
            }
        }
        // Rows TMA cannot address: a bf16 row of 130 values is 260 bytes; an f32 one is 520 (not 16-byte
        // multiples either way), and an odd address.
        let p = Plan { bm: BM, tile: 128, chains: 1, split: false, tma_store: true };
        for a in [
            RawGemm { y: 256, n: 130, bf16_out: true, ..unit_raw() },
            RawGemm { y: 256, n: 130, bf16_out: false, ..unit_raw() },
            RawGemm { y: 264, n: 256, bf16_out: false, ..unit_raw() },
        ] {
            assert!(!stores_with_tma(&a, p), "n {} at {:#x}", a.n, a.y);
        }
        let (w, x) = (weights(&mut rng, 130, 256, true), activations(&mut rng, 77, 256, true));
        let want16: Vec<f32> = cpu_forward(&x, 77, &w).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert_eq!(bits(&gpu_forward(&gpu, &x, 77, &w, p, true)), bits(&want16), "odd width (seed {seed})");
        // Grouped and split launches never take it.
        assert!(!stores_with_tma(&RawGemm { y: 256, n: 256, row_tiles: 1024, ..unit_raw() }, p));
        assert!(!stores_with_tma(&RawGemm { y: 256, n: 256, ..unit_raw() }, Plan { split: true, ..p }));
        assert!(!stores_with_tma(&RawGemm { y: 256, n: 256, ..unit_raw() }, Plan { bm: BM_SMALL, ..p }));
    }

    /// A RawGemm of null buffers, for the store rule's checks.
    fn unit_raw() -> RawGemm {
        RawGemm {
            qa: 0,
            sa_t: 0,
            scale_ld: 4,
            w: 0,
            ws: 0,
            scale_cols: 1,
            y: 0,
            part: 0,
            bf16_out: false,
            rows: 1,
            n: 1,
            kpad: BK,
            w_maps: None,
            row_tiles: 0,
            tile_slots: 0,
            groups: 1,
            out_rows: 0,
        }
    }

    /// Any finite codes: the tensor cores accumulate a k32 step's FP8 products at limited precision (about
    /// 14 significant bits, DeepSeek-V3 report §3.3.2), which the per-block promotion keeps from growing
    /// along K. Bound: |gpu - cpu| <= 2^-11 of the element's magnitude sum S = sum |a_k| |w_k| (scales
    /// applied): four k-steps per block at ~2^-14 each is 2^-12, doubled for margin; a wrong scale or
    /// layout is off by O(S). The measured worst ratio is printed.
    #[test]
    fn random_codes_stay_within_the_tensor_cores_accumulation_precision() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for (rows, inp, out) in [(33, 1536, 700), (300, 7168, 256)] {
            let w = weights(&mut rng, out, inp, false);
            let x = activations(&mut rng, rows, inp, false);
            let want = cpu_forward(&x, rows, &w);
            let got = gpu_forward(&gpu, &x, rows, &w, plan(&gpu, rows, &w, |_| {}), false);
            // Magnitude sums from the CPU's own quantization of x.
            let kpad = inp.div_ceil(BK) * BK;
            let mut worst = 0f64;
            for r in 0..rows {
                let mut qa = vec![0f32; kpad];
                let mut sa = vec![0f32; kpad / BK];
                for g in 0..kpad / BK {
                    let hi = ((g + 1) * BK).min(inp);
                    sa[g] = crate::fp8::quantize_group_values(
                        &x[r * inp + g * BK..r * inp + hi],
                        &mut qa[g * BK..hi],
                        true,
                    );
                }
                for c in 0..out {
                    let mut sum = 0f64;
                    for k in 0..inp {
                        let wv = e4m3_to_f32(w.codes[c * inp + k]) as f64
                            * w.scales[(c / BK) * inp.div_ceil(BK) + k / BK] as f64;
                        sum += (qa[k] as f64 * sa[k / BK] as f64 * wv).abs();
                    }
                    let d = (got[r * out + c] as f64 - want[r * out + c] as f64).abs();
                    worst = worst.max(d / sum.max(f64::MIN_POSITIVE));
                    assert!(
                        d <= sum * (-11f64).exp2(),
                        "{rows}x{inp}x{out} y[{r},{c}]: gpu {} cpu {} (|diff| {d:e}, S {sum:e}, seed {seed})",
                        got[r * out + c],
                        want[r * out + c]
                    );
                }
            }
            eprintln!(
                "{rows}x{inp}x{out}: worst |gpu - cpu| / S = {worst:.3e} (bound 2^-11 = {:.3e})",
                (-11f64).exp2()
            );
        }
    }

    /// A row's output bits do not depend on M, the other rows, the tile height or width or whether the
    /// shape's chains run split: rows of small launches (64-row tiles, split) equal the same rows of a large
    /// one (128-row tiles, unsplit), at every point where the plan changes.
    #[test]
    fn a_rows_output_does_not_depend_on_the_batch_or_the_plan() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let sms = sms(&gpu);
        for (inp, out) in [(1024, 2304), (7168, 576)] {
            let w = weights(&mut rng, out, inp, false);
            // Large enough that the default tile is 128 wide, unsplit, with several tiles per cluster.
            let big = (sms.div_ceil(out.div_ceil(128)) + 2) * BM;
            let p_big = plan(&gpu, big, &w, |_| {});
            assert!(p_big.bm == BM && p_big.tile == 128 && !p_big.split && p_big.chains > 1, "{p_big:?}");
            let x = activations(&mut rng, big, inp, false);
            let full = gpu_forward(&gpu, &x, big, &w, p_big, false);
            for edit in [|p: &mut Plan| p.tile = 64, |p: &mut Plan| p.split = true, |p: &mut Plan| p.bm = BM_SMALL] {
                let p = plan(&gpu, big, &w, edit);
                assert_eq!(bits(&gpu_forward(&gpu, &x, big, &w, p, false)), bits(&full), "{p:?} (seed {seed})");
            }
            for m in [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, big - 1] {
                let p = plan(&gpu, m, &w, |_| {});
                let got = gpu_forward(&gpu, &x[..m * inp], m, &w, p, false);
                assert_eq!(bits(&got), bits(&full[..m * out]), "{inp}x{out}: rows of M = {m} ({p:?}, seed {seed})");
            }
        }
    }

    /// Grouped products (the routed experts, engine::cuda::moe): every pair's row equals the plain product of
    /// its token's row and its expert's matrix, bit for bit. Experts of 0, 1, 127, 128, 129 and 300 pairs
    /// (an unused expert, partial and full row tiles, tiles that start mid-tile), pairs routed to no expert,
    /// partial K and N blocks, both tile widths; the grouped rows are a permutation of the routed pairs.
    #[test]
    fn grouped_rows_equal_each_experts_plain_product() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        let (inp, out, k): (usize, usize, usize) = (320, 192, 2);
        let kpad = inp.div_ceil(BK) * BK;
        let counts = [0usize, 1, 127, 128, 129, 300];
        let experts = counts.len();
        let mut ids: Vec<i32> =
            counts.iter().enumerate().flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c)).collect();
        ids.extend([-1, -1, -1]);
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let (pairs, tokens) = (ids.len(), ids.len() / k);
        let ws_e: Vec<Weights> = (0..experts).map(|_| weights(&mut rng, out, inp, false)).collect();
        let x = activations(&mut rng, tokens, inp, false);
        // The experts stacked as the loader stacks them: codes [E, out, kpad], scales [E, ceil(out/128), ...].
        let mut codes = vec![0u8; experts * out * kpad];
        let mut scales = Vec::new();
        for (e, w) in ws_e.iter().enumerate() {
            for r in 0..out {
                let at = (e * out + r) * kpad;
                codes[at..at + inp].copy_from_slice(&w.codes[r * inp..(r + 1) * inp]);
            }
            scales.extend_from_slice(&w.scales);
        }
        let codes = DBuf::upload(s, &codes).unwrap();
        let maps = Box::new([
            TensorMap::codes(codes.ptr(), experts * out, kpad, 64).unwrap(),
            TensorMap::codes(codes.ptr(), experts * out, kpad, 128).unwrap(),
        ]);
        let lin = crate::cuda::weights::DLinear::Fp8 {
            codes,
            scales: DBuf::upload(s, &scales).unwrap(),
            out,
            inp,
            kpad,
            block: [BK, BK],
            ue8m0: true,
            maps: Some(maps),
        };
        let (dx, dids) = (DBuf::upload(s, &x).unwrap(), DBuf::upload(s, &ids).unwrap());
        let mut ws = crate::cuda::ops::Workspace::new();
        let plain: Vec<Vec<f32>> =
            ws_e.iter().map(|w| gpu_forward(&gpu, &x, tokens, w, plan(&gpu, tokens, w, |_| {}), false)).collect();
        // Row tiles of 64 (the decode tile) and 128 rows.
        for rows in [BM_SMALL, BM] {
            let g = crate::cuda::moe::group(&gpu, &mut ws, dids.ptr(), pairs, k, experts, Some(rows)).unwrap();
            let ld = scale_ld(pairs);
            let (qa, sa) =
                crate::cuda::weights::act_quant(&gpu, &mut ws, dx.ptr(), pairs, inp, kpad, true, ld, g.src_row)
                    .unwrap();
            let mut slot = vec![0i32; pairs];
            // SAFETY: `slot_of_pair` holds `pairs` i32s in the workspace, which outlives the copy.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut slot, g.slot_of_pair, s.cu_stream()) }.unwrap();
            s.synchronize().unwrap();
            let mut seen = vec![false; pairs];
            for (p, &e) in ids.iter().enumerate() {
                if e < 0 {
                    assert_eq!(slot[p], -1, "pair {p} routed to no expert (seed {seed})");
                } else {
                    let r = slot[p] as usize;
                    assert!(r < pairs - 3 && !seen[r], "pair {p}: grouped row {r} (seed {seed})");
                    seen[r] = true;
                }
            }
            for tile in [64, 128] {
                let y = DBuf::<f32>::zeros(s, pairs * out).unwrap();
                crate::cuda::moe::grouped_linear(&gpu, &lin, qa, sa, ld, &g, y.ptr(), false, 0, Some(tile)).unwrap();
                let got = s.clone_dtoh(y.slice()).unwrap();
                for (p, &e) in ids.iter().enumerate() {
                    if e < 0 {
                        continue;
                    }
                    let (r, t) = (slot[p] as usize, p / k);
                    assert_eq!(
                        bits(&got[r * out..(r + 1) * out]),
                        bits(&plain[e as usize][t * out..(t + 1) * out]),
                        "pair {p} (token {t}, expert {e}, grouped row {r}), tile {rows}x{tile} (seed {seed})"
                    );
                }
            }
        }
        assert!(crate::cuda::moe::group(&gpu, &mut ws, dids.ptr(), pairs - 1, k, experts, None).is_err());
        assert!(crate::cuda::moe::group(&gpu, &mut ws, dids.ptr(), pairs, k, experts, Some(32)).is_err());
    }

    #[test]
    fn bad_shapes_are_errors() {
        let Some(gpu) = Gpu::for_test() else { return };
        let ok = RawGemm { rows: 4, n: 8, ..unit_raw() };
        let p = Plan { bm: BM, tile: 64, chains: 1, split: false, tma_store: true };
        assert!(launch(&gpu, &RawGemm { kpad: 100, ..ok }, p).unwrap_err().to_string().contains("kpad"));
        assert!(launch(&gpu, &RawGemm { scale_ld: 2, ..ok }, p).unwrap_err().to_string().contains("scale_ld"));
        assert!(launch(&gpu, &RawGemm { scale_cols: 0, ..ok }, p).unwrap_err().to_string().contains("scale"));
        assert!(launch(&gpu, &ok, Plan { tile: 96, ..p }).unwrap_err().to_string().contains("tile width"));
        assert!(launch(&gpu, &ok, Plan { bm: 32, ..p }).unwrap_err().to_string().contains("tile height"));
        let k_max = (MAX_K_BLOCKS + 1) * BK;
        assert!(
            launch(&gpu, &RawGemm { kpad: k_max, scale_cols: k_max / BK, ..ok }, p)
                .unwrap_err()
                .to_string()
                .contains("at most")
        );
        assert!(launch(&gpu, &ok, Plan { chains: 2, ..p }).unwrap_err().to_string().contains("chains"));
        assert!(launch(&gpu, &ok, Plan { chains: 0, ..p }).unwrap_err().to_string().contains("chains"));
        let split = Plan { split: true, ..p };
        assert!(
            launch(&gpu, &RawGemm { kpad: 256, scale_cols: 2, ..ok }, Plan { chains: 2, ..split })
                .unwrap_err()
                .to_string()
                .contains("partial buffer")
        );
        // Null and misaligned operands are refused before the driver sees them.
        assert!(launch(&gpu, &ok, p).unwrap_err().to_string().contains("null"));
        let aligned = RawGemm { qa: 256, sa_t: 256, w: 256, ws: 256, y: 256, ..ok };
        assert!(launch(&gpu, &RawGemm { qa: 8, ..aligned }, p).unwrap_err().to_string().contains("aligned"));
        // Nothing to do is not an error.
        assert!(launch(&gpu, &RawGemm { rows: 0, ..ok }, p).is_ok());
        // Grouped products: row tiles and one or more matrices, never split; plain ones take one matrix.
        let grouped = RawGemm { row_tiles: 256, tile_slots: 1, groups: 2, ..aligned };
        assert!(launch(&gpu, &RawGemm { groups: 2, ..aligned }, p).unwrap_err().to_string().contains("grouped"));
        assert!(launch(&gpu, &RawGemm { tile_slots: 0, ..grouped }, p).unwrap_err().to_string().contains("grouped"));
        let split2 = Plan { bm: BM, tile: 64, chains: 2, split: true, tma_store: true };
        let grouped2 = RawGemm { part: 256, kpad: 256, scale_cols: 2, ..grouped };
        assert!(launch(&gpu, &grouped2, split2).unwrap_err().to_string().contains("grouped"));
        // A split launch of one chain would leave y to the combine of an unwritten partial buffer.
        assert!(launch(&gpu, &RawGemm { part: 256, ..aligned }, split).unwrap_err().to_string().contains("two chains"));
    }

    /// The chains of a weight shape never depend on M, and a plan splits only where the unsplit launch
    /// would leave SMs idle.
    #[test]
    fn plans_depend_on_m_only_in_how_they_run() {
        for (n, kpad) in [(1536, 7168), (576, 7168), (24576, 1536), (7168, 2048), (128, 7168), (300, 256)] {
            let c = chains(n, kpad);
            assert!((1..=16).contains(&c) && c <= kpad / BK, "{n}x{kpad}: {c}");
            for m in [1, 64, 128, 129, 256, 1024, 4096, 8192] {
                let p = Plan::new(m, n, kpad, 132);
                assert_eq!(p.chains, c, "{n}x{kpad} at M = {m}");
                assert_eq!(p.bm, if m <= BM_SMALL && small_tiles() { BM_SMALL } else { BM }, "{n}x{kpad} at M = {m}");
                assert!(
                    !p.split
                        || (c > 1
                            && m <= 256
                            && n * kpad >= SPLIT_MIN_BYTES
                            && m.div_ceil(BM) * n.div_ceil(64).div_ceil(2) < 66),
                    "{p:?}"
                );
                assert_eq!(p.partial_len(m, n), if p.split { c * m * n } else { 0 });
            }
        }
        // The small projections split at decode sizes; the large ones never need to.
        assert!(Plan::new(64, 1536, 7168, 132).split);
        assert!(!Plan::new(64, 36864, 7168, 132).split);
        assert_eq!(chains(36864, 7168), 1);
        // The chains do not depend on the device; only whether a launch splits them does.
        assert_eq!(Plan::new(64, 1536, 7168, 114).chains, Plan::new(64, 1536, 7168, 132).chains);
    }
}
