//! The error a client sees: an HTTP status and the OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`.
#![forbid(unsafe_code)]

use serde_json::Value;

/// An error as the client sees it: an HTTP status and the OpenAI error body.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    pub message: String,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, code: Option<&'static str>, message: String) -> ApiError {
        ApiError { status, kind, code, param: None, message, retry_after: None }
    }

    /// 400: the request is wrong.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", None, message.into())
    }

    /// 400 naming the offending field.
    pub fn param(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param), ..ApiError::invalid(message) }
    }

    /// 400 with a code (e.g. `context_length_exceeded`).
    pub fn invalid_code(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", Some(code), message.into())
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(401, "invalid_request_error", Some("invalid_api_key"), message.into())
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(404, "invalid_request_error", Some(code), message.into())
    }

    pub fn method_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(405, "invalid_request_error", Some("method_not_allowed"), message.into())
    }

    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(413, "invalid_request_error", Some("request_too_large"), message.into())
    }

    /// 408: the body did not arrive in time (`--body-timeout`); the connection is closed.
    pub fn request_timeout(message: impl Into<String>) -> ApiError {
        ApiError::new(408, "invalid_request_error", Some("request_timeout"), message.into())
    }

    pub fn queue_full(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            ..ApiError::new(429, "rate_limit_error", Some("queue_full"), message.into())
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError { retry_after: Some(5), ..ApiError::new(503, "server_error", Some("shutting_down"), message.into()) }
    }

    /// 503 for a connection beyond `--max-connections`, answered on accept.
    pub fn too_many_connections(message: impl Into<String>) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(503, "server_error", Some("too_many_connections"), message.into())
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(500, "server_error", None, message.into())
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        })
    }
}
