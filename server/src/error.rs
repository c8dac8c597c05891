//! [`ApiError`]: every error the API answers, as JSON with a stable code.
//!
//! | code | status | when |
//! |---|---|---|
//! | `invalid_counter`, `invalid_actor` | 400 | an id breaks the wire format's rules |
//! | `bad_query`, `bad_json` | 400 | a query string or body that does not parse |
//! | `too_many_counters`, `too_many_events` | 400 | over [`crate::MAX_BATCH`] / [`crate::MAX_EVENTS`] |
//! | `invalid_events` | 400 | `POST /v1/events` with a bad event: `details` gives each one's index and reason |
//! | `not_deduplicated` | 400 | a like route on a namespace that does not count once per actor |
//! | `invalid_window`, `no_such_window` | 400 | `?window=` that is not a duration, or that no window of the counter's namespace can sum |
//! | `window_too_large` | 400 | a window read of more (counter, bucket) pairs than `tally_common::window::MAX_WINDOW_CELLS` (100,000) |
//! | `unauthorized` | 401 | no bearer token, or an unknown one |
//! | `forbidden` | 403 | a token without the route's scope |
//! | `not_found`, `method_not_allowed` | 404, 405 | no such route, or not with that method |
//! | `body_too_large` | 413 | a body over [`crate::MAX_BODY_BYTES`] |
//! | `unsupported_media_type` | 415 | a body not sent as `application/json` |
//! | `corrupt_counter` | 500 | a key under tally's prefix holds something that is not a count |
//! | `redis_unavailable`, `kafka_unavailable`, `store_unavailable` | 503 | Redis, Kafka or the PostgreSQL store did not answer in time |
//! | `slow_read_during_shrink` | 503 | on a Redis Cluster, five reads in a row took `tally_common::regroup::FOLD_READ_BOUND` (1 s) or longer while a shrink was under way or the group plan changed |
//! | `forbidden_host` | 403 | without tokens, a request addressed to a name that is not loopback |
//!
//! A 5xx answer says what failed in general terms and carries a `request_id`; the error's own
//! text (which may name hosts, keys or a store's internals) goes only to the server's log, under
//! the same id.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use tally_common::ReadError;
use utoipa::ToSchema;

use crate::limits::MAX_BODY_BYTES;

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong: a stable code for programs, a message for people.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable: see the table in the server's documentation.
    pub code: &'static str,
    /// For people; may change between versions.
    pub message: String,
    /// `invalid_events`: each bad event's index and reason. `kafka_unavailable` after events
    /// were sent: how many of them Kafka acknowledged and which it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub details: Option<serde_json::Value>,
    /// 5xx answers: the id under which the server logged what happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// An error answer: its HTTP status, a stable code and a message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    detail: ErrorDetail,
}

impl ApiError {
    /// An error with `status`, `code` and `message`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            detail: ErrorDetail {
                code,
                message: message.into(),
                details: None,
                request_id: None,
            },
        }
    }

    /// The same error, carrying `details`.
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.detail.details = Some(details);
        self
    }

    /// A 400 with `code`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// Its HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Its stable code.
    pub fn code(&self) -> &'static str {
        self.detail.code
    }

    /// What it carries beyond the code and message, if anything.
    pub fn details(&self) -> Option<&serde_json::Value> {
        self.detail.details.as_ref()
    }
}

/// What a 5xx answer says, by code: general terms only.
fn general_terms(code: &str) -> &'static str {
    match code {
        "redis_unavailable" => "Redis did not answer in time",
        "kafka_unavailable" => "Kafka did not acknowledge the events in time",
        "store_unavailable" => "the store of record did not answer in time",
        "corrupt_counter" => "a key under tally's prefix holds something that is not a count",
        "slow_read_during_shrink" => {
            "reads took too long to be exact while a shrink folds shares: try again"
        }
        _ => "the server could not answer",
    }
}

/// A new request id: 16 hex digits, unique within the process and unlikely to repeat across
/// restarts.
fn request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(0, |d| d.as_nanos() as u64) ^ u64::from(std::process::id()).rotate_left(32)
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{:016x}", seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

impl IntoResponse for ApiError {
    fn into_response(mut self) -> Response {
        if self.status.is_server_error() {
            let id = request_id();
            tracing::warn!(
                request_id = %id,
                status = self.status.as_u16(),
                code = self.detail.code,
                error = %self.detail.message,
                "request failed"
            );
            self.detail.message = format!(
                "{} (request {id}: the server's log has the detail)",
                general_terms(self.detail.code)
            );
            self.detail.request_id = Some(id);
        }
        let unauthorized = self.status == StatusCode::UNAUTHORIZED;
        let mut response = (self.status, Json(ErrorBody { error: self.detail })).into_response();
        if unauthorized {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"tally\""),
            );
        }
        response
    }
}

impl From<ReadError> for ApiError {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::InvalidCounter(e) => Self::bad_request("invalid_counter", e.to_string()),
            e @ ReadError::Window { .. } => Self::bad_request("no_such_window", e.to_string()),
            e @ ReadError::WindowTooLarge { .. } => {
                Self::bad_request("window_too_large", e.to_string())
            }
            ReadError::Redis(e) => Self::redis(e),
            ReadError::Store(e) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                e.to_string(),
            ),
            e @ ReadError::Slow { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "slow_read_during_shrink",
                e.to_string(),
            ),
            // Not the caller's input: what Redis holds under tally's keys is not a count.
            other => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "corrupt_counter",
                other.to_string(),
            ),
        }
    }
}

impl ApiError {
    /// Redis failed or timed out.
    pub fn redis(error: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "redis_unavailable",
            error.to_string(),
        )
    }

    /// Kafka failed or timed out.
    pub fn kafka(error: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "kafka_unavailable",
            error.to_string(),
        )
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("the body is larger than {MAX_BODY_BYTES} bytes"),
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as JSON, with content-type: application/json",
            ),
            _ => Self::bad_request("bad_json", rejection.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::bad_request("bad_query", rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::bad_request("invalid_counter", rejection.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_5xx_says_what_failed_in_general_terms_with_a_request_id() {
        let raw = "redis://:hunter2@10.0.0.7:6379: connection refused";
        let response = ApiError::redis(raw).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("a body");
        let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        let text = body.to_string();
        assert!(
            !text.contains("hunter2") && !text.contains("10.0.0.7"),
            "{text}"
        );
        assert_eq!(body["error"]["code"], "redis_unavailable");
        let id = body["error"]["request_id"].as_str().expect("a request id");
        assert_eq!(id.len(), 16, "{id}");
        let message = body["error"]["message"].as_str().expect("a message");
        assert!(
            message.starts_with("Redis did not answer in time"),
            "{message}"
        );
        assert!(message.contains(id), "{message}");

        // A 4xx keeps its message: it is about the caller's input.
        let response = ApiError::bad_request("bad_query", "no such field x").into_response();
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("a body");
        let text = String::from_utf8_lossy(&body).into_owned();
        assert!(
            text.contains("no such field x") && !text.contains("request_id"),
            "{text}"
        );
    }
}
