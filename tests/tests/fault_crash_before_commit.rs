//! Fault: a crash exactly between a durable Redis flush and its Kafka commit (a test-only
//! failpoint aborts the process there), five times over. In exactly-once mode every counter ends
//! at the ground truth; the same crashes in at-least-once mode apply the crashed batches twice,
//! which shows that the failpoint hits the window and that the ledger is what closes it.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorProcess, AggregatorSetup, RedisServer, TempDir, below_and_above, finish_load, seed,
    start_load, unique, wait_committed_to_end, wait_for_totals,
};

/// Runs a load through five aggregator incarnations that each abort right after their
/// `1 + rng % 4`-th durable flush, then a normal one; returns the setup, the truth and Redis.
async fn crash_five_times(
    name: &str,
    delivery: &str,
) -> (
    AggregatorSetup,
    tally_cli::load::LoadReport,
    RedisServer,
    AggregatorProcess,
    TempDir,
) {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create(name, &redis.url(), 4).await;
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--delivery", delivery, "--kafka-option", &member];
    let spec = LoadSpec {
        events: 100_000,
        counters: 2_000,
        rate: 10_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    for crash in 0..5u64 {
        let after = (1 + (seed.wrapping_add(crash) % 4)).to_string();
        let mut doomed = setup.spawn_with_env(
            dir.path(),
            &flags,
            &[("TALLY_FAILPOINT_CRASH_AFTER_FLUSHES", &after)],
        );
        let status = doomed.wait_exit(Duration::from_secs(60)).await;
        assert!(
            !status.success(),
            "incarnation {crash} must crash at the failpoint"
        );
        assert!(
            doomed.log().contains("failpoint: aborting"),
            "{}",
            doomed.log()
        );
        assert!(!load.is_finished(), "the load ended before crash {crash}");
    }
    let last = setup.spawn(dir.path(), &flags);
    let sent = finish_load(load, 100_000).await;
    (setup, sent, redis, last, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_survives_crashes_between_flush_and_commit() {
    let _serial = tally_tests::serial().await;
    let (setup, sent, redis, mut last, _dir) = crash_five_times("crash-eo", "exactly-once").await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    last.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_double_counts_the_same_crashes_but_loses_nothing() {
    let _serial = tally_tests::serial().await;
    let (setup, sent, redis, mut last, _dir) = crash_five_times("crash-alo", "at-least-once").await;
    wait_committed_to_end(&setup.group, &setup.topic, 4, Duration::from_secs(60)).await;
    last.stop_gracefully().await;
    let reader = redis.reader(setup.keyspace()).await;
    let (below, above) = below_and_above(&reader, &sent.totals).await;
    eprintln!(
        "at-least-once after 5 crashes between flush and commit: {above} of {} counters above the truth, {below} below",
        sent.totals.len()
    );
    assert_eq!(below, 0, "at-least-once must never lose a count");
    assert!(above > 0, "the crashed batches were re-applied");
}
