//! Compaction: collapsing the shares of counters that have gone cold back into one key (the
//! counter's base group, shard 0), so that a spike does not leave a counter with many keys
//! forever, and resetting their shard counts to one.
//!
//! Moving an amount from one group to another crosses slots, so it cannot be one atomic
//! operation. Each move is three idempotent, fenced steps, each a script in one slot:
//!
//! 1. **take** (source slot): the whole share becomes a journal `"<move id>:<amount>"` and the
//!    share key is deleted. Writes landing afterwards recreate the share; they are not lost.
//! 2. **give** (base slot): the amount is added to the base share, and a marker records the
//!    move id, unless the marker already holds it (a retried step). A reset of the counter
//!    that reached the two groups on either side of the take has the amount dropped instead,
//!    or the give wait for the base group to apply it (`compact/moving.rs`).
//! 3. **done** (source slot, then base slot): the journal, then the marker, are deleted.
//!
//! Readers count a journal unless the base group's marker holds its id (see
//! `tally_common::Reader`), so at every step boundary the total is exact, and a compactor killed
//! anywhere leaves nothing hidden or doubled. The next compactor first finishes every journal it
//! finds, and deletes markers whose journal is gone.
//!
//! Every step checks the compactor's **fence** (field `compactor` of each group's fence hash):
//! a compactor takes a new epoch at start and stamps it into every group, so a stale one (paused,
//! then resumed) has all its steps refused instead of replaying a move whose marker is gone.
//! It then marks every group moving and waits for the partitions' watermarks (`compact/moving.rs`);
//! [`Compactor::close`] removes the marks.
//!
//! A counter is **cold** when its shares have not changed for `cold_after`: each pass records a
//! fingerprint of them (`<prefix>:compact:seen`), and compacts counters whose fingerprint is as
//! old as that (a `cold_after` of zero compacts every counter at once). Counters of namespaces that deduplicate are left alone (their shares live with
//! their actors' member sets). Finding counters uses `SCAN`, so it needs a standalone Redis.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::{AsyncCommands as _, ScanOptions};
use tally_common::keyspace::CompactionKey;
use tally_common::{Keyspace, Namespaces, RedisConn};

mod moving;

use crate::store::fence::take_epoch;
use crate::store::redis_sink::RedisSink;
use crate::store::sink::SinkError;

/// The fence field of the compactor.
const FIELD: &str = "compactor";

/// How many keys of a group's slot [`Compactor::fold_spaced`] lists at a time.
pub const SLOT_BATCH: usize = 10_000;

/// Why a compaction pass stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompactError {
    /// Redis failed; the next pass picks up where this one stopped.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Taking or stamping the compactor's epoch failed.
    #[error(transparent)]
    Fence(#[from] SinkError),
    /// A newer compactor started: this one must stop.
    #[error("a newer compactor took over")]
    Fenced,
    /// Finding counters needs `SCAN`, which a cluster connection does not offer here.
    #[error("compaction needs a standalone Redis (it finds counters with SCAN)")]
    Cluster,
    /// A script answered something it never answers.
    #[error("unexpected reply from a compaction step: {0}")]
    Protocol(String),
    /// Partitions whose writes some groups have not applied yet, a minute after the groups were
    /// marked moving (`moving::SETTLE_LIMIT`): their owner stopped mid-flush.
    #[error(
        "partitions {0} have writes some groups have not applied yet (an aggregator stopped \
         mid-flush?): start their aggregators, then compact again"
    )]
    Unsettled(String),
    /// A move's base group did not apply, within `moving::BEHIND_LIMIT`, a reset of the counter
    /// that the source group had applied when the amount was taken; the move stays journaled
    /// (and counted) for the next pass.
    #[error(
        "group {group} has not applied a reset of {counter} that another group has: its \
         partition's aggregator is behind; the move is finished by the next pass"
    )]
    Behind {
        /// The counter.
        counter: String,
        /// The base group.
        group: u32,
    },
    /// A group's moving mark passed its deadline: this compactor did not renew it in time
    /// (stalled longer than its lease), so resets there may have gone unrecorded. Nothing was
    /// moved in that group; a compactor started again marks and settles anew.
    #[error(
        "this compactor's mark on a group lapsed (it stalled longer than its lease): start it \
         again"
    )]
    Lapsed,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Counters seen with data outside their base share (or a journal).
    pub candidates: usize,
    /// Journals of earlier, interrupted moves finished.
    pub recovered: usize,
    /// Counters compacted to one key.
    pub compacted: usize,
    /// Moves made.
    pub moves: usize,
    /// Applied-move markers deleted after their move was complete.
    pub markers_dropped: usize,
    /// Moves (made or finished) whose amount was dropped: a reset of their counter had cleared
    /// it (`compact/moving.rs`).
    pub dropped: u64,
}

/// What the keyspace holds for one counter, as far as compaction cares.
#[derive(Debug, Default)]
struct Found {
    shares: Vec<u32>,
    journals: Vec<u32>,
    markers: Vec<u32>,
}

/// A journaled move of `counter`'s amount from group `from` to its base group.
#[derive(Debug)]
struct Move {
    counter: String,
    from: u32,
    /// The counter's base group, where the amount goes.
    base: u32,
    id: String,
    amount: String,
}

/// A compactor holding its epoch.
#[derive(Debug)]
pub struct Compactor {
    conn: RedisConn,
    keyspace: Keyspace,
    namespaces: std::sync::Arc<Namespaces>,
    /// How long a counter's shares must stay unchanged before it is compacted.
    cold_after: Duration,
    epoch: u64,
    /// The groups its epoch is stamped in: every group readers summed when it started
    /// (`tally_common::regroup`). Shares in later groups wait for the next compactor.
    groups: u32,
    take: redis::Script,
    give: redis::Script,
    done: redis::Script,
    moving: redis::Script,
    /// Test-only failpoint: abort the process right after this many shares were taken into
    /// journals, before their moves finish (`TALLY_FAILPOINT_COMPACT_ABORT_AFTER_TAKES`).
    abort_after_takes: Option<u64>,
    /// Shares taken so far (for the failpoint).
    takes: std::sync::atomic::AtomicU64,
    /// Moves dropped because a reset of their counter cleared their amount.
    cancelled: std::sync::atomic::AtomicU64,
    /// How long a group's moving mark holds unless renewed (30 s but in tests).
    lease: Duration,
    /// The task renewing the marks, stopped when the compactor closes or is dropped.
    renewal: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Compactor {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Compactor {
    /// Takes a new compactor epoch and stamps it into every group, fencing off any earlier one.
    pub async fn start(
        conn: RedisConn,
        keyspace: Keyspace,
        namespaces: std::sync::Arc<Namespaces>,
        cold_after: Duration,
    ) -> Result<Self, CompactError> {
        Self::start_with_lease(conn, keyspace, namespaces, cold_after, moving::LEASE).await
    }

    /// [`Compactor::start`] with marks that lapse `lease` after their last renewal, instead of
    /// 30 s.
    pub async fn start_with_lease(
        conn: RedisConn,
        keyspace: Keyspace,
        namespaces: std::sync::Arc<Namespaces>,
        cold_after: Duration,
        lease: Duration,
    ) -> Result<Self, CompactError> {
        if conn.is_cluster() {
            return Err(CompactError::Cluster);
        }
        let plan = tally_common::regroup::read_plan(&conn, &keyspace)
            .await
            .map_err(|e| CompactError::Fence(SinkError::fatal(e.to_string())))?;
        let groups = plan.read.max(keyspace.groups());
        Self::open(conn, keyspace, namespaces, cold_after, groups, lease).await
    }

    /// [`Compactor::start`], stamping `groups` groups: a fold of groups past those readers sum
    /// (`crate::tasks::regroup`) needs them stamped too. On a Redis Cluster the compactor it
    /// returns folds with [`Compactor::fold_spaced`] only.
    pub async fn start_over(
        conn: RedisConn,
        keyspace: Keyspace,
        namespaces: std::sync::Arc<Namespaces>,
        cold_after: Duration,
        groups: u32,
    ) -> Result<Self, CompactError> {
        Self::open(
            conn,
            keyspace,
            namespaces,
            cold_after,
            groups,
            moving::LEASE,
        )
        .await
    }

    async fn open(
        conn: RedisConn,
        keyspace: Keyspace,
        namespaces: std::sync::Arc<Namespaces>,
        cold_after: Duration,
        groups: u32,
        lease: Duration,
    ) -> Result<Self, CompactError> {
        let sink = RedisSink::scripts_only(conn.clone(), keyspace.clone());
        let (epoch, _) = take_epoch(&sink, groups, 0, FIELD).await?;
        let compactor = Self {
            conn,
            keyspace,
            namespaces,
            cold_after,
            epoch,
            groups,
            take: redis::Script::new(concat!(
                include_str!("../store/scripts/moving_lib.lua"),
                include_str!("../store/scripts/compact_take.lua")
            )),
            give: redis::Script::new(concat!(
                include_str!("../store/scripts/moving_lib.lua"),
                include_str!("../store/scripts/compact_give.lua")
            )),
            done: redis::Script::new(include_str!("../store/scripts/compact_done.lua")),
            moving: redis::Script::new(concat!(
                include_str!("../store/scripts/moving_lib.lua"),
                include_str!("../store/scripts/compact_moving.lua")
            )),
            abort_after_takes: std::env::var("TALLY_FAILPOINT_COMPACT_ABORT_AFTER_TAKES")
                .ok()
                .and_then(|v| v.parse().ok()),
            takes: std::sync::atomic::AtomicU64::new(0),
            cancelled: std::sync::atomic::AtomicU64::new(0),
            lease,
            renewal: std::sync::Mutex::new(None),
        };
        if let Err(error) = compactor.mark_moving().await {
            // Best effort: a later compactor marks and clears again.
            let _ = compactor.close().await;
            return Err(error);
        }
        Ok(compactor)
    }

    /// This compactor's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// One pass: finish interrupted moves, drop stale markers, compact cold counters.
    pub async fn pass(&self) -> Result<PassReport, CompactError> {
        if self.conn.is_cluster() {
            return Err(CompactError::Cluster);
        }
        let found = self.scan().await?;
        let cancelled_before = self.cancelled();
        let mut report = PassReport {
            candidates: found.len(),
            ..PassReport::default()
        };
        let mut conn = self.conn.clone();
        let seen_key = format!("{}:compact:seen", self.keyspace.prefix());
        for (counter, what) in &found {
            let base = self.keyspace.shard_group(counter, 0);
            for &from in &what.journals {
                if let Some(journaled) = self.journaled(counter, from).await? {
                    self.finish(&journaled).await?;
                    report.recovered += 1;
                }
            }
            for &from in &what.markers {
                if what.journals.contains(&from) {
                    continue;
                }
                // The journal is gone, so its move is complete: the marker is no longer needed.
                let marker: Option<String> = redis::cmd("GET")
                    .arg(self.keyspace.moved_key(base, counter, from))
                    .query_async(&mut conn)
                    .await?;
                if let Some(id) = marker {
                    self.step_done(base, &self.keyspace.moved_key(base, counter, from), &id)
                        .await?;
                    report.markers_dropped += 1;
                }
            }
            let spread = what.shares.iter().any(|&g| g != base);
            if !spread || self.namespaces.policy(counter).dedup {
                continue;
            }
            if !self.is_cold(&seen_key, counter, &what.shares).await? {
                continue;
            }
            // Writers shrink back to one shard within a second; writes to other shards before
            // then are recreated shares, moved by a later pass.
            redis::cmd("ZREM")
                .arg(self.keyspace.shards_key())
                .arg(counter)
                .exec_async(&mut conn)
                .await?;
            for &from in what.shares.iter().filter(|&&g| g != base) {
                if self.move_share(counter, from).await? {
                    report.moves += 1;
                }
            }
            redis::cmd("HDEL")
                .arg(&seen_key)
                .arg(counter)
                .exec_async(&mut conn)
                .await?;
            report.compacted += 1;
        }
        self.forget_resets(false).await?;
        report.dropped = self.cancelled() - cancelled_before;
        Ok(report)
    }

    /// Every counter with a share outside its base group, a journal or a marker.
    async fn scan(&self) -> Result<BTreeMap<String, Found>, CompactError> {
        let pattern = self.keyspace.compaction_pattern();
        let mut found: BTreeMap<String, Found> = BTreeMap::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, keys) = self.conn.scan_page(cursor, &pattern, 1000).await?;
            for key in &keys {
                if let Some((group, kind, counter)) = self.keyspace.parse_compaction_key(key)
                    && group < self.groups
                {
                    let entry = found.entry(counter.to_owned()).or_default();
                    match kind {
                        CompactionKey::Share => entry.shares.push(group),
                        CompactionKey::Journal => entry.journals.push(group),
                        CompactionKey::Moved { from } => entry.markers.push(from),
                    }
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        found.retain(|counter, f| {
            let base = self.keyspace.shard_group(counter, 0);
            !f.journals.is_empty() || !f.markers.is_empty() || f.shares.iter().any(|&g| g != base)
        });
        Ok(found)
    }

    /// Whether `counter`'s shares have not changed for `cold_after` (recording them if they
    /// did). With `cold_after` zero every counter counts as cold: compact everything now.
    async fn is_cold(
        &self,
        seen_key: &str,
        counter: &str,
        groups: &[u32],
    ) -> Result<bool, CompactError> {
        if self.cold_after.is_zero() {
            return Ok(true);
        }
        let mut conn = self.conn.clone();
        let mut groups = groups.to_vec();
        groups.sort_unstable();
        let mut pipe = redis::pipe();
        for &g in &groups {
            pipe.get(self.keyspace.counter_key(g, counter));
        }
        let values: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
        let fingerprint: String = groups
            .iter()
            .zip(&values)
            .map(|(g, v)| format!("{g}={}", v.as_deref().unwrap_or("")))
            .collect::<Vec<_>>()
            .join(",");
        let seen: Option<String> = redis::cmd("HGET")
            .arg(seen_key)
            .arg(counter)
            .query_async(&mut conn)
            .await?;
        let now = now_ms();
        if let Some((since, print)) = seen.as_deref().and_then(|s| s.split_once('|'))
            && print == fingerprint
        {
            let since: u64 = since.parse().unwrap_or(now);
            return Ok(now.saturating_sub(since) >= self.cold_after.as_millis() as u64);
        }
        redis::cmd("HSET")
            .arg(seen_key)
            .arg(counter)
            .arg(format!("{now}|{fingerprint}"))
            .exec_async(&mut conn)
            .await?;
        Ok(false)
    }

    /// Moves `counter`'s share in `from` to its base group; false if there was nothing to move.
    async fn move_share(&self, counter: &str, from: u32) -> Result<bool, CompactError> {
        let Some(taken) = self.take_share(counter, from).await? else {
            return Ok(false);
        };
        self.finish(&taken).await?;
        Ok(true)
    }

    /// The move journaled in `counter`'s journal in `from`, if there is one.
    async fn journaled(&self, counter: &str, from: u32) -> Result<Option<Move>, CompactError> {
        let journal: Option<String> = redis::cmd("GET")
            .arg(self.keyspace.journal_key(from, counter))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(journal.and_then(|j| self.parse_journal(counter, from, &j)))
    }

    /// A journal's `"<move id>:<amount>"` as the move it records.
    fn parse_journal(&self, counter: &str, from: u32, journal: &str) -> Option<Move> {
        let (id, amount) = journal.split_once(':')?;
        Some(self.move_of(counter, from, id, amount))
    }

    /// Move `id` of `amount` from `counter`'s share in `from` to its base group.
    fn move_of(&self, counter: &str, from: u32, id: &str, amount: &str) -> Move {
        Move {
            counter: counter.to_owned(),
            from,
            base: self.keyspace.shard_group(counter, 0),
            id: id.to_owned(),
            amount: amount.to_owned(),
        }
    }

    /// Step 1: `counter`'s share in `from` becomes a journal. Returns the move (the one already
    /// journaled there, if there is one), or `None` if there is no share.
    async fn take_share(&self, counter: &str, from: u32) -> Result<Option<Move>, CompactError> {
        let id = format!("{:016x}", rand::random::<u64>());
        let mut conn = self.conn.clone();
        let reply: Vec<String> = self
            .take
            .key(self.keyspace.fence_key(from))
            .key(self.keyspace.counter_key(from, counter))
            .key(self.keyspace.journal_key(from, counter))
            .key(self.keyspace.resets_key(from))
            .arg(self.epoch)
            .arg(&id)
            .invoke_async(&mut conn)
            .await?;
        match reply.first().map(String::as_str) {
            Some("taken") => {
                if let Some(limit) = self.abort_after_takes {
                    let n = self.takes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    if n >= limit {
                        eprintln!("failpoint: aborting after {n} shares taken, mid-move");
                        std::process::abort();
                    }
                }
                let amount = reply.get(1).map_or("", String::as_str);
                let id = reply.get(2).map_or(id.as_str(), String::as_str);
                Ok(Some(self.move_of(counter, from, id, amount)))
            }
            Some("pending") => {
                let journal = reply.get(1).map_or("", String::as_str);
                (self.parse_journal(counter, from, journal).map(Some))
                    .ok_or_else(|| CompactError::Protocol(journal.to_owned()))
            }
            Some("empty") => Ok(None),
            Some("fenced") => Err(CompactError::Fenced),
            Some("lapsed") => Err(CompactError::Lapsed),
            _ => Err(CompactError::Protocol(format!("{reply:?}"))),
        }
    }

    /// Moves every share in `groups`, whatever its age, into its counter's base share, and
    /// finishes every move journaled there: a re-grouping retiring those groups
    /// (`crate::tasks::regroup`), once no writer places anything in them. Returns the moves
    /// made; a pass that makes none found the groups empty.
    pub async fn fold(&self, groups: std::ops::Range<u32>) -> Result<usize, CompactError> {
        if self.conn.is_cluster() {
            return Err(CompactError::Cluster);
        }
        let mut moves = 0;
        for group in groups {
            if group >= self.groups {
                return Err(CompactError::Protocol(format!(
                    "group {group} is past the {} this compactor stamped",
                    self.groups
                )));
            }
            let pattern = format!("{}:{{g{group}}}:[cj]:*", self.keyspace.prefix());
            let options = ScanOptions::default()
                .with_pattern(pattern)
                .with_count(1000);
            let mut scan = self.conn.clone();
            let mut keys = scan.scan_options::<String>(options).await?;
            while let Some(key) = keys.next_item().await {
                let key = key?;
                let Some((from, kind, counter)) = self.keyspace.parse_compaction_key(&key) else {
                    continue;
                };
                match kind {
                    CompactionKey::Share => {
                        moves += usize::from(self.move_share(counter, from).await?);
                    }
                    CompactionKey::Journal => {
                        if let Some(journaled) = self.journaled(counter, from).await? {
                            self.finish(&journaled).await?;
                            moves += 1;
                        }
                    }
                    CompactionKey::Moved { .. } => {}
                }
            }
        }
        Ok(moves)
    }

    /// [`Compactor::fold`] on a Redis Cluster, where a read is one request per slot, not a
    /// snapshot: each step runs for every move found, and at least `gap` passes between a move's
    /// steps (take; give; the journal deleted; the marker deleted), so that a read that takes
    /// less than `gap` sees at most one step of each move, which the reader then counts once
    /// (`tally_common::Reader`, on a cluster while a shrink is under way). Finds the shares and
    /// journals of each group with `CLUSTER GETKEYSINSLOT` on its slot's master, at most
    /// [`SLOT_BATCH`] keys at a time; returns the moves made, zero once the groups are empty.
    pub async fn fold_spaced(&self, groups: &[u32], gap: Duration) -> Result<usize, CompactError> {
        let mut moves = Vec::new();
        for &group in groups {
            if group >= self.groups {
                return Err(CompactError::Protocol(format!(
                    "group {group} is past the {} this compactor stamped",
                    self.groups
                )));
            }
            let slot_of = self.keyspace.fence_key(group);
            for key in self.conn.keys_in_slot_of(&slot_of, SLOT_BATCH).await? {
                let Some((from, kind, counter)) = self.keyspace.parse_compaction_key(&key) else {
                    continue;
                };
                if from != group {
                    continue;
                }
                let under_way = match kind {
                    CompactionKey::Share => self.take_share(counter, from).await?,
                    CompactionKey::Journal => self.journaled(counter, from).await?,
                    CompactionKey::Moved { .. } => None,
                };
                moves.extend(under_way);
            }
        }
        if moves.is_empty() {
            return Ok(0);
        }
        tokio::time::sleep(gap).await;
        for under_way in &moves {
            self.give(under_way).await?;
        }
        tokio::time::sleep(gap).await;
        for under_way in &moves {
            self.drop_journal(under_way).await?;
        }
        tokio::time::sleep(gap).await;
        for under_way in &moves {
            self.drop_marker(under_way).await?;
        }
        Ok(moves.len())
    }

    /// Steps 2 and 3 of a journaled move, one after the other.
    async fn finish(&self, under_way: &Move) -> Result<(), CompactError> {
        self.give(under_way).await?;
        self.drop_journal(under_way).await?;
        self.drop_marker(under_way).await
    }

    /// Step 2: the amount joins the base share, and the marker records the move; or it is
    /// dropped, if the base group applied a reset the amount predates (see [`moving`]).
    async fn give(&self, under_way: &Move) -> Result<(), CompactError> {
        let Move {
            counter,
            from,
            base,
            id,
            amount,
        } = under_way;
        let since = std::time::Instant::now();
        loop {
            let verdict = self.verdict(under_way).await?;
            let given: String = self
                .give
                .key(self.keyspace.fence_key(*base))
                .key(self.keyspace.counter_key(*base, counter))
                .key(self.keyspace.moved_key(*base, counter, *from))
                .key(self.keyspace.ledger_key(*base))
                .key(self.keyspace.resets_key(*base))
                .arg(self.epoch)
                .arg(id)
                .arg(amount)
                .arg(&verdict.expected)
                .arg(if verdict.cancel { "cancel" } else { "give" })
                .invoke_async(&mut self.conn.clone())
                .await?;
            match given.as_str() {
                "given" | "already" => return Ok(()),
                "cancelled" => {
                    self.cancelled
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Ok(());
                }
                // A reset landed in the base group since the verdict was read.
                "changed" => {}
                "behind" => self.still_behind(under_way, since).await?,
                "fenced" => return Err(CompactError::Fenced),
                "lapsed" => return Err(CompactError::Lapsed),
                other => return Err(CompactError::Protocol(other.to_owned())),
            }
        }
    }

    /// Moves dropped so far because their amount predated a reset of their counter.
    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Step 3, first half: the journal in the source group is deleted.
    async fn drop_journal(&self, under_way: &Move) -> Result<(), CompactError> {
        let key = self
            .keyspace
            .journal_key(under_way.from, &under_way.counter);
        self.step_done(under_way.from, &key, &under_way.id).await
    }

    /// Step 3, second half: the marker in the base group is deleted.
    async fn drop_marker(&self, under_way: &Move) -> Result<(), CompactError> {
        let Move {
            counter,
            from,
            base,
            ..
        } = under_way;
        let key = self.keyspace.moved_key(*base, counter, *from);
        self.step_done(*base, &key, &under_way.id).await
    }

    /// Deletes a journal or marker of move `id` in `group`.
    async fn step_done(&self, group: u32, key: &str, id: &str) -> Result<(), CompactError> {
        let mut conn = self.conn.clone();
        let reply: String = self
            .done
            .key(self.keyspace.fence_key(group))
            .key(key)
            .arg(self.epoch)
            .arg(id)
            .invoke_async(&mut conn)
            .await?;
        match reply.as_str() {
            "done" | "gone" => Ok(()),
            "fenced" => Err(CompactError::Fenced),
            other => Err(CompactError::Protocol(other.to_owned())),
        }
    }
}
