//! Products with bf16 weights on the tensor cores (`engine/kernels/bf16_mma.cu`): the checkpoint's bf16
//! linears (lm_head, the MTP head, eh_proj) and the absorbed MLA projections `W_UK^T q_nope` / `W_UV lat`,
//! one head per batch entry, from f32 activations.
//!
//! Each activation enters the bf16 MMA as two bf16 values, `hi = bf16(x)` and `lo = bf16(x - hi)` (16
//! significant bits, within 2^-17 |x| of x), so the result is an f32 dot product up to that and the tensor
//! cores' f32 accumulation (docs/model.md §2.1). Which kernel a product takes depends only on the weight's
//! shape ([`serves_linear`], [`serves_heads`]), and a row's bits do not depend on the batch: the k order is
//! fixed and rows never share sums.

use super::ops::{Arg, launch as launch_kernel};
use super::weights::AbsorbedWeights;
use super::{CudaError, Gpu};

/// Rows and output columns of a CTA, channels per stage (`BMMA_ROWS`, `BMMA_N`, `BMMA_K` in the kernel).
pub const ROWS: usize = 32;
pub const N: usize = 128;
pub const K: usize = 64;
const STAGES: usize = 3;
const THREADS: u32 = 256;
/// Must match `BMMA_SHARED_BYTES`: three stages of weights (128 rows of 72 bf16) and activations (32 rows of
/// 64 f32), and two split buffers (64 MMA rows of 72 bf16).
pub const SHARED_BYTES: usize = STAGES * (N * (K + 8) * 2 + ROWS * K * 4) + 2 * (2 * ROWS * (K + 8) * 2);

/// Plain bf16 linears with at least this many outputs take the tensor cores (enough CTAs for a row tile);
/// narrower ones keep the CUDA-core kernel (`tandem_gemm_bf16w`).
pub const MIN_LINEAR_OUT: usize = 8 * N;

/// Rows a CTA of the CUDA-core projections `tandem_mla_absorb_q` / `tandem_mla_up_v` takes
/// (`MLA_PROJ_ROWS` in model.cu).
const MLA_PROJ_ROWS: usize = 16;

/// Whether a plain bf16 linear `[out, inp]` runs on the tensor cores.
pub fn serves_linear(out: usize, inp: usize) -> bool {
    out >= MIN_LINEAR_OUT && serves_heads(inp)
}

/// Whether per-head products over `k` channels (bf16 weights) run on the tensor cores: the kernel loads
/// rows in 16-byte chunks, so `k` must be a multiple of 8.
pub fn serves_heads(k: usize) -> bool {
    k > 0 && k.is_multiple_of(8)
}

/// Extra bf16 columns copied into every output row after the product's `n`: `y[m][n + i] = bf16(src[m][i])`
/// (the absorbed query's rope part), element strides.
#[derive(Debug, Clone, Copy)]
pub struct Tail {
    pub src: u64,
    pub row: usize,
    pub batch: usize,
    pub n: usize,
}

/// One launch: `y[b][m, c] = x[b][m / a_div] . w[b][c]` for `b < batch`, `m < rows`, `c < n` over `k`
/// channels. Strides are in elements (f32 for x, bf16 for w, the output type for y); w's rows are `k` apart.
#[derive(Debug, Clone, Copy)]
pub struct Product {
    pub x: u64,
    pub x_row: usize,
    pub x_batch: usize,
    pub a_div: usize,
    pub w: u64,
    pub w_batch: usize,
    pub y: u64,
    pub y_row: usize,
    pub y_batch: usize,
    pub y_bf16: bool,
    pub tail: Option<Tail>,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    /// Device address of an i32 row count at most `rows` (the rows past it are not computed), or 0.
    pub rows_dev: u64,
}

impl Product {
    /// A plain linear `y [rows, out] = x [rows / a_div, inp] . w^T` (one matrix, f32 rows in and out), the
    /// rows past `*rows_dev` not computed where `rows_dev` is not 0.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(x: u64, a_div: usize, w: u64, y: u64, rows: usize, out: usize, inp: usize, rows_dev: u64) -> Self {
        Product {
            x,
            x_row: inp,
            x_batch: 0,
            a_div,
            w,
            w_batch: 0,
            y,
            y_row: out,
            y_batch: 0,
            y_bf16: false,
            tail: None,
            rows,
            n: out,
            k: inp,
            batch: 1,
            rows_dev,
        }
    }
}

/// Launches `p` on the GPU's stream after checking what the kernel assumes.
pub fn launch(gpu: &Gpu, p: &Product) -> Result<(), CudaError> {
    if p.rows == 0 || p.n == 0 || p.batch == 0 {
        return Ok(());
    }
    let bad = |m: String| Err(CudaError::Shape(format!("bf16 tensor-core product: {m}")));
    if !serves_heads(p.k) {
        return bad(format!("{} channels: a multiple of 8 is needed", p.k));
    }
    // 16-byte cp.async chunks: x rows at 4-float steps, w rows at 8-bf16 steps (k), both bases aligned.
    if !p.x.is_multiple_of(16) || !p.x_row.is_multiple_of(4) || !p.x_batch.is_multiple_of(4) {
        return bad(format!(
            "activations at {:#x} (row stride {}, batch stride {}) are not 16-byte aligned",
            p.x, p.x_row, p.x_batch
        ));
    }
    if !p.w.is_multiple_of(16) || !p.w_batch.is_multiple_of(8) {
        return bad(format!("weights at {:#x} (batch stride {}) are not 16-byte aligned", p.w, p.w_batch));
    }
    let int = |v: usize| v <= i32::MAX as usize;
    let tail_n = p.tail.map_or(0, |t| t.n);
    if p.a_div == 0 || !int(p.a_div) || !int(p.rows) || !int(p.n) || !int(p.k) || !int(tail_n) {
        return bad(format!(
            "{} rows (a_div {}), {} columns, {} channels, {tail_n} tail columns",
            p.rows, p.a_div, p.n, p.k
        ));
    }
    // Column tiles and batch entries are the grid's y and z.
    if p.n.div_ceil(N) > 65_535 || p.batch > 65_535 {
        return bad(format!("{} columns in {} batch entries exceed the grid", p.n, p.batch));
    }
    let y_align = if p.y_bf16 { 2 } else { 4 };
    if !p.y.is_multiple_of(y_align) {
        return bad(format!("output at {:#x} is not {y_align}-byte aligned", p.y));
    }
    if p.tail.is_some() && !p.y_bf16 {
        return bad("tail columns are bf16: the output must be bf16".into());
    }
    let t = p.tail.unwrap_or(Tail { src: 0, row: 0, batch: 0, n: 0 });
    let grid = (p.rows.div_ceil(ROWS) as u32, p.n.div_ceil(N) as u32, p.batch as u32);
    let i = |v: usize| Arg::I(v as i32);
    let l = |v: usize| Arg::L(v as i64);
    launch_kernel(
        gpu,
        "tandem_gemm_bf16_mma",
        grid,
        THREADS,
        SHARED_BYTES as u32,
        &[
            Arg::P(p.x),
            l(p.x_row),
            l(p.x_batch),
            i(p.a_div),
            Arg::P(p.w),
            l(p.w_batch),
            Arg::P(p.y),
            l(p.y_row),
            l(p.y_batch),
            i(p.y_bf16 as usize),
            Arg::P(t.src),
            l(t.row),
            l(t.batch),
            i(t.n),
            i(p.rows),
            i(p.n),
            i(p.k),
            Arg::P(p.rows_dev),
        ],
    )
}

/// The FP8 decode's absorbed queries: `qb[r, h] = bf16(W_UK^T[h] q_nope[r, h])` then `bf16(q_pe[r, h])`
/// (`rank + rd` values per head) from `q [rows, heads, nope + rd]` (f32).
#[allow(clippy::too_many_arguments)]
pub fn absorb_q(
    gpu: &Gpu,
    w_uk_t: &AbsorbedWeights,
    q: u64,
    qb: u64,
    rows: usize,
    heads: usize,
    nope: usize,
    rd: usize,
    rank: usize,
) -> Result<(), CudaError> {
    let qk = nope + rd;
    let product = Product {
        x: q,
        x_row: heads * qk,
        x_batch: qk,
        a_div: 1,
        w: w_uk_t.ptr(),
        w_batch: rank * nope,
        y: qb,
        y_row: heads * (rank + rd),
        y_batch: rank + rd,
        y_bf16: true,
        tail: Some(Tail { src: q + (nope * 4) as u64, row: heads * qk, batch: qk, n: rd }),
        rows,
        n: rank,
        k: nope,
        batch: heads,
        rows_dev: 0,
    };
    let i = |v: usize| Arg::I(v as i32);
    head_product(gpu, w_uk_t, &product, "tandem_mla_absorb_q", &[i(rows), i(heads), i(nope), i(rd), i(rank)])
}

/// The FP8 decode's up-projection: `out[r, h] = W_UV[h] lat[r, h]` (f32) from `lat [rows, heads, rank]`.
#[allow(clippy::too_many_arguments)]
pub fn up_v(
    gpu: &Gpu,
    w_uv: &AbsorbedWeights,
    lat: u64,
    out: u64,
    rows: usize,
    heads: usize,
    rank: usize,
    vd: usize,
) -> Result<(), CudaError> {
    let product = Product {
        x: lat,
        x_row: heads * rank,
        x_batch: rank,
        a_div: 1,
        w: w_uv.ptr(),
        w_batch: vd * rank,
        y: out,
        y_row: heads * vd,
        y_batch: vd,
        y_bf16: false,
        tail: None,
        rows,
        n: vd,
        k: rank,
        batch: heads,
        rows_dev: 0,
    };
    let i = |v: usize| Arg::I(v as i32);
    head_product(gpu, w_uv, &product, "tandem_mla_up_v", &[i(rows), i(heads), i(rank), i(vd)])
}

/// One absorbed projection (a batch entry per head): `p` on the tensor cores where the weights are bf16 and
/// its channels fit ([`serves_heads`]), else the CUDA-core kernel `cuda_core` (`_bf16w` for bf16 weights,
/// one CTA per head and MLA_PROJ_ROWS rows) with its arguments after x, w and y.
fn head_product(gpu: &Gpu, w: &AbsorbedWeights, p: &Product, cuda_core: &str, shape: &[Arg]) -> Result<(), CudaError> {
    if w.is_bf16() && serves_heads(p.k) {
        return launch(gpu, p);
    }
    let name = if w.is_bf16() { format!("{cuda_core}_bf16w") } else { cuda_core.to_string() };
    let args: Vec<Arg> = [Arg::P(p.x), Arg::P(p.w), Arg::P(p.y)].into_iter().chain(shape.iter().copied()).collect();
    let grid = (p.batch as u32, p.rows.div_ceil(MLA_PROJ_ROWS) as u32, 1);
    launch_kernel(gpu, &name, grid, 256, (MLA_PROJ_ROWS * p.k * 4) as u32, &args)
}

#[cfg(test)]
mod tests {
    use rand::RngExt;

    use super::*;
    use crate::cuda::ops::DBuf;

    fn bf16(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }

    /// Batched products against f64 sums: small integers (exact in the split and in f32 sums) give the f64
    /// value's bits, which pins every fragment's place; random values agree within 2^-16 of the magnitude
    /// sum; a row's bits are the same in every row count (row tiles of 32, partial ones); a_div repeats rows.
    #[test]
    fn batched_products_match_f64_sums_and_do_not_depend_on_the_batch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        // (n, k, batch): partial column tiles, k not a multiple of the 64-channel stage, one 8-channel step.
        for (n, k, batch, exact) in
            [(300, 72, 3, true), (1280, 256, 1, true), (130, 200, 2, false), (17, 8, 2, true), (640, 520, 2, false)]
        {
            let big = 70;
            let w: Vec<f32> = (0..batch * n * k)
                .map(|_| if exact { rng.random_range(-6i32..=6) as f32 } else { rng.random::<f32>() * 2.0 - 1.0 })
                .map(|v| half::bf16::from_f32(v).to_f32())
                .collect();
            // Activations with a spread of exponents (the lo part matters), rows of batch entries interleaved
            // as the absorbed projections lay them out: x[m][b][k].
            let x: Vec<f32> = (0..big * batch * k)
                .map(|_| {
                    if exact {
                        rng.random_range(-40i32..=40) as f32
                    } else {
                        (rng.random::<f32>() - 0.5) * 2f32.powi(rng.random_range(-6..6))
                    }
                })
                .collect();
            let wb: Vec<u16> = w.iter().map(|&v| bf16(v)).collect();
            let (dx, dw) = (DBuf::upload(s, &x).unwrap(), DBuf::upload(s, &wb).unwrap());
            // The batched product over x and w into `y` (rows x batch x n).
            let product = |rows: usize, a_div: usize, y: u64, rows_dev: u64| Product {
                x: dx.ptr(),
                x_row: batch * k,
                x_batch: k,
                a_div,
                w: dw.ptr(),
                w_batch: n * k,
                y,
                y_row: batch * n,
                y_batch: n,
                y_bf16: false,
                tail: None,
                rows,
                n,
                k,
                batch,
                rows_dev,
            };
            let run = |rows: usize, a_div: usize| {
                let y = DBuf::<f32>::zeros(s, rows * batch * n).unwrap();
                launch(&gpu, &product(rows, a_div, y.ptr(), 0)).unwrap();
                s.clone_dtoh(y.slice()).unwrap()
            };
            let full = run(big, 1);
            for m in 0..big {
                for b in 0..batch {
                    let xr = &x[(m * batch + b) * k..][..k];
                    for c in 0..n {
                        let wr = &w[(b * n + c) * k..][..k];
                        let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = xr.iter().zip(wr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                        let got = full[(m * batch + b) * n + c];
                        if exact {
                            assert_eq!(got, want as f32, "{n}x{k}x{batch} y[{m},{b},{c}] (seed {seed})");
                        } else {
                            let tol = mag * 2f64.powi(-16);
                            assert!(
                                (got as f64 - want).abs() <= tol,
                                "{n}x{k}x{batch} y[{m},{b},{c}] = {got}, f64 {want}, tolerance {tol} (seed {seed})"
                            );
                        }
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for rows in [1, 2, 7, 8, 9, 31, 32, 33, 64, 65] {
                let got = run(rows, 1);
                assert!(bits(&got) == bits(&full[..got.len()]), "{n}x{k}: {rows} rows differ from {big} (seed {seed})");
            }
            // a_div 3: output row m reads x row m / 3.
            let rep = run(30, 3);
            for m in 0..30 {
                let (got, want) = (&rep[m * batch * n..][..batch * n], &full[(m / 3) * batch * n..][..batch * n]);
                assert!(bits(got) == bits(want), "{n}x{k}: a_div 3, row {m} (seed {seed})");
            }
            // A row count in device memory (DLinear::forward_first): the rows below it as computed with every
            // row, across the 32-row CTA boundary; the rows past it untouched.
            const SENTINEL: u32 = 0x7fc0_1234;
            for count in [1i32, 33, 70] {
                let dcount = DBuf::upload(s, &[count]).unwrap();
                let y = DBuf::upload(s, &vec![f32::from_bits(SENTINEL); big * batch * n]).unwrap();
                let p = product(big, 1, y.ptr(), dcount.ptr());
                launch(&gpu, &p).unwrap();
                let got = s.clone_dtoh(y.slice()).unwrap();
                let at = count as usize * batch * n;
                assert!(bits(&got[..at]) == bits(&full[..at]), "{n}x{k}: the first {count} rows differ (seed {seed})");
                assert!(got[at..].iter().all(|v| v.to_bits() == SENTINEL), "{n}x{k}: rows past {count} written");
            }
        }
    }

    /// bf16 output with tail columns: the absorbed query's layout (`rank` product columns, then `rd` copied
    /// ones, per head), with the product's values rounded once.
    #[test]
    fn bf16_output_and_tail_columns() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let s = gpu.stream();
        let (rows, heads, k, rd, n) = (11usize, 2usize, 64usize, 8usize, 40usize);
        let w: Vec<f32> =
            (0..heads * n * k).map(|_| half::bf16::from_f32(rng.random::<f32>() - 0.5).to_f32()).collect();
        let x: Vec<f32> = (0..rows * heads * (k + rd)).map(|_| rng.random::<f32>() - 0.5).collect();
        let wb: Vec<u16> = w.iter().map(|&v| bf16(v)).collect();
        let (dx, dw) = (DBuf::upload(s, &x).unwrap(), DBuf::upload(s, &wb).unwrap());
        let y = DBuf::<u16>::zeros(s, rows * heads * (n + rd)).unwrap();
        let qk = k + rd;
        let p = Product {
            x: dx.ptr(),
            x_row: heads * qk,
            x_batch: qk,
            a_div: 1,
            w: dw.ptr(),
            w_batch: n * k,
            y: y.ptr(),
            y_row: heads * (n + rd),
            y_batch: n + rd,
            y_bf16: true,
            tail: Some(Tail { src: dx.ptr() + (k * 4) as u64, row: heads * qk, batch: qk, n: rd }),
            rows,
            n,
            k,
            batch: heads,
            rows_dev: 0,
        };
        launch(&gpu, &p).unwrap();
        let got = s.clone_dtoh(y.slice()).unwrap();
        for m in 0..rows {
            for h in 0..heads {
                let xr = &x[(m * heads + h) * qk..][..qk];
                for c in 0..n + rd {
                    let g = half::bf16::from_bits(got[(m * heads + h) * (n + rd) + c]).to_f32() as f64;
                    if c >= n {
                        assert_eq!(g as f32, half::bf16::from_f32(xr[k + c - n]).to_f32(), "tail [{m},{h},{c}]");
                        continue;
                    }
                    let wr = &w[(h * n + c) * k..][..k];
                    let want: f64 = xr[..k].iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = xr[..k].iter().zip(wr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    let tol = want.abs() * 2f64.powi(-8) + mag * 2f64.powi(-16);
                    assert!((g - want).abs() <= tol, "y[{m},{h},{c}] = {g}, f64 {want} (seed {seed})");
                }
            }
        }
    }

    /// An infinite activation (or one that rounds to infinity in bf16) is carried by its hi part alone: the
    /// output is infinite, not NaN.
    #[test]
    fn infinite_activations_give_infinite_outputs() {
        let Some(gpu) = Gpu::for_test() else { return };
        let s = gpu.stream();
        let (n, k) = (8usize, 16usize);
        let w: Vec<u16> = vec![bf16(0.5); n * k];
        let mut x = vec![1.0f32; 3 * k];
        x[0] = f32::INFINITY;
        x[k + 3] = f32::MAX;
        let (dx, dw) = (DBuf::upload(s, &x).unwrap(), DBuf::upload(s, &w).unwrap());
        let y = DBuf::<f32>::zeros(s, 3 * n).unwrap();
        let p = Product {
            x: dx.ptr(),
            x_row: k,
            x_batch: 0,
            a_div: 1,
            w: dw.ptr(),
            w_batch: 0,
            y: y.ptr(),
            y_row: n,
            y_batch: 0,
            y_bf16: false,
            tail: None,
            rows: 3,
            n,
            k,
            batch: 1,
            rows_dev: 0,
        };
        launch(&gpu, &p).unwrap();
        let got = s.clone_dtoh(y.slice()).unwrap();
        assert!(got[..2 * n].iter().all(|v| *v == f32::INFINITY), "{got:?}");
        assert!(got[2 * n..].iter().all(|v| *v == 8.0), "{got:?}");
    }

    /// What the kernel cannot take is an error before the launch.
    #[test]
    fn bad_products_are_errors() {
        let Some(gpu) = Gpu::for_test() else { return };
        let s = gpu.stream();
        let buf = DBuf::<f32>::zeros(s, 4096).unwrap();
        let ok = Product {
            x: buf.ptr(),
            x_row: 16,
            x_batch: 0,
            a_div: 1,
            w: buf.ptr(),
            w_batch: 0,
            y: buf.ptr() + 8192,
            y_row: 16,
            y_batch: 0,
            y_bf16: false,
            tail: None,
            rows: 2,
            n: 16,
            k: 16,
            batch: 1,
            rows_dev: 0,
        };
        launch(&gpu, &ok).unwrap();
        for (p, what) in [
            (Product { k: 12, ..ok }, "multiple of 8"),
            (Product { x: ok.x + 4, ..ok }, "not 16-byte aligned"),
            (Product { x_row: 18, ..ok }, "not 16-byte aligned"),
            (Product { w: ok.w + 8, ..ok }, "not 16-byte aligned"),
            (Product { a_div: 0, ..ok }, "a_div 0"),
            (Product { tail: Some(Tail { src: ok.x, row: 0, batch: 0, n: 1 }), ..ok }, "must be bf16"),
            (Product { batch: 70_000, ..ok }, "exceed the grid"),
            (Product { n: 128 * 65_536, ..ok }, "exceed the grid"),
            (Product { y: ok.y + 2, ..ok }, "not 4-byte aligned"),
        ] {
            let e = launch(&gpu, &p).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        assert!(serves_linear(129280, 7168) && serves_linear(1280, 256));
        assert!(!serves_linear(1023, 7168) && !serves_linear(7168, 300) && !serves_heads(0));
    }
}
