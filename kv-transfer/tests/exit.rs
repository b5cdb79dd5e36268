//! A process exits cleanly right after its UCX transports are dropped, while their progress threads are
//! still draining and destroying their workers, and with transports it never dropped: every progress
//! thread has destroyed its worker and context before the exit tears libucs down (UCX 1.13 aborts an exit
//! during which a thread touches its object registry: "vfs_obj.c: Assertion `khiter != ...` failed").
//! Each case runs in a child process, the test binary itself, whose exit status and stderr are checked.

#[macro_use]
mod common;

use std::process::Command;

use common::{Kind, Opts, cases, pair};

const CHILD: &str = "TANDEM_EXIT_TEST_CHILD";
/// Exits per case: the race is short, so one exit proves little.
const EXITS: u64 = 12;
/// A dropped node's progress thread drains for at least 50 ms, then destroys its worker: the children
/// exit right after the drop, and around that point.
const DELAYS_MS: [u64; 2] = [0, 44];
/// What a child prints last, from an exit handler that runs after the transport's own.
const AT_EXIT: &str = "UCX progress threads at exit: ";

fn exits_cleanly(kind: Kind, child_test: &str) {
    if !kind.available() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for i in 0..EXITS {
        let delay = DELAYS_MS[(i % 2) as usize] + i / 2 * 3;
        let out = Command::new(&exe)
            .args(["--exact", child_test, "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD, delay.to_string())
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "exit {i} of {child_test} ({delay} ms) failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(stdout.contains("1 passed"), "the child test did not run:\n{stdout}");
        let left = stderr.lines().find_map(|l| l.strip_prefix(AT_EXIT));
        assert_eq!(
            left,
            Some("0"),
            "exit {i} ({delay} ms): progress threads still running as libucs went down:\n{stderr}"
        );
    }
}

#[test]
fn exit_right_after_ucx_tcp_transfers() {
    exits_cleanly(Kind::Ucx("tcp"), "child::ucx_tcp_then_exit");
}

#[test]
fn exit_right_after_ucx_shared_memory_transfers() {
    exits_cleanly(Kind::Striped(Box::new(Kind::Ucx("sm,self")), 3), "child::ucx_shm_striped_then_exit");
}

/// Run only as children of the tests above: a transfer whose transports are dropped, transports that are
/// never dropped, then an exit `TANDEM_EXIT_TEST_CHILD` ms later.
mod child {
    use super::*;

    extern "C" fn report() {
        eprintln!("{AT_EXIT}{}", kv_transfer::transport::ucx::progress_threads());
    }

    fn run(kind: Kind) {
        let delay: u64 = std::env::var(CHILD)
            .ok()
            .and_then(|v| v.parse().ok())
            .expect("a child of the exit tests: run through them");
        // Registered before any UCX node starts, so it runs after the transport's exit handler.
        // SAFETY: registering a plain extern "C" function.
        assert_eq!(unsafe { libc::atexit(report) }, 0);
        let live = pair(&kind, Opts::default()).expect("UCX");
        cases::completes_with_partial_last_block(&kind);
        std::mem::forget(live);
        std::thread::sleep(std::time::Duration::from_millis(delay));
    }

    #[test]
    #[ignore = "a child process of the exit tests"]
    fn ucx_tcp_then_exit() {
        run(Kind::Ucx("tcp"));
    }

    #[test]
    #[ignore = "a child process of the exit tests"]
    fn ucx_shm_striped_then_exit() {
        run(Kind::Striped(Box::new(Kind::Ucx("sm,self")), 3));
    }
}
