//! Compaction under live writes, with the compactor SIGKILLed at random points: counters written
//! both through Kafka (the aggregator, exactly-once) and directly (random shards, their shard
//! counts raised to 8), a `tally compact --loop` process killed at least 20 times while they
//! run, then one last compactor. Every total ends exact, and every counter is back to at most
//! one key, its base share.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tally_aggregator::compact::Compactor;
use tally_aggregator::load::LoadSpec;
use tally_common::keyspace::CompactionKey;
use tally_common::{Keyspace, Namespaces, RedisConn};
use tally_producer::DirectWriter;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, binary, connect, finish_load, seed, start_load,
    wait_for_totals,
};

const COUNTERS: u64 = 40;
const STREAMED: u64 = 100_000;
const KILLS: usize = 20;

/// A `tally compact --loop` that treats every counter as cold, so that it keeps moving shares
/// while they are written, and is killed in the middle of moves; its reports go to `log`.
fn compactor(redis_url: &str, ks: &Keyspace, log: &std::path::Path) -> std::process::Child {
    Command::new(binary("tally"))
        .args([
            "compact",
            "--loop",
            "--cold-after-ms",
            "0",
            "--interval-ms",
            "20",
        ])
        .args(["--redis-url", redis_url, "--key-prefix", ks.prefix()])
        .stdout(std::fs::File::create(log).expect("log file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("tally compact starts")
}

/// Direct writes of +1..+3 to random counters until `stop` is set, returning what was written.
/// Each write completes before the flag is looked at again, so none is left half-known.
async fn direct_writes(
    writer: DirectWriter,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> HashMap<String, i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut written: HashMap<String, i64> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        let counter = format!("views:video:{}", rng.random_range(0..COUNTERS));
        let delta = rng.random_range(1..=3);
        writer.add(&counter, delta).await.expect("direct write");
        *written.entry(counter).or_default() += delta;
    }
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_under_live_writes_survives_twenty_sigkills() {
    let _serial = tally_tests::serial().await;
    let seed = seed();
    let dir = TempDir::new("tally-compact");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("compact", &redis.url(), 8).await;
    let ks = setup.keyspace();
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let mut conn = connect(&redis.url()).await;
    for c in 0..COUNTERS {
        redis::cmd("ZADD")
            .arg(ks.shards_key())
            .arg(8)
            .arg(format!("views:video:{c}"))
            .exec_async(&mut conn)
            .await
            .expect("ZADD");
    }
    let namespaces = Arc::new(Namespaces::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4 {
        let conn = RedisConn::connect(&redis.url()).await.expect("redis");
        let writer = DirectWriter::new(conn, ks.clone(), namespaces.clone());
        writers.push(tokio::spawn(direct_writes(writer, seed + w, stop.clone())));
    }
    let load = start_load(
        &setup.topic,
        LoadSpec {
            events: STREAMED,
            counters: COUNTERS,
            counter_prefix: "views:video:".to_owned(),
            rate: 10_000,
            max_delta: 3,
            negative_share: 0.2,
            actors: 0,
            seed,
            ..LoadSpec::default()
        },
    );

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for kill in 1..=KILLS {
        let mut child = compactor(
            &redis.url(),
            &ks,
            &dir.path().join(format!("compactor-{kill}.log")),
        );
        let after = Duration::from_millis(rng.random_range(50..600));
        tokio::time::sleep(after).await;
        assert!(
            !load.is_finished(),
            "the writes ended before kill {kill} of {KILLS}"
        );
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        eprintln!("compactor SIGKILL {kill}/{KILLS} after {after:?}");
    }
    let streamed = finish_load(load, STREAMED).await;
    stop.store(true, Ordering::Relaxed);
    let mut expected = streamed.totals;
    for writer in writers {
        for (counter, n) in writer.await.expect("writer task") {
            *expected.entry(counter).or_default() += n;
        }
    }
    let reader = redis.reader(ks.clone()).await;
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    aggregator.stop_gracefully().await;

    // One last compactor, until nothing is left to do.
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let last = Compactor::start(conn, ks.clone(), namespaces, Duration::ZERO)
        .await
        .expect("compactor");
    let (mut compacted, mut passes, mut interrupted) = (0, 0, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let report = last.pass().await.expect("pass");
        if passes == 0 {
            eprintln!("the last compactor's first pass: {report:?}");
            interrupted += (report.recovered + report.markers_dropped) as u64;
        }
        compacted += report.compacted;
        passes += 1;
        if report.candidates == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "compaction did not finish: {report:?}"
        );
    }
    eprintln!("the last compactor compacted {compacted} counters in {passes} passes");
    let (mut moves, mut recovered) = (0, interrupted);
    for kill in 1..=KILLS {
        let log = std::fs::read_to_string(dir.path().join(format!("compactor-{kill}.log")))
            .unwrap_or_default();
        for line in log.lines() {
            let number = |after: &str| -> u64 {
                line.split(after)
                    .next()
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0)
            };
            moves += number(" moves");
            recovered += number(" interrupted") + number(" markers");
        }
    }
    eprintln!(
        "the killed compactors made at least {moves} moves under live writes and finished {recovered} moves (or their last step) that a predecessor was killed in"
    );
    assert!(moves > 0, "the killed compactors never moved anything");
    assert!(recovered > 0, "no kill ever interrupted a move");
    wait_for_totals(&reader, &expected, Duration::from_secs(5)).await;

    let mut keys: HashMap<String, Vec<(u32, CompactionKey)>> = HashMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(ks.compaction_pattern())
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connect(&redis.url()).await)
            .await
            .expect("SCAN");
        for key in batch {
            if let Some((group, kind, counter)) = ks.parse_compaction_key(&key) {
                keys.entry(counter.to_owned())
                    .or_default()
                    .push((group, kind));
            }
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    for counter in expected.keys() {
        let held = keys.get(counter).cloned().unwrap_or_default();
        let base = ks.shard_group(counter, 0);
        assert!(
            held.is_empty() || held == [(base, CompactionKey::Share)],
            "{counter} still has {held:?} (base group {base})"
        );
    }
    eprintln!(
        "{} counters, each at one key; {KILLS} compactor kills survived",
        expected.len()
    );
}
