//! Counters that expire: in a namespace with `expire_after`, a counter none of whose events
//! arrived for that long disappears with its keys, and its next event starts it from zero.
//!
//! Expiry travels through the log, like a reset, so that it is ordered with the counter's
//! events and applied exactly once:
//!
//! 1. **The idle index.** Every flush of a partition records, in its home group, each counter
//!    it wrote in an expiring namespace with its *idle deadline*: its last event's Kafka
//!    timestamp plus the namespace's `expire_after` (a sorted set, one per partition, see
//!    `Keyspace::idle_key`). One `ZADD GT` per counter per flush, no scan of the keyspace.
//! 2. **The expirer** (`crate::consume::expirer`). Each aggregator, for the partitions it owns, reads the counters whose
//!    deadline has passed (`ZRANGE ... BYSCORE LIMIT`, a page at a time) and appends an *expiry record*
//!    (`tally_common::codec::encode_expiry`: the counter and the expirer's clock) to that
//!    partition. It writes the next page once the records it wrote are behind the partition's
//!    watermark, so a record is not written twice by one owner; a record written twice (by two
//!    owners, across a rebalance) is harmless, see 3.
//! 3. **The decision.** The record is a *conditional* reset: the owner, reading it in log order,
//!    clears the counter only if it is still idle at that point: no event of it in the
//!    partition since its last expiry, or the last one's deadline at or before the record's
//!    clock ([`expires`]). Events earlier in the same batch are held aside until the flush
//!    decides (`crate::machine::batch::Batch::expire`). The flush decides in the home group before
//!    writing any group (`scripts/idle.lua`, or `Transactions::mark_idle`) and records the
//!    decision under the record's offset, so a batch replayed after a crash decides every
//!    group's part the same way, whatever the index says by then. An expired counter is then
//!    cleared like a reset in every group that has not applied the record: its shares, its
//!    compaction journals and its cached total.
//!
//! The decision depends only on the partition's log, so `tally audit` recounts it.
//!
//! Limits: a counter is judged by the events of the partition the record is in. Routed by
//! counter (the producer's default), all its events are there. A counter whose events come
//! through several partitions (routing at random) has an index entry in each, and each
//! partition's expirer judges it by that partition's events alone.

use std::time::Duration;

/// The most expiry records an expirer writes into one partition per round.
pub const PAGE: usize = 1_000;

pub use crate::machine::verdict::expires;

/// How often the expirer looks: a tenth of the shortest `expire_after`, between 250 ms and 10 s.
pub fn interval(shortest_ms: i64) -> Duration {
    Duration::from_millis((shortest_ms / 10).clamp(250, 10_000) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expirer_looks_a_tenth_of_the_shortest_expiry_within_bounds() {
        assert_eq!(interval(60_000), Duration::from_secs(6));
        assert_eq!(interval(1_000), Duration::from_millis(250));
        assert_eq!(interval(86_400_000), Duration::from_secs(10));
    }
}
