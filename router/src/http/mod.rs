//! The OpenAI-compatible HTTP front door (axum).
//!
//! Every /v1 answer carries `x-request-id`; errors are OpenAI-style JSON objects; bodies are read up
//! to `--max-body-bytes` and parsed here so that every rejection has a JSON body and a useful message.

mod body;
mod chat;
mod completions;
mod logprobs;
mod openapi;
mod params;
mod stream;

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{Instrument, info_span};

use crate::admission::Admission;
use crate::auth::ApiKeys;
use crate::error::ApiError;
use crate::flow::{Dispatcher, TokenizedRequest};
use crate::metrics::Metrics;
use crate::model::ServedModel;
use crate::request_id;
use params::Validated;
pub(crate) use params::check_sampling;
use stream::{Format, StreamOpts};

pub struct AppState {
    pub dispatcher: Arc<Dispatcher>,
    pub admission: Arc<Admission>,
    pub model: Arc<ServedModel>,
    pub metrics: Arc<Metrics>,
    /// `None`: no authentication.
    pub api_keys: Option<Arc<ApiKeys>>,
    pub max_body_bytes: usize,
    pub body_read_timeout: std::time::Duration,
}

/// Every route the router serves. `openapi.json` documents exactly these (checked in `openapi.rs`).
fn routes() -> Vec<(Method, &'static str, MethodRouter<Arc<AppState>>)> {
    vec![
        (Method::POST, "/v1/completions", post(completions_handler)),
        (Method::POST, "/v1/chat/completions", post(chat_handler)),
        (Method::GET, "/v1/models", get(models)),
        (Method::GET, "/health", get(health)),
        (Method::GET, "/ready", get(ready)),
        (Method::GET, "/metrics", get(metrics)),
        (Method::GET, "/openapi.json", get(openapi::serve)),
    ]
}

pub fn router(state: Arc<AppState>) -> Router {
    routes()
        .into_iter()
        .fold(Router::new(), |r, (_, path, handler)| r.route(path, handler))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::map_response(json_errors))
        .with_state(state)
}

/// Error answers produced below the handlers (the framework's own rejections) get the same JSON
/// error object as every other error.
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text =
        axum::body::to_bytes(body, 4096).await.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let reason = status.canonical_reason().unwrap_or("error");
    let message = if text.trim().is_empty() { reason.to_owned() } else { format!("{reason}: {}", text.trim()) };
    let mut e = if status.is_server_error() { ApiError::internal(message) } else { ApiError::invalid(message) };
    e.status = status;
    let mut out = e.into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// Serves until `shutdown` turns true; accepted sockets get TCP_NODELAY. A connection must send its
/// first byte and each request's headers within `header_timeout`, so clients that open connections
/// and send nothing (or half a request) cannot hold them forever.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    header_timeout: std::time::Duration,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), String> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let app = router(state);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the connections we have.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = async { drop(shutdown.wait_for(|s| *s).await) } => break,
        };
        let _ = tcp.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            // The first byte decides HTTP/1 or HTTP/2; a silent connection would wait for it forever. At
            // shutdown one that has not spoken is closed: a client's pool opens connections it may never
            // use, and each would hold the graceful shutdown for the whole header timeout.
            let mut probe = [0u8; 1];
            let first = tokio::select! {
                r = tokio::time::timeout(header_timeout, tcp.peek(&mut probe)) => r,
                _ = async { drop(stop.wait_for(|s| *s).await) } => return,
            };
            if !matches!(first, Ok(Ok(n)) if n > 0) {
                return;
            }
            let mut builder = Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(header_timeout);
            builder.http2().timer(TokioTimer::new()).keep_alive_interval(Some(header_timeout));
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), svc);
            let _ = watcher.watch(conn.into_owned()).await;
        });
    }
    drop(listener);
    // In-flight responses finish; RouterHandle::shutdown bounds the wait.
    graceful.shutdown().await;
    Ok(())
}

pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The `stop_reason` field (vLLM's extension): the stop string or token id that ended the request.
pub(crate) fn stop_reason(s: &crate::flow::Summary) -> serde_json::Value {
    match &s.stop_reason {
        Some(crate::flow::StopReason::Text(t)) => serde_json::json!(t),
        Some(crate::flow::StopReason::Token(id)) => serde_json::json!(id),
        None => serde_json::Value::Null,
    }
}

pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("Invalid JSON body: {e}")))
}

/// Tokenizes off the async threads when the text is long.
pub(crate) async fn tokenize(model: &Arc<ServedModel>, text: String, add_special: bool) -> Result<Vec<u32>, ApiError> {
    let run = move |m: &ServedModel, t: &str| {
        let r = if add_special { m.tokenizer.encode_prompt(t) } else { m.tokenizer.encode(t, false) };
        r.map_err(|e| ApiError::invalid(format!("Cannot tokenize the prompt: {e}")))
    };
    if text.len() < 16 * 1024 {
        return run(model, &text);
    }
    let m = model.clone();
    tokio::task::spawn_blocking(move || run(&m, &text)).await.map_err(|e| ApiError::internal(e.to_string()))?
}

fn authorize(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(keys) = &st.api_keys else { return Ok(()) };
    keys.check(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())).map(|_| ())
}

/// Admits the request, starts it, and answers as a stream or a JSON body.
pub(crate) async fn serve_tokenized<F: Format>(
    st: &Arc<AppState>,
    request_id: &str,
    endpoint: &'static str,
    prompt: Vec<u32>,
    v: Validated,
    fmt: F,
) -> Result<Response, ApiError> {
    let prompt_tokens = prompt.len() as u32;
    let tokenized = TokenizedRequest {
        request_id: request_id.to_owned(),
        endpoint,
        prompt,
        sampling: v.sampling,
        stop: v.stop,
        include_stop_str: v.include_stop_str,
        skip_special_tokens: v.skip_special_tokens,
        arrived: Instant::now(),
    };
    let permit = st.admission.admit().await?;
    let events = st.dispatcher.start(tokenized, permit).await?;
    if v.stream {
        let opts = StreamOpts { include_usage: v.include_usage, continuous_usage: v.continuous_usage };
        Ok(stream::sse(events, fmt, opts, prompt_tokens))
    } else {
        stream::collect(events, fmt).await
    }
}

type Handler =
    for<'a> fn(&'a Arc<AppState>, &'a str, &'a [u8]) -> futures::future::BoxFuture<'a, Result<Response, ApiError>>;

async fn generate(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    endpoint: &'static str,
    handler: Handler,
) -> Response {
    let rid = request_id::from_header(headers.get(request_id::HEADER).and_then(|v| v.to_str().ok()));
    let span = info_span!("http", request_id = %rid, endpoint);
    let result = async {
        authorize(&st, &headers)?;
        if let Some(len) =
            headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok())
            && len > st.max_body_bytes
        {
            return Err(body::refuse(body, st.max_body_bytes, st.body_read_timeout).await);
        }
        let bytes = body::read(body, st.max_body_bytes, st.body_read_timeout).await?;
        handler(&st, &rid, &bytes).await
    }
    .instrument(span.clone())
    .await;
    let mut resp = match result {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_server_error() || e.status == StatusCode::TOO_MANY_REQUESTS {
                span.in_scope(|| tracing::warn!(error = %e, "request refused"));
            } else {
                span.in_scope(|| tracing::debug!(error = %e, "request rejected"));
            }
            e.into_response()
        }
    };
    st.metrics.requests.with_label_values(&[endpoint, resp.status().as_str()]).inc();
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert(request_id::HEADER, v);
    }
    resp
}

async fn completions_handler(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, headers, body, "completions", |st, rid, b| Box::pin(completions::handle(st, rid, b))).await
}

async fn chat_handler(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, headers, body, "chat", |st, rid, b| Box::pin(chat::handle(st, rid, b))).await
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&st, &headers) {
        return e.into_response();
    }
    let body = json!({
        "object": "list",
        "data": [{
            "id": st.model.name,
            "object": "model",
            "created": now(),
            "owned_by": "tandem",
            "root": st.model.name,
            "max_model_len": st.dispatcher.max_model_len(),
        }],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

async fn health() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], r#"{"status":"ok"}"#).into_response()
}

/// 200 when at least one compatible prefill/decode pair is usable, else 503 saying why.
async fn ready(State(st): State<Arc<AppState>>) -> Response {
    match st.dispatcher.readiness() {
        Ok(pairs) => {
            ([(header::CONTENT_TYPE, "application/json")], json!({"status": "ready", "detail": pairs}).to_string())
                .into_response()
        }
        Err(why) => ApiError::unavailable(why).into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.running.set(st.admission.running() as i64);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render()).into_response()
}

async fn fallback(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

async fn method_not_allowed(uri: Uri) -> Response {
    let mut e = ApiError::invalid(format!("Method not allowed on {}", uri.path()));
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e.into_response()
}
