//! The run's shared state and tools: names, topics, the local Redis, starting the release
//! binaries and timing them to their end.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use tally_common::CounterEvent;

use crate::args::Args;
use crate::probe::{self, CommandStats, ProcStats};
use crate::results::{CatchUp, Throughput};

/// The run's shared state: names, connections.
pub(crate) struct Env<'a> {
    pub(crate) args: &'a Args,
    pub(crate) run_id: String,
    pub(crate) redis: redis::aio::MultiplexedConnection,
}

impl Env<'_> {
    pub(crate) fn bin(&self, name: &str) -> std::path::PathBuf {
        self.args.bin_dir.join(name)
    }

    pub(crate) fn name(&self, what: &str) -> String {
        format!("{}-{what}", self.run_id)
    }

    /// Runs the catch-up of [`Env::catch_up`] with `namespaces` (a namespace file's text) given
    /// to the aggregator.
    pub(crate) async fn catch_up_with_namespaces(
        &mut self,
        topic: &str,
        events: u64,
        namespaces: &str,
    ) -> anyhow::Result<CatchUp> {
        let file =
            std::env::temp_dir().join(self.name(&format!("ns-{}.toml", rand::random::<u32>())));
        std::fs::write(&file, namespaces)?;
        let path = file.to_str().context("a UTF-8 temp path")?.to_owned();
        let run = self.catch_up(topic, events, &["--namespaces", &path]).await;
        let _ = std::fs::remove_file(&file);
        run
    }

    pub(crate) async fn create_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
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
    pub(crate) async fn load(
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
    pub(crate) fn aggregator(
        &self,
        topic: &str,
        id: &str,
        dlq: &str,
        port: u16,
        extra: &[&str],
    ) -> anyhow::Result<std::process::Child> {
        self.aggregator_logged(topic, id, dlq, port, extra, id)
    }

    /// [`Env::aggregator`], logging to `aggregator-<log>.log` (members of one group each have
    /// their own).
    pub(crate) fn aggregator_logged(
        &self,
        topic: &str,
        id: &str,
        dlq: &str,
        port: u16,
        extra: &[&str],
        log: &str,
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
                    .unwrap_or_else(|_| "info,tally_aggregator::consume::flush=debug".into()),
            )
            .stderr(std::fs::File::create(
                self.args.out.join(format!("aggregator-{log}.log")),
            )?)
            .spawn()
            .context("tally-aggregator (build the release binaries: deploy/local/bench.sh)")
    }

    /// Runs `tally-aggregator` over a preloaded `topic` of `events` events until every one is
    /// flushed.
    pub(crate) async fn catch_up(
        &mut self,
        topic: &str,
        events: u64,
        extra: &[&str],
    ) -> anyhow::Result<CatchUp> {
        let id = self.catch_up_id();
        self.catch_up_as(&id, topic, events, extra).await
    }

    /// A new aggregator id (group and key prefix) for [`Env::catch_up_as`].
    pub(crate) fn catch_up_id(&self) -> String {
        self.name(&format!("agg-{}", rand::random::<u32>()))
    }

    /// [`Env::catch_up`] under group and key prefix `id`, for a caller that acts on its keys
    /// meanwhile.
    pub(crate) async fn catch_up_as(
        &mut self,
        id: &str,
        topic: &str,
        events: u64,
        extra: &[&str],
    ) -> anyhow::Result<CatchUp> {
        let id = id.to_owned();
        let dlq = format!("{id}.dlq");
        self.create_topic(&dlq, 1).await?;
        let port = free_port()?;
        let before = CommandStats::read(&mut self.redis).await?;
        let scripts = probe::ScriptLog::start(&mut self.redis).await?;
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
        let (mut script_ms, longest_ms) = scripts.finish(&mut self.redis).await?;
        stop(&mut child)?;
        let from_first = last_t - first.unwrap_or(0.0);
        let counters = metrics
            .get("tally_counter_writes_total")
            .copied()
            .unwrap_or(0.0);
        // Only top-level calls: commandstats also counts the HGETs, INCRBYs... run inside scripts.
        let requests =
            after.of(&before, "evalsha") + after.of(&before, "eval") + after.of(&before, "exec");
        let gauge = |name: &str| metrics.get(name).copied().unwrap_or(0.0);
        Ok(CatchUp {
            idempotency_ids_held: gauge("tally_idempotency_ids_held"),
            idempotency_table_bytes: gauge("tally_idempotency_bytes"),
            key_prefix: id.clone(),
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
            scripts_over_1ms: script_ms.len(),
            script_p50_ms: probe::quantile(&mut script_ms, 0.5),
            script_max_ms: script_ms.last().copied().unwrap_or(0.0).max(longest_ms),
        })
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// SIGTERM, then wait for the exit.
pub(crate) fn stop(child: &mut std::process::Child) -> anyhow::Result<()> {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    child.wait()?;
    Ok(())
}

/// Runs `child` to its end, collecting its stdout; returns its stats, wall time, success and
/// stdout.
pub(crate) async fn run_capturing(
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
pub(crate) fn payload_bytes(counters: u64) -> anyhow::Result<usize> {
    let mut total = 0;
    for i in 0..1_000u64 {
        let event = CounterEvent::new(format!("likes:post:{}", 1 + (i * 7919) % counters), 1)?
            .with_actor(format!("u{}", (i * 104_729) % 10_000))?;
        total += tally_common::codec::encode(&event).len();
    }
    Ok(total / 1_000)
}

pub(crate) fn machine() -> String {
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

/// Deletes this run's keys from the local Redis (topics stay; Kafka's retention removes them).
pub(crate) async fn cleanup(env: &mut Env<'_>) {
    delete_matching(&mut env.redis, &format!("{}*", env.run_id)).await;
}

/// Deletes the keys matching `pattern` (best effort: a failure leaves them).
pub(crate) async fn delete_matching(redis: &mut redis::aio::MultiplexedConnection, pattern: &str) {
    let mut cursor: u64 = 0;
    loop {
        let Ok((next, keys)): redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(redis)
            .await
        else {
            return;
        };
        if !keys.is_empty() {
            let _: redis::RedisResult<()> =
                redis::cmd("UNLINK").arg(&keys).query_async(redis).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}
