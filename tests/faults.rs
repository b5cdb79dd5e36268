//! The fault matrix (issue 24): SIGKILL and SIGSTOP of the prefill worker, the decode worker and etcd, a
//! graceful router restart and a router crash, each at every stage of a request: queued, prefilling,
//! transferring, decoding. Every cell runs on a fresh cluster of separate processes (router, one prefill
//! and one decode worker, real etcd, kv-transfer over UCX tcp) and checks that:
//! - each client in flight gets an answer within the configured timeouts: the completion (unaffected, or
//!   retried transparently), a clean OpenAI-style error (a status with an error object, or an error event
//!   on a started stream), or, only when the router itself goes away, a closed connection; never a hang;
//! - the survivors return to idle, read from their `/metrics`: every decode block free and none
//!   quarantined, no decode request running or waiting for caches, no prefill running or queued, no
//!   request running or queued in the router and nothing in flight on any worker;
//! - the next requests all succeed (`TANDEM_FAULT_FOLLOWUPS` of them, default 100, four at a time).
//!
//! How a request is held at a stage (test builds only, through the `fault-injection` features):
//! - queued: the prefill worker runs `--max-num-seqs 1` and stalls its first batch
//!   (`TANDEM_PREFILL_FAULT=stall_first_batch`); a second request waits in its queue;
//! - prefilling: the same stall holds the first request in its batch;
//! - transferring: the prefill worker's kv-transfer shipper stalls once after layer 1 landed
//!   (`TANDEM_KV_FAULT=stall_once_after_layer`);
//! - decoding: a long stream, faulted once tokens flow.
//!
//! A SIGSTOP lasts longer than `--prefill-timeout-secs` and the workers' etcd lease, so the router's
//! timeouts are what end the wait. Some outcomes are asserted exactly: etcd faults, a graceful router
//! restart and prefill faults once decoding started leave the request complete; a prefill fault before the
//! first token is retried (and, with no other prefill worker, answered 503). Every cell prints one
//! `fault-matrix:` line (cell, outcomes, when answered, when idle and serving again); RELIABILITY.md has the
//! table. The eight rows run two at a time (cargo's test threads), about 2.5 minutes on 2 cores.

mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use support::cluster::{Cluster, MODEL_NAME, Spec, prompt_ids};

/// How long a knob holds a request at its stage.
const HOLD_MS: u64 = 3000;
/// Router limits of the matrix's clusters: a stall outlives HOLD_MS, a SIGSTOP outlives the prefill timeout.
const PREFILL_TIMEOUT_S: u64 = 5;
const REQUEST_TIMEOUT_S: u64 = 25;
const STOP: Duration = Duration::from_secs(7);
/// A client that has no answer this long after the fault is a hang.
const ANSWER_WITHIN: Duration = Duration::from_secs(REQUEST_TIMEOUT_S + 10);
/// Tokens of the decoding stage's stream: long enough to still run when the fault comes.
const LONG: u32 = 600;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Prefill,
    Decode,
    Etcd,
    Router,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Stop,
    /// SIGTERM (graceful), then a new router on the same ports: a rolling restart.
    Restart,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Queued,
    Prefilling,
    Transferring,
    Decoding,
}

const STAGES: [Stage; 4] = [Stage::Queued, Stage::Prefilling, Stage::Transferring, Stage::Decoding];

/// What one client saw.
#[derive(Debug, Clone)]
enum Answer {
    /// The whole completion (`[DONE]`, every token).
    Completed,
    /// An error status with an OpenAI-style error object.
    Status(u16, String),
    /// A started stream that ended with an error event.
    StreamError(String),
    /// The connection closed without an answer (only acceptable when the router itself went away).
    Closed(String),
}

impl Answer {
    fn short(&self) -> String {
        match self {
            Answer::Completed => "completed".into(),
            Answer::Status(s, m) => format!("{s} ({})", brief(m)),
            Answer::StreamError(m) => format!("error event ({})", brief(m)),
            Answer::Closed(m) => format!("connection closed ({})", brief(m)),
        }
    }
}

fn brief(m: &str) -> String {
    m.chars().take(90).collect()
}

fn body(ids: &[u32], max_tokens: u32, stream: bool) -> Value {
    let mut v = json!({"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": true, "stream": stream});
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

/// One completion, read to its end; `Closed` when the transport fails.
async fn ask(base: &str, ids: Vec<u32>, max_tokens: u32, stream: bool) -> Answer {
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&body(&ids, max_tokens, stream))
        .timeout(ANSWER_WITHIN * 2)
        .send()
        .await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => return Answer::Closed(e.to_string()),
    };
    let status = resp.status().as_u16();
    if status != 200 || !stream {
        let v: Value = match resp.json().await {
            Ok(v) => v,
            Err(e) => return Answer::Closed(format!("status {status}, body unreadable: {e}")),
        };
        if let Some(e) = v.get("error") {
            let message = e["message"].as_str().unwrap_or_default().to_string();
            assert!(status >= 400 && message.len() > 10, "an error needs a status and a useful message: {v}");
            return Answer::Status(status, message);
        }
        assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
        return Answer::Completed;
    }
    let mut bytes = resp.bytes_stream();
    let (mut buf, mut chunks, mut tokens) = (String::new(), 0u32, None);
    while let Some(chunk) = bytes.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return Answer::Closed(format!("after {chunks} chunks: {e}")),
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                assert_eq!(tokens, Some(max_tokens as u64), "a finished stream carries every token");
                return Answer::Completed;
            }
            let v: Value = serde_json::from_str(data).expect("SSE data is JSON");
            if let Some(e) = v.get("error") {
                let message = e["message"].as_str().unwrap_or_default().to_string();
                assert!(message.len() > 10, "a useful message: {v}");
                return Answer::StreamError(message);
            }
            chunks += 1;
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n);
            }
        }
    }
    Answer::Closed(format!("stream ended after {chunks} chunks without [DONE] or an error event"))
}

/// Sums `metric` over the label sets whose line contains every one of `filters`, in a Prometheus text page.
fn metric_sum(page: &str, metric: &str, filters: &[&str]) -> Option<f64> {
    let vals: Vec<f64> = page
        .lines()
        .filter(|l| {
            l.starts_with(metric)
                && matches!(l.as_bytes().get(metric.len()), Some(b' ' | b'{'))
                && filters.iter().all(|f| l.contains(f))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!vals.is_empty()).then(|| vals.iter().sum())
}

fn sig(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a process this test started.
    unsafe { libc::kill(pid as i32, signal) };
}

/// Polls `f` every 50 ms until it holds or `limit` passes.
async fn until(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

async fn start(stage: Stage) -> Option<Cluster> {
    let router = [
        "--prefill-timeout-secs",
        &PREFILL_TIMEOUT_S.to_string(),
        "--request-timeout-secs",
        &REQUEST_TIMEOUT_S.to_string(),
        "--breaker-open-secs",
        "1",
    ]
    .map(str::to_string);
    let mut c = Cluster::start_with_router_args(support::cluster::model(), &router)?;
    let mut prefill = Spec::args(&["--max-num-seqs", "1"]);
    match stage {
        Stage::Queued | Stage::Prefilling => {
            prefill.env.push(("TANDEM_PREFILL_FAULT".into(), format!("stall_first_batch:{HOLD_MS}ms")));
        }
        Stage::Transferring => {
            prefill.env.push(("TANDEM_KV_FAULT".into(), format!("stall_once_after_layer:1:{HOLD_MS}ms")));
        }
        Stage::Decoding => {}
    }
    c.add_worker("prefill", "prefill-0", prefill);
    c.add_worker("decode", "decode-0", Spec::default());
    c.wait_healthy(1, 1).await;
    Some(c)
}

/// Sends the cell's requests and waits until they are held at `stage`.
async fn hold(c: &Cluster, stage: Stage, salt: u64) -> Vec<tokio::task::JoinHandle<(Answer, Instant)>> {
    let send = |n: u64, max_tokens: u32| {
        let base = c.http.clone();
        tokio::spawn(async move { (ask(&base, prompt_ids(40, salt + n), max_tokens, true).await, Instant::now()) })
    };
    let stalled = |needle: &'static str| async move { c.proc("prefill-0").log().contains(needle) };
    let mut clients = vec![send(0, if stage == Stage::Decoding { LONG } else { 8 })];
    let held = match stage {
        Stage::Queued | Stage::Prefilling => {
            let ok = until(Duration::from_secs(20), async || stalled("stalling the first batch").await).await;
            if stage == Stage::Queued {
                // The second request reaches the worker, whose compute thread is busy with the first: it
                // waits in the loop's queue (the router counts both in flight there).
                clients.push(send(1, 8));
                let queued = async || {
                    let page = support::cluster::get_text(&format!("{}/metrics", c.http)).await.unwrap_or_default();
                    let f = ["metric=\"router_in_flight\"", "worker=\"prefill-0\""];
                    metric_sum(&page, "tandem_router_worker_load", &f) == Some(2.0)
                };
                ok && until(Duration::from_secs(2), queued).await
            } else {
                ok
            }
        }
        Stage::Transferring => {
            let held = async || {
                stalled("fault injection: stalling").await
                    && c.worker_metric("decode-0", "tandem_decode_transferring").await == Some(1.0)
            };
            until(Duration::from_secs(20), held).await
        }
        Stage::Decoding => {
            let flowing = async || {
                c.worker_metric("decode-0", "tandem_decode_running").await == Some(1.0)
                    && c.worker_metric("decode-0", "tandem_decode_tokens_total").await.unwrap_or(0.0) >= 5.0
            };
            until(Duration::from_secs(20), flowing).await
        }
    };
    assert!(held, "the request was never held at {stage:?}\n{}", c.logs());
    clients
}

/// Applies the fault; returns the processes that are gone for good (their replacements are started).
async fn strike(c: &mut Cluster, target: Target, fault: Fault) -> Vec<&'static str> {
    match (target, fault) {
        (Target::Prefill | Target::Decode, Fault::Kill) => {
            let (victim, role, spare) = match target {
                Target::Prefill => ("prefill-0", "prefill", "prefill-1"),
                _ => ("decode-0", "decode", "decode-1"),
            };
            c.kill(victim);
            c.add_worker(role, spare, Spec::default());
            vec![victim]
        }
        (Target::Prefill | Target::Decode, Fault::Stop) => {
            let victim = if target == Target::Prefill { "prefill-0" } else { "decode-0" };
            let pid = c.proc(victim).child.id();
            sig(pid, libc::SIGSTOP);
            tokio::time::sleep(STOP).await;
            sig(pid, libc::SIGCONT);
            vec![]
        }
        (Target::Etcd, Fault::Kill) => {
            c.etcd.kill();
            tokio::time::sleep(Duration::from_secs(2)).await;
            c.etcd.restart(false);
            vec![]
        }
        (Target::Etcd, Fault::Stop) => {
            let pid = c.etcd.pid().expect("etcd runs");
            sig(pid, libc::SIGSTOP);
            tokio::time::sleep(STOP).await;
            sig(pid, libc::SIGCONT);
            vec![]
        }
        (Target::Router, Fault::Restart) => {
            c.restart_router(true);
            vec![]
        }
        (Target::Router, Fault::Kill) => {
            c.restart_router(false);
            vec![]
        }
        other => panic!("no such cell: {other:?}"),
    }
}

/// Whether every survivor is idle; else what is not.
async fn busy(c: &Cluster, gone: &[&str]) -> Option<String> {
    let mut busy = Vec::new();
    for p in c.procs.iter().filter(|p| p.name != "router" && !gone.contains(&p.name.as_str())) {
        let checks: &[(&str, f64)] = if p.name.starts_with("decode") {
            &[
                ("tandem_kv_blocks_free", 512.0),
                ("tandem_kv_blocks_quarantined", 0.0),
                ("tandem_decode_running", 0.0),
                ("tandem_decode_transferring", 0.0),
            ]
        } else {
            &[("tandem_prefill_running", 0.0), ("tandem_prefill_queued", 0.0)]
        };
        for &(m, want) in checks {
            let got = c.worker_metric(&p.name, m).await;
            if got != Some(want) {
                busy.push(format!("{} {m} = {got:?}", p.name));
            }
        }
    }
    let page = support::cluster::get_text(&format!("{}/metrics", c.http)).await.unwrap_or_default();
    for m in ["tandem_router_running_requests", "tandem_router_queue_depth"] {
        let got = metric_sum(&page, m, &[]);
        if got != Some(0.0) {
            busy.push(format!("router {m} = {got:?}"));
        }
    }
    // In flight on each worker the router still polls (a dead worker's gauge keeps its last value).
    for p in c.procs.iter().filter(|p| p.name != "router" && !gone.contains(&p.name.as_str())) {
        let f = ["metric=\"router_in_flight\"", &format!("worker=\"{}\"", p.name)];
        let got = metric_sum(&page, "tandem_router_worker_load", &f);
        if got.is_some_and(|v| v != 0.0) {
            busy.push(format!("router in flight on {} = {got:?}", p.name));
        }
    }
    (!busy.is_empty()).then(|| busy.join(", "))
}

/// `/ready`, and no survivor's circuit breaker open.
async fn serving(c: &Cluster, gone: &[&str]) -> bool {
    let page = support::cluster::get_text(&format!("{}/metrics", c.http)).await.unwrap_or_default();
    let ready = reqwest::get(format!("{}/ready", c.http)).await.is_ok_and(|r| r.status() == 200);
    let open = c.procs.iter().filter(|p| p.name != "router" && !gone.contains(&p.name.as_str())).any(|p| {
        let f = format!("worker=\"{}\"", p.name);
        metric_sum(&page, "tandem_router_worker_circuit_open", &[&f]).unwrap_or(0.0) != 0.0
    });
    ready && !open
}

async fn follow_ups(c: &Cluster, salt: u64) -> usize {
    let n: usize = std::env::var("TANDEM_FAULT_FOLLOWUPS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut ok = 0;
    for batch in (0..n).collect::<Vec<_>>().chunks(4) {
        let answers = futures::future::join_all(
            batch.iter().map(|&i| ask(&c.http, prompt_ids(10 + i % 50, salt + 1000 + i as u64), 4, i % 2 == 0)),
        )
        .await;
        for (a, i) in answers.into_iter().zip(batch) {
            assert!(matches!(a, Answer::Completed), "follow-up request {i} of {n}: {a:?}\n{}", c.logs());
            ok += 1;
        }
    }
    ok
}

async fn cell(target: Target, fault: Fault, stage: Stage, salt: u64) {
    let began = Instant::now();
    let Some(mut c) = start(stage).await else { return };
    let clients = hold(&c, stage, salt).await;
    let struck = Instant::now();
    let gone = strike(&mut c, target, fault).await;
    let (mut answers, mut answered) = (Vec::new(), Duration::ZERO);
    for h in clients {
        let left = ANSWER_WITHIN.saturating_sub(struck.elapsed());
        let (a, at) = tokio::time::timeout(left, h)
            .await
            .unwrap_or_else(|_| panic!("{target:?} {fault:?} at {stage:?}: a client hangs\n{}", c.logs()))
            .expect("client task");
        answered = answered.max(at.saturating_duration_since(struck));
        if let Answer::Closed(why) = &a {
            assert_eq!(target, Target::Router, "{target:?} {fault:?} at {stage:?}: {why}\n{}", c.logs());
        }
        // etcd is not on a request's path; a graceful restart lets in-flight requests finish; a prefill
        // fault cannot touch a request already decoding; a killed decode worker's requests continue on the
        // replacement decode worker the test starts (the router treats the broken stream as a lost worker).
        let unaffected = target == Target::Etcd
            || fault == Fault::Restart
            || (target == Target::Prefill && stage == Stage::Decoding)
            || (target == Target::Decode && fault == Fault::Kill);
        // A prefill fault before the first token is retried on another prefill worker; the cluster has none,
        // so the answer is the retry's 503 (the decode worker's failed transfer must not end it as a 502).
        if target == Target::Prefill && stage != Stage::Decoding {
            assert!(matches!(a, Answer::Status(503, _)), "{target:?} {fault:?} at {stage:?}: {a:?}\n{}", c.logs());
        }
        if unaffected {
            let logs = format!("{}{}", c.old_router_logs(), c.logs());
            assert!(matches!(a, Answer::Completed), "{target:?} {fault:?} at {stage:?}: {a:?}\n{logs}");
        }
        answers.push(a);
    }
    let mut last = None;
    let idle = until(Duration::from_secs(30), async || {
        last = busy(&c, &gone).await;
        last.is_none()
    })
    .await;
    assert!(idle, "{target:?} {fault:?} at {stage:?}: not idle: {last:?}\n{}", c.logs());
    let healthy = until(Duration::from_secs(30), async || serving(&c, &gone).await).await;
    assert!(healthy, "{target:?} {fault:?} at {stage:?}: not serving again\n{}", c.logs());
    c.wait_healthy(1, 1).await;
    let recovered = struck.elapsed();
    let n = follow_ups(&c, salt).await;
    let outcomes: Vec<String> = answers.iter().map(Answer::short).collect();
    println!(
        "fault-matrix: {target:?} {fault:?} | {stage:?} | {} | answered {:.1}s, idle and serving {:.1}s after the fault | {n} next requests ok | cell {:.0}s",
        outcomes.join("; "),
        answered.as_secs_f64(),
        recovered.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
}

async fn row(target: Target, fault: Fault, salt: u64) {
    for (i, stage) in STAGES.into_iter().enumerate() {
        cell(target, fault, stage, salt + 100 * i as u64).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_the_prefill_worker_at_every_stage() {
    row(Target::Prefill, Fault::Kill, 10_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_the_prefill_worker_at_every_stage() {
    row(Target::Prefill, Fault::Stop, 20_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_the_decode_worker_at_every_stage() {
    row(Target::Decode, Fault::Kill, 30_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_the_decode_worker_at_every_stage() {
    row(Target::Decode, Fault::Stop, 40_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_of_etcd_at_every_stage() {
    row(Target::Etcd, Fault::Kill, 50_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigstop_of_etcd_at_every_stage() {
    row(Target::Etcd, Fault::Stop, 60_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_router_restart_at_every_stage() {
    row(Target::Router, Fault::Restart, 70_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_router_crash_and_restart_at_every_stage() {
    row(Target::Router, Fault::Kill, 80_000).await;
}
