//! Faults in the consumer group, exactly-once mode: scaling 1 → 3 → 1 members during a load; and
//! a member SIGSTOPped past `max.poll.interval.ms` and the session timeout, then SIGCONTed: it
//! wakes up as a zombie with buffered events and stale epochs, and its late writes must be
//! refused by the fences that the partitions' new owner stamped. Every counter ends exact.

use std::time::Duration;

use tally_aggregator::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, seed, start_load, wait_for_totals,
};

fn spec(seed: u64) -> LoadSpec {
    LoadSpec {
        events: 200_000,
        counters: 4_000,
        rate: 10_000,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_one_to_three_to_one_members_counts_exactly() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("scale", &redis.url(), 8).await;
    let mut a = setup.spawn(dir.path(), &[]);
    let load = start_load(&setup.topic, spec(seed));

    a.wait_metric("tally_flushes_total", 5.0, Duration::from_secs(60))
        .await;
    let mut b = setup.spawn(dir.path(), &[]);
    let mut c = setup.spawn(dir.path(), &[]);
    for member in [&b, &c] {
        member
            .wait_metric("tally_flushes_total", 3.0, Duration::from_secs(60))
            .await;
    }
    assert!(!load.is_finished(), "the load ended before scaling back");
    b.stop_gracefully().await;
    c.stop_gracefully().await;
    assert!(
        !load.is_finished(),
        "the load ended before the group was back to one"
    );

    let sent = finish_load(load, 200_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    a.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_woken_after_losing_its_partitions_is_fenced_off() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("zombie", &redis.url(), 8).await;
    let poll = ["--kafka-option", "max.poll.interval.ms=7000"];
    // The zombie flushes every 3 s, so it is holding buffered events when it is stopped.
    let slow = AggregatorSetup {
        flush_interval_ms: 3000,
        ..setup.clone()
    };
    let mut zombie = slow.spawn(dir.path(), &poll);
    let load = start_load(&setup.topic, spec(seed));
    zombie
        .wait_metric("tally_flushes_total", 8.0, Duration::from_secs(60))
        .await;
    let mut survivor = setup.spawn(dir.path(), &poll);
    survivor
        .wait_metric("tally_flushes_total", 2.0, Duration::from_secs(60))
        .await;
    // Both own partitions now; freeze the zombie with a full buffer.
    zombie
        .wait_metric("tally_buffered_events", 1.0, Duration::from_secs(10))
        .await;
    zombie.signal("STOP");
    survivor
        .wait_metric("tally_assigned_partitions", 8.0, Duration::from_secs(60))
        .await;
    // Let the survivor stamp its fences and flush before the zombie wakes up.
    let flushed = survivor.metric("tally_flushes_total").await.unwrap_or(0.0);
    survivor
        .wait_metric(
            "tally_flushes_total",
            flushed + 8.0,
            Duration::from_secs(30),
        )
        .await;
    assert!(!load.is_finished(), "the load ended while the zombie slept");
    zombie.signal("CONT");
    let fenced = zombie
        .wait_metric("tally_fenced_writes_total", 1.0, Duration::from_secs(30))
        .await;
    eprintln!("the zombie's writes refused by fences: {fenced}");

    let sent = finish_load(load, 200_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    zombie.stop_gracefully().await;
    survivor.stop_gracefully().await;
}
