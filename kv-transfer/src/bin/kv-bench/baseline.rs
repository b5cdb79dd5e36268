//! A like-for-like reference for kv-bench: how fast this machine copies the request's bytes from one
//! DRAM-resident buffer to another (the work a shared-memory transfer cannot avoid), on 1 and N threads.

use std::time::Instant;

use kv_cache::KvCache;

/// Copies at most this much per measurement: far beyond any last-level cache, so the copy streams DRAM.
const MAX_COPY: usize = 1 << 30;

pub struct Copier<'a> {
    cache: &'a KvCache,
    dst: Vec<u8>,
}

impl<'a> Copier<'a> {
    /// `off`: measure nothing (the destination is never allocated).
    pub fn new(cache: &'a KvCache, off: bool) -> Option<Copier<'a>> {
        if off {
            return None;
        }
        let n = cache.arena().len().min(MAX_COPY);
        // Written once so every page is faulted in, like a warm worker's pool.
        Some(Copier { cache, dst: vec![1u8; n] })
    }

    /// GB/s of copying min(bytes, 1 GiB) of the cache arena into the destination on `threads` threads
    /// (best of 3).
    pub fn gbps(&mut self, bytes: u64, threads: usize) -> Option<f64> {
        let n = (bytes as usize).min(self.dst.len());
        // SAFETY: the sender's arena is only read, while no transfer is in flight.
        let src = unsafe { self.cache.arena().slice(0, n) }.ok()?;
        let dst = &mut self.dst[..n];
        let chunk = n.div_ceil(threads.max(1));
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for (d, s_) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                    s.spawn(move || d.copy_from_slice(s_));
                }
            });
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Some(n as f64 / best / 1e9)
    }
}

/// `None`-tolerant front for the bench loop.
pub trait MaybeCopier {
    fn gbps(&mut self, bytes: u64, threads: usize) -> Option<f64>;
}

impl MaybeCopier for Option<Copier<'_>> {
    fn gbps(&mut self, bytes: u64, threads: usize) -> Option<f64> {
        self.as_mut().and_then(|c| c.gbps(bytes, threads))
    }
}
