//! A deterministic hold for the cross-process fault tests: `TANDEM_PREFILL_FAULT=stall_first_batch:MSms`
//! makes the compute thread sleep MS milliseconds before this process's first prefill batch, so its first
//! request is held mid-prefill (and, with `--max-num-seqs 1`, later ones wait queued) while a test kills or
//! stops a process. It fires once, so the requests after it run normally.
//!
//! Only builds with the `fault-injection` feature honour the variable (the `tandem` crate's test builds
//! have it); other builds log that they ignore it.

use std::time::Duration;

pub const FAULT_ENV: &str = "TANDEM_PREFILL_FAULT";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    StallFirstBatch(Duration),
}

impl Fault {
    pub fn parse(s: &str) -> Result<Fault, String> {
        match s.trim().split(':').collect::<Vec<_>>().as_slice() {
            ["stall_first_batch", d] => {
                let ms = d.strip_suffix("ms").unwrap_or(d);
                let ms = ms.parse::<u64>().map_err(|_| format!("{FAULT_ENV}: bad duration {d:?} in {s:?}"))?;
                Ok(Fault::StallFirstBatch(Duration::from_millis(ms)))
            }
            _ => Err(format!("{FAULT_ENV}={s:?}: expected stall_first_batch:MSms")),
        }
    }

    /// The fault configured in the environment, if this build honours it.
    pub fn from_env() -> Result<Option<Fault>, String> {
        let v = std::env::var(FAULT_ENV).unwrap_or_default();
        if v.is_empty() {
            return Ok(None);
        }
        if cfg!(feature = "fault-injection") {
            let f = Fault::parse(&v)?;
            tracing::warn!(fault = ?f, "prefill fault injection armed");
            Ok(Some(f))
        } else {
            tracing::warn!("{FAULT_ENV} is set but this build has no fault injection; ignored");
            Ok(None)
        }
    }

    /// Runs the fault on the compute thread, before the first batch.
    pub(crate) fn fire(&self, request_ids: &[&str]) {
        match *self {
            Fault::StallFirstBatch(d) => {
                tracing::warn!(
                    ?request_ids,
                    ms = d.as_millis() as u64,
                    "prefill fault injection: stalling the first batch"
                );
                std::thread::sleep(d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_stall_and_rejects_garbage() {
        assert_eq!(Fault::parse("stall_first_batch:3000ms"), Ok(Fault::StallFirstBatch(Duration::from_millis(3000))));
        assert_eq!(Fault::parse("stall_first_batch:20"), Ok(Fault::StallFirstBatch(Duration::from_millis(20))));
        for bad in ["", "stall_first_batch", "stall_first_batch:soon", "kill_after_layer:1", "stall:1:2"] {
            assert!(Fault::parse(bad).is_err(), "{bad:?}");
        }
    }
}
