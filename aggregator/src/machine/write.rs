//! One write into a shard group as the stores take it ([`GroupWrite`], [`IdleWrite`]), and
//! what they answer ([`Applied`], [`Stamp`], [`Marked`], the [`Rejection`]s): the vocabulary
//! of `crate::store::sink`'s seam, without the I/O.

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
    /// Nothing written, because these deltas or memberships cannot be applied.
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
    /// then the memberships.
    pub(crate) fn refused(&self, index: usize) -> Option<Refused> {
        let deltas = self.deltas.len();
        let windows = deltas + self.windows.len();
        match index.checked_sub(1)? {
            i if i < deltas => Some(Refused::Delta(i)),
            i if i < windows => Some(Refused::Window(i - deltas)),
            i if i - windows < self.members.len() => Some(Refused::Member(i - windows)),
            _ => None,
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
        let members = [Member {
            counter: "c".to_owned(),
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
        let refused: Vec<Option<Refused>> = (0..6).map(|i| write.refused(i)).collect();
        assert_eq!(
            refused,
            [
                None,
                Some(Refused::Delta(0)),
                Some(Refused::Delta(1)),
                Some(Refused::Window(0)),
                Some(Refused::Member(0)),
                None
            ]
        );
    }
}
