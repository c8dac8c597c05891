//! End to end: a rebalance while Redis is down. The first member has partitions paused (full
//! buffers, flushes retrying) when a second member joins; its revoke drain gives up at the revoke
//! deadline without committing, the partitions are split, and once Redis returns every total is
//! exact. A partition that stayed paused across revoke and re-assignment would never fetch again.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, eventually, finish_load, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_while_redis_is_down_loses_nothing() {
    let dir = TempDir::new("tally-e2e");
    let mut redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("outage-rebalance", &redis.url(), 8).await;
    let flags = ["--max-batch-events", "500", "--revoke-timeout-ms", "2000"];
    let mut first = setup.spawn(dir.path(), &flags);

    let spec = LoadSpec {
        events: 100_000,
        counters: 2_000,
        rate: 8_000,
        max_delta: 4,
        negative_share: 0.25,
        seed: 9,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);

    first
        .wait_metric("tally_flushes_total", 5.0, Duration::from_secs(60))
        .await;
    redis.stop().await;
    first
        .wait_metric("tally_paused_partitions", 1.0, Duration::from_secs(20))
        .await;

    let mut second = setup.spawn(dir.path(), &flags);
    second
        .wait_metric("tally_assigned_partitions", 1.0, Duration::from_secs(60))
        .await;
    eventually(Duration::from_secs(30), "the first member's revoke", || {
        let log = first.log();
        async move { log.contains("partitions revoked").then_some(()) }
    })
    .await;
    assert!(
        !load.is_finished(),
        "the stream must still be running when Redis returns"
    );
    redis.start_again().await;

    let sent = finish_load(load, 100_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    assert!(first.is_running() && second.is_running());

    first.stop_gracefully().await;
    second.stop_gracefully().await;
}
