//! Fault: the Kafka broker restarted mid-stream (`deploy/local/restart-kafka.sh`: SIGTERM, then
//! started again from its data directory), in exactly-once mode. The producer's idempotent
//! retries and the aggregator ride it out without a restart; every counter ends exact.
//!
//! This test restarts the broker that `deploy/local/start.sh` started, which every other test
//! uses too; cargo runs test binaries one after another, so nothing else is running then.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, seed, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_mid_stream_loses_and_repeats_nothing() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("kafka-restart", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let spec = LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 6_000,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    aggregator
        .wait_metric("tally_flushes_total", 8.0, Duration::from_secs(60))
        .await;
    assert!(
        !load.is_finished(),
        "the load ended before the broker restart"
    );

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/restart-kafka.sh");
    let restarted = tokio::task::spawn_blocking(move || Command::new(script).status())
        .await
        .expect("join")
        .expect("restart-kafka.sh runs");
    assert!(
        restarted.success(),
        "restarting the broker failed: this test needs the broker of deploy/local/start.sh"
    );

    let sent = finish_load(load, 150_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(120)).await;
    assert!(
        aggregator.is_running(),
        "rode out the restart without one of its own"
    );
    aggregator.stop_gracefully().await;
}
