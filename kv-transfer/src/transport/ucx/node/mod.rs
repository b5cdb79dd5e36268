//! One UCX context and worker, driven by a dedicated progress thread. Other threads talk to it through a
//! command queue (and an eventfd to wake it); every UCX call happens on that thread, so the worker runs in
//! UCX's single-threaded mode. UCX callbacks only record events; the loop handles them after progress
//! returns, so no callback re-enters the worker.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak, mpsc};
use std::time::{Duration, Instant};

use prost::Message;
use proto::v1::TransferControl;

use super::api::{StatusPtr, classify, status_str};
use super::sys::*;
use crate::TransferError;
use crate::receiver::core::{Refusal, StreamPermit, WritePermit};
use crate::staging::{DeviceBuf, DevicePool, RECEIVER_LANE_BUFFERS, STAGE_BYTES, STREAM_CHUNK, StagedBuf, StagingPool};
use crate::transport::lanes::{FlushJoin, encode_address};
use crate::transport::{PutOp, StreamHeader, WriteHeader, next_id};
use crate::wait::Cell;

mod callbacks;
mod ops;
mod state;

use callbacks::*;

/// AM id of control messages (header: the origin node id, 8 bytes LE; data: a TransferControl).
pub const AM_CONTROL: u32 = 7101;
/// AM id of data writes (header: a [`WriteHeader`]; payload by rendezvous).
pub const AM_DATA: u32 = 7102;
/// AM id of gathered writes (header: a [`StreamHeader`]; payload by rendezvous, device memory).
pub const AM_STREAM: u32 = 7103;
/// The sleep's timeout with nothing in flight (ms): only to notice the owners are gone.
const IDLE_POLL_MS: i32 = 100;
/// The sleep's timeout with requests in flight (ms).
const INFLIGHT_POLL_MS: i32 = 1;

/// Shared-memory segment (FIFO element payload) size when `UCX_MM_SEG_SIZE` / `UCX_SYSV_SEG_SIZE` /
/// `UCX_POSIX_SEG_SIZE` are unset: 8K (UCX's default) moved 10-12 GB/s at 8K-32K tokens on 2 cores, 32K-60000
/// about 18 GB/s. It must stay below 64 KiB: with UCX 1.13, 64K and 128K segments silently corrupt emulated
/// puts (the checksum tests fail; a FIFO element's 16-bit length is the likely cause).
const SHM_SEG_SIZE: &str = "56K";
/// Progress calls in a row while they make progress, before the command queue is looked at again.
const PROGRESS_BURST: usize = 64;
/// Control messages waiting to be handled after a progress call; more are dropped (a flood).
pub const CONTROL_QUEUE: usize = 1024;
/// Largest control message accepted (a 1M-token handshake's block ids take about 50 KB).
pub const MAX_CONTROL_BYTES: usize = 256 << 10;
/// Control sends in flight on one endpoint. A peer that does not read its replies (or asks for more
/// than it reads) reaches it and is cut off: its endpoint is closed and reported as failed.
pub const CONTROL_INFLIGHT: usize = 1024;

/// Receives what arrives on a node.
pub(crate) trait Sink: Send + Sync {
    fn on_control(&self, node: &Arc<Node>, origin: u64, msg: TransferControl);
    /// Admits an active-message write (receivers); `None` where this node receives no data.
    fn admit(&self, _header: &WriteHeader) -> Option<Result<WritePermit, Refusal>> {
        None
    }
    /// Admits a gathered write (receivers that land them); `None` where this node takes none.
    fn admit_stream(&self, _header: &StreamHeader) -> Option<Result<StreamPermit, Refusal>> {
        None
    }

    fn on_ep_error(&self, ep: u64, reason: &str);
    /// The node closed `ep` because its peer misbehaved (see [`CONTROL_INFLIGHT`]).
    fn on_cut_off(&self, ep: u64, reason: &str) {
        self.on_ep_error(ep, reason);
    }
    /// A control message that did not decode, or arrived while the queue was full (dropped unread).
    fn on_dropped(&self, _count: usize) {}
}

enum Cmd {
    Connect {
        ep: u64,
        addr: Vec<u8>,
        /// Ask for peer-failure detection (else create the endpoint without it).
        peer_errors: bool,
        done: Option<Arc<Cell<Result<(), TransferError>>>>,
    },
    Control {
        ep: u64,
        data: Vec<u8>,
    },
    /// `am`: send as an active message the receiver places (else a one-sided put with `rkeys`).
    Put {
        ep: u64,
        rkeys: u64,
        op: PutOp,
        am: bool,
    },
    Flush {
        ep: u64,
        join: Arc<FlushJoin>,
    },
    Rkeys {
        ep: u64,
        handle: u64,
        packed: Vec<Vec<u8>>,
        done: Arc<Cell<Result<(), TransferError>>>,
    },
    MemMap {
        addr: usize,
        len: usize,
        done: Arc<Cell<Result<Vec<u8>, TransferError>>>,
    },
    CloseEp {
        ep: u64,
    },
    /// The lanes and transports UCX chose for `ep` (`ucp_ep_print_info`'s lane lines).
    Describe {
        ep: u64,
        done: Arc<Cell<String>>,
    },
    /// Closes `ep` once its control sends completed, and at `by` at the latest.
    CloseWhenSent {
        ep: u64,
        by: Instant,
    },
    Shutdown,
}

/// Makes a device pool's context current on a progress thread (UCX moves device memory from there).
pub(crate) type Binder = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Reports when a started connection's endpoint exists.
pub(crate) type Connecting = Arc<Cell<Result<(), TransferError>>>;

/// The handle other threads hold.
pub(crate) struct Node {
    pub id: u64,
    /// This node as a one-lane address ([`encode_address`]): what handshakes carry.
    pub address: Vec<u8>,
    /// The UCP worker address alone.
    pub worker: Vec<u8>,
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake_fd: i32,
    alive: AtomicBool,
    /// The context moves CUDA device memory itself (a CUDA-capable libucp, e.g. the `libucx-cu13` wheel):
    /// device pools are sent and received without host staging.
    pub cuda: bool,
}

impl Node {
    /// Creates the context (reading `UCX_*` from the environment, `tls` overriding `UCX_TLS`,
    /// `net_devices` standing in for an unset `UCX_NET_DEVICES`) and worker, and starts the progress thread.
    /// `rma`: give the context UCX's RMA feature, which one-sided puts need on both sides. It also installs
    /// UCX's software RMA handlers, which write (and read) wherever a connected peer's put names,
    /// whatever the key: only nodes that use or accept one-sided puts ask for it. `bind` runs first on the
    /// progress thread (a device pool's context, made current for UCX's CUDA transports); `landing`: the
    /// device buffers this receiver lane lands gathered writes in (none: it refuses them).
    pub fn start(
        name: &str,
        tls: Option<&str>,
        net_devices: Option<&str>,
        rma: bool,
        sink: Arc<dyn Sink>,
        bind: Option<Binder>,
        landing: Option<Arc<DevicePool>>,
    ) -> Result<Arc<Node>, TransferError> {
        let lib = super::api::load().map_err(TransferError::Transport)?;
        let (tx, rx) = mpsc::channel();
        let init = Cell::new();
        let init2 = init.clone();
        let tls = tls.map(str::to_string);
        let net_devices = net_devices.map(str::to_string);
        // SAFETY: plain syscall.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(TransferError::Transport("eventfd failed".into()));
        }
        let thread_name = format!("{name}-ucx");
        // Counted from before the thread exists: process exit waits for a node still creating its worker.
        live::begin();
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let bound = bind.map_or(Ok(()), |b| {
                    b().map_err(|e| TransferError::Transport(format!("making the cache pool's device current: {e}")))
                });
                // SAFETY: the worker state is created and used on this thread only.
                let st =
                    bound.and_then(|()| unsafe { State::create(lib, tls.as_deref(), net_devices.as_deref(), rma) });
                match st {
                    Ok(mut st) => {
                        st.landing = landing;
                        // The id every message of this node carries and a receiver trusts a sender by: random, so
                        // that a stranger cannot claim a trusted sender's id by guessing it (a process counter
                        // mixed with the pid could be guessed). 0 stays free for "no origin".
                        let id = rand::random::<u64>().max(1);
                        let address = encode_address(id, super::host::host_id(), &[&st.worker_address]);
                        st.origin = id;
                        let node = Arc::new(Node {
                            id,
                            address,
                            worker: st.worker_address.clone(),
                            tx: Mutex::new(mpsc::channel().0),
                            wake_fd,
                            alive: AtomicBool::new(true),
                            cuda: st.cuda,
                        });
                        if live::enter(id, &node) {
                            init2.set(Ok(node.clone()));
                            // SAFETY: same thread.
                            unsafe { st.run(&node, rx, sink) };
                        } else {
                            init2.set(Err(TransferError::Transport("the process is exiting".into())));
                        }
                        node.alive.store(false, Ordering::SeqCst);
                        // SAFETY: same thread; every request was completed or cancelled by run() (or none
                        // was ever issued).
                        unsafe { st.destroy() };
                        live::leave(id);
                    }
                    Err(e) => {
                        live::abandon();
                        init2.set(Err(e));
                    }
                }
            })
            .map_err(|e| {
                live::abandon();
                TransferError::Transport(format!("cannot start the UCX progress thread: {e}"))
            })?;
        let node: Arc<Node> = init
            .wait_until(Instant::now() + Duration::from_secs(30))
            .unwrap_or_else(|| Err(TransferError::Transport("UCX initialisation timed out".into())))?;
        // The thread built the handle before it knew the channel; hand it the real sender now.
        *node.tx.lock().unwrap_or_else(|p| p.into_inner()) = tx;
        Ok(node)
    }

    fn cmd(&self, c: Cmd) -> Result<(), TransferError> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(TransferError::Transport("link lost: UCX worker stopped".into()));
        }
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(c)
            .map_err(|_| TransferError::Transport("link lost: UCX worker stopped".into()))?;
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8) };
        Ok(())
    }

    /// Starts connecting to a peer's UCP worker address; returns the endpoint id at once (commands for it queue
    /// behind the connect).
    pub fn connect_nowait(&self, addr: &[u8], peer_errors: bool) -> Result<u64, TransferError> {
        let ep = next_id();
        self.cmd(Cmd::Connect { ep, addr: addr.to_vec(), peer_errors, done: None })?;
        Ok(ep)
    }

    /// Starts connecting; the cell reports when the endpoint exists (wait with [`Node::connected`]).
    /// `peer_errors`: ask for peer-failure detection where the transports offer it.
    pub fn connect_start(&self, addr: &[u8], peer_errors: bool) -> Result<(u64, Connecting), TransferError> {
        let ep = next_id();
        let done = Cell::new();
        self.cmd(Cmd::Connect { ep, addr: addr.to_vec(), peer_errors, done: Some(done.clone()) })?;
        Ok((ep, done))
    }

    pub fn connected(done: &Cell<Result<(), TransferError>>, deadline: Instant) -> Result<(), TransferError> {
        done.wait_until(deadline).unwrap_or_else(|| Err(TransferError::Transport("UCX connect timed out".into())))
    }

    pub fn send_control(&self, ep: u64, msg: &TransferControl) -> Result<(), TransferError> {
        self.cmd(Cmd::Control { ep, data: msg.encode_to_vec() })
    }

    pub fn put(&self, ep: u64, rkeys: u64, op: PutOp, am: bool) -> Result<(), TransferError> {
        self.cmd(Cmd::Put { ep, rkeys, op, am })
    }

    /// Flushes `ep`; reports to `join` (also when the flush cannot start).
    pub fn flush(&self, ep: u64, join: Arc<FlushJoin>) {
        if let Err(e) = self.cmd(Cmd::Flush { ep, join: join.clone() }) {
            join.part(Err(e));
        }
    }

    /// Unpacks `packed` on `ep` under `handle` (the caller picks it, so lanes can share one id).
    pub fn unpack_rkeys(&self, ep: u64, handle: u64, packed: Vec<Vec<u8>>) -> Result<(), TransferError> {
        let done = Cell::new();
        self.cmd(Cmd::Rkeys { ep, handle, packed, done: done.clone() })?;
        done.wait_until(Instant::now() + Duration::from_secs(10))
            .unwrap_or_else(|| Err(TransferError::Transport("rkey unpack timed out".into())))
    }

    /// Registers `len` bytes at `addr` for remote access; returns the packed rkey.
    pub fn mem_map(&self, addr: *mut u8, len: usize) -> Result<Vec<u8>, TransferError> {
        let done = Cell::new();
        self.cmd(Cmd::MemMap { addr: addr as usize, len, done: done.clone() })?;
        done.wait_until(Instant::now() + Duration::from_secs(60))
            .unwrap_or_else(|| Err(TransferError::Transport("memory registration timed out".into())))
    }

    pub fn close_ep(&self, ep: u64) {
        let _ = self.cmd(Cmd::CloseEp { ep });
    }

    /// The lanes and transports UCX uses for `ep` (for start-up logs); empty if it cannot tell.
    pub fn describe(&self, ep: u64) -> String {
        let done = Cell::new();
        if self.cmd(Cmd::Describe { ep, done: done.clone() }).is_err() {
            return String::new();
        }
        done.wait_until(Instant::now() + Duration::from_secs(5)).unwrap_or_default()
    }

    /// Closes `ep` once what was sent on it went out, or after `within` (a peer that never reads).
    pub fn close_when_sent(&self, ep: u64, within: Duration) {
        let _ = self.cmd(Cmd::CloseWhenSent { ep, by: Instant::now() + within });
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: closing our own fd.
        unsafe { libc::close(self.wake_fd) };
    }
}

/// The progress threads of this process, so that its exit can stop them first. libucs's destructors tear
/// down UCX's object registry (its VFS) without a lock; a progress thread still draining or destroying its
/// worker then (dropping a node only asks its thread to stop, and the drain takes 50-500 ms) corrupts it,
/// and libucs aborts the exit (UCX 1.13: "vfs_obj.c: Assertion `khiter != ...` failed"). An `atexit`
/// handler, registered after libucp is loaded and so run before its destructors, asks every running node to
/// stop and waits for their threads to destroy their workers.
mod live {
    use super::*;

    /// How long process exit waits for the progress threads (each drains for at most 500 ms).
    const EXIT_WAIT: Duration = Duration::from_secs(5);

    #[derive(Default)]
    struct Nodes {
        /// Registered nodes: until their worker and context are destroyed.
        running: HashMap<u64, (Weak<Node>, std::thread::ThreadId)>,
        /// Nodes whose thread is creating its worker (counted from before the thread starts).
        starting: usize,
        /// Set by the exit handler: a node that registers after it destroys its worker at once.
        exiting: bool,
    }

    struct Registry {
        nodes: Mutex<Nodes>,
        gone: Condvar,
    }

    fn registry() -> &'static Registry {
        static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
        R.get_or_init(|| {
            // SAFETY: registering a plain extern "C" function.
            if unsafe { libc::atexit(stop_all) } != 0 {
                tracing::warn!("could not register the UCX exit handler; exit may race the progress threads");
            }
            Registry { nodes: Mutex::new(Nodes::default()), gone: Condvar::new() }
        })
    }

    fn lock(r: &Registry) -> std::sync::MutexGuard<'_, Nodes> {
        r.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A node's thread is about to start.
    pub(super) fn begin() {
        lock(registry()).starting += 1;
    }

    /// A started node failed before it registered (its worker was never created, or was destroyed).
    pub(super) fn abandon() {
        let r = registry();
        let mut n = lock(r);
        n.starting = n.starting.saturating_sub(1);
        drop(n);
        r.gone.notify_all();
    }

    /// Called on the progress thread once its node exists: false while the process is exiting (the thread
    /// then destroys its worker at once and calls [`leave`]).
    pub(super) fn enter(id: u64, node: &Arc<Node>) -> bool {
        let mut n = lock(registry());
        n.starting = n.starting.saturating_sub(1);
        n.running.insert(id, (Arc::downgrade(node), std::thread::current().id()));
        !n.exiting
    }

    /// Called on the progress thread after its worker and context are destroyed.
    pub(super) fn leave(id: u64) {
        let r = registry();
        lock(r).running.remove(&id);
        r.gone.notify_all();
    }

    /// UCX progress threads running in this process (a node's thread counts until its worker and context
    /// are destroyed).
    pub fn running() -> usize {
        lock(registry()).running.len()
    }

    pub(super) extern "C" fn stop_all() {
        let r = registry();
        let me = std::thread::current().id();
        let deadline = Instant::now() + EXIT_WAIT;
        let mut n = lock(r);
        n.exiting = true;
        // A process that exits from a progress thread cannot wait for that thread.
        while n.starting > 0 || n.running.values().any(|(_, t)| *t != me) {
            // Every wake-up asks again: a node that registered since has its Shutdown too (one that
            // registers from now on sees `exiting` and stops by itself).
            for (weak, _) in n.running.values() {
                if let Some(node) = weak.upgrade() {
                    let _ = node.cmd(Cmd::Shutdown);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            n = r
                .gone
                .wait_timeout(n, (deadline - now).min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

pub use live::running as progress_threads;

/// A node that stops its thread when the last owner goes.
pub(crate) struct NodeOwner(pub Arc<Node>);

impl Drop for NodeOwner {
    fn drop(&mut self) {
        let _ = self.0.cmd(Cmd::Shutdown);
    }
}

/// The queue UCX callbacks record into: a node's progress thread owns it and drains it after each progress
/// call (callbacks run inside progress, on that thread). Control messages in it are counted, so a flood
/// is dropped at [`CONTROL_QUEUE`] instead of growing it.
#[derive(Default)]
struct Events {
    q: std::cell::RefCell<VecDeque<Event>>,
    control: std::cell::Cell<usize>,
}

impl Events {
    fn push(&self, ev: Event) {
        self.q.borrow_mut().push_back(ev);
    }

    /// Queues `ev` ahead of everything waiting (a cut-off must take effect before the peer's queued
    /// messages are handled).
    fn push_front(&self, ev: Event) {
        self.q.borrow_mut().push_front(ev);
    }

    /// Queues a control message unless [`CONTROL_QUEUE`] of them wait already (then records the drop).
    fn push_control(&self, origin: u64, bytes: &[u8]) {
        if self.control.get() >= CONTROL_QUEUE || bytes.len() > MAX_CONTROL_BYTES {
            // One marker for a run of drops: the queue stays bounded while the flood lasts.
            let mut q = self.q.borrow_mut();
            if !matches!(q.back(), Some(Event::Dropped(_))) {
                q.push_back(Event::Dropped(0));
            }
            if let Some(Event::Dropped(n)) = q.back_mut() {
                *n += 1;
            }
            return;
        }
        self.control.set(self.control.get() + 1);
        self.q.borrow_mut().push_back(Event::Am(origin, bytes.to_vec()));
    }

    fn pop(&self) -> Option<Event> {
        let ev = self.q.borrow_mut().pop_front();
        if matches!(ev, Some(Event::Am(..))) {
            self.control.set(self.control.get() - 1);
        }
        ev
    }
}

/// What UCX callbacks record.
enum Event {
    Done(u64, ucs_status_t),
    /// An active-message write: its header, then the payload (rendezvous or persistent descriptor, or a
    /// copy of a small eager payload).
    Data(WriteHeader, Payload),
    /// A gathered write: its header and its payload.
    Stream(StreamHeader, Payload),
    EpError(u64, ucs_status_t),
    Am(u64, Vec<u8>),
    /// Control messages dropped in the callback (too large, or the queue was full).
    Dropped(usize),
    /// An endpoint whose peer misbehaves: fail and close it.
    CutOff(u64, &'static str),
}

enum Payload {
    /// A rendezvous descriptor and the length its sender announced.
    Rndv(*mut core::ffi::c_void, u64),
    Persistent(*mut core::ffi::c_void),
    Copied(Vec<u8>),
}

/// Pending request actions, by token. A staging buffer a request reads or fills is held here until the
/// request completes.
enum Action {
    Put(u64, Option<StagedBuf>),
    /// An active-message data send on endpoint `.0`, with the host or device buffer it reads.
    DataSend(u64, Option<StagedBuf>, Option<DeviceBuf>),
    /// Receiving a gathered write into a device buffer, scattered into the blocks when it lands.
    RecvStream(StreamPermit, DeviceBuf),
    /// Receiving a rendezvous payload into admitted memory, or into a staging buffer for a device pool.
    Recv(WritePermit, Option<StagedBuf>),
    /// A control send on endpoint `.0`.
    Control(u64),
    Flush(Arc<FlushJoin>),
    Close,
}

struct Ep {
    h: ucp_ep_h,
    failed: Option<String>,
    /// Keeps the error-callback argument alive.
    _arg: Box<(usize, u64)>,
}

struct State {
    lib: &'static UcpLib,
    ctx: ucp_context_h,
    worker: ucp_worker_h,
    efd: i32,
    worker_address: Vec<u8>,
    events: Box<Events>,
    eps: HashMap<u64, Ep>,
    rkeys: HashMap<u64, (u64, Vec<ucp_rkey_h>)>,
    memhs: Vec<ucp_mem_h>,
    actions: HashMap<u64, Action>,
    /// Control header and payload in flight (UCX reads them until the send completes).
    buffers: HashMap<u64, (Box<[u8; 8]>, Vec<u8>)>,
    /// This node's id, sent as every control message's header.
    origin: u64,
    /// The selected transports cannot report peer failure: create endpoints without it.
    no_peer_errors: bool,
    /// Active-message data sends in flight per endpoint, and flushes waiting for them.
    data_inflight: HashMap<u64, usize>,
    flush_waiting: HashMap<u64, Vec<Arc<FlushJoin>>>,
    /// Control sends in flight per endpoint (bounded by [`CONTROL_INFLIGHT`]).
    control_inflight: HashMap<u64, usize>,
    /// Endpoints to close once their control sends completed, with the latest time to do it.
    closing: HashMap<u64, Instant>,
    /// Puts that failed, per endpoint, reported by the next flush.
    put_errors: HashMap<u64, String>,
    /// Buffers rendezvous writes into a device pool land in (created on the first one).
    recv_staging: Option<Arc<StagingPool>>,
    /// Rendezvous writes into a device pool waiting for a staging buffer to come back.
    deferred: VecDeque<(*mut core::ffi::c_void, WritePermit)>,
    /// `resume_staged` is running (an immediately completed receive must not re-enter it).
    resuming: bool,
    /// `resume_stream` is running.
    resuming_stream: bool,
    /// Gathered writes waiting for a landing buffer to come back.
    deferred_stream: VecDeque<(*mut core::ffi::c_void, StreamPermit)>,
    /// This receiver lane's landing buffers for gathered writes (its own: a buffer coming back wakes the
    /// lane's deferred writes).
    landing: Option<Arc<DevicePool>>,
    /// Landed gathered writes whose scatter into the blocks is queued on the device, oldest first: each is
    /// committed, and its landing buffer returned, once the copy finished ([`State::poll_scatters`]).
    scattering: VecDeque<Scatter>,
    /// The context moves CUDA memory ([`Node::cuda`]): rendezvous writes into a device pool land there
    /// directly, and device sources are sent as they are.
    cuda: bool,
}

/// Lands a received payload: a `memcpy` into a host pool, `copy_in` for a device pool (where a failed copy
/// fails the transfer).
fn place(permit: WritePermit, src: &[u8]) {
    let src = &src[..src.len().min(permit.len)];
    if permit.staged() {
        match permit.copy_in(0, src) {
            Ok(()) => permit.commit(),
            Err(why) => permit.fail(&why),
        }
    } else {
        // SAFETY: the permit owns `permit.len` bytes at its pointer in the host arena.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), permit.ptr, src.len()) };
        permit.commit();
    }
}

/// A landed gathered write being scattered into the pool on the device.
/// Its fields drop in order: the copy first (which waits for it), so neither the transfer's blocks nor
/// the landing buffer are given back while the device still writes or reads them.
struct Scatter {
    copy: Box<dyn kv_cache::QueuedCopy>,
    permit: StreamPermit,
    /// The landing buffer the copy reads, returned when it finished.
    _buf: DeviceBuf,
    /// When the copy was queued (for the trace event of its end).
    queued: Instant,
}

/// Queues the scatter of a gathered write that landed in `buf` into its pieces of the pool (on the
/// device). `Some` while it runs (or until it is polled, for a device that copies synchronously); `None`
/// when the transfer failed (a copy that could not be queued).
fn scatter(permit: StreamPermit, buf: DeviceBuf) -> Option<Scatter> {
    let (base, mut at) = (permit.arena().as_ptr() as u64, buf.addr());
    if permit.len > buf.len() as u64 {
        permit.fail("larger than its landing buffer");
        return None;
    }
    let copies: Vec<(u64, u64, u64)> = permit
        .pieces
        .iter()
        .map(|&(off, len)| {
            let c = (at, base + off, len);
            at += len;
            c
        })
        .collect();
    let Some(copier) = permit.arena().device_copier().cloned() else {
        permit.fail("the pool is not device memory");
        return None;
    };
    // SAFETY: the pieces are the transfer's own blocks (the permit mapped them from its table) and lie in
    // the pool; the landing buffer holds `permit.len` bytes; the permit is the only writer of the pieces,
    // and it and the buffer are kept until the copy finished.
    match unsafe { copier.copy_pieces_queued(&copies) } {
        Some(Ok(copy)) => return Some(Scatter { copy, permit, _buf: buf, queued: Instant::now() }),
        Some(Err(e)) => permit.fail(&format!("scattering on the device: {e}")),
        None => permit.fail("the device cannot scatter"),
    }
    None
}

fn err(lib: &UcpLib, what: &str, s: ucs_status_t) -> TransferError {
    TransferError::Transport(format!("{what}: {}", status_str(lib, s)))
}
