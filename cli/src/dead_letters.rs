//! The way back for dead letters: `tally dead-letters list` shows what the dead-letter topic
//! holds, by reason, source partition and time; `tally dead-letters replay` puts the original key
//! and bytes of the matching ones back on the topic they came from, once the cause is fixed.
//!
//! A replay moves forward in Kafka transactions: each carries a chunk of replayed events and the
//! replay group's offsets on the dead-letter topic past that chunk, committed together. A replay
//! that is killed leaves its open transaction to be aborted (the next run of the same group
//! fences it off when it starts, with the same `transactional.id`), and the aggregators read
//! committed events only, so each dead letter is replayed at most once per replay group however
//! often the command is killed and run again, and exactly once when a run completes.
//! Letters the filter leaves out are passed over for good by that group; a replay with another
//! filter takes another `--group`.
//!
//! A refused window bucket (its payload names `bucket_start_ms`) is listed but never replayed:
//! its counter's total took the same delta, so replaying it as an event would count it twice.

use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tally_aggregator::consume::dead_letter::headers;
use tally_ops::topic::{partition_logs, range_reader_config, read_ranges};

const KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

/// Which dead letters a command takes.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only these reasons (`tally-reason`); all when empty.
    pub reasons: Vec<String>,
    /// Only those read from this partition of the source topic.
    pub source_partition: Option<i32>,
    /// Only those dead-lettered at or after this time (Unix ms).
    pub since_ms: Option<i64>,
    /// Only those dead-lettered before this time (Unix ms).
    pub until_ms: Option<i64>,
}

impl Filter {
    /// Whether `letter` passes.
    pub fn matches(&self, letter: &Letter) -> bool {
        let at = letter.timestamp_ms.unwrap_or(0);
        (self.reasons.is_empty() || self.reasons.contains(&letter.reason))
            && self
                .source_partition
                .is_none_or(|p| letter.source_partition == Some(p))
            && self.since_ms.is_none_or(|since| at >= since)
            && self.until_ms.is_none_or(|until| at < until)
    }
}

/// One dead letter, as the aggregator wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Letter {
    /// Where it is on the dead-letter topic.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// When it was dead-lettered (the record's timestamp).
    pub timestamp_ms: Option<i64>,
    /// `tally-reason`.
    pub reason: String,
    /// `tally-error`.
    pub error: String,
    /// `tally-source-topic`.
    pub source_topic: Option<String>,
    /// `tally-source-partition`.
    pub source_partition: Option<i32>,
    /// `tally-source-offset`.
    pub source_offset: Option<i64>,
    /// The original key.
    pub key: Option<Vec<u8>>,
    /// The original bytes (for a refused delta: the summed delta as a JSON event).
    pub payload: Option<Vec<u8>>,
}

impl Letter {
    fn read(message: &BorrowedMessage<'_>) -> Self {
        let header = |name: &str| -> Option<String> {
            let headers = message.headers()?;
            let found = headers.iter().find(|h| h.key == name)?;
            Some(String::from_utf8_lossy(found.value?).into_owned())
        };
        Self {
            partition: message.partition(),
            offset: message.offset(),
            timestamp_ms: message.timestamp().to_millis(),
            reason: header(headers::REASON).unwrap_or_default(),
            error: header(headers::ERROR).unwrap_or_default(),
            source_topic: header(headers::SOURCE_TOPIC),
            source_partition: header(headers::SOURCE_PARTITION).and_then(|p| p.parse().ok()),
            source_offset: header(headers::SOURCE_OFFSET).and_then(|o| o.parse().ok()),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec),
        }
    }

    /// Whether it is a refused window bucket, which is never replayed: its payload names the
    /// bucket (`"bucket_start_ms"`), which no event may (an event with an unknown field is
    /// undecodable).
    pub fn is_window_bucket(&self) -> bool {
        let payload = self.payload.as_deref().unwrap_or_default();
        String::from_utf8_lossy(payload).contains("\"bucket_start_ms\"")
    }
}

fn consumer(kafka: &ClientConfig, group: &str) -> anyhow::Result<BaseConsumer> {
    let mut config = range_reader_config(kafka);
    config
        .set("group.id", group)
        .set("isolation.level", "read_committed");
    Ok(config.create()?)
}

/// Reads `[from, to)` of `partition` of the dead-letter `topic`.
fn read(
    consumer: &BaseConsumer,
    topic: &str,
    partition: i32,
    from: i64,
    to: i64,
) -> anyhow::Result<Vec<Letter>> {
    let mut letters = Vec::new();
    read_ranges(
        consumer,
        topic,
        &[(partition, from, to)],
        KAFKA_TIMEOUT,
        |m| {
            letters.push(Letter::read(m));
        },
    )
    .with_context(|| format!("reading {topic} partition {partition}"))?;
    Ok(letters)
}

/// Hands every dead letter of `topic` that `filter` passes to `each`, partition by partition in
/// offset order, up to the topic's end when the command started; returns how many.
pub fn list(
    kafka: &ClientConfig,
    topic: &str,
    filter: &Filter,
    mut each: impl FnMut(&Letter) -> std::io::Result<()>,
) -> anyhow::Result<usize> {
    let consumer = consumer(kafka, "tally-dead-letters-list")?;
    let logs = partition_logs(&consumer, topic, KAFKA_TIMEOUT)?;
    let mut listed = 0;
    for (p, log) in logs.iter().enumerate() {
        for letter in read(&consumer, topic, p as i32, log.start, log.end)? {
            if filter.matches(&letter) {
                each(&letter)?;
                listed += 1;
            }
        }
    }
    Ok(listed)
}

/// How a replay went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Dead letters put back on their source topic.
    pub replayed: usize,
    /// Dead letters the filter left out, now passed over by the group.
    pub passed_over: usize,
    /// Refused window buckets passed over (never replayed).
    pub window_buckets: usize,
}

/// A replay: the dead-letter topic, where to, and in which chunks.
#[derive(Debug, Clone)]
pub struct ReplaySpec {
    /// Kafka client settings (brokers, security).
    pub kafka: ClientConfig,
    /// The dead-letter topic.
    pub topic: String,
    /// The replay's consumer group: its committed offsets are the replay's progress.
    pub group: String,
    /// The topic to put them on; by default each one's source topic.
    pub to: Option<String>,
    /// Dead letters per transaction.
    pub chunk: usize,
}

/// Replays every dead letter of `spec.topic` past the group's progress that `filter` passes,
/// up to the topic's end when the command started.
pub fn replay(spec: &ReplaySpec, filter: &Filter) -> anyhow::Result<Replayed> {
    let consumer = consumer(&spec.kafka, &spec.group)?;
    let mut config = spec.kafka.clone();
    config
        .set("transactional.id", format!("{}-replay", spec.group))
        .set("enable.idempotence", "true")
        .set("acks", "all");
    let producer: BaseProducer = config.create()?;
    // Fences off an earlier run of the same group that was killed, aborting what it left open.
    producer.init_transactions(KAFKA_TIMEOUT)?;
    let metadata = consumer
        .group_metadata()
        .context("the replay consumer has no group metadata")?;
    let logs = partition_logs(&consumer, &spec.topic, KAFKA_TIMEOUT)?;
    let mut done = Replayed::default();
    let abort_after = failpoint_abort_after();
    for (p, log) in logs.iter().enumerate() {
        let p = p as i32;
        let mut from = log.committed.unwrap_or(log.start).max(log.start);
        while from < log.end {
            let to = (from + spec.chunk.max(1) as i64).min(log.end);
            let letters = read(&consumer, &spec.topic, p, from, to)?;
            producer.begin_transaction()?;
            for letter in &letters {
                if !filter.matches(letter) {
                    done.passed_over += 1;
                    continue;
                }
                if letter.is_window_bucket() {
                    done.window_buckets += 1;
                    continue;
                }
                let target = (spec.to.as_deref())
                    .or(letter.source_topic.as_deref())
                    .with_context(|| {
                        format!(
                            "dead letter {p}/{} names no source topic: give --to",
                            letter.offset
                        )
                    })?;
                let mut record = BaseRecord::<[u8], [u8]>::to(target);
                if let Some(key) = &letter.key {
                    record = record.key(key);
                }
                if let Some(payload) = &letter.payload {
                    record = record.payload(payload);
                }
                producer.send(record).map_err(|(e, _)| e)?;
                done.replayed += 1;
                if abort_after.is_some_and(|n| done.replayed >= n) {
                    eprintln!("failpoint: aborting in the middle of a replay transaction");
                    std::process::abort();
                }
            }
            let mut offsets = TopicPartitionList::new();
            offsets.add_partition_offset(&spec.topic, p, Offset::Offset(to))?;
            producer.send_offsets_to_transaction(&offsets, &metadata, KAFKA_TIMEOUT)?;
            producer.commit_transaction(KAFKA_TIMEOUT)?;
            from = to;
        }
    }
    Ok(done)
}

/// Test-only failpoint (`TALLY_FAILPOINT_REPLAY_ABORT_AFTER=n`): abort the process once `n`
/// letters were sent, inside their transaction, as a kill would.
fn failpoint_abort_after() -> Option<usize> {
    std::env::var("TALLY_FAILPOINT_REPLAY_ABORT_AFTER")
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(reason: &str, source_partition: i32, timestamp_ms: i64) -> Letter {
        Letter {
            partition: 0,
            offset: 0,
            timestamp_ms: Some(timestamp_ms),
            reason: reason.to_owned(),
            error: String::new(),
            source_topic: Some("tally.events".to_owned()),
            source_partition: Some(source_partition),
            source_offset: Some(7),
            key: None,
            payload: None,
        }
    }

    #[test]
    fn a_filter_takes_reasons_a_partition_and_a_time_range() {
        let any = Filter::default();
        assert!(any.matches(&letter("overflow", 3, 1_000)));
        let filter = Filter {
            reasons: vec!["overflow".to_owned(), "wrong_type".to_owned()],
            source_partition: Some(3),
            since_ms: Some(1_000),
            until_ms: Some(2_000),
        };
        assert!(filter.matches(&letter("overflow", 3, 1_000)));
        assert!(filter.matches(&letter("wrong_type", 3, 1_999)));
        assert!(!filter.matches(&letter("undecodable", 3, 1_500)));
        assert!(!filter.matches(&letter("overflow", 2, 1_500)));
        assert!(!filter.matches(&letter("overflow", 3, 999)));
        assert!(!filter.matches(&letter("overflow", 3, 2_000)));
    }

    #[test]
    fn a_refused_window_bucket_is_told_apart() {
        let mut bucket = letter("overflow", 0, 0);
        bucket.payload = Some(
            br#"{"bucket_start_ms":60000,"counter":"c","delta":5,"window_ms":60000}"#.to_vec(),
        );
        assert!(bucket.is_window_bucket());
        bucket.payload = Some(br#"{"counter":"c","delta":5}"#.to_vec());
        assert!(!bucket.is_window_bucket());
    }
}
