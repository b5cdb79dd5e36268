//! The lightning indexer (docs/model.md §2.3): per-token index keys for the cache, per-query scores over the causal
//! context, and the top-k selection that sparse MLA attends to.

use super::kernels::{dot, hadamard, layer_norm_row};
use super::weights::Indexer;
use crate::rope::{Rope, apply_neox};
use crate::{ModelConfig, Precision, fp8};

/// Indexer keys' LayerNorm epsilon (DeepSeek's reference uses the LayerNorm default).
pub const K_NORM_EPS: f32 = 1e-6;

/// Queries of a batch of rows, ready to score.
pub struct Queries {
    /// Per row, per head: the vector dotted with keys (decoded e4m3 codes in FP8, f32 otherwise).
    pub q: Vec<f32>,
    /// Per row, per head: the head weight with every scale folded in
    /// (`weights_proj(x) * heads^-0.5 * q_scale * dim^-0.5`).
    pub w: Vec<f32>,
}

/// Index queries and keys for `rows` tokens at `positions`. Keys are returned in f32 (rotated and
/// Hadamard-transformed); the cache writer quantizes them.
pub fn project(
    ix: &Indexer,
    cfg: &ModelConfig,
    prec: Precision,
    rope: &Rope,
    x: &[f32],
    qr: &[f32],
    positions: &[usize],
) -> (Queries, Vec<f32>) {
    let rows = positions.len();
    let (heads, dim, rd) = (cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim);
    let mut q = ix.wq_b.forward(qr, rows);
    let mut k = ix.wk.forward(x, rows);
    let wts = ix.weights_proj.forward(x, rows);
    let mut w = vec![0f32; rows * heads];
    let head_scale = (heads as f32).powf(-0.5) * cfg.index_softmax_scale();
    let mut codes = vec![0f32; dim];
    for (r, &pos) in positions.iter().enumerate() {
        let (cos, sin) = rope.cos_sin(pos);
        let kr = &mut k[r * dim..(r + 1) * dim];
        layer_norm_row(kr, &ix.k_norm_w, &ix.k_norm_b, K_NORM_EPS);
        apply_neox(&mut kr[..rd], &cos, &sin);
        hadamard(kr);
        for h in 0..heads {
            let qh = &mut q[(r * heads + h) * dim..(r * heads + h + 1) * dim];
            apply_neox(&mut qh[..rd], &cos, &sin);
            hadamard(qh);
            let mut wh = wts[r * heads + h] * head_scale;
            if prec == Precision::Fp8 {
                let s = fp8::quantize_group_values(qh, &mut codes, true);
                qh.copy_from_slice(&codes);
                wh *= s;
            }
            w[r * heads + h] = wh;
        }
    }
    (Queries { q, w }, k)
}

/// `I[s] = k_scale[s] * sum_h w[h] * relu(q[h] . k[s])` for `s in 0..ctx`, the heads summed in [`head_sum`]'s order.
pub fn scores(q: &[f32], w: &[f32], keys: &[f32], k_scale: &[f32], ctx: usize, dim: usize) -> Vec<f32> {
    (0..ctx)
        .map(|s| {
            let ks = &keys[s * dim..(s + 1) * dim];
            head_sum(w.iter().enumerate().map(|(h, &wh)| (dot(&q[h * dim..(h + 1) * dim], ks), wh))) * k_scale[s]
        })
        .collect()
}

/// The indexer's sum over heads of `w[h] * ReLU(q_h . k)` from `(q_h . k, w[h])` pairs (docs/model.md §2.3):
/// four partial sums, partial `c` taking heads `h` with `(h / 2) % 4 == c` in ascending order, each term added
/// by a fused multiply-add (`p = fma(ReLU(d), w, p)`, one rounding), then `(P0 + P1) + (P2 + P3)`. This is the
/// order in which the GPU scorer's wgmma accumulator fragments lie (a thread holds heads `8j + 2c` and
/// `8j + 2c + 1`, four threads a token), so both backends give the same bits for the same products.
#[inline]
pub fn head_sum(terms: impl IntoIterator<Item = (f32, f32)>) -> f32 {
    let mut p = [0f32; 4];
    for (h, (d, wh)) in terms.into_iter().enumerate() {
        let c = (h / 2) % 4;
        p[c] = d.max(0.0).mul_add(wh, p[c]);
    }
    (p[0] + p[1]) + (p[2] + p[3])
}

/// The selection as a fixed-width list padded with -1 (the form attention kernels take).
pub fn padded(selection: &[usize], k: usize) -> Vec<i32> {
    let mut out: Vec<i32> = selection.iter().map(|&i| i as i32).collect();
    out.resize(k, -1);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn topk_equals_brute_force_ranking_with_padding() {
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let (heads, dim) = (4, 128);
        for ctx in [1usize, 5, 16, 17, 100, 1500] {
            // Real indexer scores from random queries and keys (distinct almost surely).
            let q: Vec<f32> = (0..heads * dim).map(|_| rng.random::<f32>() - 0.5).collect();
            let w: Vec<f32> = (0..heads).map(|_| rng.random::<f32>() - 0.3).collect();
            let keys: Vec<f32> = (0..ctx * dim).map(|_| rng.random::<f32>() - 0.5).collect();
            let s = scores(&q, &w, &keys, &vec![1.0; ctx], ctx, dim);
            let k = 16;
            let got = super::super::topk::select(&s, k);
            // Brute force: every score, larger first, equal scores (the ReLU's zeros) later position first.
            let mut brute: Vec<usize> = (0..ctx).collect();
            brute.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).unwrap().then(b.cmp(&a)));
            brute.truncate(k);
            brute.sort();
            assert_eq!(got, brute, "ctx {ctx} seed {seed}");
            let p = padded(&got, k);
            assert_eq!(p.len(), k);
            assert_eq!(p.iter().filter(|&&i| i == -1).count(), k.saturating_sub(ctx));
            assert!(p.iter().filter(|&&i| i >= 0).all(|&i| (i as usize) < ctx));
        }
    }

    #[test]
    fn scores_match_the_formula() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (heads, dim, ctx) = (3, 8, 5);
        let q: Vec<f32> = (0..heads * dim).map(|_| rng.random::<f32>() - 0.5).collect();
        let w: Vec<f32> = (0..heads).map(|_| rng.random::<f32>()).collect();
        let keys: Vec<f32> = (0..ctx * dim).map(|_| rng.random::<f32>() - 0.5).collect();
        let ks: Vec<f32> = (0..ctx).map(|_| rng.random::<f32>() + 0.5).collect();
        let got = scores(&q, &w, &keys, &ks, ctx, dim);
        for s in 0..ctx {
            let mut want = 0f64;
            for h in 0..heads {
                let d: f64 = (0..dim).map(|i| q[h * dim + i] as f64 * keys[s * dim + i] as f64).sum();
                want += d.max(0.0) * w[h] as f64;
            }
            want *= ks[s] as f64;
            assert!((got[s] as f64 - want).abs() < 1e-5);
        }
    }
}

#[cfg(test)]
mod rope_tests {
    use super::*;
    use crate::cpu::kernels::hadamard;
    use crate::cpu::test_support::{eye, indexer, small_cfg};

    #[test]
    fn indexer_rope_is_neox_on_the_first_64_dims() {
        // qr = 8 e0 reaches the first indexer query dim through an identity wq_b.
        let cfg = small_cfg(1);
        let ix = indexer(&cfg, eye(128, 64, 0), eye(128, 64, 0));
        let rope = Rope::new(&cfg);
        let pos = 7;
        let mut x = vec![0f32; 64];
        x[0] = 1.0;
        let mut qr = vec![0f32; 64];
        qr[0] = 8.0;
        let (q, _) = project(&ix, &cfg, Precision::Full, &rope, &x, &qr, &[pos]);
        let mut pre = q.q.clone();
        hadamard(&mut pre); // undo the (self-inverse) Hadamard rotation
        let (cos, sin) = rope.cos_sin(pos);
        assert!((pre[0] - 8.0 * cos[0]).abs() < 1e-4, "{}", pre[0]);
        assert!((pre[32] - 8.0 * sin[0]).abs() < 1e-4, "NeoX pairs dim 0 with dim 32: {}", pre[32]);
        assert!(
            pre[1].abs() < 1e-5,
            "interleaved RoPE (the early-code bug) would put the rotation into dim 1: {}",
            pre[1]
        );
        // The rope part is the FIRST 64 dims: dims 64.. are untouched (zero here).
        assert!(pre[64..].iter().all(|v| v.abs() < 1e-5));
    }
}
