//! On a real 3-broker KRaft cluster (replication factor 3, `min.insync.replicas=2`): a broker
//! SIGKILLed under load and later restarted, and then a rolling restart of all three, lose
//! no acknowledged event and count none twice, and the aggregator rides through both without
//! being restarted.

use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::kafka_cluster::KafkaCluster;
use tally_tests::{
    AggregatorProcess, AggregatorSetup, RedisServer, StoppableLoad, TempDir, finish_load, serial,
    start_load_on, wait_for_totals,
};

const EVENTS: u64 = 150_000;

/// An aggregator on `cluster`, with its topics created there.
fn setup_on(cluster: &KafkaCluster, name: &str, redis_url: &str) -> AggregatorSetup {
    let setup = AggregatorSetup::named(&cluster.bootstrap(), name, redis_url);
    cluster.topic(&setup.topic, 8);
    cluster.topic(&setup.dead_letter_topic, 1);
    setup
}

fn spec(rate: u64, seed: u64) -> LoadSpec {
    LoadSpec {
        events: EVENTS,
        counters: 2_000,
        rate,
        seed,
        ..LoadSpec::default()
    }
}

/// Waits until `aggregator` has made at least `events` events durable.
async fn flushed(aggregator: &AggregatorProcess, events: u64) {
    aggregator
        .wait_metric(
            "tally_events_flushed_total",
            events as f64,
            Duration::from_secs(120),
        )
        .await;
}

/// One cluster for both faults (starting three brokers takes seconds of two busy cores): a
/// broker SIGKILLed under load and started again, then a rolling restart of every broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_then_a_rolling_restart_lose_and_repeat_nothing() {
    let _serial = serial().await;
    let cluster = tokio::task::block_in_place(KafkaCluster::start);
    let redis = RedisServer::start().await;
    a_broker_killed_under_load(&cluster, &redis).await;
    a_rolling_restart_of_every_broker(&cluster, &redis).await;
}

async fn a_broker_killed_under_load(cluster: &KafkaCluster, redis: &RedisServer) {
    let dir = TempDir::new("tally-cluster-kill");
    let setup = tokio::task::block_in_place(|| setup_on(cluster, "cluster-kill", &redis.url()));
    let mut aggregator = setup.spawn(dir.path(), &[]);

    let load = start_load_on(&cluster.bootstrap(), &setup.topic, spec(15_000, 61));
    flushed(&aggregator, EVENTS / 5).await;
    tokio::task::block_in_place(|| cluster.kill(2));
    flushed(&aggregator, EVENTS * 3 / 5).await;
    tokio::task::block_in_place(|| cluster.start_node(2));
    let report = finish_load(load, EVENTS).await;

    wait_for_totals(
        &redis.reader(setup.keyspace()).await,
        &report.totals,
        Duration::from_secs(120),
    )
    .await;
    assert!(aggregator.is_running(), "the aggregator must ride through");
    tokio::task::block_in_place(|| cluster.wait_in_sync());
    aggregator.stop_gracefully().await;
}

async fn a_rolling_restart_of_every_broker(cluster: &KafkaCluster, redis: &RedisServer) {
    let dir = TempDir::new("tally-cluster-roll");
    let setup = tokio::task::block_in_place(|| setup_on(cluster, "cluster-roll", &redis.url()));
    let mut aggregator = setup.spawn(dir.path(), &[]);

    // At most 150 s of events: the load runs until the restarts are over and more is durable.
    let spec = LoadSpec {
        events: 600_000,
        ..spec(4_000, 62)
    };
    let load = StoppableLoad::start_on(&cluster.bootstrap(), &setup.topic, spec);
    flushed(&aggregator, EVENTS / 10).await;
    for node in 1..=3 {
        tokio::task::block_in_place(|| cluster.restart_node(node));
    }
    let flushed_after = aggregator
        .metric("tally_events_flushed_total")
        .await
        .unwrap_or(0.0);
    flushed(&aggregator, flushed_after as u64 + 4_000).await;
    assert!(!load.is_finished(), "the load ended before the restarts");
    let report = load.stop().await;

    wait_for_totals(
        &redis.reader(setup.keyspace()).await,
        &report.totals,
        Duration::from_secs(120),
    )
    .await;
    assert!(aggregator.is_running(), "the aggregator must ride through");
    aggregator.stop_gracefully().await;
}
