//! Rebalances and draining: the consumer's context, and what happens to partitions when they
//! come and go.
//!
//! The revoke callback runs synchronously inside the consumer's poll (see `crate::consume`):
//! before it returns it waits for the revoked partitions' in-flight flushes, flushes what is left
//! in their buffers, and commits their offsets, bounded by `revoke_timeout`; what is not durable
//! by then is not committed and is read again by the next owner. Shutdown uses the same
//! `Shared::drain`. On assignment, exactly-once partitions start paused while their fences are
//! stamped; at-least-once ones start fetching at once.

use std::time::{Instant, SystemTime};

use rdkafka::TopicPartitionList;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::statistics::Statistics;
use tokio::task::JoinSet;

use crate::batch::{Batch, FlushClock};
use crate::config::Delivery;
use crate::consume::{Ownership, Partition, Shared, lock};
use crate::flush::FlushOutcome;
use crate::sink::Sink;

/// The consumer's context: rebalance hooks, statistics, logs.
pub struct AggregatorContext<S> {
    /// The state the consume loop shares with these callbacks.
    pub(crate) shared: std::sync::Arc<Shared<S>>,
}

impl<S> std::fmt::Debug for AggregatorContext<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AggregatorContext")
    }
}

/// What a drain achieved.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    /// Partitions whose buffered work all became durable (or that had none).
    pub(crate) drained: usize,
    /// The offsets to commit for them: `(partition, next_offset)`, for those that flushed anything.
    pub(crate) commit: Vec<(i32, i64)>,
    /// Partitions left with work that is not durable: nothing is committed for them.
    pub(crate) not_drained: Vec<i32>,
}

impl<S: Sink> Shared<S> {
    /// Waits for each partition's in-flight flush, then flushes its buffer, until `deadline`.
    pub(crate) async fn drain(&self, taken: Vec<(i32, Partition)>, deadline: Instant) -> Drained {
        let mut drained = Drained::default();
        if taken.is_empty() {
            return drained;
        }
        let cancel = self.hard_stop.child_token();
        let timer = {
            let cancel = cancel.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(deadline.into()).await;
                cancel.cancel();
            })
        };
        let mut tasks = JoinSet::new();
        for (partition, mut st) in taken {
            let flusher = self.flusher.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                let mut owner = match st.state {
                    Ownership::Unfenced => None,
                    Ownership::Owned(owner) => Some(owner),
                    Ownership::Acquiring(task) => {
                        // Not positioned yet: nothing was buffered, nothing to commit.
                        task.abort();
                        return (partition, Ok(None));
                    }
                    Ownership::Fenced => return (partition, Ok(None)),
                };
                let mut durable = None;
                if let Some(mut in_flight) = st.in_flight.take() {
                    let outcome = tokio::select! {
                        joined = &mut in_flight.handle => joined.unwrap_or(FlushOutcome::Cancelled),
                        () = cancel.cancelled() => {
                            in_flight.handle.abort();
                            FlushOutcome::Cancelled
                        }
                    };
                    match outcome {
                        FlushOutcome::Durable {
                            next_offset,
                            owner: after,
                        } => {
                            durable = Some(next_offset);
                            owner = after.or(owner);
                        }
                        // A check of an idle partition, not a flush: nothing to commit.
                        FlushOutcome::Verified => {}
                        // Committing the buffer behind it would skip the lost batch: stop here.
                        FlushOutcome::Cancelled
                        | FlushOutcome::Fenced
                        | FlushOutcome::RolledBack => return (partition, Err(())),
                    }
                }
                if let Some(batch) = st.buffer.seal() {
                    match flusher.flush(partition, batch, owner, &cancel).await {
                        FlushOutcome::Durable { next_offset, .. } => durable = Some(next_offset),
                        FlushOutcome::Verified => {}
                        FlushOutcome::Cancelled
                        | FlushOutcome::Fenced
                        | FlushOutcome::RolledBack => return (partition, Err(())),
                    }
                }
                (partition, Ok(durable))
            });
        }
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((partition, Ok(durable))) => {
                    drained.drained += 1;
                    drained
                        .commit
                        .extend(durable.map(|offset| (partition, offset)));
                }
                Ok((partition, Err(()))) => {
                    tracing::warn!(
                        partition,
                        "partition not drained before the deadline; its uncommitted events will be read again"
                    );
                    drained.not_drained.push(partition);
                }
                Err(error) => tracing::error!(%error, "drain task failed"),
            }
        }
        timer.abort();
        drained
    }

    /// The revoke callback's work: drain the revoked partitions and commit, before returning.
    fn revoke(&self, consumer: &BaseConsumer<AggregatorContext<S>>, revoked: &TopicPartitionList) {
        let taken: Vec<(i32, Partition)> = {
            let mut parts = lock(&self.partitions);
            revoked
                .elements_for_topic(&self.settings.topic)
                .iter()
                .filter_map(|e| {
                    parts
                        .map
                        .remove(&e.partition())
                        .map(|st| (e.partition(), st))
                })
                .collect()
        };
        if taken.is_empty() {
            return;
        }
        for (partition, _) in &taken {
            self.metrics.released(*partition);
        }
        let count = taken.len();
        let deadline = Instant::now() + self.settings.revoke_timeout;
        let durable =
            tokio::task::block_in_place(|| self.runtime.block_on(self.drain(taken, deadline)));
        self.commit(consumer, &durable.commit, CommitMode::Sync);
        tracing::info!(
            revoked = count,
            drained = durable.drained,
            "partitions revoked"
        );
    }

    fn assign(&self, consumer: &BaseConsumer<AggregatorContext<S>>, assigned: &TopicPartitionList) {
        let exactly_once = self.settings.delivery == Delivery::ExactlyOnce;
        // librdkafka keeps an application pause across revoke and re-assign, so set it
        // explicitly: at-least-once partitions start fetching; exactly-once ones wait, paused,
        // until their fences are stamped and their position is known.
        let paused = if exactly_once {
            consumer.pause(assigned)
        } else {
            consumer.resume(assigned)
        };
        if let Err(error) = paused {
            tracing::warn!(%error, "pausing/resuming newly assigned partitions failed");
        }
        let mut parts = lock(&self.partitions);
        for element in assigned.elements_for_topic(&self.settings.topic) {
            let partition = element.partition();
            let generation = parts.next_generation;
            parts.next_generation += 1;
            let state = if exactly_once {
                Ownership::Acquiring(self.spawn_acquire(partition, generation))
            } else {
                Ownership::Unfenced
            };
            parts.map.insert(
                partition,
                Partition {
                    generation,
                    state,
                    buffer: Batch::default(),
                    clock: FlushClock::new(
                        self.settings.limits.flush_interval,
                        partition,
                        Instant::now(),
                        SystemTime::now(),
                    ),
                    in_flight: None,
                    paused: false,
                    confirmed: Instant::now(),
                    read_to: None,
                    log_end: None,
                    reading: false,
                },
            );
        }
        tracing::info!(
            partitions = ?parts.map.keys().collect::<Vec<_>>(),
            "partitions assigned"
        );
    }
}

impl<S: Sink> ClientContext for AggregatorContext<S> {
    fn stats(&self, statistics: Statistics) {
        let partitions = statistics
            .topics
            .get(&self.shared.settings.topic)
            .into_iter()
            .flat_map(|t| t.partitions.iter())
            .filter(|(p, _)| **p >= 0);
        // A report without the topic (no partition owned) clears the lag gauge.
        let lags = partitions
            .clone()
            .filter(|(_, s)| s.consumer_lag >= 0)
            .map(|(p, s)| (*p, s.consumer_lag));
        self.shared.metrics.consumer_lag(lags);
        // Where each owned partition's log ends, for its pace: the last stable offset (what a
        // read_committed consumer can read), the high watermark where that is unknown. A
        // partition not fetched yet reports neither; it keeps the end read at its acquisition.
        let mut parts = lock(&self.shared.partitions);
        for (partition, stats) in partitions {
            let end = if stats.ls_offset >= 0 {
                stats.ls_offset
            } else {
                stats.hi_offset
            };
            if let Some(st) = parts.map.get_mut(partition).filter(|_| end >= 0) {
                st.log_end = Some(end);
            }
        }
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", fac, "{log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "Kafka client error");
    }
}

impl<S: Sink> ConsumerContext for AggregatorContext<S> {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            self.shared.revoke(consumer, revoked);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let metrics = &self.shared.metrics;
        match rebalance {
            Rebalance::Assign(assigned) => {
                self.shared.assign(consumer, assigned);
                metrics.group_membership(true);
            }
            // A revoke in a rebalance keeps the membership; a lost assignment (session timeout,
            // max.poll.interval.ms exceeded) does not.
            Rebalance::Revoke(_) => {
                if consumer.assignment_lost() {
                    metrics.group_membership(false);
                }
            }
            Rebalance::Error(error) => {
                metrics.group_membership(false);
                tracing::error!(%error, "rebalance failed");
            }
        }
    }
}
