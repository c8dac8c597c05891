//! What the benchmark measured: throughputs, catch-ups, the steady state and reads, as
//! written to `results.json` and read by the report.

use serde::{Deserialize, Serialize};

use crate::probe::ProcStats;

/// A throughput measurement of one process.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Throughput {
    /// What ran.
    pub name: String,
    /// Events handled.
    pub events: u64,
    /// Wall time of the measured part, in seconds.
    pub seconds: f64,
    /// Events per second.
    pub events_per_second: f64,
    /// CPU seconds (user + system) of the process per million events.
    pub cpu_seconds_per_million: f64,
    /// Peak RSS of the process, MiB.
    pub peak_rss_mib: f64,
    /// Distinct counters the events went to (loads only; 0 when not known).
    pub distinct_counters: u64,
}

impl Throughput {
    pub(crate) fn new(name: &str, events: u64, seconds: f64, stats: ProcStats) -> Self {
        Self {
            name: name.to_owned(),
            events,
            seconds,
            events_per_second: events as f64 / seconds.max(1e-9),
            cpu_seconds_per_million: stats.cpu_seconds / (events as f64 / 1e6).max(1e-9),
            peak_rss_mib: stats.peak_rss_mib,
            distinct_counters: 0,
        }
    }
}

/// An aggregator (or naive consumer) working through a preloaded topic.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct CatchUp {
    /// Rate, CPU and memory, timed from the first event consumed to the last one flushed.
    pub run: Throughput,
    /// Wall time from the process's launch to its last flush (joining the group and acquiring
    /// the partitions included), seconds: what an operator waits.
    pub seconds_from_start: f64,
    /// Events per second over that time.
    pub events_per_second_from_launch: f64,
    /// CPU seconds per million events over that time, of the Kafka broker and of redis-server
    /// (the aggregator's own is in `run`).
    pub broker_cpu_seconds_per_million: f64,
    /// The same for redis-server.
    pub redis_cpu_seconds_per_million: f64,
    /// Share of the machine's CPU time left idle over that time: a consumer that waits on its
    /// fetches (rather than on CPU) shows here.
    pub idle_share: f64,
    /// Counters written per event (`tally_counter_writes_total` / events): each distinct
    /// counter needs at least one write, so `distinct_counters / events` is its floor.
    pub counter_writes_per_event: f64,
    /// Redis commands per event, scripts' inner commands included (`INFO commandstats`).
    pub redis_commands_per_event: f64,
    /// Scripts and transactions the process sent per event (`EVALSHA`, `EVAL`, `EXEC` calls; the
    /// few plain commands, such as idle partitions' checks, are not counted).
    pub redis_requests_per_event: f64,
    /// Redis calls per command during the run, most first (`INFO commandstats`).
    pub redis_commands: Vec<(String, u64)>,
    /// Distinct counters in the topic (0 when not known): each needs at least one write, so
    /// `distinct_counters / events` is the floor of counter writes per event.
    pub distinct_counters: u64,
    /// Event ids the aggregator held for idempotency at the end (`tally_idempotency_ids_held`).
    pub idempotency_ids_held: f64,
    /// Bytes of the tables holding them (`tally_idempotency_bytes`).
    pub idempotency_table_bytes: f64,
    /// The key prefix (and group) the aggregator ran under, for reading its keys back.
    pub key_prefix: String,
    /// Flush duration quantiles, ms (histogram bucket bounds).
    pub flush_p50_ms: f64,
    /// The 99th percentile.
    pub flush_p99_ms: f64,
    /// (seconds since start, events flushed per second) samples.
    pub series: Vec<(f64, f64)>,
    /// Flush duration histogram: (upper bound in seconds, flushes).
    pub flush_histogram: Vec<(f64, f64)>,
    /// Scripts that held Redis more than 1 ms (Redis's slow log).
    pub scripts_over_1ms: usize,
    /// Their median, ms.
    pub script_p50_ms: f64,
    /// The longest script or transaction (`EXEC`, by the latency monitor), ms: how long one
    /// flush kept Redis from every other client.
    pub script_max_ms: f64,
}

impl CatchUp {
    /// redis-server's CPU-µs per counter write: Redis's work follows the writes, not the events.
    pub fn redis_cpu_us_per_write(&self) -> f64 {
        self.redis_cpu_seconds_per_million / self.counter_writes_per_event.max(1e-9)
    }
}

/// End-to-end latency under a steady load.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Steady {
    /// Background events per second asked of the producer.
    pub target_rate: f64,
    /// Background events per second it reached.
    pub achieved_rate: f64,
    /// The aggregator's flush interval, ms.
    pub flush_interval_ms: f64,
    /// Probes measured.
    pub probes: usize,
    /// Latency quantiles, ms.
    pub p50_ms: f64,
    /// The 99th percentile.
    pub p99_ms: f64,
    /// The worst.
    pub max_ms: f64,
    /// Every probe's latency, ms.
    pub latencies_ms: Vec<f64>,
}

/// Latency of one kind of read.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReadLatency {
    /// What was read.
    pub name: String,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
}

/// The catch-up into the PostgreSQL store, and what it cost PostgreSQL.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PostgresRun {
    /// The catch-up, as for Redis.
    pub catch_up: CatchUp,
    /// WAL written per event, in bytes.
    pub wal_bytes_per_event: f64,
    /// Transactions committed per event (every database).
    pub commits_per_event: f64,
    /// Statements run per event (`pg_stat_statements`; `None` when it is not loaded).
    pub statements_per_event: Option<f64>,
    /// The PostgreSQL server's CPU seconds per million events.
    pub postgres_cpu_seconds_per_million: f64,
}

/// The catch-up with a number of windows, and what it cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WindowsRun {
    /// Windows the namespace keeps.
    pub windows: usize,
    /// The catch-up.
    pub catch_up: CatchUp,
    /// Redis memory added per distinct counter (`used_memory` after − before), bytes.
    pub memory_bytes_per_counter: f64,
    /// Per round of the scenario, its events/s from launch over the 0-window run's of the same
    /// round (the figures above are of the round with the median 3-window ratio). Empty in
    /// results from before rounds.
    #[serde(default)]
    pub ratios: Vec<f64>,
}

/// Window sums of many counters, read back and timed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WindowRead {
    /// The window's width, as written (`1h`).
    pub width: String,
    /// Its buckets summed per counter (the span read: width × buckets).
    pub buckets: i64,
    /// Counters in each read.
    pub counters: usize,
    /// Fields each read asks of each shard group: one cells field per counter, whatever the
    /// span (runs before the cells layout asked counters × buckets keys).
    pub keys_per_group: usize,
    /// Shard groups, each asked with one `HMGET` per cells hash, all in one pipeline (one round
    /// trip).
    pub groups: u32,
    /// Reads timed.
    pub reads: usize,
    /// Their median, ms.
    pub p50_ms: f64,
    /// Their 99th percentile, ms.
    pub p99_ms: f64,
    /// Whether the sums equal the counters' all-time totals (they should: every event is
    /// minutes old, inside the span read).
    pub matches_totals: bool,
}

/// The catch-up with or without deduplication (one like per actor).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DedupRun {
    /// Whether the namespace deduplicates.
    pub dedup: bool,
    /// The catch-up.
    pub catch_up: CatchUp,
    /// Redis memory added per distinct counter (`used_memory` after − before), bytes.
    pub memory_bytes_per_counter: f64,
    /// The same over the events, bytes.
    pub memory_bytes_per_event: f64,
    /// With dedup on: per round of the scenario, its events/s from launch over the dedup-off
    /// run's of the same round (the figures above are of the round with the median ratio).
    /// Empty with dedup off, and in results from before rounds.
    #[serde(default)]
    pub ratios: Vec<f64>,
}

/// The catch-up with or without a re-grouping (16 to 64 shard groups once its first flush
/// landed, `tally regroup`), with exact reads timed throughout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegroupRun {
    /// Whether the run was re-grouped.
    pub regrouped: bool,
    /// The catch-up.
    pub catch_up: CatchUp,
    /// From `tally regroup`'s start to every partition placing new offsets in 64 groups,
    /// seconds (3 of them are the wait for readers' leases); 0 when not re-grouped.
    pub regroup_seconds: f64,
    /// Exact reads of 100 counters (`get_many`) made during the catch-up, one after another.
    pub reads: usize,
    /// Their latency, milliseconds: median, 99th percentile and worst.
    pub read_p50_ms: f64,
    /// 99th percentile.
    pub read_p99_ms: f64,
    /// Worst.
    pub read_max_ms: f64,
    /// Re-grouped: per round, its events/s from launch over the plain run's of the same round
    /// (the figures above are of the round with the median ratio). Empty otherwise.
    pub ratios: Vec<f64>,
}

/// Redis memory per membership (an actor in a counter's member set).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MembershipMemory {
    /// Whether the actor ids were integers (`123456`) rather than strings (`u123456`).
    pub integer_ids: bool,
    /// Members per set.
    pub members_per_set: u64,
    /// `used_memory` added per membership, the sets' keys included, bytes.
    pub bytes_per_membership: f64,
    /// Whether Redis kept the sets as intsets (integers, at most `set-max-intset-entries`).
    pub intset: bool,
}

/// The catch-up with or without expiring counters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExpiryRun {
    /// The namespace's `expire_after` (`none`, `30d`).
    pub expire_after: String,
    /// The catch-up.
    pub catch_up: CatchUp,
    /// Redis memory added per distinct counter (`used_memory` after − before), bytes.
    pub memory_bytes_per_counter: f64,
}

/// The catch-up of events with ids, with or without an idempotency window.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotencyRun {
    /// The namespace's idempotency window (`none`, `10m`).
    pub window: String,
    /// The catch-up.
    pub catch_up: CatchUp,
    /// With a window: per round, its events/s from launch over the run without's of the same
    /// round (the figures above are of the round with the median ratio). Empty without a
    /// window, and in results from before rounds.
    #[serde(default)]
    pub ratios: Vec<f64>,
}

/// One rebalance under a steady stream (`scenarios::rebalance`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RebalanceEvent {
    /// What happened.
    pub event: String,
    /// Partitions that stayed with their member.
    pub kept: usize,
    /// The longest gap between durable flushes among those, from the event on, seconds.
    pub kept_longest_gap_s: f64,
    /// Partitions that moved (in a restart: the restarted member's own).
    pub moved: usize,
    /// The longest gap among those, seconds.
    pub moved_longest_gap_s: f64,
    /// From the event until every partition was owned again, seconds.
    pub owned_again_s: f64,
    /// From the event until everything sent before it was durable, seconds.
    pub durable_again_s: f64,
}

/// What redis-server spends on writes that create their keys, without tally: the floor of a
/// long tail's counter writes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RedisFloor {
    /// Writes per script (and per pipeline): as many as the catch-up's flush scripts carried.
    pub writes_per_script: f64,
    /// CPU-µs per write of a bare Lua loop of `INCRBY`s over new keys.
    pub script_cpu_us_per_write: f64,
    /// CPU-µs per write of pipelined `INCRBY`s over new keys, no script.
    pub pipelined_cpu_us_per_write: f64,
    /// Redis memory per key the loop created.
    pub bytes_per_key: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Results {
    /// When and where.
    pub machine: String,
    /// What a reader must know about how the file was made (a section measured in another run
    /// and put in, say): printed under the capacity guide's opening.
    pub notes: Vec<String>,
    /// Average encoded event size, bytes (the kcat yardsticks use messages of this size).
    pub payload_bytes: usize,
    /// `kcat` consuming the preloaded topic to /dev/null.
    pub kcat_consume: Option<Throughput>,
    /// `kcat` consuming the JSON topic to /dev/null.
    pub kcat_consume_json: Option<Throughput>,
    /// `kcat -P -K` writing the JSON topic from a file (an independent producer).
    pub kcat_produce_json: Option<Throughput>,
    /// The aggregator (exactly-once) catching up on the JSON topic.
    pub catch_up_json: Option<CatchUp>,
    /// The same through librdkafka's consumer (`--fetch librdkafka`, its fetch backoff at
    /// 10 ms): the stall fixed, tally's own fetch path not yet. The baseline of the CPU target.
    pub catch_up_json_librdkafka: Option<CatchUp>,
    /// `kcat` producing as many same-sized messages.
    pub kcat_produce: Option<Throughput>,
    /// The same with keys: the counter ids of `tally load` (same Zipf), spread over the
    /// partitions by key as routing by counter does; what librdkafka itself makes of keyed traffic.
    pub kcat_produce_keyed: Option<Throughput>,
    /// `redis-benchmark`: pipelined `INCRBY` over random keys, per second.
    pub redis_incrby_per_second: Option<f64>,
    /// `tally load` per routing.
    pub producer: Vec<Throughput>,
    /// The aggregator catching up, per delivery mode.
    pub catch_up: Vec<(String, CatchUp)>,
    /// The naive consumer.
    pub naive: Option<CatchUp>,
    /// Steady state and end-to-end latency.
    pub steady: Option<Steady>,
    /// The same with three windows (`1m`, `1h`, `1d`) on every counter, at 50,000 events/s.
    #[serde(default)]
    pub steady_windows: Option<Steady>,
    /// The same with likes counted once per user (`dedup = true`) at 50,000 events/s.
    #[serde(default)]
    pub steady_likes: Option<Steady>,
    /// 90% of events on one counter.
    pub hot: Option<CatchUp>,
    /// Likes of one counter by as many actors, `dedup = true`.
    #[serde(default)]
    pub hot_likes: Option<CatchUp>,
    /// One event per counter, a million counters (the median round's).
    pub cardinality: Option<CatchUp>,
    /// Redis memory the cardinality catch-up added per counter.
    pub cardinality_bytes_per_counter: Option<f64>,
    /// Redis's own floor for the cardinality run's writes, from the same round.
    pub cardinality_floor: Option<RedisFloor>,
    /// Each cardinality round's redis-server CPU per counter write over its script floor's.
    pub cardinality_floor_ratios: Vec<f64>,
    /// The same catch-up with the counters' shares packed into hashes (`tally pack` before
    /// launch), from the same median round.
    #[serde(default)]
    pub cardinality_packed: Option<CatchUp>,
    /// Redis memory the packed catch-up added per counter.
    #[serde(default)]
    pub cardinality_packed_bytes_per_counter: Option<f64>,
    /// Its packed hashes per group.
    #[serde(default)]
    pub cardinality_packed_buckets: u32,
    /// Reads.
    pub reads: Vec<ReadLatency>,
    /// The catch-up into the PostgreSQL store.
    pub postgres: Option<PostgresRun>,
    /// The catch-up with 0, 1 and 3 windows.
    pub windows: Vec<WindowsRun>,
    /// Window sums of 1,000 counters read back after the 3-window catch-up.
    #[serde(default)]
    pub window_reads: Vec<WindowRead>,
    /// The catch-up without and with expiring counters.
    pub expiry: Vec<ExpiryRun>,
    /// The catch-up without and with deduplication.
    pub dedup: Vec<DedupRun>,
    /// The catch-up of events with ids, without and with an idempotency window.
    pub idempotency: Vec<IdempotencyRun>,
    /// Redis memory per membership of a member set, by set size and actor id shape.
    #[serde(default)]
    pub members: Vec<MembershipMemory>,
    /// Decode + aggregate on one core (criterion), events per second, per format.
    pub micro: Vec<(String, f64)>,
    /// Partitions added to a live topic.
    pub new_partitions: Option<NewPartitions>,
    /// Rebalances under a steady stream.
    pub rebalance: Vec<RebalanceEvent>,
    /// Catch-ups with and without a re-grouping, with reads during them.
    #[serde(default)]
    pub regroup: Vec<RegroupRun>,
}

/// Partitions added to a live topic: how soon their events are counted.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct NewPartitions {
    /// Partitions before and after.
    pub from: i32,
    /// After.
    pub to: i32,
    /// Per new partition: seconds from `CreatePartitions` to its first durable flush.
    pub delays_s: Vec<(i32, f64)>,
    /// The longest of those.
    pub longest_s: f64,
    /// Events sent in all, and whether every total in Redis then matched them exactly.
    pub events: u64,
    /// Whether every counter's total matched what was sent.
    pub exact: bool,
}

impl Results {
    /// The aggregator's catch-up in exactly-once mode, if it ran.
    pub fn exactly_once(&self) -> Option<&CatchUp> {
        self.catch_up
            .iter()
            .find(|(mode, _)| mode == "exactly-once")
            .map(|(_, c)| c)
    }
}

/// The windows scenario's rounds as a sentence: each variant's ratio to the 0-window run of
/// its round, round by round, and their median; `None` for results from before rounds.
pub(crate) fn window_rounds(windows: &[WindowsRun]) -> Option<String> {
    let rounds = windows.first()?.ratios.len();
    if rounds == 0 {
        return None;
    }
    let variants: Vec<String> = (windows.iter().filter(|w| w.windows > 0))
        .map(|w| {
            let each: Vec<String> = w.ratios.iter().map(|r| format!("{r:.2}")).collect();
            let median = crate::probe::quantile(&mut w.ratios.clone(), 0.5);
            format!(
                "{} window(s) {} (median {median:.2})",
                w.windows,
                each.join(", ")
            )
        })
        .collect();
    Some(format!(
        "Over {rounds} rounds, each running the variants in the order opposite to the last, the rate over the same round's 0 windows: {}. The table shows the round with the median 3-window ratio.",
        variants.join("; ")
    ))
}

/// The dedup scenario's rounds in a sentence: each round's ratio (dedup on over off) and
/// their median and spread. `None` before rounds.
pub(crate) fn dedup_rounds(dedup: &[DedupRun]) -> Option<String> {
    let on = dedup.iter().find(|d| d.dedup)?;
    if on.ratios.is_empty() {
        return None;
    }
    let each: Vec<String> = on.ratios.iter().map(|r| format!("{r:.2}")).collect();
    let mut sorted = on.ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let median = crate::probe::quantile(&mut on.ratios.clone(), 0.5);
    Some(format!(
        "Over {} rounds, each running the variants in the order opposite to the last, dedup on over off in the same round: {} (median {median:.2}, from {:.2} to {:.2}). The table shows the round with the median ratio.",
        on.ratios.len(),
        each.join(", "),
        sorted[0],
        sorted[sorted.len() - 1]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(windows: usize, ratios: &[f64]) -> WindowsRun {
        WindowsRun {
            windows,
            catch_up: CatchUp::default(),
            memory_bytes_per_counter: 0.0,
            ratios: ratios.to_vec(),
        }
    }

    #[test]
    fn window_rounds_give_each_ratio_and_the_median() {
        let runs = [
            run(0, &[1.0, 1.0, 1.0]),
            run(1, &[0.9, 0.7, 0.8]),
            run(3, &[0.75, 0.95, 0.72]),
        ];
        let line = window_rounds(&runs).expect("rounds");
        assert!(line.starts_with("Over 3 rounds"), "{line}");
        assert!(
            line.contains("1 window(s) 0.90, 0.70, 0.80 (median 0.80)"),
            "{line}"
        );
        assert!(
            line.contains("3 window(s) 0.75, 0.95, 0.72 (median 0.75)"),
            "{line}"
        );
        // Results from before rounds say nothing of them.
        assert_eq!(window_rounds(&[run(0, &[]), run(3, &[])]), None);
        assert_eq!(window_rounds(&[]), None);
    }

    #[test]
    fn dedup_rounds_give_each_ratio_the_median_and_the_spread() {
        let run = |dedup: bool, ratios: &[f64]| DedupRun {
            dedup,
            catch_up: CatchUp::default(),
            memory_bytes_per_counter: 0.0,
            memory_bytes_per_event: 0.0,
            ratios: ratios.to_vec(),
        };
        let line = dedup_rounds(&[run(false, &[]), run(true, &[0.6, 0.5, 0.7])]).expect("rounds");
        assert!(
            line.contains("0.60, 0.50, 0.70 (median 0.60, from 0.50 to 0.70)"),
            "{line}"
        );
        assert_eq!(dedup_rounds(&[run(false, &[]), run(true, &[])]), None);
    }
}
