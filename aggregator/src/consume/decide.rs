//! Idempotency keys decided off the loop's thread. With tally's fetcher and a namespace that
//! keeps an idempotency window, a thread of its own (the decider) sits between the fetcher and
//! the loop: it decodes each chunk's records, decides their ids against the partition's
//! [`RecentIds`] and hands the chunk on with its [`Decisions`], which the loop then routes by,
//! with the events it decoded, which the loop does not decode again ([`Decisions::event`]).
//! Looking ids up in tables of millions waits on memory; on the loop's thread that was the
//! bound of an idempotent catch-up (`docs/guarantees.md`, "Idempotency keys").
//!
//! Exactness. A partition's ids are decided once each, in log order, from the state its
//! acquisition rebuilt ([`super::idempotency::WarmUp`]), whoever decides them:
//! - [`Ids`] holds the state with the epoch whose chunks may be decided and the next offset to
//!   decide. The loop installs a new state on each acquisition with no epoch, and sets the
//!   epoch under the state's lock while it seeks the fetcher ([`Ids::positioned`]), so no
//!   chunk of the new epoch is decided before the state knows its position.
//! - The decider decides a chunk only if it is of the state's epoch, and only its records from
//!   the next offset on; any other chunk goes on undecided. A record the loop reads without a
//!   decision (a chunk that went by before the epoch was set, or read through librdkafka) is
//!   decided by the loop, under the same lock ([`Ids::lock`], [`Deciding::decide`]).
//! - Chunks of another epoch than the partition's are dropped by the loop unread, as before.
//!   Every change of epoch other than an acquisition's seek stops the partition until it is
//!   acquired again (a rollback, a truncated log, a fenced owner), and the new acquisition
//!   installs a state rebuilt from the log, so what the decider decided of chunks that are then
//!   dropped never decides a record that is read.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tally_common::Namespaces;
use tally_common::codec::{self, EventRef, Record};
use tally_kafka::{Chunk, Fetched, Item};
use tokio::sync::mpsc;

use crate::consume::idempotency::{self, Pending, RecentIds};
use crate::machine::ownership::Resume;

/// A partition's idempotency state, shared by the loop and the decider.
#[derive(Debug)]
pub(crate) struct Ids {
    deciding: Mutex<Deciding>,
    /// Ids held and bytes of tables, as of the last chunk decided (for the metrics).
    held: AtomicUsize,
    bytes: AtomicUsize,
}

/// What [`Ids`] guards.
#[derive(Debug)]
pub(crate) struct Deciding {
    /// The epoch whose chunks the decider decides; `None` until the partition is positioned.
    epoch: Option<u64>,
    /// Records before this offset are decided.
    next: i64,
    ids: RecentIds,
}

impl Deciding {
    /// Decides the record at `offset` (stamped `kafka_ms`) with id key `key` in a namespace
    /// keeping `window_ms`: whether it repeats an id counted.
    pub(crate) fn decide(&mut self, offset: i64, kafka_ms: i64, key: u64, window_ms: i64) -> bool {
        self.next = self.next.max(offset + 1);
        self.ids.is_repeat(key, offset, kafka_ms, window_ms)
    }
}

impl Ids {
    /// A partition's state as its acquisition rebuilt it, positioned nowhere yet.
    pub(crate) fn new(ids: RecentIds) -> Self {
        Self {
            held: AtomicUsize::new(ids.len()),
            bytes: AtomicUsize::new(ids.bytes()),
            deciding: Mutex::new(Deciding {
                epoch: None,
                next: i64::MIN,
                ids,
            }),
        }
    }

    /// Replaces the state with `ids`, rebuilt by a new acquisition: nothing is decided with it
    /// until [`Ids::positioned`].
    pub(crate) fn install(&self, ids: RecentIds) {
        let mut deciding = self.lock();
        self.noted(&ids);
        *deciding = Deciding {
            epoch: None,
            next: i64::MIN,
            ids,
        };
    }

    /// Positions the partition at `resume` with `seek`, which returns the epoch of the seek:
    /// the decider decides that epoch's chunks from `resume` on.
    pub(crate) fn positioned<T>(&self, resume: Resume, seek: impl FnOnce() -> (T, u64)) -> T {
        let mut deciding = self.lock();
        let (sought, epoch) = seek();
        deciding.epoch = Some(epoch);
        deciding.next = match resume {
            Resume::At(offset) => offset,
            Resume::Beginning => i64::MIN,
        };
        sought
    }

    /// The state, to decide records the decider did not.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Deciding> {
        self.deciding.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ids held and bytes of tables, as last noted.
    pub(crate) fn sizes(&self) -> (usize, usize) {
        if let Ok(deciding) = self.deciding.try_lock() {
            self.noted(&deciding.ids);
        }
        (
            self.held.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }

    fn noted(&self, ids: &RecentIds) {
        self.held.store(ids.len(), Ordering::Relaxed);
        self.bytes.store(ids.bytes(), Ordering::Relaxed);
    }
}

/// Which of a run of records repeat an id counted: every record at an offset in `from..to`
/// was decided, and those in `repeats` (ascending) repeat. With them, the events the decider
/// decoded, so that the loop does not decode them again.
#[derive(Debug, Default)]
pub(crate) struct Decisions {
    from: i64,
    to: i64,
    repeats: Vec<i64>,
    /// The events decoded, by ascending offset from `base`, and where the loop's next lookup
    /// starts.
    events: Vec<Read>,
    base: i64,
    next: Cell<usize>,
    /// Where `events` goes back once read.
    spare: Option<Arc<Spare>>,
}

/// An event as the decider decoded and checked it, in 32 bytes: its offset, its strings as
/// ranges of its message's bytes, and its numbers. Its event id is left out: it is decided.
/// At most one per record of a chunk, two thirds of what the chunk's own index of its records
/// takes (48 bytes a record, counted by the fetcher's budget), so what they hold is bounded
/// as chunks are.
#[derive(Debug, Clone, Copy)]
struct Read {
    /// Its offset after the decisions' `base`.
    at: u32,
    counter: u32,
    actor: u32,
    counter_len: u16,
    /// [`NO_ACTOR`] for none.
    actor_len: u16,
    /// 0 for a reset (no other event has a delta of 0).
    delta: i64,
    ts_ms: i64,
}

const _: () = assert!(std::mem::size_of::<Read>() == 32);

/// [`Read::actor_len`] of an event without an actor (actor ids are at most 256 bytes).
const NO_ACTOR: u16 = u16::MAX;

/// Where `s`, borrowed from `payload`, lies in it: its start and length.
fn range_in(payload: &[u8], s: &str) -> Option<(u32, u16)> {
    let start = (s.as_ptr() as usize).checked_sub(payload.as_ptr() as usize)?;
    start
        .checked_add(s.len())
        .filter(|&end| end <= payload.len())?;
    Some((u32::try_from(start).ok()?, u16::try_from(s.len()).ok()?))
}

impl Read {
    /// `event`, decoded from `payload` at `at` past the base, if each of its strings is a
    /// slice of it (a JSON string with escapes is not).
    fn of(event: &EventRef<'_>, payload: &[u8], at: u32) -> Option<Self> {
        let borrowed = |s: &Cow<'_, str>| match s {
            Cow::Borrowed(s) => range_in(payload, s),
            Cow::Owned(_) => None,
        };
        let (counter, counter_len) = borrowed(&event.counter)?;
        let (actor, actor_len) = match &event.actor {
            Some(actor) => borrowed(actor).filter(|a| a.1 != NO_ACTOR)?,
            None => (0, NO_ACTOR),
        };
        debug_assert_eq!(
            event.reset,
            event.delta == 0,
            "a reset's delta is 0, no other's"
        );
        Some(Self {
            at,
            counter,
            actor,
            counter_len,
            actor_len,
            delta: event.delta,
            ts_ms: event.ts_ms,
        })
    }

    /// The event again, from the same `payload`, without its event id; `None` if the ranges
    /// do not hold text of `payload`.
    fn event<'a>(&self, payload: &'a [u8]) -> Option<EventRef<'a>> {
        let text = |start: u32, len: u16| {
            let start = start as usize;
            let bytes = payload.get(start..start + usize::from(len))?;
            std::str::from_utf8(bytes).ok().map(Cow::Borrowed)
        };
        Some(EventRef {
            counter: text(self.counter, self.counter_len)?,
            delta: self.delta,
            actor: match self.actor_len {
                NO_ACTOR => None,
                len => Some(text(self.actor, len)?),
            },
            ts_ms: self.ts_ms,
            event_id: None,
            reset: self.delta == 0,
        })
    }
}

/// Buffers of decoded events the loop is done with, for the decider to fill again: a chunk's
/// are larger than the allocator's threshold for mapping memory apart, and one mapped anew
/// for each chunk cost the decider its page faults.
#[derive(Debug, Default)]
pub(crate) struct Spare(Mutex<Vec<Vec<Read>>>);

/// Most buffers kept spare.
const SPARE: usize = 4;

impl Spare {
    fn take(&self) -> Vec<Read> {
        (self.0.lock().unwrap_or_else(PoisonError::into_inner))
            .pop()
            .unwrap_or_default()
    }
}

impl Drop for Decisions {
    fn drop(&mut self) {
        if let Some(spare) = &self.spare {
            let mut events = std::mem::take(&mut self.events);
            events.clear();
            let mut kept = spare.0.lock().unwrap_or_else(PoisonError::into_inner);
            if kept.len() < SPARE {
                kept.push(events);
            }
        }
    }
}

impl Decisions {
    /// Whether the record at `offset` repeats an id counted, if it was decided.
    pub(crate) fn repeat(&self, offset: i64) -> Option<bool> {
        (self.from..self.to)
            .contains(&offset)
            .then(|| self.repeats.binary_search(&offset).is_ok())
    }

    /// The event at `offset`, whose message is `payload`, if the decider decoded it: as
    /// [`codec::decode`] returns it, but without its event id. Found at once when asked in
    /// ascending offsets, as the loop reads.
    pub(crate) fn event<'a>(&self, offset: i64, payload: &'a [u8]) -> Option<EventRef<'a>> {
        let at = u32::try_from(offset.checked_sub(self.base)?).ok()?;
        let next = self.next.get();
        let i = match self.events.get(next) {
            Some(read) if read.at == at => next,
            _ => self.events.binary_search_by_key(&at, |r| r.at).ok()?,
        };
        self.next.set(i + 1);
        self.events[i].event(payload)
    }
}

/// The partitions' idempotency states by partition, for the decider to find.
pub(crate) type Registry = Arc<Mutex<HashMap<i32, Arc<Ids>>>>;

/// What the decider hands the loop: what the fetcher handed over, with a chunk's decisions.
pub(crate) type Decided = (Fetched, Option<Decisions>);

/// The records of a chunk from offset `from` on, with what decides their ids.
#[derive(Debug)]
pub(crate) struct Decider {
    namespaces: Arc<Namespaces>,
    max_message_bytes: usize,
    /// The records with an id of the chunk being decided (kept between chunks).
    pending: Vec<Pending>,
    spare: Arc<Spare>,
}

impl Decider {
    pub(crate) fn new(namespaces: Arc<Namespaces>, max_message_bytes: usize) -> Self {
        Self {
            namespaces,
            max_message_bytes,
            pending: Vec::new(),
            spare: Arc::default(),
        }
    }

    /// Starts the decider's thread between `fetched` and the returned receiver; it ends when
    /// either side closes.
    pub(crate) fn start(
        mut self,
        registry: Registry,
        mut fetched: mpsc::UnboundedReceiver<Fetched>,
    ) -> mpsc::UnboundedReceiver<Decided> {
        let (tx, rx) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("tally-ids".into())
            .spawn(move || {
                while let Some(fetched) = fetched.blocking_recv() {
                    let decisions = match &fetched {
                        Fetched::Chunk(chunk) => {
                            let ids = registry
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .get(&chunk.partition)
                                .cloned();
                            ids.and_then(|ids| self.decide_chunk(&ids, chunk))
                        }
                        _ => None,
                    };
                    if tx.send((fetched, decisions)).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the idempotency decider's thread");
        rx
    }

    /// Decides `chunk`'s records from the state's next offset on, if the chunk is of the
    /// state's epoch.
    pub(crate) fn decide_chunk(&mut self, ids: &Ids, chunk: &Chunk) -> Option<Decisions> {
        let mut deciding = ids.lock();
        if deciding.epoch != Some(chunk.epoch) {
            return None;
        }
        let records = chunk.items().map(|item| match item {
            Item::Record(r) => (r.offset, r.timestamp_ms, r.value),
            // Nothing to decide; its offsets are passed.
            Item::Undecodable { last_offset, .. } => (last_offset, -1, None),
        });
        let decisions = self.decide(&mut deciding, records);
        ids.noted(&deciding.ids);
        Some(decisions)
    }

    /// Decides `records` (offset, Kafka timestamp or -1, value) from `deciding`'s next
    /// offset on.
    fn decide<'a>(
        &mut self,
        deciding: &mut Deciding,
        records: impl Iterator<Item = (i64, i64, Option<&'a [u8]>)>,
    ) -> Decisions {
        let from = deciding.next;
        let mut to = from;
        self.pending.clear();
        let mut events = self.spare.take();
        let mut base = None;
        for (offset, kafka_ms, value) in records.filter(|r| r.0 >= from) {
            to = to.max(offset + 1);
            let payload = value.unwrap_or_default();
            let Ok(record) = codec::decode_record(payload, self.max_message_bytes) else {
                continue;
            };
            if let Some((key, window)) = idempotency::record_id(&self.namespaces, &record) {
                self.pending.push((offset, kafka_ms.max(0), key, window));
            }
            if let Record::Event(event) = &record
                && let Ok(at) = u32::try_from(offset - *base.get_or_insert(offset))
                && let Some(read) = Read::of(event, payload, at)
            {
                events.push(read);
            }
        }
        let mut repeats = Vec::new();
        (deciding.ids).decide_all(&self.pending, |offset| repeats.push(offset));
        deciding.next = deciding.next.max(to);
        Decisions {
            from,
            to,
            repeats,
            events,
            base: base.unwrap_or(0),
            next: Cell::new(0),
            spare: Some(Arc::clone(&self.spare)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_common::CounterEvent;
    use tally_common::codec::encode;

    const MIN: i64 = 60_000;

    fn namespaces() -> Arc<Namespaces> {
        let toml = "[namespaces.views]\nidempotency_window = \"10m\"\n";
        Arc::new(Namespaces::from_toml(toml).expect("namespaces"))
    }

    /// An event of counter `views:c{counter}` with id `e{id}`.
    fn event(counter: u32, id: u32) -> Vec<u8> {
        let event = CounterEvent::new(format!("views:c{counter}"), 1).expect("event");
        encode(&event.with_event_id(format!("e{id}")).expect("id"))
    }

    /// Pseudo-random log: (offset, Kafka ms, value), ids repeated within and past the window.
    fn log(n: i64, seed: u64) -> Vec<(i64, i64, Vec<u8>)> {
        let mut x = seed;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..n)
            .map(|offset| {
                let r = next();
                let value = if r % 50 == 0 {
                    b"not an event".to_vec()
                } else {
                    event((r >> 8) as u32 % 5, (r >> 20) as u32 % 40)
                };
                (offset * 2, offset * 20_000, value)
            })
            .collect()
    }

    /// What deciding each record in turn, as the loop did, gives: the repeats' offsets.
    fn one_by_one(log: &[(i64, i64, Vec<u8>)]) -> Vec<i64> {
        let namespaces = namespaces();
        let mut ids = RecentIds::new(10 * MIN);
        log.iter()
            .filter(|(offset, ms, value)| {
                let record = codec::decode_record(value, 1 << 20).ok();
                match record.and_then(|r| idempotency::record_id(&namespaces, &r)) {
                    Some((key, window)) => ids.is_repeat(key, *offset, *ms, window),
                    None => false,
                }
            })
            .map(|r| r.0)
            .collect()
    }

    #[test]
    fn the_events_decided_are_handed_on_as_decoded_without_their_ids() {
        let actor = CounterEvent::new("views:c1", 3)
            .and_then(|e| e.with_actor("u7"))
            .and_then(|e| e.with_event_id("e1"))
            .expect("event");
        let payloads: Vec<Vec<u8>> = vec![
            event(1, 1),
            encode(&actor),
            encode(&CounterEvent::reset("views:c2").expect("reset")),
            br#"{"counter":"views:c3","delta":2,"actor":"u1","event_id":"e9","ts_ms":5}"#.to_vec(),
            // Escaped: its counter is not a slice of the message, and the loop decodes it.
            br#"{"counter":"views:c\u0034","event_id":"e9"}"#.to_vec(),
            codec::encode_expiry("views:c1", 10),
            b"not an event".to_vec(),
        ];
        let ids = Ids::new(RecentIds::new(10 * MIN));
        ids.positioned(Resume::Beginning, || ((), 1));
        let mut decider = Decider::new(namespaces(), 1 << 20);
        let records = (payloads.iter().enumerate()).map(|(i, p)| (i as i64, 0, Some(&p[..])));
        let decisions = decider.decide(&mut ids.lock(), records);
        fn expected(payload: &[u8]) -> Option<EventRef<'_>> {
            let mut event = codec::decode(payload, 1 << 20).ok()?;
            event.event_id = None;
            Some(event)
        }
        let kept = [true, true, true, true, false, false, false];
        // In order, then out of order (the lookup then searches).
        for offset in (0..payloads.len()).chain([5, 0, 3, 3, 1]) {
            let payload = &payloads[offset][..];
            let event = decisions.event(offset as i64, payload);
            assert_eq!(event.is_some(), kept[offset], "offset {offset}");
            if kept[offset] {
                assert_eq!(event, expected(payload), "offset {offset}");
            }
        }
        assert_eq!(decisions.event(9, &payloads[0]), None, "no record there");
        // Another message than the one decided: the ranges are checked, never trusted.
        assert_eq!(decisions.event(1, b"x"), None);
        // Read, its buffer goes back to the decider, which fills it again for the next chunk
        // with that chunk's events alone.
        drop(decisions);
        let next: Vec<Vec<u8>> = vec![encode(&actor), event(2, 2)];
        let records = (next.iter().enumerate()).map(|(i, p)| (10 + i as i64, 0, Some(&p[..])));
        let decisions = decider.decide(&mut ids.lock(), records);
        assert_eq!(decisions.events.len(), 2, "the buffer was emptied");
        for (i, payload) in next.iter().enumerate() {
            let event = decisions.event(10 + i as i64, payload);
            assert_eq!(event, expected(payload), "offset {}", 10 + i);
        }
        assert_eq!(decisions.event(0, &payloads[0]), None, "the last chunk's");
    }

    #[test]
    fn chunks_decided_in_runs_decide_as_one_record_at_a_time() {
        for seed in 1..20 {
            let log = log(400, seed);
            let expected = one_by_one(&log);
            assert!(!expected.is_empty(), "the log repeats ids");
            let mut decider = Decider::new(namespaces(), 1 << 20);
            let ids = Ids::new(RecentIds::new(10 * MIN));
            ids.positioned(Resume::Beginning, || ((), 7));
            let mut repeats = Vec::new();
            // Chunks of uneven sizes, each overlapping the one before (a fetch from the start
            // of a batch): the overlap is not decided twice.
            let mut start = 0;
            let mut len = 1;
            while start < log.len() {
                let from = start.saturating_sub(len / 2);
                let end = (start + len).min(log.len());
                let records = log[from..end]
                    .iter()
                    .map(|(o, t, v)| (*o, *t, Some(&v[..])));
                let decisions = decider.decide(&mut ids.lock(), records);
                for (offset, _, _) in &log[start..end] {
                    if decisions.repeat(*offset) == Some(true) {
                        repeats.push(*offset);
                    }
                    assert!(decisions.repeat(*offset).is_some(), "{offset} decided");
                }
                start = end;
                len = len * 3 % 37 + 1;
            }
            assert_eq!(repeats, expected, "seed {seed}");
        }
    }

    #[test]
    fn a_state_decides_nothing_until_positioned_and_then_from_its_position() {
        let ids = Ids::new(RecentIds::new(10 * MIN));
        let mut decider = Decider::new(namespaces(), 1 << 20);
        assert_eq!(ids.lock().epoch, None);
        let sought = ids.positioned(Resume::At(10), || ("sought", 3));
        assert_eq!(sought, "sought");
        let (a, b) = (event(1, 1), event(1, 1));
        let records = [
            (8, 0, Some(&a[..])),
            (10, 1, Some(&a[..])),
            (12, 2, Some(&b[..])),
        ];
        let decisions = decider.decide(&mut ids.lock(), records.into_iter());
        assert_eq!(
            decisions.repeat(8),
            None,
            "before the position: not decided"
        );
        assert_eq!(decisions.repeat(10), Some(false), "the first counted");
        assert_eq!(decisions.repeat(12), Some(true), "its repeat");
        assert_eq!(decisions.repeat(13), None);
        // A new acquisition's state: no epoch until positioned again.
        ids.install(RecentIds::new(10 * MIN));
        assert_eq!(ids.lock().epoch, None);
        assert_eq!(ids.sizes(), (0, RecentIds::new(10 * MIN).bytes()));
    }
}
