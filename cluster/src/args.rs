//! Discovery flags shared by the router and both workers: flatten [`DiscoveryArgs`] into a clap parser.

use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::{DiscoveryConfig, EtcdOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Fixed addresses (router: --prefill/--decode); workers do not register anywhere.
    Static,
    /// etcd: workers register under /tandem/<cluster>/workers/, routers watch that prefix.
    Etcd,
}

#[derive(Debug, Clone, Args)]
pub struct DiscoveryArgs {
    /// How workers are found.
    #[arg(long = "discovery", env = "TANDEM_DISCOVERY", value_enum, default_value = "static")]
    pub backend: Backend,
    /// etcd endpoints (etcd discovery; repeat or comma-separate).
    #[arg(long, env = "TANDEM_ETCD", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd: Vec<String>,
    /// Cluster name: the etcd key prefix is /tandem/<cluster>/workers/.
    #[arg(long, env = "TANDEM_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Lease TTL of worker registrations: a dead worker disappears from routers within this time.
    #[arg(long, env = "TANDEM_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,
}

impl DiscoveryArgs {
    /// The backend configuration. `prefill` / `decode` are the static address lists (empty for workers).
    pub fn config(&self, prefill: Vec<String>, decode: Vec<String>) -> DiscoveryConfig {
        match self.backend {
            Backend::Static => DiscoveryConfig::Static { prefill, decode },
            Backend::Etcd => DiscoveryConfig::Etcd {
                endpoints: self.etcd.clone(),
                cluster: self.cluster.clone(),
                options: EtcdOptions {
                    lease_ttl: Duration::from_secs(self.lease_ttl_secs.max(1)),
                    ..Default::default()
                },
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
            DiscoveryConfig::Etcd { endpoints, cluster, options } => {
                assert_eq!(endpoints, ["http://a:1", "http://b:2"]);
                assert_eq!(cluster, "prod");
                assert_eq!(options.lease_ttl, Duration::from_secs(10));
            }
            other => panic!("{other:?}"),
        }
        let err = Cli::try_parse_from(["x", "--discovery", "zookeeper"]).err().unwrap().to_string();
        assert!(err.contains("static") && err.contains("etcd"), "{err}");
    }
}
