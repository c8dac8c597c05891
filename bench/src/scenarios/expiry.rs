//! What counters that expire cost: the exactly-once catch-up over the preloaded topic with its
//! namespace never expiring and with `expire_after = "30d"` (no counter expires during the run:
//! the cost measured is the idle index each flush keeps, one `ZADD GT` per counter written),
//! with the Redis commands per event and the memory each counter adds.

use crate::env::Env;
use crate::results::ExpiryRun;
use crate::scenarios::windows::catch_up_with_memory;

/// The two catch-ups of `events` events on `topic` (`distinct` counters, all `likes:post:*`).
pub(crate) async fn expiry(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
    distinct: u64,
) -> anyhow::Result<Vec<ExpiryRun>> {
    let mut runs = Vec::new();
    for (expire_after, entry) in [("none", ""), ("30d", "expire_after = \"30d\"\n")] {
        println!("expiry: the aggregator, expire_after {expire_after}, over {events} events");
        let namespaces = format!("[namespaces.likes]\n{entry}");
        let (run, memory) = catch_up_with_memory(env, topic, events, distinct, &namespaces).await?;
        runs.push(ExpiryRun {
            expire_after: expire_after.to_owned(),
            memory_bytes_per_counter: memory,
            catch_up: run,
        });
    }
    Ok(runs)
}
