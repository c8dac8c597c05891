//! [`RedisSink`]: the [`Sink`] that writes to Redis, standalone or cluster.
//!
//! - at-least-once: a group's `INCRBY`s inside one `MULTI`/`EXEC`;
//! - exactly-once: one Lua script per group (`scripts/flush.lua`) that checks the writer's fence,
//!   recognises a write the group already applied, and writes all of it or, when Redis refuses a
//!   counter, none of it (undoing what it wrote). On a standalone server in `auto` mode, the
//!   likes counted by their sets are written before it by plain `SADD`s and `SREM`s in one
//!   `MULTI`/`EXEC` with it, under a `WATCH` of the fence (`flush`): in Lua each member costs
//!   Redis about twice as much. The other scripts take epochs, stamp fences and store
//!   watermarks (see `crate::store::fence`). For servers that refuse scripts the same operations run as optimistic
//!   `WATCH`/`MULTI`/`EXEC` transactions (`crate::store::transactions`), chosen by the
//!   `redis_atomicity` setting: `auto` (the default) tries scripts and switches for good on the
//!   first refusal (`NOPERM`, or an unknown `EVALSHA`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::ErrorKind;
use tally_common::{DeadLetterReason, Keyspace, RedisConn, RedisTarget};

use crate::machine::batch::{Reset, WindowDelta};
use crate::machine::pace::{MEMBERSHIPS_PER_ENTRY, MEMBERSHIPS_PER_ENTRY_BEFORE_SCRIPT};
use crate::operator::config::Atomicity;
use crate::store::packing::Packing;
use crate::store::recall::{self, Recall, RecallCounts};
use crate::store::sink::{
    Applied, GroupWrite, IdleWrite, Marked, Refused, Rejection, Sink, SinkError, SinkErrorKind,
    Stamp,
};
use crate::store::store_error::{ERR_FIELD_NOT_AN_INTEGER, ERR_NOT_AN_INTEGER, ERR_OVERFLOW};
use crate::store::transactions::{TRANSACTION_GROUP_ENTRIES, Transactions, redis_integer};

mod cells_io;
mod fence_io;
mod flush;

/// `scripts/flush.lua`, after the functions it shares: the cells', and the moving mark's.
pub const FLUSH_SCRIPT: &str = concat!(
    include_str!("../scripts/cells_lib.lua"),
    include_str!("../scripts/moving_lib.lua"),
    include_str!("../scripts/flush.lua")
);

/// `scripts/cells.lua`, after the cells functions.
pub const CELLS_SCRIPT: &str = concat!(
    include_str!("../scripts/cells_lib.lua"),
    include_str!("../scripts/cells.lua")
);

/// The Lua scripts, hashed once.
#[derive(Debug)]
struct Scripts {
    flush: redis::Script,
    cells: redis::Script,
    stamp: redis::Script,
    epoch: redis::Script,
    watermark: redis::Script,
    rewind: redis::Script,
    idle: redis::Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            flush: redis::Script::new(FLUSH_SCRIPT),
            cells: redis::Script::new(CELLS_SCRIPT),
            stamp: redis::Script::new(include_str!("../scripts/stamp.lua")),
            epoch: redis::Script::new(include_str!("../scripts/epoch.lua")),
            watermark: redis::Script::new(include_str!("../scripts/watermark.lua")),
            rewind: redis::Script::new(include_str!("../scripts/rewind.lua")),
            idle: redis::Script::new(include_str!("../scripts/idle.lua")),
        }
    }
}

/// Longest [`RedisSink::probe_scripts`] waits for its answer.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The Redis sink.
#[derive(Debug, Clone)]
pub struct RedisSink {
    /// The connection (standalone or cluster).
    conn: RedisConn,
    /// Which keys to write.
    keyspace: Keyspace,
    /// The exactly-once scripts.
    scripts: Arc<Scripts>,
    /// The same operations as transactions, on a standalone server unless set to scripts only.
    transactions: Option<Arc<Transactions>>,
    /// Whether the exactly-once operations run as scripts (else as transactions).
    use_scripts: Arc<AtomicBool>,
    /// Whether a server refusing scripts switches this sink to transactions (else it is an error).
    fall_back: bool,
    /// The cells fields this writer read and wrote, so that its scripts can skip reading them.
    recall: Arc<Recall>,
    /// Whether runs of likes counted by their sets are written by plain commands before the
    /// flush script, in one `MULTI`/`EXEC` with it (with transactions only; off for good once
    /// the server refuses one of those commands).
    sets_first: Arc<AtomicBool>,
    /// Which groups pack their counters' shares, as far as this writer knows.
    packing: Arc<Packing>,
}

impl RedisSink {
    /// A sink writing through `conn` (which reaches `target`) into `keyspace`, making
    /// exactly-once writes atomic as `atomicity` says.
    pub fn new(
        conn: RedisConn,
        target: &RedisTarget,
        keyspace: Keyspace,
        atomicity: Atomicity,
    ) -> redis::RedisResult<Self> {
        let transactions = match atomicity {
            Atomicity::Scripts => None,
            _ if conn.is_cluster() => None,
            _ => Some(Arc::new(Transactions::new(target, keyspace.clone())?)),
        };
        Ok(Self {
            conn,
            keyspace,
            scripts: Arc::new(Scripts::new()),
            transactions,
            use_scripts: Arc::new(AtomicBool::new(atomicity != Atomicity::Transactions)),
            fall_back: atomicity == Atomicity::Auto,
            recall: Arc::new(Recall::new(recall::DEFAULT_FIELDS)),
            sets_first: Arc::new(AtomicBool::new(true)),
            packing: Arc::default(),
        })
    }

    /// A sink that runs the exactly-once operations as scripts only (the compactor's).
    pub fn scripts_only(conn: RedisConn, keyspace: Keyspace) -> Self {
        Self {
            conn,
            keyspace,
            scripts: Arc::new(Scripts::new()),
            transactions: None,
            use_scripts: Arc::new(AtomicBool::new(true)),
            fall_back: false,
            recall: Arc::new(Recall::new(recall::DEFAULT_FIELDS)),
            sets_first: Arc::new(AtomicBool::new(false)),
            packing: Arc::default(),
        }
    }

    /// Runs `script`, or `transaction` when this sink uses transactions; in auto mode a server
    /// refusing the script switches the sink to transactions for good.
    async fn either<'a, T, B>(
        &'a self,
        script: impl Future<Output = Result<T, SinkError>>,
        transaction: impl FnOnce(&'a Transactions) -> B,
    ) -> Result<T, SinkError>
    where
        B: Future<Output = Result<T, SinkError>>,
    {
        if self.use_scripts.load(Ordering::Relaxed) {
            match script.await {
                Err(e) if e.redis().is_some_and(refuses_scripts) => {
                    if !self.fall_back {
                        return Err(e);
                    }
                    self.switch_to_transactions(&e.source);
                }
                other => return other,
            }
        }
        match &self.transactions {
            Some(transactions) => transaction(transactions).await,
            None => Err(SinkError {
                kind: SinkErrorKind::Fatal,
                source: Box::new(redis::RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "Redis refuses scripts, and transactions are not supported on Redis Cluster",
                ))),
            }),
        }
    }

    /// In auto mode, finds out before the first write whether the server runs scripts, so that
    /// one that refuses them gets transactions from the first batch on, batched for them
    /// ([`Sink::max_group_entries`]): an `EVALSHA` of a script no server holds is refused (no
    /// permission, or no such command) or answered `NOSCRIPT`. Any other answer, or none within
    /// `PROBE_TIMEOUT` (Redis down or unreachable at start), leaves it to the first write, as
    /// before, without holding up the start.
    pub async fn probe_scripts(&self) {
        if !self.fall_back || self.transactions.is_none() {
            return;
        }
        let (mut conn, mut probe) = (self.conn.clone(), redis::cmd("EVALSHA"));
        probe.arg("0".repeat(40)).arg(0);
        let reply = probe.query_async::<redis::Value>(&mut conn);
        if let Ok(Err(e)) = tokio::time::timeout(PROBE_TIMEOUT, reply).await
            && refuses_scripts(&e)
        {
            self.switch_to_transactions(&e);
        }
    }

    /// Runs the exactly-once operations as transactions from now on.
    fn switch_to_transactions(&self, error: &dyn std::fmt::Display) {
        if self.use_scripts.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                error = %error,
                "Redis refuses scripts: exactly-once writes switch to WATCH/MULTI/EXEC transactions"
            );
        }
    }
}

/// Whether `e` is a server refusing to run scripts: an ACL without `@scripting` (`NOPERM`) or
/// `EVAL`/`EVALSHA` renamed or disabled (`unknown command`).
fn refuses_scripts(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or("").to_ascii_lowercase();
    let about_scripts = detail.contains("eval") || detail.contains("script");
    match e.code() {
        Some("NOPERM") => about_scripts,
        Some("ERR") => detail.contains("unknown command") && about_scripts,
        _ => false,
    }
}

/// Why Redis refused an `INCRBY` on `key`, if it is about the key's data: `WRONGTYPE`, the
/// overflow error, or "not an integer" once `GET` shows a string that is not a 64-bit integer.
async fn data_refusal(
    conn: &mut RedisConn,
    (key, field): (&str, Option<&str>),
    error: &redis::RedisError,
) -> Result<Option<DeadLetterReason>, SinkError> {
    let detail = error.detail().unwrap_or("");
    let not_an_integer = match field {
        None => ERR_NOT_AN_INTEGER,
        Some(_) => ERR_FIELD_NOT_AN_INTEGER,
    };
    Ok(match error.code() {
        Some("WRONGTYPE") => Some(DeadLetterReason::WrongType),
        Some("ERR") if detail.contains(ERR_OVERFLOW) => Some(DeadLetterReason::Overflow),
        Some("ERR") if detail.contains(not_an_integer) => {
            let value: Option<Vec<u8>> = match field {
                None => redis::cmd("GET").arg(key).query_async(conn).await?,
                Some(field) => {
                    redis::cmd("HGET")
                        .arg(key)
                        .arg(field)
                        .query_async(conn)
                        .await?
                }
            };
            (value.is_some_and(|v| redis_integer(&v).is_none()))
                .then_some(DeadLetterReason::NotAnInteger)
        }
        _ => None,
    })
}

/// A script reply the scripts never give.
fn unexpected(reply: &[String]) -> SinkError {
    SinkError {
        kind: SinkErrorKind::Fatal,
        source: Box::new(redis::RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "unexpected script reply",
            format!("{reply:?}"),
        ))),
    }
}

fn parse_number<T: std::str::FromStr>(reply: &[String], at: usize) -> Result<T, SinkError> {
    reply
        .get(at)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| unexpected(reply))
}

impl Sink for RedisSink {
    async fn apply(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        windows: &[WindowDelta],
        resets: &[Reset],
    ) -> Result<Vec<Rejection>, SinkError> {
        let mut rejected = Vec::new();
        if !deltas.is_empty() || !resets.is_empty() {
            rejected = self.apply_totals(group, deltas, resets).await?;
        }
        if !windows.is_empty() {
            let refused = (self.either(self.script_cells(group, windows), |t| {
                t.apply_cells(group, windows)
            }))
            .await?;
            rejected.extend(refused);
        }
        Ok(rejected)
    }

    async fn apply_fenced(&self, write: GroupWrite<'_>) -> Result<Applied, SinkError> {
        self.either(self.script_apply_fenced(write), |t| t.apply_fenced(write))
            .await
    }

    fn recall_counts(&self) -> Option<RecallCounts> {
        Some(self.recall.counts())
    }

    fn memberships_per_entry(&self) -> usize {
        // Where every deduplicating namespace counts likes by sets, they go before the script
        // (an ACL that refuses it switches to the script later, with the warning that names
        // the grant: the batch being filled then may run up to twice as long on likes, and the
        // loop weighs the next ones by the script's cost from its next tick).
        let likes = self.keyspace.every_dedup_by_set();
        let before = self.transactions.is_some()
            && self.use_scripts.load(Ordering::Relaxed)
            && self.sets_first.load(Ordering::Relaxed);
        if before && likes {
            MEMBERSHIPS_PER_ENTRY_BEFORE_SCRIPT
        } else {
            MEMBERSHIPS_PER_ENTRY
        }
    }

    fn max_group_entries(&self) -> usize {
        if self.use_scripts.load(Ordering::Relaxed) {
            usize::MAX
        } else {
            TRANSACTION_GROUP_ENTRIES
        }
    }

    async fn forget_cached(&self, counters: &[String]) -> Result<(), SinkError> {
        // One DEL per key: the cache keys carry no hash tag, so on a cluster they live anywhere
        // (one request each there: redis-rs refuses a cluster pipeline that spans slots).
        let deletes = (counters.iter())
            .map(|counter| {
                let mut del = redis::cmd("DEL");
                del.arg(self.keyspace.cache_key(counter));
                del
            })
            .collect();
        tally_common::connection::query_each::<redis::Value>(&self.conn, deletes).await?;
        Ok(())
    }

    async fn next_epoch(&self, home: u32, field: &str, at_least: u64) -> Result<u64, SinkError> {
        self.either(self.script_next_epoch(home, field, at_least), |t| {
            t.next_epoch(home, field, at_least)
        })
        .await
    }

    async fn stamp_fence(&self, group: u32, field: &str, epoch: u64) -> Result<Stamp, SinkError> {
        self.either(self.script_stamp_fence(group, field, epoch), |t| {
            t.stamp_fence(group, field, epoch)
        })
        .await
    }

    async fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> Result<Applied, SinkError> {
        self.either(
            self.fenced_write(
                &self.scripts.watermark,
                home,
                self.keyspace.watermark_key(home),
                field,
                epoch,
                watermark,
            ),
            |t| t.write_watermark(home, field, epoch, watermark),
        )
        .await
    }

    async fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> Result<Applied, SinkError> {
        let ledger = self.keyspace.ledger_key(group);
        let script = &self.scripts.rewind;
        self.either(
            self.fenced_write(script, group, ledger, field, epoch, to),
            |t| t.rewind_ledger(group, field, epoch, to),
        )
        .await
    }

    async fn read_fence_and_ledger(
        &self,
        group: u32,
        field: &str,
    ) -> Result<(Option<u64>, Option<i64>), SinkError> {
        let mut conn = self.conn.clone();
        Ok(redis::pipe()
            .hget(self.keyspace.fence_key(group), field)
            .hget(self.keyspace.ledger_key(group), field)
            .query_async(&mut conn)
            .await?)
    }

    async fn mark_idle(&self, write: IdleWrite<'_>) -> Result<Marked, SinkError> {
        self.either(self.script_mark_idle(write), |t| t.mark_idle(write))
            .await
    }

    async fn idle_counters(
        &self,
        home: u32,
        field: &str,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, SinkError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("ZRANGE")
            .arg(self.keyspace.idle_key(home, field))
            .arg("-inf")
            .arg(now_ms)
            .arg("BYSCORE")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await?)
    }

    async fn read_watermark(&self, home: u32, field: &str) -> Result<Option<String>, SinkError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("HGET")
            .arg(self.keyspace.watermark_key(home))
            .arg(field)
            .query_async(&mut conn)
            .await?)
    }

    async fn read_plan(&self) -> Result<Option<String>, SinkError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("GET")
            .arg(self.keyspace.plan_key())
            .query_async(&mut conn)
            .await?)
    }

    async fn likes_moved(&self, group: u32) -> Result<bool, SinkError> {
        if !self.keyspace.likes_in_shares() {
            return Ok(false);
        }
        let mut conn = self.conn.clone();
        let mark: Option<String> = redis::cmd("HGET")
            .arg(self.keyspace.fence_key(group))
            .arg(tally_common::layout::MOVED_FIELD)
            .query_async(&mut conn)
            .await?;
        Ok(mark.is_some())
    }
}

impl RedisSink {
    /// An at-least-once write's resets and deltas, with the deltas refused: the deltas as
    /// fields where the group is marked packed (read at most once per `UNMARKED_FOR` while it is
    /// not), and the resets clearing the fields wherever it is marked now.
    async fn apply_totals(
        &self,
        group: u32,
        deltas: &[(String, i64)],
        resets: &[Reset],
    ) -> Result<Vec<Rejection>, SinkError> {
        let ks = &self.keyspace;
        // A reset reads the mark itself: a field moved there in the last moment must go too.
        let buckets = match self.packing.known(group) {
            Some(buckets) if resets.is_empty() => buckets,
            _ => {
                let mark: Option<u32> = redis::cmd("HGET")
                    .arg(ks.fence_key(group))
                    .arg(tally_common::layout::PACKED_FIELD)
                    .query_async(&mut self.conn.clone())
                    .await?;
                self.packing.learn(group, mark.unwrap_or(0));
                mark.unwrap_or(0)
            }
        };
        // One MULTI/EXEC, each command's reply kept: Redis refuses a transaction it cannot run
        // (out of memory, read-only, no permission) whole, before running any of it, but runs
        // the rest when one command fails on its data, so those are told apart here.
        let mut pipe = redis::pipe();
        pipe.atomic().ignore_errors();
        for counter in resets.iter().map(|r| &r.counter) {
            pipe.cmd("DEL")
                .arg(ks.counter_key(group, counter))
                .arg(ks.likes_key(group, counter))
                .arg(ks.journal_key(group, counter))
                .ignore();
            if buckets > 0 {
                let bucket = Keyspace::bucket_of(counter, buckets);
                pipe.cmd("HDEL")
                    .arg(ks.packed_key(group, bucket))
                    .arg(counter)
                    .ignore();
            }
        }
        let mut key = String::new();
        for (counter, delta) in deltas {
            if buckets > 0 {
                ks.write_packed_key(&mut key, group, Keyspace::bucket_of(counter, buckets));
                pipe.cmd("HINCRBY").arg(&key).arg(counter).arg(*delta);
            } else {
                ks.write_counter_key(&mut key, group, counter);
                pipe.cmd("INCRBY").arg(&key).arg(*delta);
            }
        }
        let mut conn = self.conn.clone();
        let replies: Vec<redis::RedisResult<redis::Value>> = pipe.query_async(&mut conn).await?;
        // One reply per INCRBY or HINCRBY (the DELs and HDELs are ignored).
        let mut rejected = Vec::new();
        for (i, reply) in replies.into_iter().enumerate() {
            let Err(error) = reply else { continue };
            // Rare: a key is built again only for a refused command.
            let counter = &deltas[i].0;
            let place = match buckets {
                0 => (ks.counter_key(group, counter), None),
                _ => {
                    let bucket = Keyspace::bucket_of(counter, buckets);
                    (ks.packed_key(group, bucket), Some(counter.as_str()))
                }
            };
            match data_refusal(&mut conn, (&place.0, place.1), &error).await? {
                Some(reason) => rejected.push(Rejection {
                    refused: Refused::Delta(i),
                    reason,
                }),
                // Not about the data: fail the flush (the rest of the transaction ran; the
                // retry adds it again, a duplicate that at-least-once allows).
                None => return Err(SinkError::from(error)),
            }
        }
        Ok(rejected)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_reason_the_flush_script_gives_is_a_dead_letter_reason() {
        // The refusals are `reason = '<label>'` and, in `refusal`, `return '<label>'`.
        let script = include_str!("../scripts/flush.lua");
        let labels: BTreeSet<&str> = (script.lines().map(str::trim))
            .filter_map(|line| {
                let rest =
                    (line.strip_prefix("reason = '")).or_else(|| line.strip_prefix("return '"))?;
                rest.split('\'').next()
            })
            .collect();
        let reasons: BTreeSet<DeadLetterReason> = (labels.iter())
            .map(|label| label.parse().expect("a DeadLetterReason label"))
            .collect();
        assert_eq!(
            reasons,
            BTreeSet::from([
                DeadLetterReason::Overflow,
                DeadLetterReason::NotAnInteger,
                DeadLetterReason::WrongType,
            ])
        );
    }
}
