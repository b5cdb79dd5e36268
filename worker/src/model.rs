//! Loading the model and creating the cache pool a worker serves from.

use std::sync::Arc;

use anyhow::Context;
use engine::cache::{BLOCK_SIZE, BlockPool, CacheGeometry, KvCache};
use engine::checkpoint::Checkpoint;
use engine::cpu::CpuBackend;
use engine::{Backend, ModelConfig};
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
    pub fn load(args: &ServeArgs) -> anyhow::Result<LoadedModel> {
        if let Some(n) = args.threads {
            // A second call (tests starting several workers in one process) keeps the first pool.
            let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
        }
        let ckpt =
            Checkpoint::open(&args.model).with_context(|| format!("opening checkpoint {}", args.model.display()))?;
        let backend = CpuBackend::from_checkpoint(&ckpt, args.precision)
            .with_context(|| format!("loading {}", args.model.display()))?;
        let cfg: ModelConfig = backend.config().clone();
        anyhow::ensure!(args.kv_blocks > 0, "--kv-blocks must be > 0");
        let geometry = CacheGeometry::new(
            args.precision.cache_format(),
            backend.entry_dims(),
            cfg.num_cache_layers(),
            args.kv_blocks,
        );
        let cache = KvCache::new_host(geometry).with_context(|| {
            format!("allocating a {}-byte cache pool (--kv-blocks {})", geometry.total_bytes(), args.kv_blocks)
        })?;
        let pool_tokens = args.kv_blocks * BLOCK_SIZE;
        let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings.min(pool_tokens));
        anyhow::ensure!(
            max_model_len <= cfg.max_position_embeddings,
            "--max-model-len {max_model_len} exceeds the model's max_position_embeddings {}",
            cfg.max_position_embeddings
        );
        let name = args.served_name();
        let fingerprint = ModelFingerprint {
            model_name: name.clone(),
            checkpoint_hash: ckpt.fingerprint().to_string(),
            precision: args.precision.name().to_string(),
            block_size: BLOCK_SIZE as u32,
            num_layers: cfg.num_cache_layers() as u32,
        };
        tracing::info!(
            model = %args.model.display(), name = %name, precision = args.precision.name(),
            kv_blocks = args.kv_blocks, cache_bytes = geometry.total_bytes(), max_model_len,
            fingerprint = %fingerprint.checkpoint_hash, "model loaded"
        );
        Ok(LoadedModel {
            backend: Arc::new(backend),
            cache: Arc::new(cache),
            pool: Arc::new(BlockPool::new(args.kv_blocks)),
            fingerprint,
            max_model_len,
            name,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    pub fn cluster_fingerprint(&self) -> cluster::Fingerprint {
        self.fingerprint.clone().into()
    }
}
