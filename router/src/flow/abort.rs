//! Aborts a request on its workers when the attempt ends early (client gone, stop string, timeout,
//! retry elsewhere). Runs on drop, so no exit path can forget it.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::AbortRequest;
use tracing::debug;

use crate::workers::WorkerHandle;

pub struct AbortGuard {
    pub request_id: String,
    pub prefill: Option<Arc<WorkerHandle>>,
    pub decode: Option<Arc<WorkerHandle>>,
    pub reason: &'static str,
}

impl AbortGuard {
    pub fn new(request_id: &str) -> Self {
        Self { request_id: request_id.to_owned(), prefill: None, decode: None, reason: "client disconnected" }
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        let (p, d) = (self.prefill.take(), self.decode.take());
        if p.is_none() && d.is_none() {
            return;
        }
        let (id, reason) = (self.request_id.clone(), self.reason);
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            let req = || {
                let mut r = tonic::Request::new(AbortRequest { request_id: id.clone(), reason: reason.into() });
                crate::request_id::tag(&mut r, &id);
                r.set_timeout(Duration::from_secs(2));
                r
            };
            if let Some(w) = p {
                let r = w.prefill_client().abort(req()).await;
                debug!(worker = %w.id, request_id = %id, found = r.map(|x| x.into_inner().found).unwrap_or(false), "prefill abort");
            }
            if let Some(w) = d {
                let r = w.decode_client().abort(req()).await;
                debug!(worker = %w.id, request_id = %id, found = r.map(|x| x.into_inner().found).unwrap_or(false), "decode abort");
            }
        });
    }
}
