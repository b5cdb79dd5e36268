//! Request ids: the client's `x-request-id` when it is usable, else a fresh random one. The id goes to
//! both workers (field and `x-request-id` metadata) and into every log line of the request.

use rand::RngExt;

pub const HEADER: &str = "x-request-id";

/// Accepts ids of 1..=128 visible ASCII characters (safe in headers, metadata and logs).
pub fn accept(candidate: &str) -> Option<String> {
    let ok = !candidate.is_empty() && candidate.len() <= 128 && candidate.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| candidate.to_owned())
}

/// 32 hex characters of randomness.
pub fn make() -> String {
    let v: u128 = rand::rng().random();
    format!("{v:032x}")
}

pub fn from_header(value: Option<&str>) -> String {
    value.and_then(accept).unwrap_or_else(make)
}

/// Adds the id as gRPC metadata to a worker call, so worker logs carry it even before the body is parsed.
pub fn tag<T>(req: &mut tonic::Request<T>, id: &str) {
    if let Ok(v) = id.parse() {
        req.metadata_mut().insert(HEADER, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_when_safe_and_replaced_otherwise() {
        assert_eq!(from_header(Some("abc-123")), "abc-123");
        assert_eq!(from_header(Some("has space")).len(), 32);
        assert_eq!(from_header(Some(&"x".repeat(200))).len(), 32);
        assert_ne!(make(), make());
    }
}
