//! `tandem`: the command-line entry point. Each subcommand lives in its own module under `cli/`.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// tandem: a prefill/decode-disaggregated serving cluster for DeepSeek-V3.2-class models.
#[derive(Parser)]
#[command(name = "tandem", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a small DeepSeek-V3.2-architecture checkpoint (HF layout, FP8, MTP, tokenizer).
    GenTiny(cli::gen_tiny::Args),
    /// Check a checkpoint's files: every shard listed, parses, sizes match headers, optional sha256.
    Verify(cli::verify::Args),
    /// Generate text in this process on the CPU backend.
    Generate(cli::generate::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli::init_logging();
    let result = match cli.command {
        Command::GenTiny(a) => cli::gen_tiny::run(a),
        Command::Verify(a) => cli::verify::run(a),
        Command::Generate(a) => cli::generate::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
