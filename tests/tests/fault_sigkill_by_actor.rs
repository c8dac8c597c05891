//! Fault: SIGKILL at random moments with deltas grouped by actor, so that every flush writes into
//! many shard groups and a crash can fall between two groups' writes of one flush. Every counter
//! ends exactly at the ground truth.

use std::time::Duration;

use tally_aggregator::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, kill_repeatedly, seed, start_load, unique,
    wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkills_with_actor_grouping_count_every_event_once() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("sigkill-actor", &redis.url(), 8).await;
    // Static membership: a restarted incarnation takes its predecessor's partitions at once.
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--grouping", "actor", "--kafka-option", &member];
    let first = setup.spawn(dir.path(), &flags);

    let spec = LoadSpec {
        events: 300_000,
        counters: 5_000,
        rate: 15_000,
        max_delta: 5,
        negative_share: 0.3,
        actors: 50_000,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let mut last = kill_repeatedly(&setup, dir.path(), &flags, first, 10, seed, &load).await;
    let sent = finish_load(load, 300_000).await;

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(120)).await;
    last.stop_gracefully().await;
}
