//! A request's flow through the cluster, in named stages:
//!
//! 1. [`select`]: pick a compatible prefill/decode pair with the configured policies.
//! 2. [`attempt`]: a state machine over one pair: open `DecodeWorker.Decode` (the decode worker reserves
//!    blocks and answers `Reserved`), call `PrefillWorker.Prefill` with the descriptor, then relay tokens
//!    from the Decode stream ([`worker_replies`] reads what the workers answer).
//! 3. [`output`]: incremental detokenization, stop strings, logprobs, usage -> [`Event`]s.
//!
//! [`Dispatcher::start`] runs these in a task per request and retries: another prefill worker when
//! prefill fails before the first token, another decode worker when a reservation is refused, a fresh
//! pair for prompt + generated tokens when the decode worker preempts. Dropping the event stream (the
//! client went away) aborts the request on both workers.

mod abort;
mod attempt;
mod capacity;
mod output;
mod select;
mod worker_replies;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::v1::{GeneratedToken, SamplingParams};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::{Instrument, info, info_span, warn};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::model::ServedModel;
use crate::policies::Policy;
use crate::workers::WorkerPool;
use attempt::{AttemptEnd, AttemptInput};
pub use capacity::CapacityWait;
use output::Output;
pub use output::{StopReason, Summary};

/// One generation request after validation, templating and tokenization.
#[derive(Debug, Clone)]
pub struct TokenizedRequest {
    pub request_id: String,
    /// Metrics label: "completions", "chat" or "grpc".
    pub endpoint: &'static str,
    pub prompt: Vec<u32>,
    /// max_tokens is resolved (>= 1).
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub include_stop_str: bool,
    pub skip_special_tokens: bool,
    pub arrived: Instant,
}

/// What the front doors receive.
#[derive(Debug)]
pub enum Event {
    /// New text (never a split character, never part of a stop string) and the tokens that produced it.
    Delta { text: String, tokens: Vec<GeneratedToken> },
    /// The request ended normally.
    Done(Summary),
    /// The request failed. Before any Delta this becomes an HTTP error status.
    Failed(ApiError),
}

/// Limits applied to every request.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_retries: u32,
    pub prefill_timeout: Duration,
    pub request_timeout: Option<Duration>,
}

pub struct Dispatcher {
    pub pool: Arc<WorkerPool>,
    pub prefill_policy: Box<dyn Policy>,
    pub decode_policy: Box<dyn Policy>,
    pub model: Arc<ServedModel>,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub ids: InFlightIds,
    pub capacity: CapacityWait,
}

/// Request ids in flight on the workers.
#[derive(Default)]
pub struct InFlightIds(Arc<std::sync::Mutex<HashSet<String>>>);

/// Holds an id until dropped.
pub struct IdClaim {
    id: String,
    set: Arc<std::sync::Mutex<HashSet<String>>>,
}

impl IdClaim {
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for IdClaim {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

impl InFlightIds {
    /// `id` itself when no request in flight uses it, else `id~N` for the smallest free N.
    pub fn claim(&self, id: &str) -> IdClaim {
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut candidate = id.to_owned();
        let mut n = 1u32;
        while set.contains(&candidate) {
            candidate = format!("{id}~{n}");
            n += 1;
        }
        set.insert(candidate.clone());
        IdClaim { id: candidate, set: self.0.clone() }
    }
}

/// The events of one request. Dropping it aborts the request on its workers.
pub struct EventStream {
    first: Option<Event>,
    rx: mpsc::UnboundedReceiver<Event>,
}

impl EventStream {
    pub async fn next(&mut self) -> Option<Event> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }
}

/// Preemptions allowed per request before it fails (guards against a worker that preempts forever).
const MAX_PREEMPTIONS: u32 = 16;

impl Dispatcher {
    /// Starts `request` and waits for its first event: a failure before any output is returned as Err, so
    /// the front door can answer with a proper status (400/429/503...). `permit` is the admission slot,
    /// held until the request ends.
    pub async fn start(
        self: &Arc<Self>,
        mut request: TokenizedRequest,
        permit: OwnedSemaphorePermit,
    ) -> Result<EventStream, ApiError> {
        // One seed for the request's whole life: every attempt (retry, re-prefill after preemption) and
        // both workers of each attempt sample from the same (seed, output position) stream.
        request.sampling.seed.get_or_insert_with(rand::random);
        // Workers key reservations and aborts by request id; a client may reuse its `x-request-id` while
        // the first request runs, so the second gets a distinct worker-side id.
        let key = self.ids.claim(&request.request_id);
        request.request_id = key.id().to_owned();
        // Unbounded on purpose: the worker's token stream must always be read promptly. Blocking on
        // a slow client would leave frames unread in the shared HTTP/2 connection to the worker and
        // stall every other request on it (flow-control windows). Memory is bounded by max_tokens.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let span = info_span!("request", request_id = %request.request_id);
        let me = self.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                let _key = key;
                me.run(request, tx).await;
            }
            .instrument(span),
        );
        match rx.recv().await {
            Some(Event::Failed(e)) => Err(e),
            Some(first) => Ok(EventStream { first: Some(first), rx }),
            None => Err(ApiError::internal("request task ended without a result")),
        }
    }

    async fn run(&self, request: TokenizedRequest, tx: mpsc::UnboundedSender<Event>) {
        let deadline = self.limits.request_timeout.map(|t| request.arrived + t);
        let mut out = Output::new(&request, self.model.clone(), self.metrics.clone(), tx.clone());
        let work = self.drive(&request, &mut out, &tx);
        let result = match deadline {
            Some(d) => tokio::time::timeout_at(d.into(), work).await,
            None => Ok(work.await),
        };
        // Its decode slot and blocks are free now: waiting requests may try again.
        self.capacity.freed();
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => out.fail(e).await,
            Err(_) => {
                let secs = self.limits.request_timeout.map(|t| t.as_secs_f64()).unwrap_or_default();
                warn!(timeout_s = secs, "request timed out");
                out.fail(ApiError::timeout(secs)).await
            }
        }
    }

    /// The retry loop around attempts. Returns Err for failures to report; Ok when the request ended
    /// (finished, or the client left).
    async fn drive(
        &self,
        request: &TokenizedRequest,
        out: &mut Output,
        tx: &mpsc::UnboundedSender<Event>,
    ) -> Result<(), ApiError> {
        let hashes = if self.prefill_policy.wants_prefix_hashes() {
            cluster::prefix_hash::prefix_hashes(&request.prompt)
        } else {
            Vec::new()
        };
        let mut excluded_prefill = HashSet::new();
        let mut excluded_decode = HashSet::new();
        // Why each decode worker refused a reservation for lack of room (its own words: the sequence
        // limit or the cache blocks), for the 429 message.
        let mut decode_full: Vec<String> = Vec::new();
        let (mut retries, mut preemptions, mut lost) = (0u32, 0u32, 0u32);
        let mut last_failure = String::new();
        let mut attempt = 0u32;
        // A request waiting for decode room holds a place among the waiters only while it waits: an
        // attempt leaves (the deadline is kept, so waits between tries add up to one bound), and a
        // preemption starts a fresh wait with the continuation's own bound.
        let mut waiter = None;
        let mut wait_deadline = None;
        loop {
            let seq_len = request.prompt.len() + request.sampling.max_tokens as usize;
            let pair = match select::pair(
                self,
                &hashes,
                request.prompt.len(),
                seq_len,
                &excluded_prefill,
                &excluded_decode,
            ) {
                Ok(p) => p,
                // Every decode worker is full, or a started stream was preempted or lost its decode worker and
                // none can take it now (a restarting expert-parallel group): wait for room (bounded), then try
                // them all again.
                Err(_) if !decode_full.is_empty() || lost > 0 || preemptions > 0 => {
                    let preempted = preemptions > 0 || lost > 0;
                    if waiter.is_none() {
                        waiter = self.capacity.enter(preempted, wait_deadline);
                        if waiter.is_some() {
                            info!(
                                preempted,
                                waiting = self.capacity.waiting(),
                                "every decode worker is full; waiting for room"
                            );
                        }
                    }
                    let go_on = match &waiter {
                        Some(w) => tokio::select! {
                            more = self.capacity.next_try(w) => more,
                            _ = tx.closed() => {
                                info!("client disconnected while waiting for decode capacity");
                                return Ok(());
                            }
                        },
                        None => false,
                    };
                    if go_on {
                        // A fresh round after the wait: workers that failed before may have recovered (a
                        // restarted expert-parallel group; a prefill worker blamed for its decode side's
                        // failure). Retries stay bounded by --max-retries.
                        decode_full.clear();
                        excluded_decode.clear();
                        excluded_prefill.clear();
                        continue;
                    }
                    if decode_full.is_empty() {
                        return Err(ApiError::unavailable(format!(
                            "The request was interrupted (its decode worker was lost or preempted it) and no prefill/decode pair could continue it within --preempted-wait-secs; last failure: {last_failure}"
                        )));
                    }
                    let message =
                        format!("Every decode worker is at capacity; retry shortly. {}", decode_full.join("; "));
                    return Err(if preempted {
                        ApiError::unavailable(format!(
                            "The request was preempted and no decode worker had room to continue it within --preempted-wait-secs. {message}"
                        ))
                    } else {
                        ApiError::overloaded(message, 1)
                    });
                }
                Err(why) if !last_failure.is_empty() => {
                    return Err(ApiError::unavailable(format!("{why}; last failure: {last_failure}")));
                }
                Err(why) => return Err(ApiError::unavailable(why)),
            };
            if let Some(w) = waiter.take() {
                wait_deadline = Some(w.deadline);
            }
            let input = AttemptInput {
                request,
                attempt,
                hashes: &hashes,
                pair: &pair,
                limits: &self.limits,
                metrics: &self.metrics,
            };
            attempt += 1;
            // Boxed: the attempt's state is large and would otherwise be copied around with this future.
            let end = Box::pin(attempt::run(input, out, tx)).await;
            if matches!(end, AttemptEnd::Preempted(_) | AttemptEnd::DecodeLost(_))
                && let Some(reason) = out.ended_by_tokens()
            {
                // The request's last token ended it before the worker said so: nothing to continue.
                let _ = out.finish(reason).await;
                return Ok(());
            }
            match end {
                AttemptEnd::Done => return Ok(()),
                AttemptEnd::ClientGone => {
                    info!("client disconnected; request aborted on both workers");
                    return Ok(());
                }
                AttemptEnd::Failed(e) => return Err(e),
                AttemptEnd::Preempted(why) => {
                    preemptions += 1;
                    last_failure = format!("preempted by decode worker {}: {why}", pair.decode.id);
                    wait_deadline = None;
                    self.metrics.retries.with_label_values(&["preempted"]).inc();
                    info!(worker = %pair.decode.id, reason = %why, generated = out.generated().len(), "preempted; prefilling again");
                    if preemptions > MAX_PREEMPTIONS {
                        return Err(ApiError::upstream(format!("request preempted {preemptions} times; giving up")));
                    }
                }
                AttemptEnd::DecodeLost(why) => {
                    retries += 1;
                    lost += 1;
                    wait_deadline = None;
                    self.metrics.retries.with_label_values(&["decode_lost"]).inc();
                    warn!(worker = %pair.decode.id, reason = %why, generated = out.generated().len(), retries, "decode worker lost; continuing the request elsewhere");
                    last_failure = why.clone();
                    if retries > self.limits.max_retries {
                        return Err(ApiError::upstream(format!("{why}; gave up after {retries} attempts")));
                    }
                    excluded_decode.insert(pair.decode.id.clone());
                }
                AttemptEnd::RetryPrefill(why) => {
                    retries += 1;
                    self.metrics.retries.with_label_values(&["prefill_failed"]).inc();
                    warn!(worker = %pair.prefill.id, reason = %why, retries, "prefill failed before the first token");
                    last_failure = format!("prefill worker {}: {why}", pair.prefill.id);
                    if retries > self.limits.max_retries {
                        return Err(ApiError::upstream(format!(
                            "Prefill failed on {retries} attempts; {last_failure}"
                        )));
                    }
                    excluded_prefill.insert(pair.prefill.id.clone());
                }
                AttemptEnd::RetryDecode { why, full } => {
                    self.metrics
                        .retries
                        .with_label_values(&[if full { "decode_full" } else { "decode_unavailable" }])
                        .inc();
                    warn!(worker = %pair.decode.id, reason = %why, "decode reservation failed; trying another decode worker");
                    last_failure = format!("decode worker {}: {why}", pair.decode.id);
                    if full {
                        decode_full.push(last_failure.clone());
                    }
                    excluded_decode.insert(pair.decode.id.clone());
                }
            }
        }
    }
}

impl Dispatcher {
    /// The context length requests are validated against: `--max-model-len` (or the checkpoint's)
    /// capped by the workers' own limits.
    pub fn max_model_len(&self) -> u32 {
        select::context_limit(self, self.model.max_model_len)
    }

    /// For /ready: Ok with a description when some pair could serve now, else why not.
    pub fn readiness(&self) -> Result<String, String> {
        let none = std::collections::HashSet::new();
        select::pair(self, &[], 1, 2, &none, &none)
            .map(|p| format!("e.g. prefill {} + decode {}", p.prefill.id, p.decode.id))
    }
}

#[cfg(test)]
mod tests {
    use super::InFlightIds;

    #[test]
    fn a_reused_request_id_gets_a_distinct_worker_side_id_while_the_first_runs() {
        let ids = InFlightIds::default();
        let a = ids.claim("abc");
        let b = ids.claim("abc");
        assert_eq!(a.id(), "abc");
        assert_eq!(b.id(), "abc~1");
        drop(a);
        assert_eq!(ids.claim("abc").id(), "abc");
    }
}
