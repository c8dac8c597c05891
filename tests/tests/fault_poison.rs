//! Fault: deltas Redis cannot take, in exactly-once mode. A counter whose share would overflow
//! 64 bits, and a counter key that an outsider overwrote with a hash, are dead-lettered with the
//! reason (`overflow`, `wrong_type`); the rest of their batches is applied, every other total is
//! exact, and nothing crashes. Poison and oversized messages are covered in
//! `json_and_dead_letters.rs`, which runs in exactly-once mode too.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_common::keyspace::{DEFAULT_SPREAD, Fan};
use tally_tests::{AggregatorSetup, RedisServer, TempDir, read_dead_letters, wait_for_totals};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_redis_cannot_take_are_dead_lettered_and_the_rest_counts() {
    let dir = TempDir::new("tally-fault");
    let redis = RedisServer::start().await;
    // One partition (0): the poisoned keys below are in the groups it writes those counters to.
    let setup = AggregatorSetup::create("poison", &redis.url(), 1).await;
    let keyspace = setup.keyspace();
    let group = |counter: &str| {
        let rule = tally_common::GroupingRule::ByPartition;
        keyspace.group_for_event(rule, 0, None, counter, Fan::of(DEFAULT_SPREAD))
    };
    let near_max = i64::MAX - 10;
    let mut conn = tally_tests::connect(&redis.url()).await;
    redis::cmd("SET")
        .arg(keyspace.counter_key(group("big:1"), "big:1"))
        .arg(near_max)
        .query_async::<()>(&mut conn)
        .await
        .expect("SET");
    redis::cmd("HSET")
        .arg(keyspace.counter_key(group("weird:1"), "weird:1"))
        .arg("not")
        .arg("a counter")
        .query_async::<()>(&mut conn)
        .await
        .expect("HSET");
    let mut aggregator = setup.spawn(dir.path(), &[]);

    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("producer");
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut deliveries = Vec::new();
    for i in 0..2_000i64 {
        let (counter, delta) = match i % 50 {
            0 => ("big:1".to_owned(), 100),
            1 => ("weird:1".to_owned(), 1),
            _ => (format!("ok:{}", i % 20), 1 + i % 3),
        };
        if !counter.starts_with("big") && !counter.starts_with("weird") {
            *expected.entry(counter.clone()).or_default() += delta;
        }
        let payload = format!(r#"{{"counter":"{counter}","delta":{delta}}}"#);
        let record = FutureRecord::<String, String>::to(&setup.topic)
            .key(&counter)
            .payload(&payload);
        deliveries.push(tally_tests::enqueue_raw(&plain, record));
    }
    tally_tests::assert_delivered(deliveries).await;

    let reader = redis.reader(keyspace.clone()).await;
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    let big: i64 = redis::cmd("GET")
        .arg(keyspace.counter_key(group("big:1"), "big:1"))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(big, near_max, "the overflowing delta was not applied");

    // The dead-letter topic says why, per counter.
    let reasons: std::collections::BTreeSet<(String, String)> =
        read_dead_letters(&setup.dead_letter_topic, 2)
            .into_iter()
            .map(|l| (String::from_utf8_lossy(&l.key).into_owned(), l.reason))
            .collect();
    let reasons: Vec<(String, String)> = reasons.into_iter().collect();
    assert_eq!(
        reasons,
        [
            ("big:1".to_owned(), "overflow".to_owned()),
            ("weird:1".to_owned(), "wrong_type".to_owned())
        ]
    );
    assert!(aggregator.is_running());
    aggregator.stop_gracefully().await;
}
