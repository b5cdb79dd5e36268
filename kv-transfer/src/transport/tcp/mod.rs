//! TCP transport (tokio). Same semantics as UCX: the receiver reads each data frame's payload straight
//! into the destination blocks (no intermediate copy), after `admit_write` checked the range.
//!
//! A link is one or more connections (lanes, see [`super::lanes`]): control messages go on lane 0, data
//! on the lane the shipper picked for each piece. On one connection frame order alone puts a completion after
//! the data; with several, a flush also sends a barrier on every other lane, which the receiver answers
//! once it has placed every frame before it.
//!
//! Frames: control `[1][len: u32 LE][TransferControl]`; data `[2][WriteHeader][len bytes]` (session: u64,
//! token: 16 bytes, pool offset: u64, len: u64); barrier `[3][id: u64]`, answered by an `Ack` control
//! frame with correlation id `id` (integers little-endian).

mod serve;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use kv_cache::KvCache;
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::{TransferControl, TransportEndpoint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::lanes::{FlushJoin, LaneEpochs, lanes_or_default};
use super::{Flushed, Inbound, Link, PendingCalls, PutOp, Reply, Served, Transport, TransportKind, control, next_id};
use crate::receiver::core::ReceiverCore;
use crate::wait::Cell;
use crate::{TcpConfig, TransferError};

const TAG_CONTROL: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_BARRIER: u8 = 3;
/// Control messages are small (the largest is a 128K-token handshake, ~8 KB); anything huge is garbage.
const MAX_CONTROL: u32 = 16 << 20;
const IO_BUF: usize = 256 << 10;

pub struct TcpTransport {
    cfg: TcpConfig,
    rt: tokio::runtime::Handle,
    lanes: usize,
}

impl TcpTransport {
    pub fn new(cfg: TcpConfig, rt: tokio::runtime::Handle) -> Self {
        Self::with_lanes(cfg, rt, None)
    }

    /// `lanes`: connections per link (`None`: `TANDEM_KV_LANES`, else a quarter of the cores, 2 to 8; 1 on one core).
    pub fn with_lanes(cfg: TcpConfig, rt: tokio::runtime::Handle, lanes: Option<usize>) -> Self {
        TcpTransport { cfg, rt, lanes: lanes_or_default(lanes) }
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
                    serve::serve_conn(core, stream);
                }
            })
        };
        let guard = ListenerGuard(task.abort_handle());
        Ok(Served::new(TransportKind::Tcp, address.into_bytes(), guard))
    }

    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        _local: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        let addr = String::from_utf8_lossy(&endpoint.address).to_string();
        let (a2, n) = (addr.clone(), self.lanes);
        let streams = run_until(&self.rt, deadline, async move {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(TcpStream::connect(a2.clone()).await?);
            }
            Ok::<_, std::io::Error>(v)
        })
        .ok_or_else(|| TransferError::Transport(format!("connecting to {addr}: timed out")))?
        .map_err(|e| TransferError::Transport(format!("connecting to {addr}: {e}")))?;
        let mut lanes = Vec::new();
        let mut halves = Vec::new();
        for stream in streams {
            let _ = stream.set_nodelay(true);
            let (rd, wr) = stream.into_split();
            let (tx, rx) = mpsc::unbounded_channel::<Out>();
            lanes.push(tx);
            halves.push((rd, wr, rx));
        }
        let link = Arc::new(TcpLink {
            id: next_id(),
            epochs: Arc::new(LaneEpochs::new(lanes.len())),
            lanes,
            calls: Arc::new(PendingCalls::default()),
            barriers: Mutex::new((false, HashMap::new())),
            alive: AtomicBool::new(true),
        });
        for (rd, wr, rx) in halves {
            let (weak, inbound2) = (Arc::downgrade(&link), inbound.clone());
            self.rt.spawn(async move {
                let r = write_loop(wr, rx).await;
                let why = format!("write: {}", r.err().map(|e| e.to_string()).unwrap_or("closed".into()));
                lost(&weak, &inbound2, &why);
            });
            let (weak, inbound2) = (Arc::downgrade(&link), inbound.clone());
            self.rt.spawn(async move {
                let r = sender_read_loop(rd, &weak, &inbound2).await;
                let why = format!("read: {}", r.err().map(|e| e.to_string()).unwrap_or("closed".into()));
                lost(&weak, &inbound2, &why);
            });
        }
        tracing::debug!(%addr, lanes = self.lanes, "kv-transfer tcp link up");
        Ok(link)
    }
}

fn lost(link: &Weak<TcpLink>, inbound: &Arc<dyn Inbound>, reason: &str) {
    if let Some(l) = link.upgrade()
        && l.alive.swap(false, Ordering::SeqCst)
    {
        tracing::info!(reason, "kv-transfer tcp link lost");
        l.calls.fail_all(reason);
        let joins: Vec<Arc<FlushJoin>> = {
            let mut b = l.barriers.lock().unwrap_or_else(|p| p.into_inner());
            b.0 = true;
            b.1.drain().map(|(_, j)| j).collect()
        };
        for j in joins {
            j.part(Err(TransferError::Transport(format!("link lost: {reason}"))));
        }
        inbound.on_link_lost(l.id, reason);
    }
}

enum Out {
    Ctl(TransferControl),
    Data(PutOp),
    /// Reports to the join once every frame queued before it was written to the socket.
    Flush(Arc<FlushJoin>),
    Barrier(u64),
}

async fn write_frame_ctl<W: AsyncWrite + Unpin>(w: &mut W, msg: &TransferControl) -> std::io::Result<()> {
    let bytes = msg.encode_to_vec();
    w.write_u8(TAG_CONTROL).await?;
    w.write_u32_le(bytes.len() as u32).await?;
    w.write_all(&bytes).await
}

async fn write_loop(wr: tokio::net::tcp::OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Out>) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(IO_BUF, wr);
    let mut flushed: Vec<Arc<FlushJoin>> = Vec::new();
    let result = async {
        while let Some(first) = rx.recv().await {
            let mut item = Some(first);
            while let Some(it) = item.take() {
                match it {
                    Out::Ctl(m) => write_frame_ctl(&mut w, &m).await?,
                    Out::Data(op) => {
                        w.write_u8(TAG_DATA).await?;
                        w.write_all(&op.header().encode()).await?;
                        // SAFETY: the session keeps the source arena alive and unmodified until flushed.
                        let src = unsafe { std::slice::from_raw_parts(op.src, op.len as usize) };
                        w.write_all(src).await?;
                    }
                    Out::Flush(j) => flushed.push(j),
                    Out::Barrier(id) => {
                        let mut b = [0u8; 9];
                        b[0] = TAG_BARRIER;
                        b[1..].copy_from_slice(&id.to_le_bytes());
                        w.write_all(&b).await?;
                    }
                }
                item = rx.try_recv().ok();
            }
            w.flush().await?;
            for j in flushed.drain(..) {
                j.part(Ok(()));
            }
        }
        Ok(())
    }
    .await;
    let failed = || Err(TransferError::Transport("link lost: write failed".into()));
    for j in flushed.drain(..) {
        j.part(failed());
    }
    rx.close();
    while let Ok(it) = rx.try_recv() {
        if let Out::Flush(j) = it {
            j.part(failed());
        }
    }
    result
}

async fn read_ctl<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<TransferControl> {
    let len = r.read_u32_le().await?;
    if len > MAX_CONTROL {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("control frame of {len} bytes")));
    }
    // Grown as the bytes arrive: a peer that announces 16 MB and sends nothing holds no 16 MB buffer.
    let mut buf = Vec::with_capacity((len as usize).min(64 << 10));
    (&mut *r).take(u64::from(len)).read_to_end(&mut buf).await?;
    if buf.len() < len as usize {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "control frame cut short"));
    }
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
        let barrier = l.barriers.lock().unwrap_or_else(|p| p.into_inner()).1.remove(&msg.correlation_id);
        if let Some(j) = barrier {
            j.part(Ok(()));
            continue;
        }
        l.calls.deliver(&l, inbound.as_ref(), msg);
    }
}

struct TcpLink {
    id: u64,
    /// One writer per connection; lane 0 carries control messages.
    lanes: Vec<mpsc::UnboundedSender<Out>>,
    epochs: Arc<LaneEpochs>,
    calls: Arc<PendingCalls>,
    /// Barriers waiting for the receiver's answer (id -> flush); `.0` once the link died.
    barriers: Mutex<(bool, HashMap<u64, Arc<FlushJoin>>)>,
    alive: AtomicBool,
}

impl TcpLink {
    fn send(&self, lane: usize, o: Out) -> Result<(), TransferError> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(TransferError::Transport("link lost: connection closed".into()));
        }
        self.lanes[lane].send(o).map_err(|_| TransferError::Transport("link lost: connection closed".into()))
    }

    /// Lanes 1.. with data frames no answered barrier covers, and the epoch a barrier now would cover.
    fn pending_lanes(&self) -> Vec<(usize, u64)> {
        (1..self.lanes.len()).filter_map(|i| self.epochs.pending(i).map(|e| (i, e))).collect()
    }

    /// Sends a barrier on each of `todo`'s lanes; each reports to `join` once the receiver placed every
    /// frame queued before it there.
    fn barriers(&self, todo: &[(usize, u64)], join: &Arc<FlushJoin>) {
        for &(lane, epoch) in todo {
            let (j, e) = (join.clone(), self.epochs.clone());
            let part = FlushJoin::new(1, move |r| {
                if r.is_ok() {
                    e.covered(lane, epoch);
                }
                j.part(r)
            });
            let id = next_id();
            {
                let mut b = self.barriers.lock().unwrap_or_else(|p| p.into_inner());
                if b.0 {
                    drop(b);
                    part.part(Err(TransferError::Transport("link lost: connection closed".into())));
                    continue;
                }
                b.1.insert(id, part.clone());
            }
            if let Err(e) = self.send(lane, Out::Barrier(id))
                && self.barriers.lock().unwrap_or_else(|p| p.into_inner()).1.remove(&id).is_some()
            {
                part.part(Err(e));
            }
        }
    }
}

impl Link for TcpLink {
    fn id(&self) -> u64 {
        self.id
    }

    fn lanes(&self) -> usize {
        self.lanes.len()
    }

    fn call(&self, body: Body) -> Result<Reply, TransferError> {
        let (id, cell) = self.calls.register().ok_or_else(|| TransferError::Transport("link lost: closed".into()))?;
        self.send(0, Out::Ctl(control(id, body)))?;
        Ok(cell)
    }

    fn flush_then_call(&self, body: Body) -> Option<Result<Reply, TransferError>> {
        if self.lanes.len() == 1 {
            // Frames are ordered: the message follows every data frame queued before it.
            return Some(self.call(body));
        }
        let Some((id, cell)) = self.calls.register() else {
            return Some(Err(TransferError::Transport("link lost: closed".into())));
        };
        let todo = self.pending_lanes();
        let (calls, lane0) = (self.calls.clone(), self.lanes[0].clone());
        let join = FlushJoin::new(todo.len(), move |r| {
            let r = r.and_then(|()| {
                lane0
                    .send(Out::Ctl(control(id, body)))
                    .map_err(|_| TransferError::Transport("link lost: connection closed".into()))
            });
            if let Err(e) = r {
                calls.complete(id, Err(e));
            }
        });
        self.barriers(&todo, &join);
        Some(Ok(cell))
    }

    fn put(&self, _regions: u64, op: PutOp) -> Result<(), TransferError> {
        let lane = op.lane % self.lanes.len();
        self.epochs.note_put(lane);
        self.send(lane, Out::Data(op))
    }

    fn flush(&self) -> Result<Flushed, TransferError> {
        let c: Flushed = Cell::new();
        let c2 = c.clone();
        let todo = self.pending_lanes();
        let join = FlushJoin::new(1 + todo.len(), move |r| {
            c2.set(r);
        });
        if let Err(e) = self.send(0, Out::Flush(join.clone())) {
            join.part(Err(e));
        }
        self.barriers(&todo, &join);
        Ok(c)
    }

    fn flush_then_reply(&self, correlation_id: u64, body: Body) {
        // Writes here are receiver-mediated: the receiver refuses them once it aborted, whatever the
        // order of this reply and data on other lanes.
        let _ = self.send(0, Out::Ctl(control(correlation_id, body)));
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}
