//! Worker doubles. A decode double reserves (answers `Reserved` with a descriptor), waits until a
//! prefill double "transfers" to it (an in-process hand-off keyed by the transfer token), then streams
//! a scripted reply. Knobs inject the failures the router must survive, and every call, abort and
//! cancellation is recorded for assertions.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use proto::v1::decode_event::Event as Ev;
use proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use proto::v1::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use proto::v1::*;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};

/// What the model "says": the output tokens for a prompt (EOS included when it should stop).
pub type Script = Arc<dyn Fn(&[u32]) -> Vec<u32> + Send + Sync>;

/// Fault and pacing knobs, shared by all clones of a double; change them while a test runs.
pub struct Knobs {
    /// Gap between decode tokens.
    pub token_interval_us: AtomicU64,
    /// Prefill sleeps this long before answering.
    pub prefill_delay_ms: AtomicU64,
    /// The next N Prefill calls fail with UNAVAILABLE.
    pub prefill_failures: AtomicU32,
    /// The next N Prefill calls lose their transfer: the decode side reports it first (a `Finished` with
    /// reason ERROR, as a real decode worker does), then the Prefill call fails.
    pub transfer_failures: AtomicU32,
    /// Decode refuses reservations with RESOURCE_EXHAUSTED.
    pub decode_full: AtomicBool,
    /// Decode preempts once after this many streamed tokens (0 = never).
    pub preempt_after: AtomicU32,
    /// Tokens per Tokens event (MTP-like batches).
    pub tokens_per_event: AtomicU32,
    /// The decode stream fails with INTERNAL after this many streamed tokens (0 = never): a crash.
    pub fail_after: AtomicU32,
    /// The longest sequence GetInfo reports (read when the router first asks).
    pub max_model_len: AtomicU32,
    /// Preempting also turns `decode_full` on (a worker out of blocks stays full for a while).
    pub full_after_preempt: AtomicBool,
    /// The RESOURCE_EXHAUSTED message of a full decode double (after its id).
    pub full_reason: Mutex<String>,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            token_interval_us: AtomicU64::new(0),
            prefill_delay_ms: AtomicU64::new(0),
            prefill_failures: AtomicU32::new(0),
            transfer_failures: AtomicU32::new(0),
            decode_full: AtomicBool::new(false),
            preempt_after: AtomicU32::new(0),
            tokens_per_event: AtomicU32::new(1),
            fail_after: AtomicU32::new(0),
            max_model_len: AtomicU32::new(4096),
            full_after_preempt: AtomicBool::new(false),
            full_reason: Mutex::new("no free KV blocks".into()),
        }
    }
}

/// What a double saw.
#[derive(Default)]
pub struct Log {
    /// (request_id field, x-request-id metadata, token_ids, sampling) of each Prefill / Decode call.
    pub prefills: Vec<(String, String, Vec<u32>, SamplingParams)>,
    pub decodes: Vec<(String, String, Vec<u32>, SamplingParams)>,
    pub aborts: Vec<String>,
    /// Decode streams the router dropped before they finished.
    pub cancelled: Vec<String>,
}

/// The in-process stand-in for kv-transfer: reservations waiting for their prefill.
#[derive(Default)]
pub struct Fabric {
    waiting: Mutex<HashMap<Vec<u8>, oneshot::Sender<Handoff>>>,
}

enum Handoff {
    /// Caches written; decoding may start.
    Complete,
    /// Prefill finished the request; release the blocks.
    Release,
    /// The transfer failed (the reason).
    Fail(String),
}

pub struct Double {
    pub id: String,
    pub role: WorkerRole,
    pub addr: SocketAddr,
    pub knobs: Arc<Knobs>,
    pub log: Arc<Mutex<Log>>,
    pub fingerprint: ModelFingerprint,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Double {
    pub fn grpc_address(&self) -> String {
        self.addr.to_string()
    }

    /// Stops serving (as if the process died).
    pub fn kill(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }

    pub fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap()
    }
}

impl Drop for Double {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn fingerprint(model: &str, hash: &str) -> ModelFingerprint {
    ModelFingerprint {
        model_name: model.into(),
        checkpoint_hash: hash.into(),
        precision: "full".into(),
        block_size: 64,
        num_layers: 2,
        kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
    }
}

#[derive(Clone)]
struct Shared {
    id: String,
    script: Script,
    eos: u32,
    knobs: Arc<Knobs>,
    log: Arc<Mutex<Log>>,
    fabric: Arc<Fabric>,
    fingerprint: ModelFingerprint,
    running: Arc<AtomicU32>,
    cached: Arc<Mutex<HashSet<u64>>>,
}

fn meta_id<T>(r: &Request<T>) -> String {
    r.metadata().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

fn token(id: u32, position: usize, sampling: &SamplingParams) -> GeneratedToken {
    let logprobs = sampling.logprobs.map(|n| Logprobs {
        chosen: Some(TokenLogprob { token_id: id, logprob: -0.25 - position as f32 * 0.01 }),
        top: (0..n).map(|k| TokenLogprob { token_id: (id + k) % 256 + 7, logprob: -1.0 - k as f32 }).collect(),
    });
    GeneratedToken { token_id: id, logprobs }
}

/// The full output for a request as the scripted model produces it under `sampling`.
fn output(s: &Shared, prompt: &[u32], sampling: &SamplingParams) -> (Vec<u32>, FinishReason) {
    let mut script = (s.script)(prompt);
    if sampling.ignore_eos {
        script.retain(|&t| t != s.eos);
        if script.is_empty() {
            script.push(42);
        }
    }
    let max = sampling.max_tokens.max(1) as usize;
    let mut out = Vec::new();
    for (i, t) in script.iter().cycle().enumerate() {
        if i >= max {
            return (out, FinishReason::Length);
        }
        out.push(*t);
        if (*t == s.eos && !sampling.ignore_eos) || sampling.stop_token_ids.contains(t) {
            return (out, FinishReason::Stop);
        }
        if !sampling.ignore_eos && i + 1 >= script.len() {
            return (out, FinishReason::Stop);
        }
    }
    (out, FinishReason::Stop)
}

struct PrefillDouble(Shared);
struct DecodeDouble(Shared);

fn info(s: &Shared, role: WorkerRole, addr: &str) -> WorkerInfo {
    WorkerInfo {
        worker_id: s.id.clone(),
        role: role as i32,
        fingerprint: Some(s.fingerprint.clone()),
        max_num_seqs: 256,
        kv_blocks_total: 1000,
        max_model_len: s.knobs.max_model_len.load(Ordering::Relaxed),
        grpc_address: addr.to_owned(),
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillDouble {
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let s = &self.0;
        let meta = meta_id(&request);
        let req = request.into_inner();
        let logged = req.sampling.clone().unwrap_or_default();
        s.log.lock().unwrap().prefills.push((req.request_id.clone(), meta, req.token_ids.clone(), logged));
        let delay = s.knobs.prefill_delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if s.knobs.prefill_failures.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
            return Err(Status::unavailable(format!("{}: injected prefill failure", s.id)));
        }
        let t = req.transfer.ok_or_else(|| Status::invalid_argument("no transfer descriptor"))?;
        if t.fingerprint.as_ref() != Some(&s.fingerprint) {
            return Err(Status::failed_precondition("fingerprint mismatch"));
        }
        if s.knobs.transfer_failures.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
            if let Some(sender) = s.fabric.waiting.lock().unwrap().remove(&t.transfer_token) {
                let _ = sender.send(Handoff::Fail(format!("cache transfer failed: {}: injected", s.id)));
            }
            // The decode side's report reaches the router first.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Err(Status::unavailable(format!("{}: injected transfer failure", s.id)));
        }
        let sampling = req.sampling.unwrap_or_default();
        let prompt = &req.token_ids[..req.num_prompt_tokens as usize];
        let (out, reason) = output(s, prompt, &sampling);
        let pos = req.num_generated as usize;
        let first = out.get(pos).copied().ok_or_else(|| Status::invalid_argument("nothing left to generate"))?;
        let finished = pos + 1 == out.len();
        s.cached.lock().unwrap().extend(cluster::prefix_hash::prefix_hashes(prompt));
        let sender = s.fabric.waiting.lock().unwrap().remove(&t.transfer_token);
        let Some(sender) = sender else { return Err(Status::not_found("reservation not found (expired?)")) };
        let _ = sender.send(if finished { Handoff::Release } else { Handoff::Complete });
        Ok(Response::new(PrefillResponse {
            first_token: Some(token(first, pos, &sampling)),
            finished,
            finish_reason: if finished { reason as i32 } else { 0 },
            timings: Some(StageTimings {
                prefill_us: 100,
                transfer_us: 50,
                transfer_bytes: 4096,
                ..Default::default()
            }),
        }))
    }

    async fn abort(&self, request: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.0.log.lock().unwrap().aborts.push(request.into_inner().request_id);
        Ok(Response::new(AbortResponse { found: true }))
    }

    async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        let cached = self.0.cached.lock().unwrap().iter().copied().collect();
        Ok(Response::new(LoadReport {
            worker_id: self.0.id.clone(),
            role: WorkerRole::Prefill as i32,
            cached_prefix_hashes: cached,
            ..Default::default()
        }))
    }

    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(info(&self.0, WorkerRole::Prefill, "")))
    }
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for DecodeDouble {
    type DecodeStream = DecodeStream;

    async fn decode(&self, request: Request<DecodeRequest>) -> Result<Response<DecodeStream>, Status> {
        let s = self.0.clone();
        let meta = meta_id(&request);
        let req = request.into_inner();
        let sampling = req.sampling.clone().unwrap_or_default();
        s.log.lock().unwrap().decodes.push((req.request_id.clone(), meta, req.token_ids.clone(), sampling.clone()));
        if s.knobs.decode_full.load(Ordering::Relaxed) {
            let why = s.knobs.full_reason.lock().unwrap().clone();
            return Err(proto::refusal::no_room(format!("{}: {why}", s.id)));
        }
        let transfer_token = rand::random::<[u8; 16]>().to_vec();
        let (done_tx, done_rx) = oneshot::channel();
        s.fabric.waiting.lock().unwrap().insert(transfer_token.clone(), done_tx);
        let (tx, rx) = mpsc::channel::<Result<DecodeEvent, Status>>(64);
        let descriptor = TransferDescriptor {
            request_id: req.request_id.clone(),
            transfer_token,
            fingerprint: Some(s.fingerprint.clone()),
            num_tokens: req.token_ids.len() as u32,
            block_ids: (0..req.token_ids.len().div_ceil(64) as u32).collect(),
            ..Default::default()
        };
        let _ = tx.send(Ok(DecodeEvent { event: Some(Ev::Reserved(Reserved { transfer: Some(descriptor) })) })).await;
        tokio::spawn(async move {
            s.running.fetch_add(1, Ordering::Relaxed);
            let rid = req.request_id.clone();
            let finished = run_decode(&s, req, sampling, done_rx, &tx).await;
            s.running.fetch_sub(1, Ordering::Relaxed);
            if !finished {
                s.log.lock().unwrap().cancelled.push(rid);
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn abort(&self, request: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        self.0.log.lock().unwrap().aborts.push(request.into_inner().request_id);
        Ok(Response::new(AbortResponse { found: true }))
    }

    async fn get_load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        let running = self.0.running.load(Ordering::Relaxed);
        Ok(Response::new(LoadReport {
            worker_id: self.0.id.clone(),
            role: WorkerRole::Decode as i32,
            running_requests: running,
            kv_blocks_total: 1000,
            kv_blocks_free: 1000 - running.min(1000),
            ..Default::default()
        }))
    }

    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        Ok(Response::new(info(&self.0, WorkerRole::Decode, "")))
    }
}

/// Streams the reply; returns false when the router went away first.
async fn run_decode(
    s: &Shared,
    req: DecodeRequest,
    sampling: SamplingParams,
    done: oneshot::Receiver<Handoff>,
    tx: &mpsc::Sender<Result<DecodeEvent, Status>>,
) -> bool {
    let handoff = tokio::select! {
        h = done => h,
        _ = tx.closed() => return false,
    };
    match handoff {
        Ok(Handoff::Complete) => {}
        Ok(Handoff::Release) => return true,
        Ok(Handoff::Fail(error)) => {
            let fin = Finished { reason: FinishReason::Error as i32, error, ..Default::default() };
            return tx.send(Ok(DecodeEvent { event: Some(Ev::Finished(fin)) })).await.is_ok();
        }
        Err(_) => return tx.is_closed(),
    }
    let prompt = &req.token_ids[..req.num_prompt_tokens as usize];
    let (out, reason) = output(s, prompt, &sampling);
    let interval = Duration::from_micros(s.knobs.token_interval_us.load(Ordering::Relaxed));
    let per_event = s.knobs.tokens_per_event.load(Ordering::Relaxed).max(1) as usize;
    let preempt_after = s.knobs.preempt_after.swap(0, Ordering::AcqRel) as usize;
    let fail_after = s.knobs.fail_after.load(Ordering::Relaxed) as usize;
    let mut pos = req.num_generated as usize;
    let mut streamed = 0usize;
    while pos < out.len() {
        if !interval.is_zero() && streamed > 0 {
            tokio::time::sleep(interval).await;
        }
        if fail_after > 0 && streamed >= fail_after {
            return tx.send(Err(Status::internal("decode worker crashed (injected)"))).await.is_ok();
        }
        if preempt_after > 0 && streamed >= preempt_after {
            if s.knobs.full_after_preempt.load(Ordering::Relaxed) {
                s.knobs.decode_full.store(true, Ordering::Relaxed);
            }
            let ev = Ev::Preempted(Preempted { reason: "out of blocks (injected)".into() });
            return tx.send(Ok(DecodeEvent { event: Some(ev) })).await.is_ok();
        }
        let end = (pos + per_event).min(out.len());
        let tokens = (pos..end).map(|p| token(out[p], p, &sampling)).collect();
        if tx.send(Ok(DecodeEvent { event: Some(Ev::Tokens(Tokens { tokens })) })).await.is_err() {
            return false;
        }
        streamed += end - pos;
        pos = end;
    }
    let fin = Finished { reason: reason as i32, completion_tokens: out.len() as u32, ..Default::default() };
    tx.send(Ok(DecodeEvent { event: Some(Ev::Finished(fin)) })).await.is_ok()
}

/// Starts a double on a free port.
pub async fn spawn(
    id: &str,
    role: WorkerRole,
    script: Script,
    eos: u32,
    fabric: Arc<Fabric>,
    fingerprint: ModelFingerprint,
) -> Double {
    spawn_tls(id, role, script, eos, fabric, fingerprint, None).await
}

/// [`spawn`], serving TLS through the workers' own accept loop (`tls::incoming`) when `tls` is given.
pub async fn spawn_tls(
    id: &str,
    role: WorkerRole,
    script: Script,
    eos: u32,
    fabric: Arc<Fabric>,
    fingerprint: ModelFingerprint,
    tls: Option<tls::ServerTls>,
) -> Double {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let knobs = Arc::new(Knobs::default());
    let log = Arc::new(Mutex::new(Log::default()));
    let shared = Shared {
        id: id.into(),
        script,
        eos,
        knobs: knobs.clone(),
        log: log.clone(),
        fabric,
        fingerprint: fingerprint.clone(),
        running: Arc::new(AtomicU32::new(0)),
        cached: Arc::new(Mutex::new(HashSet::new())),
    };
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    // hyper's default of 200 concurrent streams makes the server refuse (RST) the excess streams of a
    // busy router, and past 1024 refusals it closes the connection with GOAWAY ENHANCE_YOUR_CALM.
    // Real workers need the same two settings.
    let mut builder = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(100_000))
        .http2_max_pending_accept_reset_streams(Some(100_000));
    let router = match role {
        WorkerRole::Prefill => builder.add_service(PrefillWorkerServer::new(PrefillDouble(shared))),
        _ => builder.add_service(DecodeWorkerServer::new(DecodeDouble(shared))),
    };
    let stopped = async {
        let _ = stop_rx.await;
    };
    match tls {
        Some(tls) => {
            tokio::spawn(router.serve_with_incoming_shutdown(tls::incoming(listener, tls), stopped));
        }
        None => {
            let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, stopped));
        }
    }
    Double { id: id.into(), role, addr, knobs, log, fingerprint, shutdown: Some(stop_tx) }
}
