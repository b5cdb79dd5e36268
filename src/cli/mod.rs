//! Subcommands of the `tandem` binary.

pub mod bench;
pub mod compile_kernels;
pub mod gen_tiny;
pub mod generate;
pub mod up;
pub mod verify;

/// Logs to stderr; `RUST_LOG` filters (default: info).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
