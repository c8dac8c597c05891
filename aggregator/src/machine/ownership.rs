//! What an exactly-once owner knows of its partition ([`Owner`]: epoch, ledgers, spread), and
//! where a partition resumes ([`resume_offset`]) from its watermark and the groups' ledgers:
//! decisions without I/O, which `crate::store::fence` acts on.

use tally_common::keyspace::{Spread, Watermark};

/// What an owner knows about its partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The partition's field in the bookkeeping hashes.
    pub field: String,
    /// The partition's home group (epoch counter, watermark).
    pub home: u32,
    /// This owner's epoch.
    pub epoch: u64,
    /// Per group, the ledger entry (offset after the last applied message; -1 for none).
    pub ledgers: Vec<i64>,
    /// How the partition's counters spread over groups along its log: the recorded stretches
    /// some group may have applied, then this owner's configured spread.
    pub spread: Spread,
    /// The version of the group plan it was acquired under (`tally_common::regroup`).
    pub plan_version: u64,
}

impl Owner {
    /// The watermark after a flush up to `next_offset`, with the ledgers as they are now.
    pub fn watermark(&self, next_offset: i64) -> Watermark {
        Watermark::new(next_offset, &self.ledgers, self.spread.clone())
    }
}

/// Where a partition resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// From the start of the retained log: nothing (or a rolled-back group's everything) was
    /// applied.
    Beginning,
    /// From this offset.
    At(i64),
}

/// Where to resume, from the stored watermark (if any) and the groups' current ledger entries.
///
/// Without a watermark nothing is known to be applied everywhere: resume from the beginning (the
/// skip rule then passes over whatever some group had applied). With one, resume from it, unless
/// a group's ledger entry is now below what it was when the watermark was stored: that group lost
/// writes, so rewind to its ledger entry to re-feed it. Groups past `ledgers` (retired by a
/// re-grouping) are left out.
pub fn resume_offset(watermark: Option<&Watermark>, ledgers: &[i64]) -> Resume {
    let Some(watermark) = watermark else {
        return Resume::Beginning;
    };
    let mut from = watermark.next_offset;
    for &(group, recorded) in &watermark.ledgers {
        // A group past the owner's was retired by a re-grouping, its shares folded into the
        // groups left: what it lost no longer counts.
        let Some(&current) = ledgers.get(group as usize) else {
            continue;
        };
        if current < recorded {
            from = from.min(current);
        }
    }
    if from < 0 {
        Resume::Beginning
    } else {
        Resume::At(from)
    }
}
