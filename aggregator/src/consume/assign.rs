//! Rebalances: new partitions get their state machine (exactly-once ones start paused,
//! acquiring); revoked ones, and every one at shutdown, are drained: in-flight work awaited,
//! buffers flushed, offsets committed, within a deadline.

use std::sync::PoisonError;
use std::time::{Instant, SystemTime};

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::consume::flush::Flusher;
use crate::machine::outcome::{FlushOutcome, Standing};
use crate::machine::partition::{Drain, NotDrained, Partition};
use crate::operator::config::Delivery;
use crate::store::sink::Sink;

use super::{Drained, Shared, Slot, Task, lock};

impl<S: Sink> Shared<S> {
    /// New partitions: each gets its state machine; exactly-once ones start paused, acquiring.
    pub(crate) fn assign<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        assigned: &TopicPartitionList,
    ) {
        let exactly_once = self.settings.delivery == Delivery::ExactlyOnce;
        // Chunks of the partitions positioned here reach the loop after this returns, so the
        // partitions have their slots by then.
        let mut epochs =
            (self.source).assigned(consumer, &self.settings.topic, assigned, exactly_once);
        let mut parts = lock(&self.partitions);
        let limits = self.limits();
        for element in assigned.elements_for_topic(&self.settings.topic) {
            let partition = element.partition();
            let generation = parts.next_generation;
            parts.next_generation += 1;
            let (machine, action) = Partition::assigned(
                partition,
                generation,
                exactly_once,
                self.settings.limits.flush_interval,
                Instant::now(),
                SystemTime::now(),
            );
            let mut slot = Slot {
                machine,
                task: None,
                acquiring: None,
                ids: None,
                epoch: epochs.remove(&partition).unwrap_or(0),
                truncated_to: None,
                held: None,
                limits,
            };
            if let Some(action) = action {
                self.execute(consumer, partition, &mut slot, action);
            }
            parts.map.insert(partition, slot);
        }
        tracing::info!(
            partitions = ?parts.map.keys().collect::<Vec<_>>(),
            "partitions assigned"
        );
    }

    /// The revoke callback's work: drain the revoked partitions and commit, before returning.
    pub(crate) fn revoke<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        revoked: &TopicPartitionList,
    ) {
        let taken: Vec<(i32, Slot)> = {
            let mut parts = lock(&self.partitions);
            (revoked.elements_for_topic(&self.settings.topic).iter())
                .filter_map(|e| parts.map.remove(&e.partition()).map(|s| (e.partition(), s)))
                .collect()
        };
        self.forget_ids(taken.iter().map(|(p, _)| *p));
        if taken.is_empty() {
            return;
        }
        for (partition, _) in &taken {
            self.metrics.released(*partition);
        }
        self.source
            .released(taken.iter().map(|(partition, _)| *partition));
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

    /// Partitions no longer owned: the decider no longer finds their ids.
    fn forget_ids(&self, partitions: impl Iterator<Item = i32>) {
        let mut registry = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        for partition in partitions {
            registry.remove(&partition);
        }
    }

    /// Shutdown: drains every partition (bounded by the shutdown timeout), commits, and stops
    /// every flush still retrying.
    pub(crate) async fn drain_all<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
    ) -> Drained {
        let taken: Vec<(i32, Slot)> = lock(&self.partitions).map.drain().collect();
        self.forget_ids(taken.iter().map(|(p, _)| *p));
        self.source
            .released(taken.iter().map(|(partition, _)| *partition));
        let deadline = Instant::now() + self.settings.shutdown_timeout;
        let drained = self.drain(taken, deadline).await;
        self.commit(consumer, &drained.commit, CommitMode::Sync);
        // Nothing may keep retrying past this point.
        self.hard_stop.cancel();
        drained
    }

    /// Waits for each partition's in-flight flush, then flushes its buffer, until `deadline`.
    pub(super) async fn drain(&self, taken: Vec<(i32, Slot)>, deadline: Instant) -> Drained {
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
        for (partition, slot) in taken {
            let flusher = self.flusher.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                let outcome = drain_one(&flusher, partition, slot, &cancel).await;
                (partition, outcome)
            });
        }
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((partition, Ok(durable))) => {
                    drained.drained += 1;
                    (drained.commit).extend(durable.map(|offset| (partition, offset)));
                }
                Ok((partition, Err(NotDrained))) => {
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
}

/// `task`'s output, or `otherwise` if it failed or `cancel` fired first (then it is aborted).
pub(super) async fn join_or<T>(
    mut task: JoinHandle<T>,
    cancel: &CancellationToken,
    otherwise: T,
) -> T {
    tokio::select! {
        joined = &mut task => joined.unwrap_or(otherwise),
        () = cancel.cancelled() => {
            task.abort();
            otherwise
        }
    }
}

/// Drains one partition: waits for its in-flight task, then flushes its buffer; the offset to
/// commit, if it flushed anything.
pub(super) async fn drain_one<S: Sink>(
    flusher: &Flusher<S>,
    partition: i32,
    slot: Slot,
    cancel: &CancellationToken,
) -> Result<Option<i64>, NotDrained> {
    if let Some(acquiring) = slot.acquiring {
        acquiring.abort();
    }
    let Drain::Work(mut draining) = slot.machine.into_drain() else {
        return Ok(None);
    };
    match slot.task {
        Some(Task::Flush(handle)) => {
            let outcome = join_or(handle, cancel, FlushOutcome::Cancelled).await;
            draining.on_flushed(outcome)?;
        }
        // A check that cannot finish found nothing wrong: the flush below asks again.
        Some(Task::Check(handle)) => {
            draining.on_checked(join_or(handle, cancel, Standing::Held).await)?;
        }
        None => {}
    }
    if let Some((batch, owner)) = draining.last_flush() {
        let outcome = flusher.flush(partition, batch, owner, cancel).await;
        draining.on_flushed(outcome)?;
    }
    Ok(draining.commit())
}
