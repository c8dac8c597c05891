//! Windowed counts: a namespace may keep, beside each counter's all-time total, its sums per
//! time bucket of one or more widths ("views in the last 24 hours" is the sum of the last 24
//! hour buckets).
//!
//! ```toml
//! [namespaces.views]
//! windows = ["1m", "1h", { width = "1d", retention = "30d" }]
//! window_grace = "1m"
//! ```
//!
//! - **Buckets** are aligned to the Unix epoch (`1d` buckets start at 00:00 UTC). An event counts
//!   in the bucket of its event time: its `ts_ms`, or, when it has none, its Kafka timestamp.
//! - **Retention**: a bucket is kept `retention` after it ends (the string form keeps
//!   [`DEFAULT_RETENTION_BUCKETS`] buckets' worth); a counter's buckets are stored together
//!   ([`cells`]).
//! - **Late and future events**, judged against the event's Kafka timestamp `k` (when it was
//!   produced), never against the aggregator's clock, so that a replay of the same offsets (after
//!   a crash, a rebalance or a Redis rollback) places every event exactly as the first pass did:
//!   - an event is *late* for a window when its bucket ended more than the grace before `k`: it
//!     is not counted in that window (it is in the total, and in wider windows still open);
//!   - an event is *from the future* when its time is more than the grace after `k`: it is
//!     counted in no window.
//!
//!   Both are counted by the aggregator's `tally_window_events_dropped_total{reason}`.

use serde::Deserialize;

pub mod cells;

/// Most windows a namespace may keep.
pub const MAX_WINDOWS: usize = 4;

/// Buckets kept by a window given as a plain width (`"1h"` keeps 48 hours).
pub const DEFAULT_RETENTION_BUCKETS: i64 = 48;

/// The grace of a namespace that sets none.
pub const DEFAULT_GRACE_MS: i64 = 60_000;

/// One bucket width and how long its buckets are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    /// The bucket width, in ms.
    pub width_ms: i64,
    /// How long a bucket is kept after it ends, in ms.
    pub retention_ms: i64,
}

impl Window {
    /// The start of the bucket holding time `t` (ms since the epoch).
    pub fn start_of(&self, t: i64) -> i64 {
        t.div_euclid(self.width_ms) * self.width_ms
    }

    /// When the bucket starting at `start` expires.
    pub fn expire_at(&self, start: i64) -> i64 {
        start
            .saturating_add(self.width_ms)
            .saturating_add(self.retention_ms)
    }

    /// The width as written (`1h`).
    pub fn label(&self) -> String {
        format_duration(self.width_ms)
    }
}

/// A namespace's windows and grace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Windows {
    /// Narrowest first.
    list: Vec<Window>,
    /// How late (after its bucket ended) an event may still be counted in it, in ms.
    grace_ms: i64,
}

/// One bucket an event counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// The window's width, in ms.
    pub width_ms: i64,
    /// Where the bucket starts, in ms since the epoch.
    pub start_ms: i64,
    /// When it expires (its end plus the window's retention), in ms since the epoch.
    pub expire_at_ms: i64,
}

/// Where one event counts: up to [`MAX_WINDOWS`] buckets, and the windows it missed.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    buckets: [Bucket; MAX_WINDOWS],
    len: usize,
    /// Windows the event was too late for.
    pub late: usize,
    /// Whether its time was too far ahead of its Kafka timestamp for any window.
    pub future: bool,
}

impl Default for Placement {
    /// No bucket.
    fn default() -> Self {
        let empty = Bucket {
            width_ms: 0,
            start_ms: 0,
            expire_at_ms: 0,
        };
        Self {
            buckets: [empty; MAX_WINDOWS],
            len: 0,
            late: 0,
            future: false,
        }
    }
}

impl PartialEq for Placement {
    /// The same buckets and misses (whatever the slots past its buckets hold).
    fn eq(&self, other: &Self) -> bool {
        self.buckets() == other.buckets() && (self.late, self.future) == (other.late, other.future)
    }
}

impl Eq for Placement {}

impl Placement {
    /// The buckets it counts in.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets[..self.len]
    }
}

/// [`Windows::place`] remembering its last answer: events read together mostly carry the same
/// times (a catch-up reads thousands a millisecond), and their placement is then the same. It
/// borrows the windows it placed by, so that the same windows are known by their address.
#[derive(Debug, Clone, Default)]
pub struct Placer<'a> {
    /// The windows and times of the last event placed, and its placement.
    last: Option<(&'a Windows, i64, Option<i64>)>,
    placed: Placement,
}

impl<'a> Placer<'a> {
    /// `windows.place(ts_ms, kafka_ms)`.
    pub fn place(&mut self, windows: &'a Windows, ts_ms: i64, kafka_ms: Option<i64>) -> &Placement {
        let hit = matches!(self.last, Some((w, t, k))
            if t == ts_ms && k == kafka_ms && std::ptr::eq(w, windows));
        if !hit {
            self.last = Some((windows, ts_ms, kafka_ms));
            windows.place_into(ts_ms, kafka_ms, &mut self.placed);
        }
        &self.placed
    }
}

/// The most (counter, bucket) pairs one window read may sum (each counter's buckets are one field
/// per shard group, summed over the span). A read of more is refused
/// ([`crate::ReadError::WindowTooLarge`]); no window alone can need more, since it keeps at most
/// [`MAX_WINDOW_BUCKETS`].
pub const MAX_WINDOW_CELLS: i64 = 100_000;

/// The most buckets one window may keep (its retention over its width, plus one): a week of
/// minutes. A counter's buckets are one field its writes rewrite whole (`cells`), so a window of
/// many more fine buckets would make every write of a busy counter copy them all.
pub const MAX_WINDOW_BUCKETS: i64 = 10_081;

/// A window as written in the namespace file: `"1h"`, or `{ width = "1h", retention = "7d" }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum WindowEntry {
    /// A width, kept [`DEFAULT_RETENTION_BUCKETS`] buckets.
    Width(String),
    /// A width and a retention.
    Full {
        /// The width.
        width: String,
        /// The retention.
        retention: String,
    },
}

impl Windows {
    /// Windows from the namespace file's entries and grace; an error says what is wrong.
    pub(crate) fn from_entries(entries: &[WindowEntry], grace_ms: i64) -> Result<Self, String> {
        if entries.len() > MAX_WINDOWS {
            return Err(format!("at most {MAX_WINDOWS} windows"));
        }
        let mut list = entries
            .iter()
            .map(|entry| {
                let (width, retention) = match entry {
                    WindowEntry::Width(width) => {
                        let width = parse_duration(width)?;
                        (width, width.saturating_mul(DEFAULT_RETENTION_BUCKETS))
                    }
                    WindowEntry::Full { width, retention } => {
                        (parse_duration(width)?, parse_duration(retention)?)
                    }
                };
                if width < 1_000 {
                    return Err(format!(
                        "window width {} is under 1s",
                        format_duration(width)
                    ));
                }
                let buckets = retention / width + 1;
                if buckets > MAX_WINDOW_BUCKETS {
                    return Err(format!(
                        "window {}: a retention of {} keeps {buckets} buckets, more than the \
                         {MAX_WINDOW_BUCKETS} a counter's cells hold (each write rewrites them: \
                         widen the window or shorten its retention)",
                        format_duration(width),
                        format_duration(retention)
                    ));
                }
                Ok(Window {
                    width_ms: width,
                    retention_ms: retention,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        list.sort();
        if list.windows(2).any(|w| w[0].width_ms == w[1].width_ms) {
            return Err("two windows of the same width".to_owned());
        }
        Ok(Self { list, grace_ms })
    }

    /// Windows of the given widths and retentions (for tests and tools).
    pub fn new(mut list: Vec<Window>, grace_ms: i64) -> Self {
        list.sort();
        Self { list, grace_ms }
    }

    /// Whether the namespace keeps no window.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The windows, narrowest first.
    pub fn list(&self) -> &[Window] {
        &self.list
    }

    /// The grace, in ms.
    pub fn grace_ms(&self) -> i64 {
        self.grace_ms
    }

    /// The buckets an event counts in, given its `ts_ms` (0: none) and its Kafka timestamp
    /// (`None`: none).
    pub fn place(&self, ts_ms: i64, kafka_ms: Option<i64>) -> Placement {
        let mut placed = Placement::default();
        self.place_into(ts_ms, kafka_ms, &mut placed);
        placed
    }

    /// [`Windows::place`], written into `placed`.
    fn place_into(&self, ts_ms: i64, kafka_ms: Option<i64>, placed: &mut Placement) {
        (placed.len, placed.late, placed.future) = (0, 0, false);
        let kafka_ms = kafka_ms.filter(|k| *k > 0);
        let (t, reference) = match (ts_ms, kafka_ms) {
            (t, Some(k)) if t > 0 => (t, k),
            (_, Some(k)) => (k, k),
            (t, None) if t > 0 => (t, t),
            _ => {
                // No time at all: nothing to place it by.
                placed.future = true;
                return;
            }
        };
        if t > reference.saturating_add(self.grace_ms) {
            placed.future = true;
            return;
        }
        for window in &self.list {
            let start = window.start_of(t);
            if start + window.width_ms + self.grace_ms < reference {
                placed.late += 1;
                continue;
            }
            placed.buckets[placed.len] = Bucket {
                width_ms: window.width_ms,
                start_ms: start,
                expire_at_ms: window.expire_at(start),
            };
            placed.len += 1;
        }
    }

    /// How to read the last `span_ms`: the widest window whose width divides the span and that
    /// keeps enough buckets, and how many of its buckets (the current one and those before it).
    pub fn plan(&self, span_ms: i64) -> Option<(Window, i64)> {
        self.list
            .iter()
            .rev()
            .filter(|w| span_ms > 0 && span_ms % w.width_ms == 0)
            .find(|w| w.retention_ms >= span_ms - w.width_ms)
            .map(|w| (*w, span_ms / w.width_ms))
    }
}

/// Parses `250ms`, `90s`, `5m`, `1h`, `7d`, `2w` into ms.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {text:?} has no unit (ms, s, m, h, d, w)"))?;
    let (digits, unit) = text.split_at(split);
    let n: i64 = digits
        .parse()
        .map_err(|_| format!("duration {text:?} does not start with a number"))?;
    let scale = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 7 * 86_400_000,
        _ => {
            return Err(format!(
                "duration {text:?}: unknown unit {unit:?} (ms, s, m, h, d, w)"
            ));
        }
    };
    n.checked_mul(scale)
        .filter(|ms| *ms > 0)
        .ok_or_else(|| format!("duration {text:?} must be positive and under 292 million years"))
}

/// Writes `ms` in the largest unit that divides it: `1h`, `90s`, `250ms`.
pub fn format_duration(ms: i64) -> String {
    let (n, unit) = duration_parts(ms);
    format!("{n}{unit}")
}

/// `ms` as a number of the largest unit that divides it, and that unit: `(90, "s")`.
pub(crate) fn duration_parts(ms: i64) -> (i64, &'static str) {
    let units = [
        (7 * 86_400_000, "w"),
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ];
    for (scale, unit) in units {
        if ms != 0 && ms % scale == 0 {
            return (ms / scale, unit);
        }
    }
    (ms, "ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    const HOUR: i64 = 60 * MIN;

    fn windows() -> Windows {
        Windows::new(
            vec![
                Window {
                    width_ms: HOUR,
                    retention_ms: 48 * HOUR,
                },
                Window {
                    width_ms: MIN,
                    retention_ms: 2 * HOUR,
                },
            ],
            MIN,
        )
    }

    #[test]
    fn a_window_one_read_could_not_sum_is_refused_when_loaded() {
        let full = |width: &str, retention: &str| WindowEntry::Full {
            width: width.to_owned(),
            retention: retention.to_owned(),
        };
        // A day of 1 s buckets: 86,401 buckets.
        let refused = Windows::from_entries(&[full("1s", "1d")], 0).expect_err("refused");
        assert!(refused.contains("86401 buckets"), "{refused}");
        // A week of minutes (10,081) is within the cap; a year of minutes (524,161) is not.
        assert!(Windows::from_entries(&[full("1m", "7d")], 0).is_ok());
        assert!(Windows::from_entries(&[full("1m", "8d")], 0).is_err());
        assert!(Windows::from_entries(&[full("1m", "52w")], 0).is_err());
        assert!(Windows::from_entries(&[full("1h", "52w")], 0).is_ok());
    }

    #[test]
    fn an_event_counts_in_the_bucket_of_its_time_in_every_window_still_open() {
        let w = windows();
        let t = 1_000 * HOUR + 30 * MIN + 5_000;
        let on_time = w.place(t, Some(t + 2_000));
        let starts: Vec<(i64, i64)> = on_time
            .buckets()
            .iter()
            .map(|b| (b.width_ms, b.start_ms))
            .collect();
        assert_eq!(
            starts,
            [(MIN, 1_000 * HOUR + 30 * MIN), (HOUR, 1_000 * HOUR)]
        );
        assert_eq!(on_time.buckets()[1].expire_at_ms, 1_001 * HOUR + 48 * HOUR);
        // Produced 3 minutes after its time: too late for its minute, not for its hour.
        let late = w.place(t, Some(t + 3 * MIN));
        assert_eq!((late.buckets().len(), late.late), (1, 1));
        assert_eq!(late.buckets()[0].width_ms, HOUR);
        // Two minutes ahead of when it was produced: no window.
        let future = w.place(t + 2 * MIN, Some(t));
        assert!(future.future && future.buckets().is_empty());
        // No ts: the Kafka timestamp is its time.
        assert_eq!(
            w.place(0, Some(t)).buckets()[0].start_ms,
            1_000 * HOUR + 30 * MIN
        );
        // Negative times are bucketed downwards, not towards zero.
        assert_eq!(
            Window {
                width_ms: MIN,
                retention_ms: MIN
            }
            .start_of(-1),
            -MIN
        );
    }

    #[test]
    fn a_span_is_read_from_the_widest_window_that_divides_it() {
        let w = windows();
        assert_eq!(
            w.plan(24 * HOUR).map(|(w, n)| (w.width_ms, n)),
            Some((HOUR, 24))
        );
        assert_eq!(
            w.plan(90 * MIN).map(|(w, n)| (w.width_ms, n)),
            Some((MIN, 90))
        );
        // Widest first: hours, though 3 hours of minutes would not be kept anyway.
        assert_eq!(
            w.plan(3 * HOUR).map(|(w, n)| (w.width_ms, n)),
            Some((HOUR, 3))
        );
        assert_eq!(w.plan(90_000), None);
        assert_eq!(w.plan(72 * HOUR), None);
    }

    #[test]
    fn a_placer_answers_as_the_windows_do() {
        let (hour, minute) = (windows(), Windows::new(vec![windows().list()[0]], 0));
        let mut placer = Placer::default();
        for (w, ts, kafka) in [
            (&hour, 10 * MIN, Some(10 * MIN)),
            (&hour, 10 * MIN, Some(10 * MIN)),
            (&minute, 10 * MIN, Some(10 * MIN)),
            (&hour, 10 * MIN, Some(10 * MIN)),
            (&hour, 10 * MIN, Some(200 * HOUR)),
            (&hour, 3 * HOUR, None),
            (&hour, 0, None),
        ] {
            assert_eq!(
                *placer.place(w, ts, kafka),
                w.place(ts, kafka),
                "{ts} {kafka:?}"
            );
        }
    }

    #[test]
    fn durations_parse_and_print() {
        assert_eq!(parse_duration("24h"), Ok(24 * HOUR));
        assert_eq!(parse_duration("250ms"), Ok(250));
        assert!(parse_duration("24").is_err());
        assert!(parse_duration("1y").is_err());
        assert!(parse_duration("0s").is_err());
        assert_eq!(format_duration(24 * HOUR), "1d");
        assert_eq!(format_duration(90_000), "90s");
    }
}
