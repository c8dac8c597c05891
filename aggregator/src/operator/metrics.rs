//! Every metric the aggregator exports, in one place, with intent-named methods.
//!
//! Names follow `tally_<thing>_<unit>[_total]`. Labels come only from small fixed sets (the
//! dead-letter reason, the partition number); no label ever carries a counter id.

use std::time::Duration;

use tally_common::DeadLetterReason;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The aggregator's metrics, registered in their own registry.
#[derive(Debug)]
pub struct Metrics {
    /// Where every metric below is registered.
    registry: Registry,
    /// Messages read from Kafka (valid and malformed).
    events_consumed: IntCounter,
    /// Malformed messages copied to the dead-letter topic, by reason.
    events_dead_lettered: IntCounterVec,
    /// Events not counted because they repeat an idempotency key counted within its window.
    repeated_ids: IntCounter,
    /// Partitions whose position was outside their log and moved to its start.
    offset_resets: IntCounter,
    /// Fetched batches that did not match their CRC-32C (`check.crcs`).
    corrupt_batches: IntCounter,
    /// Offsets read that a leader change truncated from the log (KIP-320), and of those, the
    /// ones already applied to the store (the ledgers are then moved back).
    truncated_offsets: IntCounter,
    truncated_applied: IntCounter,
    /// Time tally's fetcher waited out brokers' quota throttles.
    fetch_throttled: prometheus::Counter,
    /// `Fetch` requests tally's fetcher sent.
    fetch_requests: IntCounter,
    /// Records fetched and dropped unread (their partition paused or positioned again).
    fetched_records_dropped: IntCounter,
    /// Cells writes sent with remembered values instead of read ones, the ones of those found
    /// stale, and the fields remembered (`crate::store::recall`).
    cells_predicted: IntCounter,
    cells_mispredicted: IntCounter,
    cells_remembered: IntGauge,
    expiry_records: IntCounter,
    expired: IntCounter,
    /// Events left out of a window's bucket, by reason (`late`, `future`).
    window_dropped: IntCounterVec,
    /// Batches made durable.
    flushes: IntCounter,
    /// Messages whose batch was made durable.
    events_flushed: IntCounter,
    /// Redis commands (INCRBY) sent by successful flushes.
    counters_flushed: IntCounter,
    /// Time from a flush's start to durability, retries included.
    flush_duration: Histogram,
    /// Failed Redis attempts.
    redis_errors: IntCounter,
    /// Writes refused by a fence (this instance no longer owned the partition).
    fenced_writes: IntCounter,
    /// Retried group writes that found an earlier attempt had landed.
    repeated_writes: IntCounter,
    /// Messages passed over on resume because their group had already applied them.
    skipped_events: IntCounter,
    /// Times a partition found Redis had lost its writes and was re-fed from Kafka.
    rollbacks: IntCounter,
    /// Messages buffered and not yet durable.
    buffered_events: IntGauge,
    /// Partitions this instance owns.
    assigned_partitions: IntGauge,
    /// Partitions paused because their buffer is full while a flush is in flight.
    paused_partitions: IntGauge,
    /// Partitions batching by size because their log holds more than they have read.
    catching_up_partitions: IntGauge,
    /// Idempotency keys held over the owned partitions' windows.
    idempotency_ids_held: IntGauge,
    /// Bytes of the tables holding them.
    idempotency_bytes: IntGauge,
    /// Consumer lag per partition: the log's end less the next offset read.
    consumer_lag: IntGaugeVec,
    /// Shard counts raised by the shard monitor.
    shard_raises: IntCounter,
    /// 1 while this instance is a member of its consumer group (it got an assignment, possibly
    /// empty, and has not lost it), else 0.
    group_member: IntGauge,
    /// Always 1, labelled with the version and the settings that change what a flush means.
    build_info: IntGaugeVec,
    /// Buffered messages per partition at which its fetching pauses.
    buffer_limit: IntGauge,
    /// The offset up to which each owned partition is durable in Redis.
    durable_offset: IntGaugeVec,
    /// Activity (summed |delta|) of the hottest counters in the last trending window, by rank.
    trending_top: IntGaugeVec,
    /// 1 if Redis answered the last periodic `PING`, else 0.
    redis_up: IntGauge,
}

/// Creates metrics and registers each in the registry as it goes.
struct Register(Registry);

impl Register {
    /// Registers `metric` (a clone: both share the same value) and returns it. Names and label
    /// sets are fixed in [`Metrics::new`], so neither creating nor registering can fail.
    fn add<M: prometheus::core::Collector + Clone + 'static>(
        &self,
        metric: prometheus::Result<M>,
    ) -> M {
        let metric = metric.expect("valid metric");
        (self.0)
            .register(Box::new(metric.clone()))
            .expect("metric names are unique");
        metric
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help))
    }

    fn float_counter(&self, name: &str, help: &str) -> prometheus::Counter {
        self.add(prometheus::Counter::new(name, help))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help))
    }

    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels))
    }

    fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels))
    }

    fn histogram(&self, opts: HistogramOpts) -> Histogram {
        self.add(Histogram::with_opts(opts))
    }
}

/// How many ranks of hot counters [`Metrics::trending`] exports.
pub const TRENDING_RANKS: usize = 5;

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let r = Register(Registry::new());
        let metrics = Self {
            events_consumed: r.counter(
                "tally_events_consumed_total",
                "Messages read from Kafka, valid and malformed.",
            ),
            events_dead_lettered: r.counter_vec(
                "tally_events_dead_lettered_total",
                "Malformed messages copied to the dead-letter topic, by reason.",
                &["reason"],
            ),
            repeated_ids: r.counter(
                "tally_repeated_ids_total",
                "Events not counted because they repeat an event_id counted within their namespace's idempotency window.",
            ),
            offset_resets: r.counter(
                "tally_offset_resets_total",
                "Times a partition's position was no longer in its log (retention deleted it before it was read) and reading moved to the log's start: the events in between were never counted.",
            ),
            corrupt_batches: r.counter(
                "tally_corrupt_batches_total",
                "Fetched record batches that did not match their CRC-32C (check.crcs=true): the partition is not read past them, and they are fetched again every 5 s.",
            ),
            truncated_offsets: r.counter(
                "tally_log_truncated_offsets_total",
                "Offsets read by tally's fetcher that a leader change (an unclean election) then truncated from the log: reading went on where the new leader's log ends.",
            ),
            truncated_applied: r.counter(
                "tally_truncated_applied_offsets_total",
                "Of the truncated offsets, those already applied to the store in exactly-once mode: their counts stay, though the log no longer holds the events; the ledgers are moved back, so the new leader's records at those offsets count (see docs/guarantees.md).",
            ),
            fetch_requests: r.counter(
                "tally_fetch_requests_total",
                "Fetch requests tally's fetcher sent to the brokers (none with --fetch librdkafka).",
            ),
            fetched_records_dropped: r.counter(
                "tally_fetched_records_dropped_total",
                "Records tally's fetcher handed over that were dropped unread, because their partition was paused or positioned again after they were fetched (a fence, a rollback, a truncated log, a rebalance): they are fetched again if still wanted.",
            ),
            cells_predicted: r.counter(
                "tally_cells_predicted_writes_total",
                "Writes of window cells sent with the values the aggregator remembered in place of a read.",
            ),
            cells_mispredicted: r.counter(
                "tally_cells_mispredicted_writes_total",
                "Of the predicted cells writes, those Redis found stale: each read the cells and went again.",
            ),
            cells_remembered: r.gauge(
                "tally_cells_remembered_fields",
                "Window cells fields whose values the aggregator remembers (about 100 bytes each).",
            ),
            fetch_throttled: r.float_counter(
                "tally_fetch_throttled_seconds_total",
                "Time tally's fetcher sent a broker nothing because its quota throttled the last fetch (throttle_time_ms, KIP-219).",
            ),
            expiry_records: r.counter(
                "tally_expiry_records_total",
                "Expiry records this aggregator's expirer wrote into the partitions it owns (one per counter found past its idle deadline).",
            ),
            expired: r.counter(
                "tally_counters_expired_total",
                "Counters cleared by an expiry record, decided idle where it stands in the log (flushes retried after a crash count again).",
            ),
            window_dropped: r.counter_vec(
                "tally_window_events_dropped_total",
                "Events of windowed namespaces counted in their total but left out of a window: late (their bucket closed more than the grace before they were produced, one per window) or future (their time more than the grace after it).",
                &["reason"],
            ),
            flushes: r.counter("tally_flushes_total", "Batches made durable in Redis."),
            events_flushed: r.counter(
                "tally_events_flushed_total",
                "Messages whose batch was made durable.",
            ),
            counters_flushed: r.counter(
                "tally_counter_writes_total",
                "Counter writes made durable: one per distinct (shard group, counter) per flush.",
            ),
            flush_duration: r.histogram(
                HistogramOpts::new(
                    "tally_flush_duration_seconds",
                    "Time from a flush's start until it is durable, retries included.",
                )
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0,
                ]),
            ),
            redis_errors: r.counter("tally_redis_errors_total", "Failed store attempts: Redis, or PostgreSQL with --store postgres."),
            fenced_writes: r.counter(
                "tally_fenced_writes_total",
                "Writes refused by a fence: another aggregator owned the partition by then.",
            ),
            repeated_writes: r.counter(
                "tally_repeated_writes_total",
                "Retried group writes whose earlier attempt had landed (its reply was lost): \
                 recognised by the group's ledger and not applied again.",
            ),
            rollbacks: r.counter(
                "tally_redis_rollbacks_total",
                "Times a partition found that Redis had lost writes it made, and was re-fed from Kafka.",
            ),
            skipped_events: r.counter(
                "tally_skipped_events_total",
                "Messages passed over on resume because their shard group had already applied them.",
            ),
            buffered_events: r.gauge(
                "tally_buffered_events",
                "Messages buffered or being flushed, not yet durable.",
            ),
            assigned_partitions: r.gauge(
                "tally_assigned_partitions",
                "Kafka partitions this instance owns.",
            ),
            paused_partitions: r.gauge(
                "tally_paused_partitions",
                "Partitions paused because their buffer is full while a flush is in flight.",
            ),
            catching_up_partitions: r.gauge(
                "tally_catching_up_partitions",
                "Partitions batching by size, not by the flush clock, because their log holds at least 1,000 events more than they have read.",
            ),
            idempotency_ids_held: r.gauge(
                "tally_idempotency_ids_held",
                "Event ids held to recognise repeats within the idempotency windows, over the partitions this instance owns (forgotten ones included until their table is swept).",
            ),
            idempotency_bytes: r.gauge(
                "tally_idempotency_bytes",
                "Bytes of the tables holding those event ids.",
            ),
            consumer_lag: r.gauge_vec(
                "tally_consumer_lag",
                "Messages between the consumer's position and the partition's end.",
                &["partition"],
            ),
            shard_raises: r.counter(
                "tally_shard_raises_total",
                "Shard counts of directly written counters raised by the shard monitor.",
            ),
            group_member: r.gauge(
                "tally_group_member",
                "1 while this instance holds membership of its consumer group, else 0.",
            ),
            build_info: r.gauge_vec(
                "tally_build_info",
                "Always 1: the version and the delivery settings of this instance.",
                &["version", "delivery", "grouping", "redis_atomicity", "fetch"],
            ),
            buffer_limit: r.gauge(
                "tally_buffer_limit_events",
                "Buffered messages per partition at which fetching that partition pauses.",
            ),
            durable_offset: r.gauge_vec(
                "tally_durable_offset",
                "The offset up to which each owned partition is durable in Redis.",
                &["partition"],
            ),
            trending_top: r.gauge_vec(
                "tally_trending_top_activity",
                "Summed |delta| of the hottest counters in the last trending window, by rank \
                 (1 = hottest); `tally top` names them.",
                &["rank"],
            ),
            redis_up: r.gauge(
                "tally_redis_up",
                "1 if Redis answered the aggregator's last periodic PING, else 0.",
            ),
            registry: r.0,
        };
        // Every reason's series starts at 0, so that the first dead letter of a reason is an
        // increase Prometheus can see (a series born at 1 has no increase).
        for reason in DeadLetterReason::ALL {
            metrics
                .events_dead_lettered
                .with_label_values(&[reason.as_str()]);
        }
        metrics
    }

    /// `n` messages were read from Kafka.
    pub fn consumed(&self, n: u64) {
        self.events_consumed.inc_by(n);
    }

    /// `records` fetched were dropped unread: their partition was paused or positioned again.
    pub fn fetched_records_dropped(&self, records: usize) {
        self.fetched_records_dropped.inc_by(records as u64);
    }

    /// A partition's position was outside its log and moved to its start.
    pub fn offset_reset(&self) {
        self.offset_resets.inc();
    }

    /// A fetched batch did not match its CRC.
    pub fn corrupt_batch(&self) {
        self.corrupt_batches.inc();
    }

    /// A leader change truncated `offsets` offsets read from a partition's log.
    pub fn log_truncated(&self, offsets: i64) {
        self.truncated_offsets.inc_by(offsets.max(0) as u64);
    }

    /// Of a truncation, `offsets` had been applied to the store.
    pub fn truncated_applied(&self, offsets: i64) {
        self.truncated_applied.inc_by(offsets.max(0) as u64);
    }

    /// tally's fetcher has sent `total` fetch requests so far.
    pub fn fetch_requests(&self, total: u64) {
        self.fetch_requests
            .inc_by(total.saturating_sub(self.fetch_requests.get()));
    }

    /// The writer has sent `predicted` cells writes with remembered values so far, `mispredicted`
    /// of them found stale, and remembers `fields` fields.
    pub fn cells_recall(&self, predicted: u64, mispredicted: u64, fields: usize) {
        (self.cells_predicted).inc_by(predicted.saturating_sub(self.cells_predicted.get()));
        (self.cells_mispredicted)
            .inc_by(mispredicted.saturating_sub(self.cells_mispredicted.get()));
        self.cells_remembered.set(fields as i64);
    }

    /// A broker's quota throttled a fetch for `ms` milliseconds.
    pub fn fetch_throttled(&self, ms: u32) {
        self.fetch_throttled.inc_by(f64::from(ms) / 1000.0);
    }

    /// A malformed message is safely in the dead-letter topic.
    pub fn dead_lettered(&self, reason: DeadLetterReason) {
        self.events_dead_lettered
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// An event repeated an idempotency key and was not counted.
    pub fn repeated_id(&self) {
        self.repeated_ids.inc();
    }

    /// The expirer wrote `n` expiry records.
    pub fn expiry_records(&self, n: usize) {
        self.expiry_records.inc_by(n as u64);
    }

    /// A flush cleared `n` expired counters.
    pub fn expired(&self, n: usize) {
        self.expired.inc_by(n as u64);
    }

    /// An event was left out of `late` windows, or of every window when from the `future`.
    pub fn window_dropped(&self, late: usize, future: bool) {
        if late > 0 {
            (self.window_dropped.with_label_values(&["late"])).inc_by(late as u64);
        }
        if future {
            self.window_dropped.with_label_values(&["future"]).inc();
        }
    }

    /// A batch of `events` messages over `counters` counters became durable after `elapsed`.
    pub fn batch_flushed(&self, events: usize, counters: usize, elapsed: Duration) {
        self.flushes.inc();
        self.events_flushed.inc_by(events as u64);
        self.counters_flushed.inc_by(counters as u64);
        self.flush_duration.observe(elapsed.as_secs_f64());
    }

    /// A Redis attempt failed.
    pub fn redis_error(&self) {
        self.redis_errors.inc();
    }

    /// A write was refused by a fence.
    pub fn fenced(&self) {
        self.fenced_writes.inc();
    }

    /// A retried write found its earlier attempt had landed.
    pub fn repeated_write(&self) {
        self.repeated_writes.inc();
    }

    /// Redis was found to have lost a partition's writes.
    pub fn rolled_back(&self) {
        self.rollbacks.inc();
    }

    /// The shard monitor raised a counter's shard count.
    pub fn shard_raised(&self) {
        self.shard_raises.inc();
    }

    /// A message was passed over because its group had already applied it.
    pub fn skipped(&self) {
        self.skipped_events.inc();
    }

    /// The current state of the buffers.
    pub fn buffers(
        &self,
        buffered_events: usize,
        assigned: usize,
        paused: usize,
        catching_up: usize,
    ) {
        self.buffered_events.set(buffered_events as i64);
        self.assigned_partitions.set(assigned as i64);
        self.paused_partitions.set(paused as i64);
        self.catching_up_partitions.set(catching_up as i64);
    }

    /// The event ids held for idempotency, and the bytes of their tables.
    pub fn idempotency_tables(&self, held: usize, bytes: usize) {
        self.idempotency_ids_held.set(held as i64);
        self.idempotency_bytes.set(bytes as i64);
    }

    /// Replaces the per-partition lag with `lags`.
    pub fn consumer_lag(&self, lags: impl IntoIterator<Item = (i32, i64)>) {
        self.consumer_lag.reset();
        for (partition, lag) in lags {
            self.consumer_lag
                .with_label_values(&[&partition.to_string()])
                .set(lag);
        }
    }

    /// Whether this instance holds membership of its consumer group.
    pub fn group_membership(&self, member: bool) {
        self.group_member.set(i64::from(member));
    }

    /// Whether this instance holds membership of its consumer group (what `/readyz` asks).
    pub fn is_group_member(&self) -> bool {
        self.group_member.get() == 1
    }

    /// Records the version and delivery settings, and the per-partition pause threshold.
    pub fn started(&self, settings: [&str; 4], buffer_limit: usize) {
        let [delivery, grouping, atomicity, fetch] = settings;
        self.build_info
            .with_label_values(&[
                env!("CARGO_PKG_VERSION"),
                delivery,
                grouping,
                atomicity,
                fetch,
            ])
            .set(1);
        self.buffer_limit.set(buffer_limit as i64);
    }

    /// `partition` is durable up to `next_offset`.
    pub fn durable(&self, partition: i32, next_offset: i64) {
        self.durable_offset
            .with_label_values(&[&partition.to_string()])
            .set(next_offset);
    }

    /// `partition` is no longer owned here.
    pub fn released(&self, partition: i32) {
        let _ = self
            .durable_offset
            .remove_label_values(&[&partition.to_string()]);
    }

    /// The activity of the hottest counters of the last trending window, hottest first; ranks
    /// with no counter read 0.
    pub fn trending(&self, activity: &[u64]) {
        for rank in 0..TRENDING_RANKS {
            let value = activity.get(rank).copied().unwrap_or(0);
            self.trending_top
                .with_label_values(&[&(rank + 1).to_string()])
                .set(i64::try_from(value).unwrap_or(i64::MAX));
        }
    }

    /// Whether Redis answered the last periodic `PING`.
    pub fn redis_answered(&self, up: bool) {
        self.redis_up.set(i64::from(up));
    }

    /// The metrics in Prometheus's text format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding metric families into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_metric_without_counter_ids() {
        let m = Metrics::new();
        m.consumed(3);
        m.dead_lettered(DeadLetterReason::Undecodable);
        m.batch_flushed(2, 1, Duration::from_millis(3));
        m.consumer_lag([(0, 5)]);
        m.group_membership(true);
        m.started(["exactly-once", "partition", "auto", "direct"], 400_000);
        m.durable(3, 42);
        m.durable(4, 7);
        m.released(4);
        m.trending(&[9, 8, 7, 6, 5, 4]);
        m.trending(&[9, 8]);
        let text = m.render();
        for name in [
            "tally_events_consumed_total 3",
            "tally_events_dead_lettered_total{reason=\"undecodable\"} 1",
            "tally_flushes_total 1",
            "tally_events_flushed_total 2",
            "tally_flush_duration_seconds_count 1",
            "tally_consumer_lag{partition=\"0\"} 5",
            "tally_redis_errors_total 0",
            "tally_events_dead_lettered_total{reason=\"overflow\"} 0",
            "tally_group_member 1",
            "tally_buffer_limit_events 400000",
            "tally_durable_offset{partition=\"3\"} 42",
            "tally_trending_top_activity{rank=\"2\"} 8",
            "tally_trending_top_activity{rank=\"5\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(text.contains("tally_build_info{delivery=\"exactly-once\",fetch=\"direct\""));
        assert!(
            !text.contains("partition=\"4\"} 7"),
            "a released partition stays"
        );
        assert!(!text.contains("rank=\"6\""), "more ranks than exported");
    }
}
