//! What became of a partition's flush or check, as its state machine is told.

use super::ownership::Owner;

/// How a flush ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlushOutcome {
    /// Everything is durable; the partition may resume from `next_offset`.
    Durable {
        /// The offset to commit.
        next_offset: i64,
        /// In exactly-once mode, the owner with its ledgers after this flush.
        owner: Option<Owner>,
    },
    /// Cancelled before it was durable; nothing may be committed.
    Cancelled,
    /// Refused by a fence: the partition belongs to a newer owner. Nothing may be committed.
    Fenced,
    /// A group lost writes this owner had seen land (Redis restarted from an older state).
    /// Nothing may be committed; the partition must be acquired again and re-fed from where
    /// Redis now stands.
    RolledBack,
}

/// What a check of an idle partition's standing found ([`crate::consume::flush::Flusher::verify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Redis still holds everything this owner wrote (or could not be asked: the next check or
    /// flush asks again).
    Held,
    /// A newer owner has the partition.
    Fenced,
    /// A group lost writes this owner had seen land.
    RolledBack,
}
