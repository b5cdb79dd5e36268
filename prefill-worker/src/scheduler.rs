//! The prefill loop, on its own thread: start queued requests (prefix-cache lookup, block reservation,
//! kv-transfer handshake), run batches under the token budget (long prompts go in chunks), ship every
//! layer of a request as soon as its last chunk computed it, then complete the transfer with the first
//! token and the MTP draft (or release the decode side when prefill already finished the request).

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster::prefix_hash::prefix_hashes;
use engine::cache::{BLOCK_SIZE, CacheGeometry, LayerIdx, PoolError};
use engine::generate::{self, SeqState};
use engine::sampling::SamplingParams;
use kv_transfer::{KvSender, SendSession, TransferError};
use proto::v1::{FinishReason, MtpDraft, PrefillResponse, StageTimings, TransferDescriptor};
use tokio::sync::oneshot;
use tonic::Status;
use worker::LoadedModel;
use worker::drain::InflightGuard;

use crate::metrics::PrefillMetrics;
use crate::prefix_cache::PrefixCache;

/// Hashes of cached prefixes reported to the router.
const REPORTED_HASHES: usize = 256;

pub struct Job {
    pub id: String,
    /// Tokens to prefill (prompt, plus output generated before a preemption).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub descriptor: TransferDescriptor,
    pub reply: oneshot::Sender<Result<PrefillResponse, Status>>,
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
}

enum Cmd {
    Job(Box<Job>),
    Abort(String),
}

pub struct Scheduler {
    tx: mpsc::Sender<Cmd>,
    load: Arc<Mutex<Load>>,
}

impl Scheduler {
    pub fn start(
        model: Arc<LoadedModel>,
        sender: KvSender,
        metrics: Arc<PrefillMetrics>,
        config: Config,
    ) -> Arc<Scheduler> {
        let (tx, rx) = mpsc::channel();
        let load = Arc::new(Mutex::new(Load::default()));
        let l = Loop {
            model,
            sender,
            metrics,
            config,
            rx,
            waiting: VecDeque::new(),
            active: Vec::new(),
            cache: PrefixCache::default(),
            load: load.clone(),
        };
        std::thread::Builder::new()
            .name("prefill-loop".into())
            .spawn(move || l.run())
            .expect("spawning the prefill loop");
        Arc::new(Scheduler { tx, load })
    }

    /// Queues a prefill; gives the job back if the loop is gone.
    pub fn submit(&self, job: Job) -> Result<(), Box<Job>> {
        self.tx.send(Cmd::Job(Box::new(job))).map_err(|e| match e.0 {
            Cmd::Job(j) => j,
            Cmd::Abort(_) => unreachable!("sent a Job"),
        })
    }

    pub fn abort(&self, id: &str) {
        let _ = self.tx.send(Cmd::Abort(id.to_string()));
    }

    pub fn load(&self) -> Load {
        self.load.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Active {
    job: Job,
    state: SeqState,
    session: Option<SendSession>,
    cached_tokens: usize,
    started: Instant,
    compute: Duration,
    transfer_started: Instant,
    /// A layer put that failed (the transfer is lost; the request fails after the batch).
    error: Option<TransferError>,
}

/// What starting a queued request led to.
enum Started {
    Active(Box<Active>),
    /// The pool is short; the job goes back to the queue or is refused.
    NoBlocks(Box<Job>, PoolError),
    /// Failed and already answered (handshake refused).
    Answered,
}

struct Loop {
    model: Arc<LoadedModel>,
    sender: KvSender,
    metrics: Arc<PrefillMetrics>,
    config: Config,
    rx: mpsc::Receiver<Cmd>,
    waiting: VecDeque<Job>,
    active: Vec<Active>,
    cache: PrefixCache,
    load: Arc<Mutex<Load>>,
}

/// The gRPC status for a transfer that failed on this side.
fn transfer_status(e: &TransferError) -> Status {
    let msg = format!("cache transfer: {e}");
    match e {
        TransferError::BadDescriptor { .. } => Status::invalid_argument(msg),
        TransferError::FingerprintMismatch(_) => Status::failed_precondition(msg),
        TransferError::DeadlineExceeded(_) => Status::deadline_exceeded(msg),
        TransferError::Aborted { .. } => Status::cancelled(msg),
        TransferError::Rejected { .. } | TransferError::BadCompletion { .. } => Status::failed_precondition(msg),
        _ => Status::unavailable(msg),
    }
}

impl Loop {
    fn run(mut self) {
        loop {
            if self.waiting.is_empty() && self.active.is_empty() {
                match self.rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.publish();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.drop_cancelled();
            self.start_waiting();
            if !self.active.is_empty() {
                self.run_batch();
            }
            self.publish();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Job(j) => {
                self.metrics.queued.inc();
                self.waiting.push_back(*j);
            }
            Cmd::Abort(id) => {
                if let Some(i) = self.waiting.iter().position(|j| j.id == id) {
                    let j = self.waiting.remove(i).expect("position found");
                    self.metrics.queued.dec();
                    let _ = j.reply.send(Err(Status::cancelled("aborted")));
                }
                if let Some(i) = self.active.iter().position(|a| a.job.id == id) {
                    let a = self.active.remove(i);
                    self.fail(a, Status::cancelled("aborted"), "aborted");
                }
            }
        }
    }

    /// Ends an active request with an error: aborts its transfer (the decode side frees its blocks) and
    /// releases this side's blocks.
    fn fail(&self, mut a: Active, status: Status, outcome: &str) {
        if let Some(s) = a.session.take() {
            let _ = s.abort(status.message());
        }
        self.release(&a.job.id);
        self.metrics.running.dec();
        self.metrics.requests.with_label_values(&[outcome]).inc();
        tracing::warn!(request_id = %a.job.id, status = %status.message(), "prefill failed");
        let _ = a.job.reply.send(Err(status));
    }

    fn release(&self, id: &str) {
        if let Err(e) = self.model.pool.release(id) {
            tracing::error!(request_id = %id, error = %e, "releasing prefill blocks");
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
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.reply.is_closed() {
                let a = self.active.remove(i);
                self.fail(a, Status::cancelled("the caller went away"), "cancelled");
            } else {
                i += 1;
            }
        }
    }

    fn start_waiting(&mut self) {
        while self.active.len() < self.config.max_num_seqs {
            let Some(job) = self.waiting.pop_front() else { break };
            match self.start(job) {
                Started::Active(a) => {
                    self.metrics.queued.dec();
                    self.metrics.running.inc();
                    self.active.push(*a);
                }
                Started::NoBlocks(job, _) if !self.active.is_empty() => {
                    // Blocks come back when running prefills finish: wait for them.
                    self.waiting.push_front(*job);
                    break;
                }
                Started::NoBlocks(job, e) => {
                    self.metrics.queued.dec();
                    self.metrics.requests.with_label_values(&["no_blocks"]).inc();
                    let _ = job.reply.send(Err(Status::resource_exhausted(format!("prefill worker cache: {e}"))));
                }
                Started::Answered => self.metrics.queued.dec(),
            }
        }
    }

    /// Prefix lookup, reservation and handshake.
    fn start(&mut self, job: Job) -> Started {
        let pool = &self.model.pool;
        let needed = CacheGeometry::blocks_for(job.tokens.len());
        if pool.stats().free_blocks < needed {
            self.cache.evict_until(pool, needed);
        }
        let hashes = prefix_hashes(&job.tokens);
        let hit = if self.config.prefix_caching {
            // Cached blocks hold prefill-form caches: a continuation reuses them for its prompt only (its
            // generated tokens are replayed in the decode form, see engine::generate::prefill).
            let limit = ((job.tokens.len() - 1) / BLOCK_SIZE).min(job.prompt_len / BLOCK_SIZE);
            self.cache.lookup(&hashes, &job.tokens, limit)
        } else {
            Vec::new()
        };
        let table = match pool.reserve_with_prefix(&job.id, &hit, job.tokens.len()) {
            Ok(t) => t,
            Err(e) => return Started::NoBlocks(Box::new(job), e),
        };
        let cached_tokens = hit.len() * BLOCK_SIZE;
        let started = Instant::now();
        self.metrics.queue_seconds.observe(job.arrived.elapsed().as_secs_f64());
        let session = match self.sender.begin(&job.descriptor, &table) {
            Ok(s) => s,
            Err(e) => {
                self.release(&job.id);
                self.metrics.requests.with_label_values(&["transfer_failed"]).inc();
                tracing::warn!(request_id = %job.id, error = %e, "transfer handshake failed");
                let _ = job.reply.send(Err(transfer_status(&e)));
                return Started::Answered;
            }
        };
        let mut state = SeqState::continuing(job.tokens.clone(), job.prompt_len, job.params.clone(), table.blocks);
        state.fed = cached_tokens;
        self.metrics.prompt_tokens.inc_by(job.tokens.len() as u64);
        self.metrics.cached_tokens.inc_by(cached_tokens as u64);
        tracing::info!(request_id = %job.id, tokens = job.tokens.len(), cached_tokens, "prefill started");
        Started::Active(Box::new(Active {
            job,
            state,
            session: Some(session),
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
            Err(e) => {
                let failed: Vec<Active> = self.active.drain(..n).collect();
                for a in failed {
                    self.fail(a, Status::internal(format!("prefill failed: {e}")), "error");
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

    fn finish(&mut self, mut a: Active, first: Option<engine::sampling::Sampled>) {
        if let Some(e) = a.error.take() {
            let status = transfer_status(&e);
            return self.fail(a, status, "transfer_failed");
        }
        let Some(first) = first else {
            return self.fail(a, Status::internal("prefill produced no token"), "error");
        };
        if self.config.prefix_caching {
            // Prompt blocks only: a continuation's generated tokens were computed in the decode form.
            let prefilled = &a.state.tokens[..a.state.prompt_len];
            self.cache.insert(&self.model.pool, &prefix_hashes(prefilled), &a.state.blocks, &a.state.tokens);
        }
        let with_lp = a.state.params.logprobs.is_some();
        let first_token = worker::convert::generated_token(&first, with_lp);
        let session = a.session.take().expect("an active request has a session");
        let mut timings = StageTimings {
            prefill_queue_us: a.started.duration_since(a.job.arrived).as_micros() as u64,
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
        self.release(&a.job.id);
        self.metrics.running.dec();
        match result {
            Ok(report) => {
                if let Some(r) = report {
                    timings.transfer_us = r.elapsed.as_micros() as u64;
                    timings.transfer_bytes = r.bytes;
                    self.metrics.transfer_bytes.inc_by(r.bytes);
                }
                self.metrics.transfer_seconds.observe(a.transfer_started.elapsed().as_secs_f64());
                self.metrics.requests.with_label_values(&[if finished { "finished" } else { "shipped" }]).inc();
                tracing::info!(
                    request_id = %a.job.id, prefill_us = timings.prefill_us, transfer_us = timings.transfer_us,
                    bytes = timings.transfer_bytes, finished, "prefill done"
                );
                let _ = a.job.reply.send(Ok(PrefillResponse {
                    first_token: Some(first_token),
                    finished,
                    finish_reason: reason as i32,
                    timings: Some(timings),
                }));
            }
            Err(e) => {
                self.metrics.requests.with_label_values(&["transfer_failed"]).inc();
                tracing::warn!(request_id = %a.job.id, error = %e, "transfer failed at completion");
                let _ = a.job.reply.send(Err(transfer_status(&e)));
            }
        }
    }

    fn publish(&mut self) {
        let queued_tokens: u64 = self.waiting.iter().map(|j| j.tokens.len() as u64).sum::<u64>()
            + self.active.iter().map(|a| (a.state.prefill_len - a.state.fed) as u64).sum::<u64>();
        let load = Load {
            running: self.active.len(),
            queued: self.waiting.len(),
            queued_tokens,
            cached_hashes: self.cache.hashes(REPORTED_HASHES),
        };
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = load;
        self.metrics.prefix_cache_blocks.set(self.cache.len() as i64);
        self.metrics.kv_blocks_free.set(self.model.pool.stats().free_blocks as i64);
    }
}
