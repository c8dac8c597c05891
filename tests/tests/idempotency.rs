//! Idempotency keys end to end: up to 200,000 events with ids (the stream runs until the last of
//! 5 aggregator SIGKILLs, or of 3 hand-overs between aggregators, is over and flushed), of which
//! about 10% are sent again with the same id (at once, a few seconds later, and after the
//! last change), in a
//! namespace with a 10-minute idempotency window, grouped by partition and by actor. Every total
//! equals the sum over distinct ids, `tally audit` agrees, and the last aggregator's gauge
//! holds one id per event counted. Then the window itself, with
//! explicit Kafka timestamps: a repeat 30 s after the first counts nothing, one 61 s after counts
//! again (a 1-minute window), and one 30 s after that repeats the second.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_common::CounterEvent;
use tally_common::codec::encode;
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    NamespacedSetup, PacedSender, brokers, kill_repeatedly, reader, seed, wait_for_totals,
};

const EVENTS: u64 = 200_000;
const RATE: u64 = 10_000;
const NAMESPACES: &str = r#"
[namespaces.views]
idempotency_window = "10m"

[namespaces.clicks]
idempotency_window = "1m"
"#;

/// What was sent: every distinct id's delta, and the resends kept for after the kills.
struct Sent {
    events: u64,
    totals: HashMap<String, i64>,
    later: Vec<CounterEvent>,
    repeats: u64,
}

async fn send(topic: String, seed: u64, stop: Arc<AtomicBool>) -> Sent {
    let mut sender = PacedSender::new(&topic, RATE);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut totals: HashMap<String, i64> = HashMap::new();
    let mut soon: Vec<(u64, CounterEvent)> = Vec::new();
    let mut later = Vec::new();
    let mut repeats = 0;
    let mut events = 0;
    for i in 0..EVENTS {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let counter = format!("views:video:{}", rng.random_range(0..1_000));
        let delta = rng.random_range(1..=5);
        let event = CounterEvent::new(counter.clone(), delta)
            .and_then(|e| e.with_actor(format!("u{}", rng.random_range(0..5_000))))
            .and_then(|e| e.with_event_id(format!("e{i}")))
            .expect("valid");
        *totals.entry(counter).or_default() += delta;
        sender.send(&event).await;
        events += 1;
        if rng.random_bool(0.1) {
            repeats += 1;
            match rng.random_range(0..3) {
                0 => sender.send(&event).await,
                // 2 to 5 seconds later, at this rate.
                1 => soon.push((i + rng.random_range(2 * RATE..5 * RATE), event)),
                _ => later.push(event),
            }
        }
        while soon.first().is_some_and(|(due, _)| *due <= i) {
            let (_, event) = soon.remove(0);
            sender.send(&event).await;
        }
        soon.sort_by_key(|(due, _)| *due);
    }
    for (_, event) in soon {
        sender.send(&event).await;
    }
    sender.finish().await;
    Sent {
        events,
        totals,
        later,
        repeats,
    }
}

/// How the aggregators change while the events are sent.
#[derive(Debug, Clone, Copy)]
enum Changes {
    /// The aggregator is SIGKILLed 5 times, a new one started each time.
    Kills,
    /// 3 times, a second aggregator joins the group (the partitions are split between the
    /// two, each taking its share from the log's window), then the first leaves gracefully
    /// (its partitions revoked and taken by the second).
    HandOvers,
}

/// `Changes::HandOvers`: returns the last aggregator.
async fn hand_over_repeatedly<T>(
    setup: &tally_tests::AggregatorSetup,
    dir: &std::path::Path,
    flags: &[&str],
    first: tally_tests::AggregatorProcess,
    load: &tokio::task::JoinHandle<T>,
) -> tally_tests::AggregatorProcess {
    let mut current = first;
    for change in 1..=3 {
        (current)
            .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
            .await;
        // A member of its own: under the first's static member id it would replace it
        // rather than share the partitions with it.
        let member = format!("group.instance.id={}", tally_tests::unique("joined"));
        let flags: Vec<&str> = (flags.iter())
            .map(|f| match f.starts_with("group.instance.id=") {
                true => member.as_str(),
                false => f,
            })
            .collect();
        let mut joined = setup.spawn(dir, &flags);
        let minute = Duration::from_secs(60);
        joined.wait_metric("tally_flushes_total", 1.0, minute).await;
        assert!(
            !load.is_finished(),
            "the load ended before hand-over {change} of 3: make it longer"
        );
        // Both own some: the partitions split between them.
        let theirs = joined.metric("tally_assigned_partitions").await;
        let ours = current.metric("tally_assigned_partitions").await;
        eprintln!("hand-over {change}/3: {ours:?} and {theirs:?} partitions");
        assert!(
            theirs.is_some_and(|n| n >= 1.0) && ours.is_some_and(|n| n >= 1.0),
            "the partitions split between the two: {ours:?} and {theirs:?}"
        );
        current.stop_gracefully().await;
        eprintln!("hand-over {change}/3: the first aggregator left the second");
        std::mem::swap(&mut current, &mut joined);
        drop(joined);
    }
    current
        .wait_metric("tally_flushes_total", 3.0, Duration::from_secs(60))
        .await;
    current
}

async fn repeats_count_once(name: &str, grouping: &str, changes: Changes) {
    let seed = seed();
    let run = NamespacedSetup::start(name, NAMESPACES).await;
    let (redis, dir, setup) = (&run.redis, &run.dir, &run.setup);
    let flags = run.flags(&["--grouping", grouping]);
    let first = setup.spawn(dir.path(), &flags);
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(send(setup.topic.clone(), seed, stop.clone()));
    let mut last = match changes {
        Changes::Kills => kill_repeatedly(setup, dir.path(), &flags, first, 5, seed, &load).await,
        Changes::HandOvers => hand_over_repeatedly(setup, dir.path(), &flags, first, &load).await,
    };
    stop.store(true, Ordering::Relaxed);
    let sent = load.await.expect("load task");
    // After the last change: the rest of the repeats.
    let producer = Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
    // Pipelined: one round trip each would spend most of the test waiting.
    let mut acks = Vec::with_capacity(sent.later.len());
    for event in &sent.later {
        acks.push(producer.enqueue(event).await.expect("enqueued"));
    }
    for ack in acks {
        ack.acked().await.expect("sent again");
    }
    eprintln!(
        "{} events, {} sent again ({} after the last change)",
        sent.events,
        sent.repeats,
        sent.later.len()
    );
    wait_for_totals(
        &reader(&redis.url(), setup.keyspace()).await,
        &sent.totals,
        Duration::from_secs(90),
    )
    .await;
    let repeated = last
        .wait_metric("tally_repeated_ids_total", 1.0, Duration::from_secs(10))
        .await;
    eprintln!("the last aggregator passed over {repeated} repeats");
    // It holds one id per event counted, whether read before it took over (the warm-up) or
    // after, and none for a repeat; its tables cost about 22.5 bytes per id.
    let held = last
        .wait_metric(
            "tally_idempotency_ids_held",
            sent.events as f64,
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(held, sent.events as f64, "ids held, one per event counted");
    let bytes = last.metric("tally_idempotency_bytes").await.unwrap_or(0.0);
    eprintln!("{held} ids held in {bytes} bytes of tables");
    assert!(
        (16.0..=40.0).contains(&(bytes / held)),
        "16-byte slots, about 1.4 per id: {bytes} bytes for {held} ids"
    );

    // The window, by Kafka timestamp: a 1-minute window on clicks.
    let raw: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("producer");
    let t = tally_common::event::now_ms() - 10 * 60_000;
    for (stamp, delta) in [(t, 2), (t + 30_000, 2), (t + 61_000, 2), (t + 91_000, 2)] {
        let event = CounterEvent::new("clicks:ad:1", delta)
            .and_then(|e| e.with_event_id("click-1"))
            .expect("valid");
        let payload = encode(&event);
        raw.send(
            FutureRecord::to(&setup.topic)
                .key("clicks:ad:1")
                .payload(&payload)
                .timestamp(stamp),
            Duration::from_secs(10),
        )
        .await
        .expect("acknowledged");
    }
    let mut totals = sent.totals.clone();
    totals.insert("clicks:ad:1".to_owned(), 4);
    wait_for_totals(
        &reader(&redis.url(), setup.keyspace()).await,
        &totals,
        Duration::from_secs(30),
    )
    .await;
    last.stop_gracefully().await;

    setup.assert_audit_clean(&["--namespaces", &run.namespaces], totals.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_ids_count_once_under_sigkills_grouped_by_partition() {
    let _serial = tally_tests::serial().await;
    repeats_count_once("ids", "partition", Changes::Kills).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_ids_count_once_under_sigkills_grouped_by_actor() {
    let _serial = tally_tests::serial().await;
    repeats_count_once("ids-actor", "actor", Changes::Kills).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_ids_count_once_as_partitions_change_hands() {
    let _serial = tally_tests::serial().await;
    repeats_count_once("ids-hands", "partition", Changes::HandOvers).await;
}
