//! How a counter's window buckets are stored: all of them in one hash field, so that a counter
//! with three windows costs one field and one write per flush rather than a key and a write
//! per bucket.
//!
//! Each shard group keeps [`STRIPES`] hashes (`Keyspace::cells_key`); a counter's field is in
//! the stripe its id hashes to, and its value lists its live buckets, window by window:
//!
//! ```text
//! 1m=29934720:3,29934719:12;1h=498912:15;1d=20788:15
//! ```
//!
//! - a window is its width as written (`1m`), then its buckets, newest first;
//! - a bucket is its index (its start over the width: bucket 29934720 of `1m` starts at
//!   29934720 × 60,000 ms) and its count, a non-zero 64-bit integer;
//! - windows are in the order of their widths, narrowest first.
//!
//! The value is rewritten whole on each write ([`Cells::add`]); a write also drops the buckets
//! of the windows it writes that have expired ([`Cells::expire`]). A hash expires when the
//! last bucket written into it does; fields of counters no longer written are dropped by the
//! sweep (`tally windows sweep`, `tally_aggregator::tasks::cells`).

use std::fmt;

use super::{format_duration, parse_duration};

/// Hashes per shard group holding its counters' buckets: enough that a group of a million
/// counters keeps about 16,000 per hash, few enough that a flush of a group writes a handful.
pub const STRIPES: u64 = 64;

/// The buckets of one window.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Section {
    width_ms: i64,
    /// `(index, count)`, newest first; no count is 0.
    buckets: Vec<(i64, i64)>,
}

/// A counter's buckets in one shard group: a parsed field value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cells {
    /// Narrowest first.
    sections: Vec<Section>,
}

/// A bucket's count would pass 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

impl Cells {
    /// The cells a field value holds, or `None` if it is not one.
    pub fn parse(text: &str) -> Option<Self> {
        let mut sections: Vec<Section> = Vec::new();
        if text.is_empty() {
            return Some(Self { sections });
        }
        for section in text.split(';') {
            let (label, buckets) = section.split_once('=')?;
            let width_ms = parse_duration(label).ok()?;
            if format_duration(width_ms) != label
                || sections.last().is_some_and(|s| s.width_ms >= width_ms)
            {
                return None;
            }
            let mut parsed: Vec<(i64, i64)> = Vec::new();
            for bucket in buckets.split(',') {
                let (index, count) = bucket.split_once(':')?;
                let (index, count) = (strict_i64(index)?, strict_i64(count)?);
                if count == 0 || parsed.last().is_some_and(|(i, _)| *i <= index) {
                    return None;
                }
                index.checked_mul(width_ms)?;
                parsed.push((index, count));
            }
            sections.push(Section {
                width_ms,
                buckets: parsed,
            });
        }
        Some(Self { sections })
    }

    /// Whether no bucket is left.
    pub fn is_empty(&self) -> bool {
        self.sections.is_empty()
    }

    /// Adds `delta` to the bucket of width `width_ms` starting at `start_ms`; a count that
    /// comes to 0 leaves no bucket. Nothing changes on overflow.
    pub fn add(&mut self, width_ms: i64, start_ms: i64, delta: i64) -> Result<(), Overflow> {
        let index = start_ms.div_euclid(width_ms);
        let at = match (self.sections).binary_search_by_key(&width_ms, |s| s.width_ms) {
            Ok(at) => at,
            Err(at) => {
                if delta == 0 {
                    return Ok(());
                }
                self.sections.insert(
                    at,
                    Section {
                        width_ms,
                        buckets: Vec::with_capacity(1),
                    },
                );
                at
            }
        };
        let buckets = &mut self.sections[at].buckets;
        // Newest first: the current bucket is almost always the first.
        match buckets.binary_search_by(|(i, _)| index.cmp(i)) {
            Ok(b) => {
                let sum = buckets[b].1.checked_add(delta).ok_or(Overflow)?;
                if sum == 0 {
                    buckets.remove(b);
                } else {
                    buckets[b].1 = sum;
                }
            }
            Err(b) if delta != 0 => buckets.insert(b, (index, delta)),
            Err(_) => {}
        }
        if buckets.is_empty() {
            self.sections.remove(at);
        }
        Ok(())
    }

    /// Drops the buckets of width `width_ms` that expired by `now_ms`: those that ended more
    /// than `retention_ms` before it.
    pub fn expire(&mut self, width_ms: i64, retention_ms: i64, now_ms: i64) {
        let Ok(at) = (self.sections).binary_search_by_key(&width_ms, |s| s.width_ms) else {
            return;
        };
        let buckets = &mut self.sections[at].buckets;
        buckets.retain(|(index, _)| {
            let end = index.saturating_mul(width_ms).saturating_add(width_ms);
            end.saturating_add(retention_ms) > now_ms
        });
        if buckets.is_empty() {
            self.sections.remove(at);
        }
    }

    /// The count of the bucket of width `width_ms` starting at `start_ms` (0 if none).
    pub fn get(&self, width_ms: i64, start_ms: i64) -> i64 {
        let index = start_ms.div_euclid(width_ms);
        (self.sections.iter())
            .find(|s| s.width_ms == width_ms)
            .and_then(|s| s.buckets.iter().find(|(i, _)| *i == index))
            .map_or(0, |(_, count)| *count)
    }

    /// The sum of the buckets of width `width_ms` starting from `first_ms` to `last_ms`
    /// (inclusive), or `None` past 64 bits.
    pub fn sum(&self, width_ms: i64, first_ms: i64, last_ms: i64) -> Option<i64> {
        let (first, last) = (first_ms.div_euclid(width_ms), last_ms.div_euclid(width_ms));
        (self.sections.iter())
            .find(|s| s.width_ms == width_ms)
            .map_or(Some(0), |s| {
                (s.buckets.iter())
                    .filter(|(i, _)| (first..=last).contains(i))
                    .try_fold(0i64, |acc, (_, count)| acc.checked_add(*count))
            })
    }

    /// The field value, written into one allocation of about its size.
    pub fn to_value(&self) -> String {
        use std::fmt::Write;
        let buckets: usize = self.sections.iter().map(|s| s.buckets.len()).sum();
        let mut out = String::with_capacity(8 * self.sections.len() + 24 * buckets);
        // Writing to a String cannot fail.
        let _ = write!(out, "{self}");
        out
    }

    /// Every bucket: `(width_ms, start_ms, count)`, narrowest window first, newest first.
    pub fn buckets(&self) -> impl Iterator<Item = (i64, i64, i64)> + '_ {
        (self.sections.iter()).flat_map(|s| {
            (s.buckets.iter()).map(|(index, count)| (s.width_ms, index * s.width_ms, *count))
        })
    }
}

impl fmt::Display for Cells {
    /// The field value ([`Cells::parse`] reads it back).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, section) in self.sections.iter().enumerate() {
            if i > 0 {
                f.write_str(";")?;
            }
            write!(f, "{}=", format_duration(section.width_ms))?;
            for (j, (index, count)) in section.buckets.iter().enumerate() {
                if j > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{index}:{count}")?;
            }
        }
        Ok(())
    }
}

/// A 64-bit integer written the one way Rust writes it (no `+`, no leading zero, no `-0`).
fn strict_i64(text: &str) -> Option<i64> {
    let value: i64 = text.parse().ok()?;
    (value.to_string() == text).then_some(value)
}

/// The stripe of `counter`'s field: bits of its hash that the choice of its base group does
/// not use.
pub fn stripe(hash: u64) -> u64 {
    (hash >> 40) % STRIPES
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    const HOUR: i64 = 60 * MIN;

    #[test]
    fn buckets_are_added_newest_first_and_printed_the_way_they_parse() {
        let mut cells = Cells::default();
        let now = 29_934_720 * MIN;
        cells.add(HOUR, now, 3).expect("no overflow");
        cells.add(MIN, now, 3).expect("no overflow");
        cells.add(MIN, now - MIN, 12).expect("no overflow");
        cells.add(MIN, now, 4).expect("no overflow");
        let text = cells.to_string();
        assert_eq!(text, "1m=29934720:7,29934719:12;1h=498912:3");
        assert_eq!(Cells::parse(&text), Some(cells.clone()));
        assert_eq!(cells.get(MIN, now - MIN), 12);
        assert_eq!(cells.sum(MIN, now - MIN, now), Some(19));
        assert_eq!(cells.sum(MIN, now - 10 * MIN, now - 2 * MIN), Some(0));
        assert_eq!(cells.sum(HOUR, now, now), Some(3));
        assert_eq!(cells.sum(7 * HOUR, now, now), Some(0));
        // A bucket whose count comes back to 0 is dropped, and so is an empty window.
        cells.add(HOUR, now, -3).expect("no overflow");
        assert_eq!(cells.to_string(), "1m=29934720:7,29934719:12");
        cells.add(MIN, now, -7).expect("no overflow");
        cells.add(MIN, now - MIN, -12).expect("no overflow");
        assert!(cells.is_empty());
        assert_eq!(cells.to_string(), "");
        assert_eq!(Cells::parse(""), Some(Cells::default()));
    }

    #[test]
    fn an_overflow_changes_nothing() {
        let mut cells = Cells::default();
        cells.add(MIN, 0, i64::MAX).expect("no overflow");
        assert_eq!(cells.add(MIN, 0, 1), Err(Overflow));
        assert_eq!(cells.get(MIN, 0), i64::MAX);
        cells.add(MIN, MIN, i64::MAX).expect("no overflow");
        assert_eq!(cells.sum(MIN, 0, MIN), None);
        cells.add(MIN, -MIN, i64::MIN).expect("no overflow");
        assert_eq!(cells.get(MIN, -MIN), i64::MIN);
        assert_eq!(Cells::parse(&cells.to_string()), Some(cells));
    }

    #[test]
    fn expired_buckets_are_dropped_by_their_window_retention() {
        let mut cells = Cells::default();
        for m in 0..5 {
            cells.add(MIN, m * MIN, 1).expect("no overflow");
        }
        cells.add(HOUR, 0, 5).expect("no overflow");
        // Retention 2 minutes: at 6m, buckets ending at or before 4m are gone (0m..3m).
        cells.expire(MIN, 2 * MIN, 6 * MIN);
        assert_eq!(cells.to_string(), "1m=4:1;1h=0:5");
        cells.expire(MIN, 0, 10 * MIN);
        cells.expire(HOUR, 0, 10 * MIN);
        assert_eq!(cells.to_string(), "1h=0:5");
    }

    #[test]
    fn anything_else_is_not_cells() {
        for text in [
            "1m",
            "1m=",
            "1m=1",
            "1m=1:0",
            "1m=1:01",
            "1m=1:+1",
            "1m=1:-0",
            "1m=1:9223372036854775808",
            "60s=1:1",
            "1m=1:1,1:1",
            "1m=1:1,2:1",
            "1h=1:1;1m=1:1",
            "1m=1:1;1m=2:1",
            "1m=1:1;",
            "5",
            "1h=9223372036854775807:1",
        ] {
            assert_eq!(Cells::parse(text), None, "{text}");
        }
        assert!(Cells::parse("1m=2:1,1:-1;1h=-1:9223372036854775807").is_some());
    }
}
