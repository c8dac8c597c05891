//! The Kafka side of the partitions' state machines: messages decoded and routed into their
//! partition's `Partition`, ticks, task reports, and the `Action`s these return carried out
//! (flush and check tasks, acquisitions, seeks, pauses, offset commits); rebalances (the
//! assignment and the revoke, called by `crate::consume::rebalance`'s callbacks) and the drain that
//! revokes and shutdown share.
//!
//! - [`daemon`]: the loop ([`daemon::Aggregator`]): shutdown, reports, ticks and messages, in
//!   one task.
//! - [`rebalance`]: the consumer's context: the rebalance callbacks, statistics and logs.
//! - [`dead_letter`]: the dead-letter topic for malformed messages.
//! - `expirer`: expiry records written into the partitions this aggregator owns.
//! - [`flush`]: making a sealed batch durable through the sink, with retries, its refused
//!   writes dead-lettered and its counters fed to trending.
//! - [`idempotency`]: idempotency keys, decided from the log and warmed up from it.
//! - `decide`: with tally's fetcher, the ids decided on a thread of their own.
//! - `source`: where records come from (librdkafka's consumer or tally's fetcher), the one
//!   place that tells the two read paths apart.
//! - `route`, `act`, `assign`: messages in, actions out, partitions assigned and revoked.
//!
//! Decisions are the state machine's (`crate::machine::partition`); this module does the I/O. A flush
//! runs as its own task, so that polling goes on while Redis is slow or down: the consumer keeps
//! its group membership (`max.poll.interval.ms` never expires).
//!
//! # Offsets
//! **An offset is committed only after everything before it is durable**: the commit is the
//! state machine's `Action::Commit`, which only a [`FlushOutcome::Durable`] produces. Auto-commit
//! is off. In exactly-once mode ([`Delivery::ExactlyOnce`]) the committed offset is only a
//! progress hint for lag monitoring: the truth is in Redis. A newly assigned partition is paused
//! while [`crate::store::fence::acquire`] stamps a new epoch into every group's fence and reads
//! where to resume; then it seeks there and resumes.
//!
//! # Rebalances and shutdown
//! The revoke runs synchronously inside the consumer's poll: before it returns it waits for the
//! revoked partitions' in-flight flushes, flushes what is left in their buffers, and commits
//! their offsets, bounded by `revoke_timeout`; what is not durable by then is not committed and
//! is read again by the next owner. Shutdown drains every partition the same way (bounded by
//! `shutdown_timeout`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rdkafka::message::{BorrowedMessage, Message as _};
use tally_common::regroup::{self, GroupPlan, PLAN_LEASE};
use tally_common::{Keyspace, Namespaces};
use tally_kafka::{Chunk, Fetcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::consume::decide::{Decisions, Ids, Registry};
use crate::consume::flush::Flusher;
use crate::consume::idempotency::{RecentIds, WarmUp};
use crate::machine::outcome::{FlushOutcome, Standing};
use crate::machine::ownership::{Owner, Resume};
use crate::machine::pace::Limits;
use crate::machine::partition::Partition;
use crate::operator::config::Delivery;
use crate::operator::metrics::Metrics;
use crate::store::sink::Sink;
use source::Source;

mod act;
mod assign;
pub mod daemon;
pub mod dead_letter;
mod decide;
mod expirer;
pub mod flush;
pub mod idempotency;
pub mod rebalance;
mod route;
mod source;

/// What the consume loop needs to know.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// The topic to consume.
    pub topic: String,
    /// Flush triggers as configured; each partition's are weighed for the sink at each tick
    /// (`Shared::limits`).
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
    /// Why it stopped by itself, if it did: the deployment moved on under it (a group's likes
    /// were moved to count sets, which fenced its writes and refuses it a partition there), and
    /// only a restart, which reads the layout again, can go on.
    pub outdated: Option<String>,
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
    /// from the log on each acquisition, shared with the decider (`decide`).
    ids: Option<Arc<Ids>>,
    /// With tally's fetcher: the epoch of the partition's last seek (chunks of another epoch
    /// were fetched before it and are dropped).
    epoch: u64,
    /// Where a leader change last truncated the partition's log under its position, until the
    /// acquisition that follows tells how much of it had been applied.
    truncated_to: Option<i64>,
    /// With tally's fetcher, while the partition is held
    /// ([`Action::Hold`](crate::machine::partition::Action::Hold)): the chunks fetched
    /// for it and not read yet (the first one perhaps in part), read in order once it resumes
    /// rather than dropped and fetched again. They stay within the fetcher's byte budget.
    held: Option<VecDeque<(Chunk, Option<Decisions>)>>,
    /// Its batches' limits: the configured ones weighed for the sink as it writes now
    /// (`Shared::limits`), refreshed at each tick, so that a Redis that starts refusing
    /// scripts has the next batches cut for its transactions, not only after a restart.
    limits: Limits,
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
        /// After a truncation of its log: where, and how far the ledgers had gone past it
        /// before they were moved back ([`crate::store::fence::rewind`]).
        rewound: Option<(i64, i64)>,
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
    /// Fired, with why, when the deployment moved on under this process ([`RunSummary::outdated`]).
    outdated: Arc<Outdated>,
    runtime: tokio::runtime::Handle,
    /// Rebuilds recent ids on acquisition, when a namespace keeps an idempotency window.
    warm_up: Option<Arc<WarmUp>>,
    /// The partitions' idempotency states, for the decider (`decide`) to find.
    ids: Registry,
    /// Where the partitions' records come from: librdkafka's consumer or tally's fetcher.
    pub(crate) source: Source,
    /// The deployment's group plan as last read ([`refresh_plan`]).
    pub(crate) plan: PlanCell,
}

/// The deployment's group plan (`tally_common::regroup`) as the loop last read it: the count
/// at-least-once writes place new offsets in, and the one resets and expiries clear.
#[derive(Debug)]
pub(crate) struct PlanCell {
    version: AtomicU64,
    write: AtomicU32,
    read: AtomicU32,
}

impl PlanCell {
    fn new(plan: &GroupPlan) -> Self {
        Self {
            version: AtomicU64::new(plan.version),
            write: AtomicU32::new(plan.write),
            read: AtomicU32::new(plan.read),
        }
    }

    /// Keeps `plan` unless a later one is held.
    fn set(&self, plan: &GroupPlan) {
        if plan.version >= self.version.load(Ordering::Acquire) {
            self.write.store(plan.write, Ordering::Release);
            self.read.store(plan.read, Ordering::Release);
            self.version.store(plan.version, Ordering::Release);
        }
    }

    /// `(version, write, read)`.
    pub(crate) fn get(&self) -> (u64, u32, u32) {
        (
            self.version.load(Ordering::Acquire),
            self.write.load(Ordering::Acquire),
            self.read.load(Ordering::Acquire),
        )
    }
}

/// Reads the deployment's group plan every [`PLAN_LEASE`] until `shutdown`, so that owners
/// notice a re-grouping (`Shared::tick`) within about a second.
pub(crate) async fn refresh_plan<S: Sink>(shared: Arc<Shared<S>>, shutdown: CancellationToken) {
    let keyspace = &shared.settings.keyspace;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(PLAN_LEASE) => {}
        }
        let stored = match shared.flusher.sink.read_plan().await {
            Ok(stored) => stored,
            // The store is down: owners will find out when they write.
            Err(_) => continue,
        };
        match regroup::checked(keyspace, keyspace.plan_key(), stored.as_deref()) {
            Ok(plan) => shared.plan.set(&plan),
            Err(error) => tracing::error!(%error, "the group plan cannot be used"),
        }
    }
}

/// A partition's recent ids as of `resume`, read from the log on a blocking thread; none to
/// read when the log starts at `resume` (by `watermarks`, its first offset and the one after its
/// last, if known): no consumer is then created.
async fn warm_up_ids(
    warm_up: &Arc<WarmUp>,
    partition: i32,
    resume: Resume,
    watermarks: Option<(i64, i64)>,
) -> Result<RecentIds, String> {
    let resume = match resume {
        Resume::At(resume) if watermarks.is_none_or(|(low, _)| resume > low) => resume,
        _ => return Ok(warm_up.empty()),
    };
    let reader = warm_up.clone();
    let warmed = tokio::task::spawn_blocking(move || reader.read(partition, resume, watermarks))
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

/// Stops the loop when the deployment moved on under this process: with why, once.
#[derive(Debug, Default)]
pub(crate) struct Outdated {
    why: std::sync::OnceLock<String>,
    fired: CancellationToken,
}

impl Outdated {
    /// Stops the loop (the first reason given is kept).
    pub(crate) fn fire(&self, why: String) {
        let _ = self.why.set(why);
        self.fired.cancel();
    }

    /// Why it fired, if it did.
    pub(crate) fn why(&self) -> Option<String> {
        self.why.get().cloned()
    }
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
            partitions: Mutex::new(Partitions::default()),
            flusher,
            metrics,
            done_tx,
            flushes: std::sync::atomic::AtomicU64::new(0),
            hard_stop: CancellationToken::new(),
            outdated: Arc::default(),
            runtime: tokio::runtime::Handle::current(),
            plan: PlanCell::new(&GroupPlan::initial(settings.keyspace.groups())),
            warm_up: warm_up.map(Arc::new),
            ids: Registry::default(),
            source: Source::new(fetcher),
            settings,
        });
        (shared, done_rx)
    }

    /// The batch limits for the sink as it writes now: likes weighed by what they cost its
    /// flush, and each group's entries at most what one of its writes may hold (both change
    /// when Redis starts refusing scripts, or `SINTERSTORE`).
    pub(crate) fn limits(&self) -> Limits {
        let sink = &self.flusher.sink;
        (self.settings.limits)
            .with_memberships_per_entry(sink.memberships_per_entry())
            .with_group_entries(sink.max_group_entries())
    }

    /// The partitions this aggregator owns now (exactly-once).
    pub(crate) fn owned_partitions(&self) -> Vec<i32> {
        let parts = lock(&self.partitions);
        (parts.map.iter())
            .filter(|(_, slot)| slot.machine.ledgers().is_some())
            .map(|(p, _)| *p)
            .collect()
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
