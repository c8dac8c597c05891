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
//! events as they were decided the first time, then decides the rest as they are read (with
//! tally's fetcher on a thread of their own, `crate::consume::decide`). A
//! replay, a restart or a new owner therefore decides every event the same way, and a duplicate
//! is never counted, exactly once like everything else.
//!
//! Bounds: ids are hashed to 64 bits (two different ids of one counter collide with probability
//! about n / 2^64 for n ids in a window); an event stamped more than [`CLOCK_SKEW_MS`] before the
//! newest event of its partition may find its first occurrence already forgotten.

use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Message};
use tally_common::{Namespaces, codec};

use tally_ops::topic::{offsets_at_time, range_reader_config, read_ranges};

/// How far a partition's Kafka timestamps may run backwards (producers' clocks apart) while
/// duplicates are still recognised: ids are kept this much longer than the widest window.
pub const CLOCK_SKEW_MS: i64 = 60_000;

/// Ids whose home slots are read together before they are decided (the reads wait on memory
/// at the same time instead of one after the other).
const DECIDED_TOGETHER: usize = 16;

/// A record to decide: its offset, Kafka timestamp, and its id's key and window.
pub(crate) type Pending = (i64, i64, u64, i64);

/// Records a warm-up holds before deciding them.
const PENDING_RUN: usize = 1024;

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

/// Shards of a [`RecentIds`]: each grows (and is swept) on its own, so that growing copies a
/// sixty-fourth of the ids at a time, and the shards, sized apart, do not all grow at once.
const SHARDS: usize = 64;
/// A shard is swept of forgotten ids, and grown if it is still over [`GROW_LOAD`], when an
/// insertion would fill it past this share of its homes (its slots but the [`SLACK`]).
const MAX_LOAD: f64 = 0.85;
/// After a sweep, a shard fuller than this is rebuilt at [`REBUILT_LOAD`].
const GROW_LOAD: f64 = 0.7;
/// The load a rebuilt shard starts at: its slots average about 1.35 per id held over its growth
/// (16 bytes each: about 21.5 bytes per id; 22.5 at 0.6, which grew 1.4-fold, measured 2% faster
/// and 5 MiB larger over the bench's 5,000,000 ids, within the noise of the rate).
const REBUILT_LOAD: f64 = 0.66;
/// Fewest homes in a shard.
const MIN_SLOTS: usize = 16;

/// One id held: its key (0: an empty slot), the offset of the occurrence that counted (1 +
/// its distance from the set's base offset; 0: before the base) and its Kafka timestamp (ms
/// after the set's base time). 16 bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: u64,
    at: u32,
    stamp: u32,
}

/// A shard: open addressing with linear probing, each key's home slot `key * homes / 2^64`, in
/// order: home slots rise with keys, and a run of slots holds its keys in ascending order, so
/// a lookup stops at the first larger key (or an empty slot), a couple of slots past its home
/// on average even when the shard is nearly full, instead of at the run's end. An insertion
/// shifts the larger keys after it one slot on. Runs do not wrap: [`SLACK`] slots past the last
/// home take the last run's overflow, and more are added if it ever outgrows them.
#[derive(Debug, Clone, Default)]
struct Shard {
    slots: Vec<Slot>,
    homes: usize,
    held: usize,
    /// At most the oldest stamp held ([`u32::MAX`] when none is): while it is inside the keep
    /// horizon nothing is forgotten, and a sweep skips its pass over the slots.
    oldest: u32,
}

/// The shard holding `key`.
fn shard_of(key: u64) -> usize {
    (key % SHARDS as u64) as usize
}

/// Slots of a shard past its last home.
const SLACK: usize = 32;

impl Shard {
    fn with_homes(homes: usize) -> Self {
        let homes = homes.max(MIN_SLOTS);
        Self {
            slots: vec![Slot::default(); homes + SLACK],
            homes,
            held: 0,
            oldest: u32::MAX,
        }
    }

    /// The slot `key`'s lookup starts from.
    fn home(&self, key: u64) -> usize {
        ((u128::from(key) * self.homes as u128) >> 64) as usize
    }

    /// Where `key` is, or where it would go (the first slot from its home holding an empty
    /// slot or a larger key), or the number of slots if it would go past the end.
    fn find(&self, key: u64) -> usize {
        let mut i = self.home(key);
        while let Some(slot) = self.slots.get(i) {
            if slot.key == 0 || slot.key >= key {
                return i;
            }
            i += 1;
        }
        i
    }

    /// Puts `slot` at `i` (from [`Shard::find`], its key not there), shifting the run after it
    /// one slot on (into one more slot past the end, if the run reaches it).
    fn insert(&mut self, i: usize, slot: Slot) {
        let free = (i..self.slots.len())
            .find(|&j| self.slots[j].key == 0)
            .unwrap_or_else(|| {
                self.slots.push(Slot::default());
                self.slots.len() - 1
            });
        self.slots.copy_within(i..free, i + 1);
        self.slots[i] = slot;
        self.held += 1;
        self.oldest = self.oldest.min(slot.stamp);
    }

    /// Rebuilt with `homes` homes, keeping only the ids `keep` keeps. The old slots are read
    /// in key order, so each is put at its home or just after the one before.
    fn rebuild(&mut self, homes: usize, keep: impl Fn(&Slot) -> bool) {
        let old = std::mem::replace(self, Self::with_homes(homes));
        let mut next = 0;
        for slot in old.slots.into_iter().filter(|s| s.key != 0 && keep(s)) {
            let i = self.home(slot.key).max(next);
            if i == self.slots.len() {
                // The last run outgrows the slack (rare with hashed keys).
                self.slots.push(slot);
            } else {
                self.slots[i] = slot;
            }
            self.held += 1;
            self.oldest = self.oldest.min(slot.stamp);
            next = i + 1;
        }
    }
}

/// The ids one partition counted over the last window: per id, the 64-bit key of (counter,
/// id) with the offset and Kafka timestamp of the occurrence that counted, in 16 bytes, and
/// about 21.5 bytes of slots per id held with the slots kept free (the bench's idempotency
/// scenario measured 21.5 bytes of table and 22-24 bytes of peak RSS per id in three runs on
/// 2026-12-06). Ids stamped before the keep horizon are forgotten when their shard is swept:
/// when it fills up, and each shard once every quarter of the horizon.
#[derive(Debug, Clone)]
pub struct RecentIds {
    shards: Vec<Shard>,
    /// Offsets are kept relative to this one.
    base_offset: i64,
    /// Timestamps are kept relative to this one, never after the keep horizon.
    base_ms: i64,
    /// The newest Kafka timestamp seen (`i64::MIN`: none yet).
    newest_ms: i64,
    /// How long an id is kept: the widest window plus [`CLOCK_SKEW_MS`].
    keep_ms: i64,
    /// When the newest timestamp passes this, the shards are swept, one per insertion.
    sweep_at_ms: i64,
    /// The next shard to sweep, [`SHARDS`] when none is due.
    sweeping: usize,
}

impl RecentIds {
    /// An empty set keeping ids for `widest_window_ms` plus the clock skew allowed.
    pub fn new(widest_window_ms: i64) -> Self {
        // Shards sized apart, so that they reach their limits (and grow) at different times.
        let shards = (0..SHARDS)
            .map(|i| {
                let spread = (1.0 / REBUILT_LOAD).powf(i as f64 / SHARDS as f64);
                Shard::with_homes((MIN_SLOTS as f64 * spread).ceil() as usize)
            })
            .collect();
        Self {
            shards,
            base_offset: 0,
            base_ms: 0,
            newest_ms: i64::MIN,
            keep_ms: widest_window_ms.saturating_add(CLOCK_SKEW_MS),
            sweep_at_ms: i64::MIN,
            sweeping: SHARDS,
        }
    }

    /// Ids held (forgotten ones included until their shard is swept).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.held).sum()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of slots held.
    pub fn bytes(&self) -> usize {
        let slots: usize = self.shards.iter().map(|s| s.slots.len()).sum();
        slots * std::mem::size_of::<Slot>()
    }

    /// Whether the event at `offset`, stamped `kafka_ms`, repeats an occurrence of `key` counted
    /// at an earlier offset at most `window_ms` before it; if not, it is the occurrence that
    /// counts and is recorded.
    pub fn is_repeat(&mut self, key: u64, offset: i64, kafka_ms: i64, window_ms: i64) -> bool {
        let key = key.max(1);
        if self.newest_ms == i64::MIN {
            self.base_offset = offset;
            self.base_ms = kafka_ms.saturating_sub(self.keep_ms);
            self.sweep_at_ms = kafka_ms.saturating_add(self.keep_ms / 4);
        }
        self.newest_ms = self.newest_ms.max(kafka_ms);
        self.fit(offset);
        let (base_offset, base_ms) = (self.base_offset, self.base_ms);
        let shard = &mut self.shards[shard_of(key)];
        let i = shard.find(key);
        let slot = shard.slots.get(i).copied().unwrap_or_default();
        if slot.key == key {
            let earlier = slot.at == 0 || base_offset + i64::from(slot.at) - 1 < offset;
            let stamped = base_ms + i64::from(slot.stamp);
            if earlier && stamped >= kafka_ms.saturating_sub(window_ms) {
                return true;
            }
        }
        // Stamped before the horizon, it would be forgotten at once.
        if kafka_ms < self.newest_ms.saturating_sub(self.keep_ms) || kafka_ms < base_ms {
            return false;
        }
        let recorded = Slot {
            key,
            at: (offset - base_offset + 1) as u32,
            stamp: (kafka_ms - base_ms) as u32,
        };
        if slot.key == key {
            // A later stamp than the slot's: `oldest` still bounds the shard's.
            shard.slots[i] = recorded;
        } else if (shard.held + 1) as f64 > shard.homes as f64 * MAX_LOAD {
            self.sweep(shard_of(key), true);
            let shard = &mut self.shards[shard_of(key)];
            shard.insert(shard.find(key), recorded);
        } else {
            shard.insert(i, recorded);
        }
        self.sweep_some();
        false
    }

    /// Decides `pending` in order, as [`RecentIds::is_repeat`] one after the other would,
    /// handing `repeat` the offset of each that repeats an id counted. They are decided
    /// [`DECIDED_TOGETHER`] at a time, their home slots read first.
    pub(crate) fn decide_all(&mut self, pending: &[Pending], mut repeat: impl FnMut(i64)) {
        for run in pending.chunks(DECIDED_TOGETHER) {
            self.touch(run.iter().map(|p| p.2));
            for &(offset, kafka_ms, key, window) in run {
                if self.is_repeat(key, offset, kafka_ms, window) {
                    repeat(offset);
                }
            }
        }
    }

    /// Reads the home slot of each of `keys`, so that looking them up next finds them in
    /// cache: a lookup of a large set waits on memory, and these independent reads wait
    /// together (the processor overlaps them) where lookups one after the other wait in turn.
    pub fn touch(&self, keys: impl IntoIterator<Item = u64>) {
        let mut sum = 0u64;
        for key in keys {
            let key = key.max(1);
            let shard = &self.shards[shard_of(key)];
            sum ^= shard.slots[shard.home(key)].key;
        }
        // Used, so that the reads are not optimised away.
        std::hint::black_box(sum);
    }

    /// Moves the bases so that `offset` and the newest timestamp fit in a slot.
    fn fit(&mut self, offset: i64) {
        let ahead = offset - self.base_offset + 1;
        if (1..=i64::from(u32::MAX)).contains(&ahead)
            && self.newest_ms - self.base_ms <= i64::from(u32::MAX)
        {
            return;
        }
        let (old_offset, old_ms) = (self.base_offset, self.base_ms);
        // Half the range behind the offset (all of it ahead, for an offset read again from
        // before the base), the time base at the horizon.
        let new_offset = if ahead < 1 {
            offset
        } else {
            offset - i64::from(u32::MAX / 2)
        };
        let new_ms = (self.newest_ms.saturating_sub(self.keep_ms)).max(old_ms);
        (self.base_offset, self.base_ms) = (new_offset, new_ms);
        for shard in &mut self.shards {
            let homes = shard.homes;
            shard.rebuild(homes, |s| old_ms + i64::from(s.stamp) >= new_ms);
            // Every stamp kept is at or after the new base: each moves down alike.
            if shard.oldest != u32::MAX {
                shard.oldest = (old_ms + i64::from(shard.oldest) - new_ms).max(0) as u32;
            }
            for s in shard.slots.iter_mut().filter(|s| s.key != 0) {
                s.stamp = (old_ms + i64::from(s.stamp) - new_ms) as u32;
                if s.at != 0 {
                    let at = old_offset + i64::from(s.at) - 1 - new_offset + 1;
                    s.at = at.clamp(0, i64::from(u32::MAX)) as u32;
                }
            }
        }
    }

    /// Sweeps shard `index` of the ids stamped before the horizon, and grows it if it is
    /// still full enough (`grow`) or shrinks it if it is mostly empty.
    fn sweep(&mut self, index: usize, grow: bool) {
        let horizon = self.newest_ms.saturating_sub(self.keep_ms);
        let base_ms = self.base_ms;
        let kept = |stamp: u32| base_ms + i64::from(stamp) >= horizon;
        let keep = |s: &Slot| kept(s.stamp);
        let shard = &mut self.shards[index];
        // Nothing stamped before the horizon: every id held is live, no pass needed.
        let live = if kept(shard.oldest) {
            shard.held
        } else {
            shard.slots.iter().filter(|s| s.key != 0 && keep(s)).count()
        };
        let homes = shard.homes;
        let sized = ((live + 1) as f64 / REBUILT_LOAD).ceil() as usize;
        let target = if grow && (live + 1) as f64 > homes as f64 * GROW_LOAD {
            sized
        } else if (live as f64) < homes as f64 * REBUILT_LOAD / 4.0 {
            sized.min(homes)
        } else {
            homes
        };
        if live < shard.held || target != homes {
            shard.rebuild(target, keep);
        }
    }

    /// Every quarter of the keep horizon, sweeps the shards, one per call.
    fn sweep_some(&mut self) {
        if self.sweeping == SHARDS && self.newest_ms >= self.sweep_at_ms {
            self.sweeping = 0;
            self.sweep_at_ms = self.newest_ms.saturating_add(self.keep_ms / 4);
        }
        if self.sweeping < SHARDS {
            self.sweep(self.sweeping, false);
            self.sweeping += 1;
        }
    }
}

/// What an event is decided by for idempotency: the key of its (counter, id) and its
/// namespace's window; `None` if the namespace keeps no window or the event carries no id.
pub fn id_of(namespaces: &Namespaces, event: &codec::EventRef<'_>) -> Option<(u64, i64)> {
    let window = namespaces.policy(&event.counter).idempotency_window_ms?;
    let id = event.event_id.as_deref()?;
    Some((id_key(&event.counter, id), window))
}

/// What a record read from the log is decided by: an event's [`id_of`]; an expiry record
/// has none. The loop and the decider (`crate::consume::decide`) both ask this.
pub fn record_id(namespaces: &Namespaces, record: &codec::Record<'_>) -> Option<(u64, i64)> {
    match record {
        codec::Record::Event(event) => id_of(namespaces, event),
        codec::Record::Expiry(_) => None,
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
    let (key, window) = id_of(namespaces, event)?;
    Some(ids.is_repeat(key, offset, kafka_ms, window))
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
        let mut config = range_reader_config(base);
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
    /// message as the consume loop does; `watermarks`, the log's first offset and the one after
    /// its last, if the caller has just read them. Blocking: run it off the async workers.
    pub fn read(
        &self,
        partition: i32,
        resume: i64,
        watermarks: Option<(i64, i64)>,
    ) -> Result<WarmedUp, KafkaError> {
        let started = Instant::now();
        let consumer: BaseConsumer = self.config.create()?;
        let read = self.read_with(&consumer, partition, resume, watermarks);
        close_apart(consumer);
        let (ids, messages) = read?;
        Ok(WarmedUp {
            ids,
            messages,
            elapsed: started.elapsed(),
        })
    }

    /// [`WarmUp::read`] with `consumer`: the ids and the messages read.
    fn read_with(
        &self,
        consumer: &BaseConsumer,
        partition: i32,
        resume: i64,
        watermarks: Option<(i64, i64)>,
    ) -> Result<(RecentIds, u64), KafkaError> {
        let mut ids = self.empty();
        // The topic's leaders first: a new client's first request to a partition's leader
        // otherwise waited, now and then, about 700 ms for librdkafka to look the leader up.
        consumer.fetch_metadata(Some(&self.topic), WARM_UP_STALL)?;
        let (low, high) = match watermarks {
            Some(known) => known,
            None => consumer.fetch_watermarks(&self.topic, partition, WARM_UP_STALL)?,
        };
        if resume <= low {
            return Ok((ids, 0));
        }
        // The time of the first message to decide: the horizon is measured back from it.
        let mut anchor = None;
        if resume < high {
            let first = [(partition, resume, resume + 1)];
            read_ranges(consumer, &self.topic, &first, WARM_UP_STALL, |m| {
                anchor = m.timestamp().to_millis();
            })?;
        }
        let anchor = anchor.unwrap_or_else(tally_common::event::now_ms);
        let horizon = anchor.saturating_sub(self.widest_window_ms + CLOCK_SKEW_MS);
        let found = offsets_at_time(consumer, &self.topic, &[partition], horizon, WARM_UP_STALL)?;
        let from = found[0].map_or(resume, |o| o.max(low));
        let mut messages = 0;
        let range = [(partition, from, resume)];
        // Decided [`PENDING_RUN`] at a time, as the decider decides a chunk's.
        let mut pending = Vec::with_capacity(PENDING_RUN);
        read_ranges(consumer, &self.topic, &range, WARM_UP_STALL, |message| {
            messages += 1;
            let payload = message.payload().unwrap_or_default();
            let Ok(event) = codec::decode(payload, self.max_message_bytes) else {
                return;
            };
            if let Some((key, window)) = id_of(&self.namespaces, &event) {
                let kafka_ms = message.timestamp().to_millis().unwrap_or(0);
                pending.push((message.offset(), kafka_ms, key, window));
                if pending.len() == PENDING_RUN {
                    ids.decide_all(&pending, |_| {});
                    pending.clear();
                }
            }
        })?;
        ids.decide_all(&pending, |_| {});
        Ok((ids, messages))
    }
}

/// Drops `consumer` on a thread of its own: a consumer of the group (librdkafka assigns
/// partitions only to one) closes when dropped, polling 100 ms at a time, and every
/// acquisition waited for that before its partition was read at all.
fn close_apart(consumer: BaseConsumer) {
    // Should no thread be had, the closure, and the consumer with it, is dropped here.
    let _ = std::thread::Builder::new()
        .name("tally-warm-up".into())
        .spawn(move || drop(consumer));
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
        // Horizon 300 - 120 = 180 s: every earlier id forgotten, as the shards are swept (one
        // per id recorded, the next quarter of the horizon).
        for i in 0..SHARDS as i64 {
            ids.is_repeat(id_key("c", &format!("late{i}")), 100 + i, 300_000, MIN);
        }
        assert_eq!(ids.len(), SHARDS);
        assert!(!ids.is_repeat(id_key("c", "e99"), 200, 300_000, MIN));
    }

    /// A shard's bound on its oldest stamp moves with the bases, so ids are still forgotten
    /// once the offsets have jumped past the slots' range.
    #[test]
    fn ids_are_forgotten_after_the_bases_move() {
        let mut ids = RecentIds::new(MIN);
        for i in 0..1_000 {
            ids.is_repeat(id_key("c", &format!("e{i}")), i, i * 10, MIN);
        }
        // An offset past what a slot holds moves the bases (and every stamp); no shard grows
        // after it, so none is rebuilt from its slots again.
        let far = i64::from(u32::MAX) + 10;
        ids.is_repeat(id_key("c", "f"), far, 20_000, MIN);
        assert_eq!(ids.len(), 1_001);
        // Horizon 135 - 120 = 15 s: the first thousand (stamped before 10 s) are forgotten as
        // the shards are swept, the one stamped 20 s kept.
        for i in 0..SHARDS as i64 {
            ids.is_repeat(id_key("c", &format!("late{i}")), far + 1 + i, 135_000, MIN);
        }
        assert_eq!(ids.len(), 1 + SHARDS);
        // Kept: a resend stamped 80 s (within the skew of the newest) repeats it.
        assert!(ids.is_repeat(id_key("c", "f"), far + 100, 80_000, MIN));
    }

    /// Against a reference that never forgets, over random streams whose timestamps run back at
    /// most the skew allowed: the same decision for every event, through sweeps, growth,
    /// shrinking, offsets that jump past the slots' range and offsets read again.
    #[test]
    fn decides_as_a_set_that_never_forgets_within_the_skew() {
        use rand::{Rng, SeedableRng};
        for seed in 0..40 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let window = rng.random_range(1..20) * 1_000;
            let mut ids = RecentIds::new(window);
            let mut reference: std::collections::HashMap<u64, (i64, i64)> = Default::default();
            let (mut offset, mut newest) = (rng.random_range(0..1_000_000i64), 0i64);
            let distinct = rng.random_range(10..5_000u64);
            for _ in 0..20_000 {
                offset += match rng.random_range(0..1000) {
                    0 => 3_000_000_000,
                    1 => -rng.random_range(0..50),
                    _ => 1,
                };
                newest += rng.random_range(0..200);
                let ts = newest - rng.random_range(0..CLOCK_SKEW_MS);
                let key = id_key("c", &rng.random_range(0..distinct).to_string());
                let expected = match reference.get(&key) {
                    Some(&(at, stamped)) => at < offset && stamped >= ts - window,
                    None => false,
                };
                if !expected {
                    reference.insert(key, (offset, ts));
                }
                assert_eq!(
                    ids.is_repeat(key, offset, ts, window),
                    expected,
                    "seed {seed}, offset {offset}"
                );
            }
            assert!(ids.len() <= reference.len());
        }
    }

    /// Keys whose homes are all a shard's last slots: the run there outgrows the slack past
    /// them, and the shard grows rather than lose one.
    #[test]
    fn keys_crowding_the_end_of_a_shard_are_all_kept() {
        let mut ids = RecentIds::new(60 * MIN);
        let keys: Vec<u64> = (0..2_000u64)
            .map(|i| u64::MAX - i * SHARDS as u64)
            .collect();
        for (n, &key) in keys.iter().enumerate().rev() {
            assert!(!ids.is_repeat(key, n as i64, 0, 60 * MIN), "key {n} is new");
        }
        assert_eq!(ids.len(), keys.len());
        for (n, &key) in keys.iter().enumerate() {
            let offset = (keys.len() + n) as i64;
            assert!(ids.is_repeat(key, offset, 1, 60 * MIN), "key {n} is held");
        }
    }

    #[test]
    fn ids_held_cost_about_22_bytes() {
        let mut ids = RecentIds::new(60 * MIN);
        for n in 1..=1_000_000i64 {
            ids.is_repeat(id_key("c", &n.to_string()), n, n, 60 * MIN);
            if n % 100_000 == 0 {
                let per_id = ids.bytes() as f64 / ids.len() as f64;
                assert!(
                    (18.0..=27.0).contains(&per_id),
                    "{per_id} bytes per id at {n}"
                );
            }
        }
    }
}
