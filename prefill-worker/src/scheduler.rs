//! The prefill batcher on the shared compute loop ([`worker::compute_loop`]): start queued requests
//! (prefix-cache lookup, block reservation), run batches under the token budget (long prompts go in
//! chunks), ship every layer of a request as soon as its last chunk computed it, then complete the
//! transfer with the first token and the MTP draft (or release the decode side when prefill already
//! finished the request). The kv-transfer handshake (`KvSender::begin`) and the terminal calls (complete,
//! release, abort: they wait for the receiver) run on helper threads, never on the compute thread; a
//! request's blocks return to the pool only once its transfer has settled. Outcomes are [`PrefillError`]s;
//! the service maps them to gRPC statuses. A device failure ends every request and fails the worker
//! ([`worker::Drain::fail`]): nothing computes anymore.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::prefix_hash::prefix_hashes;
use engine::cache::{BLOCK_SIZE, BlockTable, CacheGeometry, LayerIdx, PoolError};
use engine::generate::{self, SeqState};
use engine::sampling::SamplingParams;
use kv_transfer::{KvSender, SendSession, TransferError};
use proto::v1::{FinishReason, GeneratedToken, MtpDraft, PrefillResponse, StageTimings, TransferDescriptor};
use tokio::sync::oneshot;
use worker::compute_loop::{self, Batcher, Events, LoopHandle, Turn};
use worker::drain::{self, InflightGuard};
use worker::{Drain, LoadedModel};

use crate::metrics::PrefillMetrics;
use crate::prefix_cache::PrefixCache;

/// Hashes of cached prefixes reported to the router.
const REPORTED_HASHES: usize = 256;

/// Why a prefill did not deliver its caches.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefillError {
    /// An abort asked for it.
    Aborted,
    /// The caller went away.
    CallerGone,
    /// The pool cannot hold the prompt even with nothing else running.
    NoBlocks(PoolError),
    Transfer(TransferError),
    /// The backend failed the batch.
    Compute(String),
    /// The device failed (this batch or another): the worker is shutting down.
    Device(String),
    NoToken,
}

impl std::fmt::Display for PrefillError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefillError::Aborted => f.write_str("aborted"),
            PrefillError::CallerGone => f.write_str("the caller went away"),
            PrefillError::NoBlocks(e) => write!(f, "prefill worker cache: {e}"),
            PrefillError::Transfer(e) => write!(f, "cache transfer: {e}"),
            PrefillError::Compute(e) => write!(f, "prefill failed: {e}"),
            PrefillError::Device(e) => f.write_str(e),
            PrefillError::NoToken => f.write_str("prefill produced no token"),
        }
    }
}

impl PrefillError {
    /// The `requests` metric label.
    fn outcome(&self) -> &'static str {
        match self {
            PrefillError::Aborted => "aborted",
            PrefillError::CallerGone => "cancelled",
            PrefillError::NoBlocks(_) => "no_blocks",
            PrefillError::Transfer(_) => "transfer_failed",
            PrefillError::Compute(_) | PrefillError::Device(_) | PrefillError::NoToken => "error",
        }
    }
}

pub type Outcome = Result<PrefillResponse, PrefillError>;

/// Where a request's outcome goes (once).
pub struct Reply(Option<oneshot::Sender<Outcome>>);

impl Reply {
    pub fn new(tx: oneshot::Sender<Outcome>) -> Self {
        Reply(Some(tx))
    }

    fn send(&mut self, outcome: Outcome) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(outcome);
        }
    }

    /// The caller went away (or was already answered).
    fn is_closed(&self) -> bool {
        self.0.as_ref().is_none_or(|tx| tx.is_closed())
    }
}

/// A prefill the service admitted, as the loop queues and runs it.
pub struct Admitted {
    pub id: String,
    /// Tokens to prefill (prompt, plus output generated before a preemption).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub descriptor: TransferDescriptor,
    pub reply: Reply,
    pub guard: InflightGuard,
    pub arrived: Instant,
}

/// What GetLoad reports.
#[derive(Debug, Clone, Default)]
pub struct Load {
    pub running: usize,
    pub queued: usize,
    pub queued_tokens: u64,
    pub cached_hashes: Vec<u64>,
}

pub struct Config {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub prefix_caching: bool,
    /// The test builds' fault knob ([`crate::fault`]); fires before the first batch.
    pub fault: Option<crate::fault::Fault>,
}

/// What helper threads report.
pub enum Event {
    /// The handshake of request `id` ended.
    Handshake { id: String, result: Result<SendSession, TransferError> },
    /// A request's transfer settled and its blocks are back in the pool.
    Settled,
}

pub struct Scheduler {
    handle: LoopHandle<Box<Admitted>, Event>,
    load: Arc<Mutex<Load>>,
}

impl Scheduler {
    /// Starts the loop; helper work (handshakes, completions) runs as blocking tasks on `runtime`. A device
    /// failure is reported to `drain`.
    pub fn start(
        model: Arc<LoadedModel>,
        sender: KvSender,
        metrics: Arc<PrefillMetrics>,
        drain: Arc<Drain>,
        config: Config,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Arc<Scheduler>> {
        let load = Arc::new(Mutex::new(Load::default()));
        let l = load.clone();
        let lockstep = model.backend.expert_parallel().is_some();
        let handle = compute_loop::spawn("prefill-loop", move |events| Prefill {
            model,
            sender,
            metrics,
            drain,
            config,
            events,
            runtime,
            waiting: VecDeque::new(),
            handshaking: Vec::new(),
            active: Vec::new(),
            settling: 0,
            cache: PrefixCache::default(),
            load: l,
            lockstep,
            failed: None,
        })?;
        Ok(Arc::new(Scheduler { handle, load }))
    }

    /// Queues a prefill; gives it back if the loop is gone.
    pub fn submit(&self, req: Admitted) -> Result<(), Box<Admitted>> {
        self.handle.submit(Box::new(req))
    }

    pub fn abort(&self, id: &str) {
        self.handle.abort(id);
    }

    pub fn load(&self) -> Load {
        self.load.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Active {
    req: Admitted,
    state: SeqState,
    /// None while the handshake runs.
    session: Option<SendSession>,
    /// The caller is already answered with this error; the request ends once its handshake returns.
    cancelled: Option<PrefillError>,
    cached_tokens: usize,
    started: Instant,
    compute: Duration,
    transfer_started: Instant,
    /// A layer put that failed (the transfer is lost; the request fails after the batch).
    error: Option<TransferError>,
}

/// What starting a queued request led to.
enum Started {
    Handshaking(Box<Active>),
    /// The pool is short; the request goes back to the queue or is refused.
    NoBlocks(Box<Admitted>, PoolError),
}

struct Prefill {
    model: Arc<LoadedModel>,
    sender: KvSender,
    metrics: Arc<PrefillMetrics>,
    drain: Arc<Drain>,
    config: Config,
    events: Events<Box<Admitted>, Event>,
    runtime: tokio::runtime::Handle,
    waiting: VecDeque<Admitted>,
    /// Reserved, waiting for the handshake.
    handshaking: Vec<Active>,
    /// Handshake done: these compute.
    active: Vec<Active>,
    /// Requests whose transfer is settling on a helper thread (their blocks are not back yet).
    settling: usize,
    cache: PrefixCache,
    load: Arc<Mutex<Load>>,
    /// A rank of an expert-parallel group: every turn is one step of the group.
    lockstep: bool,
    /// The error every request gets once the device failed.
    failed: Option<PrefillError>,
}

impl Batcher for Prefill {
    type Work = Box<Admitted>;
    type Event = Event;

    fn submit(&mut self, mut req: Box<Admitted>) {
        if let Some(err) = &self.failed {
            // Admitted just before the device failed.
            self.metrics.requests.with_label_values(&[err.outcome()]).inc();
            return req.reply.send(Err(err.clone()));
        }
        self.metrics.queued.inc();
        self.waiting.push_back(*req);
    }

    fn abort(&mut self, id: &str) {
        if let Some(i) = self.waiting.iter().position(|j| j.id == id) {
            let mut j = self.waiting.remove(i).expect("position found");
            self.metrics.queued.dec();
            self.metrics.requests.with_label_values(&["aborted"]).inc();
            j.reply.send(Err(PrefillError::Aborted));
        }
        if let Some(a) = self.handshaking.iter_mut().find(|a| a.req.id == id && a.cancelled.is_none()) {
            a.req.reply.send(Err(PrefillError::Aborted));
            a.cancelled = Some(PrefillError::Aborted);
        }
        if let Some(i) = self.active.iter().position(|a| a.req.id == id) {
            let a = self.active.remove(i);
            self.fail(a, PrefillError::Aborted);
        }
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::Handshake { id, result } => self.handshaken(&id, result),
            Event::Settled => self.settling -= 1,
        }
    }

    fn turn(&mut self) -> Turn {
        self.drop_cancelled();
        self.start_waiting();
        if self.active.is_empty() {
            // Idle, or waiting for handshakes and settling transfers: their events wake the loop.
            return Turn::Wait;
        }
        self.run_batch();
        Turn::Busy
    }

    fn lockstep(&self) -> Option<Arc<dyn engine::Backend>> {
        (self.lockstep && self.failed.is_none()).then(|| self.model.backend.clone())
    }

    fn lockstep_failed(&mut self, e: &engine::EngineError) {
        self.fail_worker(e);
    }

    fn publish(&mut self) {
        let queued_tokens: u64 = self.waiting.iter().map(|j| j.tokens.len() as u64).sum::<u64>()
            + self
                .handshaking
                .iter()
                .chain(&self.active)
                .map(|a| (a.state.prefill_len - a.state.fed) as u64)
                .sum::<u64>();
        let load = Load {
            running: self.handshaking.len() + self.active.len(),
            queued: self.waiting.len(),
            queued_tokens,
            cached_hashes: self.cache.hashes(REPORTED_HASHES),
        };
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = load;
        self.metrics.prefix_cache_blocks.set(self.cache.len() as i64);
        self.metrics.kv_blocks_free.set(self.model.pool.stats().free_blocks as i64);
    }
}

impl Prefill {
    /// Ends an active request with an error: on a helper thread, aborts its transfer (the decode side
    /// frees its blocks), then releases this side's blocks and answers.
    fn fail(&mut self, mut a: Active, err: PrefillError) {
        tracing::warn!(request_id = %a.req.id, error = %err, "prefill failed");
        self.metrics.requests.with_label_values(&[err.outcome()]).inc();
        let session = a.session.take();
        self.settle(a, move |_| {
            if let Some(s) = session {
                let _ = s.abort(&err.to_string());
            }
            Err(err)
        });
    }

    /// Runs `end` (the transfer's terminal call, which waits for the receiver) on a helper thread, then
    /// returns the request's blocks (no byte is read from them anymore), answers the caller and tells the
    /// loop.
    fn settle(&mut self, mut a: Active, end: impl FnOnce(&mut Active) -> Outcome + Send + 'static) {
        self.settling += 1;
        let (pool, metrics, events) = (self.model.pool.clone(), self.metrics.clone(), self.events.clone());
        self.runtime.spawn_blocking(move || {
            let outcome = end(&mut a);
            compute_loop::release(&pool, &a.req.id);
            metrics.running.dec();
            a.req.reply.send(outcome);
            events.send(Event::Settled);
        });
    }

    /// A handshake returned: the request starts computing, or ends.
    fn handshaken(&mut self, id: &str, result: Result<SendSession, TransferError>) {
        let Some(i) = self.handshaking.iter().position(|a| a.req.id == id) else {
            tracing::error!(request_id = %id, "a handshake returned for an unknown request");
            return;
        };
        let mut a = self.handshaking.remove(i);
        match (result, a.cancelled.take()) {
            (Ok(session), None) => {
                a.session = Some(session);
                a.transfer_started = Instant::now();
                self.active.push(a);
            }
            (Ok(session), Some(err)) => {
                self.metrics.requests.with_label_values(&[err.outcome()]).inc();
                self.settle(a, move |_| {
                    let _ = session.abort(&err.to_string());
                    Err(err)
                });
            }
            (Err(e), cancelled) => {
                if cancelled.is_none() {
                    tracing::warn!(request_id = %id, error = %e, "transfer handshake failed");
                }
                self.metrics.requests.with_label_values(&["transfer_failed"]).inc();
                self.settle(a, move |_| Err(PrefillError::Transfer(e)));
            }
        }
    }

    /// Requests whose caller went away (router cancelled) are dropped, their transfers aborted.
    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.reply.is_closed());
        for _ in self.waiting.len()..before {
            self.metrics.queued.dec();
            self.metrics.requests.with_label_values(&["cancelled"]).inc();
        }
        for a in &mut self.handshaking {
            if a.cancelled.is_none() && a.req.reply.is_closed() {
                a.cancelled = Some(PrefillError::CallerGone);
            }
        }
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].req.reply.is_closed() {
                let a = self.active.remove(i);
                self.fail(a, PrefillError::CallerGone);
            } else {
                i += 1;
            }
        }
    }

    fn start_waiting(&mut self) {
        while self.active.len() + self.handshaking.len() < self.config.max_num_seqs {
            let Some(req) = self.waiting.pop_front() else { break };
            match self.start(req) {
                Started::Handshaking(a) => {
                    self.metrics.queued.dec();
                    self.metrics.running.inc();
                    self.handshaking.push(*a);
                }
                Started::NoBlocks(req, _)
                    if !self.active.is_empty() || !self.handshaking.is_empty() || self.settling > 0 =>
                {
                    // Blocks come back when running prefills finish: wait for them.
                    self.waiting.push_front(*req);
                    break;
                }
                Started::NoBlocks(mut req, e) => {
                    self.metrics.queued.dec();
                    self.metrics.requests.with_label_values(&["no_blocks"]).inc();
                    req.reply.send(Err(PrefillError::NoBlocks(e)));
                }
            }
        }
    }

    /// Starts the handshake of `table` on a helper thread.
    fn begin(&self, id: &str, descriptor: &TransferDescriptor, table: BlockTable) {
        let (sender, events, desc, id) = (self.sender.clone(), self.events.clone(), descriptor.clone(), id.to_string());
        self.runtime.spawn_blocking(move || {
            let result = sender.begin(&desc, &table);
            // If the loop is gone the session is dropped, which aborts it.
            events.send(Event::Handshake { id, result });
        });
    }

    /// Prefix lookup, reservation, and the handshake's start.
    fn start(&mut self, req: Admitted) -> Started {
        let pool = &self.model.pool;
        let needed = CacheGeometry::blocks_for(req.tokens.len());
        if pool.stats().free_blocks < needed {
            self.cache.evict_until(pool, needed);
        }
        let hashes = prefix_hashes(&req.tokens);
        let hit = if self.config.prefix_caching {
            // Cached blocks hold prefill-form caches: a continuation reuses them for its prompt only (its
            // generated tokens are replayed in the decode form, see engine::generate::prefill).
            let limit = ((req.tokens.len() - 1) / BLOCK_SIZE).min(req.prompt_len / BLOCK_SIZE);
            self.cache.lookup(&hashes, &req.tokens, limit)
        } else {
            Vec::new()
        };
        let table = match pool.reserve_with_prefix(&req.id, &hit, req.tokens.len()) {
            Ok(t) => t,
            Err(e) => return Started::NoBlocks(Box::new(req), e),
        };
        let cached_tokens = hit.len() * BLOCK_SIZE;
        let started = Instant::now();
        self.metrics.queue_seconds.observe(req.arrived.elapsed().as_secs_f64());
        self.begin(&req.id, &req.descriptor, table.clone());
        let mut state = SeqState::continuing(req.tokens.clone(), req.prompt_len, req.params.clone(), table.blocks);
        state.fed = cached_tokens;
        self.metrics.prompt_tokens.inc_by(req.tokens.len() as u64);
        self.metrics.cached_tokens.inc_by(cached_tokens as u64);
        tracing::info!(request_id = %req.id, tokens = req.tokens.len(), cached_tokens, "prefill started");
        Started::Handshaking(Box::new(Active {
            req,
            state,
            session: None,
            cancelled: None,
            cached_tokens,
            started,
            compute: Duration::ZERO,
            transfer_started: Instant::now(),
            error: None,
        }))
    }

    fn run_batch(&mut self) {
        let mut budget = self.config.max_num_batched_tokens.max(1);
        let mut chunks = Vec::new();
        for a in &self.active {
            let left = a.state.prefill_chunk_max();
            if budget == 0 || left == 0 {
                break;
            }
            let c = left.min(budget);
            chunks.push(c);
            budget -= c;
        }
        let n = chunks.len();
        if n == 0 {
            return;
        }
        if let Some(f) = self.config.fault.take() {
            let ids: Vec<&str> = self.active[..n].iter().map(|a| a.req.id.as_str()).collect();
            f.fire(&ids);
        }
        let finishing: Vec<bool> =
            self.active[..n].iter().zip(&chunks).map(|(a, &c)| a.state.fed + c == a.state.prefill_len).collect();
        let tokens: usize = chunks.iter().sum();
        let t0 = Instant::now();
        let result = {
            let (batch, _) = self.active.split_at_mut(n);
            let mut states: Vec<&mut SeqState> = Vec::with_capacity(n);
            let mut ships: Vec<(Option<&SendSession>, &mut Option<TransferError>)> = Vec::with_capacity(n);
            for (a, fin) in batch.iter_mut().zip(&finishing) {
                states.push(&mut a.state);
                ships.push((if *fin { a.session.as_ref() } else { None }, &mut a.error));
            }
            let mut on_layer = |l: LayerIdx, ready: engine::LayerReady| {
                for (session, err) in ships.iter_mut() {
                    if let (Some(s), None) = (session, &**err)
                        && let Err(e) = s.put_layer_when(l, ready.clone())
                    {
                        **err = Some(e);
                    }
                }
            };
            generate::prefill(self.model.backend.as_ref(), &self.model.cache, &mut states, &chunks, &mut on_layer)
        };
        let elapsed = t0.elapsed();
        self.metrics.batch_seconds.observe(elapsed.as_secs_f64());
        self.metrics.batch_tokens.observe(tokens as f64);
        self.metrics.computed_tokens.inc_by(tokens as u64);
        let outputs = match result {
            Ok(o) => o,
            Err(e) if drain::is_fatal(&e) => return self.fail_worker(&e),
            Err(e) => {
                let failed: Vec<Active> = self.active.drain(..n).collect();
                for a in failed {
                    self.fail(a, PrefillError::Compute(e.to_string()));
                }
                return;
            }
        };
        for a in &mut self.active[..n] {
            a.compute += elapsed;
        }
        // Finish the requests whose prompt completed, last first so indexes stay valid.
        for i in (0..n).rev() {
            if !finishing[i] {
                continue;
            }
            let a = self.active.remove(i);
            let out = &outputs[i];
            self.finish(a, out.tokens.first().cloned());
        }
    }

    /// The device is unusable: every request ends with the error (computing ones abort their transfers,
    /// so the decode side frees its blocks, and release theirs), later ones too, and the worker
    /// deregisters and exits.
    fn fail_worker(&mut self, e: &engine::EngineError) {
        let what = if matches!(e, engine::EngineError::GroupDown(_)) { "group failure" } else { "device failure" };
        let reason = format!("{what} in a prefill batch: {e}");
        let requests = self.waiting.len() + self.handshaking.len() + self.active.len();
        tracing::error!(%reason, requests, "failing every request; the worker stops");
        let err = PrefillError::Device(drain::failed_request_error(&reason));
        // First: the worker refuses new work and starts deregistering while the requests end; the other
        // ranks of its expert-parallel group, if any, are told at once.
        self.model.backend.leave_group(&reason);
        self.drain.fail(reason);
        for a in std::mem::take(&mut self.active) {
            self.fail(a, err.clone());
        }
        // Their handshakes still return; the requests settle then.
        for a in self.handshaking.iter_mut().filter(|a| a.cancelled.is_none()) {
            a.req.reply.send(Err(err.clone()));
            a.cancelled = Some(err.clone());
        }
        for mut req in std::mem::take(&mut self.waiting) {
            self.metrics.queued.dec();
            self.metrics.requests.with_label_values(&[err.outcome()]).inc();
            req.reply.send(Err(err.clone()));
        }
        self.failed = Some(err);
    }

    fn finish(&mut self, mut a: Active, first: Option<engine::sampling::Sampled>) {
        if let Some(e) = a.error.take() {
            return self.fail(a, PrefillError::Transfer(e));
        }
        let Some(first) = first else {
            return self.fail(a, PrefillError::NoToken);
        };
        if self.config.prefix_caching {
            // Prompt blocks only: a continuation's generated tokens were computed in the decode form.
            let prefilled = &a.state.tokens[..a.state.prompt_len];
            self.cache.insert(&self.model.pool, &prefix_hashes(prefilled), &a.state.blocks, &a.state.tokens);
        }
        let with_lp = a.state.params.logprobs.is_some();
        let first_token = worker::convert::generated_token(&first, with_lp);
        let Some(session) = a.session.take() else {
            return self.fail(a, PrefillError::Compute("a computed request has no transfer session".into()));
        };
        let metrics = self.metrics.clone();
        self.settle(a, move |a| deliver(a, session, first_token, &metrics));
    }
}

/// On a helper thread: completes the transfer (or releases the decode side when prefill finished the
/// request) and builds the answer.
fn deliver(a: &mut Active, session: SendSession, first_token: GeneratedToken, metrics: &PrefillMetrics) -> Outcome {
    let mut timings = StageTimings {
        prefill_queue_us: a.started.duration_since(a.req.arrived).as_micros() as u64,
        prefill_us: a.compute.as_micros() as u64,
        cached_tokens: a.cached_tokens as u32,
        ..Default::default()
    };
    let (finished, reason, result) = match a.state.finished {
        Some(f) => {
            let reason = worker::convert::finish_reason(f);
            (true, reason, session.release(first_token.clone(), reason).map(|_| None))
        }
        None => {
            let draft = a.state.draft.map(|d| MtpDraft { token_id: d, prob: a.state.draft_prob });
            (false, FinishReason::Unspecified, session.complete(first_token.clone(), draft).map(Some))
        }
    };
    match result {
        Ok(report) => {
            if let Some(r) = report {
                timings.transfer_us = r.elapsed.as_micros() as u64;
                timings.transfer_bytes = r.bytes;
                metrics.transfer_bytes.inc_by(r.bytes);
            }
            metrics.transfer_seconds.observe(a.transfer_started.elapsed().as_secs_f64());
            metrics.requests.with_label_values(&[if finished { "finished" } else { "shipped" }]).inc();
            tracing::info!(
                request_id = %a.req.id, prefill_us = timings.prefill_us, transfer_us = timings.transfer_us,
                bytes = timings.transfer_bytes, finished, "prefill done"
            );
            Ok(PrefillResponse {
                first_token: Some(first_token),
                finished,
                finish_reason: reason as i32,
                timings: Some(timings),
            })
        }
        Err(e) => {
            metrics.requests.with_label_values(&["transfer_failed"]).inc();
            tracing::warn!(request_id = %a.req.id, error = %e, "transfer failed at completion");
            Err(PrefillError::Transfer(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use engine::cache::{BlockPool, KvCache};
    use kv_transfer::{
        ExpectRequest, KvReceiver, PendingTransfer, ReceiverConfig, SenderConfig, TransferOutcome, TransportConfig,
        TransportKind,
    };
    use worker::fake_backend::{Failure, FakeBackend};

    use super::*;

    /// A prefill loop on the fake backend, shipping in-process into a decode-side pool.
    struct Env {
        fake: Arc<FakeBackend>,
        model: Arc<LoadedModel>,
        sched: Arc<Scheduler>,
        receiver: KvReceiver,
        rcache: Arc<KvCache>,
        rpool: Arc<BlockPool>,
        drain: Arc<Drain>,
    }

    fn env(blocks: usize, prefix_caching: bool) -> Env {
        env_with_seqs(blocks, prefix_caching, 8)
    }

    fn env_with_seqs(blocks: usize, prefix_caching: bool, max_num_seqs: usize) -> Env {
        env_on(FakeBackend::new(1280), blocks, prefix_caching, max_num_seqs)
    }

    fn env_on(fake: Arc<FakeBackend>, blocks: usize, prefix_caching: bool, max_num_seqs: usize) -> Env {
        let model = Arc::new(LoadedModel::from_backend(fake.clone(), blocks, "fake").unwrap());
        let geometry = *model.cache.geometry();
        let rcache = Arc::new(KvCache::new_host(CacheGeometry { num_blocks: 64, ..geometry }).unwrap());
        let rpool = Arc::new(BlockPool::new(64));
        let receiver = KvReceiver::start(
            ReceiverConfig::new(TransportConfig::InProc),
            rcache.clone(),
            rpool.clone(),
            model.fingerprint.clone(),
        )
        .unwrap();
        let sender = KvSender::new(
            SenderConfig { transports: vec![TransportKind::InProc], ..SenderConfig::default() },
            model.cache.clone(),
            model.fingerprint.clone(),
        )
        .unwrap();
        let metrics = Arc::new(PrefillMetrics::new(&prometheus::Registry::new()).unwrap());
        let config = Config { max_num_seqs, max_num_batched_tokens: 96, prefix_caching, fault: None };
        let drain = Drain::new();
        let runtime = tokio::runtime::Handle::current();
        let sched = Scheduler::start(model.clone(), sender, metrics, drain.clone(), config, runtime).unwrap();
        Env { fake, model, sched, receiver, rcache, rpool, drain }
    }

    fn prompt(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| 7 + (i * 11 + salt * 101) % 1200).collect()
    }

    /// Reserves decode-side blocks, expects the transfer, submits the prefill.
    fn submit(e: &Env, id: &str, tokens: &[u32]) -> (oneshot::Receiver<Outcome>, PendingTransfer, BlockTable) {
        submit_with(e, id, tokens, e.drain.admit().unwrap())
    }

    /// `submit` for a request the service admitted earlier (`guard`).
    fn submit_with(
        e: &Env,
        id: &str,
        tokens: &[u32],
        guard: InflightGuard,
    ) -> (oneshot::Receiver<Outcome>, PendingTransfer, BlockTable) {
        let dst = e.rpool.reserve(id, tokens.len() + 2).unwrap();
        let (descriptor, pending) = e
            .receiver
            .expect(ExpectRequest {
                request_id: id.into(),
                blocks: dst.clone(),
                num_tokens: tokens.len(),
                timeout: Duration::from_secs(10),
                verify_checksum: false,
            })
            .unwrap();
        let (tx, rx) = oneshot::channel();
        let req = Admitted {
            id: id.into(),
            tokens: tokens.to_vec(),
            prompt_len: tokens.len(),
            params: SamplingParams { ignore_eos: true, ..SamplingParams::greedy(16) },
            descriptor,
            reply: Reply::new(tx),
            guard,
            arrived: Instant::now(),
        };
        assert!(e.sched.submit(req).is_ok());
        (rx, pending, dst)
    }

    async fn outcome(rx: oneshot::Receiver<Outcome>) -> Outcome {
        tokio::time::timeout(Duration::from_secs(20), rx).await.expect("answered in time").expect("answered")
    }

    async fn wait_pool_used(pool: &BlockPool, used: usize) {
        for _ in 0..1000 {
            if pool.stats().used_blocks == used {
                pool.check_invariants().unwrap();
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("pool holds {:?}, want {used} used", pool.stats());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunked_prefills_ship_every_layer_and_deliver_first_token_and_draft() {
        let e = env(32, false);
        let prompts = [prompt(200, 1), prompt(70, 2), prompt(5, 3)];
        let mut runs = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            runs.push(submit(&e, &format!("r{i}"), p));
        }
        for ((rx, pending, dst), p) in runs.into_iter().zip(&prompts) {
            let resp = outcome(rx).await.expect("delivered");
            let first = e.fake.next(p[p.len() - 1], p.len() - 1);
            assert_eq!(resp.first_token.as_ref().unwrap().token_id, first);
            assert!(!resp.finished);
            let done = tokio::time::timeout(Duration::from_secs(10), pending).await.unwrap().unwrap();
            let TransferOutcome::Completed(c) = done else { panic!("{done:?}") };
            assert_eq!(c.draft.map(|d| d.token_id), Some(e.fake.next(first, p.len())), "the MTP draft");
            // Every served layer landed: decoder layers hold each position's token, the MTP layer the next.
            let host = e.rcache.host().unwrap();
            let layers = e.model.cache.geometry().num_layers;
            for l in 0..layers {
                for pos in 0..p.len() {
                    let t = if l + 1 == layers { p.get(pos + 1).copied().unwrap_or(first) } else { p[pos] };
                    let (b, slot) = dst.slot(pos).unwrap();
                    // SAFETY: the transfer completed; nothing writes the decode-side pool now.
                    let entry = unsafe { host.latent_entry(LayerIdx(l as u32), b, slot) };
                    assert!(entry.iter().all(|&x| x == FakeBackend::cache_byte(l, pos, t)), "layer {l} pos {pos}");
                }
            }
        }
        // Prefill-side blocks come back once each transfer settled.
        wait_pool_used(&e.model.pool, 0).await;
        assert_eq!(e.sched.load().running, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_expert_parallel_rank_joins_every_pass_of_a_busy_ones_prefill() {
        use worker::fake_backend::Agreement;
        let g = worker::fake_backend::FakeGroup::new(2, Duration::from_secs(5));
        let ranks: Vec<Env> = (0..2).map(|r| env_on(FakeBackend::ep_rank(1280, &g, r), 32, false, 8)).collect();
        // Four chunks of the 96-token budget on rank 0; rank 1 has nothing to do.
        let p = prompt(300, 5);
        let (rx, pending, _) = submit(&ranks[0], "r0", &p);
        let resp = outcome(rx).await.expect("delivered");
        assert_eq!(resp.first_token.unwrap().token_id, ranks[0].fake.next(p[p.len() - 1], p.len() - 1));
        let done = tokio::time::timeout(Duration::from_secs(10), pending).await.unwrap().unwrap();
        assert!(matches!(done, TransferOutcome::Completed(_)), "{done:?}");
        let (a, b) = (g.log(0), g.log(1));
        // One agreement a step (the step's shape): rank 0's four chunks in the prefill-form pass, rank 1 empty.
        assert!(a.iter().chain(&b).all(|x| x.0 == Agreement::Step), "{a:?}");
        let prefilled: usize = a.iter().map(|x| x.1[1]).sum();
        assert_eq!(prefilled, 300, "rank 0's chunks");
        assert_eq!(a.iter().filter(|x| x.1[1] > 0).count(), 4, "{a:?}");
        assert!(b.iter().all(|x| x.1 == [0; 3]), "rank 1 brought no rows");
        wait_pool_used(&ranks[0].model.pool, 0).await;
        // Idle ranks poll the group instead of spinning: one agreement per LOCKSTEP_POLL.
        let before = g.log(0).len();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let polled = g.log(0).len() - before;
        // About 100 at 2 ms a poll; a loop that spun would agree tens of thousands of times, one that waited
        // IDLE_WAIT once.
        assert!((10..1_000).contains(&polled), "{polled} agreements in 200 ms of idling");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abort_fails_the_prefill_aborts_the_transfer_and_frees_both_sides() {
        let e = env(32, false);
        // 16 chunks of the 96-token budget at 10 ms per backend call: abort once it computes.
        e.fake.delay_us.store(10_000, std::sync::atomic::Ordering::SeqCst);
        let (rx, pending, _) = submit(&e, "gone", &prompt(1500, 4));
        while e.fake.calls.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        e.sched.abort("gone");
        assert_eq!(outcome(rx).await.unwrap_err(), PrefillError::Aborted);
        let r = tokio::time::timeout(Duration::from_secs(10), pending).await.unwrap();
        assert!(r.is_err(), "the decode side hears of the abort: {r:?}");
        wait_pool_used(&e.model.pool, 0).await;
        wait_pool_used(&e.rpool, 0).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_non_device_backend_error_is_a_compute_error_frees_both_sides_and_the_worker_goes_on() {
        let e = env(32, false);
        e.fake.fail_next(Failure::InvalidInput);
        let (rx, pending, _) = submit(&e, "doomed", &prompt(40, 5));
        let err = outcome(rx).await.unwrap_err();
        assert!(matches!(&err, PrefillError::Compute(m) if m.contains("injected failure")), "{err:?}");
        assert!(tokio::time::timeout(Duration::from_secs(10), pending).await.unwrap().is_err());
        wait_pool_used(&e.model.pool, 0).await;
        wait_pool_used(&e.rpool, 0).await;
        assert_eq!(e.drain.failure(), None, "the worker did not fail");
        assert!(!e.drain.is_draining());
        // The loop goes on serving.
        let (rx, _, _) = submit(&e, "after", &prompt(40, 6));
        assert!(outcome(rx).await.is_ok());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_device_failure_fails_every_request_frees_both_sides_and_fails_the_worker() {
        // One request at a time: "computing" runs (16 chunks, 10 ms each), "queued" waits behind it.
        let e = env_with_seqs(32, false, 1);
        e.fake.delay_us.store(10_000, std::sync::atomic::Ordering::SeqCst);
        let (computing, computing_pending, _) = submit(&e, "computing", &prompt(1500, 11));
        while e.fake.calls.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let (queued, queued_pending, _) = submit(&e, "queued", &prompt(40, 12));
        // Admitted by the service now; it reaches the loop after the failure.
        let late_guard = e.drain.admit().unwrap();
        e.fake.fail_next(Failure::Device);
        for rx in [computing, queued] {
            let err = outcome(rx).await.unwrap_err();
            assert!(matches!(&err, PrefillError::Device(_)), "{err:?}");
            let msg = err.to_string();
            assert!(msg.contains("device failure") && msg.contains("injected device failure"), "{msg}");
            assert_eq!(crate::service::status(&err).code(), tonic::Code::Unavailable, "another worker can serve it");
        }
        let r = tokio::time::timeout(Duration::from_secs(10), computing_pending).await.unwrap();
        assert!(r.is_err(), "the decode side hears of the abort: {r:?}");
        // The queued one never began its transfer: its decode side is aborted by the router.
        queued_pending.abort("prefill failed");
        wait_pool_used(&e.model.pool, 0).await;
        wait_pool_used(&e.rpool, 0).await;
        let reason = e.drain.failure().expect("the worker failed");
        assert!(reason.contains("injected device failure"), "{reason}");

        let calls = e.fake.calls.load(std::sync::atomic::Ordering::SeqCst);
        let (late, late_pending, _) = submit_with(&e, "late", &prompt(40, 13), late_guard);
        assert!(matches!(outcome(late).await.unwrap_err(), PrefillError::Device(_)));
        late_pending.abort("prefill failed");
        assert_eq!(e.fake.calls.load(std::sync::atomic::Ordering::SeqCst), calls, "the device is not touched");
        wait_pool_used(&e.rpool, 0).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_prompt_larger_than_the_idle_pool_is_refused_with_no_blocks() {
        let e = env(2, false);
        let (rx, _, _) = submit(&e, "huge", &prompt(3 * 64, 7));
        assert!(matches!(outcome(rx).await.unwrap_err(), PrefillError::NoBlocks(_)));
        assert_eq!(e.model.pool.stats().used_blocks, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_request_waits_for_blocks_a_settling_transfer_returns() {
        // Two blocks: the second request fits only once the first one's transfer settled.
        let e = env(2, false);
        let (a, _, _) = submit(&e, "a", &prompt(100, 8));
        let (b, _, _) = submit(&e, "b", &prompt(100, 9));
        assert!(outcome(a).await.is_ok());
        assert!(outcome(b).await.is_ok(), "b waited instead of being refused");
        wait_pool_used(&e.model.pool, 0).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prefix_cache_hits_skip_cached_blocks_and_ship_the_same_bytes() {
        let e = env(32, true);
        let p = prompt(200, 10);
        let (rx, pending, _) = submit(&e, "first", &p);
        outcome(rx).await.unwrap();
        pending.await.unwrap();
        let calls = e.fake.calls.load(std::sync::atomic::Ordering::SeqCst);
        let (rx, pending, _) = submit(&e, "second", &p);
        let resp = outcome(rx).await.unwrap();
        assert_eq!(resp.timings.unwrap().cached_tokens, 192);
        assert!(matches!(pending.await.unwrap(), TransferOutcome::Completed(_)));
        assert!(e.fake.calls.load(std::sync::atomic::Ordering::SeqCst) > calls);
        // The cache keeps its own blocks; the requests hold none.
        wait_pool_used(&e.model.pool, 3).await;
    }
}
