//! `tokenizer_config.json`: the special-token strings and the chat template, as Hugging Face writes them.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::TextError;

/// The parts of `tokenizer_config.json` the router needs. Unknown keys are ignored.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    /// Whether plain (non-chat) prompts get the BOS token prepended.
    pub add_bos_token: Option<bool>,
    /// The default chat template (a string, or the entry named "default" of a list of named templates).
    pub chat_template: Option<String>,
}

#[derive(Deserialize)]
struct Raw {
    bos_token: Option<Value>,
    eos_token: Option<Value>,
    pad_token: Option<Value>,
    add_bos_token: Option<bool>,
    chat_template: Option<Value>,
}

/// A special token is either `"<s>"` or `{"content": "<s>", ...}` (AddedToken form).
fn token_string(v: Option<Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn template_string(v: Option<Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s),
        // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        Value::Array(list) => {
            let named = |n: &str| list.iter().find(|e| e.get("name").and_then(Value::as_str) == Some(n)).cloned();
            named("default")
                .or_else(|| list.first().cloned())
                .and_then(|e| e.get("template").and_then(Value::as_str).map(str::to_owned))
        }
        _ => None,
    }
}

impl TokenizerConfig {
    /// Parses the JSON value of a `tokenizer_config.json`.
    pub fn from_value(v: Value) -> Result<Self, String> {
        let raw: Raw = serde_json::from_value(v).map_err(|e| e.to_string())?;
        Ok(Self {
            bos_token: token_string(raw.bos_token),
            eos_token: token_string(raw.eos_token),
            pad_token: token_string(raw.pad_token),
            add_bos_token: raw.add_bos_token,
            chat_template: template_string(raw.chat_template),
        })
    }

    /// Reads `path`; a missing file is an empty config (many checkpoints have none).
    pub fn load(path: &Path) -> Result<Self, TextError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => return Err(TextError::Io { path: path.to_owned(), source }),
        };
        let parse = |message: String| TextError::Parse { path: path.to_owned(), message };
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| parse(e.to_string()))?;
        Self::from_value(v).map_err(parse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn accepts_added_token_objects_and_named_template_lists() {
        let c = TokenizerConfig::from_value(json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            "something_else": 3
        }))
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.chat_template.as_deref(), Some("D"));
    }

    #[test]
    fn missing_file_is_an_empty_config() {
        let dir = tempfile::tempdir().unwrap();
        let c = TokenizerConfig::load(&dir.path().join("tokenizer_config.json")).unwrap();
        assert!(c.chat_template.is_none());
    }
}
