//! The tiny test tokenizer written into generated checkpoints (`tandem gen-tiny`): a byte-level BPE
//! trained on a small embedded corpus, deterministically (the same bytes on every run and machine),
//! with DeepSeek's special tokens at fixed ids so the chat template and EOS handling match a real
//! DeepSeek-V3 checkpoint.

use std::path::Path;

use serde_json::{Value, json};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use crate::TextError;

/// Special tokens in id order: id 0 is BOS, id 1 is EOS.
pub const SPECIAL_TOKENS: [&str; 7] = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
];
pub const BOS_ID: u32 = 0;
pub const EOS_ID: u32 = 1;
pub const PAD_ID: u32 = 2;

/// Requested vocabulary size; reached with merges of pairs seen at least once.
const TARGET_VOCAB: usize = 1280;
const CORPUS: &str = include_str!("tiny_corpus.txt");

/// Trains the tiny tokenizer (a few ms). Same output on every call.
pub fn tokenizer() -> Result<Tokenizer, TextError> {
    let specials = SPECIAL_TOKENS.iter().map(|s| AddedToken::from(*s, true)).collect();
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(TARGET_VOCAB)
        .min_frequency(1)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    let bos = SPECIAL_TOKENS[BOS_ID as usize];
    let post = TemplateProcessing::builder()
        .try_single(format!("{bos} $A"))
        .and_then(|b| b.try_pair(format!("{bos} $A $B")))
        .map_err(TextError::Train)?
        .special_tokens(vec![(bos, BOS_ID)])
        .build()
        .map_err(|e| TextError::Train(e.to_string()))?;
    tok.with_post_processor(Some(post));
    tok.train(&mut trainer, CORPUS.lines()).map_err(|e| TextError::Train(e.to_string()))?;
    Ok(tok)
}

/// `tokenizer_config.json` for the tiny checkpoint: DeepSeek's special tokens and chat template.
pub fn tokenizer_config_json() -> Value {
    json!({
        "add_bos_token": true,
        "add_eos_token": false,
        "bos_token": SPECIAL_TOKENS[BOS_ID as usize],
        "eos_token": SPECIAL_TOKENS[EOS_ID as usize],
        "pad_token": SPECIAL_TOKENS[PAD_ID as usize],
        "clean_up_tokenization_spaces": false,
        "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": crate::DEEPSEEK_V3_TEMPLATE,
    })
}

/// The tiny tokenizer with its config, as the crate's [`crate::Tokenizer`] (the crate's unit tests).
#[cfg(test)]
pub(crate) fn test_tokenizer() -> crate::Tokenizer {
    let cfg = crate::TokenizerConfig::from_value(tokenizer_config_json()).unwrap();
    crate::Tokenizer::from_parts(tokenizer().unwrap(), cfg)
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (which must exist).
pub fn write_files(dir: &Path) -> Result<(), TextError> {
    let tok = tokenizer()?;
    let json = tok.to_string(true).map_err(|e| TextError::Train(e.to_string()))?;
    let write = |name: &str, body: String| {
        let path = dir.join(name);
        std::fs::write(&path, body).map_err(|source| TextError::Io { path, source })
    };
    write("tokenizer.json", json)?;
    let cfg = serde_json::to_string_pretty(&tokenizer_config_json()).map_err(|e| TextError::Train(e.to_string()))?;
    write("tokenizer_config.json", cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_is_deterministic_byte_for_byte() {
        let a = tokenizer().unwrap().to_string(false).unwrap();
        let b = tokenizer().unwrap().to_string(false).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn special_tokens_have_fixed_ids_and_vocab_is_in_range() {
        let t = tokenizer().unwrap();
        for (id, s) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(t.token_to_id(s), Some(id as u32), "{s}");
        }
        let n = t.get_vocab_size(true);
        assert!((1000..=2000).contains(&n), "vocab size {n}");
        // Special tokens are matched whole inside text, not split into bytes.
        let ids = t.encode("<｜User｜>hi<｜Assistant｜>", false).unwrap();
        assert_eq!(ids.get_ids()[0], 3);
        assert_eq!(*ids.get_ids().last().unwrap(), 4);
    }

    #[test]
    fn any_text_round_trips_through_bytes() {
        let t = tokenizer().unwrap();
        let text = "Zebra-crossing ✗ 🦀 tab\tnew\nline 12345";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(ids.get_ids(), false).unwrap(), text);
        let with_bos = t.encode(text, true).unwrap();
        assert_eq!(with_bos.get_ids()[0], BOS_ID);
    }

    #[test]
    fn written_files_load_back_with_the_chat_template() {
        let dir = tempfile::tempdir().unwrap();
        write_files(dir.path()).unwrap();
        let tok = crate::Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_id(), Some(BOS_ID));
        assert_eq!(tok.eos_id(), Some(EOS_ID));
        let tmpl = crate::ChatTemplate::resolve(None, tok.config()).unwrap();
        assert_eq!(tmpl.source(), &crate::ChatTemplateSource::Checkpoint);
        let msgs = [json!({"role": "user", "content": "hi"})];
        let prompt = tmpl.render(&msgs, true, &serde_json::Map::new()).unwrap();
        let ids = tok.encode(&prompt, false).unwrap();
        assert_eq!(ids[0], BOS_ID);
        assert_eq!(ids[1], 3);
        assert_eq!(*ids.last().unwrap(), 4);
    }
}
