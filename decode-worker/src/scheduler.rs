//! The decode loop, on its own thread (compute never runs on the async runtime): admit requests whose
//! caches arrived, make room for the next positions (growing by a block, or preempting the newest request
//! when the pool is exhausted), run one batched decode step with MTP verification, stream the tokens, and
//! retire finished, aborted or disconnected requests, releasing their blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use engine::generate::{self, SeqState};
use proto::v1::decode_event::Event;
use proto::v1::{DecodeEvent, FinishReason, Finished, GeneratedToken, Preempted, StageTimings, Tokens};
use worker::LoadedModel;
use worker::drain::InflightGuard;

use crate::metrics::DecodeMetrics;

pub type EventTx = tokio::sync::mpsc::UnboundedSender<Result<DecodeEvent, tonic::Status>>;

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

enum Cmd {
    Admit(Box<Admitted>),
    Abort(String),
}

pub struct Scheduler {
    tx: mpsc::Sender<Cmd>,
    running: Arc<AtomicUsize>,
}

struct Running {
    a: Admitted,
    stepped: bool,
}

fn event(e: Event) -> Result<DecodeEvent, tonic::Status> {
    Ok(DecodeEvent { event: Some(e) })
}

impl Scheduler {
    pub fn start(
        model: Arc<LoadedModel>,
        metrics: Arc<DecodeMetrics>,
        speculate: bool,
        max_batch: usize,
    ) -> Arc<Scheduler> {
        let (tx, rx) = mpsc::channel();
        let running = Arc::new(AtomicUsize::new(0));
        let loop_ = Loop {
            model,
            metrics,
            speculate,
            max_batch: max_batch.max(1),
            rx,
            running: Vec::new(),
            count: running.clone(),
        };
        std::thread::Builder::new()
            .name("decode-loop".into())
            .spawn(move || loop_.run())
            .expect("spawning the decode loop thread");
        Arc::new(Scheduler { tx, running })
    }

    /// Hands a request to the loop; gives it back if the loop is gone.
    pub fn admit(&self, a: Admitted) -> Result<(), Box<Admitted>> {
        self.tx.send(Cmd::Admit(Box::new(a))).map_err(|e| match e.0 {
            Cmd::Admit(a) => a,
            Cmd::Abort(_) => unreachable!("sent an Admit"),
        })
    }

    pub fn abort(&self, id: &str) {
        let _ = self.tx.send(Cmd::Abort(id.to_string()));
    }

    /// Requests in the decode batch.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
}

struct Loop {
    model: Arc<LoadedModel>,
    metrics: Arc<DecodeMetrics>,
    speculate: bool,
    max_batch: usize,
    rx: mpsc::Receiver<Cmd>,
    running: Vec<Running>,
    count: Arc<AtomicUsize>,
}

impl Loop {
    fn run(mut self) {
        loop {
            if self.running.is_empty() {
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
            self.drop_disconnected();
            self.make_room();
            if !self.running.is_empty() {
                self.step();
            }
            self.publish();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Admit(a) => self.admit(*a),
            Cmd::Abort(id) => {
                if let Some(i) = self.running.iter().position(|r| r.a.id == id) {
                    let r = self.running.remove(i);
                    tracing::info!(request_id = %id, "aborted");
                    self.retire(r, FinishReason::Abort, String::new(), "abort");
                }
            }
        }
    }

    fn admit(&mut self, mut a: Admitted) {
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
        if let Err(e) = self.model.pool.release(id) {
            tracing::error!(request_id = %id, error = %e, "releasing blocks");
        }
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
                    let _ = r.a.events.send(event(Event::Preempted(Preempted { reason: e.to_string() })));
                    self.release(&r.a.id);
                    self.metrics.preemptions.inc();
                    self.metrics.requests.with_label_values(&["preempted"]).inc();
                }
            }
        }
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

    fn publish(&self) {
        self.count.store(self.running.len(), Ordering::Relaxed);
        let s = self.model.pool.stats();
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.kv_blocks_total.set(s.total_blocks as i64);
        self.metrics.kv_blocks_free.set(s.free_blocks as i64);
        self.metrics.mtp_acceptance.set(self.metrics.acceptance_rate());
    }
}
