//! Per-kernel GPU time from CUDA events (`Backend::set_kernel_profile`, `engine-bench --kernel-profile`).
//!
//! Off by default, where a launch pays one relaxed atomic load. On, every launch through this module is
//! bracketed by two timing events on its stream; [`Profiler::take`] waits for the events and sums the
//! time per kernel. The events cost the host a few microseconds per launch, so a profiled call is slower
//! end to end, while each kernel's own time stays what it is: profile a run to split it by kernel, and time
//! it unprofiled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaEvent, CudaStream, sys};

use super::CudaError;
use crate::backend::KernelTime;

/// Launches timed before their events are read back and summed (bounds the events held).
const FOLD_AT: usize = 4096;

#[derive(Default)]
pub struct Profiler {
    on: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    open: Vec<(String, CudaEvent, CudaEvent)>,
    totals: HashMap<String, (u64, f64)>,
}

impl Profiler {
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Runs `launch` (one kernel launch on `stream`; what it returns on success is dropped), timed as `name`
    /// when profiling is on.
    pub fn time<T, E>(
        &self,
        stream: &CudaStream,
        name: &str,
        launch: impl FnOnce() -> Result<T, E>,
    ) -> Result<(), CudaError>
    where
        CudaError: From<E>,
    {
        if !self.is_on() {
            launch()?;
            return Ok(());
        }
        let ctx = stream.context();
        let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        launch()?;
        end.record(stream)?;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.open.push((name.to_string(), start, end));
        if st.open.len() >= FOLD_AT {
            st.fold()?;
        }
        Ok(())
    }

    /// The time per kernel since the previous take, longest first; waits for the timed launches.
    pub fn take(&self) -> Result<Vec<KernelTime>, CudaError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.fold()?;
        let mut out: Vec<KernelTime> =
            st.totals.drain().map(|(name, (launches, seconds))| KernelTime { name, launches, seconds }).collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.name.cmp(&b.name)));
        Ok(out)
    }
}

impl State {
    fn fold(&mut self) -> Result<(), CudaError> {
        for (name, start, end) in self.open.drain(..) {
            let ms = start.elapsed_ms(&end)?;
            let t = self.totals.entry(name).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += f64::from(ms) / 1e3;
        }
        Ok(())
    }
}

/// When the GPU works and when it waits, call by call (`Backend::set_busy_timer`, `engine-bench`'s
/// `extra.gpu_busy`). On, each backend call that puts work on the stream (a forward pass, a sampling or
/// drafting call) records a timing event before its first piece of work and one after its last, before any
/// wait for it; [`BusyTimer::take`] sums the calls' spans and the whole span from the first call to the last.
/// The GPU is idle between the calls: what the host does between them (sampling's read-back, the
/// scheduler, preparing the next step's inputs). Inside a call it counts as busy, so an eagerly launched
/// call whose launches fall behind the GPU hides its gaps (a CUDA graph has none to hide).
#[derive(Default)]
pub struct BusyTimer {
    on: AtomicBool,
    state: Mutex<BusyState>,
}

#[derive(Default)]
struct BusyState {
    /// The call in progress: its start event.
    open: Option<CudaEvent>,
    spans: Vec<(CudaEvent, CudaEvent)>,
}

/// A timing event recorded on `stream`.
fn record(stream: &CudaStream) -> Result<CudaEvent, CudaError> {
    let ev = stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    ev.record(stream)?;
    Ok(ev)
}

/// Calls timed, the GPU time inside them, and the time from the first one's start to the last one's end.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Busy {
    pub calls: u64,
    pub busy_s: f64,
    pub span_s: f64,
}

impl BusyTimer {
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
        if !on {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.open = None;
        }
    }

    /// The start of a call's work on `stream`. A start left open by a call that failed before its end is
    /// replaced, so a failed call is not counted. A timer that cannot record is logged, never the call's
    /// failure.
    pub fn begin(&self, stream: &CudaStream) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        match record(stream) {
            Ok(ev) => self.state.lock().unwrap_or_else(|p| p.into_inner()).open = Some(ev),
            Err(e) => tracing::warn!(error = %e, "the GPU busy timer could not record a call's start"),
        }
    }

    /// The end of the open call's work on `stream` (nothing where none is open).
    pub fn end(&self, stream: &CudaStream) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(start) = st.open.take() {
            match record(stream) {
                Ok(ev) => st.spans.push((start, ev)),
                Err(e) => tracing::warn!(error = %e, "the GPU busy timer could not record a call's end"),
            }
        }
    }

    /// The calls timed since the previous take (waits for them).
    pub fn take(&self) -> Result<Busy, CudaError> {
        let spans = std::mem::take(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()).spans);
        let mut busy = Busy { calls: spans.len() as u64, ..Busy::default() };
        for (start, end) in &spans {
            busy.busy_s += f64::from(start.elapsed_ms(end)?) / 1e3;
        }
        if let (Some(first), Some(last)) = (spans.first(), spans.last()) {
            busy.span_s = f64::from(first.0.elapsed_ms(&last.1)?) / 1e3;
        }
        Ok(busy)
    }
}

#[cfg(test)]
mod tests {
    use crate::cuda::device::Gpu;
    use crate::cuda::ops::{Arg, DBuf, elementwise_grid, launch};

    /// Timed launches are counted per kernel with their GPU time; untimed ones leave nothing; a take
    /// empties the profile.
    #[test]
    fn timed_launches_are_summed_per_kernel() {
        let Some(gpu) = Gpu::for_test() else { return };
        let s = gpu.stream();
        let n = 1 << 22;
        let (h, x) = (DBuf::<f32>::zeros(s, n).unwrap(), DBuf::<f32>::zeros(s, n).unwrap());
        let add = |gpu: &Gpu| {
            launch(
                gpu,
                "tandem_add",
                elementwise_grid(n),
                256,
                0,
                &[Arg::P(h.ptr()), Arg::P(x.ptr()), Arg::L(n as i64)],
            )
            .unwrap()
        };
        add(&gpu);
        assert!(gpu.profiler().take().unwrap().is_empty(), "a launch with profiling off was timed");
        gpu.profiler().set(true);
        for _ in 0..3 {
            add(&gpu);
        }
        launch(
            &gpu,
            "tandem_silu_mul",
            elementwise_grid(n),
            256,
            0,
            &[Arg::P(h.ptr()), Arg::P(x.ptr()), Arg::P(h.ptr()), Arg::L(n as i64)],
        )
        .unwrap();
        gpu.profiler().set(false);
        add(&gpu);
        let k = gpu.profiler().take().unwrap();
        let names: Vec<(&str, u64)> = k.iter().map(|t| (t.name.as_str(), t.launches)).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.contains(&("tandem_add", 3)) && names.contains(&("tandem_silu_mul", 1)), "{names:?}");
        // 16 MiB read twice and written once per launch: microseconds, not nothing and not seconds.
        assert!(k.iter().all(|t| t.seconds > 1e-7 && t.seconds < 0.1), "{k:?}");
        assert!(gpu.profiler().take().unwrap().is_empty(), "a take leaves the profile empty");
    }
}
