//! Reading counts: a counter's value is the sum of its keys over every shard group.
//!
//! [`Reader::get_many`] reads a batch of counters with one `MGET` per shard group, each holding
//! that group's keys of every counter in the batch, so each `MGET` stays inside one Redis Cluster
//! slot; the `MGET`s go out as one pipeline (one round trip on a standalone server, one per node
//! on a cluster, where redis-rs refuses pipelines that span slots, so the `MGET`s go out as
//! concurrent requests instead) and each counter's shares are summed. [`Reader::get`] is the same for one
//! counter. These are exact reads of what has been flushed so far; nothing is cached here.

use crate::connection::{RedisConn, query_each};
use crate::event::{EventError, validate_counter};
use crate::keyspace::Keyspace;

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The counter id is not valid, so it can have no value.
    #[error("invalid counter id: {0}")]
    InvalidCounter(#[from] EventError),
    /// Redis failed or timed out.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The shards add up to more than an i64 holds.
    #[error("the shards of {counter} add up to more than 64 bits")]
    Overflow {
        /// The counter.
        counter: String,
    },
}

/// Reads counter totals from Redis.
#[derive(Debug, Clone)]
pub struct Reader {
    /// Where to read from.
    conn: RedisConn,
    /// Which keys make up a counter.
    keyspace: Keyspace,
}

impl Reader {
    /// A reader over `conn` for the given keyspace.
    pub fn new(conn: RedisConn, keyspace: Keyspace) -> Self {
        Self { conn, keyspace }
    }

    /// The connection this reader reads through.
    pub fn conn(&self) -> &RedisConn {
        &self.conn
    }

    /// The keyspace this reader reads.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// Whether `actor`'s like of `counter` is counted, in a namespace that deduplicates: one
    /// `SISMEMBER` in the actor's group, whatever the topic's partition count.
    pub async fn has_liked(&self, counter: &str, actor: &str) -> Result<bool, ReadError> {
        validate_counter(counter)?;
        let group = self.keyspace.group_for_actor(actor);
        let mut conn = self.conn.clone();
        Ok(redis::cmd("SISMEMBER")
            .arg(self.keyspace.member_key(group, counter))
            .arg(actor)
            .query_async(&mut conn)
            .await?)
    }

    /// The exact total of `counter` (0 if it was never written).
    pub async fn get(&self, counter: &str) -> Result<i64, ReadError> {
        Ok(self.get_many(&[counter]).await?[0])
    }

    /// The exact totals of `counters`, in the same order, read in one pipeline of one
    /// single-slot `MGET` per shard group.
    pub async fn get_many<S: AsRef<str>>(&self, counters: &[S]) -> Result<Vec<i64>, ReadError> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        for counter in counters {
            validate_counter(counter.as_ref())?;
        }
        let mgets = (0..self.keyspace.groups())
            .map(|group| {
                let keys: Vec<String> = counters
                    .iter()
                    .map(|c| self.keyspace.counter_key(group, c.as_ref()))
                    .collect();
                let mut mget = redis::cmd("MGET");
                mget.arg(keys);
                mget
            })
            .collect();
        // rows[group][i]: counter i's share in that group.
        let rows: Vec<Vec<Option<i64>>> = query_each(&self.conn, mgets).await?;
        counters
            .iter()
            .enumerate()
            .map(|(i, counter)| {
                let shares: Vec<Option<i64>> = rows
                    .iter()
                    .map(|row| row.get(i).copied().flatten())
                    .collect();
                sum(counter.as_ref(), &shares)
            })
            .collect()
    }
}

fn sum(counter: &str, values: &[Option<i64>]) -> Result<i64, ReadError> {
    values
        .iter()
        .flatten()
        .try_fold(0i64, |acc, v| acc.checked_add(*v))
        .ok_or_else(|| ReadError::Overflow {
            counter: counter.to_owned(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_skips_missing_keys_and_reports_overflow() {
        assert_eq!(sum("c", &[None, Some(3), Some(-1), None]).ok(), Some(2));
        assert_eq!(sum("c", &[]).ok(), Some(0));
        assert!(matches!(
            sum("c", &[Some(i64::MAX), Some(1)]),
            Err(ReadError::Overflow { .. })
        ));
    }
}
