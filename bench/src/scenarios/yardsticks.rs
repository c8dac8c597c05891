//! The yardsticks: `kcat` consuming and producing, `redis-benchmark`, and the criterion
//! micro-benchmark of decode + aggregate.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::env::Env;
use crate::probe;
use crate::results::Throughput;

pub(crate) async fn kcat_consume(
    env: &Env<'_>,
    topic: &str,
    name: &str,
) -> anyhow::Result<Throughput> {
    println!("yardstick: {name} consuming {topic}");
    let child = Command::new("kcat")
        .args([
            "-C",
            "-b",
            &env.args.brokers,
            "-t",
            topic,
            "-o",
            "beginning",
            "-e",
            "-q",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("kcat (deploy/local/install.sh installs it)")?;
    let (stats, wall, ok) = probe::run_to_end(child).await?;
    if !ok {
        bail!("kcat -C failed");
    }
    Ok(Throughput::new(
        name,
        env.args.events,
        wall.as_secs_f64(),
        stats,
    ))
}

pub(crate) async fn kcat_produce(
    env: &Env<'_>,
    payload: usize,
    keyed: bool,
) -> anyhow::Result<Throughput> {
    let name = if keyed { "kcat -P, keyed" } else { "kcat -P" };
    let topic = env.name(if keyed { "kcat-keyed" } else { "kcat" });
    env.create_topic(&topic, env.args.partitions).await?;
    let file = env.args.out.join("kcat-input.txt");
    {
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::fs::File::create(&file)?);
        let value = "x".repeat(payload);
        let mut rng = StdRng::seed_from_u64(42);
        let zipf = rand_distr::Zipf::new(env.args.counters as f64, env.args.zipf)?;
        for _ in 0..env.args.events {
            if keyed {
                let n = rng.sample(zipf) as u64;
                writeln!(out, "likes:post:{n}\t{value}")?;
            } else {
                writeln!(out, "{value}")?;
            }
        }
        out.flush()?;
    }
    println!(
        "yardstick: {name} producing {} messages of {payload} bytes",
        env.args.events
    );
    let run = kcat_produce_file(env, name, &topic, &file, keyed).await;
    let _ = std::fs::remove_file(&file);
    run
}

/// `kcat -P` sending every line of `file` (`key<TAB>value` when `keyed`) to `topic`, with the
/// bulk producer's own settings, so that comparisons are like for like.
pub(crate) async fn kcat_produce_file(
    env: &Env<'_>,
    name: &str,
    topic: &str,
    file: &Path,
    keyed: bool,
) -> anyhow::Result<Throughput> {
    let linger = format!("linger.ms={}", tally_producer::bulk::BULK_LINGER_MS);
    let mut kcat = Command::new("kcat");
    kcat.args(["-P", "-b", &env.args.brokers, "-t", topic, "-l"]);
    if keyed {
        kcat.args(["-K", "\t"]);
    }
    let child = kcat
        .args([
            "-X",
            "enable.idempotence=true",
            "-X",
            "acks=all",
            "-X",
            &linger,
        ])
        .args([
            "-X",
            "batch.size=1000000",
            "-X",
            "batch.num.messages=100000",
            "-X",
            "compression.type=lz4",
        ])
        .args([
            "-X",
            "queue.buffering.max.messages=500000",
            "-X",
            "queue.buffering.max.kbytes=262144",
        ])
        .arg(file)
        .stderr(Stdio::inherit())
        .spawn()
        .context("kcat")?;
    let (stats, wall, ok) = probe::run_to_end(child).await?;
    if !ok {
        bail!("{name} failed");
    }
    Ok(Throughput::new(
        name,
        env.args.events,
        wall.as_secs_f64(),
        stats,
    ))
}

pub(crate) fn redis_benchmark(env: &Env<'_>) -> anyhow::Result<f64> {
    println!("yardstick: redis-benchmark, pipelined INCRBY over random keys");
    let url = redis::parse_redis_url(&env.args.redis_url).context("redis url")?;
    let host = url.host_str().unwrap_or("127.0.0.1").to_owned();
    let port = url.port().unwrap_or(6379).to_string();
    let key = format!("{}:rb:__rand_int__", env.run_id);
    let out = Command::new("redis-benchmark")
        .args([
            "-h", &host, "-p", &port, "-n", "2000000", "-P", "64", "-r", "100000", "-c", "8", "-q",
        ])
        .args(["incrby", &key, "1"])
        .output()
        .context("redis-benchmark (package redis-tools)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "incrby ...: 1234567.89 requests per second, p50=..." (the last line; progress lines end in \r)
    text.rsplit(['\n', '\r'])
        .find_map(|line| {
            let (_, rest) = line.rsplit_once(": ")?;
            rest.split(' ').next()?.parse().ok()
        })
        .with_context(|| format!("redis-benchmark output: {text}"))
}

/// The criterion microbenchmark's results, if `deploy/local/bench.sh` ran it into `out`.
pub(crate) fn micro(out: &Path) -> Vec<(String, f64)> {
    let Ok(text) = std::fs::read_to_string(out.join("micro.txt")) else {
        return Vec::new();
    };
    // criterion: "decode_aggregate/bincode" ... "thrpt:  [a Melem/s b Melem/s c Melem/s]"
    let mut results = Vec::new();
    let mut current = None;
    for line in text.lines() {
        if let Some(name) = line
            .split_whitespace()
            .next()
            .filter(|n| n.starts_with("decode_aggregate/"))
        {
            current = Some(name.trim_start_matches("decode_aggregate/").to_owned());
        }
        if let (Some(name), Some(rest)) = (&current, line.split("thrpt:").nth(1)) {
            let parts: Vec<&str> = rest
                .trim()
                .trim_matches(['[', ']'])
                .split_whitespace()
                .collect();
            // The middle estimate: parts[2] with its unit parts[3].
            if let (Some(v), Some(unit)) = (
                parts.get(2).and_then(|v| v.parse::<f64>().ok()),
                parts.get(3),
            ) {
                let scale = match *unit {
                    "Gelem/s" => 1e9,
                    "Melem/s" => 1e6,
                    "Kelem/s" => 1e3,
                    _ => 1.0,
                };
                results.push((name.clone(), v * scale));
                current = None;
            }
        }
    }
    results
}
