//! The cardinality scenario (the long tail: every event a distinct counter, so every event is a
//! counter write that creates its key) against Redis's own floor for the same writes, measured
//! in the same rounds.
//!
//! The floor is what redis-server spends on a write that creates its key with no tally in the
//! way: a bare Lua loop of `INCRBY` over new keys, as many per script as the flush's scripts carried
//! (the least an atomic, fenced write can cost: tally's flush is such a script), and pipelined
//! `INCRBY`s without a script (what a write costs Redis when nothing is atomic). Its keys are
//! shaped like tally's (a prefix, a group tag, `c:`, a counter id), so that the two differ only
//! in what tally's script does around each write.
//!
//! Each round also catches the topic up with the counters' shares packed into hashes (`tally
//! pack` on the empty deployment before launch), for its Redis CPU per write and its memory per
//! counter at rest against the keys'.

use anyhow::Context;

use crate::env::{Env, delete_matching};
use crate::probe;
use crate::results::{CatchUp, RedisFloor};
use crate::scenarios::rounds::median_round;
use crate::scenarios::windows::used_memory;

/// Requests of the floor in flight at once, about as many as the aggregator's flushes.
const IN_FLIGHT: usize = 4;

/// The bare loop: one `INCRBY` per key, nothing else.
const LOOP: &str = "for i = 1, #KEYS do redis.call('INCRBY', KEYS[i], ARGV[i]) end return #KEYS";

/// The long tail's figures: the median round's catch-up and floor, and every round's ratio.
pub(crate) struct Cardinality {
    pub(crate) run: CatchUp,
    /// Redis memory the catch-up added per counter.
    pub(crate) bytes_per_counter: f64,
    pub(crate) floor: RedisFloor,
    /// redis-server's CPU per counter write in tally's catch-up over the script floor's, per
    /// round.
    pub(crate) ratios: Vec<f64>,
    /// The packed catch-up of the same round.
    pub(crate) packed: CatchUp,
    /// Redis memory the packed catch-up added per counter.
    pub(crate) packed_bytes_per_counter: f64,
}

/// `rounds` alternated rounds, each a catch-up of `topic` (`distinct` events, one per
/// counter), the floor's `distinct` writes, and the catch-up packed into `buckets` hashes per
/// group.
pub(crate) async fn cardinality(
    env: &mut Env<'_>,
    topic: &str,
    distinct: u64,
    rounds: u32,
    buckets: u32,
) -> anyhow::Result<Cardinality> {
    let mut runs = Vec::new();
    for round in 1..=rounds {
        println!("cardinality, round {round} of {rounds}: the aggregator over {distinct} events");
        let before = used_memory(&mut env.redis).await?;
        let mut run = env.catch_up(topic, distinct, &[]).await?;
        run.distinct_counters = distinct;
        let bytes = (used_memory(&mut env.redis).await? - before) / distinct as f64;
        delete_matching(&mut env.redis, &format!("{}*", run.key_prefix)).await;
        // As many writes per script as the catch-up's flush scripts carried.
        let per_request = run.counter_writes_per_event / run.redis_requests_per_event.max(1e-9);
        let floor = floor(env, distinct, (per_request.round() as u64).max(1)).await?;
        let ratio = run.redis_cpu_us_per_write() / floor.script_cpu_us_per_write;
        println!(
            "  {:.0} events/s from launch; redis-server {:.2} CPU-us per counter write, the floor \
             {:.2} (a script) / {:.2} (pipelined): {ratio:.2} x the script floor",
            run.events_per_second_from_launch,
            run.redis_cpu_us_per_write(),
            floor.script_cpu_us_per_write,
            floor.pipelined_cpu_us_per_write,
        );
        let (packed, packed_bytes) = packed_catch_up(env, topic, distinct, buckets).await?;
        println!(
            "  packed into {buckets} hashes per group: {:.0} events/s from launch; redis-server \
             {:.2} CPU-us per counter write; {packed_bytes:.1} B per counter against {bytes:.1}",
            packed.events_per_second_from_launch,
            packed.redis_cpu_us_per_write(),
        );
        runs.push((run, bytes, floor, ratio, packed, packed_bytes));
    }
    let ratios: Vec<f64> = runs.iter().map(|r| r.3).collect();
    let median = median_round(&ratios, "cardinality, redis-server CPU per write / floor");
    let (run, bytes_per_counter, floor, _, packed, packed_bytes_per_counter) =
        runs.swap_remove(median);
    Ok(Cardinality {
        run,
        bytes_per_counter,
        floor,
        ratios,
        packed,
        packed_bytes_per_counter,
    })
}

/// A catch-up of `topic` into a deployment packed into `buckets` hashes per group from launch
/// (`tally pack` on its empty keyspace first), and the Redis memory it added per counter.
async fn packed_catch_up(
    env: &mut Env<'_>,
    topic: &str,
    distinct: u64,
    buckets: u32,
) -> anyhow::Result<(CatchUp, f64)> {
    let id = env.catch_up_id();
    let packed = std::process::Command::new(env.bin("tally"))
        .args([
            "pack",
            "--buckets",
            &buckets.to_string(),
            "--key-prefix",
            &id,
        ])
        .args(["--redis-url", &env.args.redis_url])
        .output()
        .context("tally pack (build the release binaries: deploy/local/bench.sh)")?;
    anyhow::ensure!(
        packed.status.success(),
        "tally pack failed: {}",
        String::from_utf8_lossy(&packed.stderr)
    );
    let before = used_memory(&mut env.redis).await?;
    let mut run = env.catch_up_as(&id, topic, distinct, &[]).await?;
    run.distinct_counters = distinct;
    let bytes = (used_memory(&mut env.redis).await? - before) / distinct as f64;
    delete_matching(&mut env.redis, &format!("{id}*")).await;
    Ok((run, bytes))
}

/// The floor: `writes` new keys written by the bare script, `per_request` per call, then as many
/// by pipelined `INCRBY`s; each timed by redis-server's CPU and its keys deleted after. The keys'
/// names are as long as the catch-up's.
async fn floor(env: &mut Env<'_>, writes: u64, per_request: u64) -> anyhow::Result<RedisFloor> {
    let script = redis::Script::new(LOOP);
    // Loaded before the clock starts, so that no NOSCRIPT round trip is timed.
    let _: String = script
        .prepare_invoke()
        .load_async(&mut env.redis)
        .await
        .context("SCRIPT LOAD of the floor's loop")?;
    // `agg-` is the catch-up's (`Env::catch_up_id`).
    let prefix = || env.name(&format!("flr-{}", rand::random::<u32>()));
    let (scripted, pipelined) = (prefix(), prefix());
    let memory = used_memory(&mut env.redis).await?;
    let cpu = probe::cpu_seconds_matching("redis-server");
    write_new_keys(env, &scripted, writes, per_request, Some(&script)).await?;
    let script_cpu = probe::cpu_seconds_matching("redis-server") - cpu;
    let bytes_per_key = (used_memory(&mut env.redis).await? - memory) / writes as f64;
    delete_matching(&mut env.redis, &format!("{scripted}*")).await;
    let cpu = probe::cpu_seconds_matching("redis-server");
    write_new_keys(env, &pipelined, writes, per_request, None).await?;
    let pipelined_cpu = probe::cpu_seconds_matching("redis-server") - cpu;
    delete_matching(&mut env.redis, &format!("{pipelined}*")).await;
    Ok(RedisFloor {
        writes_per_script: per_request as f64,
        script_cpu_us_per_write: script_cpu * 1e6 / writes as f64,
        pipelined_cpu_us_per_write: pipelined_cpu * 1e6 / writes as f64,
        bytes_per_key,
    })
}

/// Adds 1 to `writes` keys that do not exist yet, `per_request` per script call (or per
/// pipeline), `IN_FLIGHT` requests at a time; each request's keys share a group tag, as a
/// flush's do.
async fn write_new_keys(
    env: &Env<'_>,
    prefix: &str,
    writes: u64,
    per_request: u64,
    script: Option<&redis::Script>,
) -> anyhow::Result<()> {
    let (mut written, mut request) = (0, 0);
    while written < writes {
        let mut batch = tokio::task::JoinSet::new();
        while batch.len() < IN_FLIGHT && written < writes {
            let n = per_request.min(writes - written);
            let keys: Vec<String> = (written..written + n)
                .map(|i| format!("{prefix}:{{g{}}}:c:likes:post:{i}", request % 64))
                .collect();
            let mut conn = env.redis.clone();
            let script = script.cloned();
            batch.spawn(async move {
                match script {
                    Some(script) => {
                        let mut invocation = script.prepare_invoke();
                        for key in &keys {
                            invocation.key(key).arg(1);
                        }
                        invocation.invoke_async::<u64>(&mut conn).await.map(drop)
                    }
                    None => {
                        let mut pipe = redis::pipe();
                        for key in &keys {
                            pipe.cmd("INCRBY").arg(key).arg(1).ignore();
                        }
                        pipe.query_async::<()>(&mut conn).await
                    }
                }
            });
            written += n;
            request += 1;
        }
        while let Some(result) = batch.join_next().await {
            result?.context("the floor's writes")?;
        }
    }
    Ok(())
}
