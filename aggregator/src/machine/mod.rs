//! The core: one partition's state machine, its buffer, what an owner knows, and what became of
//! its work, with no I/O (no Kafka, no store, no clock but the instants it is given), so that
//! every decision is unit-tested. The rest of the aggregator tells it what happened and carries
//! out what it answers.
//!
//! - [`partition`]: one partition as a state machine: what to flush, commit, pause, acquire.
//! - [`batch`]: one partition's buffer, and a sealed batch per group.
//! - [`likes`]: a batch's likes and unlikes per group, and their runs once sealed.
//! - [`pace`]: when a batch must be flushed (its limits, its pace, its flush clock).
//! - [`ownership`]: an exactly-once owner's epoch and ledgers, and where a partition resumes.
//! - [`outcome`]: how a flush or a check ended.
//! - [`letter`]: a message bound for the dead-letter topic.
//! - [`write`](mod@write): one write into a shard group as the stores take it, and what they answer.
//! - [`verdict`]: the exactly-once decisions every store makes before it writes.

pub mod batch;
pub mod letter;
pub mod likes;
pub mod outcome;
pub mod ownership;
pub mod pace;
pub mod partition;
pub mod verdict;
pub mod write;
