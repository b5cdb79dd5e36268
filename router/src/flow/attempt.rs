//! Stage 2: one try on one pair. Decode reserves -> prefill ships the caches -> tokens stream from decode.

use std::time::Duration;

use proto::v1::decode_event::Event as DecodeEv;
use proto::v1::{DecodeRequest, PrefillRequest, RefusalReason, StageTimings};
use tokio::sync::mpsc;
use tonic::Code;
use tracing::{debug, warn};

use super::abort::AbortGuard;
use super::output::{Control, FinishReason, Output};
use super::select::Pair;
use super::{Event, Limits, TokenizedRequest};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::workers::is_worker_fault;

pub struct AttemptInput<'a> {
    pub request: &'a TokenizedRequest,
    /// 0 for the first attempt; retries and re-prefills count up.
    pub attempt: u32,
    pub hashes: &'a [u64],
    pub pair: &'a Pair,
    pub limits: &'a Limits,
    pub metrics: &'a Metrics,
}

pub enum AttemptEnd {
    /// Finished (normally or by a stop string); events were sent.
    Done,
    ClientGone,
    Failed(ApiError),
    /// The decode worker gave the request back; prefill prompt + generated again on any pair.
    Preempted(String),
    /// Prefill failed before producing the first token of this attempt.
    RetryPrefill(String),
    /// The decode worker could not reserve (full) or could not be reached.
    RetryDecode {
        why: String,
        full: bool,
    },
}

/// Adds the request id as gRPC metadata, so worker logs carry it even before the body is parsed.
pub fn tag<T>(req: &mut tonic::Request<T>, request_id: &str) {
    if let Ok(v) = request_id.parse() {
        req.metadata_mut().insert(crate::request_id::HEADER, v);
    }
}

fn finish_reason(code: i32) -> FinishReason {
    match proto::v1::FinishReason::try_from(code) {
        Ok(proto::v1::FinishReason::Length) => FinishReason::Length,
        Ok(proto::v1::FinishReason::Abort) => FinishReason::Abort,
        _ => FinishReason::Stop,
    }
}

/// Records the workers' per-request stage timings in the metrics and in the request's log span.
fn observe_timings(m: &Metrics, t: &StageTimings) {
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

/// The worker said it has no room (its typed refusal). RESOURCE_EXHAUSTED without it comes from the
/// HTTP/2 layer (GOAWAY ENHANCE_YOUR_CALM) and is a connection failure instead.
fn is_full(status: &tonic::Status) -> bool {
    status.code() == Code::ResourceExhausted && proto::refusal::reason(status) == Some(RefusalReason::NoRoom)
}

fn decode_refused(status: &tonic::Status, pair: &Pair) -> AttemptEnd {
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

/// Reads the rest of a finished Decode stream (its trailers) in the background. Dropping it unread
/// would reset the HTTP/2 stream, and servers treat many resets as abuse (hyper answers a burst of them
/// with GOAWAY ENHANCE_YOUR_CALM, failing every request on the connection).
fn drain(mut stream: tonic::Streaming<proto::v1::DecodeEvent>) {
    tokio::spawn(async move {
        let _ =
            tokio::time::timeout(Duration::from_secs(5), async { while let Ok(Some(_)) = stream.message().await {} })
                .await;
    });
}

/// The next Decode event; never resolves once the stream was handed to [`drain`].
async fn next(
    stream: &mut Option<tonic::Streaming<proto::v1::DecodeEvent>>,
) -> Result<Option<proto::v1::DecodeEvent>, tonic::Status> {
    match stream {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

pub async fn run(input: AttemptInput<'_>, out: &mut Output, tx: &mpsc::UnboundedSender<Event>) -> AttemptEnd {
    let AttemptInput { request, attempt, hashes, pair, limits, metrics } = input;
    // Workers key reservations, transfers and aborts by request id. A retry gets its own id
    // (`<id>.<attempt>`), so the previous attempt's late abort or cleanup can never hit it.
    let attempt_id =
        if attempt == 0 { request.request_id.clone() } else { format!("{}.{attempt}", request.request_id) };
    let rid = attempt_id.as_str();
    let num_generated = out.generated().len();
    let mut seq = Vec::with_capacity(request.prompt.len() + num_generated);
    seq.extend_from_slice(&request.prompt);
    seq.extend_from_slice(out.generated());
    let tokens = seq.len() as u64;
    let mut guard = AbortGuard::new(rid);

    // Reserve on the decode worker.
    let _decode_flight = pair.decode.begin(tokens);
    let mut dreq = tonic::Request::new(DecodeRequest {
        request_id: rid.to_owned(),
        token_ids: seq.clone(),
        sampling: Some(request.sampling.clone()),
        num_generated: num_generated as u32,
        num_prompt_tokens: request.prompt.len() as u32,
        transfer_timeout_ms: limits.prefill_timeout.as_millis().min(u32::MAX as u128) as u32,
    });
    tag(&mut dreq, rid);
    guard.decode = Some(pair.decode.clone());
    let mut dclient = pair.decode.decode_client();
    let opened = tokio::select! {
        r = dclient.decode(dreq) => r,
        _ = tx.closed() => return AttemptEnd::ClientGone,
    };
    let mut stream = match opened {
        Ok(s) => Some(s.into_inner()),
        Err(status) => {
            guard.decode = None;
            return decode_refused(&status, pair);
        }
    };
    let first = tokio::select! {
        m = next(&mut stream) => m,
        _ = tx.closed() => return AttemptEnd::ClientGone,
        _ = tokio::time::sleep(limits.prefill_timeout) => {
            guard.reason = "reservation timed out";
            pair.decode.breaker.failure();
            return AttemptEnd::RetryDecode { why: "no reservation answer in time".into(), full: false };
        }
    };
    let transfer = match first {
        Ok(Some(proto::v1::DecodeEvent { event: Some(DecodeEv::Reserved(r)) })) => r.transfer,
        Ok(Some(other)) => {
            guard.reason = "protocol error";
            return AttemptEnd::Failed(ApiError::upstream(format!(
                "decode worker {} sent {:?} before Reserved",
                pair.decode.id, other.event
            )));
        }
        Ok(None) => {
            pair.decode.breaker.failure();
            return AttemptEnd::RetryDecode { why: "stream closed before Reserved".into(), full: false };
        }
        Err(status) => return decode_refused(&status, pair),
    };
    debug!(decode = %pair.decode.id, prefill = %pair.prefill.id, "reserved");

    // Prefill with the descriptor, while reading the decode stream.
    let _prefill_flight = pair.prefill.begin(tokens);
    pair.prefill.note_routed(hashes);
    let mut preq = tonic::Request::new(PrefillRequest {
        request_id: rid.to_owned(),
        token_ids: seq,
        sampling: Some(request.sampling.clone()),
        transfer,
        num_generated: num_generated as u32,
        num_prompt_tokens: request.prompt.len() as u32,
    });
    tag(&mut preq, rid);
    preq.set_timeout(limits.prefill_timeout);
    guard.prefill = Some(pair.prefill.clone());
    let mut pclient = pair.prefill.prefill_client();
    let prefill = tokio::time::timeout(limits.prefill_timeout + Duration::from_secs(1), pclient.prefill(preq));
    tokio::pin!(prefill);
    let mut prefill_pending = true;
    let mut decode_open = true;
    // A Finished that overtook the prefill reply (the request ended in prefill): applied after it.
    let mut early_finish: Option<FinishReason> = None;
    loop {
        tokio::select! {
            _ = tx.closed() => return AttemptEnd::ClientGone,
            r = &mut prefill, if prefill_pending => {
                prefill_pending = false;
                guard.prefill = None;
                let progressed = out.generated().len() > num_generated;
                let resp = match r {
                    Ok(Ok(resp)) => resp.into_inner(),
                    Ok(Err(status)) if !progressed => {
                        if is_worker_fault(&status) {
                            pair.prefill.breaker.failure();
                        }
                        guard.prefill = Some(pair.prefill.clone());
                        guard.reason = "prefill failed; retrying elsewhere";
                        return match status.code() {
                            Code::InvalidArgument => AttemptEnd::Failed(ApiError::invalid(format!(
                                "prefill worker rejected the request: {}", status.message()))),
                            _ => AttemptEnd::RetryPrefill(format!("{:?}: {}", status.code(), status.message())),
                        };
                    }
                    Err(_) if !progressed => {
                        pair.prefill.breaker.failure();
                        guard.prefill = Some(pair.prefill.clone());
                        guard.reason = "prefill timed out; retrying elsewhere";
                        return AttemptEnd::RetryPrefill("prefill timed out".into());
                    }
                    // Tokens are already flowing from decode, so the caches arrived: a lost reply is harmless.
                    Ok(Err(_)) | Err(_) => {
                        warn!(worker = %pair.prefill.id, "prefill reply lost after decoding started; continuing");
                        continue;
                    }
                };
                pair.prefill.breaker.success();
                if let Some(t) = &resp.timings {
                    observe_timings(metrics, t);
                    out.set_cached_tokens(t.cached_tokens);
                }
                // The first token's one source: the decode stream, unless prefill ended the request
                // (then the reservation was released and no decode stream carries it).
                if resp.finished && let Some(tok) = resp.first_token {
                    match out.push(std::slice::from_ref(&tok)).await {
                        Control::Continue => {}
                        Control::Stop => { guard.reason = "stop string matched"; return AttemptEnd::Done; }
                        Control::ClientGone => return AttemptEnd::ClientGone,
                    }
                }
                let end = if resp.finished { Some(finish_reason(resp.finish_reason)) } else { early_finish };
                if let Some(reason) = end {
                    // The prefill worker already released the decode reservation.
                    guard.decode = None;
                    return match out.finish(reason).await {
                        Control::ClientGone => AttemptEnd::ClientGone,
                        _ => AttemptEnd::Done,
                    };
                }
                if !decode_open {
                    guard.reason = "decode stream ended early";
                    return AttemptEnd::Failed(ApiError::upstream(format!(
                        "decode worker {} closed the stream without finishing the request", pair.decode.id)));
                }
            }
            m = next(&mut stream), if decode_open && early_finish.is_none() => {
                let ev = match m {
                    Ok(Some(ev)) => ev.event,
                    // Released because prefill ended the request: its reply says so.
                    Ok(None) if prefill_pending => {
                        decode_open = false;
                        continue;
                    }
                    Ok(None) => {
                        pair.decode.breaker.failure();
                        guard.reason = "decode stream ended early";
                        return AttemptEnd::Failed(ApiError::upstream(format!(
                            "decode worker {} closed the stream without finishing the request", pair.decode.id)));
                    }
                    Err(status) => {
                        if is_worker_fault(&status) {
                            pair.decode.breaker.failure();
                        }
                        guard.reason = "decode failed";
                        if prefill_pending && out.generated().len() == num_generated && is_full(&status) {
                            return AttemptEnd::RetryDecode { why: status.message().to_owned(), full: true };
                        }
                        return AttemptEnd::Failed(ApiError::upstream(format!(
                            "decode worker {} failed: {}", pair.decode.id, status.message())));
                    }
                };
                match ev {
                    Some(DecodeEv::Tokens(t)) => {
                        match out.push(&t.tokens).await {
                            Control::Continue => {}
                            Control::Stop => { guard.reason = "stop string matched"; return AttemptEnd::Done; }
                            Control::ClientGone => return AttemptEnd::ClientGone,
                        }
                    }
                    Some(DecodeEv::Finished(f)) => {
                        guard.decode = None;
                        pair.decode.breaker.success();
                        if let Some(s) = stream.take() {
                            drain(s);
                        }
                        if let Some(t) = &f.timings {
                            observe_timings(metrics, t);
                        }
                        let reason = finish_reason(f.reason);
                        if prefill_pending && f.reason != proto::v1::FinishReason::Error as i32 {
                            early_finish = Some(reason);
                            continue;
                        }
                        guard.prefill = None;
                        if f.reason == proto::v1::FinishReason::Error as i32 {
                            return AttemptEnd::Failed(ApiError::upstream(format!(
                                "decode worker {} failed the request: {}", pair.decode.id, f.error)));
                        }
                        return match out.finish(reason).await {
                            Control::ClientGone => AttemptEnd::ClientGone,
                            _ => AttemptEnd::Done,
                        };
                    }
                    Some(DecodeEv::Preempted(p)) => {
                        guard.decode = None;
                        return AttemptEnd::Preempted(p.reason);
                    }
                    Some(DecodeEv::Reserved(_)) | None => warn!(worker = %pair.decode.id, "unexpected decode event ignored"),
                }
            }
        }
    }
}
