//! [`BulkProducer`]: fire-and-forget sends with a delivery callback, for bulk traffic.
//!
//! [`Producer`](crate::Producer) gives every event its own acknowledgement future, which is what
//! a request handler wants but costs an allocation, a channel and a wake-up per event. A job
//! that appends millions of events (a backfill, an import, the load generator) wants librdkafka's
//! own model instead: hand the event over with a caller-chosen `usize` token, and hear about its
//! fate later in one callback. Nothing is lost silently: every event handed over is reported
//! exactly once, as [`Delivered`] or as an error, by the time [`BulkProducer::flush`] returns.
//!
//! The producer is driven by its owner's thread: delivery reports are handled inside
//! [`BulkProducer::send`], [`BulkProducer::poll`] and [`BulkProducer::flush`], so the callback
//! runs on that thread and no background thread competes for the CPU. The callback is `Fn`
//! (librdkafka contexts are shared); keep its state in atomics or a mutex. Use it from a blocking
//! thread (`tokio::task::spawn_blocking`), never on an async worker.

use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext};
use tally_common::codec::{self, EventRef};

use crate::kafka::{Delivered, ProduceError, ProducerConfig, Routing};

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

/// Appends events without a future per event; each outcome goes to one callback with the token
/// given at send time. See the module documentation.
pub struct BulkProducer<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    /// The librdkafka producer, polled by the owner.
    inner: BaseProducer<Reports<F>>,
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
        f.debug_struct("BulkProducer")
            .field("topic", &self.topic)
            .field("routing", &self.routing)
            .finish_non_exhaustive()
    }
}

impl<F> BulkProducer<F>
where
    F: Fn(usize, Result<Delivered, ProduceError>) + Send + Sync + 'static,
{
    /// Creates a bulk producer with the same librdkafka settings as [`Producer`](crate::Producer)
    /// (idempotent, `acks=all`) except a longer linger, [`BULK_LINGER_MS`] unless the config sets
    /// `linger.ms`; `on_delivery` hears about every event sent.
    pub fn new(config: &ProducerConfig, on_delivery: F) -> Result<Self, ProduceError> {
        let mut client = config.client_config();
        if !config.options.contains_key("linger.ms") {
            client.set("linger.ms", BULK_LINGER_MS);
        }
        let inner = client
            .create_with_context(Reports { on_delivery })
            .map_err(ProduceError::Config)?;
        Ok(Self {
            inner,
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
            // No record timestamp: Kafka stamps when it was produced (see `Producer::enqueue`).
            let mut record = BaseRecord::<str, [u8], usize>::with_opaque_to(&self.topic, token)
                .payload(&self.payload);
            if let Some(key) = key {
                record = record.key(key);
            }
            match self.inner.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    self.poll(QUEUE_FULL_WAIT);
                }
                Err((e, _)) => return Err(ProduceError::Kafka(e)),
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
            std::thread::sleep(timeout);
        }
    }

    /// Handles the delivery reports librdkafka has ready, without waiting, and returns how many
    /// events they freed (reports arrive one produce request at a time, many events each).
    fn serve_reports(&self) -> u32 {
        let mut freed = 0;
        for _ in 0..MAX_REPORT_EVENTS {
            let before = self.inner.in_flight_count();
            self.inner.poll(Duration::ZERO);
            let after = self.inner.in_flight_count();
            if after >= before {
                break;
            }
            freed += u32::try_from(before - after).unwrap_or(0);
        }
        freed
    }

    /// Events handed over and not yet reported.
    pub fn in_flight(&self) -> usize {
        usize::try_from(self.inner.in_flight_count()).unwrap_or(0)
    }

    /// Waits until every event sent has been reported, for at most `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), ProduceError> {
        self.inner.flush(timeout).map_err(ProduceError::Kafka)
    }
}
