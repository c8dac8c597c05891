//! The tally aggregator: a Kafka consumer-group member that sums counter events per partition in
//! micro-batches and flushes them as `INCRBY`s to sharded Redis keys, committing a partition's
//! offset only once everything before it is durable.
//!
//! # Layout
//! The folders are layers, from the ground up; each imports only those below it (the
//! `layering` test of `tally-common` checks it):
//! - [`machine`]: the core, with no I/O: one partition as a state machine (what to flush,
//!   commit, pause), its batch and flush triggers, what a write is, and the exactly-once and
//!   expiry decisions.
//! - [`store`]: the stores: the [`Sink`] seam, [`RedisSink`] (Lua scripts, or transactions),
//!   PostgreSQL, what each store's errors say, and owning a partition in exactly-once mode
//!   (epochs, fences, ledgers, watermark).
//! - [`tasks`]: the side tasks: trending, expiry, the shard monitor, compaction.
//! - [`consume`]: the Kafka side: the loop ([`Aggregator`]), the record source (librdkafka's
//!   consumer or tally's fetcher), messages decoded and routed, actions carried out, the flush
//!   with its retries, assignments, revokes and drains, the rebalance callbacks, dead letters,
//!   idempotency keys and the expirer.
//!
//! Beside them, [`operator`]: the operator's surface (configuration, metrics, the HTTP
//! endpoint), which the layers above the core use and which uses the core only. Credentials
//! and shutdown on signals are `tally_ops`'s.

pub mod consume;
pub mod machine;
pub mod operator;
pub mod store;
pub mod tasks;

use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;

use consume::{dead_letter, flush};
use operator::{config, http, metrics};
use tasks::{shard_monitor, trending};

pub use consume::daemon::Aggregator;
pub use consume::{LoopSettings, RunSummary};
pub use operator::config::Config;
pub use store::redis_sink::RedisSink;
pub use store::sink::Sink;
pub use tally_common::pg as pg_schema;

/// Why the aggregator could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The Kafka consumer or dead-letter producer could not be created.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The Redis target is invalid or (for a cluster) unreachable.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The PostgreSQL store could not be set up (URL, connection, migrations).
    #[error("postgres: {0}")]
    Postgres(#[from] pg_schema::PgError),
    /// The namespaces group a deduplicating namespace's likes otherwise than the deployment
    /// keeps them (`tally_common::layout`).
    #[error("{0}")]
    Layout(#[from] tally_common::layout::LayoutError),
    /// The deployment's group plan is unreadable, or was made for another `--shard-groups`
    /// (`tally_common::regroup`).
    #[error("{0}")]
    Groups(#[from] tally_common::regroup::PlanError),
    /// `--fetch direct` with a Kafka option tally's fetcher does not support.
    #[error("--fetch direct: {0} (use --fetch auto or librdkafka)")]
    Fetch(#[from] tally_kafka::Unsupported),
    /// The metrics address could not be bound.
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// How long the group waits for a silent member before moving its partitions, unless
/// `session.timeout.ms` says otherwise: 10 s, not librdkafka's 45 s, so that a dead aggregator's
/// partitions are counted again within about 15 s (`docs/operations.md`, Failover). A false
/// alarm (a member cut off for longer) costs a rebalance, never a count: its late writes are
/// fenced off.
pub const SESSION_TIMEOUT_MS: &str = "10000";

/// How often a member heartbeats, unless `heartbeat.interval.ms` says otherwise: 1 s (a tenth
/// of the session), which is also how soon members hear that a rebalance began.
pub const HEARTBEAT_INTERVAL_MS: &str = "1000";

/// How partitions are assigned, unless `partition.assignment.strategy` says otherwise:
/// incrementally (KIP-429), so a rebalance revokes only the partitions that move and the
/// others never stop.
pub const ASSIGNMENT_STRATEGY: &str = "cooperative-sticky";

/// The Kafka client settings shared by the consumer and the dead-letter producer: tally's
/// group defaults, then every option given (which override them). With the broker-side group
/// protocol (`group.protocol=consumer`, KIP-848) the broker owns the session, the heartbeats
/// and the assignment, and librdkafka refuses those options: tally sets none of them then.
pub fn kafka_client_config(config: &Config) -> ClientConfig {
    let mut kafka = ClientConfig::new();
    kafka
        .set("bootstrap.servers", &config.brokers)
        .set("group.id", &config.group);
    let broker_side = (config.kafka.iter())
        .any(|(k, v)| k == "group.protocol" && v.eq_ignore_ascii_case("consumer"));
    if !broker_side {
        kafka
            .set("session.timeout.ms", SESSION_TIMEOUT_MS)
            .set("heartbeat.interval.ms", HEARTBEAT_INTERVAL_MS)
            .set("partition.assignment.strategy", ASSIGNMENT_STRATEGY);
    }
    for (k, v) in &config.kafka {
        kafka.set(k, v);
    }
    kafka
}

/// tally's fetcher's settings, from the same options librdkafka gets, if `config.fetch` and
/// those options let it read the partitions.
fn fetch_config(
    config: &Config,
    kafka: &ClientConfig,
) -> Result<Option<tally_kafka::FetchConfig>, StartError> {
    use config::Fetch;
    if config.fetch == Fetch::Librdkafka {
        return Ok(None);
    }
    // The values from `get`: `config_map` masks secrets such as `sasl.password`.
    let keys: Vec<&str> = kafka.config_map().into_keys().collect();
    let options = keys.iter().filter_map(|k| kafka.get(k).map(|v| (*k, v)));
    // The aggregator's fetch sizes, where the operator sets none.
    let sizes = (consume::daemon::FETCH_SIZES.into_iter()).filter(|(k, _)| kafka.get(k).is_none());
    let options = options.chain(sizes);
    match tally_kafka::FetchConfig::from_options(&config.topic, options) {
        Ok(fetch) => Ok(Some(fetch)),
        Err(unsupported) if config.fetch == Fetch::Auto => {
            tracing::info!(%unsupported, "reading the partitions through librdkafka");
            Ok(None)
        }
        Err(unsupported) => Err(unsupported.into()),
    }
}

/// The delivery, grouping, atomicity and fetch settings as `tally_build_info` labels them.
fn settings_labels(config: &Config, direct: bool) -> [&'static str; 4] {
    use config::{Atomicity, Delivery};
    [
        match config.delivery {
            Delivery::ExactlyOnce => "exactly-once",
            Delivery::AtLeastOnce => "at-least-once",
        },
        config.grouping.as_str(),
        match config.redis_atomicity {
            Atomicity::Auto => "auto",
            Atomicity::Scripts => "scripts",
            Atomicity::Transactions => "transactions",
        },
        if direct { "direct" } else { "librdkafka" },
    ]
}

/// Runs the aggregator until `shutdown` fires: serves metrics, consumes, flushes, and drains.
pub async fn run(
    mut config: Config,
    shutdown: CancellationToken,
) -> Result<RunSummary, StartError> {
    let kafka = kafka_client_config(&config);
    let fetch = fetch_config(&config, &kafka)?;
    let metrics = Arc::new(metrics::Metrics::new());
    // The most a partition buffers: its pause size, live or catching up.
    metrics.started(
        settings_labels(&config, fetch.is_some()),
        (2 * config.limits.live.max_events).max(config.limits.catch_up.max_events),
    );
    let probes = Arc::new(http::Probes {
        metrics: metrics.clone(),
        redis: std::sync::OnceLock::new(),
        shutdown: shutdown.clone(),
    });
    let (addr, server) = http::serve(config.metrics_addr, probes.clone())
        .await
        .map_err(|source| StartError::Metrics {
            addr: config.metrics_addr,
            source,
        })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    let conn = tally_common::RedisConn::connect_to(&config.redis).await;
    let conn = match conn {
        Ok(conn) => conn,
        Err(e) => {
            server.abort();
            return Err(e.into());
        }
    };
    let _ = probes.redis.set(conn.clone());
    tokio::spawn(http::watch_redis(probes.clone(), shutdown.clone()));
    if config.shard_threshold > 0 {
        let monitor = shard_monitor::ShardMonitor {
            conn: conn.clone(),
            keyspace: config.keyspace.clone(),
            threshold: config.shard_threshold,
            metrics: Some(metrics.clone()),
        };
        tokio::spawn(monitor.run(shutdown.clone()));
    }
    // The PostgreSQL store, migrated, when it is the store of record.
    let postgres = match &config.postgres {
        None => None,
        Some(postgres) => match open_postgres(postgres, config.keyspace.prefix()).await {
            Ok(opened) => Some(opened),
            Err(e) => {
                server.abort();
                return Err(e.into());
            }
        },
    };
    let trending = (!config.trending_interval.is_zero()).then(|| {
        let mut reader = tally_common::Reader::new(conn.clone(), config.keyspace.clone());
        if let Some((pool, schema)) = &postgres {
            // Trending keeps hot counters' cached totals warm: read them from the rows.
            let store = tally_common::pg::PgStore::new(pool.clone(), schema.clone());
            reader = reader.with_store(Arc::new(store));
        }
        let trending = Arc::new(
            trending::Trending::new(reader, config.namespaces.clone())
                .with_metrics(metrics.clone()),
        );
        tokio::spawn(
            trending
                .clone()
                .run(config.trending_interval, shutdown.clone()),
        );
        trending
    });
    let parts = Parts {
        metrics,
        trending,
        fetch,
    };
    let summary = match postgres {
        None => {
            // A store that fails is retried, never fatal; a layout that disagrees is.
            let mut backoff = tally_kafka::backoff::Backoff::new(
                std::time::Duration::from_millis(100),
                std::time::Duration::from_secs(2),
            );
            loop {
                let recorded = record_layout(&conn, &config.keyspace, &config.namespaces).await;
                match recorded {
                    Ok(keyspace) => {
                        if let Some(keyspace) = keyspace {
                            tracing::info!(
                                cells_stripes = keyspace.cells_stripes(),
                                "writing by the deployment's recorded layout"
                            );
                            config.keyspace = keyspace;
                        }
                        break;
                    }
                    Err(tally_common::layout::LayoutError::Redis(e)) => {
                        tracing::warn!(error = %e, "recording the layout of likes and windows failed; retrying");
                        tokio::select! {
                            () = shutdown.cancelled() => {
                                server.abort();
                                return Ok(RunSummary { drained: 0, not_drained: Vec::new(), outdated: None });
                            }
                            () = backoff.wait() => {}
                        }
                    }
                    Err(e) => {
                        server.abort();
                        return Err(e.into());
                    }
                }
            }
            // Each acquisition checks the plan too; a start refuses a wrong count at once.
            match tally_common::regroup::read_plan(&conn, &config.keyspace).await {
                Ok(_) | Err(tally_common::regroup::PlanError::Redis(_)) => {}
                Err(e) => {
                    server.abort();
                    return Err(e.into());
                }
            }
            let sink = RedisSink::new(
                conn,
                &config.redis,
                config.keyspace.clone(),
                config.redis_atomicity,
            )?;
            sink.probe_scripts().await;
            consume(&config, &kafka, sink, parts, shutdown).await
        }
        Some((pool, schema)) => {
            let sink = store::pg_sink::PgSink::new(pool, schema);
            consume(&config, &kafka, sink, parts, shutdown).await
        }
    };
    server.abort();
    summary
}

/// Records (or checks) the layout of likes, then where window buckets go: the keyspace with
/// the deployment's way of counting likes and its cells stripes, or `None` when Redis failed on
/// those and no namespace keeps windows or likes (then neither is written, and the aggregator
/// may start while Redis is down). Any other Redis failure is the caller's to retry.
async fn record_layout(
    conn: &tally_common::RedisConn,
    keyspace: &tally_common::Keyspace,
    namespaces: &tally_common::Namespaces,
) -> Result<Option<tally_common::Keyspace>, tally_common::layout::LayoutError> {
    use tally_common::layout::{
        LayoutError, likes_by_set, record_cells_stripes, record_dedup_groupings,
    };
    let likes = record_dedup_groupings(conn, keyspace, namespaces).await?;
    let keyspace = &(keyspace.clone()).with_likes_by_set(likes_by_set(namespaces, likes));
    match record_cells_stripes(conn, keyspace).await {
        Ok(keyspace) => Ok(Some(keyspace)),
        Err(LayoutError::Redis(_)) if !namespaces.any_windows() && !namespaces.any_dedup() => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Connects to the PostgreSQL store and brings the deployment's schema (named `prefix`) to the
/// latest version.
async fn open_postgres(
    postgres: &config::PostgresTarget,
    prefix: &str,
) -> Result<(deadpool_postgres::Pool, pg_schema::Schema), pg_schema::PgError> {
    let pool = pg_schema::pool(
        &postgres.url,
        pg_schema::PoolOptions {
            password: postgres.password.as_deref(),
            size: postgres.pool_size,
            statement_timeout: Some(postgres.statement_timeout),
        },
    )?;
    let schema = pg_schema::Schema::new(prefix)?;
    for version in pg_schema::migrate(&pool, &schema).await? {
        tracing::info!(
            schema = schema.name(),
            version,
            "PostgreSQL migration applied"
        );
    }
    Ok((pool, schema))
}

/// What the flusher shares with the rest of the daemon.
struct Parts {
    metrics: Arc<metrics::Metrics>,
    trending: Option<Arc<trending::Trending>>,
    /// tally's fetcher's settings, when it reads the partitions.
    fetch: Option<tally_kafka::FetchConfig>,
}

/// Consumes into `sink` until `shutdown` fires, then drains.
async fn consume<S: Sink>(
    config: &Config,
    kafka: &ClientConfig,
    sink: S,
    parts: Parts,
    shutdown: CancellationToken,
) -> Result<RunSummary, StartError> {
    let flusher = flush::Flusher {
        sink,
        dead_letters: dead_letter::DeadLetterQueue::new(
            kafka,
            &config.dead_letter_topic,
            &config.topic,
        )?,
        metrics: parts.metrics,
        retry_initial: Duration::from_millis(50),
        retry_max: config.retry_max_backoff,
        trending: parts.trending,
    };
    let settings = LoopSettings {
        topic: config.topic.clone(),
        // Weighed for the sink as it writes at each tick (`Shared::limits`).
        limits: config.limits,
        keyspace: config.keyspace.clone(),
        partition_spread: config.partition_spread,
        namespaces: config.namespaces.clone(),
        delivery: config.delivery,
        crash_after_flushes: std::env::var("TALLY_FAILPOINT_CRASH_AFTER_FLUSHES")
            .ok()
            .and_then(|v| v.parse().ok()),
        max_message_bytes: config.max_message_bytes,
        revoke_timeout: config.revoke_timeout,
        shutdown_timeout: config.shutdown_timeout,
        check_idle_interval: config.check_idle_interval,
        fetch: parts.fetch,
    };
    let fetch = if settings.fetch.is_some() {
        "direct"
    } else {
        "librdkafka"
    };
    let aggregator = Aggregator::new(kafka, settings, flusher)?;
    tracing::info!(
        topic = %config.topic,
        group = %config.group,
        delivery = ?config.delivery,
        grouping = ?config.grouping,
        store = ?config.store,
        redis_atomicity = ?config.redis_atomicity,
        fetch,
        "aggregator started"
    );
    Ok(aggregator.run(shutdown).await)
}

#[cfg(test)]
mod tests {
    use super::*;
    use config::Cli;

    fn client_config(args: &[&str]) -> ClientConfig {
        let matches = <Cli as clap::CommandFactory>::command()
            .try_get_matches_from(args)
            .expect("parses");
        let config = (Cli::from_matches(&matches).and_then(Cli::into_config))
            .expect("a valid configuration");
        kafka_client_config(&config)
    }

    #[test]
    fn the_group_is_incremental_with_a_short_session_unless_told_otherwise() {
        let defaults = client_config(&["tally-aggregator"]);
        assert_eq!(
            defaults.get("partition.assignment.strategy"),
            Some(ASSIGNMENT_STRATEGY)
        );
        assert_eq!(defaults.get("session.timeout.ms"), Some(SESSION_TIMEOUT_MS));
        assert_eq!(
            defaults.get("heartbeat.interval.ms"),
            Some(HEARTBEAT_INTERVAL_MS)
        );

        let given = client_config(&[
            "tally-aggregator",
            "--kafka-option",
            "partition.assignment.strategy=range",
            "--kafka-option",
            "session.timeout.ms=30000",
        ]);
        assert_eq!(given.get("partition.assignment.strategy"), Some("range"));
        assert_eq!(given.get("session.timeout.ms"), Some("30000"));

        // The broker-side protocol: librdkafka refuses the classic group options with it.
        let broker_side = client_config(&[
            "tally-aggregator",
            "--kafka-option",
            "group.protocol=consumer",
        ]);
        for key in [
            "partition.assignment.strategy",
            "session.timeout.ms",
            "heartbeat.interval.ms",
        ] {
            assert_eq!(broker_side.get(key), None, "{key}");
        }
        broker_side
            .create::<rdkafka::consumer::BaseConsumer>()
            .expect("librdkafka takes the configuration");
    }
}
