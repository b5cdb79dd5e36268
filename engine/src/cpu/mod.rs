//! The CPU reference backend: the full DeepSeek-V3.2 forward of docs/model.md §2 in plain Rust, multithreaded
//! with rayon (its own pool with `--threads`, rayon's global one otherwise), batch-invariant (every row's
//! reductions have one fixed order). Its memory is host memory: the cache pool, and activations returned
//! as [`DeviceRows`] holding a `Vec<f32>`.

pub mod attention;
mod cache_io;
pub mod forward;
pub mod indexer;
pub mod kernels;
pub mod linear;
pub mod moe;
#[cfg(test)]
pub(crate) mod test_support;
pub mod topk;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use crate::backend::{AttnForm, Backend, DeviceRows, EngineError, LayerDone, MtpInput, SeqInput, SeqOutput};
use crate::cache::{CacheGeometry, HostCache, KvCache, LayerIdx};
use crate::checkpoint::Checkpoint;
use crate::memory::{MemoryBudget, ServingLimits};
use crate::rope::Rope;
use crate::sampling;
use crate::{ModelConfig, Precision};
use forward::{Ctx, Pass};
use weights::Weights;

pub struct CpuBackend {
    cfg: ModelConfig,
    prec: Precision,
    rope: Rope,
    weights: Weights,
    fingerprint: String,
    /// Its own compute threads (`--threads`); rayon's global pool when absent.
    pool: Option<Arc<rayon::ThreadPool>>,
    /// Top-k selections being recorded (diagnostics only).
    selections: Option<crate::backend::SelectionLog>,
}

impl CpuBackend {
    pub fn load(dir: &Path, prec: Precision) -> Result<Self, EngineError> {
        let ckpt = Checkpoint::open_model(dir)?;
        Self::from_checkpoint(&ckpt, prec)
    }

    pub fn from_checkpoint(ckpt: &Checkpoint, prec: Precision) -> Result<Self, EngineError> {
        let cfg = ckpt.config().clone();
        let weights = Weights::load(ckpt, prec)?;
        Ok(CpuBackend {
            rope: Rope::new(&cfg),
            cfg,
            prec,
            weights,
            fingerprint: ckpt.fingerprint().to_string(),
            pool: None,
            selections: None,
        })
    }

    /// Computes on `threads` threads of its own (`None`: rayon's global pool, one thread per core).
    pub fn with_threads(mut self, threads: Option<usize>) -> Result<Self, EngineError> {
        self.pool = match threads {
            None => None,
            Some(0) => return Err(EngineError::InvalidInput("--threads must be > 0".into())),
            Some(n) => Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("cpu-backend-{i}"))
                    .build()
                    .map_err(|e| EngineError::Unsupported(format!("cannot start {n} compute threads: {e}")))?,
            )),
        };
        Ok(self)
    }

    /// Runs `f` on this backend's threads.
    fn on_threads<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// Records every row's top-k selection from now on (diagnostics: GPU against CPU); read with
    /// [`CpuBackend::take_selections`].
    pub fn recording_selections(mut self) -> Self {
        self.selections = Some(Default::default());
        self
    }

    /// The selections recorded since the last call: (layer, row of the call, ascending positions).
    pub fn take_selections(&self) -> Vec<(LayerIdx, usize, Vec<u32>)> {
        self.selections.as_ref().map(|s| s.take()).unwrap_or_default()
    }

    /// The checkpoint's fingerprint (see `Checkpoint::fingerprint`).
    pub fn checkpoint_fingerprint(&self) -> &str {
        &self.fingerprint
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            prec: self.prec,
            rope: &self.rope,
            w: &self.weights,
            selections: self.selections.as_ref(),
        }
    }

    /// The pool as host memory, if it fits this model.
    fn check_cache<'c>(&self, cache: &'c KvCache) -> Result<HostCache<'c>, EngineError> {
        let host = cache
            .host()
            .map_err(|e| EngineError::InvalidInput(format!("the CPU backend cannot use this pool: {e}")))?;
        crate::backend::check_pool_fits(&self.cfg, self.prec, cache.geometry())?;
        Ok(host)
    }

    fn run_main(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let host = self.check_cache(cache)?;
        let items = crate::backend::main_items(&self.cfg, cache.geometry().num_blocks, batch)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ctx = self.ctx();
        let hidden = self.cfg.hidden_size;
        let mut h = forward::embed(&self.weights.embed, batch.iter().flat_map(|s| s.tokens.iter().copied()), hidden);
        let pass = Pass { items: &items, form, cache: host };
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

    fn allocate_cache(&self, geometry: CacheGeometry) -> Result<KvCache, EngineError> {
        KvCache::new_host(geometry).map_err(|e| {
            EngineError::Unsupported(format!("{e} ({} blocks of {} layers)", geometry.num_blocks, geometry.num_layers))
        })
    }

    /// Weights as loaded; activations are an estimate of the f32 buffers alive at once in a
    /// `max_num_batched_tokens` forward (residual and normed rows, projections, the decompressed keys and
    /// values of the MHA form, routed experts' intermediates) plus two logits rows per request.
    fn memory_budget(&self, limits: &ServingLimits) -> MemoryBudget {
        let c = &self.cfg;
        let per_token = 3 * c.hidden_size
            + c.num_attention_heads * (c.qk_head_dim() + c.qk_nope_head_dim + 2 * c.v_head_dim)
            + c.kv_lora_rank
            + c.qk_rope_head_dim
            + c.index_n_heads * c.index_head_dim
            + 2 * c.num_experts_per_tok.max(1) * c.moe_intermediate_size.max(c.intermediate_size);
        let floats = limits.max_num_batched_tokens * per_token + 2 * limits.max_num_seqs * c.vocab_size;
        MemoryBudget { weights: self.weights.bytes(), activations: 4 * floats as u64, graphs: 0, communication: 0 }
    }

    fn draft(&self, logits: &DeviceRows, row: usize) -> Result<(u32, f32), EngineError> {
        let r = logits.host_row(row)?;
        let d = sampling::argmax(r);
        Ok((d, sampling::log_softmax(r)[d as usize].exp()))
    }

    fn prefill(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.on_threads(|| self.run_main(cache, batch, AttnForm::Prefill, on_layer))
    }

    fn decode(&self, cache: &KvCache, batch: &[SeqInput<'_>]) -> Result<Vec<SeqOutput>, EngineError> {
        self.on_threads(|| self.run_main(cache, batch, AttnForm::Decode, &mut |_, _| {}))
    }

    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[MtpInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.on_threads(|| {
            let Some(mtp) = self.weights.mtp.first() else {
                return Err(EngineError::Unsupported(
                    "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)".into(),
                ));
            };
            let host = self.check_cache(cache)?;
            let hidden = self.cfg.hidden_size;
            let items = crate::backend::mtp_items(&self.cfg, cache.geometry().num_blocks, batch)?;
            for (m, it) in batch.iter().zip(&items) {
                if m.hidden.host_values()?.len() < it.n * hidden {
                    return Err(EngineError::InvalidInput(format!(
                        "{} hidden values for {} rows of {hidden}",
                        m.hidden.host_values()?.len(),
                        it.n
                    )));
                }
            }
            let row0: usize = items.iter().map(|it| it.n).sum();
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
            let mut prev: Vec<f32> = Vec::with_capacity(row0 * hidden);
            for (m, it) in batch.iter().zip(&items) {
                prev.extend_from_slice(&m.hidden.host_values()?[..it.n * hidden]);
            }
            let hh = kernels::rms_norm(&prev, &mtp.hnorm, eps);
            let mut cat = Vec::with_capacity(row0 * 2 * hidden);
            for r in 0..row0 {
                cat.extend_from_slice(&e[r * hidden..(r + 1) * hidden]);
                cat.extend_from_slice(&hh[r * hidden..(r + 1) * hidden]);
            }
            let mut h = mtp.eh_proj.forward(&cat, row0);
            let ctx = self.ctx();
            let li = LayerIdx(self.cfg.num_hidden_layers as u32);
            let pass = Pass { items: &items, form, cache: host };
            forward::layer_forward(&ctx, &pass, &mtp.layer, li, &mut h, on_layer);
            let head = mtp.head.as_ref().unwrap_or(&self.weights.lm_head);
            Ok(forward::finish(&ctx, &items, &h, &mtp.head_norm, head))
        })
    }
}
