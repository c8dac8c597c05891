//! The expirer: for the partitions this aggregator owns, it reads the counters whose idle
//! deadline has passed and appends an expiry record for each to their partition, a page at a
//! time (`crate::tasks::expiry` explains expiry from end to end).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tally_common::event::now_ms;
use tally_common::keyspace::partition_field;
use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::store::sink::Sink;
use crate::tasks::expiry::PAGE;

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
