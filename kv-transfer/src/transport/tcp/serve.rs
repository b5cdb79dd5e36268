//! The receiver's side of one sender connection: control messages to the core, data frames read straight
//! into admitted blocks (through one reused staging buffer for a device pool), barriers answered once
//! every frame before them was placed.
//!
//! A connection is trusted once the core accepted one of its handshakes (an `Accept` went out on it), or
//! admitted one of its data frames (a link's other lanes): a handshake that carries the right token but
//! is refused (already started, past its deadline, an orphaned reservation) leaves it a stranger. Before
//! that only handshakes are answered (at most [`UNTRUSTED_HANDSHAKES`] refused ones); any other frame
//! closes the connection.
//! Replies wait in a queue of at most [`REPLY_QUEUE`] messages; a peer that does not read them is cut off.
//! A data frame whose payload stops arriving for the receiver's `write_stall` drops the connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use proto::v1::TransferControl;
use proto::v1::transfer_control::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::{IO_BUF, TAG_BARRIER, TAG_CONTROL, TAG_DATA, read_ctl, write_frame_ctl};
use crate::receiver::core::{ReceiverCore, Refusal, WritePermit};
use crate::staging::STAGE_BYTES;
use crate::transport::{PeerLink, WriteHeader, control, next_id};

/// Replies queued for one connection. A sender reads its replies as they come; a full queue means the
/// peer stopped reading (or floods us with requests for replies), and it is disconnected.
pub(super) const REPLY_QUEUE: usize = 4096;
/// Refused handshakes (and writes to no live transfer) a connection may send before one succeeds.
pub(super) const UNTRUSTED_HANDSHAKES: u32 = 16;
/// The largest write to no live transfer an untrusted connection may send (it is read and dropped): a
/// striped link's lanes ship pieces of about a MiB, and a lane's first write may meet a transfer that
/// just ended.
const UNTRUSTED_WRITE_BYTES: u64 = 4 << 20;

/// Receiver side of one sender connection.
struct TcpPeer {
    id: u64,
    tx: mpsc::Sender<TransferControl>,
    reader: Mutex<Option<tokio::task::AbortHandle>>,
    core: Weak<ReceiverCore>,
    overflowed: AtomicBool,
    /// The core accepted a handshake on this connection (an `Accept` was queued).
    accepted: AtomicBool,
}

impl PeerLink for TcpPeer {
    fn id(&self) -> u64 {
        self.id
    }

    fn one_sided(&self) -> bool {
        false
    }

    fn send(&self, msg: TransferControl) {
        if matches!(msg.body, Some(Body::Accept(_))) {
            self.accepted.store(true, Ordering::SeqCst);
        }
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(msg)
            && !self.overflowed.swap(true, Ordering::SeqCst)
        {
            tracing::warn!(queued = REPLY_QUEUE, "kv-transfer tcp peer does not read its replies; disconnecting");
            if let Some(core) = self.core.upgrade() {
                core.count_cut_off();
            }
            self.close();
        }
    }

    fn close(&self) {
        if let Some(h) = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
        if let Some(core) = self.core.upgrade() {
            core.peer_lost(self.id, "connection closed by the receiver");
        }
    }
}

pub(super) fn serve_conn(core: Arc<ReceiverCore>, stream: TcpStream) {
    let (rd, wr) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<TransferControl>(REPLY_QUEUE);
    let peer = Arc::new(TcpPeer {
        id: next_id(),
        tx,
        reader: Mutex::new(None),
        core: Arc::downgrade(&core),
        overflowed: AtomicBool::new(false),
        accepted: AtomicBool::new(false),
    });
    let rt = core.runtime().clone();
    rt.spawn(async move {
        let mut w = BufWriter::new(wr);
        while let Some(m) = rx.recv().await {
            if write_frame_ctl(&mut w, &m).await.is_err() {
                break;
            }
            while let Ok(m) = rx.try_recv() {
                if write_frame_ctl(&mut w, &m).await.is_err() {
                    return;
                }
            }
            if w.flush().await.is_err() {
                break;
            }
        }
    });
    let p2 = peer.clone();
    let weak = Arc::downgrade(&core);
    drop(core);
    let reader = rt.spawn(async move {
        let r = receiver_read_loop(rd, &weak, &p2).await;
        if let Some(core) = weak.upgrade() {
            let reason = match r {
                Ok(()) => "connection closed".to_string(),
                Err(e) => format!("connection error: {e}"),
            };
            core.peer_lost(p2.id, &reason);
        }
    });
    *peer.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader.abort_handle());
}

async fn receiver_read_loop(
    rd: tokio::net::tcp::OwnedReadHalf,
    core: &Weak<ReceiverCore>,
    tcp_peer: &Arc<TcpPeer>,
) -> std::io::Result<()> {
    let peer: Arc<dyn PeerLink> = tcp_peer.clone();
    let mut r = BufReader::with_capacity(IO_BUF, rd);
    let mut scratch = Vec::new();
    let mut trusted = false;
    let mut refused = 0u32;
    let untrusted = |what: &str| {
        if let Some(core) = core.upgrade() {
            core.count_dropped_untrusted(1);
            core.count_cut_off();
        }
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{what} before a valid handshake"))
    };
    loop {
        let tag = match r.read_u8().await {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(core) = core.upgrade() else { return Ok(()) };
        match tag {
            TAG_CONTROL => {
                let msg = read_ctl(&mut r).await?;
                if trusted {
                    core.on_control(&peer, msg);
                    continue;
                }
                if !matches!(msg.body, Some(Body::Begin(_))) {
                    return Err(untrusted("a control message"));
                }
                // The Accept (if any) is queued from within on_control, on this task.
                core.on_control(&peer, msg);
                trusted = tcp_peer.accepted.load(Ordering::SeqCst);
                if !trusted {
                    refused += 1;
                    if refused > UNTRUSTED_HANDSHAKES {
                        return Err(untrusted("too many refused handshakes"));
                    }
                }
            }
            TAG_BARRIER => {
                if !trusted {
                    return Err(untrusted("a barrier"));
                }
                // This connection's reader placed every frame before the barrier: answer it.
                let id = r.read_u64_le().await?;
                peer.send(control(id, Body::Ack(Default::default())));
            }
            TAG_DATA => {
                let mut hdr = [0u8; WriteHeader::BYTES];
                r.read_exact(&mut hdr).await?;
                let Some(WriteHeader { session, token, offset, len }) = WriteHeader::decode(&hdr) else {
                    return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "bad write header"));
                };
                let stall = core.timings().write_stall;
                match core.admit_write(session, &token, offset, len) {
                    Ok(permit) if permit.staged() => {
                        trusted = true;
                        read_staged(&mut r, permit, &mut scratch, stall).await?;
                    }
                    Ok(permit) => {
                        trusted = true;
                        // SAFETY: the permit is the only writer of its range.
                        read_within(&mut r, unsafe { permit.slice() }, stall).await?;
                        permit.commit();
                    }
                    Err(refusal) => {
                        match &refusal {
                            // Its sender broke the rules and the transfer failed: once per transfer.
                            Refusal::Invalid(why) => tracing::warn!(why, "dropping an invalid write"),
                            // Counted by the core; a trusted peer may send any number: never above debug.
                            Refusal::WrongToken => {
                                tracing::debug!(session, "dropping a write without the session token")
                            }
                            Refusal::Stale => {}
                        }
                        if !trusted && refusal != Refusal::Stale {
                            return Err(untrusted("an invalid write"));
                        }
                        if !trusted {
                            refused += 1;
                            if refused > UNTRUSTED_HANDSHAKES || len > UNTRUSTED_WRITE_BYTES {
                                return Err(untrusted("writes to no live transfer"));
                            }
                        }
                        // Stale (the transfer ended, or never existed): a lane's first write can meet a
                        // transfer that just ended, so the bytes are only dropped; nothing is answered.
                        // Drop the payload: the transfer is gone, aborted or was failed for this write.
                        let mut left = len;
                        if scratch.len() < IO_BUF {
                            scratch.resize(IO_BUF, 0);
                        }
                        while left > 0 {
                            let n = left.min(IO_BUF as u64) as usize;
                            read_within(&mut r, &mut scratch[..n], stall).await?;
                            left -= n as u64;
                        }
                    }
                }
            }
            t => {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown frame tag {t}")));
            }
        }
    }
}

/// Reads a data frame's payload for a device pool: through `scratch` (one staging buffer per connection,
/// reused) into the pool with `copy_in`. A failed copy fails the transfer; the rest of the payload is
/// still read so the connection stays in frame.
async fn read_staged(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    permit: WritePermit,
    scratch: &mut Vec<u8>,
    stall: Duration,
) -> std::io::Result<()> {
    if scratch.len() < STAGE_BYTES {
        scratch.resize(STAGE_BYTES, 0);
    }
    let mut failed = None;
    let mut at = 0;
    while at < permit.len {
        let n = (permit.len - at).min(STAGE_BYTES);
        read_within(r, &mut scratch[..n], stall).await?;
        if failed.is_none()
            && let Err(why) = permit.copy_in(at, &scratch[..n])
        {
            failed = Some(why);
        }
        at += n;
    }
    match failed {
        None => permit.commit(),
        Some(why) => permit.fail(&why),
    }
    Ok(())
}

/// Reads `buf` whole, or fails when no byte arrives for `stall`: a sender that stops mid-frame must not
/// hold the frame's write permit (and so its transfer's blocks) forever. Dropping the connection ends
/// the write, and the sender's transfers fail as with a lost peer.
async fn read_within(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    buf: &mut [u8],
    stall: Duration,
) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match tokio::time::timeout(stall, r.read(&mut buf[at..])).await {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(n)) => at += n,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("a data frame stalled for {stall:?} ({at} of {} bytes)", buf.len()),
                ));
            }
        }
    }
    Ok(())
}
