//! API keys: `--api-key` / `TANDEM_API_KEY` and `--api-keys-file` (one key a line, optionally named), checked on
//! /v1/* and on every gRPC call, with an optional per-key rate limit. Keys are never logged: a key's name (or
//! its position in the file) is what logs and errors show, and an `Args` printed with `{:?}` shows none.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::ApiError;

/// An API key as a command-line or environment value: its `Debug` never shows it (an `Args` printed with
/// `{:?}` shows `<redacted>`).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::str::FromStr for ApiKey {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(ApiKey(s.to_string()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The keys a router accepts.
pub struct ApiKeys {
    keys: Vec<Key>,
    /// Requests a minute per key (token bucket: this many at once, refilled evenly), or unlimited.
    per_minute: Option<u32>,
}

struct Key {
    name: String,
    secret: Vec<u8>,
    bucket: Mutex<Bucket>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.keys.iter().map(|k| k.name.as_str()).collect();
        f.debug_struct("ApiKeys").field("names", &names).field("per_minute", &self.per_minute).finish()
    }
}

impl ApiKeys {
    /// The keys of `--api-key` and `--api-keys-file`; `None` when neither is given (no authentication).
    /// File format: one key a line, as `KEY` or `NAME:KEY`; blank lines and lines starting with `#` are
    /// skipped. A key is printable ASCII without spaces; an empty or repeated key is an error.
    pub fn load(key: Option<&str>, file: Option<&Path>, per_minute: Option<u32>) -> Result<Option<Self>, String> {
        if per_minute == Some(0) {
            return Err("--api-key-rate-limit must be at least 1 request a minute".into());
        }
        let mut entries: Vec<(String, String)> = Vec::new();
        if let Some(k) = key {
            entries.push(("--api-key".into(), k.to_string()));
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--api-keys-file {}: cannot be read: {e}", path.display()))?;
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let (name, secret) = match line.split_once(':') {
                    Some((n, s)) => (n.trim().to_string(), s.trim().to_string()),
                    None => (format!("{}:{}", path.display(), i + 1), line.to_string()),
                };
                if name.is_empty() {
                    return Err(format!("--api-keys-file {} line {}: an empty key name", path.display(), i + 1));
                }
                entries.push((name, secret));
            }
            if entries.is_empty() || (key.is_some() && entries.len() == 1) {
                return Err(format!("--api-keys-file {}: no key in it", path.display()));
            }
        }
        if entries.is_empty() {
            if per_minute.is_some() {
                return Err("--api-key-rate-limit needs --api-key or --api-keys-file".into());
            }
            return Ok(None);
        }
        let mut keys: Vec<Key> = Vec::with_capacity(entries.len());
        for (name, secret) in entries {
            // Where the key came from, never the key itself.
            if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!("API key {name}: must be non-empty printable ASCII without spaces"));
            }
            if keys.iter().any(|k| k.secret == secret.as_bytes()) {
                return Err(format!("API key {name}: the same key is listed twice"));
            }
            if keys.iter().any(|k| k.name == name) {
                return Err(format!("API key name {name}: listed twice"));
            }
            let tokens = f64::from(per_minute.unwrap_or(0));
            keys.push(Key {
                name,
                secret: secret.into_bytes(),
                bucket: Mutex::new(Bucket { tokens, at: Instant::now() }),
            });
        }
        Ok(Some(ApiKeys { keys, per_minute }))
    }

    /// How many keys are accepted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Checks an `Authorization` header value (scheme `Bearer`, any case): the key's name, 401 for a missing or
    /// unknown key, 429 with Retry-After past the key's rate limit.
    pub fn check(&self, authorization: Option<&str>) -> Result<&str, ApiError> {
        let given = authorization.and_then(bearer).ok_or_else(ApiError::unauthorized)?;
        // Every key is compared, each in constant time, so the time taken does not tell which one matched.
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if constant_time_eq(given.as_bytes(), &k.secret) {
                found = Some(i);
            }
        }
        let key = &self.keys[found.ok_or_else(ApiError::unauthorized)?];
        if let Some(per_minute) = self.per_minute {
            key.take(per_minute, Instant::now())?;
        }
        Ok(&key.name)
    }
}

impl Key {
    fn take(&self, per_minute: u32, now: Instant) -> Result<(), ApiError> {
        let rate = f64::from(per_minute) / 60.0;
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        b.tokens = (b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate).min(f64::from(per_minute));
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Ok(());
        }
        let wait = Duration::from_secs_f64((1.0 - b.tokens) / rate);
        Err(ApiError::overloaded(
            format!("API key {} is over its rate limit ({per_minute} a minute)", self.name),
            wait.as_secs_f64().ceil().max(1.0) as u64,
        )
        .with_code("rate_limit_exceeded"))
    }
}

/// The credentials of an `Authorization` value whose scheme is `Bearer` in any case (RFC 9110: schemes are
/// case-insensitive).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim()).filter(|k| !k.is_empty())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_key_given_as_an_argument_never_prints() {
        let k: super::ApiKey = "sk-secret-value".parse().unwrap();
        assert_eq!(format!("{k:?}"), "<redacted>");
        assert!(!format!("{:?}", Some(k.clone())).contains("secret"));
        assert_eq!(k.0, "sk-secret-value");
    }

    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn keys_come_from_the_flag_and_the_file_with_names() {
        let f = file("# team keys\nalice:key-a\n\n  key-b  \n");
        let keys = ApiKeys::load(Some("key-c"), Some(f.path()), None).unwrap().unwrap();
        assert_eq!(keys.len(), 3);
        assert_eq!(keys.check(Some("Bearer key-a")).unwrap(), "alice");
        assert!(keys.check(Some("Bearer key-b")).unwrap().ends_with(":4"), "unnamed keys are named by line");
        assert_eq!(keys.check(Some("Bearer key-c")).unwrap(), "--api-key");
        assert_eq!(keys.check(Some("Bearer key-d")).unwrap_err().status.as_u16(), 401);
        assert_eq!(keys.check(None).unwrap_err().status.as_u16(), 401);
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_nothing_else_is_accepted() {
        let keys = ApiKeys::load(Some("sekret"), None, None).unwrap().unwrap();
        for ok in ["Bearer sekret", "bearer sekret", "BEARER sekret", "  Bearer   sekret  "] {
            assert!(keys.check(Some(ok)).is_ok(), "{ok}");
        }
        for bad in ["sekret", "Basic sekret", "Bearer", "Bearer ", "Bearersekret", "Bearer sekret2", "Bearer SEKRET"] {
            assert_eq!(keys.check(Some(bad)).unwrap_err().status.as_u16(), 401, "{bad}");
        }
    }

    #[test]
    fn bad_key_lists_are_refused_without_echoing_keys() {
        // Keys longer than a temporary file's random name, which the message names (".tmpSk2I10" once
        // contained "k2").
        let cases = [
            ("", "no key in it"),
            ("# only a comment\n", "no key in it"),
            ("a:firstsecret\nb:firstsecret\n", "listed twice"),
            ("a:firstsecret\na:secondsecret\n", "listed twice"),
            ("a:has space\n", "printable ASCII"),
            (":firstsecret\n", "empty key name"),
            ("a:\n", "non-empty"),
        ];
        for (text, why) in cases {
            let f = file(text);
            let err = ApiKeys::load(None, Some(f.path()), None).unwrap_err();
            assert!(err.contains(why), "{text:?}: {err}");
            assert!(!err.contains("firstsecret") && !err.contains("secondsecret"), "a key was echoed: {err}");
        }
        let missing = ApiKeys::load(None, Some(Path::new("/nonexistent/keys")), None).unwrap_err();
        assert!(missing.contains("cannot be read"), "{missing}");
        assert!(ApiKeys::load(None, None, Some(10)).unwrap_err().contains("needs --api-key"));
        assert!(ApiKeys::load(Some("k"), None, Some(0)).unwrap_err().contains("at least 1"));
        assert!(ApiKeys::load(None, None, None).unwrap().is_none());
    }

    #[test]
    fn each_key_has_its_own_rate_limit_and_refills_over_time() {
        let f = file("a:key-a\nb:key-b\n");
        let keys = ApiKeys::load(None, Some(f.path()), Some(2)).unwrap().unwrap();
        assert!(keys.check(Some("Bearer key-a")).is_ok());
        assert!(keys.check(Some("Bearer key-a")).is_ok());
        let over = keys.check(Some("Bearer key-a")).unwrap_err();
        assert_eq!(over.status.as_u16(), 429);
        assert_eq!(over.retry_after, Some(30), "one request a 30 s at 2 a minute");
        assert!(over.message.contains("API key a") && !over.message.contains("key-a"), "{}", over.message);
        // The other key is not affected.
        assert!(keys.check(Some("Bearer key-b")).is_ok());
        // Time refills the bucket (the clock is moved by hand).
        let k = &keys.keys[0];
        let later = Instant::now() + Duration::from_secs(31);
        assert!(k.take(2, later).is_ok());
        assert!(k.take(2, later).is_err());
    }

    #[test]
    fn debug_shows_names_never_keys() {
        let keys = ApiKeys::load(Some("super-secret-value"), None, Some(5)).unwrap().unwrap();
        let shown = format!("{keys:?}");
        assert!(shown.contains("--api-key") && !shown.contains("super-secret-value"), "{shown}");
    }
}
