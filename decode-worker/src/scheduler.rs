//! The decode batcher on the shared compute loop ([`worker::compute_loop`]; compute never runs on the
//! async runtime): admit requests whose caches arrived, make room for the next positions (growing by a
//! block, or preempting the newest request when the pool is exhausted), run one batched decode step with
//! MTP verification, stream the tokens, and retire finished, aborted or disconnected requests, releasing
//! their blocks. It streams domain events (`DecodeEvent`); the service wraps them for gRPC. A device
//! failure ends every request and fails the worker ([`worker::Drain::fail`]): nothing decodes anymore.
//! Under expert parallelism every turn ends the group's step ([`Batcher::lockstep`]); when the
//! group fails because of another rank, the requests are preempted instead (the router continues them on
//! another decode worker, as after any preemption), and the worker exits to be restarted with its group.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use engine::generate::{self, SeqState};
use proto::v1::decode_event::Event;
use proto::v1::{DecodeEvent, FinishReason, Finished, GeneratedToken, Preempted, StageTimings, Tokens};
use worker::compute_loop::{self, Batcher, LoopHandle, Turn};
use worker::drain::{self, InflightGuard};
use worker::{Drain, LoadedModel};

use crate::metrics::DecodeMetrics;

pub type EventTx = tokio::sync::mpsc::UnboundedSender<DecodeEvent>;

/// Counts a request as holding blocks (for admission) until dropped with the request.
pub struct Holding(pub Arc<AtomicUsize>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request whose caches arrived, ready to join the batch.
pub struct Admitted {
    pub id: String,
    pub state: SeqState,
    /// The prefill worker's first token, streamed first.
    pub first: GeneratedToken,
    pub events: EventTx,
    pub guard: InflightGuard,
    pub hold: Holding,
    pub timings: StageTimings,
    pub completed_at: Instant,
}

pub struct Scheduler {
    handle: LoopHandle<Box<Admitted>, ()>,
    running: Arc<AtomicUsize>,
}

struct Running {
    a: Admitted,
    stepped: bool,
}

fn event(e: Event) -> DecodeEvent {
    DecodeEvent { event: Some(e) }
}

impl Scheduler {
    /// Starts the loop; a device failure is reported to `drain`.
    pub fn start(
        model: Arc<LoadedModel>,
        metrics: Arc<DecodeMetrics>,
        drain: Arc<Drain>,
        speculate: bool,
        max_batch: usize,
    ) -> std::io::Result<Arc<Scheduler>> {
        let running = Arc::new(AtomicUsize::new(0));
        let count = running.clone();
        let model_lockstep = model.backend.expert_parallel().is_some();
        let handle = compute_loop::spawn("decode-loop", move |_events| Decode {
            model,
            metrics,
            drain,
            speculate,
            max_batch: max_batch.max(1),
            running: Vec::new(),
            count,
            lockstep: model_lockstep,
            failed: None,
        })?;
        Ok(Arc::new(Scheduler { handle, running }))
    }

    /// Hands a request to the loop; gives it back if the loop is gone.
    pub fn admit(&self, a: Admitted) -> Result<(), Box<Admitted>> {
        self.handle.submit(Box::new(a))
    }

    pub fn abort(&self, id: &str) {
        self.handle.abort(id);
    }

    /// Requests in the decode batch.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
}

struct Decode {
    model: Arc<LoadedModel>,
    metrics: Arc<DecodeMetrics>,
    drain: Arc<Drain>,
    speculate: bool,
    max_batch: usize,
    running: Vec<Running>,
    count: Arc<AtomicUsize>,
    /// A rank of an expert-parallel group: every turn is one step of the group.
    lockstep: bool,
    /// How every request ends once the device (or the group) failed.
    failed: Option<Ending>,
}

/// How a worker failure ends a request.
#[derive(Clone)]
enum Ending {
    /// With this error (this worker's device failed).
    Error(String),
    /// Preempted with this reason: the request is not at fault and this device works (another rank of the
    /// expert-parallel group failed), so the router continues it elsewhere.
    Preempt(String),
}

impl Batcher for Decode {
    type Work = Box<Admitted>;
    type Event = ();

    fn submit(&mut self, a: Box<Admitted>) {
        self.admit(*a);
    }

    fn abort(&mut self, id: &str) {
        if let Some(i) = self.running.iter().position(|r| r.a.id == id) {
            let r = self.running.remove(i);
            tracing::info!(request_id = %id, "aborted");
            self.retire(r, FinishReason::Abort, String::new(), "abort");
        }
    }

    fn event(&mut self, (): ()) {}

    fn turn(&mut self) -> Turn {
        self.drop_disconnected();
        self.make_room();
        if self.running.is_empty() {
            return Turn::Wait;
        }
        self.step();
        Turn::Busy
    }

    fn lockstep(&self) -> Option<Arc<dyn engine::Backend>> {
        (self.lockstep && self.failed.is_none()).then(|| self.model.backend.clone())
    }

    fn lockstep_failed(&mut self, e: &engine::EngineError) {
        self.fail_worker(e);
    }

    fn publish(&mut self) {
        self.count.store(self.running.len(), Ordering::Relaxed);
        let s = self.model.pool.stats();
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.kv_blocks_total.set(s.total_blocks as i64);
        self.metrics.kv_blocks_free.set(s.free_blocks as i64);
        self.metrics.mtp_acceptance.set(self.metrics.acceptance_rate());
    }
}

impl Decode {
    fn admit(&mut self, mut a: Admitted) {
        if let Some(ending) = self.failed.clone() {
            // Its transfer completed after the device failed.
            return self.end(Running { a, stepped: false }, &ending);
        }
        if !self.speculate || !self.model.backend.has_mtp() {
            a.state.speculate = false;
            a.state.draft = None;
        }
        let first = a.first.clone();
        if a.events.send(event(Event::Tokens(Tokens { tokens: vec![first] }))).is_err() {
            self.release(&a.id);
            self.metrics.requests.with_label_values(&["disconnected"]).inc();
            return;
        }
        // The prefill worker releases requests its first token finished; a completed transfer whose
        // first token still ends the request (stop token ids it did not know of) ends here.
        let eos = self.model.config().eos_token_ids.clone();
        let count = a.state.generated().len() as u32;
        if let Some(f) =
            engine::sampling::finish_reason(*a.state.tokens.last().unwrap_or(&0), count, &a.state.params, &eos)
        {
            let r = Running { a, stepped: false };
            return self.retire(r, worker::convert::finish_reason(f), String::new(), "finished");
        }
        tracing::debug!(request_id = %a.id, "joined the decode batch");
        self.running.push(Running { a, stepped: false });
    }

    fn release(&self, id: &str) {
        compute_loop::release(&self.model.pool, id);
    }

    /// Sends the final event (if the client is still there), releases the blocks, counts the outcome.
    fn retire(&self, r: Running, reason: FinishReason, error: String, outcome: &str) {
        let s = &r.a.state;
        let fin = Finished {
            reason: reason as i32,
            error,
            timings: Some(r.a.timings),
            completion_tokens: s.generated().len() as u32,
            mtp_drafts: s.drafts_proposed,
            mtp_accepted: s.drafts_accepted,
        };
        let _ = r.a.events.send(event(Event::Finished(fin)));
        self.release(&r.a.id);
        self.metrics.requests.with_label_values(&[outcome]).inc();
    }

    fn drop_disconnected(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].a.events.is_closed() {
                let r = self.running.remove(i);
                tracing::info!(request_id = %r.a.id, "client went away; aborting");
                self.release(&r.a.id);
                self.metrics.requests.with_label_values(&["disconnected"]).inc();
            } else {
                i += 1;
            }
        }
    }

    /// Grows every request's table to cover its next step; when the pool is exhausted, preempts the
    /// newest request (possibly the one that needs room) and tries again.
    fn make_room(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let need = self.running[i].a.state.positions_needed();
            match self.model.pool.grow(&self.running[i].a.id, need) {
                Ok(t) => {
                    self.running[i].a.state.blocks = t.blocks;
                    i += 1;
                }
                Err(e) => {
                    let victim = self.running.len() - 1;
                    let r = self.running.remove(victim);
                    tracing::warn!(
                        request_id = %r.a.id,
                        generated = r.a.state.generated().len(),
                        error = %e,
                        "out of cache blocks: preempting for re-prefill"
                    );
                    self.preempt(r, e.to_string());
                }
            }
        }
    }

    /// Tells the router to continue `r` elsewhere (re-prefilling what it generated) and releases its blocks.
    fn preempt(&self, r: Running, reason: String) {
        let _ = r.a.events.send(event(Event::Preempted(Preempted { reason })));
        self.release(&r.a.id);
        self.metrics.preemptions.inc();
        self.metrics.requests.with_label_values(&["preempted"]).inc();
    }

    fn end(&self, r: Running, how: &Ending) {
        match how {
            Ending::Error(e) => self.retire(r, FinishReason::Error, e.clone(), "error"),
            Ending::Preempt(why) => self.preempt(r, why.clone()),
        }
    }

    /// The device is unusable: every running request ends with the error (its blocks released), later
    /// ones too, and the worker deregisters and exits. When the expert-parallel group failed because of
    /// another rank, the requests are preempted instead, so the router continues them elsewhere.
    fn fail_worker(&mut self, e: &engine::EngineError) {
        let group = matches!(e, engine::EngineError::GroupDown(_));
        let reason = format!("{} in a decode step: {e}", if group { "group failure" } else { "device failure" });
        tracing::error!(%reason, requests = self.running.len(), "ending every request; the worker stops");
        let ending = if group {
            Ending::Preempt(format!("{reason}; this worker restarts with its group, continue elsewhere"))
        } else {
            Ending::Error(drain::failed_request_error(&reason))
        };
        // First: the worker refuses new work and starts deregistering while the requests end; the other
        // ranks of its expert-parallel group, if any, are told at once.
        self.model.backend.leave_group(&reason);
        self.drain.fail(reason);
        for r in std::mem::take(&mut self.running) {
            self.end(r, &ending);
        }
        self.failed = Some(ending);
    }

    fn step(&mut self) {
        let started = Instant::now();
        let n = self.running.len().min(self.max_batch);
        let result = {
            let mut refs: Vec<&mut SeqState> = self.running[..n].iter_mut().map(|r| &mut r.a.state).collect();
            let drafts: u32 = refs.iter().map(|s| s.drafts_proposed).sum();
            let accepted: u32 = refs.iter().map(|s| s.drafts_accepted).sum();
            generate::decode_step(self.model.backend.as_ref(), &self.model.cache, &mut refs).map(|out| {
                let d: u32 = refs.iter().map(|s| s.drafts_proposed).sum::<u32>() - drafts;
                let a: u32 = refs.iter().map(|s| s.drafts_accepted).sum::<u32>() - accepted;
                (out, d, a)
            })
        };
        let elapsed = started.elapsed();
        self.metrics.step_seconds.observe(elapsed.as_secs_f64());
        self.metrics.step_batch.observe(n as f64);
        let (outputs, drafts, accepted) = match result {
            Ok(x) => x,
            Err(e) if drain::is_fatal(&e) => return self.fail_worker(&e),
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing its requests");
                for r in self.running.drain(..n).collect::<Vec<_>>() {
                    self.retire(r, FinishReason::Error, format!("decode step failed: {e}"), "error");
                }
                return;
            }
        };
        self.metrics.mtp_drafts.inc_by(drafts as u64);
        self.metrics.mtp_accepted.inc_by(accepted as u64);
        let mut done = Vec::new();
        for (i, out) in outputs.into_iter().enumerate() {
            let r = &mut self.running[i];
            if !r.stepped {
                r.stepped = true;
                let first = r.a.completed_at.elapsed();
                r.a.timings.first_decode_step_us = first.as_micros() as u64;
                self.metrics.first_step_seconds.observe(first.as_secs_f64());
            }
            self.metrics.tokens.inc_by(out.tokens.len() as u64);
            let with_lp = r.a.state.params.logprobs.is_some();
            let tokens: Vec<GeneratedToken> =
                out.tokens.iter().map(|t| worker::convert::generated_token(t, with_lp)).collect();
            let sent = r.a.events.send(event(Event::Tokens(Tokens { tokens })));
            if let Some(f) = out.finished {
                done.push((i, Some(f)));
            } else if sent.is_err() {
                done.push((i, None));
            }
        }
        for (i, f) in done.into_iter().rev() {
            let r = self.running.remove(i);
            match f {
                Some(f) => self.retire(r, worker::convert::finish_reason(f), String::new(), "finished"),
                None => {
                    tracing::info!(request_id = %r.a.id, "client went away; aborting");
                    self.release(&r.a.id);
                    self.metrics.requests.with_label_values(&["disconnected"]).inc();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use engine::sampling::SamplingParams;
    use proto::v1::FinishReason;
    use tokio::sync::mpsc::UnboundedReceiver;
    use worker::Drain;
    use worker::fake_backend::{Failure, FakeBackend};

    use super::*;

    struct Env {
        fake: Arc<FakeBackend>,
        model: Arc<LoadedModel>,
        sched: Arc<Scheduler>,
        metrics: Arc<DecodeMetrics>,
        drain: Arc<Drain>,
    }

    fn env() -> Env {
        env_with_batch(8)
    }

    fn env_with_batch(max_batch: usize) -> Env {
        env_on(FakeBackend::new(1280), max_batch)
    }

    fn env_on(fake: Arc<FakeBackend>, max_batch: usize) -> Env {
        let model = Arc::new(LoadedModel::from_backend(fake.clone(), 32, "fake").unwrap());
        let metrics = Arc::new(DecodeMetrics::new(&prometheus::Registry::new()).unwrap());
        let drain = Drain::new();
        let sched = Scheduler::start(model.clone(), metrics.clone(), drain.clone(), true, max_batch).unwrap();
        Env { fake, model, sched, metrics, drain }
    }

    /// Admits a request whose `prompt` was prefilled elsewhere, with the prefill worker's first token and
    /// draft as the fake computes them.
    fn admit(e: &Env, id: &str, prompt_len: usize, max_tokens: u32) -> (Vec<u32>, UnboundedReceiver<DecodeEvent>) {
        admit_with(e, id, prompt_len, max_tokens, e.drain.admit().unwrap())
    }

    /// `admit` for a request the service admitted earlier (`guard`).
    fn admit_with(
        e: &Env,
        id: &str,
        prompt_len: usize,
        max_tokens: u32,
        guard: InflightGuard,
    ) -> (Vec<u32>, UnboundedReceiver<DecodeEvent>) {
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 7 + i * 3).collect();
        let first = e.fake.next(prompt[prompt_len - 1], prompt_len - 1);
        let draft = e.fake.next(first, prompt_len);
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
        let table = e.model.pool.reserve(id, prompt_len + 2).unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let holding = Arc::new(AtomicUsize::new(1));
        let a = Admitted {
            id: id.to_string(),
            state: SeqState::resume(prompt.clone(), prompt_len, first, Some(draft), params, table.blocks),
            first: GeneratedToken { token_id: first, logprobs: None },
            events: tx,
            guard,
            hold: Holding(holding),
            timings: StageTimings::default(),
            completed_at: Instant::now(),
        };
        assert!(e.sched.admit(a).is_ok());
        (prompt, rx)
    }

    /// Events until the Finished one: (tokens streamed, the Finished event).
    async fn drain_events(rx: &mut UnboundedReceiver<DecodeEvent>) -> (Vec<u32>, Finished) {
        let mut tokens = Vec::new();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("an event").expect("open");
            match ev.event {
                Some(Event::Tokens(t)) => tokens.extend(t.tokens.iter().map(|t| t.token_id)),
                Some(Event::Finished(f)) => return (tokens, f),
                other => panic!("unexpected event {other:?}"),
            }
        }
    }

    async fn wait_pool_empty(model: &LoadedModel) {
        for _ in 0..500 {
            if model.pool.stats().used_blocks == 0 {
                model.pool.check_invariants().unwrap();
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("blocks still held: {:?}", model.pool.stats());
    }

    #[tokio::test]
    async fn a_request_streams_max_tokens_with_accepted_drafts_then_releases_its_blocks() {
        let e = env();
        let (prompt, mut rx) = admit(&e, "r1", 10, 40);
        let (tokens, fin) = drain_events(&mut rx).await;
        assert_eq!(fin.reason, FinishReason::Length as i32, "{fin:?}");
        assert_eq!(tokens.len(), 40);
        // Each token follows the previous one exactly as the fake model predicts.
        let mut prev = *prompt.last().unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            assert_eq!(t, e.fake.next(prev, prompt.len() - 1 + i), "token {i}");
            prev = t;
        }
        assert_eq!(fin.completion_tokens, 40);
        assert!(fin.mtp_drafts > 0 && fin.mtp_accepted == fin.mtp_drafts, "the fake's drafts are always right");
        wait_pool_empty(&e.model).await;
        assert_eq!(e.metrics.requests.with_label_values(&["finished"]).get(), 1);
    }

    #[tokio::test]
    async fn an_abort_mid_stream_finishes_with_abort_and_frees_the_blocks() {
        let e = env();
        let (_, mut rx) = admit(&e, "long", 10, 100_000);
        // Let it run a few steps.
        for _ in 0..3 {
            rx.recv().await.unwrap();
        }
        e.sched.abort("long");
        let (_, fin) = drain_events(&mut rx).await;
        assert_eq!(fin.reason, FinishReason::Abort as i32);
        wait_pool_empty(&e.model).await;
        assert!(e.model.pool.stats().free_blocks == 32);
    }

    #[tokio::test]
    async fn a_non_device_backend_error_fails_the_batch_frees_the_blocks_and_the_worker_goes_on() {
        let e = env();
        e.fake.fail_next(Failure::InvalidInput);
        let (_, mut rx) = admit(&e, "doomed", 10, 20);
        let (tokens, fin) = drain_events(&mut rx).await;
        assert_eq!(tokens.len(), 1, "only the prefill worker's first token");
        assert_eq!(fin.reason, FinishReason::Error as i32);
        assert!(fin.error.contains("injected failure"), "{}", fin.error);
        wait_pool_empty(&e.model).await;
        assert_eq!(e.drain.failure(), None, "the worker did not fail");
        assert!(!e.drain.is_draining());
        let (_, mut rx) = admit(&e, "next", 10, 5);
        let (tokens, fin) = drain_events(&mut rx).await;
        assert_eq!((tokens.len(), fin.reason), (5, FinishReason::Length as i32));
    }

    #[tokio::test]
    async fn a_device_failure_fails_every_request_frees_the_blocks_and_fails_the_worker() {
        // One request per step: "running" is stepped, "waiting" sits in the batch behind it. At 1 ms a
        // backend call, "running" neither finishes nor fills the pool before the failure.
        let e = env_with_batch(1);
        e.fake.delay_us.store(1_000, std::sync::atomic::Ordering::SeqCst);
        let (_, mut running) = admit(&e, "running", 10, 1_500);
        for _ in 0..3 {
            running.recv().await.unwrap();
        }
        let (_, mut waiting) = admit(&e, "waiting", 10, 1_500);
        assert!(matches!(waiting.recv().await.unwrap().event, Some(Event::Tokens(_))), "joined the batch");
        // Admitted by the service now; its caches arrive after the failure.
        let late_guard = e.drain.admit().unwrap();
        e.fake.fail_next(Failure::Device);
        for rx in [&mut running, &mut waiting] {
            let (_, fin) = drain_events(rx).await;
            assert_eq!(fin.reason, FinishReason::Error as i32);
            assert!(fin.error.contains("device failure") && fin.error.contains("injected device failure"), "{fin:?}");
            assert!(fin.error.contains("shutting down"), "{}", fin.error);
        }
        wait_pool_empty(&e.model).await;
        let reason = e.drain.failure().expect("the worker failed");
        assert!(reason.contains("injected device failure"), "{reason}");
        // A transfer that completes afterwards ends at once, without touching the device.
        let calls = e.fake.calls.load(std::sync::atomic::Ordering::SeqCst);
        let (_, mut late) = admit_with(&e, "late", 10, 5, late_guard);
        let (tokens, fin) = drain_events(&mut late).await;
        assert!(tokens.is_empty() && fin.reason == FinishReason::Error as i32, "{tokens:?} {fin:?}");
        assert!(fin.error.contains("injected device failure"), "{}", fin.error);
        wait_pool_empty(&e.model).await;
        assert_eq!(e.fake.calls.load(std::sync::atomic::Ordering::SeqCst), calls);
    }

    /// Two decode workers that are the ranks of one expert-parallel group (agreements time out after
    /// `timeout`).
    fn ep_pair(timeout: Duration) -> (Arc<worker::fake_backend::FakeGroup>, Vec<Env>) {
        let g = worker::fake_backend::FakeGroup::new(2, timeout);
        let ranks = (0..2).map(|r| env_on(FakeBackend::ep_rank(1280, &g, r), 8)).collect();
        (g, ranks)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expert_parallel_ranks_step_in_lockstep_and_an_idle_rank_joins_every_pass() {
        use worker::fake_backend::Agreement;
        let (g, ranks) = ep_pair(Duration::from_secs(5));
        // Rank 0 decodes two requests, rank 1 one that ends sooner: it idles through the last steps.
        let (p0, mut a) = admit(&ranks[0], "a", 10, 30);
        let (_, mut b) = admit(&ranks[0], "b", 20, 12);
        let (_, mut c) = admit(&ranks[1], "c", 7, 5);
        let mut streams = Vec::new();
        for (rx, n) in [(&mut a, 30), (&mut b, 12), (&mut c, 5)] {
            let (tokens, fin) = drain_events(rx).await;
            assert_eq!((tokens.len(), fin.reason), (n, FinishReason::Length as i32));
            streams.push(tokens);
        }
        // Each token follows the previous one as the fake predicts: lockstep changes no output.
        let mut prev = *p0.last().unwrap();
        for (i, &t) in streams[0].iter().enumerate() {
            assert_eq!(t, ranks[0].fake.next(prev, p0.len() - 1 + i), "token {i}");
            prev = t;
        }
        let (tokens, _) = drain_events(&mut admit(&ranks[1], "d", 7, 3).1).await;
        assert_eq!(tokens.len(), 3, "the idle rank serves again");
        let (l0, l1) = (g.log(0), g.log(1));
        let n = l0.len().min(l1.len());
        // One agreement a step, the whole step's shape: every step of both ranks was agreed up front.
        assert!(l0.iter().chain(&l1).all(|a| a.0 == Agreement::Step), "{l0:?}");
        // A decode step brings rows to the main and MTP passes, never to the prefill form.
        let busy = (0..n).filter(|&i| l0[i].1[0] > 0 || l1[i].1[0] > 0).count();
        // "a": 29 tokens after the prefill's, two a step (the fake's drafts are accepted): 15 steps.
        assert!(busy >= 15, "rank 0 decoded 15 steps of a: {busy} busy steps");
        assert!(l0.iter().chain(&l1).all(|a| a.1[1] == 0), "a decode worker never prefills");
        for r in &ranks {
            wait_pool_empty(&r.model).await;
            assert_eq!(r.drain.failure(), None);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_rank_preempts_the_others_requests_and_fails_the_worker() {
        let (g, ranks) = ep_pair(Duration::from_millis(300));
        let e = &ranks[0];
        e.fake.delay_us.store(1_000, Ordering::SeqCst);
        let (_, mut rx) = admit(e, "long", 10, 100_000);
        for _ in 0..3 {
            assert!(matches!(rx.recv().await.unwrap().event, Some(Event::Tokens(_))));
        }
        // Admitted by the service now; its caches arrive after the failure.
        let late_guard = e.drain.admit().unwrap();
        g.vanish(1);
        let preempted = loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("an event").expect("open");
            match ev.event {
                Some(Event::Tokens(_)) => continue,
                Some(Event::Preempted(p)) => break p,
                other => panic!("a lost rank preempts the request (the router continues it): {other:?}"),
            }
        };
        assert!(preempted.reason.contains("group") && preempted.reason.contains("did not join"), "{preempted:?}");
        wait_pool_empty(&e.model).await;
        let reason = e.drain.failure().expect("the worker failed");
        assert!(reason.contains("group failure"), "{reason}");
        // A transfer that completes afterwards is preempted at once too.
        let (_, mut late) = admit_with(e, "late", 10, 5, late_guard);
        let ev = tokio::time::timeout(Duration::from_secs(10), late.recv()).await.unwrap().unwrap();
        assert!(matches!(ev.event, Some(Event::Preempted(_))), "{ev:?}");
        wait_pool_empty(&e.model).await;
        assert_eq!(e.metrics.requests.with_label_values(&["error"]).get(), 0, "no request failed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_whose_device_fails_tells_its_group_at_once() {
        // A 60 s step bound: the peer must learn of the failure from the failing rank, not from its watchdog.
        let (_g, ranks) = ep_pair(Duration::from_secs(60));
        ranks[0].fake.delay_us.store(1_000, Ordering::SeqCst);
        let (_, mut mine) = admit(&ranks[0], "mine", 10, 100_000);
        let (_, mut theirs) = admit(&ranks[1], "theirs", 10, 100_000);
        for rx in [&mut mine, &mut theirs] {
            assert!(matches!(rx.recv().await.unwrap().event, Some(Event::Tokens(_))));
        }
        let t0 = std::time::Instant::now();
        ranks[0].fake.fail_next(Failure::Device);
        // Rank 0's own failure ends its request with the error; rank 1's is preempted (continued elsewhere).
        let (_, fin) = drain_events(&mut mine).await;
        assert!(fin.reason == FinishReason::Error as i32 && fin.error.contains("injected device failure"), "{fin:?}");
        let preempted = loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), theirs.recv()).await.expect("an event").unwrap();
            match ev.event {
                Some(Event::Tokens(_)) => continue,
                Some(Event::Preempted(p)) => break p,
                other => panic!("{other:?}"),
            }
        };
        assert!(preempted.reason.contains("rank 0 left the group"), "{preempted:?}");
        assert!(t0.elapsed() < Duration::from_secs(10), "told at once, not after the step bound: {:?}", t0.elapsed());
        for r in &ranks {
            wait_pool_empty(&r.model).await;
            assert!(r.drain.failure().is_some(), "both workers stop");
        }
    }

    #[tokio::test]
    async fn a_client_that_goes_away_frees_the_blocks() {
        let e = env();
        let (_, rx) = admit(&e, "gone", 10, 100_000);
        drop(rx);
        wait_pool_empty(&e.model).await;
        // The loop is idle again and serves the next request.
        let (_, mut rx) = admit(&e, "next", 5, 3);
        let (tokens, _) = drain_events(&mut rx).await;
        assert_eq!(tokens.len(), 3);
    }

    #[tokio::test]
    async fn requests_beyond_the_pool_are_preempted_not_failed() {
        let e = env();
        // Slow steps: `a` must still be decoding when `b` arrives (on a busy 2-core CI machine an instant
        // fake finished `a` first once, and nothing needed preempting).
        e.fake.delay_us.store(1000, Ordering::SeqCst);
        // 32 blocks of 64 tokens: two requests that each grow past 16 blocks cannot both finish.
        let (_, mut a) = admit(&e, "a", 64 * 14, 64 * 4);
        let (_, mut b) = admit(&e, "b", 64 * 14, 64 * 4);
        let mut preempted = 0;
        for rx in [&mut a, &mut b] {
            loop {
                let ev = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.unwrap().unwrap();
                match ev.event {
                    Some(Event::Preempted(_)) => {
                        preempted += 1;
                        break;
                    }
                    Some(Event::Finished(f)) => {
                        assert_eq!(f.reason, FinishReason::Length as i32);
                        break;
                    }
                    _ => {}
                }
            }
        }
        assert_eq!(preempted, 1, "the newest request is preempted, the other finishes");
        wait_pool_empty(&e.model).await;
    }
}
