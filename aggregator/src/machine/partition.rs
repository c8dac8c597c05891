//! One owned partition as a state machine, with no I/O: the consume loop (`crate::consume`) feeds
//! it what happened (a message, a tick, a flush's or a check's outcome, an acquisition) and
//! carries out the `Action`s it returns (start a flush of this sealed batch, commit this
//! offset, pause, resume, seek, acquire, check). Everything that decides when to flush, what
//! may be committed, and when fetching pauses lives here, and is unit-tested here.
//!
//! The rules:
//! - **An offset is committed only after everything before it is durable**: `Action::Commit`
//!   comes only from a flush that reported [`FlushOutcome::Durable`], with that flush's offset.
//! - **One flush (or check) in flight at a time**, so flushes land in offset order.
//! - **Backpressure**: while a flush is in flight, a buffer that reaches its pause size pauses
//!   fetching until the flush lands and the buffer has room again.
//! - **Exactly-once ownership**: a partition acquires an epoch before it reads (messages are
//!   ignored until it is positioned); a fenced write stops it for good (a newer owner has it);
//!   a rollback (Redis lost writes) drops its buffer and acquires it again, to be re-fed from
//!   where Redis now stands.

use std::time::{Duration, Instant, SystemTime};

use tally_common::keyspace::Fan;
use tally_common::window::Bucket;

use super::batch::{Batch, SealedBatch};
use super::letter::DeadLetter;
use super::outcome::{FlushOutcome, Standing};
use super::ownership::{Owner, Resume};
use super::pace::{FlushClock, Limits, Pace};

/// Where a partition's ownership stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// At-least-once mode: no fences, no ledgers.
    Unfenced,
    /// Exactly-once: taking an epoch and stamping fences; fetching is paused and messages are
    /// ignored (they are read again after the seek).
    Acquiring,
    /// Exactly-once: acquired; waiting for the seek to where it resumes.
    Positioning(Owner),
    /// Exactly-once: owned under an epoch, with the groups' ledger entries.
    Owned(Owner),
    /// Exactly-once: a write was refused by a fence; a newer owner has the partition, so nothing
    /// more is consumed or flushed here.
    Fenced,
}

/// What is in flight for a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InFlight {
    /// A flush of this many messages.
    Flush {
        /// Messages in the flushed batch.
        events: usize,
    },
    /// A check that Redis still holds what this owner wrote.
    Check,
}

/// What the loop must do for a partition.
#[derive(Debug)]
pub(crate) enum Action {
    /// Make this batch durable (exactly-once with `owner`), then report [`FlushOutcome`].
    Flush {
        /// The batch.
        batch: SealedBatch,
        /// The exactly-once owner, `None` at-least-once.
        owner: Option<Owner>,
    },
    /// Check the owner's standing in Redis, then report [`Standing`].
    Check(Owner),
    /// Commit this offset: everything before it is durable.
    Commit(i64),
    /// Stop fetching the partition, dropping what was fetched of it and not read.
    Pause,
    /// Stop fetching the partition for now, keeping what was fetched of it and not read: its
    /// buffer is full while a flush is in flight. Reading goes on from there on [`Action::Resume`].
    Hold,
    /// Read it again (what was held first, then what is fetched next).
    Resume,
    /// Acquire exactly-once ownership, then report with [`Partition::on_acquired`].
    Acquire,
    /// Move the consumer's position, then report with [`Partition::on_seek`].
    Seek(Resume),
}

/// A message, decoded and routed by the loop.
#[derive(Debug)]
pub(crate) enum Entry<'a> {
    /// A delta for a counter's share in a group.
    Delta {
        /// The shard group.
        group: u32,
        /// The counter.
        counter: &'a str,
        /// The delta.
        delta: i64,
        /// The time buckets it also counts in (windowed namespaces; else empty).
        buckets: &'a [Bucket],
        /// When the counter expires if nothing touches it again (namespaces that expire
        /// counters; else `None`).
        idle_deadline: Option<i64>,
    },
    /// A like (or unlike) in a namespace that counts one per actor.
    Member {
        /// The shard group.
        group: u32,
        /// The counter.
        counter: &'a str,
        /// Who.
        actor: &'a str,
        /// Like or unlike.
        like: bool,
        /// When the counter expires if nothing touches it again (namespaces that expire
        /// counters; else `None`).
        idle_deadline: Option<i64>,
    },
    /// An event repeating an idempotency key counted within its window: not counted, but read
    /// past like any other.
    Repeat,
    /// A reset of a counter: its shares in every one of the `groups` shard groups are cleared
    /// before anything after it is added.
    Reset {
        /// The counter.
        counter: &'a str,
        /// How many shard groups there are.
        groups: u32,
    },
    /// An expiry record (`crate::tasks::expiry`): the counter is cleared in every group here if it has
    /// gone idle by `deadline_ms`.
    Expire {
        /// The counter.
        counter: &'a str,
        /// Idle deadlines at or before this have passed.
        deadline_ms: i64,
        /// How many shard groups there are.
        groups: u32,
    },
    /// A message to copy to the dead-letter topic, with the group its event would have gone
    /// to if it decoded that far (a like without an actor).
    DeadLetter {
        /// That group.
        group: Option<u32>,
        /// The copy.
        letter: DeadLetter,
    },
}

/// What became of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handled {
    /// Not read in this position (acquiring, or fenced off): it will be read again, or by its
    /// owner.
    Ignored,
    /// Its group had already applied it before a restart: counted once, not twice.
    Skipped,
    /// In the buffer.
    Buffered,
}

/// One owned partition. See the module documentation.
#[derive(Debug)]
pub(crate) struct Partition {
    /// Distinguishes this ownership from an earlier or later one of the same partition.
    pub(crate) generation: u64,
    /// Where its exactly-once ownership stands.
    pub(crate) state: Ownership,
    /// Events not yet handed to a flush.
    pub(crate) buffer: Batch,
    /// When its buffer is due.
    clock: FlushClock,
    /// The flush or check in progress, if any.
    pub(crate) in_flight: Option<InFlight>,
    /// Whether fetching is paused because the buffer is full (or the partition is fenced).
    pub(crate) paused: bool,
    /// When Redis last confirmed this owner's standing (a durable flush or a check).
    confirmed: Instant,
    /// The offset after the last message handled in this position (`None` until the first).
    read_to: Option<i64>,
    /// Where the partition's log ended: its high watermark when it was acquired, then its last
    /// stable offset at each statistics report.
    log_end: Option<i64>,
    /// Whether messages reached it since the last tick.
    reading: bool,
    /// Whether the last flush was started while catching up: the buffer then holds the rest of
    /// a catch-up, flushed as soon as the partition has read to the end of its log rather than
    /// at its next flush time (which kept the last ~60,000 events of a 5 M catch-up waiting up
    /// to a second, the machine idle).
    catch_up_rest: bool,
    /// The log was truncated under the position while a flush or check was in flight: once
    /// it ends, the partition is acquired again ([`Self::on_truncated`]).
    restart: bool,
}

impl Partition {
    /// A newly assigned partition. In exactly-once mode it starts acquiring ([`Action::Acquire`];
    /// the loop has paused fetching for the whole assignment).
    pub(crate) fn assigned(
        number: i32,
        generation: u64,
        exactly_once: bool,
        flush_interval: Duration,
        now: Instant,
        wall: SystemTime,
    ) -> (Self, Option<Action>) {
        let partition = Self {
            generation,
            state: if exactly_once {
                Ownership::Acquiring
            } else {
                Ownership::Unfenced
            },
            buffer: Batch::default(),
            clock: FlushClock::new(flush_interval, number, now, wall),
            in_flight: None,
            paused: false,
            confirmed: now,
            read_to: None,
            log_end: None,
            reading: false,
            catch_up_rest: false,
            restart: false,
        };
        (partition, exactly_once.then_some(Action::Acquire))
    }

    /// Whether the partition batches by clock or by size. A partition paused with its buffer
    /// full reads nothing because it was paused, not because nothing came: behind the end of
    /// its log, it is still catching up. (Taken as live, a catch-up paused less than
    /// [`CATCH_UP_MIN_LAG`](super::pace::CATCH_UP_MIN_LAG) events from its end flushed at the
    /// live pace, and its last events then waited for the flush clock: up to a second at the
    /// end of a catch-up.)
    pub(crate) fn pace(&self) -> Pace {
        Pace::of(self.read_to, self.log_end, self.reading || self.paused)
    }

    /// Whether messages are read in this position: the loop decodes only those.
    pub(crate) fn accepts(&self) -> bool {
        matches!(self.state, Ownership::Unfenced | Ownership::Owned(_)) && !self.restart
    }

    /// A leader change truncated the log under the partition's position (KIP-320). In
    /// exactly-once mode the buffer, which may hold records the log lost, is dropped and the
    /// partition acquired again, resuming from what the store holds; a flush or check in
    /// flight ends first. With at-least-once, reading just goes on where the fetcher moved.
    pub(crate) fn on_truncated(&mut self) -> Vec<Action> {
        self.take_again()
    }

    /// The deployment was re-grouped (`tally_common::regroup`): an owner placing new offsets
    /// in another count of groups than the plan's takes the partition again, which places them
    /// in the plan's count from the first offset no group has applied. Its buffer, placed the
    /// old way, is dropped and read again; a flush or check in flight ends first.
    pub(crate) fn on_regrouped(&mut self, write: u32, version: u64, original: u32) -> Vec<Action> {
        match &self.state {
            Ownership::Owned(owner)
                if owner.plan_version < version
                    && owner.spread.current_fan().groups_of(original) != write
                    && !self.restart =>
            {
                self.take_again()
            }
            _ => Vec::new(),
        }
    }

    /// Drops the buffer and acquires the partition again once what is in flight ends.
    fn take_again(&mut self) -> Vec<Action> {
        if !matches!(self.state, Ownership::Owned(_)) {
            // Acquiring (it seeks when done), fenced, or at-least-once.
            return Vec::new();
        }
        self.buffer = Batch::default();
        if self.in_flight.is_none() {
            return self.rolled_back();
        }
        self.restart = true;
        self.paused = true;
        vec![Action::Pause]
    }

    /// The groups' ledger entries, in exactly-once mode.
    pub(crate) fn ledgers(&self) -> Option<&[i64]> {
        match &self.state {
            Ownership::Owned(owner) => Some(&owner.ledgers),
            _ => None,
        }
    }

    /// How the message at `offset` is placed, in exactly-once mode (the loop's configured
    /// spread over the plan's groups otherwise).
    pub(crate) fn fan_at(&self, offset: i64) -> Option<Fan> {
        match &self.state {
            Ownership::Owned(owner) => Some(owner.spread.fan_at(offset)),
            _ => None,
        }
    }

    /// Messages and events buffered or in flight.
    pub(crate) fn pending_events(&self) -> usize {
        let in_flight = match self.in_flight {
            Some(InFlight::Flush { events }) => events,
            _ => 0,
        };
        self.buffer.events() + in_flight
    }

    /// The offset after the last message read since the partition was positioned, if any.
    pub(crate) fn read_to(&self) -> Option<i64> {
        self.read_to
    }

    /// How far the log's end is past the last message read, where both are known.
    pub(crate) fn lag(&self) -> Option<i64> {
        Some((self.log_end? - self.read_to?).max(0))
    }

    /// Where the partition's log ends now (from statistics); unknown values are ignored.
    pub(crate) fn on_log_end(&mut self, end: i64) {
        if end >= 0 {
            self.log_end = Some(end);
        }
    }

    /// A message at `offset`: buffered (or skipped, or ignored); returns a flush to start or a
    /// pause when the buffer is full.
    pub(crate) fn on_message(
        &mut self,
        offset: i64,
        entry: Entry<'_>,
        limits: &Limits,
    ) -> (Handled, Option<Action>) {
        if !self.accepts() {
            return (Handled::Ignored, None);
        }
        self.read_to = Some(offset + 1);
        self.reading = true;
        // The event's group, and in namespaces that expire counters what it touches.
        let (group, touch) = match &entry {
            Entry::Delta {
                group,
                counter,
                idle_deadline,
                ..
            }
            | Entry::Member {
                group,
                counter,
                idle_deadline,
                ..
            } => (Some(*group), idle_deadline.map(|d| (*counter, d))),
            Entry::DeadLetter { group, .. } => (*group, None),
            Entry::Repeat | Entry::Reset { .. } | Entry::Expire { .. } => (None, None),
        };
        // A group past the owner's ledgers was retired by a re-grouping after everything it
        // was ever placed was applied there and folded into the groups left
        // (`tally_common::regroup`): a replay of an older stretch skips it.
        let already_applied = group.is_some_and(|group| {
            self.ledgers().is_some_and(|ledgers| {
                ledgers
                    .get(group as usize)
                    .is_none_or(|ledger| offset < *ledger)
            })
        });
        let handled = if already_applied {
            self.buffer.skip(offset);
            Handled::Skipped
        } else {
            if let Some((counter, deadline)) = touch {
                self.buffer.touch(counter, deadline);
            }
            match entry {
                Entry::Delta {
                    group,
                    counter,
                    delta,
                    buckets,
                    ..
                } => self
                    .buffer
                    .add_windowed(group, counter, delta, buckets, offset),
                Entry::Member {
                    group,
                    counter,
                    actor,
                    like,
                    ..
                } => self.buffer.add_member(group, counter, actor, like, offset),
                Entry::DeadLetter { letter, .. } => self.buffer.add_dead_letter(letter, offset),
                Entry::Repeat => self.buffer.skip(offset),
                Entry::Reset { counter, groups } => {
                    let pending = self.not_applied(groups, offset);
                    self.buffer.reset(counter, pending.into_iter(), offset)
                }
                Entry::Expire {
                    counter,
                    deadline_ms,
                    groups,
                } => {
                    let pending = self.not_applied(groups, offset);
                    (self.buffer).expire(counter, deadline_ms, pending.into_iter(), offset)
                }
            }
            Handled::Buffered
        };
        let pace = self.pace();
        if !self.buffer.is_full(limits.size(pace)) {
            return (handled, None);
        }
        if self.in_flight.is_none() {
            return (handled, self.start_flush(pace));
        }
        if !self.paused && self.buffer.is_full(&limits.pause_size(pace)) {
            self.paused = true;
            return (handled, Some(Action::Hold));
        }
        (handled, None)
    }

    /// The groups, of `groups`, that have not applied the message at `offset` yet (a crash may
    /// have fallen between two groups' writes of the flush that carried it).
    fn not_applied(&self, groups: u32, offset: i64) -> Vec<u32> {
        let ledgers = self.ledgers();
        (0..groups)
            .filter(|g| ledgers.is_none_or(|l| l.get(*g as usize).is_none_or(|l| offset >= *l)))
            .collect()
    }

    /// The loop's periodic tick: starts a flush of a due buffer, or a check of an idle owner.
    /// Returns the pace the partition had since the last tick.
    pub(crate) fn on_tick(
        &mut self,
        limits: &Limits,
        check_idle_interval: Duration,
        now: Instant,
    ) -> (Pace, Option<Action>) {
        let pace = self.pace();
        self.reading = false;
        if pace == Pace::Live && self.buffer.events() == 0 {
            // Caught up with nothing left over: later events are live ones.
            self.catch_up_rest = false;
        }
        if self.in_flight.is_some() {
            return (pace, None);
        }
        if self.flush_due(limits, pace, now)
            && let Some(flush) = self.start_flush(pace)
        {
            return (pace, Some(flush));
        }
        if self.buffer.events() == 0 && now.duration_since(self.confirmed) >= check_idle_interval {
            return (pace, self.start_check(now));
        }
        (pace, None)
    }

    /// The flush in flight ended.
    pub(crate) fn on_flushed(
        &mut self,
        outcome: FlushOutcome,
        limits: &Limits,
        now: Instant,
    ) -> Vec<Action> {
        debug_assert!(matches!(self.in_flight, Some(InFlight::Flush { .. })));
        self.in_flight = None;
        let restart = std::mem::take(&mut self.restart);
        match outcome {
            FlushOutcome::Durable { next_offset, .. } if restart => {
                let mut actions = vec![Action::Commit(next_offset)];
                actions.extend(self.rolled_back());
                actions
            }
            FlushOutcome::Durable { next_offset, owner } => {
                if let Some(owner) = owner {
                    self.state = Ownership::Owned(owner);
                }
                self.confirmed = now;
                let mut actions = vec![Action::Commit(next_offset)];
                actions.extend(self.after_in_flight(limits, now));
                actions
            }
            FlushOutcome::Fenced => self.fenced(),
            FlushOutcome::RolledBack => self.rolled_back(),
            // Shutting down or revoked: the drain decides what happens next.
            FlushOutcome::Cancelled => Vec::new(),
        }
    }

    /// The check in flight ended.
    pub(crate) fn on_checked(
        &mut self,
        standing: Standing,
        limits: &Limits,
        now: Instant,
    ) -> Vec<Action> {
        debug_assert_eq!(self.in_flight, Some(InFlight::Check));
        self.in_flight = None;
        let restart = std::mem::take(&mut self.restart);
        match standing {
            Standing::Held if restart => self.rolled_back(),
            Standing::Held => self.after_in_flight(limits, now),
            Standing::Fenced => self.fenced(),
            Standing::RolledBack => self.rolled_back(),
        }
    }

    /// Exactly-once ownership is acquired: seek to where the partition resumes.
    pub(crate) fn on_acquired(
        &mut self,
        owner: Owner,
        resume: Resume,
        log_end: Option<i64>,
    ) -> Action {
        self.state = Ownership::Positioning(owner);
        if let Some(end) = log_end {
            self.log_end = Some(end);
        }
        Action::Seek(resume)
    }

    /// The seek after an acquisition ended: fetch from there, or (the position is unknown)
    /// acquire again.
    pub(crate) fn on_seek(&mut self, sought: bool, now: Instant) -> Action {
        let state = std::mem::replace(&mut self.state, Ownership::Acquiring);
        match state {
            Ownership::Positioning(owner) if sought => {
                self.state = Ownership::Owned(owner);
                self.read_to = None;
                self.confirmed = now;
                Action::Resume
            }
            _ => Action::Acquire,
        }
    }

    /// Whether the buffer must be flushed at `now`: due at its pace, or so full that fetching
    /// was paused (whatever the pace is now: a partition paused at the live limits may look
    /// behind since it stopped reading).
    fn flush_due(&self, limits: &Limits, pace: Pace, now: Instant) -> bool {
        self.paused
            || self.buffer.is_due(limits, pace, &self.clock, now)
            || (self.catch_up_rest && pace == Pace::Live && self.buffer.events() > 0)
    }

    /// After a flush or check landed: flush what became due, resume if there is room.
    fn after_in_flight(&mut self, limits: &Limits, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        let pace = self.pace();
        if self.flush_due(limits, pace, now) {
            actions.extend(self.start_flush(pace));
        }
        if self.paused && !self.buffer.is_full(&limits.pause_size(pace)) {
            self.paused = false;
            actions.push(Action::Resume);
        }
        actions
    }

    /// A newer owner has the partition: stop reading and drop the buffer.
    fn fenced(&mut self) -> Vec<Action> {
        self.state = Ownership::Fenced;
        self.buffer = Batch::default();
        self.paused = true;
        vec![Action::Pause]
    }

    /// Redis lost writes: drop the buffer and start over from what Redis now holds (a new
    /// epoch, a new resume offset).
    fn rolled_back(&mut self) -> Vec<Action> {
        self.buffer = Batch::default();
        self.paused = false;
        self.state = Ownership::Acquiring;
        vec![Action::Pause, Action::Acquire]
    }

    /// Seals the buffer into a flush, if it holds anything and the partition may write, at
    /// `pace`.
    fn start_flush(&mut self, pace: Pace) -> Option<Action> {
        debug_assert!(
            self.in_flight.is_none(),
            "one flush per partition at a time"
        );
        let owner = match &self.state {
            Ownership::Unfenced => None,
            Ownership::Owned(owner) => Some(owner.clone()),
            _ => return None,
        };
        let batch = self.buffer.seal()?;
        self.catch_up_rest = pace == Pace::CatchingUp;
        self.in_flight = Some(InFlight::Flush {
            events: batch.events,
        });
        Some(Action::Flush { batch, owner })
    }

    /// Starts a check of an idle owner's standing.
    fn start_check(&mut self, now: Instant) -> Option<Action> {
        let Ownership::Owned(owner) = &self.state else {
            return None;
        };
        self.confirmed = now;
        self.in_flight = Some(InFlight::Check);
        Some(Action::Check(owner.clone()))
    }

    /// Takes the partition out of the loop to drain it (revoke or shutdown).
    pub(crate) fn into_drain(self) -> Drain {
        let owner = match self.state {
            Ownership::Unfenced => None,
            Ownership::Owned(owner) => Some(owner),
            // Not positioned yet: nothing was buffered, nothing to commit.
            Ownership::Acquiring | Ownership::Positioning(_) | Ownership::Fenced => {
                return Drain::Nothing;
            }
        };
        Drain::Work(Box::new(Draining {
            owner,
            buffer: self.buffer,
            durable: None,
        }))
    }
}

/// What draining a partition involves.
#[derive(Debug)]
pub(crate) enum Drain {
    /// Nothing to flush or commit (acquiring, or fenced off).
    Nothing,
    /// Wait for what is in flight, flush the buffer, commit.
    Work(Box<Draining>),
}

/// A partition being drained: its in-flight work's outcome, then its buffer's flush, decide
/// what may be committed.
#[derive(Debug)]
pub(crate) struct Draining {
    /// The exactly-once owner, `None` at-least-once.
    owner: Option<Owner>,
    /// What was not yet handed to a flush.
    buffer: Batch,
    /// The offset made durable so far.
    durable: Option<i64>,
}

/// A drained partition kept work that is not durable: nothing may be committed for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotDrained;

impl Draining {
    /// The flush that was in flight (or the last flush) ended.
    pub(crate) fn on_flushed(&mut self, outcome: FlushOutcome) -> Result<(), NotDrained> {
        match outcome {
            FlushOutcome::Durable { next_offset, owner } => {
                self.durable = Some(next_offset);
                if owner.is_some() {
                    self.owner = owner;
                }
                Ok(())
            }
            // Committing the buffer behind it would skip the lost batch: stop here.
            FlushOutcome::Cancelled | FlushOutcome::Fenced | FlushOutcome::RolledBack => {
                Err(NotDrained)
            }
        }
    }

    /// The check that was in flight ended.
    pub(crate) fn on_checked(&mut self, standing: Standing) -> Result<(), NotDrained> {
        match standing {
            Standing::Held => Ok(()),
            Standing::Fenced | Standing::RolledBack => Err(NotDrained),
        }
    }

    /// The buffer's last flush, if it holds anything.
    pub(crate) fn last_flush(&mut self) -> Option<(SealedBatch, Option<Owner>)> {
        Some((self.buffer.seal()?, self.owner.clone()))
    }

    /// The offset to commit once everything landed (`None`: nothing was flushed).
    pub(crate) fn commit(&self) -> Option<i64> {
        self.durable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::pace::{MEMBERSHIPS_PER_ENTRY, Size};
    use tally_common::keyspace::Spread;

    const INTERVAL: Duration = Duration::from_millis(1_000);

    fn limits() -> Limits {
        Limits {
            flush_interval: INTERVAL,
            live: Size {
                max_events: 4,
                max_counters: 100,
                memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
                max_group_entries: usize::MAX,
            },
            catch_up: Size {
                max_events: 8,
                max_counters: 100,
                memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
                max_group_entries: usize::MAX,
            },
            catch_up_interval: Duration::from_secs(10),
        }
    }

    fn owner(ledgers: Vec<i64>) -> Owner {
        Owner {
            field: "t/0".to_owned(),
            home: 0,
            epoch: 7,
            ledgers,
            spread: Spread::uniform(1),
            plan_version: 0,
        }
    }

    /// An at-least-once partition, assigned at `now`.
    fn unfenced(now: Instant) -> Partition {
        Partition::assigned(0, 1, false, INTERVAL, now, SystemTime::now()).0
    }

    /// An exactly-once partition, owned from `now`, with these ledgers.
    fn owned(now: Instant, ledgers: Vec<i64>) -> Partition {
        let (mut p, acquire) = Partition::assigned(0, 1, true, INTERVAL, now, SystemTime::now());
        assert!(matches!(acquire, Some(Action::Acquire)));
        let seek = p.on_acquired(owner(ledgers), Resume::At(0), None);
        assert!(matches!(seek, Action::Seek(Resume::At(0))));
        assert!(matches!(p.on_seek(true, now), Action::Resume));
        p
    }

    fn delta(counter: &str) -> Entry<'_> {
        Entry::Delta {
            group: 0,
            counter,
            delta: 1,
            buckets: &[],
            idle_deadline: None,
        }
    }

    /// Feeds messages at `offsets`, returning the actions they produced.
    fn feed(p: &mut Partition, offsets: std::ops::Range<i64>) -> Vec<Action> {
        let limits = limits();
        offsets
            .filter_map(|offset| p.on_message(offset, delta("c"), &limits).1)
            .collect()
    }

    /// A flush durable up to `next_offset`, its owner unchanged.
    fn durable(next_offset: i64) -> FlushOutcome {
        FlushOutcome::Durable {
            next_offset,
            owner: None,
        }
    }

    fn flushed_offset(actions: &[Action]) -> Option<i64> {
        actions.iter().find_map(|a| match a {
            Action::Flush { batch, .. } => Some(batch.next_offset),
            _ => None,
        })
    }

    fn commits(actions: &[Action]) -> Vec<i64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Commit(offset) => Some(*offset),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn commits_come_only_from_durable_flushes_and_never_pass_them() {
        let now = Instant::now();
        let limits = limits();
        let mut p = unfenced(now);
        // Four messages fill the live buffer: a flush of offsets 0..4 starts.
        let actions = feed(&mut p, 0..4);
        assert_eq!(flushed_offset(&actions), Some(4));
        assert!(commits(&actions).is_empty());
        // Two more wait in the buffer while it is in flight.
        assert!(feed(&mut p, 4..6).is_empty());
        // The flush fails to become durable (shutdown): nothing is committed.
        assert!(
            p.on_flushed(FlushOutcome::Cancelled, &limits, now)
                .is_empty()
        );
        // A durable flush commits exactly its own offset, not the buffer behind it.
        let mut p = unfenced(now);
        feed(&mut p, 0..6);
        let actions = p.on_flushed(durable(4), &limits, now);
        assert_eq!(commits(&actions), [4]);
        // The buffer behind it is not due yet (its clock has not come): it stays buffered.
        assert_eq!(flushed_offset(&actions), None);
        assert_eq!(p.pending_events(), 2);
    }

    #[test]
    fn the_flush_clock_flushes_a_partial_buffer_once_due() {
        let now = Instant::now();
        let limits = limits();
        let mut p = unfenced(now);
        assert!(feed(&mut p, 0..2).is_empty());
        let (_, early) = p.on_tick(&limits, Duration::MAX, now);
        assert!(early.is_none(), "not due at once");
        // Within one interval (plus its phase) of the first message, the tick flushes it.
        let later = now + 2 * INTERVAL;
        let (_, due) = p.on_tick(&limits, Duration::MAX, later);
        assert_eq!(flushed_offset(due.as_slice()), Some(2));
        // One flush at a time: nothing more starts while it is in flight.
        feed(&mut p, 2..3);
        let (_, none) = p.on_tick(&limits, Duration::MAX, later + 2 * INTERVAL);
        assert!(none.is_none());
    }

    #[test]
    fn the_rest_of_a_catch_up_flushes_once_read_to_the_end_not_at_the_clock() {
        let now = Instant::now();
        let limits = limits();
        let mut p = unfenced(now);
        // Eleven events behind: catching up, a flush at the catch-up size (8).
        p.on_log_end(11);
        let first = feed(&mut p, 0..8);
        assert_eq!(flushed_offset(&first), Some(8));
        assert_eq!(commits(&p.on_flushed(durable(8), &limits, now)), [8]);
        // The last three events reach the end of the log: live now, the buffer not full, and
        // its flush time not come; as the rest of a catch-up it goes at the next tick anyway.
        assert!(feed(&mut p, 8..11).is_empty());
        let (pace, rest) = p.on_tick(&limits, Duration::MAX, now);
        assert_eq!(pace, Pace::Live);
        assert_eq!(flushed_offset(rest.as_slice()), Some(11));
        // That flush was live: what comes after it waits for the clock again.
        p.on_flushed(durable(11), &limits, now);
        p.on_log_end(12);
        assert!(feed(&mut p, 11..12).is_empty());
        let (_, early) = p.on_tick(&limits, Duration::MAX, now);
        assert!(early.is_none(), "a live batch waits for its flush time");

        // A catch-up flush can leave no rest (here the log's end is one past its last event, as
        // a transaction's commit marker makes it): once the partition has gone live with
        // nothing buffered, the next events wait for the clock too.
        let mut p = unfenced(now);
        p.on_log_end(9);
        assert_eq!(flushed_offset(&feed(&mut p, 0..8)), Some(8));
        p.on_flushed(durable(8), &limits, now);
        let (pace, _) = p.on_tick(&limits, Duration::MAX, now);
        assert_eq!(pace, Pace::CatchingUp, "messages came since the last tick");
        let (pace, none) = p.on_tick(&limits, Duration::MAX, now);
        assert_eq!((pace, none.is_none()), (Pace::Live, true));
        assert!(feed(&mut p, 8..9).is_empty());
        let (_, early) = p.on_tick(&limits, Duration::MAX, now);
        assert!(
            early.is_none(),
            "a live batch after a drained catch-up waits for its flush time"
        );
    }

    #[test]
    fn a_catch_up_paused_near_its_end_still_flushes_its_rest_at_once() {
        let now = Instant::now();
        let limits = limits();
        let mut p = unfenced(now);
        // Nineteen events behind, far fewer than CATCH_UP_MIN_LAG: catching up while they come.
        p.on_log_end(19);
        assert_eq!(flushed_offset(&feed(&mut p, 0..8)), Some(8));
        // The next buffer fills to the catch-up pause size while that flush is in flight.
        assert!(matches!(feed(&mut p, 8..16).as_slice(), [Action::Hold]));
        // Ticks while paused: nothing is read, yet the partition is behind, not live.
        for _ in 0..2 {
            let (pace, _) = p.on_tick(&limits, Duration::MAX, now);
            assert_eq!(pace, Pace::CatchingUp);
        }
        let actions = p.on_flushed(durable(8), &limits, now);
        assert_eq!(flushed_offset(&actions), Some(16));
        // The last three events (fewer than a live batch) are the rest of the catch-up: flushed
        // as soon as the flush before them lands, not at the partition's flush time.
        assert!(feed(&mut p, 16..19).is_empty());
        assert_eq!(p.pace(), Pace::Live);
        assert_eq!(
            flushed_offset(&p.on_flushed(durable(16), &limits, now)),
            Some(19)
        );
    }

    #[test]
    fn a_full_buffer_pauses_fetching_until_the_flush_in_flight_lands() {
        let now = Instant::now();
        let limits = limits();
        let mut p = unfenced(now);
        let first = feed(&mut p, 0..4);
        assert_eq!(flushed_offset(&first), Some(4));
        // The next buffer fills to its pause size (twice the live size) while the flush is in
        // flight.
        assert!(feed(&mut p, 4..11).is_empty());
        assert!(!p.paused);
        let actions = feed(&mut p, 11..12);
        assert!(matches!(actions.as_slice(), [Action::Hold]));
        assert!(p.paused);
        // More messages already fetched are still buffered, without a second pause.
        assert!(feed(&mut p, 12..13).is_empty());
        // The flush lands: the full buffer flushes at once, and fetching resumes.
        let actions = p.on_flushed(durable(4), &limits, now);
        assert_eq!(commits(&actions), [4]);
        assert_eq!(flushed_offset(&actions), Some(13));
        assert!(matches!(actions.last(), Some(Action::Resume)));
        assert!(!p.paused);
    }

    #[test]
    fn a_fenced_write_stops_the_partition_without_committing() {
        let now = Instant::now();
        let limits = limits();
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..4);
        feed(&mut p, 4..6);
        let actions = p.on_flushed(FlushOutcome::Fenced, &limits, now);
        assert!(matches!(actions.as_slice(), [Action::Pause]));
        assert!(commits(&actions).is_empty());
        assert_eq!(p.state, Ownership::Fenced);
        assert_eq!(p.pending_events(), 0, "the buffer is dropped");
        // Nothing more is read or flushed here.
        assert_eq!(p.on_message(6, delta("c"), &limits).0, Handled::Ignored);
        assert!(
            p.on_tick(&limits, Duration::ZERO, now + INTERVAL * 5)
                .1
                .is_none()
        );
        assert!(matches!(p.into_drain(), Drain::Nothing));
    }

    #[test]
    fn a_rollback_seen_by_a_flush_reacquires_and_refeeds() {
        let now = Instant::now();
        let limits = limits();
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..4);
        feed(&mut p, 4..6);
        let actions = p.on_flushed(FlushOutcome::RolledBack, &limits, now);
        assert!(matches!(
            actions.as_slice(),
            [Action::Pause, Action::Acquire]
        ));
        assert_eq!(p.state, Ownership::Acquiring);
        assert_eq!(p.pending_events(), 0);
        // Messages fetched before the pause took effect are ignored until the new position.
        assert_eq!(p.on_message(6, delta("c"), &limits).0, Handled::Ignored);
        // Acquired again: it resumes where Redis now stands, and skips what a group applied.
        p.on_acquired(owner(vec![2]), Resume::At(0), Some(100));
        assert!(matches!(p.on_seek(true, now), Action::Resume));
        assert_eq!(p.on_message(1, delta("c"), &limits).0, Handled::Skipped);
        assert_eq!(p.on_message(2, delta("c"), &limits).0, Handled::Buffered);
    }

    #[test]
    fn a_newer_plan_with_another_count_takes_the_partition_again_after_its_flush() {
        let now = Instant::now();
        let limits = limits();
        // The owner places in the 4 original groups under plan version 0.
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..2);
        assert!(p.on_regrouped(4, 1, 4).is_empty(), "the same count");
        assert!(p.on_regrouped(8, 0, 4).is_empty(), "not a newer plan");
        let actions = p.on_regrouped(8, 1, 4);
        assert!(matches!(
            actions.as_slice(),
            [Action::Pause, Action::Acquire]
        ));
        assert_eq!(p.pending_events(), 0, "placed the old way: read again");
        // With a flush in flight: it lands first, then the partition is taken again, once.
        let mut p = owned(now, vec![-1]);
        let flush = feed(&mut p, 0..4);
        assert_eq!(flushed_offset(&flush), Some(4));
        assert!(matches!(
            p.on_regrouped(8, 1, 4).as_slice(),
            [Action::Pause]
        ));
        assert!(p.on_regrouped(8, 1, 4).is_empty());
        let durable = FlushOutcome::Durable {
            next_offset: 4,
            owner: Some(owner(vec![4])),
        };
        let actions = p.on_flushed(durable, &limits, now);
        assert!(matches!(
            actions.as_slice(),
            [Action::Commit(4), Action::Pause, Action::Acquire]
        ));
        // An owner acquired under the new plan is left alone.
        let mut moved = owner(vec![4]);
        moved.spread = Spread::fixed(Fan {
            k: 1,
            groups: Some(8),
        });
        moved.plan_version = 1;
        p.on_acquired(moved, Resume::At(4), None);
        assert!(matches!(p.on_seek(true, now), Action::Resume));
        assert!(p.on_regrouped(8, 1, 4).is_empty());
        assert!(unfenced(now).on_regrouped(8, 1, 4).is_empty());
    }

    #[test]
    fn a_replay_placed_in_a_retired_group_is_skipped() {
        let limits = limits();
        // The owner stamped 2 groups: group 5 was folded away before it acquired.
        let mut p = owned(Instant::now(), vec![-1, -1]);
        let retired = Entry::Delta {
            group: 5,
            counter: "c",
            delta: 1,
            buckets: &[],
            idle_deadline: None,
        };
        assert_eq!(p.on_message(0, retired, &limits).0, Handled::Skipped);
        assert_eq!(p.on_message(1, delta("c"), &limits).0, Handled::Buffered);
    }

    #[test]
    fn a_truncated_log_drops_the_buffer_and_reacquires_once_the_flush_in_flight_ends() {
        let now = Instant::now();
        let limits = limits();
        // Idle: acquired again at once, nothing buffered survives.
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..2);
        let actions = p.on_truncated();
        assert!(matches!(
            actions.as_slice(),
            [Action::Pause, Action::Acquire]
        ));
        assert_eq!(p.pending_events(), 0);
        // With a flush in flight: paused, reading nothing, until it lands.
        let mut p = owned(now, vec![-1]);
        let flush = feed(&mut p, 0..4);
        assert_eq!(flushed_offset(&flush), Some(4));
        feed(&mut p, 4..6);
        assert!(matches!(p.on_truncated().as_slice(), [Action::Pause]));
        assert_eq!(p.on_message(6, delta("c"), &limits).0, Handled::Ignored);
        let durable = FlushOutcome::Durable {
            next_offset: 4,
            owner: Some(owner(vec![4])),
        };
        let actions = p.on_flushed(durable, &limits, now);
        assert!(matches!(
            actions.as_slice(),
            [Action::Commit(4), Action::Pause, Action::Acquire]
        ));
        assert_eq!(
            (p.state.clone(), p.pending_events()),
            (Ownership::Acquiring, 0)
        );
        // Re-acquired at the ledger: the new leader's records from there are read.
        p.on_acquired(owner(vec![4]), Resume::At(4), None);
        assert!(matches!(p.on_seek(true, now), Action::Resume));
        assert_eq!(p.on_message(4, delta("c"), &limits).0, Handled::Buffered);
        // At-least-once reads straight on.
        assert!(unfenced(now).on_truncated().is_empty());
    }

    #[test]
    fn a_rollback_seen_by_the_idle_check_reacquires() {
        let now = Instant::now();
        let limits = limits();
        let check_every = Duration::from_secs(5);
        let mut p = owned(now, vec![10]);
        assert!(
            p.on_tick(&limits, check_every, now).1.is_none(),
            "confirmed just now"
        );
        let later = now + check_every;
        let (_, check) = p.on_tick(&limits, check_every, later);
        assert!(matches!(check, Some(Action::Check(ref o)) if o.ledgers == [10]));
        // Held: nothing to do, and the next check waits another interval.
        assert!(p.on_checked(Standing::Held, &limits, later).is_empty());
        assert!(p.on_tick(&limits, check_every, later).1.is_none());
        let (_, check) = p.on_tick(&limits, check_every, later + check_every);
        assert!(check.is_some());
        let actions = p.on_checked(Standing::RolledBack, &limits, later + check_every);
        assert!(matches!(
            actions.as_slice(),
            [Action::Pause, Action::Acquire]
        ));
        assert_eq!(p.state, Ownership::Acquiring);
    }

    #[test]
    fn a_failed_seek_acquires_again_and_reads_nothing_meanwhile() {
        let now = Instant::now();
        let limits = limits();
        let (mut p, _) = Partition::assigned(3, 1, true, INTERVAL, now, SystemTime::now());
        assert_eq!(p.on_message(0, delta("c"), &limits).0, Handled::Ignored);
        p.on_acquired(owner(vec![-1]), Resume::Beginning, None);
        assert_eq!(p.on_message(0, delta("c"), &limits).0, Handled::Ignored);
        assert!(matches!(p.on_seek(false, now), Action::Acquire));
        assert_eq!(p.state, Ownership::Acquiring);
    }

    #[test]
    fn revoking_during_a_flush_commits_only_what_became_durable() {
        let now = Instant::now();
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..4);
        feed(&mut p, 4..6);
        // Revoked with the flush of 0..4 in flight and 4..6 buffered.
        let Drain::Work(mut d) = p.into_drain() else {
            panic!("an owned partition has work to drain");
        };
        let landed = FlushOutcome::Durable {
            next_offset: 4,
            owner: Some(owner(vec![4])),
        };
        assert_eq!(d.on_flushed(landed), Ok(()));
        assert_eq!(d.commit(), Some(4));
        // The buffer is flushed by the owner the in-flight flush left behind.
        let (batch, by) = d.last_flush().expect("the buffer");
        assert_eq!(
            (batch.next_offset, by.map(|o| o.ledgers)),
            (6, Some(vec![4]))
        );
        assert_eq!(d.on_flushed(durable(6)), Ok(()));
        assert_eq!(d.commit(), Some(6));
        assert!(d.last_flush().is_none());

        // Had the in-flight flush not landed before the deadline, nothing is committed.
        let mut p = owned(now, vec![-1]);
        feed(&mut p, 0..6);
        let Drain::Work(mut d) = p.into_drain() else {
            panic!("work");
        };
        assert_eq!(d.on_flushed(FlushOutcome::Cancelled), Err(NotDrained));
        assert_eq!(d.commit(), None);
    }

    #[test]
    fn a_partition_still_acquiring_has_nothing_to_drain() {
        let now = Instant::now();
        let (p, _) = Partition::assigned(0, 1, true, INTERVAL, now, SystemTime::now());
        assert!(matches!(p.into_drain(), Drain::Nothing));
    }
}
