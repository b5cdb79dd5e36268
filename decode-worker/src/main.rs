use clap::Parser;

fn main() -> std::process::ExitCode {
    worker::ucx_logs_to_stderr();
    let args = decode_worker::Args::parse();
    args.serve.log.init();
    worker::run_main("decode-worker", decode_worker::run(args))
}
