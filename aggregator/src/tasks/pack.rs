//! Packing a live deployment's counters' shares into small hashes (`tally pack`): a key per
//! counter per group costs Redis a keyspace entry (79-125 bytes in tally's layout), a field of
//! a small hash about a third of that (`docs/keyspace.md`, "Packed shares").
//!
//! A counter's share in a group is then its field in the group's hash of its bucket
//! (`Keyspace::packed_key`, `Keyspace::bucket_of`) plus its key, if it has one: readers always
//! sum both, so a share may be in either, or split between them, at any moment. That makes the
//! move safe beside running writers, in three steps:
//!
//! 1. **Readers first.** The group plan records the buckets (`GroupPlan::buckets`); a reader
//!    sums the fields within its plan's lease, so once `PHASE_WAIT` has passed every reader
//!    does. A process that predates packing refuses the plan as unreadable.
//! 2. **Then writers, group by group.** Each group's fence hash is marked
//!    (`tally_common::layout::PACKED_FIELD`). Every exactly-once write checks the mark in the
//!    same script or transaction that writes, so from the mark on each flush adds its deltas to
//!    the fields, and each reset or expiry clears both forms.
//! 3. **Then the keys.** Each group's counter keys are moved into their fields, a batch per
//!    script: each key's value added to its field and the key deleted in one step.
//!
//! Keys written after the walk by writers that keep to keys (direct writes, likes counted in the
//! shares, compaction, an at-least-once aggregator before it reads the mark) stay keys and are
//! read as such; running it again packs them. It runs again from any point, and picks up: the
//! plan and the marks are set once, and a moved key is gone.

use tally_common::layout::PACKED_FIELD;
use tally_common::regroup::{self, GroupPlan, PHASE_WAIT, PlanError, RegroupError};
use tally_common::{Keyspace, RedisConn};

/// Keys per `SCAN` call, and keys moved per script.
const BATCH: usize = 1_000;

/// Why packing stopped.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The count asked for is not one tally keeps.
    #[error("--buckets {0} is not a power of two from 1 to {max}", max = regroup::MAX_BUCKETS)]
    Buckets(u32),
    /// The deployment already packs into another number of hashes.
    #[error(
        "this deployment already packs its counters into {packed} hashes per group (its group plan \
         at {key}); the count is set once"
    )]
    Packed {
        /// The recorded count.
        packed: u32,
        /// The plan's key.
        key: String,
    },
    /// A group is marked with another count than the plan's.
    #[error("group {group}'s fence hash marks it packed into {marked:?} hashes, the plan {plan}")]
    Marked {
        /// The group.
        group: u32,
        /// Its mark.
        marked: String,
        /// The plan's count.
        plan: u32,
    },
    /// The plan could not be read or stored.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Another change of the plan came first.
    #[error(transparent)]
    Regroup(#[from] RegroupError),
    /// Redis failed; running it again picks up.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Fields of a retired group could not go back to their keys (a key of another type, not
    /// an integer, or a sum past 64 bits), or kept changing.
    #[error(
        "{left} field(s) of {hash} could not be moved back into their counters' keys (a key of \
         another type or not an integer, a sum past 64 bits, or fields that kept changing): \
         repair them and run the command again"
    )]
    Unpacked {
        /// The hash.
        hash: String,
        /// Its fields left.
        left: u64,
    },
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Packed {
    /// The deployment's packed hashes per group.
    pub buckets: u32,
    /// Groups marked by this run.
    pub marked: u32,
    /// Counter keys moved into their fields and deleted.
    pub moved: u64,
    /// Counter keys left: not a 64-bit integer, of another type, or a sum with the field past
    /// 64 bits.
    pub left: u64,
}

/// Packs the deployment's counters' shares into `buckets` hashes per group (see the module),
/// saying each step.
pub async fn pack(
    conn: &RedisConn,
    keyspace: &Keyspace,
    buckets: u32,
    mut say: impl FnMut(&str),
) -> Result<Packed, PackError> {
    if !regroup::valid_buckets(buckets) {
        return Err(PackError::Buckets(buckets));
    }
    let mut plan = regroup::read_plan(conn, keyspace).await?;
    if plan.buckets != buckets && plan.buckets != 0 {
        return Err(PackError::Packed {
            packed: plan.buckets,
            key: keyspace.plan_key(),
        });
    }
    if plan.buckets == 0 {
        plan = GroupPlan {
            version: plan.version + 1,
            buckets,
            ..plan
        };
        regroup::replace_plan(conn, keyspace, &plan).await?;
        say(&format!(
            "readers sum the fields of {buckets} packed hashes per group; writers pack in {} s",
            PHASE_WAIT.as_secs()
        ));
        tokio::time::sleep(PHASE_WAIT).await;
    }
    let mut report = Packed {
        buckets,
        ..Packed::default()
    };
    // Every group readers sum: a group only grown into later is packed by the next run.
    for group in 0..plan.read {
        let fence = keyspace.fence_key(group);
        let set: bool = redis::cmd("HSETNX")
            .arg(&fence)
            .arg(PACKED_FIELD)
            .arg(buckets)
            .query_async(&mut conn.clone())
            .await?;
        if set {
            report.marked += 1;
            continue;
        }
        let marked: String = redis::cmd("HGET")
            .arg(&fence)
            .arg(PACKED_FIELD)
            .query_async(&mut conn.clone())
            .await?;
        if marked != buckets.to_string() {
            return Err(PackError::Marked {
                group,
                marked,
                plan: buckets,
            });
        }
    }
    say(&format!(
        "writers pack into {buckets} hashes in groups 0..{} ({} marked now); moving the keys",
        plan.read, report.marked
    ));
    let pattern = keyspace.counter_key_pattern();
    let nodes = conn
        .one_per_node((0..plan.read).map(|group| keyspace.fence_key(group)))
        .await?;
    let script = redis::Script::new(MOVE);
    for slot_key in &nodes {
        each_page(conn, slot_key, &pattern, async |keys| {
            let mut shares: Vec<(u32, &str, &str)> = (keys.iter())
                .filter_map(|key| {
                    let (group, counter) = keyspace.share_of_key(key)?;
                    (group < plan.read).then_some((group, counter, key.as_str()))
                })
                .collect();
            shares.sort_unstable();
            for one_group in shares.chunk_by(|a, b| a.0 == b.0) {
                let (moved, left) = move_keys(conn, keyspace, &script, buckets, one_group).await?;
                report.moved += moved;
                report.left += left;
            }
            Ok(())
        })
        .await?;
    }
    say(&format!(
        "moved {} key(s) into their fields; left {} (not integers, another type, or past 64 \
         bits with the field)",
        report.moved, report.left
    ));
    Ok(report)
}

/// Moves every packed field of `groups` back into its counter's key, deleting the field in the
/// same step, so that a shrink's fold (which moves keys) finds every share of the groups it
/// retires; nothing writes those groups any more by then. Returns the fields moved.
pub async fn unpack(
    conn: &RedisConn,
    keyspace: &Keyspace,
    groups: &[u32],
) -> Result<u64, PackError> {
    let script = redis::Script::new(UNPACK);
    let mut moved = 0;
    for &group in groups {
        let (slot_key, pattern) = (keyspace.fence_key(group), keyspace.packed_pattern(group));
        each_page(conn, &slot_key, &pattern, async |hashes| {
            for hash in hashes {
                moved += unpack_hash(conn, keyspace, &script, group, &hash).await?;
            }
            Ok(())
        })
        .await?;
    }
    Ok(moved)
}

/// Hands `page` each page of the keys matching `pattern` on `slot_key`'s node, to the walk's
/// end.
async fn each_page(
    conn: &RedisConn,
    slot_key: &str,
    pattern: &str,
    mut page: impl AsyncFnMut(Vec<String>) -> Result<(), PackError>,
) -> Result<(), PackError> {
    let mut cursor = 0;
    loop {
        let (next, keys) = conn.scan_page_at(slot_key, cursor, pattern, BATCH).await?;
        page(keys).await?;
        cursor = next;
        if cursor == 0 {
            return Ok(());
        }
    }
}

/// Moves the fields of `hash` (in `group`) into their counters' keys, until none is left.
async fn unpack_hash(
    conn: &RedisConn,
    keyspace: &Keyspace,
    script: &redis::Script,
    group: u32,
    hash: &str,
) -> Result<u64, PackError> {
    let mut moved = 0;
    for _ in 0..MAX_TRIES {
        let fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(hash)
            .query_async(&mut conn.clone())
            .await?;
        if fields.is_empty() {
            return Ok(moved);
        }
        let mut left = 0;
        for chunk in fields.chunks(BATCH) {
            let mut invocation = script.key(hash);
            for (field, value) in chunk {
                invocation
                    .key(keyspace.counter_key(group, field))
                    .arg(field)
                    .arg(value);
            }
            let (done, refused): (u64, u64) = invocation.invoke_async(&mut conn.clone()).await?;
            moved += done;
            left += refused;
        }
        if left > 0 {
            return Err(PackError::Unpacked {
                hash: hash.to_owned(),
                left,
            });
        }
    }
    Err(PackError::Unpacked {
        hash: hash.to_owned(),
        left: 0,
    })
}

/// Reads of a hash [`unpack_hash`] takes before giving up on fields that keep changing.
const MAX_TRIES: usize = 8;

/// Moves `shares` (one group's: group, counter, key) into their fields with one script.
async fn move_keys(
    conn: &RedisConn,
    keyspace: &Keyspace,
    script: &redis::Script,
    buckets: u32,
    shares: &[(u32, &str, &str)],
) -> Result<(u64, u64), PackError> {
    let Some(&(group, _, _)) = shares.first() else {
        return Ok((0, 0));
    };
    let mut invocation = script.key(keyspace.fence_key(group));
    invocation.arg(buckets);
    for &(_, counter, key) in shares {
        let bucket = Keyspace::bucket_of(counter, buckets);
        invocation
            .key(key)
            .key(keyspace.packed_key(group, bucket))
            .arg(counter);
    }
    let (moved, left): (u64, u64) = invocation.invoke_async(&mut conn.clone()).await?;
    Ok((moved, left))
}

/// Moves fields back into their counters' keys: each field still holding the value read is
/// added to its key and deleted (one that changed is left for the next read).
///
/// KEYS[1] the hash; then per field its counter's key
/// ARGV per field: the field, the value read
/// Returns {moved, refused}: refused, a key that would not take its field's value.
const UNPACK: &str = r"
local moved, refused = 0, 0
for i = 1, #KEYS - 1 do
  local field, value = ARGV[2 * i - 1], ARGV[2 * i]
  if redis.call('HGET', KEYS[1], field) == value then
    local sum = redis.pcall('INCRBY', KEYS[1 + i], value)
    if type(sum) == 'number' then
      redis.call('HDEL', KEYS[1], field)
      if sum == 0 then
        redis.call('DEL', KEYS[1 + i])
      end
      moved = moved + 1
    else
      refused = refused + 1
    end
  end
end
return {moved, refused}
";

/// Moves counter keys into their fields, in a group marked packed into ARGV[1] hashes.
///
/// KEYS[1] the group's fence hash; then per key: the counter key, the hash of its bucket
/// ARGV[1] the buckets; then per key its counter (its field)
/// Returns {moved, left}.
const MOVE: &str = r"
if redis.call('HGET', KEYS[1], '~packed') ~= ARGV[1] then
  return redis.error_reply('ERR the group is not marked packed into ' .. ARGV[1] .. ' hashes')
end
local moved, left = 0, 0
for i = 2, #ARGV do
  local key, hash, field = KEYS[2 * i - 2], KEYS[2 * i - 1], ARGV[i]
  local value = redis.pcall('GET', key)
  if type(value) == 'string' then
    local sum = redis.pcall('HINCRBY', hash, field, value)
    if type(sum) == 'number' then
      redis.call('DEL', key)
      if sum == 0 then
        redis.call('HDEL', hash, field)
      end
      moved = moved + 1
    else
      left = left + 1
    end
  elseif type(value) == 'table' then
    left = left + 1
  end
end
return {moved, left}
";
