//! The contract every backend (CPU reference, CUDA) implements. Schedulers and workers only see this.
//!
//! A batch is a list of per-request items. Item `i` carries tokens at positions
//! `start .. start + tokens.len()`; the caches of positions `< start` are already in its blocks (earlier
//! chunks, a prefix-cache hit, or a transfer from a prefill worker). Every call writes the caches of its
//! own positions into the item's blocks, so the next call can continue from there.

use serde::{Deserialize, Serialize};

use crate::ModelConfig;
use crate::cache::{BlockId, CacheFormat, EntryDims, KvCache, LayerIdx};
use crate::checkpoint::CheckpointError;

/// Numeric mode of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// Block-scaled FP8 weights and activations, FP8 caches (the serving default).
    Fp8,
    /// Weights dequantized to f32, no activation quantization, f32 caches (for comparison with references).
    Full,
}

impl Precision {
    pub fn cache_format(self) -> CacheFormat {
        match self {
            Precision::Fp8 => CacheFormat::Fp8,
            Precision::Full => CacheFormat::F32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp8 => "fp8",
            Precision::Full => "full",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp8" => Ok(Precision::Fp8),
            "full" | "f32" => Ok(Precision::Full),
            other => Err(format!("unknown precision `{other}` (expected fp8 or full)")),
        }
    }
}

/// Which positions of an item need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last position only (prefill: the first sampled token).
    Last,
    /// Every position (decode with MTP verification; tests).
    All,
}

/// One request's slice of a main-model batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub start: usize,
    /// The request's block table (must cover `start + tokens.len()` positions).
    pub blocks: &'a [BlockId],
    pub logits: Logits,
}

/// One request's slice of an MTP batch. MTP position `p` combines the main model's final hidden state at
/// `p` with the embedding of the token at `p + 1` (docs/model.md §2.5); its caches are the MTP layer's.
#[derive(Debug, Clone, Copy)]
pub struct MtpInput<'a> {
    /// The token at position `p + 1` for each MTP position `p`.
    pub next_tokens: &'a [u32],
    /// Main-model final hidden states (after the final norm), one row of hidden_size per position.
    pub hidden: &'a [f32],
    pub start: usize,
    pub blocks: &'a [BlockId],
    pub logits: Logits,
}

/// Outputs for one item.
#[derive(Debug, Clone, Default)]
pub struct SeqOutput {
    /// Logits rows (0, 1 or one per position, per `Logits`), each vocab_size long.
    pub logits: Vec<f32>,
    /// Final hidden states (after the final norm) of every position, hidden_size each: the MTP input.
    pub hidden: Vec<f32>,
}

impl SeqOutput {
    /// Logits row `i`.
    pub fn logits_row(&self, i: usize, vocab: usize) -> &[f32] {
        &self.logits[i * vocab..(i + 1) * vocab]
    }
}

/// Attention form: MHA over decompressed keys (prefill) or MQA over the latent (absorbed decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnForm {
    Prefill,
    Decode,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// Called with each layer index as soon as that layer's caches are written for the whole batch, so the
/// prefill worker can start shipping them while later layers compute.
pub type LayerDone<'a> = &'a mut dyn FnMut(LayerIdx);

pub trait Backend: Send + Sync {
    /// Short name for logs ("cpu", "cuda").
    fn name(&self) -> &'static str;
    fn config(&self) -> &ModelConfig;
    fn precision(&self) -> Precision;

    /// Dimensions of cached vectors; with `precision().cache_format()` they fix the pool's byte layout.
    fn entry_dims(&self) -> EntryDims {
        EntryDims::from_config(self.config())
    }

    /// Main model, prefill form (MHA over the selected tokens). Writes every layer's caches.
    fn prefill(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError>;

    /// Main model, decode form (absorbed MQA over the cache); items may carry several query tokens (MTP
    /// verification). Writes every layer's caches for the new positions.
    fn decode(&self, cache: &KvCache, batch: &[SeqInput<'_>]) -> Result<Vec<SeqOutput>, EngineError>;

    /// The MTP layer (layer index num_hidden_layers) over `batch`, in the given form; logits are the draft
    /// distribution for the token after each position's next token.
    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[MtpInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError>;

    fn has_mtp(&self) -> bool {
        self.config().num_nextn_predict_layers > 0
    }
}
