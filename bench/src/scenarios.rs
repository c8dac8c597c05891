//! Every scenario and yardstick of the benchmark, each measured on the local Kafka and Redis with
//! the release binaries, on topics and key prefixes of its own.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use serde::Serialize;
use tally_common::{CachedReader, CounterEvent, Keyspace, Namespaces, Policy, Reader, RedisConn};
use tally_producer::{Producer, ProducerConfig};

use crate::Args;
use crate::probe::{self, CommandStats, ProcStats};

/// A throughput measurement of one process.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Throughput {
    /// What ran.
    pub name: String,
    /// Events handled.
    pub events: u64,
    /// Wall time of the measured part, in seconds.
    pub seconds: f64,
    /// Events per second.
    pub events_per_second: f64,
    /// CPU seconds (user + system) of the process per million events.
    pub cpu_seconds_per_million: f64,
    /// Peak RSS of the process, MiB.
    pub peak_rss_mib: f64,
    /// Distinct counters the events went to (loads only; 0 when not known).
    pub distinct_counters: u64,
}

impl Throughput {
    fn new(name: &str, events: u64, seconds: f64, stats: ProcStats) -> Self {
        Self {
            name: name.to_owned(),
            events,
            seconds,
            events_per_second: events as f64 / seconds.max(1e-9),
            cpu_seconds_per_million: stats.cpu_seconds / (events as f64 / 1e6).max(1e-9),
            peak_rss_mib: stats.peak_rss_mib,
            distinct_counters: 0,
        }
    }
}

/// An aggregator (or naive consumer) working through a preloaded topic.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CatchUp {
    /// Rate, CPU and memory, timed from the first event consumed to the last one flushed.
    pub run: Throughput,
    /// Wall time from the process's launch to its last flush (joining the group and acquiring
    /// the partitions included), seconds: what an operator waits.
    pub seconds_from_start: f64,
    /// Events per second over that time.
    pub events_per_second_from_launch: f64,
    /// CPU seconds per million events over that time, of the Kafka broker and of redis-server
    /// (the aggregator's own is in `run`).
    pub broker_cpu_seconds_per_million: f64,
    /// The same for redis-server.
    pub redis_cpu_seconds_per_million: f64,
    /// Share of the machine's CPU time left idle over that time: a consumer that waits on its
    /// fetches (rather than on CPU) shows here.
    pub idle_share: f64,
    /// Counters written per event (`tally_counter_writes_total` / events): each distinct
    /// counter needs at least one write, so `distinct_counters / events` is its floor.
    pub counter_writes_per_event: f64,
    /// Redis commands per event, scripts' inner commands included (`INFO commandstats`).
    pub redis_commands_per_event: f64,
    /// Scripts and transactions the process sent per event (`EVALSHA`, `EVAL`, `EXEC` calls; the
    /// few plain commands, such as idle partitions' checks, are not counted).
    pub redis_requests_per_event: f64,
    /// Redis calls per command during the run, most first (`INFO commandstats`).
    pub redis_commands: Vec<(String, u64)>,
    /// Distinct counters in the topic (0 when not known): each needs at least one write, so
    /// `distinct_counters / events` is the floor of counter writes per event.
    pub distinct_counters: u64,
    /// Flush duration quantiles, ms (histogram bucket bounds).
    pub flush_p50_ms: f64,
    /// The 99th percentile.
    pub flush_p99_ms: f64,
    /// (seconds since start, events flushed per second) samples.
    pub series: Vec<(f64, f64)>,
    /// Flush duration histogram: (upper bound in seconds, flushes).
    pub flush_histogram: Vec<(f64, f64)>,
}

/// End-to-end latency under a steady load.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Steady {
    /// Background events per second asked of the producer.
    pub target_rate: f64,
    /// Background events per second it reached.
    pub achieved_rate: f64,
    /// The aggregator's flush interval, ms.
    pub flush_interval_ms: f64,
    /// Probes measured.
    pub probes: usize,
    /// Latency quantiles, ms.
    pub p50_ms: f64,
    /// The 99th percentile.
    pub p99_ms: f64,
    /// The worst.
    pub max_ms: f64,
    /// Every probe's latency, ms.
    pub latencies_ms: Vec<f64>,
}

/// Latency of one kind of read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReadLatency {
    /// What was read.
    pub name: String,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Results {
    /// When and where.
    pub machine: String,
    /// Average encoded event size, bytes (the kcat yardsticks use messages of this size).
    pub payload_bytes: usize,
    /// `kcat` consuming the preloaded topic to /dev/null.
    pub kcat_consume: Option<Throughput>,
    /// `kcat` consuming the JSON topic to /dev/null.
    pub kcat_consume_json: Option<Throughput>,
    /// `kcat -P -K` writing the JSON topic from a file (an independent producer).
    pub kcat_produce_json: Option<Throughput>,
    /// The aggregator (exactly-once) catching up on the JSON topic.
    pub catch_up_json: Option<CatchUp>,
    /// `kcat` producing as many same-sized messages.
    pub kcat_produce: Option<Throughput>,
    /// The same with keys: the counter ids of `tally load` (same Zipf), spread over the
    /// partitions by key as routing by counter does; what librdkafka itself makes of keyed traffic.
    pub kcat_produce_keyed: Option<Throughput>,
    /// `redis-benchmark`: pipelined `INCRBY` over random keys, per second.
    pub redis_incrby_per_second: Option<f64>,
    /// `tally load` per routing.
    pub producer: Vec<Throughput>,
    /// The aggregator catching up, per delivery mode.
    pub catch_up: Vec<(String, CatchUp)>,
    /// The naive consumer.
    pub naive: Option<CatchUp>,
    /// Steady state and end-to-end latency.
    pub steady: Option<Steady>,
    /// 90% of events on one counter.
    pub hot: Option<CatchUp>,
    /// One event per counter, a million counters.
    pub cardinality: Option<CatchUp>,
    /// Reads.
    pub reads: Vec<ReadLatency>,
    /// Decode + aggregate on one core (criterion), events per second, per format.
    pub micro: Vec<(String, f64)>,
}

impl Results {
    /// The aggregator's catch-up in exactly-once mode, if it ran.
    pub fn exactly_once(&self) -> Option<&CatchUp> {
        self.catch_up
            .iter()
            .find(|(mode, _)| mode == "exactly-once")
            .map(|(_, c)| c)
    }
}

/// The run's shared state: names, connections.
struct Env<'a> {
    args: &'a Args,
    run_id: String,
    redis: redis::aio::MultiplexedConnection,
}

impl Env<'_> {
    fn bin(&self, name: &str) -> std::path::PathBuf {
        self.args.bin_dir.join(name)
    }

    fn name(&self, what: &str) -> String {
        format!("{}-{what}", self.run_id)
    }

    async fn create_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.args.brokers)
            .create()?;
        for result in admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().request_timeout(Some(Duration::from_secs(20))),
            )
            .await
            .with_context(|| format!("Kafka at {} (deploy/local/start.sh)", self.args.brokers))?
        {
            result.map_err(|(t, e)| anyhow::anyhow!("creating {t}: {e}"))?;
        }
        Ok(())
    }

    /// `tally load` into `topic`; returns what it reports and measures.
    async fn load(
        &self,
        topic: &str,
        name: &str,
        events: u64,
        extra: &[&str],
    ) -> anyhow::Result<Throughput> {
        let child = Command::new(self.bin("tally"))
            .args([
                "load",
                "--brokers",
                &self.args.brokers,
                "--topic",
                topic,
                "--top",
                "0",
            ])
            .args(["--events", &events.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("tally load (build the release binaries: deploy/local/bench.sh)")?;
        let (stats, _wall, ok, stdout) = run_capturing(child).await?;
        if !ok {
            bail!("tally load failed: {stdout}");
        }
        // "sent <acked> events (<failed> failed) over <n> counters to <topic> in <s>s: <r> events/s"
        let seconds: f64 = stdout
            .split(" in ")
            .nth(1)
            .and_then(|s| s.split('s').next())
            .and_then(|s| s.parse().ok())
            .context("tally load's summary")?;
        let acked: u64 = stdout
            .strip_prefix("sent ")
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .context("tally load's summary")?;
        let distinct_counters = stdout
            .split(" over ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .context("tally load's summary")?;
        Ok(Throughput {
            distinct_counters,
            ..Throughput::new(name, acked, seconds, stats)
        })
    }

    /// Starts `tally-aggregator` on `topic` with group and key prefix `id`, metrics on `port`.
    fn aggregator(
        &self,
        topic: &str,
        id: &str,
        dlq: &str,
        port: u16,
        extra: &[&str],
    ) -> anyhow::Result<std::process::Child> {
        let metrics = format!("127.0.0.1:{port}");
        Command::new(self.bin("tally-aggregator"))
            .args(["--brokers", &self.args.brokers, "--topic", topic])
            .args([
                "--dead-letter-topic",
                dlq,
                "--group",
                id,
                "--key-prefix",
                id,
            ])
            .args([
                "--redis-url",
                &self.args.redis_url,
                "--metrics-addr",
                &metrics,
            ])
            .args(extra)
            .args(&self.args.aggregator_args)
            .stdout(Stdio::null())
            // Kept for a look afterwards, with every flush's events, writes and duration.
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG")
                    .unwrap_or_else(|_| "info,tally_aggregator::flush=debug".into()),
            )
            .stderr(std::fs::File::create(
                self.args.out.join(format!("aggregator-{id}.log")),
            )?)
            .spawn()
            .context("tally-aggregator (build the release binaries: deploy/local/bench.sh)")
    }

    /// Runs `tally-aggregator` over a preloaded `topic` of `events` events until every one is
    /// flushed.
    async fn catch_up(
        &mut self,
        topic: &str,
        events: u64,
        extra: &[&str],
    ) -> anyhow::Result<CatchUp> {
        let id = self.name(&format!("agg-{}", rand::random::<u32>()));
        let dlq = format!("{id}.dlq");
        self.create_topic(&dlq, 1).await?;
        let port = free_port()?;
        let before = CommandStats::read(&mut self.redis).await?;
        let (broker_cpu, redis_cpu) = (
            probe::cpu_seconds_matching("kafka.Kafka"),
            probe::cpu_seconds_matching("redis-server"),
        );
        let machine = probe::machine_ticks();
        let started = Instant::now();
        let mut child = self.aggregator(topic, &id, &dlq, port, extra)?;
        let pid = child.id();
        let mut series = Vec::new();
        let (mut first, mut last_flushed, mut last_t) = (None, 0.0, 0.0);
        let mut stats = ProcStats::default();
        let metrics = loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(status) = child.try_wait()? {
                bail!("tally-aggregator exited early: {status}");
            }
            if started.elapsed() > Duration::from_secs(900) {
                let _ = child.kill();
                bail!("the aggregator did not catch up within 15 minutes");
            }
            let Ok(m) = probe::metrics(port).await else {
                continue;
            };
            if let Some(s) = probe::proc_stats(pid) {
                stats = s;
            }
            let t = started.elapsed().as_secs_f64();
            let consumed = m.get("tally_events_consumed_total").copied().unwrap_or(0.0);
            let flushed = m.get("tally_events_flushed_total").copied().unwrap_or(0.0);
            if first.is_none() && consumed > 0.0 {
                first = Some(t);
            }
            // One point per quarter second at most: the samples come every 50 ms.
            if t >= last_t + 0.25 || flushed >= events as f64 {
                series.push((t, (flushed - last_flushed) / (t - last_t)));
                (last_flushed, last_t) = (flushed, t);
            }
            if flushed >= events as f64 {
                break m;
            }
        };
        let from_launch = started.elapsed().as_secs_f64();
        let millions = events as f64 / 1e6;
        let broker_cpu = (probe::cpu_seconds_matching("kafka.Kafka") - broker_cpu) / millions;
        let redis_cpu = (probe::cpu_seconds_matching("redis-server") - redis_cpu) / millions;
        let idle_share = match (machine, probe::machine_ticks()) {
            (Some((idle0, total0)), Some((idle1, total1))) if total1 > total0 => {
                (idle1 - idle0) as f64 / (total1 - total0) as f64
            }
            _ => 0.0,
        };
        let after = CommandStats::read(&mut self.redis).await?;
        stop(&mut child)?;
        let from_first = last_t - first.unwrap_or(0.0);
        let counters = metrics
            .get("tally_counter_writes_total")
            .copied()
            .unwrap_or(0.0);
        // Only top-level calls: commandstats also counts the HGETs, INCRBYs... run inside scripts.
        let requests =
            after.of(&before, "evalsha") + after.of(&before, "eval") + after.of(&before, "exec");
        Ok(CatchUp {
            run: Throughput::new(topic, events, from_first, stats),
            seconds_from_start: from_launch,
            events_per_second_from_launch: events as f64 / from_launch,
            broker_cpu_seconds_per_million: broker_cpu,
            redis_cpu_seconds_per_million: redis_cpu,
            idle_share,
            counter_writes_per_event: counters / events as f64,
            redis_commands_per_event: after.since(&before) as f64 / events as f64,
            redis_requests_per_event: requests as f64 / events as f64,
            redis_commands: after.breakdown(&before),
            distinct_counters: 0,
            flush_p50_ms: probe::histogram_quantile(&metrics, "tally_flush_duration_seconds", 0.5)
                .unwrap_or(0.0)
                * 1000.0,
            flush_p99_ms: probe::histogram_quantile(&metrics, "tally_flush_duration_seconds", 0.99)
                .unwrap_or(0.0)
                * 1000.0,
            series,
            flush_histogram: probe::histogram_buckets(&metrics, "tally_flush_duration_seconds"),
        })
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// SIGTERM, then wait for the exit.
fn stop(child: &mut std::process::Child) -> anyhow::Result<()> {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    child.wait()?;
    Ok(())
}

/// Runs `child` to its end, collecting its stdout; returns its stats, wall time, success and
/// stdout.
async fn run_capturing(
    mut child: std::process::Child,
) -> anyhow::Result<(ProcStats, Duration, bool, String)> {
    let mut stdout = child.stdout.take().context("piped stdout")?;
    let copier = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let (stats, wall, ok) = probe::run_to_end(child).await?;
    let text = copier.join().unwrap_or_default();
    Ok((stats, wall, ok, text.trim().to_owned()))
}

/// The average encoded size of the events `tally load` sends.
fn payload_bytes(counters: u64) -> anyhow::Result<usize> {
    let mut total = 0;
    for i in 0..1_000u64 {
        let event = CounterEvent::new(format!("likes:post:{}", 1 + (i * 7919) % counters), 1)?
            .with_actor(format!("u{}", (i * 104_729) % 10_000))?;
        total += tally_common::codec::encode(&event).len();
    }
    Ok(total / 1_000)
}

/// Runs every scenario the arguments ask for.
pub async fn run_all(args: &Args) -> anyhow::Result<Results> {
    let client = redis::Client::open(args.redis_url.as_str())?;
    let redis = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("Redis at {} (deploy/local/start.sh)", args.redis_url))?;
    let mut env = Env {
        args,
        run_id: format!(
            "bench-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
        ),
        redis,
    };
    let mut results = Results {
        machine: machine(),
        payload_bytes: payload_bytes(args.counters)?,
        ..Results::default()
    };
    let zipf = args.zipf.to_string();
    let counters = args.counters.to_string();
    let preloaded = env.name("events");
    let needs_preload = ["producer", "catch-up", "naive", "yardsticks"]
        .iter()
        .any(|s| args.runs(s));
    if needs_preload {
        for routing in ["counter", "actor", "random"] {
            if routing != "counter" && !args.runs("producer") {
                continue;
            }
            let topic = if routing == "counter" {
                preloaded.clone()
            } else {
                env.name(&format!("events-{routing}"))
            };
            env.create_topic(&topic, args.partitions).await?;
            println!("producer: {} events, routing by {routing}", args.events);
            let run = env
                .load(
                    &topic,
                    &format!("tally load, routing by {routing}"),
                    args.events,
                    &[
                        "--counters",
                        &counters,
                        "--zipf",
                        &zipf,
                        "--routing",
                        routing,
                    ],
                )
                .await?;
            println!("  {:.0} events/s", run.events_per_second);
            results.producer.push(run);
        }
    }
    if args.runs("yardsticks") {
        results.kcat_consume = Some(kcat_consume(&env, &preloaded, "kcat -C").await?);
        results.kcat_produce = Some(kcat_produce(&env, results.payload_bytes, false).await?);
        results.kcat_produce_keyed = Some(kcat_produce(&env, results.payload_bytes, true).await?);
        results.redis_incrby_per_second = Some(redis_benchmark(&env)?);
    }
    if args.runs("catch-up") {
        for mode in ["exactly-once", "at-least-once"] {
            println!(
                "catch-up: the aggregator, {mode}, over {} events",
                args.events
            );
            let mut run = env
                .catch_up(&preloaded, args.events, &["--delivery", mode])
                .await?;
            // The preload is the producer run routing by counter (same seed, same counters).
            run.distinct_counters = results.producer.first().map_or(0, |p| p.distinct_counters);
            println!(
                "  {:.0} events/s from launch",
                run.events_per_second_from_launch
            );
            results.catch_up.push((mode.to_owned(), run));
        }
    }
    if args.runs("json") {
        json_catch_up(&mut env, &mut results).await?;
    }
    if args.runs("naive") {
        println!("catch-up: the naive consumer, for {} s", args.naive_seconds);
        results.naive = Some(naive(&mut env, &preloaded).await?);
    }
    if args.runs("steady") {
        // Half of what the pipeline sustains: its slower stage, the producer or the
        // aggregator catching up in exactly-once mode (both measured above in this run).
        let producer = results.producer.first().map(|p| p.events_per_second);
        let aggregator = results.exactly_once().map(|c| c.run.events_per_second);
        let max = [producer, aggregator]
            .into_iter()
            .flatten()
            .reduce(f64::min)
            .unwrap_or(400_000.0);
        let rate = args.steady_rate.unwrap_or(max / 2.0);
        println!("steady state at {rate:.0} events/s, with latency probes");
        results.steady = Some(steady(&mut env, rate).await?);
    }
    if args.runs("hot") {
        let topic = env.name("hot");
        env.create_topic(&topic, args.partitions).await?;
        println!(
            "hot counter: {} events, 90% on one counter",
            args.hot_events
        );
        let load = env
            .load(
                &topic,
                "hot",
                args.hot_events,
                &[
                    "--counters",
                    &counters,
                    "--zipf",
                    &zipf,
                    "--hot-share",
                    "0.9",
                ],
            )
            .await?;
        let mut hot = env.catch_up(&topic, args.hot_events, &[]).await?;
        hot.distinct_counters = load.distinct_counters;
        results.hot = Some(hot);
    }
    if args.runs("cardinality") {
        let topic = env.name("distinct");
        env.create_topic(&topic, args.partitions).await?;
        println!("cardinality: {} distinct counters", args.distinct);
        env.load(
            &topic,
            "distinct",
            args.distinct,
            &["--distinct", "--actors", "0"],
        )
        .await?;
        results.cardinality = Some(env.catch_up(&topic, args.distinct, &[]).await?);
    }
    if args.runs("reads") {
        println!("reads");
        results.reads = reads(&env).await?;
    }
    if args.runs("micro") {
        results.micro = micro(&args.out);
    }
    cleanup(&mut env).await;
    Ok(results)
}

fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_default();
    format!("{cores} cores, {cpu}")
}

async fn kcat_consume(env: &Env<'_>, topic: &str, name: &str) -> anyhow::Result<Throughput> {
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

async fn kcat_produce(env: &Env<'_>, payload: usize, keyed: bool) -> anyhow::Result<Throughput> {
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
async fn kcat_produce_file(
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

/// Writes `events` JSON events in the documented wire format as `key<TAB>value` lines, keyed by
/// counter id (Zipf over `counters`), a quarter each with every field, an actor only, a delta
/// and a time, and the counter alone; returns how many distinct counters they name.
fn write_json_events(path: &Path, args: &Args) -> anyhow::Result<u64> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut rng = StdRng::seed_from_u64(7);
    let zipf = rand_distr::Zipf::new(args.counters as f64, args.zipf)?;
    let mut seen = vec![false; args.counters as usize + 1];
    let ts = 1_764_460_800_000u64;
    for i in 0..args.events {
        let n = rng.sample(zipf) as usize;
        seen[n.min(args.counters as usize)] = true;
        let actor = i % 9_973;
        let counter = format!("likes:post:{n}");
        match i % 4 {
            0 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","delta":1,"actor":"u{actor}","ts_ms":{}}}"#,
                ts + i
            )?,
            1 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","actor":"u{actor}"}}"#
            )?,
            2 => writeln!(
                out,
                r#"{counter}	{{"counter":"{counter}","delta":2,"ts_ms":{}}}"#,
                ts + i
            )?,
            _ => writeln!(out, r#"{counter}	{{"counter":"{counter}"}}"#)?,
        }
    }
    out.flush()?;
    Ok(seen.iter().filter(|s| **s).count() as u64)
}

/// JSON from an independent producer: `kcat -P -K` writes a topic of JSON events, `kcat -C`
/// reads it (the yardstick), then the aggregator (exactly-once, default settings) catches up.
async fn json_catch_up(env: &mut Env<'_>, results: &mut Results) -> anyhow::Result<()> {
    let topic = env.name("events-json");
    env.create_topic(&topic, env.args.partitions).await?;
    let file = env.args.out.join("json-events.txt");
    let distinct = write_json_events(&file, env.args)?;
    println!(
        "JSON: kcat -P -K writing {} JSON events over {distinct} counters",
        env.args.events
    );
    let produced = kcat_produce_file(env, "kcat -P, JSON keyed", &topic, &file, true).await;
    let _ = std::fs::remove_file(&file);
    results.kcat_produce_json = Some(produced?);
    results.kcat_consume_json = Some(kcat_consume(env, &topic, "kcat -C, JSON").await?);
    println!(
        "catch-up: the aggregator, exactly-once, over {} JSON events",
        env.args.events
    );
    let mut run = env
        .catch_up(&topic, env.args.events, &["--delivery", "exactly-once"])
        .await?;
    run.distinct_counters = distinct;
    println!(
        "  {:.0} events/s from launch",
        run.events_per_second_from_launch
    );
    results.catch_up_json = Some(run);
    Ok(())
}

fn redis_benchmark(env: &Env<'_>) -> anyhow::Result<f64> {
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

async fn naive(env: &mut Env<'_>, topic: &str) -> anyhow::Result<CatchUp> {
    let id = env.name("naive");
    let before = CommandStats::read(&mut env.redis).await?;
    let started = Instant::now();
    let child = Command::new(env.bin("tally-naive"))
        .args([
            "--brokers",
            &env.args.brokers,
            "--topic",
            topic,
            "--group",
            &id,
        ])
        .args(["--redis-url", &env.args.redis_url, "--key-prefix", &id])
        .args(["--events", &env.args.events.to_string()])
        .args(["--seconds", &env.args.naive_seconds.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .context("tally-naive")?;
    let (stats, _, ok, stdout) = run_capturing(child).await?;
    if !ok {
        bail!("tally-naive failed: {stdout}");
    }
    let after = CommandStats::read(&mut env.redis).await?;
    let done = stdout.lines().last().unwrap_or_default();
    let mut parts = done.split(' ').skip(1);
    let events: u64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .context("naive summary")?;
    let seconds: f64 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .context("naive summary")?;
    println!("  {:.0} events/s", events as f64 / seconds.max(1e-9));
    Ok(CatchUp {
        run: Throughput::new("tally-naive", events, seconds, stats),
        seconds_from_start: started.elapsed().as_secs_f64(),
        redis_commands_per_event: after.since(&before) as f64 / events.max(1) as f64,
        redis_requests_per_event: after.since(&before) as f64 / events.max(1) as f64,
        ..CatchUp::default()
    })
}

async fn steady(env: &mut Env<'_>, rate: f64) -> anyhow::Result<Steady> {
    let topic = env.name("steady");
    env.create_topic(&topic, env.args.partitions).await?;
    let id = env.name("steady-agg");
    let dlq = format!("{id}.dlq");
    env.create_topic(&dlq, 1).await?;
    let port = free_port()?;
    let flush_interval_ms = 1000.0;
    let interval = flush_interval_ms.to_string();
    let mut aggregator =
        env.aggregator(&topic, &id, &dlq, port, &["--flush-interval-ms", &interval])?;
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
            producer.add(&counter, 1).await?;
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

async fn reads(env: &Env<'_>) -> anyhow::Result<Vec<ReadLatency>> {
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
    let n = env.args.reads;
    let mut out = Vec::new();
    let hit = cached(3_600_000);
    hit.get(&feed[0]).await?;
    out.push(time("get, cache hit", n, || hit.get(&feed[0])).await?);
    // A 1 ms TTL: every read finds both levels stale and takes the whole refresh path.
    let miss = cached(1);
    out.push(
        time(
            "get, cache miss (shared entry, lock, 16 MGETs, write back)",
            n,
            || async {
                tokio::time::sleep(Duration::from_millis(2)).await;
                miss.get(&feed[1]).await
            },
        )
        .await?,
    );
    hit.get_many(&feed).await?;
    out.push(
        time("get_many of 1,000, cache hit", n / 10, || {
            hit.get_many(&feed)
        })
        .await?,
    );
    out.push(
        time("get_many of 1,000, cache miss", n / 10, || async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            miss.get_many(&feed).await
        })
        .await?,
    );
    out.push(time("get_exact", n, || hit.get_exact(&feed[2])).await?);
    Ok(out)
}

/// Times `n` calls of `op`, each on its own (the 2 ms sleep of a miss measurement is not
/// counted: it runs before the clock starts, inside `op`, so it is subtracted).
async fn time<F, Fut, T>(name: &str, n: usize, mut op: F) -> anyhow::Result<ReadLatency>
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

/// The criterion microbenchmark's results, if `deploy/local/bench.sh` ran it into `out`.
fn micro(out: &Path) -> Vec<(String, f64)> {
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

/// Deletes this run's keys from the local Redis (topics stay; Kafka's retention removes them).
async fn cleanup(env: &mut Env<'_>) {
    let pattern = format!("{}*", env.run_id);
    let mut cursor: u64 = 0;
    loop {
        let Ok((next, keys)): redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut env.redis)
            .await
        else {
            return;
        };
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut env.redis)
                .await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}
