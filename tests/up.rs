//! `tandem up` supervises its processes: a worker that dies is restarted (with backoff) while the router
//! keeps serving, and Ctrl-C still stops everything.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// (status, body) of one HTTP/1.0 request.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()))
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// The pids of `pid`'s children whose command line contains `needle`.
fn children_with(pid: u32, needle: &str) -> Vec<u32> {
    let list = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .filter(|c| {
            std::fs::read(format!("/proc/{c}/cmdline")).is_ok_and(|b| String::from_utf8_lossy(&b).contains(needle))
        })
        .collect()
}

/// `tandem up` with `args` (and its model cache in `cache`), its stderr collected; returns the child and a
/// reader of the log so far.
fn start_up(args: &[&str], cache: Option<&std::path::Path>) -> (std::process::Child, impl Fn() -> String + use<>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    if let Some(dir) = cache {
        cmd.env("XDG_CACHE_HOME", dir);
    }
    let mut up = cmd.arg("up").args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (l2, stderr) = (log.clone(), up.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut g = l2.lock().unwrap();
            g.push_str(&line);
            g.push('\n');
        }
    });
    (up, move || log.lock().unwrap().clone())
}

#[test]
fn a_dead_worker_is_restarted_and_the_cluster_keeps_serving() {
    let cache = tempfile::tempdir().unwrap();
    let (port, grpc) = (free_port(), free_port());
    let (port_s, grpc_s) = (port.to_string(), grpc.to_string());
    let (mut up, logs) = start_up(
        &[
            "--port",
            &port_s,
            "--grpc-port",
            &grpc_s,
            "--kv-transport",
            "tcp",
            "--precision",
            "full",
            "--kv-blocks",
            "64",
        ],
        Some(cache.path()),
    );
    let ready = || http(port, "GET", "/ready", "").is_some_and(|(s, _)| s == 200);
    assert!(wait_until(Duration::from_secs(240), ready), "cluster not ready:\n{}", logs());
    let req = r#"{"model": "tandem-tiny", "prompt": "Hello", "max_tokens": 4}"#;
    assert_eq!(http(port, "POST", "/v1/completions", req).unwrap().0, 200, "{}", logs());

    let decode = children_with(up.id(), "decode-worker");
    assert_eq!(decode.len(), 1, "{}", logs());
    // SAFETY: kill(2) on a child of the process this test started.
    unsafe { libc::kill(decode[0] as i32, libc::SIGKILL) };

    let restarted = || logs().contains("[decode-0] restarted");
    assert!(wait_until(Duration::from_secs(60), restarted), "no restart:\n{}", logs());
    assert!(logs().contains("[decode-0] exited"), "{}", logs());
    assert!(up.try_wait().unwrap().is_none(), "tandem up stopped:\n{}", logs());
    let served = || http(port, "POST", "/v1/completions", req).is_some_and(|(s, _)| s == 200);
    assert!(wait_until(Duration::from_secs(120), served), "not serving after the restart:\n{}", logs());
    let new = children_with(up.id(), "decode-worker");
    assert!(new.len() == 1 && new[0] != decode[0], "{new:?}");

    // Ctrl-C stops everything.
    // SAFETY: kill(2) on the process this test started.
    unsafe { libc::kill(up.id() as i32, libc::SIGINT) };
    let stopped = wait_until(Duration::from_secs(60), || up.try_wait().unwrap().is_some());
    assert!(stopped, "tandem up did not stop on SIGINT:\n{}", logs());
    assert!(!std::path::Path::new(&format!("/proc/{}", new[0])).exists(), "the decode worker outlived tandem up");
}

/// A synthetic model (engine::synthetic) serves through the whole cluster: the workers build it from its
/// spec (with the same fingerprint, so they pair), the router reads and writes text with the tiny
/// tokenizer, and a bad spec stops `tandem up` at once with the reason.
#[test]
fn a_synthetic_model_serves_through_the_cluster() {
    let model = "synthetic:tiny,layers=6,sets=2,experts=4";
    // On a free port, in case the spec were ever accepted: the test fails instead of serving.
    let bad = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--model", "synthetic:tiny,layers=x", "--port", &free_port().to_string()])
        .args(["--grpc-port", &free_port().to_string(), "--ready-timeout", "5"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("layers=x"), "{}", String::from_utf8_lossy(&bad.stderr));

    let (port, grpc) = (free_port(), free_port());
    let (port_s, grpc_s) = (port.to_string(), grpc.to_string());
    let (mut up, logs) = start_up(
        &["--model", model, "--port", &port_s, "--grpc-port", &grpc_s, "--kv-transport", "tcp", "--kv-blocks", "64"],
        None,
    );
    // A failed assertion still stops the cluster (SIGINT reaches tandem up, which stops its children).
    struct Stop(u32);
    impl Drop for Stop {
        fn drop(&mut self) {
            // SAFETY: kill(2) on the process this test started (harmless if it already exited).
            unsafe { libc::kill(self.0 as i32, libc::SIGINT) };
        }
    }
    let _stop = Stop(up.id());
    let ready = || http(port, "GET", "/ready", "").is_some_and(|(s, _)| s == 200);
    assert!(wait_until(Duration::from_secs(240), ready), "cluster not ready:\n{}", logs());
    let (status, body) = http(port, "GET", "/v1/models", "").unwrap();
    assert!(status == 200 && body.contains(model), "{status} {body}");
    let req = format!(r#"{{"model": "{model}", "prompt": "Hello there", "max_tokens": 6, "ignore_eos": true}}"#);
    let (status, body) = http(port, "POST", "/v1/completions", &req).unwrap();
    assert_eq!(status, 200, "{body}\n{}", logs());
    assert!(body.contains(r#""completion_tokens":6"#), "{body}");
    drop(_stop);
    assert!(wait_until(Duration::from_secs(60), || up.try_wait().unwrap().is_some()), "{}", logs());
}
