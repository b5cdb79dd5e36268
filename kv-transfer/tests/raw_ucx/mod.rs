//! A raw libucp client for the hostile-peer tests: a UCP worker in the test process that speaks
//! kv-transfer's control and data messages by hand (and forges what a real sender never sends), with
//! UCX's RMA feature so it can also try one-sided puts. Real UCX, default settings (`UCX_TLS` unset).
#![allow(dead_code)]

use std::ptr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_cache::BlockPool;
use kv_transfer::transport::WriteHeader;
use kv_transfer::transport::lanes::{decode_address, encode_address};
use kv_transfer::transport::ucx::api::{self, StatusPtr, classify};
use kv_transfer::transport::ucx::host::host_id;
use kv_transfer::transport::ucx::sys::*;
use kv_transfer::transport::ucx::{AM_CONTROL, AM_DATA};
use kv_transfer::{ExpectRequest, KvReceiver, PendingTransfer};
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::{TransferBegin, TransferControl, TransferDescriptor};

/// libucp, or `None` when it is missing outside CI (the test then passes with a SKIPPED line). Under
/// `CI` a missing libucp fails the test.
pub fn ucx() -> Option<&'static UcpLib> {
    match api::load() {
        Ok(lib) => Some(lib),
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "libucp is not available under CI: {e}");
            eprintln!("SKIPPED: libucp is not available ({e}); install libucx0 to run the UCX tests");
            None
        }
    }
}

/// A raw UCP worker in this process.
pub struct Raw {
    lib: &'static UcpLib,
    ctx: ucp_context_h,
    worker: ucp_worker_h,
    ep: Option<ucp_ep_h>,
    address: Vec<u8>,
    /// Control messages this worker received (answers from the receiver), as they arrived.
    answers: Arc<Mutex<Vec<Vec<u8>>>>,
    /// A put nobody acknowledged is still pending: UCX cannot tear this worker down (it asserts), so it
    /// is left to the process's end.
    stuck: std::cell::Cell<bool>,
    /// Create endpoints with peer-failure detection, as a kv-transfer receiver does towards a peer it
    /// cannot reach over shared memory (both sides' endpoints must agree).
    peer_errors: bool,
}

unsafe extern "C" fn keep_answer(
    arg: *mut core::ffi::c_void,
    _header: *const core::ffi::c_void,
    _header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    _param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the Mutex inside the worker's `answers`, alive as long as the worker; `data` holds
    // `length` bytes for the call (whole eager messages).
    unsafe {
        let bytes = std::slice::from_raw_parts(data as *const u8, length as usize).to_vec();
        (*(arg as *const Mutex<Vec<Vec<u8>>>)).lock().unwrap().push(bytes);
    }
    ucs_status_t::UCS_OK
}

impl Raw {
    pub fn new(lib: &'static UcpLib) -> Raw {
        Self::with_tls(lib, None)
    }

    /// A raw worker whose context uses `tls` (`UCX_TLS`) where given.
    pub fn with_tls(lib: &'static UcpLib, tls: Option<&str>) -> Raw {
        // SAFETY: UCX's documented initialisation sequence; out-pointers valid.
        unsafe {
            let mut config: *mut ucp_config_t = ptr::null_mut();
            assert_eq!((lib.ucp_config_read)(ptr::null(), ptr::null(), &mut config), ucs_status_t::UCS_OK);
            if let Some(tls) = tls {
                let (k, v) = (std::ffi::CString::new("TLS").unwrap(), std::ffi::CString::new(tls).unwrap());
                assert_eq!((lib.ucp_config_modify)(config, k.as_ptr(), v.as_ptr()), ucs_status_t::UCS_OK);
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = ucp_params_field::UCP_PARAM_FIELD_FEATURES.0 as u64;
            params.features = (ucp_feature::UCP_FEATURE_AM.0 | ucp_feature::UCP_FEATURE_RMA.0) as u64;
            let mut ctx: ucp_context_h = ptr::null_mut();
            let s = (lib.ucp_init_version)(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            (lib.ucp_config_release)(config);
            assert_eq!(s, ucs_status_t::UCS_OK);
            let mut wp: ucp_worker_params_t = std::mem::zeroed();
            wp.field_mask = ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64;
            wp.thread_mode = ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            let mut worker: ucp_worker_h = ptr::null_mut();
            assert_eq!((lib.ucp_worker_create)(ctx, &wp, &mut worker), ucs_status_t::UCS_OK);
            let mut addr: *mut ucp_address_t = ptr::null_mut();
            let mut len: size_t = 0;
            assert_eq!((lib.ucp_worker_get_address)(worker, &mut addr, &mut len), ucs_status_t::UCS_OK);
            let address = std::slice::from_raw_parts(addr as *const u8, len as usize).to_vec();
            (lib.ucp_worker_release_address)(worker, addr);
            let answers = Arc::new(Mutex::new(Vec::new()));
            let hp = api::whole_message_handler(
                AM_CONTROL,
                Some(keep_answer),
                Arc::as_ptr(&answers) as *mut core::ffi::c_void,
            );
            assert_eq!((lib.ucp_worker_set_am_recv_handler)(worker, &hp), ucs_status_t::UCS_OK);
            let peer_errors = tls.is_some_and(|t| !t.contains("sm") && !t.contains("posix") && !t.contains("sysv"));
            Raw { lib, ctx, worker, ep: None, address, answers, stuck: Default::default(), peer_errors }
        }
    }

    pub fn connect(&mut self, worker_address: &[u8]) {
        // SAFETY: a valid worker and a peer address that outlives the call.
        unsafe {
            let mut p: ucp_ep_params_t = std::mem::zeroed();
            // Like a same-host kv-transfer sender: no peer-failure detection, so UCX may use shared
            // memory (the receiver's endpoint back to this worker is created the same way).
            p.field_mask = ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 as u64;
            p.address = worker_address.as_ptr() as *const ucp_address_t;
            if self.peer_errors {
                p.field_mask |= ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE.0 as u64;
                p.err_mode = ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
            }
            let mut ep: ucp_ep_h = ptr::null_mut();
            assert_eq!((self.lib.ucp_ep_create)(self.worker, &p, &mut ep), ucs_status_t::UCS_OK);
            self.ep = Some(ep);
        }
    }

    /// Waits for a request this worker issued (`r`), progressing, for at most `within`; whether it
    /// completed.
    fn wait(&self, r: ucs_status_ptr_t, within: Duration) -> bool {
        // SAFETY: a request of this worker, freed once complete (or abandoned to UCX at the timeout).
        unsafe {
            match classify(r) {
                StatusPtr::Done => true,
                StatusPtr::Error(s) => panic!("request failed: {}", api::status_str(self.lib, s)),
                StatusPtr::Pending(req) => {
                    let end = Instant::now() + within;
                    while (self.lib.ucp_request_check_status)(req) == ucs_status_t::UCS_INPROGRESS {
                        if Instant::now() > end {
                            return false;
                        }
                        (self.lib.ucp_worker_progress)(self.worker);
                    }
                    (self.lib.ucp_request_free)(req);
                    true
                }
            }
        }
    }

    /// Sends one active message `id` (`header`, `payload`) and progresses until it left.
    /// Issues an active message and returns its request.
    ///
    /// # Safety
    /// `header` and `payload` must stay valid until the request completes.
    unsafe fn issue_am(&self, id: u32, header: &[u8], payload: &[u8], flags: u32) -> ucs_status_ptr_t {
        // SAFETY: the caller keeps both buffers alive; the parameters are fully initialized.
        unsafe {
            let mut p: ucp_request_param_t = std::mem::zeroed();
            p.op_attr_mask = ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = flags;
            (self.lib.ucp_am_send_nbx)(
                self.ep.expect("connected"),
                id,
                header.as_ptr() as *const core::ffi::c_void,
                header.len() as size_t,
                payload.as_ptr() as *const core::ffi::c_void,
                payload.len() as size_t,
                &p,
            )
        }
    }

    fn send_am(&self, id: u32, header: &[u8], payload: &[u8], flags: u32) {
        // SAFETY: header and payload outlive the request (we wait for it below).
        let r = unsafe { self.issue_am(id, header, payload, flags) };
        assert!(self.wait(r, Duration::from_secs(20)), "an active message did not leave in 20 s");
    }

    /// Sends one control message (8-byte origin header + `payload`).
    pub fn send(&self, origin: u64, payload: &[u8]) {
        self.send_am(AM_CONTROL, &origin.to_le_bytes(), payload, ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER.0);
    }

    /// Sends a data write the receiver would place: `header` then `payload`, by rendezvous or eagerly.
    pub fn send_write(&self, header: &WriteHeader, payload: &[u8], rendezvous: bool) {
        let flag = if rendezvous {
            ucp_send_am_flags::UCP_AM_SEND_FLAG_RNDV
        } else {
            ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER
        };
        self.send_am(AM_DATA, &header.encode(), payload, flag.0);
    }

    /// Starts a rendezvous data write and never progresses it: the receiver gets the header and admits
    /// the write, but the payload (which this worker must push over tcp) never comes. The worker is left
    /// to the process's end (its request never completes).
    pub fn start_write_and_stall(&self, header: &WriteHeader, payload: Vec<u8>) {
        let header = header.encode().to_vec();
        let (h, d) = (header.leak(), payload.leak());
        // SAFETY: header and payload are leaked: UCX may read them for as long as the request lives.
        unsafe { self.issue_am(AM_DATA, h, d, ucp_send_am_flags::UCP_AM_SEND_FLAG_RNDV.0) };
        self.stuck.set(true);
    }

    /// A one-sided put of `bytes` to `remote_addr` in the receiver's process with a key this worker made
    /// up (its own registered buffer's, unpacked against the receiver): what a stranger who never got the
    /// receiver's key can try. Returns whether UCX reported the put (and a flush) complete within 1 s
    /// each.
    pub fn forged_put(&self, remote_addr: u64, bytes: &[u8]) -> bool {
        let ep = self.ep.expect("connected");
        // SAFETY: our context, worker and endpoint; every buffer outlives the calls that use it.
        unsafe {
            let mut own = vec![0u8; 4096];
            let mut mp: ucp_mem_map_params_t = std::mem::zeroed();
            mp.field_mask = (ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS.0
                | ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH.0) as u64;
            mp.address = own.as_mut_ptr() as *mut core::ffi::c_void;
            mp.length = own.len() as size_t;
            let mut memh: ucp_mem_h = ptr::null_mut();
            assert_eq!((self.lib.ucp_mem_map)(self.ctx, &mp, &mut memh), ucs_status_t::UCS_OK);
            let mut packed: *mut core::ffi::c_void = ptr::null_mut();
            let mut n: size_t = 0;
            assert_eq!((self.lib.ucp_rkey_pack)(self.ctx, memh, &mut packed, &mut n), ucs_status_t::UCS_OK);
            let mut rkey: ucp_rkey_h = ptr::null_mut();
            let s = (self.lib.ucp_ep_rkey_unpack)(ep, packed, &mut rkey);
            (self.lib.ucp_rkey_buffer_release)(packed);
            assert_eq!(s, ucs_status_t::UCS_OK, "unpacking a made-up key");
            let p: ucp_request_param_t = std::mem::zeroed();
            let r = (self.lib.ucp_put_nbx)(
                ep,
                bytes.as_ptr() as *const core::ffi::c_void,
                bytes.len() as size_t,
                remote_addr,
                rkey,
                &p,
            );
            let put = self.wait(r, Duration::from_secs(1));
            let flushed = put && self.wait((self.lib.ucp_ep_flush_nbx)(ep, &p), Duration::from_secs(1));
            // A flush that never completes (no one acknowledged the put) keeps the key and buffer in use.
            if flushed {
                (self.lib.ucp_rkey_destroy)(rkey);
                (self.lib.ucp_mem_unmap)(self.ctx, memh);
            } else {
                std::mem::forget(own);
                self.stuck.set(true);
            }
            flushed
        }
    }

    pub fn progress_for(&self, d: Duration) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            // SAFETY: our worker, this thread.
            if unsafe { (self.lib.ucp_worker_progress)(self.worker) } == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// This worker as a sender address for a handshake, under `origin`.
    pub fn sender_address(&self, origin: u64) -> Vec<u8> {
        encode_address(origin, host_id(), &[&self.address])
    }

    /// How many control messages the receiver sent this worker.
    pub fn answers(&self) -> usize {
        self.answers.lock().unwrap().len()
    }

    /// The control messages the receiver sent this worker so far (decoded).
    pub fn replies(&self) -> Vec<TransferControl> {
        self.answers.lock().unwrap().iter().map(|b| TransferControl::decode(b.as_slice()).expect("a reply")).collect()
    }

    /// Progresses until the reply to `correlation_id` arrived (at most 10 s).
    pub fn reply_to(&self, correlation_id: u64) -> TransferControl {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(r) = self.replies().into_iter().find(|m| m.correlation_id == correlation_id) {
                return r;
            }
            assert!(Instant::now() < end, "no reply to {correlation_id} within 10 s");
            self.progress_for(Duration::from_millis(5));
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if self.stuck.get() {
            return;
        }
        // SAFETY: our objects; the endpoint is force-closed and the worker progressed until it is gone.
        unsafe {
            if let Some(ep) = self.ep.take() {
                let mut p: ucp_request_param_t = std::mem::zeroed();
                p.op_attr_mask = ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
                p.flags = ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE.0;
                if let StatusPtr::Pending(req) = classify((self.lib.ucp_ep_close_nbx)(ep, &p)) {
                    let end = Instant::now() + Duration::from_secs(2);
                    while (self.lib.ucp_request_check_status)(req) == ucs_status_t::UCS_INPROGRESS
                        && Instant::now() < end
                    {
                        (self.lib.ucp_worker_progress)(self.worker);
                    }
                    (self.lib.ucp_request_free)(req);
                }
            }
            (self.lib.ucp_worker_destroy)(self.worker);
            (self.lib.ucp_cleanup)(self.ctx);
        }
    }
}

/// Expects a 64-token request `id` on `recv` over a fresh reservation in `pool` (60 s deadline, checksum
/// verified): what every UCX hostile and fuzz test sets up before it attacks.
pub fn expect64(recv: &KvReceiver, pool: &BlockPool, id: &str) -> (TransferDescriptor, PendingTransfer) {
    let blocks = pool.reserve(id, 64).unwrap();
    let req = ExpectRequest {
        request_id: id.into(),
        blocks,
        num_tokens: 64,
        timeout: Duration::from_secs(60),
        verify_checksum: true,
    };
    recv.expect(req).unwrap()
}

/// The receiver's control worker (lane 0) from a descriptor.
pub fn receiver_worker(desc: &TransferDescriptor) -> Vec<u8> {
    let address = &desc.endpoint.as_ref().unwrap().address;
    decode_address(address).expect("a UCX endpoint address").lanes[0].to_vec()
}

pub fn control(correlation_id: u64, body: Body) -> Vec<u8> {
    TransferControl { correlation_id, body: Some(body) }.encode_to_vec()
}

/// A handshake for `request_id` presenting `token`, with replies to `sender_address`.
pub fn begin(request_id: &str, token: Vec<u8>, sender_address: Vec<u8>) -> Body {
    Body::Begin(TransferBegin {
        request_id: request_id.into(),
        transfer_token: token,
        sender_address,
        receiver_mediated: true,
        ..Default::default()
    })
}

/// A handshake that matches `desc` in every field (the receiver accepts it), with replies to
/// `sender_address`; `receiver_mediated`: active messages (else it asks for one-sided puts).
pub fn valid_begin(desc: &TransferDescriptor, sender_address: Vec<u8>, receiver_mediated: bool) -> Body {
    Body::Begin(TransferBegin {
        request_id: desc.request_id.clone(),
        transfer_token: desc.transfer_token.clone(),
        num_tokens: desc.num_tokens,
        block_ids: desc.block_ids.clone(),
        layout: desc.layout,
        fingerprint: desc.fingerprint.clone(),
        sender_address,
        receiver_mediated,
    })
}
