//! Expert-parallel load balancing (EPLB): where to put redundant copies of hot experts so that no GPU of an
//! expert-parallel group waits for the busiest (issue 20; DeepSeek's published EPLB policies, implemented
//! here from their description). Given each logical expert's recent load, [`rebalance`] decides how many
//! physical copies each expert gets and which GPU holds each copy:
//!
//! - **Hierarchical** (the expert groups divide evenly over the nodes): whole expert groups are packed onto
//!   nodes so that the nodes' loads balance (group-limited routing then keeps a token's experts on few
//!   nodes), each node's experts are replicated within the node's share of physical slots, and the copies
//!   are packed onto the node's GPUs.
//! - **Global** (otherwise): experts are replicated over all slots and the copies packed onto all GPUs.
//!
//! Replication gives the next copy to the expert with the largest load per copy; packing places items
//! heaviest first, each on the lightest pack that still has room (every pack gets the same number of
//! items). Ties go to the lowest index, so the placement is a pure function of the loads.
//!
//! [`LoadWindow`] keeps the per-expert loads of the last steps that [`rebalance`] is fed with.

use std::collections::VecDeque;

/// Where every physical expert slot's copy comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Physical slot -> logical expert. Slots `[g * per_gpu, (g + 1) * per_gpu)` are GPU g's.
    pub phy2log: Vec<usize>,
    /// Logical expert -> its slots, ascending.
    pub log2phy: Vec<Vec<usize>>,
}

impl Placement {
    /// One copy of every expert, in order (what expert parallelism without EPLB does).
    pub fn identity(experts: usize) -> Self {
        Placement { phy2log: (0..experts).collect(), log2phy: (0..experts).map(|e| vec![e]).collect() }
    }

    /// Copies of each logical expert.
    pub fn counts(&self) -> Vec<usize> {
        self.log2phy.iter().map(Vec::len).collect()
    }

    /// The load each of `gpus` GPUs gets when every expert's `load` splits evenly over its copies.
    pub fn gpu_loads(&self, load: &[f64], gpus: usize) -> Vec<f64> {
        let per_gpu = self.phy2log.len() / gpus.max(1);
        let counts = self.counts();
        let mut out = vec![0.0; gpus];
        for (slot, &e) in self.phy2log.iter().enumerate() {
            out[slot / per_gpu.max(1)] += load[e] / counts[e] as f64;
        }
        out
    }
}

impl Placement {
    /// Expert parallelism's own placement: GPU g's slots hold its contiguous share of the experts, then
    /// `redundant` more slots copying the first of them (the placement at start-up, before any load is
    /// known: every copy is one the GPU loads from the checkpoint anyway).
    pub fn home(experts: usize, gpus: usize, redundant: usize) -> Result<Self, String> {
        if gpus == 0 || experts == 0 || !experts.is_multiple_of(gpus) {
            return Err(format!("eplb: {experts} experts do not split over {gpus} GPUs"));
        }
        let per = experts / gpus;
        if redundant > per {
            return Err(format!("eplb: {redundant} redundant slots per GPU exceed its {per} experts"));
        }
        let phy2log: Vec<usize> =
            (0..gpus).flat_map(|g| (g * per..(g + 1) * per).chain(g * per..g * per + redundant)).collect();
        Ok(Self::from_phy2log(phy2log, experts))
    }

    /// The placement whose slot s holds expert `phy2log[s]` (every expert in `0..experts` must have one).
    pub fn from_phy2log(phy2log: Vec<usize>, experts: usize) -> Self {
        let mut log2phy = vec![Vec::new(); experts];
        for (slot, &e) in phy2log.iter().enumerate() {
            log2phy[e].push(slot);
        }
        Placement { phy2log, log2phy }
    }

    /// The most copies any expert has.
    pub fn max_copies(&self) -> usize {
        self.log2phy.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The device form of `log2phy`: per expert, its number of copies and then its slots, padded with -1 to
    /// `1 + max_copies` ints.
    pub fn table(&self) -> Vec<i32> {
        let w = 1 + self.max_copies();
        let mut t = vec![-1i32; self.log2phy.len() * w];
        for (e, slots) in self.log2phy.iter().enumerate() {
            t[e * w] = slots.len() as i32;
            for (i, &s) in slots.iter().enumerate() {
                t[e * w + 1 + i] = s as i32;
            }
        }
        t
    }
}

/// Where a GPU's new slot gets its expert's weights when the placement changes ([`transfer_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// This GPU's own slot (of the old placement, numbered within the GPU).
    Local(usize),
    /// Another GPU's slot (old placement, numbered within that GPU).
    Remote { gpu: usize, slot: usize },
}

/// For every GPU and each of its slots under `new`, where the expert's weights come from under `old`: the
/// GPU's own first copy if it has one, else the first copy on the lowest GPU that has it. Every GPU computes
/// the same plan, so the sends and receives pair up without a further exchange.
pub fn transfer_plan(old: &Placement, new: &Placement, gpus: usize) -> Vec<Vec<Source>> {
    let (old_per, new_per) = (old.phy2log.len() / gpus, new.phy2log.len() / gpus);
    (0..gpus)
        .map(|g| {
            (0..new_per)
                .map(|j| {
                    let e = new.phy2log[g * new_per + j];
                    let copies = &old.log2phy[e];
                    match copies.iter().find(|&&s| s / old_per == g) {
                        Some(&s) => Source::Local(s - g * old_per),
                        None => Source::Remote { gpu: copies[0] / old_per, slot: copies[0] % old_per },
                    }
                })
                .collect()
        })
        .collect()
}

/// Expert-parallel load balancing at run time (the CUDA backend's, engine::cuda::balance).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EplbConfig {
    /// Whether placements change; off, the loads are still counted and logged (what EPLB would gain).
    pub rebalance: bool,
    /// Slots per GPU beyond its share of the experts, for copies of hot experts.
    pub redundant: usize,
    /// Busy steps between two looks at the loads.
    pub interval: usize,
    /// Looks whose loads the window sums ([`LoadWindow`]).
    pub window: usize,
    /// GPUs per node, for the hierarchical policy (the group's size: one node).
    pub gpus_per_node: Option<usize>,
    /// A new placement is applied only where it lowers the max/mean GPU load by at least this fraction.
    pub min_gain: f64,
}

impl Default for EplbConfig {
    fn default() -> Self {
        EplbConfig { rebalance: false, redundant: 0, interval: 256, window: 4, gpus_per_node: None, min_gain: 0.05 }
    }
}

impl EplbConfig {
    /// Whether the values make sense for `experts` routed experts over `gpus` GPUs.
    pub fn check(&self, experts: usize, groups: usize, gpus: usize) -> Result<(), String> {
        self.check_settings(gpus)?;
        Placement::home(experts, gpus, self.redundant)?;
        // The layout the placements will be made for.
        rebalance(&vec![1.0; experts], self.layout(experts, groups, gpus)).map(drop)
    }

    /// [`check`](Self::check) of what does not depend on the model.
    pub fn check_settings(&self, gpus: usize) -> Result<(), String> {
        if self.interval == 0 || self.window == 0 {
            return Err("eplb: the interval and the window must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.min_gain) {
            return Err(format!("eplb: the minimum gain {} is not in [0, 1)", self.min_gain));
        }
        if let Some(n) = self.gpus_per_node
            && (n == 0 || !gpus.is_multiple_of(n))
        {
            return Err(format!("eplb: {gpus} GPUs do not split into nodes of {n}"));
        }
        Ok(())
    }

    /// The layout a placement is for.
    pub fn layout(&self, experts: usize, groups: usize, gpus: usize) -> Layout {
        let nodes = gpus / self.gpus_per_node.unwrap_or(gpus).max(1);
        Layout { slots: experts + gpus * self.redundant, groups, nodes: nodes.max(1), gpus }
    }
}

/// The shape of the expert-parallel deployment a placement is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Physical expert slots over all GPUs (>= the logical experts; a multiple of `gpus`).
    pub slots: usize,
    /// Expert groups of the model's group-limited routing (`n_group`; 1 if none).
    pub groups: usize,
    pub nodes: usize,
    pub gpus: usize,
}

impl Layout {
    fn check(&self, experts: usize) -> Result<(), String> {
        let Layout { slots, groups, nodes, gpus } = *self;
        if experts == 0 || gpus == 0 || nodes == 0 || groups == 0 {
            return Err(format!("eplb: {experts} experts, {groups} groups, {nodes} nodes, {gpus} GPUs"));
        }
        if slots < experts || !slots.is_multiple_of(gpus) || !gpus.is_multiple_of(nodes) {
            return Err(format!(
                "eplb: {slots} slots for {experts} experts over {gpus} GPUs on {nodes} nodes: slots must be at least \
                 the experts and a multiple of the GPUs, the GPUs a multiple of the nodes"
            ));
        }
        if !experts.is_multiple_of(groups) {
            return Err(format!("eplb: {experts} experts do not split into {groups} groups"));
        }
        Ok(())
    }
}

/// The placement of `load.len()` logical experts (their recent loads, e.g. tokens routed) on `layout`:
/// the hierarchical policy where the groups divide evenly over the nodes, the global one otherwise.
pub fn rebalance(load: &[f64], layout: Layout) -> Result<Placement, String> {
    layout.check(load.len())?;
    if load.iter().any(|l| !l.is_finite() || *l < 0.0) {
        return Err("eplb: loads must be finite and not negative".into());
    }
    if layout.groups.is_multiple_of(layout.nodes) {
        hierarchical(load, layout)
    } else {
        hierarchical(load, Layout { groups: 1, nodes: 1, ..layout })
    }
}

fn hierarchical(load: &[f64], l: Layout) -> Result<Placement, String> {
    let experts = load.len();
    let per_group = experts / l.groups;
    let (slots_per_node, gpus_per_node) = (l.slots / l.nodes, l.gpus / l.nodes);
    if slots_per_node < per_group * (l.groups / l.nodes) || !slots_per_node.is_multiple_of(gpus_per_node) {
        return Err(format!("eplb: {} slots per node cannot hold the node's experts", slots_per_node));
    }
    // 1. Whole groups onto nodes, balancing the nodes' loads.
    let group_load: Vec<f64> = (0..l.groups).map(|g| load[g * per_group..(g + 1) * per_group].iter().sum()).collect();
    let node_of_group = pack(&group_load, l.nodes);
    let mut phy2log = Vec::with_capacity(l.slots);
    for node in 0..l.nodes {
        // The node's experts, by group then expert index.
        let mine: Vec<usize> = (0..l.groups)
            .filter(|&g| node_of_group[g] == node)
            .flat_map(|g| g * per_group..(g + 1) * per_group)
            .collect();
        // 2. Copies within the node's slots.
        let node_load: Vec<f64> = mine.iter().map(|&e| load[e]).collect();
        let copies = replicate(&node_load, slots_per_node);
        // 3. The copies onto the node's GPUs, by load per copy.
        let items: Vec<usize> = (0..mine.len()).flat_map(|i| std::iter::repeat_n(i, copies[i])).collect();
        let item_load: Vec<f64> = items.iter().map(|&i| node_load[i] / copies[i] as f64).collect();
        let gpu_of_item = pack(&item_load, gpus_per_node);
        for gpu in 0..gpus_per_node {
            phy2log.extend(items.iter().zip(&gpu_of_item).filter(|(_, g)| **g == gpu).map(|(&i, _)| mine[i]));
        }
    }
    Ok(Placement::from_phy2log(phy2log, experts))
}

/// Copies per item for `slots` slots: one each, then each further copy to the item with the largest load
/// per copy (ties: lowest index).
fn replicate(load: &[f64], slots: usize) -> Vec<usize> {
    let mut copies = vec![1usize; load.len()];
    for _ in load.len()..slots {
        let mut best = 0;
        for i in 1..load.len() {
            if load[i] / copies[i] as f64 > load[best] / copies[best] as f64 {
                best = i;
            }
        }
        copies[best] += 1;
    }
    copies
}

/// Each item's pack among `packs` packs of equal item counts: heaviest item first (ties: lowest index),
/// each onto the lightest pack with room (ties: lowest pack).
fn pack(load: &[f64], packs: usize) -> Vec<usize> {
    let per_pack = load.len() / packs;
    let mut order: Vec<usize> = (0..load.len()).collect();
    order.sort_by(|&a, &b| load[b].total_cmp(&load[a]).then(a.cmp(&b)));
    let (mut weight, mut filled) = (vec![0.0f64; packs], vec![0usize; packs]);
    let mut out = vec![0; load.len()];
    for i in order {
        let p = (0..packs)
            .filter(|&p| filled[p] < per_pack)
            .min_by(|&a, &b| weight[a].total_cmp(&weight[b]).then(a.cmp(&b)))
            .expect("the packs hold every item");
        out[i] = p;
        weight[p] += load[i];
        filled[p] += 1;
    }
    out
}

/// Per-expert loads of the last `steps` steps (one window per MoE layer), summed for [`rebalance`].
#[derive(Debug, Clone)]
pub struct LoadWindow {
    steps: usize,
    recent: VecDeque<Vec<u64>>,
    sum: Vec<u64>,
}

impl LoadWindow {
    pub fn new(experts: usize, steps: usize) -> Self {
        LoadWindow { steps: steps.max(1), recent: VecDeque::new(), sum: vec![0; experts] }
    }

    /// One step's tokens per expert; the oldest step leaves the window once it is full.
    pub fn push(&mut self, counts: &[u64]) -> Result<(), String> {
        if counts.len() != self.sum.len() {
            return Err(format!("eplb: {} counts for {} experts", counts.len(), self.sum.len()));
        }
        if self.recent.len() == self.steps
            && let Some(old) = self.recent.pop_front()
        {
            self.sum.iter_mut().zip(&old).for_each(|(s, o)| *s -= o);
        }
        self.sum.iter_mut().zip(counts).for_each(|(s, c)| *s += c);
        self.recent.push_back(counts.to_vec());
        Ok(())
    }

    /// Tokens per expert over the window.
    pub fn load(&self) -> Vec<f64> {
        self.sum.iter().map(|&s| s as f64).collect()
    }
}

/// The largest GPU load over the mean: 1 is perfect balance.
pub fn imbalance(gpu_loads: &[f64]) -> f64 {
    let mean = gpu_loads.iter().sum::<f64>() / gpu_loads.len().max(1) as f64;
    let max = gpu_loads.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 { max / mean } else { 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_valid(p: &Placement, experts: usize, l: Layout) {
        assert_eq!(p.phy2log.len(), l.slots);
        assert_eq!(p.log2phy.len(), experts);
        assert!(p.log2phy.iter().all(|s| !s.is_empty()), "every expert has a copy");
        for (e, slots) in p.log2phy.iter().enumerate() {
            assert!(slots.iter().all(|&s| p.phy2log[s] == e), "log2phy and phy2log agree");
        }
        assert_eq!(p.counts().iter().sum::<usize>(), l.slots);
    }

    /// A skewed load: expert e gets (e + 1)^-1.2 of the traffic, shuffled by a fixed permutation.
    fn zipf(experts: usize) -> Vec<f64> {
        let mut load = vec![0.0; experts];
        for r in 0..experts {
            load[(r * 37 + 11) % experts] = 1e4 / ((r + 1) as f64).powf(1.2);
        }
        load
    }

    #[test]
    fn a_hot_expert_gets_the_spare_slots_and_the_gpus_balance() {
        let l = Layout { slots: 6, groups: 1, nodes: 1, gpus: 2 };
        let load = [90.0, 10.0, 10.0, 10.0];
        let p = rebalance(&load, l).unwrap();
        check_valid(&p, 4, l);
        assert_eq!(p.counts(), [3, 1, 1, 1], "the two spare slots copy expert 0");
        // Three copies of 30 and three experts of 10 in two GPUs of three slots: 70 / 50 is the best split
        // (each GPU holds three slots, so no split of 120 gives 60 / 60).
        let loads = p.gpu_loads(&load, 2);
        assert_eq!(loads, [70.0, 50.0], "{p:?}");
        let before = Placement::identity(4).gpu_loads(&load, 2);
        assert!(imbalance(&loads) < imbalance(&before));
    }

    #[test]
    fn hierarchical_keeps_groups_whole_on_a_node_and_beats_no_balancing() {
        // DeepSeek-V3's shape scaled down: 64 experts in 8 groups, 2 nodes of 4 GPUs, 80 slots.
        let (experts, l) = (64, Layout { slots: 80, groups: 8, nodes: 2, gpus: 8 });
        let load = zipf(experts);
        let p = rebalance(&load, l).unwrap();
        check_valid(&p, experts, l);
        let per_node = l.slots / l.nodes;
        for g in 0..l.groups {
            let nodes: std::collections::BTreeSet<usize> =
                (g * 8..(g + 1) * 8).flat_map(|e| p.log2phy[e].iter().map(|s| s / per_node)).collect();
            assert_eq!(nodes.len(), 1, "group {g} is on one node: {nodes:?}");
        }
        let before = imbalance(&Placement::identity(experts).gpu_loads(&load, l.gpus));
        let after = imbalance(&p.gpu_loads(&load, l.gpus));
        assert!(after < before && after < 1.35, "max/mean {before:.2} without, {after:.2} with EPLB");
    }

    #[test]
    fn groups_that_do_not_divide_over_the_nodes_use_the_global_policy() {
        let (experts, l) = (48, Layout { slots: 64, groups: 3, nodes: 2, gpus: 8 });
        let load = zipf(experts);
        let p = rebalance(&load, l).unwrap();
        check_valid(&p, experts, l);
        assert_eq!(p, rebalance(&load, Layout { groups: 1, nodes: 1, ..l }).unwrap());
        assert!(imbalance(&p.gpu_loads(&load, 8)) < 1.2);
    }

    #[test]
    fn equal_loads_and_ties_give_one_placement() {
        let l = Layout { slots: 8, groups: 1, nodes: 1, gpus: 4 };
        let p = rebalance(&[1.0; 8], l).unwrap();
        assert_eq!(p.counts(), [1; 8]);
        assert_eq!(p, rebalance(&[1.0; 8], l).unwrap(), "a pure function of the loads");
        assert_eq!(imbalance(&p.gpu_loads(&[1.0; 8], 4)), 1.0);
    }

    #[test]
    fn bad_layouts_and_loads_are_refused_with_the_reason() {
        let l = Layout { slots: 8, groups: 1, nodes: 1, gpus: 4 };
        assert!(rebalance(&[1.0; 9], l).unwrap_err().contains("slots must be at least"));
        assert!(rebalance(&[1.0; 8], Layout { gpus: 3, ..l }).unwrap_err().contains("multiple of the GPUs"));
        assert!(rebalance(&[1.0; 8], Layout { groups: 3, ..l }).unwrap_err().contains("3 groups"));
        assert!(rebalance(&[f64::NAN; 8], l).unwrap_err().contains("finite"));
        assert!(rebalance(&[], l).is_err());
    }

    #[test]
    fn the_window_sums_the_last_steps_only() {
        let mut w = LoadWindow::new(3, 2);
        w.push(&[1, 0, 0]).unwrap();
        w.push(&[0, 2, 0]).unwrap();
        assert_eq!(w.load(), [1.0, 2.0, 0.0]);
        w.push(&[0, 0, 4]).unwrap();
        assert_eq!(w.load(), [0.0, 2.0, 4.0], "the first step left the window");
        assert!(w.push(&[1, 2]).unwrap_err().contains("2 counts for 3 experts"));
    }

    #[test]
    fn the_home_placement_is_each_gpus_share_then_copies_of_its_first_experts() {
        let p = Placement::home(8, 2, 1).unwrap();
        assert_eq!(p.phy2log, [0, 1, 2, 3, 0, 4, 5, 6, 7, 4]);
        assert_eq!(p.log2phy[0], [0, 4]);
        assert_eq!(p.max_copies(), 2);
        assert_eq!(&p.table()[..6], [2, 0, 4, 1, 1, -1]);
        assert_eq!(Placement::home(8, 2, 0).unwrap(), Placement::identity(8));
        assert!(Placement::home(8, 2, 5).unwrap_err().contains("exceed"));
        assert!(Placement::home(9, 2, 0).is_err());
    }

    #[test]
    fn a_transfer_plan_keeps_local_copies_and_fetches_the_rest_from_the_lowest_holder() {
        let old = Placement::home(8, 2, 1).unwrap();
        // GPU 0 keeps 0 and 2, takes 5 and 7 (held by GPU 1 only) and a second 5; GPU 1 takes 0.
        let new = Placement::from_phy2log(vec![0, 2, 5, 7, 5, 1, 3, 4, 6, 0], 8);
        let plan = transfer_plan(&old, &new, 2);
        use Source::*;
        assert_eq!(
            plan[0],
            [Local(0), Local(2), Remote { gpu: 1, slot: 1 }, Remote { gpu: 1, slot: 3 }, Remote { gpu: 1, slot: 1 }]
        );
        assert_eq!(
            plan[1],
            [Remote { gpu: 0, slot: 1 }, Remote { gpu: 0, slot: 3 }, Local(0), Local(2), Remote { gpu: 0, slot: 0 }]
        );
        assert!(transfer_plan(&old, &old, 2).iter().flatten().all(|s| matches!(s, Local(_))));
    }

    #[test]
    fn eplb_settings_are_checked() {
        let c = EplbConfig { rebalance: true, redundant: 2, ..Default::default() };
        assert!(c.check(16, 4, 2).is_ok());
        assert_eq!(c.layout(16, 4, 2), Layout { slots: 20, groups: 4, nodes: 1, gpus: 2 });
        assert!(EplbConfig { interval: 0, ..c }.check(16, 4, 2).is_err());
        assert!(EplbConfig { min_gain: 1.5, ..c }.check(16, 4, 2).is_err());
        assert!(EplbConfig { gpus_per_node: Some(3), ..c }.check(16, 4, 2).unwrap_err().contains("nodes of 3"));
        assert!(EplbConfig { redundant: 9, ..c }.check(16, 4, 2).unwrap_err().contains("exceed"));
        // DeepSeek-V3.2's shape at EP128 over 16 nodes of 8: 8 groups do not divide over 16 nodes (global).
        let wide = EplbConfig { redundant: 1, gpus_per_node: Some(8), ..c };
        assert!(wide.check(256, 8, 128).is_ok() && wide.check(256, 8, 32).is_ok());
        assert_eq!(EplbConfig { gpus_per_node: Some(2), ..c }.layout(16, 4, 4).nodes, 2);
    }
}
