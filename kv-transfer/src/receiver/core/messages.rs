//! The control messages a sender sends (handshake, completion, release, abort, abort acknowledgement)
//! and the completeness check that gates scheduling.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use proto::v1::transfer_control::Body;
use proto::v1::{
    TransferAbort, TransferAccept, TransferAck, TransferBegin, TransferComplete, TransferControl, TransferRelease,
    TransferStatus,
};

use super::{Phase, ReceiverCore, Transfer, ack};
use crate::TransferError;
use crate::layout::{self, checksum_segments};
use crate::receiver::{CompletedTransfer, ReleasedTransfer, TransferOutcome};
use crate::staging::checksum_device;
use crate::transport::{PeerLink, control};

impl ReceiverCore {
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
        tracing::trace!(request_id = %b.request_id, "kv-transfer: handshake received");
        let reject = |status: TransferStatus, message: String| {
            self.counters.rejected_handshakes.fetch_add(1, Ordering::Relaxed);
            tracing::info!(request_id = %b.request_id, ?status, message, "kv transfer handshake rejected");
            peer.send(ack(corr, 0, status, &message));
        };
        // An unknown request and a wrong (or missing) token get the same answer, so a stranger cannot
        // tell which request ids are awaited; the difference is only logged, at debug (counted in
        // rejected_handshakes either way). Not the paired sender: the transfer is left alone.
        let t = self.lookup_request(&b.request_id);
        let Some(t) = t.filter(|t| t.token.matches(&b.transfer_token)) else {
            self.counters.rejected_handshakes.fetch_add(1, Ordering::Relaxed);
            let why = if self.lookup_request(&b.request_id).is_some() { "wrong token" } else { "unknown request" };
            tracing::debug!(request_id = %b.request_id, why, "kv transfer handshake refused");
            let status = TransferStatus::UnknownRequest;
            return peer.send(ack(corr, 0, status, "no transfer awaits this request with this token"));
        };
        if !self.reservation_intact(&t) {
            self.orphan(&t);
            return reject(TransferStatus::UnknownRequest, format!("the reservation of {} is gone", b.request_id));
        }
        // The paired sender with a mismatching view: the transfer cannot succeed, fail it now.
        let mismatch = if let Err(e) = self.fingerprint.check_compatible(&b.fingerprint.clone().unwrap_or_default()) {
            Some((TransferStatus::FingerprintMismatch, TransferError::from(e).to_string()))
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
        let accept =
            TransferAccept { session_id: t.session, session_token: t.session_token.to_vec(), ..Default::default() };
        peer.send(control(corr, Body::Accept(accept)));
    }

    /// Finds a session's transfer for a message that must come from its sender (it carries the session
    /// token only the accepted sender was given). Without that token the answer is UNKNOWN_REQUEST
    /// whether the session is live, ended or never existed: a trusted peer probing session ids learns
    /// neither liveness nor another request's tombstone.
    fn session_for(&self, peer: &Arc<dyn PeerLink>, corr: u64, session: u64, token: &[u8]) -> Option<Arc<Transfer>> {
        let (t, tomb) = {
            let tb = self.tables();
            (tb.by_session.get(&session).cloned(), tb.tombstones.get(&session).cloned())
        };
        match (t, tomb) {
            (Some(t), _) if t.session_token.matches(token) => return Some(t),
            (None, Some(tomb)) if tomb.token.matches(token) => {
                peer.send(ack(corr, session, tomb.status, &tomb.why));
                return None;
            }
            (live, _) => {
                tracing::debug!(session, live = live.is_some(), "a session message without its session token");
            }
        }
        peer.send(ack(corr, session, TransferStatus::UnknownRequest, "no such transfer"));
        None
    }

    fn on_complete(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, c: TransferComplete) {
        let Some(t) = self.session_for(peer, corr, c.session_id, &c.session_token) else { return };
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
        tracing::trace!(
            request_id = %t.request_id,
            inflight = t.inflight.load(Ordering::SeqCst),
            "kv-transfer: completion received"
        );
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
    pub(super) fn verify(self: &Arc<Self>, t: Arc<Transfer>, corr: u64, c: TransferComplete, peer: Arc<dyn PeerLink>) {
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
                        tracing::trace!(request_id = %t.request_id, "kv-transfer: completion verified");
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
        let blocks: Vec<kv_cache::BlockId> = t.blocks.iter().map(|&b| kv_cache::BlockId(b)).collect();
        let plan = layout::PutPlan::new(self.layout, self.layout, &blocks, &blocks, t.num_tokens as usize);
        for l in &c.layers {
            let Some(want) = l.checksum else {
                return Err((TransferStatus::ChecksumMismatch, format!("layer {} has no checksum", l.layer)));
            };
            let segs = plan.layer_puts(kv_cache::LayerIdx(l.layer)).map(|p| (p.dst_offset, p.len));
            let got = match &self.staging {
                // SAFETY: the transfer owns these blocks and no write is admitted any more.
                None => unsafe { checksum_segments(self.cache.arena().as_ptr(), segs) },
                Some(pool) => {
                    let cannot = |why: String| (TransferStatus::ChecksumMismatch, format!("layer {}: {why}", l.layer));
                    let segs: Vec<(u64, u64)> = segs.collect();
                    // On the device where it can; else through a buffer. Verifications hold a buffer only
                    // while hashing: a wait means others are hashing.
                    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
                    let buf = || pool.take_until(until).ok_or_else(|| "no staging buffer".to_string());
                    // SAFETY: as above.
                    unsafe { checksum_device(self.cache.arena(), &segs, buf) }
                        .map_err(|e| cannot(format!("cannot read the pool to verify it: {e}")))?
                }
            };
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
        let Some(t) = self.session_for(peer, corr, r.session_id, &r.session_token) else { return };
        // Checked and ended under one guard: a concurrent abort either happened first or finds it Done.
        let was = {
            let mut ph = t.lock_phase();
            if !matches!(&*ph, Phase::Active(_) | Phase::Aborting(_)) {
                drop(ph);
                peer.send(ack(corr, t.session, TransferStatus::Protocol, "release out of sequence"));
                return;
            }
            std::mem::replace(&mut *ph, Phase::Done)
        };
        t.active.store(false, Ordering::SeqCst);
        if let Phase::Active(_) = was {
            let rel = ReleasedTransfer {
                request_id: t.request_id.clone(),
                first_token: r.first_token.unwrap_or_default(),
                finish_reason: proto::v1::FinishReason::try_from(r.finish_reason).unwrap_or_default(),
            };
            if t.outcome.set(Ok(TransferOutcome::Released(rel))) {
                self.counters.released.fetch_add(1, Ordering::Relaxed);
            }
            peer.send(ack(corr, t.session, TransferStatus::Ok, ""));
        } else {
            peer.send(ack(corr, t.session, TransferStatus::Aborted, "aborted by the receiver"));
        }
        self.forget(&t);
        self.free_now(&t);
    }

    fn on_sender_abort(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, corr: u64, a: TransferAbort) {
        let Some(t) = self.session_for(peer, corr, a.session_id, &a.session_token) else { return };
        {
            let mut ph = t.lock_phase();
            if !matches!(&*ph, Phase::Active(_) | Phase::Aborting(_) | Phase::Expected) {
                drop(ph);
                peer.send(ack(corr, t.session, TransferStatus::Protocol, "abort out of sequence"));
                return;
            }
            *ph = Phase::Done;
        }
        t.active.store(false, Ordering::SeqCst);
        let err = TransferError::Aborted { request_id: t.request_id.clone(), reason: format!("sender: {}", a.reason) };
        self.note_terminal(&t, &err);
        self.forget(&t);
        self.free_now(&t);
        self.finish_err(&t, err);
        peer.send(ack(corr, t.session, TransferStatus::Ok, ""));
    }

    /// The sender acknowledged our abort: its puts are flushed and it issues no more. Only the aborted
    /// session's own sender can say so (an acknowledgement carries no token).
    fn on_ack(self: &Arc<Self>, peer: &Arc<dyn PeerLink>, a: TransferAck) {
        let Some(t) = self.tables().by_session.get(&a.session_id).cloned() else { return };
        let mut ph = t.lock_phase();
        if matches!(&*ph, Phase::Aborting(p) if p.id() == peer.id()) {
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
