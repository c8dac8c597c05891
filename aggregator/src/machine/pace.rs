//! When a partition's batch must be flushed: how much it may hold ([`Limits`]), whether the
//! partition reads live or catches up ([`Pace`]), and its flush times ([`FlushClock`]).
//!
//! A live partition's batch is due at its partition's next flush time, at most one flush
//! interval after its oldest message arrived; a partition catching up (the log holds more than
//! it has read) is flushed by size instead, with larger limits, so that each counter is written
//! about once per catch-up rather than once per interval. Either way a batch is full when it
//! holds too many events or too many distinct counters, so memory stays bounded whatever the
//! traffic.

use std::time::{Duration, Instant, SystemTime};

/// How much a batch may hold before it must be flushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// Flush once this many messages are buffered.
    pub max_events: usize,
    /// Flush once this many distinct (group, counter) entries are buffered (a counter's likes
    /// are one entry, and every `memberships_per_entry` memberships one more): bounds how long
    /// one flush script runs.
    pub max_counters: usize,
    /// How many memberships count as one more entry: what costs the store's flush about what a
    /// counter's delta does ([`MEMBERSHIPS_PER_ENTRY`], or the sink's own).
    pub memberships_per_entry: usize,
    /// Flush once one shard group's part holds this many entries (counters with deltas, runs of
    /// likes, resets): a group's write is one write to the store, and where its cost grows
    /// faster than its size (a transaction's `WATCH`, the sink's
    /// [`crate::store::sink::Sink::max_group_entries`]) this bounds it; `usize::MAX` elsewhere.
    pub max_group_entries: usize,
}

/// How many memberships count as one entry toward [`Size::max_counters`], whose point is to
/// bound how long one flush script runs. A counter's likes are one run in the script (an
/// `SADD`, an `SREM`, an `INCRBY`, its type check: ~10 us of Redis whatever the run's
/// length, measured with `INFO commandstats` over the likes workload), and each membership
/// adds ~0.5 us to its run, where a counter's delta costs 6-7 us (a new key): so a counter with
/// likes counts as one entry, and every 8 memberships as one more. Counting each membership
/// as a whole entry cut a catch-up into flushes that wrote each counter's likes several times
/// over, about ten members to a run.
pub const MEMBERSHIPS_PER_ENTRY: usize = 8;

/// How many of a batch's weighted memberships one shard group's write may hold: at most
/// `max_counters * memberships_per_entry / GROUP_MEMBERSHIPS_SHARE` memberships in any one group
/// (a third of `max_counters` through the flush script, 4/3 of it where likes' sets go first). The
/// weight assumes a flush's likes spread over the groups, as the likes of many counters do; the
/// likes of one viral counter all go to its group, one transaction, which the weight alone let
/// grow to 240,000-480,000 members: 120-230 ms of one `SADD` and 180-300 ms of its `EXEC` with
/// the sets first, a 138 ms script through Lua (a catch-up of 1,000,000 likes of one counter by
/// as many actors, Redis's slow log and latency monitor, 2026-12-06). A `SADD` into a set of
/// up to a million members took 1-1.8 us a member there. At this share a catch-up's group write
/// holds at most 20,000 members with the sets first (that catch-up's longest command 21-33 ms in
/// five runs, once 50 ms; 35-55 ms at 16) and 5,000 through the script (15-18 ms). The bench's
/// likes, spread over 100,000 counters, are not slowed (`ab.sh`, 8 rounds against 16: 0.80-1.19
/// x, median 0.99); the one-counter catch-up is, by about 15% (0.66-0.74 against 0.81-0.84 M
/// likes/s): more, shorter transactions.
pub const GROUP_MEMBERSHIPS_SHARE: usize = 24;

/// [`MEMBERSHIPS_PER_ENTRY`] where likes' sets are written by plain `SADD`s and `SREM`s before
/// the flush script (`crate::store::redis_sink`): a membership costs Redis ~0.37 us there and a
/// run ~0.5 us more (`deploy/local/dedup-paths.py`, `INFO commandstats` over the bench's likes:
/// 395,075 `SADD`s of 3.6 M members took 1.28 s), so 16 to 32 memberships cost about a
/// counter's delta. A flush of likes grouped by counter also spreads over every group, each
/// its own transaction, so its transactions are shorter than a flush of deltas at the same
/// weight: the bench's dedup catch-up took 12-13 ms at most per transaction at 16 and 13-22 ms
/// at 32 (a plain catch-up's longest script: 14-24 ms). At 32 against 16, 10 alternated rounds:
/// 0.95-1.13 x the rate (median 1.06), redis-server 0.23-0.28 against 0.29-0.35 CPU-us per
/// like (bigger batches net more repeats and send more members per `SADD`); at 64 the bench's
/// ratio did not rise further (median 0.44 against 0.50 at 32, 7 rounds each).
pub const MEMBERSHIPS_PER_ENTRY_BEFORE_SCRIPT: usize = 32;

/// When a partition's buffer must be flushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A live partition flushes at most this long after the oldest buffered message arrived
    /// (see [`FlushClock`]).
    pub flush_interval: Duration,
    /// A live partition's batch size.
    pub live: Size,
    /// A catching-up partition's batch size.
    pub catch_up: Size,
    /// A catching-up partition flushes at least this often, so that its offsets move and its
    /// counts show during a long catch-up.
    pub catch_up_interval: Duration,
}

impl Limits {
    /// These limits with memberships weighed `per_entry` to an entry, live and catching up
    /// alike (what a sink's flush pays for them, `crate::store::sink::Sink`).
    pub fn with_memberships_per_entry(mut self, per_entry: usize) -> Self {
        self.live.memberships_per_entry = per_entry;
        self.catch_up.memberships_per_entry = per_entry;
        self
    }

    /// These limits with at most `most` entries in one group's write, live and catching up
    /// alike (what a sink's writes can take, `crate::store::sink::Sink`).
    pub fn with_group_entries(mut self, most: usize) -> Self {
        self.live.max_group_entries = most;
        self.catch_up.max_group_entries = most;
        self
    }

    /// The batch size at `pace`.
    pub fn size(&self, pace: Pace) -> &Size {
        match pace {
            Pace::Live => &self.live,
            Pace::CatchingUp => &self.catch_up,
        }
    }

    /// How full a batch may grow while the partition's previous flush is still in flight
    /// before the partition stops fetching until that flush lands. Live: twice the live size
    /// (pausing makes librdkafka drop what it prefetched and fetch it again, tally's fetcher
    /// holds it, and a live flush is short). Catching up: the catch-up size itself, so that no
    /// flush script ever writes more than `catch_up.max_counters` (a 1-event-per-counter
    /// catch-up buffered twice that while each flush landed: scripts of 30,000 keys ran up to
    /// 230 ms).
    pub fn pause_size(&self, pace: Pace) -> Size {
        match pace {
            Pace::Live => Size {
                max_events: 2 * self.live.max_events,
                max_counters: 2 * self.live.max_counters,
                ..self.live
            },
            Pace::CatchingUp => self.catch_up,
        }
    }
}

/// Whether a partition batches by the flush clock or by size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// At the end of its log, or not known to be behind: batches go by the flush clock.
    Live,
    /// Its log holds events it has not read yet: batches go by size, since more events are
    /// waiting anyway and writing each counter once per batch is what a flush costs.
    CatchingUp,
}

/// How far behind the end of its log a partition that receives nothing must be to count as
/// catching up (waiting for its next fetch). Not 1: a transactional topic ends in a commit
/// marker that is never delivered.
pub const CATCH_UP_MIN_LAG: i64 = 1_000;

impl Pace {
    /// The pace of a partition that has read up to `read_to` (the offset after the last message
    /// it handled) of a log that ended at `log_end` at the last statistics report, `reading`
    /// whether messages reached it since the last tick.
    ///
    /// A partition still receiving messages catches up until it has read to the end of its log,
    /// so that a catch-up ends with one flush of everything, not a flush and a straggler; one
    /// that receives nothing catches up only while it is [`CATCH_UP_MIN_LAG`] events behind.
    /// The end of the log is a report up to a second old: a live partition reads past it within
    /// milliseconds of each report, so a stale end never holds it back for long.
    pub fn of(read_to: Option<i64>, log_end: Option<i64>, reading: bool) -> Self {
        match (read_to, log_end) {
            (Some(read_to), Some(end))
                if end - read_to >= CATCH_UP_MIN_LAG || (reading && end > read_to) =>
            {
                Pace::CatchingUp
            }
            _ => Pace::Live,
        }
    }
}

/// When one partition's batches are due: at the points `origin + k × interval`.
///
/// A batch is due at the first of those points after its oldest message arrived, so no message
/// waits longer than one interval. Each partition has its own phase within the interval
/// (partition × the golden ratio, modulo 1, of wall-clock time), so the partitions of every
/// aggregator in the group flush at spread-out moments rather than all at once: flushes started
/// together queue behind each other at Redis, and the last one's events wait for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushClock {
    /// A flush time.
    origin: Instant,
    /// Between flush times.
    interval: Duration,
}

impl FlushClock {
    /// The clock of `partition`; `now` and `wall` are the same moment on the monotonic and the
    /// wall clock.
    pub fn new(interval: Duration, partition: i32, now: Instant, wall: SystemTime) -> Self {
        let interval_ns = interval.as_nanos().max(1);
        let phase = (f64::from(partition) * 0.618_033_988_749_895).fract();
        let phase_ns = (phase * interval_ns as f64) as u128;
        let wall_ns = wall
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // How long ago the last flush time was (wall time minus phase, modulo the interval).
        let since = (wall_ns + interval_ns - phase_ns) % interval_ns;
        let since = Duration::from_nanos(u64::try_from(since).unwrap_or(0));
        Self {
            origin: now.checked_sub(since).unwrap_or(now),
            interval,
        }
    }

    /// How many flush times passed from the origin to `t`.
    fn points_until(&self, t: Instant) -> u128 {
        t.saturating_duration_since(self.origin).as_nanos() / self.interval.as_nanos().max(1)
    }

    /// Whether a flush time passed after `since`, up to `now`.
    pub(crate) fn passed(&self, since: Instant, now: Instant) -> bool {
        self.points_until(now) > self.points_until(since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_flush_at_spread_out_moments() {
        let interval = Duration::from_millis(1000);
        let (now, wall) = (Instant::now(), SystemTime::now());
        let reference = FlushClock::new(interval, 0, now, wall).origin;
        let mut phases: Vec<u128> = (0..8)
            .map(|p| {
                let origin = FlushClock::new(interval, p, now, wall).origin;
                let ms = if origin >= reference {
                    (origin - reference).as_millis()
                } else {
                    1000 - (reference - origin).as_millis() % 1000
                };
                ms % 1000
            })
            .collect();
        phases.sort_unstable();
        phases.push(phases[0] + 1000);
        let closest = phases.windows(2).map(|w| w[1] - w[0]).min();
        assert!(closest >= Some(80), "phases {phases:?}");
    }

    #[test]
    fn every_aggregator_gives_a_partition_the_same_flush_times() {
        let interval = Duration::from_millis(1000);
        let wall = SystemTime::now();
        let now = Instant::now();
        let a = FlushClock::new(interval, 5, now, wall);
        // Another process, 1.3 s later on both clocks.
        let later = FlushClock::new(
            interval,
            5,
            now + Duration::from_millis(1300),
            wall + Duration::from_millis(1300),
        );
        let apart = (later.origin - a.origin).as_nanos() % interval.as_nanos();
        assert!(
            apart < 1_000 || interval.as_nanos() - apart < 1_000,
            "{apart} ns"
        );
    }

    #[test]
    fn a_partition_catches_up_until_it_reads_to_the_end_of_its_log() {
        for reading in [false, true] {
            assert_eq!(
                Pace::of(None, Some(1_000_000), reading),
                Pace::Live,
                "nothing read"
            );
            assert_eq!(
                Pace::of(Some(10), None, reading),
                Pace::Live,
                "end not known yet"
            );
            assert_eq!(Pace::of(Some(10), Some(1_010), reading), Pace::CatchingUp);
            // A stale end of log, already passed.
            assert_eq!(Pace::of(Some(5_000), Some(1_010), reading), Pace::Live);
            assert_eq!(Pace::of(Some(1_010), Some(1_010), reading), Pace::Live);
        }
        // Near the end: still catching up while messages come, live once they stop (the end
        // of a transactional topic is a commit marker that never arrives).
        assert_eq!(Pace::of(Some(1_009), Some(1_010), true), Pace::CatchingUp);
        assert_eq!(Pace::of(Some(1_009), Some(1_010), false), Pace::Live);
    }
}
