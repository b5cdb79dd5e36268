//! Benchmark metrics, computed as SGLang's bench_serving does (numpy percentiles with linear
//! interpolation, population standard deviation) and printed in its summary layout.

use std::fmt::Write as _;

use serde::Serialize;

use super::client::Outcome;
use super::dataset::Row;

#[derive(Serialize, Debug, Default)]
pub struct Metrics {
    pub duration: f64,
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_throughput: f64,
    /// Mean requests in flight: the sum of E2E latencies over the duration.
    pub concurrency: f64,
    pub mean_e2e_latency_ms: f64,
    pub median_e2e_latency_ms: f64,
    pub std_e2e_latency_ms: f64,
    pub p99_e2e_latency_ms: f64,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub std_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_itl_ms: f64,
    pub median_itl_ms: f64,
    pub std_itl_ms: f64,
    pub p95_itl_ms: f64,
    pub p99_itl_ms: f64,
    pub max_itl_ms: f64,
}

/// numpy.percentile's default (linear); 0 for no samples, as SGLang reports an empty list.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => {
            let rank = p / 100.0 * (n - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() { 0.0 } else { xs.iter().fold(0.0, |a, x| a + x) / xs.len() as f64 }
}

fn std_dev(xs: &[f64]) -> f64 {
    let m = mean(xs);
    mean(&xs.iter().map(|x| (x - m) * (x - m)).collect::<Vec<_>>()).sqrt()
}

/// Seconds in, sorted milliseconds out.
fn sorted_ms(mut xs: Vec<f64>) -> Vec<f64> {
    xs.iter_mut().for_each(|x| *x *= 1e3);
    xs.sort_by(f64::total_cmp);
    xs
}

impl Metrics {
    pub fn compute(rows: &[Row], outcomes: &[Outcome], duration: f64) -> Self {
        let ok: Vec<(&Row, &Outcome)> = rows.iter().zip(outcomes).filter(|(_, o)| o.success).collect();
        let input: u64 = ok.iter().map(|(r, o)| o.prompt_tokens.unwrap_or(r.prompt_len as u64)).sum();
        let output: u64 = ok.iter().map(|(_, o)| o.output_tokens).sum();
        let e2e = sorted_ms(ok.iter().map(|(_, o)| o.latency).collect());
        let ttft = sorted_ms(ok.iter().map(|(_, o)| o.ttft).collect());
        let itl = sorted_ms(ok.iter().flat_map(|(_, o)| o.itl.iter().copied()).collect());
        let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
        Self {
            duration,
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: per_s(ok.len() as f64),
            input_throughput: per_s(input as f64),
            output_throughput: per_s(output as f64),
            total_throughput: per_s((input + output) as f64),
            concurrency: per_s(e2e.iter().fold(0.0, |a, x| a + x) / 1e3),
            mean_e2e_latency_ms: mean(&e2e),
            median_e2e_latency_ms: percentile(&e2e, 50.0),
            std_e2e_latency_ms: std_dev(&e2e),
            p99_e2e_latency_ms: percentile(&e2e, 99.0),
            mean_ttft_ms: mean(&ttft),
            median_ttft_ms: percentile(&ttft, 50.0),
            std_ttft_ms: std_dev(&ttft),
            p99_ttft_ms: percentile(&ttft, 99.0),
            mean_itl_ms: mean(&itl),
            median_itl_ms: percentile(&itl, 50.0),
            std_itl_ms: std_dev(&itl),
            p95_itl_ms: percentile(&itl, 95.0),
            p99_itl_ms: percentile(&itl, 99.0),
            max_itl_ms: itl.last().copied().unwrap_or(0.0),
        }
    }
}

/// The run's settings shown at the top of the summary.
pub struct Header<'a> {
    pub backend: &'a str,
    pub request_rate: f64,
    pub max_concurrency: Option<usize>,
}

/// Python's `str(float)` for the rate: "inf", "16.0".
pub fn rate_label(rate: f64) -> String {
    if rate.is_infinite() { "inf".into() } else { format!("{rate:?}") }
}

fn title(out: &mut String, text: &str, fill: char) {
    let pad = 50usize.saturating_sub(text.chars().count());
    let fill = |n| std::iter::repeat_n(fill, n).collect::<String>();
    let _ = writeln!(out, "{}{text}{}", fill(pad / 2), fill(pad - pad / 2));
}

/// The summary block, line for line SGLang's (its retokenized-token count needs a tokenizer and is
/// left out; "Failed requests" appears only when some failed).
pub fn summary(h: &Header, m: &Metrics) -> String {
    let mut s = String::new();
    let line = |s: &mut String, label: &str, value: String| {
        let _ = writeln!(s, "{label:<40} {value:<10}");
    };
    let f2 = |x: f64| format!("{x:.2}");
    s.push('\n');
    title(&mut s, " Serving Benchmark Result ", '=');
    line(&mut s, "Backend:", h.backend.into());
    line(&mut s, "Traffic request rate:", rate_label(h.request_rate));
    line(&mut s, "Max request concurrency:", h.max_concurrency.map_or("not set".into(), |c| c.to_string()));
    line(&mut s, "Successful requests:", m.completed.to_string());
    if m.failed > 0 {
        line(&mut s, "Failed requests:", m.failed.to_string());
    }
    line(&mut s, "Benchmark duration (s):", f2(m.duration));
    line(&mut s, "Total input tokens:", m.total_input_tokens.to_string());
    line(&mut s, "Total generated tokens:", m.total_output_tokens.to_string());
    line(&mut s, "Request throughput (req/s):", f2(m.request_throughput));
    line(&mut s, "Input token throughput (tok/s):", f2(m.input_throughput));
    line(&mut s, "Output token throughput (tok/s):", f2(m.output_throughput));
    line(&mut s, "Total token throughput (tok/s):", f2(m.total_throughput));
    line(&mut s, "Concurrency:", f2(m.concurrency));
    title(&mut s, "End-to-End Latency", '-');
    line(&mut s, "Mean E2E Latency (ms):", f2(m.mean_e2e_latency_ms));
    line(&mut s, "Median E2E Latency (ms):", f2(m.median_e2e_latency_ms));
    title(&mut s, "Time to First Token", '-');
    line(&mut s, "Mean TTFT (ms):", f2(m.mean_ttft_ms));
    line(&mut s, "Median TTFT (ms):", f2(m.median_ttft_ms));
    line(&mut s, "P99 TTFT (ms):", f2(m.p99_ttft_ms));
    title(&mut s, "Inter-Token Latency", '-');
    line(&mut s, "Mean ITL (ms):", f2(m.mean_itl_ms));
    line(&mut s, "Median ITL (ms):", f2(m.median_itl_ms));
    line(&mut s, "P95 ITL (ms):", f2(m.p95_itl_ms));
    line(&mut s, "P99 ITL (ms):", f2(m.p99_itl_ms));
    line(&mut s, "Max ITL (ms):", f2(m.max_itl_ms));
    s.push_str(&"=".repeat(50));
    s.push('\n');
    s
}

/// Distinct error messages in first-seen order, with how often each occurred.
pub fn error_counts(outcomes: &[Outcome]) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    for o in outcomes.iter().filter(|o| !o.success) {
        match out.iter_mut().find(|(e, _)| *e == o.error) {
            Some((_, n)) => *n += 1,
            None => out.push((o.error.clone(), 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::dataset::Prompt;
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let xs = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&xs, 50.0), 2.5);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&xs, 100.0), 4.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert!((std_dev(&xs) - 1.118_033_988_749_895).abs() < 1e-12);
    }

    #[test]
    fn titles_are_centred_in_fifty_columns_like_python_format() {
        let mut s = String::new();
        title(&mut s, " Serving Benchmark Result ", '=');
        title(&mut s, "End-to-End Latency", '-');
        assert_eq!(
            s,
            "============ Serving Benchmark Result ============\n----------------End-to-End Latency----------------\n"
        );
    }

    #[test]
    fn a_run_with_no_successes_reports_zeros_not_negative_zeros() {
        let rows = [Row { prompt: Prompt::Text("x".into()), prompt_len: 1, output_len: 1 }];
        let m = Metrics::compute(&rows, &[Outcome { error: "down".into(), ..Outcome::default() }], 0.5);
        assert_eq!((m.completed, m.failed), (0, 1));
        let h = Header { backend: "openai", request_rate: f64::INFINITY, max_concurrency: None };
        let s = summary(&h, &m);
        assert!(!s.contains("-0.00"), "{s}");
        assert!(s.contains("Failed requests:                         1"), "{s}");
        assert!(s.contains("Max request concurrency:                 not set"), "{s}");
        assert_eq!(error_counts(&[]), []);
    }

    #[test]
    fn rate_prints_as_python_would() {
        assert_eq!(rate_label(f64::INFINITY), "inf");
        assert_eq!(rate_label(16.0), "16.0");
        assert_eq!(rate_label(2.5), "2.5");
    }
}
