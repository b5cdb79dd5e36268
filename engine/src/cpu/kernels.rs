//! Numeric kernels of the CPU backend. Every reduction has one fixed order (16 lanes, a fixed reduction
//! tree, then the tail), whatever the batch, the row's position in it or the thread that runs it: that is
//! what makes results batch-invariant (SPEC section 2.6). The AVX2 entry points compile the same code
//! with wider vectors and no FMA, so they give bit-identical results to the portable path.

use rayon::prelude::*;

const LANES: usize = 16;

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut s8 = [0f32; 8];
    for j in 0..8 {
        s8[j] = acc[j] + acc[j + 8];
    }
    let s4 = [s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

#[inline(always)]
fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let body = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (x, y) in a[..body].chunks_exact(LANES).zip(b[..body].chunks_exact(LANES)) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = reduce(&acc);
    for i in body..n {
        s += a[i] * b[i];
    }
    s
}

/// Four dot products of `x` with `w0..w3`, each bit-identical to `dot(x, wi)`.
#[inline(always)]
fn dot4_impl(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    let n = x.len();
    let body = n / LANES * LANES;
    let mut acc = [[0f32; LANES]; 4];
    let mut c = 0;
    while c < body {
        let xs = &x[c..c + LANES];
        for k in 0..4 {
            let ws = &w[k][c..c + LANES];
            for j in 0..LANES {
                acc[k][j] += xs[j] * ws[j];
            }
        }
        c += LANES;
    }
    let mut out = [0f32; 4];
    for k in 0..4 {
        let mut s = reduce(&acc[k]);
        for i in body..n {
            s += x[i] * w[k][i];
        }
        out[k] = s;
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_impl(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4_avx2(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    dot4_impl(x, w)
}

#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `sum(a[i] * b[i])` in the engine's fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked).
        return unsafe { dot_avx2(a, b) };
    }
    dot_impl(a, b)
}

#[inline]
pub fn dot4(x: &[f32], w: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked).
        return unsafe { dot4_avx2(x, w) };
    }
    dot4_impl(x, w)
}

/// Rows per parallel task when splitting over rows.
const ROW_TASK: usize = 4;
/// Output columns per parallel task when splitting over columns.
const COL_TASK: usize = 64;

/// `y[r, n] = f(r, n)` computed in parallel for `rows x cols`, where `f4(r, n0)` produces columns
/// `n0..n0 + 4` (callers pass dot4-based closures). The split (rows or columns) never changes a value.
pub fn par_rows_cols(
    rows: usize,
    cols: usize,
    f4: impl Fn(usize, usize) -> [f32; 4] + Sync,
    f1: impl Fn(usize, usize) -> f32 + Sync,
) -> Vec<f32> {
    let mut y = vec![0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return y;
    }
    let fill_row_range = |r: usize, yr: &mut [f32], c0: usize, c1: usize| {
        let mut n = c0;
        while n + 4 <= c1 {
            let v = f4(r, n);
            yr[n - c0..n - c0 + 4].copy_from_slice(&v);
            n += 4;
        }
        while n < c1 {
            yr[n - c0] = f1(r, n);
            n += 1;
        }
    };
    let threads = rayon::current_num_threads();
    if rows >= ROW_TASK * threads * 2 || cols < 2 * COL_TASK {
        y.par_chunks_mut(cols * ROW_TASK).enumerate().for_each(|(t, chunk)| {
            for (i, yr) in chunk.chunks_mut(cols).enumerate() {
                fill_row_range(t * ROW_TASK + i, yr, 0, cols);
            }
        });
    } else {
        // Few rows (decode): split the columns; each task writes its own column slab per row.
        let tasks: Vec<(usize, usize)> = (0..cols).step_by(COL_TASK).map(|c| (c, (c + COL_TASK).min(cols))).collect();
        let slabs: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(c0, c1)| {
                let mut slab = vec![0f32; rows * (c1 - c0)];
                for r in 0..rows {
                    fill_row_range(r, &mut slab[r * (c1 - c0)..(r + 1) * (c1 - c0)], c0, c1);
                }
                slab
            })
            .collect();
        for ((c0, c1), slab) in tasks.into_iter().zip(slabs) {
            let w = c1 - c0;
            for r in 0..rows {
                y[r * cols + c0..r * cols + c1].copy_from_slice(&slab[r * w..(r + 1) * w]);
            }
        }
    }
    y
}

/// `y = x . W^T` for `x: [rows, k]`, `W: [n, k]` (f32).
pub fn matmul_t(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    par_rows_cols(
        rows,
        n,
        |r, c| {
            let xr = &x[r * k..(r + 1) * k];
            dot4(
                xr,
                [
                    &w[c * k..(c + 1) * k],
                    &w[(c + 1) * k..(c + 2) * k],
                    &w[(c + 2) * k..(c + 3) * k],
                    &w[(c + 3) * k..(c + 4) * k],
                ],
            )
        },
        |r, c| dot(&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]),
    )
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
    fn dot4_matches_dot_bitwise_and_portable_matches_avx2() {
        for n in [1, 15, 16, 17, 128, 200, 513] {
            let x = data(n, 1);
            let ws: Vec<Vec<f32>> = (0..4).map(|k| data(n, 10 + k)).collect();
            let four = dot4(&x, [&ws[0], &ws[1], &ws[2], &ws[3]]);
            for k in 0..4 {
                assert_eq!(four[k].to_bits(), dot(&x, &ws[k]).to_bits(), "n={n} k={k}");
                assert_eq!(dot_impl(&x, &ws[k]).to_bits(), dot(&x, &ws[k]).to_bits());
            }
        }
    }

    #[test]
    fn matmul_is_the_same_whatever_the_split() {
        let (k, n) = (96, 300);
        let w = data(n * k, 3);
        let x = data(40 * k, 4);
        let all = matmul_t(&x, 40, k, &w, n);
        for r in [0, 7, 39] {
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
