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
//! 2. **The expirer.** Each aggregator, for the partitions it owns, reads the counters whose
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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tally_common::event::now_ms;
use tally_common::keyspace::partition_field;
use tokio_util::sync::CancellationToken;

use crate::consume::Shared;
use crate::store::sink::Sink;

/// The most expiry records an expirer writes into one partition per round.
pub const PAGE: usize = 1_000;

/// Whether a counter expires at its expiry record: `last` is its deadline in the index (the
/// latest of its events before this batch since its last expiry, if any), `held` the latest of
/// its events earlier in the batch, `deadline` the record's clock. Idle means: it had an event
/// since its last expiry (else there is nothing to clear), and every one's deadline has passed.
/// `scripts/idle.lua` decides the same way.
pub fn expires(last: Option<i64>, held: Option<i64>, deadline: i64) -> bool {
    last.max(held).is_some_and(|latest| latest <= deadline)
}

/// How often the expirer looks: a tenth of the shortest `expire_after`, between 250 ms and 10 s.
pub fn interval(shortest_ms: i64) -> Duration {
    Duration::from_millis((shortest_ms / 10).clamp(250, 10_000) as u64)
}

/// Writes expiry records into the partitions this aggregator owns until `shutdown` fires.
pub(crate) async fn run<S: Sink>(
    shared: Arc<Shared<S>>,
    every: Duration,
    shutdown: CancellationToken,
) {
    // Per partition: the offset of the last record written, until the watermark passes it.
    let mut waiting: HashMap<i32, i64> = HashMap::new();
    // A failure is logged as a warning once, until a round succeeds again.
    let mut failing = false;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let owned = shared.owned_partitions();
        waiting.retain(|p, _| owned.contains(p));
        for partition in owned {
            match round(&shared, partition, &mut waiting).await {
                Ok(()) => failing = false,
                Err(error) if failing => tracing::debug!(partition, %error, "expiry round failed"),
                Err(error) => {
                    failing = true;
                    tracing::warn!(partition, %error, "expiry round failed; trying again next round");
                }
            }
        }
    }
}

/// One partition's round: if its last records are applied, write the next page.
async fn round<S: Sink>(
    shared: &Shared<S>,
    partition: i32,
    waiting: &mut HashMap<i32, i64>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let keyspace = &shared.settings.keyspace;
    let home = keyspace.group_for_partition(partition);
    let field = partition_field(&shared.settings.topic, partition);
    let sink = &shared.flusher.sink;
    if let Some(&last) = waiting.get(&partition) {
        let watermark = sink.read_watermark(home, &field).await?;
        let resume = watermark
            .as_deref()
            .and_then(tally_common::keyspace::Watermark::parse)
            .map_or(-1, |w| w.next_offset);
        if resume <= last {
            return Ok(());
        }
        waiting.remove(&partition);
    }
    let now = now_ms();
    let idle = sink.idle_counters(home, &field, now, PAGE).await?;
    let records: Vec<(Vec<u8>, Vec<u8>)> = (idle.iter())
        .map(|c| {
            (
                c.as_bytes().to_vec(),
                tally_common::codec::encode_expiry(c, now),
            )
        })
        .collect();
    let last = shared
        .flusher
        .dead_letters
        .append(partition, &records)
        .await?;
    shared.metrics.expiry_records(idle.len());
    if let Some(last) = last {
        tracing::debug!(partition, records = idle.len(), "expiry records written");
        waiting.insert(partition, last);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_expires_only_if_it_was_touched_and_every_touch_is_past_its_deadline() {
        assert!(!expires(None, None, 100), "nothing to clear");
        assert!(expires(Some(100), None, 100));
        assert!(expires(None, Some(90), 100));
        assert!(expires(Some(50), Some(90), 100));
        assert!(!expires(Some(101), None, 100));
        assert!(!expires(Some(50), Some(101), 100));
        assert!(!expires(Some(150), Some(90), 100));
    }
}
