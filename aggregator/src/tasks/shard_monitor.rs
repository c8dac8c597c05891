//! The shard monitor: raises the shard count of directly written counters whose per-shard write
//! rate passes a threshold (the articles' viral video), within seconds and without an operator.
//!
//! Direct writers (`tally_producer::DirectWriter`) report their writes per counter every second
//! into `<prefix>:rates:<unix second>`. Every second the monitor reads the last complete second's
//! bucket, and for each counter whose rate per shard is above the threshold sets its shard count
//! (`<prefix>:shards`) to twice what that rate needs, up to the number of shard groups, with
//! `ZADD GT`: a count only grows, and several monitors (one per aggregator) can run at once.
//! Writers pick the new count up within a second. Shrinking a cold counter is compaction's job.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::RedisResult;
use tally_common::{Keyspace, RedisConn};
use tokio_util::sync::CancellationToken;

use crate::operator::metrics::Metrics;

/// What the monitor needs.
#[derive(Debug, Clone)]
pub struct ShardMonitor {
    /// Where the rates and shard counts live.
    pub conn: RedisConn,
    /// Which keys.
    pub keyspace: Keyspace,
    /// Writes per second one shard should take at most.
    pub threshold: u64,
    /// Counts raises.
    pub metrics: Option<Arc<Metrics>>,
}

/// A raise the monitor made.
#[derive(Debug, Clone, PartialEq)]
pub struct Raise {
    /// The counter.
    pub counter: String,
    /// Its writes per second in the last complete second.
    pub rate: f64,
    /// Its shard count before.
    pub from: u32,
    /// Its shard count now.
    pub to: u32,
}

/// The shard count a counter written `rate` times a second needs so that each shard takes at
/// most half the threshold (headroom for growth until the next check), at most `max`.
pub fn shards_needed(rate: f64, threshold: u64, max: u32) -> u32 {
    let needed = (rate * 2.0 / threshold.max(1) as f64).ceil();
    (needed as u32).clamp(1, max)
}

impl ShardMonitor {
    /// Checks every second until `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(error) = self.check().await {
                tracing::warn!(%error, "the shard monitor could not read write rates");
            }
        }
    }

    /// One check of the last complete second; returns the raises it made.
    pub async fn check(&self) -> RedisResult<Vec<Raise>> {
        let second = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_sub(1);
        let mut conn = self.conn.clone();
        let hot: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(self.keyspace.rates_key(second))
            .arg(self.threshold)
            .arg("+inf")
            .arg("BYSCORE")
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await?;
        let mut raises = Vec::new();
        for (counter, rate) in hot {
            let current: Option<f64> = redis::cmd("ZSCORE")
                .arg(self.keyspace.shards_key())
                .arg(&counter)
                .query_async(&mut conn)
                .await?;
            let from = current.map_or(1, |s| s as u32).max(1);
            if rate / f64::from(from) <= self.threshold as f64 {
                continue;
            }
            let to = shards_needed(rate, self.threshold, self.keyspace.groups());
            if to <= from {
                continue;
            }
            redis::cmd("ZADD")
                .arg(self.keyspace.shards_key())
                .arg("GT")
                .arg(to)
                .arg(&counter)
                .exec_async(&mut conn)
                .await?;
            tracing::info!(%counter, rate, from, to, "shard count raised");
            if let Some(metrics) = &self.metrics {
                metrics.shard_raised();
            }
            raises.push(Raise {
                counter,
                rate,
                from,
                to,
            });
        }
        Ok(raises)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raise_leaves_each_shard_at_half_the_threshold_at_most() {
        assert_eq!(shards_needed(1_000.0, 1_000, 16), 2);
        assert_eq!(shards_needed(10_500.0, 1_000, 16), 16);
        assert_eq!(shards_needed(3_200.0, 1_000, 16), 7);
        assert_eq!(shards_needed(50_000.0, 1_000, 16), 16);
        assert_eq!(shards_needed(0.0, 1_000, 16), 1);
    }
}
