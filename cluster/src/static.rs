//! Static discovery: a fixed list of worker addresses (`--prefill ADDR --decode ADDR`), for one machine
//! or a cluster manager that knows the addresses. Fingerprints are not known here: the router learns
//! each worker's identity and fingerprint through the GetInfo RPC.

use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::watch;

use proto::v1::WorkerRole;

use crate::{ClusterView, Discovery, DiscoveryError, Registration, WorkerRecord};

pub struct StaticDiscovery {
    view: watch::Sender<Arc<ClusterView>>,
}

impl StaticDiscovery {
    /// Each address becomes a worker whose id is its address.
    pub fn new(prefill: Vec<String>, decode: Vec<String>) -> Self {
        let record = |role, addr: String| WorkerRecord {
            id: addr.clone(),
            role,
            grpc_address: addr,
            capacity: Default::default(),
            fingerprint: None,
        };
        let records = prefill
            .into_iter()
            .map(|a| record(WorkerRole::Prefill, a))
            .chain(decode.into_iter().map(|a| record(WorkerRole::Decode, a)));
        let (view, _) = watch::channel(Arc::new(ClusterView::from_records(records)));
        Self { view }
    }
}

impl Discovery for StaticDiscovery {
    fn watch(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view.subscribe()
    }

    /// Nothing to write: the router was given the address. The handle is inert.
    fn register(&self, record: WorkerRecord) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move { Ok(Registration::fixed(format!("static:{}/{}", record.role, record.id))) })
    }

    fn kind(&self) -> crate::DiscoveryKind {
        crate::DiscoveryKind::Static
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn addresses_become_workers_of_their_role() {
        let d = StaticDiscovery::new(vec!["127.0.0.1:1".into()], vec!["127.0.0.1:2".into(), "127.0.0.1:3".into()]);
        let v = d.watch().borrow().clone();
        assert_eq!(v.role(WorkerRole::Prefill).count(), 1);
        assert_eq!(v.role(WorkerRole::Decode).count(), 2);
        assert!(v.get(WorkerRole::Decode, "127.0.0.1:3").is_some());
        let mut reg = d.register(v.role(WorkerRole::Prefill).next().unwrap().clone()).await.unwrap();
        assert!(reg.wait_registered(std::time::Duration::from_millis(10)).await);
    }
}
