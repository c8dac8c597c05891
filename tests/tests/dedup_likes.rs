//! One like per user, end to end: a storm of likes and unlikes with heavy repetition (double
//! clicks, re-likes, unlikes of nothing) from 10,000 actors on a few counters of a deduplicating
//! namespace, with the aggregator SIGKILLed five times mid-stream. Every total equals the number
//! of distinct actors whose last action was a like, and `has_liked` agrees with that last action.
//! Run with Lua scripts, again as a Redis user that may not run scripts (WATCH/MULTI/EXEC), and
//! with PostgreSQL as the store of record (a members table in the flush's transaction). On Redis,
//! `tally audit` then recounts the log by the one-per-actor rule and finds no drift.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tally_common::CounterEvent;
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    AggregatorProcess, AggregatorSetup, RedisServer, TempDir, brokers, kill_repeatedly, reader,
    seed, unique, wait_for_totals,
};

const COUNTERS: u64 = 5;
const ACTORS: u64 = 10_000;
/// The storm sends at least this many, and on until the last kill.
const EVENTS: u64 = 60_000;
const RATE: u64 = 12_000;

/// What the storm left true: per counter, the actors whose last acknowledged action was a like.
struct Truth {
    last: HashMap<(String, String), bool>,
    sent: u64,
}

impl Truth {
    fn totals(&self) -> HashMap<String, i64> {
        let mut totals: HashMap<String, i64> = (0..COUNTERS)
            .map(|c| (format!("likes:post:{c}"), 0))
            .collect();
        for ((counter, _), liked) in &self.last {
            if *liked {
                *totals.entry(counter.clone()).or_default() += 1;
            }
        }
        totals
    }
}

/// Sends the storm in order (one task, keyed by counter, so each counter's actions stay in order)
/// and records each acknowledged action. It sends at least `EVENTS`, and goes on until `killing`
/// is cleared, so that every SIGKILL lands mid-storm however slowly the aggregators restart.
async fn storm(topic: String, seed: u64, killing: Arc<AtomicBool>) -> Truth {
    let producer = Producer::new(&ProducerConfig::new(brokers(), topic)).expect("producer");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pending = std::collections::VecDeque::new();
    let mut last = HashMap::new();
    let started = std::time::Instant::now();
    let mut sent = 0u64;
    while sent < EVENTS || killing.load(Ordering::Relaxed) {
        let counter = format!("likes:post:{}", rng.random_range(0..COUNTERS));
        let actor = format!("u{}", rng.random_range(0..ACTORS));
        let like = rng.random_bool(0.6);
        // A double click sends the same action twice in a row.
        let times = if rng.random_bool(0.2) { 2 } else { 1 };
        for _ in 0..times {
            let event = CounterEvent::new(counter.clone(), if like { 1 } else { -1 })
                .and_then(|e| e.with_actor(actor.clone()))
                .expect("valid event");
            let ack = producer.enqueue(&event).await.expect("enqueued");
            pending.push_back((ack, counter.clone(), actor.clone(), like));
            sent += 1;
        }
        while pending.len() > 20_000 {
            settle(&mut pending, &mut last).await;
        }
        if sent % 100 < times {
            let due = started + Duration::from_secs_f64(sent as f64 / RATE as f64);
            tokio::time::sleep_until(due.into()).await;
        }
    }
    while !pending.is_empty() {
        settle(&mut pending, &mut last).await;
    }
    Truth { last, sent }
}

type Pending = (tally_producer::Pending, String, String, bool);

async fn settle(
    pending: &mut std::collections::VecDeque<Pending>,
    last: &mut HashMap<(String, String), bool>,
) {
    if let Some((ack, counter, actor, like)) = pending.pop_front() {
        ack.acked().await.expect("Kafka acknowledged the action");
        last.insert((counter, actor), like);
    }
}

/// The PostgreSQL store as the store of record, when given.
fn postgres_reader(reader: tally_common::Reader, url: &str, prefix: &str) -> tally_common::Reader {
    use tally_common::pg;
    let options = pg::PoolOptions {
        password: None,
        size: 2,
        statement_timeout: None,
    };
    let store = pg::PgStore::connect(url, options, prefix).expect("PostgreSQL store");
    reader.with_store(std::sync::Arc::new(store))
}

/// A storm of likes and unlikes under SIGKILLs into a fresh deployment, which counts them by
/// their sets, or, `in_shares`, into one recorded as counting them in the shares (a deployment
/// an earlier version started).
async fn like_storm(
    name: &str,
    redis: &RedisServer,
    redis_url: &str,
    postgres: Option<&str>,
    in_shares: bool,
) {
    use redis::AsyncCommands as _;
    let seed = seed();
    let dir = TempDir::new("tally-likes");
    let mut setup = AggregatorSetup::create(name, redis_url, 8).await;
    setup.flush_interval_ms = 500;
    let mut admin = tally_tests::connect(&redis.url()).await;
    let ks = setup.keyspace();
    if in_shares {
        let _: () = admin
            .hset_multiple(
                ks.layout_key(),
                &[("origin", "recorded"), ("likes", "shares")],
            )
            .await
            .expect("HSET");
    }
    let namespaces = dir.path().join("namespaces.toml");
    std::fs::write(&namespaces, "[namespaces.likes]\ndedup = true\n").expect("namespace file");
    let member = format!("group.instance.id={}", unique("member"));
    let mut flags = vec![
        "--namespaces",
        namespaces.to_str().expect("utf-8 path"),
        "--kafka-option",
        &member,
    ];
    if let Some(url) = postgres {
        flags.extend(["--store", "postgres", "--postgres-url", url]);
    }
    let first = setup.spawn(dir.path(), &flags);
    let killing = Arc::new(AtomicBool::new(true));
    let load = tokio::spawn(storm(setup.topic.clone(), seed, killing.clone()));
    let mut last = kill_repeatedly(&setup, dir.path(), &flags, first, 5, seed, &load).await;
    killing.store(false, Ordering::Relaxed);
    let truth = load.await.expect("storm task");
    let totals = truth.totals();
    let likers: i64 = totals.values().sum();
    eprintln!(
        "{} actions over {} (counter, actor) pairs; {likers} likes stand",
        truth.sent,
        truth.last.len()
    );
    let mut counts = redis.reader(setup.keyspace()).await;
    let mut check = reader(redis_url, setup.keyspace()).await;
    if let Some(url) = postgres {
        counts = postgres_reader(counts, url, &setup.key_prefix);
        check = postgres_reader(check, url, &setup.key_prefix);
    }
    wait_for_totals(&counts, &totals, Duration::from_secs(90)).await;
    if postgres.is_none() {
        // A fresh deployment counts likes by their sets: each standing like is in its counter's
        // count set, and no share holds a like. One counting them in the shares keeps them in
        // member sets, each counted in its counter's share.
        let counted: Option<String> = admin.hget(ks.layout_key(), "likes").await.expect("HGET");
        let sets: Vec<String> =
            (admin.keys(format!("{}:*:s:*", setup.key_prefix)).await).expect("KEYS");
        let shares: Vec<String> =
            (admin.keys(format!("{}:*:c:*", setup.key_prefix)).await).expect("KEYS");
        let mut held = 0;
        for counter in totals.keys() {
            let group = ks.group_for_counter(counter);
            let key = match in_shares {
                false => ks.count_set_key(group, counter),
                true => ks.member_key(group, counter),
            };
            held += admin.scard::<_, i64>(key).await.expect("SCARD");
        }
        assert_eq!(held, likers, "every standing like is in its set");
        if in_shares {
            assert_eq!(counted.as_deref(), Some("shares"));
            assert_eq!(sets, Vec::<String>::new(), "no count set");
            assert!(!shares.is_empty(), "the likes are counted in the shares");
        } else {
            assert_eq!(counted.as_deref(), Some("sets"));
            assert_eq!(shares, Vec::<String>::new(), "no share holds a like");
        }
    }
    for ((counter, actor), liked) in truth.last.iter().take(2_000) {
        assert_eq!(
            check.has_liked(counter, actor).await.expect("has_liked"),
            *liked,
            "{actor} on {counter}"
        );
    }
    let mut totals = totals;
    if in_shares {
        let file = namespaces.to_str().expect("utf-8 path");
        let moved = MoveToSets {
            setup: &setup,
            redis,
            dir: dir.path(),
            namespaces: file,
            seed,
        };
        (last, totals) = moved.run(last, truth, &flags).await;
    }
    last.stop_gracefully().await;
    if postgres.is_none() {
        let namespaces = namespaces.to_str().expect("utf-8 path");
        setup.assert_audit_clean(&["--namespaces", namespaces], totals.len());
    }
}

/// A deployment counting likes in the shares, moved to count sets by `tally likes-to-sets`.
struct MoveToSets<'a> {
    setup: &'a AggregatorSetup,
    redis: &'a RedisServer,
    dir: &'a std::path::Path,
    namespaces: &'a str,
    seed: u64,
}

impl MoveToSets<'_> {
    /// Moves the likes while `running` (an aggregator counting them in the shares) still runs
    /// and a direct writer that counts them in the shares is open: every total and `has_liked`
    /// reads the same after, the aggregator stops by itself once fenced and the direct writer
    /// writes no like. Then a second storm, through an aggregator started after the move,
    /// likes, re-likes and unlikes the likes moved: each counted once, by the sets. Returns
    /// that aggregator and the totals.
    async fn run(
        &self,
        mut running: AggregatorProcess,
        truth: Truth,
        flags: &[&str],
    ) -> (AggregatorProcess, HashMap<String, i64>) {
        use redis::AsyncCommands as _;
        let setup = self.setup;
        let ks = setup.keyspace();
        let mut admin = tally_tests::connect(&self.redis.url()).await;
        let conn = tally_common::RedisConn::connect(&self.redis.url())
            .await
            .expect("connects");
        let namespaces = tally_common::Namespaces::from_file(std::path::Path::new(self.namespaces))
            .expect("namespaces");
        let direct = tally_producer::DirectWriter::new(conn, ks.clone(), Arc::new(namespaces));
        let mut last = truth.last;
        // It writes likes in the shares (taken back, for the audit's sake, which recounts the
        // log and not direct writes).
        let actor = "direct-actor";
        assert!(direct.like("likes:post:0", actor).await.expect("a like"));
        assert!(
            direct
                .unlike("likes:post:0", actor)
                .await
                .expect("an unlike")
        );
        let totals = |last: &HashMap<(String, String), bool>| {
            Truth {
                last: last.clone(),
                sent: 0,
            }
            .totals()
        };
        let reader = self.redis.reader(ks.clone()).await;
        wait_for_totals(&reader, &totals(&last), Duration::from_secs(30)).await;

        let namespaces = std::path::Path::new(self.namespaces);
        let tally = |args: &[&str]| {
            let url = self.redis.url();
            let (succeeded, stdout, stderr) =
                tally_tests::process::likes_to_sets(&url, namespaces, &setup.key_prefix, 16, args);
            assert!(succeeded, "{stdout}{stderr}");
            stdout
        };
        // A dry run first: what the move then does, with nothing changed.
        let planned = tally(&["--dry-run"]);
        let (_, would) = planned
            .split_once("would move (dry run, nothing changed) to count sets: ")
            .unwrap_or_else(|| panic!("{planned}"));
        let said = tally(&[]);
        assert!(said.contains("likes moved to count sets"), "{said}");
        assert!(said.ends_with(would), "dry run: {planned}; move: {said}");
        eprintln!("{said}");
        // Every total the same, read at once; no member set left; the record says sets.
        let expected = totals(&last);
        for (counter, total) in &expected {
            assert_eq!(
                reader.get(counter).await.expect("read"),
                *total,
                "{counter}"
            );
        }
        let members: Vec<String> =
            (admin.keys(format!("{}:*:m:*", setup.key_prefix)).await).expect("KEYS");
        assert_eq!(members, Vec::<String>::new(), "every member set moved");
        let record: HashMap<String, String> =
            admin.hgetall(ks.layout_key()).await.expect("HGETALL");
        assert_eq!(record.get("likes").map(String::as_str), Some("sets"));
        assert_eq!(record.get("dedup:likes").map(String::as_str), Some("sets"));
        let again = tally(&[]);
        assert!(again.contains("already"), "{again}");
        // The direct writer that counted in the shares finds the group moved, reads the layout
        // again and writes by the sets: the like lands in the count set, not in a member set
        // (taken back again for the audit).
        let counter = "likes:post:1";
        let set = ks.count_set_key(ks.group_for_counter(counter), counter);
        assert!(
            direct
                .like(counter, actor)
                .await
                .expect("a like by the sets")
        );
        let counted: bool = admin.sismember(&set, actor).await.expect("SISMEMBER");
        assert!(counted, "{set}");
        assert!(direct.unlike(counter, actor).await.expect("an unlike"));
        let members: Vec<String> =
            (admin.keys(format!("{}:*:m:*", setup.key_prefix)).await).expect("KEYS");
        assert_eq!(members, Vec::<String>::new(), "no member set written");

        // A second storm while the old aggregator still holds its partitions (fenced: it writes
        // nothing more, and takes no partition again, `refused_writes.rs`), and a new one.
        // Fenced, the old one finds the likes moved and stops by itself, failing, so that a
        // supervisor restarts it into the sets.
        let member = format!("group.instance.id={}", unique("member"));
        let mut flags = flags.to_vec();
        let at = flags
            .iter()
            .position(|f| f.starts_with("group.instance.id="));
        if let Some(at) = at {
            flags[at] = &member;
        }
        let load = tokio::spawn(storm(
            setup.topic.clone(),
            self.seed ^ 0x5e75,
            Arc::new(AtomicBool::new(false)),
        ));
        let after = setup.spawn(self.dir, &flags);
        // Both in the group, the new one writing the storm's likes by the sets, before the old
        // one goes.
        let flushed = "tally_events_flushed_total";
        after
            .wait_metric(flushed, 1.0, Duration::from_secs(60))
            .await;
        let status = running.wait_exit(Duration::from_secs(60)).await;
        assert!(
            !status.success(),
            "the old aggregator exits failing: {status}"
        );
        let log = running.log();
        assert!(
            log.contains("likes were moved to count sets") && log.contains("stopping"),
            "{}",
            running.log_tail(20)
        );
        let second = load.await.expect("storm task");
        last.extend(second.last);
        let expected = totals(&last);
        wait_for_totals(&reader, &expected, Duration::from_secs(90)).await;
        let members: Vec<String> =
            (admin.keys(format!("{}:*:m:*", setup.key_prefix)).await).expect("KEYS");
        assert_eq!(
            members,
            Vec::<String>::new(),
            "likes are kept in count sets"
        );
        for ((counter, actor), liked) in last.iter().take(2_000) {
            assert_eq!(
                reader.has_liked(counter, actor).await.expect("has_liked"),
                *liked,
                "{actor} on {counter}"
            );
        }
        (after, expected)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_like_storm_with_sigkills_counts_each_actor_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    like_storm("likes", &redis, &redis.url(), None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_like_storm_counted_in_the_shares_counts_each_actor_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    like_storm("likes-shares", &redis, &redis.url(), None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_like_storm_without_scripts_counts_each_actor_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let url = redis.user_without_scripts().await;
    like_storm("likes-noscripts", &redis, &url, None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_like_storm_into_postgres_counts_each_actor_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let pg = tally_tests::postgres::PgServer::start().await;
    like_storm("likes-pg", &redis, &redis.url(), Some(&pg.url()), false).await;
}

/// Where likes are kept is recorded by the first writer and holds every writer after it: an
/// aggregator grouping a namespace's likes otherwise than the record refuses to start and says
/// why; a deployment that counted before records existed refuses the new grouping until told.
/// A deployment whose first writer found nothing written counts likes by their sets, and
/// records each namespace grouped by counter as `sets`, which older writers refuse as a grouping
/// they do not keep; one grouped by actor is recorded and kept as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_grouping_likes_otherwise_than_the_record_refuses_to_start() {
    use tally_common::layout::{LayoutError, LikesCount, record_dedup_groupings};
    use tally_common::{Namespaces, RedisConn};

    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let dir = TempDir::new("tally-layout");
    let setup = AggregatorSetup::create("layout", &redis.url(), 4).await;
    let conn = RedisConn::connect(&redis.url()).await.expect("connects");
    let ks = setup.keyspace();
    let by_counter = Namespaces::from_toml("[namespaces.likes]\ndedup = true\n").expect("valid");
    let by_actor = "[namespaces.likes]\ndedup = true\ngrouping = \"actor\"\n";
    let by_actor = Namespaces::from_toml(by_actor).expect("valid");
    let mut admin = tally_tests::connect(&redis.url()).await;
    // A flush's ledger entry for partition 0 in the ledger hash `key`.
    async fn ledger(admin: &mut redis::aio::MultiplexedConnection, key: String, entry: i64) {
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg("0")
            .arg(entry)
            .query_async(admin)
            .await
            .expect("HSET");
    }
    async fn recorded(
        admin: &mut redis::aio::MultiplexedConnection,
        ks: &tally_common::Keyspace,
        field: &str,
    ) -> Option<String> {
        redis::cmd("HGET")
            .arg(ks.layout_key())
            .arg(field)
            .query_async(admin)
            .await
            .expect("HGET")
    }

    // A fresh deployment: plain counts first (a writer without likes records the origin and
    // that likes count by their sets, then its flushes write ledgers), then likes grouped by
    // counter, recorded as counted by their sets.
    assert_eq!(
        record_dedup_groupings(&conn, &ks, &Namespaces::default())
            .await
            .expect("nothing to record but the origin and how likes count"),
        Some(LikesCount::Sets)
    );
    ledger(&mut admin, ks.ledger_key(1), 41).await;
    assert_eq!(
        record_dedup_groupings(&conn, &ks, &by_counter)
            .await
            .expect("recorded"),
        Some(LikesCount::Sets)
    );
    assert_eq!(
        recorded(&mut admin, &ks, "dedup:likes").await.as_deref(),
        Some("sets")
    );
    let refused = record_dedup_groupings(&conn, &ks, &by_actor).await;
    assert!(
        matches!(&refused, Err(LayoutError::Mismatch { recorded, .. }) if recorded == "sets"),
        "{refused:?}"
    );
    let votes = "[namespaces.votes]\ndedup = true\ngrouping = \"actor\"\n";
    let votes = Namespaces::from_toml(votes).expect("valid");
    record_dedup_groupings(&conn, &ks, &votes)
        .await
        .expect("recorded");
    assert_eq!(
        recorded(&mut admin, &ks, "dedup:votes").await.as_deref(),
        Some("actor")
    );

    // The aggregator binary holds to the record too: it exits at once, naming the namespace.
    let file = dir.path().join("by-actor.toml");
    std::fs::write(
        &file,
        "[namespaces.likes]\ndedup = true\ngrouping = \"actor\"\n",
    )
    .expect("written");
    let mut aggregator = setup.spawn(dir.path(), &["--namespaces", file.to_str().expect("utf-8")]);
    let status = aggregator.wait_exit(Duration::from_secs(60)).await;
    assert!(!status.success(), "{status:?}");
    let log = aggregator.log();
    assert!(
        log.contains("\"likes\" keeps its likes as \"sets\""),
        "{log}"
    );

    // A deployment an earlier version started (its origin recorded, not how likes count) and
    // flushed into: likes count in the shares, as that version counted them, and each
    // namespace's record is its grouping.
    let earlier = tally_common::Keyspace::new("layout-earlier", 4).expect("valid");
    let _: () = redis::cmd("HSET")
        .arg(earlier.layout_key())
        .arg("origin")
        .arg("recorded")
        .query_async(&mut admin)
        .await
        .expect("HSET");
    ledger(&mut admin, earlier.ledger_key(0), 5).await;
    assert_eq!(
        record_dedup_groupings(&conn, &earlier, &by_counter)
            .await
            .expect("recorded"),
        Some(LikesCount::Shares)
    );
    assert_eq!(
        recorded(&mut admin, &earlier, "likes").await.as_deref(),
        Some("shares")
    );
    assert_eq!(
        recorded(&mut admin, &earlier, "dedup:likes")
            .await
            .as_deref(),
        Some("counter")
    );
    let refused = record_dedup_groupings(&conn, &earlier, &by_actor).await;
    assert!(
        matches!(&refused, Err(LayoutError::Mismatch { recorded, .. }) if recorded == "counter"),
        "{refused:?}"
    );

    // A deployment that counted before records existed: ledgers, and no record.
    let old = tally_common::Keyspace::new("layout-old", 4).expect("valid");
    ledger(&mut admin, old.ledger_key(2), 17).await;
    let refused = record_dedup_groupings(&conn, &old, &by_counter).await;
    assert!(
        matches!(&refused, Err(LayoutError::Unrecorded { .. })),
        "{refused:?}"
    );
    record_dedup_groupings(&conn, &old, &by_actor)
        .await
        .expect("likes kept where they were");
}
