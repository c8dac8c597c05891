//! [`PgSink`]: the [`Sink`] for PostgreSQL as the store of record.
//!
//! A counter's shares are rows `(counter, shard) → value` in the deployment's schema (named by
//! the key prefix, created and migrated by [`tally_common::pg`]); a shard is a shard group, as in
//! Redis. The exactly-once bookkeeping sits beside them: `partitions (field, shard) → fence,
//! ledger`, `epochs (field) → epoch`, `watermarks (field) → watermark`.
//!
//! Each exactly-once flush into a group is one transaction: it locks the partition's fence and
//! ledger row in that group and the batch's share rows (in counter order, so two flushes never
//! deadlock), decides exactly as the Redis script does (`crate::machine::verdict::flush_verdict`:
//! fenced, already applied, rolled back, or a delta that would overflow 64 bits), then clears
//! the group's part of each reset (the counter's share row here and the `members` rows whose
//! like it holds), applies the deltas as one multi-row upsert (`INSERT … ON CONFLICT … DO
//! UPDATE SET value = value + EXCLUDED.value`), applies the likes and then the unlikes through
//! `members`, one statement each (a like adds 1 only if the actor was not a member, an unlike
//! takes 1 only if it was; a batch holds one action per counter and actor, so the order between
//! them is moot), moves the ledger, stores the watermark when asked, and commits. So a crash, a
//! retried flush whose first attempt committed, and a zombie owner all end with every offset
//! applied once, as with Redis.
//!
//! Connections come from a pool (deadpool-postgres). Errors are classified by their SQLSTATE
//! (`crate::store::store_error`): a lost connection, a pool timeout, a shutdown, too many connections,
//! a read-only transaction, a full disk, a serialization failure, a deadlock or a cancelled
//! statement heal by themselves; the rest need an operator. Every one is retried, and none
//! refuses a delta: only the overflow check on the locked shares does.

use std::future::Future;

use deadpool_postgres::{Pool, PoolError};

use crate::machine::batch::{Reset, WindowDelta};
use crate::machine::verdict::{
    Current, MemberState, flush_verdict, next_epoch_after, rejections, stamp_refusal,
    watermark_refusal,
};
use crate::store::sink::{Applied, GroupWrite, Refused, Rejection, Sink, SinkError, Stamp};
use crate::store::store_error::{ErrorClass, pg_class};
use tally_common::pg::Schema;

/// Classifies a PostgreSQL error by its SQLSTATE (`crate::store::store_error::pg_class`).
fn classify(error: tokio_postgres::Error) -> SinkError {
    // Without a SQLSTATE, a closed connection or an I/O failure is the connection's; anything
    // else (a conversion or protocol error) is unknown. All are retried.
    let io = std::error::Error::source(&error).is_some_and(|s| s.is::<std::io::Error>());
    let class = match error.code() {
        Some(code) => pg_class(code.code()),
        None if error.is_closed() || io => ErrorClass::Unavailable,
        None => ErrorClass::Unknown,
    };
    SinkError::of_class(class, PgError(error))
}

/// A PostgreSQL error that says what the server said: tokio-postgres's own `Display` of a
/// server's error is only "db error".
#[derive(Debug)]
struct PgError(tokio_postgres::Error);

impl std::fmt::Display for PgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_db_error() {
            Some(db) => write!(
                f,
                "PostgreSQL {} ({}): {}",
                db.severity(),
                db.code().code(),
                db.message()
            ),
            None => write!(f, "PostgreSQL: {}", self.0),
        }
    }
}

impl std::error::Error for PgError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn pool_error(error: PoolError) -> SinkError {
    match error {
        PoolError::Backend(e) => classify(e),
        // Timed out waiting for a connection, or could not make one: the pool heals by itself.
        other => SinkError::retryable(other.to_string()),
    }
}

impl From<tokio_postgres::Error> for SinkError {
    fn from(error: tokio_postgres::Error) -> Self {
        classify(error)
    }
}

/// The batch's `(counter, delta)` pairs in counter order (the lock order), as two arrays.
/// Windows are not kept in PostgreSQL: the configuration refuses them with `--store postgres`,
/// and this refuses any that got through.
fn no_windows(windows: &[WindowDelta]) -> Result<(), SinkError> {
    if windows.is_empty() {
        return Ok(());
    }
    Err(SinkError::fatal(
        "windowed counts are not kept in PostgreSQL (--store postgres): remove the namespace's windows",
    ))
}

fn sorted_columns(deltas: &[(String, i64)]) -> (Vec<&str>, Vec<i64>) {
    let mut pairs: Vec<(&str, i64)> = deltas.iter().map(|(c, d)| (c.as_str(), *d)).collect();
    pairs.sort_unstable_by(|a, b| a.0.cmp(b.0));
    pairs.into_iter().unzip()
}

/// A [`Sink`] writing to PostgreSQL. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct PgSink {
    pool: Pool,
    schema: Schema,
}

impl std::fmt::Debug for PgSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSink")
            .field("schema", &self.schema.name())
            .finish_non_exhaustive()
    }
}

impl PgSink {
    /// A sink over `pool`, writing the tables of `schema` (already migrated).
    pub fn new(pool: Pool, schema: Schema) -> Self {
        Self { pool, schema }
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, SinkError> {
        self.pool.get().await.map_err(pool_error)
    }

    /// At-least-once: in one transaction, clears the reset counters' rows, locks the batch's
    /// shares in counter order, refuses the deltas that would take a share past 64 bits, and
    /// adds the rest.
    async fn apply_now(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        resets: &[Reset],
    ) -> Result<Vec<Rejection>, SinkError> {
        let sql = &self.schema.sql;
        let shard = group as i32;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        if !resets.is_empty() {
            // At least once there are no member sets: a reset is the counter's rows here.
            let resets = counters(resets);
            tx.execute(&sql.reset_shares, &[&shard, &resets]).await?;
        }
        let (touched, _) = sorted_columns(deltas);
        let rows = tx.query(&sql.lock_shares, &[&shard, &touched]).await?;
        let held: std::collections::HashMap<String, i64> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let currents: Vec<Current> = (deltas.iter())
            .map(|(c, _)| {
                held.get(c)
                    .map_or(Current::Missing, |v| Current::Integer(*v))
            })
            .collect();
        let rejected = rejections(&currents, deltas);
        let refused: std::collections::HashSet<usize> = (rejected.iter())
            .filter_map(|r| match r.refused {
                Refused::Delta(i) => Some(i),
                _ => None,
            })
            .collect();
        let kept: Vec<(String, i64)> = (deltas.iter().enumerate())
            .filter(|(i, _)| !refused.contains(i))
            .map(|(_, d)| d.clone())
            .collect();
        let (counters, values) = sorted_columns(&kept);
        tx.execute(&sql.upsert_shares, &[&shard, &counters, &values])
            .await?;
        tx.commit().await?;
        Ok(rejected)
    }

    async fn apply_fenced_now(&self, write: GroupWrite<'_>) -> Result<Applied, SinkError> {
        let sql = &self.schema.sql;
        no_windows(write.windows)?;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let shard = write.group as i32;
        let row = tx
            .query_opt(&sql.lock_partition, &[&write.field, &shard])
            .await?;
        let fence: Option<u64> = row
            .as_ref()
            .and_then(|r| r.get::<_, Option<i64>>(0))
            .map(|f| f as u64);
        let ledger: Option<i64> = row.as_ref().and_then(|r| r.get(1));
        // Every share the write touches, and every share it resets, locked in counter order.
        let mut touched: Vec<&str> = (write.deltas.iter().map(|(c, _)| c.as_str()))
            .chain(write.members.each_run().map(|run| run.counter))
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let mut locked: Vec<&str> = touched
            .iter()
            .copied()
            .chain(write.resets.iter().map(|r| r.counter.as_str()))
            .collect();
        locked.sort_unstable();
        locked.dedup();
        let rows = tx.query(&sql.lock_shares, &[&shard, &locked]).await?;
        let held: std::collections::HashMap<String, i64> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        // A reset counter's share is cleared before the write: what the batch adds to it
        // starts from nothing.
        let current = |counter: &str| match held.get(counter) {
            Some(v) if !write.resets.iter().any(|r| r.counter == counter) => Current::Integer(*v),
            _ => Current::Missing,
        };
        let currents: Vec<Current> = write.deltas.iter().map(|(c, _)| current(c)).collect();
        // A members table always takes a like: only the share can refuse one (64 bits).
        let members: Vec<MemberState> = (write.members.iter())
            .map(|m| MemberState {
                member: Some(false),
                counter: current(m.counter),
            })
            .collect();
        if let Some(verdict) = flush_verdict(fence, ledger, &currents, &[], &members, &write) {
            // Nothing written: the transaction rolls back as it is dropped.
            return Ok(verdict);
        }
        if !write.resets.is_empty() {
            // This group's part of each reset: its share, and the members whose likes it holds.
            let resets = counters(write.resets);
            tx.execute(&sql.reset_shares, &[&shard, &resets]).await?;
            tx.execute(&sql.reset_members, &[&shard, &resets]).await?;
        }
        // Every touched share row exists after this, created in counter order (a counter only
        // liked gets a 0 first), so the likes below take no new locks out of order.
        let deltas: std::collections::HashMap<&str, i64> =
            write.deltas.iter().map(|(c, d)| (c.as_str(), *d)).collect();
        let values: Vec<i64> = touched
            .iter()
            .map(|c| deltas.get(c).copied().unwrap_or(0))
            .collect();
        tx.execute(&sql.upsert_shares, &[&shard, &touched, &values])
            .await?;
        // As the script: a like counts if the actor was not a member, an unlike if it was. A
        // batch holds one action per (counter, actor), so their order does not matter: all the
        // likes go in one statement and all the unlikes in another, which was one statement per
        // membership (the likes workload ran at 12-15 k events/s that way).
        for like in [true, false] {
            let (counters, actors): (Vec<&str>, Vec<&str>) = (write.members.iter())
                .filter(|m| m.like == like)
                .map(|m| (m.counter, m.actor))
                .unzip();
            if counters.is_empty() {
                continue;
            }
            let statement = tx
                .prepare_cached(if like { &sql.likes } else { &sql.unlikes })
                .await?;
            tx.execute(&statement, &[&counters, &actors, &shard])
                .await?;
        }
        tx.execute(&sql.set_ledger, &[&write.field, &shard, &write.next_offset])
            .await?;
        if let Some(watermark) = write.watermark {
            tx.execute(&sql.set_watermark, &[&write.field, &watermark])
                .await?;
        }
        tx.commit().await?;
        Ok(Applied::Written)
    }

    async fn next_epoch_now(&self, field: &str, at_least: u64) -> Result<u64, SinkError> {
        let client = self.client().await?;
        let first = next_epoch_after(None, at_least) as i64;
        let row = client
            .query_one(
                &self.schema.sql.next_epoch,
                &[&field, &first, &(at_least as i64)],
            )
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    async fn stamp_fence_now(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> Result<Stamp, SinkError> {
        let sql = &self.schema.sql;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let shard = group as i32;
        tx.execute(&sql.ensure_partition, &[&field, &shard]).await?;
        let row = tx.query_one(&sql.lock_partition, &[&field, &shard]).await?;
        let current = row.get::<_, Option<i64>>(0).map(|f| f as u64);
        if let Some(stale) = stamp_refusal(current, epoch) {
            return Ok(stale);
        }
        tx.execute(&sql.set_fence, &[&field, &shard, &(epoch as i64)])
            .await?;
        tx.commit().await?;
        Ok(Stamp::Stamped {
            ledger: row.get::<_, Option<i64>>(1).unwrap_or(-1),
        })
    }

    async fn write_watermark_now(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> Result<Applied, SinkError> {
        let sql = &self.schema.sql;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let row = tx
            .query_opt(&sql.lock_partition, &[&field, &(home as i32)])
            .await?;
        let fence = row
            .and_then(|r| r.get::<_, Option<i64>>(0))
            .map(|f| f as u64);
        if let Some(refused) = watermark_refusal(fence, epoch) {
            return Ok(refused);
        }
        tx.execute(&sql.set_watermark, &[&field, &watermark])
            .await?;
        tx.commit().await?;
        Ok(Applied::Written)
    }

    async fn rewind_ledger_now(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> Result<Applied, SinkError> {
        let sql = &self.schema.sql;
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let shard = group as i32;
        let row = tx.query_opt(&sql.lock_partition, &[&field, &shard]).await?;
        let fence = (row.as_ref())
            .and_then(|r| r.get::<_, Option<i64>>(0))
            .map(|f| f as u64);
        if let Some(refused) = watermark_refusal(fence, epoch) {
            return Ok(refused);
        }
        let ledger: Option<i64> = row.as_ref().and_then(|r| r.get(1));
        if ledger.unwrap_or(-1) > to {
            tx.execute(&sql.set_ledger, &[&field, &shard, &to]).await?;
        }
        tx.commit().await?;
        Ok(Applied::Written)
    }

    async fn read_fence_and_ledger_now(
        &self,
        group: u32,
        field: &str,
    ) -> Result<(Option<u64>, Option<i64>), SinkError> {
        let client = self.client().await?;
        let row = client
            .query_opt(&self.schema.sql.read_partition, &[&field, &(group as i32)])
            .await?;
        Ok(match row {
            Some(row) => (row.get::<_, Option<i64>>(0).map(|f| f as u64), row.get(1)),
            None => (None, None),
        })
    }

    async fn read_watermark_now(&self, field: &str) -> Result<Option<String>, SinkError> {
        let client = self.client().await?;
        let row = client
            .query_opt(&self.schema.sql.read_watermark, &[&field])
            .await?;
        Ok(row.map(|r| r.get(0)))
    }
}

/// The counters of `resets`, as a query's text array.
fn counters(resets: &[Reset]) -> Vec<&str> {
    resets.iter().map(|r| r.counter.as_str()).collect()
}

impl Sink for PgSink {
    fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[Reset],
    ) -> impl Future<Output = Result<Vec<Rejection>, SinkError>> + Send {
        let refused = no_windows(windows);
        async move {
            refused?;
            self.apply_now(group, deltas, resets).await
        }
    }

    fn apply_fenced(
        &self,
        write: GroupWrite<'_>,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        self.apply_fenced_now(write)
    }

    fn next_epoch(
        &self,
        _home: u32,
        field: &str,
        at_least: u64,
    ) -> impl Future<Output = Result<u64, SinkError>> + Send {
        self.next_epoch_now(field, at_least)
    }

    fn stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> impl Future<Output = Result<Stamp, SinkError>> + Send {
        self.stamp_fence_now(group, field, epoch)
    }

    fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        self.write_watermark_now(home, field, epoch, watermark)
    }

    fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> impl Future<Output = Result<Applied, SinkError>> + Send {
        self.rewind_ledger_now(group, field, epoch, to)
    }

    fn read_fence_and_ledger(
        &self,
        group: u32,
        field: &str,
    ) -> impl Future<Output = Result<(Option<u64>, Option<i64>), SinkError>> + Send {
        self.read_fence_and_ledger_now(group, field)
    }

    fn read_watermark(
        &self,
        _home: u32,
        field: &str,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send {
        self.read_watermark_now(field)
    }
}
