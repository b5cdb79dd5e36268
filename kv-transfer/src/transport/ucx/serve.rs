//! The receiver's side of UCX senders: control messages to the core, active-message writes to admission.
//!
//! A sender that asks for one-sided puts gets them only from a receiver that accepts them: its `Accept`
//! then carries the registered regions and their remote key ([`Grant`]); elsewhere the sender is treated
//! as receiver-mediated whatever it asked, and its `Accept` carries no key.
//!
//! A sender is trusted once the core accepted one of its handshakes (`Begin` -> `Accept`); only then does
//! it get a lasting endpoint and answers to its other messages. Before that, anything but a `Begin` is
//! dropped unanswered, and a refused `Begin` is answered over a temporary endpoint closed once the
//! refusal went out (after [`STRANGER_TTL`] at the latest); at most [`STRANGER_EPS`] of those are opened
//! per [`STRANGER_TTL`], further strangers' handshakes are dropped. The node bounds the rest: queued
//! control messages, their size, and replies in flight per endpoint (a peer that stops reading them is
//! cut off, which fails its transfers like a lost peer).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use proto::v1::transfer_control::Body;
use proto::v1::{MemoryRegion, TransferControl};

use super::node::{Node, Sink};
use super::{host, lock};
use crate::receiver::core::{ReceiverCore, Refusal, StreamPermit, WritePermit};
use crate::staging::STAGE_BYTES;
use crate::transport::lanes::decode_address;
use crate::transport::{PeerLink, StreamHeader, WriteHeader, next_id};

/// Temporary endpoints for refusing strangers' handshakes, opened per [`STRANGER_TTL`].
pub const STRANGER_EPS: usize = 16;
/// How long a temporary endpoint may take to deliver its refusal before it is closed anyway.
pub const STRANGER_TTL: Duration = Duration::from_secs(1);
/// Trusted senders remembered at once; beyond it the longest-known one is closed (each sender process
/// is one entry, so only a flood of accepted handshakes reaches this).
const TRUSTED_PEERS: usize = 4096;

/// Receiver side: one trusted peer per sender node, created from the address in its first accepted
/// handshake.
pub(super) struct ReceiverSink {
    core: Weak<ReceiverCore>,
    /// The receiver's `UCX_TLS` override (decides, with the sender's host, how to reach it).
    tls: Option<String>,
    peers: Mutex<Peers>,
    grant: Arc<Grant>,
}

/// What an `Accept` hands a sender beyond the session id.
#[derive(Default)]
struct Grant {
    /// The registered pool, with its remote key, where one-sided puts are accepted (set once, at start).
    puts: std::sync::OnceLock<Vec<MemoryRegion>>,
    /// The largest write the receiver places (a device pool staged through the host: one staging
    /// buffer); 0 when unbounded.
    max_write: AtomicU64,
    /// Gathered writes are landed (see `TransferAccept::stream_writes`).
    stream_writes: AtomicBool,
}

#[derive(Default)]
struct Peers {
    trusted: HashMap<u64, Arc<UcxPeer>>,
    /// Origins in the order they became trusted (for the [`TRUSTED_PEERS`] cap).
    order: VecDeque<u64>,
    /// When each temporary endpoint still within [`STRANGER_TTL`] was opened.
    strangers: VecDeque<Instant>,
}

impl ReceiverSink {
    pub(super) fn new(core: &Arc<ReceiverCore>, tls: Option<&str>) -> Self {
        let max_write = if core.cache.stages_through_host() { STAGE_BYTES as u64 } else { 0 };
        ReceiverSink {
            core: Arc::downgrade(core),
            tls: tls.map(str::to_string),
            peers: Mutex::new(Peers::default()),
            grant: Arc::new(Grant {
                puts: Default::default(),
                max_write: AtomicU64::new(max_write),
                stream_writes: AtomicBool::new(false),
            }),
        }
    }

    /// The nodes land writes in the device pool themselves (a CUDA-capable UCX): writes of any size, and
    /// gathered writes where every lane has its landing buffers (`stream_writes`).
    pub(super) fn receive_device_memory(&self, stream_writes: bool) {
        self.grant.max_write.store(0, Ordering::SeqCst);
        self.grant.stream_writes.store(stream_writes, Ordering::SeqCst);
    }

    /// Accepts one-sided puts into `regions` (the registered pool) from senders that ask for them.
    pub(super) fn grant_puts(&self, regions: Vec<MemoryRegion>) {
        let _ = self.grant.puts.set(regions);
    }

    /// Whether a sender asking for one-sided puts (`receiver_mediated` false) gets them.
    fn one_sided(&self, receiver_mediated: bool) -> bool {
        !receiver_mediated && self.grant.puts.get().is_some()
    }

    /// A handshake from a sender we do not trust yet: answered over a temporary endpoint, which stays
    /// (and the sender becomes trusted) only if the core accepts it.
    fn on_stranger_begin(&self, core: &Arc<ReceiverCore>, node: &Arc<Node>, origin: u64, msg: TransferControl) {
        let Some(Body::Begin(b)) = &msg.body else { return };
        {
            let mut peers = lock(&self.peers);
            let now = Instant::now();
            while peers.strangers.front().is_some_and(|t| now.duration_since(*t) >= STRANGER_TTL) {
                peers.strangers.pop_front();
            }
            if peers.strangers.len() >= STRANGER_EPS {
                drop(peers);
                return core.count_dropped_untrusted(1);
            }
            peers.strangers.push_back(now);
        }
        let Some(sender) = decode_address(&b.sender_address) else {
            tracing::debug!("a UCX sender sent a malformed address");
            return core.count_dropped_untrusted(1);
        };
        let one_sided = self.one_sided(b.receiver_mediated);
        // The same rule the sender used for its endpoints to us (UCX wants both sides to agree).
        let local = host::same_host(sender.host) && host::shm_allowed(self.tls.as_deref());
        let ep = match node.connect_nowait(sender.lanes[0], !local) {
            Ok(ep) => ep,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach a UCX sender");
                return;
            }
        };
        let peer = Arc::new(UcxPeer {
            one_sided: AtomicBool::new(one_sided),
            id: next_id(),
            ep,
            node: Arc::downgrade(node),
            core: self.core.clone(),
            alive: AtomicBool::new(true),
            trusted: AtomicBool::new(false),
            accepts: AtomicU64::new(0),
            grant: self.grant.clone(),
        });
        let dynp: Arc<dyn PeerLink> = peer.clone();
        core.on_control(&dynp, msg);
        if !peer.trusted.load(Ordering::SeqCst) {
            // Refused: the answer is queued on the endpoint; nothing else will use it.
            peer.alive.store(false, Ordering::SeqCst);
            node.close_when_sent(ep, STRANGER_TTL);
            return;
        }
        let evicted = {
            let mut peers = lock(&self.peers);
            peers.trusted.insert(origin, peer);
            peers.order.retain(|o| *o != origin);
            peers.order.push_back(origin);
            let mut out = Vec::new();
            while peers.order.len() > TRUSTED_PEERS {
                if let Some(p) = peers.order.pop_front().and_then(|o| peers.trusted.remove(&o)) {
                    out.push(p);
                }
            }
            out
        };
        for p in evicted {
            p.close();
        }
    }
}

impl Sink for ReceiverSink {
    fn on_control(&self, node: &Arc<Node>, origin: u64, msg: TransferControl) {
        let Some(core) = self.core.upgrade() else { return };
        let trusted = {
            let peers = lock(&self.peers);
            peers.trusted.get(&origin).filter(|p| p.alive.load(Ordering::SeqCst)).cloned()
        };
        let Some(peer) = trusted else {
            if matches!(msg.body, Some(Body::Begin(_))) {
                return self.on_stranger_begin(&core, node, origin, msg);
            }
            tracing::debug!(origin, "control message from an untrusted UCX sender");
            return core.count_dropped_untrusted(1);
        };
        // A handshake's write mode becomes the peer's only if the core accepts it (Accept is sent from within
        // on_control, on this thread): a refused Begin leaves the mode of the peer's transfers in flight alone.
        let begin_mode = match &msg.body {
            Some(Body::Begin(b)) => Some(self.one_sided(b.receiver_mediated)),
            _ => None,
        };
        let (previous, accepts) = match begin_mode {
            Some(mode) => (peer.one_sided.swap(mode, Ordering::SeqCst), peer.accepts.load(Ordering::SeqCst)),
            None => (false, 0),
        };
        let dynp: Arc<dyn PeerLink> = peer.clone();
        core.on_control(&dynp, msg);
        if begin_mode.is_some() && peer.accepts.load(Ordering::SeqCst) == accepts {
            peer.one_sided.store(previous, Ordering::SeqCst);
        }
    }

    fn admit(&self, h: &WriteHeader) -> Option<Result<WritePermit, Refusal>> {
        let core = self.core.upgrade()?;
        Some(core.admit_write(h.session, &h.token, h.offset, h.len))
    }

    fn admit_stream(&self, h: &StreamHeader) -> Option<Result<StreamPermit, Refusal>> {
        if !self.grant.stream_writes.load(Ordering::SeqCst) {
            return None;
        }
        let core = self.core.upgrade()?;
        Some(core.admit_stream(h.session, &h.token, h.layer, h.offset, h.len))
    }

    fn on_ep_error(&self, ep: u64, reason: &str) {
        let lost: Vec<Arc<UcxPeer>> = {
            let mut peers = lock(&self.peers);
            let ids: Vec<u64> = peers.trusted.iter().filter(|(_, p)| p.ep == ep).map(|(o, _)| *o).collect();
            peers.order.retain(|o| !ids.contains(o));
            ids.iter().filter_map(|o| peers.trusted.remove(o)).collect()
        };
        let Some(core) = self.core.upgrade() else { return };
        for p in lost {
            p.alive.store(false, Ordering::SeqCst);
            core.peer_lost(p.id, &format!("UCX endpoint: {reason}"));
        }
    }

    fn on_cut_off(&self, ep: u64, reason: &str) {
        if let Some(core) = self.core.upgrade() {
            core.count_cut_off();
        }
        self.on_ep_error(ep, reason);
    }

    fn on_dropped(&self, count: usize) {
        if let Some(core) = self.core.upgrade() {
            core.count_dropped_untrusted(count as u64);
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
    /// The core accepted one of this sender's handshakes.
    trusted: AtomicBool,
    /// Handshakes of this sender the core accepted.
    accepts: AtomicU64,
    grant: Arc<Grant>,
}

impl PeerLink for UcxPeer {
    fn id(&self) -> u64 {
        self.id
    }

    fn one_sided(&self) -> bool {
        self.one_sided.load(Ordering::SeqCst)
    }

    fn send(&self, mut msg: TransferControl) {
        if let Some(Body::Accept(a)) = &mut msg.body {
            self.trusted.store(true, Ordering::SeqCst);
            self.accepts.fetch_add(1, Ordering::SeqCst);
            // The key to the pool goes only to a sender the core just accepted, and only if it asked
            // for puts and this receiver accepts them.
            if self.one_sided()
                && let Some(regions) = self.grant.puts.get()
            {
                a.regions = regions.clone();
            }
            a.max_write = self.grant.max_write.load(Ordering::SeqCst);
            a.stream_writes = self.grant.stream_writes.load(Ordering::SeqCst);
        }
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
