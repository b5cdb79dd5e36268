//! Discovery flags shared by the router and both workers: flatten [`DiscoveryArgs`] into a clap parser.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::etcd_security::{PASSWORD_ENV, PasswordSource};
use crate::{DiscoveryConfig, EtcdOptions, EtcdSecurity};

/// Which discovery backend (`--discovery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryKind {
    /// Fixed addresses (router: --prefill/--decode); workers do not register anywhere.
    Static,
    /// etcd: workers register under /tandem/<cluster>/workers/, routers watch that prefix.
    Etcd,
}

impl DiscoveryKind {
    /// The flag value ("static", "etcd").
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Etcd => "etcd",
        }
    }
}

impl std::fmt::Display for DiscoveryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Args)]
pub struct DiscoveryArgs {
    /// How workers are found.
    #[arg(long = "discovery", env = "TANDEM_DISCOVERY", value_enum, default_value = "static")]
    pub kind: DiscoveryKind,
    /// etcd endpoints (etcd discovery; repeat or comma-separate).
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd: Vec<String>,
    /// Cluster name: the etcd key prefix is /tandem/<cluster>/workers/.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Lease TTL of worker registrations: a dead worker disappears from routers within this time.
    #[arg(long, env = "TANDEM_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// CA certificate (PEM) that signed etcd's server certificate: etcd is reached over TLS (https:// or
    /// bare HOST:PORT endpoints).
    #[arg(long, env = "TANDEM_ETCD_CA", value_name = "PEM")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd that requires one (--client-cert-auth). Needs --etcd-key.
    #[arg(long, env = "TANDEM_ETCD_CERT", value_name = "PEM")]
    pub etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, env = "TANDEM_ETCD_KEY", value_name = "PEM")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication enabled. The password comes from --etcd-password-file
    /// or the TANDEM_ETCD_PASSWORD environment variable, never from the command line.
    #[arg(long, env = "TANDEM_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (a final newline is ignored).
    #[arg(long, env = "TANDEM_ETCD_PASSWORD_FILE", value_name = "FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

fn env_password() -> bool {
    std::env::var_os(PASSWORD_ENV).is_some_and(|v| !v.is_empty())
}

impl DiscoveryArgs {
    /// Checks what clap cannot (`--check-config` and start-up). Messages name the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.cluster.is_empty() || self.cluster.contains('/') {
            return Err(format!("--cluster {:?}: must be a non-empty name without '/'", self.cluster));
        }
        if self.lease_ttl_secs == 0 {
            return Err("--lease-ttl-secs must be at least 1".into());
        }
        if self.kind == DiscoveryKind::Etcd {
            if self.etcd.is_empty() {
                return Err("--discovery etcd needs at least one --etcd URL".into());
            }
            for e in &self.etcd {
                let hostport = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or(e);
                let ok = hostport
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
                if !ok {
                    return Err(format!("--etcd {e:?}: expected http://HOST:PORT"));
                }
            }
            if self.etcd_password_file.is_some() && env_password() {
                return Err(format!("the etcd password is given twice: --etcd-password-file and {PASSWORD_ENV}"));
            }
            // Reads the files and the password: unreadable or mismatched ones fail here, by flag name.
            self.security().load(&self.etcd).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// TLS and credentials for etcd, as the flags and the environment give them (paths, not contents).
    pub fn security(&self) -> EtcdSecurity {
        let password = match &self.etcd_password_file {
            Some(f) => Some(PasswordSource::File(f.clone())),
            None => env_password().then(|| PasswordSource::Env(PASSWORD_ENV.into())),
        };
        EtcdSecurity {
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
            user: self.etcd_user.clone(),
            password,
        }
    }

    /// The backend configuration. `prefill` / `decode` are the static address lists (empty for workers).
    pub fn config(&self, prefill: Vec<String>, decode: Vec<String>) -> DiscoveryConfig {
        match self.kind {
            DiscoveryKind::Static => DiscoveryConfig::Static { prefill, decode },
            DiscoveryKind::Etcd => DiscoveryConfig::Etcd {
                endpoints: self.etcd.clone(),
                cluster: self.cluster.clone(),
                options: EtcdOptions {
                    lease_ttl: Duration::from_secs(self.lease_ttl_secs.max(1)),
                    ..Default::default()
                },
                security: self.security(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        d: DiscoveryArgs,
    }

    #[test]
    fn flags_build_the_backend_and_reject_unknown_names() {
        let c =
            Cli::try_parse_from(["x", "--discovery", "etcd", "--etcd", "http://a:1,http://b:2", "--cluster", "prod"])
                .unwrap();
        match c.d.config(vec![], vec![]) {
            DiscoveryConfig::Etcd { endpoints, cluster, options, security } => {
                assert!(!security.is_set());
                assert_eq!(endpoints, ["http://a:1", "http://b:2"]);
                assert_eq!(cluster, "prod");
                assert_eq!(options.lease_ttl, Duration::from_secs(10));
            }
            other => panic!("{other:?}"),
        }
        let err = Cli::try_parse_from(["x", "--discovery", "zookeeper"]).err().unwrap().to_string();
        assert!(err.contains("static") && err.contains("etcd"), "{err}");
    }

    #[test]
    fn validate_names_the_bad_flag() {
        let parse = |a: &[&str]| Cli::try_parse_from(std::iter::once("x").chain(a.iter().copied())).unwrap().d;
        assert!(parse(&["--discovery", "etcd", "--etcd", "http://etcd.ns.svc:2379"]).validate().is_ok());
        assert!(parse(&["--discovery", "etcd", "--etcd", "10.0.0.1:2379"]).validate().is_ok());
        let err = parse(&["--discovery", "etcd", "--etcd", "http://etcd"]).validate().unwrap_err();
        assert!(err.contains("--etcd"), "{err}");
        let err = parse(&["--cluster", "a/b"]).validate().unwrap_err();
        assert!(err.contains("--cluster"), "{err}");
        let err = parse(&["--lease-ttl-secs", "0"]).validate().unwrap_err();
        assert!(err.contains("--lease-ttl-secs"), "{err}");
    }
}
