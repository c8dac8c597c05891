//! The producer crate against a real broker: routing puts events where it promises, a full local
//! queue makes the caller wait instead of dropping or failing events (async and bulk producers),
//! and the load generator's totals are exactly what the topic holds.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tally_cli::load::{self, LoadSpec};
use tally_common::CounterEvent;
use tally_common::codec::EventRef;
use tally_producer::{BulkProducer, Delivered, ProduceError, Producer, ProducerConfig, Routing};
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

/// A producer config whose librdkafka queue holds only 10 messages.
fn tiny_queue(topic: &str) -> ProducerConfig {
    ProducerConfig::new(brokers(), topic).option("queue.buffering.max.messages", "10")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_queue_makes_the_caller_wait_and_loses_nothing() {
    let topic = unique("producer.backpressure");
    create_topic(&topic, 2).await;
    let producer = Producer::new(&tiny_queue(&topic)).expect("producer");
    let mut pending = Vec::new();
    for i in 0..5_000 {
        let event = CounterEvent::new(format!("likes:post:{}", i % 100), 1).expect("valid");
        pending.push(producer.enqueue(&event).await.expect("enqueued"));
    }
    let mut offsets = HashSet::new();
    for p in pending {
        let delivered = p.acked().await.expect("acknowledged");
        assert!(offsets.insert((delivered.partition, delivered.offset)));
    }
    assert_eq!(offsets.len(), 5_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once() {
    let topic = unique("producer.bulk");
    create_topic(&topic, 4).await;
    let reports: Arc<Mutex<Vec<(usize, Delivered)>>> = Arc::default();
    let seen = Arc::clone(&reports);
    let sent = tokio::task::spawn_blocking(move || {
        let mut producer = BulkProducer::new(&tiny_queue(&topic), move |token, outcome| {
            let delivered = outcome.expect("acknowledged");
            seen.lock().expect("not poisoned").push((token, delivered));
        })
        .expect("producer");
        for token in 0..5_000 {
            let counter = format!("likes:post:{}", token % 100);
            let event = EventRef {
                counter: Cow::Borrowed(&counter),
                delta: 1,
                actor: None,
                ts_ms: 0,
                event_id: None,
                reset: false,
            };
            producer.send(&event, token).expect("handed over");
        }
        let invalid = EventRef {
            counter: Cow::Borrowed("a{b}"),
            delta: 1,
            actor: None,
            ts_ms: 0,
            event_id: None,
            reset: false,
        };
        assert!(matches!(
            producer.send(&invalid, 9_999),
            Err(ProduceError::Invalid(_))
        ));
        producer.flush(Duration::from_secs(30)).expect("flushed");
        assert_eq!(producer.in_flight(), 0);
    });
    sent.await.expect("the sending thread finished");
    let reports = reports.lock().expect("not poisoned");
    let tokens: HashSet<usize> = reports.iter().map(|(t, _)| *t).collect();
    assert_eq!(reports.len(), 5_000, "one report per event");
    assert_eq!(tokens, (0..5_000).collect(), "every token reported once");
    // Keyed by counter: each counter's events share a partition, as with the async producer.
    let mut partitions: HashMap<usize, HashSet<i32>> = HashMap::new();
    for (token, delivered) in reports.iter() {
        partitions
            .entry(token % 100)
            .or_default()
            .insert(delivered.partition);
    }
    assert!(partitions.values().all(|p| p.len() == 1), "{partitions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_reports_exact_totals_of_what_kafka_acknowledged() {
    let topic = unique("producer.load");
    create_topic(&topic, 2).await;
    let spec = LoadSpec {
        events: 20_000,
        counters: 100,
        max_delta: 5,
        negative_share: 0.3,
        hot_share: 0.2,
        ..LoadSpec::default()
    };
    let report = load::run(&tiny_queue(&topic), &spec)
        .await
        .expect("load runs");
    assert_eq!(report.failed, 0, "{:?}", report.first_error);
    assert_eq!(report.acked, 20_000);
    // Read the topic back and sum it: the report's totals are exactly what Kafka holds.
    let stored = tally_tests::topic_totals(&topic, 20_000);
    assert_eq!(report.totals, stored);
    assert!(report.totals.contains_key("likes:post:hot"));
}
