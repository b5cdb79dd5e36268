//! The step rule of expert parallelism (docs/model.md §5.1): the ranks of a group run every MoE layer's
//! exchange together, so each must issue the same forward passes in the same order. A scheduling step is
//! the three passes of [`Pass::STEP`]; a rank issues the ones it has rows for and joins the others with an
//! empty batch ([`Steps`] says which), and [`crate::Backend::end_step`] closes the step.
//!
//! A step the ranks agree on up front ([`crate::Backend::begin_step`], what `engine::generate` and the
//! workers do) costs one small collective: the most rows of each pass, after which a pass no rank has rows
//! for is skipped and the others run without another agreement. A rank with nothing to do agrees on an
//! empty step at `end_step`. Forward calls outside such a step (engine-level use) agree pass by pass.
//! Backends in a group (the CUDA backend, the worker tests' fake) keep their place in the step here.

use std::sync::Mutex;

use crate::{AttnForm, EngineError};

/// One forward pass of a step, in the order every rank issues them ([`Pass::STEP`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The main layers in the decode form (decode steps; a prefill batch's replayed tokens).
    Main = 1,
    /// The main layers in the prefill form.
    MainPrefill = 2,
    /// The MTP layer (either form).
    Mtp = 3,
}

impl Pass {
    /// One step: every rank issues these passes in this order.
    pub const STEP: [Pass; 3] = [Pass::Main, Pass::MainPrefill, Pass::Mtp];

    /// The pass a main-layer call in `form` belongs to.
    pub fn main(form: AttnForm) -> Pass {
        match form {
            AttnForm::Decode => Pass::Main,
            AttnForm::Prefill => Pass::MainPrefill,
        }
    }

    /// Its place in [`Pass::STEP`].
    pub fn index(self) -> usize {
        self as usize - 1
    }
}

/// Joins `pass` with an empty batch; returns whether some rank had rows in it.
pub type JoinEmpty<'a> = &'a mut dyn FnMut(Pass) -> Result<bool, EngineError>;

/// Rows per pass of a step, in [`Pass::STEP`] order (a rank's at most, or the most of any rank).
pub type StepRows = [usize; 3];

/// A rank's place in the current step.
#[derive(Debug, Default)]
pub struct Steps(Mutex<State>);

#[derive(Debug, Default)]
struct State {
    /// The index in [`Pass::STEP`] of the next pass to issue.
    next: usize,
    /// Whether some rank had rows in a pass of this step.
    busy: bool,
    /// The agreed most rows of each pass, for a step agreed up front.
    plan: Option<StepRows>,
}

impl Steps {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before this rank issues `pass`: a pass no later in the step than the last one issued starts a new
    /// step (the rest of the last one joined first), and the passes of this step it skips are joined empty.
    pub fn enter(&self, pass: Pass, join: JoinEmpty<'_>) -> Result<(), EngineError> {
        if pass.index() < self.state().next {
            self.finish(join)?;
        }
        let next = self.state().next;
        for &p in &Pass::STEP[next..pass.index()] {
            let busy = join(p)?;
            self.state().busy |= busy;
        }
        self.state().next = pass.index() + 1;
        Ok(())
    }

    /// Some rank (this one, at least) had rows in the pass just entered.
    pub fn mark_busy(&self) {
        self.state().busy = true;
    }

    /// Starts a step agreed up front: the last step is completed first if it had begun, then `agree` gives
    /// the most rows of each pass over the ranks.
    pub fn plan(
        &self,
        agree: &mut dyn FnMut() -> Result<StepRows, EngineError>,
        join: JoinEmpty<'_>,
    ) -> Result<(), EngineError> {
        if self.state().next > 0 || self.state().plan.is_some() {
            self.finish(join)?;
        }
        let most = agree()?;
        let mut st = self.state();
        st.plan = Some(most);
        st.busy = most.iter().any(|&r| r > 0);
        Ok(())
    }

    /// The agreed most rows of `pass` in this step, if it was agreed up front.
    pub fn planned(&self, pass: Pass) -> Option<usize> {
        self.state().plan.map(|p| p[pass.index()])
    }

    /// Whether this step has begun: a pass issued, or agreed up front.
    pub fn begun(&self) -> bool {
        let st = self.state();
        st.next > 0 || st.plan.is_some()
    }

    /// Joins the passes of the step this rank did not issue, empty, and starts the next step; whether some
    /// rank had rows in the step that ended.
    pub fn finish(&self, join: JoinEmpty<'_>) -> Result<bool, EngineError> {
        let next = self.state().next;
        for &p in &Pass::STEP[next..] {
            let busy = join(p)?;
            self.state().busy |= busy;
        }
        Ok(std::mem::take(&mut *self.state()).busy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` (a rank's passes, `true` where it has rows) and returns every pass issued, with the
    /// joined ones marked empty.
    fn issued(steps: &Steps, calls: &[(Pass, bool)], end: bool) -> (Vec<(Pass, bool)>, Option<bool>) {
        let mut log = Vec::new();
        for &(p, rows) in calls {
            let mut join = |q: Pass| {
                log.push((q, false));
                Ok(false)
            };
            steps.enter(p, &mut join).unwrap();
            if rows {
                steps.mark_busy();
            }
            log.push((p, rows));
        }
        let ended = end.then(|| {
            steps
                .finish(&mut |q| {
                    log.push((q, false));
                    Ok(false)
                })
                .unwrap()
        });
        (log, ended)
    }

    #[test]
    fn skipped_and_trailing_passes_are_joined_in_step_order() {
        use Pass::*;
        let s = Steps::default();
        // A decode step: Main, then MTP (the prefill-form pass joined between them), then the step ends.
        let (log, busy) = issued(&s, &[(Main, true), (Mtp, true)], true);
        assert_eq!(log, [(Main, true), (MainPrefill, false), (Mtp, true)]);
        assert_eq!(busy, Some(true));
        // An idle rank: the whole step joined empty; nobody had rows.
        let (log, busy) = issued(&s, &[], true);
        assert_eq!(log, [(Main, false), (MainPrefill, false), (Mtp, false)]);
        assert_eq!(busy, Some(false));
        // A pass earlier than the last one starts a new step without end_step: the old one is completed.
        let (log, _) = issued(&s, &[(MainPrefill, true), (MainPrefill, true)], false);
        assert_eq!(log, [(Main, false), (MainPrefill, true), (Mtp, false), (Main, false), (MainPrefill, true)]);
        let (log, busy) = issued(&s, &[], true);
        assert_eq!(log, [(Mtp, false)]);
        assert_eq!(busy, Some(true), "the step had rows");
    }

    #[test]
    fn a_joined_pass_where_another_rank_had_rows_makes_the_step_busy() {
        let s = Steps::default();
        let busy = s.finish(&mut |p| Ok(p == Pass::MainPrefill)).unwrap();
        assert!(busy);
        assert!(!s.finish(&mut |_| Ok(false)).unwrap(), "a new step starts idle");
    }

    #[test]
    fn a_step_agreed_up_front_keeps_its_plan_until_it_ends() {
        let s = Steps::default();
        assert!(!s.begun());
        s.plan(&mut || Ok([2, 0, 2]), &mut |_| unreachable!("nothing to complete")).unwrap();
        assert!(s.begun());
        assert_eq!((s.planned(Pass::Main), s.planned(Pass::MainPrefill)), (Some(2), Some(0)));
        let mut joined = Vec::new();
        s.enter(Pass::Main, &mut |_| unreachable!("the first pass skips nothing")).unwrap();
        s.enter(Pass::Mtp, &mut |p| {
            joined.push(p);
            Ok(false)
        })
        .unwrap();
        assert_eq!(joined, [Pass::MainPrefill], "the skipped pass is offered to the backend, which knows the plan");
        assert!(s.finish(&mut |_| unreachable!("the step is complete")).unwrap(), "the plan had rows");
        assert_eq!(s.planned(Pass::Main), None, "the next step is not agreed yet");
        // A new plan while a step is under way completes that step first.
        s.enter(Pass::Main, &mut |_| Ok(false)).unwrap();
        let mut done = Vec::new();
        s.plan(&mut || Ok([0; 3]), &mut |p| {
            done.push(p);
            Ok(false)
        })
        .unwrap();
        assert_eq!(done, [Pass::MainPrefill, Pass::Mtp]);
        assert!(!s.finish(&mut |_| Ok(false)).unwrap(), "an empty step");
    }

    #[test]
    fn a_failed_join_is_returned() {
        let s = Steps::default();
        let e = s.enter(Pass::Mtp, &mut |_| Err(EngineError::GroupDown("rank 1 lost".into()))).unwrap_err();
        assert!(matches!(e, EngineError::GroupDown(_)), "{e}");
    }
}
