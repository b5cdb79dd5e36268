//! Timing a streamed answer from its raw SSE bytes (`data: {json}` events, `data: [DONE]` last).
//!
//! As in SGLang's bench_serving, TTFT is the first chunk with non-empty text. A chunk may carry several
//! tokens (MTP-accepted drafts, or tokens the detokenizer held back), so each chunk gap is spread evenly
//! over the tokens it delivered, as SGLang does for its native backend. Token counts come from `usage`
//! on every chunk (`stream_options.continuous_usage_stats`, a vLLM extension tandem implements); against
//! a server without it every content chunk counts as one token.

use std::time::Instant;

use serde_json::Value;

use super::client::{Endpoint, Outcome};

/// Splits an SSE byte stream into the payloads of its `data:` lines, across arbitrary chunk boundaries.
#[derive(Default)]
pub struct SseData {
    buf: Vec<u8>,
}

impl SseData {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end_matches(['\n', '\r']).strip_prefix("data:") {
                out.push(data.trim_start().to_owned());
            }
        }
        out
    }
}

/// The timing state of one stream.
pub struct Timing {
    start: Instant,
    first: Option<Instant>,
    last: Instant,
    itl: Vec<f64>,
    /// Cumulative completion tokens per the latest `usage`.
    usage_tokens: Option<u64>,
    tokens_at_last: u64,
    content_chunks: u64,
    prompt_tokens: Option<u64>,
}

impl Timing {
    pub fn new(start: Instant) -> Self {
        Self {
            start,
            first: None,
            last: start,
            itl: Vec::new(),
            usage_tokens: None,
            tokens_at_last: 0,
            content_chunks: 0,
            prompt_tokens: None,
        }
    }

    pub fn chunk(&mut self, now: Instant, v: &Value, endpoint: Endpoint) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage_tokens = u["completion_tokens"].as_u64().or(self.usage_tokens);
            self.prompt_tokens = u["prompt_tokens"].as_u64().or(self.prompt_tokens);
        }
        let choice = &v["choices"][0];
        let text = match endpoint {
            Endpoint::Completions => &choice["text"],
            Endpoint::Chat => &choice["delta"]["content"],
        };
        if text.as_str().is_none_or(str::is_empty) {
            return;
        }
        self.content_chunks += 1;
        let tokens = self.usage_tokens.unwrap_or(self.content_chunks);
        if self.first.is_none() {
            self.first = Some(now);
        } else {
            let n = tokens.saturating_sub(self.tokens_at_last).max(1);
            let gap = now.duration_since(self.last).as_secs_f64() / n as f64;
            self.itl.extend(std::iter::repeat_n(gap, n as usize));
        }
        self.tokens_at_last = tokens;
        self.last = now;
    }

    pub fn finish(self, now: Instant) -> Outcome {
        let latency = now.duration_since(self.start).as_secs_f64();
        Outcome {
            success: true,
            error: String::new(),
            ttft: self.first.map_or(latency, |f| f.duration_since(self.start).as_secs_f64()),
            latency,
            itl: self.itl,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.usage_tokens.unwrap_or(self.content_chunks),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    #[test]
    fn sse_payloads_survive_any_split_and_crlf() {
        let stream = b"data: {\"a\":1}\r\n\r\n: comment\n\ndata:{\"b\":2}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut sse = SseData::default();
            let mut got = sse.push(&stream[..cut]);
            got.extend(sse.push(&stream[cut..]));
            assert_eq!(got, ["{\"a\":1}", "{\"b\":2}", "[DONE]"], "cut at {cut}");
        }
    }

    fn chunk(text: &str, tokens: Option<u64>) -> Value {
        let mut v = json!({ "choices": [{ "index": 0, "text": text }] });
        if let Some(t) = tokens {
            v["usage"] = json!({ "prompt_tokens": 7, "completion_tokens": t });
        }
        v
    }

    #[test]
    fn a_chunk_carrying_several_tokens_spreads_its_gap_over_them() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t = Timing::new(t0);
        t.chunk(ms(100), &chunk("a", Some(1)), Endpoint::Completions);
        t.chunk(ms(130), &chunk("bc", Some(3)), Endpoint::Completions);
        t.chunk(ms(140), &chunk("", Some(4)), Endpoint::Completions); // held back by the detokenizer
        t.chunk(ms(160), &chunk("de", Some(5)), Endpoint::Completions);
        t.chunk(
            ms(161),
            &json!({ "choices": [], "usage": { "prompt_tokens": 7, "completion_tokens": 5 } }),
            Endpoint::Completions,
        );
        let o = t.finish(ms(170));
        assert!((o.ttft - 0.100).abs() < 1e-9);
        assert!((o.latency - 0.170).abs() < 1e-9);
        assert_eq!((o.output_tokens, o.prompt_tokens), (5, Some(7)));
        let itl: Vec<u64> = o.itl.iter().map(|x| (x * 1e6).round() as u64).collect();
        assert_eq!(itl, [15_000, 15_000, 15_000, 15_000]);
    }

    #[test]
    fn without_usage_each_content_chunk_counts_as_one_token() {
        let t0 = Instant::now();
        let mut t = Timing::new(t0);
        for i in 1..=3 {
            let v = json!({ "choices": [{ "delta": { "content": "x" } }] });
            t.chunk(t0 + Duration::from_millis(10 * i), &v, Endpoint::Chat);
        }
        let o = t.finish(t0 + Duration::from_millis(40));
        assert_eq!((o.output_tokens, o.itl.len(), o.prompt_tokens), (3, 2, None));
    }
}
