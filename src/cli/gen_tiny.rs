//! `tandem gen-tiny DIR [--seed N]`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// Directory to write (created if missing; existing checkpoint files are overwritten).
    pub dir: PathBuf,
    /// Seed of the random weights: the same seed gives the same bytes.
    #[arg(long, env = "TANDEM_GEN_TINY_SEED", default_value_t = 0)]
    pub seed: u64,
}

/// Writes the tiny checkpoint: tokenizer first (its size is the model's vocab_size), then weights.
pub fn write(dir: &std::path::Path, seed: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tok = text::tiny::tokenizer().context("training the tiny tokenizer")?;
    text::tiny::write_files(dir).with_context(|| format!("writing the tokenizer into {}", dir.display()))?;
    engine::tiny::write(dir, seed, tok.get_vocab_size(true))
        .with_context(|| format!("writing weights into {}", dir.display()))?;
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    write(&args.dir, args.seed)?;
    let ckpt = engine::checkpoint::Checkpoint::open(&args.dir).context("re-opening the written checkpoint")?;
    println!(
        "wrote {} (seed {}): {} tensors in {} bytes, vocab {}, fingerprint {}",
        args.dir.display(),
        args.seed,
        ckpt.num_tensors(),
        ckpt.total_bytes(),
        ckpt.config().vocab_size,
        ckpt.fingerprint()
    );
    Ok(ExitCode::SUCCESS)
}
