use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = prefill_worker::Args::parse();
    worker::init_logging();
    match prefill_worker::run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefill-worker: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
