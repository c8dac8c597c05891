//! `GET /v1/pipeline`: how far behind the log the counts are, per partition of tally's topic.
//!
//! For each partition: where its log starts and ends (Kafka's watermarks), where it is durable
//! (the watermark the aggregator stores in Redis with every exactly-once flush; in at-least-once
//! mode, the consumer group's committed offset), the lag in events between the two, and the lag
//! in seconds: the age of the oldest event not yet durable (its Kafka timestamp), read with a
//! consumer of the server's own that joins no group and commits nothing. Kafka calls are
//! blocking, so they run on Tokio's blocking pool, one request at a time, and an answer is
//! reused for [`FRESH_FOR`].

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde::Serialize;
use tally_common::event::now_ms;
use tally_ops::topic::partition_logs;
use utoipa::ToSchema;

use crate::error::ApiError;

/// How long an answer is reused.
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// Longest one Kafka request may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(3);

/// One partition's progress.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PartitionLag {
    /// The partition.
    partition: i32,
    /// The first offset the log still holds.
    log_start: i64,
    /// The offset after the last event in the log.
    log_end: i64,
    /// The offset before which every event is counted in Redis (`null`: nothing yet).
    durable: Option<i64>,
    /// Where `durable` comes from: `watermark` (exactly-once), `committed` (the group's
    /// committed offset) or `none`.
    source: &'static str,
    /// Events in the log not yet counted.
    lag_events: i64,
    /// Age of the oldest event not yet counted, in seconds (0 when caught up; `null` if it
    /// could not be read in time).
    lag_seconds: Option<f64>,
}

/// The pipeline's progress.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PipelineState {
    /// tally's topic.
    topic: String,
    /// The aggregators' consumer group.
    group: String,
    /// Per partition.
    partitions: Vec<PartitionLag>,
    /// Events not yet counted, over every partition.
    lag_events: i64,
    /// The largest partition lag in seconds.
    lag_seconds: Option<f64>,
}

/// The Kafka side of the pipeline route.
pub struct Pipeline {
    topic: String,
    group: String,
    consumer: Arc<Mutex<BaseConsumer>>,
    last: tokio::sync::Mutex<Option<(Instant, PipelineState)>>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// A reader of `topic`'s progress, for the aggregators' `group`; `kafka` holds the brokers
    /// and any security options.
    pub fn new(
        kafka: &ClientConfig,
        topic: &str,
        group: &str,
    ) -> Result<Self, rdkafka::error::KafkaError> {
        let mut config = kafka.clone();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "50");
        Ok(Self {
            topic: topic.to_owned(),
            group: group.to_owned(),
            consumer: Arc::new(Mutex::new(config.create()?)),
            last: tokio::sync::Mutex::new(None),
        })
    }

    /// The timestamps (ms) of the events at `at` (partition, offset), read within a deadline.
    fn timestamps(consumer: &BaseConsumer, topic: &str, at: &[(i32, i64)]) -> Vec<Option<i64>> {
        let mut found = vec![None; at.len()];
        if at.is_empty() {
            return found;
        }
        let mut tpl = TopicPartitionList::new();
        for &(p, offset) in at {
            if tpl
                .add_partition_offset(topic, p, Offset::Offset(offset))
                .is_err()
            {
                return found;
            }
        }
        if consumer.assign(&tpl).is_err() {
            return found;
        }
        let deadline = Instant::now() + KAFKA_TIMEOUT;
        while found.iter().any(Option::is_none) && Instant::now() < deadline {
            let Some(Ok(message)) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let slot = at
                .iter()
                .position(|&(p, o)| p == message.partition() && o == message.offset());
            if let (Some(i), Some(ts)) = (slot, message.timestamp().to_millis()) {
                found[i] = Some(ts);
            }
        }
        let _ = consumer.unassign();
        found
    }

    /// The pipeline's state now (or as read less than [`FRESH_FOR`] ago).
    pub async fn state(&self, reader: &tally_common::Reader) -> Result<PipelineState, ApiError> {
        let mut last = self.last.lock().await;
        if let Some((_, state)) = last.as_ref().filter(|(at, _)| at.elapsed() < FRESH_FOR) {
            return Ok(state.clone());
        }
        let (consumer, topic) = (self.consumer.clone(), self.topic.clone());
        let logs = tokio::task::spawn_blocking(move || {
            let consumer = consumer.lock().unwrap_or_else(PoisonError::into_inner);
            partition_logs(&consumer, &topic, KAFKA_TIMEOUT)
        })
        .await
        .map_err(ApiError::kafka)?
        .map_err(ApiError::kafka)?;
        let watermarks = reader
            .durable_offsets(&self.topic, logs.len() as i32)
            .await
            .map_err(ApiError::redis)?;
        let mut partitions: Vec<PartitionLag> = (0_i32..)
            .zip(logs.iter().zip(watermarks))
            .map(|(partition, (log, watermark))| {
                let (durable, source) = match (watermark, log.committed) {
                    (Some(w), _) => (Some(w), "watermark"),
                    (None, Some(c)) => (Some(c), "committed"),
                    (None, None) => (None, "none"),
                };
                let from = durable.unwrap_or(log.start).max(log.start);
                PartitionLag {
                    partition,
                    log_start: log.start,
                    log_end: log.end,
                    durable,
                    source,
                    lag_events: (log.end - from).max(0),
                    lag_seconds: Some(0.0),
                }
            })
            .collect();
        let behind: Vec<(i32, i64)> = (partitions.iter())
            .filter(|p| p.lag_events > 0)
            .map(|p| {
                (
                    p.partition,
                    p.durable.unwrap_or(p.log_start).max(p.log_start),
                )
            })
            .collect();
        let (consumer, topic, asked) = (self.consumer.clone(), self.topic.clone(), behind.clone());
        let stamps = tokio::task::spawn_blocking(move || {
            let consumer = consumer.lock().unwrap_or_else(PoisonError::into_inner);
            Self::timestamps(&consumer, &topic, &asked)
        })
        .await
        .map_err(ApiError::kafka)?;
        let now = now_ms();
        for ((partition, _), stamp) in behind.iter().zip(stamps) {
            partitions[*partition as usize].lag_seconds =
                stamp.map(|ts| (now - ts).max(0) as f64 / 1000.0);
        }
        let state = PipelineState {
            topic: self.topic.clone(),
            group: self.group.clone(),
            lag_events: partitions.iter().map(|p| p.lag_events).sum(),
            lag_seconds: partitions
                .iter()
                .map(|p| p.lag_seconds)
                .try_fold(0.0_f64, |max, s| s.map(|s| max.max(s))),
            partitions,
        };
        *last = Some((Instant::now(), state.clone()));
        Ok(state)
    }
}
