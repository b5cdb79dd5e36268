//! Expert-parallel load balancing at run time (docs/model.md §5.2; the placement policies are
//! [`crate::eplb`]).
//!
//! Every MoE layer counts, on the device, the pairs its rows route to each logical expert
//! ([`count`]). Every rank of the group runs [`Balancer::after_agreement`] right after each step agreement,
//! at the same point of the same step, so everything below is collective and needs no further agreement:
//!
//! 1. **Look** (every `interval` busy steps): the counts are summed over the ranks (one grouped all-reduce)
//!    and read back, and each MoE layer's window ([`LoadWindow`]) takes them. The loads are logged as the
//!    max/mean GPU load under the shard placement and under the current one. With rebalancing on, each layer
//!    whose new placement ([`crate::eplb::rebalance`], a pure function of the summed loads, so every rank
//!    computes the same one) lowers its max/mean by at least `min_gain` is queued.
//! 2. **Move** (one queued layer per busy step): the layer's new slots are filled in a second set of
//!    buffers, the copies this rank already holds copied on the device and the others received from the
//!    lowest rank holding them (grouped NCCL sends and receives, [`crate::eplb::transfer_plan`]). The new
//!    experts and their slot table then replace the old ones ([`DMoe::replace_routed`]); the old buffers are
//!    freed in stream order. The step's passes that follow route with the new table on every rank.
//!
//! A pair's output does not depend on which copy computes it: the grouped GEMM's rows are independent of
//! the other rows of their group (the exactness rule), so output is the same before and after a move.
//! While a layer moves, its routed experts are held twice: the memory budget counts the largest layer's
//! routed experts once more ([`super::weights::DWeights::largest_routed_bytes`]).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use super::ep::EpGroup;
use super::ops::{Arg, elementwise_grid, launch};
use super::weights::{DMlp, DMoe, DWeights, Routed, SlotTable};
use super::{CudaError, Gpu};
use crate::ModelConfig;
use crate::eplb::{EplbConfig, LoadWindow, Placement, Source, imbalance, rebalance, transfer_plan};

/// What load balancing has seen and done on this rank.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EplbStats {
    /// Looks at the loads, and those that queued a move.
    pub looks: u64,
    pub rebalances: u64,
    /// MoE layers moved, and expert copies this rank filled from its own memory and from other ranks.
    pub layers_moved: u64,
    pub copies_local: u64,
    pub copies_received: u64,
    /// Host seconds spent issuing moves (the copies run on the stream with the steps).
    pub move_issue_s: f64,
    /// Over the last window, summed over the MoE layers: the busiest GPU's load over the mean (a step waits
    /// for the busiest), under the shard placement and under the current one.
    pub imbalance_shard: f64,
    pub imbalance_now: f64,
    /// The window's pairs per GPU under the current placement, summed over the layers.
    pub gpu_load: Vec<f64>,
}

struct State {
    busy_steps: u64,
    /// Per MoE layer ([`DWeights::moe_sets`] order).
    windows: Vec<LoadWindow>,
    queued: VecDeque<(usize, Placement)>,
    stats: EplbStats,
}

pub struct Balancer {
    cfg: EplbConfig,
    state: Mutex<State>,
    /// The stats as of the last step that changed them: readers (metrics) never wait for a look or a move.
    snapshot: Mutex<EplbStats>,
}

/// `counts[e] += ` the pairs of `ids [n]` routed to expert e (the layer's [`DMoe::counts`]).
pub fn count(gpu: &Gpu, m: &DMoe, ids: u64, n: usize, experts: usize) -> Result<(), CudaError> {
    let Some(c) = &m.counts else { return Ok(()) };
    if n == 0 {
        return Ok(());
    }
    launch(
        gpu,
        "tandem_eplb_count",
        elementwise_grid(n),
        256,
        0,
        &[Arg::P(ids), Arg::I(n as i32), Arg::I(experts as i32), Arg::P(c.ptr())],
    )
}

impl Balancer {
    pub fn new(cfg: EplbConfig, layers: usize, experts: usize) -> Self {
        let windows = (0..layers).map(|_| LoadWindow::new(experts, cfg.window)).collect();
        Balancer {
            cfg,
            state: Mutex::new(State { busy_steps: 0, windows, queued: VecDeque::new(), stats: EplbStats::default() }),
            snapshot: Mutex::new(EplbStats::default()),
        }
    }

    pub fn config(&self) -> &EplbConfig {
        &self.cfg
    }

    pub fn stats(&self) -> EplbStats {
        self.snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// MoE layers moved so far (the same on every rank at the same point of a step): captured decode graphs
    /// name the experts' buffers of the placement they were captured under.
    pub fn moves(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stats.layers_moved
    }

    /// Right after a step agreement, on every rank: a busy step counts towards the next look, and a queued
    /// layer moves (see the module's text). Nothing happens on a step every rank agreed to be empty.
    pub fn after_agreement(
        &self,
        gpu: &Gpu,
        ep: &EpGroup,
        cfg: &ModelConfig,
        w: &DWeights,
        busy: bool,
    ) -> Result<(), CudaError> {
        if !busy {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.busy_steps += 1;
        let mut changed = false;
        if st.busy_steps.is_multiple_of(self.cfg.interval as u64) {
            self.look(&mut st, gpu, ep, cfg, w)?;
            changed = true;
        }
        if let Some((layer, to)) = st.queued.pop_front() {
            let t0 = Instant::now();
            let (local, received) = move_layer(gpu, ep, w.moe_sets()[layer], to)?;
            st.stats.layers_moved += 1;
            st.stats.copies_local += local as u64;
            st.stats.copies_received += received as u64;
            st.stats.move_issue_s += t0.elapsed().as_secs_f64();
            changed = true;
        }
        if changed {
            *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = st.stats.clone();
        }
        Ok(())
    }

    fn look(&self, st: &mut State, gpu: &Gpu, ep: &EpGroup, cfg: &ModelConfig, w: &DWeights) -> Result<(), CudaError> {
        let sets = w.moe_sets();
        let experts = cfg.n_routed_experts;
        let bufs: Vec<(u64, usize)> =
            sets.iter().filter_map(|m| m.counts.as_ref().map(|c| (c.ptr(), experts))).collect();
        if bufs.len() != sets.len() || sets.len() != st.windows.len() {
            return Err(CudaError::Shape("eplb: a MoE layer without load counts".into()));
        }
        ep.all_reduce_sum_i32(&bufs)?;
        let s = gpu.stream();
        let mut host = vec![0i32; experts * sets.len()];
        for (i, &(p, n)) in bufs.iter().enumerate() {
            // SAFETY: `n` i32 from a live buffer; synchronized below before `host` is read.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[i * n..(i + 1) * n], p, s.cu_stream()) }?;
            // SAFETY: the same buffer, zeroed after the read in stream order.
            unsafe { cudarc::driver::result::memset_d8_async(p, 0, n * 4, s.cu_stream()) }?;
        }
        s.synchronize()?;
        let world = ep.shard().world;
        let layout = self.cfg.layout(experts, cfg.n_group, world);
        let shard = Placement::identity(experts);
        let (mut max_shard, mut max_now, mut sum) = (0.0, 0.0, 0.0);
        let mut gpu_load = vec![0.0; world];
        let mut queued = 0;
        for (i, m) in sets.iter().enumerate() {
            let counts: Vec<u64> = host[i * experts..(i + 1) * experts].iter().map(|&c| c.max(0) as u64).collect();
            st.windows[i].push(&counts).map_err(CudaError::Shape)?;
            let load = st.windows[i].load();
            let total: f64 = load.iter().sum();
            if total == 0.0 {
                continue;
            }
            let routed = m.routed();
            let now = routed.slots.as_ref().map_or(&shard, |t| &t.placement);
            let now_loads = now.gpu_loads(&load, world);
            max_shard += shard.gpu_loads(&load, world).iter().copied().fold(0.0, f64::max);
            max_now += now_loads.iter().copied().fold(0.0, f64::max);
            sum += total / world as f64;
            gpu_load.iter_mut().zip(&now_loads).for_each(|(g, l)| *g += l);
            if self.cfg.rebalance && routed.slots.is_some() {
                // A placement the policy cannot make leaves the layer where it is (every rank sees the same
                // loads, so every rank skips it); serving goes on.
                let new = match rebalance(&load, layout) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(layer = i, "expert placement not changed: {e}");
                        continue;
                    }
                };
                let (before, after) = (imbalance(&now_loads), imbalance(&new.gpu_loads(&load, world)));
                if new != *now && after <= before * (1.0 - self.cfg.min_gain) {
                    st.queued.retain(|(l, _)| *l != i);
                    st.queued.push_back((i, new));
                    queued += 1;
                }
            }
        }
        st.stats.looks += 1;
        if queued > 0 {
            st.stats.rebalances += 1;
        }
        if sum > 0.0 {
            st.stats.imbalance_shard = max_shard / sum;
            st.stats.imbalance_now = max_now / sum;
            st.stats.gpu_load = gpu_load;
            tracing::info!(
                rank = ep.shard().rank,
                "expert loads over the window: busiest GPU / mean {:.3} as sharded, {:.3} as placed now; {queued} \
                 MoE layers to move",
                st.stats.imbalance_shard,
                st.stats.imbalance_now,
            );
        }
        Ok(())
    }
}

/// Moves one MoE layer's experts to `to`: the new slots filled in new buffers (own copies on the device,
/// the rest received from the ranks the plan names, every rank sending what the others need), then put in
/// place. How many of this rank's slots were filled locally and from other ranks.
fn move_layer(gpu: &Gpu, ep: &EpGroup, m: &DMoe, to: Placement) -> Result<(usize, usize), CudaError> {
    let old = m.routed();
    let Some(from) = &old.slots else {
        return Err(CudaError::Shape("eplb: a layer without slots cannot move".into()));
    };
    let (rank, world) = (ep.shard().rank, ep.shard().world);
    let plan = transfer_plan(&from.placement, &to, world);
    let per = to.phy2log.len() / world;
    let s = gpu.stream();
    let like = |l: &super::weights::DLinear| {
        l.fp8_like(s, per)?.ok_or_else(|| CudaError::Shape("eplb: routed experts that are not FP8".into()))
    };
    let new = DMlp { gate: like(&old.experts.gate)?, up: like(&old.experts.up)?, down: like(&old.experts.down)? };
    let parts = |mlp: &DMlp, i: usize| -> Result<Vec<(u64, usize)>, CudaError> {
        let mut v = Vec::with_capacity(6);
        for l in [&mlp.gate, &mlp.up, &mlp.down] {
            v.extend(l.fp8_matrix(i).ok_or_else(|| CudaError::Shape(format!("eplb: no matrix {i}")))?);
        }
        Ok(v)
    };
    let (mut local, mut received) = (0, 0);
    for (j, src) in plan[rank].iter().enumerate() {
        if let Source::Local(i) = *src {
            for ((dst, n), (from, _)) in parts(&new, j)?.into_iter().zip(parts(&old.experts, i)?) {
                // SAFETY: two live device ranges of `n` bytes, ordered on the stream.
                unsafe { cudarc::driver::result::memcpy_dtod_async(dst, from, n, s.cu_stream()) }?;
            }
            local += 1;
        }
    }
    // Every rank walks the whole plan in the same order, so each pair of ranks lists its moves alike.
    let mut moves = Vec::new();
    for (r, slots) in plan.iter().enumerate() {
        for (j, src) in slots.iter().enumerate() {
            let Source::Remote { gpu: q, slot: i } = *src else { continue };
            if q == rank {
                moves.extend(parts(&old.experts, i)?.into_iter().map(|(p, n)| (r, p, n, true)));
            } else if r == rank {
                moves.extend(parts(&new, j)?.into_iter().map(|(p, n)| (q, p, n, false)));
                received += 1;
            }
        }
    }
    ep.moves(&moves)?;
    let slots = SlotTable::new(s, to, world)?;
    m.replace_routed(Routed { experts: new, expert_map: None, slots: Some(slots) });
    Ok((local, received))
}
