//! What deduplication costs: the exactly-once catch-up over the preloaded topic (every event a
//! like by one of `tally load`'s 10,000 actors) without and with `dedup = true` on its
//! namespace, in alternated rounds, with the Redis memory each adds per counter (the likes'
//! member sets) and per event.

use crate::env::{Env, delete_matching};
use crate::results::{CatchUp, DedupRun};
use crate::scenarios::windows::catch_up_with_memory;

/// The two variants: whether the namespace deduplicates, and its entries.
const VARIANTS: [(bool, &str); 2] = [(false, ""), (true, "dedup = true\n")];

/// The two catch-ups of `events` events on `topic` (`distinct` counters, all `likes:post:*`),
/// `rounds` times, each round in the order opposite to the last, each run's keys deleted once
/// its memory is measured. The runs of the round with the median ratio (dedup on over off, in
/// events/s from launch), each with every round's ratio.
pub(crate) async fn dedup(
    env: &mut Env<'_>,
    (topic, events, distinct): (&str, u64, u64),
    rounds: u32,
) -> anyhow::Result<Vec<DedupRun>> {
    let mut runs: Vec<[(CatchUp, f64); 2]> = Vec::new();
    for round in 1..=rounds {
        let mut order = [0, 1];
        if round % 2 == 0 {
            order.reverse();
        }
        let mut got: [Option<(CatchUp, f64)>; 2] = [None, None];
        for v in order {
            let (on, entries) = VARIANTS[v];
            let label = if on { "on" } else { "off" };
            println!("dedup: round {round} of {rounds}, dedup {label}, over {events} events");
            let namespaces = format!("[namespaces.likes]\n{entries}");
            let run = catch_up_with_memory(env, topic, events, distinct, &namespaces).await?;
            println!(
                "  redis-server {:.2} CPU-us per event",
                run.0.redis_cpu_seconds_per_million
            );
            delete_matching(&mut env.redis, &format!("{}*", run.0.key_prefix)).await;
            got[v] = Some(run);
        }
        let [Some(off), Some(on)] = got else {
            unreachable!("both variants ran");
        };
        runs.push([off, on]);
    }
    let rate = |run: &(CatchUp, f64)| run.0.events_per_second_from_launch;
    let ratios: Vec<f64> = runs.iter().map(|[off, on]| rate(on) / rate(off)).collect();
    let median = super::rounds::median_round(&ratios, "dedup on over off");
    Ok((runs.swap_remove(median).into_iter().zip(VARIANTS))
        .map(|((catch_up, memory), (dedup, _))| DedupRun {
            dedup,
            memory_bytes_per_counter: memory,
            memory_bytes_per_event: memory * distinct as f64 / events.max(1) as f64,
            catch_up,
            ratios: if dedup { ratios.clone() } else { Vec::new() },
        })
        .collect())
}
