//! The `tally-aggregator` binary as a process: its setup, its log, stopping and killing it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tally_common::Keyspace;
use tokio::task::JoinHandle;

use crate::http::http_get;
use crate::kafka::{brokers, create_topic};
use crate::store::RedisServer;
use crate::support::{TempDir, eventually, free_port, unique};

/// Asserts that no aggregator log under `log_dir` (every incarnation a test started) mentions
/// a cross-slot error, however redis-rs spells it.
pub fn assert_no_crossslot(log_dir: &Path) {
    for entry in std::fs::read_dir(log_dir).expect("log dir") {
        let path = entry.expect("log entry").path();
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            !log.to_lowercase().contains("crossslot"),
            "{} hit CROSSSLOT:\n{log}",
            path.display()
        );
    }
}

/// The build's directory for this profile, `target/<profile>` (under `CARGO_TARGET_DIR` when
/// that is set): the tests run from its `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// Path of a workspace binary, built by `cargo build --workspace --bins`.
pub fn binary(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins`",
        path.display()
    );
    path
}

/// Runs `tally likes-to-sets` against the Redis at `url` for the deployment `prefix` of
/// `groups` shard groups, with the writers' `namespaces` file and `extra` flags: whether it
/// succeeded, its standard output and its standard error.
pub fn likes_to_sets(
    url: &str,
    namespaces: &Path,
    prefix: &str,
    groups: u32,
    extra: &[&str],
) -> (bool, String, String) {
    let output = Command::new(binary("tally"))
        .arg("likes-to-sets")
        .arg("--namespaces")
        .arg(namespaces)
        .args(["--redis-url", url, "--key-prefix", prefix])
        .args(["--shard-groups", &groups.to_string()])
        .args(extra)
        .output()
        .expect("tally runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (
        output.status.success(),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// A running `tally-aggregator` process.
#[derive(Debug)]
pub struct AggregatorProcess {
    child: Child,
    metrics_port: u16,
    log: PathBuf,
}

/// What an aggregator under test is pointed at.
#[derive(Debug, Clone)]
pub struct AggregatorSetup {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Events topic.
    pub topic: String,
    /// Dead-letter topic.
    pub dead_letter_topic: String,
    /// Consumer group.
    pub group: String,
    /// Redis URL.
    pub redis_url: String,
    /// Key prefix.
    pub key_prefix: String,
    /// Flush interval.
    pub flush_interval_ms: u64,
    /// The cap on a failed flush's retry delay: 500 ms, so that tests recover fast; the
    /// aggregator's default is 2,000.
    pub retry_max_backoff_ms: u64,
    /// The group's session timeout: 6 s (the broker's minimum; heartbeats are 1 s by default),
    /// so that a crashed member's partitions move fast; `None` leaves the aggregator's 10 s.
    pub session_timeout_ms: Option<u64>,
}

impl AggregatorSetup {
    /// A setup with unique topic, group and prefix names, and topics created (`partitions` for
    /// events, 1 for dead letters).
    pub async fn create(name: &str, redis_url: &str, partitions: i32) -> Self {
        let setup = Self::named(&brokers(), name, redis_url);
        create_topic(&setup.topic, partitions).await;
        create_topic(&setup.dead_letter_topic, 1).await;
        setup
    }

    /// A setup on the Kafka at `bootstrap` with unique topic, group and prefix names derived from
    /// `name`; creates no topic (the caller does, where its Kafka wants it).
    pub fn named(bootstrap: &str, name: &str, redis_url: &str) -> Self {
        Self {
            brokers: bootstrap.to_owned(),
            topic: unique(&format!("{name}.events")),
            dead_letter_topic: unique(&format!("{name}.dlq")),
            group: unique(&format!("{name}-group")),
            redis_url: redis_url.to_owned(),
            key_prefix: unique(name),
            flush_interval_ms: 200,
            retry_max_backoff_ms: 500,
            session_timeout_ms: Some(6_000),
        }
    }

    /// The keyspace the aggregator writes.
    pub fn keyspace(&self) -> Keyspace {
        Keyspace::new(self.key_prefix.clone(), 16).expect("valid keyspace")
    }

    /// Starts an aggregator process with this setup and `extra` flags; its log goes to `log_dir`.
    pub fn spawn(&self, log_dir: &Path, extra: &[&str]) -> AggregatorProcess {
        self.spawn_with_env(log_dir, extra, &[])
    }

    /// Like [`AggregatorSetup::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        &self,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> AggregatorProcess {
        let log = log_dir.join(format!("aggregator-{}.log", unique("run")));
        let out = std::fs::File::create(&log).expect("log file");
        self.spawn_with_output(
            extra,
            env,
            Stdio::from(out.try_clone().expect("log file")),
            Stdio::from(out),
            log,
        )
    }

    /// Like [`AggregatorSetup::spawn`], with its stdout and stderr going to a pipe that is
    /// closed once the first line came through: every later log line fails to write.
    pub fn spawn_with_closed_output(&self) -> AggregatorProcess {
        let mut process = self.spawn_with_output(
            &[],
            &[],
            Stdio::null(),
            Stdio::piped(),
            PathBuf::from("/dev/null"),
        );
        let stderr = process.child.stderr.take().expect("piped stderr");
        let mut first = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stderr), &mut first)
            .expect("the first log line");
        assert!(!first.is_empty(), "the aggregator wrote no log line");
        process
    }

    fn spawn_with_output(
        &self,
        extra: &[&str],
        env: &[(&str, &str)],
        stdout: Stdio,
        stderr: Stdio,
        log: PathBuf,
    ) -> AggregatorProcess {
        let metrics_port = free_port();
        let session: Vec<String> = (self.session_timeout_ms.iter())
            .flat_map(|ms| {
                [
                    "--kafka-option".to_owned(),
                    format!("session.timeout.ms={ms}"),
                ]
            })
            .collect();
        let child = Command::new(binary("tally-aggregator"))
            .args(["--brokers", &self.brokers])
            .args(["--topic", &self.topic])
            .args(["--dead-letter-topic", &self.dead_letter_topic])
            .args(["--group", &self.group])
            // From the environment, not a flag: a URL with a password is refused as a flag.
            .env("TALLY_REDIS_URL", &self.redis_url)
            .args(["--key-prefix", &self.key_prefix])
            .args(["--flush-interval-ms", &self.flush_interval_ms.to_string()])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args([
                "--retry-max-backoff-ms",
                &self.retry_max_backoff_ms.to_string(),
            ])
            .args(&session)
            .args(extra)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .expect("tally-aggregator starts");
        AggregatorProcess {
            child,
            metrics_port,
            log,
        }
    }
}

/// A fault test over a namespace file: a private `redis-server`, a fresh 8-partition topic and
/// group ([`AggregatorSetup`]), a temporary directory holding the namespace file and the logs,
/// and a static group member id, so that an aggregator restarted after a SIGKILL takes its
/// partitions back at once.
#[derive(Debug)]
pub struct NamespacedSetup {
    /// The Redis server.
    pub redis: RedisServer,
    /// Holds the namespace file and every incarnation's log.
    pub dir: TempDir,
    /// The topic, group and keyspace.
    pub setup: AggregatorSetup,
    /// The namespace file's path.
    pub namespaces: String,
    /// `group.instance.id=<unique>`.
    member: String,
}

impl NamespacedSetup {
    /// Starts Redis, creates the topic and writes `namespaces` (TOML) to the file.
    pub async fn start(name: &str, namespaces: &str) -> Self {
        let redis = RedisServer::start().await;
        let dir = TempDir::new(&format!("tally-{name}"));
        let setup = AggregatorSetup::create(name, &redis.url(), 8).await;
        let path = dir.path().join("namespaces.toml");
        std::fs::write(&path, namespaces).expect("namespace file");
        Self {
            redis,
            namespaces: path.to_str().expect("utf-8 path").to_owned(),
            dir,
            setup,
            member: format!("group.instance.id={}", unique("member")),
        }
    }

    /// The aggregator's flags: the namespace file and the static member, then `extra`.
    pub fn flags<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut flags = vec![
            "--namespaces",
            &self.namespaces,
            "--kafka-option",
            &self.member,
        ];
        flags.extend_from_slice(extra);
        flags
    }
}

/// What `tally audit` printed and how it exited.
#[derive(Debug)]
pub struct AuditRun {
    /// Whether it exited 0 (no drift).
    pub clean: bool,
    /// Its standard output.
    pub stdout: String,
    /// Counters compared.
    pub checked: usize,
    /// Counters off: `(counter, stored, recounted)`, largest difference first.
    pub drift: Vec<(String, i64, i64)>,
    /// Counters left out as moving.
    pub moving: usize,
}

impl AggregatorSetup {
    /// Runs `tally audit` on this setup's topic and keyspace, with `extra` flags, and parses its
    /// report.
    pub fn audit(&self, extra: &[&str]) -> AuditRun {
        let out = Command::new(binary("tally"))
            .arg("audit")
            .args(["--brokers", &self.brokers])
            .args(["--topic", &self.topic])
            .args(["--group", &self.group])
            .env("TALLY_REDIS_URL", &self.redis_url)
            .args(["--key-prefix", &self.key_prefix])
            .args(["--top", "1000"])
            .args(extra)
            .output()
            .expect("tally audit runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "tally audit failed: {}\n{stdout}{stderr}",
            out.status
        );
        let number = |label: &str| -> usize {
            let at = stdout
                .find(label)
                .unwrap_or_else(|| panic!("{label} in {stdout}"));
            let rest = &stdout[at + label.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().expect("a number")
        };
        let drift = stdout
            .lines()
            .filter_map(|l| l.strip_prefix("drift "))
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let n = |i: usize| f[i].parse::<i64>().expect("a number");
                (f[0].to_owned(), n(2), n(4))
            })
            .collect();
        AuditRun {
            clean: out.status.success(),
            checked: number("counters checked: "),
            moving: number("left out: "),
            drift,
            stdout,
        }
    }

    /// Runs `tally audit` with `extra` flags and asserts it found no drift over exactly
    /// `counters` counters.
    pub fn assert_audit_clean(&self, extra: &[&str], counters: usize) {
        let audit = self.audit(extra);
        eprintln!("{}", audit.stdout);
        assert!(audit.clean, "no drift: {}", audit.stdout);
        assert_eq!(audit.checked, counters, "every counter checked");
    }
}

impl AggregatorProcess {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port serving its /metrics, /healthz and /readyz.
    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends `signal` (`TERM`, `STOP`, `CONT`, ...).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// SIGKILLs the process (a crash: nothing is drained or committed) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and asserts that the process drains and exits 0 within 30 s.
    pub async fn stop_gracefully(&mut self) {
        self.terminate();
        let status = self.wait_exit(Duration::from_secs(30)).await;
        assert!(
            status.success(),
            "graceful shutdown must exit 0, got {status}"
        );
    }

    /// Waits for the process to exit, for at most `timeout`; prints its log if it failed.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let status = eventually(timeout, "the aggregator to exit", || {
            let status = self.child.try_wait().expect("try_wait");
            async move { status }
        })
        .await;
        if !status.success() {
            eprintln!("aggregator exited with {status}; its log:\n{}", self.log());
        }
        status
    }

    /// The value of an un-labelled metric, or the sum over a labelled one's series.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = http_get(self.metrics_port, "/metrics").await?;
        let mut found = None;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            if metric == name {
                *found.get_or_insert(0.0) += value.parse::<f64>().ok()?;
            }
        }
        found
    }

    /// The value of one series of a labelled metric, `labels` as Prometheus prints them
    /// (`partition="3"`).
    pub async fn series(&self, name: &str, labels: &str) -> Option<f64> {
        let text = http_get(self.metrics_port, "/metrics").await?;
        let wanted = format!("{name}{{{labels}}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&wanted))
            .and_then(|v| v.parse().ok())
    }

    /// Waits until `more` flushes beyond those made so far are durable (`tally_flushes_total`).
    pub async fn wait_more_flushes(&self, more: f64, timeout: Duration) {
        let now = self.metric("tally_flushes_total").await.unwrap_or(0.0);
        self.wait_metric("tally_flushes_total", now + more, timeout)
            .await;
    }

    /// Waits until every partition `p` is durable up to `ends[p]` (`tally_durable_offset`), and
    /// returns how long that took; on timeout, panics with the end of the process's log.
    pub async fn wait_durable(&self, ends: &[i64], timeout: Duration) -> Duration {
        let started = Instant::now();
        for (partition, end) in ends.iter().enumerate() {
            let labels = format!("partition=\"{partition}\"");
            loop {
                let durable = self.series("tally_durable_offset", &labels).await;
                if durable.is_some_and(|d| d >= *end as f64) {
                    break;
                }
                if started.elapsed() >= timeout {
                    panic!(
                        "partition {partition} not durable up to {end} after {timeout:?} (at {durable:?}); log tail:\n{}",
                        self.log_tail(30)
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        started.elapsed()
    }

    /// The last `lines` lines of the process's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let tail: Vec<&str> = log.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Waits until the metric reaches at least `at_least`; on timeout, panics with the end of
    /// the process's log.
    pub async fn wait_metric(&self, name: &str, at_least: f64, timeout: Duration) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.metric(name).await;
            if let Some(v) = value.filter(|v| *v >= at_least) {
                return v;
            }
            if Instant::now() >= deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {name} >= {at_least} (last value {value:?}); log tail:\n{}",
                    self.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for AggregatorProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// SIGKILLs the aggregator `kills` times while `load` is running, restarting it each time with
/// `extra` flags; returns the last one, running, once it has made three flushes durable (so a
/// load that lasts as long as the kills can stop then). Each incarnation is killed at a random
/// moment (0 to 800 ms, from `seed`) after it has made its first flush durable, so every kill
/// lands on an aggregator that is consuming and flushing. Panics if the load ends before the
/// last kill.
pub async fn kill_repeatedly<T>(
    setup: &AggregatorSetup,
    log_dir: &Path,
    extra: &[&str],
    first: AggregatorProcess,
    kills: usize,
    seed: u64,
    load: &JoinHandle<T>,
) -> AggregatorProcess {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut aggregator = first;
    for kill in 1..=kills {
        aggregator
            .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
            .await;
        let wait = Duration::from_millis(rng.random_range(0..800));
        tokio::time::sleep(wait).await;
        assert!(
            !load.is_finished(),
            "the load ended before kill {kill} of {kills}: make it longer"
        );
        aggregator.kill();
        eprintln!("SIGKILL {kill}/{kills}, {wait:?} after its first durable flush");
        aggregator = setup.spawn(log_dir, extra);
    }
    aggregator
        .wait_metric("tally_flushes_total", 3.0, Duration::from_secs(60))
        .await;
    aggregator
}
