//! A fast, deterministic backend for the worker loops' unit tests: the tiny model's shapes, no model
//! math. The token after `t` at position `p` is always [`FakeBackend::next`]`(t, p)` (a one-hot logits
//! row, sampled by the real sampler), the MTP layer predicts exactly that (so drafts are accepted), every
//! position's cache entries get bytes derived from (layer, position, token), and each layer is announced.
//! A test can make a chosen call fail ([`FakeBackend::fail_at`]).
//!
//! [`FakeBackend::ep_rank`] makes it one rank of a [`FakeGroup`]: an expert-parallel group in one process
//! whose agreement is a barrier (the CUDA backend's all-reduce), with the same step rule
//! ([`engine::lockstep`]), the ranks' passes recorded, and a rank that can be made to vanish.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use engine::lockstep::{Pass, StepRows, Steps};

use engine::backend::{
    AttnForm, Backend, DeviceRows, EngineError, LayerDone, LayerReady, MtpInput, SeqInput, SeqOutput,
};
use engine::cache::{BLOCK_SIZE, CacheGeometry, KvCache, LayerIdx};
use engine::memory::{MemoryBudget, ServingLimits};
use engine::sampling;
use engine::{Logits, ModelConfig, Precision};

/// What an injected failure returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// `EngineError::Device`, and every later call fails too, as after a sticky CUDA error.
    Device,
    /// `EngineError::InvalidInput`, once.
    InvalidInput,
}

pub struct FakeBackend {
    cfg: ModelConfig,
    /// The call number (1-based, counted by `calls`) that fails, and how.
    fail_at: Mutex<Option<(usize, Failure)>>,
    /// A device failure happened: every call fails.
    broken: Mutex<Option<String>>,
    /// Main-model and MTP calls made.
    pub calls: AtomicUsize,
    /// Microseconds each call takes (tests that act while a request computes).
    pub delay_us: AtomicU64,
    /// This backend's group and rank, if it is one.
    group: Option<(Arc<FakeGroup>, usize)>,
    steps: Steps,
}

/// An expert-parallel group of fake ranks in one process.
pub struct FakeGroup {
    world: usize,
    /// How long a rank waits for the others in an agreement before the group is down (the watchdog).
    timeout: Duration,
    state: Mutex<GroupState>,
    cv: Condvar,
}

#[derive(Default)]
struct GroupState {
    /// Agreements completed.
    round: u64,
    /// This round's arrivals: what and the rows per rank.
    arrived: Vec<Option<(Agreement, StepRows)>>,
    /// The last completed round's most rows.
    most: StepRows,
    down: Option<String>,
    /// Ranks made to vanish.
    gone: Vec<bool>,
    /// Every agreement each rank joined, with its rows.
    log: Vec<Vec<(Agreement, StepRows)>>,
}

/// What an agreement is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreement {
    /// A whole step, agreed up front (rows per pass).
    Step,
    /// One pass (its rows in slot 0).
    Pass(Pass),
}

impl FakeGroup {
    pub fn new(world: usize, timeout: Duration) -> Arc<Self> {
        let state = GroupState {
            arrived: vec![None; world],
            gone: vec![false; world],
            log: vec![Vec::new(); world],
            ..Default::default()
        };
        Arc::new(FakeGroup { world, timeout, state: Mutex::new(state), cv: Condvar::new() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rank `rank` stops taking part without a word (as a SIGKILLed or SIGSTOPped process): the others
    /// find the group down at their next agreement, after the timeout.
    pub fn vanish(&self, rank: usize) {
        self.lock().gone[rank] = true;
        self.cv.notify_all();
    }

    /// Every agreement rank `rank` joined so far, with the rows it brought.
    pub fn log(&self, rank: usize) -> Vec<(Agreement, StepRows)> {
        self.lock().log[rank].clone()
    }

    /// Rank `rank` leaves the group (its worker stopped): the others' agreements fail at once.
    fn leave(&self, rank: usize, why: &str) {
        let mut st = self.lock();
        if st.gone[rank] {
            // A vanished rank stands for a killed process: it tells nobody.
            return;
        }
        st.down.get_or_insert_with(|| format!("rank {rank} left the group: {why}"));
        self.cv.notify_all();
    }

    /// The agreement: waits for every rank to bring the same `what`; the most rows any brought.
    fn agree(&self, rank: usize, what: Agreement, rows: StepRows) -> Result<StepRows, EngineError> {
        self.meet(rank, what, rows, true)
    }

    /// A pass of an agreed step in which some rank has rows: every rank must be at the same pass (the
    /// CUDA backend's exchange would otherwise hang); not logged.
    fn barrier(&self, rank: usize, pass: Pass) -> Result<(), EngineError> {
        self.meet(rank, Agreement::Pass(pass), [0; 3], false).map(drop)
    }

    fn meet(&self, rank: usize, what: Agreement, rows: StepRows, log: bool) -> Result<StepRows, EngineError> {
        let mut st = self.lock();
        if st.gone[rank] {
            // A vanished rank's process would be gone; its calls never return in a real group.
            return Err(EngineError::GroupDown(format!("rank {rank} left the group")));
        }
        if let Some(why) = &st.down {
            return Err(EngineError::GroupDown(why.clone()));
        }
        if log {
            st.log[rank].push((what, rows));
        }
        st.arrived[rank] = Some((what, rows));
        if st.arrived.iter().all(Option::is_some) {
            let whats: Vec<Agreement> = st.arrived.iter().flatten().map(|a| a.0).collect();
            if whats.iter().any(|&w| w != what) {
                let why = format!("ranks out of lockstep: {whats:?}");
                st.down = Some(why.clone());
                self.cv.notify_all();
                return Err(EngineError::GroupDown(why));
            }
            let mut most = [0; 3];
            for (_, r) in st.arrived.iter().flatten() {
                for (m, &x) in most.iter_mut().zip(r) {
                    *m = (*m).max(x);
                }
            }
            st.most = most;
            st.arrived.iter_mut().for_each(|a| *a = None);
            st.round += 1;
            self.cv.notify_all();
            return Ok(st.most);
        }
        let (round, deadline) = (st.round, Instant::now() + self.timeout);
        while st.round == round && st.down.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = (0..self.world).filter(|&r| st.arrived[r].is_none()).collect();
                let why = format!(
                    "watchdog: ranks {missing:?} did not join the {what:?} agreement within {:?}",
                    self.timeout
                );
                st.down = Some(why);
                self.cv.notify_all();
                break;
            }
            st = self.cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        match &st.down {
            Some(why) => Err(EngineError::GroupDown(why.clone())),
            None => Ok(st.most),
        }
    }
}

impl FakeBackend {
    /// The tiny model's config with a `vocab_size`-token vocabulary and one MTP layer.
    pub fn new(vocab_size: usize) -> Arc<Self> {
        let cfg = ModelConfig::from_json(&engine::tiny::config_json(vocab_size)).expect("the tiny config is valid");
        Arc::new(FakeBackend {
            cfg,
            fail_at: Mutex::new(None),
            broken: Mutex::new(None),
            calls: AtomicUsize::new(0),
            delay_us: AtomicU64::new(0),
            group: None,
            steps: Steps::default(),
        })
    }

    /// [`FakeBackend::new`] as rank `rank` of `group`.
    pub fn ep_rank(vocab_size: usize, group: &Arc<FakeGroup>, rank: usize) -> Arc<Self> {
        let mut b = Arc::into_inner(Self::new(vocab_size)).expect("just made");
        b.group = Some((group.clone(), rank));
        Arc::new(b)
    }

    /// In a group: `pass` in its place in the step, with `rows` rows (agreed with the others unless the step
    /// was agreed up front).
    fn lockstep(&self, pass: Pass, rows: usize) -> Result<(), EngineError> {
        let Some((g, rank)) = &self.group else { return Ok(()) };
        self.steps.enter(pass, &mut |p| self.join_empty(p))?;
        let most = match self.steps.planned(pass) {
            Some(most) if rows <= most => {
                if most > 0 {
                    g.barrier(*rank, pass)?;
                }
                most
            }
            Some(most) => {
                return Err(EngineError::InvalidInput(format!("{pass:?}: {rows} rows, the step agreed on {most}")));
            }
            None => g.agree(*rank, Agreement::Pass(pass), [rows, 0, 0])?[0],
        };
        if most > 0 {
            self.steps.mark_busy();
        }
        Ok(())
    }

    /// `pass` with no rows of this rank's: whether some rank had rows (an agreement unless the step was
    /// agreed up front).
    fn join_empty(&self, pass: Pass) -> Result<bool, EngineError> {
        let Some((g, rank)) = &self.group else { return Ok(false) };
        Ok(match self.steps.planned(pass) {
            Some(0) => false,
            Some(_) => {
                g.barrier(*rank, pass)?;
                true
            }
            None => g.agree(*rank, Agreement::Pass(pass), [0; 3])?[0] > 0,
        })
    }

    /// Main-model or MTP call number `call` (1-based, counting all calls made so far) fails with `failure`.
    pub fn fail_at(&self, call: usize, failure: Failure) {
        *self.fail_at.lock().unwrap_or_else(|p| p.into_inner()) = Some((call, failure));
    }

    /// The next main-model or MTP call fails with `failure`.
    pub fn fail_next(&self, failure: Failure) {
        self.fail_at(self.calls.load(Ordering::SeqCst) + 1, failure);
    }

    /// The token that follows `token` at position `pos` (never a special id below 7).
    pub fn next(&self, token: u32, pos: usize) -> u32 {
        7 + ((token as usize * 31 + pos * 17) % (self.cfg.vocab_size - 7)) as u32
    }

    /// The byte every cache entry of (layer, pos, token) is filled with.
    pub fn cache_byte(layer: usize, pos: usize, token: u32) -> u8 {
        (layer as u32 * 59 + pos as u32 * 13 + token * 7) as u8 | 1
    }

    fn begin_call(&self) -> Result<(), EngineError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        std::thread::sleep(std::time::Duration::from_micros(self.delay_us.load(Ordering::SeqCst)));
        let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(msg) = &*broken {
            return Err(EngineError::Device(msg.clone()));
        }
        let mut fail_at = self.fail_at.lock().unwrap_or_else(|p| p.into_inner());
        match fail_at.take_if(|(at, _)| *at <= call).map(|(_, f)| f) {
            Some(Failure::Device) => {
                let msg = format!("injected device failure (call {call})");
                *broken = Some(msg.clone());
                Err(EngineError::Device(msg))
            }
            Some(Failure::InvalidInput) => Err(EngineError::InvalidInput(format!("injected failure (call {call})"))),
            None => Ok(()),
        }
    }

    fn one_hot(&self, tokens: &[u32]) -> Vec<f32> {
        let vocab = self.cfg.vocab_size;
        let mut rows = vec![0f32; tokens.len() * vocab];
        for (r, &t) in tokens.iter().enumerate() {
            rows[r * vocab + t as usize] = 10.0;
        }
        rows
    }

    /// Writes positions `start..start + tokens.len()` of `layer` and builds the item's output.
    fn run_item(
        &self,
        cache: &KvCache,
        layer_range: std::ops::Range<usize>,
        item: (&[u32], usize, &[engine::cache::BlockId], Logits),
        // The token each position predicts.
        predict: impl Fn(usize) -> u32,
    ) -> Result<SeqOutput, EngineError> {
        let (tokens, start, blocks, logits) = item;
        let host = cache.host().map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        if blocks.len() * BLOCK_SIZE < start + tokens.len() {
            return Err(EngineError::InvalidInput("blocks do not cover the positions".into()));
        }
        for l in layer_range {
            for (i, &t) in tokens.iter().enumerate() {
                let pos = start + i;
                let (b, s) = (blocks[pos / BLOCK_SIZE], pos % BLOCK_SIZE);
                // SAFETY: the block belongs to this item's request, which this call writes alone.
                unsafe { host.latent_entry_mut(LayerIdx(l as u32), b, s) }.fill(Self::cache_byte(l, pos, t));
            }
        }
        let predicted: Vec<u32> = logits.rows(tokens.len()).map(predict).collect();
        let hidden: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        Ok(SeqOutput {
            logits: DeviceRows::new(predicted.len(), self.cfg.vocab_size, self.one_hot(&predicted)),
            hidden: DeviceRows::new(tokens.len(), 1, hidden),
        })
    }

    fn main(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.lockstep(Pass::main(form), batch.iter().map(|s| s.tokens.len()).sum())?;
        self.begin_call()?;
        let layers = 0..self.cfg.num_hidden_layers;
        let outs = batch
            .iter()
            .map(|s| {
                let item = (s.tokens, s.start, s.blocks, s.logits);
                self.run_item(cache, layers.clone(), item, |i| self.next(s.tokens[i], s.start + i))
            })
            .collect::<Result<Vec<_>, _>>()?;
        for l in layers {
            on_layer(LayerIdx(l as u32), LayerReady::complete());
        }
        Ok(outs)
    }
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn precision(&self) -> Precision {
        Precision::Fp8
    }

    fn allocate_cache(&self, geometry: CacheGeometry) -> Result<KvCache, EngineError> {
        KvCache::new_host(geometry).map_err(|e| EngineError::Unsupported(e.to_string()))
    }

    fn memory_budget(&self, _limits: &ServingLimits) -> MemoryBudget {
        MemoryBudget::default()
    }

    fn expert_balance(&self) -> Option<engine::ExpertBalance> {
        // A group rank reports as a balanced one that looked once (what the metrics show for a real group).
        self.group.as_ref().map(|_| engine::ExpertBalance {
            looks: 1,
            imbalance_sharded: 1.5,
            imbalance_placed: 1.0,
            ..Default::default()
        })
    }

    fn expert_parallel(&self) -> Option<engine::EpRank> {
        self.group.as_ref().map(|(g, rank)| engine::EpRank { rank: *rank, world: g.world })
    }

    fn leave_group(&self, why: &str) {
        if let Some((g, rank)) = &self.group {
            g.leave(*rank, why);
        }
    }

    fn begin_step(&self, rows: StepRows) -> Result<(), EngineError> {
        let Some((g, rank)) = &self.group else { return Ok(()) };
        self.steps.plan(&mut || g.agree(*rank, Agreement::Step, rows), &mut |p| self.join_empty(p))
    }

    fn end_step(&self) -> Result<bool, EngineError> {
        if self.group.is_none() {
            return Ok(false);
        }
        if !self.steps.begun() {
            self.begin_step([0; 3])?;
        }
        self.steps.finish(&mut |p| self.join_empty(p))
    }

    fn draft(&self, logits: &DeviceRows, row: usize) -> Result<(u32, f32), EngineError> {
        Ok((sampling::argmax(logits.host_row(row)?), 1.0))
    }

    fn prefill(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.main(cache, batch, AttnForm::Prefill, on_layer)
    }

    fn decode(&self, cache: &KvCache, batch: &[SeqInput<'_>]) -> Result<Vec<SeqOutput>, EngineError> {
        self.main(cache, batch, AttnForm::Decode, &mut |_, _| {})
    }

    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[MtpInput<'_>],
        _form: AttnForm,
        on_layer: LayerDone<'_>,
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.lockstep(Pass::Mtp, batch.iter().map(|m| m.next_tokens.len()).sum())?;
        self.begin_call()?;
        let l = self.cfg.num_hidden_layers;
        let outs = batch
            .iter()
            .map(|m| {
                // MTP position p sees the token at p + 1 and predicts the one after it.
                let item = (m.next_tokens, m.start, m.blocks, m.logits);
                self.run_item(cache, l..l + 1, item, |i| self.next(m.next_tokens[i], m.start + i + 1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        on_layer(LayerIdx(l as u32), LayerReady::complete());
        Ok(outs)
    }
}
