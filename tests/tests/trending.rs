//! Trending counters and the cache warmer, end to end: a skewed stream (Zipf 1.5 over 1,000
//! counters) through the aggregator. `top` names the Zipf head in order, and a reader of the
//! hottest counter is served from entries the aggregator warmed after its flushes: it never
//! reads shards itself.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_common::{CachedReader, Namespaces, Policy};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, finish_load, reader, seed, start_load, wait_for_totals,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aggregator_names_trending_counters_and_keeps_them_warm() {
    let dir = TempDir::new("tally-trending");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("trending", &redis.url(), 8).await;
    let mut aggregator = setup.spawn(dir.path(), &["--trending-interval-ms", "500"]);
    let load = start_load(
        &setup.topic,
        LoadSpec {
            events: 150_000,
            counters: 1_000,
            zipf: 1.5,
            rate: 15_000,
            seed: seed(),
            ..LoadSpec::default()
        },
    );
    let exact = reader(&redis.url(), setup.keyspace()).await;
    tally_tests::eventually(Duration::from_secs(30), "a trending list", || {
        let exact = exact.clone();
        async move {
            let top = exact.top("likes", 3).await.expect("top");
            (top.len() == 3).then_some(())
        }
    })
    .await;
    // A reader with a TTL longer than the flush interval: the warmed entry stays fresh.
    let cached = CachedReader::new(
        reader(&redis.url(), setup.keyspace()).await,
        Arc::new(Namespaces::uniform(Policy {
            cache_ttl_ms: 3_000,
            ..Policy::default()
        })),
    );
    // Wait until the hottest counter's entry has been warmed once, then read it as a service
    // would while the stream goes on.
    tally_tests::eventually(Duration::from_secs(30), "a warmed entry", || {
        let exact = exact.clone();
        async move {
            let mut conn = exact.conn().clone();
            let entry: Option<String> = redis::cmd("GET")
                .arg(exact.keyspace().cache_key("likes:post:1"))
                .query_async(&mut conn)
                .await
                .ok()?;
            entry.map(|_| ())
        }
    })
    .await;
    let mut reads = 0;
    while !load.is_finished() {
        cached.get("likes:post:1").await.expect("cached read");
        reads += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sent = finish_load(load, 150_000).await;
    wait_for_totals(&exact, &sent.totals, Duration::from_secs(60)).await;
    let stats = cached.stats();
    let (shard_reads, shared) = (
        stats.shard_reads.load(Ordering::Relaxed),
        stats.shared_hits.load(Ordering::Relaxed),
    );
    eprintln!(
        "{reads} reads of the hottest counter: {shard_reads} shard reads, {shared} refreshed from warmed entries"
    );
    assert!(
        reads > 100,
        "the stream ended too soon to read it ({reads} reads)"
    );
    assert_eq!(shard_reads, 0, "a trending counter's reader read shards");
    assert!(shared > 0, "the reader never found a warmed entry");

    let top = exact.top("likes", 3).await.expect("top");
    eprintln!("top likes: {top:?}");
    let names: Vec<&str> = top.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(names, ["likes:post:1", "likes:post:2", "likes:post:3"]);
    aggregator.stop_gracefully().await;
}
