//! `tandem gen-tiny DIR [--seed N] [--mtp-layers N]`.

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
    /// MTP layers in the checkpoint (num_nextn_predict_layers); tandem serves the first.
    #[arg(long, env = "TANDEM_TINY_MTP_LAYERS", default_value_t = 1)]
    pub mtp_layers: usize,
}

/// Writes the tiny checkpoint: tokenizer first (its size is the model's vocab_size), then weights.
pub fn write(dir: &std::path::Path, seed: u64) -> anyhow::Result<()> {
    write_with_mtp_layers(dir, seed, 1)
}

/// As [`write`], with `mtp_layers` MTP layers.
pub fn write_with_mtp_layers(dir: &std::path::Path, seed: u64, mtp_layers: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tok = text::tiny::tokenizer().context("training the tiny tokenizer")?;
    text::tiny::write_files(dir).with_context(|| format!("writing the tokenizer into {}", dir.display()))?;
    engine::tiny::write_with_mtp_layers(dir, seed, tok.get_vocab_size(true), mtp_layers)
        .with_context(|| format!("writing weights into {}", dir.display()))?;
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    write_with_mtp_layers(&args.dir, args.seed, args.mtp_layers)?;
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
