//! Helpers for tally's end-to-end tests: real Kafka, real `redis-server` processes, and the real
//! `tally-aggregator` binary.
//!
//! Kafka is the broker started by `deploy/local/start.sh` (or any broker named by
//! `TALLY_TEST_BROKERS`); tests fail loudly, saying what to start, when it is not there. Each test
//! starts its own `redis-server` on a free port in its own directory, creates its own topics and
//! uses its own consumer group and key prefix, so tests never interfere.
//!
//! The binaries must be built first (`cargo build --workspace --bins`); the README's test command
//! does that.

pub mod kafka_cluster;
pub mod prometheus;
pub mod scenarios;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tally_cli::load::{self, LoadError, LoadReport, LoadSpec};
use tally_common::{Keyspace, Reader, RedisConn};
use tally_producer::ProducerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// The Kafka brokers the tests use.
pub fn brokers() -> String {
    std::env::var("TALLY_TEST_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// Serializes the heavy tests of one test binary: cargo runs a binary's tests on parallel
/// threads, and two fault scenarios at once would fight over the machine's two cores.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// The seed of a test's randomness: `TALLY_TEST_SEED` if set (to replay a failure), else a fresh
/// one. Printed either way, so a failing run can be replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("TALLY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("test seed: {seed} (replay with TALLY_TEST_SEED={seed})");
    seed
}

/// A name no other test (or earlier run) uses: `<base>-<pid>-<n>-<random>`.
pub fn unique(base: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{base}-{}-{}-{:08x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    )
}

/// A multiplexed connection to the Redis server at `url` (a plain `redis://` URL), or `None`
/// if it does not answer.
pub async fn try_connect(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).ok()?;
    client.get_multiplexed_async_connection().await.ok()
}

/// A multiplexed connection to the Redis server at `url`; panics if it does not answer.
pub async fn connect(url: &str) -> redis::aio::MultiplexedConnection {
    try_connect(url)
        .await
        .unwrap_or_else(|| panic!("no Redis answers at {url}"))
}

/// A reader of `keyspace` over `url` (standalone `redis://` or `redis+cluster://`).
pub async fn reader(url: &str, keyspace: Keyspace) -> Reader {
    Reader::new(
        RedisConn::connect(url).await.expect("redis target"),
        keyspace,
    )
}

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

/// Ports handed out by [`free_port`]: below Linux's ephemeral range (32768-60999 by default),
/// and low enough that a Redis Cluster bus port (`port + 10000`) stays below it too.
const TEST_PORTS: std::ops::Range<u32> = 20_000..22_768;

/// Ports already handed out by this process.
static PORTS_HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// A free TCP port on loopback, never the same one twice in a process.
///
/// Not `bind(0)`: that returns an ephemeral port, which the kernel may also give to any outgoing
/// connection (a client of another test running in parallel) between our check and the server's
/// own bind; a Kafka node then fails to start with "Address already in use".
pub fn free_port() -> u16 {
    let span = TEST_PORTS.end - TEST_PORTS.start;
    // Processes started one after another begin at different places in the range.
    let start = std::process::id().wrapping_mul(97) % span;
    for _ in 0..span {
        let n = PORTS_HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(TEST_PORTS.start + (start + n) % span).expect("range fits u16");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {TEST_PORTS:?}");
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after `timeout` with `what`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates `topic` with `partitions` partitions; fails loudly if Kafka is not reachable.
pub async fn create_topic(topic: &str, partitions: i32) {
    create_topic_on(&brokers(), topic, partitions).await;
}

/// Creates `topic` with `partitions` partitions (replication factor 1) on the Kafka at
/// `bootstrap`; fails loudly if it is not reachable.
pub async fn create_topic_on(bootstrap: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(20))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Kafka is not reachable at {bootstrap} ({e}): start it with deploy/local/start.sh"
            )
        });
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("cannot create topic {t}: {e}"));
    }
}

/// Raises `topic`'s partition count to `partitions` on the Kafka the tests use.
pub async fn add_partitions(topic: &str, partitions: usize) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let results = admin
        .create_partitions(
            &[rdkafka::admin::NewPartitions::new(topic, partitions)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(20))),
        )
        .await
        .expect("Kafka answers CreatePartitions");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("cannot add partitions to {t}: {e}"));
    }
}

/// Partitions of `topic` (`0..partitions`) whose committed offset for `group` is not the
/// partition's end, as `(partition, committed, end)`.
pub fn uncommitted(group: &str, topic: &str, partitions: i32) -> Vec<(i32, Option<Offset>, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .filter_map(|p| {
            let offset = committed.find_partition(topic, p).map(|e| e.offset());
            let (_, end) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            (offset != Some(Offset::Offset(end))).then_some((p, offset, end))
        })
        .collect()
}

/// Asserts that `group` has committed every partition of `topic` up to the partition's end:
/// nothing is left to re-read, malformed messages included.
pub fn assert_committed_to_end(group: &str, topic: &str, partitions: i32) {
    let behind = uncommitted(group, topic, partitions);
    assert!(
        behind.is_empty(),
        "partitions of {topic} not committed to their end (partition, committed, end): {behind:?}"
    );
}

/// Waits until `group` has committed every partition of `topic` up to its end.
pub async fn wait_committed_to_end(group: &str, topic: &str, partitions: i32, timeout: Duration) {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    eventually(timeout, "offsets committed to the end", || {
        let (group, topic) = (group.clone(), topic.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                uncommitted(&group, &topic, partitions)
                    .is_empty()
                    .then_some(())
            })
            .await
            .ok()
            .flatten()
        }
    })
    .await;
}

/// Compares Redis with the ground truth: (counters below it, counters above it).
pub async fn below_and_above(reader: &Reader, expected: &HashMap<String, i64>) -> (usize, usize) {
    let counters: Vec<&String> = expected.keys().collect();
    let (mut below, mut above) = (0, 0);
    for chunk in counters.chunks(2000) {
        let values = reader.get_many(chunk).await.expect("read totals");
        for (counter, got) in chunk.iter().zip(values) {
            match got.cmp(&expected[*counter]) {
                std::cmp::Ordering::Less => below += 1,
                std::cmp::Ordering::Greater => above += 1,
                std::cmp::Ordering::Equal => {}
            }
        }
    }
    (below, above)
}

/// Starts sending `spec` to `topic` through the producer crate in the background.
pub fn start_load(topic: &str, spec: LoadSpec) -> JoinHandle<Result<LoadReport, LoadError>> {
    start_load_on(&brokers(), topic, spec)
}

/// Like [`start_load`], on the Kafka at `bootstrap`.
pub fn start_load_on(
    bootstrap: &str,
    topic: &str,
    spec: LoadSpec,
) -> JoinHandle<Result<LoadReport, LoadError>> {
    start_load_with(ProducerConfig::new(bootstrap, topic), spec)
}

/// Like [`start_load`], through a producer built from `config`.
pub fn start_load_with(
    config: ProducerConfig,
    spec: LoadSpec,
) -> JoinHandle<Result<LoadReport, LoadError>> {
    tokio::spawn(async move { load::run(&config, &spec).await })
}

/// Waits for a load started by [`start_load`] and checks that Kafka acknowledged every event.
pub async fn finish_load(
    load: JoinHandle<Result<LoadReport, LoadError>>,
    events: u64,
) -> LoadReport {
    let report = load.await.expect("load task").expect("load runs");
    assert_eq!(
        report.acked, events,
        "every event acknowledged: {:?}",
        report.first_error
    );
    report
}

/// A message read back from a dead-letter topic.
#[derive(Debug, Clone)]
pub struct SeenDeadLetter {
    /// Its key.
    pub key: Vec<u8>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The `tally-reason` header.
    pub reason: String,
    /// The `tally-error` header.
    pub error: String,
}

/// Reads `topic` from the start, handing each message to `each`, until `n` messages arrived (or
/// 30 s passed); returns how many arrived.
fn read_from_start(
    topic: &str,
    n: usize,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> usize {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", unique("reader"))
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen < n && Instant::now() < deadline {
        if let Some(message) = consumer.poll(Duration::from_millis(500)) {
            each(&message.expect("message"));
            seen += 1;
        }
    }
    seen
}

/// Reads the dead-letter `topic` from the start until `n` messages arrived (or 30 s passed).
pub fn read_dead_letters(topic: &str, n: usize) -> Vec<SeenDeadLetter> {
    use rdkafka::message::{Headers, Message};
    let header = |m: &rdkafka::message::BorrowedMessage<'_>, name: &str| {
        m.headers()
            .and_then(|h| h.iter().find(|h| h.key == name))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_else(|| panic!("dead letter without a {name} header"))
    };
    let mut seen = Vec::new();
    read_from_start(topic, n, |message| {
        seen.push(SeenDeadLetter {
            key: message.key().unwrap_or_default().to_vec(),
            payload: message.payload().unwrap_or_default().to_vec(),
            reason: header(message, "tally-reason"),
            error: header(message, "tally-error"),
        });
    });
    seen
}

/// Reads the `n` events of `topic` and sums them per counter; panics if fewer arrive in 30 s or
/// one does not decode.
pub fn topic_totals(topic: &str, n: usize) -> HashMap<String, i64> {
    use rdkafka::message::Message;
    let mut totals = HashMap::new();
    let read = read_from_start(topic, n, |message| {
        let event = tally_common::codec::decode(
            message.payload().unwrap_or_default(),
            tally_common::codec::DEFAULT_MAX_MESSAGE_BYTES,
        )
        .expect("the producer writes valid events");
        *totals.entry(event.counter.into_owned()).or_default() += event.delta;
    });
    assert_eq!(read, n, "events read back from {topic}");
    totals
}

/// Where a test keeps its files; removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system temp dir.
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&path).expect("temp dir");
        Self(path)
    }
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A private `redis-server` on a free loopback port, with an append-only file so that a
/// stop and restart keeps its data.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// `appendfsync` policy: `always`, or `everysec` to let a crash lose about a second.
    fsync: &'static str,
}

impl RedisServer {
    /// Starts a server that fsyncs every write, and waits until it answers.
    pub async fn start() -> Self {
        Self::start_with_fsync("always").await
    }

    /// Starts a server with the given `appendfsync` policy, and waits until it answers.
    pub async fn start_with_fsync(fsync: &'static str) -> Self {
        let mut server = Self {
            port: free_port(),
            dir: TempDir::new("tally-redis"),
            child: None,
            fsync,
        };
        server.start_again().await;
        server
    }

    /// Saves a point-in-time snapshot (`SAVE`) that [`RedisServer::restore_snapshot`] can go back to.
    pub async fn snapshot(&self) {
        let mut conn = connect(&self.url()).await;
        redis::cmd("SAVE")
            .query_async::<()>(&mut conn)
            .await
            .expect("SAVE");
        std::fs::copy(
            self.dir.path().join("dump.rdb"),
            self.dir.path().join("snapshot.rdb"),
        )
        .expect("snapshot copied");
    }

    /// SIGKILLs the server and brings it back with the state of the last snapshot, as a failover
    /// to a lagging replica or a restore from backup would: every write since is gone, counters
    /// and bookkeeping alike.
    pub async fn restore_snapshot(&mut self) {
        self.kill().await;
        let dir = self.dir.path();
        let _ = std::fs::remove_dir_all(dir.join("appendonlydir"));
        std::fs::copy(dir.join("snapshot.rdb"), dir.join("dump.rdb")).expect("snapshot restored");
        // Redis 7 starts empty when AOF is on and no AOF exists: load the RDB, then turn AOF on.
        self.spawn_and_wait("no").await;
        let mut conn = connect(&self.url()).await;
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("appendonly")
            .arg("yes")
            .query_async::<()>(&mut conn)
            .await
            .expect("CONFIG SET appendonly yes");
    }

    /// SIGKILLs the server (a crash: with `everysec`, up to a second of writes is lost).
    pub async fn kill(&mut self) {
        let mut child = self.child.take().expect("redis-server is not running");
        let _ = child.kill();
        let _ = tokio::task::spawn_blocking(move || child.wait()).await;
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the process on the same port and directory, and waits until it answers.
    pub async fn start_again(&mut self) {
        self.spawn_and_wait("yes").await;
    }

    async fn spawn_and_wait(&mut self, appendonly: &str) {
        assert!(self.child.is_none(), "redis-server is already running");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                appendonly,
                "--enable-debug-command",
                "local",
                "--appendfsync",
                self.fsync,
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run redis-server ({e}): install it with deploy/local/install.sh")
            });
        self.child = Some(child);
        let url = self.url();
        eventually(Duration::from_secs(10), "redis-server to answer", || {
            ping(&url)
        })
        .await;
    }

    /// Shuts the server down (`SHUTDOWN`, which syncs the append-only file) and waits for exit.
    pub async fn stop(&mut self) {
        let mut child = self.child.take().expect("redis-server is not running");
        let _ = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "shutdown"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let status = tokio::task::spawn_blocking(move || child.wait())
            .await
            .expect("join")
            .expect("redis-server exit");
        assert!(
            status.success() || status.code().is_none(),
            "redis-server exit: {status}"
        );
    }

    /// Creates an ACL user that may run everything but scripts (`-@scripting`, as on a managed
    /// Redis that refuses them), and returns a URL logging in as it.
    pub async fn user_without_scripts(&self) -> String {
        let mut conn = connect(&self.url()).await;
        redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "noscripts",
                "on",
                ">secret",
                "~*",
                "&*",
                "+@all",
                "-@scripting",
            ])
            .exec_async(&mut conn)
            .await
            .expect("ACL SETUSER");
        self.url().replace("redis://", "redis://noscripts:secret@")
    }

    /// A reader over this server for `keyspace`.
    pub async fn reader(&self, keyspace: Keyspace) -> Reader {
        reader(&self.url(), keyspace).await
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A 3-master Redis Cluster on free loopback ports (`redis-server --cluster-enabled yes` ×3,
/// joined with `redis-cli --cluster create`), each node with its own append-only file.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<(u16, Option<Child>)>,
    dir: TempDir,
}

impl RedisCluster {
    /// Starts three masters, creates the cluster, and waits until every slot is served.
    pub async fn start() -> Self {
        let dir = TempDir::new("tally-cluster");
        let mut cluster = Self {
            nodes: (0..3).map(|_| (free_port(), None)).collect(),
            dir,
        };
        for i in 0..3 {
            cluster.start_node(i);
        }
        for (port, _) in &cluster.nodes {
            let url = format!("redis://127.0.0.1:{port}");
            eventually(Duration::from_secs(10), "a cluster node to answer", || {
                let url = url.clone();
                async move { ping(&url).await }
            })
            .await;
        }
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for (port, _) in &cluster.nodes {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        wait_cluster_ok(cluster.nodes[0].0, "the cluster to serve every slot").await;
        cluster
    }

    fn start_node(&mut self, i: usize) {
        let port = self.nodes[i].0;
        let node_dir = self.dir.path().join(format!("node-{port}"));
        std::fs::create_dir_all(&node_dir).expect("node dir");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ])
            .arg("--dir")
            .arg(&node_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.nodes[i].1 = Some(child);
    }

    /// The URL tally takes for this cluster: `redis+cluster://` and every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|(port, _)| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// SIGKILLs node `i` and restarts it from its append-only file, waiting until the cluster
    /// serves every slot again.
    pub async fn kill_and_restart_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].1.take() {
            let _ = child.kill();
            let _ = tokio::task::spawn_blocking(move || child.wait()).await;
        }
        self.start_node(i);
        wait_cluster_ok(self.nodes[i].0, "the restarted node to rejoin").await;
    }

    /// A reader over this cluster for `keyspace`.
    pub async fn reader(&self, keyspace: Keyspace) -> Reader {
        reader(&self.url(), keyspace).await
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Waits until the cluster node on `port` reports `cluster_state:ok`.
async fn wait_cluster_ok(port: u16, what: &str) {
    let url = format!("redis://127.0.0.1:{port}");
    eventually(Duration::from_secs(30), what, || {
        let url = url.clone();
        async move {
            let mut conn = try_connect(&url).await?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut conn)
                .await
                .ok()?;
            info.contains("cluster_state:ok").then_some(())
        }
    })
    .await;
}

async fn ping(url: &str) -> Option<String> {
    let mut conn = try_connect(url).await?;
    redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .ok()
}

/// Path of a workspace binary, built by `cargo build --workspace --bins`.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join(name))
        .expect("target dir");
    assert!(
        path.exists(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins`",
        path.display()
    );
    path
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
            .args(["--retry-max-backoff-ms", "500"])
            // A crashed member's partitions move after 6 s (the broker's minimum), not 45 s.
            .args(["--kafka-option", "session.timeout.ms=6000"])
            .args(["--kafka-option", "heartbeat.interval.ms=1000"])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
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

impl AggregatorProcess {
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
                let log = self.log();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                panic!(
                    "timed out after {timeout:?} waiting for {name} >= {at_least} (last value {value:?}); log tail:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
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

/// A one-shot HTTP GET on loopback; the body, or `None` if nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    http_get_status(port, path).await.map(|(_, body)| body)
}

/// A one-shot HTTP/1.1 GET on loopback (`connection: close`, chunked bodies decoded): the status
/// code and the body, or `None` if nothing answers.
pub async fn http_get_status(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        status,
        if chunked {
            dechunk(body)?
        } else {
            body.to_owned()
        },
    ))
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size + 2..)?;
    }
}

/// Waits until every counter in `expected` reads exactly its expected total, or panics after
/// `timeout` listing the first differences.
pub async fn wait_for_totals(reader: &Reader, expected: &HashMap<String, i64>, timeout: Duration) {
    if let Err(mismatch) = tally_cli::verify::wait_for_totals(reader, expected, timeout).await {
        panic!("{mismatch}");
    }
}

/// Every counter id that has a key under `keyspace` in the Redis at `url`.
pub async fn counters_in_redis(
    url: &str,
    keyspace: &Keyspace,
) -> std::collections::HashSet<String> {
    let mut conn = connect(url).await;
    let mut cursor: u64 = 0;
    let mut found = std::collections::HashSet::new();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(keyspace.counter_key_pattern())
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        for key in keys {
            if let Some(counter) = keyspace.counter_of_key(&key) {
                found.insert(counter.to_owned());
            }
        }
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

/// SIGKILLs the aggregator `kills` times while `load` is running, restarting it each time with
/// `extra` flags; returns the last one, running. Each incarnation is killed at a random moment
/// (0 to 800 ms, from `seed`) after it has made its first flush durable, so every kill lands on
/// an aggregator that is consuming and flushing. Panics if the load ends before the last kill.
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
}
