//! The decode worker's side: serve the cache arena, then per request hand out a descriptor (with a fresh
//! transfer token) for reserved blocks and await the transfer's outcome.

pub mod core;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kv_cache::{BlockPool, BlockTable, CacheGeometry, KvCache};
use proto::v1::{FinishReason, GeneratedToken, ModelFingerprint, MtpDraft, TransferDescriptor};

use self::core::{OutcomeCell, ReceiverCore, ReceiverTimings, Transfer};
use crate::runtime::Runtime;
use crate::token::TransferToken;
use crate::transport::{Served, TransportKind};
use crate::wait::CellFuture;
use crate::{TransferError, TransportConfig, fingerprint};

/// Receiver settings.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    pub transport: TransportConfig,
    /// How long a one-sided (UCX RMA) sender has to acknowledge an abort before its endpoint is closed.
    pub abort_ack_timeout: Duration,
    /// How long blocks stay out of the pool after a one-sided sender was lost mid-transfer.
    pub quarantine: Duration,
    /// The longest a TCP sender may pause inside one data frame (its payload stops arriving) before the
    /// connection is dropped, which ends the write and fails the sender's transfers. (A write that does
    /// not end within `abort_ack_timeout` after its transfer failed gets its sender cut off too, on
    /// every transport.)
    pub write_stall: Duration,
    /// UCX nodes (workers with a progress thread each) that place incoming active-message writes, and
    /// runtime threads for TCP connections (`None`: `TANDEM_KV_LANES`, else a quarter of the cores, 2 to 8; 1 on one core).
    pub lanes: Option<usize>,
    /// UCX: accept one-sided puts from senders that passed the handshake (`None`: read
    /// `TANDEM_UCX_ONE_SIDED_PUTS`, default off). The pool is then registered and its key handed to
    /// each accepted sender, and the receiver can no longer keep a sender's writes inside its blocks:
    /// only for networks where every process that can reach this worker's UCX ports is trusted.
    pub one_sided_puts: Option<bool>,
}

impl ReceiverConfig {
    pub fn new(transport: TransportConfig) -> Self {
        ReceiverConfig {
            transport,
            abort_ack_timeout: Duration::from_secs(2),
            quarantine: Duration::from_secs(2),
            write_stall: Duration::from_secs(10),
            lanes: None,
            one_sided_puts: None,
        }
    }
}

/// One request's transfer, as the decode worker asks for it after reserving `blocks` in the pool.
#[derive(Debug, Clone)]
pub struct ExpectRequest {
    pub request_id: String,
    /// The request's reservation (as returned by `BlockPool::reserve`); the first
    /// `blocks_for(num_tokens)` blocks receive the caches.
    pub blocks: BlockTable,
    /// Prompt tokens the sender writes (positions `0..num_tokens`).
    pub num_tokens: usize,
    /// The transfer fails (and its blocks are freed) if not completed within this time.
    pub timeout: Duration,
    /// Ask the sender for per-layer checksums and verify them against the received bytes.
    pub verify_checksum: bool,
}

/// A transfer that finished successfully: the request may be scheduled. Its blocks stay reserved under
/// the request id; the decode worker releases them when the request finishes.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletedTransfer {
    pub request_id: String,
    /// The first sampled token, with logprobs when the request asked for them.
    pub first_token: GeneratedToken,
    /// The MTP draft for the next position and its probability (absent without MTP).
    pub draft: Option<MtpDraft>,
    pub bytes: u64,
    /// Whether per-layer checksums were compared against the received bytes.
    pub checksum_verified: bool,
    /// From the accepted handshake to the verified completion.
    pub elapsed: Duration,
}

/// Prefill finished the request itself (EOS, stop token, max_tokens = 1). The blocks were already freed.
#[derive(Debug, Clone, PartialEq)]
pub struct ReleasedTransfer {
    pub request_id: String,
    pub first_token: GeneratedToken,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TransferOutcome {
    Completed(CompletedTransfer),
    Released(ReleasedTransfer),
}

/// Counters for metrics and leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct ReceiverStats {
    /// Transfers expected or in progress.
    pub pending: usize,
    pub completed: u64,
    pub released: u64,
    pub failed: u64,
    pub rejected_handshakes: u64,
    /// Messages dropped unanswered because their sender never proved it holds a descriptor (or flooded
    /// the receiver's queues).
    pub dropped_untrusted: u64,
    /// Peers disconnected for not reading their replies or for messages before a valid handshake.
    pub cut_off_peers: u64,
    /// Blocks held back after a one-sided sender was lost (freed when the quarantine ends).
    pub quarantined_blocks: usize,
    pub bytes_received: u64,
    /// Of those, the bytes that came as gathered writes (layers of a device pool gathered on the sender's
    /// GPU: scattered ones, and small ones that travel several to a message).
    pub stream_bytes_received: u64,
    /// The gathered writes those bytes came in.
    pub stream_writes_received: u64,
}

/// The receiving side of kv-transfer, one per decode worker.
pub struct KvReceiver {
    core: Arc<ReceiverCore>,
    served: Served,
    kind: TransportKind,
    _rt: Arc<Runtime>,
}

impl KvReceiver {
    /// Serves `cache`'s arena over the configured transport (registering it with UCX only in the one-sided
    /// mode). `pool` is the pool the decode worker reserves from; failed transfers free their blocks in
    /// it. A device pool is never registered: writes land through host staging buffers and its
    /// `DeviceCopy`.
    pub fn start(
        config: ReceiverConfig,
        cache: Arc<KvCache>,
        pool: Arc<BlockPool>,
        fingerprint: ModelFingerprint,
    ) -> Result<KvReceiver, TransferError> {
        fingerprint::check_own_fingerprint(&fingerprint, cache.geometry())?;
        crate::layout::check_reachable(&cache)?;
        crate::layout::log_staging("receiver", &cache);
        let g = cache.geometry();
        let total = pool.stats().total_blocks;
        if total != g.num_blocks {
            return Err(TransferError::Transport(format!(
                "pool has {total} blocks but the cache geometry {}",
                g.num_blocks
            )));
        }
        let rt = Runtime::new("kv-recv", config.lanes)?;
        let timings = ReceiverTimings {
            abort_ack_timeout: config.abort_ack_timeout,
            quarantine: config.quarantine,
            write_stall: config.write_stall,
        };
        let core = Arc::new(ReceiverCore::new(cache, pool, fingerprint, timings, rt.handle().clone()));
        let puts = match config.one_sided_puts {
            Some(p) => p,
            None => crate::transport::ucx::one_sided_puts_from_env().map_err(TransferError::Transport)?,
        };
        let transport = crate::transport_for(&config.transport, &rt, config.lanes, puts)?;
        let served = transport.serve(core.clone())?;
        tracing::info!(transport = %transport.kind(), "kv-transfer receiver serving");
        Ok(KvReceiver { core, served, kind: transport.kind(), _rt: rt })
    }

    /// The transport actually serving (UCX may have fallen back to TCP).
    pub fn transport(&self) -> TransportKind {
        self.kind
    }

    pub fn geometry(&self) -> &CacheGeometry {
        &self.core.geometry
    }

    /// Starts expecting a request's caches: returns the descriptor for the prefill worker (carrying the
    /// reservation's fresh transfer token, which opens one handshake; never log it) and a handle that
    /// resolves to the outcome. From here on the transfer owns the reservation's fate on failure:
    /// on any error outcome (and on `Released`) it frees the blocks itself, as soon as no write can land.
    /// On error here nothing was taken.
    pub fn expect(&self, req: ExpectRequest) -> Result<(TransferDescriptor, PendingTransfer), TransferError> {
        let bad = |reason: String| TransferError::BadDescriptor { request_id: req.request_id.clone(), reason };
        if req.num_tokens == 0 {
            return Err(bad("num_tokens is 0".into()));
        }
        if req.num_tokens > u32::MAX as usize {
            return Err(bad("num_tokens does not fit the wire format".into()));
        }
        let need = CacheGeometry::blocks_for(req.num_tokens);
        if req.blocks.len() < need {
            return Err(bad(format!(
                "{} tokens need {need} blocks, the reservation has {}",
                req.num_tokens,
                req.blocks.len()
            )));
        }
        match self.core.pool().table(&req.request_id) {
            Some(t) if t == req.blocks => {}
            Some(_) => return Err(bad("blocks differ from the pool's reservation for this request".into())),
            None => return Err(bad("the pool holds no reservation for this request".into())),
        }
        let blocks: Vec<u32> = req.blocks.blocks[..need].iter().map(|b| b.0).collect();
        let token = TransferToken::generate()?;
        let wire_token = token.to_vec();
        let deadline = Instant::now() + req.timeout;
        let deadline_unix_ms =
            (SystemTime::now() + req.timeout).duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        let t = self.core.register(
            &req.request_id,
            token,
            req.num_tokens as u32,
            blocks.clone(),
            deadline,
            req.verify_checksum,
        )?;
        let desc = TransferDescriptor {
            request_id: req.request_id.clone(),
            transfer_token: wire_token,
            deadline_unix_ms,
            fingerprint: Some(self.core.fingerprint.clone()),
            endpoint: Some(self.served.endpoint.clone()),
            layout: Some(self.core.layout),
            block_ids: blocks,
            num_tokens: req.num_tokens as u32,
            verify_checksum: req.verify_checksum,
        };
        let pending = PendingTransfer { core: self.core.clone(), t: t.clone(), outcome: t.outcome.clone() };
        Ok((desc, pending))
    }

    /// Aborts a request's transfer (client went away). False when none is pending (finished already).
    pub fn abort(&self, request_id: &str, reason: &str) -> bool {
        match self.core.lookup_request(request_id) {
            Some(t) => self.core.fail(
                &t,
                TransferError::Aborted { request_id: request_id.into(), reason: reason.into() },
                reason,
            ),
            None => false,
        }
    }

    pub fn stats(&self) -> ReceiverStats {
        let c = &self.core.counters;
        ReceiverStats {
            pending: self.core.pending_transfers(),
            completed: c.completed.load(Ordering::Relaxed),
            released: c.released.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            rejected_handshakes: c.rejected_handshakes.load(Ordering::Relaxed),
            dropped_untrusted: c.dropped_untrusted.load(Ordering::Relaxed),
            cut_off_peers: c.cut_off_peers.load(Ordering::Relaxed),
            quarantined_blocks: c.quarantined_blocks.load(Ordering::SeqCst),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            stream_bytes_received: c.stream_bytes_received.load(Ordering::Relaxed),
            stream_writes_received: c.stream_writes_received.load(Ordering::Relaxed),
        }
    }
}

/// Resolves to the transfer's outcome: `.await` it, or `wait_timeout` from a plain thread.
pub struct PendingTransfer {
    core: Arc<ReceiverCore>,
    t: Arc<Transfer>,
    outcome: OutcomeCell,
}

impl PendingTransfer {
    pub fn request_id(&self) -> &str {
        &self.t.request_id
    }

    /// Aborts the transfer (client went away). Returns false when it had already finished: after a
    /// `Completed` outcome the blocks belong to the request and the caller releases them.
    pub fn abort(&self, reason: &str) -> bool {
        self.core.fail(
            &self.t,
            TransferError::Aborted { request_id: self.t.request_id.clone(), reason: reason.into() },
            reason,
        )
    }

    /// Blocks the calling thread up to `timeout`; `None` when the transfer is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<TransferOutcome, TransferError>> {
        self.outcome.wait_until(Instant::now() + timeout)
    }

    pub fn is_finished(&self) -> bool {
        self.outcome.is_set()
    }
}

impl Future for PendingTransfer {
    type Output = Result<TransferOutcome, TransferError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut f = CellFuture(self.outcome.clone());
        match Pin::new(&mut f).poll(cx) {
            Poll::Ready(Some(v)) => Poll::Ready(v),
            Poll::Ready(None) => Poll::Ready(Err(TransferError::Usage {
                request_id: self.t.request_id.clone(),
                reason: "outcome already taken".into(),
            })),
            Poll::Pending => Poll::Pending,
        }
    }
}
