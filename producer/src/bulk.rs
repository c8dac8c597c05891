//! [`BulkProducer`]: fire-and-forget sends with a delivery callback, for bulk traffic.
//!
//! [`Producer`](crate::Producer) gives every event its own acknowledgement future, which is what
//! a request handler wants but costs an allocation, a channel and a wake-up per event. A job
//! that appends millions of events (a backfill, an import, the load generator) wants librdkafka's
//! own model instead: hand the event over with a caller-chosen `usize` token, and hear about its
//! fate later in one callback. Nothing is lost silently: every event handed over is reported
//! exactly once, as [`Delivered`] or as an error, by the time [`BulkProducer::flush`] returns.
//!
//! Two paths send the events, chosen by [`ProducerConfig::bulk_path`]: tally's own appender
//! (`tally_kafka::Appender`, the default whenever it supports the options given: each event is
//! encoded straight into its partition's batch, and an I/O thread of its own sends the
//! batches), or librdkafka's producer (one message object, a topic lookup and clock reads per
//! event). Both are idempotent with `acks=all` and route a key to the same partition.
//!
//! Delivery reports are handled inside [`BulkProducer::send`], [`BulkProducer::poll`] and
//! [`BulkProducer::flush`], so the callback runs on the owner's thread. The callback is `Fn`;
//! keep its state in atomics or a mutex. Use it from a blocking thread
//! (`tokio::task::spawn_blocking`), never on an async worker.

use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext};
use tally_common::codec::{self, EventRef};

use tally_kafka::{AppendConfig, AppendError, Appender, Completion};

use crate::kafka::{BulkPath, Delivered, ProduceError, ProducerConfig, Routing};

/// Sends between two polls for delivery reports: often enough to keep librdkafka's report queue
/// short, rarely enough that polling costs nothing per event.
const POLL_EVERY_SENDS: u32 = 1024;

/// librdkafka's `linger.ms` for bulk traffic. Events routed by key spread over every partition,
/// so each partition's batch fills a partition-count times slower than the stream; 20 ms rather
/// than [`Producer`](crate::Producer)'s 5 ms makes batches 4 times larger and produced 2,000,000
/// events routed by counter over 8 partitions 10-30% faster here (`tally-bench --only producer`,
/// runs alternated: 637-787 vs 570-617 thousand events/s; 50 ms was no better than 20).
pub const BULK_LINGER_MS: &str = "20";

/// How long a send waits for room in a full librdkafka queue before trying again.
const QUEUE_FULL_WAIT: Duration = Duration::from_millis(1);

/// Most reports served by one [`BulkProducer::serve_reports`] call, so that a stream of reports
/// cannot keep the sending thread from sending.
const MAX_REPORT_EVENTS: u32 = 64;

/// The librdkafka context that hands each delivery report to the owner's callback.
struct Reports<F> {
    /// The callback.
    on_delivery: F,
}

impl<F: Send + Sync + 'static> ClientContext for Reports<F> {}

impl<F> ProducerContext for Reports<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, token: usize) {
        let outcome = match result {
            Ok(message) => Ok(Delivered {
                partition: message.partition(),
                offset: message.offset(),
            }),
            Err((e, _)) => Err(ProduceError::Kafka(e.clone())),
        };
        (self.on_delivery)(token, outcome);
    }
}

/// Who sends the events.
enum Path<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    /// tally's appender, and the callback its completions go to.
    Direct { appender: Appender, on_delivery: F },
    /// The librdkafka producer, polled by the owner.
    Librdkafka(BaseProducer<Reports<F>>),
}

/// Appends events without a future per event; each outcome goes to one callback with the token
/// given at send time. See the module documentation.
pub struct BulkProducer<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    /// Who sends.
    path: Path<F>,
    /// The topic events go to.
    topic: String,
    /// How events are keyed.
    routing: Routing,
    /// The encode buffer, reused for every event.
    payload: Vec<u8>,
    /// Sends since the last poll.
    unpolled: u32,
}

impl<F> std::fmt::Debug for BulkProducer<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = match self.path {
            Path::Direct { .. } => "direct",
            Path::Librdkafka(_) => "librdkafka",
        };
        f.debug_struct("BulkProducer")
            .field("topic", &self.topic)
            .field("routing", &self.routing)
            .field("path", &path)
            .finish_non_exhaustive()
    }
}

impl<F> BulkProducer<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    /// Creates a bulk producer with the same settings as [`Producer`](crate::Producer)
    /// (idempotent, `acks=all`) except a longer linger, [`BULK_LINGER_MS`] unless the config sets
    /// `linger.ms`; `on_delivery` hears about every event sent. With tally's appender (see the
    /// module documentation) it waits until the topic's partitions are known, and fails if
    /// Kafka cannot be reached.
    pub fn new(config: &ProducerConfig, on_delivery: F) -> Result<Self, ProduceError> {
        let mut client = config.client_config();
        if !config.options.contains_key("linger.ms") {
            client.set("linger.ms", BULK_LINGER_MS);
        }
        let direct = match config.bulk_path {
            BulkPath::Librdkafka => None,
            path => {
                // The values from `get`: `config_map` masks secrets such as `sasl.password`.
                let keys: Vec<&str> = client.config_map().into_keys().collect();
                let options = keys.iter().filter_map(|k| client.get(k).map(|v| (*k, v)));
                match AppendConfig::from_options(&config.topic, options) {
                    Ok(append) => Some(append),
                    Err(unsupported) if path == BulkPath::Auto => {
                        tracing::debug!(%unsupported, "bulk producer: sending through librdkafka");
                        None
                    }
                    Err(unsupported) => return Err(ProduceError::Direct(unsupported.to_string())),
                }
            }
        };
        let path = match direct {
            Some(append) => Path::Direct {
                appender: Appender::start(append)
                    .map_err(|e| ProduceError::Direct(e.to_string()))?,
                on_delivery,
            },
            None => Path::Librdkafka(
                client
                    .create_with_context(Reports { on_delivery })
                    .map_err(ProduceError::Config)?,
            ),
        };
        Ok(Self {
            path,
            topic: config.topic.clone(),
            routing: config.routing,
            payload: Vec::with_capacity(128),
            unpolled: 0,
        })
    }

    /// Validates `event` and hands it to librdkafka; its outcome reaches the callback later with
    /// `token`. While librdkafka's queue is full it waits, handling delivery reports, so memory
    /// stays bounded and nothing is dropped. An `Err` means the event was not handed over (and
    /// will not be reported).
    pub fn send(&mut self, event: &EventRef<'_>, token: usize) -> Result<(), ProduceError> {
        event.validate()?;
        self.payload.clear();
        codec::encode_ref_into(event, &mut self.payload);
        let key = match self.routing {
            Routing::ByCounter => Some(event.counter.as_ref()),
            Routing::ByActor => Some(event.actor.as_deref().unwrap_or(&event.counter)),
            Routing::Random => None,
        };
        loop {
            let sent = match &self.path {
                Path::Direct { appender, .. } => {
                    match appender.append(key.map(str::as_bytes), &self.payload, token) {
                        Ok(()) => Ok(()),
                        Err(AppendError::Full) => Err(None),
                        Err(e) => Err(Some(ProduceError::Direct(e.to_string()))),
                    }
                }
                Path::Librdkafka(inner) => {
                    // No record timestamp: Kafka stamps when it was produced (see
                    // `Producer::enqueue`).
                    let mut record =
                        BaseRecord::<str, [u8], usize>::with_opaque_to(&self.topic, token)
                            .payload(&self.payload);
                    if let Some(key) = key {
                        record = record.key(key);
                    }
                    match inner.send(record) {
                        Ok(()) => Ok(()),
                        Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                            Err(None)
                        }
                        Err((e, _)) => Err(Some(ProduceError::Kafka(e))),
                    }
                }
            };
            match sent {
                Ok(()) => break,
                // Full: wait for room.
                Err(None) => self.poll(QUEUE_FULL_WAIT),
                Err(Some(e)) => return Err(e),
            }
        }
        self.unpolled += 1;
        if self.unpolled >= POLL_EVERY_SENDS {
            self.unpolled = 0;
            self.serve_reports();
        }
        Ok(())
    }

    /// Handles the delivery reports librdkafka has ready, then sleeps for `timeout` unless one
    /// was handled (a way to wait for room, or to pace sends).
    ///
    /// It never hands `timeout` to librdkafka: rust-rdkafka's `poll` loops until its deadline and
    /// asks librdkafka to wait in whole milliseconds rounded down, so the last millisecond of
    /// every wait (all of a 1 ms wait) was a busy loop of clock reads and empty polls, taking a
    /// core from the broker thread. Measured with `perf record -e cpu-clock` on `tally load
    /// --routing random`: 19% of the samples were `clock_gettime`, half of them in that loop.
    pub fn poll(&self, timeout: Duration) {
        if self.serve_reports() == 0 && !timeout.is_zero() {
            match &self.path {
                // Woken as soon as a report comes.
                Path::Direct { appender, .. } => appender.wait(timeout),
                Path::Librdkafka(_) => std::thread::sleep(timeout),
            }
        }
    }

    /// Handles the delivery reports librdkafka has ready, without waiting, and returns how many
    /// events they freed (reports arrive one produce request at a time, many events each).
    fn serve_reports(&self) -> u32 {
        let inner = match &self.path {
            Path::Direct {
                appender,
                on_delivery,
            } => return report(appender.completions(), on_delivery),
            Path::Librdkafka(inner) => inner,
        };
        let mut freed = 0;
        for _ in 0..MAX_REPORT_EVENTS {
            let before = inner.in_flight_count();
            inner.poll(Duration::ZERO);
            let after = inner.in_flight_count();
            if after >= before {
                break;
            }
            freed += u32::try_from(before - after).unwrap_or(0);
        }
        freed
    }

    /// Events handed over and not yet reported.
    pub fn in_flight(&self) -> usize {
        match &self.path {
            Path::Direct { appender, .. } => appender.in_flight(),
            Path::Librdkafka(inner) => usize::try_from(inner.in_flight_count()).unwrap_or(0),
        }
    }

    /// Waits until every event sent has been reported, for at most `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), ProduceError> {
        let appender = match &self.path {
            Path::Direct { appender, .. } => appender,
            Path::Librdkafka(inner) => return inner.flush(timeout).map_err(ProduceError::Kafka),
        };
        appender.send_now();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.serve_reports();
            if appender.in_flight() == 0 {
                // Everything answered; what was answered last is reported too.
                self.serve_reports();
                return Ok(());
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(ProduceError::Direct(format!(
                    "{} events not acknowledged within {timeout:?}",
                    appender.in_flight()
                )));
            }
            appender.wait(left.min(Duration::from_millis(100)));
        }
    }
}

/// Hands every event of `completions` to `on_delivery`; returns how many.
fn report<F>(completions: Vec<Completion>, on_delivery: &F) -> u32
where
    F: Fn(usize, Result<Delivered, ProduceError>),
{
    let mut reported = 0;
    for completion in completions {
        match completion {
            Completion::Written {
                partition,
                base_offset,
                tokens,
            } => {
                for (i, token) in tokens.into_iter().enumerate() {
                    let offset = if base_offset < 0 {
                        -1
                    } else {
                        base_offset + i as i64
                    };
                    on_delivery(token, Ok(Delivered { partition, offset }));
                    reported += 1;
                }
            }
            Completion::Failed { tokens, error } => {
                for token in tokens {
                    on_delivery(token, Err(ProduceError::Direct(error.clone())));
                    reported += 1;
                }
            }
        }
    }
    reported
}
