//! Where flushed deltas go: the [`Sink`] seam, what a write is ([`GroupWrite`]) and what became
//! of it ([`Applied`]), and how its errors are classified ([`SinkError`]). The Redis
//! implementation is `crate::redis_sink`.
//!
//! Every write goes to one shard group (see `tally_common::keyspace`), whose keys share a hash tag,
//! so each operation is single-slot (valid on Redis Cluster) and lands all or nothing:
//!
//! - at-least-once: the group's increments, all or none ([`Sink::apply`]);
//! - exactly-once: [`Sink::apply_fenced`] checks the writer's fence, recognises a write the group
//!   already applied (its ledger entry), and writes the increments, the ledger entry and, when
//!   asked, the watermark, all or none: a counter Redis cannot take (type, 64-bit overflow)
//!   comes back as a [`Rejection`] with nothing written.
//!
//! Errors are classified at this boundary (`crate::store_error`'s tables) as retryable
//! (connection, timeout, out of memory, read-only, busy, failing over) or needing an operator
//! (a permission, the data, anything unknown); the flush loop retries both with capped backoff,
//! because dropping a batch would lose counts, but only the former are expected to heal by
//! themselves. No error ever refuses a delta: only a [`Rejection`], read from the data, does.

use std::future::Future;

use tally_common::DeadLetterReason;

use crate::machine::batch::{Member, PendingExpiry, WindowDelta};
use crate::store_error::{ErrorClass, RedisReply, redis_error_class};

/// Why a sink write failed.
#[derive(Debug, thiserror::Error)]
#[error("{kind} store error: {source}")]
pub struct SinkError {
    /// Whether a retry can be expected to succeed without an operator.
    pub kind: SinkErrorKind,
    /// What the store (or the connection) said: a `redis::RedisError` or a
    /// `tokio_postgres::Error`, among others.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl SinkError {
    /// A fatal error: the store refused, and an operator is needed.
    pub fn fatal(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            kind: SinkErrorKind::Fatal,
            source: source.into(),
        }
    }

    /// A retryable error: the store should heal by itself (connection lost, timeout, conflict).
    pub fn retryable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self {
            kind: SinkErrorKind::Retryable,
            source: source.into(),
        }
    }

    /// The Redis error behind it, if it came from Redis.
    pub fn redis(&self) -> Option<&redis::RedisError> {
        self.source.downcast_ref()
    }
}

/// Retryable or fatal, decided once here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkErrorKind {
    /// Connection lost, timeout, server loading, busy, failing over: retry.
    Retryable,
    /// The server refused the command (wrong type, overflow, ACL): needs an operator.
    Fatal,
}

impl std::fmt::Display for SinkErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SinkErrorKind::Retryable => "retryable",
            SinkErrorKind::Fatal => "fatal",
        })
    }
}

impl SinkError {
    /// An error of `class` (see `crate::store_error`): retryable if the store heals by itself,
    /// else one that needs an operator. Both are retried.
    pub fn of_class(
        class: ErrorClass,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            kind: if class.heals_by_itself() {
                SinkErrorKind::Retryable
            } else {
                SinkErrorKind::Fatal
            },
            source: source.into(),
        }
    }
}

impl From<redis::RedisError> for SinkError {
    fn from(source: redis::RedisError) -> Self {
        SinkError::of_class(redis_error_class(&source), source)
    }
}

impl From<RedisReply> for SinkError {
    fn from(reply: RedisReply) -> Self {
        SinkError::of_class(reply.class(), reply)
    }
}

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
    /// Deltas to add to time buckets of windowed namespaces, each key expiring with its bucket.
    pub windows: &'a [WindowDelta],
    /// Counters to clear here first (resets): their share, member set and compaction journal.
    pub resets: &'a [String],
    /// Likes and unlikes: membership changes, each counting only if it changes the membership.
    pub members: &'a [Member],
    /// The watermark to store in this group in the same operation, if it is the home group.
    pub watermark: Option<&'a str>,
}

/// The expiry work of one flush, for the partition's home group (`crate::expiry`).
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

/// Applies deltas to shard groups, and keeps the exactly-once bookkeeping beside them.
pub trait Sink: Clone + Send + Sync + 'static {
    /// At-least-once: clears the `resets` counters' keys in `group`, then adds each
    /// `(counter, delta)` to the counter's key there and each window delta to its bucket's key.
    /// Returns the deltas the store refused for their data (as [`Sink::apply_fenced`] does:
    /// `Refused::Delta` and `Refused::Window` indexes), none of which was applied; all the rest
    /// was. An error means nothing was applied, or (an error the store gives for one command
    /// of a transaction that is not about its data, which Redis does not) some of it: retried
    /// whole, a duplicate that at-least-once allows.
    fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[String],
    ) -> impl Future<Output = Result<Vec<Rejection>, SinkError>> + Send;

    /// Exactly-once: one fenced, deduplicated, validated write into one group.
    fn apply_fenced(
        &self,
        write: GroupWrite<'_>,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send;

    /// Takes the partition's next epoch in its home group, at least `at_least`.
    fn next_epoch(
        &self,
        home: u32,
        field: &str,
        at_least: u64,
    ) -> impl Future<Output = Result<u64, SinkError>> + Send;

    /// Stamps `epoch` into the partition's fence in `group` and reads its ledger entry there.
    fn stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> impl Future<Output = Result<Stamp, SinkError>> + Send;

    /// Stores the partition's watermark in its home group if `epoch` still holds the fence.
    /// Returns [`Applied::Written`], [`Applied::Fenced`] or [`Applied::RolledBack`].
    fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send;

    /// Reads the partition's fence (epoch) and ledger entry in `group`, in one slot.
    fn read_fence_and_ledger(
        &self,
        group: u32,
        field: &str,
    ) -> impl Future<Output = Result<(Option<u64>, Option<i64>), SinkError>> + Send;

    /// Drops the cached totals of `counters` that readers share (after a reset); a store without
    /// such a cache does nothing.
    fn forget_cached(
        &self,
        counters: &[String],
    ) -> impl Future<Output = Result<(), SinkError>> + Send {
        let _ = counters;
        std::future::ready(Ok(()))
    }

    /// Exactly-once, in the partition's home group before a batch's group writes: decides the
    /// batch's expiry records and moves the partition's idle index (`crate::expiry`). A store
    /// that cannot expire counters refuses.
    fn mark_idle(
        &self,
        write: IdleWrite<'_>,
    ) -> impl Future<Output = Result<Marked, SinkError>> + Send {
        let _ = write;
        std::future::ready(Err(SinkError::fatal("this store cannot expire counters")))
    }

    /// Up to `limit` counters of the partition's idle index whose deadline is at or before
    /// `now_ms`. A store that cannot expire counters has none.
    fn idle_counters(
        &self,
        home: u32,
        field: &str,
        now_ms: i64,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<String>, SinkError>> + Send {
        let _ = (home, field, now_ms, limit);
        std::future::ready(Ok(Vec::new()))
    }

    /// Reads the partition's watermark from its home group.
    fn read_watermark(
        &self,
        home: u32,
        field: &str,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_indexes_name_the_deltas_then_the_windows_then_the_memberships() {
        let deltas = [("a".to_owned(), 1), ("b".to_owned(), 2)];
        let windows = [WindowDelta {
            counter: "a".to_owned(),
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
