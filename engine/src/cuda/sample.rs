//! The sampler on the GPU (`engine/kernels/sample.cu`): one logits row that lives on the device to the
//! token [`crate::sampling::sample`] picks from the same values, with the raw logprobs; and the MTP draft.
//! Everything vocabulary-sized runs on the device (one CTA per row); the host sends the request's edits
//! (the few tokens that min_tokens, logit_bias and the penalties touch) and reads back the token, its
//! logprob and the top-n.
//!
//! What is guaranteed, against the CPU on the same values:
//! - greedy: the same token always (the argmax of the processed logits, NaN never, equal: lower id);
//! - seeded sampling: the same token, with one exception: the device's `exp`/`log` may differ from the
//!   host libm's in the last bit, so where the CPU's top-p running sum lands within a few ulp of `top_p`,
//!   a probability within an ulp of the min-p floor or of underflow to 0, or two race keys within an f64
//!   ulp of each other, the cut (and then possibly the token) can differ. Everything else is the CPU's
//!   arithmetic: the edits and `z = l / T` rounded as the CPU rounds them, the same Philox counters, the
//!   top-p sum added in f32 one term at a time in rank order, and the same tie rules;
//! - logprobs within 1e-4 (both sides compute `l - lse` in f32 from an f64 sum), the same top-n ids. A
//!   NaN logit makes every logprob NaN (as on the CPU) and the top-n the lowest ids; a `+inf` logit is
//!   outside the guarantee (the CPU's softmax is NaN there).
//!
//! Cost: one CTA of 1024 threads makes a few dozen passes over the row (L2-resident). Top-p sorts only the
//! candidates its bound admits, so a peaked distribution sorts a handful; a near-flat one (the nucleus most
//! of the vocabulary) sorts and adds up to the whole row in that one CTA, the slow case. Rows of a batch
//! would take one CTA each (later work), and the edits are rebuilt on the host per call.

use std::collections::BTreeMap;

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};

use super::{CudaError, Gpu};
use crate::sampling::{History, PURPOSE_TOKEN, Sampled, SamplingParams};

/// Threads of the one CTA per row; must match `SAMPLE_THREADS` in the kernel.
pub const THREADS: u32 = 1024;
/// The most top logprobs a call returns (`SAMPLE_MAX_TOP`: one per thread in the kernel's final sort).
pub const MAX_TOP_LOGPROBS: u32 = 1024;
/// `out` words: the kernel's `OUT_*` header, then (id, logprob bits) pairs.
const OUT_TOKEN: usize = 0;
const OUT_LOGPROB: usize = 1;
const OUT_KEPT: usize = 2;
const OUT_FLAGS: usize = 3;
const OUT_TOP_COUNT: usize = 4;
const OUT_HEADER: usize = 8;
/// Edit flags (`EDIT_*` in the kernel).
const EDIT_MASK: u32 = 1;
const EDIT_SEEN: u32 = 2;

/// The tokens a request's processing touches, in token order, each with what happens to it in the CPU's
/// order ([`crate::sampling::processed_logits`]): masked (min_tokens), its logit_bias values in request
/// order, the repetition penalty (seen in prompt or output), the frequency/presence penalty (its output
/// count). `words` holds `[token, flags, count, end of its biases]` per token.
#[derive(Debug, Default, PartialEq)]
struct Edits {
    words: Vec<u32>,
    bias: Vec<f32>,
}

#[derive(Default)]
struct Edit {
    flags: u32,
    count: u32,
    bias: Vec<f32>,
}

impl Edits {
    /// The edits of `history` followed by `extra` output tokens still unknown to the host (counted in
    /// min_tokens only: the kernel adds their penalties).
    fn new(vocab: usize, params: &SamplingParams, history: History<'_>, extra: usize, eos: &[u32]) -> Self {
        let mut touched = BTreeMap::<u32, Edit>::new();
        // Ids outside the vocabulary are skipped, as the CPU does.
        fn at(touched: &mut BTreeMap<u32, Edit>, vocab: usize, t: u32) -> Option<&mut Edit> {
            ((t as usize) < vocab).then(|| touched.entry(t).or_default())
        }
        if ((history.output.len() + extra) as u32) < params.min_tokens {
            for &t in eos.iter().chain(&params.stop_token_ids) {
                if let Some(e) = at(&mut touched, vocab, t) {
                    e.flags |= EDIT_MASK;
                }
            }
        }
        for &(t, b) in &params.logit_bias {
            if let Some(e) = at(&mut touched, vocab, t) {
                e.bias.push(b);
            }
        }
        let rep = params.repetition_penalty;
        if rep > 0.0 && rep != 1.0 {
            for &t in history.prompt.iter().chain(history.output) {
                if let Some(e) = at(&mut touched, vocab, t) {
                    e.flags |= EDIT_SEEN;
                }
            }
        }
        if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            for &t in history.output {
                if let Some(e) = at(&mut touched, vocab, t) {
                    e.count += 1;
                }
            }
        }
        let mut out = Edits::default();
        for (t, e) in touched {
            out.bias.extend(&e.bias);
            out.words.extend([t, e.flags, e.count, out.bias.len() as u32]);
        }
        out
    }
}

fn shape(cond: bool, what: impl FnOnce() -> String) -> Result<(), CudaError> {
    if cond { Ok(()) } else { Err(CudaError::Shape(what())) }
}

/// Samples output position `history.output.len()` of one request from one logits row that lives on the
/// device (`row` is a view of `vocab` f32). Same result as [`crate::sampling::sample`] on the same values
/// (the module documentation says exactly what is guaranteed): the same token for greedy and seeded
/// sampling, logprob within 1e-4 absolute, the same top-n ids. `params.logprobs` above
/// [`MAX_TOP_LOGPROBS`] is refused.
pub fn sample_row(
    gpu: &Gpu,
    row: &CudaView<'_, f32>,
    params: &SamplingParams,
    history: History<'_>,
    eos: &[u32],
) -> Result<Sampled, CudaError> {
    Ok(warn_fallback(run(gpu, row, params, history, eos)?))
}

/// One row of [`sample_rows`]: a logits row on the device (`n` f32 at `row`) and its request.
#[derive(Clone, Copy)]
pub struct RowRequest<'a> {
    pub row: u64,
    pub n: usize,
    pub params: &'a SamplingParams,
    pub history: History<'a>,
}

/// [`sample_row`] of several rows in one launch (one CTA per row) and one wait: each row's result is the one
/// `sample_row` gives it alone (a launch of that row only).
pub fn sample_rows(gpu: &Gpu, rows: &[RowRequest<'_>], eos: &[u32]) -> Result<Vec<Sampled>, CudaError> {
    Ok(launch_rows(gpu, rows, eos)?.into_iter().map(warn_fallback).collect())
}

/// The sample, after logging a fallback the kernel reported (diagnostics only: the token is still the CPU's).
pub fn warn_fallback(o: Outcome) -> Sampled {
    if o.flags != 0 {
        tracing::warn!(flags = o.flags, kept = o.kept, "sampler kernel took a fallback path");
    }
    o.sampled
}

/// One slot of a [`Staged`] launch: a row to sample, possibly after a token an earlier launch samples.
#[derive(Clone, Copy)]
pub struct SlotRow<'a> {
    pub req: RowRequest<'a>,
    /// Device address of a `u32` an earlier launch writes (its `token_out`): that token joins `history` as one
    /// more output token (the next output position, penalties, min_tokens), as if the host had pushed it. 0:
    /// none.
    pub prev: u64,
    /// With `prev`: sample only where that token is this one (the MTP draft verified), otherwise write
    /// nothing (its result slot stays unread).
    pub expect: Option<u32>,
    /// Device address where the sampled token is also written (a compact token array), or 0.
    pub token_out: u64,
}

/// The argument records of `tandem_sample_rows` for a list of slots (`None`: a padding record, whose CTA
/// writes nothing), with the device buffers they point into: edits, biases, scratch and results. The
/// records are plain bytes for the caller to upload (a CUDA graph's launch reads them from a fixed address);
/// the buffers live as long as this value.
pub struct Staged {
    /// 144-byte `SampleRowArgs` per slot.
    pub records: Vec<u8>,
    /// Per slot: its index among the results, None for padding.
    slots: Vec<Option<usize>>,
    top_ns: Vec<i32>,
    logprobs: Vec<bool>,
    out: CudaSlice<u32>,
    out_words: usize,
    _keep: Scratch,
}

/// The device buffers a [`Staged`] launch's records point into (besides its results).
struct Scratch {
    _edits: CudaSlice<u32>,
    _bias: CudaSlice<f32>,
    _z: CudaSlice<f32>,
    _prob: CudaSlice<f32>,
    _sort: [CudaSlice<u32>; 2],
}

/// Bytes of one `SampleRowArgs` record.
pub const RECORD_BYTES: usize = 144;

/// Scratch bytes one launch of `rows` rows of `vocab` values may take ([`stage`]: z for every row, three
/// more buffers for rows that are not greedy): the memory budget's share of sampling.
pub fn scratch_bytes(rows: usize, vocab: usize) -> u64 {
    16 * rows as u64 * vocab as u64
}

/// Checks and stages `slots` (see [`Staged`]); `None` entries are padding. The slots are launches of
/// `per_launch` records each, issued in order on the GPU's stream ([`launch_records`]), so the launches share
/// one launch's scratch (z for every row, three more buffers for rows that are not greedy, uninitialized:
/// the kernel writes before it reads); edits, biases and results are per row. Everything on the GPU's stream.
pub fn stage(gpu: &Gpu, slots: &[Option<SlotRow<'_>>], per_launch: usize, eos: &[u32]) -> Result<Staged, CudaError> {
    shape(per_launch > 0 && slots.len().is_multiple_of(per_launch), || {
        format!("{} records in launches of {per_launch}", slots.len())
    })?;
    let rows: Vec<&SlotRow<'_>> = slots.iter().flatten().collect();
    let mut top_ns = Vec::with_capacity(rows.len());
    for r in &rows {
        let r = &r.req;
        shape(r.n > 0 && r.n <= i32::MAX as usize, || format!("a logits row of {} values", r.n))?;
        top_ns.push(match r.params.logprobs {
            None => -1i32,
            Some(k) => {
                shape(k <= MAX_TOP_LOGPROBS, || format!("logprobs {k}: at most {MAX_TOP_LOGPROBS}"))?;
                k as i32
            }
        });
    }
    // Every row's edits in one buffer of words and one of biases (each row's bias ends are relative to its
    // own biases, as the kernel reads them), and scratch for every row (sampling rows: four buffers of n).
    let (mut words, mut bias, mut at) = (Vec::new(), Vec::new(), Vec::with_capacity(rows.len()));
    for r in &rows {
        let extra = usize::from(r.prev != 0);
        let e = Edits::new(r.req.n, r.req.params, r.req.history, extra, eos);
        at.push((words.len(), e.words.len() / 4, bias.len()));
        words.extend(e.words);
        bias.extend(e.bias);
    }
    let st = gpu.stream();
    let dwords = st.clone_htod(if words.is_empty() { &[0u32][..] } else { &words })?;
    let dbias = st.clone_htod(if bias.is_empty() { &[0f32][..] } else { &bias })?;
    // The largest launch's scratch: z for every row, the rest for rows that are not greedy.
    let (mut z_len, mut s_len) = (1usize, 1usize);
    for launch in slots.chunks(per_launch) {
        let rows = launch.iter().flatten();
        z_len = z_len.max(rows.clone().map(|r| r.req.n).sum());
        s_len = s_len.max(rows.filter(|r| !r.req.params.is_greedy()).map(|r| r.req.n).sum());
    }
    // SAFETY (the four allocations): device memory the kernel writes before it reads (z from the row, prob
    // for every value, the sort buffers before each pass reads them); nothing reads it from the host.
    let z = unsafe { st.alloc::<f32>(z_len) }?;
    let prob = unsafe { st.alloc::<f32>(s_len) }?;
    let sort_a = unsafe { st.alloc::<u32>(s_len) }?;
    let sort_b = unsafe { st.alloc::<u32>(s_len) }?;
    // Each result: the kernel's header, then the (id, logprob bits) pairs its row asked for.
    let out_words = OUT_HEADER + 2 * top_ns.iter().copied().max().unwrap_or(0).max(0) as usize;
    let out = st.alloc_zeros::<u32>((out_words * rows.len()).max(1))?;
    let (z0, p0) = (z.device_ptr(st).0, prob.device_ptr(st).0);
    let (a0, b0) = (sort_a.device_ptr(st).0, sort_b.device_ptr(st).0);
    let (w0, bias0, o0) = (dwords.device_ptr(st).0, dbias.device_ptr(st).0, out.device_ptr(st).0);
    // SampleRowArgs: 11 eight-byte words, then 14 four-byte ones (the last the expected token or -1).
    let mut records = Vec::with_capacity(slots.len() * RECORD_BYTES);
    let mut index = Vec::with_capacity(slots.len());
    let (mut z_at, mut s_at, mut i) = (0usize, 0usize, 0usize);
    for (k, slot) in slots.iter().enumerate() {
        if k % per_launch == 0 {
            // A new launch: after the previous one in stream order, so it reuses the scratch.
            (z_at, s_at) = (0, 0);
        }
        let Some(r) = slot else {
            records.resize(records.len() + RECORD_BYTES, 0);
            index.push(None);
            continue;
        };
        let (req, p) = (&r.req, r.req.params);
        let (w_at, n_edits, b_at) = at[i];
        let scratch = if p.is_greedy() { 0 } else { req.n };
        for v in [
            req.row,
            w0 + (4 * w_at) as u64,
            bias0 + (4 * b_at) as u64,
            z0 + (4 * z_at) as u64,
            p0 + (4 * s_at) as u64,
            a0 + (4 * s_at) as u64,
            b0 + (4 * s_at) as u64,
            o0 + (4 * out_words * i) as u64,
            r.prev,
            r.token_out,
            p.seed,
        ] {
            records.extend_from_slice(&v.to_le_bytes());
        }
        for v in [req.n as u32, n_edits as u32] {
            records.extend_from_slice(&v.to_le_bytes());
        }
        for v in [p.repetition_penalty, p.frequency_penalty, p.presence_penalty] {
            records.extend_from_slice(&v.to_le_bytes());
        }
        records.extend_from_slice(&(p.is_greedy() as i32).to_le_bytes());
        records.extend_from_slice(&p.temperature.to_le_bytes());
        records.extend_from_slice(&p.top_k.to_le_bytes());
        records.extend_from_slice(&p.top_p.to_le_bytes());
        records.extend_from_slice(&p.min_p.to_le_bytes());
        let position = req.history.output.len() + usize::from(r.prev != 0);
        records.extend_from_slice(&(position as u32).to_le_bytes());
        records.extend_from_slice(&PURPOSE_TOKEN.to_le_bytes());
        records.extend_from_slice(&top_ns[i].to_le_bytes());
        let expect = match r.expect {
            Some(t) if r.prev != 0 => t as i64,
            _ => -1,
        };
        shape(expect < i32::MAX as i64, || format!("expected token {expect}"))?;
        records.extend_from_slice(&(expect as i32).to_le_bytes());
        index.push(Some(i));
        z_at += req.n;
        s_at += scratch;
        i += 1;
    }
    debug_assert_eq!(records.len(), slots.len() * RECORD_BYTES);
    let logprobs = rows.iter().map(|r| r.req.params.logprobs.is_some()).collect();
    let keep = Scratch { _edits: dwords, _bias: dbias, _z: z, _prob: prob, _sort: [sort_a, sort_b] };
    Ok(Staged { records, slots: index, top_ns, logprobs, out, out_words, _keep: keep })
}

/// Launches `tandem_sample_rows` over `count` records at device address `records` (one CTA each).
pub fn launch_records(gpu: &Gpu, records: u64, count: usize) -> Result<(), CudaError> {
    shape(count <= u32::MAX as usize, || format!("{count} rows"))?;
    super::ops::launch(gpu, "tandem_sample_rows", (count as u32, 1, 1), THREADS, 0, &[super::ops::Arg::P(records)])
}

impl Staged {
    /// Slots staged (padding included).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Slot `i`'s result index, None for padding.
    pub fn result_of(&self, slot: usize) -> Option<usize> {
        self.slots.get(slot).copied().flatten()
    }

    /// The results' words, copied to the host after the launches (waits for the stream).
    pub fn read(&self, gpu: &Gpu) -> Result<Vec<Outcome>, CudaError> {
        let st = gpu.stream();
        let got = st.clone_dtoh(&self.out)?;
        st.synchronize()?;
        Ok(self.parse(&got))
    }

    fn parse(&self, got: &[u32]) -> Vec<Outcome> {
        (0..self.top_ns.len())
            .map(|i| {
                let g = &got[i * self.out_words..(i + 1) * self.out_words];
                let top_count = if self.top_ns[i] < 0 { 0 } else { g[OUT_TOP_COUNT] as usize };
                let top = (0..top_count)
                    .map(|j| (g[OUT_HEADER + 2 * j], f32::from_bits(g[OUT_HEADER + 2 * j + 1])))
                    .collect();
                let logprob = if self.logprobs[i] { f32::from_bits(g[OUT_LOGPROB]) } else { 0.0 };
                Outcome {
                    sampled: Sampled { token: g[OUT_TOKEN], logprob, top },
                    kept: g[OUT_KEPT],
                    flags: g[OUT_FLAGS],
                }
            })
            .collect()
    }
}

/// One launch of `tandem_sample_rows` over `rows`, and what each CTA returned.
fn launch_rows(gpu: &Gpu, rows: &[RowRequest<'_>], eos: &[u32]) -> Result<Vec<Outcome>, CudaError> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let slots: Vec<Option<SlotRow<'_>>> = rows
        .iter()
        .map(|r| {
            Some(SlotRow {
                req: RowRequest { row: r.row, n: r.n, params: r.params, history: r.history },
                prev: 0,
                expect: None,
                token_out: 0,
            })
        })
        .collect();
    let st = gpu.stream();
    let staged = stage(gpu, &slots, slots.len(), eos)?;
    gpu.busy().begin(st);
    let dargs = st.clone_htod(&staged.records)?;
    // SAFETY of the launch (inside launch_records' one unsafe): each record is SampleRowArgs: its row holds n
    // values, its edits and biases are its own slices of the uploaded buffers (tokens below n, bias ends
    // inside its biases), z holds n values and the other scratch n unless greedy, and its out slot the header
    // and the pairs its top_n asks for.
    launch_records(gpu, dargs.device_ptr(st).0, slots.len())?;
    gpu.busy().end(st);
    staged.read(gpu)
}

/// What one launch returns: the sample, how many candidates the race saw (the CPU's
/// `candidates(..).len()`), and the kernel's diagnostic flags (`FLAG_*`: 0 unless a fallback ran).
#[derive(Clone)]
pub struct Outcome {
    pub sampled: Sampled,
    pub kept: u32,
    pub flags: u32,
}

fn run(
    gpu: &Gpu,
    row: &CudaView<'_, f32>,
    params: &SamplingParams,
    history: History<'_>,
    eos: &[u32],
) -> Result<Outcome, CudaError> {
    let req = RowRequest { row: row.device_ptr(gpu.stream()).0, n: row.len(), params, history };
    Ok(launch_rows(gpu, &[req], eos)?.remove(0))
}

/// The MTP draft: argmax (ties: lowest id, NaN never) and its softmax probability (as `CpuBackend::draft`).
pub fn draft_row(gpu: &Gpu, row: &CudaView<'_, f32>) -> Result<(u32, f32), CudaError> {
    let n = row.len();
    shape(n > 0 && n <= i32::MAX as usize, || format!("a logits row of {n} values"))?;
    let (ptr, _sync) = row.device_ptr(gpu.stream());
    Ok(draft_rows(gpu, &[ptr], n)?[0])
}

/// [`draft_row`] of several rows of `n` values each (device addresses), in one launch and one wait.
pub fn draft_rows(gpu: &Gpu, rows: &[u64], n: usize) -> Result<Vec<(u32, f32)>, CudaError> {
    shape(n > 0 && n <= i32::MAX as usize, || format!("logits rows of {n} values"))?;
    shape(rows.len() <= u32::MAX as usize, || format!("{} rows", rows.len()))?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let st = gpu.stream();
    gpu.busy().begin(st);
    let ptrs = st.clone_htod(rows)?;
    let mut out = st.alloc_zeros::<u32>(2 * rows.len())?;
    let f = gpu.function("tandem_draft_rows")?;
    let cfg = LaunchConfig { grid_dim: (rows.len() as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let n_i = n as i32;
    let no_count = 0u64;
    let mut b = st.launch_builder(f);
    b.arg(&ptrs).arg(&n_i).arg(&mut out).arg(&no_count);
    // SAFETY: argument types and order match the kernel; every address holds `n` values (the callers' rows),
    // `out` two words per row.
    gpu.profiler().time(st, "tandem_draft_rows", || unsafe { b.launch(cfg) })?;
    gpu.busy().end(st);
    let got = st.clone_dtoh(&out)?;
    st.synchronize()?;
    Ok(got.chunks_exact(2).map(|w| (w[0], f32::from_bits(w[1]))).collect())
}

#[cfg(test)]
mod tests {
    use cudarc::driver::CudaSlice;
    use rand::RngExt;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::sampling::{argmax, candidates, log_softmax, sample};

    const EOS: &[u32] = &[1, 7];
    const BIG: usize = 129_280;

    /// Rows as a model and the tests' corner cases make them.
    #[derive(Debug, Clone, Copy)]
    enum Style {
        /// Uniform in [-s, s]: s = 0.2 is nearly flat (top-p keeps most of the vocabulary), 12 is peaked.
        Uniform(f32),
        /// Values from a set of four (and -0.0 next to 0.0): ties everywhere.
        FewValues,
        AllEqual,
        /// 30% -inf.
        NegInf,
        /// 5% NaN: every raw logprob is NaN.
        Nan,
        AllNegInf,
        AllNan,
    }

    fn row(rng: &mut ChaCha8Rng, n: usize, style: Style) -> Vec<f32> {
        let u = |rng: &mut ChaCha8Rng, s: f32| (rng.random::<f32>() * 2.0 - 1.0) * s;
        (0..n)
            .map(|_| match style {
                Style::Uniform(s) => u(rng, s),
                Style::FewValues => [0.0f32, -0.0, 0.5, 1.0, 1.5][rng.random_range(0..5)],
                Style::AllEqual => 0.25,
                Style::NegInf => {
                    if rng.random_range(0..10) < 3 {
                        f32::NEG_INFINITY
                    } else {
                        u(rng, 3.0)
                    }
                }
                Style::Nan => {
                    if rng.random_range(0..20) == 0 {
                        f32::NAN
                    } else {
                        u(rng, 3.0)
                    }
                }
                Style::AllNegInf => f32::NEG_INFINITY,
                Style::AllNan => f32::NAN,
            })
            .collect()
    }

    fn base(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, max_tokens: 1000, ..Default::default() }
    }

    /// Every filter alone and together, at a few strengths; logprobs None / 0 / 5 / 20 in turn.
    fn combos() -> Vec<(&'static str, SamplingParams)> {
        let t = base;
        let list = vec![
            ("greedy", SamplingParams::greedy(1000)),
            ("temperature 0.7", t(0.7)),
            ("temperature 1.5", t(1.5)),
            ("top_k 1", SamplingParams { top_k: 1, ..t(1.0) }),
            ("top_k 5", SamplingParams { top_k: 5, ..t(1.0) }),
            ("top_k 50", SamplingParams { top_k: 50, ..t(0.9) }),
            ("top_k 1000", SamplingParams { top_k: 1000, ..t(1.1) }),
            ("top_p 0.5", SamplingParams { top_p: 0.5, ..t(1.0) }),
            ("top_p 0.9", SamplingParams { top_p: 0.9, ..t(0.8) }),
            ("top_p 0.95", SamplingParams { top_p: 0.95, ..t(1.3) }),
            ("min_p 0.05", SamplingParams { min_p: 0.05, ..t(1.0) }),
            ("min_p 0.3", SamplingParams { min_p: 0.3, ..t(0.7) }),
            ("all filters", SamplingParams { top_k: 40, top_p: 0.9, min_p: 0.05, ..t(0.8) }),
            ("all filters, wide", SamplingParams { top_k: 20_000, top_p: 0.97, min_p: 0.001, ..t(1.2) }),
        ];
        let logprobs = [None, Some(0), Some(5), Some(20)];
        list.into_iter()
            .enumerate()
            .map(|(i, (name, p))| (name, SamplingParams { logprobs: logprobs[i % 4], ..p }))
            .collect()
    }

    fn close(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-4
    }

    /// The GPU against [`sample`] on the same values: token, logprob, top-n ids and values, and (with
    /// `kept_too`) the number of candidates the race saw against the CPU's `candidates`.
    fn check(
        gpu: &Gpu,
        dev: &CudaSlice<f32>,
        host: &[f32],
        p: &SamplingParams,
        h: History<'_>,
        kept_too: bool,
        what: &str,
    ) {
        let want = sample(host, p, h, EOS);
        let got = run(gpu, &dev.slice(..), p, h, EOS).unwrap();
        let cpu_kept = || candidates(host, p, h, EOS).len();
        assert_eq!(got.flags, 0, "{what}: fallback flags");
        assert_eq!(got.sampled.token, want.token, "{what}: token (gpu kept {}, cpu kept {})", got.kept, cpu_kept());
        if kept_too {
            assert_eq!(got.kept as usize, cpu_kept(), "{what}: candidates");
        }
        assert!(
            close(got.sampled.logprob, want.logprob),
            "{what}: logprob {} vs {}",
            got.sampled.logprob,
            want.logprob
        );
        let ids = |s: &Sampled| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(&got.sampled), ids(&want), "{what}: top ids");
        for (g, w) in got.sampled.top.iter().zip(&want.top) {
            assert!(close(g.1, w.1), "{what}: top logprob of {}: {} vs {}", g.0, g.1, w.1);
        }
    }

    /// Every combination over `rows`, at several seeds and output positions.
    fn check_rows(gpu: &Gpu, rng: &mut ChaCha8Rng, test_seed: u64, rows: &[(usize, Style)], draws: usize) {
        for &(n, style) in rows {
            let host = row(rng, n, style);
            let dev = gpu.stream().clone_htod(&host).unwrap();
            for (name, p) in combos() {
                for d in 0..draws {
                    let p = SamplingParams { seed: rng.random(), ..p.clone() };
                    let out = vec![3u32; [0, 1, 17, 1000][d % 4]];
                    let h = History { prompt: &[2, 4], output: &out };
                    let what = format!("{name}, vocab {n}, {style:?}, draw {d}, test seed {test_seed}");
                    check(gpu, &dev, &host, &p, h, d == 0, &what);
                }
            }
        }
    }

    #[test]
    fn tokens_and_logprobs_equal_the_cpu_on_random_rows() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let rows = [
            (BIG, Style::Uniform(0.2)),
            (BIG, Style::Uniform(4.0)),
            (BIG, Style::Uniform(12.0)),
            (50, Style::Uniform(1.0)),
            (50, Style::Uniform(3.0)),
            (1000, Style::Uniform(2.0)),
        ];
        check_rows(&gpu, &mut rng, seed, &rows, 6);
    }

    #[test]
    fn rows_with_ties_neg_inf_and_nan_follow_the_cpu() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let mut rows = Vec::new();
        for n in [BIG, 50] {
            for style in [Style::FewValues, Style::AllEqual, Style::NegInf, Style::Nan, Style::AllNegInf, Style::AllNan]
            {
                rows.push((n, style));
            }
        }
        check_rows(&gpu, &mut rng, seed, &rows, 3);
    }

    #[test]
    fn penalties_bias_and_min_tokens_follow_the_cpu() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for n in [BIG, 50] {
            let host = row(&mut rng, n, Style::Uniform(3.0));
            let dev = gpu.stream().clone_htod(&host).unwrap();
            let prompt: Vec<u32> = (0..2000).map(|_| rng.random_range(0..n as u32)).collect();
            // Repeats (frequency counts above 1) and the eos / stop ids themselves.
            let output: Vec<u32> =
                (0..40).map(|i| [1, 3, 7, 11, i % 9, rng.random_range(0..n as u32)][i as usize % 6]).collect();
            let hot =
                (host.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })).0 as u32;
            let bias =
                vec![(5, 2.5), (5, -1.0), (9, 100.0), (12 % n as u32, -100.0), (hot, -7.5), (n as u32 + 3, 50.0)];
            let processing = [
                SamplingParams { repetition_penalty: 1.3, ..Default::default() },
                SamplingParams { repetition_penalty: 0.7, ..Default::default() },
                SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() },
                SamplingParams { presence_penalty: -1.5, frequency_penalty: -0.4, ..Default::default() },
                SamplingParams { logit_bias: bias.clone(), ..Default::default() },
                SamplingParams { min_tokens: 60, stop_token_ids: vec![3, 11], ..Default::default() },
                SamplingParams { min_tokens: 30, stop_token_ids: vec![3, 11], ..Default::default() },
                SamplingParams {
                    repetition_penalty: 1.2,
                    presence_penalty: 0.3,
                    frequency_penalty: 0.6,
                    logit_bias: bias.clone(),
                    min_tokens: 100,
                    stop_token_ids: vec![hot],
                    ..Default::default()
                },
            ];
            for (i, proc_) in processing.iter().enumerate() {
                for (name, filters) in combos() {
                    let p = SamplingParams {
                        temperature: filters.temperature,
                        top_k: filters.top_k,
                        top_p: filters.top_p,
                        min_p: filters.min_p,
                        logprobs: filters.logprobs,
                        seed: rng.random(),
                        max_tokens: 1000,
                        ..proc_.clone()
                    };
                    for len in [0, 1, 40] {
                        let h = History { prompt: &prompt, output: &output[..len] };
                        let what = format!("processing {i}, {name}, vocab {n}, output {len}, test seed {seed}");
                        check(&gpu, &dev, &host, &p, h, true, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn many_seeds_and_positions_draw_the_cpus_token() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let host = row(&mut rng, 50, Style::Uniform(1.5));
        let dev = gpu.stream().clone_htod(&host).unwrap();
        let out = vec![0u32; 300];
        for params in [base(1.0), SamplingParams { top_k: 10, top_p: 0.8, min_p: 0.02, ..base(0.9) }] {
            let mut seen = std::collections::HashSet::new();
            for pos in 0..300 {
                let p = SamplingParams { seed: u64::MAX - pos as u64 * 0x9E37_79B9_7F4A_7C15, ..params.clone() };
                let h = History { prompt: &[], output: &out[..pos] };
                let want = sample(&host, &p, h, EOS).token;
                let got = sample_row(&gpu, &dev.slice(..), &p, h, EOS).unwrap().token;
                assert_eq!(got, want, "position {pos}, seed {:#x}, test seed {seed}", p.seed);
                seen.insert(got);
            }
            assert!(seen.len() > 5, "draws vary with seed and position");
        }
    }

    #[test]
    fn top_logprobs_up_to_the_limit_are_ranked_as_on_the_cpu() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for (n, style) in
            [(BIG, Style::FewValues), (BIG, Style::Uniform(5.0)), (700, Style::Uniform(1.0)), (3, Style::FewValues)]
        {
            let host = row(&mut rng, n, style);
            let dev = gpu.stream().clone_htod(&host).unwrap();
            for k in [1, 2, 64, 1000, MAX_TOP_LOGPROBS] {
                let p = SamplingParams { logprobs: Some(k), ..SamplingParams::greedy(4) };
                check(
                    &gpu,
                    &dev,
                    &host,
                    &p,
                    History { prompt: &[], output: &[] },
                    true,
                    &format!("top {k}, vocab {n}, {style:?}, test seed {seed}"),
                );
            }
        }
    }

    #[test]
    fn results_depend_only_on_the_rows_values() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, _) = crate::cpu::test_support::rng();
        let host = row(&mut rng, BIG, Style::Uniform(0.5));
        // The row at three places of one buffer, after other rows' garbage.
        let mut buf = row(&mut rng, 3 * BIG + 1000, Style::Uniform(9.0));
        for at in [0, BIG + 7, 2 * BIG + 1000] {
            buf[at..at + BIG].copy_from_slice(&host);
        }
        let dev = gpu.stream().clone_htod(&buf).unwrap();
        let p = SamplingParams { top_p: 0.93, min_p: 0.0001, logprobs: Some(20), seed: 77, ..base(1.1) };
        let bits =
            |s: Sampled| (s.token, s.logprob.to_bits(), s.top.iter().map(|t| (t.0, t.1.to_bits())).collect::<Vec<_>>());
        let mut first = None;
        for at in [0, BIG + 7, 2 * BIG + 1000, 0] {
            let view = dev.slice(at..at + BIG);
            let got = bits(sample_row(&gpu, &view, &p, History { prompt: &[], output: &[5] }, EOS).unwrap());
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(&got, f, "row at {at}"),
            }
        }
    }

    /// Rows sampled in one launch (every filter combination with seeds, penalties, biases, min_tokens and
    /// logprobs; rows of two widths; one row twice) give each row's `sample_row` result bit for bit.
    #[test]
    fn rows_sampled_in_one_launch_are_each_rows_sample() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let mut params: Vec<SamplingParams> = combos().into_iter().map(|(_, p)| p).collect();
        params.push(SamplingParams {
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            frequency_penalty: 0.6,
            logit_bias: vec![(5, 2.5), (5, -1.0), (9, 100.0)],
            min_tokens: 100,
            stop_token_ids: vec![3, 11],
            logprobs: Some(7),
            ..base(0.9)
        });
        for (i, p) in params.iter_mut().enumerate() {
            p.seed = seed ^ i as u64;
        }
        let widths: Vec<usize> = (0..params.len()).map(|i| if i % 3 == 2 { 50 } else { BIG }).collect();
        let hosts: Vec<Vec<f32>> = widths.iter().map(|&n| row(&mut rng, n, Style::Uniform(4.0))).collect();
        let devs: Vec<CudaSlice<f32>> = hosts.iter().map(|h| gpu.stream().clone_htod(h).unwrap()).collect();
        let prompt: Vec<u32> = (0..300).map(|_| rng.random_range(0..50)).collect();
        let output: Vec<u32> = (0..12).map(|i| [1, 3, 7, 11, 5, 9][i % 6]).collect();
        let h = History { prompt: &prompt, output: &output };
        let mut order: Vec<usize> = (0..params.len()).collect();
        order.push(1);
        let reqs: Vec<RowRequest<'_>> = order
            .iter()
            .map(|&i| RowRequest {
                row: devs[i].device_ptr(gpu.stream()).0,
                n: widths[i],
                params: &params[i],
                history: h,
            })
            .collect();
        let got = sample_rows(&gpu, &reqs, EOS).unwrap();
        assert_eq!(got.len(), order.len());
        let bits = |s: &Sampled| {
            (s.token, s.logprob.to_bits(), s.top.iter().map(|t| (t.0, t.1.to_bits())).collect::<Vec<_>>())
        };
        for (&i, g) in order.iter().zip(&got) {
            let want = sample_row(&gpu, &devs[i].slice(..), &params[i], h, EOS).unwrap();
            assert_eq!(bits(g), bits(&want), "row {i} ({:?}), seed {seed}", params[i]);
        }
        assert!(sample_rows(&gpu, &[], EOS).unwrap().is_empty());
        let too_many = SamplingParams { logprobs: Some(MAX_TOP_LOGPROBS + 1), ..base(1.0) };
        let bad = [RowRequest { row: reqs[0].row, n: BIG, params: &too_many, history: h }];
        assert!(sample_rows(&gpu, &bad, EOS).unwrap_err().to_string().contains("logprobs"));
    }

    /// A row sampled after a token an earlier launch wrote on the device (`prev`) is the CPU's sample with
    /// that token pushed onto the history: penalties on a token seen before and on a new one, min_tokens
    /// ending at that token, every filter; a second launch over the same scratch gives the same results; a
    /// rejected draft's record and a record of no row write nothing.
    #[test]
    fn a_row_after_a_device_token_is_the_cpus_sample_with_that_token_in_the_history() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let n = 300;
        let host = row(&mut rng, n, Style::Uniform(3.0));
        let dev = gpu.stream().clone_htod(&host).unwrap();
        let st = gpu.stream();
        let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(0..n as u32)).collect();
        let output = vec![5u32, 9, 5, 200];
        let mut params: Vec<SamplingParams> = combos().into_iter().map(|(_, p)| p).collect();
        for (rep, freq, pres, min_tokens) in
            [(1.3, 0.0, 0.0, 0), (1.0, 0.7, 0.2, 0), (0.8, -0.4, 0.5, 5), (1.2, 0.5, 0.0, 6), (1.0, 0.0, 0.0, 5)]
        {
            params.push(SamplingParams {
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
                min_tokens,
                stop_token_ids: vec![3],
                logit_bias: vec![(9, 1.5), (77, -2.0)],
                logprobs: Some(3),
                ..base(0.8)
            });
            params.push(SamplingParams {
                repetition_penalty: rep,
                frequency_penalty: freq,
                presence_penalty: pres,
                ..SamplingParams::greedy(100)
            });
        }
        // Earlier tokens: one the history holds (5), one only the prompt may hold, one nothing touched, EOS.
        let prevs = [5u32, prompt[3], 250, EOS[0], 9];
        for (k, &t) in prevs.iter().enumerate() {
            let dprev = st.clone_htod(&[t]).unwrap();
            let dtok = st.alloc_zeros::<u32>(params.len() + 1).unwrap();
            let (pp, tp) = (dprev.device_ptr(st).0, dtok.device_ptr(st).0);
            let h = History { prompt: &prompt, output: &output };
            let mut slots: Vec<Option<SlotRow<'_>>> = vec![None];
            for (i, p) in params.iter().enumerate() {
                let req = RowRequest { row: dev.device_ptr(st).0, n, params: p, history: h };
                slots.push(Some(SlotRow { req, prev: pp, expect: None, token_out: tp + 4 * (i as u64 + 1) }));
            }
            slots.push(None);
            // Two launches sharing one launch's scratch: the rows, then the same rows in reverse order (each at
            // other scratch offsets, over what the first launch left there).
            let both: Vec<Option<SlotRow<'_>>> = slots.iter().chain(slots.iter().rev()).copied().collect();
            let staged = stage(&gpu, &both, slots.len(), EOS).unwrap();
            let records = st.clone_htod(&staged.records).unwrap();
            let at = records.device_ptr(st).0;
            launch_records(&gpu, at, slots.len()).unwrap();
            launch_records(&gpu, at + (slots.len() * RECORD_BYTES) as u64, slots.len()).unwrap();
            let all = staged.read(&gpu).unwrap();
            let tokens = st.clone_dtoh(&dtok).unwrap();
            assert_eq!(all.len(), 2 * params.len());
            assert_eq!((staged.result_of(0), staged.result_of(1)), (None, Some(0)));
            let (got, again) = all.split_at(params.len());
            for (a, b) in got.iter().zip(again.iter().rev()) {
                assert_eq!(
                    (a.sampled.token, a.sampled.logprob.to_bits()),
                    (b.sampled.token, b.sampled.logprob.to_bits()),
                    "the second launch (the same scratch) differs, test seed {seed}"
                );
            }
            let pushed: Vec<u32> = output.iter().copied().chain([t]).collect();
            for (i, p) in params.iter().enumerate() {
                let want = sample(&host, p, History { prompt: &prompt, output: &pushed }, EOS);
                let g = &got[i].sampled;
                let what = format!("prev {t} (case {k}), params {i} {p:?}, test seed {seed}");
                assert_eq!(g.token, want.token, "{what}");
                assert_eq!(tokens[i + 1], want.token, "{what}: token_out");
                assert!(close(g.logprob, want.logprob), "{what}: logprob {} vs {}", g.logprob, want.logprob);
                assert_eq!(
                    g.top.iter().map(|x| x.0).collect::<Vec<_>>(),
                    want.top.iter().map(|x| x.0).collect::<Vec<_>>(),
                    "{what}: top ids"
                );
            }
        }
        // With an expected token: sampled where the earlier token is it, nothing written where it is not; a
        // record of no row (n = 0, a graph's padding) writes nothing either, whatever its pointers.
        let dprev = st.clone_htod(&[9u32]).unwrap();
        let dtok = st.clone_htod(&[77u32, 77, 77]).unwrap();
        let (pp, tp) = (dprev.device_ptr(st).0, dtok.device_ptr(st).0);
        let p = SamplingParams::greedy(10);
        let req =
            || RowRequest { row: dev.device_ptr(st).0, n, params: &p, history: History { prompt: &[], output: &[] } };
        let slots = [
            Some(SlotRow { req: req(), prev: pp, expect: Some(9), token_out: tp }),
            Some(SlotRow { req: req(), prev: pp, expect: Some(10), token_out: tp + 4 }),
            Some(SlotRow { req: req(), prev: 0, expect: None, token_out: tp + 8 }),
        ];
        let staged = stage(&gpu, &slots, 3, EOS).unwrap();
        let mut bytes = staged.records.clone();
        // The third record's n (after eleven 8-byte words) set to 0.
        bytes[2 * RECORD_BYTES + 88..2 * RECORD_BYTES + 92].copy_from_slice(&0u32.to_le_bytes());
        let records = st.clone_htod(&bytes).unwrap();
        launch_records(&gpu, records.device_ptr(st).0, 3).unwrap();
        let got = staged.read(&gpu).unwrap();
        let tokens = st.clone_dtoh(&dtok).unwrap();
        let want = sample(&host, &p, History { prompt: &[], output: &[9] }, EOS).token;
        assert_eq!((got[0].sampled.token, tokens[0]), (want, want), "the expected token: sampled");
        assert_eq!(tokens[1], 77, "another token: nothing written");
        assert_eq!(tokens[2], 77, "a record of no row wrote");
    }

    /// Several rows' drafts in one launch (rows in any order of one buffer, one repeated) are each row's
    /// draft alone.
    #[test]
    fn drafts_of_many_rows_in_one_launch_are_each_rows_draft() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        let styles =
            [Style::Uniform(4.0), Style::FewValues, Style::NegInf, Style::Nan, Style::AllNegInf, Style::Uniform(0.2)];
        let host: Vec<f32> = styles.iter().flat_map(|&st| row(&mut rng, BIG, st)).collect();
        let dev = gpu.stream().clone_htod(&host).unwrap();
        let (base_ptr, _sync) = dev.device_ptr(gpu.stream());
        let order = [3usize, 0, 5, 1, 1, 4, 2];
        let ptrs: Vec<u64> = order.iter().map(|&i| base_ptr + (i * BIG * 4) as u64).collect();
        let got = draft_rows(&gpu, &ptrs, BIG).unwrap();
        assert_eq!(got.len(), order.len());
        for (&i, (token, prob)) in order.iter().zip(got) {
            let (want_t, want_p) = draft_row(&gpu, &dev.slice(i * BIG..(i + 1) * BIG)).unwrap();
            assert_eq!(token, want_t, "row {i} ({:?}), seed {seed}", styles[i]);
            assert_eq!(prob.to_bits(), want_p.to_bits(), "row {i} ({:?}), seed {seed}", styles[i]);
        }
        assert!(draft_rows(&gpu, &[], BIG).unwrap().is_empty());
        assert!(draft_rows(&gpu, &ptrs, 0).is_err());
    }

    #[test]
    fn the_draft_is_the_cpu_draft() {
        let Some(gpu) = Gpu::for_test() else { return };
        let (mut rng, seed) = crate::cpu::test_support::rng();
        for n in [BIG, 50, 1] {
            for style in
                [Style::Uniform(4.0), Style::FewValues, Style::NegInf, Style::Nan, Style::AllNegInf, Style::AllNan]
            {
                let host = row(&mut rng, n, style);
                let dev = gpu.stream().clone_htod(&host).unwrap();
                let (token, prob) = draft_row(&gpu, &dev.slice(..)).unwrap();
                let want = argmax(&host);
                let want_prob = log_softmax(&host)[want as usize].exp();
                assert_eq!(token, want, "vocab {n}, {style:?}, test seed {seed}");
                assert!(
                    close(prob, want_prob) && (prob - want_prob).abs() <= 1e-6 || prob.is_nan() && want_prob.is_nan(),
                    "vocab {n}, {style:?}: {prob} vs {want_prob}"
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_before_launch() {
        let Some(gpu) = Gpu::for_test() else { return };
        let dev = gpu.stream().clone_htod(&[0.5f32, 1.0]).unwrap();
        let h = History { prompt: &[], output: &[] };
        let e = sample_row(&gpu, &dev.slice(0..0), &base(1.0), h, EOS).unwrap_err().to_string();
        assert!(e.contains("0 values"), "{e}");
        let p = SamplingParams { logprobs: Some(MAX_TOP_LOGPROBS + 1), ..base(1.0) };
        let e = sample_row(&gpu, &dev.slice(..), &p, h, EOS).unwrap_err().to_string();
        assert!(e.contains("logprobs"), "{e}");
        assert!(draft_row(&gpu, &dev.slice(1..1)).is_err());
    }

    #[test]
    fn edits_group_biases_in_request_order_and_skip_ids_outside_the_vocabulary() {
        let p = SamplingParams {
            logit_bias: vec![(9, 1.0), (4, 2.0), (9, -3.0), (50, 1.0)],
            repetition_penalty: 1.5,
            frequency_penalty: 0.5,
            min_tokens: 4,
            stop_token_ids: vec![4, 60],
            ..base(1.0)
        };
        let e = Edits::new(10, &p, History { prompt: &[2, 70], output: &[2, 9, 2] }, 0, &[1]);
        let want_words = vec![
            1, EDIT_MASK, 0, 0, // eos, masked (3 outputs < min_tokens 4)
            2, EDIT_SEEN, 2, 0, // seen, twice in the output
            4, EDIT_MASK, 0, 1, // a stop id with one bias
            9, EDIT_SEEN, 1, 3, // two biases in request order, seen once
        ];
        assert_eq!(e, Edits { words: want_words, bias: vec![2.0, 1.0, -3.0] });
        // Neutral parameters touch nothing.
        assert_eq!(Edits::new(10, &base(1.0), History { prompt: &[1, 2], output: &[3] }, 0, &[1]), Edits::default());
    }
}
