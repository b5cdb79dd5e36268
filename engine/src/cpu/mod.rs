//! The CPU reference backend: the full DeepSeek-V3.2 forward of docs/model.md §2 in plain Rust, multithreaded
//! with rayon, batch-invariant (every row's reductions have one fixed order).

pub mod attention;
mod cache_io;
pub mod forward;
pub mod indexer;
pub mod kernels;
pub mod linear;
pub mod moe;
#[cfg(test)]
mod test_support;
pub mod topk;
pub mod weights;

use std::path::Path;

use crate::backend::{AttnForm, Backend, EngineError, LayerDone, MtpInput, SeqInput, SeqOutput};
use crate::cache::{BlockId, KvCache, LayerIdx};
use crate::checkpoint::Checkpoint;
use crate::rope::Rope;
use crate::{ModelConfig, Precision};
use forward::{Ctx, Item, Pass};
use weights::Weights;

pub struct CpuBackend {
    cfg: ModelConfig,
    prec: Precision,
    rope: Rope,
    weights: Weights,
    fingerprint: String,
}

impl CpuBackend {
    pub fn load(dir: &Path, prec: Precision) -> Result<Self, EngineError> {
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(&ckpt, prec)
    }

    pub fn from_checkpoint(ckpt: &Checkpoint, prec: Precision) -> Result<Self, EngineError> {
        let cfg = ckpt.config().clone();
        let weights = Weights::load(ckpt, prec)?;
        Ok(CpuBackend { rope: Rope::new(&cfg), cfg, prec, weights, fingerprint: ckpt.fingerprint().to_string() })
    }

    /// The checkpoint's fingerprint (see `Checkpoint::fingerprint`).
    pub fn checkpoint_fingerprint(&self) -> &str {
        &self.fingerprint
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx { cfg: &self.cfg, prec: self.prec, rope: &self.rope, w: &self.weights }
    }

    fn check_cache(&self, cache: &KvCache) -> Result<(), EngineError> {
        let g = cache.geometry();
        if g.format != self.prec.cache_format()
            || g.dims != self.entry_dims()
            || g.num_layers < self.cfg.num_cache_layers()
        {
            return Err(EngineError::InvalidInput(format!(
                "cache pool {:?} {:?} with {} layers does not fit this model ({} precision needs {:?} {:?}, {} layers)",
                g.format,
                g.dims,
                g.num_layers,
                self.prec.name(),
                self.prec.cache_format(),
                self.entry_dims(),
                self.cfg.num_cache_layers()
            )));
        }
        Ok(())
    }

    fn check_item(
        &self,
        cache: &KvCache,
        i: usize,
        n: usize,
        start: usize,
        blocks: &[BlockId],
    ) -> Result<(), EngineError> {
        let bad = |msg: String| Err(EngineError::InvalidInput(format!("batch item {i}: {msg}")));
        if n == 0 {
            return bad("no tokens".into());
        }
        let end = start + n;
        if end > self.cfg.max_position_embeddings {
            return bad(format!(
                "positions up to {end} exceed max_position_embeddings {}",
                self.cfg.max_position_embeddings
            ));
        }
        if blocks.len() * crate::cache::BLOCK_SIZE < end {
            return bad(format!(
                "{} blocks hold {} tokens, {end} needed",
                blocks.len(),
                blocks.len() * crate::cache::BLOCK_SIZE
            ));
        }
        if let Some(b) = blocks.iter().find(|b| b.index() >= cache.geometry().num_blocks) {
            return bad(format!("block {} outside the pool of {}", b.0, cache.geometry().num_blocks));
        }
        Ok(())
    }

    fn items<'a>(&self, cache: &KvCache, batch: &[SeqInput<'a>]) -> Result<Vec<Item<'a>>, EngineError> {
        self.check_cache(cache)?;
        let mut row0 = 0;
        let mut items = Vec::with_capacity(batch.len());
        for (i, s) in batch.iter().enumerate() {
            self.check_item(cache, i, s.tokens.len(), s.start, s.blocks)?;
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(EngineError::InvalidInput(format!(
                    "batch item {i}: token id {t} >= vocab_size {}",
                    self.cfg.vocab_size
                )));
            }
            items.push(Item { start: s.start, n: s.tokens.len(), row0, blocks: s.blocks, logits: s.logits });
            row0 += s.tokens.len();
        }
        Ok(items)
    }

    fn run_main(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let items = self.items(cache, batch)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ctx = self.ctx();
        let hidden = self.cfg.hidden_size;
        let mut h = forward::embed(&self.weights.embed, batch.iter().flat_map(|s| s.tokens.iter().copied()), hidden);
        let pass = Pass { items: &items, form, cache };
        for (l, layer) in self.weights.layers.iter().enumerate() {
            forward::layer_forward(&ctx, &pass, layer, LayerIdx(l as u32), &mut h, on_layer);
        }
        Ok(forward::finish(&ctx, &items, &h, &self.weights.norm, &self.weights.lm_head))
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn precision(&self) -> Precision {
        self.prec
    }

    fn prefill(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.run_main(cache, batch, AttnForm::Prefill, on_layer)
    }

    fn decode(&self, cache: &KvCache, batch: &[SeqInput<'_>]) -> Result<Vec<SeqOutput>, EngineError> {
        self.run_main(cache, batch, AttnForm::Decode, &mut |_| {})
    }

    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[MtpInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let Some(mtp) = self.weights.mtp.first() else {
            return Err(EngineError::Unsupported(
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)".into(),
            ));
        };
        self.check_cache(cache)?;
        let hidden = self.cfg.hidden_size;
        let mut items = Vec::with_capacity(batch.len());
        let mut row0 = 0;
        for (i, m) in batch.iter().enumerate() {
            let n = m.next_tokens.len();
            self.check_item(cache, i, n, m.start, m.blocks)?;
            if m.hidden.len() != n * hidden {
                return Err(EngineError::InvalidInput(format!(
                    "batch item {i}: {} hidden values for {n} positions of width {hidden}",
                    m.hidden.len()
                )));
            }
            if let Some(t) = m.next_tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(EngineError::InvalidInput(format!(
                    "batch item {i}: token id {t} >= vocab_size {}",
                    self.cfg.vocab_size
                )));
            }
            items.push(Item { start: m.start, n, row0, blocks: m.blocks, logits: m.logits });
            row0 += n;
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let table = mtp.embed.as_ref().unwrap_or(&self.weights.embed);
        let mut emb = forward::embed(table, batch.iter().flat_map(|m| m.next_tokens.iter().copied()), hidden);
        // The MTP input embedding at position 0 is zeroed (docs/model.md §2.5).
        for it in &items {
            if it.start == 0 {
                emb[it.row0 * hidden..(it.row0 + 1) * hidden].fill(0.0);
            }
        }
        let eps = self.cfg.rms_norm_eps;
        let e = kernels::rms_norm(&emb, &mtp.enorm, eps);
        let prev: Vec<f32> = batch.iter().flat_map(|m| m.hidden.iter().copied()).collect();
        let hh = kernels::rms_norm(&prev, &mtp.hnorm, eps);
        let mut cat = Vec::with_capacity(row0 * 2 * hidden);
        for r in 0..row0 {
            cat.extend_from_slice(&e[r * hidden..(r + 1) * hidden]);
            cat.extend_from_slice(&hh[r * hidden..(r + 1) * hidden]);
        }
        let mut h = mtp.eh_proj.forward(&cat, row0);
        let ctx = self.ctx();
        let li = LayerIdx(self.cfg.num_hidden_layers as u32);
        let pass = Pass { items: &items, form, cache };
        forward::layer_forward(&ctx, &pass, &mtp.layer, li, &mut h, on_layer);
        let head = mtp.head.as_ref().unwrap_or(&self.weights.lm_head);
        Ok(forward::finish(&ctx, &items, &h, &mtp.head_norm, head))
    }
}
