//! Fault: the aggregator SIGKILLed at random moments, ten times, during a load of 500,000 events,
//! in exactly-once mode. Every counter ends exactly at the ground truth (the events Kafka
//! acknowledged): nothing lost, nothing applied twice.

use std::time::Duration;

use tally_aggregator::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, kill_repeatedly, seed, start_load, unique,
    wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_sigkills_during_half_a_million_events_count_every_event_once() {
    let seed = seed();
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("sigkill", &redis.url(), 8).await;
    // Static membership: a restarted incarnation takes its predecessor's partitions at once.
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--kafka-option", &member];
    let first = setup.spawn(dir.path(), &flags);

    let spec = LoadSpec {
        events: 500_000,
        counters: 20_000,
        rate: 20_000,
        max_delta: 5,
        negative_share: 0.3,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let mut last = kill_repeatedly(&setup, dir.path(), &flags, first, 10, seed, &load).await;
    let sent = finish_load(load, 500_000).await;

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(120)).await;
    last.stop_gracefully().await;
}
