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
    /// Generate text in this process (CPU or CUDA backend, --device).
    Generate(cli::generate::Args),
    /// Start a local cluster: router + prefill + decode workers as separate processes.
    Up(cli::up::Args),
    /// Compile every CUDA kernel with NVRTC for an architecture (no GPU needed) into the kernel cache.
    CompileKernels(cli::compile_kernels::Args),
    /// Benchmark an OpenAI-compatible server (SGLang bench_serving's summary; JSON with --json).
    Bench(cli::bench::Args),
    /// Run the router (the `tandem-router` binary).
    Router(router::Args),
    /// Run a prefill worker (the `prefill-worker` binary).
    PrefillWorker(prefill_worker::Args),
    /// Run a decode worker (the `decode-worker` binary).
    DecodeWorker(decode_worker::Args),
}

/// Runs an async role entry point on a fresh multi-threaded runtime.
fn serve<F: std::future::Future<Output = anyhow::Result<()>>>(f: impl FnOnce() -> F) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(f())?;
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    worker::ucx_logs_to_stderr();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Router(a) => {
            a.log.init();
            serve(|| async move { router::run(a).await.map_err(anyhow::Error::from) })
        }
        Command::PrefillWorker(a) => {
            a.serve.log.init();
            serve(|| prefill_worker::run(a))
        }
        Command::DecodeWorker(a) => {
            a.serve.log.init();
            serve(|| decode_worker::run(a))
        }
        command => {
            logging::init(logging::LogFormat::Text);
            match command {
                Command::GenTiny(a) => cli::gen_tiny::run(a),
                Command::Verify(a) => cli::verify::run(a),
                Command::Generate(a) => cli::generate::run(a),
                Command::Up(a) => cli::up::run(a),
                Command::Bench(a) => cli::bench::run(a),
                Command::CompileKernels(a) => cli::compile_kernels::run(a),
                Command::Router(_) | Command::PrefillWorker(_) | Command::DecodeWorker(_) => {
                    unreachable!("handled above")
                }
            }
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// What a Kubernetes pod runs takes every setting from a flag or its TANDEM_* environment variable.
    #[test]
    fn every_flag_of_what_pods_run_has_an_env_fallback() {
        let cli = super::Cli::command();
        for name in ["router", "prefill-worker", "decode-worker", "verify", "gen-tiny"] {
            let sub = cli.find_subcommand(name).expect(name);
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") || (name == "gen-tiny" && id == "dir") {
                    continue;
                }
                let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                assert!(env.as_deref().is_some_and(|e| e.starts_with("TANDEM_")), "{name} --{id} has no TANDEM_* env");
            }
        }
    }
}
