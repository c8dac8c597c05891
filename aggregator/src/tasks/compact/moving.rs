//! Moves against resets. A reset is one write per group, so it may clear the source group after
//! a move took the counter's share there and the base group before the move gives it (the
//! amount, older than the reset, would come back), or clear the source before the take and
//! the base after the give (the amount, newer than the reset, would be cleared with the base
//! share). While a compactor runs, every group it stamped is marked moving
//! (`tally_common::layout::MOVING_FIELD`), and each reset applied there records where it was in
//! the log (`Keyspace::resets_key`, under the counter's share key: `"<partition field>
//! <offset>"` of its last reset from each partition in the group, joined by `;`,
//! `tally_common::layout::reset_entries`); a group has applied a reset once its ledger entry
//! for the partition is past the offset. A counter of unkeyed traffic is reset from several
//! partitions, and a group may have applied one partition's reset and not an earlier one of
//! another's, so every partition's last reset is kept, not only the group's last. The take
//! carries the source group's record in the move id, and the give (`scripts/compact_give.lua`):
//! - drops the amount if the base group applied a reset that the source group had not applied
//!   when the amount was taken (read here from the source's ledger, with its journal still in
//!   place, which no reset since the take has deleted);
//! - waits if the source group had applied a reset that the base group has not yet.
//!
//! Resets applied before a group was marked left no record. So, once every group is marked, the
//! compactor waits until every partition's watermark has passed each group's ledger entry
//! ([`Compactor::settle`]): every reset that may have reached some groups unrecorded has then
//! reached all of them, and no move needs its record. Records are forgotten once their reset
//! is everywhere (at the end of each pass, no move under way), and all of them when the
//! compactor stops ([`Compactor::close`]) and removes the marks.
//!
//! A mark holds a deadline, which the compactor moves a lease ahead every fifth of it
//! ([`LEASE`]). A compactor killed leaves its marks, and once they lapse resets record nothing
//! more. A mark that lapsed under a live compactor (stalled past its lease) may have missed
//! resets, so no take or give goes on in its group (`lapsed`, [`CompactError::Lapsed`]): a
//! compactor started again marks and settles anew. A renewal never revives a lapsed mark.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tally_common::layout::reset_entries;
use tally_common::regroup::watermarks;
use tally_common::{Keyspace, RedisConn};

use super::{CompactError, Compactor, Move};

/// Longest [`Compactor::settle`] waits for every partition's watermark to pass its ledgers.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// Longest a give waits for the base group to apply a reset the source group had applied.
pub const BEHIND_LIMIT: Duration = Duration::from_secs(60);

/// How often either wait looks again.
const POLL: Duration = Duration::from_millis(100);

/// Records a forget deletes per script call.
const FORGET_BATCH: usize = 500;

/// How long a group's moving mark holds after it is set or renewed. A compactor renews its marks
/// every fifth of it; one killed (or stalled longer) leaves marks that lapse, so resets stop
/// recording in groups no compactor moves from (`scripts/compact_moving.lua`).
pub(super) const LEASE: Duration = Duration::from_secs(30);

/// What a give decides from: the base group's record of the counter's resets as read ('' for
/// none), and whether the source group had not applied one of them when the amount was taken.
pub(super) struct Verdict {
    pub(super) expected: String,
    pub(super) cancel: bool,
}

impl Compactor {
    /// Marks every stamped group moving, starts renewing the marks, then
    /// [`Compactor::settle`]s.
    pub(super) async fn mark_moving(&self) -> Result<(), CompactError> {
        let lease = [self.lease.as_millis().to_string()];
        for group in 0..self.groups {
            self.moving_step(group, "set", &lease).await?;
        }
        self.start_renewal();
        self.settle().await
    }

    /// Starts the task that renews every group's mark each fifth of the lease, until a renewal
    /// finds its mark lapsed or fenced (the compactor's next take or give then fails) or the
    /// compactor stops.
    fn start_renewal(&self) {
        let (conn, keyspace, script) = (
            self.conn.clone(),
            self.keyspace.clone(),
            self.moving.clone(),
        );
        let (epoch, groups, lease) = (self.epoch, self.groups, self.lease);
        let task = tokio::spawn(async move {
            let lease_ms = [lease.as_millis().to_string()];
            let call = MovingCall {
                conn: &conn,
                keyspace: &keyspace,
                script: &script,
                epoch,
            };
            loop {
                tokio::time::sleep(lease / 5).await;
                for group in 0..groups {
                    match call.step(group, "renew", &lease_ms).await {
                        Ok(_) => {}
                        Err(error @ (CompactError::Lapsed | CompactError::Fenced)) => {
                            tracing::warn!(group, %error, "compactor: renewals stop");
                            return;
                        }
                        Err(error) => {
                            tracing::warn!(group, %error, "compactor: renewing a moving mark failed; trying again");
                        }
                    }
                }
            }
        });
        let previous = self
            .renewal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .replace(task.abort_handle());
        if let Some(previous) = previous {
            previous.abort();
        }
    }

    /// Stops renewing the marks.
    pub(super) fn stop_renewal(&self) {
        let task = self
            .renewal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            task.abort();
        }
    }

    /// Waits until every partition's watermark is at or past where its ledger entries were in
    /// every group when it was called: a reset that some groups applied before they were marked
    /// has then reached every group. Fails after [`SETTLE_LIMIT`], naming the partitions still
    /// behind (a partition whose owner stopped mid-flush: start its aggregator).
    pub(super) async fn settle(&self) -> Result<(), CompactError> {
        let mut reached: HashMap<String, i64> = HashMap::new();
        for group in 0..self.groups {
            let ledgers: Vec<(String, i64)> = redis::cmd("HGETALL")
                .arg(self.keyspace.ledger_key(group))
                .query_async(&mut self.conn.clone())
                .await?;
            for (partition, entry) in ledgers {
                let most = reached.entry(partition).or_insert(entry);
                *most = (*most).max(entry);
            }
        }
        let deadline = Instant::now() + SETTLE_LIMIT;
        loop {
            let watermarks = self.watermarks().await?;
            let mut behind: Vec<&str> = (reached.iter())
                .filter(|(p, entry)| watermarks.get(*p).is_none_or(|w| w < *entry))
                .map(|(p, _)| p.as_str())
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                behind.sort_unstable();
                return Err(CompactError::Unsettled(behind.join(", ")));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Every partition's watermark: where everything before is applied in every group.
    async fn watermarks(&self) -> Result<HashMap<String, i64>, CompactError> {
        let stored = watermarks(&self.conn, &self.keyspace, self.groups).await?;
        Ok((stored.into_iter())
            .filter_map(|(partition, watermark)| Some((partition, watermark?.next_offset)))
            .collect())
    }

    /// Deletes the records of resets every group has applied (all of them with `all`), and
    /// returns how many it deleted. Only with no move under way.
    pub(super) async fn forget_resets(&self, all: bool) -> Result<usize, CompactError> {
        let watermarks = if all {
            HashMap::new()
        } else {
            self.watermarks().await?
        };
        let mut deleted = 0;
        for group in 0..self.groups {
            let resets = self.keyspace.resets_key(group);
            let mut cursor: u64 = 0;
            let mut found: Vec<String> = Vec::new();
            loop {
                let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                    .arg(&resets)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut self.conn.clone())
                    .await?;
                for (field, record) in pairs {
                    let everywhere = reset_entries(&record).is_some_and(|entries| {
                        (entries.iter()).all(|(p, o)| watermarks.get(*p).is_some_and(|w| w > o))
                    });
                    if all || everywhere {
                        found.extend([field, record]);
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
            for pairs in found.chunks(2 * FORGET_BATCH) {
                deleted += self.moving_step(group, "forget", pairs).await?;
            }
        }
        Ok(deleted)
    }

    /// Removes the marks of the groups this compactor marked and forgets every record: a
    /// compactor that stops (or is stopped) leaves nothing recorded. A later compactor marks
    /// and settles again.
    pub async fn close(&self) -> Result<(), CompactError> {
        self.stop_renewal();
        for group in 0..self.groups {
            self.moving_step(group, "clear", &[]).await?;
        }
        self.forget_resets(true).await?;
        Ok(())
    }

    /// One call of `scripts/compact_moving.lua` in `group`; returns the records it deleted.
    async fn moving_step(
        &self,
        group: u32,
        step: &str,
        args: &[String],
    ) -> Result<usize, CompactError> {
        let call = MovingCall {
            conn: &self.conn,
            keyspace: &self.keyspace,
            script: &self.moving,
            epoch: self.epoch,
        };
        call.step(group, step, args).await
    }

    /// What the give of `under_way` decides from: the base group's record of the counter's
    /// resets, and whether the source group had not applied one of them when the amount was
    /// taken.
    pub(super) async fn verdict(&self, under_way: &Move) -> Result<Verdict, CompactError> {
        let Move {
            counter,
            from,
            base,
            id,
            amount,
        } = under_way;
        let share = self.keyspace.counter_key(*base, counter);
        let expected: Option<String> = redis::cmd("HGET")
            .arg(self.keyspace.resets_key(*base))
            .arg(&share)
            .query_async(&mut self.conn.clone())
            .await?;
        let Some(entries) = expected.as_deref().and_then(reset_entries) else {
            return Ok(Verdict {
                expected: expected.unwrap_or_default(),
                cancel: false,
            });
        };
        // The source's journal and ledger entries together (one slot): with the journal still
        // there, no reset reached the source since the take, so its ledger says what it had
        // applied then.
        let partitions: Vec<&str> = entries.iter().map(|(partition, _)| *partition).collect();
        let (journal, ledger): (Option<String>, Vec<Option<i64>>) = redis::pipe()
            .atomic()
            .get(self.keyspace.journal_key(*from, counter))
            .cmd("HMGET")
            .arg(self.keyspace.ledger_key(*from))
            .arg(&partitions)
            .query_async(&mut self.conn.clone())
            .await?;
        let ours = journal.as_deref() == Some(format!("{id}:{amount}").as_str());
        let applied = ledger.len() == entries.len()
            && (entries.iter().zip(&ledger))
                .all(|((_, offset), entry)| entry.is_some_and(|entry| entry > *offset));
        let cancel = !ours || !applied;
        Ok(Verdict {
            expected: expected.unwrap_or_default(),
            cancel,
        })
    }

    /// Whether a give answered `behind` for longer than [`BEHIND_LIMIT`] since `since`; if
    /// not, waits a moment before it gives again.
    pub(super) async fn still_behind(
        &self,
        under_way: &Move,
        since: Instant,
    ) -> Result<(), CompactError> {
        if since.elapsed() >= BEHIND_LIMIT {
            return Err(CompactError::Behind {
                counter: under_way.counter.clone(),
                group: under_way.base,
            });
        }
        tokio::time::sleep(POLL).await;
        Ok(())
    }
}

/// What a call of `scripts/compact_moving.lua` needs: the compactor's, or the renewal task's
/// copies of them.
struct MovingCall<'a> {
    conn: &'a RedisConn,
    keyspace: &'a Keyspace,
    script: &'a redis::Script,
    epoch: u64,
}

impl MovingCall<'_> {
    /// One call in `group`: `step` with `args`; returns the records it deleted.
    async fn step(&self, group: u32, step: &str, args: &[String]) -> Result<usize, CompactError> {
        let mut invocation = self.script.key(self.keyspace.fence_key(group));
        invocation.key(self.keyspace.resets_key(group));
        invocation.arg(self.epoch).arg(step);
        for value in args {
            invocation.arg(value);
        }
        let reply: redis::Value = invocation.invoke_async(&mut self.conn.clone()).await?;
        match reply {
            redis::Value::Int(deleted) => Ok(usize::try_from(deleted).unwrap_or(0)),
            redis::Value::BulkString(text) if text == b"fenced" => Err(CompactError::Fenced),
            redis::Value::BulkString(text) if text == b"lapsed" => Err(CompactError::Lapsed),
            other => Err(CompactError::Protocol(format!("{other:?}"))),
        }
    }
}
