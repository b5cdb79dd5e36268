//! A device failure ends a decode worker: its in-flight requests get the reason, the serve future ends
//! with it, and its etcd registration is gone at once (long before the lease could expire). The worker
//! serves the fake backend in this process and registers in a real etcd (the test is skipped without
//! one, and fails under CI).

#[path = "../../cluster/tests/support/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use cluster::ClusterView;
use engine::cache::{BlockPool, KvCache, LayerIdx};
use kv_transfer::{KvSender, SenderConfig, TransportKind};
use proto::v1::decode_event::Event;
use proto::v1::decode_worker_client::DecodeWorkerClient;
use proto::v1::{
    DecodeEvent, DecodeRequest, FinishReason, Finished, GeneratedToken, SamplingParams, TransferDescriptor, WorkerRole,
};
use tokio::sync::watch;
use worker::LoadedModel;
use worker::fake_backend::{Failure, FakeBackend};

const ID: &str = "decode-device-failure";

fn request(id: &str, prompt: &[u32]) -> DecodeRequest {
    DecodeRequest {
        request_id: id.into(),
        token_ids: prompt.to_vec(),
        sampling: Some(SamplingParams { max_tokens: 20, ignore_eos: true, ..Default::default() }),
        num_prompt_tokens: prompt.len() as u32,
        transfer_timeout_ms: 30_000,
        ..Default::default()
    }
}

async fn next(stream: &mut tonic::Streaming<DecodeEvent>) -> Option<Event> {
    let ev = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("an event in time");
    ev.expect("the stream stays healthy").and_then(|e| e.event)
}

async fn reserved(stream: &mut tonic::Streaming<DecodeEvent>) -> TransferDescriptor {
    match next(stream).await {
        Some(Event::Reserved(r)) => r.transfer.expect("a descriptor"),
        other => panic!("expected Reserved, got {other:?}"),
    }
}

/// Events until Finished.
async fn finished(stream: &mut tonic::Streaming<DecodeEvent>) -> Finished {
    loop {
        match next(stream).await {
            Some(Event::Finished(f)) => return f,
            Some(Event::Tokens(_)) => {}
            other => panic!("expected Tokens or Finished, got {other:?}"),
        }
    }
}

/// Ships `tokens` positions of (meaningless) caches to `desc` and completes the transfer, as a prefill
/// worker would.
async fn ship(model: &LoadedModel, desc: TransferDescriptor, tokens: usize) {
    let geometry = *model.cache.geometry();
    let cache = Arc::new(KvCache::new_host(geometry).unwrap());
    let sender = KvSender::new(
        SenderConfig { transports: vec![TransportKind::Tcp], ..SenderConfig::default() },
        cache,
        model.fingerprint.clone(),
    )
    .unwrap();
    let table = BlockPool::new(geometry.num_blocks).reserve(&desc.request_id, tokens).unwrap();
    tokio::task::spawn_blocking(move || {
        let session = sender.begin(&desc, &table).unwrap();
        for l in 0..geometry.num_layers {
            session.put_layer(LayerIdx(l as u32)).unwrap();
        }
        session.complete(GeneratedToken { token_id: 100, logprobs: None }, None).unwrap();
    })
    .await
    .unwrap();
}

async fn wait_view(view: &mut watch::Receiver<Arc<ClusterView>>, f: impl Fn(&ClusterView) -> bool) -> bool {
    tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| f(v))).await.is_ok_and(|r| r.is_ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_failure_fails_in_flight_requests_deregisters_and_ends_the_worker_with_the_reason() {
    let Some(etcd) = etcd::Etcd::start() else { return };
    let fake = FakeBackend::new(1280);
    let model = Arc::new(LoadedModel::from_backend(fake.clone(), 32, "fake").unwrap());
    #[rustfmt::skip]
    let args = decode_worker::Args::try_parse_from([
        "decode-worker", "--model", "fake", "--worker-id", ID, "--kv-transport", "tcp",
        "--discovery", "etcd", "--etcd", &etcd.client_url, "--cluster", "fatal", "--lease-ttl-secs", "60",
    ])
    .unwrap();
    let discovery = cluster::connect(args.serve.discovery.config(Vec::new(), Vec::new())).await.unwrap();
    let mut view = discovery.watch();
    let serving = tokio::spawn(decode_worker::serve(args, model.clone()));
    assert!(wait_view(&mut view, |v| v.get(WorkerRole::Decode, ID).is_some()).await, "registered");
    let addr = view.borrow().get(WorkerRole::Decode, ID).unwrap().grpc_address.clone();
    let mut client = DecodeWorkerClient::connect(format!("http://{addr}")).await.unwrap();

    // "decoding" gets its caches and hits the failure in its first step; "transferring" still waits for
    // its caches, which would never be decoded.
    let prompt: Vec<u32> = (0..40).map(|i| 7 + i * 3).collect();
    let mut decoding = client.decode(request("decoding", &prompt)).await.unwrap().into_inner();
    let desc = reserved(&mut decoding).await;
    let mut transferring = client.decode(request("transferring", &prompt)).await.unwrap().into_inner();
    reserved(&mut transferring).await;
    fake.fail_next(Failure::Device);
    ship(&model, desc, prompt.len()).await;
    for (name, stream) in [("decoding", &mut decoding), ("transferring", &mut transferring)] {
        let fin = finished(stream).await;
        assert_eq!(fin.reason, FinishReason::Error as i32, "{name}: {fin:?}");
        assert!(
            fin.error.contains("device failure") && fin.error.contains("injected device failure"),
            "{name}: {fin:?}"
        );
    }

    let ended = tokio::time::timeout(Duration::from_secs(15), serving).await.expect("serve ended").unwrap();
    let err = format!("{:#}", ended.expect_err("the worker failed"));
    assert!(err.contains("injected device failure"), "{err}");
    assert!(wait_view(&mut view, |v| v.get(WorkerRole::Decode, ID).is_none()).await, "deregistered, not expired");
    assert!(client.decode(request("after", &prompt)).await.is_err(), "it stopped serving");
    for _ in 0..500 {
        if model.pool.stats().used_blocks == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(model.pool.stats().used_blocks, 0, "every request's blocks are back");
}
