//! Turning a request's events into an HTTP answer: an SSE stream exactly as OpenAI sends it
//! (`data: {json}\n\n` chunks, `data: [DONE]\n\n` last), or one JSON body.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use proto::v1::GeneratedToken;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::flow::{Event, EventStream, Summary};

/// The `usage` field of a chunk.
pub enum UsageField {
    /// Not present (stream_options.include_usage unset).
    Omit,
    /// `"usage": null` (include_usage set; the totals come in the last chunk).
    Null,
    Value(Value),
}

impl UsageField {
    pub fn apply(self, v: &mut Value) {
        match self {
            Self::Omit => {}
            Self::Null => v["usage"] = Value::Null,
            Self::Value(u) => v["usage"] = u,
        }
    }
}

pub fn usage_json(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

/// The include_usage chunk of a stream of `object`s: no choices, the request's usage.
pub fn usage_chunk(id: &str, object: &str, created: u64, model: &str, s: &Summary) -> Value {
    json!({
        "id": id, "object": object, "created": created, "model": model,
        "choices": [], "usage": usage_json(s.prompt_tokens, s.completion_tokens, s.cached_tokens),
    })
}

/// Endpoint-specific JSON shapes.
pub trait Format: Send + 'static {
    /// First chunk before any text (chat sends the assistant role).
    fn opening(&mut self, usage: UsageField) -> Option<Value>;
    /// A chunk with new text / tokens; None to send nothing.
    fn chunk(&mut self, text: &str, tokens: &[GeneratedToken], usage: UsageField) -> Option<Value>;
    /// The chunk carrying finish_reason.
    fn finish(&mut self, s: &Summary, usage: UsageField) -> Value;
    /// The include_usage chunk (empty choices).
    fn usage_chunk(&mut self, s: &Summary) -> Value;
    /// The whole non-streaming body.
    fn complete(&mut self, text: String, tokens: &[GeneratedToken], s: &Summary) -> Value;
}

#[derive(Clone, Copy)]
pub struct StreamOpts {
    pub include_usage: bool,
    pub continuous_usage: bool,
}

struct Sse<F> {
    events: EventStream,
    fmt: F,
    opts: StreamOpts,
    pending: VecDeque<Bytes>,
    opened: bool,
    done: bool,
    prompt_tokens: u32,
    completion_tokens: u32,
}

fn data(v: &Value) -> Bytes {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

impl<F: Format> Sse<F> {
    fn usage(&self, s: Option<&Summary>) -> UsageField {
        if self.opts.continuous_usage {
            let (p, c, k) = s.map_or((self.prompt_tokens, self.completion_tokens, 0), |s| {
                (s.prompt_tokens, s.completion_tokens, s.cached_tokens)
            });
            UsageField::Value(usage_json(p, c, k))
        } else if self.opts.include_usage {
            UsageField::Null
        } else {
            UsageField::Omit
        }
    }

    async fn advance(&mut self) {
        if !self.opened {
            self.opened = true;
            let u = self.usage(None);
            if let Some(v) = self.fmt.opening(u) {
                self.pending.push_back(data(&v));
            }
            return;
        }
        match self.events.next().await {
            Some(Event::Delta { text, tokens }) => {
                self.completion_tokens += tokens.len() as u32;
                let u = self.usage(None);
                if let Some(v) = self.fmt.chunk(&text, &tokens, u) {
                    self.pending.push_back(data(&v));
                }
            }
            Some(Event::Done(s)) => {
                let u = self.usage(Some(&s));
                let fin = self.fmt.finish(&s, u);
                self.pending.push_back(data(&fin));
                if self.opts.include_usage {
                    let u = self.fmt.usage_chunk(&s);
                    self.pending.push_back(data(&u));
                }
                self.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                self.done = true;
            }
            Some(Event::Failed(e)) => {
                // After the 200 the only way to report: an error object as the last event.
                self.pending.push_back(Bytes::from(format!("data: {}\n\n", e.to_json())));
                self.done = true;
            }
            None => {
                let e = ApiError::internal("the request ended without a final result");
                self.pending.push_back(Bytes::from(format!("data: {}\n\n", e.to_json())));
                self.done = true;
            }
        }
    }
}

pub fn sse<F: Format>(events: EventStream, fmt: F, opts: StreamOpts, prompt_tokens: u32) -> Response {
    let st = Sse {
        events,
        fmt,
        opts,
        pending: VecDeque::new(),
        opened: false,
        done: false,
        prompt_tokens,
        completion_tokens: 0,
    };
    let body = futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(b) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(b), st));
            }
            if st.done {
                return None;
            }
            st.advance().await;
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

/// Waits for the whole answer.
pub async fn collect<F: Format>(mut events: EventStream, mut fmt: F) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match events.next().await {
            Some(Event::Delta { text: t, tokens: ts }) => {
                text.push_str(&t);
                tokens.extend(ts);
            }
            Some(Event::Done(s)) => {
                let body = fmt.complete(text, &tokens, &s);
                return Ok(
                    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
                );
            }
            Some(Event::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the request ended without a final result")),
        }
    }
}
