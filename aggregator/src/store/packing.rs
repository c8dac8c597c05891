//! What a writer knows of each group's packing: whether the group's counters' shares are
//! fields of its packed hashes (`tally_common::layout::PACKED_FIELD` in its fence hash, set by
//! `tally pack`), learned from the flush script's answers. Every exactly-once write checks the
//! group's mark itself, so a writer that guessed wrong is told, learns, and writes again: it
//! never lands a write in the other layout.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a group read unmarked is taken as unmarked by writes that do not check the mark
/// themselves (at-least-once deltas): a mark is never removed, so only "not packed" goes stale.
pub const UNMARKED_FOR: Duration = Duration::from_secs(1);

/// Each group's buckets as last answered or read (absent: not packed, as far as known), and
/// when.
#[derive(Debug, Default)]
pub struct Packing {
    groups: Mutex<HashMap<u32, (u32, Instant)>>,
}

impl Packing {
    /// `group`'s packed hashes per group as this writer knows them (0: the counters' keys).
    pub fn buckets(&self, group: u32) -> u32 {
        self.known_at(group).map_or(0, |(buckets, _)| buckets)
    }

    /// `group`'s buckets if known: packed, or answered or read unmarked less than
    /// [`UNMARKED_FOR`] ago (0); `None` when it is to be read again.
    pub fn known(&self, group: u32) -> Option<u32> {
        let (buckets, at) = self.known_at(group)?;
        (buckets > 0 || at.elapsed() < UNMARKED_FOR).then_some(buckets)
    }

    /// `group` answered, or its mark was read, now: it packs into `buckets` hashes (0: it does
    /// not).
    pub fn learn(&self, group: u32, buckets: u32) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.insert(group, (buckets, Instant::now()));
    }

    fn known_at(&self, group: u32) -> Option<(u32, Instant)> {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups.get(&group).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_packs_once_it_says_so() {
        let packing = Packing::default();
        assert_eq!(
            (packing.buckets(3), packing.known(3)),
            (0, None),
            "never read"
        );
        packing.learn(3, 4096);
        assert_eq!((packing.buckets(3), packing.buckets(4)), (4096, 0));
        assert_eq!(packing.known(3), Some(4096));
        packing.learn(3, 0);
        assert_eq!(packing.buckets(3), 0);
        assert_eq!(packing.known(3), Some(0), "read unmarked just now");
    }
}
