//! Block-scaled FP8 weights: `W[r, c] = e4m3(q[r, c]) * scale[r / br, c / bc]` with partial edge blocks.

use crate::fp8;

/// Dequantizes an `[rows, cols]` e4m3 weight with `[ceil(rows/br), ceil(cols/bc)]` scales.
pub fn dequantize(q: &[u8], scales: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> Vec<f32> {
    let sc = cols.div_ceil(block[1]);
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / block[0]) * sc..(r / block[0] + 1) * sc];
        for c in 0..cols {
            out[r * cols + c] = fp8::e4m3_to_f32(q[r * cols + c]) * srow[c / block[1]];
        }
    }
    out
}

/// Quantizes an f32 `[rows, cols]` weight into e4m3 with one scale per block (ue8m0 when asked).
/// Returns (codes, scales).
pub fn quantize(w: &[f32], rows: usize, cols: usize, block: [usize; 2], ue8m0: bool) -> (Vec<u8>, Vec<f32>) {
    let (sr, sc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut scales = vec![0f32; sr * sc];
    for br in 0..sr {
        for bc in 0..sc {
            let mut amax = 0f32;
            for r in br * block[0]..((br + 1) * block[0]).min(rows) {
                for c in bc * block[1]..((bc + 1) * block[1]).min(cols) {
                    amax = amax.max(w[r * cols + c].abs());
                }
            }
            scales[br * sc + bc] = fp8::group_scale(amax, ue8m0);
        }
    }
    let mut q = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let s = scales[(r / block[0]) * sc + c / block[1]];
            q[r * cols + c] = fp8::f32_to_e4m3((w[r * cols + c] / s).clamp(-fp8::E4M3_MAX, fp8::E4M3_MAX));
        }
    }
    (q, scales)
}

/// Re-blocks scales to a block size that divides the old one (128x128 -> 64x64 for tensor-parallel
/// shards that split a block; docs/model.md §3): every old scale is replicated over the sub-blocks it covers,
/// so the dequantized weight is unchanged.
pub fn reblock_scales(scales: &[f32], rows: usize, cols: usize, from: [usize; 2], to: [usize; 2]) -> Vec<f32> {
    assert!(from[0].is_multiple_of(to[0]) && from[1].is_multiple_of(to[1]), "new block {to:?} must divide {from:?}");
    let (osc, nsr, nsc) = (cols.div_ceil(from[1]), rows.div_ceil(to[0]), cols.div_ceil(to[1]));
    let mut out = vec![0f32; nsr * nsc];
    for r in 0..nsr {
        for c in 0..nsc {
            out[r * nsc + c] = scales[(r * to[0] / from[0]) * osc + c * to[1] / from[1]];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    fn random_weight(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        // Blocks of very different magnitudes, so scales matter.
        (0..rows * cols)
            .map(|i| {
                (rng.random::<f32>() - 0.5)
                    * if (i / cols / 128 + i % cols / 128).is_multiple_of(2) { 0.01 } else { 3.0 }
            })
            .collect()
    }

    #[test]
    fn reblocking_128_to_64_keeps_dequantized_weights_identical() {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        // Partial blocks in both dimensions (300 = 2x128 + 44, 200 = 128 + 72).
        let (rows, cols) = (300, 200);
        let w = random_weight(rows, cols, seed);
        let (q, s128) = quantize(&w, rows, cols, [128, 128], true);
        let s64 = reblock_scales(&s128, rows, cols, [128, 128], [64, 64]);
        assert_eq!(s64.len(), rows.div_ceil(64) * cols.div_ceil(64));
        let a = dequantize(&q, &s128, rows, cols, [128, 128]);
        let b = dequantize(&q, &s64, rows, cols, [64, 64]);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "seed {seed}");
    }

    #[test]
    fn quantized_weights_are_close_to_the_originals() {
        let (rows, cols) = (130, 257);
        let w = random_weight(rows, cols, 11);
        for ue8m0 in [false, true] {
            let (q, s) = quantize(&w, rows, cols, [128, 128], ue8m0);
            let d = dequantize(&q, &s, rows, cols, [128, 128]);
            for (i, (x, y)) in w.iter().zip(&d).enumerate() {
                let bs = s[(i / cols / 128) * cols.div_ceil(128) + (i % cols) / 128];
                assert!((x - y).abs() <= x.abs() / 16.0 + bs / 512.0, "{i}: {x} vs {y}");
            }
        }
    }
}
