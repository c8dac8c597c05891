//! Re-grouping a live deployment: the **group plan**, recorded in Redis at `<prefix>:groups`,
//! tells writers how many shard groups new offsets go to and readers how many groups to sum.
//!
//! A deployment starts at its configured count (`--shard-groups`, the plan's `origin`) and needs
//! no record until it is re-grouped. Groups are numbered, so a count of 64 includes the 16 groups
//! of a count of 16: a reader that sums more groups than hold shares reads the same total. That
//! makes growing safe in two steps ([`grow`]):
//!
//! 1. **Readers first.** The plan's `read` rises to the new count. A reader uses a plan for at
//!    most [`PLAN_LEASE`] after it asked for it ([`PlanLease`]), so once [`PHASE_WAIT`] has passed
//!    every reader sums the new groups.
//! 2. **Then writers.** The plan's `write` rises. Each aggregator notices within a second, lets
//!    its flush in flight land, and takes its partitions again: the new count applies from the
//!    first offset no group has applied, and the partition's watermark records it beside the
//!    spread (`crate::keyspace::Spread`), so that a replay of older offsets after a crash still
//!    places each message in the group its first attempt did.
//!
//! What a partition places moves; likes (grouped by counter or actor, beside the sets that
//! guard them) stay in their group of the original count, and so do directly written shards and
//! each partition's bookkeeping (epoch, watermark, idle index) in its home group `p mod origin`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::connection::RedisConn;
use crate::keyspace::{Keyspace, MAX_GROUPS, Watermark};

/// How long a reader sums the groups of a plan it read, counted from when it asked.
pub const PLAN_LEASE: Duration = Duration::from_secs(1);

/// How long [`grow`] waits between raising the readers' count and the writers': past every
/// reader's lease, with room for a reader's clock running slow.
pub const PHASE_WAIT: Duration = Duration::from_secs(3);

/// How long a shrink's fold on a Redis Cluster waits between the steps of each move
/// (`tally_aggregator::tasks::regroup`): twice [`FOLD_READ_BOUND`], so that a read bounded by it
/// overlaps at most one step of any move.
pub const FOLD_STEP_GAP: Duration = Duration::from_secs(2);

/// The longest a read on a Redis Cluster may take and stand without asking the plan again: a
/// slower one is read again unless the plan is unchanged and says no shrink is under way (its
/// `write` equal to its `read`) ([`crate::Reader::get_many`]).
pub const FOLD_READ_BOUND: Duration = Duration::from_secs(1);

/// The deployment's group counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPlan {
    /// Bumped by every change, so that a change is stored only over the plan it was made from.
    pub version: u64,
    /// The count the deployment was created with: partitions' home groups (`p mod origin`),
    /// likes and directly written shards stay in these.
    pub origin: u32,
    /// The count writers place new offsets in.
    pub write: u32,
    /// The count readers sum: at least `write`, and every count whose groups may hold shares.
    pub read: u32,
    /// The count windowed reads sum: at least `read`, and more after a shrink while the retired
    /// groups still hold window buckets, which are not folded back but left to expire
    /// (`tally_aggregator::tasks::regroup`).
    pub cells: u32,
    /// How many packed hashes per group readers read counters' shares from, beside their keys
    /// (0: none; `crate::keyspace::Keyspace::packed_key`). Set once, by `tally pack`, before any
    /// group's writers write a share there; never changed after.
    pub buckets: u32,
}

impl GroupPlan {
    /// A deployment never re-grouped: `groups` everywhere.
    pub const fn initial(groups: u32) -> Self {
        Self {
            version: 0,
            origin: groups,
            write: groups,
            read: groups,
            cells: groups,
            buckets: 0,
        }
    }

    /// Its stored form: `v=<version>;origin=<n>;write=<n>;read=<n>`, then `;cells=<n>` when
    /// windowed reads sum more groups than `read`, then `;buckets=<n>` when counters' shares
    /// may be packed (a process that predates either refuses such a plan as unreadable rather
    /// than miss those buckets or those shares).
    pub fn encode(&self) -> String {
        let mut text = format!(
            "v={};origin={};write={};read={}",
            self.version, self.origin, self.write, self.read
        );
        if self.cells > self.read {
            text.push_str(&format!(";cells={}", self.cells));
        }
        if self.buckets > 0 {
            text.push_str(&format!(";buckets={}", self.buckets));
        }
        text
    }

    /// Parses the stored form; `None` if it is not one, or its counts are out of range or read
    /// fewer groups than are written.
    pub fn parse(text: &str) -> Option<Self> {
        const NAMES: [&str; 4] = ["v", "origin", "write", "read"];
        let fields: Vec<(&str, &str)> = (text.split(';'))
            .map(|f| f.split_once('='))
            .collect::<Option<_>>()?;
        let named = fields
            .iter()
            .zip(NAMES)
            .all(|((name, _), want)| *name == want);
        if fields.len() < NAMES.len() || !named {
            return None;
        }
        let count =
            |text: &str| (text.parse::<u32>().ok()).filter(|n| (1..=MAX_GROUPS).contains(n));
        let read = count(fields[3].1)?;
        let mut plan = Self {
            version: fields[0].1.parse().ok()?,
            origin: count(fields[1].1)?,
            write: count(fields[2].1)?,
            read,
            cells: read,
            buckets: 0,
        };
        // Then `cells` and `buckets`, each at most once and in that order.
        let mut optional = fields[NAMES.len()..].iter().peekable();
        if let Some((_, text)) = optional.next_if(|(name, _)| *name == "cells") {
            plan.cells = count(text)?;
        }
        if let Some((_, text)) = optional.next_if(|(name, _)| *name == "buckets") {
            plan.buckets = (text.parse::<u32>().ok()).filter(|&n| valid_buckets(n))?;
        }
        let valid = optional.next().is_none() && plan.read >= plan.write && plan.cells >= plan.read;
        valid.then_some(plan)
    }
}

/// The most packed hashes per group `tally pack` keeps: 2^24.
pub const MAX_BUCKETS: u32 = 1 << 24;

/// Whether `n` is a count of packed hashes per group tally keeps: a power of two from 1 to
/// [`MAX_BUCKETS`].
pub fn valid_buckets(n: u32) -> bool {
    n.is_power_of_two() && n <= MAX_BUCKETS
}

/// Why the plan could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The stored plan is not one.
    #[error("the group plan at {key} is unreadable: {text:?}")]
    Unreadable {
        /// Its key.
        key: String,
        /// What it holds.
        text: String,
    },
    /// The deployment was created with another count than this process is configured with.
    #[error(
        "this deployment was created with {origin} shard groups, but --shard-groups is {configured}: set it to {origin} (the plan at {key} holds the counts in use)"
    )]
    Origin {
        /// Its key.
        key: String,
        /// The recorded count.
        origin: u32,
        /// The configured count.
        configured: u32,
    },
}

/// Reads the deployment's plan; one never re-grouped has none and gets
/// [`GroupPlan::initial`] of the configured count.
pub async fn read_plan(conn: &RedisConn, keyspace: &Keyspace) -> Result<GroupPlan, PlanError> {
    let key = keyspace.plan_key();
    let stored: Option<String> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut conn.clone())
        .await?;
    checked(keyspace, key, stored.as_deref())
}

/// The plan stored as `stored` (none: never re-grouped), checked against the configured count.
pub fn checked(
    keyspace: &Keyspace,
    key: String,
    stored: Option<&str>,
) -> Result<GroupPlan, PlanError> {
    let Some(text) = stored else {
        return Ok(GroupPlan::initial(keyspace.groups()));
    };
    let plan = GroupPlan::parse(text).ok_or_else(|| PlanError::Unreadable {
        key: key.clone(),
        text: text.to_owned(),
    })?;
    if plan.origin != keyspace.groups() {
        return Err(PlanError::Origin {
            key,
            origin: plan.origin,
            configured: keyspace.groups(),
        });
    }
    Ok(plan)
}

/// Stores `plan` if the stored one is still version `plan.version - 1` (none stored counts as
/// version 0); returns whether it did.
async fn store_plan(
    conn: &RedisConn,
    keyspace: &Keyspace,
    plan: &GroupPlan,
) -> Result<bool, PlanError> {
    const SCRIPT: &str = r"
local stored = redis.call('GET', KEYS[1])
local version = 0
if stored then version = tonumber(string.match(stored, '^v=(%d+);')) end
if version ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1";
    let stored: i64 = redis::Script::new(SCRIPT)
        .key(keyspace.plan_key())
        .arg(plan.version.saturating_sub(1))
        .arg(plan.encode())
        .invoke_async(&mut conn.clone())
        .await?;
    Ok(stored == 1)
}

/// Stores `plan` over version `plan.version - 1` (`store_plan`); if another change came first,
/// fails with the plan now stored.
pub async fn replace_plan(
    conn: &RedisConn,
    keyspace: &Keyspace,
    plan: &GroupPlan,
) -> Result<(), RegroupError> {
    if store_plan(conn, keyspace, plan).await? {
        return Ok(());
    }
    Err(RegroupError::Raced(read_plan(conn, keyspace).await?))
}

/// A reader's plan, asked for at most once per [`PLAN_LEASE`]; clones share it.
#[derive(Debug, Clone, Default)]
pub struct PlanLease {
    held: Arc<Mutex<Option<(GroupPlan, Instant)>>>,
}

impl PlanLease {
    /// The plan to read by now: the one held if it was asked for less than a lease ago, else
    /// asked for again.
    pub async fn current(
        &self,
        conn: &RedisConn,
        keyspace: &Keyspace,
    ) -> Result<GroupPlan, PlanError> {
        let held = *self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((plan, asked)) = held
            && asked.elapsed() < PLAN_LEASE
        {
            return Ok(plan);
        }
        let asked = Instant::now();
        let plan = read_plan(conn, keyspace).await?;
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_none_or(|(_, before)| before < asked) {
            *held = Some((plan, asked));
        }
        Ok(plan)
    }
}

/// Where a re-grouping stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The plan now stored.
    pub plan: GroupPlan,
    /// Partitions whose watermark places new offsets in `plan.write` groups, with everything
    /// they placed in more groups than that applied.
    pub moved: Vec<String>,
    /// The other partitions, with the count their new offsets go to: their owner has not taken
    /// them again yet (or none runs), or has not flushed past what it placed the old way.
    pub pending: Vec<(String, u32)>,
}

/// Why a re-grouping was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegroupError {
    /// The plan could not be read or stored.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The count asked for is out of range.
    #[error("a deployment has 1 to {MAX_GROUPS} shard groups, not {0}")]
    Count(u32),
    /// Fewer groups than are in use.
    #[error(
        "growing cannot take {from} shard groups down to {to}: shrinking folds the extra groups' shares back (`tally regroup`, `tally_aggregator::tasks::regroup`)"
    )]
    Shrink {
        /// The count in use.
        from: u32,
        /// The count asked for.
        to: u32,
    },
    /// Another re-grouping changed the plan meanwhile.
    #[error("the group plan changed meanwhile (now {0:?}): run the command again")]
    Raced(GroupPlan),
}

/// Grows the deployment to `to` groups: readers first, then, after [`PHASE_WAIT`], writers
/// (see the module). `say` hears each step. Safe to run again after it was interrupted, and
/// to run when the deployment already writes `to` groups.
pub async fn grow(
    conn: &RedisConn,
    keyspace: &Keyspace,
    to: u32,
    mut say: impl FnMut(&str),
) -> Result<GroupPlan, RegroupError> {
    if !(1..=MAX_GROUPS).contains(&to) {
        return Err(RegroupError::Count(to));
    }
    let plan = read_plan(conn, keyspace).await?;
    if to < plan.write {
        return Err(RegroupError::Shrink {
            from: plan.write,
            to,
        });
    }
    if to == plan.write {
        say(&format!("the deployment already writes {to} groups"));
        return Ok(plan);
    }
    let readers = GroupPlan {
        version: plan.version + 1,
        read: plan.read.max(to),
        cells: plan.cells.max(to),
        ..plan
    };
    replace_plan(conn, keyspace, &readers).await?;
    say(&format!(
        "readers sum {} groups; writers move in {} s",
        readers.read,
        PHASE_WAIT.as_secs()
    ));
    tokio::time::sleep(PHASE_WAIT).await;
    let writers = GroupPlan {
        version: readers.version + 1,
        write: to,
        ..readers
    };
    replace_plan(conn, keyspace, &writers).await?;
    say(&format!(
        "writers place new offsets in {to} groups (from {})",
        plan.write
    ));
    Ok(writers)
}

/// The watermarks stored in groups `0..homes` (a partition's is in its home group): each
/// partition's field with its watermark, `None` where the value is not one this release reads.
pub async fn watermarks(
    conn: &RedisConn,
    keyspace: &Keyspace,
    homes: u32,
) -> redis::RedisResult<Vec<(String, Option<Watermark>)>> {
    let mut all = Vec::new();
    for home in 0..homes {
        let stored: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(keyspace.watermark_key(home))
            .query_async(&mut conn.clone())
            .await?;
        all.extend((stored.into_iter()).map(|(field, text)| (field, Watermark::parse(&text))));
    }
    Ok(all)
}

/// Where each partition stands against the stored plan: its watermark's fan from here on
/// (home groups are `0..origin`).
pub async fn progress(conn: &RedisConn, keyspace: &Keyspace) -> Result<Progress, PlanError> {
    let plan = read_plan(conn, keyspace).await?;
    let (mut moved, mut pending) = (Vec::new(), Vec::new());
    let original = keyspace.groups();
    for (field, watermark) in watermarks(conn, keyspace, original).await? {
        let Some(watermark) = watermark else {
            pending.push((field, original));
            continue;
        };
        let groups = watermark.spread.current_fan().groups_of(original);
        let past = (watermark.spread.within_from(plan.write, original))
            .is_some_and(|from| from == 0 || watermark.next_offset >= from);
        if groups == plan.write && past {
            moved.push(field);
        } else {
            pending.push((field, groups));
        }
    }
    moved.sort();
    pending.sort();
    Ok(Progress {
        plan,
        moved,
        pending,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_bad_ones_are_refused() {
        let plan = GroupPlan {
            version: 3,
            origin: 16,
            write: 16,
            read: 64,
            cells: 64,
            buckets: 0,
        };
        assert_eq!(plan.encode(), "v=3;origin=16;write=16;read=64");
        assert_eq!(GroupPlan::parse(&plan.encode()), Some(plan));
        let windows = GroupPlan {
            read: 16,
            cells: 32,
            ..plan
        };
        assert_eq!(windows.encode(), "v=3;origin=16;write=16;read=16;cells=32");
        assert_eq!(GroupPlan::parse(&windows.encode()), Some(windows));
        let packed = GroupPlan {
            buckets: 4096,
            ..windows
        };
        let text = "v=3;origin=16;write=16;read=16;cells=32;buckets=4096";
        assert_eq!(packed.encode(), text);
        assert_eq!(GroupPlan::parse(text), Some(packed));
        let packed = GroupPlan { buckets: 8, ..plan };
        assert_eq!(packed.encode(), "v=3;origin=16;write=16;read=64;buckets=8");
        assert_eq!(GroupPlan::parse(&packed.encode()), Some(packed));
        let bad = [
            "v=1;origin=16;write=16;read=16;buckets=8;cells=32",
            "v=1;origin=16;write=16;read=16;buckets=0",
            "v=1;origin=16;write=16;read=16;buckets=12",
            "v=1;origin=16;write=16;read=16;buckets=8;buckets=8",
            "v=1;origin=16;write=16;read=16;cells=32;cells=32",
            "v=1;origin=16;write=16;read=32;cells=16",
            "v=1;origin=16;write=16;read=16;cells=32;x=1",
            "v=1;origin=16;write=16;read=16;cells=",
            "",
            "v=1;origin=16;write=16",
            "v=1;origin=16;write=64;read=16",
            "v=1;origin=0;write=16;read=16",
            "v=1;origin=16;write=16;read=2000",
            "v=1;origin=16;read=16;write=16",
            "v=1;origin=16;write=16;read=16;x=1",
            "v=x;origin=16;write=16;read=16",
        ];
        for text in bad {
            assert_eq!(GroupPlan::parse(text), None, "{text}");
        }
    }

    #[test]
    fn no_plan_is_the_configured_count_and_another_origin_is_refused() {
        let ks = Keyspace::new("t", 16).expect("valid");
        let none = checked(&ks, ks.plan_key(), None).expect("initial");
        assert_eq!(none, GroupPlan::initial(16));
        let grown = "v=2;origin=16;write=64;read=64";
        assert_eq!(
            checked(&ks, ks.plan_key(), Some(grown))
                .expect("same origin")
                .write,
            64
        );
        let other = Keyspace::new("t", 8).expect("valid");
        let refused = checked(&other, other.plan_key(), Some(grown)).expect_err("origin 16");
        assert!(
            refused.to_string().contains("created with 16 shard groups"),
            "{refused}"
        );
        assert!(matches!(
            checked(&ks, ks.plan_key(), Some("nonsense")),
            Err(PlanError::Unreadable { .. })
        ));
    }
}
