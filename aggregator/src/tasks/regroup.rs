//! Re-grouping a live deployment (`tally regroup`): growing, as `tally_common::regroup` does it,
//! and shrinking, which retires groups and so folds their shares back.
//!
//! Shrinking from `read` groups to `to` goes the other way round from growing:
//!
//! 1. **Writers first.** The plan's `write` drops to `to`; each aggregator takes its partitions
//!    again within a second or so, placing new offsets in `to` groups. Readers still sum `read`.
//! 2. **Wait** a few seconds (every aggregator reads the plan each second), then until every
//!    partition's watermark has passed the last offset it placed in more than `to` groups: from
//!    then on no replay writes a retired group again (an owner skips groups past the ones it
//!    stamps, `crate::machine::partition`), and every offset placed in one is applied there.
//!    At-least-once aggregators keep no watermark: one that flushes what it placed the old way
//!    after the fold leaves it in a retired group, where no reader sums it until the command
//!    runs again at the same count, which folds such stray shares.
//! 3. **Fold** every share of the retired groups into its counter's base share (in the original
//!    groups), journaled as compaction moves are ([`Compactor::fold`]): at every moment a read
//!    counts each amount once, and a fold killed at any point is finished by the next run.
//! 4. **Readers last.** The plan's `read` drops to `to`. A reader still summing the retired
//!    groups for the rest of its lease reads them empty.
//!
//! The original count is the floor: partitions' bookkeeping, likes, directly written shards and
//! compaction's base shares live in those groups. A retired group keeps its ledger and fence
//! hashes (a field per partition), so that a later growth finds what each partition applied
//! there.
//!
//! On a standalone Redis the fold finds shares with `SCAN` and each move's steps follow one
//! another, since every exact read is a snapshot. On a Redis Cluster a read is one request per
//! slot: the fold lists each retired group's slot on its master, and spaces each move's steps by
//! [`regroup::FOLD_STEP_GAP`] ([`Compactor::fold_spaced`]), while readers read a moving
//! counter's base share again with the move's marker, and read again any read of
//! [`regroup::FOLD_READ_BOUND`] or more that a shrink could have run under
//! (`tally_common::Reader::get_many`). The run at the count in use does not look for stray
//! shares on a cluster.
//!
//! Window buckets are not folded: a bucket lives only as long as its window's retention, so the
//! retired groups' buckets are left to expire where they are, and windowed reads go on summing
//! those groups (the plan's `cells`) until they have. A run at the count in use sets `cells` to
//! the groups still holding buckets.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{AsyncCommands as _, ScanOptions};
use tally_common::keyspace::MAX_GROUPS;
use tally_common::regroup::{self, GroupPlan, PlanError, Progress, RegroupError};
use tally_common::{Keyspace, Namespaces, RedisConn};

use crate::tasks::compact::{CompactError, Compactor};
use crate::tasks::pack::PackError;

/// Why a re-grouping stopped.
#[derive(Debug, thiserror::Error)]
pub enum RegroupFailure {
    /// Growing was refused, or another re-grouping changed the plan meanwhile.
    #[error(transparent)]
    Regroup(#[from] RegroupError),
    /// The plan could not be read or stored.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// Folding failed (Redis, a newer compactor).
    #[error("folding the retired groups: {0}")]
    Fold(#[from] CompactError),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The deployment's record of its cells stripes is unreadable.
    #[error(transparent)]
    Layout(#[from] tally_common::layout::LayoutError),
    /// Fewer groups than the deployment was created with.
    #[error(
        "a deployment shrinks down to its original {origin} shard groups at most, not {to}: partitions' bookkeeping, likes and directly written shards live in those"
    )]
    BelowOrigin {
        /// The count asked for.
        to: u32,
        /// The original count.
        origin: u32,
    },
    /// The retired groups' packed fields could not go back into keys for the fold.
    #[error("unpacking the retired groups: {0}")]
    Unpack(#[from] PackError),
    /// Some partitions did not move within the wait.
    #[error(
        "{} partition(s) did not move within the wait: {}; run the command again once their owners run (writers place new offsets in {write} groups, readers still sum {read})",
        pending.len(),
        pending.iter().map(|(p, g)| format!("{p} ({g} groups)")).collect::<Vec<_>>().join(", ")
    )]
    NotMoved {
        /// The partitions, with the count they still place new offsets in.
        pending: Vec<(String, u32)>,
        /// The writers' count.
        write: u32,
        /// The readers' count.
        read: u32,
    },
}

/// Moves the deployment to `to` groups, growing or shrinking; waits up to `wait` for every
/// partition's owner to move. `say` hears each step. Safe to run again after it was interrupted.
pub async fn regroup(
    conn: &RedisConn,
    keyspace: &Keyspace,
    to: u32,
    wait: Duration,
    mut say: impl FnMut(&str),
) -> Result<GroupPlan, RegroupFailure> {
    let plan = regroup::read_plan(conn, keyspace).await?;
    if to < plan.write || (to == plan.write && plan.read > to) {
        return shrink(conn, keyspace, plan, to, wait, say).await;
    }
    if to == plan.write && to == plan.read {
        // What an untracked writer (an at-least-once aggregator that flushed after a shrink's
        // fold) placed past the groups in use: its shares are folded now, and windowed reads
        // sum the groups its window buckets went to.
        let mut upto = plan.cells;
        if !conn.is_cluster() {
            let stray = strays(conn, keyspace, to).await?;
            if let Some(&last) = stray.shares.last() {
                let (folded, dropped) = fold(conn, keyspace, &stray.shares, last + 1).await?;
                say(&format!(
                    "folded {folded} stray share(s) of groups {:?} into their base groups{}",
                    stray.shares,
                    dropped_by_resets(dropped)
                ));
            }
            if let Some(&last) = stray.cells.last() {
                upto = upto.max(last + 1);
            }
        }
        if upto > plan.read {
            let cells = groups_with_buckets(conn, keyspace, to, upto).await?;
            let plan = if cells == plan.cells {
                plan
            } else {
                let changed = GroupPlan {
                    version: plan.version + 1,
                    cells,
                    ..plan
                };
                regroup::replace_plan(conn, keyspace, &changed).await?;
                changed
            };
            say(&windows_left(&plan));
            return Ok(plan);
        }
    }
    let plan = regroup::grow(conn, keyspace, to, &mut say).await?;
    moved(conn, keyspace, &plan, wait, &mut say).await?;
    Ok(plan)
}

/// Waits until every partition places new offsets in `plan.write` groups only.
async fn moved(
    conn: &RedisConn,
    keyspace: &Keyspace,
    plan: &GroupPlan,
    wait: Duration,
    say: &mut impl FnMut(&str),
) -> Result<Progress, RegroupFailure> {
    let deadline = Instant::now() + wait;
    loop {
        let progress = regroup::progress(conn, keyspace).await?;
        if progress.plan != *plan {
            return Err(RegroupError::Raced(progress.plan).into());
        }
        if progress.pending.is_empty() {
            say(&format!(
                "every partition ({}) places new offsets in {} groups",
                progress.moved.len(),
                plan.write
            ));
            return Ok(progress);
        }
        if Instant::now() >= deadline {
            return Err(RegroupFailure::NotMoved {
                pending: progress.pending,
                write: plan.write,
                read: plan.read,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Shrinks the deployment from `plan` to `to` groups (see the module).
async fn shrink(
    conn: &RedisConn,
    keyspace: &Keyspace,
    plan: GroupPlan,
    to: u32,
    wait: Duration,
    mut say: impl FnMut(&str),
) -> Result<GroupPlan, RegroupFailure> {
    if to < plan.origin {
        return Err(RegroupFailure::BelowOrigin {
            to,
            origin: plan.origin,
        });
    }
    let plan = if plan.write == to {
        plan
    } else {
        let writers = GroupPlan {
            version: plan.version + 1,
            write: to,
            ..plan
        };
        regroup::replace_plan(conn, keyspace, &writers).await?;
        say(&format!(
            "writers place new offsets in {to} groups (from {}); readers still sum {}",
            plan.write, plan.read
        ));
        writers
    };
    // Every aggregator reads the plan each second; at-least-once ones have no watermark to wait
    // for, so give them that long (see the module).
    tokio::time::sleep(regroup::PHASE_WAIT).await;
    moved(conn, keyspace, &plan, wait, &mut say).await?;
    let retired: Vec<u32> = (to..plan.read).collect();
    if plan.buckets > 0 {
        // The fold moves keys: the retired groups' fields go back into keys first, each in one
        // step (readers sum both forms).
        let unpacked = crate::tasks::pack::unpack(conn, keyspace, &retired).await?;
        say(&format!(
            "moved {unpacked} packed share(s) of groups {to}..{} back into keys",
            plan.read
        ));
    }
    let (folded, dropped) = fold(conn, keyspace, &retired, plan.read).await?;
    say(&format!(
        "folded {folded} share(s) of groups {to}..{} into their base groups{}",
        plan.read,
        dropped_by_resets(dropped)
    ));
    let cells = groups_with_buckets(conn, keyspace, to, plan.cells.max(plan.read)).await?;
    let readers = GroupPlan {
        version: plan.version + 1,
        read: to,
        cells,
        ..plan
    };
    regroup::replace_plan(conn, keyspace, &readers).await?;
    say(&format!("readers sum {to} groups"));
    if cells > to {
        say(&windows_left(&readers));
    }
    Ok(readers)
}

/// What a fold says of the moves it dropped.
fn dropped_by_resets(dropped: u64) -> String {
    match dropped {
        0 => String::new(),
        n => format!(" ({n} of them dropped: their counters were reset meanwhile)"),
    }
}

/// Folds every share of `groups` into its base share until a pass finds none, with a compactor
/// stamped in `stamped` groups; returns the moves made, and how many of them were dropped
/// because a reset of their counter had cleared their amount.
async fn fold(
    conn: &RedisConn,
    keyspace: &Keyspace,
    groups: &[u32],
    stamped: u32,
) -> Result<(usize, u64), RegroupFailure> {
    let compactor = Compactor::start_over(
        conn.clone(),
        keyspace.clone(),
        Arc::new(Namespaces::default()),
        Duration::ZERO,
        stamped.max(keyspace.groups()),
    )
    .await?;
    let folding = async {
        let mut folded = 0;
        loop {
            let moves = if conn.is_cluster() {
                compactor
                    .fold_spaced(groups, regroup::FOLD_STEP_GAP)
                    .await?
            } else {
                let mut moves = 0;
                for &group in groups {
                    moves += compactor.fold(group..group + 1).await?;
                }
                moves
            };
            if moves == 0 {
                return Ok::<_, CompactError>(folded);
            }
            folded += moves;
        }
    };
    // The groups' moving marks go with the compactor, whether the fold finished or not.
    let folded = folding.await;
    let closed = compactor.close().await;
    let folded = folded?;
    closed?;
    Ok((folded, compactor.cancelled()))
}

/// The groups at or past `from` that hold shares or journals, and those that hold window
/// buckets, each in order.
#[derive(Debug, Default)]
struct Strays {
    shares: Vec<u32>,
    cells: Vec<u32>,
}

/// The groups at or past `from` holding shares, journals or window buckets (`SCAN`).
async fn strays(
    conn: &RedisConn,
    keyspace: &Keyspace,
    from: u32,
) -> Result<Strays, RegroupFailure> {
    let options = ScanOptions::default()
        .with_pattern(format!("{}:{{g*}}:[cjW]:*", keyspace.prefix()))
        .with_count(1000);
    let mut scan = conn.clone();
    let mut keys = scan.scan_options::<String>(options).await?;
    let (mut shares, mut cells) = (BTreeSet::new(), BTreeSet::new());
    while let Some(key) = keys.next_item().await {
        let key = key?;
        if let Some((group, _, _)) = keyspace.parse_compaction_key(&key) {
            if (from..MAX_GROUPS).contains(&group) {
                shares.insert(group);
            }
        } else if let Some(group) = keyspace.parse_cells_key(&key)
            && (from..MAX_GROUPS).contains(&group)
        {
            cells.insert(group);
        }
    }
    Ok(Strays {
        shares: shares.into_iter().collect(),
        cells: cells.into_iter().collect(),
    })
}

/// How many groups windowed reads must sum: `to`, or past the last group of `to..upto` that
/// still holds window buckets.
async fn groups_with_buckets(
    conn: &RedisConn,
    keyspace: &Keyspace,
    to: u32,
    upto: u32,
) -> Result<u32, RegroupFailure> {
    let keyspace = &tally_common::layout::cells_stripes_for_reading(conn, keyspace).await?;
    for group in (to..upto).rev() {
        if tally_common::layout::group_holds_cells(conn, keyspace, group).await? {
            return Ok(group + 1);
        }
    }
    Ok(to)
}

/// What a plan whose windowed reads sum retired groups tells the operator.
fn windows_left(plan: &GroupPlan) -> String {
    if plan.cells == plan.read {
        return format!("windowed reads sum {} groups", plan.read);
    }
    format!(
        "window buckets in groups {}..{} are left to expire (their hashes expire with their last bucket): windowed reads sum {} groups until then; run this again at {} to stop reading them",
        plan.read, plan.cells, plan.cells, plan.read
    )
}
