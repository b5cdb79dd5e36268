//! `tandem bench` against an emulated OpenAI server whose timing and token counts are known: a first
//! token after `TTFT`, then chunks of two tokens every `GAP` (as MTP-accepted drafts arrive), usage on
//! every chunk when asked for.

use std::convert::Infallible;
use std::net::TcpListener as StdListener;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde_json::{Value, json};

const TTFT: Duration = Duration::from_millis(150);
const GAP: Duration = Duration::from_millis(20);
const TOKENS_PER_CHUNK: u64 = 2;

#[derive(Clone, Default)]
struct Emu {
    /// Every n-th request (0: none) fails after its first token with an SSE error event.
    fail_every: usize,
    /// Every request is refused with this HTTP status.
    refuse: Option<StatusCode>,
    served: Arc<AtomicUsize>,
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

async fn generate(State(emu): State<Emu>, Json(body): Json<Value>, chat: bool) -> Response {
    let n = emu.served.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(status) = emu.refuse {
        let err = json!({ "error": { "message": "emulated refusal", "type": "server_error" } });
        return (status, Json(err)).into_response();
    }
    let prompt = match chat {
        false => body["prompt"].as_array().map_or(0, Vec::len) as u64,
        true => body["messages"][0]["content"].as_str().unwrap_or("").split(' ').count() as u64,
    };
    let max_tokens = body["max_tokens"].as_u64().unwrap();
    let choice = |text: &str, finish: Value| match chat {
        false => json!({ "index": 0, "text": text, "finish_reason": finish }),
        true => json!({ "index": 0, "delta": { "content": text }, "finish_reason": finish }),
    };
    // Tokens per content chunk: 1, then TOKENS_PER_CHUNK at a time.
    let mut sizes = vec![1];
    let mut sent = 1;
    while sent < max_tokens {
        let k = TOKENS_PER_CHUNK.min(max_tokens - sent);
        sizes.push(k);
        sent += k;
    }
    if body["stream"] != json!(true) {
        tokio::time::sleep(TTFT + GAP * (sizes.len() as u32 - 1)).await;
        let text = "t".repeat(max_tokens as usize);
        let c = if chat {
            json!({ "index": 0, "message": { "role": "assistant", "content": text } })
        } else {
            choice(&text, json!("length"))
        };
        return Json(json!({ "choices": [c], "usage": usage(prompt, max_tokens) })).into_response();
    }
    let continuous = body["stream_options"]["continuous_usage_stats"] == json!(true);
    let with_usage = |mut v: Value, done: u64| {
        if continuous {
            v["usage"] = usage(prompt, done);
        }
        v
    };
    let mut events: Vec<(Duration, String)> = Vec::new();
    if chat {
        let role = json!({ "choices": [{ "index": 0, "delta": { "role": "assistant", "content": "" } }] });
        events.push((Duration::ZERO, sse(&with_usage(role, 0))));
    }
    let mut done = 0;
    for (i, k) in sizes.iter().enumerate() {
        done += k;
        let delay = if i == 0 { TTFT } else { GAP };
        let chunk = with_usage(json!({ "choices": [choice(&"t".repeat(*k as usize), Value::Null)] }), done);
        events.push((delay, sse(&chunk)));
        if i == 0 && emu.fail_every > 0 && n % emu.fail_every == 0 {
            let err = json!({ "error": { "message": "emulated decode worker failure", "type": "server_error" } });
            events.push((GAP, sse(&err)));
            break;
        }
    }
    if events.last().is_some_and(|(_, e)| !e.contains("\"error\"")) {
        events.push((Duration::ZERO, sse(&with_usage(json!({ "choices": [choice("", json!("length"))] }), done))));
        events.push((Duration::ZERO, sse(&json!({ "choices": [], "usage": usage(prompt, done) }))));
        events.push((Duration::ZERO, "data: [DONE]\n\n".into()));
    }
    let stream = futures::stream::iter(events).then(|(delay, e)| async move {
        tokio::time::sleep(delay).await;
        Ok::<_, Infallible>(e)
    });
    ([(header::CONTENT_TYPE, "text/event-stream")], Body::from_stream(stream)).into_response()
}

/// Starts the emulator; it lives as long as the returned runtime.
fn serve(emu: Emu) -> (tokio::runtime::Runtime, String) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let app = axum::Router::new()
        .route("/v1/models", get(|| async { Json(json!({ "object": "list", "data": [{ "id": "emu-model" }] })) }))
        .route("/v1/completions", post(|s, b| generate(s, b, false)))
        .route("/v1/chat/completions", post(|s, b| generate(s, b, true)))
        .with_state(emu);
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, app).await });
    (rt, url)
}

fn bench(url: &str, extra: &[&str]) -> (Output, Option<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("result.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "--base-url", url, "--disable-progress", "--json", json.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let result = std::fs::read(&json).ok().map(|b| serde_json::from_slice(&b).unwrap());
    (out, result)
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing from {v}"))
}

const SMALL_RUN: [&str; 10] =
    ["--dataset", "fixed", "--input-len", "32", "--output-len", "9", "--num-prompts", "8", "--max-concurrency", "4"];

#[test]
fn streamed_completions_report_exact_tokens_and_the_emulated_latencies() {
    let (_rt, url) = serve(Emu::default());
    let (out, r) = bench(&url, &SMALL_RUN);
    assert!(out.status.success(), "{}", text(&out));
    let r = r.expect("--json written");
    assert_eq!(r["model"], "emu-model", "model from /v1/models");
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(8), Some(0)));
    assert_eq!(r["total_input_tokens"], 8 * 32);
    assert_eq!(r["total_output_tokens"], 8 * 9);
    let ttft = TTFT.as_secs_f64() * 1e3;
    assert!((ttft..ttft + 250.0).contains(&num(&r, "mean_ttft_ms")), "{r}");
    assert!((ttft..ttft + 250.0).contains(&num(&r, "p99_ttft_ms")), "{r}");
    // Each 20 ms chunk carries two tokens: 10 ms per token, not 20.
    let per_token = GAP.as_secs_f64() * 1e3 / TOKENS_PER_CHUNK as f64;
    assert!((per_token..per_token + 8.0).contains(&num(&r, "median_itl_ms")), "{r}");
    assert!(num(&r, "max_itl_ms") >= num(&r, "p99_itl_ms") && num(&r, "p99_itl_ms") >= num(&r, "p95_itl_ms"));
    let e2e = ttft + 4.0 * GAP.as_secs_f64() * 1e3;
    assert!((e2e..e2e + 300.0).contains(&num(&r, "mean_e2e_latency_ms")), "{r}");
    assert!(num(&r, "output_throughput") > 0.0 && num(&r, "concurrency") > 1.0, "{r}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for label in [
        "============ Serving Benchmark Result ============",
        "Backend:                                 openai",
        "Traffic request rate:                    inf",
        "Max request concurrency:                 4",
        "Successful requests:                     8",
        "Benchmark duration (s):",
        "Total input tokens:                      256",
        "Total generated tokens:                  72",
        "Request throughput (req/s):",
        "Input token throughput (tok/s):",
        "Output token throughput (tok/s):",
        "Total token throughput (tok/s):",
        "Concurrency:",
        "----------------End-to-End Latency----------------",
        "Mean E2E Latency (ms):",
        "Median E2E Latency (ms):",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "---------------Inter-Token Latency----------------",
        "Mean ITL (ms):",
        "Median ITL (ms):",
        "P95 ITL (ms):",
        "P99 ITL (ms):",
        "Max ITL (ms):",
    ] {
        assert!(stdout.contains(label), "{label:?} missing from\n{stdout}");
    }
    assert!(!stdout.contains("Failed requests:"), "{stdout}");
}

#[test]
fn chat_without_streaming_measures_end_to_end_only() {
    let (_rt, url) = serve(Emu::default());
    let (out, r) =
        bench(&url, &[&SMALL_RUN[..], &["--endpoint", "chat", "--no-stream", "--model", "emu-model"]].concat());
    assert!(out.status.success(), "{}", text(&out));
    let r = r.unwrap();
    assert_eq!((r["backend"].as_str(), r["stream"].as_bool()), (Some("openai-chat"), Some(false)));
    assert_eq!((r["completed"].as_u64(), r["total_output_tokens"].as_u64()), (Some(8), Some(72)));
    assert_eq!(r["total_input_tokens"], 8 * 32, "the server's count of the 32-word prompts");
    assert_eq!(num(&r, "mean_ttft_ms"), num(&r, "mean_e2e_latency_ms"));
    assert_eq!(num(&r, "max_itl_ms"), 0.0);
    assert!(num(&r, "mean_e2e_latency_ms") >= TTFT.as_secs_f64() * 1e3 + 80.0, "{r}");
}

#[test]
fn failed_requests_are_counted_and_their_errors_shown() {
    let emu = Emu { fail_every: 3, ..Emu::default() };
    let (_rt, url) = serve(emu);
    // Warmup is request 1; of the 9 measured (requests 2..=10), requests 3, 6 and 9 fail mid-stream.
    let run = [&SMALL_RUN[..7], &["9", "--max-concurrency", "1", "--output-details"]].concat();
    let (out, r) = bench(&url, &run);
    assert!(out.status.success(), "some requests succeeded: {}", text(&out));
    let r = r.unwrap();
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(6), Some(3)), "{r}");
    assert_eq!(r["total_output_tokens"], 6 * 9);
    assert_eq!(r["errors"][0]["count"], 3);
    assert_eq!(r["request_errors"].as_array().unwrap().len(), 9);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Failed requests:                         3"), "{stdout}");
    assert!(stdout.contains("error (3x): error event: emulated decode worker failure"), "{stdout}");
}

#[test]
fn every_request_failing_exits_non_zero_with_the_server_error() {
    let (_rt, url) = serve(Emu { refuse: Some(StatusCode::SERVICE_UNAVAILABLE), ..Emu::default() });
    let (out, r) = bench(&url, &[&SMALL_RUN[..], &["--warmup-requests", "0"]].concat());
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains("error: all 8 requests failed; first error: HTTP 503: emulated refusal"), "{all}");
    assert_eq!(r.unwrap()["completed"], 0, "the JSON is still written");
    // With warmup (the default) the run stops before it starts.
    let (out, _) = bench(&url, &SMALL_RUN);
    assert!(!out.status.success());
    assert!(text(&out).contains("warmup failed"), "{}", text(&out));
}

#[test]
fn an_unreachable_server_exits_non_zero_with_a_clear_message() {
    let port = StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let (out, r) = bench(&url, &SMALL_RUN);
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains(&format!("error: cannot reach the server at {url}")), "{all}");
    assert!(r.is_none());
    let (out, _) = bench(&url, &[&SMALL_RUN[..], &["--model", "m", "--warmup-requests", "0"]].concat());
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains(&format!("cannot connect to {url}/v1/completions")), "{all}");
}
