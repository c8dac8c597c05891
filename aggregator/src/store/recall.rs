//! What a writer remembers of the cells fields it read and wrote ([`Recall`]), so that a write
//! can skip reading them: it predicts each field (what it last read or wrote there, else nothing)
//! and, once its predictions have held, sends them as the values read. The write's script still
//! checks every field it rewrites against them (`scripts/cells_lib.lua`), so a wrong prediction
//! (another writer, an expiry, a sweep, a forgotten field) costs a write found stale and read
//! again, never a wrong count.
//!
//! Per group the writer either **trusts** its predictions or **reads**. It starts reading; a
//! read compares what it finds with what was predicted, and reads in a row that found every
//! prediction right make it trust them: [`TRUST_AFTER`] at first, twice as many after each write
//! that went by memory and was found stale (up to [`TRUST_AFTER`] << [`MAX_DOUBLINGS`]), so that
//! a group whose fields other writers change (unkeyed traffic over several aggregators, with
//! `grouping = "counter"`) soon seldom tries. A write found stale makes it read again.
//! A long tail of new counters (every field absent) and a partition that alone writes its
//! counters' fields are then written without a read: one round trip and one hash lookup per field
//! fewer for Redis.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::store::cells::{FieldValue, Read, Reads, StripeWrite};

type Hasher = foldhash::fast::RandomState;

/// Per field (a hash of its group and name), what it holds (`None`: nothing): the value a write
/// read or wrote, shared with it.
type Fields = HashMap<u64, Option<FieldValue>, Hasher>;

/// Reads in a row whose predictions all held before a group's predictions are first trusted.
/// One: a group whose fields only this writer changes (keyed traffic, or one aggregator) goes
/// by memory from its second write on; alternated catch-ups of 2,000,000 unkeyed events with
/// three windows ran 4-16% faster than at 4 (`docs/keyspace.md`, "With windows").
pub const TRUST_AFTER: u32 = 1;

/// How many times a group's mispredictions double the reads it needs before it trusts again: 6,
/// up to 64 reads. Measured with two aggregators writing the same fields, where a fixed 1
/// found 75-100% of predicted writes stale.
pub const MAX_DOUBLINGS: u32 = 6;

/// How many fields a writer remembers by default: about 100 bytes each.
pub const DEFAULT_FIELDS: usize = 1 << 20;

/// The cells fields a writer remembers, across its partitions.
#[derive(Debug)]
pub struct Recall {
    state: Mutex<State>,
    hasher: Hasher,
    /// Fields per generation: the newer one is set aside when it holds this many.
    generation: usize,
    /// Writes sent with predicted values instead of read ones, and of those, the ones found
    /// stale.
    predicted: AtomicU64,
    mispredicted: AtomicU64,
}

/// How a writer's predictions went, for its metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecallCounts {
    /// Writes sent with the values the writer remembered instead of reading them, so far.
    pub predicted_writes: u64,
    /// Of those, the ones the script found stale (the writer then read and went again).
    pub mispredicted_writes: u64,
    /// The fields it remembers now.
    pub fields: usize,
}

#[derive(Debug, Default)]
struct State {
    /// The fields seen since the older generation was set aside, then those seen before that.
    newer: Fields,
    older: Fields,
    /// Per group, how far it trusts its predictions.
    trust: HashMap<u32, Trust>,
}

/// How far a group trusts its predictions.
#[derive(Debug, Default)]
struct Trust {
    /// Reads in a row whose predictions all held.
    held: u32,
    /// Predicted writes found stale so far (at most [`MAX_DOUBLINGS`]).
    doublings: u32,
}

impl Trust {
    fn trusted(&self) -> bool {
        self.held >= TRUST_AFTER << self.doublings
    }
}

impl State {
    /// What this writer predicts `id` holds: what it remembers, else nothing.
    fn predicted(&self, id: u64) -> Option<&FieldValue> {
        (self.newer.get(&id).or_else(|| self.older.get(&id))).and_then(Option::as_ref)
    }
}

impl Recall {
    /// Remembering at most about `fields` fields (kept in two generations of half as many).
    pub fn new(fields: usize) -> Self {
        Self {
            state: Mutex::default(),
            hasher: Hasher::default(),
            generation: (fields / 2).max(1),
            predicted: AtomicU64::new(0),
            mispredicted: AtomicU64::new(0),
        }
    }

    fn id(&self, group: u32, field: &str) -> u64 {
        self.hasher.hash_one((group, field))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding it leaves at worst a wrong prediction, which the
        // write's check catches.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the fields of `reads` (group `group`'s) hold, one [`Read`] per hash as if read,
    /// if this writer trusts its predictions there; `None` while it reads.
    pub fn predict(&self, group: u32, reads: &Reads) -> Option<Vec<Read>> {
        let state = self.state();
        if !state.trust.get(&group).is_some_and(Trust::trusted) {
            return None;
        }
        let read = |(_, fields): &(String, Vec<Arc<str>>)| {
            Read::Fields(
                (fields.iter())
                    .map(|f| state.predicted(self.id(group, f)).cloned())
                    .collect(),
            )
        };
        Some(reads.stripes.iter().map(read).collect())
    }

    /// After reading the fields of `reads`: whether what this writer would have predicted held
    /// decides its trust, and what differs is remembered.
    pub fn read(&self, group: u32, reads: &Reads, got: &[Read]) {
        let mut state = self.state();
        let mut held = true;
        for ((_, fields), read) in reads.stripes.iter().zip(got) {
            match read {
                Read::Fields(values) => {
                    for (field, value) in fields.iter().zip(values) {
                        let (id, value) = (self.id(group, field), value.as_ref());
                        if state.predicted(id) != value {
                            held = false;
                            self.insert(&mut state, id, value);
                        }
                    }
                }
                // Not cells: whatever was remembered is forgotten.
                Read::WrongType => {
                    held = false;
                    for field in fields {
                        let id = self.id(group, field);
                        state.newer.remove(&id);
                        state.older.remove(&id);
                    }
                }
            }
        }
        let trust = state.trust.entry(group).or_default();
        trust.held = if held {
            trust.held.saturating_add(1)
        } else {
            0
        };
    }

    /// After `writes` landed: their fields hold what was written. A write that did not land, or
    /// whose fate is unknown (an error), changes nothing here: if it did land after all, the
    /// next write finds its fields stale and reads them.
    pub fn wrote(&self, group: u32, writes: &[StripeWrite]) {
        let mut state = self.state();
        for f in writes.iter().flat_map(|s| &s.fields) {
            let id = self.id(group, &f.field);
            self.insert(&mut state, id, f.value.as_ref());
        }
    }

    /// A write goes with predicted values (from [`Recall::predict`]) instead of read ones.
    pub fn predicted_write(&self) {
        self.predicted.fetch_add(1, Ordering::Relaxed);
    }

    /// A write found a field changed since it was predicted (`predicted`) or read: read again.
    pub fn stale(&self, group: u32, predicted: bool) {
        let mut state = self.state();
        let trust = state.trust.entry(group).or_default();
        trust.held = 0;
        if predicted {
            trust.doublings = (trust.doublings + 1).min(MAX_DOUBLINGS);
            self.mispredicted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How its predictions went so far, and how many fields it remembers.
    pub fn counts(&self) -> RecallCounts {
        let fields = {
            let state = self.state();
            state.newer.len() + state.older.len()
        };
        RecallCounts {
            predicted_writes: self.predicted.load(Ordering::Relaxed),
            mispredicted_writes: self.mispredicted.load(Ordering::Relaxed),
            fields,
        }
    }

    fn insert(&self, state: &mut State, id: u64, value: Option<&FieldValue>) {
        let value = value.cloned();
        let full = state.newer.len() >= self.generation;
        // A field is in one generation at most: one rewritten again (the common case) is
        // replaced where it is, one lookup; a new one is looked up once in each.
        match state.newer.entry(id) {
            Entry::Occupied(mut held) => {
                held.insert(value);
                return;
            }
            Entry::Vacant(slot) if !full => {
                slot.insert(value);
            }
            Entry::Vacant(_) => {
                // Made at its full size: a generation fills it anyway, so it never grows by
                // rehashing.
                let fresh = Fields::with_capacity_and_hasher(self.generation, Hasher::default());
                state.older = std::mem::replace(&mut state.newer, fresh);
                state.newer.insert(id, value);
            }
        }
        state.older.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tally_common::Keyspace;

    use super::*;
    use crate::machine::batch::WindowDelta;
    use crate::store::cells::FieldWrite;

    fn reads(counters: &[&str]) -> Reads {
        let ks = Keyspace::new("t".to_owned(), 1).expect("keyspace");
        let windows: Vec<WindowDelta> = (counters.iter())
            .map(|c| WindowDelta {
                counter: Arc::from(*c),
                width_ms: 60_000,
                start_ms: 0,
                expire_at_ms: 180_000,
                delta: 1,
            })
            .collect();
        Reads::new(&ks, 0, &windows)
    }

    /// What `reads` would read from `held` (field -> value).
    fn got(reads: &Reads, held: &[(&str, &str)]) -> Vec<Read> {
        (reads.stripes.iter())
            .map(|(_, fields)| {
                Read::Fields(
                    (fields.iter())
                        .map(|f| {
                            (held.iter().find(|(k, _)| **k == **f))
                                .map(|(_, v)| FieldValue::from(*v))
                        })
                        .collect(),
                )
            })
            .collect()
    }

    fn writes(reads: &Reads, value: &str) -> Vec<StripeWrite> {
        (reads.stripes.iter())
            .map(|(key, fields)| StripeWrite {
                key: key.clone(),
                expire_at_ms: None,
                fields: (fields.iter())
                    .map(|f| FieldWrite {
                        field: Arc::clone(f),
                        read: None,
                        value: Some(value.into()),
                    })
                    .collect(),
            })
            .collect()
    }

    /// What `recall` remembers of `field` in group 0, trusted or not.
    fn known(recall: &Recall, field: &str) -> Option<String> {
        let state = recall.state();
        state.predicted(recall.id(0, field)).map(|v| v.to_string())
    }

    #[test]
    fn predictions_are_trusted_only_after_reads_in_a_row_that_held() {
        let recall = Recall::new(1_000);
        let r = reads(&["a", "b"]);
        // Nothing known, nothing trusted: it reads. "a" exists, which it did not predict.
        assert_eq!(recall.predict(0, &r), None);
        recall.read(0, &r, &got(&r, &[("a", "1m=0:1")]));
        assert_eq!(known(&recall, "a").as_deref(), Some("1m=0:1"));
        for _ in 0..TRUST_AFTER {
            assert_eq!(recall.predict(0, &r), None);
            recall.read(0, &r, &got(&r, &[("a", "1m=0:1")]));
        }
        assert_eq!(recall.predict(0, &r), Some(got(&r, &[("a", "1m=0:1")])));
        // Another group's trust is its own.
        assert_eq!(recall.predict(1, &r), None);
        // A stale write reads again.
        recall.stale(0, false);
        assert_eq!(recall.predict(0, &r), None);
        // A predicted write found stale doubles the reads it takes to trust again, up to a cap.
        for doublings in 1..=MAX_DOUBLINGS + 1 {
            recall.stale(0, true);
            for _ in 0..TRUST_AFTER << doublings.min(MAX_DOUBLINGS) {
                assert_eq!(recall.predict(0, &r), None);
                recall.read(0, &r, &got(&r, &[("a", "1m=0:1")]));
            }
            assert!(recall.predict(0, &r).is_some(), "{doublings} doublings");
        }
    }

    #[test]
    fn a_write_is_remembered_and_a_read_corrects_it() {
        let recall = Recall::new(1_000);
        let r = reads(&["a"]);
        recall.wrote(0, &writes(&r, "1m=0:2"));
        assert_eq!(known(&recall, "a").as_deref(), Some("1m=0:2"));
        // Another writer added to it: the read finds so, and it is remembered.
        recall.read(0, &r, &got(&r, &[("a", "1m=0:7")]));
        assert_eq!(known(&recall, "a").as_deref(), Some("1m=0:7"));
        // A hash of another type: forgotten.
        recall.read(0, &r, &[Read::WrongType]);
        assert_eq!(known(&recall, "a"), None);
        // A field deleted is remembered as nothing.
        let mut deleted = writes(&r, "");
        deleted[0].fields[0].value = None;
        recall.wrote(0, &deleted);
        assert_eq!(known(&recall, "a"), None);
    }

    #[test]
    fn memory_is_bounded_by_two_generations() {
        let recall = Recall::new(4);
        for i in 0..100 {
            let r = reads(&[&format!("c{i}")]);
            recall.wrote(0, &writes(&r, "1m=0:1"));
        }
        let state = recall.state();
        assert!(state.newer.len() + state.older.len() <= 4);
        drop(state);
        // The latest are still known.
        assert_eq!(known(&recall, "c99").as_deref(), Some("1m=0:1"));
    }
}
