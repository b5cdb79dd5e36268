//! `tandem bench`: a serving benchmark client for any OpenAI-compatible server, after SGLang's
//! `bench_serving`. It sends `--num-prompts` requests with Poisson arrivals at `--request-rate`, at most
//! `--max-concurrency` in flight, times each (TTFT, inter-token latencies, E2E), and prints SGLang's
//! summary block; `--json` writes the numbers. Requests ask for exactly `output_len` tokens
//! (`max_tokens`, `ignore_eos`), greedy unless `--temperature` says otherwise.

mod client;
mod dataset;
mod report;
mod stream;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;
use tokio::sync::Semaphore;

use client::{Client, Endpoint, Outcome};
use dataset::{DatasetKind, Row, Spec, TOKEN_ID_FLOOR};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Server to benchmark.
    #[arg(long, default_value = client::DEFAULT_URL)]
    pub base_url: String,
    /// Model name in the requests (default: the first id from GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    #[arg(long, value_enum, default_value_t = DatasetKind::Random)]
    pub dataset: DatasetKind,
    /// Prompt length in tokens (chat prompts: words, the server's usage gives the exact count).
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Random dataset: lengths uniform in [len * ratio, len] (SGLang's semantics; 1.0 = exact).
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Token ids in random prompts are drawn from [100, vocab-size).
    #[arg(long, default_value_t = 1000)]
    pub vocab_size: u32,
    /// Requests in the measured run.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Requests per second, Poisson arrivals; inf sends all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// At most this many requests in flight (default: no limit).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Seeds prompts, lengths and arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stream responses over SSE (the default).
    #[arg(long, overrides_with = "no_stream")]
    pub stream: bool,
    /// Plain JSON responses: only E2E latency is measured (TTFT = E2E, no ITL).
    #[arg(long, overrides_with = "stream")]
    pub no_stream: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Let requests stop at EOS (output lengths are then no longer exact).
    #[arg(long)]
    pub disable_ignore_eos: bool,
    /// Requests sent (and awaited) before the measured run; they also check that the server answers.
    #[arg(long, default_value_t = 1)]
    pub warmup_requests: usize,
    /// Bearer token for the server.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Write the results as one JSON object to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Add per-request input/output lengths, TTFTs, latencies and errors to the JSON.
    #[arg(long)]
    pub output_details: bool,
    /// No progress bar (it is drawn on stderr, and only on a terminal).
    #[arg(long)]
    pub disable_progress: bool,
}

impl Args {
    fn check(&self) -> anyhow::Result<()> {
        ensure!(self.num_prompts > 0, "--num-prompts must be at least 1");
        ensure!(self.input_len > 0 && self.output_len > 0, "--input-len and --output-len must be at least 1");
        ensure!((0.0..=1.0).contains(&self.random_range_ratio), "--random-range-ratio must be in [0, 1]");
        ensure!(self.request_rate > 0.0, "--request-rate must be positive (or inf)");
        ensure!(self.max_concurrency != Some(0), "--max-concurrency must be at least 1");
        ensure!(self.vocab_size > TOKEN_ID_FLOOR, "--vocab-size must exceed {TOKEN_ID_FLOOR}");
        ensure!(
            self.base_url.starts_with("http://"),
            "--base-url must be an http:// URL (got {}); this client speaks plain HTTP",
            self.base_url
        );
        Ok(())
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    args.check()?;
    let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    rt.block_on(bench(args))
}

async fn bench(args: Args) -> anyhow::Result<ExitCode> {
    let base = args.base_url.trim_end_matches('/').to_owned();
    let http = client::http_client()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => client::first_model(&http, &base, args.api_key.as_deref()).await?,
    };
    let mut rng = StdRng::seed_from_u64(args.seed);
    let spec = Spec {
        kind: args.dataset,
        input_len: args.input_len,
        output_len: args.output_len,
        range_ratio: args.random_range_ratio,
        vocab_size: args.vocab_size,
        text: args.endpoint == Endpoint::Chat,
    };
    let rows = Arc::new(spec.generate(args.num_prompts, &mut rng));
    println!("#Input tokens: {}", rows.iter().map(|r| r.prompt_len).sum::<usize>());
    println!("#Output tokens: {}", rows.iter().map(|r| r.output_len).sum::<usize>());

    let client = Arc::new(Client {
        http,
        url: format!("{base}{}", args.endpoint.path()),
        endpoint: args.endpoint,
        model: model.clone(),
        api_key: args.api_key.clone(),
        stream: !args.no_stream,
        temperature: args.temperature,
        ignore_eos: !args.disable_ignore_eos,
    });
    warmup(&client, &rows[0], args.warmup_requests).await?;

    let bar = progress(rows.len(), args.disable_progress);
    let start = Instant::now();
    let outcomes = dispatch(&client, &rows, &args, &mut rng, &bar).await;
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();

    let metrics = report::Metrics::compute(&rows, &outcomes, duration);
    let header = report::Header {
        backend: args.endpoint.backend(),
        request_rate: args.request_rate,
        max_concurrency: args.max_concurrency,
    };
    print!("{}", report::summary(&header, &metrics));
    let errors = report::error_counts(&outcomes);
    for (e, n) in errors.iter().take(5) {
        println!("error ({n}x): {e}");
    }
    if let Some(path) = &args.json {
        write_json(path, &args, &model, &metrics, &errors, &rows, &outcomes)?;
    }
    if metrics.completed == 0 {
        let first = errors.first().map_or("none recorded", |(e, _)| e.as_str());
        bail!("all {} requests failed; first error: {first}", outcomes.len());
    }
    Ok(ExitCode::SUCCESS)
}

/// Sends the first prompt `n` times at once (at most 32 output tokens, like SGLang) so connection set-up
/// and lazy initialisation stay out of the numbers; fails when none succeeds.
async fn warmup(client: &Client, row: &Row, n: usize) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    println!("Starting warmup with {n} sequences...");
    let out = futures::future::join_all((0..n).map(|_| client.send(row, row.output_len.min(32)))).await;
    if out.iter().all(|o| !o.success) {
        bail!("warmup failed, so the benchmark did not start: {} (check --base-url and --model)", out[0].error);
    }
    println!("Warmup completed with {n} sequences. Starting main benchmark run...");
    Ok(())
}

fn progress(n: usize, disabled: bool) -> ProgressBar {
    if disabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{wide_bar} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]")
    {
        bar.set_style(style);
    }
    bar
}

/// Starts each request at its arrival time (Poisson: exponential gaps); the concurrency limit is
/// taken inside the request, so a full server delays requests without delaying arrivals.
async fn dispatch(
    client: &Arc<Client>,
    rows: &Arc<Vec<Row>>,
    args: &Args,
    rng: &mut StdRng,
    bar: &ProgressBar,
) -> Vec<Outcome> {
    let limit = args.max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
    let mut tasks = Vec::with_capacity(rows.len());
    let n = rows.len();
    for i in 0..n {
        let (client, rows, limit, bar) = (client.clone(), rows.clone(), limit.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = match &limit {
                Some(s) => s.clone().acquire_owned().await.ok(),
                None => None,
            };
            let out = client.send(&rows[i], rows[i].output_len).await;
            bar.inc(1);
            out
        }));
        if args.request_rate.is_finite() && i + 1 < n {
            let u: f64 = rng.random();
            tokio::time::sleep(Duration::from_secs_f64(-(1.0 - u).ln() / args.request_rate)).await;
        }
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(
            t.await.unwrap_or_else(|e| Outcome { error: format!("request task failed: {e}"), ..Outcome::default() }),
        );
    }
    outcomes
}

fn write_json(
    path: &PathBuf,
    args: &Args,
    model: &str,
    m: &report::Metrics,
    errors: &[(String, usize)],
    rows: &[Row],
    outcomes: &[Outcome],
) -> anyhow::Result<()> {
    let mut v = json!({
        "backend": args.endpoint.backend(),
        "base_url": args.base_url,
        "endpoint": args.endpoint.name(),
        "model": model,
        "dataset_name": args.dataset.name(),
        "num_prompts": args.num_prompts,
        "random_input_len": args.input_len,
        "random_output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": if args.request_rate.is_finite() { json!(args.request_rate) } else { json!("inf") },
        "max_concurrency": args.max_concurrency,
        "stream": !args.no_stream,
        "temperature": args.temperature,
        "seed": args.seed,
        "errors": errors.iter().take(10).map(|(e, n)| json!({ "error": e, "count": n })).collect::<Vec<_>>(),
    });
    if let (Some(obj), serde_json::Value::Object(metrics)) = (v.as_object_mut(), serde_json::to_value(m)?) {
        obj.extend(metrics);
    }
    if args.output_details {
        v["input_lens"] = json!(
            rows.iter().zip(outcomes).map(|(r, o)| o.prompt_tokens.unwrap_or(r.prompt_len as u64)).collect::<Vec<_>>()
        );
        v["output_lens"] = json!(outcomes.iter().map(|o| o.output_tokens).collect::<Vec<_>>());
        v["ttfts"] = json!(outcomes.iter().map(|o| o.ttft).collect::<Vec<_>>());
        v["latencies"] = json!(outcomes.iter().map(|o| o.latency).collect::<Vec<_>>());
        v["itls"] = json!(outcomes.iter().map(|o| &o.itl).collect::<Vec<_>>());
        v["request_errors"] = json!(outcomes.iter().map(|o| &o.error).collect::<Vec<_>>());
    }
    let text = serde_json::to_string_pretty(&v)? + "\n";
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
