//! The aggregator's HTTP endpoint: `GET /metrics` (Prometheus text format), `GET /healthz`
//! (liveness) and `GET /readyz` (readiness).
//!
//! - `/healthz` answers 200 while the process serves at all, draining included: restarting a
//!   draining aggregator would only lose the drain.
//! - `/readyz` answers 200 only while the aggregator holds membership of its consumer group and
//!   Redis answers a `PING` within [`READY_PING_TIMEOUT`]; otherwise 503 with the reason. It
//!   turns 503 as soon as shutdown starts.
//!
//! Three fixed routes need no web framework: this reads one request line, answers, and closes.
//! The server runs until its task is aborted, after the final drain.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tally_common::RedisConn;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
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
    let handle = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let probes = probes.clone();
            tokio::spawn(async move {
                let _ = answer(stream, &probes).await;
            });
        }
    });
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

async fn answer(stream: tokio::net::TcpStream, probes: &Probes) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).await?;
    // Drain the headers so the client sees a clean close.
    let mut line = String::new();
    while reader.read_line(&mut line).await? > 2 {
        line.clear();
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let (status, content_type, body) = match path {
        "/metrics" => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            probes.metrics.render(),
        ),
        "/healthz" => ("200 OK", "text/plain", "ok\n".to_owned()),
        "/readyz" => match readiness(probes).await {
            Ok(()) => ("200 OK", "text/plain", "ready\n".to_owned()),
            Err(why) => ("503 Service Unavailable", "text/plain", format!("{why}\n")),
        },
        _ => ("404 Not Found", "text/plain", "not found\n".to_owned()),
    };
    let mut stream = reader.into_inner();
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
