//! Stage 1: pick a prefill/decode pair. Both must be healthy, not draining, breaker closed (or half-open
//! with its trial free), serve the router's model (the fingerprint's served name), and have compatible
//! fingerprints (`ModelFingerprint::check_compatible`, the rule kv-transfer enforces).

use std::collections::HashSet;
use std::sync::Arc;

use proto::v1::WorkerRole;

use super::Dispatcher;
use crate::policies::{Candidate, Request};
use crate::workers::WorkerHandle;

pub struct Pair {
    pub prefill: Arc<WorkerHandle>,
    pub decode: Arc<WorkerHandle>,
}

fn eligible(w: &WorkerHandle, model: &str) -> bool {
    w.is_healthy()
        && !w.is_draining()
        && w.fingerprint().is_some_and(|f| f.model_name == model)
        && w.breaker.available()
}

/// Whether the two workers' caches are interchangeable bytes (both fingerprints known and compatible).
fn compatible(a: &WorkerHandle, b: &WorkerHandle) -> bool {
    a.fingerprint().zip(b.fingerprint()).is_some_and(|(a, b)| a.is_compatible(&b))
}

/// Whether the worker accepts a sequence of `len` tokens (unknown limits accept: the worker decides).
fn fits(w: &WorkerHandle, len: usize) -> bool {
    w.max_model_len().is_none_or(|m| len <= m as usize)
}

/// The longest sequence (prompt + output) some prefill/decode pair of `model` accepts: the configured
/// limit capped by what the workers report, so defaults and validation never promise more than a
/// worker's cache pool holds.
pub fn context_limit(d: &Dispatcher, configured: u32) -> u32 {
    let model = d.model.name.as_str();
    let all = d.pool.snapshot();
    let role_max = |role: WorkerRole| {
        all.iter()
            .filter(|w| w.role == role && w.fingerprint().is_some_and(|f| f.model_name == model))
            .filter_map(|w| w.max_model_len())
            .max()
    };
    [role_max(WorkerRole::Prefill), role_max(WorkerRole::Decode)].into_iter().flatten().fold(configured, u32::min)
}

/// Err explains why no pair exists (for the 503/429 message). `seq_len` is prompt + output: workers
/// whose context is shorter are skipped.
pub fn pair(
    d: &Dispatcher,
    hashes: &[u64],
    prompt_tokens: usize,
    seq_len: usize,
    excluded_prefill: &HashSet<String>,
    excluded_decode: &HashSet<String>,
) -> Result<Pair, String> {
    let model = d.model.name.as_str();
    let all = d.pool.snapshot();
    let decodes: Vec<&Arc<WorkerHandle>> = all
        .iter()
        .filter(|w| w.role == WorkerRole::Decode && !excluded_decode.contains(&w.id) && eligible(w, model))
        .filter(|w| fits(w, seq_len))
        .collect();
    let usable_prefills: Vec<&Arc<WorkerHandle>> = all
        .iter()
        .filter(|w| w.role == WorkerRole::Prefill && !excluded_prefill.contains(&w.id) && eligible(w, model))
        .filter(|w| fits(w, seq_len))
        .collect();
    let usable = usable_prefills.len();
    if usable == 0 || decodes.is_empty() {
        return Err(explain(&all, model, usable, decodes.len()));
    }
    let prefills: Vec<&Arc<WorkerHandle>> =
        usable_prefills.into_iter().filter(|p| decodes.iter().any(|d| compatible(p, d))).collect();
    if prefills.is_empty() {
        return Err(format!(
            "No prefill/decode pair can serve model `{model}` now: {usable} prefill and {} decode workers are usable, but no prefill worker has the same model fingerprint as a decode worker (checkpoint, precision, block size, layer count or kv-transfer protocol version differ)",
            decodes.len()
        ));
    }
    let req = Request { prefix_hashes: hashes, prompt_tokens };
    let cands: Vec<&dyn Candidate> = prefills.iter().map(|w| w.as_ref() as &dyn Candidate).collect();
    let p =
        d.prefill_policy.select(&cands, &req).and_then(|i| prefills.get(i)).ok_or("prefill policy chose nothing")?;
    let matching: Vec<&Arc<WorkerHandle>> = decodes.into_iter().filter(|d| compatible(p, d)).collect();
    let cands: Vec<&dyn Candidate> = matching.iter().map(|w| w.as_ref() as &dyn Candidate).collect();
    let dec =
        d.decode_policy.select(&cands, &req).and_then(|i| matching.get(i)).ok_or("decode policy chose nothing")?;
    Ok(Pair { prefill: (*p).clone(), decode: (*dec).clone() })
}

fn explain(all: &[Arc<WorkerHandle>], model: &str, prefills: usize, decodes: usize) -> String {
    let count = |role| all.iter().filter(|w| w.role == role).count();
    let others: HashSet<String> =
        all.iter().filter_map(|w| w.fingerprint()).map(|f| f.model_name).filter(|m| m != model).collect();
    let mut s = format!(
        "No prefill/decode pair can serve model `{model}` now: {prefills} of {} prefill and {decodes} of {} decode workers are usable (healthy, not draining, same model fingerprint)",
        count(WorkerRole::Prefill),
        count(WorkerRole::Decode)
    );
    if !others.is_empty() {
        let mut v: Vec<String> = others.into_iter().collect();
        v.sort();
        s.push_str(&format!("; workers registered for other models: {}", v.join(", ")));
    }
    s
}
