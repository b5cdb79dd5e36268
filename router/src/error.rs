//! Errors as clients see them: an OpenAI-style JSON error object (`{"error": {...}}`) with an HTTP
//! status, or a gRPC status with the same message.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A request-level error. `message` must tell the user what to change.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for the `Retry-After` header (429/503).
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// 400: the request cannot be served as written.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the offending parameter.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.to_owned()), ..Self::invalid(message) }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
        )
        .with_code("invalid_api_key")
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        let requested = clip(requested, 256);
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{requested}` does not exist. This server serves `{served}`."),
        )
        .with_code("model_not_found")
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "Unknown path {path}. See GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /openapi.json."
            ),
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("Request body is larger than the limit of {limit} bytes (--max-body-bytes)."),
        )
    }

    /// 400: the client sent fewer body bytes than it announced, or a malformed chunked body.
    pub fn incomplete_body(why: impl std::fmt::Display) -> Self {
        Self::invalid(format!("The request body could not be read completely: {why}"))
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(secs: f64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("The request body did not arrive within {secs:.1} s (--body-read-timeout-secs)."),
        )
    }

    /// 429 with Retry-After.
    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> Self {
        Self { retry_after: Some(retry_after), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message) }
            .with_code("rate_limit_exceeded")
    }

    /// 503: no worker can take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message) }
    }

    /// 502: a worker failed the request.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", message)
    }

    pub fn timeout(secs: f64) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            format!("Request timed out after {secs:.1} s (--request-timeout-secs)."),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON error object (also used as the final SSE event of a stream that fails mid-way).
    pub fn to_json(&self) -> String {
        let body = Body {
            error: Inner { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code },
        };
        serde_json::to_string(&body)
            .unwrap_or_else(|_| r#"{"error":{"message":"internal error","type":"server_error"}}"#.into())
    }

    /// The equivalent gRPC status.
    pub fn to_status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self.status.as_u16() {
            400 | 413 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            404 => Code::NotFound,
            429 => Code::ResourceExhausted,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        // The message travels in a header (grpc-message): one that echoes a huge request field would
        // exceed the client's header limit and reach it as a protocol error instead of this status.
        tonic::Status::new(code, clip(&self.message, MAX_STATUS_MESSAGE).into_owned())
    }
}

/// Longest gRPC status message sent (bytes, before percent-encoding).
const MAX_STATUS_MESSAGE: usize = 2048;

/// `s`, cut to at most `max` bytes at a character boundary, with "..." when cut.
fn clip(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end]).into()
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.kind, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, [(header::CONTENT_TYPE, "application/json")], self.to_json()).into_response();
        if let Some(s) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_openai_shaped() {
        let e = ApiError::invalid_param("n", "n must be 1");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["error"]["message"], "n must be 1");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "n");
        assert_eq!(e.to_status().code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn a_status_message_stays_small_whatever_the_request_echoed() {
        // Found by router/tests/fuzz.rs: a 20 KB model name made the status an h2 protocol error.
        let e = ApiError::model_not_found(&"\u{1F600}a".repeat(10_000), "tiny");
        assert!(e.message.len() < 400, "{}", e.message.len());
        let e = ApiError::invalid("\u{1F600}".repeat(10_000));
        let s = e.to_status();
        assert!(s.message().len() <= MAX_STATUS_MESSAGE + 3 && s.message().ends_with("..."));
    }

    #[test]
    fn overload_carries_retry_after() {
        let r = ApiError::overloaded("full", 2).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
