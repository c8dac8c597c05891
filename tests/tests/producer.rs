//! The producer crate against a real broker: routing puts events where it promises, a full local
//! queue makes the caller wait instead of dropping or failing events (async and bulk producers,
//! the bulk one through tally's appender and through librdkafka), both bulk paths route every key
//! to the same partition, and the load generator's totals are exactly what the topic holds, also
//! when `tally load`'s output goes to a pipe nobody reads (`tally load | head`).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tally_cli::load::{self, LoadSpec};
use tally_cli::verify;
use tally_common::CounterEvent;
use tally_common::codec::EventRef;
use tally_producer::{
    BulkPath, BulkProducer, Delivered, ProduceError, Producer, ProducerConfig, Routing,
};
use tally_tests::{TempDir, binary, brokers, create_topic, unique};

async fn partitions_by_key(routing: Routing, key_of: fn(usize) -> (String, String)) -> Vec<usize> {
    let topic = unique("producer.routing");
    create_topic(&topic, 8).await;
    let producer =
        Producer::new(&ProducerConfig::new(brokers(), &topic).routing(routing)).expect("producer");
    let mut seen: HashMap<String, HashSet<i32>> = HashMap::new();
    // In 20 waves, each acknowledged before the next: librdkafka's sticky partitioner keeps
    // unkeyed messages on one partition for `sticky.partitioning.linger.ms` (10 ms), and 2,000
    // events enqueued at once can all fit in that window on a fast day.
    for wave in 0..20 {
        let mut pending = Vec::new();
        for i in wave * 100..(wave + 1) * 100 {
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

fn event(counter: &str) -> EventRef<'_> {
    EventRef {
        counter: Cow::Borrowed(counter),
        delta: 1,
        actor: None,
        ts_ms: 0,
        event_id: None,
        reset: false,
    }
}

/// Sends `events` events over `counters` counters (token `i` to `likes:post:<i % counters>`)
/// through a bulk producer on `path`, checks each token is reported once, and returns where
/// each was delivered, by token.
async fn bulk_send(config: ProducerConfig, events: usize, counters: usize) -> Vec<Delivered> {
    let reports: Arc<Mutex<Vec<(usize, Delivered)>>> = Arc::default();
    let seen = Arc::clone(&reports);
    let sent = tokio::task::spawn_blocking(move || {
        let mut producer = BulkProducer::new(&config, move |token, outcome| {
            let delivered = outcome.expect("acknowledged");
            seen.lock().expect("not poisoned").push((token, delivered));
        })
        .expect("producer");
        for token in 0..events {
            let counter = format!("likes:post:{}", token % counters);
            producer.send(&event(&counter), token).expect("handed over");
        }
        assert!(matches!(
            producer.send(&event("a{b}"), usize::MAX),
            Err(ProduceError::Invalid(_))
        ));
        producer.flush(Duration::from_secs(30)).expect("flushed");
        assert_eq!(producer.in_flight(), 0);
    });
    sent.await.expect("the sending thread finished");
    let mut reports = std::mem::take(&mut *reports.lock().expect("not poisoned"));
    assert_eq!(reports.len(), events, "one report per event");
    reports.sort_by_key(|(token, _)| *token);
    let tokens: Vec<usize> = reports.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        tokens,
        (0..events).collect::<Vec<_>>(),
        "every token reported once"
    );
    let offsets: HashSet<(i32, i64)> = reports
        .iter()
        .map(|(_, d)| (d.partition, d.offset))
        .collect();
    assert_eq!(offsets.len(), events, "every event at an offset of its own");
    reports.into_iter().map(|(_, d)| d).collect()
}

async fn the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once(path: BulkPath) {
    let topic = unique("producer.bulk");
    create_topic(&topic, 4).await;
    let delivered = bulk_send(tiny_queue(&topic).bulk_path(path), 5_000, 100).await;
    // Keyed by counter: each counter's events share a partition, as with the async producer.
    let mut partitions: HashMap<usize, HashSet<i32>> = HashMap::new();
    for (token, d) in delivered.iter().enumerate() {
        partitions
            .entry(token % 100)
            .or_default()
            .insert(d.partition);
    }
    assert!(partitions.values().all(|p| p.len() == 1), "{partitions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once_through_tallys_appender()
 {
    the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once(BulkPath::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once_through_librdkafka() {
    the_bulk_producer_waits_on_a_full_queue_and_reports_every_event_once(BulkPath::Librdkafka)
        .await;
}

/// A counter's events must land in one partition whoever sends them (a service through
/// librdkafka, a backfill through tally's appender): the appender partitions as librdkafka's
/// default partitioner does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_bulk_paths_route_every_key_to_the_same_partition() {
    let topic = unique("producer.parity");
    create_topic(&topic, 7).await;
    let config = ProducerConfig::new(brokers(), &topic);
    let direct = bulk_send(config.clone().bulk_path(BulkPath::Direct), 3_000, 3_000).await;
    let librdkafka = bulk_send(config.bulk_path(BulkPath::Librdkafka), 3_000, 3_000).await;
    let differ: Vec<usize> = (0..3_000)
        .filter(|i| direct[*i].partition != librdkafka[*i].partition)
        .collect();
    assert!(
        differ.is_empty(),
        "{} of 3,000 keys routed differently, e.g. token {:?}",
        differ.len(),
        differ.first()
    );
    let used: HashSet<i32> = direct.iter().map(|d| d.partition).collect();
    assert_eq!(used.len(), 7, "3,000 keys spread over every partition");
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

/// `tally load --totals-out F | head -1`: once the reader is gone the report has nowhere to go,
/// but the events are sent and the file `tally verify` needs is written, and the command exits 0
/// without a panic. The pipe's read end is closed before `tally` starts, so every write fails.
#[test]
fn tally_load_into_a_closed_pipe_writes_its_totals_and_exits_quietly() {
    let topic = unique("producer.pipe");
    tokio::runtime::Runtime::new()
        .expect("runtime")
        .block_on(create_topic(&topic, 2));
    let dir = TempDir::new("tally-load-pipe");
    let totals = dir.path().join("totals.txt");
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = std::process::Command::new(binary("tally"))
        .args(["load", "--brokers", &brokers(), "--topic", &topic])
        .args(["--events", "3000", "--counters", "40", "--max-delta", "3"])
        .arg("--totals-out")
        .arg(&totals)
        .stdout(writer)
        .output()
        .expect("tally load runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let text = std::fs::read_to_string(&totals).expect("the totals file");
    let written = verify::parse_totals(&text).expect("totals lines");
    assert_eq!(written, tally_tests::topic_totals(&topic, 3000));
}
