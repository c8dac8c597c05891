//! Faults in Redis, exactly-once mode: Redis SIGKILLed and restarted from its append-only file
//! (`appendfsync everysec`) mid-stream; and Redis brought back with an older state (a snapshot
//! taken seconds before, as a failover to a lagging replica would), which loses acknowledged
//! writes, counters and bookkeeping alike. The running aggregator notices the rollback and re-feeds
//! the lost range from Kafka's retained log; every counter ends at the ground truth.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, StoppableLoad, TempDir, finish_load, seed, start_load,
    wait_for_totals,
};

fn spec(seed: u64) -> LoadSpec {
    LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkilled_and_restarted_from_its_aof_mid_stream() {
    let _serial = tally_tests::serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let mut redis = RedisServer::start_with_fsync("everysec").await;
    let setup = AggregatorSetup::create("redis-kill", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let load = StoppableLoad::start(&setup.topic, spec(seed));

    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    redis.kill().await;
    redis.start_again().await;
    aggregator
        .wait_more_flushes(16.0, Duration::from_secs(60))
        .await;
    assert!(!load.is_finished(), "the load ended before Redis was back");

    let reader = redis.reader(setup.keyspace()).await;
    load.stop_and_wait_totals(&reader, Duration::from_secs(60))
        .await;
    assert!(aggregator.is_running(), "recovered without a restart");
    aggregator.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_back_with_an_older_state_is_re_fed_from_kafka() {
    let _serial = tally_tests::serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let mut redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("redis-rollback", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let load = StoppableLoad::start(&setup.topic, spec(seed));

    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    redis.snapshot().await;
    // Let at least 16 more flushes land, then lose them all.
    aggregator
        .wait_more_flushes(16.0, Duration::from_secs(60))
        .await;
    redis.restore_snapshot().await;
    // The rollback is noticed with the next flushes, which re-feed the lost range.
    aggregator
        .wait_more_flushes(16.0, Duration::from_secs(60))
        .await;
    assert!(!load.is_finished(), "the load ended before the rollback");

    let reader = redis.reader(setup.keyspace()).await;
    load.stop_and_wait_totals(&reader, Duration::from_secs(60))
        .await;
    let rollbacks = aggregator
        .metric("tally_redis_rollbacks_total")
        .await
        .unwrap_or(0.0);
    assert!(rollbacks >= 1.0, "the rollback was noticed ({rollbacks})");
    aggregator.stop_gracefully().await;
}

/// Redis comes back older after the load has ended: no new event will ever arrive to trigger a
/// flush, yet the idle partitions notice (their periodic check finds a ledger entry or fence
/// older than what they wrote) and re-feed the lost range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_after_the_last_event_is_still_re_fed() {
    let _serial = tally_tests::serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let mut redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("redis-idle-rollback", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &["--check-idle-interval-ms", "1000"]);
    let load = start_load(
        &setup.topic,
        LoadSpec {
            events: 60_000,
            ..spec(seed)
        },
    );
    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    redis.snapshot().await;
    let sent = finish_load(load, 60_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    let before = aggregator
        .metric("tally_redis_rollbacks_total")
        .await
        .unwrap_or(0.0);
    assert_eq!(before, 0.0, "a rollback before the restore");

    redis.restore_snapshot().await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    let rollbacks = aggregator
        .metric("tally_redis_rollbacks_total")
        .await
        .unwrap_or(0.0);
    eprintln!("rollbacks noticed by idle partitions: {rollbacks}");
    assert!(rollbacks >= 1.0, "the rollback was noticed ({rollbacks})");
    aggregator.stop_gracefully().await;
}
