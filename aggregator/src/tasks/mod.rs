//! The side tasks: work beside the consume loop, each with its own schedule.
//!
//! - [`trending`]: heavy-hitter sketches of the fastest-moving counters, and the cache warmer.
//! - [`expiry`]: counters that expire: the idle index, expiry records and their decision.
//! - [`shard_monitor`]: raises the shard counts of directly written counters that run hot.
//! - [`cells`]: the window cells' sweep of expired buckets, and the migration from bucket keys.
//! - [`compact`]: collapsing cold counters' shares into one key, crash-safe (`tally compact`).
//! - [`likes_move`]: moving a deployment's likes from the shares to count sets
//!   (`tally likes-to-sets`).
//! - [`pack`]: packing a live deployment's counters' shares into small hashes (`tally pack`).
//! - [`regroup`]: growing and shrinking a live deployment's shard groups (`tally regroup`).

pub mod cells;
pub mod compact;
pub mod expiry;
pub mod likes_move;
pub mod pack;
pub mod regroup;
pub mod shard_monitor;
pub mod trending;

/// Walks over a deployment's keys before a migration gives up on keys that keep appearing.
pub const MAX_WALKS: u32 = 8;

/// Runs `walk` (one walk over a deployment's keys, acting on what it finds; it returns how many
/// it found to act on) until a walk finds nothing: once where `again` is false (a standalone
/// server, whose `SCAN` returns every key there all along), and on a cluster again, since a
/// slot migrating during a walk can hide its keys from it. Whether the keys settled: false
/// after [`MAX_WALKS`] walks that all found some (a writer of what is being migrated is still
/// running).
pub async fn walk_until_settled<E>(
    again: bool,
    mut walk: impl AsyncFnMut() -> Result<usize, E>,
) -> Result<bool, E> {
    for _ in 0..MAX_WALKS {
        if walk().await? == 0 || !again {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many walks `walk_until_settled` takes over walks finding `found` in turn (then
    /// none), and whether it settles.
    async fn walks(again: bool, found: &[usize]) -> (usize, bool) {
        let mut taken = 0;
        let settled = walk_until_settled(again, async || {
            taken += 1;
            Ok::<_, ()>(found.get(taken - 1).copied().unwrap_or(0))
        });
        let settled = settled.await.expect("no walk fails");
        (taken, settled)
    }

    #[tokio::test]
    async fn walks_again_until_a_walk_finds_nothing_at_most_max_walks() {
        assert_eq!(walks(true, &[]).await, (1, true));
        assert_eq!(
            walks(true, &[5, 2]).await,
            (3, true),
            "the third finds nothing"
        );
        assert_eq!(
            walks(false, &[5, 2]).await,
            (1, true),
            "a standalone server: one"
        );
        let busy = [1; MAX_WALKS as usize + 4];
        assert_eq!(walks(true, &busy).await, (MAX_WALKS as usize, false));
        let failing = walk_until_settled(true, async || Err::<usize, _>(7)).await;
        assert_eq!(failing, Err(7));
    }
}
