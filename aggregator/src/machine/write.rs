//! One write into a shard group as the stores take it ([`GroupWrite`], [`IdleWrite`]), and
//! what they answer ([`Applied`], [`Stamp`], [`Marked`], the [`Rejection`]s): the vocabulary
//! of `crate::store::sink`'s seam, without the I/O.

use tally_common::DeadLetterReason;

use super::batch::{PendingExpiry, Reset, WindowDelta};
use super::likes::Likes;

/// One exactly-once write into one shard group.
#[derive(Debug, Clone, Copy)]
pub struct GroupWrite<'a> {
    /// The group.
    pub group: u32,
    /// The partition's field in the ledger, fence and watermark hashes.
    pub field: &'a str,
    /// The writer's epoch; the write is refused unless the group's fence holds it.
    pub epoch: u64,
    /// The group's ledger entry as the writer last saw it; finding it lower means the group lost
    /// writes (Redis restarted from an older state).
    pub expected_ledger: i64,
    /// The ledger entry after this write: the offset after the batch's last message.
    pub next_offset: i64,
    /// `(counter, delta)` pairs to add.
    pub deltas: &'a [(String, i64)],
    /// Deltas to add to time buckets of windowed namespaces (rewritten in the counters' cells).
    pub windows: &'a [WindowDelta],
    /// Counters to clear here first (resets and expiries): their share, member set and
    /// compaction journal; each with its offset, which the group records while a compactor
    /// moves shares (`crate::tasks::compact`).
    pub resets: &'a [Reset],
    /// Likes and unlikes: membership changes, each counting only if it changes the membership,
    /// in a run per counter (one `SADD` of its likers, one `SREM` of its unlikers and one
    /// `INCRBY` by what they changed in `scripts/flush.lua`).
    pub members: &'a Likes,
    /// The watermark to store in this group in the same operation, if it is the home group.
    pub watermark: Option<&'a str>,
}

/// The expiry work of one flush, for the partition's home group (`crate::tasks::expiry`).
#[derive(Debug, Clone, Copy)]
pub struct IdleWrite<'a> {
    /// The partition's home group.
    pub home: u32,
    /// The partition's field.
    pub field: &'a str,
    /// The writer's epoch; refused unless the fence holds it.
    pub epoch: u64,
    /// The batch's expiry records, in log order.
    pub expiries: &'a [PendingExpiry],
    /// The counters the batch wrote in expiring namespaces, with their latest idle deadline.
    pub touched: &'a [(String, i64)],
}

/// What the home group answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marked {
    /// Per record, in order: whether the counter expired.
    Decided(Vec<bool>),
    /// Not the owner any more ([`Applied::Fenced`]), or Redis lost the fence
    /// ([`Applied::RolledBack`]).
    Refused(Applied),
}

/// What became of an exactly-once write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Written now.
    Written,
    /// The group had already applied it (an earlier attempt landed): nothing written.
    AlreadyApplied,
    /// The group's fence holds a newer epoch: the writer no longer owns the partition.
    Fenced,
    /// The group lost writes the writer had seen land (its ledger entry, or its fence, is older
    /// than the writer's): Redis came back from a crash with an older state. Nothing written.
    RolledBack,
    /// Not written, because these deltas or memberships cannot be applied. No delta or window
    /// delta was written; a counter's likes that landed before the refusal stay, since the
    /// write tried again finds them done (a run is idempotent: its set holds its likers and
    /// not its unlikers whatever it held before, and its count moved by exactly what the set
    /// did).
    Rejected(Vec<Rejection>),
}

/// What a refused write could not apply, by its index in [`GroupWrite`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refused {
    /// `deltas[i]`.
    Delta(usize),
    /// `windows[i]`.
    Window(usize),
    /// `members[i]`.
    Member(usize),
}

/// One delta or membership Redis cannot take, and why (`overflow`, `wrong_type`,
/// `not_an_integer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Which.
    pub refused: Refused,
    /// Why.
    pub reason: DeadLetterReason,
}

impl GroupWrite<'_> {
    /// What the script's 1-based `index` names: the deltas come first, then the window deltas,
    /// then the runs of likes, each naming every membership of its counter. Empty if it names
    /// nothing.
    pub(crate) fn refused(&self, index: usize) -> Vec<Refused> {
        let deltas = self.deltas.len();
        let windows = deltas + self.windows.len();
        match index.checked_sub(1) {
            None => Vec::new(),
            Some(i) if i < deltas => vec![Refused::Delta(i)],
            Some(i) if i < windows => vec![Refused::Window(i - deltas)],
            Some(i) if i - windows < self.members.runs() => {
                (self.members.run(i - windows).members())
                    .map(Refused::Member)
                    .collect()
            }
            Some(_) => Vec::new(),
        }
    }
}

impl Applied {
    /// What a fence holding another epoch than the writer's means: a newer owner's
    /// ([`Applied::Fenced`]), or, older or gone, a Redis that lost it ([`Applied::RolledBack`]).
    pub fn from_fence(current: Option<u64>, epoch: u64) -> Self {
        if current.unwrap_or(0) > epoch {
            Applied::Fenced
        } else {
            Applied::RolledBack
        }
    }
}

/// What stamping a fence found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    /// Stamped; the group's ledger entry for the partition (-1 if none).
    Stamped {
        /// The ledger entry.
        ledger: i64,
    },
    /// Refused: the fence already holds this epoch or a newer one.
    Stale {
        /// The fence's epoch.
        current: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_indexes_name_the_deltas_then_the_windows_then_the_memberships() {
        let deltas = [("a".to_owned(), 1), ("b".to_owned(), 2)];
        let windows = [WindowDelta {
            counter: "a".into(),
            width_ms: 60_000,
            start_ms: 0,
            expire_at_ms: 120_000,
            delta: 1,
        }];
        let members = Likes::from_actions([("c", "u", true)]);
        let write = GroupWrite {
            group: 0,
            field: "t/0",
            epoch: 1,
            expected_ledger: -1,
            next_offset: 1,
            deltas: &deltas,
            windows: &windows,
            resets: &[],
            members: &members,
            watermark: None,
        };
        let refused: Vec<Vec<Refused>> = (0..6).map(|i| write.refused(i)).collect();
        assert_eq!(
            refused,
            [
                vec![],
                vec![Refused::Delta(0)],
                vec![Refused::Delta(1)],
                vec![Refused::Window(0)],
                vec![Refused::Member(0)],
                vec![]
            ]
        );
    }

    /// Applies `members` as `scripts/flush.lua` does: per run, `SADD` of its likers and `SREM`
    /// of its unlikers, the count moved by what they changed.
    fn apply_runs(
        members: &Likes,
        sets: &mut std::collections::HashMap<String, std::collections::HashSet<String>>,
        counts: &mut std::collections::HashMap<String, i64>,
    ) {
        for run in members.each_run() {
            let set = sets.entry(run.counter.to_owned()).or_default();
            let added = (run.likes)
                .filter(|&i| set.insert(members.actor(i).to_owned()))
                .count() as i64;
            let removed = (run.unlikes)
                .filter(|&i| set.remove(members.actor(i)))
                .count() as i64;
            *counts.entry(run.counter.to_owned()).or_default() += added - removed;
        }
    }

    /// The batched arithmetic (the last action per (counter, actor) in a batch, then one run per
    /// counter) against applying every like, unlike and reset one by one, over random streams
    /// cut into random batches, each batch's runs applied once or twice.
    #[test]
    fn runs_of_batched_likes_count_what_one_by_one_counts() {
        use rand::{Rng, SeedableRng};
        use std::collections::{HashMap, HashSet};

        use super::super::batch::Batch;

        for seed in 0..200 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let counters = rng.random_range(1..6);
            let actors = rng.random_range(1..12);
            let mut one_sets: HashMap<String, HashSet<String>> = HashMap::new();
            let mut one_counts: HashMap<String, i64> = HashMap::new();
            let mut sets = HashMap::new();
            let mut counts = HashMap::new();
            let mut batch = Batch::default();
            // A sealed batch's resets clear their counters, then its runs apply; as after a
            // refusal that followed runs that landed (never with resets: those check
            // everything first), the runs may apply again.
            let mut apply = |batch: &mut Batch, rng: &mut rand::rngs::StdRng| {
                let Some(sealed) = batch.seal() else { return };
                let group = &sealed.groups[0];
                for counter in group.resets.iter().map(|r| &r.counter) {
                    sets.remove(counter);
                    counts.remove(counter);
                }
                apply_runs(&group.members, &mut sets, &mut counts);
                if group.resets.is_empty() && rng.random_bool(0.3) {
                    apply_runs(&group.members, &mut sets, &mut counts);
                }
            };
            for offset in 0..rng.random_range(1..400) {
                let counter = format!("likes:p:{}", rng.random_range(0..counters));
                if rng.random_bool(0.02) {
                    one_sets.remove(&counter);
                    one_counts.remove(&counter);
                    batch.reset(&counter, 0..1, offset);
                    continue;
                }
                let actor = format!("u{}", rng.random_range(0..actors));
                let like = rng.random_bool(0.6);
                let set = one_sets.entry(counter.clone()).or_default();
                let changed = if like {
                    set.insert(actor.clone())
                } else {
                    set.remove(&actor)
                };
                *one_counts.entry(counter.clone()).or_default() +=
                    i64::from(changed) * if like { 1 } else { -1 };
                batch.add_member(0, &counter, &actor, like, offset);
                if rng.random_bool(0.05) {
                    apply(&mut batch, &mut rng);
                }
            }
            apply(&mut batch, &mut rng);
            one_counts.retain(|_, n| *n != 0);
            counts.retain(|_, n| *n != 0);
            sets.retain(|_, s: &mut HashSet<String>| !s.is_empty());
            one_sets.retain(|_, s| !s.is_empty());
            assert_eq!(counts, one_counts, "seed {seed}");
            assert_eq!(sets, one_sets, "seed {seed}");
            for (counter, set) in &sets {
                assert_eq!(counts.get(counter).copied().unwrap_or(0), set.len() as i64);
            }
        }
    }
}
