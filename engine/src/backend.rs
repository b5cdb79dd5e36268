//! The contract every backend (CPU reference, CUDA) implements. Schedulers and workers only see this.
//!
//! A batch is a list of per-request items. Item `i` carries tokens at positions
//! `start .. start + tokens.len()`; the caches of positions `< start` are already in its blocks (earlier
//! chunks, a prefix-cache hit, or a transfer from a prefill worker). Every call writes the caches of its
//! own positions into the item's blocks, so the next call can continue from there.
//!
//! Memory belongs to the backend: it allocates the cache pool ([`Backend::allocate_cache`]) and reports
//! what else it needs ([`Backend::memory_budget`]). Activations stay where they were computed: logits and
//! hidden states come back as opaque [`DeviceRows`] that only the backend reads, so a step returns sampled
//! tokens (and requested logprobs) to the host, nothing vocabulary-sized. Each layer's cache writes are
//! announced with a [`LayerReady`] marker that other threads wait on before reading the bytes.

use std::any::Any;

use serde::{Deserialize, Serialize};

use crate::ModelConfig;
use crate::cache::{BlockId, CacheFormat, CacheGeometry, EntryDims, KvCache, LayerIdx};
use crate::checkpoint::CheckpointError;
use crate::memory::{MemoryBudget, ServingLimits};
use crate::sampling::{History, Sampled, SamplingParams};

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

impl Logits {
    /// The positions of an `n`-position item that get a logits row, counted from its first position.
    pub fn rows(self, n: usize) -> std::ops::Range<usize> {
        match self {
            Logits::None => n..n,
            Logits::Last => n.saturating_sub(1)..n,
            Logits::All => 0..n,
        }
    }
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
    /// Main-model final hidden states (after the final norm) from this backend's main-model call: the
    /// first `next_tokens.len()` rows are used.
    pub hidden: &'a DeviceRows,
    pub start: usize,
    pub blocks: &'a [BlockId],
    pub logits: Logits,
}

/// Rows of activations (logits, hidden states) where the backend computed them: host memory on the CPU,
/// device memory on a GPU. Opaque to everyone but the backend that made them; [`Backend::rows_to_host`]
/// copies them out for tests and diagnostics, never on the serving path.
pub struct DeviceRows {
    rows: usize,
    width: usize,
    data: Box<dyn Any + Send + Sync>,
}

impl DeviceRows {
    /// Wraps a backend's own storage of `rows` rows of `width` values.
    pub fn new<T: Any + Send + Sync>(rows: usize, width: usize, data: T) -> Self {
        DeviceRows { rows, width, data: Box::new(data) }
    }

    /// No rows.
    pub fn empty() -> Self {
        DeviceRows::new(0, 0, ())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn width(&self) -> usize {
        self.width
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The backend's storage, if it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        self.data.downcast_ref()
    }

    /// All values, for rows a host backend stored as one `Vec<f32>`; an error for anyone else's rows.
    pub fn host_values(&self) -> Result<&[f32], EngineError> {
        self.downcast_ref::<Vec<f32>>()
            .map(Vec::as_slice)
            .ok_or_else(|| EngineError::InvalidInput("rows from another backend (not host f32 rows)".into()))
    }

    /// Row `row` of [`DeviceRows::host_values`].
    pub fn host_row(&self, row: usize) -> Result<&[f32], EngineError> {
        let data = self.host_values()?;
        data.get(row * self.width..(row + 1) * self.width)
            .filter(|_| row < self.rows)
            .ok_or_else(|| EngineError::InvalidInput(format!("row {row} of {} rows", self.rows)))
    }
}

impl Default for DeviceRows {
    fn default() -> Self {
        DeviceRows::empty()
    }
}

impl std::fmt::Debug for DeviceRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRows").field("rows", &self.rows).field("width", &self.width).finish()
    }
}

/// Outputs for one item, kept by the backend.
#[derive(Debug, Default)]
pub struct SeqOutput {
    /// Logits rows (0, 1 or one per position, per `Logits`), vocab_size wide.
    pub logits: DeviceRows,
    /// Final hidden states (after the final norm) of every position, hidden_size wide: the MTP input.
    pub hidden: DeviceRows,
}

pub use crate::cache::{Fence, LayerReady};

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
    #[error("device: {0}")]
    Device(String),
    /// The expert-parallel group this backend is a rank of failed because of another rank (lost, hung,
    /// failed) or its watchdog: this device is fine, but no step can run until every rank has restarted.
    #[error("expert-parallel group down: {0}")]
    GroupDown(String),
}

/// The indexer's top-k selections of one call, recorded for diagnostics (GPU against CPU: how many positions
/// selected different sets). Off unless a backend is asked to record; never on the serving path.
#[derive(Debug, Default)]
pub struct SelectionLog(std::sync::Mutex<Vec<(LayerIdx, usize, Vec<u32>)>>);

impl SelectionLog {
    /// Row `row` of the call selected `positions` (ascending) in layer `layer`.
    pub fn push(&self, layer: LayerIdx, row: usize, positions: Vec<u32>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push((layer, row, positions));
    }

    /// Everything recorded since the last take, ordered by layer, then row.
    pub fn take(&self) -> Vec<(LayerIdx, usize, Vec<u32>)> {
        let mut v = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        v.sort_by_key(|(l, r, _)| (l.0, *r));
        v
    }
}

/// One request of a checked batch, in rows of the batch: positions `start .. start + n` are rows
/// `row0 .. row0 + n`.
#[derive(Debug, Clone, Copy)]
pub struct BatchItem<'a> {
    pub start: usize,
    pub n: usize,
    pub row0: usize,
    pub blocks: &'a [BlockId],
    pub logits: Logits,
}

impl BatchItem<'_> {
    /// The rows of the batch whose logits this item asks for.
    pub fn logits_rows(&self) -> std::ops::Range<usize> {
        let r = self.logits.rows(self.n);
        self.row0 + r.start..self.row0 + r.end
    }
}

/// A main-model batch checked against the model and a pool of `num_blocks` blocks (the rule every backend
/// applies before touching memory), as rows.
pub(crate) fn main_items<'a>(
    cfg: &ModelConfig,
    num_blocks: usize,
    batch: &[SeqInput<'a>],
) -> Result<Vec<BatchItem<'a>>, EngineError> {
    items(cfg, num_blocks, batch.iter().map(|s| (s.tokens, s.start, s.blocks, s.logits)))
}

/// An MTP batch checked as [`main_items`] does, and each item's hidden rows for their shape (that they are
/// the calling backend's rows is the backend's check).
pub(crate) fn mtp_items<'a>(
    cfg: &ModelConfig,
    num_blocks: usize,
    batch: &[MtpInput<'a>],
) -> Result<Vec<BatchItem<'a>>, EngineError> {
    let hidden = cfg.hidden_size;
    for (i, m) in batch.iter().enumerate() {
        let n = m.next_tokens.len();
        if m.hidden.width() != hidden || m.hidden.rows() < n {
            return Err(EngineError::InvalidInput(format!(
                "batch item {i}: {} hidden rows of width {} for {n} positions of width {hidden}",
                m.hidden.rows(),
                m.hidden.width()
            )));
        }
    }
    items(cfg, num_blocks, batch.iter().map(|m| (m.next_tokens, m.start, m.blocks, m.logits)))
}

fn items<'a>(
    cfg: &ModelConfig,
    num_blocks: usize,
    batch: impl Iterator<Item = (&'a [u32], usize, &'a [BlockId], Logits)>,
) -> Result<Vec<BatchItem<'a>>, EngineError> {
    let mut row0 = 0;
    let mut items = Vec::new();
    for (i, (tokens, start, blocks, logits)) in batch.enumerate() {
        check_item(cfg, num_blocks, i, tokens.len(), start, blocks)?;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::InvalidInput(format!(
                "batch item {i}: token id {t} >= vocab_size {}",
                cfg.vocab_size
            )));
        }
        items.push(BatchItem { start, n: tokens.len(), row0, blocks, logits });
        row0 += tokens.len();
    }
    Ok(items)
}

/// Checks batch item `i` (`n` tokens from position `start`, block table `blocks`) against the model and a
/// pool of `num_blocks` blocks.
fn check_item(
    cfg: &ModelConfig,
    num_blocks: usize,
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
    if end > cfg.max_position_embeddings {
        return bad(format!("positions up to {end} exceed max_position_embeddings {}", cfg.max_position_embeddings));
    }
    if blocks.len() * crate::cache::BLOCK_SIZE < end {
        return bad(format!(
            "{} blocks hold {} tokens, {end} needed",
            blocks.len(),
            blocks.len() * crate::cache::BLOCK_SIZE
        ));
    }
    if let Some(b) = blocks.iter().find(|b| b.index() >= num_blocks) {
        return bad(format!("block {} outside the pool of {num_blocks}", b.0));
    }
    Ok(())
}

/// Checks that a pool of geometry `g` holds this model's caches at precision `prec` (the rule every backend
/// applies before computing into a pool).
pub(crate) fn check_pool_fits(cfg: &ModelConfig, prec: Precision, g: &CacheGeometry) -> Result<(), EngineError> {
    if g.format != prec.cache_format() || g.dims != cfg.entry_dims() || g.num_layers < cfg.num_cache_layers() {
        return Err(EngineError::InvalidInput(format!(
            "cache pool {:?} {:?} with {} layers does not fit this model ({} precision needs {:?} {:?}, {} layers)",
            g.format,
            g.dims,
            g.num_layers,
            prec.name(),
            prec.cache_format(),
            cfg.entry_dims(),
            cfg.num_cache_layers()
        )));
    }
    Ok(())
}

/// Called with each layer index as soon as that layer's caches are issued for the whole batch, with the
/// marker of their completion, so the prefill worker can ship them while later layers compute. Only the
/// prefill form promises the calls: nothing ships a decode-form pass's layers, and a backend may skip them
/// there (the CUDA backend does: a pass replayed as a CUDA graph creates no events).
pub type LayerDone<'a> = &'a mut (dyn FnMut(LayerIdx, LayerReady) + Send);

pub trait Backend: Send + Sync {
    /// Short name for logs ("cpu", "cuda").
    fn name(&self) -> &'static str;
    fn config(&self) -> &ModelConfig;
    fn precision(&self) -> Precision;

    /// Dimensions of cached vectors; with `precision().cache_format()` they fix the pool's byte layout.
    fn entry_dims(&self) -> EntryDims {
        self.config().entry_dims()
    }

    /// Cache layers this backend runs: the decoder layers and the one MTP layer it serves (when the
    /// checkpoint has any). The pool, manifests and transfers cover exactly these.
    fn cache_layers(&self) -> usize {
        self.config().num_cache_layers()
    }

    /// The pool's memory in the place this backend computes from (host memory on the CPU, device memory
    /// on a GPU). Called once at startup: serving allocates nothing per request.
    fn allocate_cache(&self, geometry: CacheGeometry) -> Result<KvCache, EngineError>;

    /// What the backend needs besides the cache pool at these serving limits.
    fn memory_budget(&self, limits: &ServingLimits) -> MemoryBudget;

    /// Bytes of the memory the pool and the budget share (a GPU's memory), or `None` where the pool is
    /// sized by `--kv-blocks` (the CPU).
    fn memory_capacity(&self) -> Option<u64> {
        None
    }

    /// A marker reached when all work issued so far is done.
    fn fence(&self) -> LayerReady {
        LayerReady::complete()
    }

    /// Samples from row `row` of `logits` (this backend's rows) for one request; only the token and
    /// its requested logprobs come back. The default samples rows a backend keeps in host memory
    /// ([`DeviceRows::host_row`]); a device backend samples where its rows are.
    fn sample(
        &self,
        logits: &DeviceRows,
        row: usize,
        params: &SamplingParams,
        history: History<'_>,
        eos: &[u32],
    ) -> Result<Sampled, EngineError> {
        Ok(crate::sampling::sample(logits.host_row(row)?, params, history, eos))
    }

    /// [`Backend::sample`] of several requests' rows, in their order. The default samples each in turn; a
    /// device backend takes them in one launch. Each result is the one `sample` gives it alone.
    fn sample_rows(&self, reqs: &[SampleRequest<'_>], eos: &[u32]) -> Result<Vec<Sampled>, EngineError> {
        reqs.iter().map(|r| self.sample(r.logits, r.row, r.params, r.history, eos)).collect()
    }

    /// The MTP draft of row `row`: its argmax token and that token's probability.
    fn draft(&self, logits: &DeviceRows, row: usize) -> Result<(u32, f32), EngineError>;

    /// [`Backend::draft`] of several `(logits, row)` pairs, in their order. The default asks for each in turn;
    /// a device backend takes them in one launch.
    fn draft_rows(&self, rows: &[(&DeviceRows, usize)]) -> Result<Vec<(u32, f32)>, EngineError> {
        rows.iter().map(|&(logits, row)| self.draft(logits, row)).collect()
    }

    /// Copies rows to the host (tests, diagnostics). The default copies rows a backend keeps in host memory.
    fn rows_to_host(&self, rows: &DeviceRows) -> Result<Vec<f32>, EngineError> {
        Ok(rows.host_values()?.to_vec())
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

    /// The first MTP layer (cache layer num_hidden_layers) over `batch`, in the given form; logits are the
    /// draft distribution for the token after each position's next token. Further MTP layers of a
    /// checkpoint are not served.
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

    /// A whole decode step of `batch` in one go on the backend, where it has one (`Ok(None)` otherwise; the
    /// caller then runs [`Backend::decode`], [`Backend::sample_rows`], [`Backend::mtp`] and
    /// [`Backend::draft_rows`] in turn, as `crate::generate::decode_step` does). Each item feeds its pending
    /// token and, optionally, the MTP draft after it (1 or 2 tokens). The backend samples row 0 with the
    /// item's history; where row 0's token is the draft, also row 1, with the history plus that token; and,
    /// where it has an MTP layer, runs it over every fed row (row `i` with the token sampled at row `i`) and
    /// drafts from the row of the last token kept. Each value is the one those separate calls give (the
    /// caller verifies the draft and keeps what applies). The MTP caches of a rejected draft's row are
    /// overwritten by the next step.
    fn decode_whole_step(
        &self,
        _cache: &KvCache,
        _batch: &[StepInput<'_>],
        _eos: &[u32],
    ) -> Result<Option<Vec<StepSamples>>, EngineError> {
        Ok(None)
    }

    /// This backend's rank in an expert-parallel group, if it is one. Every rank must then issue the same
    /// forward passes each scheduling step, in lockstep: a rank with nothing to run still calls
    /// [`Backend::end_step`] once a step, as often as the busiest rank steps.
    fn expert_parallel(&self) -> Option<EpRank> {
        None
    }

    /// What expert-parallel load balancing has seen on this rank (expert parallelism only): for metrics.
    fn expert_balance(&self) -> Option<ExpertBalance> {
        None
    }

    /// Leaves this backend's expert-parallel group at once (nothing otherwise): a worker that stops for a
    /// failure of its own tells the other ranks now, instead of leaving them to wait for the step bound.
    fn leave_group(&self, _why: &str) {}

    /// Begins one scheduling step (expert parallelism; nothing otherwise): `rows` bounds the rows this rank
    /// brings to each pass of the step (`crate::lockstep::StepRows`, [`crate::lockstep::Pass::STEP`]
    /// order: main layers in the decode form, in the prefill form, the MTP layer). The ranks agree on the
    /// step in one small collective; its passes then run without another, and a pass no rank has rows for is
    /// skipped. A pass that brings more rows than agreed is an error that fails the group.
    fn begin_step(&self, _rows: crate::lockstep::StepRows) -> Result<(), EngineError> {
        Ok(())
    }

    /// Ends one scheduling step (expert parallelism; `Ok(false)` at once otherwise): joins with an empty
    /// batch every pass of the step this rank did not run (all of them on an idle rank), so every rank
    /// issues the same collectives; a rank that began no step agrees on an empty one first. Every rank calls
    /// it once per step, after the step's forward calls (as the workers' compute loops do every turn).
    /// Returns whether any rank had rows in the step: while one has, the others keep stepping; when none
    /// has, the ranks may wait for work.
    fn end_step(&self) -> Result<bool, EngineError> {
        Ok(false)
    }

    /// Turns per-kernel GPU timing on or off (a profiling aid, `engine-bench --kernel-profile`: every launch
    /// is bracketed by two timing events, so calls get slower). A backend without kernels ignores it.
    fn set_kernel_profile(&self, _on: bool) {}

    /// The kernel times since the previous call, summed per kernel, longest first (none where nothing was
    /// timed).
    fn take_kernel_profile(&self) -> Result<Vec<KernelTime>, EngineError> {
        Ok(Vec::new())
    }

    /// Turns the timing of each call's span on the GPU on or off (`engine-bench`'s `extra.gpu_busy`:
    /// engine::cuda::profile::BusyTimer). A backend without a GPU ignores it.
    fn set_busy_timer(&self, _on: bool) {}

    /// The calls' GPU spans since the previous take (`None` without a GPU).
    fn take_busy_time(&self) -> Result<Option<GpuBusy>, EngineError> {
        Ok(None)
    }

    /// Prepares decode steps before serving at `limits` from `cache`, requests at most `max_len` positions
    /// long (the decode worker calls it once after allocating its pool): the CUDA backend captures the CUDA
    /// graph of every whole-step shape it can meet (engine::cuda::graphs), so serving captures none. What the
    /// graphs then hold, or `None` where there is nothing to prepare.
    fn prepare_decode(
        &self,
        _cache: &KvCache,
        _limits: &ServingLimits,
        _max_len: usize,
    ) -> Result<Option<DecodeGraphs>, EngineError> {
        Ok(None)
    }

    /// What the captured decode passes have done (`None` where there are none: the CPU).
    fn decode_graphs(&self) -> Option<DecodeGraphs> {
        None
    }

    /// Captures decode passes as CUDA graphs or not (A/B measurements; a backend without them ignores it).
    fn set_decode_graphs(&self, _on: bool) {}
}

/// The GPU's share of a run of calls ([`Backend::take_busy_time`]): calls timed, GPU time inside them, and
/// the time from the first call's start to the last one's end; the rest of the span the GPU waited for the
/// host.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct GpuBusy {
    pub calls: u64,
    pub busy_s: f64,
    pub span_s: f64,
}

/// Decode passes run as CUDA graphs ([`Backend::decode_graphs`], engine::cuda::graphs).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct DecodeGraphs {
    /// Whether decode passes are captured.
    pub on: bool,
    /// Passes captured, replayed, and run eagerly (not eligible, or the first call of a shape).
    pub captures: u64,
    pub replays: u64,
    pub eager: u64,
    /// Graphs held now, their nodes (kernel launches and copies) and their device memory as measured.
    pub held: usize,
    pub nodes: usize,
    pub bytes: u64,
    /// Graphs evicted to stay within the graphs' memory and count limits.
    pub evicted: u64,
    /// Seconds spent capturing and instantiating.
    pub capture_s: f64,
}

/// A backend's place in an expert-parallel group ([`Backend::expert_parallel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpRank {
    pub rank: usize,
    pub world: usize,
}

/// Expert-parallel load balancing as one rank sees it ([`Backend::expert_balance`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertBalance {
    /// Looks at the group's expert loads, MoE layers moved, expert copies this rank received.
    pub looks: u64,
    pub layers_moved: u64,
    pub copies_received: u64,
    /// Over the last window, summed over the MoE layers: the busiest GPU's routed pairs over the mean, with
    /// the experts as sharded and as placed now (the same without balancing).
    pub imbalance_sharded: f64,
    pub imbalance_placed: f64,
}

/// One request of [`Backend::decode_whole_step`].
#[derive(Clone, Copy)]
pub struct StepInput<'a> {
    /// The pending token, then the MTP draft if there is one.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub start: usize,
    pub blocks: &'a [BlockId],
    pub params: &'a SamplingParams,
    /// The request's history before this step.
    pub history: History<'a>,
}

/// What [`Backend::decode_whole_step`] computed for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSamples {
    /// The sample at the pending token's position.
    pub first: Sampled,
    /// Where `first` is the draft (accepted): the sample at the draft's position, with `first` in the history
    /// (what the step emits after `first`). `None` without a draft or where it was rejected.
    pub second: Option<Sampled>,
    /// With an MTP layer: the next draft (argmax, probability), from the MTP row of the last token the step
    /// keeps: row 1's where `second` is there (the draft accepted), row 0's otherwise; the MTP layer reads
    /// the token sampled at that row.
    pub draft: Option<(u32, f32)>,
}

/// One request's row to sample ([`Backend::sample_rows`]).
#[derive(Clone, Copy)]
pub struct SampleRequest<'a> {
    pub logits: &'a DeviceRows,
    pub row: usize,
    pub params: &'a SamplingParams,
    pub history: History<'a>,
}

/// GPU time of one kernel over the launches of a profiled window ([`Backend::take_kernel_profile`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub launches: u64,
    pub seconds: f64,
}
