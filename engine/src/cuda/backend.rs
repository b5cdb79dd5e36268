//! The CUDA backend: the whole DeepSeek-V3.2 forward of docs/model.md §2 on one GPU, with the weights, the
//! cache pool and every activation in device memory. A call uploads its inputs (tokens, positions, block
//! tables), queues every layer's kernels on one stream and returns without waiting; only sampling brings
//! anything back (a token and its logprobs). Each layer's cache writes are announced with an event, so a
//! prefill worker ships layer `l` while later layers compute.
//!
//! The kernels are the plain, correct forms of `engine/kernels/model.cu` (plus the cache quantizers,
//! the FP8 indexer scorer and the top-k rule of the other families); the fast kernels of the later issues
//! replace them one by one behind this same backend.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaEvent, DevicePtr, sys};

use super::ep::{self, EpConfig, EpGroup, Pass, Shard};
use super::graphs::{self, GraphKey, GraphPass, Graphs, Plan};
use super::ops::{Arg, DBuf, Workspace, elementwise_grid, launch};
use super::topk::{self, HIST_WORDS, RawTopk, launch_topk};
use super::weights::{DFfn, DLayer, DLinear, DMlp, DMoe, DWeights, LoadError, QuantIn};
use super::{CudaError, Gpu, bf16_mma, indexer, moe, sparse_mla};
use crate::backend::{
    AttnForm, Backend, DeviceRows, EngineError, Fence, LayerDone, LayerReady, Logits, MtpInput, SampleRequest,
    SeqInput, SeqOutput, StepInput, StepSamples, check_pool_fits, main_items, mtp_items,
};
use crate::cache::{BLOCK_SIZE, BlockId, CacheFormat, CacheGeometry, KvCache, LayerIdx, MemoryKind};
use crate::checkpoint::Checkpoint;
use crate::memory::{MemoryBudget, ServingLimits};
use crate::rope::Rope;
use crate::sampling::{History, Sampled, SamplingParams};
use crate::{ModelConfig, Precision};

/// Indexer q and head-weight rows are padded to a multiple of 8 heads with zeros (the scorer pads to 64 itself).
const INDEX_HEAD_TILE: usize = 8;

/// Bytes of indexer scores one chunk of rows may hold: the scorer and the top-k run over rows in chunks of
/// [`score_rows`] so that a long prefill's workspace stays bounded.
const SCORE_BYTES: usize = 64 << 20;
/// Query heads per CTA of `tandem_indexer_post` (`INDEXER_POST_HEADS` in model.cu): each head is a chain of
/// barriers (the Hadamard transform, the amax), so fewer heads a CTA is a shorter launch at small batches.
const INDEXER_POST_HEADS: usize = 2;

/// Query heads per CTA of `tandem_mla_post` (`MLA_POST_HEADS` in model.cu).
const MLA_POST_HEADS: usize = 16;
/// Rows per scoring chunk at a score stride of `stride` positions (at least one scorer group).
fn score_rows(stride: usize, score_bytes: usize) -> usize {
    (score_bytes / (4 * stride.max(1))).max(indexer::MAX_GROUP)
}

/// Device memory the CUDA context, the loaded kernels and the library handles take outside any
/// allocation of ours (measured ~300-500 MiB on an H100 with CUDA 13).
const CONTEXT_RESERVE: u64 = 512 << 20;
/// Most bytes of staged context rows an FP8 prefill call converts per layer for the staged attention form
/// (engine::cuda::sparse_mla::stage: 1152 bytes a context position, so about 233K positions); a call whose
/// items' contexts hold more takes the gathering form, which gives the same bits.
const STAGE_BYTES: usize = 256 << 20;

/// Rows this backend returned: a range of one device buffer of the call that made them.
pub struct GpuRows {
    buf: Arc<DBuf<f32>>,
    /// First value of row 0.
    offset: usize,
    /// The context that made them (rows of another GPU are refused).
    ordinal: usize,
}

impl GpuRows {
    fn addr(&self, row: usize, width: usize) -> u64 {
        self.buf.at(self.offset + row * width)
    }
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Shape(m) => EngineError::InvalidInput(m),
            other => EngineError::Device(other.to_string()),
        }
    }
}

fn dev(e: cudarc::driver::DriverError) -> EngineError {
    EngineError::Device(e.to_string())
}

/// A point on the backend's stream.
struct EventFence(CudaEvent);

impl Fence for EventFence {
    fn wait(&self) -> Result<(), String> {
        self.0.synchronize().map_err(|e| e.to_string())
    }

    fn is_complete(&self) -> bool {
        self.0.is_complete()
    }
}

/// Copies between the device pool and host memory for transports that stage through the host.
pub struct CudaBackend {
    gpu: Gpu,
    cfg: ModelConfig,
    prec: Precision,
    w: DWeights,
    inv_freq: DBuf<f64>,
    attn_factor: f64,
    ws: Mutex<Workspace>,
    /// What `memory_budget` was last asked about: the workspace reserved with the pool.
    limits: Mutex<Option<ServingLimits>>,
    fingerprint: String,
    /// Top-k selections being recorded (diagnostics only: it waits for the GPU after every layer).
    selections: Option<crate::backend::SelectionLog>,
    /// Bytes of scores one indexer chunk may hold ([`SCORE_BYTES`] unless a test sets it).
    score_bytes: usize,
    /// `None`: the top-k form [`topk::split_applies`] picks; a test may force one.
    topk_form: Option<topk::Form>,
    /// Top-k launches (one a chunk of rows) in the single and the split form, for tests.
    topk_launches: [std::sync::atomic::AtomicU64; 2],
    /// Calls' layers where every row selected all of its positions without the indexer's scores (for tests),
    /// and whether that shortcut is taken (`TANDEM_SELECT_ALL=0` turns it off).
    select_all_launches: std::sync::atomic::AtomicU64,
    select_all: std::sync::atomic::AtomicBool,
    /// FP8 prefill attends over staged bf16 context rows (`TANDEM_PREFILL_STAGED=0` turns it off: the
    /// gathering form, the same bits), and how many layers of calls did (for tests).
    staged_prefill: std::sync::atomic::AtomicBool,
    staged_launches: std::sync::atomic::AtomicU64,
    /// This rank's expert-parallel group (engine::cuda::ep), if any.
    ep: Option<EpGroup>,
    /// The running call's agreed expert-parallel capacity (rows).
    ep_cap: std::sync::atomic::AtomicUsize,
    /// Where this rank is in the current step's passes ([`Pass::STEP`]).
    ep_step: crate::lockstep::Steps,
    /// Expert-parallel load counting and balancing (engine::cuda::balance).
    balancer: Option<super::balance::Balancer>,
    /// Dual-batch overlap under expert parallelism ([`ep::Dbo`]); the second micro-batch's workspace and
    /// the running call's agreed most rows.
    dbo: ep::Dbo,
    /// The routed expert matrices a rank holds a layer besides load balancing's spare slots (the same on
    /// every rank of a group, and across moves): what [`ep::Dbo::Auto`] looks at.
    local_experts: usize,
    ws_b: Mutex<Workspace>,
    ep_most: std::sync::atomic::AtomicUsize,
    /// The captured decode passes (engine::cuda::graphs); locked after `ws`.
    graphs: Mutex<Graphs>,
    /// Whole decode steps on the device ([`Backend::decode_whole_step`]; `TANDEM_WHOLE_STEP=0` turns them off).
    whole_steps: std::sync::atomic::AtomicBool,
}

/// A decode pass's padded shape where it runs as a CUDA graph (engine::cuda::graphs): rows and block-table
/// width.
#[derive(Clone, Copy, Debug)]
struct Pad {
    rows: usize,
    width: usize,
}

use crate::backend::BatchItem as Item;

/// One micro-batch of an overlapped pass ([`CudaBackend::overlapped`]): its inputs (None: no rows), rows,
/// and its rows of the residual stream.
#[derive(Clone, Copy)]
struct Micro<'a> {
    inp: Option<&'a Inputs>,
    rows: usize,
    h: u64,
}

/// `items` cut at row `at`: the items (or parts of items) before it, and those after it with their rows
/// counted from `at`.
fn split_items<'a>(items: &[Item<'a>], at: usize) -> (Vec<Item<'a>>, Vec<Item<'a>>) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for it in items {
        let (lo, hi) = (it.row0, it.row0 + it.n);
        if lo < at {
            let n = hi.min(at) - lo;
            a.push(Item { n, ..*it });
        }
        if hi > at {
            let first = lo.max(at);
            let skip = first - lo;
            b.push(Item { start: it.start + skip, n: hi - first, row0: first - at, ..*it });
        }
    }
    (a, b)
}

/// A whole decode step's buffers on the device ([`CudaBackend::step_buffers`]): inputs, the main
/// pass's tokens, final-normed rows and logits (reused by the MTP layer), the sampled tokens, the MTP
/// embedding's zero flags, the drafts' row addresses and results, and the samplers' records.
struct StepBuffers {
    rows: usize,
    tok: u64,
    inp: Inputs,
    normed: u64,
    logits: u64,
    sampled: u64,
    zero: u64,
    draft_rows: u64,
    draft_out: u64,
    records: u64,
    heads: StepHeads,
}

/// Where a whole step's MTP head reads its rows ([`CudaBackend::step_buffers`]): each request's first row,
/// second row (-1: none) and draft (-1: none), the requests' count, and the rows chosen.
struct StepHeads {
    first: u64,
    second: u64,
    draft: u64,
    count: u64,
    idx: u64,
}

/// A call's inputs on the device, shared by every layer.
struct Inputs {
    rows: usize,
    positions: u64,
    lengths: u64,
    slots: u64,
    /// `[rows, table_width]` block ids of each row's request.
    tables: u64,
    table_width: usize,
    /// Score columns: the longest context of any row.
    score_stride: usize,
    /// The MHA form (full-precision prefill): every item's context slots, and each row's first context row.
    ctx: Option<(u64, usize, u64)>,
    /// The staged attention form (FP8 prefill within [`STAGE_BYTES`]): the same three, the context rows to
    /// stage and each row's first staged row.
    stage: Option<(u64, usize, u64)>,
    /// How the indexer cuts the rows into chunks, the same in every layer.
    score_plan: ScorePlan,
    /// The FP8 indexer's scorer groups, one entry per chunk of `score_plan` (uploaded here: an upload in a
    /// layer would make the host wait for the stream every layer): groups on the device, groups, most queries
    /// of a group.
    score_groups: Vec<(u64, usize, usize)>,
    /// Under expert parallelism, a padded call's real rows (one i32 on the device, so a graph reads each
    /// step's): the padding rows' pairs route to no expert. 0 otherwise.
    real_rows: u64,
}

/// How a call's indexer scores are cut into chunks of rows (the same in every layer).
#[derive(Clone, Copy)]
struct ScorePlan {
    /// The scorer counts the top-k's first radix digit as it writes.
    with_hist: bool,
    /// The top-k's split form.
    split: bool,
    chunk_rows: usize,
}

/// Device memory a graph is expected to hold a node, with room (measured on an H200: 5.2 MiB for the 62
/// layers of the synthetic model's graphs, about 48 nodes a layer, 1.8 KiB a node).
const GRAPH_NODE_BYTES: u64 = 3 * 1024;

/// Device memory a whole-step graph of `layers` layers is expected to hold ([`CudaBackend::graph_bytes_each`]).
fn graph_bytes(layers: usize) -> u64 {
    (48 * layers as u64 + 32) * GRAPH_NODE_BYTES
}

/// Blocks of the longest block-table row a call over `items` needs.
fn table_blocks(items: &[Item<'_>]) -> usize {
    items.iter().map(|it| (it.start + it.n).div_ceil(BLOCK_SIZE)).max().unwrap_or(1)
}

/// The runs of `runs` (each item's first row and rows) inside rows `r0..r1`, relative to `r0`, as the
/// scorer's groups.
fn chunk_groups(runs: &[(usize, usize)], r0: usize, r1: usize) -> Vec<i32> {
    indexer::groups(runs.iter().filter_map(|&(first, len)| {
        let (a, b) = (first.max(r0), (first + len).min(r1));
        (a < b).then(|| (a - r0, b - a))
    }))
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or finds cached) every kernel and loads the checkpoint's weights.
    pub fn load(ckpt: &Checkpoint, prec: Precision, ordinal: usize, kernel_cache: &Path) -> Result<Self, EngineError> {
        Self::load_with(ckpt, prec, ordinal, kernel_cache, None)
    }

    /// [`load`](Self::load) as one rank of an expert-parallel group (engine::cuda::ep): this rank's routed
    /// experts only, and every forward call in lockstep with the other ranks. Returns once every rank of
    /// the group has joined.
    pub fn load_ep(
        ckpt: &Checkpoint,
        prec: Precision,
        ordinal: usize,
        kernel_cache: &Path,
        ep: &EpConfig,
    ) -> Result<Self, EngineError> {
        Self::load_with(ckpt, prec, ordinal, kernel_cache, Some(ep))
    }

    fn load_with(
        ckpt: &Checkpoint,
        prec: Precision,
        ordinal: usize,
        kernel_cache: &Path,
        ep: Option<&EpConfig>,
    ) -> Result<Self, EngineError> {
        let cfg = ckpt.config().clone();
        let shard = ep.map_or(Shard::SINGLE, EpConfig::shard);
        shard.check(&cfg).map_err(EngineError::InvalidInput)?;
        if ep.is_some() && (prec != Precision::Fp8 || !moe::enabled()) {
            return Err(EngineError::Unsupported(
                "expert parallelism runs the grouped FP8 experts: --precision fp8, TANDEM_MOE_GROUPED unset".into(),
            ));
        }
        let gpu = Gpu::open(ordinal, kernel_cache)?;
        Self::check_config(&cfg)?;
        // One stream carries all work; buffers are ordered by it, so cudarc's per-buffer events are not needed.
        // SAFETY: no buffer of this context is used on another stream.
        unsafe { gpu.context().disable_event_tracking() };
        keep_freed_memory(&gpu)?;
        let stream = gpu.stream().clone();
        let eplb = ep.map(|e| e.eplb);
        let dbo = ep.map_or(ep::Dbo::Off, |e| e.dbo);
        if let Some(b) = eplb.filter(|b| b.rebalance) {
            b.check(cfg.n_routed_experts, cfg.n_group, shard.world).map_err(EngineError::InvalidInput)?;
        }
        let layout = super::weights::ExpertLayout {
            shard,
            count: ep.is_some(),
            redundant: eplb.filter(|b| b.rebalance).map(|b| b.redundant),
        };
        let w = DWeights::load(&stream, ckpt, prec, layout).map_err(|e| match e {
            LoadError::Checkpoint(c) => EngineError::Checkpoint(c),
            LoadError::Cuda(c) => EngineError::Device(format!(
                "loading the weights onto GPU {ordinal} ({}, {} MiB): {c}",
                gpu.info().name,
                gpu.info().total_memory >> 20
            )),
        })?;
        let rope = Rope::new(&cfg);
        let inv_freq = DBuf::upload(&stream, rope.inv_freq())?;
        stream.synchronize().map_err(dev)?;
        if ep.is_some() {
            // The exchange moves FP8 rows of 128-channel groups and bf16 rows 16 bytes at a time, into the
            // grouped experts.
            let moe_layers = w.layers.iter().map(|l| &**l).chain(w.mtp.iter().map(|m| &m.layer));
            for l in moe_layers {
                if let DFfn::Moe(m) = &l.ffn
                    && (!moe::supported(&m.routed().experts) || !cfg.hidden_size.is_multiple_of(8))
                {
                    return Err(EngineError::Unsupported(format!(
                        "expert parallelism needs FP8 experts with 128 x 128 blocks and a hidden size that is a \
                         multiple of 8 (hidden {})",
                        cfg.hidden_size
                    )));
                }
            }
        }
        // A group of one runs the exchange with itself (the kernels' single-GPU check).
        let ep = ep.map(|e| EpGroup::connect(&gpu, e)).transpose()?;
        if let Some(e) = &ep {
            let m = e.shard();
            tracing::info!(rank = m.rank, world = m.world, experts = ?m.experts(cfg.n_routed_experts), "expert-parallel group joined");
        }
        let balancer = eplb.map(|b| super::balance::Balancer::new(b, w.moe_sets().len(), cfg.n_routed_experts));
        let local_experts = w.moe_sets().first().map_or(0, |m| {
            let r = m.routed();
            let spare = r.slots.as_ref().map_or(0, |t| t.per_rank.saturating_sub(cfg.n_routed_experts / shard.world));
            r.experts.down.groups().saturating_sub(spare)
        });
        let mut graphs = Graphs::new(graphs::enabled_by_env());
        if ep.is_some() {
            // Every rank evicts the same graphs at the same call (the plan agreement also catches a rank
            // whose graphs differ, at the cost of a capture).
            graphs.charge_nodes(GRAPH_NODE_BYTES);
        }
        Ok(CudaBackend {
            balancer,
            dbo,
            local_experts,
            ws_b: Mutex::new(Workspace::new()),
            ep_most: Default::default(),
            attn_factor: rope.attn_factor(),
            inv_freq,
            gpu,
            cfg,
            prec,
            w,
            ws: Mutex::new(Workspace::new()),
            limits: Mutex::new(None),
            fingerprint: ckpt.fingerprint().to_string(),
            selections: None,
            score_bytes: SCORE_BYTES,
            topk_form: None,
            topk_launches: Default::default(),
            select_all_launches: Default::default(),
            select_all: std::env::var("TANDEM_SELECT_ALL").map_or(true, |v| v != "0").into(),
            staged_prefill: std::env::var("TANDEM_PREFILL_STAGED").map_or(true, |v| v != "0").into(),
            staged_launches: Default::default(),
            ep,
            ep_cap: Default::default(),
            ep_step: Default::default(),
            graphs: Mutex::new(graphs),
            whole_steps: std::env::var("TANDEM_WHOLE_STEP").map_or(true, |v| v != "0").into(),
        })
    }

    /// Captures decode passes as CUDA graphs (the default unless `TANDEM_CUDA_GRAPHS=0`) or not.
    pub fn with_graphs(self, on: bool) -> Self {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).set_enabled(on);
        self
    }

    /// Runs whole decode steps on the device ([`Backend::decode_whole_step`]) or the separate calls (A/B
    /// measurements and tests; `TANDEM_WHOLE_STEP=0` starts with them off).
    pub fn with_whole_steps(self, on: bool) -> Self {
        self.set_whole_steps(on);
        self
    }

    /// [`with_whole_steps`](Self::with_whole_steps) on a shared backend.
    pub fn set_whole_steps(&self, on: bool) {
        self.whole_steps.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether decode steps run whole on the device (never under expert parallelism).
    pub fn whole_steps(&self) -> bool {
        self.ep.is_none() && self.whole_steps.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What the decode graphs have done so far.
    pub fn graph_stats(&self) -> crate::DecodeGraphs {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).stats()
    }

    /// Records every row's top-k selection from now on (diagnostics: it copies them to the host after every
    /// layer); read with [`CudaBackend::take_selections`].
    pub fn recording_selections(mut self) -> Self {
        self.selections = Some(Default::default());
        // Recorded layer by layer over the whole batch: never in two micro-batches (under expert
        // parallelism every rank must then record).
        self.dbo = ep::Dbo::Off;
        self
    }

    /// Bounds one chunk of indexer scores to `bytes` (at least one scorer group of rows per chunk), instead
    /// of [`SCORE_BYTES`]: tests use it to cut a short prefill into many chunks. Results do not depend on it.
    pub fn with_score_chunk_bytes(mut self, bytes: usize) -> Self {
        self.score_bytes = bytes.min(SCORE_BYTES);
        self
    }

    /// Runs the indexer's top-k in `form` wherever that form can run (FP8 rows longer than index_topk; the
    /// split form up to [`topk::MAX_SPLIT_STRIDE`] positions) instead of where [`topk::split_applies`] picks
    /// it: tests use it to run both forms through the model. Results do not depend on it.
    pub fn with_topk_form(mut self, form: topk::Form) -> Self {
        self.topk_form = Some(form);
        self
    }

    /// Takes the shortcut for calls whose rows are all at most index_topk long (every position selected: no
    /// indexer queries or scores) or not (tests and A/B measurements; the same bits either way).
    pub fn with_select_all(self, on: bool) -> Self {
        self.select_all.store(on, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// FP8 prefill attends over staged context rows or gathers from the cache (tests and A/B measurements; the
    /// same bits either way).
    pub fn with_staged_prefill(self, on: bool) -> Self {
        self.staged_prefill.store(on, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Layers of FP8 prefill calls that attended over staged context rows so far.
    pub fn staged_launches(&self) -> u64 {
        self.staged_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Chunks of rows (one a layer and chunk) that selected all of their positions without scores so far. A
    /// captured pass counts when captured; its replays add none.
    pub fn select_all_launches(&self) -> u64 {
        self.select_all_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Top-k launches issued so far (one a chunk of rows): (single form, split form). A decode pass captured
    /// as a CUDA graph counts its launches once, when captured; its replays add none.
    pub fn topk_launches(&self) -> (u64, u64) {
        let n = |i: usize| self.topk_launches[i].load(std::sync::atomic::Ordering::Relaxed);
        (n(0), n(1))
    }

    /// The selections recorded since the last call: (layer, row of the call, ascending positions).
    pub fn take_selections(&self) -> Vec<(LayerIdx, usize, Vec<u32>)> {
        self.selections.as_ref().map(|s| s.take()).unwrap_or_default()
    }

    /// Shapes the kernels support, refused at load with the reason.
    fn check_config(cfg: &ModelConfig) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::Unsupported(m));
        if cfg.index_head_dim != 128 {
            return bad(format!("index_head_dim {}: the GPU indexer kernels take 128", cfg.index_head_dim));
        }
        if cfg.index_n_heads > 64 {
            return bad(format!("{} indexer heads: the GPU scorer takes up to 64", cfg.index_n_heads));
        }
        if cfg.qk_rope_head_dim > 128 || !cfg.qk_rope_head_dim.is_multiple_of(2) {
            return bad(format!("qk_rope_head_dim {}: an even number up to 128", cfg.qk_rope_head_dim));
        }
        if !cfg.kv_lora_rank.is_multiple_of(128) || cfg.kv_lora_rank > 4096 {
            return bad(format!("kv_lora_rank {}: a multiple of 128 up to 4096", cfg.kv_lora_rank));
        }
        if cfg.n_routed_experts > 512 || cfg.n_group > 64 {
            return bad(format!("{} experts in {} groups: at most 512 in 64", cfg.n_routed_experts, cfg.n_group));
        }
        if cfg.num_experts_per_tok > 32 {
            return bad(format!("{} experts per token: the GPU routing takes up to 32", cfg.num_experts_per_tok));
        }
        Ok(())
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Copies whole blocks `src[i]` onto `dst[i]` in every layer of `cache` (latent entries and indexer
    /// blocks), ordered on the backend's stream: a request's caches cloned into blocks of its own (engine-bench's
    /// `--shared-context` decodes many requests over one prefilled context this way). Runs of consecutive ids
    /// on both sides move as one copy per layer and region.
    pub fn copy_blocks(&self, cache: &KvCache, src: &[BlockId], dst: &[BlockId]) -> Result<(), EngineError> {
        let pool = self.check_cache(cache)?;
        let g = cache.geometry();
        if src.len() != dst.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} source blocks for {} destinations",
                src.len(),
                dst.len()
            )));
        }
        if let Some(b) = src.iter().chain(dst).find(|b| b.0 as usize >= g.num_blocks) {
            return Err(EngineError::InvalidInput(format!("block {} outside a pool of {}", b.0, g.num_blocks)));
        }
        // Each destination once, and never a source: overlapping copies have no defined result.
        let mut seen = std::collections::HashSet::new();
        let sources: std::collections::HashSet<u32> = src.iter().map(|b| b.0).collect();
        if let Some(b) = dst.iter().find(|b| !seen.insert(b.0) || sources.contains(&b.0)) {
            return Err(EngineError::InvalidInput(format!(
                "block {} is a destination twice, or both a source and a destination",
                b.0
            )));
        }
        // (first source, first destination, blocks) of each run.
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (a, b) in src.iter().zip(dst).map(|(a, b)| (a.0 as usize, b.0 as usize)) {
            match runs.last_mut() {
                Some((s0, d0, n)) if *s0 + *n == a && *d0 + *n == b => *n += 1,
                _ => runs.push((a, b, 1)),
            }
        }
        let s = self.stream();
        s.context().bind_to_thread().map_err(dev)?;
        let regions = [
            (0, g.latent_layer_stride(), g.latent_bytes_per_block()),
            (g.indexer_region_offset(), g.indexer_layer_stride(), g.indexer_bytes_per_block()),
        ];
        for l in 0..g.num_layers {
            for &(offset, stride, block) in &regions {
                let base = pool + (offset + l * stride) as u64;
                for &(a, b, n) in &runs {
                    let (from, to) = (base + (a * block) as u64, base + (b * block) as u64);
                    // SAFETY: both ranges are whole blocks inside this layer's region of the pool (ids checked
                    // above); the copy is ordered on the stream with every call that reads or writes them.
                    unsafe { cudarc::driver::result::memcpy_dtod_async(to, from, n * block, s.cu_stream()) }
                        .map_err(dev)?;
                }
            }
        }
        Ok(())
    }

    pub fn checkpoint_fingerprint(&self) -> &str {
        &self.fingerprint
    }

    fn rows_of<'r>(&self, rows: &'r DeviceRows) -> Result<&'r GpuRows, EngineError> {
        let g = rows
            .downcast_ref::<GpuRows>()
            .ok_or_else(|| EngineError::InvalidInput("rows from another backend (not this GPU's)".into()))?;
        if g.ordinal != self.gpu.info().ordinal {
            return Err(EngineError::InvalidInput(format!(
                "rows of GPU {} on GPU {}",
                g.ordinal,
                self.gpu.info().ordinal
            )));
        }
        Ok(g)
    }

    /// The pool as this backend's device memory, if it fits this model.
    fn check_cache(&self, cache: &KvCache) -> Result<u64, EngineError> {
        let g = cache.geometry();
        let ordinal = self.gpu.info().ordinal as u32;
        if cache.memory_kind() != (MemoryKind::Device { ordinal }) {
            return Err(EngineError::InvalidInput(format!(
                "the CUDA backend on GPU {ordinal} cannot use a pool in {} memory",
                cache.memory_kind()
            )));
        }
        check_pool_fits(&self.cfg, self.prec, g)?;
        Ok(cache.arena().as_ptr() as u64)
    }

    fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        self.gpu.stream()
    }

    fn fence_now(&self) -> Result<LayerReady, EngineError> {
        let ev = self.gpu.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(dev)?;
        ev.record(self.stream()).map_err(dev)?;
        Ok(LayerReady::pending(Arc::new(EventFence(ev))))
    }

    /// Uploads a call's positions, lengths, slots and block tables. With `pad` (a decode pass captured as a
    /// graph, engine::cuda::graphs) the rows and the table width are padded to its shape: padding rows sit at
    /// position 0 of the first item's request (length 1), write no cache entry (slot -1) and score alone, and
    /// each chunk's scorer groups are filled to one entry per row with empty groups, so every launch's
    /// arguments depend on the shape only.
    fn inputs(
        &self,
        ws: &mut Workspace,
        items: &[Item<'_>],
        form: AttnForm,
        pad: Option<Pad>,
    ) -> Result<Inputs, EngineError> {
        self.padded_inputs(ws, items, form, pad, None)
    }

    /// [`inputs`](Self::inputs) where padding rows may attend to `fill` (position 0 of that block) when
    /// `items` is empty: an overlapped pass's second micro-batch of padding alone.
    fn padded_inputs(
        &self,
        ws: &mut Workspace,
        items: &[Item<'_>],
        form: AttnForm,
        pad: Option<Pad>,
        fill: Option<BlockId>,
    ) -> Result<Inputs, EngineError> {
        let s = self.stream();
        let real: usize = items.iter().map(|it| it.n).sum();
        let needed = table_blocks(items);
        let (rows, table_width) = match pad {
            Some(p) if p.rows >= real && p.width >= needed => (p.rows, p.width),
            Some(p) => {
                return Err(EngineError::InvalidInput(format!(
                    "a graph shape of {} rows x {} blocks for {real} rows x {needed} blocks",
                    p.rows, p.width
                )));
            }
            None => (real, needed),
        };
        let mut positions = Vec::with_capacity(rows);
        let mut slots = Vec::with_capacity(rows);
        let mut tables = vec![-1i32; rows * table_width];
        for it in items {
            for i in 0..it.n {
                let p = it.start + i;
                let r = it.row0 + i;
                positions.push(p as i32);
                slots.push(it.blocks[p / BLOCK_SIZE].0 as i64 * BLOCK_SIZE as i64 + (p % BLOCK_SIZE) as i64);
                let need = (p + 1).div_ceil(BLOCK_SIZE);
                for (b, id) in it.blocks[..need].iter().enumerate() {
                    tables[r * table_width + b] = id.0 as i32;
                }
            }
        }
        if rows > real {
            let first = items
                .first()
                .and_then(|it| it.blocks.first())
                .or(fill.as_ref())
                .ok_or_else(|| EngineError::InvalidInput("padding rows need a request with a block".into()))?;
            for r in real..rows {
                positions.push(0);
                slots.push(-1);
                tables[r * table_width] = first.0 as i32;
            }
        }
        let lengths: Vec<i32> = positions.iter().map(|p| p + 1).collect();
        // A multiple of 4, so every row of scores starts 16-byte aligned (the top-k reads them in vectors).
        let score_stride = match pad {
            Some(_) => table_width * BLOCK_SIZE,
            None => (lengths.iter().copied().max().unwrap_or(1) as usize).next_multiple_of(4),
        };
        // FP8 prefill attends in the absorbed form over the cache, as decode does (`layer`), over context rows
        // staged from it where they fit.
        let fp8 = self.prec == Precision::Fp8;
        // Staging converts every context position once; it pays where the rows' selections (what gathering
        // would dequantize) are at least as many, i.e. not for a few rows over a long context.
        let context: usize = items.iter().map(|it| it.start + it.n).sum();
        let topk = self.cfg.index_topk.max(1);
        let selections: usize =
            items.iter().map(|it| (it.start + 1..=it.start + it.n).map(|len| len.min(topk)).sum::<usize>()).sum();
        let staged = fp8
            && form == AttnForm::Prefill
            && pad.is_none()
            && self.staged_prefill.load(std::sync::atomic::Ordering::Relaxed)
            && context * sparse_mla::STAGED_ROW_BYTES <= STAGE_BYTES
            && selections >= context;
        let ctx = if form == AttnForm::Prefill && (!fp8 || staged) {
            let mut ctx_slots = Vec::new();
            let mut ctx0 = Vec::with_capacity(rows);
            for it in items {
                let first = ctx_slots.len() as i32;
                let end = it.start + it.n;
                for p in 0..end {
                    ctx_slots.push(it.blocks[p / BLOCK_SIZE].0 as i64 * BLOCK_SIZE as i64 + (p % BLOCK_SIZE) as i64);
                }
                ctx0.extend(std::iter::repeat_n(first, it.n));
            }
            let n = ctx_slots.len();
            Some((ws.upload(s, &ctx_slots)?, n, ws.upload(s, &ctx0)?))
        } else {
            None
        };
        // The pool's format is the precision's (check_pool_fits), so FP8 here is the layer's FP8 cache.
        let (ctx, stage) = if fp8 { (None, ctx) } else { (ctx, None) };
        let score_plan = self.score_plan(rows, score_stride, fp8);
        let mut score_groups = Vec::new();
        if fp8 {
            let runs: Vec<(usize, usize)> =
                items.iter().map(|it| (it.row0, it.n)).chain((real..rows).map(|r| (r, 1))).collect();
            for r0 in (0..rows).step_by(score_plan.chunk_rows.max(1)) {
                let r1 = (r0 + score_plan.chunk_rows).min(rows);
                let mut grouping = chunk_groups(&runs, r0, r1);
                let mut max_q = grouping.chunks(2).map(|g| g[1] as usize).max().unwrap_or(1);
                if pad.is_some() {
                    // Empty groups (no rows: their CTAs leave at once) up to one per row.
                    grouping.resize(2 * (r1 - r0), 0);
                    max_q = graphs::MAX_ROWS_PER_REQUEST;
                }
                score_groups.push((ws.upload(s, &grouping)?, grouping.len() / 2, max_q));
            }
        }
        let real_rows = if pad.is_some() && self.ep.is_some() { ws.upload(s, &[real as i32])? } else { 0 };
        Ok(Inputs {
            real_rows,
            rows,
            positions: ws.upload(s, &positions)?,
            lengths: ws.upload(s, &lengths)?,
            slots: ws.upload(s, &slots)?,
            tables: ws.upload(s, &tables)?,
            table_width,
            score_stride,
            ctx,
            stage,
            score_plan,
            score_groups,
        })
    }

    /// Whether a pass over `items` in `form` may run as a CUDA graph on this backend: graphs on, the decode
    /// form, no selections recorded, kernels profiled or overlap stages timed (all read per launch), and no
    /// item of more than two rows (a replayed prefill chunk).
    fn graph_able(&self, items: &[Item<'_>], form: AttnForm) -> bool {
        let on = self.graphs.lock().unwrap_or_else(|p| p.into_inner()).enabled();
        on && form == AttnForm::Decode
            && self.selections.is_none()
            && !self.gpu.profiler().is_on()
            && !self.ep.as_ref().is_some_and(EpGroup::recording_timeline)
            && !items.is_empty()
            && items.iter().all(|it| it.n <= graphs::MAX_ROWS_PER_REQUEST)
    }

    /// The padded shape a decode pass over `items` is captured at on one GPU, or `None` where it runs
    /// eagerly: not [`graph_able`](Self::graph_able), or more rows than [`graphs::MAX_ROWS`].
    fn graph_shape(&self, items: &[Item<'_>], form: AttnForm) -> Option<Pad> {
        if self.ep.is_some() || !self.graph_able(items, form) {
            return None;
        }
        let real: usize = items.iter().map(|it| it.n).sum();
        let mut rows = graphs::row_bucket(real)?;
        // Padding past the serving limit would outgrow the workspace reserved for it: the exact rows then.
        let limits = *self.limits.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = limits
            && rows > l.max_num_batched_tokens
        {
            rows = real;
        }
        Some(Pad { rows, width: graphs::width_bucket(table_blocks(items)) })
    }

    /// The padded shape `pass` over `items` runs at as a graph ([`graph_shape`](Self::graph_shape)); under
    /// expert parallelism, agreed by every rank ([`EpGroup::agree_graph_shape`]): the decode-form passes
    /// ([`Pass::Main`], [`Pass::Mtp`]) whose agreed most rows have a row bucket are captured where every rank
    /// can and has rows, each rank padded to that bucket and to the widest rank's table width, so all ranks
    /// run the same graphs together (their exchanges' collectives are in them). Called after
    /// [`begin`](Self::begin); a rank without rows joins with [`ep_join_graph`](Self::ep_join_graph).
    fn pass_shape(&self, items: &[Item<'_>], form: AttnForm, pass: Pass) -> Result<Option<Pad>, EngineError> {
        let Some(ep) = &self.ep else { return Ok(self.graph_shape(items, form)) };
        let Some(rows) = self.ep_graph_rows(pass) else { return Ok(None) };
        let limits = *self.limits.lock().unwrap_or_else(|p| p.into_inner());
        // Padding past the serving limit would outgrow the workspace reserved for it.
        let able = self.graph_able(items, form) && limits.is_none_or(|l| rows <= l.max_num_batched_tokens);
        let real: usize = items.iter().map(|it| it.n).sum();
        let width = ep.agree_graph_shape(able, real, table_blocks(items))?;
        Ok(width.map(|w| Pad { rows, width: graphs::width_bucket(w) }))
    }

    /// The rows every rank pads a graphed `pass` to under expert parallelism (its agreed most rows' bucket),
    /// or `None` for a pass that is never captured (no [`EpGroup::agree_graph_shape`] then, on any rank).
    fn ep_graph_rows(&self, pass: Pass) -> Option<usize> {
        if pass == Pass::MainPrefill {
            return None;
        }
        graphs::row_bucket(self.ep_most.load(std::sync::atomic::Ordering::Relaxed).max(1))
    }

    /// A rank without rows in `pass` joins its graph-shape agreement (which then says no graph: the pass
    /// runs eagerly on every rank).
    fn ep_join_graph(&self, ep: &EpGroup, pass: Pass) -> Result<(), EngineError> {
        if self.ep_graph_rows(pass).is_some() {
            ep.agree_graph_shape(false, 0, 0)?;
        }
        Ok(())
    }

    /// Runs the layers of a pass (`issue`, which leaves the workspace where it found it): with `pad` (its
    /// graph shape, [`graph_shape`](Self::graph_shape)) as the CUDA graph of that shape, replayed where
    /// captured, otherwise run eagerly, then captured (not run) for the next call of the shape
    /// (engine::cuda::graphs); without, eagerly.
    /// Under expert parallelism the ranks agree on the plan ([`EpGroup::agree_graph_plan`]): every rank
    /// replays, or every rank runs and captures, or none captures; after a capture, a failure on any rank is
    /// every rank's. While capturing, the group does not pace the host (nothing runs). `second` is an
    /// overlapped pass's second workspace, rewound and frozen with the first.
    #[allow(clippy::too_many_arguments)]
    fn graphed(
        &self,
        ws: &mut Workspace,
        mut second: Option<&mut Workspace>,
        pass: GraphPass,
        pad: Option<Pad>,
        form: AttnForm,
        g: &CacheGeometry,
        pool: u64,
        mut issue: impl FnMut(&mut Workspace, Option<&mut Workspace>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let Some(pad) = pad else {
            if form == AttnForm::Decode {
                self.graphs.lock().unwrap_or_else(|p| p.into_inner()).count_eager();
            }
            return issue(ws, second);
        };
        let (mark, mark_b) = (ws.mark(), second.as_ref().map(|b| b.mark()));
        let key = self.graph_key(ws, second.as_deref(), pass, pad, g, pool);
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        graphs.retire(self.balancer.as_ref().map_or(0, super::balance::Balancer::moves));
        let mut plan = graphs.plan(&key);
        if let Some(ep) = &self.ep {
            plan = Plan::from_code(ep.agree_graph_plan(plan.code(), graphs.serial_of(&key))?);
        }
        match plan {
            Plan::Replayed => graphs.launch(&key),
            Plan::Eager => {
                graphs.count_eager_shape();
                issue(ws, second)
            }
            Plan::RunAndCapture => {
                graphs.count_eager_shape();
                issue(ws, second.as_deref_mut())?;
                ws.rewind(mark);
                // The eager run grew the workspaces to what this issue sequence takes: capturing may not grow
                // them (an allocation would be captured too).
                ws.set_frozen(true);
                if let (Some(b), Some(m)) = (second.as_deref_mut(), mark_b) {
                    b.rewind(m);
                    b.set_frozen(true);
                }
                if let Some(ep) = &self.ep {
                    ep.set_capturing(true);
                }
                let captured = graphs.capture(self.stream(), key, || issue(ws, second.as_deref_mut()));
                if let Some(ep) = &self.ep {
                    ep.set_capturing(false);
                }
                ws.set_frozen(false);
                ws.rewind(mark);
                if let (Some(b), Some(m)) = (second, mark_b) {
                    b.set_frozen(false);
                    b.rewind(m);
                }
                captured?;
                if let Some(ep) = &self.ep
                    && !ep.agree_graph_outcome(graphs.is_captured(&key))?
                {
                    graphs.mark_failed(key);
                }
                Ok(())
            }
        }
    }

    /// The indexer's chunking of `rows` rows of `stride` score columns: the score buffer bounded, a launch at
    /// most 65535 rows (grid y); where the FP8 scorer counts the first radix digit (rows longer than
    /// index_topk) and the top-k's split form (CTAs of 4096 positions instead of one per row, where a chunk has
    /// few rows; its plan records count in the chunk's budget). The selections are the same in either form.
    fn score_plan(&self, rows: usize, stride: usize, fp8: bool) -> ScorePlan {
        let topk = self.cfg.index_topk;
        let with_hist = fp8 && stride > topk;
        let row_words = stride + if with_hist { HIST_WORDS } else { 0 };
        let chunk = |words| score_rows(words, self.score_bytes).min(rows).min(65_535);
        let split_chunk = chunk(row_words + topk::SPLIT_WORDS);
        let split = with_hist
            && match self.topk_form {
                None => topk::split_applies(split_chunk, stride, topk),
                Some(topk::Form::Split) => stride <= topk::MAX_SPLIT_STRIDE,
                Some(topk::Form::Single) => false,
            };
        let chunk_rows = if split { split_chunk } else { chunk(row_words) };
        ScorePlan { with_hist, split, chunk_rows }
    }

    fn rms_norm(
        &self,
        x: u64,
        in_stride: usize,
        w: &DBuf<f32>,
        out: u64,
        out_stride: usize,
        rows: usize,
    ) -> Result<(), CudaError> {
        launch(
            &self.gpu,
            "tandem_rms_norm",
            (rows as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(x),
                Arg::L(in_stride as i64),
                Arg::P(w.ptr()),
                Arg::P(out),
                Arg::L(out_stride as i64),
                Arg::I(w.len() as i32),
                Arg::F(self.cfg.rms_norm_eps),
            ],
        )
    }

    /// `x [rows, ..]` quantized in `first`'s FP8 input format, where it takes one (and there are rows).
    fn quantize_once(
        &self,
        ws: &mut Workspace,
        first: &DLinear,
        x: u64,
        rows: usize,
    ) -> Result<Option<QuantIn>, CudaError> {
        match first.quant_format() {
            Some(_) if rows > 0 => Ok(Some(first.quantize_input(&self.gpu, ws, x, rows)?)),
            _ => Ok(None),
        }
    }

    /// `y = lin(x)` over `rows` rows, from `pre` where it is `x` quantized in `lin`'s format (the same codes
    /// `lin` would make: the same bits), else from `x`.
    fn linear(
        &self,
        ws: &mut Workspace,
        lin: &DLinear,
        x: u64,
        rows: usize,
        pre: Option<&QuantIn>,
        y: u64,
    ) -> Result<(), CudaError> {
        match pre {
            Some(q) if lin.quant_format() == Some(q.format) => lin.forward_quantized(&self.gpu, ws, q, rows, y),
            _ => lin.forward(&self.gpu, ws, x, rows, 1, 0, y),
        }
    }

    fn add(&self, h: u64, x: u64, n: usize) -> Result<(), CudaError> {
        launch(&self.gpu, "tandem_add", elementwise_grid(n), 256, 0, &[Arg::P(h), Arg::P(x), Arg::L(n as i64)])
    }

    /// `down(silu(gate(x)) * up(x))`, rows through matrix `sel[m]` of stacked experts (`a_div` rows per x row).
    /// Where gate and up take the same quantized rows (FP8 tensor-core linears), they share one quantization
    /// of x: `pre` when it is in their format (x quantized already, e.g. into an expert-parallel dispatch
    /// record), else quantized here once.
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &self,
        ws: &mut Workspace,
        m: &DMlp,
        x: u64,
        x_rows: usize,
        a_div: usize,
        sel: u64,
        pre: Option<&QuantIn>,
        y: u64,
    ) -> Result<(), CudaError> {
        let s = self.stream();
        let rows = x_rows * a_div;
        let inter = m.gate.out_features();
        let g = ws.take::<f32>(s, rows * inter)?;
        let u = ws.take::<f32>(s, rows * inter)?;
        let format = m.gate.quant_format().filter(|f| a_div == 1 && sel == 0 && m.up.quant_format() == Some(*f));
        match format {
            Some(f) if rows > 0 => {
                let q = match pre {
                    Some(q) if q.format == f => *q,
                    _ => m.gate.quantize_input(&self.gpu, ws, x, x_rows)?,
                };
                m.gate.forward_quantized(&self.gpu, ws, &q, x_rows, g)?;
                m.up.forward_quantized(&self.gpu, ws, &q, x_rows, u)?;
            }
            _ => {
                m.gate.forward(&self.gpu, ws, x, x_rows, a_div, sel, g)?;
                m.up.forward(&self.gpu, ws, x, x_rows, a_div, sel, u)?;
            }
        }
        let n = rows * inter;
        launch(
            &self.gpu,
            "tandem_silu_mul",
            elementwise_grid(n),
            256,
            0,
            &[Arg::P(g), Arg::P(u), Arg::P(g), Arg::L(n as i64)],
        )?;
        m.down.forward(&self.gpu, ws, g, rows, 1, sel, y)
    }

    /// A MoE layer's routing of `x [rows, hidden]` (ids and weights `[rows, k]`) and its shared expert's
    /// output (f32 `[rows, hidden]`, 0 without one), the shared expert's input quantized as `pre` says.
    /// Where `real` is set ([`Inputs::real_rows`]), the rows past that count route to no expert (id -1).
    fn route_and_share(
        &self,
        ws: &mut Workspace,
        m: &DMoe,
        x: u64,
        rows: usize,
        real: u64,
        pre: Option<&QuantIn>,
    ) -> Result<(u64, u64, u64), CudaError> {
        let c = &self.cfg;
        let (s, hidden, e, k) = (self.stream(), c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        let ids = ws.take::<i32>(s, (rows * k).max(1))?;
        let weights = ws.take::<f32>(s, (rows * k).max(1))?;
        let mut shared = 0;
        if rows > 0 {
            let logits = ws.take::<f32>(s, rows * e)?;
            m.gate.forward(&self.gpu, ws, x, rows, 1, 0, logits)?;
            moe::route(&self.gpu, c, logits, m.bias.as_ref().map_or(0, DBuf::ptr), rows, ids, weights)?;
            if real != 0 {
                let n = rows * k;
                let args = [Arg::P(ids), Arg::I(n as i32), Arg::I(k as i32), Arg::P(real)];
                launch(&self.gpu, "tandem_moe_drop_padding", elementwise_grid(n), 256, 0, &args)?;
            }
            super::balance::count(&self.gpu, m, ids, rows * k, e)?;
            if let Some(sh) = &m.shared {
                shared = ws.take::<f32>(s, rows * hidden)?;
                self.mlp(ws, sh, x, rows, 1, 0, pre, shared)?;
            }
        }
        Ok((ids, weights, shared))
    }

    /// Under expert parallelism, a MoE layer up to its dispatch (on `lane`): the rows quantized first, into
    /// this rank's dispatch record (engine::cuda::ep), which the shared expert reads too (one quantization
    /// of x for both), then routed (a padded pass's padding rows, past `*real`, to no expert). A rank
    /// without rows still joins (it computes the others' pairs).
    #[allow(clippy::too_many_arguments)]
    fn moe_front(
        &self,
        ws: &mut Workspace,
        ep: &EpGroup,
        m: &DMoe,
        x: u64,
        rows: usize,
        real: u64,
        lane: ep::Lane,
        micro: usize,
    ) -> Result<ep::Flight, CudaError> {
        let c = &self.cfg;
        ep.pace()?;
        let cap = self.ep_cap.load(std::sync::atomic::Ordering::Relaxed);
        let q = ep::quantize(&self.gpu, ws, c, ep::record_format(m, c.hidden_size)?, x, rows, cap)?;
        let (ids, weights, shared) = self.route_and_share(ws, m, x, rows, real, Some(&q.input()))?;
        ep::moe_send(&self.gpu, ws, ep, c, m, &q, rows, ids, weights, shared, lane, micro)
    }

    /// The feed-forward block of `rows` rows of `x` into `y`; `real` as in [`Inputs::real_rows`].
    fn ffn(&self, ws: &mut Workspace, f: &DFfn, x: u64, rows: usize, real: u64, y: u64) -> Result<(), CudaError> {
        let m = match f {
            DFfn::Dense(m) => return self.mlp(ws, m, x, rows, 1, 0, None, y),
            DFfn::Moe(m) => m,
        };
        let c = &self.cfg;
        let (s, hidden, e, k) = (self.stream(), c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        // Expert parallelism: the routed experts of every rank, the stages back to back.
        if let Some(ep) = &self.ep {
            let mut f = self.moe_front(ws, ep, m, x, rows, real, ep::Lane::Main, 0)?;
            ep::moe_experts(&self.gpu, ws, ep, c, &mut f)?;
            ep::moe_finish(&self.gpu, ep, c, f, y)?;
            return ep.layer_issued();
        }
        // One GPU: padding rows' pairs run like any (every grouped row alone), so the mask is not needed.
        let (ids, weights, shared) = self.route_and_share(ws, m, x, rows, 0, None)?;
        let routed = m.routed();
        // Experts that share weights (a synthetic model's) run as the matrix they share.
        let e = match &routed.expert_map {
            Some(map) => {
                launch(
                    &self.gpu,
                    "tandem_moe_map_ids",
                    elementwise_grid(rows * k),
                    256,
                    0,
                    &[Arg::P(ids), Arg::I((rows * k) as i32), Arg::P(map.ptr()), Arg::I(e as i32)],
                )?;
                routed.experts.down.groups()
            }
            None => e,
        };
        // FP8 experts with 128 x 128 blocks, where enabled: grouped by expert, one tensor-core GEMM per
        // matrix over all of them (engine::cuda::moe); pair p's output at its grouped row, in bf16. Otherwise
        // one matrix-vector product per pair, at row p, in f32.
        // An FP8 model's routed experts give bf16 outputs either way (docs/model.md §2.4).
        if moe::enabled() && moe::supported(&routed.experts) {
            let pairs = ws.take::<u16>(s, rows * k * hidden)?;
            let g = moe::group(&self.gpu, ws, ids, rows * k, k, e, None)?;
            moe::forward(&self.gpu, ws, &routed.experts, x, &g, pairs)?;
            let pairs = moe::PairRows::Bf16 { rows: pairs, slot: g.slot_of_pair };
            return moe::combine(&self.gpu, pairs, weights, shared, y, rows, k, hidden);
        }
        let pairs = ws.take::<f32>(s, rows * k * hidden)?;
        self.mlp(ws, &routed.experts, x, rows, k, ids, None, pairs)?;
        let round_bf16 = matches!(routed.experts.down, DLinear::Fp8 { .. });
        moe::combine(&self.gpu, moe::PairRows::F32 { rows: pairs, round_bf16 }, weights, shared, y, rows, k, hidden)
    }

    /// A decoder layer's attention block (cache layer `li`) over the batch: the layer's cache entries
    /// written, then `h` += the attention's output.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        ws: &mut Workspace,
        inp: &Inputs,
        layer: &DLayer,
        li: LayerIdx,
        geometry: &CacheGeometry,
        pool: u64,
        form: AttnForm,
        h: u64,
        on_layer: LayerDone<'_>,
    ) -> Result<(), EngineError> {
        let c = &self.cfg;
        let s = self.stream().clone();
        let g = &self.gpu;
        let rows = inp.rows;
        let (hidden, rank, rd, heads) = (c.hidden_size, c.kv_lora_rank, c.qk_rope_head_dim, c.num_attention_heads);
        let (nope, vd, qk, ih) = (c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim(), c.index_n_heads);
        let ih_pad = ih.next_multiple_of(INDEX_HEAD_TILE);
        let fp8 = geometry.format == CacheFormat::Fp8;
        let a = &layer.attn;

        let x = ws.take::<f32>(&s, rows * hidden)?;
        self.rms_norm(h, hidden, &layer.attn_norm, x, hidden, rows)?;
        let ix = &layer.indexer;
        // x feeds q_a, kv_a and the indexer's wk, qr feeds q_b and wq_b: each quantized once for the linears
        // that take FP8 rows in the same format (the codes each would make alone).
        let xq = self.quantize_once(ws, &a.q_a, x, rows)?;
        let q_lora = a.q_a.out_features();
        let qa = ws.take::<f32>(&s, rows * q_lora)?;
        self.linear(ws, &a.q_a, x, rows, xq.as_ref(), qa)?;
        let qr = ws.take::<f32>(&s, rows * q_lora)?;
        self.rms_norm(qa, q_lora, &a.q_a_norm, qr, q_lora, rows)?;
        let qrq = self.quantize_once(ws, &a.q_b, qr, rows)?;
        let q = ws.take::<f32>(&s, rows * heads * qk)?;
        self.linear(ws, &a.q_b, qr, rows, qrq.as_ref(), q)?;
        let kv = ws.take::<f32>(&s, rows * (rank + rd))?;
        self.linear(ws, &a.kv_a, x, rows, xq.as_ref(), kv)?;
        let lat = ws.take::<f32>(&s, rows * rank)?;
        let kpe = ws.take::<f32>(&s, rows * rd)?;
        launch(
            g,
            "tandem_mla_post",
            (rows as u32, heads.div_ceil(MLA_POST_HEADS) as u32, 1),
            256,
            0,
            &[
                Arg::P(q),
                Arg::P(kv),
                Arg::P(a.kv_a_norm.ptr()),
                Arg::P(inp.positions),
                Arg::P(self.inv_freq.ptr()),
                Arg::D(self.attn_factor),
                Arg::P(lat),
                Arg::P(kpe),
                Arg::I(heads as i32),
                Arg::I(nope as i32),
                Arg::I(rd as i32),
                Arg::I(rank as i32),
                Arg::F(c.rms_norm_eps),
            ],
        )?;

        // Where no row of the call is longer than index_topk (the score stride bounds every row's length), every
        // row selects all of its positions (§2.3): the indexer's keys are still made and cached for later
        // calls, but its queries, head weights and scores are not needed, and the top-k emits each row's
        // positions without reading a score. The same selections, so the same bits.
        let select_all = self.select_all.load(std::sync::atomic::Ordering::Relaxed) && inp.score_stride <= c.index_topk;
        // The indexer's queries and keys.
        let iq = ws.take::<f32>(&s, rows * ih * 128)?;
        if !select_all {
            self.linear(ws, &ix.wq_b, qr, rows, qrq.as_ref(), iq)?;
        }
        let keys = ws.take::<f32>(&s, rows * 128)?;
        self.linear(ws, &ix.wk, x, rows, xq.as_ref(), keys)?;
        let wts = ws.take::<f32>(&s, rows * ih)?;
        if !select_all {
            ix.weights_proj.forward(g, ws, x, rows, 1, 0, wts)?;
        }
        let q_codes = if fp8 { ws.take::<u8>(&s, rows * ih_pad * 128)? } else { 0 };
        let q_f32 = if fp8 { 0 } else { ws.take::<f32>(&s, rows * ih * 128)? };
        let w_heads = ws.take::<f32>(&s, rows * ih_pad)?;
        let head_scale = (ih as f32).powf(-0.5) * c.index_softmax_scale();
        // Keys only where every position is selected: no query head is read (the first CTA of a row zeroes its
        // group's, the rest are not launched).
        let (post_heads, post_groups) = if select_all { (0, 1) } else { (ih, ih_pad.div_ceil(INDEXER_POST_HEADS)) };
        launch(
            g,
            "tandem_indexer_post",
            (rows as u32, post_groups as u32, 1),
            128,
            0,
            &[
                Arg::P(iq),
                Arg::P(keys),
                Arg::P(wts),
                Arg::P(ix.k_norm_w.ptr()),
                Arg::P(ix.k_norm_b.ptr()),
                Arg::P(inp.positions),
                Arg::P(self.inv_freq.ptr()),
                Arg::D(self.attn_factor),
                Arg::F(head_scale),
                Arg::F(crate::cpu::indexer::K_NORM_EPS),
                Arg::I(post_heads as i32),
                Arg::I(ih_pad as i32),
                Arg::I(rd as i32),
                Arg::I(fp8 as i32),
                Arg::P(q_codes),
                Arg::P(q_f32),
                Arg::P(w_heads),
            ],
        )?;

        // Caches first: attention reads every position (this call's too) back from the cache.
        let latent_region = pool + (li.index() * geometry.latent_layer_stride()) as u64;
        let index_region =
            pool + (geometry.indexer_region_offset() + li.index() * geometry.indexer_layer_stride()) as u64;
        let num_slots = (geometry.num_blocks * BLOCK_SIZE) as i64;
        if fp8 {
            launch(
                g,
                "tandem_quantize_latent_fp8",
                (rows as u32, 1, 1),
                32 * (rank / 128) as u32,
                0,
                &[
                    Arg::P(lat),
                    Arg::P(kpe),
                    Arg::P(inp.slots),
                    Arg::P(latent_region),
                    Arg::I(rows as i32),
                    Arg::I(rank as i32),
                    Arg::I(rd as i32),
                    Arg::L(num_slots),
                ],
            )?;
            launch(
                g,
                "tandem_quantize_index_keys_fp8",
                (rows.div_ceil(4) as u32, 1, 1),
                128,
                0,
                &[Arg::P(keys), Arg::P(inp.slots), Arg::P(index_region), Arg::I(rows as i32), Arg::L(num_slots)],
            )?;
        } else {
            launch(
                g,
                "tandem_write_cache_f32",
                (rows as u32, 1, 1),
                128,
                0,
                &[
                    Arg::P(lat),
                    Arg::P(kpe),
                    Arg::P(keys),
                    Arg::P(inp.slots),
                    Arg::P(latent_region),
                    Arg::P(index_region),
                    Arg::I(rank as i32),
                    Arg::I(rd as i32),
                    Arg::I(128),
                    Arg::L(num_slots),
                ],
            )?;
        }
        // Announced for shipping (prefill); nothing listens to a decode pass's layers (and a captured pass
        // could not create events).
        if form == AttnForm::Prefill {
            on_layer(li, self.fence_now()?);
        }

        // Scores over each row's causal context, then the top-k rule, in chunks of rows that bound the
        // score buffer (a long prefill never holds a [tokens x context] matrix).
        let stride = inp.score_stride;
        let topk = c.index_topk;
        let sel = ws.take::<i32>(&s, rows * topk)?;
        let counts = ws.take::<i32>(&s, rows)?;
        let nans = ws.take::<i32>(&s, rows)?;
        // The scorer counts the top-k's first radix digit as it writes (FP8 only; rows of at most index_topk
        // positions select everything and never read it). The budget covers scores and counts; a launch
        // takes at most 65535 rows (grid y).
        let ScorePlan { with_hist, split, chunk_rows } = inp.score_plan;
        let scores = ws.take::<f32>(&s, chunk_rows * stride)?;
        let hist = if with_hist { ws.take::<u32>(&s, chunk_rows * HIST_WORDS)? } else { 0 };
        let plans = if split { ws.take::<u32>(&s, chunk_rows * topk::SPLIT_WORDS)? } else { 0 };
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + chunk_rows).min(rows);
            let n = r1 - r0;
            let tables = inp.tables + (r0 * inp.table_width * 4) as u64;
            let lengths = inp.lengths + (r0 * 4) as u64;
            if select_all {
                self.select_all_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else if fp8 {
                // The chunk's scorer groups, uploaded with the call's inputs by the same plan.
                let (groups, ngroups, max_q) = inp.score_groups[r0 / chunk_rows];
                if with_hist {
                    s.context().bind_to_thread().map_err(dev)?;
                    // SAFETY: `hist` holds chunk_rows >= n rows of counts (taken above); stream-ordered before
                    // the scorer.
                    unsafe { cudarc::driver::result::memset_d8_async(hist, 0, 4 * n * HIST_WORDS, s.cu_stream()) }
                        .map_err(dev)?;
                }
                indexer::launch_scores(
                    g,
                    &indexer::RawScoreArgs {
                        q: q_codes + (r0 * ih_pad * 128) as u64,
                        w: w_heads + (r0 * ih_pad * 4) as u64,
                        heads: ih_pad,
                        index_blocks: index_region,
                        num_blocks: geometry.num_blocks,
                        block_table: tables,
                        max_blocks: inp.table_width,
                        lengths,
                        groups,
                        ngroups,
                        max_q,
                        scores,
                        score_stride: stride,
                        hist,
                    },
                )?;
            } else {
                launch(
                    g,
                    "tandem_indexer_scores_f32",
                    (stride.div_ceil(64) as u32, n as u32, 1),
                    64,
                    0,
                    &[
                        Arg::P(q_f32 + (r0 * ih * 128 * 4) as u64),
                        Arg::P(w_heads + (r0 * ih_pad * 4) as u64),
                        Arg::I(ih as i32),
                        Arg::I(ih_pad as i32),
                        Arg::P(index_region),
                        Arg::P(tables),
                        Arg::I(inp.table_width as i32),
                        Arg::P(lengths),
                        Arg::P(scores),
                        Arg::L(stride as i64),
                    ],
                )?;
            }
            self.topk_launches[usize::from(split)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            launch_topk(
                g,
                &RawTopk {
                    scores,
                    row_stride: stride,
                    lengths,
                    rows: n,
                    k: topk,
                    positions: sel + (r0 * topk * 4) as u64,
                    counts: counts + (r0 * 4) as u64,
                    nan_counts: nans + (r0 * 4) as u64,
                    pre_hist: hist,
                    split: plans,
                },
            )?;
            r0 = r1;
        }

        if let Some(log) = &self.selections {
            let mut host = vec![0i32; rows * topk];
            // SAFETY: `sel` holds rows x topk i32 written by the launch above; the copy is synchronous.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, sel, s.cu_stream()) }.map_err(dev)?;
            s.synchronize().map_err(dev)?;
            for (r, row) in host.chunks(topk).enumerate() {
                log.push(li, r, row.iter().take_while(|&&p| p >= 0).map(|&p| p as u32).collect());
            }
        }

        // Attention over the selected tokens.
        let o = ws.take::<f32>(&s, rows * heads * vd)?;
        let scale = c.softmax_scale();
        // Full precision prefills in the MHA form over the decompressed latents. FP8 prefill and every decode
        // take the absorbed form over the FP8 cache on the tensor cores: a row's attention is the same kernel
        // on the same inputs whether it is prefilled or decoded (docs/model.md §2.2).
        match (form, inp.ctx) {
            (AttnForm::Prefill, Some((ctx_slots, ctx_rows, ctx0))) => {
                let cc = ws.take::<f32>(&s, ctx_rows * rank)?;
                let ck = ws.take::<f32>(&s, ctx_rows * rd)?;
                launch(
                    g,
                    "tandem_read_latents",
                    (ctx_rows as u32, 1, 1),
                    256,
                    0,
                    &[
                        Arg::P(latent_region),
                        Arg::P(ctx_slots),
                        Arg::I(fp8 as i32),
                        Arg::I(rank as i32),
                        Arg::I(rd as i32),
                        Arg::P(cc),
                        Arg::P(ck),
                    ],
                )?;
                let dec = ws.take::<f32>(&s, ctx_rows * heads * (nope + vd))?;
                a.kv_b.forward(g, ws, cc, ctx_rows, 1, 0, dec)?;
                launch(
                    g,
                    "tandem_mla_prefill",
                    (heads as u32, rows as u32, 1),
                    256,
                    (topk * 4) as u32,
                    &[
                        Arg::P(q),
                        Arg::P(dec),
                        Arg::P(ck),
                        Arg::P(ctx0),
                        Arg::P(sel),
                        Arg::I(topk as i32),
                        Arg::P(o),
                        Arg::I(heads as i32),
                        Arg::I(nope as i32),
                        Arg::I(rd as i32),
                        Arg::I(vd as i32),
                        Arg::F(scale),
                    ],
                )?;
            }
            _ if fp8 => {
                // The absorbed form on the tensor cores (engine/kernels/sparse_mla.cu): q_abs in bf16, the
                // latent attention, then W_UV. The FP8 entry fixes rank 512 and rope 64 (CacheGeometry).
                let qb = ws.take::<u16>(&s, rows * heads * sparse_mla::DQK)?;
                bf16_mma::absorb_q(g, &a.w_uk_t, q, qb, rows, heads, nope, rd, rank)?;
                let latent_out = ws.take::<f32>(&s, rows * heads * rank)?;
                let splits = sparse_mla::max_splits(topk, sparse_mla::SPLIT_TILES);
                let (part_o, part_lse) = if splits > 1 {
                    (ws.take::<f32>(&s, rows * splits * heads * rank)?, ws.take::<f32>(&s, rows * splits * heads)?)
                } else {
                    (0, 0)
                };
                // Prefill within STAGE_BYTES: this layer's context rows converted once (the chunk's own entries
                // were written above), then the staged form, which gives the gathering form's bits.
                // `inputs` builds the staged rows for prefill calls only.
                let staged = match inp.stage {
                    Some((slots, n, row0)) => {
                        let buf = ws.take::<u16>(&s, n * sparse_mla::DQK)?;
                        sparse_mla::stage(g, latent_region, geometry.num_blocks, slots, n, buf)?;
                        self.staged_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Some((buf, n, row0))
                    }
                    _ => None,
                };
                // A launch takes up to 65535 queries (a grid dimension): long prefill chunks in pieces, each
                // query the same work whatever piece it is in.
                const QUERIES: usize = 32_768;
                for q0 in (0..rows).step_by(QUERIES) {
                    let n = QUERIES.min(rows - q0);
                    let (at4, at2) = ((q0 * 4) as u64, (q0 * heads * sparse_mla::DQK * 2) as u64);
                    let args = sparse_mla::RawArgs {
                        q: qb + at2,
                        queries: n,
                        heads,
                        latent: latent_region,
                        num_blocks: geometry.num_blocks,
                        block_table: inp.tables + at4 * inp.table_width as u64,
                        max_blocks: inp.table_width,
                        query_row: 0,
                        ctx_len: inp.lengths + at4,
                        sel: sel + at4 * topk as u64,
                        topk,
                        // The top-k selects min(length, index_topk) positions, then -1.
                        sel_len: inp.lengths + at4,
                        split_tiles: sparse_mla::SPLIT_TILES,
                        scale,
                        out: latent_out + at4 * (heads * rank) as u64,
                        out_bf16: false,
                        lse: 0,
                        part_o: if part_o == 0 { 0 } else { part_o + at4 * (splits * heads * rank) as u64 },
                        part_lse: if part_lse == 0 { 0 } else { part_lse + at4 * (splits * heads) as u64 },
                    };
                    match staged {
                        Some((rows_ptr, n_rows, row0)) => sparse_mla::launch_staged(
                            g,
                            &args,
                            &sparse_mla::Staged { rows_ptr, rows: n_rows, row_base: row0 + at4 },
                        )?,
                        None => sparse_mla::launch(g, &args)?,
                    }
                }
                bf16_mma::up_v(g, &a.w_uv, latent_out, o, rows, heads, rank, vd)?;
            }
            _ => {
                // The f32 decode reads f32 weights (bf16 ones exist only for the FP8 path above).
                if a.w_uk_t.is_bf16() || a.w_uv.is_bf16() {
                    return Err(CudaError::Shape("the f32 MLA decode needs f32 absorbed weights".into()).into());
                }
                let smem = ((2 * rank + rd + topk) * 4) as u32;
                launch(
                    g,
                    "tandem_mla_decode",
                    (heads as u32, rows as u32, 1),
                    256,
                    smem,
                    &[
                        Arg::P(q),
                        Arg::P(a.w_uk_t.ptr()),
                        Arg::P(a.w_uv.ptr()),
                        Arg::P(sel),
                        Arg::I(topk as i32),
                        Arg::P(inp.tables),
                        Arg::I(inp.table_width as i32),
                        Arg::P(latent_region),
                        Arg::I(fp8 as i32),
                        Arg::P(o),
                        Arg::I(heads as i32),
                        Arg::I(nope as i32),
                        Arg::I(rd as i32),
                        Arg::I(rank as i32),
                        Arg::I(vd as i32),
                        Arg::F(scale),
                    ],
                )?;
            }
        }
        let attn_out = ws.take::<f32>(&s, rows * hidden)?;
        a.o.forward(g, ws, o, rows, 1, 0, attn_out)?;
        self.add(h, attn_out, rows * hidden)?;
        Ok(())
    }

    /// One decoder layer (cache layer `li`) over the batch, updating the residual stream `h` in place.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        ws: &mut Workspace,
        inp: &Inputs,
        layer: &DLayer,
        li: LayerIdx,
        geometry: &CacheGeometry,
        pool: u64,
        form: AttnForm,
        h: u64,
        on_layer: LayerDone<'_>,
    ) -> Result<(), EngineError> {
        self.attention(ws, inp, layer, li, geometry, pool, form, h, on_layer)?;
        let (s, rows, hidden) = (self.stream(), inp.rows, self.cfg.hidden_size);
        let x2 = self.ffn_input(ws, layer, h, rows)?;
        let f = ws.take::<f32>(s, rows * hidden)?;
        self.ffn(ws, &layer.ffn, x2, rows, inp.real_rows, f)?;
        self.add(h, f, rows * hidden)?;
        Ok(())
    }

    /// The feed-forward block's input: `h [rows, hidden]` normed.
    fn ffn_input(&self, ws: &mut Workspace, layer: &DLayer, h: u64, rows: usize) -> Result<u64, CudaError> {
        let hidden = self.cfg.hidden_size;
        let x2 = ws.take::<f32>(self.stream(), rows * hidden)?;
        self.rms_norm(h, hidden, &layer.ffn_norm, x2, hidden, rows)?;
        Ok(x2)
    }

    /// Final norm of every row (the hidden output) and logits of the rows each item asks for.
    fn finish(
        &self,
        ws: &mut Workspace,
        items: &[Item<'_>],
        h: u64,
        norm: &DBuf<f32>,
        head: &DLinear,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let s = self.stream();
        let hidden = self.cfg.hidden_size;
        let rows: usize = items.iter().map(|it| it.n).sum();
        let normed = Arc::new(DBuf::<f32>::zeros(s, rows * hidden)?);
        self.rms_norm(h, hidden, norm, normed.ptr(), hidden, rows)?;
        let want: Vec<i32> = items.iter().flat_map(|it| it.logits_rows()).map(|r| r as i32).collect();
        let vocab = head.out_features();
        let logits = Arc::new(DBuf::<f32>::zeros(s, want.len() * vocab)?);
        if !want.is_empty() {
            let idx = ws.upload(s, &want)?;
            let gathered = ws.take::<f32>(s, want.len() * hidden)?;
            launch(
                &self.gpu,
                "tandem_gather_rows",
                (want.len() as u32, 1, 1),
                256,
                0,
                &[Arg::P(normed.ptr()), Arg::P(idx), Arg::P(gathered), Arg::I(hidden as i32)],
            )?;
            head.forward(&self.gpu, ws, gathered, want.len(), 1, 0, logits.ptr())?;
        }
        let ordinal = self.gpu.info().ordinal;
        let mut at = 0;
        Ok(items
            .iter()
            .map(|it| {
                let n_logits = it.logits_rows().len();
                let l = GpuRows { buf: logits.clone(), offset: at * vocab, ordinal };
                at += n_logits;
                let hr = GpuRows { buf: normed.clone(), offset: it.row0 * hidden, ordinal };
                SeqOutput { logits: DeviceRows::new(n_logits, vocab, l), hidden: DeviceRows::new(it.n, hidden, hr) }
            })
            .collect())
    }

    fn run_main(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let g = cache.geometry();
        // Under expert parallelism a rank with nothing to run (or a batch it refuses) still joins the pass.
        let checked = self.check_cache(cache).and_then(|pool| Ok((pool, main_items(&self.cfg, g.num_blocks, batch)?)));
        let (pool, items) = match checked {
            Ok((pool, items)) if !items.is_empty() => (pool, items),
            other => {
                self.ep_idle(Pass::main(form))?;
                return other.map(|_| Vec::new());
            }
        };
        self.ep_enter(Pass::main(form))?;
        let mut run = || -> Result<Vec<SeqOutput>, EngineError> {
            let pass = Pass::main(form);
            let mut ws = self.begin(&items, pass)?;
            let dbo = self.dbo_applies(pass);
            let pad = self.pass_shape(&items, form, pass)?;
            let mut tokens: Vec<i32> = batch.iter().flat_map(|b| b.tokens.iter().map(|&t| t as i32)).collect();
            if let Some(p) = pad {
                tokens.resize(p.rows, 0);
            }
            self.gpu.busy().begin(self.stream());
            let h = self.embed(&mut ws, &self.w.embed, &tokens, None)?;
            if dbo {
                // Two micro-batches: the rows halved (an item may straddle them: its later rows read the
                // earlier ones' cache entries, written first).
                let rows = tokens.len();
                let half = rows.div_ceil(2);
                let (a, b) = split_items(&items, half);
                let mut ws_b = self.ws_b.lock().unwrap_or_else(|p| p.into_inner());
                ws_b.reset();
                // A graphed pass pads each half to its rows (the second may be padding alone, attending to
                // the first request's first block).
                let pads = pad.map(|p| (Pad { rows: half, ..p }, Pad { rows: rows - half, ..p }));
                let fill = items.first().and_then(|it| it.blocks.first()).copied();
                let inp_a = self.inputs(&mut ws, &a, form, pads.map(|p| p.0))?;
                let inp_b = match pads {
                    Some((_, pb)) if pb.rows > 0 => Some(self.padded_inputs(&mut ws_b, &b, form, Some(pb), fill)?),
                    _ if b.is_empty() => None,
                    _ => Some(self.inputs(&mut ws_b, &b, form, None)?),
                };
                let hidden = self.cfg.hidden_size;
                let micro = [
                    Micro { inp: Some(&inp_a), rows: half, h },
                    Micro { inp: inp_b.as_ref(), rows: rows - half, h: h + (half * hidden * 4) as u64 },
                ];
                let both = |ws: &mut Workspace, ws_b: Option<&mut Workspace>| -> Result<(), EngineError> {
                    let ws_b = ws_b
                        .ok_or_else(|| EngineError::Device("an overlapped pass without its second workspace".into()))?;
                    self.overlapped(ws, ws_b, pass, &micro, Some((g, pool, form)), on_layer)
                };
                self.graphed(&mut ws, Some(&mut ws_b), GraphPass::Main, pad, form, g, pool, both)?;
            } else {
                let inp = self.inputs(&mut ws, &items, form, pad)?;
                // A layer's intermediates are dead once its last kernel is issued (the residual stream `h` and
                // the inputs were taken before): every layer reuses the same workspace bytes, so a call holds
                // one layer's (`activation_bytes`), not 61.
                let mark = ws.mark();
                let layers = |ws: &mut Workspace, _: Option<&mut Workspace>| -> Result<(), EngineError> {
                    for (l, layer) in self.w.layers.iter().enumerate() {
                        self.layer(ws, &inp, layer, LayerIdx(l as u32), g, pool, form, h, on_layer)?;
                        ws.rewind(mark);
                    }
                    Ok(())
                };
                self.graphed(&mut ws, None, GraphPass::Main, pad, form, g, pool, layers)?;
            }
            let out = self.finish(&mut ws, &items, h, &self.w.norm, &self.w.lm_head)?;
            self.gpu.busy().end(self.stream());
            self.ep_step_issued()?;
            Ok(out)
        };
        self.ep_fail_fast(run())
    }

    /// [`Backend::decode_whole_step`] on the device: the main pass, its final norm and logits, the samples of
    /// rows 0 and 1 (two launches: row 1's history holds row 0's token, read on the device, and its CTA leaves at
    /// once where that token is not the draft), the MTP layer over every fed row with the tokens sampled there,
    /// and the drafts, issued as one sequence ([`issue_step`](Self::issue_step)); with a graph shape
    /// (engine::cuda::graphs) that sequence is one CUDA graph, replayed where captured. Per-step values (tokens,
    /// positions, slots, block tables, scorer groups, the samplers' records) are uploaded before it into
    /// buffers whose addresses follow from the shape ([`step_buffers`](Self::step_buffers)); the samplers'
    /// edits and scratch are per-step buffers the records point to. One read-back at the end.
    fn whole_step(
        &self,
        cache: &KvCache,
        batch: &[StepInput<'_>],
        eos: &[u32],
    ) -> Result<Vec<StepSamples>, EngineError> {
        let g = cache.geometry();
        let pool = self.check_cache(cache)?;
        let seq_in: Vec<SeqInput<'_>> = batch
            .iter()
            .map(|b| SeqInput { tokens: b.tokens, start: b.start, blocks: b.blocks, logits: Logits::All })
            .collect();
        let items = main_items(&self.cfg, g.num_blocks, &seq_in)?;
        if let Some(i) = items.iter().position(|it| it.n > graphs::MAX_ROWS_PER_REQUEST) {
            return Err(EngineError::InvalidInput(format!("step item {i}: {} tokens (1 or 2)", items[i].n)));
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let form = AttnForm::Decode;
        let mut ws = self.begin(&items, Pass::main(form))?;
        let pad = self.graph_shape(&items, form);
        let s = self.stream().clone();
        self.gpu.busy().begin(&s);
        let (bufs, staged) = self.step_buffers(&mut ws, &items, batch, pad, eos)?;
        self.graphed(&mut ws, None, GraphPass::Step, pad, form, g, pool, |ws, _| self.issue_step(ws, &bufs, g, pool))?;
        self.gpu.busy().end(&s);
        let rows = bufs.rows;
        let has_mtp = self.w.mtp.is_some();
        let mut drafts = vec![0u32; 2 * rows];
        if has_mtp {
            // SAFETY: `draft_out` holds 2 x rows words (taken in step_buffers); the copy is stream-ordered after
            // the drafts, and `staged.read` below waits for the stream before `drafts` is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut drafts, bufs.draft_out, s.cu_stream()) }
                .map_err(dev)?;
        }
        let got = staged.read(&self.gpu)?;
        let outcome = |slot: usize| -> Result<Sampled, EngineError> {
            let i = staged.result_of(slot).ok_or_else(|| EngineError::Device(format!("no sample in slot {slot}")))?;
            Ok(super::sample::warn_fallback(got[i].clone()))
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, (it, b)) in items.iter().zip(batch).enumerate() {
            let first = outcome(it.row0)?;
            // Row 1 was sampled only where row 0's token is the draft.
            let second = match b.tokens.get(1) {
                Some(&draft) if first.token == draft => Some(outcome(rows + it.row0 + 1)?),
                _ => None,
            };
            // One draft a request, from the row of its last kept token (`tandem_step_draft_rows`).
            let draft = has_mtp.then(|| (drafts[2 * i], f32::from_bits(drafts[2 * i + 1])));
            out.push(StepSamples { first, second, draft });
        }
        Ok(out)
    }

    /// A whole step's device buffers over `items` (rows padded to `pad`): what [`issue_step`](Self::issue_step)
    /// reads and writes, taken from the workspace in the same order every step so that their addresses
    /// follow from the shape, with the per-step values uploaded; and the samplers' staged records (their
    /// edits, scratch and results live in the returned [`super::sample::Staged`]).
    fn step_buffers(
        &self,
        ws: &mut Workspace,
        items: &[Item<'_>],
        batch: &[StepInput<'_>],
        pad: Option<Pad>,
        eos: &[u32],
    ) -> Result<(StepBuffers, super::sample::Staged), EngineError> {
        let s = self.stream();
        let real: usize = items.iter().map(|it| it.n).sum();
        let rows = pad.map_or(real, |p| p.rows);
        let (hidden, vocab) = (self.cfg.hidden_size, self.w.lm_head.out_features());
        let mut tokens: Vec<i32> = batch.iter().flat_map(|b| b.tokens.iter().map(|&t| t as i32)).collect();
        tokens.resize(rows, 0);
        let tok = ws.upload(s, &tokens)?;
        let inp = self.inputs(ws, items, AttnForm::Decode, pad)?;
        let normed = ws.take::<f32>(s, rows * hidden)?;
        let logits = ws.take::<f32>(s, rows * vocab)?;
        // The tokens sampled at each row (the MTP layer's input); padding rows read token 0, zeroed.
        let sampled = ws.upload(s, &vec![0i32; rows])?;
        let mut zero: Vec<i32> =
            items.iter().flat_map(|it| (0..it.n).map(move |i| (it.start + i == 0) as i32)).collect();
        zero.resize(rows, 1);
        let zero = ws.upload(s, &zero)?;
        let row_at = |r: usize| logits + (r * vocab * 4) as u64;
        let draft_rows = ws.upload(s, &(0..rows).map(row_at).collect::<Vec<u64>>())?;
        let draft_out = ws.take::<u32>(s, 2 * rows)?;
        // Each request's draft comes from the MTP row of its last kept token, chosen on the device
        // (`tandem_step_draft_rows`): its first row, its second (-1: none) and its draft token (-1: none), then
        // the requests' count; the MTP head runs over that many gathered rows.
        let mut head_first = vec![0i32; rows];
        let mut head_second = vec![-1i32; rows];
        let mut head_draft = vec![-1i32; rows];
        for (i, (it, b)) in items.iter().zip(batch).enumerate() {
            head_first[i] = it.row0 as i32;
            if it.n == 2 {
                head_second[i] = it.row0 as i32 + 1;
                head_draft[i] = b.tokens[1] as i32;
            }
        }
        let head_first = ws.upload(s, &head_first)?;
        let head_second = ws.upload(s, &head_second)?;
        let head_draft = ws.upload(s, &head_draft)?;
        let head_count = ws.upload(s, &[items.len() as i32])?;
        let head_idx = ws.take::<i32>(s, rows)?;
        // Records: rows of the first launch (each item's row 0), then of the second (row 1 of items with a
        // draft, after row 0's token, sampled only where that token is the draft).
        let mut slots: Vec<Option<super::sample::SlotRow<'_>>> = (0..2 * rows).map(|_| None).collect();
        let token_at = |r: usize| sampled + 4 * r as u64;
        for (b, it) in batch.iter().zip(items) {
            let req =
                |r: usize| super::sample::RowRequest { row: row_at(r), n: vocab, params: b.params, history: b.history };
            slots[it.row0] =
                Some(super::sample::SlotRow { req: req(it.row0), prev: 0, expect: None, token_out: token_at(it.row0) });
            if it.n == 2 {
                slots[rows + it.row0 + 1] = Some(super::sample::SlotRow {
                    req: req(it.row0 + 1),
                    prev: token_at(it.row0),
                    expect: Some(b.tokens[1]),
                    token_out: token_at(it.row0 + 1),
                });
            }
        }
        // Two launches of `rows` records: the second runs after the first, so they share the scratch.
        let staged = super::sample::stage(&self.gpu, &slots, rows, eos)?;
        let records = ws.upload(s, &staged.records)?;
        let heads =
            StepHeads { first: head_first, second: head_second, draft: head_draft, count: head_count, idx: head_idx };
        let bufs = StepBuffers { rows, tok, inp, normed, logits, sampled, zero, draft_rows, draft_out, records, heads };
        Ok((bufs, staged))
    }

    /// The launches of a whole step over `b` ([`whole_step`](Self::whole_step)); leaves the workspace where it
    /// found it. The same sequence whether run or captured.
    fn issue_step(&self, ws: &mut Workspace, b: &StepBuffers, g: &CacheGeometry, pool: u64) -> Result<(), EngineError> {
        let (s, rows, hidden) = (self.stream().clone(), b.rows, self.cfg.hidden_size);
        let vocab = self.w.lm_head.out_features();
        let form = AttnForm::Decode;
        let mark = ws.mark();
        let h = ws.take::<f32>(&s, rows * hidden)?;
        self.embed_rows(&self.w.embed, b.tok, 0, h, rows)?;
        let layers_at = ws.mark();
        for (l, layer) in self.w.layers.iter().enumerate() {
            self.layer(ws, &b.inp, layer, LayerIdx(l as u32), g, pool, form, h, &mut |_, _| {})?;
            ws.rewind(layers_at);
        }
        self.rms_norm(h, hidden, &self.w.norm, b.normed, hidden, rows)?;
        self.w.lm_head.forward(&self.gpu, ws, b.normed, rows, 1, 0, b.logits)?;
        let record = super::sample::RECORD_BYTES as u64;
        super::sample::launch_records(&self.gpu, b.records, rows)?;
        super::sample::launch_records(&self.gpu, b.records + rows as u64 * record, rows)?;
        if let Some(mtp) = self.w.mtp.as_ref() {
            // [enorm(embedding of the sampled token) | hnorm(main hidden)] per row, then the MTP layer.
            let emb = ws.take::<f32>(&s, rows * hidden)?;
            self.embed_rows(mtp.embed.as_ref().unwrap_or(&self.w.embed), b.sampled, b.zero, emb, rows)?;
            let cat = ws.take::<f32>(&s, rows * 2 * hidden)?;
            self.rms_norm(emb, hidden, &mtp.enorm, cat, 2 * hidden, rows)?;
            self.rms_norm(b.normed, hidden, &mtp.hnorm, cat + (hidden * 4) as u64, 2 * hidden, rows)?;
            let h2 = ws.take::<f32>(&s, rows * hidden)?;
            mtp.eh_proj.forward(&self.gpu, ws, cat, rows, 1, 0, h2)?;
            let li = LayerIdx(self.cfg.num_hidden_layers as u32);
            self.layer(ws, &b.inp, &mtp.layer, li, g, pool, form, h2, &mut |_, _| {})?;
            self.rms_norm(h2, hidden, &mtp.head_norm, b.normed, hidden, rows)?;
            // The head over one row a request (the row of its last kept token), gathered to the front.
            let hd = &b.heads;
            launch(
                &self.gpu,
                "tandem_step_draft_rows",
                (1, 1, 1),
                512,
                0,
                &[
                    Arg::P(b.sampled),
                    Arg::P(hd.first),
                    Arg::P(hd.second),
                    Arg::P(hd.draft),
                    Arg::P(hd.count),
                    Arg::I(rows as i32),
                    Arg::P(hd.idx),
                ],
            )?;
            // Into the embedding's rows (dead since enorm wrote `cat`): the step's workspace peak stays the
            // MTP layer's.
            let gathered = emb;
            launch(
                &self.gpu,
                "tandem_gather_rows",
                (rows as u32, 1, 1),
                256,
                0,
                &[Arg::P(b.normed), Arg::P(hd.idx), Arg::P(gathered), Arg::I(hidden as i32)],
            )?;
            let head = mtp.head.as_ref().unwrap_or(&self.w.lm_head);
            head.forward_first(&self.gpu, ws, gathered, rows, hd.count, b.logits)?;
            launch(
                &self.gpu,
                "tandem_draft_rows",
                (rows as u32, 1, 1),
                super::sample::THREADS,
                0,
                &[Arg::P(b.draft_rows), Arg::I(vocab as i32), Arg::P(b.draft_out), Arg::P(hd.count)],
            )?;
        }
        ws.rewind(mark);
        Ok(())
    }

    /// The whole-step graph shapes serving at `limits` with requests up to `max_len` positions can meet: every
    /// padded row count up to two rows a sequence (the token and the draft) and `max_num_batched_tokens` by
    /// every block-table width up to `max_len` positions' ([`graph_shape`](Self::graph_shape)'s rule).
    fn step_shapes(&self, limits: &ServingLimits, max_len: usize) -> Vec<Pad> {
        let most = (graphs::MAX_ROWS_PER_REQUEST * limits.max_num_seqs).min(graphs::MAX_ROWS);
        // Buckets past max_num_batched_tokens are exact row counts (graph_shape): captured on their first step,
        // not here (there could be hundreds).
        let mut rows: Vec<usize> =
            (1..=most).filter_map(graphs::row_bucket).filter(|&b| b <= limits.max_num_batched_tokens).collect();
        rows.dedup();
        let widest = graphs::width_bucket(max_len.max(1).div_ceil(BLOCK_SIZE));
        let widths: Vec<usize> = std::iter::successors(Some(1usize), |w| (*w < widest).then_some(w * 2)).collect();
        rows.iter().flat_map(|&r| widths.iter().map(move |&w| Pad { rows: r, width: w })).collect()
    }

    /// Captures the whole-step graph of every shape serving can meet ([`step_shapes`](Self::step_shapes)) before
    /// serving (`Backend::prepare_decode`): per row count, one eager step at the widest shape grows the
    /// workspace to what the shapes take (its rows write no cache entry: every slot is -1), then each width is
    /// captured without running. The inputs are a dummy request's; a graph reads its inputs from the shape's
    /// buffers, which each step fills.
    fn capture_steps(
        &self,
        cache: &KvCache,
        limits: &ServingLimits,
        max_len: usize,
    ) -> Result<Option<crate::DecodeGraphs>, EngineError> {
        if !self.captures_at_startup() {
            return Ok(None);
        }
        let g = cache.geometry();
        let pool = self.check_cache(cache)?;
        let shapes = self.step_shapes(limits, max_len.min(g.num_blocks * BLOCK_SIZE));
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).reserve(shapes.len(), self.graph_bytes_each());
        let params = SamplingParams::greedy(1);
        let t0 = std::time::Instant::now();
        let mut grown_for = None;
        // Widest first within a row count: the eager step that grows the workspace takes the most.
        let mut order = shapes.clone();
        order.sort_by_key(|p| (p.rows, std::cmp::Reverse(p.width)));
        for pad in order {
            // One request of one row whose table is `width` entries of block 0, at the table's last position.
            let blocks = vec![BlockId(0); pad.width];
            let tokens = [0u32];
            let batch = [StepInput {
                tokens: &tokens,
                start: pad.width * BLOCK_SIZE - 1,
                blocks: &blocks,
                params: &params,
                history: History { prompt: &[], output: &[] },
            }];
            let item = Item { start: batch[0].start, n: 1, row0: 0, blocks: &blocks, logits: Logits::All };
            let mut ws = self.begin(std::slice::from_ref(&item), Pass::main(AttnForm::Decode))?;
            let (bufs, _staged) = self.step_buffers(&mut ws, std::slice::from_ref(&item), &batch, Some(pad), &[])?;
            let s = self.stream();
            // SAFETY: `slots` holds `rows` i64 (uploaded in `inputs`); all bytes 0xff make each -1 (no cache write).
            unsafe { cudarc::driver::result::memset_d8_async(bufs.inp.slots, 0xff, bufs.rows * 8, s.cu_stream()) }
                .map_err(dev)?;
            let mark = ws.mark();
            if grown_for != Some(pad.rows) {
                self.issue_step(&mut ws, &bufs, g, pool)?;
                ws.rewind(mark);
                grown_for = Some(pad.rows);
            }
            let key = self.graph_key(&ws, None, GraphPass::Step, pad, g, pool);
            // A shape whose capture fails (its workspace outgrew the widest shape's) grows it in one eager step
            // and is captured again; a second failure leaves it to its first serving step.
            for attempt in 0..2 {
                ws.set_frozen(true);
                let captured = self
                    .graphs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .capture(s, key, || self.issue_step(&mut ws, &bufs, g, pool));
                ws.set_frozen(false);
                ws.rewind(mark);
                captured?;
                let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
                if graphs.is_captured(&key) {
                    break;
                }
                graphs.forget(&key);
                drop(graphs);
                if attempt == 0 {
                    let grown = self.issue_step(&mut ws, &bufs, g, pool);
                    ws.rewind(mark);
                    if let Err(e) = grown {
                        tracing::warn!(?key, error = %e, "a decode step shape could not be prepared; its first step captures it");
                        break;
                    }
                }
            }
        }
        self.stream().synchronize().map_err(dev)?;
        let stats = self.graph_stats();
        tracing::info!(
            shapes = shapes.len(),
            held = stats.held,
            bytes = stats.bytes,
            seconds = t0.elapsed().as_secs_f64(),
            "decode steps captured as CUDA graphs"
        );
        Ok(Some(stats))
    }

    /// The captured graphs' share of the memory budget: [`graphs::GRAPH_BYTES`], or where a decode worker
    /// captures its whole-step shapes before serving (`limits.decode_graphs`), their estimate for requests of
    /// that length (a smaller pool captures fewer).
    fn graph_budget(&self, limits: &ServingLimits) -> u64 {
        if !self.graphs.lock().unwrap_or_else(|p| p.into_inner()).enabled() {
            return 0;
        }
        let shapes = match limits.decode_graphs {
            Some(max_len) if self.captures_at_startup() => self.step_shapes(limits, max_len).len(),
            _ => 0,
        };
        graphs::GRAPH_BYTES.max(shapes as u64 * self.graph_bytes_each())
    }

    /// Whether [`prepare_decode`](Backend::prepare_decode) captures the whole-step graphs: graphs and whole
    /// steps on, no expert parallelism, nothing that keeps steps eager (recorded selections, the kernel
    /// profiler), and `TANDEM_GRAPH_CAPTURE` not `lazy`.
    fn captures_at_startup(&self) -> bool {
        graphs::capture_at_startup()
            && self.whole_steps()
            && self.selections.is_none()
            && !self.gpu.profiler().is_on()
            && self.graphs.lock().unwrap_or_else(|p| p.into_inner()).enabled()
    }

    /// The key of the graph of `pass` at shape `pad`, its layers starting at the workspace's current mark.
    fn graph_key(
        &self,
        ws: &Workspace,
        second: Option<&Workspace>,
        pass: GraphPass,
        pad: Pad,
        g: &CacheGeometry,
        pool: u64,
    ) -> GraphKey {
        GraphKey {
            pass,
            rows: pad.rows,
            width: pad.width,
            pool,
            num_blocks: g.num_blocks,
            num_layers: g.num_layers,
            mark: ws.address(ws.mark()),
            cap: if self.ep.is_some() { self.ep_cap.load(std::sync::atomic::Ordering::Relaxed) } else { 0 },
            dbo: second.is_some(),
            mark_b: second.map_or(0, |b| b.address(b.mark())),
        }
    }

    /// Device memory one whole-step graph is expected to hold (the memory budget's estimate): about 3 KiB a
    /// node, 48 nodes a layer (measured on an H200: 5.2 MiB for the 62 layers of the synthetic model's graphs).
    fn graph_bytes_each(&self) -> u64 {
        graph_bytes(self.w.layers.len() + usize::from(self.w.mtp.is_some()))
    }

    /// Starts a call over `items` (not empty): the context bound to this thread, the workspace reset (the
    /// caller uploads the call's inputs: the whole batch's, or each micro-batch's).
    /// Under expert parallelism, the call's capacity agreed with the other ranks first (engine::cuda::ep;
    /// [`ep_enter`](Self::ep_enter) before).
    fn begin(&self, items: &[Item<'_>], pass: Pass) -> Result<MutexGuard<'_, Workspace>, EngineError> {
        self.gpu.context().bind_to_thread().map_err(dev)?;
        let mut ws = self.ws.lock().unwrap_or_else(|p| p.into_inner());
        ws.reset();
        if let Some(ep) = &self.ep {
            let rows = items.iter().map(|it| it.n).sum();
            let most = match self.ep_step.planned(pass) {
                // An agreed step: its passes need no agreement, but may not bring more rows than agreed.
                Some(most) if rows <= most => {
                    ep.arm();
                    most
                }
                Some(most) => {
                    return Err(EngineError::InvalidInput(format!(
                        "the {pass:?} pass brings {rows} rows; the step agreed on at most {most}"
                    )));
                }
                None => ep.agree(rows, pass)?,
            };
            self.ep_cap.store(ep::capacity(most), std::sync::atomic::Ordering::Relaxed);
            self.ep_most.store(most, std::sync::atomic::Ordering::Relaxed);
            self.ep_step.mark_busy();
        }
        Ok(ws)
    }

    /// A rank's share of `pass` without rows of its own (expert parallelism; nothing otherwise), in its
    /// place in the step ([`ep_enter`](Self::ep_enter)).
    fn ep_idle(&self, pass: Pass) -> Result<(), EngineError> {
        self.ep_enter(pass)?;
        if self.ep_join_empty(pass)? {
            self.ep_step.mark_busy();
        }
        Ok(())
    }

    /// Before this rank issues `pass` (expert parallelism; nothing otherwise): the passes of the step it
    /// skips are joined empty, or the last step is completed first (crate::lockstep::Steps).
    fn ep_enter(&self, pass: Pass) -> Result<(), EngineError> {
        if self.ep.is_none() {
            return Ok(());
        }
        self.ep_step.enter(pass, &mut |p| self.ep_join_empty(p))
    }

    /// `pass` with an empty batch: the agreement, then every MoE layer of the pass, computing the other
    /// ranks' pairs on this rank's experts; the agreement alone where every rank is idle. A model without
    /// an MTP layer has no MTP pass. Whether some rank had rows.
    fn ep_join_empty(&self, pass: Pass) -> Result<bool, EngineError> {
        let Some(ep) = &self.ep else { return Ok(false) };
        if pass == Pass::Mtp && self.w.mtp.is_none() {
            return Ok(false);
        }
        let planned = self.ep_step.planned(pass);
        if planned == Some(0) {
            // An agreed step in which no rank has rows for this pass: skipped by every rank.
            return Ok(false);
        }
        let run = || -> Result<bool, EngineError> {
            self.gpu.context().bind_to_thread().map_err(dev)?;
            let mut ws = self.ws.lock().unwrap_or_else(|p| p.into_inner());
            ws.reset();
            let most = match planned {
                Some(most) => {
                    ep.arm();
                    most
                }
                None => ep.agree(0, pass)?,
            };
            if most == 0 {
                // Every rank is idle: no rank has a pair to exchange, so the pass is the agreement alone.
                self.ep_step_issued()?;
                return Ok(false);
            }
            self.ep_cap.store(ep::capacity(most), std::sync::atomic::Ordering::Relaxed);
            self.ep_most.store(most, std::sync::atomic::Ordering::Relaxed);
            // Without rows the pass is not captured on any rank (it runs eagerly everywhere).
            self.ep_join_graph(ep, pass)?;
            if self.dbo_applies(pass) {
                // The others run two micro-batches: this rank joins both, empty, in the same order.
                let mut ws_b = self.ws_b.lock().unwrap_or_else(|p| p.into_inner());
                ws_b.reset();
                let none = Micro { inp: None, rows: 0, h: 0 };
                self.overlapped(&mut ws, &mut ws_b, pass, &[none, none], None, &mut |_, _| {})?;
                self.ep_step_issued()?;
                return Ok(true);
            }
            let layers: Vec<&DLayer> = match pass {
                Pass::Main | Pass::MainPrefill => self.w.layers.iter().map(|l| &**l).collect(),
                Pass::Mtp => self.w.mtp.iter().map(|m| &m.layer).collect(),
            };
            let mark = ws.mark();
            for l in layers.into_iter().filter(|l| matches!(l.ffn, DFfn::Moe(_))) {
                self.ffn(&mut ws, &l.ffn, 0, 0, 0, 0)?;
                ws.rewind(mark);
            }
            self.ep_step_issued()?;
            Ok(true)
        };
        self.ep_fail_fast(run())
    }

    /// Whether the running call's `pass` runs as two overlapped micro-batches (the agreed most rows decide,
    /// so every rank does the same). Off while selections are recorded (a diagnostic that reads every
    /// layer's rows in order).
    fn dbo_applies(&self, pass: Pass) -> bool {
        self.ep.is_some()
            && self.dbo.applies(pass, self.ep_most.load(std::sync::atomic::Ordering::Relaxed), self.local_experts)
    }

    /// Whether any pass may run overlapped: `on`, or `auto` with thresholds this group can reach.
    fn dbo_possible(&self) -> bool {
        self.ep.is_some()
            && match self.dbo {
                ep::Dbo::Off => false,
                ep::Dbo::On => true,
                ep::Dbo::Auto { decode_rows, prefill_rows } => {
                    self.local_experts <= ep::DBO_MAX_LOCAL_EXPERTS
                        && (decode_rows < usize::MAX || prefill_rows < usize::MAX)
                }
            }
    }

    /// The main model's layers over two micro-batches with dual-batch overlap (docs/model.md §5.3): every
    /// MoE layer's exchanges run on the group's second stream ([`ep::Lane::Comm`]) while the main stream
    /// computes the other micro-batch. Per MoE layer, in issue order on the main stream:
    ///
    /// `front A (attention, routing, shared expert)` - `finish B of the layer before` - `front B` -
    /// `experts A` - `experts B` - `finish A (combine)`
    ///
    /// and on the second stream `dispatch A`, `dispatch B`, `combine A`, `combine B` (the same order on every
    /// rank; each waits for its micro-batch's main-stream work by an event, and the main stream waits for
    /// each by an event before using it). So A's dispatch runs under B's attention, B's dispatch under A's
    /// experts, A's combine under B's experts, and B's combine under the next layer's attention of A. A
    /// micro-batch's rows are independent of the other's (the kernels are batch-invariant), so the output
    /// equals the single pass's bit for bit. Each micro-batch has its own workspace, rewound once its layer
    /// has finished (every exchange that read it is then done). `attn` is None for a rank without rows (it
    /// joins both micro-batches' exchanges).
    #[allow(clippy::too_many_arguments)]
    fn overlapped(
        &self,
        ws_a: &mut Workspace,
        ws_b: &mut Workspace,
        pass: Pass,
        micro: &[Micro<'_>; 2],
        attn: Option<(&CacheGeometry, u64, AttnForm)>,
        on_layer: LayerDone<'_>,
    ) -> Result<(), EngineError> {
        let Some(ep) = &self.ep else {
            return Err(EngineError::InvalidInput("dual-batch overlap needs a group".into()));
        };
        let c = &self.cfg;
        let s = self.stream().clone();
        let hidden = c.hidden_size;
        let most = self.ep_most.load(std::sync::atomic::Ordering::Relaxed);
        // Each micro-batch at the capacity of the largest rank's half (every rank's halves fit it, a graphed
        // pass's padded halves too: they are at most half the full capacity).
        self.ep_cap.store(ep::capacity(ep::capacity(most).div_ceil(2)), std::sync::atomic::Ordering::Relaxed);
        let layers: Vec<&DLayer> = match pass {
            Pass::Main | Pass::MainPrefill => self.w.layers.iter().map(|l| &**l).collect(),
            Pass::Mtp => return Err(EngineError::InvalidInput("the MTP pass is not overlapped".into())),
        };
        // The cache callback once a layer, after the later micro-batch's cache writes (or the only one's).
        let last_rows = if micro[1].rows > 0 { 1 } else { 0 };
        let marks = [ws_a.mark(), ws_b.mark()];
        let wss = [ws_a, ws_b];
        // B's MoE layer awaiting its finish, and where its output goes.
        let mut pending: Option<(ep::Flight, u64)> = None;
        for (l, layer) in layers.iter().enumerate() {
            let li = LayerIdx(l as u32);
            let moe = match &layer.ffn {
                DFfn::Moe(m) => Some(&**m),
                DFfn::Dense(_) => None,
            };
            let mut flights: [Option<ep::Flight>; 2] = [None, None];
            for (i, mb) in micro.iter().enumerate() {
                if i == 1
                    && let Some((f, y)) = pending.take()
                {
                    // B's previous layer finishes once A's front is issued (its combine ran under it).
                    self.finish_micro(ep, 1, f, y, micro[1])?;
                }
                let ws = &mut *wss[i];
                ws.rewind(marks[i]);
                let front = || -> Result<Option<ep::Flight>, EngineError> {
                    if let (Some(inp), Some((g, pool, form))) = (mb.inp, attn)
                        && mb.rows > 0
                    {
                        let cb: LayerDone<'_> = if i == last_rows { &mut *on_layer } else { &mut |_, _| {} };
                        self.attention(ws, inp, layer, li, g, pool, form, mb.h, cb)?;
                    }
                    match moe {
                        Some(m) => {
                            let x2 = if mb.rows > 0 { self.ffn_input(ws, layer, mb.h, mb.rows)? } else { 0 };
                            let real = mb.inp.map_or(0, |inp| inp.real_rows);
                            Ok(Some(self.moe_front(ws, ep, m, x2, mb.rows, real, ep::Lane::Comm, i)?))
                        }
                        None if mb.rows > 0 => {
                            let x2 = self.ffn_input(ws, layer, mb.h, mb.rows)?;
                            let f = ws.take::<f32>(&s, mb.rows * hidden)?;
                            self.ffn(ws, &layer.ffn, x2, mb.rows, 0, f)?;
                            self.add(mb.h, f, mb.rows * hidden)?;
                            Ok(None)
                        }
                        None => Ok(None),
                    }
                };
                flights[i] = ep.timed(ep::Lane::Main, i, "front", front)?;
            }
            let [Some(mut fa), Some(mut fb)] = flights else { continue };
            for (i, f) in [&mut fa, &mut fb].into_iter().enumerate() {
                let ws = &mut *wss[i];
                ep.timed(ep::Lane::Main, i, "experts", || ep::moe_experts(&self.gpu, ws, ep, c, f))?;
            }
            let ya = wss[0].take::<f32>(&s, (micro[0].rows * hidden).max(1))?;
            self.finish_micro(ep, 0, fa, ya, micro[0])?;
            let yb = wss[1].take::<f32>(&s, (micro[1].rows * hidden).max(1))?;
            pending = Some((fb, yb));
        }
        if let Some((f, y)) = pending.take() {
            self.finish_micro(ep, 1, f, y, micro[1])?;
        }
        Ok(())
    }

    /// A micro-batch's MoE layer combined into `y` and added to its residual stream; the second
    /// micro-batch's marks the layer done for the host's pacing.
    fn finish_micro(&self, ep: &EpGroup, i: usize, f: ep::Flight, y: u64, mb: Micro<'_>) -> Result<(), EngineError> {
        ep.timed(ep::Lane::Main, i, "finish", || {
            ep::moe_finish(&self.gpu, ep, &self.cfg, f, y)?;
            if mb.rows > 0 {
                self.add(mb.h, y, mb.rows * self.cfg.hidden_size)?;
            }
            Ok::<_, EngineError>(())
        })?;
        if i == 1 {
            ep.layer_issued()?;
        }
        Ok(())
    }

    /// Under expert parallelism, the end of a call's work on the stream for the watchdog.
    fn ep_step_issued(&self) -> Result<(), EngineError> {
        if let Some(ep) = &self.ep {
            ep.step_issued()?;
        }
        Ok(())
    }

    /// Under expert parallelism, a call that failed after its agreement leaves the other ranks waiting in
    /// its collectives: the group is aborted at once (every rank's calls fail from then on). A failure
    /// because the group was already down (another rank lost, the watchdog) is [`EngineError::GroupDown`].
    /// This rank's own device failure stays a device error; any other error that aborted the group is the
    /// group's too: the worker must stop either way.
    fn ep_fail_fast<T>(&self, r: Result<T, EngineError>) -> Result<T, EngineError> {
        let (Err(e), Some(ep)) = (&r, &self.ep) else { return r };
        if let Some(why) = ep.is_down() {
            self.drop_graphs();
            return Err(EngineError::GroupDown(why));
        }
        let why = format!("a step failed on this rank after the ranks agreed on it: {e}");
        // The graphs first: the abort returns once they are gone.
        self.drop_graphs();
        ep.abort(&why);
        match r {
            Err(EngineError::Device(_)) => r,
            _ => Err(EngineError::GroupDown(why)),
        }
    }

    /// Results read back (logits, samples) after the group was aborted may come from collectives that never
    /// delivered their data: an error instead (expert parallelism; nothing otherwise).
    fn ep_outputs_valid(&self) -> Result<(), EngineError> {
        match self.ep.as_ref().and_then(EpGroup::is_down) {
            Some(why) => {
                self.drop_graphs();
                Err(EngineError::GroupDown(format!("this step's outputs are lost: {why}")))
            }
            None => Ok(()),
        }
    }

    /// Drops the captured decode graphs (the group is down, or about to be aborted on this thread): NCCL's
    /// abort of the communicator returns only once every graph holding its launches is destroyed
    /// (engine::cuda::ep; a graph still running is freed when it ends), and a down group replays none.
    fn drop_graphs(&self) {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// This rank's expert-parallel group, if it is one.
    pub fn ep_group(&self) -> Option<&EpGroup> {
        self.ep.as_ref()
    }

    /// Starts (or stops) recording the stages of overlapped passes (expert parallelism only; see
    /// [`EpGroup::take_timeline`]).
    pub fn record_timeline(&self, on: bool) {
        if let Some(ep) = &self.ep {
            ep.record_timeline(on);
        }
    }

    /// The stages recorded since the last call.
    pub fn take_timeline(&self) -> Result<Vec<ep::StageTime>, EngineError> {
        match &self.ep {
            Some(ep) => Ok(ep.take_timeline()?),
            None => Ok(Vec::new()),
        }
    }

    /// What expert-parallel load balancing has seen and done on this rank (expert parallelism only).
    pub fn eplb_stats(&self) -> Option<super::balance::EplbStats> {
        self.balancer.as_ref().map(super::balance::Balancer::stats)
    }

    /// The rows of embedding `table` for `tokens`; the rows that `zero` (one flag per row) marks are zeros.
    fn embed(
        &self,
        ws: &mut Workspace,
        table: &DBuf<f32>,
        tokens: &[i32],
        zero: Option<&[i32]>,
    ) -> Result<u64, EngineError> {
        let s = self.stream();
        let (rows, hidden) = (tokens.len(), self.cfg.hidden_size);
        let tok = ws.upload(s, tokens)?;
        let zero = match zero {
            Some(z) => ws.upload(s, z)?,
            None => 0,
        };
        let h = ws.take::<f32>(s, rows * hidden)?;
        self.embed_rows(table, tok, zero, h, rows)?;
        Ok(h)
    }

    /// `h [rows, hidden]` = the rows of `table` of the `rows` i32 tokens at `tok`, zeros where the i32 at `zero`
    /// (0: none) is not 0.
    fn embed_rows(&self, table: &DBuf<f32>, tok: u64, zero: u64, h: u64, rows: usize) -> Result<(), CudaError> {
        let hidden = self.cfg.hidden_size as i32;
        launch(
            &self.gpu,
            "tandem_embed",
            (rows as u32, 1, 1),
            256,
            0,
            &[Arg::P(table.ptr()), Arg::P(tok), Arg::P(zero), Arg::P(h), Arg::I(hidden)],
        )
    }

    /// One logits row as a device view.
    fn logits_row<'r>(
        &self,
        logits: &'r DeviceRows,
        row: usize,
    ) -> Result<cudarc::driver::CudaView<'r, f32>, EngineError> {
        let g = self.rows_of(logits)?;
        if row >= logits.rows() {
            return Err(EngineError::InvalidInput(format!("row {row} of {} rows", logits.rows())));
        }
        let w = logits.width();
        let at = g.offset + row * w;
        Ok(g.buf.slice().slice(at..at + w))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn set_kernel_profile(&self, on: bool) {
        self.gpu.profiler().set(on);
    }

    fn take_kernel_profile(&self) -> Result<Vec<crate::KernelTime>, EngineError> {
        Ok(self.gpu.profiler().take()?)
    }

    fn set_busy_timer(&self, on: bool) {
        self.gpu.busy().set(on);
    }

    fn take_busy_time(&self) -> Result<Option<crate::GpuBusy>, EngineError> {
        let b = self.gpu.busy().take()?;
        Ok(Some(crate::GpuBusy { calls: b.calls, busy_s: b.busy_s, span_s: b.span_s }))
    }

    fn set_decode_graphs(&self, on: bool) {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).set_enabled(on);
    }

    fn decode_graphs(&self) -> Option<crate::DecodeGraphs> {
        Some(self.graph_stats())
    }

    fn expert_balance(&self) -> Option<crate::ExpertBalance> {
        let st = self.balancer.as_ref()?.stats();
        Some(crate::ExpertBalance {
            looks: st.looks,
            layers_moved: st.layers_moved,
            copies_received: st.copies_received,
            imbalance_sharded: st.imbalance_shard,
            imbalance_placed: st.imbalance_now,
        })
    }

    fn expert_parallel(&self) -> Option<crate::EpRank> {
        self.ep.as_ref().map(|e| crate::EpRank { rank: e.shard().rank, world: e.shard().world })
    }

    fn begin_step(&self, rows: crate::lockstep::StepRows) -> Result<(), EngineError> {
        let Some(ep) = &self.ep else { return Ok(()) };
        // Load balancing's collectives follow the agreement on every rank (engine::cuda::balance).
        let mut agree = || {
            let agreed = ep.agree_step(rows).and_then(|got| {
                if let Some(b) = &self.balancer {
                    b.after_agreement(&self.gpu, ep, &self.cfg, &self.w, got.iter().any(|&r| r > 0))?;
                }
                Ok(got)
            });
            self.ep_fail_fast(agreed.map_err(EngineError::from))
        };
        self.ep_step.plan(&mut agree, &mut |p| self.ep_join_empty(p))
    }

    fn leave_group(&self, why: &str) {
        if let Some(ep) = &self.ep {
            // The graphs first: the abort returns once they are gone.
            self.drop_graphs();
            ep.abort(&format!("this rank stops: {why}"));
        }
    }

    fn end_step(&self) -> Result<bool, EngineError> {
        if self.ep.is_none() {
            return Ok(false);
        }
        if !self.ep_step.begun() {
            // A rank with nothing to run this step: it agrees on an empty step (the others' agreement).
            self.begin_step([0; 3])?;
        }
        self.ep_step.finish(&mut |p| self.ep_join_empty(p))
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn precision(&self) -> Precision {
        self.prec
    }

    fn allocate_cache(&self, geometry: CacheGeometry) -> Result<KvCache, EngineError> {
        let s = self.stream();
        // The workspace for the serving limits the pool was sized with, reserved with it (the limits copied
        // out first: a call holds `ws` while it reads them).
        let limits = *self.limits.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = limits {
            let need = self.activation_bytes(&l) as usize;
            self.ws.lock().unwrap_or_else(|p| p.into_inner()).reserve(s, need)?;
            let b = self.second_micro_bytes(&l) as usize;
            if b > 0 {
                self.ws_b.lock().unwrap_or_else(|p| p.into_inner()).reserve(s, b)?;
            }
        }
        super::pool::allocate(&self.gpu, geometry).map_err(|e| EngineError::Unsupported(e.to_string()))
    }

    fn memory_budget(&self, limits: &ServingLimits) -> MemoryBudget {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = Some(*limits);
        // Load balancing holds one MoE layer's routed experts twice while it moves them.
        let moving = match &self.balancer {
            Some(b) if b.config().rebalance => self.w.largest_routed_bytes(),
            _ => 0,
        };
        MemoryBudget {
            weights: self.w.bytes() + moving,
            activations: self.activation_bytes(limits)
                + self.second_micro_bytes(limits)
                + super::sample::scratch_bytes(limits.max_num_seqs, self.w.lm_head.out_features()),
            graphs: self.graph_budget(limits),
            // kv-transfer's device buffers for one lane (gathering scattered layers on a prefill worker,
            // landing them on a decode worker).
            communication: (crate::cache::TRANSFER_BUFFERS * crate::cache::TRANSFER_CHUNK) as u64,
        }
    }

    fn memory_capacity(&self) -> Option<u64> {
        // A fraction of the whole device (`--gpu-memory-utilization`), as vLLM: workers sharing a GPU each
        // take their own fraction.
        Some(self.gpu.info().total_memory as u64)
    }

    fn fence(&self) -> LayerReady {
        self.fence_now().unwrap_or_else(|_| LayerReady::complete())
    }

    fn sample(
        &self,
        logits: &DeviceRows,
        row: usize,
        params: &SamplingParams,
        history: History<'_>,
        eos: &[u32],
    ) -> Result<Sampled, EngineError> {
        let view = self.logits_row(logits, row)?;
        self.gpu.context().bind_to_thread().map_err(dev)?;
        let out = super::sample::sample_row(&self.gpu, &view, params, history, eos)?;
        self.ep_outputs_valid()?;
        Ok(out)
    }

    fn sample_rows(&self, reqs: &[SampleRequest<'_>], eos: &[u32]) -> Result<Vec<Sampled>, EngineError> {
        let mut rows = Vec::with_capacity(reqs.len());
        for r in reqs {
            let view = self.logits_row(r.logits, r.row)?;
            rows.push(super::sample::RowRequest {
                row: view.device_ptr(self.stream()).0,
                n: view.len(),
                params: r.params,
                history: r.history,
            });
        }
        self.gpu.context().bind_to_thread().map_err(dev)?;
        let out = super::sample::sample_rows(&self.gpu, &rows, eos)?;
        self.ep_outputs_valid()?;
        Ok(out)
    }

    fn draft(&self, logits: &DeviceRows, row: usize) -> Result<(u32, f32), EngineError> {
        let view = self.logits_row(logits, row)?;
        self.gpu.context().bind_to_thread().map_err(dev)?;
        let out = super::sample::draft_row(&self.gpu, &view)?;
        self.ep_outputs_valid()?;
        Ok(out)
    }

    fn prepare_decode(
        &self,
        cache: &KvCache,
        limits: &ServingLimits,
        max_len: usize,
    ) -> Result<Option<crate::DecodeGraphs>, EngineError> {
        if !graphs::capture_at_startup() {
            return Ok(None);
        }
        self.capture_steps(cache, limits, max_len)
    }

    fn decode_whole_step(
        &self,
        cache: &KvCache,
        batch: &[StepInput<'_>],
        eos: &[u32],
    ) -> Result<Option<Vec<StepSamples>>, EngineError> {
        // Expert parallelism agrees on each pass's rows with the other ranks: its steps run the separate calls.
        if !self.whole_steps() {
            return Ok(None);
        }
        self.whole_step(cache, batch, eos).map(Some)
    }

    fn draft_rows(&self, rows: &[(&DeviceRows, usize)]) -> Result<Vec<(u32, f32)>, EngineError> {
        let Some(&(first, _)) = rows.first() else { return Ok(Vec::new()) };
        let n = first.width();
        let mut ptrs = Vec::with_capacity(rows.len());
        for &(logits, row) in rows {
            if logits.width() != n {
                return Err(EngineError::InvalidInput(format!("logits rows of {} and {n} values", logits.width())));
            }
            let view = self.logits_row(logits, row)?;
            ptrs.push(view.device_ptr(self.stream()).0);
        }
        self.gpu.context().bind_to_thread().map_err(dev)?;
        let out = super::sample::draft_rows(&self.gpu, &ptrs, n)?;
        self.ep_outputs_valid()?;
        Ok(out)
    }

    fn rows_to_host(&self, rows: &DeviceRows) -> Result<Vec<f32>, EngineError> {
        let g = self.rows_of(rows)?;
        let n = rows.rows() * rows.width();
        let mut out = vec![0f32; n];
        if n > 0 {
            let s = self.stream();
            s.memcpy_dtoh(&g.buf.slice().slice(g.offset..g.offset + n), &mut out).map_err(dev)?;
            s.synchronize().map_err(dev)?;
        }
        self.ep_outputs_valid()?;
        Ok(out)
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
        self.run_main(cache, batch, AttnForm::Decode, &mut |_, _| {})
    }

    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[MtpInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        let Some(mtp) = self.w.mtp.as_ref() else {
            return Err(EngineError::Unsupported(
                "this checkpoint has no MTP layer (num_nextn_predict_layers = 0)".into(),
            ));
        };
        let g = cache.geometry();
        let hidden = self.cfg.hidden_size;
        let checked = self.check_cache(cache).and_then(|pool| {
            let items = mtp_items(&self.cfg, g.num_blocks, batch)?;
            for m in batch {
                self.rows_of(m.hidden)?;
            }
            Ok((pool, items))
        });
        let (pool, items) = match checked {
            Ok((pool, items)) if !items.is_empty() => (pool, items),
            other => {
                self.ep_idle(Pass::Mtp)?;
                return other.map(|_| Vec::new());
            }
        };
        self.ep_enter(Pass::Mtp)?;
        let row0: usize = items.iter().map(|it| it.n).sum();
        let mut run = || -> Result<Vec<SeqOutput>, EngineError> {
            let mut ws = self.begin(&items, Pass::Mtp)?;
            let pad = self.pass_shape(&items, form, Pass::Mtp)?;
            self.gpu.busy().begin(self.stream());
            let inp = self.inputs(&mut ws, &items, form, pad)?;
            let rows = inp.rows;
            let s = self.stream().clone();
            let mut tokens: Vec<i32> = batch.iter().flat_map(|m| m.next_tokens.iter().map(|&t| t as i32)).collect();
            // The MTP input embedding at position 0 is zeroed (docs/model.md §2.5), and a padding row's.
            let mut zero: Vec<i32> =
                items.iter().flat_map(|it| (0..it.n).map(move |i| (it.start == 0 && i == 0) as i32)).collect();
            tokens.resize(rows, 0);
            zero.resize(rows, 1);
            let table = mtp.embed.as_ref().unwrap_or(&self.w.embed);
            let emb = self.embed(&mut ws, table, &tokens, Some(&zero))?;
            // [enorm(emb) | hnorm(hidden)] per row; padding rows all zeros (finite through the layer).
            let cat = ws.take::<f32>(&s, rows * 2 * hidden)?;
            if rows > row0 {
                s.context().bind_to_thread().map_err(dev)?;
                // SAFETY: `cat` holds rows x 2 x hidden f32 (taken above); stream-ordered before its readers.
                unsafe { cudarc::driver::result::memset_d8_async(cat, 0, rows * 2 * hidden * 4, s.cu_stream()) }
                    .map_err(dev)?;
            }
            self.rms_norm(emb, hidden, &mtp.enorm, cat, 2 * hidden, rows)?;
            for (m, it) in batch.iter().zip(&items) {
                let rows = self.rows_of(m.hidden)?;
                self.rms_norm(
                    rows.addr(0, hidden),
                    hidden,
                    &mtp.hnorm,
                    cat + ((it.row0 * 2 + 1) * hidden * 4) as u64,
                    2 * hidden,
                    it.n,
                )?;
            }
            let h = ws.take::<f32>(&s, rows * hidden)?;
            let li = LayerIdx(self.cfg.num_hidden_layers as u32);
            let mark = ws.mark();
            let layer = |ws: &mut Workspace, _: Option<&mut Workspace>| -> Result<(), EngineError> {
                mtp.eh_proj.forward(&self.gpu, ws, cat, rows, 1, 0, h)?;
                self.layer(ws, &inp, &mtp.layer, li, g, pool, form, h, on_layer)?;
                ws.rewind(mark);
                Ok(())
            };
            self.graphed(&mut ws, None, GraphPass::Mtp, pad, form, g, pool, layer)?;
            let head = mtp.head.as_ref().unwrap_or(&self.w.lm_head);
            let out = self.finish(&mut ws, &items, h, &mtp.head_norm, head)?;
            self.gpu.busy().end(self.stream());
            self.ep_step_issued()?;
            Ok(out)
        };
        self.ep_fail_fast(run())
    }
}

impl CudaBackend {
    /// The second micro-batch's workspace where dual-batch overlap may run: a forward of half the tokens (the
    /// first micro-batch uses the call's workspace, which is sized for the whole forward; the halved limits
    /// still count the logits and the score chunk whole, an upper bound).
    fn second_micro_bytes(&self, l: &ServingLimits) -> u64 {
        if !self.dbo_possible() {
            return 0;
        }
        let half = ServingLimits { max_num_batched_tokens: l.max_num_batched_tokens.div_ceil(2), ..*l };
        self.activation_bytes(&half)
    }

    /// Workspace bytes of a `max_num_batched_tokens` forward: every buffer of one `layer` at once (layers
    /// reuse the same bytes) for the largest of the main and MTP passes, one chunk of indexer scores and
    /// first-digit counts (at most [`SCORE_BYTES`], or one scorer group of rows at `max_position_embeddings`),
    /// the MHA form's decompressed context (full precision only; bounded by the batch), FP8 prefill's staged
    /// context rows, and the logits rows.
    fn activation_bytes(&self, l: &ServingLimits) -> u64 {
        let c = &self.cfg;
        let rows = l.max_num_batched_tokens as u64;
        let ih_pad = c.index_n_heads.next_multiple_of(INDEX_HEAD_TILE) as u64;
        let (hidden, rank, rd, heads) =
            (c.hidden_size as u64, c.kv_lora_rank as u64, c.qk_rope_head_dim as u64, c.num_attention_heads as u64);
        let (qk, vd, q_lora) = (c.qk_head_dim() as u64, c.v_head_dim as u64, c.q_lora_rank.max(1) as u64);
        let inter = c.moe_intermediate_size.max(c.intermediate_size) as u64;
        let k = c.num_experts_per_tok.max(1) as u64;
        let per_row = 8 * hidden
            + 2 * q_lora
            + heads * qk
            + 2 * rank
            + 2 * rd
            + c.index_n_heads as u64 * 128 * 2
            + 128
            + 2 * ih_pad
            + heads * vd
            + heads * (sparse_mla::DQK as u64 / 2 + rank)
            + 2 * k * inter
            + k * hidden
            + 2 * c.n_routed_experts as u64
            + c.index_topk as u64
            // The K chunks' partial sums of the narrow f32 linears (router gate, weights_proj).
            + (super::weights::F32_MAX_CHUNKS * super::weights::F32_SPLIT_MAX_OUT) as u64;
        let ctx = rows.min(c.max_position_embeddings as u64);
        // The indexer's scores, first-digit counts and top-k plans: a decode row may have any context up to
        // max_position_embeddings, so the chunk is bounded by SCORE_BYTES or one scorer group of such rows.
        let row_words = (c.max_position_embeddings + HIST_WORDS + topk::SPLIT_WORDS) as u64;
        let scores = (rows * row_words).min((SCORE_BYTES as u64 / 4).max(indexer::MAX_GROUP as u64 * row_words));
        let mha =
            if self.prec == Precision::Fp8 { 0 } else { ctx * (rank + rd + heads * (c.qk_nope_head_dim as u64 + vd)) };
        let logits = 2 * l.max_num_seqs as u64 * c.vocab_size as u64;
        // The grouped experts' indices and quantized activations (engine::cuda::moe). Under expert
        // parallelism a rank groups every rank's pairs (at the agreed capacity) and holds the dispatch and
        // combine buffers (engine::cuda::ep).
        let (k, inter) = (c.num_experts_per_tok, c.moe_intermediate_size);
        let grouped = if c.n_routed_experts > 0 && moe::enabled() {
            let grouping = |pairs: usize| moe::workspace_bytes(pairs, c.n_routed_experts, c.hidden_size, inter);
            match &self.ep {
                None => grouping(l.max_num_batched_tokens * k),
                Some(e) => {
                    let (world, cap) = (e.shard().world, ep::capacity(l.max_num_batched_tokens));
                    let kpad = c.hidden_size.next_multiple_of(128);
                    // The per-row terms above count gate and up for this rank's own pairs only.
                    let more_pairs = (world * cap - l.max_num_batched_tokens) * k;
                    grouping(world * cap * k)
                        + ep::workspace_bytes(world, cap, k, kpad, c.hidden_size)
                        + 4 * 2 * more_pairs * inter
                }
            }
        } else {
            0
        } as u64;
        // FP8 prefill's staged context rows (bounded by STAGE_BYTES; a larger call gathers instead).
        let staged = if self.prec == Precision::Fp8 { STAGE_BYTES as u64 } else { 0 };
        4 * (rows * per_row + scores + mha + logits) + grouped + staged + CONTEXT_RESERVE
    }
}

impl Drop for CudaBackend {
    /// The captured graphs go first: fields drop in declaration order, which would drop the expert-parallel
    /// group (`ep`) before `graphs`, and NCCL's destroy or abort of the communicator returns only once no
    /// graph holds its launches.
    fn drop(&mut self) {
        self.graphs.get_mut().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Call outputs (logits, hidden rows) are stream-ordered allocations from the device's default pool: keeping
/// what is freed in the pool (release threshold: never) means that once the first calls at the serving
/// limits have run, no call asks the driver for memory.
fn keep_freed_memory(gpu: &Gpu) -> Result<(), EngineError> {
    let ctx = gpu.context();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread().map_err(dev)?;
    let mut pool = std::mem::MaybeUninit::uninit();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: plain driver calls on this context's device with valid out-pointers.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
            .result()
            .map_err(|e| EngineError::Device(format!("cuDeviceGetDefaultMemPool: {e}")))?;
        sys::cuMemPoolSetAttribute(
            pool.assume_init(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .map_err(|e| EngineError::Device(format!("cuMemPoolSetAttribute: {e}")))?;
    }
    Ok(())
}

// The `DevicePtr` import keeps `device_ptr` in scope for DBuf's address.
#[allow(unused_imports)]
use DevicePtr as _;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Logits;
    use crate::cache::BlockId;

    #[test]
    fn a_batch_splits_into_two_micro_batches_at_a_row_even_inside_an_item() {
        let blocks = [BlockId(3), BlockId(4)];
        let item = |start, n, row0| Item { start, n, row0, blocks: &blocks, logits: Logits::Last };
        // A 5-row prefill chunk from position 10, then two decode rows.
        let items = [item(10, 5, 0), item(40, 1, 5), item(7, 1, 6)];
        let (a, b) = split_items(&items, 4);
        let rows = |v: &[Item<'_>]| v.iter().map(|i| (i.start, i.n, i.row0)).collect::<Vec<_>>();
        assert_eq!(rows(&a), [(10, 4, 0)]);
        assert_eq!(rows(&b), [(14, 1, 0), (40, 1, 1), (7, 1, 2)], "the chunk's last row continues at position 14");
        let (a, b) = split_items(&items, 5);
        assert_eq!((rows(&a), rows(&b)), (vec![(10, 5, 0)], vec![(40, 1, 0), (7, 1, 1)]));
        let (a, b) = split_items(&items[..1], 5);
        assert_eq!(a.len(), 1);
        assert!(b.is_empty(), "nothing after the last row");
    }
}
