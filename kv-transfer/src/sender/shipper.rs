//! The background thread that turns queued layers into puts, so `put_layer` never blocks compute. One per
//! sender; puts themselves are asynchronous in every transport, so the thread waits for each layer's
//! completion marker (a GPU event; complete at once on the CPU), plans, checksums and hands puts over.
//! A device pool is copied out piece by piece into staging buffers first ([`crate::staging`]); the
//! transport returns each buffer once its bytes left. Where the link moves device memory and lands
//! gathered writes, the layers of a device pool are gathered on the device instead, and consecutive
//! layers of a session that are already written go together: a few large messages for many small
//! layers (see [`Shipper::start`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use kv_cache::LayerIdx;
use kv_cache::LayerReady;
use kv_cache::hash::Sum64;
use proto::v1::LayerManifest;

use super::session::SessionState;
use crate::TransferError;
use crate::fault::Fault;
use crate::layout::{self, checksum_segments};
use crate::staging::{self, STAGE_BYTES, StagedBuf, StagingPool};
use crate::transport::{PutOp, lanes};

/// One finished layer to turn into puts.
pub(crate) struct LayerShipment {
    pub st: Arc<SessionState>,
    pub layer: LayerIdx,
    /// Reached once the layer's bytes are written.
    pub ready: LayerReady,
    pub fault: Option<Fault>,
    /// The sender's staging buffers when its pool is device memory.
    pub staging: Option<Arc<StagingPool>>,
    /// The sender's device buffers for gathering layers ([`gathers`]).
    pub gather: Arc<staging::LazyDevicePool>,
}

pub(crate) struct Shipper {
    tx: std::sync::Mutex<mpsc::Sender<LayerShipment>>,
}

impl Shipper {
    /// Starts the shipping thread. It takes the oldest queued layer and, where that layer is gathered
    /// ([`gathers`]), the layers of the same session queued right behind it that are already written
    /// (up to [`COALESCE_BYTES`]): they are gathered and sent as one stretch of the request's stream, so
    /// a request whose layers are all written (a short prefill, or a shipper that fell behind) goes as a
    /// few 32 MiB messages instead of one or two per layer. A layer still being computed is never waited
    /// for to fill a batch.
    pub fn start() -> Result<Shipper, TransferError> {
        let (tx, rx) = mpsc::channel::<LayerShipment>();
        std::thread::Builder::new()
            .name("kv-ship".into())
            .spawn(move || {
                let mut backlog: VecDeque<LayerShipment> = VecDeque::new();
                loop {
                    let first = match backlog.pop_front() {
                        Some(s) => s,
                        None => match crate::wait::recv_spinning(&rx) {
                            Ok(s) => s,
                            Err(_) => return,
                        },
                    };
                    let mut batch = vec![first];
                    if gathers(&batch[0]) {
                        // A failed marker is reported by ship(), which waits again.
                        let _ = batch[0].ready.wait();
                        backlog.extend(rx.try_iter());
                        while let Some(next) = backlog.front()
                            && joins(&batch, next)
                        {
                            batch.extend(backlog.pop_front());
                        }
                        join_burst(&rx, &mut backlog, &mut batch);
                    }
                    ship(&batch);
                    for s in &batch {
                        s.st.shipment_done();
                    }
                }
            })
            .map_err(|e| TransferError::Transport(format!("cannot start the shipping thread: {e}")))?;
        Ok(Shipper { tx: std::sync::Mutex::new(tx) })
    }

    pub fn submit(&self, shipment: LayerShipment) -> bool {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(shipment).is_ok()
    }
}

/// How long the shipping thread waits for the next `put_layer` of a burst still being queued
/// ([`join_burst`]).
const BURST_GAP: std::time::Duration = std::time::Duration::from_micros(5);

/// Takes the layers of a burst of `put_layer` calls still arriving into `batch`: while everything queued
/// joined it and the next layer arrives within [`BURST_GAP`], written and within [`COALESCE_BYTES`]
/// (`joins`). A request whose layers are all written is queued in a burst (a short prefill, a
/// shipper that fell behind, kv-bench), and a shipping thread that woke at its first layer took one or
/// two layers alone: a 1K-token request went as a 1-4 MB message before its 32 MiB ones. Layers queued
/// as they are computed do not join (not written yet), so this waits at most [`BURST_GAP`] for them.
fn join_burst(
    rx: &mpsc::Receiver<LayerShipment>,
    backlog: &mut VecDeque<LayerShipment>,
    batch: &mut Vec<LayerShipment>,
) {
    let mut last = std::time::Instant::now();
    while backlog.is_empty() && last.elapsed() < BURST_GAP {
        match rx.try_recv() {
            Ok(next) if joins(batch, &next) => {
                batch.push(next);
                last = std::time::Instant::now();
            }
            Ok(next) => backlog.push_back(next),
            Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            Err(mpsc::TryRecvError::Disconnected) => return,
        }
    }
}

/// The most bytes of consecutive written layers gathered together (the sender's gather buffers, once
/// over).
const COALESCE_BYTES: u64 = (staging::DEVICE_BUFFERS * staging::STREAM_CHUNK) as u64;

/// Whether `shipment`'s layer goes gathered on the device: a device pool, read by the link itself
/// (CUDA-capable UCX) into a receiver that lands gathered writes, and a layer either scattered (more
/// than [`staging::GATHER_MIN_PUTS`] runs) or small enough that layers going together pays (two fit
/// one message).
fn gathers(shipment: &LayerShipment) -> bool {
    let st = &shipment.st;
    let device = !st.cache.memory_kind().host_accessible();
    let direct = st.link.moves_device_memory() && st.cache.arena().cuda_memory();
    device
        && (direct || shipment.staging.is_none())
        && st.link.stream_writes()
        && (st.plan.layer_put_count() > staging::GATHER_MIN_PUTS
            || st.plan.bytes_per_layer() * 2 <= staging::STREAM_CHUNK as u64)
}

/// Whether `next` joins `batch` (gathered layers of one session, in order): the next layer of the same
/// session, already written, within [`COALESCE_BYTES`], and no fault due at the batch's last layer.
fn joins(batch: &[LayerShipment], next: &LayerShipment) -> bool {
    let Some(last) = batch.last() else { return false };
    Arc::ptr_eq(&last.st, &next.st)
        && next.layer.0 == last.layer.0 + 1
        && last.fault.is_none_or(|f| f.layer() != last.layer.0)
        && next.ready.is_complete()
        && (batch.len() as u64 + 1) * next.st.plan.bytes_per_layer() <= COALESCE_BYTES
}

/// Ships `batch`: consecutive layers of one session (one layer unless they are gathered).
fn ship(batch: &[LayerShipment]) {
    let Some(first) = batch.first() else { return };
    let st = &first.st;
    for s in batch {
        if let Err(e) = s.ready.wait() {
            st.set_error(TransferError::Transport(format!(
                "request {}: layer {} was never written: {e}",
                st.request_id(),
                s.layer.0
            )));
            return;
        }
    }
    let pool = gathers(first).then(|| gather_pool(st, first)).flatten();
    let Some(pool) = pool else {
        for s in batch {
            if !ship_puts(s) {
                return;
            }
        }
        return;
    };
    let last = batch.last().map_or(first.layer, |s| s.layer);
    if !ship_gathered(st, &pool, first.layer, last) {
        return;
    }
    let (latent, indexer) = (st.plan.latent_bytes_per_layer(), st.plan.indexer_bytes_per_layer());
    for s in batch {
        st.bytes.fetch_add(latent + indexer, Ordering::Relaxed);
        if !finish_layer(s, latent, indexer, None) {
            return;
        }
    }
}

/// Ships `shipment`'s layer a put per run (pieces of it through staging buffers for a staged pool);
/// false after recording why the session cannot go on.
fn ship_puts(shipment: &LayerShipment) -> bool {
    let st = &shipment.st;
    let layer = shipment.layer;
    // Regions only where the receiver granted one-sided puts; else writes go through the receiver.
    let base = st.dst_regions.first().map(|r| r.remote_addr).unwrap_or(0);
    let src_base = st.cache.arena().as_ptr() as *const u8;
    // A device pool goes out through host staging buffers unless the link reads device memory itself.
    let device = !st.cache.memory_kind().host_accessible();
    let direct = st.link.moves_device_memory() && st.cache.arena().cuda_memory();
    let staging = shipment.staging.as_ref().filter(|_| !direct);
    // A staged pool is hashed from the host copies as they go out (the arena is not host memory).
    let mut staged_hash = (st.checksum && staging.is_some()).then(Sum64::new);
    // A device pool on either side: pieces must fit one staging buffer.
    let own_limit = staging.map(|_| STAGE_BYTES as u64);
    let max_write = [own_limit, st.link.max_write()].into_iter().flatten().min();
    let (mut latent, mut indexer) = (0u64, 0u64);
    let latent_len = st.plan.latent_bytes_per_layer();
    for p in st.plan.layer_puts(layer) {
        let is_latent = latent < latent_len;
        let dst_addr = base.wrapping_add(p.dst_offset);
        let region = if st.dst_regions.is_empty() {
            0
        } else if let Some(r) = layout::region_for(&st.dst_regions, dst_addr, p.len) {
            r
        } else {
            st.set_error(TransferError::Transport(format!("request {}: put outside the regions", st.request_id())));
            return false;
        };
        // Several lanes: cut the put into aligned pieces dealt over the lanes by bytes; a small
        // request stays on lane 0 with the control messages.
        let lanes = if st.plan.bytes_per_layer() * st.num_layers as u64 >= lanes::SPREAD_MIN_BYTES {
            st.link.lanes()
        } else {
            1
        };
        // Staged pieces hold whole latent entries or indexer blocks, so the receiver admits each.
        let piece = match max_write {
            Some(max) => staging::piece_bytes(st.plan.unit_bytes(is_latent), max),
            None => lanes::piece_bytes(lanes),
        };
        for (off, len) in lanes::split(p.len, piece) {
            let lane = if lanes > 1 { st.lanes.deal(lanes, len) } else { 0 };
            let (src, staged) = match staging {
                // SAFETY (of the transport's read): checked against the local geometry in begin().
                None => (src_base.wrapping_add((p.src_offset + off) as usize), None),
                Some(pool) => match stage(st, pool, layer, p.src_offset + off, len, staged_hash.as_mut()) {
                    Some(buf) => (buf.as_ptr(), Some(buf)),
                    None => return false,
                },
            };
            let op = PutOp {
                session_id: st.session_id,
                token: *st.token().as_bytes(),
                src,
                len,
                dst_offset: p.dst_offset + off,
                dst_addr: dst_addr.wrapping_add(off),
                region,
                lane,
                device: device && staged.is_none(),
                staged,
                stream_layer: None,
                device_buf: None,
            };
            // Holding the control lock while issuing makes "stopped" final: after stop_by_receiver
            // returns, no put of this session enters the transport.
            let c = st.lock_ctl();
            if c.stopped.is_some() {
                return false;
            }
            if let Err(e) = st.link.put(st.regions, op) {
                drop(c);
                st.set_error(super::map_link_error(st.request_id(), e));
                return false;
            }
        }
        if is_latent {
            latent += p.len;
        } else {
            indexer += p.len;
        }
        st.bytes.fetch_add(p.len, Ordering::Relaxed);
    }
    finish_layer(shipment, latent, indexer, staged_hash)
}

/// Records `shipment`'s layer as sent (`latent` and `indexer` bytes) in the session's manifests, with its
/// checksum where the session sends them (`staged_hash`: the digest of the host copies that went out,
/// for a staged pool), and fires a fault due at this layer; false after recording why the session
/// cannot go on.
fn finish_layer(shipment: &LayerShipment, latent: u64, indexer: u64, staged_hash: Option<Sum64>) -> bool {
    let st = &shipment.st;
    let layer = shipment.layer;
    let device = !st.cache.memory_kind().host_accessible();
    let checksum = match (st.checksum, staged_hash) {
        (false, _) => None,
        (true, Some(h)) => Some(h.digest()),
        (true, None) if device => {
            // Sent straight from the device: hashed there (or through a staging buffer).
            let segs: Vec<(u64, u64)> = st.plan.layer_puts(layer).map(|p| (p.src_offset, p.len)).collect();
            let buf = || {
                let pool = shipment.staging.as_ref().ok_or("no staging buffers")?;
                pool.take_until(st.deadline).ok_or("no staging buffer came back in time")
            };
            // SAFETY: the layer is complete (its marker was reached) and unmodified until the session ends.
            match unsafe { staging::checksum_device(st.cache.arena(), &segs, || buf().map_err(str::to_string)) } {
                Ok(h) => Some(h),
                Err(e) => {
                    st.set_error(TransferError::Transport(format!(
                        "request {}: hashing layer {} on the device: {e}",
                        st.request_id(),
                        layer.0
                    )));
                    return false;
                }
            }
        }
        (true, None) => {
            let segs = st.plan.layer_puts(layer).map(|p| (p.src_offset, p.len));
            let src_base = st.cache.arena().as_ptr() as *const u8;
            // SAFETY: the layer is complete (put_layer's contract) and inside the local host arena.
            Some(unsafe { checksum_segments(src_base, segs) })
        }
    };
    st.manifests.lock().unwrap_or_else(|p| p.into_inner())[layer.index()] =
        Some(LayerManifest { layer: layer.0, latent_bytes: latent, indexer_bytes: indexer, checksum });
    if let Some(f) = shipment.fault
        && f.layer() == layer.0
    {
        // Make the fault deterministic: the layer has landed before the process dies or stalls.
        if let Err(e) = st.flush(st.deadline) {
            st.set_error(e);
        }
        f.fire(st.request_id());
    }
    true
}

/// The sender's gather buffers, made on first use; `None` (the layer then goes a message per run, with a
/// warning once per process) where the device cannot lend them.
fn gather_pool(st: &SessionState, shipment: &LayerShipment) -> Option<Arc<staging::DevicePool>> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match shipment.gather.get(st.cache.arena()) {
        Some(Ok(p)) => Some(p),
        Some(Err(e)) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "no device buffers to gather layers: they go a message per run");
            }
            None
        }
        None => None,
    }
}

/// Gathers queued on the device ahead of the chunk being handed to the link.
const GATHERS_AHEAD: usize = 2;

/// Gathers layers `first..=last` (written) of the request's stream chunk by chunk into device buffers of
/// `pool` and hands each chunk to the link as one write; false after recording why the session cannot
/// go on. The next chunk's gather is queued on the device before this one's is waited for, so the
/// copies run back to back while the link sends.
fn ship_gathered(st: &SessionState, pool: &Arc<staging::DevicePool>, first: LayerIdx, last: LayerIdx) -> bool {
    let arena = st.cache.arena();
    let fail = |why: String| {
        st.set_error(TransferError::Transport(format!(
            "request {}: layers {}..={}: {why}",
            st.request_id(),
            first.0,
            last.0
        )));
        false
    };
    let Some(copier) = arena.device_copier() else {
        return fail("a gathered layer needs a device pool".into());
    };
    let base = arena.as_ptr() as u64;
    let bpl = st.plan.bytes_per_layer();
    let (from, to) = (first.0 as u64 * bpl, (last.0 as u64 + 1) * bpl);
    // Messages of 32 MiB from the first: growing from 2 MiB (a shorter first copy) measured 1-4% slower
    // on the H200 pair, in the same call (bench/RESULTS.md).
    let max = staging::STREAM_CHUNK as u64;
    let mut chunks = st.plan.stream_chunks(from, to, max).into_iter().peekable();
    // The gather before its buffer: dropped first (an early return), it waits for the copy, so the buffer
    // goes back to the pool only once the device no longer writes it.
    let mut queued: VecDeque<(u64, u64, Box<dyn kv_cache::QueuedCopy>, staging::DeviceBuf)> = VecDeque::new();
    loop {
        // Queue gathers while buffers are free (waiting for one only when none is queued).
        while queued.len() < GATHERS_AHEAD
            && let Some(&(lo, hi)) = chunks.peek()
        {
            if st.lock_ctl().stopped.is_some() {
                return false;
            }
            let t0 = std::time::Instant::now();
            let buf = if queued.is_empty() {
                let Some(buf) = pool.take_until(st.deadline) else {
                    st.set_error(st.timeout_error());
                    return false;
                };
                buf
            } else {
                match pool.try_take() {
                    Some(buf) => buf,
                    None => break,
                }
            };
            chunks.next();
            if hi - lo > buf.len() as u64 {
                return fail(format!("a {}-byte chunk exceeds the {}-byte gather buffer", hi - lo, buf.len()));
            }
            let mut at = buf.addr();
            let copies: Vec<(u64, u64, u64)> = st
                .plan
                .stream_pieces(lo, hi, true)
                .into_iter()
                .map(|(off, len)| {
                    let c = (base + off, at, len);
                    at += len;
                    c
                })
                .collect();
            // SAFETY: the pieces lie in the pool (the plan was checked against its geometry in begin()) and
            // the buffer holds the chunk (STREAM_CHUNK bytes at most); the layers are complete, and the
            // buffer stays ours (in `queued`, then in the put) until the copy finished.
            let gather = match unsafe { copier.copy_pieces_queued(&copies) } {
                Some(Ok(copy)) => copy,
                Some(Err(e)) => return fail(format!("gathering on the device: {e}")),
                None => return fail("the device cannot gather".into()),
            };
            tracing::trace!(
                lo,
                bytes = hi - lo,
                pieces = copies.len(),
                // Waiting for a buffer, mapping the pieces, uploading them and launching the copy.
                queue_us = t0.elapsed().as_micros() as u64,
                "kv-transfer: gather queued"
            );
            queued.push_back((lo, hi, gather, buf));
        }
        let Some((lo, hi, mut gather, buf)) = queued.pop_front() else { return true };
        let t0 = std::time::Instant::now();
        if let Err(e) = gather.wait() {
            return fail(format!("gathering on the device: {e}"));
        }
        tracing::trace!(
            lo,
            bytes = hi - lo,
            wait_us = t0.elapsed().as_micros() as u64,
            "kv-transfer: gathered a chunk"
        );
        let op = PutOp {
            session_id: st.session_id,
            token: *st.token().as_bytes(),
            src: buf.addr() as *const u8,
            len: hi - lo,
            // The chunk's place in the stream: from byte `lo % bpl` of layer `lo / bpl`'s.
            dst_offset: lo % bpl,
            dst_addr: 0,
            region: 0,
            lane: st.lanes.deal(st.link.lanes(), hi - lo),
            staged: None,
            device: true,
            stream_layer: Some((lo / bpl) as u32),
            device_buf: Some(buf),
        };
        let c = st.lock_ctl();
        if c.stopped.is_some() {
            return false;
        }
        if let Err(e) = st.link.put(st.regions, op) {
            drop(c);
            st.set_error(super::map_link_error(st.request_id(), e));
            return false;
        }
    }
}

/// Copies `len` bytes at `offset` of the device pool into a staging buffer (waiting for one until the
/// deadline) and feeds them to the layer's checksum. `None` after recording why the session cannot go on.
fn stage(
    st: &SessionState,
    pool: &Arc<StagingPool>,
    layer: LayerIdx,
    offset: u64,
    len: u64,
    hash: Option<&mut Sum64>,
) -> Option<StagedBuf> {
    if st.lock_ctl().stopped.is_some() {
        return None;
    }
    let Some(mut buf) = pool.take_until(st.deadline) else {
        st.set_error(st.timeout_error());
        return None;
    };
    let dst = &mut buf[..len as usize];
    // SAFETY: the layer is complete (its marker was reached) and unmodified until the session ends.
    if let Err(e) = unsafe { st.cache.arena().copy_out(offset as usize, dst) } {
        st.set_error(TransferError::Transport(format!(
            "request {}: staging layer {} out of the cache pool: {e}",
            st.request_id(),
            layer.0
        )));
        return None;
    }
    if let Some(h) = hash {
        h.update(dst);
    }
    Some(buf)
}
