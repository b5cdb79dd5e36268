//! UCX transport through libucp, loaded at run time ([`api::load`]); bindings generated once by
//! `scripts/gen-ucx-bindings.sh` ([`sys`]). The receiver publishes its workers' addresses in descriptors;
//! control messages are active messages, and so are data writes by default: the receiver places each one
//! itself after [`admit_write`](crate::receiver::core::ReceiverCore::admit_write) checked its token and
//! that it lies inside the transfer's blocks.
//!
//! One-sided puts (`ucp_put_nbx`, made visible with `ucp_ep_flush_nbx` before any completion, release or
//! abort acknowledgement) happen only where the receiver accepts them ([`one_sided_puts_from_env`], a
//! trusted network): it then registers its arena (`ucp_mem_map`) and hands the packed rkey to a sender in
//! its `Accept`, never before the token handshake. The receiver cannot bound where puts land, and UCX's
//! RMA feature, which puts need, answers any connected peer's put wherever it points over transports
//! that emulate RMA (tcp, shared memory): nodes ask for that feature only in this mode. A device pool is
//! never registered; senders to it send active messages of at most one staging buffer
//! ([`crate::staging`]). UCX picks the transport itself (`UCX_TLS` and every other `UCX_*` variable
//! apply); this code names none, but creates endpoints to same-host peers without peer-failure detection
//! so that UCX may pick shared memory ([`host`]), and raises the shared-memory segment size where the user
//! set none.

pub mod api;
pub mod host;
mod link;
mod node;
mod serve;
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code, clippy::all, unsafe_op_in_unsafe_fn)]
pub mod sys;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kv_cache::KvCache;
use proto::v1::{MemoryRegion, TransportEndpoint};

use self::link::{SenderSink, UcxLink};
pub use self::node::{AM_CONTROL, AM_DATA, CONTROL_INFLIGHT, CONTROL_QUEUE, MAX_CONTROL_BYTES, progress_threads};
use self::node::{Node, NodeOwner, Sink};
use self::serve::ReceiverSink;
pub use self::serve::{STRANGER_EPS, STRANGER_TTL};
use super::lanes::{FlushJoin, LaneEpochs, decode_address, encode_address, lanes_or_default};
use super::{Inbound, Link, PendingCalls, Served, Transport, TransportKind, next_id};
use crate::TransferError;
use crate::receiver::core::ReceiverCore;
use crate::staging;

pub use api::cuda_memory;

/// Whether libucp loads here.
pub fn load() -> Result<(), String> {
    api::load().map(|_| ())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether one-sided puts are allowed in this deployment: `TANDEM_UCX_ONE_SIDED_PUTS` = `1`/`true`
/// (default off). A receiver then accepts them from senders that passed the handshake, and a sender's
/// `auto` data path may choose them. Turn it on only where every process that can reach the decode
/// workers' UCX ports is trusted with their whole memory (see the crate README).
pub fn one_sided_puts_from_env() -> Result<bool, String> {
    one_sided_puts_from(std::env::var("TANDEM_UCX_ONE_SIDED_PUTS").ok().as_deref())
}

fn one_sided_puts_from(v: Option<&str>) -> Result<bool, String> {
    match v {
        None | Some("") | Some("0") | Some("false") => Ok(false),
        Some("1") | Some("true") => Ok(true),
        Some(v) => Err(format!("TANDEM_UCX_ONE_SIDED_PUTS={v:?}; valid: 1, true, 0, false")),
    }
}

/// Checks the UCX variables of the environment `var` reads (`TANDEM_UCX_DATA_PATH`,
/// `TANDEM_UCX_ONE_SIDED_PUTS`) as a worker's start would: for `--check-config`.
pub fn check_env(var: impl Fn(&str) -> Option<String>) -> Result<(), String> {
    let dp = DataPath::from_value(var("TANDEM_UCX_DATA_PATH").as_deref())?;
    check_data_path(dp, one_sided_puts_from(var("TANDEM_UCX_ONE_SIDED_PUTS").as_deref())?)
}

/// How a UCX sender moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// One-sided `ucp_put_nbx` into the registered arena (fastest where UCX has native RMA). Only with
    /// one-sided puts allowed ([`one_sided_puts_from_env`]; without them it is a configuration error,
    /// [`check_data_path`]), and only to a receiver that accepts them; other receivers get active
    /// messages.
    Put,
    /// Rendezvous active messages the receiver places itself (fastest where RMA is emulated, as over
    /// tcp; every write is admitted by the receiver).
    ActiveMessage,
    /// Active messages unless one-sided puts are allowed ([`one_sided_puts_from_env`]); then the measured
    /// choice (bench/RESULTS.md): `Put` to a peer on this host over shared memory through one
    /// lane (UCX emulates the put over the shared-memory FIFO: the sender copies in, the receiver's
    /// progress thread copies out, a two-core pipeline; rendezvous active messages, one copy on the
    /// receiver's thread, ran at half the rate on the 2-core VM), and where an RDMA transport carries native RMA (`UCX_TLS` names one, or it is unset and
    /// the host has an RDMA device); `ActiveMessage` elsewhere: over tcp UCX emulates RMA about 10x
    /// slower, and over shared memory with several lanes puts stay one stream per link while the
    /// receiver's lanes place active messages in parallel.
    Auto,
}

impl DataPath {
    /// `TANDEM_UCX_DATA_PATH` = `put`, `am` or `auto` (the default).
    pub fn from_env() -> Result<DataPath, String> {
        Self::from_value(std::env::var("TANDEM_UCX_DATA_PATH").ok().as_deref())
    }

    fn from_value(v: Option<&str>) -> Result<DataPath, String> {
        match v {
            None | Some("") => Ok(DataPath::Auto),
            Some(v) => v.parse().map_err(|e| format!("TANDEM_UCX_DATA_PATH: {e}")),
        }
    }

    /// The concrete path for a link of `lanes` lanes in a context configured with `tls` (else
    /// `UCX_TLS`); `local`: the peer shares this host's memory ([`host::same_host`]).
    pub fn resolve(self, tls: Option<&str>, local: bool, lanes: usize) -> DataPath {
        if self != DataPath::Auto {
            return self;
        }
        if local && lanes == 1 && host::shm_allowed(tls) {
            return DataPath::Put;
        }
        let tls = tls.map(str::to_string).or_else(|| std::env::var("UCX_TLS").ok()).unwrap_or_default();
        let names: Vec<&str> = tls.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
        let rdma = if names.is_empty() || names.iter().any(|n| n.starts_with('^') || *n == "all") {
            std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
        } else {
            names.iter().any(|n| ["rc", "dc", "ud", "ib", "rdma"].iter().any(|p| n.starts_with(p)))
        };
        if rdma { DataPath::Put } else { DataPath::ActiveMessage }
    }
}

/// Refuses `put` without the one-sided opt-in: UCX's RMA feature, which puts need, lets any connected
/// peer write and read the process's memory over transports that emulate RMA, so a prefill worker asks
/// for it only where the deployment declared its network trusted (`TANDEM_UCX_ONE_SIDED_PUTS=1`).
pub fn check_data_path(data_path: DataPath, one_sided_puts: bool) -> Result<(), String> {
    if data_path == DataPath::Put && !one_sided_puts {
        return Err("TANDEM_UCX_DATA_PATH=put needs TANDEM_UCX_ONE_SIDED_PUTS=1 (one-sided puts, for trusted \
                    networks only: see kv-transfer/README.md); without it use am or auto"
            .into());
    }
    Ok(())
}

impl std::str::FromStr for DataPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DataPath::Auto),
            "put" => Ok(DataPath::Put),
            "am" => Ok(DataPath::ActiveMessage),
            _ => Err(format!("unknown UCX data path {s:?}; valid: auto, put, am")),
        }
    }
}

pub struct UcxTransport {
    tls: Option<String>,
    /// `UCX_NET_DEVICES` for this transport's contexts when the environment sets none.
    net_devices: Option<String>,
    data_path: DataPath,
    /// Receiver: accept one-sided puts from senders that passed the handshake. Sender: `put` uses them,
    /// `auto` may choose them. Without it no node of this transport carries UCX's RMA feature.
    one_sided_puts: bool,
    /// Nodes (workers, progress threads) per link on each side.
    lanes: usize,
    /// The lane count the configuration asked for (`None`: chosen per pool, [`lanes::for_pool`]).
    lanes_configured: Option<usize>,
    sender: Mutex<Option<(Vec<NodeOwner>, Arc<SenderSink>)>>,
}

impl UcxTransport {
    /// Fails (with the loader's message) when libucp cannot be loaded. Data path and one-sided puts as
    /// `TANDEM_UCX_DATA_PATH` and [`one_sided_puts_from_env`] say.
    pub fn new(tls: Option<&str>) -> Result<Self, String> {
        Self::with_options(tls, DataPath::from_env()?, None, one_sided_puts_from_env()?)
    }

    /// `lanes`: nodes per link (`None`: `TANDEM_KV_LANES`, else a quarter of the cores, 2 to 8; 1 on one core).
    /// `one_sided_puts`: a receiver accepts them from senders that passed the handshake (it cannot bound
    /// where they land); a sender's `put` and `auto` data paths may use them. `put` without it is refused
    /// ([`check_data_path`]).
    pub fn with_options(
        tls: Option<&str>,
        data_path: DataPath,
        lanes: Option<usize>,
        one_sided_puts: bool,
    ) -> Result<Self, String> {
        check_data_path(data_path, one_sided_puts)?;
        load()?;
        Ok(UcxTransport {
            tls: tls.map(str::to_string),
            net_devices: None,
            data_path,
            one_sided_puts,
            lanes: lanes_or_default(lanes),
            lanes_configured: lanes,
            sender: Mutex::new(None),
        })
    }

    /// Lanes for a link of `cache`: a GPU pool moved by a CUDA-capable UCX takes [`lanes::DEVICE_LANES`]
    /// unless configured.
    fn lanes_for(&self, cache: &KvCache) -> usize {
        if device_direct(cache) { super::lanes::for_pool(self.lanes_configured, true) } else { self.lanes }
    }

    /// Whether this side's nodes use or accept one-sided puts (and so need UCX's RMA feature): only with
    /// the opt-in, whatever the data path asks for.
    fn rma(&self) -> bool {
        self.one_sided_puts && self.data_path != DataPath::ActiveMessage
    }
}

impl UcxTransport {
    /// Keeps UCX's network transports on the loopback interface (`UCX_NET_DEVICES=lo` unless the
    /// environment names devices), for a receiver told to listen on loopback: UCX would otherwise
    /// listen on every interface. Shared-memory transports are not network devices and stay available.
    pub fn loopback_only(mut self) -> Self {
        self.net_devices = Some("lo".into());
        self
    }
}

impl Transport for UcxTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    fn serve(&self, core: Arc<ReceiverCore>) -> Result<Served, TransferError> {
        // A device pool is never registered for one-sided puts: senders send active messages, which a
        // CUDA-capable UCX lands in the device pool itself, and any other UCX through staging buffers.
        let puts = self.one_sided_puts && !core.cache.stages_through_host();
        let sink = Arc::new(ReceiverSink::new(&core, self.tls.as_deref()));
        // Lane 0 takes control messages (and puts, where accepted: it registers the arena); every lane
        // places active-message writes (senders spread theirs over all of them).
        let lanes = self.lanes_for(&core.cache);
        // A GPU pool moved by UCX itself: each lane lands gathered writes in device buffers of its own,
        // allocated now; without them the receiver does not offer gathered writes.
        let direct = device_direct(&core.cache);
        let mut landing = Vec::new();
        if direct {
            for _ in 0..lanes {
                match staging::DevicePool::for_arena(core.cache.arena()) {
                    Some(Ok(p)) => landing.push(p),
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "no device buffers for gathered writes: scattered requests go a message per run");
                        landing.clear();
                        break;
                    }
                    None => break,
                }
            }
        }
        let mut owners = Vec::new();
        for lane in 0..lanes {
            let sink: Arc<dyn Sink> = sink.clone();
            let tls = self.tls.as_deref();
            let (bind, land) = (binder(&core.cache), landing.get(lane).cloned());
            owners.push(NodeOwner(Node::start("kv-recv", tls, self.net_devices.as_deref(), puts, sink, bind, land)?));
        }
        let node = owners[0].0.clone();
        log_start("receiver", &node, &core.cache);
        if direct && owners.iter().all(|o| o.0.cuda) {
            sink.receive_device_memory(landing.len() == lanes);
        }
        if puts {
            let arena = core.cache.arena();
            let rkey = node.mem_map(arena.as_ptr(), arena.len())?;
            tracing::warn!(
                "kv-transfer accepts one-sided UCX puts: senders that pass the handshake can write anywhere in the cache pool"
            );
            sink.grant_puts(vec![MemoryRegion {
                remote_addr: arena.as_ptr() as u64,
                length: arena.len() as u64,
                rkey,
            }]);
        }
        let workers: Vec<&[u8]> = owners.iter().map(|o| o.0.worker.as_slice()).collect();
        let address = encode_address(node.id, host::host_id(), &workers);
        Ok(Served::new(TransportKind::Ucx, address, owners))
    }

    fn connect(
        &self,
        endpoint: &TransportEndpoint,
        local_cache: &Arc<KvCache>,
        inbound: Arc<dyn Inbound>,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        let addr = decode_address(&endpoint.address)
            .ok_or_else(|| TransferError::Transport("bad UCX endpoint address".into()))?;
        let (origin, remote) = (addr.origin, addr.lanes);
        // A peer on this host is reached over shared memory, which UCX only selects for endpoints without
        // peer-failure detection (see `host`); its loss is then noticed by deadlines and the quarantine.
        let local = host::same_host(addr.host) && host::shm_allowed(self.tls.as_deref());
        let am =
            !self.rma() || self.data_path.resolve(self.tls.as_deref(), local, self.lanes) == DataPath::ActiveMessage;
        let (nodes, sink) = {
            let mut g = lock(&self.sender);
            if g.as_ref().is_none_or(|(n, _)| n.iter().any(|n| !n.0.is_alive())) {
                let sink = Arc::new(SenderSink { links: Mutex::new(HashMap::new()), inbound: inbound.clone() });
                let mut owners = Vec::new();
                for _ in 0..self.lanes_for(local_cache) {
                    let s: Arc<dyn Sink> = sink.clone();
                    owners.push(NodeOwner(Node::start(
                        "kv-send",
                        self.tls.as_deref(),
                        self.net_devices.as_deref(),
                        self.rma(),
                        s,
                        binder(local_cache),
                        None,
                    )?));
                }
                log_start("sender", &owners[0].0, local_cache);
                *g = Some((owners, sink));
            }
            let (n, s) = g.as_ref().expect("set above");
            (n.iter().map(|o| o.0.clone()).collect::<Vec<_>>(), s.clone())
        };
        // Puts need the registering node's rkey: every lane targets receiver lane 0 (one-sided RMA
        // leaves the receiver's threads idle anyway). Active messages spread over the receiver's lanes.
        let mut pending = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let target = if am { remote[i % remote.len()] } else { remote[0] };
            let (ep, done) = node.connect_start(target, !local)?;
            pending.push((node.clone(), ep, done));
        }
        let mut lanes = Vec::new();
        let mut failed = None;
        for (node, ep, done) in pending {
            if let Err(e) = Node::connected(&done, deadline) {
                failed.get_or_insert(e);
            }
            lanes.push((node, ep));
        }
        if let Some(e) = failed {
            for (node, ep) in lanes {
                node.close_ep(ep);
            }
            return Err(e);
        }
        let link = Arc::new(UcxLink {
            receiver_mediated: AtomicBool::new(am),
            max_write: AtomicU64::new(0),
            stream_writes: AtomicBool::new(false),
            id: next_id(),
            epochs: Arc::new(LaneEpochs::new(lanes.len())),
            lanes,
            calls: Arc::new(PendingCalls::default()),
            alive: AtomicBool::new(true),
            rkeys: Mutex::new(HashMap::new()),
        });
        // Finish every lane's wireup now: a lane a small request never uses would otherwise still have
        // wireup messages queued when the link closes, and UCX 1.13 asserts when it purges those.
        let done: super::Flushed = crate::wait::Cell::new();
        let d = done.clone();
        let join = FlushJoin::new(link.lanes.len(), move |r| {
            d.set(r);
        });
        for (node, ep) in &link.lanes {
            node.flush(*ep, join.clone());
        }
        let wired =
            done.wait_until(deadline).unwrap_or_else(|| Err(TransferError::Transport("UCX wireup timed out".into())));
        if let Err(e) = wired {
            for (node, ep) in &link.lanes {
                node.close_ep(*ep);
            }
            return Err(e);
        }
        // What UCX chose for the first link of this process (transports, lanes), once.
        static LOGGED: AtomicBool = AtomicBool::new(false);
        if !LOGGED.swap(true, std::sync::atomic::Ordering::SeqCst)
            && let Some((node, ep)) = link.lanes.first()
        {
            tracing::info!(lanes = link.lanes.len(), ucx_lanes = %node.describe(*ep), "kv-transfer UCX link to a receiver");
        }
        let mut links = lock(&sink.links);
        links.retain(|_, l| l.strong_count() > 0);
        links.insert(origin, Arc::downgrade(&link));
        Ok(link)
    }
}

/// Whether `cache` is GPU memory the loaded libucp moves itself (cuda_ipc): no host staging, one lane.
fn device_direct(cache: &KvCache) -> bool {
    cache.arena().cuda_memory() && api::cuda_memory()
}

/// For a device pool: makes its context current on a progress thread.
fn binder(cache: &Arc<KvCache>) -> Option<node::Binder> {
    if cache.memory_kind().host_accessible() {
        return None;
    }
    let cache = cache.clone();
    Some(Arc::new(move || cache.arena().bind_device_thread().map_err(|e| e.to_string())))
}

/// Logs, once per sender or receiver, the UCX library in use and how the pool's memory moves.
fn log_start(side: &str, node: &Node, cache: &KvCache) {
    let memory = cache.memory_kind();
    let path = match (memory.host_accessible(), node.cuda && cache.arena().cuda_memory()) {
        (true, _) => "host memory in place",
        (false, true) => "device memory directly (UCX's CUDA transports: cuda_ipc between GPUs of a node)",
        (false, false) => "device memory through host staging buffers (no CUDA-capable libucp, or not CUDA memory)",
    };
    tracing::info!(side, ucx = %api::version(), %memory, cuda_memory = node.cuda, path, "kv-transfer UCX started");
    static WARNED: AtomicBool = AtomicBool::new(false);
    if let Some((major, minor, release)) = api::version_parts()
        && api::may_abort_on_peer_loss_in_wireup((major, minor, release))
        && !WARNED.swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        tracing::warn!(
            ucx = %format!("{major}.{minor}.{release}"),
            "this libucp can abort the process when a peer dies while one of its connections is still being set \
             up (seen over TCP; an assertion removed in UCX 1.14, openucx/ucx#8175); use UCX 1.14 or later in \
             production"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::DataPath;

    #[test]
    fn auto_data_path_puts_over_local_shared_memory_and_rdma() {
        assert_eq!(DataPath::Auto.resolve(Some("tcp"), false, 1), DataPath::ActiveMessage);
        assert_eq!(DataPath::Auto.resolve(Some("tcp"), true, 1), DataPath::ActiveMessage);
        assert_eq!(DataPath::Auto.resolve(Some("sm,self"), false, 1), DataPath::ActiveMessage);
        assert_eq!(DataPath::Auto.resolve(Some("sm,self"), true, 1), DataPath::Put);
        assert_eq!(DataPath::Auto.resolve(Some("sm,self"), true, 4), DataPath::ActiveMessage);
        assert_eq!(DataPath::Auto.resolve(Some("rc_x,sm,self"), false, 4), DataPath::Put);
        assert_eq!(DataPath::Put.resolve(Some("tcp"), false, 1), DataPath::Put);
        assert_eq!(DataPath::ActiveMessage.resolve(Some("rc"), true, 1), DataPath::ActiveMessage);
        assert_eq!("auto".parse::<DataPath>(), Ok(DataPath::Auto));
        assert!("rma".parse::<DataPath>().is_err());
    }

    #[test]
    fn put_needs_the_one_sided_opt_in() {
        let e = super::check_data_path(DataPath::Put, false).unwrap_err();
        assert!(e.contains("TANDEM_UCX_ONE_SIDED_PUTS=1"), "{e}");
        super::check_data_path(DataPath::Put, true).unwrap();
        for dp in [DataPath::Auto, DataPath::ActiveMessage] {
            super::check_data_path(dp, false).unwrap();
        }
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let e = super::check_env(env(&[("TANDEM_UCX_DATA_PATH", "put")])).unwrap_err();
        assert!(e.contains("TANDEM_UCX_ONE_SIDED_PUTS=1"), "{e}");
        super::check_env(env(&[("TANDEM_UCX_DATA_PATH", "put"), ("TANDEM_UCX_ONE_SIDED_PUTS", "1")])).unwrap();
        super::check_env(env(&[])).unwrap();
        assert!(super::check_env(env(&[("TANDEM_UCX_ONE_SIDED_PUTS", "yes")])).is_err());
    }
}
