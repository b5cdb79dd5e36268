//! One request's send session: layer queueing, the stop flag that receiver aborts set, and the terminal
//! calls (complete, release, abort) with their bounded waits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_cache::LayerReady;
use kv_cache::{KvCache, LayerIdx};
use proto::v1::transfer_control::Body;
use proto::v1::{
    FinishReason, GeneratedToken, LayerManifest, MemoryRegion, MtpDraft, TransferAbort, TransferComplete,
    TransferRelease, TransferStatus,
};

use super::shipper::LayerShipment;
use super::{SenderShared, map_link_error};
use crate::TransferError;
use crate::layout::PutPlan;
use crate::token::TransferToken;
use crate::transport::Link;

/// What a finished session shipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendReport {
    pub bytes: u64,
    pub layers: usize,
    /// From the accepted handshake to the receiver's acknowledgement.
    pub elapsed: Duration,
}

pub(crate) struct Ctl {
    /// Set once no more puts may be issued; the reason, if the receiver asked.
    pub stopped: Option<Stop>,
    pub queued: Vec<bool>,
}

#[derive(Clone)]
pub(crate) enum Stop {
    Receiver { reason: String, status: i32 },
    Local,
}

pub(crate) struct SessionState {
    request_id: String,
    /// The session token of the receiver's Accept: every later message and write carries it.
    token: TransferToken,
    pub session_id: u64,
    pub link: Arc<dyn Link>,
    pub regions: u64,
    pub dst_regions: Vec<MemoryRegion>,
    pub deadline: Instant,
    pub final_deadline: Instant,
    pub plan: PutPlan,
    pub num_layers: usize,
    pub checksum: bool,
    pub cache: Arc<KvCache>,
    pub ctl: Mutex<Ctl>,
    pub manifests: Mutex<Vec<Option<LayerManifest>>>,
    /// Layers queued for the shipper and not yet shipped (or skipped).
    shipments: Mutex<usize>,
    shipments_cv: Condvar,
    error: Mutex<Option<TransferError>>,
    pub bytes: AtomicU64,
    /// Which lane each piece goes on: the least loaded by bytes (starting at the session id, so sessions
    /// interleave).
    pub lanes: crate::transport::lanes::LaneDealer,
    started: Instant,
}

impl SessionState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        request_id: String,
        token: TransferToken,
        session_id: u64,
        link: Arc<dyn Link>,
        regions: u64,
        dst_regions: Vec<MemoryRegion>,
        deadline: Instant,
        final_deadline: Instant,
        plan: PutPlan,
        num_layers: usize,
        checksum: bool,
        cache: Arc<KvCache>,
    ) -> Arc<Self> {
        Arc::new(SessionState {
            request_id,
            token,
            session_id,
            link,
            regions,
            dst_regions,
            deadline,
            final_deadline,
            plan,
            num_layers,
            checksum,
            cache,
            ctl: Mutex::new(Ctl { stopped: None, queued: vec![false; num_layers] }),
            manifests: Mutex::new(vec![None; num_layers]),
            shipments: Mutex::new(0),
            shipments_cv: Condvar::new(),
            error: Mutex::new(None),
            bytes: AtomicU64::new(0),
            lanes: crate::transport::lanes::LaneDealer::new(session_id as usize),
            started: Instant::now(),
        })
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn token(&self) -> &TransferToken {
        &self.token
    }

    pub fn lock_ctl(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The receiver aborted: no put is issued after this returns.
    pub fn stop_by_receiver(&self, reason: &str, status: i32) {
        let mut c = self.lock_ctl();
        if c.stopped.is_none() {
            c.stopped = Some(Stop::Receiver { reason: reason.to_string(), status });
        }
    }

    pub fn set_error(&self, e: TransferError) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
    }

    pub fn error(&self) -> Option<TransferError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn shipment_done(&self) {
        let mut n = self.shipments.lock().unwrap_or_else(|p| p.into_inner());
        *n -= 1;
        if *n == 0 {
            self.shipments_cv.notify_all();
        }
    }

    fn add_shipment(&self) {
        *self.shipments.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    /// Waits until every queued layer was shipped (or skipped). False on timeout.
    fn wait_shipments(&self, until: Instant) -> bool {
        // Polled first: the completion waits on this, and a sleeping thread's wake-up took up to 200 us.
        // try_lock: polling must not hold up the shipping thread's shipment_done.
        if crate::wait::spin_until(until, || self.shipments.try_lock().is_ok_and(|n| *n == 0)) {
            return true;
        }
        let mut n = self.shipments.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            let now = Instant::now();
            if now >= until {
                return false;
            }
            n = self.shipments_cv.wait_timeout(n, until - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }

    /// The error a receiver abort turns into.
    fn stop_error(&self) -> Option<TransferError> {
        match &self.lock_ctl().stopped {
            Some(Stop::Receiver { reason, status }) => {
                let status = TransferStatus::try_from(*status).unwrap_or(TransferStatus::Aborted);
                Some(if status == TransferStatus::DeadlineExceeded {
                    TransferError::DeadlineExceeded(self.request_id.clone())
                } else {
                    TransferError::Aborted {
                        request_id: self.request_id.clone(),
                        reason: format!("receiver: {reason}"),
                    }
                })
            }
            _ => None,
        }
    }

    pub(super) fn timeout_error(&self) -> TransferError {
        if self.link.is_alive() {
            TransferError::DeadlineExceeded(self.request_id.clone())
        } else {
            TransferError::PeerLost { request_id: self.request_id.clone(), reason: "connection closed".into() }
        }
    }

    /// Flushes the link and waits (bounded).
    pub fn flush(&self, until: Instant) -> Result<(), TransferError> {
        let cell = self.link.flush().map_err(|e| map_link_error(&self.request_id, e))?;
        match cell.wait_until(until) {
            Some(r) => r.map_err(|e| map_link_error(&self.request_id, e)),
            None => Err(self.timeout_error()),
        }
    }

    /// Sends `body` and waits for the acknowledgement.
    fn call_ack(&self, body: Body, until: Instant) -> Result<(), TransferError> {
        self.wait_ack(self.link.call(body), until)
    }

    /// Waits for the acknowledgement of a sent request.
    fn wait_ack(
        &self,
        sent: Result<crate::transport::Reply, TransferError>,
        until: Instant,
    ) -> Result<(), TransferError> {
        let cell = sent.map_err(|e| map_link_error(&self.request_id, e))?;
        let reply = cell.wait_until(until).unwrap_or_else(|| Err(self.timeout_error()));
        match reply.map_err(|e| map_link_error(&self.request_id, e))? {
            Body::Ack(a) if a.status == TransferStatus::Ok as i32 => Ok(()),
            Body::Ack(a) => {
                let status = TransferStatus::try_from(a.status).unwrap_or(TransferStatus::Protocol);
                Err(TransferError::rejected(&self.request_id, status, a.message))
            }
            _ => Err(TransferError::Transport(format!("request {}: unexpected reply", self.request_id))),
        }
    }
}

/// An open transfer on the prefill side. Finish it with `complete`, `release` or `abort`; dropping it
/// unfinished aborts it.
pub struct SendSession {
    st: Arc<SessionState>,
    shared: Arc<SenderShared>,
    finished: bool,
}

impl SendSession {
    pub(crate) fn new(st: Arc<SessionState>, shared: Arc<SenderShared>) -> Self {
        SendSession { st, shared, finished: false }
    }

    pub fn request_id(&self) -> &str {
        self.st.request_id()
    }

    /// Queues layer `layer` for shipping and returns at once (the compute thread goes on with the next
    /// layer). The layer's caches must be complete and stay untouched until the session finishes.
    pub fn put_layer(&self, layer: LayerIdx) -> Result<(), TransferError> {
        self.put_layer_when(layer, LayerReady::complete())
    }

    /// Queues layer `layer` for shipping once `ready` (the backend's completion marker for the layer's
    /// cache writes) is reached; returns at once. The shipping thread waits on the marker, so no byte of
    /// the layer leaves before it is written and the compute thread never blocks here.
    pub fn put_layer_when(&self, layer: LayerIdx, ready: LayerReady) -> Result<(), TransferError> {
        let usage = |reason: String| TransferError::Usage { request_id: self.st.request_id.clone(), reason };
        if layer.index() >= self.st.num_layers {
            return Err(usage(format!("layer {} out of range ({} layers)", layer.0, self.st.num_layers)));
        }
        if let Some(e) = self.st.stop_error().or_else(|| self.st.error()) {
            return Err(e);
        }
        {
            let mut c = self.st.lock_ctl();
            if c.stopped.is_some() {
                return Err(usage("session already finished".into()));
            }
            if c.queued[layer.index()] {
                return Err(usage(format!("layer {} queued twice", layer.0)));
            }
            c.queued[layer.index()] = true;
        }
        self.st.add_shipment();
        let shipment = LayerShipment {
            st: self.st.clone(),
            layer,
            ready,
            fault: self.shared.fault,
            staging: self.shared.staging.clone(),
            gather: self.shared.gather.clone(),
        };
        if !self.shared.shipper.submit(shipment) {
            self.st.shipment_done();
            return Err(TransferError::Transport("the shipping thread is gone".into()));
        }
        Ok(())
    }

    /// Waits for every layer to land, then sends the completion (first token, its logprobs, the MTP draft)
    /// and waits for the receiver to verify it.
    pub fn complete(
        mut self,
        first_token: GeneratedToken,
        draft: Option<MtpDraft>,
    ) -> Result<SendReport, TransferError> {
        self.finished = true;
        let st = self.st.clone();
        let r = (|| {
            let t0 = Instant::now();
            self.drain(st.deadline)?;
            let drained = t0.elapsed();
            let missing: Vec<usize> =
                st.lock_ctl().queued.iter().enumerate().filter(|(_, q)| !**q).map(|(i, _)| i).collect();
            if !missing.is_empty() {
                return Err(TransferError::Usage {
                    request_id: st.request_id.clone(),
                    reason: format!("completion before layers {missing:?} were put"),
                });
            }
            let layers: Vec<LayerManifest> =
                st.manifests.lock().unwrap_or_else(|p| p.into_inner()).iter().flatten().cloned().collect();
            if layers.len() != st.num_layers {
                return Err(TransferError::Transport(format!("request {}: a layer was not shipped", st.request_id)));
            }
            st.lock_ctl().stopped.get_or_insert(super::session::Stop::Local);
            let body = Body::Complete(TransferComplete {
                session_id: st.session_id,
                session_token: st.token.to_vec(),
                first_token: Some(first_token),
                draft,
                layers,
            });
            // The completion must follow the data: where the link can order it behind a flush itself,
            // that saves the caller one round trip through the transport's threads.
            match st.link.flush_then_call(body.clone()) {
                Some(reply) => st.wait_ack(reply, st.final_deadline)?,
                None => {
                    st.flush(st.deadline)?;
                    st.call_ack(body, st.final_deadline)?;
                }
            }
            tracing::trace!(
                request_id = %st.request_id,
                drain_us = drained.as_micros() as u64,
                completion_us = (t0.elapsed() - drained).as_micros() as u64,
                "kv-transfer: completed"
            );
            Ok(SendReport {
                bytes: st.bytes.load(Ordering::Relaxed),
                layers: st.num_layers,
                elapsed: st.started.elapsed(),
            })
        })();
        if let Err(e @ (TransferError::Usage { .. } | TransferError::Transport(_))) = &r {
            // A local failure: tell the receiver so it frees the blocks now rather than at the deadline.
            let _ = self.abort_inner(&format!("completion failed: {e}"));
        }
        self.finish(r)
    }

    /// Prefill finished the request (EOS, stop, max_tokens = 1): stop shipping and free the receiver's
    /// reservation.
    pub fn release(mut self, first_token: GeneratedToken, finish_reason: FinishReason) -> Result<(), TransferError> {
        self.finished = true;
        let st = self.st.clone();
        let r = (|| {
            self.stop_and_flush()?;
            let body = Body::Release(TransferRelease {
                session_id: st.session_id,
                session_token: st.token.to_vec(),
                first_token: Some(first_token),
                finish_reason: finish_reason as i32,
            });
            st.call_ack(body, st.final_deadline)
        })();
        self.finish(r)
    }

    /// Gives up (prefill failed): stop shipping, flush, tell the receiver so it frees the blocks.
    pub fn abort(mut self, reason: &str) -> Result<(), TransferError> {
        self.finished = true;
        let r = self.abort_inner(reason);
        self.finish(r)
    }

    fn abort_inner(&self, reason: &str) -> Result<(), TransferError> {
        let st = &self.st;
        self.stop_and_flush()?;
        let body = Body::Abort(TransferAbort {
            session_id: st.session_id,
            session_token: st.token.to_vec(),
            reason: reason.to_string(),
            status: TransferStatus::Aborted as i32,
        });
        st.call_ack(body, st.final_deadline)
    }

    /// Stops issuing puts, waits for the shipper to leave this session, flushes what was issued.
    fn stop_and_flush(&self) -> Result<(), TransferError> {
        let st = &self.st;
        st.lock_ctl().stopped.get_or_insert(Stop::Local);
        if let Some(e) = st.stop_error() {
            // The receiver already aborted and (after our ack) freed the blocks.
            return Err(e);
        }
        if !st.wait_shipments(st.deadline) {
            return Err(st.timeout_error());
        }
        if let Some(e) = st.error() {
            return Err(e);
        }
        st.flush(st.deadline)
    }

    /// Waits until the shipper shipped every queued layer; reports aborts and link errors.
    fn drain(&self, until: Instant) -> Result<(), TransferError> {
        let st = &self.st;
        let ok = st.wait_shipments(until);
        if let Some(e) = st.stop_error().or_else(|| st.error()) {
            return Err(e);
        }
        if !ok {
            return Err(st.timeout_error());
        }
        Ok(())
    }

    fn finish<T>(&mut self, r: Result<T, TransferError>) -> Result<T, TransferError> {
        self.shared.router.remove(self.st.link.id(), self.st.session_id);
        self.st.link.detach_regions(self.st.regions);
        if let Err(e) = &r {
            tracing::info!(request_id = %self.st.request_id, error = %e, "kv send failed");
            // Stop the shipper whatever happened.
            self.st.lock_ctl().stopped.get_or_insert(Stop::Local);
        }
        r
    }
}

impl Drop for SendSession {
    fn drop(&mut self) {
        if !self.finished {
            self.finished = true;
            let r = self.abort_inner("send session dropped");
            let _ = self.finish(r);
        }
    }
}
