//! Redis: private `redis-server` processes and clusters, connections, and reading totals.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tally_common::{Keyspace, Reader, RedisConn};

use crate::support::{TempDir, eventually, free_port};

/// A multiplexed connection to the Redis server at `url` (a plain `redis://` URL), or `None`
/// if it does not answer.
pub async fn try_connect(url: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).ok()?;
    client.get_multiplexed_async_connection().await.ok()
}

/// A multiplexed connection to the Redis server at `url` that waits up to `timeout` for each
/// reply (the default is shorter than a server busy on purpose, or a reply of tens of MB).
pub async fn connect_patient(url: &str, timeout: Duration) -> redis::aio::MultiplexedConnection {
    let patient = redis::AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
    let client = redis::Client::open(url).expect("redis url");
    client
        .get_multiplexed_async_connection_with_config(&patient)
        .await
        .expect("redis connection")
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
        Self::start_with_replicas(0).await
    }

    /// Starts three masters with `replicas` replicas each, creates the cluster, and waits until
    /// every slot is served.
    pub async fn start_with_replicas(replicas: usize) -> Self {
        let dir = TempDir::new("tally-cluster");
        let n = 3 * (1 + replicas);
        let mut cluster = Self {
            nodes: (0..n).map(|_| (free_port(), None)).collect(),
            dir,
        };
        for i in 0..n {
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
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
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

    /// The URL of node `i` alone.
    pub fn node_url(&self, i: usize) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[i].0)
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

    /// Grows the cluster by `n` empty masters and moves slots to them until every master serves
    /// about as many, keys and all, while clients write (`redis-cli --cluster add-node`, then
    /// `--cluster rebalance --cluster-use-empty-masters`); waits until the cluster is ok.
    /// Returns the new masters' ports.
    pub async fn add_masters(&mut self, n: usize) -> Vec<u16> {
        let first = self.nodes.len();
        let seed = format!("127.0.0.1:{}", self.nodes[0].0);
        for i in first..first + n {
            self.nodes.push((free_port(), None));
            self.start_node(i);
            let url = self.node_url(i);
            eventually(Duration::from_secs(10), "a new node to answer", || {
                let url = url.clone();
                async move { ping(&url).await }
            })
            .await;
            let node = format!("127.0.0.1:{}", self.nodes[i].0);
            redis_cli(&["--cluster", "add-node", &node, &seed]).await;
            // A node joins through gossip: the next step checks that every node agrees.
            self.wait_all_know(i + 1).await;
        }
        // A new node serves (and takes slots) only once it too finds every slot covered: until
        // then a slot moved to it fails with CLUSTERDOWN.
        for (port, _) in &self.nodes {
            wait_cluster_ok(
                *port,
                "every node to find the cluster ok with the new nodes",
            )
            .await;
        }
        redis_cli(&[
            "--cluster",
            "rebalance",
            &seed,
            "--cluster-use-empty-masters",
            "--cluster-pipeline",
            "100",
        ])
        .await;
        wait_cluster_ok(self.nodes[0].0, "the cluster to be ok after the rebalance").await;
        self.nodes[first..].iter().map(|(port, _)| *port).collect()
    }

    /// Waits until every node lists `count` nodes with the same view of who serves what.
    async fn wait_all_know(&self, count: usize) {
        let ports: Vec<u16> = self.nodes.iter().map(|(port, _)| *port).collect();
        eventually(
            Duration::from_secs(30),
            "every node to know every other",
            || {
                let ports = ports.clone();
                async move {
                    let mut views = Vec::new();
                    for port in ports {
                        let mut conn = try_connect(&format!("redis://127.0.0.1:{port}")).await?;
                        let nodes: String = (redis::cmd("CLUSTER").arg("NODES"))
                            .query_async(&mut conn)
                            .await
                            .ok()?;
                        // Per node: its id, role and slots, without flags such as `myself`.
                        let mut view: Vec<String> = (nodes.lines())
                            .map(|l| {
                                let f: Vec<&str> = l.split(' ').collect();
                                let master = f.get(2).is_some_and(|r| r.contains("master"));
                                format!("{} {master} {}", f[0], f.get(8..).unwrap_or(&[]).join(" "))
                            })
                            .collect();
                        view.sort();
                        if view.len() != count {
                            return None;
                        }
                        views.push(view);
                    }
                    views.windows(2).all(|w| w[0] == w[1]).then_some(())
                }
            },
        )
        .await;
    }

    /// The ports of the masters serving `slots`, in order.
    pub async fn owners_of(&self, slots: &[u16]) -> Vec<u16> {
        let mut conn = connect(&self.node_url(0)).await;
        // Each range: first slot, last slot, then [ip, port, id, ...] of its master and replicas.
        let ranges: Vec<(u16, u16, u16)> = (redis::cmd("CLUSTER").arg("SLOTS"))
            .query_async::<Vec<Vec<redis::Value>>>(&mut conn)
            .await
            .expect("CLUSTER SLOTS")
            .into_iter()
            .map(|range| {
                let mut range = range.into_iter();
                let mut next = || range.next().expect("a slot range's field");
                let first: u16 = redis::from_redis_value(next()).expect("a slot");
                let last: u16 = redis::from_redis_value(next()).expect("a slot");
                let master: Vec<redis::Value> = redis::from_redis_value(next()).expect("a master");
                let port = master.into_iter().nth(1).expect("its port");
                (first, last, redis::from_redis_value(port).expect("a port"))
            })
            .collect();
        (slots.iter())
            .map(|slot| {
                (ranges.iter())
                    .find(|(first, last, _)| (*first..=*last).contains(slot))
                    .map(|(_, _, port)| *port)
                    .expect("every slot served")
            })
            .collect()
    }

    /// A reader over this cluster for `keyspace`.
    pub async fn reader(&self, keyspace: Keyspace) -> Reader {
        reader(&self.url(), keyspace).await
    }

    /// `CLUSTER NODES` as node 0 sees it.
    async fn cluster_nodes(&self) -> String {
        let mut conn = connect(&self.node_url(0)).await;
        redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await
            .expect("CLUSTER NODES")
    }

    /// Each node's `(port, id, first and last slot served)` (one range per master, as
    /// `redis-cli --cluster create` assigns them), from `CLUSTER NODES`.
    async fn nodes(&self) -> Vec<(u16, String, Option<(u16, u16)>)> {
        (self.cluster_nodes().await.lines())
            .map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let port = fields[1].split(['@', ':']).nth(1).expect("port");
                let range = fields.get(8).and_then(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    Some((a.parse().ok()?, b.parse().ok()?))
                });
                (port.parse().expect("port"), fields[0].to_owned(), range)
            })
            .collect()
    }

    /// Fails the master serving `slot` over to its replica (`CLUSTER FAILOVER` on the replica,
    /// as an operator does before maintenance), and waits until the replica serves the slot and
    /// the cluster is ok. Returns the old and the new master's ports.
    pub async fn fail_over(&self, slot: u16) -> (u16, u16) {
        let owner = self.owner(slot).await;
        let replica: u16 = (self.cluster_nodes().await.lines())
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .find(|f| f[2].contains("slave") && f[3] == owner.1)
            .and_then(|f| f[1].split(['@', ':']).nth(1)?.parse().ok())
            .expect("a replica of the slot's master");
        let mut replica_conn = connect(&format!("redis://127.0.0.1:{replica}")).await;
        redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .exec_async(&mut replica_conn)
            .await
            .expect("CLUSTER FAILOVER");
        eventually(
            Duration::from_secs(30),
            "the replica to take the slot over",
            || async { (self.owner(slot).await.0 == replica).then_some(()) },
        )
        .await;
        wait_cluster_ok(replica, "the cluster to be ok after the failover").await;
        (owner.0, replica)
    }

    /// The `(port, id)` of the master serving `slot`.
    async fn owner(&self, slot: u16) -> (u16, String) {
        let nodes = self.nodes().await;
        let (port, id, _) = (nodes.into_iter())
            .find(|(_, _, r)| r.is_some_and(|(a, b)| (a..=b).contains(&slot)))
            .expect("the slot's owner");
        (port, id)
    }

    /// Moves hash slot `slot` to another master while it is written, as `redis-cli --cluster
    /// reshard` does: the target imports it, the owner migrates it, its keys move `batch` at a
    /// time with `pause` between (clients meanwhile get `ASK`, or `TRYAGAIN` for a script whose
    /// keys are split between the nodes), then every node is told the new owner (clients get
    /// `MOVED`). Returns the old and the new owner's ports.
    pub async fn migrate_slot(&self, slot: u16, batch: usize, pause: Duration) -> (u16, u16) {
        let nodes = self.nodes().await;
        let owner = (nodes.iter())
            .find(|(_, _, r)| r.is_some_and(|(a, b)| (a..=b).contains(&slot)))
            .expect("the slot's owner")
            .clone();
        let target = (nodes.iter())
            .find(|(p, _, r)| *p != owner.0 && r.is_some())
            .expect("another master")
            .clone();
        let node = |port: u16| connect_owned(format!("redis://127.0.0.1:{port}"));
        let (mut from, mut to) = (node(owner.0).await, node(target.0).await);
        let setslot = |how: &'static str, id: String| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SETSLOT").arg(slot).arg(how).arg(id);
            cmd
        };
        setslot("IMPORTING", owner.1.clone())
            .exec_async(&mut to)
            .await
            .expect("IMPORTING");
        setslot("MIGRATING", target.1.clone())
            .exec_async(&mut from)
            .await
            .expect("MIGRATING");
        let mut moved = 0;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch)
                .query_async(&mut from)
                .await
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(target.0)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("REPLACE")
                .arg("KEYS")
                .arg(&keys)
                .exec_async(&mut from)
                .await
                .expect("MIGRATE");
            moved += keys.len();
            tokio::time::sleep(pause).await;
        }
        for (port, _, _) in &nodes {
            let mut conn = node(*port).await;
            setslot("NODE", target.1.clone())
                .exec_async(&mut conn)
                .await
                .expect("SETSLOT NODE");
        }
        wait_cluster_ok(
            self.nodes[0].0,
            "the cluster to agree on the slot's new owner",
        )
        .await;
        eprintln!(
            "slot {slot}: {moved} keys moved from {} to {}",
            owner.0, target.0
        );
        (owner.0, target.0)
    }
}

/// Runs `redis-cli` with `args` on a blocking thread; panics with its output if it fails.
async fn redis_cli(args: &[&str]) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || Command::new("redis-cli").args(&args).output())
        .await
        .expect("redis-cli task")
        .expect("redis-cli runs");
    assert!(
        out.status.success(),
        "redis-cli failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn connect_owned(url: String) -> redis::aio::MultiplexedConnection {
    connect(&url).await
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
