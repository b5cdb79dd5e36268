//! UCX transport through libucp, loaded at run time ([`api::load`]); bindings generated once by
//! `scripts/gen-ucx-bindings.sh` ([`sys`]). The receiver registers its arena (`ucp_mem_map`) and publishes
//! its worker address and packed rkey in descriptors; senders write with `ucp_put_nbx` and make the bytes
//! visible with `ucp_ep_flush_nbx` before any completion, release or abort acknowledgement. Control
//! messages are active messages. UCX picks the transport itself (`UCX_TLS` and every other `UCX_*`
//! variable apply); this code names none.

pub mod api;
mod node;
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, clippy::all, unsafe_op_in_unsafe_fn)]
pub mod sys;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use engine::cache::KvCache;
use proto::v1::transfer_control::Body;
use proto::v1::{MemoryRegion, TransferControl, TransportEndpoint};

use self::node::{Node, NodeOwner, Sink};
use super::{
    Flushed, Inbound, Link, PeerLink, PendingCalls, PutOp, Reply, Served, Transport, TransportKind, control, next_id,
};
use crate::TransferError;
use crate::receiver::core::{ReceiverCore, Refusal, WritePermit};

/// Whether libucp loads here.
pub fn load() -> Result<(), String> {
    api::load().map(|_| ())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a UCX sender moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// One-sided `ucp_put_nbx` into the registered arena (fastest where UCX has native RMA).
    Put,
    /// Rendezvous active messages the receiver places itself (fastest where RMA is emulated, as over
    /// tcp; every write is admitted by the receiver).
    ActiveMessage,
}

impl DataPath {
    /// `TANDEM_UCX_DATA_PATH` = `put` or `am`; default `put`.
    pub fn from_env() -> Result<DataPath, String> {
        match std::env::var("TANDEM_UCX_DATA_PATH").as_deref() {
            Err(_) | Ok("") | Ok("put") => Ok(DataPath::Put),
            Ok("am") => Ok(DataPath::ActiveMessage),
            Ok(v) => Err(format!("TANDEM_UCX_DATA_PATH={v:?}: valid values are put, am")),
        }
    }
}

pub struct UcxTransport {
    tls: Option<String>,
    data_path: DataPath,
    sender: Mutex<Option<(NodeOwner, Arc<SenderSink>)>>,
}

impl UcxTransport {
    /// Fails (with the loader's message) when libucp cannot be loaded.
    pub fn new(tls: Option<&str>) -> Result<Self, String> {
        Self::with_data_path(tls, DataPath::from_env()?)
    }

    pub fn with_data_path(tls: Option<&str>, data_path: DataPath) -> Result<Self, String> {
        load()?;
        Ok(UcxTransport { tls: tls.map(str::to_string), data_path, sender: Mutex::new(None) })
    }
}

fn origin_of(address: &[u8]) -> Option<u64> {
    address.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

impl Transport for UcxTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    fn serve(&self, core: Arc<ReceiverCore>) -> Result<Served, TransferError> {
        let sink = Arc::new(ReceiverSink { core: Arc::downgrade(&core), peers: Mutex::new(HashMap::new()) });
        let node = Node::start("kv-recv", self.tls.as_deref(), false, sink)?;
        let owner = NodeOwner(node.clone());
        let arena = core.cache.arena();
        let rkey = node.mem_map(arena.as_ptr(), arena.len())?;
        Ok(Served {
            endpoint: TransportEndpoint { kind: TransportKind::Ucx.as_str().into(), address: node.address.clone() },
            regions: vec![MemoryRegion { remote_addr: arena.as_ptr() as u64, length: arena.len() as u64, rkey }],
            guard: Box::new(owner),
        })
    }

    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        _local: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        let origin =
            origin_of(&endpoint.address).ok_or_else(|| TransferError::Transport("bad UCX endpoint address".into()))?;
        let (node, sink) = {
            let mut g = lock(&self.sender);
            if g.as_ref().is_none_or(|(n, _)| !n.0.is_alive()) {
                let sink = Arc::new(SenderSink { links: Mutex::new(HashMap::new()), inbound: inbound.clone() });
                let am = self.data_path == DataPath::ActiveMessage;
                let node = Node::start("kv-send", self.tls.as_deref(), am, sink.clone())?;
                *g = Some((NodeOwner(node), sink));
            }
            let (n, s) = g.as_ref().expect("set above");
            (n.0.clone(), s.clone())
        };
        let ep = node.connect(&endpoint.address, deadline)?;
        let link = Arc::new(UcxLink {
            receiver_mediated: self.data_path == DataPath::ActiveMessage,
            id: next_id(),
            ep,
            node: node.clone(),
            calls: PendingCalls::default(),
            alive: AtomicBool::new(true),
            rkeys: Mutex::new(HashMap::new()),
        });
        let mut links = lock(&sink.links);
        links.retain(|_, l| l.strong_count() > 0);
        links.insert(origin, Arc::downgrade(&link));
        Ok(link)
    }
}

/// Sender side: routes the receiver's replies and aborts to links.
struct SenderSink {
    /// Receiver node id -> link.
    links: Mutex<HashMap<u64, Weak<UcxLink>>>,
    inbound: Arc<dyn Inbound>,
}

impl Sink for SenderSink {
    fn on_control(&self, _node: &Arc<Node>, origin: u64, msg: TransferControl) {
        let Some(link) = lock(&self.links).get(&origin).and_then(Weak::upgrade) else {
            tracing::debug!(origin, "control message from an unknown UCX peer");
            return;
        };
        let body = msg.body.clone().unwrap_or(Body::Ack(Default::default()));
        if link.calls.complete(msg.correlation_id, Ok(body)) {
            return;
        }
        if let Some(Body::Abort(a)) = msg.body {
            let dl: Arc<dyn Link> = link.clone();
            self.inbound.on_abort(&dl, msg.correlation_id, a);
        }
    }

    fn on_ep_error(&self, ep: u64, reason: &str) {
        let links: Vec<Arc<UcxLink>> =
            lock(&self.links).values().filter_map(Weak::upgrade).filter(|l| l.ep == ep).collect();
        for l in links {
            if l.alive.swap(false, Ordering::SeqCst) {
                let why = format!("UCX endpoint: {reason}");
                l.calls.fail_all(&why);
                self.inbound.on_link_lost(l.id, &why);
            }
        }
    }
}

struct UcxLink {
    receiver_mediated: bool,
    id: u64,
    ep: u64,
    node: Arc<Node>,
    calls: PendingCalls,
    alive: AtomicBool,
    /// Packed rkeys -> unpacked handle (unpacked once per endpoint).
    rkeys: Mutex<HashMap<Vec<Vec<u8>>, u64>>,
}

impl Link for UcxLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn call(&self, mut body: Body) -> Result<Reply, TransferError> {
        if let Body::Begin(b) = &mut body {
            b.sender_address = self.node.address.clone();
            b.receiver_mediated = self.receiver_mediated;
        }
        let (id, cell) = self.calls.register().ok_or_else(|| TransferError::Transport("link lost: closed".into()))?;
        self.node.send_control(self.ep, &control(id, body))?;
        Ok(cell)
    }

    fn attach_regions(&self, regions: &[MemoryRegion]) -> Result<u64, TransferError> {
        let packed: Vec<Vec<u8>> = regions.iter().map(|r| r.rkey.clone()).collect();
        if let Some(&h) = lock(&self.rkeys).get(&packed) {
            return Ok(h);
        }
        let h = self.node.unpack_rkeys(self.ep, packed.clone())?;
        lock(&self.rkeys).insert(packed, h);
        Ok(h)
    }

    fn detach_regions(&self, _handle: u64) {}

    fn put(&self, regions: u64, op: PutOp) -> Result<(), TransferError> {
        if !self.is_alive() {
            return Err(TransferError::Transport("link lost: UCX endpoint failed".into()));
        }
        self.node.put(self.ep, regions, op)
    }

    fn flush(&self) -> Result<Flushed, TransferError> {
        self.node.flush(self.ep)
    }

    fn flush_then_reply(&self, correlation_id: u64, body: Body) {
        self.node.flush_then_control(self.ep, &control(correlation_id, body));
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst) && self.node.is_alive()
    }
}

/// Receiver side: one peer per sender node, created from the address in its first handshake.
struct ReceiverSink {
    core: Weak<ReceiverCore>,
    peers: Mutex<HashMap<u64, Arc<UcxPeer>>>,
}

impl Sink for ReceiverSink {
    fn on_control(&self, node: &Arc<Node>, origin: u64, msg: TransferControl) {
        let Some(core) = self.core.upgrade() else { return };
        let peer = {
            let mut peers = lock(&self.peers);
            match peers.get(&origin) {
                Some(p) if p.alive.load(Ordering::SeqCst) => {
                    if let Some(Body::Begin(b)) = &msg.body {
                        p.one_sided.store(!b.receiver_mediated, Ordering::SeqCst);
                    }
                    p.clone()
                }
                _ => {
                    let Some(Body::Begin(b)) = &msg.body else {
                        tracing::debug!(origin, "control message from an unknown UCX sender");
                        return;
                    };
                    let ep = match node.connect_nowait(&b.sender_address) {
                        Ok(ep) => ep,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot reach a UCX sender");
                            return;
                        }
                    };
                    let p = Arc::new(UcxPeer {
                        one_sided: AtomicBool::new(!b.receiver_mediated),
                        id: next_id(),
                        ep,
                        node: Arc::downgrade(node),
                        core: self.core.clone(),
                        alive: AtomicBool::new(true),
                    });
                    peers.insert(origin, p.clone());
                    p
                }
            }
        };
        let dynp: Arc<dyn PeerLink> = peer;
        core.on_control(&dynp, msg);
    }

    fn admit(&self, session: u64, token: u64, offset: u64, len: u64) -> Option<Result<WritePermit, Refusal>> {
        let core = self.core.upgrade()?;
        Some(core.admit_write(session, token, offset, len))
    }

    fn on_ep_error(&self, ep: u64, reason: &str) {
        let lost: Vec<Arc<UcxPeer>> = {
            let mut peers = lock(&self.peers);
            let ids: Vec<u64> = peers.iter().filter(|(_, p)| p.ep == ep).map(|(o, _)| *o).collect();
            ids.iter().filter_map(|o| peers.remove(o)).collect()
        };
        for p in lost {
            p.alive.store(false, Ordering::SeqCst);
            if let Some(core) = self.core.upgrade() {
                core.peer_lost(p.id, &format!("UCX endpoint: {reason}"));
            }
        }
    }
}

struct UcxPeer {
    /// Whether this sender writes with one-sided puts (from its handshake).
    one_sided: AtomicBool,
    id: u64,
    ep: u64,
    node: Weak<Node>,
    core: Weak<ReceiverCore>,
    alive: AtomicBool,
}

impl PeerLink for UcxPeer {
    fn id(&self) -> u64 {
        self.id
    }

    fn one_sided(&self) -> bool {
        self.one_sided.load(Ordering::SeqCst)
    }

    fn send(&self, msg: TransferControl) {
        if let Some(n) = self.node.upgrade() {
            let _ = n.send_control(self.ep, &msg);
        }
    }

    fn close(&self) {
        if self.alive.swap(false, Ordering::SeqCst) {
            if let Some(n) = self.node.upgrade() {
                n.close_ep(self.ep);
            }
            if let Some(core) = self.core.upgrade() {
                core.peer_lost(self.id, "endpoint closed by the receiver");
            }
        }
    }
}
