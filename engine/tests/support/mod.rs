//! What the engine's integration tests share: the device they run on, a backend beside its cache pool with
//! one-shot prefill, and fresh random prompts.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

pub mod golden;

use std::sync::Arc;

use engine::cache::{BlockPool, CacheGeometry, KvCache};
use engine::device::Device;
use engine::{Backend, Logits, SeqInput};

/// The vocabulary of the tiny checkpoints the tests generate.
pub const VOCAB: usize = 1280;

/// `TANDEM_TEST_DEVICE` (cpu when unset): `scripts/gpu-test.sh run model` runs the model tests on the GPU.
pub fn device() -> Device {
    std::env::var("TANDEM_TEST_DEVICE")
        .map(|d| d.parse().expect("TANDEM_TEST_DEVICE: cpu, cuda or cuda:N"))
        .unwrap_or_default()
}

/// A backend and a pool of `blocks` cache blocks it allocated in its precision's format.
pub struct Served {
    pub b: Arc<dyn Backend>,
    pub cache: KvCache,
    pub pool: BlockPool,
}

impl Served {
    pub fn new(b: Arc<dyn Backend>, blocks: usize) -> Self {
        let geo =
            CacheGeometry::new(b.precision().cache_format(), b.entry_dims(), b.config().num_cache_layers(), blocks);
        let cache = b.allocate_cache(geo).unwrap();
        Served { b, cache, pool: BlockPool::new(blocks) }
    }

    /// Every position's logits from one prefill of `tokens`, in blocks reserved as `id` (released after).
    pub fn prefill_all(&self, id: &str, tokens: &[u32]) -> Vec<f32> {
        let t = self.pool.reserve(id, tokens.len()).unwrap();
        let batch = [SeqInput { tokens, start: 0, blocks: &t.blocks, logits: Logits::All }];
        let out = self.b.prefill(&self.cache, &batch, &mut |_, _| {}).unwrap();
        self.pool.release(id).unwrap();
        self.b.rows_to_host(&out[0].logits).unwrap()
    }
}

/// Fresh random prompt tokens of the tiny vocabulary (avoiding the special ids 0..7); the seed is printed so
/// that a failure can be replayed.
pub fn prompt(n: usize, salt: u64) -> Vec<u32> {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 ^ salt;
    eprintln!("prompt seed {seed}");
    xorshift(seed).take(n).map(|s| 7 + (s % (VOCAB as u64 - 7)) as u32).collect()
}

/// The xorshift64 stream from `seed` (0 is taken as 1).
pub fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}
