//! Reading counts: a counter's value is the sum of its keys over every shard group.
//!
//! [`Reader::get`] fetches all of one counter's keys with one `MGET` (one round trip on a
//! standalone server; on a cluster redis-rs splits it into one request per node) and sums them.
//! [`Reader::get_many`] does the same for a batch of counters in one pipeline. These are exact
//! reads of what has been flushed so far; nothing is cached here.

use redis::aio::ConnectionLike;

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
pub struct Reader<C> {
    /// Where to read from.
    conn: C,
    /// Which keys make up a counter.
    keyspace: Keyspace,
}

impl<C: ConnectionLike + Clone + Send + Sync> Reader<C> {
    /// A reader over `conn` for the given keyspace.
    pub fn new(conn: C, keyspace: Keyspace) -> Self {
        Self { conn, keyspace }
    }

    /// The keyspace this reader reads.
    pub fn keyspace(&self) -> &Keyspace {
        &self.keyspace
    }

    /// The exact total of `counter` (0 if it was never written).
    pub async fn get(&self, counter: &str) -> Result<i64, ReadError> {
        validate_counter(counter)?;
        let mut conn = self.conn.clone();
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(self.keyspace.counter_keys(counter))
            .query_async(&mut conn)
            .await?;
        sum(counter, &values)
    }

    /// The exact totals of `counters`, in the same order, read in one pipeline.
    pub async fn get_many<S: AsRef<str>>(&self, counters: &[S]) -> Result<Vec<i64>, ReadError> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for counter in counters {
            validate_counter(counter.as_ref())?;
            pipe.cmd("MGET")
                .arg(self.keyspace.counter_keys(counter.as_ref()));
        }
        let mut conn = self.conn.clone();
        let rows: Vec<Vec<Option<i64>>> = pipe.query_async(&mut conn).await?;
        counters
            .iter()
            .zip(&rows)
            .map(|(counter, values)| sum(counter.as_ref(), values))
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
