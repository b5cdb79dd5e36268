//! The requests a benchmark sends: prompt and output lengths drawn like SGLang's `random` dataset
//! (uniform in `[len * ratio, len]`) or fixed, with random content so no two prompts share a prefix.

use rand::RngExt;
use rand::rngs::StdRng;

/// Lowest token id in random prompts: keeps clear of the special tokens every DeepSeek tokenizer
/// (and the tiny one) puts at the bottom of the vocabulary.
pub const TOKEN_ID_FLOOR: u32 = 100;

/// Common words for chat prompts, which must be text (about one token each with a BPE tokenizer).
const WORDS: [&str; 48] = [
    "the", "time", "people", "year", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company",
    "system", "program", "question", "work", "number", "night", "point", "home", "water", "room", "mother", "area",
    "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word",
];

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatasetKind {
    /// Lengths uniform in [len * random-range-ratio, len].
    Random,
    /// Every request exactly input-len / output-len tokens.
    Fixed,
}

impl DatasetKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Fixed => "fixed",
        }
    }
}

pub enum Prompt {
    /// Token ids for /v1/completions: the input length is exact.
    Tokens(Vec<u32>),
    /// Text for chat: the server's tokenizer decides the exact length (reported back in `usage`).
    Text(String),
}

pub struct Row {
    pub prompt: Prompt,
    /// Requested input length in tokens (for text prompts, in words).
    pub prompt_len: usize,
    pub output_len: usize,
}

pub struct Spec {
    pub kind: DatasetKind,
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    pub vocab_size: u32,
    /// Text prompts (chat) instead of token ids.
    pub text: bool,
}

impl Spec {
    fn lengths(&self, rng: &mut StdRng) -> (usize, usize) {
        let draw = |rng: &mut StdRng, len: usize| match self.kind {
            DatasetKind::Fixed => len,
            // SGLang's bounds, except that the output gets at least one token too (max_tokens=0 is an error).
            DatasetKind::Random => rng.random_range(((len as f64 * self.range_ratio) as usize).max(1)..=len),
        };
        let input = draw(rng, self.input_len);
        (input, draw(rng, self.output_len))
    }

    pub fn generate(&self, n: usize, rng: &mut StdRng) -> Vec<Row> {
        (0..n)
            .map(|_| {
                let (prompt_len, output_len) = self.lengths(rng);
                let prompt = if self.text {
                    let words: Vec<&str> = (0..prompt_len).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
                    Prompt::Text(words.join(" "))
                } else {
                    Prompt::Tokens((0..prompt_len).map(|_| rng.random_range(TOKEN_ID_FLOOR..self.vocab_size)).collect())
                };
                Row { prompt, prompt_len, output_len }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn spec(kind: DatasetKind, text: bool) -> Spec {
        Spec { kind, input_len: 200, output_len: 50, range_ratio: 0.5, vocab_size: 1000, text }
    }

    #[test]
    fn random_lengths_stay_within_ratio_bounds_and_token_ids_in_range() {
        let rows = spec(DatasetKind::Random, false).generate(500, &mut StdRng::seed_from_u64(1));
        assert!(rows.iter().all(|r| (100..=200).contains(&r.prompt_len) && (25..=50).contains(&r.output_len)));
        assert!(rows.iter().any(|r| r.prompt_len < 150) && rows.iter().any(|r| r.prompt_len > 150));
        for r in &rows {
            let Prompt::Tokens(ids) = &r.prompt else { panic!("token prompt expected") };
            assert_eq!(ids.len(), r.prompt_len);
            assert!(ids.iter().all(|&t| (TOKEN_ID_FLOOR..1000).contains(&t)));
        }
    }

    #[test]
    fn fixed_lengths_are_exact_and_text_prompts_have_that_many_words() {
        let rows = spec(DatasetKind::Fixed, true).generate(20, &mut StdRng::seed_from_u64(2));
        for r in &rows {
            assert_eq!((r.prompt_len, r.output_len), (200, 50));
            let Prompt::Text(t) = &r.prompt else { panic!("text prompt expected") };
            assert_eq!(t.split(' ').count(), 200);
        }
    }

    #[test]
    fn same_seed_gives_the_same_requests() {
        let ids = |seed| {
            spec(DatasetKind::Random, false)
                .generate(5, &mut StdRng::seed_from_u64(seed))
                .into_iter()
                .map(|r| match r.prompt {
                    Prompt::Tokens(t) => t,
                    Prompt::Text(_) => unreachable!(),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(7), ids(7));
        assert_ne!(ids(7), ids(8));
    }
}
