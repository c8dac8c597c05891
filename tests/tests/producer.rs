//! The producer crate against a real broker: routing puts events where it promises, and a full
//! local queue makes the caller wait instead of dropping or failing events.

use std::collections::{HashMap, HashSet};

use tally_aggregator::load::{self, LoadSpec};
use tally_common::CounterEvent;
use tally_producer::{Producer, ProducerConfig, Routing};
use tally_tests::{brokers, create_topic, unique};

async fn partitions_by_key(routing: Routing, key_of: fn(usize) -> (String, String)) -> Vec<usize> {
    let topic = unique("producer.routing");
    create_topic(&topic, 8).await;
    let producer =
        Producer::new(&ProducerConfig::new(brokers(), &topic).routing(routing)).expect("producer");
    let mut seen: HashMap<String, HashSet<i32>> = HashMap::new();
    let mut pending = Vec::new();
    for i in 0..2_000 {
        let (counter, actor) = key_of(i);
        let event = CounterEvent::new(counter.clone(), 1)
            .and_then(|e| e.with_actor(actor.clone()))
            .expect("valid event");
        let key = if routing == Routing::ByActor {
            actor
        } else {
            counter
        };
        pending.push((key, producer.enqueue(&event).await.expect("enqueued")));
    }
    for (key, p) in pending {
        let delivered = p.acked().await.expect("acknowledged");
        seen.entry(key).or_default().insert(delivered.partition);
    }
    seen.values().map(HashSet::len).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_by_counter_keeps_each_counter_in_one_partition() {
    let spread = partitions_by_key(Routing::ByCounter, |i| {
        (format!("likes:post:{}", i % 50), format!("u{i}"))
    })
    .await;
    assert_eq!(spread.len(), 50);
    assert!(
        spread.iter().all(|n| *n == 1),
        "a counter spanned partitions: {spread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_by_actor_keeps_each_actor_in_one_partition() {
    let spread = partitions_by_key(Routing::ByActor, |i| {
        (format!("likes:post:{i}"), format!("u{}", i % 40))
    })
    .await;
    assert_eq!(spread.len(), 40);
    assert!(
        spread.iter().all(|n| *n == 1),
        "an actor spanned partitions: {spread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_routing_spreads_one_counter_over_partitions() {
    let spread = partitions_by_key(Routing::Random, |i| {
        ("likes:post:1".to_owned(), format!("u{i}"))
    })
    .await;
    assert_eq!(spread.len(), 1);
    assert!(
        spread[0] > 1,
        "2,000 unkeyed events all landed in one partition"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_queue_makes_the_caller_wait_and_loses_nothing() {
    let topic = unique("producer.backpressure");
    create_topic(&topic, 2).await;
    // Room for 10 messages in librdkafka's queue, 5,000 events in flight from the caller's side.
    let producer = Producer::new(
        &ProducerConfig::new(brokers(), &topic).option("queue.buffering.max.messages", "10"),
    )
    .expect("producer");
    let spec = LoadSpec {
        events: 5_000,
        counters: 100,
        window: 5_000,
        ..LoadSpec::default()
    };
    let report = load::run(&producer, &spec).await.expect("load runs");
    assert_eq!(report.failed, 0, "{:?}", report.first_error);
    assert_eq!(report.acked, 5_000);
    assert_eq!(report.totals.values().sum::<i64>(), 5_000);
}
