//! `tally audit`: recount the log and compare with what the store holds.
//!
//! The audit reads tally's topic with a consumer of its own (it joins no group and commits
//! nothing), recomputes every counter's total by the namespaces' rules ([`Recount`]), reads the
//! totals through [`Reader::get_many`] in bounded chunks, and reports the drift.
//!
//! **Against a live pipeline.** Each partition is recounted up to its *durable* offset `D`: the
//! exactly-once watermark (everything before it is applied in every shard group), or, without
//! one, the group's committed offset. Counts are read after that. Then the log's end `E` is
//! read, and every counter with an event in `[D, E)` is left out as *moving*: its stored total
//! may include some of those events. Every other counter's events all lie before `D`, so its
//! stored total must equal the recount exactly. A quiet pipeline leaves nothing out.
//!
//! Also left out, and counted in the report: counters of namespaces written directly to the store
//! (`write_path = "direct"`: their events never pass through the log), and, in namespaces that
//! count one per actor, counters where one actor's likes and unlikes came through several
//! partitions (their order, and so the outcome, is not defined by the log).
//!
//! Totals are recounted from the first offset: if retention has deleted the start of a
//! partition, the audit refuses, since the deleted events are in the totals.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Message};
use tally_aggregator::consume::idempotency::{self, RecentIds};
use tally_aggregator::tasks::expiry;
use tally_common::codec::Record;
use tally_common::namespace::WritePath;
use tally_common::window::format_duration;
use tally_common::{Namespaces, Reader, codec};
use tally_ops::topic::{
    PartitionLog, offsets_at_time, partition_logs, range_reader_config, read_ranges,
};

/// Longest one Kafka metadata or offset request may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest the log may go without delivering anything the audit still waits for.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Counters read from the store per round trip.
const READ_CHUNK: usize = 2_000;

/// Buckets that expire sooner than this are not compared: Redis may drop them mid-audit.
pub const EXPIRY_MARGIN_MS: i64 = 60_000;

/// What to audit.
#[derive(Debug, Clone)]
pub struct AuditSpec {
    /// Kafka client settings: the brokers and any security options.
    pub kafka: ClientConfig,
    /// tally's topic.
    pub topic: String,
    /// The aggregators' consumer group (for its committed offsets, when there is no watermark).
    pub group: String,
    /// Messages larger than this are dead letters (the aggregator's `max_message_bytes`).
    pub max_message_bytes: usize,
    /// Audit only the log from this time on (ms since the epoch): the window buckets whose
    /// events all lie in it, no totals. `None`: the whole log, totals and buckets.
    pub since_ms: Option<i64>,
}

/// Why an audit could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    /// Kafka failed or does not have the topic.
    #[error("kafka: {0}")]
    Kafka(String),
    /// The log no longer holds every event counted.
    #[error(
        "partition {partition} of {topic} starts at offset {start}: retention deleted the events before it, which the totals include, so they cannot be recounted"
    )]
    Truncated {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// Its first offset.
        start: i64,
    },
    /// Reading the store failed.
    #[error("store: {0}")]
    Store(#[from] tally_common::ReadError),
}

impl From<KafkaError> for AuditError {
    fn from(e: KafkaError) -> Self {
        AuditError::Kafka(e.to_string())
    }
}

/// The recount of a log, event by event, by the namespaces' rules: the same decoding, the same
/// dead letters and the same one-per-actor rule as the aggregator.
#[derive(Debug)]
pub struct Recount<'a> {
    namespaces: &'a Namespaces,
    max_message_bytes: usize,
    /// Sums of deltas, in namespaces that do not deduplicate.
    totals: HashMap<String, i64>,
    /// The last like (`true`) or unlike of each (counter, actor), and the partition it came
    /// from, in namespaces that count one per actor.
    members: HashMap<(String, String), (bool, i32)>,
    /// Counters whose outcome the log does not define.
    ambiguous: HashSet<String>,
    /// Counters of namespaces written directly to the store.
    direct: HashSet<String>,
    /// Windowed namespaces' buckets: `(counter, width, start)` → (sum, expiry).
    buckets: HashMap<(String, i64, i64), (i64, i64)>,
    /// Each partition's recent idempotency keys, decided as the aggregator decides them.
    ids: HashMap<i32, RecentIds>,
    /// The widest idempotency window, if a namespace keeps one.
    widest_window_ms: Option<i64>,
    /// Per partition, the first offset counted: those before only feed the recent ids.
    count_from: HashMap<i32, i64>,
    /// Per (partition, counter) in namespaces that expire counters: the latest idle deadline
    /// since its last expiry, as the partition's idle index holds it.
    idle: HashMap<(i32, String), i64>,
    /// Per counter in namespaces that expire counters: the partition its events came through,
    /// `None` if several (then an expiry in one is not ordered with the others' events).
    came_through: HashMap<String, Option<i32>>,
    /// Counters an expiry record cleared at least once.
    cleared: HashSet<String>,
    /// Counters cleared by expiry records.
    pub expired: u64,
    /// Events recounted.
    pub events: u64,
    /// Events not counted because they repeat an idempotency key within its window.
    pub repeats: u64,
    /// Messages the aggregator dead-letters (malformed, or a like without an actor).
    pub dead_letters: u64,
}

impl<'a> Recount<'a> {
    /// An empty recount.
    pub fn new(namespaces: &'a Namespaces, max_message_bytes: usize) -> Self {
        Self {
            namespaces,
            max_message_bytes,
            totals: HashMap::new(),
            members: HashMap::new(),
            ambiguous: HashSet::new(),
            direct: HashSet::new(),
            buckets: HashMap::new(),
            ids: HashMap::new(),
            widest_window_ms: namespaces.widest_idempotency_window_ms(),
            count_from: HashMap::new(),
            idle: HashMap::new(),
            came_through: HashMap::new(),
            cleared: HashSet::new(),
            expired: 0,
            events: 0,
            repeats: 0,
            dead_letters: 0,
        }
    }

    /// Counts `partition`'s events from `offset` on; those before only feed its recent ids.
    pub fn count_from(&mut self, partition: i32, offset: i64) {
        self.count_from.insert(partition, offset);
    }

    /// Counts the message at `offset` of `partition`, in log order; `kafka_ms` is its Kafka
    /// timestamp (what windows and idempotency windows go by).
    pub fn add(&mut self, partition: i32, offset: i64, payload: &[u8], kafka_ms: Option<i64>) {
        let counted = offset >= self.count_from.get(&partition).copied().unwrap_or(0);
        let event = match codec::decode_record(payload, self.max_message_bytes) {
            Ok(Record::Event(event)) => event,
            Ok(Record::Expiry(expiry)) => {
                if counted {
                    self.expire(partition, &expiry.counter, expiry.deadline_ms);
                }
                return;
            }
            Err(_) => {
                self.dead_letters += u64::from(counted);
                return;
            }
        };
        if let Some(widest) = self.widest_window_ms {
            let ids = (self.ids.entry(partition)).or_insert_with(|| RecentIds::new(widest));
            let kafka = kafka_ms.unwrap_or(0);
            if idempotency::decide(ids, self.namespaces, &event, offset, kafka) == Some(true) {
                self.repeats += u64::from(counted);
                return;
            }
        }
        if !counted {
            return;
        }
        if event.reset {
            // Everything before it in the log is cleared; its windows are not.
            self.events += 1;
            self.members.retain(|(c, _), _| c != event.counter.as_ref());
            self.totals.insert(event.counter.into_owned(), 0);
            return;
        }
        let policy = self.namespaces.policy(&event.counter);
        if policy.write_path == WritePath::Direct {
            self.direct.insert(event.counter.into_owned());
            self.events += 1;
            return;
        }
        if !policy.dedup {
            if let Some(after) = policy.expire_after_ms {
                self.touch(partition, &event.counter, kafka_ms, after);
            }
            for bucket in policy.windows.place(event.ts_ms, kafka_ms).buckets() {
                let key = (event.counter.to_string(), bucket.width_ms, bucket.start_ms);
                self.buckets
                    .entry(key)
                    .or_insert((0, bucket.expire_at_ms))
                    .0 += event.delta;
            }
            *self.totals.entry(event.counter.into_owned()).or_default() += event.delta;
            self.events += 1;
            return;
        }
        let Some(actor) = event.actor else {
            self.dead_letters += 1;
            return;
        };
        self.events += 1;
        if let Some(after) = policy.expire_after_ms {
            self.touch(partition, &event.counter, kafka_ms, after);
        }
        let like = event.delta > 0;
        let counter = event.counter.into_owned();
        match self.members.entry((counter, actor.into_owned())) {
            std::collections::hash_map::Entry::Occupied(mut seen) => {
                let (was, from) = *seen.get();
                if from != partition && was != like {
                    self.ambiguous.insert(seen.key().0.clone());
                }
                seen.insert((like, partition));
            }
            std::collections::hash_map::Entry::Vacant(new) => {
                new.insert((like, partition));
            }
        }
    }

    /// An event of `counter` in a namespace that expires counters after `after` ms: moves its
    /// idle deadline, as the flush moves the partition's idle index.
    fn touch(&mut self, partition: i32, counter: &str, kafka_ms: Option<i64>, after: i64) {
        let deadline = kafka_ms.unwrap_or(0).saturating_add(after);
        let latest = (self.idle)
            .entry((partition, counter.to_owned()))
            .or_insert(deadline);
        *latest = (*latest).max(deadline);
        let through = (self.came_through)
            .entry(counter.to_owned())
            .or_insert(Some(partition));
        if *through != Some(partition) {
            *through = None;
        }
    }

    /// An expiry record of `counter` in `partition`: decided as the aggregator decides it
    /// (`tally_aggregator::tasks::expiry::expires`), from the partition's events since the counter's
    /// last expiry.
    fn expire(&mut self, partition: i32, counter: &str, deadline_ms: i64) {
        let key = (partition, counter.to_owned());
        let last = self.idle.get(&key).copied();
        if expiry::expires(last, None, deadline_ms) {
            self.idle.remove(&key);
            self.expired += 1;
            self.cleared.insert(key.1.clone());
            self.members.retain(|(c, _), _| *c != key.1);
            self.totals.insert(key.1, 0);
        }
    }

    /// What the recount found.
    pub fn finish(mut self) -> Recounted {
        for (counter, through) in self.came_through {
            if through.is_none() && self.cleared.contains(&counter) {
                self.ambiguous.insert(counter);
            }
        }
        let mut totals = self.totals;
        for ((counter, _), (like, _)) in self.members {
            *totals.entry(counter).or_default() += i64::from(like);
        }
        for counter in self.ambiguous.iter().chain(&self.direct) {
            totals.remove(counter);
        }
        Recounted {
            totals,
            buckets: self.buckets,
            direct: self.direct,
            ambiguous: self.ambiguous,
        }
    }
}

/// What a [`Recount`] found.
#[derive(Debug)]
pub struct Recounted {
    /// Each counter's total.
    pub totals: HashMap<String, i64>,
    /// Each bucket of a windowed namespace: `(counter, width, start)` → (sum, expiry).
    pub buckets: HashMap<(String, i64, i64), (i64, i64)>,
    /// Counters left out: written directly.
    pub direct: HashSet<String>,
    /// Counters left out: one actor's likes came through several partitions.
    pub ambiguous: HashSet<String>,
}

/// One counter (or bucket) the store and the log disagree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    /// The counter, or for a bucket `<counter>@<width>:<start ms>` (`views:v:1@1h:1764547200000`).
    pub counter: String,
    /// What the store holds.
    pub stored: i64,
    /// What the log says it should hold.
    pub recounted: i64,
}

/// What an audit found.
#[derive(Debug, Clone)]
pub struct Report {
    /// Partitions read.
    pub partitions: usize,
    /// Events recounted (up to the durable offsets).
    pub events: u64,
    /// Events not counted because they repeat an idempotency key within its window.
    pub repeats: u64,
    /// Counters cleared by expiry records.
    pub expired: u64,
    /// Messages the aggregator dead-letters, not counted.
    pub dead_letters: u64,
    /// Counters compared.
    pub checked: usize,
    /// Window buckets compared.
    pub buckets_checked: usize,
    /// Window buckets left out because they expire within [`EXPIRY_MARGIN_MS`] (or have).
    pub buckets_expiring: usize,
    /// Counters that differ, largest difference first.
    pub drift: Vec<Drift>,
    /// Counters left out because events after the durable offsets touch them.
    pub moving: usize,
    /// Counters left out because their namespace is written directly.
    pub direct: usize,
    /// Counters left out because one actor's likes came through several partitions.
    pub ambiguous: usize,
    /// How long it took.
    pub elapsed: Duration,
}

/// Recounts `spec`'s topic up to the durable offsets and compares every counter with `reader`.
pub async fn audit(
    spec: &AuditSpec,
    namespaces: &Namespaces,
    reader: &Reader,
) -> Result<Report, AuditError> {
    let started = Instant::now();
    let consumer = consumer(spec)?;
    let logs = tokio::task::block_in_place(|| read_logs(&consumer, spec))?;
    let durable = reader
        .durable_offsets(&spec.topic, logs.len() as i32)
        .await?;
    let starts = match spec.since_ms {
        Some(since) => {
            tokio::task::block_in_place(|| starts_at(&consumer, spec, since, logs.len()))?
        }
        None => logs.iter().map(|log| log.start).collect(),
    };
    let mut ranges = Vec::with_capacity(logs.len());
    for (partition, ((log, watermark), start)) in logs.iter().zip(durable).zip(starts).enumerate() {
        let partition = partition as i32;
        let durable = watermark.or(log.committed).unwrap_or(log.start);
        if (log.start > 0 && spec.since_ms.is_none()) || start < log.start {
            return Err(AuditError::Truncated {
                topic: spec.topic.clone(),
                partition,
                start: log.start,
            });
        }
        ranges.push((partition, start, durable.max(start)));
    }

    let mut recount = Recount::new(namespaces, spec.max_message_bytes);
    // From a time, with idempotency keys: read the widest window (and the skew) before it too,
    // so that a repeat of an event just before the time is known as one.
    if let (Some(since), Some(widest)) = (spec.since_ms, namespaces.widest_idempotency_window_ms())
    {
        let earlier = since - widest - idempotency::CLOCK_SKEW_MS;
        let warm = tokio::task::block_in_place(|| starts_at(&consumer, spec, earlier, logs.len()))?;
        for (range, warm) in ranges.iter_mut().zip(warm) {
            recount.count_from(range.0, range.1);
            range.1 = warm.max(logs[range.0 as usize].start).min(range.1);
        }
    }
    tokio::task::block_in_place(|| {
        read_range(
            &consumer,
            &spec.topic,
            &ranges,
            |p, offset, payload, kafka_ms| recount.add(p, offset, payload, kafka_ms),
        )
    })?;
    let (events, dead_letters, repeats) = (recount.events, recount.dead_letters, recount.repeats);
    let expired = recount.expired;
    let Recounted {
        totals: recounted,
        buckets,
        direct,
        ambiguous,
    } = recount.finish();

    // From a time, totals include events before it: only buckets are compared.
    let counters: Vec<&String> = match spec.since_ms {
        Some(_) => Vec::new(),
        None => recounted.keys().collect(),
    };
    let mut stored = Vec::with_capacity(counters.len());
    for chunk in counters.chunks(READ_CHUNK) {
        stored.extend(reader.get_many(chunk).await?);
    }
    let horizon = tally_common::event::now_ms() + EXPIRY_MARGIN_MS;
    // From a time `T`, a bucket is whole in the range read when every event that can count in
    // it was produced at `T` or later: its start minus the grace (see `tally_common::window`).
    // The range starts at each partition's first offset stamped `T` or later, so every offset
    // before it was stamped earlier and counts in no such bucket.
    let first_whole = spec.since_ms.map(|since| since + max_grace(namespaces));
    let cells: Vec<(&str, i64, i64)> = (buckets.iter())
        .filter(|(_, (_, expire_at))| *expire_at > horizon)
        .filter(|((_, _, start), _)| first_whole.is_none_or(|first| *start >= first))
        .map(|((c, width, start), _)| (c.as_str(), *width, *start))
        .collect();
    let buckets_expiring = (buckets.values())
        .filter(|(_, expire_at)| *expire_at <= horizon)
        .count();
    let mut stored_cells = Vec::with_capacity(cells.len());
    for chunk in cells.chunks(READ_CHUNK) {
        stored_cells.extend(reader.bucket_values(chunk).await?);
    }

    // Whatever the store held when it was read came from offsets before the log's end now.
    let ends = tokio::task::block_in_place(|| read_logs(&consumer, spec))?;
    let after: Vec<(i32, i64, i64)> = ranges
        .iter()
        .zip(&ends)
        .map(|(&(p, _, durable), log)| (p, durable, log.end))
        .collect();
    let mut moving = HashSet::new();
    tokio::task::block_in_place(|| {
        read_range(&consumer, &spec.topic, &after, |_, _, payload, _| {
            if let Ok(record) = codec::decode_record(payload, spec.max_message_bytes)
                && !moving.contains(record.counter())
            {
                moving.insert(record.counter().to_owned());
            }
        })
    })?;

    let mut checked = 0;
    let mut drift = Vec::new();
    for (counter, stored) in counters.into_iter().zip(stored) {
        if moving.contains(counter) {
            continue;
        }
        checked += 1;
        let recounted = recounted[counter];
        if stored != recounted {
            drift.push(Drift {
                counter: counter.clone(),
                stored,
                recounted,
            });
        }
    }
    let mut buckets_checked = 0;
    for ((counter, width, start), stored) in cells.into_iter().zip(stored_cells) {
        if moving.contains(counter) {
            continue;
        }
        buckets_checked += 1;
        let recounted = buckets[&(counter.to_owned(), width, start)].0;
        if stored != recounted {
            drift.push(Drift {
                counter: format!("{counter}@{}:{start}", format_duration(width)),
                stored,
                recounted,
            });
        }
    }
    drift.sort_by(|a, b| {
        let size = |d: &Drift| d.stored.abs_diff(d.recounted);
        size(b)
            .cmp(&size(a))
            .then_with(|| a.counter.cmp(&b.counter))
    });
    let moving = moving.iter().filter(|c| recounted.contains_key(*c)).count();
    Ok(Report {
        partitions: logs.len(),
        events,
        repeats,
        expired,
        dead_letters,
        checked,
        buckets_checked,
        buckets_expiring,
        drift,
        moving,
        direct: direct.len(),
        ambiguous: ambiguous.len(),
        elapsed: started.elapsed(),
    })
}

/// The largest grace of any namespace's windows.
fn max_grace(namespaces: &Namespaces) -> i64 {
    (namespaces.listed().map(|(_, p)| p))
        .chain([namespaces.defaults()])
        .filter(|p| !p.windows.is_empty())
        .map(|p| p.windows.grace_ms())
        .max()
        .unwrap_or(0)
}

/// Each partition's first offset whose Kafka timestamp is `since_ms` or later (its log end if
/// none is).
fn starts_at(
    consumer: &BaseConsumer,
    spec: &AuditSpec,
    since_ms: i64,
    partitions: usize,
) -> Result<Vec<i64>, AuditError> {
    let all: Vec<i32> = (0..partitions as i32).collect();
    let found = offsets_at_time(consumer, &spec.topic, &all, since_ms, KAFKA_TIMEOUT)?;
    (all.iter().zip(found))
        .map(|(&p, offset)| match offset {
            Some(o) => Ok(o),
            None => Ok(consumer.fetch_watermarks(&spec.topic, p, KAFKA_TIMEOUT)?.1),
        })
        .collect()
}

fn consumer(spec: &AuditSpec) -> Result<BaseConsumer, AuditError> {
    let mut config = range_reader_config(&spec.kafka);
    config
        .set("group.id", &spec.group)
        .set("isolation.level", "read_committed");
    Ok(config.create()?)
}

/// Each partition's log start and end and the group's committed offset.
fn read_logs(consumer: &BaseConsumer, spec: &AuditSpec) -> Result<Vec<PartitionLog>, AuditError> {
    partition_logs(consumer, &spec.topic, KAFKA_TIMEOUT)
        .map_err(|e| AuditError::Kafka(e.to_string()))
}

/// Reads `[from, to)` of each `(partition, from, to)` and hands each message's partition,
/// offset, payload and Kafka timestamp to `each`, in offset order per partition.
fn read_range(
    consumer: &BaseConsumer,
    topic: &str,
    ranges: &[(i32, i64, i64)],
    mut each: impl FnMut(i32, i64, &[u8], Option<i64>),
) -> Result<(), AuditError> {
    read_ranges(consumer, topic, ranges, STALL_TIMEOUT, |m| {
        let payload = m.payload().unwrap_or_default();
        each(
            m.partition(),
            m.offset(),
            payload,
            m.timestamp().to_millis(),
        );
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_common::CounterEvent;
    use tally_common::codec::{DEFAULT_MAX_MESSAGE_BYTES, encode};

    impl Recount<'_> {
        fn add_at(&mut self, partition: i32, payload: &[u8]) {
            self.add(partition, 0, payload, Some(1_000))
        }
    }

    fn event(counter: &str, delta: i64, actor: Option<&str>) -> Vec<u8> {
        let mut e = CounterEvent::new(counter, delta).expect("valid");
        if let Some(actor) = actor {
            e = e.with_actor(actor).expect("valid");
        }
        encode(&e)
    }

    #[test]
    fn deltas_sum_and_likes_count_once_per_actor() {
        let ns = Namespaces::from_toml(
            "[namespaces.likes]\ndedup = true\n[namespaces.bids]\nwrite_path = \"direct\"\n",
        )
        .expect("valid");
        let mut r = Recount::new(&ns, DEFAULT_MAX_MESSAGE_BYTES);
        r.add_at(0, &event("views:v:1", 3, None));
        r.add_at(1, &event("views:v:1", -1, Some("u1")));
        r.add_at(0, &event("likes:p:1", 1, Some("u1")));
        r.add_at(0, &event("likes:p:1", 1, Some("u1")));
        r.add_at(0, &event("likes:p:1", 1, Some("u2")));
        r.add_at(0, &event("likes:p:1", -1, Some("u2")));
        r.add_at(0, &event("likes:p:1", 1, None));
        r.add_at(0, b"not an event");
        r.add_at(2, &event("bids:lot:1", 5, None));
        // u3's like and unlike of p:2 came through two partitions: the outcome is undefined.
        r.add_at(0, &event("likes:p:2", 1, Some("u3")));
        r.add_at(1, &event("likes:p:2", -1, Some("u3")));
        r.add_at(0, &event("likes:p:3", -1, Some("u3")));
        assert_eq!((r.events, r.dead_letters), (10, 2));
        let Recounted {
            totals,
            direct,
            ambiguous,
            ..
        } = r.finish();
        assert_eq!(
            totals,
            HashMap::from([
                ("views:v:1".to_owned(), 2),
                ("likes:p:1".to_owned(), 1),
                ("likes:p:3".to_owned(), 0),
            ])
        );
        assert_eq!(direct, HashSet::from(["bids:lot:1".to_owned()]));
        assert_eq!(ambiguous, HashSet::from(["likes:p:2".to_owned()]));
    }

    #[test]
    fn repeated_ids_count_once_and_a_warm_up_only_remembers() {
        let ns = Namespaces::from_toml("[namespaces.views]\nidempotency_window = \"10m\"\n")
            .expect("valid");
        let with_id = |id: &str| {
            encode(
                &CounterEvent::new("views:v:1", 3)
                    .and_then(|e| e.with_event_id(id))
                    .expect("valid"),
            )
        };
        let mut r = Recount::new(&ns, DEFAULT_MAX_MESSAGE_BYTES);
        r.count_from(0, 2);
        r.add(0, 0, &with_id("a"), Some(1_000)); // before the range: remembered only
        r.add(0, 1, &with_id("b"), Some(1_000));
        r.add(0, 2, &with_id("a"), Some(2_000)); // a repeat of offset 0
        r.add(0, 3, &with_id("c"), Some(2_000));
        r.add(0, 4, &with_id("c"), Some(3_000));
        r.add(1, 0, &with_id("c"), Some(3_000)); // another partition: another event
        assert_eq!((r.events, r.repeats), (2, 2));
        assert_eq!(
            r.finish().totals,
            HashMap::from([("views:v:1".to_owned(), 6)])
        );
    }

    #[test]
    fn an_expiry_record_clears_a_counter_only_if_its_partition_saw_it_go_idle() {
        let ns = Namespaces::from_toml("[namespaces.c]\nexpire_after = \"10s\"\n").expect("valid");
        let plus = |counter: &str| encode(&CounterEvent::new(counter, 2).expect("valid"));
        let expiry = |counter: &str, at: i64| codec::encode_expiry(counter, at);
        let mut r = Recount::new(&ns, DEFAULT_MAX_MESSAGE_BYTES);
        r.add(0, 0, &plus("c:1"), Some(1_000)); // idle from 11 s
        r.add(0, 1, &plus("c:2"), Some(1_000));
        r.add(0, 2, &plus("c:2"), Some(5_000)); // idle from 15 s
        r.add(1, 0, &plus("c:1"), Some(9_000)); // another partition's index
        r.add(0, 3, &expiry("c:1", 12_000), Some(12_000)); // expires
        r.add(0, 4, &expiry("c:2", 12_000), Some(12_000)); // kept
        r.add(0, 5, &expiry("c:1", 13_000), Some(13_000)); // nothing since: no-op
        r.add(0, 6, &plus("c:1"), Some(14_000)); // counts from zero
        r.add(0, 7, &plus("views:v:1"), Some(14_000));
        r.add(0, 8, &expiry("views:v:1", 99_000), Some(99_000)); // never expires
        r.add(2, 0, &plus("c:3"), Some(1_000));
        r.add(2, 1, &expiry("c:3", 12_000), Some(12_000));
        r.add(2, 2, &plus("c:3"), Some(14_000));
        assert_eq!(r.expired, 2);
        let recounted = r.finish();
        assert_eq!(
            recounted.totals,
            HashMap::from([
                ("c:2".to_owned(), 4),
                ("c:3".to_owned(), 2),
                ("views:v:1".to_owned(), 2),
            ])
        );
        // c:1 came through two partitions and was cleared: the log does not order the two.
        assert_eq!(recounted.ambiguous, HashSet::from(["c:1".to_owned()]));
    }

    #[test]
    fn a_reset_clears_what_came_before_it() {
        let ns = Namespaces::from_toml("[namespaces.likes]\ndedup = true\n").expect("valid");
        let mut r = Recount::new(&ns, DEFAULT_MAX_MESSAGE_BYTES);
        r.add_at(0, &event("views:v:1", 5, None));
        r.add_at(
            0,
            &encode(&CounterEvent::reset("views:v:1").expect("valid")),
        );
        r.add_at(0, &event("views:v:1", 2, None));
        r.add_at(0, &event("likes:p:1", 1, Some("u1")));
        r.add_at(0, &event("likes:p:1", 1, Some("u2")));
        r.add_at(
            0,
            &encode(&CounterEvent::reset("likes:p:1").expect("valid")),
        );
        r.add_at(0, &event("likes:p:1", 1, Some("u1")));
        r.add_at(
            0,
            &encode(&CounterEvent::reset("views:v:2").expect("valid")),
        );
        let totals = r.finish().totals;
        assert_eq!(
            totals,
            HashMap::from([
                ("views:v:1".to_owned(), 2),
                ("likes:p:1".to_owned(), 1),
                ("views:v:2".to_owned(), 0),
            ])
        );
    }

    #[test]
    fn windowed_events_count_in_their_buckets_unless_late() {
        let ns = Namespaces::from_toml(
            "[namespaces.views]\nwindows = [\"1m\", \"1h\"]\nwindow_grace = \"10s\"\n",
        )
        .expect("valid");
        let mut r = Recount::new(&ns, DEFAULT_MAX_MESSAGE_BYTES);
        let at = |ts: i64| {
            encode(
                &CounterEvent::new("views:v:1", 2)
                    .expect("valid")
                    .with_ts_ms(ts),
            )
        };
        let hour = 3_600_000;
        r.add(0, 0, &at(hour + 5_000), Some(hour + 6_000));
        r.add(0, 0, &at(hour + 7_000), Some(hour + 65_000));
        // Produced 2 minutes after its time: late for its minute, on time for its hour.
        r.add(0, 0, &at(hour + 1_000), Some(hour + 121_000));
        let buckets: HashMap<(i64, i64), i64> = (r.finish().buckets.into_iter())
            .map(|((_, w, s), (sum, _))| ((w, s), sum))
            .collect();
        assert_eq!(
            buckets,
            HashMap::from([((60_000, hour), 4), ((hour, hour), 6)])
        );
    }
}
