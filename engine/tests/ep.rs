//! Expert parallelism on two GPUs (engine::cuda::ep): two processes, one a GPU, each a data-parallel rank
//! with half of the requests and half of the routed experts, produce the logits of one GPU that runs every
//! request with every expert, bit for bit; a rank with no requests left joins each pass with an empty
//! batch; the MTP layer's MoE runs in lockstep too.
//!
//! The test runs itself as the ranks (`TANDEM_EP_TEST_RANK`). Below two GPUs it is skipped, a failure under
//! `TANDEM_REQUIRE_GPUS=2` (`scripts/gpu-test.sh run ep`).

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::cuda::CudaBackend;
use engine::cuda::ep::{Dbo, EpConfig};
use engine::sampling::argmax;
use engine::{AttnForm, Backend, Logits, MtpInput, Precision, SeqInput};
use support::{Served, VOCAB, xorshift};

const BLOCKS: usize = 64;
const RANK: &str = "TANDEM_EP_TEST_RANK";

/// Requests: prompt length and decode steps. Request i runs on rank i % 2; rank 1's requests end early, so
/// it is idle for the last steps while rank 0 still decodes.
const REQUESTS: [(usize, usize); 4] = [(37, 7), (90, 4), (5, 7), (64, 3)];

fn gpus() -> usize {
    engine::cuda::device::device_count().unwrap_or(0)
}

/// Rows of logits as bits, per request: the prefill's last row, then per step the decode row and the
/// MTP row.
type Trace = BTreeMap<usize, Vec<Vec<u32>>>;

fn prompt(i: usize, seed: u64) -> Vec<u32> {
    xorshift(seed ^ ((i as u64 + 1) * 0x9e37_79b9))
        .take(REQUESTS[i].0)
        .map(|s| 7 + (s % (VOCAB as u64 - 7)) as u32)
        .collect()
}

fn bits(b: &dyn Backend, rows: &engine::DeviceRows) -> Vec<u32> {
    b.rows_to_host(rows).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Runs `mine` of the requests in lockstep steps (every step a decode call and an MTP call, empty where
/// none of `mine` is left), greedy, then one step where every rank is idle.
fn run(b: Arc<dyn Backend>, mine: &[usize], seed: u64) -> Trace {
    let s = Served::new(b, BLOCKS);
    let b = &*s.b;
    let prompts: Vec<Vec<u32>> = mine.iter().map(|&i| prompt(i, seed)).collect();
    let tables: Vec<_> =
        mine.iter().zip(&prompts).map(|(i, p)| s.pool.reserve(&i.to_string(), p.len() + 16).unwrap()).collect();
    let mut trace = Trace::new();
    // One prefill of every request, then the MTP layer over each prompt (its next tokens: the prompt's
    // own, then the first generated one).
    let batch: Vec<SeqInput> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqInput { tokens: p, start: 0, blocks: &t.blocks, logits: Logits::Last })
        .collect();
    // Each step agreed up front, as engine::generate does (the final idle step agrees pass by pass).
    let prompt_rows: usize = prompts.iter().map(Vec::len).sum();
    b.begin_step([0, prompt_rows, prompt_rows]).unwrap();
    let out = b.prefill(&s.cache, &batch, &mut |_, _| {}).unwrap();
    let mut next: Vec<u32> = Vec::new();
    for (&i, o) in mine.iter().zip(&out) {
        let row = bits(b, &o.logits);
        next.push(argmax(&b.rows_to_host(&o.logits).unwrap()));
        trace.entry(i).or_default().push(row);
    }
    let follow: Vec<Vec<u32>> = prompts.iter().zip(&next).map(|(p, &n)| [&p[1..], &[n]].concat()).collect();
    let mtp: Vec<MtpInput> = follow
        .iter()
        .zip(&out)
        .zip(&tables)
        .map(|((f, o), t)| MtpInput {
            next_tokens: f,
            hidden: &o.hidden,
            start: 0,
            blocks: &t.blocks,
            logits: Logits::Last,
        })
        .collect();
    for (&i, o) in mine.iter().zip(b.mtp(&s.cache, &mtp, AttnForm::Prefill, &mut |_, _| {}).unwrap()) {
        trace.entry(i).or_default().push(bits(b, &o.logits));
    }
    end_step(b, true);
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let steps = REQUESTS.iter().map(|r| r.1).max().unwrap();
    for step in 0..steps {
        let live: Vec<usize> = (0..mine.len()).filter(|&j| step < REQUESTS[mine[j]].1).collect();
        if live.is_empty() {
            // An idle rank's step, as a worker runs it: the whole step joined at its end.
            end_step(b, true);
            continue;
        }
        let toks: Vec<[u32; 1]> = live.iter().map(|&j| [next[j]]).collect();
        let batch: Vec<SeqInput> = live
            .iter()
            .zip(&toks)
            .map(|(&j, t)| SeqInput { tokens: t, start: pos[j], blocks: &tables[j].blocks, logits: Logits::Last })
            .collect();
        b.begin_step([live.len(), 0, live.len()]).unwrap();
        let out = b.decode(&s.cache, &batch).unwrap();
        let mut after: Vec<[u32; 1]> = Vec::new();
        for (&j, o) in live.iter().zip(&out) {
            trace.entry(mine[j]).or_default().push(bits(b, &o.logits));
            after.push([argmax(&b.rows_to_host(&o.logits).unwrap())]);
        }
        let mtp: Vec<MtpInput> = live
            .iter()
            .zip(&out)
            .zip(&after)
            .map(|((&j, o), a)| MtpInput {
                next_tokens: a,
                hidden: &o.hidden,
                start: pos[j],
                blocks: &tables[j].blocks,
                logits: Logits::Last,
            })
            .collect();
        for (&j, o) in live.iter().zip(b.mtp(&s.cache, &mtp, AttnForm::Decode, &mut |_, _| {}).unwrap()) {
            trace.entry(mine[j]).or_default().push(bits(b, &o.logits));
        }
        for (&j, a) in live.iter().zip(&after) {
            next[j] = a[0];
            pos[j] += 1;
        }
        end_step(b, true);
    }
    // A step where every rank is idle: the agreement alone, and the step says so.
    assert!(b.decode(&s.cache, &[]).unwrap().is_empty());
    assert!(b.mtp(&s.cache, &[], AttnForm::Decode, &mut |_, _| {}).unwrap().is_empty());
    end_step(b, false);
    trace
}

/// Ends a step as a worker does; under expert parallelism it says whether a rank had rows.
fn end_step(b: &dyn Backend, busy: bool) {
    let got = b.end_step().unwrap();
    if b.expert_parallel().is_some() {
        assert_eq!(got, busy, "whether a rank had rows in the step");
    } else {
        assert!(!got, "a backend alone has no steps");
    }
}

fn checkpoint(dir: &Path) {
    engine::tiny::write(dir, 1, VOCAB).unwrap();
}

fn encode(t: &Trace) -> String {
    t.iter()
        .map(|(i, rows)| {
            let rows: Vec<String> =
                rows.iter().map(|r| r.iter().map(|b| format!("{b:08x}")).collect::<Vec<_>>().join("")).collect();
            format!("{i} {}", rows.join(","))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Writes `body` to `path` whole (a temporary file renamed), so a parent polling it never reads half.
fn write_whole(path: &str, body: &str) {
    let tmp = format!("{path}.tmp");
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The multi-process tests take both GPUs: one at a time, whatever the test harness's threads.
fn gpus_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    L.lock().unwrap_or_else(|p| p.into_inner())
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"))
}

/// This rank's backend in the group `spec` (`TANDEM_EP_TEST_SPEC` or another); the fault tests bound a step
/// to 3 s.
fn rank_backend(rank: usize, spec: &str) -> Result<CudaBackend, engine::EngineError> {
    let ckpt = engine::checkpoint::Checkpoint::open(Path::new(&var("TANDEM_EP_TEST_CKPT"))).unwrap();
    let mut ep = EpConfig::parse(spec).unwrap();
    if std::env::var_os(EPLB).is_some() {
        ep.eplb = moving_eplb();
    }
    // Overlap off unless asked for: the plain tests check the one-stream exchange.
    ep.dbo = if std::env::var_os(DBO).is_some() { Dbo::On } else { Dbo::Off };
    match var("TANDEM_EP_TEST_MODE").as_str() {
        "equal" => {}
        "init-fault" => ep.timeout = Duration::from_secs(10),
        _ => ep.step_timeout = Duration::from_secs(3),
    }
    let cache = std::env::temp_dir().join("tandem-test-kernels");
    CudaBackend::load_ep(&ckpt, Precision::Fp8, rank, &cache, &ep)
}

/// Set for a rank that balances its experts' load ([`moving_eplb`]).
const EPLB: &str = "TANDEM_EP_TEST_EPLB";
/// Set for a rank that runs every main pass of 2 rows or more as two overlapped micro-batches.
const DBO: &str = "TANDEM_EP_TEST_DBO";

/// Load balancing that moves experts as often as it can: a look at every busy step over that step's loads
/// alone, any change applied, two spare slots a rank.
fn moving_eplb() -> engine::eplb::EplbConfig {
    engine::eplb::EplbConfig {
        rebalance: true,
        redundant: 2,
        interval: 1,
        window: 1,
        min_gain: 0.0,
        gpus_per_node: None,
    }
}

/// One prefill of a short prompt, then one decode step of it: two steps of the group. The decode pass has
/// the same shape every time, so from the second on it replays a CUDA graph holding the exchanges'
/// collectives: a lost rank must end that replay too.
fn one_step(s: &Served) -> Result<(), engine::EngineError> {
    let toks: Vec<u32> = (0..24).map(|i| 7 + i).collect();
    let t = s.pool.reserve("step", toks.len() + 1).unwrap();
    let run = || -> Result<(), engine::EngineError> {
        let item = SeqInput { tokens: &toks, start: 0, blocks: &t.blocks, logits: Logits::Last };
        let o = s.b.prefill(&s.cache, &[item], &mut |_, _| {})?;
        s.b.rows_to_host(&o[0].logits)?;
        let next = [7u32];
        let item = SeqInput { tokens: &next, start: toks.len(), blocks: &t.blocks, logits: Logits::Last };
        let o = s.b.decode(&s.cache, &[item])?;
        s.b.rows_to_host(&o[0].logits).map(drop)
    };
    let r = run();
    s.pool.release("step").unwrap();
    r
}

/// The backend's decode graphs as `captures replays`.
fn graph_counts(b: &dyn Backend) -> String {
    let g = b.decode_graphs().unwrap_or_default();
    format!("{} {}", g.captures, g.replays)
}

/// A rank (`TANDEM_EP_TEST_MODE`): `equal` runs its requests under EP-2 and writes the trace; `fault` steps
/// until a step fails (writing `stepping` after a few), then joins the group `TANDEM_EP_TEST_SPEC2` and
/// steps once; `rejoin` only joins that group and steps once. What happened goes to `TANDEM_EP_TEST_OUT`.
fn rank_main(rank: usize) {
    let out = var("TANDEM_EP_TEST_OUT");
    match var("TANDEM_EP_TEST_MODE").as_str() {
        "equal" => {
            let b = rank_backend(rank, &var("TANDEM_EP_TEST_SPEC")).unwrap();
            let seed: u64 = var("TANDEM_EP_TEST_SEED").parse().unwrap();
            let mine: Vec<usize> = (0..REQUESTS.len()).filter(|i| i % 2 == rank).collect();
            let b = Arc::new(b);
            let t = run(b.clone(), &mine, seed);
            if let Some(st) = b.eplb_stats() {
                write_whole(&format!("{out}.eplb"), &format!("{} {}", st.layers_moved, st.copies_received));
            }
            write_whole(&format!("{out}.graphs"), &graph_counts(&*b));
            write_whole(&out, &encode(&t));
        }
        "fault" => {
            let s = Served::new(Arc::new(rank_backend(rank, &var("TANDEM_EP_TEST_SPEC")).unwrap()), BLOCKS);
            let mut n = 0u64;
            let mut last = Instant::now();
            let err = loop {
                match one_step(&s) {
                    Ok(()) => {
                        n += 1;
                        last = Instant::now();
                        if n == 3 {
                            let g = s.b.decode_graphs().unwrap_or_default();
                            assert!(g.replays > 0, "rank {rank}: the decode steps replay no graph: {g:?}");
                            std::fs::write(format!("{out}.stepping"), "").unwrap();
                        }
                    }
                    Err(e) => break e,
                }
            };
            let waited = last.elapsed().as_secs_f64();
            // As a worker does on a group failure: it leaves the group (its decode graphs dropped, the
            // communicator aborted), then ends its requests; nothing here may wait for NCCL's abort.
            s.b.leave_group("the test's rank stops");
            let group = matches!(err, engine::EngineError::GroupDown(_));
            write_whole(
                &out,
                &format!("error after {n} steps, {waited:.2} s after the last (group down: {group}): {err}\n"),
            );
            drop(s);
            rejoin(rank, &out);
        }
        "rejoin" => rejoin(rank, &out),
        "init-fault" => {
            let t0 = Instant::now();
            let got = rank_backend(rank, &var("TANDEM_EP_TEST_SPEC"));
            let took = t0.elapsed().as_secs_f64();
            write_whole(
                &out,
                &match got {
                    Ok(_) => format!("joined after {took:.1} s\n"),
                    Err(e) => format!("error after {took:.1} s: {e}\n"),
                },
            );
        }
        m => panic!("unknown mode {m}"),
    }
}

/// The recovery policy: every rank leaves the broken group and the ranks form a new one.
fn rejoin(rank: usize, out: &str) {
    let s = Served::new(Arc::new(rank_backend(rank, &var("TANDEM_EP_TEST_SPEC2")).unwrap()), BLOCKS);
    one_step(&s).unwrap();
    let mut o = std::fs::read_to_string(out).unwrap_or_default();
    o.push_str("recovered\n");
    write_whole(out, &o);
}

/// Rank `r` of a test in `dir` as a child process.
fn spawn_rank(dir: &Path, r: usize, mode: &str, env: &[(&str, String)]) -> std::process::Child {
    let tag = format!("{mode}-rank{r}");
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "two_expert_parallel_ranks_give_one_gpus_logits_bit_for_bit", "--nocapture"])
        .env(RANK, r.to_string())
        .env("TANDEM_EP_TEST_MODE", mode)
        .env("TANDEM_EP_TEST_CKPT", dir)
        .env("TANDEM_EP_TEST_OUT", dir.join(format!("{tag}.txt")))
        .stdout(Stdio::from(std::fs::File::create(dir.join(format!("{tag}.log"))).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(dir.join(format!("{tag}.err"))).unwrap()));
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Waits for `kids` to exit (killing them all past `secs`); panics with a rank's output where it failed.
fn wait_all(dir: &Path, kids: &mut [(String, std::process::Child)], secs: u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut done: Vec<Option<std::process::ExitStatus>> = kids.iter().map(|_| None).collect();
    while done.iter().any(Option::is_none) {
        for (d, (_, k)) in done.iter_mut().zip(kids.iter_mut()) {
            if d.is_none() {
                *d = k.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            kids.iter_mut().for_each(|(_, k)| drop(k.kill()));
            panic!("the ranks did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (st, (tag, _)) in done.iter().zip(kids.iter()) {
        if !st.unwrap().success() {
            let read = |ext: &str| std::fs::read_to_string(dir.join(format!("{tag}.{ext}"))).unwrap_or_default();
            panic!("{tag} failed ({st:?}):\n{}\n{}", read("log"), read("err"));
        }
    }
}

fn two_gpus_or_skip() -> bool {
    if gpus() >= 2 {
        return true;
    }
    assert!(
        std::env::var("TANDEM_REQUIRE_GPUS").is_err(),
        "TANDEM_REQUIRE_GPUS is set and this machine has {} GPUs",
        gpus()
    );
    eprintln!("skipped: expert parallelism needs 2 GPUs, this machine has {}", gpus());
    false
}

/// Rank 1 stopped (`STOP`) or killed (`KILL`) mid-run, or (`EXIT`) exiting on its own just before it
/// would replay a decode graph that rank 0 then replays alone: rank 0's step fails within seconds (its
/// watchdog aborts the communicator), and the two form a new group (rank 1 restarted) that steps again.
fn fault_case(signal: &str) {
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let spec = |r: usize, port: u16| format!("{r}/2@127.0.0.1:{port}");
    let (p1, p2) = (free_port(), free_port());
    let env = |r: usize| vec![("TANDEM_EP_TEST_SPEC", spec(r, p1)), ("TANDEM_EP_TEST_SPEC2", spec(r, p2))];
    let mut r0 = spawn_rank(dir.path(), 0, "fault", &env(0));
    let mut env1 = env(1);
    if signal == "EXIT" {
        // Past the steps that write `stepping` (a replay each from the second).
        env1.push((engine::cuda::ep::FAULT_EXIT_AT_REPLAY, "5".into()));
    }
    let mut r1 = spawn_rank(dir.path(), 1, "fault", &env1);
    let stepping = |r: usize| dir.path().join(format!("fault-rank{r}.txt.stepping")).exists();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(stepping(0) && stepping(1)) {
        assert!(Instant::now() < deadline, "the ranks did not start stepping within 120 s");
        let exited = r1.try_wait().unwrap().is_some() && signal != "EXIT";
        assert!(r0.try_wait().unwrap().is_none() && !exited, "a rank exited early");
        std::thread::sleep(Duration::from_millis(20));
    }
    let hit = Instant::now();
    if signal == "EXIT" {
        let st = r1.wait().unwrap();
        assert_eq!(st.code(), Some(3), "rank 1 exits at its fifth agreed replay");
    } else {
        let st = Command::new("kill").args([&format!("-{signal}"), &r1.id().to_string()]).status().unwrap();
        assert!(st.success(), "kill -{signal}");
    }
    let out0 = dir.path().join("fault-rank0.txt");
    while !std::fs::read_to_string(&out0).is_ok_and(|o| o.starts_with("error")) {
        assert!(hit.elapsed() < Duration::from_secs(60), "rank 0 still steps 60 s after rank 1's fault ({signal})");
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = hit.elapsed().as_secs_f64();
    let msg = std::fs::read_to_string(&out0).unwrap();
    eprintln!("{signal}: rank 0's step failed {after:.2} s after rank 1's fault: {}", msg.trim());
    assert!(msg.contains("(group down: true)"), "rank 0's error is the group's, not its device's: {msg}");
    // Restart all ranks: rank 1 anew, rank 0 (already rejoining) with it.
    drop(r1.kill());
    drop(r1.wait());
    let r1 = spawn_rank(dir.path(), 1, "rejoin", &env(1));
    wait_all(dir.path(), &mut [("fault-rank0".into(), r0), ("rejoin-rank1".into(), r1)], 180);
    assert!(std::fs::read_to_string(&out0).unwrap().contains("recovered"), "rank 0 did not step in the new group");
    assert!(std::fs::read_to_string(dir.path().join("rejoin-rank1.txt")).unwrap().contains("recovered"));
}

/// A group of one's test set-up: the tiny checkpoint in `dir`, and the plain backend's trace of every
/// request with `seed` (None, with a message, where there is no GPU and none is required).
fn plain_trace(dir: &Path, seed: u64) -> Option<(engine::checkpoint::Checkpoint, PathBuf, String)> {
    checkpoint(dir);
    let ckpt = engine::checkpoint::Checkpoint::open(dir).unwrap();
    let cache = std::env::temp_dir().join("tandem-test-kernels");
    let one = match CudaBackend::load(&ckpt, Precision::Fp8, 0, &cache) {
        Ok(b) => b,
        Err(e) if !engine::cuda::gpu_required() && e.to_string().contains("no usable GPU") => {
            eprintln!("skipped: {e}; TANDEM_REQUIRE_GPU=1 makes this a failure");
            return None;
        }
        Err(e) => panic!("the CUDA backend did not load: {e}"),
    };
    let want = encode(&run(Arc::new(one), &[0, 1, 2, 3], seed));
    Some((ckpt, cache, want))
}

/// A group of one rank's settings, on a free leader port.
fn one_rank() -> EpConfig {
    EpConfig::parse(&format!("0/1@127.0.0.1:{}", free_port())).unwrap()
}

/// A group of one rank with `ep`'s settings, loaded from `ckpt`.
fn one_rank_backend(ckpt: &engine::checkpoint::Checkpoint, cache: &Path, ep: &EpConfig) -> Arc<CudaBackend> {
    Arc::new(CudaBackend::load_ep(ckpt, Precision::Fp8, 0, cache, ep).unwrap())
}

/// A group of one rank runs every step of expert parallelism (record, exchange with itself, gather, the
/// down projection into the combine rows, the combine) in one process: the same bits as without it.
#[test]
fn a_group_of_one_gives_the_plain_backends_logits_bit_for_bit() {
    if std::env::var(RANK).is_ok() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    let seed = 7;
    let Some((ckpt, cache, want)) = plain_trace(dir.path(), seed) else { return };
    let grouped = one_rank_backend(&ckpt, &cache, &one_rank());
    assert!(grouped.ep_group().is_some());
    assert!(encode(&run(grouped.clone(), &[0, 1, 2, 3], seed)) == want, "EP-1 differs from the plain backend");
    let g = grouped.decode_graphs().unwrap();
    assert!(g.captures > 0 && g.replays > 0, "the decode passes ran as CUDA graphs: {g:?}");
}

/// A graphed decode pass pads its rows (3 live requests run at the 4-row bucket), and the padding rows'
/// pairs route to no expert: the experts' counted load over the whole run is the eager run's, pair for pair,
/// and the logits are the same.
#[test]
fn padding_rows_of_a_graphed_pass_add_no_expert_load() {
    if std::env::var(RANK).is_ok() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    let seed = 17;
    let Some((ckpt, cache, want)) = plain_trace(dir.path(), seed) else { return };
    // Loads counted at every busy step and summed over the whole run; no placement changes.
    let eplb = engine::eplb::EplbConfig { rebalance: false, interval: 1, window: 64, ..Default::default() };
    let load = |graphs: bool| {
        let ep = EpConfig { eplb, ..one_rank() };
        let b = Arc::new(CudaBackend::load_ep(&ckpt, Precision::Fp8, 0, &cache, &ep).unwrap().with_graphs(graphs));
        assert!(encode(&run(b.clone(), &[0, 1, 2, 3], seed)) == want, "EP-1 (graphs {graphs}) differs");
        let g = b.decode_graphs().unwrap();
        assert_eq!(g.replays > 0, graphs, "graphs {graphs}: {g:?}");
        let st = b.eplb_stats().unwrap();
        assert!(st.looks >= 4, "{st:?}");
        st.gpu_load
    };
    let (graphed, eager) = (load(true), load(false));
    assert!(eager.iter().sum::<f64>() > 0.0, "no load counted");
    assert_eq!(graphed, eager, "padding rows were counted as expert load");
}

/// A group of one with load balancing: the experts' copies move between its slots at nearly every step
/// (the slot table, the copies, the switch between steps), and the logits stay the plain backend's.
#[test]
fn a_group_of_one_whose_experts_move_gives_the_plain_backends_logits_bit_for_bit() {
    if std::env::var(RANK).is_ok() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    let seed = 11;
    let Some((ckpt, cache, want)) = plain_trace(dir.path(), seed) else { return };
    let b = one_rank_backend(&ckpt, &cache, &EpConfig { eplb: moving_eplb(), ..one_rank() });
    assert!(encode(&run(b.clone(), &[0, 1, 2, 3], seed)) == want, "EP-1 with moving experts differs");
    let st = b.eplb_stats().unwrap();
    eprintln!("{st:?}");
    assert!(st.layers_moved >= 2 && st.looks >= 4, "{st:?}");
    assert!((st.imbalance_now - 1.0).abs() < 1e-9, "one GPU is always balanced: {st:?}");
}

/// A group of one with dual-batch overlap on every main pass of 2 rows or more (prefills split inside a
/// prompt, decode steps split between requests): the plain backend's logits, bit for bit.
#[test]
fn a_group_of_one_with_dual_batch_overlap_gives_the_plain_backends_logits_bit_for_bit() {
    if std::env::var(RANK).is_ok() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    let seed = 13;
    let Some((ckpt, cache, want)) = plain_trace(dir.path(), seed) else { return };
    let b = one_rank_backend(&ckpt, &cache, &EpConfig { dbo: Dbo::On, ..one_rank() });
    b.record_timeline(true);
    assert!(encode(&run(b.clone(), &[0, 1, 2, 3], seed)) == want, "EP-1 with dual-batch overlap differs");
    let stages = b.take_timeline().unwrap();
    let on_comm = stages.iter().filter(|s| s.lane == "comm").count();
    let micro_b = stages.iter().filter(|s| s.micro == 1 && s.what == "experts").count();
    assert!(on_comm > 0 && micro_b > 0, "no overlapped pass ran: {} stages", stages.len());
    assert!(stages.iter().all(|s| s.end_ms >= s.start_ms && s.start_ms >= 0.0));
    assert_eq!(b.decode_graphs().unwrap().replays, 0, "timed stages are read per launch: no graph");
    // Not timed, the overlapped decode passes (both streams) are captured and replayed: the same bits.
    b.record_timeline(false);
    drop(b);
    let b = one_rank_backend(&ckpt, &cache, &EpConfig { dbo: Dbo::On, ..one_rank() });
    assert!(encode(&run(b.clone(), &[0, 1, 2, 3], seed)) == want, "EP-1 overlapped in CUDA graphs differs");
    let g = b.decode_graphs().unwrap();
    assert!(g.captures > 0 && g.replays > 0, "the overlapped decode passes ran as CUDA graphs: {g:?}");
}

/// Bad load-balancing settings are refused when the backend loads, with the reason.
#[test]
fn load_balancing_settings_that_cannot_work_are_refused() {
    if std::env::var(RANK).is_ok() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let ckpt = engine::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let cache = std::env::temp_dir().join("tandem-test-kernels");
    if engine::cuda::device::device_count().unwrap_or(0) == 0 {
        assert!(!engine::cuda::gpu_required(), "TANDEM_REQUIRE_GPU=1 and no GPU");
        eprintln!("skipped: no GPU");
        return;
    }
    let ep = EpConfig { eplb: engine::eplb::EplbConfig { redundant: 17, ..moving_eplb() }, ..one_rank() };
    let e = CudaBackend::load_ep(&ckpt, Precision::Fp8, 0, &cache, &ep).err().expect("17 spare slots of 16 experts");
    assert!(e.to_string().contains("exceed"), "{e}");
}

/// Rank 1 dies between the rendezvous and NCCL's communicator set-up: rank 0's start-up fails with the
/// reason instead of waiting forever.
#[test]
fn a_rank_lost_before_the_communicator_exists_fails_the_others_start_up() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let spec = |r: usize, port: u16| ("TANDEM_EP_TEST_SPEC", format!("{r}/2@127.0.0.1:{port}"));
    let port = free_port();
    let mut r1 =
        spawn_rank(dir.path(), 1, "init-fault", &[spec(1, port), (engine::cuda::ep::FAULT_EXIT_AFTER_ID, "1".into())]);
    let r0 = spawn_rank(dir.path(), 0, "init-fault", &[spec(0, port)]);
    wait_all(dir.path(), &mut [("init-fault-rank0".into(), r0)], 120);
    assert_eq!(r1.wait().unwrap().code(), Some(3), "rank 1 exits as injected");
    let out = std::fs::read_to_string(dir.path().join("init-fault-rank0.txt")).unwrap();
    eprintln!("rank 0: {}", out.trim());
    assert!(out.starts_with("error"), "rank 0 joined a group whose rank 1 is gone: {out}");
    assert!(out.contains("start-up") || out.contains("ncclCommInitRank"), "{out}");
}

#[test]
fn a_stopped_rank_ends_the_others_steps_and_the_group_is_formed_again() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    fault_case("STOP");
}

/// Rank 0 replays a decode graph whose exchanges wait for rank 1, which is gone: the watchdog's abort ends
/// the graph's collectives, the step fails, and the group forms again.
#[test]
fn a_rank_lost_while_the_other_replays_a_decode_graph_ends_its_step_and_the_group_is_formed_again() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    fault_case("EXIT");
}

#[test]
fn a_killed_rank_ends_the_others_steps_and_the_group_is_formed_again() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    fault_case("KILL");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn two_expert_parallel_ranks_give_one_gpus_logits_bit_for_bit() {
    if let Ok(r) = std::env::var(RANK) {
        return rank_main(r.parse().unwrap());
    }
    if !two_gpus_or_skip() {
        return;
    }
    two_ranks_against_one_gpu(false, false);
}

/// Dual-batch overlap on every main pass (rank 1 idle for the last steps joins both micro-batches): the
/// logits stay one GPU's, bit for bit.
#[test]
fn two_ranks_with_dual_batch_overlap_keep_one_gpus_logits_bit_for_bit() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    two_ranks_against_one_gpu(false, true);
}

/// Load balancing moves experts between the two ranks at nearly every step (copies sent over NCCL, the
/// slot tables switched between steps): the logits stay one GPU's, bit for bit.
#[test]
fn two_ranks_that_move_their_experts_keep_one_gpus_logits_bit_for_bit() {
    if std::env::var(RANK).is_ok() || !two_gpus_or_skip() {
        return;
    }
    two_ranks_against_one_gpu(true, false);
}

fn two_ranks_against_one_gpu(eplb: bool, dbo: bool) {
    let _gpus = gpus_lock();
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path());
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("prompt seed {seed}");
    let port = free_port();
    let env = |r: usize| {
        let mut v =
            vec![("TANDEM_EP_TEST_SPEC", format!("{r}/2@127.0.0.1:{port}")), ("TANDEM_EP_TEST_SEED", seed.to_string())];
        if eplb {
            v.push((EPLB, "1".into()));
        }
        if dbo {
            v.push((DBO, "1".into()));
        }
        v
    };
    let mut kids: Vec<(String, std::process::Child)> =
        (0..2).map(|r| (format!("equal-rank{r}"), spawn_rank(dir.path(), r, "equal", &env(r)))).collect();
    wait_all(dir.path(), &mut kids, 300);
    let outs: Vec<PathBuf> = (0..2).map(|r| dir.path().join(format!("equal-rank{r}.txt"))).collect();
    for (r, o) in outs.iter().enumerate() {
        let g = std::fs::read_to_string(o.with_extension("txt.graphs")).unwrap();
        let (captures, replays): (u64, u64) =
            g.split_once(' ').map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap())).unwrap();
        eprintln!("rank {r}: {captures} decode graphs captured, {replays} replayed");
        // Load balancing moves experts at nearly every step, and a move drops the graphs.
        assert!(eplb || (captures > 0 && replays > 0), "rank {r}: the decode passes ran as CUDA graphs");
    }
    if eplb {
        for (r, o) in outs.iter().enumerate() {
            let st = std::fs::read_to_string(o.with_extension("txt.eplb")).unwrap();
            let (moved, received): (u64, u64) =
                st.split_once(' ').map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap())).unwrap();
            eprintln!("rank {r}: {moved} MoE layers moved, {received} expert copies received");
            assert!(moved >= 2, "rank {r}: load balancing moved {moved} layers");
            assert!(received >= 1, "rank {r}: no expert came from the other rank");
        }
    }
    // One GPU, every request, every expert.
    let ckpt = engine::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let cache = std::env::temp_dir().join("tandem-test-kernels");
    let one = CudaBackend::load(&ckpt, Precision::Fp8, 0, &cache).unwrap();
    let want = encode(&run(Arc::new(one), &[0, 1, 2, 3], seed));
    let mut got: Vec<String> = outs
        .iter()
        .flat_map(|o| std::fs::read_to_string(o).unwrap().lines().map(str::to_string).collect::<Vec<_>>())
        .collect();
    got.sort_by_key(|l| l.split(' ').next().unwrap().parse::<usize>().unwrap());
    let want: Vec<&str> = want.lines().collect();
    assert_eq!(got.len(), want.len(), "requests traced");
    for (g, w) in got.iter().zip(&want) {
        let req = w.split(' ').next().unwrap();
        let (gr, wr): (Vec<&str>, Vec<&str>) = (g.split(',').collect(), w.split(',').collect());
        assert_eq!(gr.len(), wr.len(), "request {req}: rows");
        for (n, (a, b)) in gr.iter().zip(&wr).enumerate() {
            assert!(
                a == b,
                "request {req}, row {n} (0: prefill, then decode and MTP rows by turns): EP-2 differs from one GPU"
            );
        }
    }
}
