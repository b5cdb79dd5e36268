//! Fuzzing the engine's file formats through the entry points workers use: `config.json`
//! (`ModelConfig::from_json_str` and its validation, then what is derived from it), and safetensors
//! shards (`Checkpoint::open` and `tandem verify`'s `verify`) with arbitrary or mutated headers, claimed
//! header lengths and data sizes. Every input ends in a value or an error: no panic, and no allocation
//! sized by a number in the file. Bounded by `fuzzing::config` (`TANDEM_FUZZ_CASES`, scripts/fuzz.sh).

use std::path::Path;

use engine::ModelConfig;
use engine::checkpoint::Checkpoint;
use proptest::prelude::*;
use serde_json::{Value, json};

const CASES: u32 = 256;

/// Everything a worker derives from an accepted config before it allocates.
fn use_config(cfg: &ModelConfig) {
    let _ = (cfg.entry_dims(), cfg.num_cache_layers(), cfg.num_served_mtp_layers(), cfg.num_checkpoint_layers());
    let _ = (cfg.qk_head_dim(), cfg.softmax_scale(), cfg.index_softmax_scale());
    for l in 0..cfg.num_checkpoint_layers().min(8) {
        let _ = cfg.is_moe_layer(l);
    }
    let specs = engine::checkpoint::names::expected_tensors(cfg);
    assert!(!specs.is_empty());
}

#[test]
fn config_json_is_parsed_or_refused_with_the_field_named() {
    let base = engine::tiny::config_json(1280);
    fuzzing::run(CASES, "config.json mutated", fuzzing::json::mutated(base, 4), |v| {
        match ModelConfig::from_json_str(&v.to_string()) {
            Ok(cfg) => use_config(&cfg),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    });
    fuzzing::run(CASES, "config.json bytes", fuzzing::bytes(2048), |b| {
        if let Ok(cfg) = ModelConfig::from_json_str(&String::from_utf8_lossy(&b)) {
            use_config(&cfg);
        }
        Ok(())
    });
}

/// A small, valid safetensors header for the seed of the mutations.
fn header_seed() -> Value {
    json!({
        "__metadata__": {"format": "pt"},
        "model.embed_tokens.weight": {"dtype": "BF16", "shape": [4, 2], "data_offsets": [0, 16]},
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [16, 20]},
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": {"dtype": "F32", "shape": [1, 1], "data_offsets": [20, 24]}
    })
}

/// How the header's length prefix is written: true, or a lie.
#[derive(Debug, Clone)]
enum Claim {
    Exact,
    Edge(u64),
    Off(i64),
}

fn claim() -> impl Strategy<Value = Claim> {
    prop_oneof![
        4 => Just(Claim::Exact),
        1 => proptest::sample::select(vec![0, 1, 7, 8, 1 << 20, 100 << 20, (100 << 20) + 1, u32::MAX as u64, 1 << 40, u64::MAX])
            .prop_map(Claim::Edge),
        1 => (-16i64..16).prop_map(Claim::Off),
    ]
}

fn shard_bytes(header: &[u8], claim: &Claim, data: usize) -> Vec<u8> {
    let n = match claim {
        Claim::Exact => header.len() as u64,
        Claim::Edge(n) => *n,
        Claim::Off(d) => (header.len() as i64 + d).max(0) as u64,
    };
    let mut out = n.to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend((0..data).map(|i| i as u8));
    out
}

fn open_and_verify(dir: &Path) -> Result<(), TestCaseError> {
    match Checkpoint::open(dir) {
        Ok(c) => {
            for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] {
                if let Some(t) = c.get(name) {
                    let _ = t.to_f32();
                }
            }
        }
        Err(e) => prop_assert!(!e.to_string().is_empty()),
    }
    let report = engine::checkpoint::verify::verify(dir, None);
    prop_assert!(report.is_ok() || dir.join("model.safetensors.index.json").exists(), "{report:?}");
    Ok(())
}

#[test]
fn safetensors_headers_are_parsed_or_refused_without_trusting_their_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let config = engine::tiny::config_json(1280);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let shard = dir.path().join("model.safetensors");
    let header = (fuzzing::json::mutated(header_seed(), 4), claim(), 0usize..64);
    fuzzing::run(CASES, "safetensors mutated header", header, |(h, claim, data)| {
        std::fs::write(&shard, shard_bytes(h.to_string().as_bytes(), &claim, data)).unwrap();
        open_and_verify(dir.path())
    });
    fuzzing::run(CASES, "safetensors bytes", (fuzzing::bytes(1024), claim()), |(b, claim)| {
        std::fs::write(&shard, shard_bytes(&b, &claim, 0)).unwrap();
        open_and_verify(dir.path())
    });
    // The index: names a shard per tensor, and must not point outside the directory.
    let index = dir.path().join("model.safetensors.index.json");
    let seed = json!({"metadata": {"total_size": 24}, "weight_map": {
        "model.embed_tokens.weight": "model.safetensors",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "model.safetensors"}});
    std::fs::write(&shard, shard_bytes(header_seed().to_string().as_bytes(), &Claim::Exact, 24)).unwrap();
    fuzzing::run(CASES, "safetensors index", fuzzing::json::mutated(seed, 3), |v| {
        std::fs::write(&index, v.to_string()).unwrap();
        open_and_verify(dir.path())
    });
}

/// A config.json whose sizes would make the loader list (and allocate for) billions of tensors or
/// cache entries is refused by the config, before anything is sized by it.
#[test]
fn a_config_with_absurd_sizes_is_refused_before_anything_is_allocated() {
    for (field, value) in [
        ("num_hidden_layers", json!(1u64 << 40)),
        ("num_nextn_predict_layers", json!(1u64 << 40)),
        ("n_routed_experts", json!(1u64 << 40)),
        ("vocab_size", json!(1u64 << 40)),
        ("hidden_size", json!(1u64 << 40)),
        ("num_attention_heads", json!(1u64 << 40)),
        ("max_position_embeddings", json!(u64::MAX)),
        ("index_topk", json!(1e300)),
    ] {
        let mut v = engine::tiny::config_json(1280);
        v[field] = value;
        let e = ModelConfig::from_json(&v).expect_err(field).to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    let mut v = engine::tiny::config_json(1280);
    (v["num_hidden_layers"], v["n_routed_experts"], v["n_group"]) = (json!(1000), json!(60000), json!(1));
    let e = ModelConfig::from_json(&v).expect_err("layers x experts").to_string();
    assert!(e.contains("layers x"), "{e}");
}
