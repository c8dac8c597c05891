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

pub mod browser;
pub mod http;
pub mod kafka;
pub mod kafka_cluster;
pub mod pauses;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod proxy;
pub mod scenarios;
pub mod server;
pub mod store;
pub mod support;

pub use http::*;
pub use kafka::*;
pub use pauses::{Group, Rebalanced, assignments_seen, revokes_seen};
pub use process::*;
pub use server::*;
pub use store::*;
pub use support::*;
