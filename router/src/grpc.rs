//! The gRPC front door: `tandem.v1.Generate`, same semantics as the HTTP API.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use proto::v1::generate_request::Input;
use proto::v1::generate_server::{Generate, GenerateServer};
use proto::v1::{GenerateRequest, GenerateResponse, ListModelsRequest, ListModelsResponse, ModelInfo, Usage};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::ApiError;
use crate::flow::{Event, TokenizedRequest};
use crate::http::{AppState, tokenize};
use crate::request_id;

pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), String> {
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    // Standard grpc.health.v1, for load balancers and Kubernetes probes.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<GenerateServer<GenerateService>>().await;
    tonic::transport::Server::builder()
        // One HTTP/2 connection may carry many clients' requests (hyper's default is 200 streams).
        .max_concurrent_streams(Some(16_384))
        .layer(tower::util::MapResponseLayer::new(undecodable_is_invalid_argument))
        .add_service(health)
        .add_service(GenerateServer::new(GenerateService { st: state }))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await
        .map_err(|e| e.to_string())
}

/// tonic answers a request message that does not decode with INTERNAL (the server's fault, so clients
/// retry it); it is the client's: INVALID_ARGUMENT, with tonic's message kept.
fn undecodable_is_invalid_argument(
    mut resp: axum::http::Response<tonic::body::Body>,
) -> axum::http::Response<tonic::body::Body> {
    let h = resp.headers();
    let internal = h.get("grpc-status").is_some_and(|v| v.as_bytes() == b"13");
    let undecodable = h.get("grpc-message").is_some_and(|v| {
        let m = v.as_bytes();
        m.starts_with(b"failed to decode") || m.starts_with(b"failed%20to%20decode")
    });
    if internal && undecodable {
        let code = axum::http::HeaderValue::from(tonic::Code::InvalidArgument as i32);
        resp.headers_mut().insert("grpc-status", code);
    }
    resp
}

struct GenerateService {
    st: Arc<AppState>,
}

fn authorize<T>(st: &AppState, req: &Request<T>) -> Result<(), Status> {
    let Some(keys) = &st.api_keys else { return Ok(()) };
    let given = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
    keys.check(given).map(|_| ()).map_err(|e| e.to_status())
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

impl GenerateService {
    /// Validates, templates and tokenizes a Generate request.
    async fn prepare(&self, rid: &str, req: GenerateRequest) -> Result<TokenizedRequest, ApiError> {
        let st = &self.st;
        if !req.model.is_empty() && req.model != st.model.name {
            return Err(ApiError::model_not_found(&req.model, &st.model.name));
        }
        let prompt = match req.input {
            None => return Err(ApiError::invalid_param("input", "one of text, token_ids or chat is required")),
            Some(Input::Text(t)) => tokenize(&st.model, t, true).await?,
            Some(Input::TokenIds(t)) => {
                let vocab = st.model.tokenizer.vocab_size() as u32;
                if let Some(bad) = t.ids.iter().find(|&&i| i >= vocab) {
                    return Err(ApiError::invalid_param(
                        "token_ids",
                        format!("token id {bad} is outside the vocabulary (0..{vocab})"),
                    ));
                }
                t.ids
            }
            Some(Input::Chat(c)) => {
                let msgs: Vec<Value> = c
                    .messages
                    .into_iter()
                    .map(|m| {
                        let mut v = json!({ "role": m.role, "content": m.content });
                        if !m.name.is_empty() {
                            v["name"] = Value::String(m.name);
                        }
                        v
                    })
                    .collect();
                if msgs.is_empty() {
                    return Err(ApiError::invalid_param("chat", "chat.messages must not be empty"));
                }
                let text = st
                    .model
                    .template
                    .render(&msgs, c.add_generation_prompt.unwrap_or(true), &Map::new())
                    .map_err(|e| ApiError::invalid(e.to_string()))?;
                tokenize(&st.model, text, false).await?
            }
        };
        let mut sampling = req.sampling.unwrap_or_default();
        let max_len = st.dispatcher.max_model_len() as usize;
        if prompt.is_empty() {
            return Err(ApiError::invalid_param("input", "The prompt is empty"));
        }
        if prompt.len() >= max_len {
            return Err(ApiError::invalid(format!(
                "This model's maximum context length is {max_len} tokens; the prompt has {} tokens.",
                prompt.len()
            )));
        }
        let room = (max_len - prompt.len()) as u32;
        if sampling.max_tokens == 0 {
            sampling.max_tokens = room;
        } else if sampling.max_tokens > room {
            return Err(ApiError::invalid_param(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} in the prompt, {} in the completion).",
                    prompt.len() as u64 + u64::from(sampling.max_tokens),
                    prompt.len(),
                    sampling.max_tokens
                ),
            ));
        }
        crate::http::check_sampling(&sampling, st.model.tokenizer.vocab_size())?;
        Ok(TokenizedRequest {
            request_id: rid.to_owned(),
            endpoint: "grpc",
            prompt,
            sampling,
            stop: req.stop,
            include_stop_str: false,
            skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
            arrived: Instant::now(),
        })
    }
}

#[tonic::async_trait]
impl Generate for GenerateService {
    type GenerateStream = ResponseStream;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        authorize(&self.st, &request)?;
        let from_meta = request.metadata().get(request_id::HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let req = request.into_inner();
        let rid = request_id::accept(&req.request_id).unwrap_or_else(|| request_id::from_header(from_meta.as_deref()));
        let span = tracing::info_span!("grpc", request_id = %rid);
        let started = async {
            let tokenized = self.prepare(&rid, req).await?;
            let prompt_tokens = tokenized.prompt.len() as u32;
            let permit = self.st.admission.admit().await?;
            Ok::<_, ApiError>((self.st.dispatcher.start(tokenized, permit).await?, prompt_tokens))
        }
        .instrument(span)
        .await;
        let status = started.as_ref().map(|_| "200".to_owned()).unwrap_or_else(|e| e.status.as_str().to_owned());
        self.st.metrics.requests.with_label_values(&["grpc", &status]).inc();
        let (events, _prompt_tokens) = started.map_err(|e| e.to_status())?;
        let rid2 = rid.clone();
        let out = futures::stream::unfold((events, false), move |(mut events, done)| {
            let rid = rid2.clone();
            async move {
                if done {
                    return None;
                }
                let item = match events.next().await? {
                    Event::Delta { text, tokens } => {
                        (GenerateResponse { request_id: rid, text, tokens, ..Default::default() }, false)
                    }
                    Event::Done(s) => (
                        GenerateResponse {
                            request_id: rid,
                            finish_reason: s.finish_reason.to_proto() as i32,
                            usage: Some(Usage {
                                prompt_tokens: s.prompt_tokens,
                                completion_tokens: s.completion_tokens,
                                cached_tokens: s.cached_tokens,
                            }),
                            ..Default::default()
                        },
                        true,
                    ),
                    Event::Failed(e) => (
                        GenerateResponse {
                            request_id: rid,
                            finish_reason: proto::v1::FinishReason::Error as i32,
                            error: e.message,
                            ..Default::default()
                        },
                        true,
                    ),
                };
                Some((Ok(item.0), (events, item.1)))
            }
        });
        let mut resp = Response::new(Box::pin(out) as ResponseStream);
        if let Ok(v) = rid.parse() {
            resp.metadata_mut().insert(request_id::HEADER, v);
        }
        Ok(resp)
    }

    async fn list_models(&self, request: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        authorize(&self.st, &request)?;
        Ok(Response::new(ListModelsResponse {
            models: vec![ModelInfo {
                id: self.st.model.name.clone(),
                max_model_len: self.st.dispatcher.max_model_len(),
            }],
        }))
    }
}
