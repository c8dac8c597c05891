//! One partition's buffer: deltas summed per counter, plus the malformed messages to dead-letter,
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

/// The buffer of one partition.
#[derive(Debug, Default)]
pub struct Batch {
    /// Summed delta per counter id.
    deltas: HashMap<String, i64>,
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
    /// Non-zero summed deltas per counter (deltas that cancelled out are left out).
    pub deltas: Vec<(String, i64)>,
    /// Malformed messages to copy to the dead-letter topic before the offset moves.
    pub dead_letters: Vec<DeadLetter>,
    /// Messages in the batch.
    pub events: usize,
    /// The offset to commit once the batch is durable.
    pub next_offset: i64,
}

impl Batch {
    /// Adds a valid event at `offset`.
    pub fn add(&mut self, counter: &str, delta: i64, offset: i64) {
        // Look up by &str first: the common case (a counter already in the batch) allocates nothing.
        match self.deltas.get_mut(counter) {
            // Cannot overflow: |delta| <= 10^12 and a batch holds far fewer than 9.2 million events.
            Some(sum) => *sum += delta,
            None => {
                self.deltas.insert(counter.to_owned(), delta);
            }
        }
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

    /// Whether the batch hit a size limit and must be flushed now.
    pub fn is_full(&self, limits: &Limits) -> bool {
        self.events >= limits.max_events || self.deltas.len() >= limits.max_counters
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
            deltas: taken.deltas.into_iter().filter(|(_, d)| *d != 0).collect(),
            dead_letters: taken.dead_letters,
            events: taken.events,
            next_offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        b.add("a", 2, 10);
        b.add("b", 1, 11);
        b.add("a", -5, 12);
        b.add("b", -1, 13);
        let mut sealed = b.seal().expect("not empty");
        sealed.deltas.sort();
        assert_eq!(sealed.deltas, vec![("a".to_owned(), -3)]);
        assert_eq!((sealed.events, sealed.next_offset), (4, 14));
        assert!(b.is_empty() && b.seal().is_none());
    }

    #[test]
    fn full_on_too_many_events() {
        let mut b = Batch::default();
        for offset in 0..4 {
            b.add("a", 1, offset);
        }
        assert!(!b.is_full(&limits()));
        b.add("a", 1, 4);
        assert!(b.is_full(&limits()));
    }

    #[test]
    fn full_on_too_many_distinct_counters() {
        let mut b = Batch::default();
        b.add("a", 1, 0);
        b.add("b", 1, 1);
        assert!(!b.is_full(&limits()));
        b.add("c", 1, 2);
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
        b.add("a", 1, 0);
        assert!(!b.is_due(&limits, Instant::now()));
        assert!(b.is_due(&limits, Instant::now() + Duration::from_millis(100)));
    }

    #[test]
    fn dead_letters_move_the_offset_and_count_as_events() {
        let mut b = Batch::default();
        b.add_dead_letter(DeadLetter::for_test("undecodable"), 7);
        let sealed = b.seal().expect("not empty");
        assert!(sealed.deltas.is_empty());
        assert_eq!(sealed.dead_letters.len(), 1);
        assert_eq!(sealed.next_offset, 8);
    }
}
