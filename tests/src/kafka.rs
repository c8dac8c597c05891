//! Kafka: the brokers, topics and partitions, committed offsets, load through the producer
//! crate, and reading topics back (dead letters, what was sent).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::ToBytes;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use tally_cli::load::{self, LoadError, LoadReport, LoadSpec};
use tally_common::{CounterEvent, Reader};
use tally_producer::{Pending, Producer, ProducerConfig};
use tokio::task::JoinHandle;

use crate::store::wait_for_totals;
use crate::support::{eventually, unique};

/// The Kafka brokers the tests use.
pub fn brokers() -> String {
    std::env::var("TALLY_TEST_BROKERS")
        .unwrap_or_else(|_| tally_common::defaults::BROKERS.to_owned())
}

/// Sends counter events through the producer crate from one task, in order, at `rate` a second
/// on average, with at most 5,000 of them unacknowledged; every acknowledgement is checked.
#[derive(Debug)]
pub struct PacedSender {
    producer: Producer,
    rate: u64,
    started: tokio::time::Instant,
    sent: u64,
    pending: Vec<Pending>,
}

impl PacedSender {
    /// A sender to `topic`, routing by counter (the producer's default).
    pub fn new(topic: &str, rate: u64) -> Self {
        Self {
            producer: Producer::new(&ProducerConfig::new(brokers(), topic)).expect("producer"),
            rate,
            started: tokio::time::Instant::now(),
            sent: 0,
            pending: Vec::new(),
        }
    }

    /// Sends `event`, pausing as the rate asks.
    pub async fn send(&mut self, event: &CounterEvent) {
        self.pending
            .push(self.producer.enqueue(event).await.expect("enqueued"));
        self.sent += 1;
        if self.pending.len() >= 5_000 {
            for ack in self.pending.drain(..) {
                ack.acked().await.expect("acknowledged");
            }
        }
        if self.sent.is_multiple_of(100) {
            let due = self.started + Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
            tokio::time::sleep_until(due).await;
        }
    }

    /// Waits until Kafka acknowledged everything sent; returns the producer.
    pub async fn finish(self) -> Producer {
        for ack in self.pending {
            ack.acked().await.expect("acknowledged");
        }
        self.producer
    }
}

/// Sends a storm of `events` in order from one task, at 10,000 a second: increments over
/// `counters` counters (`<prefix><n>`, a fifth of them -2, the rest 1 to 5, each with an
/// actor), 1% of them resets. Returns each counter's total since its last reset, and the
/// resets sent.
pub async fn send_with_resets(
    topic: String,
    events: u64,
    (prefix, counters): (&'static str, u32),
    seed: u64,
    stop: Arc<AtomicBool>,
) -> (HashMap<String, i64>, u64) {
    use rand::{Rng, SeedableRng};
    let mut sender = PacedSender::new(&topic, 10_000);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut truth: HashMap<String, i64> = HashMap::new();
    let mut resets = 0;
    for _ in 0..events {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let counter = format!("{prefix}{}", rng.random_range(0..counters));
        let event = if rng.random_bool(0.01) {
            resets += 1;
            truth.insert(counter.clone(), 0);
            CounterEvent::reset(counter).expect("valid")
        } else {
            let delta = if rng.random_bool(0.2) {
                -2
            } else {
                rng.random_range(1..=5)
            };
            *truth.entry(counter.clone()).or_default() += delta;
            CounterEvent::new(counter, delta)
                .and_then(|e| e.with_actor(format!("u{}", rng.random_range(0..5_000))))
                .expect("valid")
        };
        sender.send(&event).await;
    }
    sender.finish().await;
    (truth, resets)
}

/// Sends random events (`post:0` .. `post:<counters - 1>`, deltas of ±1 to ±5) to `topic` at
/// `rate` a second until `sending` is cleared, and returns what it sent, summed per counter: a
/// stream that outlasts whatever a test does to the pipeline meanwhile.
pub async fn stream_until(
    topic: &str,
    rate: u64,
    counters: u64,
    seed: u64,
    sending: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> HashMap<String, i64> {
    use rand::{Rng, SeedableRng};
    let mut sender = PacedSender::new(topic, rate);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut totals = HashMap::new();
    while sending.load(std::sync::atomic::Ordering::Relaxed) {
        let counter = format!("post:{}", rng.random_range(0..counters));
        let delta = rng.random_range(1..=5) * if rng.random_bool(0.3) { -1 } else { 1 };
        let event = CounterEvent::new(counter.clone(), delta).expect("valid event");
        sender.send(&event).await;
        *totals.entry(counter).or_insert(0) += delta;
    }
    sender.finish().await;
    totals
}

/// Hands `record` to a raw librdkafka producer (an independent client, not tally's), panicking
/// if it is refused; wait for it with [`assert_delivered`].
pub fn enqueue_raw<K: ToBytes + ?Sized, P: ToBytes + ?Sized>(
    producer: &FutureProducer,
    record: FutureRecord<'_, K, P>,
) -> DeliveryFuture {
    producer
        .send_result(record)
        .map_err(|(e, _)| e)
        .expect("enqueued")
}

/// Waits for every delivery and asserts Kafka acknowledged each.
pub async fn assert_delivered(deliveries: impl IntoIterator<Item = DeliveryFuture>) {
    for delivery in deliveries {
        delivery
            .await
            .expect("delivery report")
            .map_err(|(e, _)| e)
            .expect("Kafka acknowledged the message");
    }
}

/// Creates `topic` with `partitions` partitions; fails loudly if Kafka is not reachable.
pub async fn create_topic(topic: &str, partitions: i32) {
    create_topic_on(&brokers(), topic, partitions).await;
}

/// Creates `topic` with `partitions` partitions (replication factor 1) on the Kafka at
/// `bootstrap`; fails loudly if it is not reachable.
pub async fn create_topic_on(bootstrap: &str, topic: &str, partitions: i32) {
    create_replicated_topic(bootstrap, topic, partitions, 1, &[]).await;
}

/// Creates `topic` with `partitions` partitions, `replicas` replicas each and the topic
/// `configs`, on the Kafka at `bootstrap`; fails loudly if it cannot.
pub async fn create_replicated_topic(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    replicas: i32,
    configs: &[(&str, &str)],
) {
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replicas));
    create_new_topic(bootstrap, new, configs).await;
}

/// Creates `new` with `configs` on the Kafka at `bootstrap`, through the admin API.
pub async fn create_new_topic(bootstrap: &str, mut new: NewTopic<'_>, configs: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    for (key, value) in configs {
        new = new.set(key, value);
    }
    let results = admin
        .create_topics(
            &[new],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(20))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Kafka is not reachable at {bootstrap} ({e}): start it with deploy/local/start.sh"
            )
        });
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("cannot create topic {t}: {e}"));
    }
}

/// Raises `topic`'s partition count to `partitions` on the Kafka the tests use.
pub async fn add_partitions(topic: &str, partitions: usize) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let results = admin
        .create_partitions(
            &[rdkafka::admin::NewPartitions::new(topic, partitions)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(20))),
        )
        .await
        .expect("Kafka answers CreatePartitions");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("cannot add partitions to {t}: {e}"));
    }
}

/// Partitions of `topic` (`0..partitions`) whose committed offset for `group` is not the
/// partition's end, as `(partition, committed, end)`.
pub fn uncommitted(group: &str, topic: &str, partitions: i32) -> Vec<(i32, Option<Offset>, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .filter_map(|p| {
            let offset = committed.find_partition(topic, p).map(|e| e.offset());
            let (_, end) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            (offset != Some(Offset::Offset(end))).then_some((p, offset, end))
        })
        .collect()
}

/// The end (high watermark) of each partition of `topic`, `0..partitions`.
pub async fn end_offsets(topic: &str, partitions: i32) -> Vec<i64> {
    end_offsets_on(&brokers(), topic, partitions).await
}

/// [`end_offsets`] on the Kafka at `bootstrap`.
pub async fn end_offsets_on(bootstrap: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let (bootstrap, topic) = (bootstrap.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()
            .expect("consumer");
        (0..partitions)
            .map(|p| {
                let (_, end) = consumer
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                end
            })
            .collect()
    })
    .await
    .expect("join")
}

/// Asserts that `group` has committed every partition of `topic` up to the partition's end:
/// nothing is left to re-read, malformed messages included.
pub fn assert_committed_to_end(group: &str, topic: &str, partitions: i32) {
    let behind = uncommitted(group, topic, partitions);
    assert!(
        behind.is_empty(),
        "partitions of {topic} not committed to their end (partition, committed, end): {behind:?}"
    );
}

/// Waits until `group` has committed every partition of `topic` up to its end.
pub async fn wait_committed_to_end(group: &str, topic: &str, partitions: i32, timeout: Duration) {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    eventually(timeout, "offsets committed to the end", || {
        let (group, topic) = (group.clone(), topic.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                uncommitted(&group, &topic, partitions)
                    .is_empty()
                    .then_some(())
            })
            .await
            .ok()
            .flatten()
        }
    })
    .await;
}

/// Starts sending `spec` to `topic` through the producer crate in the background.
pub fn start_load(topic: &str, spec: LoadSpec) -> JoinHandle<Result<LoadReport, LoadError>> {
    start_load_on(&brokers(), topic, spec)
}

/// Like [`start_load`], on the Kafka at `bootstrap`.
pub fn start_load_on(
    bootstrap: &str,
    topic: &str,
    spec: LoadSpec,
) -> JoinHandle<Result<LoadReport, LoadError>> {
    start_load_with(ProducerConfig::new(bootstrap, topic), spec)
}

/// Like [`start_load`], through a producer built from `config`.
pub fn start_load_with(
    config: ProducerConfig,
    spec: LoadSpec,
) -> JoinHandle<Result<LoadReport, LoadError>> {
    tokio::spawn(async move { load::run(&config, &spec).await })
}

/// Waits for a load started by [`start_load`] and checks that Kafka acknowledged every event.
pub async fn finish_load(
    load: JoinHandle<Result<LoadReport, LoadError>>,
    events: u64,
) -> LoadReport {
    let report = load.await.expect("load task").expect("load runs");
    assert_eq!(
        report.acked, events,
        "every event acknowledged: {:?}",
        report.first_error
    );
    report
}

/// A load that runs until it is stopped: a stream that lasts as long as what a test does to
/// the pipeline meanwhile, no longer. Its `events` is only an upper bound.
#[derive(Debug)]
pub struct StoppableLoad {
    /// The load's task (for [`kill_repeatedly`](crate::kill_repeatedly)'s check that it is
    /// still running).
    pub task: JoinHandle<Result<LoadReport, LoadError>>,
    stop: Arc<AtomicBool>,
}

impl StoppableLoad {
    /// Starts `spec` on `topic`.
    pub fn start(topic: &str, spec: LoadSpec) -> Self {
        Self::start_on(&brokers(), topic, spec)
    }

    /// Like [`StoppableLoad::start`], on the Kafka at `bootstrap`.
    pub fn start_on(bootstrap: &str, topic: &str, spec: LoadSpec) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let spec = LoadSpec {
            stop: Some(stop.clone()),
            ..spec
        };
        Self {
            task: start_load_on(bootstrap, topic, spec),
            stop,
        }
    }

    /// Whether the load ended on its own (it sent all its `events`).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the load: it sends nothing more, and every event it sent was acknowledged.
    /// Returns what it sent.
    pub async fn stop(self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        let report = self.task.await.expect("load task").expect("load runs");
        assert_eq!(
            (report.acked, report.failed),
            (report.sent, 0),
            "every event sent was acknowledged: {:?}",
            report.first_error
        );
        report
    }

    /// Stops the load ([`StoppableLoad::stop`]) and waits until every total it sent is what
    /// `reader` reads, exactly; returns what it sent.
    pub async fn stop_and_wait_totals(self, reader: &Reader, timeout: Duration) -> LoadReport {
        let report = self.stop().await;
        wait_for_totals(reader, &report.totals, timeout).await;
        report
    }
}

/// A message read back from a dead-letter topic.
#[derive(Debug, Clone)]
pub struct SeenDeadLetter {
    /// Its key.
    pub key: Vec<u8>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The `tally-reason` header.
    pub reason: String,
    /// The `tally-error` header.
    pub error: String,
}

/// Reads `topic` from the start, handing each message to `each`, until `n` messages arrived (or
/// 30 s passed); returns how many arrived.
fn read_from_start(
    topic: &str,
    n: usize,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("reader"))
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen < n && Instant::now() < deadline {
        if let Some(message) = consumer.poll(Duration::from_millis(500)) {
            each(&message.expect("message"));
            seen += 1;
        }
    }
    seen
}

/// Reads the dead-letter `topic` from the start until `n` messages arrived (or 30 s passed).
pub fn read_dead_letters(topic: &str, n: usize) -> Vec<SeenDeadLetter> {
    use rdkafka::message::{Headers, Message};
    let header = |m: &rdkafka::message::BorrowedMessage<'_>, name: &str| {
        m.headers()
            .and_then(|h| h.iter().find(|h| h.key == name))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_else(|| panic!("dead letter without a {name} header"))
    };
    let mut seen = Vec::new();
    read_from_start(topic, n, |message| {
        seen.push(SeenDeadLetter {
            key: message.key().unwrap_or_default().to_vec(),
            payload: message.payload().unwrap_or_default().to_vec(),
            reason: header(message, "tally-reason"),
            error: header(message, "tally-error"),
        });
    });
    seen
}

/// Reads the `n` events of `topic` and sums them per counter; panics if fewer arrive in 30 s or
/// one does not decode.
pub fn topic_totals(topic: &str, n: usize) -> HashMap<String, i64> {
    use rdkafka::message::Message;
    let mut totals = HashMap::new();
    let read = read_from_start(topic, n, |message| {
        let event = tally_common::codec::decode(
            message.payload().unwrap_or_default(),
            tally_common::codec::DEFAULT_MAX_MESSAGE_BYTES,
        )
        .expect("the producer writes valid events");
        *totals.entry(event.counter.into_owned()).or_default() += event.delta;
    });
    assert_eq!(read, n, "events read back from {topic}");
    totals
}
