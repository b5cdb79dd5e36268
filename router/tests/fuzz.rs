//! Fuzzing the router's front doors against a live router (in this process, on loopback, in front of
//! worker doubles): arbitrary and structure-aware-mutated JSON bodies on both generate endpoints, and
//! arbitrary bytes and field values on `tandem.v1.Generate`. Whatever arrives, the answer is a
//! well-formed success or a client error with a JSON error body (HTTP) / a status with a message
//! (gRPC): never a 5xx, a panic, a hang or a dropped connection. schemathesis then fuzzes the same
//! router from its `/openapi.json`. Bounded by `fuzzing::config` (`TANDEM_FUZZ_CASES` for long runs,
//! scripts/fuzz.sh); the inputs these runs found are kept as the regression tests at the end.

mod support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use proto::v1::generate_client::GenerateClient;
use proto::v1::generate_request::Input;
use proto::v1::{ChatMessage, ChatMessages, GenerateRequest, SamplingParams, TokenIds};
use serde_json::{Value, json};
use support::harness::{Cluster, MODEL, Options};

const CASES: u32 = 96;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Valid requests with every documented field, the seeds of the mutations.
fn chat_seed() -> Value {
    json!({
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 8, "max_completion_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
        "logit_bias": {"5": 1.0}, "n": 1, "best_of": 1, "stream": false,
        "stream_options": {"include_usage": true, "continuous_usage_stats": false},
        "stop": ["\n"], "stop_token_ids": [3], "ignore_eos": false, "min_tokens": 1,
        "skip_special_tokens": true, "include_stop_str_in_output": false, "logprobs": true, "top_logprobs": 2,
        "add_generation_prompt": true, "continue_final_message": false, "chat_template_kwargs": {"x": 1},
        "add_special_tokens": false, "tools": null, "tool_choice": "none", "response_format": {"type": "text"}
    })
}

fn completion_seed() -> Value {
    json!({
        "model": MODEL, "prompt": "Once upon", "echo": false, "logprobs": 1, "suffix": "",
        "add_special_tokens": true, "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 1,
        "logit_bias": {"7": -100}, "stream": true, "stream_options": {"include_usage": true},
        "stop": "x", "stop_token_ids": [], "min_tokens": 0, "n": 1
    })
}

/// Checks one HTTP answer: a 2xx with a JSON or SSE body, or a 4xx with the JSON error object.
fn check_http(body_sent: &[u8], status: u16, content_type: &str, text: &str) -> Result<(), TestCaseError> {
    let sent = String::from_utf8_lossy(&body_sent[..body_sent.len().min(300)]).into_owned();
    prop_assert!(status < 500, "{status} for {sent:?}: {text}");
    if (200..300).contains(&status) {
        if content_type.starts_with("text/event-stream") {
            prop_assert!(text.ends_with("data: [DONE]\n\n"), "stream not terminated for {sent:?}: {text}");
        } else {
            let v: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
            prop_assert!(v["choices"].is_array(), "no choices for {sent:?}: {v}");
        }
        return Ok(());
    }
    prop_assert!(content_type.starts_with("application/json"), "{status} {content_type} for {sent:?}");
    let v: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    prop_assert!(!msg.is_empty() && v["error"]["type"].is_string(), "bad error body for {sent:?}: {v}");
    Ok(())
}

async fn post(c: &Cluster, path: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    let send = c.http.post(c.url(path)).header("content-type", "application/json").body(body.clone()).send();
    let r = tokio::time::timeout(Duration::from_secs(20), send)
        .await
        .map_err(|_| TestCaseError::fail("no answer within 20 s"))?
        .map_err(|e| TestCaseError::fail(format!("connection failed: {e}")))?;
    let status = r.status().as_u16();
    let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let text = tokio::time::timeout(Duration::from_secs(20), r.text())
        .await
        .map_err(|_| TestCaseError::fail("body did not end within 20 s"))?
        .map_err(|e| TestCaseError::fail(format!("body failed: {e}")))?;
    check_http(&body, status, &ct, &text)
}

/// Every request field name either endpoint knows, so arbitrary objects hit real fields.
fn field_names() -> Vec<String> {
    let mut k = fuzzing::json::keys_of(&chat_seed());
    k.extend(fuzzing::json::keys_of(&completion_seed()));
    k.extend(["role", "content", "type", "text", "name"].map(String::from));
    k.sort();
    k.dedup();
    k
}

#[test]
fn http_bodies_get_an_answer_or_a_json_4xx_never_a_5xx() {
    let rt = runtime();
    // A small body limit, so that grown bodies take the 413 path too.
    let args = vec!["--max-body-bytes".into(), (1 << 20).to_string()];
    let c = rt.block_on(Cluster::start(Options { args, ..Default::default() }));
    let body = |v: Value| serde_json::to_vec(&v).unwrap();
    for path in [CHAT, COMPLETIONS] {
        fuzzing::run(CASES, &format!("{path} bytes"), fuzzing::bytes(4096), |b| rt.block_on(post(&c, path, b)));
        fuzzing::run(CASES, &format!("{path} json"), fuzzing::json::value(field_names(), 3), |v| {
            rt.block_on(post(&c, path, body(v)))
        });
    }
    fuzzing::run(CASES, "chat mutated", fuzzing::json::mutated(chat_seed(), 4), |v| {
        rt.block_on(post(&c, CHAT, body(v)))
    });
    fuzzing::run(CASES, "completions mutated", fuzzing::json::mutated(completion_seed(), 4), |v| {
        rt.block_on(post(&c, COMPLETIONS, body(v)))
    });
    rt.block_on(c.shutdown());
}

/// Arbitrary values in every GenerateRequest field.
fn generate_request() -> impl Strategy<Value = GenerateRequest> {
    let text = fuzzing::json::edge_string();
    let input = prop_oneof![
        1 => Just(None),
        3 => text.clone().prop_map(|t| Some(Input::Text(t))),
        3 => proptest::collection::vec(prop_oneof![0u32..2000, any::<u32>()], 0..600)
            .prop_map(|ids| Some(Input::TokenIds(TokenIds { ids }))),
        3 => (proptest::collection::vec((text.clone(), text.clone(), text.clone()), 0..4), any::<Option<bool>>())
            .prop_map(|(m, add)| Some(Input::Chat(ChatMessages {
                messages: m.into_iter().map(|(role, content, name)| ChatMessage { role, content, name }).collect(),
                add_generation_prompt: add,
            }))),
    ];
    let f = || prop_oneof![Just(0.0f32), Just(1.0), Just(-1.0), Just(f32::NAN), Just(f32::INFINITY), any::<f32>()];
    let sampling = (
        (prop_oneof![0u32..16, any::<u32>()], f(), f(), any::<i32>(), f(), any::<Option<u64>>()),
        (f(), f(), f(), any::<bool>(), proptest::collection::vec(any::<u32>(), 0..4)),
        (prop_oneof![0u32..4, any::<u32>()], any::<Option<u32>>()),
        proptest::collection::btree_map(any::<u32>(), f(), 0..4),
    )
        .prop_map(
            |(
                (max_tokens, temperature, top_p, top_k, min_p, seed),
                (pp, fp, rp, ignore_eos, stops),
                (min_tokens, logprobs),
                bias,
            )| {
                SamplingParams {
                    max_tokens,
                    temperature,
                    top_p,
                    top_k,
                    min_p,
                    seed,
                    presence_penalty: pp,
                    frequency_penalty: fp,
                    repetition_penalty: rp,
                    ignore_eos,
                    stop_token_ids: stops,
                    min_tokens,
                    logprobs,
                    logit_bias: bias.into_iter().collect(),
                }
            },
        );
    let model = prop_oneof![Just(String::new()), Just(MODEL.to_owned()), fuzzing::json::edge_string()];
    (
        input,
        proptest::option::of(sampling),
        model,
        proptest::collection::vec(text.clone(), 0..3),
        text,
        any::<Option<bool>>(),
    )
        .prop_map(|(input, sampling, model, stop, request_id, skip)| GenerateRequest {
            model,
            input,
            sampling,
            stop,
            request_id,
            skip_special_tokens: skip,
        })
}

/// A stream that ends with a finish reason, or a client-side status with a message.
async fn check_generate(
    client: &mut GenerateClient<tonic::transport::Channel>,
    req: GenerateRequest,
) -> Result<(), TestCaseError> {
    let shown = format!("{req:?}").chars().take(400).collect::<String>();
    let call = async {
        match client.generate(req).await {
            Ok(s) => {
                let mut s = s.into_inner();
                let mut finished = false;
                while let Some(m) = s.message().await? {
                    finished |= m.finish_reason != 0;
                }
                Ok(finished)
            }
            Err(e) => Err(e),
        }
    };
    match tokio::time::timeout(Duration::from_secs(20), call).await {
        Err(_) => Err(TestCaseError::fail(format!("no answer within 20 s: {shown}"))),
        Ok(Ok(finished)) => {
            prop_assert!(finished, "stream ended without a finish reason: {shown}");
            Ok(())
        }
        Ok(Err(status)) => {
            prop_assert!(is_client_status(status.code()), "{status:?} for {shown}");
            prop_assert!(!status.message().is_empty(), "status without a message for {shown}");
            Ok(())
        }
    }
}

#[test]
fn grpc_requests_get_a_stream_or_a_client_status_never_internal() {
    let rt = runtime();
    let c = rt.block_on(Cluster::start(Options::default()));
    let client = rt.block_on(GenerateClient::connect(c.grpc.clone())).unwrap();
    fuzzing::run(CASES, "grpc fields", generate_request(), |req| rt.block_on(check_generate(&mut client.clone(), req)));
    // The same service, fed bytes that are not (or not quite) a GenerateRequest.
    let channel = rt.block_on(tonic::transport::Endpoint::from_shared(c.grpc.clone()).unwrap().connect()).unwrap();
    fuzzing::run(CASES, "grpc bytes", fuzzing::bytes(2048), |bytes| rt.block_on(raw_generate(channel.clone(), bytes)));
    fuzzing::run(CASES, "grpc mutated encoding", encoded_then_damaged(), |bytes| {
        rt.block_on(raw_generate(channel.clone(), bytes))
    });
    rt.block_on(c.shutdown());
}

/// A valid request's prost encoding with bytes overwritten, inserted or cut off: varints, lengths and
/// tags that are almost right.
fn encoded_then_damaged() -> impl Strategy<Value = Vec<u8>> {
    use prost::Message;
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..6);
    (generate_request(), edits, any::<Option<usize>>()).prop_map(|(req, edits, cut)| {
        let mut b = req.encode_to_vec();
        for (at, byte, kind) in edits {
            let at = at % (b.len() + 1);
            match kind {
                0 if at < b.len() => b[at] = byte,
                1 => b.insert(at, byte),
                _ if at < b.len() => {
                    b.remove(at);
                }
                _ => b.push(byte),
            }
        }
        if let Some(n) = cut {
            b.truncate(n % (b.len() + 1));
        }
        b
    })
}

/// Sends `bytes` as the request message of `Generate` (not prost-encoded by us).
async fn raw_generate(channel: tonic::transport::Channel, bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| TestCaseError::fail(e.to_string()))?;
    let path = axum::http::uri::PathAndQuery::from_static("/tandem.v1.Generate/Generate");
    let shown = format!("{bytes:?}");
    let call = async {
        let mut s = grpc.server_streaming(tonic::Request::new(bytes), path, RawCodec).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    match tokio::time::timeout(Duration::from_secs(20), call).await {
        Err(_) => Err(TestCaseError::fail(format!("no answer within 20 s: {shown}"))),
        Ok(Ok(())) => Ok(()),
        Ok(Err(status)) => {
            prop_assert!(is_client_status(status.code()), "{status:?} for {shown}");
            prop_assert!(!status.message().is_empty(), "status without a message for {shown}");
            Ok(())
        }
    }
}

/// The codes that blame the request (tonic's INTERNAL or UNKNOWN would blame the router).
fn is_client_status(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(code, Code::InvalidArgument | Code::NotFound | Code::OutOfRange | Code::FailedPrecondition)
}

/// Writes request messages as given; reads response messages as opaque bytes.
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

/// schemathesis (in the test venv, next to TANDEM_PYTHON) generates requests from the served
/// `/openapi.json`, valid and invalid, and checks every answer: no 5xx, statuses, content types and
/// bodies as documented, schema-invalid bodies refused. Bounded by `--max-examples`.
#[test]
fn schemathesis_finds_no_server_error_and_no_answer_outside_the_document() {
    let required = std::env::var("CI").is_ok_and(|v| v == "true");
    let Some(python) = std::env::var_os("TANDEM_PYTHON") else {
        assert!(!required, "TANDEM_PYTHON must be set under CI (scripts/test.sh sets it)");
        eprintln!("SKIP: TANDEM_PYTHON is not set (scripts/test.sh creates .venv with schemathesis)");
        return;
    };
    let cli = std::path::Path::new(&python).with_file_name("schemathesis");
    if !cli.is_file() {
        assert!(!required, "{} is missing under CI (scripts/test.sh installs schemathesis)", cli.display());
        eprintln!("SKIP: {} is missing (scripts/test.sh installs it)", cli.display());
        return;
    }
    let rt = runtime();
    let c = rt.block_on(Cluster::start(Options::default()));
    // 25 examples an operation here; scripts/fuzz.sh's TANDEM_FUZZ_CASES / 100 on long runs.
    let examples = (fuzzing::cases(2500) / 100).max(1).to_string();
    let report = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(&cli)
        .args(["run", &c.url("/openapi.json"), "--url", &c.base, "--max-examples", &examples])
        // The bounded run is the same every time; long runs (scripts/fuzz.sh) draw a seed and print it.
        .args(if std::env::var_os(fuzzing::CASES_ENV).is_none() { &["--seed", "1"][..] } else { &[] })
        .args(["--workers", "1", "--phases", "examples,coverage,fuzzing", "--max-response-time", "20"])
        .args(["--checks", SCHEMATHESIS_CHECKS, "--generation-database", "none"])
        .args(["--report-dir", &report.path().display().to_string(), "--no-color"])
        // Its caches (.hypothesis, .schemathesis) go there too, not into the source tree.
        .current_dir(report.path())
        .output()
        .unwrap();
    rt.block_on(c.shutdown());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "schemathesis failed:\n{stdout}\n{stderr}");
    // The summary (operations, cases, checks) in the test log.
    eprintln!("{}", stdout.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n"));
}

/// What schemathesis checks on every answer.
const SCHEMATHESIS_CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
response_schema_conformance,negative_data_rejection";

/// Found by the HTTP fuzz test: a body over `--max-body-bytes` was refused before it was read, and the
/// connection closed with the rest unread, so the client got a connection reset instead of the 413.
#[test]
fn a_body_over_the_limit_gets_a_413_the_client_can_read() {
    let rt = runtime();
    let args = vec!["--max-body-bytes".into(), "1000".into()];
    let c = rt.block_on(Cluster::start(Options { args, ..Default::default() }));
    for size in [5_000, 4 << 20] {
        let body = serde_json::to_vec(&json!({"prompt": "x".repeat(size)})).unwrap();
        // Announced (Content-Length) and streamed (chunked, no length).
        for chunked in [false, true] {
            let req = c.http.post(c.url(COMPLETIONS)).header("content-type", "application/json");
            let req = if chunked {
                let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                    body.chunks(64 << 10).map(|c| Ok(c.to_vec())).collect();
                req.body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
            } else {
                req.body(body.clone())
            };
            let r = rt.block_on(req.send()).unwrap_or_else(|e| panic!("{size} bytes, chunked {chunked}: {e:?}"));
            assert_eq!(r.status(), 413, "{size} bytes, chunked {chunked}");
            let v: Value = rt.block_on(r.json()).unwrap();
            assert!(v["error"]["message"].as_str().unwrap().contains("1000 bytes"), "{v}");
        }
    }
    rt.block_on(c.shutdown());
}

/// Requests the OpenAPI document calls invalid that the router used to accept (found by schemathesis):
/// each is a 400 naming the field.
#[test]
fn schema_violations_found_by_schemathesis_are_refused() {
    let rt = runtime();
    let c = rt.block_on(Cluster::start(Options::default()));
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (CHAT, json!({"messages": user, "stream_options": [null, null]}), "stream_options"),
        (CHAT, json!({"messages": user, "logprobs": false, "top_logprobs": -1}), "top_logprobs"),
        (CHAT, json!({"messages": user, "max_completion_tokens": 4, "max_tokens": 0}), "max_tokens"),
        (CHAT, json!({"messages": user, "max_completion_tokens": 4, "max_tokens": 100_000}), "max_tokens"),
        (CHAT, json!({"messages": user, "response_format": "text"}), "response_format"),
        (CHAT, json!({"messages": user, "response_format": {"type": null}}), "response_format"),
        (CHAT, json!({"messages": [{"role": "user", "content": "Hi", "name": 7}]}), "messages"),
        (CHAT, json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), "messages"),
        (COMPLETIONS, json!({"prompt": "x", "stream_options": [true]}), "stream_options"),
    ];
    for (path, body, param) in cases {
        let (status, v) = rt.block_on(c.post_json(path, body.clone()));
        assert_eq!(status, 400, "{body}: {v}");
        let named = v["error"]["param"] == param || v["error"]["message"].as_str().unwrap().contains(param);
        assert!(named, "the error does not name {param}: {body}: {v}");
    }
    rt.block_on(c.shutdown());
}
