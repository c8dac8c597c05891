//! What windowed counts cost: the exactly-once catch-up over the same preloaded topic with its
//! namespace keeping 0, 1 (`1h`) and 3 (`1m`, `1h`, `1d`) windows, in alternated rounds, with
//! the Redis commands per event and the memory each counter adds (`INFO memory`'s
//! `used_memory` before and after each run, over the distinct counters). The preloaded events
//! were produced moments before, so each counter has one live bucket per window, all in one
//! cells field per counter.

use std::time::Instant;

use anyhow::Context;
use tally_common::window::Window;
use tally_common::{Keyspace, Reader, RedisConn};

use crate::env::{Env, delete_matching};
use crate::results::{CatchUp, WindowRead, WindowsRun};

/// Redis's `used_memory`, in bytes.
pub(crate) async fn used_memory(
    conn: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("INFO memory has no used_memory")
}

/// The exactly-once catch-up of `events` events on `topic` (`distinct` counters) under the
/// namespace file `namespaces`, with the Redis memory it added per distinct counter.
pub(crate) async fn catch_up_with_memory(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
    distinct: u64,
    namespaces: &str,
) -> anyhow::Result<(CatchUp, f64)> {
    let before = used_memory(&mut env.redis).await?;
    let mut run = (env.catch_up_with_namespaces(topic, events, namespaces)).await?;
    let after = used_memory(&mut env.redis).await?;
    run.distinct_counters = distinct;
    println!(
        "  {:.0} events/s from launch, {:.3} Redis commands/event",
        run.events_per_second_from_launch, run.redis_commands_per_event
    );
    Ok((run, (after - before) / distinct.max(1) as f64))
}

/// The exactly-once catch-up of `events` events on `topic` (`distinct` counters, all
/// `likes:post:*`) once per variant of the `likes` namespace, `(label, its entries)`: each run
/// with the Redis memory it added per distinct counter.
pub(crate) async fn likes_variants<'v>(
    env: &mut Env<'_>,
    scenario: &str,
    (topic, events, distinct): (&str, u64, u64),
    variants: &[(&'v str, &str)],
) -> anyhow::Result<Vec<(&'v str, CatchUp, f64)>> {
    let mut runs = Vec::new();
    for &(label, entries) in variants {
        println!("{scenario}: the aggregator, {label}, over {events} events");
        let namespaces = format!("[namespaces.likes]\n{entries}");
        let (run, memory) = catch_up_with_memory(env, topic, events, distinct, &namespaces).await?;
        runs.push((label, run, memory));
    }
    Ok(runs)
}

/// The windows kept by each variant of the windows scenario, and the `likes` namespace's entries.
const VARIANTS: [(usize, &str); 3] = [
    (0, ""),
    (1, "windows = [\"1h\"]\n"),
    (3, "windows = [\"1m\", \"1h\", \"1d\"]\n"),
];

/// The catch-up of `events` events on `topic` (`distinct` counters, all `likes:post:*`) with
/// 0, 1 and 3 windows, `rounds` times, each round in the order opposite to the last (the
/// machine drifts: then it favours no variant). Each run's keys are deleted once its memory is
/// measured, so that every run starts from the same keyspace, except the last 3-window run's,
/// whose key prefix is returned (the window reads read them). Per variant: the run of the round with the median 3-window ratio, and every
/// round's ratio to that round's 0-window run.
pub(crate) async fn windows(
    env: &mut Env<'_>,
    (topic, events, distinct): (&str, u64, u64),
    rounds: u32,
) -> anyhow::Result<(Vec<WindowsRun>, String)> {
    // Per round, per variant: the catch-up and the memory it added per counter.
    let mut runs: Vec<Vec<(CatchUp, f64)>> = Vec::new();
    let mut kept = String::new();
    for round in 1..=rounds {
        let mut order: Vec<usize> = (0..VARIANTS.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut got: Vec<Option<(CatchUp, f64)>> = vec![None; VARIANTS.len()];
        for v in order {
            let (windows, entries) = VARIANTS[v];
            println!(
                "windows: round {round} of {rounds}, {windows} window(s), over {events} events"
            );
            let namespaces = format!("[namespaces.likes]\n{entries}");
            let run = catch_up_with_memory(env, topic, events, distinct, &namespaces).await?;
            let prefix = &run.0.key_prefix;
            if windows == 3 && round == rounds {
                kept.clone_from(prefix);
            } else {
                delete_matching(&mut env.redis, &format!("{prefix}*")).await;
            }
            got[v] = Some(run);
        }
        runs.push(got.into_iter().flatten().collect());
    }
    let ratios: Vec<Vec<f64>> = (runs.iter())
        .map(|round| {
            let rate = |v: usize| round[v].0.events_per_second_from_launch;
            (0..VARIANTS.len()).map(|v| rate(v) / rate(0)).collect()
        })
        .collect();
    let three = VARIANTS.len() - 1;
    let mut by_ratio: Vec<usize> = (0..runs.len()).collect();
    by_ratio.sort_by(|&a, &b| ratios[a][three].total_cmp(&ratios[b][three]));
    let median = by_ratio[by_ratio.len() / 2];
    println!(
        "  3 windows over 0, per round: {} (the median round's runs are reported)",
        (ratios.iter())
            .map(|r| format!("{:.2}", r[three]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let reported = (runs.swap_remove(median).into_iter().enumerate())
        .map(|(v, (catch_up, memory))| WindowsRun {
            windows: VARIANTS[v].0,
            memory_bytes_per_counter: memory,
            catch_up,
            ratios: ratios.iter().map(|r| r[v]).collect(),
        })
        .collect();
    Ok((reported, kept))
}

/// Window sums of 1,000 counters (`likes:post:1` to `likes:post:1000`) read back from the keys
/// of the catch-up under `prefix`, each window over its usual span (60 minutes, 24 hours, 7
/// days): each read timed, `READS` times, and checked against the counters' totals.
pub(crate) async fn window_reads(redis_url: &str, prefix: &str) -> anyhow::Result<Vec<WindowRead>> {
    const READS: usize = 20;
    const GROUPS: u32 = 16;
    let conn = RedisConn::connect(redis_url).await?;
    let reader = Reader::new(conn, Keyspace::new(prefix.to_owned(), GROUPS)?);
    let counters: Vec<String> = (1..=1_000).map(|i| format!("likes:post:{i}")).collect();
    let totals = reader.get_many(&counters).await?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    let mut reads = Vec::new();
    for (width, width_ms, buckets) in [
        ("1m", 60_000, 60),
        ("1h", 3_600_000, 24),
        ("1d", 86_400_000, 7),
    ] {
        let window = Window {
            width_ms,
            retention_ms: 0,
        };
        let mut ms = Vec::with_capacity(READS);
        let mut sums = Vec::new();
        for _ in 0..READS {
            let started = Instant::now();
            sums = (reader.window_sums(&counters, window, buckets, now_ms)).await?;
            ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        let read = WindowRead {
            width: width.to_owned(),
            buckets,
            counters: counters.len(),
            keys_per_group: counters.len(),
            groups: GROUPS,
            reads: READS,
            p50_ms: ms[READS / 2],
            p99_ms: ms[(READS * 99).div_ceil(100) - 1],
            matches_totals: sums == totals,
        };
        println!(
            "  {width} x {buckets} over {} counters: p50 {:.1} ms, p99 {:.1} ms, sums {} the totals",
            read.counters,
            read.p50_ms,
            read.p99_ms,
            if read.matches_totals {
                "equal"
            } else {
                "differ from"
            }
        );
        reads.push(read);
    }
    Ok(reads)
}
