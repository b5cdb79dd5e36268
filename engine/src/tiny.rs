//! A small DeepSeek-V3.2-architecture checkpoint in exactly the HF layout, generated deterministically
//! from a seed: `config.json` (model_type deepseek_v32), sharded FP8 block-scaled safetensors with
//! partial blocks, the MTP layer, `generation_config.json`. The tokenizer files come from the `text`
//! crate (`tandem gen-tiny` writes both).
//!
//! It keeps the real cache geometry (kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128: the
//! 656-byte and 8448-byte formats) and YaRN with factor 40 (so mscale matters); everything else is small,
//! and index_topk is 32 so prompts of a few hundred tokens already exercise sparse selection.

use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use crate::ModelConfig;
use crate::checkpoint::CheckpointError;
use crate::checkpoint::names::{Expect, expected_tensors, scale_name};
use crate::checkpoint::quant;
use crate::checkpoint::writer::{OwnedTensor, write_sharded};

/// Weight block of the FP8 weights (DeepSeek's).
pub const BLOCK: [usize; 2] = [128, 128];
/// Safetensors shards written.
pub const SHARDS: usize = 3;

/// The tiny model's `config.json` for a tokenizer of `vocab_size` tokens.
pub fn config_json(vocab_size: usize) -> Value {
    json!({
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "index_head_dim": 128,
        "index_n_heads": 4,
        "index_topk": 32,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": true,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 192,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": BLOCK,
        },
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
            "rope_type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": false,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_cache": true,
        "v_head_dim": 64,
        "vocab_size": vocab_size,
    })
}

pub fn generation_config_json() -> Value {
    json!({
        "_from_model_config": true,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "do_sample": true,
        "temperature": 0.6,
        "top_p": 0.95,
        "transformers_version": "4.57.1",
    })
}

/// Normal samples by Box-Muller.
pub(crate) struct Normal(pub(crate) ChaCha8Rng);

impl Normal {
    pub(crate) fn sample(&mut self, std: f32) -> f32 {
        let u1: f32 = self.0.random::<f32>().max(1e-12);
        let u2: f32 = self.0.random::<f32>();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos() * std
    }

    fn vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.sample(std)).collect()
    }
}

/// Standard deviation of a random projection `[out, in]`, chosen so activations keep unit scale, the
/// residual stream grows slowly (output projections are damped) and logits are varied enough for greedy
/// decoding not to collapse into one repeated token.
pub(crate) fn linear_std(name: &str, inp: usize) -> f32 {
    let base = (inp as f32).powf(-0.5);
    if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        0.5 * base
    } else if name.contains("weights_proj") {
        2.0 * base
    } else {
        base
    }
}

/// A non-linear float tensor (norms, embedding, head, router) of `n` values drawn by `normal(n, std)`.
pub(crate) fn float_tensor(
    name: &str,
    shape: &[usize],
    cfg: &ModelConfig,
    normal: &mut dyn FnMut(usize, f32) -> Vec<f32>,
) -> OwnedTensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = if name.ends_with("e_score_correction_bias") {
        normal(n, 0.02)
    } else if name.ends_with("k_norm.bias") {
        normal(n, 0.1)
    } else if shape.len() == 1 {
        // Norm weights around 1.
        normal(n, 0.1).into_iter().map(|v| 1.0 + v).collect()
    } else if name.ends_with("embed_tokens.weight") {
        normal(n, 1.0)
    } else if name.ends_with("lm_head.weight") || name.ends_with("shared_head.head.weight") {
        normal(n, 4.0 / (cfg.hidden_size as f32).sqrt())
    } else {
        // The MoE gate: varied routing.
        normal(n, 2.0 / (shape[1] as f32).sqrt())
    };
    if name.ends_with("e_score_correction_bias") {
        OwnedTensor::f32(shape.to_vec(), &values)
    } else {
        OwnedTensor::bf16(shape.to_vec(), &values)
    }
}

/// Every tensor of the tiny model for `cfg`, deterministic for `seed`.
pub fn tensors(cfg: &ModelConfig, seed: u64) -> Vec<(String, OwnedTensor)> {
    let mut rng = Normal(ChaCha8Rng::seed_from_u64(seed));
    let mut out: Vec<(String, OwnedTensor)> = Vec::new();
    let mut main_embed: Option<OwnedTensor> = None;
    let mut main_head: Option<OwnedTensor> = None;
    for spec in expected_tensors(cfg) {
        let name = spec.name.clone();
        // docs/model.md §2.5: the MTP layer's embedding and head are the main model's.
        if name.ends_with("shared_head.head.weight") {
            out.push((name, main_head.clone().expect("lm_head comes first")));
            continue;
        }
        if name.starts_with("model.layers.") && name.ends_with("embed_tokens.weight") {
            out.push((name, main_embed.clone().expect("embedding comes first")));
            continue;
        }
        // docs/model.md §3: these projections are bf16 in DeepSeek-V3.2 checkpoints; the rest are FP8.
        let bf16_linear = name.contains("weights_proj") || name.ends_with("eh_proj.weight");
        if spec.expect == Expect::Linear && !bf16_linear {
            let (rows, cols) = (spec.shape[0], spec.shape[1]);
            let w = rng.vec(rows * cols, linear_std(&name, cols));
            let (codes, scales) = quant::quantize(&w, rows, cols, BLOCK, true);
            let sname = scale_name(&name);
            out.push((name, OwnedTensor::fp8(spec.shape.clone(), codes)));
            out.push((sname, OwnedTensor::f32(vec![rows.div_ceil(BLOCK[0]), cols.div_ceil(BLOCK[1])], &scales)));
        } else if spec.expect == Expect::Linear {
            let w = rng.vec(spec.shape[0] * spec.shape[1], linear_std(&name, spec.shape[1]));
            out.push((name, OwnedTensor::bf16(spec.shape.clone(), &w)));
        } else {
            let t = float_tensor(&name, &spec.shape, cfg, &mut |n, std| rng.vec(n, std));
            if name == "model.embed_tokens.weight" {
                main_embed = Some(t.clone());
            }
            if name == "lm_head.weight" {
                main_head = Some(t.clone());
            }
            out.push((name, t));
        }
    }
    out
}

/// Writes the tiny checkpoint (everything but the tokenizer) into `dir`, which must exist.
pub fn write(dir: &Path, seed: u64, vocab_size: usize) -> Result<(), CheckpointError> {
    write_with_mtp_layers(dir, seed, vocab_size, 1)
}

/// The tiny checkpoint with `mtp_layers` MTP layers (`num_nextn_predict_layers`); only the first is
/// served, the others exercise checkpoints that ship more.
pub fn write_with_mtp_layers(
    dir: &Path,
    seed: u64,
    vocab_size: usize,
    mtp_layers: usize,
) -> Result<(), CheckpointError> {
    let mut config = config_json(vocab_size);
    config["num_nextn_predict_layers"] = json!(mtp_layers);
    let cfg = ModelConfig::from_json(&config)?;
    let write_json = |name: &str, v: &Value| {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(v).expect("json serializes");
        std::fs::write(&path, text + "\n").map_err(|source| CheckpointError::Io { path, source })
    };
    write_json("config.json", &config)?;
    write_json("generation_config.json", &generation_config_json())?;
    write_sharded(dir, &tensors(&cfg, seed), SHARDS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;

    #[test]
    fn generated_checkpoint_loads_and_is_deterministic() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write(a.path(), 7, 1280).unwrap();
        write(b.path(), 7, 1280).unwrap();
        let ca = Checkpoint::open(a.path()).unwrap();
        let cb = Checkpoint::open(b.path()).unwrap();
        assert_eq!(ca.fingerprint(), cb.fingerprint());
        for f in ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", "config.json"] {
            assert_eq!(std::fs::read(a.path().join(f)).unwrap(), std::fs::read(b.path().join(f)).unwrap(), "{f}");
        }
        assert!(ca.unexpected().is_empty());
        let cfg = ca.config();
        assert_eq!(cfg.num_nextn_predict_layers, 1);
        assert!(ca.contains("model.layers.4.eh_proj.weight"));
        // Partial blocks: q_lora_rank 192 = 1.5 blocks, kv_a out 576 = 4.5 blocks.
        assert_eq!(ca.tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv").unwrap().shape, &[5, 2]);
        assert_eq!(ca.tensor("model.layers.1.self_attn.q_a_proj.weight_scale_inv").unwrap().shape, &[2, 2]);
        write(b.path(), 8, 1280).unwrap();
        assert_ne!(Checkpoint::open(b.path()).unwrap().fingerprint(), ca.fingerprint(), "the seed matters");
    }

    #[test]
    fn a_second_mtp_layer_is_written_and_verifies() {
        let d = tempfile::tempdir().unwrap();
        write_with_mtp_layers(d.path(), 7, 1280, 2).unwrap();
        let c = Checkpoint::open(d.path()).unwrap();
        assert_eq!(c.config().num_nextn_predict_layers, 2);
        assert!(c.contains("model.layers.5.eh_proj.weight") && c.contains("model.layers.5.mlp.gate.weight"));
        assert!(c.unexpected().is_empty());
        assert_eq!(c.config().num_cache_layers(), 5, "4 decoder layers and the first MTP layer");
    }
}
