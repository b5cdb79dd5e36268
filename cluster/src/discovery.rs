//! The discovery trait, the registration handle workers hold, and the backend factory.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::{ClusterView, DiscoveryError, EtcdDiscovery, EtcdOptions, EtcdSecurity, StaticDiscovery, WorkerRecord};

/// A source of cluster membership. Backends live in sibling files (`etcd.rs`, `static.rs`).
pub trait Discovery: Send + Sync + 'static {
    /// The current view, updated on every change. While the registry is unreachable the last view stays.
    fn watch(&self) -> watch::Receiver<Arc<ClusterView>>;

    /// Registers a worker. The returned handle keeps the registration alive (lease keep-alive,
    /// re-registration after registry outages) until it is dropped or [`Registration::deregister`]ed.
    fn register(&self, record: WorkerRecord) -> BoxFuture<'_, Result<Registration, DiscoveryError>>;

    /// Which backend this is (for logs).
    fn kind(&self) -> crate::DiscoveryKind;
}

/// Which backend to use; built from the router's and workers' flags.
#[derive(Debug, Clone)]
pub enum DiscoveryConfig {
    Etcd { endpoints: Vec<String>, cluster: String, options: EtcdOptions, security: EtcdSecurity },
    Static { prefill: Vec<String>, decode: Vec<String> },
}

/// Builds the configured backend. Never fails because etcd is down: the backend retries in the background.
/// It does fail when etcd answers but refuses the credentials or the TLS handshake fails, which retrying
/// cannot fix, and on unreadable TLS or password files.
pub async fn connect(config: DiscoveryConfig) -> Result<Arc<dyn Discovery>, DiscoveryError> {
    Ok(match config {
        DiscoveryConfig::Etcd { endpoints, cluster, options, security } => {
            let etcd = EtcdDiscovery::connect(endpoints, cluster, options, security).await?;
            etcd.check().await?;
            Arc::new(etcd)
        }
        DiscoveryConfig::Static { prefill, decode } => Arc::new(StaticDiscovery::new(prefill, decode)),
    })
}

/// Where a registration stands (observable for readiness checks and tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationState {
    /// Not yet written (first attempt in flight).
    Registering,
    /// Written under the given lease, which is being kept alive.
    Registered { lease: i64 },
    /// The registry is unreachable or the lease was lost; retrying.
    Retrying { error: String },
    /// Nothing to keep alive (static discovery).
    Static,
}

pub(crate) enum Stop {
    /// Delete the key (revoke the lease), then end.
    Deregister,
    /// End without touching the registry: the entry expires with its lease, as if the process died.
    Abandon,
}

/// Handle of one worker's registration. Dropping it deregisters in the background.
pub struct Registration {
    key: String,
    state: watch::Receiver<RegistrationState>,
    stop: Option<oneshot::Sender<Stop>>,
    task: Option<JoinHandle<()>>,
}

impl Registration {
    pub(crate) fn new(
        key: String,
        state: watch::Receiver<RegistrationState>,
        stop: oneshot::Sender<Stop>,
        task: JoinHandle<()>,
    ) -> Self {
        Self { key, state, stop: Some(stop), task: Some(task) }
    }

    /// A registration with nothing behind it (static discovery).
    pub(crate) fn fixed(key: String) -> Self {
        let (_tx, state) = watch::channel(RegistrationState::Static);
        Self { key, state, stop: None, task: None }
    }

    /// The discovery key this worker is registered under.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn state(&self) -> RegistrationState {
        self.state.borrow().clone()
    }

    /// Waits until the entry is written (or static), up to `timeout`. Returns whether it is.
    pub async fn wait_registered(&mut self, timeout: Duration) -> bool {
        let ok = |s: &RegistrationState| matches!(s, RegistrationState::Registered { .. } | RegistrationState::Static);
        tokio::time::timeout(timeout, self.state.wait_for(ok)).await.is_ok_and(|r| r.is_ok())
    }

    /// Deletes the entry (revokes the lease) and waits, at most 5 s, for the registry to confirm.
    pub async fn deregister(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Stop::Deregister);
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }

    /// Stops the keep-alive without deleting the entry, which then expires after the lease TTL,
    /// exactly as when the worker process dies. For tests and crash drills.
    pub fn abandon(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Stop::Abandon);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Stop::Deregister);
        }
    }
}
