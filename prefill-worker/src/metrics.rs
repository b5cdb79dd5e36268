//! The prefill worker's Prometheus metrics.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub struct PrefillMetrics {
    pub requests: IntCounterVec,
    pub queued: IntGauge,
    pub running: IntGauge,
    pub prompt_tokens: IntCounter,
    pub computed_tokens: IntCounter,
    pub cached_tokens: IntCounter,
    pub prefix_cache_blocks: IntGauge,
    pub kv_blocks_free: IntGauge,
    pub batch_seconds: Histogram,
    pub batch_tokens: Histogram,
    pub queue_seconds: Histogram,
    pub transfer_seconds: Histogram,
    pub transfer_bytes: IntCounter,
}

fn secs() -> Vec<f64> {
    vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
}

impl PrefillMetrics {
    pub fn new(r: &Registry) -> prometheus::Result<Self> {
        let m = PrefillMetrics {
            requests: IntCounterVec::new(
                Opts::new("tandem_prefill_requests_total", "Prefills by outcome"),
                &["outcome"],
            )?,
            queued: IntGauge::new("tandem_prefill_queued", "Prefills waiting to start")?,
            running: IntGauge::new("tandem_prefill_running", "Prefills in progress (chunked ones span batches)")?,
            prompt_tokens: IntCounter::new("tandem_prefill_prompt_tokens_total", "Tokens of prefilled sequences")?,
            computed_tokens: IntCounter::new("tandem_prefill_computed_tokens_total", "Tokens actually computed")?,
            cached_tokens: IntCounter::new(
                "tandem_prefill_cached_tokens_total",
                "Tokens served from the prefix cache",
            )?,
            prefix_cache_blocks: IntGauge::new("tandem_prefix_cache_blocks", "Blocks held by the prefix cache")?,
            kv_blocks_free: IntGauge::new("tandem_kv_blocks_free", "Cache blocks neither used nor cached")?,
            batch_seconds: Histogram::with_opts(
                HistogramOpts::new("tandem_prefill_batch_seconds", "One prefill batch (all layers, MTP included)")
                    .buckets(secs()),
            )?,
            batch_tokens: Histogram::with_opts(
                HistogramOpts::new("tandem_prefill_batch_tokens", "Tokens per prefill batch")
                    .buckets(vec![16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]),
            )?,
            queue_seconds: Histogram::with_opts(
                HistogramOpts::new("tandem_prefill_queue_seconds", "Arrival to the first batch").buckets(secs()),
            )?,
            transfer_seconds: Histogram::with_opts(
                HistogramOpts::new("tandem_kv_transfer_seconds", "Handshake to the receiver's verified completion")
                    .buckets(secs()),
            )?,
            transfer_bytes: IntCounter::new("tandem_kv_transfer_bytes_total", "Cache bytes shipped")?,
        };
        r.register(Box::new(m.requests.clone()))?;
        r.register(Box::new(m.queued.clone()))?;
        r.register(Box::new(m.running.clone()))?;
        r.register(Box::new(m.prompt_tokens.clone()))?;
        r.register(Box::new(m.computed_tokens.clone()))?;
        r.register(Box::new(m.cached_tokens.clone()))?;
        r.register(Box::new(m.prefix_cache_blocks.clone()))?;
        r.register(Box::new(m.kv_blocks_free.clone()))?;
        r.register(Box::new(m.batch_seconds.clone()))?;
        r.register(Box::new(m.batch_tokens.clone()))?;
        r.register(Box::new(m.queue_seconds.clone()))?;
        r.register(Box::new(m.transfer_seconds.clone()))?;
        r.register(Box::new(m.transfer_bytes.clone()))?;
        Ok(m)
    }
}
