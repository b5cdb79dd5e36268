//! Reading a request body: whole, up to `--max-body-bytes`, within `--body-read-timeout-secs`.
//!
//! A body refused as too large is still read and dropped, up to [`DRAIN_BYTES`] more and within the
//! same timeout: a client is usually still sending when the 413 is ready, and a connection closed with
//! its bytes unread is reset, so the client would see a broken pipe instead of the answer.

use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::error::ApiError;

/// How much of a refused body is read and dropped before the connection is given up.
const DRAIN_BYTES: usize = 64 << 20;

/// The whole body: 413 past `limit`, 400 when the client sent less than it announced (or broken
/// chunked framing), 408 when it does not arrive within `timeout`.
pub async fn read(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let mut body = body;
    let read = async {
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(ApiError::incomplete_body)?;
            if let Some(data) = frame.data_ref() {
                if buf.len() + data.len() > limit {
                    return Ok(None);
                }
                buf.extend_from_slice(data);
            }
        }
        Ok(Some(buf.freeze()))
    };
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(ApiError::body_timeout(timeout.as_secs_f64())),
        Ok(Err(e)) => Err(e),
        Ok(Ok(Some(bytes))) => Ok(bytes),
        Ok(Ok(None)) => Err(refuse(body, limit, timeout).await),
    }
}

/// The 413 for a body over `limit`, once the rest of it was read (up to [`DRAIN_BYTES`], within
/// `timeout`) so that the client can read the answer.
pub async fn refuse(body: Body, limit: usize, timeout: Duration) -> ApiError {
    let mut body = body;
    let drain = async {
        let mut left = DRAIN_BYTES;
        while let Some(Ok(frame)) = body.frame().await {
            let n = frame.data_ref().map_or(0, |d| d.len());
            if n >= left {
                return;
            }
            left -= n;
        }
    };
    let _ = tokio::time::timeout(timeout, drain).await;
    ApiError::too_large(limit)
}
