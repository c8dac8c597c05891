//! Where tally looks when nothing else is said: the one place each default lives, used by the
//! aggregator's configuration, the `tally` command line, the bench and the examples.

pub use crate::keyspace::{DEFAULT_GROUPS as SHARD_GROUPS, DEFAULT_PREFIX as KEY_PREFIX};

/// Kafka bootstrap servers.
pub const BROKERS: &str = "127.0.0.1:9092";
/// The topic holding counter events.
pub const TOPIC: &str = "tally.events";
/// The topic receiving malformed messages.
pub const DEAD_LETTER_TOPIC: &str = "tally.events.dlq";
/// The aggregators' Kafka consumer group.
pub const GROUP: &str = "tally-aggregator";
/// The Redis server.
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
