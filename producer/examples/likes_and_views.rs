//! How a service uses tally for likes and views, on the local Kafka and Redis
//! (`deploy/local/start.sh`) with an aggregator running (`deploy/local/demo.sh` starts one, or
//! `cargo run --bin tally-aggregator -- --namespaces deploy/namespaces.example.toml`):
//!
//! ```sh
//! cargo run -p tally-producer --example likes_and_views
//! ```
//!
//! Likes count once per user and go through Kafka; views are written straight to Redis.

use std::sync::Arc;
use std::time::Duration;

use tally_common::{CachedReader, Keyspace, Namespaces, Reader, RedisConn, defaults};
use tally_producer::{Counts, DirectWriter, Producer, ProducerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let namespaces = Arc::new(Namespaces::from_toml(
        r#"
        [namespaces.likes]
        dedup = true
        cache_ttl_ms = 10000
        display_never_decreases = true

        [namespaces.views]
        write_path = "direct"
        cache_ttl_ms = 60000
        "#,
    )?);
    let redis = RedisConn::connect(defaults::REDIS_URL).await?;
    let keyspace = Keyspace::default();
    let counts = Counts::new(
        namespaces.clone(),
        Some(Producer::new(&ProducerConfig::new(
            defaults::BROKERS,
            defaults::TOPIC,
        ))?),
        Some(DirectWriter::new(
            redis.clone(),
            keyspace.clone(),
            namespaces.clone(),
        )),
        CachedReader::new(Reader::new(redis, keyspace), namespaces),
    );

    let post = "likes:post:example";
    counts.like(post, "user:7").await?; // acknowledged by Kafka
    counts.like(post, "user:7").await?; // a double click: still one like
    counts.like(post, "user:8").await?;
    counts.unlike(post, "user:8").await?;
    counts.add("views:video:example", 1).await?; // visible at once

    println!(
        "views:video:example = {}",
        counts.get_exact("views:video:example").await?
    );
    // The like goes through the aggregator: wait for its next flush.
    for _ in 0..50 {
        if counts.has_liked(post, "user:7").await? {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "{post} = {} (shown as {}), user:7 liked it: {}, user:8: {}",
        counts.get_exact(post).await?,
        counts.display(post).await?,
        counts.has_liked(post, "user:7").await?,
        counts.has_liked(post, "user:8").await?,
    );
    Ok(())
}
