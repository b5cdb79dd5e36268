//! The served model as the router knows it: name, context length, tokenizer and chat template, read as
//! plain files from the checkpoint directory (the router never links model code).

use std::path::Path;

use serde::Deserialize;
use text::{ChatTemplate, Tokenizer};

use crate::Args;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error(transparent)]
    Text(#[from] text::TextError),
}

/// The fields of config.json the router uses.
#[derive(Deserialize)]
struct ModelConfig {
    max_position_embeddings: Option<u32>,
}

pub struct ServedModel {
    pub name: String,
    pub max_model_len: u32,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
}

impl ServedModel {
    pub fn load(args: &Args) -> Result<Self, ModelError> {
        let dir = args.model.as_path();
        if let Some(spec) = dir.to_str().filter(|m| m.starts_with(SYNTHETIC)) {
            return Self::synthetic(args, spec);
        }
        let max_model_len = match args.max_model_len {
            Some(n) => n,
            None => read_max_position_embeddings(dir)?,
        };
        if max_model_len < 2 {
            return Err(ModelError::Config {
                path: "--max-model-len".into(),
                message: format!("must be at least 2 (got {max_model_len})"),
            });
        }
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::resolve(args.chat_template.as_deref(), tokenizer.config())?;
        let name = args.served_model_name.clone().unwrap_or_else(|| default_name(dir));
        Ok(Self { name, max_model_len, tokenizer, template })
    }
}

/// How a synthetic model (engine::synthetic, built by the workers from a seed) is named.
const SYNTHETIC: &str = "synthetic:";
/// Its context length (DeepSeek-V3.2's max_position_embeddings, for every preset).
const SYNTHETIC_CONTEXT: u32 = 163_840;

impl ServedModel {
    /// A synthetic model has no tokenizer of its own: the router reads and writes text with the embedded tiny
    /// model's (1280 tokens), extended with placeholder tokens `<|t{id}|>` up to the preset's vocabulary
    /// (`v32`: 129280), so every id the workers produce has text and every id they accept is valid. It is
    /// for measuring the serving path. The workers check the rest of the spec.
    fn synthetic(args: &Args, spec: &str) -> Result<Self, ModelError> {
        let bad = |message: String| ModelError::Config { path: spec.to_string(), message };
        let preset = spec[SYNTHETIC.len()..].split(',').next().unwrap_or("");
        let vocab = match preset {
            "v32" => 129_280,
            "tiny" => 1280,
            other => return Err(bad(format!("unknown synthetic preset `{other}` (v32 or tiny)"))),
        };
        let config = text::TokenizerConfig::from_value(text::tiny::tokenizer_config_json()).map_err(bad)?;
        let tokenizer = Tokenizer::from_parts(text::tiny::tokenizer()?, config).with_placeholders(vocab)?;
        let template = ChatTemplate::resolve(args.chat_template.as_deref(), tokenizer.config())?;
        let max_model_len = args.max_model_len.unwrap_or(SYNTHETIC_CONTEXT);
        if max_model_len < 2 {
            return Err(ModelError::Config {
                path: "--max-model-len".into(),
                message: format!("must be at least 2 (got {max_model_len})"),
            });
        }
        let name = args.served_model_name.clone().unwrap_or_else(|| spec.to_string());
        Ok(Self { name, max_model_len, tokenizer, template })
    }
}

fn read_max_position_embeddings(dir: &Path) -> Result<u32, ModelError> {
    let path = dir.join("config.json");
    let err = |message: String| ModelError::Config { path: path.display().to_string(), message };
    let bytes = std::fs::read(&path).map_err(|e| err(format!("{e} (pass --max-model-len to run without it)")))?;
    let cfg: ModelConfig = serde_json::from_slice(&bytes).map_err(|e| err(e.to_string()))?;
    cfg.max_position_embeddings.ok_or_else(|| err("no max_position_embeddings; pass --max-model-len".into()))
}

fn default_name(dir: &Path) -> String {
    let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    canon.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

#[cfg(test)]
impl ServedModel {
    /// The tiny tokenizer and the built-in template, for unit tests.
    pub fn for_tests() -> Self {
        let config = text::TokenizerConfig::from_value(text::tiny::tokenizer_config_json()).expect("tiny config");
        let tokenizer = Tokenizer::from_parts(text::tiny::tokenizer().expect("tiny tokenizer"), config);
        let template = ChatTemplate::resolve(None, tokenizer.config()).expect("template");
        Self { name: "tiny".into(), max_model_len: 512, tokenizer, template }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn load(model: &str, extra: &[&str]) -> Result<ServedModel, ModelError> {
        let argv =
            ["r", "--model", model, "--prefill", "p:1", "--decode", "d:2"].into_iter().chain(extra.iter().copied());
        ServedModel::load(&Cli::try_parse_from(argv).unwrap().args)
    }

    #[test]
    fn synthetic_models_get_the_tiny_tokenizer_over_their_whole_vocabulary() {
        let m = load("synthetic:v32,experts=32", &[]).unwrap();
        assert_eq!((m.name.as_str(), m.max_model_len), ("synthetic:v32,experts=32", 163_840));
        assert_eq!(m.tokenizer.vocab_size(), 129_280);
        assert_eq!(m.tokenizer.decode(&[100_000], true).unwrap(), "<|t100000|>");
        assert_eq!(load("synthetic:tiny", &[]).unwrap().tokenizer.vocab_size(), 1280);
        let e = load("synthetic:v4", &[]).err().unwrap().to_string();
        assert!(e.contains("unknown synthetic preset"), "{e}");
        let e = load("synthetic:tiny", &["--max-model-len", "1"]).err().unwrap().to_string();
        assert!(e.contains("at least 2"), "{e}");
    }
}
