use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = decode_worker::Args::parse();
    worker::init_logging();
    match decode_worker::run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode-worker: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
