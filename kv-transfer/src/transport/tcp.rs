//! TCP transport (tokio). Same semantics as UCX: the receiver reads each data frame's payload straight
//! into the destination blocks (no intermediate copy), after `admit_write` checked the range; control
//! messages share the connection, so a completion is processed after every data frame sent before it.
//!
//! Frames: control `[1][len: u32 LE][TransferControl]`; data
//! `[2][session: u64][token: u64][offset: u64][len: u64][len bytes]` (all little-endian).

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use engine::cache::KvCache;
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::{MemoryRegion, TransferControl, TransportEndpoint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{
    Flushed, Inbound, Link, PeerLink, PendingCalls, PutOp, Reply, Served, Transport, TransportKind, control, next_id,
};
use crate::receiver::core::{ReceiverCore, Refusal};
use crate::wait::Cell;
use crate::{TcpConfig, TransferError};

const TAG_CONTROL: u8 = 1;
const TAG_DATA: u8 = 2;
/// Control messages are small (the largest is a 128K-token handshake, ~8 KB); anything huge is garbage.
const MAX_CONTROL: u32 = 16 << 20;
const IO_BUF: usize = 256 << 10;

pub struct TcpTransport {
    cfg: TcpConfig,
    rt: tokio::runtime::Handle,
}

impl TcpTransport {
    pub fn new(cfg: TcpConfig, rt: tokio::runtime::Handle) -> Self {
        TcpTransport { cfg, rt }
    }
}

/// Runs `fut` on `rt` and waits for it from a plain thread until `deadline`.
fn run_until<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    deadline: Instant,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let cell = Cell::new();
    let c2 = cell.clone();
    let task = rt.spawn(async move {
        c2.set(fut.await);
    });
    let r = cell.wait_until(deadline);
    if r.is_none() {
        task.abort();
    }
    r
}

struct ListenerGuard(tokio::task::AbortHandle);

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn serve(&self, core: Arc<ReceiverCore>) -> Result<Served, TransferError> {
        let listen = self.cfg.listen;
        let std_listener = std::net::TcpListener::bind(listen)
            .map_err(|e| TransferError::Transport(format!("cannot listen on {listen}: {e}")))?;
        std_listener.set_nonblocking(true).map_err(|e| TransferError::Transport(e.to_string()))?;
        let local = std_listener.local_addr().map_err(|e| TransferError::Transport(e.to_string()))?;
        let host = match &self.cfg.advertise_host {
            Some(h) => h.clone(),
            None if local.ip().is_unspecified() => {
                tracing::warn!(%local, "listening on all interfaces without an advertise host; descriptors say 127.0.0.1");
                "127.0.0.1".to_string()
            }
            None => local.ip().to_string(),
        };
        let address = match host.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => format!("[{host}]:{}", local.port()),
            _ => format!("{host}:{}", local.port()),
        };
        let weak = Arc::downgrade(&core);
        let task = {
            let _g = self.rt.enter();
            let listener = TcpListener::from_std(std_listener).map_err(|e| TransferError::Transport(e.to_string()))?;
            self.rt.spawn(async move {
                loop {
                    let (stream, from) = match listener.accept().await {
                        Ok(x) => x,
                        Err(e) => {
                            // Out of descriptors and the like: back off instead of spinning.
                            tracing::warn!(error = %e, "kv-transfer tcp accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let Some(core) = weak.upgrade() else { break };
                    let _ = stream.set_nodelay(true);
                    tracing::debug!(%from, "kv-transfer tcp sender connected");
                    serve_conn(core, stream);
                }
            })
        };
        let arena = core.cache.arena();
        Ok(Served {
            endpoint: TransportEndpoint { kind: TransportKind::Tcp.as_str().into(), address: address.into_bytes() },
            regions: vec![MemoryRegion {
                remote_addr: arena.as_ptr() as u64,
                length: arena.len() as u64,
                rkey: Vec::new(),
            }],
            guard: Box::new(ListenerGuard(task.abort_handle())),
        })
    }

    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        _local: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        let addr = String::from_utf8_lossy(&endpoint.address).to_string();
        let a2 = addr.clone();
        let stream = run_until(&self.rt, deadline, async move { TcpStream::connect(a2).await })
            .ok_or_else(|| TransferError::Transport(format!("connecting to {addr}: timed out")))?
            .map_err(|e| TransferError::Transport(format!("connecting to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel::<Out>();
        let link =
            Arc::new(TcpLink { id: next_id(), tx, calls: PendingCalls::default(), alive: AtomicBool::new(true) });
        let weak = Arc::downgrade(&link);
        let inbound2 = inbound.clone();
        self.rt.spawn(async move {
            let r = write_loop(wr, rx).await;
            lost(&weak, &inbound2, &format!("write: {}", r.err().map(|e| e.to_string()).unwrap_or("closed".into())));
        });
        let weak = Arc::downgrade(&link);
        self.rt.spawn(async move {
            let r = sender_read_loop(rd, &weak, &inbound).await;
            lost(&weak, &inbound, &format!("read: {}", r.err().map(|e| e.to_string()).unwrap_or("closed".into())));
        });
        tracing::debug!(%addr, "kv-transfer tcp link up");
        Ok(link)
    }
}

fn lost(link: &Weak<TcpLink>, inbound: &Arc<dyn Inbound>, reason: &str) {
    if let Some(l) = link.upgrade()
        && l.alive.swap(false, Ordering::SeqCst)
    {
        tracing::info!(reason, "kv-transfer tcp link lost");
        l.calls.fail_all(reason);
        inbound.on_link_lost(l.id, reason);
    }
}

enum Out {
    Ctl(TransferControl),
    Data(PutOp),
    Flush(Flushed),
}

async fn write_frame_ctl<W: AsyncWrite + Unpin>(w: &mut W, msg: &TransferControl) -> std::io::Result<()> {
    let bytes = msg.encode_to_vec();
    w.write_u8(TAG_CONTROL).await?;
    w.write_u32_le(bytes.len() as u32).await?;
    w.write_all(&bytes).await
}

async fn write_loop(wr: tokio::net::tcp::OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Out>) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(IO_BUF, wr);
    let mut flushed: Vec<Flushed> = Vec::new();
    let result = async {
        while let Some(first) = rx.recv().await {
            let mut item = Some(first);
            while let Some(it) = item.take() {
                match it {
                    Out::Ctl(m) => write_frame_ctl(&mut w, &m).await?,
                    Out::Data(op) => {
                        let mut hdr = [0u8; 33];
                        hdr[0] = TAG_DATA;
                        hdr[1..9].copy_from_slice(&op.session_id.to_le_bytes());
                        hdr[9..17].copy_from_slice(&op.token.to_le_bytes());
                        hdr[17..25].copy_from_slice(&op.dst_offset.to_le_bytes());
                        hdr[25..33].copy_from_slice(&op.len.to_le_bytes());
                        w.write_all(&hdr).await?;
                        // SAFETY: the session keeps the source arena alive and unmodified until flushed.
                        let src = unsafe { std::slice::from_raw_parts(op.src, op.len as usize) };
                        w.write_all(src).await?;
                    }
                    Out::Flush(c) => flushed.push(c),
                }
                item = rx.try_recv().ok();
            }
            w.flush().await?;
            for c in flushed.drain(..) {
                c.set(Ok(()));
            }
        }
        Ok(())
    }
    .await;
    for c in flushed.drain(..) {
        c.set(Err(TransferError::Transport("link lost: write failed".into())));
    }
    rx.close();
    while let Ok(it) = rx.try_recv() {
        if let Out::Flush(c) = it {
            c.set(Err(TransferError::Transport("link lost: write failed".into())));
        }
    }
    result
}

async fn read_ctl<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<TransferControl> {
    let len = r.read_u32_le().await?;
    if len > MAX_CONTROL {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("control frame of {len} bytes")));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf).await?;
    TransferControl::decode(buf.as_slice()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

async fn sender_read_loop(
    rd: tokio::net::tcp::OwnedReadHalf,
    link: &Weak<TcpLink>,
    inbound: &Arc<dyn Inbound>,
) -> std::io::Result<()> {
    let mut r = BufReader::new(rd);
    loop {
        let tag = r.read_u8().await?;
        if tag != TAG_CONTROL {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unexpected frame tag {tag}")));
        }
        let msg = read_ctl(&mut r).await?;
        let Some(l) = link.upgrade() else { return Ok(()) };
        let body = msg.body.clone().unwrap_or(Body::Ack(Default::default()));
        if l.calls.complete(msg.correlation_id, Ok(body)) {
            continue;
        }
        if let Some(Body::Abort(a)) = msg.body {
            let dl: Arc<dyn Link> = l.clone();
            inbound.on_abort(&dl, msg.correlation_id, a);
        }
    }
}

struct TcpLink {
    id: u64,
    tx: mpsc::UnboundedSender<Out>,
    calls: PendingCalls,
    alive: AtomicBool,
}

impl TcpLink {
    fn send(&self, o: Out) -> Result<(), TransferError> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(TransferError::Transport("link lost: connection closed".into()));
        }
        self.tx.send(o).map_err(|_| TransferError::Transport("link lost: connection closed".into()))
    }
}

impl Link for TcpLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn call(&self, body: Body) -> Result<Reply, TransferError> {
        let (id, cell) = self.calls.register().ok_or_else(|| TransferError::Transport("link lost: closed".into()))?;
        self.send(Out::Ctl(control(id, body)))?;
        Ok(cell)
    }

    fn attach_regions(&self, _regions: &[MemoryRegion]) -> Result<u64, TransferError> {
        Ok(0)
    }

    fn detach_regions(&self, _handle: u64) {}

    fn put(&self, _regions: u64, op: PutOp) -> Result<(), TransferError> {
        self.send(Out::Data(op))
    }

    fn flush(&self) -> Result<Flushed, TransferError> {
        let c = Cell::new();
        self.send(Out::Flush(c.clone()))?;
        Ok(c)
    }

    fn flush_then_reply(&self, correlation_id: u64, body: Body) {
        // Frames are ordered: the reply follows every data frame queued before it.
        let _ = self.send(Out::Ctl(control(correlation_id, body)));
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}

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

fn serve_conn(core: Arc<ReceiverCore>, stream: TcpStream) {
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
