//! Where a deployment keeps each deduplicating namespace's member sets, recorded in Redis so
//! that no writer puts likes where earlier ones are not.
//!
//! A like is counted once because its actor is in exactly one set: the counter's group's when
//! the namespace is grouped by counter (the default since this record exists), each actor's
//! group's when grouped by actor (the layout before). A writer that used the other layout would
//! count again every like already counted, and miss every unlike of one. So the first writer
//! records each namespace's grouping in the hash `<prefix>:layout` (field `dedup:<namespace>`,
//! `dedup:*` for the defaults) and every writer after it checks its own against the record.
//!
//! The first writer also records the deployment's origin: `recorded` for one that starts under
//! these records, `unrecorded` for one that counted before them (its groups hold ledgers and
//! the hash does not exist). A writer without deduplicating namespaces records it too, when
//! Redis answers at its start, so that a deployment that counts plain events first and turns
//! likes on later is known to have started here. An unrecorded deployment may hold likes grouped by actor, so in it
//! a deduplicating namespace with no record and a grouping other than `actor` refuses to start
//! until the operator says which layout is there (`docs/operations.md`).
//!
//! The same hash records how a deployment counts likes, in field `likes`: `sets` when a
//! deduplicating namespace's count is its member set's size (`SCARD`) added to its share, so
//! that a like is one `SADD` and no `INCRBY`; `shares` when each like is also added to the
//! counter's share (every deployment before this record). The first writer decides, once:
//! `sets` for a deployment with nothing written yet (no ledger, no namespace's grouping
//! recorded), `shares` otherwise. In a `sets` deployment each deduplicating namespace grouped
//! by counter keeps its likes in count sets (`Keyspace::count_set_key`) and is recorded as
//! `sets`, which older writers refuse as a grouping they do not have; one grouped by actor
//! keeps them as before (member sets in the actors' groups, counted in the shares), recorded
//! as `actor`. Readers add each counter's count set's size (none: 0) to its shares.
//!
//! The same hash records how many cells hashes (window buckets) each group keeps, in field
//! `cells_stripes` ([`record_cells_stripes`]): every reader and writer finds a counter's
//! buckets in the stripe its id hashes to among that many. The first writer records
//! [`DEFAULT_STRIPES`], or [`LEGACY_STRIPES`] if the groups already hold cells hashes written
//! before the count was recorded; readers go by the record, and by [`LEGACY_STRIPES`] while
//! there is none.

use crate::connection::RedisConn;
use crate::keyspace::{GroupingRule, Keyspace, LikesBySet};
use crate::namespace::{Namespaces, Policy};
use crate::window::cells::{DEFAULT_STRIPES, LEGACY_STRIPES, MAX_STRIPES, valid_stripes};

/// Why a writer may not write likes with the grouping it was given.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The deployment records another grouping for the namespace.
    #[error(
        "namespace {namespace:?} keeps its likes as {recorded:?} ({key} field {field}: a \
         grouping, or \"sets\" for grouped by counter and counted by their sets), but this \
         writer, configured with grouping = {configured:?}, would keep them otherwise: set the \
         grouping recorded in its namespace file (changing a namespace's layout needs its \
         member sets moved, which tally does not do yet)"
    )]
    Mismatch {
        /// The namespace (`*` for the defaults).
        namespace: String,
        /// The grouping recorded.
        recorded: String,
        /// The grouping configured.
        configured: GroupingRule,
        /// The record's key.
        key: String,
        /// The record's field.
        field: String,
    },
    /// The deployment counted before layouts were recorded: its likes may be grouped by actor.
    #[error(
        "namespace {namespace:?} deduplicates with grouping = \"counter\", but this deployment \
         (key prefix {prefix:?}) counted before tally recorded where likes are kept, when they \
         were kept grouped by actor: set grouping = \"actor\" in the namespace to keep counting \
         them there or, if this deployment never deduplicated that namespace, record the new \
         layout with `redis-cli HSET {key} {field} counter`"
    )]
    Unrecorded {
        /// The namespace (`*` for the defaults).
        namespace: String,
        /// The deployment's key prefix.
        prefix: String,
        /// The record's key.
        key: String,
        /// The record's field.
        field: String,
    },
    /// The deployment's likes are being moved from the shares to count sets.
    #[error(
        "{key} field likes holds \"moving\": this deployment's likes are being moved from the \
         shares to count sets (`tally likes-to-sets`); start writers once it has finished (run \
         it again if it was interrupted)"
    )]
    Moving {
        /// The record's key.
        key: String,
    },
    /// The recorded way of counting likes is not one tally knows.
    #[error(
        "{key} field {field} holds {text:?}, not a way of counting likes (\"sets\" or \
         \"shares\"): restore it from the deployment's other writers' logs"
    )]
    Likes {
        /// The record's key.
        key: String,
        /// The record's field.
        field: &'static str,
        /// What it holds.
        text: String,
    },
    /// The recorded number of cells stripes is not one tally keeps.
    #[error(
        "{key} field {field} holds {text:?}, not a number of cells stripes (a power of two \
         from 1 to {MAX_STRIPES}): restore it from the deployment's other writers' logs"
    )]
    Stripes {
        /// The record's key.
        key: String,
        /// The record's field.
        field: &'static str,
        /// What it holds.
        text: String,
    },
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// The hash field recording `namespace`'s grouping (`*`: the defaults).
fn field(namespace: &str) -> String {
    format!("dedup:{namespace}")
}

/// The deduplicating namespaces of `namespaces` with their groupings (`*` for the defaults).
pub fn deduplicating(namespaces: &Namespaces) -> Vec<(String, GroupingRule)> {
    let listed = namespaces.listed().map(|(name, p)| (name.to_owned(), p));
    (listed.chain([("*".to_owned(), namespaces.defaults())]))
        .filter(|(_, p): &(String, &Policy)| p.dedup)
        .map(|(name, p)| (name, p.grouping))
        .collect()
}

/// The field recording whether the deployment began under these records (`recorded`) or
/// counted before them (`unrecorded`): set by the first writer to check, never changed.
const ORIGIN_FIELD: &str = "origin";

/// How a deployment counts likes (the layout hash's field `likes`; see the module's doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LikesCount {
    /// A deduplicating counter's total is its share plus its member set's size.
    Sets,
    /// Each like is added to the counter's share too.
    Shares,
}

impl LikesCount {
    /// The record's value.
    pub const fn as_str(self) -> &'static str {
        match self {
            LikesCount::Sets => "sets",
            LikesCount::Shares => "shares",
        }
    }

    /// Whether a deduplicating namespace grouped by `grouping` counts its likes by their count
    /// sets in a deployment that counts likes this way: only grouped by counter.
    pub fn by_set(self, grouping: GroupingRule) -> bool {
        self == LikesCount::Sets && grouping == GroupingRule::ByCounter
    }

    fn parse(key: String, text: String) -> Result<Self, LayoutError> {
        match text.as_str() {
            "sets" => Ok(LikesCount::Sets),
            "shares" => Ok(LikesCount::Shares),
            MOVING => Err(LayoutError::Moving { key }),
            _ => Err(LayoutError::Likes {
                key,
                field: LIKES_FIELD,
                text,
            }),
        }
    }
}

/// The namespaces of `namespaces` whose likes a writer counts by their count sets in a
/// deployment that counts likes as `count`: those that deduplicate grouped by counter, where
/// likes count by sets (see the module's doc).
pub fn likes_by_set(namespaces: &Namespaces, count: Option<LikesCount>) -> LikesBySet {
    let by_set = |p: &Policy| p.dedup && count.is_some_and(|c| c.by_set(p.grouping));
    let policies = || (namespaces.listed().map(|(_, p)| p)).chain([namespaces.defaults()]);
    LikesBySet {
        listed: (namespaces.listed())
            .map(|(name, p)| (name.to_owned(), by_set(p)))
            .collect(),
        others: by_set(namespaces.defaults()),
        every_dedup: policies().any(|p| p.dedup) && policies().all(|p| !p.dedup || by_set(p)),
        in_shares: policies()
            .any(|p| p.dedup && p.grouping == GroupingRule::ByCounter && !by_set(p)),
    }
}

/// The field recording how the deployment counts likes.
pub const LIKES_FIELD: &str = "likes";

/// What the field `likes` holds while `tally likes-to-sets` moves a deployment's likes from the
/// shares to count sets: no writer starts then.
pub const MOVING: &str = "moving";

/// The field of a group's fence hash that marks the group's counters' shares as packed, holding
/// the deployment's buckets per group (`crate::regroup::GroupPlan::buckets`): every exactly-once
/// write there checks it, and adds its deltas to the fields of `Keyspace::packed_key` hashes
/// instead of the counters' keys (`tally pack`).
pub const PACKED_FIELD: &str = "~packed";

/// The field of a group's fence hash that, while a compactor moves shares out of or into the
/// group (compaction, a shrink's fold), holds its epoch and a deadline (`<epoch> <deadline>`,
/// ms by the server's clock, moved ahead while the compactor runs): until the deadline, each
/// reset applied there records where it was in the log in the group's `Keyspace::resets_key`
/// hash (a hash apart, so that these writes do not abort the transactions that watch the
/// fence). An earlier release's mark, the epoch alone, has no deadline.
pub const MOVING_FIELD: &str = "~moving";

/// A counter's record of resets in a group's `Keyspace::resets_key` hash (see [`MOVING_FIELD`]):
/// `<partition field> <offset>` of its last reset from each partition that reset it there,
/// joined by `;` (a partition's field has neither). One entry is the form of releases that
/// kept only the last reset, whichever its partition.
///
/// The entries of `record`, each a partition's field and its reset's offset; `None` if one is
/// not of that form.
pub fn reset_entries(record: &str) -> Option<Vec<(&str, i64)>> {
    (record.split(';'))
        .map(|entry| {
            let (partition, offset) = entry.rsplit_once(' ')?;
            Some((partition, offset.parse().ok()?))
        })
        .collect()
}

/// `record` (`None`: no record yet) with `partition`'s entry set to `offset`, in the form
/// [`reset_entries`] reads; the other partitions' entries are kept, in their order.
pub fn reset_recorded(record: Option<&str>, partition: &str, offset: i64) -> String {
    let prefix = format!("{partition} ");
    let mut entries: Vec<String> = (record.unwrap_or_default().split(';'))
        .filter(|entry| !entry.is_empty() && !entry.starts_with(&prefix))
        .map(str::to_owned)
        .collect();
    entries.push(format!("{partition} {offset}"));
    entries.join(";")
}

/// The field of a group's fence hash that marks the group's likes as moved to count sets: a
/// writer that counts likes grouped by counter in the shares may not take a partition there
/// (`scripts/stamp.lua`), nor write a like directly. A partition's field is `<topic>/<n>`, and
/// a topic has no `~`.
pub const MOVED_FIELD: &str = "~likes";

/// The message of a writer refused at a group whose likes were moved.
pub fn moved_message(group: u32) -> String {
    format!(
        "this writer counts likes in the shares, but group {group}'s likes were moved to count \
         sets (`tally likes-to-sets`): restart it, and it counts them by their sets"
    )
}

/// How the deployment counts likes, or `None` if no writer has recorded it yet (nothing was
/// written by this version's writers: no likes are kept in sets alone).
pub async fn recorded_likes_count(
    conn: &RedisConn,
    keyspace: &Keyspace,
) -> Result<Option<LikesCount>, LayoutError> {
    let key = keyspace.layout_key();
    let text = read_record(conn, &key, LIKES_FIELD).await?;
    text.map(|text| LikesCount::parse(key, text)).transpose()
}

/// What the layout hash `key` records in `field`, if anything.
async fn read_record(
    conn: &RedisConn,
    key: &str,
    field: &str,
) -> redis::RedisResult<Option<String>> {
    redis::cmd("HGET")
        .arg(key)
        .arg(field)
        .query_async(&mut conn.clone())
        .await
}

/// How the deployment counts likes, recorded first if it is not: [`LikesCount::Sets`] if
/// nothing has been written (no group holds a ledger and no namespace's grouping is recorded),
/// else [`LikesCount::Shares`]. Writers record it before they write anything, so racing writers
/// that find it missing decide alike; each reads back the record.
async fn record_likes_count(
    conn: &mut RedisConn,
    keyspace: &Keyspace,
) -> Result<LikesCount, LayoutError> {
    if let Some(count) = recorded_likes_count(conn, keyspace).await? {
        return Ok(count);
    }
    let key = keyspace.layout_key();
    let fields: Vec<String> = redis::cmd("HKEYS").arg(&key).query_async(conn).await?;
    let grouped = fields.iter().any(|f| f.starts_with("dedup:"));
    let count = if grouped || has_ledgers(conn, keyspace).await? {
        LikesCount::Shares
    } else {
        LikesCount::Sets
    };
    let _: bool = redis::cmd("HSETNX")
        .arg(&key)
        .arg(LIKES_FIELD)
        .arg(count.as_str())
        .query_async(conn)
        .await?;
    Ok(recorded_likes_count(conn, keyspace).await?.unwrap_or(count))
}

/// Records the grouping of each deduplicating namespace of `namespaces` where none is recorded,
/// and checks it where one is; returns how the deployment counts likes (recorded first if it
/// is not): see the module's doc. Without deduplicating namespaces, `None` if Redis did not
/// answer (such a writer may start while Redis is down).
pub async fn record_dedup_groupings(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
) -> Result<Option<LikesCount>, LayoutError> {
    let wanted = deduplicating(namespaces);
    let key = keyspace.layout_key();
    let mut conn = conn.clone();
    if wanted.is_empty() {
        // Only the origin and how likes count, and only if Redis answers: a writer without
        // likes needs Redis for nothing else here, and may start while Redis is down (a later
        // writer records them then, from the ledgers it finds).
        if origin(&mut conn, keyspace, &key).await.is_err() {
            return Ok(None);
        }
        return Ok(record_likes_count(&mut conn, keyspace).await.ok());
    }
    let unrecorded_origin = origin(&mut conn, keyspace, &key).await? == "unrecorded";
    let count = record_likes_count(&mut conn, keyspace).await?;
    for (namespace, grouping) in wanted {
        let field = field(&namespace);
        let expected = if count.by_set(grouping) {
            LikesCount::Sets.as_str()
        } else {
            grouping.as_str()
        };
        let recorded = match read_record(&conn, &key, &field).await? {
            Some(recorded) => recorded,
            None => {
                // Writers before records kept likes grouped by actor, the only layout then.
                if unrecorded_origin && grouping != GroupingRule::ByActor {
                    return Err(LayoutError::Unrecorded {
                        namespace,
                        prefix: keyspace.prefix().to_owned(),
                        key,
                        field,
                    });
                }
                // Another writer may record at the same moment: the first one wins, and the
                // check below holds everyone to it.
                let _: bool = redis::cmd("HSETNX")
                    .arg(&key)
                    .arg(&field)
                    .arg(expected)
                    .query_async(&mut conn)
                    .await?;
                read_record(&conn, &key, &field).await?.unwrap_or_default()
            }
        };
        if recorded != expected {
            return Err(LayoutError::Mismatch {
                namespace,
                recorded,
                configured: grouping,
                key,
                field,
            });
        }
    }
    Ok(Some(count))
}

/// The deployment's origin, recorded first if it is not: a deployment whose groups hold
/// ledgers but no record counted before records existed. The first writer decides; a racing
/// one reads its decision.
async fn origin(
    conn: &mut RedisConn,
    keyspace: &Keyspace,
    key: &str,
) -> redis::RedisResult<String> {
    let recorded: Option<String> = redis::cmd("HGET")
        .arg(key)
        .arg(ORIGIN_FIELD)
        .query_async(conn)
        .await?;
    if let Some(origin) = recorded {
        return Ok(origin);
    }
    let before = if has_ledgers(conn, keyspace).await? {
        "unrecorded"
    } else {
        "recorded"
    };
    let _: bool = redis::cmd("HSETNX")
        .arg(key)
        .arg(ORIGIN_FIELD)
        .arg(before)
        .query_async(conn)
        .await?;
    redis::cmd("HGET")
        .arg(key)
        .arg(ORIGIN_FIELD)
        .query_async(conn)
        .await
}

/// The field recording how many cells hashes each group keeps.
const STRIPES_FIELD: &str = "cells_stripes";

/// The number of cells stripes the deployment records, or `None` if it records none.
pub async fn recorded_cells_stripes(
    conn: &RedisConn,
    keyspace: &Keyspace,
) -> Result<Option<u64>, LayoutError> {
    let key = keyspace.layout_key();
    let Some(text) = read_record(conn, &key, STRIPES_FIELD).await? else {
        return Ok(None);
    };
    match text.parse() {
        Ok(stripes) if valid_stripes(stripes) => Ok(Some(stripes)),
        _ => Err(LayoutError::Stripes {
            key,
            field: STRIPES_FIELD,
            text,
        }),
    }
}

/// `keyspace` with the cells stripes a reader finds buckets in: the recorded count, or
/// [`LEGACY_STRIPES`] where none is recorded (a deployment whose writers kept cells before the
/// count was recorded, or that keeps none yet).
pub async fn cells_stripes_for_reading(
    conn: &RedisConn,
    keyspace: &Keyspace,
) -> Result<Keyspace, LayoutError> {
    let stripes = recorded_cells_stripes(conn, keyspace).await?;
    Ok(keyspace
        .clone()
        .with_cells_stripes(stripes.unwrap_or(LEGACY_STRIPES)))
}

/// `keyspace` with the cells stripes a writer puts buckets in: the recorded count, recorded
/// first if there is none. The first writer decides: [`LEGACY_STRIPES`] if any group already
/// holds a cells hash of that layout (written before the count was recorded), else
/// [`DEFAULT_STRIPES`]; a racing writer reads its decision.
pub async fn record_cells_stripes(
    conn: &RedisConn,
    keyspace: &Keyspace,
) -> Result<Keyspace, LayoutError> {
    if let Some(stripes) = recorded_cells_stripes(conn, keyspace).await? {
        return Ok(keyspace.clone().with_cells_stripes(stripes));
    }
    let stripes = if has_legacy_cells(conn, keyspace).await? {
        LEGACY_STRIPES
    } else {
        DEFAULT_STRIPES
    };
    let _: bool = redis::cmd("HSETNX")
        .arg(keyspace.layout_key())
        .arg(STRIPES_FIELD)
        .arg(stripes)
        .query_async(&mut conn.clone())
        .await?;
    // A racing writer's decision, if it recorded first (none only if an operator deleted the
    // record in between: then this one's).
    let recorded = recorded_cells_stripes(conn, keyspace).await?;
    Ok(keyspace
        .clone()
        .with_cells_stripes(recorded.unwrap_or(stripes)))
}

/// Whether any group readers may sum (the plan's `cells`, at least every other count it
/// names) holds a cells hash of the layout before the count was recorded ([`LEGACY_STRIPES`]
/// per group).
async fn has_legacy_cells(conn: &RedisConn, keyspace: &Keyspace) -> Result<bool, LayoutError> {
    let groups = match crate::regroup::read_plan(conn, keyspace).await {
        Ok(plan) => plan.cells,
        Err(crate::regroup::PlanError::Redis(e)) => return Err(e.into()),
        // A plan for another count: the writer refuses it when it checks the plan.
        Err(_) => keyspace.groups(),
    };
    let legacy = keyspace.clone().with_cells_stripes(LEGACY_STRIPES);
    for group in 0..groups {
        if group_holds_cells(conn, &legacy, group).await? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether `group` holds any of its cells hashes under `keyspace`'s stripe count: one `EXISTS`
/// of them all (they share the group's slot, so one command on a cluster too).
pub async fn group_holds_cells(
    conn: &RedisConn,
    keyspace: &Keyspace,
    group: u32,
) -> redis::RedisResult<bool> {
    let mut exists = redis::cmd("EXISTS");
    for stripe in 0..keyspace.cells_stripes() {
        exists.arg(keyspace.cells_key_of_stripe(group, stripe));
    }
    let found: u64 = exists.query_async(&mut conn.clone()).await?;
    Ok(found > 0)
}

/// Whether any group holds a ledger: whether an aggregator has flushed into this deployment.
async fn has_ledgers(conn: &mut RedisConn, keyspace: &Keyspace) -> redis::RedisResult<bool> {
    for group in 0..keyspace.groups() {
        let exists: bool = redis::cmd("EXISTS")
            .arg(keyspace.ledger_key(group))
            .query_async(conn)
            .await?;
        if exists {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_deduplicating_namespaces_are_recorded_with_their_grouping() {
        let text = "[defaults]\ndedup = false\n[namespaces.likes]\ndedup = true\n\
                    [namespaces.votes]\ndedup = true\ngrouping = \"actor\"\n[namespaces.views]\n";
        let ns = Namespaces::from_toml(text).expect("valid");
        assert_eq!(
            deduplicating(&ns),
            [
                ("likes".to_owned(), GroupingRule::ByCounter),
                ("votes".to_owned(), GroupingRule::ByActor),
            ]
        );
        let all = Namespaces::from_toml("[defaults]\ndedup = true\n").expect("valid");
        assert_eq!(
            deduplicating(&all),
            [("*".to_owned(), GroupingRule::ByCounter)]
        );
    }

    #[test]
    fn every_deduplicating_namespace_by_sets_only_when_each_is() {
        let every = |text: &str, count| {
            let ns = Namespaces::from_toml(text).expect("valid");
            likes_by_set(&ns, Some(count)).every_dedup
        };
        let likes = "[namespaces.likes]\ndedup = true\n[namespaces.views]\n";
        assert!(every(likes, LikesCount::Sets));
        assert!(!every(likes, LikesCount::Shares));
        let by_actor = "[namespaces.likes]\ndedup = true\n\
                        [namespaces.votes]\ndedup = true\ngrouping = \"actor\"\n";
        assert!(!every(by_actor, LikesCount::Sets));
        assert!(every("[defaults]\ndedup = true\n", LikesCount::Sets));
        assert!(
            !every("[namespaces.views]\n", LikesCount::Sets),
            "none deduplicates"
        );
    }

    #[test]
    fn only_likes_grouped_by_counter_and_counted_in_the_shares_are_in_shares() {
        let in_shares = |text: &str, count| {
            let ns = Namespaces::from_toml(text).expect("valid");
            likes_by_set(&ns, count).in_shares
        };
        let likes = "[namespaces.likes]\ndedup = true\n[namespaces.views]\n";
        assert!(in_shares(likes, Some(LikesCount::Shares)));
        assert!(!in_shares(likes, Some(LikesCount::Sets)));
        let by_actor = "[namespaces.votes]\ndedup = true\ngrouping = \"actor\"\n";
        assert!(!in_shares(by_actor, Some(LikesCount::Shares)), "not moved");
        assert!(in_shares(
            "[defaults]\ndedup = true\n",
            Some(LikesCount::Shares)
        ));
        assert!(!in_shares("[namespaces.views]\n", Some(LikesCount::Shares)));
    }

    #[test]
    fn a_reset_record_keeps_each_partitions_last_reset() {
        let one = reset_recorded(None, "t/1", 12);
        assert_eq!(one, "t/1 12");
        let two = reset_recorded(Some(&one), "t/10", 5);
        let three = reset_recorded(Some(&two), "t/1", 30);
        assert_eq!(three, "t/10 5;t/1 30");
        assert_eq!(reset_entries(&three), Some(vec![("t/10", 5), ("t/1", 30)]));
        assert_eq!(reset_entries("t/1 12"), Some(vec![("t/1", 12)]));
        assert_eq!(reset_entries("t/1 x"), None);
        assert_eq!(reset_entries("t/1 12;"), None);
        assert_eq!(reset_entries(""), None, "never an empty list");
    }
}
