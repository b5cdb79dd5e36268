//! Fuzzing a checkpoint's tokenizer files through `Tokenizer::from_dir` (what the router and workers
//! load) and the chat template `tokenizer_config.json` carries (`ChatTemplate::resolve` + `render`):
//! mutated `tokenizer.json` / `tokenizer_config.json` and arbitrary bytes load or fail with an error,
//! and a tokenizer that loads encodes and decodes without panicking. Bounded by `fuzzing::config`
//! (`TANDEM_FUZZ_CASES`, scripts/fuzz.sh).

use std::path::Path;

use proptest::prelude::*;
use serde_json::{Value, json};
use text::{ChatTemplate, Tokenizer, TokenizerConfig};

const CASES: u32 = 128;

/// What serving does with a loaded tokenizer: encode prompts, decode and detokenize outputs, render
/// the chat template.
fn use_tokenizer(dir: &Path) -> Result<(), TestCaseError> {
    let tok = match Tokenizer::from_dir(dir) {
        Ok(t) => t,
        Err(e) => {
            prop_assert!(!e.to_string().is_empty());
            return Ok(());
        }
    };
    for text in ["Hello world!", "", "\u{0}\u{1F600} <|im_start|>"] {
        let _ = tok.encode(text, true);
        let _ = tok.encode_prompt(text);
    }
    let vocab = tok.vocab_size() as u32;
    let ids: Vec<u32> = [0, 1, 2, vocab / 2, vocab.saturating_sub(1), vocab, u32::MAX].to_vec();
    let _ = tok.decode(&ids, true);
    let _ = tok.decode(&ids, false);
    for &id in &ids {
        let _ = (tok.token_bytes(id), tok.token_text(id));
    }
    let mut detok = text::IncrementalDetokenizer::new(&ids[..2], true);
    for &id in &ids {
        let _ = detok.push(&tok, id);
    }
    let config = TokenizerConfig::load(&dir.join("tokenizer_config.json")).unwrap_or_default();
    if let Ok(t) = ChatTemplate::resolve(None, &config) {
        let msgs = vec![json!({"role": "user", "content": "Hi"}), json!({"role": "assistant", "content": "Hello"})];
        let _ = t.render(&msgs, true, &serde_json::Map::new());
    }
    Ok(())
}

fn seeds() -> (tempfile::TempDir, Value, Value) {
    let dir = tempfile::tempdir().unwrap();
    text::tiny::write_files(dir.path()).unwrap();
    let read = |n: &str| serde_json::from_str(&std::fs::read_to_string(dir.path().join(n)).unwrap()).unwrap();
    let (tok, cfg) = (read("tokenizer.json"), read("tokenizer_config.json"));
    (dir, tok, cfg)
}

#[test]
fn tokenizer_json_loads_or_fails_with_an_error() {
    let (dir, tok, _) = seeds();
    let path = dir.path().join("tokenizer.json");
    fuzzing::run(CASES, "tokenizer.json mutated", fuzzing::json::mutated(tok, 3), |v| {
        std::fs::write(&path, v.to_string()).unwrap();
        use_tokenizer(dir.path())
    });
    fuzzing::run(CASES, "tokenizer.json bytes", fuzzing::bytes(2048), |b| {
        std::fs::write(&path, b).unwrap();
        use_tokenizer(dir.path())
    });
}

#[test]
fn tokenizer_config_json_loads_or_fails_with_an_error() {
    let (dir, _, cfg) = seeds();
    let path = dir.path().join("tokenizer_config.json");
    fuzzing::run(CASES, "tokenizer_config.json mutated", fuzzing::json::mutated(cfg, 3), |v| {
        std::fs::write(&path, v.to_string()).unwrap();
        use_tokenizer(dir.path())
    });
}
