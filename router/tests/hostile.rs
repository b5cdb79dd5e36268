//! What a hostile or careless client sends, and limits the workers impose: each case must end in a
//! clear error (or a correct answer), never a wrong status, a hang or a held connection.

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use proto::v1::generate_client::GenerateClient;
use proto::v1::generate_request::Input;
use proto::v1::{ChatMessage, ChatMessages, FinishReason, GenerateRequest, SamplingParams};
use serde_json::{Value, json};
use support::harness::{Cluster, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn chat(content: &str) -> Value {
    json!({"messages": [{"role": "user", "content": content}]})
}

/// Sends raw bytes on a fresh connection and returns what the router answered before closing, or
/// None when it sent nothing within `limit`.
async fn raw(c: &Cluster, bytes: &[u8], close_write: bool, limit: Duration) -> Option<String> {
    let addr = c.base.trim_start_matches("http://").to_owned();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    if close_write {
        s.shutdown().await.unwrap();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, s.read_to_end(&mut out)).await;
    (!out.is_empty()).then(|| String::from_utf8_lossy(&out).into_owned())
}

fn status_of(resp: &str) -> u16 {
    resp.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

fn body_of(resp: &str) -> Value {
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not a JSON body ({e}): {resp:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_uses_the_workers_context_limit_for_defaults_validation_and_models() {
    let c = Cluster::start(Options { worker_max_model_len: Some(256), ..Default::default() }).await;
    let models: Value = c.http.get(c.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 256, "{models}");

    // No max_tokens: the rest of the workers' context, not the router's 512.
    let (s, body) = c.post_json("/v1/chat/completions", chat("x")).await;
    assert_eq!(s, 200, "{body}");
    let sent = c.decode[0].log().decodes.last().unwrap().3.max_tokens as usize;
    assert_eq!(sent + c.prefill[0].log().prefills.last().unwrap().2.len(), 256);

    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 300})).await;
    assert_eq!(s, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("maximum context length is 256 tokens"), "{body}");

    // gRPC max_tokens = 0 means the rest of the context.
    let mut client = GenerateClient::connect(c.grpc.clone()).await.unwrap();
    let req = GenerateRequest {
        input: Some(Input::TokenIds(proto::v1::TokenIds { ids: vec![10; 6] })),
        sampling: Some(SamplingParams { max_tokens: 0, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut last = None;
    while let Some(r) = stream.message().await.unwrap() {
        last = Some(r);
    }
    assert_eq!(last.unwrap().finish_reason, FinishReason::Stop as i32);
    assert_eq!(c.decode[0].log().decodes.last().unwrap().3.max_tokens, 250);
    let listed = client.list_models(proto::v1::ListModelsRequest {}).await.unwrap().into_inner();
    assert_eq!(listed.models[0].max_model_len, 256);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_body_is_a_400_not_a_413() {
    let c = Cluster::start(Options::default()).await;
    let head =
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    let resp = raw(&c, format!("{head}{{\"prompt\":").as_bytes(), true, Duration::from_secs(10)).await.unwrap();
    assert_eq!(status_of(&resp), 400, "{resp}");
    let msg = body_of(&resp)["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("could not be read completely"), "{msg}");
    assert!(!msg.contains("larger than the limit"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_requests_do_not_hold_connections() {
    let args = ["--header-read-timeout-secs", "1", "--body-read-timeout-secs", "1"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    let limit = Duration::from_secs(15);

    // Half the headers, then silence: the connection is closed.
    let started = Instant::now();
    let addr = c.base.trim_start_matches("http://").to_owned();
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(limit, s.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "connection still open after {limit:?}");
    assert!(started.elapsed() < Duration::from_secs(10));

    // A connection that never sends a byte is closed too.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    assert!(tokio::time::timeout(limit, s.read_to_end(&mut buf)).await.is_ok(), "silent connection kept open");

    // Headers, part of the body, silence: 408 with a JSON error.
    let head =
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    let resp = raw(&c, format!("{head}{{\"prompt\":").as_bytes(), false, limit).await.expect("no answer");
    assert_eq!(status_of(&resp), 408, "{resp}");
    assert!(body_of(&resp)["error"]["message"].as_str().unwrap().contains("--body-read-timeout-secs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_reused_while_in_flight_is_served_twice() {
    let c = Cluster::start(Options::default()).await;
    c.decode[0].knobs.token_interval_us.store(20_000, Ordering::Relaxed);
    let send = || {
        let (http, url) = (c.http.clone(), c.url("/v1/completions"));
        tokio::spawn(async move {
            let r = http
                .post(url)
                .header("x-request-id", "same-id")
                .json(&json!({"prompt": "x", "max_tokens": 8}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.headers()["x-request-id"].to_str().unwrap().to_owned())
        })
    };
    let (a, b) = (send(), send());
    assert_eq!(a.await.unwrap(), (200, "same-id".to_owned()));
    assert_eq!(b.await.unwrap(), (200, "same-id".to_owned()));
    let mut ids: Vec<String> = c.decode[0].log().decodes.iter().map(|d| d.0.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["same-id", "same-id~1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_errors_name_the_real_cause() {
    let args = ["--queue-timeout-secs", "0"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    *c.decode[0].knobs.full_reason.lock().unwrap() = "64 requests running or transferring (--max-num-seqs 64)".into();
    c.decode[0].knobs.decode_full.store(true, Ordering::Relaxed);
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 429, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--max-num-seqs 64"), "{msg}");
    assert!(!msg.contains("KV-cache"), "{msg}");
    c.decode[0].knobs.decode_full.store(false, Ordering::Relaxed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_decode_down_is_reported_as_decode_down() {
    let mut c = Cluster::start(Options::default()).await;
    c.decode[0].kill();
    let mut last = Value::Null;
    for _ in 0..300 {
        let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
        last = body;
        if s == 503 && last.to_string().contains("0 of 1 decode") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let msg = last["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("1 of 1 prefill and 0 of 1 decode"), "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_rejects_what_http_rejects() {
    let c = Cluster::start(Options::default()).await;
    let mut client = GenerateClient::connect(c.grpc.clone()).await.unwrap();
    let with = |s: SamplingParams| GenerateRequest {
        input: Some(Input::Chat(ChatMessages {
            messages: vec![ChatMessage { role: "user".into(), content: "Hi".into(), name: String::new() }],
            add_generation_prompt: None,
        })),
        sampling: Some(SamplingParams { max_tokens: 4, ..s }),
        ..Default::default()
    };
    for bad in [
        SamplingParams { logprobs: Some(1_000_000), ..Default::default() },
        SamplingParams { top_k: -7, ..Default::default() },
        SamplingParams { top_p: f32::NAN, ..Default::default() },
    ] {
        let e = client.generate(with(bad)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    assert!(c.decode[0].log().decodes.is_empty(), "nothing reached a worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_grpc_message_is_invalid_argument() {
    let c = Cluster::start(Options::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(c.grpc.clone()).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = axum::http::uri::PathAndQuery::from_static("/tandem.v1.Generate/Generate");
    // Field 1, wire type 2, length 200, then 3 bytes: a truncated message.
    let garbage = bytes::Bytes::from_static(&[0x0a, 0xc8, 0x01, 1, 2, 3]);
    let e = grpc.server_streaming(tonic::Request::new(garbage), path, RawCodec).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}

/// Sends bytes as they are (a client with a broken encoder).
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = bytes::Bytes;
    type Decode = bytes::Bytes;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = bytes::Bytes;
    type Error = tonic::Status;
    fn encode(&mut self, item: bytes::Bytes, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        bytes::BufMut::put(dst, item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = bytes::Bytes;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<bytes::Bytes>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_full_decode_worker_instead_of_an_immediate_429() {
    let args = ["--queue-timeout-secs", "5"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    c.decode[0].knobs.decode_full.store(true, Ordering::Relaxed);
    let knobs = c.decode[0].knobs.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        knobs.decode_full.store(false, Ordering::Relaxed);
    });
    let started = Instant::now();
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 200, "{body}");
    assert!(started.elapsed() >= Duration::from_millis(600), "it cannot have run while the worker was full");
    assert!(c.decode[0].log().decodes.len() >= 2, "tried again after the refusal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_for_decode_room_is_bounded_by_time_and_length() {
    let args = ["--queue-timeout-secs", "0.5", "--max-queued-requests", "1"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    c.decode[0].knobs.decode_full.store(true, Ordering::Relaxed);
    let first = {
        let (http, url) = (c.http.clone(), c.url("/v1/completions"));
        tokio::spawn(async move {
            let t = Instant::now();
            let r = http.post(url).json(&json!({"prompt": "x"})).send().await.unwrap();
            (r.status().as_u16(), r.headers().contains_key("retry-after"), t.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The one waiting place is taken: 429 at once.
    let t = Instant::now();
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "y"})).await;
    assert_eq!(s, 429, "{body}");
    assert!(t.elapsed() < Duration::from_millis(400), "{:?}", t.elapsed());
    let (s, retry_after, waited) = first.await.unwrap();
    assert_eq!((s, retry_after), (429, true));
    assert!(waited >= Duration::from_millis(450) && waited < Duration::from_secs(5), "{waited:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_request_waits_for_room_and_its_stream_continues() {
    let c = Cluster::start(Options::default()).await;
    let k = &c.decode[0].knobs;
    k.token_interval_us.store(20_000, Ordering::Relaxed);
    k.preempt_after.store(3, Ordering::Relaxed);
    k.full_after_preempt.store(true, Ordering::Relaxed);
    let knobs = k.clone();
    tokio::spawn(async move {
        // Full from the preemption (after ~3 tokens) until here.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        knobs.decode_full.store(false, Ordering::Relaxed);
    });
    let (s, _, body) = c.post("/v1/completions", json!({"prompt": "x", "max_tokens": 50, "stream": true})).await;
    assert_eq!(s, 200);
    assert!(!body.contains("\"error\""), "the stream ended with an error: {body}");
    let text: String = support::harness::sse_events(&body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(text, support::harness::REPLY);
    assert!(c.decode[0].log().decodes.len() >= 3, "refused at least once while full, then continued");
}
