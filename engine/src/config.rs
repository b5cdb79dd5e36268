//! The HF `config.json` of a DeepSeek-V3.2 checkpoint (docs/model.md §1), read field by field so that a
//! missing or invalid value is reported by name. Every model dimension comes from here; nothing in the
//! engine hard-codes the 671B numbers.

use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

/// Model types this engine serves.
pub const SERVED_MODEL_TYPES: &[&str] = &["deepseek_v32"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not valid JSON: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("config.json: field `{field}` is missing")]
    Missing { field: String },
    #[error("config.json: field `{field}`: {msg}")]
    Invalid { field: String, msg: String },
}

fn invalid(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.to_string(), msg: msg.into() }
}

/// YaRN context extension (`rope_scaling` / `rope_parameters` with type "yarn").
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

/// Block-scaled FP8 weights (`quantization_config`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fp8Quant {
    /// `[rows, cols]` of one scale block, [128, 128] in DeepSeek checkpoints.
    pub weight_block_size: [usize; 2],
    /// True when scales are powers of two (`scale_fmt: ue8m0`).
    pub ue8m0: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ScoringFunc {
    Sigmoid,
    Softmax,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub num_attention_heads: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub rope_theta: f64,
    pub yarn: Option<Yarn>,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub num_nextn_predict_layers: usize,
    pub quantization: Option<Fp8Quant>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub tie_word_embeddings: bool,
}

/// Reads typed fields out of a JSON object, naming the field in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                // Some configs write integral values as floats (e.g. 40.0).
                None => match v.as_f64() {
                    Some(f) if f >= 0.0 && f.fract() == 0.0 => Ok(Some(f as usize)),
                    _ => Err(invalid(&self.name(key), format!("expected a non-negative integer, got {v}"))),
                },
            },
        }
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        self.usize_opt(key)?.ok_or_else(|| ConfigError::Missing { field: self.name(key) })
    }

    fn positive(&self, key: &str) -> Result<usize, ConfigError> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(invalid(&self.name(key), "must be > 0"));
        }
        Ok(n)
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| invalid(&self.name(key), format!("expected a number, got {v}"))),
        }
    }

    fn f64(&self, key: &str) -> Result<f64, ConfigError> {
        self.f64_opt(key)?.ok_or_else(|| ConfigError::Missing { field: self.name(key) })
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| invalid(&self.name(key), format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(Some).ok_or_else(|| invalid(&self.name(key), format!("expected a string, got {v}")))
            }
        }
    }

    fn str(&self, key: &str) -> Result<&'a str, ConfigError> {
        self.str_opt(key)?.ok_or_else(|| ConfigError::Missing { field: self.name(key) })
    }

    fn object(&self, key: &str) -> Result<Option<Fields<'a>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields { obj, prefix: format!("{}.", self.name(key)) })),
            Some(v) => Err(invalid(&self.name(key), format!("expected an object, got {v}"))),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>, ConfigError> {
        let bad = |v: &Value| invalid(&self.name(key), format!("expected a token id or a list of token ids, got {v}"));
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(v @ Value::Array(items)) => {
                items.iter().map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v))).collect()
            }
            Some(v) => Ok(vec![v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v))?]),
        }
    }
}

impl ModelConfig {
    /// Reads `DIR/config.json` (or the file itself when `path` is a file).
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let text = std::fs::read_to_string(&file)
            .map_err(|source| ConfigError::Io { path: file.display().to_string(), source })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ConfigError::Json { source, .. } => ConfigError::Json { path: file.display().to_string(), source },
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|source| ConfigError::Json { path: "config.json".into(), source })?;
        Self::from_json(&value)
    }

    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        let obj = value.as_object().ok_or_else(|| invalid("(root)", "config.json must be a JSON object"))?;
        let f = Fields { obj, prefix: String::new() };

        let model_type = f.str("model_type")?.to_string();
        if !SERVED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(invalid(
                "model_type",
                format!("`{model_type}` is not served by tandem (served: {})", SERVED_MODEL_TYPES.join(", ")),
            ));
        }

        let scoring_func = match f.str_opt("scoring_func")?.unwrap_or("sigmoid") {
            "sigmoid" => ScoringFunc::Sigmoid,
            "softmax" => ScoringFunc::Softmax,
            other => return Err(invalid("scoring_func", format!("`{other}` (expected sigmoid or softmax)"))),
        };
        match f.str_opt("topk_method")?.unwrap_or("noaux_tc") {
            "noaux_tc" => {}
            other => return Err(invalid("topk_method", format!("`{other}` is not supported (expected noaux_tc)"))),
        }
        if let Some(act) = f.str_opt("hidden_act")?
            && act != "silu"
        {
            return Err(invalid("hidden_act", format!("`{act}` is not supported (expected silu)")));
        }

        let (rope_theta, yarn) = parse_rope(&f)?;
        let quantization = parse_quantization(&f)?;

        let cfg = ModelConfig {
            model_type,
            vocab_size: f.positive("vocab_size")?,
            hidden_size: f.positive("hidden_size")?,
            intermediate_size: f.positive("intermediate_size")?,
            moe_intermediate_size: f.positive("moe_intermediate_size")?,
            num_hidden_layers: f.positive("num_hidden_layers")?,
            first_k_dense_replace: f.usize_opt("first_k_dense_replace")?.unwrap_or(0),
            moe_layer_freq: f.usize_opt("moe_layer_freq")?.unwrap_or(1),
            num_attention_heads: f.positive("num_attention_heads")?,
            n_routed_experts: f.positive("n_routed_experts")?,
            n_shared_experts: f.usize_opt("n_shared_experts")?.unwrap_or(0),
            num_experts_per_tok: f.positive("num_experts_per_tok")?,
            n_group: f.usize_opt("n_group")?.unwrap_or(1).max(1),
            topk_group: f.usize_opt("topk_group")?.unwrap_or(1).max(1),
            scoring_func,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            q_lora_rank: f.positive("q_lora_rank")?,
            kv_lora_rank: f.positive("kv_lora_rank")?,
            qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: f.positive("qk_rope_head_dim")?,
            v_head_dim: f.positive("v_head_dim")?,
            index_n_heads: f.positive("index_n_heads")?,
            index_head_dim: f.positive("index_head_dim")?,
            index_topk: f.positive("index_topk")?,
            rope_theta,
            yarn,
            max_position_embeddings: f.positive("max_position_embeddings")?,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            num_nextn_predict_layers: f.usize_opt("num_nextn_predict_layers")?.unwrap_or(0),
            quantization,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Cross-field checks: shapes the kernels and cache formats rely on.
    fn validate(&self) -> Result<(), ConfigError> {
        self.check_sizes()?;
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(invalid(
                "n_group",
                format!("{} does not divide n_routed_experts {}", self.n_group, self.n_routed_experts),
            ));
        }
        if self.topk_group > self.n_group {
            return Err(invalid("topk_group", format!("{} exceeds n_group {}", self.topk_group, self.n_group)));
        }
        let per_group = self.n_routed_experts / self.n_group;
        if self.num_experts_per_tok > self.topk_group * per_group {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "{} exceeds the {} experts in topk_group {} groups",
                    self.num_experts_per_tok,
                    self.topk_group * per_group,
                    self.topk_group
                ),
            ));
        }
        if self.n_group > 1 && per_group < 2 {
            return Err(invalid("n_group", "group-limited routing needs at least 2 experts per group"));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid("qk_rope_head_dim", "must be even"));
        }
        if !self.index_head_dim.is_power_of_two() || self.index_head_dim < self.qk_rope_head_dim {
            return Err(invalid(
                "index_head_dim",
                format!(
                    "{} must be a power of two (Hadamard) and >= qk_rope_head_dim {}",
                    self.index_head_dim, self.qk_rope_head_dim
                ),
            ));
        }
        if !self.kv_lora_rank.is_multiple_of(128) {
            return Err(invalid("kv_lora_rank", "must be a multiple of 128 (FP8 cache tiles)"));
        }
        if !self.index_head_dim.is_multiple_of(128) {
            return Err(invalid("index_head_dim", "must be a multiple of 128 (FP8 quantization groups)"));
        }
        if self.moe_layer_freq == 0 {
            return Err(invalid("moe_layer_freq", "must be > 0"));
        }
        if self.eos_token_ids.iter().chain(self.bos_token_id.iter()).any(|&t| t as usize >= self.vocab_size) {
            return Err(invalid("eos_token_id", format!("token id outside vocab_size {}", self.vocab_size)));
        }
        if let Some(y) = &self.yarn
            && (y.factor <= 0.0 || y.original_max_position_embeddings == 0)
        {
            return Err(invalid("rope_scaling", "factor and original_max_position_embeddings must be > 0"));
        }
        Ok(())
    }

    /// Every count and width is refused above a bound far past any real model's, so that nothing
    /// later (tensor lists, shapes, cache pools) is sized by an absurd number from the file.
    fn check_sizes(&self) -> Result<(), ConfigError> {
        const LAYERS: usize = 1 << 10;
        const WIDTH: usize = 1 << 20;
        const COUNT: usize = 1 << 16;
        const VOCAB: usize = 1 << 24;
        const POSITIONS: usize = 1 << 26;
        let sizes = [
            ("vocab_size", self.vocab_size, VOCAB),
            ("hidden_size", self.hidden_size, WIDTH),
            ("intermediate_size", self.intermediate_size, WIDTH),
            ("moe_intermediate_size", self.moe_intermediate_size, WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, LAYERS),
            ("first_k_dense_replace", self.first_k_dense_replace, LAYERS),
            ("moe_layer_freq", self.moe_layer_freq, LAYERS),
            ("num_nextn_predict_layers", self.num_nextn_predict_layers, LAYERS),
            ("num_attention_heads", self.num_attention_heads, COUNT),
            ("n_routed_experts", self.n_routed_experts, COUNT),
            ("n_shared_experts", self.n_shared_experts, COUNT),
            ("num_experts_per_tok", self.num_experts_per_tok, COUNT),
            ("n_group", self.n_group, COUNT),
            ("topk_group", self.topk_group, COUNT),
            ("q_lora_rank", self.q_lora_rank, WIDTH),
            ("kv_lora_rank", self.kv_lora_rank, WIDTH),
            ("qk_nope_head_dim", self.qk_nope_head_dim, WIDTH),
            ("qk_rope_head_dim", self.qk_rope_head_dim, WIDTH),
            ("v_head_dim", self.v_head_dim, WIDTH),
            ("index_n_heads", self.index_n_heads, COUNT),
            ("index_head_dim", self.index_head_dim, WIDTH),
            ("index_topk", self.index_topk, POSITIONS),
            ("max_position_embeddings", self.max_position_embeddings, POSITIONS),
        ];
        let block = self.quantization.as_ref().map(|q| q.weight_block_size).unwrap_or([128, 128]);
        let yarn_len = self.yarn.as_ref().map_or(1, |y| y.original_max_position_embeddings);
        let more = [
            ("quantization_config.weight_block_size", block[0].max(block[1]), WIDTH),
            ("rope_scaling.original_max_position_embeddings", yarn_len, POSITIONS),
        ];
        if let Some((name, n, max)) = sizes.into_iter().chain(more).find(|&(_, n, max)| n > max) {
            return Err(invalid(name, format!("{n} is larger than tandem accepts ({max})")));
        }
        // The checkpoint lists three tensors per expert and layer: bound the product too (DeepSeek-V3
        // has 62 x 257).
        const EXPERT_LAYERS: usize = 1 << 18;
        let layers = self.num_hidden_layers + self.num_nextn_predict_layers;
        let experts = self.n_routed_experts + self.n_shared_experts;
        if layers * experts > EXPERT_LAYERS {
            return Err(invalid(
                "n_routed_experts",
                format!("{layers} layers x {experts} experts is more than tandem accepts ({EXPERT_LAYERS})"),
            ));
        }
        Ok(())
    }

    /// Dimensions of the cached vectors.
    pub fn entry_dims(&self) -> crate::cache::EntryDims {
        crate::cache::EntryDims {
            kv_lora_rank: self.kv_lora_rank,
            rope_dim: self.qk_rope_head_dim,
            index_dim: self.index_head_dim,
        }
    }

    /// Layers whose caches a request holds: the decoder layers, then the one MTP layer that is served.
    /// A checkpoint may ship more MTP layers (`num_nextn_predict_layers > 1`); only the first drafts
    /// (one draft token per step), so the pool, manifests and transfers cover exactly these layers.
    pub fn num_cache_layers(&self) -> usize {
        self.num_hidden_layers + self.num_served_mtp_layers()
    }

    /// MTP layers that run: the first one, when the checkpoint has any.
    pub fn num_served_mtp_layers(&self) -> usize {
        self.num_nextn_predict_layers.min(1)
    }

    /// Every layer the checkpoint holds (decoder layers, then all its MTP layers).
    pub fn num_checkpoint_layers(&self) -> usize {
        self.num_hidden_layers + self.num_nextn_predict_layers
    }

    /// Whether layer `layer` (MTP layers included) uses MoE rather than the dense MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// MLA softmax scale: `qk_head_dim^-0.5 * mscale^2` under YaRN (docs/model.md §1).
    pub fn softmax_scale(&self) -> f32 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        let m = match &self.yarn {
            Some(y) if y.mscale_all_dim != 0.0 => yarn_mscale(y.factor, y.mscale_all_dim),
            _ => 1.0,
        };
        (base * m * m) as f32
    }

    /// Indexer score scale `index_head_dim^-0.5` (no mscale).
    pub fn index_softmax_scale(&self) -> f32 {
        (self.index_head_dim as f64).powf(-0.5) as f32
    }

    pub fn is_eos(&self, token: u32) -> bool {
        self.eos_token_ids.contains(&token)
    }
}

/// `0.1 * m * ln(f) + 1`, or 1 when f <= 1.
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 }
}

/// `rope_theta` plus YaRN from `rope_scaling` (classic) or `rope_parameters` (newer HF configs).
fn parse_rope(f: &Fields<'_>) -> Result<(f64, Option<Yarn>), ConfigError> {
    let params = match f.object("rope_parameters")? {
        Some(p) => Some(p),
        None => f.object("rope_scaling")?,
    };
    let top_theta = f.f64_opt("rope_theta")?;
    let Some(p) = params else {
        return Ok((top_theta.unwrap_or(10000.0), None));
    };
    let theta = match (top_theta, p.f64_opt("rope_theta")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => 10000.0,
    };
    if theta <= 0.0 {
        return Err(invalid("rope_theta", "must be > 0"));
    }
    let kind = match p.str_opt("rope_type")? {
        Some(k) => k,
        None => p.str_opt("type")?.unwrap_or("default"),
    };
    match kind {
        "default" | "none" => Ok((theta, None)),
        "yarn" => {
            let yarn = Yarn {
                factor: p.f64("factor")?,
                original_max_position_embeddings: p.positive("original_max_position_embeddings")?,
                beta_fast: p.f64_opt("beta_fast")?.unwrap_or(32.0),
                beta_slow: p.f64_opt("beta_slow")?.unwrap_or(1.0),
                mscale: p.f64_opt("mscale")?.unwrap_or(1.0),
                mscale_all_dim: p.f64_opt("mscale_all_dim")?.unwrap_or(0.0),
            };
            Ok((theta, Some(yarn)))
        }
        other => Err(invalid(&p.name("rope_type"), format!("`{other}` is not supported (expected yarn or default)"))),
    }
}

fn parse_quantization(f: &Fields<'_>) -> Result<Option<Fp8Quant>, ConfigError> {
    let Some(q) = f.object("quantization_config")? else { return Ok(None) };
    let method = q.str("quant_method")?;
    if method != "fp8" {
        return Err(invalid(&q.name("quant_method"), format!("`{method}` is not supported (expected fp8)")));
    }
    if let Some(fmt) = q.str_opt("fmt")?
        && fmt != "e4m3"
    {
        return Err(invalid(&q.name("fmt"), format!("`{fmt}` is not supported (expected e4m3)")));
    }
    if let Some(scheme) = q.str_opt("activation_scheme")?
        && scheme != "dynamic"
    {
        return Err(invalid(&q.name("activation_scheme"), format!("`{scheme}` is not supported (expected dynamic)")));
    }
    let block = match q.get("weight_block_size") {
        None => [128, 128],
        Some(Value::Array(v)) if v.len() == 2 => {
            let dims: Vec<usize> = v.iter().filter_map(|x| x.as_u64().map(|n| n as usize)).collect();
            if dims.len() != 2 || dims.contains(&0) {
                return Err(invalid(&q.name("weight_block_size"), "expected two positive integers"));
            }
            [dims[0], dims[1]]
        }
        Some(v) => return Err(invalid(&q.name("weight_block_size"), format!("expected [rows, cols], got {v}"))),
    };
    let ue8m0 = match q.str_opt("scale_fmt")? {
        None => false,
        Some("ue8m0") => true,
        Some(other) => {
            return Err(invalid(&q.name("scale_fmt"), format!("`{other}` is not supported (expected ue8m0)")));
        }
    };
    Ok(Some(Fp8Quant { weight_block_size: block, ue8m0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN_LIKE: &str = r#"{
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": 192, "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
        "index_n_heads": 4, "index_head_dim": 128, "index_topk": 16, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
        "model_type": "deepseek_v32",
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_nextn_predict_layers": 0,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    }"#;

    fn with(edit: impl FnOnce(&mut Map<String, Value>)) -> Result<ModelConfig, ConfigError> {
        let mut v: Value = serde_json::from_str(GOLDEN_LIKE).unwrap();
        edit(v.as_object_mut().unwrap());
        ModelConfig::from_json(&v)
    }

    #[test]
    fn parses_a_v32_config_with_yarn_and_fp8() {
        let c = with(|_| {}).unwrap();
        assert_eq!(c.num_cache_layers(), 3);
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1));
        let y = c.yarn.as_ref().unwrap();
        assert_eq!(y.factor, 40.0);
        assert_eq!(c.quantization.as_ref().unwrap().weight_block_size, [128, 128]);
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn softmax_scale_includes_mscale_squared() {
        let mut c = with(|_| {}).unwrap();
        c.qk_nope_head_dim = 128;
        // docs/model.md §1: 192^-0.5 * 1.36889^2 = 0.135234.
        assert!((c.softmax_scale() - 0.135234).abs() < 1e-5, "{}", c.softmax_scale());
    }

    #[test]
    fn accepts_rope_parameters_form() {
        let c = with(|m| {
            let rs = m.remove("rope_scaling").unwrap();
            m.remove("rope_theta");
            let mut p = rs.as_object().unwrap().clone();
            p.remove("type");
            p.insert("rope_type".into(), "yarn".into());
            p.insert("rope_theta".into(), 50000.0.into());
            m.insert("rope_parameters".into(), Value::Object(p));
        })
        .unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.yarn.unwrap().original_max_position_embeddings, 4096);
    }

    #[test]
    fn errors_name_the_field() {
        let e = with(|m| {
            m.remove("hidden_size");
        })
        .unwrap_err();
        assert!(e.to_string().contains("`hidden_size` is missing"), "{e}");
        let e = with(|m| {
            m.insert("index_topk".into(), "many".into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("`index_topk`"), "{e}");
        let e = with(|m| {
            m.insert("model_type".into(), "llama".into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("`model_type`") && e.to_string().contains("llama"), "{e}");
        let e = with(|m| {
            m.get_mut("rope_scaling").unwrap().as_object_mut().unwrap().remove("factor");
        })
        .unwrap_err();
        assert!(e.to_string().contains("`rope_scaling.factor` is missing"), "{e}");
        let e = with(|m| {
            m.insert("n_group".into(), 3.into());
        })
        .unwrap_err();
        assert!(e.to_string().contains("`n_group`"), "{e}");
    }

    #[test]
    fn mtp_layers_may_be_absent_or_present() {
        let c = with(|m| {
            m.insert("num_nextn_predict_layers".into(), 1.into());
        })
        .unwrap();
        assert_eq!(c.num_cache_layers(), 4);
        let c = with(|m| {
            m.insert("num_nextn_predict_layers".into(), 2.into());
        })
        .unwrap();
        assert_eq!((c.num_cache_layers(), c.num_checkpoint_layers()), (4, 5), "only the first MTP layer is served");
        assert!(c.is_moe_layer(3));
        let c = with(|m| {
            m.remove("num_nextn_predict_layers");
        })
        .unwrap();
        assert_eq!(c.num_nextn_predict_layers, 0);
    }
}
