#![allow(dead_code)]
//! A real etcd server for tests: started on free ports with a temporary data dir, killed on drop.
//! Tests skip (with a printed reason) when no `etcd` binary is installed, except under CI, where
//! `scripts/test.sh` installs it and a missing binary is a failure.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Option<Child>,
    pub client_url: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    _tmp: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

fn etcd_binary() -> Option<PathBuf> {
    for dir in std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default() {
        let p = dir.join("etcd");
        if p.is_file() {
            return Some(p);
        }
    }
    None
}

impl Etcd {
    /// Starts etcd, or returns None (after printing why) when it is not installed outside CI.
    pub fn start() -> Option<Self> {
        if etcd_binary().is_none() {
            assert!(std::env::var_os("CI").is_none(), "etcd is not installed (scripts/test.sh installs etcd-server)");
            eprintln!("SKIP: no `etcd` binary on PATH (apt-get install etcd-server)");
            return None;
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let data_dir = tmp.path().join("data");
        let mut e = Self {
            child: None,
            client_url: String::new(),
            client_port: free_port(),
            peer_port: free_port(),
            data_dir,
            _tmp: tmp,
        };
        e.client_url = format!("http://127.0.0.1:{}", e.client_port);
        e.spawn();
        Some(e)
    }

    fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        wait_port(self.client_port, Duration::from_secs(10));
    }

    /// Kills etcd hard (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports. `wipe` starts from an empty data dir (all leases and keys lost).
    pub fn restart(&mut self, wipe: bool) {
        self.kill();
        if wipe {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
        self.spawn();
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

fn wait_port(port: u16, limit: Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("etcd did not listen on port {port} within {limit:?}");
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
