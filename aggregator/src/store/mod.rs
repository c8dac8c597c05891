//! The stores: the [`sink::Sink`] seam every write goes through, and its implementations.
//!
//! - [`sink`]: the seam, and [`sink::SinkError`] (retried; the class only words the log).
//! - [`store_error`]: what a store's error says, one table per store (none refuses a delta).
//! - [`redis_sink`]: [`redis_sink::RedisSink`], Redis through the Lua `scripts/`, or
//! - [`transactions`]: the same operations as `WATCH`/`MULTI`/`EXEC`, for servers that refuse
//!   scripts.
//! - [`pg_sink`]: [`pg_sink::PgSink`], PostgreSQL as the store of record.
//! - `memory_sink`: an in-memory sink for the unit tests of the loop.
//! - [`script_call`]: one `EVALSHA`, its keys and arguments each in one buffer.
//! - [`cells`]: window deltas as rewrites of the counters' cells hashes, planned from a read.
//! - [`recall`]: what a writer remembers of the cells fields, so that a write can skip its read.
//! - [`packing`]: which groups pack their counters' shares into hashes, as a writer knows.
//! - [`fence`]: owning a partition in exactly-once mode (epochs, fences, ledgers, watermark).
//!
//! What a write is and what the stores decide before writing are the core's
//! (`crate::machine::write`, `crate::machine::verdict`).

pub mod cells;
pub mod fence;
#[cfg(test)]
pub(crate) mod memory_sink;
pub mod packing;
pub mod pg_sink;
pub mod recall;
pub mod redis_sink;
pub mod script_call;
pub mod sink;
pub mod store_error;
pub mod transactions;
