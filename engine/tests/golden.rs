//! Against an independent implementation: `tests/golden/hf-tiny-v32` is a real-format FP8 checkpoint with
//! logits and greedy tokens computed by Hugging Face transformers' DeepseekV32ForCausalLM in float32 on the
//! dequantized weights (see tests/golden/README.md). In full precision tandem must reproduce them: logits
//! to ~1e-4 and the greedy tokens exactly, both by one-shot prefill and by prefill + decode steps. For the
//! FP8 path the agreement is reported.

use std::path::PathBuf;

use engine::cache::{BlockPool, CacheGeometry, KvCache};
use engine::checkpoint::Checkpoint;
use engine::cpu::{CpuBackend, TopkRows};
use engine::{Backend, Logits, Precision, SeqInput};

fn golden_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TANDEM_GOLDEN_DIR") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/hf-tiny-v32")
}

struct Case {
    ids: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let bytes = std::fs::read(golden_dir().join("golden.safetensors")).expect("golden.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    (0..4)
        .map(|i| Case {
            ids: ints(&format!("input_ids_{i}")),
            logits: st
                .tensor(&format!("logits_{i}"))
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            greedy: ints(&format!("greedy_{i}")),
        })
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// SPEC section 6: `1 - 2 sum(ab) / sum(a^2 + b^2)`.
fn diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += (*x as f64).powi(2) + (*y as f64).powi(2);
    }
    1.0 - 2.0 * ab / aa
}

struct Run {
    backend: CpuBackend,
    cache: KvCache,
    pool: BlockPool,
}

/// A backend whose top-k rows emulate a reference forward over `reference_len` tokens (see `TopkRows`).
fn setup(prec: Precision, rows: TopkRows) -> Run {
    let ckpt = Checkpoint::open(&golden_dir()).expect("golden checkpoint opens");
    assert_eq!(ckpt.config().num_nextn_predict_layers, 0);
    let backend = CpuBackend::from_checkpoint(&ckpt, prec).unwrap().with_topk_rows(rows);
    let geo = CacheGeometry::new(prec.cache_format(), backend.entry_dims(), backend.config().num_cache_layers(), 16);
    Run { backend, cache: KvCache::new_host(geo).unwrap(), pool: BlockPool::new(16) }
}

/// One-shot prefill of `tokens` with logits at every position.
fn prefill_all(r: &Run, tokens: &[u32]) -> Vec<f32> {
    let table = r.pool.reserve("oneshot", tokens.len()).unwrap();
    let out = r
        .backend
        .prefill(&r.cache, &[SeqInput { tokens, start: 0, blocks: &table.blocks, logits: Logits::All }], &mut |_, _| {})
        .unwrap();
    r.pool.release("oneshot").unwrap();
    r.backend.rows_to_host(&out[0].logits).unwrap()
}

/// Prefill the prompt, then greedy decode steps (one token each) through the paged cache.
fn greedy_by_decode(r: &Run, prompt: &[u32], n: usize) -> Vec<u32> {
    let table = r.pool.reserve("decode", prompt.len() + n).unwrap();
    let vocab = r.backend.config().vocab_size;
    let out = r
        .backend
        .prefill(
            &r.cache,
            &[SeqInput { tokens: prompt, start: 0, blocks: &table.blocks, logits: Logits::Last }],
            &mut |_, _| {},
        )
        .unwrap();
    let mut toks = vec![argmax(&r.backend.rows_to_host(&out[0].logits).unwrap()[..vocab])];
    while toks.len() < n {
        let pos = prompt.len() + toks.len() - 1;
        let last = [*toks.last().unwrap()];
        let out = r
            .backend
            .decode(&r.cache, &[SeqInput { tokens: &last, start: pos, blocks: &table.blocks, logits: Logits::Last }])
            .unwrap();
        toks.push(argmax(&r.backend.rows_to_host(&out[0].logits).unwrap()));
    }
    r.pool.release("decode").unwrap();
    toks
}

/// Greedy tokens read off one prefill of prompt + greedy[..n-1]: the argmax after each prefix.
fn greedy_by_one_shot(r: &Run, prompt: &[u32], greedy: &[u32]) -> Vec<u32> {
    let vocab = r.backend.config().vocab_size;
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&greedy[..greedy.len() - 1]);
    let all = prefill_all(r, &seq);
    (prompt.len() - 1..seq.len()).map(|p| argmax(&all[p * vocab..(p + 1) * vocab])).collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

// The reference ranks each prefill query over the whole masked sequence (its forward) and each
// generated token over its causal row (cached decode): rows padded to the prompt length emulate both.
// Exact ties at the top-k boundary are common (see engine::cpu::topk), so this emulation is what makes
// a bit-exact comparison possible.

#[test]
fn full_precision_reproduces_golden_logits() {
    for (i, c) in cases().iter().enumerate() {
        let r = setup(Precision::Full, TopkRows::PaddedTo(c.ids.len()));
        let logits = prefill_all(&r, &c.ids);
        assert_eq!(logits.len(), c.logits.len());
        let m = max_abs(&logits, &c.logits);
        println!(
            "seq {i} (len {}): max |logit - golden| = {m:.2e}, diff = {:.2e}",
            c.ids.len(),
            diff(&logits, &c.logits)
        );
        assert!(m < 1e-4, "seq {i}: logits differ by {m}");
    }
}

#[test]
fn full_precision_reproduces_golden_greedy_by_prefill_and_decode_steps() {
    for (i, c) in cases().iter().enumerate() {
        let r = setup(Precision::Full, TopkRows::PaddedTo(c.ids.len()));
        assert_eq!(greedy_by_decode(&r, &c.ids, c.greedy.len()), c.greedy, "seq {i}");
        assert_eq!(r.pool.stats().used_blocks, 0);
    }
}

#[test]
fn full_precision_reproduces_golden_greedy_by_one_shot_prefill() {
    for (i, c) in cases().iter().enumerate() {
        let r = setup(Precision::Full, TopkRows::PaddedTo(c.ids.len()));
        assert_eq!(greedy_by_one_shot(&r, &c.ids, &c.greedy), c.greedy, "seq {i}");
    }
}

#[test]
fn default_causal_rows_reproduce_golden_where_no_prompt_tie_differs() {
    // With tandem's batch-invariant causal rows, the prompt's rows are shorter than the reference's, so
    // exact ties can resolve differently; sequences 0..=2 have no such tie and must match fully.
    let r = setup(Precision::Full, TopkRows::Causal);
    for (i, c) in cases().iter().enumerate().take(3) {
        assert!(max_abs(&prefill_all(&r, &c.ids), &c.logits) < 1e-4, "seq {i}");
        assert_eq!(greedy_by_decode(&r, &c.ids, c.greedy.len()), c.greedy, "seq {i}");
        assert_eq!(greedy_by_one_shot(&r, &c.ids, &c.greedy), c.greedy, "seq {i}");
    }
}

#[test]
fn fp8_path_agreement_with_golden_is_reported() {
    let mut agree_total = 0;
    let mut total = 0;
    for (i, c) in cases().iter().enumerate() {
        let r = setup(Precision::Fp8, TopkRows::PaddedTo(c.ids.len()));
        let logits = prefill_all(&r, &c.ids);
        let d = diff(&logits, &c.logits);
        let decoded = greedy_by_decode(&r, &c.ids, c.greedy.len());
        // Agreement = length of the common prefix: after the first divergence the contexts differ.
        let agree = decoded.iter().zip(&c.greedy).take_while(|(a, b)| a == b).count();
        println!(
            "fp8 seq {i} (len {}): logits diff {d:.2e}; greedy agrees on the first {agree}/{}",
            c.ids.len(),
            c.greedy.len()
        );
        agree_total += agree;
        total += c.greedy.len();
        // This random golden model is very sensitive to FP8: quantizing the cached latent to e4m3 tiles
        // alone moves its logits by diff 2.4e-2 on seq 0 (bf16 k_pe alone: 2e-6), and the discrete choices
        // downstream (MoE experts, index top-k) then flip. A broken FP8 path (wrong scale, layout or
        // rounding) gives diff near 1; the bound catches that, the printed numbers are the report. The FP8 path itself is
        // checked against the full path on the well-conditioned tiny model (tests/model.rs).
        assert!(d < 0.5, "seq {i}: FP8 logits diff {d}");
    }
    println!("fp8 greedy agreement: {agree_total}/{total} tokens");
}
