//! The aggregator's HTTP endpoint: `GET /metrics` (Prometheus text format), `GET /healthz`
//! (liveness) and `GET /readyz` (readiness).
//!
//! - `/healthz` answers 200 while the process serves at all, draining included: restarting a
//!   draining aggregator would only lose the drain.
//! - `/readyz` answers 200 only while the aggregator holds membership of its consumer group and
//!   Redis answers a `PING` within [`READY_PING_TIMEOUT`]; otherwise 503 with the reason. It
//!   turns 503 as soon as shutdown starts.
//!
//! Served by the project's one HTTP server (`tally_ops::http`, axum on hyper) within its
//! default limits: connections, header size, header and request timeouts. The server runs
//! until its task is aborted, after the final drain.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tally_common::RedisConn;
use tally_ops::http::Limits;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::operator::metrics::Metrics;

/// How long `/readyz` waits for Redis to answer its `PING`.
pub const READY_PING_TIMEOUT: Duration = Duration::from_secs(1);

/// What the endpoints report on.
#[derive(Debug)]
pub struct Probes {
    /// The metrics (group membership is one of them).
    pub metrics: Arc<Metrics>,
    /// The Redis connection, once made.
    pub redis: OnceLock<RedisConn>,
    /// Fires when shutdown starts.
    pub shutdown: CancellationToken,
}

/// Binds `addr` (fails now if it is taken) and serves until the returned task is aborted.
pub async fn serve(
    addr: SocketAddr,
    probes: Arc<Probes>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n") })
        .with_state(probes);
    // Aborted rather than cancelled: nothing is left to answer once the daemon has drained.
    let never = CancellationToken::new();
    let handle = tokio::spawn(tally_ops::http::serve(
        listener,
        router,
        Limits::default(),
        None,
        never,
    ));
    Ok((bound, handle))
}

/// How often [`watch_redis`] pings Redis.
pub const REDIS_PING_INTERVAL: Duration = Duration::from_secs(5);

/// Pings Redis every [`REDIS_PING_INTERVAL`] and records the answer as `tally_redis_up`, until
/// `cancel` fires.
pub async fn watch_redis(probes: Arc<Probes>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(REDIS_PING_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let up = ping(&probes).await;
        if let Err(why) = &up {
            tracing::warn!(%why, "Redis did not answer a PING");
        }
        probes.metrics.redis_answered(up.is_ok());
    }
}

/// Pings Redis, for at most [`READY_PING_TIMEOUT`].
async fn ping(probes: &Probes) -> Result<(), String> {
    let Some(conn) = probes.redis.get() else {
        return Err("redis: not connected yet".to_owned());
    };
    conn.ping(READY_PING_TIMEOUT).await
}

/// Whether the aggregator is ready, or why not.
async fn readiness(probes: &Probes) -> Result<(), String> {
    if probes.shutdown.is_cancelled() {
        return Err("shutting down".to_owned());
    }
    if !probes.metrics.is_group_member() {
        return Err("not a member of the consumer group".to_owned());
    }
    ping(probes).await
}

async fn metrics(State(probes): State<Arc<Probes>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        probes.metrics.render(),
    )
}

async fn ready(State(probes): State<Arc<Probes>>) -> (StatusCode, String) {
    match readiness(&probes).await {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}
