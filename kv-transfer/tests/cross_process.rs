//! Two processes, one killed mid-transfer: the survivor reports a typed error in bounded time and the
//! receiver's pool gets every block back. The other process is the `kv-peer` binary; its fault comes from
//! `TANDEM_KV_FAULT` (honoured because test builds enable the fault-injection feature).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Kind, Opts, pair, wait_pool_used};
use kv_transfer::transport::ucx::DataPath;
use kv_transfer::{ExpectRequest, TransferError, testkit};
use prost::Message;

fn peer(args: &[&str], fault: Option<&str>) -> (Child, ChildStdin, std::sync::mpsc::Receiver<String>) {
    common::spawn_peer(env!("CARGO_BIN_EXE_kv-peer"), args, fault)
}

fn tls_args(kind: &Kind) -> Vec<String> {
    match kind.tls() {
        Some(tls) => vec!["--tls".into(), tls.to_string()],
        None => vec![],
    }
}

/// The prefill process dies (SIGKILL) right after layer 1 landed.
fn sender_killed_mid_transfer(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let tokens = 64 * 6 + 3;
    let dst = p.rpool.reserve("victim", tokens).unwrap();
    let req = ExpectRequest {
        request_id: "victim".into(),
        blocks: dst,
        num_tokens: tokens,
        timeout: Duration::from_secs(4),
        verify_checksum: true,
    };
    let (desc, pending) = p.recv.expect(req).unwrap();
    let mut args = vec!["send".to_string(), "--layers".into(), "4".into()];
    args.extend(tls_args(kind));
    args.extend(["--lanes".into(), kind.lanes().to_string()]);
    if let Some(dp) = kind.data_path() {
        let dp = if dp == DataPath::Put { "put" } else { "am" };
        args.extend(["--data-path".into(), dp.into()]);
    }
    if kind.one_sided_puts() {
        // Puts need the trusted-network opt-in (without it `put` is a configuration error).
        args.push("--one-sided-puts".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut child, mut stdin, _out) = peer(&args, Some("kill_after_layer:1"));
    writeln!(stdin, "DESC {}", testkit::to_hex(&desc.encode_to_vec())).unwrap();
    let t0 = Instant::now();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the sender must have died: {status:?}");
    let e = pending.wait_timeout(Duration::from_secs(10)).expect("bounded").unwrap_err();
    match kind.base() {
        // Transports with peer-failure detection report the dead sender itself.
        Kind::Tcp | Kind::Ucx("tcp") | Kind::UcxAm("tcp") => {
            assert!(matches!(e, TransferError::PeerLost { .. }), "{e:?}")
        }
        // UCX 1.13 shared memory cannot detect a dead peer: the deadline ends the transfer.
        _ => assert!(matches!(e, TransferError::PeerLost { .. } | TransferError::DeadlineExceeded(_)), "{e:?}"),
    }
    if let Kind::Ucx("tcp") = kind.base() {
        // A one-sided writer was lost: its blocks sit out the quarantine before returning.
        assert_eq!(p.recv.stats().quarantined_blocks, 7, "blocks quarantined");
    }
    wait_pool_used(&p.rpool, 0, Duration::from_secs(6));
    assert_eq!(p.recv.stats().quarantined_blocks, 0);
    assert!(t0.elapsed() < Duration::from_secs(12));
}

/// The decode process dies mid-transfer: the sender's completion fails in bounded time.
fn receiver_killed_mid_transfer(kind: &Kind) {
    if !kind.available() {
        return;
    }
    let transport = kind.transport_kind().as_str();
    let mut args = vec!["recv".to_string(), "--transport".into(), transport.into(), "--layers".into(), "4".into()];
    args.extend(["--tokens".into(), "300".into(), "--timeout-ms".into(), "3000".into()]);
    args.extend(tls_args(kind));
    args.extend(["--lanes".into(), kind.lanes().to_string()]);
    if kind.one_sided_puts() {
        args.push("--one-sided-puts".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (child, _stdin, out) = peer(&args, None);
    let (cache, pool) = testkit::filled_cache(testkit::geometry(4, 64), 5);
    common::sender_sees_the_receiver_die(child, &out, Duration::from_secs(30), kind.sender_config(), cache, &pool);
}

/// How many runs an [`isolated`] test gets before UCX 1.13's wireup assertion fails it.
const ISOLATED_ATTEMPTS: u32 = 4;

/// Runs test `name` in a process of its own (this binary re-entered with `TANDEM_ISOLATED=1`, where `body`
/// runs directly), and again (up to [`ISOLATED_ATTEMPTS`] runs) while that process dies of UCX 1.13's
/// assertion on a wireup reply purged from a killed peer's endpoint ("got REP message" in
/// `ucp_request_send_state_ff`): a libucp bug on the error path, not one of ours (UCX 1.14 removed the
/// assertion, openucx/ucx#8175; tandem warns at start with an older libucp). Measured on the 2-core VM with
/// Debian's 1.13.1: the striped TCP sender-killed test aborted on both of its two runs in 2 of 40 runs of this
/// binary (p^2 = 0.05, so p = 0.22 a run); with four runs that test fails about 0.25% of the time (p^4), and
/// each of the UCX kill tests can. Any other failure fails the test at once.
fn isolated(name: &str, body: impl FnOnce()) {
    if std::env::var_os("TANDEM_ISOLATED").is_some() {
        return body();
    }
    for attempt in 1..=ISOLATED_ATTEMPTS {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env("TANDEM_ISOLATED", "1")
            .output()
            .expect("re-run the test binary");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            assert!(text.contains("test result: ok. 1 passed"), "{name} did not run in its process:\n{text}");
            return;
        }
        let known = text.contains("got REP message") && text.contains("ucp_request_send_state_ff");
        assert!(known && attempt < ISOLATED_ATTEMPTS, "{name} failed in its process (attempt {attempt}):\n{text}");
        eprintln!("{name}: UCX 1.13's wireup assertion aborted the process (a libucp bug); running it again");
    }
}

#[test]
fn tcp_sender_killed_mid_transfer() {
    sender_killed_mid_transfer(&Kind::Tcp)
}

#[test]
fn ucx_tcp_sender_killed_mid_transfer() {
    isolated("ucx_tcp_sender_killed_mid_transfer", || sender_killed_mid_transfer(&Kind::Ucx("tcp")))
}

#[test]
fn ucx_shm_sender_killed_mid_transfer() {
    isolated("ucx_shm_sender_killed_mid_transfer", || sender_killed_mid_transfer(&Kind::Ucx("sm,self")))
}

#[test]
fn tcp_receiver_killed_mid_transfer() {
    receiver_killed_mid_transfer(&Kind::Tcp)
}

#[test]
fn ucx_tcp_receiver_killed_mid_transfer() {
    isolated("ucx_tcp_receiver_killed_mid_transfer", || receiver_killed_mid_transfer(&Kind::Ucx("tcp")))
}

#[test]
fn ucx_shm_receiver_killed_mid_transfer() {
    isolated("ucx_shm_receiver_killed_mid_transfer", || receiver_killed_mid_transfer(&Kind::Ucx("sm,self")))
}

#[test]
fn ucx_tcp_striped_sender_killed_mid_transfer() {
    isolated("ucx_tcp_striped_sender_killed_mid_transfer", || {
        sender_killed_mid_transfer(&Kind::Striped(Box::new(Kind::Ucx("tcp")), 3))
    })
}

#[test]
fn ucx_tcp_am_striped_sender_killed_mid_transfer() {
    isolated("ucx_tcp_am_striped_sender_killed_mid_transfer", || {
        sender_killed_mid_transfer(&Kind::Striped(Box::new(Kind::UcxAm("tcp")), 3))
    })
}

#[test]
fn ucx_tcp_am_striped_receiver_killed_mid_transfer() {
    isolated("ucx_tcp_am_striped_receiver_killed_mid_transfer", || {
        receiver_killed_mid_transfer(&Kind::Striped(Box::new(Kind::UcxAm("tcp")), 3))
    })
}

#[test]
fn tcp_striped_sender_killed_mid_transfer() {
    sender_killed_mid_transfer(&Kind::Striped(Box::new(Kind::Tcp), 3))
}

/// UCX's own log lines go to stderr without truncating a file stderr is redirected to: UCX reopens a
/// path such as `/dev/stderr` with O_TRUNC, which wiped the log of a process started as `... 2>>log`.
/// In a process of its own, like the UCX kill tests: loading libucp (its check of the library) runs UCX's
/// library constructors, which this binary's in-process TCP tests should not run beside (the binary died of
/// a SIGSEGV once under a loaded CI run, with no test of ours failing).
#[test]
fn ucx_logs_append_to_a_redirected_stderr() {
    isolated("ucx_logs_append_to_a_redirected_stderr", ucx_logs_append);
}

fn ucx_logs_append() {
    if !Kind::Ucx("tcp").available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peer.log");
    std::fs::write(&path, "an earlier log line\n").unwrap();
    let log_file = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-peer"))
        .args(["recv", "--transport", "ucx", "--tls", "tcp", "--timeout-ms", "2000"])
        .env("UCX_LOG_LEVEL", "info")
        .env_remove("UCX_LOG_FILE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .expect("spawn kv-peer");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("DESC "), "stdout holds only the peer's own lines, got {line:?}");
    let log = std::fs::read_to_string(&path).unwrap();
    assert!(log.starts_with("an earlier log line\n"), "stderr's file was truncated: {:?}", &log[..log.len().min(300)]);
    assert!(log.contains("UCX  INFO"), "UCX's log lines reach stderr: {:?}", &log[..log.len().min(300)]);
}
