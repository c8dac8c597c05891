//! The consume loop: Kafka messages into per-partition buffers, buffers into flushes, durable
//! flushes into committed offsets.
//!
//! One task owns the consumer and runs [`Aggregator::run`]. It decodes each message into its
//! partition's [`Batch`] (or, if malformed, into the batch's dead letters), and starts a flush as
//! a separate task when the batch is due, so that polling goes on while Redis is slow or down:
//! the consumer keeps its group membership (`max.poll.interval.ms` never expires), and a
//! partition whose next buffer reaches its pause size (`Limits::pause_size`) while its previous
//! flush is still in flight is *paused* until that flush lands. Each partition has at most one
//! flush in flight, so flushes land in offset order.
//!
//! # Offsets
//! **An offset is committed only after everything before it is durable**: the loop commits a
//! partition's offset when that partition's flush reports [`FlushOutcome::Durable`], and never
//! otherwise. Auto-commit is off.
//!
//! In exactly-once mode ([`Delivery::ExactlyOnce`]) the committed offset is only a progress hint
//! for lag monitoring: the truth is in Redis. A newly assigned partition is paused while
//! [`fence::acquire`] stamps a new epoch into every group's fence and reads where to resume; the
//! loop then seeks there and resumes, and while rebuilding its first batch skips every message
//! whose shard group had already applied it (offset below that group's ledger entry).
//!
//! # Rebalances and shutdown
//! The rebalance callbacks live in [`crate::rebalance`]; they run inside this loop's poll and
//! share its state (`Shared`). Shutdown drains every partition the way a revoke drains
//! the revoked ones (bounded by `shutdown_timeout`), then closes the consumer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures_core::Stream;
use rdkafka::consumer::stream_consumer::MessageStream;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tally_common::{DeadLetterReason, Keyspace, Namespaces, codec};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::batch::{Batch, FlushClock, Limits, Pace};
use crate::config::Delivery;
use crate::dead_letter::DeadLetter;
use crate::fence::{self, Owner, Resume};
use crate::flush::{FlushOutcome, Flusher};
use crate::metrics::Metrics;
use crate::rebalance::AggregatorContext;
use crate::sink::Sink;

/// Most messages taken from librdkafka's queue in one go (one lock of the partitions, one
/// trip through the loop).
const MAX_DRAIN: usize = 1_024;

/// Waits for the next message, then takes every message already waiting behind it, up to
/// [`MAX_DRAIN`]: one wake-up and one lock per run of messages instead of per message.
async fn ready_messages<'a, C: rdkafka::consumer::ConsumerContext>(
    stream: &mut MessageStream<'a, C>,
) -> Vec<KafkaResult<BorrowedMessage<'a>>> {
    std::future::poll_fn(|cx| {
        let mut messages = Vec::new();
        while messages.len() < MAX_DRAIN {
            match std::pin::Pin::new(&mut *stream).poll_next(cx) {
                std::task::Poll::Ready(Some(message)) => messages.push(message),
                std::task::Poll::Ready(None) | std::task::Poll::Pending => break,
            }
        }
        if messages.is_empty() {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(messages)
        }
    })
    .await
}

/// What the consume loop needs to know.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// The topic to consume.
    pub topic: String,
    /// Flush triggers.
    pub limits: Limits,
    /// Where each partition's deltas go.
    pub keyspace: Keyspace,
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

/// One owned partition.
#[derive(Debug)]
pub(crate) struct Partition {
    /// Distinguishes this ownership from an earlier or later one of the same partition.
    pub(crate) generation: u64,
    /// Where its exactly-once ownership stands.
    pub(crate) state: Ownership,
    /// Events not yet handed to a flush.
    pub(crate) buffer: Batch,
    /// When its buffer is due.
    pub(crate) clock: FlushClock,
    /// The flush (or check of an idle partition) in progress, if any.
    pub(crate) in_flight: Option<InFlight>,
    /// Whether fetching is paused because the buffer is full.
    pub(crate) paused: bool,
    /// When Redis last confirmed this owner's standing (a durable flush or a check).
    pub(crate) confirmed: Instant,
    /// The offset after the last message handled in this position (`None` until the first).
    pub(crate) read_to: Option<i64>,
    /// Where the partition's log ended: its high watermark when it was acquired, then its last
    /// stable offset at each statistics report.
    pub(crate) log_end: Option<i64>,
    /// Whether messages reached it since the last tick.
    pub(crate) reading: bool,
}

impl Partition {
    /// Whether the partition batches by clock or by size.
    pub(crate) fn pace(&self) -> Pace {
        Pace::of(self.read_to, self.log_end, self.reading)
    }

    /// Whether its buffer must be flushed at `now`: due at its pace, or so full that fetching
    /// was paused (whatever the pace is now: a partition paused at the live limits may look
    /// behind since it stopped reading).
    fn flush_due(&self, limits: &Limits, pace: Pace, now: Instant) -> bool {
        self.paused || self.buffer.is_due(limits, pace, &self.clock, now)
    }
}

/// Where a partition's ownership stands.
#[derive(Debug)]
pub(crate) enum Ownership {
    /// At-least-once mode: no fences, no ledgers.
    Unfenced,
    /// Exactly-once: taking an epoch and stamping fences (this task); the partition is paused and
    /// its messages are dropped until it is positioned.
    Acquiring(JoinHandle<()>),
    /// Exactly-once: owned under an epoch, with the groups' ledger entries.
    Owned(Owner),
    /// Exactly-once: a write was refused by a fence; a newer owner has the partition, so nothing
    /// more is consumed or flushed here.
    Fenced,
}

/// A flush running as its own task.
#[derive(Debug)]
pub(crate) struct InFlight {
    /// The task; its output is the outcome.
    pub(crate) handle: JoinHandle<FlushOutcome>,
    /// Messages in the flushed batch.
    pub(crate) events: usize,
}

/// A task's report to the loop.
#[derive(Debug)]
pub(crate) enum Report {
    /// A flush ended.
    Flushed {
        partition: i32,
        generation: u64,
        outcome: FlushOutcome,
    },
    /// Exactly-once ownership was acquired: seek and resume.
    Acquired {
        partition: i32,
        generation: u64,
        owner: Owner,
        resume: Resume,
        /// The partition's high watermark when it was acquired, if the brokers told.
        log_end: Option<i64>,
    },
}

/// The owned partitions.
#[derive(Debug, Default)]
pub(crate) struct Partitions {
    pub(crate) map: HashMap<i32, Partition, foldhash::fast::RandomState>,
    pub(crate) next_generation: u64,
}

/// State shared by the loop and the rebalance callbacks (which run inside the loop's poll).
pub(crate) struct Shared<S> {
    pub(crate) settings: LoopSettings,
    pub(crate) partitions: Mutex<Partitions>,
    pub(crate) flusher: Flusher<S>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) done_tx: mpsc::UnboundedSender<Report>,
    /// Durable flushes so far (for the crash failpoint).
    pub(crate) flushes: std::sync::atomic::AtomicU64,
    /// Cancels every flush still retrying: fired when the shutdown deadline passes.
    pub(crate) hard_stop: CancellationToken,
    pub(crate) runtime: tokio::runtime::Handle,
}

pub(crate) type AggConsumer<S> = StreamConsumer<AggregatorContext<S>>;

/// The aggregator: a consumer, its partitions' buffers, and the flusher.
pub struct Aggregator<S: Sink> {
    shared: Arc<Shared<S>>,
    consumer: AggConsumer<S>,
    done_rx: mpsc::UnboundedReceiver<Report>,
}

impl<S: Sink> std::fmt::Debug for Aggregator<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregator")
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock(m: &Mutex<Partitions>) -> MutexGuard<'_, Partitions> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S: Sink> Aggregator<S> {
    /// Creates the consumer from `kafka` (tally's consumer settings are applied first, `kafka`'s
    /// own entries override them) and subscribes to the topic. Must run inside a multi-threaded
    /// Tokio runtime.
    pub fn new(
        kafka: &ClientConfig,
        settings: LoopSettings,
        flusher: Flusher<S>,
    ) -> Result<Self, KafkaError> {
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
        });
        // tally's consumer settings under the operator's: start from the operator's (copying the
        // config, never its `config_map()`, which masks secrets such as `sasl.password`).
        let mut config = kafka.clone();
        let defaults = [
            ("enable.auto.commit", "false"),
            ("auto.offset.reset", "earliest"),
            ("enable.partition.eof", "false"),
            // Each report tells every partition where its log ends (its pace, see
            // `batch::Pace`) and feeds the lag gauge.
            ("statistics.interval.ms", "1000"),
            // Fetch more per partition, hold less: librdkafka's defaults (1 MiB per partition
            // per fetch, 64 MiB queued) caught up at 363,209 events/s with a 160 MiB peak RSS;
            // these at 506,765 events/s with 280 MiB (3,000,000 events, 8 partitions, 2 cores).
            // 8 MiB fetches reached 862,161 events/s but peaked at 723 MiB.
            ("max.partition.fetch.bytes", "2097152"),
            ("queued.max.messages.kbytes", "16384"),
            // Once a partition's prefetched messages pass the queue limits above, librdkafka
            // waits this long before fetching it again. Its default, 1,000 ms, starved a
            // catch-up: every partition got one burst a second and the machine sat 63-76% idle
            // (2 M JSON events, 8 partitions: 149,000 events/s). Measured from launch to the
            // last flush on the same topic, two runs each: 1 ms 622-623k, 10 ms 633-667k,
            // 50 ms 608-621k, 200 ms 475-518k events/s.
            ("fetch.queue.backoff.ms", "10"),
            // Partitions added to the topic are noticed at the next metadata refresh (which
            // starts the rebalance that assigns them): librdkafka's default is 5 minutes.
            ("topic.metadata.refresh.interval.ms", "5000"),
        ];
        for (key, value) in defaults {
            if config.get(key).is_none() {
                config.set(key, value);
            }
        }
        let consumer: AggConsumer<S> = config.create_with_context(AggregatorContext {
            shared: shared.clone(),
        })?;
        consumer.subscribe(&[&shared.settings.topic])?;
        Ok(Self {
            shared,
            consumer,
            done_rx,
        })
    }

    /// Consumes until `shutdown` fires, then drains every partition (bounded by the shutdown
    /// timeout), commits, and closes the consumer.
    pub async fn run(mut self, shutdown: CancellationToken) -> RunSummary {
        let shared = self.shared.clone();
        let interval = shared.settings.limits.flush_interval;
        // A batch is flushed within one period after its flush time: that slack is part of the
        // end-to-end latency.
        let period = (interval / 100).clamp(Duration::from_millis(1), Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut stream = self.consumer.stream();
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(report) = self.done_rx.recv() => shared.report(&self.consumer, report),
                _ = tick.tick() => shared.tick(),
                messages = ready_messages(&mut stream) => {
                    shared.handle_messages(&self.consumer, &messages);
                }
            }
        }
        drop(stream);
        shared.metrics.group_membership(false);
        tracing::info!("shutting down: draining every partition");
        let taken: Vec<(i32, Partition)> = lock(&shared.partitions).map.drain().collect();
        let deadline = Instant::now() + shared.settings.shutdown_timeout;
        let drained = shared.drain(taken, deadline).await;
        shared.commit(&self.consumer, &drained.commit, CommitMode::Sync);
        // Nothing may keep retrying past this point.
        shared.hard_stop.cancel();
        shared.metrics.buffers(0, 0, 0, 0);
        self.consumer.unsubscribe();
        RunSummary {
            drained: drained.drained,
            not_drained: drained.not_drained,
        }
    }
}

impl<S: Sink> Shared<S> {
    /// Handles a run of messages under one lock of the partitions.
    fn handle_messages(
        &self,
        consumer: &AggConsumer<S>,
        messages: &[KafkaResult<BorrowedMessage<'_>>],
    ) {
        let mut parts = lock(&self.partitions);
        let mut read = 0;
        for message in messages {
            match message {
                Ok(message) => {
                    read += 1;
                    self.handle_message(&mut parts, consumer, message);
                }
                Err(error) => tracing::warn!(%error, "Kafka consumer error"),
            }
        }
        self.metrics.consumed(read);
    }

    /// Adds one message to its partition's buffer, starting a flush or pausing if it is full.
    fn handle_message(
        &self,
        parts: &mut Partitions,
        consumer: &AggConsumer<S>,
        message: &BorrowedMessage<'_>,
    ) {
        let partition = message.partition();
        let offset = message.offset();
        let Some(st) = parts.map.get_mut(&partition) else {
            // Not (or no longer) ours: whoever owns it will read it from the committed offset.
            return;
        };
        let ledgers = match &st.state {
            Ownership::Unfenced => None,
            Ownership::Owned(owner) => Some(&owner.ledgers),
            // Not positioned yet (it will be re-read after the seek), or fenced off.
            Ownership::Acquiring(_) | Ownership::Fenced => return,
        };
        st.read_to = Some(offset + 1);
        st.reading = true;
        match codec::decode(
            message.payload().unwrap_or_default(),
            self.settings.max_message_bytes,
        ) {
            Ok(event) => {
                let policy = self.settings.namespaces.policy(&event.counter);
                let actor = event.actor.as_deref();
                let group =
                    self.settings
                        .keyspace
                        .group_for_event(policy.grouping, partition, actor);
                if ledgers.is_some_and(|l| offset < l[group as usize]) {
                    // Applied by this group before a restart: count it once, not twice.
                    st.buffer.skip(offset);
                    self.metrics.skipped();
                } else if !policy.dedup {
                    st.buffer.add(group, &event.counter, event.delta, offset);
                } else if let Some(actor) = actor {
                    st.buffer
                        .add_member(group, &event.counter, actor, event.delta > 0, offset);
                } else {
                    tracing::debug!(partition, offset, "dead-lettering a like without an actor");
                    st.buffer.add_dead_letter(
                        DeadLetter {
                            key: message.key().map(<[u8]>::to_vec),
                            payload: message.payload().map(<[u8]>::to_vec),
                            reason: DeadLetterReason::MissingActor,
                            error: format!(
                                "{} is in a namespace that counts one per actor, and the event names no actor",
                                event.counter
                            ),
                            partition,
                            offset,
                        },
                        offset,
                    );
                }
            }
            Err(error) => {
                tracing::debug!(partition, offset, %error, "dead-lettering a malformed message");
                st.buffer.add_dead_letter(
                    DeadLetter {
                        key: message.key().map(<[u8]>::to_vec),
                        payload: message.payload().map(<[u8]>::to_vec),
                        reason: error.reason(),
                        error: error.to_string(),
                        partition,
                        offset,
                    },
                    offset,
                );
            }
        }
        let limits = &self.settings.limits;
        let pace = st.pace();
        if st.buffer.is_full(limits.size(pace)) {
            if st.in_flight.is_none() {
                self.start_flush(partition, st);
            } else if !st.paused && st.buffer.is_full(&limits.pause_size(pace)) {
                self.set_paused(consumer, partition, true);
                st.paused = true;
            }
        }
    }

    /// Starts flushes of due buffers and refreshes the buffer gauges.
    fn tick(&self) {
        let now = Instant::now();
        let mut parts = lock(&self.partitions);
        let (mut buffered, mut paused, mut catching_up) = (0, 0, 0);
        for (&partition, st) in parts.map.iter_mut() {
            let pace = st.pace();
            st.reading = false;
            catching_up += usize::from(pace == Pace::CatchingUp);
            if st.in_flight.is_none() && st.flush_due(&self.settings.limits, pace, now) {
                self.start_flush(partition, st);
            }
            if st.in_flight.is_none()
                && st.buffer.events() == 0
                && now.duration_since(st.confirmed) >= self.settings.check_idle_interval
            {
                self.start_check(partition, st, now);
            }
            buffered += st.buffer.events() + st.in_flight.as_ref().map_or(0, |f| f.events);
            paused += usize::from(st.paused);
        }
        self.metrics
            .buffers(buffered, parts.map.len(), paused, catching_up);
    }

    /// Hands the partition's buffer to a new flush task.
    fn start_flush(&self, partition: i32, st: &mut Partition) {
        debug_assert!(st.in_flight.is_none(), "one flush per partition at a time");
        let owner = match &st.state {
            Ownership::Unfenced => None,
            Ownership::Owned(owner) => Some(owner.clone()),
            Ownership::Acquiring(_) | Ownership::Fenced => return,
        };
        let Some(batch) = st.buffer.seal() else {
            return;
        };
        let events = batch.events;
        let flusher = self.flusher.clone();
        let cancel = self.hard_stop.clone();
        let done_tx = self.done_tx.clone();
        let generation = st.generation;
        let handle = tokio::spawn(async move {
            // In the task, not the consume loop: feeding the sketches costs a hash per counter.
            let warm = flusher
                .trending
                .as_ref()
                .map(|t| t.observe(&batch))
                .unwrap_or_default();
            let outcome = flusher.flush(partition, batch, owner, &cancel).await;
            // The loop may be gone (shutdown); the outcome is also the task's output.
            let _ = done_tx.send(Report::Flushed {
                partition,
                generation,
                outcome: outcome.clone(),
            });
            if let (FlushOutcome::Durable { .. }, Some(trending)) = (&outcome, &flusher.trending)
                && !warm.is_empty()
            {
                trending.warm(&warm).await;
            }
            outcome
        });
        st.in_flight = Some(InFlight { handle, events });
    }

    /// Checks an idle owned partition's standing in Redis, as its in-flight task.
    fn start_check(&self, partition: i32, st: &mut Partition, now: Instant) {
        let Ownership::Owned(owner) = &st.state else {
            return;
        };
        st.confirmed = now;
        let owner = owner.clone();
        let flusher = self.flusher.clone();
        let done_tx = self.done_tx.clone();
        let generation = st.generation;
        let handle = tokio::spawn(async move {
            let outcome = flusher.verify(partition, &owner).await;
            let _ = done_tx.send(Report::Flushed {
                partition,
                generation,
                outcome: outcome.clone(),
            });
            outcome
        });
        st.in_flight = Some(InFlight { handle, events: 0 });
    }

    /// A task reported back.
    fn report(&self, consumer: &AggConsumer<S>, report: Report) {
        let (partition, generation) = match &report {
            Report::Flushed {
                partition,
                generation,
                ..
            }
            | Report::Acquired {
                partition,
                generation,
                ..
            } => (*partition, *generation),
        };
        let mut parts = lock(&self.partitions);
        let Some(st) = parts.map.get_mut(&partition) else {
            return;
        };
        if st.generation != generation {
            // A report from an earlier ownership, already handled by the revoke.
            return;
        }
        match report {
            Report::Flushed { outcome, .. } => self.flush_done(consumer, partition, st, outcome),
            Report::Acquired {
                owner,
                resume,
                log_end,
                ..
            } => {
                let offset = match resume {
                    Resume::Beginning => Offset::Beginning,
                    Resume::At(offset) => Offset::Offset(offset),
                };
                if let Err(error) = consumer.seek(
                    &self.settings.topic,
                    partition,
                    offset,
                    Duration::from_secs(10),
                ) {
                    // Without the seek the position is unknown: stay paused and acquire again.
                    tracing::warn!(partition, %error, "seek failed; acquiring the partition again");
                    st.state = Ownership::Acquiring(self.spawn_acquire(partition, generation));
                    return;
                }
                tracing::info!(partition, epoch = owner.epoch, ?resume, "partition owned");
                st.read_to = None;
                st.log_end = log_end.or(st.log_end);
                st.state = Ownership::Owned(owner);
                st.confirmed = Instant::now();
                self.set_paused(consumer, partition, false);
            }
        }
    }

    /// A flush finished: commit its offset, start the next one if due, resume if paused.
    fn flush_done(
        &self,
        consumer: &AggConsumer<S>,
        partition: i32,
        st: &mut Partition,
        outcome: FlushOutcome,
    ) {
        st.in_flight = None;
        let next_offset = match outcome {
            FlushOutcome::Durable { next_offset, owner } => {
                if let Some(owner) = owner {
                    st.state = Ownership::Owned(owner);
                }
                st.confirmed = Instant::now();
                Some(next_offset)
            }
            FlushOutcome::Verified => None,
            FlushOutcome::Fenced => {
                st.state = Ownership::Fenced;
                st.buffer = Batch::default();
                self.set_paused(consumer, partition, true);
                st.paused = true;
                return;
            }
            FlushOutcome::RolledBack => {
                // Start over from what Redis now holds: a new epoch, a new resume offset.
                st.buffer = Batch::default();
                self.set_paused(consumer, partition, true);
                st.paused = false;
                st.state = Ownership::Acquiring(self.spawn_acquire(partition, st.generation));
                return;
            }
            FlushOutcome::Cancelled => return,
        };
        if let Some(next_offset) = next_offset {
            self.durable(consumer, partition, next_offset);
        }
        let pace = st.pace();
        if st.flush_due(&self.settings.limits, pace, Instant::now()) {
            self.start_flush(partition, st);
        }
        if st.paused && !st.buffer.is_full(&self.settings.limits.pause_size(pace)) {
            self.set_paused(consumer, partition, false);
            st.paused = false;
        }
    }

    /// A flush up to `next_offset` is durable: commit it.
    fn durable(&self, consumer: &AggConsumer<S>, partition: i32, next_offset: i64) {
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
    /// result comes back as [`Report::Acquired`].
    pub(crate) fn spawn_acquire(&self, partition: i32, generation: u64) -> JoinHandle<()> {
        let sink = self.flusher.sink.clone();
        let dead_letters = self.flusher.dead_letters.clone();
        let keyspace = self.settings.keyspace.clone();
        let topic = self.settings.topic.clone();
        let metrics = self.metrics.clone();
        let done_tx = self.done_tx.clone();
        let (initial, max) = (self.flusher.retry_initial, self.flusher.retry_max);
        tokio::spawn(async move {
            let mut backoff = Backoff::new(initial, max);
            loop {
                match fence::acquire(&sink, &keyspace, &topic, partition).await {
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
                        let _ = done_tx.send(Report::Acquired {
                            partition,
                            generation,
                            owner,
                            resume,
                            log_end: watermarks.map(|(_, high)| high),
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
    pub(crate) fn commit<C: Consumer<AggregatorContext<S>>>(
        &self,
        consumer: &C,
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

    pub(crate) fn set_paused(&self, consumer: &AggConsumer<S>, partition: i32, pause: bool) {
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
}
