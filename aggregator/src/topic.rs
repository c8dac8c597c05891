//! What Kafka says of tally's topic, per partition: where its log starts and ends, and the
//! aggregators' committed offset. The API server's pipeline route and `tally audit` read it with
//! consumers of their own that join no group.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};

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
