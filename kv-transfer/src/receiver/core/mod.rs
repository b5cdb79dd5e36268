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
//!   because every write passes `admit_write`, which refuses writes to inactive transfers; a write in
//!   progress that does not end within `abort_ack_timeout` of the failure gets its sender cut off (TCP
//!   also drops a connection whose frame stalls for `write_stall`);
//! - one-sided peers (UCX RMA) that died, or did not acknowledge our abort within `abort_ack_timeout`
//!   (then we close their endpoint): after `quarantine`, counted in `ReceiverStats::quarantined_blocks`.

mod admit;
mod messages;

pub use admit::{Refusal, StreamPermit, WritePermit};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_cache::{BlockPool, CacheGeometry, KvCache};
use proto::v1::transfer_control::Body;
use proto::v1::{
    CacheLayout, ModelFingerprint, TransferAbort, TransferAck, TransferComplete, TransferControl, TransferStatus,
};

use super::TransferOutcome;
use crate::TransferError;
use crate::layout;
use crate::staging::{self, StagingPool};
use crate::token::TransferToken;
use crate::transport::{PeerLink, control, next_id};
use crate::wait::Cell;

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
    /// The longest a sender may pause inside one TCP data frame before its connection is dropped.
    pub write_stall: Duration,
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
    /// The descriptor's token: opens the one handshake.
    token: TransferToken,
    /// Handed to the accepted sender only; authenticates the session's later messages and writes.
    session_token: TransferToken,
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
    /// This side's put plan of the request (its blocks to themselves), built on the first gathered write:
    /// it maps a layer's stream ranges to the transfer's blocks.
    stream_plan: std::sync::OnceLock<layout::PutPlan>,
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
    /// Why recently finished sessions ended, so a sender's late message gets the real reason (only a
    /// message carrying the session's token).
    tombstones: HashMap<u64, Tombstone>,
    tombstone_order: std::collections::VecDeque<u64>,
}

#[derive(Clone)]
struct Tombstone {
    token: TransferToken,
    status: TransferStatus,
    why: String,
}

const TOMBSTONES: usize = 4096;

/// Live counters of a receiver.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub completed: AtomicU64,
    pub released: AtomicU64,
    pub failed: AtomicU64,
    pub rejected_handshakes: AtomicU64,
    pub dropped_untrusted: AtomicU64,
    pub cut_off_peers: AtomicU64,
    pub quarantined_blocks: AtomicUsize,
    pub bytes_received: AtomicU64,
    pub stream_bytes_received: AtomicU64,
    pub stream_writes_received: AtomicU64,
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
    /// Buffers checksums of a device pool are read through (`None` for host pools, hashed in place).
    pub(crate) staging: Option<Arc<StagingPool>>,
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
            pool,
            fingerprint,
            timings,
            rt,
            tables: Mutex::new(Tables::default()),
            counters: Counters::default(),
            staging: cache.stages_through_host().then(|| StagingPool::new(staging::VERIFY_BUFFERS)),
            cache,
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

    pub(crate) fn timings(&self) -> &ReceiverTimings {
        &self.timings
    }

    pub(crate) fn pending_transfers(&self) -> usize {
        self.tables().by_session.len()
    }

    /// Registers an expected transfer; the caller has checked the reservation.
    pub(crate) fn register(
        self: &Arc<Self>,
        request_id: &str,
        token: TransferToken,
        num_tokens: u32,
        blocks: Vec<u32>,
        deadline: Instant,
        verify_checksum: bool,
    ) -> Result<Arc<Transfer>, TransferError> {
        let session = self.fresh_session_id();
        let layers = self.geometry.num_layers;
        let t = Arc::new(Transfer {
            session,
            request_id: request_id.to_string(),
            token,
            session_token: TransferToken::generate()?,
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
            stream_plan: std::sync::OnceLock::new(),
        });
        {
            let mut tb = self.tables();
            if tb.by_request.contains_key(request_id) {
                return Err(TransferError::Duplicate(request_id.to_string()));
            }
            if tb.by_session.contains_key(&session) || tb.tombstones.contains_key(&session) {
                // Two draws of 64 random bits met between the draw and here; the caller may retry.
                return Err(TransferError::Transport("session id collision".into()));
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

    /// A random session id (never 0) no live or remembered session has: ids are not sequential, so one
    /// session's id says nothing about the others'.
    fn fresh_session_id(&self) -> u64 {
        let tb = self.tables();
        loop {
            let id = rand::random::<u64>();
            if id != 0 && !tb.by_session.contains_key(&id) && !tb.tombstones.contains_key(&id) {
                return id;
            }
        }
    }

    /// Whether the pool still holds `t`'s reservation as it was granted. A reservation freed (or taken
    /// again under the same id) behind the transfer's back takes the token with it.
    fn reservation_intact(&self, t: &Transfer) -> bool {
        self.pool.table(&t.request_id).is_some_and(|table| {
            table.len() >= t.blocks.len() && table.blocks.iter().zip(&t.blocks).all(|(b, &want)| b.0 == want)
        })
    }

    /// Ends an expected transfer whose reservation is gone, without freeing blocks it no longer owns.
    fn orphan(&self, t: &Arc<Transfer>) {
        {
            // Checked and set under one guard: a concurrent fail() either ran first or finds it Done.
            let mut ph = t.lock_phase();
            if !matches!(*ph, Phase::Expected) {
                return;
            }
            *ph = Phase::Done;
        }
        t.active.store(false, Ordering::SeqCst);
        {
            // Nothing is freed: the blocks went back to the pool without us.
            let mut f = t.free.lock().unwrap_or_else(|p| p.into_inner());
            f.requested = true;
            f.done = true;
        }
        let why = "the reservation was freed outside the transfer".to_string();
        let err = TransferError::Aborted { request_id: t.request_id.clone(), reason: why };
        self.note_terminal(t, &err);
        self.forget(t);
        self.finish_err(t, err);
    }

    /// Messages from senders that never proved they hold a descriptor, dropped unanswered.
    pub(crate) fn count_dropped_untrusted(&self, n: u64) {
        self.counters.dropped_untrusted.fetch_add(n, Ordering::Relaxed);
    }

    /// A peer disconnected for flooding or not reading its replies.
    pub(crate) fn count_cut_off(&self) {
        self.counters.cut_off_peers.fetch_add(1, Ordering::Relaxed);
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
            if let Some((status, why)) = terminal {
                tb.tombstones.insert(t.session, Tombstone { token: t.session_token.clone(), status, why });
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
                // Gone from the tables (and its blocks freed) before the outcome is seen.
                self.note_terminal(t, &err);
                self.forget(t);
                self.free_now(t);
                self.finish_err(t, err);
                true
            }
            Phase::Active(peer) => {
                t.active.store(false, Ordering::SeqCst);
                let abort = Body::Abort(TransferAbort {
                    session_id: t.session,
                    session_token: t.session_token.to_vec(),
                    reason: reason.to_string(),
                    status: err.wire_status() as i32,
                });
                if peer.one_sided() {
                    self.finish_err(t, err);
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
                    self.note_terminal(t, &err);
                    self.forget(t);
                    self.free_now(t);
                    self.finish_err(t, err);
                    self.cut_off_if_stuck(t, peer);
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

    /// Records why `t` ended (for its tombstone) without publishing the outcome: call before `forget`.
    fn note_terminal(&self, t: &Transfer, err: &TransferError) {
        t.terminal.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert((err.wire_status(), err.to_string()));
    }

    /// A receiver-mediated transfer just failed: its blocks are freed once writes in progress end. A
    /// write that never ends (a TCP sender stalled mid-frame, a UCX rendezvous whose data never comes)
    /// would pin them forever, so after `abort_ack_timeout` the sender is cut off: its connection or
    /// endpoint is closed, which ends (TCP) or fails (UCX) what it was receiving.
    fn cut_off_if_stuck(self: &Arc<Self>, t: &Arc<Transfer>, peer: Arc<dyn PeerLink>) {
        if t.free.lock().unwrap_or_else(|p| p.into_inner()).done {
            return;
        }
        let core = self.clone();
        let tt = t.clone();
        let wait = self.timings.abort_ack_timeout;
        self.rt.spawn(async move {
            tokio::time::sleep(wait).await;
            if tt.free.lock().unwrap_or_else(|p| p.into_inner()).done {
                return;
            }
            tracing::warn!(
                request_id = %tt.request_id,
                writes = tt.inflight.load(Ordering::SeqCst),
                "writes of a failed transfer did not end; cutting its sender off"
            );
            core.count_cut_off();
            peer.close();
        });
    }

    fn finish_err(&self, t: &Transfer, err: TransferError) -> bool {
        self.note_terminal(t, &err);
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
}

pub(crate) fn ack(corr: u64, session: u64, status: TransferStatus, message: &str) -> TransferControl {
    control(corr, Body::Ack(TransferAck { session_id: session, status: status as i32, message: message.to_string() }))
}
