//! Loading the model and creating the cache pool a worker serves from. The backend comes from the
//! factory (`--device`), allocates the pool itself and reports its memory budget; the pool's size follows
//! (`--kv-blocks` on the CPU, what `--gpu-memory-utilization` leaves on a GPU). Everything is allocated
//! here, before the worker reports ready: serving allocates no cache memory per request.

use std::sync::Arc;

use anyhow::Context;
use engine::cache::{BLOCK_SIZE, BlockPool, CacheGeometry, KvCache};
use engine::checkpoint::Checkpoint;
use engine::memory::{PoolSizing, ServingLimits};
use engine::{Backend, ModelConfig, Precision};
use proto::v1::ModelFingerprint;

use crate::ServeArgs;

pub struct LoadedModel {
    pub backend: Arc<dyn Backend>,
    pub cache: Arc<KvCache>,
    pub pool: Arc<BlockPool>,
    pub fingerprint: ModelFingerprint,
    /// Longest prompt + output served.
    pub max_model_len: usize,
    pub name: String,
}

impl LoadedModel {
    /// Loads the model and allocates the pool; with `prepare_decode` (a decode worker) also prepares decode
    /// steps before serving (`Backend::prepare_decode`: the CUDA backend captures its step graphs).
    pub fn load(args: &ServeArgs, prepare_decode: bool) -> anyhow::Result<LoadedModel> {
        // Before touching the checkpoint: a device this build cannot use fails at once.
        engine::device::check_available(args.device)?;
        let ckpt = Checkpoint::open_model(&args.model)
            .with_context(|| format!("opening checkpoint {}", args.model.display()))?;
        let ep = args.ep_config()?;
        if let Some(e) = &ep {
            tracing::info!(rank = e.rank, world = e.world, leader = %e.leader, "joining the expert-parallel group");
        }
        let backend = engine::device::load_backend_ep(&ckpt, args.backend_options(), ep.as_ref())
            .with_context(|| format!("loading {} on {}", args.model.display(), args.device))?;
        let cfg: ModelConfig = backend.config().clone();
        let limits = ServingLimits {
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            // The pool is sized after the budget: the longest request it may serve is bounded by the flag or the
            // model here (a smaller pool captures fewer shapes than budgeted).
            decode_graphs: prepare_decode
                .then(|| args.max_model_len.unwrap_or(backend.config().max_position_embeddings)),
        };
        let budget = backend.memory_budget(&limits);
        let capacity = backend.memory_capacity();
        let mut geometry =
            CacheGeometry::new(args.precision.cache_format(), backend.entry_dims(), backend.cache_layers(), 0);
        let sizing = PoolSizing { kv_blocks: args.kv_blocks, gpu_memory_utilization: args.gpu_memory_utilization };
        geometry.num_blocks = sizing.blocks(&geometry, capacity, &budget)?;
        let cache = backend.allocate_cache(geometry).with_context(|| {
            format!("allocating a {}-byte cache pool ({} blocks)", geometry.total_bytes(), geometry.num_blocks)
        })?;
        let pool_tokens = geometry.num_blocks * BLOCK_SIZE;
        let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings.min(pool_tokens));
        anyhow::ensure!(
            max_model_len <= cfg.max_position_embeddings,
            "--max-model-len {max_model_len} exceeds the model's max_position_embeddings {}",
            cfg.max_position_embeddings
        );
        if prepare_decode {
            // Before reporting ready: the decode steps' CUDA graphs are captured now, not on the first requests.
            backend
                .prepare_decode(&cache, &limits, max_model_len)
                .context("capturing the decode steps before serving")?;
        }
        let name = args.served_name();
        let fingerprint = fingerprint(&name, ckpt.fingerprint().to_string(), args.precision, &geometry);
        if cfg.num_nextn_predict_layers > cfg.num_served_mtp_layers() {
            tracing::info!(
                mtp_layers = cfg.num_nextn_predict_layers,
                "the checkpoint has {} MTP layers; only the first is served (one draft token per step)",
                cfg.num_nextn_predict_layers
            );
        }
        tracing::info!(
            model = %args.model.display(), name = %name, device = %args.device, backend = backend.name(),
            precision = args.precision.name(), kv_blocks = geometry.num_blocks, cache_layers = geometry.num_layers,
            cache_bytes = geometry.total_bytes(), cache_memory = %cache.memory_kind(), max_model_len,
            weights_bytes = budget.weights, activation_bytes = budget.activations, graph_bytes = budget.graphs,
            communication_bytes = budget.communication, fingerprint = %fingerprint.checkpoint_hash,
            kv_transfer_protocol = fingerprint.kv_transfer_protocol, "model loaded"
        );
        Ok(LoadedModel {
            backend,
            cache: Arc::new(cache),
            pool: Arc::new(BlockPool::new(geometry.num_blocks)),
            fingerprint,
            max_model_len,
            name,
        })
    }

    /// Validates the flags; with `--check-config` reports them valid for `role` and returns `None`, otherwise
    /// loads the model (off the async runtime).
    pub async fn load_unless_checking(args: &ServeArgs, role: &str) -> anyhow::Result<Option<LoadedModel>> {
        args.validate()?;
        if args.check_config {
            args.report_config_ok(role);
            return Ok(None);
        }
        let args = args.clone();
        let decode = role == "decode-worker";
        Ok(Some(tokio::task::spawn_blocking(move || LoadedModel::load(&args, decode)).await??))
    }

    /// A model over an already-built backend with a pool of `blocks` blocks (tests: a fake backend).
    pub fn from_backend(backend: Arc<dyn Backend>, blocks: usize, name: &str) -> anyhow::Result<LoadedModel> {
        let geometry = CacheGeometry::new(
            backend.precision().cache_format(),
            backend.entry_dims(),
            backend.cache_layers(),
            blocks,
        );
        let cache = backend.allocate_cache(geometry)?;
        let cfg = backend.config();
        let hash = format!("{}-{}", backend.name(), cfg.vocab_size);
        let fingerprint = fingerprint(name, hash, backend.precision(), &geometry);
        Ok(LoadedModel {
            max_model_len: cfg.max_position_embeddings.min(blocks * BLOCK_SIZE),
            backend,
            cache: Arc::new(cache),
            pool: Arc::new(BlockPool::new(blocks)),
            fingerprint,
            name: name.to_string(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }
}

/// The fingerprint a worker serving `name` from a checkpoint with this hash, at `precision`, into a pool of
/// `geometry` publishes, with the kv-transfer protocol this build speaks (workers are paired by
/// `ModelFingerprint::check_compatible`, so workers of two protocols never are).
fn fingerprint(
    name: &str,
    checkpoint_hash: String,
    precision: Precision,
    geometry: &CacheGeometry,
) -> ModelFingerprint {
    ModelFingerprint {
        model_name: name.to_string(),
        checkpoint_hash,
        precision: precision.name().to_string(),
        block_size: BLOCK_SIZE as u32,
        num_layers: geometry.num_layers as u32,
        kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
    }
}
