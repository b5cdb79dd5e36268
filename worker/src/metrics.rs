//! The worker's Prometheus endpoint: `GET /metrics` (text format), `GET /health` (the process is up) and
//! `GET /ready` (503 once the worker drains: the readiness probe where the gRPC port speaks TLS, which
//! Kubernetes gRPC probes cannot).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use prometheus::{Encoder, IntCounter, Registry, TextEncoder};

use crate::Drain;

/// Serves `registry` on `addr`, plus the engine's process-wide counters; returns the bound address. Adds
/// `tandem_cache_arenas_created`: cache arenas this process created, which stays at its startup value while
/// the worker serves (the pool is allocated once, before ready).
///
/// Under expert parallelism (`backend` in a group) it adds the experts' load balance, read at each scrape:
/// `tandem_expert_imbalance{placement="sharded"|"placed"}` (the busiest GPU's routed pairs over the mean
/// over the last window, summed over the MoE layers: what balancing would gain, and what it gives),
/// `tandem_expert_balance_looks`, `tandem_expert_layers_moved`, `tandem_expert_copies_received`.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    drain: Arc<Drain>,
    backend: Option<Arc<dyn engine::Backend>>,
) -> anyhow::Result<SocketAddr> {
    let balance = match backend.filter(|b| b.expert_balance().is_some()) {
        Some(b) => Some((b, BalanceGauges::register(&registry)?)),
        None => None,
    };
    let nan_scores = IntCounter::new(
        "tandem_indexer_nan_scores_total",
        "Indexer scores that were NaN and so never selected (a sign of overflow in the model or its weights)",
    )?;
    registry.register(Box::new(nan_scores.clone()))?;
    let arenas = prometheus::IntGauge::new(
        "tandem_cache_arenas_created",
        "Cache arenas this process allocated (once, at startup: nothing is allocated per request)",
    )?;
    registry.register(Box::new(arenas.clone()))?;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                let nan_scores = nan_scores.clone();
                arenas.set(engine::cache::arenas_created() as i64);
                if let Some((b, g)) = &balance
                    && let Some(eb) = b.expert_balance()
                {
                    g.set(&eb);
                }
                async move {
                    nan_scores.inc_by(engine::cpu::topk::nan_scores_total().saturating_sub(nan_scores.get()));
                    let mut buf = Vec::new();
                    let enc = TextEncoder::new();
                    if let Err(e) = enc.encode(&registry.gather(), &mut buf) {
                        return ([(CONTENT_TYPE, "text/plain".to_string())], format!("# encode error: {e}\n"));
                    }
                    ([(CONTENT_TYPE, enc.format_type().to_string())], String::from_utf8_lossy(&buf).into_owned())
                }
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get(move || {
                let draining = drain.is_draining();
                async move {
                    if draining { (StatusCode::SERVICE_UNAVAILABLE, "draining") } else { (StatusCode::OK, "ready") }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tracing::info!(addr = %bound, "metrics on /metrics");
    Ok(bound)
}

/// The expert-balance gauges ([`serve`]).
#[derive(Clone)]
struct BalanceGauges {
    imbalance: prometheus::GaugeVec,
    looks: prometheus::IntGauge,
    moved: prometheus::IntGauge,
    received: prometheus::IntGauge,
}

impl BalanceGauges {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        let g = BalanceGauges {
            imbalance: prometheus::GaugeVec::new(
                prometheus::Opts::new(
                    "tandem_expert_imbalance",
                    "The busiest GPU's routed pairs over the mean, over the last window (1 is balanced)",
                ),
                &["placement"],
            )?,
            looks: prometheus::IntGauge::new("tandem_expert_balance_looks", "Looks at the group's expert loads")?,
            moved: prometheus::IntGauge::new("tandem_expert_layers_moved", "MoE layers whose experts were moved")?,
            received: prometheus::IntGauge::new(
                "tandem_expert_copies_received",
                "Expert copies this rank received from others",
            )?,
        };
        registry.register(Box::new(g.imbalance.clone()))?;
        registry.register(Box::new(g.looks.clone()))?;
        registry.register(Box::new(g.moved.clone()))?;
        registry.register(Box::new(g.received.clone()))?;
        Ok(g)
    }

    fn set(&self, b: &engine::ExpertBalance) {
        self.imbalance.with_label_values(&["sharded"]).set(b.imbalance_sharded);
        self.imbalance.with_label_values(&["placed"]).set(b.imbalance_placed);
        self.looks.set(b.looks as i64);
        self.moved.set(b.layers_moved as i64);
        self.received.set(b.copies_received as i64);
    }
}

/// A role's metrics, made by `register` in a fresh registry and [`serve`]d on `addr` (`--metrics-listen`)
/// when it is given, `/ready` following `drain`, the experts' balance from `backend`; with the bound
/// address.
pub async fn start<M>(
    addr: Option<SocketAddr>,
    drain: Arc<Drain>,
    backend: Arc<dyn engine::Backend>,
    register: impl FnOnce(&Registry) -> prometheus::Result<M>,
) -> anyhow::Result<(std::sync::Arc<M>, Option<SocketAddr>)> {
    let registry = Registry::new();
    let metrics = register(&registry)?;
    let bound = match addr {
        Some(a) => Some(serve(a, registry, drain, Some(backend)).await?),
        None => None,
    };
    Ok((std::sync::Arc::new(metrics), bound))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn metrics_report_the_engines_nan_indexer_scores() {
        // Two NaN scores in a row longer than k: counted by the process-wide counter.
        assert_eq!(engine::cpu::topk::select(&[f32::NAN, 1.0, f32::NAN, 0.0], 1), vec![1]);
        let seen = engine::cpu::topk::nan_scores_total();
        assert!(seen >= 2);
        let drain = crate::Drain::new();
        let addr =
            super::serve("127.0.0.1:0".parse().unwrap(), prometheus::Registry::new(), drain, None).await.unwrap();
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).await.unwrap();
        let line = body
            .lines()
            .find(|l| l.starts_with("tandem_indexer_nan_scores_total "))
            .unwrap_or_else(|| panic!("no counter in {body}"));
        let value: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(value >= seen, "{line}");
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).await.unwrap();
        body
    }

    #[tokio::test]
    async fn ready_turns_503_when_the_worker_drains() {
        let drain = crate::Drain::new();
        let addr = super::serve("127.0.0.1:0".parse().unwrap(), prometheus::Registry::new(), drain.clone(), None)
            .await
            .unwrap();
        assert!(get(addr, "/ready").await.starts_with("HTTP/1.0 200"));
        drain.start();
        assert!(get(addr, "/ready").await.starts_with("HTTP/1.0 503"));
        assert!(get(addr, "/health").await.starts_with("HTTP/1.0 200"), "alive while draining");
    }
}
