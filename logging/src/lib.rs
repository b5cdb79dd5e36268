//! How every tandem process logs: `tracing` events to stderr (stdout carries the workers' machine-readable
//! ready line), filtered by `RUST_LOG` (default `info`), as text or as JSON lines (`--log-format`).
//!
//! Each role (router, prefill worker, decode worker; also as `tandem <role>`) flattens [`LogArgs`] into its
//! flags and calls [`LogArgs::init`] once, first thing in `main`; other commands call [`init`].

use std::io::IsTerminal;

/// The shape of log lines on stderr.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `--log-format text|json` (`TANDEM_LOG_FORMAT`), flattened into each role's flags.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct LogArgs {
    /// Log lines on stderr: text, or json (one object per line). RUST_LOG sets the level (default info).
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// [`init`] with this format.
    pub fn init(&self) {
        init(self.log_format);
    }
}

/// Installs the process-wide subscriber. A second call keeps the first subscriber (tests call it freely).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(format == LogFormat::Text && std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn formats_parse_by_name_and_unknown_ones_list_the_valid_names() {
        assert_eq!(Cli::try_parse_from(["x"]).unwrap().log.log_format, LogFormat::Text);
        assert_eq!(Cli::try_parse_from(["x", "--log-format", "json"]).unwrap().log.log_format, LogFormat::Json);
        let err = Cli::try_parse_from(["x", "--log-format", "xml"]).err().unwrap().to_string();
        assert!(err.contains("text") && err.contains("json"), "{err}");
    }
}
