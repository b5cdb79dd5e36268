//! The HF tensor names of a DeepSeek-V3.2 checkpoint (docs/model.md §3) and the shape each must have for a
//! given config.

use crate::ModelConfig;

/// What a tensor is, which decides the dtypes it may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// A projection: FP8 e4m3 with a `weight_scale_inv` block-scale tensor, or bf16/f16/f32 without one.
    Linear,
    /// A bf16/f16/f32 tensor (norms, embeddings, lm_head, the MoE gate and its bias).
    Float,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub expect: Expect,
    /// May be absent (MTP embed/head shared with the main model, lm_head tied to the embedding).
    pub optional: bool,
}

/// Name of the block-scale tensor of an FP8 linear weight.
pub fn scale_name(weight: &str) -> String {
    format!("{weight}_scale_inv")
}

pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

fn push(out: &mut Vec<TensorSpec>, name: String, shape: Vec<usize>, expect: Expect) {
    out.push(TensorSpec { name, shape, expect, optional: false });
}

fn mlp(out: &mut Vec<TensorSpec>, p: &str, hidden: usize, inter: usize) {
    push(out, format!("{p}gate_proj.weight"), vec![inter, hidden], Expect::Linear);
    push(out, format!("{p}up_proj.weight"), vec![inter, hidden], Expect::Linear);
    push(out, format!("{p}down_proj.weight"), vec![hidden, inter], Expect::Linear);
}

/// The tensors of decoder layer `layer` (also used for the MTP layers' decoder block).
pub fn decoder_layer(cfg: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    let p = layer_prefix(layer);
    let h = cfg.hidden_size;
    let heads = cfg.num_attention_heads;
    let mut out = Vec::new();
    push(&mut out, format!("{p}input_layernorm.weight"), vec![h], Expect::Float);
    push(&mut out, format!("{p}post_attention_layernorm.weight"), vec![h], Expect::Float);
    let a = format!("{p}self_attn.");
    push(&mut out, format!("{a}q_a_proj.weight"), vec![cfg.q_lora_rank, h], Expect::Linear);
    push(&mut out, format!("{a}q_a_layernorm.weight"), vec![cfg.q_lora_rank], Expect::Float);
    push(&mut out, format!("{a}q_b_proj.weight"), vec![heads * cfg.qk_head_dim(), cfg.q_lora_rank], Expect::Linear);
    push(
        &mut out,
        format!("{a}kv_a_proj_with_mqa.weight"),
        vec![cfg.kv_lora_rank + cfg.qk_rope_head_dim, h],
        Expect::Linear,
    );
    push(&mut out, format!("{a}kv_a_layernorm.weight"), vec![cfg.kv_lora_rank], Expect::Float);
    push(
        &mut out,
        format!("{a}kv_b_proj.weight"),
        vec![heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank],
        Expect::Linear,
    );
    push(&mut out, format!("{a}o_proj.weight"), vec![h, heads * cfg.v_head_dim], Expect::Linear);
    let ix = format!("{a}indexer.");
    push(
        &mut out,
        format!("{ix}wq_b.weight"),
        vec![cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank],
        Expect::Linear,
    );
    push(&mut out, format!("{ix}wk.weight"), vec![cfg.index_head_dim, h], Expect::Linear);
    push(&mut out, format!("{ix}k_norm.weight"), vec![cfg.index_head_dim], Expect::Float);
    push(&mut out, format!("{ix}k_norm.bias"), vec![cfg.index_head_dim], Expect::Float);
    push(&mut out, format!("{ix}weights_proj.weight"), vec![cfg.index_n_heads, h], Expect::Linear);
    let m = format!("{p}mlp.");
    if cfg.is_moe_layer(layer) {
        push(&mut out, format!("{m}gate.weight"), vec![cfg.n_routed_experts, h], Expect::Float);
        push(&mut out, format!("{m}gate.e_score_correction_bias"), vec![cfg.n_routed_experts], Expect::Float);
        for e in 0..cfg.n_routed_experts {
            mlp(&mut out, &format!("{m}experts.{e}."), h, cfg.moe_intermediate_size);
        }
        if cfg.n_shared_experts > 0 {
            mlp(&mut out, &format!("{m}shared_experts."), h, cfg.moe_intermediate_size * cfg.n_shared_experts);
        }
    } else {
        mlp(&mut out, &m, h, cfg.intermediate_size);
    }
    out
}

/// The extra tensors of MTP layer `layer` (index >= num_hidden_layers).
pub fn mtp_layer_extras(cfg: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    let p = layer_prefix(layer);
    let h = cfg.hidden_size;
    let mut out = Vec::new();
    push(&mut out, format!("{p}enorm.weight"), vec![h], Expect::Float);
    push(&mut out, format!("{p}hnorm.weight"), vec![h], Expect::Float);
    push(&mut out, format!("{p}eh_proj.weight"), vec![h, 2 * h], Expect::Linear);
    push(&mut out, format!("{p}shared_head.norm.weight"), vec![h], Expect::Float);
    out.push(TensorSpec {
        name: format!("{p}shared_head.head.weight"),
        shape: vec![cfg.vocab_size, h],
        expect: Expect::Float,
        optional: true,
    });
    out.push(TensorSpec {
        name: format!("{p}embed_tokens.weight"),
        shape: vec![cfg.vocab_size, h],
        expect: Expect::Float,
        optional: true,
    });
    out
}

/// Every tensor the config implies, in a stable order.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let mut out = Vec::new();
    push(&mut out, "model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], Expect::Float);
    push(&mut out, "model.norm.weight".into(), vec![h], Expect::Float);
    out.push(TensorSpec {
        name: "lm_head.weight".into(),
        shape: vec![cfg.vocab_size, h],
        expect: Expect::Float,
        optional: cfg.tie_word_embeddings,
    });
    for layer in 0..cfg.num_checkpoint_layers() {
        out.extend(decoder_layer(cfg, layer));
        if layer >= cfg.num_hidden_layers {
            out.extend(mtp_layer_extras(cfg, layer));
        }
    }
    out
}
