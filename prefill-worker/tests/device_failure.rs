//! A device failure ends a prefill worker: its in-flight requests get the reason (UNAVAILABLE, so the
//! router retries them on another prefill worker), the serve future ends with it, and its etcd
//! registration is gone at once (long before the lease could expire). The worker serves the fake backend
//! in this process and registers in a real etcd (the test is skipped without one, and fails under CI).

#[path = "../../cluster/tests/support/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::Parser;
use cluster::ClusterView;
use engine::cache::{BlockPool, KvCache};
use kv_transfer::{ExpectRequest, KvReceiver, PendingTransfer, ReceiverConfig, TcpConfig, TransportConfig};
use proto::v1::prefill_worker_client::PrefillWorkerClient;
use proto::v1::{PrefillRequest, PrefillResponse, SamplingParams, WorkerRole};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use worker::LoadedModel;
use worker::fake_backend::{Failure, FakeBackend};

const ID: &str = "prefill-device-failure";

/// The decode side: reserves blocks, expects the transfer, sends the prefill.
struct DecodeSide {
    receiver: KvReceiver,
    pool: Arc<BlockPool>,
}

impl DecodeSide {
    fn prefill(
        &self,
        client: &PrefillWorkerClient<Channel>,
        id: &str,
        prompt: Vec<u32>,
    ) -> (JoinHandle<Result<tonic::Response<PrefillResponse>, tonic::Status>>, PendingTransfer) {
        let blocks = self.pool.reserve(id, prompt.len() + 2).unwrap();
        let expect = ExpectRequest {
            request_id: id.into(),
            blocks,
            num_tokens: prompt.len(),
            timeout: Duration::from_secs(30),
            verify_checksum: false,
        };
        let (descriptor, pending) = self.receiver.expect(expect).unwrap();
        let req = PrefillRequest {
            request_id: id.into(),
            num_prompt_tokens: prompt.len() as u32,
            token_ids: prompt,
            sampling: Some(SamplingParams { max_tokens: 16, ignore_eos: true, ..Default::default() }),
            transfer: Some(descriptor),
            num_generated: 0,
        };
        let mut client = client.clone();
        (tokio::spawn(async move { client.prefill(req).await }), pending)
    }
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| 7 + (i * 11 + salt * 101) % 1200).collect()
}

async fn wait_view(view: &mut watch::Receiver<Arc<ClusterView>>, f: impl Fn(&ClusterView) -> bool) -> bool {
    tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| f(v))).await.is_ok_and(|r| r.is_ok())
}

async fn wait_pool_empty(pool: &BlockPool) {
    for _ in 0..500 {
        if pool.stats().used_blocks == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("blocks still held: {:?}", pool.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_failure_fails_in_flight_requests_deregisters_and_ends_the_worker_with_the_reason() {
    let Some(etcd) = etcd::Etcd::start() else { return };
    let fake = FakeBackend::new(1280);
    let model = Arc::new(LoadedModel::from_backend(fake.clone(), 64, "fake").unwrap());
    let geometry = *model.cache.geometry();
    let pool = Arc::new(BlockPool::new(64));
    let cache = Arc::new(KvCache::new_host(geometry).unwrap());
    let tcp = TransportConfig::Tcp(TcpConfig::default());
    let receiver = KvReceiver::start(ReceiverConfig::new(tcp), cache, pool.clone(), model.fingerprint.clone()).unwrap();
    let decode = DecodeSide { receiver, pool };
    // One prefill at a time in 96-token chunks: a long prompt computes for a while, the next one queues.
    #[rustfmt::skip]
    let args = prefill_worker::Args::try_parse_from([
        "prefill-worker", "--model", "fake", "--worker-id", ID, "--no-prefix-caching",
        "--max-num-seqs", "1", "--max-num-batched-tokens", "96",
        "--discovery", "etcd", "--etcd", &etcd.client_url, "--cluster", "fatal", "--lease-ttl-secs", "60",
    ])
    .unwrap();
    let discovery = cluster::connect(args.serve.discovery.config(Vec::new(), Vec::new())).await.unwrap();
    let mut view = discovery.watch();
    let serving = tokio::spawn(prefill_worker::serve(args, model.clone()));
    assert!(wait_view(&mut view, |v| v.get(WorkerRole::Prefill, ID).is_some()).await, "registered");
    let addr = view.borrow().get(WorkerRole::Prefill, ID).unwrap().grpc_address.clone();
    let client = PrefillWorkerClient::connect(format!("http://{addr}")).await.unwrap();

    fake.delay_us.store(10_000, Ordering::SeqCst);
    let (computing, computing_transfer) = decode.prefill(&client, "computing", prompt(1500, 1));
    while fake.calls.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (queued, queued_transfer) = decode.prefill(&client, "queued", prompt(40, 2));
    tokio::time::sleep(Duration::from_millis(20)).await;
    fake.fail_next(Failure::Device);
    for (name, call) in [("computing", computing), ("queued", queued)] {
        let status = tokio::time::timeout(Duration::from_secs(10), call).await.expect("answered").unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{name}: {status:?}");
        assert!(status.message().contains("injected device failure"), "{name}: {status:?}");
    }
    let r = tokio::time::timeout(Duration::from_secs(10), computing_transfer).await.expect("settled");
    assert!(r.is_err(), "the decode side hears of the abort: {r:?}");
    // Never begun: the router aborts it on the prefill failure.
    queued_transfer.abort("prefill failed");

    let ended = tokio::time::timeout(Duration::from_secs(15), serving).await.expect("serve ended").unwrap();
    let err = format!("{:#}", ended.expect_err("the worker failed"));
    assert!(err.contains("injected device failure"), "{err}");
    assert!(wait_view(&mut view, |v| v.get(WorkerRole::Prefill, ID).is_none()).await, "deregistered, not expired");
    let (after, after_transfer) = decode.prefill(&client, "after", prompt(40, 3));
    assert!(after.await.unwrap().is_err(), "it stopped serving");
    after_transfer.abort("prefill failed");
    wait_pool_empty(&model.pool).await;
    wait_pool_empty(&decode.pool).await;
}
