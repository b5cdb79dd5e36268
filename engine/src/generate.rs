//! A request's life on a backend, shared by `tandem generate` and the workers so that a disaggregated
//! cluster computes exactly what one process does: (chunked) prefill, the first token, the MTP draft,
//! then decode steps that verify the draft.
//!
//! Invariants of a [`SeqState`] between calls: the main model's caches hold positions `0..fed`; once the
//! prompt is prefilled, `tokens` holds exactly one more token than `fed` (the last sampled one, not yet
//! fed); the MTP layer's caches hold the same positions as the main model's. A draft, when present, is
//! the MTP's guess for the token after the pending one.
//!
//! Drafts are the MTP's argmax. Verification samples the target distribution at the draft's position with
//! that position's own RNG draw (keyed by seed and output position, exactly as without speculation) and
//! accepts the draft when the sample equals it. The draft is accepted with probability p(draft), as in
//! rejection sampling with a point-mass draft, the emitted tokens follow the target distribution exactly,
//! and they are the very tokens non-speculative decoding emits for the same seed, whatever the schedule
//! (batching, preemption, which worker decodes).

//!
//! Logits and hidden states stay in the backend ([`crate::DeviceRows`]): this module asks the backend to
//! sample and to draft, and gets back tokens and requested logprobs only.

use crate::backend::{
    AttnForm, Backend, DeviceRows, EngineError, LayerDone, Logits, MtpInput, SampleRequest, SeqInput, SeqOutput,
    StepInput, StepSamples,
};
use crate::cache::{BlockId, KvCache, LayerIdx};
use crate::sampling::{self, Finish, History, Sampled, SamplingParams};

/// One request's state.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Leading tokens that are prompt (penalties and output positions count from here).
    pub prompt_len: usize,
    /// Tokens to prefill: the prompt, or prompt + tokens generated before a preemption.
    pub prefill_len: usize,
    /// Prompt tokens, then generated tokens.
    pub tokens: Vec<u32>,
    /// Positions whose caches (main and MTP) are written.
    pub fed: usize,
    /// The MTP's guess for the token after the pending one.
    pub draft: Option<u32>,
    /// The draft's probability under the MTP head (diagnostics; verification uses the point mass).
    pub draft_prob: f32,
    pub blocks: Vec<BlockId>,
    pub params: SamplingParams,
    pub finished: Option<Finish>,
    pub drafts_proposed: u32,
    pub drafts_accepted: u32,
    /// Use MTP drafts (when the model has an MTP layer).
    pub speculate: bool,
}

/// What one call produced for a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    pub tokens: Vec<Sampled>,
    pub finished: Option<Finish>,
}

impl SeqState {
    /// A request whose first `cached` prompt positions are already in `blocks` (prefix cache), or 0.
    pub fn new(prompt: Vec<u32>, params: SamplingParams, blocks: Vec<BlockId>, cached: usize) -> Self {
        SeqState {
            prompt_len: prompt.len(),
            prefill_len: prompt.len(),
            tokens: prompt,
            fed: cached,
            draft: None,
            draft_prob: 0.0,
            blocks,
            params,
            finished: None,
            drafts_proposed: 0,
            drafts_accepted: 0,
            speculate: true,
        }
    }

    /// A request whose `tokens` continue after `prompt_len` prompt tokens with output generated earlier
    /// (re-prefill after a preemption): all of `tokens` is prefilled, and the next sample is output
    /// position `tokens.len() - prompt_len`.
    pub fn continuing(tokens: Vec<u32>, prompt_len: usize, params: SamplingParams, blocks: Vec<BlockId>) -> Self {
        let mut s = SeqState::new(tokens, params, blocks, 0);
        s.prompt_len = prompt_len.min(s.tokens.len());
        s
    }

    /// A request continuing on a decode worker after a remote prefill: `prefilled` (of which the first
    /// `prompt_len` are prompt) is in the cache and `first`, sampled by the prefill worker, is pending,
    /// with the MTP draft if there is one.
    pub fn resume(
        prefilled: Vec<u32>,
        prompt_len: usize,
        first: u32,
        draft: Option<u32>,
        params: SamplingParams,
        blocks: Vec<BlockId>,
    ) -> Self {
        let prefill_len = prefilled.len();
        let mut s = SeqState::new(prefilled, params, blocks, prefill_len);
        s.tokens.push(first);
        s.prompt_len = prompt_len.min(prefill_len);
        s.draft = draft;
        s
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len.min(self.tokens.len())..]
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    /// The most tokens the next [`prefill`] call takes from this sequence: a chunk never straddles the end
    /// of the prompt, since a continuation's generated tokens are computed in the decode form.
    pub fn prefill_chunk_max(&self) -> usize {
        let end = if self.fed < self.prompt_len { self.prompt_len } else { self.prefill_len };
        end.saturating_sub(self.fed)
    }

    pub fn prefill_done(&self) -> bool {
        self.fed >= self.prefill_len
    }

    /// Cache positions the next decode step writes up to (exclusive): the pending token and the draft.
    pub fn positions_needed(&self) -> usize {
        self.fed + 1 + usize::from(self.draft.is_some())
    }
}

/// Samples row `row` of the logits of each sequence `idx[j]` (its next output position), in one backend call.
fn sample_rows(
    backend: &dyn Backend,
    seqs: &[&mut SeqState],
    outs: &[SeqOutput],
    idx: &[usize],
    row: usize,
    eos: &[u32],
) -> Result<Vec<Sampled>, EngineError> {
    let reqs: Vec<SampleRequest<'_>> = idx
        .iter()
        .map(|&i| SampleRequest { logits: &outs[i].logits, row, params: &seqs[i].params, history: history(seqs[i]) })
        .collect();
    backend.sample_rows(&reqs, eos)
}

fn history(s: &SeqState) -> History<'_> {
    History { prompt: s.prompt(), output: s.generated() }
}

/// Samples output token number `generated().len()` from row `row` of `logits`, appends it, checks stop
/// conditions.
fn take(
    backend: &dyn Backend,
    s: &mut SeqState,
    logits: &DeviceRows,
    row: usize,
    eos: &[u32],
) -> Result<Sampled, EngineError> {
    let t = backend.sample(logits, row, &s.params, history(s), eos)?;
    push(s, t.clone(), eos);
    Ok(t)
}

fn push(s: &mut SeqState, t: Sampled, eos: &[u32]) {
    s.tokens.push(t.token);
    let count = s.generated().len() as u32;
    s.finished = sampling::finish_reason(t.token, count, &s.params, eos);
}

/// Verifies `draft` given the pending position's own sample `t` from the target logits (the same draw as
/// without speculation): the token to emit is `t`, and the draft is accepted when it equals it.
fn verify(t: Sampled, draft: u32) -> (Sampled, bool) {
    let accepted = t.token == draft;
    (t, accepted)
}

/// Prefills the next chunk of every sequence's prompt in one batch, at most `chunks[i]` tokens for
/// sequence `i` (a token budget split by the caller; see [`SeqState::prefill_chunk_max`]). Sequences whose prompt completes sample their first
/// token (returned) and get an MTP draft. `on_layer` hears of each cache layer as it completes for the
/// whole batch (main layers, then the MTP layer).
///
/// A continuation ([`SeqState::continuing`]) computes its prompt positions in the prefill form and
/// replays the tokens generated before the preemption in the decode form, as the uninterrupted run
/// computed them (a chunk never straddles the two). The decode form is batch- and chunk-invariant, so the
/// caches and the next sample are bit-identical to a run that was never preempted, in FP8 as in f32
/// (re-prefilling generated tokens in the prefill form would differ by rounding: an e4m3 step in FP8).
pub fn prefill(
    backend: &dyn Backend,
    cache: &KvCache,
    seqs: &mut [&mut SeqState],
    chunks: &[usize],
    on_layer: LayerDone<'_>,
) -> Result<Vec<StepOutput>, EngineError> {
    if chunks.len() != seqs.len() {
        return Err(EngineError::InvalidInput(format!("{} chunk sizes for {} sequences", chunks.len(), seqs.len())));
    }
    let eos = backend.config().eos_token_ids.clone();
    let ranges: Vec<(usize, usize)> =
        seqs.iter().zip(chunks).map(|(s, &c)| (s.fed, s.fed + c.max(1).min(s.prefill_chunk_max()))).collect();
    if let Some((i, _)) = ranges.iter().enumerate().find(|(_, (a, b))| a >= b) {
        return Err(EngineError::InvalidInput(format!("sequence {i} has no prompt left to prefill")));
    }
    let replay: Vec<bool> = seqs.iter().zip(&ranges).map(|(s, &(a, _))| a >= s.prompt_len).collect();
    fn input(s: &SeqState, (a, b): (usize, usize)) -> SeqInput<'_> {
        SeqInput {
            tokens: &s.tokens[a..b],
            start: a,
            blocks: &s.blocks,
            logits: if b == s.prefill_len { Logits::Last } else { Logits::None },
        }
    }
    let pick = |want: bool| -> Vec<SeqInput<'_>> {
        seqs.iter().zip(&ranges).zip(&replay).filter(|(_, r)| **r == want).map(|((s, &rg), _)| input(s, rg)).collect()
    };
    let (replay_in, prefill_in) = (pick(true), pick(false));
    // Under expert parallelism the step's shape is agreed first (the MTP layer runs over at most the same
    // positions).
    let rows = |v: &[SeqInput<'_>]| v.iter().map(|s| s.tokens.len()).sum::<usize>();
    let (replay_rows, prefill_rows) = (rows(&replay_in), rows(&prefill_in));
    backend.begin_step([replay_rows, prefill_rows, replay_rows + prefill_rows])?;
    // Replays first: when the prefill form announces a layer, the whole batch has written it.
    let mut replayed = backend.decode(cache, &replay_in)?.into_iter();
    let mut prefilled = if prefill_in.is_empty() {
        let ready = backend.fence();
        for l in 0..backend.config().num_hidden_layers {
            on_layer(LayerIdx(l as u32), ready.clone());
        }
        Vec::new().into_iter()
    } else {
        backend.prefill(cache, &prefill_in, on_layer)?.into_iter()
    };
    drop((replay_in, prefill_in));
    let outs: Vec<SeqOutput> = replay
        .iter()
        .map(|&r| if r { replayed.next() } else { prefilled.next() })
        .collect::<Option<_>>()
        .ok_or_else(|| EngineError::InvalidInput("backend returned fewer outputs than sequences".into()))?;
    let mut results = vec![StepOutput::default(); seqs.len()];
    for ((s, out), (res, &(_, b))) in seqs.iter_mut().zip(&outs).zip(results.iter_mut().zip(&ranges)) {
        if b == s.prefill_len {
            res.tokens.push(take(backend, s, &out.logits, 0, &eos)?);
            res.finished = s.finished;
        }
    }
    run_mtp(backend, cache, seqs, &ranges, &outs, AttnForm::Prefill, on_layer)?;
    for (s, &(_, b)) in seqs.iter_mut().zip(&ranges) {
        s.fed = b;
    }
    Ok(results)
}

/// The MTP layer over positions `ranges[i]` of each sequence (hidden states from `outs`), writing its
/// caches; sequences whose next token is known at the range end get a new draft.
fn run_mtp(
    backend: &dyn Backend,
    cache: &KvCache,
    seqs: &mut [&mut SeqState],
    ranges: &[(usize, usize)],
    outs: &[SeqOutput],
    form: AttnForm,
    on_layer: LayerDone<'_>,
) -> Result<(), EngineError> {
    if !backend.has_mtp() {
        return Ok(());
    }
    // MTP position p needs the token at p + 1, known for every position of a range once its last token is
    // sampled; finished sequences need no more MTP caches.
    let mut idx = Vec::new();
    let mut inputs = Vec::new();
    for (i, (s, &(a, b))) in seqs.iter().zip(ranges).enumerate() {
        if s.tokens.len() <= b || s.finished.is_some() {
            continue;
        }
        idx.push(i);
        inputs.push(MtpInput {
            next_tokens: &s.tokens[a + 1..=b],
            hidden: &outs[i].hidden,
            start: a,
            blocks: &s.blocks,
            logits: Logits::Last,
        });
    }
    if inputs.is_empty() {
        return Ok(());
    }
    let mtp_out = backend.mtp(cache, &inputs, form, on_layer)?;
    drop(inputs);
    // A draft only where the range ends at the pending token (the prompt is done) and drafts are used; all of
    // the step's drafts in one call.
    let wants: Vec<bool> = idx.iter().map(|&i| ranges[i].1 + 1 == seqs[i].tokens.len() && seqs[i].speculate).collect();
    let rows: Vec<(&DeviceRows, usize)> =
        mtp_out.iter().zip(&wants).filter(|(_, w)| **w).map(|(out, _)| (&out.logits, 0)).collect();
    let mut drafts = backend.draft_rows(&rows)?.into_iter();
    for (&i, want) in idx.iter().zip(wants) {
        let s = &mut seqs[i];
        s.draft = None;
        if want {
            let (d, p) = drafts.next().ok_or_else(|| EngineError::Device("a draft per row was not returned".into()))?;
            s.draft = Some(d);
            s.draft_prob = p;
        }
    }
    Ok(())
}

/// One decode step for every sequence: feeds the pending token (and the draft), verifies, samples, and
/// runs the MTP layer for the next draft. Sequences must have room for `positions_needed()` positions.
pub fn decode_step(
    backend: &dyn Backend,
    cache: &KvCache,
    seqs: &mut [&mut SeqState],
) -> Result<Vec<StepOutput>, EngineError> {
    let eos = backend.config().eos_token_ids.clone();
    for (i, s) in seqs.iter().enumerate() {
        if !s.prefill_done() || s.tokens.len() != s.fed + 1 || s.finished.is_some() {
            return Err(EngineError::InvalidInput(format!("sequence {i} is not ready to decode")));
        }
    }
    let drafts: Vec<Option<u32>> =
        seqs.iter().map(|s| if s.speculate && backend.has_mtp() { s.draft } else { None }).collect();
    let fed_tokens: Vec<Vec<u32>> =
        seqs.iter().zip(&drafts).map(|(s, d)| std::iter::once(s.tokens[s.fed]).chain(*d).collect()).collect();
    let whole: Vec<StepInput<'_>> = seqs
        .iter()
        .zip(&fed_tokens)
        .map(|(s, t)| StepInput { tokens: t, start: s.fed, blocks: &s.blocks, params: &s.params, history: history(s) })
        .collect();
    if let Some(samples) = backend.decode_whole_step(cache, &whole, &eos)? {
        drop(whole);
        return apply_whole_step(backend, seqs, &drafts, samples, &eos);
    }
    drop(whole);
    let inputs: Vec<SeqInput<'_>> = seqs
        .iter()
        .zip(&fed_tokens)
        .map(|(s, t)| SeqInput { tokens: t, start: s.fed, blocks: &s.blocks, logits: Logits::All })
        .collect();
    // Under expert parallelism the step's shape is agreed first: the MTP layer runs over at most the fed
    // positions.
    let rows: usize = fed_tokens.iter().map(Vec::len).sum();
    backend.begin_step([rows, 0, rows])?;
    let outs = backend.decode(cache, &inputs)?;
    drop(inputs);
    // Every sequence's pending position from its row 0, in one call (a sequence's sample depends on its own
    // history only, so the order across sequences changes nothing).
    let firsts = sample_rows(backend, seqs, &outs, &(0..seqs.len()).collect::<Vec<_>>(), 0, &eos)?;
    let mut results = vec![StepOutput::default(); seqs.len()];
    let mut fed = vec![1usize; seqs.len()];
    let mut seconds = Vec::new();
    for (i, ((s, t), draft)) in seqs.iter_mut().zip(firsts).zip(&drafts).enumerate() {
        match draft {
            Some(d) => {
                s.drafts_proposed += 1;
                let (tok, accepted) = verify(t, *d);
                push(s, tok.clone(), &eos);
                results[i].tokens.push(tok);
                if accepted {
                    s.drafts_accepted += 1;
                    fed[i] = 2;
                    if s.finished.is_none() {
                        seconds.push(i);
                    }
                }
            }
            None => {
                push(s, t.clone(), &eos);
                results[i].tokens.push(t);
            }
        }
    }
    // Accepted drafts: the next position from row 1, its history holding the accepted token.
    for (&i, t) in seconds.iter().zip(sample_rows(backend, seqs, &outs, &seconds, 1, &eos)?) {
        push(seqs[i], t.clone(), &eos);
        results[i].tokens.push(t);
    }
    let mut ranges = Vec::with_capacity(seqs.len());
    for ((s, res), fed) in seqs.iter_mut().zip(results.iter_mut()).zip(fed) {
        res.finished = s.finished;
        s.draft = None;
        ranges.push((s.fed, s.fed + fed));
    }
    run_mtp(backend, cache, seqs, &ranges, &outs, AttnForm::Decode, &mut |_, _| {})?;
    for (s, &(_, b)) in seqs.iter_mut().zip(&ranges) {
        s.fed = b;
    }
    Ok(results)
}

/// [`decode_step`]'s bookkeeping over what [`Backend::decode_whole_step`] computed: the same verification,
/// tokens, drafts and positions as the separate calls give (the second sample is kept only where the draft
/// was accepted and the first token did not finish the request; the draft is the MTP row that follows the
/// last kept token).
fn apply_whole_step(
    backend: &dyn Backend,
    seqs: &mut [&mut SeqState],
    drafts: &[Option<u32>],
    samples: Vec<StepSamples>,
    eos: &[u32],
) -> Result<Vec<StepOutput>, EngineError> {
    if samples.len() != seqs.len() {
        return Err(EngineError::Device(format!("{} step results for {} sequences", samples.len(), seqs.len())));
    }
    let mut results = vec![StepOutput::default(); seqs.len()];
    for ((s, o), (res, draft)) in seqs.iter_mut().zip(samples).zip(results.iter_mut().zip(drafts)) {
        let mut fed = 1;
        let (tok, accepted) = match draft {
            Some(d) => verify(o.first, *d),
            None => (o.first, false),
        };
        if draft.is_some() {
            s.drafts_proposed += 1;
        }
        push(s, tok.clone(), eos);
        res.tokens.push(tok);
        if accepted {
            s.drafts_accepted += 1;
            fed = 2;
            if s.finished.is_none() {
                let second = o.second.ok_or_else(|| EngineError::Device("no sample at the draft's position".into()))?;
                push(s, second.clone(), eos);
                res.tokens.push(second);
            }
        }
        res.finished = s.finished;
        s.draft = None;
        if backend.has_mtp() && s.finished.is_none() && s.speculate {
            let (d, p) = o.draft.ok_or_else(|| EngineError::Device("no draft was returned".into()))?;
            s.draft = Some(d);
            s.draft_prob = p;
        }
        s.fed += fed;
    }
    Ok(results)
}

/// What [`Backend::decode_whole_step`] promises, computed by the separate calls: the main model over each
/// item's fed tokens, row 0 sampled with the item's history, row 1 (where row 0's token is the draft) with
/// that token added to it, the MTP layer over every fed row with the token sampled there (a rejected
/// draft's row with token 0), and the draft from the MTP row of the last token kept. The reference a
/// backend's whole step is checked against.
pub fn decode_whole_step_by_parts(
    backend: &dyn Backend,
    cache: &KvCache,
    batch: &[StepInput<'_>],
    eos: &[u32],
) -> Result<Vec<StepSamples>, EngineError> {
    if batch.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = batch.iter().position(|b| b.tokens.is_empty() || b.tokens.len() > 2) {
        return Err(EngineError::InvalidInput(format!("step item {i}: {} tokens (1 or 2)", batch[i].tokens.len())));
    }
    let inputs: Vec<SeqInput<'_>> = batch
        .iter()
        .map(|b| SeqInput { tokens: b.tokens, start: b.start, blocks: b.blocks, logits: Logits::All })
        .collect();
    let outs = backend.decode(cache, &inputs)?;
    let reqs: Vec<SampleRequest<'_>> = batch
        .iter()
        .zip(&outs)
        .map(|(b, o)| SampleRequest { logits: &o.logits, row: 0, params: b.params, history: b.history })
        .collect();
    let firsts = backend.sample_rows(&reqs, eos)?;
    // Row 1 of the items whose draft is row 0's token, each history holding that token.
    let twos: Vec<usize> = (0..batch.len()).filter(|&i| batch[i].tokens.get(1) == Some(&firsts[i].token)).collect();
    let outputs: Vec<Vec<u32>> =
        twos.iter().map(|&i| batch[i].history.output.iter().copied().chain([firsts[i].token]).collect()).collect();
    let reqs: Vec<SampleRequest<'_>> = twos
        .iter()
        .zip(&outputs)
        .map(|(&i, out)| SampleRequest {
            logits: &outs[i].logits,
            row: 1,
            params: batch[i].params,
            history: History { prompt: batch[i].history.prompt, output: out },
        })
        .collect();
    let mut seconds: Vec<Option<Sampled>> = vec![None; batch.len()];
    for (&i, t) in twos.iter().zip(backend.sample_rows(&reqs, eos)?) {
        seconds[i] = Some(t);
    }
    let mut drafts = vec![None; batch.len()];
    if backend.has_mtp() {
        let next: Vec<Vec<u32>> = (0..batch.len())
            .map(|i| {
                let second = (batch[i].tokens.len() == 2).then(|| seconds[i].as_ref().map_or(0, |t| t.token));
                std::iter::once(firsts[i].token).chain(second).collect()
            })
            .collect();
        let mtp_in: Vec<MtpInput<'_>> = batch
            .iter()
            .zip(&outs)
            .zip(&next)
            .map(|((b, o), n)| MtpInput {
                next_tokens: n,
                hidden: &o.hidden,
                start: b.start,
                blocks: b.blocks,
                logits: Logits::All,
            })
            .collect();
        let mtp_out = backend.mtp(cache, &mtp_in, AttnForm::Decode, &mut |_, _| {})?;
        let rows: Vec<(&DeviceRows, usize)> =
            mtp_out.iter().zip(&next).flat_map(|(o, n)| (0..n.len()).map(move |r| (&o.logits, r))).collect();
        let mut got = backend.draft_rows(&rows)?.into_iter();
        for ((d, n), second) in drafts.iter_mut().zip(&next).zip(&seconds) {
            let of_rows: Vec<(u32, f32)> = got.by_ref().take(n.len()).collect();
            // Row 1's where its sample is kept (the draft accepted), row 0's otherwise.
            *d = of_rows.get(usize::from(second.is_some())).copied();
        }
    }
    Ok(firsts
        .into_iter()
        .zip(seconds)
        .zip(drafts)
        .map(|((first, second), draft)| StepSamples { first, second, draft })
        .collect())
}

/// One MTP draft and what verification made of it (for checking the MTP layer against another
/// implementation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftStep {
    /// Output position (0 = first generated token) the draft guessed.
    pub position: usize,
    pub draft: u32,
    pub accepted: bool,
}

/// Everything generated for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<Sampled>,
    pub finish: Finish,
    pub drafts_proposed: u32,
    pub drafts_accepted: u32,
    /// Every draft in order.
    pub drafts: Vec<DraftStep>,
}

/// Generates for one request in this process (blocks from `blocks`, which must hold prompt + max_tokens
/// + 1 positions). `chunk` bounds the tokens per prefill call.
pub fn generate(
    backend: &dyn Backend,
    cache: &KvCache,
    prompt: Vec<u32>,
    params: SamplingParams,
    blocks: Vec<BlockId>,
    chunk: usize,
    speculate: bool,
) -> Result<Generation, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidInput("empty prompt".into()));
    }
    let mut s = SeqState::new(prompt, params, blocks, 0);
    s.speculate = speculate;
    let mut tokens = Vec::new();
    while !s.prefill_done() {
        let out = prefill(backend, cache, &mut [&mut s], &[chunk], &mut |_, _| {})?;
        tokens.extend(out.into_iter().flat_map(|o| o.tokens));
    }
    let mut drafts = Vec::new();
    while s.finished.is_none() {
        // The draft guesses the token after the pending one.
        let draft = if s.speculate && backend.has_mtp() { s.draft } else { None };
        let (position, accepted_before) = (s.tokens.len() - s.prompt_len, s.drafts_accepted);
        let out = decode_step(backend, cache, &mut [&mut s])?;
        if let Some(draft) = draft {
            drafts.push(DraftStep { position, draft, accepted: s.drafts_accepted > accepted_before });
        }
        tokens.extend(out.into_iter().flat_map(|o| o.tokens));
    }
    Ok(Generation {
        tokens,
        finish: s.finished.expect("loop ends when finished"),
        drafts_proposed: s.drafts_proposed,
        drafts_accepted: s.drafts_accepted,
        drafts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chi-square of observed counts against expected probabilities (bins with p > 0).
    fn chi2(counts: &[usize], dist: &[(u32, f32)], n: usize) -> (f64, usize) {
        let mut stat = 0f64;
        for &(t, p) in dist {
            let e = n as f64 * p as f64;
            stat += (counts[t as usize] as f64 - e).powi(2) / e;
        }
        (stat, dist.len() - 1)
    }

    #[test]
    fn draft_verification_preserves_the_target_distribution() {
        let vocab = 12;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.8 + i as f32 * 0.05).collect();
        let params = SamplingParams { temperature: 0.8, top_p: 0.95, max_tokens: 100, ..Default::default() };
        let base = SeqState::new(vec![3, 4, 5], params.clone(), Vec::new(), 3);
        let target = sampling::distribution(&logits, &params, history(&base), &[]);
        let n = 30_000;
        // A likely draft, an unlikely one, and one outside the top-p set (always rejected).
        let outside = (0..vocab as u32).find(|t| !target.iter().any(|x| x.0 == *t)).expect("top_p drops a token");
        for draft in [target.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0, target[0].0, outside] {
            let mut counts = vec![0usize; vocab];
            let mut accepted = 0;
            for seed in 0..n {
                let mut s = base.clone();
                s.params.seed = seed as u64;
                let (tok, acc) = verify(sampling::sample(&logits, &s.params, history(&s), &[]), draft);
                counts[tok.token as usize] += 1;
                accepted += usize::from(acc);
            }
            let (stat, dof) = chi2(&counts, &target, n);
            // p = 0.001 critical values for up to 11 degrees of freedom are below 31.3.
            assert!(stat < 31.3, "draft {draft}: chi2 {stat} with {dof} dof, counts {counts:?}");
            let p_draft = target.iter().find(|x| x.0 == draft).map(|x| x.1).unwrap_or(0.0);
            let rate = accepted as f32 / n as f32;
            assert!((rate - p_draft).abs() < 0.02, "acceptance rate {rate} should be p(draft) {p_draft}");
        }
    }

    #[test]
    fn greedy_verification_accepts_exactly_the_argmax() {
        let logits = vec![0.0f32, 3.0, 1.0];
        let s = SeqState::new(vec![0], SamplingParams::greedy(4), Vec::new(), 1);
        let sample = || sampling::sample(&logits, &s.params, history(&s), &[]);
        assert!(verify(sample(), 1).1);
        let (tok, acc) = verify(sample(), 2);
        assert!(!acc);
        assert_eq!(tok.token, 1);
    }
}
