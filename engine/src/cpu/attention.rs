//! Multi-head latent attention (docs/model.md §2.2) over the selected tokens, in both forms: MHA with decompressed
//! keys/values (prefill) and MQA against the shared 576-d latent key (absorbed decode, what FlashMLA runs).

use super::kernels::{dot, rms_norm, softmax};
use super::weights::Mla;
use crate::ModelConfig;
use crate::rope::{Rope, apply_interleaved};

/// Per-row MLA projections.
pub struct Projected {
    /// `[rows, heads, nope + rope]`, RoPE applied to the last `rope` dims of each head.
    pub q: Vec<f32>,
    /// `[rows, q_lora_rank]`: the normed query latent, shared with the indexer.
    pub qr: Vec<f32>,
    /// `[rows, kv_lora_rank]`: the normed KV latent that is cached.
    pub c: Vec<f32>,
    /// `[rows, rope]`: the rotated shared rope key.
    pub k_pe: Vec<f32>,
}

pub fn project(m: &Mla, cfg: &ModelConfig, rope: &Rope, x: &[f32], positions: &[usize]) -> Projected {
    let rows = positions.len();
    let (heads, nope, rd, rank) =
        (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank);
    let qk = nope + rd;
    let qr = rms_norm(&m.q_a.forward(x, rows), &m.q_a_norm, cfg.rms_norm_eps);
    let mut q = m.q_b.forward(&qr, rows);
    let kv = m.kv_a.forward(x, rows);
    let mut c = vec![0f32; rows * rank];
    let mut k_pe = vec![0f32; rows * rd];
    for (r, &pos) in positions.iter().enumerate() {
        let (cos, sin) = rope.cos_sin(pos);
        for h in 0..heads {
            let base = (r * heads + h) * qk;
            apply_interleaved(&mut q[base + nope..base + qk], &cos, &sin);
        }
        let row = &kv[r * (rank + rd)..(r + 1) * (rank + rd)];
        super::kernels::rms_norm_row(&row[..rank], &m.kv_a_norm, cfg.rms_norm_eps, &mut c[r * rank..(r + 1) * rank]);
        let kp = &mut k_pe[r * rd..(r + 1) * rd];
        kp.copy_from_slice(&row[rank..]);
        apply_interleaved(kp, &cos, &sin);
    }
    Projected { q, qr, c, k_pe }
}

/// Context decompressed for the MHA form: `kv_b(c)` per context token.
pub struct Decompressed {
    /// `[ctx, heads, nope + v]`.
    pub kv: Vec<f32>,
    /// `[ctx, rope]`.
    pub k_pe: Vec<f32>,
}

pub fn decompress(m: &Mla, c: &[f32], k_pe: Vec<f32>, ctx: usize) -> Decompressed {
    Decompressed { kv: m.kv_b.forward(c, ctx), k_pe }
}

/// MHA form for one query row: `out [heads, v]`. `q_row` is `[heads, nope + rope]`; `selected` are context
/// positions (ascending) into `ctx`.
pub fn mha_row(cfg: &ModelConfig, q_row: &[f32], ctx: &Decompressed, selected: &[usize], scale: f32) -> Vec<f32> {
    let (heads, nope, rd, vd) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let (qk, kvw) = (nope + rd, nope + vd);
    let mut out = vec![0f32; heads * vd];
    let mut p = vec![0f32; selected.len()];
    for h in 0..heads {
        let qh = &q_row[h * qk..(h + 1) * qk];
        for (i, &s) in selected.iter().enumerate() {
            let kv = &ctx.kv[(s * heads + h) * kvw..(s * heads + h) * kvw + nope];
            p[i] = (dot(&qh[..nope], kv) + dot(&qh[nope..], &ctx.k_pe[s * rd..(s + 1) * rd])) * scale;
        }
        softmax(&mut p);
        let oh = &mut out[h * vd..(h + 1) * vd];
        for (i, &s) in selected.iter().enumerate() {
            let v = &ctx.kv[(s * heads + h) * kvw + nope..(s * heads + h + 1) * kvw];
            for (o, vv) in oh.iter_mut().zip(v) {
                *o += p[i] * vv;
            }
        }
    }
    out
}

/// Absorbed form for one query row: the selected tokens' latents `c_sel [n, rank]` and rope keys
/// `kpe_sel [n, rope]`, read from the cache. Returns `[heads, v]`.
pub fn absorbed_row(m: &Mla, cfg: &ModelConfig, q_row: &[f32], c_sel: &[f32], kpe_sel: &[f32], scale: f32) -> Vec<f32> {
    let (heads, nope, rd, vd, rank) =
        (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
    let qk = nope + rd;
    let n = c_sel.len() / rank;
    let mut out = vec![0f32; heads * vd];
    let mut q_abs = vec![0f32; rank];
    let mut p = vec![0f32; n];
    let mut lat = vec![0f32; rank];
    for h in 0..heads {
        let qh = &q_row[h * qk..(h + 1) * qk];
        let wt = &m.w_uk_t[h];
        for (cidx, qa) in q_abs.iter_mut().enumerate() {
            *qa = dot(&wt[cidx * nope..(cidx + 1) * nope], &qh[..nope]);
        }
        for (i, pi) in p.iter_mut().enumerate() {
            *pi = (dot(&q_abs, &c_sel[i * rank..(i + 1) * rank]) + dot(&qh[nope..], &kpe_sel[i * rd..(i + 1) * rd]))
                * scale;
        }
        softmax(&mut p);
        lat.fill(0.0);
        for (i, pi) in p.iter().enumerate() {
            for (l, cv) in lat.iter_mut().zip(&c_sel[i * rank..(i + 1) * rank]) {
                *l += pi * cv;
            }
        }
        let wv = &m.w_uv[h];
        for (d, o) in out[h * vd..(h + 1) * vd].iter_mut().enumerate() {
            *o = dot(&wv[d * rank..(d + 1) * rank], &lat);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_support::{eye, mla, random, rng, small_cfg};

    /// Dense causal attention over every context token, in f64, straight from the MHA definition.
    fn dense_reference(cfg: &ModelConfig, q_row: &[f32], ctx: &Decompressed, n: usize, scale: f32) -> Vec<f64> {
        let (heads, nope, rd, vd) =
            (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        let (qk, kvw) = (nope + rd, nope + vd);
        let mut out = vec![0f64; heads * vd];
        for h in 0..heads {
            let q = &q_row[h * qk..(h + 1) * qk];
            let scores: Vec<f64> = (0..n)
                .map(|s| {
                    let k = &ctx.kv[(s * heads + h) * kvw..(s * heads + h) * kvw + nope];
                    let kp = &ctx.k_pe[s * rd..(s + 1) * rd];
                    let d: f64 = (0..nope).map(|i| q[i] as f64 * k[i] as f64).sum::<f64>()
                        + (0..rd).map(|i| q[nope + i] as f64 * kp[i] as f64).sum::<f64>();
                    d * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
            for (s, sc) in scores.iter().enumerate() {
                let v = &ctx.kv[(s * heads + h) * kvw + nope..(s * heads + h + 1) * kvw];
                for d in 0..vd {
                    out[h * vd + d] += (sc - m).exp() / z * v[d] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn absorbed_form_equals_mha_form_and_sparse_with_full_topk_equals_dense() {
        let cfg = small_cfg(3);
        let (mut r, seed) = rng();
        let (heads, qk, rank, rd) =
            (cfg.num_attention_heads, cfg.qk_head_dim(), cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let (q_b, kv_a) = (random(&mut r, heads * qk * 64, 0.2), random(&mut r, (rank + rd) * 64, 0.2));
        let m = mla(&cfg, &mut r, q_b, kv_a);
        let n = 23;
        let c = random(&mut r, n * rank, 1.0);
        let k_pe = random(&mut r, n * rd, 1.0);
        let q_row = random(&mut r, heads * qk, 1.0);
        let scale = cfg.softmax_scale();
        let ctx = decompress(&m, &c, k_pe.clone(), n);

        // Sparse: a random subset, in both forms.
        let sel: Vec<usize> = (0..n).filter(|i| !(i * 7 + seed as usize).is_multiple_of(3)).collect();
        let mha = mha_row(&cfg, &q_row, &ctx, &sel, scale);
        let gather =
            |v: &[f32], w: usize| sel.iter().flat_map(|&s| v[s * w..(s + 1) * w].to_vec()).collect::<Vec<f32>>();
        let abs = absorbed_row(&m, &cfg, &q_row, &gather(&c, rank), &gather(&k_pe, rd), scale);
        for (a, b) in mha.iter().zip(&abs) {
            assert!((a - b).abs() <= 1e-5 + 1e-4 * a.abs(), "absorbed {b} vs mha {a} (seed {seed})");
        }

        // top-k >= context selects everything, which is dense attention.
        let all = crate::cpu::topk::select(&random(&mut r, n, 1.0), n + 5);
        assert_eq!(all, (0..n).collect::<Vec<_>>());
        let sparse = mha_row(&cfg, &q_row, &ctx, &all, scale);
        let dense = dense_reference(&cfg, &q_row, &ctx, n, scale);
        for (a, b) in sparse.iter().zip(&dense) {
            assert!((*a as f64 - b).abs() <= 1e-5 + 1e-4 * b.abs(), "sparse {a} vs dense {b} (seed {seed})");
        }
    }

    #[test]
    fn mla_rope_is_interleaved_on_the_last_64_dims() {
        // x = e0; q_a is the identity, so qr = rmsnorm(e0) = 8 e0 and q_b copies qr into the rope part.
        let cfg = small_cfg(1);
        let (mut r, _) = rng();
        let (qk, nope, rank, rd) = (cfg.qk_head_dim(), cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let m = mla(&cfg, &mut r, eye(qk, 64, nope), eye(rank + rd, 64, rank));
        let mut x = vec![0f32; 64];
        x[0] = 1.0;
        let rope = Rope::new(&cfg);
        let pos = 5;
        let p = project(&m, &cfg, &rope, &x, &[pos]);
        let (cos, sin) = rope.cos_sin(pos);
        let q_pe = &p.q[nope..qk];
        // Interleaved: dim 0 rotates with dim 1. NeoX would have rotated it with dim 32.
        assert!((q_pe[0] - 8.0 * cos[0]).abs() < 1e-3 && (q_pe[1] - 8.0 * sin[0]).abs() < 1e-3, "{:?}", &q_pe[..2]);
        assert_eq!(q_pe[32], 0.0, "MLA must not use NeoX pairs (0, 32)");
        // The shared key is rotated the same way: kv_a's rope rows copy x = e0 unnormalized.
        assert!((p.k_pe[0] - cos[0]).abs() < 1e-6 && (p.k_pe[1] - sin[0]).abs() < 1e-6);
        assert_eq!(p.k_pe[32], 0.0);
    }
}
