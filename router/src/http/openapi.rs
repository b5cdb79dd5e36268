//! GET /openapi.json: the OpenAPI 3 document of the HTTP API. It is written by hand
//! (`router/openapi.json`); the tests below hold it to the routes [`super::routes`] registers, both
//! ways, and schemathesis (router/tests/fuzz.rs) holds the live answers to it.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;

pub const DOCUMENT: &str = include_str!("../../openapi.json");

/// The document for this router: `ModelName` narrowed to the served name (or empty), and the output
/// lengths to what the context (`max_model_len` tokens, at least one of them the prompt's) leaves.
pub fn document(served_model: &str, max_model_len: u32) -> Value {
    let mut doc: Value = serde_json::from_str(DOCUMENT).unwrap_or(Value::Null);
    if let Some(schema) = doc.pointer_mut("/components/schemas/ModelName") {
        schema["enum"] = json!(["", served_model, null]);
    }
    for request in ["ChatCompletionRequest", "CompletionRequest"] {
        for field in ["max_tokens", "max_completion_tokens", "min_tokens"] {
            if let Some(schema) = doc.pointer_mut(&format!("/components/schemas/{request}/properties/{field}")) {
                schema["maximum"] = json!(max_model_len.saturating_sub(1));
            }
        }
    }
    doc
}

pub async fn serve(State(st): State<Arc<AppState>>) -> Response {
    let doc = document(&st.model.name, st.dispatcher.max_model_len());
    ([(header::CONTENT_TYPE, "application/json")], doc.to_string()).into_response()
}
#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn document() -> Value {
        serde_json::from_str(DOCUMENT).expect("openapi.json is JSON")
    }

    #[test]
    fn the_served_document_names_the_served_model_and_its_context() {
        let doc = super::document("tiny", 512);
        assert_eq!(doc["components"]["schemas"]["ModelName"]["enum"], json!(["", "tiny", null]));
        let chat = &doc["components"]["schemas"]["ChatCompletionRequest"]["properties"];
        assert_eq!(chat["max_tokens"]["maximum"], 511);
        assert_eq!(doc["paths"], document()["paths"]);
    }

    #[test]
    fn the_document_lists_exactly_the_routes_the_router_registers() {
        let doc = document();
        assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "not OpenAPI 3");
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let registered: BTreeSet<(String, String)> =
            super::super::routes().into_iter().map(|(m, p, _)| (m.as_str().to_owned(), p.to_owned())).collect();
        assert_eq!(documented, registered, "openapi.json and http::routes() disagree");
    }

    #[test]
    fn every_error_answer_is_documented_as_the_json_error_object() {
        let doc = document();
        let mut errors = 0;
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, resp) in op["responses"].as_object().unwrap() {
                    if status.starts_with('4') || status.starts_with('5') {
                        let schema = &resp["content"]["application/json"]["schema"]["$ref"];
                        assert_eq!(schema, "#/components/schemas/Error", "{method} {path} {status}");
                        errors += 1;
                    }
                }
            }
        }
        assert!(errors > 10, "only {errors} error answers documented");
        let e = &doc["components"]["schemas"]["Error"]["properties"]["error"];
        let sample: Value =
            serde_json::from_str(&crate::ApiError::invalid_param("n", "n must be 1").to_json()).unwrap();
        for field in sample["error"].as_object().unwrap().keys() {
            assert!(e["properties"].get(field).is_some(), "the Error schema lacks `{field}`");
        }
    }

    #[test]
    fn every_schema_reference_resolves() {
        let doc = document();
        fn refs(v: &Value, out: &mut Vec<String>) {
            match v {
                Value::Object(o) => {
                    if let Some(Value::String(r)) = o.get("$ref") {
                        out.push(r.clone());
                    }
                    o.values().for_each(|x| refs(x, out));
                }
                Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(&doc, &mut all);
        for r in all {
            let name = r.strip_prefix("#/components/schemas/").unwrap_or_else(|| panic!("unexpected $ref {r}"));
            assert!(doc["components"]["schemas"].get(name).is_some(), "{r} does not resolve");
        }
    }
}
