//! The sender's side of a UCX connection: one endpoint per lane (each lane a node with its own worker and
//! progress thread), control on lane 0, data on the lane the shipper picked for each piece.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use proto::v1::transfer_control::Body;
use proto::v1::{TransferAccept, TransferControl};

use super::lock;
use super::node::{Node, Sink};
use crate::TransferError;
use crate::transport::lanes::{FlushJoin, LaneEpochs};
use crate::transport::{Flushed, Inbound, Link, PendingCalls, PutOp, Reply, control, next_id};
use crate::wait::Cell;

/// Sender side: routes the receiver's replies and aborts to links.
pub(super) struct SenderSink {
    /// Receiver node id -> link.
    pub links: Mutex<HashMap<u64, Weak<UcxLink>>>,
    pub inbound: Arc<dyn Inbound>,
}

impl Sink for SenderSink {
    fn on_control(&self, _node: &Arc<Node>, origin: u64, msg: TransferControl) {
        let Some(link) = lock(&self.links).get(&origin).and_then(Weak::upgrade) else {
            tracing::debug!(origin, "control message from an unknown UCX peer");
            return;
        };
        link.calls.deliver(&link, self.inbound.as_ref(), msg);
    }

    fn on_ep_error(&self, ep: u64, reason: &str) {
        let links: Vec<Arc<UcxLink>> = lock(&self.links)
            .values()
            .filter_map(Weak::upgrade)
            .filter(|l| l.lanes.iter().any(|(_, e)| *e == ep))
            .collect();
        for l in links {
            if l.alive.swap(false, Ordering::SeqCst) {
                let why = format!("UCX endpoint: {reason}");
                l.calls.fail_all(&why);
                self.inbound.on_link_lost(l.id, &why);
            }
        }
    }
}

pub(super) struct UcxLink {
    /// Data goes as active messages the receiver places (configured, or the receiver granted no regions
    /// for puts); else as one-sided puts.
    pub receiver_mediated: AtomicBool,
    /// The largest write the receiver places (from its `Accept`; a device pool it stages through host
    /// memory); 0 when unbounded.
    pub max_write: AtomicU64,
    /// The receiver lands gathered writes (its last `Accept` said so).
    pub stream_writes: AtomicBool,
    pub id: u64,
    /// (node, endpoint) per lane; lane 0 carries control messages.
    pub lanes: Vec<(Arc<Node>, u64)>,
    pub epochs: Arc<LaneEpochs>,
    pub calls: Arc<PendingCalls>,
    pub alive: AtomicBool,
    /// Packed rkeys -> handle, unpacked on every lane's endpoint under that one handle.
    pub rkeys: Mutex<HashMap<Vec<Vec<u8>>, u64>>,
}

impl UcxLink {
    fn control(&self) -> &(Arc<Node>, u64) {
        &self.lanes[0]
    }

    /// Flushes lane 0 and every lane with puts no completed flush covers, then runs `then` with the
    /// joined result.
    fn flush_all(&self, then: impl FnOnce(Result<(), TransferError>) + Send + 'static) {
        let todo: Vec<(usize, Option<u64>)> = (0..self.lanes.len())
            .filter_map(|i| {
                let p = self.epochs.pending(i);
                (i == 0 || p.is_some()).then_some((i, p))
            })
            .collect();
        let join = FlushJoin::new(todo.len(), then);
        for (i, pending) in todo {
            let (node, ep) = &self.lanes[i];
            let part = match pending {
                Some(epoch) => {
                    let (j, e) = (join.clone(), self.epochs.clone());
                    FlushJoin::new(1, move |r| {
                        if r.is_ok() {
                            e.covered(i, epoch);
                        }
                        j.part(r)
                    })
                }
                None => join.clone(),
            };
            node.flush(*ep, part);
        }
    }
}

impl Link for UcxLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn call(&self, mut body: Body) -> Result<Reply, TransferError> {
        let (node, ep) = self.control();
        if let Body::Begin(b) = &mut body {
            b.sender_address = node.address.clone();
            b.receiver_mediated = self.receiver_mediated.load(Ordering::SeqCst);
        }
        let (id, cell) = self.calls.register().ok_or_else(|| TransferError::Transport("link lost: closed".into()))?;
        node.send_control(*ep, &control(id, body))?;
        Ok(cell)
    }

    fn flush_then_call(&self, body: Body) -> Option<Result<Reply, TransferError>> {
        let Some((id, cell)) = self.calls.register() else {
            return Some(Err(TransferError::Transport("link lost: closed".into())));
        };
        let (node, ep) = self.control().clone();
        let calls = self.calls.clone();
        self.flush_all(move |r| {
            let r = r.and_then(|()| node.send_control(ep, &control(id, body)));
            if let Err(e) = r {
                calls.complete(id, Err(e));
            }
        });
        Some(Ok(cell))
    }

    fn moves_device_memory(&self) -> bool {
        self.lanes.iter().all(|(node, _)| node.cuda)
    }

    fn stream_writes(&self) -> bool {
        self.stream_writes.load(Ordering::SeqCst)
    }

    fn max_write(&self) -> Option<u64> {
        let m = self.max_write.load(Ordering::SeqCst);
        (m > 0).then_some(m)
    }

    fn accepted(&self, accept: &TransferAccept) -> Result<u64, TransferError> {
        if accept.max_write > 0 {
            self.max_write.store(accept.max_write, Ordering::SeqCst);
        }
        self.stream_writes.store(accept.stream_writes, Ordering::SeqCst);
        let regions = &accept.regions;
        if regions.is_empty() {
            // No puts granted (the receiver does not take them, or its pool is in device memory): it lands
            // active messages itself. Its policy is fixed, so later sessions ask for that directly.
            if !self.receiver_mediated.swap(true, Ordering::SeqCst) {
                tracing::debug!(link = self.id, "the UCX receiver takes no one-sided puts; sending active messages");
            }
            return Ok(0);
        }
        if self.receiver_mediated.load(Ordering::SeqCst) {
            return Err(TransferError::Transport("the receiver granted puts this sender did not ask for".into()));
        }
        if regions.iter().any(|r| r.rkey.is_empty()) {
            return Err(TransferError::Transport("a granted region carries no remote key".into()));
        }
        let packed: Vec<Vec<u8>> = regions.iter().map(|r| r.rkey.clone()).collect();
        if let Some(&h) = lock(&self.rkeys).get(&packed) {
            return Ok(h);
        }
        let h = next_id();
        for (node, ep) in &self.lanes {
            node.unpack_rkeys(*ep, h, packed.clone())?;
        }
        lock(&self.rkeys).insert(packed, h);
        Ok(h)
    }

    fn detach_regions(&self, _handle: u64) {}

    fn put(&self, regions: u64, op: PutOp) -> Result<(), TransferError> {
        if !self.is_alive() {
            return Err(TransferError::Transport("link lost: UCX endpoint failed".into()));
        }
        let lane = op.lane % self.lanes.len();
        self.epochs.note_put(lane);
        let (node, ep) = &self.lanes[lane];
        node.put(*ep, regions, op, self.receiver_mediated.load(Ordering::SeqCst))
    }

    fn flush(&self) -> Result<Flushed, TransferError> {
        let done: Flushed = Cell::new();
        let d = done.clone();
        self.flush_all(move |r| {
            d.set(r);
        });
        Ok(done)
    }

    fn flush_then_reply(&self, correlation_id: u64, body: Body) {
        let (node, ep) = self.control().clone();
        // Without a flush no acknowledgement: the receiver then closes the endpoint and quarantines.
        self.flush_all(move |r| {
            if r.is_ok() {
                let _ = node.send_control(ep, &control(correlation_id, body));
            }
        });
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst) && self.lanes.iter().all(|(n, _)| n.is_alive())
    }
}
