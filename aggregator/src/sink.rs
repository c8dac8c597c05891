//! Where flushed deltas go: the [`Sink`] seam, and [`RedisSink`], which writes them to Redis.
//!
//! A flush of one partition's batch writes all its deltas into one shard group (see
//! `tally_common::keyspace`) as `INCRBY`s inside one `MULTI`/`EXEC`: every key shares the group's
//! hash tag, so the transaction is single-slot (valid on Redis Cluster) and lands all or nothing.
//! Errors are classified at this boundary as retryable (connection, timeout, server busy or
//! failing over) or not; the flush loop retries both with capped backoff, because dropping a
//! batch would lose counts, but only the former are expected to heal by themselves.

use std::future::Future;

use redis::ErrorKind;
use tally_common::{Keyspace, RedisConn};

/// Why a sink write failed.
#[derive(Debug, thiserror::Error)]
#[error("{kind} redis error: {source}")]
pub struct SinkError {
    /// Whether a retry can be expected to succeed without an operator.
    pub kind: SinkErrorKind,
    /// What Redis (or the connection) said.
    #[source]
    pub source: redis::RedisError,
}

/// Retryable or fatal, decided once here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkErrorKind {
    /// Connection lost, timeout, server loading, busy, failing over: retry.
    Retryable,
    /// The server refused the command (wrong type, overflow, ACL): needs an operator.
    Fatal,
}

impl std::fmt::Display for SinkErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SinkErrorKind::Retryable => "retryable",
            SinkErrorKind::Fatal => "fatal",
        })
    }
}

impl From<redis::RedisError> for SinkError {
    fn from(source: redis::RedisError) -> Self {
        let retryable = source.is_io_error()
            || source.is_timeout()
            || source.is_connection_dropped()
            || source.is_connection_refusal()
            || source.is_unrecoverable_error()
            || matches!(
                source.kind(),
                ErrorKind::ClusterConnectionNotFound
                    | ErrorKind::Server(
                        redis::ServerErrorKind::BusyLoading
                            | redis::ServerErrorKind::TryAgain
                            | redis::ServerErrorKind::ClusterDown
                            | redis::ServerErrorKind::MasterDown
                            | redis::ServerErrorKind::Moved
                            | redis::ServerErrorKind::Ask
                            | redis::ServerErrorKind::ReadOnly
                    )
            );
        SinkError {
            kind: if retryable {
                SinkErrorKind::Retryable
            } else {
                SinkErrorKind::Fatal
            },
            source,
        }
    }
}

/// Applies one batch of deltas to one shard group, all or nothing.
pub trait Sink: Clone + Send + Sync + 'static {
    /// Adds each `(counter, delta)` to the counter's key in `group`.
    fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
}

/// The Redis sink: one `MULTI`/`EXEC` of `INCRBY`s per flush.
#[derive(Debug, Clone)]
pub struct RedisSink {
    /// The connection (standalone or cluster).
    conn: RedisConn,
    /// Which keys to write.
    keyspace: Keyspace,
}

impl RedisSink {
    /// A sink writing through `conn` into `keyspace`.
    pub fn new(conn: RedisConn, keyspace: Keyspace) -> Self {
        Self { conn, keyspace }
    }
}

impl Sink for RedisSink {
    async fn apply(&self, group: u32, deltas: &[(String, i64)]) -> Result<(), SinkError> {
        if deltas.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        let mut key = String::new();
        for (counter, delta) in deltas {
            self.keyspace.write_counter_key(&mut key, group, counter);
            pipe.cmd("INCRBY").arg(&key).arg(*delta).ignore();
        }
        let mut conn = self.conn.clone();
        pipe.query_async::<()>(&mut conn).await?;
        Ok(())
    }
}
