//! Projections: block-scaled FP8 (docs/model.md §2.1: e4m3 weights with block scales, activations quantized per
//! token per 128 channels with ue8m0 scales, fp32 accumulation per K block) or plain f32.

use safetensors::Dtype;

use super::kernels::{Tiles, matmul_t, run_tiles, tile};
use crate::Precision;
use crate::checkpoint::{Checkpoint, CheckpointError, names::scale_name};
use crate::fp8;

/// Activation quantization group (per token, per 128 channels).
pub const ACT_GROUP: usize = 128;

pub struct Fp8Linear {
    /// Decoded e4m3 weight values `[out, kpad]` as bf16 bits (exact: e4m3 fits bf16; not scaled; K padded
    /// with zeros to a multiple of 128). Half the bytes of f32, which is what bounds small-batch decode.
    q: Vec<u16>,
    /// Block scales `[ceil(out / block[0]), ceil(in / block[1])]`.
    scales: Vec<f32>,
    out: usize,
    inp: usize,
    kpad: usize,
    block: [usize; 2],
    ue8m0: bool,
}

pub enum Linear {
    /// `W [out, in]` in f32.
    Dense {
        w: Vec<f32>,
        out: usize,
        inp: usize,
    },
    Fp8(Fp8Linear),
}

impl Linear {
    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense { out, .. } => *out,
            Linear::Fp8(l) => l.out,
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn bytes(&self) -> u64 {
        match self {
            Linear::Dense { w, .. } => std::mem::size_of_val(w.as_slice()) as u64,
            Linear::Fp8(l) => {
                (std::mem::size_of_val(l.q.as_slice()) + std::mem::size_of_val(l.scales.as_slice())) as u64
            }
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            Linear::Dense { inp, .. } => *inp,
            Linear::Fp8(l) => l.inp,
        }
    }

    /// Loads `name` ([out, in]): FP8 weights stay FP8 in `Precision::Fp8`, everything else is dequantized.
    pub fn load(ckpt: &Checkpoint, name: &str, precision: Precision) -> Result<Self, CheckpointError> {
        let t = ckpt.tensor(name)?;
        let (out, inp) = (t.shape[0], t.shape[1]);
        if t.dtype != Dtype::F8_E4M3 || precision == Precision::Full {
            return Ok(Linear::Dense { w: ckpt.dequantized(name)?, out, inp });
        }
        let quant = ckpt
            .config()
            .quantization
            .clone()
            .unwrap_or(crate::config::Fp8Quant { weight_block_size: [128, 128], ue8m0: true });
        let block = quant.weight_block_size;
        if !(ACT_GROUP.is_multiple_of(block[1]) || block[1].is_multiple_of(ACT_GROUP)) {
            return Err(CheckpointError::Tensor {
                name: name.into(),
                file: t.file.into(),
                msg: format!(
                    "weight block {block:?} does not align with 128-channel activation groups; use --precision full"
                ),
            });
        }
        let scales = ckpt.tensor(&scale_name(name))?.to_f32()?;
        Ok(Linear::Fp8(Fp8Linear::new(t.data, scales, out, inp, block, quant.ue8m0)))
    }

    /// `y = x . W^T` for `x: [rows, in]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        match self {
            Linear::Dense { w, out, inp } => matmul_t(x, rows, *inp, w, *out),
            Linear::Fp8(l) => l.forward(x, rows),
        }
    }
}

impl Fp8Linear {
    pub fn new(codes: &[u8], scales: Vec<f32>, out: usize, inp: usize, block: [usize; 2], ue8m0: bool) -> Self {
        let kpad = inp.div_ceil(ACT_GROUP) * ACT_GROUP;
        let mut q = vec![0u16; out * kpad];
        for r in 0..out {
            for c in 0..inp {
                q[r * kpad + c] = half::bf16::from_f32(fp8::e4m3_to_f32(codes[r * inp + c])).to_bits();
            }
        }
        Fp8Linear { q, scales, out, inp, kpad, block, ue8m0 }
    }

    /// Quantizes activations per row per 128 channels: values `[rows, kpad]` and scales `[rows, groups]`.
    fn quantize_rows(&self, x: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
        let groups = self.kpad / ACT_GROUP;
        let mut qa = vec![0f32; rows * self.kpad];
        let mut sa = vec![0f32; rows * groups];
        for r in 0..rows {
            let xr = &x[r * self.inp..(r + 1) * self.inp];
            for g in 0..groups {
                let lo = g * ACT_GROUP;
                let hi = ((g + 1) * ACT_GROUP).min(self.inp);
                sa[r * groups + g] = fp8::quantize_group_values(
                    &xr[lo..hi],
                    &mut qa[r * self.kpad + lo..r * self.kpad + hi],
                    self.ue8m0,
                );
            }
        }
        (qa, sa)
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (qa, sa) = self.quantize_rows(x, rows);
        run_tiles(&Fp8Tiles { l: self, qa: &qa, sa: &sa }, rows, self.out)
    }
}

/// The FP8 GEMM as register tiles: per K segment (an activation group, or a weight block when smaller),
/// the segment's dot products in the fixed order, scaled by activation x weight block scale, summed.
struct Fp8Tiles<'a> {
    l: &'a Fp8Linear,
    qa: &'a [f32],
    sa: &'a [f32],
}

impl Tiles for Fp8Tiles<'_> {
    #[inline]
    fn tile<const R: usize, const C: usize>(&self, r: usize, c: usize) -> [[f32; C]; R] {
        let l = self.l;
        let (kpad, groups) = (l.kpad, l.kpad / ACT_GROUP);
        let seg = ACT_GROUP.min(l.block[1]);
        let scale_cols = l.inp.div_ceil(l.block[1]);
        let mut acc = [[0f32; C]; R];
        let mut s = 0;
        while s * seg < l.inp {
            let lo = s * seg;
            let p = tile::<u16, R, C>(
                std::array::from_fn(|i| &self.qa[(r + i) * kpad + lo..(r + i) * kpad + lo + seg]),
                std::array::from_fn(|j| &l.q[(c + j) * kpad + lo..(c + j) * kpad + lo + seg]),
            );
            for i in 0..R {
                let a = self.sa[(r + i) * groups + lo / ACT_GROUP];
                for j in 0..C {
                    let w = l.scales[((c + j) / l.block[0]) * scale_cols + lo / l.block[1]];
                    acc[i][j] += p[i][j] * (a * w);
                }
            }
            s += 1;
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::quant;
    use crate::tolerance::diff;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn fp8_linear_matches_f32_linear_on_dequantized_weights() {
        let (mut rng, seed) = crate::cpu::test_support::rng();
        // Partial blocks: 200 = 128 + 72 inputs, 300 outputs.
        let (rows, inp, out) = (9, 200, 300);
        let w: Vec<f32> = (0..out * inp).map(|_| rng.random::<f32>() - 0.5).collect();
        let x: Vec<f32> = (0..rows * inp).map(|_| (rng.random::<f32>() - 0.5) * 4.0).collect();
        let (codes, scales) = quant::quantize(&w, out, inp, [128, 128], true);
        let wd = quant::dequantize(&codes, &scales, out, inp, [128, 128]);
        let fp8 = Fp8Linear::new(&codes, scales.clone(), out, inp, [128, 128], true).forward(&x, rows);
        let reference = matmul_t(&x, rows, inp, &wd, out);
        let d = diff(&fp8, &reference);
        assert!(d < 1e-3, "FP8 GEMM diff {d} (seed {seed})");
        // Exact check of the FP8 semantics on one element: quantized activations times dequantized weights.
        let mut qx = x[..inp].to_vec();
        fp8::fake_quantize(&mut qx, 128, true);
        let exact: f64 = (0..inp).map(|k| qx[k] as f64 * wd[k] as f64).sum();
        assert!((fp8[0] as f64 - exact).abs() < 1e-4 * exact.abs().max(1.0), "{} vs {exact}", fp8[0]);
        // 64x64 re-blocked scales give the same result (K blocks inside one activation group).
        let s64 = quant::reblock_scales(&scales, out, inp, [128, 128], [64, 64]);
        let re = Fp8Linear::new(&codes, s64, out, inp, [64, 64], true).forward(&x, rows);
        assert!(diff(&re, &fp8) < 1e-6);
    }

    #[test]
    fn fp8_rows_are_batch_invariant() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (rows, inp, out) = (33, 256, 260);
        let w: Vec<f32> = (0..out * inp).map(|_| rng.random::<f32>() - 0.5).collect();
        let x: Vec<f32> = (0..rows * inp).map(|_| rng.random::<f32>() - 0.5).collect();
        let (codes, scales) = quant::quantize(&w, out, inp, [128, 128], true);
        let l = Fp8Linear::new(&codes, scales, out, inp, [128, 128], true);
        let all = l.forward(&x, rows);
        for r in [0, 16, 32] {
            assert_eq!(l.forward(&x[r * inp..(r + 1) * inp], 1), all[r * out..(r + 1) * out].to_vec());
        }
    }
}
