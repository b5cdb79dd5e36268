//! The OpenAI-compatible HTTP API against worker doubles speaking the real gRPC protocol.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use support::harness::{Cluster, MAX_MODEL_LEN, MODEL, Options, REPLY, eventually, sse_events};

const WAIT: Duration = Duration::from_secs(5);

async fn cluster() -> Cluster {
    Cluster::start(Options::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_returns_the_text_usage_and_the_request_id() {
    let c = cluster().await;
    let (s, h, body) = c
        .post_headers_json(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Say hello", "max_tokens": 64}),
            &[("x-request-id", "req-abc")],
        )
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(h["x-request-id"], "req-abc");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["id"], "cmpl-req-abc");
    assert_eq!(body["model"], MODEL);
    assert_eq!(body["choices"][0]["text"], REPLY);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let prompt_tokens = c.tokenizer.encode_prompt("Say hello").unwrap().len() as u64;
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);
    let completion = c.tokenizer.encode(REPLY, false).unwrap().len() as u64 + 1; // + EOS
    assert_eq!(body["usage"]["completion_tokens"], completion);
    assert_eq!(body["usage"]["total_tokens"], prompt_tokens + completion);
    // The id travels to both workers, as the field and as gRPC metadata.
    let p = c.prefill[0].log();
    assert_eq!((p.prefills[0].0.as_str(), p.prefills[0].1.as_str()), ("req-abc", "req-abc"));
    let d = c.decode[0].log();
    assert_eq!((d.decodes[0].0.as_str(), d.decodes[0].1.as_str()), ("req-abc", "req-abc"));
    assert_eq!(p.prefills[0].2[0], 0, "plain prompts start with BOS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_default_to_16_tokens_like_openai() {
    let c = cluster().await;
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "ignore_eos": true})).await;
    assert_eq!(s, 200);
    assert_eq!(body["usage"]["completion_tokens"], 16);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_completion_is_sse_exactly_as_openai_with_usage_last() {
    let c = cluster().await;
    let req = json!({"prompt": "hi", "max_tokens": 50, "stream": true, "stream_options": {"include_usage": true}});
    let (s, h, body) = c.post("/v1/completions", req).await;
    assert_eq!(s, 200);
    assert_eq!(h["content-type"], "text/event-stream");
    let ev = sse_events(&body);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage_chunk["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let body_chunks = &chunks[..chunks.len() - 1];
    let text: String = body_chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, REPLY);
    for ch in body_chunks {
        assert_eq!(ch["object"], "text_completion");
        assert!(ch.get("usage").is_some_and(Value::is_null), "usage: null on every other chunk: {ch}");
    }
    assert_eq!(body_chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    assert!(body_chunks[..body_chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert!(body_chunks.len() > 3, "streamed in pieces, not one blob");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_without_include_usage_has_no_usage_field() {
    let c = cluster().await;
    let (_, _, body) = c.post("/v1/completions", json!({"prompt": "hi", "stream": true})).await;
    let ev = sse_events(&body);
    for e in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("usage").is_none(), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_renders_the_template_and_answers() {
    let c = cluster().await;
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]);
    let (s, body) =
        c.post_json("/v1/chat/completions", json!({"model": MODEL, "messages": msgs, "extra_field": {"x": 1}})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], REPLY);
    let expected = c.tokenizer.encode("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>", false).unwrap();
    assert_eq!(c.prefill[0].log().prefills[0].2, expected, "prompt = template of all messages, no second BOS");
    assert_eq!(body["usage"]["prompt_tokens"], expected.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_opens_with_the_role_and_ends_with_finish_reason_and_done() {
    let c = cluster().await;
    let req = json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true});
    let (s, _, body) = c.post("/v1/chat/completions", req).await;
    assert_eq!(s, 200);
    let ev = sse_events(&body);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, REPLY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_the_openai_shapes() {
    let c = cluster().await;
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "a", "max_tokens": 3, "logprobs": 2})).await;
    assert_eq!(s, 200, "{body}");
    let lp = &body["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(lp["text_offset"][0], 0);
    let top0 = lp["top_logprobs"][0].as_object().unwrap();
    assert!(top0.len() >= 2 && top0.len() <= 3, "chosen + top 2: {top0:?}");
    let joined: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, body["choices"][0]["text"].as_str().unwrap());

    let req =
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": true, "top_logprobs": 2});
    let (s, body) = c.post_json("/v1/chat/completions", req).await;
    assert_eq!(s, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    assert!(content[0]["logprob"].as_f64().unwrap() < 0.0);
    assert!(content[0]["bytes"].is_array());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(c.decode[0].log().decodes[1].3.logprobs, Some(2), "top_logprobs reaches the workers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_across_token_boundaries_is_trimmed_and_ends_the_request() {
    let c = cluster().await;
    // "swer i" starts inside "answer" and ends inside "is": it spans several tokens.
    let ids = c.tokenizer.encode(REPLY, false).unwrap();
    assert!(ids.len() > 6);
    c.decode[0].knobs.token_interval_us.store(20_000, Ordering::Relaxed);
    for stream in [false, true] {
        let req = json!({"prompt": "q", "max_tokens": 100, "stop": ["swer i", "never"], "stream": stream});
        let (s, _, body) = c.post("/v1/completions", req).await;
        assert_eq!(s, 200);
        let (text, finish, stop_reason) = if stream {
            let ev = sse_events(&body);
            let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
            let t: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
            let last = chunks.last().unwrap()["choices"][0].clone();
            (t, last["finish_reason"].clone(), last["stop_reason"].clone())
        } else {
            let v: Value = serde_json::from_str(&body).unwrap();
            let ch = v["choices"][0].clone();
            (ch["text"].as_str().unwrap().to_owned(), ch["finish_reason"].clone(), ch["stop_reason"].clone())
        };
        assert_eq!(text, "Hello world! The an", "stream={stream}");
        assert_eq!(finish, "stop");
        assert_eq!(stop_reason, "swer i");
    }
    // The router ended the requests itself: the decode worker was told to stop instead of finishing.
    let d = &c.decode[0];
    assert!(
        eventually(WAIT, || d.log().aborts.len() == 2 && d.log().cancelled.len() == 2).await,
        "{:?}",
        d.log().aborts
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_stop_str_in_output_keeps_the_stop_string() {
    let c = cluster().await;
    let req = json!({"prompt": "q", "stop": "world", "include_stop_str_in_output": true});
    let (_, body) = c.post_json("/v1/completions", req).await;
    assert_eq!(body["choices"][0]["text"], "Hello world");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_errors_state_the_numbers() {
    let c = cluster().await;
    let prompt_len = c.tokenizer.encode_prompt("hello there").unwrap().len();
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "hello there", "max_tokens": 600})).await;
    assert_eq!(s, 400);
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("maximum context length is {MAX_MODEL_LEN} tokens")), "{msg}");
    assert!(msg.contains(&format!("you requested {} tokens", prompt_len + 600)), "{msg}");
    assert!(msg.contains(&format!("{prompt_len} in the prompt, 600 in the completion")), "{msg}");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["code"], "context_length_exceeded");

    let long: Vec<u32> = vec![10; MAX_MODEL_LEN as usize];
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": long})).await;
    assert_eq!(s, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains(&format!("your prompt has {MAX_MODEL_LEN} tokens")));

    // max_completion_tokens counts the same; chat without a limit gets the rest of the context.
    let (s, _) = c
        .post_json(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9999}),
        )
        .await;
    assert_eq!(s, 400);
    let (s, _) = c.post_json("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 200);
    let sent = c.decode[0].log().decodes.last().unwrap().3.max_tokens as usize;
    assert_eq!(sent + c.prefill[0].log().prefills.last().unwrap().2.len(), MAX_MODEL_LEN as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_we_cannot_honour_get_a_clear_400_and_unknown_fields_are_ignored() {
    let c = cluster().await;
    let cases = [
        (json!({"prompt": "x", "n": 2}), "n"),
        (json!({"prompt": "x", "best_of": 3}), "best_of"),
        (json!({"prompt": "x", "temperature": 7}), "temperature"),
        (json!({"prompt": "x", "logprobs": 99}), "logprobs"),
        (json!({"prompt": "x", "logit_bias": {"999999": 5}}), "logit_bias"),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": [1, 2, 99999]}), "prompt"),
        (json!({"prompt": "x", "stop": 5}), "stop"),
        (json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options"),
        (json!({"max_tokens": 3}), "prompt"),
    ];
    for (req, param) in cases {
        let (s, body) = c.post_json("/v1/completions", req.clone()).await;
        assert_eq!(s, 400, "{req} -> {body}");
        assert_eq!(body["error"]["param"], param, "{req} -> {body}");
        assert!(!body["error"]["message"].as_str().unwrap().is_empty());
    }
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "n": 2})).await;
    assert_eq!(s, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("n must be 1"));
    let (s, body) = c
        .post_json(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        )
        .await;
    assert_eq!(s, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("image_url"), "{body}");
    let (s, body) = c.post_json("/v1/chat/completions", json!({"messages": [{"role": "robot", "content": "x"}]})).await;
    assert_eq!(s, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("Unknown message role: robot"), "{body}");
    // Not JSON at all, and a wrong type.
    let r = c.http.post(c.url("/v1/completions")).body("{nope").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().starts_with("Invalid JSON body"));
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": "ten"})).await;
    assert_eq!(s, 400, "{body}");
    // Unknown fields, vendor extensions and explicit nulls are accepted.
    let req = json!({"prompt": "x", "max_tokens": 2, "user": "u", "frobnicate": true, "top_k": -1, "min_p": 0.1,
                     "seed": 7, "presence_penalty": 0.5, "logit_bias": {"5": 1.0}, "stop": null, "temperature": null,
                     "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [3], "best_of": 1, "n": 1});
    let (s, body) = c.post_json("/v1/completions", req).await;
    assert_eq!(s, 200, "{body}");
    let sent = c.decode[0].log().decodes.last().unwrap().3.clone();
    assert_eq!((sent.seed, sent.min_tokens, sent.stop_token_ids.clone()), (Some(7), 1, vec![3]));
    assert_eq!(sent.logit_bias.get(&5), Some(&1.0));
    assert!((sent.min_p - 0.1).abs() < 1e-6 && sent.top_k == 0 && (sent.temperature - 1.0).abs() < 1e-6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_path_and_method_get_json_errors() {
    let c = cluster().await;
    let (s, body) = c.post_json("/v1/completions", json!({"model": "gpt-5", "prompt": "x"})).await;
    assert_eq!(s, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    let r = c.http.get(c.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    let r = c.http.get(c.url("/v1/completions")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413_json() {
    let c =
        Cluster::start(Options { args: vec!["--max-body-bytes".into(), "1000".into()], ..Default::default() }).await;
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x".repeat(5000)})).await;
    assert_eq!(s, 413);
    assert!(body["error"]["message"].as_str().unwrap().contains("1000 bytes"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_v1_but_not_health() {
    let c = Cluster::start(Options { args: vec!["--api-key".into(), "sekret".into()], ..Default::default() }).await;
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 401);
    assert_eq!(body["error"]["code"], "invalid_api_key");
    let r =
        c.http.post(c.url("/v1/completions")).bearer_auth("wrong").json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r =
        c.http.post(c.url("/v1/completions")).bearer_auth("sekret").json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.http.get(c.url("/v1/models")).send().await.unwrap().status(), 401);
    assert_eq!(c.http.get(c.url("/health")).send().await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_a_file_any_case_bearer_and_a_per_key_rate_limit() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# two teams\nalpha:key-alpha\nbeta:key-beta\n").unwrap();
    let args = ["--api-keys-file", keys.to_str().unwrap(), "--api-key-rate-limit", "2"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    let send = |auth: &'static str| {
        c.http.post(c.url("/v1/completions")).header("authorization", auth).json(&json!({"prompt": "x"})).send()
    };
    assert_eq!(send("bearer key-alpha").await.unwrap().status(), 200, "the scheme in lower case");
    assert_eq!(send("BEARER key-alpha").await.unwrap().status(), 200);
    // alpha's two requests a minute are used; beta has its own.
    let over = send("Bearer key-alpha").await.unwrap();
    assert_eq!(over.status(), 429);
    let retry: u64 = over.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "Retry-After {retry}");
    let body: serde_json::Value = over.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("alpha") && !msg.contains("key-alpha"), "the key's name, never the key: {msg}");
    assert_eq!(send("Bearer key-beta").await.unwrap().status(), 200);
    assert_eq!(send("Bearer key-gamma").await.unwrap().status(), 401);
    assert_eq!(send("Basic key-beta").await.unwrap().status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after() {
    let args = ["--max-running-requests", "1", "--max-queued-requests", "0"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, ..Default::default() }).await;
    c.decode[0].knobs.token_interval_us.store(50_000, Ordering::Relaxed);
    let slow = {
        let http = c.http.clone();
        let url = c.url("/v1/completions");
        tokio::spawn(async move {
            http.post(url).json(&json!({"prompt": "x", "max_tokens": 10})).send().await.unwrap().status()
        })
    };
    // Wait until the slow request holds the only running slot.
    let mut held = false;
    for _ in 0..250 {
        let m = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
        if m.contains("tandem_router_running_requests 1") {
            held = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held, "the slow request never started");
    let (s, h, body) = c.post("/v1/completions", json!({"prompt": "y"})).await;
    assert_eq!(s, 429, "{body}");
    assert_eq!(h["retry-after"], "1");
    assert!(body.contains("at capacity"));
    assert_eq!(slow.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_workers_out_of_blocks_mean_429_not_500() {
    // No waiting for room (--queue-timeout-secs 0): the 429 comes at once.
    let args = ["--queue-timeout-secs", "0"].map(String::from).to_vec();
    let c = Cluster::start(Options { decode: 2, args, ..Default::default() }).await;
    c.wait_all_healthy(Duration::from_secs(10)).await;
    for d in &c.decode {
        d.knobs.decode_full.store(true, Ordering::Relaxed);
    }
    let (s, h, body) = c.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 429, "{body}");
    assert!(h.contains_key("retry-after"));
    assert!(body.contains("no free KV blocks"), "{body}");
    assert_eq!(c.decode[0].log().decodes.len() + c.decode[1].log().decodes.len(), 2, "both tried once");
    c.decode[1].knobs.decode_full.store(false, Ordering::Relaxed);
    let (s, _) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 200, "the other decode worker takes it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_failure_before_the_first_token_is_retried_on_another_prefill_worker() {
    let c = Cluster::start(Options {
        prefill: 2,
        args: vec!["--prefill-policy".into(), "round-robin".into()],
        ..Default::default()
    })
    .await;
    // The retry needs p1 counted healthy (`/ready` waits for one pair only; a loaded machine probes late).
    c.wait_all_healthy(Duration::from_secs(10)).await;
    // p0 fails every prefill (but stays reachable, so only the breaker can learn it).
    c.prefill[0].knobs.prefill_failures.store(1000, Ordering::Relaxed);
    for _ in 0..4 {
        let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 50})).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["choices"][0]["text"], REPLY);
    }
    let (p0, p1) = (c.prefill[0].log().prefills.len(), c.prefill[1].log().prefills.len());
    assert!(p0 >= 1, "round-robin sent something to p0");
    assert_eq!(p1, 4, "every request was served by p1");
    assert_eq!(c.decode[0].log().decodes.len(), 4 + p0, "a fresh reservation for each retry");
    let released = eventually(WAIT, || c.decode[0].log().aborts.len() == p0).await;
    assert!(released, "each failed attempt's reservation was released: {:?}", c.decode[0].log().aborts);
    let metrics = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(&format!("tandem_router_retries_total{{reason=\"prefill_failed\"}} {p0}")), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_failure_reported_by_decode_before_the_first_token_is_retried_on_another_prefill_worker() {
    // A prefill worker that dies or stalls mid-transfer: the decode worker reports the failed transfer before
    // the Prefill call fails. Nothing was generated yet, so the request goes to another prefill worker.
    let c = Cluster::start(Options {
        prefill: 2,
        args: vec!["--prefill-policy".into(), "round-robin".into()],
        ..Default::default()
    })
    .await;
    // The retry needs p1 counted healthy (`/ready` waits for one pair only; a loaded machine probes late).
    c.wait_all_healthy(Duration::from_secs(10)).await;
    c.prefill[0].knobs.transfer_failures.store(1000, Ordering::Relaxed);
    for _ in 0..4 {
        let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 50})).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["choices"][0]["text"], REPLY);
    }
    let (p0, p1) = (c.prefill[0].log().prefills.len(), c.prefill[1].log().prefills.len());
    assert!(p0 >= 1, "round-robin sent something to p0");
    assert_eq!(p1, 4, "every request was served by p1");
    let metrics = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(&format!("tandem_router_retries_total{{reason=\"prefill_failed\"}} {p0}")), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_bounded_and_the_error_names_the_failure() {
    let c = Cluster::start(Options { args: vec!["--max-retries".into(), "1".into()], ..Default::default() }).await;
    c.prefill[0].knobs.prefill_failures.store(100, Ordering::Relaxed);
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert!(s == 502 || s == 503, "{s} {body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("injected prefill failure"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_during_prefill_aborts_on_both_workers() {
    let c = cluster().await;
    c.prefill[0].knobs.prefill_delay_ms.store(800, Ordering::Relaxed);
    let req = c
        .http
        .post(c.url("/v1/completions"))
        .header("x-request-id", "gone-1")
        .json(&json!({"prompt": "x", "stream": true}));
    let _ = tokio::time::timeout(Duration::from_millis(300), req.send()).await;
    let gone = "gone-1".to_owned();
    assert!(eventually(WAIT, || c.prefill[0].log().aborts.contains(&gone)).await, "prefill abort");
    assert!(eventually(WAIT, || c.decode[0].log().aborts.contains(&gone)).await, "decode abort");
    assert!(eventually(WAIT, || c.decode[0].log().cancelled.contains(&gone)).await, "decode stream cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_stops_the_decode_worker() {
    let c = cluster().await;
    c.decode[0].knobs.token_interval_us.store(30_000, Ordering::Relaxed);
    let req = json!({"prompt": "x", "stream": true, "ignore_eos": true, "max_tokens": 200});
    let mut resp =
        c.http.post(c.url("/v1/completions")).header("x-request-id", "gone-2").json(&req).send().await.unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(resp);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let d = c.decode[0].log();
    assert!(
        d.aborts.contains(&"gone-2".to_owned()) && d.cancelled.contains(&"gone-2".to_owned()),
        "{:?} {:?}",
        d.aborts,
        d.cancelled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_re_prefills_prompt_plus_output_and_the_text_continues() {
    let c = cluster().await;
    c.decode[0].knobs.preempt_after.store(3, Ordering::Relaxed);
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 50})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], REPLY, "same output as without preemption");
    let prompt_len = c.tokenizer.encode_prompt("x").unwrap().len();
    let prefills = c.prefill[0].log().prefills.clone();
    assert_eq!(prefills.len(), 2);
    assert_eq!(prefills[1].2.len(), prompt_len + 3, "prompt + the 3 tokens generated before preemption");
    let reply = c.tokenizer.encode(REPLY, false).unwrap();
    assert_eq!(prefills[1].2[prompt_len..], reply[..3]);
    let decodes = c.decode[0].log().decodes.clone();
    assert_eq!(decodes[1].2.len(), prompt_len + 3);
    // No seed was given: the router chose one, and every worker call of the request used it.
    let seed = prefills[0].3.seed;
    assert!(seed.is_some());
    assert!(prefills.iter().map(|p| p.3.seed).chain(decodes.iter().map(|d| d.3.seed)).all(|s| s == seed));
    let (s, _) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(s, 200);
    assert_ne!(c.prefill[0].log().prefills[2].3.seed, seed, "a new request gets a new seed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_token_events_and_one_token_requests_work() {
    let c = cluster().await;
    c.decode[0].knobs.tokens_per_event.store(3, Ordering::Relaxed);
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 50})).await;
    assert_eq!((s, body["choices"][0]["text"].as_str()), (200, Some(REPLY)));
    // max_tokens = 1 ends in prefill: the router emits the prefill worker's token itself.
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, 200);
    let first = c.tokenizer.decode(&c.tokenizer.encode(REPLY, false).unwrap()[..1], true).unwrap();
    assert_eq!(body["choices"][0]["text"], first.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(c.prefill[0].log().prefills.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_with_different_fingerprints_are_never_paired() {
    let c = Cluster::start(Options { decode_hashes: vec!["other"], wait_ready: false, ..Default::default() }).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 503, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("same model fingerprint"), "{body}");
    assert!(c.prefill[0].log().prefills.is_empty());
    let r = c.http.get(c.url("/ready")).send().await.unwrap();
    assert_eq!(r.status(), 503);

    let c = Cluster::start(Options { decode: 2, decode_hashes: vec!["other", "h1"], ..Default::default() }).await;
    for _ in 0..4 {
        let (s, _) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
        assert_eq!(s, 200);
    }
    assert!(c.decode[0].log().decodes.is_empty(), "the mismatched decode worker got nothing");
    assert_eq!(c.decode[1].log().decodes.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_worker_is_skipped() {
    let mut c = Cluster::start(Options {
        prefill: 2,
        args: vec!["--prefill-policy".into(), "round-robin".into()],
        ..Default::default()
    })
    .await;
    c.wait_all_healthy(Duration::from_secs(10)).await;
    c.prefill[0].kill();
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..6 {
        let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
        assert_eq!(s, 200, "{body}");
    }
    assert_eq!(c.prefill[1].log().prefills.len(), 6);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let metrics = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(&format!(
            "tandem_router_worker_healthy{{role=\"prefill\",worker=\"{}\"}} 0",
            c.prefill[0].grpc_address()
        )),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_routing_sends_a_shared_prefix_to_the_same_worker() {
    let c = Cluster::start(Options { prefill: 3, ..Default::default() }).await;
    let long: Vec<u32> = (0..200).map(|i| 10 + i % 300).collect();
    let mut first = None;
    for k in 0..4 {
        let mut p = long.clone();
        p.push(500 + k);
        let (s, _) = c.post_json("/v1/completions", json!({"prompt": p, "max_tokens": 2})).await;
        assert_eq!(s, 200);
        let who: Vec<usize> = c.prefill.iter().map(|d| d.log().prefills.len()).collect();
        let idx = who.iter().position(|&n| n > 0).unwrap();
        first.get_or_insert(idx);
        assert_eq!(who.iter().sum::<usize>(), (k + 1) as usize);
        assert_eq!(who[*first.as_ref().unwrap()], (k + 1) as usize, "all on one worker: {who:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_endpoints_answer() {
    let c = cluster().await;
    let m: Value = c.http.get(c.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(c.http.get(c.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(c.http.get(c.url("/ready")).send().await.unwrap().status(), 200);
    let (s, _) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 200);
    let metrics = c.http.get(c.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for name in [
        "tandem_router_requests_total{endpoint=\"completions\",status=\"200\"} 1",
        "tandem_router_time_to_first_token_seconds_bucket",
        "tandem_router_inter_token_latency_seconds_bucket",
        "tandem_router_e2e_request_latency_seconds_count{endpoint=\"completions\"} 1",
        "tandem_router_queue_depth 0",
        "tandem_router_stage_seconds_count{stage=\"kv_transfer\"} 1",
        "tandem_router_worker_load{metric=\"kv_blocks_total\",role=\"decode\"",
    ] {
        assert!(metrics.contains(name), "missing {name} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_failure_after_the_200_ends_the_stream_with_an_error_event() {
    let c = cluster().await;
    c.decode[0].knobs.fail_after.store(3, Ordering::Relaxed);
    let (s, _, body) = c.post("/v1/completions", json!({"prompt": "x", "stream": true, "max_tokens": 50})).await;
    assert_eq!(s, 200);
    let ev = sse_events(&body);
    assert_ne!(ev.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    let msg = last["error"]["message"].as_str().unwrap();
    assert!(msg.contains("decode worker") && msg.contains("crashed"), "{msg}");
    assert!(ev.len() > 2, "tokens were streamed before the failure");
    // Not streamed: the same failure is a 502 with the message.
    let (s, body) = c.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 50})).await;
    assert_eq!(s, 502, "{body}");
    c.decode[0].knobs.fail_after.store(0, Ordering::Relaxed);
    let (s, _) = c.post_json("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 200, "the next request succeeds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_timeout_gets_504_and_is_aborted() {
    let c = Cluster::start(Options { args: vec!["--request-timeout-secs".into(), "0.3".into()], ..Default::default() })
        .await;
    c.prefill[0].knobs.prefill_delay_ms.store(2000, Ordering::Relaxed);
    let (s, _, body) =
        c.post_headers_json("/v1/completions", json!({"prompt": "x"}), &[("x-request-id", "slow-1")]).await;
    assert_eq!(s, 504, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("timed out"));
    let id = "slow-1".to_owned();
    assert!(eventually(WAIT, || c.prefill[0].log().aborts.contains(&id)).await);
    assert!(eventually(WAIT, || c.decode[0].log().aborts.contains(&id)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_break_the_worker_connection_for_others() {
    // A stalled SSE reader backs up its token frames inside the router's HTTP/2 connection to the
    // decode worker. h2 budgets unread small DATA frames (half the connection window) and past that
    // closes the whole connection, failing everyone's requests; the router's large window prevents it.
    let args = ["--max-model-len", "100000", "--prefill-timeout-secs", "5"].map(String::from).to_vec();
    let c = Cluster::start(Options { args, worker_max_model_len: Some(100_000), ..Default::default() }).await;
    let req = json!({"prompt": "x", "max_tokens": 40000, "ignore_eos": true, "stream": true});
    let mut stalled = c.http.post(c.url("/v1/completions")).json(&req).send().await.unwrap();
    assert_eq!(stalled.status(), 200);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for _ in 0..5 {
        let (s, body) = c.post_json("/v1/completions", json!({"prompt": "y", "max_tokens": 8})).await;
        assert_eq!(s, 200, "{body}");
    }
    let mut body = Vec::new();
    while let Some(chunk) = stalled.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(body).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "stream ended badly: {}", &text[text.len().saturating_sub(300)..]);
    assert!(!text.contains("\"error\""));
}
