//! POST /v1/chat/completions: messages -> chat template -> tokens.

use std::sync::Arc;

use axum::response::Response;
use proto::v1::GeneratedToken;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::logprobs::chat_content;
use super::params::Common;
use super::stream::{self, Format, UsageField, usage_json};
use super::{AppState, stop_reason};
use crate::error::ApiError;
use crate::flow::Summary;
use crate::model::ServedModel;

#[derive(Deserialize)]
struct ChatRequest {
    messages: Option<Vec<Value>>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    add_special_tokens: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
    #[serde(flatten)]
    common: Common,
}

/// Flattens OpenAI content parts into a string; anything but text is refused.
fn normalize(i: usize, m: Value) -> Result<Value, ApiError> {
    let bad = |msg: String| ApiError::invalid_param("messages", msg);
    let Value::Object(mut obj) = m else { return Err(bad(format!("messages[{i}] must be an object"))) };
    match obj.get("role") {
        Some(Value::String(_)) => {}
        _ => return Err(bad(format!("messages[{i}].role must be a string"))),
    }
    if obj.get("name").is_some_and(|n| !n.is_string() && !n.is_null()) {
        return Err(bad(format!("messages[{i}].name must be a string")));
    }
    let content = match obj.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(bad(format!("messages[{i}].content[{j}].text must be a string")));
                    }
                    (kind, _) => {
                        return Err(bad(format!(
                            "messages[{i}].content[{j}] has type {}; this model accepts text parts only",
                            kind.unwrap_or("(none)")
                        )));
                    }
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(bad(format!("messages[{i}].content must be a string or an array of text parts"))),
    };
    obj.insert("content".into(), Value::String(content));
    Ok(Value::Object(obj))
}

pub async fn handle(st: &Arc<AppState>, request_id: &str, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = super::parse_json(body)?;
    req.common.check_model(&st.model)?;
    let messages = req.messages.ok_or_else(|| ApiError::invalid_param("messages", "messages is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must contain at least one message"));
    }
    let messages: Vec<Value> =
        messages.into_iter().enumerate().map(|(i, m)| normalize(i, m)).collect::<Result<_, _>>()?;
    match req.tool_choice.as_ref().and_then(|t| t.as_str().map(str::to_owned).or(Some(String::from("named")))) {
        None => {}
        Some(c) if c == "none" || c == "auto" => {}
        Some(c) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "tool_choice {c:?} is not supported: tandem passes tools to the chat template but does not force or parse tool calls"
                ),
            ));
        }
    }
    match req.response_format.as_ref() {
        None | Some(Value::Null) => {}
        Some(Value::Object(f)) => match f.get("type") {
            Some(Value::String(kind)) if kind == "text" => {}
            None | Some(Value::Null) => {
                return Err(ApiError::invalid_param("response_format", "response_format.type must be \"text\""));
            }
            Some(kind) => {
                return Err(ApiError::invalid_param(
                    "response_format",
                    format!("response_format {kind} (structured output) is not supported"),
                ));
            }
        },
        Some(_) => return Err(ApiError::invalid_param("response_format", "response_format must be an object")),
    }
    let top_logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(n)) if !(0..=20).contains(&n) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("top_logprobs must be between 0 and 20 (got {n})"),
            ));
        }
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid_param("top_logprobs", "top_logprobs requires logprobs: true"));
        }
        (true, n) => Some(n.unwrap_or(0) as u32),
        (false, _) => None,
    };
    let continue_final = req.continue_final_message.unwrap_or(false);
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(ApiError::invalid_param(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    let mut extra = req.chat_template_kwargs.unwrap_or_default();
    if let Some(t) = req.tools {
        extra.insert("tools".into(), t);
    }
    let mut rendered = st
        .model
        .template
        .render(&messages, add_generation_prompt, &extra)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    if continue_final {
        // Leave the last message open: cut what the template wrote after its content.
        let last = messages.last().and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or_default();
        if let Some(at) = rendered.rfind(last).filter(|_| !last.is_empty()) {
            rendered.truncate(at + last.len());
        }
    }
    let prompt = super::tokenize(&st.model, rendered, req.add_special_tokens.unwrap_or(false)).await?;
    let v = req.common.validate(&st.model, st.dispatcher.max_model_len(), prompt.len(), None, top_logprobs)?;
    let fmt = ChatFormat {
        id: format!("chatcmpl-{request_id}"),
        created: super::now(),
        model: st.model.clone(),
        top_logprobs: top_logprobs.map(|n| n as usize),
    };
    super::serve_tokenized(st, request_id, "chat", prompt, v, fmt).await
}

pub struct ChatFormat {
    id: String,
    created: u64,
    model: Arc<ServedModel>,
    top_logprobs: Option<usize>,
}

impl ChatFormat {
    fn chunk_body(&self, delta: Value, logprobs: Value, finish: Value) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model.name,
            "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish }],
        })
    }

    fn lp(&self, tokens: &[GeneratedToken]) -> Value {
        match self.top_logprobs {
            Some(n) => json!({ "content": chat_content(&self.model.tokenizer, tokens, n) }),
            None => Value::Null,
        }
    }
}

impl Format for ChatFormat {
    fn opening(&mut self, usage: UsageField) -> Option<Value> {
        let mut v = self.chunk_body(json!({ "role": "assistant", "content": "" }), Value::Null, Value::Null);
        usage.apply(&mut v);
        Some(v)
    }

    fn chunk(&mut self, text: &str, tokens: &[GeneratedToken], usage: UsageField) -> Option<Value> {
        let mut v = self.chunk_body(json!({ "content": text }), self.lp(tokens), Value::Null);
        usage.apply(&mut v);
        Some(v)
    }

    fn finish(&mut self, s: &Summary, usage: UsageField) -> Value {
        let mut v = self.chunk_body(json!({}), Value::Null, json!(s.finish_reason.as_str()));
        v["choices"][0]["stop_reason"] = stop_reason(s);
        usage.apply(&mut v);
        v
    }

    fn usage_chunk(&mut self, s: &Summary) -> Value {
        stream::usage_chunk(&self.id, "chat.completion.chunk", self.created, &self.model.name, s)
    }

    fn complete(&mut self, text: String, tokens: &[GeneratedToken], s: &Summary) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [{
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": self.lp(tokens),
                "finish_reason": s.finish_reason.as_str(),
                "stop_reason": stop_reason(s),
            }],
            "usage": usage_json(s.prompt_tokens, s.completion_tokens, s.cached_tokens),
        })
    }
}
