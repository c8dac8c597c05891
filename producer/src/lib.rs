//! The tally producer: what services link to append counter events to Kafka.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tally_producer::ProduceError> {
//! use tally_producer::{Producer, ProducerConfig};
//! let producer = Producer::new(&ProducerConfig::new("127.0.0.1:9092", "tally.events"))?;
//! producer.like("likes:post:42", "u7").await?; // returns once Kafka has the event
//! producer.add("views:video:9", 3).await?;
//! producer.flush().await?;
//! # Ok(()) }
//! ```
//!
//! Every call returns only once Kafka has acknowledged the event (`acks=all`, idempotent
//! producer), or with a typed [`ProduceError`]. For high throughput, [`Producer::enqueue`] hands
//! the event to librdkafka and returns a [`Pending`] acknowledgement to await later, so that many
//! events are in flight at once. When librdkafka's local queue is full the caller waits for room:
//! nothing is dropped silently. For bulk jobs (backfills, imports, load generation),
//! [`BulkProducer`] skips the per-event future: each outcome goes to one callback instead, and
//! tally's own appender (`tally_kafka::Appender`) sends the events, about three times faster than
//! librdkafka's per-message path ([`BulkPath`]).
//!
//! For a namespace whose write path is `direct` (`docs/namespaces.md`), [`DirectWriter`] writes
//! straight to Redis instead: visible at once, no Kafka.
//!
//! # Layout
//! - [`kafka`]: [`ProducerConfig`] and [`Routing`] (what to build), [`Producer`] (sending),
//!   [`Pending`] and [`Delivered`] (acknowledgements), [`ProduceError`].
//! - [`bulk`]: [`BulkProducer`], sends with a delivery callback and no future per event,
//!   through tally's appender or librdkafka ([`BulkPath`]).
//! - [`direct`]: [`DirectWriter`], direct writes to random shards, likes, rate reports.
//! - [`counts`]: [`Counts`], one handle that writes by each namespace's path and reads through
//!   the cache: what a service for likes and views uses.

pub mod bulk;
pub mod counts;
pub mod direct;
pub mod kafka;

pub use bulk::BulkProducer;
pub use counts::{Counts, WriteError};
pub use direct::{DirectError, DirectWriter};
pub use kafka::{
    BulkPath, DEFAULT_FLUSH_TIMEOUT, Delivered, Pending, ProduceError, Producer, ProducerConfig,
    Routing,
};
