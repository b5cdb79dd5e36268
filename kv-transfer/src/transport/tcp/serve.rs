//! The receiver's side of one sender connection: control messages to the core, data frames read straight
//! into admitted blocks, barriers answered once every frame before them was placed.

use std::sync::{Arc, Mutex, Weak};

use proto::v1::TransferControl;
use proto::v1::transfer_control::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::{IO_BUF, TAG_BARRIER, TAG_CONTROL, TAG_DATA, read_ctl, write_frame_ctl};
use crate::receiver::core::{ReceiverCore, Refusal};
use crate::transport::{PeerLink, control, next_id};

/// Receiver side of one sender connection.
struct TcpPeer {
    id: u64,
    tx: mpsc::UnboundedSender<TransferControl>,
    reader: Mutex<Option<tokio::task::AbortHandle>>,
    core: Weak<ReceiverCore>,
}

impl PeerLink for TcpPeer {
    fn id(&self) -> u64 {
        self.id
    }

    fn one_sided(&self) -> bool {
        false
    }

    fn send(&self, msg: TransferControl) {
        let _ = self.tx.send(msg);
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
    let (tx, mut rx) = mpsc::unbounded_channel::<TransferControl>();
    let peer = Arc::new(TcpPeer { id: next_id(), tx, reader: Mutex::new(None), core: Arc::downgrade(&core) });
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
        let peer_dyn: Arc<dyn PeerLink> = p2.clone();
        let r = receiver_read_loop(rd, &weak, &peer_dyn).await;
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
    peer: &Arc<dyn PeerLink>,
) -> std::io::Result<()> {
    let mut r = BufReader::with_capacity(IO_BUF, rd);
    let mut scratch = Vec::new();
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
                core.on_control(peer, msg);
            }
            TAG_BARRIER => {
                // This connection's reader placed every frame before the barrier: answer it.
                let id = r.read_u64_le().await?;
                peer.send(control(id, Body::Ack(Default::default())));
            }
            TAG_DATA => {
                let mut hdr = [0u8; 32];
                r.read_exact(&mut hdr).await?;
                let word = |i: usize| u64::from_le_bytes(hdr[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                let (session, token, offset, len) = (word(0), word(1), word(2), word(3));
                match core.admit_write(session, token, offset, len) {
                    Ok(permit) => {
                        // SAFETY: the permit is the only writer of its range.
                        r.read_exact(unsafe { permit.slice() }).await?;
                        permit.commit();
                    }
                    Err(refusal) => {
                        if let Refusal::Invalid(why) = refusal {
                            tracing::warn!(why, "dropping an invalid write");
                        }
                        // Drop the payload: the transfer is gone, aborted or was failed for this write.
                        let mut left = len;
                        scratch.resize(IO_BUF, 0);
                        while left > 0 {
                            let n = left.min(IO_BUF as u64) as usize;
                            r.read_exact(&mut scratch[..n]).await?;
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
