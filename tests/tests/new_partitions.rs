//! End to end: partitions added to a live topic are counted within 15 s. A keyed stream runs
//! into a 4-partition topic; mid-stream the topic grows to 8 partitions through Kafka's admin
//! API. The producer (refreshing its metadata every second) starts routing counters to the new
//! partitions; the aggregator must notice them (its metadata refresh starts the rebalance that
//! assigns them) and make their events durable, and every total must end exact.

use std::time::{Duration, Instant};

use tally_cli::load::LoadSpec;
use tally_producer::ProducerConfig;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, add_partitions, brokers, finish_load, start_load_with,
    wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_added_to_a_live_topic_are_counted_within_15_seconds() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("new-partitions", &redis.url(), 4).await;
    let aggregator = setup.spawn(dir.path(), &[]);

    let spec = LoadSpec {
        events: 300_000,
        counters: 5_000,
        rate: 12_000,
        seed: 17,
        ..LoadSpec::default()
    };
    let producer = ProducerConfig::new(brokers(), &setup.topic)
        .option("topic.metadata.refresh.interval.ms", "1000");
    let load = start_load_with(producer, spec);
    aggregator
        .wait_metric("tally_flushes_total", 4.0, Duration::from_secs(60))
        .await;

    add_partitions(&setup.topic, 8).await;
    let added = Instant::now();
    let mut counted = Vec::new();
    for partition in 4..8 {
        let labels = format!("partition=\"{partition}\"");
        loop {
            let durable = aggregator.series("tally_durable_offset", &labels).await;
            if durable.is_some_and(|offset| offset > 0.0) {
                counted.push((partition, added.elapsed()));
                break;
            }
            assert!(
                added.elapsed() < Duration::from_secs(30),
                "partition {partition} has nothing durable 30 s after it was added; log tail:\n{}",
                aggregator
                    .log()
                    .lines()
                    .rev()
                    .take(30)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let delay = counted.iter().map(|(_, d)| *d).max().unwrap_or_default();
    println!("new partitions first durable after {counted:?}: all within {delay:?}");
    assert!(
        !load.is_finished(),
        "the stream must still be running when the new partitions are counted"
    );
    assert!(
        delay <= Duration::from_secs(15),
        "new partitions counted {delay:?} after they were added, more than 15 s"
    );

    let sent = finish_load(load, 300_000).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;
    drop(aggregator);
}
