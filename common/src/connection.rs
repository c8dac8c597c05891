//! Connecting to Redis: one standalone server or a Redis Cluster, behind one connection type.
//!
//! A target is written as a URL and parsed once into a [`RedisTarget`]. `redis://host:port/db`
//! (or `rediss://` for TLS) is a standalone server, reached through redis-rs's
//! [`ConnectionManager`], which reconnects by itself. `redis+cluster://host:port,host:port` (or
//! `rediss+cluster://`) names seed nodes of a Redis Cluster. Either way commands time out
//! instead of hanging, so callers can retry.
//!
//! A cluster connection that stops answering altogether is replaced: redis-rs's cluster client
//! has been seen to wedge during a slot migration (a topology refresh that never ended, every
//! command after it timing out, PINGs included), and it does not recover by itself. When every
//! request has timed out for [`HEAL_AFTER`], the next timeout connects a fresh connection from
//! the seed nodes in the background, and requests go to it once it is up ([`HealingCluster`]).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// How long one command or pipeline may take before it fails with a timeout.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long every request to a cluster must have timed out before the connection is replaced.
pub const HEAL_AFTER: Duration = Duration::from_secs(10);

/// A connection to a standalone Redis or a Redis Cluster. Cheap to clone; clones share the
/// underlying connection(s), which pipeline concurrent requests.
#[derive(Clone)]
pub enum RedisConn {
    /// A standalone server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(HealingCluster),
}

/// A Redis Cluster connection that connects afresh once every request has timed out for
/// [`HEAL_AFTER`] (see the module). Clones share it, and its replacement.
#[derive(Clone)]
pub struct HealingCluster {
    shared: Arc<Healing>,
}

struct Healing {
    client: ClusterClient,
    /// How long requests may all time out before the connection is replaced.
    heal_after: Duration,
    state: Mutex<Current>,
}

/// The connection in use, and what its requests have told.
struct Current {
    conn: ClusterConnection,
    /// How many times the connection was replaced.
    generation: u64,
    /// Since when every request has timed out; `None` while requests are answered.
    silent_since: Option<Instant>,
    /// A replacement is being connected.
    replacing: bool,
}

impl std::fmt::Debug for HealingCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealingCluster")
            .field("replacements", &self.replacements())
            .finish_non_exhaustive()
    }
}

impl HealingCluster {
    /// Connects to the cluster through `client` (one seed node must answer now).
    pub async fn connect(client: ClusterClient, heal_after: Duration) -> redis::RedisResult<Self> {
        let conn = client.get_async_connection().await?;
        let state = Mutex::new(Current {
            conn,
            generation: 0,
            silent_since: None,
            replacing: false,
        });
        Ok(Self {
            shared: Arc::new(Healing {
                client,
                heal_after,
                state,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, Current> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// How many times the connection was replaced.
    pub fn replacements(&self) -> u64 {
        self.state().generation
    }

    /// Runs `request` on the connection in use and notes how it ended (see [`Self::observe`]).
    async fn request<T, F>(
        &self,
        request: impl FnOnce(ClusterConnection) -> F,
    ) -> redis::RedisResult<T>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        let (conn, generation) = {
            let state = self.state();
            (state.conn.clone(), state.generation)
        };
        let result = request(conn).await;
        self.observe(generation, &result);
        result
    }

    /// Notes how a request on the connection of `generation` ended; once every request has
    /// timed out for the healing delay, connects a replacement in the background.
    fn observe<T>(&self, generation: u64, result: &redis::RedisResult<T>) {
        let mut state = self.state();
        if generation != state.generation {
            // Sent on a connection replaced since: it says nothing of the one in use.
            return;
        }
        if !matches!(result, Err(e) if e.is_timeout()) {
            state.silent_since = None;
            return;
        }
        let since = *state.silent_since.get_or_insert_with(Instant::now);
        if since.elapsed() < self.shared.heal_after || state.replacing {
            return;
        }
        state.replacing = true;
        drop(state);
        let this = self.clone();
        tokio::spawn(async move {
            let fresh = this.shared.client.get_async_connection().await;
            let mut state = this.state();
            state.replacing = false;
            match fresh {
                Ok(conn) => {
                    (state.conn, state.generation) = (conn, generation + 1);
                    state.silent_since = None;
                    tracing::warn!(
                        silent_ms = since.elapsed().as_millis() as u64,
                        "every Redis Cluster request timed out: connected afresh"
                    );
                }
                Err(error) => {
                    tracing::warn!(%error, "every Redis Cluster request timed out, and connecting afresh failed");
                }
            }
        });
    }
}

impl ConnectionLike for HealingCluster {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.request(move |mut conn| async move { conn.req_packed_command(cmd).await }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.request(move |mut conn| async move {
            conn.req_packed_commands(cmd, offset, count).await
        }))
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Single(_) => "RedisConn::Single",
            RedisConn::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

/// Where Redis is: a standalone server or a cluster's seed nodes, with optional credentials,
/// parsed from a URL (see the module documentation). Its `Display` hides the password.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// The scheme as written (`redis`, `rediss`, `redis+cluster`, `redis+unix`...).
    scheme: String,
    /// The user name, as written in the URL (percent-encoded).
    username: Option<String>,
    /// The password, as written in the URL (percent-encoded).
    password: Option<String>,
    /// `host:port[/db][?query]` of a standalone server; each seed `host:port` of a cluster.
    hosts: Vec<String>,
}

/// A URL that names no Redis target.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Redis URL: {0}")]
pub struct TargetError(&'static str);

impl RedisTarget {
    /// Parses `scheme://[user[:password]@]host:port[/db]`, or, for a cluster,
    /// `redis+cluster://[user[:password]@]host:port,host:port`.
    pub fn parse(url: &str) -> Result<Self, TargetError> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or(TargetError("it is not scheme://host:port"))?;
        if !scheme.starts_with("redis") && scheme != "unix" {
            return Err(TargetError(
                "the scheme must be redis, rediss or their +cluster forms",
            ));
        }
        let (userinfo, hosts) = match rest.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, rest),
        };
        let (username, password) = match userinfo.map(|u| u.split_once(':')) {
            None => (None, None),
            Some(None) => (userinfo.map(str::to_owned), None),
            Some(Some((user, password))) => (
                (!user.is_empty()).then(|| user.to_owned()),
                Some(password.to_owned()),
            ),
        };
        let hosts: Vec<String> = if scheme.ends_with("+cluster") {
            (hosts.split(',').map(str::trim))
                .filter(|h| !h.is_empty())
                .map(str::to_owned)
                .collect()
        } else {
            vec![hosts.to_owned()]
        };
        if hosts.iter().all(String::is_empty) {
            return Err(TargetError("it names no host"));
        }
        Ok(Self {
            scheme: scheme.to_owned(),
            username,
            password,
            hosts,
        })
    }

    /// Whether it names a Redis Cluster (`redis+cluster://` or `rediss+cluster://`).
    pub fn is_cluster(&self) -> bool {
        self.scheme.ends_with("+cluster")
    }

    /// Whether the URL holds a password (in its user information, or as the `pass` or
    /// `password` query parameter a `redis+unix://` URL takes).
    pub fn has_password(&self) -> bool {
        self.password.is_some() || self.hosts.iter().any(|h| query_secret(h))
    }

    /// Whether the URL holds credentials (a user name or a password).
    pub fn has_credentials(&self) -> bool {
        self.username.is_some() || self.has_password() || self.hosts.iter().any(|h| query_user(h))
    }

    /// The same target with these credentials (already percent-encoded); on a cluster they apply
    /// to every seed node.
    pub fn with_credentials(mut self, username: Option<String>, password: Option<String>) -> Self {
        self.username = username;
        self.password = password;
        self
    }

    /// The URL of each node to connect to: the server, or every cluster seed (with the scheme
    /// without `+cluster`), credentials included.
    pub fn node_urls(&self) -> Vec<String> {
        let scheme = self.scheme.trim_end_matches("+cluster");
        let userinfo = self.userinfo(false);
        (self.hosts.iter())
            .map(|host| format!("{scheme}://{userinfo}{host}"))
            .collect()
    }

    /// The URL, credentials included (for the parts of redis-rs that take one).
    pub fn url(&self) -> String {
        format!(
            "{}://{}{}",
            self.scheme,
            self.userinfo(false),
            self.hosts.join(",")
        )
    }

    /// `user:password@` (the password as `***` when `redact`), or nothing.
    fn userinfo(&self, redact: bool) -> String {
        let user = self.username.as_deref().unwrap_or_default();
        match (&self.username, &self.password) {
            (None, None) => String::new(),
            (_, None) => format!("{user}@"),
            (_, Some(_)) if redact => format!("{user}:***@"),
            (_, Some(password)) => format!("{user}:{password}@"),
        }
    }
}

/// The query parameters that carry a password in a Redis URL (`redis+unix:///s?pass=...`).
const SECRET_PARAMETERS: [&str; 2] = ["pass", "password"];

/// The query parameters of `host` (`path?query`), if it has a query.
fn query_pairs(host: &str) -> impl Iterator<Item = (&str, &str)> {
    (host.split_once('?').map(|(_, query)| query).into_iter())
        .flat_map(|query| query.split('&'))
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
}

/// Whether `host`'s query holds a password.
fn query_secret(host: &str) -> bool {
    query_pairs(host).any(|(name, value)| SECRET_PARAMETERS.contains(&name) && !value.is_empty())
}

/// Whether `host`'s query names a user (`user=`).
fn query_user(host: &str) -> bool {
    query_pairs(host).any(|(name, value)| name == "user" && !value.is_empty())
}

/// `host` with the value of every secret query parameter as `***`.
fn redact_query(host: &str) -> String {
    let Some((path, query)) = host.split_once('?') else {
        return host.to_owned();
    };
    let pairs: Vec<String> = (query.split('&'))
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) if SECRET_PARAMETERS.contains(&name) && !value.is_empty() => {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}", pairs.join("&"))
}

impl std::fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<String> = self.hosts.iter().map(|h| redact_query(h)).collect();
        write!(
            f,
            "{}://{}{}",
            self.scheme,
            self.userinfo(true),
            hosts.join(",")
        )
    }
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RedisTarget({self})")
    }
}

impl std::str::FromStr for RedisTarget {
    type Err = TargetError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        Self::parse(url)
    }
}

impl RedisConn {
    /// Connects to `url` (see [`RedisConn::connect_to`]).
    pub async fn connect(url: &str) -> redis::RedisResult<Self> {
        let target = RedisTarget::parse(url)
            .map_err(|e| redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, e.0)))?;
        Self::connect_to(&target).await
    }

    /// Connects to `target`. A standalone target connects lazily: this succeeds even while the
    /// server is down, and the first command fails (and reconnects) instead. A cluster target
    /// needs one seed node to answer now, to learn the topology.
    pub async fn connect_to(target: &RedisTarget) -> redis::RedisResult<Self> {
        if target.is_cluster() {
            let client = redis::cluster::ClusterClient::builder(target.node_urls())
                .connection_timeout(DEFAULT_CONNECT_TIMEOUT)
                .response_timeout(DEFAULT_RESPONSE_TIMEOUT)
                .build()?;
            Ok(RedisConn::Cluster(
                HealingCluster::connect(client, HEAL_AFTER).await?,
            ))
        } else {
            let client = redis::Client::open(target.url())?;
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

    /// Sends `PING` and waits at most `timeout` for the answer; `Err` says why Redis did not
    /// answer (readiness probes).
    pub async fn ping(&self, timeout: Duration) -> Result<(), String> {
        let ping = redis::cmd("PING");
        match tokio::time::timeout(timeout, ping.query_async::<String>(&mut self.clone())).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("redis: {e}")),
            Err(_) => Err(format!("redis: no answer to PING within {timeout:?}")),
        }
    }

    /// Whether this is a Redis Cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }

    /// One `SCAN` call from `cursor`: the next cursor (0 once done) and about `count` keys
    /// matching `pattern`, some perhaps seen before. A standalone Redis's keys; on a cluster
    /// connection, one node's only.
    pub async fn scan_page(
        &self,
        cursor: u64,
        pattern: &str,
        count: usize,
    ) -> redis::RedisResult<(u64, Vec<String>)> {
        scan(cursor, pattern, count)
            .query_async(&mut self.clone())
            .await
    }

    /// One `SCAN` call from `cursor` on the server holding `slot_key`'s slot: on a cluster, that
    /// slot's master, whose keys (of every slot it serves) it walks; on a standalone server, the
    /// server's. As [`RedisConn::scan_page`] otherwise. A cursor is only good at the node that
    /// gave it: if the slot moves meanwhile, the walk ends early or repeats keys.
    pub async fn scan_page_at(
        &self,
        slot_key: &str,
        cursor: u64,
        pattern: &str,
        count: usize,
    ) -> redis::RedisResult<(u64, Vec<String>)> {
        let cmd = scan(cursor, pattern, count);
        match self {
            RedisConn::Single(_) => cmd.query_async(&mut self.clone()).await,
            RedisConn::Cluster(cluster) => Ok(redis::from_redis_value(
                at_master(cluster, slot_key, cmd).await?,
            )?),
        }
    }

    /// Of `slot_keys`, one per node holding their slots, to walk every key of those slots with
    /// [`RedisConn::scan_page_at`], each node once; the first alone on a standalone server.
    /// A slot that migrates during the walk may be walked on neither node: walk again until a
    /// walk finds nothing left to do.
    pub async fn one_per_node(
        &self,
        slot_keys: impl IntoIterator<Item = String>,
    ) -> redis::RedisResult<Vec<String>> {
        if !self.is_cluster() {
            return Ok(slot_keys.into_iter().take(1).collect());
        }
        let mut nodes = std::collections::BTreeMap::new();
        for slot_key in slot_keys {
            nodes
                .entry(self.node_of(&slot_key).await?)
                .or_insert(slot_key);
        }
        Ok(nodes.into_values().collect())
    }

    /// The node holding `slot_key`'s slot (its master's `CLUSTER MYID`); `None` on a standalone
    /// server, which holds every key.
    pub async fn node_of(&self, slot_key: &str) -> redis::RedisResult<Option<String>> {
        match self {
            RedisConn::Single(_) => Ok(None),
            RedisConn::Cluster(cluster) => {
                let mut cmd = redis::cmd("CLUSTER");
                cmd.arg("MYID");
                Ok(Some(redis::from_redis_value(
                    at_master(cluster, slot_key, cmd).await?,
                )?))
            }
        }
    }

    /// Up to `count` keys of the cluster slot `key` hashes to (`CLUSTER GETKEYSINSLOT`, sent to
    /// that slot's master): what one slot holds, where `SCAN` would cover one node only. Fails on
    /// a standalone Redis.
    pub async fn keys_in_slot_of(
        &self,
        key: &str,
        count: usize,
    ) -> redis::RedisResult<Vec<String>> {
        let RedisConn::Cluster(cluster) = self else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "CLUSTER GETKEYSINSLOT needs a Redis Cluster",
            )));
        };
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("GETKEYSINSLOT").arg(cluster_slot(key)).arg(count);
        Ok(redis::from_redis_value(
            at_master(cluster, key, cmd).await?,
        )?)
    }
}

/// `SCAN cursor MATCH pattern COUNT count`.
fn scan(cursor: u64, pattern: &str, count: usize) -> Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(count);
    cmd
}

/// Sends `cmd` to the master of `slot_key`'s slot.
async fn at_master(
    cluster: &HealingCluster,
    slot_key: &str,
    cmd: Cmd,
) -> redis::RedisResult<Value> {
    let route = Route::new(cluster_slot(slot_key), SlotAddr::Master);
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
    cluster
        .request(move |mut conn| async move { conn.route_command(cmd, routing).await })
        .await
}

/// Redis Cluster's slot of `key`: CRC16/XMODEM of its hash tag (or of the whole key), mod 16384.
pub fn cluster_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|&b| b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    let mut crc: u16 = 0;
    for &b in hashed {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
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
    fn urls_parse_into_targets_and_print_without_passwords() {
        let cluster = RedisTarget::parse("redis+cluster://a:1, b:2,").expect("cluster");
        assert!(cluster.is_cluster() && !cluster.has_credentials());
        assert_eq!(cluster.node_urls(), ["redis://a:1", "redis://b:2"]);
        let tls = RedisTarget::parse("rediss+cluster://u:p%40ss@a:1,b:2").expect("tls cluster");
        assert_eq!(
            tls.node_urls(),
            ["rediss://u:p%40ss@a:1", "rediss://u:p%40ss@b:2"]
        );
        assert_eq!(tls.to_string(), "rediss+cluster://u:***@a:1,b:2");
        let single = RedisTarget::parse("redis://app:hunter2@h:6379/2").expect("single");
        assert!(!single.is_cluster() && single.has_password());
        assert_eq!(single.url(), "redis://app:hunter2@h:6379/2");
        assert_eq!(
            format!("{single:?}"),
            "RedisTarget(redis://app:***@h:6379/2)"
        );
        let user_only = RedisTarget::parse("redis://app@h:1").expect("user only");
        assert!(user_only.has_credentials() && !user_only.has_password());
        let with = RedisTarget::parse("redis://h:1")
            .expect("plain")
            .with_credentials(Some("u".to_owned()), Some("p".to_owned()));
        assert_eq!(with.url(), "redis://u:p@h:1");
        let unix =
            RedisTarget::parse("redis+unix:///run/redis.sock?db=2&pass=hunter2&x=1").expect("unix");
        assert!(unix.has_password() && unix.has_credentials());
        assert_eq!(
            unix.to_string(),
            "redis+unix:///run/redis.sock?db=2&pass=***&x=1"
        );
        assert!(
            unix.url().contains("hunter2"),
            "the URL to connect with keeps it"
        );
        let both = RedisTarget::parse("redis+unix:///s?password=a&user=u&pass=b").expect("unix");
        assert_eq!(
            format!("{both:?}"),
            "RedisTarget(redis+unix:///s?password=***&user=u&pass=***)"
        );
        let plain = RedisTarget::parse("redis+unix:///s?db=1").expect("unix");
        assert!(!plain.has_credentials());
        assert!(
            RedisTarget::parse("redis+unix:///s?user=u")
                .expect("unix")
                .has_credentials()
        );
        assert!(RedisTarget::parse("h:6379").is_err());
        assert!(RedisTarget::parse("http://h:1").is_err());
        assert!(RedisTarget::parse("redis+cluster://,").is_err());
    }
}
