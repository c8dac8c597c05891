//! The dead-letter topic: where malformed messages go, with the reason, instead of blocking the
//! partition or vanishing.
//!
//! A malformed message (undecodable, invalid counter id, bad delta, oversized) is copied with its
//! original key and payload, plus headers naming the reason and where it came from:
//!
//! | header | value |
//! |---|---|
//! | `tally-reason` | the [`DeadLetterReason`]: `undecodable`, `oversized`, `invalid_counter`, `invalid_delta`, `invalid_field`, `missing_actor`, or Redis's refusal of a summed delta (`overflow`, `wrong_type`, `not_an_integer`, `rejected`) |
//! | `tally-error` | the full error message |
//! | `tally-source-topic`, `tally-source-partition`, `tally-source-offset` | where it was read |
//!
//! The copy travels with its partition's batch: the flush waits for Kafka to acknowledge it before
//! the partition's offset moves past the message, so a crash cannot lose it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use tally_common::DeadLetterReason;

use crate::machine::letter::DeadLetter;

/// Header names, shared with tests and tools that read the dead-letter topic.
pub mod headers {
    /// The fixed reason label.
    pub const REASON: &str = "tally-reason";
    /// The full error message.
    pub const ERROR: &str = "tally-error";
    /// Topic the message was read from.
    pub const SOURCE_TOPIC: &str = "tally-source-topic";
    /// Partition the message was read from.
    pub const SOURCE_PARTITION: &str = "tally-source-partition";
    /// Offset the message was read at.
    pub const SOURCE_OFFSET: &str = "tally-source-offset";
}

impl DeadLetter {
    #[cfg(test)]
    pub(crate) fn for_test(reason: DeadLetterReason) -> Self {
        Self {
            key: None,
            payload: Some(b"junk".to_vec()),
            reason,
            error: "test".to_owned(),
            partition: 0,
            offset: 0,
        }
    }
}

/// How often at most a reason's dead letters are logged.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The dead letters of one reason since its last log line.
#[derive(Debug, Default)]
struct Unlogged {
    /// When the reason was last logged.
    logged: Option<Instant>,
    /// How many went to the topic since.
    count: u64,
    /// The counter (the message's key) of the first of them.
    first: Option<String>,
}

/// Logs dead letters at warning level, one line per reason at most every `LOG_EVERY`, with
/// how many went since the last line and the first one's counter: a burst of malformed events
/// cannot flood the log, and none goes unmentioned for longer than that while more follow.
#[derive(Debug, Default)]
pub struct DeadLetterLog {
    reasons: Mutex<HashMap<DeadLetterReason, Unlogged>>,
}

impl DeadLetterLog {
    /// Records `letter`, sent; logs its reason's line if it is due.
    pub fn record(&self, letter: &DeadLetter) {
        self.record_at(letter, Instant::now());
    }

    /// [`DeadLetterLog::record`] at `now`; returns whether it logged.
    fn record_at(&self, letter: &DeadLetter, now: Instant) -> bool {
        let mut reasons = self.reasons.lock().unwrap_or_else(|e| e.into_inner());
        let unlogged = reasons.entry(letter.reason).or_default();
        unlogged.count += 1;
        let counter = || {
            (letter.key.as_deref()).map_or_else(
                || "(no key)".to_owned(),
                |k| String::from_utf8_lossy(k).into_owned(),
            )
        };
        let first = unlogged.first.get_or_insert_with(counter);
        if unlogged
            .logged
            .is_some_and(|at| now.duration_since(at) < LOG_EVERY)
        {
            return false;
        }
        tracing::warn!(
            reason = %letter.reason,
            count = unlogged.count,
            first_counter = %first,
            partition = letter.partition,
            offset = letter.offset,
            error = %letter.error,
            "dead-lettered {} event(s) since the last report of this reason",
            unlogged.count
        );
        *unlogged = Unlogged {
            logged: Some(now),
            ..Unlogged::default()
        };
        true
    }
}

/// Writes dead letters to their topic. Cheap to clone.
#[derive(Clone)]
pub struct DeadLetterQueue {
    /// An idempotent producer.
    producer: FutureProducer,
    /// The dead-letter topic.
    topic: String,
    /// The topic the aggregator consumes, for the source header.
    source_topic: String,
    /// What has been sent, for the log.
    log: Arc<DeadLetterLog>,
}

impl std::fmt::Debug for DeadLetterQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterQueue")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl DeadLetterQueue {
    /// A dead-letter writer to `topic`, with the consumer's Kafka settings (security etc.).
    pub fn new(base: &ClientConfig, topic: &str, source_topic: &str) -> Result<Self, KafkaError> {
        let mut config = base.clone();
        config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5");
        // Consumer-only options would make the producer warn; drop them.
        for key in [
            "group.id",
            "enable.auto.commit",
            "auto.offset.reset",
            "enable.auto.offset.store",
            "group.instance.id",
            "group.protocol",
            "group.remote.assignor",
            "partition.assignment.strategy",
            "session.timeout.ms",
            "heartbeat.interval.ms",
            "max.poll.interval.ms",
            "queued.min.messages",
            "fetch.max.bytes",
            "enable.partition.eof",
        ] {
            config.remove(key);
        }
        Ok(Self {
            producer: config.create()?,
            topic: topic.to_owned(),
            source_topic: source_topic.to_owned(),
            log: Arc::default(),
        })
    }

    /// Copies one dead letter to the topic and waits for Kafka's acknowledgement.
    pub async fn send(&self, letter: &DeadLetter) -> Result<(), KafkaError> {
        let partition = letter.partition.to_string();
        let offset = letter.offset.to_string();
        let headers = OwnedHeaders::new()
            .insert(header(headers::REASON, letter.reason.as_str()))
            .insert(header(headers::ERROR, &letter.error))
            .insert(header(headers::SOURCE_TOPIC, &self.source_topic))
            .insert(header(headers::SOURCE_PARTITION, &partition))
            .insert(header(headers::SOURCE_OFFSET, &offset));
        let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
        if let Some(key) = &letter.key {
            record = record.key(key);
        }
        if let Some(payload) = &letter.payload {
            record = record.payload(payload);
        }
        self.producer
            .send(record, Timeout::Never)
            .await
            .map_err(|(e, _)| e)?;
        self.log.record(letter);
        Ok(())
    }

    /// Appends `records` (`(key, payload)`: expiry records, `crate::tasks::expiry`) to `partition` of
    /// the consumed topic, all in flight at once, and waits for Kafka's acknowledgement of each;
    /// returns the offset of the last one.
    pub async fn append(
        &self,
        partition: i32,
        records: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<Option<i64>, KafkaError> {
        let mut deliveries = Vec::with_capacity(records.len());
        for (key, payload) in records {
            let record = FutureRecord::<[u8], [u8]>::to(&self.source_topic)
                .partition(partition)
                .key(key)
                .payload(payload);
            deliveries.push(self.producer.send_result(record).map_err(|(e, _)| e)?);
        }
        let mut last = None;
        for delivery in deliveries {
            let delivered = delivery
                .await
                .map_err(|_| KafkaError::Canceled)?
                .map_err(|(e, _)| e)?;
            last = last.max(Some(delivered.offset));
        }
        Ok(last)
    }

    /// Where `partition` of the consumed topic starts and ends (its low and high watermarks),
    /// asked of the brokers: the dead-letter producer is also the aggregator's client for such
    /// questions, off the consume loop. `None` if the brokers did not answer within 5 s.
    pub async fn watermarks(&self, partition: i32) -> Option<(i64, i64)> {
        let producer = self.producer.clone();
        let topic = self.source_topic.clone();
        let asked = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_watermarks(&topic, partition, Duration::from_secs(5))
        })
        .await;
        match asked {
            Ok(Ok(watermarks)) => Some(watermarks),
            Ok(Err(error)) => {
                tracing::debug!(partition, %error, "could not read the partition's watermarks");
                None
            }
            Err(_) => None,
        }
    }
}

fn header<'a>(key: &'a str, value: &'a str) -> Header<'a, &'a str> {
    Header {
        key,
        value: Some(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_is_logged_at_most_every_ten_seconds_with_what_came_since() {
        let log = DeadLetterLog::default();
        let t0 = Instant::now();
        let letter = DeadLetter::for_test(DeadLetterReason::Overflow);
        let other = DeadLetter::for_test(DeadLetterReason::Undecodable);
        assert!(log.record_at(&letter, t0));
        assert!(!log.record_at(&letter, t0 + Duration::from_secs(1)));
        assert!(!log.record_at(&letter, t0 + Duration::from_secs(9)));
        // Another reason has its own clock.
        assert!(log.record_at(&other, t0 + Duration::from_secs(9)));
        let count = |reason| log.reasons.lock().expect("not poisoned")[&reason].count;
        assert_eq!(count(DeadLetterReason::Overflow), 2);
        assert!(log.record_at(&letter, t0 + Duration::from_secs(10)));
        assert_eq!(count(DeadLetterReason::Overflow), 0);
    }
}
