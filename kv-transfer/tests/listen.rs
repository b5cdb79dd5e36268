//! A receiver told to listen on loopback opens no socket on another interface, UCX included.

mod common;

use std::time::Duration;

use common::Kind;
use kv_transfer::{KvReceiver, ReceiverConfig, TcpConfig, TransportConfig, TransportKind, testkit};

/// Inodes of this process's sockets (`/proc/self/fd/N -> socket:[INODE]`).
fn own_socket_inodes() -> std::collections::HashSet<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Local addresses of this process's listening TCP sockets ("ip:port", IPv4 and IPv6 in /proc's hex).
/// /proc/self/net/tcp lists the whole network namespace (other processes' sockets too), so a socket
/// counts only if its inode is one of this process's file descriptors.
fn listening() -> Vec<String> {
    let ours = own_socket_inodes();
    let mut out = Vec::new();
    for f in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st 0A = LISTEN; column 9 is the inode.
            if cols.len() > 9 && cols[3] == "0A" && ours.contains(cols[9]) {
                out.push(cols[1].to_owned());
            }
        }
    }
    out
}

fn is_loopback(hex: &str) -> bool {
    let ip = hex.split(':').next().unwrap_or_default();
    // 127.x.x.x is stored little-endian: the last byte pair is 7F. ::1 and ::ffff:127.x likewise.
    ip.len() == 8 && ip.ends_with("7F")
        || ip == "00000000000000000000000001000000"
        || (ip.len() == 32 && ip.starts_with("0000000000000000FFFF0000") && ip.ends_with("7F"))
}

#[test]
fn a_loopback_receiver_listens_on_loopback_only() {
    let kind = Kind::Ucx("tcp");
    if !kind.available() {
        return;
    }
    let before = listening();
    let g = testkit::geometry(2, 16);
    let (cache, pool) = testkit::filled_cache(g, 3);
    let tcp = TcpConfig { listen: "127.0.0.1:0".parse().unwrap(), advertise_host: None };
    let cfg = ReceiverConfig::new(TransportConfig::Ucx { tls: Some("tcp".into()), tcp_fallback: Some(tcp) });
    let recv = KvReceiver::start(cfg, cache, pool, testkit::fingerprint(&g)).unwrap();
    assert_eq!(recv.transport(), TransportKind::Ucx);
    std::thread::sleep(Duration::from_millis(200));
    let opened: Vec<String> = listening().into_iter().filter(|a| !before.contains(a)).collect();
    assert!(!opened.is_empty(), "UCX over tcp opened no listening socket");
    let outside: Vec<&String> = opened.iter().filter(|a| !is_loopback(a)).collect();
    assert!(outside.is_empty(), "listening beyond loopback: {outside:?} (all new: {opened:?})");
}
