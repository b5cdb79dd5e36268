//! `tandem verify DIR [--sha256 MANIFEST]`.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (config.json, model.safetensors.index.json and shards).
    #[arg(env = "TANDEM_MODEL")]
    pub dir: PathBuf,
    /// A `sha256sum`-format manifest (`<digest>  <file>` per line) to check every listed file against.
    #[arg(long, env = "TANDEM_VERIFY_SHA256")]
    pub sha256: Option<PathBuf>,
    /// Also load every tensor against the config (names, shapes, dtypes).
    #[arg(long, env = "TANDEM_VERIFY_TENSORS")]
    pub tensors: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut report = engine::checkpoint::verify::verify(&args.dir, args.sha256.as_deref())?;
    if args.tensors
        && let Err(e) = engine::checkpoint::Checkpoint::open(&args.dir)
    {
        report.problems.push(e.to_string());
    }
    println!(
        "{}: {} shards, {} tensors, {} bytes{}",
        args.dir.display(),
        report.shards,
        report.tensors,
        report.bytes,
        if args.sha256.is_some() { format!(", {} files matched the manifest", report.hashed) } else { String::new() }
    );
    if report.ok() {
        println!("OK");
        return Ok(ExitCode::SUCCESS);
    }
    for p in &report.problems {
        println!("FAIL: {p}");
    }
    Ok(ExitCode::FAILURE)
}
