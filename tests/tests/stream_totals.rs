//! End to end: 200,000 Zipf-skewed events with positive and negative deltas, sent with the
//! producer crate, consumed by the real aggregator binary; every total read back is exact.

use std::time::Duration;

use tally_aggregator::load::{self, LoadSpec};
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, committed_and_end, counters_in_redis, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zipf_stream_with_negative_deltas_sums_exactly() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("stream", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);

    let producer = Producer::new(&ProducerConfig::new(tally_tests::brokers(), &setup.topic))
        .expect("producer");
    let spec = LoadSpec {
        events: 200_000,
        counters: 10_000,
        zipf: 1.1,
        max_delta: 5,
        negative_share: 0.3,
        seed: 7,
        ..LoadSpec::default()
    };
    let sent = load::run(&producer, &spec).await.expect("load runs");
    assert_eq!(
        sent.acked, 200_000,
        "every event acknowledged: {:?}",
        sent.first_error
    );
    assert!(
        sent.totals.values().any(|t| *t < 0),
        "some totals are negative"
    );

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(60)).await;

    // Nothing was written that was not sent.
    let stray: Vec<String> = counters_in_redis(&redis.url(), &setup.keyspace())
        .await
        .into_iter()
        .filter(|c| !sent.totals.contains_key(c))
        .collect();
    assert!(stray.is_empty(), "counters never sent: {stray:?}");
    assert_eq!(
        aggregator.metric("tally_events_consumed_total").await,
        Some(200_000.0)
    );

    aggregator.terminate();
    assert!(
        aggregator
            .wait_exit(Duration::from_secs(30))
            .await
            .success()
    );
    for (partition, (committed, end)) in committed_and_end(&setup.group, &setup.topic, 8)
        .into_iter()
        .enumerate()
    {
        assert_eq!(committed, end, "partition {partition} committed to its end");
    }
}
