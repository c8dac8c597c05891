//! The state machines' actions carried out: ticks, task reports, flush and check tasks,
//! acquisitions, seeks, pauses and offset commits.

use std::sync::{Arc, PoisonError};
use std::time::Instant;

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};
use tokio::task::JoinHandle;

use crate::machine::outcome::{FlushOutcome, Standing};
use crate::machine::ownership::Resume;
use crate::machine::pace::Pace;
use crate::machine::partition::Action;
use crate::store::fence;
use crate::store::sink::Sink;
use tally_kafka::backoff::Backoff;

use super::{Done, Ids, Outdated, RecentIds, Report, Shared, Slot, Task, lock, warm_up_ids};

impl<S: Sink> Shared<S> {
    /// Starts flushes of due buffers and checks of idle owners, and refreshes the buffer and
    /// idempotency gauges.
    pub(crate) fn tick<X: ConsumerContext, K: Consumer<X>>(&self, consumer: &K) {
        let now = Instant::now();
        let mut parts = lock(&self.partitions);
        let (mut buffered, mut paused, mut catching_up) = (0, 0, 0);
        let (mut ids_held, mut id_bytes) = (0, 0);
        let (version, write, _) = self.plan.get();
        let original = self.settings.keyspace.groups();
        let limits = self.limits();
        for (&partition, slot) in parts.map.iter_mut() {
            slot.limits = limits;
            for action in slot.machine.on_regrouped(write, version, original) {
                tracing::info!(
                    partition,
                    groups = write,
                    "re-grouped: taking the partition again"
                );
                self.execute(consumer, partition, slot, action);
            }
            let (pace, action) =
                (slot.machine).on_tick(&limits, self.settings.check_idle_interval, now);
            if let Some(action) = action {
                self.execute(consumer, partition, slot, action);
            }
            catching_up += usize::from(pace == Pace::CatchingUp);
            buffered += slot.machine.pending_events();
            paused += usize::from(slot.machine.paused);
            if let Some(ids) = &slot.ids {
                let (held, bytes) = ids.sizes();
                ids_held += held;
                id_bytes += bytes;
            }
        }
        self.metrics
            .buffers(buffered, parts.map.len(), paused, catching_up);
        self.metrics.idempotency_tables(ids_held, id_bytes);
        self.metrics.fetch_requests(self.source.fetch_requests());
        if let Some(c) = self.flusher.sink.recall_counts() {
            (self.metrics).cells_recall(c.predicted_writes, c.mispredicted_writes, c.fields);
        }
    }

    /// A task reported back.
    pub(crate) fn report<X: ConsumerContext, K: Consumer<X>>(&self, consumer: &K, report: Report) {
        let Report {
            partition,
            generation,
            done,
        } = report;
        let mut parts = lock(&self.partitions);
        let Some(slot) = parts.map.get_mut(&partition) else {
            return;
        };
        if slot.machine.generation != generation {
            // A report from an earlier ownership, already handled by the revoke.
            return;
        }
        let (limits, now) = (slot.limits, Instant::now());
        let actions = match done {
            Done::Flushed(outcome) => {
                slot.task = None;
                slot.machine.on_flushed(outcome, &limits, now)
            }
            Done::Checked(standing) => {
                slot.task = None;
                slot.machine.on_checked(standing, &limits, now)
            }
            Done::Acquired {
                owner,
                resume,
                log_end,
                ids,
                rewound,
            } => {
                slot.acquiring = None;
                self.install_ids(partition, slot, ids);
                if let Some((to, past)) = rewound.filter(|(_, past)| *past > 0) {
                    self.metrics.truncated_applied(past);
                    tracing::error!(
                        partition,
                        truncated_at = to,
                        applied_to = to + past,
                        "events the log no longer holds had been applied before its truncation: their counts stay; the ledgers moved back, so the new leader's records from the truncation point on are counted"
                    );
                }
                tracing::info!(partition, epoch = owner.epoch, ?resume, "partition owned");
                vec![slot.machine.on_acquired(owner, resume, log_end)]
            }
        };
        for action in actions {
            self.execute(consumer, partition, slot, action);
        }
    }

    /// Carries out one of a partition's actions.
    pub(super) fn execute<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        slot: &mut Slot,
        action: Action,
    ) {
        let generation = slot.machine.generation;
        match action {
            Action::Flush { batch, owner } => {
                let flusher = self.flusher.clone();
                let cancel = self.hard_stop.clone();
                let done_tx = self.done_tx.clone();
                let outdated = self.outdated.clone();
                let home = owner.as_ref().map(|owner| owner.home);
                slot.task = Some(Task::Flush(tokio::spawn(async move {
                    // In the task, not the consume loop: feeding the sketches costs a hash per
                    // counter.
                    let trending = flusher.trending.as_ref();
                    let warm = trending.map(|t| t.observe(&batch)).unwrap_or_default();
                    let outcome = flusher.flush(partition, batch, owner, &cancel).await;
                    if let (FlushOutcome::Fenced, Some(home)) = (&outcome, home) {
                        check_moved(&flusher.sink, home, &outdated).await;
                    }
                    // The loop may be gone (shutdown); the outcome is also the task's output.
                    let _ = done_tx.send(Report {
                        partition,
                        generation,
                        done: Done::Flushed(outcome.clone()),
                    });
                    if let (FlushOutcome::Durable { .. }, Some(trending)) = (&outcome, trending)
                        && !warm.is_empty()
                    {
                        trending.warm(&warm).await;
                    }
                    outcome
                })));
            }
            Action::Check(owner) => {
                let flusher = self.flusher.clone();
                let done_tx = self.done_tx.clone();
                let outdated = self.outdated.clone();
                slot.task = Some(Task::Check(tokio::spawn(async move {
                    let standing = flusher.verify(partition, &owner).await;
                    if standing == Standing::Fenced {
                        check_moved(&flusher.sink, owner.home, &outdated).await;
                    }
                    let _ = done_tx.send(Report {
                        partition,
                        generation,
                        done: Done::Checked(standing),
                    });
                    standing
                })));
            }
            Action::Commit(next_offset) => self.durable(consumer, partition, next_offset),
            Action::Pause => {
                slot.held = None;
                self.set_paused(consumer, partition, slot, true);
            }
            Action::Hold => {
                let topic = &self.settings.topic;
                if (self.source).hold(consumer, topic, partition, &mut slot.epoch) {
                    slot.held.get_or_insert_default();
                }
            }
            Action::Resume => {
                // What was held is read first; if that fills the buffer again, the partition
                // is held again and its fetching stays paused.
                self.read_held(consumer, slot);
                if slot.held.is_none() {
                    self.set_paused(consumer, partition, slot, false);
                }
            }
            Action::Acquire => {
                let truncated_to = slot.truncated_to.take();
                slot.acquiring = Some(self.spawn_acquire(partition, generation, truncated_to));
            }
            Action::Seek(resume) => {
                slot.held = None;
                let topic = &self.settings.topic;
                let epoch = &mut slot.epoch;
                let mut seek = || {
                    let sought = (self.source).seek(consumer, topic, partition, resume, epoch);
                    (sought, *epoch)
                };
                // With idempotency keys, the decider decides the new epoch's chunks from
                // `resume` on.
                let sought = match slot.ids.clone() {
                    Some(ids) => ids.positioned(resume, seek),
                    None => seek().0,
                };
                let next = slot.machine.on_seek(sought, Instant::now());
                self.execute(consumer, partition, slot, next);
            }
        }
    }

    /// A flush up to `next_offset` is durable: commit it.
    pub(super) fn durable<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        next_offset: i64,
    ) {
        if let Some(limit) = self.settings.crash_after_flushes {
            let n = self
                .flushes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            if n >= limit {
                eprintln!("failpoint: aborting after {n} durable flushes, before committing");
                std::process::abort();
            }
        }
        self.commit(consumer, &[(partition, next_offset)], CommitMode::Async);
        self.metrics.durable(partition, next_offset);
    }

    /// Starts acquiring exactly-once ownership of `partition`, retrying until it succeeds; the
    /// result comes back as a [`Report`] of [`Done::Acquired`].
    /// `truncated_to`: the log was truncated there under the partition's position, and the
    /// ledgers past it are moved back to it.
    pub(super) fn spawn_acquire(
        &self,
        partition: i32,
        generation: u64,
        truncated_to: Option<i64>,
    ) -> JoinHandle<()> {
        let sink = self.flusher.sink.clone();
        let dead_letters = self.flusher.dead_letters.clone();
        let keyspace = self.settings.keyspace.clone();
        let spread = self.settings.partition_spread;
        let topic = self.settings.topic.clone();
        let metrics = self.metrics.clone();
        let done_tx = self.done_tx.clone();
        let (initial, max) = (self.flusher.retry_initial, self.flusher.retry_max);
        let warm_up = self.warm_up.clone();
        let outdated = self.outdated.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(initial, max);
            loop {
                let acquired = fence::acquire(&sink, &keyspace, &topic, partition, spread).await;
                let acquired = match (acquired, truncated_to) {
                    (Ok((mut owner, resume)), Some(to)) => {
                        match fence::rewind(&sink, &mut owner, to).await {
                            Ok(past) => {
                                let resume = match resume {
                                    Resume::At(at) if at > to => Resume::At(to),
                                    resume => resume,
                                };
                                Ok((owner, resume, Some((to, past))))
                            }
                            Err(e) => Err(e),
                        }
                    }
                    (acquired, _) => acquired.map(|(owner, resume)| (owner, resume, None)),
                };
                match acquired {
                    Ok((owner, resume, rewound)) => {
                        // Where the log starts and ends: its end sets the partition's pace
                        // from the first message (statistics come a second later). Seek to its
                        // first offset rather than to the logical beginning: librdkafka is
                        // already resolving the group's starting offset, and a seek to a
                        // logical offset outdates that lookup, which it then retries only
                        // after 500 ms (every first start of a group paid it).
                        let watermarks = dead_letters.watermarks(partition).await;
                        let resume = match (resume, watermarks) {
                            (Resume::Beginning, Some((low, _))) => Resume::At(low),
                            (resume, _) => resume,
                        };
                        let ids = match &warm_up {
                            Some(warm_up) => {
                                match warm_up_ids(warm_up, partition, resume, watermarks).await {
                                    Ok(ids) => Some(ids),
                                    Err(error) => {
                                        tracing::warn!(partition, %error, "reading the recent ids from the log failed; retrying");
                                        tokio::time::sleep(backoff.next_delay()).await;
                                        continue;
                                    }
                                }
                            }
                            None => None,
                        };
                        let _ = done_tx.send(Report {
                            partition,
                            generation,
                            done: Done::Acquired {
                                owner,
                                resume,
                                log_end: watermarks.map(|(_, high)| high),
                                ids,
                                rewound,
                            },
                        });
                        return;
                    }
                    Err(error) if error.is_likes_moved() => {
                        // No retry can succeed: this process's layout is outdated.
                        tracing::error!(partition, %error, "acquiring the partition was refused; stopping");
                        outdated.fire(error.source.to_string());
                        return;
                    }
                    Err(error) => {
                        metrics.redis_error();
                        tracing::warn!(partition, %error, "acquiring the partition failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
        })
    }

    /// Commits `(partition, next_offset)` pairs.
    pub(crate) fn commit<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        offsets: &[(i32, i64)],
        mode: CommitMode,
    ) {
        let mut tpl = TopicPartitionList::new();
        for &(partition, offset) in offsets {
            // Adding an offset to a fresh list cannot fail.
            let _ =
                tpl.add_partition_offset(&self.settings.topic, partition, Offset::Offset(offset));
        }
        if tpl.count() == 0 {
            return;
        }
        if let Err(error) = consumer.commit(&tpl, mode) {
            // Not fatal: the work is durable, and at worst the next owner re-reads it.
            tracing::warn!(%error, "offset commit failed");
        }
    }

    /// A new acquisition's recent ids (`None`: no namespace keeps a window) replace the
    /// partition's, which the decider then finds.
    fn install_ids(&self, partition: i32, slot: &mut Slot, ids: Option<RecentIds>) {
        let mut registry = self.ids.lock().unwrap_or_else(PoisonError::into_inner);
        slot.ids = match (ids, slot.ids.take()) {
            (Some(ids), Some(state)) => {
                state.install(ids);
                Some(state)
            }
            (Some(ids), None) => {
                let state = Arc::new(Ids::new(ids));
                registry.insert(partition, state.clone());
                Some(state)
            }
            (None, _) => {
                registry.remove(&partition);
                None
            }
        };
    }

    pub(super) fn set_paused<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        slot: &mut Slot,
        pause: bool,
    ) {
        let read_to = slot.machine.read_to();
        let topic = &self.settings.topic;
        (self.source).set_paused(consumer, topic, partition, pause, read_to, &mut slot.epoch);
    }
}

/// After a write of this process's was fenced at `group`: if the fence was moved by a move of
/// the likes to count sets (`tally likes-to-sets`), no owner of this process's can write there
/// again, and no other owner took the partition: the loop stops, so that a restart reads the
/// layout again (a read that fails leaves the partition fenced, as any fenced write does).
async fn check_moved<S: Sink>(sink: &S, group: u32, outdated: &Outdated) {
    if let Ok(true) = sink.likes_moved(group).await {
        let why = tally_common::layout::moved_message(group);
        tracing::error!(group, %why, "a write was fenced by the move of the likes; stopping");
        outdated.fire(why);
    }
}
