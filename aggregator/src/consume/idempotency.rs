//! Idempotency keys: in a namespace with an `idempotency_window`, events carrying the same
//! `event_id` for the same counter count once when they land within the window of the first one
//! counted (by Kafka timestamp), in the same partition.
//!
//! The state is each partition's [`RecentIds`]: the ids seen in its log over the last window,
//! as 64-bit hashes of (counter, id) with the offset and Kafka timestamp of the occurrence that
//! counted. It is never written to Redis. Whether the event at an offset repeats one is a
//! function of the log before it, so the state is rebuilt from the log instead: when the
//! aggregator takes a partition (at start, after a crash, in a rebalance, after a rollback), it
//! first reads the window of log before the offset it resumes from ([`WarmUp`]), deciding those
//! events as they were decided the first time, then decides the rest as it reads them. A
//! replay, a restart or a new owner therefore decides every event the same way, and a duplicate
//! is never counted, exactly once like everything else.
//!
//! Bounds: ids are hashed to 64 bits (two different ids of one counter collide with probability
//! about n / 2^64 for n ids in a window); an event stamped more than [`CLOCK_SKEW_MS`] before the
//! newest event of its partition may find its first occurrence already forgotten.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Message};
use tally_common::{Namespaces, codec};

use tally_ops::topic::{offsets_at_time, read_ranges};

/// How far a partition's Kafka timestamps may run backwards (producers' clocks apart) while
/// duplicates are still recognised: ids are kept this much longer than the widest window.
pub const CLOCK_SKEW_MS: i64 = 60_000;

/// Longest the warm-up waits for the log without receiving anything.
const WARM_UP_STALL: Duration = Duration::from_secs(30);

/// The key of `(counter, event_id)`: a fixed-seed hash, the same in every process.
pub fn id_key(counter: &str, event_id: &str) -> u64 {
    let mut h = foldhash::quality::FixedState::with_seed(0x7a11_1d3e).build_hasher();
    h.write(counter.as_bytes());
    h.write_u8(0xff);
    h.write(event_id.as_bytes());
    h.finish()
}

/// The ids one partition counted over the last window.
#[derive(Debug, Clone)]
pub struct RecentIds {
    /// Key → (offset, Kafka timestamp) of the occurrence that counted.
    first: HashMap<u64, (i64, i64), foldhash::fast::RandomState>,
    /// Keys in the order they were recorded, with their timestamp, for forgetting old ones.
    order: VecDeque<(i64, u64)>,
    /// The newest Kafka timestamp seen.
    newest_ms: i64,
    /// How long an id is kept: the widest window plus [`CLOCK_SKEW_MS`].
    keep_ms: i64,
}

impl RecentIds {
    /// An empty set keeping ids for `widest_window_ms` plus the clock skew allowed.
    pub fn new(widest_window_ms: i64) -> Self {
        Self {
            first: HashMap::default(),
            order: VecDeque::new(),
            newest_ms: i64::MIN,
            keep_ms: widest_window_ms.saturating_add(CLOCK_SKEW_MS),
        }
    }

    /// Ids held.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Whether the event at `offset`, stamped `kafka_ms`, repeats an occurrence of `key` counted
    /// at an earlier offset at most `window_ms` before it; if not, it is the occurrence that
    /// counts and is recorded.
    pub fn is_repeat(&mut self, key: u64, offset: i64, kafka_ms: i64, window_ms: i64) -> bool {
        if let Some(&(at, stamped)) = self.first.get(&key)
            && at < offset
            && stamped >= kafka_ms.saturating_sub(window_ms)
        {
            return true;
        }
        self.first.insert(key, (offset, kafka_ms));
        self.order.push_back((kafka_ms, key));
        self.newest_ms = self.newest_ms.max(kafka_ms);
        self.forget_old();
        false
    }

    /// Forgets ids stamped more than `keep_ms` before the newest.
    fn forget_old(&mut self) {
        let horizon = self.newest_ms.saturating_sub(self.keep_ms);
        while let Some(&(stamped, key)) = self.order.front() {
            if stamped >= horizon {
                break;
            }
            self.order.pop_front();
            if self.first.get(&key).is_some_and(|(_, s)| *s == stamped) {
                self.first.remove(&key);
            }
        }
    }
}

/// Decides one message for idempotency: `Some(true)` if it repeats an id counted within its
/// namespace's window, `Some(false)` if it counts, `None` if its namespace keeps no window or it
/// carries no id.
pub fn decide(
    ids: &mut RecentIds,
    namespaces: &Namespaces,
    event: &codec::EventRef<'_>,
    offset: i64,
    kafka_ms: i64,
) -> Option<bool> {
    let window = namespaces.policy(&event.counter).idempotency_window_ms?;
    let id = event.event_id.as_deref()?;
    Some(ids.is_repeat(id_key(&event.counter, id), offset, kafka_ms, window))
}

/// Rebuilds a partition's [`RecentIds`] from its log: a consumer of its own (no group, no
/// commits) with the aggregator's Kafka settings.
#[derive(Debug, Clone)]
pub struct WarmUp {
    config: ClientConfig,
    topic: String,
    namespaces: std::sync::Arc<Namespaces>,
    widest_window_ms: i64,
    max_message_bytes: usize,
}

/// What a warm-up read.
#[derive(Debug)]
pub struct WarmedUp {
    /// The partition's recent ids, as of the offset it resumes from.
    pub ids: RecentIds,
    /// Messages read.
    pub messages: u64,
    /// How long it took.
    pub elapsed: Duration,
}

impl WarmUp {
    /// A warm-up for `topic`, reading with `base`'s Kafka settings; `None` when no namespace keeps
    /// an idempotency window.
    pub fn new(
        base: &ClientConfig,
        topic: &str,
        namespaces: std::sync::Arc<Namespaces>,
        max_message_bytes: usize,
    ) -> Option<Self> {
        let widest_window_ms = namespaces.widest_idempotency_window_ms()?;
        let mut config = base.clone();
        config
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("fetch.wait.max.ms", "50");
        config.remove("group.instance.id");
        Some(Self {
            config,
            topic: topic.to_owned(),
            namespaces,
            widest_window_ms,
            max_message_bytes,
        })
    }

    /// An empty set for a partition read from its start.
    pub fn empty(&self) -> RecentIds {
        RecentIds::new(self.widest_window_ms)
    }

    /// Reads `partition`'s log from the first offset stamped within the keep horizon of the
    /// message at `resume` (or of now, if there is none yet) up to `resume`, deciding each
    /// message as the consume loop does. Blocking: run it off the async workers.
    pub fn read(&self, partition: i32, resume: i64) -> Result<WarmedUp, KafkaError> {
        let started = Instant::now();
        let mut ids = self.empty();
        let consumer: BaseConsumer = self.config.create()?;
        let (low, high) = consumer.fetch_watermarks(&self.topic, partition, WARM_UP_STALL)?;
        if resume <= low {
            return Ok(WarmedUp {
                ids,
                messages: 0,
                elapsed: started.elapsed(),
            });
        }
        // The time of the first message to decide: the horizon is measured back from it.
        let mut anchor = None;
        if resume < high {
            let first = [(partition, resume, resume + 1)];
            read_ranges(&consumer, &self.topic, &first, WARM_UP_STALL, |m| {
                anchor = m.timestamp().to_millis();
            })?;
        }
        let anchor = anchor.unwrap_or_else(tally_common::event::now_ms);
        let horizon = anchor.saturating_sub(self.widest_window_ms + CLOCK_SKEW_MS);
        let found = offsets_at_time(&consumer, &self.topic, &[partition], horizon, WARM_UP_STALL)?;
        let from = found[0].map_or(resume, |o| o.max(low));
        let mut messages = 0;
        let range = [(partition, from, resume)];
        read_ranges(&consumer, &self.topic, &range, WARM_UP_STALL, |message| {
            messages += 1;
            let payload = message.payload().unwrap_or_default();
            if let Ok(event) = codec::decode(payload, self.max_message_bytes) {
                let kafka_ms = message.timestamp().to_millis().unwrap_or(0);
                decide(
                    &mut ids,
                    &self.namespaces,
                    &event,
                    message.offset(),
                    kafka_ms,
                );
            }
        })?;
        Ok(WarmedUp {
            ids,
            messages,
            elapsed: started.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn a_repeat_within_the_window_of_the_first_counted_is_not_counted() {
        let mut ids = RecentIds::new(10 * MIN);
        let a = id_key("views:v:1", "e1");
        assert!(!ids.is_repeat(a, 0, 0, 10 * MIN), "the first counts");
        assert!(
            ids.is_repeat(a, 5, 3 * MIN, 10 * MIN),
            "a resend 3 minutes later"
        );
        assert!(
            ids.is_repeat(a, 6, 10 * MIN, 10 * MIN),
            "at the window's edge"
        );
        // Past the window of the first counted: it counts again, and becomes the first.
        assert!(!ids.is_repeat(a, 7, 10 * MIN + 1, 10 * MIN));
        assert!(ids.is_repeat(a, 8, 15 * MIN, 10 * MIN));
        // The same id of another counter is another event.
        assert!(!ids.is_repeat(id_key("views:v:2", "e1"), 9, 15 * MIN, 10 * MIN));
        // Reading an offset again (a replay without a warm-up) is not a repeat of itself.
        assert!(!ids.is_repeat(a, 7, 10 * MIN + 1, 10 * MIN));
    }

    #[test]
    fn ids_older_than_the_window_and_the_skew_are_forgotten() {
        let mut ids = RecentIds::new(MIN);
        for i in 0..100 {
            ids.is_repeat(id_key("c", &format!("e{i}")), i, i * 1_000, MIN);
        }
        // Stamped up to 99 s: ids stamped before 99 - 60 - 60 = -21 s... all kept.
        assert_eq!(ids.len(), 100);
        ids.is_repeat(id_key("c", "late"), 100, 300_000, MIN);
        // Horizon 300 - 120 = 180 s: every earlier id forgotten.
        assert_eq!(ids.len(), 1);
    }
}
