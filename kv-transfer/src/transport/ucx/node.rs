//! One UCX context and worker, driven by a dedicated progress thread. Other threads talk to it through a
//! command queue (and an eventfd to wake it); every UCX call happens on that thread, so the worker runs in
//! UCX's single-threaded mode. UCX callbacks only record events; the loop handles them after progress
//! returns, so no callback re-enters the worker.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use prost::Message;
use proto::v1::TransferControl;

use super::api::{StatusPtr, classify, status_str};
use super::sys::*;
use crate::TransferError;
use crate::receiver::core::{Refusal, WritePermit};
use crate::transport::{Flushed, PutOp, next_id};
use crate::wait::Cell;

/// AM id of control messages (header: the origin node id, 8 bytes LE; data: a TransferControl).
const AM_CONTROL: u32 = 7101;
/// AM id of data writes (header: session, token, pool offset, length as u64 LE; payload by rendezvous).
const AM_DATA: u32 = 7102;
/// How long the loop keeps polling after activity before it sleeps on the event fd.
const SPIN: Duration = Duration::from_micros(200);

/// Receives what arrives on a node.
pub(crate) trait Sink: Send + Sync {
    fn on_control(&self, node: &Arc<Node>, origin: u64, msg: TransferControl);
    /// Admits an active-message write (receivers); `None` where this node receives no data.
    fn admit(&self, _session: u64, _token: u64, _offset: u64, _len: u64) -> Option<Result<WritePermit, Refusal>> {
        None
    }
    fn on_ep_error(&self, ep: u64, reason: &str);
}

enum Cmd {
    Connect { ep: u64, addr: Vec<u8>, done: Option<Arc<Cell<Result<(), TransferError>>>> },
    Control { ep: u64, data: Vec<u8> },
    Put { ep: u64, rkeys: u64, op: PutOp },
    Flush { ep: u64, done: Flushed },
    FlushThenControl { ep: u64, data: Vec<u8> },
    Rkeys { ep: u64, handle: u64, packed: Vec<Vec<u8>>, done: Arc<Cell<Result<(), TransferError>>> },
    MemMap { addr: usize, len: usize, done: Arc<Cell<Result<Vec<u8>, TransferError>>> },
    CloseEp { ep: u64 },
    Shutdown,
}

/// The handle other threads hold.
pub(crate) struct Node {
    #[allow(dead_code)]
    pub id: u64,
    /// `id` (8 bytes LE) followed by the UCP worker address: what descriptors and handshakes carry.
    pub address: Vec<u8>,
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake_fd: i32,
    alive: AtomicBool,
}

impl Node {
    /// Creates the context (reading `UCX_*` from the environment, `tls` overriding `UCX_TLS`) and worker,
    /// and starts the progress thread.
    pub fn start(
        name: &str,
        tls: Option<&str>,
        am_data: bool,
        sink: Arc<dyn Sink>,
    ) -> Result<Arc<Node>, TransferError> {
        let lib = super::api::load().map_err(TransferError::Transport)?;
        let (tx, rx) = mpsc::channel();
        let init = Cell::new();
        let init2 = init.clone();
        let tls = tls.map(str::to_string);
        // SAFETY: plain syscall.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(TransferError::Transport("eventfd failed".into()));
        }
        let thread_name = format!("{name}-ucx");
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                // SAFETY: the worker state is created and used on this thread only.
                let st = unsafe { State::create(lib, tls.as_deref()) };
                match st {
                    Ok(mut st) => {
                        let id = next_id() ^ ((std::process::id() as u64) << 40);
                        let mut address = id.to_le_bytes().to_vec();
                        address.extend_from_slice(&st.worker_address);
                        st.origin = id;
                        st.am_data = am_data;
                        let node = Arc::new(Node {
                            id,
                            address,
                            tx: Mutex::new(mpsc::channel().0),
                            wake_fd,
                            alive: AtomicBool::new(true),
                        });
                        init2.set(Ok(node.clone()));
                        // SAFETY: same thread.
                        unsafe { st.run(&node, rx, sink) };
                        node.alive.store(false, Ordering::SeqCst);
                        // SAFETY: same thread; every request was completed or cancelled by run().
                        unsafe { st.destroy() };
                    }
                    Err(e) => {
                        init2.set(Err(e));
                    }
                }
            })
            .map_err(|e| TransferError::Transport(format!("cannot start the UCX progress thread: {e}")))?;
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

    /// Starts connecting to a peer's node address; returns the endpoint id at once (commands for it queue
    /// behind the connect).
    pub fn connect_nowait(&self, addr: &[u8]) -> Result<u64, TransferError> {
        let ep = next_id();
        self.cmd(Cmd::Connect { ep, addr: addr.to_vec(), done: None })?;
        Ok(ep)
    }

    pub fn connect(&self, addr: &[u8], deadline: Instant) -> Result<u64, TransferError> {
        let ep = next_id();
        let done = Cell::new();
        self.cmd(Cmd::Connect { ep, addr: addr.to_vec(), done: Some(done.clone()) })?;
        done.wait_until(deadline).unwrap_or_else(|| Err(TransferError::Transport("UCX connect timed out".into())))?;
        Ok(ep)
    }

    pub fn send_control(&self, ep: u64, msg: &TransferControl) -> Result<(), TransferError> {
        self.cmd(Cmd::Control { ep, data: msg.encode_to_vec() })
    }

    pub fn flush_then_control(&self, ep: u64, msg: &TransferControl) {
        let _ = self.cmd(Cmd::FlushThenControl { ep, data: msg.encode_to_vec() });
    }

    pub fn put(&self, ep: u64, rkeys: u64, op: PutOp) -> Result<(), TransferError> {
        self.cmd(Cmd::Put { ep, rkeys, op })
    }

    pub fn flush(&self, ep: u64) -> Result<Flushed, TransferError> {
        let done = Cell::new();
        self.cmd(Cmd::Flush { ep, done: done.clone() })?;
        Ok(done)
    }

    pub fn unpack_rkeys(&self, ep: u64, packed: Vec<Vec<u8>>) -> Result<u64, TransferError> {
        let handle = next_id();
        let done = Cell::new();
        self.cmd(Cmd::Rkeys { ep, handle, packed, done: done.clone() })?;
        done.wait_until(Instant::now() + Duration::from_secs(10))
            .unwrap_or_else(|| Err(TransferError::Transport("rkey unpack timed out".into())))?;
        Ok(handle)
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

/// A node that stops its thread when the last owner goes.
pub(crate) struct NodeOwner(pub Arc<Node>);

impl Drop for NodeOwner {
    fn drop(&mut self) {
        let _ = self.0.cmd(Cmd::Shutdown);
    }
}

/// What UCX callbacks record.
enum Event {
    Done(u64, ucs_status_t),
    /// An active-message write: header words, then the payload (rendezvous or persistent descriptor, or
    /// a copy of a small eager payload).
    Data([u64; 4], Payload),
    EpError(u64, ucs_status_t),
    Am(u64, Vec<u8>),
}

enum Payload {
    Rndv(*mut core::ffi::c_void),
    Persistent(*mut core::ffi::c_void),
    Copied(Vec<u8>),
}

/// Pending request actions, by token.
enum Action {
    Put(u64),
    /// An active-message data send on endpoint `.0`.
    DataSend(u64),
    /// Receiving a rendezvous payload into admitted memory.
    Recv(WritePermit),
    Control,
    Flush(Flushed),
    FlushThen(u64, Vec<u8>),
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
    events: Box<std::cell::RefCell<VecDeque<Event>>>,
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
    /// Send data as active messages (receiver-placed) instead of one-sided puts.
    am_data: bool,
    /// Active-message data sends in flight per endpoint, and flushes waiting for them.
    data_inflight: HashMap<u64, usize>,
    flush_waiting: HashMap<u64, Vec<Action>>,
    /// Puts that failed, per endpoint, reported by the next flush.
    put_errors: HashMap<u64, String>,
}

fn err(lib: &UcpLib, what: &str, s: ucs_status_t) -> TransferError {
    TransferError::Transport(format!("{what}: {}", status_str(lib, s)))
}

unsafe extern "C" fn on_request_done(
    request: *mut core::ffi::c_void,
    status: ucs_status_t,
    user: *mut core::ffi::c_void,
) {
    // SAFETY: `user` is the (events, token) pair registered with the request; the lib is loaded.
    unsafe {
        let (events, token) = *(user as *const (usize, u64));
        let q = &*(events as *const std::cell::RefCell<VecDeque<Event>>);
        q.borrow_mut().push_back(Event::Done(token, status));
        drop(Box::from_raw(user as *mut (usize, u64)));
        if let Ok(lib) = super::api::load() {
            (lib.ucp_request_free)(request);
        }
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut core::ffi::c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the endpoint's (events, id) pair, alive while the endpoint exists.
    unsafe {
        let (events, id) = *(arg as *const (usize, u64));
        let q = &*(events as *const std::cell::RefCell<VecDeque<Event>>);
        q.borrow_mut().push_back(Event::EpError(id, status));
    }
}

unsafe extern "C" fn on_am(
    arg: *mut core::ffi::c_void,
    header: *const core::ffi::c_void,
    header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the node's event queue; header/data are valid for the call (eager, whole message).
    unsafe {
        let q = &*(arg as *const std::cell::RefCell<VecDeque<Event>>);
        if header_length != 8 || (*param).recv_attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            return ucs_status_t::UCS_OK;
        }
        let origin =
            u64::from_le_bytes(std::slice::from_raw_parts(header as *const u8, 8).try_into().unwrap_or([0; 8]));
        let bytes = std::slice::from_raw_parts(data as *const u8, length as usize).to_vec();
        q.borrow_mut().push_back(Event::Am(origin, bytes));
    }
    ucs_status_t::UCS_OK
}

unsafe extern "C" fn on_am_data(
    arg: *mut core::ffi::c_void,
    header: *const core::ffi::c_void,
    header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the node's event queue; header/data are valid for the call, and beyond it when we
    // return UCS_INPROGRESS for rendezvous and persistent payloads (released or received later).
    unsafe {
        let q = &*(arg as *const std::cell::RefCell<VecDeque<Event>>);
        if header_length != 32 {
            return ucs_status_t::UCS_OK;
        }
        let h = std::slice::from_raw_parts(header as *const u8, 32);
        let w = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let hdr = [w(0), w(1), w(2), w(3)];
        let attr = (*param).recv_attr;
        if attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            q.borrow_mut().push_back(Event::Data(hdr, Payload::Rndv(data)));
            return ucs_status_t::UCS_INPROGRESS;
        }
        if hdr[3] != length {
            return ucs_status_t::UCS_OK;
        }
        if attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_DATA as u64 != 0 {
            q.borrow_mut().push_back(Event::Data(hdr, Payload::Persistent(data)));
            return ucs_status_t::UCS_INPROGRESS;
        }
        let bytes = std::slice::from_raw_parts(data as *const u8, length as usize).to_vec();
        q.borrow_mut().push_back(Event::Data(hdr, Payload::Copied(bytes)));
    }
    ucs_status_t::UCS_OK
}

unsafe extern "C" fn on_recv_done(
    request: *mut core::ffi::c_void,
    status: ucs_status_t,
    _len: size_t,
    user: *mut core::ffi::c_void,
) {
    // SAFETY: same contract as on_request_done.
    unsafe { on_request_done(request, status, user) }
}

impl State {
    unsafe fn create(lib: &'static UcpLib, tls: Option<&str>) -> Result<State, TransferError> {
        // SAFETY: the calls follow UCX's documented initialisation sequence; every out-pointer is valid.
        unsafe {
            let mut config: *mut ucp_config_t = ptr::null_mut();
            let s = (lib.ucp_config_read)(ptr::null(), ptr::null(), &mut config);
            if s != ucs_status_t::UCS_OK {
                return Err(err(lib, "ucp_config_read", s));
            }
            let set = |k: &str, v: &str| {
                let (k, v) = (CString::new(k).unwrap_or_default(), CString::new(v).unwrap_or_default());
                (lib.ucp_config_modify)(config, k.as_ptr(), v.as_ptr())
            };
            if let Some(tls) = tls {
                let s = set("TLS", tls);
                if s != ucs_status_t::UCS_OK {
                    (lib.ucp_config_release)(config);
                    return Err(err(lib, &format!("UCX_TLS={tls}"), s));
                }
            }
            // A killed peer must be noticed in about a second, not the 20 s default.
            if std::env::var_os("UCX_KEEPALIVE_INTERVAL").is_none() {
                set("KEEPALIVE_INTERVAL", "500ms");
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = ucp_params_field::UCP_PARAM_FIELD_FEATURES.0 as u64;
            params.features = (ucp_feature::UCP_FEATURE_RMA.0
                | ucp_feature::UCP_FEATURE_AM.0
                | ucp_feature::UCP_FEATURE_WAKEUP.0) as u64;
            let mut ctx: ucp_context_h = ptr::null_mut();
            let s = (lib.ucp_init_version)(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            (lib.ucp_config_release)(config);
            if s != ucs_status_t::UCS_OK {
                return Err(err(lib, "ucp_init", s));
            }
            let mut wp: ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = (ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0
                | ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_EVENTS.0) as u64;
            wp.thread_mode = ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            wp.events = ucp_wakeup_event_types_UCP_WAKEUP_RMA
                | ucp_wakeup_event_types_UCP_WAKEUP_TX
                | ucp_wakeup_event_types_UCP_WAKEUP_RX;
            let mut worker: ucp_worker_h = ptr::null_mut();
            let s = (lib.ucp_worker_create)(ctx, &wp, &mut worker);
            if s != ucs_status_t::UCS_OK {
                (lib.ucp_cleanup)(ctx);
                return Err(err(lib, "ucp_worker_create", s));
            }
            let mut efd = -1;
            let s = (lib.ucp_worker_get_efd)(worker, &mut efd);
            if s != ucs_status_t::UCS_OK {
                (lib.ucp_worker_destroy)(worker);
                (lib.ucp_cleanup)(ctx);
                return Err(err(lib, "ucp_worker_get_efd", s));
            }
            let mut addr: *mut ucp_address_t = ptr::null_mut();
            let mut addr_len: size_t = 0;
            let s = (lib.ucp_worker_get_address)(worker, &mut addr, &mut addr_len);
            if s != ucs_status_t::UCS_OK {
                (lib.ucp_worker_destroy)(worker);
                (lib.ucp_cleanup)(ctx);
                return Err(err(lib, "ucp_worker_get_address", s));
            }
            let worker_address = std::slice::from_raw_parts(addr as *const u8, addr_len as usize).to_vec();
            (lib.ucp_worker_release_address)(worker, addr);
            let events: Box<std::cell::RefCell<VecDeque<Event>>> = Box::new(std::cell::RefCell::new(VecDeque::new()));
            let mut hp: ucp_am_handler_param_t = std::mem::zeroed();
            hp.field_mask = (ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID.0
                | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_FLAGS.0
                | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB.0
                | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG.0) as u64;
            hp.id = AM_CONTROL;
            hp.flags = ucp_am_cb_flags::UCP_AM_FLAG_WHOLE_MSG.0;
            hp.cb = Some(on_am);
            hp.arg = &*events as *const _ as *mut core::ffi::c_void;
            let mut s = (lib.ucp_worker_set_am_recv_handler)(worker, &hp);
            if s == ucs_status_t::UCS_OK {
                hp.id = AM_DATA;
                hp.flags = ucp_am_cb_flags::UCP_AM_FLAG_WHOLE_MSG.0 | ucp_am_cb_flags::UCP_AM_FLAG_PERSISTENT_DATA.0;
                hp.cb = Some(on_am_data);
                s = (lib.ucp_worker_set_am_recv_handler)(worker, &hp);
            }
            if s != ucs_status_t::UCS_OK {
                (lib.ucp_worker_destroy)(worker);
                (lib.ucp_cleanup)(ctx);
                return Err(err(lib, "ucp_worker_set_am_recv_handler", s));
            }
            Ok(State {
                lib,
                ctx,
                worker,
                efd,
                worker_address,
                events,
                eps: HashMap::new(),
                rkeys: HashMap::new(),
                memhs: Vec::new(),
                actions: HashMap::new(),
                buffers: HashMap::new(),
                origin: 0,
                no_peer_errors: false,
                am_data: false,
                data_inflight: HashMap::new(),
                flush_waiting: HashMap::new(),
                put_errors: HashMap::new(),
            })
        }
    }

    fn events_ptr(&self) -> usize {
        &*self.events as *const _ as usize
    }

    /// A request parameter whose completion records `Done(token)`.
    fn param(&self, token: u64) -> ucp_request_param_t {
        // SAFETY: all-zero is a valid "no fields" parameter.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        p.op_attr_mask = ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK | ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send = Some(on_request_done);
        p.user_data = Box::into_raw(Box::new((self.events_ptr(), token))) as *mut core::ffi::c_void;
        p
    }

    /// Handles a just-issued request: immediate completion runs the action now.
    fn issued(&mut self, token: u64, p: &ucp_request_param_t, r: ucs_status_ptr_t, action: Action) {
        match classify(r) {
            StatusPtr::Pending(_) => {
                self.actions.insert(token, action);
            }
            StatusPtr::Done => {
                // SAFETY: the callback will not run; reclaim its argument.
                drop(unsafe { Box::from_raw(p.user_data as *mut (usize, u64)) });
                self.complete(token, action, ucs_status_t::UCS_OK);
            }
            StatusPtr::Error(s) => {
                // SAFETY: as above.
                drop(unsafe { Box::from_raw(p.user_data as *mut (usize, u64)) });
                self.complete(token, action, s);
            }
        }
    }

    fn complete(&mut self, token: u64, action: Action, s: ucs_status_t) {
        let ok = s == ucs_status_t::UCS_OK;
        match action {
            Action::Put(ep) => {
                if !ok {
                    self.put_errors.entry(ep).or_insert_with(|| status_str(self.lib, s));
                }
            }
            Action::Control => {
                self.buffers.remove(&token);
            }
            Action::DataSend(ep) => {
                self.buffers.remove(&token);
                if !ok {
                    self.put_errors.entry(ep).or_insert_with(|| status_str(self.lib, s));
                }
                let n = self.data_inflight.entry(ep).or_insert(1);
                *n -= 1;
                if *n == 0 {
                    self.data_inflight.remove(&ep);
                    for a in self.flush_waiting.remove(&ep).unwrap_or_default() {
                        self.flush(ep, a);
                    }
                }
            }
            Action::Recv(permit) => {
                if ok {
                    permit.commit();
                }
            }
            Action::Flush(done) => {
                done.set(if ok { Ok(()) } else { Err(err(self.lib, "link lost: flush", s)) });
            }
            Action::FlushThen(ep, data) => {
                if ok {
                    self.send_control(ep, data);
                }
            }
            Action::Close => {}
        }
    }

    fn ep(&self, ep: u64) -> Result<ucp_ep_h, TransferError> {
        match self.eps.get(&ep) {
            Some(e) if e.failed.is_none() => Ok(e.h),
            Some(e) => Err(TransferError::Transport(format!("link lost: {}", e.failed.clone().unwrap_or_default()))),
            None => Err(TransferError::Transport("link lost: no such endpoint".into())),
        }
    }

    unsafe fn connect(&mut self, id: u64, addr: &[u8]) -> Result<(), TransferError> {
        if addr.len() <= 8 {
            return Err(TransferError::Transport("bad UCX address".into()));
        }
        if self.no_peer_errors {
            // SAFETY: forwarded.
            return unsafe { self.create_ep(id, addr, false) }.map_err(|s| err(self.lib, "ucp_ep_create", s));
        }
        // SAFETY: forwarded.
        match unsafe { self.create_ep(id, addr, true) } {
            Err(s) if s == ucs_status_t::UCS_ERR_UNREACHABLE => {
                // Some transports (UCX 1.13's shared memory) cannot report peer failure; connect without
                // it. Liveness then rests on deadlines, abort acknowledgements and the quarantine.
                tracing::info!("UCX transport has no peer-failure detection; relying on deadlines");
                self.no_peer_errors = true;
                // SAFETY: forwarded.
                unsafe { self.create_ep(id, addr, false) }.map_err(|s| err(self.lib, "ucp_ep_create", s))
            }
            r => r.map_err(|s| err(self.lib, "ucp_ep_create", s)),
        }
    }

    unsafe fn create_ep(&mut self, id: u64, addr: &[u8], peer_errors: bool) -> Result<(), ucs_status_t> {
        let arg = Box::new((self.events_ptr(), id));
        // SAFETY: zeroed params with the fields we set; the address outlives the call.
        unsafe {
            let mut p: ucp_ep_params_t = std::mem::zeroed();
            p.field_mask = ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 as u64;
            p.address = addr[8..].as_ptr() as *const ucp_address_t;
            if peer_errors {
                p.field_mask |= (ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE.0
                    | ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER.0) as u64;
                p.err_mode = ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
                p.err_handler =
                    ucp_err_handler { cb: Some(on_ep_error), arg: &*arg as *const _ as *mut core::ffi::c_void };
            }
            let mut h: ucp_ep_h = ptr::null_mut();
            let s = (self.lib.ucp_ep_create)(self.worker, &p, &mut h);
            if s != ucs_status_t::UCS_OK {
                return Err(s);
            }
            self.eps.insert(id, Ep { h, failed: None, _arg: arg });
        }
        Ok(())
    }

    fn send_control(&mut self, ep: u64, data: Vec<u8>) {
        let Ok(h) = self.ep(ep) else { return };
        let token = next_id();
        let mut p = self.param(token);
        p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER.0;
        self.buffers.insert(token, (Box::new(self.origin.to_le_bytes()), data));
        let (hdr, buf) = &self.buffers[&token];
        // SAFETY: header and payload live in self.buffers until the send completes.
        let r = unsafe {
            (self.lib.ucp_am_send_nbx)(
                h,
                AM_CONTROL,
                hdr.as_ptr() as *const core::ffi::c_void,
                8,
                buf.as_ptr() as *const core::ffi::c_void,
                buf.len() as size_t,
                &p,
            )
        };
        self.issued(token, &p, r, Action::Control);
    }

    fn put(&mut self, ep: u64, rkeys: u64, op: PutOp) {
        let h = match self.ep(ep) {
            Ok(h) => h,
            Err(e) => {
                self.put_errors.entry(ep).or_insert_with(|| e.to_string());
                return;
            }
        };
        let Some(rkey) = self.rkeys.get(&rkeys).and_then(|(_, v)| v.get(op.region).copied()) else {
            self.put_errors.entry(ep).or_insert_with(|| "put without its remote key".into());
            return;
        };
        let token = next_id();
        if self.am_data {
            let mut p = self.param(token);
            p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = ucp_send_am_flags::UCP_AM_SEND_FLAG_RNDV.0;
            let mut hdr = Vec::with_capacity(32);
            for w in [op.session_id, op.token, op.dst_offset, op.len] {
                hdr.extend_from_slice(&w.to_le_bytes());
            }
            self.buffers.insert(token, (Box::new([0; 8]), hdr));
            let hdr = &self.buffers[&token].1;
            // SAFETY: the header lives in self.buffers and the source in the session's arena until the
            // send completes.
            let r = unsafe {
                (self.lib.ucp_am_send_nbx)(
                    h,
                    AM_DATA,
                    hdr.as_ptr() as *const core::ffi::c_void,
                    32,
                    op.src as *const core::ffi::c_void,
                    op.len as size_t,
                    &p,
                )
            };
            *self.data_inflight.entry(ep).or_insert(0) += 1;
            self.issued(token, &p, r, Action::DataSend(ep));
            return;
        }
        let p = self.param(token);
        // SAFETY: the source stays alive and unmodified until the put is flushed (session contract); the
        // remote range was checked against the descriptor's regions.
        let r = unsafe {
            (self.lib.ucp_put_nbx)(h, op.src as *const core::ffi::c_void, op.len as size_t, op.dst_addr, rkey, &p)
        };
        self.issued(token, &p, r, Action::Put(ep));
    }

    fn flush(&mut self, ep: u64, then: Action) {
        if self.data_inflight.get(&ep).is_some_and(|n| *n > 0) && self.eps.get(&ep).is_some_and(|e| e.failed.is_none())
        {
            // Endpoint flush covers RMA, not active messages: wait for the data sends first.
            self.flush_waiting.entry(ep).or_default().push(then);
            return;
        }
        let h = match self.ep(ep) {
            Ok(h) => h,
            Err(e) => {
                if let Action::Flush(done) = then {
                    done.set(Err(e));
                }
                return;
            }
        };
        if let Some(e) = self.put_errors.remove(&ep)
            && let Action::Flush(done) = then
        {
            done.set(Err(TransferError::Transport(format!("put failed: {e}"))));
            return;
        }
        let token = next_id();
        let p = self.param(token);
        // SAFETY: valid endpoint.
        let r = unsafe { (self.lib.ucp_ep_flush_nbx)(h, &p) };
        self.issued(token, &p, r, then);
    }

    unsafe fn unpack(&mut self, ep: u64, handle: u64, packed: &[Vec<u8>]) -> Result<(), TransferError> {
        let h = self.ep(ep)?;
        let mut keys = Vec::new();
        for b in packed {
            let mut k: ucp_rkey_h = ptr::null_mut();
            // SAFETY: valid endpoint and buffer.
            let s = unsafe { (self.lib.ucp_ep_rkey_unpack)(h, b.as_ptr() as *const core::ffi::c_void, &mut k) };
            if s != ucs_status_t::UCS_OK {
                for k in keys {
                    // SAFETY: unpacked above.
                    unsafe { (self.lib.ucp_rkey_destroy)(k) };
                }
                return Err(err(self.lib, "ucp_ep_rkey_unpack", s));
            }
            keys.push(k);
        }
        self.rkeys.insert(handle, (ep, keys));
        Ok(())
    }

    unsafe fn mem_map(&mut self, addr: usize, len: usize) -> Result<Vec<u8>, TransferError> {
        // SAFETY: registering memory the caller keeps alive for the node's life; out-pointers valid.
        unsafe {
            let mut p: ucp_mem_map_params_t = std::mem::zeroed();
            p.field_mask = (ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS.0
                | ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH.0) as u64;
            p.address = addr as *mut core::ffi::c_void;
            p.length = len as size_t;
            let mut memh: ucp_mem_h = ptr::null_mut();
            let s = (self.lib.ucp_mem_map)(self.ctx, &p, &mut memh);
            if s != ucs_status_t::UCS_OK {
                return Err(err(self.lib, "ucp_mem_map", s));
            }
            self.memhs.push(memh);
            let mut buf: *mut core::ffi::c_void = ptr::null_mut();
            let mut n: size_t = 0;
            let s = (self.lib.ucp_rkey_pack)(self.ctx, memh, &mut buf, &mut n);
            if s != ucs_status_t::UCS_OK {
                return Err(err(self.lib, "ucp_rkey_pack", s));
            }
            let out = std::slice::from_raw_parts(buf as *const u8, n as usize).to_vec();
            (self.lib.ucp_rkey_buffer_release)(buf);
            Ok(out)
        }
    }

    fn close_ep(&mut self, ep: u64) {
        let Some(e) = self.eps.remove(&ep) else { return };
        let stale: Vec<u64> = self.rkeys.iter().filter(|(_, (owner, _))| *owner == ep).map(|(h, _)| *h).collect();
        for h in stale {
            if let Some((_, keys)) = self.rkeys.remove(&h) {
                for k in keys {
                    // SAFETY: unpacked on this endpoint, which is still open.
                    unsafe { (self.lib.ucp_rkey_destroy)(k) };
                }
            }
        }
        let token = next_id();
        let mut p = self.param(token);
        p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE.0;
        // SAFETY: the endpoint is open; it is not used after this.
        let r = unsafe { (self.lib.ucp_ep_close_nbx)(e.h, &p) };
        // The error-callback argument must outlive a pending close.
        std::mem::forget(e._arg);
        self.issued(token, &p, r, Action::Close);
    }

    /// The progress loop; returns on Shutdown or when every owner is gone.
    unsafe fn run(&mut self, node: &Arc<Node>, rx: mpsc::Receiver<Cmd>, sink: Arc<dyn Sink>) {
        let mut last_activity = Instant::now();
        loop {
            let mut busy = false;
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return self.drain(),
                    Ok(c) => {
                        busy = true;
                        self.handle(c);
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            // SAFETY: our worker, our thread.
            while unsafe { (self.lib.ucp_worker_progress)(self.worker) } != 0 {
                busy = true;
            }
            loop {
                let ev = self.events.borrow_mut().pop_front();
                let Some(ev) = ev else { break };
                busy = true;
                match ev {
                    Event::Done(token, s) => {
                        if let Some(a) = self.actions.remove(&token) {
                            self.complete(token, a, s);
                        }
                    }
                    Event::EpError(ep, s) => {
                        let why = status_str(self.lib, s);
                        if let Some(e) = self.eps.get_mut(&ep)
                            && e.failed.is_none()
                        {
                            e.failed = Some(why.clone());
                            tracing::info!(ep, reason = %why, "UCX endpoint failed");
                            sink.on_ep_error(ep, &why);
                            self.close_ep(ep);
                        }
                    }
                    Event::Data(hdr, payload) => self.on_data(&*sink, hdr, payload),
                    Event::Am(origin, bytes) => match TransferControl::decode(bytes.as_slice()) {
                        Ok(msg) => sink.on_control(node, origin, msg),
                        Err(e) => tracing::warn!(error = %e, "undecodable kv-transfer control message"),
                    },
                }
            }
            if busy {
                last_activity = Instant::now();
                continue;
            }
            if !self.actions.is_empty() {
                // Requests in flight: some transports complete them only under progress, without an
                // event on the fd, so keep driving the worker (yielding the core) until they finish.
                std::thread::yield_now();
                continue;
            }
            if last_activity.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // SAFETY: our worker.
            let s = unsafe { (self.lib.ucp_worker_arm)(self.worker) };
            if s == ucs_status_t::UCS_ERR_BUSY {
                continue;
            }
            let mut fds = [
                libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: node.wake_fd, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: valid pollfd array.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
            let mut buf = 0u64;
            // SAFETY: draining our nonblocking eventfd.
            unsafe { libc::read(node.wake_fd, &mut buf as *mut u64 as *mut libc::c_void, 8) };
            if Arc::strong_count(node) == 1 {
                return self.drain();
            }
        }
    }

    /// Places an active-message write where the receiver admits it, or drops it.
    fn on_data(&mut self, sink: &dyn Sink, [session, token, offset, len]: [u64; 4], payload: Payload) {
        let admitted = match sink.admit(session, token, offset, len) {
            Some(Ok(p)) => Some(p),
            Some(Err(Refusal::Invalid(why))) => {
                tracing::warn!(why, "dropping an invalid write");
                None
            }
            _ => None,
        };
        match (payload, admitted) {
            (Payload::Rndv(desc), Some(permit)) => {
                let t = next_id();
                let mut p = self.param(t);
                p.cb.recv_am = Some(on_recv_done);
                // SAFETY: the permit owns `len` bytes at its pointer until the receive completes.
                let r = unsafe {
                    (self.lib.ucp_am_recv_data_nbx)(
                        self.worker,
                        desc,
                        permit.ptr as *mut core::ffi::c_void,
                        len as size_t,
                        &p,
                    )
                };
                self.issued(t, &p, r, Action::Recv(permit));
            }
            (Payload::Persistent(desc), permit) => {
                if let Some(permit) = permit {
                    // SAFETY: `len` payload bytes (checked in the callback) into the admitted range.
                    unsafe { std::ptr::copy_nonoverlapping(desc as *const u8, permit.ptr, len as usize) };
                    permit.commit();
                }
                // SAFETY: a descriptor kept by returning UCS_INPROGRESS.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Rndv(desc), None) => {
                // SAFETY: releasing an unreceived rendezvous descriptor drops its data.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Copied(bytes), Some(permit)) => {
                // SAFETY: the admitted range is `len` = bytes.len() bytes.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), permit.ptr, bytes.len().min(permit.len)) };
                permit.commit();
            }
            (Payload::Copied(_), None) => {}
        }
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Connect { ep, addr, done } => {
                // SAFETY: on the worker's thread.
                let r = unsafe { self.connect(ep, &addr) };
                if let Some(d) = done {
                    d.set(r);
                } else if let Err(e) = r {
                    tracing::warn!(error = %e, "UCX connect failed");
                }
            }
            Cmd::Control { ep, data } => self.send_control(ep, data),
            Cmd::Put { ep, rkeys, op } => self.put(ep, rkeys, op),
            Cmd::Flush { ep, done } => self.flush(ep, Action::Flush(done)),
            Cmd::FlushThenControl { ep, data } => self.flush(ep, Action::FlushThen(ep, data)),
            Cmd::Rkeys { ep, handle, packed, done } => {
                // SAFETY: on the worker's thread.
                done.set(unsafe { self.unpack(ep, handle, &packed) });
            }
            Cmd::MemMap { addr, len, done } => {
                // SAFETY: on the worker's thread.
                done.set(unsafe { self.mem_map(addr, len) });
            }
            Cmd::CloseEp { ep } => self.close_ep(ep),
            Cmd::Shutdown => {}
        }
    }

    /// Fails what is pending and closes every endpoint (then `destroy`).
    fn drain(&mut self) {
        let eps: Vec<u64> = self.eps.keys().copied().collect();
        for ep in eps {
            self.close_ep(ep);
        }
        let until = Instant::now() + Duration::from_millis(500);
        while !self.actions.is_empty() && Instant::now() < until {
            // SAFETY: our worker.
            unsafe { (self.lib.ucp_worker_progress)(self.worker) };
            loop {
                let ev = self.events.borrow_mut().pop_front();
                let Some(ev) = ev else { break };
                if let Event::Done(token, s) = ev
                    && let Some(a) = self.actions.remove(&token)
                {
                    self.complete(token, a, s);
                }
            }
        }
        let waiting: Vec<Action> = self.flush_waiting.drain().flat_map(|(_, v)| v).collect();
        for a in self.actions.drain().map(|(_, a)| a).chain(waiting) {
            if let Action::Flush(done) = a {
                done.set(Err(TransferError::Transport("link lost: UCX worker stopped".into())));
            }
        }
    }

    unsafe fn destroy(self) {
        // SAFETY: every endpoint was closed in drain(); the worker and context are ours.
        unsafe {
            for m in &self.memhs {
                (self.lib.ucp_mem_unmap)(self.ctx, *m);
            }
            (self.lib.ucp_worker_destroy)(self.worker);
            (self.lib.ucp_cleanup)(self.ctx);
        }
    }
}
