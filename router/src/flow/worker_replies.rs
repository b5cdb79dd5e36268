//! Reading what workers answer, for the attempt's states: a refused reservation, a finish reason, the
//! stage timings they measured, and the rest of a finished Decode stream.

use std::time::Duration;

use proto::v1::{DecodeEvent, RefusalReason, StageTimings};
use tonic::Code;

use super::attempt::AttemptEnd;
use super::output::FinishReason;
use super::select::Pair;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::workers::is_worker_fault;

pub fn finish_reason(code: i32) -> FinishReason {
    match proto::v1::FinishReason::try_from(code) {
        Ok(proto::v1::FinishReason::Length) => FinishReason::Length,
        Ok(proto::v1::FinishReason::Abort) => FinishReason::Abort,
        _ => FinishReason::Stop,
    }
}

/// The worker said it has no room (its typed refusal). RESOURCE_EXHAUSTED without it comes from the
/// HTTP/2 layer (GOAWAY ENHANCE_YOUR_CALM) and is a connection failure instead.
pub fn is_full(status: &tonic::Status) -> bool {
    status.code() == Code::ResourceExhausted && proto::refusal::reason(status) == Some(RefusalReason::NoRoom)
}

/// The decode worker refused to open the request: another decode worker (full, unreachable), or a
/// failure to report.
pub fn decode_refused(status: &tonic::Status, pair: &Pair) -> AttemptEnd {
    let full = is_full(status);
    if is_worker_fault(status) {
        pair.decode.breaker.failure();
    }
    if full || is_worker_fault(status) || status.code() == Code::ResourceExhausted {
        AttemptEnd::RetryDecode { why: format!("{:?}: {}", status.code(), status.message()), full }
    } else if status.code() == Code::InvalidArgument {
        AttemptEnd::Failed(ApiError::invalid(format!("decode worker rejected the request: {}", status.message())))
    } else {
        AttemptEnd::Failed(ApiError::upstream(format!("decode worker {}: {}", pair.decode.id, status.message())))
    }
}

/// Records the workers' per-request stage timings in the metrics and in the request's log span.
pub fn observe_timings(m: &Metrics, t: &StageTimings) {
    let s = |us: u64| us as f64 / 1e6;
    let ms = |us: u64| us as f64 / 1e3;
    if t.prefill_us > 0 {
        m.stage.with_label_values(&["prefill_queue"]).observe(s(t.prefill_queue_us));
        m.stage.with_label_values(&["prefill"]).observe(s(t.prefill_us));
        // Both workers report the transfer; the prefill side's figure is counted (the decode side's is
        // the same transfer, seen from the other end, and only logged).
        if t.transfer_us > 0 {
            m.stage.with_label_values(&["kv_transfer"]).observe(s(t.transfer_us));
            m.kv_transfer_bytes.inc_by(t.transfer_bytes);
        }
        tracing::info!(
            queue_ms = ms(t.prefill_queue_us),
            prefill_ms = ms(t.prefill_us),
            cached_tokens = t.cached_tokens,
            transfer_ms = ms(t.transfer_us),
            transfer_bytes = t.transfer_bytes,
            "prefill stages"
        );
    }
    if t.first_decode_step_us > 0 {
        m.stage.with_label_values(&["first_decode_step"]).observe(s(t.first_decode_step_us));
        tracing::info!(
            transfer_ms = ms(t.transfer_us),
            first_decode_step_ms = ms(t.first_decode_step_us),
            "decode stages"
        );
    }
}

/// Reads the rest of a finished Decode stream (its trailers) in the background. Dropping it unread
/// would reset the HTTP/2 stream, and servers treat many resets as abuse (hyper answers a burst of them
/// with GOAWAY ENHANCE_YOUR_CALM, failing every request on the connection).
pub fn drain(mut stream: tonic::Streaming<DecodeEvent>) {
    tokio::spawn(async move {
        let _ =
            tokio::time::timeout(Duration::from_secs(5), async { while let Ok(Some(_)) = stream.message().await {} })
                .await;
    });
}
