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
//! | `unauthorized` | 401 | no bearer token, or an unknown one |
//! | `forbidden` | 403 | a token without the route's scope |
//! | `not_found`, `method_not_allowed` | 404, 405 | no such route, or not with that method |
//! | `body_too_large` | 413 | a body over [`crate::MAX_BODY_BYTES`] |
//! | `unsupported_media_type` | 415 | a body not sent as `application/json` |
//! | `corrupt_counter` | 500 | a key under tally's prefix holds something that is not a count |
//! | `redis_unavailable`, `kafka_unavailable`, `store_unavailable` | 503 | Redis, Kafka or the PostgreSQL store did not answer in time |

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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
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
            ReadError::Redis(e) => Self::redis(e),
            ReadError::Store(e) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
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
