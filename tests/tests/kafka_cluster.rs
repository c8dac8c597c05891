//! On a real 3-broker KRaft cluster (replication factor 3, `min.insync.replicas=2`): a broker
//! SIGKILLed under load and later restarted, and then a rolling restart of all three, lose
//! no acknowledged event and count none twice, and the aggregator rides through both without
//! being restarted. On the same cluster, a group on the broker-side protocol (KIP-848) rebalances
//! incrementally: a member joins and one dies under load, and only the partitions that move stop;
//! and an unclean leader election truncates the log under the aggregator's position, which the
//! fetcher finds (KIP-320) and the aggregator counts.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use tally_common::CounterEvent;
use tally_producer::{Producer, ProducerConfig};

use tally_cli::load::LoadSpec;
use tally_tests::kafka_cluster::KafkaCluster;
use tally_tests::{
    AggregatorProcess, AggregatorSetup, Group, RedisServer, StoppableLoad, TempDir, finish_load,
    revokes_seen, serial, start_load_on, wait_for_totals,
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

/// One cluster for every case (starting three brokers takes seconds of two busy cores): a
/// broker SIGKILLed under load and started again, a rolling restart of every broker, and a
/// group on the broker-side protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_faults_lose_and_repeat_nothing_and_the_new_group_protocol_rebalances_incrementally()
{
    let _serial = serial().await;
    // Each case's time goes to stderr even when the test passes (`eprintln!` is captured), to
    // show where this test's minutes go in a CI log.
    let mut since = Instant::now();
    let mut took = |case: &str| {
        let _ = writeln!(
            std::io::stderr(),
            "kafka_cluster: {case} took {:?}",
            since.elapsed()
        );
        since = Instant::now();
    };
    let cluster = tokio::task::block_in_place(KafkaCluster::start);
    let redis = RedisServer::start().await;
    took("starting the cluster");
    a_broker_killed_under_load(&cluster, &redis).await;
    took("a broker killed under load");
    a_rolling_restart_of_every_broker(&cluster, &redis).await;
    took("a rolling restart");
    // The broker-side protocol is generally available from Kafka 4.0 (a preview before:
    // `deploy/local/compat.sh` runs this file on 3.x releases too).
    match cluster.release() {
        (major, minor) if major < 4 => {
            eprintln!("Kafka {major}.{minor}: no broker-side group protocol (KIP-848) before 4.0")
        }
        _ => the_broker_side_group_protocol(&cluster, &redis).await,
    }
    took("the broker-side group protocol");
    // Last: it leaves node 1 down and the quorum shaken.
    an_unclean_election_truncates_the_log_under_the_position(&cluster, &redis).await;
    took("an unclean election");
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
    load.stop_and_wait_totals(
        &redis.reader(setup.keyspace()).await,
        Duration::from_secs(120),
    )
    .await;
    assert!(aggregator.is_running(), "the aggregator must ride through");
    aggregator.stop_gracefully().await;
}

/// `group.protocol=consumer` (KIP-848): the brokers assign the partitions and keep the session
/// (10 s, heartbeats every 1 s, as `deploy/local/kafka-cluster.sh` configures them). A third
/// member joins, then one of the first two is SIGKILLed: nobody revokes a partition it keeps,
/// those that stay put go at most 5 s without a durable flush, the dead member's are counted
/// again within 15 s, and every total is exact.
async fn the_broker_side_group_protocol(cluster: &KafkaCluster, redis: &RedisServer) {
    const PARTITIONS: i32 = 8;
    let dir = TempDir::new("tally-cluster-kip848");
    let setup = AggregatorSetup {
        // The broker owns the session: librdkafka refuses session.timeout.ms with this protocol.
        session_timeout_ms: None,
        ..tokio::task::block_in_place(|| setup_on(cluster, "cluster-kip848", &redis.url()))
    };
    let mut group = Group::new(
        &setup,
        dir.path(),
        &["--kafka-option", "group.protocol=consumer"],
    );
    let mut a = group.spawn("a");
    let mut b = group.spawn("b");
    let spec = LoadSpec {
        events: 10_000_000,
        ..spec(4_000, 63)
    };
    let load = StoppableLoad::start_on(&cluster.bootstrap(), &setup.topic, spec);
    let before = group.wait_owned(&["a", "b"], PARTITIONS, 4).await;

    let revokes = revokes_seen(&a) + revokes_seen(&b);
    let mut c = group.spawn("c");
    let joined = group
        .rebalanced(Instant::now(), before, &["a", "b", "c"], PARTITIONS, 2)
        .await;
    eprintln!("KIP-848 join: {joined:?}");
    assert!(
        joined.kept.len() >= PARTITIONS as usize - 3,
        "only the partitions the new member takes move: {joined:?}"
    );
    assert!(
        joined.pause.1 <= Duration::from_secs(5),
        "a partition that stayed put paused during a join: {joined:?}"
    );
    assert!(
        revokes_seen(&a) + revokes_seen(&b) > revokes,
        "the partitions that moved were revoked (drained) by their owners first"
    );

    let revokes = [revokes_seen(&b), revokes_seen(&c)];
    group.kill("a", &mut a);
    let died = group
        .rebalanced(Instant::now(), joined.after, &["b", "c"], PARTITIONS, 1)
        .await;
    eprintln!("KIP-848 SIGKILL: {died:?}");
    assert_eq!(
        [revokes_seen(&b), revokes_seen(&c)],
        revokes,
        "the survivors revoked partitions when a member died"
    );
    assert!(
        died.settled <= Duration::from_secs(15),
        "a dead member's partitions were counted again only after {:?}",
        died.settled
    );
    assert!(
        died.pause.1 <= Duration::from_secs(3),
        "a partition that stayed with a survivor paused: {died:?}"
    );

    load.stop_and_wait_totals(
        &redis.reader(setup.keyspace()).await,
        Duration::from_secs(120),
    )
    .await;
    b.stop_gracefully().await;
    c.stop_gracefully().await;
}

/// Sends `n` events of +1 to `counter` through a new idempotent producer (a new producer id:
/// after an unclean election the old one's sequence numbers no longer match the log), and
/// waits for every acknowledgement.
async fn send(bootstrap: &str, topic: &str, counter: &str, n: u64) {
    let producer = Producer::new(&ProducerConfig::new(bootstrap, topic)).expect("producer");
    let event = CounterEvent::new(counter, 1).expect("valid event");
    let mut acks = Vec::new();
    for _ in 0..n {
        acks.push(producer.enqueue(&event).await.expect("enqueued"));
    }
    for ack in acks {
        ack.acked().await.expect("acknowledged");
    }
}

/// KIP-320 on a real unclean election. The partition lives on nodes 1 and 2 only. Node 2 is
/// stopped (out of the ISR), 200 events reach node 1 alone and are counted; node 1 dies, node
/// 2 comes back and is elected out of sync: its log ends 200 offsets before the aggregator's
/// position. The fetcher notices the leader epoch moved, asks `OffsetForLeaderEpoch`, finds the
/// truncation and says so; the aggregator counts it and re-acquires the partition.
///
/// The store's ledgers had passed the truncation point: they are moved back to it, so every
/// record the new leader writes counts, and the 200 lost events stay counted (what
/// docs/guarantees.md, "Unclean leader elections", says).
async fn an_unclean_election_truncates_the_log_under_the_position(
    cluster: &KafkaCluster,
    redis: &RedisServer,
) {
    const BEFORE: u64 = 300;
    const LOST: u64 = 200;
    const AFTER: u64 = 500;
    let dir = TempDir::new("tally-cluster-unclean");
    let bootstrap = cluster.bootstrap();
    let setup = AggregatorSetup::named(&bootstrap, "cluster-unclean", &redis.url());
    let topic = setup.topic.clone();
    tokio::task::block_in_place(|| {
        let configs = [
            ("min.insync.replicas", "1"),
            ("unclean.leader.election.enable", "true"),
        ];
        cluster.topic_on(&topic, &[1, 2], &configs);
        cluster.topic(&setup.dead_letter_topic, 1);
    });
    let mut aggregator = setup.spawn(dir.path(), &["--fetch", "direct"]);
    send(&bootstrap, &topic, "before", BEFORE).await;
    flushed(&aggregator, BEFORE).await;

    tokio::task::block_in_place(|| cluster.stop_node(2));
    send(&bootstrap, &topic, "lost", LOST).await;
    flushed(&aggregator, BEFORE + LOST).await;

    tokio::task::block_in_place(|| {
        cluster.kill(1);
        cluster.start_node(2);
        // Node 2 leads once the controllers (2 and 3 now) fence node 1 and elect it uncleanly.
        let deadline = Instant::now() + Duration::from_secs(120);
        while cluster.leader(&topic, 0) != 2 {
            assert!(Instant::now() < deadline, "node 2 was never elected");
            cluster.elect_unclean(&topic, 0);
        }
    });
    send(&bootstrap, &topic, "after", AFTER).await;

    let truncated = aggregator
        .wait_metric(
            "tally_log_truncated_offsets_total",
            1.0,
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(truncated, LOST as f64, "the truncation is found, exactly");
    let applied = aggregator
        .wait_metric(
            "tally_truncated_applied_offsets_total",
            1.0,
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(applied, LOST as f64, "all of it had been applied");
    let expected: HashMap<String, i64> = [("before", BEFORE), ("lost", LOST), ("after", AFTER)]
        .map(|(c, n)| (c.to_owned(), n as i64))
        .into();
    wait_for_totals(
        &redis.reader(setup.keyspace()).await,
        &expected,
        Duration::from_secs(60),
    )
    .await;
    assert!(aggregator.is_running());
}
