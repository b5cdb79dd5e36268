//! Memory planning: what a backend needs besides the cache pool, and how many cache blocks the rest
//! holds. A GPU backend reports its weights, the activations of the largest batch, captured graphs and
//! communication buffers; the pool gets what `--gpu-memory-utilization` leaves. The CPU sizes the pool
//! with `--kv-blocks` (host memory is not partitioned up front).

use serde::Serialize;

use crate::cache::CacheGeometry;

/// The serving limits activations are sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingLimits {
    /// Tokens of the largest forward (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Requests of the largest batch (`--max-num-seqs`): rows of logits.
    pub max_num_seqs: usize,
    /// A decode worker's longest request (`--max-model-len`, or the model's): its decode steps are prepared
    /// before serving (`Backend::prepare_decode`: the CUDA backend's step graphs, in the budget). `None`
    /// elsewhere (a prefill worker, `generate`, benchmarks that do not prepare).
    pub decode_graphs: Option<usize>,
}

/// Bytes a backend needs outside the cache pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MemoryBudget {
    pub weights: u64,
    /// Peak activations of a `max_num_batched_tokens` forward.
    pub activations: u64,
    /// Captured graphs (CUDA graphs); 0 on the CPU.
    pub graphs: u64,
    /// Communication buffers (NCCL, staging); 0 on the CPU.
    pub communication: u64,
}

impl MemoryBudget {
    pub fn total(&self) -> u64 {
        self.weights + self.activations + self.graphs + self.communication
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemoryError {
    #[error("--gpu-memory-utilization must be in (0, 1], got {0}")]
    BadUtilization(f64),
    #[error("--kv-blocks must be > 0")]
    NoBlocks,
    #[error(
        "no room for the cache pool: {usable} usable bytes ({utilization} of {capacity}) minus the backend's \
         {needed} (weights {weights}, activations {activations}, graphs {graphs}, communication {communication}) \
         leave less than one {block_bytes}-byte block; raise --gpu-memory-utilization or lower \
         --max-num-batched-tokens"
    )]
    NoRoom {
        capacity: u64,
        utilization: f64,
        usable: u64,
        needed: u64,
        weights: u64,
        activations: u64,
        graphs: u64,
        communication: u64,
        block_bytes: u64,
    },
    #[error("--kv-blocks {blocks} needs {bytes} bytes but --gpu-memory-utilization leaves {room}")]
    BlocksDoNotFit { blocks: usize, bytes: u64, room: u64 },
}

/// How the pool is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolSizing {
    /// `--kv-blocks`: the pool size where memory is not partitioned (CPU), an explicit override on a GPU.
    pub kv_blocks: Option<usize>,
    /// `--gpu-memory-utilization`: the fraction of a device's memory this worker may use.
    pub gpu_memory_utilization: f64,
}

/// Blocks when `--kv-blocks` is not given and the backend has no memory capacity to divide.
pub const DEFAULT_KV_BLOCKS: usize = 2048;

impl PoolSizing {
    /// Cache blocks for a pool whose per-block geometry is `geometry` (its `num_blocks` is ignored), on a
    /// backend with `capacity` bytes (`None`: the CPU) that needs `budget` besides the pool.
    pub fn blocks(
        &self,
        geometry: &CacheGeometry,
        capacity: Option<u64>,
        budget: &MemoryBudget,
    ) -> Result<usize, MemoryError> {
        let u = self.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return Err(MemoryError::BadUtilization(u));
        }
        if self.kv_blocks == Some(0) {
            return Err(MemoryError::NoBlocks);
        }
        let Some(capacity) = capacity else {
            return Ok(self.kv_blocks.unwrap_or(DEFAULT_KV_BLOCKS));
        };
        let block_bytes = CacheGeometry { num_blocks: 1, ..*geometry }.total_bytes() as u64;
        let usable = (capacity as f64 * u) as u64;
        let room = usable.saturating_sub(budget.total());
        match self.kv_blocks {
            Some(blocks) => {
                let bytes = blocks as u64 * block_bytes;
                if bytes > room {
                    return Err(MemoryError::BlocksDoNotFit { blocks, bytes, room });
                }
                Ok(blocks)
            }
            None if room < block_bytes => Err(MemoryError::NoRoom {
                capacity,
                utilization: u,
                usable,
                needed: budget.total(),
                weights: budget.weights,
                activations: budget.activations,
                graphs: budget.graphs,
                communication: budget.communication,
                block_bytes,
            }),
            None => Ok((room / block_bytes) as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheFormat, EntryDims};

    fn geo() -> CacheGeometry {
        CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, 62, 0)
    }

    #[test]
    fn the_cpu_pool_is_kv_blocks() {
        let s = PoolSizing { kv_blocks: Some(17), gpu_memory_utilization: 0.9 };
        assert_eq!(s.blocks(&geo(), None, &MemoryBudget::default()).unwrap(), 17);
        let s = PoolSizing { kv_blocks: None, ..s };
        assert_eq!(s.blocks(&geo(), None, &MemoryBudget::default()).unwrap(), DEFAULT_KV_BLOCKS);
    }

    #[test]
    fn a_device_pool_gets_what_the_budget_leaves() {
        let block = CacheGeometry { num_blocks: 1, ..geo() }.total_bytes() as u64;
        let budget = MemoryBudget { weights: 1000 * block, activations: 50 * block, graphs: 7, communication: 3 };
        let s = PoolSizing { kv_blocks: None, gpu_memory_utilization: 0.5 };
        // 0.5 of 2200 blocks is 1100; the budget takes 1050 blocks and 10 bytes, leaving 49 whole blocks.
        assert_eq!(s.blocks(&geo(), Some(2200 * block), &budget).unwrap(), 49);
        let s = PoolSizing { kv_blocks: Some(49), ..s };
        assert_eq!(s.blocks(&geo(), Some(2200 * block), &budget).unwrap(), 49);
        let s = PoolSizing { kv_blocks: Some(50), ..s };
        assert!(matches!(s.blocks(&geo(), Some(2200 * block), &budget), Err(MemoryError::BlocksDoNotFit { .. })));
    }

    #[test]
    fn a_budget_that_leaves_no_block_is_a_clear_error() {
        let s = PoolSizing { kv_blocks: None, gpu_memory_utilization: 0.9 };
        let budget = MemoryBudget { weights: 900, ..Default::default() };
        let e = s.blocks(&geo(), Some(1000), &budget).unwrap_err();
        assert!(e.to_string().contains("--gpu-memory-utilization"), "{e}");
        for bad in [0.0, -0.1, 1.5, f64::NAN] {
            let s = PoolSizing { kv_blocks: None, gpu_memory_utilization: bad };
            assert!(matches!(s.blocks(&geo(), None, &budget), Err(MemoryError::BadUtilization(_))));
        }
        let s = PoolSizing { kv_blocks: Some(0), gpu_memory_utilization: 0.9 };
        assert_eq!(s.blocks(&geo(), None, &budget), Err(MemoryError::NoBlocks));
    }
}
