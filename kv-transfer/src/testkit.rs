//! Helpers shared by the tests, the bench and the cross-process test peer (not part of the API).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use kv_cache::{BlockPool, CacheFormat, CacheGeometry, DeviceCopy, EntryDims, KvArena, KvCache};
use proto::v1::ModelFingerprint;

/// A completion marker that is reached once opened: a sender that queues every layer of a request behind
/// one gate, then opens it, ships them as if they were all written before its shipping thread got to the
/// first (deterministically gathered together where the layers are gathered).
#[derive(Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.opened.notify_all();
    }
}

impl kv_cache::Fence for Gate {
    fn wait(&self) -> Result<(), String> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    fn is_complete(&self) -> bool {
        *self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A fingerprint matching `g`.
pub fn fingerprint(g: &CacheGeometry) -> ModelFingerprint {
    ModelFingerprint {
        model_name: "test-model".into(),
        checkpoint_hash: "0123456789abcdef0123456789abcdef".into(),
        precision: g.format.name().into(),
        block_size: 64,
        num_layers: g.num_layers as u32,
        kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
    }
}

pub fn geometry(layers: usize, blocks: usize) -> CacheGeometry {
    CacheGeometry::new(CacheFormat::Fp8, EntryDims::DEEPSEEK_V32, layers, blocks)
}

/// A host cache whose every byte is pseudo-random (seeded), plus a pool over it.
pub fn filled_cache(g: CacheGeometry, seed: u64) -> (Arc<KvCache>, Arc<BlockPool>) {
    let cache = KvCache::new_host(g).expect("allocate test cache");
    fill(&cache, seed);
    let pool = Arc::new(BlockPool::new(g.num_blocks));
    (Arc::new(cache), pool)
}

/// Overwrites the whole arena (host or device) with a seeded xorshift stream (fast, and never all-equal
/// bytes).
pub fn fill(cache: &KvCache, seed: u64) {
    let len = cache.arena().len();
    let mut buf = vec![0u8; len.min(1 << 20)];
    let mut x = seed | 1;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(buf.len());
        for chunk in buf[..n].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        // SAFETY: test setup, no concurrent access.
        unsafe { cache.arena().copy_in(at, &buf[..n]) }.expect("fill the test cache");
        at += n;
    }
}

/// A stand-in for a GPU backend's pool in tests: an arena of kind `Device { ordinal: 0 }` at an address
/// the host cannot touch (an inaccessible mapping: a stray dereference faults), whose bytes live in a
/// private host buffer that only this [`DeviceCopy`] reaches. It can be told to fail mid-transfer.
pub struct SimulatedDevice {
    mem: Mutex<Box<[u8]>>,
    /// Copies left before each direction fails (`u64::MAX`: never).
    reads_left: AtomicU64,
    writes_left: AtomicU64,
}

impl SimulatedDevice {
    /// Every read after the next `n` fails.
    pub fn fail_reads_after(&self, n: u64) {
        self.reads_left.store(n, Ordering::SeqCst);
    }

    /// Every write after the next `n` fails.
    pub fn fail_writes_after(&self, n: u64) {
        self.writes_left.store(n, Ordering::SeqCst);
    }

    /// Copies succeed again.
    pub fn heal(&self) {
        self.fail_reads_after(u64::MAX);
        self.fail_writes_after(u64::MAX);
    }

    fn allowed(left: &AtomicU64) -> bool {
        left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
            0 => None,
            u64::MAX => Some(n),
            n => Some(n - 1),
        })
        .is_ok()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Box<[u8]>> {
        self.mem.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl DeviceCopy for SimulatedDevice {
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        if !Self::allowed(&self.reads_left) {
            return Err("simulated device: read failed (injected)".into());
        }
        let mem = self.lock();
        let src = mem.get(offset..offset + dst.len()).ok_or("simulated device: read out of range")?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        if !Self::allowed(&self.writes_left) {
            return Err("simulated device: write failed (injected)".into());
        }
        let mut mem = self.lock();
        let dst = mem.get_mut(offset..offset + src.len()).ok_or("simulated device: write out of range")?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// An address range reserved with no access rights: what a device pointer looks like from the host.
struct NoAccess {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: an inaccessible reservation; nothing reads or writes through it.
unsafe impl Send for NoAccess {}
unsafe impl Sync for NoAccess {}

impl Drop for NoAccess {
    fn drop(&mut self) {
        // SAFETY: unmapping our own reservation.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// A simulated device pool for `g`, filled like [`filled_cache`], plus a pool over it and the device
/// (to inject copy failures).
pub fn device_cache(g: CacheGeometry, seed: u64) -> (Arc<KvCache>, Arc<BlockPool>, Arc<SimulatedDevice>) {
    let len = g.total_bytes();
    // SAFETY: an anonymous PROT_NONE reservation (no memory behind it).
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "reserving {len} bytes of address space");
    let ptr = NonNull::new(addr as *mut u8).expect("mmap returns non-null");
    let device = Arc::new(SimulatedDevice {
        mem: Mutex::new(vec![0u8; len].into_boxed_slice()),
        reads_left: AtomicU64::new(u64::MAX),
        writes_left: AtomicU64::new(u64::MAX),
    });
    // SAFETY: the reservation lives as long as the arena (its owner) and the copier reaches every byte.
    let arena = unsafe { KvArena::from_device(ptr, len, 0, Box::new(NoAccess { addr, len }), device.clone()) };
    let cache = KvCache::with_arena(g, arena).expect("a device test cache");
    fill(&cache, seed);
    (Arc::new(cache), Arc::new(BlockPool::new(g.num_blocks)), device)
}

/// The [`kv_cache::hash`] digest of a request's cache (every layer's shipped bytes, in plan order) in
/// `cache`'s `blocks`, read through host copies: the same value on both sides of a correct transfer,
/// whatever the block ids and the memory (host or device), and computed without the GPU checksum.
pub fn request_digest(cache: &KvCache, blocks: &[kv_cache::BlockId], tokens: usize) -> u64 {
    let layout = crate::layout::layout_of(cache.geometry());
    let plan = crate::layout::PutPlan::new(layout, layout, blocks, blocks, tokens);
    let mut h = kv_cache::hash::Sum64::new();
    let mut buf = Vec::new();
    for l in 0..cache.geometry().num_layers {
        for p in plan.layer_puts(kv_cache::LayerIdx(l as u32)) {
            buf.resize(p.len as usize, 0);
            // SAFETY: test code; the request's blocks are not written during the call.
            unsafe { cache.arena().copy_out(p.dst_offset as usize, &mut buf) }.expect("read the request's blocks");
            h.update(&buf);
        }
    }
    h.digest()
}

/// Encodes a descriptor as one hex line (for passing between processes on stdio).
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}
