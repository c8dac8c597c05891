//! Re-grouping under load: the exactly-once catch-up of the preloaded topic as it is, and
//! re-grouped from 16 to 64 shard groups (`tally regroup --to 64`) as soon as its first flush
//! landed, in alternated rounds; throughout each run a reader sums 100 of its busiest counters
//! exactly (`get_many`, one read after another), timed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tally_common::{Keyspace, Reader, RedisConn};

use crate::env::{Env, delete_matching};
use crate::probe;
use crate::results::{CatchUp, RegroupRun};

/// What one run measured besides its catch-up: the re-grouping's seconds and the read latencies
/// in milliseconds.
struct During {
    regroup_seconds: f64,
    reads_ms: Vec<f64>,
}

/// Both variants of the catch-up of `events` events on `topic`, `rounds` times, each round in
/// the order opposite to the last, each run's keys deleted after it. The runs of the round with
/// the median ratio (re-grouped over plain, in events/s from launch), with every round's ratio.
pub(crate) async fn regroup(
    env: &mut Env<'_>,
    (topic, events): (&str, u64),
    rounds: u32,
) -> anyhow::Result<Vec<RegroupRun>> {
    let mut runs: Vec<[(CatchUp, During); 2]> = Vec::new();
    for round in 1..=rounds {
        let mut order = [false, true];
        if round % 2 == 0 {
            order.reverse();
        }
        let mut got: [Option<(CatchUp, During)>; 2] = [None, None];
        for regrouped in order {
            let label = if regrouped {
                "re-grouped 16 -> 64"
            } else {
                "plain"
            };
            println!("regroup: round {round} of {rounds}, {label}, over {events} events");
            let run = one_run(env, topic, events, regrouped).await?;
            println!(
                "  {:.0} events/s from launch; {} reads, p99 {:.1} ms{}",
                run.0.events_per_second_from_launch,
                run.1.reads_ms.len(),
                probe::quantile(&mut run.1.reads_ms.clone(), 0.99),
                if regrouped {
                    format!("; moved in {:.1} s", run.1.regroup_seconds)
                } else {
                    String::new()
                }
            );
            delete_matching(&mut env.redis, &format!("{}*", run.0.key_prefix)).await;
            got[usize::from(regrouped)] = Some(run);
        }
        let [Some(plain), Some(regrouped)] = got else {
            unreachable!("both variants ran");
        };
        runs.push([plain, regrouped]);
    }
    let rate = |run: &(CatchUp, During)| run.0.events_per_second_from_launch;
    let ratios: Vec<f64> = (runs.iter())
        .map(|[plain, regrouped]| rate(regrouped) / rate(plain))
        .collect();
    let median = super::rounds::median_round(&ratios, "re-grouped over plain");
    Ok((runs.swap_remove(median).into_iter().zip([false, true]))
        .map(|((catch_up, mut during), regrouped)| RegroupRun {
            regrouped,
            catch_up,
            regroup_seconds: during.regroup_seconds,
            reads: during.reads_ms.len(),
            read_p50_ms: probe::quantile(&mut during.reads_ms, 0.5),
            read_p99_ms: probe::quantile(&mut during.reads_ms, 0.99),
            read_max_ms: during.reads_ms.last().copied().unwrap_or(0.0),
            ratios: if regrouped {
                ratios.clone()
            } else {
                Vec::new()
            },
        })
        .collect())
}

/// One catch-up, re-grouped or not, with the reader running beside it.
async fn one_run(
    env: &mut Env<'_>,
    topic: &str,
    events: u64,
    regrouped: bool,
) -> anyhow::Result<(CatchUp, During)> {
    let id = env.catch_up_id();
    let keyspace = Keyspace::new(id.clone(), 16)?;
    let conn = RedisConn::connect(&env.args.redis_url).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn(read_until(
        Reader::new(conn.clone(), keyspace.clone()),
        stop.clone(),
    ));
    let regrouping = regrouped.then(|| {
        let tally = env.bin("tally");
        let url = env.args.redis_url.clone();
        tokio::spawn(regroup_once_flushed(tally, url, conn, keyspace))
    });
    let catch_up = env.catch_up_as(&id, topic, events, &[]).await;
    stop.store(true, Ordering::Relaxed);
    let reads_ms = reader.await.context("the reader task")??;
    let regroup_seconds = match regrouping {
        Some(task) => task.await.context("the regroup task")??,
        None => 0.0,
    };
    Ok((
        catch_up?,
        During {
            regroup_seconds,
            reads_ms,
        },
    ))
}

/// Exact reads of 100 counters, one after another, until `stop`: their latencies, ms.
async fn read_until(reader: Reader, stop: Arc<AtomicBool>) -> anyhow::Result<Vec<f64>> {
    // The preload's counters are `likes:post:<n>`, Zipf-skewed: the first hundred are the busiest.
    let counters: Vec<String> = (0..100).map(|i| format!("likes:post:{i}")).collect();
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        reader.get_many(&counters).await?;
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(samples)
}

/// Waits for the aggregator's first flush (a ledger in some group), then runs `tally regroup
/// --to 64`; returns its wall time, seconds.
async fn regroup_once_flushed(
    tally: std::path::PathBuf,
    url: String,
    conn: RedisConn,
    keyspace: Keyspace,
) -> anyhow::Result<f64> {
    let waiting = Instant::now();
    loop {
        let mut exists = redis::cmd("EXISTS");
        for group in 0..keyspace.groups() {
            exists.arg(keyspace.ledger_key(group));
        }
        let found: u64 = exists.query_async(&mut conn.clone()).await?;
        if found > 0 {
            break;
        }
        if waiting.elapsed() > Duration::from_secs(120) {
            bail!("the aggregator flushed nothing within 2 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let out = tokio::process::Command::new(tally)
        .args(["regroup", "--to", "64", "--wait", "120"])
        .args(["--redis-url", &url, "--key-prefix", keyspace.prefix()])
        .output()
        .await
        .context("tally regroup (build the release binaries: deploy/local/bench.sh)")?;
    if !out.status.success() {
        bail!(
            "tally regroup failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(started.elapsed().as_secs_f64())
}
