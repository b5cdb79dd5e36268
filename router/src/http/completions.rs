//! POST /v1/completions.

use std::sync::Arc;

use proto::v1::GeneratedToken;
use serde::Deserialize;
use serde_json::{Value, json};

use super::logprobs::CompletionLogprobs;
use super::params::Common;
use super::stream::{self, Format, UsageField, usage_json};
use super::{AppState, stop_reason};
use crate::error::ApiError;
use crate::flow::Summary;
use crate::model::ServedModel;
use axum::response::Response;

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Option<Value>,
    echo: Option<bool>,
    logprobs: Option<i64>,
    suffix: Option<String>,
    add_special_tokens: Option<bool>,
    #[serde(flatten)]
    common: Common,
}

enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

fn parse_prompt(v: Option<Value>, vocab: usize) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::invalid_param("prompt", m);
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|x| match x.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                _ => Err(bad(format!("prompt token {x} is not a token id of this model (0..{vocab})"))),
            })
            .collect()
    };
    match v {
        None | Some(Value::Null) => Err(bad("prompt is required".into())),
        Some(Value::String(s)) => Ok(Prompt::Text(s)),
        Some(Value::Array(a)) if a.is_empty() => Err(bad("prompt is empty".into())),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => Ok(Prompt::Ids(ids(&a)?)),
        Some(Value::Array(a)) if a.len() > 1 => Err(bad(format!(
            "batched prompts ({} in one request) are not supported: send one request per prompt",
            a.len()
        ))),
        Some(Value::Array(mut a)) => match a.pop() {
            Some(Value::String(s)) => Ok(Prompt::Text(s)),
            Some(Value::Array(inner)) => Ok(Prompt::Ids(ids(&inner)?)),
            _ => Err(bad("prompt must be a string, an array of token ids, or a one-element array of either".into())),
        },
        Some(_) => Err(bad("prompt must be a string or an array of token ids".into())),
    }
}

pub async fn handle(st: &Arc<AppState>, request_id: &str, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = super::parse_json(body)?;
    req.common.check_model(&st.model)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(n) if (0..=20).contains(&n) => Some(n as u32),
        Some(n) => {
            return Err(ApiError::invalid_param("logprobs", format!("logprobs must be between 0 and 20 (got {n})")));
        }
    };
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid_param("echo", "echo together with logprobs (prompt logprobs) is not supported"));
    }
    let add_special = req.add_special_tokens.unwrap_or(true);
    let (prompt, prompt_text) = match parse_prompt(req.prompt, st.model.tokenizer.vocab_size())? {
        Prompt::Text(t) => (super::tokenize(&st.model, t.clone(), add_special).await?, t),
        Prompt::Ids(ids) => {
            let text = if echo { st.model.tokenizer.decode(&ids, true).unwrap_or_default() } else { String::new() };
            (ids, text)
        }
    };
    // OpenAI's default for completions is 16 tokens.
    let v = req.common.validate(&st.model, st.dispatcher.max_model_len(), prompt.len(), Some(16), logprobs)?;
    let fmt = CompletionFormat {
        id: format!("cmpl-{request_id}"),
        created: super::now(),
        model: st.model.clone(),
        echo: echo.then_some(prompt_text),
        logprobs: logprobs.map(|_| CompletionLogprobs::default()),
    };
    super::serve_tokenized(st, request_id, "completions", prompt, v, fmt).await
}

pub struct CompletionFormat {
    id: String,
    created: u64,
    model: Arc<ServedModel>,
    /// Prompt text to put before the first chunk / the answer (echo=true).
    echo: Option<String>,
    logprobs: Option<CompletionLogprobs>,
}

impl CompletionFormat {
    fn body(&self, text: &str, logprobs: Value, finish: Value, stop_reason: Value) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [{ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason }],
        })
    }

    fn lp(&mut self, tokens: &[GeneratedToken]) -> Value {
        match &mut self.logprobs {
            Some(acc) => {
                acc.push(&self.model.tokenizer, tokens);
                acc.take()
            }
            None => Value::Null,
        }
    }
}

impl Format for CompletionFormat {
    fn opening(&mut self, usage: UsageField) -> Option<Value> {
        let echo = self.echo.take().filter(|e| !e.is_empty())?;
        let mut v = self.body(&echo, Value::Null, Value::Null, Value::Null);
        usage.apply(&mut v);
        Some(v)
    }

    fn chunk(&mut self, text: &str, tokens: &[GeneratedToken], usage: UsageField) -> Option<Value> {
        let lp = self.lp(tokens);
        let mut v = self.body(text, lp, Value::Null, Value::Null);
        usage.apply(&mut v);
        Some(v)
    }

    fn finish(&mut self, s: &Summary, usage: UsageField) -> Value {
        let lp = if self.logprobs.is_some() { self.lp(&[]) } else { Value::Null };
        let mut v = self.body("", lp, json!(s.finish_reason.as_str()), stop_reason(s));
        usage.apply(&mut v);
        v
    }

    fn usage_chunk(&mut self, s: &Summary) -> Value {
        stream::usage_chunk(&self.id, "text_completion", self.created, &self.model.name, s)
    }

    fn complete(&mut self, text: String, tokens: &[GeneratedToken], s: &Summary) -> Value {
        let full = match self.echo.take() {
            Some(e) => e + &text,
            None => text,
        };
        let lp = self.lp(tokens);
        let mut v = self.body(&full, lp, json!(s.finish_reason.as_str()), stop_reason(s));
        v["usage"] = usage_json(s.prompt_tokens, s.completion_tokens, s.cached_tokens);
        v
    }
}
