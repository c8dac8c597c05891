//! The Kafka side of the partitions' state machines: messages decoded and routed into their
//! partition's [`Partition`], ticks, task reports, and the [`Action`]s these return carried out
//! (flush and check tasks, acquisitions, seeks, pauses, offset commits); rebalances (the
//! assignment and the revoke, called by `crate::rebalance`'s callbacks) and the drain that
//! revokes and shutdown share.
//!
//! Decisions are the state machine's (`crate::partition`); this module does the I/O. A flush
//! runs as its own task, so that polling goes on while Redis is slow or down: the consumer keeps
//! its group membership (`max.poll.interval.ms` never expires).
//!
//! # Offsets
//! **An offset is committed only after everything before it is durable**: the commit is the
//! state machine's [`Action::Commit`], which only a [`FlushOutcome::Durable`] produces. Auto-commit
//! is off. In exactly-once mode ([`Delivery::ExactlyOnce`]) the committed offset is only a
//! progress hint for lag monitoring: the truth is in Redis. A newly assigned partition is paused
//! while [`fence::acquire`] stamps a new epoch into every group's fence and reads where to
//! resume; then it seeks there and resumes.
//!
//! # Rebalances and shutdown
//! The revoke runs synchronously inside the consumer's poll: before it returns it waits for the
//! revoked partitions' in-flight flushes, flushes what is left in their buffers, and commits
//! their offsets, bounded by `revoke_timeout`; what is not durable by then is not committed and
//! is read again by the next owner. Shutdown drains every partition the same way (bounded by
//! `shutdown_timeout`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::{Offset, TopicPartitionList};
use tally_common::codec::Record;
use tally_common::window::Placement;
use tally_common::{DeadLetterReason, Keyspace, Namespaces, codec};
use tally_kafka::{Chunk, Fetched, Fetcher, Item, OffsetReset, Start};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batch::{Limits, Pace};
use crate::config::Delivery;
use crate::dead_letter::DeadLetter;
use crate::fence::{self, Owner, Resume};
use crate::flush::{FlushOutcome, Flusher, Standing};
use crate::idempotency::{self, RecentIds, WarmUp};
use crate::metrics::Metrics;
use crate::partition::{Action, Drain, Entry, Handled, NotDrained, Partition};
use crate::sink::Sink;

/// What the consume loop needs to know.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// The topic to consume.
    pub topic: String,
    /// Flush triggers.
    pub limits: Limits,
    /// Where each partition's deltas go.
    pub keyspace: Keyspace,
    /// How many groups a partition's counters spread over (`tally_common::keyspace::Spread`);
    /// an owner keeps the recorded spread of the stretch of its log some group may have applied.
    pub partition_spread: u32,
    /// Each namespace's policy: which group its deltas go to, whether it deduplicates.
    pub namespaces: Arc<Namespaces>,
    /// Exactly-once (fenced, ledgered writes) or at-least-once.
    pub delivery: Delivery,
    /// Test-only failpoint: abort the process right after this many durable flushes, before
    /// their offsets are committed (`TALLY_FAILPOINT_CRASH_AFTER_FLUSHES`).
    pub crash_after_flushes: Option<u64>,
    /// Largest message accepted.
    pub max_message_bytes: usize,
    /// Longest flush of revoked partitions.
    pub revoke_timeout: Duration,
    /// Longest flush at shutdown.
    pub shutdown_timeout: Duration,
    /// How often an owned partition with nothing to flush checks that Redis still holds what it
    /// wrote (exactly-once), so that a rollback is re-fed without waiting for new events.
    pub check_idle_interval: Duration,
    /// Read partitions with tally's own fetcher (`tally_kafka`), configured so; `None` reads
    /// them through librdkafka's consumer.
    pub fetch: Option<tally_kafka::FetchConfig>,
}

/// Most bytes of a batch that cannot be read kept in its dead letter (well under a topic's
/// default `max.message.bytes`, 1 MiB).
const MAX_UNREADABLE_BYTES: usize = 256 * 1024;

/// A message as the loop reads it, from librdkafka's consumer or from tally's fetcher.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Message<'a> {
    /// Its partition.
    pub(crate) partition: i32,
    /// Its offset.
    pub(crate) offset: i64,
    /// Its key.
    pub(crate) key: Option<&'a [u8]>,
    /// Its payload.
    pub(crate) payload: Option<&'a [u8]>,
    /// Its Kafka timestamp, if it has one.
    pub(crate) timestamp_ms: Option<i64>,
}

impl<'a> Message<'a> {
    fn of(message: &'a BorrowedMessage<'_>) -> Self {
        Self {
            partition: message.partition(),
            offset: message.offset(),
            key: message.key(),
            payload: message.payload(),
            timestamp_ms: message.timestamp().to_millis(),
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSummary {
    /// Partitions whose buffers were all durable and committed at shutdown.
    pub drained: usize,
    /// Partitions whose last flush did not become durable before the shutdown deadline; their
    /// uncommitted events will be read again by the next owner.
    pub not_drained: Vec<i32>,
}

/// A partition in the loop: its state machine, and the tasks carrying out its actions.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The decisions.
    machine: Partition,
    /// The flush or check running for it.
    task: Option<Task>,
    /// The acquisition running for it.
    acquiring: Option<JoinHandle<()>>,
    /// The ids counted over the last idempotency window (namespaces that keep one), rebuilt
    /// from the log on each acquisition.
    ids: Option<RecentIds>,
    /// With tally's fetcher: the epoch of the partition's last seek (chunks of another epoch
    /// were fetched before it and are dropped).
    epoch: u64,
}

/// A flush or a check, running as its own task.
#[derive(Debug)]
enum Task {
    /// A flush; its output is the outcome.
    Flush(JoinHandle<FlushOutcome>),
    /// A check of an idle owner's standing.
    Check(JoinHandle<Standing>),
}

/// A task's report to the loop: which ownership of which partition, and what ended.
#[derive(Debug)]
pub(crate) struct Report {
    partition: i32,
    generation: u64,
    done: Done,
}

/// What a task reports.
#[derive(Debug)]
enum Done {
    /// A flush ended.
    Flushed(FlushOutcome),
    /// A check of an idle partition ended.
    Checked(Standing),
    /// Exactly-once ownership was acquired: seek and resume.
    Acquired {
        owner: Owner,
        resume: Resume,
        /// The partition's high watermark when it was acquired, if the brokers told.
        log_end: Option<i64>,
        /// Its recent ids, read from the log before `resume` (namespaces with idempotency).
        ids: Option<RecentIds>,
    },
}

/// The owned partitions.
#[derive(Debug, Default)]
struct Partitions {
    map: HashMap<i32, Slot, foldhash::fast::RandomState>,
    next_generation: u64,
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

/// State shared by the loop and the rebalance callbacks (which run inside the loop's poll).
pub(crate) struct Shared<S> {
    pub(crate) settings: LoopSettings,
    partitions: Mutex<Partitions>,
    pub(crate) flusher: Flusher<S>,
    pub(crate) metrics: Arc<Metrics>,
    done_tx: mpsc::UnboundedSender<Report>,
    /// Durable flushes so far (for the crash failpoint).
    flushes: std::sync::atomic::AtomicU64,
    /// Cancels every flush still retrying: fired when the shutdown deadline passes.
    hard_stop: CancellationToken,
    runtime: tokio::runtime::Handle,
    /// Rebuilds recent ids on acquisition, when a namespace keeps an idempotency window.
    warm_up: Option<Arc<WarmUp>>,
    /// tally's fetcher, when it reads the partitions (librdkafka's consumer then keeps every
    /// partition paused and only runs the group).
    pub(crate) fetcher: Option<Fetcher>,
}

/// A partition's recent ids as of `resume`, read from the log on a blocking thread.
async fn warm_up_ids(
    warm_up: &Arc<WarmUp>,
    partition: i32,
    resume: Resume,
) -> Result<RecentIds, String> {
    let Resume::At(resume) = resume else {
        return Ok(warm_up.empty());
    };
    let reader = warm_up.clone();
    let warmed = tokio::task::spawn_blocking(move || reader.read(partition, resume))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    tracing::info!(
        partition,
        resume,
        messages = warmed.messages,
        ids = warmed.ids.len(),
        ms = warmed.elapsed.as_millis() as u64,
        "recent ids read from the log"
    );
    Ok(warmed.ids)
}

fn lock(m: &Mutex<Partitions>) -> MutexGuard<'_, Partitions> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S: Sink> Shared<S> {
    /// The shared state, and the receiver of its tasks' reports. Must run inside a Tokio runtime.
    pub(crate) fn new(
        settings: LoopSettings,
        flusher: Flusher<S>,
        warm_up: Option<WarmUp>,
        fetcher: Option<Fetcher>,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<Report>) {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let metrics = flusher.metrics.clone();
        let shared = Arc::new(Shared {
            settings,
            partitions: Mutex::new(Partitions::default()),
            flusher,
            metrics,
            done_tx,
            flushes: std::sync::atomic::AtomicU64::new(0),
            hard_stop: CancellationToken::new(),
            runtime: tokio::runtime::Handle::current(),
            warm_up: warm_up.map(Arc::new),
            fetcher,
        });
        (shared, done_rx)
    }

    /// The partitions this aggregator owns now (exactly-once).
    pub(crate) fn owned_partitions(&self) -> Vec<i32> {
        let parts = lock(&self.partitions);
        (parts.map.iter())
            .filter(|(_, slot)| slot.machine.ledgers().is_some())
            .map(|(p, _)| *p)
            .collect()
    }

    /// Handles a run of messages under one lock of the partitions.
    pub(crate) fn handle_messages<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        messages: &[KafkaResult<BorrowedMessage<'_>>],
    ) {
        let mut parts = lock(&self.partitions);
        let mut read = 0;
        for message in messages {
            match message {
                Ok(message) => {
                    read += 1;
                    let message = Message::of(message);
                    if let Some(slot) = parts.map.get_mut(&message.partition) {
                        self.handle_message(slot, consumer, &message);
                    }
                }
                Err(error) => tracing::warn!(%error, "Kafka consumer error"),
            }
        }
        self.metrics.consumed(read);
    }

    /// What tally's fetcher handed over: a chunk of one partition's records, each decoded and
    /// routed to the partition's state machine in turn, under one lock.
    pub(crate) fn handle_fetched<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        fetched: Fetched,
    ) {
        let chunk = match fetched {
            Fetched::Chunk(chunk) => chunk,
            Fetched::OutOfRange {
                partition,
                from,
                to,
                ..
            } => {
                self.metrics.offset_reset();
                match to {
                    Some(to) => tracing::error!(
                        partition,
                        from,
                        to,
                        "the partition's position is no longer in its log (retention deleted it): reading goes on where auto.offset.reset says; the events in between were never counted"
                    ),
                    None => tracing::error!(
                        partition,
                        from,
                        "the partition's position is no longer in its log, and auto.offset.reset = error: it is not read until it is positioned again"
                    ),
                }
                return;
            }
            Fetched::Failed { error } => {
                tracing::error!(%error, "reading the topic fails; retrying");
                return;
            }
        };
        let mut parts = lock(&self.partitions);
        let read = self.handle_chunk(&mut parts, consumer, &chunk);
        self.metrics.consumed(read);
    }

    /// Routes a chunk's records while the chunk's epoch is the partition's; returns how many
    /// were read.
    fn handle_chunk<X: ConsumerContext, K: Consumer<X>>(
        &self,
        parts: &mut Partitions,
        consumer: &K,
        chunk: &Chunk,
    ) -> u64 {
        let partition = chunk.partition;
        let Some(slot) = parts.map.get_mut(&partition) else {
            return 0;
        };
        if slot.epoch != chunk.epoch {
            // Fetched before the partition's last seek (or pause).
            return 0;
        }
        slot.machine.on_log_end(chunk.log_end);
        let mut read = 0;
        for item in chunk.items() {
            match item {
                Item::Record(record) => {
                    let message = Message {
                        partition,
                        offset: record.offset,
                        key: record.key,
                        payload: record.value,
                        timestamp_ms: (record.timestamp_ms >= 0).then_some(record.timestamp_ms),
                    };
                    self.handle_message(slot, consumer, &message);
                }
                Item::Undecodable {
                    first_offset,
                    last_offset,
                    bytes,
                    reason,
                } => {
                    if slot.machine.accepts() {
                        tracing::warn!(partition, first_offset, last_offset, %reason, "dead-lettering a batch that cannot be read");
                        // Its bytes as evidence, at most a dead letter's worth.
                        let kept = bytes.len().min(MAX_UNREADABLE_BYTES);
                        let letter = DeadLetter {
                            key: None,
                            payload: Some(bytes[..kept].to_vec()),
                            reason: DeadLetterReason::Undecodable,
                            error: format!(
                                "offsets {first_offset} to {last_offset}: {reason} (the first {kept} of its {} bytes)",
                                bytes.len()
                            ),
                            partition,
                            offset: first_offset,
                        };
                        let entry = Entry::DeadLetter {
                            group: None,
                            letter,
                        };
                        // At the stretch's last offset: reading goes on after it.
                        self.deliver(consumer, partition, slot, last_offset, entry);
                    }
                }
            }
            read += 1;
            if slot.epoch != chunk.epoch {
                // Paused: the fetcher reads on from the next offset once resumed.
                break;
            }
        }
        read
    }

    /// Decodes one message and routes it to its partition's state machine.
    fn handle_message<X: ConsumerContext, K: Consumer<X>>(
        &self,
        slot: &mut Slot,
        consumer: &K,
        message: &Message<'_>,
    ) {
        let Message {
            partition,
            offset,
            key,
            payload,
            timestamp_ms: kafka_ms,
        } = *message;
        // Not positioned yet (it will be re-read after the seek), or fenced off: not decoded.
        if !slot.machine.accepts() {
            return;
        }
        let dead_letter = |reason: DeadLetterReason, error: String| DeadLetter {
            key: key.map(<[u8]>::to_vec),
            payload: payload.map(<[u8]>::to_vec),
            reason,
            error,
            partition,
            offset,
        };
        let payload = payload.unwrap_or_default();
        // An event, or an expiry record an expirer wrote into the partition (`crate::expiry`).
        let decoded = codec::decode_record(payload, self.settings.max_message_bytes);
        // Every message's Kafka timestamp (`kafka_ms`) is what windows, idempotency windows and
        // expiry go by.
        // Idempotency keys: every event read is decided (and its id recorded) in log order.
        let repeat = match (&decoded, slot.ids.as_mut()) {
            (Ok(Record::Event(event)), Some(ids)) => {
                let namespaces = &self.settings.namespaces;
                let kafka = kafka_ms.unwrap_or(0);
                idempotency::decide(ids, namespaces, event, offset, kafka) == Some(true)
            }
            _ => false,
        };
        // A windowed event's buckets, borrowed by its entry.
        let placement;
        let entry = match &decoded {
            Ok(_) if repeat => {
                self.metrics.repeated_id();
                Entry::Repeat
            }
            Ok(Record::Expiry(expiry)) => Entry::Expire {
                counter: &expiry.counter,
                deadline_ms: expiry.deadline_ms,
                groups: self.settings.keyspace.groups(),
            },
            Ok(Record::Event(event)) if event.reset => Entry::Reset {
                counter: &event.counter,
                groups: self.settings.keyspace.groups(),
            },
            Ok(Record::Event(event)) => {
                let policy = self.settings.namespaces.policy(&event.counter);
                let actor = event.actor.as_deref();
                let keyspace = &self.settings.keyspace;
                let spread =
                    (slot.machine.spread_at(offset)).unwrap_or(self.settings.partition_spread);
                let group = keyspace.group_for_event(
                    policy.grouping,
                    partition,
                    actor,
                    &event.counter,
                    spread,
                );
                // Only windowed namespaces pay for a placement.
                placement = (!policy.windows.is_empty()).then(|| {
                    let placed = (policy.windows).place(event.ts_ms, kafka_ms);
                    self.metrics.window_dropped(placed.late, placed.future);
                    placed
                });
                let idle_deadline = (policy.expire_after_ms)
                    .map(|after| kafka_ms.unwrap_or(0).saturating_add(after));
                match actor {
                    _ if !policy.dedup => Entry::Delta {
                        group,
                        counter: &event.counter,
                        delta: event.delta,
                        buckets: placement.as_ref().map_or(&[], Placement::buckets),
                        idle_deadline,
                    },
                    Some(actor) => Entry::Member {
                        group,
                        counter: &event.counter,
                        actor,
                        like: event.delta > 0,
                        idle_deadline,
                    },
                    None => {
                        tracing::debug!(
                            partition,
                            offset,
                            "dead-lettering a like without an actor"
                        );
                        let why = format!(
                            "{} is in a namespace that counts one per actor, and the event names no actor",
                            event.counter
                        );
                        Entry::DeadLetter {
                            group: Some(group),
                            letter: dead_letter(DeadLetterReason::MissingActor, why),
                        }
                    }
                }
            }
            Err(error) => {
                tracing::debug!(partition, offset, %error, "dead-lettering a malformed message");
                let letter = dead_letter(error.reason(), error.to_string());
                Entry::DeadLetter {
                    group: None,
                    letter,
                }
            }
        };
        self.deliver(consumer, partition, slot, offset, entry);
    }

    /// Hands the message at `offset` to its partition's state machine and carries out what it
    /// decides.
    fn deliver<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        slot: &mut Slot,
        offset: i64,
        entry: Entry<'_>,
    ) {
        let (handled, action) = slot
            .machine
            .on_message(offset, entry, &self.settings.limits);
        if handled == Handled::Skipped {
            self.metrics.skipped();
        }
        if let Some(action) = action {
            self.execute(consumer, partition, slot, action);
        }
    }

    /// Starts flushes of due buffers and checks of idle owners, and refreshes the buffer gauges.
    pub(crate) fn tick<X: ConsumerContext, K: Consumer<X>>(&self, consumer: &K) {
        let now = Instant::now();
        let mut parts = lock(&self.partitions);
        let (mut buffered, mut paused, mut catching_up) = (0, 0, 0);
        for (&partition, slot) in parts.map.iter_mut() {
            let (pace, action) = (slot.machine).on_tick(
                &self.settings.limits,
                self.settings.check_idle_interval,
                now,
            );
            if let Some(action) = action {
                self.execute(consumer, partition, slot, action);
            }
            catching_up += usize::from(pace == Pace::CatchingUp);
            buffered += slot.machine.pending_events();
            paused += usize::from(slot.machine.paused);
        }
        self.metrics
            .buffers(buffered, parts.map.len(), paused, catching_up);
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
        let (limits, now) = (&self.settings.limits, Instant::now());
        let actions = match done {
            Done::Flushed(outcome) => {
                slot.task = None;
                slot.machine.on_flushed(outcome, limits, now)
            }
            Done::Checked(standing) => {
                slot.task = None;
                slot.machine.on_checked(standing, limits, now)
            }
            Done::Acquired {
                owner,
                resume,
                log_end,
                ids,
            } => {
                slot.acquiring = None;
                slot.ids = ids;
                tracing::info!(partition, epoch = owner.epoch, ?resume, "partition owned");
                vec![slot.machine.on_acquired(owner, resume, log_end)]
            }
        };
        for action in actions {
            self.execute(consumer, partition, slot, action);
        }
    }

    /// Carries out one of a partition's actions.
    fn execute<X: ConsumerContext, K: Consumer<X>>(
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
                slot.task = Some(Task::Flush(tokio::spawn(async move {
                    // In the task, not the consume loop: feeding the sketches costs a hash per
                    // counter.
                    let trending = flusher.trending.as_ref();
                    let warm = trending.map(|t| t.observe(&batch)).unwrap_or_default();
                    let outcome = flusher.flush(partition, batch, owner, &cancel).await;
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
                slot.task = Some(Task::Check(tokio::spawn(async move {
                    let standing = flusher.verify(partition, &owner).await;
                    let _ = done_tx.send(Report {
                        partition,
                        generation,
                        done: Done::Checked(standing),
                    });
                    standing
                })));
            }
            Action::Commit(next_offset) => self.durable(consumer, partition, next_offset),
            Action::Pause => self.set_paused(consumer, partition, slot, true),
            Action::Resume => self.set_paused(consumer, partition, slot, false),
            Action::Acquire => slot.acquiring = Some(self.spawn_acquire(partition, generation)),
            Action::Seek(resume) => {
                let sought = match &self.fetcher {
                    Some(fetcher) => {
                        let start = match resume {
                            Resume::Beginning => Start::Earliest,
                            Resume::At(offset) => Start::At(offset),
                        };
                        // Paused, as the partition is while it is acquired; the resume follows.
                        slot.epoch = fetcher.seek(partition, start, true);
                        true
                    }
                    None => {
                        let offset = match resume {
                            Resume::Beginning => Offset::Beginning,
                            Resume::At(offset) => Offset::Offset(offset),
                        };
                        let topic = &self.settings.topic;
                        let sought =
                            consumer.seek(topic, partition, offset, Duration::from_secs(10));
                        if let Err(error) = &sought {
                            // Without the seek the position is unknown: stay paused and acquire
                            // again.
                            tracing::warn!(partition, %error, "seek failed; acquiring the partition again");
                        }
                        sought.is_ok()
                    }
                };
                let next = slot.machine.on_seek(sought, Instant::now());
                self.execute(consumer, partition, slot, next);
            }
        }
    }

    /// A flush up to `next_offset` is durable: commit it.
    fn durable<X: ConsumerContext, K: Consumer<X>>(
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
    fn spawn_acquire(&self, partition: i32, generation: u64) -> JoinHandle<()> {
        let sink = self.flusher.sink.clone();
        let dead_letters = self.flusher.dead_letters.clone();
        let keyspace = self.settings.keyspace.clone();
        let spread = self.settings.partition_spread;
        let topic = self.settings.topic.clone();
        let metrics = self.metrics.clone();
        let done_tx = self.done_tx.clone();
        let (initial, max) = (self.flusher.retry_initial, self.flusher.retry_max);
        let warm_up = self.warm_up.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(initial, max);
            loop {
                match fence::acquire(&sink, &keyspace, &topic, partition, spread).await {
                    Ok((owner, resume)) => {
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
                            Some(warm_up) => match warm_up_ids(warm_up, partition, resume).await {
                                Ok(ids) => Some(ids),
                                Err(error) => {
                                    tracing::warn!(partition, %error, "reading the recent ids from the log failed; retrying");
                                    tokio::time::sleep(backoff.next_delay()).await;
                                    continue;
                                }
                            },
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
                            },
                        });
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

    fn set_paused<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        partition: i32,
        slot: &mut Slot,
        pause: bool,
    ) {
        if let Some(fetcher) = &self.fetcher {
            match (pause, slot.machine.read_to()) {
                // As librdkafka does: drop what was fetched past the last message read, and
                // fetch from there once resumed, so a paused partition holds nothing more.
                (true, Some(next)) => slot.epoch = fetcher.seek(partition, Start::At(next), true),
                (true, None) => fetcher.pause(partition),
                (false, _) => fetcher.resume(partition),
            }
            return;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.settings.topic, partition);
        let result = if pause {
            consumer.pause(&tpl)
        } else {
            consumer.resume(&tpl)
        };
        match result {
            Ok(()) => tracing::debug!(partition, pause, "partition fetch paused/resumed"),
            Err(error) => tracing::warn!(partition, pause, %error, "pause/resume failed"),
        }
    }

    /// New partitions: each gets its state machine; exactly-once ones start paused, acquiring.
    pub(crate) fn assign<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        assigned: &TopicPartitionList,
    ) {
        let exactly_once = self.settings.delivery == Delivery::ExactlyOnce;
        // librdkafka keeps an application pause across revoke and re-assign, so set it
        // explicitly: at-least-once partitions start fetching; exactly-once ones wait, paused,
        // until their fences are stamped and their position is known. With tally's fetcher,
        // librdkafka fetches nothing: every partition stays paused there.
        let paused = if exactly_once || self.fetcher.is_some() {
            consumer.pause(assigned)
        } else {
            consumer.resume(assigned)
        };
        if let Err(error) = paused {
            tracing::warn!(%error, "pausing/resuming newly assigned partitions failed");
        }
        let committed = match (&self.fetcher, exactly_once) {
            (Some(_), false) => self.committed(consumer, assigned),
            _ => HashMap::new(),
        };
        let mut parts = lock(&self.partitions);
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
                epoch: 0,
            };
            if let Some(action) = action {
                self.execute(consumer, partition, &mut slot, action);
            }
            if let (Some(fetcher), false) = (&self.fetcher, exactly_once) {
                // At-least-once reads on from the group's committed offset.
                let start = committed.get(&partition).copied().map_or(
                    match fetcher.offset_reset() {
                        OffsetReset::Latest => Start::Latest,
                        OffsetReset::Earliest | OffsetReset::Error => Start::Earliest,
                    },
                    Start::At,
                );
                slot.epoch = fetcher.seek(partition, start, false);
            }
            parts.map.insert(partition, slot);
        }
        tracing::info!(
            partitions = ?parts.map.keys().collect::<Vec<_>>(),
            "partitions assigned"
        );
    }

    /// The group's committed offsets of `assigned` (at-least-once with tally's fetcher, which
    /// starts there); a partition with none, or whose lookup failed, is read from where
    /// `auto.offset.reset` says (its start unless it says `latest`), as librdkafka does.
    fn committed<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
        assigned: &TopicPartitionList,
    ) -> HashMap<i32, i64> {
        match consumer.committed_offsets(assigned.clone(), Duration::from_secs(10)) {
            Ok(tpl) => (tpl.elements_for_topic(&self.settings.topic).iter())
                .filter_map(|e| match e.offset() {
                    Offset::Offset(offset) => Some((e.partition(), offset)),
                    _ => None,
                })
                .collect(),
            Err(error) => {
                tracing::warn!(%error, "reading the committed offsets failed; reading the partitions from their start");
                HashMap::new()
            }
        }
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
        if taken.is_empty() {
            return;
        }
        for (partition, _) in &taken {
            self.metrics.released(*partition);
            if let Some(fetcher) = &self.fetcher {
                fetcher.remove(*partition);
            }
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

    /// Shutdown: drains every partition (bounded by the shutdown timeout), commits, and stops
    /// every flush still retrying.
    pub(crate) async fn drain_all<X: ConsumerContext, K: Consumer<X>>(
        &self,
        consumer: &K,
    ) -> Drained {
        let taken: Vec<(i32, Slot)> = lock(&self.partitions).map.drain().collect();
        if let Some(fetcher) = &self.fetcher {
            for (partition, _) in &taken {
                fetcher.remove(*partition);
            }
        }
        let deadline = Instant::now() + self.settings.shutdown_timeout;
        let drained = self.drain(taken, deadline).await;
        self.commit(consumer, &drained.commit, CommitMode::Sync);
        // Nothing may keep retrying past this point.
        self.hard_stop.cancel();
        drained
    }

    /// Waits for each partition's in-flight flush, then flushes its buffer, until `deadline`.
    async fn drain(&self, taken: Vec<(i32, Slot)>, deadline: Instant) -> Drained {
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

    /// Each owned partition's lag, where it is known (read with tally's fetcher).
    pub(crate) fn lags(&self) -> Vec<(i32, i64)> {
        let parts = lock(&self.partitions);
        (parts.map.iter())
            .filter_map(|(p, slot)| slot.machine.lag().map(|lag| (*p, lag)))
            .collect()
    }

    /// Where each owned partition's log ends now (from statistics).
    pub(crate) fn log_ends(&self, ends: impl Iterator<Item = (i32, i64)>) {
        let mut parts = lock(&self.partitions);
        for (partition, end) in ends {
            if let Some(slot) = parts.map.get_mut(&partition) {
                slot.machine.on_log_end(end);
            }
        }
    }
}

/// `task`'s output, or `otherwise` if it failed or `cancel` fired first (then it is aborted).
async fn join_or<T>(mut task: JoinHandle<T>, cancel: &CancellationToken, otherwise: T) -> T {
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
async fn drain_one<S: Sink>(
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
