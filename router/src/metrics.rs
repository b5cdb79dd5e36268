//! Prometheus metrics (`GET /metrics`). All names start with `tandem_router_`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    /// Finished requests by endpoint ("completions", "chat", "grpc") and HTTP status.
    pub requests: IntCounterVec,
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub e2e: HistogramVec,
    /// Requests waiting for a running slot.
    pub queue_depth: IntGauge,
    /// Requests being served.
    pub running: IntGauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub cached_prompt_tokens: IntCounter,
    /// Retries by reason (prefill_failed, decode_unavailable, decode_full, preempted).
    pub retries: IntCounterVec,
    /// Worker-reported stage timings: prefill_queue, prefill, kv_transfer, first_decode_step.
    pub stage: HistogramVec,
    pub kv_transfer_bytes: IntCounter,
    /// Per worker: running, queued, queued_tokens, kv_blocks_free, kv_blocks_total, router_in_flight.
    pub worker_load: IntGaugeVec,
    /// Per worker: 1 healthy, 0 not.
    pub worker_healthy: IntGaugeVec,
    /// Per worker: 1 while its circuit breaker is open.
    pub worker_breaker_open: IntGaugeVec,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0,
];

fn hist(r: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<HistogramVec, prometheus::Error> {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()), labels)?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntCounterVec, prometheus::Error> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter(r: &Registry, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
    let c = IntCounter::new(name, help)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec, prometheus::Error> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn gauge(r: &Registry, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
    let g = IntGauge::new(name, help)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let r = Registry::new();
        Ok(Self {
            requests: counter_vec(
                &r,
                "tandem_router_requests_total",
                "Finished requests by endpoint and status",
                &["endpoint", "status"],
            )?,
            ttft: hist(
                &r,
                "tandem_router_time_to_first_token_seconds",
                "Time from request arrival to the first token",
                &["endpoint"],
            )?,
            itl: hist(
                &r,
                "tandem_router_inter_token_latency_seconds",
                "Gap between consecutive output tokens",
                &["endpoint"],
            )?,
            e2e: hist(&r, "tandem_router_e2e_request_latency_seconds", "Request arrival to last token", &["endpoint"])?,
            queue_depth: gauge(&r, "tandem_router_queue_depth", "Requests waiting for a running slot")?,
            running: gauge(&r, "tandem_router_running_requests", "Requests being served")?,
            prompt_tokens: counter(&r, "tandem_router_prompt_tokens_total", "Prompt tokens of served requests")?,
            generation_tokens: counter(&r, "tandem_router_generation_tokens_total", "Generated tokens")?,
            cached_prompt_tokens: counter(
                &r,
                "tandem_router_cached_prompt_tokens_total",
                "Prompt tokens served from prefix caches",
            )?,
            retries: counter_vec(
                &r,
                "tandem_router_retries_total",
                "Attempts repeated on another worker, by reason",
                &["reason"],
            )?,
            stage: hist(
                &r,
                "tandem_router_stage_seconds",
                "Worker-reported stage time: prefill_queue, prefill, kv_transfer, first_decode_step",
                &["stage"],
            )?,
            kv_transfer_bytes: counter(
                &r,
                "tandem_router_kv_transfer_bytes_total",
                "Cache bytes shipped prefill -> decode",
            )?,
            worker_load: gauge_vec(
                &r,
                "tandem_router_worker_load",
                "Last load report per worker",
                &["role", "worker", "metric"],
            )?,
            worker_healthy: gauge_vec(
                &r,
                "tandem_router_worker_healthy",
                "1 when the worker answers health polls",
                &["role", "worker"],
            )?,
            worker_breaker_open: gauge_vec(
                &r,
                "tandem_router_worker_circuit_open",
                "1 while the worker's circuit breaker is open",
                &["role", "worker"],
            )?,
            registry: r,
        })
    }

    /// Text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Forgets a departed worker's series.
    pub fn remove_worker(&self, role: &str, worker: &str) {
        for m in ["running", "queued", "queued_tokens", "kv_blocks_free", "kv_blocks_total", "router_in_flight"] {
            let _ = self.worker_load.remove_label_values(&[role, worker, m]);
        }
        let _ = self.worker_healthy.remove_label_values(&[role, worker]);
        let _ = self.worker_breaker_open.remove_label_values(&[role, worker]);
    }
}
