//! The CUDA backend's weights on the device, loaded by HF name (docs/model.md §3): FP8 projections stay
//! e4m3 codes with their block scales (`Precision::Fp8`), wide bf16 matrices (lm_head) stay bf16, the absorbed
//! W_UK / W_UV are bf16 where exact, everything else is f32. The routed experts of a
//! layer sit back to back in one buffer per projection, so one launch runs every (token, expert) pair.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use safetensors::Dtype;

use super::ep::Shard;
use super::ops::{Arg, DBuf, Workspace, launch};
use super::{CudaError, bf16_mma, gemm};
use crate::checkpoint::names::{layer_prefix, scale_name};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::Fp8Quant;
use crate::cpu::linear::ACT_GROUP;
use crate::{ModelConfig, Precision};

use super::Gpu;

/// Why loading failed: the checkpoint, or the device (out of memory).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// Columns and rows of a CTA of `tandem_gemm_f32_tiled` (8 warps x `F32T_COLS`, `F32T_ROWS` in model.cu).
const F32T_COLS_PER_CTA: usize = 32;
const F32T_ROWS: usize = 8;
/// Rows from which an f32 linear of one matrix takes the tiled kernel: below, the row kernel's one warp per
/// column is as fast (bench/gpu/f32_bench.py, router gate 256 x 7168 on an H200: 2 rows 32 us tiled against
/// 31, 16 rows 62 against 95, 128 rows 66 against 122, 2048 rows 489 against 1656).
const F32T_MIN_ROWS: usize = 16;

/// Channels of one K chunk of an f32 linear of `inp` inputs: at most [`F32_MAX_CHUNKS`] chunks of a multiple
/// of 512 (the tiled kernel's step), from the weight shape alone. Both f32 kernels sum a chunk's channels per
/// lane, then the warp's butterfly, and add the chunks left to right (model.cu, `tandem_gemm_f32`).
pub fn f32_chunk(inp: usize) -> usize {
    512 * inp.div_ceil(512).div_ceil(F32_MAX_CHUNKS).max(1)
}

/// K chunks of an f32 linear at most.
pub const F32_MAX_CHUNKS: usize = 8;

/// f32 linears of at most this many outputs and more than one K chunk (the router gate and the indexer's
/// weights_proj; with `--precision full` also its wk) run each K chunk as its own CTAs and add the chunks' sums
/// in a second launch (`tandem_gemm_f32_combine`): the same sums, with as many times the warps in flight as
/// there are chunks (7 at K = 7168) where a few rows would leave most SMs idle. Wider ones add their chunks in
/// sequence.
pub const F32_SPLIT_MAX_OUT: usize = 256;

/// Workspace f32s an f32 linear of `out` x `inp` takes for `rows` rows (its chunks' partial sums).
pub fn f32_partial_len(rows: usize, out: usize, inp: usize) -> usize {
    let chunks = inp.div_ceil(f32_chunk(inp));
    if out <= F32_SPLIT_MAX_OUT && chunks > 1 { chunks * rows * out } else { 0 }
}

/// Which f32 kernel a product runs: `Tiled` (one matrix, `inp` a multiple of 4, `x` 16-byte aligned; rows
/// share the weight reads) or `Rows` (one warp per output, matrix `sel[row]` of stacked ones where `sel` is not
/// 0). The same bits either way.
#[derive(Clone, Copy, PartialEq)]
enum F32Kernel {
    Tiled,
    Rows,
}

/// `y [rows, out] = x [rows / a_div, inp] . w^T` in f32 through `kernel`; `part`: the K chunks' partial sums
/// (see [`F32_SPLIT_MAX_OUT`]; each chunk its own CTAs, then the combine), or 0 (chunks added in sequence).
#[allow(clippy::too_many_arguments)]
fn f32_product(
    gpu: &Gpu,
    kernel: F32Kernel,
    x: u64,
    a_div: usize,
    w: u64,
    sel: u64,
    y: u64,
    rows: usize,
    out: usize,
    inp: usize,
    part: u64,
) -> Result<(), CudaError> {
    let chunk = f32_chunk(inp);
    let z = if part != 0 { inp.div_ceil(chunk) } else { 1 };
    let (xa, dims) = ([Arg::P(x), Arg::I(a_div as i32), Arg::P(w)], [rows, out, inp, chunk].map(|v| Arg::I(v as i32)));
    match kernel {
        F32Kernel::Tiled => {
            let grid = (out.div_ceil(F32T_COLS_PER_CTA) as u32, rows.div_ceil(F32T_ROWS) as u32, z as u32);
            let args: Vec<Arg> = xa.into_iter().chain([Arg::P(y)]).chain(dims).chain([Arg::P(part)]).collect();
            launch(gpu, "tandem_gemm_f32_tiled", grid, 256, 0, &args)?;
        }
        F32Kernel::Rows => {
            let grid = (out.div_ceil(8) as u32, rows.div_ceil(8) as u32, z as u32);
            let stacked = [Arg::P(sel), Arg::L((out * inp) as i64), Arg::P(y)];
            let args: Vec<Arg> = xa.into_iter().chain(stacked).chain(dims).chain([Arg::P(part)]).collect();
            launch(gpu, "tandem_gemm_f32", grid, 256, 0, &args)?;
        }
    }
    if part != 0 { f32_combine(gpu, part, y, rows * out, z) } else { Ok(()) }
}

/// `y[i]` = the chunks' partial sums of an f32 linear added left to right.
fn f32_combine(gpu: &Gpu, part: u64, y: u64, len: usize, chunks: usize) -> Result<(), CudaError> {
    launch(
        gpu,
        "tandem_gemm_f32_combine",
        super::ops::elementwise_grid(len),
        256,
        0,
        &[Arg::P(part), Arg::P(y), Arg::L(len as i64), Arg::I(chunks as i32)],
    )
}

/// Output rows from which a bf16 linear keeps its bf16 weights ([`DLinear::Bf16`]).
const BF16_MIN_ROWS: usize = 1024;

/// `mats` matrices `[out, in]` of one shape.
pub enum DLinear {
    Dense {
        w: DBuf<f32>,
        out: usize,
        inp: usize,
    },
    /// One wide matrix stored as bf16 in the checkpoint (lm_head, the MTP head, eh_proj): kept as bf16, whose
    /// values are exact in f32.
    Bf16 {
        w: DBuf<u16>,
        out: usize,
        inp: usize,
    },
    Fp8 {
        /// `[mats, out, kpad]` e4m3 codes, K padded with zero codes to a multiple of 128.
        codes: DBuf<u8>,
        /// `[mats, ceil(out / b0), ceil(in / b1)]`.
        scales: DBuf<f32>,
        out: usize,
        inp: usize,
        kpad: usize,
        block: [usize; 2],
        ue8m0: bool,
        /// The codes' TMA maps for the tensor-core GEMM's 64- and 128-wide tiles (128 x 128 blocks; over every
        /// stacked matrix; encoded once at load instead of on every call).
        maps: Option<Box<[gemm::TensorMap; 2]>>,
    },
}

/// An FP8 matrix's block shape and scale format.
type Fp8Kind = ([usize; 2], bool);

/// Host-side form of one matrix before upload.
enum HostLinear {
    Dense(Vec<f32>),
    Fp8 { codes: Vec<u8>, scales: Vec<f32>, block: [usize; 2], ue8m0: bool },
}

fn quant_config(ckpt: &Checkpoint) -> Fp8Quant {
    ckpt.config().quantization.clone().unwrap_or(Fp8Quant { weight_block_size: [128, 128], ue8m0: true })
}

/// Reads `name` ([out, in]) as the backend keeps it.
fn read_linear(ckpt: &Checkpoint, name: &str, prec: Precision) -> Result<(HostLinear, usize, usize), CheckpointError> {
    let t = ckpt.tensor(name)?;
    let (out, inp) = (t.shape[0], t.shape[1]);
    if t.dtype != Dtype::F8_E4M3 || prec == Precision::Full {
        return Ok((HostLinear::Dense(ckpt.dequantized(name)?), out, inp));
    }
    let q = quant_config(ckpt);
    let block = q.weight_block_size;
    let seg = ACT_GROUP.min(block[1]);
    if !(ACT_GROUP.is_multiple_of(block[1]) || block[1].is_multiple_of(ACT_GROUP)) || !seg.is_multiple_of(32) {
        return Err(CheckpointError::Tensor {
            name: name.into(),
            file: t.file.into(),
            msg: format!(
                "weight block {block:?}: the GPU's FP8 GEMM needs K blocks of 32, 64, 128 or a multiple of 128; use \
                 --precision full"
            ),
        });
    }
    let kpad = inp.div_ceil(ACT_GROUP) * ACT_GROUP;
    let mut codes = vec![0u8; out * kpad];
    for r in 0..out {
        codes[r * kpad..r * kpad + inp].copy_from_slice(&t.data[r * inp..(r + 1) * inp]);
    }
    let scales = ckpt.tensor(&scale_name(name))?.to_f32()?;
    Ok((HostLinear::Fp8 { codes, scales, block, ue8m0: q.ue8m0 }, out, inp))
}

impl DLinear {
    /// One matrix.
    pub fn load(stream: &Arc<CudaStream>, ckpt: &Checkpoint, name: &str, prec: Precision) -> Result<Self, LoadError> {
        let t = ckpt.tensor(name)?;
        // Wide bf16 matrices (lm_head, the MTP head, eh_proj) stay bf16; narrow ones (the indexer's
        // weights_proj, 64 rows) keep the f32 kernel, whose one-column warps spread them over more SMs.
        if t.dtype == Dtype::BF16 && t.shape.len() == 2 && t.shape[0] >= BF16_MIN_ROWS {
            let w: Vec<u16> = t.data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            return Ok(DLinear::Bf16 { w: DBuf::upload(stream, &w)?, out: t.shape[0], inp: t.shape[1] });
        }
        Self::load_stacked(stream, ckpt, &[name.to_string()], prec)
    }

    /// Several matrices of one shape and kind, back to back (a layer's routed experts).
    pub fn load_stacked(
        stream: &Arc<CudaStream>,
        ckpt: &Checkpoint,
        names: &[String],
        prec: Precision,
    ) -> Result<Self, LoadError> {
        let mut dense = Vec::new();
        let (mut codes, mut scales) = (Vec::new(), Vec::new());
        let mut first: Option<(usize, usize, Option<Fp8Kind>)> = None;
        for name in names {
            let (h, out, inp) = read_linear(ckpt, name, prec)?;
            let kind = match &h {
                HostLinear::Dense(_) => None,
                HostLinear::Fp8 { block, ue8m0, .. } => Some((*block, *ue8m0)),
            };
            if first.is_some_and(|f| f != (out, inp, kind)) {
                return Err(CheckpointError::Tensor {
                    name: name.clone(),
                    file: String::new(),
                    msg: format!("shape or dtype differs from {} (stacked experts must match)", names[0]),
                }
                .into());
            }
            first = Some((out, inp, kind));
            match h {
                HostLinear::Dense(w) => dense.extend_from_slice(&w),
                HostLinear::Fp8 { codes: c, scales: s, .. } => {
                    codes.extend_from_slice(&c);
                    scales.extend_from_slice(&s);
                }
            }
        }
        match first {
            None => Err(CudaError::Shape("no matrices to load".into()).into()),
            Some((out, inp, None)) => Ok(DLinear::Dense { w: DBuf::upload(stream, &dense)?, out, inp }),
            Some((out, inp, Some((block, ue8m0)))) => {
                let codes = DBuf::upload(stream, &codes)?;
                let kpad = inp.div_ceil(ACT_GROUP) * ACT_GROUP;
                // Stacked matrices (the routed experts) get maps over all of them: the grouped GEMM's. K past
                // the GEMM's limit (gemm::MAX_K_BLOCKS) takes the dot-product kernel, decided here at load.
                let rows = names.len() * out;
                let maps = if block == [gemm::BK, gemm::BK] && kpad / gemm::BK <= gemm::MAX_K_BLOCKS {
                    Some(Box::new([
                        gemm::TensorMap::codes(codes.ptr(), rows, kpad, 64)?,
                        gemm::TensorMap::codes(codes.ptr(), rows, kpad, 128)?,
                    ]))
                } else {
                    None
                };
                Ok(DLinear::Fp8 { codes, scales: DBuf::upload(stream, &scales)?, out, inp, kpad, block, ue8m0, maps })
            }
        }
    }

    /// A zeroed FP8 stack of `mats` matrices shaped as this one's (with its TMA maps), for copies of matrices
    /// to be written into (expert-parallel load balancing's new slots); `None` for other forms.
    pub fn fp8_like(&self, stream: &Arc<CudaStream>, mats: usize) -> Result<Option<Self>, CudaError> {
        let DLinear::Fp8 { scales, out, inp, kpad, block, ue8m0, maps, .. } = self else { return Ok(None) };
        let (per_codes, per_scales) = (out * kpad, scales.len() / self.groups().max(1));
        let codes = DBuf::<u8>::zeros(stream, mats * per_codes)?;
        let rows = mats * out;
        let maps = match maps {
            Some(_) => Some(Box::new([
                gemm::TensorMap::codes(codes.ptr(), rows, *kpad, 64)?,
                gemm::TensorMap::codes(codes.ptr(), rows, *kpad, 128)?,
            ])),
            None => None,
        };
        Ok(Some(DLinear::Fp8 {
            codes,
            scales: DBuf::zeros(stream, mats * per_scales)?,
            out: *out,
            inp: *inp,
            kpad: *kpad,
            block: *block,
            ue8m0: *ue8m0,
            maps,
        }))
    }

    /// Stacked FP8 matrix `i`'s codes and scales: (address, bytes) of each.
    pub fn fp8_matrix(&self, i: usize) -> Option<[(u64, usize); 2]> {
        let DLinear::Fp8 { codes, scales, out, kpad, .. } = self else { return None };
        let mats = self.groups();
        if i >= mats {
            return None;
        }
        let (pc, ps) = (out * kpad, scales.len() / mats * std::mem::size_of::<f32>());
        Some([(codes.ptr() + (i * pc) as u64, pc), (scales.ptr() + (i * ps) as u64, ps)])
    }

    /// A dense matrix from values already in memory (`[out, in]`).
    pub fn dense(stream: &Arc<CudaStream>, w: &[f32], out: usize, inp: usize) -> Result<Self, CudaError> {
        Ok(DLinear::Dense { w: DBuf::upload(stream, w)?, out, inp })
    }

    /// Matrices stacked (the routed experts'; 1 for a plain linear).
    pub fn groups(&self) -> usize {
        match self {
            DLinear::Dense { w, out, inp } => w.len() / (out * inp).max(1),
            DLinear::Bf16 { .. } => 1,
            DLinear::Fp8 { codes, out, kpad, .. } => codes.len() / (out * kpad).max(1),
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            DLinear::Dense { out, .. } | DLinear::Bf16 { out, .. } | DLinear::Fp8 { out, .. } => *out,
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            DLinear::Dense { inp, .. } | DLinear::Bf16 { inp, .. } | DLinear::Fp8 { inp, .. } => *inp,
        }
    }

    pub fn bytes(&self) -> u64 {
        match self {
            DLinear::Dense { w, .. } => w.bytes(),
            DLinear::Bf16 { w, .. } => w.bytes(),
            DLinear::Fp8 { codes, scales, .. } => codes.bytes() + scales.bytes(),
        }
    }

    /// [`forward`](Self::forward) of the first `*rows_dev` of `rows` rows (`rows_dev`: a device i32 at most
    /// `rows`, read when the launch runs: a CUDA graph's product over a varying number of rows). A bf16 linear
    /// on the tensor cores computes only those rows; any other computes all `rows`. Either way each of the
    /// first rows is what `forward` gives it (a row's result does not depend on the others).
    pub fn forward_first(
        &self,
        gpu: &Gpu,
        ws: &mut Workspace,
        x: u64,
        rows: usize,
        rows_dev: u64,
        y: u64,
    ) -> Result<(), CudaError> {
        if let DLinear::Bf16 { w, out, inp } = self
            && bf16_mma::serves_linear(*out, *inp)
        {
            return bf16_mma::launch(gpu, &bf16_mma::Product::linear(x, 1, w.ptr(), y, rows, *out, *inp, rows_dev));
        }
        self.forward(gpu, ws, x, rows, 1, 0, y)
    }

    /// `y [rows, out] = x [rows / a_div, in] . W^T`, row `m` through matrix `sel[m]` (`sel`: a device array
    /// of `rows` i32, 0 for matrix 0 only).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &Gpu,
        ws: &mut Workspace,
        x: u64,
        x_rows: usize,
        a_div: usize,
        sel: u64,
        y: u64,
    ) -> Result<(), CudaError> {
        let rows = x_rows * a_div;
        if rows == 0 {
            return Ok(());
        }
        let out = self.out_features();
        let grid = (out.div_ceil(8) as u32, rows.div_ceil(8) as u32, 1);
        match self {
            DLinear::Bf16 { w, out, inp } => {
                if sel != 0 {
                    return Err(CudaError::Shape("a bf16 linear is one matrix: no per-row selection".into()));
                }
                if bf16_mma::serves_linear(*out, *inp) {
                    // The tensor cores, by the weight's shape (a misaligned x is an error, never the other kernel).
                    return bf16_mma::launch(
                        gpu,
                        &bf16_mma::Product::linear(x, a_div, w.ptr(), y, rows, *out, *inp, 0),
                    );
                }
                // Four columns per warp, 16 rows per CTA (BF16W_COLS, BF16W_ROWS in model.cu).
                launch(
                    gpu,
                    "tandem_gemm_bf16w",
                    (out.div_ceil(8 * 4) as u32, rows.div_ceil(16) as u32, 1),
                    256,
                    0,
                    &[
                        Arg::P(x),
                        Arg::I(a_div as i32),
                        Arg::P(w.ptr()),
                        Arg::P(y),
                        Arg::I(rows as i32),
                        Arg::I(*out as i32),
                        Arg::I(*inp as i32),
                    ],
                )
            }
            // The kernel reads rows of a multiple of 4 channels 16 bytes at a time: such an x must be 16-byte
            // aligned (workspace and DBuf addresses are 256-aligned; a pointer into a row is not).
            DLinear::Dense { inp, .. } if inp.is_multiple_of(4) && !x.is_multiple_of(16) => {
                Err(CudaError::Shape(format!("an f32 linear's input at {x:#x} is not 16-byte aligned")))
            }
            DLinear::Dense { w, out, inp } => {
                // The chunks' partial sums (narrow linears) are dead once the combine is issued (one stream):
                // handed back at once.
                let mark = ws.mark();
                let part = match f32_partial_len(rows, *out, *inp) {
                    0 => 0,
                    n => ws.take::<f32>(gpu.stream(), n)?,
                };
                // One matrix and enough rows: rows share the weight reads (tandem_gemm_f32_tiled). Both kernels
                // give the same bits (tested), so the row count picks the faster one and changes no result.
                let kernel = if sel == 0 && inp.is_multiple_of(4) && rows >= F32T_MIN_ROWS {
                    F32Kernel::Tiled
                } else {
                    F32Kernel::Rows
                };
                let r = f32_product(gpu, kernel, x, a_div, w.ptr(), sel, y, rows, *out, *inp, part);
                ws.rewind(mark);
                r
            }
            // Dense rows with DeepSeek's 128 x 128 weight blocks: the tensor-core GEMM (engine::cuda::gemm).
            DLinear::Fp8 { maps: Some(_), .. } if sel == 0 && a_div == 1 => {
                let q = self.quantize_input(gpu, ws, x, x_rows)?;
                self.forward_quantized(gpu, ws, &q, x_rows, y)
            }
            // Routed experts' (token, slot) rows and other weight blocks: one warp per output column.
            DLinear::Fp8 { codes, scales, out, inp, kpad, block, ue8m0, .. } => {
                let (qa, sa) = act_quant(gpu, ws, x, x_rows, *inp, *kpad, *ue8m0, 0, 0)?;
                let scale_len = out.div_ceil(block[0]) * inp.div_ceil(block[1]);
                launch(
                    gpu,
                    "tandem_gemm_fp8",
                    grid,
                    256,
                    0,
                    &[
                        Arg::P(qa),
                        Arg::P(sa),
                        Arg::I(a_div as i32),
                        Arg::P(codes.ptr()),
                        Arg::P(scales.ptr()),
                        Arg::P(sel),
                        Arg::L((out * kpad) as i64),
                        Arg::L(scale_len as i64),
                        Arg::P(y),
                        Arg::I(rows as i32),
                        Arg::I(*out as i32),
                        Arg::I(*inp as i32),
                        Arg::I(*kpad as i32),
                        Arg::I(block[0] as i32),
                        Arg::I(block[1] as i32),
                    ],
                )
            }
        }
    }

    /// The input format of the tensor-core FP8 path, if this linear takes it: its rows quantized per 128
    /// channels ([`QuantIn`]). Linears with the same format can share one quantization of the same rows.
    pub fn quant_format(&self) -> Option<QuantFormat> {
        match self {
            DLinear::Fp8 { inp, kpad, ue8m0, maps: Some(_), .. } => {
                Some(QuantFormat { inp: *inp, kpad: *kpad, ue8m0: *ue8m0 })
            }
            _ => None,
        }
    }

    /// `x [rows, inp]` f32 quantized as this linear's tensor-core path takes it (workspace codes and
    /// transposed scales).
    pub fn quantize_input(&self, gpu: &Gpu, ws: &mut Workspace, x: u64, rows: usize) -> Result<QuantIn, CudaError> {
        let f = self
            .quant_format()
            .ok_or_else(|| CudaError::Shape("only an FP8 linear with 128 x 128 blocks takes quantized rows".into()))?;
        let ld = gemm::scale_ld(rows);
        let (qa, sa) = act_quant(gpu, ws, x, rows, f.inp, f.kpad, f.ue8m0, ld, 0)?;
        Ok(QuantIn { qa, sa, ld, format: f })
    }

    /// `y [rows, out]` f32 from rows already quantized in this linear's format (the tensor-core GEMM).
    pub fn forward_quantized(
        &self,
        gpu: &Gpu,
        ws: &mut Workspace,
        q: &QuantIn,
        x_rows: usize,
        y: u64,
    ) -> Result<(), CudaError> {
        if x_rows == 0 {
            return Ok(());
        }
        match self {
            DLinear::Fp8 { codes, scales, out, inp, kpad, maps: Some(maps), .. }
                if self.quant_format() == Some(q.format) =>
            {
                let (qa, sa, ld) = (q.qa, q.sa, q.ld);
                let plan = gemm::Plan::new(x_rows, *out, *kpad, gpu.info().multiprocessors as usize);
                let part = match plan.partial_len(x_rows, *out) {
                    0 => 0,
                    len => ws.take::<f32>(gpu.stream(), len)?,
                };
                let raw = gemm::RawGemm {
                    qa,
                    sa_t: sa,
                    scale_ld: ld,
                    w: codes.ptr(),
                    ws: scales.ptr(),
                    scale_cols: inp.div_ceil(gemm::BK),
                    y,
                    part,
                    bf16_out: false,
                    rows: x_rows,
                    n: *out,
                    kpad: *kpad,
                    w_maps: Some(**maps),
                    row_tiles: 0,
                    tile_slots: 0,
                    groups: 1,
                    out_rows: 0,
                };
                gemm::launch(gpu, &raw, plan)
            }
            _ => Err(CudaError::Shape(format!(
                "rows quantized as {:?} do not fit this linear ({:?})",
                q.format,
                self.quant_format()
            ))),
        }
    }
}

/// How a tensor-core FP8 linear quantizes its input rows: `inp` channels padded to `kpad`, per-128 scales
/// (powers of two with `ue8m0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantFormat {
    pub inp: usize,
    pub kpad: usize,
    pub ue8m0: bool,
}

/// Rows quantized in a [`QuantFormat`]: codes `qa [rows, kpad]` and scales `sa [kpad / 128, ld]`
/// (transposed, `ld` a multiple of 4 of at least the rows).
#[derive(Debug, Clone, Copy)]
pub struct QuantIn {
    pub qa: u64,
    pub sa: u64,
    pub ld: usize,
    pub format: QuantFormat,
}

/// Quantizes `x [rows, inp]` per row per 128 channels into workspace codes `[rows, kpad]` and scales:
/// `[rows, kpad / 128]`, or transposed `[kpad / 128, scale_ld]` with `scale_ld` > 0 (the tensor-core GEMM's).
/// With a device row map `row_src` (i32 `[rows]`, 0 for none), row r quantizes x's row `row_src[r]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn act_quant(
    gpu: &Gpu,
    ws: &mut Workspace,
    x: u64,
    rows: usize,
    inp: usize,
    kpad: usize,
    ue8m0: bool,
    scale_ld: usize,
    row_src: u64,
) -> Result<(u64, u64), CudaError> {
    let groups = kpad / ACT_GROUP;
    let qa = ws.take::<u8>(gpu.stream(), rows * kpad)?;
    let sa = ws.take::<f32>(gpu.stream(), groups * if scale_ld > 0 { scale_ld } else { rows })?;
    act_quant_into(gpu, x, rows, inp, kpad, ue8m0, scale_ld, row_src, qa, sa)?;
    Ok((qa, sa))
}

/// Rows one `tandem_act_quant` warp takes per pass (`ACT_ROWS` in model.cu).
const ACT_ROWS: usize = 4;

/// [`act_quant`] into given buffers: codes `qa [rows, kpad]`, scales `sa` (`[kpad / 128, scale_ld]`, or
/// `[rows, kpad / 128]` with `scale_ld` 0).
#[allow(clippy::too_many_arguments)]
pub(super) fn act_quant_into(
    gpu: &Gpu,
    x: u64,
    rows: usize,
    inp: usize,
    kpad: usize,
    ue8m0: bool,
    scale_ld: usize,
    row_src: u64,
    qa: u64,
    sa: u64,
) -> Result<(), CudaError> {
    let groups = kpad / ACT_GROUP;
    // Rows of a multiple of 4 channels are read 16 bytes at a time.
    if inp.is_multiple_of(4) && !x.is_multiple_of(16) {
        return Err(CudaError::Shape(format!("activations to quantize at {x:#x} are not 16-byte aligned")));
    }
    if scale_ld > 0 && scale_ld < rows {
        return Err(CudaError::Shape(format!("{rows} rows of scales in rows of {scale_ld}")));
    }
    // Four groups (warps) per CTA, ACT_ROWS rows a pass.
    launch(
        gpu,
        "tandem_act_quant",
        (groups.div_ceil(4) as u32, rows.div_ceil(ACT_ROWS).min(65535) as u32, 1),
        128,
        0,
        &[
            Arg::P(x),
            Arg::I(inp as i32),
            Arg::I(kpad as i32),
            Arg::I(ue8m0 as i32),
            Arg::P(qa),
            Arg::P(sa),
            Arg::I(scale_ld as i32),
            Arg::I(rows as i32),
            Arg::P(row_src),
        ],
    )
}

pub struct DMlp {
    pub gate: DLinear,
    pub up: DLinear,
    pub down: DLinear,
}

pub struct DMoe {
    /// Router weights `[experts, hidden]` (f32 logits).
    pub gate: DLinear,
    pub bias: Option<DBuf<f32>>,
    /// The routed experts this rank computes: replaced whole, between steps, when expert-parallel load
    /// balancing moves them (engine::cuda::balance).
    routed: std::sync::RwLock<Arc<Routed>>,
    pub shared: Option<DMlp>,
    /// i32 `[n_routed_experts]`: the pairs this rank's rows routed to each logical expert since the last
    /// read (expert parallelism only: engine::cuda::balance).
    pub counts: Option<DBuf<i32>>,
}

/// A MoE layer's routed experts on this rank.
pub struct Routed {
    /// Every distinct matrix this rank holds (its shard's experts, or its slots' copies), stacked.
    pub experts: DMlp,
    /// i32 `[shard's experts]`: each of the shard's routed experts' matrix among `experts`, where experts
    /// share their weights (a synthetic model's); `None`: the shard's expert e (or slot e) is matrix e.
    pub expert_map: Option<DBuf<i32>>,
    /// Expert-parallel load balancing: which expert each slot of every rank holds (`experts` are this rank's
    /// slots, in order). `None`: rank r holds its shard's experts ([`Shard::experts`]).
    pub slots: Option<SlotTable>,
}

/// A placement of the routed experts over the ranks' slots, on the host and as the dispatch reads it.
pub struct SlotTable {
    pub placement: crate::eplb::Placement,
    /// Slots per rank.
    pub per_rank: usize,
    /// [`crate::eplb::Placement::table`]: per expert, its copies and their slots (`1 + max_copies` ints).
    pub table: DBuf<i32>,
    pub width: usize,
}

impl SlotTable {
    pub fn new(stream: &Arc<CudaStream>, placement: crate::eplb::Placement, ranks: usize) -> Result<Self, CudaError> {
        let table = DBuf::upload(stream, &placement.table())?;
        Ok(SlotTable {
            per_rank: placement.phy2log.len() / ranks.max(1),
            width: 1 + placement.max_copies(),
            table,
            placement,
        })
    }
}

impl DMoe {
    /// The routed experts as they are now (hold the `Arc` for one call: a rebalance replaces them between
    /// steps).
    pub fn routed(&self) -> Arc<Routed> {
        self.routed.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Puts `r` in place of the routed experts (between steps); the old ones are freed in stream order once
    /// the last holder lets go.
    pub fn replace_routed(&self, r: Routed) {
        *self.routed.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(r);
    }
}

/// Which routed experts a rank loads and how they are tracked.
#[derive(Debug, Clone, Copy)]
pub struct ExpertLayout {
    pub shard: Shard,
    /// Count the pairs per expert (expert parallelism: engine::cuda::balance).
    pub count: bool,
    /// Expert-parallel load balancing: this many slots per rank beyond its share, the rank's slots loaded as
    /// [`crate::eplb::Placement::home`] places them.
    pub redundant: Option<usize>,
}

impl ExpertLayout {
    /// Every expert on one GPU.
    pub const SINGLE: ExpertLayout = ExpertLayout { shard: Shard::SINGLE, count: false, redundant: None };
}

pub enum DFfn {
    Dense(Box<DMlp>),
    Moe(Box<DMoe>),
}

pub struct DMla {
    pub q_a: DLinear,
    pub q_a_norm: DBuf<f32>,
    pub q_b: DLinear,
    pub kv_a: DLinear,
    pub kv_a_norm: DBuf<f32>,
    pub kv_b: DLinear,
    pub o: DLinear,
    /// `[heads, rank, nope]` and `[heads, v, rank]` from the dequantized kv_b (the absorbed form).
    pub w_uk_t: AbsorbedWeights,
    pub w_uv: AbsorbedWeights,
}

/// The absorbed W_UK / W_UV: bf16 where the FP8 decode uses them and every value is exact in bf16 (an FP8
/// kv_b with power-of-two block scales: e4m3 times 2^k has 4 significant bits), so the kernels read half the
/// bytes and compute the same products; f32 otherwise (and for the full-precision decode).
pub enum AbsorbedWeights {
    F32(DBuf<f32>),
    Bf16(DBuf<u16>),
}

impl AbsorbedWeights {
    fn upload(stream: &Arc<CudaStream>, values: &[f32], bf16: bool) -> Result<Self, CudaError> {
        match exact_bf16(values) {
            Some(b) if bf16 => Ok(AbsorbedWeights::Bf16(DBuf::upload(stream, &b)?)),
            _ => Ok(AbsorbedWeights::F32(DBuf::upload(stream, values)?)),
        }
    }

    pub fn ptr(&self) -> u64 {
        match self {
            AbsorbedWeights::F32(b) => b.ptr(),
            AbsorbedWeights::Bf16(b) => b.ptr(),
        }
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self, AbsorbedWeights::Bf16(_))
    }

    pub fn bytes(&self) -> u64 {
        match self {
            AbsorbedWeights::F32(b) => b.bytes(),
            AbsorbedWeights::Bf16(b) => b.bytes(),
        }
    }
}

/// `values` as bf16 bit patterns when every one is exactly a bf16 value (finite), else None.
fn exact_bf16(values: &[f32]) -> Option<Vec<u16>> {
    values
        .iter()
        .map(|&v| {
            let b = half::bf16::from_f32(v);
            (v.is_finite() && b.to_f32().to_bits() == v.to_bits()).then(|| b.to_bits())
        })
        .collect()
}

pub struct DIndexer {
    pub wq_b: DLinear,
    pub wk: DLinear,
    pub k_norm_w: DBuf<f32>,
    pub k_norm_b: DBuf<f32>,
    pub weights_proj: DLinear,
}

pub struct DLayer {
    pub attn_norm: DBuf<f32>,
    pub ffn_norm: DBuf<f32>,
    pub attn: DMla,
    pub indexer: DIndexer,
    pub ffn: DFfn,
}

pub struct DMtp {
    pub enorm: DBuf<f32>,
    pub hnorm: DBuf<f32>,
    pub eh_proj: DLinear,
    pub head_norm: DBuf<f32>,
    pub head: Option<DLinear>,
    pub embed: Option<DBuf<f32>>,
    pub layer: DLayer,
}

pub struct DWeights {
    pub embed: DBuf<f32>,
    /// Per decoder layer; layers that share their weights (a synthetic model's weight sets,
    /// `Checkpoint::layer_source`) share one load.
    pub layers: Vec<Arc<DLayer>>,
    pub norm: DBuf<f32>,
    pub lm_head: DLinear,
    /// The one MTP layer served (the first of the checkpoint's).
    pub mtp: Option<DMtp>,
}

fn f32s(stream: &Arc<CudaStream>, ckpt: &Checkpoint, name: &str) -> Result<DBuf<f32>, LoadError> {
    Ok(DBuf::upload(stream, &ckpt.f32(name)?)?)
}

fn mlp(stream: &Arc<CudaStream>, ckpt: &Checkpoint, prefixes: &[String], prec: Precision) -> Result<DMlp, LoadError> {
    let names = |p: &str| prefixes.iter().map(|x| format!("{x}{p}_proj.weight")).collect::<Vec<_>>();
    Ok(DMlp {
        gate: DLinear::load_stacked(stream, ckpt, &names("gate"), prec)?,
        up: DLinear::load_stacked(stream, ckpt, &names("up"), prec)?,
        down: DLinear::load_stacked(stream, ckpt, &names("down"), prec)?,
    })
}

/// Whether tensors `a` and `b` are one allocation of the checkpoint (a synthetic model's shared tensors).
fn same_memory(ckpt: &Checkpoint, a: &str, b: &str) -> bool {
    match (ckpt.get(a), ckpt.get(b)) {
        (Some(x), Some(y)) => std::ptr::eq(x.data, y.data),
        _ => false,
    }
}

/// The distinct experts among `prefixes` (experts whose three matrices are the same memory, as a synthetic
/// model's shared experts are, count once): their prefixes, and each expert's index among them.
fn distinct_experts(ckpt: &Checkpoint, prefixes: &[String]) -> Result<(Vec<String>, Vec<i32>), CheckpointError> {
    let mut first: std::collections::HashMap<[usize; 3], i32> = std::collections::HashMap::new();
    let (mut distinct, mut map) = (Vec::new(), Vec::with_capacity(prefixes.len()));
    for p in prefixes {
        let mut key = [0usize; 3];
        for (k, m) in key.iter_mut().zip(["gate", "up", "down"]) {
            *k = ckpt.tensor(&format!("{p}{m}_proj.weight"))?.data.as_ptr() as usize;
        }
        let i = *first.entry(key).or_insert_with(|| {
            distinct.push(p.clone());
            distinct.len() as i32 - 1
        });
        map.push(i);
    }
    Ok((distinct, map))
}

fn layer(
    stream: &Arc<CudaStream>,
    ckpt: &Checkpoint,
    index: usize,
    prec: Precision,
    el: ExpertLayout,
) -> Result<DLayer, LoadError> {
    let shard = el.shard;
    let cfg = ckpt.config();
    let p = layer_prefix(index);
    let a = format!("{p}self_attn.");
    let ix = format!("{a}indexer.");
    let kv_b_name = format!("{a}kv_b_proj.weight");
    let (w_uk_t, w_uv) = crate::cpu::weights::absorb(&ckpt.dequantized(&kv_b_name)?, cfg);
    let ffn = if cfg.is_moe_layer(index) {
        let m = format!("{p}mlp.");
        let bias_name = format!("{m}gate.e_score_correction_bias");
        let gate = ckpt.f32(&format!("{m}gate.weight"))?;
        let routed = match el.redundant {
            // Load balancing: one matrix per slot (a slot's copy moves on its own), the home placement.
            Some(redundant) => {
                let placement = crate::eplb::Placement::home(cfg.n_routed_experts, shard.world, redundant)
                    .map_err(CudaError::Shape)?;
                let per = placement.phy2log.len() / shard.world;
                let mine = &placement.phy2log[shard.rank * per..(shard.rank + 1) * per];
                let prefixes: Vec<String> = mine.iter().map(|e| format!("{m}experts.{e}.")).collect();
                Routed {
                    experts: mlp(stream, ckpt, &prefixes, prec)?,
                    expert_map: None,
                    slots: Some(SlotTable::new(stream, placement, shard.world)?),
                }
            }
            None => {
                // This rank's routed experts only (all of them without expert parallelism).
                let experts: Vec<String> =
                    shard.experts(cfg.n_routed_experts).map(|e| format!("{m}experts.{e}.")).collect();
                let (distinct, map) = distinct_experts(ckpt, &experts)?;
                let expert_map = if distinct.len() < experts.len() { Some(DBuf::upload(stream, &map)?) } else { None };
                Routed { experts: mlp(stream, ckpt, &distinct, prec)?, expert_map, slots: None }
            }
        };
        DFfn::Moe(Box::new(DMoe {
            gate: DLinear::dense(stream, &gate, cfg.n_routed_experts, cfg.hidden_size)?,
            bias: if ckpt.contains(&bias_name) { Some(f32s(stream, ckpt, &bias_name)?) } else { None },
            routed: std::sync::RwLock::new(Arc::new(routed)),
            shared: if cfg.n_shared_experts > 0 {
                Some(mlp(stream, ckpt, &[format!("{m}shared_experts.")], prec)?)
            } else {
                None
            },
            counts: if el.count { Some(DBuf::zeros(stream, cfg.n_routed_experts)?) } else { None },
        }))
    } else {
        DFfn::Dense(Box::new(mlp(stream, ckpt, &[format!("{p}mlp.")], prec)?))
    };
    let flat = |v: Vec<Vec<f32>>| v.into_iter().flatten().collect::<Vec<f32>>();
    Ok(DLayer {
        attn_norm: f32s(stream, ckpt, &format!("{p}input_layernorm.weight"))?,
        ffn_norm: f32s(stream, ckpt, &format!("{p}post_attention_layernorm.weight"))?,
        attn: DMla {
            q_a: DLinear::load(stream, ckpt, &format!("{a}q_a_proj.weight"), prec)?,
            q_a_norm: f32s(stream, ckpt, &format!("{a}q_a_layernorm.weight"))?,
            q_b: DLinear::load(stream, ckpt, &format!("{a}q_b_proj.weight"), prec)?,
            kv_a: DLinear::load(stream, ckpt, &format!("{a}kv_a_proj_with_mqa.weight"), prec)?,
            kv_a_norm: f32s(stream, ckpt, &format!("{a}kv_a_layernorm.weight"))?,
            kv_b: DLinear::load(stream, ckpt, &kv_b_name, prec)?,
            o: DLinear::load(stream, ckpt, &format!("{a}o_proj.weight"), prec)?,
            // bf16 only where the FP8 decode reads them (the full-precision decode takes f32).
            w_uk_t: AbsorbedWeights::upload(stream, &flat(w_uk_t), prec == Precision::Fp8)?,
            w_uv: AbsorbedWeights::upload(stream, &flat(w_uv), prec == Precision::Fp8)?,
        },
        indexer: DIndexer {
            wq_b: DLinear::load(stream, ckpt, &format!("{ix}wq_b.weight"), prec)?,
            wk: DLinear::load(stream, ckpt, &format!("{ix}wk.weight"), prec)?,
            k_norm_w: f32s(stream, ckpt, &format!("{ix}k_norm.weight"))?,
            k_norm_b: f32s(stream, ckpt, &format!("{ix}k_norm.bias"))?,
            weights_proj: DLinear::load(stream, ckpt, &format!("{ix}weights_proj.weight"), prec)?,
        },
        ffn,
    })
}

impl DWeights {
    /// Every weight, the routed experts `el` gives this rank (its shard's or its slots' under expert
    /// parallelism).
    pub fn load(
        stream: &Arc<CudaStream>,
        ckpt: &Checkpoint,
        prec: Precision,
        el: ExpertLayout,
    ) -> Result<Self, LoadError> {
        let cfg: &ModelConfig = ckpt.config();
        let embed_host = ckpt.f32("model.embed_tokens.weight")?;
        let embed = DBuf::upload(stream, &embed_host)?;
        let lm_head = if ckpt.contains("lm_head.weight") {
            DLinear::load(stream, ckpt, "lm_head.weight", prec)?
        } else {
            DLinear::dense(stream, &embed_host, cfg.vocab_size, cfg.hidden_size)?
        };
        drop(embed_host);
        let norm = f32s(stream, ckpt, "model.norm.weight")?;
        let mut loaded: std::collections::HashMap<usize, Arc<DLayer>> = std::collections::HashMap::new();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let src = ckpt.layer_source(i);
            let l = match loaded.get(&src) {
                Some(l) => l.clone(),
                None => {
                    let l = Arc::new(layer(stream, ckpt, src, prec, el)?);
                    loaded.insert(src, l.clone());
                    l
                }
            };
            layers.push(l);
        }
        let mtp = if cfg.num_served_mtp_layers() > 0 {
            let i = cfg.num_hidden_layers;
            let p = layer_prefix(i);
            let head_name = format!("{p}shared_head.head.weight");
            let embed_name = format!("{p}embed_tokens.weight");
            Some(DMtp {
                enorm: f32s(stream, ckpt, &format!("{p}enorm.weight"))?,
                hnorm: f32s(stream, ckpt, &format!("{p}hnorm.weight"))?,
                eh_proj: DLinear::load(stream, ckpt, &format!("{p}eh_proj.weight"), prec)?,
                head_norm: f32s(stream, ckpt, &format!("{p}shared_head.norm.weight"))?,
                // The MTP layer's head and embedding are the main model's (docs/model.md §2.5): where the
                // checkpoint's tensors are the same memory (a synthetic model's), they are not loaded twice.
                head: if ckpt.contains(&head_name) && !same_memory(ckpt, &head_name, "lm_head.weight") {
                    Some(DLinear::load(stream, ckpt, &head_name, prec)?)
                } else {
                    None
                },
                embed: if ckpt.contains(&embed_name) && !same_memory(ckpt, &embed_name, "model.embed_tokens.weight") {
                    Some(f32s(stream, ckpt, &embed_name)?)
                } else {
                    None
                },
                layer: layer(stream, ckpt, i, prec, el)?,
            })
        } else {
            None
        };
        Ok(DWeights { embed, layers, norm, lm_head, mtp })
    }

    /// Device bytes of every weight.
    pub fn bytes(&self) -> u64 {
        let mlp = |m: &DMlp| m.gate.bytes() + m.up.bytes() + m.down.bytes();
        let layer = |l: &DLayer| {
            let a = &l.attn;
            let i = &l.indexer;
            let ffn = match &l.ffn {
                DFfn::Dense(m) => mlp(m),
                DFfn::Moe(m) => {
                    let r = m.routed();
                    m.gate.bytes()
                        + m.bias.as_ref().map_or(0, DBuf::bytes)
                        + mlp(&r.experts)
                        + r.expert_map.as_ref().map_or(0, DBuf::bytes)
                        + r.slots.as_ref().map_or(0, |t| t.table.bytes())
                        + m.counts.as_ref().map_or(0, DBuf::bytes)
                        + m.shared.as_ref().map_or(0, mlp)
                }
            };
            l.attn_norm.bytes()
                + l.ffn_norm.bytes()
                + [&a.q_a, &a.q_b, &a.kv_a, &a.kv_b, &a.o].iter().map(|x| x.bytes()).sum::<u64>()
                + a.q_a_norm.bytes()
                + a.kv_a_norm.bytes()
                + a.w_uk_t.bytes()
                + a.w_uv.bytes()
                + i.wq_b.bytes()
                + i.wk.bytes()
                + i.weights_proj.bytes()
                + i.k_norm_w.bytes()
                + i.k_norm_b.bytes()
                + ffn
        };
        let mtp = self.mtp.as_ref().map_or(0, |m| {
            m.enorm.bytes()
                + m.hnorm.bytes()
                + m.eh_proj.bytes()
                + m.head_norm.bytes()
                + m.head.as_ref().map_or(0, DLinear::bytes)
                + m.embed.as_ref().map_or(0, DBuf::bytes)
                + layer(&m.layer)
        });
        // Shared layers once.
        let mut seen = std::collections::HashSet::new();
        let layers: u64 = self.layers.iter().filter(|l| seen.insert(Arc::as_ptr(l))).map(|l| layer(l)).sum();
        self.embed.bytes() + self.norm.bytes() + self.lm_head.bytes() + layers + mtp
    }

    /// Every distinct MoE layer (layers sharing weights once), the MTP layer's last: where expert-parallel
    /// load balancing counts and places experts.
    pub fn moe_sets(&self) -> Vec<&DMoe> {
        let mut seen = std::collections::HashSet::new();
        let main = self.layers.iter().filter(|l| seen.insert(Arc::as_ptr(l))).map(|l| &**l);
        main.chain(self.mtp.iter().map(|m| &m.layer))
            .filter_map(|l| match &l.ffn {
                DFfn::Moe(m) => Some(&**m),
                DFfn::Dense(_) => None,
            })
            .collect()
    }

    /// The largest MoE layer's routed experts (bytes): what a rebalance holds twice while it moves one.
    pub fn largest_routed_bytes(&self) -> u64 {
        let mlp = |m: &DMlp| m.gate.bytes() + m.up.bytes() + m.down.bytes();
        self.moe_sets().iter().map(|m| mlp(&m.routed().experts)).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use rand::RngExt;

    use super::*;

    #[test]
    fn absorbed_weights_are_bf16_only_when_every_value_is_exact() {
        // e4m3 values times powers of two (what an FP8 kv_b with ue8m0 scales dequantizes to) are exact.
        let exact: Vec<f32> = (0..=255u8)
            .map(crate::fp8::e4m3_to_f32)
            .filter(|v| v.is_finite())
            .flat_map(|v| [v * 2f32.powi(-20), v * 2f32.powi(7)])
            .collect();
        let b = exact_bf16(&exact).expect("exact");
        assert!(b.iter().zip(&exact).all(|(&h, &v)| half::bf16::from_bits(h).to_f32() == v));
        // One value with more than 8 significant bits (a non-power-of-two scale) keeps f32.
        assert!(exact_bf16(&[1.0, 1.0 + 2f32.powi(-10)]).is_none());
        assert!(exact_bf16(&[f32::NAN]).is_none());
    }

    /// The absorbed projections from bf16 weights (the tensor cores, activations split into hi + lo) agree
    /// with the same values in f32 (the CUDA-core kernels, f32 sums) and with f64 sums, to the split's 2^-17
    /// and f32 rounding; a row's bits do not depend on how many rows the launch holds.
    #[test]
    fn absorbed_projections_on_the_tensor_cores_match_f32_weights() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        // DeepSeek-V3.2's per-head shapes over 3 heads; 37 rows: a partial second row tile.
        let (rows, heads, nope, rd, rank, vd): (usize, usize, usize, usize, usize, usize) = (37, 3, 128, 64, 512, 128);
        let code = |rng: &mut rand_chacha::ChaCha8Rng| loop {
            let v = crate::fp8::e4m3_to_f32(rng.random::<u8>());
            if v.is_finite() {
                break v * 2f32.powi(rng.random_range(-12..2));
            }
        };
        let w_uk: Vec<f32> = (0..heads * rank * nope).map(|_| code(&mut rng)).collect();
        let w_uv: Vec<f32> = (0..heads * vd * rank).map(|_| code(&mut rng)).collect();
        let q: Vec<f32> = (0..rows * heads * (nope + rd)).map(|_| rng.random::<f32>() - 0.5).collect();
        let lat: Vec<f32> = (0..rows * heads * rank).map(|_| rng.random::<f32>() - 0.5).collect();
        let (dq, dlat) = (DBuf::upload(s, &q).unwrap(), DBuf::upload(s, &lat).unwrap());
        // Both projections of the first `n` rows: the absorbed queries (bf16 bits) and the up-projection (f32).
        let project = |n: usize, wk: &AbsorbedWeights, wv: &AbsorbedWeights| {
            let qb = DBuf::<u16>::zeros(s, n * heads * (rank + rd)).unwrap();
            let o = DBuf::<f32>::zeros(s, n * heads * vd).unwrap();
            bf16_mma::absorb_q(&gpu, wk, dq.ptr(), qb.ptr(), n, heads, nope, rd, rank).unwrap();
            bf16_mma::up_v(&gpu, wv, dlat.ptr(), o.ptr(), n, heads, rank, vd).unwrap();
            (s.clone_dtoh(qb.slice()).unwrap(), s.clone_dtoh(o.slice()).unwrap())
        };
        let mut outs = Vec::new();
        for bf16 in [false, true] {
            let wk = AbsorbedWeights::upload(s, &w_uk, bf16).unwrap();
            let wv = AbsorbedWeights::upload(s, &w_uv, bf16).unwrap();
            assert_eq!((wk.is_bf16(), wv.is_bf16()), (bf16, bf16));
            outs.push(project(rows, &wk, &wv));
        }
        let bf = |b: u16| half::bf16::from_bits(b).to_f32() as f64;
        for r in 0..rows {
            for h in 0..heads {
                let qr = &q[(r * heads + h) * (nope + rd)..][..nope + rd];
                for c in 0..rank + rd {
                    let at = (r * heads + h) * (rank + rd) + c;
                    let (f32w, tc) = (bf(outs[0].0[at]), bf(outs[1].0[at]));
                    if c >= rank {
                        // The rope part is copied: bf16(q_pe) on both paths.
                        assert_eq!(outs[0].0[at], outs[1].0[at], "q_pe [{r},{h},{c}] (seed {seed})");
                        continue;
                    }
                    let w = &w_uk[(h * rank + c) * nope..][..nope];
                    let want: f64 = w.iter().zip(qr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w.iter().zip(qr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    // Each rounds to bf16 (half a step: 2^-8 relative at most) a sum within 2^-16 of the magnitude
                    // sum; the two paths can round to neighbouring values (one step apart).
                    let tol = want.abs() * 2f64.powi(-8) + mag * 2f64.powi(-16);
                    assert!((tc - want).abs() <= tol, "absorbed q [{r},{h},{c}] {tc} vs f64 {want} (seed {seed})");
                    assert!(
                        (tc - f32w).abs() <= 2.0 * tol,
                        "absorbed q [{r},{h},{c}] {tc} vs f32 weights {f32w} (seed {seed})"
                    );
                }
                let lr = &lat[(r * heads + h) * rank..][..rank];
                for d in 0..vd {
                    let at = (r * heads + h) * vd + d;
                    let w = &w_uv[(h * vd + d) * rank..][..rank];
                    let want: f64 = w.iter().zip(lr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = w.iter().zip(lr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    let (f32w, tc) = (outs[0].1[at] as f64, outs[1].1[at] as f64);
                    let tol = mag * 2f64.powi(-16);
                    assert!((tc - want).abs() <= tol, "up_v [{r},{h},{d}] {tc} vs f64 {want} (seed {seed})");
                    assert!(
                        (tc - f32w).abs() <= 2.0 * tol,
                        "up_v [{r},{h},{d}] {tc} vs f32 weights {f32w} (seed {seed})"
                    );
                }
            }
        }
        // A row's values do not depend on how many rows the launch holds (row tiles of 32, partial ones).
        let wk = AbsorbedWeights::upload(s, &w_uk, true).unwrap();
        let wv = AbsorbedWeights::upload(s, &w_uv, true).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for few in [1usize, 2, 7, 8, 9, 31, 32, 33] {
            let (got_q, got_o) = project(few, &wk, &wv);
            assert!(
                got_q[..] == outs[1].0[..got_q.len()],
                "absorbed q of {few} rows differs from {rows} (seed {seed})"
            );
            assert!(
                bits(&got_o) == bits(&outs[1].1[..got_o.len()]),
                "up-projection of {few} rows differs from {rows} rows (seed {seed})"
            );
        }
    }

    /// The tiled f32 kernel (one matrix, rows sharing weight reads) gives the row kernel's bits for every
    /// shape (partial column and row tiles, k not a multiple of 128, a_div), and f64 sums within f32 rounding;
    /// so does `DLinear::forward`, which picks one of them by the row count.
    #[test]
    fn tiled_f32_linears_have_the_row_kernels_bits() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        for (out, inp) in
            [(256, 7168), (64, 7168), (17, 132), (300, 4), (5, 8), (33, 260), (300, 1100), (20, 1028), (20, 1030)]
        {
            let w: Vec<f32> = (0..out * inp).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
            let big = 70;
            let x: Vec<f32> = (0..big * inp).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
            let lin = DLinear::dense(s, &w, out, inp).unwrap();
            let dx = DBuf::upload(s, &x).unwrap();
            let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (rows, a_div) in [(1, 1), (7, 1), (8, 1), (9, 1), (33, 1), (64, 1), (big, 1), (21, 3)] {
                let DLinear::Dense { w: dw, .. } = &lin else { unreachable!() };
                // DLinear::forward picks one of the two kernels by the row count (and splits narrow ones).
                let picked = DBuf::<f32>::zeros(s, rows * out).unwrap();
                let mut ws = Workspace::new();
                lin.forward(&gpu, &mut ws, dx.ptr(), rows / a_div, a_div, 0, picked.ptr()).unwrap();
                let picked = s.clone_dtoh(picked.slice()).unwrap();
                // The row kernel adding its chunks in sequence.
                let row = DBuf::<f32>::zeros(s, rows * out).unwrap();
                f32_product(&gpu, F32Kernel::Rows, dx.ptr(), a_div, dw.ptr(), 0, row.ptr(), rows, out, inp, 0).unwrap();
                let want = s.clone_dtoh(row.slice()).unwrap();
                let got = if inp.is_multiple_of(4) {
                    // The tiled kernel (it takes K a multiple of 4), adding chunks in sequence and split.
                    let tiled = DBuf::<f32>::zeros(s, rows * out).unwrap();
                    f32_product(&gpu, F32Kernel::Tiled, dx.ptr(), a_div, dw.ptr(), 0, tiled.ptr(), rows, out, inp, 0)
                        .unwrap();
                    let split = DBuf::<f32>::zeros(s, rows * out).unwrap();
                    let part = DBuf::<f32>::zeros(s, inp.div_ceil(f32_chunk(inp)) * rows * out).unwrap();
                    f32_product(
                        &gpu,
                        F32Kernel::Tiled,
                        dx.ptr(),
                        a_div,
                        dw.ptr(),
                        0,
                        split.ptr(),
                        rows,
                        out,
                        inp,
                        part.ptr(),
                    )
                    .unwrap();
                    let (got, split) = (s.clone_dtoh(tiled.slice()).unwrap(), s.clone_dtoh(split.slice()).unwrap());
                    assert!(
                        bits(split) == bits(want.clone()),
                        "{out}x{inp}, {rows} rows: the split tiled kernel's bits"
                    );
                    assert!(
                        bits(got.clone()) == bits(want.clone()),
                        "{out}x{inp}, {rows} rows (a_div {a_div}): bits differ (seed {seed})"
                    );
                    got
                } else {
                    want.clone()
                };
                assert!(bits(picked) == bits(got.clone()), "{out}x{inp}, {rows} rows: forward's bits (seed {seed})");
                for m in 0..rows {
                    for c in 0..out {
                        let xr = &x[(m / a_div) * inp..][..inp];
                        let f: f64 = xr.iter().zip(&w[c * inp..][..inp]).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let g = got[m * out + c] as f64;
                        assert!(
                            (g - f).abs() <= 1e-5 * (inp as f64).sqrt(),
                            "{out}x{inp} y[{m},{c}] {g} vs {f} (seed {seed})"
                        );
                    }
                }
            }
        }
    }

    /// The bf16-weight kernels (lm_head and the other bf16 linears) against f32 sums on the host: exact
    /// small-integer inputs give the same bits; random inputs agree to f32 rounding; a row's result does not
    /// depend on the rows beside it (every row count through 16-row CTAs and a partial last one), including
    /// widths that are not a multiple of 8 channels (the one-value loads).
    #[test]
    fn bf16_linears_match_f32_sums_and_do_not_depend_on_the_batch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        // Widths: 300 and 250 take one-value loads; 264 (a multiple of 8, not of 256: a partial last step)
        // and 7168 take 16-byte loads.
        // From MIN_LINEAR_OUT outputs (1030 with 264 channels, 1100 with 7168) the tensor cores compute them
        // (bf16_mma): exact inputs still give the same bits, random ones agree to the split's 2^-17.
        for (out, inp, exact) in [
            (77, 300, true),
            (50, 264, true),
            (129, 7168, false),
            (40, 250, false),
            (1030, 264, true),
            (1100, 7168, false),
        ] {
            let w: Vec<f32> = (0..out * inp)
                .map(|_| if exact { rng.random_range(-4i32..=4) as f32 } else { rng.random::<f32>() * 2.0 - 1.0 })
                .map(|v| half::bf16::from_f32(v).to_f32())
                .collect();
            let big = 37;
            let x: Vec<f32> = (0..big * inp)
                .map(|_| if exact { rng.random_range(-8i32..=8) as f32 } else { rng.random::<f32>() * 2.0 - 1.0 })
                .collect();
            let bits: Vec<u16> = w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let lin = DLinear::Bf16 { w: DBuf::upload(s, &bits).unwrap(), out, inp };
            let dx = DBuf::upload(s, &x).unwrap();
            let run = |rows: usize| {
                let y = DBuf::<f32>::zeros(s, rows * out).unwrap();
                let mut ws = Workspace::new();
                lin.forward(&gpu, &mut ws, dx.ptr(), rows, 1, 0, y.ptr()).unwrap();
                s.clone_dtoh(y.slice()).unwrap()
            };
            let full = run(big);
            for r in 0..big {
                for c in 0..out {
                    let want: f64 = (0..inp).map(|k| x[r * inp + k] as f64 * w[c * inp + k] as f64).sum();
                    let got = full[r * out + c] as f64;
                    // The tensor cores' f32 accumulation is not round-to-nearest (a bias of up to an f32 step per
                    // 16-channel step): their bound is 2^-16 of the magnitude sum, as in bf16_mma's tests.
                    let mag: f64 = (0..inp).map(|k| (x[r * inp + k] as f64 * w[c * inp + k] as f64).abs()).sum();
                    let tol = match (exact, bf16_mma::serves_linear(out, inp)) {
                        (true, _) => 0.0,
                        (false, true) => mag * 2f64.powi(-16),
                        (false, false) => 1e-5 * (inp as f64).sqrt(),
                    };
                    assert!((got - want).abs() <= tol, "{out}x{inp} y[{r},{c}] = {got}, f64 sum {want} (seed {seed})");
                }
            }
            for rows in [1, 2, 8, 9, 15, 16, 17, 32, 33] {
                let got = run(rows);
                let same = got.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{out}x{inp}: the first {rows} rows differ from the same rows of {big} (seed {seed})");
            }
            // Two output rows per x row (a_div 2): row m reads x row m / 2.
            let y = DBuf::<f32>::zeros(s, 2 * 5 * out).unwrap();
            let mut ws = Workspace::new();
            lin.forward(&gpu, &mut ws, dx.ptr(), 5, 2, 0, y.ptr()).unwrap();
            let twice = s.clone_dtoh(y.slice()).unwrap();
            for m in 0..10 {
                let (got, want) = (&twice[m * out..(m + 1) * out], &full[(m / 2) * out..(m / 2 + 1) * out]);
                assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "a_div 2, row {m}");
            }
        }
        let lin = DLinear::Bf16 { w: DBuf::upload(s, &[0u16; 8]).unwrap(), out: 1, inp: 8 };
        let mut ws = Workspace::new();
        assert!(lin.forward(&gpu, &mut ws, 256, 1, 1, 256, 256).unwrap_err().to_string().contains("one matrix"));
    }
}
