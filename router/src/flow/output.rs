//! Stage 3: tokens -> client events. Incremental detokenization, stop strings (held back, trimmed),
//! max_tokens, usage and latency metrics.

use std::sync::Arc;
use std::time::Instant;

use proto::v1::GeneratedToken;
use text::{IncrementalDetokenizer, StopMatcher};
use tokio::sync::mpsc;
use tracing::info;

use super::{Event, TokenizedRequest};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::model::ServedModel;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }

    pub fn to_proto(self) -> proto::v1::FinishReason {
        match self {
            Self::Stop => proto::v1::FinishReason::Stop,
            Self::Length => proto::v1::FinishReason::Length,
            Self::Abort => proto::v1::FinishReason::Abort,
        }
    }
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended the request (None for EOS/length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub finish_reason: FinishReason,
    pub stop_reason: Option<StopReason>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// Whether the attempt goes on.
#[derive(Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// The router ended the request (stop string); abort the workers.
    Stop,
    ClientGone,
}

pub struct Output {
    model: Arc<ServedModel>,
    metrics: Arc<Metrics>,
    tx: mpsc::UnboundedSender<Event>,
    endpoint: &'static str,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    generated: Vec<u32>,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    min_tokens: usize,
    ignore_eos: bool,
    prompt_tokens: u32,
    cached_tokens: u32,
    arrived: Instant,
    last_token: Option<Instant>,
    first_token: Option<Instant>,
    finished: bool,
}

impl Output {
    pub fn new(
        request: &TokenizedRequest,
        model: Arc<ServedModel>,
        metrics: Arc<Metrics>,
        tx: mpsc::UnboundedSender<Event>,
    ) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(&request.prompt, request.skip_special_tokens),
            stop: StopMatcher::new(&request.stop, request.include_stop_str),
            model,
            metrics,
            tx,
            endpoint: request.endpoint,
            generated: Vec::new(),
            max_tokens: request.sampling.max_tokens.max(1) as usize,
            stop_token_ids: request.sampling.stop_token_ids.clone(),
            min_tokens: request.sampling.min_tokens as usize,
            ignore_eos: request.sampling.ignore_eos,
            prompt_tokens: request.prompt.len() as u32,
            cached_tokens: 0,
            arrived: request.arrived,
            last_token: None,
            first_token: None,
            finished: false,
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the tokens pushed so far already end the request (the token budget, or a stop or EOS token
    /// past `min_tokens`): a request whose decode worker was lost between its last token and its `Finished`
    /// is finished here instead of being continued past its end.
    pub fn ended_by_tokens(&self) -> Option<FinishReason> {
        let n = self.generated.len();
        if n >= self.max_tokens {
            return Some(FinishReason::Length);
        }
        let last = *self.generated.last()?;
        let stops =
            self.stop_token_ids.contains(&last) || (!self.ignore_eos && Some(last) == self.model.tokenizer.eos_id());
        (stops && n >= self.min_tokens).then_some(FinishReason::Stop)
    }

    pub fn set_cached_tokens(&mut self, n: u32) {
        self.cached_tokens = n;
    }

    async fn send(&self, ev: Event) -> Control {
        if self.tx.send(ev).is_err() { Control::ClientGone } else { Control::Continue }
    }

    /// The tokens that follow those already pushed (every token of an attempt has one source; see
    /// `flow::attempt`).
    pub async fn push(&mut self, tokens: &[GeneratedToken]) -> Control {
        if self.finished {
            return Control::Continue;
        }
        let mut text = String::new();
        let mut emitted = Vec::new();
        let mut matched = None;
        for t in tokens {
            if self.generated.len() >= self.max_tokens {
                break;
            }
            self.generated.push(t.token_id);
            emitted.push(t.clone());
            let delta = self.detok.push(&self.model.tokenizer, t.token_id).unwrap_or_default();
            let o = self.stop.push(&delta);
            text.push_str(&o.text);
            if o.matched.is_some() {
                matched = o.matched;
                break;
            }
        }
        if emitted.is_empty() {
            return Control::Continue;
        }
        self.observe_tokens(emitted.len());
        if (!text.is_empty() || emitted.iter().any(|t| t.logprobs.is_some()))
            && self.send(Event::Delta { text, tokens: emitted }).await == Control::ClientGone
        {
            return Control::ClientGone;
        }
        match matched {
            Some(s) => {
                let c = self.done(FinishReason::Stop, Some(StopReason::Text(s))).await;
                if c == Control::ClientGone { c } else { Control::Stop }
            }
            None => Control::Continue,
        }
    }

    fn observe_tokens(&mut self, n: usize) {
        let now = Instant::now();
        match self.last_token {
            None => {
                self.first_token = Some(now);
                self.metrics.ttft.with_label_values(&[self.endpoint]).observe((now - self.arrived).as_secs_f64());
            }
            Some(prev) => {
                let gap = (now - prev).as_secs_f64() / n as f64;
                let h = self.metrics.itl.with_label_values(&[self.endpoint]);
                for _ in 0..n {
                    h.observe(gap);
                }
            }
        }
        self.last_token = Some(now);
    }

    /// The workers ended the request.
    pub async fn finish(&mut self, reason: FinishReason) -> Control {
        let stop_reason = match (reason, self.generated.last()) {
            (FinishReason::Stop, Some(t)) if self.stop_token_ids.contains(t) => Some(StopReason::Token(*t)),
            _ => None,
        };
        // A worker that overshot max_tokens is cut here; report it as length.
        let reason = if self.generated.len() >= self.max_tokens && reason == FinishReason::Stop && stop_reason.is_none()
        {
            let last_is_eos = self.generated.last().copied() == self.model.tokenizer.eos_id();
            if last_is_eos { reason } else { FinishReason::Length }
        } else {
            reason
        };
        self.done(reason, stop_reason).await
    }

    async fn done(&mut self, reason: FinishReason, stop_reason: Option<StopReason>) -> Control {
        if self.finished {
            return Control::Continue;
        }
        self.finished = true;
        let mut tail = self.detok.flush(&self.model.tokenizer).unwrap_or_default();
        if !matches!(stop_reason, Some(StopReason::Text(_))) {
            let held = self.stop.push(&tail);
            tail = held.text;
            tail.push_str(&self.stop.flush());
        } else {
            tail.clear();
        }
        if !tail.is_empty() && self.send(Event::Delta { text: tail, tokens: Vec::new() }).await == Control::ClientGone {
            return Control::ClientGone;
        }
        let summary = Summary {
            finish_reason: reason,
            stop_reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated.len() as u32,
            cached_tokens: self.cached_tokens,
        };
        let e2e = self.arrived.elapsed();
        self.metrics.e2e.with_label_values(&[self.endpoint]).observe(e2e.as_secs_f64());
        self.metrics.prompt_tokens.inc_by(self.prompt_tokens.into());
        self.metrics.generation_tokens.inc_by(self.generated.len() as u64);
        self.metrics.cached_prompt_tokens.inc_by(self.cached_tokens.into());
        let ttft_ms = self.first_token.map(|t| (t - self.arrived).as_secs_f64() * 1e3);
        info!(
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.generated.len(),
            cached_tokens = self.cached_tokens,
            finish = reason.as_str(),
            ttft_ms,
            e2e_ms = e2e.as_secs_f64() * 1e3,
            "request finished"
        );
        self.send(Event::Done(summary)).await
    }

    pub async fn fail(&mut self, e: ApiError) {
        if self.finished {
            return;
        }
        self.finished = true;
        tracing::warn!(error = %e, generated = self.generated.len(), "request failed");
        let _ = self.send(Event::Failed(e)).await;
    }
}
