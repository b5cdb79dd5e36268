//! Builders for the CPU backend's unit tests: a small config and random or hand-made weights.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::linear::Linear;
use super::weights::{Indexer, Mla, absorb};
use crate::ModelConfig;

/// hidden 64, one attention head (nope 64, rope 64, v 64), kv_lora_rank 128, one 128-d indexer head.
pub fn small_cfg(heads: usize) -> ModelConfig {
    ModelConfig::from_json_str(&format!(
        r#"{{"model_type":"deepseek_v32","vocab_size":32,"hidden_size":64,"intermediate_size":64,
        "moe_intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":{heads},"n_routed_experts":4,
        "num_experts_per_tok":2,"q_lora_rank":64,"kv_lora_rank":128,"qk_nope_head_dim":64,"qk_rope_head_dim":64,
        "v_head_dim":64,"index_n_heads":1,"index_head_dim":128,"index_topk":8,"max_position_embeddings":163840,
        "rope_theta":10000,"rope_scaling":{{"type":"yarn","factor":40,"original_max_position_embeddings":4096,
        "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}}}}"#
    ))
    .expect("test config parses")
}

pub fn rng() -> (ChaCha8Rng, u64) {
    let seed =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
    (ChaCha8Rng::seed_from_u64(seed), seed)
}

pub fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

pub fn dense(out: usize, inp: usize, w: Vec<f32>) -> Linear {
    assert_eq!(w.len(), out * inp);
    Linear::Dense { w, out, inp }
}

/// `[out, inp]` with ones on the diagonal (as far as it reaches), placed at row offset `row0`.
pub fn eye(out: usize, inp: usize, row0: usize) -> Vec<f32> {
    let mut w = vec![0f32; out * inp];
    for i in 0..inp.min(out.saturating_sub(row0)) {
        w[(row0 + i) * inp + i] = 1.0;
    }
    w
}

/// An MLA block with the given projections (kv_b random unless given) and derived absorbed weights.
pub fn mla(cfg: &ModelConfig, rng: &mut ChaCha8Rng, q_b: Vec<f32>, kv_a: Vec<f32>) -> Mla {
    let (h, heads, qk) = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim());
    let (rank, rd, nope, vd) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim);
    let kv_b = random(rng, heads * (nope + vd) * rank, 0.1);
    let (w_uk_t, w_uv) = absorb(&kv_b, cfg);
    Mla {
        q_a: dense(cfg.q_lora_rank, h, eye(cfg.q_lora_rank, h, 0)),
        q_a_norm: vec![1.0; cfg.q_lora_rank],
        q_b: dense(heads * qk, cfg.q_lora_rank, q_b),
        kv_a: dense(rank + rd, h, kv_a),
        kv_a_norm: vec![1.0; rank],
        kv_b: dense(heads * (nope + vd), rank, kv_b),
        o: dense(h, heads * vd, random(rng, h * heads * vd, 0.1)),
        w_uk_t,
        w_uv,
    }
}

pub fn indexer(cfg: &ModelConfig, wq_b: Vec<f32>, wk: Vec<f32>) -> Indexer {
    let (h, d) = (cfg.hidden_size, cfg.index_head_dim);
    Indexer {
        wq_b: dense(cfg.index_n_heads * d, cfg.q_lora_rank, wq_b),
        wk: dense(d, h, wk),
        k_norm_w: vec![1.0; d],
        k_norm_b: vec![0.0; d],
        weights_proj: dense(cfg.index_n_heads, h, vec![1.0; cfg.index_n_heads * h]),
    }
}
