//! Connecting to Redis: one standalone server or a Redis Cluster, behind one connection type.
//!
//! A target is written as a URL. `redis://host:port/db` (or `rediss://` for TLS) is a standalone
//! server, reached through redis-rs's [`ConnectionManager`], which reconnects by itself.
//! `redis+cluster://host:port,host:port` (or `rediss+cluster://`) names seed nodes of a Redis
//! Cluster. Either way commands time out instead of hanging, so callers can retry.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// How long one command or pipeline may take before it fails with a timeout.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection to a standalone Redis or a Redis Cluster. Cheap to clone; clones share the
/// underlying connection(s), which pipeline concurrent requests.
#[derive(Clone)]
pub enum RedisConn {
    /// A standalone server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Single(_) => "RedisConn::Single",
            RedisConn::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl RedisConn {
    /// Connects to `url`. A standalone target connects lazily: this succeeds even while the
    /// server is down, and the first command fails (and reconnects) instead. A cluster target
    /// needs one seed node to answer now, to learn the topology.
    pub async fn connect(url: &str) -> redis::RedisResult<Self> {
        if let Some((tls, seeds)) = cluster_seeds(url) {
            let scheme = if tls { "rediss" } else { "redis" };
            let nodes: Vec<String> = seeds.map(|s| format!("{scheme}://{s}")).collect();
            let client = redis::cluster::ClusterClient::builder(nodes)
                .connection_timeout(DEFAULT_CONNECT_TIMEOUT)
                .response_timeout(DEFAULT_RESPONSE_TIMEOUT)
                .build()?;
            Ok(RedisConn::Cluster(client.get_async_connection().await?))
        } else {
            let client = redis::Client::open(url)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
                .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            Ok(RedisConn::Single(ConnectionManager::new_lazy_with_config(
                client, config,
            )?))
        }
    }

    /// Whether this is a Redis Cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }
}

/// Sends `commands` and returns their replies in order: as one pipeline on a standalone server,
/// and as concurrent requests on a cluster (redis-rs refuses cluster pipelines whose commands
/// span slots). Each command must itself be single-slot.
pub async fn query_each<T>(conn: &RedisConn, commands: Vec<Cmd>) -> redis::RedisResult<Vec<T>>
where
    T: redis::FromRedisValue + Send + 'static,
{
    if commands.is_empty() {
        return Ok(Vec::new());
    }
    if conn.is_cluster() {
        let requests: Vec<_> = commands
            .into_iter()
            .map(|command| {
                let mut conn = conn.clone();
                tokio::spawn(async move { command.query_async::<T>(&mut conn).await })
            })
            .collect();
        let mut replies = Vec::with_capacity(requests.len());
        for request in requests {
            replies.push(request.await.map_err(|_| {
                redis::RedisError::from((redis::ErrorKind::Io, "request task cancelled"))
            })??);
        }
        Ok(replies)
    } else {
        let mut pipe = redis::pipe();
        for command in commands {
            pipe.add_command(command);
        }
        pipe.query_async(&mut conn.clone()).await
    }
}

/// Whether `url` names a Redis Cluster (`redis+cluster://` or `rediss+cluster://`).
pub fn is_cluster_url(url: &str) -> bool {
    cluster_seeds(url).is_some()
}

/// `Some((tls, seeds))` when `url` names a cluster.
fn cluster_seeds(url: &str) -> Option<(bool, impl Iterator<Item = &str>)> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("redis+cluster://") {
        (false, rest)
    } else {
        (true, url.strip_prefix("rediss+cluster://")?)
    };
    Some((
        tls,
        rest.split(',').map(str::trim).filter(|s| !s.is_empty()),
    ))
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_list_their_seeds() {
        let (tls, seeds) = cluster_seeds("redis+cluster://a:1, b:2,").expect("cluster");
        assert!(!tls);
        assert_eq!(seeds.collect::<Vec<_>>(), ["a:1", "b:2"]);
        assert!(cluster_seeds("rediss+cluster://a:1").is_some_and(|(tls, _)| tls));
        assert!(cluster_seeds("redis://a:1").is_none());
    }
}
