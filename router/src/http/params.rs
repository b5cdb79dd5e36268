//! The sampling and stopping fields shared by /v1/completions and /v1/chat/completions, validated into
//! `tandem.v1.SamplingParams` one parameter group at a time: choices (`n`, `best_of`), lengths (prompt,
//! `max_tokens`), the distribution's shape (`temperature`, `top_p`, `top_k`, `min_p`), penalties, token ids
//! (`logit_bias`, `stop_token_ids`), stopping (`min_tokens`, `stop`) and streaming. Unknown fields are
//! ignored (as vLLM does); values we cannot honour get a 400 that says which field and why. The gRPC front
//! door checks its `SamplingParams` against the same bounds ([`check_sampling`]).

use std::collections::HashMap;

use proto::v1::SamplingParams;
use serde::{Deserialize, Deserializer};
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
    #[serde(default, deserialize_with = "stream_options")]
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
}

/// `stream_options`: an object or null. serde's derived structs also take a sequence (their fields in
/// order), which the API does not document and clients should not come to rely on.
fn stream_options<'de, D: Deserializer<'de>>(d: D) -> Result<Option<StreamOptions>, D::Error> {
    use serde::de::Error;
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => {
            serde_json::from_value(v).map(Some).map_err(|e| D::Error::custom(format!("stream_options: {e}")))
        }
        Some(_) => Err(D::Error::custom("stream_options must be an object")),
    }
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

impl Common {
    /// Checks the requested model against the served one.
    pub fn check_model(&self, model: &ServedModel) -> Result<(), ApiError> {
        match self.model.as_deref() {
            Some(m) if !m.is_empty() && m != model.name => Err(ApiError::model_not_found(m, &model.name)),
            _ => Ok(()),
        }
    }

    /// Validates every group in turn (the first bad field is reported).
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
        one_choice(self.n, self.best_of)?;
        // Each limit given must be valid, also the one the other overrides.
        for (name, m) in [("max_tokens", self.max_tokens), ("max_completion_tokens", self.max_completion_tokens)] {
            if let Some(m) = m
                && m < 1
            {
                return Err(ApiError::invalid_param(name, format!("{name} must be at least 1 (got {m})")));
            }
        }
        if self.max_completion_tokens.is_some() {
            lengths(prompt_tokens, max_len as usize, self.max_tokens, default_max_tokens)?;
        }
        let max_tokens = lengths(
            prompt_tokens,
            max_len as usize,
            self.max_completion_tokens.or(self.max_tokens),
            default_max_tokens,
        )?;
        let mut sampling = SamplingParams {
            max_tokens,
            seed: self.seed.map(|s| s as u64),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            ..Default::default()
        };
        shape(&self, &mut sampling)?;
        penalties(&self, &mut sampling)?;
        let vocab = model.tokenizer.vocab_size();
        sampling.logit_bias = logit_bias(self.logit_bias.unwrap_or_default(), vocab)?;
        sampling.stop_token_ids = self
            .stop_token_ids
            .unwrap_or_default()
            .into_iter()
            .map(|id| vocab_id("stop_token_ids", id, vocab))
            .collect::<Result<_, _>>()?;
        sampling.min_tokens = min_tokens(self.min_tokens, max_tokens)?;
        let stop = stop_strings(self.stop)?;
        let (stream, include_usage, continuous_usage) = streaming(self.stream, self.stream_options)?;
        Ok(Validated {
            sampling,
            stop,
            stream,
            include_usage,
            continuous_usage,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            include_stop_str: self.include_stop_str_in_output.unwrap_or(false),
        })
    }
}

/// A closed range a parameter must lie in (both front doors).
struct Bounds {
    name: &'static str,
    lo: f64,
    hi: f64,
}

const TEMPERATURE: Bounds = Bounds { name: "temperature", lo: 0.0, hi: 2.0 };
const TOP_P: Bounds = Bounds { name: "top_p", lo: 0.0, hi: 1.0 };
const MIN_P: Bounds = Bounds { name: "min_p", lo: 0.0, hi: 1.0 };
const PRESENCE_PENALTY: Bounds = Bounds { name: "presence_penalty", lo: -2.0, hi: 2.0 };
const FREQUENCY_PENALTY: Bounds = Bounds { name: "frequency_penalty", lo: -2.0, hi: 2.0 };
const LOGIT_BIAS: Bounds = Bounds { name: "logit_bias", lo: -100.0, hi: 100.0 };

impl Bounds {
    /// `x` (shown as given: the gRPC door's values are f32) when finite and within the bounds.
    fn check<T: Into<f64> + std::fmt::Display + Copy>(&self, x: T) -> Result<T, ApiError> {
        let v: f64 = x.into();
        if v.is_finite() && v >= self.lo && v <= self.hi {
            Ok(x)
        } else {
            let Bounds { name, lo, hi } = self;
            Err(ApiError::invalid_param(name, format!("{name} must be between {lo} and {hi} (got {x})")))
        }
    }

    /// An optional HTTP field: absent is `default`.
    fn check_or(&self, x: Option<f64>, default: f64) -> Result<f64, ApiError> {
        x.map_or(Ok(default), |x| self.check(x))
    }
}

/// A token id in the vocabulary.
fn vocab_id(name: &str, id: i64, vocab: usize) -> Result<u32, ApiError> {
    if (0..vocab as i64).contains(&id) {
        Ok(id as u32)
    } else {
        Err(ApiError::invalid_param(name, format!("token id {id} is outside the vocabulary (0..{vocab})")))
    }
}

/// Choices: `n` and `best_of` must be 1 (one choice per request).
fn one_choice(n: Option<i64>, best_of: Option<i64>) -> Result<(), ApiError> {
    if let Some(n) = n
        && n != 1
    {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be 1: tandem returns one choice per request (got n={n}). Send {n} requests instead."),
        ));
    }
    if let Some(b) = best_of
        && b != 1
    {
        return Err(ApiError::invalid_param("best_of", format!("best_of must be 1 (got {b})")));
    }
    Ok(())
}

/// Lengths: a non-empty prompt that leaves room in the context, and `max_tokens` (given, or the default,
/// or the room left) within it.
fn lengths(
    prompt_tokens: usize,
    max_len: usize,
    requested: Option<i64>,
    default_max_tokens: Option<u32>,
) -> Result<u32, ApiError> {
    if prompt_tokens == 0 {
        return Err(ApiError::invalid_param("prompt", "The prompt is empty: send at least one token."));
    }
    if prompt_tokens >= max_len {
        return Err(ApiError::invalid(format!(
            "This model's maximum context length is {max_len} tokens. However, your prompt has {prompt_tokens} tokens, which leaves no room for the completion. Please shorten the prompt."
        ))
        .with_code("context_length_exceeded"));
    }
    let room = max_len - prompt_tokens;
    match requested {
        Some(m) if m < 1 => {
            Err(ApiError::invalid_param("max_tokens", format!("max_tokens must be at least 1 (got {m})")))
        }
        Some(m) if prompt_tokens as u64 + m as u64 > max_len as u64 => Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {m} in the completion). Please reduce the prompt or max_tokens (at most {room} here).",
                prompt_tokens as u64 + m as u64,
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m as u32),
        None => Ok(default_max_tokens.map_or(room, |d| (d as usize).min(room)) as u32),
    }
}

/// The distribution's shape: temperature, top_p (never 0), top_k (-1 or 0: off), min_p.
fn shape(c: &Common, s: &mut SamplingParams) -> Result<(), ApiError> {
    s.temperature = TEMPERATURE.check_or(c.temperature, 1.0)? as f32;
    let top_p = TOP_P.check_or(c.top_p, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::invalid_param("top_p", "top_p must be in (0, 1]"));
    }
    s.top_p = top_p as f32;
    s.min_p = MIN_P.check_or(c.min_p, 0.0)? as f32;
    s.top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k.min(i32::MAX as i64) as i32,
        Some(k) => {
            return Err(ApiError::invalid_param("top_k", format!("top_k must be -1 (off) or positive (got {k})")));
        }
    };
    Ok(())
}

/// Penalties: presence and frequency (OpenAI's -2..2), repetition (vLLM's, > 0).
fn penalties(c: &Common, s: &mut SamplingParams) -> Result<(), ApiError> {
    s.presence_penalty = PRESENCE_PENALTY.check_or(c.presence_penalty, 0.0)? as f32;
    s.frequency_penalty = FREQUENCY_PENALTY.check_or(c.frequency_penalty, 0.0)? as f32;
    s.repetition_penalty = match c.repetition_penalty {
        Some(r) if !(r.is_finite() && r > 0.0) => {
            return Err(ApiError::invalid_param(
                "repetition_penalty",
                format!("repetition_penalty must be > 0 (got {r})"),
            ));
        }
        r => r.unwrap_or(1.0) as f32,
    };
    Ok(())
}

/// Token ids: `logit_bias` keys (JSON object keys: token ids as strings) in the vocabulary, biases in range.
fn logit_bias(bias: HashMap<String, f64>, vocab: usize) -> Result<HashMap<u32, f32>, ApiError> {
    let mut out = HashMap::new();
    for (k, v) in bias {
        let id: i64 = k.parse().map_err(|_| {
            ApiError::invalid_param("logit_bias", format!("logit_bias keys must be token ids (got {k:?})"))
        })?;
        let v = LOGIT_BIAS.check(v)?;
        out.insert(vocab_id("logit_bias", id, vocab)?, v as f32);
    }
    Ok(out)
}

/// Stopping: `min_tokens` in 0..=max_tokens.
fn min_tokens(min: Option<i64>, max_tokens: u32) -> Result<u32, ApiError> {
    match min {
        Some(m) if m < 0 => Err(ApiError::invalid_param("min_tokens", "min_tokens must be >= 0")),
        Some(m) if m as u64 > max_tokens as u64 => Err(ApiError::invalid_param(
            "min_tokens",
            format!("min_tokens ({m}) must not exceed max_tokens ({max_tokens})"),
        )),
        m => Ok(m.unwrap_or(0) as u32),
    }
}

/// Stopping: `stop` is a string or a list of strings.
fn stop_strings(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid_param("stop", "stop must be a string or an array of strings");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(a)) => a.into_iter().map(|x| x.as_str().map(str::to_owned).ok_or_else(bad)).collect(),
        Some(_) => Err(bad()),
    }
}

/// Streaming: `stream_options` only with `stream`. Returns (stream, include_usage, continuous_usage).
fn streaming(stream: Option<bool>, opts: Option<StreamOptions>) -> Result<(bool, bool, bool), ApiError> {
    let stream = stream.unwrap_or(false);
    let opts = opts.unwrap_or_default();
    if !stream && (opts.include_usage.is_some() || opts.continuous_usage_stats.is_some()) {
        return Err(ApiError::invalid_param("stream_options", "stream_options is only allowed when stream is true"));
    }
    Ok((stream, opts.include_usage.unwrap_or(false), opts.continuous_usage_stats.unwrap_or(false)))
}

/// Most top logprobs per token, on every front door (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Checks a gRPC request's sampling parameters against the same bounds the HTTP API enforces (proto
/// defaults, 0 for "off", are accepted). `max_tokens` must already be resolved.
pub fn check_sampling(s: &SamplingParams, vocab: usize) -> Result<(), ApiError> {
    TEMPERATURE.check(s.temperature)?;
    TOP_P.check(s.top_p)?;
    MIN_P.check(s.min_p)?;
    PRESENCE_PENALTY.check(s.presence_penalty)?;
    FREQUENCY_PENALTY.check(s.frequency_penalty)?;
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
    for (&id, &bias) in &s.logit_bias {
        vocab_id("logit_bias", id.into(), vocab)?;
        LOGIT_BIAS.check(bias)?;
    }
    for &id in &s.stop_token_ids {
        vocab_id("stop_token_ids", id.into(), vocab)?;
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
    fn max_tokens_is_checked_even_where_max_completion_tokens_overrides_it() {
        // Found by schemathesis: max_tokens 0 or past the context was accepted beside a valid
        // max_completion_tokens.
        let model = ServedModel::for_tests();
        let common = |m: i64| Common { max_tokens: Some(m), max_completion_tokens: Some(8), ..Default::default() };
        for m in [0, -1, 200] {
            let e = common(m).validate(&model, 100, 10, None, None).err().expect("refused");
            assert_eq!(e.param.as_deref(), Some("max_tokens"), "{m}: {e}");
        }
        assert_eq!(common(8).validate(&model, 100, 10, None, None).unwrap().sampling.max_tokens, 8);
    }

    #[test]
    fn stream_options_must_be_an_object() {
        // Found by schemathesis: `"stream_options": [null, null]` was taken as an empty object.
        let parse = |v: Value| serde_json::from_value::<Common>(serde_json::json!({ "stream_options": v }));
        assert!(parse(serde_json::json!([null, null])).is_err());
        assert!(parse(serde_json::json!(true)).is_err());
        assert!(parse(Value::Null).unwrap().stream_options.is_none());
        let c = parse(serde_json::json!({"include_usage": true})).unwrap();
        assert_eq!(c.stream_options.unwrap().include_usage, Some(true));
    }

    #[test]
    fn each_group_names_its_bad_field() {
        let param = |r: Result<(), ApiError>| r.unwrap_err().param.unwrap_or_default();
        assert_eq!(param(one_choice(Some(2), None)), "n");
        assert_eq!(param(one_choice(None, Some(3))), "best_of");
        assert_eq!(param(lengths(0, 100, None, None).map(drop)), "prompt");
        assert_eq!(param(lengths(10, 100, Some(91), None).map(drop)), "max_tokens");
        assert_eq!(lengths(10, 100, None, Some(16)).unwrap(), 16);
        assert_eq!(lengths(10, 100, None, None).unwrap(), 90, "up to the context");
        let mut s = SamplingParams::default();
        let c = |f: fn(&mut Common)| {
            let mut c = Common::default();
            f(&mut c);
            c
        };
        assert_eq!(param(shape(&c(|c| c.top_p = Some(0.0)), &mut s)), "top_p");
        assert_eq!(param(shape(&c(|c| c.top_k = Some(-2)), &mut s)), "top_k");
        assert_eq!(param(penalties(&c(|c| c.frequency_penalty = Some(3.0)), &mut s)), "frequency_penalty");
        assert_eq!(param(penalties(&c(|c| c.repetition_penalty = Some(0.0)), &mut s)), "repetition_penalty");
        assert_eq!(param(logit_bias([("7".to_string(), 101.0)].into(), 100).map(drop)), "logit_bias");
        assert_eq!(param(min_tokens(Some(9), 8).map(drop)), "min_tokens");
        let opts = StreamOptions { include_usage: Some(true), ..Default::default() };
        assert_eq!(param(streaming(Some(false), Some(opts)).map(drop)), "stream_options");
    }

    #[test]
    fn both_front_doors_word_a_bound_alike() {
        let http = TEMPERATURE.check_or(Some(2.5), 1.0).unwrap_err().message;
        let grpc = check_sampling(&SamplingParams { temperature: 2.5, ..ok() }, 100).unwrap_err().message;
        assert_eq!(http, grpc);
        assert_eq!(http, "temperature must be between 0 and 2 (got 2.5)");
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
