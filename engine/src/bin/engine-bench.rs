//! Engine benchmark: prefill tokens/s for 512- and 2048-token prompts, decode tokens/s at batch 1 and 16
//! (`--batches`) over a 256-token context (`--context`), on the embedded tiny model or `--model` (a
//! checkpoint directory, or a synthetic model such as `synthetic:v32`: DeepSeek-V3.2's dimensions,
//! engine::synthetic). Prints a table and, with --json, one JSON object per measurement.
//!
//! cargo run --release -p engine --bin engine-bench -- [--json] [--out FILE] [--precision fp8|full]
//!     [--device cpu|cuda[:N]] [--threads N] [--decode-steps N] [--decode-only] [--model M]
//!     [--batches 1,16] [--context 256] [--blocks 2048] [--mtp] [--kernel-profile] [--graphs-ab]
//!     [--whole-step-ab] [--shared-context] [--prepare-decode]
//!
//! `--mtp` times speculative decode steps (the main model over the token and the MTP draft, then the MTP
//! layer): with random weights almost no draft is accepted, so tokens/s counts the accepted tokens only and
//! `extra.step_s` is the step time a projection (bench/gpu/projection.py) combines with an assumed rate.
//!
//! `--kernel-profile` (GPU) runs each measurement once more with every launch timed by CUDA events
//! (engine::cuda::profile) after the timed runs, and adds `extra.kernels` (per kernel: launches and seconds
//! per prefill or per decode step), `extra.kernel_s` (their sum) and for eagerly run decode steps
//! `extra.gpu_idle` = 1 - kernel_s / step_s, an estimate of the unprofiled step's share in which no kernel ran
//! (profiled steps never replay CUDA graphs, so it is left out where the timed steps did), biased low: a
//! kernel's start event is recorded before the host submits it, so where the slower profiled host falls
//! behind, its gap counts as kernel time. bench/gpu/kernel_plot.py draws the split as an SVG.
//!
//! Every decode record carries `extra.gpu_busy` (the timed steps' calls: GPU time inside them and the span
//! from the first to the last, engine::cuda::profile::BusyTimer) and `extra.gpu_idle_between_calls` = 1 -
//! busy / span: the GPU's share waiting for the host between calls (sampling's read-back, the scheduler,
//! the next step's inputs). With decode passes captured as CUDA graphs (engine::cuda::graphs, the default on
//! a GPU) each batch runs one untimed step first (it captures the shapes), and `extra.graphs` says how many
//! timed passes were replayed. `--graphs-ab` (GPU; under --ep every rank passes it) times each batch with
//! graphs on, then off (`decode_batch_N_eager`) on the same requests, which by then are a few positions
//! longer (the steps of the first mode). `--whole-step-ab` (GPU, one rank) times each batch with whole
//! decode steps on the device (`Backend::decode_whole_step`, the default), then with the separate calls
//! (`decode_batch_N_parts`).
//! `--prepare-decode` captures the decode steps before the decode measurements, as a decode worker does
//! before serving (`Backend::prepare_decode`, limits: the largest batch, contexts up to the longest measured),
//! and records the time and the graphs (`prepare_decode`).
//! `--shared-context` (GPU) prefills one context once and copies its caches into each request's
//! own blocks, each request sampling with its own seed (temperature 1): long contexts at large batches
//! without a prefill per request.
//!
//! `--ep RANK/WORLD@HOST:PORT` runs this process as one rank of an expert-parallel group (one per GPU, all
//! started together with the same flags); `--eplb` with `--eplb-redundant`, `--eplb-interval`,
//! `--eplb-window`, `--eplb-min-gain` balances the experts' load (engine::cuda::balance), and every record
//! then carries `extra.eplb` (the busiest GPU's load over the mean as sharded and as placed, layers moved).
//! `--warmup-steps N` runs N untimed prefills and N untimed decode steps before the timed ones.
//! `--dbo auto|on|off|auto:D,P` sets dual-batch overlap (engine::cuda::ep::Dbo), and `--timeline FILE` writes
//! the stages of one more untimed call per measurement (main and second stream, each micro-batch) as JSON
//! for bench/gpu/timeline_plot.py.

use std::time::Instant;

use engine::cache::{BlockPool, CacheGeometry};
use engine::checkpoint::Checkpoint;
use engine::device::{BackendOptions, load_backend};
use engine::generate::{self, SeqState};
use engine::sampling::SamplingParams;
use engine::{Device, Precision};

/// Most tokens of one prefill call when the decode measurements fill their contexts.
const PREFILL_CHUNK: usize = 2048;

struct Opts {
    json: bool,
    out: Option<String>,
    precision: Precision,
    device: Device,
    threads: Option<usize>,
    decode_steps: usize,
    /// Only the decode measurements (for profilers).
    decode_only: bool,
    model: Option<String>,
    batches: Vec<usize>,
    context: usize,
    blocks: usize,
    /// Decode steps with MTP speculation (a draft token verified each step) instead of plain steps.
    mtp: bool,
    /// A per-kernel split of each measurement (one more profiled run).
    kernel_profile: bool,
    /// Each decode measurement with the decode passes' CUDA graphs on, then off.
    graphs_ab: bool,
    whole_step_ab: bool,
    /// Decode batches over one prefilled context copied into each request (CUDA only).
    shared_context: bool,
    prepare_decode: bool,
    /// This process as one rank of an expert-parallel group (`RANK/WORLD@HOST:PORT`).
    ep: Option<engine::cuda::ep::EpConfig>,
    /// Capacities (rows per rank) to time the expert-parallel exchange at, before the other measurements.
    ep_exchange: Vec<usize>,
    /// Expert-parallel load balancing (`--eplb` and its settings; applied to `ep`).
    eplb: engine::eplb::EplbConfig,
    /// Untimed decode steps before each timed decode measurement (load balancing settles in them).
    warmup_steps: usize,
    /// Dual-batch overlap under `--ep` (`auto`, `on`, `off`, `auto:DECODE_ROWS,PREFILL_ROWS`).
    dbo: Option<engine::cuda::ep::Dbo>,
    /// Where to write the stages of one more (untimed) call per measurement, under `--ep`.
    timeline: Option<String>,
    /// Prompt lengths of the prefill measurements.
    prefill_lens: Vec<usize>,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        json: false,
        out: None,
        precision: Precision::Fp8,
        device: Device::Cpu,
        threads: None,
        decode_steps: 32,
        decode_only: false,
        model: None,
        batches: vec![1, 16],
        context: 256,
        blocks: 2048,
        mtp: false,
        kernel_profile: false,
        graphs_ab: false,
        whole_step_ab: false,
        shared_context: false,
        prepare_decode: false,
        ep: None,
        ep_exchange: Vec::new(),
        eplb: Default::default(),
        warmup_steps: 0,
        dbo: None,
        timeline: None,
        prefill_lens: vec![512, 2048],
    };
    let list = |v: Option<String>, what: &str, example: &str| -> Result<Vec<usize>, String> {
        let v = v.ok_or(format!("{what} needs a list such as {example}"))?;
        v.split(',')
            .map(|b| b.trim().parse().ok().filter(|&n: &usize| n > 0))
            .collect::<Option<_>>()
            .ok_or(format!("{what} {v}: positive numbers, comma-separated"))
    };
    let number = |v: Option<String>, what: &str| -> Result<usize, String> {
        v.and_then(|v| v.parse().ok()).filter(|&n| n > 0).ok_or(format!("{what} needs a positive number"))
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--json" => o.json = true,
            "--decode-only" => o.decode_only = true,
            "--out" => o.out = Some(args.next().ok_or("--out needs a file")?),
            "--precision" => o.precision = args.next().ok_or("--precision needs a value")?.parse()?,
            "--device" => o.device = args.next().ok_or("--device needs a value")?.parse()?,
            "--threads" => {
                o.threads = Some(args.next().and_then(|v| v.parse().ok()).ok_or("--threads needs a number")?)
            }
            "--decode-steps" => {
                o.decode_steps = args.next().and_then(|v| v.parse().ok()).ok_or("--decode-steps needs a number")?
            }
            "--model" => o.model = Some(args.next().ok_or("--model needs a checkpoint directory or synthetic:...")?),
            "--batches" => o.batches = list(args.next(), "--batches", "1,16")?,
            "--context" => o.context = number(args.next(), "--context")?,
            "--prefill-lens" => o.prefill_lens = list(args.next(), "--prefill-lens", "512,2048")?,
            "--mtp" => o.mtp = true,
            "--kernel-profile" => o.kernel_profile = true,
            "--graphs-ab" => o.graphs_ab = true,
            "--whole-step-ab" => o.whole_step_ab = true,
            "--shared-context" => o.shared_context = true,
            "--prepare-decode" => o.prepare_decode = true,
            "--blocks" => o.blocks = number(args.next(), "--blocks")?,
            "--ep" => {
                o.ep = Some(engine::cuda::ep::EpConfig::parse(&args.next().ok_or("--ep needs RANK/WORLD@HOST:PORT")?)?)
            }
            "--ep-exchange" => o.ep_exchange = list(args.next(), "--ep-exchange", "64,1024 (rows per rank)")?,
            "--dbo" => o.dbo = Some(engine::cuda::ep::Dbo::parse(&args.next().ok_or("--dbo needs auto, on or off")?)?),
            "--timeline" => o.timeline = Some(args.next().ok_or("--timeline needs a file")?),
            "--eplb" => o.eplb.rebalance = true,
            "--eplb-redundant" => {
                o.eplb.redundant = args.next().and_then(|v| v.parse().ok()).ok_or("--eplb-redundant needs a number")?
            }
            "--eplb-interval" => o.eplb.interval = number(args.next(), "--eplb-interval")?,
            "--eplb-window" => o.eplb.window = number(args.next(), "--eplb-window")?,
            "--eplb-min-gain" => {
                o.eplb.min_gain = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|g: &f64| (0.0..1.0).contains(g))
                    .ok_or("--eplb-min-gain needs a fraction in [0, 1)")?
            }
            "--warmup-steps" => {
                o.warmup_steps = args.next().and_then(|v| v.parse().ok()).ok_or("--warmup-steps needs a number")?
            }
            "-h" | "--help" => {
                println!(
                    "engine-bench [--json] [--out FILE] [--precision fp8|full] [--device cpu|cuda[:N]] [--threads N] \
                     [--decode-steps N] [--decode-only] [--model DIR|synthetic:v32[,...]] [--batches 1,16] [--prefill-lens 512,2048] \
                     [--context 256] [--blocks 2048] [--mtp] [--kernel-profile] [--warmup-steps N] [--graphs-ab] [--whole-step-ab] [--shared-context] [--prepare-decode] \
                     [--ep RANK/WORLD@HOST:PORT [--ep-exchange 64,1024] [--eplb] [--eplb-redundant N] \
                     [--eplb-interval STEPS] [--eplb-window LOOKS] [--eplb-min-gain F] \
                     [--dbo auto|on|off|auto:D,P] [--timeline FILE]]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if let Some(ep) = &mut o.ep {
        ep.eplb = o.eplb;
        if let Some(d) = o.dbo {
            ep.dbo = d;
        }
    } else if o.eplb != engine::eplb::EplbConfig::default() || o.dbo.is_some() || o.timeline.is_some() {
        return Err("--eplb, --dbo and --timeline are about an expert-parallel group: they need --ep".into());
    }
    Ok(o)
}

/// The expert-parallel exchange alone at each `--ep-exchange` capacity, next to plain NCCL all-to-alls of the
/// same bytes (engine::cuda::ep::time_exchange), one JSON line each: bus bandwidth = (world - 1) / world x
/// bytes received per rank / time, NCCL's convention for all-to-all. The dispatch is the ids' pack and the
/// record's exchange; the rows' FP8 quantization before it (`quantize_us`) is the shared expert's input
/// quantization too, which every GPU runs with or without expert parallelism.
fn exchange(cb: &engine::cuda::CudaBackend, o: &Opts, cfg: &engine::ModelConfig) {
    let ep = cb.ep_group().expect("an expert-parallel backend");
    let world = ep.shard().world as f64;
    for &cap in &o.ep_exchange {
        let cap = cap.next_multiple_of(4);
        let t = engine::cuda::ep::time_exchange(cb.gpu(), ep, cfg, cap, 20).expect("exchange");
        let bus = |bytes: usize, s: f64| (world - 1.0) / world * bytes as f64 / s / 1e9;
        let line = serde_json::json!({
            "bench": "ep_exchange", "cap": cap, "world": world, "hidden": cfg.hidden_size, "k": cfg.num_experts_per_tok,
            "dispatch_mib_per_rank": t.dispatch_bytes as f64 / 1048576.0,
            "combine_mib_per_rank": t.combine_bytes as f64 / 1048576.0,
            "quantize_us": t.quantize_s * 1e6,
            "dispatch_us": t.dispatch_s * 1e6, "a2a_dispatch_us": t.a2a_dispatch_s * 1e6,
            "combine_us": t.combine_s * 1e6, "a2a_combine_us": t.a2a_combine_s * 1e6,
            "dispatch_gbps": bus(t.dispatch_bytes, t.dispatch_s), "a2a_dispatch_gbps": bus(t.dispatch_bytes, t.a2a_dispatch_s),
            "combine_gbps": bus(t.combine_bytes, t.combine_s), "a2a_combine_gbps": bus(t.combine_bytes, t.a2a_combine_s),
            "dispatch_vs_a2a": t.a2a_dispatch_s / t.dispatch_s, "combine_vs_a2a": t.a2a_combine_s / t.combine_s,
            "gather_us": t.gather_s * 1e6, "gather_p2p_us": t.gather_p2p_s * 1e6,
            "gather_vs_a2a": t.a2a_dispatch_s / t.gather_s, "gather_p2p_vs_a2a": t.a2a_dispatch_s / t.gather_p2p_s,
        });
        if o.json {
            println!("{line}");
        } else {
            println!(
                "ep_exchange cap {cap:>5}: quantize {:>7.1} us, dispatch {:>7.1} MiB {:>8.1} us ({:.2}x a2a), combine {:>7.1} MiB {:>8.1} us ({:.2}x a2a)",
                t.quantize_s * 1e6,
                t.dispatch_bytes as f64 / 1048576.0,
                t.dispatch_s * 1e6,
                t.a2a_dispatch_s / t.dispatch_s,
                t.combine_bytes as f64 / 1048576.0,
                t.combine_s * 1e6,
                t.a2a_combine_s / t.combine_s
            );
        }
    }
}

/// Decode steps run with the kernel profile on (after the timed ones; the cache blocks reserved cover them).
const PROFILED_STEPS: usize = 2;

/// The kernel times of `run`, per repetition (`reps` of the measured work in it).
fn profiled(b: &dyn engine::Backend, reps: usize, run: impl FnOnce()) -> Vec<engine::KernelTime> {
    b.take_kernel_profile().expect("kernel profile");
    b.set_kernel_profile(true);
    run();
    b.set_kernel_profile(false);
    let mut k = b.take_kernel_profile().expect("kernel profile");
    for t in &mut k {
        t.seconds /= reps as f64;
        t.launches = t.launches.div_ceil(reps as u64);
    }
    k
}

/// `extra.kernels`, `extra.kernel_s` and, given the unprofiled step time, `extra.gpu_idle`.
fn add_profile(extra: &mut serde_json::Value, kernels: Vec<engine::KernelTime>, step_s: Option<f64>) {
    let total: f64 = kernels.iter().map(|k| k.seconds).sum();
    extra["kernels"] = kernels
        .iter()
        .map(|k| serde_json::json!({"name": k.name, "launches": k.launches, "seconds": k.seconds}))
        .collect();
    extra["kernel_s"] = total.into();
    if let Some(s) = step_s {
        extra["gpu_idle"] = (1.0 - total / s).into();
    }
}

/// Prefills all of `seq`'s prompt in chunks of at most [`PREFILL_CHUNK`] tokens (as a prefill worker chunks
/// long prompts).
fn prefill_whole(b: &dyn engine::Backend, cache: &engine::cache::KvCache, seq: &mut SeqState) {
    while !seq.prefill_done() {
        let chunk = seq.prefill_chunk_max().min(PREFILL_CHUNK);
        generate::prefill(b, cache, &mut [&mut *seq], &[chunk], &mut |_, _| {}).expect("prefill");
    }
}

fn prompt(n: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 7 + (i.wrapping_mul(2654435761).wrapping_add(salt * 97) >> 7) % (vocab - 7)).collect()
}

/// A sequence's cache blocks, or a clear error (exit 2) when the bench's pool, sized by `--blocks`, is too
/// small for the lengths and batches asked for.
fn reserved<T, E: std::fmt::Debug>(r: Result<T, E>, pool_blocks: usize) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("engine-bench: {e:?}: --blocks {pool_blocks} is too few for these lengths and batches; raise it");
        std::process::exit(2)
    })
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("engine-bench: {e}");
            std::process::exit(2);
        }
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let opened = match &o.model {
        Some(m) => Checkpoint::open_model(std::path::Path::new(m)),
        None => engine::tiny::write(dir.path(), 0, 1280).and_then(|()| Checkpoint::open(dir.path())),
    };
    let ckpt = match opened {
        Ok(c) => c,
        Err(e) => {
            eprintln!("engine-bench: {e}");
            std::process::exit(1);
        }
    };
    // On a GPU the CUDA backend itself (under expert parallelism its group times the exchange;
    // --shared-context copies caches with it).
    let mut cuda = None;
    let loaded = match (&o.ep, o.device) {
        (ep, engine::Device::Cuda(n)) => {
            let cache = engine::cuda::kernels::default_cache_dir();
            let loaded = match ep {
                Some(ep) => engine::cuda::CudaBackend::load_ep(&ckpt, o.precision, n as usize, &cache, ep),
                None => engine::cuda::CudaBackend::load(&ckpt, o.precision, n as usize, &cache),
            };
            loaded.map(|c| {
                let c = std::sync::Arc::new(c);
                cuda = Some(c.clone());
                c as std::sync::Arc<dyn engine::Backend>
            })
        }
        (Some(_), _) => Err(engine::EngineError::Unsupported("--ep needs --device cuda[:N]".into())),
        (None, _) => {
            load_backend(&ckpt, BackendOptions { device: o.device, precision: o.precision, threads: o.threads })
        }
    };
    let b = match loaded {
        Ok(b) => b,
        Err(e) => {
            eprintln!("engine-bench: {e}");
            std::process::exit(1);
        }
    };
    let b = b.as_ref();
    let cfg = b.config().clone();
    if let Some(ep) = &o.ep {
        // Every rank runs the same measurements on its own requests (data-parallel attention), in lockstep.
        eprintln!("engine-bench: rank {} of {} (expert parallelism)", ep.rank, ep.world);
        if !o.ep_exchange.is_empty() {
            exchange(cuda.as_deref().expect("the CUDA backend"), &o, &cfg);
        }
    } else if !o.ep_exchange.is_empty() {
        eprintln!("engine-bench: --ep-exchange times the expert-parallel exchange: it needs --ep");
        std::process::exit(2);
    }
    if o.graphs_ab && cuda.is_none() {
        eprintln!("engine-bench: --graphs-ab compares CUDA graphs with eager passes: it needs --device cuda");
        std::process::exit(2);
    }
    if o.whole_step_ab && (cuda.is_none() || o.ep.is_some() || o.graphs_ab) {
        eprintln!(
            "engine-bench: --whole-step-ab compares whole decode steps with separate calls: it needs --device cuda, \
             no --ep, no --graphs-ab"
        );
        std::process::exit(2);
    }
    if o.shared_context && cuda.is_none() {
        eprintln!("engine-bench: --shared-context copies caches on the GPU: it needs --device cuda");
        std::process::exit(2);
    }
    if o.kernel_profile && b.name() != "cuda" {
        eprintln!("engine-bench: --kernel-profile times GPU kernels: it needs --device cuda");
        std::process::exit(2);
    }
    if o.mtp && cfg.num_served_mtp_layers() == 0 {
        eprintln!("engine-bench: --mtp needs a model with an MTP layer");
        std::process::exit(2);
    }
    let blocks = o.blocks;
    let geo = CacheGeometry::new(o.precision.cache_format(), b.entry_dims(), b.cache_layers(), blocks);
    let cache = b.allocate_cache(geo).expect("cache");
    let pool = BlockPool::new(blocks);
    let threads = o.threads.unwrap_or_else(rayon::current_num_threads);
    let mut results = Vec::new();
    let mut timelines: std::collections::BTreeMap<String, Vec<engine::cuda::ep::StageTime>> = Default::default();
    let mut record = |name: &str, tokens: usize, secs: f64, extra: serde_json::Value| {
        let tps = tokens as f64 / secs;
        let line = serde_json::json!({
            "model": o.model.as_deref().unwrap_or("tiny"),
            "bench": name, "precision": o.precision.name(), "device": o.device.to_string(), "threads": threads,
            "tokens": tokens, "seconds": secs, "tokens_per_s": tps, "extra": extra,
        });
        if o.json {
            println!("{line}");
        } else {
            println!("{name:<28} {tokens:>6} tokens {secs:>8.3} s {tps:>10.1} tok/s");
        }
        results.push(line);
    };

    let prefill_lens: &[usize] = if o.decode_only { &[] } else { &o.prefill_lens };
    if !prefill_lens.is_empty() {
        // Untimed prefills first (load balancing settles in them, as in the decode warm-up).
        let toks = prompt(512, 7, cfg.vocab_size as u32);
        for i in 0..o.warmup_steps {
            let id = format!("w{i}");
            let t = reserved(pool.reserve(&id, toks.len() + 2), o.blocks);
            let mut s = SeqState::new(toks.clone(), SamplingParams::greedy(1), t.blocks, 0);
            generate::prefill(b, &cache, &mut [&mut s], &[toks.len()], &mut |_, _| {}).expect("prefill");
            pool.release(&id).expect("release");
        }
    }
    for &len in prefill_lens {
        let toks = prompt(len, len as u32, cfg.vocab_size as u32);
        let mut best = f64::MAX;
        for rep in 0..2 {
            let id = format!("p{len}-{rep}");
            let t = reserved(pool.reserve(&id, len + 2), o.blocks);
            let mut s = SeqState::new(toks.clone(), SamplingParams::greedy(1), t.blocks, 0);
            let start = Instant::now();
            generate::prefill(b, &cache, &mut [&mut s], &[len], &mut |_, _| {}).expect("prefill");
            best = best.min(start.elapsed().as_secs_f64());
            pool.release(&id).expect("release");
        }
        let mut extra = serde_json::json!({"includes_mtp": cfg.num_nextn_predict_layers > 0});
        if let Some(st) = cuda.as_ref().and_then(|c| c.eplb_stats()) {
            extra["eplb"] = serde_json::to_value(&st).expect("json");
            extra["eplb_on"] = o.eplb.rebalance.into();
        }
        if o.kernel_profile {
            let id = format!("p{len}-profiled");
            let t = reserved(pool.reserve(&id, len + 2), o.blocks);
            let mut s = SeqState::new(toks.clone(), SamplingParams::greedy(1), t.blocks, 0);
            let kernels = profiled(b, 1, || {
                generate::prefill(b, &cache, &mut [&mut s], &[len], &mut |_, _| {}).expect("prefill");
            });
            pool.release(&id).expect("release");
            add_profile(&mut extra, kernels, None);
        }
        if let (Some(c), Some(_)) = (&cuda, &o.timeline) {
            c.record_timeline(true);
            let id = format!("p{len}-timeline");
            let t = reserved(pool.reserve(&id, len + 2), o.blocks);
            let mut s = SeqState::new(toks.clone(), SamplingParams::greedy(1), t.blocks, 0);
            generate::prefill(b, &cache, &mut [&mut s], &[len], &mut |_, _| {}).expect("prefill");
            pool.release(&id).expect("release");
            timelines.insert(format!("prefill_{len}"), c.take_timeline().expect("timeline"));
            c.record_timeline(false);
        }
        record(&format!("prefill_{len}"), len, best, extra);
    }

    // --shared-context: one prefill of the context for every batch, its caches copied into each request's own
    // blocks (distinct memory, so no request reads another's cache through L2), each request sampling with its
    // own seed (temperature 1), so their tokens, and so their experts and selections, part from the first step.
    let shared = match cuda.as_deref().filter(|_| o.shared_context) {
        Some(_) => {
            let t = reserved(pool.reserve("context", o.context + 1), o.blocks);
            let mut base = SeqState::new(
                prompt(o.context, 0, cfg.vocab_size as u32),
                SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10_000) },
                t.blocks.clone(),
                0,
            );
            base.speculate = o.mtp;
            prefill_whole(b, &cache, &mut base);
            Some((t, base))
        }
        None => None,
    };
    if o.prepare_decode && !o.batches.is_empty() {
        let most = o.batches.iter().copied().max().unwrap_or(1);
        let room = o.context + (2 * o.decode_steps + o.warmup_steps + PROFILED_STEPS) * 4 + 8;
        let limits = engine::memory::ServingLimits {
            max_num_batched_tokens: 2 * most,
            max_num_seqs: most,
            decode_graphs: Some(room),
        };
        let start = Instant::now();
        let prepared = b.prepare_decode(&cache, &limits, room).expect("prepare decode");
        let secs = start.elapsed().as_secs_f64();
        let graphs = prepared.map(|g| serde_json::to_value(g).expect("json"));
        record(
            "prepare_decode",
            0,
            secs,
            serde_json::json!({ "graphs": graphs, "max_len": room, "max_num_seqs": most }),
        );
    }
    for &batch in &o.batches {
        let ctx = o.context;
        let room = ctx + (2 * o.decode_steps + o.warmup_steps + PROFILED_STEPS) * 4 + 8;
        let mut seqs: Vec<SeqState> = match cuda.as_deref().filter(|_| o.shared_context) {
            Some(c) => {
                let (t, base) = shared.as_ref().expect("the shared context is prefilled");
                let used = ctx.div_ceil(engine::cache::BLOCK_SIZE);
                (0..batch)
                    .map(|i| {
                        let own = reserved(pool.reserve(&format!("d{batch}-{i}"), room), o.blocks);
                        c.copy_blocks(&cache, &t.blocks[..used], &own.blocks[..used]).expect("copy the context");
                        let params = SamplingParams {
                            temperature: 1.0,
                            seed: i as u64 + 1,
                            ignore_eos: true,
                            ..SamplingParams::greedy(10_000)
                        };
                        let mut s = SeqState::resume(
                            base.tokens[..ctx].to_vec(),
                            ctx,
                            base.tokens[ctx],
                            base.draft,
                            params,
                            own.blocks,
                        );
                        s.speculate = o.mtp;
                        s
                    })
                    .collect()
            }
            None => {
                let mut seqs: Vec<SeqState> = (0..batch)
                    .map(|i| {
                        let t = reserved(pool.reserve(&format!("d{batch}-{i}"), room), o.blocks);
                        let mut s = SeqState::new(
                            prompt(ctx, i as u32, cfg.vocab_size as u32),
                            SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10_000) },
                            t.blocks,
                            0,
                        );
                        s.speculate = o.mtp;
                        s
                    })
                    .collect();
                // Each context on its own, in chunks of at most PREFILL_CHUNK tokens (as a prefill worker chunks
                // long prompts): one call for the whole batch would pass batch x context rows through every
                // linear.
                for seq in seqs.iter_mut() {
                    prefill_whole(b, &cache, seq);
                }
                seqs
            }
        };
        // With --graphs-ab the same sequences are timed with decode graphs on, then off (`_eager` records); with
        // --whole-step-ab with whole steps on, then off (`_parts`).
        let modes: &[Option<bool>] = if o.graphs_ab || o.whole_step_ab { &[Some(true), Some(false)] } else { &[None] };
        for &mode in modes {
            if let Some(on) = mode {
                if o.whole_step_ab {
                    cuda.as_ref().expect("checked: --whole-step-ab needs cuda").set_whole_steps(on);
                } else {
                    b.set_decode_graphs(on);
                }
            }
            let suffix = match mode {
                Some(false) if o.whole_step_ab => "_parts",
                Some(false) => "_eager",
                _ => "",
            };
            // One untimed step first where decode passes are captured as CUDA graphs: the first call of a shape
            // runs eagerly and then captures it (engine::cuda::graphs).
            let graphs_on = b.decode_graphs().is_some_and(|g| g.on);
            for _ in 0..o.warmup_steps.max(usize::from(graphs_on)) {
                let mut refs: Vec<&mut SeqState> = seqs.iter_mut().collect();
                generate::decode_step(b, &cache, &mut refs).expect("decode");
            }
            let moved_before = cuda.as_ref().and_then(|c| c.eplb_stats()).map_or(0, |s| s.layers_moved);
            let graphs_before = b.decode_graphs();
            b.set_busy_timer(true);
            let start = Instant::now();
            let mut produced = 0;
            for _ in 0..o.decode_steps {
                let mut refs: Vec<&mut SeqState> = seqs.iter_mut().collect();
                for out in generate::decode_step(b, &cache, &mut refs).expect("decode") {
                    produced += out.tokens.len();
                }
            }
            let secs = start.elapsed().as_secs_f64();
            b.set_busy_timer(false);
            let busy = b.take_busy_time().expect("busy time");
            let step_s = secs / o.decode_steps as f64;
            let mut extra = serde_json::json!({
                "context": ctx, "steps": o.decode_steps, "mtp": o.mtp, "batch": batch, "step_s": step_s,
                "warmup_steps": o.warmup_steps,
            });
            if let Some(busy) = busy.filter(|b| b.span_s > 0.0) {
                // The GPU's idle share between the timed steps' calls (engine::cuda::profile::BusyTimer).
                extra["gpu_busy"] = serde_json::to_value(busy).expect("json");
                extra["gpu_idle_between_calls"] = (1.0 - busy.busy_s / busy.span_s).into();
            }
            if let Some(c) = &cuda {
                extra["whole_step"] = c.whole_steps().into();
            }
            if let (Some(before), Some(after)) = (graphs_before, b.decode_graphs()) {
                extra["graphs"] = serde_json::json!({
                    "on": after.on,
                    "timed_replays": after.replays - before.replays,
                    "timed_captures": after.captures - before.captures,
                    "timed_eager": after.eager - before.eager,
                    "held": after.held, "nodes": after.nodes, "bytes": after.bytes, "capture_s": after.capture_s,
                });
            }
            if let Some(st) = cuda.as_ref().and_then(|c| c.eplb_stats()) {
                // Layers moved inside the timed steps cost time there: the record says how many.
                extra["eplb_moved_while_timed"] = (st.layers_moved - moved_before).into();
                extra["eplb"] = serde_json::to_value(&st).expect("json");
                extra["eplb_on"] = o.eplb.rebalance.into();
            }
            if o.kernel_profile && mode != Some(false) {
                let kernels = profiled(b, PROFILED_STEPS, || {
                    for _ in 0..PROFILED_STEPS {
                        let mut refs: Vec<&mut SeqState> = seqs.iter_mut().collect();
                        generate::decode_step(b, &cache, &mut refs).expect("decode");
                    }
                });
                // Profiled steps run eagerly: their kernel sum says nothing about a replayed step's idle time.
                let replayed = extra["graphs"]["timed_replays"].as_u64().is_some_and(|n| n > 0);
                add_profile(&mut extra, kernels, (!replayed).then_some(step_s));
            }
            if let (Some(c), Some(_), true) = (&cuda, &o.timeline, mode != Some(false)) {
                c.record_timeline(true);
                let mut refs: Vec<&mut SeqState> = seqs.iter_mut().collect();
                generate::decode_step(b, &cache, &mut refs).expect("decode");
                timelines.insert(format!("decode_batch_{batch}"), c.take_timeline().expect("timeline"));
                c.record_timeline(false);
            }
            record(&format!("decode_batch_{batch}{suffix}"), produced, secs, extra);
        }
        for i in 0..batch {
            pool.release(&format!("d{batch}-{i}")).expect("release");
        }
    }
    if let Some(path) = &o.timeline {
        let body = serde_json::to_string(&timelines).expect("json");
        if let Err(e) = std::fs::write(path, body + "\n") {
            eprintln!("engine-bench: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
    if let Some(path) = o.out {
        let body = serde_json::to_string_pretty(&results).expect("json");
        if let Err(e) = std::fs::write(&path, body + "\n") {
            eprintln!("engine-bench: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
