//! The transports behind one trait: UCX (libucp, loaded at run time), TCP (tokio) and in-process.
//!
//! A transport does two things for the protocol in [`crate::receiver`] and [`crate::sender`]: it carries
//! control messages (`TransferControl`) both ways, and it moves bytes from the sender's arena into the
//! receiver's arena. By default every write passes through [`ReceiverCore::admit_write`] (TCP, in-process,
//! UCX active messages), which refuses writes without the transfer's token, to transfers that are not
//! active and to blocks the transfer does not own. Only a UCX receiver configured to accept one-sided
//! puts (a trusted network, see the crate README) lets them write its memory unseen; it then relies on the
//! sender's flush-then-acknowledge and cannot bound where the puts land.
//!
//! A pool in device memory moves device to device where UCX is CUDA-capable (puts from the pool with
//! [`PutOp::device`], scattered layers as gathered writes, [`PutOp::stream_layer`]); elsewhere it is
//! staged through host memory ([`crate::staging`]): a sender's puts then point into host buffers they own
//! ([`PutOp::staged`]), and a receiver's writes land through
//! [`WritePermit::copy_in`](crate::receiver::core::WritePermit::copy_in). No device pool is ever registered
//! for one-sided puts.

pub mod inproc;
pub mod lanes;
pub mod tcp;
pub mod ucx;

use std::sync::Arc;
use std::time::Instant;

use kv_cache::KvCache;
use proto::v1::{TransferAccept, TransferControl, TransportEndpoint, transfer_control::Body};

use crate::TransferError;
use crate::receiver::core::ReceiverCore;
use crate::staging::StagedBuf;
use crate::token::TOKEN_BYTES;
use crate::wait::Cell;

/// Which transport an endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    Ucx,
    Tcp,
    InProc,
}

impl TransportKind {
    pub const ALL: [TransportKind; 3] = [TransportKind::Ucx, TransportKind::Tcp, TransportKind::InProc];

    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Ucx => "ucx",
            TransportKind::Tcp => "tcp",
            TransportKind::InProc => "inproc",
        }
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ucx" => Ok(TransportKind::Ucx),
            "tcp" => Ok(TransportKind::Tcp),
            "inproc" => Ok(TransportKind::InProc),
            _ => Err(format!("unknown transport {s:?}; valid: ucx, tcp, inproc")),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a serving transport publishes in descriptors: where to reach it. Nothing that grants writes (a
/// remote key) goes in a descriptor; a UCX receiver that accepts one-sided puts hands its keys out only in
/// `TransferAccept`.
pub struct Served {
    pub endpoint: TransportEndpoint,
    /// Keeps the listener (and registrations) alive; dropping it stops serving.
    pub guard: Box<dyn Send + Sync>,
}

impl Served {
    /// A `kind` endpoint at `address`, kept alive by `guard`.
    pub fn new(kind: TransportKind, address: Vec<u8>, guard: impl Send + Sync + 'static) -> Self {
        Served { endpoint: TransportEndpoint { kind: kind.as_str().into(), address }, guard: Box::new(guard) }
    }
}

/// One transport implementation. `serve` is the receiver side, `connect` the sender side.
pub trait Transport: Send + Sync {
    fn kind(&self) -> TransportKind;

    /// Makes `core`'s arena writable by senders and delivers their control messages to it.
    fn serve(&self, core: Arc<ReceiverCore>) -> Result<Served, TransferError>;

    /// A link to the receiver at `endpoint`, reading from `local`'s arena. Messages the receiver sends
    /// that are not replies go to `inbound`.
    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        local: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError>;
}

/// Sender-side handler of receiver-initiated messages (aborts) and link loss.
pub trait Inbound: Send + Sync {
    /// The receiver asks to stop `abort.session_id`; reply with `Link::flush_then_reply` once no further
    /// put of that session can be issued.
    fn on_abort(&self, link: &Arc<dyn Link>, correlation_id: u64, abort: proto::v1::TransferAbort);
    fn on_link_lost(&self, link_id: u64, reason: &str);
}

/// A copy of `len` bytes from the sender's arena into the receiver's: a write the receiver admits, or a
/// one-sided put where the receiver granted regions.
pub struct PutOp {
    pub session_id: u64,
    /// The session token (from the receiver's Accept), which every receiver-mediated write carries.
    pub token: [u8; TOKEN_BYTES],
    /// Source address: in the sender's arena, or in `staged` when the arena is device memory.
    pub src: *const u8,
    pub len: u64,
    /// Destination offset from the receiver's pool base.
    pub dst_offset: u64,
    /// Destination virtual address (region base + offset) and the region holding it.
    pub dst_addr: u64,
    pub region: usize,
    /// Which of the link's lanes carries it (taken modulo the lane count).
    pub lane: usize,
    /// The host copy `src` points into, for a device pool staged through host memory. Transports hold the
    /// op (or this buffer) until they are done reading `src`; dropping it lends the buffer out again.
    pub staged: Option<StagedBuf>,
    /// `src` is device memory (a device pool sent without staging, over a link whose
    /// [`Link::moves_device_memory`]).
    pub device: bool,
    /// A gathered write starting in this layer's stream ([`crate::receiver::core::StreamPermit`]):
    /// `dst_offset` is the offset in that layer's stream (the write may run on into the next layers'),
    /// `src` the device buffer it was gathered into.
    pub stream_layer: Option<u32>,
    /// The device buffer `src` points into for a gathered write, held until the transport is done.
    pub device_buf: Option<crate::staging::DeviceBuf>,
}

impl PutOp {
    /// The header a receiver-mediated write of this op carries.
    pub fn header(&self) -> WriteHeader {
        WriteHeader { session: self.session_id, token: self.token, offset: self.dst_offset, len: self.len }
    }
}

/// What every receiver-mediated write carries ahead of its payload (TCP data frames, UCX data active
/// messages): `[session: u64][session token: 16 bytes][pool offset: u64][len: u64]`, integers
/// little-endian.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct WriteHeader {
    pub session: u64,
    pub token: [u8; TOKEN_BYTES],
    pub offset: u64,
    pub len: u64,
}

impl WriteHeader {
    pub const BYTES: usize = 8 + TOKEN_BYTES + 16;

    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&self.session.to_le_bytes());
        b[8..8 + TOKEN_BYTES].copy_from_slice(&self.token);
        b[8 + TOKEN_BYTES..16 + TOKEN_BYTES].copy_from_slice(&self.offset.to_le_bytes());
        b[16 + TOKEN_BYTES..24 + TOKEN_BYTES].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// `None` unless `b` is exactly [`WriteHeader::BYTES`] long.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::BYTES {
            return None;
        }
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
        Some(WriteHeader {
            session: word(0),
            token: b[8..8 + TOKEN_BYTES].try_into().ok()?,
            offset: word(8 + TOKEN_BYTES),
            len: word(16 + TOKEN_BYTES),
        })
    }
}

/// What a gathered write carries ahead of its payload (UCX active messages `AM_STREAM`):
/// `[session: u64][session token: 16 bytes][layer: u32][stream offset: u64][len: u64]`, little-endian.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct StreamHeader {
    pub session: u64,
    pub token: [u8; TOKEN_BYTES],
    pub layer: u32,
    pub offset: u64,
    pub len: u64,
}

impl StreamHeader {
    pub const BYTES: usize = 8 + TOKEN_BYTES + 4 + 16;

    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        let t = 8 + TOKEN_BYTES;
        b[..8].copy_from_slice(&self.session.to_le_bytes());
        b[8..t].copy_from_slice(&self.token);
        b[t..t + 4].copy_from_slice(&self.layer.to_le_bytes());
        b[t + 4..t + 12].copy_from_slice(&self.offset.to_le_bytes());
        b[t + 12..t + 20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// `None` unless `b` is exactly [`StreamHeader::BYTES`] long.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::BYTES {
            return None;
        }
        let t = 8 + TOKEN_BYTES;
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
        Some(StreamHeader {
            session: word(0),
            token: b[8..t].try_into().ok()?,
            layer: u32::from_le_bytes(b[t..t + 4].try_into().ok()?),
            offset: word(t + 4),
            len: word(t + 12),
        })
    }
}

// SAFETY: `src` points into an arena the session keeps alive (Arc<KvCache>) until its puts are flushed,
// or into `staged`, which the op owns.
unsafe impl Send for PutOp {}
unsafe impl Sync for PutOp {}

pub type Reply = Arc<Cell<Result<Body, TransferError>>>;
pub type Flushed = Arc<Cell<Result<(), TransferError>>>;

/// Sender side of a connection to one receiver.
pub trait Link: Send + Sync {
    fn id(&self) -> u64;
    /// Sends a request; the reply (same correlation id) completes the returned cell.
    fn call(&self, body: Body) -> Result<Reply, TransferError>;
    /// Sends `body` once every put queued before it is visible, without a round trip through the
    /// caller (`None`: not supported here; the caller flushes, waits, then calls).
    fn flush_then_call(&self, _body: Body) -> Option<Result<Reply, TransferError>> {
        None
    }
    /// Independent streams the link spreads puts over; the shipper cuts puts into pieces when above 1.
    fn lanes(&self) -> usize {
        1
    }
    /// The largest write the receiver can place, where that is bounded: a receiver staging a device pool
    /// lands each UCX active message whole in one staging buffer. The shipper cuts puts to fit.
    fn max_write(&self) -> Option<u64> {
        None
    }
    /// Whether puts may read device memory directly (a CUDA-capable UCX): a sender with a device pool then
    /// sends from it without host staging. Other links get host memory only.
    fn moves_device_memory(&self) -> bool {
        false
    }
    /// Whether the receiver lands gathered writes (`TransferAccept::stream_writes`, noted by `accepted`).
    fn stream_writes(&self) -> bool {
        false
    }
    /// Sets up the writes of a session the receiver accepted: makes the regions it granted for one-sided
    /// puts usable by `put` (none granted: every write goes through the receiver) and notes the largest
    /// write it places. Returns a handle for the regions (0 when none).
    fn accepted(&self, _accept: &TransferAccept) -> Result<u64, TransferError> {
        Ok(0)
    }
    fn detach_regions(&self, _handle: u64) {}
    /// Queues a put; never blocks. Failures surface at the next flush.
    fn put(&self, regions: u64, op: PutOp) -> Result<(), TransferError>;
    /// Completes once every put queued before it is visible in the receiver's memory.
    fn flush(&self) -> Result<Flushed, TransferError>;
    /// Flushes, then sends `body` as the reply to `correlation_id` (acknowledging a receiver's abort).
    fn flush_then_reply(&self, correlation_id: u64, body: Body);
    fn is_alive(&self) -> bool;
}

/// Receiver side of a connection from one sender.
pub trait PeerLink: Send + Sync {
    fn id(&self) -> u64;
    /// Whether writes from this peer bypass [`ReceiverCore::admit_write`] (one-sided RMA): then only the
    /// sender's acknowledgement, or a quarantine after its loss, makes freeing blocks safe.
    fn one_sided(&self) -> bool;
    fn send(&self, msg: TransferControl);
    /// Drops the connection (the receiver gave up waiting for the sender).
    fn close(&self);
}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Process-unique ids for links, peers and correlation.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Replies pending on a link: correlation id -> cell. Fails them all when the link dies.
#[derive(Default)]
pub(crate) struct PendingCalls {
    calls: std::sync::Mutex<(bool, std::collections::HashMap<u64, Reply>)>,
}

impl PendingCalls {
    /// Registers a call; `None` once the link died.
    pub fn register(&self) -> Option<(u64, Reply)> {
        let mut g = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 {
            return None;
        }
        let id = next_id();
        let cell = Cell::new();
        g.1.insert(id, cell.clone());
        Some((id, cell))
    }

    /// Completes the call `id`; false when no such call is pending.
    pub fn complete(&self, id: u64, v: Result<Body, TransferError>) -> bool {
        let cell = self.calls.lock().unwrap_or_else(|p| p.into_inner()).1.remove(&id);
        match cell {
            Some(c) => {
                c.set(v);
                true
            }
            None => false,
        }
    }

    /// A message from the receiver on the sender's link `link`: the reply to one of its pending calls, else an
    /// abort for `inbound` (anything else is dropped).
    pub fn deliver<L: Link + 'static>(&self, link: &Arc<L>, inbound: &dyn Inbound, msg: TransferControl) {
        let body = msg.body.clone().unwrap_or(Body::Ack(Default::default()));
        if self.complete(msg.correlation_id, Ok(body)) {
            return;
        }
        if let Some(Body::Abort(a)) = msg.body {
            let dl: Arc<dyn Link> = link.clone();
            inbound.on_abort(&dl, msg.correlation_id, a);
        }
    }

    pub fn fail_all(&self, reason: &str) {
        let drained: Vec<Reply> = {
            let mut g = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            g.0 = true;
            g.1.drain().map(|(_, c)| c).collect()
        };
        for c in drained {
            c.set(Err(TransferError::Transport(format!("link lost: {reason}"))));
        }
    }
}

/// A control message with `body` and `correlation_id`.
pub(crate) fn control(correlation_id: u64, body: Body) -> TransferControl {
    TransferControl { correlation_id, body: Some(body) }
}

#[cfg(test)]
mod tests {
    use super::WriteHeader;

    #[test]
    fn write_headers_round_trip_and_refuse_other_lengths() {
        let h = WriteHeader { session: 7, token: [0xab; 16], offset: 1 << 40, len: 656 };
        let b = h.encode();
        assert_eq!(b.len(), 40);
        assert!(WriteHeader::decode(&b) == Some(h));
        assert!(WriteHeader::decode(&b[..39]).is_none());
        assert!(WriteHeader::decode(&[b.as_slice(), &[0]].concat()).is_none());
    }
}
