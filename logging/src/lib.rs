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

/// Every log line of this process at every level, kept in memory instead of printed: for tests that check
/// what was logged (and that no secret was). The first call installs the process-wide subscriber (a test
/// binary that uses it must not install another); later calls return the same capture.
pub fn capture() -> &'static Capture {
    static CAPTURE: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAPTURE.get_or_init(|| {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .with_writer(move || CaptureWriter(sink.clone()))
            .finish();
        tracing_subscriber::util::SubscriberInitExt::try_init(subscriber)
            .expect("logging::capture installs the only subscriber of its process");
        Capture(buf)
    })
}

/// The lines [`capture`] kept.
pub struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Capture {
    /// Everything logged so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

struct CaptureWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CaptureWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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
