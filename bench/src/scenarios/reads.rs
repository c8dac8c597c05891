//! Reads: exact and cached totals, one counter and batches, timed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tally_common::{CachedReader, Keyspace, Namespaces, Policy, Reader, RedisConn};

use crate::env::Env;
use crate::probe;
use crate::results::ReadLatency;

pub(crate) async fn reads(env: &Env<'_>) -> anyhow::Result<Vec<ReadLatency>> {
    let prefix = env.name("reads");
    let ks = Keyspace::new(prefix, 16)?;
    let conn = RedisConn::connect(&env.args.redis_url).await?;
    let feed: Vec<String> = (0..1_000).map(|i| format!("likes:post:{i}")).collect();
    let mut pipe = redis::pipe();
    for (i, counter) in feed.iter().enumerate() {
        for group in 0..4u32 {
            pipe.incr(
                ks.counter_key((i as u32 + group) % 16, counter),
                i as i64 + 1,
            )
            .ignore();
        }
    }
    pipe.query_async::<()>(&mut conn.clone()).await?;
    let cached = |ttl_ms: u64| {
        CachedReader::new(
            Reader::new(conn.clone(), ks.clone()),
            Arc::new(Namespaces::uniform(Policy {
                cache_ttl_ms: ttl_ms,
                ..Policy::default()
            })),
        )
    };
    read_latencies(
        "",
        "shared entry, lock, 16 MGETs, write back",
        cached,
        &feed,
        env.args.reads,
    )
    .await
}

/// The read latencies of one store: `cached(ttl_ms)` makes a cached reader over it, `feed` names
/// 1,000 counters it holds; each name starts with `label`, and a miss says `how` it refreshes.
pub(crate) async fn read_latencies(
    label: &str,
    how: &str,
    cached: impl Fn(u64) -> CachedReader,
    feed: &[String],
    n: usize,
) -> anyhow::Result<Vec<ReadLatency>> {
    let mut out = Vec::new();
    let hit = cached(3_600_000);
    hit.get(&feed[0]).await?;
    out.push(time(&format!("{label}get, cache hit"), n, || hit.get(&feed[0])).await?);
    // A 1 ms TTL: every read finds both levels stale and takes the whole refresh path.
    let miss = cached(1);
    out.push(
        time(&format!("{label}get, cache miss ({how})"), n, || async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            miss.get(&feed[1]).await
        })
        .await?,
    );
    hit.get_many(feed).await?;
    out.push(
        time(
            &format!("{label}get_many of 1,000, cache hit"),
            n / 10,
            || hit.get_many(feed),
        )
        .await?,
    );
    out.push(
        time(
            &format!("{label}get_many of 1,000, cache miss"),
            n / 10,
            || async {
                tokio::time::sleep(Duration::from_millis(2)).await;
                miss.get_many(feed).await
            },
        )
        .await?,
    );
    out.push(time(&format!("{label}get_exact"), n, || hit.get_exact(&feed[2])).await?);
    Ok(out)
}

/// Times `n` calls of `op`, each on its own (the 2 ms sleep of a miss measurement is not
/// counted: it runs before the clock starts, inside `op`, so it is subtracted).
pub(crate) async fn time<F, Fut, T>(name: &str, n: usize, mut op: F) -> anyhow::Result<ReadLatency>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tally_common::ReadError>>,
{
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let started = Instant::now();
        op().await?;
        samples.push(started.elapsed().as_secs_f64() * 1e6);
    }
    let sleeps = if name.contains("miss") { 2_000.0 } else { 0.0 };
    for s in &mut samples {
        *s = (*s - sleeps).max(0.0);
    }
    Ok(ReadLatency {
        name: name.to_owned(),
        p50_us: probe::quantile(&mut samples, 0.5),
        p99_us: probe::quantile(&mut samples, 0.99),
    })
}
