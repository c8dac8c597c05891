//! End to end: SIGTERM in the middle of a stream. The aggregator drains, commits and exits 0; a
//! new one takes over the group, and every total ends exact (nothing lost, nothing twice).

use std::time::Duration;

use tally_aggregator::load::{self, LoadSpec};
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{AggregatorSetup, RedisServer, TempDir, wait_for_totals};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_then_restart_loses_and_repeats_nothing() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("shutdown", &redis.url(), 8).await;
    let mut first = setup.spawn(dir.path(), &[]);

    let producer = Producer::new(&ProducerConfig::new(tally_tests::brokers(), &setup.topic))
        .expect("producer");
    let spec = LoadSpec {
        events: 150_000,
        counters: 5_000,
        rate: 20_000,
        max_delta: 3,
        negative_share: 0.2,
        seed: 11,
        ..LoadSpec::default()
    };
    let load = tokio::spawn(async move { load::run(&producer, &spec).await });

    first
        .wait_metric(
            "tally_events_consumed_total",
            30_000.0,
            Duration::from_secs(60),
        )
        .await;
    assert!(
        !load.is_finished(),
        "the stream must still be running at SIGTERM"
    );
    first.terminate();
    let status = first.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "graceful shutdown exits 0, got {status}");
    let log = first.log();
    assert!(log.contains("drained and committed"), "{log}");

    let mut second = setup.spawn(dir.path(), &[]);
    let sent = load.await.expect("load task").expect("load runs");
    assert_eq!(sent.acked, 150_000, "{:?}", sent.first_error);
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    second.terminate();
    assert!(second.wait_exit(Duration::from_secs(30)).await.success());
}
