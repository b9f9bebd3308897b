//! Errors as OpenAI reports them: an HTTP status and `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::types::{ErrorBody, ErrorDetail, RawSampling};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a request the server cannot serve as sent.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the offending field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::bad_request(message).with_param(param)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect or missing API key: send it as the header `Authorization: Bearer <key>`.",
        )
        .with_code("invalid_api_key")
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist; this server serves `{served}`."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn payload_too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body is larger than the limit of {limit} bytes."),
        )
        .with_code("request_too_large")
    }

    pub fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!(
                "The request body must be JSON, sent with `Content-Type: application/json` (got {content_type:?})."
            ),
        )
        .with_code("unsupported_media_type")
    }

    pub fn body_timeout(limit: std::time::Duration) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("The request body did not arrive within {:.1} s.", limit.as_secs_f64()),
        )
        .with_code("request_timeout")
    }

    pub fn queue_full(max_queue: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("The server is busy: its request queue ({max_queue} waiting) is full. Retry later."),
        )
        .with_code("queue_full");
        e.retry_after = Some(1);
        e
    }

    pub fn loading() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "The model is still loading; retry when GET /health answers 200.",
        )
        .with_code("model_loading");
        e.retry_after = Some(1);
        e
    }

    pub fn shutting_down() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "The server is shutting down.",
        )
        .with_code("shutting_down")
    }

    /// The engine stopped after an internal error it could not recover from: nothing more will be served.
    pub fn engine_failed() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "The server's engine stopped after an internal error; restart the server.",
        )
        .with_code("engine_failed")
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message).with_code("internal_error")
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind,
                param: self.param.clone(),
                code: self.code,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

/// Parses a JSON body into `T`: malformed JSON, a body that is not an object, and wrong types are 400s (the
/// last naming the field).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    deserialize_fields(parse_object(body)?)
}

/// Parses a chat or completions body: the request's own fields into `T` and, from the same object, the sampling
/// fields into [`RawSampling`]; errors as [`parse_json`]'s.
pub fn parse_json_with_sampling<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<(T, RawSampling), ApiError> {
    let object = parse_object(body)?;
    let sampling = deserialize_fields(&object)?;
    Ok((deserialize_fields(object)?, sampling))
}

fn parse_object(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("The request body is not valid JSON: {e}")).with_code("invalid_json")
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object.").with_code("invalid_json"));
    }
    Ok(value)
}

/// Wrong types are reported with the path of the field.
fn deserialize_fields<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(object: D) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(object).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let mut e = ApiError::bad_request(format!("Invalid value for `{path}`: {inner}")).with_code("invalid_type");
        e.param = (path != "." && !path.is_empty()).then_some(path);
        e
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ChatCompletionRequest, CompletionRequest};

    #[test]
    fn type_errors_name_the_field_and_what_was_expected() {
        let e = parse_json_with_sampling::<ChatCompletionRequest>(br#"{"stop": 5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(e.message.contains("a string or an array of strings"), "{}", e.message);
        let e = parse_json_with_sampling::<CompletionRequest>(br#"{"prompt": {"a": 1}}"#).unwrap_err();
        assert!(e.message.contains("array of token ids"), "{}", e.message);
        let e = parse_json_with_sampling::<ChatCompletionRequest>(br#"{"messages": [], "temperature": "hot"}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert_eq!(
            e.message,
            "Invalid value for `temperature`: invalid type: string \"hot\", expected f32"
        );
        assert_eq!(e.code, Some("invalid_type"));
        let e = parse_json_with_sampling::<CompletionRequest>(br#"{"prompt": "a", "seed": 1.5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("seed"));
        assert_eq!(
            e.message,
            "Invalid value for `seed`: invalid type: floating point `1.5`, expected i64"
        );
        let e = parse_json_with_sampling::<CompletionRequest>(br#"{"prompt": "a", "echo": 1}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
        assert_eq!(
            parse_json::<ChatCompletionRequest>(b"[1]").unwrap_err().code,
            Some("invalid_json")
        );
        assert_eq!(
            parse_json::<ChatCompletionRequest>(b"{").unwrap_err().code,
            Some("invalid_json")
        );
        let (_, sampling) =
            parse_json_with_sampling::<ChatCompletionRequest>(br#"{"unknown": {"x": 1}, "n": null, "top_k": 5}"#)
                .unwrap();
        assert_eq!((sampling.n, sampling.top_k), (None, Some(5)));
        assert_eq!(
            parse_json_with_sampling::<CompletionRequest>(b"[1]").unwrap_err().code,
            Some("invalid_json")
        );
    }
}
