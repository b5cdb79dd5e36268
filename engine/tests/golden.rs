//! Against an independent implementation: Hugging Face transformers' DeepseekV32ForCausalLM in float32 on
//! the dequantized weights, with its indexer's top-k replaced by the rule of docs/model.md §2.6 (scripts/hf_golden.py), on
//! two checkpoints: `tests/golden/hf-tiny-v32` (a real-format FP8 checkpoint, committed) and tandem's own tiny
//! checkpoint (`tandem gen-tiny --seed 0`, regenerated here). In full precision tandem's default backend must
//! reproduce every sequence: logits to 1e-4 and the greedy tokens exactly, both by one-shot prefill and by
//! prefill + decode steps. For the FP8 path the agreement is reported (see tests/golden/README.md).

mod support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use engine::checkpoint::Checkpoint;
use engine::device::{BackendOptions, load_backend};
use engine::tolerance::diff;
use engine::{Logits, Precision, SeqInput};
use support::{Served, device, golden};

/// `tandem gen-tiny --seed 0`'s weights (vocab 1280) have this fingerprint; the golden file was computed
/// from exactly those bytes.
const TANDEM_TINY_FINGERPRINT: &str = "e4c13f067f1073753bd5430178b1d6329b79f41f2b0be20d1b0bd6bb4ee47418";
/// Teacher-forced FP8 greedy agreement with the golden tokens, at least, of 64 (half of the CPU backend's 18 and
/// 49; fp8_path_agreement_with_golden_is_reported).
const FORCED_LEAST_HF: usize = 9;
const FORCED_LEAST_TANDEM: usize = 24;

/// `tests/golden` of the source tree (`TANDEM_GOLDEN_ROOT` where the binary runs elsewhere, e.g. the GPU
/// machine).
fn golden_root() -> PathBuf {
    match std::env::var("TANDEM_GOLDEN_ROOT") {
        Ok(d) => PathBuf::from(d),
        Err(_) => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/golden"),
    }
}

fn hf_tiny_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TANDEM_GOLDEN_DIR") {
        return PathBuf::from(d);
    }
    golden_root().join("hf-tiny-v32")
}

/// tandem's own tiny checkpoint, regenerated (it is deterministic) rather than committed.
fn tandem_tiny_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        engine::tiny::write(d.path(), 0, 1280).unwrap();
        d
    })
    .path()
}

/// A checkpoint and the golden data computed from it.
struct Set {
    name: &'static str,
    checkpoint: PathBuf,
    golden: PathBuf,
}

fn sets() -> Vec<Set> {
    vec![
        Set { name: "hf-tiny-v32", checkpoint: hf_tiny_dir(), golden: hf_tiny_dir().join("golden.safetensors") },
        Set {
            name: "tandem-tiny",
            checkpoint: tandem_tiny_dir().to_path_buf(),
            golden: golden_root().join("tandem-tiny/golden.safetensors"),
        },
    ]
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

/// The default backend (no emulation of anything: the rule of docs/model.md §2.6 is the model's).
fn setup(set: &Set, prec: Precision) -> Served {
    let ckpt = Checkpoint::open(&set.checkpoint).expect("golden checkpoint opens");
    if set.name == "tandem-tiny" {
        assert_eq!(
            ckpt.fingerprint(),
            TANDEM_TINY_FINGERPRINT,
            "engine::tiny's weights changed: regenerate tests/golden/tandem-tiny (tests/golden/README.md)"
        );
    }
    let backend = load_backend(&ckpt, BackendOptions { device: device(), precision: prec, threads: None })
        .unwrap_or_else(|e| panic!("backend on {}: {e}", device()));
    Served::new(backend, 16)
}

/// Prefill the prompt, then greedy decode steps (one token each) through the paged cache.
fn greedy_by_decode(r: &Served, prompt: &[u32], n: usize) -> Vec<u32> {
    let table = r.pool.reserve("decode", prompt.len() + n).unwrap();
    let vocab = r.b.config().vocab_size;
    let out =
        r.b.prefill(
            &r.cache,
            &[SeqInput { tokens: prompt, start: 0, blocks: &table.blocks, logits: Logits::Last }],
            &mut |_, _| {},
        )
        .unwrap();
    let mut toks = vec![argmax(&r.b.rows_to_host(&out[0].logits).unwrap()[..vocab])];
    while toks.len() < n {
        let pos = prompt.len() + toks.len() - 1;
        let last = [*toks.last().unwrap()];
        let out = r
            .b
            .decode(&r.cache, &[SeqInput { tokens: &last, start: pos, blocks: &table.blocks, logits: Logits::Last }])
            .unwrap();
        toks.push(argmax(&r.b.rows_to_host(&out[0].logits).unwrap()));
    }
    r.pool.release("decode").unwrap();
    toks
}

/// Greedy tokens read off one prefill of prompt + greedy[..n-1]: the argmax after each prefix.
fn greedy_by_one_shot(r: &Served, prompt: &[u32], greedy: &[u32]) -> Vec<u32> {
    let vocab = r.b.config().vocab_size;
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&greedy[..greedy.len() - 1]);
    let all = r.prefill_all("oneshot", &seq);
    (prompt.len() - 1..seq.len()).map(|p| argmax(&all[p * vocab..(p + 1) * vocab])).collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

// The references ran HF transformers with the indexer's top-k replaced by the rule of docs/model.md §2.6 (a stable sort,
// scripts/hf_golden.py), so tandem's default causal selection must match every row of every sequence.

#[test]
fn full_precision_reproduces_golden_logits() {
    for set in sets() {
        let r = setup(&set, Precision::Full);
        for (i, c) in golden::cases(&set.golden).iter().enumerate() {
            let logits = r.prefill_all("oneshot", &c.ids);
            assert_eq!(logits.len(), c.logits.len());
            let m = max_abs(&logits, &c.logits);
            let d = diff(&logits, &c.logits);
            println!("{} seq {i} (len {}): max |logit - golden| = {m:.2e}, diff = {d:.2e}", set.name, c.ids.len());
            assert!(m < 1e-4, "{} seq {i}: logits differ by {m}", set.name);
            assert!(d < 1e-6, "{} seq {i}: diff {d}", set.name);
        }
    }
}

#[test]
fn full_precision_reproduces_golden_greedy_by_prefill_and_decode_steps() {
    for set in sets() {
        let r = setup(&set, Precision::Full);
        for (i, c) in golden::cases(&set.golden).iter().enumerate() {
            assert_eq!(greedy_by_decode(&r, &c.ids, c.greedy.len()), c.greedy, "{} seq {i}", set.name);
            assert_eq!(r.pool.stats().used_blocks, 0);
        }
    }
}

#[test]
fn full_precision_reproduces_golden_greedy_by_one_shot_prefill() {
    for set in sets() {
        let r = setup(&set, Precision::Full);
        for (i, c) in golden::cases(&set.golden).iter().enumerate() {
            assert_eq!(greedy_by_one_shot(&r, &c.ids, &c.greedy), c.greedy, "{} seq {i}", set.name);
        }
    }
}

#[test]
fn fp8_path_agreement_with_golden_is_reported() {
    for set in sets() {
        let (mut prefix_total, mut forced_total, mut total) = (0, 0, 0);
        let r = setup(&set, Precision::Fp8);
        for (i, c) in golden::cases(&set.golden).iter().enumerate() {
            let logits = r.prefill_all("oneshot", &c.ids);
            let d = diff(&logits, &c.logits);
            let decoded = greedy_by_decode(&r, &c.ids, c.greedy.len());
            // Free-running agreement = length of the common prefix: after the first divergence the contexts
            // differ, so one early flip decides it (reported). Teacher-forced agreement = positions where
            // the argmax after HF's own prefix is HF's token: every position counts on its own (asserted).
            let prefix = decoded.iter().zip(&c.greedy).take_while(|(a, b)| a == b).count();
            let forced =
                greedy_by_one_shot(&r, &c.ids, &c.greedy).iter().zip(&c.greedy).filter(|(a, b)| a == b).count();
            println!(
                "{} fp8 seq {i} (len {}): logits diff {d:.2e}; greedy agrees on the first {prefix}/{n}, \
                 teacher-forced on {forced}/{n}",
                set.name,
                c.ids.len(),
                n = c.greedy.len()
            );
            prefix_total += prefix;
            forced_total += forced;
            total += c.greedy.len();
            // The random hf-tiny-v32 model is very sensitive to FP8: quantizing the cached latent to e4m3
            // tiles alone moves its logits by diff 2.4e-2 on seq 0 (bf16 k_pe alone: 2e-6), and the discrete
            // choices downstream (MoE experts, index top-k) then flip. A broken FP8 path (wrong scale, layout
            // or rounding) gives diff near 1. The inputs are fixed, so the numbers repeat exactly; each bound
            // is the largest measured diff with a 15% margin for numerics changes of the same accuracy
            // (hf-tiny-v32: 3.07e-2, 5.80e-2, 1.29e-1, 2.97e-1; tandem-tiny: 1.17e-2, 1.23e-2, 1.36e-2,
            // 3.07e-2). The FP8 path itself is checked against the full path on the well-conditioned tiny
            // model (tests/model.rs).
            let bound = if set.name == "hf-tiny-v32" { 0.35 } else { 0.036 };
            assert!(d < bound, "{} seq {i}: FP8 logits diff {d} (bound {bound})", set.name);
        }
        println!(
            "{} fp8 greedy agreement: {prefix_total}/{total} tokens free-running, {forced_total}/{total} \
             teacher-forced",
            set.name
        );
        // Free-running, the random models flip their argmax under FP8 rounding within a few tokens (measured
        // 1-4/64 on hf-tiny-v32 depending on the backend's accumulation order), so that count only gets
        // reported. Teacher-forced, a flip costs one position: a working FP8 path agrees on most (the
        // bounds are half the measured counts, CPU and GPU); a broken one agrees by chance (1 in the vocab).
        let least = if set.name == "hf-tiny-v32" { FORCED_LEAST_HF } else { FORCED_LEAST_TANDEM };
        assert!(
            forced_total >= least,
            "{} fp8 teacher-forced greedy agreement {forced_total}/{total} (at least {least})",
            set.name
        );
    }
}
