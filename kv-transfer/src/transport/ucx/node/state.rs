//! Creating and destroying the UCX context and worker, and the request bookkeeping shared by every
//! operation.

use super::*;

impl State {
    pub(super) unsafe fn create(
        lib: &'static UcpLib,
        tls: Option<&str>,
        net_devices: Option<&str>,
        rma: bool,
    ) -> Result<State, TransferError> {
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
            // The listening sockets of UCX's network transports follow NET_DEVICES (default: every
            // interface); the user's UCX_NET_DEVICES wins over ours.
            if let Some(dev) = net_devices
                && std::env::var_os("UCX_NET_DEVICES").is_none()
            {
                set("NET_DEVICES", dev);
            }
            // Shared memory: UCX 1.13 emulates puts over the mm transports' FIFO one segment at a time; the
            // 8 KB default costs a FIFO slot, a pending-queue pass and a receiver callback per 8 KB (see
            // SHM_SEG_SIZE; bench/RESULTS.md, issue 23).
            // "MM_SEG_SIZE" reaches every mm transport's table (UCX applies it after the environment,
            // so it is only set where the user set no segment size).
            let seg_vars = ["UCX_MM_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_POSIX_SEG_SIZE"];
            if super::super::host::shm_allowed(tls) && seg_vars.iter().all(|v| std::env::var_os(v).is_none()) {
                set("MM_SEG_SIZE", SHM_SEG_SIZE);
            }
            // A killed peer must be noticed in about a second, not the 20 s default.
            if std::env::var_os("UCX_KEEPALIVE_INTERVAL").is_none() {
                set("KEEPALIVE_INTERVAL", "500ms");
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = ucp_params_field::UCP_PARAM_FIELD_FEATURES.0 as u64;
            // RMA only where asked (see Node::start): with it UCX answers any peer's put or get.
            let rma = if rma { ucp_feature::UCP_FEATURE_RMA.0 } else { 0 };
            params.features = (rma | ucp_feature::UCP_FEATURE_AM.0 | ucp_feature::UCP_FEATURE_WAKEUP.0) as u64;
            let mut ctx: ucp_context_h = ptr::null_mut();
            let s = (lib.ucp_init_version)(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            (lib.ucp_config_release)(config);
            if s != ucs_status_t::UCS_OK {
                return Err(err(lib, "ucp_init", s));
            }
            let mut attr: ucp_context_attr_t = std::mem::zeroed();
            attr.field_mask = ucp_context_attr_field::UCP_ATTR_FIELD_MEMORY_TYPES.0 as u64;
            let cuda = (lib.ucp_context_query)(ctx, &mut attr) == ucs_status_t::UCS_OK
                && attr.memory_types & (1 << ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0;
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
            let events: Box<Events> = Box::default();
            let arg = &*events as *const _ as *mut core::ffi::c_void;
            let mut hp = super::super::api::whole_message_handler(AM_CONTROL, Some(on_am), arg);
            let mut s = (lib.ucp_worker_set_am_recv_handler)(worker, &hp);
            if s == ucs_status_t::UCS_OK {
                hp = super::super::api::whole_message_handler(AM_DATA, Some(on_am_data), arg);
                hp.flags |= ucp_am_cb_flags::UCP_AM_FLAG_PERSISTENT_DATA.0;
                s = (lib.ucp_worker_set_am_recv_handler)(worker, &hp);
            }
            if s == ucs_status_t::UCS_OK {
                hp = super::super::api::whole_message_handler(AM_STREAM, Some(on_am_stream), arg);
                hp.flags |= ucp_am_cb_flags::UCP_AM_FLAG_PERSISTENT_DATA.0;
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
                data_inflight: HashMap::new(),
                flush_waiting: HashMap::new(),
                control_inflight: HashMap::new(),
                closing: HashMap::new(),
                put_errors: HashMap::new(),
                recv_staging: None,
                deferred: VecDeque::new(),
                resuming: false,
                resuming_stream: false,
                deferred_stream: VecDeque::new(),
                landing: None,
                scattering: VecDeque::new(),
                cuda,
            })
        }
    }

    pub(super) fn events_ptr(&self) -> usize {
        &*self.events as *const _ as usize
    }

    /// A request parameter whose completion records `Done(token)`.
    pub(super) fn param(&self, token: u64) -> ucp_request_param_t {
        // SAFETY: all-zero is a valid "no fields" parameter.
        let mut p: ucp_request_param_t = unsafe { std::mem::zeroed() };
        p.op_attr_mask = ucp_op_attr_t_UCP_OP_ATTR_FIELD_CALLBACK | ucp_op_attr_t_UCP_OP_ATTR_FIELD_USER_DATA;
        p.cb.send = Some(on_request_done);
        p.user_data = Box::into_raw(Box::new((self.events_ptr(), token))) as *mut core::ffi::c_void;
        p
    }

    /// Handles a just-issued request: immediate completion runs the action now.
    pub(super) fn issued(&mut self, token: u64, p: &ucp_request_param_t, r: ucs_status_ptr_t, action: Action) {
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

    pub(super) fn complete(&mut self, token: u64, action: Action, s: ucs_status_t) {
        let ok = s == ucs_status_t::UCS_OK;
        match action {
            Action::Put(ep, _source) => {
                if !ok {
                    self.put_errors.entry(ep).or_insert_with(|| status_str(self.lib, s));
                }
            }
            Action::Control(ep) => {
                self.buffers.remove(&token);
                if let Some(n) = self.control_inflight.get_mut(&ep) {
                    *n -= 1;
                    if *n == 0 {
                        self.control_inflight.remove(&ep);
                        if self.closing.remove(&ep).is_some() {
                            self.close_ep(ep);
                        }
                    }
                }
            }
            Action::DataSend(ep, _source, _device) => {
                self.buffers.remove(&token);
                if !ok {
                    self.put_errors.entry(ep).or_insert_with(|| status_str(self.lib, s));
                }
                let n = self.data_inflight.entry(ep).or_insert(1);
                *n -= 1;
                if *n == 0 {
                    self.data_inflight.remove(&ep);
                    for j in self.flush_waiting.remove(&ep).unwrap_or_default() {
                        self.flush(ep, j);
                    }
                }
            }
            Action::Recv(permit, staged) => {
                match (ok, staged) {
                    (false, staged) => drop((permit, staged)),
                    (true, None) => permit.commit(),
                    (true, Some(buf)) => {
                        let n = permit.len;
                        place(permit, &buf[..n]);
                    }
                }
                // The staging buffer is back: a deferred write may take it.
                self.resume_staged();
            }
            Action::RecvStream(permit, buf) => {
                tracing::trace!(bytes = permit.len, ok, "kv-transfer: a gathered write landed");
                if !ok {
                    drop((permit, buf));
                } else if let Some(s) = scatter(permit, buf) {
                    // Committed and its buffer returned by poll_scatters once the copy finished.
                    self.scattering.push_back(s);
                    return;
                }
                // The landing buffer is back: a deferred gathered write may take it.
                self.resume_stream();
            }
            Action::Flush(join) => {
                join.part(if ok { Ok(()) } else { Err(err(self.lib, "link lost: flush", s)) });
            }
            Action::Close => {}
        }
    }

    /// Commits the gathered writes whose scatter finished (a failed copy fails its transfer) and lets
    /// deferred ones take their landing buffers; whether any finished.
    pub(super) fn poll_scatters(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.scattering.len() {
            let Some(done) = self.scattering[i].copy.poll() else {
                i += 1;
                continue;
            };
            let Some(s) = self.scattering.remove(i) else { break };
            tracing::trace!(
                bytes = s.permit.len,
                scatter_us = s.queued.elapsed().as_micros() as u64,
                "kv-transfer: scattered a gathered write"
            );
            match done {
                Ok(()) => s.permit.commit(),
                Err(e) => s.permit.fail(&format!("scattering on the device: {e}")),
            }
            any = true;
        }
        if any {
            self.resume_stream();
        }
        any
    }

    /// Waits for every queued scatter (the node is stopping), committing those that finished.
    pub(super) fn finish_scatters(&mut self) {
        for mut s in std::mem::take(&mut self.scattering) {
            match s.copy.wait() {
                Ok(()) => s.permit.commit(),
                Err(e) => s.permit.fail(&format!("scattering on the device: {e}")),
            }
        }
    }

    pub(super) fn ep(&self, ep: u64) -> Result<ucp_ep_h, TransferError> {
        match self.eps.get(&ep) {
            Some(e) if e.failed.is_none() => Ok(e.h),
            Some(e) => Err(TransferError::Transport(format!("link lost: {}", e.failed.clone().unwrap_or_default()))),
            None => Err(TransferError::Transport("link lost: no such endpoint".into())),
        }
    }

    pub(super) unsafe fn connect(&mut self, id: u64, addr: &[u8], peer_errors: bool) -> Result<(), TransferError> {
        if addr.is_empty() {
            return Err(TransferError::Transport("bad UCX address".into()));
        }
        if self.no_peer_errors || !peer_errors {
            // SAFETY: forwarded.
            return match unsafe { self.create_ep(id, addr, false) } {
                // The peer connected to us first with the other error-handling mode (its own view of
                // which transports we share): UCX requires both sides' endpoints to agree.
                // SAFETY: forwarded.
                Err(ucs_status_t::UCS_ERR_UNSUPPORTED) if !self.no_peer_errors => unsafe {
                    self.create_ep(id, addr, true)
                },
                r => r,
            }
            .map_err(|s| err(self.lib, "ucp_ep_create", s));
        }
        // SAFETY: forwarded.
        match super::super::api::quiet_probe(|| unsafe { self.create_ep(id, addr, true) }) {
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

    pub(super) unsafe fn create_ep(&mut self, id: u64, addr: &[u8], peer_errors: bool) -> Result<(), ucs_status_t> {
        let arg = Box::new((self.events_ptr(), id));
        // SAFETY: zeroed params with the fields we set; the address outlives the call.
        unsafe {
            let mut p: ucp_ep_params_t = std::mem::zeroed();
            p.field_mask = ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 as u64;
            p.address = addr.as_ptr() as *const ucp_address_t;
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

    pub(super) unsafe fn destroy(self) {
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
