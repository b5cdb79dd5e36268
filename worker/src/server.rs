//! A worker's life as a server: bind, serve the role's gRPC service (plus standard health), register,
//! announce readiness, and on SIGTERM/SIGINT drain, deregister and stop; on a device failure deregister
//! and stop at once, returning the reason.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tonic::body::Body;
use tonic::server::NamedService;

use crate::{Drain, LoadedModel, ServeArgs};

/// Binds `args.listen` and returns the listener with what this worker registers in discovery and reports
/// from GetInfo (advertising `--advertise`, or the bound address).
pub async fn bind(
    args: &ServeArgs,
    model: &LoadedModel,
    role: proto::v1::WorkerRole,
) -> anyhow::Result<(tokio::net::TcpListener, cluster::WorkerRecord)> {
    let listener =
        tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding gRPC on {}", args.listen))?;
    let bound = listener.local_addr()?;
    let grpc_address = args.advertise.clone().unwrap_or_else(|| bound.to_string());
    Ok((listener, record(args, model, role, grpc_address)))
}

fn record(
    args: &ServeArgs,
    model: &LoadedModel,
    role: proto::v1::WorkerRole,
    grpc_address: String,
) -> cluster::WorkerRecord {
    cluster::WorkerRecord {
        id: args.worker_id(role.name()),
        role,
        grpc_address,
        capacity: cluster::Capacity {
            max_num_seqs: args.max_num_seqs as u32,
            kv_blocks_total: model.pool.stats().total_blocks as u32,
            max_model_len: model.max_model_len as u32,
        },
        fingerprint: Some(model.fingerprint.clone()),
    }
}

/// Refuses new work from now on and reports NOT_SERVING over grpc.health.v1, for the role's service and for
/// the server as a whole (""), which is what a Kubernetes gRPC probe without a service name asks: a
/// draining pod leaves its Service's endpoints.
pub async fn start_draining<S: NamedService>(drain: &Drain, health: &tonic_health::server::HealthReporter) {
    drain.start();
    health.set_not_serving::<S>().await;
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
}

/// Serves `svc` on `listener` until a shutdown signal, then drains: refuses new work (the service answers
/// UNAVAILABLE through `drain`), waits for in-flight requests, deregisters, stops. When the worker fails
/// ([`Drain::fail`], a device failure) it deregisters and stops at once, and returns the reason as an
/// error: the process exits non-zero and its supervisor (Kubernetes, `tandem up`) starts a fresh one.
pub async fn serve_until_drained<S>(
    svc: S,
    listener: tokio::net::TcpListener,
    args: &ServeArgs,
    record: cluster::WorkerRecord,
    drain: Arc<Drain>,
    metrics_addr: Option<SocketAddr>,
    model_name: &str,
) -> anyhow::Result<()>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let tls = args.grpc_tls()?;
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<S>().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let routes = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        // A router multiplexes all of its requests to this worker over one HTTP/2 connection.
        .max_concurrent_streams(Some(65_536))
        .http2_max_pending_accept_reset_streams(Some(65_536))
        .initial_connection_window_size(Some(64 << 20))
        .initial_stream_window_size(Some(1 << 20))
        .add_service(health_service)
        .add_service(svc);
    let stopped = async {
        let _ = stop_rx.await;
    };
    let server = match tls {
        Some(tls) => {
            tracing::info!(client_certificates = tls.requires_client_certificates(), "gRPC over TLS");
            tokio::spawn(routes.serve_with_incoming_shutdown(tls::incoming(listener, tls), stopped))
        }
        None => tokio::spawn(
            routes.serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), stopped),
        ),
    };
    let (role, id, grpc) = (record.role.name(), record.id.clone(), record.grpc_address.clone());
    let registration = crate::register(args, record).await?;
    // The machine-readable ready line (`tandem up` and the tests read it).
    println!(
        "{}",
        serde_json::json!({"event": "ready", "role": role, "id": id, "grpc": grpc,
            "metrics": metrics_addr.map(|a| a.to_string()), "model": model_name})
    );
    tracing::info!(grpc = %grpc, id = %id, "{role} worker ready");

    let mut failure = tokio::select! {
        _ = crate::drain::shutdown_signal() => None,
        reason = drain.failed() => Some(reason),
    };
    start_draining::<S>(&drain, &health_reporter).await;
    if failure.is_none() {
        // A failure while draining ends the wait: what is in flight cannot complete anymore.
        failure = tokio::select! {
            idle = drain.wait_idle(Duration::from_secs(args.drain_timeout_s)) => {
                if !idle {
                    tracing::warn!(inflight = drain.inflight(), "drain timeout: stopping with requests in flight");
                }
                None
            }
            reason = drain.failed() => Some(reason),
        };
    }
    if let Some(reason) = &failure {
        tracing::error!(%reason, inflight = drain.inflight(), "{role} worker failed: deregistering and stopping");
    }
    if let Some(r) = registration {
        r.deregister().await;
    }
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    match failure {
        Some(reason) => Err(anyhow::anyhow!("{role} worker failed: {reason}")),
        None => {
            tracing::info!("{role} worker stopped");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_server::Health;
    use tonic_health::pb::{HealthCheckRequest, health_server::HealthServer};

    use super::*;

    struct Role;
    impl NamedService for Role {
        const NAME: &'static str = "tandem.v1.DecodeWorker";
    }

    async fn status(svc: &tonic_health::server::HealthService, name: &str) -> i32 {
        let req = tonic::Request::new(HealthCheckRequest { service: name.into() });
        svc.check(req).await.expect("registered").into_inner().status
    }

    #[tokio::test]
    async fn draining_reports_not_serving_for_the_role_and_the_whole_server() {
        let (reporter, _server): (_, HealthServer<_>) = tonic_health::server::health_reporter();
        reporter.set_serving::<Role>().await;
        let svc = tonic_health::server::HealthService::from_health_reporter(reporter.clone());
        assert_eq!(status(&svc, "").await, ServingStatus::Serving as i32);
        assert_eq!(status(&svc, Role::NAME).await, ServingStatus::Serving as i32);

        let drain = Drain::new();
        start_draining::<Role>(&drain, &reporter).await;
        assert!(drain.is_draining());
        assert_eq!(status(&svc, "").await, ServingStatus::NotServing as i32, "the probe's service \"\"");
        assert_eq!(status(&svc, Role::NAME).await, ServingStatus::NotServing as i32);
    }
}
