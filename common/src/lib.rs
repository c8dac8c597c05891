//! What every part of tally shares: the counter event and its rules, the wire format, the Redis
//! keyspace and the reader that sums a counter's shards.
//!
//! # Layout
//! - [`event`]: [`CounterEvent`] and the validation rules (counter ids, deltas) with typed errors.
//! - [`codec`]: the wire format: a versioned bincode envelope and a JSON form, decoded by
//!   [`codec::decode`] into a borrowed, validated [`codec::EventRef`].
//! - [`keyspace`]: [`Keyspace`], the one place that builds Redis keys (prefix, shard groups,
//!   Redis Cluster hash tags).
//! - [`connection`]: [`RedisConn`], a standalone or cluster Redis connection.
//! - [`reader`]: [`Reader`], exact counter totals by summing shards (`MGET`, pipelines).

pub mod codec;
pub mod connection;
pub mod event;
pub mod keyspace;
pub mod reader;

pub use codec::{DecodeError, EventRef};
pub use connection::RedisConn;
pub use event::{CounterEvent, EventError};
pub use keyspace::{GroupingRule, Keyspace};
pub use reader::{ReadError, Reader};
