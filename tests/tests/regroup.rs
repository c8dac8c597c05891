//! Re-grouping a live deployment, both ways, under load: two aggregators count a paced load of
//! 240,000 events on four partitions. `tally regroup --to 32` grows the original 16 groups to
//! 32 without a restart, and one aggregator is SIGKILLed right after, so that the other takes
//! its partitions over under the new plan. Then `tally regroup --to 16` shrinks back while the
//! load goes on: writers move first (a first attempt, with the aggregator SIGSTOPped, gives up
//! after its wait without folding; the second finishes), the retired groups' shares are folded
//! into the groups left, readers move last; a third aggregator replaces the second (SIGKILLed) under the final
//! plan. Likes of a deduplicating namespace go through the HTTP API (`tally-server`) before the
//! change and between the shrink's writer and reader steps, unlikes too. Throughout, a reader
//! polls the busiest counters, exact and windowed (the namespace keeps an hourly window): no
//! total it reads ever goes down (every delta is positive), so no read missed a group or counted
//! a folded share twice; the API's cached total is never above the exact one read after it, and
//! `has_liked`, through the library and the API, keeps its answers. In the end every counter is exact, in total
//! and over its window, `tally audit` finds no drift, the second half of the load went to the new
//! groups, and no share is left in the retired ones; their window buckets stay read until they
//! expire, and a run at the same count then stops reading them.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_common::window::Window;
use tally_tests::{
    AggregatorSetup, ApiServer, RedisCluster, RedisServer, TempDir, assert_no_crossslot, binary,
    connect, eventually, finish_load, http_call, json, seed, start_load, unique, wait_for_totals,
};

const PARTITIONS: i32 = 4;
const EVENTS: u64 = 240_000;
const HOUR: Window = Window {
    width_ms: 3_600_000,
    retention_ms: 48 * 3_600_000,
};
/// Hourly buckets summed by the windowed reads: every event of the test falls in the last 3.
const HOURS: i64 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_the_groups_under_load_and_a_sigkill_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let dir = TempDir::new("tally-regroup");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("regroup", &redis.url(), PARTITIONS).await;
    let namespaces = dir.path().join("namespaces.toml");
    let policies = "[namespaces.likes]\nwindows = [\"1h\"]\n\n[namespaces.fans]\ndedup = true\n";
    std::fs::write(&namespaces, policies).expect("namespaces");
    let ns = namespaces.to_str().expect("utf-8 path");
    let spec = LoadSpec {
        events: EVENTS,
        counters: 2_000,
        rate: 10_000,
        max_delta: 5,
        seed: seed(),
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let member = |name: &str| format!("group.instance.id={}", unique(name));
    let (first, second) = (member("first"), member("second"));
    let mut doomed = setup.spawn(dir.path(), &["--namespaces", ns, "--kafka-option", &first]);
    let mut survivor = setup.spawn(dir.path(), &["--namespaces", ns, "--kafka-option", &second]);
    doomed
        .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
        .await;

    // The HTTP API over the same deployment, and likes through it: 4 posts liked by 50 fans
    // each (the first 10 of post 0 twice), counted before the groups change.
    let server = ApiServer::over(&setup, &redis.url(), ns, dir.path()).await;
    for post in 0..FANS_POSTS {
        for fan in 0..50 {
            like(&server, "PUT", post, fan).await;
        }
    }
    for fan in 0..10 {
        like(&server, "PUT", 0, fan).await;
    }
    let mut fans: HashMap<String, i64> = (0..FANS_POSTS)
        .map(|p| (format!("fans:post:{p}"), 50))
        .collect();
    wait_for_totals(
        &redis.reader(setup.keyspace()).await,
        &fans,
        Duration::from_secs(60),
    )
    .await;

    // A reader polls the busiest counters while the groups change under it: exact and windowed
    // totals through the library, and through the HTTP API a cached total (never above the exact
    // one read after it) and a like (still there).
    let api = server.port;
    let watched: Vec<String> = (0..20).map(|i| format!("likes:post:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let reader = redis.reader(setup.keyspace()).await;
        let (watched, stop) = (watched.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = vec![0; watched.len()];
            let mut last_windowed = vec![0; watched.len()];
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let totals = reader.get_many(&watched).await.expect("a read");
                assert_never_down(&watched, &totals, &mut last, "total");
                let now = tally_common::event::now_ms();
                let windowed = (reader.window_sums(&watched, HOUR, HOURS, now).await)
                    .expect("a windowed read");
                assert_never_down(
                    &watched,
                    &windowed,
                    &mut last_windowed,
                    &format!("last {HOURS} hours"),
                );
                let cached = http_json(api, "/v1/counters/likes:post:0").await["total"].as_i64();
                let exact = reader.get("likes:post:0").await.expect("a read");
                assert!(
                    cached.is_some_and(|cached| cached <= exact),
                    "the API's cached total of likes:post:0 is {cached:?}, the exact one after it {exact}"
                );
                let liked = http_json(api, "/v1/counters/fans:post:0/likes/u7").await;
                assert_eq!(liked["liked"], true, "{liked}");
                let liked = reader
                    .has_liked("fans:post:1", "u49")
                    .await
                    .expect("has_liked");
                let stranger = reader
                    .has_liked("fans:post:1", "u50")
                    .await
                    .expect("has_liked");
                assert!(liked && !stranger, "has_liked: {liked} and {stranger}");
                reads += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            reads
        })
    };

    // A good part of the load counted in the original groups first.
    doomed
        .wait_metric(
            "tally_events_flushed_total",
            20_000.0,
            Duration::from_secs(60),
        )
        .await;
    let grown = regroup(&setup, "32");
    assert!(grown.contains("readers sum 32 groups"), "{grown}");
    assert!(
        grown.contains("every partition (4) places new offsets in 32 groups"),
        "{grown}"
    );
    doomed.kill();
    assert!(
        doomed
            .log()
            .contains("re-grouped: taking the partition again"),
        "{}",
        doomed.log()
    );
    // The load's later events go to the new groups too.
    let reader = redis.reader(setup.keyspace()).await;
    assert_eq!(reader.groups().await.expect("the plan"), 32);
    eventually(
        Duration::from_secs(30),
        "shares in groups 16..32",
        || async { (shares_in(&redis.url(), &setup, 16..32).await > 0).then_some(()) },
    )
    .await;

    // Shrinking waits for every writer to move before it folds: with the only aggregator
    // stopped, it gives up after the wait with writers moved in the plan and readers still
    // summing 32, and a second run, once the aggregator runs again, finishes.
    survivor.signal("STOP");
    let (done, stopped) = run_regroup(&setup, "16", "3");
    survivor.signal("CONT");
    assert!(!done, "{stopped}");
    assert!(
        stopped.contains("writers place new offsets in 16 groups (from 32)"),
        "{stopped}"
    );
    assert!(
        stopped.contains("did not move within the wait"),
        "{stopped}"
    );
    assert!(!stopped.contains("folded"), "{stopped}");
    // Likes and unlikes while writers have moved and readers have not: 50 more fans of post 0,
    // 5 of the first unliking it.
    for fan in 50..100 {
        like(&server, "PUT", 0, fan).await;
    }
    for fan in 0..5 {
        like(&server, "DELETE", 0, fan).await;
    }
    fans.insert("fans:post:0".to_owned(), 95);
    let shrunk = regroup(&setup, "16");
    assert!(
        shrunk.contains("every partition (4) places new offsets in 16 groups"),
        "{shrunk}"
    );
    assert!(shrunk.contains("into their base groups"), "{shrunk}");
    assert!(shrunk.contains("readers sum 16 groups"), "{shrunk}");
    // The retired groups' window buckets stay where they are, read until they expire.
    let fresh = redis.reader(setup.keyspace()).await;
    let cell_groups = fresh.cell_groups().await.expect("the plan");
    assert!(
        shrunk.contains(&format!(
            "window buckets in groups 16..{cell_groups} are left to expire"
        )),
        "{shrunk}"
    );
    assert!((17..=32).contains(&cell_groups), "{cell_groups}");
    let third = member("third");
    let mut last = setup.spawn(dir.path(), &["--namespaces", ns, "--kafka-option", &third]);
    last.wait_metric("tally_assigned_partitions", 1.0, Duration::from_secs(60))
        .await;
    survivor.kill();

    let sent = finish_load(load, EVENTS).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    stop.store(true, Ordering::Relaxed);
    let reads = poller.await.expect("no read went down");
    assert!(reads > 50, "the reader polled throughout: {reads} reads");
    assert_eq!(reader.groups().await.expect("the plan"), 16);
    assert_eq!(shares_in(&redis.url(), &setup, 16..32).await, 0);
    wait_for_totals(&reader, &fans, Duration::from_secs(60)).await;
    for (fan, liked) in [(0, false), (4, false), (5, true), (99, true), (100, false)] {
        let path = format!("/v1/counters/fans:post:0/likes/u{fan}");
        assert_eq!(http_json(api, &path).await["liked"], liked, "u{fan}");
    }
    let exact = http_json(api, "/v1/counters/fans:post:0?exact=true").await;
    assert_eq!(exact["total"], 95, "{exact}");
    // Every counter's window holds its whole total, part of it in the retired groups.
    let counters: Vec<&String> = sent.totals.keys().collect();
    let now = tally_common::event::now_ms();
    for chunk in counters.chunks(500) {
        let sums = (reader.window_sums(chunk, HOUR, HOURS, now).await).expect("a windowed read");
        for (counter, sum) in chunk.iter().zip(sums) {
            assert_eq!(sum, sent.totals[*counter], "{counter}'s last {HOURS} hours");
        }
    }
    assert!(cells_in(&redis.url(), &setup, 16..32).await > 0);
    last.stop_gracefully().await;
    setup.assert_audit_clean(&["--namespaces", ns], sent.totals.len() + fans.len());

    // A share left past the groups in use (as an at-least-once aggregator's late flush leaves
    // one) is not read until a run at the same count folds it.
    let stray = "likes:post:0";
    let before = reader.get(stray).await.expect("a read");
    let mut conn = connect(&redis.url()).await;
    redis::cmd("SET")
        .arg(setup.keyspace().counter_key(20, stray))
        .arg(5)
        .exec_async(&mut conn)
        .await
        .expect("SET");
    assert_eq!(reader.get(stray).await.expect("a read"), before);
    let swept = regroup(&setup, "16");
    assert!(
        swept.contains("folded 1 stray share(s) of groups [20]"),
        "{swept}"
    );
    assert_eq!(reader.get(stray).await.expect("a read"), before + 5);
    assert_eq!(shares_in(&redis.url(), &setup, 16..32).await, 0);
    assert!(
        swept.contains(&format!(
            "window buckets in groups 16..{cell_groups} are left to expire"
        )),
        "{swept}"
    );

    // Once the retired groups' window hashes have expired (made to, here), a run at the same
    // count stops windowed reads from summing them.
    for group in 16..32 {
        for stripe in 0..setup.keyspace().cells_stripes() {
            redis::cmd("PEXPIRE")
                .arg(setup.keyspace().cells_key_of_stripe(group, stripe))
                .arg(1)
                .exec_async(&mut conn)
                .await
                .expect("PEXPIRE");
        }
    }
    eventually(Duration::from_secs(10), "the hashes expire", || async {
        (cells_in(&redis.url(), &setup, 16..32).await == 0).then_some(())
    })
    .await;
    let lowered = regroup(&setup, "16");
    assert!(
        lowered.contains("windowed reads sum 16 groups"),
        "{lowered}"
    );
    let fresh = redis.reader(setup.keyspace()).await;
    assert_eq!(fresh.cell_groups().await.expect("the plan"), 16);

    // A window bucket left past the groups in use (an at-least-once aggregator's late flush) is
    // not read until a run at the same count finds it.
    let now = tally_common::event::now_ms();
    let windowed = |reader: tally_common::Reader| async move {
        let sums = reader.window_sums(&[stray], HOUR, HOURS, now).await;
        sums.expect("a windowed read")[0]
    };
    let before = windowed(redis.reader(setup.keyspace()).await).await;
    let hash = setup.keyspace().cells_key(20, stray);
    redis::cmd("HSET")
        .arg(&hash)
        .arg(stray)
        .arg(format!("1h={}:5", now / HOUR.width_ms))
        .exec_async(&mut conn)
        .await
        .expect("HSET");
    redis::cmd("PEXPIRE")
        .arg(&hash)
        .arg(3_600_000)
        .exec_async(&mut conn)
        .await
        .expect("PEXPIRE");
    assert_eq!(windowed(redis.reader(setup.keyspace()).await).await, before);
    let found = regroup(&setup, "16");
    assert!(
        found.contains("window buckets in groups 16..21 are left to expire"),
        "{found}"
    );
    assert_eq!(
        windowed(redis.reader(setup.keyspace()).await).await,
        before + 5
    );

    // Below the original count is refused with a clear error.
    let (done, below) = run_regroup(&setup, "8", "0");
    assert!(!done);
    assert!(
        below.contains("shrinks down to its original 16 shard groups at most, not 8"),
        "{below}"
    );
}

/// Panics unless each of `read` (a total or windowed sum, `what`) is at least what `last` holds
/// for its counter, then records it there: every delta of these tests is positive, so a value
/// that went down was misread (a group missed, or a moving amount counted twice, then once).
fn assert_never_down(watched: &[String], read: &[i64], last: &mut [i64], what: &str) {
    for ((counter, now), before) in watched.iter().zip(read).zip(last) {
        assert!(
            *now >= *before,
            "{counter}'s {what} read {now} after {before}: a read missed a group or counted a moving amount twice"
        );
        *before = *now;
    }
}

/// Posts of the `fans` namespace (one like per fan) that the HTTP API likes.
const FANS_POSTS: u32 = 4;

/// `PUT` (like) or `DELETE` (unlike) `fans:post:<post>` by `u<fan>` through the API: accepted.
async fn like(server: &ApiServer, method: &str, post: u32, fan: u32) {
    let path = format!("/v1/counters/fans:post:{post}/likes/u{fan}");
    let (status, body) = server.call(method, &path, None).await;
    assert_eq!(status, 202, "{method} {path}: {body}");
}

/// `GET path` from the API on `port`: a 200 answer's JSON.
async fn http_json(port: u16, path: &str) -> serde_json::Value {
    let answer = http_call(port, "GET", path, &[], None)
        .await
        .unwrap_or_else(|| panic!("GET {path}: no answer"));
    assert_eq!(answer.status, 200, "GET {path}: {}", answer.body);
    json(&answer.body)
}

/// Runs `tally regroup --to <to>` on the setup's deployment and asserts it succeeded; returns
/// what it printed.
fn regroup(setup: &AggregatorSetup, to: &str) -> String {
    let (done, printed) = run_regroup(setup, to, "60");
    assert!(done, "tally regroup --to {to}: {printed}");
    printed
}

/// Runs `tally regroup --to <to> --wait <wait>`; returns whether it succeeded, and what it
/// printed (stdout, then stderr).
fn run_regroup(setup: &AggregatorSetup, to: &str, wait: &str) -> (bool, String) {
    run_regroup_with(setup, to, wait, &[])
}

/// [`run_regroup`] with `env` set for the command (a failpoint).
fn run_regroup_with(
    setup: &AggregatorSetup,
    to: &str,
    wait: &str,
    env: &[(&str, &str)],
) -> (bool, String) {
    let run = Command::new(binary("tally"))
        .envs(env.iter().copied())
        .args(["regroup", "--to", to, "--wait", wait])
        .args(["--redis-url", &setup.redis_url])
        .args(["--key-prefix", &setup.key_prefix])
        .output()
        .expect("tally regroup runs");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    eprintln!("{printed}");
    (run.status.success(), printed)
}

/// How many shares and compaction journals the setup's keyspace holds in `groups`.
async fn shares_in(url: &str, setup: &AggregatorSetup, groups: std::ops::Range<u32>) -> usize {
    let mut conn = connect(url).await;
    let mut found = 0;
    for group in groups {
        let pattern = format!("{}:{{g{group}}}:[cj]:*", setup.key_prefix);
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        found += keys.len();
    }
    found
}

/// How many window hashes groups `groups` of the setup's deployment hold.
async fn cells_in(url: &str, setup: &AggregatorSetup, groups: std::ops::Range<u32>) -> usize {
    let mut conn = connect(url).await;
    let mut found = 0;
    for group in groups {
        let mut exists = redis::cmd("EXISTS");
        for stripe in 0..setup.keyspace().cells_stripes() {
            exists.arg(setup.keyspace().cells_key_of_stripe(group, stripe));
        }
        found += exists
            .query_async::<usize>(&mut conn)
            .await
            .expect("EXISTS");
    }
    found
}

/// Growing a Redis Cluster under load, then the groups: a 3-master cluster takes a paced load
/// on 16 partitions (spread 4 over 16 groups); 3 empty masters join and slots move to them,
/// keys and all, while the aggregator writes; then `tally regroup --to 64` lets the partitions
/// write 64 groups, which reach every master, and a second load runs under the new plan: every
/// new master holds shares of the new groups. Then `tally regroup --to 16` shrinks back under a
/// third load, folding the retired groups' shares with each move's steps spaced out (a first
/// run is aborted mid-fold by a failpoint; a second finishes), while a reader polls the busiest
/// counters and never reads a total go down. Every counter ends exact,
/// nothing is dead-lettered, no script crossed slots, `tally audit` finds no drift, and no
/// master holds a share or journal of the retired groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_grown_to_six_masters_under_load_then_shrunk_back_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let dir = TempDir::new("tally-regroup-cluster");
    let seed = seed();
    let mut cluster = RedisCluster::start().await;
    let setup = AggregatorSetup::create("regroup-cluster", &cluster.url(), 16).await;
    let events = 200_000;
    let spec = LoadSpec {
        events,
        counters: 3_000,
        rate: 8_000,
        max_delta: 5,
        seed,
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let mut aggregator = setup.spawn(dir.path(), &[]);
    aggregator
        .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
        .await;

    let started = std::time::Instant::now();
    let new_masters = cluster.add_masters(3).await;
    eprintln!(
        "3 masters added and slots rebalanced in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let grown = regroup(&setup, "64");
    assert!(
        grown.contains("every partition (16) places new offsets in 64 groups"),
        "{grown}"
    );

    // More load under the new plan (the first may have ended during the rebalance).
    let after = LoadSpec {
        events: 60_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        seed: seed.wrapping_add(1),
        ..LoadSpec::default()
    };
    let later = start_load(&setup.topic, after);
    let mut totals = finish_load(load, events).await.totals;
    for (counter, total) in finish_load(later, 60_000).await.totals {
        *totals.entry(counter).or_default() += total;
    }
    let reader = cluster.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &totals, Duration::from_secs(120)).await;

    // Every new master took writes of the new groups.
    let ks = setup.keyspace();
    for &port in &new_masters {
        let in_new_groups = shares_in(&format!("redis://127.0.0.1:{port}"), &setup, 16..64).await;
        eprintln!("master {port}: {in_new_groups} shares in groups 16-63");
        assert!(
            in_new_groups > 0,
            "master {port} holds no share of groups 16-63"
        );
    }

    // Back down to 16 groups under a third load, while a reader polls the busiest counters:
    // no total it reads ever goes down (every delta is positive), so no read counted a folded
    // share twice or missed one.
    let watched: Vec<String> = (0..20).map(|i| format!("likes:post:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let reader = cluster.reader(ks.clone()).await;
        let (watched, stop) = (watched.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = vec![0; watched.len()];
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let totals = reader.get_many(&watched).await.expect("a read");
                assert_never_down(&watched, &totals, &mut last, "total");
                reads += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            reads
        })
    };
    let third = LoadSpec {
        events: 60_000,
        counters: 3_000,
        rate: 10_000,
        max_delta: 5,
        seed: seed.wrapping_add(2),
        ..LoadSpec::default()
    };
    let last = start_load(&setup.topic, third);
    // The first run dies mid-fold (a failpoint aborts it once 300 shares were taken into
    // journals, before any was given); the reader goes on counting them from the journals, and
    // a second run finishes those moves and makes the rest.
    let failpoint = [("TALLY_FAILPOINT_COMPACT_ABORT_AFTER_TAKES", "300")];
    let (done, aborted) = run_regroup_with(&setup, "16", "60", &failpoint);
    assert!(!done, "{aborted}");
    assert!(
        aborted.contains("failpoint: aborting after 300 shares taken"),
        "{aborted}"
    );
    let shrunk = regroup(&setup, "16");
    assert!(
        shrunk.contains("every partition (16) places new offsets in 16 groups"),
        "{shrunk}"
    );
    assert!(shrunk.contains("into their base groups"), "{shrunk}");
    assert!(shrunk.contains("readers sum 16 groups"), "{shrunk}");
    for (counter, total) in finish_load(last, 60_000).await.totals {
        *totals.entry(counter).or_default() += total;
    }
    wait_for_totals(&reader, &totals, Duration::from_secs(120)).await;
    stop.store(true, Ordering::Relaxed);
    let reads = poller.await.expect("no read went down");
    assert!(reads > 20, "the reader polled throughout: {reads} reads");
    let fresh = cluster.reader(setup.keyspace()).await;
    assert_eq!(fresh.groups().await.expect("the plan"), 16);
    for i in 0..6 {
        let left = shares_in(&cluster.node_url(i), &setup, 16..64).await;
        assert_eq!(
            left, 0,
            "node {i} holds {left} shares of the retired groups"
        );
    }

    let dead = aggregator.metric("tally_events_dead_lettered_total").await;
    assert_eq!(dead.unwrap_or(0.0), 0.0, "nothing dead-lettered");
    aggregator.stop_gracefully().await;
    assert_no_crossslot(dir.path());
    setup.assert_audit_clean(&[], totals.len());
}
