//! Fault: Redis slow for longer than a flush interval (`CLIENT PAUSE ... WRITE` three times, then
//! `DEBUG SLEEP`), in exactly-once mode. Flushes wait and retry, polling goes on, the consumer
//! keeps its group membership (no rebalance at all), and every counter ends exact.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, connect_patient, finish_load, seed, start_load,
    wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_redis_causes_no_rebalance_and_loses_nothing() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("slow", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let spec = LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    aggregator
        .wait_metric("tally_flushes_total", 5.0, Duration::from_secs(60))
        .await;

    let mut conn = tally_tests::connect(&redis.url()).await;
    for _ in 0..3 {
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(2500)
            .arg("WRITE")
            .query_async::<()>(&mut conn)
            .await
            .expect("CLIENT PAUSE");
        // The pause is the fault; wait it out, then let a few flushes through.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        aggregator
            .wait_more_flushes(4.0, Duration::from_secs(30))
            .await;
    }
    // DEBUG SLEEP blocks the whole server, reads included, for 3 s.
    let mut sleeper = connect_patient(&redis.url(), Duration::from_secs(10)).await;
    redis::cmd("DEBUG")
        .arg("SLEEP")
        .arg(3)
        .query_async::<()>(&mut sleeper)
        .await
        .expect("DEBUG SLEEP");
    assert!(!load.is_finished(), "the load ended before Redis recovered");

    let sent = finish_load(load, 150_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    let log = aggregator.log();
    assert_eq!(
        log.matches("partitions assigned").count(),
        1,
        "one assignment, no rebalance: {log}"
    );
    assert!(!log.contains("partitions revoked"), "{log}");
    aggregator.stop_gracefully().await;
}
