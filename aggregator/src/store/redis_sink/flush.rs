//! The exactly-once flush through `scripts/flush.lua`: the cells read, the script's call, and
//! the runs of likes counted by their sets written before it by plain commands in one
//! `MULTI`/`EXEC` with it, where the sink can.

use std::sync::atomic::Ordering;

use redis::{ErrorKind, FromRedisValue, ServerErrorKind, Value};
use tally_common::{DeadLetterReason, Keyspace};

use super::{RedisSink, cells_io::stale_cells, parse_number, unexpected};
use crate::machine::likes::LikeRun;
use crate::machine::verdict::window_rejections;
use crate::store::cells::{self, MAX_STALE_READS, Rereads};
use crate::store::script_call::ScriptCall;
use crate::store::sink::{Applied, GroupWrite, Refused, Rejection, SinkError, SinkErrorKind};
use crate::store::store_error::RedisReply;
use crate::store::transactions::Transactions;

impl RedisSink {
    pub(super) async fn script_apply_fenced(
        &self,
        write: GroupWrite<'_>,
    ) -> Result<Applied, SinkError> {
        let reads = cells::Reads::new(&self.keyspace, write.group, write.windows);
        let mut rereads = Rereads::new(MAX_STALE_READS);
        loop {
            let (plan, predicted) =
                (self.read_cells(write.group, &reads, write.windows, rereads.may_predict()))
                    .await?;
            match self.script_flush(write, &plan).await? {
                Some(applied) => {
                    if applied == Applied::Written {
                        self.recall.wrote(write.group, &plan.writes);
                    }
                    return Ok(applied);
                }
                None => {
                    self.recall.stale(write.group, predicted);
                    if !rereads.again_after(predicted).await {
                        return Err(stale_cells());
                    }
                }
            }
        }
    }

    /// One run of `scripts/flush.lua`; `None` when a cells field changed since it was read.
    async fn script_flush(
        &self,
        write: GroupWrite<'_>,
        plan: &cells::Plan,
    ) -> Result<Option<Applied>, SinkError> {
        // Runs counted by their sets are written before the script where they can be (see the
        // script's top); if one of their sets holds another type, the script alone tries the
        // write again, and finds every refusal as it would have.
        let mut sets_first = true;
        let mut tried = self.script_flush_once(write, plan, sets_first).await?;
        // A group packed otherwise than this writer knew: it learns and writes again (a group's
        // mark is set once, so the second try agrees).
        for _ in 0..2 {
            match &tried {
                Tried::ScriptAlone if sets_first => sets_first = false,
                Tried::Replied(reply) if reply.first().is_some_and(|s| s == "layout") => {
                    let buckets: u32 = parse_number(reply, 1)?;
                    if buckets == self.packing.buckets(write.group) {
                        return Err(unexpected(reply));
                    }
                    self.packing.learn(write.group, buckets);
                }
                _ => break,
            }
            tried = self.script_flush_once(write, plan, sets_first).await?;
        }
        match tried {
            Tried::Stopped(stopped) => Ok(Some(stopped)),
            Tried::Replied(reply) if reply.first().is_some_and(|s| s == "stale") => Ok(None),
            Tried::Replied(reply) => fenced_flush_reply(&reply, write).map(Some),
            Tried::ScriptAlone => Err(unexpected(&[SETS_REFUSED.to_owned()])),
        }
    }

    /// [`RedisSink::script_flush`]'s one try, writing runs counted by their sets before the
    /// script if `sets_first` and the sink can.
    async fn script_flush_once(
        &self,
        write: GroupWrite<'_>,
        plan: &cells::Plan,
        sets_first: bool,
    ) -> Result<Tried, SinkError> {
        let ks = &self.keyspace;
        let refused = window_rejections(&plan.currents, write.windows);
        let likes = write.members;
        // Never with resets, which the script applies before anything is added.
        let before = match &self.transactions {
            Some(transactions) if sets_first && write.resets.is_empty() => self
                .sets_first
                .load(Ordering::Relaxed)
                .then_some(&**transactions),
            _ => None,
        };
        // Which runs' likes are counted by their sets: they pass no counter key; those written
        // before pass nothing else either.
        let by_set: String = (likes.each_run())
            .map(|run| match ks.likes_by_set(run.counter) {
                true if before.is_some() => RUN_BEFORE as char,
                true => '1',
                false => '0',
            })
            .collect();
        let counted = by_set.bytes().filter(|&b| b == b'0').count();
        // Packed: the deltas go to their buckets' hashes, as the group's mark says.
        let buckets = self.packing.buckets(write.group);
        let deltas = match buckets {
            0 => write.deltas.len().to_string(),
            _ => format!("{}/{buckets}", write.deltas.len()),
        };
        let fields: usize = plan.writes.iter().map(|s| s.fields.len()).sum();
        // Members of the runs the script writes (none of those written before it).
        let members: usize = (likes.each_run().zip(by_set.bytes()))
            .filter(|(_, flag)| *flag != RUN_BEFORE)
            .map(|(run, _)| run.members().len())
            .sum();
        let mut invocation = ScriptCall::with_capacity(
            &self.scripts.flush,
            3 + write.deltas.len()
                + plan.writes.len()
                + 4 * write.resets.len()
                + 1
                + likes.runs()
                + counted,
            11 + write.deltas.len()
                + 2 * plan.writes.len()
                + 3 * fields
                + 2 * refused.len()
                + 2 * likes.runs()
                + members
                + write.resets.len(),
        );
        invocation
            .key(ks.fence_key(write.group))
            .key(ks.ledger_key(write.group))
            .key(ks.watermark_key(write.group))
            .arg(write.field)
            .arg(write.epoch)
            .arg(write.expected_ledger)
            .arg(write.next_offset)
            .arg(write.watermark.unwrap_or(""))
            .arg(&deltas)
            .arg(plan.writes.len())
            .arg(write.resets.len())
            .arg(write.windows.len())
            .arg(refused.len())
            .arg(&by_set);
        // KEYS and ARGV are two lists: each part adds its keys and its arguments in turn.
        let mut key = String::new();
        for (counter, delta) in write.deltas {
            match buckets {
                0 => ks.write_counter_key(&mut key, write.group, counter),
                _ => {
                    let bucket = Keyspace::bucket_of(counter, buckets);
                    ks.write_packed_key(&mut key, write.group, bucket);
                }
            }
            invocation.key(&key).arg(*delta);
        }
        for stripe in &plan.writes {
            stripe.add_to(&mut invocation);
        }
        for counter in write.resets.iter().map(|r| &r.counter) {
            invocation
                .key(ks.counter_key(write.group, counter))
                .key(ks.likes_key(write.group, counter))
                .key(ks.journal_key(write.group, counter));
        }
        if buckets > 0 {
            for counter in write.resets.iter().map(|r| &r.counter) {
                let bucket = Keyspace::bucket_of(counter, buckets);
                invocation.key(ks.packed_key(write.group, bucket));
            }
        }
        if !write.resets.is_empty() {
            invocation.key(ks.resets_key(write.group));
        }
        for rejection in &refused {
            if let Refused::Window(i) = rejection.refused {
                invocation
                    .arg(write.deltas.len() + i + 1)
                    .arg(rejection.reason.as_str());
            }
        }
        // The runs of likes: every set, then every counter key (none for a run counted by its
        // set), then per run its likers and unlikers.
        for (run, flag) in likes.each_run().zip(by_set.bytes()) {
            if flag != RUN_BEFORE {
                ks.write_set_key(&mut key, write.group, run.counter, flag == b'1');
                invocation.key(&key);
            }
        }
        for (run, flag) in likes.each_run().zip(by_set.bytes()) {
            if flag == RUN_BEFORE {
                continue;
            }
            if flag == b'0' {
                ks.write_counter_key(&mut key, write.group, run.counter);
                invocation.key(&key);
            }
            invocation.arg(run.likes.len()).arg(run.unlikes.len());
            for m in run.members() {
                invocation.arg(likes.actor(m));
            }
        }
        // Packed: the fields; then the resets' offsets, last.
        if buckets > 0 {
            for (counter, _) in write.deltas {
                invocation.arg(counter);
            }
            for reset in write.resets {
                invocation.arg(&reset.counter);
            }
        }
        for reset in write.resets {
            invocation.arg(reset.offset);
        }
        match before {
            Some(transactions) if by_set.as_bytes().contains(&RUN_BEFORE) => {
                invocation.key(ks.set_check_key(write.group));
                (self.sets_then_script(transactions, write, &by_set, &invocation)).await
            }
            _ => Ok(Tried::Replied(
                invocation.invoke(&mut self.conn.clone()).await?,
            )),
        }
    }

    /// The runs flagged [`RUN_BEFORE`] in `by_set` written by plain `SADD`s and `SREM`s, checked
    /// and followed by `script` in one `MULTI`/`EXEC`, where `write` may land (see
    /// `scripts/flush.lua`'s top).
    async fn sets_then_script(
        &self,
        transactions: &Transactions,
        write: GroupWrite<'_>,
        by_set: &str,
        script: &ScriptCall<'_>,
    ) -> Result<Tried, SinkError> {
        let ks = &self.keyspace;
        let likes = write.members;
        let before: Vec<LikeRun<'_>> = (likes.each_run().zip(by_set.bytes()))
            .filter(|(_, flag)| *flag == RUN_BEFORE)
            .map(|(run, _)| run)
            .collect();
        let check = ks.set_check_key(write.group);
        // Every command made at its size: grown an argument at a time, the buffers of a
        // catch-up's hundreds of thousands of SADDs were reallocated several times each.
        let mut writes = redis::Pipeline::with_capacity(2 * before.len() + 4);
        writes.atomic().ignore_errors();
        let mut sets = redis::Cmd::with_capacity(before.len() + 3, 64 * (before.len() + 2));
        sets.arg("SINTERSTORE")
            .arg(&check)
            .arg(ks.none_key(write.group));
        let mut key = String::new();
        for run in &before {
            ks.write_set_key(&mut key, write.group, run.counter, true);
            for (command, members) in [("SADD", &run.likes), ("SREM", &run.unlikes)] {
                if !members.is_empty() {
                    let bytes = likes.actors_len(members.clone()) + key.len() + 4;
                    let mut cmd = redis::Cmd::with_capacity(members.len() + 2, bytes);
                    cmd.arg(command).arg(&key);
                    for m in members.clone() {
                        cmd.arg(likes.actor(m));
                    }
                    writes.add_command(cmd).ignore();
                }
            }
            sets.arg(&key);
        }
        writes.cmd("DEL").arg(ks.none_key(write.group)).ignore();
        writes.cmd("SET").arg(&check).arg(1).ignore();
        writes.add_command(sets).ignore();
        writes.add_command(script.command());
        // A script Redis no longer knows (restarted, SCRIPT FLUSH) is loaded and the whole
        // tried again.
        for _ in 0..2 {
            let replies = match transactions.exec_if_owner(&write, &writes).await {
                Ok(Ok(replies)) => replies,
                Ok(Err(stopped)) => return Ok(Tried::Stopped(stopped)),
                Err(e) if e.redis().is_some_and(refuses_commands) => {
                    // An ACL from before this way of writing (no SINTERSTORE), which discarded
                    // the whole transaction: the script alone takes this write, and every one
                    // from now on.
                    if self.sets_first.swap(false, Ordering::Relaxed) {
                        tracing::warn!(
                            error = %e.source,
                            "Redis refuses a command of the likes' fast path: they are written by the flush script alone (grant +sinterstore to use it)"
                        );
                    }
                    return Ok(Tried::ScriptAlone);
                }
                Err(e) => return Err(e),
            };
            let reply = match replies.last() {
                Some(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::NoScript) => {
                    script.load(&mut self.conn.clone()).await?;
                    continue;
                }
                Some(value) => Vec::<String>::from_redis_value(value.clone())
                    .map_err(|e| SinkError::from(redis::RedisError::from(e)))?,
                None => return Err(unexpected(&[])),
            };
            if reply.first().is_some_and(|s| s == SETS_REFUSED) {
                return Ok(Tried::ScriptAlone);
            }
            return Ok(Tried::Replied(reply));
        }
        Err(SinkError {
            kind: SinkErrorKind::Retryable,
            source: Box::new(redis::RedisError::from((
                ErrorKind::Server(ServerErrorKind::ExecAbort),
                "the flush script is unknown to Redis",
                "twice in a row, loaded in between".into(),
            ))),
        })
    }
}

/// What one try of the flush script came to.
enum Tried {
    /// The script's reply.
    Replied(Vec<String>),
    /// Stopped before the script ran: not the owner, already applied, or rolled back.
    Stopped(Applied),
    /// The runs written before the script could not be (a set of another type, which wrote
    /// nothing of its run, or an ACL without their commands): the script alone is to try.
    ScriptAlone,
}

/// The flag of a run of likes written before the flush script (`scripts/flush.lua`).
const RUN_BEFORE: u8 = b'2';

/// The flush script's reply when a set of a run written before it holds another type.
const SETS_REFUSED: &str = "sets_refused";

/// Whether `e` is a server refusing one of the commands a flush runs outside its script: an
/// ACL without it (`NOPERM` when queued, which discards the transaction: `EXECABORT`).
fn refuses_commands(e: &redis::RedisError) -> bool {
    (e.clone().into_server_errors())
        .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "NOPERM"))
}

/// `scripts/flush.lua`'s reply, other than `{'stale'}`.
fn fenced_flush_reply(reply: &[String], write: GroupWrite<'_>) -> Result<Applied, SinkError> {
    match reply.first().map(String::as_str) {
        Some("ok") => Ok(Applied::Written),
        Some("duplicate") => Ok(Applied::AlreadyApplied),
        Some("fenced") => Ok(Applied::from_fence(
            parse_number(reply, 1).ok(),
            write.epoch,
        )),
        Some("rolled_back") => Ok(Applied::RolledBack),
        Some("failed") => Err(SinkError::from(RedisReply(
            reply.get(1).cloned().unwrap_or_default(),
        ))),
        Some("rejected") => {
            let mut rejections = Vec::new();
            for pair in reply[1..].chunks(2) {
                // A reason not about the data is not a refusal: the write is retried.
                let [index, reason] = pair else {
                    return Err(unexpected(reply));
                };
                let refused = (index.parse().ok()).map(|i| write.refused(i));
                let reason = DeadLetterReason::from_script(reason);
                let (Some(refused), Some(reason)) = (refused.filter(|r| !r.is_empty()), reason)
                else {
                    return Err(unexpected(reply));
                };
                rejections.extend(
                    refused
                        .into_iter()
                        .map(|refused| Rejection { refused, reason }),
                );
            }
            Ok(Applied::Rejected(rejections))
        }
        _ => Err(unexpected(reply)),
    }
}
