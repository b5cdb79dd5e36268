//! Chat templating: OpenAI messages -> the prompt text the model was trained on.
//!
//! Hugging Face renders templates with Jinja2 (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`); minijinja with `pycompat` reproduces that.

use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::{TextError, TokenizerConfig};

/// DeepSeek-V3's conversation format, used when a checkpoint ships no chat template.
pub const DEEPSEEK_V3_TEMPLATE: &str = include_str!("templates/deepseek_v3.jinja");

/// Where the active template came from (logged at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplateSource {
    /// `--chat-template FILE`.
    File(PathBuf),
    /// `--chat-template` given an inline template string.
    Inline,
    /// `chat_template` of the checkpoint's tokenizer_config.json.
    Checkpoint,
    /// [`DEEPSEEK_V3_TEMPLATE`].
    BuiltinDeepSeekV3,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: ChatTemplateSource,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// Compiles `template`. Special-token strings come from the tokenizer config.
    pub fn new(template: String, source: ChatTemplateSource, config: &TokenizerConfig) -> Result<Self, TextError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TextError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, template).map_err(|e| TextError::Template(format!("{source:?}: {e:#}")))?;
        Ok(Self {
            env,
            source,
            bos_token: config.bos_token.clone().unwrap_or_default(),
            eos_token: config.eos_token.clone().unwrap_or_default(),
        })
    }

    /// The template to serve with: `override_` (a file, or an inline template as vLLM accepts), else the
    /// checkpoint's, else the built-in DeepSeek-V3 format.
    pub fn resolve(override_: Option<&Path>, config: &TokenizerConfig) -> Result<Self, TextError> {
        if let Some(p) = override_ {
            if p.is_file() {
                let src = std::fs::read_to_string(p).map_err(|source| TextError::Io { path: p.to_owned(), source })?;
                return Self::new(src, ChatTemplateSource::File(p.to_owned()), config);
            }
            let s = p.to_string_lossy();
            if s.contains("{{") || s.contains("{%") {
                return Self::new(s.into_owned(), ChatTemplateSource::Inline, config);
            }
            return Err(TextError::Io {
                path: p.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "chat template file not found"),
            });
        }
        match &config.chat_template {
            Some(t) => Self::new(t.clone(), ChatTemplateSource::Checkpoint, config),
            None => Self::new(DEEPSEEK_V3_TEMPLATE.to_owned(), ChatTemplateSource::BuiltinDeepSeekV3, config),
        }
    }

    pub fn source(&self) -> &ChatTemplateSource {
        &self.source
    }

    /// Renders `messages` (OpenAI message objects; `content` already flattened to a string).
    /// `extra` holds template variables such as `tools` or the request's `chat_template_kwargs`; it can
    /// not override `messages`.
    pub fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String, TextError> {
        let mut ctx = Map::new();
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        let tmpl = self.env.get_template(NAME).map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(Value::from(minijinja::value::Serde(&ctx))).map_err(|e| {
            // raise_exception's message is what the template author wanted the user to see.
            let detail = e.detail().map(str::to_owned).unwrap_or_else(|| e.to_string());
            TextError::Template(detail)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> TokenizerConfig {
        TokenizerConfig {
            bos_token: Some("<｜begin▁of▁sentence｜>".into()),
            eos_token: Some("<｜end▁of▁sentence｜>".into()),
            ..Default::default()
        }
    }

    #[test]
    fn builtin_deepseek_format_puts_system_first_and_closes_assistant_turns() {
        let t = ChatTemplate::resolve(None, &cfg()).unwrap();
        assert_eq!(t.source(), &ChatTemplateSource::BuiltinDeepSeekV3);
        let msgs = vec![
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "assistant", "content": "<think>hmm</think>Hello!"}),
            json!({"role": "user", "content": "Bye"}),
        ];
        let s = t.render(&msgs, true, &Map::new()).unwrap();
        assert_eq!(
            s,
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>"
        );
        let no_gen = t.render(&msgs[..1], false, &Map::new()).unwrap();
        assert_eq!(no_gen, "<｜begin▁of▁sentence｜><｜User｜>Hi");
        let mut kw = Map::new();
        kw.insert("thinking".into(), json!(true));
        assert!(t.render(&msgs[..1], true, &kw).unwrap().ends_with("<｜Assistant｜><think>"));
    }

    #[test]
    fn raise_exception_reaches_the_caller_with_its_message() {
        let t = ChatTemplate::resolve(None, &cfg()).unwrap();
        let err = t.render(&[json!({"role": "robot", "content": "x"})], true, &Map::new()).unwrap_err();
        assert!(err.to_string().contains("Unknown message role: robot"), "{err}");
    }

    #[test]
    fn python_string_methods_and_hf_whitespace_rules_work() {
        let src =
            "{% for m in messages %}\n  {{ m['content'].strip().upper() }}|{{ m.role.startswith('us') }}\n{% endfor %}";
        let t = ChatTemplate::new(src.into(), ChatTemplateSource::Inline, &cfg()).unwrap();
        let s = t.render(&[json!({"role": "user", "content": "  a b "})], false, &Map::new()).unwrap();
        assert_eq!(s, "  A B|True\n", "booleans print as Python does");
    }

    #[test]
    fn override_accepts_a_file_or_an_inline_template_and_rejects_a_missing_path() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t.jinja");
        std::fs::write(&f, "{{ bos_token }}{{ messages[0].content }}").unwrap();
        let t = ChatTemplate::resolve(Some(&f), &cfg()).unwrap();
        assert_eq!(
            t.render(&[json!({"role": "user", "content": "x"})], true, &Map::new()).unwrap(),
            "<｜begin▁of▁sentence｜>x"
        );
        let inline = ChatTemplate::resolve(Some(Path::new("{{ messages|length }}")), &cfg()).unwrap();
        assert_eq!(inline.source(), &ChatTemplateSource::Inline);
        assert!(ChatTemplate::resolve(Some(&dir.path().join("missing.jinja")), &cfg()).is_err());
    }

    #[test]
    fn checkpoint_template_wins_over_the_builtin() {
        let c = TokenizerConfig { chat_template: Some("X{{ messages|length }}".into()), ..cfg() };
        let t = ChatTemplate::resolve(None, &c).unwrap();
        assert_eq!(t.render(&[json!({"role": "user", "content": "a"})], true, &Map::new()).unwrap(), "X1");
    }
}
