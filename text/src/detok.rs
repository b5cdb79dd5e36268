//! Incremental detokenization: the text of each new token without ever emitting half a UTF-8 character.
//!
//! Decoding tokens one by one is wrong for byte-level vocabularies (a character can span tokens) and
//! for SentencePiece (leading spaces depend on context). As vLLM and TGI do, we decode a short window
//! twice, `[prefix..read)` and `[prefix..end)`, and emit the difference once it no longer ends in the
//! replacement character U+FFFD.

use crate::{TextError, Tokenizer};

/// Prompt tokens kept as left context, so the first output token decodes with the right spacing.
const CONTEXT_TOKENS: usize = 5;

pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    /// Nothing decoded yet: the prompt context is still in `ids`.
    fresh: bool,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// `prompt` supplies left context only; its text is never emitted.
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let start = prompt.len().saturating_sub(CONTEXT_TOKENS);
        let ids = prompt[start..].to_vec();
        let n = ids.len();
        Self { ids, fresh: true, prefix_offset: 0, read_offset: n, skip_special_tokens }
    }

    /// Adds one generated token and returns the text it completes (possibly empty, while a character
    /// is still incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        if std::mem::take(&mut self.fresh) && tok.is_byte_level() {
            // Byte-level text needs no left context, and context ending inside a character would merge
            // with the first output bytes: the output must be exactly decode(output ids).
            self.ids.clear();
            self.read_offset = 0;
        }
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = match full.get(prefix.len()..) {
            Some(d) if full.starts_with(&prefix) => d.to_owned(),
            // A decoder that rewrote the window's start (rare cleanup rules): emit what is new by chars.
            _ => full.chars().skip(prefix.chars().count()).collect(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the buffer short: only the window is ever decoded.
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        Ok(delta)
    }

    /// Text still held back at the end of the request (an incomplete character at EOS), decoded
    /// lossily so nothing is silently dropped.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TextError> {
        if self.read_offset >= self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::test_tokenizer;

    #[test]
    fn deltas_concatenate_to_the_full_text_and_never_split_a_character() {
        let t = test_tokenizer();
        let text = "Grüße, 世界! 🦀 crab emoji and ✓ marks: café.";
        let prompt = t.encode_prompt("Say it:").unwrap();
        let ids = t.encode(text, false).unwrap();
        // Multi-byte characters the tiny vocabulary never merged span several byte tokens.
        assert!(ids.len() > text.chars().count() / 2);
        let mut d = IncrementalDetokenizer::new(&prompt, true);
        let mut out = String::new();
        for &id in &ids {
            let delta = d.push(&t, id).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "split character emitted: {delta:?}");
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&t).unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn output_text_equals_decoding_the_output_even_after_a_prompt_ending_mid_character() {
        let t = test_tokenizer();
        let euro = t.encode("€uro", false).unwrap();
        assert!(euro.len() > 2, "the tiny vocabulary splits € into byte tokens");
        // The prompt ends with the first byte of €; the output starts with its remaining bytes.
        let mut prompt = t.encode_prompt("price:").unwrap();
        prompt.push(euro[0]);
        let output = &euro[1..];
        let mut d = IncrementalDetokenizer::new(&prompt, true);
        let mut out = String::new();
        for &id in output {
            out.push_str(&d.push(&t, id).unwrap());
        }
        out.push_str(&d.flush(&t).unwrap());
        assert_eq!(out, t.decode(output, true).unwrap());
    }

    #[test]
    fn special_tokens_are_skipped_or_kept_on_request() {
        let t = test_tokenizer();
        let mut ids = t.encode("done", false).unwrap();
        ids.push(1);
        let run = |skip| {
            let mut d = IncrementalDetokenizer::new(&[], skip);
            ids.iter().map(|&i| d.push(&t, i).unwrap()).collect::<String>()
        };
        assert_eq!(run(true), "done");
        assert_eq!(run(false), "done<｜end▁of▁sentence｜>");
    }

    #[test]
    fn a_lone_continuation_byte_is_flushed_lossily_at_the_end() {
        let t = test_tokenizer();
        let ids = t.encode("é", false).unwrap();
        let mut d = IncrementalDetokenizer::new(&[], true);
        let first = d.push(&t, ids[0]).unwrap();
        if ids.len() > 1 {
            assert_eq!(first, "", "half of é must be held back");
            assert_eq!(d.flush(&t).unwrap(), "\u{FFFD}");
        }
    }
}
