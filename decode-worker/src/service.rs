//! The `tandem.v1.DecodeWorker` gRPC service.
//!
//! `Decode` reserves blocks (admission policy), asks kv-transfer for a descriptor, streams `Reserved`,
//! waits for the prefill worker's transfer, then hands the request to the decode loop, which streams
//! `Tokens` and one `Finished` (or `Preempted`). Dropping the stream aborts the request at any stage.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use engine::generate::SeqState;
use futures::{Stream, StreamExt};
use kv_transfer::{ExpectRequest, KvReceiver, TransferError, TransferOutcome};
use proto::v1::decode_event::Event;
use proto::v1::decode_worker_server::DecodeWorker;
use proto::v1::{
    AbortRequest, AbortResponse, DecodeEvent, DecodeRequest, FinishReason, Finished, InfoRequest, LoadReport,
    LoadRequest, Reserved, StageTimings, WorkerInfo, WorkerRole,
};
use tonic::{Request, Response, Status};
use worker::{Drain, LoadedModel};

use crate::admission::{self, Policy};
use crate::metrics::DecodeMetrics;
use crate::scheduler::{Admitted, EventTx, Holding, Scheduler};

pub struct Shared {
    pub model: Arc<LoadedModel>,
    pub receiver: KvReceiver,
    pub scheduler: Arc<Scheduler>,
    pub drain: Arc<Drain>,
    pub metrics: Arc<DecodeMetrics>,
    pub record: cluster::WorkerRecord,
    pub admission: Policy,
    pub transfer_timeout: Duration,
    pub verify_checksum: bool,
}

#[derive(Clone)]
pub struct DecodeService {
    shared: Arc<Shared>,
    /// Requests holding blocks (transferring or running): the admission count.
    holding: Arc<AtomicUsize>,
}

impl DecodeService {
    pub fn new(shared: Shared) -> Self {
        DecodeService { shared: Arc::new(shared), holding: Arc::new(AtomicUsize::new(0)) }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

fn transfer_status(e: &TransferError) -> String {
    format!("cache transfer failed: {e}")
}

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type DecodeStream = EventStream;

    async fn decode(&self, req: Request<DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        let sh = &self.shared;
        let id = worker::validate::request_id(&req, &req.get_ref().request_id)?;
        let guard = sh.drain.admit()?;
        let r = req.into_inner();
        let cfg = sh.model.config();
        let prompt_len = worker::validate::tokens(&r.token_ids, r.num_prompt_tokens, cfg.vocab_size)?;
        let sampling = r.sampling.clone().unwrap_or_default();
        let params = worker::convert::sampling_params(&sampling, &id);
        params.validate(cfg.vocab_size).map_err(Status::invalid_argument)?;
        let generated_before = r.token_ids.len() - prompt_len;
        let remaining = (params.max_tokens as usize).saturating_sub(generated_before);
        sh.admission.check_lengths(r.token_ids.len(), remaining).map_err(Status::invalid_argument)?;

        // Reserve, then hand out the descriptor.
        let holding = self.holding.fetch_add(1, Ordering::SeqCst);
        let hold = Holding(self.holding.clone());
        sh.admission.admit(&sh.model.pool.stats(), holding, r.token_ids.len()).map_err(proto::refusal::no_room)?;
        let table = sh.model.pool.reserve(&id, admission::initial_tokens(r.token_ids.len())).map_err(|e| match e {
            engine::cache::PoolError::DuplicateRequest(_) => {
                Status::already_exists(format!("request {id} is already running here"))
            }
            other => proto::refusal::no_room(other.to_string()),
        })?;
        let timeout = if r.transfer_timeout_ms > 0 {
            Duration::from_millis(r.transfer_timeout_ms as u64)
        } else {
            sh.transfer_timeout
        };
        let expect = ExpectRequest {
            request_id: id.clone(),
            blocks: table.clone(),
            num_tokens: r.token_ids.len(),
            timeout,
            verify_checksum: sh.verify_checksum,
        };
        let (desc, pending) = match sh.receiver.expect(expect) {
            Ok(x) => x,
            Err(e) => {
                let _ = sh.model.pool.release(&id);
                return Err(Status::internal(format!("cannot expect the transfer: {e}")));
            }
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(DecodeEvent { event: Some(Event::Reserved(Reserved { transfer: Some(desc) })) });
        sh.metrics.transferring.inc();
        tracing::info!(request_id = %id, tokens = r.token_ids.len(), blocks = table.len(), "reserved; awaiting transfer");

        let sh = self.shared.clone();
        let reserved_at = Instant::now();
        tokio::spawn(async move {
            let mut pending = pending;
            let send_finished = |tx: &EventTx, reason: FinishReason, error: String, timings: StageTimings| {
                let fin = Finished { reason: reason as i32, error, timings: Some(timings), ..Default::default() };
                let _ = tx.send(DecodeEvent { event: Some(Event::Finished(fin)) });
            };
            let outcome = tokio::select! {
                o = &mut pending => Some(o),
                _ = tx.closed() => None,
                reason = sh.drain.failed() => {
                    // The device failed: these caches would never be decoded. kv-transfer frees the blocks.
                    sh.metrics.transferring.dec();
                    let error = worker::drain::failed_request_error(&reason);
                    pending.abort(&error);
                    sh.metrics.requests.with_label_values(&["error"]).inc();
                    send_finished(&tx, FinishReason::Error, error, StageTimings::default());
                    return;
                }
            };
            sh.metrics.transferring.dec();
            match outcome {
                None => {
                    // The client went away before the caches arrived: kv-transfer frees the blocks once no
                    // write can land anymore. This transfer, not whatever later holds the same id.
                    pending.abort("client disconnected");
                    sh.metrics.requests.with_label_values(&["disconnected"]).inc();
                    tracing::info!(request_id = %id, "client went away during the transfer");
                }
                Some(Err(e)) => {
                    tracing::warn!(request_id = %id, error = %e, "transfer failed; blocks freed by kv-transfer");
                    sh.metrics.requests.with_label_values(&["transfer_failed"]).inc();
                    send_finished(&tx, FinishReason::Error, transfer_status(&e), StageTimings::default());
                }
                Some(Ok(TransferOutcome::Released(rel))) => {
                    sh.metrics.requests.with_label_values(&["released"]).inc();
                    send_finished(&tx, rel.finish_reason, String::new(), StageTimings::default());
                }
                Some(Ok(TransferOutcome::Completed(c))) => {
                    sh.metrics.transfer_seconds.observe(reserved_at.elapsed().as_secs_f64());
                    sh.metrics.transfer_bytes.inc_by(c.bytes);
                    let timings = StageTimings {
                        transfer_us: c.elapsed.as_micros() as u64,
                        transfer_bytes: c.bytes,
                        ..Default::default()
                    };
                    let state = SeqState::resume(
                        r.token_ids.clone(),
                        prompt_len,
                        c.first_token.token_id,
                        c.draft.map(|d| d.token_id),
                        params,
                        table.blocks.clone(),
                    );
                    let a = Admitted {
                        id: id.clone(),
                        state,
                        first: c.first_token,
                        events: tx,
                        guard,
                        hold,
                        timings,
                        completed_at: Instant::now(),
                    };
                    if let Err(a) = sh.scheduler.admit(a) {
                        let _ = sh.model.pool.release(&a.id);
                        send_finished(&a.events, FinishReason::Error, "decode loop is not running".into(), a.timings);
                    }
                }
            }
        });
        // The loop streams domain events; gRPC wraps each one.
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(Ok::<_, Status>);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let r = req.into_inner();
        let in_transfer =
            self.shared.receiver.abort(&r.request_id, if r.reason.is_empty() { "aborted" } else { &r.reason });
        let running = self.shared.model.pool.holds(&r.request_id);
        self.shared.scheduler.abort(&r.request_id);
        tracing::info!(request_id = %r.request_id, reason = %r.reason, "abort requested");
        Ok(Response::new(AbortResponse { found: in_transfer || running }))
    }

    async fn get_load(&self, _req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        let sh = &self.shared;
        let s = sh.model.pool.stats();
        let running = sh.scheduler.running();
        Ok(Response::new(LoadReport {
            worker_id: sh.record.id.clone(),
            role: WorkerRole::Decode as i32,
            running_requests: running as u32,
            queued_requests: self.holding.load(Ordering::SeqCst).saturating_sub(running) as u32,
            queued_tokens: 0,
            kv_blocks_total: s.total_blocks as u32,
            kv_blocks_free: s.free_blocks as u32,
            draining: sh.drain.is_draining(),
            cached_prefix_hashes: Vec::new(),
            mtp_acceptance_rate: sh.metrics.acceptance_rate() as f32,
        }))
    }

    async fn get_info(&self, _req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.shared.record.to_info()))
    }
}
