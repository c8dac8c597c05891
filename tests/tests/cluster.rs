//! Exactly-once on a real 3-master Redis Cluster: SIGKILLs of the aggregator during a load, for
//! both grouping rules, and a cluster node SIGKILLed and restarted from its append-only file.
//! Every counter ends exact, and no operation ever hits CROSSSLOT (every script stays in its
//! group's slot).

use std::time::Duration;

use tally_aggregator::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisCluster, TempDir, finish_load, kill_repeatedly, seed, start_load, unique,
    wait_for_totals,
};

async fn sigkills_on_a_cluster(grouping: &str) {
    let seed = seed();
    let dir = TempDir::new("tally-cluster-fault");
    let cluster = RedisCluster::start().await;
    let setup = AggregatorSetup::create(&format!("cluster-{grouping}"), &cluster.url(), 8).await;
    let member = format!("group.instance.id={}", unique("member"));
    let flags = ["--grouping", grouping, "--kafka-option", &member];
    let first = setup.spawn(dir.path(), &flags);
    let spec = LoadSpec {
        events: 200_000,
        counters: 5_000,
        rate: 15_000,
        max_delta: 5,
        negative_share: 0.3,
        actors: 50_000,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let mut last = kill_repeatedly(&setup, dir.path(), &flags, first, 5, seed, &load).await;
    let sent = finish_load(load, 200_000).await;
    let reader = cluster.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    let log = last.log();
    assert!(!log.contains("CROSSSLOT"), "{log}");
    last.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sigkills_grouped_by_partition_count_exactly() {
    sigkills_on_a_cluster("partition").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sigkills_grouped_by_actor_count_exactly() {
    sigkills_on_a_cluster("actor").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_node_killed_and_restarted_from_its_aof() {
    let seed = seed();
    let dir = TempDir::new("tally-cluster-fault");
    let mut cluster = RedisCluster::start().await;
    let setup = AggregatorSetup::create("cluster-node", &cluster.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &["--grouping", "actor"]);
    let spec = LoadSpec {
        events: 150_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    aggregator
        .wait_metric("tally_flushes_total", 10.0, Duration::from_secs(60))
        .await;
    cluster.kill_and_restart_node(1).await;
    assert!(
        !load.is_finished(),
        "the load ended before the node came back"
    );
    let sent = finish_load(load, 150_000).await;
    let reader = cluster.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    assert!(!aggregator.log().contains("CROSSSLOT"));
    aggregator.stop_gracefully().await;
}
