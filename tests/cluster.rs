//! End to end: router + prefill + decode workers as separate processes, real etcd, kv-transfer over UCX
//! (tcp). Output must equal `tandem generate` in one process; failures must stay contained.

mod support;

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use support::cluster::{
    Cluster, MODEL_NAME, Spec, generate_reference, generate_reference_on, model_with_two_mtp_layers, prompt_ids,
};

/// A finished completion as the client saw it.
#[derive(Debug, Default)]
struct Outcome {
    text: String,
    finish_reason: Option<String>,
    usage: Option<Value>,
    /// An error object delivered in the body (after a 200 for streams).
    error: Option<Value>,
    status: u16,
}

async fn complete(base: &str, body: Value) -> Outcome {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let chat = body.get("messages").is_some();
    let url = format!("{base}/v1/{}", if chat { "chat/completions" } else { "completions" });
    let resp = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("request sent");
    let status = resp.status().as_u16();
    let mut o = Outcome { status, ..Default::default() };
    if !stream || status != 200 {
        let v: Value = resp.json().await.expect("json body");
        if let Some(e) = v.get("error") {
            o.error = Some(e.clone());
            return o;
        }
        let c = &v["choices"][0];
        o.text = if chat {
            c["message"]["content"].as_str().unwrap_or_default().to_string()
        } else {
            c["text"].as_str().unwrap_or_default().to_string()
        };
        o.finish_reason = c["finish_reason"].as_str().map(str::to_string);
        o.usage = Some(v["usage"].clone());
        return o;
    }
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    let mut done = false;
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).expect("SSE data is JSON");
            if let Some(e) = v.get("error") {
                o.error = Some(e.clone());
                continue;
            }
            if !v["usage"].is_null() {
                o.usage = Some(v["usage"].clone());
            }
            if let Some(c) = v["choices"].get(0) {
                let piece = if chat { c["delta"]["content"].as_str() } else { c["text"].as_str() };
                o.text.push_str(piece.unwrap_or_default());
                if let Some(f) = c["finish_reason"].as_str() {
                    o.finish_reason = Some(f.to_string());
                }
            }
        }
    }
    if o.error.is_none() {
        assert!(done, "stream ended without [DONE]");
    }
    o
}

fn completion(ids: &[u32], max_tokens: u32, stream: bool) -> Value {
    let mut v = json!({"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": true, "stream": stream});
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

/// A cluster of 2 prefill + 2 decode workers; decode-1 runs without MTP.
async fn two_by_two() -> Option<Cluster> {
    let mut c = Cluster::start()?;
    c.add_worker("prefill", "prefill-0", Spec::default());
    c.add_worker("prefill", "prefill-1", Spec::default());
    c.add_worker("decode", "decode-0", Spec::default());
    c.add_worker("decode", "decode-1", Spec::args(&["--no-mtp"]));
    c.wait_healthy(2, 2).await;
    Some(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cluster_serves_exactly_what_one_process_generates() {
    let Some(c) = two_by_two().await else { return };
    // Several prompts (some beyond index_topk and a block), streamed and not: each must equal the
    // single-process output, whichever pair serves it. Both decode workers (with and without MTP) serve.
    let prompts: Vec<Vec<u32>> =
        [5usize, 40, 70, 130, 9, 200].iter().enumerate().map(|(i, &n)| prompt_ids(n, i as u64)).collect();
    let mut handles = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (base, p) = (c.http.clone(), p.clone());
        handles.push(tokio::spawn(async move { complete(&base, completion(&p, 24, i % 2 == 0)).await }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.await.unwrap();
        let want = generate_reference(&prompts[i], 24, false);
        assert_eq!(got.status, 200, "{got:?}\n{}", c.logs());
        assert_eq!(got.text, want["text"].as_str().unwrap(), "prompt {i}");
        assert_eq!(got.finish_reason.as_deref(), Some("length"));
        assert_eq!(got.usage.as_ref().unwrap()["completion_tokens"], 24);
        assert_eq!(got.usage.as_ref().unwrap()["prompt_tokens"], prompts[i].len());
    }
    // The no-MTP reference is the same text: speculation never changes greedy output.
    assert_eq!(generate_reference(&prompts[1], 24, true)["text"], generate_reference(&prompts[1], 24, false)["text"]);
    let served = |name: &'static str| {
        let c = &c;
        async move { c.worker_metric(name, "tandem_decode_requests_total").await.unwrap_or(0.0) }
    };
    assert!(served("decode-0").await + served("decode-1").await >= 6.0);
    assert!(
        c.worker_metric("decode-0", "tandem_mtp_drafts_total").await.unwrap_or(0.0) > 0.0
            || served("decode-0").await == 0.0
    );
    assert_eq!(c.worker_metric("decode-1", "tandem_mtp_drafts_total").await, Some(0.0), "decode-1 runs without MTP");

    // Chat, streamed and not, through the template.
    let chat = |stream: bool| {
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}],
                                     "max_tokens": 12, "temperature": 0, "stream": stream})
    };
    let a = complete(&c.http, chat(false)).await;
    let b = complete(&c.http, chat(true)).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.text, b.text, "streamed and non-streamed chat agree");
    assert!(a.finish_reason.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_requests_all_complete_correctly() {
    let Some(c) = two_by_two().await else { return };
    let prompts: Vec<Vec<u32>> = (0..64).map(|i| prompt_ids(10 + (i * 7) % 90, 100 + i as u64)).collect();
    let mut handles = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (base, p) = (c.http.clone(), p.clone());
        handles.push(tokio::spawn(async move { complete(&base, completion(&p, 12, i % 3 != 0)).await }));
    }
    let mut outs = Vec::new();
    for h in handles {
        outs.push(h.await.unwrap());
    }
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o.status, 200, "request {i}: {o:?}\n{}", c.logs());
        assert!(o.error.is_none(), "request {i}: {o:?}");
        assert_eq!(o.usage.as_ref().unwrap()["completion_tokens"], 12, "request {i}");
    }
    for i in [0usize, 17, 42, 63] {
        assert_eq!(outs[i].text, generate_reference(&prompts[i], 12, false)["text"].as_str().unwrap(), "request {i}");
    }
    // Nothing leaked: every decode block is back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for d in ["decode-0", "decode-1"] {
        assert_eq!(c.worker_metric(d, "tandem_kv_blocks_free").await, Some(512.0), "{d}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_long_prefix_hits_the_prefix_cache() {
    let Some(mut c) = Cluster::start() else { return };
    c.add_worker("prefill", "prefill-0", Spec::default());
    c.add_worker("decode", "decode-0", Spec::default());
    c.wait_healthy(1, 1).await;
    let a = prompt_ids(300, 7);
    let mut b = a[..256].to_vec();
    b.extend(prompt_ids(40, 8).iter().skip(1));
    let first = complete(&c.http, completion(&a, 4, false)).await;
    assert_eq!(first.usage.unwrap()["prompt_tokens_details"]["cached_tokens"], 0);
    let second = complete(&c.http, completion(&b, 4, false)).await;
    // Blocks 0..2 are reused; block 3 is followed by a different token in b, so its MTP entry is not.
    assert_eq!(second.usage.as_ref().unwrap()["prompt_tokens_details"]["cached_tokens"], 192, "{second:?}");
    assert_eq!(
        second.text,
        generate_reference(&b, 4, false)["text"].as_str().unwrap(),
        "a cache hit computes the same"
    );
    assert!(c.worker_metric("prefill-0", "tandem_prefill_cached_tokens_total").await.unwrap() >= 192.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_a_decode_worker_mid_stream_continues_its_requests_elsewhere_with_the_same_text() {
    let Some(mut c) = Cluster::start() else { return };
    c.add_worker("prefill", "prefill-0", Spec::default());
    c.add_worker("decode", "decode-0", Spec::default());
    c.add_worker("decode", "decode-1", Spec::default());
    c.wait_healthy(1, 2).await;
    const TOKENS: u32 = 1500;
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt_ids(20, 300 + i)).collect();
    let mut handles = Vec::new();
    for p in &prompts {
        let (base, p) = (c.http.clone(), p.clone());
        handles.push(tokio::spawn(async move { complete(&base, completion(&p, TOKENS, true)).await }));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Wait until both workers run streams, note how many decode-0 has, then kill it.
    let mut on_victim = 0.0;
    for _ in 0..100 {
        on_victim = c.worker_metric("decode-0", "tandem_decode_running").await.unwrap_or(0.0);
        let other = c.worker_metric("decode-1", "tandem_decode_running").await.unwrap_or(0.0);
        if on_victim + other == 4.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(on_victim >= 1.0, "the least-KV policy spreads the streams");
    c.kill("decode-0");
    // Every stream finishes: the killed worker's continue on decode-1 from what they generated (prefilled
    // again), and the text is what one process generates.
    for (h, p) in handles.into_iter().zip(&prompts) {
        let o = tokio::time::timeout(Duration::from_secs(120), h).await.expect("the stream finished").unwrap();
        assert_eq!(o.status, 200, "{o:?}");
        assert!(o.error.is_none(), "no error event: {o:?}\n{}", c.logs());
        assert_eq!(o.text, generate_reference(p, TOKENS, false)["text"].as_str().unwrap(), "the same text");
    }
    let lost = c.router_metric("tandem_router_retries_total{reason=\"decode_lost\"}").await.unwrap_or(0.0);
    assert_eq!(lost, on_victim, "each of the killed worker's streams was continued once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_a_prefill_worker_mid_transfer_frees_the_reserved_blocks() {
    let Some(mut c) = Cluster::start() else { return };
    // This prefill worker kills itself after shipping layer 1 (kv-transfer's fault knob).
    let faulty = Spec { env: vec![("TANDEM_KV_FAULT".into(), "kill_after_layer:1".into())], ..Default::default() };
    c.add_worker("prefill", "prefill-faulty", faulty);
    c.add_worker("decode", "decode-0", Spec::default());
    c.wait_healthy(1, 1).await;
    let p = prompt_ids(150, 77);
    let o = complete(&c.http, completion(&p, 8, false)).await;
    // No other prefill worker: the request fails cleanly with an OpenAI-style error.
    assert!(o.status >= 500, "{o:?}");
    assert!(o.error.is_some(), "{o:?}");
    // The decode worker freed the reservation (after the kv-transfer quarantine), visible in its metrics.
    let mut free = 0.0;
    for _ in 0..100 {
        free = c.worker_metric("decode-0", "tandem_kv_blocks_free").await.unwrap_or(0.0);
        if free == 512.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(free, 512.0, "decode blocks freed\n{}", c.logs());
    assert!(c.worker_metric("decode-0", "tandem_decode_requests_total").await.unwrap_or(0.0) >= 1.0);
    // A healthy prefill worker joins through etcd; the next request succeeds.
    c.add_worker("prefill", "prefill-ok", Spec::default());
    c.wait_healthy(1, 1).await;
    let o = complete(&c.http, completion(&p, 8, true)).await;
    assert_eq!(o.status, 200, "{o:?}\n{}", c.logs());
    assert_eq!(o.text, generate_reference(&p, 8, false)["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_official_openai_python_client_works_against_the_cluster() {
    let Ok(python) = std::env::var("TANDEM_PYTHON") else {
        assert!(std::env::var_os("CI").is_none(), "TANDEM_PYTHON must be set under CI (scripts/test.sh sets it)");
        eprintln!("SKIP: TANDEM_PYTHON is not set (scripts/test.sh creates .venv with the openai client)");
        return;
    };
    let Some(mut c) = Cluster::start() else { return };
    c.add_worker("prefill", "prefill-0", Spec::default());
    c.add_worker("decode", "decode-0", Spec::default());
    c.wait_healthy(1, 1).await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_cluster.py");
    let out = tokio::process::Command::new(python)
        .arg(&script)
        .arg(&c.http)
        .arg(MODEL_NAME)
        .output()
        .await
        .expect("python runs");
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_preempted_for_blocks_continues_elsewhere_with_the_same_output() {
    // Exact in FP8: the re-prefill replays the generated tokens in the decode form (engine::generate).
    let Some(mut c) = Cluster::start() else { return };
    c.add_worker("prefill", "prefill-0", Spec::default());
    // 12 blocks: two requests of 100 + 300 tokens each need 7 blocks by their end, so one of them runs
    // out mid-decode and is preempted.
    c.add_worker("decode", "decode-small", Spec::args(&["--kv-blocks", "12"]));
    c.wait_healthy(1, 1).await;
    let prompts = [prompt_ids(100, 4242), prompt_ids(100, 4343)];
    let mut handles = Vec::new();
    for p in &prompts {
        let (base, body) = (c.http.clone(), completion(p, 300, true));
        handles.push(tokio::spawn(async move { complete(&base, body).await }));
    }
    for _ in 0..200 {
        if c.worker_metric("decode-small", "tandem_decode_running").await == Some(2.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A roomier decode worker joins; the preempted request is prefilled again and finishes there.
    c.add_worker("decode", "decode-big", Spec::default());
    for (h, p) in handles.into_iter().zip(&prompts) {
        let o = h.await.unwrap();
        assert_eq!(o.status, 200, "{o:?}");
        assert!(o.error.is_none(), "{o:?}\n{}", c.logs());
        assert_eq!(o.usage.as_ref().unwrap()["completion_tokens"], 300);
        assert_eq!(o.text, generate_reference(p, 300, false)["text"].as_str().unwrap(), "preemption changes nothing");
    }
    let preempted = c.worker_metric("decode-small", "tandem_decode_preemptions_total").await.unwrap_or(0.0);
    assert!(preempted >= 1.0, "no preemption happened\n{}", c.logs());
    assert_eq!(c.worker_metric("decode-small", "tandem_kv_blocks_free").await, Some(12.0), "blocks returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_with_two_mtp_layers_serves_with_its_first() {
    // The pool, manifests and transfers cover the decoder layers and the first MTP layer only, so
    // disaggregated requests complete, equal the single-process output, and draft with MTP.
    let model = model_with_two_mtp_layers();
    let Some(mut c) = Cluster::start_with_model(model) else { return };
    c.add_worker("prefill", "prefill-0", Spec::default());
    c.add_worker("decode", "decode-0", Spec::default());
    c.wait_healthy(1, 1).await;
    let arenas = |name: &'static str| {
        let c = &c;
        async move { c.worker_metric(name, "tandem_cache_arenas_created").await }
    };
    let at_ready = (arenas("prefill-0").await, arenas("decode-0").await);
    assert_eq!(at_ready, (Some(1.0), Some(1.0)), "each worker allocates its pool once");
    let prompts: Vec<Vec<u32>> =
        [9usize, 70, 130].iter().enumerate().map(|(i, &n)| prompt_ids(n, 50 + i as u64)).collect();
    for (i, p) in prompts.iter().enumerate() {
        let got = complete(&c.http, completion(p, 16, i % 2 == 0)).await;
        assert_eq!(got.status, 200, "{got:?}\n{}", c.logs());
        assert!(got.error.is_none(), "{got:?}\n{}", c.logs());
        let want = generate_reference_on(model, p, 16, false);
        assert_eq!(got.text, want["text"].as_str().unwrap(), "prompt {i}");
        assert_eq!(got.usage.as_ref().unwrap()["completion_tokens"], 16);
    }
    assert!(c.worker_metric("decode-0", "tandem_mtp_drafts_total").await.unwrap_or(0.0) > 0.0, "MTP drafts");
    assert_eq!((arenas("prefill-0").await, arenas("decode-0").await), at_ready, "nothing allocated per request");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(c.worker_metric("decode-0", "tandem_kv_blocks_free").await, Some(512.0), "every block is back");
}
