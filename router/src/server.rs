//! Start-up and shutdown: load the model files, connect discovery, start the worker pool, serve HTTP
//! and gRPC until a signal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

use crate::admission::Admission;
use crate::config::Args;
use crate::flow::{CapacityWait, Dispatcher, Limits};
use crate::metrics::Metrics;
use crate::model::{ModelError, ServedModel};
use crate::workers::{HandleSettings, PoolSettings, WorkerPool};
use crate::{grpc, http, policies};

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid flags: {0}")]
    Flags(String),
    // Sources are printed by the error chain (anyhow's "Caused by"), not repeated in the message.
    #[error("loading the model files")]
    Model(#[from] ModelError),
    #[error("discovery")]
    Discovery(#[from] cluster::DiscoveryError),
    #[error("binding {addr}")]
    Bind { addr: String, source: std::io::Error },
    #[error("metrics registry")]
    Metrics(#[from] prometheus::Error),
    #[error("server: {0}")]
    Serve(String),
}

/// A running router. Dropping it does not stop it; call [`RouterHandle::shutdown`].
pub struct RouterHandle {
    pub http_addr: SocketAddr,
    pub grpc_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Result<(), String>>>,
}

impl RouterHandle {
    /// Stops accepting, lets in-flight responses finish (up to 10 s), stops background tasks.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }

    /// Waits until a server task ends (an error, or shutdown from elsewhere). Cancel-safe: the tasks stay in
    /// the handle, so a `shutdown` after a cancelled wait (the signal came first) still waits for them.
    async fn wait(&mut self) -> Result<(), RouterError> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        let (res, i, _) = futures::future::select_all(self.tasks.iter_mut()).await;
        self.tasks.remove(i);
        match res {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(RouterError::Serve(e)),
            Err(e) => Err(RouterError::Serve(e.to_string())),
        }
    }
}

async fn bind(addr: &str) -> Result<TcpListener, RouterError> {
    TcpListener::bind(addr).await.map_err(|source| RouterError::Bind { addr: addr.to_owned(), source })
}

/// Binds the ports from `args` and starts serving.
pub async fn start(args: Args) -> Result<RouterHandle, RouterError> {
    let http = bind(&args.http_addr()).await?;
    let grpc = match args.grpc_addr() {
        Some(a) => Some(bind(&a).await?),
        None => None,
    };
    start_with_listeners(args, http, grpc).await
}

/// Starts serving on already bound listeners (tests and benchmarks bind port 0).
pub async fn start_with_listeners(
    args: Args,
    http_listener: TcpListener,
    grpc_listener: Option<TcpListener>,
) -> Result<RouterHandle, RouterError> {
    args.validate().map_err(RouterError::Flags)?;
    let model = Arc::new(ServedModel::load(&args)?);
    info!(
        model = %model.name,
        max_model_len = model.max_model_len,
        vocab = model.tokenizer.vocab_size(),
        chat_template = ?model.template.source(),
        "model files loaded"
    );
    let worker_tls = args.worker_tls().map_err(|e| RouterError::Flags(e.to_string()))?;
    if let Some(t) = &worker_tls {
        info!(server_name = ?t.server_name(), client_certificate = t.presents_certificate(), "TLS to the workers");
    }
    let discovery = cluster::connect(args.registry.config(args.prefill.clone(), args.decode.clone())).await?;
    let metrics = Arc::new(Metrics::new()?);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let pool = WorkerPool::start(
        discovery,
        PoolSettings {
            handle: HandleSettings {
                connections: args.worker_connections,
                connect_timeout: Duration::from_millis(args.health_timeout_ms.max(100)),
                breaker_failures: args.breaker_failures,
                breaker_open: Duration::from_secs_f64(args.breaker_open_secs.max(0.0)),
                tls: worker_tls,
            },
            health_interval: Duration::from_millis(args.health_interval_ms),
            health_timeout: Duration::from_millis(args.health_timeout_ms),
            health_failures: 2,
        },
        metrics.clone(),
        shutdown_rx.clone(),
    );
    let dispatcher = Arc::new(Dispatcher {
        pool,
        prefill_policy: policies::prefill_policy(args.prefill_policy, args.cache_balance_tokens),
        decode_policy: policies::decode_policy(args.decode_policy),
        model: model.clone(),
        metrics: metrics.clone(),
        limits: Limits {
            max_retries: args.max_retries,
            prefill_timeout: args.prefill_timeout(),
            request_timeout: args.request_timeout(),
        },
        ids: Default::default(),
        capacity: CapacityWait::new(args.max_queued_requests, args.queue_timeout(), args.preempted_wait()),
    });
    let admission = Arc::new(Admission::new(
        args.max_running_requests,
        args.max_queued_requests,
        args.queue_timeout(),
        metrics.clone(),
    ));
    let api_keys = crate::auth::ApiKeys::load(
        args.api_key.as_ref().map(|k| k.0.as_str()),
        args.api_keys_file.as_deref(),
        args.api_key_rate_limit,
    )
    .map_err(RouterError::Flags)?
    .map(Arc::new);
    if let Some(k) = &api_keys {
        tracing::info!(keys = k.len(), rate_limit_per_minute = ?args.api_key_rate_limit, "API keys required");
    }
    let state = Arc::new(http::AppState {
        dispatcher,
        admission,
        model,
        metrics,
        api_keys,
        max_body_bytes: args.max_body_bytes,
        body_read_timeout: args.body_read_timeout(),
    });
    let http_addr = http_listener.local_addr().map_err(|e| RouterError::Serve(e.to_string()))?;
    let mut tasks =
        vec![tokio::spawn(http::serve(http_listener, state.clone(), args.header_read_timeout(), shutdown_rx.clone()))];
    let grpc_addr = match grpc_listener {
        Some(l) => {
            let a = l.local_addr().map_err(|e| RouterError::Serve(e.to_string()))?;
            tasks.push(tokio::spawn(grpc::serve(l, state, shutdown_rx)));
            Some(a)
        }
        None => None,
    };
    info!(%http_addr, ?grpc_addr, discovery = %args.registry.kind, prefill_policy = ?args.prefill_policy, decode_policy = ?args.decode_policy, "router listening");
    Ok(RouterHandle { http_addr, grpc_addr, shutdown: shutdown_tx, tasks })
}

/// Serves until Ctrl-C or SIGTERM, then shuts down gracefully (with `--check-config`: validates and returns).
pub async fn run(args: Args) -> Result<(), RouterError> {
    if args.check_config {
        args.validate().map_err(RouterError::Flags)?;
        println!(
            "{}",
            serde_json::json!({"event": "config-ok", "role": "router", "model": args.model.display().to_string(),
                "http": args.http_addr(), "grpc": args.grpc_addr(),
                "discovery": args.registry.kind.as_str(), "worker_tls": args.tls_mode()})
        );
        return Ok(());
    }
    let mut handle = start(args).await?;
    tokio::select! {
        r = handle.wait() => return r,
        _ = signal() => info!("shutting down"),
    }
    handle.shutdown().await;
    Ok(())
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
