//! CUDA graphs of the decode passes (docs/model.md §5.4).
//!
//! A decode step's main pass issues about 40 kernels per layer (2,500 at 61 layers) and its MTP pass about
//! 40 more; issued one by one, the host spends milliseconds launching them, and the GPU waits wherever the
//! host falls behind. Here the layers of a decode pass are captured once per shape into a CUDA graph and
//! replayed with one launch:
//!
//! - **Shapes.** A pass is captured per padded row count ([`row_bucket`]: 1, 2, 4, 8, 16, 24, 32, 48, 64, then
//!   steps of 32 to 256 and of 64 to 512) and per block-table width (the next power of two of the longest
//!   row's blocks): together they fix every launch's grid, every workspace address and the indexer's score
//!   stride and chunking. Each decode row belongs to one request and takes 1 or 2 rows (the token and the MTP
//!   draft), so the indexer's scorer groups are data (uploaded each step), never part of the graph.
//! - **Padding rows** past the real ones attend to position 0 of the first request (length 1), write no
//!   cache entry (slot -1) and are never read back: every kernel computes a row alone, so the real rows get
//!   the bits the eager pass gives them (tested: `engine/tests/gpu.rs`).
//! - **What stays eager.** The inputs' upload (positions, slots, block tables, tokens), the embedding and,
//!   for the MTP pass, the concatenated norms: they write the workspace addresses the graph reads. After the
//!   layers, the final norm and the logits rows go into fresh buffers, so outputs a caller still holds are
//!   never overwritten by a later replay.
//! - **Capture.** The first call of a shape runs eagerly (that is the call's result, and it grows the
//!   workspace to what the shape needs), then the same issue sequence is captured without running it; the
//!   workspace may not grow while capturing. A shape whose capture fails stays eager (logged once).
//! - **Memory.** Each graph's device memory is measured at instantiation; graphs past [`GRAPH_BYTES`] are
//!   evicted least recently used first, and `GRAPH_BYTES` is the graphs' share of the memory budget.
//!
//! Off with `TANDEM_CUDA_GRAPHS=0` (A/B measurements, debugging).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaGraph, CudaStream, sys};

use crate::backend::{DecodeGraphs, EngineError};

/// Device memory the captured graphs may hold (counted in the memory budget as `graphs`): [`MAX_HELD`]
/// graphs of the 61-layer model at about 3 MiB each (measured on an H200: 6 MiB for its first two), with room.
pub const GRAPH_BYTES: u64 = 256 << 20;

/// The most graphs held at once (least recently used evicted first). The driver's free-memory reading moves in
/// 2 MiB steps and often not at all for a graph (its memory comes from what earlier graphs freed), so the count
/// bounds the graphs' memory where the measurement cannot.
pub const MAX_HELD: usize = 64;

/// The most device memory one graph is charged (a larger free-memory drop at its instantiation was someone
/// else's allocation).
pub const MAX_GRAPH_BYTES: u64 = 32 << 20;

/// The most rows a decode row of one request has in a captured pass (the token and the MTP draft).
pub const MAX_ROWS_PER_REQUEST: usize = 2;

/// The most rows a captured pass has; larger decode batches run eagerly.
pub const MAX_ROWS: usize = 512;

/// Whether the decode passes are captured (`TANDEM_CUDA_GRAPHS=0` turns them off).
pub fn enabled_by_env() -> bool {
    std::env::var("TANDEM_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

/// Whether the decode worker captures its whole-step graphs before serving (`TANDEM_GRAPH_CAPTURE=lazy`: on
/// each shape's first step instead).
pub fn capture_at_startup() -> bool {
    std::env::var("TANDEM_GRAPH_CAPTURE").map_or(true, |v| v != "lazy")
}

/// The padded row count a decode pass of `rows` rows is captured at, `None` past [`MAX_ROWS`].
pub fn row_bucket(rows: usize) -> Option<usize> {
    let r = rows.max(1);
    let b = match r {
        0..=2 => r,
        3..=4 => 4,
        5..=8 => 8,
        9..=16 => 16,
        17..=24 => 24,
        25..=32 => 32,
        33..=48 => 48,
        49..=64 => 64,
        65..=256 => r.next_multiple_of(32),
        _ => r.next_multiple_of(64),
    };
    (b <= MAX_ROWS).then_some(b)
}

/// The block-table width (blocks) a pass whose longest row needs `blocks` is captured at.
pub fn width_bucket(blocks: usize) -> usize {
    blocks.max(1).next_power_of_two()
}

/// Which pass a graph is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GraphPass {
    Main,
    Mtp,
    /// A whole decode step ([`crate::Backend::decode_whole_step`]).
    Step,
}

/// Everything a captured pass's launches depend on besides the inputs it reads from device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub pass: GraphPass,
    /// Padded rows.
    pub rows: usize,
    /// Padded block-table width (blocks); the score stride is this many blocks of positions.
    pub width: usize,
    /// The cache pool's address, blocks and layers.
    pub pool: u64,
    pub num_blocks: usize,
    pub num_layers: usize,
    /// The workspace address where the layers began (the inputs and the residual stream were taken before
    /// it, at addresses that follow from the shape).
    pub mark: u64,
    /// Under expert parallelism (0 and `false` without): the agreed capacity of the exchange's records,
    /// whether the pass runs as two overlapped micro-batches, and where the second one's workspace began.
    pub cap: usize,
    pub dbo: bool,
    pub mark_b: u64,
}

/// A captured pass. The driver's graph objects are not internally synchronized: every use is under the
/// [`Graphs`] owner's mutex.
struct Held {
    graph: Option<CudaGraph>,
    nodes: usize,
    bytes: u64,
    last_used: u64,
    /// Which capture made it ([`Graphs::serial`] then): expert-parallel ranks replay only graphs of the
    /// same capture.
    serial: u64,
}

// SAFETY: a CUgraphExec may be launched from any thread; access is serialized by the `Graphs` owner's mutex.
unsafe impl Send for Held {}

/// The captured passes of one backend, by shape.
pub struct Graphs {
    enabled: bool,
    held: HashMap<GraphKey, Held>,
    clock: u64,
    stats: DecodeGraphs,
    /// The most graphs and bytes held ([`MAX_HELD`] and [`GRAPH_BYTES`], or what [`Graphs::reserve`] raised
    /// them to).
    max_held: usize,
    max_bytes: u64,
    /// Where set, each graph is charged this many bytes a node instead of the free-memory drop measured at
    /// its capture: expert-parallel ranks then evict the same graphs at the same calls.
    charge: Option<u64>,
    /// The routed experts' placement the held graphs read (load balancing's moves, [`Graphs::retire`]).
    experts: u64,
    /// Captures begun so far: expert-parallel ranks capture together, so the count names the same capture
    /// on every rank.
    serial: u64,
}

/// What to do with a pass of a given shape.
pub enum Plan {
    /// Replayed (done).
    Replayed,
    /// Run the layers eagerly, then capture them.
    RunAndCapture,
    /// Run the layers eagerly (the shape's capture failed before).
    Eager,
}

impl Plan {
    /// The plan as the expert-parallel ranks agree on it (engine::cuda::ep::EpGroup::agree_graph_plan: the
    /// most of the ranks' codes): 0 replay, 1 run and capture, 2 run eagerly.
    pub fn code(&self) -> i32 {
        match self {
            Plan::Replayed => 0,
            Plan::RunAndCapture => 1,
            Plan::Eager => 2,
        }
    }

    /// The plan of an agreed code ([`code`](Self::code)).
    pub fn from_code(code: i32) -> Plan {
        match code {
            0 => Plan::Replayed,
            1 => Plan::RunAndCapture,
            _ => Plan::Eager,
        }
    }
}

impl Graphs {
    pub fn new(enabled: bool) -> Self {
        Graphs {
            enabled,
            held: HashMap::new(),
            clock: 0,
            stats: DecodeGraphs::default(),
            max_held: MAX_HELD,
            max_bytes: GRAPH_BYTES,
            charge: None,
            experts: 0,
            serial: 0,
        }
    }

    /// Charges every graph `bytes` a node (expert parallelism: eviction follows the shapes alone, the same
    /// on every rank) instead of the free memory it took.
    pub fn charge_nodes(&mut self, bytes: u64) {
        self.charge = Some(bytes);
    }

    /// The capture that made the graph of `key` (0: none held).
    pub fn serial_of(&self, key: &GraphKey) -> u64 {
        self.held.get(key).map_or(0, |h| h.serial)
    }

    /// Drops every held graph when the routed experts moved since they were captured (`placement` counts
    /// load balancing's moves): their launches name the old experts' buffers, which are freed.
    pub fn retire(&mut self, placement: u64) {
        if placement != self.experts {
            self.experts = placement;
            self.clear();
        }
    }

    /// Drops every held graph (the graphs' device memory goes back).
    pub fn clear(&mut self) {
        self.held.clear();
        self.stats.held = 0;
        self.stats.nodes = 0;
        self.stats.bytes = 0;
    }

    /// Makes room for `count` graphs of about `bytes_each` (the shapes captured at start-up, all held while
    /// serving): the limits become at least that.
    pub fn reserve(&mut self, count: usize, bytes_each: u64) {
        self.max_held = self.max_held.max(count);
        self.max_bytes = self.max_bytes.max(count as u64 * bytes_each.min(MAX_GRAPH_BYTES));
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.clear();
        }
    }

    /// What the graphs have done (for tests, benchmarks and logs).
    pub fn stats(&self) -> DecodeGraphs {
        DecodeGraphs { on: self.enabled, ..self.stats }
    }

    /// Whether the graph of `key` is captured (not missing, not a failed shape's entry).
    pub fn is_captured(&self, key: &GraphKey) -> bool {
        self.held.get(key).is_some_and(|h| h.graph.is_some())
    }

    /// Drops a failed capture's entry for `key` (the shape is tried again on its next step); a captured graph
    /// stays.
    pub fn forget(&mut self, key: &GraphKey) {
        if self.held.get(key).is_some_and(|h| h.graph.is_none()) {
            self.held.remove(key);
        }
    }

    /// Counts a pass that runs eagerly because it is not eligible.
    pub fn count_eager(&mut self) {
        self.stats.eager += 1;
    }

    /// What this backend holds for `key`, without running anything: [`Plan::Replayed`] where it is
    /// captured (then [`launch`](Self::launch) it), otherwise how to run the pass.
    pub fn plan(&mut self, key: &GraphKey) -> Plan {
        self.clock += 1;
        let Some(h) = self.held.get_mut(key) else { return Plan::RunAndCapture };
        h.last_used = self.clock;
        if h.graph.is_some() { Plan::Replayed } else { Plan::Eager }
    }

    /// Launches the captured graph of `key` on its stream.
    pub fn launch(&mut self, key: &GraphKey) -> Result<(), EngineError> {
        let g = self.held.get(key).and_then(|h| h.graph.as_ref());
        let g = g.ok_or_else(|| EngineError::Device(format!("no captured decode graph for {key:?}")))?;
        g.launch().map_err(|e| EngineError::Device(format!("replaying a decode graph: {e}")))?;
        self.stats.replays += 1;
        Ok(())
    }

    /// Counts a pass of an eligible shape that ran eagerly (before its capture, or where capturing failed).
    pub fn count_eager_shape(&mut self) {
        self.stats.eager += 1;
    }

    /// Makes `key` a failed shape's entry (its capture failed here or on another rank): it runs eagerly from
    /// now.
    pub fn mark_failed(&mut self, key: GraphKey) {
        self.clock += 1;
        self.held.insert(key, Held { graph: None, nodes: 0, bytes: 0, last_used: self.clock, serial: self.serial });
        self.evict();
    }

    /// Captures what `issue` puts on `stream` (nothing runs) as the graph of `key`. The same issue sequence
    /// has just run eagerly, so any failure here is the capture's: the shape then stays eager (warned once).
    pub fn capture<F>(&mut self, stream: &Arc<CudaStream>, key: GraphKey, issue: F) -> Result<(), EngineError>
    where
        F: FnOnce() -> Result<(), EngineError>,
    {
        let t0 = Instant::now();
        self.serial += 1;
        let free_before = free_memory();
        if let Err(e) = stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
            tracing::warn!(?key, error = %e, "a decode graph capture did not start; this shape runs eagerly");
            self.mark_failed(key);
            return Ok(());
        }
        let issued = issue();
        // The capture ends whatever happened, so the stream is usable again.
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let graph = match (issued, ended) {
            (Err(e), _) => {
                tracing::warn!(?key, error = %e, "a decode pass failed while captured; this shape runs eagerly");
                None
            }
            (Ok(()), Ok(Some(g))) => match g.upload() {
                Ok(()) => Some(g),
                Err(e) => {
                    tracing::warn!(?key, error = %e, "a decode graph did not upload; this shape runs eagerly");
                    None
                }
            },
            (Ok(()), Ok(None)) => None,
            (Ok(()), Err(e)) => {
                tracing::warn!(?key, error = %e, "a decode pass could not be captured; this shape runs eagerly");
                None
            }
        };
        // The device's free memory also moves with other processes' allocations (workers sharing a GPU): a
        // reading past MAX_GRAPH_BYTES is not this graph's.
        let nodes = graph.as_ref().map_or(0, node_count);
        let bytes = match (free_before, free_memory(), self.charge) {
            _ if graph.is_none() => 0,
            (_, _, Some(c)) => (nodes as u64 * c).min(MAX_GRAPH_BYTES),
            (Some(a), Some(b), None) => a.saturating_sub(b).min(MAX_GRAPH_BYTES),
            _ => 0,
        };
        let secs = t0.elapsed().as_secs_f64();
        self.stats.capture_s += secs;
        if graph.is_some() {
            self.stats.captures += 1;
            tracing::debug!(?key, nodes, bytes, ms = secs * 1e3, "decode pass captured");
        }
        self.clock += 1;
        self.held.insert(key, Held { graph, nodes, bytes, last_used: self.clock, serial: self.serial });
        self.evict();
        Ok(())
    }

    /// Drops the least recently used graphs while they hold more than [`GRAPH_BYTES`] or number more than
    /// [`MAX_HELD`] ([`victims`]); shapes whose capture failed stay (eager, warned once).
    fn evict(&mut self) {
        let entries: Vec<(GraphKey, u64, u64, bool)> =
            self.held.iter().map(|(k, h)| (*k, h.bytes, h.last_used, h.graph.is_some())).collect();
        let rows: Vec<(u64, u64, bool)> = entries.iter().map(|e| (e.1, e.2, e.3)).collect();
        for i in victims(&rows, self.max_bytes, self.max_held) {
            self.held.remove(&entries[i].0);
            self.stats.evicted += 1;
        }
        self.stats.held = self.held.values().filter(|h| h.graph.is_some()).count();
        self.stats.nodes = self.held.values().map(|h| h.nodes).sum();
        self.stats.bytes = self.held.values().map(|h| h.bytes).sum();
    }
}

/// Which of the held graphs `(bytes, last used, captured)` to drop: the least recently used captured ones
/// while the captured ones hold more than `max_bytes` or number more than `max_held`, never the most recent
/// one (the graph just captured), never a failed shape's entry.
fn victims(held: &[(u64, u64, bool)], max_bytes: u64, max_held: usize) -> Vec<usize> {
    let mut live: Vec<usize> = (0..held.len()).filter(|&i| held[i].2).collect();
    live.sort_by_key(|&i| held[i].1);
    let mut bytes: u64 = live.iter().map(|&i| held[i].0).sum();
    let mut out = Vec::new();
    let mut n = live.len();
    for &i in &live {
        if n <= 1 || (bytes <= max_bytes && n <= max_held) {
            break;
        }
        bytes -= held[i].0;
        n -= 1;
        out.push(i);
    }
    out
}

/// Nodes of a captured graph (0 where the driver does not say).
fn node_count(g: &CudaGraph) -> usize {
    let mut n = 0usize;
    // SAFETY: a live graph; a null node array asks for the count only.
    let r = unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) };
    if r == sys::CUresult::CUDA_SUCCESS { n } else { 0 }
}

/// Free device memory of the current context, where the driver says.
fn free_memory() -> Option<u64> {
    cudarc::driver::result::mem_get_info().ok().map(|(free, _)| free as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_pad_rows_and_widths_a_bounded_amount() {
        let got: Vec<_> = [1, 2, 3, 5, 9, 17, 25, 33, 49, 64, 65, 100, 256, 257, 512].map(row_bucket).to_vec();
        let want = [1, 2, 4, 8, 16, 24, 32, 48, 64, 64, 96, 128, 256, 320, 512];
        assert_eq!(got, want.map(Some).to_vec());
        assert_eq!(row_bucket(513), None, "past MAX_ROWS the pass runs eagerly");
        for r in 1..=MAX_ROWS {
            let b = row_bucket(r).unwrap();
            assert!(b >= r && (b <= 2 * r || r <= 2), "{r} -> {b}");
            assert!(b <= r + 64, "{r} -> {b}: at most 64 padding rows");
        }
        assert_eq!([1, 2, 3, 33, 64, 65].map(width_bucket), [1, 2, 4, 64, 64, 128]);
    }

    fn key(rows: usize) -> GraphKey {
        GraphKey {
            pass: GraphPass::Main,
            rows,
            width: 4,
            pool: 1 << 20,
            num_blocks: 64,
            num_layers: 2,
            mark: 1 << 30,
            cap: 8,
            dbo: false,
            mark_b: 0,
        }
    }

    /// The plan of a shape (what the expert-parallel ranks agree on): captured next where nothing is held, run
    /// eagerly once some rank's capture failed, captured again after the experts moved (the held graphs
    /// name the old placement's buffers).
    #[test]
    fn a_shape_is_captured_then_kept_eager_after_a_failure_and_dropped_when_the_experts_move() {
        let mut g = Graphs::new(true);
        assert!(matches!(g.plan(&key(4)), Plan::RunAndCapture));
        assert_eq!(g.serial_of(&key(4)), 0, "nothing held");
        g.mark_failed(key(4));
        assert!(matches!(g.plan(&key(4)), Plan::Eager));
        assert!(!g.is_captured(&key(4)));
        assert!(g.launch(&key(4)).is_err(), "nothing to launch for a failed shape");
        assert!(matches!(g.plan(&key(8)), Plan::RunAndCapture), "another shape is its own entry");
        g.retire(0);
        assert!(matches!(g.plan(&key(4)), Plan::Eager), "the same placement keeps the entries");
        g.retire(1);
        assert!(matches!(g.plan(&key(4)), Plan::RunAndCapture), "a move drops every entry");
        assert_eq!(g.stats().held, 0);
    }

    #[test]
    fn eviction_drops_the_least_recently_used_graphs_past_either_limit() {
        let mib = 1u64 << 20;
        // Within both limits: nothing.
        assert!(victims(&[(4 * mib, 1, true), (4 * mib, 2, true)], GRAPH_BYTES, MAX_HELD).is_empty());
        // Past the count: the oldest captured graphs, not a failed shape's entry.
        let mut held: Vec<(u64, u64, bool)> = (0..MAX_HELD as u64 + 2).map(|t| (mib, 10 + t, true)).collect();
        held.push((0, 0, false));
        assert_eq!(victims(&held, GRAPH_BYTES, MAX_HELD), vec![0, 1]);
        // Raised limits (the start-up shapes) keep them all.
        assert!(victims(&held, GRAPH_BYTES, MAX_HELD + 2).is_empty());
        // Past the bytes: oldest first until the rest fit.
        let big = GRAPH_BYTES / 2;
        assert_eq!(victims(&[(big, 3, true), (big, 1, true), (big, 2, true)], GRAPH_BYTES, MAX_HELD), vec![1]);
        // The newest graph stays whatever it holds.
        assert!(victims(&[(2 * GRAPH_BYTES, 1, true)], GRAPH_BYTES, MAX_HELD).is_empty());
    }
}
