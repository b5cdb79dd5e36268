//! The router's picture of the cluster: every registered worker, by discovery key.

use std::collections::BTreeMap;

use proto::v1::WorkerRole;

use crate::WorkerRecord;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Workers by id, per role. Ids are unique within a role.
    pub workers: BTreeMap<(WorkerRole, String), WorkerRecord>,
}

impl ClusterView {
    pub fn from_records(records: impl IntoIterator<Item = WorkerRecord>) -> Self {
        Self { workers: records.into_iter().map(|r| ((r.role, r.id.clone()), r)).collect() }
    }

    pub fn role(&self, role: WorkerRole) -> impl Iterator<Item = &WorkerRecord> {
        self.workers.values().filter(move |w| w.role == role)
    }

    pub fn get(&self, role: WorkerRole, id: &str) -> Option<&WorkerRecord> {
        self.workers.get(&(role, id.to_owned()))
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}
