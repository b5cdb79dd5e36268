//! The CPU backend's weights, loaded by HF name from a checkpoint (docs/model.md §3).

use super::linear::Linear;
use crate::Precision;
use crate::checkpoint::{Checkpoint, CheckpointError, names::layer_prefix};

pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Moe {
    /// Router weights `[n_routed_experts, hidden]` (f32 logits).
    pub gate: Vec<f32>,
    /// `e_score_correction_bias`: added for selection only.
    pub bias: Option<Vec<f32>>,
    /// Per routed expert; experts that share their tensors (a synthetic model's) share one load.
    pub experts: Vec<std::sync::Arc<Mlp>>,
    pub shared: Option<Mlp>,
}

pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

pub struct Indexer {
    pub wq_b: Linear,
    pub wk: Linear,
    pub k_norm_w: Vec<f32>,
    pub k_norm_b: Vec<f32>,
    pub weights_proj: Linear,
}

pub struct Mla {
    pub q_a: Linear,
    pub q_a_norm: Vec<f32>,
    pub q_b: Linear,
    pub kv_a: Linear,
    pub kv_a_norm: Vec<f32>,
    /// MHA form: latent -> per head [k_nope | v].
    pub kv_b: Linear,
    pub o: Linear,
    /// Absorbed form: per head, W_UK transposed `[kv_lora_rank, qk_nope]` (so q_abs = W_UK^T q_nope is a
    /// row of dot products) and W_UV `[v_head_dim, kv_lora_rank]`, from the dequantized kv_b.
    pub w_uk_t: Vec<Vec<f32>>,
    pub w_uv: Vec<Vec<f32>>,
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn: Mla,
    pub indexer: Indexer,
    pub ffn: Ffn,
}

/// The MTP module: its projections plus a full decoder layer.
pub struct Mtp {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub eh_proj: Linear,
    pub head_norm: Vec<f32>,
    /// None: shares the main model's lm_head.
    pub head: Option<Linear>,
    /// None: shares the main model's embedding.
    pub embed: Option<Vec<f32>>,
    pub layer: Layer,
}

pub struct Weights {
    pub embed: Vec<f32>,
    /// Per decoder layer; layers that share their tensors (`Checkpoint::layer_source`) share one load.
    pub layers: Vec<std::sync::Arc<Layer>>,
    pub norm: Vec<f32>,
    pub lm_head: Linear,
    pub mtp: Vec<Mtp>,
}

fn mlp(ckpt: &Checkpoint, p: &str, prec: Precision) -> Result<Mlp, CheckpointError> {
    Ok(Mlp {
        gate: Linear::load(ckpt, &format!("{p}gate_proj.weight"), prec)?,
        up: Linear::load(ckpt, &format!("{p}up_proj.weight"), prec)?,
        down: Linear::load(ckpt, &format!("{p}down_proj.weight"), prec)?,
    })
}

/// Splits the dequantized `kv_b_proj` (per head: qk_nope k rows, then v_head_dim v rows, each
/// kv_lora_rank wide) into the absorbed form's per-head W_UK^T `[rank, nope]` and W_UV `[v, rank]`.
pub fn absorb(kv_b: &[f32], cfg: &crate::ModelConfig) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (rank, nope, vd) = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim);
    let mut w_uk_t = Vec::with_capacity(cfg.num_attention_heads);
    let mut w_uv = Vec::with_capacity(cfg.num_attention_heads);
    for h in 0..cfg.num_attention_heads {
        let base = h * (nope + vd) * rank;
        let mut t = vec![0f32; rank * nope];
        for d in 0..nope {
            for c in 0..rank {
                t[c * nope + d] = kv_b[base + d * rank + c];
            }
        }
        w_uk_t.push(t);
        w_uv.push(kv_b[base + nope * rank..base + (nope + vd) * rank].to_vec());
    }
    (w_uk_t, w_uv)
}

fn layer(ckpt: &Checkpoint, index: usize, prec: Precision) -> Result<Layer, CheckpointError> {
    let cfg = ckpt.config();
    let p = layer_prefix(index);
    let a = format!("{p}self_attn.");
    let ix = format!("{a}indexer.");
    let kv_b_name = format!("{a}kv_b_proj.weight");
    let (w_uk_t, w_uv) = absorb(&ckpt.dequantized(&kv_b_name)?, cfg);
    let ffn = if cfg.is_moe_layer(index) {
        let m = format!("{p}mlp.");
        let bias_name = format!("{m}gate.e_score_correction_bias");
        Ffn::Moe(Moe {
            gate: ckpt.f32(&format!("{m}gate.weight"))?,
            bias: if ckpt.contains(&bias_name) { Some(ckpt.f32(&bias_name)?) } else { None },
            experts: {
                // Experts whose matrices are the same memory load once.
                let mut first: std::collections::HashMap<usize, std::sync::Arc<Mlp>> = Default::default();
                let mut v = Vec::with_capacity(cfg.n_routed_experts);
                for e in 0..cfg.n_routed_experts {
                    let p = format!("{m}experts.{e}.");
                    let key = ckpt.tensor(&format!("{p}down_proj.weight"))?.data.as_ptr() as usize;
                    let x = match first.get(&key) {
                        Some(x) => x.clone(),
                        None => {
                            let x = std::sync::Arc::new(mlp(ckpt, &p, prec)?);
                            first.insert(key, x.clone());
                            x
                        }
                    };
                    v.push(x);
                }
                v
            },
            shared: if cfg.n_shared_experts > 0 {
                Some(mlp(ckpt, &format!("{m}shared_experts."), prec)?)
            } else {
                None
            },
        })
    } else {
        Ffn::Dense(mlp(ckpt, &format!("{p}mlp."), prec)?)
    };
    Ok(Layer {
        attn_norm: ckpt.f32(&format!("{p}input_layernorm.weight"))?,
        ffn_norm: ckpt.f32(&format!("{p}post_attention_layernorm.weight"))?,
        attn: Mla {
            q_a: Linear::load(ckpt, &format!("{a}q_a_proj.weight"), prec)?,
            q_a_norm: ckpt.f32(&format!("{a}q_a_layernorm.weight"))?,
            q_b: Linear::load(ckpt, &format!("{a}q_b_proj.weight"), prec)?,
            kv_a: Linear::load(ckpt, &format!("{a}kv_a_proj_with_mqa.weight"), prec)?,
            kv_a_norm: ckpt.f32(&format!("{a}kv_a_layernorm.weight"))?,
            kv_b: Linear::load(ckpt, &kv_b_name, prec)?,
            o: Linear::load(ckpt, &format!("{a}o_proj.weight"), prec)?,
            w_uk_t,
            w_uv,
        },
        indexer: Indexer {
            wq_b: Linear::load(ckpt, &format!("{ix}wq_b.weight"), prec)?,
            wk: Linear::load(ckpt, &format!("{ix}wk.weight"), prec)?,
            k_norm_w: ckpt.f32(&format!("{ix}k_norm.weight"))?,
            k_norm_b: ckpt.f32(&format!("{ix}k_norm.bias"))?,
            weights_proj: Linear::load(ckpt, &format!("{ix}weights_proj.weight"), prec)?,
        },
        ffn,
    })
}

impl Weights {
    /// Loads every weight, showing a progress bar on a terminal.
    pub fn load(ckpt: &Checkpoint, prec: Precision) -> Result<Self, CheckpointError> {
        let cfg = ckpt.config();
        let total = cfg.num_cache_layers() as u64 + 1;
        let bar = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} {bar:30} {pos}/{len} layers [{elapsed}]")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(ckpt.dir().display().to_string());
        let embed = ckpt.f32("model.embed_tokens.weight")?;
        let lm_head = if ckpt.contains("lm_head.weight") {
            Linear::load(ckpt, "lm_head.weight", prec)?
        } else {
            Linear::Dense { w: embed.clone(), out: cfg.vocab_size, inp: cfg.hidden_size }
        };
        let norm = ckpt.f32("model.norm.weight")?;
        bar.inc(1);
        let mut layers: Vec<std::sync::Arc<Layer>> = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let src = ckpt.layer_source(i);
            let l = if src < i { layers[src].clone() } else { std::sync::Arc::new(layer(ckpt, i, prec)?) };
            layers.push(l);
            bar.inc(1);
        }
        let mut mtp = Vec::new();
        for i in cfg.num_hidden_layers..cfg.num_cache_layers() {
            let p = layer_prefix(i);
            let head_name = format!("{p}shared_head.head.weight");
            let embed_name = format!("{p}embed_tokens.weight");
            mtp.push(Mtp {
                enorm: ckpt.f32(&format!("{p}enorm.weight"))?,
                hnorm: ckpt.f32(&format!("{p}hnorm.weight"))?,
                eh_proj: Linear::load(ckpt, &format!("{p}eh_proj.weight"), prec)?,
                head_norm: ckpt.f32(&format!("{p}shared_head.norm.weight"))?,
                head: if ckpt.contains(&head_name) { Some(Linear::load(ckpt, &head_name, prec)?) } else { None },
                embed: if ckpt.contains(&embed_name) { Some(ckpt.f32(&embed_name)?) } else { None },
                layer: layer(ckpt, i, prec)?,
            });
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok(Weights { embed, layers, norm, lm_head, mtp })
    }
}

fn f32_bytes(v: &[f32]) -> u64 {
    std::mem::size_of_val(v) as u64
}

impl Mlp {
    fn bytes(&self) -> u64 {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

impl Layer {
    /// Bytes this layer's weights occupy in memory (as loaded, not as stored in the checkpoint).
    pub fn bytes(&self) -> u64 {
        let a = &self.attn;
        let attn = [&a.q_a, &a.q_b, &a.kv_a, &a.kv_b, &a.o].iter().map(|l| l.bytes()).sum::<u64>()
            + f32_bytes(&a.q_a_norm)
            + f32_bytes(&a.kv_a_norm)
            + a.w_uk_t.iter().chain(&a.w_uv).map(|w| f32_bytes(w)).sum::<u64>();
        let i = &self.indexer;
        let indexer =
            i.wq_b.bytes() + i.wk.bytes() + i.weights_proj.bytes() + f32_bytes(&i.k_norm_w) + f32_bytes(&i.k_norm_b);
        let ffn = match &self.ffn {
            Ffn::Dense(m) => m.bytes(),
            Ffn::Moe(m) => {
                f32_bytes(&m.gate)
                    + m.bias.as_deref().map_or(0, f32_bytes)
                    + {
                        let mut seen = std::collections::HashSet::new();
                        m.experts
                            .iter()
                            .filter(|x| seen.insert(std::sync::Arc::as_ptr(x)))
                            .map(|x| x.bytes())
                            .sum::<u64>()
                    }
                    + m.shared.as_ref().map_or(0, Mlp::bytes)
            }
        };
        attn + indexer + ffn + f32_bytes(&self.attn_norm) + f32_bytes(&self.ffn_norm)
    }
}

impl Weights {
    /// Bytes the loaded weights occupy.
    pub fn bytes(&self) -> u64 {
        let mtp: u64 = self
            .mtp
            .iter()
            .map(|m| {
                f32_bytes(&m.enorm)
                    + f32_bytes(&m.hnorm)
                    + m.eh_proj.bytes()
                    + f32_bytes(&m.head_norm)
                    + m.head.as_ref().map_or(0, Linear::bytes)
                    + m.embed.as_deref().map_or(0, f32_bytes)
                    + m.layer.bytes()
            })
            .sum();
        f32_bytes(&self.embed)
            + f32_bytes(&self.norm)
            + self.lm_head.bytes()
            + {
                let mut seen = std::collections::HashSet::new();
                self.layers.iter().filter(|l| seen.insert(std::sync::Arc::as_ptr(l))).map(|l| l.bytes()).sum::<u64>()
            }
            + mtp
    }
}
