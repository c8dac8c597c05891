//! The tally HTTP API: counts for services in any language, read through the same
//! [`tally_common::CachedReader`] the Rust crates use (per-namespace TTL, one refresh per counter
//! across processes) and written through the producer crate, plus an operator console.
//!
//! | route | scope | answer |
//! |---|---|---|
//! | `GET /v1/counters/{id}` | read | `{"counter", "total"}`, through the cache; `?exact=true` sums the shares now |
//! | `POST /v1/counters/batch-get` | read | `{"counters": [...]}` (at most [`MAX_BATCH`]) → `{"totals": [...]}` in order, one round of Redis reads |
//! | `GET /v1/counters/{id}/shares` | read | the exact total, each group's share, the direct shard count, the cached total and its age |
//! | `GET`/`PUT`/`DELETE /v1/counters/{id}/likes/{actor}` | read / write | has liked, like, unlike (namespaces that count once per actor) |
//! | `GET /v1/namespaces` | read | the namespaces the policy file lists, with their policies |
//! | `GET /v1/namespaces/{ns}/top?k=10` | read | the namespace's fastest-moving counters |
//! | `POST /v1/events` | write | events in the wire format, answered once Kafka acknowledged them all ([`events`]) |
//! | `GET /v1/pipeline` | read | per partition: the log's end, where counts are durable, the lag ([`pipeline`]) |
//! | `GET /openapi.json` | - | the OpenAPI 3 document, generated from these handlers |
//! | `GET /metrics` | - | Prometheus metrics ([`metrics`]) |
//! | `GET /healthz`, `GET /readyz` | - | liveness; readiness (Redis answers a `PING`) |
//! | `GET /` | - | the operator console, one page |
//!
//! Scopes are checked when a token file is configured ([`auth`]). Every error is JSON,
//! `{"error": {"code", "message"}}`, with a stable code ([`error`]): bad input of every kind is
//! a 4xx, never a 500 or a dropped connection.

pub mod auth;
pub mod config;
pub mod counters;
pub mod error;
pub mod events;
pub mod limits;
pub mod metrics;
pub mod pipeline;
pub mod routes;
pub mod state;

pub use events::MAX_EVENTS;
pub use limits::{MAX_BATCH, MAX_BODY_BYTES, MAX_TOP, READY_PING_TIMEOUT};
pub use routes::{api, router};
pub use state::AppState;
