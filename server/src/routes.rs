//! The router: every route with its handler, its scope and its place in the OpenAPI document.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::middleware::from_fn_with_state;
use axum::response::{Html, IntoResponse, Response};
use axum::{Json, Router};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Serialize;
use sha2::Digest as _;
use utoipa::ToSchema;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::{self, Guard, Scope, Tokens};
use crate::counters;
use crate::error::{ApiError, ErrorBody};
use crate::events;
use crate::limits::{MAX_BODY_BYTES, READY_PING_TIMEOUT};
use crate::metrics;
use crate::pipeline::PipelineState;
use crate::state::AppState;

/// The operator console: one page, no build step.
const CONSOLE: &str = include_str!("console.html");

/// The API's routes over `state`, and its OpenAPI document; `tokens` `None` lets every request
/// through (loopback use).
pub fn router(state: Arc<AppState>, tokens: Option<Arc<Tokens>>) -> Router {
    let (router, _) = api(state, tokens);
    router
}

/// The routes and the OpenAPI document generated from their handlers.
pub fn api(
    state: Arc<AppState>,
    tokens: Option<Arc<Tokens>>,
) -> (Router, utoipa::openapi::OpenApi) {
    let guard = |scope| Guard {
        tokens: tokens.clone(),
        scope,
    };
    let read = OpenApiRouter::new()
        .routes(routes!(counters::get_counter))
        .routes(routes!(counters::batch_get))
        .routes(routes!(counters::inspect))
        .routes(routes!(counters::has_liked))
        .routes(routes!(counters::top))
        .routes(routes!(counters::namespaces))
        .routes(routes!(pipeline))
        .route_layer(from_fn_with_state(guard(Scope::Read), auth::require));
    let write = OpenApiRouter::new()
        .routes(routes!(events::post_events))
        .routes(routes!(counters::like, counters::unlike))
        .route_layer(from_fn_with_state(guard(Scope::Write), auth::require));
    let open = OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics_text));
    let (router, mut openapi) = OpenApiRouter::new()
        .merge(read)
        .merge(write)
        .merge(open)
        .split_for_parts();
    openapi.info.title = "tally".to_owned();
    openapi.info.contact = None;
    openapi.info.license = Some(utoipa::openapi::License::new(env!("CARGO_PKG_LICENSE")));
    openapi.info.version = env!("CARGO_PKG_VERSION").to_owned();
    openapi.info.description = Some(
        "Counts of likes, views and other events: read through a per-namespace cache, written through Kafka exactly once. Errors are {\"error\": {\"code\", \"message\"}} with a stable code.".to_owned(),
    );
    let components = openapi.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    let document = Arc::new(openapi.clone());
    let metrics = state.metrics.clone();
    let router = router
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let document = document.clone();
                async move { Json(document.as_ref().clone()) }
            }),
        )
        .route("/", axum::routing::get(console))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(from_fn_with_state(metrics, metrics::track))
        .with_state(state);
    // Without tokens, only requests addressed to loopback are answered (no DNS rebinding).
    let router = match tokens {
        Some(_) => router,
        None => router.layer(axum::middleware::from_fn(auth::loopback_only)),
    };
    (router, openapi)
}

/// A status answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Status {
    /// `ok` or `ready`.
    status: &'static str,
}

/// Liveness: 200 while the process serves.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Status)))]
async fn healthz() -> Json<Status> {
    Json(Status { status: "ok" })
}

/// Readiness: 200 if Redis answers a `PING` within a second, else 503.
#[utoipa::path(
    get, path = "/readyz", tag = "operations",
    responses((status = 200, body = Status), (status = 503, body = ErrorBody))
)]
async fn readyz(State(state): State<Arc<AppState>>) -> Result<Json<Status>, ApiError> {
    state
        .conn
        .ping(READY_PING_TIMEOUT)
        .await
        .map_err(ApiError::redis)?;
    Ok(Json(Status { status: "ready" }))
}

async fn console() -> Response {
    static POLICY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let policy = POLICY.get_or_init(|| console_policy(CONSOLE));
    (
        [
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, policy.as_str()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        Html(CONSOLE),
    )
        .into_response()
}

/// The console's Content-Security-Policy: its inline scripts and styles run only by their
/// SHA-256 (an id made of HTML that slipped into the page could not run), it talks only to
/// this origin, and no other site may frame it.
fn console_policy(page: &str) -> String {
    let hashes = |tag: &str| -> String {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        let mut hashes = String::new();
        let mut rest = page;
        while let Some(start) = rest.find(&open) {
            let body = &rest[start + open.len()..];
            let Some(end) = body.find(&close) else { break };
            let digest = sha2::Sha256::digest(&body.as_bytes()[..end]);
            hashes.push_str(&format!(" 'sha256-{}'", BASE64.encode(digest)));
            rest = &body[end..];
        }
        hashes
    };
    format!(
        "default-src 'none'; script-src{}; style-src{}; connect-src 'self'; img-src 'self'; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        hashes("script"),
        hashes("style"),
    )
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

/// Per partition of tally's topic: the log's end, where counts are durable, and the lag between
/// them in events and seconds.
#[utoipa::path(
    get, path = "/v1/pipeline", tag = "operations",
    responses(
        (status = 200, body = PipelineState),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "Kafka or Redis did not answer"),
    ),
    security(("bearer" = ["read"]))
)]
async fn pipeline(State(state): State<Arc<AppState>>) -> Result<Json<PipelineState>, ApiError> {
    Ok(Json(
        state.pipeline.state(state.counts.reader().reader()).await?,
    ))
}

/// Prometheus metrics, in its text format.
#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus's text format", content_type = "text/plain"))
)]
async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let body = state.metrics.render(state.counts.reader().stats());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_policy_allows_its_inline_code_by_hash_only() {
        let page = "<style>p{}</style><script>go()</script><script>more()</script>";
        let policy = console_policy(page);
        let hash = |text: &str| BASE64.encode(sha2::Sha256::digest(text.as_bytes()));
        assert!(
            policy.contains(&format!(
                "script-src 'sha256-{}' 'sha256-{}';",
                hash("go()"),
                hash("more()")
            )),
            "{policy}"
        );
        assert!(
            policy.contains(&format!("style-src 'sha256-{}';", hash("p{}"))),
            "{policy}"
        );
        assert!(policy.starts_with("default-src 'none';"), "{policy}");
        assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
        assert!(!policy.contains("unsafe"), "{policy}");
        // The real page: one script, one style, both hashed.
        let real = console_policy(CONSOLE);
        assert_eq!(real.matches("'sha256-").count(), 2, "{real}");
    }
}
