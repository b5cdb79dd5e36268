//! In-process transport: sender and receiver in one process (single-process mode, tests). Puts are
//! memcpys admitted by the receiver core; control messages travel through ordered channels on the
//! receiver's runtime, so neither side ever re-enters the other's locks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use kv_cache::KvCache;
use proto::v1::transfer_control::Body;
use proto::v1::{TransferControl, TransportEndpoint};
use tokio::sync::mpsc;

use super::{
    Flushed, Inbound, Link, PeerLink, PendingCalls, PutOp, Reply, Served, Transport, TransportKind, control, next_id,
};
use crate::TransferError;
use crate::receiver::core::{ReceiverCore, Refusal};
use crate::wait::Cell;

fn registry() -> &'static Mutex<HashMap<String, Weak<ReceiverCore>>> {
    static R: OnceLock<Mutex<HashMap<String, Weak<ReceiverCore>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

pub struct InProcTransport {
    rt: tokio::runtime::Handle,
}

impl InProcTransport {
    pub fn new(rt: tokio::runtime::Handle) -> Self {
        InProcTransport { rt }
    }
}

struct Registration(String);

impl Drop for Registration {
    fn drop(&mut self) {
        registry().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.0);
    }
}

impl Transport for InProcTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::InProc
    }

    fn serve(&self, core: Arc<ReceiverCore>) -> Result<Served, TransferError> {
        let name = format!("inproc-{}-{}", std::process::id(), next_id());
        registry().lock().unwrap_or_else(|p| p.into_inner()).insert(name.clone(), Arc::downgrade(&core));
        let address = name.clone().into_bytes();
        Ok(Served::new(TransportKind::InProc, address, Registration(name)))
    }

    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        _local: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        _deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        let name = String::from_utf8_lossy(&endpoint.address).to_string();
        let core = registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&name)
            .and_then(Weak::upgrade)
            .ok_or_else(|| TransferError::Transport(format!("no in-process receiver named {name}")))?;
        let (to_recv, mut recv_rx) = mpsc::unbounded_channel::<TransferControl>();
        let (to_send, mut send_rx) = mpsc::unbounded_channel::<TransferControl>();
        let link = Arc::new(InProcLink {
            id: next_id(),
            core: Arc::downgrade(&core),
            to_recv,
            calls: PendingCalls::default(),
            closed: Arc::new(AtomicBool::new(false)),
        });
        let peer: Arc<dyn PeerLink> = Arc::new(InProcPeer { id: next_id(), to_send, closed: link.closed.clone() });
        let weak_core = Arc::downgrade(&core);
        let closed = link.closed.clone();
        let core_rt = core.runtime().clone();
        core_rt.spawn(async move {
            while let Some(msg) = recv_rx.recv().await {
                if closed.load(Ordering::SeqCst) {
                    break;
                }
                match weak_core.upgrade() {
                    Some(core) => core.on_control(&peer, msg),
                    None => break,
                }
            }
        });
        let weak_link = Arc::downgrade(&link);
        self.rt.spawn(async move {
            while let Some(msg) = send_rx.recv().await {
                let Some(link) = weak_link.upgrade() else { break };
                link.calls.deliver(&link, inbound.as_ref(), msg);
            }
            if let Some(link) = weak_link.upgrade() {
                link.calls.fail_all("in-process receiver closed the link");
                inbound.on_link_lost(link.id, "in-process receiver closed the link");
            }
        });
        Ok(link)
    }
}

struct InProcLink {
    id: u64,
    core: Weak<ReceiverCore>,
    to_recv: mpsc::UnboundedSender<TransferControl>,
    calls: PendingCalls,
    closed: Arc<AtomicBool>,
}

impl Link for InProcLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn call(&self, body: Body) -> Result<Reply, TransferError> {
        let (id, cell) = self.calls.register().ok_or_else(|| TransferError::Transport("link lost: closed".into()))?;
        self.to_recv
            .send(control(id, body))
            .map_err(|_| TransferError::Transport("link lost: receiver gone".into()))?;
        Ok(cell)
    }

    fn put(&self, _regions: u64, op: PutOp) -> Result<(), TransferError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(TransferError::Transport("link lost: closed".into()));
        }
        let core = self.core.upgrade().ok_or_else(|| TransferError::Transport("link lost: receiver gone".into()))?;
        match core.admit_write(op.session_id, &op.token, op.dst_offset, op.len) {
            Ok(permit) if permit.staged() => {
                // SAFETY: the source is host memory (the sender's live arena or its staging buffer in `op`).
                let src = unsafe { std::slice::from_raw_parts(op.src, permit.len) };
                match permit.copy_in(0, src) {
                    Ok(()) => permit.commit(),
                    Err(why) => permit.fail(&why),
                }
                Ok(())
            }
            Ok(permit) => {
                // SAFETY: the permit owns the destination range; the source is the sender's live arena
                // (or its staging buffer, which `op` holds).
                unsafe { std::ptr::copy_nonoverlapping(op.src, permit.ptr, permit.len) };
                permit.commit();
                Ok(())
            }
            Err(Refusal::Stale) => Ok(()),
            Err(Refusal::WrongToken) => Err(TransferError::Transport("a write without the session token".into())),
            Err(Refusal::Invalid(why)) => Err(TransferError::Transport(why)),
        }
    }

    fn flush(&self) -> Result<Flushed, TransferError> {
        // Puts are synchronous copies: everything issued has landed.
        let c = Cell::new();
        c.set(if self.is_alive() { Ok(()) } else { Err(TransferError::Transport("link lost: closed".into())) });
        Ok(c)
    }

    fn flush_then_reply(&self, correlation_id: u64, body: Body) {
        let _ = self.to_recv.send(control(correlation_id, body));
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::SeqCst) && self.core.strong_count() > 0
    }
}

struct InProcPeer {
    id: u64,
    to_send: mpsc::UnboundedSender<TransferControl>,
    closed: Arc<AtomicBool>,
}

impl PeerLink for InProcPeer {
    fn id(&self) -> u64 {
        self.id
    }

    fn one_sided(&self) -> bool {
        false
    }

    fn send(&self, msg: TransferControl) {
        let _ = self.to_send.send(msg);
    }

    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }
}
