//! What deduplication costs: the exactly-once catch-up over the preloaded topic (every event a
//! like by one of `tally load`'s 10,000 actors) without and with `dedup = true` on its
//! namespace, with the Redis memory each adds per counter (the likes' member sets) and per
//! event.

use crate::env::Env;
use crate::results::DedupRun;
use crate::scenarios::windows::likes_variants;

/// The two catch-ups of `events` events on `topic` (`distinct` counters, all `likes:post:*`).
pub(crate) async fn dedup(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
    distinct: u64,
) -> anyhow::Result<Vec<DedupRun>> {
    let variants = [("dedup off", ""), ("dedup on", "dedup = true\n")];
    let runs = likes_variants(env, "dedup", (topic, events, distinct), &variants).await?;
    Ok((runs.into_iter().zip([false, true]))
        .map(|((_, catch_up, memory), dedup)| DedupRun {
            dedup,
            memory_bytes_per_counter: memory,
            memory_bytes_per_event: memory * distinct as f64 / events.max(1) as f64,
            catch_up,
        })
        .collect())
}
