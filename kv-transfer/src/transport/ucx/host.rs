//! Which UCX peers share this machine. With `UCX_TLS` unset, UCX reaches a peer on the same host over
//! shared memory (posix/sysv/cma) only from endpoints created without peer-failure detection: UCX 1.13's
//! shared-memory transports cannot report a dead peer, so an endpoint that asks for it silently gets
//! tcp over loopback instead, at a fraction of the bandwidth (bench/RESULTS.md, issue 23 D11).

use std::sync::OnceLock;

/// An id equal for processes that can share memory with each other: same boot of the same machine, same
/// IPC namespace (shared-memory segments) and PID namespace (cma's process_vm_writev).
pub fn host_id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let link = |p: &str| std::fs::read_link(p).map(|l| l.to_string_lossy().into_owned()).unwrap_or_default();
        let parts = [
            read("/proc/sys/kernel/random/boot_id"),
            read("/proc/sys/kernel/hostname"),
            link("/proc/self/ns/ipc"),
            link("/proc/self/ns/pid"),
        ];
        // 0 means "unknown" on the wire: never equal to a peer's.
        xxhash_rust::xxh3::xxh3_64(parts.join("\n").as_bytes()).max(1)
    })
}

/// Whether a peer with `host` can be reached over shared memory from here.
pub fn same_host(host: u64) -> bool {
    host != 0 && host == host_id()
}

/// Whether `tls` (the configured value, else `UCX_TLS`) leaves UCX free to pick shared memory: unset,
/// or naming a shared-memory transport.
pub fn shm_allowed(tls: Option<&str>) -> bool {
    let tls = tls.map(str::to_string).or_else(|| std::env::var("UCX_TLS").ok()).unwrap_or_default();
    const SHM: [&str; 8] = ["all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"];
    let names = |list: &str| list.split(',').map(|n| n.trim().trim_start_matches('\\').to_string()).collect::<Vec<_>>();
    match tls.trim().strip_prefix('^') {
        // "^a,b": everything but a and b.
        Some(excluded) => !names(excluded).iter().any(|n| n == "sm" || n == "shm"),
        None => tls.trim().is_empty() || names(&tls).iter().any(|n| SHM.contains(&n.as_str())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_is_the_same_host_and_unknown_is_not() {
        assert!(same_host(host_id()));
        assert!(!same_host(0));
        assert!(shm_allowed(Some("sm,self")));
        assert!(shm_allowed(Some("posix,tcp")));
        assert!(!shm_allowed(Some("tcp")));
        assert!(!shm_allowed(Some("rc_x,self")));
        assert!(shm_allowed(Some("^tcp")));
        assert!(!shm_allowed(Some("^sm")));
    }
}
