//! The steady state: a background load at a fixed rate, with end-to-end latency probes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tally_common::{Keyspace, Reader, RedisConn};
use tally_producer::{Producer, ProducerConfig};

use crate::env::{Env, free_port, run_capturing, stop};
use crate::probe;
use crate::results::Steady;

/// The steady state at `rate` events/s, its topic and aggregator named after `scenario` (each
/// steady scenario of a run has its own); `namespaces`, a namespace file's text, configures the
/// aggregator's namespaces (the load's counters are `likes:*`, the probes `probe:*`). With
/// `likes`, the load is likes and unlikes (15%) of 50,000 users, and each probe a like.
pub(crate) async fn steady(
    env: &mut Env<'_>,
    scenario: &str,
    rate: f64,
    namespaces: Option<&str>,
    likes: bool,
) -> anyhow::Result<Steady> {
    let topic = env.name(scenario);
    env.create_topic(&topic, env.args.partitions).await?;
    let id = env.name(&format!("{scenario}-agg"));
    let dlq = format!("{id}.dlq");
    env.create_topic(&dlq, 1).await?;
    let port = free_port()?;
    let flush_interval_ms = 1000.0;
    let interval = flush_interval_ms.to_string();
    let file = std::env::temp_dir().join(format!("{id}-namespaces.toml"));
    let mut args = vec!["--flush-interval-ms".to_owned(), interval];
    if let Some(text) = namespaces {
        std::fs::write(&file, text)?;
        let path = file.to_str().context("a UTF-8 temp path")?.to_owned();
        args.extend(["--namespaces".to_owned(), path]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut aggregator = env.aggregator(&topic, &id, &dlq, port, &args)?;
    let seconds = env.args.steady_seconds;
    let events = (rate * seconds as f64) as u64;
    let background = Command::new(env.bin("tally"))
        .args([
            "load",
            "--brokers",
            &env.args.brokers,
            "--topic",
            &topic,
            "--top",
            "0",
        ])
        .args([
            "--events",
            &events.to_string(),
            "--rate",
            &(rate as u64).to_string(),
        ])
        .args(["--counters", &env.args.counters.to_string()])
        .args(if likes {
            &["--actors", "50000", "--negative-share", "0.15"][..]
        } else {
            &[]
        })
        .stdout(Stdio::piped())
        .spawn()
        .context("tally load")?;
    let producer = Producer::new(&ProducerConfig::new(&env.args.brokers, &topic))?;
    let conn = RedisConn::connect(&env.args.redis_url).await?;
    let reader = Reader::new(conn, Keyspace::new(id.clone(), 16)?);
    // Let the aggregator join and the load ramp up before probing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut probes = Vec::new();
    let probing = Instant::now();
    let mut i = 0;
    while probing.elapsed() < Duration::from_secs(seconds.saturating_sub(5).max(5)) {
        let counter = format!("probe:{i}");
        i += 1;
        let (producer, reader) = (producer.clone(), reader.clone());
        probes.push(tokio::spawn(async move {
            if likes {
                producer.like(&counter, "probe").await?;
            } else {
                producer.add(&counter, 1).await?;
            }
            let sent = Instant::now();
            loop {
                if reader.get(&counter).await? >= 1 {
                    return anyhow::Ok(sent.elapsed().as_secs_f64() * 1000.0);
                }
                if sent.elapsed() > Duration::from_secs(30) {
                    bail!("{counter} not visible after 30 s");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut latencies = Vec::new();
    for probe in probes {
        latencies.push(probe.await??);
    }
    let (_, _, _, load_out) = run_capturing(background).await?;
    stop(&mut aggregator)?;
    let _ = std::fs::remove_file(&file);
    let achieved = load_out
        .split(": ")
        .last()
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    let mut sorted = latencies.clone();
    Ok(Steady {
        target_rate: rate,
        achieved_rate: achieved,
        flush_interval_ms,
        probes: latencies.len(),
        p50_ms: probe::quantile(&mut sorted, 0.5),
        p99_ms: probe::quantile(&mut sorted, 0.99),
        max_ms: sorted.last().copied().unwrap_or(0.0),
        latencies_ms: latencies,
    })
}
