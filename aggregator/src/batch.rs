//! One partition's buffer: deltas summed per shard group and counter, the last like or unlike of
//! each (counter, actor) in deduplicating namespaces, plus the malformed messages to dead-letter,
//! up to the offset of the last message added.
//!
//! A [`Batch`] grows as messages arrive and is *sealed* into a [`SealedBatch`] when a flush
//! starts. The flush triggers live here too ([`Limits`]): a batch is due when it is older than
//! the flush interval, and full when it holds too many events or too many distinct counters, so
//! memory stays bounded whatever the traffic.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::dead_letter::DeadLetter;

/// When a partition's buffer must be flushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Flush once the oldest buffered message is this old.
    pub flush_interval: Duration,
    /// Flush once this many messages are buffered.
    pub max_events: usize,
    /// Flush once this many distinct counters are buffered.
    pub max_counters: usize,
}

/// A like (`like == true`) or unlike of `counter` by `actor`, in a deduplicating namespace: the
/// flush adds the actor to the counter's membership set and counts 1 only if it was not there,
/// or removes it and takes 1 back only if it was.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// The counter.
    pub counter: String,
    /// Who.
    pub actor: String,
    /// Like (true) or unlike (false).
    pub like: bool,
}

/// What one shard group receives from a batch.
#[derive(Debug, Default)]
struct GroupBuffer {
    /// Summed delta per counter id.
    deltas: HashMap<String, i64>,
    /// The last action per (counter, actor): only the last one matters, since membership is a
    /// state, not a sum.
    members: HashMap<(String, String), bool>,
}

/// One shard group's part of a sealed batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupBatch {
    /// The group.
    pub group: u32,
    /// Non-zero summed deltas per counter.
    pub deltas: Vec<(String, i64)>,
    /// Likes and unlikes, one per (counter, actor).
    pub members: Vec<Member>,
}

impl GroupBatch {
    /// Distinct writes: counters with a delta, plus memberships.
    pub fn writes(&self) -> usize {
        self.deltas.len() + self.members.len()
    }
}

/// The buffer of one partition.
#[derive(Debug, Default)]
pub struct Batch {
    /// Per shard group (one entry per group that has anything; a partition grouped by
    /// partition has exactly one).
    groups: Vec<(u32, GroupBuffer)>,
    /// Distinct (group, counter) and (group, counter, actor) entries over all groups.
    entries: usize,
    /// Malformed messages waiting to be copied to the dead-letter topic.
    dead_letters: Vec<DeadLetter>,
    /// Messages added (valid and malformed).
    events: usize,
    /// The offset after the last message added: where the partition resumes once this is durable.
    next_offset: Option<i64>,
    /// When the first message was added.
    started: Option<Instant>,
}

/// A batch taken for flushing: everything a flush needs, detached from the live buffer.
#[derive(Debug)]
pub struct SealedBatch {
    /// Per shard group, the non-zero summed deltas per counter (deltas that cancelled out are
    /// left out, and so are groups left with nothing) and the memberships.
    pub groups: Vec<GroupBatch>,
    /// Malformed messages to copy to the dead-letter topic before the offset moves.
    pub dead_letters: Vec<DeadLetter>,
    /// Messages in the batch.
    pub events: usize,
    /// The offset to commit once the batch is durable.
    pub next_offset: i64,
}

impl SealedBatch {
    /// Distinct (group, counter) writes and memberships in the batch.
    pub fn writes(&self) -> usize {
        self.groups.iter().map(GroupBatch::writes).sum()
    }
}

impl Batch {
    /// Adds a valid event at `offset`, bound for shard group `group`.
    pub fn add(&mut self, group: u32, counter: &str, delta: i64, offset: i64) {
        let deltas = &mut self.group(group).deltas;
        // Look up by &str first: the common case (a counter already in the batch) allocates nothing.
        match deltas.get_mut(counter) {
            // Cannot overflow: |delta| <= 10^12 and a batch holds far fewer than 9.2 million events.
            Some(sum) => *sum += delta,
            None => {
                deltas.insert(counter.to_owned(), delta);
                self.entries += 1;
            }
        }
        self.advance(offset);
    }

    /// Adds a like (or unlike) of `counter` by `actor` at `offset`, bound for `group` (the
    /// actor's). A later action of the same actor on the same counter replaces it.
    pub fn add_member(&mut self, group: u32, counter: &str, actor: &str, like: bool, offset: i64) {
        let members = &mut self.group(group).members;
        if members
            .insert((counter.to_owned(), actor.to_owned()), like)
            .is_none()
        {
            self.entries += 1;
        }
        self.advance(offset);
    }

    fn group(&mut self, group: u32) -> &mut GroupBuffer {
        let i = match self.groups.iter().position(|(g, _)| *g == group) {
            Some(i) => i,
            None => {
                self.groups.push((group, GroupBuffer::default()));
                self.groups.len() - 1
            }
        };
        &mut self.groups[i].1
    }

    /// Records that the message at `offset` needs nothing from this batch (its delta was already
    /// applied before a restart), so that the batch still moves the partition past it.
    pub fn skip(&mut self, offset: i64) {
        self.advance(offset);
    }

    /// Adds a malformed message at `offset`, to be dead-lettered by the flush.
    pub fn add_dead_letter(&mut self, dead_letter: DeadLetter, offset: i64) {
        self.dead_letters.push(dead_letter);
        self.advance(offset);
    }

    fn advance(&mut self, offset: i64) {
        self.events += 1;
        self.next_offset = Some(offset + 1);
        self.started.get_or_insert_with(Instant::now);
    }

    /// Whether no message has been added since the last seal.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// Messages buffered.
    pub fn events(&self) -> usize {
        self.events
    }

    /// Whether the batch holds twice a size limit: the next batch has filled up while the
    /// previous flush was still in flight, and its partition must stop fetching until it lands.
    pub fn is_overfull(&self, limits: &Limits) -> bool {
        self.events >= 2 * limits.max_events || self.entries >= 2 * limits.max_counters
    }

    /// Whether the batch hit a size limit and must be flushed now.
    pub fn is_full(&self, limits: &Limits) -> bool {
        self.events >= limits.max_events || self.entries >= limits.max_counters
    }

    /// Whether the batch must be flushed at `now`: full, or holding a message older than the
    /// flush interval.
    pub fn is_due(&self, limits: &Limits, now: Instant) -> bool {
        self.is_full(limits)
            || self
                .started
                .is_some_and(|t| now.saturating_duration_since(t) >= limits.flush_interval)
    }

    /// Takes the contents for flushing, leaving an empty batch. `None` if there is nothing.
    pub fn seal(&mut self) -> Option<SealedBatch> {
        let next_offset = self.next_offset?;
        let taken = std::mem::take(self);
        Some(SealedBatch {
            groups: taken
                .groups
                .into_iter()
                .map(|(group, buffer)| GroupBatch {
                    group,
                    deltas: buffer.deltas.into_iter().filter(|(_, d)| *d != 0).collect(),
                    members: buffer
                        .members
                        .into_iter()
                        .map(|((counter, actor), like)| Member {
                            counter,
                            actor,
                            like,
                        })
                        .collect(),
                })
                .filter(|g| g.writes() > 0)
                .collect(),
            dead_letters: taken.dead_letters,
            events: taken.events,
            next_offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deltas(group: u32, deltas: &[(&str, i64)]) -> GroupBatch {
        GroupBatch {
            group,
            deltas: deltas.iter().map(|(c, d)| ((*c).to_owned(), *d)).collect(),
            members: Vec::new(),
        }
    }

    #[test]
    fn keeps_the_last_action_per_counter_and_actor() {
        let mut b = Batch::default();
        b.add_member(2, "likes:p:1", "u1", true, 0);
        b.add_member(2, "likes:p:1", "u1", false, 1);
        b.add_member(2, "likes:p:1", "u2", true, 2);
        b.add_member(2, "likes:p:1", "u2", true, 3);
        b.add_member(2, "likes:p:2", "u1", true, 4);
        let sealed = b.seal().expect("not empty");
        let mut members = sealed.groups[0].members.clone();
        members.sort();
        let m = |c: &str, a: &str, like| Member {
            counter: c.to_owned(),
            actor: a.to_owned(),
            like,
        };
        assert_eq!(
            members,
            [
                m("likes:p:1", "u1", false),
                m("likes:p:1", "u2", true),
                m("likes:p:2", "u1", true)
            ]
        );
        assert_eq!(
            (sealed.events, sealed.writes(), sealed.next_offset),
            (5, 3, 5)
        );
    }

    fn limits() -> Limits {
        Limits {
            flush_interval: Duration::from_secs(3600),
            max_events: 5,
            max_counters: 3,
        }
    }

    #[test]
    fn sums_deltas_per_counter_and_drops_those_that_cancel() {
        let mut b = Batch::default();
        b.add(0, "a", 2, 10);
        b.add(0, "b", 1, 11);
        b.add(0, "a", -5, 12);
        b.add(0, "b", -1, 13);
        let sealed = b.seal().expect("not empty");
        assert_eq!(sealed.groups, vec![deltas(0, &[("a", -3)])]);
        assert_eq!((sealed.events, sealed.next_offset), (4, 14));
        assert!(b.is_empty() && b.seal().is_none());
    }

    #[test]
    fn keeps_groups_apart_and_skipped_messages_move_the_offset() {
        let mut b = Batch::default();
        b.add(3, "a", 1, 0);
        b.add(7, "a", 2, 1);
        b.add(3, "a", 1, 2);
        b.skip(3);
        let mut sealed = b.seal().expect("not empty");
        sealed.groups.sort_by_key(|g| g.group);
        assert_eq!(
            sealed.groups,
            vec![deltas(3, &[("a", 2)]), deltas(7, &[("a", 2)])]
        );
        assert_eq!(
            (sealed.events, sealed.next_offset, sealed.writes()),
            (4, 4, 2)
        );
    }

    #[test]
    fn full_on_too_many_events() {
        let mut b = Batch::default();
        for offset in 0..4 {
            b.add(0, "a", 1, offset);
        }
        assert!(!b.is_full(&limits()));
        b.add(0, "a", 1, 4);
        assert!(b.is_full(&limits()));
    }

    #[test]
    fn full_on_too_many_distinct_counters() {
        let mut b = Batch::default();
        b.add(0, "a", 1, 0);
        b.add(0, "b", 1, 1);
        assert!(!b.is_full(&limits()));
        // The same counter in another group is another entry.
        b.add(1, "a", 1, 2);
        assert!(b.is_full(&limits()));
    }

    #[test]
    fn due_once_the_oldest_message_is_older_than_the_interval() {
        let limits = Limits {
            flush_interval: Duration::from_millis(100),
            ..limits()
        };
        let mut b = Batch::default();
        let now = Instant::now();
        assert!(
            !b.is_due(&limits, now + Duration::from_secs(10)),
            "empty is never due"
        );
        b.add(0, "a", 1, 0);
        assert!(!b.is_due(&limits, Instant::now()));
        assert!(b.is_due(&limits, Instant::now() + Duration::from_millis(100)));
    }

    #[test]
    fn dead_letters_move_the_offset_and_count_as_events() {
        let mut b = Batch::default();
        b.add_dead_letter(DeadLetter::for_test("undecodable"), 7);
        let sealed = b.seal().expect("not empty");
        assert!(sealed.groups.is_empty());
        assert_eq!(sealed.dead_letters.len(), 1);
        assert_eq!(sealed.next_offset, 8);
    }
}
