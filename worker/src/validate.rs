//! Checks both worker services apply to an incoming request.

use tonic::{Request, Status};

/// The request id: the field, else the `x-request-id` metadata.
pub fn request_id<T>(req: &Request<T>, field: &str) -> Result<String, Status> {
    if !field.is_empty() {
        return Ok(field.to_string());
    }
    req.metadata()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| Status::invalid_argument("request_id is empty and no x-request-id metadata was sent"))
}

/// Validates the token ids and returns the prompt length (`num_prompt_tokens`, 0 meaning all of them).
pub fn tokens(token_ids: &[u32], num_prompt_tokens: u32, vocab_size: usize) -> Result<usize, Status> {
    if token_ids.is_empty() {
        return Err(Status::invalid_argument("token_ids is empty"));
    }
    if let Some(t) = token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(Status::invalid_argument(format!("token id {t} is outside the vocabulary of {vocab_size}")));
    }
    let prompt_len = if num_prompt_tokens == 0 { token_ids.len() } else { num_prompt_tokens as usize };
    if prompt_len > token_ids.len() {
        return Err(Status::invalid_argument(format!(
            "num_prompt_tokens {prompt_len} exceeds the {} token ids",
            token_ids.len()
        )));
    }
    Ok(prompt_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_from_the_field_or_the_metadata() {
        let mut r = Request::new(());
        assert_eq!(request_id(&r, "a").unwrap(), "a");
        assert_eq!(request_id(&r, "").unwrap_err().code(), tonic::Code::InvalidArgument);
        r.metadata_mut().insert("x-request-id", "b".parse().unwrap());
        assert_eq!(request_id(&r, "").unwrap(), "b");
    }

    #[test]
    fn token_checks_name_the_problem() {
        assert_eq!(tokens(&[1, 2, 3], 0, 10).unwrap(), 3);
        assert_eq!(tokens(&[1, 2, 3], 2, 10).unwrap(), 2);
        assert!(tokens(&[], 0, 10).unwrap_err().message().contains("empty"));
        assert!(tokens(&[1, 12], 0, 10).unwrap_err().message().contains("token id 12"));
        assert!(tokens(&[1], 2, 10).unwrap_err().message().contains("num_prompt_tokens"));
    }
}
