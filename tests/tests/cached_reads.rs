//! Cached reads against a real Redis: a stampede of concurrent readers in several reader
//! "processes" (each its own `CachedReader` and connection) on one hot counter costs about one
//! shard read per TTL; a feed of 1,000 counters is served from the cache within the TTL and
//! refreshed after it; `get_exact` bypasses the cache; a namespace can keep its displayed count
//! from going down; reading counters never written writes nothing to Redis.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tally_common::namespace::{DisplayStyle, Namespaces, Policy};
use tally_common::{CachedReader, Keyspace, Reader, RedisConn};
use tally_tests::{RedisServer, unique};

async fn cached(redis: &RedisServer, keyspace: &Keyspace, namespaces: Namespaces) -> CachedReader {
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    CachedReader::new(Reader::new(conn, keyspace.clone()), Arc::new(namespaces))
}

fn ttl(ms: u64) -> Namespaces {
    Namespaces::uniform(Policy {
        cache_ttl_ms: ms,
        ..Policy::default()
    })
}

/// Adds `delta` to `counter`'s share in `group`, as a flush would.
async fn add(conn: &mut RedisConn, ks: &Keyspace, group: u32, counter: &str, delta: i64) {
    redis::cmd("INCRBY")
        .arg(ks.counter_key(group, counter))
        .arg(delta)
        .exec_async(conn)
        .await
        .expect("INCRBY");
}

async fn mget_calls(conn: &mut RedisConn) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_mget:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stampede_on_a_hot_counter_reads_its_shards_about_once_per_expiry() {
    const PROCESSES: usize = 4;
    const READERS: usize = 250;
    const TTL_MS: u64 = 200;
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("stampede"), 16).expect("keyspace");
    let hot = "likes:post:hot";
    // A connection with tally's 5 s response timeout: the readers below keep both cores busy.
    let mut conn = RedisConn::connect(&redis.url()).await.expect("redis");
    for group in 0..16 {
        add(&mut conn, &ks, group, hot, 100).await;
    }
    let mut processes = Vec::new();
    for _ in 0..PROCESSES {
        processes.push(cached(&redis, &ks, ttl(TTL_MS)).await);
    }
    // Warm the shared entry once, so that no process starts with nothing to serve.
    processes[0].get(hot).await.expect("first read");
    processes[0].stats().shard_reads.store(0, Ordering::Relaxed);
    let mgets_before = mget_calls(&mut conn).await;
    let started = Instant::now();
    let run_for = Duration::from_secs(3);
    let mut tasks = Vec::new();
    for process in &processes {
        for _ in 0..READERS {
            let process = process.clone();
            tasks.push(tokio::spawn(async move {
                let mut reads = 0u64;
                let mut last = 0;
                while started.elapsed() < run_for {
                    let value = process.get(hot).await.expect("cached read");
                    assert!(value >= last, "a later read went back: {last} then {value}");
                    last = value;
                    reads += 1;
                    // Each reader asks again every millisecond: a million reads a second in all.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                reads
            }));
        }
    }
    // The counter keeps moving while it is read.
    let mut written = 1_600;
    while started.elapsed() < run_for {
        add(&mut conn, &ks, (written % 16) as u32, hot, 1).await;
        written += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut reads = 0;
    for task in tasks {
        reads += task.await.expect("reader task");
    }
    let elapsed = started.elapsed();
    let mgets = mget_calls(&mut conn).await - mgets_before;
    let (mut shard_reads, mut local, mut stale, mut shared) = (0, 0, 0, 0);
    for p in &processes {
        let s = p.stats();
        shard_reads += s.shard_reads.load(Ordering::Relaxed);
        local += s.local_hits.load(Ordering::Relaxed);
        stale += s.stale_served.load(Ordering::Relaxed);
        shared += s.shared_hits.load(Ordering::Relaxed);
    }
    let expiries = elapsed.as_millis() as u64 / TTL_MS + 1;
    eprintln!(
        "{} readers in {PROCESSES} processes, {reads} reads in {elapsed:?}, TTL {TTL_MS} ms: \
         {shard_reads} shard reads ({mgets} MGETs over 16 groups) for {expiries} expiries = {:.2} per expiry; \
         {local} fresh local hits, {stale} stale served during a refresh, {shared} refreshed from another process's entry",
        PROCESSES * READERS,
        shard_reads as f64 / expiries as f64,
    );
    assert!(reads > 10 * expiries, "the readers barely read ({reads})");
    assert!(shard_reads >= expiries / 2, "the cache was never refreshed");
    assert!(
        shard_reads <= expiries + 2,
        "{shard_reads} shard reads for {expiries} expiries: a stampede"
    );
    assert_eq!(
        mgets,
        shard_reads * 16,
        "every shard read is one MGET per group"
    );
    // Once the writes stop and a TTL passes, the cached total is the exact one.
    tokio::time::sleep(Duration::from_millis(TTL_MS + 50)).await;
    let exact = processes[0].get_exact(hot).await.expect("exact");
    assert_eq!(exact, written);
    for p in &processes {
        assert_eq!(p.get(hot).await.expect("cached"), exact);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_is_cached_for_its_ttl_and_get_exact_bypasses_the_cache() {
    const TTL_MS: u64 = 3_000;
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("feed"), 16).expect("keyspace");
    // A connection with tally's 5 s response timeout: the readers below keep both cores busy.
    let mut conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let feed: Vec<String> = (0..1_000).map(|i| format!("views:video:{i}")).collect();
    for (i, counter) in feed.iter().enumerate() {
        add(&mut conn, &ks, (i % 16) as u32, counter, i as i64).await;
    }
    let reader = cached(&redis, &ks, ttl(TTL_MS)).await;
    let first = reader.get_many(&feed).await.expect("feed");
    assert_eq!(first, (0..1_000).collect::<Vec<i64>>());
    let refreshed_at = Instant::now();
    let mut pipe = redis::pipe();
    for (i, counter) in feed.iter().enumerate() {
        pipe.incr(ks.counter_key(((i + 1) % 16) as u32, counter), 1)
            .ignore();
    }
    pipe.exec_async(&mut conn).await.expect("INCRBYs");
    let cached_feed = reader.get_many(&feed).await.expect("feed");
    assert!(
        refreshed_at.elapsed() < Duration::from_millis(TTL_MS),
        "the check came too late"
    );
    assert_eq!(
        cached_feed, first,
        "within the TTL the feed comes from the cache"
    );
    assert_eq!(reader.get_exact(&feed[7]).await.expect("exact"), 8);
    tokio::time::sleep(Duration::from_millis(TTL_MS + 50)).await;
    let later = reader.get_many(&feed).await.expect("feed");
    assert_eq!(later, (1..=1_000).collect::<Vec<i64>>());
    assert_eq!(reader.stats().shard_reads.load(Ordering::Relaxed), 2_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_can_keep_its_displayed_count_from_going_down() {
    const TTL_MS: u64 = 200;
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("display"), 16).expect("keyspace");
    let namespaces = Namespaces::from_toml(&format!(
        "[defaults]\ncache_ttl_ms = {TTL_MS}\n\
         [namespaces.likes]\ndisplay_never_decreases = true\n\
         [namespaces.bids]\ndisplay = \"exact\"\n"
    ))
    .expect("namespaces");
    assert_eq!(namespaces.policy("bids:lot:1").display, DisplayStyle::Exact);
    // A connection with tally's 5 s response timeout: the readers below keep both cores busy.
    let mut conn = RedisConn::connect(&redis.url()).await.expect("redis");
    for counter in ["likes:post:1", "views:video:1", "bids:lot:1"] {
        add(&mut conn, &ks, 3, counter, 10_500).await;
    }
    let reader = cached(&redis, &ks, namespaces).await;
    assert_eq!(
        reader.display("likes:post:1").await.expect("shown"),
        "10.5K"
    );
    assert_eq!(
        reader.display("views:video:1").await.expect("shown"),
        "10.5K"
    );
    assert_eq!(reader.display("bids:lot:1").await.expect("shown"), "10,500");
    for counter in ["likes:post:1", "views:video:1"] {
        add(&mut conn, &ks, 4, counter, -100).await;
    }
    tokio::time::sleep(Duration::from_millis(TTL_MS + 50)).await;
    assert_eq!(reader.get("likes:post:1").await.expect("count"), 10_400);
    assert_eq!(
        reader.display("likes:post:1").await.expect("shown"),
        "10.5K"
    );
    assert_eq!(
        reader.display("views:video:1").await.expect("shown"),
        "10.4K"
    );
}

async fn dbsize(conn: &mut RedisConn) -> u64 {
    redis::cmd("DBSIZE")
        .query_async(conn)
        .await
        .expect("DBSIZE")
}

/// Reading counters that were never written writes nothing to Redis: no cache entry, no lock
/// left behind, however many are asked for, and after their TTL too; a counter written later
/// is cached as before.
#[tokio::test]
async fn reading_counters_never_written_writes_nothing() {
    let redis = RedisServer::start().await;
    let keyspace = Keyspace::new(unique("never"), 4).expect("keyspace");
    let reader = cached(&redis, &keyspace, ttl(200)).await;
    let mut conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let before = dbsize(&mut conn).await;
    let missing: Vec<String> = (0..1_000).map(|i| format!("likes:post:ghost{i}")).collect();
    for _ in 0..2 {
        let totals = reader.get_many(&missing).await.expect("read");
        assert!(totals.iter().all(|t| *t == 0));
        assert_eq!(reader.get("likes:post:ghost-one").await.expect("read"), 0);
        // Past the TTL, so the second round refreshes.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(dbsize(&mut conn).await, before, "keys written by reads");

    // A written counter is cached as before: one entry, shared by every reader.
    add(&mut conn, &keyspace, 1, "likes:post:real", 3).await;
    assert_eq!(reader.get("likes:post:real").await.expect("read"), 3);
    assert_eq!(
        dbsize(&mut conn).await,
        before + 2,
        "the share and its cache entry"
    );
}
