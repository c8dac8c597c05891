//! End to end: a second aggregator joins the group mid-stream. The first one's revoked partitions
//! are drained and committed inside the revoke callback, the two split the partitions, and every
//! total ends exact. Redis is paused for writes while the second member joins, so the first
//! member's flushes are in flight at the revoke: a revoke that returned before they landed would
//! let the new owner re-read and re-apply those batches, and the totals would come out high.
//! (What rebalances cost in time is `failover.rs`.)

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_member_joining_mid_stream_counts_exactly() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("rebalance", &redis.url(), 8).await;
    let mut first = setup.spawn(dir.path(), &[]);

    let spec = LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 20_000,
        max_delta: 3,
        negative_share: 0.2,
        seed: 3,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);

    first
        .wait_metric("tally_flushes_total", 8.0, Duration::from_secs(60))
        .await;
    let mut conn = tally_tests::connect(&redis.url()).await;
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("WRITE")
        .query_async::<()>(&mut conn)
        .await
        .expect("CLIENT PAUSE");
    let mut second = setup.spawn(dir.path(), &[]);
    second
        .wait_metric("tally_assigned_partitions", 1.0, Duration::from_secs(60))
        .await;
    assert!(
        !load.is_finished(),
        "the stream must still be running at the rebalance"
    );

    let sent = finish_load(load, 150_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    // Both members own part of the topic, and the first drained what it gave up.
    let a = first
        .metric("tally_assigned_partitions")
        .await
        .unwrap_or(0.0);
    let b = second
        .metric("tally_assigned_partitions")
        .await
        .unwrap_or(0.0);
    assert_eq!(
        a + b,
        8.0,
        "partitions split between the members: {a} + {b}"
    );
    assert!(
        a >= 1.0 && b >= 1.0,
        "both members own partitions: {a} + {b}"
    );
    assert!(
        first.log().contains("partitions revoked"),
        "{}",
        first.log()
    );

    first.stop_gracefully().await;
    second.stop_gracefully().await;
}
