//! A flush: making one sealed batch durable, then reporting where its partition may resume.
//!
//! A flush first copies the batch's malformed messages to the dead-letter topic (waiting for
//! Kafka's acknowledgement), then applies the summed deltas through the [`Sink`], retrying with
//! capped backoff until they land or the flush is cancelled (shutdown or revoke deadline). Only a
//! flush that returns [`FlushOutcome::Durable`] lets its partition's offset move: **an offset is
//! never committed past work that is not durable.** A cancelled flush commits nothing, so its
//! messages are read again by whoever owns the partition next.
//!
//! In exactly-once mode (an [`Owner`] is given) each group write is fenced and deduplicated by the
//! group's ledger (see [`crate::store::fence`]). In either mode the groups' writes go out
//! together. In exactly-once mode, once all have landed, the partition's watermark moves (in the
//! same operation when the batch wrote only to the home group). A write refused by the fence ends
//! the flush as [`FlushOutcome::Fenced`] without waiting for the other groups: another aggregator
//! owns the partition now.
//! Counters that Redis cannot take (the sum would overflow 64 bits, or the key holds something
//! else) are dead-lettered with the reason and left out; the rest of the batch is applied.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use tokio_util::sync::CancellationToken;

use crate::consume::dead_letter::DeadLetterQueue;
use crate::machine::batch::{GroupBatch, SealedBatch};
use crate::machine::letter::DeadLetter;
use crate::machine::outcome::{FlushOutcome, Standing};
use crate::machine::ownership::Owner;
use crate::operator::metrics::Metrics;
use crate::store::fence::Watermark;
use crate::store::sink::{
    Applied, GroupWrite, IdleWrite, Marked, Refused, Rejection, Sink, SinkError, SinkErrorKind,
};
use tally_kafka::backoff::Backoff;

/// What every flush needs besides its batch.
#[derive(Debug, Clone)]
pub struct Flusher<S> {
    /// Where deltas go.
    pub sink: S,
    /// Where malformed messages go.
    pub dead_letters: DeadLetterQueue,
    /// Counts flushes, errors and latency.
    pub metrics: Arc<Metrics>,
    /// First retry delay.
    pub retry_initial: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// Trending sketches and the cache warmer, if on.
    pub trending: Option<Arc<crate::tasks::trending::Trending>>,
}

impl<S: Sink> Flusher<S> {
    /// Makes `batch` durable, retrying until it is, `cancel` fires, or (exactly-once, with
    /// `owner`) a fence refuses it.
    pub async fn flush(
        &self,
        partition: i32,
        mut batch: SealedBatch,
        owner: Option<Owner>,
        cancel: &CancellationToken,
    ) -> FlushOutcome {
        let started = Instant::now();
        if !self
            .send_dead_letters(partition, &batch.dead_letters, cancel)
            .await
        {
            return FlushOutcome::Cancelled;
        }
        let owner = match owner {
            None => {
                // Memberships never reach this path: dedup namespaces need exactly-once; nor do
                // expiries (expiring namespaces need it too). The groups' writes go out
                // together, as in exactly-once mode.
                let next_offset = batch.next_offset;
                let written = try_join_all(batch.groups.iter().map(|g| async move {
                    let rejected = self
                        .retry(partition, g.group, cancel, || {
                            self.sink.apply(g.group, &g.deltas, &g.windows, &g.resets)
                        })
                        .await
                        .ok_or(FlushOutcome::Cancelled)?;
                    if !rejected.is_empty() {
                        // The refused deltas were not applied (the rest was): dead-letter them.
                        let letters = rejected_letters(partition, g, next_offset, &rejected);
                        if !self.send_dead_letters(partition, &letters, cancel).await {
                            return Err(FlushOutcome::Cancelled);
                        }
                    }
                    Ok(())
                }))
                .await;
                if let Err(cancelled) = written {
                    return cancelled;
                }
                self.forget_cached(&batch).await;
                None
            }
            Some(owner) => match self
                .flush_fenced(partition, &mut batch, owner, cancel)
                .await
            {
                Ok(owner) => Some(owner),
                Err(outcome) => return outcome,
            },
        };
        let writes = batch.writes();
        self.metrics
            .batch_flushed(batch.events, writes, started.elapsed());
        tracing::debug!(
            partition,
            events = batch.events,
            writes,
            next_offset = batch.next_offset,
            ms = started.elapsed().as_millis(),
            "flushed"
        );
        FlushOutcome::Durable {
            next_offset: batch.next_offset,
            owner,
        }
    }

    /// The exactly-once path: one fenced write per group, then the watermark.
    async fn flush_fenced(
        &self,
        partition: i32,
        batch: &mut SealedBatch,
        mut owner: Owner,
        cancel: &CancellationToken,
    ) -> Result<Owner, FlushOutcome> {
        let next_offset = batch.next_offset;
        if !batch.expiries.is_empty() || !batch.touched.is_empty() {
            let write = IdleWrite {
                home: owner.home,
                field: &owner.field,
                epoch: owner.epoch,
                expiries: &batch.expiries,
                touched: &batch.touched,
            };
            let marked = self
                .retry(partition, owner.home, cancel, || self.sink.mark_idle(write))
                .await
                .ok_or(FlushOutcome::Cancelled)?;
            match marked {
                Marked::Decided(expired) => {
                    let expired = batch.settle(&expired);
                    self.metrics.expired(expired);
                    if expired > 0 && abort_after_expiry() {
                        tracing::error!(partition, "failpoint: aborting after an expiry decision");
                        std::process::abort();
                    }
                }
                Marked::Refused(Applied::Fenced) => return Err(self.fenced(partition, owner.home)),
                Marked::Refused(_) => return Err(self.rolled_back(partition, owner.home)),
            }
        }
        // A batch that wrote only into the home group moves the watermark in the same operation.
        let home_only = batch.groups.len() == 1 && batch.groups[0].group == owner.home;
        let watermark = home_only.then(|| {
            let mut after = owner.ledgers.clone();
            after[owner.home as usize] = next_offset;
            Watermark::new(next_offset, &after, owner.spread.clone()).encode()
        });
        // The groups' writes go out together: each is fenced and ledgered on its own, so they
        // may land in any order (a crash between them leaves what a crash between writes one
        // after the other left), and a flush waits for Redis once rather than once per group
        // behind the other partitions' writes.
        let groups = batch.groups.len();
        let landed = AtomicUsize::new(0);
        {
            let owner = &owner;
            let (watermark, landed) = (watermark.as_deref(), &landed);
            // The first write that does not land ends the flush, and the others are dropped
            // where they are (as a crash would leave them).
            try_join_all((batch.groups.iter_mut()).map(|g| async move {
                self.write_group(partition, g, owner, next_offset, watermark, cancel)
                    .await?;
                if landed.fetch_add(1, Ordering::Relaxed) + 1 < groups {
                    abort_mid_flush(partition);
                }
                Ok(())
            }))
            .await?;
        }
        for g in &batch.groups {
            owner.ledgers[g.group as usize] = next_offset;
        }
        if !home_only {
            let watermark = owner.watermark(next_offset).encode();
            let home = owner.home;
            let applied = self
                .retry(partition, home, cancel, || {
                    self.sink
                        .write_watermark(home, &owner.field, owner.epoch, &watermark)
                })
                .await
                .ok_or(FlushOutcome::Cancelled)?;
            match applied {
                Applied::Fenced => return Err(self.fenced(partition, home)),
                Applied::RolledBack => return Err(self.rolled_back(partition, home)),
                _ => {}
            }
        }
        self.forget_cached(batch).await;
        Ok(owner)
    }

    /// Writes group `g`'s part of a batch ending at `next_offset`, fenced by `owner`, retrying
    /// until it lands; its refused entries are dead-lettered and the rest written again.
    async fn write_group(
        &self,
        partition: i32,
        g: &mut GroupBatch,
        owner: &Owner,
        next_offset: i64,
        watermark: Option<&str>,
        cancel: &CancellationToken,
    ) -> Result<(), FlushOutcome> {
        let group = g.group;
        loop {
            let write = GroupWrite {
                group,
                field: &owner.field,
                epoch: owner.epoch,
                expected_ledger: owner.ledgers[group as usize],
                next_offset,
                deltas: &g.deltas,
                windows: &g.windows,
                resets: &g.resets,
                members: &g.members,
                watermark,
            };
            let applied = self
                .retry(partition, group, cancel, || self.sink.apply_fenced(write))
                .await
                .ok_or(FlushOutcome::Cancelled)?;
            match applied {
                Applied::Written => return Ok(()),
                Applied::AlreadyApplied => {
                    self.metrics.repeated_write();
                    return Ok(());
                }
                Applied::Fenced => return Err(self.fenced(partition, group)),
                Applied::RolledBack => return Err(self.rolled_back(partition, group)),
                Applied::Rejected(rejected) => {
                    let letters = rejected_letters(partition, g, next_offset, &rejected);
                    if !self.send_dead_letters(partition, &letters, cancel).await {
                        return Err(FlushOutcome::Cancelled);
                    }
                    // Highest index first in each list, so that a removal never moves an
                    // entry still to be removed.
                    let mut refused: Vec<Refused> = rejected.iter().map(|r| r.refused).collect();
                    refused.sort_unstable_by(|a, b| b.cmp(a));
                    refused.dedup();
                    let mut members = Vec::new();
                    for r in refused {
                        match r {
                            Refused::Delta(i) => {
                                g.deltas.swap_remove(i);
                            }
                            Refused::Window(i) => {
                                g.windows.swap_remove(i);
                            }
                            Refused::Member(i) => members.push(i),
                        }
                    }
                    g.members.remove(&members);
                }
            }
        }
    }

    /// Drops the shared cached totals of the counters the batch reset (best effort: they expire
    /// within their namespace's TTL anyway).
    async fn forget_cached(&self, batch: &SealedBatch) {
        let mut reset: Vec<String> = (batch.groups.iter())
            .flat_map(|g| g.resets.iter().map(|r| r.counter.clone()))
            .collect();
        if reset.is_empty() {
            return;
        }
        reset.sort_unstable();
        reset.dedup();
        if let Err(error) = self.sink.forget_cached(&reset).await {
            tracing::warn!(%error, "could not drop the cached totals of reset counters");
        }
    }

    /// Checks an idle partition's standing in Redis ([`crate::store::fence::verify`]): a rollback found
    /// here re-feeds the partition without waiting for its next event.
    pub async fn verify(&self, partition: i32, owner: &Owner) -> Standing {
        match crate::store::fence::verify(&self.sink, owner).await {
            Ok(Applied::Written) => Standing::Held,
            Ok(Applied::Fenced) => {
                self.fenced(partition, owner.home);
                Standing::Fenced
            }
            Ok(_) => {
                self.rolled_back(partition, owner.home);
                Standing::RolledBack
            }
            Err(error) => {
                // The next check (or the next flush) asks again.
                self.metrics.redis_error();
                tracing::debug!(partition, %error, "checking an idle partition failed");
                Standing::Held
            }
        }
    }

    fn fenced(&self, partition: i32, group: u32) -> FlushOutcome {
        self.metrics.fenced();
        tracing::warn!(
            partition,
            group,
            "write refused by the fence: another aggregator owns this partition now"
        );
        FlushOutcome::Fenced
    }

    fn rolled_back(&self, partition: i32, group: u32) -> FlushOutcome {
        self.metrics.rolled_back();
        tracing::warn!(
            partition,
            group,
            "Redis lost writes this partition had made (restarted from an older state): re-feeding it from Kafka"
        );
        FlushOutcome::RolledBack
    }

    /// Copies `letters` to the dead-letter topic, retrying each until Kafka acknowledges it.
    /// False if cancelled first.
    async fn send_dead_letters(
        &self,
        partition: i32,
        letters: &[DeadLetter],
        cancel: &CancellationToken,
    ) -> bool {
        for letter in letters {
            let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
            loop {
                match self.dead_letters.send(letter).await {
                    Ok(()) => {
                        self.metrics.dead_lettered(letter.reason);
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(partition, offset = letter.offset, %error, "dead-letter write failed; retrying");
                        if sleep_or_cancel(backoff.next_delay(), cancel).await {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// Runs `op` until it succeeds, with capped backoff; `None` if cancelled first.
    async fn retry<T, F, Fut>(
        &self,
        partition: i32,
        group: u32,
        cancel: &CancellationToken,
        mut op: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, SinkError>>,
    {
        let mut backoff = Backoff::new(self.retry_initial, self.retry_max);
        loop {
            let attempt = tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                result = op() => result,
            };
            match attempt {
                Ok(value) => return Some(value),
                Err(error) => {
                    self.metrics.redis_error();
                    match error.kind {
                        SinkErrorKind::Retryable => {
                            tracing::warn!(partition, group, %error, "store write failed; retrying")
                        }
                        SinkErrorKind::Fatal => tracing::error!(
                            partition, group, %error,
                            "the store refused the write; retrying, but this needs an operator"
                        ),
                    }
                    if sleep_or_cancel(backoff.next_delay(), cancel).await {
                        return None;
                    }
                }
            }
        }
    }
}

/// Dead letters for deltas that Redis cannot take: the summed delta and why, one per counter.
fn rejected_letters(
    partition: i32,
    batch: &GroupBatch,
    next_offset: i64,
    rejected: &[Rejection],
) -> Vec<DeadLetter> {
    let group = batch.group;
    let (deltas, windows, members) = (&batch.deltas, &batch.windows, &batch.members);
    rejected
        .iter()
        .map(|rejection| {
            let (counter, payload, delta) = match rejection.refused {
                Refused::Delta(i) => {
                    let (counter, delta) = &deltas[i];
                    let payload = serde_json::json!({ "counter": counter, "delta": delta });
                    (counter.as_str(), payload, *delta)
                }
                Refused::Window(i) => {
                    let w = &windows[i];
                    let payload = serde_json::json!({
                        "counter": &*w.counter,
                        "delta": w.delta,
                        "window_ms": w.width_ms,
                        "bucket_start_ms": w.start_ms,
                    });
                    (&*w.counter, payload, w.delta)
                }
                Refused::Member(i) => {
                    let m = members.get(i);
                    let delta = if m.like { 1 } else { -1 };
                    let payload = serde_json::json!({ "counter": m.counter, "actor": m.actor, "delta": delta });
                    (m.counter, payload, delta)
                }
            };
            DeadLetter {
                key: Some(counter.as_bytes().to_vec()),
                payload: Some(payload.to_string().into_bytes()),
                reason: rejection.reason,
                error: format!(
                    "the summed delta {delta} of {counter} (messages up to offset {}) cannot be added in group {group}: {}",
                    next_offset - 1,
                    rejection.reason
                ),
                partition,
                offset: next_offset - 1,
            }
        })
        .collect()
}

/// Test-only failpoint (`TALLY_FAILPOINT_ABORT_AFTER_EXPIRY`): abort the process right after the
/// home group decided that a counter expired, before any group is written, so that the replay
/// must decide every group's part from the recorded decision.
fn abort_after_expiry() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TALLY_FAILPOINT_ABORT_AFTER_EXPIRY").is_some())
}

/// Test-only failpoint (`TALLY_FAILPOINT_ABORT_MID_FLUSH=n`): abort the process right after the
/// `n`th group write to land while other groups of its flush have not, so that a restart finds
/// one flush applied in some groups and not others.
fn abort_mid_flush(partition: i32) {
    static AFTER: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    static SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let after = AFTER.get_or_init(|| {
        let value = std::env::var("TALLY_FAILPOINT_ABORT_MID_FLUSH").ok()?;
        value.parse().ok()
    });
    if let Some(after) = *after {
        let seen = SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if seen >= after {
            eprintln!("failpoint: aborting in the middle of a flush of partition {partition}");
            std::process::abort();
        }
    }
}

/// Sleeps for `delay`; true if `cancel` fired first.
async fn sleep_or_cancel(delay: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(delay) => false,
    }
}

/// The flush, the fences and the partition state machine together, over an in-memory store
/// with faults on demand (`crate::store::memory_sink`).
#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use rdkafka::ClientConfig;
    use tally_common::Keyspace;
    use tally_common::keyspace::Fan;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::consume::dead_letter::DeadLetterQueue;
    use crate::machine::outcome::{FlushOutcome, Standing};
    use crate::machine::ownership::{Owner, Resume};
    use crate::machine::pace::{Limits, MEMBERSHIPS_PER_ENTRY, Size};
    use crate::machine::partition::{Action, Entry, Partition};
    use crate::operator::metrics::Metrics;
    use crate::store::fence::{self, Watermark};
    use crate::store::memory_sink::MemorySink;
    use crate::store::sink::SinkErrorKind;

    const TOPIC: &str = "events";

    fn keyspace() -> Keyspace {
        Keyspace::new("t".to_owned(), 4).expect("keyspace")
    }

    fn flusher(sink: &MemorySink) -> Flusher<MemorySink> {
        // Never sent to: these batches hold no dead letters.
        let mut kafka = ClientConfig::new();
        kafka.set("bootstrap.servers", "127.0.0.1:9");
        Flusher {
            sink: sink.clone(),
            dead_letters: DeadLetterQueue::new(&kafka, "dlq", TOPIC).expect("producer"),
            metrics: Arc::new(Metrics::new()),
            retry_initial: Duration::from_millis(1),
            retry_max: Duration::from_millis(2),
            trending: None,
        }
    }

    fn limits() -> Limits {
        let size = Size {
            max_events: 3,
            max_counters: 100,
            memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
            max_group_entries: usize::MAX,
        };
        Limits {
            flush_interval: Duration::from_secs(1),
            live: size,
            catch_up: size,
            catch_up_interval: Duration::from_secs(10),
        }
    }

    async fn acquire(sink: &MemorySink) -> (Owner, Resume) {
        acquire_spread(sink, 1).await
    }

    async fn acquire_spread(sink: &MemorySink, spread: u32) -> (Owner, Resume) {
        fence::acquire(sink, &keyspace(), TOPIC, 0, spread)
            .await
            .expect("acquired")
    }

    /// A partition owned by `owner`, positioned at `resume`.
    fn positioned(owner: Owner, resume: Resume) -> Partition {
        let (mut p, _) = Partition::assigned(
            0,
            1,
            true,
            Duration::from_secs(1),
            Instant::now(),
            SystemTime::now(),
        );
        p.on_acquired(owner, resume, None);
        assert!(matches!(p.on_seek(true, Instant::now()), Action::Resume));
        p
    }

    /// Feeds `likes:post:1 +1` at each offset, on the partition's home group.
    fn feed(p: &mut Partition, offsets: std::ops::Range<i64>) -> Vec<Action> {
        let group = keyspace().group_for_partition(0);
        let limits = limits();
        offsets
            .filter_map(|offset| {
                let entry = Entry::Delta {
                    group,
                    counter: "likes:post:1",
                    delta: 1,
                    buckets: &[],
                    idle_deadline: None,
                };
                p.on_message(offset, entry, &limits).1
            })
            .collect()
    }

    /// A token cancelled 20 ms from now (a shutdown deadline ending a flush that keeps failing).
    fn cancelled_soon() -> CancellationToken {
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            stop.cancel();
        });
        cancel
    }

    /// Runs the one flush in `actions`, returning its outcome.
    async fn run_flush(
        flusher: &Flusher<MemorySink>,
        actions: Vec<Action>,
        cancel: &CancellationToken,
    ) -> FlushOutcome {
        let mut flushes = actions.into_iter().filter_map(|a| match a {
            Action::Flush { batch, owner } => Some((batch, owner)),
            _ => None,
        });
        let (batch, owner) = flushes.next().expect("a flush");
        flusher.flush(0, batch, owner, cancel).await
    }

    fn commits(actions: &[Action]) -> Vec<i64> {
        (actions.iter())
            .filter_map(|a| match a {
                Action::Commit(offset) => Some(*offset),
                _ => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_truncated_log_moves_the_ledgers_back_and_the_new_records_count() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let never = CancellationToken::new();
        let (owner, resume) = acquire(&sink).await;
        let old = owner.clone();
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed(&mut p, 0..3), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable { next_offset: 3, .. }
        ));
        // The log is truncated at 1 (offsets 1 and 2 lost, applied) and the new leader writes
        // three records from 1 on: the next owner moves the ledger back and counts them.
        let (mut owner, resume) = acquire(&sink).await;
        assert_eq!(resume, Resume::At(3));
        let home = keyspace().group_for_partition(0) as usize;
        assert_eq!(fence::rewind(&sink, &mut owner, 1).await.ok(), Some(2));
        assert_eq!(owner.ledgers[home], 1);
        let mut zombie = old;
        zombie.ledgers[home] = 3;
        let refused = fence::rewind(&sink, &mut zombie, 0).await;
        assert!(refused.is_err(), "an older owner moves nothing");
        let (_, resume) = acquire(&sink).await;
        assert_eq!(resume, Resume::At(1), "resumes at the truncation point");
        let (mut owner, _) = acquire(&sink).await;
        assert_eq!(fence::rewind(&sink, &mut owner, 1).await.ok(), Some(0));
        let mut p = positioned(owner, Resume::At(1));
        let outcome = run_flush(&flusher, feed(&mut p, 1..4), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable { next_offset: 4, .. }
        ));
        // 1 kept, 2 lost but counted, 3 new.
        assert_eq!(sink.snapshot().total("likes:post:1"), 6);
    }

    #[tokio::test]
    async fn a_flush_that_never_lands_commits_nothing_and_a_replay_counts_once() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let (owner, resume) = acquire(&sink).await;
        let mut p = positioned(owner, resume);
        let flush = feed(&mut p, 0..3);
        // Redis unreachable until the flush is cancelled (a shutdown deadline): no commit.
        sink.fail_next(u32::MAX);
        let cancel = cancelled_soon();
        let outcome = run_flush(&flusher, flush, &cancel).await;
        assert_eq!(outcome, FlushOutcome::Cancelled);
        assert!(commits(&p.on_flushed(outcome, &limits(), Instant::now())).is_empty());
        assert_eq!(sink.snapshot().total("likes:post:1"), 0);

        // Redis back: the next owner resumes from the start and counts each event once, even
        // when its flush is applied twice (a retry of a write that had landed).
        sink.fail_next(0);
        let (owner, resume) = acquire(&sink).await;
        assert_eq!(resume, Resume::Beginning);
        let mut p = positioned(owner.clone(), resume);
        let mut same = positioned(owner, resume);
        let never = CancellationToken::new();
        let first = run_flush(&flusher, feed(&mut p, 0..3), &never).await;
        let again = run_flush(&flusher, feed(&mut same, 0..3), &never).await;
        assert!(matches!(
            first,
            FlushOutcome::Durable { next_offset: 3, .. }
        ));
        assert!(matches!(
            again,
            FlushOutcome::Durable { next_offset: 3, .. }
        ));
        assert_eq!(sink.snapshot().total("likes:post:1"), 3);
        assert_eq!(
            commits(&p.on_flushed(first, &limits(), Instant::now())),
            [3]
        );
        // A later owner resumes after what is durable.
        assert_eq!(acquire(&sink).await.1, Resume::At(3));
    }

    #[tokio::test]
    async fn an_unreadable_watermark_fails_the_next_acquire_as_fatal() {
        let sink = MemorySink::default();
        let (owner, _) = acquire(&sink).await;
        // Spread steps out of offset order: read as absent, it would drop the log's history.
        let written = sink
            .write_watermark(
                owner.home,
                &owner.field,
                owner.epoch,
                "40;s=2@300;s=4@100;s=1",
            )
            .await
            .expect("written");
        assert_eq!(written, Applied::Written);
        let error = fence::acquire(&sink, &keyspace(), TOPIC, 0, 1)
            .await
            .expect_err("an unreadable watermark");
        assert_eq!(error.kind, SinkErrorKind::Fatal);
        assert!(error.to_string().contains("unreadable"), "{error}");
    }

    #[tokio::test]
    async fn a_zombie_owner_is_fenced_and_writes_nothing() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let (old, resume) = acquire(&sink).await;
        let mut zombie = positioned(old.clone(), resume);
        // A new owner takes the partition while the old one still buffers.
        let (new, _) = acquire(&sink).await;
        let outcome = run_flush(&flusher, feed(&mut zombie, 0..3), &CancellationToken::new()).await;
        assert_eq!(outcome, FlushOutcome::Fenced);
        let actions = zombie.on_flushed(outcome, &limits(), Instant::now());
        assert!(matches!(actions.as_slice(), [Action::Pause]));
        assert_eq!(sink.snapshot().total("likes:post:1"), 0);
        // The new owner's standing holds; the zombie's does not.
        assert_eq!(flusher.verify(0, &new).await, Standing::Held);
        assert_eq!(flusher.verify(0, &old).await, Standing::Fenced);
    }

    #[tokio::test]
    async fn a_store_that_lost_writes_is_seen_by_the_next_flush_and_by_the_idle_check() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let never = CancellationToken::new();
        let (owner, resume) = acquire(&sink).await;
        let before = sink.snapshot();
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed(&mut p, 0..3), &never).await;
        let FlushOutcome::Durable {
            owner: Some(after), ..
        } = outcome.clone()
        else {
            panic!("durable: {outcome:?}");
        };
        p.on_flushed(outcome, &limits(), Instant::now());
        assert_eq!(flusher.verify(0, &after).await, Standing::Held);

        // Redis comes back from a snapshot taken before that flush.
        sink.restore(before);
        assert_eq!(flusher.verify(0, &after).await, Standing::RolledBack);
        let outcome = run_flush(&flusher, feed(&mut p, 3..6), &never).await;
        assert_eq!(outcome, FlushOutcome::RolledBack);
        let actions = p.on_flushed(outcome, &limits(), Instant::now());
        assert!(matches!(
            actions.as_slice(),
            [Action::Pause, Action::Acquire]
        ));
        // Re-acquired, it resumes from where Redis now stands: the lost events are re-fed.
        let (owner, resume) = acquire(&sink).await;
        assert_eq!(resume, Resume::Beginning);
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed(&mut p, 0..3), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable { next_offset: 3, .. }
        ));
        assert_eq!(sink.snapshot().total("likes:post:1"), 3);
    }

    /// Feeds `c<offset % 40> +1` at each offset, each into the group its spread there puts it,
    /// as one batch.
    fn feed_spread(p: &mut Partition, offsets: std::ops::Range<i64>) -> Vec<Action> {
        let keyspace = keyspace();
        let mut limits = limits();
        limits.live.max_events = (offsets.end - offsets.start) as usize;
        limits.catch_up = limits.live;
        let counters: Vec<String> = (0..40).map(|c| format!("c{c}")).collect();
        offsets
            .filter_map(|offset| {
                let counter = &counters[(offset % 40) as usize];
                let fan = p.fan_at(offset).expect("owned");
                let rule = tally_common::GroupingRule::ByPartition;
                let entry = Entry::Delta {
                    group: keyspace.group_for_event(rule, 0, None, counter, fan),
                    counter,
                    delta: 1,
                    buckets: &[],
                    idle_deadline: None,
                };
                p.on_message(offset, entry, &limits).1
            })
            .collect()
    }

    #[tokio::test]
    async fn a_new_spread_starts_after_what_a_crashed_flush_applied_and_counts_once() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let never = CancellationToken::new();
        let totals = |n| (0..40).all(|c| sink.snapshot().total(&format!("c{c}")) == n);

        // Spread 1: offsets 0..40 land in the home group.
        let (owner, resume) = acquire_spread(&sink, 1).await;
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed_spread(&mut p, 0..40), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable {
                next_offset: 40,
                ..
            }
        ));
        assert!(totals(1));

        // A new owner at spread 4 records it before writing: 1 below 40, 4 from there.
        let (owner, resume) = acquire_spread(&sink, 4).await;
        assert_eq!(resume, Resume::At(40));
        let stored = sink.snapshot().watermarks.values().next().cloned();
        let stored = Watermark::parse(&stored.expect("a watermark")).expect("parses");
        assert_eq!(
            (
                stored.next_offset,
                stored.spread.at(39),
                stored.spread.at(40)
            ),
            (40, 1, 4)
        );
        // Its flush of 40..80 spreads over 4 groups, and crashes after the first group's write.
        let mut p = positioned(owner, resume);
        let flush = feed_spread(&mut p, 40..80);
        sink.fail_after(1, u32::MAX);
        let cancel = cancelled_soon();
        assert_eq!(
            run_flush(&flusher, flush, &cancel).await,
            FlushOutcome::Cancelled
        );
        let applied: i64 = sink.snapshot().counters.values().sum::<i64>() - 40;
        assert!(
            (1..40).contains(&applied),
            "one group of four took its part of the 40 counters, not {applied}"
        );
        sink.fail_next(0);

        // The next owner is configured for spread 2: 40..80 replay at 4, as first written, and
        // its spread starts at 80, past the highest ledger entry.
        let (owner, resume) = acquire_spread(&sink, 2).await;
        assert_eq!(resume, Resume::At(40));
        assert_eq!((owner.spread.at(79), owner.spread.at(80)), (4, 2));
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed_spread(&mut p, 40..120), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable {
                next_offset: 120,
                ..
            }
        ));
        assert!(totals(3), "{:?}", sink.snapshot().counters);
        // And a later owner at spread 2 resumes after it with nothing to record.
        let before = sink.snapshot().watermarks;
        let (owner, resume) = acquire_spread(&sink, 2).await;
        assert_eq!(
            (resume, owner.spread.at(0), owner.spread.at(100)),
            (Resume::At(120), 1, 2)
        );
        assert_eq!(sink.snapshot().watermarks, before);
    }

    #[tokio::test]
    async fn growing_the_groups_mid_log_places_later_offsets_in_the_new_ones_and_counts_once() {
        let sink = MemorySink::default();
        let flusher = flusher(&sink);
        let never = CancellationToken::new();
        let totals = |n| (0..40).all(|c| sink.snapshot().total(&format!("c{c}")) == n);
        let in_new_groups = || {
            (sink.snapshot().counters.iter())
                .filter(|((group, _), value)| *group >= 4 && **value != 0)
                .count()
        };

        // Four groups, spread 2: offsets 0..40.
        let (owner, resume) = acquire_spread(&sink, 2).await;
        assert_eq!(owner.ledgers.len(), 4);
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed_spread(&mut p, 0..40), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable {
                next_offset: 40,
                ..
            }
        ));
        assert_eq!(in_new_groups(), 0);

        // Re-grouped to 8: the next owner stamps 8 groups and places offsets from 40 in 8.
        let mut state = sink.snapshot();
        state.plan = Some("v=2;origin=4;write=8;read=8".to_owned());
        sink.restore(state);
        let (owner, resume) = acquire_spread(&sink, 2).await;
        assert_eq!(
            (owner.ledgers.len(), owner.plan_version, resume),
            (8, 2, Resume::At(40))
        );
        assert_eq!(owner.spread.fan_at(39), Fan::of(2));
        assert_eq!(
            owner.spread.fan_at(40),
            Fan {
                k: 2,
                groups: Some(8)
            }
        );
        let stored = sink.snapshot().watermarks.values().next().cloned();
        assert!(stored.expect("a watermark").ends_with(";s=2@40;s=2/8"));

        // Its flush of 40..80 crashes after its first group write.
        let mut p = positioned(owner, resume);
        let flush = feed_spread(&mut p, 40..80);
        sink.fail_after(1, u32::MAX);
        let cancel = cancelled_soon();
        assert_eq!(
            run_flush(&flusher, flush, &cancel).await,
            FlushOutcome::Cancelled
        );
        sink.fail_next(0);

        // The next owner replays 40..80 as first placed, and every event counts once.
        let (owner, resume) = acquire_spread(&sink, 2).await;
        assert_eq!(resume, Resume::At(40));
        let mut p = positioned(owner, resume);
        let outcome = run_flush(&flusher, feed_spread(&mut p, 40..120), &never).await;
        assert!(matches!(
            outcome,
            FlushOutcome::Durable {
                next_offset: 120,
                ..
            }
        ));
        assert!(totals(3), "{:?}", sink.snapshot().counters);
        assert!(in_new_groups() > 0, "{:?}", sink.snapshot().counters);

        // A plan made for another original count is refused, for good.
        let mut state = sink.snapshot();
        state.plan = Some("v=3;origin=16;write=16;read=16".to_owned());
        sink.restore(state);
        let refused = fence::acquire(&sink, &keyspace(), TOPIC, 0, 2)
            .await
            .expect_err("another origin");
        assert!(
            refused.to_string().contains("created with 16 shard groups"),
            "{refused}"
        );
    }
}
