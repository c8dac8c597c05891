//! tally's own Kafka client for the two paths that carry every event: reading (a topic's
//! partitions read straight from their leaders, record batches decompressed once and parsed in
//! place) and bulk appending (records encoded straight into their partition's batch), without a
//! heap object, a lock or a clock read per message.
//!
//! librdkafka (through rust-rdkafka) stays in charge of everything else: the consumer group, its
//! rebalances, offset commits, the services' producer with an acknowledgement per event. What
//! it costs per message (an op, a queue pop, clock reads, a wrapper per message) bounded the
//! aggregator's catch-up at about twice what this path costs, and the bulk producer at about
//! three quarters of `kcat -P`; see `docs/performance/` in the repository.
//!
//! # Layout
//! - [`wire`]: Kafka's primitive types for record batches and request headers, read in place.
//! - [`records`]: record batches (message format v2) and their records.
//! - [`compression`]: gzip, Snappy and LZ4 records sections.
//! - [`protocol`]: the requests tally sends (`ApiVersions`, `Metadata`, `ListOffsets`, `Fetch`,
//!   `Produce`, `InitProducerId`, SASL), their versions agreed per connection, their bodies
//!   encoded and decoded by the `kafka-protocol` crate.
//! - [`sasl`]: `PLAIN` and `SCRAM-SHA-256`/`-512`, client side.
//! - [`config`]: [`FetchConfig`], read from librdkafka-style options.
//! - [`connection`]: one broker connection: TCP, TLS, SASL, requests.
//! - [`fetcher`]: [`Fetcher`], the partitions' fetch loop, and the [`Chunk`]s it hands out.
//! - [`append`]: [`Appender`], an idempotent producer for bulk traffic: records encoded into
//!   their partition's batch as they are appended, one `Produce` per broker at a time.
//! - [`backoff`]: capped exponential backoff with jitter, which every retry in tally uses.

pub mod append;
pub mod backoff;
pub mod compression;
pub mod config;
pub mod connection;
pub mod fetcher;
pub mod protocol;
pub mod records;
pub mod sasl;
pub mod wire;

#[cfg(test)]
mod fuzz;

pub use append::{AppendError, Appender, Completion};
pub use config::{AppendConfig, FetchConfig, OffsetReset, Unsupported};
pub use fetcher::{Chunk, Fetched, Fetcher, Item, Start};
pub use records::Record;
