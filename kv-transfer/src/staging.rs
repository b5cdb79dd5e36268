//! Buffers for cache pools in device memory: host staging buffers for transports that cannot move device
//! memory (TCP, in-process, a UCX without CUDA), and the device buffers a CUDA-capable UCX gathers
//! layers into (scattered ones, and small ones several to a buffer) and lands them in ([`DevicePool`]).
//!
//! Staged, the sender copies each piece of a put out of the device arena ([`kv_cache::KvArena::copy_out`]) into a
//! host buffer that the transport sends from; the receiver places each write through a host buffer and
//! [`kv_cache::KvArena::copy_in`]. Buffers are few, of one fixed size and reused (a buffer goes back to its
//! pool when the transport is done with its bytes), so a transfer allocates nothing per block and the host
//! memory a pool needs stays bounded. Host pools never come here: their bytes move without a copy.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use kv_cache::hash::Sum64;
use kv_cache::{ArenaError, DeviceBuffer, KvArena};

/// One staging buffer, and the most one staged write carries: large enough that per-write costs (a
/// device copy call, a message) vanish next to the bytes, small enough that a few per lane stay cheap.
pub const STAGE_BYTES: usize = 1 << 20;

/// Staging buffers of a sender: enough to keep every lane busy while the next piece is copied out.
pub fn sender_buffers(lanes: usize) -> usize {
    (2 * lanes).clamp(4, 16)
}

/// Buffers a receiver's UCX lane lands rendezvous payloads in before copying them into the device.
pub const RECEIVER_LANE_BUFFERS: usize = 4;

/// Buffers a receiver verifies checksums through (verifications run concurrently on blocking threads).
pub const VERIFY_BUFFERS: usize = 2;

/// Buffers of one kind, lent out and returned: host staging buffers ([`StagingPool`]) or device buffers
/// ([`DevicePool`]).
pub struct Pool<B> {
    free: Mutex<Vec<B>>,
    returned: Condvar,
}

/// Fixed-size host buffers ([`STAGE_BYTES`]).
pub type StagingPool = Pool<Box<[u8]>>;
/// A host buffer on loan from a [`StagingPool`]. Its bytes keep their address while it is lent, so a
/// transport may send from a pointer into it for as long as it holds the buffer.
pub type StagedBuf = Loan<Box<[u8]>>;

impl<B> Pool<B> {
    fn of(free: Vec<B>) -> Arc<Self> {
        Arc::new(Pool { free: Mutex::new(free), returned: Condvar::new() })
    }

    /// A free buffer, waiting for one to come back until `deadline` (`None` then).
    pub fn take_until(self: &Arc<Self>, deadline: Instant) -> Option<Loan<B>> {
        // A buffer comes back when a transport's thread finished with it: poll first, as a sleeping
        // shipping thread woken per buffer let the link run dry between 32 MiB messages.
        let mut polled = None;
        crate::wait::spin_until(deadline, || {
            polled = self.try_take();
            polled.is_some()
        });
        if polled.is_some() {
            return polled;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(buf) = free.pop() {
                return Some(Loan { buf: Some(buf), pool: self.clone() });
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            free = self.returned.wait_timeout(free, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// A free buffer if one is there now (for progress threads, which must not wait).
    pub fn try_take(self: &Arc<Self>) -> Option<Loan<B>> {
        let buf = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        Some(Loan { buf: Some(buf), pool: self.clone() })
    }

    /// Buffers not lent out (tests check none leaks).
    pub fn available(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl StagingPool {
    /// `buffers` buffers of [`STAGE_BYTES`], allocated now.
    pub fn new(buffers: usize) -> Arc<StagingPool> {
        Pool::of((0..buffers).map(|_| vec![0u8; STAGE_BYTES].into_boxed_slice()).collect())
    }
}

/// A buffer on loan from a [`Pool`]; dropping it returns it.
pub struct Loan<B> {
    buf: Option<B>,
    pool: Arc<Pool<B>>,
}

impl<B> Drop for Loan<B> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
            self.pool.returned.notify_one();
        }
    }
}

impl Deref for StagedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or_default()
    }
}

impl DerefMut for StagedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().unwrap_or_default()
    }
}

/// The most one gathered write carries (a CUDA-capable UCX moving device layers: a stretch of the
/// request's stream, one or more layers' latent entries and indexer blocks, is gathered on the sender's
/// GPU, sent as one message and scattered on the receiver's): 1.3 layers of a 32K-token request, 41 of
/// a 1K-token one.
pub const STREAM_CHUNK: usize = kv_cache::TRANSFER_CHUNK;

/// Device buffers of [`STREAM_CHUNK`] a sender gathers into, and each receiver lane lands gathered writes
/// in (128 MiB a side per lane, counted in the backend's memory budget).
pub const DEVICE_BUFFERS: usize = kv_cache::TRANSFER_BUFFERS;

/// Layers with more puts than this (a scattered block table) are gathered on the device; so are layers
/// small enough that two fit a [`STREAM_CHUNK`]. Larger layers of few runs go a put per run.
pub const GATHER_MIN_PUTS: usize = 16;

/// Fixed-size device buffers ([`STREAM_CHUNK`]).
pub type DevicePool = Pool<Box<dyn DeviceBuffer>>;
/// A device buffer on loan from a [`DevicePool`].
pub type DeviceBuf = Loan<Box<dyn DeviceBuffer>>;

impl DevicePool {
    /// [`DEVICE_BUFFERS`] buffers of [`STREAM_CHUNK`] from `arena`'s device; `None` where the arena is
    /// not device memory that can lend buffers.
    pub fn for_arena(arena: &KvArena) -> Option<Result<Arc<DevicePool>, String>> {
        let copier = arena.device_copier()?;
        let mut free = Vec::new();
        for _ in 0..DEVICE_BUFFERS {
            match copier.alloc(STREAM_CHUNK)? {
                Ok(b) => free.push(b),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(Pool::of(free)))
    }
}

impl DeviceBuf {
    pub fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.addr())
    }

    pub fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A [`DevicePool`] made on first use (device memory only for a side that gathers or lands scattered
/// layers); its error is kept and reported to every later use.
#[derive(Default)]
pub struct LazyDevicePool(std::sync::OnceLock<Result<Arc<DevicePool>, String>>);

impl LazyDevicePool {
    /// The pool for `arena`'s device, made now if need be; `None` where the arena cannot lend buffers.
    pub fn get(&self, arena: &KvArena) -> Option<Result<Arc<DevicePool>, String>> {
        arena.device_copier()?;
        let r = self.0.get_or_init(|| {
            DevicePool::for_arena(arena).unwrap_or_else(|| Err("the device cannot lend transfer buffers".into()))
        });
        Some(r.clone())
    }
}

/// The piece size for staged writes of `unit`-sized items (latent entries or indexer blocks): the most
/// whole items that fit `max` bytes, so the receiver admits every piece (latent writes must hold whole
/// entries).
pub fn piece_bytes(unit: u64, max: u64) -> u64 {
    if unit == 0 || unit > max { max } else { max / unit * unit }
}

/// The digest of `segments` (offset, length) of `arena`, read through `buf` with `copy_out`: the same
/// digest [`crate::layout::checksum_segments`] computes over host memory.
///
/// # Safety
/// No one writes the segments during the call (see [`KvArena::copy_out`]).
pub unsafe fn checksum_copied(
    arena: &KvArena,
    segments: impl Iterator<Item = (u64, u64)>,
    buf: &mut [u8],
) -> Result<u64, ArenaError> {
    let mut h = Sum64::new();
    for (off, len) in segments {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            // SAFETY: forwarded contract.
            unsafe { arena.copy_out((off + done) as usize, &mut buf[..n]) }?;
            h.update(&buf[..n]);
            done += n as u64;
        }
    }
    Ok(h.digest())
}

/// The digest of `segments` of a device arena: computed on the device where its [`kv_cache::DeviceCopy`]
/// can, else over host copies read through the buffer `buf` gives (called only then).
///
/// # Safety
/// As [`checksum_copied`].
pub unsafe fn checksum_device<B: DerefMut<Target = [u8]>>(
    arena: &KvArena,
    segments: &[(u64, u64)],
    buf: impl FnOnce() -> Result<B, String>,
) -> Result<u64, String> {
    if let Some(r) = arena.device_checksum(segments) {
        return r.map_err(|e| e.to_string());
    }
    let mut buf = buf()?;
    // SAFETY: forwarded contract.
    unsafe { checksum_copied(arena, segments.iter().copied(), &mut buf) }.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn buffers_come_back_when_dropped_and_waiters_wake() {
        let pool = StagingPool::new(2);
        let a = pool.try_take().unwrap();
        let b = pool.take_until(Instant::now()).unwrap();
        assert_eq!(a.len(), STAGE_BYTES);
        assert!(pool.try_take().is_none());
        assert!(pool.take_until(Instant::now() + Duration::from_millis(20)).is_none(), "bounded wait");
        let addr = a.as_ptr();
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || p2.take_until(Instant::now() + Duration::from_secs(5)).is_some());
        std::thread::sleep(Duration::from_millis(20));
        drop(a);
        assert!(waiter.join().unwrap(), "a returned buffer wakes a waiter");
        drop(b);
        assert_eq!(pool.available(), 2);
        assert!([pool.try_take().unwrap().as_ptr(), pool.try_take().unwrap().as_ptr()].contains(&addr), "reused");
    }

    #[test]
    fn pieces_hold_whole_entries_and_blocks() {
        assert_eq!(piece_bytes(656, STAGE_BYTES as u64), 1598 * 656);
        assert_eq!(piece_bytes(8448, STAGE_BYTES as u64), 124 * 8448);
        assert_eq!(piece_bytes(32768, STAGE_BYTES as u64), STAGE_BYTES as u64);
        assert_eq!(piece_bytes(3 << 20, STAGE_BYTES as u64), STAGE_BYTES as u64);
    }

    #[test]
    fn copied_checksums_match_the_host_digest() {
        let arena = KvArena::new_host(10_000).unwrap();
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        unsafe { arena.copy_in(0, &bytes) }.unwrap();
        let segs = [(100u64, 3000u64), (5000, 4321)];
        let want = unsafe { crate::layout::checksum_segments(arena.as_ptr(), segs.iter().copied()) };
        let mut buf = vec![0u8; 1000];
        assert_eq!(unsafe { checksum_copied(&arena, segs.iter().copied(), &mut buf) }.unwrap(), want);
    }
}
