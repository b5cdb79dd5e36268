//! Turning logits into the next token, as vLLM/OpenAI define it: min_tokens masking, logit_bias,
//! repetition/frequency/presence penalties, greedy or temperature sampling with top-k / top-p / min-p,
//! stop conditions and logprobs.
//!
//! A seeded draw is an exponential race (the Gumbel-max trick) over the tokens the deterministic filters
//! keep: each token gets its own counter-based random number, Philox4x32-10 keyed by the request seed at
//! counter (token, output position, purpose), and the token with the largest `logit / T - ln(-ln u)` wins
//! (equal keys: the lowest id). No running sum over the vocabulary is involved, so any backend computes
//! the same draw for the same logits in any batch, on any worker, in any chunking (the prefill worker
//! samples the first token, decode workers the rest; docs/model.md §2.6). Temperatures below [`GREEDY_BELOW`] are
//! greedy; greedy ties take the lowest token id. Logprobs are those of the raw model distribution (vLLM's
//! default). [`philox4x32`], [`uniform`] and [`race`] are pure functions a GPU sampler's tests compare with.

/// Temperatures below this are greedy.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Per-request sampling parameters (zero values mean "off", as in tandem.v1 SamplingParams).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SamplingParams {
    /// Below [`GREEDY_BELOW`] (0 included) = greedy.
    pub temperature: f32,
    /// 0 or >= 1 = off.
    pub top_p: f32,
    /// 0 or negative = off.
    pub top_k: i32,
    /// 0 = off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 0 or 1 = off.
    pub repetition_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    /// The RNG key (callers pick a random one when the client gave none).
    pub seed: u64,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// None = no logprobs; Some(n) = the chosen token's plus the top n.
    pub logprobs: Option<u32>,
}

impl SamplingParams {
    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams { max_tokens, ..Default::default() }
    }

    /// Greedy: a temperature below [`GREEDY_BELOW`] (dividing logits by it would overflow or be noise).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// Checks ranges; the message names the parameter.
    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        let finite =
            |name: &str, v: f32| if v.is_finite() { Ok(()) } else { Err(format!("{name} must be a finite number")) };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        if self.temperature < 0.0 {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) || !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err("presence_penalty and frequency_penalty must be in [-2, 2]".into());
        }
        if self.repetition_penalty < 0.0 {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be >= 1".into());
        }
        if self.min_tokens > self.max_tokens {
            return Err(format!("min_tokens {} exceeds max_tokens {}", self.min_tokens, self.max_tokens));
        }
        if let Some(&(t, _)) = self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab_size) {
            return Err(format!("logit_bias token id {t} is outside the vocabulary of {vocab_size}"));
        }
        if let Some((_, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(format!("logit_bias values must be in [-100, 100], got {b}"));
        }
        if let Some(&t) = self.stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!("stop_token_ids: {t} is outside the vocabulary of {vocab_size}"));
        }
        Ok(())
    }
}

/// The tokens a request has seen, for penalties.
#[derive(Debug, Clone, Copy)]
pub struct History<'a> {
    pub prompt: &'a [u32],
    pub output: &'a [u32],
}

/// One sampled token with its logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log P(token) under the raw model distribution.
    pub logprob: f32,
    /// The most likely tokens, best first (empty unless logprobs > 0 were asked for).
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// EOS or a stop token.
    Stop,
    /// max_tokens reached.
    Length,
}

/// Why generation ends after `token`, which is output number `count` (1-based), or None to go on.
pub fn finish_reason(token: u32, count: u32, params: &SamplingParams, eos: &[u32]) -> Option<Finish> {
    let may_stop = count >= params.min_tokens;
    if may_stop && ((!params.ignore_eos && eos.contains(&token)) || params.stop_token_ids.contains(&token)) {
        return Some(Finish::Stop);
    }
    if count >= params.max_tokens {
        return Some(Finish::Length);
    }
    None
}

/// The purpose of the token draw at an output position (other values are free for independent draws).
pub const PURPOSE_TOKEN: u32 = 0;

/// Philox4x32-10 (Salmon et al., SC'11; Random123, cuRAND): the 4 x 32-bit block for `counter` under `key`.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The uniform number in (0, 1) of `token` at output `position` for `purpose`, under `seed`: 53 bits of
/// Philox at counter (token, position, purpose, 0), key (seed low, seed high), centred in their interval.
pub fn uniform(seed: u64, position: u32, purpose: u32, token: u32) -> f64 {
    let r = philox4x32([token, position, purpose, 0], [seed as u32, (seed >> 32) as u32]);
    let bits = ((r[0] as u64) << 21) ^ ((r[1] as u64) >> 11);
    (bits as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// The exponential race over `candidates` (token, logit / temperature): the token with the largest
/// `z - ln(-ln u)` wins, which samples `softmax(z)` over the candidates exactly; equal keys take the lowest
/// id. `None` when no candidate has a finite `z`.
pub fn race(candidates: &[(u32, f32)], seed: u64, position: u32, purpose: u32) -> Option<u32> {
    let mut best: Option<(u32, f64)> = None;
    for &(t, z) in candidates {
        if !z.is_finite() {
            continue;
        }
        let key = z as f64 - (-uniform(seed, position, purpose, t).ln()).ln();
        let better = match best {
            None => true,
            Some((bt, bk)) => key > bk || (key == bk && t < bt),
        };
        if better {
            best = Some((t, key));
        }
    }
    best.map(|b| b.0)
}

/// The logits after min_tokens masking, logit_bias and penalties (before temperature).
pub fn processed_logits(logits: &[f32], params: &SamplingParams, history: History<'_>, eos: &[u32]) -> Vec<f32> {
    let mut l = logits.to_vec();
    if (history.output.len() as u32) < params.min_tokens {
        for &t in eos.iter().chain(&params.stop_token_ids) {
            if let Some(v) = l.get_mut(t as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    for &(t, b) in &params.logit_bias {
        if let Some(v) = l.get_mut(t as usize) {
            *v += b;
        }
    }
    let rep = params.repetition_penalty;
    if rep > 0.0 && rep != 1.0 {
        let mut seen = vec![false; l.len()];
        for &t in history.prompt.iter().chain(history.output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (v, s) in l.iter_mut().zip(&seen) {
            if *s {
                *v = if *v > 0.0 { *v / rep } else { *v * rep };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in history.output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= params.frequency_penalty * c as f32 + params.presence_penalty;
            }
        }
    }
    l
}

/// log-softmax of `logits`.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    let sum: f64 = logits.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lse = m + sum.ln() as f32;
    logits.iter().map(|&v| v - lse).collect()
}

/// Tokens ranked best first (ties: lower id first).
fn ranked(values: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    idx.sort_by(|&a, &b| values[b as usize].total_cmp(&values[a as usize]).then(a.cmp(&b)));
    idx
}

/// The index of the largest value; ties take the lowest index, NaN is never the maximum (0 when all are).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, v) in values.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| *v > values[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// The tokens the filters keep (processing, then top-k, top-p, min-p on the temperature-scaled
/// distribution), in token order, each with its scaled logit `z = logit / temperature`. Never empty; for
/// greedy requests: the argmax alone.
pub fn candidates(logits: &[f32], params: &SamplingParams, history: History<'_>, eos: &[u32]) -> Vec<(u32, f32)> {
    let l = processed_logits(logits, params, history, eos);
    if params.is_greedy() {
        let t = argmax(&l);
        return vec![(t, l.get(t as usize).copied().unwrap_or(0.0))];
    }
    let z: Vec<f32> = l.iter().map(|v| if v.is_nan() { f32::NEG_INFINITY } else { v / params.temperature }).collect();
    let lp = log_softmax(&z);
    let order = ranked(&lp);
    let mut keep = order.len();
    if params.top_k > 0 {
        keep = keep.min(params.top_k as usize);
    }
    let probs: Vec<f32> = lp.iter().map(|v| v.exp()).collect();
    if params.top_p > 0.0 && params.top_p < 1.0 {
        let mut cum = 0f32;
        for (i, &t) in order.iter().take(keep).enumerate() {
            cum += probs[t as usize];
            if cum >= params.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if params.min_p > 0.0 {
        let floor = params.min_p * probs[order[0] as usize];
        keep = order.iter().take(keep).take_while(|&&t| probs[t as usize] >= floor).count().max(1);
    }
    let mut kept: Vec<(u32, f32)> =
        order[..keep].iter().filter(|&&t| probs[t as usize] > 0.0).map(|&t| (t, z[t as usize])).collect();
    if kept.is_empty() {
        let t = order.first().copied().unwrap_or(0);
        kept.push((t, z.get(t as usize).copied().unwrap_or(0.0)));
    }
    kept.sort_by_key(|&(t, _)| t);
    kept
}

/// The sampling distribution: [`candidates`] with `softmax(z)` as (token, prob) in token order, summing
/// to 1 (greedy: the argmax with probability 1). What [`sample`]'s race draws from, and what speculative
/// verification preserves.
pub fn distribution(logits: &[f32], params: &SamplingParams, history: History<'_>, eos: &[u32]) -> Vec<(u32, f32)> {
    let kept = candidates(logits, params, history, eos);
    if kept.len() == 1 {
        return vec![(kept[0].0, 1.0)];
    }
    let lp = log_softmax(&kept.iter().map(|c| c.1).collect::<Vec<_>>());
    kept.iter().zip(lp).map(|(c, l)| (c.0, l.exp())).collect()
}

/// The chosen token's raw logprob and the top-n alternatives.
pub fn logprobs_of(logits: &[f32], token: u32, top_n: Option<u32>) -> (f32, Vec<(u32, f32)>) {
    let lp = log_softmax(logits);
    let chosen = lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let top = match top_n {
        Some(n) if n > 0 => ranked(&lp).into_iter().take(n as usize).map(|t| (t, lp[t as usize])).collect(),
        _ => Vec::new(),
    };
    (chosen, top)
}

/// Samples output position `history.output.len()` of a request.
pub fn sample(logits: &[f32], params: &SamplingParams, history: History<'_>, eos: &[u32]) -> Sampled {
    let position = history.output.len() as u32;
    let kept = candidates(logits, params, history, eos);
    let token = match kept.as_slice() {
        [only] => only.0,
        _ => race(&kept, params.seed, position, PURPOSE_TOKEN).unwrap_or(kept[0].0),
    };
    let (logprob, top) =
        if params.logprobs.is_some() { logprobs_of(logits, token, params.logprobs) } else { (0.0, Vec::new()) };
    Sampled { token, logprob, top }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: &[u32] = &[1];

    fn no_history() -> History<'static> {
        History { prompt: &[], output: &[] }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let l = vec![0.1, 2.0, -1.0, 2.5, 0.0];
        assert_eq!(sample(&l, &SamplingParams::greedy(4), no_history(), &[]).token, 3);
    }

    #[test]
    fn seeded_sampling_depends_only_on_seed_and_position() {
        let l: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams { temperature: 1.0, seed: 42, max_tokens: 10, ..Default::default() };
        let out_a = [5u32, 6, 7];
        let out_b = [9u32, 9, 9];
        // Same position (3) from different histories without penalties: the same draw.
        let a = sample(&l, &p, History { prompt: &[1], output: &out_a }, EOS).token;
        let b = sample(&l, &p, History { prompt: &[2, 3], output: &out_b }, EOS).token;
        assert_eq!(a, b);
        let draws: std::collections::HashSet<u32> =
            (0..20).map(|n| sample(&l, &p, History { prompt: &[], output: &vec![0; n] }, EOS).token).collect();
        assert!(draws.len() > 3, "positions give different draws");
    }

    /// Chi-square statistic of `counts` against `probs` (every bin expected > 0).
    fn chi2(counts: &[usize], probs: &[f64], n: usize) -> f64 {
        counts.iter().zip(probs).map(|(&c, &p)| (c as f64 - n as f64 * p).powi(2) / (n as f64 * p)).sum()
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let l = vec![1.0f32, 0.0, -1.0, 2.0, 0.5, -3.0];
        let t = 0.7;
        let probs: Vec<f64> =
            log_softmax(&l.iter().map(|v| v / t).collect::<Vec<_>>()).iter().map(|v| (*v as f64).exp()).collect();
        let n = 40000;
        // Over positions of one seed, and over seeds at one position: both are the softmax.
        for by_seed in [false, true] {
            let mut counts = [0usize; 6];
            for i in 0..n {
                let p = SamplingParams {
                    temperature: t,
                    seed: if by_seed { i as u64 } else { 7 },
                    max_tokens: 1,
                    ..Default::default()
                };
                let pos = if by_seed { 3 } else { i };
                let out = vec![0u32; pos];
                counts[sample(&l, &p, History { prompt: &[], output: &out[..] }, &[]).token as usize] += 1;
            }
            // 5 degrees of freedom: p = 0.001 at 20.5.
            let stat = chi2(&counts, &probs, n);
            assert!(stat < 20.5, "by seed {by_seed}: chi2 {stat}, counts {counts:?}");
        }
    }

    #[test]
    fn filtered_sampling_follows_the_renormalized_softmax() {
        let l: Vec<f32> = (0..40).map(|i| ((i * 17 % 11) as f32 - 5.0) * 0.4).collect();
        let p =
            SamplingParams { temperature: 1.3, top_k: 8, top_p: 0.9, seed: 11, max_tokens: 1, ..Default::default() };
        let dist = distribution(&l, &p, no_history(), &[]);
        assert!(dist.len() > 2 && dist.len() <= 8);
        let n = 30000;
        let mut counts = vec![0usize; 40];
        for i in 0..n {
            let q = SamplingParams { seed: i as u64, ..p.clone() };
            counts[sample(&l, &q, no_history(), &[]).token as usize] += 1;
        }
        let kept: Vec<usize> = dist.iter().map(|d| counts[d.0 as usize]).collect();
        assert_eq!(kept.iter().sum::<usize>(), n, "only kept tokens are drawn");
        let probs: Vec<f64> = dist.iter().map(|d| d.1 as f64).collect();
        // At most 7 degrees of freedom: p = 0.001 at 24.3.
        let stat = chi2(&kept, &probs, n);
        assert!(stat < 24.3, "chi2 {stat}, counts {kept:?}, dist {dist:?}");
    }

    #[test]
    fn philox_matches_the_random123_known_answers() {
        assert_eq!(philox4x32([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniforms_are_in_the_open_interval_and_keyed_by_every_part() {
        let u = uniform(1, 2, PURPOSE_TOKEN, 3);
        assert!(u > 0.0 && u < 1.0);
        assert_eq!(u, uniform(1, 2, PURPOSE_TOKEN, 3));
        for other in [
            uniform(2, 2, 0, 3),
            uniform(1, 3, 0, 3),
            uniform(1, 2, 1, 3),
            uniform(1, 2, 0, 4),
            uniform(1 << 40, 2, 0, 3),
        ] {
            assert_ne!(u, other);
        }
    }

    #[test]
    fn a_draw_depends_on_the_logits_of_its_candidates_only() {
        // The race needs no sum: scaling the scene (adding a constant to every logit) or dropping a
        // non-candidate never changes the winner, and candidate order does not matter.
        let c: Vec<(u32, f32)> = (0..50).map(|t| (t, ((t * 13 % 7) as f32) * 0.3)).collect();
        for pos in 0..200 {
            let w = race(&c, 5, pos, PURPOSE_TOKEN).unwrap();
            let shifted: Vec<(u32, f32)> = c.iter().map(|&(t, z)| (t, z + 100.0)).collect();
            assert_eq!(race(&shifted, 5, pos, PURPOSE_TOKEN), Some(w));
            let mut reversed = c.clone();
            reversed.reverse();
            assert_eq!(race(&reversed, 5, pos, PURPOSE_TOKEN), Some(w));
        }
        assert_eq!(race(&[(3, f32::NEG_INFINITY)], 1, 1, 0), None);
    }

    #[test]
    fn tiny_temperatures_are_greedy_and_greedy_ties_take_the_lowest_id() {
        let l = vec![-1.0f32, 0.5, 3.0, 3.0, 2.0];
        for t in [1e-40f32, 1e-6, 9.9e-6, 0.0] {
            let p = SamplingParams { temperature: t, seed: 3, max_tokens: 200, ..Default::default() };
            assert!(p.validate(5).is_ok());
            for pos in 0..50 {
                let out = vec![4u32; pos];
                assert_eq!(sample(&l, &p, History { prompt: &[], output: &out[..] }, &[]).token, 2, "temperature {t}");
            }
        }
        // NaN is never the argmax.
        assert_eq!(argmax(&[f32::NAN, 1.0, 1.0]), 1);
        // 1e-5 itself samples.
        assert!(!SamplingParams { temperature: 1e-5, ..Default::default() }.is_greedy());
    }

    #[test]
    fn top_k_top_p_and_min_p_filter() {
        let l = vec![3.0f32, 2.0, 1.0, 0.0, -1.0];
        let base = SamplingParams { temperature: 1.0, max_tokens: 1, ..Default::default() };
        let toks = |p: SamplingParams| distribution(&l, &p, no_history(), &[]).iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(toks(SamplingParams { top_k: 2, ..base.clone() }), vec![0, 1]);
        // softmax: 0.636, 0.234, 0.086, ...: top_p 0.8 needs the first two.
        assert_eq!(toks(SamplingParams { top_p: 0.8, ..base.clone() }), vec![0, 1]);
        assert_eq!(toks(SamplingParams { top_p: 0.5, ..base.clone() }), vec![0]);
        // min_p 0.1: keep p >= 0.0636: tokens 0, 1, 2.
        assert_eq!(toks(SamplingParams { min_p: 0.1, ..base.clone() }), vec![0, 1, 2]);
        let d = distribution(&l, &SamplingParams { top_k: 3, ..base }, no_history(), &[]);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn penalties_and_bias_follow_openai_and_vllm() {
        let l = vec![1.0f32, 1.0, -1.0, 0.5];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(3, 10.0)],
            max_tokens: 5,
            ..Default::default()
        };
        let out = processed_logits(&l, &p, History { prompt: &[2], output: &[0, 0] }, EOS);
        // token 0: repetition (seen) 1/2, then -(0.25*2 + 0.5).
        assert!((out[0] - (0.5 - 1.0)).abs() < 1e-6);
        assert_eq!(out[1], 1.0);
        // token 2: in the prompt, negative: times 2; no frequency/presence (output only).
        assert_eq!(out[2], -2.0);
        assert_eq!(out[3], 10.5);
    }

    #[test]
    fn min_tokens_masks_eos_and_stop_tokens() {
        let l = vec![0.0f32, 5.0, 1.0, 5.0];
        let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![3], max_tokens: 4, ..Default::default() };
        assert_eq!(sample(&l, &p, History { prompt: &[], output: &[2] }, EOS).token, 2);
        assert_eq!(sample(&l, &p, History { prompt: &[], output: &[2, 2] }, EOS).token, 1);
    }

    #[test]
    fn stop_conditions() {
        let p = SamplingParams { max_tokens: 3, min_tokens: 1, stop_token_ids: vec![7], ..Default::default() };
        assert_eq!(finish_reason(1, 1, &p, EOS), Some(Finish::Stop));
        assert_eq!(finish_reason(7, 2, &p, EOS), Some(Finish::Stop));
        assert_eq!(finish_reason(5, 2, &p, EOS), None);
        assert_eq!(finish_reason(5, 3, &p, EOS), Some(Finish::Length));
        let ignore = SamplingParams { ignore_eos: true, ..p.clone() };
        assert_eq!(finish_reason(1, 1, &ignore, EOS), None);
        let late = SamplingParams { min_tokens: 2, ..p };
        assert_eq!(finish_reason(1, 1, &late, EOS), None);
    }

    #[test]
    fn logprobs_report_the_raw_distribution() {
        let l = vec![2.0f32, 1.0, 0.0];
        let p = SamplingParams { logprobs: Some(2), max_tokens: 1, ..Default::default() };
        let s = sample(&l, &p, no_history(), &[]);
        let lse = (2f32.exp() + 1f32.exp() + 1.0).ln();
        assert!((s.logprob - (2.0 - lse)).abs() < 1e-6);
        assert_eq!(s.top.len(), 2);
        assert_eq!(s.top[0].0, 0);
        assert_eq!(s.top[1].0, 1);
    }

    #[test]
    fn validation_names_the_parameter() {
        let ok = SamplingParams::greedy(4);
        assert!(ok.validate(10).is_ok());
        for (bad, word) in [
            (SamplingParams { temperature: -1.0, ..ok.clone() }, "temperature"),
            (SamplingParams { top_p: 1.5, ..ok.clone() }, "top_p"),
            (SamplingParams { max_tokens: 0, ..ok.clone() }, "max_tokens"),
            (SamplingParams { logit_bias: vec![(99, 1.0)], ..ok.clone() }, "logit_bias"),
            (SamplingParams { min_tokens: 9, ..ok.clone() }, "min_tokens"),
        ] {
            assert!(bad.validate(10).unwrap_err().contains(word), "{word}");
        }
    }
}
