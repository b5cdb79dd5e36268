//! The worker's Prometheus endpoint: `GET /metrics` (text format) and `GET /health`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};

/// Serves `registry` on `addr`; returns the bound address. Adds `tandem_cache_arenas_created`: cache
/// arenas this process created, which stays at its startup value while the worker serves (the pool is
/// allocated once, before ready).
pub async fn serve(addr: SocketAddr, registry: Registry) -> anyhow::Result<SocketAddr> {
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
                arenas.set(engine::cache::arenas_created() as i64);
                async move {
                    let mut buf = Vec::new();
                    let enc = TextEncoder::new();
                    if let Err(e) = enc.encode(&registry.gather(), &mut buf) {
                        return ([(CONTENT_TYPE, "text/plain".to_string())], format!("# encode error: {e}\n"));
                    }
                    ([(CONTENT_TYPE, enc.format_type().to_string())], String::from_utf8_lossy(&buf).into_owned())
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
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
