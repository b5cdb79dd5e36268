//! The text side of a request, shared by the router and `tandem generate`: tokenizer loading, chat
//! templating, incremental detokenization and stop strings. Workers only ever see token ids.
//!
//! - [`Tokenizer`]: `tokenizer.json` + `tokenizer_config.json` from a checkpoint directory, with the
//!   special tokens and the per-token bytes that logprobs report.
//! - [`ChatTemplate`]: the checkpoint's Jinja chat template (minijinja with Python string methods), a
//!   `--chat-template FILE` override, or the built-in DeepSeek-V3 conversation format.
//! - [`IncrementalDetokenizer`]: token ids in, text deltas out; never emits a split UTF-8 character.
//! - [`StopMatcher`]: stop strings matched across token boundaries, with hold-back and trimming.
//! - [`tiny`]: the small deterministic byte-level BPE tokenizer written into generated test checkpoints.

mod chat;
mod detok;
mod error;
mod stop;
pub mod tiny;
mod tokenizer;
mod tokenizer_config;

pub use chat::{ChatTemplate, ChatTemplateSource, DEEPSEEK_V3_TEMPLATE};
pub use detok::IncrementalDetokenizer;
pub use error::TextError;
pub use stop::{StopMatcher, StopOutcome};
pub use tokenizer::Tokenizer;
pub use tokenizer_config::TokenizerConfig;
