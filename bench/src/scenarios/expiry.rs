//! What counters that expire cost: the exactly-once catch-up over the preloaded topic with its
//! namespace never expiring and with `expire_after = "30d"` (no counter expires during the run:
//! the cost measured is the idle index each flush keeps, one `ZADD GT` per counter written),
//! with the Redis commands per event and the memory each counter adds.

use crate::env::Env;
use crate::results::ExpiryRun;
use crate::scenarios::windows::likes_variants;

/// The two catch-ups of `events` events on `topic` (`distinct` counters, all `likes:post:*`).
pub(crate) async fn expiry(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
    distinct: u64,
) -> anyhow::Result<Vec<ExpiryRun>> {
    let variants = [("none", ""), ("30d", "expire_after = \"30d\"\n")];
    let runs = likes_variants(env, "expiry", (topic, events, distinct), &variants).await?;
    Ok((runs.into_iter())
        .map(|(expire_after, catch_up, memory)| ExpiryRun {
            expire_after: expire_after.to_owned(),
            memory_bytes_per_counter: memory,
            catch_up,
        })
        .collect())
}
