//! The receiver's per-transfer state machine, shared by every transport.
//!
//! ```text
//! Expected --Begin ok--> Active --Complete--> Verifying --ok--> (Completed: blocks stay with the request)
//!    |                     |  \--Release / sender Abort--> Done (blocks freed)
//!    |                     \--deadline / client abort--> Aborting --sender ack--> Done (blocks freed)
//!    \--deadline / client abort--> Done (blocks freed at once: nothing was accepted, nothing written)
//! ```
//!
//! Block-freeing policy: blocks return to the pool only when no write can land in them any more:
//! - nothing accepted yet (our senders never write before `Accept`): at once;
//! - the sender said it is done (Complete, Release, Abort, or its ack of our Abort; it flushes its puts
//!   before sending any of them): at once, after writes in progress through `admit_write` drained;
//! - receiver-mediated peers (TCP, in-process, UCX active messages) that died or were dropped: at once,
//!   because every write passes `admit_write`, which refuses writes to inactive transfers;
//! - one-sided peers (UCX RMA) that died, or did not acknowledge our abort within `abort_ack_timeout`
//!   (then we close their endpoint): after `quarantine`, counted in `ReceiverStats::quarantined_blocks`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use engine::cache::{BlockPool, CacheGeometry, KvCache};
use proto::v1::transfer_control::Body;
use proto::v1::{
    CacheLayout, ModelFingerprint, TransferAbort, TransferAccept, TransferAck, TransferBegin, TransferComplete,
    TransferControl, TransferRelease, TransferStatus,
};

use super::{CompletedTransfer, ReleasedTransfer, TransferOutcome};
use crate::layout::{self, checksum_segments};
use crate::transport::{PeerLink, control, next_id};
use crate::wait::Cell;
use crate::{TransferError, fingerprint};

/// A completion (correlation id, message, sender) waiting for writes in progress.
type DeferredComplete = (u64, TransferComplete, Arc<dyn PeerLink>);

pub(crate) type OutcomeCell = Arc<Cell<Result<TransferOutcome, TransferError>>>;

/// Timing policy of the receiver.
#[derive(Debug, Clone, Copy)]
pub struct ReceiverTimings {
    /// How long a one-sided sender has to acknowledge our abort before we close its endpoint.
    pub abort_ack_timeout: Duration,
    /// How long blocks stay out of the pool after a one-sided sender was lost.
    pub quarantine: Duration,
}

enum Phase {
    Expected,
    Active(Arc<dyn PeerLink>),
    Aborting(Arc<dyn PeerLink>),
    Verifying,
    Done,
}

pub(crate) struct Transfer {
    pub session: u64,
    pub request_id: String,
    token: u64,
    num_tokens: u32,
    blocks: Vec<u32>,
    /// Block id -> index in `blocks`, for write admission.
    block_index: HashMap<u32, u32>,
    verify_checksum: bool,
    deadline: Instant,
    started: Mutex<Option<Instant>>,
    phase: Mutex<Phase>,
    /// Mirror of `Phase::Active` for the write fast path.
    active: AtomicBool,
    inflight: AtomicUsize,
    latent_written: Vec<AtomicU64>,
    indexer_written: Vec<AtomicU64>,
    pub outcome: OutcomeCell,
    /// The wire status of a failure, for tombstones.
    terminal: Mutex<Option<(TransferStatus, String)>>,
    free: Mutex<FreeState>,
    /// Complete waiting for writes in progress to drain.
    deferred_complete: Mutex<Option<DeferredComplete>>,
}

#[derive(Default)]
struct FreeState {
    requested: bool,
    done: bool,
}

impl Transfer {
    fn lock_phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct Tables {
    by_session: HashMap<u64, Arc<Transfer>>,
    by_request: HashMap<String, u64>,
    /// Why recently finished sessions ended, so a sender's late message gets the real reason.
    tombstones: HashMap<u64, (TransferStatus, String)>,
    tombstone_order: std::collections::VecDeque<u64>,
}

const TOMBSTONES: usize = 4096;

/// Live counters of a receiver.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub completed: AtomicU64,
    pub released: AtomicU64,
    pub failed: AtomicU64,
    pub rejected_handshakes: AtomicU64,
    pub quarantined_blocks: AtomicUsize,
    pub bytes_received: AtomicU64,
}

pub struct ReceiverCore {
    pub(crate) geometry: CacheGeometry,
    pub(crate) layout: CacheLayout,
    pub(crate) cache: Arc<KvCache>,
    pool: Arc<BlockPool>,
    pub(crate) fingerprint: ModelFingerprint,
    timings: ReceiverTimings,
    rt: tokio::runtime::Handle,
    tables: Mutex<Tables>,
    pub(crate) counters: Counters,
}

/// Why a receiver-mediated write was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The transfer is gone or no longer active (aborted, expired, completed): drop the bytes.
    Stale,
    /// The write is outside the transfer's blocks or malformed; the transfer has been failed.
    Invalid(String),
}

/// Permission to write `len` bytes at `ptr`, inside one layer of one transfer's blocks. Dropping it ends
/// the write; call `commit` first when the bytes arrived.
pub struct WritePermit {
    core: Arc<ReceiverCore>,
    t: Arc<Transfer>,
    pub ptr: *mut u8,
    pub len: usize,
    layer: usize,
    latent: bool,
    committed: bool,
}

// SAFETY: the permit is the exclusive right to write its range (checked against the transfer's blocks).
unsafe impl Send for WritePermit {}

impl WritePermit {
    /// The destination bytes.
    ///
    /// # Safety
    /// Only one slice per permit may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self) -> &mut [u8] {
        // SAFETY: admitted range inside the arena, owned by this transfer, only this permit writes it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Records that every byte of the permit was written.
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for WritePermit {
    fn drop(&mut self) {
        if self.committed {
            let c = if self.latent { &self.t.latent_written } else { &self.t.indexer_written };
            c[self.layer].fetch_add(self.len as u64, Ordering::Relaxed);
            self.core.counters.bytes_received.fetch_add(self.len as u64, Ordering::Relaxed);
        }
        if self.t.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.core.on_quiescent(&self.t);
        }
    }
}

impl ReceiverCore {
    pub(crate) fn new(
        cache: Arc<KvCache>,
        pool: Arc<BlockPool>,
        fingerprint: ModelFingerprint,
        timings: ReceiverTimings,
        rt: tokio::runtime::Handle,
    ) -> Self {
        let geometry = *cache.geometry();
        ReceiverCore {
            layout: layout::layout_of(&geometry),
            geometry,
            cache,
            pool,
            fingerprint,
            timings,
            rt,
            tables: Mutex::new(Tables::default()),
            counters: Counters::default(),
        }
    }

    fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.rt
    }

    pub(crate) fn pending_transfers(&self) -> usize {
        self.tables().by_session.len()
    }

    /// Registers an expected transfer; the caller has checked the reservation.
    pub(crate) fn register(
        self: &Arc<Self>,
        request_id: &str,
        token: u64,
        num_tokens: u32,
        blocks: Vec<u32>,
        deadline: Instant,
        verify_checksum: bool,
    ) -> Result<Arc<Transfer>, TransferError> {
        let session = next_id();
        let layers = self.geometry.num_layers;
        let t = Arc::new(Transfer {
            session,
            request_id: request_id.to_string(),
            token,
            num_tokens,
            block_index: blocks.iter().enumerate().map(|(i, &b)| (b, i as u32)).collect(),
            blocks,
            verify_checksum,
            deadline,
            started: Mutex::new(None),
            phase: Mutex::new(Phase::Expected),
            active: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            latent_written: (0..layers).map(|_| AtomicU64::new(0)).collect(),
            indexer_written: (0..layers).map(|_| AtomicU64::new(0)).collect(),
            outcome: Cell::new(),
            terminal: Mutex::new(None),
            free: Mutex::new(FreeState::default()),
            deferred_complete: Mutex::new(None),
        });
        {
            let mut tb = self.tables();
            if tb.by_request.contains_key(request_id) {
                return Err(TransferError::Duplicate(request_id.to_string()));
            }
            tb.by_request.insert(request_id.to_string(), session);
            tb.by_session.insert(session, t.clone());
        }
        let core = self.clone();
        let tt = t.clone();
        self.rt.spawn(async move {
            tokio::time::sleep_until(deadline.into()).await;
            core.fail(&tt, TransferError::DeadlineExceeded(tt.request_id.clone()), "deadline exceeded");
        });
        Ok(t)
    }

    pub(crate) fn lookup_request(&self, request_id: &str) -> Option<Arc<Transfer>> {
        let tb = self.tables();
        tb.by_request.get(request_id).and_then(|s| tb.by_session.get(s)).cloned()
    }

    fn forget(&self, t: &Transfer) {
        let terminal = t.terminal.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut tb = self.tables();
        if tb.by_session.remove(&t.session).is_some() {
            tb.by_request.remove(&t.request_id);
            if let Some(why) = terminal {
                tb.tombstones.insert(t.session, why);
                tb.tombstone_order.push_back(t.session);
                if tb.tombstone_order.len() > TOMBSTONES
                    && let Some(old) = tb.tombstone_order.pop_front()
                {
                    tb.tombstones.remove(&old);
                }
            }
        }
    }

    /// Fails `t` with `err` (deadline, client abort, protocol violation). Returns false when it had
    /// already finished.
    pub(crate) fn fail(self: &Arc<Self>, t: &Arc<Transfer>, err: TransferError, reason: &str) -> bool {
        let mut ph = t.lock_phase();
        match std::mem::replace(&mut *ph, Phase::Done) {
            Phase::Expected => {
                drop(ph);
                t.active.store(false, Ordering::SeqCst);
                self.finish_err(t, err);
                self.forget(t);
                self.free_now(t);
                true
            }
            Phase::Active(peer) => {
                t.active.store(false, Ordering::SeqCst);
                let abort = Body::Abort(TransferAbort {
                    session_id: t.session,
                    transfer_token: t.token,
                    reason: reason.to_string(),
                    status: err.wire_status() as i32,
                });
                self.finish_err(t, err);
                if peer.one_sided() {
                    *ph = Phase::Aborting(peer.clone());
                    drop(ph);
                    peer.send(control(next_id(), abort));
                    let core = self.clone();
                    let tt = t.clone();
                    let wait = self.timings.abort_ack_timeout;
                    self.rt.spawn(async move {
                        tokio::time::sleep(wait).await;
                        core.abort_ack_timed_out(&tt);
                    });
                } else {
                    drop(ph);
                    // Every write passes admit_write, which now refuses: free once writes in progress end.
                    peer.send(control(next_id(), abort));
                    self.forget(t);
                    self.free_now(t);
                }
                true
            }
            Phase::Verifying => {
                *ph = Phase::Verifying;
                drop(ph);
                // The sender already finished; verification frees the blocks when it sees this outcome.
                self.finish_err(t, err)
            }
            other => {
                *ph = other;
                false
            }
        }
    }

    fn finish_err(&self, t: &Transfer, err: TransferError) -> bool {
        t.terminal.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert((err.wire_status(), err.to_string()));
        let set = t.outcome.set(Err(err.clone()));
        if set {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(request_id = %t.request_id, error = %err, "kv transfer failed");
        }
        set
    }

    fn abort_ack_timed_out(self: &Arc<Self>, t: &Arc<Transfer>) {
        let mut ph = t.lock_phase();
        if let Phase::Aborting(peer) = std::mem::replace(&mut *ph, Phase::Done) {
            drop(ph);
            tracing::warn!(request_id = %t.request_id, "sender did not acknowledge the abort; closing its endpoint, quarantining blocks");
            peer.close();
            self.forget(t);
            self.free_after_quarantine(t);
        }
    }

    /// A peer's connection died.
    pub(crate) fn peer_lost(self: &Arc<Self>, peer_id: u64, reason: &str) {
        let transfers: Vec<Arc<Transfer>> = self.tables().by_session.values().cloned().collect();
        for t in transfers {
            let mut ph = t.lock_phase();
            let peer = match &*ph {
                Phase::Active(p) | Phase::Aborting(p) if p.id() == peer_id => p.clone(),
                _ => continue,
            };
            *ph = Phase::Done;
            drop(ph);
            t.active.store(false, Ordering::SeqCst);
            let err = TransferError::PeerLost { request_id: t.request_id.clone(), reason: reason.to_string() };
            t.terminal.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert((err.wire_status(), err.to_string()));
            self.forget(&t);
            // Blocks first (freed or visibly quarantined), then the outcome the worker waits on.
            if peer.one_sided() {
                self.free_after_quarantine(&t)
            } else {
                self.free_now(&t)
            }
            self.finish_err(&t, err);
        }
    }

    /// Frees the blocks once writes in progress drained.
    fn free_now(&self, t: &Arc<Transfer>) {
        {
            let mut f = t.free.lock().unwrap_or_else(|p| p.into_inner());
            f.requested = true;
        }
        self.try_free(t);
    }

    fn try_free(&self, t: &Arc<Transfer>) {
        if t.inflight.load(Ordering::SeqCst) != 0 {
            return;
        }
        let mut f = t.free.lock().unwrap_or_else(|p| p.into_inner());
        if !f.requested || f.done {
            return;
        }
        f.done = true;
        drop(f);
        match self.pool.release(&t.request_id) {
            Ok(n) => tracing::debug!(request_id = %t.request_id, blocks = n, "kv transfer blocks freed"),
            Err(e) => tracing::warn!(request_id = %t.request_id, error = %e, "freeing a failed transfer's blocks"),
        }
    }

    fn free_after_quarantine(self: &Arc<Self>, t: &Arc<Transfer>) {
        {
            let mut f = t.free.lock().unwrap_or_else(|p| p.into_inner());
            if f.done {
                return;
            }
            f.requested = true;
            f.done = true;
        }
        let n = t.blocks.len();
        self.counters.quarantined_blocks.fetch_add(n, Ordering::SeqCst);
        let q = self.timings.quarantine;
        let core = self.clone();
        let id = t.request_id.clone();
        self.rt.spawn(async move {
            tokio::time::sleep(q).await;
            match core.pool.release(&id) {
                Ok(n) => tracing::info!(request_id = %id, blocks = n, "quarantined blocks freed"),
                Err(e) => tracing::warn!(request_id = %id, error = %e, "freeing quarantined blocks"),
            }
            core.counters.quarantined_blocks.fetch_sub(n, Ordering::SeqCst);
        });
    }

    /// Writes in progress for `t` reached zero.
    fn on_quiescent(self: &Arc<Self>, t: &Arc<Transfer>) {
        self.try_free(t);
        let deferred = t.deferred_complete.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((corr, c, peer)) = deferred {
            self.verify(t.clone(), corr, c, peer);
        }
    }

    /// Admits a receiver-mediated write of `len` bytes at pool offset `offset` for `session`.
    pub fn admit_write(
        self: &Arc<Self>,
        session: u64,
        token: u64,
        offset: u64,
        len: u64,
    ) -> Result<WritePermit, Refusal> {
        let Some(t) = self.tables().by_session.get(&session).cloned() else { return Err(Refusal::Stale) };
        if t.token != token {
            return Err(Refusal::Invalid(format!("request {}: write with a wrong token", t.request_id)));
        }
        t.inflight.fetch_add(1, Ordering::SeqCst);
        let permit = |layer, latent| WritePermit {
            core: self.clone(),
            t: t.clone(),
            // SAFETY (of later use): the range is checked below to lie inside the arena.
            ptr: self.cache.arena().as_ptr().wrapping_add(offset as usize),
            len: len as usize,
            layer,
            latent,
            committed: false,
        };
        if !t.active.load(Ordering::SeqCst) {
            drop(permit(0, true));
            return Err(Refusal::Stale);
        }
        match self.classify(&t, offset, len) {
            Ok((layer, latent)) => Ok(permit(layer, latent)),
            Err(why) => {
                drop(permit(0, true));
                let why = format!("request {}: {why}", t.request_id);
                self.fail(
                    &t,
                    TransferError::BadCompletion { request_id: t.request_id.clone(), reason: why.clone() },
                    &why,
                );
                Err(Refusal::Invalid(why))
            }
        }
    }

    /// (layer, is_latent) of a write, if it lies inside one layer's blocks of `t`.
    fn classify(&self, t: &Transfer, offset: u64, len: u64) -> Result<(usize, bool), String> {
        let g = &self.geometry;
        let end = offset.checked_add(len).ok_or("write range overflows")?;
        if len == 0 || end > g.total_bytes() as u64 {
            return Err(format!("write {offset}+{len} outside the pool"));
        }
        let (base, stride, unit, latent) = if offset < g.indexer_region_offset() as u64 {
            (0u64, g.latent_layer_stride() as u64, g.latent_bytes_per_block() as u64, true)
        } else {
            (
                g.indexer_region_offset() as u64,
                g.indexer_layer_stride() as u64,
                g.indexer_bytes_per_block() as u64,
                false,
            )
        };
        let rel = offset - base;
        let layer = (rel / stride) as usize;
        let in_layer = rel % stride;
        if in_layer + len > stride || layer >= g.num_layers {
            return Err(format!("write {offset}+{len} crosses a layer boundary"));
        }
        let first = in_layer / unit;
        let last = (in_layer + len - 1) / unit;
        let mut prev: Option<u32> = None;
        for b in first..=last {
            let Some(&idx) = t.block_index.get(&(b as u32)) else {
                return Err(format!("write into block {b}, which the transfer does not own"));
            };
            if prev.is_some_and(|p| p + 1 != idx) {
                return Err(format!("write spans blocks out of the request's order at block {b}"));
            }
            prev = Some(idx);
        }
        if latent
            && (!in_layer.is_multiple_of(g.latent_bytes_per_token() as u64)
                || !len.is_multiple_of(g.latent_bytes_per_token() as u64))
        {
            return Err("latent write not aligned to entries".into());
        }
        Ok((layer, latent))
    }

    /// A control message from `peer`.
    pub fn on_control(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, msg: TransferControl) {
        let corr = msg.correlation_id;
        match msg.body {
            Some(Body::Begin(b)) => self.on_begin(peer, corr, b),
            Some(Body::Complete(c)) => self.on_complete(peer, corr, c),
            Some(Body::Release(r)) => self.on_release(peer, corr, r),
            Some(Body::Abort(a)) => self.on_sender_abort(peer, corr, a),
            Some(Body::Ack(a)) => self.on_ack(peer, a),
            Some(Body::Accept(_)) | None => {
                peer.send(ack(corr, 0, TransferStatus::Protocol, "unexpected message"));
            }
        }
    }

    fn on_begin(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, b: TransferBegin) {
        let reject = |status: TransferStatus, message: String| {
            self.counters.rejected_handshakes.fetch_add(1, Ordering::Relaxed);
            tracing::info!(request_id = %b.request_id, ?status, message, "kv transfer handshake rejected");
            peer.send(ack(corr, 0, status, &message));
        };
        let Some(t) = self.lookup_request(&b.request_id) else {
            return reject(TransferStatus::UnknownRequest, format!("no transfer expected for {}", b.request_id));
        };
        if b.transfer_token != t.token {
            // Not the paired sender: refuse without touching the transfer.
            return reject(TransferStatus::BadToken, "transfer token does not match".into());
        }
        // The paired sender with a mismatching view: the transfer cannot succeed, fail it now.
        let mismatch = if let Err(e) =
            fingerprint::check_fingerprint(&self.fingerprint, &b.fingerprint.clone().unwrap_or_default())
        {
            Some((TransferStatus::FingerprintMismatch, e.to_string()))
        } else if let Err(e) = b.layout.as_ref().ok_or("no layout".to_string()).and_then(|l| {
            if *l == self.layout {
                Ok(())
            } else {
                layout::check_layout(&self.geometry, l).and(Err("layout differs from the receiver's".into()))
            }
        }) {
            Some((TransferStatus::LayoutMismatch, e))
        } else if b.num_tokens != t.num_tokens {
            Some((TransferStatus::BadSize, format!("{} tokens, the reservation is for {}", b.num_tokens, t.num_tokens)))
        } else if b.block_ids != t.blocks {
            Some((TransferStatus::BadBlocks, "block ids differ from the reservation".into()))
        } else {
            None
        };
        let mut ph = t.lock_phase();
        match &*ph {
            Phase::Expected => {}
            _ => {
                drop(ph);
                return reject(TransferStatus::AlreadyStarted, "transfer already started or finished".into());
            }
        }
        if let Some((status, message)) = mismatch {
            drop(ph);
            reject(status, message.clone());
            let err = TransferError::Rejected {
                request_id: t.request_id.clone(),
                status: crate::RejectStatus::from_wire(status).unwrap_or(crate::RejectStatus::Protocol),
                message,
            };
            self.fail(&t, err, "handshake rejected");
            return;
        }
        if Instant::now() >= t.deadline {
            drop(ph);
            return reject(TransferStatus::DeadlineExceeded, "deadline already passed".into());
        }
        *ph = Phase::Active(peer.clone());
        t.active.store(true, Ordering::SeqCst);
        drop(ph);
        *t.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        tracing::debug!(request_id = %t.request_id, session = t.session, "kv transfer accepted");
        peer.send(control(corr, Body::Accept(TransferAccept { session_id: t.session })));
    }

    /// Finds a session's transfer for a message that must come from its sender.
    fn session_for(&self, peer: &Arc<dyn PeerLink>, corr: u64, session: u64, token: u64) -> Option<Arc<Transfer>> {
        let (t, tomb) = {
            let tb = self.tables();
            (tb.by_session.get(&session).cloned(), tb.tombstones.get(&session).cloned())
        };
        match t {
            None => {
                let (status, why) = tomb.unwrap_or((TransferStatus::UnknownRequest, "no such transfer".into()));
                peer.send(ack(corr, session, status, &why));
                None
            }
            Some(t) if t.token != token => {
                peer.send(ack(corr, session, TransferStatus::BadToken, "transfer token does not match"));
                None
            }
            Some(t) => Some(t),
        }
    }

    fn on_complete(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, c: TransferComplete) {
        let Some(t) = self.session_for(peer, corr, c.session_id, c.transfer_token) else { return };
        let mut ph = t.lock_phase();
        match std::mem::replace(&mut *ph, Phase::Verifying) {
            Phase::Active(p) if p.id() == peer.id() => {}
            Phase::Aborting(_) => {
                // The sender finished before it saw our abort; it flushed, so this acts as the ack.
                *ph = Phase::Done;
                drop(ph);
                peer.send(ack(corr, t.session, TransferStatus::Aborted, "the receiver aborted this transfer"));
                self.forget(&t);
                self.free_now(&t);
                return;
            }
            other => {
                *ph = other;
                drop(ph);
                peer.send(ack(corr, t.session, TransferStatus::Protocol, "completion out of sequence"));
                return;
            }
        }
        drop(ph);
        t.active.store(false, Ordering::SeqCst);
        *t.deferred_complete.lock().unwrap_or_else(|p| p.into_inner()) = Some((corr, c, peer.clone()));
        if t.inflight.load(Ordering::SeqCst) == 0 {
            let d = t.deferred_complete.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some((corr, c, peer)) = d {
                self.verify(t, corr, c, peer);
            }
        }
    }

    /// Checks completeness (and checksums, off the transport's thread), then hands the blocks over.
    fn verify(self: &Arc<Self>, t: Arc<Transfer>, corr: u64, c: TransferComplete, peer: Arc<dyn PeerLink>) {
        let core = self.clone();
        let blocking = needs_blocking(&c);
        let work = move || {
            let result = core.check_completion(&t, &c, peer.one_sided());
            {
                *t.lock_phase() = Phase::Done;
            }
            core.forget(&t);
            match result {
                Ok(checksum_verified) => {
                    let elapsed =
                        t.started.lock().unwrap_or_else(|p| p.into_inner()).map(|s| s.elapsed()).unwrap_or_default();
                    let done = CompletedTransfer {
                        request_id: t.request_id.clone(),
                        first_token: c.first_token.clone().unwrap_or_default(),
                        draft: c.draft,
                        bytes: c.layers.iter().map(|l| l.latent_bytes + l.indexer_bytes).sum(),
                        checksum_verified,
                        elapsed,
                    };
                    if t.outcome.set(Ok(TransferOutcome::Completed(done))) {
                        core.counters.completed.fetch_add(1, Ordering::Relaxed);
                        peer.send(ack(corr, t.session, TransferStatus::Ok, ""));
                    } else {
                        // Aborted (client gone) while verifying: nobody takes the blocks.
                        peer.send(ack(corr, t.session, TransferStatus::Aborted, "aborted by the receiver"));
                        core.free_now(&t);
                    }
                }
                Err((status, reason)) => {
                    core.finish_err(
                        &t,
                        TransferError::BadCompletion { request_id: t.request_id.clone(), reason: reason.clone() },
                    );
                    peer.send(ack(corr, t.session, status, &reason));
                    core.free_now(&t);
                }
            }
        };
        if blocking {
            self.rt.spawn_blocking(work);
        } else {
            work();
        }
    }

    fn check_completion(
        &self,
        t: &Transfer,
        c: &TransferComplete,
        one_sided: bool,
    ) -> Result<bool, (TransferStatus, String)> {
        let g = &self.geometry;
        let want_latent = t.num_tokens as u64 * g.latent_bytes_per_token() as u64;
        let want_indexer = t.blocks.len() as u64 * g.indexer_bytes_per_block() as u64;
        let incomplete = |m: String| Err((TransferStatus::Incomplete, m));
        if c.layers.len() != g.num_layers {
            return incomplete(format!("{} of {} layers reported", c.layers.len(), g.num_layers));
        }
        for (i, l) in c.layers.iter().enumerate() {
            if l.layer as usize != i {
                return incomplete(format!("manifest entry {i} is for layer {}", l.layer));
            }
            if l.latent_bytes != want_latent || l.indexer_bytes != want_indexer {
                return incomplete(format!(
                    "layer {i}: sender wrote {}+{} bytes, expected {want_latent}+{want_indexer}",
                    l.latent_bytes, l.indexer_bytes
                ));
            }
            if !one_sided {
                let (lw, iw) =
                    (t.latent_written[i].load(Ordering::Relaxed), t.indexer_written[i].load(Ordering::Relaxed));
                if lw != want_latent || iw != want_indexer {
                    return incomplete(format!(
                        "layer {i}: {lw}+{iw} bytes arrived, expected {want_latent}+{want_indexer}"
                    ));
                }
            }
        }
        if !t.verify_checksum {
            return Ok(false);
        }
        let blocks: Vec<engine::cache::BlockId> = t.blocks.iter().map(|&b| engine::cache::BlockId(b)).collect();
        let plan = layout::PutPlan::new(self.layout, self.layout, &blocks, &blocks, t.num_tokens as usize);
        for l in &c.layers {
            let Some(want) = l.checksum else {
                return Err((TransferStatus::ChecksumMismatch, format!("layer {} has no checksum", l.layer)));
            };
            let segs = plan.layer_puts(engine::cache::LayerIdx(l.layer)).map(|p| (p.dst_offset, p.len));
            // SAFETY: the transfer owns these blocks and no write is admitted any more.
            let got = unsafe { checksum_segments(self.cache.arena().as_ptr(), segs) };
            if got != want {
                return Err((
                    TransferStatus::ChecksumMismatch,
                    format!("layer {} checksum {got:016x} != sender's {want:016x}", l.layer),
                ));
            }
        }
        Ok(true)
    }

    fn on_release(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, r: TransferRelease) {
        let Some(t) = self.session_for(peer, corr, r.session_id, r.transfer_token) else { return };
        let mut ph = t.lock_phase();
        let was = std::mem::replace(&mut *ph, Phase::Done);
        drop(ph);
        t.active.store(false, Ordering::SeqCst);
        match was {
            Phase::Active(_) => {
                let rel = ReleasedTransfer {
                    request_id: t.request_id.clone(),
                    first_token: r.first_token.unwrap_or_default(),
                    finish_reason: proto::v1::FinishReason::try_from(r.finish_reason).unwrap_or_default(),
                };
                if t.outcome.set(Ok(TransferOutcome::Released(rel))) {
                    self.counters.released.fetch_add(1, Ordering::Relaxed);
                }
                peer.send(ack(corr, t.session, TransferStatus::Ok, ""));
            }
            Phase::Aborting(_) => peer.send(ack(corr, t.session, TransferStatus::Aborted, "aborted by the receiver")),
            other => {
                *t.lock_phase() = other;
                peer.send(ack(corr, t.session, TransferStatus::Protocol, "release out of sequence"));
                return;
            }
        }
        self.forget(&t);
        self.free_now(&t);
    }

    fn on_sender_abort(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, a: TransferAbort) {
        let Some(t) = self.session_for(peer, corr, a.session_id, a.transfer_token) else { return };
        let mut ph = t.lock_phase();
        let was = std::mem::replace(&mut *ph, Phase::Done);
        drop(ph);
        match was {
            Phase::Active(_) | Phase::Aborting(_) | Phase::Expected => {
                t.active.store(false, Ordering::SeqCst);
                self.finish_err(
                    &t,
                    TransferError::Aborted {
                        request_id: t.request_id.clone(),
                        reason: format!("sender: {}", a.reason),
                    },
                );
                peer.send(ack(corr, t.session, TransferStatus::Ok, ""));
                self.forget(&t);
                self.free_now(&t);
            }
            other => {
                *t.lock_phase() = other;
                peer.send(ack(corr, t.session, TransferStatus::Protocol, "abort out of sequence"));
            }
        }
    }

    /// The sender acknowledged our abort: its puts are flushed and it issues no more.
    fn on_ack(self: &Arc<Self>, _peer: &Arc<dyn PeerLink>, a: TransferAck) {
        let Some(t) = self.tables().by_session.get(&a.session_id).cloned() else { return };
        let mut ph = t.lock_phase();
        if matches!(&*ph, Phase::Aborting(_)) {
            *ph = Phase::Done;
            drop(ph);
            self.forget(&t);
            self.free_now(&t);
        }
    }
}

fn needs_blocking(c: &TransferComplete) -> bool {
    c.layers.iter().any(|l| l.checksum.is_some())
}

pub(crate) fn ack(corr: u64, session: u64, status: TransferStatus, message: &str) -> TransferControl {
    control(corr, Body::Ack(TransferAck { session_id: session, status: status as i32, message: message.to_string() }))
}
