//! The set of workers, kept in step with the discovery view. Readers take a cheap snapshot.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cluster::{ClusterView, Discovery};
use proto::v1::WorkerRole;
use tokio::sync::watch;
use tracing::{info, warn};

use super::{HandleSettings, WorkerHandle, health};
use crate::metrics::Metrics;

#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub handle: HandleSettings,
    pub health_interval: Duration,
    pub health_timeout: Duration,
    /// Consecutive failed polls before a worker is unhealthy.
    pub health_failures: u32,
}

pub struct WorkerPool {
    workers: RwLock<Arc<Vec<Arc<WorkerHandle>>>>,
    pub(crate) settings: PoolSettings,
    pub(crate) metrics: Arc<Metrics>,
}

impl WorkerPool {
    /// Starts following `discovery` and polling workers until `shutdown` flips to true.
    pub fn start(
        discovery: Arc<dyn Discovery>,
        settings: PoolSettings,
        metrics: Arc<Metrics>,
        shutdown: watch::Receiver<bool>,
    ) -> Arc<Self> {
        let pool = Arc::new(Self { workers: RwLock::new(Arc::new(Vec::new())), settings, metrics });
        let mut view = discovery.watch();
        pool.apply(&view.borrow_and_update());
        let follower = pool.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = view.changed() => {
                        if changed.is_err() { return; }
                        let v = view.borrow_and_update().clone();
                        follower.apply(&v);
                    }
                    _ = stop.changed() => return,
                }
            }
        });
        tokio::spawn(health::run(pool.clone(), shutdown));
        pool
    }

    pub fn snapshot(&self) -> Arc<Vec<Arc<WorkerHandle>>> {
        self.workers.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn apply(self: &Arc<Self>, view: &ClusterView) {
        let current = self.snapshot();
        let by_key: HashMap<(WorkerRole, &str), &Arc<WorkerHandle>> =
            current.iter().map(|w| ((w.role, w.id.as_str()), w)).collect();
        let mut next = Vec::with_capacity(view.len());
        for rec in view.workers.values() {
            match by_key.get(&(rec.role, rec.id.as_str())) {
                Some(h) if h.address == rec.grpc_address => {
                    h.update_record(rec.clone());
                    next.push((*h).clone());
                }
                _ => match WorkerHandle::new(rec.clone(), &self.settings.handle) {
                    Ok(h) => {
                        info!(worker = %rec.id, role = %rec.role, address = %rec.grpc_address, "worker added");
                        let h = Arc::new(h);
                        tokio::spawn(health::poll_once(self.clone(), h.clone()));
                        next.push(h);
                    }
                    Err(e) => {
                        warn!(worker = %rec.id, address = %rec.grpc_address, error = %e, "bad worker address; ignored")
                    }
                },
            }
        }
        for w in current.iter() {
            if !next.iter().any(|n| Arc::ptr_eq(n, w)) {
                info!(worker = %w.id, role = %w.role, "worker removed");
                self.metrics.remove_worker(w.role.name(), &w.id);
            }
        }
        *self.workers.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
    }
}
