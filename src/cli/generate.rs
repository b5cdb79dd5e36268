//! `tandem generate`: one request, in this process, on the backend `--device` selects: the same engine
//! code the workers run, so a cluster's greedy output can be checked against it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use engine::cache::{BlockPool, CacheGeometry};
use engine::checkpoint::Checkpoint;
use engine::device::{BackendOptions, load_backend};
use engine::sampling::{Finish, SamplingParams};
use engine::{Device, Precision};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory, or a synthetic model (`synthetic:v32[,...]`, engine::synthetic; pass --prompt-ids).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text (tokenized with the checkpoint's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated (for checkpoints without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Apply the chat template to the prompt as one user message.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Sampling seed (random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// fp8 (block-scaled FP8 weights/activations, FP8 caches) or full (f32 everything).
    #[arg(long, default_value = "fp8")]
    pub precision: Precision,
    /// Where the model runs: cpu, or cuda[:N] (the CUDA backend on GPU N).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// CPU compute threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Do not use MTP speculative decoding.
    #[arg(long)]
    pub no_mtp: bool,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 2048)]
    pub chunk: usize,
    /// Print one JSON object (prompt_token_ids, generated_token_ids, text, ...).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    engine::device::check_available(args.device)?;
    let ckpt =
        Checkpoint::open_model(&args.model).with_context(|| format!("opening checkpoint {}", args.model.display()))?;
    let opts = BackendOptions { device: args.device, precision: args.precision, threads: args.threads };
    let backend = load_backend(&ckpt, opts).with_context(|| format!("loading {}", args.model.display()))?;
    let cfg = backend.config().clone();
    let tokenizer = if args.model.join("tokenizer.json").exists() {
        Some(text::Tokenizer::from_dir(&args.model).context("loading the tokenizer")?)
    } else {
        None
    };
    let prompt_ids: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(p), None) => {
            let tok = tokenizer.as_ref().context("this checkpoint has no tokenizer.json; pass --prompt-ids")?;
            if args.chat {
                let template = text::ChatTemplate::resolve(None, tok.config())?;
                let msg = serde_json::json!({"role": "user", "content": p});
                let rendered = template.render(&[msg], true, &serde_json::Map::new())?;
                tok.encode(&rendered, false)?
            } else {
                tok.encode_prompt(p)?
            }
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(t) = prompt_ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        bail!("prompt token id {t} is outside the vocabulary of {}", cfg.vocab_size);
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed.unwrap_or_else(rand_seed),
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        ..Default::default()
    };
    params.validate(cfg.vocab_size).map_err(anyhow::Error::msg)?;
    let positions = prompt_ids.len() + args.max_tokens as usize + 2;
    if positions > cfg.max_position_embeddings {
        bail!(
            "prompt ({}) + max_tokens ({}) exceeds the model's {} positions",
            prompt_ids.len(),
            args.max_tokens,
            cfg.max_position_embeddings
        );
    }
    let blocks = CacheGeometry::blocks_for(positions);
    let geo = CacheGeometry::new(args.precision.cache_format(), backend.entry_dims(), backend.cache_layers(), blocks);
    let cache = backend.allocate_cache(geo).context("allocating the cache")?;
    let pool = BlockPool::new(blocks);
    let table = pool.reserve("generate", positions)?;
    let started = std::time::Instant::now();
    let g = engine::generate::generate(
        backend.as_ref(),
        &cache,
        prompt_ids.clone(),
        params,
        table.blocks,
        args.chunk,
        !args.no_mtp,
    )?;
    let elapsed = started.elapsed();
    pool.release("generate")?;
    let ids: Vec<u32> = g.tokens.iter().map(|t| t.token).collect();
    let text = match &tokenizer {
        Some(t) => t.decode(&ids, true)?,
        None => String::new(),
    };
    let finish = match g.finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
    };
    if args.json {
        let out = serde_json::json!({
            "prompt_token_ids": prompt_ids,
            "generated_token_ids": ids,
            "text": text,
            "finish_reason": finish,
            "mtp": {
                "drafts": g.drafts_proposed,
                "accepted": g.drafts_accepted,
                "steps": g.drafts.iter().map(|d| serde_json::json!({
                    "position": d.position, "draft_token_id": d.draft, "accepted": d.accepted,
                })).collect::<Vec<_>>(),
            },
            "precision": args.precision.name(),
            "seconds": elapsed.as_secs_f64(),
        });
        println!("{out}");
    } else {
        println!("{text}");
        eprintln!(
            "[{} prompt + {} generated tokens in {:.2}s, finish {finish}, MTP accepted {}/{}]",
            prompt_ids.len(),
            ids.len(),
            elapsed.as_secs_f64(),
            g.drafts_accepted,
            g.drafts_proposed
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
