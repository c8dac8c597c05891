//! Appending events to the Kafka topic: [`ProducerConfig`] and [`Routing`] (what to build),
//! [`Producer`] (sending), [`Pending`] and [`Delivered`] (acknowledgements), [`ProduceError`].

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use tally_common::{CounterEvent, EventError, Namespaces, codec};

/// How long [`Producer::flush`] waits for outstanding events by default.
pub const DEFAULT_FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// How many times [`Producer::send`] sends an event with an idempotency key again by default.
pub const DEFAULT_IDEMPOTENT_RETRIES: u32 = 3;

/// Who sends a [`BulkProducer`](crate::BulkProducer)'s events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BulkPath {
    /// tally's own appender (`tally_kafka::Appender`) when it supports the options given,
    /// else librdkafka.
    #[default]
    Auto,
    /// tally's own appender; options it does not support are an error.
    Direct,
    /// librdkafka.
    Librdkafka,
}

impl std::str::FromStr for BulkPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "direct" => Ok(Self::Direct),
            "librdkafka" => Ok(Self::Librdkafka),
            other => Err(format!(
                "unknown producer path {other:?}: expected auto, direct or librdkafka"
            )),
        }
    }
}

/// How events are spread over the topic's partitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Routing {
    /// Keyed by counter id: every event of a counter lands in one partition, so the aggregator
    /// folds them into one delta per flush. The default.
    #[default]
    ByCounter,
    /// Keyed by actor: every event of one actor lands in one partition (deduplication relies on
    /// it). Events without an actor fall back to their counter id.
    ByActor,
    /// No key: librdkafka picks a random partition per message.
    Random,
}

impl std::str::FromStr for Routing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "counter" | "by-counter" => Ok(Routing::ByCounter),
            "actor" | "by-actor" => Ok(Routing::ByActor),
            "random" => Ok(Routing::Random),
            other => Err(format!(
                "unknown routing {other:?}: expected counter, actor or random"
            )),
        }
    }
}

/// What a [`Producer`] is built from. Its `Debug` shows the names of the raw options, never their
/// values (they may be credentials such as `sasl.password`).
#[derive(Clone)]
pub struct ProducerConfig {
    /// Kafka bootstrap servers, `host:port[,host:port]`.
    pub brokers: String,
    /// The topic events are appended to.
    pub topic: String,
    /// How events are spread over partitions.
    pub routing: Routing,
    /// Raw librdkafka options, applied last so they override tally's defaults
    /// (e.g. `security.protocol`, `sasl.mechanisms`, `linger.ms`).
    pub options: BTreeMap<String, String>,
    /// The namespaces' policies: in a namespace with an idempotency window, an event sent
    /// without an `event_id` gets a random one, and [`Producer::send`] retries a send Kafka did
    /// not acknowledge with the same id (the aggregator counts it once).
    pub namespaces: Option<Arc<Namespaces>>,
    /// How many times [`Producer::send`] sends such an event again before giving up.
    pub idempotent_retries: u32,
    /// Who sends a [`BulkProducer`](crate::BulkProducer)'s events.
    pub bulk_path: BulkPath,
}

impl std::fmt::Debug for ProducerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("routing", &self.routing)
            .field("options", &self.options.keys().collect::<Vec<_>>())
            .field("idempotent_retries", &self.idempotent_retries)
            .field("bulk_path", &self.bulk_path)
            .finish_non_exhaustive()
    }
}

impl ProducerConfig {
    /// A configuration with tally's defaults for the given brokers and topic.
    pub fn new(brokers: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            routing: Routing::default(),
            options: BTreeMap::new(),
            namespaces: None,
            idempotent_retries: DEFAULT_IDEMPOTENT_RETRIES,
            bulk_path: BulkPath::default(),
        }
    }

    /// Sets who sends a [`BulkProducer`](crate::BulkProducer)'s events.
    pub fn bulk_path(mut self, path: BulkPath) -> Self {
        self.bulk_path = path;
        self
    }

    /// Sets the namespaces' policies (idempotency keys, see the field).
    pub fn namespaces(mut self, namespaces: Arc<Namespaces>) -> Self {
        self.namespaces = Some(namespaces);
        self
    }

    /// Sets the routing.
    pub fn routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }

    /// Sets one raw librdkafka option.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// The librdkafka configuration: safe, throughput-minded defaults, then the raw options.
    pub(crate) fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            // Exactly one copy per send, in order per partition, despite retries.
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // Batch for throughput: a few ms of linger fill large, compressed batches.
            .set("linger.ms", "5")
            .set("batch.size", "1000000")
            .set("batch.num.messages", "100000")
            .set("compression.type", "lz4")
            .set("queue.buffering.max.messages", "500000")
            .set("queue.buffering.max.kbytes", "262144");
        for (key, value) in &self.options {
            config.set(key, value);
        }
        config
    }
}

/// Why an event was not appended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The event broke a rule; nothing was sent.
    #[error("invalid event: {0}")]
    Invalid(#[from] EventError),
    /// The producer could not be created (bad option, bad broker list).
    #[error("cannot create the Kafka producer: {0}")]
    Config(#[source] KafkaError),
    /// Kafka did not acknowledge the event (timed out or refused); it may or may not be stored.
    #[error("Kafka did not acknowledge the event: {0}")]
    Kafka(#[source] KafkaError),
    /// The producer was shut down while the event was in flight.
    #[error("the producer shut down before Kafka acknowledged the event")]
    Canceled,
    /// tally's own producer (the bulk path) could not start, or Kafka refused or did not
    /// acknowledge the event through it.
    #[error("{0}")]
    Direct(String),
}

/// Where an acknowledged event was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// The partition.
    pub partition: i32,
    /// The offset within the partition.
    pub offset: i64,
}

/// An event handed to librdkafka, not yet acknowledged. Await [`Pending::acked`] for the outcome.
#[must_use = "an event is only known to be stored once its acknowledgement is awaited"]
pub struct Pending {
    /// librdkafka's delivery report.
    delivery: DeliveryFuture,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pending")
    }
}

impl Pending {
    /// Waits for Kafka's acknowledgement.
    pub async fn acked(self) -> Result<Delivered, ProduceError> {
        match self.delivery.await {
            Ok(Ok(d)) => Ok(Delivered {
                partition: d.partition,
                offset: d.offset,
            }),
            Ok(Err((e, _))) => Err(ProduceError::Kafka(e)),
            Err(_) => Err(ProduceError::Canceled),
        }
    }
}

/// Appends counter events to tally's topic. Cheap to clone; clones share one librdkafka producer.
#[derive(Clone)]
pub struct Producer {
    /// The librdkafka producer.
    inner: FutureProducer,
    /// The topic events go to.
    topic: String,
    /// How events are keyed.
    routing: Routing,
    /// The namespaces' policies, for idempotency keys.
    namespaces: Option<Arc<Namespaces>>,
    /// Sends again of an event with an idempotency key.
    idempotent_retries: u32,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("topic", &self.topic)
            .field("routing", &self.routing)
            .finish_non_exhaustive()
    }
}

impl Producer {
    /// Creates a producer. Connecting happens in the background; the first send waits for it.
    pub fn new(config: &ProducerConfig) -> Result<Self, ProduceError> {
        let inner: FutureProducer = config
            .client_config()
            .create()
            .map_err(ProduceError::Config)?;
        Ok(Self {
            inner,
            topic: config.topic.clone(),
            routing: config.routing,
            namespaces: config.namespaces.clone(),
            idempotent_retries: config.idempotent_retries,
        })
    }

    /// Adds `delta` to `counter`; returns once Kafka has acknowledged it.
    pub async fn add(&self, counter: &str, delta: i64) -> Result<Delivered, ProduceError> {
        self.send(&CounterEvent::new(counter, delta)?).await
    }

    /// Records that `actor` liked `counter` (a +1 carrying the actor); returns once acknowledged.
    pub async fn like(&self, counter: &str, actor: &str) -> Result<Delivered, ProduceError> {
        self.send(&CounterEvent::new(counter, 1)?.with_actor(actor)?)
            .await
    }

    /// Takes back `actor`'s like of `counter` (a -1 carrying the actor); returns once
    /// acknowledged. In a namespace that deduplicates, it removes a counted like and does nothing
    /// otherwise; elsewhere it is a plain -1.
    pub async fn unlike(&self, counter: &str, actor: &str) -> Result<Delivered, ProduceError> {
        self.send(&CounterEvent::new(counter, -1)?.with_actor(actor)?)
            .await
    }

    /// Resets `counter` through the stream: ordered with its increments (routing by counter), so
    /// everything sent before it is cleared and everything after counts from zero; returns once
    /// acknowledged. See `docs/guarantees.md` for what a reset clears.
    pub async fn reset(&self, counter: &str) -> Result<Delivered, ProduceError> {
        self.send(&CounterEvent::reset(counter)?).await
    }

    /// Sends one event; returns once Kafka has acknowledged it. In a namespace with an
    /// idempotency window the event carries an id (its own, or a random one given here), and a
    /// send Kafka did not acknowledge is sent again with the same id, up to
    /// [`ProducerConfig::idempotent_retries`] times: the aggregator counts it once.
    pub async fn send(&self, event: &CounterEvent) -> Result<Delivered, ProduceError> {
        let event = self.identified(event)?;
        let retries = if self.idempotent(&event) {
            self.idempotent_retries
        } else {
            0
        };
        let mut attempt = 0;
        loop {
            match self.enqueue_identified(&event).await?.acked().await {
                Err(ProduceError::Kafka(error)) if attempt < retries => {
                    attempt += 1;
                    tracing::warn!(
                        counter = event.counter(),
                        event_id = event.event_id(),
                        attempt,
                        %error,
                        "Kafka did not acknowledge the event; sending it again with the same id"
                    );
                }
                done => return done,
            }
        }
    }

    /// Whether `event`'s namespace acts on idempotency keys.
    fn idempotent(&self, event: &CounterEvent) -> bool {
        (self.namespaces.as_ref())
            .is_some_and(|ns| ns.policy(event.counter()).idempotency_window_ms.is_some())
    }

    /// `event`, with a random id if its namespace acts on ids and it has none.
    fn identified<'e>(
        &self,
        event: &'e CounterEvent,
    ) -> Result<Cow<'e, CounterEvent>, ProduceError> {
        if event.event_id().is_some() || !self.idempotent(event) {
            return Ok(Cow::Borrowed(event));
        }
        let id = format!("{:032x}", rand::random::<u128>());
        Ok(Cow::Owned(event.clone().with_event_id(id)?))
    }

    /// Hands one event to librdkafka, waiting while its queue is full, and returns the pending
    /// acknowledgement. Events enqueued by one task keep their order within a partition. In a
    /// namespace with an idempotency window, an event without an id gets a random one; to send
    /// it again yourself, give it your own id (or use [`Producer::send`], which retries).
    pub async fn enqueue(&self, event: &CounterEvent) -> Result<Pending, ProduceError> {
        let event = self.identified(event)?;
        self.enqueue_identified(&event).await
    }

    /// [`Producer::enqueue`] for an event that already carries the id its namespace needs.
    async fn enqueue_identified(&self, event: &CounterEvent) -> Result<Pending, ProduceError> {
        let payload = codec::encode(event);
        let key = match self.routing {
            Routing::ByCounter => Some(event.counter()),
            Routing::ByActor => Some(event.actor().unwrap_or(event.counter())),
            Routing::Random => None,
        };
        // No record timestamp: librdkafka stamps the time of this call, so the Kafka timestamp is
        // when the event was produced and `ts_ms` (in the payload) when it happened. Windows
        // judge lateness by the difference, the pipeline's lag in seconds is the age since it
        // was produced, and `tally audit --since` finds offsets by it.
        let mut record = FutureRecord::<str, [u8]>::to(&self.topic).payload(&payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        loop {
            match self.inner.send_result(record) {
                Ok(delivery) => return Ok(Pending { delivery }),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // Backpressure: librdkafka's queue is full; wait for deliveries to make room.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => return Err(ProduceError::Kafka(e)),
            }
        }
    }

    /// Waits until every enqueued event is acknowledged or failed, for at most `timeout`.
    pub async fn flush_timeout(&self, timeout: Duration) -> Result<(), ProduceError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.flush(timeout))
            .await
            .map_err(|_| ProduceError::Canceled)?
            .map_err(ProduceError::Kafka)
    }

    /// Waits until every enqueued event is acknowledged or failed, for at most
    /// [`DEFAULT_FLUSH_TIMEOUT`]. Call it before shutting down.
    pub async fn flush(&self) -> Result<(), ProduceError> {
        self.flush_timeout(DEFAULT_FLUSH_TIMEOUT).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_parses_its_names_and_rejects_others() {
        assert_eq!("counter".parse(), Ok(Routing::ByCounter));
        assert_eq!("actor".parse(), Ok(Routing::ByActor));
        assert_eq!("random".parse(), Ok(Routing::Random));
        assert!("round-robin".parse::<Routing>().is_err());
    }

    #[test]
    fn raw_options_override_the_defaults() {
        let config = ProducerConfig::new("b:1", "t")
            .option("linger.ms", "50")
            .client_config();
        assert_eq!(config.get("linger.ms"), Some("50"));
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("acks"), Some("all"));
    }

    #[test]
    fn debug_output_names_options_without_their_values() {
        let config = ProducerConfig::new("b:1", "t").option("sasl.password", "hunter2");
        let shown = format!("{config:?}");
        assert!(
            shown.contains("sasl.password") && !shown.contains("hunter2"),
            "{shown}"
        );
    }

    #[test]
    fn events_of_idempotent_namespaces_get_an_id_unless_they_have_one() {
        let namespaces =
            Namespaces::from_toml("[namespaces.views]\nidempotency_window = \"10m\"\n")
                .expect("valid");
        let config = ProducerConfig::new("127.0.0.1:1", "t").namespaces(Arc::new(namespaces));
        let producer = Producer::new(&config).expect("created");
        let view = CounterEvent::new("views:v:1", 1).expect("valid");
        let given = producer.identified(&view).expect("identified");
        let id = given.event_id().expect("an id given");
        assert!(
            id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
        let own = view.clone().with_event_id("mine").expect("valid");
        assert_eq!(
            producer.identified(&own).expect("kept").event_id(),
            Some("mine")
        );
        let like = CounterEvent::new("likes:p:1", 1).expect("valid");
        assert_eq!(producer.identified(&like).expect("kept").event_id(), None);
    }

    #[tokio::test]
    async fn invalid_events_are_refused_before_sending() {
        let producer = Producer::new(&ProducerConfig::new("127.0.0.1:1", "t")).expect("created");
        assert!(matches!(
            producer.add("a{b}", 1).await,
            Err(ProduceError::Invalid(EventError::CounterCharacter { .. }))
        ));
        assert!(matches!(
            producer.add("a", 0).await,
            Err(ProduceError::Invalid(EventError::ZeroDelta))
        ));
    }
}
