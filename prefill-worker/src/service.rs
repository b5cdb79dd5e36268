//! The `tandem.v1.PrefillWorker` gRPC service: validates, queues the prefill and answers when the
//! caches are delivered (or the request ended in prefill). A cancelled call aborts the prefill and its
//! transfer.

use std::sync::Arc;
use std::time::Instant;

use kv_transfer::TransferError;
use proto::v1::prefill_worker_server::PrefillWorker;
use proto::v1::{
    AbortRequest, AbortResponse, InfoRequest, LoadReport, LoadRequest, PrefillRequest, PrefillResponse, WorkerInfo,
    WorkerRole,
};
use tonic::{Request, Response, Status};
use worker::{Drain, LoadedModel};

use crate::scheduler::{Admitted, PrefillError, Reply, Scheduler};

/// The gRPC status of a prefill that did not deliver.
pub(crate) fn status(e: &PrefillError) -> Status {
    let msg = e.to_string();
    match e {
        PrefillError::Aborted | PrefillError::CallerGone => Status::cancelled(msg),
        PrefillError::NoBlocks(_) => proto::refusal::no_room(msg),
        PrefillError::Compute(_) | PrefillError::NoToken => Status::internal(msg),
        // Another prefill worker can serve it.
        PrefillError::Device(_) => Status::unavailable(msg),
        PrefillError::Transfer(t) => match t {
            TransferError::BadDescriptor { .. } => Status::invalid_argument(msg),
            TransferError::FingerprintMismatch(_) => Status::failed_precondition(msg),
            TransferError::DeadlineExceeded(_) => Status::deadline_exceeded(msg),
            TransferError::Aborted { .. } => Status::cancelled(msg),
            TransferError::Rejected { .. } | TransferError::BadCompletion { .. } => Status::failed_precondition(msg),
            _ => Status::unavailable(msg),
        },
    }
}

pub struct PrefillService {
    pub model: Arc<LoadedModel>,
    pub scheduler: Arc<Scheduler>,
    pub drain: Arc<Drain>,
    pub record: cluster::WorkerRecord,
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    async fn prefill(&self, req: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let id = worker::validate::request_id(&req, &req.get_ref().request_id)?;
        let guard = self.drain.admit()?;
        let r = req.into_inner();
        let cfg = self.model.config();
        let prompt_len = worker::validate::tokens(&r.token_ids, r.num_prompt_tokens, cfg.vocab_size)?;
        if r.token_ids.len() >= self.model.max_model_len {
            return Err(Status::invalid_argument(format!(
                "{} tokens do not fit the maximum context length {}",
                r.token_ids.len(),
                self.model.max_model_len
            )));
        }
        let params = worker::convert::sampling_params(&r.sampling.unwrap_or_default(), &id);
        params.validate(cfg.vocab_size).map_err(Status::invalid_argument)?;
        let descriptor = r.transfer.ok_or_else(|| Status::invalid_argument("no transfer descriptor"))?;
        if descriptor.request_id != id {
            return Err(Status::invalid_argument(format!(
                "the transfer descriptor is for request {}, not {id}",
                descriptor.request_id
            )));
        }
        if descriptor.num_tokens as usize != r.token_ids.len() {
            return Err(Status::invalid_argument(format!(
                "the descriptor expects {} tokens, the request has {}",
                descriptor.num_tokens,
                r.token_ids.len()
            )));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let admitted = Admitted {
            id: id.clone(),
            tokens: r.token_ids,
            prompt_len,
            params,
            descriptor,
            reply: Reply::new(tx),
            guard,
            arrived: Instant::now(),
        };
        if self.scheduler.submit(admitted).is_err() {
            return Err(Status::internal("the prefill loop is not running"));
        }
        match rx.await {
            Ok(r) => r.map(Response::new).map_err(|e| status(&e)),
            Err(_) => Err(Status::internal("the prefill loop dropped the request")),
        }
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let r = req.into_inner();
        let found = self.model.pool.holds(&r.request_id);
        self.scheduler.abort(&r.request_id);
        tracing::info!(request_id = %r.request_id, reason = %r.reason, "abort requested");
        Ok(Response::new(AbortResponse { found }))
    }

    async fn get_load(&self, _req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        let l = self.scheduler.load();
        let s = self.model.pool.stats();
        Ok(Response::new(LoadReport {
            worker_id: self.record.id.clone(),
            role: WorkerRole::Prefill as i32,
            running_requests: l.running as u32,
            queued_requests: l.queued as u32,
            queued_tokens: l.queued_tokens,
            kv_blocks_total: s.total_blocks as u32,
            kv_blocks_free: s.free_blocks as u32,
            draining: self.drain.is_draining(),
            cached_prefix_hashes: l.cached_hashes,
            mtp_acceptance_rate: 0.0,
        }))
    }

    async fn get_info(&self, _req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(self.record.to_info()))
    }
}
