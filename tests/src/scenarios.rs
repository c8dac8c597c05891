//! Fault scenarios shared by the standalone-Redis, Redis Cluster and PostgreSQL test files: each
//! takes the store (a Redis URL, `redis://...` or `redis+cluster://...`, and with
//! [`Store::postgres`] a PostgreSQL store of record) and the grouping rule, runs a seeded load
//! through real aggregator processes while injecting its fault, and asserts that every counter
//! ends exactly at the ground truth (the events Kafka acknowledged).

use std::collections::HashMap;
use std::time::Duration;

use tally_cli::load::LoadSpec;

use crate::kafka::StoppableLoad;
use crate::process::{AggregatorSetup, assert_no_crossslot, kill_repeatedly};
use crate::store::reader;
use crate::support::{TempDir, seed, unique};

/// Where the aggregators under test keep the counts.
#[derive(Debug, Clone, Copy)]
pub struct Store<'a> {
    /// Redis: the store, or with `postgres` its cache.
    pub redis_url: &'a str,
    /// PostgreSQL as the store of record (`--store postgres`), if given.
    pub postgres_url: Option<&'a str>,
}

impl<'a> From<&'a str> for Store<'a> {
    fn from(redis_url: &'a str) -> Self {
        Self {
            redis_url,
            postgres_url: None,
        }
    }
}

impl<'a> From<&'a String> for Store<'a> {
    fn from(redis_url: &'a String) -> Self {
        Self::from(redis_url.as_str())
    }
}

impl<'a> Store<'a> {
    /// PostgreSQL at `postgres_url` as the store of record, Redis at `redis_url` beside it.
    pub fn postgres(redis_url: &'a str, postgres_url: &'a str) -> Self {
        Self {
            redis_url,
            postgres_url: Some(postgres_url),
        }
    }

    /// The aggregator's flags for this store.
    pub fn flags(&self) -> Vec<&'a str> {
        match self.postgres_url {
            Some(url) => vec!["--store", "postgres", "--postgres-url", url],
            None => Vec::new(),
        }
    }

    /// A reader of the counts in this store (exact, not cached).
    pub async fn reader(&self, keyspace: tally_common::Keyspace) -> tally_common::Reader {
        let redis = reader(self.redis_url, keyspace.clone()).await;
        let Some(url) = self.postgres_url else {
            return redis;
        };
        use tally_common::pg;
        let options = pg::PoolOptions {
            password: None,
            size: 2,
            statement_timeout: None,
        };
        let store =
            pg::PgStore::connect(url, options, keyspace.prefix()).expect("PostgreSQL store");
        redis.with_store(std::sync::Arc::new(store))
    }
}

fn spec(events: u64, rate: u64, seed: u64) -> LoadSpec {
    LoadSpec {
        events,
        counters: 5_000,
        rate,
        max_delta: 5,
        negative_share: 0.3,
        actors: 50_000,
        seed,
        ..LoadSpec::default()
    }
}

/// `kills` SIGKILLs of the aggregator at random moments during a load of at most `events`
/// events, which runs on until the last incarnation has made three flushes durable. Static
/// membership lets each new incarnation take its predecessor's partitions at once.
pub async fn sigkill_storm<'a>(
    name: &str,
    store: impl Into<Store<'a>>,
    grouping: &str,
    events: u64,
    kills: usize,
) -> (AggregatorSetup, HashMap<String, i64>) {
    let store = store.into();
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let setup = AggregatorSetup::create(name, store.redis_url, 8).await;
    let member = format!("group.instance.id={}", unique("member"));
    let mut flags = vec!["--grouping", grouping, "--kafka-option", &member];
    flags.extend(store.flags());
    let first = setup.spawn(dir.path(), &flags);
    let load = StoppableLoad::start(&setup.topic, spec(events, 20_000, seed));
    let mut last =
        kill_repeatedly(&setup, dir.path(), &flags, first, kills, seed, &load.task).await;
    let sent = load
        .stop_and_wait_totals(
            &store.reader(setup.keyspace()).await,
            Duration::from_secs(120),
        )
        .await;
    last.stop_gracefully().await;
    assert_no_crossslot(dir.path());
    (setup, sent.totals)
}

/// The group scales from one member to three and back to one during a load, which runs on
/// until the one member left has flushed every partition again.
pub async fn scale_one_three_one(name: &str, redis_url: &str, grouping: &str) {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let setup = AggregatorSetup::create(name, redis_url, 8).await;
    let flags = ["--grouping", grouping];
    let mut a = setup.spawn(dir.path(), &flags);
    let load = StoppableLoad::start(&setup.topic, spec(200_000, 10_000, seed));
    a.wait_metric("tally_flushes_total", 5.0, Duration::from_secs(60))
        .await;
    let mut b = setup.spawn(dir.path(), &flags);
    let mut c = setup.spawn(dir.path(), &flags);
    for member in [&b, &c] {
        member
            .wait_metric("tally_flushes_total", 3.0, Duration::from_secs(60))
            .await;
    }
    assert!(!load.is_finished(), "the load ended before scaling back");
    b.stop_gracefully().await;
    c.stop_gracefully().await;
    a.wait_more_flushes(8.0, Duration::from_secs(60)).await;
    assert!(
        !load.is_finished(),
        "the load ended before the group was back to one"
    );
    load.stop_and_wait_totals(
        &reader(redis_url, setup.keyspace()).await,
        Duration::from_secs(90),
    )
    .await;
    a.stop_gracefully().await;
}

/// A member is SIGSTOPped past `max.poll.interval.ms` and the session timeout while holding
/// buffered events, the other member takes its partitions and stamps their fences, then the
/// zombie is SIGCONTed: its late writes must be refused.
pub async fn zombie_is_fenced_off<'a>(name: &str, store: impl Into<Store<'a>>, grouping: &str) {
    let store = store.into();
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let setup = AggregatorSetup::create(name, store.redis_url, 8).await;
    let mut flags = vec![
        "--grouping",
        grouping,
        "--kafka-option",
        "max.poll.interval.ms=7000",
    ];
    flags.extend(store.flags());
    // The zombie flushes every 3 s, so it is holding buffered events when it is stopped.
    let slow = AggregatorSetup {
        flush_interval_ms: 3000,
        ..setup.clone()
    };
    let mut zombie = slow.spawn(dir.path(), &flags);
    let load = StoppableLoad::start(&setup.topic, spec(200_000, 10_000, seed));
    zombie
        .wait_metric("tally_flushes_total", 8.0, Duration::from_secs(60))
        .await;
    let mut survivor = setup.spawn(dir.path(), &flags);
    survivor
        .wait_metric("tally_flushes_total", 2.0, Duration::from_secs(60))
        .await;
    zombie
        .wait_metric("tally_buffered_events", 1.0, Duration::from_secs(10))
        .await;
    zombie.signal("STOP");
    survivor
        .wait_metric("tally_assigned_partitions", 8.0, Duration::from_secs(60))
        .await;
    // Let the survivor stamp its fences and flush before the zombie wakes up.
    survivor
        .wait_more_flushes(8.0, Duration::from_secs(30))
        .await;
    assert!(!load.is_finished(), "the load ended while the zombie slept");
    zombie.signal("CONT");
    let fenced = zombie
        .wait_metric("tally_fenced_writes_total", 1.0, Duration::from_secs(30))
        .await;
    eprintln!("the zombie's writes refused by fences: {fenced}");
    survivor
        .wait_more_flushes(8.0, Duration::from_secs(30))
        .await;
    assert!(!load.is_finished(), "the load ended before the zombie woke");
    load.stop_and_wait_totals(
        &store.reader(setup.keyspace()).await,
        Duration::from_secs(90),
    )
    .await;
    zombie.stop_gracefully().await;
    survivor.stop_gracefully().await;
}
