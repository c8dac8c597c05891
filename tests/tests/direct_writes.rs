//! Direct writes and dynamic shard counts against a real Redis: one counter driven from 100 to
//! 20,000 writes per second by 64 concurrent writers in 4 writer "processes" (each its own
//! `DirectWriter` and connection), with the shard monitor running. Its shard count starts at one
//! and rises by itself, the busiest shard's rate ends under the threshold, and the total is
//! exactly the number of writes made. Likes in a deduplicating direct namespace count once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tally_aggregator::tasks::shard_monitor::ShardMonitor;
use tally_common::{Keyspace, Namespaces, Reader, RedisConn};
use tally_producer::DirectWriter;
use tally_tests::{RedisServer, unique};
use tokio_util::sync::CancellationToken;

const THRESHOLD: u64 = 2_000;
const PHASES: [(u64, u64); 4] = [(100, 3), (1_000, 3), (5_000, 3), (20_000, 5)];

/// One second's sample: the shard count the writers see, and each group's writes that second.
struct Sample {
    at: Duration,
    target: u64,
    shards: u32,
    per_shard: Vec<i64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viral_counter_gets_more_shards_and_stays_exact() {
    const PROCESSES: usize = 4;
    const TASKS: usize = 16;
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("viral"), 16).expect("keyspace");
    let namespaces = Arc::new(
        Namespaces::from_toml("[namespaces.views]\nwrite_path = \"direct\"\n").expect("ns"),
    );
    let counter = "views:video:viral";
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let reader = Reader::new(conn.clone(), ks.clone());
    let cancel = CancellationToken::new();
    let monitor = ShardMonitor {
        conn: conn.clone(),
        keyspace: ks.clone(),
        threshold: THRESHOLD,
        metrics: None,
    };
    let monitor_task = tokio::spawn(monitor.run(cancel.clone()));

    let mut writers = Vec::new();
    for _ in 0..PROCESSES {
        let conn = RedisConn::connect(&redis.url()).await.expect("redis");
        writers.push(DirectWriter::new(conn, ks.clone(), namespaces.clone()));
    }
    let written = Arc::new(AtomicU64::new(0));
    let target = Arc::new(AtomicU64::new(PHASES[0].0));
    let started = Instant::now();
    let total_s: u64 = PHASES.iter().map(|(_, s)| s).sum();
    let stop = started + Duration::from_secs(total_s);
    let mut tasks = Vec::new();
    for writer in &writers {
        for _ in 0..TASKS {
            let (writer, written, target) = (writer.clone(), written.clone(), target.clone());
            tasks.push(tokio::spawn(async move {
                // Each task writes its share of the target rate in 10 ms slices.
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                let mut owed = 0.0;
                while Instant::now() < stop {
                    tick.tick().await;
                    owed +=
                        target.load(Ordering::Relaxed) as f64 / (PROCESSES * TASKS) as f64 / 100.0;
                    while owed >= 1.0 {
                        writer.add(counter, 1).await.expect("direct write");
                        written.fetch_add(1, Ordering::Relaxed);
                        owed -= 1.0;
                    }
                }
            }));
        }
    }
    let mut samples = Vec::new();
    let mut last: Vec<i64> = vec![0; 16];
    let mut phase_end = Duration::ZERO;
    for (rate, seconds) in PHASES {
        target.store(rate, Ordering::Relaxed);
        phase_end += Duration::from_secs(seconds);
        while started.elapsed() < phase_end {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let shares = shares(&reader, &ks, counter).await;
            let per_shard = shares
                .iter()
                .zip(&last)
                .map(|(now, before)| now - before)
                .collect();
            last = shares;
            samples.push(Sample {
                at: started.elapsed(),
                target: rate,
                shards: writers[0].shard_count(counter).await,
                per_shard,
            });
        }
    }
    for task in tasks {
        task.await.expect("writer task");
    }
    cancel.cancel();
    monitor_task.await.expect("monitor");

    eprintln!("  time  target/s  shards  writes/s  busiest shard/s");
    for s in &samples {
        let total: i64 = s.per_shard.iter().sum();
        let busiest = s.per_shard.iter().max().copied().unwrap_or(0);
        eprintln!(
            "{:>5.1}s {:>9} {:>7} {:>9} {:>16}",
            s.at.as_secs_f64(),
            s.target,
            s.shards,
            total,
            busiest
        );
    }
    let written = written.load(Ordering::Relaxed) as i64;
    assert_eq!(
        reader.get(counter).await.expect("total"),
        written,
        "every write counted once"
    );
    let first = samples.first().expect("samples");
    assert_eq!(first.shards, 1, "a counter starts with one shard");
    let peak = samples.last().expect("samples");
    assert!(peak.shards > 1, "the shard count never rose");
    let busiest = peak.per_shard.iter().max().copied().unwrap_or(0);
    let total: i64 = peak.per_shard.iter().sum();
    assert!(
        total > THRESHOLD as i64 * 3,
        "the load never got hot enough to need shards ({total} writes/s)"
    );
    assert!(
        busiest < THRESHOLD as i64,
        "the busiest shard still takes {busiest} writes/s at the peak"
    );
}

/// The counter's share in each group.
async fn shares(reader: &Reader, ks: &Keyspace, counter: &str) -> Vec<i64> {
    let keys: Vec<String> = (0..ks.groups())
        .map(|g| ks.counter_key(g, counter))
        .collect();
    let mut conn = reader.conn().clone();
    let values: Vec<Option<i64>> = redis::cmd("MGET")
        .arg(keys)
        .query_async(&mut conn)
        .await
        .expect("MGET");
    values.into_iter().map(Option::unwrap_or_default).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_likes_count_once_per_actor() {
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("direct-likes"), 16).expect("keyspace");
    let namespaces = Arc::new(
        Namespaces::from_toml("[namespaces.likes]\ndedup = true\nwrite_path = \"direct\"\n")
            .expect("ns"),
    );
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let writer = DirectWriter::new(conn.clone(), ks.clone(), namespaces);
    let reader = Reader::new(conn, ks);
    let post = "likes:post:1";
    assert!(writer.like(post, "u1").await.expect("like"));
    assert!(!writer.like(post, "u1").await.expect("double click"));
    assert!(writer.like(post, "u2").await.expect("like"));
    assert!(!writer.unlike(post, "u3").await.expect("unlike of nothing"));
    assert!(writer.unlike(post, "u2").await.expect("unlike"));
    assert!(
        writer.add(post, 1).await.is_err(),
        "add without an actor is refused"
    );
    assert_eq!(reader.get(post).await.expect("total"), 1);
    assert!(reader.has_liked(post, "u1").await.expect("has_liked"));
    assert!(!reader.has_liked(post, "u2").await.expect("has_liked"));
}
