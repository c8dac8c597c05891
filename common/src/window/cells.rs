//! How a counter's window buckets are stored: all of them in one hash field, so that a counter
//! with three windows costs one field and one write per flush rather than a key and a write
//! per bucket.
//!
//! Each shard group keeps a deployment's number of hashes, its **stripes** (`Keyspace::cells_key`,
//! [`DEFAULT_STRIPES`] since it is recorded, [`LEGACY_STRIPES`] before); a counter's field is in
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

use super::{duration_parts, parse_duration};

/// Hashes per shard group holding its counters' buckets in a deployment that records none
/// (`crate::layout::record_cells_stripes`): what every deployment kept before the count was
/// recorded.
pub const LEGACY_STRIPES: u64 = 64;

/// Hashes per shard group in a new deployment: with 16 groups and 100,000 counters about 25
/// fields per hash on keyed traffic and 60 on unkeyed (where a counter has a field in each
/// group its partitions write), so that each lookup of a flush's read, check and write scans
/// tens of listpack entries rather than hundreds. Measured against [`LEGACY_STRIPES`], 128 and
/// 512 (`docs/keyspace.md`): more stripes cost the aggregator a command per hash, fewer cost
/// Redis longer scans.
pub const DEFAULT_STRIPES: u64 = 256;

/// The most stripes a deployment may record.
pub const MAX_STRIPES: u64 = 4096;

/// Whether `stripes` is a count a deployment may keep: a power of two from 1 to
/// [`MAX_STRIPES`], so that each stripe of a smaller count is the same stripes of a larger
/// one, mod the smaller.
pub fn valid_stripes(stripes: u64) -> bool {
    stripes.is_power_of_two() && stripes <= MAX_STRIPES
}

/// One bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cell {
    width_ms: i64,
    /// Its start over its width.
    index: i64,
    /// Never 0.
    count: i64,
}

/// A counter's buckets in one shard group: a parsed field value.
///
/// One flat list, ordered as the value is written (narrowest window first, each window's
/// buckets newest first): a field is parsed and rewritten on every write of its counter, so it
/// costs one allocation, not one per window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cells {
    cells: Vec<Cell>,
}

/// A bucket's count would pass 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow;

impl Cells {
    /// The cells a field value holds, or `None` if it is not one: one pass over its bytes.
    pub fn parse(text: &str) -> Option<Self> {
        let mut cells = Vec::new();
        let mut rest = text.as_bytes();
        let mut last_width = 0;
        while !rest.is_empty() {
            let equals = rest.iter().position(|&b| b == b'=')?;
            let label = std::str::from_utf8(&rest[..equals]).ok()?;
            let width_ms = parse_label(label)?;
            if width_ms <= last_width {
                return None;
            }
            last_width = width_ms;
            rest = &rest[equals + 1..];
            let mut last_index = None;
            loop {
                let index = strict_i64_prefix(&mut rest)?;
                rest = rest.strip_prefix(b":")?;
                let count = strict_i64_prefix(&mut rest)?;
                if count == 0 || last_index.is_some_and(|i| i <= index) {
                    return None;
                }
                index.checked_mul(width_ms)?;
                last_index = Some(index);
                cells.push(Cell {
                    width_ms,
                    index,
                    count,
                });
                match rest {
                    [b',', more @ ..] => rest = more,
                    // A `;` must start another window.
                    [b';', more @ ..] if !more.is_empty() => {
                        rest = more;
                        break;
                    }
                    [] => break,
                    _ => return None,
                }
            }
        }
        Some(Self { cells })
    }

    /// Whether no bucket is left.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// Where the bucket `index` of width `width_ms` is, or would be inserted.
    fn find(&self, width_ms: i64, index: i64) -> Result<usize, usize> {
        (self.cells).binary_search_by(|c| c.width_ms.cmp(&width_ms).then(index.cmp(&c.index)))
    }

    /// The buckets of width `width_ms`, as a range of `cells`.
    fn window(&self, width_ms: i64) -> std::ops::Range<usize> {
        let start = self.cells.partition_point(|c| c.width_ms < width_ms);
        let end = start + self.cells[start..].partition_point(|c| c.width_ms == width_ms);
        start..end
    }

    /// Adds `delta` to the bucket of width `width_ms` starting at `start_ms`; a count that
    /// comes to 0 leaves no bucket. Nothing changes on overflow.
    pub fn add(&mut self, width_ms: i64, start_ms: i64, delta: i64) -> Result<(), Overflow> {
        let index = start_ms.div_euclid(width_ms);
        match self.find(width_ms, index) {
            Ok(at) => {
                let sum = self.cells[at].count.checked_add(delta).ok_or(Overflow)?;
                if sum == 0 {
                    self.cells.remove(at);
                } else {
                    self.cells[at].count = sum;
                }
            }
            Err(at) if delta != 0 => self.cells.insert(
                at,
                Cell {
                    width_ms,
                    index,
                    count: delta,
                },
            ),
            Err(_) => {}
        }
        Ok(())
    }

    /// Drops the buckets of width `width_ms` that expired by `now_ms`: those that ended more
    /// than `retention_ms` before it. Returns whether there were any.
    pub fn expire(&mut self, width_ms: i64, retention_ms: i64, now_ms: i64) -> bool {
        let window = self.window(width_ms);
        // Newest first: the expired ones are the window's last.
        let kept = self.cells[window.clone()].partition_point(|c| {
            let end = c.index.saturating_mul(width_ms).saturating_add(width_ms);
            end.saturating_add(retention_ms) > now_ms
        });
        let expired = window.start + kept..window.end;
        let any = !expired.is_empty();
        self.cells.drain(expired);
        any
    }

    /// The count of the bucket of width `width_ms` starting at `start_ms` (0 if none).
    pub fn get(&self, width_ms: i64, start_ms: i64) -> i64 {
        let index = start_ms.div_euclid(width_ms);
        self.find(width_ms, index)
            .map_or(0, |at| self.cells[at].count)
    }

    /// The sum of the buckets of width `width_ms` starting from `first_ms` to `last_ms`
    /// (inclusive), or `None` past 64 bits.
    pub fn sum(&self, width_ms: i64, first_ms: i64, last_ms: i64) -> Option<i64> {
        let (first, last) = (first_ms.div_euclid(width_ms), last_ms.div_euclid(width_ms));
        (self.cells[self.window(width_ms)].iter())
            .filter(|c| (first..=last).contains(&c.index))
            .try_fold(0i64, |acc, c| acc.checked_add(c.count))
    }

    /// The field value, written into one allocation of about its size.
    pub fn to_value(&self) -> String {
        let mut out = String::with_capacity(24 * self.cells.len());
        self.write_value(&mut out);
        out
    }

    /// Appends the field value to `out` (a buffer a writer reuses field after field).
    pub fn write_value(&self, out: &mut String) {
        let mut digits = itoa::Buffer::new();
        let mut width_ms = 0;
        for c in &self.cells {
            if c.width_ms == width_ms {
                out.push(',');
            } else {
                if width_ms != 0 {
                    out.push(';');
                }
                width_ms = c.width_ms;
                let (n, unit) = duration_parts(width_ms);
                out.push_str(digits.format(n));
                out.push_str(unit);
                out.push('=');
            }
            out.push_str(digits.format(c.index));
            out.push(':');
            out.push_str(digits.format(c.count));
        }
    }

    /// Every bucket: `(width_ms, start_ms, count)`, narrowest window first, newest first.
    pub fn buckets(&self) -> impl Iterator<Item = (i64, i64, i64)> + '_ {
        (self.cells.iter()).map(|c| (c.width_ms, c.index * c.width_ms, c.count))
    }
}

impl fmt::Display for Cells {
    /// The field value ([`Cells::parse`] reads it back).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_value())
    }
}

/// A window's width written the one way [`super::format_duration`] writes it (`1m`, not `60s`).
fn parse_label(label: &str) -> Option<i64> {
    let width_ms = parse_duration(label).ok()?;
    let (n, unit) = duration_parts(width_ms);
    let digits = label.strip_suffix(unit)?;
    (digits == itoa::Buffer::new().format(n)).then_some(width_ms)
}

/// A 64-bit integer written the one way Rust writes it (no `+`, no leading zero, no `-0`).
#[cfg(test)]
fn strict_i64(text: &str) -> Option<i64> {
    let mut rest = text.as_bytes();
    strict_i64_prefix(&mut rest).filter(|_| rest.is_empty())
}

/// The integer `rest` starts with, written the one way Rust writes it; `rest` moves past it.
fn strict_i64_prefix(rest: &mut &[u8]) -> Option<i64> {
    let all: &[u8] = rest;
    let (negative, digits) = match all {
        [b'-', digits @ ..] => (true, digits),
        digits => (false, digits),
    };
    let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
    match &digits[..len] {
        [] => return None,
        [b'0', ..] if negative || len > 1 => return None,
        _ => {}
    }
    // Summed as a negative number, which reaches i64::MIN.
    let mut value: i64 = 0;
    for &b in &digits[..len] {
        value = value.checked_mul(10)?.checked_sub(i64::from(b - b'0'))?;
    }
    *rest = &digits[len..];
    if negative {
        Some(value)
    } else {
        value.checked_neg()
    }
}

/// The stripe of `counter`'s field among `stripes`: bits of its hash that the choice of its
/// base group does not use.
pub fn stripe(hash: u64, stripes: u64) -> u64 {
    (hash >> 40) % stripes
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    const HOUR: i64 = 60 * MIN;

    proptest::proptest! {
        /// Integers are read exactly as Rust writes them, and nothing else is.
        #[test]
        fn integers_parse_only_as_rust_writes_them(text in "[-+0-9]{0,21}", value: i64) {
            let reference = text.parse::<i64>().ok().filter(|v| v.to_string() == text);
            proptest::prop_assert_eq!(strict_i64(&text), reference);
            proptest::prop_assert_eq!(strict_i64(&value.to_string()), Some(value));
        }

        /// Any additions and expiries keep what a map of (width, start) to count keeps, and the
        /// value parses back to the same cells.
        #[test]
        fn cells_keep_what_a_map_keeps(
            ops in proptest::collection::vec((0..3usize, -5..5i64, -3..3i64, 0..4u8), 0..60),
        ) {
            let widths = [MIN, HOUR, 24 * HOUR];
            let mut cells = Cells::default();
            let mut model = std::collections::BTreeMap::new();
            for (w, bucket, delta, expire) in ops {
                let width = widths[w];
                if expire == 0 {
                    // Keep buckets that end more than one width after `bucket`'s start.
                    let now = bucket * width + width;
                    let dropped = cells.expire(width, width, now);
                    let before = model.len();
                    model.retain(|&(mw, start): &(i64, i64), _| mw != width || start + 2 * mw > now);
                    proptest::prop_assert_eq!(dropped, model.len() < before);
                    continue;
                }
                cells.add(width, bucket * width, delta).expect("small");
                let count = model.entry((width, bucket * width)).or_insert(0);
                *count += delta;
                if *count == 0 {
                    model.remove(&(width, bucket * width));
                }
            }
            let mut held: Vec<(i64, i64, i64)> = cells.buckets().collect();
            held.sort();
            let expected: Vec<(i64, i64, i64)> =
                model.iter().map(|(&(w, s), &c)| (w, s, c)).collect();
            proptest::prop_assert_eq!(held, expected);
            proptest::prop_assert_eq!(Cells::parse(&cells.to_value()), Some(cells));
        }
    }

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
