//! What the progress thread does: control and data sends, puts, flushes, registrations, the progress
//! loop itself and placing received active-message writes.

use super::*;

impl State {
    pub(super) fn send_control(&mut self, ep: u64, data: Vec<u8>) {
        let Ok(h) = self.ep(ep) else { return };
        let inflight = self.control_inflight.entry(ep).or_insert(0);
        if *inflight >= CONTROL_INFLIGHT {
            self.events.push_front(Event::CutOff(ep, "the peer does not read its replies"));
            return;
        }
        *inflight += 1;
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
        self.issued(token, &p, r, Action::Control(ep));
    }

    pub(super) fn put(&mut self, ep: u64, rkeys: u64, op: PutOp, am: bool) {
        let h = match self.ep(ep) {
            Ok(h) => h,
            Err(e) => {
                self.put_errors.entry(ep).or_insert_with(|| e.to_string());
                return;
            }
        };
        let token = next_id();
        if let Some(layer) = op.stream_layer {
            let hdr =
                StreamHeader { session: op.session_id, token: op.token, layer, offset: op.dst_offset, len: op.len };
            return self.send_data(ep, h, token, AM_STREAM, hdr.encode().to_vec(), op);
        }
        if am {
            return self.send_data(ep, h, token, AM_DATA, op.header().encode().to_vec(), op);
        }
        let Some(rkey) = self.rkeys.get(&rkeys).and_then(|(_, v)| v.get(op.region).copied()) else {
            self.put_errors.entry(ep).or_insert_with(|| "put without its remote key".into());
            return;
        };
        let p = self.param(token);
        // SAFETY: the source stays alive and unmodified until the put is flushed (session contract); the
        // remote range was checked against the descriptor's regions.
        let r = unsafe {
            (self.lib.ucp_put_nbx)(h, op.src as *const core::ffi::c_void, op.len as size_t, op.dst_addr, rkey, &p)
        };
        self.issued(token, &p, r, Action::Put(ep, op.staged));
    }

    /// A data write as a rendezvous active message `id` with header `hdr`: a receiver-placed write
    /// (`AM_DATA`) from the pool or a staging buffer, or a gathered write (`AM_STREAM`) from a device
    /// buffer. Device sources go as CUDA memory.
    fn send_data(&mut self, ep: u64, h: ucp_ep_h, token: u64, id: u32, hdr: Vec<u8>, op: PutOp) {
        let mut p = self.param(token);
        p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = ucp_send_am_flags::UCP_AM_SEND_FLAG_RNDV.0;
        if op.device {
            if !self.cuda {
                // SAFETY: the request was never issued; reclaim its callback argument.
                drop(unsafe { Box::from_raw(p.user_data as *mut (usize, u64)) });
                self.put_errors.entry(ep).or_insert_with(|| "a device-memory write on a UCX without CUDA".into());
                return;
            }
            p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            p.memory_type = ucs_memory_type_UCS_MEMORY_TYPE_CUDA;
        }
        self.buffers.insert(token, (Box::new([0; 8]), hdr));
        let hdr = &self.buffers[&token].1;
        // SAFETY: the header lives in self.buffers and the source in the session's arena, or in the staging
        // or device buffer the action holds, until the send completes.
        let r = unsafe {
            (self.lib.ucp_am_send_nbx)(
                h,
                id,
                hdr.as_ptr() as *const core::ffi::c_void,
                hdr.len() as size_t,
                op.src as *const core::ffi::c_void,
                op.len as size_t,
                &p,
            )
        };
        *self.data_inflight.entry(ep).or_insert(0) += 1;
        self.issued(token, &p, r, Action::DataSend(ep, op.staged, op.device_buf));
    }

    pub(super) fn flush(&mut self, ep: u64, join: Arc<FlushJoin>) {
        if self.data_inflight.get(&ep).is_some_and(|n| *n > 0) && self.eps.get(&ep).is_some_and(|e| e.failed.is_none())
        {
            // Endpoint flush covers RMA, not active messages: wait for the data sends first.
            self.flush_waiting.entry(ep).or_default().push(join);
            return;
        }
        let h = match self.ep(ep) {
            Ok(h) => h,
            Err(e) => return join.part(Err(e)),
        };
        if let Some(e) = self.put_errors.remove(&ep) {
            return join.part(Err(TransferError::Transport(format!("put failed: {e}"))));
        }
        let token = next_id();
        let p = self.param(token);
        // SAFETY: valid endpoint.
        let r = unsafe { (self.lib.ucp_ep_flush_nbx)(h, &p) };
        self.issued(token, &p, r, Action::Flush(join));
    }

    pub(super) unsafe fn unpack(&mut self, ep: u64, handle: u64, packed: &[Vec<u8>]) -> Result<(), TransferError> {
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

    pub(super) unsafe fn mem_map(&mut self, addr: usize, len: usize) -> Result<Vec<u8>, TransferError> {
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

    /// `ucp_ep_print_info`'s lane lines for `ep`, whitespace squeezed, `; `-joined.
    fn describe(&self, ep: u64) -> String {
        let Ok(h) = self.ep(ep) else { return String::new() };
        let (mut buf, mut len): (*mut libc::c_char, libc::size_t) = (ptr::null_mut(), 0);
        // SAFETY: open_memstream with valid out-pointers; UCX writes the text into the stream, which is
        // closed (flushing it into `buf`) before `buf` is read and freed.
        let text = unsafe {
            let f = libc::open_memstream(&mut buf, &mut len);
            if f.is_null() {
                return String::new();
            }
            (self.lib.ucp_ep_print_info)(h, f as *mut FILE);
            libc::fclose(f);
            if buf.is_null() {
                return String::new();
            }
            let text = String::from_utf8_lossy(std::slice::from_raw_parts(buf as *const u8, len)).into_owned();
            libc::free(buf as *mut libc::c_void);
            text
        };
        text.lines()
            .filter(|l| l.contains("lane["))
            .map(|l| l.trim_start_matches('#').split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub(super) fn close_ep(&mut self, ep: u64) {
        self.control_inflight.remove(&ep);
        self.closing.remove(&ep);
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
    pub(super) unsafe fn run(&mut self, node: &Arc<Node>, rx: mpsc::Receiver<Cmd>, sink: Arc<dyn Sink>) {
        let mut last_activity = Instant::now();
        let spin = crate::wait::spin_time();
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
            // Events are handled after every progress call: what one call delivers stays bounded (a flood
            // cannot pile up events behind a progress loop that never returns 0).
            for _ in 0..PROGRESS_BURST {
                // SAFETY: our worker, our thread.
                let progressed = unsafe { (self.lib.ucp_worker_progress)(self.worker) } != 0;
                busy |= progressed | self.handle_events(node, &*sink);
                if !progressed {
                    break;
                }
            }
            busy |= !self.scattering.is_empty() && self.poll_scatters();
            if !self.closing.is_empty() {
                let now = Instant::now();
                let due: Vec<u64> = self.closing.iter().filter(|(_, by)| **by <= now).map(|(ep, _)| *ep).collect();
                for ep in due {
                    self.close_ep(ep);
                }
            }
            if busy {
                last_activity = Instant::now();
                continue;
            }
            // Scatters on the device complete without a UCX event: poll them without sleeping (one takes
            // tens of microseconds).
            if last_activity.elapsed() < spin || !self.scattering.is_empty() {
                if self.actions.is_empty() && self.scattering.is_empty() {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            // Idle: sleep on the worker's event fd. With requests in flight a short timeout keeps driving
            // transports that complete them only under progress, without an event; polling them without
            // pause held a core the peer process needed on 2 cores (one run fell to 1.2 GB/s).
            let timeout = if self.actions.is_empty() { IDLE_POLL_MS } else { INFLIGHT_POLL_MS };
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
            unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            let mut buf = 0u64;
            // SAFETY: draining our nonblocking eventfd.
            unsafe { libc::read(node.wake_fd, &mut buf as *mut u64 as *mut libc::c_void, 8) };
            if Arc::strong_count(node) == 1 {
                return self.drain();
            }
        }
    }

    /// Handles what the callbacks recorded; whether there was anything.
    fn handle_events(&mut self, node: &Arc<Node>, sink: &dyn Sink) -> bool {
        let mut any = false;
        while let Some(ev) = self.events.pop() {
            any = true;
            match ev {
                Event::Done(token, s) => {
                    if let Some(a) = self.actions.remove(&token) {
                        self.complete(token, a, s);
                    }
                }
                Event::EpError(ep, s) => {
                    let why = status_str(self.lib, s);
                    self.fail_ep(sink, ep, &why, false);
                }
                Event::CutOff(ep, why) => {
                    tracing::warn!(ep, why, "cutting off a UCX peer");
                    self.fail_ep(sink, ep, why, true);
                }
                Event::Data(hdr, payload) => self.on_data(sink, hdr, payload),
                Event::Stream(hdr, payload) => self.on_stream(sink, hdr, payload),
                Event::Am(origin, bytes) => match TransferControl::decode(bytes.as_slice()) {
                    Ok(msg) => sink.on_control(node, origin, msg),
                    Err(e) => {
                        tracing::debug!(error = %e, "undecodable kv-transfer control message");
                        sink.on_dropped(1);
                    }
                },
                Event::Dropped(n) => sink.on_dropped(n),
            }
        }
        any
    }

    /// Marks `ep` failed, tells the sink (`cut_off`: we cut the peer off), and closes it.
    fn fail_ep(&mut self, sink: &dyn Sink, ep: u64, why: &str, cut_off: bool) {
        if let Some(e) = self.eps.get_mut(&ep)
            && e.failed.is_none()
        {
            e.failed = Some(why.to_string());
            tracing::info!(ep, reason = %why, "UCX endpoint failed");
            if cut_off {
                sink.on_cut_off(ep, why);
            } else {
                sink.on_ep_error(ep, why);
            }
            self.close_ep(ep);
        }
    }

    /// Places an active-message write where the receiver admits it, or drops it.
    pub(super) fn on_data(&mut self, sink: &dyn Sink, hdr: WriteHeader, payload: Payload) {
        let len = hdr.len;
        let admitted = match sink.admit(&hdr) {
            Some(Ok(p)) => Some(p),
            Some(Err(Refusal::Invalid(why))) => {
                // Its sender broke the rules and the transfer failed: once per transfer.
                tracing::warn!(why, "dropping an invalid write");
                None
            }
            Some(Err(Refusal::WrongToken)) => {
                // Any endpoint can send these (the core counts them): never above debug.
                tracing::debug!(session = hdr.session, "dropping a write without the session token");
                None
            }
            _ => None,
        };
        match (payload, admitted) {
            (Payload::Rndv(desc, announced), Some(permit)) if announced != len => {
                // A receive of `len` bytes would complete with the `announced` ones and count `len`: the
                // session's own sender broke the rules (only it has the token), so the transfer fails.
                permit.fail(&format!("a rendezvous of {announced} bytes under a {len}-byte write header"));
                // SAFETY: releasing an unreceived rendezvous descriptor drops its data.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Rndv(desc, _), Some(permit)) if permit.staged() && self.cuda && permit.cuda_memory() => {
                self.recv(desc, permit, None, true)
            }
            (Payload::Rndv(desc, _), Some(permit)) if permit.staged() => self.recv_staged(desc, permit),
            (Payload::Rndv(desc, _), Some(permit)) => self.recv(desc, permit, None, false),
            (Payload::Persistent(desc), permit) => {
                if let Some(permit) = permit {
                    // SAFETY: `len` payload bytes (checked in the callback), valid until released below.
                    place(permit, unsafe { std::slice::from_raw_parts(desc as *const u8, len as usize) });
                }
                // SAFETY: a descriptor kept by returning UCS_INPROGRESS.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Rndv(desc, _), None) => {
                // SAFETY: releasing an unreceived rendezvous descriptor drops its data.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Copied(bytes), Some(permit)) => place(permit, &bytes),
            (Payload::Copied(_), None) => {}
        }
    }

    /// A gathered write: admitted as a range of the transfer's stream (from a layer's, possibly on into the
    /// next layers'), received into a landing buffer on the device, then scattered into the transfer's
    /// blocks ([`scatter`]).
    pub(super) fn on_stream(&mut self, sink: &dyn Sink, hdr: StreamHeader, payload: Payload) {
        tracing::trace!(
            layer = hdr.layer,
            offset = hdr.offset,
            bytes = hdr.len,
            waiting = self.deferred_stream.len(),
            "kv-transfer: a gathered write announced"
        );
        let admitted = match sink.admit_stream(&hdr) {
            Some(Ok(p)) => Some(p),
            Some(Err(Refusal::Invalid(why))) => {
                tracing::warn!(why, "dropping an invalid gathered write");
                None
            }
            _ => None,
        };
        let landing = self.landing.is_some();
        match (payload, admitted) {
            (Payload::Rndv(desc, announced), Some(permit))
                if announced == hdr.len && hdr.len <= STREAM_CHUNK as u64 && landing =>
            {
                self.deferred_stream.push_back((desc, permit));
                self.resume_stream();
            }
            (Payload::Rndv(desc, announced), Some(permit)) => {
                permit.fail(&format!(
                    "a gathered write of {announced} bytes under a {}-byte header (at most {STREAM_CHUNK}), or no \
                     device buffer to land it",
                    hdr.len
                ));
                // SAFETY: releasing an unreceived rendezvous descriptor drops its data.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Rndv(desc, _), None) => {
                // SAFETY: as above.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Persistent(desc), permit) => {
                if let Some(p) = permit {
                    p.fail("a gathered write must come by rendezvous");
                }
                // SAFETY: a descriptor kept by returning UCS_INPROGRESS.
                unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            }
            (Payload::Copied(_), Some(p)) => p.fail("a gathered write must come by rendezvous"),
            (Payload::Copied(_), None) => {}
        }
    }

    /// Starts deferred gathered receives while landing buffers are free.
    pub(super) fn resume_stream(&mut self) {
        if self.resuming_stream {
            return;
        }
        self.resuming_stream = true;
        while !self.deferred_stream.is_empty() {
            let Some(buf) = self.landing.as_ref().and_then(|p| p.try_take()) else { break };
            let Some((desc, permit)) = self.deferred_stream.pop_front() else { break };
            let (dst, len) = (buf.addr() as *mut u8, (permit.len as usize).min(buf.len()));
            // SAFETY: `len` bytes fit the landing buffer (on_stream admitted at most STREAM_CHUNK), which the
            // action holds until the receive completes.
            unsafe { self.recv_data(desc, dst, len, true, Action::RecvStream(permit, buf)) };
        }
        self.resuming_stream = false;
    }

    /// Receives a rendezvous payload into `staged`, else straight into the admitted range (device memory
    /// with `cuda`: UCX's CUDA transports, cuda_ipc from another GPU of this node).
    fn recv(&mut self, desc: *mut core::ffi::c_void, permit: WritePermit, mut staged: Option<StagedBuf>, cuda: bool) {
        let dst = match staged.as_deref_mut() {
            Some(buf) => buf.as_mut_ptr(),
            None => permit.ptr,
        };
        let len = permit.len;
        // SAFETY: `len` bytes at `dst` (the admitted range, or a staging buffer of at least that size) stay
        // ours until the receive completes: the action holds the permit and the buffer.
        unsafe { self.recv_data(desc, dst, len, cuda, Action::Recv(permit, staged)) };
    }

    /// Receives rendezvous descriptor `desc` into `len` bytes at `dst` (CUDA memory with `cuda`); `action`
    /// runs when it lands.
    ///
    /// # Safety
    /// `dst..dst + len` stays writable and unused by anyone else until the action completes.
    unsafe fn recv_data(&mut self, desc: *mut core::ffi::c_void, dst: *mut u8, len: usize, cuda: bool, action: Action) {
        let t = next_id();
        let mut p = self.param(t);
        p.cb.recv_am = Some(on_recv_done);
        if cuda {
            p.op_attr_mask |= ucp_op_attr_t_UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            p.memory_type = ucs_memory_type_UCS_MEMORY_TYPE_CUDA;
        }
        // SAFETY: the caller's contract.
        let r = unsafe {
            (self.lib.ucp_am_recv_data_nbx)(self.worker, desc, dst as *mut core::ffi::c_void, len as size_t, &p)
        };
        self.issued(t, &p, r, action);
    }

    /// A rendezvous write into a device pool: received into a staging buffer, then copied in. Without a
    /// free buffer it waits (holding its permit, so the transfer's blocks stay put) for one to return.
    fn recv_staged(&mut self, desc: *mut core::ffi::c_void, permit: WritePermit) {
        if permit.len > STAGE_BYTES {
            let why = format!("a {}-byte write exceeds the {STAGE_BYTES}-byte staging buffer", permit.len);
            permit.fail(&why);
            // SAFETY: releasing an unreceived rendezvous descriptor drops its data.
            unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
            return;
        }
        let pool = self.recv_staging.get_or_insert_with(|| StagingPool::new(RECEIVER_LANE_BUFFERS)).clone();
        self.deferred.push_back((desc, permit));
        if pool.available() > 0 {
            self.resume_staged();
        }
    }

    /// Starts deferred staged receives while staging buffers are free.
    pub(super) fn resume_staged(&mut self) {
        if self.resuming {
            return;
        }
        self.resuming = true;
        while !self.deferred.is_empty() {
            let Some(buf) = self.recv_staging.as_ref().and_then(|p| p.try_take()) else { break };
            let Some((desc, permit)) = self.deferred.pop_front() else { break };
            self.recv(desc, permit, Some(buf), false);
        }
        self.resuming = false;
    }

    pub(super) fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Connect { ep, addr, peer_errors, done } => {
                // SAFETY: on the worker's thread.
                let r = unsafe { self.connect(ep, &addr, peer_errors) };
                if let Some(d) = done {
                    d.set(r);
                } else if let Err(e) = r {
                    tracing::warn!(error = %e, "UCX connect failed");
                }
            }
            Cmd::Control { ep, data } => self.send_control(ep, data),
            Cmd::Put { ep, rkeys, op, am } => self.put(ep, rkeys, op, am),
            Cmd::Flush { ep, join } => self.flush(ep, join),
            Cmd::Rkeys { ep, handle, packed, done } => {
                // SAFETY: on the worker's thread.
                done.set(unsafe { self.unpack(ep, handle, &packed) });
            }
            Cmd::MemMap { addr, len, done } => {
                // SAFETY: on the worker's thread.
                done.set(unsafe { self.mem_map(addr, len) });
            }
            Cmd::CloseEp { ep } => self.close_ep(ep),
            Cmd::Describe { ep, done } => {
                done.set(self.describe(ep));
            }
            Cmd::CloseWhenSent { ep, by } => {
                if self.control_inflight.contains_key(&ep) {
                    self.closing.insert(ep, by);
                } else {
                    self.close_ep(ep);
                }
            }
            Cmd::Shutdown => {}
        }
    }

    /// Fails what is pending and closes every endpoint (then `destroy`).
    pub(super) fn drain(&mut self) {
        self.finish_scatters();
        let eps: Vec<u64> = self.eps.keys().copied().collect();
        for ep in eps {
            self.close_ep(ep);
        }
        // Keep progressing a little even when nothing of ours is pending: wireup replies UCX still owes
        // its peers go out now, rather than sit in a queue that ucp_worker_destroy purges (UCX 1.13
        // asserts on purging a wireup reply).
        let start = Instant::now();
        let until = start + Duration::from_millis(500);
        while (!self.actions.is_empty() || start.elapsed() < Duration::from_millis(50)) && Instant::now() < until {
            // SAFETY: our worker.
            unsafe { (self.lib.ucp_worker_progress)(self.worker) };
            while let Some(ev) = self.events.pop() {
                if let Event::Done(token, s) = ev
                    && let Some(a) = self.actions.remove(&token)
                {
                    self.complete(token, a, s);
                }
            }
        }
        // Landings completed by the loop above queued their scatters.
        self.finish_scatters();
        let lost = || Err(TransferError::Transport("link lost: UCX worker stopped".into()));
        for j in self.flush_waiting.drain().flat_map(|(_, v)| v) {
            j.part(lost());
        }
        for (desc, _permit) in std::mem::take(&mut self.deferred) {
            // SAFETY: an unreceived rendezvous descriptor; releasing it drops its data.
            unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
        }
        for (desc, _permit) in std::mem::take(&mut self.deferred_stream) {
            // SAFETY: as above.
            unsafe { (self.lib.ucp_am_data_release)(self.worker, desc) };
        }
        // Requests still in flight keep their memory (staging buffers, permits) until `destroy` has
        // destroyed the worker: only then can UCX no longer touch it.
        self.actions.retain(|_, a| match a {
            Action::Flush(j) => {
                j.part(lost());
                false
            }
            _ => true,
        });
    }
}
