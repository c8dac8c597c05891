//! End to end: Redis stopped for 10 s in the middle of a stream, then started again. The
//! aggregator stays up (retrying, pausing full partitions, keeping its group membership) and
//! recovers by itself; every total ends exact.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_for_ten_seconds_mid_stream_loses_nothing() {
    let dir = TempDir::new("tally-e2e");
    let mut redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("outage", &redis.url(), 8).await;
    // Small buffers, so that partitions fill up and pause during the outage.
    let mut aggregator = setup.spawn(dir.path(), &["--max-batch-events", "1000"]);

    let spec = LoadSpec {
        events: 120_000,
        counters: 2_000,
        rate: 8_000,
        max_delta: 4,
        negative_share: 0.25,
        seed: 5,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);

    aggregator
        .wait_metric("tally_flushes_total", 5.0, Duration::from_secs(60))
        .await;
    redis.stop().await;
    let outage = std::time::Instant::now();
    aggregator
        .wait_metric("tally_redis_errors_total", 1.0, Duration::from_secs(10))
        .await;
    aggregator
        .wait_metric("tally_paused_partitions", 1.0, Duration::from_secs(10))
        .await;
    // The outage lasts 10 s: that is the scenario, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed())).await;
    assert!(
        aggregator.is_running(),
        "the aggregator must survive the outage"
    );
    assert!(
        !load.is_finished(),
        "the stream must still be running when Redis returns"
    );
    redis.start_again().await;

    let sent = finish_load(load, 120_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    assert!(aggregator.is_running(), "recovered without a restart");
    assert_eq!(
        aggregator.metric("tally_paused_partitions").await,
        Some(0.0),
        "every partition resumed"
    );

    aggregator.stop_gracefully().await;
}
