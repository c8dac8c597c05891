//! Where logs start and end: the `ListOffsets` a fetch needs before it can be sent (a
//! partition sought to its log's start or end) or after its answer (an offset out of range,
//! moved as `auto.offset.reset` says).

use super::{EARLIEST, Fetched, LATEST, Shared};
use crate::config::OffsetReset;
use crate::connection::Connection;
use crate::protocol::LogEnd;

/// Turns the [`EARLIEST`] and [`LATEST`] offsets of `request` into where those logs start or
/// end now, asking the leader.
pub(super) async fn resolve_ends(
    shared: &Shared,
    connection: &mut Connection,
    request: &mut [(i32, i64, u64)],
) -> Result<(), crate::connection::ConnectionError> {
    for (sentinel, end) in [(EARLIEST, LogEnd::Earliest), (LATEST, LogEnd::Latest)] {
        let unresolved: Vec<i32> = (request.iter())
            .filter(|(_, offset, _)| *offset == sentinel)
            .map(|(p, _, _)| *p)
            .collect();
        if unresolved.is_empty() {
            continue;
        }
        let found = connection
            .list_offsets(&shared.config.topic, &unresolved, end)
            .await?;
        let mut state = shared.lock();
        for (partition, offset, epoch) in request.iter_mut() {
            let Some(&(_, error, at)) = found.iter().find(|(p, _, _)| p == partition) else {
                continue;
            };
            if *offset != sentinel || error.is_error() {
                continue;
            }
            *offset = at;
            if let Some(w) = state.wanted.get_mut(partition)
                && w.epoch == *epoch
            {
                w.offset = at;
            }
        }
    }
    Ok(())
}

/// Moves partitions whose offsets were out of range as `auto.offset.reset` says, and reports
/// each; returns whether leadership looked stale.
pub(super) async fn reset_out_of_range(
    shared: &Shared,
    node: i32,
    out_of_range: Vec<(i32, i64, u64)>,
    connection: Option<&mut Connection>,
) -> bool {
    let report = |partition, epoch, from, to| {
        let _ = shared.out.send(Fetched::OutOfRange {
            partition,
            epoch,
            from,
            to,
        });
    };
    let end = match shared.config.offset_reset {
        OffsetReset::Earliest => LogEnd::Earliest,
        OffsetReset::Latest => LogEnd::Latest,
        OffsetReset::Error => {
            let mut state = shared.lock();
            for (partition, from, epoch) in out_of_range {
                if let Some(w) = state.wanted.get_mut(&partition)
                    && w.epoch == epoch
                {
                    // Stays where it is, unfetched, until the owner seeks it.
                    w.paused = true;
                    report(partition, epoch, from, None);
                }
            }
            return false;
        }
    };
    let Some(c) = connection else {
        return true;
    };
    let ids: Vec<i32> = out_of_range.iter().map(|(p, _, _)| *p).collect();
    let found = match c.list_offsets(&shared.config.topic, &ids, end).await {
        Ok(found) => found,
        Err(error) => {
            tracing::warn!(node, %error, "fetcher: could not find where the logs start or end");
            return true;
        }
    };
    let mut stale = false;
    let mut state = shared.lock();
    for (partition, from, epoch) in out_of_range {
        let Some(&(_, error, to)) = found.iter().find(|(p, _, _)| *p == partition) else {
            continue;
        };
        if error.is_error() {
            stale = true;
            continue;
        }
        if let Some(w) = state.wanted.get_mut(&partition)
            && w.epoch == epoch
            && w.offset == from
        {
            w.offset = to;
            report(partition, epoch, from, Some(to));
        }
    }
    stale
}
