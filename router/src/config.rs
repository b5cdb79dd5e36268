//! Command-line flags (each with an environment fallback), shared by `tandem-router` and `tandem router`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args as ClapArgs, ValueEnum};

/// Prefill worker selection (`--prefill-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrefillPolicyKind {
    /// Each worker in turn.
    RoundRobin,
    /// Fewest queued prompt tokens (router-side in-flight counts included).
    LeastLoaded,
    /// Two random workers, the less loaded one.
    PowerOfTwo,
    /// Longest cached prompt prefix (all messages) unless that worker is much busier than the idlest.
    CacheAware,
}

/// Decode worker selection (`--decode-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecodePolicyKind {
    /// Lowest KV-cache usage.
    LeastKv,
    /// Two random workers, the one with lower KV usage.
    PowerOfTwo,
    /// Each worker in turn.
    RoundRobin,
}

/// The router's flags. Embed in another clap parser with `#[command(flatten)]`.
#[derive(Debug, Clone, ClapArgs)]
pub struct Args {
    /// Checkpoint directory: config.json (max_position_embeddings), tokenizer.json, tokenizer_config.json.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// Model name clients send in "model" [default: the model directory's name].
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Longest prompt + completion in tokens [default: config.json max_position_embeddings].
    #[arg(long, env = "TANDEM_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,
    /// Jinja chat template file (or inline template) replacing the checkpoint's.
    #[arg(long, env = "TANDEM_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,

    /// Address the HTTP and gRPC front doors listen on (0.0.0.0 to serve other machines).
    #[arg(long, env = "TANDEM_ROUTER_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (OpenAI-compatible API, /metrics, /health).
    #[arg(long, env = "TANDEM_ROUTER_PORT", default_value_t = 8000)]
    pub port: u16,
    /// gRPC port of the tandem.v1.Generate front door.
    #[arg(long, env = "TANDEM_ROUTER_GRPC_PORT", default_value_t = 8001)]
    pub grpc_port: u16,
    /// Do not serve the gRPC front door.
    #[arg(long, env = "TANDEM_ROUTER_DISABLE_GRPC")]
    pub disable_grpc: bool,
    /// Require 'Authorization: Bearer <key>' (the scheme in any case) on /v1/* and on gRPC calls.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<crate::auth::ApiKey>,
    /// More keys: a file of one key a line, `KEY` or `NAME:KEY` (`#` comments); logs and errors name a key,
    /// never show it. Combines with --api-key.
    #[arg(long, env = "TANDEM_API_KEYS_FILE")]
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Requests a minute each key may make (a token bucket: this many at once, refilled evenly); past it,
    /// 429 with Retry-After. Unlimited when unset.
    #[arg(long, env = "TANDEM_API_KEY_RATE_LIMIT")]
    pub api_key_rate_limit: Option<u32>,

    /// Discovery backend flags (--discovery, --etcd, --cluster, --lease-ttl-secs, etcd TLS and credentials).
    #[command(flatten)]
    pub registry: cluster::DiscoveryArgs,
    /// TLS to the workers' gRPC ports: --tls-ca verifies them, --tls-cert/--tls-key is presented to them
    /// (workers given --tls-ca require it). The client-facing HTTP and gRPC ports are not affected.
    #[command(flatten)]
    pub tls: tls::TlsArgs,
    /// The name worker certificates must carry (DNS or IP SAN), instead of the host the router dials (a pod
    /// IP, which certificates rarely list).
    #[arg(long, env = "TANDEM_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// Prefill worker gRPC addresses (static discovery; repeat or comma-separate).
    #[arg(long, env = "TANDEM_PREFILL", value_delimiter = ',')]
    pub prefill: Vec<String>,
    /// Decode worker gRPC addresses (static discovery; repeat or comma-separate).
    #[arg(long, env = "TANDEM_DECODE", value_delimiter = ',')]
    pub decode: Vec<String>,

    /// Prefill worker selection.
    #[arg(long, env = "TANDEM_PREFILL_POLICY", value_enum, default_value = "cache-aware")]
    pub prefill_policy: PrefillPolicyKind,
    /// Decode worker selection.
    #[arg(long, env = "TANDEM_DECODE_POLICY", value_enum, default_value = "least-kv")]
    pub decode_policy: DecodePolicyKind,
    /// cache-aware: take the best-cached worker only while its queued tokens exceed the idlest worker's by
    /// at most this many.
    #[arg(long, env = "TANDEM_CACHE_BALANCE_TOKENS", default_value_t = 16384)]
    pub cache_balance_tokens: u64,

    /// Requests handled at once; more wait in the queue.
    #[arg(long, env = "TANDEM_MAX_RUNNING_REQUESTS", default_value_t = 4096)]
    pub max_running_requests: usize,
    /// Requests waiting for a running slot, and (separately) new requests waiting for room on a full
    /// decode worker; beyond this, 429 with Retry-After.
    #[arg(long, env = "TANDEM_MAX_QUEUED_REQUESTS", default_value_t = 4096)]
    pub max_queued_requests: usize,
    /// Longest wait in the queue before 429: for a running slot, and for room on a decode worker when
    /// every one is full (0 = answer 429 at once).
    #[arg(long, env = "TANDEM_QUEUE_TIMEOUT_SECS", default_value_t = 30.0)]
    pub queue_timeout_secs: f64,
    /// How long a preempted request (its stream already open) waits for a decode worker with room to
    /// continue it before it ends with an error event.
    #[arg(long, env = "TANDEM_PREEMPTED_WAIT_SECS", default_value_t = 120.0)]
    pub preempted_wait_secs: f64,
    /// Whole-request limit (0 = none); then 504, or an error event on a started stream.
    #[arg(long, env = "TANDEM_REQUEST_TIMEOUT_SECS", default_value_t = 600.0)]
    pub request_timeout_secs: f64,
    /// Limit for one Prefill call and for the decode worker's reservation answer.
    #[arg(long, env = "TANDEM_PREFILL_TIMEOUT_SECS", default_value_t = 300.0)]
    pub prefill_timeout_secs: f64,
    /// Further prefill workers tried when prefill fails before the first token.
    #[arg(long, env = "TANDEM_MAX_RETRIES", default_value_t = 2)]
    pub max_retries: u32,
    /// Largest accepted request body.
    #[arg(long, env = "TANDEM_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// A connection must send a request's complete headers within this time (also the first byte of
    /// a new connection), else it is closed.
    #[arg(long, env = "TANDEM_HEADER_READ_TIMEOUT_SECS", default_value_t = 30.0)]
    pub header_read_timeout_secs: f64,
    /// A request's complete body must arrive within this time of its headers, else 408.
    #[arg(long, env = "TANDEM_BODY_READ_TIMEOUT_SECS", default_value_t = 60.0)]
    pub body_read_timeout_secs: f64,

    /// Load/health poll period per worker.
    #[arg(long, env = "TANDEM_HEALTH_INTERVAL_MS", default_value_t = 500)]
    pub health_interval_ms: u64,
    /// Timeout of one health poll.
    #[arg(long, env = "TANDEM_HEALTH_TIMEOUT_MS", default_value_t = 1000)]
    pub health_timeout_ms: u64,
    /// Consecutive failures (polls or requests) that open a worker's circuit breaker.
    #[arg(long, env = "TANDEM_BREAKER_FAILURES", default_value_t = 3)]
    pub breaker_failures: u32,
    /// How long an open breaker keeps a worker out before one trial request.
    #[arg(long, env = "TANDEM_BREAKER_OPEN_SECS", default_value_t = 5.0)]
    pub breaker_open_secs: f64,
    /// HTTP/2 connections per worker (requests are spread over them).
    #[arg(long, env = "TANDEM_WORKER_CONNECTIONS", default_value_t = 1)]
    pub worker_connections: usize,

    #[command(flatten)]
    pub log: logging::LogArgs,
    /// Validate every argument, print the result and exit (0 when valid) without reading the model files
    /// or binding anything.
    #[arg(long, env = "TANDEM_CHECK_CONFIG")]
    pub check_config: bool,
}

/// Longest timeout a flag accepts, in seconds.
const MAX_SECS: f64 = 1e7;

fn secs(s: f64) -> Option<Duration> {
    (s > 0.0 && s.is_finite()).then(|| Duration::from_secs_f64(s))
}

impl Args {
    pub fn http_addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    pub fn grpc_addr(&self) -> Option<String> {
        (!self.disable_grpc).then(|| format!("{}:{}", self.host, self.grpc_port))
    }

    pub fn request_timeout(&self) -> Option<Duration> {
        secs(self.request_timeout_secs)
    }

    pub fn prefill_timeout(&self) -> Duration {
        secs(self.prefill_timeout_secs).unwrap_or(Duration::from_secs(3600))
    }

    pub fn header_read_timeout(&self) -> Duration {
        secs(self.header_read_timeout_secs).unwrap_or(Duration::from_secs(30))
    }

    pub fn body_read_timeout(&self) -> Duration {
        secs(self.body_read_timeout_secs).unwrap_or(Duration::from_secs(60))
    }

    pub fn preempted_wait(&self) -> Duration {
        secs(self.preempted_wait_secs).unwrap_or(Duration::ZERO)
    }

    pub fn queue_timeout(&self) -> Duration {
        secs(self.queue_timeout_secs).unwrap_or(Duration::ZERO)
    }

    /// Checks what clap cannot. Messages name the flag.
    pub fn validate(&self) -> Result<(), String> {
        crate::auth::ApiKeys::load(
            self.api_key.as_ref().map(|k| k.0.as_str()),
            self.api_keys_file.as_deref(),
            self.api_key_rate_limit,
        )?;
        if self.registry.kind == cluster::DiscoveryKind::Static && (self.prefill.is_empty() || self.decode.is_empty()) {
            return Err("--discovery static needs at least one --prefill ADDR and one --decode ADDR".into());
        }
        if self.max_running_requests == 0 {
            return Err("--max-running-requests must be at least 1".into());
        }
        if self.worker_connections == 0 {
            return Err("--worker-connections must be at least 1".into());
        }
        if self.health_interval_ms == 0 {
            return Err("--health-interval-ms must be at least 1".into());
        }
        if self.host.is_empty() || self.host.contains(char::is_whitespace) {
            return Err(format!("--host {:?}: expected an IP address or host name", self.host));
        }
        if !self.disable_grpc && self.grpc_port != 0 && self.grpc_port == self.port {
            return Err(format!("--grpc-port {} is also --port", self.grpc_port));
        }
        for (flag, list) in [("--prefill", &self.prefill), ("--decode", &self.decode)] {
            for a in list {
                let hostport = a.strip_prefix("http://").or_else(|| a.strip_prefix("https://")).unwrap_or(a);
                let ok = hostport
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
                if !ok {
                    return Err(format!("{flag} {a:?}: expected HOST:PORT"));
                }
            }
        }
        for (flag, v) in [
            ("--queue-timeout-secs", self.queue_timeout_secs),
            ("--request-timeout-secs", self.request_timeout_secs),
            ("--prefill-timeout-secs", self.prefill_timeout_secs),
            ("--breaker-open-secs", self.breaker_open_secs),
            ("--preempted-wait-secs", self.preempted_wait_secs),
        ] {
            // The upper bound keeps `Instant::now() + timeout` from overflowing (about 116 days).
            if !(v.is_finite() && (0.0..=MAX_SECS).contains(&v)) {
                return Err(format!("{flag} {v}: expected a number of seconds from 0 to {MAX_SECS}"));
            }
        }
        for (flag, v) in [
            ("--header-read-timeout-secs", self.header_read_timeout_secs),
            ("--body-read-timeout-secs", self.body_read_timeout_secs),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= MAX_SECS) {
                return Err(format!("{flag} {v}: expected a number of seconds above 0, at most {MAX_SECS}"));
            }
        }
        self.worker_tls().map_err(|e| e.to_string())?;
        self.registry.validate()
    }

    /// TLS to the workers, its files read and checked (`None`: plaintext).
    pub fn worker_tls(&self) -> Result<Option<tls::ClientTls>, tls::TlsError> {
        self.tls.client(self.tls_server_name.as_deref())
    }

    /// "off", "tls" (workers verified) or "mutual" (the router also presents a certificate).
    pub fn tls_mode(&self) -> &'static str {
        match (&self.tls.ca, &self.tls.cert) {
            (None, _) => "off",
            (Some(_), None) => "tls",
            (Some(_), Some(_)) => "mutual",
        }
    }
}

/// Parses "host:port" or a URL for logging purposes.
pub fn parse_socket(s: &str) -> Option<SocketAddr> {
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::Args,
    }

    fn parse(extra: &[&str]) -> super::Args {
        let argv =
            ["r", "--model", "/m", "--prefill", "p:1", "--decode", "d:2"].into_iter().chain(extra.iter().copied());
        Cli::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn check_config_refuses_bad_values_by_flag_name() {
        assert!(parse(&[]).validate().is_ok());
        assert!(parse(&["--check-config"]).check_config);
        for (flags, name) in [
            (&["--prefill", "nohost"][..], "--prefill"),
            (&["--grpc-port", "8000"][..], "--grpc-port"),
            (&["--queue-timeout-secs=-1"][..], "--queue-timeout-secs"),
            (&["--preempted-wait-secs=1e30"][..], "--preempted-wait-secs"),
            (&["--header-read-timeout-secs=0"][..], "--header-read-timeout-secs"),
            (&["--body-read-timeout-secs=NaN"][..], "--body-read-timeout-secs"),
            (&["--discovery", "etcd", "--etcd", "http://etcd"][..], "--etcd"),
            (&["--cluster", ""][..], "--cluster"),
        ] {
            let err = parse(flags).validate().unwrap_err();
            assert!(err.contains(name), "{flags:?}: {err}");
        }
    }
}
