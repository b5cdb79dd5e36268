//! Deterministic faults for the cross-process tests: `TANDEM_KV_FAULT` makes a sender kill its own process
//! or stall its shipping right after a given layer's bytes were flushed to the receiver.
//!
//! - `kill_after_layer:N`: SIGKILL this process once layer N landed (the receiver sees a dead peer with a
//!   partially written request).
//! - `stall_after_layer:N:MSms`: the shipping thread sleeps MS milliseconds after layer N landed (a hung
//!   prefill: deadlines expire, aborts arrive mid-transfer).
//! - `stall_once_after_layer:N:MSms`: the same, for the first transfer of this process only (holds one
//!   request mid-transfer; the later ones run normally).
//!
//! Only builds with the `fault-injection` feature honour the variable (every `cargo test` build has it);
//! other builds log that they ignore it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub const FAULT_ENV: &str = "TANDEM_KV_FAULT";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    KillAfterLayer(u32),
    StallAfterLayer(u32, Duration),
    StallOnceAfterLayer(u32, Duration),
}

/// Whether a `StallOnceAfterLayer` fired in this process.
static STALLED_ONCE: AtomicBool = AtomicBool::new(false);

impl Fault {
    pub fn parse(s: &str) -> Result<Fault, String> {
        let parts: Vec<&str> = s.trim().split(':').collect();
        let layer = |p: &str| p.parse::<u32>().map_err(|_| format!("{FAULT_ENV}: bad layer {p:?} in {s:?}"));
        match parts.as_slice() {
            ["kill_after_layer", l] => Ok(Fault::KillAfterLayer(layer(l)?)),
            [kind @ ("stall_after_layer" | "stall_once_after_layer"), l, d] => {
                let ms = d.strip_suffix("ms").unwrap_or(d);
                let ms = ms.parse::<u64>().map_err(|_| format!("{FAULT_ENV}: bad duration {d:?} in {s:?}"))?;
                let (l, d) = (layer(l)?, Duration::from_millis(ms));
                Ok(if *kind == "stall_after_layer" {
                    Fault::StallAfterLayer(l, d)
                } else {
                    Fault::StallOnceAfterLayer(l, d)
                })
            }
            _ => Err(format!(
                "{FAULT_ENV}={s:?}: expected kill_after_layer:N, stall_after_layer:N:MSms or stall_once_after_layer:N:MSms"
            )),
        }
    }

    /// The fault configured in the environment, if this build honours it.
    pub fn from_env() -> Result<Option<Fault>, String> {
        let Ok(v) = std::env::var(FAULT_ENV) else { return Ok(None) };
        if v.is_empty() {
            return Ok(None);
        }
        if cfg!(feature = "fault-injection") {
            let f = Fault::parse(&v)?;
            tracing::warn!(fault = ?f, "kv-transfer fault injection armed");
            Ok(Some(f))
        } else {
            tracing::warn!("{FAULT_ENV} is set but this build has no fault injection; ignored");
            Ok(None)
        }
    }

    pub fn layer(&self) -> u32 {
        match *self {
            Fault::KillAfterLayer(l) | Fault::StallAfterLayer(l, _) | Fault::StallOnceAfterLayer(l, _) => l,
        }
    }

    /// Runs the fault (called after `layer` was flushed).
    pub(crate) fn fire(&self, request_id: &str) {
        match *self {
            Fault::KillAfterLayer(l) => {
                tracing::warn!(request_id, layer = l, "fault injection: killing this process");
                // SAFETY: plain syscalls; SIGKILL cannot be caught, exactly like `kill -9`.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
            Fault::StallAfterLayer(l, d) => {
                tracing::warn!(request_id, layer = l, ms = d.as_millis() as u64, "fault injection: stalling");
                std::thread::sleep(d);
            }
            Fault::StallOnceAfterLayer(l, d) => {
                if !STALLED_ONCE.swap(true, Ordering::Relaxed) {
                    Fault::StallAfterLayer(l, d).fire(request_id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_faults_and_rejects_garbage() {
        assert_eq!(Fault::parse("kill_after_layer:3"), Ok(Fault::KillAfterLayer(3)));
        assert_eq!(
            Fault::parse("stall_after_layer:3:5000ms"),
            Ok(Fault::StallAfterLayer(3, Duration::from_millis(5000)))
        );
        assert_eq!(Fault::parse("stall_after_layer:0:20"), Ok(Fault::StallAfterLayer(0, Duration::from_millis(20))));
        assert_eq!(
            Fault::parse("stall_once_after_layer:1:3000ms"),
            Ok(Fault::StallOnceAfterLayer(1, Duration::from_millis(3000)))
        );
        for bad in ["", "kill", "kill_after_layer:x", "stall_after_layer:1", "stall_after_layer:1:fast", "boom:1"] {
            assert!(Fault::parse(bad).is_err(), "{bad:?}");
        }
    }
}
