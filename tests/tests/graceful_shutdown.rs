//! End to end: SIGTERM in the middle of a stream. The aggregator drains, commits and exits 0; a
//! new one takes over the group, and every total ends exact (nothing lost, nothing twice).

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_then_restart_loses_and_repeats_nothing() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("shutdown", &redis.url(), 8).await;
    let mut first = setup.spawn(dir.path(), &[]);

    let spec = LoadSpec {
        events: 150_000,
        counters: 5_000,
        rate: 20_000,
        max_delta: 3,
        negative_share: 0.2,
        seed: 11,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);

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
    first.stop_gracefully().await;
    let log = first.log();
    assert!(log.contains("drained and committed"), "{log}");

    let mut second = setup.spawn(dir.path(), &[]);
    let sent = finish_load(load, 150_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    second.stop_gracefully().await;
}

/// An aggregator whose log pipe was closed (`tally-aggregator | head -1`) keeps working and still
/// shuts down on SIGTERM: a log line it cannot write is dropped, never a panic that leaves the
/// process half alive and deaf to signals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_log_pipe_does_not_stop_the_work_or_the_shutdown() {
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("closed-pipe", &redis.url(), 4).await;
    let mut aggregator = setup.spawn_with_closed_output();
    let spec = LoadSpec {
        events: 20_000,
        counters: 500,
        seed: 12,
        ..LoadSpec::default()
    };
    let sent = finish_load(start_load(&setup.topic, spec), 20_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    aggregator.stop_gracefully().await;
}
