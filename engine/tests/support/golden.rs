//! The golden files `tests/golden/*/golden.safetensors` (scripts/hf_golden.py): for each sequence `i`, its
//! prompt `input_ids_i`, HF transformers' logits at every position `logits_i` and its greedy tokens
//! `greedy_i`. Read by the engine's golden tests and by `tandem generate`'s CLI test.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::path::Path;

pub struct Case {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

/// Every sequence of the golden file at `path`.
pub fn cases(path: &Path) -> Vec<Case> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let n = st.names().iter().filter(|n| n.starts_with("input_ids_")).count();
    assert!(n > 0, "{}: no sequences", path.display());
    (0..n)
        .map(|i| Case {
            ids: ints(&format!("input_ids_{i}")),
            logits: st
                .tensor(&format!("logits_{i}"))
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            greedy: ints(&format!("greedy_{i}")),
        })
        .collect()
}
