//! The sampling and stopping fields shared by /v1/completions and /v1/chat/completions, validated into
//! `tandem.v1.SamplingParams`. Unknown fields are ignored (as vLLM does); values we cannot honour get a
//! 400 that says which field and why.

use std::collections::HashMap;

use proto::v1::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::model::ServedModel;

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM extension: usage on every chunk.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Fields common to both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
}

/// The validated result.
pub struct Validated {
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub skip_special_tokens: bool,
    pub include_stop_str: bool,
}

fn range(name: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => {
            Err(ApiError::invalid_param(name, format!("{name} must be between {lo} and {hi} (got {x})")))
        }
        other => Ok(other),
    }
}

fn stop_strings(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid_param("stop", "stop must be a string or an array of strings");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(a)) => a.into_iter().map(|x| x.as_str().map(str::to_owned).ok_or_else(bad)).collect(),
        Some(_) => Err(bad()),
    }
}

impl Common {
    /// Checks the requested model against the served one.
    pub fn check_model(&self, model: &ServedModel) -> Result<(), ApiError> {
        match self.model.as_deref() {
            Some(m) if !m.is_empty() && m != model.name => Err(ApiError::model_not_found(m, &model.name)),
            _ => Ok(()),
        }
    }

    /// `max_len`: the context length in force (the router's limit capped by the workers').
    /// `default_max_tokens`: what to use when the request gives no limit (None = up to the context).
    /// `logprobs`: the endpoint-specific logprobs request, already validated.
    pub fn validate(
        self,
        model: &ServedModel,
        max_len: u32,
        prompt_tokens: usize,
        default_max_tokens: Option<u32>,
        logprobs: Option<u32>,
    ) -> Result<Validated, ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::invalid_param(
                "n",
                format!("n must be 1: tandem returns one choice per request (got n={n}). Send {n} requests instead."),
            ));
        }
        if let Some(b) = self.best_of
            && b != 1
        {
            return Err(ApiError::invalid_param("best_of", format!("best_of must be 1 (got {b})")));
        }
        let max_len = max_len as usize;
        if prompt_tokens == 0 {
            return Err(ApiError::invalid_param("prompt", "The prompt is empty: send at least one token."));
        }
        if prompt_tokens >= max_len {
            return Err(ApiError::invalid(format!(
                "This model's maximum context length is {max_len} tokens. However, your prompt has {prompt_tokens} tokens, which leaves no room for the completion. Please shorten the prompt."
            ))
            .with_code("context_length_exceeded"));
        }
        let requested = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) | (None, Some(m)) => Some(m),
            (None, None) => None,
        };
        let max_tokens = match requested {
            Some(m) if m < 1 => {
                return Err(ApiError::invalid_param("max_tokens", format!("max_tokens must be at least 1 (got {m})")));
            }
            Some(m) => {
                let m = m as u64;
                if prompt_tokens as u64 + m > max_len as u64 {
                    return Err(ApiError::invalid_param("max_tokens", format!(
                        "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {m} in the completion). Please reduce the prompt or max_tokens (at most {} here).",
                        prompt_tokens as u64 + m,
                        max_len - prompt_tokens
                    ))
                    .with_code("context_length_exceeded"));
                }
                m as u32
            }
            None => {
                default_max_tokens.map_or(max_len - prompt_tokens, |d| (d as usize).min(max_len - prompt_tokens)) as u32
            }
        };
        let temperature = range("temperature", self.temperature, 0.0, 2.0)?.unwrap_or(1.0);
        let top_p = range("top_p", self.top_p, 0.0, 1.0)?.unwrap_or(1.0);
        if top_p == 0.0 {
            return Err(ApiError::invalid_param("top_p", "top_p must be in (0, 1]"));
        }
        let min_p = range("min_p", self.min_p, 0.0, 1.0)?.unwrap_or(0.0);
        let presence = range("presence_penalty", self.presence_penalty, -2.0, 2.0)?.unwrap_or(0.0);
        let frequency = range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?.unwrap_or(0.0);
        let repetition = match self.repetition_penalty {
            Some(r) if !(r.is_finite() && r > 0.0) => {
                return Err(ApiError::invalid_param(
                    "repetition_penalty",
                    format!("repetition_penalty must be > 0 (got {r})"),
                ));
            }
            r => r.unwrap_or(1.0),
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k.min(i32::MAX as i64) as i32,
            Some(k) => {
                return Err(ApiError::invalid_param("top_k", format!("top_k must be -1 (off) or positive (got {k})")));
            }
        };
        let vocab = model.tokenizer.vocab_size() as i64;
        let token = |name: &str, id: i64| -> Result<u32, ApiError> {
            if (0..vocab).contains(&id) {
                Ok(id as u32)
            } else {
                Err(ApiError::invalid_param(name, format!("token id {id} is outside the vocabulary (0..{vocab})")))
            }
        };
        let mut logit_bias = HashMap::new();
        for (k, v) in self.logit_bias.unwrap_or_default() {
            let id: i64 = k.parse().map_err(|_| {
                ApiError::invalid_param("logit_bias", format!("logit_bias keys must be token ids (got {k:?})"))
            })?;
            let v = range("logit_bias", Some(v), -100.0, 100.0)?.unwrap_or(0.0);
            logit_bias.insert(token("logit_bias", id)?, v as f32);
        }
        let stop_token_ids = self
            .stop_token_ids
            .unwrap_or_default()
            .into_iter()
            .map(|id| token("stop_token_ids", id))
            .collect::<Result<_, _>>()?;
        let min_tokens = match self.min_tokens {
            Some(m) if m < 0 => return Err(ApiError::invalid_param("min_tokens", "min_tokens must be >= 0")),
            Some(m) if m as u64 > max_tokens as u64 => {
                return Err(ApiError::invalid_param(
                    "min_tokens",
                    format!("min_tokens ({m}) must not exceed max_tokens ({max_tokens})"),
                ));
            }
            m => m.unwrap_or(0) as u32,
        };
        let stop = stop_strings(self.stop)?;
        let stream = self.stream.unwrap_or(false);
        let opts = self.stream_options.unwrap_or_default();
        if !stream && (opts.include_usage.is_some() || opts.continuous_usage_stats.is_some()) {
            return Err(ApiError::invalid_param(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        Ok(Validated {
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                min_p: min_p as f32,
                presence_penalty: presence as f32,
                frequency_penalty: frequency as f32,
                repetition_penalty: repetition as f32,
                logit_bias,
                seed: self.seed.map(|s| s as u64),
                max_tokens,
                min_tokens,
                stop_token_ids,
                ignore_eos: self.ignore_eos.unwrap_or(false),
                logprobs,
            },
            stop,
            stream,
            include_usage: opts.include_usage.unwrap_or(false),
            continuous_usage: opts.continuous_usage_stats.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            include_stop_str: self.include_stop_str_in_output.unwrap_or(false),
        })
    }
}

/// Most top logprobs per token, on every front door (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Checks a gRPC request's sampling parameters against the same bounds the HTTP API enforces (proto
/// defaults, 0 for "off", are accepted). `max_tokens` must already be resolved.
pub fn check_sampling(s: &SamplingParams, vocab: usize) -> Result<(), ApiError> {
    let within = |name: &str, x: f32, lo: f32, hi: f32| {
        if x.is_finite() && (lo..=hi).contains(&x) {
            Ok(())
        } else {
            Err(ApiError::invalid_param(name, format!("{name} must be between {lo} and {hi} (got {x})")))
        }
    };
    within("temperature", s.temperature, 0.0, 2.0)?;
    within("top_p", s.top_p, 0.0, 1.0)?;
    within("min_p", s.min_p, 0.0, 1.0)?;
    within("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    within("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    if !(s.repetition_penalty.is_finite() && s.repetition_penalty >= 0.0) {
        return Err(ApiError::invalid_param(
            "repetition_penalty",
            format!("repetition_penalty must be > 0, or 0 for off (got {})", s.repetition_penalty),
        ));
    }
    if s.top_k < -1 {
        return Err(ApiError::invalid_param(
            "top_k",
            format!("top_k must be -1 or 0 (off) or positive (got {})", s.top_k),
        ));
    }
    let in_vocab = |name: &str, id: u32| {
        if (id as usize) < vocab {
            Ok(())
        } else {
            Err(ApiError::invalid_param(name, format!("token id {id} is outside the vocabulary (0..{vocab})")))
        }
    };
    for (&id, &bias) in &s.logit_bias {
        in_vocab("logit_bias", id)?;
        within("logit_bias", bias, -100.0, 100.0)?;
    }
    for &id in &s.stop_token_ids {
        in_vocab("stop_token_ids", id)?;
    }
    if let Some(n) = s.logprobs
        && n > MAX_TOP_LOGPROBS
    {
        return Err(ApiError::invalid_param(
            "logprobs",
            format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS} (got {n})"),
        ));
    }
    if s.min_tokens > s.max_tokens {
        return Err(ApiError::invalid_param(
            "min_tokens",
            format!("min_tokens ({}) must not exceed max_tokens ({})", s.min_tokens, s.max_tokens),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> SamplingParams {
        SamplingParams { temperature: 0.7, max_tokens: 8, ..Default::default() }
    }

    #[test]
    fn grpc_sampling_gets_the_http_bounds() {
        assert!(check_sampling(&ok(), 100).is_ok());
        assert!(check_sampling(&SamplingParams { top_k: -1, ..ok() }, 100).is_ok());
        let bad = [
            ("logprobs", SamplingParams { logprobs: Some(100_000), ..ok() }),
            ("top_k", SamplingParams { top_k: -5, ..ok() }),
            ("temperature", SamplingParams { temperature: f32::NAN, ..ok() }),
            ("top_p", SamplingParams { top_p: 1.5, ..ok() }),
            ("repetition_penalty", SamplingParams { repetition_penalty: -1.0, ..ok() }),
            ("stop_token_ids", SamplingParams { stop_token_ids: vec![100], ..ok() }),
            ("min_tokens", SamplingParams { min_tokens: 9, ..ok() }),
        ];
        for (param, s) in bad {
            let e = check_sampling(&s, 100).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{e}");
            assert_eq!(e.to_status().code(), tonic::Code::InvalidArgument);
        }
    }
}
