//! Compaction under live writes, with the compactor crashing at random points: counters written
//! both through Kafka (the aggregator, exactly-once) and directly (random shards, their shard
//! counts raised to 8), a `tally compact --loop` process SIGKILLed 20 times at random moments and
//! aborted 10 more times by a failpoint right after taking shares into journals (mid-move, for
//! certain), then one last compactor. Every total ends exact, and every counter is back to at
//! most one key, its base share.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tally_aggregator::tasks::compact::Compactor;
use tally_cli::load::LoadSpec;
use tally_common::keyspace::CompactionKey;
use tally_common::{Keyspace, Namespaces, RedisConn};
use tally_producer::DirectWriter;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, binary, connect, eventually, finish_load, seed,
    start_load, wait_for_totals,
};

const COUNTERS: u64 = 40;
const STREAMED: u64 = 150_000;
/// Compactor incarnations: every third aborts itself mid-move, the others are SIGKILLed.
const KILLS: usize = 30;

/// A `tally compact --loop` that treats every counter as cold, so that it keeps moving shares
/// while they are written; its reports go to `log`. With `abort_after_takes` it aborts itself
/// right after taking that many shares into journals: in the middle of a move, every time.
fn compactor(
    redis_url: &str,
    ks: &Keyspace,
    log: &std::path::Path,
    abort_after_takes: Option<u32>,
) -> std::process::Child {
    let mut command = Command::new(binary("tally"));
    command
        .args(["compact", "--loop", "--cold-after-ms", "0"])
        .args(["--interval-ms", "20"])
        .args(["--redis-url", redis_url, "--key-prefix", ks.prefix()])
        .stdout(std::fs::File::create(log).expect("log file"))
        .stderr(Stdio::null());
    if let Some(n) = abort_after_takes {
        command.env("TALLY_FAILPOINT_COMPACT_ABORT_AFTER_TAKES", n.to_string());
    }
    command.spawn().expect("tally compact starts")
}

/// Every compaction key of `ks` (shares, journals, markers) by counter.
async fn compaction_keys(
    redis_url: &str,
    ks: &Keyspace,
) -> HashMap<String, Vec<(u32, CompactionKey)>> {
    let mut conn = connect(redis_url).await;
    let mut keys: HashMap<String, Vec<(u32, CompactionKey)>> = HashMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(ks.compaction_pattern())
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
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
            return keys;
        }
        cursor = next;
    }
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
    // Two incarnations in three are SIGKILLed at a random moment (20 in all); every third aborts
    // itself right after taking a random number of shares into journals, so that some crashes
    // certainly fall in the middle of a move, and the journal they leave is checked for.
    let (mut aborted, mut journals_left) = (0, 0);
    for kill in 1..=KILLS {
        let log = dir.path().join(format!("compactor-{kill}.log"));
        if kill % 3 == 0 {
            let takes = rng.random_range(1..40);
            let mut child = compactor(&redis.url(), &ks, &log, Some(takes));
            let status = eventually(Duration::from_secs(10), "the compactor's failpoint", || {
                let status = child.try_wait().expect("try_wait");
                async move { status }
            })
            .await;
            assert_eq!(
                status.signal(),
                Some(6),
                "incarnation {kill} did not abort at its failpoint: {status}"
            );
            aborted += 1;
            let left = compaction_keys(&redis.url(), &ks)
                .await
                .values()
                .flatten()
                .filter(|(_, kind)| *kind == CompactionKey::Journal)
                .count();
            assert!(left > 0, "an abort mid-move left no journal");
            journals_left += left;
            eprintln!(
                "compactor {kill}/{KILLS} aborted after {takes} takes, leaving {left} journal(s)"
            );
        } else {
            let mut child = compactor(&redis.url(), &ks, &log, None);
            let after = Duration::from_millis(rng.random_range(50..600));
            tokio::time::sleep(after).await;
            child.kill().expect("SIGKILL");
            child.wait().expect("reaped");
            eprintln!("compactor {kill}/{KILLS} SIGKILLed after {after:?}");
        }
        assert!(
            !load.is_finished(),
            "the writes ended before crash {kill} of {KILLS}"
        );
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
        "the crashed compactors reported at least {moves} moves under live writes, and {recovered} moves (or last steps) finished after a predecessor crashed in them; {aborted} aborted mid-move, leaving {journals_left} journal(s) in all"
    );
    wait_for_totals(&reader, &expected, Duration::from_secs(5)).await;

    let keys = compaction_keys(&redis.url(), &ks).await;
    for counter in expected.keys() {
        let held = keys.get(counter).cloned().unwrap_or_default();
        let base = ks.shard_group(counter, 0);
        assert!(
            held.is_empty() || held == [(base, CompactionKey::Share)],
            "{counter} still has {held:?} (base group {base})"
        );
    }
    eprintln!(
        "{} counters, each at one key, after 20 compactor SIGKILLs and {aborted} aborts mid-move",
        expected.len()
    );
}

/// Reads during moves: 100 counters, each spread over all 16 groups, are compacted again and
/// again (a transaction spreads each base share back out between passes, its total unchanged)
/// while a reader reads them all, one exact read after another: every read finds every total
/// exact. (A read of the groups one after another, not as one snapshot, can meet a move between
/// the base group and the source group and miss or double the moved amount.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_reads_never_miss_or_double_a_moving_share() {
    const SPREAD: u32 = 16;
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(tally_tests::unique("moves"), SPREAD).expect("keyspace");
    let counters: Vec<String> = (0..100).map(|i| format!("views:video:{i}")).collect();
    let total = |i: usize| (i as i64 + 1) * i64::from(SPREAD);
    let mut conn = connect(&redis.url()).await;
    let spread_out = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut pipe = redis::pipe();
        pipe.atomic();
        for (i, counter) in counters.iter().enumerate() {
            for group in 0..SPREAD {
                pipe.set(ks.counter_key(group, counter), i as i64 + 1)
                    .ignore();
            }
        }
        let mut conn = conn.clone();
        async move { pipe.query_async::<()>(&mut conn).await.expect("spread") }
    };
    spread_out(&mut conn).await;

    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let reader = redis.reader(ks.clone()).await;
        let (counters, stop) = (counters.clone(), stop.clone());
        tokio::spawn(async move {
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let totals = reader.get_many(&counters).await.expect("a read");
                for (i, got) in totals.iter().enumerate() {
                    assert_eq!(*got, total(i), "{} read {got} in read {reads}", counters[i]);
                }
                reads += 1;
            }
            reads
        })
    };
    let conn_for_compactor = RedisConn::connect(&redis.url()).await.expect("connect");
    let compactor = Compactor::start(
        conn_for_compactor,
        ks.clone(),
        Arc::new(Namespaces::default()),
        Duration::ZERO,
    )
    .await
    .expect("a compactor");
    let mut moves = 0;
    for _ in 0..2 {
        moves += compactor.pass().await.expect("a pass").moves;
        spread_out(&mut conn).await;
    }
    stop.store(true, Ordering::Relaxed);
    let reads = reader.await.expect("every read exact");
    eprintln!("{moves} moves under {reads} reads");
    assert!(moves >= 2 * 100 * 15, "{moves} moves");
    assert!(reads > 20, "{reads} reads");
}
