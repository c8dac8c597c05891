//! A private 3-broker KRaft cluster for a test, run by `deploy/local/kafka-cluster.sh` on free
//! loopback ports in a temporary directory; stopped when dropped.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::support::{TempDir, free_port};

/// A running 3-broker cluster (replication factor 3, `min.insync.replicas=2`).
#[derive(Debug)]
pub struct KafkaCluster {
    dir: TempDir,
    broker_ports: Vec<u16>,
    controller_ports: Vec<u16>,
}

impl KafkaCluster {
    /// Formats and starts the three nodes; returns once all three brokers registered.
    pub fn start() -> Self {
        let cluster = Self {
            dir: TempDir::new("kafka-cluster"),
            broker_ports: (0..3).map(|_| free_port()).collect(),
            controller_ports: (0..3).map(|_| free_port()).collect(),
        };
        cluster.script(&["start"]);
        cluster
    }

    /// The bootstrap servers.
    pub fn bootstrap(&self) -> String {
        let brokers: Vec<String> = self
            .broker_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        brokers.join(",")
    }

    /// Creates `topic` with `partitions` partitions, replication factor 3, min ISR 2, through
    /// the admin API (a JVM tool took seconds to start); call it inside `block_in_place`.
    pub fn topic(&self, topic: &str, partitions: i32) {
        let bootstrap = self.bootstrap();
        let create = crate::kafka::create_replicated_topic(
            &bootstrap,
            topic,
            partitions,
            3,
            &[("min.insync.replicas", "2")],
        );
        tokio::runtime::Handle::current().block_on(create);
    }

    /// The Kafka release the nodes run, `(major, minor)`, as `kafka-cluster.sh` wrote it when
    /// it formatted them.
    pub fn release(&self) -> (u32, u32) {
        let path = self.dir.path().join("kafka-version");
        let version =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut parts = version.trim().split('.').map(|p| p.parse().ok());
        match (parts.next().flatten(), parts.next().flatten()) {
            (Some(major), Some(minor)) => (major, minor),
            _ => panic!("{}: not a Kafka release: {version:?}", path.display()),
        }
    }

    /// SIGKILLs node `i` (1-3).
    pub fn kill(&self, i: usize) {
        self.script(&["kill", &i.to_string()]);
    }

    /// Stops node `i` (SIGTERM: a controlled shutdown, which takes it out of every ISR).
    pub fn stop_node(&self, i: usize) {
        self.script(&["stop-node", &i.to_string()]);
    }

    /// Asks for an unclean election of partition `partition` of `topic` (a live replica out of
    /// sync may lead); whether it happened is the caller's to check.
    pub fn elect_unclean(&self, topic: &str, partition: i32) -> bool {
        let args = ["elect-unclean", topic, &partition.to_string()];
        let out = self.command(&args).output().expect("kafka-cluster.sh runs");
        out.status.success()
    }

    /// Creates `topic`, one partition on `replicas` (the first leads), with `configs`; call it
    /// inside `block_in_place`.
    pub fn topic_on(&self, topic: &str, replicas: &[i32], configs: &[(&str, &str)]) {
        let assignment = [replicas];
        let new = NewTopic::new(topic, 1, TopicReplication::Variable(&assignment));
        let bootstrap = self.bootstrap();
        let create = crate::kafka::create_new_topic(&bootstrap, new, configs);
        tokio::runtime::Handle::current().block_on(create);
    }

    /// Partition `partition` of `topic`'s leader, as the cluster's metadata says (-1: none).
    pub fn leader(&self, topic: &str, partition: i32) -> i32 {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("consumer");
        let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10));
        metadata
            .ok()
            .and_then(|m| {
                let t = m.topics().first()?;
                let p = t.partitions().iter().find(|p| p.id() == partition)?;
                Some(p.leader())
            })
            .unwrap_or(-1)
    }

    /// Starts node `i` again from its data.
    pub fn start_node(&self, i: usize) {
        self.script(&["start-node", &i.to_string()]);
    }

    /// Stops node `i` (SIGTERM), starts it, and waits until every partition is in sync again.
    pub fn restart_node(&self, i: usize) {
        self.script(&["restart-node", &i.to_string()]);
    }

    /// Waits until no partition is under-replicated.
    pub fn wait_in_sync(&self) {
        self.script(&["wait-in-sync"]);
    }

    fn script(&self, args: &[&str]) {
        let status = self.command(args).status().expect("kafka-cluster.sh runs");
        assert!(
            status.success(),
            "kafka-cluster.sh {args:?} failed: {status}"
        );
    }

    fn command(&self, args: &[&str]) -> Command {
        let join = |ports: &[u16]| {
            ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/kafka-cluster.sh");
        let mut command = Command::new(script);
        command
            .args(args)
            .env("TALLY_CLUSTER_DIR", self.dir.path())
            .env("TALLY_CLUSTER_BROKER_PORTS", join(&self.broker_ports))
            .env(
                "TALLY_CLUSTER_CONTROLLER_PORTS",
                join(&self.controller_ports),
            );
        command
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        let _ = self.command(&["stop"]).status();
    }
}
