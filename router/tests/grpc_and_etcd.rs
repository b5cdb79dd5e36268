//! The gRPC front door, and the router following workers through a real etcd.

mod support;

#[path = "../../cluster/tests/support/etcd.rs"]
mod etcd;

use std::time::Duration;

use cluster::{Capacity, Discovery, EtcdDiscovery, EtcdOptions, WorkerRecord};
use proto::v1::WorkerRole as Role;
use proto::v1::generate_client::GenerateClient;
use proto::v1::generate_request::Input;
use proto::v1::{ChatMessage, ChatMessages, FinishReason, GenerateRequest, ListModelsRequest, SamplingParams};
use support::harness::{Cluster, MODEL, Options, REPLY};

fn request(input: Input, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(input),
        sampling: Some(SamplingParams { max_tokens, ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_takes_the_bearer_scheme_in_any_case_and_limits_each_key() {
    let args = ["--api-key", "k", "--api-key-rate-limit", "1"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    let mut client = GenerateClient::connect(c.grpc.clone()).await.unwrap();
    let call = |auth: &'static str| {
        let mut req = tonic::Request::new(request(Input::Text("hi".into()), 4));
        req.metadata_mut().insert("authorization", auth.parse().unwrap());
        req
    };
    let mut stream = client.generate(call("bearer k")).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    let limited = client.generate(call("Bearer k")).await.unwrap_err();
    assert_eq!(limited.code(), tonic::Code::ResourceExhausted, "{limited:?}");
    assert!(limited.message().contains("rate limit") && !limited.message().contains(" k "), "{}", limited.message());
    assert_eq!(client.generate(call("Bearer nope")).await.unwrap_err().code(), tonic::Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_generate_streams_text_then_a_final_response_with_usage() {
    let c = Cluster::start(Options { args: vec!["--api-key".into(), "k".into()], ..Default::default() }).await;
    let mut client = GenerateClient::connect(c.grpc.clone()).await.unwrap();

    let denied = client.generate(request(Input::Text("hi".into()), 8)).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);

    let mut req = tonic::Request::new(request(Input::Text("hi".into()), 64));
    req.metadata_mut().insert("authorization", "Bearer k".parse().unwrap());
    req.metadata_mut().insert("x-request-id", "grpc-1".parse().unwrap());
    let resp = client.generate(req).await.unwrap();
    assert_eq!(resp.metadata().get("x-request-id").unwrap(), "grpc-1");
    let mut stream = resp.into_inner();
    let mut text = String::new();
    let mut tokens = 0;
    let mut last = None;
    while let Some(r) = stream.message().await.unwrap() {
        assert_eq!(r.request_id, "grpc-1");
        text.push_str(&r.text);
        tokens += r.tokens.len();
        last = Some(r);
    }
    let last = last.unwrap();
    assert_eq!(text, REPLY);
    assert_eq!(last.finish_reason, FinishReason::Stop as i32);
    let usage = last.usage.unwrap();
    assert_eq!(usage.completion_tokens as usize, c.tokenizer.encode(REPLY, false).unwrap().len() + 1);
    assert!(tokens > 0);
    assert_eq!(c.decode[0].log().decodes[0].1, "grpc-1");

    let chat = Input::Chat(ChatMessages {
        messages: vec![ChatMessage { role: "user".into(), content: "Hi".into(), name: String::new() }],
        add_generation_prompt: None,
    });
    let mut req = tonic::Request::new(request(chat, 0));
    req.metadata_mut().insert("authorization", "Bearer k".parse().unwrap());
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut text = String::new();
    while let Some(r) = stream.message().await.unwrap() {
        text.push_str(&r.text);
    }
    assert_eq!(text, REPLY);
    let expected = c.tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>", false).unwrap();
    assert_eq!(c.prefill[0].log().prefills[1].2, expected);

    let channel = tonic::transport::Channel::from_shared(c.grpc.clone()).unwrap().connect().await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = tonic_health::pb::HealthCheckRequest { service: "tandem.v1.Generate".into() };
    let status = health.check(check).await.unwrap().into_inner().status;
    assert_eq!(status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);

    let mut req = tonic::Request::new(ListModelsRequest {});
    req.metadata_mut().insert("authorization", "Bearer k".parse().unwrap());
    assert_eq!(client.list_models(req).await.unwrap().into_inner().models[0].id, MODEL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_errors_are_statuses_with_messages() {
    let c = Cluster::start(Options::default()).await;
    let mut client = GenerateClient::connect(c.grpc.clone()).await.unwrap();
    let e = client.generate(request(Input::Text("hi".into()), 100_000)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("maximum context length"), "{}", e.message());
    let e = client.generate(GenerateRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let mut r = request(Input::Text("x".into()), 4);
    r.model = "nope".into();
    assert_eq!(client.generate(r).await.unwrap_err().code(), tonic::Code::NotFound);
}

fn record(d: &support::double::Double, role: Role) -> WorkerRecord {
    WorkerRecord {
        id: d.id.clone(),
        role,
        grpc_address: d.grpc_address(),
        capacity: Capacity { max_num_seqs: 8, kv_blocks_total: 1000, max_model_len: 4096 },
        fingerprint: Some(d.fingerprint.clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_follows_workers_registered_in_etcd() {
    let Some(etcd) = etcd::Etcd::start() else { return };
    // Doubles without a router of their own; the router below finds them through etcd only.
    let doubles = Cluster::start(Options { prefill: 2, wait_ready: false, ..Default::default() }).await;
    let opts = EtcdOptions {
        lease_ttl: Duration::from_secs(2),
        request_timeout: Duration::from_secs(1),
        max_backoff: Duration::from_millis(200),
    };
    let reg = EtcdDiscovery::new(vec![etcd.client_url.clone()], "rt".into(), opts).await.unwrap();
    let p0 = reg.register(record(&doubles.prefill[0], Role::Prefill)).await.unwrap();
    let _d0 = reg.register(record(&doubles.decode[0], Role::Decode)).await.unwrap();

    let args = support::harness::router_args(
        doubles.model_dir.path(),
        &[],
        &[],
        &["--discovery", "etcd", "--etcd", &etcd.client_url, "--cluster", "rt", "--prefill-policy", "round-robin"]
            .map(String::from),
    );
    let http_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = router::start_with_listeners(args, http_l, None).await.unwrap();
    let url = format!("http://{}/v1/completions", router.http_addr);
    let ready = format!("http://{}/ready", router.http_addr);
    let http = reqwest::Client::new();
    let mut ok = false;
    for _ in 0..100 {
        if http.get(&ready).send().await.unwrap().status() == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "router saw the registered workers");
    let send = || http.post(&url).json(&serde_json::json!({"prompt": "x"})).send();
    assert_eq!(send().await.unwrap().status(), 200);

    // A second prefill worker registers: it gets traffic. The first leaves: it gets none.
    let _p1 = reg.register(record(&doubles.prefill[1], Role::Prefill)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..4 {
        assert_eq!(send().await.unwrap().status(), 200);
    }
    assert!(!doubles.prefill[1].log().prefills.is_empty(), "new worker used");
    p0.deregister().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = doubles.prefill[0].log().prefills.len();
    for _ in 0..4 {
        assert_eq!(send().await.unwrap().status(), 200);
    }
    assert_eq!(doubles.prefill[0].log().prefills.len(), before, "deregistered worker no longer used");
    router.shutdown().await;
}
