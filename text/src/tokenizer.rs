//! A checkpoint's tokenizer: `tokenizer.json` (Hugging Face `tokenizers`) plus the special tokens of
//! `tokenizer_config.json`.

use std::collections::HashMap;
use std::path::Path;

use crate::{TextError, TokenizerConfig};

/// Tokenizer of one served model. Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    /// GPT-2 byte-level vocabularies store bytes as printable chars; this maps them back.
    byte_decoder: Option<HashMap<char, u8>>,
}

/// The GPT-2 `bytes_to_unicode` table: byte -> the printable char a byte-level vocabulary uses for it.
fn byte_level_chars() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut extra = 0u32;
    for b in 0u32..256 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

impl Tokenizer {
    /// Loads `tokenizer.json` and (optionally) `tokenizer_config.json` from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(TextError::Io {
                path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TextError::Parse { path: path.clone(), message: e.to_string() })?;
        let config = TokenizerConfig::load(&dir.join("tokenizer_config.json"))?;
        Ok(Self::from_parts(inner, config))
    }

    /// Wraps an already built tokenizer (e.g. [`crate::tiny::tokenizer`]).
    pub fn from_parts(inner: tokenizers::Tokenizer, config: TokenizerConfig) -> Self {
        let bos_id = config.bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_id = config.eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|s| s.contains("\"ByteLevel\""));
        let byte_decoder = byte_level.then(byte_level_chars);
        Self { inner, config, bos_id, eos_id, byte_decoder }
    }

    /// Extends the vocabulary to `size` ids with placeholder tokens `<|t{id}|>` (ordinary added tokens, decoded
    /// as their text): a tokenizer for a model whose vocabulary is larger than this one's (a synthetic model
    /// served with the tiny tokenizer), so that every id the model can produce has text.
    pub fn with_placeholders(mut self, size: usize) -> Result<Self, TextError> {
        let have = self.inner.get_vocab_size(true);
        if size > have {
            let extra: Vec<tokenizers::AddedToken> =
                (have..size).map(|id| tokenizers::AddedToken::from(format!("<|t{id}|>"), false)).collect();
            self.inner.add_tokens(extra).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        }
        let got = self.inner.get_vocab_size(true);
        if got < size || (size > have && self.inner.token_to_id(&format!("<|t{have}|>")) != Some(have as u32)) {
            return Err(TextError::Tokenizer(format!("placeholders for ids {have}..{size} did not take those ids")));
        }
        Ok(self)
    }

    /// Encodes a plain prompt the way Hugging Face does for `tokenizer(text)`: with the tokenizer's own
    /// special tokens (post-processor), e.g. a leading BOS.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = self.encode(text, true)?;
        // Some tokenizer.json files have no post-processor but ask for BOS in tokenizer_config.json.
        if self.config.add_bos_token == Some(true)
            && let Some(bos) = self.bos_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Encodes text; `add_special_tokens` runs the post-processor (rendered chat prompts pass false: the
    /// template already wrote BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// Whether tokens are byte-level (GPT-2 style): their text never depends on left context.
    pub fn is_byte_level(&self) -> bool {
        self.byte_decoder.is_some()
    }

    /// Vocabulary size including added tokens: every valid id is below it.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.config.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.config.eos_token.as_deref()
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The raw bytes one token stands for (what OpenAI's logprobs `bytes` field reports). For byte-level
    /// vocabularies a token may be part of a UTF-8 character; other tokenizers decode the token alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else { return Vec::new() };
        if self.inner.get_added_tokens_decoder().contains_key(&id) {
            return piece.into_bytes();
        }
        if let Some(map) = &self.byte_decoder
            && let Some(bytes) = piece.chars().map(|c| map.get(&c).copied()).collect::<Option<Vec<u8>>>()
        {
            return bytes;
        }
        self.inner.decode(&[id], false).map(String::into_bytes).unwrap_or_default()
    }

    /// A token's text for logprobs: its bytes as UTF-8, or `bytes:\xNN...` when they are not valid
    /// UTF-8 on their own (the OpenAI convention).
    pub fn token_text(&self, id: u32) -> String {
        let bytes = self.token_bytes(id);
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => {
                let mut s = String::from("bytes:");
                for b in e.as_bytes() {
                    s.push_str(&format!("\\x{b:02x}"));
                }
                s
            }
        }
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::test_tokenizer;

    #[test]
    fn byte_level_table_covers_all_bytes() {
        let m = byte_level_chars();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'A'], b'A');
    }

    #[test]
    fn placeholders_give_every_id_of_a_larger_vocabulary_text() {
        let start = std::time::Instant::now();
        let t = test_tokenizer().with_placeholders(129_280).unwrap();
        let built = start.elapsed();
        assert_eq!(t.vocab_size(), 129_280);
        assert_eq!(t.decode(&[1280], true).unwrap(), "<|t1280|>");
        assert_eq!(t.decode(&[129_279], true).unwrap(), "<|t129279|>");
        // The tiny vocabulary is unchanged: prompts encode and decode as before.
        let ids = t.encode_prompt("Hello world").unwrap();
        assert!(ids.iter().all(|&i| i < 1280), "{ids:?}");
        assert_eq!(t.decode(&ids, true).unwrap(), "Hello world");
        println!("placeholders for 128000 ids added in {built:?}");
        // A size within the vocabulary adds nothing.
        assert_eq!(test_tokenizer().with_placeholders(10).unwrap().vocab_size(), 1280);
    }

    #[test]
    fn plain_prompts_start_with_bos_and_round_trip() {
        let t = test_tokenizer();
        let ids = t.encode_prompt("Hello world, héllo ✓").unwrap();
        assert_eq!(ids[0], 0, "BOS has id 0");
        assert_eq!(t.decode(&ids, true).unwrap(), "Hello world, héllo ✓");
    }

    #[test]
    fn token_bytes_concatenate_to_the_text() {
        let t = test_tokenizer();
        let text = "naïve café ✓ 日本";
        let ids = t.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i)).collect();
        assert_eq!(bytes, text.as_bytes());
        assert_eq!(t.token_text(1), "<｜end▁of▁sentence｜>");
        assert_eq!(t.eos_id(), Some(1));
    }
}
