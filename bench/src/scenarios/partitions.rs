//! Partitions added to a live topic: a keyed stream through the producer crate (its metadata
//! refreshed every second, as a producer that must follow a growing topic is set) runs into a
//! 4-partition topic at a steady rate; mid-stream Kafka's admin API raises the topic to 8
//! partitions. Measured: the delay from `CreatePartitions` to each new partition's first durable
//! flush, and whether every total then matches what was sent.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions as AddPartitions};
use rdkafka::client::DefaultClientContext;
use tally_common::{CounterEvent, Keyspace, Reader, RedisConn};
use tally_producer::{Producer, ProducerConfig};

use crate::env::{Env, free_port, stop};
use crate::probe;
use crate::results::NewPartitions;

/// Partitions before and after.
const FROM: i32 = 4;
const TO: i32 = 8;
/// The stream: events per second, for how long, over how many counters.
const RATE: u64 = 10_000;
const SECONDS: u64 = 30;
const COUNTERS: u64 = 5_000;

pub(crate) async fn new_partitions(env: &mut Env<'_>) -> anyhow::Result<NewPartitions> {
    let topic = env.name("grow");
    env.create_topic(&topic, FROM).await?;
    let id = env.name("grow-agg");
    let dlq = format!("{id}.dlq");
    env.create_topic(&dlq, 1).await?;
    let port = free_port()?;
    let mut aggregator = env.aggregator(&topic, &id, &dlq, port, &[])?;
    let config = ProducerConfig::new(&env.args.brokers, &topic)
        .option("topic.metadata.refresh.interval.ms", "1000");
    let producer = Producer::new(&config)?;
    println!(
        "new partitions: {RATE} events/s into {FROM} partitions, {TO} after {} s",
        SECONDS / 3
    );
    let stream = tokio::spawn(async move {
        let mut sent: HashMap<String, i64> = HashMap::new();
        let mut pending = Vec::new();
        let started = tokio::time::Instant::now();
        for i in 0..RATE * SECONDS {
            let counter = format!("orders:grow:{}", i % COUNTERS);
            let event = CounterEvent::new(counter.clone(), 1)?;
            pending.push(producer.enqueue(&event).await?);
            *sent.entry(counter).or_default() += 1;
            if i % 100 == 99 {
                tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / RATE as f64))
                    .await;
            }
            if pending.len() >= 5_000 {
                for ack in pending.drain(..) {
                    ack.acked().await?;
                }
            }
        }
        for ack in pending {
            ack.acked().await?;
        }
        Ok::<_, anyhow::Error>(sent)
    });
    tokio::time::sleep(Duration::from_secs(SECONDS / 3)).await;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &env.args.brokers)
        .create()?;
    for result in admin
        .create_partitions(
            &[AddPartitions::new(&topic, TO as usize)],
            &AdminOptions::new(),
        )
        .await?
    {
        result.map_err(|(t, e)| anyhow::anyhow!("adding partitions to {t}: {e}"))?;
    }
    let added = Instant::now();
    let mut delays_s = Vec::new();
    for partition in FROM..TO {
        let wanted = format!("tally_durable_offset{{partition=\"{partition}\"}} ");
        loop {
            let text = probe::metrics_text(port).await.unwrap_or_default();
            let durable = (text.lines())
                .find_map(|l| l.strip_prefix(&wanted))
                .and_then(|v| v.trim().parse::<f64>().ok());
            if durable.is_some_and(|offset| offset > 0.0) {
                delays_s.push((partition, added.elapsed().as_secs_f64()));
                break;
            }
            if added.elapsed() > Duration::from_secs(120) {
                let _ = stop(&mut aggregator);
                bail!("partition {partition} had nothing durable 120 s after it was added");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let sent = stream.await.context("the stream task")??;
    let conn = RedisConn::connect(&env.args.redis_url).await?;
    let reader = Reader::new(conn, Keyspace::new(id.clone(), 16)?);
    let counters: Vec<&str> = sent.keys().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let exact = loop {
        let totals = reader.get_many(&counters).await?;
        let all = counters.iter().zip(&totals).all(|(c, t)| sent[*c] == *t);
        if all || Instant::now() > deadline {
            break all;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    stop(&mut aggregator)?;
    let longest_s = delays_s.iter().map(|(_, d)| *d).fold(0.0, f64::max);
    println!(
        "  first durable flushes {delays_s:?} s after CreatePartitions; totals exact: {exact}"
    );
    Ok(NewPartitions {
        from: FROM,
        to: TO,
        delays_s,
        longest_s,
        events: RATE * SECONDS,
        exact,
    })
}
