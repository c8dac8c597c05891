//! Upkeep of the window cells (`tally_common::window::cells`), outside the flush:
//!
//! - **sweep** ([`sweep`]): a flush drops the expired buckets of the counters it writes, and a
//!   cells hash expires when the last bucket written into it does; a counter no longer written
//!   keeps its field until a sweep finds its buckets expired (by its namespace's windows as
//!   configured now: a window no longer kept has expired) and deletes it. It walks every cells
//!   hash with `HSCAN`, so it also runs against a cluster.
//! - **migrate** ([`migrate`]): folds the keys of the layout before cells (a key per bucket,
//!   `<prefix>:{g<group>}:w:<width>:<start>:<counter>`) into the cells, deleting each key in
//!   the same script that adds its value. It finds them with `SCAN`: on a Redis Cluster, on
//!   every node holding a group, walked again until a walk folds nothing.
//!
//! Both rewrite a field only if it still holds what they read (`scripts/cells.lua`), so they run
//! beside the aggregators, and a run killed anywhere is simply run again.

use std::collections::BTreeMap;

use tally_common::event::now_ms;
use tally_common::window::cells::Cells;
use tally_common::{Keyspace, Namespaces, RedisConn};

use crate::store::cells::{FieldWrite, MAX_STALE_READS, Rereads, StripeWrite};
use crate::store::script_call::ScriptCall;
use crate::tasks::{MAX_WALKS, walk_until_settled};

/// Fields read per `HSCAN` call, and keys per `SCAN` call.
const BATCH: usize = 1_000;

/// Why a sweep or a migration stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpkeepError {
    /// Redis failed; running it again picks up.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A field kept changing between read and write.
    #[error("{0}: the cells kept changing between read and write")]
    Stale(String),
    /// A script answered something it never answers, or failed.
    #[error("unexpected reply from the cells script: {0}")]
    Protocol(String),
    /// The deployment's record of its cells stripes is unreadable.
    #[error(transparent)]
    Layout(#[from] tally_common::layout::LayoutError),
    /// Old bucket keys kept appearing walk after walk over a cluster's nodes: a writer of the
    /// old layout is still running (or slots kept migrating). What was found is folded.
    #[error(
        "old bucket keys were still found after {MAX_WALKS} walks over the cluster's nodes: \
         stop every writer of the old layout and run the command again (what was found is folded)"
    )]
    Unsettled,
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Fields read.
    pub fields: u64,
    /// Fields whose expired buckets were dropped (some left).
    pub trimmed: u64,
    /// Fields deleted: nothing left.
    pub deleted: u64,
    /// Fields that are not cells, left alone.
    pub corrupt: u64,
}

/// What a migration did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// Old bucket keys folded into cells and deleted.
    pub keys: u64,
    /// Fields written.
    pub fields: u64,
    /// Old keys left because their value is not an integer.
    pub corrupt: u64,
}

/// Runs `scripts/cells.lua` on one hash's rewrite; `Ok(false)` when a field changed since it
/// was read. `extra` keys (same slot) are deleted with the rewrite, each only if it still holds
/// its value.
async fn rewrite(
    conn: &RedisConn,
    script: &redis::Script,
    stripe: &StripeWrite,
    extra: &[(String, String)],
) -> Result<bool, UpkeepError> {
    let mut invocation = ScriptCall::new(script);
    invocation.arg(1);
    stripe.add_to(&mut invocation);
    for (old, value) in extra {
        invocation.key(old).arg(value);
    }
    let reply: Vec<String> = invocation.invoke(&mut conn.clone()).await?;
    match reply.first().map(String::as_str) {
        Some("ok") => Ok(true),
        Some("stale") => Ok(false),
        _ => Err(UpkeepError::Protocol(format!("{reply:?}"))),
    }
}

/// The cells script, hashed once.
fn script() -> redis::Script {
    redis::Script::new(crate::store::redis_sink::CELLS_SCRIPT)
}

/// `cells` without the buckets expired at `now_ms` under `namespaces` (the windows of `counter`'s
/// namespace as configured; a width it no longer keeps has expired).
fn swept(namespaces: &Namespaces, counter: &str, cells: &Cells, now_ms: i64) -> Cells {
    let windows = &namespaces.policy(counter).windows;
    let mut kept = Cells::default();
    for (width, start, count) in cells.buckets() {
        let Some(window) = windows.list().iter().find(|w| w.width_ms == width) else {
            continue;
        };
        if start
            .saturating_add(width)
            .saturating_add(window.retention_ms)
            > now_ms
        {
            // Adding to an empty bucket cannot overflow.
            let _ = kept.add(width, start, count);
        }
    }
    kept
}

/// Drops the expired buckets of every cells field, deleting the fields left empty.
pub async fn sweep(
    conn: &RedisConn,
    keyspace: &Keyspace,
    namespaces: &Namespaces,
) -> Result<SweepReport, UpkeepError> {
    let script = script();
    let mut report = SweepReport::default();
    let plan = tally_common::regroup::read_plan(conn, keyspace).await;
    let groups = plan.map_or(keyspace.groups(), |p| p.cells.max(keyspace.groups()));
    let keyspace = &tally_common::layout::cells_stripes_for_reading(conn, keyspace).await?;
    for group in 0..groups {
        for stripe in 0..keyspace.cells_stripes() {
            let key = keyspace.cells_key_of_stripe(group, stripe);
            let mut cursor: u64 = 0;
            loop {
                let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                    .arg(&key)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(BATCH)
                    .query_async(&mut conn.clone())
                    .await?;
                let now = now_ms();
                let mut fields: Vec<FieldWrite> = Vec::new();
                for (field, value) in pairs {
                    report.fields += 1;
                    let Some(cells) = Cells::parse(&value) else {
                        report.corrupt += 1;
                        continue;
                    };
                    let kept = swept(namespaces, &field, &cells, now);
                    if kept == cells {
                        continue;
                    }
                    if kept.is_empty() {
                        report.deleted += 1;
                    } else {
                        report.trimmed += 1;
                    }
                    fields.push(FieldWrite {
                        field: field.into(),
                        read: Some(value.into()),
                        value: (!kept.is_empty()).then(|| kept.to_value().into()),
                    });
                }
                // A field a flush rewrote meanwhile is left for the next sweep.
                let stripe = StripeWrite {
                    key: key.clone(),
                    expire_at_ms: None,
                    fields,
                };
                sweep_fields(conn, &script, stripe).await?;
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
    }
    Ok(report)
}

/// Rewrites the swept fields of `stripe`, all at once or, when one of them changed since it
/// was read, each alone, skipping those a flush changed.
async fn sweep_fields(
    conn: &RedisConn,
    script: &redis::Script,
    stripe: StripeWrite,
) -> Result<(), UpkeepError> {
    if stripe.fields.is_empty() || rewrite(conn, script, &stripe, &[]).await? {
        return Ok(());
    }
    for field in stripe.fields {
        let alone = StripeWrite {
            key: stripe.key.clone(),
            expire_at_ms: None,
            fields: vec![field],
        };
        rewrite(conn, script, &alone, &[]).await?;
    }
    Ok(())
}

/// Per (group, counter) in the migration: an old key, with its bucket's width and start.
type OldKey = (String, i64, i64);

/// An old bucket key: `(group, counter, width_ms, start_ms)`.
fn parse_old_key<'k>(keyspace: &Keyspace, key: &'k str) -> Option<(u32, &'k str, i64, i64)> {
    let rest = key.strip_prefix(keyspace.prefix())?.strip_prefix(":{g")?;
    let (group, rest) = rest.split_once("}:w:")?;
    let (width, rest) = rest.split_once(':')?;
    let (start, counter) = rest.split_once(':')?;
    Some((
        group.parse().ok()?,
        counter,
        width.parse().ok()?,
        start.parse().ok()?,
    ))
}

/// Folds every old bucket key into the cells and deletes it.
pub async fn migrate(conn: &RedisConn, keyspace: &Keyspace) -> Result<MigrateReport, UpkeepError> {
    // A writer of cells: the deployment's stripes, recorded first if none are.
    let keyspace = &tally_common::layout::record_cells_stripes(conn, keyspace).await?;
    let script = script();
    let mut report = MigrateReport::default();
    let pattern = format!("{}:{{g*}}:w:*", keyspace.prefix());
    // What was left is counted by the last walk. The nodes are asked again on every walk: a
    // slot that migrated since the last may have left a node unwalked.
    let walk = async || {
        let folded = report.keys;
        report.corrupt = 0;
        let groups = (0..keyspace.groups()).map(|group| keyspace.fence_key(group));
        for slot_key in &conn.one_per_node(groups).await? {
            fold_walked(conn, keyspace, &script, slot_key, &pattern, &mut report).await?;
        }
        Ok::<_, UpkeepError>((report.keys - folded) as usize)
    };
    if !walk_until_settled(conn.is_cluster(), walk).await? {
        return Err(UpkeepError::Unsettled);
    }
    Ok(report)
}

/// Walks the old bucket keys at `slot_key`'s node and folds them into the cells.
async fn fold_walked(
    conn: &RedisConn,
    keyspace: &Keyspace,
    script: &redis::Script,
    slot_key: &str,
    pattern: &str,
    report: &mut MigrateReport,
) -> Result<(), UpkeepError> {
    let mut found: BTreeMap<(u32, String), Vec<OldKey>> = BTreeMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys) = conn.scan_page_at(slot_key, cursor, pattern, BATCH).await?;
        for key in keys {
            if let Some((group, counter, width, start)) = parse_old_key(keyspace, &key) {
                let entry = found.entry((group, counter.to_owned())).or_default();
                entry.push((key.clone(), width, start));
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    for ((group, counter), keys) in found {
        let hash = keyspace.cells_key(group, &counter);
        let mut rereads = Rereads::new(MAX_STALE_READS);
        loop {
            let held: Option<String> = redis::cmd("HGET")
                .arg(&hash)
                .arg(&counter)
                .query_async(&mut conn.clone())
                .await?;
            let mut reads = redis::pipe();
            for (key, _, _) in &keys {
                reads.get(key).cmd("PEXPIRETIME").arg(key);
            }
            let olds: Vec<(Option<String>, i64)> = reads.query_async(&mut conn.clone()).await?;
            let Some(mut cells) = Cells::parse(held.as_deref().unwrap_or("")) else {
                return Err(UpkeepError::Protocol(format!(
                    "{hash} field {counter} is not cells: {held:?}"
                )));
            };
            let mut extra = Vec::new();
            let mut corrupt = 0;
            let mut expire_at = None;
            for ((key, width, start), (value, expires)) in keys.iter().zip(olds) {
                // Gone meanwhile (expired): nothing to fold.
                let Some(value) = value else { continue };
                let added = value
                    .parse::<i64>()
                    .ok()
                    .map(|v| cells.add(*width, *start, v));
                if !matches!(added, Some(Ok(()))) {
                    corrupt += 1;
                    continue;
                }
                expire_at = expire_at.max(Some(expires).filter(|t| *t > 0));
                extra.push((key.clone(), value));
            }
            let stripe = StripeWrite {
                key: hash.clone(),
                expire_at_ms: expire_at,
                fields: vec![FieldWrite {
                    field: counter.as_str().into(),
                    read: held.map(Into::into),
                    value: (!cells.is_empty()).then(|| cells.to_value().into()),
                }],
            };
            // Counted once, on the attempt that lands (or finds nothing to fold).
            if extra.is_empty() || rewrite(conn, script, &stripe, &extra).await? {
                report.keys += extra.len() as u64;
                report.fields += u64::from(!extra.is_empty());
                report.corrupt += corrupt;
                break;
            }
            if !rereads.again().await {
                return Err(UpkeepError::Stale(hash));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_keys_are_parsed_and_expired_buckets_swept_by_the_configured_windows() {
        let ks = Keyspace::new("t".to_owned(), 4).expect("keyspace");
        assert_eq!(
            parse_old_key(&ks, "t:{g3}:w:60000:120000:likes:post:1"),
            Some((3, "likes:post:1", 60_000, 120_000))
        );
        assert_eq!(parse_old_key(&ks, "t:{g3}:c:likes:post:1"), None);
        assert_eq!(parse_old_key(&ks, "u:{g3}:w:60000:120000:x"), None);
        let ns = Namespaces::from_toml(
            "[namespaces.views]\nwindows = [{ width = \"1m\", retention = \"2m\" }]\n",
        )
        .expect("valid");
        let mut cells = Cells::default();
        for m in 0..5 {
            cells.add(60_000, m * 60_000, 1).expect("no overflow");
        }
        cells.add(3_600_000, 0, 5).expect("no overflow");
        // At 6m: minutes 0-3 ended 2 minutes or more ago; hours are no longer kept.
        let kept = swept(&ns, "views:a", &cells, 6 * 60_000);
        assert_eq!(kept.to_string(), "1m=4:1");
        assert!(swept(&ns, "other:a", &cells, 0).is_empty());
    }
}
