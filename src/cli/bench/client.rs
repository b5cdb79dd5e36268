//! One benchmark request: build the OpenAI body, send it, and read the answer (timed by `stream`).

use std::error::Error as StdError;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use super::dataset::{Prompt, Row};
use super::stream::{SseData, Timing};

/// Where `tandem up` serves, and `--base-url`'s default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8000";

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// POST /v1/completions (token-id prompts).
    Completions,
    /// POST /v1/chat/completions (text prompts).
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::Chat => "/v1/chat/completions",
        }
    }

    /// The "Backend:" label of the summary, after SGLang's names for OpenAI-protocol backends.
    pub fn backend(self) -> &'static str {
        match self {
            Self::Completions => "openai",
            Self::Chat => "openai-chat",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Completions => "completions",
            Self::Chat => "chat",
        }
    }
}

/// What one request measured. Times in seconds.
#[derive(Debug, Default)]
pub struct Outcome {
    pub success: bool,
    pub error: String,
    pub ttft: f64,
    pub latency: f64,
    pub itl: Vec<f64>,
    /// The server's count (`usage.prompt_tokens`), when it sent one.
    pub prompt_tokens: Option<u64>,
    pub output_tokens: u64,
}

impl Outcome {
    fn failed(error: String, start: Instant) -> Self {
        Self { error, latency: start.elapsed().as_secs_f64(), ..Self::default() }
    }
}

/// An error with its sources, e.g. "error sending request: client error (Connect): Connection refused".
pub fn chain(e: &dyn StdError) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = c.source();
    }
    s
}

fn describe(e: &reqwest::Error, url: &str) -> String {
    if e.is_connect() { format!("cannot connect to {url}: {}", chain(e)) } else { chain(e) }
}

pub fn http_client() -> anyhow::Result<reqwest::Client> {
    // Direct connections only: a proxy from the environment would be measured along with the server.
    Ok(reqwest::Client::builder().no_proxy().connect_timeout(Duration::from_secs(10)).tcp_nodelay(true).build()?)
}

/// The first model id from `GET /v1/models`.
pub async fn first_model(http: &reqwest::Client, base: &str, api_key: Option<&str>) -> anyhow::Result<String> {
    let url = format!("{base}/v1/models");
    let mut req = http.get(&url);
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the server at {base}: {} (is it running? `tandem up` serves {DEFAULT_URL})",
            chain(&e)
        )
    })?;
    let status = resp.status();
    let body = resp.text().await.map_err(|e| anyhow::anyhow!("reading {url}: {}", chain(&e)))?;
    if !status.is_success() {
        anyhow::bail!("GET {url} answered {status}: {}", error_message(&body));
    }
    let v: Value = serde_json::from_str(&body).map_err(|e| anyhow::anyhow!("GET {url}: not JSON ({e})"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("GET {url} lists no model; pass --model"))
}

/// An OpenAI error body's message, or the body itself (shortened).
fn error_message(body: &str) -> String {
    match serde_json::from_str::<Value>(body) {
        Ok(v) if v["error"]["message"].is_string() => v["error"]["message"].as_str().unwrap_or_default().to_owned(),
        _ => body.chars().take(300).collect(),
    }
}

pub struct Client {
    pub http: reqwest::Client,
    pub url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub api_key: Option<String>,
    pub stream: bool,
    pub temperature: f64,
    pub ignore_eos: bool,
}

impl Client {
    fn body(&self, row: &Row, output_len: usize) -> Value {
        let mut b = json!({
            "model": self.model,
            "max_tokens": output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": self.stream,
        });
        match (&row.prompt, self.endpoint) {
            (Prompt::Tokens(ids), _) => b["prompt"] = json!(ids),
            (Prompt::Text(t), Endpoint::Completions) => b["prompt"] = json!(t),
            (Prompt::Text(t), Endpoint::Chat) => b["messages"] = json!([{ "role": "user", "content": t }]),
        }
        if self.stream {
            b["stream_options"] = json!({ "include_usage": true, "continuous_usage_stats": true });
        }
        b
    }

    /// Sends `row` (asking for `output_len` tokens) and measures the answer; never fails, the outcome says.
    pub async fn send(&self, row: &Row, output_len: usize) -> Outcome {
        let mut req = self.http.post(&self.url).json(&self.body(row, output_len));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let start = Instant::now();
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => return Outcome::failed(describe(&e, &self.url), start),
        };
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Outcome::failed(format!("HTTP {}: {}", status.as_u16(), error_message(&body)), start);
        }
        if self.stream { self.read_stream(resp, start).await } else { self.read_body(resp, start).await }
    }

    async fn read_body(&self, resp: reqwest::Response, start: Instant) -> Outcome {
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return Outcome::failed(describe(&e, &self.url), start),
        };
        let latency = start.elapsed().as_secs_f64();
        let v: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return Outcome::failed(format!("response is not JSON: {e}"), start),
        };
        if v.get("error").is_some() {
            return Outcome::failed(error_message(&v.to_string()), start);
        }
        Outcome {
            success: true,
            ttft: latency,
            latency,
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64(),
            output_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
            ..Outcome::default()
        }
    }

    async fn read_stream(&self, resp: reqwest::Response, start: Instant) -> Outcome {
        let mut timing = Timing::new(start);
        let mut sse = SseData::default();
        let mut body = resp.bytes_stream();
        while let Some(piece) = body.next().await {
            let piece = match piece {
                Ok(p) => p,
                Err(e) => return Outcome::failed(format!("stream broke: {}", describe(&e, &self.url)), start),
            };
            let now = Instant::now();
            for data in sse.push(&piece) {
                if data == "[DONE]" {
                    return timing.finish(now);
                }
                let v: Value = match serde_json::from_str(&data) {
                    Ok(v) => v,
                    Err(e) => return Outcome::failed(format!("bad SSE event ({e}): {data}"), start),
                };
                if v.get("error").is_some() {
                    return Outcome::failed(format!("error event: {}", error_message(&data)), start);
                }
                timing.chunk(now, &v, self.endpoint);
            }
        }
        Outcome::failed("the stream ended without data: [DONE]".into(), start)
    }
}
