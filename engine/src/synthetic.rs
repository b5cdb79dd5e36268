//! Synthetic checkpoints: a DeepSeek-V3.2-architecture model built in memory from a seed, for measuring the
//! serving path at the real dimensions without the 671B weights (`--model synthetic:v32`).
//!
//! `synthetic:PRESET[,key=value...]`:
//! - `v32`: DeepSeek-V3.2's dimensions (docs/model.md §1: hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
//!   256 experts top-8 of moe_inter 2048, dense MLP 18432 in the first 3 layers, vocab 129280, indexer
//!   64 x 128 with index_topk 2048, one MTP layer); `tiny`: the embedded tiny model's (fast on a CPU).
//! - `layers=N` decoder layers (v32: 61, tiny: 4);
//! - `sets=S` weight sets the MoE layers cycle through (default 2): layer `first_k + i` shares the tensors
//!   of layer `first_k + i % S`, the dense layers share layer 0's; every layer keeps its own cache;
//! - `experts=L` distinct experts (default: all): expert `e` shares the tensors of expert `e % L`, standing
//!   for one rank of EP-(n_routed_experts / L) whose routed tokens stay balanced;
//! - `skew=X` routing skew (default 0): the selection bias of expert `e` is lowered by `0.1 X ln(1 + e)`,
//!   so larger X sends more tokens to the low-numbered experts;
//! - `seed=N` (default 0).
//!
//! Weights follow the tiny model's initialization (`tiny::tensors`: unit-scale activations, damped output
//! projections) with a cheaper normal (a sum of four uniforms), FP8 with 128 x 128 ue8m0 block scales where
//! the real checkpoint has FP8. Shared tensors are one allocation, so a backend that loads a layer set or an
//! expert once ([`crate::checkpoint::Checkpoint::layer_source`], equal tensor addresses) keeps one copy. The
//! fingerprint hashes the canonical spec and the config: the same spec is the same model everywhere.

use std::collections::HashMap;
use std::str::FromStr;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::ModelConfig;
use crate::checkpoint::names::{Expect, expected_tensors, scale_name};
use crate::checkpoint::writer::OwnedTensor;
use crate::checkpoint::{Checkpoint, CheckpointError, hex};
use crate::fp8;

/// The prefix that names a synthetic model where a checkpoint directory is expected.
pub const PREFIX: &str = "synthetic:";
const BLOCK: usize = 128;
/// The tiny preset's vocabulary (the embedded tokenizer's size).
const TINY_VOCAB: usize = 1280;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    V32,
    Tiny,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub preset: Preset,
    pub layers: usize,
    pub sets: usize,
    pub experts: Option<usize>,
    pub skew: f32,
    pub seed: u64,
}

/// Whether `model` (a `--model` value) names a synthetic model.
pub fn is_synthetic(model: &str) -> bool {
    model.starts_with(PREFIX)
}

impl FromStr for SyntheticSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let body = s.strip_prefix(PREFIX).ok_or_else(|| format!("`{s}`: a synthetic model is `{PREFIX}v32[,...]`"))?;
        let mut parts = body.split(',');
        let preset = match parts.next().unwrap_or("") {
            "v32" => Preset::V32,
            "tiny" => Preset::Tiny,
            other => return Err(format!("`{s}`: unknown synthetic preset `{other}` (v32 or tiny)")),
        };
        let mut spec = SyntheticSpec {
            preset,
            layers: if preset == Preset::V32 { 61 } else { 4 },
            sets: 2,
            experts: None,
            skew: 0.0,
            seed: 0,
        };
        for kv in parts {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("`{s}`: `{kv}` is not key=value"))?;
            let bad = |what: &str| format!("`{s}`: {k}={v}: {what}");
            let int = || v.parse::<usize>().map_err(|_| bad("not a whole number"));
            match k {
                "layers" => spec.layers = int()?,
                "sets" => spec.sets = int()?,
                "experts" => spec.experts = Some(int()?),
                "seed" => spec.seed = v.parse().map_err(|_| bad("not a whole number"))?,
                "skew" => {
                    spec.skew = v
                        .parse()
                        .ok()
                        .filter(|x: &f32| x.is_finite() && *x >= 0.0)
                        .ok_or_else(|| bad("not a finite number >= 0"))?
                }
                _ => return Err(format!("`{s}`: unknown key `{k}` (layers, sets, experts, skew, seed)")),
            }
        }
        if spec.layers == 0 || spec.layers > 256 {
            return Err(format!("`{s}`: layers must be 1..=256"));
        }
        if spec.sets == 0 {
            return Err(format!("`{s}`: sets must be at least 1"));
        }
        Ok(spec)
    }
}

impl std::fmt::Display for SyntheticSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let preset = if self.preset == Preset::V32 { "v32" } else { "tiny" };
        write!(f, "{PREFIX}{preset},layers={},sets={}", self.layers, self.sets)?;
        if let Some(e) = self.experts {
            write!(f, ",experts={e}")?;
        }
        write!(f, ",skew={},seed={}", self.skew, self.seed)
    }
}

impl SyntheticSpec {
    /// The model's `config.json`.
    pub fn config_json(&self) -> Value {
        let mut c = crate::tiny::config_json(TINY_VOCAB);
        if self.preset == Preset::V32 {
            for (k, v) in [
                ("vocab_size", json!(129280)),
                ("hidden_size", json!(7168)),
                ("intermediate_size", json!(18432)),
                ("moe_intermediate_size", json!(2048)),
                ("first_k_dense_replace", json!(3)),
                ("num_attention_heads", json!(128)),
                ("num_key_value_heads", json!(128)),
                ("n_routed_experts", json!(256)),
                ("n_shared_experts", json!(1)),
                ("num_experts_per_tok", json!(8)),
                ("n_group", json!(8)),
                ("topk_group", json!(4)),
                ("q_lora_rank", json!(1536)),
                ("kv_lora_rank", json!(512)),
                ("qk_nope_head_dim", json!(128)),
                ("qk_rope_head_dim", json!(64)),
                ("v_head_dim", json!(128)),
                ("index_n_heads", json!(64)),
                ("index_head_dim", json!(128)),
                ("index_topk", json!(2048)),
                ("max_position_embeddings", json!(163840)),
            ] {
                c[k] = v;
            }
        }
        c["num_hidden_layers"] = json!(self.layers);
        c["num_nextn_predict_layers"] = json!(1);
        c
    }

    fn first_dense(&self, cfg: &ModelConfig) -> usize {
        cfg.first_k_dense_replace.min(self.layers)
    }

    /// The layer whose tensors decoder layer `i` shares.
    pub fn layer_source(&self, cfg: &ModelConfig, i: usize) -> usize {
        let k = self.first_dense(cfg);
        if i >= cfg.num_hidden_layers {
            i // the MTP layer: its own
        } else if i < k {
            0
        } else {
            k + (i - k) % self.sets
        }
    }

    /// The tensor whose bytes `name` shares (itself, or the same tensor of its source layer and expert).
    fn canonical(&self, cfg: &ModelConfig, name: &str) -> String {
        let Some(rest) = name.strip_prefix("model.layers.") else { return name.to_string() };
        let Some((idx, tail)) = rest.split_once('.') else { return name.to_string() };
        let Ok(i) = idx.parse::<usize>() else { return name.to_string() };
        let mut tail = tail.to_string();
        if let (Some(l), Some(after)) = (self.experts, tail.strip_prefix("mlp.experts."))
            && let Some((e, t)) = after.split_once('.')
            && let Ok(e) = e.parse::<usize>()
        {
            tail = format!("mlp.experts.{}.{t}", e % l.max(1));
        }
        format!("model.layers.{}.{tail}", self.layer_source(cfg, i))
    }

    /// Builds the checkpoint in memory (a few seconds per billion parameters per core).
    pub fn build(&self) -> Result<Checkpoint, CheckpointError> {
        let config = self.config_json();
        let cfg = ModelConfig::from_json(&config)?;
        if let Some(l) = self.experts
            && (l == 0 || l > cfg.n_routed_experts)
        {
            return Err(CheckpointError::Mismatch(format!(
                "{self}: experts={l} must be 1..={} (the model's routed experts)",
                cfg.n_routed_experts
            )));
        }
        let specs = expected_tensors(&cfg);
        // Units to generate: every canonical tensor once (a linear and its scales together).
        let mut units: Vec<usize> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, spec) in specs.iter().enumerate() {
            if self.canonical(&cfg, &spec.name) == spec.name && seen.insert(spec.name.clone()) && !spec.optional {
                units.push(i);
            }
        }
        // The bytes it will hold, against the memory the host has free: a clear error, not an OOM kill.
        let bytes: u64 = units.iter().map(|&i| self.bytes_of(&specs[i].name, &specs[i].shape, specs[i].expect)).sum();
        if let Some(free) = available_memory()
            && bytes > free
        {
            return Err(CheckpointError::Synthetic(format!(
                "{self} needs {:.1} GiB of host memory for its weights and {:.1} GiB are available; use fewer \
                 distinct experts (experts=N) or weight sets (sets=N)",
                bytes as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            )));
        }
        let generated: Vec<Vec<(String, OwnedTensor)>> =
            units.par_iter().map(|&i| self.generate(&cfg, &specs[i].name, &specs[i].shape, specs[i].expect)).collect();
        let mut physical = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for (name, t) in generated.into_iter().flatten() {
            index.insert(name, physical.len());
            physical.push(t);
        }
        let mut names = Vec::new();
        for spec in &specs {
            let canon = self.canonical(&cfg, &spec.name);
            // The MTP layer's embedding and head are the main model's (docs/model.md §2.5).
            let canon = if spec.name.ends_with("shared_head.head.weight") {
                "lm_head.weight".to_string()
            } else if spec.name.starts_with("model.layers.") && spec.name.ends_with("embed_tokens.weight") {
                "model.embed_tokens.weight".to_string()
            } else {
                canon
            };
            for (name, c) in [(spec.name.clone(), canon.clone()), (scale_name(&spec.name), scale_name(&canon))] {
                if let Some(&p) = index.get(&c) {
                    names.push((name, p));
                }
            }
        }
        let config_bytes = serde_json::to_vec(&config).expect("json serializes");
        let mut h = Sha256::new();
        h.update(b"tandem synthetic model\0");
        h.update(self.to_string().as_bytes());
        h.update(&config_bytes);
        let sources = (0..cfg.num_hidden_layers).map(|i| self.layer_source(&cfg, i)).collect();
        Checkpoint::in_memory(&self.to_string(), cfg, physical, names, hex(&h.finalize()), sources)
    }

    /// Bytes [`Self::generate`] makes for a tensor.
    fn bytes_of(&self, name: &str, shape: &[usize], expect: Expect) -> u64 {
        let n: u64 = shape.iter().map(|&d| d as u64).product();
        let bf16_linear = name.contains("weights_proj") || name.ends_with("eh_proj.weight");
        match expect {
            Expect::Linear if !bf16_linear => n + 4 * (shape[0].div_ceil(BLOCK) * shape[1].div_ceil(BLOCK)) as u64,
            Expect::Float if name.ends_with("e_score_correction_bias") => 4 * n,
            _ => 2 * n,
        }
    }

    /// One canonical tensor (and its block scales when FP8), from a seed of its own name.
    fn generate(&self, cfg: &ModelConfig, name: &str, shape: &[usize], expect: Expect) -> Vec<(String, OwnedTensor)> {
        let mut h = Sha256::new();
        h.update(self.seed.to_le_bytes());
        h.update(name.as_bytes());
        let seed = u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"));
        // docs/model.md §3: these projections are bf16 in DeepSeek-V3.2 checkpoints; the other linears FP8.
        let bf16_linear = name.contains("weights_proj") || name.ends_with("eh_proj.weight");
        match expect {
            Expect::Linear if !bf16_linear => {
                let (rows, cols) = (shape[0], shape[1]);
                let (codes, scales) = fp8_linear(rows, cols, crate::tiny::linear_std(name, cols), seed);
                vec![
                    (name.to_string(), OwnedTensor::fp8(shape.to_vec(), codes)),
                    (scale_name(name), OwnedTensor::f32(vec![rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)], &scales)),
                ]
            }
            Expect::Linear => {
                let w = normals(shape[0] * shape[1], crate::tiny::linear_std(name, shape[1]), seed);
                vec![(name.to_string(), OwnedTensor::bf16(shape.to_vec(), &w))]
            }
            Expect::Float => {
                let n: usize = shape.iter().product();
                let t = if name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight") {
                    // The two largest tensors (vocab x hidden): bf16 straight from the generator, chunk by
                    // chunk, without an f32 copy (std as tiny::float_tensor gives them).
                    let std =
                        if name.ends_with("lm_head.weight") { 4.0 / (cfg.hidden_size as f32).sqrt() } else { 1.0 };
                    OwnedTensor {
                        dtype: safetensors::Dtype::BF16,
                        shape: shape.to_vec(),
                        data: bf16_normals(n, std, seed),
                    }
                } else if name.ends_with("e_score_correction_bias") {
                    let noise = normals(n, 0.02, seed);
                    let v: Vec<f32> =
                        noise.iter().enumerate().map(|(e, z)| z - 0.1 * self.skew * ((1 + e) as f32).ln()).collect();
                    OwnedTensor::f32(shape.to_vec(), &v)
                } else {
                    crate::tiny::float_tensor(name, shape, cfg, &mut |n, std| normals(n, std, seed))
                };
                vec![(name.to_string(), t)]
            }
        }
    }
}

/// `MemAvailable` of /proc/meminfo (None where it cannot be read).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}

/// `n` approximately normal values of standard deviation `std` (a sum of four uniforms: within 3.5 sigma),
/// generated in parallel chunks seeded from `seed`.
fn normals(n: usize, std: f32, seed: u64) -> Vec<f32> {
    const CHUNK: usize = 1 << 20;
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for x in c {
            *x = normal(&mut rng) * std;
        }
    });
    v
}

/// [`normals`] as little-endian bf16 bytes.
fn bf16_normals(n: usize, std: f32, seed: u64) -> Vec<u8> {
    const CHUNK: usize = 1 << 20;
    let mut v = vec![0u8; 2 * n];
    v.par_chunks_mut(2 * CHUNK).enumerate().for_each(|(i, c)| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for b in c.chunks_exact_mut(2) {
            b.copy_from_slice(&half::bf16::from_f32(normal(&mut rng) * std).to_le_bytes());
        }
    });
    v
}

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let r: u64 = rng.random();
    let sum = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
    // Four uniforms on [0, 1): mean 2, variance 1/3.
    (sum as f32 / 65536.0 - 2.0) * 3f32.sqrt()
}

/// An FP8 linear `[rows, cols]` of normal weights (`std`), quantized per 128 x 128 block with ue8m0 scales
/// as `quant::quantize` does, a strip of 128 rows at a time (no f32 copy of the whole matrix).
fn fp8_linear(rows: usize, cols: usize, std: f32, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let sc = cols.div_ceil(BLOCK);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows.div_ceil(BLOCK) * sc];
    codes.par_chunks_mut(BLOCK * cols).zip(scales.par_chunks_mut(sc)).enumerate().for_each(|(strip, (q, s))| {
        let n = q.len();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (strip as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let w: Vec<f32> = (0..n).map(|_| normal(&mut rng) * std).collect();
        let strip_rows = n / cols;
        for (bc, scale) in s.iter_mut().enumerate() {
            let (c0, c1) = (bc * BLOCK, ((bc + 1) * BLOCK).min(cols));
            let mut amax = 0f32;
            for r in 0..strip_rows {
                for v in &w[r * cols + c0..r * cols + c1] {
                    amax = amax.max(v.abs());
                }
            }
            *scale = fp8::group_scale(amax, true);
            for r in 0..strip_rows {
                for c in c0..c1 {
                    q[r * cols + c] = fp8::f32_to_e4m3((w[r * cols + c] / *scale).clamp(-fp8::E4M3_MAX, fp8::E4M3_MAX));
                }
            }
        }
    });
    (codes, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> SyntheticSpec {
        s.parse().unwrap()
    }

    #[test]
    fn specs_parse_and_bad_ones_name_the_problem() {
        let s = spec("synthetic:v32");
        assert_eq!((s.preset, s.layers, s.sets, s.experts, s.seed), (Preset::V32, 61, 2, None, 0));
        let s = spec("synthetic:tiny,layers=9,sets=3,experts=4,skew=1.5,seed=7");
        assert_eq!((s.layers, s.sets, s.experts, s.skew, s.seed), (9, 3, Some(4), 1.5, 7));
        assert_eq!(spec(&s.to_string()), s, "the canonical form parses back");
        for (bad, says) in [
            ("synthetic:v4", "unknown synthetic preset"),
            ("synthetic:v32,layers=0", "layers"),
            ("synthetic:v32,sets=0", "sets"),
            ("synthetic:v32,layers=x", "whole number"),
            ("synthetic:v32,skew=-1", "finite number"),
            ("synthetic:v32,color=red", "unknown key"),
            ("synthetic:v32,layers", "key=value"),
            ("/models/v32", "synthetic model is"),
        ] {
            let e = bad.parse::<SyntheticSpec>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert!(is_synthetic("synthetic:v32") && !is_synthetic("/synthetic:v32"));
    }

    #[test]
    fn layers_and_experts_share_their_sets_and_the_model_is_deterministic() {
        let s = spec("synthetic:tiny,layers=7,sets=2,experts=3");
        let a = s.build().unwrap();
        let b = s.build().unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let cfg = a.config().clone();
        assert_eq!(cfg.num_hidden_layers, 7);
        let k = cfg.first_k_dense_replace;
        assert_eq!((0..7).map(|i| a.layer_source(i)).collect::<Vec<_>>(), [0, k, k + 1, k, k + 1, k, k + 1]);
        let ptr = |c: &Checkpoint, n: &str| c.tensor(n).unwrap().data.as_ptr();
        let name = |l: usize, e: usize| format!("model.layers.{l}.mlp.experts.{e}.down_proj.weight");
        // Shared: the same memory; distinct sets and experts: different values.
        assert_eq!(ptr(&a, &name(k + 2, 4)), ptr(&a, &name(k, 1)));
        assert_ne!(a.tensor(&name(k, 0)).unwrap().data, a.tensor(&name(k, 1)).unwrap().data);
        assert_ne!(a.tensor(&name(k, 0)).unwrap().data, a.tensor(&name(k + 1, 0)).unwrap().data);
        assert_eq!(a.tensor(&name(k + 3, 2)).unwrap().data, b.tensor(&name(k + 1, 2)).unwrap().data);
        // The MTP layer is its own.
        let mtp = "model.layers.7.self_attn.kv_a_proj_with_mqa.weight";
        assert_ne!(
            a.tensor(mtp).unwrap().data,
            a.tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight").unwrap().data
        );
        // Another seed or spec is another model.
        assert_ne!(
            spec("synthetic:tiny,layers=7,sets=2,experts=3,seed=1").build().unwrap().fingerprint(),
            a.fingerprint()
        );
        assert_ne!(spec("synthetic:tiny,layers=7,sets=1,experts=3").build().unwrap().fingerprint(), a.fingerprint());
        assert!(spec("synthetic:tiny,experts=999").build().is_err());
    }

    #[test]
    fn v32_has_the_real_dimensions() {
        let cfg = ModelConfig::from_json(&spec("synthetic:v32").config_json()).unwrap();
        assert_eq!(
            (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.vocab_size),
            (7168, 128, 1536, 512, 129280)
        );
        assert_eq!((cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size), (256, 8, 2048));
        assert_eq!((cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk), (64, 128, 2048));
        assert_eq!((cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.intermediate_size), (61, 3, 18432));
    }

    #[test]
    fn fp8_generation_matches_the_reference_quantizer() {
        let (rows, cols, std) = (200, 300, 0.05);
        let (codes, scales) = fp8_linear(rows, cols, std, 3);
        let deq = crate::checkpoint::quant::dequantize(&codes, &scales, rows, cols, [BLOCK, BLOCK]);
        let (q2, s2) = crate::checkpoint::quant::quantize(&deq, rows, cols, [BLOCK, BLOCK], true);
        assert_eq!((q2, s2), (codes, scales), "requantizing the dequantized weights is the identity");
        let var = deq.iter().map(|v| (v * v) as f64).sum::<f64>() / deq.len() as f64;
        assert!((var.sqrt() / std as f64 - 1.0).abs() < 0.05, "std {}", var.sqrt());
    }
}
