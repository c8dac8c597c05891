//! Owning a partition in exactly-once mode: epochs, fences, ledgers and the watermark.
//!
//! When an aggregator is assigned a partition, [`acquire`] takes a new epoch for it (a counter in
//! the partition's home group, strictly above every fence it has stamped) and stamps that epoch
//! into the partition's fence in **every** shard group, reading each group's ledger entry as it
//! stamps. Every later write into a group checks the fence in its own slot, so an earlier owner
//! that lost the partition (paused, partitioned, slow) has its late writes refused in every group,
//! including groups the new owner has not written to yet.
//!
//! A group's **ledger entry** for a partition is the offset after the last message whose delta
//! for that group it has applied; it is written in the same atomic operation as the deltas. The
//! partition's **watermark**, in its home group, is the offset from which it resumes: everything
//! before it is applied in every group. It is stored after all of a flush's group writes landed,
//! together with the ledger entries the groups had then, so that a group that later lost writes
//! (a Redis Cluster node restarted from an older append-only file) can be told apart from a group
//! that never received anything: [`resume_offset`] rewinds to the rolled-back group's ledger, and
//! the consume loop skips, per group, every message below that group's current ledger entry. So a
//! crash between two groups' writes, a retried write whose first attempt landed, and a Redis that
//! came back older all end with every offset applied exactly once. A partition with nothing to
//! flush is [`verify`]d every little while, so that a rollback is noticed and re-fed even when no
//! new event arrives.

use tally_common::Keyspace;
use tally_common::keyspace::{Fan, partition_field};
pub use tally_common::keyspace::{Spread, Watermark};
use tally_common::regroup;

use crate::machine::ownership::{Owner, Resume, resume_offset};
use crate::store::sink::{Applied, Sink, SinkError, Stamp};

/// Takes ownership of `partition`: a new epoch, stamped into every group's fence (every group
/// readers sum, after a re-grouping: `tally_common::regroup`), and the resume offset. The owner
/// spreads counters over `spread` of the groups the deployment's plan writes, from the first
/// offset no group has applied (see [`Spread`]); when that changes the recorded fan, the new one
/// is stored in the watermark before anything is written under it. Fails (to be retried by the
/// caller) on a Redis error, or if a newer owner took the partition meanwhile; fails for good on
/// a stored watermark or plan it cannot read, or a plan made for another group count.
pub async fn acquire<S: Sink>(
    sink: &S,
    keyspace: &Keyspace,
    topic: &str,
    partition: i32,
    spread: u32,
) -> Result<(Owner, Resume), SinkError> {
    let field = partition_field(topic, partition);
    let home = keyspace.group_for_partition(partition);
    let stored = sink.read_plan().await?;
    let plan = regroup::checked(keyspace, keyspace.plan_key(), stored.as_deref())
        .map_err(|e| SinkError::fatal(e.to_string()))?;
    let width = plan.read.max(keyspace.groups());
    let (epoch, ledgers) = take_epoch(sink, width, home, &field).await?;
    let watermark = match sink.read_watermark(home, &field).await? {
        None => None,
        // Read as absent, an unreadable watermark would lose the partition's spread history,
        // and with it the groups its log was applied in.
        Some(text) => Some(Watermark::parse(&text).ok_or_else(|| {
            SinkError::fatal(format!(
                "the watermark of {field} in group {home} is unreadable: {text:?}"
            ))
        })?),
    };
    let resume = resume_offset(watermark.as_ref(), &ledgers);
    let recorded = watermark
        .as_ref()
        .map_or(Spread::uniform(1), |w| w.spread.clone());
    let unapplied = ledgers.iter().copied().max().unwrap_or(-1);
    let owner = Owner {
        field,
        home,
        epoch,
        spread: recorded.then_fan(Fan::over(spread, plan.write, keyspace.groups()), unapplied),
        plan_version: plan.version,
        ledgers,
    };
    if owner.spread != recorded {
        // Only the spread changes: resume offset and recorded ledgers (rollback detection)
        // stay; a partition without a watermark still resumes from the beginning (-1).
        let mut stored = watermark.unwrap_or_else(|| owner.watermark(-1));
        stored.spread.clone_from(&owner.spread);
        let written = sink
            .write_watermark(home, &owner.field, epoch, &stored.encode())
            .await?;
        if written != Applied::Written {
            return Err(SinkError::retryable(format!(
                "storing the partition's new spread was refused ({written:?}): another owner took it"
            )));
        }
        let fan = owner.spread.current_fan();
        tracing::info!(
            partition,
            from_offset = unapplied,
            spread = fan.k,
            groups = fan.groups_of(keyspace.groups()),
            "the partition's spread changes"
        );
    }
    Ok((owner, resume))
}

/// Moves every group's ledger entry past `to` back to it, under `owner`'s fence, and `owner`'s
/// record of them with it: the partition's log was truncated at `to` (an unclean leader
/// election), so the records the new leader writes from there on are new and must be applied.
/// Returns how far the furthest ledger had gone past `to`: offsets applied from records the log
/// no longer holds. Fails, to be retried by acquiring again, if a newer owner took the partition.
/// The watermark is left as it is: a group's ledger below what it recorded makes the next
/// acquisition resume from that ledger, as after a rollback, until the next flush stores a new
/// one.
pub async fn rewind<S: Sink>(sink: &S, owner: &mut Owner, to: i64) -> Result<i64, SinkError> {
    let mut past = 0;
    for (group, ledger) in owner.ledgers.iter_mut().enumerate() {
        if *ledger <= to {
            continue;
        }
        let rewound = sink
            .rewind_ledger(group as u32, &owner.field, owner.epoch, to)
            .await?;
        if rewound != Applied::Written {
            return Err(SinkError::retryable(format!(
                "moving group {group}'s ledger back to the truncation point was refused ({rewound:?}): another owner took the partition"
            )));
        }
        past = past.max(*ledger - to);
        *ledger = to;
    }
    Ok(past)
}

/// Takes a new epoch for `field` (its counter lives in group `home`) and stamps it into the fence
/// of each of the `groups` groups, reading each group's ledger entry for `field` as it stamps.
/// Partitions ([`acquire`]) and the compactor (`crate::tasks::compact`) own their work this way.
pub async fn take_epoch<S: Sink>(
    sink: &S,
    groups: u32,
    home: u32,
    field: &str,
) -> Result<(u64, Vec<i64>), SinkError> {
    let mut at_least = 0;
    'epoch: loop {
        let epoch = sink.next_epoch(home, field, at_least).await?;
        let mut ledgers = Vec::with_capacity(groups as usize);
        for group in 0..groups {
            match sink.stamp_fence(group, field, epoch).await? {
                Stamp::Stamped { ledger } => ledgers.push(ledger),
                Stamp::Stale { current } => {
                    // The epoch counter is behind a fence (it rolled back): jump past it.
                    at_least = current + 1;
                    continue 'epoch;
                }
            }
        }
        return Ok((epoch, ledgers));
    }
}

/// Checks that Redis still holds what `owner` saw land: its epoch in every group's fence, and in
/// every group a ledger entry at least where the owner left it. Returns [`Applied::Written`] when
/// it does, [`Applied::Fenced`] when a newer owner stamped a fence, and [`Applied::RolledBack`]
/// when a group lost writes (a Redis back from a crash with an older state), so that an idle
/// partition is re-fed without waiting for its next event.
pub async fn verify<S: Sink>(sink: &S, owner: &Owner) -> Result<Applied, SinkError> {
    for (group, &expected) in owner.ledgers.iter().enumerate() {
        let (fence, ledger) = sink
            .read_fence_and_ledger(group as u32, &owner.field)
            .await?;
        if fence != Some(owner.epoch) {
            return Ok(Applied::from_fence(fence, owner.epoch));
        }
        if ledger.unwrap_or(-1) < expected {
            return Ok(Applied::RolledBack);
        }
    }
    Ok(Applied::Written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermark_round_trips_and_rejects_garbage() {
        let w = Watermark::new(120, &[-1, 100, -1, 120], Spread::uniform(1));
        assert_eq!(w.encode(), "120;1=100;3=120");
        assert_eq!(Watermark::parse(&w.encode()), Some(w));
        assert_eq!(
            Watermark::parse("7"),
            Some(Watermark {
                next_offset: 7,
                ledgers: vec![],
                spread: Spread::uniform(1),
            })
        );
        assert_eq!(Watermark::parse("x"), None);
        assert_eq!(Watermark::parse("7;1"), None);
    }

    #[test]
    fn no_watermark_resumes_from_the_beginning() {
        assert_eq!(resume_offset(None, &[5, -1]), Resume::Beginning);
    }

    #[test]
    fn resumes_at_the_watermark_when_no_group_lost_writes() {
        let w = Watermark::new(120, &[-1, 100, -1, 120], Spread::uniform(1));
        // Group 3 moved on past the watermark (a flush landed there, then a crash): still 120.
        assert_eq!(
            resume_offset(Some(&w), &[-1, 100, -1, 150]),
            Resume::At(120)
        );
    }

    #[test]
    fn a_group_that_never_received_anything_is_not_a_rollback() {
        let w = Watermark::new(120, &[-1, -1, -1, 120], Spread::uniform(1));
        assert_eq!(resume_offset(Some(&w), &[-1, -1, -1, 120]), Resume::At(120));
    }

    #[test]
    fn a_group_that_rolled_back_is_re_fed_from_its_ledger() {
        let w = Watermark::new(120, &[-1, 100, -1, 120], Spread::uniform(1));
        assert_eq!(resume_offset(Some(&w), &[-1, 80, -1, 120]), Resume::At(80));
        // It lost everything: from the beginning.
        assert_eq!(
            resume_offset(Some(&w), &[-1, -1, -1, 120]),
            Resume::Beginning
        );
    }

    #[test]
    fn a_retired_group_is_not_a_rollback() {
        // Recorded over 6 groups; the owner now stamps 4 (groups 4 and 5 were folded away).
        let w = Watermark::new(120, &[-1, 100, -1, 120, 90, 110], Spread::uniform(1));
        assert_eq!(
            resume_offset(Some(&w), &[-1, 100, -1, 120]),
            Resume::At(120)
        );
        assert_eq!(resume_offset(Some(&w), &[-1, 70, -1, 120]), Resume::At(70));
    }
}
