//! Idempotency keys decided off the loop's thread. With tally's fetcher and a namespace that
//! keeps an idempotency window, a thread of its own (the decider) sits between the fetcher and
//! the loop: it decodes each chunk's records, decides their ids against the partition's
//! [`RecentIds`] and hands the chunk on with its [`Decisions`], which the loop then routes by.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tally_common::Namespaces;
use tally_common::codec;
use tally_kafka::{Chunk, Fetched, Item};
use tokio::sync::mpsc;

use crate::consume::idempotency::{self, RecentIds};
use crate::machine::ownership::Resume;

/// Records whose ids' home slots are read together before they are decided (the reads wait on
/// memory at the same time instead of one after the other).
const DECIDED_TOGETHER: usize = 16;

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
/// was decided, and those in `repeats` (ascending) repeat.
#[derive(Debug, Default)]
pub(crate) struct Decisions {
    from: i64,
    to: i64,
    repeats: Vec<i64>,
}

impl Decisions {
    /// Whether the record at `offset` repeats an id counted, if it was decided.
    pub(crate) fn repeat(&self, offset: i64) -> Option<bool> {
        (self.from..self.to)
            .contains(&offset)
            .then(|| self.repeats.binary_search(&offset).is_ok())
    }
}

/// The partitions' idempotency states by partition, for the decider to find.
pub(crate) type Registry = Arc<Mutex<HashMap<i32, Arc<Ids>>>>;

/// What the decider hands the loop: what the fetcher handed over, with a chunk's decisions.
pub(crate) type Decided = (Fetched, Option<Decisions>);

/// A record to decide: its offset, Kafka timestamp, and its id's key and window.
type Pending = (i64, i64, u64, i64);

/// The records of a chunk from offset `from` on, with what decides their ids.
#[derive(Debug)]
pub(crate) struct Decider {
    namespaces: Arc<Namespaces>,
    max_message_bytes: usize,
    /// The records with an id of the chunk being decided (kept between chunks).
    pending: Vec<Pending>,
}

impl Decider {
    pub(crate) fn new(namespaces: Arc<Namespaces>, max_message_bytes: usize) -> Self {
        Self {
            namespaces,
            max_message_bytes,
            pending: Vec::new(),
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
        for (offset, kafka_ms, value) in records.filter(|r| r.0 >= from) {
            to = to.max(offset + 1);
            if let Some((key, window)) = self.id_of(value) {
                self.pending.push((offset, kafka_ms.max(0), key, window));
            }
        }
        let mut repeats = Vec::new();
        for run in self.pending.chunks(DECIDED_TOGETHER) {
            deciding.ids.touch(run.iter().map(|p| p.2));
            for &(offset, kafka_ms, key, window) in run {
                if deciding.decide(offset, kafka_ms, key, window) {
                    repeats.push(offset);
                }
            }
        }
        deciding.next = deciding.next.max(to);
        Decisions { from, to, repeats }
    }

    /// The id key and window of a record's value, if it is an event with an id in a namespace
    /// that keeps a window.
    fn id_of(&self, value: Option<&[u8]>) -> Option<(u64, i64)> {
        let record = codec::decode_record(value.unwrap_or_default(), self.max_message_bytes);
        idempotency::record_id(&self.namespaces, &record.ok()?)
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
        let decider = Decider::new(namespaces(), 1 << 20);
        let mut ids = RecentIds::new(10 * MIN);
        log.iter()
            .filter(|(offset, ms, value)| match decider.id_of(Some(value)) {
                Some((key, window)) => ids.is_repeat(key, *offset, *ms, window),
                None => false,
            })
            .map(|r| r.0)
            .collect()
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
