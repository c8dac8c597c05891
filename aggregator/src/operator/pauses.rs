//! How long each partition went without a durable flush, from samples of the aggregators'
//! `tally_durable_offset`: what a rebalance costs, as the bench's rebalance scenario and the
//! failover tests measure it. Pure: the caller scrapes the members and hands each sample in.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// Every `tally_durable_offset` series in a Prometheus text exposition: (partition, offset).
pub fn durable_offsets(exposition: &str) -> Vec<(i32, i64)> {
    (exposition.lines())
        .filter_map(|line| line.strip_prefix("tally_durable_offset{partition=\""))
        .filter_map(|rest| {
            let (partition, value) = rest.split_once("\"} ")?;
            Some((
                partition.parse().ok()?,
                value.trim().parse::<f64>().ok()? as i64,
            ))
        })
        .collect()
}

/// Each partition's durable offset over time, and who owned it: member names are the
/// caller's (a port, a pod name).
#[derive(Debug, Default)]
pub struct DurableHistory {
    /// Per partition: the highest durable offset seen, and the moments it rose.
    advances: BTreeMap<i32, (i64, Vec<Instant>)>,
    /// Per partition: the member that reported it in the latest sample of each member.
    owners: HashMap<i32, String>,
}

impl DurableHistory {
    /// One member's sample at `at`: the partitions it reports, with their durable offsets.
    pub fn record(&mut self, member: &str, at: Instant, offsets: &[(i32, i64)]) {
        self.owners.retain(|_, owner| owner != member);
        for &(partition, offset) in offsets {
            self.owners.insert(partition, member.to_owned());
            let (highest, rises) = self.advances.entry(partition).or_insert((offset, vec![at]));
            if offset > *highest {
                *highest = offset;
                rises.push(at);
            }
        }
    }

    /// Which member reports each partition now.
    pub fn owners(&self) -> &HashMap<i32, String> {
        &self.owners
    }

    /// The partitions `member` reports now.
    pub fn owned_by(&self, member: &str) -> Vec<i32> {
        let mut owned: Vec<i32> = (self.owners.iter())
            .filter(|(_, owner)| *owner == member)
            .map(|(partition, _)| *partition)
            .collect();
        owned.sort_unstable();
        owned
    }

    /// The highest durable offset any member reported for `partition`.
    pub fn durable(&self, partition: i32) -> Option<i64> {
        self.advances.get(&partition).map(|(highest, _)| *highest)
    }

    /// The longest time `partition` went without its durable offset rising between `from` and
    /// `to`, counting from its last rise before `from` (or `from`, if it had none) and up to
    /// `to` after its last rise.
    pub fn longest_pause(&self, partition: i32, from: Instant, to: Instant) -> std::time::Duration {
        let rises = self.advances.get(&partition).map_or(&[][..], |(_, r)| r);
        let before = rises.iter().rev().find(|t| **t <= from).copied();
        let mut last = before.unwrap_or(from);
        let mut longest = std::time::Duration::ZERO;
        for &rise in rises.iter().filter(|t| **t > from && **t <= to) {
            longest = longest.max(rise - last);
            last = rise;
        }
        longest.max(to.saturating_duration_since(last))
    }

    /// The longest pause among `partitions` between `from` and `to`, and whose it was.
    pub fn longest_among(
        &self,
        partitions: &[i32],
        from: Instant,
        to: Instant,
    ) -> Option<(i32, std::time::Duration)> {
        (partitions.iter())
            .map(|p| (*p, self.longest_pause(*p, from, to)))
            .max_by_key(|(_, pause)| *pause)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn offsets_are_read_from_the_exposition() {
        let text = "# HELP tally_durable_offset x\n# TYPE tally_durable_offset gauge\n\
                    tally_durable_offset{partition=\"3\"} 42\n\
                    tally_durable_offset{partition=\"11\"} 7\n\
                    tally_durable_offsets_other{partition=\"1\"} 9\n";
        assert_eq!(durable_offsets(text), vec![(3, 42), (11, 7)]);
    }

    #[test]
    fn the_longest_pause_counts_from_the_last_rise_and_to_the_end() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut history = DurableHistory::default();
        for (ms, offset) in [(0, 10), (100, 20), (200, 20), (900, 30), (1000, 31)] {
            history.record("a", at(ms), &[(0, offset)]);
        }
        // 100 → 900 is the longest within [150, 1000].
        assert_eq!(
            history.longest_pause(0, at(150), at(1000)),
            Duration::from_millis(800)
        );
        // Nothing rose after 1000: the pause runs to the window's end.
        assert_eq!(
            history.longest_pause(0, at(950), at(2500)),
            Duration::from_millis(1500)
        );
        // A partition never seen paused for the whole window.
        assert_eq!(
            history.longest_pause(9, at(0), at(500)),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn owners_follow_the_latest_sample_of_each_member() {
        let t0 = Instant::now();
        let mut history = DurableHistory::default();
        history.record("a", t0, &[(0, 1), (1, 1)]);
        history.record("b", t0, &[(2, 1)]);
        history.record("a", t0, &[(0, 2)]);
        history.record("b", t0, &[(1, 5), (2, 2)]);
        assert_eq!(history.owned_by("a"), vec![0]);
        assert_eq!(history.owned_by("b"), vec![1, 2]);
        assert_eq!(
            (history.longest_among(&[0, 1, 2], t0, t0 + Duration::from_secs(1)))
                .map(|(_, pause)| pause),
            Some(Duration::from_secs(1))
        );
    }
}
