//! What every part of tally shares: the counter event and its rules, the wire format, the Redis
//! keyspace, namespaces and their policies, and the readers that sum a counter's shards.
//!
//! # Layout
//! - [`event`]: [`CounterEvent`] and the validation rules (counter ids, deltas) with typed errors.
//! - [`codec`]: the wire format: a versioned bincode envelope and a JSON form, decoded by
//!   [`codec::decode`] into a borrowed, validated [`codec::EventRef`].
//! - [`keyspace`]: [`Keyspace`], the one place that builds Redis keys (prefix, shard groups,
//!   Redis Cluster hash tags).
//! - [`layout`]: where each deduplicating namespace keeps its member sets, recorded in Redis and
//!   checked by every writer.
//! - [`namespace`]: [`Namespaces`], each namespace's [`Policy`] (dedup, write path, cache TTL,
//!   grouping, display), read from one TOML file.
//! - [`connection`]: [`RedisTarget`] (a Redis URL, parsed once) and [`RedisConn`], a standalone
//!   or cluster Redis connection.
//! - [`dead_letter`]: [`DeadLetterReason`], why a message went to the dead-letter topic.
//! - [`defaults`]: the default brokers, topics, group, Redis URL, key prefix and shard groups.
//! - [`reader`]: [`Reader`], exact counter totals by summing shards (`MGET`, pipelines).
//! - [`regroup`]: the group plan (how many shard groups writers use and readers sum) and
//!   growing a live deployment's groups.
//! - [`cache`]: [`CachedReader`], totals cached per namespace TTL in the process and in Redis,
//!   with one refresh per counter in flight (no stampede).
//! - [`display`](mod@display): counts rendered for people (`9,847`, `10.2K`).

pub mod cache;
pub mod codec;
pub mod connection;
pub mod dead_letter;
pub mod defaults;
pub mod display;
pub mod event;
pub mod keyspace;
pub mod layout;
pub mod namespace;
#[cfg(feature = "postgres")]
pub mod pg;
pub mod reader;
pub mod regroup;
pub mod window;

pub use cache::{CacheStats, CachedReader};
pub use codec::{DecodeError, EventRef};
pub use connection::{RedisConn, RedisTarget};
pub use dead_letter::DeadLetterReason;
pub use display::display;
pub use event::{CounterEvent, EventError};
pub use keyspace::{GroupingRule, Keyspace};
pub use namespace::{DisplayStyle, Namespaces, Policy, WritePath};
pub use reader::{ReadError, Reader, StoreOfRecord};
pub use window::Windows;
