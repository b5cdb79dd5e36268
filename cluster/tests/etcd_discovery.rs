//! Discovery against a real etcd: registration, watch, lease expiry, etcd restarts.

mod support {
    pub mod etcd;
}

use std::sync::Arc;
use std::time::Duration;

use cluster::{Capacity, ClusterView, Discovery, EtcdDiscovery, EtcdOptions, RegistrationState, WorkerRecord};
use proto::v1::{ModelFingerprint, WorkerRole};
use support::etcd::Etcd;
use tokio::sync::watch;

fn record(role: WorkerRole, id: &str, port: u16) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        role,
        grpc_address: format!("127.0.0.1:{port}"),
        capacity: Capacity { max_num_seqs: 16, kv_blocks_total: 512, max_model_len: 4096 },
        fingerprint: Some(ModelFingerprint {
            model_name: "tiny".into(),
            checkpoint_hash: "c0ffee".into(),
            precision: "full".into(),
            block_size: 64,
            num_layers: 4,
            kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
        }),
    }
}

async fn discovery(etcd: &Etcd, cluster: &str, ttl_s: u64) -> EtcdDiscovery {
    let opts = EtcdOptions {
        lease_ttl: Duration::from_secs(ttl_s),
        request_timeout: Duration::from_secs(1),
        max_backoff: Duration::from_millis(300),
    };
    EtcdDiscovery::new(vec![etcd.client_url.clone()], cluster.into(), opts).await.unwrap()
}

async fn wait_view(
    rx: &mut watch::Receiver<Arc<ClusterView>>,
    limit: Duration,
    f: impl Fn(&ClusterView) -> bool,
) -> bool {
    tokio::time::timeout(limit, rx.wait_for(|v| f(v))).await.is_ok_and(|r| r.is_ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_workers_appear_in_the_watch_with_their_records_and_leave_on_deregister() {
    let Some(etcd) = Etcd::start() else { return };
    let router = discovery(&etcd, "reg", 5).await;
    let worker = discovery(&etcd, "reg", 5).await;
    let other_cluster = discovery(&etcd, "other", 5).await;
    let mut view = router.watch();

    let p = record(WorkerRole::Prefill, "p0", 7001);
    let d = record(WorkerRole::Decode, "d0", 7002);
    let mut rp = worker.register(p.clone()).await.unwrap();
    let rd = worker.register(d.clone()).await.unwrap();
    let _foreign = other_cluster.register(record(WorkerRole::Prefill, "x", 7003)).await.unwrap();
    assert!(rp.wait_registered(Duration::from_secs(5)).await);
    assert!(matches!(rp.state(), RegistrationState::Registered { .. }));
    assert_eq!(rp.key(), "/tandem/reg/workers/prefill/p0");

    assert!(wait_view(&mut view, Duration::from_secs(5), |v| v.len() == 2).await, "both workers visible");
    let v = view.borrow().clone();
    assert_eq!(v.get(WorkerRole::Prefill, "p0"), Some(&p));
    assert_eq!(v.get(WorkerRole::Decode, "d0"), Some(&d));

    rd.deregister().await;
    assert!(wait_view(&mut view, Duration::from_secs(2), |v| v.get(WorkerRole::Decode, "d0").is_none()).await);
    drop(rp);
    assert!(wait_view(&mut view, Duration::from_secs(2), |v| v.is_empty()).await, "drop deregisters too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_disappears_within_its_lease_ttl() {
    let Some(etcd) = Etcd::start() else { return };
    let router = discovery(&etcd, "ttl", 2).await;
    let worker = discovery(&etcd, "ttl", 2).await;
    let mut view = router.watch();
    let mut reg = worker.register(record(WorkerRole::Decode, "d0", 7002)).await.unwrap();
    assert!(reg.wait_registered(Duration::from_secs(5)).await);
    assert!(wait_view(&mut view, Duration::from_secs(5), |v| v.len() == 1).await);

    // Keep-alive stops as if the process died; the entry must outlive a keep-alive interval but not the TTL.
    reg.abandon();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(view.borrow().len(), 1, "still registered before the TTL runs out");
    let gone = std::time::Instant::now();
    assert!(wait_view(&mut view, Duration::from_secs(4), |v| v.is_empty()).await, "gone after the TTL");
    assert!(gone.elapsed() < Duration::from_secs(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_keeps_its_view_while_etcd_is_down_and_workers_register_again_after_a_wiping_restart() {
    let Some(mut etcd) = Etcd::start() else { return };
    let router = discovery(&etcd, "restart", 2).await;
    let worker = discovery(&etcd, "restart", 2).await;
    let mut view = router.watch();
    let mut reg = worker.register(record(WorkerRole::Prefill, "p0", 7001)).await.unwrap();
    assert!(reg.wait_registered(Duration::from_secs(5)).await);
    assert!(wait_view(&mut view, Duration::from_secs(5), |v| v.len() == 1).await);

    etcd.kill();
    // Well past the TTL: the router must not forget workers because the registry is gone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(view.borrow().len(), 1, "last view kept while etcd is down");
    assert!(matches!(reg.state(), RegistrationState::Retrying { .. }), "worker noticed: {:?}", reg.state());

    // etcd comes back with no data at all: the worker must write its record again by itself.
    etcd.restart(true);
    assert!(reg.wait_registered(Duration::from_secs(10)).await, "re-registered: {:?}", reg.state());
    let mut raw = etcd_client::Client::connect([etcd.client_url.as_str()], None).await.unwrap();
    let got = raw.get("/tandem/restart/workers/prefill/p0", None).await.unwrap();
    assert_eq!(got.kvs().len(), 1, "record written again after the wipe");

    // The router's watch is live again: a worker that registers now shows up.
    let _late = worker.register(record(WorkerRole::Decode, "d-late", 7009)).await.unwrap();
    assert!(wait_view(&mut view, Duration::from_secs(10), |v| v.len() == 2).await, "watch resumed");
    assert!(etcd.data_dir().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_keeps_data_reconciles_workers_that_died_during_the_outage() {
    let Some(mut etcd) = Etcd::start() else { return };
    let router = discovery(&etcd, "reconcile", 2).await;
    let worker = discovery(&etcd, "reconcile", 2).await;
    let mut view = router.watch();
    let mut alive = worker.register(record(WorkerRole::Prefill, "alive", 7001)).await.unwrap();
    let mut dead = worker.register(record(WorkerRole::Decode, "dead", 7002)).await.unwrap();
    assert!(alive.wait_registered(Duration::from_secs(5)).await && dead.wait_registered(Duration::from_secs(5)).await);
    assert!(wait_view(&mut view, Duration::from_secs(5), |v| v.len() == 2).await);

    etcd.kill();
    dead.abandon();
    tokio::time::sleep(Duration::from_millis(500)).await;
    etcd.restart(false);
    // etcd restores leases with a fresh TTL; the abandoned one then expires, the kept one stays.
    assert!(
        wait_view(&mut view, Duration::from_secs(10), |v| v.len() == 1
            && v.get(WorkerRole::Prefill, "alive").is_some())
        .await,
        "view after restart: {:?}",
        view.borrow()
    );
    assert!(alive.wait_registered(Duration::from_secs(5)).await);
}

/// A default etcd refuses HTTP/2 pings more often than every 5 s (GOAWAY "too_many_pings"), which cut
/// the router's watch and the workers' lease keep-alive every 8-10 s with a 2 s ping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_etcd_keeps_the_connection_for_a_minute() {
    let Some(etcd) = Etcd::start() else { return };
    let opts = EtcdOptions::default();
    let router = EtcdDiscovery::new(vec![etcd.client_url.clone()], "calm".into(), opts.clone()).await.unwrap();
    let worker = EtcdDiscovery::new(vec![etcd.client_url.clone()], "calm".into(), opts).await.unwrap();
    let mut view = router.watch();
    let mut reg = worker.register(record(WorkerRole::Decode, "d0", 7101)).await.unwrap();
    assert!(reg.wait_registered(Duration::from_secs(5)).await);
    let RegistrationState::Registered { lease } = reg.state() else { panic!("not registered: {:?}", reg.state()) };
    assert!(wait_view(&mut view, Duration::from_secs(5), |v| v.len() == 1).await);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(router.watch_failures(), 0, "the router's watch lost etcd");
    assert!(
        matches!(reg.state(), RegistrationState::Registered { lease: l } if l == lease),
        "the worker registered again: {:?}",
        reg.state()
    );
}
