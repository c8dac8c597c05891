//! One write into a shard group as the stores take it ([`GroupWrite`], [`IdleWrite`]), and
//! what they answer ([`Applied`], [`Stamp`], [`Marked`], the [`Rejection`]s): the vocabulary
//! of `crate::store::sink`'s seam, without the I/O.

use std::collections::HashSet;

use tally_common::DeadLetterReason;

use super::batch::{Member, PendingExpiry, WindowDelta};

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
    /// Counters to clear here first (resets): their share, member set and compaction journal.
    pub resets: &'a [String],
    /// Likes and unlikes: membership changes, each counting only if it changes the membership.
    pub members: &'a [Member],
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
    /// write tried again finds them done (`LikeRuns`).
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
    /// then the runs of likes (`runs`, built from this write's members), each naming every
    /// membership of its counter. Empty if it names nothing.
    pub(crate) fn refused(&self, index: usize, runs: &LikeRuns) -> Vec<Refused> {
        let deltas = self.deltas.len();
        let windows = deltas + self.windows.len();
        match index.checked_sub(1) {
            None => Vec::new(),
            Some(i) if i < deltas => vec![Refused::Delta(i)],
            Some(i) if i < windows => vec![Refused::Window(i - deltas)],
            Some(i) if i - windows < runs.len() => {
                let (likes, unlikes) = runs.run(i - windows);
                (likes.iter().chain(unlikes))
                    .map(|&m| Refused::Member(m))
                    .collect()
            }
            Some(_) => Vec::new(),
        }
    }
}

/// A write's likes and unlikes in runs, one per counter, as `scripts/flush.lua` takes them:
/// a run is one `SADD` of the counter's likers, one `SREM` of its unlikers and one `INCRBY` by
/// what they changed, where each membership used to be four commands (`TYPE`, `GET`, `SADD` or
/// `SREM`, `INCRBY`). A run is its own check, and idempotent: its set holds its likers and not
/// its unlikers whatever it held before, and its count moved by exactly what the set did, so a
/// run that landed in a write that was then refused or failed is found done when it is tried
/// again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LikeRuns {
    /// Indexes into the members: each run's likes, then its unlikes, run after run.
    order: Vec<usize>,
    /// Per run: where it ends in `order`, and how many of it are likes.
    ends: Vec<(usize, usize)>,
}

impl LikeRuns {
    /// The runs of `members`: in the order of their counters' first memberships when the
    /// members list each counter's together (a sealed batch does), in counter order otherwise.
    pub fn new(members: &[Member]) -> Self {
        Self::grouped(members).unwrap_or_else(|| Self::sorted(members))
    }

    /// The runs of `members` in one pass, or `None` if a counter comes back after another's
    /// (a write whose refused members were taken out).
    fn grouped(members: &[Member]) -> Option<Self> {
        let mut order = Vec::with_capacity(members.len());
        let mut ends = Vec::new();
        let mut seen: HashSet<&str, foldhash::fast::RandomState> = HashSet::default();
        let mut start = 0;
        while let Some(first) = members.get(start) {
            let counter = &*first.counter;
            if !seen.insert(counter) {
                return None;
            }
            let end = (members[start..].iter())
                .position(|m| *m.counter != *counter)
                .map_or(members.len(), |n| start + n);
            let before = order.len();
            order.extend((start..end).filter(|&i| members[i].like));
            let likes = order.len() - before;
            order.extend((start..end).filter(|&i| !members[i].like));
            ends.push((order.len(), likes));
            start = end;
        }
        Some(Self { order, ends })
    }

    /// The runs of `members`, in counter order.
    fn sorted(members: &[Member]) -> Self {
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_unstable_by(|&a, &b| {
            let (a, b) = (&members[a], &members[b]);
            (a.counter.cmp(&b.counter)).then(b.like.cmp(&a.like))
        });
        let mut ends = Vec::new();
        let mut likes = 0;
        for (at, &i) in order.iter().enumerate() {
            likes += usize::from(members[i].like);
            let next = order.get(at + 1).map(|&j| &members[j].counter);
            if next != Some(&members[i].counter) {
                ends.push((at + 1, likes));
                likes = 0;
            }
        }
        Self { order, ends }
    }

    /// How many runs (counters).
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Run `k`'s members, as indexes into the members: its likes, then its unlikes.
    pub fn run(&self, k: usize) -> (&[usize], &[usize]) {
        let start = k.checked_sub(1).map_or(0, |j| self.ends[j].0);
        let (end, likes) = self.ends[k];
        self.order[start..end].split_at(likes)
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
        let members = [Member {
            counter: "c".into(),
            actor: "u".to_owned(),
            like: true,
        }];
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
        let runs = LikeRuns::new(&members);
        let refused: Vec<Vec<Refused>> = (0..6).map(|i| write.refused(i, &runs)).collect();
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

    #[test]
    fn likes_run_per_counter_likes_first() {
        let m = |counter: &str, actor: &str, like| Member {
            counter: counter.into(),
            actor: actor.to_owned(),
            like,
        };
        let members = [
            m("b", "u1", false),
            m("a", "u1", true),
            m("b", "u2", true),
            m("c", "u3", false),
            m("a", "u2", true),
        ];
        let runs = LikeRuns::new(&members);
        assert_eq!(runs.len(), 3);
        let mut a = runs.run(0).0.to_vec();
        a.sort_unstable();
        assert_eq!((a, runs.run(0).1), (vec![1, 4], &[][..]));
        assert_eq!(runs.run(1), (&[2][..], &[0][..]));
        assert_eq!(runs.run(2), (&[][..], &[3][..]));
        assert!(LikeRuns::new(&[]).is_empty());
        // Each counter's memberships together (as sealed): the same runs in one pass, in the
        // order the counters come.
        let grouped = [
            m("b", "u1", false),
            m("b", "u2", true),
            m("a", "u1", true),
            m("a", "u2", true),
            m("c", "u3", false),
        ];
        let runs = LikeRuns::new(&grouped);
        assert_eq!(runs.len(), 3);
        assert_eq!(runs.run(0), (&[1][..], &[0][..]));
        assert_eq!(runs.run(1), (&[2, 3][..], &[][..]));
        assert_eq!(runs.run(2), (&[][..], &[4][..]));
    }

    /// Applies `runs` of `members` as `scripts/flush.lua` does: per run, `SADD` of its likers and
    /// `SREM` of its unlikers, the count moved by what they changed.
    fn apply_runs(
        members: &[Member],
        sets: &mut std::collections::HashMap<String, std::collections::HashSet<String>>,
        counts: &mut std::collections::HashMap<String, i64>,
    ) {
        let runs = LikeRuns::new(members);
        for k in 0..runs.len() {
            let (likes, unlikes) = runs.run(k);
            let counter = &members[likes
                .first()
                .or(unlikes.first())
                .copied()
                .expect("a run is not empty")]
            .counter;
            let set = sets.entry(counter.to_string()).or_default();
            let added = (likes.iter())
                .filter(|&&i| set.insert(members[i].actor.clone()))
                .count() as i64;
            let removed = (unlikes.iter())
                .filter(|&&i| set.remove(&members[i].actor))
                .count() as i64;
            *counts.entry(counter.to_string()).or_default() += added - removed;
        }
    }

    /// The batched arithmetic (the last action per (counter, actor) in a batch, then one run per
    /// counter) against applying every like and unlike one by one, over random streams cut
    /// into random batches, each batch's runs applied once or, as after a crash before the
    /// ledger moved, twice.
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
            for offset in 0..rng.random_range(1..400) {
                let counter = format!("likes:p:{}", rng.random_range(0..counters));
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
                    let sealed = batch.seal().expect("not empty");
                    // As sealed (each counter's members together: the one-pass runs), or in
                    // actor order (counters mixed, as after a refusal: the sorted runs).
                    let grouped = sealed.groups[0].members.clone();
                    let mut mixed = grouped.clone();
                    mixed.sort_by(|a, b| a.actor.cmp(&b.actor));
                    let (first, again) = if rng.random_bool(0.5) {
                        (&grouped, &mixed)
                    } else {
                        (&mixed, &grouped)
                    };
                    apply_runs(first, &mut sets, &mut counts);
                    if rng.random_bool(0.3) {
                        apply_runs(again, &mut sets, &mut counts);
                    }
                }
            }
            if let Some(sealed) = batch.seal() {
                apply_runs(&sealed.groups[0].members, &mut sets, &mut counts);
            }
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
