//! Whole-model properties on the generated tiny checkpoint (4 layers + MTP, index_topk 32, the real
//! cache formats): prefill == token-by-token decode, chunked == one-shot, batch invariance, speculative
//! greedy == plain greedy, FP8 against full precision, clean errors for bad input.
//!
//! They run on the CPU backend, or on a GPU with `TANDEM_TEST_DEVICE=cuda` (what `scripts/gpu-test.sh run
//! model` does): every property holds on both backends.

mod support;

use std::sync::{Arc, OnceLock};

use engine::cache::{CacheGeometry, KvCache};
use engine::device::{BackendOptions, load_backend};
use engine::generate::{self, SeqState};
use engine::sampling::{SamplingParams, argmax};
use engine::tolerance::diff;
use engine::{Backend, Logits, Precision, SeqInput};
use support::{Served, VOCAB, device, prompt};

const BLOCKS: usize = 64;

fn checkpoint() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        engine::tiny::write(d.path(), 1, VOCAB).unwrap();
        d
    })
    .path()
}

fn backend(prec: Precision) -> Arc<dyn Backend> {
    static FP8: OnceLock<Arc<dyn Backend>> = OnceLock::new();
    static FULL: OnceLock<Arc<dyn Backend>> = OnceLock::new();
    let cell = if prec == Precision::Fp8 { &FP8 } else { &FULL };
    cell.get_or_init(|| {
        let ckpt = engine::checkpoint::Checkpoint::open(checkpoint()).unwrap();
        load_backend(&ckpt, BackendOptions { device: device(), precision: prec, threads: None })
            .unwrap_or_else(|e| panic!("backend on {}: {e}", device()))
    })
    .clone()
}

fn env(prec: Precision) -> Served {
    Served::new(backend(prec), BLOCKS)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
}

#[test]
fn prefill_logits_equal_decode_logits_fed_token_by_token() {
    for prec in [Precision::Full, Precision::Fp8] {
        let e = env(prec);
        let toks = prompt(70, 1); // beyond index_topk 32: sparse selection in both forms
        let pre = e.prefill_all("pre", &toks);

        // Token by token from an empty cache: the decode path end to end.
        let t = e.pool.reserve("dec", toks.len()).unwrap();
        let mut stepwise = Vec::new();
        for (p, tok) in toks.iter().enumerate() {
            let out = e
                .b
                .decode(&e.cache, &[SeqInput { tokens: &[*tok], start: p, blocks: &t.blocks, logits: Logits::Last }])
                .unwrap();
            stepwise.push(e.b.rows_to_host(&out[0].logits).unwrap());
        }
        let agree =
            (0..toks.len()).filter(|&p| argmax(&stepwise[p]) == argmax(&pre[p * VOCAB..(p + 1) * VOCAB])).count();

        // Position by position over the prefill's own caches (descending, so each decode overwrites only an
        // entry no later check reads): compares the two attention forms without cascades.
        let table = e.pool.reserve("iso", toks.len()).unwrap();
        e.b.prefill(
            &e.cache,
            &[SeqInput { tokens: &toks, start: 0, blocks: &table.blocks, logits: Logits::None }],
            &mut |_, _| {},
        )
        .unwrap();
        let (mut worst, mut close, mut iso_agree) = (0f32, 0, 0);
        let mut diffs = Vec::new();
        for p in (0..toks.len()).rev() {
            let out =
                e.b.decode(
                    &e.cache,
                    &[SeqInput { tokens: &toks[p..p + 1], start: p, blocks: &table.blocks, logits: Logits::Last }],
                )
                .unwrap();
            let got = e.b.rows_to_host(&out[0].logits).unwrap();
            let want = &pre[p * VOCAB..(p + 1) * VOCAB];
            let d = max_rel(&got, want);
            worst = worst.max(d);
            close += usize::from(d < 1e-4);
            iso_agree += usize::from(argmax(&got) == argmax(want));
            diffs.push(engine::tolerance::diff(&got, want));
        }
        let n = toks.len();
        let mean_diff = diffs.iter().sum::<f64>() / n as f64;
        println!(
            "{prec:?}: prefill (MHA) vs decode (absorbed): {close}/{n} positions within 1e-4 (max relative \
             difference {worst:.2e}, mean diff {mean_diff:.2e}), argmax equal at {iso_agree}/{n}; token-by-token \
             decode argmax equal at {agree}/{n}"
        );
        match prec {
            // Same function, different float order: only rounding differs.
            Precision::Full => assert!(worst < 1e-4 && agree == n, "{worst} {agree}"),
            // The CPU's two forms differ by f32 rounding, which the activation quantization before o_proj
            // usually absorbs (bit-identical logits; measured 70/70 within 1e-4). The GPU's decode runs the
            // attention on bf16 tensor cores (q_abs and the probabilities rounded to bf16, as FlashMLA does;
            // docs/model.md §2.2): those 2^-9 roundings flip activation codes on e4m3 boundaries (6% steps),
            // which the random tiny model's routing amplifies. The bound is therefore statistical: the two
            // forms' mean diff against the same prompt's FP8-vs-full diff, and argmax agreement. Measured on an
            // H100 over 4 fresh prompts: mean diff 0.44-0.74x the FP8 noise, argmax equal at 50-62 of 70
            // (isolated) and 44-57 (token by token); the CPU with q_abs and P rounded to bf16 the same way
            // gives 0.41-0.77x, 55-60 and 50-56, so the spread is bf16's, not the kernel's. The bounds (1x,
            // 60%, 55%) keep 5-8 positions of margin; a wrong form's diff is ~1, 50x the noise.
            Precision::Fp8 => {
                let full = env(Precision::Full).prefill_all("full", &toks);
                let noise = (0..n)
                    .map(|p| {
                        engine::tolerance::diff(&pre[p * VOCAB..(p + 1) * VOCAB], &full[p * VOCAB..(p + 1) * VOCAB])
                    })
                    .sum::<f64>()
                    / n as f64;
                println!("Fp8: the FP8-vs-full diff of the same prompt: {noise:.2e}");
                assert!(
                    mean_diff < noise && iso_agree * 10 >= 6 * n && agree * 100 >= 55 * n,
                    "mean diff {mean_diff:e} against the FP8 noise {noise:e}, argmax {iso_agree}/{n} isolated, \
                     {agree}/{n} token by token"
                )
            }
        }
        e.pool.release("dec").unwrap();
        e.pool.release("iso").unwrap();
    }
}

#[test]
fn chunked_prefill_is_bitwise_one_shot_prefill() {
    for prec in [Precision::Full, Precision::Fp8] {
        let e = env(prec);
        let toks = prompt(150, 2);
        let one = e.prefill_all("one", &toks);
        let t = e.pool.reserve("chunks", toks.len()).unwrap();
        let mut chunked = Vec::new();
        for (a, b) in [(0, 37), (37, 64), (64, 65), (65, 150)] {
            let out =
                e.b.prefill(
                    &e.cache,
                    &[SeqInput { tokens: &toks[a..b], start: a, blocks: &t.blocks, logits: Logits::All }],
                    &mut |_, _| {},
                )
                .unwrap();
            chunked.extend_from_slice(&e.b.rows_to_host(&out[0].logits).unwrap());
        }
        assert!(one == chunked, "{prec:?}: chunked prefill differs from one-shot");
        e.pool.release("chunks").unwrap();
    }
}

#[test]
fn a_requests_logits_do_not_depend_on_its_batch() {
    let e = env(Precision::Fp8);
    let (a, b, c) = (prompt(90, 3), prompt(17, 4), prompt(200, 5));
    let alone = e.prefill_all("alone", &a);
    let ta = e.pool.reserve("a", a.len() + 2).unwrap();
    let tb = e.pool.reserve("b", b.len() + 2).unwrap();
    let tc = e.pool.reserve("c", c.len() + 2).unwrap();
    let batch = [
        SeqInput { tokens: &b, start: 0, blocks: &tb.blocks, logits: Logits::Last },
        SeqInput { tokens: &a, start: 0, blocks: &ta.blocks, logits: Logits::All },
        SeqInput { tokens: &c, start: 0, blocks: &tc.blocks, logits: Logits::None },
    ];
    let out = e.b.prefill(&e.cache, &batch, &mut |_, _| {}).unwrap();
    assert!(e.b.rows_to_host(&out[1].logits).unwrap() == alone, "prefill of a batched with others differs");
    assert_eq!(out[2].logits.rows(), 0);
    // Decode: a's next token alone, then batched with b and c, then with a second query token (MTP shape).
    let next = [argmax(&alone[(a.len() - 1) * VOCAB..])];
    let solo =
        e.b.decode(&e.cache, &[SeqInput { tokens: &next, start: a.len(), blocks: &ta.blocks, logits: Logits::Last }])
            .unwrap();
    let (nb, nc) = ([5u32], [9u32, 11]);
    let many =
        e.b.decode(
            &e.cache,
            &[
                SeqInput { tokens: &nb, start: b.len(), blocks: &tb.blocks, logits: Logits::Last },
                SeqInput { tokens: &next, start: a.len(), blocks: &ta.blocks, logits: Logits::Last },
                SeqInput { tokens: &nc, start: c.len(), blocks: &tc.blocks, logits: Logits::All },
            ],
        )
        .unwrap();
    assert!(
        e.b.rows_to_host(&many[1].logits).unwrap() == e.b.rows_to_host(&solo[0].logits).unwrap(),
        "decode of a batched with others differs"
    );
    let two = [next[0], 77];
    let wide =
        e.b.decode(&e.cache, &[SeqInput { tokens: &two, start: a.len(), blocks: &ta.blocks, logits: Logits::All }])
            .unwrap();
    assert!(
        e.b.rows_to_host(&wide[0].logits).unwrap()[..VOCAB] == e.b.rows_to_host(&solo[0].logits).unwrap()[..],
        "a second query token changes the first one's logits"
    );
    for id in ["a", "b", "c"] {
        e.pool.release(id).unwrap();
    }
    assert_eq!(e.pool.stats().used_blocks, 0);
}

fn run(e: &Served, toks: &[u32], params: &SamplingParams, speculate: bool, chunk: usize) -> generate::Generation {
    let t = e.pool.reserve("gen", toks.len() + params.max_tokens as usize + 2).unwrap();
    let g =
        generate::generate(e.b.as_ref(), &e.cache, toks.to_vec(), params.clone(), t.blocks, chunk, speculate).unwrap();
    e.pool.release("gen").unwrap();
    g
}

fn ids(g: &generate::Generation) -> Vec<u32> {
    g.tokens.iter().map(|t| t.token).collect()
}

#[test]
fn speculative_greedy_output_equals_plain_greedy_output() {
    let e = env(Precision::Fp8);
    let params = SamplingParams { max_tokens: 24, ignore_eos: true, ..SamplingParams::greedy(24) };
    for (salt, len) in [(6u64, 40usize), (7, 100)] {
        let toks = prompt(len, salt);
        let plain = run(&e, &toks, &params, false, 4096);
        assert_eq!(plain.tokens.len(), 24);
        let spec = run(&e, &toks, &params, true, 4096);
        assert_eq!(ids(&spec), ids(&plain), "natural MTP drafts");
        assert!(spec.drafts_proposed > 0);
        let chunked = run(&e, &toks, &params, true, 13);
        assert_eq!(ids(&chunked), ids(&plain), "chunked prefill + MTP");

        // Forced accept: drafts injected from the target's own greedy tokens; forced reject: wrong drafts.
        let target = ids(&plain);
        for force_accept in [true, false] {
            let (out, s) = forced(&e, &toks, &params, &target, force_accept);
            let got: Vec<u32> = out.iter().map(|t| t.token).collect();
            assert_eq!(got, target, "forced {}", if force_accept { "accept" } else { "reject" });
            if force_accept {
                assert_eq!(s.drafts_accepted, s.drafts_proposed);
                assert!(s.drafts_proposed >= 10, "accepted drafts make steps emit two tokens");
            } else {
                assert_eq!(s.drafts_accepted, 0);
            }
        }
    }
}

/// Generates `params.max_tokens` tokens after `toks` with every draft forced: the next token of `target`
/// (accepted) or another one (rejected). The tokens emitted and the final state.
fn forced(
    e: &Served,
    toks: &[u32],
    params: &SamplingParams,
    target: &[u32],
    force_accept: bool,
) -> (Vec<engine::sampling::Sampled>, SeqState) {
    let t = e.pool.reserve("forced", toks.len() + params.max_tokens as usize + 6).unwrap();
    let mut s = SeqState::new(toks.to_vec(), params.clone(), t.blocks, 0);
    let mut out =
        generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut s], &[4096], &mut |_, _| {}).unwrap().remove(0).tokens;
    while s.finished.is_none() {
        let next = target.get(s.generated().len()).copied().unwrap_or(0);
        s.draft = Some(if force_accept { next } else { (next + 1) % VOCAB as u32 });
        out.extend(generate::decode_step(e.b.as_ref(), &e.cache, &mut [&mut s]).unwrap().remove(0).tokens);
    }
    e.pool.release("forced").unwrap();
    (out, s)
}

/// A backend whose whole decode steps (`Backend::decode_whole_step`) are the separate calls
/// (`generate::decode_whole_step_by_parts`: `generate::decode_step` then takes its whole-step path on any
/// device) or are refused (`false`: it takes the separate calls' path on any device, the CUDA backend's own
/// whole steps included), everything else its inner backend's.
struct ByParts(Arc<dyn Backend>, bool);

impl Backend for ByParts {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn config(&self) -> &engine::ModelConfig {
        self.0.config()
    }
    fn precision(&self) -> Precision {
        self.0.precision()
    }
    fn allocate_cache(&self, g: CacheGeometry) -> Result<KvCache, engine::EngineError> {
        self.0.allocate_cache(g)
    }
    fn memory_budget(&self, l: &engine::memory::ServingLimits) -> engine::memory::MemoryBudget {
        self.0.memory_budget(l)
    }
    fn sample(
        &self,
        logits: &engine::DeviceRows,
        row: usize,
        params: &SamplingParams,
        history: engine::sampling::History<'_>,
        eos: &[u32],
    ) -> Result<engine::sampling::Sampled, engine::EngineError> {
        self.0.sample(logits, row, params, history, eos)
    }
    fn sample_rows(
        &self,
        reqs: &[engine::backend::SampleRequest<'_>],
        eos: &[u32],
    ) -> Result<Vec<engine::sampling::Sampled>, engine::EngineError> {
        self.0.sample_rows(reqs, eos)
    }
    fn draft(&self, logits: &engine::DeviceRows, row: usize) -> Result<(u32, f32), engine::EngineError> {
        self.0.draft(logits, row)
    }
    fn draft_rows(&self, rows: &[(&engine::DeviceRows, usize)]) -> Result<Vec<(u32, f32)>, engine::EngineError> {
        self.0.draft_rows(rows)
    }
    fn rows_to_host(&self, rows: &engine::DeviceRows) -> Result<Vec<f32>, engine::EngineError> {
        self.0.rows_to_host(rows)
    }
    fn prefill(
        &self,
        cache: &KvCache,
        batch: &[SeqInput<'_>],
        on_layer: engine::backend::LayerDone<'_>,
    ) -> Result<Vec<engine::SeqOutput>, engine::EngineError> {
        self.0.prefill(cache, batch, on_layer)
    }
    fn decode(&self, cache: &KvCache, batch: &[SeqInput<'_>]) -> Result<Vec<engine::SeqOutput>, engine::EngineError> {
        self.0.decode(cache, batch)
    }
    fn mtp(
        &self,
        cache: &KvCache,
        batch: &[engine::MtpInput<'_>],
        form: engine::AttnForm,
        on_layer: engine::backend::LayerDone<'_>,
    ) -> Result<Vec<engine::SeqOutput>, engine::EngineError> {
        self.0.mtp(cache, batch, form, on_layer)
    }
    fn decode_whole_step(
        &self,
        cache: &KvCache,
        batch: &[engine::StepInput<'_>],
        eos: &[u32],
    ) -> Result<Option<Vec<engine::StepSamples>>, engine::EngineError> {
        if !self.1 {
            return Ok(None);
        }
        generate::decode_whole_step_by_parts(self.0.as_ref(), cache, batch, eos).map(Some)
    }
}

/// `generate::decode_step` over whole steps (what a backend's `decode_whole_step` computes, here by the
/// separate calls) emits what the separate calls emit: tokens, logprobs, drafts and verdicts, with drafts
/// accepted and rejected (forced), a request finishing on the first token of an accepted draft's step
/// (max_tokens of both parities), greedy and seeded with penalties (row 1's history holds row 0's token).
#[test]
fn decode_steps_over_whole_steps_emit_what_the_separate_calls_emit() {
    let inner = backend(Precision::Fp8);
    let (plain, whole) = (
        Served::new(Arc::new(ByParts(inner.clone(), false)), BLOCKS),
        Served::new(Arc::new(ByParts(inner, true)), BLOCKS),
    );
    let toks = prompt(50, 9);
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(0) };
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 99,
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        min_tokens: 4,
        logprobs: Some(3),
        ..greedy.clone()
    };
    for (k, base) in [greedy, seeded].into_iter().enumerate() {
        for max_tokens in [11u32, 12] {
            let params = SamplingParams { max_tokens, ..base.clone() };
            let a = run(&plain, &toks, &params, true, 4096);
            let b = run(&whole, &toks, &params, true, 4096);
            assert_eq!(a.tokens, b.tokens, "params {k}, max_tokens {max_tokens}");
            assert_eq!(a.drafts, b.drafts, "params {k}, max_tokens {max_tokens}");
            assert_eq!((a.drafts_proposed, a.drafts_accepted), (b.drafts_proposed, b.drafts_accepted));
            assert_eq!(a.tokens.len(), max_tokens as usize);
        }
    }
    // Forced drafts: every one accepted (two tokens a step; with max_tokens 8 the last step's first token
    // finishes the request, its accepted draft's sample dropped) or every one rejected.
    for (max_tokens, force_accept) in [(8, true), (9, true), (9, false)] {
        let params = SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
        let target = ids(&run(&plain, &toks, &params, false, 4096));
        let got: Vec<_> = [&plain, &whole]
            .map(|e| {
                let (out, s) = forced(e, &toks, &params, &target, force_accept);
                (out, s.fed, s.drafts_accepted, s.drafts_proposed)
            })
            .to_vec();
        assert_eq!(
            got[0],
            got[1],
            "forced {}, max_tokens {max_tokens}",
            if force_accept { "accept" } else { "reject" }
        );
        assert_eq!(got[0].0.iter().map(|t| t.token).collect::<Vec<_>>(), target);
    }
}

#[test]
fn seeded_sampling_with_and_without_speculation_is_reproducible() {
    let e = env(Precision::Fp8);
    let toks = prompt(30, 8);
    let p = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 1234,
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    assert_eq!(ids(&run(&e, &toks, &p, false, 4096)), ids(&run(&e, &toks, &p, false, 7)));
    assert_eq!(ids(&run(&e, &toks, &p, true, 4096)), ids(&run(&e, &toks, &p, true, 4096)));
}

#[test]
fn seeded_sampling_is_the_same_alone_and_in_any_batch_after_a_hand_off() {
    // Request a alone, then: prefilled in chunks batched with b and c (other seeds, filters, lengths), its
    // state handed to a fresh SeqState the way a decode worker resumes it (first token and draft only),
    // and decoded batched with b and c, with and without MTP. The sampled tokens must be identical.
    let e = env(Precision::Fp8);
    let p = SamplingParams {
        temperature: 1.1,
        top_k: 40,
        seed: 4242,
        max_tokens: 14,
        ignore_eos: true,
        ..Default::default()
    };
    let a = prompt(70, 31);
    let alone = ids(&run(&e, &a, &p, false, 4096));
    assert_eq!(alone.len(), 14);
    for speculate in [false, true] {
        let pb = SamplingParams { seed: 5, temperature: 0.7, min_p: 0.05, ..p.clone() };
        let pc = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(14) };
        let (b, c) = (prompt(33, 32), prompt(130, 33));
        // b and c take their blocks first, so a's blocks sit elsewhere in the pool than when it ran alone.
        let tb = e.pool.reserve("b", b.len() + 20).unwrap();
        let tc = e.pool.reserve("c", c.len() + 20).unwrap();
        let ta = e.pool.reserve("a", a.len() + 20).unwrap();
        let mut sb = SeqState::new(b.clone(), pb, tb.blocks.clone(), 0);
        let mut sc = SeqState::new(c.clone(), pc, tc.blocks.clone(), 0);
        let mut sa = SeqState::new(a.clone(), p.clone(), ta.blocks.clone(), 0);
        for s in [&mut sa, &mut sb, &mut sc] {
            s.speculate = speculate;
        }
        let mut first = Vec::new();
        while !sa.prefill_done() {
            let at = usize::from(!sb.prefill_done());
            let (mut batch, mut chunks): (Vec<&mut SeqState>, Vec<usize>) = (Vec::new(), Vec::new());
            for (s, chunk) in [(&mut sb, 16), (&mut sa, 23), (&mut sc, 50)] {
                if !s.prefill_done() {
                    batch.push(s);
                    chunks.push(chunk);
                }
            }
            let out = generate::prefill(e.b.as_ref(), &e.cache, &mut batch, &chunks, &mut |_, _| {}).unwrap();
            first.extend(out[at].tokens.iter().map(|t| t.token));
        }
        for (s, chunk) in [(&mut sb, 16), (&mut sc, 50)] {
            while !s.prefill_done() {
                generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut *s], &[chunk], &mut |_, _| {}).unwrap();
            }
        }
        assert_eq!(first.len(), 1, "a's first token comes from its last prefill chunk");
        let mut ra = SeqState::resume(a.clone(), a.len(), first[0], sa.draft, p.clone(), ta.blocks.clone());
        ra.speculate = speculate;
        let mut got = first;
        while ra.finished.is_none() {
            let mut batch: Vec<&mut SeqState> = Vec::new();
            if sb.finished.is_none() {
                batch.push(&mut sb);
            }
            let at = batch.len();
            batch.push(&mut ra);
            if sc.finished.is_none() {
                batch.push(&mut sc);
            }
            let out = generate::decode_step(e.b.as_ref(), &e.cache, &mut batch).unwrap();
            got.extend(out[at].tokens.iter().map(|t| t.token));
        }
        assert_eq!(got, alone, "speculate {speculate}");
        for id in ["a", "b", "c"] {
            e.pool.release(id).unwrap();
        }
    }
}

#[test]
fn fp8_path_stays_close_to_full_precision() {
    let toks = prompt(80, 9);
    let fp8 = env(Precision::Fp8).prefill_all("fp8", &toks);
    let full = env(Precision::Full).prefill_all("full", &toks);
    let d = diff(&fp8, &full);
    let agree = (0..toks.len())
        .filter(|&p| argmax(&fp8[p * VOCAB..(p + 1) * VOCAB]) == argmax(&full[p * VOCAB..(p + 1) * VOCAB]))
        .count();
    println!("fp8 vs full on the tiny model: diff {d:.2e}, argmax agrees at {agree}/{} positions", toks.len());
    // A random model is sensitive: the FP8 latent cache alone (e4m3 tiles, ~2.4% RMS error per value)
    // gives diff ~2.4e-2 here, amplified by MoE routing and top-k choices that flip. The exactness of the
    // FP8 pieces is unit-tested (fp8, cache::format, cpu::linear). The prompt is fresh each run; over 16
    // runs the diff was 1.8e-2..3.05e-2 and the argmax agreed at 49..63 of 80 positions (mean 56, sd
    // ~3.5). The bounds sit 1.5x above the largest diff and ~3.4 sd below the mean agreement (55%); a
    // broken path gives diff near 1 and agrees almost nowhere.
    assert!(d < 0.045, "diff {d}");
    assert!(agree >= 44, "argmax agreement {agree}/{}", toks.len());
}

#[test]
fn greedy_generation_is_not_degenerate() {
    let e = env(Precision::Fp8);
    for salt in 10..13 {
        let g =
            run(&e, &prompt(20, salt), &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(48) }, true, 4096);
        let distinct: std::collections::HashSet<u32> = ids(&g).into_iter().collect();
        assert!(distinct.len() >= 12, "greedy output collapsed: {:?}", ids(&g));
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let e = env(Precision::Fp8);
    let t = e.pool.reserve("bad", 64).unwrap();
    let call = |tokens: &[u32], start: usize, blocks: &[engine::cache::BlockId]| {
        e.b.prefill(&e.cache, &[SeqInput { tokens, start, blocks, logits: Logits::Last }], &mut |_, _| {})
    };
    assert!(call(&[VOCAB as u32], 0, &t.blocks).unwrap_err().to_string().contains("vocab_size"));
    assert!(call(&[5; 65], 0, &t.blocks).unwrap_err().to_string().contains("blocks"));
    assert!(call(&[], 0, &t.blocks).unwrap_err().to_string().contains("no tokens"));
    assert!(
        call(&[5], 0, &[engine::cache::BlockId(BLOCKS as u32)]).unwrap_err().to_string().contains("outside the pool")
    );
    let wrong = KvCache::new_host(CacheGeometry::new(Precision::Full.cache_format(), e.b.entry_dims(), 5, 4)).unwrap();
    assert!(
        e.b.prefill(
            &wrong,
            &[SeqInput { tokens: &[5], start: 0, blocks: &t.blocks[..1], logits: Logits::Last }],
            &mut |_, _| {}
        )
        .is_err()
    );
    e.pool.release("bad").unwrap();
}

#[test]
fn layer_notifications_cover_every_cache_layer_in_order() {
    let e = env(Precision::Fp8);
    let toks = prompt(10, 11);
    let t = e.pool.reserve("notify", 16).unwrap();
    let mut s = SeqState::new(toks, SamplingParams::greedy(4), t.blocks, 0);
    let mut seen = Vec::new();
    generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut s], &[4096], &mut |l, ready: engine::LayerReady| {
        // A GPU announces a layer before its writes finish; the marker is reached.
        ready.wait().unwrap();
        assert!(ready.is_complete());
        seen.push(l.0)
    })
    .unwrap();
    assert_eq!(seen, (0..e.b.config().num_cache_layers() as u32).collect::<Vec<_>>());
    e.pool.release("notify").unwrap();
}

#[test]
fn re_prefill_after_preemption_continues_the_same_output() {
    // Bit-exact in FP8 too: the generated tokens are replayed in the decode form, as first computed.
    for prec in [Precision::Fp8, Precision::Full] {
        let e = env(prec);
        let toks = prompt(100, 12);
        for params in [
            SamplingParams { ignore_eos: true, ..SamplingParams::greedy(60) },
            SamplingParams {
                temperature: 0.8,
                seed: 99,
                max_tokens: 60,
                ignore_eos: true,
                presence_penalty: 0.5,
                ..Default::default()
            },
        ] {
            let full = ids(&run(&e, &toks, &params, true, 4096));
            // Preempted after k tokens: prompt + those k are prefilled again (in chunks of 16, so the
            // replay spans several chunks), then generation goes on.
            for k in [1, 7, 37] {
                let mut seq = toks.clone();
                seq.extend_from_slice(&full[..k]);
                let t = e.pool.reserve("cont", seq.len() + 70).unwrap();
                let mut s = SeqState::continuing(seq, toks.len(), params.clone(), t.blocks);
                let mut out: Vec<u32> = Vec::new();
                while !s.prefill_done() {
                    let mut layers = Vec::new();
                    let step =
                        generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut s], &[16], &mut |l, _| layers.push(l.0));
                    out.extend(step.unwrap().remove(0).tokens.iter().map(|t| t.token));
                    let main = e.b.config().num_hidden_layers as u32;
                    assert_eq!(
                        layers[..main as usize],
                        (0..main).collect::<Vec<_>>(),
                        "every chunk announces each layer"
                    );
                }
                while s.finished.is_none() {
                    let step = generate::decode_step(e.b.as_ref(), &e.cache, &mut [&mut s]).unwrap();
                    out.extend(step[0].tokens.iter().map(|t| t.token));
                }
                assert_eq!(
                    out,
                    full[k..].to_vec(),
                    "{prec:?}, temperature {}, preempted after {k}",
                    params.temperature
                );
                e.pool.release("cont").unwrap();
            }
        }
    }
}

/// What the re-prefill of a preempted request writes into the cache is byte-for-byte what the
/// uninterrupted run wrote (every main layer's latent entry at every position), in FP8: the generated
/// tokens are replayed in the decode form, not re-prefilled in the prefill form (the MHA form on the CPU;
/// the GPU's FP8 prefill is the absorbed form with the decode's bits).
#[test]
fn re_prefill_after_preemption_writes_the_same_cache_bytes() {
    let e = env(Precision::Fp8);
    let toks = prompt(150, 21);
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(48) };
    let (k, layers) = (40, e.b.config().num_hidden_layers);

    // Uninterrupted: prefill, then decode steps (with MTP drafts) until k tokens past the prompt are cached.
    let a = e.pool.reserve("whole", toks.len() + 64).unwrap();
    let mut s = SeqState::new(toks.clone(), params.clone(), a.blocks.clone(), 0);
    while !s.prefill_done() {
        generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut s], &[64], &mut |_, _| {}).unwrap();
    }
    while s.fed < toks.len() + k {
        generate::decode_step(e.b.as_ref(), &e.cache, &mut [&mut s]).unwrap();
    }
    let generated = s.generated()[..k].to_vec();

    // Preempted after k tokens: re-prefilled in chunks of 16 into other blocks.
    let mut seq = toks.clone();
    seq.extend_from_slice(&generated);
    let b = e.pool.reserve("again", seq.len() + 2).unwrap();
    let mut c = SeqState::continuing(seq, toks.len(), params, b.blocks.clone());
    while !c.prefill_done() {
        generate::prefill(e.b.as_ref(), &e.cache, &mut [&mut c], &[16], &mut |_, _| {}).unwrap();
    }
    assert_eq!(c.generated()[k], s.generated()[k], "the next sample");

    let mut differing = Vec::new();
    for l in 0..layers {
        for p in 0..toks.len() + k {
            let at = |blocks: &[engine::cache::BlockId]| {
                // Through the arena's staging copy, so the check reads a GPU's pool as well as host memory.
                let g = e.cache.geometry();
                let len = g.latent_bytes_per_token();
                let at = g.latent_block_offset(engine::cache::LayerIdx(l as u32), blocks[p / 64]) + (p % 64) * len;
                let mut bytes = vec![0u8; len];
                e.b.fence().wait().unwrap();
                // SAFETY: both reservations are held and no computation runs while we read.
                unsafe { e.cache.arena().copy_out(at, &mut bytes) }.unwrap();
                bytes
            };
            if at(&a.blocks) != at(&b.blocks) {
                differing.push((l, p));
            }
        }
    }
    assert!(
        differing.is_empty(),
        "latent entries differ at (layer, position) {:?}",
        &differing[..differing.len().min(10)]
    );
    e.pool.release("whole").unwrap();
    e.pool.release("again").unwrap();
}
