use clap::Parser;

fn main() -> std::process::ExitCode {
    worker::ucx_logs_to_stderr();
    let args = prefill_worker::Args::parse();
    args.serve.log.init();
    worker::run_main("prefill-worker", prefill_worker::run(args))
}
