#![allow(dead_code)]
//! A real etcd server for tests: started on free ports with a temporary data dir, killed on drop; plain, or
//! serving TLS ([`Etcd::start_tls`]). Tests skip (with a printed reason) when no `etcd` binary is
//! installed, except under CI, where `scripts/test.sh` installs it and a missing binary is a failure.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// etcd's own TLS files, for a TLS client port.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require clients to present a certificate signed by `ca` (etcd --client-cert-auth).
    pub client_cert_auth: bool,
}

pub struct Etcd {
    child: Option<Child>,
    tls: Option<ServerTls>,
    extra_args: Vec<String>,
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
        Self::start_with(None, &[])
    }

    /// [`Etcd::start`] with a TLS client port (`https://`).
    pub fn start_tls(tls: ServerTls) -> Option<Self> {
        Self::start_with(Some(tls), &[])
    }

    /// [`Etcd::start`] with more etcd flags (e.g. `--auth-token-ttl`).
    pub fn start_args(args: &[&str]) -> Option<Self> {
        Self::start_with(None, args)
    }

    fn start_with(tls: Option<ServerTls>, extra_args: &[&str]) -> Option<Self> {
        if etcd_binary().is_none() {
            assert!(std::env::var_os("CI").is_none(), "etcd is not installed (scripts/test.sh installs etcd-server)");
            eprintln!("SKIP: no `etcd` binary on PATH (apt-get install etcd-server)");
            return None;
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let data_dir = tmp.path().join("data");
        let mut e = Self {
            child: None,
            tls,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            client_url: String::new(),
            client_port: free_port(),
            peer_port: free_port(),
            data_dir,
            _tmp: tmp,
        };
        let scheme = if e.tls.is_some() { "https" } else { "http" };
        // Free ports can be taken between their choice and etcd's bind (tests start etcds in parallel): etcd
        // then exits at once, and it is started again on other ports.
        for _ in 0..5 {
            e.client_url = format!("{scheme}://127.0.0.1:{}", e.client_port);
            if e.try_spawn() {
                return Some(e);
            }
            (e.client_port, e.peer_port) = (free_port(), free_port());
            let _ = std::fs::remove_dir_all(&e.data_dir);
        }
        panic!("etcd did not start on 5 pairs of free ports");
    }

    fn spawn(&mut self) {
        assert!(self.try_spawn(), "etcd did not start on ports {} and {}", self.client_port, self.peer_port);
    }

    /// Starts etcd; false when it did not serve both ports, or exited right after (a port taken).
    fn try_spawn(&mut self) -> bool {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new("etcd");
        if let Some(t) = &self.tls {
            cmd.arg("--cert-file").arg(&t.cert).arg("--key-file").arg(&t.key).arg("--trusted-ca-file").arg(&t.ca);
            if t.client_cert_auth {
                cmd.arg("--client-cert-auth");
            }
        }
        let child = cmd
            .args(&self.extra_args)
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
        let up =
            wait_port(self.client_port, Duration::from_secs(10)) && wait_port(self.peer_port, Duration::from_secs(5));
        // A port lost to another process makes etcd exit just after it opened the other one.
        std::thread::sleep(Duration::from_millis(100));
        let alive = self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)));
        if !(up && alive) {
            self.kill();
        }
        up && alive
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

    /// The running etcd's process id (to stop and continue it).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The client port, for a URL of another scheme than etcd serves.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

/// Whether something listens on `port` within `limit`.
fn wait_port(port: u16, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
