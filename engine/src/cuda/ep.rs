//! Expert parallelism over NCCL (docs/model.md §5.1): one process per GPU, each a data-parallel rank that
//! owns its requests and caches (DP attention), the routed experts split across the ranks in contiguous
//! ranges, the shared experts on every rank.
//!
//! A MoE layer on rank r ([`moe_send`], [`moe_experts`], [`moe_finish`]; every rank in lockstep):
//! 1. **Dispatch.** r routes its own rows, quantizes each row once to FP8 (the per-128 scales a plain
//!    grouping would compute for each of its pairs) and writes a *dispatch record* of `cap` rows: codes
//!    `[cap][kpad]`, scales `[kpad / 128][cap]`, expert ids `[cap][k]` (rows past its own: id -1). Every
//!    rank gathers every record (point-to-point sends of the one record to every rank): with NCCL the
//!    sizes are fixed on the host, and a record of `cap` rows is what a rank must be able to send any one
//!    peer, so gathering whole records costs no more bytes than a fixed-capacity all-to-all and needs no
//!    counts on the host (a CUDA graph captured per capacity bucket could hold it; the capacity itself is
//!    agreed on the host once per call).
//! 2. **Experts.** Each rank groups the gathered pairs that route to its experts (engine::cuda::moe), copies
//!    their codes into the grouped layout and runs the same grouped FP8 GEMMs as one GPU; the down
//!    projection stores each pair's bf16 output in the pair's row of the combine buffer.
//! 3. **Combine.** Pair outputs go back unsummed, bf16, each to its token's rank (`ncclSend`/`ncclRecv` of
//!    `cap * k` rows per peer), and the token's rank adds its pairs in slot order with the shared expert:
//!    the single-GPU combine over the same bf16 values, so EP-N output equals one GPU's bit for bit.
//!
//! Lockstep: every forward call starts with [`EpGroup::agree`], one all-reduce of (rows, pass) that gives
//! the call's capacity (the largest rank's rows) and refuses ranks that are not running the same pass. A
//! scheduling step is the three passes of [`Pass::STEP`] in order (main layers in the decode form, in the
//! prefill form, the MTP layer); [`super::CudaBackend`] joins every pass a rank has no rows for with an
//! empty batch (an empty call, a pass skipped on the way to a later one, the rest of the step at
//! `Backend::end_step`): it computes the others' pairs on its experts and joins every collective. A pass
//! where every rank is idle is the agreement alone.
//!
//! Ranks find each other through a leader address (`host:port`, rank 0 listens): each rank says hello with
//! its rank and world size, and the leader answers with the NCCL unique id once every rank has arrived.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::nccl::sys as nccl;

use super::moe;
use super::ops::{Arg, DBuf, Workspace, elementwise_grid, launch};
use super::weights::{DMoe, QuantFormat, QuantIn, SlotTable};
use super::{CudaError, Gpu, gemm};
use crate::ModelConfig;

/// The routed experts a rank holds: `world` contiguous ranges of `n_routed_experts / world`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// Every expert on one GPU.
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };

    /// Rank `rank`'s experts of `n` routed experts.
    pub fn experts(&self, n: usize) -> Range<usize> {
        let per = n / self.world.max(1);
        self.rank * per..(self.rank + 1) * per
    }

    /// Whether `cfg`'s routed experts split evenly into `world` ranges.
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), String> {
        if self.world == 0 || self.rank >= self.world {
            return Err(format!("rank {} of {} ranks", self.rank, self.world));
        }
        if self.world > 1 && (cfg.n_routed_experts == 0 || !cfg.n_routed_experts.is_multiple_of(self.world)) {
            return Err(format!(
                "expert parallelism over {} ranks needs routed experts in equal shares; the model has {}",
                self.world, cfg.n_routed_experts
            ));
        }
        Ok(())
    }
}

/// How a rank joins its expert-parallel group.
#[derive(Debug, Clone)]
pub struct EpConfig {
    pub rank: usize,
    pub world: usize,
    /// `host:port` rank 0 listens on and the others connect to.
    pub leader: String,
    /// How long the ranks wait for each other at start-up.
    pub timeout: Duration,
    /// The watchdog's bound on one forward call (a step): past it the communicator is aborted, as a peer
    /// that died or hangs (SIGSTOP raises no NCCL error) would otherwise stall this rank forever.
    pub step_timeout: Duration,
    /// Load balancing (engine::cuda::balance): off by default, the loads still counted and logged.
    pub eplb: crate::eplb::EplbConfig,
    /// Dual-batch overlap of the main passes (docs/model.md §5.3).
    pub dbo: Dbo,
}

/// When a main pass runs as two micro-batches whose exchanges overlap the other's compute (dual-batch
/// overlap): decided from the most rows any rank brings (every rank agrees on it) and the experts each rank
/// holds (the same on every rank), so every rank runs the same form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dbo {
    /// At or above these rows (the largest rank's) in a decode-form / prefill-form pass, where a rank holds
    /// at most [`DBO_MAX_LOCAL_EXPERTS`] routed expert matrices a layer: a wide group's rank, whose
    /// exchanges cross nodes. Each micro-batch reads every local expert's weights again, which on a rank
    /// of many experts costs more than the overlap saves (bench/RESULTS.md, "Dual-batch overlap").
    Auto {
        decode_rows: usize,
        prefill_rows: usize,
    },
    /// Whenever the largest rank has at least 2 rows.
    On,
    Off,
}

impl Default for Dbo {
    fn default() -> Self {
        Dbo::Auto { decode_rows: DBO_DECODE_ROWS, prefill_rows: DBO_PREFILL_ROWS }
    }
}

/// The default thresholds of [`Dbo::Auto`] (bench/RESULTS.md, "Dual-batch overlap"): prefill passes of at
/// least 1024 rows; decode passes never (no measured decode step was faster overlapped).
pub const DBO_DECODE_ROWS: usize = usize::MAX;
pub const DBO_PREFILL_ROWS: usize = 1024;
/// [`Dbo::Auto`] (`auto:D,P` too) overlaps only on ranks holding at most this many routed expert matrices a
/// layer, not counting load balancing's spare slots.
pub const DBO_MAX_LOCAL_EXPERTS: usize = 16;

impl Dbo {
    /// Whether `pass` runs overlapped when the largest rank brings `most` rows and each rank holds
    /// `local_experts` routed expert matrices a layer.
    pub fn applies(&self, pass: Pass, most: usize, local_experts: usize) -> bool {
        if most < 2 || pass == Pass::Mtp {
            return false;
        }
        match *self {
            Dbo::On => true,
            Dbo::Off => false,
            Dbo::Auto { decode_rows, prefill_rows } => {
                local_experts <= DBO_MAX_LOCAL_EXPERTS
                    && most >= if pass == Pass::MainPrefill { prefill_rows } else { decode_rows }
            }
        }
    }

    /// `auto`, `on`, `off`, or `auto:DECODE_ROWS,PREFILL_ROWS`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Dbo::default()),
            "on" => Ok(Dbo::On),
            "off" => Ok(Dbo::Off),
            _ => {
                let bad = || format!("`{s}`: dual-batch overlap is auto, on, off or auto:DECODE_ROWS,PREFILL_ROWS");
                let (d, p) = s.strip_prefix("auto:").and_then(|r| r.split_once(',')).ok_or_else(bad)?;
                let (d, p) = (d.parse().map_err(|_| bad())?, p.parse().map_err(|_| bad())?);
                Ok(Dbo::Auto { decode_rows: d, prefill_rows: p })
            }
        }
    }
}

impl EpConfig {
    /// `RANK/WORLD@HOST:PORT` (e.g. `1/2@10.0.0.5:29500`).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let bad = || format!("`{spec}`: expert parallelism is RANK/WORLD@HOST:PORT, e.g. 0/2@127.0.0.1:29500");
        let (ranks, leader) = spec.split_once('@').ok_or_else(bad)?;
        let (rank, world) = ranks.split_once('/').ok_or_else(bad)?;
        let (rank, world): (usize, usize) = (rank.parse().map_err(|_| bad())?, world.parse().map_err(|_| bad())?);
        if world == 0 || rank >= world {
            return Err(format!("`{spec}`: rank {rank} is not one of {world} ranks"));
        }
        if !leader.contains(':') {
            return Err(bad());
        }
        Ok(EpConfig {
            rank,
            world,
            leader: leader.to_string(),
            timeout: Duration::from_secs(120),
            step_timeout: DEFAULT_STEP_TIMEOUT,
            eplb: Default::default(),
            dbo: Default::default(),
        })
    }

    pub fn shard(&self) -> Shard {
        Shard { rank: self.rank, world: self.world }
    }

    /// A digest of the settings every rank must share (load balancing and dual-batch overlap decide which
    /// collectives a step issues): the rendezvous refuses a rank whose digest differs from the leader's.
    pub fn settings_digest(&self) -> u64 {
        let text = format!("{:?}|{:?}", self.eplb, self.dbo);
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
    }
}

const HELLO: &[u8; 4] = b"TDEP";
/// The leader's answer to a rank it refuses, followed by the reason (`REFUSAL_BYTES`, zero-padded).
const REFUSED: &[u8; 4] = b"TDNO";
const REFUSAL_BYTES: usize = 128;

/// Sends `why` to a rank the leader refuses (best effort: the rank may be gone).
fn refuse(conn: &mut TcpStream, why: &str) {
    let mut msg = [0u8; REFUSAL_BYTES];
    let b = why.as_bytes();
    msg[..b.len().min(REFUSAL_BYTES)].copy_from_slice(&b[..b.len().min(REFUSAL_BYTES)]);
    drop(conn.write_all(REFUSED).and_then(|()| conn.write_all(&msg)));
}

/// The default bound on one step (a forward call): above the longest prefill chunk a rank runs (a few
/// seconds at DeepSeek-V3.2's depth), short enough that a lost peer ends the others' steps within seconds.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The leader's side of the start-up: the NCCL id to every other rank, once all have said hello.
fn serve_id(cfg: &EpConfig, id: &nccl::ncclUniqueId) -> Result<(), String> {
    let listener = TcpListener::bind(&cfg.leader).map_err(|e| format!("listening on {}: {e}", cfg.leader))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + cfg.timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
    while peers.iter().skip(1).any(Option::is_none) {
        match listener.accept() {
            Ok((mut conn, from)) => {
                conn.set_nonblocking(false).map_err(|e| e.to_string())?;
                conn.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
                let mut hello = [0u8; 20];
                if conn.read_exact(&mut hello).is_err() || &hello[..4] != HELLO {
                    tracing::warn!("expert parallelism: {from} is not a tandem rank; ignored");
                    continue;
                }
                let rank = u32::from_le_bytes(hello[4..8].try_into().unwrap()) as usize;
                let world = u32::from_le_bytes(hello[8..12].try_into().unwrap()) as usize;
                let digest = u64::from_le_bytes(hello[12..20].try_into().unwrap());
                if world != cfg.world || rank == 0 || rank >= cfg.world {
                    let why = format!("{from} says it is rank {rank} of {world}; this group has {} ranks", cfg.world);
                    refuse(&mut conn, &why);
                    return Err(why);
                }
                if digest != cfg.settings_digest() {
                    let why = format!(
                        "rank {rank} ({from}) has other load-balancing or overlap settings than the leader \
                         (--eplb*, --dbo must be the same on every rank; the leader has {:?}, {:?})",
                        cfg.eplb, cfg.dbo
                    );
                    refuse(&mut conn, &why);
                    for p in peers.iter_mut().flatten() {
                        refuse(p, &why);
                    }
                    return Err(why);
                }
                if peers[rank].is_some() {
                    return Err(format!("two processes say they are rank {rank} (the second from {from})"));
                }
                peers[rank] = Some(conn);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<usize> = (1..cfg.world).filter(|&r| peers[r].is_none()).collect();
                    return Err(format!("ranks {missing:?} did not arrive within {:?}", cfg.timeout));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(format!("accepting ranks on {}: {e}", cfg.leader)),
        }
    }
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    for conn in peers.iter_mut().flatten() {
        conn.write_all(HELLO).and_then(|()| conn.write_all(&bytes)).map_err(|e| format!("sending the NCCL id: {e}"))?;
    }
    Ok(())
}

/// A non-leader's side: hello to the leader (retried until it listens), then its NCCL id.
fn fetch_id(cfg: &EpConfig) -> Result<nccl::ncclUniqueId, String> {
    let deadline = Instant::now() + cfg.timeout;
    // The leader's name may not resolve yet either (its pod not scheduled, its DNS record not published):
    // resolution is retried until the deadline like the connection.
    let mut conn = loop {
        let tried = match cfg.leader.to_socket_addrs() {
            Ok(mut addrs) => match addrs.next() {
                Some(a) => TcpStream::connect_timeout(&a, Duration::from_secs(2)).map_err(|e| e.to_string()),
                None => Err("no address".to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        match tried {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("the leader at {} did not answer within {:?} ({e})", cfg.leader, cfg.timeout));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let mut hello = HELLO.to_vec();
    hello.extend((cfg.rank as u32).to_le_bytes());
    hello.extend((cfg.world as u32).to_le_bytes());
    hello.extend(cfg.settings_digest().to_le_bytes());
    conn.write_all(&hello).map_err(|e| format!("greeting the leader: {e}"))?;
    conn.set_read_timeout(Some(cfg.timeout)).map_err(|e| e.to_string())?;
    let mut answer = [0u8; 4 + 128];
    conn.read_exact(&mut answer).map_err(|e| format!("waiting for the NCCL id from {}: {e}", cfg.leader))?;
    if &answer[..4] == REFUSED {
        let why = String::from_utf8_lossy(&answer[4..]).trim_end_matches('\0').to_string();
        return Err(format!("the leader at {} refused this rank: {why}", cfg.leader));
    }
    if &answer[..4] != HELLO {
        return Err(format!("{} is not a tandem leader", cfg.leader));
    }
    let mut internal = [0 as std::ffi::c_char; 128];
    for (d, s) in internal.iter_mut().zip(&answer[4..]) {
        *d = *s as std::ffi::c_char;
    }
    Ok(nccl::ncclUniqueId { internal })
}

/// Set in a rank's environment (tests only), the rank exits right after it received the NCCL id.
pub const FAULT_EXIT_AFTER_ID: &str = "TANDEM_EP_FAULT_EXIT_AFTER_ID";

/// Fault injection for the tests: set to N, this rank exits when the ranks have agreed to replay a decode
/// graph for the Nth time, just before it would launch its own, so the others replay theirs without it.
pub const FAULT_EXIT_AT_REPLAY: &str = "TANDEM_EP_FAULT_EXIT_AT_REPLAY";

/// `ncclCommInitRank` within `cfg.timeout`: it waits for every rank, and a rank that died after the
/// rendezvous would otherwise hold this one forever. On the deadline the set-up thread is left blocked in
/// NCCL and the rank reports the error (the recovery is restarting every rank's process).
fn init_comm(gpu: &Gpu, cfg: &EpConfig, id: nccl::ncclUniqueId) -> Result<nccl::ncclComm_t, CudaError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (ctx, world, rank) = (gpu.context().clone(), cfg.world as i32, cfg.rank as i32);
    std::thread::Builder::new()
        .name(format!("ep-init-{rank}"))
        .spawn(move || {
            let made = ctx.bind_to_thread().map_err(CudaError::from).and_then(|()| {
                let mut comm = std::ptr::null_mut();
                // SAFETY: valid out-pointer; every rank calls with the same id and world size.
                check("ncclCommInitRank", unsafe { nccl::ncclCommInitRank(&mut comm, world, id, rank) })?;
                Ok(CommPtr(comm))
            });
            // The receiver may have given up (the deadline): the communicator is then never used.
            drop(tx.send(made));
        })
        .map_err(|e| CudaError::Driver(format!("starting NCCL's set-up: {e}")))?;
    match rx.recv_timeout(cfg.timeout) {
        Ok(made) => Ok(made?.0),
        Err(_) => Err(CudaError::Driver(format!(
            "expert parallelism start-up: NCCL's communicator set-up did not finish within {:?}: a rank died or \
             hangs after the rendezvous (restart every rank)",
            cfg.timeout
        ))),
    }
}

pub use crate::lockstep::Pass;

/// One recorded stage of an overlapped pass.
struct Stage {
    lane: Lane,
    micro: usize,
    what: &'static str,
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

/// A stage's place on the timeline ([`EpGroup::take_timeline`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageTime {
    pub lane: &'static str,
    pub micro: usize,
    pub what: &'static str,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// Where a MoE layer's exchanges run: on the backend's one stream, or on the group's second stream so that
/// they overlap the other micro-batch's compute (dual-batch overlap, docs/model.md §5.3). Every collective
/// of a pass runs on one lane, in the same order on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Main,
    Comm,
}

/// The tag of a step agreement ([`EpGroup::agree_step`]); pass agreements carry their pass (1-3).
const STEP_TAG: i32 = 8;
/// The largest agreement: three passes' rows and the tag twice (every agreement sends this many, so a rank
/// in another kind of agreement is told apart by the tag rather than left in a mismatched collective).
const AGREE_INTS: usize = 5;
/// Tags of the decode graphs' agreements ([`EpGroup::agree_graph_shape`], [`EpGroup::agree_graph_plan`]).
const GRAPH_SHAPE_TAG: i32 = 9;
const GRAPH_PLAN_TAG: i32 = 10;
const GRAPH_OUTCOME_TAG: i32 = 11;

/// The communicator and what the watchdog shares with the forward calls.
struct Shared {
    /// Null once aborted. Collectives hold the read lock while they enqueue; the abort takes the write lock.
    comm: std::sync::RwLock<CommPtr>,
    /// Set once a collective failed or the group was aborted: every later call is refused.
    broken: Mutex<Option<String>>,
    /// The step in flight: when it began, the event its last work records (once enqueued), and its bound.
    armed: Mutex<Option<(Instant, Option<cudarc::driver::CudaEvent>, Duration)>>,
    /// The thread running NCCL's abort of the communicator, once aborted ([`Shared::abort`]).
    aborting: Mutex<Option<std::thread::JoinHandle<()>>>,
    rank: usize,
}

#[derive(Clone, Copy)]
struct CommPtr(nccl::ncclComm_t);

impl CommPtr {
    /// NCCL's abort of the communicator (taken out of the shared slot: nothing else uses it).
    fn abort(self) {
        // SAFETY: a live communicator no other thread can reach any more.
        unsafe { nccl::ncclCommAbort(self.0) };
    }
}
// SAFETY: an NCCL communicator may be used from any thread; the lock around it orders use and abort.
unsafe impl Send for CommPtr {}
unsafe impl Sync for CommPtr {}

impl Shared {
    fn mark_broken(&self, why: String) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        b.get_or_insert(why);
    }

    /// Aborts the communicator (once): pending collectives end, later ones are refused. The communicator
    /// is taken out under the lock and aborted on a thread of its own: NCCL's abort stops the device's
    /// pending collectives at once but returns only once every CUDA graph holding this communicator's
    /// launches is destroyed, which the backend does when it sees the group down (or at its drop). No caller
    /// waits for that: not the thread that must drop the graphs, not the watchdog.
    fn abort(&self, why: &str) {
        self.abort_on(false, why);
    }

    /// [`abort`](Self::abort) from the watchdog (`watchdog`: it holds no graphs, so without a thread for the
    /// abort it may wait for it itself) or from a forward thread.
    fn abort_on(&self, watchdog: bool, why: &str) {
        self.mark_broken(why.to_string());
        let comm = {
            let mut c = self.comm.write().unwrap_or_else(|p| p.into_inner());
            CommPtr(std::mem::replace(&mut c.0, std::ptr::null_mut()))
        };
        if comm.0.is_null() {
            return;
        }
        tracing::error!(rank = self.rank, "expert-parallel group aborted: {why}");
        match std::thread::Builder::new().name(format!("ep-abort-{}", self.rank)).spawn(move || comm.abort()) {
            Ok(h) => *self.aborting.lock().unwrap_or_else(|p| p.into_inner()) = Some(h),
            Err(e) if watchdog => {
                // The forward thread sees the group broken, its device work ends with the abort's flags, and
                // it drops its graphs: this abort then returns.
                tracing::warn!(error = %e, "no thread for NCCL's abort; the watchdog aborts");
                comm.abort();
            }
            Err(e) => {
                // Not on a forward thread, which may hold the graphs the abort waits for: the group's drop
                // aborts it, after the backend dropped its graphs (the group is marked broken already).
                tracing::warn!(error = %e, "no thread for NCCL's abort; the communicator is aborted when the group ends");
                self.comm.write().unwrap_or_else(|p| p.into_inner()).0 = comm.0;
            }
        }
    }

    /// One watchdog check: the step in flight past its bound, or an asynchronous NCCL error.
    fn check_step(&self) {
        let overdue = {
            let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
            match &*armed {
                Some((_, Some(ev), _)) if ev.is_complete() => {
                    *armed = None;
                    None
                }
                Some((since, _, bound)) if since.elapsed() > *bound => Some((since.elapsed(), *bound)),
                _ => None,
            }
        };
        if let Some((t, bound)) = overdue {
            self.abort_on(
                true,
                &format!(
                    "rank {}: a step has not finished after {:.1} s (bound {bound:?}): another rank died or hangs",
                    self.rank,
                    t.as_secs_f64(),
                ),
            );
            return;
        }
        let c = self.comm.read().unwrap_or_else(|p| p.into_inner());
        if c.0.is_null() {
            return;
        }
        let mut r = nccl::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator (read lock held); valid out-pointer.
        unsafe { nccl::ncclCommGetAsyncError(c.0, &mut r) };
        drop(c);
        if r != nccl::ncclResult_t::ncclSuccess && r != nccl::ncclResult_t::ncclInProgress {
            self.abort_on(true, &format!("rank {}: NCCL reports {r:?} (a peer's connection was lost)", self.rank));
        }
    }
}

/// One rank's membership of an expert-parallel group: its NCCL communicator on the backend's stream, and
/// a watchdog thread that aborts it when a step overruns [`EpConfig::step_timeout`].
pub struct EpGroup {
    shared: Arc<Shared>,
    shard: Shard,
    stream: Arc<CudaStream>,
    /// The second stream dual-batch overlap issues the exchanges on ([`Lane::Comm`]).
    comm: Arc<CudaStream>,
    /// Stages of overlapped passes while a timeline is recorded ([`EpGroup::record_timeline`]).
    timeline: Mutex<Option<Vec<Stage>>>,
    /// i32 `[3]`: (rows, pass, -pass) reduced by max.
    agree_buf: DBuf<i32>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    /// Events recorded after the latest MoE layers' exchanges: the host issues at most [`PACE_LAYERS`] ahead
    /// of the GPU, so a hung collective never fills CUDA's launch queue and blocks an enqueue (which would
    /// hold the communicator's read lock against the watchdog's abort).
    paced: Mutex<std::collections::VecDeque<cudarc::driver::CudaEvent>>,
    step_timeout: Duration,
    /// Bounds the first agreement after start-up ([`EpConfig::timeout`]).
    start_timeout: Duration,
    /// Set once the group is formed, cleared by the first agreement.
    starting: std::sync::atomic::AtomicBool,
    /// A decode pass is being captured as a CUDA graph: nothing runs, so the host does not pace itself on
    /// events recorded into the capture (querying one is an error).
    capturing: std::sync::atomic::AtomicBool,
    /// [`FAULT_EXIT_AT_REPLAY`] (read once, at the group's start), and the replays agreed so far.
    exit_at_replay: Option<usize>,
    replays_agreed: std::sync::atomic::AtomicUsize,
}

/// MoE layers the host may run ahead of the GPU under expert parallelism (a DeepSeek-V3.2 layer is about 40
/// launches; CUDA's pending-launch queue holds about a thousand).
pub const PACE_LAYERS: usize = 2;

fn check(what: &str, r: nccl::ncclResult_t) -> Result<(), CudaError> {
    if r == nccl::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        // SAFETY: a plain NCCL call returning a static string.
        let text = unsafe { std::ffi::CStr::from_ptr(nccl::ncclGetErrorString(r)) };
        Err(CudaError::Driver(format!("NCCL {what}: {r:?} ({})", text.to_string_lossy())))
    }
}

impl EpGroup {
    /// Joins the group `cfg` describes on `gpu` (every rank calls it; it returns once all have joined).
    pub fn connect(gpu: &Gpu, cfg: &EpConfig) -> Result<Self, CudaError> {
        // SAFETY: only looks the library up.
        if !unsafe { nccl::is_culib_present() } {
            return Err(CudaError::NoGpu("expert parallelism needs NCCL (libnccl.so) and none was found".into()));
        }
        let id = if cfg.rank == 0 {
            let mut id = std::mem::MaybeUninit::uninit();
            // SAFETY: the out-pointer is valid.
            check("ncclGetUniqueId", unsafe { nccl::ncclGetUniqueId(id.as_mut_ptr()) })?;
            // SAFETY: initialized by the successful call.
            let id = unsafe { id.assume_init() };
            serve_id(cfg, &id).map_err(|e| CudaError::Driver(format!("expert parallelism start-up: {e}")))?;
            id
        } else {
            fetch_id(cfg).map_err(|e| CudaError::Driver(format!("expert parallelism start-up: {e}")))?
        };
        if std::env::var_os(FAULT_EXIT_AFTER_ID).is_some() {
            // Fault injection for the tests: this rank dies between the rendezvous and NCCL's set-up.
            std::process::exit(3);
        }
        gpu.context().bind_to_thread()?;
        let comm = init_comm(gpu, cfg, id)?;
        let stream = gpu.stream().clone();
        let agree_buf = DBuf::zeros(&stream, AGREE_INTS)?;
        let shared = Arc::new(Shared {
            comm: std::sync::RwLock::new(CommPtr(comm)),
            broken: Mutex::new(None),
            armed: Mutex::new(None),
            aborting: Mutex::new(None),
            rank: cfg.rank,
        });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watchdog = {
            let (shared, stop, ctx) = (shared.clone(), stop.clone(), gpu.context().clone());
            std::thread::Builder::new()
                .name(format!("ep-watchdog-{}", cfg.rank))
                .spawn(move || {
                    ctx.bind_to_thread().ok();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        shared.check_step();
                        std::thread::sleep(Duration::from_millis(50));
                    }
                })
                .map_err(|e| CudaError::Driver(format!("starting the expert-parallel watchdog: {e}")))?
        };
        let g = EpGroup {
            shared,
            shard: cfg.shard(),
            comm: gpu.context().new_stream()?,
            timeline: Mutex::new(None),
            stream,
            agree_buf,
            stop,
            watchdog: Some(watchdog),
            paced: Mutex::new(std::collections::VecDeque::new()),
            step_timeout: cfg.step_timeout,
            start_timeout: cfg.timeout,
            starting: std::sync::atomic::AtomicBool::new(false),
            capturing: std::sync::atomic::AtomicBool::new(false),
            exit_at_replay: std::env::var(FAULT_EXIT_AT_REPLAY).ok().and_then(|v| v.parse().ok()),
            replays_agreed: std::sync::atomic::AtomicUsize::new(0),
        };
        // Every collective once, so the point-to-point connections exist before the first step (a first
        // connection waits for the peer, which the watchdog could not interrupt).
        g.agree(0, Pass::Main)?;
        let mut ws = Workspace::new();
        let (a, b) = (ws.take::<u8>(&g.stream, 256 * cfg.world)?, ws.take::<u8>(&g.stream, 256 * cfg.world)?);
        g.gather_p2p(a, b, 256, Lane::Main)?;
        g.all_to_all(a, b, 256, Lane::Main)?;
        g.all_gather(a, b, 256)?;
        g.step_issued()?;
        g.stream.synchronize()?;
        // The ranks leave here together, but each still sets up its worker (cache pool, transports) before
        // its first step: the first agreement waits up to the start-up bound, not the step bound.
        g.starting.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(g)
    }

    /// Runs `f` (a collective's enqueue) with the communicator under the read lock, or returns the group's error.
    fn with_comm<T>(&self, f: impl FnOnce(nccl::ncclComm_t) -> Result<T, CudaError>) -> Result<T, CudaError> {
        self.usable()?;
        let c = self.shared.comm.read().unwrap_or_else(|p| p.into_inner());
        if c.0.is_null() {
            drop(c);
            self.usable()?;
            return Err(CudaError::Driver("the expert-parallel group is down".into()));
        }
        let r = f(c.0);
        drop(c);
        r.map_err(|e| self.fail(e))
    }

    /// Marks the end of the step's work on the stream: the watchdog disarms once it has run.
    pub fn step_issued(&self) -> Result<(), CudaError> {
        let ev = self.stream.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        ev.record(&self.stream)?;
        let mut armed = self.shared.armed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, e, _)) = armed.as_mut() {
            *e = Some(ev);
        }
        Ok(())
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Waits (spinning, checking the group) until the GPU is at most [`PACE_LAYERS`] MoE layers behind; at
    /// once while a graph is captured.
    pub fn pace(&self) -> Result<(), CudaError> {
        if self.is_capturing() {
            return Ok(());
        }
        let mut q = self.paced.lock().unwrap_or_else(|p| p.into_inner());
        while q.len() >= PACE_LAYERS {
            while !q.front().is_some_and(cudarc::driver::CudaEvent::is_complete) {
                self.usable()?;
                std::thread::yield_now();
            }
            q.pop_front();
        }
        Ok(())
    }

    /// Marks the end of a MoE layer's exchange on the stream (for [`pace`](Self::pace)); nothing while a
    /// graph is captured.
    pub fn layer_issued(&self) -> Result<(), CudaError> {
        if self.is_capturing() {
            return Ok(());
        }
        let ev = self.stream.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        ev.record(&self.stream)?;
        self.paced.lock().unwrap_or_else(|p| p.into_inner()).push_back(ev);
        Ok(())
    }

    /// A decode pass is captured as a CUDA graph from now (`true`) or no longer.
    pub fn set_capturing(&self, on: bool) {
        self.capturing.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_capturing(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether stages of overlapped passes are being recorded ([`record_timeline`](Self::record_timeline)):
    /// their events are read per launch, so such passes are not captured.
    pub fn recording_timeline(&self) -> bool {
        self.timeline.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn cu_stream(&self) -> nccl::cudaStream_t {
        self.stream.cu_stream() as nccl::cudaStream_t
    }

    fn usable(&self) -> Result<(), CudaError> {
        match &*self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(CudaError::Driver(format!("the expert-parallel group is down: {why}"))),
            None => Ok(()),
        }
    }

    fn fail(&self, e: CudaError) -> CudaError {
        self.shared.mark_broken(e.to_string());
        e
    }

    /// Whether the group has failed (a collective's error, the watchdog, [`abort`](Self::abort)): every
    /// later call is an error, and the ranks must form a new group.
    pub fn is_down(&self) -> Option<String> {
        self.shared.broken.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The most rows any rank brings to this `pass` (0: every rank is idle); [`capacity`] turns it into the
    /// call's capacity. One all-reduce, then a wait for it: the host-side agreement of a forward call that no
    /// step agreement ([`agree_step`](Self::agree_step)) covers. Ranks in different passes are an error on
    /// every rank.
    pub fn agree(&self, rows: usize, pass: Pass) -> Result<usize, CudaError> {
        // As many ints as a step agreement (NCCL needs the same count on every rank), the tag told apart.
        Ok(self.agree_tagged(&[rows, 0, 0], pass as i32, &format!("the {pass:?} pass"))?[0])
    }

    /// The most rows any rank brings to each pass of a step ([`Pass::STEP`] order): the step's one
    /// agreement, after which its passes run without another (a pass every rank brings 0 rows to is skipped).
    /// Ranks where another runs a pass agreement instead are an error on every rank.
    pub fn agree_step(&self, rows: [usize; 3]) -> Result<[usize; 3], CudaError> {
        let got = self.agree_tagged(&rows, STEP_TAG, "a step agreement")?;
        if got.iter().all(|&r| r == 0) {
            // No rank has work: no pass runs, so nothing follows the agreement for the watchdog to bound.
            self.disarm();
        }
        Ok([got[0], got[1], got[2]])
    }

    /// (Re)starts the watchdog's bound on a forward call: a pass of an agreed step (its agreement did so for
    /// the first).
    pub fn arm(&self) {
        self.arm_for(self.step_timeout);
    }

    fn arm_for(&self, bound: Duration) {
        *self.shared.armed.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), None, bound));
    }

    /// Nothing of the step is in flight (a step every rank agreed to be empty): the watchdog rests.
    fn disarm(&self) {
        *self.shared.armed.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// One all-reduce (max) of `rows` with `tag` and `-tag` after them: every rank must bring the same tag.
    fn agree_tagged(&self, rows: &[usize], tag: i32, what: &str) -> Result<Vec<usize>, CudaError> {
        self.usable()?;
        // It may be a thread's first CUDA call (a worker's compute loop agreeing on an idle step): the raw
        // copies below need the context current.
        self.stream.context().bind_to_thread()?;
        // A step begins: the watchdog bounds it from here (the wait below included); the first after start-up
        // by the start-up bound.
        let first = self.starting.swap(false, std::sync::atomic::Ordering::Relaxed);
        self.arm_for(if first { self.start_timeout } else { self.step_timeout });
        let vals: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let got = self.max_ints(&vals, tag, what)?;
        if let Some(bad) = got.iter().find(|&&r| r < 0) {
            let e = CudaError::Driver(format!("expert-parallel agreement returned {bad} rows"));
            self.shared.abort(&e.to_string());
            return Err(e);
        }
        Ok(got.iter().map(|&r| r as usize).collect())
    }

    /// The decode graph shape of a pass that may be captured (engine::cuda::graphs): each rank says whether
    /// it can run the pass as a graph (`able`), its rows and the block-table width its rows need. The pass is
    /// captured (or replayed) on every rank or on none: `Some(most blocks)` where every rank is able and has
    /// rows, `None` otherwise (a rank joining empty passes `able = false`). Every rank then pads its rows to
    /// the same count and its tables to the same width, so the ranks' graphs are captured and replayed
    /// together: NCCL requires a graph's collectives to be captured, and replayed, by all their ranks at
    /// once. Called inside a pass (the watchdog is armed).
    pub fn agree_graph_shape(&self, able: bool, rows: usize, blocks: usize) -> Result<Option<usize>, CudaError> {
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        let got = self.max_ints(&[i32::from(!able), -clamp(rows), clamp(blocks)], GRAPH_SHAPE_TAG, "a graph shape")?;
        Ok((got[0] == 0 && got[1] < 0).then_some(got[2].max(1) as usize))
    }

    /// The agreed plan for a graph every rank is about to run ([`agree_graph_shape`](Self::agree_graph_shape)
    /// said yes): each rank's own (0 replay, 1 run and capture, 2 run eagerly) and the capture its held graph
    /// came from (`serial`, the same count on every rank: captures are collective). Every rank replays where
    /// every rank holds a graph of the same capture; otherwise every rank runs and captures (again, where
    /// some still held one), or none does (2: a shape whose capture failed). So the ranks' graphs always come
    /// from one capture, as NCCL requires.
    pub fn agree_graph_plan(&self, plan: i32, serial: u64) -> Result<i32, CudaError> {
        let s = serial.min(i32::MAX as u64) as i32;
        let got = self.max_ints(&[plan, s, -s], GRAPH_PLAN_TAG, "a graph plan")?;
        let agreed = match got[0] {
            0 if got[1] != -got[2] => 1,
            p => p,
        };
        if agreed == 0
            && let Some(n) = self.exit_at_replay
            && self.replays_agreed.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == n
        {
            std::process::exit(3);
        }
        Ok(agreed)
    }

    /// After a capture every rank made together: whether it succeeded on every rank (`captured` on this
    /// one). A failure anywhere is everyone's, so no rank replays a graph another lacks.
    pub fn agree_graph_outcome(&self, captured: bool) -> Result<bool, CudaError> {
        Ok(self.max_ints(&[i32::from(!captured), 0, 0], GRAPH_OUTCOME_TAG, "a graph capture's outcome")?[0] == 0)
    }

    /// One all-reduce (max) of `vals` (at most [`AGREE_INTS`] - 2) with `tag` and `-tag` after them, padded to
    /// [`AGREE_INTS`], then a wait for it: ranks that bring another tag are out of lockstep (an error on
    /// every rank, the group aborted).
    fn max_ints(&self, vals: &[i32], tag: i32, what: &str) -> Result<Vec<i32>, CudaError> {
        self.usable()?;
        self.stream.context().bind_to_thread()?;
        let mut host = [0i32; AGREE_INTS];
        host[..vals.len()].copy_from_slice(vals);
        host[AGREE_INTS - 2] = tag;
        host[AGREE_INTS - 1] = -tag;
        let n = AGREE_INTS;
        let mut got = vec![0i32; n];
        let (dev, cs) = (self.agree_buf.ptr(), self.stream.cu_stream());
        self.with_comm(|comm| {
            // SAFETY: n = AGREE_INTS i32 to the buffer; the host vector outlives the synchronize below.
            unsafe { cudarc::driver::result::memcpy_htod_async(dev, &host[..], cs) }
                .map_err(|e| CudaError::Driver(format!("the agreement's upload: {e}")))?;
            let p = dev as *mut std::ffi::c_void;
            // SAFETY: n i32 in place on this communicator's stream.
            check("all-reduce (step agreement)", unsafe {
                nccl::ncclAllReduce(
                    p,
                    p,
                    n,
                    nccl::ncclDataType_t::ncclInt32,
                    nccl::ncclRedOp_t::ncclMax,
                    comm,
                    cs as nccl::cudaStream_t,
                )
            })
        })?;
        // The wait is outside the lock: the watchdog can abort a collective that never completes.
        let waited = (|| -> Result<(), CudaError> {
            // SAFETY: n i32 back; synchronized before `got` is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut got[..], dev, cs) }
                .map_err(|e| CudaError::Driver(format!("the agreement's read-back: {e}")))?;
            self.stream.synchronize().map_err(|e| CudaError::Driver(format!("the agreement's wait: {e}")))?;
            Ok(())
        })();
        self.usable()?;
        waited.map_err(|e| self.fail(e))?;
        if got[n - 2] != -got[n - 1] {
            let e = CudaError::Driver(format!(
                "expert-parallel ranks are out of lockstep: this rank runs {what}, another something else"
            ));
            self.shared.abort(&e.to_string());
            return Err(e);
        }
        got.truncate(vals.len());
        Ok(got)
    }

    /// Every rank's `bytes` at `send` into `recv` (`world * bytes`, rank order).
    pub fn all_gather(&self, send: u64, recv: u64, bytes: usize) -> Result<(), CudaError> {
        let s = self.cu_stream();
        self.with_comm(|comm| {
            // SAFETY: device buffers of `bytes` and `world * bytes` on this communicator's stream.
            check("all-gather", unsafe {
                nccl::ncclAllGather(
                    send as *const std::ffi::c_void,
                    recv as *mut std::ffi::c_void,
                    bytes,
                    nccl::ncclDataType_t::ncclUint8,
                    comm,
                    s,
                )
            })
        })
    }

    /// Each of `bufs` (device address, i32 count) summed over every rank, in place: one grouped call.
    pub fn all_reduce_sum_i32(&self, bufs: &[(u64, usize)]) -> Result<(), CudaError> {
        let s = self.cu_stream();
        self.with_comm(|comm| {
            // SAFETY: device buffers of `n` i32 each, in place, on this communicator's stream.
            unsafe {
                check("group start", nccl::ncclGroupStart())?;
                for &(p, n) in bufs {
                    let r = nccl::ncclAllReduce(
                        p as *const _,
                        p as *mut _,
                        n,
                        nccl::ncclDataType_t::ncclInt32,
                        nccl::ncclRedOp_t::ncclSum,
                        comm,
                        s,
                    );
                    if let Err(e) = check("all-reduce (expert loads)", r) {
                        nccl::ncclGroupEnd();
                        return Err(e);
                    }
                }
                check("group end", nccl::ncclGroupEnd())
            }
        })
    }

    /// One grouped round of point-to-point moves: each `(peer, address, bytes, send)` sends those bytes to
    /// `peer` or receives them from it. Every pair of ranks must list its moves between them in the same
    /// order (NCCL pairs them up in order).
    pub fn moves(&self, moves: &[(usize, u64, usize, bool)]) -> Result<(), CudaError> {
        if moves.is_empty() {
            return Ok(());
        }
        let s = self.cu_stream();
        self.with_comm(|c| {
            // SAFETY: grouped point-to-point calls over device buffers of the given sizes.
            unsafe {
                check("group start", nccl::ncclGroupStart())?;
                for &(peer, p, bytes, send) in moves {
                    let d = nccl::ncclDataType_t::ncclUint8;
                    let r = if send {
                        check("send", nccl::ncclSend(p as *const _, bytes, d, peer as i32, c, s))
                    } else {
                        check("recv", nccl::ncclRecv(p as *mut _, bytes, d, peer as i32, c, s))
                    };
                    if let Err(e) = r {
                        nccl::ncclGroupEnd();
                        return Err(e);
                    }
                }
                check("group end", nccl::ncclGroupEnd())
            }
        })
    }

    /// [`all_gather`](Self::all_gather) as point-to-point calls: `send` to every rank, rank q's into block q
    /// of `recv`, on `lane`.
    pub fn gather_p2p(&self, send: u64, recv: u64, bytes: usize, lane: Lane) -> Result<(), CudaError> {
        self.exchange(|_| send, recv, bytes, lane)
    }

    /// Block q of `send` (`bytes` each) to rank q, and rank q's block for this rank into block q of `recv`,
    /// on `lane`.
    pub fn all_to_all(&self, send: u64, recv: u64, bytes: usize, lane: Lane) -> Result<(), CudaError> {
        self.exchange(|q| send + (q * bytes) as u64, recv, bytes, lane)
    }

    /// Starts (or stops and drops) recording the stages of overlapped passes: each between two timing
    /// events on its lane ([`take_timeline`](Self::take_timeline)).
    pub fn record_timeline(&self, on: bool) {
        *self.timeline.lock().unwrap_or_else(|p| p.into_inner()) = on.then(Vec::new);
    }

    /// Runs `f` (work issued on `lane` for micro-batch `micro`) as a timeline stage named `what`.
    pub fn timed<T, E: From<CudaError>>(
        &self,
        lane: Lane,
        micro: usize,
        what: &'static str,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        if self.timeline.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            return f();
        }
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.lane(lane).record_event(flags).map_err(CudaError::from)?;
        let out = f()?;
        let end = self.lane(lane).record_event(flags).map_err(CudaError::from)?;
        if let Some(t) = self.timeline.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            t.push(Stage { lane, micro, what, start, end });
        }
        Ok(out)
    }

    /// The recorded stages (waiting for the last), in milliseconds from the first stage's start; recording
    /// goes on with an empty list (nothing while not recording).
    pub fn take_timeline(&self) -> Result<Vec<StageTime>, CudaError> {
        let stages = match self.timeline.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            Some(v) => std::mem::take(v),
            None => return Ok(Vec::new()),
        };
        let Some(first) = stages.first() else { return Ok(Vec::new()) };
        for st in &stages {
            st.end.synchronize()?;
        }
        stages
            .iter()
            .map(|st| {
                Ok(StageTime {
                    lane: if st.lane == Lane::Main { "main" } else { "comm" },
                    micro: st.micro,
                    what: st.what,
                    start_ms: first.start.elapsed_ms(&st.start)? as f64,
                    end_ms: first.start.elapsed_ms(&st.end)? as f64,
                })
            })
            .collect()
    }

    /// The stream `lane` issues on.
    pub fn lane(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Main => &self.stream,
            Lane::Comm => &self.comm,
        }
    }

    /// An event on `lane` after the work issued there so far.
    pub fn mark(&self, lane: Lane) -> Result<cudarc::driver::CudaEvent, CudaError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(self.lane(lane).record_event(flags)?)
    }

    /// `lane` waits for `ev` before its later work.
    pub fn wait(&self, lane: Lane, ev: &cudarc::driver::CudaEvent) -> Result<(), CudaError> {
        Ok(self.lane(lane).wait(ev)?)
    }

    /// One grouped round of point-to-point calls: `from(q)` to rank q, rank q's into block q of `recv`.
    fn exchange(&self, from: impl Fn(usize) -> u64, recv: u64, bytes: usize, lane: Lane) -> Result<(), CudaError> {
        let (s, world) = (self.lane(lane).cu_stream() as nccl::cudaStream_t, self.shard.world);
        self.with_comm(|c| {
            // SAFETY: grouped point-to-point calls over device buffers of `bytes` per rank.
            unsafe {
                check("group start", nccl::ncclGroupStart())?;
                for q in 0..world {
                    let d = nccl::ncclDataType_t::ncclUint8;
                    let sent = check("send", nccl::ncclSend(from(q) as *const _, bytes, d, q as i32, c, s));
                    let got = sent.and_then(|()| {
                        check("recv", nccl::ncclRecv((recv + (q * bytes) as u64) as *mut _, bytes, d, q as i32, c, s))
                    });
                    if let Err(e) = got {
                        nccl::ncclGroupEnd();
                        return Err(e);
                    }
                }
                check("group end", nccl::ncclGroupEnd())
            }
        })
    }

    /// Ends the communicator at once (another rank died or hangs): pending collectives return, and every
    /// later call of this group is an error.
    pub fn abort(&self, why: &str) {
        self.shared.abort(why);
    }
}

impl Drop for EpGroup {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(w) = self.watchdog.take() {
            drop(w.join());
        }
        // An abort in progress ends once no graph holds the communicator (the backend dropped its graphs
        // before its group).
        let aborting = self.shared.aborting.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = aborting {
            drop(h.join());
        }
        let mut c = self.shared.comm.write().unwrap_or_else(|p| p.into_inner());
        if c.0.is_null() {
            return;
        }
        // SAFETY: the communicator is not used after this; a broken one is aborted rather than destroyed
        // (destroy waits for pending work that may never finish).
        unsafe {
            if self.is_down().is_some() {
                nccl::ncclCommAbort(c.0);
            } else {
                nccl::ncclCommDestroy(c.0);
            }
        }
        c.0 = std::ptr::null_mut();
    }
}

/// A call's capacity from the agreed most rows of any rank: rounded up to the decode graphs' row bucket
/// where there is one (a captured pass pads every rank's rows to it, engine::cuda::graphs::row_bucket), then
/// to 4 (the FP8 scales' row alignment); at least 4.
pub fn capacity(max_rows: usize) -> usize {
    super::graphs::row_bucket(max_rows).unwrap_or(max_rows).max(1).next_multiple_of(4)
}

/// Byte layout of one dispatch record of `cap` rows.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub cap: usize,
    pub scales_off: usize,
    pub ids_off: usize,
    pub bytes: usize,
}

impl Record {
    pub fn new(cap: usize, kpad: usize, k: usize) -> Self {
        let scales_off = cap * kpad;
        let ids_off = scales_off + 4 * (kpad / gemm::BK) * cap;
        Record { cap, scales_off, ids_off, bytes: (ids_off + 4 * cap * k).next_multiple_of(256) }
    }
}

/// Device bytes one expert-parallel MoE layer takes from the workspace beyond the local grouping's
/// (`moe::workspace_bytes` of `world * cap * k` pairs): the records, the two combine buffers, the gathered
/// rows' codes and scales and the indices.
pub fn workspace_bytes(world: usize, cap: usize, k: usize, kpad: usize, hidden: usize) -> usize {
    let rec = Record::new(cap, kpad, k).bytes;
    let pairs = world * cap * k;
    (world + 1) * rec
        + 2 * 2 * pairs * hidden
        + pairs * (kpad + 4 * kpad / gemm::BK)
        + 4 * (2 * pairs + cap * k)
        + 8 * 256
}

/// This rank's dispatch record sent and every rank's gathered.
#[derive(Debug, Clone, Copy)]
pub struct Dispatched {
    pub rec: Record,
    /// `world` records, rank order.
    pub recv: u64,
    /// i32 `[rows, k]`: each own pair's row in the combine buffers.
    pub at: u64,
}

/// The record format of a MoE layer's experts: how their input rows are quantized, which must be rows of the
/// model's hidden size.
pub fn record_format(m: &DMoe, hidden: usize) -> Result<QuantFormat, CudaError> {
    let (inp, kpad, ue8m0) = moe::fp8_dims(&m.routed().experts.gate)?;
    if inp != hidden {
        return Err(CudaError::Shape(format!("ep: the experts take {inp} channels, the model has {hidden}")));
    }
    Ok(QuantFormat { inp, kpad, ue8m0 })
}

/// This rank's rows quantized into its dispatch record (step 1a), not yet sent.
#[derive(Debug, Clone, Copy)]
pub struct Quantized {
    pub rec: Record,
    /// The record (`rec.bytes`): codes `[cap][kpad]`, scales `[kpad / 128][cap]`, ids `[cap][k]`.
    pub send: u64,
    pub format: QuantFormat,
}

impl Quantized {
    /// The record's rows as a tensor-core linear's quantized input (the shared expert's gate and up read
    /// them: the same codes and scales their own quantization would give).
    pub fn input(&self) -> QuantIn {
        QuantIn { qa: self.send, sa: self.send + self.rec.scales_off as u64, ld: self.rec.cap, format: self.format }
    }
}

/// Step 1a: this rank's `rows` of `x [rows, hidden]` f32 quantized once into a record of `cap` rows (rows
/// past `rows` are padding).
#[allow(clippy::too_many_arguments)]
pub fn quantize(
    gpu: &Gpu,
    ws: &mut Workspace,
    cfg: &ModelConfig,
    format: QuantFormat,
    x: u64,
    rows: usize,
    cap: usize,
) -> Result<Quantized, CudaError> {
    let (hidden, kpad) = (cfg.hidden_size, format.kpad);
    if rows > cap || !cap.is_multiple_of(4) || !hidden.is_multiple_of(8) || kpad < hidden || format.inp != hidden {
        return Err(CudaError::Shape(format!("ep: {rows} rows of {hidden} at capacity {cap} (kpad {kpad})")));
    }
    let rec = Record::new(cap, kpad, cfg.num_experts_per_tok);
    let send = ws.take::<u8>(gpu.stream(), rec.bytes)?;
    if rows > 0 {
        let scales = send + rec.scales_off as u64;
        super::weights::act_quant_into(gpu, x, rows, hidden, kpad, format.ue8m0, cap, 0, send, scales)?;
    }
    Ok(Quantized { rec, send, format })
}

/// Step 1b: the route `ids [rows, k]` of the quantized rows `q` packed into the record (each pair's expert,
/// or under load balancing the slot of one of its copies: `slots`), and every rank's record gathered.
#[allow(clippy::too_many_arguments)]
pub fn dispatch(
    gpu: &Gpu,
    ws: &mut Workspace,
    ep: &EpGroup,
    cfg: &ModelConfig,
    q: &Quantized,
    rows: usize,
    ids: u64,
    slots: Option<&SlotTable>,
    lane: Lane,
    micro: usize,
) -> Result<Dispatched, CudaError> {
    let s = gpu.stream();
    let (world, k, rec, send) = (ep.shard.world, cfg.num_experts_per_tok, q.rec, q.send);
    let cap = rec.cap;
    if rows > cap {
        return Err(CudaError::Shape(format!("ep: {rows} rows at capacity {cap}")));
    }
    let recv = ws.take::<u8>(s, world * rec.bytes)?;
    let at = ws.take::<i32>(s, (rows * k).max(1))?;
    launch(
        gpu,
        "tandem_ep_pack_ids",
        elementwise_grid(cap * k),
        256,
        0,
        &[
            Arg::P(ids),
            Arg::I(rows as i32),
            Arg::I(cap as i32),
            Arg::I(k as i32),
            Arg::I(slots.map_or(cfg.n_routed_experts / world, |t| t.per_rank) as i32),
            Arg::P(slots.map_or(0, |t| t.table.ptr())),
            Arg::I(slots.map_or(0, |t| t.width) as i32),
            Arg::I(ep.shard.rank as i32),
            Arg::P(send + rec.ids_off as u64),
            Arg::P(at),
        ],
    )?;
    // Point-to-point sends of the one record to every rank: measured at the speed of a plain all-to-all of
    // those bytes, where ncclAllGather ran at 0.76-0.94x of it on two H200s (bench/RESULTS.md).
    if lane == Lane::Comm {
        ep.wait(Lane::Comm, &ep.mark(Lane::Main)?)?;
    }
    let ls = ep.lane(lane);
    ep.timed(lane, micro, "dispatch", || {
        gpu.profiler().time(ls, "nccl_ep_dispatch", || ep.gather_p2p(send, recv, rec.bytes, lane))
    })?;
    Ok(Dispatched { rec, recv, at })
}

/// The combine buffer of `d`'s call: `[world][cap * k]` bf16 rows of `hidden`, rank q's pairs in block q
/// (the down projection stores each pair's output there).
pub fn combine_buffer(
    gpu: &Gpu,
    ws: &mut Workspace,
    cfg: &ModelConfig,
    d: &Dispatched,
    world: usize,
) -> Result<u64, CudaError> {
    ws.take::<u16>(gpu.stream(), world * d.rec.cap * cfg.num_experts_per_tok * cfg.hidden_size)
}

/// Step 3: `back` (the [`combine_buffer`] with this rank's pairs' outputs in their rows) to the pairs'
/// ranks, and this rank's `rows` combined into `y [rows, hidden]` f32 in slot order with
/// `weights [rows, k]` and `shared` (f32 `[rows, hidden]` or 0).
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    ws: &mut Workspace,
    ep: &EpGroup,
    cfg: &ModelConfig,
    d: &Dispatched,
    back: u64,
    rows: usize,
    weights: u64,
    shared: u64,
    y: u64,
) -> Result<(), CudaError> {
    let home = combine_send(gpu, ws, ep, cfg, d, back, Lane::Main, 0)?;
    moe::combine(
        gpu,
        moe::PairRows::Bf16 { rows: home, slot: d.at },
        weights,
        shared,
        y,
        rows,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
    )
}

/// Step 3a: `back` to the pairs' ranks on `lane` (after the work issued so far on the main stream); where
/// this rank's pairs come home.
#[allow(clippy::too_many_arguments)]
pub fn combine_send(
    gpu: &Gpu,
    ws: &mut Workspace,
    ep: &EpGroup,
    cfg: &ModelConfig,
    d: &Dispatched,
    back: u64,
    lane: Lane,
    micro: usize,
) -> Result<u64, CudaError> {
    let (world, k, hidden, cap) = (ep.shard.world, cfg.num_experts_per_tok, cfg.hidden_size, d.rec.cap);
    let home = ws.take::<u16>(gpu.stream(), world * cap * k * hidden)?;
    if lane == Lane::Comm {
        ep.wait(Lane::Comm, &ep.mark(Lane::Main)?)?;
    }
    let ls = ep.lane(lane);
    ep.timed(lane, micro, "combine", || {
        gpu.profiler().time(ls, "nccl_ep_combine", || ep.all_to_all(back, home, cap * k * hidden * 2, lane))
    })?;
    Ok(home)
}

/// One micro-batch's MoE layer under expert parallelism between its stages ([`moe_send`], [`moe_experts`],
/// [`moe_finish`]): dual-batch overlap interleaves two of them; one pass runs them back to back on the
/// backend's stream.
pub struct Flight {
    /// Held for the layer: a rebalance replaces the experts between steps only.
    routed: Arc<super::weights::Routed>,
    d: Dispatched,
    kpad: usize,
    rows: usize,
    weights: u64,
    shared: u64,
    lane: Lane,
    micro: usize,
    /// On the comm lane: after the dispatch, after the combine's exchange.
    sent: Option<cudarc::driver::CudaEvent>,
    returned: Option<(u64, Option<cudarc::driver::CudaEvent>)>,
}

/// Stage 1 of a MoE layer under expert parallelism: `q` this rank's rows quantized into its record
/// ([`quantize`], at the call's agreed capacity: >= every rank's rows; `rows` may be 0), `ids`/`weights
/// [rows, k]` their routing, `shared [rows, hidden]` f32 or 0; the record dispatched on `lane`.
#[allow(clippy::too_many_arguments)]
pub fn moe_send(
    gpu: &Gpu,
    ws: &mut Workspace,
    ep: &EpGroup,
    cfg: &ModelConfig,
    m: &DMoe,
    q: &Quantized,
    rows: usize,
    ids: u64,
    weights: u64,
    shared: u64,
    lane: Lane,
    micro: usize,
) -> Result<Flight, CudaError> {
    if q.format != record_format(m, cfg.hidden_size)? {
        return Err(CudaError::Shape("ep: the record is not in the experts' input format".into()));
    }
    let routed = m.routed();
    let d = dispatch(gpu, ws, ep, cfg, q, rows, ids, routed.slots.as_ref(), lane, micro)?;
    let sent = if lane == Lane::Comm { Some(ep.mark(Lane::Comm)?) } else { None };
    Ok(Flight { routed, d, kpad: q.format.kpad, rows, weights, shared, lane, micro, sent, returned: None })
}

/// Stage 2: this rank's experts over every rank's pairs (once the dispatch has arrived), their outputs sent
/// back on the flight's lane.
pub fn moe_experts(
    gpu: &Gpu,
    ws: &mut Workspace,
    ep: &EpGroup,
    cfg: &ModelConfig,
    f: &mut Flight,
) -> Result<(), CudaError> {
    let s = gpu.stream();
    let (world, k, kpad, cap) = (ep.shard.world, cfg.num_experts_per_tok, f.kpad, f.d.rec.cap);
    if let Some(ev) = &f.sent {
        ep.wait(Lane::Main, ev)?;
    }
    let (d, routed) = (&f.d, &f.routed);
    // Under load balancing this rank's pairs are those of its slots.
    let (lo, per_rank) = match routed.slots.as_ref() {
        Some(t) => (ep.shard.rank * t.per_rank, t.per_rank),
        None => (ep.shard.experts(cfg.n_routed_experts).start, cfg.n_routed_experts / world),
    };
    let pairs = world * cap * k;
    let lids = ws.take::<i32>(s, pairs)?;
    launch(
        gpu,
        "tandem_ep_local_ids",
        elementwise_grid(pairs),
        256,
        0,
        &[
            Arg::P(d.recv),
            Arg::L(d.rec.bytes as i64),
            Arg::L(d.rec.ids_off as i64),
            Arg::I(world as i32),
            Arg::I((cap * k) as i32),
            Arg::I(lo as i32),
            Arg::I(per_rank as i32),
            Arg::P(routed.expert_map.as_ref().map_or(0, DBuf::ptr)),
            Arg::P(lids),
        ],
    )?;
    // `pairs` counts every rank's slots; this rank's experts expect about cap x k of them (tiles sized for the
    // local pairs, and the launch still for every slot: the tile height never changes the bits).
    let experts = routed.experts.down.groups();
    let g = moe::group(gpu, ws, lids, pairs, k, experts, Some(moe::tile_rows(cap * k, experts)))?;
    let ld = gemm::scale_ld(pairs);
    let qa = ws.take::<u8>(s, pairs * kpad)?;
    let sa = ws.take::<f32>(s, (kpad / gemm::BK) * ld)?;
    launch(
        gpu,
        "tandem_ep_gather",
        (pairs as u32, 1, 1),
        128,
        0,
        &[
            Arg::P(d.recv),
            Arg::L(d.rec.bytes as i64),
            Arg::L(d.rec.scales_off as i64),
            Arg::I(cap as i32),
            Arg::I(kpad as i32),
            Arg::P(g.src_row),
            Arg::P(g.used),
            Arg::P(qa),
            Arg::P(sa),
            Arg::I(ld as i32),
        ],
    )?;
    let back = combine_buffer(gpu, ws, cfg, d, world)?;
    moe::forward_quantized(gpu, ws, &routed.experts, qa, sa, ld, &g, back, g.pair_of_row)?;
    let home = combine_send(gpu, ws, ep, cfg, d, back, f.lane, f.micro)?;
    let ev = if f.lane == Lane::Comm { Some(ep.mark(Lane::Comm)?) } else { None };
    f.returned = Some((home, ev));
    Ok(())
}

/// Stage 3: once the pairs are home, this rank's rows combined into `y [rows, hidden]` f32 in slot order
/// with their weights and the shared expert's output.
pub fn moe_finish(gpu: &Gpu, ep: &EpGroup, cfg: &ModelConfig, f: Flight, y: u64) -> Result<(), CudaError> {
    let Some((home, ev)) = &f.returned else {
        return Err(CudaError::Shape("ep: a MoE layer finished before its experts ran".into()));
    };
    if let Some(ev) = ev {
        ep.wait(Lane::Main, ev)?;
    }
    let (k, hidden) = (cfg.num_experts_per_tok, cfg.hidden_size);
    let pairs = moe::PairRows::Bf16 { rows: *home, slot: f.d.at };
    moe::combine(gpu, pairs, f.weights, f.shared, y, f.rows, k, hidden)
}

/// Seconds per call of the exchange alone at capacity `cap` (every rank full: `cap` rows each), next to
/// plain NCCL all-to-alls of the same bytes, measured on this rank (every rank calls it together).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ExchangeTimes {
    pub cap: usize,
    /// Bytes each rank receives in a dispatch (every rank's record) and in a combine.
    pub dispatch_bytes: usize,
    pub combine_bytes: usize,
    /// The rows quantized into the record (the shared expert's input too: [`Quantized::input`]).
    pub quantize_s: f64,
    /// Pack the ids + gather (point-to-point) of the quantized record.
    pub dispatch_s: f64,
    /// All-to-all + the slot-order combine (the down projection writes the pairs into the buffer).
    pub combine_s: f64,
    /// `ncclSend`/`ncclRecv` all-to-alls of the same bytes per peer.
    pub a2a_dispatch_s: f64,
    pub a2a_combine_s: f64,
    /// The dispatch's collective alone: `ncclAllGather`, and the same as point-to-point calls.
    pub gather_s: f64,
    pub gather_p2p_s: f64,
}

/// Times [`dispatch`] and [`combine`] over random rows and routings (`iters` of each after a warm-up).
pub fn time_exchange(
    gpu: &Gpu,
    ep: &EpGroup,
    cfg: &ModelConfig,
    cap: usize,
    iters: usize,
) -> Result<ExchangeTimes, CudaError> {
    let s = gpu.stream();
    let (world, k, hidden, e) = (ep.shard.world, cfg.num_experts_per_tok, cfg.hidden_size, cfg.n_routed_experts);
    let kpad = hidden.next_multiple_of(gemm::BK);
    let mut rng = 0x2545_f491_4f6c_dd1du64 ^ ep.shard.rank as u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let x: Vec<f32> = (0..cap * hidden).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut ids = Vec::with_capacity(cap * k);
    for _ in 0..cap {
        let mut row: Vec<i32> = Vec::with_capacity(k);
        while row.len() < k {
            let c = (next() % e as u64) as i32;
            if !row.contains(&c) {
                row.push(c);
            }
        }
        row.sort_unstable();
        ids.extend(row);
    }
    let w: Vec<f32> = (0..cap * k).map(|_| 1.0 / k as f32).collect();
    let (dx, dids, dw) = (DBuf::upload(s, &x)?, DBuf::upload(s, &ids)?, DBuf::upload(s, &w)?);
    let pairs = world * cap * k;
    // The combine buffer as the down projection leaves it (every row written: the worst case).
    let back = DBuf::<u16>::upload(s, &(0..pairs * hidden).map(|i| 0x3f80 + (i % 64) as u16).collect::<Vec<_>>())?;
    let y = DBuf::<f32>::zeros(s, cap * hidden)?;
    let mut ws = Workspace::new();
    let ctx = s.context();
    let event = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
    let mut timed = |f: &mut dyn FnMut(&mut Workspace) -> Result<(), CudaError>| -> Result<f64, CudaError> {
        ws.reset();
        f(&mut ws)?;
        s.synchronize()?;
        let (a, b) = (event()?, event()?);
        a.record(s)?;
        for _ in 0..iters {
            ws.reset();
            f(&mut ws)?;
        }
        b.record(s)?;
        b.synchronize()?;
        Ok(a.elapsed_ms(&b)? as f64 / 1e3 / iters as f64)
    };
    let format = QuantFormat { inp: hidden, kpad, ue8m0: true };
    let quantize_s = timed(&mut |ws| quantize(gpu, ws, cfg, format, dx.ptr(), cap, cap).map(drop))?;
    // One record quantized outside the timed calls' workspace; the dispatch sends it.
    let mut qws = Workspace::new();
    let q = quantize(gpu, &mut qws, cfg, format, dx.ptr(), cap, cap)?;
    let mut last = None;
    let dispatch_s = timed(&mut |ws| {
        last = Some(dispatch(gpu, ws, ep, cfg, &q, cap, dids.ptr(), None, Lane::Main, 0)?);
        Ok(())
    })?;
    let d = last.expect("dispatched");
    // The combine rows of the dispatch's pairs, kept outside the workspace the combine reuses.
    let per_rank = (e / world) as i32;
    let at: Vec<i32> = ids.iter().enumerate().map(|(p, &id)| (id / per_rank) * (cap * k) as i32 + p as i32).collect();
    let at = DBuf::upload(s, &at)?;
    let d = Dispatched { at: at.ptr(), ..d };
    let combine_s = timed(&mut |ws| combine(gpu, ws, ep, cfg, &d, back.ptr(), cap, dw.ptr(), 0, y.ptr()))?;
    let (db, cb) = (d.rec.bytes, cap * k * hidden * 2);
    let a2a = |bytes: usize, ws: &mut Workspace| -> Result<(), CudaError> {
        let send = ws.take::<u8>(s, world * bytes)?;
        let recv = ws.take::<u8>(s, world * bytes)?;
        ep.all_to_all(send, recv, bytes, Lane::Main)
    };
    let a2a_dispatch_s = timed(&mut |ws| a2a(db, ws))?;
    let gather = |p2p: bool, ws: &mut Workspace| -> Result<(), CudaError> {
        let send = ws.take::<u8>(s, db)?;
        let recv = ws.take::<u8>(s, world * db)?;
        if p2p { ep.gather_p2p(send, recv, db, Lane::Main) } else { ep.all_gather(send, recv, db) }
    };
    let gather_s = timed(&mut |ws| gather(false, ws))?;
    let gather_p2p_s = timed(&mut |ws| gather(true, ws))?;
    let a2a_combine_s = timed(&mut |ws| a2a(cb, ws))?;
    Ok(ExchangeTimes {
        cap,
        dispatch_bytes: world * db,
        combine_bytes: world * cb,
        quantize_s,
        dispatch_s,
        combine_s,
        a2a_dispatch_s,
        a2a_combine_s,
        gather_s,
        gather_p2p_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_the_experts_into_equal_ranges() {
        let s = Shard { rank: 1, world: 4 };
        assert_eq!(s.experts(256), 64..128);
        assert_eq!(Shard::SINGLE.experts(16), 0..16);
        let cfg = ModelConfig::from_json(&crate::tiny::config_json(64)).unwrap();
        assert!(Shard { rank: 0, world: 2 }.check(&cfg).is_ok());
        assert!(Shard { rank: 0, world: 3 }.check(&cfg).unwrap_err().contains("equal shares"));
        assert!(Shard { rank: 2, world: 2 }.check(&cfg).is_err());
    }

    #[test]
    fn ep_specs_parse_or_say_what_is_wrong() {
        let c = EpConfig::parse("1/2@127.0.0.1:29500").unwrap();
        assert_eq!((c.rank, c.world, c.leader.as_str()), (1, 2, "127.0.0.1:29500"));
        for bad in ["1/2", "2/2@h:1", "a/2@h:1", "1/0@h:1", "0/2@host"] {
            assert!(EpConfig::parse(bad).is_err(), "{bad}");
        }
    }

    fn cfg(rank: usize, leader: &str, timeout_ms: u64) -> EpConfig {
        EpConfig {
            timeout: Duration::from_millis(timeout_ms),
            ..EpConfig::parse(&format!("{rank}/2@{leader}")).unwrap()
        }
    }

    #[test]
    fn a_rank_waits_for_a_leader_that_comes_late_and_gets_its_id() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let leader = format!("127.0.0.1:{port}");
        let rank1 = std::thread::spawn({
            let c = cfg(1, &leader, 10_000);
            move || fetch_id(&c)
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut id = nccl::ncclUniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = i as std::ffi::c_char;
        }
        serve_id(&cfg(0, &leader, 10_000), &id).unwrap();
        assert_eq!(rank1.join().unwrap().unwrap().internal, id.internal);
    }

    #[test]
    fn a_rank_with_other_balancing_or_overlap_settings_is_refused_with_the_reason() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let leader = format!("127.0.0.1:{port}");
        let rank1 = std::thread::spawn({
            let mut c = cfg(1, &leader, 10_000);
            c.dbo = Dbo::Off;
            move || fetch_id(&c)
        });
        let id = nccl::ncclUniqueId { internal: [0; 128] };
        let e = serve_id(&cfg(0, &leader, 10_000), &id).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("--dbo"), "{e}");
        let e = rank1.join().unwrap().unwrap_err();
        assert!(e.contains("refused this rank") && e.contains("overlap settings"), "{e}");
        let mut a = cfg(0, &leader, 1);
        a.eplb.interval = 7;
        assert_ne!(a.settings_digest(), cfg(0, &leader, 1).settings_digest());
        assert_eq!(cfg(0, &leader, 1).settings_digest(), cfg(1, "other:1", 5).settings_digest());
    }

    #[test]
    fn a_leader_name_that_never_resolves_is_retried_until_the_deadline() {
        // `.invalid` never resolves (RFC 6761): as a leader pod whose DNS record is not published yet.
        let t0 = Instant::now();
        let e = fetch_id(&cfg(1, "tandem-leader.invalid:29500", 400)).unwrap_err();
        assert!(t0.elapsed() >= Duration::from_millis(400), "gave up after {:?}: {e}", t0.elapsed());
        assert!(e.contains("did not answer within") && e.contains("tandem-leader.invalid"), "{e}");
    }

    #[test]
    fn dual_batch_overlap_applies_by_the_largest_ranks_rows() {
        let auto = Dbo::parse("auto:32,512").unwrap();
        assert!(auto.applies(Pass::Main, 32, 8) && !auto.applies(Pass::Main, 31, 8));
        assert!(auto.applies(Pass::MainPrefill, 512, 16) && !auto.applies(Pass::MainPrefill, 511, 16));
        assert!(!auto.applies(Pass::MainPrefill, 4096, 17), "a rank of many experts reads them twice");
        assert!(!auto.applies(Pass::Mtp, 4096, 8), "the MTP pass is one layer: never split");
        assert!(Dbo::On.applies(Pass::Main, 2, 128) && !Dbo::On.applies(Pass::Main, 1, 128));
        assert!(!Dbo::Off.applies(Pass::MainPrefill, 1 << 20, 8));
        let d = Dbo::default();
        assert!(d.applies(Pass::MainPrefill, 1024, 8) && !d.applies(Pass::Main, 1 << 20, 8));
        assert_eq!(Dbo::parse("auto").unwrap(), Dbo::default());
        for bad in ["yes", "auto:1", "auto:a,b"] {
            assert!(Dbo::parse(bad).is_err(), "{bad}");
        }
    }

    /// A graphed decode pass pads every rank's rows to the agreed most rows' bucket, and an overlapped one
    /// each half of those: the records' capacity holds both, every rank computing it alike.
    #[test]
    fn the_capacity_holds_a_graphed_pass_and_its_overlapped_halves() {
        for most in 1..=2 * super::super::graphs::MAX_ROWS {
            let cap = capacity(most);
            assert!(cap >= most && cap.is_multiple_of(4), "{most} -> {cap}");
            if let Some(rows) = super::super::graphs::row_bucket(most) {
                assert!(rows <= cap, "{most}: {rows} padded rows at capacity {cap}");
                let (half, micro) = (rows.div_ceil(2), capacity(cap.div_ceil(2)));
                assert!(half <= micro && rows - half <= micro, "{most}: halves of {rows} at capacity {micro}");
            } else {
                assert!(cap < most + 4, "{most}: past the buckets only the 4-row alignment ({cap})");
            }
        }
    }

    #[test]
    fn records_keep_their_parts_aligned() {
        let r = Record::new(64, 7168, 8);
        assert_eq!(r.scales_off, 64 * 7168);
        assert_eq!(r.ids_off, r.scales_off + 4 * 56 * 64);
        assert!(r.bytes >= r.ids_off + 4 * 64 * 8 && r.bytes.is_multiple_of(256));
    }
}
