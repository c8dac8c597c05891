//! The exactly-once operations as optimistic `WATCH`/`MULTI`/`EXEC` transactions, for Redis
//! servers that refuse scripts (an ACL without `@scripting`, `EVAL` renamed away, a managed
//! service that disables it).
//!
//! Each operation mirrors its Lua script in `scripts/`: it `WATCH`es every key its decision reads,
//! reads them, decides in Rust exactly as the script decides in Lua (the same checks in the same
//! order: fence, duplicate, rollback, validation), and writes in one `MULTI`/`EXEC`. If any
//! watched key changed in between, Redis aborts the `EXEC` and the operation starts over from the
//! reads, so what lands is what a script would have written. Writes that do not land are
//! recognised the same way as with scripts: a retry after a lost reply finds the ledger entry.
//!
//! `WATCH` state lives on the connection, so every operation leases a **dedicated** connection
//! from a small pool: never a shared multiplexed one (another task's `EXEC` would clear the
//! watch, or run inside the transaction) and never one that reconnects by itself (a reconnect
//! between `WATCH` and `EXEC` would drop the watch silently). A connection that saw any error is
//! dropped rather than returned. Standalone Redis only: on a cluster the watch would have to be
//! held on the node that owns the slot, which redis-rs's cluster client does not expose.

use std::sync::Mutex;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, Pipeline, ServerErrorKind, Value};
use tally_common::connection::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT};
use tally_common::{Keyspace, RedisTarget};

mod flush;

use crate::machine::batch::WindowDelta;
use crate::machine::verdict::{
    Current, MemberState, flush_verdict, next_epoch_after, stamp_refusal, watermark_refusal,
    window_rejections,
};
use crate::store::cells;
use crate::store::packing::Packing;
use crate::store::sink::{
    Applied, GroupWrite, IdleWrite, Marked, Rejection, SinkError, SinkErrorKind, Stamp,
};

/// How many times one operation starts over after a conflicting write before it reports a
/// retryable error (the flush's own retry then backs off).
const MAX_CONFLICTS: usize = 32;

/// The most entries (counters with deltas, runs of likes, resets) a batch gives one group's
/// transaction ([`crate::machine::pace::Size::max_group_entries`]). `WATCH` checks each key
/// against every key its connection already watches (Redis 7.0.15 here; Valkey made the check a
/// lookup in 2026, valkey-io/valkey#3360), so a transaction watching n keys costs Redis about
/// n² comparisons, all in one command: 0.3 ms for 250 keys, 3.5 ms for 1,000, 13 ms for 2,000
/// and 53 ms for 4,000 (one `WATCH` each, `INFO commandstats`). A catch-up batch of 15,000
/// counters watched ~3,750 keys per group, 23 ms a `WATCH` and 14 CPU-us of Redis per counter
/// written on a long tail; at 512 a group that is 2.7-3.9 us
/// (`docs/performance/measurements.md`).
pub const TRANSACTION_GROUP_ENTRIES: usize = 512;

/// How many idle connections are kept for reuse.
const MAX_IDLE: usize = 16;

/// The transactional implementation of the exactly-once operations.
#[derive(Debug)]
pub struct Transactions {
    /// Opens dedicated connections.
    client: redis::Client,
    /// Connections free for the next operation, each with no `WATCH` pending.
    idle: Mutex<Vec<MultiplexedConnection>>,
    /// Which keys the operations touch.
    keyspace: Keyspace,
    /// Which groups pack their counters' shares, as far as these transactions know.
    packing: Packing,
}

/// What an operation decided after reading under `WATCH`.
enum Plan<'w, T> {
    /// Nothing to write; the answer is known.
    Done(T),
    /// Write this `MULTI`/`EXEC` pipeline; if it lands, the answer is `T`.
    Write(Pipeline, T),
    /// Write this pipeline, already `MULTI`/`EXEC` ([`Pipeline::atomic`]), without a copy.
    WriteAtomic(&'w Pipeline, T),
}

fn protocol_error(what: &'static str, value: &Value) -> SinkError {
    SinkError {
        kind: SinkErrorKind::Fatal,
        source: Box::new(redis::RedisError::from((
            ErrorKind::UnexpectedReturnType,
            what,
            format!("{value:?}"),
        ))),
    }
}

/// A number stored as a string, or `None` when the field or key is absent.
fn number<T: std::str::FromStr>(value: &Value) -> Result<Option<T>, SinkError> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or_else(|| protocol_error("not a number", value)),
        Value::ServerError(e) => Err(SinkError::from(redis::RedisError::from(e.clone()))),
        _ => Err(protocol_error("not a number", value)),
    }
}

/// The 64-bit integer `bytes` hold as Redis reads one (`string2ll`): an optional minus sign and
/// digits, no plus sign, spaces, leading zeros or `-0`; that is, exactly the integer's own
/// decimal form.
pub fn redis_integer(bytes: &[u8]) -> Option<i64> {
    let digits = bytes.strip_prefix(b"-").unwrap_or(bytes);
    let canonical = match digits {
        [b'0'] => digits.len() == bytes.len(),
        [b'0', ..] | [b'+', ..] => false,
        _ => true,
    };
    canonical
        .then(|| std::str::from_utf8(bytes).ok()?.parse().ok())
        .flatten()
}

fn current(value: &Value) -> Result<Current, SinkError> {
    Ok(match value {
        Value::Nil => Current::Missing,
        Value::BulkString(bytes) => {
            redis_integer(bytes).map_or(Current::NotAnInteger, Current::Integer)
        }
        Value::ServerError(e) if e.code() == "WRONGTYPE" => Current::WrongType,
        Value::ServerError(e) => return Err(SinkError::from(redis::RedisError::from(e.clone()))),
        _ => return Err(protocol_error("not a string", value)),
    })
}

/// Adds the cells rewrites to `writes`: per hash one `HSET`, one `HDEL`, and its expiry (`NX`
/// for a new hash, then `GT`: only ever later).
fn rewrite_cells(writes: &mut Pipeline, stripes: &[cells::StripeWrite]) {
    for stripe in stripes {
        let (set, del): (Vec<_>, Vec<_>) = stripe.fields.iter().partition(|f| f.value.is_some());
        if !set.is_empty() {
            let pairs: Vec<(&str, &str)> = (set.iter())
                .filter_map(|f| Some((&*f.field, f.value.as_deref()?)))
                .collect();
            // HSET with many pairs (redis-rs's hset_multiple sends HMSET, which the ACL lacks).
            writes.cmd("HSET").arg(&stripe.key).arg(&pairs).ignore();
        }
        if !del.is_empty() {
            let fields: Vec<&str> = del.iter().map(|f| &*f.field).collect();
            writes.hdel(&stripe.key, fields).ignore();
        }
        for option in ["NX", "GT"] {
            if let Some(expire_at_ms) = stripe.expire_at_ms {
                writes
                    .cmd("PEXPIREAT")
                    .arg(&stripe.key)
                    .arg(expire_at_ms)
                    .arg(option)
                    .ignore();
            }
        }
    }
}

fn conflict() -> SinkError {
    SinkError {
        kind: SinkErrorKind::Retryable,
        source: Box::new(redis::RedisError::from((
            ErrorKind::Server(ServerErrorKind::ExecAbort),
            "watched keys kept changing",
            format!("{MAX_CONFLICTS} transactions aborted in a row"),
        ))),
    }
}

impl Transactions {
    /// Transactions on the standalone server `target`.
    pub fn new(target: &RedisTarget, keyspace: Keyspace) -> redis::RedisResult<Self> {
        Ok(Self {
            client: redis::Client::open(target.url())?,
            idle: Mutex::new(Vec::new()),
            keyspace,
            packing: Packing::default(),
        })
    }

    async fn checkout(&self) -> Result<MultiplexedConnection, SinkError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(conn) = idle {
            return Ok(conn);
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
            .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT));
        Ok(self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?)
    }

    fn release(&self, conn: MultiplexedConnection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
    }

    /// Runs one optimistic operation: `WATCH watch`, run `reads`, let `decide` plan from their
    /// replies, and `EXEC` the plan's writes, starting over when a watched key changed.
    async fn optimistic<T>(
        &self,
        watch: &[String],
        reads: &Pipeline,
        decide: impl FnMut(&[Value]) -> Result<Plan<'static, T>, SinkError>,
    ) -> Result<T, SinkError> {
        Ok(self.optimistic_replies(watch, reads, decide).await?.0)
    }

    /// [`Transactions::optimistic`], with the `EXEC`'s replies (`Nil` when nothing was written).
    async fn optimistic_replies<'w, T>(
        &self,
        watch: &[String],
        reads: &Pipeline,
        mut decide: impl FnMut(&[Value]) -> Result<Plan<'w, T>, SinkError>,
    ) -> Result<(T, Value), SinkError> {
        let mut rereads = cells::Rereads::new(MAX_CONFLICTS);
        loop {
            // On any error the connection is dropped, never returned with a watch pending.
            let mut conn = self.checkout().await?;
            redis::cmd("WATCH").arg(watch).exec_async(&mut conn).await?;
            let replies: Vec<Value> = reads.query_async(&mut conn).await?;
            // EXEC clears the watch whether it runs the writes or aborts them (Nil).
            let (result, answer): (Value, T) = match decide(&replies)? {
                Plan::Done(answer) => {
                    redis::cmd("UNWATCH").exec_async(&mut conn).await?;
                    self.release(conn);
                    return Ok((answer, Value::Nil));
                }
                Plan::Write(mut writes, answer) => {
                    (writes.atomic().query_async(&mut conn).await?, answer)
                }
                Plan::WriteAtomic(writes, answer) => {
                    debug_assert!(writes.is_transaction());
                    (writes.query_async(&mut conn).await?, answer)
                }
            };
            self.release(conn);
            if result != Value::Nil {
                return Ok((answer, result));
            }
            tracing::debug!("transaction aborted by a concurrent write; starting over");
            if !rereads.again().await {
                return Err(conflict());
            }
        }
    }

    /// Runs `writes` (a `MULTI`/`EXEC` pipeline) only where `write` may land: the
    /// group's fence holds the writer's epoch and its ledger entry is neither past the write
    /// nor behind what the writer saw, the fence watched until `EXEC` (no other writer changes
    /// the partition's ledger entry while the fence holds). The `EXEC`'s replies, or what
    /// stopped it.
    pub async fn exec_if_owner(
        &self,
        write: &GroupWrite<'_>,
        writes: &Pipeline,
    ) -> Result<Result<Vec<Value>, Applied>, SinkError> {
        let ks = &self.keyspace;
        let fence_key = ks.fence_key(write.group);
        let mut reads = redis::pipe();
        reads
            .hget(&fence_key, write.field)
            .hget(ks.ledger_key(write.group), write.field);
        let (stopped, replies) = (self.optimistic_replies(&[fence_key], &reads, |replies| {
            let [fence, ledger] = replies else {
                return Err(protocol_error(
                    "short reply",
                    &Value::Array(replies.to_vec()),
                ));
            };
            let (fence, ledger) = (number(fence)?, number(ledger)?);
            Ok(match flush_verdict(fence, ledger, &[], &[], &[], write) {
                Some(verdict) => Plan::Done(Some(verdict)),
                None => Plan::WriteAtomic(writes, None),
            })
        }))
        .await?;
        match (stopped, replies) {
            (Some(verdict), _) => Ok(Err(verdict)),
            (None, Value::Array(replies)) => Ok(Ok(replies)),
            (None, other) => Err(protocol_error("not the replies of EXEC", &other)),
        }
    }

    /// The transactional `scripts/cells.lua`: an at-least-once write's window deltas, with the
    /// ones refused.
    pub async fn apply_cells(
        &self,
        group: u32,
        windows: &[WindowDelta],
    ) -> Result<Vec<Rejection>, SinkError> {
        let cells_reads = cells::Reads::new(&self.keyspace, group, windows);
        if cells_reads.is_empty() {
            return Ok(Vec::new());
        }
        let watch: Vec<String> = (cells_reads.stripes.iter())
            .map(|(key, _)| key.clone())
            .collect();
        let mut reads = redis::pipe();
        reads.ignore_errors();
        cells_reads.add_to(&mut reads);
        self.optimistic(&watch, &reads, |replies| {
            let got = (replies.iter().cloned())
                .map(cells::Read::from_reply)
                .collect::<Result<Vec<_>, _>>()?;
            let plan = cells::plan(&cells_reads, got, windows, tally_common::event::now_ms());
            let refused = window_rejections(&plan.currents, windows);
            if plan.writes.is_empty() {
                return Ok(Plan::Done(refused));
            }
            let mut writes = redis::pipe();
            rewrite_cells(&mut writes, &plan.writes);
            Ok(Plan::Write(writes, refused))
        })
        .await
    }

    /// The transactional `scripts/epoch.lua`.
    pub async fn next_epoch(
        &self,
        home: u32,
        field: &str,
        at_least: u64,
    ) -> Result<u64, SinkError> {
        let key = self.keyspace.epoch_key(home);
        let mut reads = redis::pipe();
        reads.hget(&key, field);
        self.optimistic(std::slice::from_ref(&key), &reads, |replies| {
            let last: Option<u64> = number(replies.first().unwrap_or(&Value::Nil))?;
            let epoch = next_epoch_after(last, at_least);
            let mut writes = redis::pipe();
            writes.hset(&key, field, epoch).ignore();
            Ok(Plan::Write(writes, epoch))
        })
        .await
    }

    /// The transactional `scripts/stamp.lua`.
    pub async fn stamp_fence(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
    ) -> Result<Stamp, SinkError> {
        let (fence_key, ledger_key) = (
            self.keyspace.fence_key(group),
            self.keyspace.ledger_key(group),
        );
        let watch = [fence_key.clone(), ledger_key.clone()];
        let mut reads = redis::pipe();
        reads.hget(&fence_key, field).hget(&ledger_key, field);
        // A writer counting likes in the shares also reads whether the group's were moved.
        if self.keyspace.likes_in_shares() {
            reads.hget(&fence_key, tally_common::layout::MOVED_FIELD);
        }
        self.optimistic(&watch, &reads, |replies| {
            let (fence, ledger, moved) = match replies {
                [fence, ledger] => (fence, ledger, &Value::Nil),
                [fence, ledger, moved] => (fence, ledger, moved),
                _ => {
                    return Err(protocol_error(
                        "short reply",
                        &Value::Array(replies.to_vec()),
                    ));
                }
            };
            if !matches!(moved, Value::Nil) {
                return Err(SinkError::likes_moved(group));
            }
            if let Some(stale) = stamp_refusal(number(fence)?, epoch) {
                return Ok(Plan::Done(stale));
            }
            let mut writes = redis::pipe();
            writes.hset(&fence_key, field, epoch).ignore();
            Ok(Plan::Write(
                writes,
                Stamp::Stamped {
                    ledger: number(ledger)?.unwrap_or(-1),
                },
            ))
        })
        .await
    }

    /// The transactional `scripts/idle.lua`.
    pub async fn mark_idle(&self, write: IdleWrite<'_>) -> Result<Marked, SinkError> {
        let ks = &self.keyspace;
        let (field, home) = (write.field, write.home);
        let fence_key = ks.fence_key(home);
        let watermark_key = ks.watermark_key(home);
        let idle_key = ks.idle_key(home, field);
        let expired_key = ks.expired_key(home, field);
        let watch = [
            fence_key.clone(),
            watermark_key.clone(),
            idle_key.clone(),
            expired_key.clone(),
        ];
        let mut reads = redis::pipe();
        reads
            .hget(&fence_key, field)
            .hget(&watermark_key, field)
            .hgetall(&expired_key);
        for e in write.expiries {
            reads.zscore(&idle_key, &e.counter);
        }
        self.optimistic(&watch, &reads, |replies| {
            let fence: Option<u64> = number(replies.first().unwrap_or(&Value::Nil))?;
            if fence != Some(write.epoch) {
                return Ok(Plan::Done(Marked::Refused(Applied::from_fence(
                    fence,
                    write.epoch,
                ))));
            }
            let parse = |what: &'static str, v: &Value| protocol_error(what, v);
            let watermark: Option<String> = redis::from_redis_value(replies[1].clone())
                .map_err(|_| parse("HGET reply", &replies[1]))?;
            let resume = (watermark.as_deref())
                .and_then(tally_common::keyspace::Watermark::parse)
                .map(|w| w.next_offset);
            let recorded: std::collections::HashMap<i64, String> =
                redis::from_redis_value(replies[2].clone())
                    .map_err(|_| parse("HGETALL reply", &replies[2]))?;
            let mut writes = redis::pipe();
            for offset in recorded.keys() {
                if resume.is_some_and(|resume| *offset < resume) {
                    writes.hdel(&expired_key, *offset).ignore();
                }
            }
            // What the index holds for each record's counter as the records go by.
            let mut index: std::collections::HashMap<&str, Option<i64>> =
                std::collections::HashMap::new();
            let mut decided = Vec::with_capacity(write.expiries.len());
            for (e, reply) in write.expiries.iter().zip(&replies[3..]) {
                let last = match index.get(e.counter.as_str()) {
                    Some(last) => *last,
                    None => redis::from_redis_value::<Option<f64>>(reply.clone())
                        .map_err(|_| parse("ZSCORE reply", reply))?
                        .map(|s| s as i64),
                };
                let expired = match recorded.get(&e.offset) {
                    Some(d) => d == "1",
                    None => {
                        let expired =
                            crate::machine::verdict::expires(last, e.held_deadline, e.deadline_ms);
                        writes
                            .hset(&expired_key, e.offset, if expired { "1" } else { "0" })
                            .ignore();
                        expired
                    }
                };
                let after = if expired {
                    writes.zrem(&idle_key, &e.counter).ignore();
                    None
                } else if let Some(held) = e.held_deadline {
                    writes
                        .cmd("ZADD")
                        .arg(&idle_key)
                        .arg("GT")
                        .arg(held)
                        .arg(&e.counter)
                        .ignore();
                    last.max(Some(held))
                } else {
                    last
                };
                index.insert(&e.counter, after);
                decided.push(expired);
            }
            for chunk in write.touched.chunks(500) {
                let zadd = writes.cmd("ZADD").arg(&idle_key).arg("GT");
                for (counter, deadline) in chunk {
                    zadd.arg(*deadline).arg(counter);
                }
                zadd.ignore();
            }
            Ok(Plan::Write(writes, Marked::Decided(decided)))
        })
        .await
    }

    /// `scripts/rewind.lua`, as a transaction.
    pub async fn rewind_ledger(
        &self,
        group: u32,
        field: &str,
        epoch: u64,
        to: i64,
    ) -> Result<Applied, SinkError> {
        let fence_key = self.keyspace.fence_key(group);
        let ledger_key = self.keyspace.ledger_key(group);
        let mut reads = redis::pipe();
        reads.hget(&fence_key, field).hget(&ledger_key, field);
        let watched = [fence_key.clone(), ledger_key.clone()];
        self.optimistic(&watched, &reads, |replies| {
            let fence: Option<u64> = number(replies.first().unwrap_or(&Value::Nil))?;
            if let Some(refused) = watermark_refusal(fence, epoch) {
                return Ok(Plan::Done(refused));
            }
            let ledger: Option<i64> = number(replies.get(1).unwrap_or(&Value::Nil))?;
            let mut writes = redis::pipe();
            if ledger.unwrap_or(-1) > to {
                writes.hset(&ledger_key, field, to).ignore();
            }
            Ok(Plan::Write(writes, Applied::Written))
        })
        .await
    }

    /// The transactional `scripts/watermark.lua`.
    pub async fn write_watermark(
        &self,
        home: u32,
        field: &str,
        epoch: u64,
        watermark: &str,
    ) -> Result<Applied, SinkError> {
        let fence_key = self.keyspace.fence_key(home);
        let mut reads = redis::pipe();
        reads.hget(&fence_key, field);
        self.optimistic(std::slice::from_ref(&fence_key), &reads, |replies| {
            let fence: Option<u64> = number(replies.first().unwrap_or(&Value::Nil))?;
            if let Some(refused) = watermark_refusal(fence, epoch) {
                return Ok(Plan::Done(refused));
            }
            let mut writes = redis::pipe();
            writes
                .hset(self.keyspace.watermark_key(home), field, watermark)
                .ignore();
            Ok(Plan::Write(writes, Applied::Written))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_as_numbers_and_counter_values() {
        assert_eq!(number::<u64>(&Value::Nil).ok(), Some(None));
        assert_eq!(
            number::<i64>(&Value::BulkString(b"-4".to_vec())).ok(),
            Some(Some(-4))
        );
        assert!(number::<u64>(&Value::BulkString(b"x".to_vec())).is_err());
        assert_eq!(
            current(&Value::BulkString(b"12".to_vec())).ok(),
            Some(Current::Integer(12))
        );
        assert_eq!(
            current(&Value::BulkString(b"1.5".to_vec())).ok(),
            Some(Current::NotAnInteger)
        );
        assert_eq!(
            current(&Value::BulkString(b"+1".to_vec())).ok(),
            Some(Current::NotAnInteger)
        );
        assert_eq!(current(&Value::Nil).ok(), Some(Current::Missing));
    }

    #[test]
    fn an_integer_is_what_redis_reads_as_one() {
        for (text, want) in [
            ("0", Some(0)),
            ("-5", Some(-5)),
            ("9223372036854775807", Some(i64::MAX)),
            ("-9223372036854775808", Some(i64::MIN)),
            ("007", None),
            ("-0", None),
            ("+5", None),
            (" 5", None),
            ("5 ", None),
            ("9223372036854775808", None),
            ("", None),
            ("abc", None),
        ] {
            assert_eq!(redis_integer(text.as_bytes()), want, "{text:?}");
        }
    }
}
