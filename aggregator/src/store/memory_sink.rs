//! [`MemorySink`]: a [`Sink`] in memory, for unit tests of the flush, the fences and the
//! partition state machine together, with faults on demand: failed writes, a newer owner, and a
//! store that goes back to an older state. It decides every exactly-once operation with the same
//! functions as the `WATCH`/`MULTI`/`EXEC` path (`crate::store::transactions`: `flush_verdict`,
//! `next_epoch_after`, `stamp_refusal`, `watermark_refusal`), which mirror the Lua scripts. Evidence that tally works comes from the end-to-end tests against
//! a real Redis; these tests pin down the rules, in milliseconds.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::machine::batch::WindowDelta;
use crate::machine::verdict::{
    Current, MemberState, flush_verdict, next_epoch_after, stamp_refusal, watermark_refusal,
};
use crate::store::sink::{Applied, GroupWrite, Rejection, Sink, SinkError, Stamp};

/// Everything the store holds, per shard group and key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// `(group, counter)` → share.
    pub(crate) counters: HashMap<(u32, String), i64>,
    /// `(group, field)` → the fence's epoch.
    fences: HashMap<(u32, String), u64>,
    /// `(group, field)` → the ledger entry.
    ledgers: HashMap<(u32, String), i64>,
    /// `(home, field)` → the epoch counter.
    epochs: HashMap<(u32, String), u64>,
    /// `(home, field)` → the watermark.
    watermarks: HashMap<(u32, String), String>,
}

impl State {
    /// A counter's total over every group.
    pub(crate) fn total(&self, counter: &str) -> i64 {
        (self.counters.iter())
            .filter(|((_, c), _)| c == counter)
            .map(|(_, v)| v)
            .sum()
    }
}

/// A [`Sink`] in memory. Clones share the store.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemorySink {
    state: Arc<Mutex<State>>,
    /// Operations still to let through, then operations still to fail (a connection error
    /// each).
    failures: Arc<Mutex<(u32, u32)>>,
}

impl MemorySink {
    /// What the store holds now.
    pub(crate) fn snapshot(&self) -> State {
        self.lock().clone()
    }

    /// Puts the store back to an older state (a Redis restarted from an old snapshot).
    pub(crate) fn restore(&self, state: State) {
        *self.lock() = state;
    }

    /// Makes the next `n` operations fail with a connection error.
    pub(crate) fn fail_next(&self, n: u32) {
        self.fail_after(0, n);
    }

    /// Lets `grace` operations through, then fails `n` (a crash between two group writes).
    pub(crate) fn fail_after(&self, grace: u32, n: u32) {
        *self.failures.lock().unwrap_or_else(PoisonError::into_inner) = (grace, n);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store, unless this operation is one that must fail.
    fn reach(&self) -> Result<std::sync::MutexGuard<'_, State>, SinkError> {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let (grace, failing) = &mut *failures;
        if *grace > 0 {
            *grace -= 1;
        } else if *failing > 0 {
            *failing -= 1;
            let error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "injected");
            return Err(redis::RedisError::from(error).into());
        }
        Ok(self.lock())
    }

    fn apply_now(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[String],
    ) -> Result<Vec<Rejection>, SinkError> {
        assert!(
            windows.is_empty() && resets.is_empty(),
            "windows and resets are not modelled here"
        );
        let mut state = self.reach()?;
        for (counter, delta) in deltas {
            *state.counters.entry((group, counter.clone())).or_default() += delta;
        }
        Ok(Vec::new())
    }

    fn apply_fenced_now(&self, write: GroupWrite<'_>) -> Result<Applied, SinkError> {
        let mut state = self.reach()?;
        let key = (write.group, write.field.to_owned());
        let currents: Vec<Current> = (write.deltas.iter())
            .map(|(counter, _)| {
                let value = state.counters.get(&(write.group, counter.clone()));
                value.map_or(Current::Missing, |v| Current::Integer(*v))
            })
            .collect();
        assert!(
            write.members.is_empty() && write.windows.is_empty() && write.resets.is_empty(),
            "memberships, windows and resets are not modelled here"
        );
        let members: [MemberState; 0] = [];
        let fence = state.fences.get(&key).copied();
        let ledger = state.ledgers.get(&key).copied();
        if let Some(verdict) = flush_verdict(fence, ledger, &currents, &[], &members, &write) {
            return Ok(verdict);
        }
        for (counter, delta) in write.deltas {
            *state
                .counters
                .entry((write.group, counter.clone()))
                .or_default() += delta;
        }
        state.ledgers.insert(key.clone(), write.next_offset);
        if let Some(watermark) = write.watermark {
            state.watermarks.insert(key, watermark.to_owned());
        }
        Ok(Applied::Written)
    }

    fn next_epoch_now(&self, home: u32, field: &str, at_least: u64) -> Result<u64, SinkError> {
        let mut state = self.reach()?;
        let epoch = state.epochs.entry((home, field.to_owned())).or_default();
        *epoch = next_epoch_after(Some(*epoch), at_least);
        Ok(*epoch)
    }

    fn stamp_fence_now(&self, group: u32, field: &str, epoch: u64) -> Result<Stamp, SinkError> {
        let mut state = self.reach()?;
        let key = (group, field.to_owned());
        if let Some(stale) = stamp_refusal(state.fences.get(&key).copied(), epoch) {
            return Ok(stale);
        }
        state.fences.insert(key.clone(), epoch);
        let ledger = state.ledgers.get(&key).copied().unwrap_or(-1);
        Ok(Stamp::Stamped { ledger })
    }

    fn write_watermark_now(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> Result<Applied, SinkError> {
        let mut state = self.reach()?;
        let key = (home, field.to_owned());
        if let Some(refused) = watermark_refusal(state.fences.get(&key).copied(), epoch) {
            return Ok(refused);
        }
        state.watermarks.insert(key, watermark.to_owned());
        Ok(Applied::Written)
    }
}

impl Sink for MemorySink {
    fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[String],
    ) -> impl Future<Output = Result<Vec<Rejection>, SinkError>> + Send {
        std::future::ready(self.apply_now(group, deltas, windows, resets))
    }

    fn apply_fenced(
        &self,
        write: GroupWrite<'_>,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        std::future::ready(self.apply_fenced_now(write))
    }

    fn next_epoch(
        &self,
        home: u32,
        field: &str,
        at_least: u64,
    ) -> impl Future<Output = Result<u64, SinkError>> + Send {
        std::future::ready(self.next_epoch_now(home, field, at_least))
    }

    fn stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> impl Future<Output = Result<Stamp, SinkError>> + Send {
        std::future::ready(self.stamp_fence_now(group, field, epoch))
    }

    fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        std::future::ready(self.write_watermark_now(home, field, epoch, watermark))
    }

    fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        let rewound = self.reach().map(|mut state| {
            let key = (group, field.to_owned());
            if let Some(refused) = watermark_refusal(state.fences.get(&key).copied(), epoch) {
                return refused;
            }
            if let Some(ledger) = state.ledgers.get_mut(&key).filter(|l| **l > to) {
                *ledger = to;
            }
            Applied::Written
        });
        std::future::ready(rewound)
    }

    fn read_fence_and_ledger(
        &self,
        group: u32,
        field: &str,
    ) -> impl Future<Output = Result<(Option<u64>, Option<i64>), SinkError>> + Send {
        let read = self.reach().map(|state| {
            let key = (group, field.to_owned());
            (
                state.fences.get(&key).copied(),
                state.ledgers.get(&key).copied(),
            )
        });
        std::future::ready(read)
    }

    fn read_watermark(
        &self,
        home: u32,
        field: &str,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send {
        let read = self
            .reach()
            .map(|state| state.watermarks.get(&(home, field.to_owned())).cloned());
        std::future::ready(read)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use rdkafka::ClientConfig;
    use tally_common::Keyspace;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::consume::dead_letter::DeadLetterQueue;
    use crate::machine::outcome::{FlushOutcome, Standing};
    use crate::machine::ownership::{Owner, Resume};
    use crate::machine::pace::{Limits, Size};
    use crate::machine::partition::{Action, Entry, Partition};
    use crate::operator::metrics::Metrics;
    use crate::store::fence::{self, Watermark};
    use crate::store::flush::Flusher;
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
                let spread = p.spread_at(offset).expect("owned");
                let rule = tally_common::GroupingRule::ByPartition;
                let entry = Entry::Delta {
                    group: keyspace.group_for_event(rule, 0, None, counter, spread),
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
}
