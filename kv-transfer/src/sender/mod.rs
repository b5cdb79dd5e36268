//! The prefill worker's side: begin a session from a descriptor (handshake before any write), queue each
//! layer as compute finishes it (shipped in the background), then complete, release or abort. Every call
//! waits at most until the descriptor's deadline (plus a short grace for the final acknowledgement).

mod session;
mod shipper;

pub use session::{SendReport, SendSession};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kv_cache::{BlockId, BlockTable, CacheGeometry, KvCache, LayerIdx};
use proto::v1::transfer_control::Body;
use proto::v1::{
    CacheLayout, MemoryRegion, ModelFingerprint, TransferAbort, TransferAck, TransferBegin, TransferDescriptor,
    TransferStatus,
};

use self::session::SessionState;
use self::shipper::Shipper;
use crate::fault::Fault;
use crate::layout::{self, PutPlan};
use crate::runtime::Runtime;
use crate::staging::StagingPool;
use crate::token::{TOKEN_BYTES, TransferToken};
use crate::transport::{Inbound, Link, Transport, TransportKind};
use crate::{TcpConfig, TransferError, TransportConfig, fingerprint};

/// Sender settings.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// Extra time past the descriptor deadline to wait for the receiver's final acknowledgement.
    pub reply_grace: Duration,
    /// Upper bound on any single wait, whatever the deadline says.
    pub max_wait: Duration,
    /// Transports this sender may use (descriptors name the receiver's).
    pub transports: Vec<TransportKind>,
    /// Overrides `UCX_TLS` for this sender's UCX context.
    pub ucx_tls: Option<String>,
    /// How UCX moves bytes; `None` reads `TANDEM_UCX_DATA_PATH` (default `auto`: active messages, unless
    /// one-sided puts are allowed; then puts where measured faster). `put` needs one-sided puts allowed
    /// (`KvSender::new` refuses it otherwise). Puts go only to receivers that accept them; others get
    /// active messages whatever this says.
    pub ucx_data_path: Option<crate::transport::ucx::DataPath>,
    /// Whether `put` may use and `auto` may choose one-sided puts (`None`: read
    /// `TANDEM_UCX_ONE_SIDED_PUTS`, default off). Off, this process's UCX context has no RMA feature.
    pub ucx_one_sided_puts: Option<bool>,
    /// Parallel lanes per receiver (UCX nodes or TCP connections) that one request's data is striped
    /// over (`None`: `TANDEM_KV_LANES`, else a quarter of the cores, 2 to 8; 1 on one core).
    pub lanes: Option<usize>,
    /// Fault injection (tests); `None` reads `TANDEM_KV_FAULT` where the build honours it.
    pub fault: Option<Fault>,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            reply_grace: Duration::from_millis(1000),
            max_wait: Duration::from_secs(600),
            transports: TransportKind::ALL.to_vec(),
            ucx_tls: None,
            ucx_data_path: None,
            ucx_one_sided_puts: None,
            lanes: None,
            fault: None,
        }
    }
}

type LinkSlot = Arc<Mutex<Option<Arc<dyn Link>>>>;

pub(crate) struct SenderShared {
    pub cache: Arc<KvCache>,
    pub layout: CacheLayout,
    pub fingerprint: ModelFingerprint,
    pub config: SenderConfig,
    pub fault: Option<Fault>,
    pub rt: Arc<Runtime>,
    transports: Mutex<HashMap<TransportKind, Arc<dyn Transport>>>,
    /// One link per receiver endpoint; the inner lock serialises connecting to it.
    links: Mutex<HashMap<(TransportKind, Vec<u8>), LinkSlot>>,
    pub router: Arc<Router>,
    pub shipper: Shipper,
    /// Host buffers a device pool is shipped through (`None` for host pools, shipped in place).
    pub staging: Option<Arc<StagingPool>>,
    /// Device buffers the layers of a device pool are gathered into (allocated on first use).
    pub gather: Arc<crate::staging::LazyDevicePool>,
}

/// Routes receiver-initiated messages to sessions.
#[derive(Default)]
pub(crate) struct Router {
    sessions: Mutex<HashMap<(u64, u64), Weak<SessionState>>>,
}

impl Router {
    pub fn add(&self, link: u64, session: u64, st: &Arc<SessionState>) {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).insert((link, session), Arc::downgrade(st));
    }

    pub fn remove(&self, link: u64, session: u64) {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(&(link, session));
    }
}

impl Inbound for Router {
    fn on_abort(&self, link: &Arc<dyn Link>, correlation_id: u64, abort: TransferAbort) {
        let st = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(link.id(), abort.session_id))
            .and_then(Weak::upgrade);
        if let Some(st) = st
            && st.token().matches(&abort.session_token)
        {
            st.stop_by_receiver(&abort.reason, abort.status);
        }
        // Unknown sessions issue no puts; known ones stopped issuing above. Ack after the flush.
        let ack =
            TransferAck { session_id: abort.session_id, status: TransferStatus::Ok as i32, message: String::new() };
        link.flush_then_reply(correlation_id, Body::Ack(ack));
    }

    fn on_link_lost(&self, link_id: u64, reason: &str) {
        let live: Vec<Arc<SessionState>> = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|((l, _), _)| *l == link_id)
            .filter_map(|(_, w)| w.upgrade())
            .collect();
        for st in live {
            st.set_error(TransferError::PeerLost {
                request_id: st.request_id().to_string(),
                reason: reason.to_string(),
            });
        }
    }
}

/// The sending side of kv-transfer, one per prefill worker; sessions share its connections.
#[derive(Clone)]
pub struct KvSender {
    shared: Arc<SenderShared>,
}

impl KvSender {
    /// A sender reading caches from `cache` (the prefill worker's pool) for a model with `fingerprint`.
    pub fn new(
        config: SenderConfig,
        cache: Arc<KvCache>,
        fingerprint: ModelFingerprint,
    ) -> Result<KvSender, TransferError> {
        fingerprint::check_own_fingerprint(&fingerprint, cache.geometry())?;
        crate::layout::check_reachable(&cache)?;
        let staging = cache.stages_through_host().then(|| {
            let buffers = crate::staging::sender_buffers(crate::transport::lanes::lanes_or_default(config.lanes));
            crate::layout::log_staging("sender", &cache);
            StagingPool::new(buffers)
        });
        let fault = match config.fault {
            Some(f) => Some(f),
            None => Fault::from_env().map_err(TransferError::Transport)?,
        };
        if config.transports.contains(&TransportKind::Ucx) {
            check_ucx_config(&config)?;
        }
        let rt = Runtime::new("kv-send", config.lanes)?;
        Ok(KvSender {
            shared: Arc::new(SenderShared {
                layout: layout::layout_of(cache.geometry()),
                cache,
                fingerprint,
                config,
                fault,
                rt,
                transports: Mutex::new(HashMap::new()),
                links: Mutex::new(HashMap::new()),
                router: Arc::new(Router::default()),
                shipper: Shipper::start()?,
                staging,
                gather: Arc::default(),
            }),
        })
    }

    /// Validates `desc` against this side, connects, and performs the handshake: on success the
    /// receiver has accepted the request id and token and writes may start. `src_blocks` is the prefill
    /// side's block table for the request (its first `blocks_for(num_tokens)` blocks are shipped).
    pub fn begin(&self, desc: &TransferDescriptor, src_blocks: &BlockTable) -> Result<SendSession, TransferError> {
        let sh = &self.shared;
        let rid = desc.request_id.clone();
        let bad = |reason: String| TransferError::BadDescriptor { request_id: rid.clone(), reason };
        let now = Instant::now();
        let deadline = deadline_instant(desc.deadline_unix_ms, now);
        if deadline <= now {
            return Err(TransferError::DeadlineExceeded(rid));
        }
        let deadline = deadline.min(now + sh.config.max_wait);
        let token = TransferToken::from_wire(&desc.transfer_token)
            .ok_or_else(|| bad(format!("the transfer token is not {TOKEN_BYTES} bytes")))?;
        let fp = desc.fingerprint.as_ref().ok_or_else(|| bad("no fingerprint".into()))?;
        sh.fingerprint.check_compatible(fp)?;
        let dst_layout = desc.layout.ok_or_else(|| bad("no cache layout".into()))?;
        layout::check_layout(sh.cache.geometry(), &dst_layout).map_err(|e| bad(format!("layout: {e}")))?;
        layout::check_blocks(&dst_layout, &desc.block_ids, desc.num_tokens).map_err(|(_, e)| bad(e))?;
        let n = CacheGeometry::blocks_for(desc.num_tokens as usize);
        if src_blocks.len() < n {
            return Err(bad(format!(
                "the source table has {} blocks, {} tokens need {n}",
                src_blocks.len(),
                desc.num_tokens
            )));
        }
        if let Some(b) = src_blocks.blocks[..n].iter().find(|b| b.index() >= sh.cache.geometry().num_blocks) {
            return Err(bad(format!("source block {} outside this pool", b.0)));
        }
        let dst_blocks: Vec<BlockId> = desc.block_ids.iter().map(|&b| BlockId(b)).collect();
        let plan = PutPlan::new(sh.layout, dst_layout, &src_blocks.blocks[..n], &dst_blocks, desc.num_tokens as usize);
        let endpoint = desc.endpoint.clone().ok_or_else(|| bad("no endpoint".into()))?;
        let link = self.link(&endpoint, deadline)?;
        let begin = TransferBegin {
            request_id: rid.clone(),
            transfer_token: token.to_vec(),
            num_tokens: desc.num_tokens,
            block_ids: desc.block_ids.clone(),
            layout: Some(dst_layout),
            fingerprint: Some(sh.fingerprint.clone()),
            sender_address: Vec::new(),
            receiver_mediated: false,
        };
        let asked = Instant::now();
        tracing::trace!(request_id = %rid, "kv-transfer: handshake sent");
        let reply = link.call(Body::Begin(begin)).and_then(|cell| {
            cell.wait_until(deadline).unwrap_or_else(|| {
                Err(if link.is_alive() {
                    TransferError::DeadlineExceeded(rid.clone())
                } else {
                    TransferError::PeerLost { request_id: rid.clone(), reason: "no handshake reply".into() }
                })
            })
        });
        tracing::trace!(request_id = %rid, handshake_us = asked.elapsed().as_micros() as u64, "kv-transfer: handshake answered");
        let (accept, session_token) = match reply {
            Ok(Body::Accept(a)) => match TransferToken::from_wire(&a.session_token) {
                Some(t) => (a, t),
                None => {
                    // Without it nothing can be sent for the session; the receiver ends it at the deadline.
                    return Err(TransferError::Transport(format!(
                        "request {rid}: the Accept carries no session token"
                    )));
                }
            },
            Ok(Body::Ack(a)) => {
                let status = TransferStatus::try_from(a.status).unwrap_or(TransferStatus::Protocol);
                return Err(TransferError::rejected(&rid, status, a.message));
            }
            Ok(_) => return Err(TransferError::Transport(format!("request {rid}: unexpected handshake reply"))),
            Err(e) => return Err(map_link_error(&rid, e)),
        };
        // One-sided puts only where the receiver granted regions (and their keys) in its Accept; every put
        // must then fall inside one. Without regions every write goes through the receiver.
        let (regions, unusable) = match link.accepted(&accept) {
            Ok(h) => (h, outside_regions(&plan, dst_layout.num_layers, &accept.regions)),
            Err(e) => (0, Some(e.to_string())),
        };
        let final_deadline = deadline + sh.config.reply_grace;
        let st = SessionState::new(
            rid.clone(),
            session_token,
            accept.session_id,
            link.clone(),
            regions,
            accept.regions,
            deadline,
            final_deadline,
            plan,
            dst_layout.num_layers as usize,
            desc.verify_checksum,
            sh.cache.clone(),
        );
        sh.router.add(link.id(), st.session_id, &st);
        let session = SendSession::new(st, self.shared.clone());
        if let Some(why) = unusable {
            let _ = session.abort(&why);
            return Err(TransferError::BadDescriptor { request_id: rid, reason: why });
        }
        Ok(session)
    }

    fn transport(&self, kind: TransportKind) -> Result<Arc<dyn Transport>, TransferError> {
        let sh = &self.shared;
        if !sh.config.transports.contains(&kind) {
            return Err(TransferError::Transport(format!("transport {kind} is not enabled on this sender")));
        }
        let mut g = sh.transports.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = g.get(&kind) {
            return Ok(t.clone());
        }
        let cfg = match kind {
            TransportKind::Ucx => TransportConfig::Ucx { tls: sh.config.ucx_tls.clone(), tcp_fallback: None },
            TransportKind::Tcp => TransportConfig::Tcp(TcpConfig::default()),
            TransportKind::InProc => TransportConfig::InProc,
        };
        let puts = match sh.config.ucx_one_sided_puts {
            Some(p) => p,
            None => crate::transport::ucx::one_sided_puts_from_env().map_err(TransferError::Transport)?,
        };
        let t = match (kind, sh.config.ucx_data_path) {
            (TransportKind::Ucx, Some(dp)) => crate::transport::ucx::UcxTransport::with_options(
                sh.config.ucx_tls.as_deref(),
                dp,
                sh.config.lanes,
                puts,
            )
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .map_err(TransferError::Transport)?,
            _ => crate::transport_for(&cfg, &sh.rt, sh.config.lanes, puts)?,
        };
        if t.kind() != kind {
            return Err(TransferError::Transport(format!(
                "the receiver speaks {kind}, which this process cannot load"
            )));
        }
        g.insert(kind, t.clone());
        Ok(t)
    }

    fn link(&self, endpoint: &proto::v1::TransportEndpoint, deadline: Instant) -> Result<Arc<dyn Link>, TransferError> {
        let kind: TransportKind = endpoint.kind.parse().map_err(TransferError::Transport)?;
        let key = (kind, endpoint.address.clone());
        let slot = self.shared.links.lock().unwrap_or_else(|p| p.into_inner()).entry(key).or_default().clone();
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = slot.as_ref()
            && l.is_alive()
        {
            return Ok(l.clone());
        }
        let t = self.transport(kind)?;
        let inbound: Arc<dyn Inbound> = self.shared.router.clone();
        let link = t.connect(endpoint, &self.shared.cache, inbound, deadline)?;
        *slot = Some(link.clone());
        Ok(link)
    }
}

/// Refuses, at start, a UCX data path that needs the one-sided opt-in without it (`put` alone would ask
/// for UCX's RMA feature, which opens this process's memory to any UCX peer).
fn check_ucx_config(config: &SenderConfig) -> Result<(), TransferError> {
    use crate::transport::ucx;
    let dp = match config.ucx_data_path {
        Some(dp) => dp,
        None => ucx::DataPath::from_env().map_err(TransferError::Transport)?,
    };
    let puts = match config.ucx_one_sided_puts {
        Some(p) => p,
        None => ucx::one_sided_puts_from_env().map_err(TransferError::Transport)?,
    };
    ucx::check_data_path(dp, puts).map_err(TransferError::Transport)
}

/// Why the regions an Accept granted cannot take every put of `plan` (`None`: they can, or none were
/// granted and every write goes through the receiver).
fn outside_regions(plan: &PutPlan, layers: u32, regions: &[MemoryRegion]) -> Option<String> {
    // regions[0] starts at the pool base; every put must fall inside one region.
    let base = regions.first()?.remote_addr;
    (0..layers).find_map(|l| {
        plan.layer_puts(LayerIdx(l))
            .find(|p| layout::region_for(regions, base.wrapping_add(p.dst_offset), p.len).is_none())
            .map(|p| format!("no granted memory region covers layer {l} bytes {}+{}", p.dst_offset, p.len))
    })
}

/// The descriptor's wall-clock deadline as an Instant on this machine.
fn deadline_instant(deadline_unix_ms: u64, now: Instant) -> Instant {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    now + Duration::from_millis(deadline_unix_ms.saturating_sub(now_ms))
}

pub(crate) fn map_link_error(request_id: &str, e: TransferError) -> TransferError {
    match e {
        TransferError::Transport(m) if m.starts_with("link lost") => {
            TransferError::PeerLost { request_id: request_id.to_string(), reason: m }
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit;
    use crate::transport::ucx::DataPath;

    #[test]
    fn put_without_the_one_sided_opt_in_is_refused_at_start() {
        let g = testkit::geometry(2, 4);
        let (cache, _) = testkit::filled_cache(g, 1);
        let cfg = |dp, puts| SenderConfig {
            ucx_data_path: Some(dp),
            ucx_one_sided_puts: Some(puts),
            ..SenderConfig::default()
        };
        let e = KvSender::new(cfg(DataPath::Put, false), cache.clone(), testkit::fingerprint(&g)).err();
        assert!(matches!(&e, Some(TransferError::Transport(m)) if m.contains("TANDEM_UCX_ONE_SIDED_PUTS=1")), "{e:?}");
        // Without UCX among its transports the data path does not matter.
        let tcp_only = SenderConfig { transports: vec![TransportKind::Tcp], ..cfg(DataPath::Put, false) };
        KvSender::new(tcp_only, cache.clone(), testkit::fingerprint(&g)).unwrap();
        KvSender::new(cfg(DataPath::Put, true), cache.clone(), testkit::fingerprint(&g)).unwrap();
        KvSender::new(cfg(DataPath::Auto, false), cache, testkit::fingerprint(&g)).unwrap();
    }
}
