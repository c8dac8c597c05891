//! Where flushed deltas go: the [`Sink`] seam, what a write is ([`GroupWrite`]) and what became
//! of it ([`Applied`]), and how its errors are classified ([`SinkError`]). The Redis
//! implementation is `crate::store::redis_sink`.
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
//! Errors are classified at this boundary (`crate::store::store_error`'s tables) as retryable
//! (connection, timeout, out of memory, read-only, busy, failing over) or needing an operator
//! (a permission, the data, anything unknown); the flush loop retries both with capped backoff,
//! because dropping a batch would lose counts, but only the former are expected to heal by
//! themselves. No error ever refuses a delta: only a [`Rejection`], read from the data, does.

use std::future::Future;

use crate::machine::batch::{Reset, WindowDelta};
pub use crate::machine::write::{
    Applied, GroupWrite, IdleWrite, Marked, Refused, Rejection, Stamp,
};
use crate::store::recall::RecallCounts;
use crate::store::store_error::{ErrorClass, RedisReply, redis_error_class};

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

    /// The refusal of an owner that counts likes in the shares, at a group whose likes were
    /// moved to count sets: fatal, and no retry of this process's can succeed.
    pub fn likes_moved(group: u32) -> Self {
        Self::fatal(LikesMoved { group })
    }

    /// Whether it is [`SinkError::likes_moved`].
    pub fn is_likes_moved(&self) -> bool {
        self.source.downcast_ref::<LikesMoved>().is_some()
    }
}

/// A group's likes were moved to count sets (`tally likes-to-sets`) under a writer that counts
/// them in the shares ([`tally_common::layout::moved_message`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LikesMoved {
    /// The group.
    pub group: u32,
}

impl std::fmt::Display for LikesMoved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&tally_common::layout::moved_message(self.group))
    }
}

impl std::error::Error for LikesMoved {}

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
    /// An error of `class` (see `crate::store::store_error`): retryable if the store heals by itself,
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

/// Applies deltas to shard groups, and keeps the exactly-once bookkeeping beside them.
pub trait Sink: Clone + Send + Sync + 'static {
    /// At-least-once: clears the `resets` counters' keys in `group`, then adds each
    /// `(counter, delta)` to the counter's key there and each window delta to its bucket in the
    /// counter's cells.
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
        resets: &[Reset],
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

    /// Moves the partition's ledger entry in `group` back to `to` where it is past it, if
    /// `epoch` still holds the fence there: the log was truncated at `to` under what the group
    /// had applied (an unclean leader election), and the new leader's records from `to` on are
    /// new. Returns [`Applied::Written`] or [`Applied::Fenced`].
    fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
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
    /// batch's expiry records and moves the partition's idle index (`crate::tasks::expiry`). A store
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

    /// The deployment's stored group plan (`tally_common::regroup`), if it was re-grouped. A
    /// store that cannot be re-grouped has none.
    fn read_plan(&self) -> impl Future<Output = Result<Option<String>, SinkError>> + Send {
        std::future::ready(Ok(None))
    }

    /// Whether `group`'s likes were moved to count sets under this writer, which counts them
    /// in the shares: asked when a write of its is fenced, since the move fences every owner.
    /// A store without likes in the shares says no.
    fn likes_moved(&self, group: u32) -> impl Future<Output = Result<bool, SinkError>> + Send {
        let _ = group;
        std::future::ready(Ok(false))
    }

    /// How the writer's predictions of window cells went (`crate::store::recall`), for a store
    /// whose writes predict them.
    fn recall_counts(&self) -> Option<RecallCounts> {
        None
    }

    /// How many memberships cost this store's flush about what a counter's delta does
    /// ([`crate::machine::pace::Size::memberships_per_entry`]), as it writes them now (asked
    /// at every tick of the consume loop).
    fn memberships_per_entry(&self) -> usize {
        crate::machine::pace::MEMBERSHIPS_PER_ENTRY
    }

    /// The most entries one shard group's write should hold
    /// ([`crate::machine::pace::Size::max_group_entries`]), as this store writes now (asked at
    /// every tick of the consume loop): unbounded unless a write's cost grows faster than its
    /// size.
    fn max_group_entries(&self) -> usize {
        usize::MAX
    }
}
