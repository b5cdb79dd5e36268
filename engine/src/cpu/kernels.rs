//! Numeric kernels of the CPU backend.
//!
//! Every dot product has one fixed evaluation order: 8 lanes accumulated with fused multiply-add over
//! the body, a fixed reduction tree, then the tail. The GEMM's register tiles (2 rows x 4 columns) and its
//! edge tiles evaluate each output element in exactly that order, so a value never depends on the batch,
//! the row's place in it or the thread that runs it: results are batch-invariant (docs/model.md §2.6).
//! `f32::mul_add` is an exact fused operation everywhere (a hardware FMA where the AVX2+FMA entry points
//! are taken, a correctly rounded software one otherwise), so every machine computes the same bits.

use rayon::prelude::*;

/// Lanes of every accumulator (one AVX2 register).
const LANES: usize = 8;
/// Output columns per parallel task: the task's weights stay in cache while all rows stream past.
const COL_BLOCK: usize = 32;

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let s4 = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// A weight element the tiles read: f32, or bf16 as raw bits. A bf16 value widens to f32 exactly, so a tile
/// over bf16 weights equals the tile over the widened weights bit for bit, while reading half the bytes (FP8
/// weights' decoded values are exact in bf16).
pub trait Weight: Copy {
    fn widen(self) -> f32;

    /// `LANES` weights from `p`, widened, as one AVX register.
    ///
    /// # Safety
    /// `p..p + LANES` is readable, and the CPU supports AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_lanes(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Weight for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_lanes(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees LANES readable values.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

/// bf16 as its raw bits.
impl Weight for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_lanes(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees LANES readable values.
        let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
    }
}

/// `R x C` dot products of `x[r]` with `w[c]` (all the same length), each in the fixed order.
#[inline(always)]
fn tile_impl<W: Weight, const R: usize, const C: usize>(x: [&[f32]; R], w: [&[W]; C]) -> [[f32; C]; R] {
    let n = x[0].len();
    let body = n / LANES * LANES;
    let mut acc = [[[0f32; LANES]; C]; R];
    let mut i = 0;
    while i < body {
        let xs: [&[f32; LANES]; R] = std::array::from_fn(|r| x[r][i..i + LANES].try_into().expect("lane chunk"));
        let ws: [&[W; LANES]; C] = std::array::from_fn(|c| w[c][i..i + LANES].try_into().expect("lane chunk"));
        for r in 0..R {
            for c in 0..C {
                for j in 0..LANES {
                    acc[r][c][j] = xs[r][j].mul_add(ws[c][j].widen(), acc[r][c][j]);
                }
            }
        }
        i += LANES;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut s = reduce(&acc[r][c]);
            for t in body..n {
                s = x[r][t].mul_add(w[c][t].widen(), s);
            }
            out[r][c] = s;
        }
    }
    out
}

/// The AVX2+FMA tile: one 8-lane register per accumulator, the same lane-wise fused multiply-adds and
/// the same reduction tree as `tile_impl`, so the bits are identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_fma<W: Weight, const R: usize, const C: usize>(x: [&[f32]; R], w: [&[W]; C]) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let n = x[0].len();
    assert!(x.iter().all(|s| s.len() == n) && w.iter().all(|s| s.len() == n), "tile operands differ in length");
    let body = n / LANES * LANES;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut i = 0;
    while i < body {
        // SAFETY: i + 8 <= body <= n = every operand's length (asserted above); the caller checked AVX2+FMA.
        unsafe {
            let xv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(x[r].as_ptr().add(i)));
            for c in 0..C {
                let wv = W::load_lanes(w[c].as_ptr().add(i));
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        i += LANES;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            // (a0 + a4, a1 + a5, a2 + a6, a3 + a7), then (s0 + s2) + (s1 + s3): `reduce`'s order.
            let v = acc[r][c];
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let mut s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
            for t in body..n {
                s = x[r][t].mul_add(w[c][t].widen(), s);
            }
            out[r][c] = s;
        }
    }
    out
}

#[inline]
fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `R x C` dot products in the engine's fixed order, over f32 or bf16 weights ([`Weight`]).
#[inline]
pub fn tile<W: Weight, const R: usize, const C: usize>(x: [&[f32]; R], w: [&[W]; C]) -> [[f32; C]; R] {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked).
        return unsafe { tile_fma(x, w) };
    }
    tile_impl(x, w)
}

/// `sum(a[i] * b[i])` in the engine's fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    tile::<f32, 1, 1>([a], [b])[0][0]
}

/// A GEMM-shaped problem: `y[r, c]` for `rows x cols`, computed by register tiles.
pub trait Tiles: Sync {
    /// Outputs `rows r..r+R`, columns `c..c+C`.
    fn tile<const R: usize, const C: usize>(&self, r: usize, c: usize) -> [[f32; C]; R];
}

/// Runs a `Tiles` problem: parallel over blocks of columns, each block sweeping all rows in 2x4 tiles
/// (1-row and 1-column tiles at the edges, which compute each element in the same order).
pub fn run_tiles<P: Tiles>(p: &P, rows: usize, cols: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return y;
    }
    let blocks: Vec<(usize, usize)> = (0..cols).step_by(COL_BLOCK).map(|c| (c, (c + COL_BLOCK).min(cols))).collect();
    let slabs: Vec<Vec<f32>> = blocks
        .par_iter()
        .map(|&(c0, c1)| {
            let w = c1 - c0;
            let mut slab = vec![0f32; rows * w];
            let mut r = 0;
            while r < rows {
                let two = r + 2 <= rows;
                let mut c = c0;
                while c < c1 {
                    if c + 4 <= c1 {
                        if two {
                            let t = p.tile::<2, 4>(r, c);
                            slab[r * w + c - c0..r * w + c - c0 + 4].copy_from_slice(&t[0]);
                            slab[(r + 1) * w + c - c0..(r + 1) * w + c - c0 + 4].copy_from_slice(&t[1]);
                        } else {
                            let t = p.tile::<1, 4>(r, c);
                            slab[r * w + c - c0..r * w + c - c0 + 4].copy_from_slice(&t[0]);
                        }
                        c += 4;
                    } else {
                        if two {
                            let t = p.tile::<2, 1>(r, c);
                            slab[r * w + c - c0] = t[0][0];
                            slab[(r + 1) * w + c - c0] = t[1][0];
                        } else {
                            slab[r * w + c - c0] = p.tile::<1, 1>(r, c)[0][0];
                        }
                        c += 1;
                    }
                }
                r += if two { 2 } else { 1 };
            }
            slab
        })
        .collect();
    for ((c0, c1), slab) in blocks.into_iter().zip(slabs) {
        let w = c1 - c0;
        for r in 0..rows {
            y[r * cols + c0..r * cols + c1].copy_from_slice(&slab[r * w..(r + 1) * w]);
        }
    }
    y
}

struct Dense<'a> {
    x: &'a [f32],
    w: &'a [f32],
    k: usize,
}

impl Tiles for Dense<'_> {
    #[inline]
    fn tile<const R: usize, const C: usize>(&self, r: usize, c: usize) -> [[f32; C]; R] {
        let k = self.k;
        tile(
            std::array::from_fn(|i| &self.x[(r + i) * k..(r + i + 1) * k]),
            std::array::from_fn(|j| &self.w[(c + j) * k..(c + j + 1) * k]),
        )
    }
}

/// `y = x . W^T` for `x: [rows, k]`, `W: [n, k]` (f32).
pub fn matmul_t(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    run_tiles(&Dense { x, w, k }, rows, n)
}

/// RMSNorm of each row: `x * rsqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, r) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        rms_norm_row(r, w, eps, o);
    }
    out
}

#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// LayerNorm of one row with weight and bias.
pub fn layer_norm_row(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), bb) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * g + bb;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// In-place softmax (max-subtracted; -inf entries get probability 0).
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Orthonormal Walsh-Hadamard transform (Sylvester order, scale n^-0.5) in place; n a power of two.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = (n as f32).powf(-0.5);
    for v in x.iter_mut() {
        *v *= s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn tiles_match_single_dots_bitwise_and_portable_matches_simd() {
        for n in [1, 7, 8, 9, 128, 200, 513] {
            let x: Vec<Vec<f32>> = (0..2).map(|r| data(n, 1 + r)).collect();
            let ws: Vec<Vec<f32>> = (0..4).map(|k| data(n, 10 + k)).collect();
            let t = tile::<f32, 2, 4>([&x[0], &x[1]], [&ws[0], &ws[1], &ws[2], &ws[3]]);
            for r in 0..2 {
                for k in 0..4 {
                    assert_eq!(t[r][k].to_bits(), dot(&x[r], &ws[k]).to_bits(), "n={n} r={r} k={k}");
                    assert_eq!(tile_impl::<f32, 1, 1>([&x[r]], [&ws[k]])[0][0].to_bits(), dot(&x[r], &ws[k]).to_bits());
                }
            }
        }
    }

    #[test]
    fn bf16_weight_tiles_equal_f32_tiles_on_the_widened_weights() {
        for n in [1, 8, 13, 128, 200] {
            let x: Vec<Vec<f32>> = (0..2).map(|r| data(n, 3 + r)).collect();
            let w16: Vec<Vec<u16>> =
                (0..4).map(|k| data(n, 30 + k).iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect()).collect();
            let w32: Vec<Vec<f32>> =
                w16.iter().map(|r| r.iter().map(|b| f32::from_bits((*b as u32) << 16)).collect()).collect();
            let a = tile::<u16, 2, 4>([&x[0], &x[1]], [&w16[0], &w16[1], &w16[2], &w16[3]]);
            let b = tile::<f32, 2, 4>([&x[0], &x[1]], [&w32[0], &w32[1], &w32[2], &w32[3]]);
            assert_eq!(a.map(|r| r.map(f32::to_bits)), b.map(|r| r.map(f32::to_bits)), "n={n}");
            let p = tile_impl::<u16, 2, 4>([&x[0], &x[1]], [&w16[0], &w16[1], &w16[2], &w16[3]]);
            assert_eq!(p.map(|r| r.map(f32::to_bits)), b.map(|r| r.map(f32::to_bits)), "portable n={n}");
        }
    }

    #[test]
    fn matmul_is_the_same_whatever_the_batch() {
        let (k, n) = (96, 301);
        let w = data(n * k, 3);
        let x = data(41 * k, 4);
        let all = matmul_t(&x, 41, k, &w, n);
        for r in [0, 7, 39, 40] {
            let one = matmul_t(&x[r * k..(r + 1) * k], 1, k, &w, n);
            assert_eq!(one, all[r * n..(r + 1) * n].to_vec(), "row {r}");
        }
        let naive: f32 = (0..k).map(|i| x[5 * k + i] as f64 * w[17 * k + i] as f64).sum::<f64>() as f32;
        assert!((all[5 * n + 17] - naive).abs() < 1e-5);
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let x = data(128, 9);
        let mut y = x.clone();
        hadamard(&mut y);
        assert!((dot(&x, &x) - dot(&y, &y)).abs() < 1e-4);
        hadamard(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
