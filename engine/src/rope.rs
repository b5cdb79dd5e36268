//! Rotary embeddings with YaRN (docs/model.md §1). MLA rotates interleaved pairs `(2i, 2i+1)` of the last 64
//! dims of each head; the indexer rotates NeoX pairs `(i, i + 32)` of the FIRST 64 dims. Mixing them up is
//! the known bug of early DeepSeek-V3.2 code; tests pin both down.

use crate::ModelConfig;
use crate::config::yarn_mscale;

#[derive(Debug, Clone)]
pub struct Rope {
    /// Rotary frequency of each pair (dim / 2 of them).
    inv_freq: Vec<f64>,
    /// Multiplier on cos/sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim).
    attn_factor: f64,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let dim = cfg.qk_rope_head_dim;
        let base = cfg.rope_theta;
        let mut inv_freq: Vec<f64> = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64)).collect();
        let mut attn_factor = 1.0;
        if let Some(y) = &cfg.yarn {
            let (low, high) = correction_range(y.beta_fast, y.beta_slow, dim, base, y.original_max_position_embeddings);
            for (i, f) in inv_freq.iter_mut().enumerate() {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let smooth = 1.0 - ramp;
                *f = *f / y.factor * (1.0 - smooth) + *f * smooth;
            }
            attn_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
        }
        Rope { inv_freq, attn_factor }
    }

    /// Rotary frequency of each pair, after YaRN (what a GPU kernel evaluates `cos_sin` from).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The YaRN multiplier on cos and sin.
    pub fn attn_factor(&self) -> f64 {
        self.attn_factor
    }

    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// cos and sin of every pair's angle at `pos` (dim / 2 values each).
    pub fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let mut cos = Vec::with_capacity(self.inv_freq.len());
        let mut sin = Vec::with_capacity(self.inv_freq.len());
        for f in &self.inv_freq {
            let (s, c) = (pos as f64 * f).sin_cos();
            cos.push((c * self.attn_factor) as f32);
            sin.push((s * self.attn_factor) as f32);
        }
        (cos, sin)
    }
}

/// YaRN correction range over the rotary pairs (HF `find_correction_range` with truncation).
fn correction_range(beta_fast: f64, beta_slow: f64, dim: usize, base: f64, orig_max: usize) -> (f64, f64) {
    let find = |rot: f64| dim as f64 * (orig_max as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let low = find(beta_fast).floor().max(0.0);
    let high = find(beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high { (low, high + 0.001) } else { (low, high) }
}

/// MLA RoPE: rotates pairs `(2i, 2i+1)` of `x` (the 64 rope dims).
#[inline]
pub fn apply_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for i in 0..cos.len() {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * cos[i] - b * sin[i];
        x[2 * i + 1] = a * sin[i] + b * cos[i];
    }
}

/// Indexer RoPE: rotates pairs `(i, i + half)` of `x` (the first 64 dims of an indexer head).
#[inline]
pub fn apply_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = a * sin[i] + b * cos[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig::from_json_str(
            r#"{"model_type":"deepseek_v32","vocab_size":16,"hidden_size":8,"intermediate_size":8,
            "moe_intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,"n_routed_experts":4,
            "num_experts_per_tok":2,"q_lora_rank":8,"kv_lora_rank":512,"qk_nope_head_dim":8,"qk_rope_head_dim":64,
            "v_head_dim":8,"index_n_heads":1,"index_head_dim":128,"index_topk":4,"max_position_embeddings":163840,
            "rope_theta":10000,"rope_scaling":{"type":"yarn","factor":40,"original_max_position_embeddings":4096,
            "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}}"#,
        )
        .unwrap()
    }

    #[test]
    fn yarn_correction_range_is_10_to_23_for_deepseek() {
        assert_eq!(correction_range(32.0, 1.0, 64, 10000.0, 4096), (10.0, 23.0));
        let r = Rope::new(&cfg());
        // Below `low` frequencies are untouched, above `high` fully interpolated by 1/factor.
        assert!((r.inv_freq[0] - 1.0).abs() < 1e-12);
        let base = |i: usize| 1.0 / 10000f64.powf(2.0 * i as f64 / 64.0);
        assert!((r.inv_freq[31] - base(31) / 40.0).abs() < 1e-15);
        assert!((r.attn_factor - 1.0).abs() < 1e-12);
    }

    #[test]
    fn rotations_preserve_norm_and_relative_position() {
        let r = Rope::new(&cfg());
        let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        for apply in [apply_interleaved as fn(&mut [f32], &[f32], &[f32]), apply_neox] {
            let score = |pq: usize, pk: usize| {
                let (mut a, mut b) = (q.clone(), k.clone());
                let (c, s) = r.cos_sin(pq);
                apply(&mut a, &c, &s);
                let (c, s) = r.cos_sin(pk);
                apply(&mut b, &c, &s);
                a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
            };
            assert!((score(10, 7) - score(103, 100)).abs() < 1e-3);
        }
    }
}
