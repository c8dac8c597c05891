//! The PostgreSQL store: the exactly-once catch-up over the same preloaded topic, into share rows
//! instead of Redis keys, with what it cost PostgreSQL (WAL bytes, commits and statements per
//! event, the server's CPU), and reads of totals through Redis as the cache in front of it.

use std::process::Command;
use std::sync::Arc;

use anyhow::{Context, bail};
use tally_common::{CachedReader, Keyspace, Namespaces, Policy, Reader, RedisConn, pg};

use super::reads::read_latencies;
use crate::env::Env;
use crate::probe;
use crate::results::{PostgresRun, ReadLatency};

/// One value from `psql -Atc`.
fn psql(url: &str, sql: &str) -> anyhow::Result<String> {
    let out = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-Atc", sql])
        .output()
        .context("psql (PostgreSQL's client: deploy/local/install.sh installs it)")?;
    if !out.status.success() {
        bail!("psql: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// PostgreSQL's counters: the WAL position, commits, and statements run (when
/// `pg_stat_statements` is loaded, as `deploy/local/start.sh` starts it).
struct Counters {
    wal: String,
    commits: f64,
    statements: Option<f64>,
}

impl Counters {
    fn read(url: &str) -> anyhow::Result<Self> {
        let statements = psql(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .and_then(|_| psql(url, "SELECT sum(calls) FROM pg_stat_statements"))
            .ok()
            .and_then(|s| s.parse().ok());
        Ok(Self {
            wal: psql(url, "SELECT pg_current_wal_lsn()")?,
            commits: psql(url, "SELECT sum(xact_commit) FROM pg_stat_database")?.parse()?,
            statements,
        })
    }
}

/// The exactly-once catch-up of `events` events on `topic` into PostgreSQL.
pub(crate) async fn postgres_catch_up(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
) -> anyhow::Result<PostgresRun> {
    let url = env.args.postgres_url.clone();
    let before = Counters::read(&url)
        .with_context(|| format!("PostgreSQL at {url} (deploy/local/start.sh starts one)"))?;
    let cpu = probe::cpu_seconds_with_children_matching("postgres");
    let run = env
        .catch_up(
            topic,
            events,
            &["--store", "postgres", "--postgres-url", &url],
        )
        .await?;
    let postgres_cpu = probe::cpu_seconds_with_children_matching("postgres") - cpu;
    let after = Counters::read(&url)?;
    let wal: f64 = psql(
        &url,
        &format!("SELECT pg_wal_lsn_diff('{}', '{}')", after.wal, before.wal),
    )?
    .parse()?;
    let per_event = |v: f64| v / events as f64;
    Ok(PostgresRun {
        wal_bytes_per_event: per_event(wal),
        commits_per_event: per_event(after.commits - before.commits),
        statements_per_event: after
            .statements
            .zip(before.statements)
            .map(|(a, b)| per_event(a - b)),
        postgres_cpu_seconds_per_million: postgres_cpu / (events as f64 / 1e6),
        catch_up: run,
    })
}

/// Reads of totals kept in PostgreSQL, through Redis as the cache of totals.
pub(crate) async fn postgres_reads(env: &Env<'_>) -> anyhow::Result<Vec<ReadLatency>> {
    let url = &env.args.postgres_url;
    let prefix = env.name("pg-reads");
    let pool = pg::pool(
        url,
        pg::PoolOptions {
            password: None,
            size: 4,
            statement_timeout: None,
        },
    )?;
    let schema = pg::Schema::new(&prefix)?;
    pg::migrate(&pool, &schema).await?;
    let store = pg::PgStore::new(pool, schema);
    let feed: Vec<String> = (0..1_000).map(|i| format!("likes:post:{i}")).collect();
    for (i, counter) in feed.iter().enumerate() {
        for shard in 0..4u32 {
            store.add(counter, shard, i as i64 + 1).await?;
        }
    }
    let conn = RedisConn::connect(&env.args.redis_url).await?;
    let ks = Keyspace::new(prefix, 16)?;
    let store = Arc::new(store);
    let cached = |ttl_ms: u64| {
        CachedReader::new(
            Reader::new(conn.clone(), ks.clone()).with_store(store.clone()),
            Arc::new(Namespaces::uniform(Policy {
                cache_ttl_ms: ttl_ms,
                ..Policy::default()
            })),
        )
    };
    read_latencies(
        "PostgreSQL store: ",
        "shared entry, lock, SUM over the rows, write back",
        cached,
        &feed,
        env.args.reads,
    )
    .await
}
