//! One worker as the router sees it: gRPC clients, last load report, health, breaker, and the router's
//! own count of requests it has in flight there (fresher than any poll).

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use cluster::WorkerRecord;
use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{LoadReport, ModelFingerprint, WorkerRole};
use tonic::transport::{Channel, Endpoint};

use super::Breaker;
use crate::policies::{Candidate, Load};

/// Prefix hashes the router itself sent to a prefill worker, so the next request with the same prefix
/// goes there before the worker's next load report says it is cached.
const ROUTED_MEMORY: usize = 8192;

pub struct WorkerHandle {
    pub id: String,
    pub role: WorkerRole,
    pub address: String,
    record: RwLock<WorkerRecord>,
    channels: Vec<Channel>,
    next_channel: AtomicUsize,
    pub breaker: Breaker,
    healthy: AtomicBool,
    poll_failures: AtomicU32,
    report: RwLock<LoadReport>,
    reported_hashes: RwLock<HashSet<u64>>,
    routed: Mutex<(HashSet<u64>, VecDeque<u64>)>,
    in_flight: AtomicU32,
    in_flight_tokens: AtomicU64,
}

/// Settings for new handles.
#[derive(Debug, Clone)]
pub struct HandleSettings {
    pub connections: usize,
    pub connect_timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_open: Duration,
    /// TLS to the workers (`--tls-*`); plaintext when `None`.
    pub tls: Option<tls::ClientTls>,
}

fn endpoint(address: &str, s: &HandleSettings) -> Result<Endpoint, tonic::transport::Error> {
    let uri = match &s.tls {
        Some(_) => tls::ClientTls::uri(address),
        None if address.contains("://") => address.to_owned(),
        None => format!("http://{address}"),
    };
    let ep = Endpoint::from_shared(uri)?;
    let ep = match &s.tls {
        Some(t) => t.apply(ep)?,
        None => ep,
    };
    Ok(ep
        .tcp_nodelay(true)
        .connect_timeout(s.connect_timeout)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        // h2 budgets the framing overhead of small DATA frames it holds unread (half the connection
        // window) and closes the connection with GOAWAY "too_many_data_frames" past it. A decode worker
        // streaming tokens for a thousand requests sends exactly that: many small frames. A large
        // window keeps the budget far above any realistic backlog.
        .initial_connection_window_size(Some(64 << 20))
        .initial_stream_window_size(Some(1 << 20))
        // Workers are trusted peers: hyper's anti-abuse limit on locally reset streams (1024, then
        // GOAWAY ENHANCE_YOUR_CALM for the whole connection) must not fail healthy traffic at high
        // concurrency, where every stop-string hit and client disconnect cancels a stream.
        .http2_max_local_error_reset_streams(None))
}

impl WorkerHandle {
    /// Builds lazily connecting channels (must run inside the tokio runtime).
    pub fn new(record: WorkerRecord, s: &HandleSettings) -> Result<Self, tonic::transport::Error> {
        let ep = endpoint(&record.grpc_address, s)?;
        let channels = (0..s.connections.max(1)).map(|_| ep.connect_lazy()).collect();
        // Registered workers (etcd) start usable; static ones become usable once GetInfo answered.
        let healthy = record.fingerprint.is_some();
        Ok(Self {
            id: record.id.clone(),
            role: record.role,
            address: record.grpc_address.clone(),
            record: RwLock::new(record),
            channels,
            next_channel: AtomicUsize::new(0),
            breaker: Breaker::new(s.breaker_failures, s.breaker_open),
            healthy: AtomicBool::new(healthy),
            poll_failures: AtomicU32::new(0),
            report: RwLock::new(LoadReport::default()),
            reported_hashes: RwLock::new(HashSet::new()),
            routed: Mutex::new((HashSet::new(), VecDeque::new())),
            in_flight: AtomicU32::new(0),
            in_flight_tokens: AtomicU64::new(0),
        })
    }

    fn channel(&self) -> Channel {
        let i = self.next_channel.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        self.channels[i].clone()
    }

    pub fn prefill_client(&self) -> PrefillWorkerClient<Channel> {
        PrefillWorkerClient::new(self.channel()).max_decoding_message_size(64 << 20)
    }

    pub fn decode_client(&self) -> DecodeWorkerClient<Channel> {
        DecodeWorkerClient::new(self.channel()).max_decoding_message_size(64 << 20)
    }

    /// Replaces the record, keeping a fingerprint learned through GetInfo when the new one has none.
    pub fn update_record(&self, mut r: WorkerRecord) {
        let mut cur = self.record.write().unwrap_or_else(|p| p.into_inner());
        if r.fingerprint.is_none() {
            r.fingerprint = cur.fingerprint.clone();
            if r.capacity == Default::default() {
                r.capacity = cur.capacity.clone();
            }
        }
        *cur = r;
    }

    pub fn fingerprint(&self) -> Option<ModelFingerprint> {
        self.record.read().unwrap_or_else(|p| p.into_inner()).fingerprint.clone()
    }

    /// The longest sequence the worker accepts, once known (registration or GetInfo).
    pub fn max_model_len(&self) -> Option<u32> {
        let len = self.record.read().unwrap_or_else(|p| p.into_inner()).capacity.max_model_len;
        (len > 0).then_some(len)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.report.read().unwrap_or_else(|p| p.into_inner()).draining
    }

    /// A successful poll.
    pub fn on_report(&self, report: LoadReport) {
        if !report.cached_prefix_hashes.is_empty() || self.role == WorkerRole::Prefill {
            let set: HashSet<u64> = report.cached_prefix_hashes.iter().copied().collect();
            *self.reported_hashes.write().unwrap_or_else(|p| p.into_inner()) = set;
        }
        *self.report.write().unwrap_or_else(|p| p.into_inner()) = report;
        self.poll_failures.store(0, Ordering::Relaxed);
        self.healthy.store(true, Ordering::Relaxed);
    }

    /// A failed poll; returns whether the worker is now considered unhealthy.
    pub fn on_poll_failure(&self, threshold: u32) -> bool {
        let n = self.poll_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= threshold.max(1) {
            self.healthy.store(false, Ordering::Relaxed);
        }
        !self.is_healthy()
    }

    pub fn mark_info_learned(&self) {
        self.healthy.store(true, Ordering::Relaxed);
    }

    /// Counts a request as in flight on this worker until the guard drops.
    pub fn begin(self: &Arc<Self>, tokens: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.in_flight_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.breaker.on_send();
        InFlight { worker: self.clone(), tokens }
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Remembers that a prompt with these block hashes was sent here.
    pub fn note_routed(&self, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        let mut g = self.routed.lock().unwrap_or_else(|p| p.into_inner());
        let (set, order) = &mut *g;
        for h in hashes {
            if set.insert(*h) {
                order.push_back(*h);
            }
        }
        while order.len() > ROUTED_MEMORY {
            if let Some(old) = order.pop_front() {
                set.remove(&old);
            }
        }
    }
}

/// RAII in-flight count.
pub struct InFlight {
    worker: Arc<WorkerHandle>,
    tokens: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.worker.in_flight_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

impl Candidate for WorkerHandle {
    fn id(&self) -> &str {
        &self.id
    }

    fn load(&self) -> Load {
        let r = self.report.read().unwrap_or_else(|p| p.into_inner());
        Load {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            in_flight_tokens: self.in_flight_tokens.load(Ordering::Relaxed),
            running: r.running_requests,
            queued: r.queued_requests,
            queued_tokens: r.queued_tokens,
            kv_blocks_total: r.kv_blocks_total,
            kv_blocks_free: r.kv_blocks_free,
        }
    }

    fn cached_blocks(&self, hashes: &[u64]) -> usize {
        let reported = self.reported_hashes.read().unwrap_or_else(|p| p.into_inner());
        let routed = self.routed.lock().unwrap_or_else(|p| p.into_inner());
        cluster::prefix_hash::matched_blocks(hashes, |h| reported.contains(&h) || routed.0.contains(&h))
    }
}
