//! The tally HTTP API, read side: counter totals as JSON, for services in any language, served
//! through the same [`CachedReader`] the Rust crates use (per-namespace TTL, one refresh per
//! counter across processes).
//!
//! | route | answer |
//! |---|---|
//! | `GET /v1/counters/{id}` | `{"counter": id, "total": n}`, through the cache; `?exact=true` sums the shares now |
//! | `POST /v1/counters/batch-get` | `{"counters": [...]}` (at most [`MAX_BATCH`]) → `{"totals": [{"counter", "total"}, ...]}` in the same order, one round of Redis reads |
//! | `GET /healthz` | 200 while the process serves |
//! | `GET /readyz` | 200 if Redis answers a `PING`, else 503 |
//!
//! Every error is JSON, `{"error": {"code": ..., "message": ...}}`, with a stable code: bad
//! input of every kind is a 4xx, never a 500 or a dropped connection (see [`ApiError`]).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tally_common::{CachedReader, ReadError, RedisConn};

/// Most counters one `batch-get` may name.
pub const MAX_BATCH: usize = 1_000;

/// Largest request body accepted, in bytes: a full batch of the longest counter ids fits.
pub const MAX_BODY_BYTES: usize = 512 * 1024;

/// Longest `/readyz` waits for Redis to answer its `PING`.
pub const READY_PING_TIMEOUT: Duration = Duration::from_secs(1);

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Totals, through the cache.
    pub reader: CachedReader,
    /// The Redis connection, for readiness.
    pub conn: RedisConn,
}

/// The API's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/counters/batch-get", post(batch_get))
        .route("/v1/counters/{id}", get(get_counter))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// An error answer: its HTTP status and a stable code, with a message for people.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": { "code": self.code, "message": self.message }
        });
        (self.status, Json(body)).into_response()
    }
}

impl From<ReadError> for ApiError {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::InvalidCounter(e) => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_counter", e.to_string())
            }
            ReadError::Redis(e) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "redis_unavailable",
                e.to_string(),
            ),
            // Not the caller's input: what Redis holds under tally's keys is not a count.
            other => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "corrupt_counter",
                other.to_string(),
            ),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("the body is larger than {MAX_BODY_BYTES} bytes"),
            );
        }
        ApiError::new(StatusCode::BAD_REQUEST, "bad_json", rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_query", rejection.body_text())
    }
}

/// One counter's total.
#[derive(Debug, Serialize)]
struct Total {
    counter: String,
    total: i64,
}

/// `?exact=true`.
#[derive(Debug, Deserialize)]
struct ReadQuery {
    #[serde(default)]
    exact: bool,
}

async fn get_counter(
    State(state): State<Arc<AppState>>,
    Path(counter): Path<String>,
    query: Result<Query<ReadQuery>, QueryRejection>,
) -> Result<Json<Total>, ApiError> {
    let Query(query) = query?;
    let total = if query.exact {
        state.reader.get_exact(&counter).await?
    } else {
        state.reader.get(&counter).await?
    };
    Ok(Json(Total { counter, total }))
}

/// A `batch-get` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchGet {
    counters: Vec<String>,
}

async fn batch_get(
    State(state): State<Arc<AppState>>,
    body: Result<Json<BatchGet>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(BatchGet { counters }) = body?;
    if counters.len() > MAX_BATCH {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "too_many_counters",
            format!(
                "{} counters asked; at most {MAX_BATCH} per request",
                counters.len()
            ),
        ));
    }
    let totals = state.reader.get_many(&counters).await?;
    let totals: Vec<Total> = (counters.into_iter().zip(totals))
        .map(|(counter, total)| Total { counter, total })
        .collect();
    Ok(Json(serde_json::json!({ "totals": totals })))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

async fn readyz(State(state): State<Arc<AppState>>) -> Result<Json<serde_json::Value>, ApiError> {
    state
        .conn
        .ping(READY_PING_TIMEOUT)
        .await
        .map_err(|why| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "redis_unavailable", why))?;
    Ok(Json(serde_json::json!({ "status": "ready" })))
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
}
