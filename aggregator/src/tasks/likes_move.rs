//! Moving a deployment's likes from the shares to count sets (`tally likes-to-sets`).
//!
//! A deployment that counted likes before count sets existed keeps each like of a namespace
//! grouped by counter twice: its actor in the counter's member set, and 1 in the counter's share
//! (`tally_common::layout`). Counted by sets, the set's size is the count and a like is one
//! `SADD`, about half of Redis's work per like. The move, with every writer of the old layout
//! stopped:
//!
//! 1. The layout record (`<prefix>:layout`): `likes` from `shares` to `moving`, and each moved
//!    namespace's grouping from `counter` to `sets`, in one script. No writer starts while
//!    `likes` is `moving` (`LayoutError::Moving`), and writers older than the `likes` record
//!    refuse the grouping `sets`.
//! 2. Each group is marked (field `~likes` of its fence hash) and every partition's fence there
//!    moves one epoch on, in one script: an owner still running loses its partitions at its next
//!    write, and a writer that counts likes in the shares can take none there again
//!    (`scripts/stamp.lua`), nor write a like directly (`producer/src/scripts/like.lua`: the
//!    direct writer then reads the record again, and writes by the sets once it says so).
//!    Writers of versions before the mark know neither: they must be stopped.
//! 3. Each member set of a moved namespace, in its counter's group, is renamed to the counter's
//!    count set and its size taken off the counter's share, in one script per set: readers add
//!    the count set's size to the shares, so every total reads the same before and after each
//!    move, and a move interrupted anywhere is finished by running the command again.
//! 4. The record's `likes` becomes `sets`: writers start again, counting likes by their sets.
//!
//! The member sets are found with `SCAN`: on a Redis Cluster, on the master of each group's
//! slot (once per node), pass after pass until one finds no set to move, since a slot
//! migrated during a pass may have been walked on neither node.

use redis::Script;
use tally_common::keyspace::GroupingRule;
use tally_common::layout::LIKES_FIELD;
use tally_common::{Keyspace, Namespaces, RedisConn};

use crate::tasks::{MAX_WALKS, walk_until_settled};

/// Keys per `SCAN` call.
const BATCH: usize = 1000;

/// Why the move did not finish.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// Member sets to move kept appearing pass after pass (writers left running, or slots
    /// migrating all along).
    #[error(
        "member sets to move were still found after {MAX_WALKS} passes over the cluster's nodes: \
         stop every writer of likes and run the command again"
    )]
    Unsettled,
    /// The deployment's record does not allow the move, or does not match the namespaces.
    #[error("{0}")]
    Refused(String),
    /// A member set could not be moved (nothing of it was).
    #[error("{key}: {reason} (nothing of this set was moved; fix it and run the command again)")]
    Set {
        /// The member set.
        key: String,
        /// What Redis said.
        reason: String,
    },
    /// Redis failed; run the command again to finish the move.
    #[error("redis: {0} (run the command again to finish the move)")]
    Redis(#[from] redis::RedisError),
}

/// What a move did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Moved {
    /// Whether the deployment already counted likes by their sets (nothing was done).
    pub already: bool,
    /// Namespaces moved (`*`: those the defaults cover).
    pub namespaces: Vec<String>,
    /// Member sets renamed to count sets.
    pub sets: u64,
    /// Likes in them.
    pub likes: u64,
    /// Member sets left where they are: of namespaces that stay grouped by actor or do not
    /// deduplicate, or outside their counter's group.
    pub left: u64,
}

/// Step 1: the record, from `shares` (or `moving`, a move run before) to `moving`.
/// KEYS[1] the layout hash; ARGV[1] `dry` for a dry run (checks only), ARGV[2..] the fields of
/// the moved namespaces' groupings.
const START: &str = r"
local likes = redis.call('HGET', KEYS[1], 'likes')
if likes == 'sets' then return {'sets'} end
if likes ~= 'shares' and likes ~= 'moving' then return {'likes', likes or ''} end
for i = 2, #ARGV do
  local grouping = redis.call('HGET', KEYS[1], ARGV[i])
  if grouping and grouping ~= 'counter' and grouping ~= 'sets' then
    return {'grouping', ARGV[i], grouping}
  end
end
if ARGV[1] == 'dry' then return {'ready'} end
redis.call('HSET', KEYS[1], 'likes', 'moving')
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], 'sets') end
return {'ready'}
";

/// Step 2: a group's mark, and every owner there fenced. KEYS[1] the fence hash.
const MARK: &str = r"
local fields = redis.call('HKEYS', KEYS[1])
redis.call('HSET', KEYS[1], '~likes', 'sets')
for _, field in ipairs(fields) do
  if field ~= '~likes' then redis.call('HINCRBY', KEYS[1], field, 1) end
end
return #fields
";

/// Step 3: one member set to its count set. KEYS[1] the member set, KEYS[2] the count set,
/// KEYS[3] the counter's share, KEYS[4] the group's fence hash (all one slot); ARGV[1] `dry`
/// for a dry run, which checks the same and changes nothing (the group is not marked yet).
/// Returns the likes moved (0 if the set is gone: moved before).
const MOVE: &str = r"
local dry = ARGV[1] == 'dry'
if not dry and not redis.call('HGET', KEYS[4], '~likes') then
  return redis.error_reply('the group is not marked as moved')
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('TYPE', KEYS[1]).ok ~= 'set' then
  return redis.error_reply('not a set')
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.error_reply('its count set exists already')
end
local n = redis.call('SCARD', KEYS[1])
local share = redis.call('GET', KEYS[3])
if share and not tonumber(share) then
  return redis.error_reply('its counter share is not an integer')
end
if dry then return n end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('DECRBY', KEYS[3], n)
return n
";

/// What the move would do, changing nothing (`tally likes-to-sets --dry-run`): step 1's
/// checks of the record, then one walk over the member sets with step 3's checks; the first
/// set the move would stop at is the error. Reported as if moved.
pub async fn plan_likes_to_sets(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
) -> Result<Moved, MoveError> {
    run(conn, keyspace, namespaces, Mode::Dry).await
}

/// Moves `keyspace`'s likes from the shares to count sets, as the module's doc says: every
/// namespace of `namespaces` (the writers' namespace file) that deduplicates grouped by counter.
pub async fn likes_to_sets(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
) -> Result<Moved, MoveError> {
    run(conn, keyspace, namespaces, Mode::Move).await
}

/// A move, or its dry run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Move,
    Dry,
}

impl Mode {
    /// The scripts' ARGV[1].
    fn arg(self) -> &'static str {
        match self {
            Mode::Move => "move",
            Mode::Dry => "dry",
        }
    }
}

async fn run(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
    mode: Mode,
) -> Result<Moved, MoveError> {
    let moved = moved_namespaces(conn, keyspace, namespaces).await?;
    let start = Script::new(START);
    let mut started = start.key(keyspace.layout_key());
    started.arg(mode.arg());
    for ns in &moved {
        started.arg(format!("dedup:{ns}"));
    }
    let reply: Vec<String> = started.invoke_async(&mut conn.clone()).await?;
    match reply.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["sets"] => {
            return Ok(Moved {
                already: true,
                ..Moved::default()
            });
        }
        ["ready"] => {}
        ["likes", text] => {
            return Err(MoveError::Refused(format!(
                "{} field {LIKES_FIELD} holds {text:?}, not \"shares\": nothing recorded to move \
                 from (a deployment records how it counts likes once a writer of this version \
                 has started)",
                keyspace.layout_key()
            )));
        }
        ["grouping", field, grouping] => {
            return Err(MoveError::Refused(format!(
                "{} field {field} holds {grouping:?}, but the namespaces file groups that \
                 namespace's likes by counter: give the writers' namespaces file",
                keyspace.layout_key()
            )));
        }
        _ => {
            return Err(MoveError::Refused(format!(
                "unexpected reply to the move's start: {reply:?}"
            )));
        }
    }
    // Every group an owner stamps (more than the configured count after a re-grouping grew it).
    let width = match tally_common::regroup::read_plan(conn, keyspace).await {
        Ok(plan) => plan.read.max(keyspace.groups()),
        Err(tally_common::regroup::PlanError::Redis(e)) => return Err(e.into()),
        Err(e) => return Err(MoveError::Refused(e.to_string())),
    };
    if mode == Mode::Move {
        let mark = Script::new(MARK);
        for group in 0..width {
            let _: i64 = mark
                .key(keyspace.fence_key(group))
                .invoke_async(&mut conn.clone())
                .await?;
        }
    }
    let mut report = Moved {
        namespaces: moved,
        ..Moved::default()
    };
    let mover = Mover::new(conn, mode).await?;
    // A dry run, which moves nothing, walks once.
    let again = conn.is_cluster() && mode == Mode::Move;
    let pass = async || walk(conn, keyspace, namespaces, width, &mover, &mut report).await;
    if !walk_until_settled(again, pass).await? {
        return Err(MoveError::Unsettled);
    }
    if mode == Mode::Move {
        let _: () = redis::cmd("HSET")
            .arg(keyspace.layout_key())
            .arg(LIKES_FIELD)
            .arg("sets")
            .query_async(&mut conn.clone())
            .await?;
    }
    Ok(report)
}

/// One walk of the member sets of `width` groups (each node holding one walked once), step 3's
/// `mover` run over those of namespaces that move, in their counter's group; the sets and likes
/// it moved are added to `report`, and the sets left counted anew. Returns the sets it found to
/// move.
async fn walk(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
    width: u32,
    mover: &Mover<'_>,
    report: &mut Moved,
) -> Result<usize, MoveError> {
    let moved_counter = |counter: &str| {
        let policy = namespaces.policy(counter);
        policy.dedup && policy.grouping == GroupingRule::ByCounter
    };
    // A slot of each node holding a group: where its SCANs go.
    let nodes = conn
        .one_per_node((0..width).map(|group| keyspace.fence_key(group)))
        .await?;
    let pattern = format!("{}:{{g*}}:m:*", keyspace.prefix());
    let (mut found, mut left) = (0, 0);
    for slot_key in &nodes {
        let mut cursor: u64 = 0;
        loop {
            let (next, keys) = conn.scan_page_at(slot_key, cursor, &pattern, BATCH).await?;
            let mut moves = Vec::new();
            for key in keys {
                let Some((group, counter)) = keyspace.member_set_of_key(&key) else {
                    continue;
                };
                if !moved_counter(counter) || keyspace.group_for_counter(counter) != group {
                    left += 1;
                    continue;
                }
                let keys = [
                    keyspace.count_set_key(group, counter),
                    keyspace.counter_key(group, counter),
                    keyspace.fence_key(group),
                ];
                moves.push((key, keys));
            }
            found += moves.len();
            for likes in mover.run(moves).await? {
                if likes > 0 {
                    report.sets += 1;
                    report.likes += likes;
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    report.left = left;
    Ok(found)
}

/// Runs step 3's script over member sets: as one pipeline of `EVALSHA`s on a standalone
/// server (a round trip per set would make the move, writers stopped, take hours over
/// millions of counters), as concurrent requests on a cluster (each set in its own slot).
struct Mover<'a> {
    conn: &'a RedisConn,
    mode: Mode,
    script: std::sync::Arc<Script>,
    /// The script's SHA, loaded on the standalone server.
    sha: Option<String>,
}

impl<'a> Mover<'a> {
    async fn new(conn: &'a RedisConn, mode: Mode) -> Result<Self, MoveError> {
        let sha = if conn.is_cluster() {
            None
        } else {
            let load = redis::cmd("SCRIPT").arg("LOAD").arg(MOVE).clone();
            Some(load.query_async(&mut conn.clone()).await?)
        };
        Ok(Self {
            conn,
            mode,
            script: std::sync::Arc::new(Script::new(MOVE)),
            sha,
        })
    }

    /// Moves each member set with its count set, share and fence keys: the likes each moved
    /// (0: gone, moved before). The first set refused stops the move, named.
    async fn run(&self, moves: Vec<(String, [String; 3])>) -> Result<Vec<u64>, MoveError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        let results: Vec<redis::RedisResult<u64>> = match &self.sha {
            Some(sha) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for (key, [count_set, share, fence]) in &moves {
                    pipe.cmd("EVALSHA")
                        .arg(sha)
                        .arg(4)
                        .arg(key)
                        .arg(count_set)
                        .arg(share)
                        .arg(fence)
                        .arg(self.mode.arg());
                }
                pipe.query_async(&mut self.conn.clone()).await?
            }
            None => {
                let requests: Vec<_> = (moves.iter())
                    .map(|(key, [count_set, share, fence])| {
                        let (script, mut conn) = (self.script.clone(), self.conn.clone());
                        let keys = [key.clone(), count_set.clone(), share.clone(), fence.clone()];
                        let mode = self.mode.arg();
                        tokio::spawn(async move {
                            let mut invocation = script.prepare_invoke();
                            for key in &keys {
                                invocation.key(key);
                            }
                            invocation.arg(mode).invoke_async::<u64>(&mut conn).await
                        })
                    })
                    .collect();
                let mut results = Vec::with_capacity(requests.len());
                for request in requests {
                    results.push(request.await.map_err(|_| {
                        redis::RedisError::from((redis::ErrorKind::Io, "move task cancelled"))
                    })?);
                }
                results
            }
        };
        let mut moved = Vec::with_capacity(results.len());
        for ((key, _), result) in moves.into_iter().zip(results) {
            match result {
                Ok(likes) => moved.push(likes),
                // Redis restarted and lost the script meanwhile: run the command again.
                Err(e) if e.code() == Some("NOSCRIPT") => return Err(e.into()),
                // The connection failed: nothing is known of this set; run the command again.
                Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                    return Err(e.into());
                }
                // The script's refusal, whose first word Redis takes for an error code.
                Err(e) => {
                    let reason = match (e.code(), e.detail()) {
                        (Some(code), Some(detail)) => format!("{code} {detail}"),
                        _ => e.to_string(),
                    };
                    return Err(MoveError::Set { key, reason });
                }
            }
        }
        Ok(moved)
    }
}

/// The namespaces the move moves: those of `namespaces` that deduplicate grouped by counter
/// (`*` for the defaults). Refused if the record groups a namespace by counter that
/// `namespaces` does not move, or records `moving` for none.
async fn moved_namespaces(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
) -> Result<Vec<String>, MoveError> {
    let moved: Vec<String> = (tally_common::layout::deduplicating(namespaces).into_iter())
        .filter(|(_, grouping)| *grouping == GroupingRule::ByCounter)
        .map(|(name, _)| name)
        .collect();
    let recorded: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keyspace.layout_key())
        .query_async(&mut conn.clone())
        .await?;
    for (field, grouping) in &recorded {
        let Some(namespace) = field.strip_prefix("dedup:") else {
            continue;
        };
        if grouping == "counter" && !moved.iter().any(|m| m == namespace) {
            return Err(MoveError::Refused(format!(
                "{} records namespace {namespace:?} grouped by counter ({field} = {grouping:?}), \
                 but the namespaces file does not deduplicate it grouped by counter: give the \
                 writers' namespaces file",
                keyspace.layout_key()
            )));
        }
    }
    if moved.is_empty() {
        return Err(MoveError::Refused(
            "the namespaces file deduplicates no namespace grouped by counter: nothing to move \
             (give the writers' namespaces file)"
                .to_owned(),
        ));
    }
    Ok(moved)
}
