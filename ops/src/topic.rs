//! Reading tally's topic outside the consume loop, with consumers of their own that join no
//! group: where each partition's log starts and ends and the aggregators' committed offset
//! ([`partition_logs`], for the API server's pipeline route and `tally audit`), the first offset
//! stamped at or after a time ([`offsets_at_time`]), and ranges of offsets read to their end
//! ([`read_ranges`], for the audit and the idempotency warm-up).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

/// One partition of the topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionLog {
    /// The first offset the log still holds.
    pub start: i64,
    /// The offset after its last message.
    pub end: i64,
    /// The consumer group's committed offset, if it has one.
    pub committed: Option<i64>,
}

/// Why the topic could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    /// Kafka failed or timed out.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// No such topic (or one without partitions).
    #[error("topic {0} does not exist")]
    Missing(String),
}

/// `base` set up to read ranges of a log with [`read_ranges`]: end-of-partition events, no
/// offsets committed or stored, and fetches neither held at the broker for long nor put off by
/// the client. librdkafka puts off a partition's next fetch for `fetch.queue.backoff.ms`
/// (1 s by default) whenever its queue holds `queued.min.messages`, which a reader of a
/// backlog reaches at every fetch: 4,000,000 small events took an aggregator's 8 idempotency
/// warm-ups 4.8-5.0 s to read at the default with the machine three quarters idle, 2.1 s at 10 ms.
pub fn range_reader_config(base: &ClientConfig) -> ClientConfig {
    let mut config = base.clone();
    config
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "50")
        .set("fetch.queue.backoff.ms", "10");
    config
}

/// Every partition of `topic`, in order, with the committed offsets of `consumer`'s group.id;
/// each Kafka request waits at most `timeout`.
pub fn partition_logs(
    consumer: &BaseConsumer,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<PartitionLog>, TopicError> {
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions = (metadata.topics().first())
        .filter(|t| t.error().is_none())
        .map(|t| t.partitions().len() as i32)
        .filter(|n| *n > 0)
        .ok_or_else(|| TopicError::Missing(topic.to_owned()))?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    (0..partitions)
        .map(|p| {
            let (start, end) = consumer.fetch_watermarks(topic, p, timeout)?;
            let committed = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            };
            Ok(PartitionLog {
                start,
                end,
                committed,
            })
        })
        .collect()
}

/// Each of `partitions`' first offset whose Kafka timestamp is `ms` or later, in the same order
/// (`None` where no message is stamped that late).
pub fn offsets_at_time(
    consumer: &BaseConsumer,
    topic: &str,
    partitions: &[i32],
    ms: i64,
    timeout: Duration,
) -> Result<Vec<Option<i64>>, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        tpl.add_partition_offset(topic, p, Offset::Offset(ms.max(0)))?;
    }
    let found = consumer.offsets_for_times(tpl, timeout)?;
    Ok(partitions
        .iter()
        .map(
            |&p| match found.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            },
        )
        .collect())
}

/// Reads `[from, to)` of each `(partition, from, to)` and hands every message to `each`, in
/// offset order per partition; a partition is done at `to` or at the end of its log. Fails if
/// nothing the read still waits for arrives for `stall` (counted from the first poll that came
/// back empty after the last message, at most one poll of 100 ms after it). `consumer` must have
/// `enable.partition.eof` set, as [`range_reader_config`] does.
pub fn read_ranges(
    consumer: &BaseConsumer,
    topic: &str,
    ranges: &[(i32, i64, i64)],
    stall: Duration,
    mut each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<(), KafkaError> {
    let mut tpl = TopicPartitionList::new();
    let mut waiting = HashMap::new();
    for &(p, from, to) in ranges.iter().filter(|(_, from, to)| from < to) {
        tpl.add_partition_offset(topic, p, Offset::Offset(from))?;
        waiting.insert(p, to);
    }
    consumer.assign(&tpl)?;
    let (mut progress, mut progressed) = (Instant::now(), false);
    while !waiting.is_empty() {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(message)) => {
                let p = message.partition();
                let Some(&to) = waiting.get(&p) else {
                    continue;
                };
                progressed = true;
                if message.offset() < to {
                    each(&message);
                }
                if message.offset() + 1 >= to {
                    waiting.remove(&p);
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                waiting.remove(&p);
            }
            Some(Err(e)) => return Err(e),
            // The clock is read when a poll comes back empty, not at every message (a
            // seventh of a warm-up's thread was spent reading it).
            None if progressed => {
                (progress, progressed) = (Instant::now(), false);
            }
            None if progress.elapsed() > stall => {
                tracing::warn!(partitions = ?waiting.keys().collect::<Vec<_>>(), ?stall, "reading the topic stalled");
                return Err(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::OperationTimedOut,
                ));
            }
            None => {}
        }
    }
    consumer.unassign()
}
