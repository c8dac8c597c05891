//! The side tasks: work beside the consume loop, each with its own schedule.
//!
//! - [`trending`]: heavy-hitter sketches of the fastest-moving counters, and the cache warmer.
//! - [`expiry`]: counters that expire: the idle index, expiry records and their decision.
//! - [`shard_monitor`]: raises the shard counts of directly written counters that run hot.
//! - [`cells`]: the window cells' sweep of expired buckets, and the migration from bucket keys.
//! - [`compact`]: collapsing cold counters' shares into one key, crash-safe (`tally compact`).
//! - [`likes_move`]: moving a deployment's likes from the shares to count sets
//!   (`tally likes-to-sets`).
//! - [`regroup`]: growing and shrinking a live deployment's shard groups (`tally regroup`).

pub mod cells;
pub mod compact;
pub mod expiry;
pub mod likes_move;
pub mod regroup;
pub mod shard_monitor;
pub mod trending;
