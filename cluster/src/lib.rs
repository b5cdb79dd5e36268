//! Cluster membership shared by the router and both workers.
//!
//! - [`Discovery`]: one trait, one file per backend: [`EtcdDiscovery`] (leases, keep-alive, prefix
//!   watch) and [`StaticDiscovery`] (`--prefill ADDR --decode ADDR`, no registry).
//! - Workers call [`Discovery::register`] and keep the returned [`Registration`]: a background task
//!   holds the lease alive, registers again whenever etcd comes back, and deregisters on drop.
//! - The router calls [`Discovery::watch`]: a [`ClusterView`] that is replaced on every change and
//!   kept as it was while the registry is unreachable.
//! - [`prefix_hash`]: the hash chain over 64-token prompt blocks that prefill workers report from
//!   their prefix cache and the router's cache-aware policy matches.
//!
//! Flags: [`DiscoveryArgs`] (`--discovery static|etcd --etcd URL --cluster NAME --lease-ttl-secs N`, and for a
//! secured etcd `--etcd-ca/--etcd-cert/--etcd-key` and `--etcd-user` with `--etcd-password-file` or
//! `TANDEM_ETCD_PASSWORD`: [`EtcdSecurity`]). Failed etcd requests say whether the credentials, TLS or the
//! network was the cause ([`DiscoveryError`]).
//!
//! Key layout: `/tandem/<cluster>/workers/{prefill,decode}/<worker id>` -> JSON [`WorkerRecord`]. Roles and
//! fingerprints are `proto::v1::WorkerRole` and `proto::v1::ModelFingerprint`.

mod args;
mod discovery;
mod error;
mod etcd;
mod etcd_failure;
mod etcd_security;
mod keys;
pub mod prefix_hash;
#[path = "static.rs"]
mod static_list;
mod view;
mod worker;

pub use args::{DiscoveryArgs, DiscoveryKind};
pub use discovery::{Discovery, DiscoveryConfig, Registration, RegistrationState, connect};
pub use error::DiscoveryError;
pub use etcd::{EtcdDiscovery, EtcdOptions};
pub use etcd_security::{EtcdSecurity, PASSWORD_ENV, Password, PasswordSource};
pub use keys::{role_prefix, worker_key, workers_prefix};
pub use static_list::StaticDiscovery;
pub use view::ClusterView;
pub use worker::{Capacity, WorkerRecord};
