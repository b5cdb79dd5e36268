use clap::Parser;

fn main() -> std::process::ExitCode {
    worker::ucx_logs_to_stderr();
    let args = decode_worker::Args::parse();
    args.serve.log.init();
    let run = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(decode_worker::run(args)));
    match run {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode-worker: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
