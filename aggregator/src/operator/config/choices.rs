//! The settings that choose between a few ways: each an enum that the command line, the
//! environment and the file spell the same way.

use serde::Deserialize;

/// How logs are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The delivery guarantee.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Every Kafka offset applied to Redis exactly once: fenced, ledgered writes (Lua scripts).
    #[default]
    ExactlyOnce,
    /// Flush, then commit: a crash between the two applies a batch twice. Plain `MULTI`/`EXEC`.
    AtLeastOnce,
}

/// How the exactly-once operations are made atomic in Redis.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Atomicity {
    /// Lua scripts, falling back to transactions for good if the server refuses scripts.
    #[default]
    Auto,
    /// Lua scripts only (one round trip per operation).
    Scripts,
    /// Optimistic `WATCH`/`MULTI`/`EXEC` transactions on dedicated connections (standalone Redis).
    Transactions,
}

/// How the topic's partitions are read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fetch {
    /// tally's own fetcher (`tally-kafka`) when it supports the Kafka options given, else
    /// librdkafka's, saying why at start-up.
    #[default]
    Auto,
    /// tally's own fetcher: partitions read straight from their leaders, record batches
    /// parsed in place. Refuses to start with options it does not support.
    Direct,
    /// librdkafka's fetcher, one message at a time.
    Librdkafka,
}
