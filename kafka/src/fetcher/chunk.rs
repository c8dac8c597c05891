//! [`Chunk`]: one partition's records from one fetch response, owned and decompressed, with
//! every record located when it is built (on the fetch task) so that its reader only slices;
//! and the [`Budget`] of bytes handed out that bounds the fetcher's memory.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

use crate::compression;
use crate::protocol::{FetchPartition, Isolation};
use crate::records::{self, BatchHeader, Control, RawBatch, Record, Records};

/// Something a chunk holds.
#[derive(Debug)]
enum Piece {
    /// A batch of records.
    Batch(BatchPiece),
    /// Offsets that could not be read (a codec not supported, a corrupt batch, an old format):
    /// their bytes are `data[range]`.
    Undecodable {
        first_offset: i64,
        last_offset: i64,
        range: std::ops::Range<usize>,
        reason: String,
    },
}

/// A batch in a chunk: its records section (decompressed) is `data[range]`, its records (from
/// the chunk's start) `located[records]`, and then, if a record was malformed, why.
#[derive(Debug)]
struct BatchPiece {
    header: BatchHeader,
    range: std::ops::Range<usize>,
    records: std::ops::Range<usize>,
    malformed: Option<String>,
}

/// One partition's records from one fetch response: owned, decompressed, read in place with
/// [`Chunk::items`].
pub struct Chunk {
    /// The partition.
    pub partition: i32,
    /// The epoch of the seek it was fetched under.
    pub epoch: u64,
    /// Where the partition's log ended at the broker (its last stable offset): the reader is
    /// caught up when it has read up to here.
    pub log_end: i64,
    /// The offset fetched from: records before it (in the first batch) are not items.
    start: i64,
    pieces: Vec<Piece>,
    data: Vec<u8>,
    /// Where each record lies in `data`, found when the chunk is built (on the fetch task), so
    /// that its reader (the consume loop's thread) only slices: walking the records there was
    /// ~13% of that thread's samples in a JSON catch-up.
    located: Vec<Located>,
    /// Gives the bytes back to the fetcher's budget when the chunk is dropped.
    budget: Arc<Budget>,
}

/// What a chunk with this data and these records counts against the fetcher's budget.
fn held(data: &[u8], located: &[Located]) -> usize {
    std::mem::size_of_val(data) + std::mem::size_of_val(located)
}

/// A record's place in its chunk.
#[derive(Debug, Clone, Copy)]
struct Located {
    offset: i64,
    timestamp_ms: i64,
    key: Place,
    value: Place,
}

/// Where bytes lie in a chunk's data, if anywhere.
#[derive(Debug, Clone, Copy)]
struct Place {
    start: usize,
    end: usize,
}

impl Place {
    const NONE: Place = Place {
        start: usize::MAX,
        end: 0,
    };

    /// The place of `part` (borrowed from `data`).
    fn of(data: &[u8], part: Option<&[u8]>) -> Self {
        part.map_or(Place::NONE, |p| {
            let start = p.as_ptr().addr() - data.as_ptr().addr();
            Place {
                start,
                end: start + p.len(),
            }
        })
    }

    fn get(self, data: &[u8]) -> Option<&[u8]> {
        (self.start != usize::MAX).then(|| &data[self.start..self.end])
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk")
            .field("partition", &self.partition)
            .field("epoch", &self.epoch)
            .field("log_end", &self.log_end)
            .field("start", &self.start)
            .field("bytes", &self.data.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.budget.release(self.len_bytes());
        self.budget.recycle(
            std::mem::take(&mut self.data),
            std::mem::take(&mut self.located),
        );
    }
}

/// An item of a chunk.
#[derive(Debug)]
pub enum Item<'a> {
    /// A record.
    Record(Record<'a>),
    /// Offsets that could not be read, with their raw bytes and why.
    Undecodable {
        /// The first offset not read.
        first_offset: i64,
        /// The last.
        last_offset: i64,
        /// The bytes that could not be read.
        bytes: &'a [u8],
        /// Why.
        reason: String,
    },
}

impl Chunk {
    /// Its records (and undecodable stretches), in log order.
    pub fn items(&self) -> Items<'_> {
        Items {
            chunk: self,
            next_piece: 0,
            batch: None,
        }
    }

    /// Bytes it holds (its data, and where its records lie), as the fetcher's budget counts
    /// them.
    pub fn len_bytes(&self) -> usize {
        held(&self.data, &self.located)
    }
}

/// The iterator [`Chunk::items`] returns.
#[derive(Debug)]
pub struct Items<'a> {
    chunk: &'a Chunk,
    next_piece: usize,
    /// The batch being read, and its records not yet read (indices into `located`).
    batch: Option<(&'a BatchPiece, std::ops::Range<usize>)>,
}

impl<'a> Iterator for Items<'a> {
    type Item = Item<'a>;

    fn next(&mut self) -> Option<Item<'a>> {
        let chunk = self.chunk;
        loop {
            if let Some((batch, unread)) = &mut self.batch {
                if let Some(i) = unread.next() {
                    let at = chunk.located[i];
                    return Some(Item::Record(Record {
                        offset: at.offset,
                        timestamp_ms: at.timestamp_ms,
                        key: at.key.get(&chunk.data),
                        value: at.value.get(&chunk.data),
                    }));
                }
                let batch = *batch;
                self.batch = None;
                if let Some(reason) = &batch.malformed {
                    return Some(Item::Undecodable {
                        first_offset: batch.header.base_offset.max(chunk.start),
                        last_offset: batch.header.last_offset(),
                        bytes: &chunk.data[batch.range.clone()],
                        reason: reason.clone(),
                    });
                }
            }
            let piece = chunk.pieces.get(self.next_piece)?;
            self.next_piece += 1;
            match piece {
                Piece::Batch(batch) => self.batch = Some((batch, batch.records.clone())),
                Piece::Undecodable {
                    first_offset,
                    last_offset,
                    range,
                    reason,
                } => {
                    return Some(Item::Undecodable {
                        first_offset: *first_offset,
                        last_offset: *last_offset,
                        bytes: &chunk.data[range.clone()],
                        reason: reason.clone(),
                    });
                }
            }
        }
    }
}

/// The bytes handed out and not yet dropped, and the buffers of dropped chunks, kept for the
/// next (a fresh buffer of a few MiB costs its pages' faults and zeroing every time).
#[derive(Debug)]
pub(super) struct Budget {
    held: AtomicUsize,
    max: usize,
    freed: Notify,
    spare: Mutex<Vec<(Vec<u8>, Vec<Located>)>>,
}

/// Most buffers kept for reuse.
const SPARE_BUFFERS: usize = 16;

impl Budget {
    /// The bytes handed out and not yet dropped.
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    pub(super) fn new(max: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            max: max.max(1),
            freed: Notify::new(),
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Empty buffers for a chunk's data and records, reused if some are spare.
    fn buffers(&self) -> (Vec<u8>, Vec<Located>) {
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        spare.pop().unwrap_or_default()
    }

    /// Keeps a chunk's buffers for reuse, if there is room.
    fn recycle(&self, mut data: Vec<u8>, mut located: Vec<Located>) {
        data.clear();
        located.clear();
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        if spare.len() < SPARE_BUFFERS && data.capacity() > 0 {
            spare.push((data, located));
        }
    }

    pub(super) fn hold(&self, n: usize) {
        self.held.fetch_add(n, Ordering::AcqRel);
    }

    pub(super) fn release(&self, n: usize) {
        let before = self.held.fetch_sub(n, Ordering::AcqRel);
        if before >= self.max && before - n < self.max {
            self.freed.notify_waiters();
        }
    }

    /// Waits until there is room for another fetch.
    pub(super) async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            if self.held.load(Ordering::Acquire) < self.max {
                return;
            }
            freed.await;
        }
    }
}

/// A chunk, if the partition's answer held anything to hand out, and the next offset to fetch.
pub(super) struct Built {
    pub(super) chunk: Option<Chunk>,
    pub(super) next: i64,
    /// With `check.crcs`, a batch whose bytes do not match its CRC: why. Reading stopped before
    /// it (`next` is where it starts), so nothing of it or after it was handed out.
    pub(super) corrupt: Option<String>,
    /// The leader epoch of the last batch read past (KIP-320's last fetched epoch), if any was.
    pub(super) last_epoch: Option<i32>,
}

/// How records are read: the options that change it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Reading {
    /// `check.crcs`.
    pub(super) check_crcs: bool,
    /// `isolation.level`.
    pub(super) isolation: Isolation,
}

/// Turns one partition's record set into a chunk: decompresses each batch, leaves out control
/// batches and the batches of aborted transactions, and notes what cannot be read. With
/// `check_crcs`, a batch that does not match its CRC ends the chunk before it.
pub(super) fn chunk(
    budget: &Arc<Budget>,
    partition: i32,
    epoch: u64,
    start: i64,
    part: &FetchPartition<'_>,
    reading: Reading,
    scratch: &mut Vec<u8>,
) -> Built {
    let (mut data, mut located) = budget.buffers();
    let mut pieces = Vec::new();
    let mut next = start;
    // Aborted transactions, by first offset; a producer is in `aborting` from its first aborted
    // offset until its abort marker.
    let mut aborted: Vec<(i64, i64)> = part.aborted.clone();
    aborted.sort_unstable_by_key(|(_, first)| std::cmp::Reverse(*first));
    let mut aborting: HashSet<i64> = HashSet::new();
    let mut corrupt = None;
    let mut last_epoch = None;
    for batch in records::batches(part.records) {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                // The rest of the set cannot be split into batches: hand it out as one
                // undecodable stretch.
                let at = data.len();
                data.extend_from_slice(part.records);
                // Its offsets are unknown: skip one offset at a time (each fetch from the next
                // one returns the same batch until reading passes it), losing the least.
                pieces.push(Piece::Undecodable {
                    first_offset: next,
                    last_offset: next,
                    range: at..data.len(),
                    reason: e.to_string(),
                });
                next += 1;
                break;
            }
        };
        let (header, section, covered) = match batch {
            RawBatch::V2 {
                header,
                records,
                covered,
            } => (header, records, covered),
            RawBatch::Legacy {
                offset,
                magic,
                bytes,
            } => {
                if offset >= start {
                    let at = data.len();
                    data.extend_from_slice(bytes);
                    pieces.push(Piece::Undecodable {
                        first_offset: offset,
                        last_offset: offset,
                        range: at..data.len(),
                        reason: format!("message format v{magic} is not read (only v2)"),
                    });
                }
                next = next.max(offset + 1);
                continue;
            }
        };
        let last = header.last_offset();
        if last < start {
            continue;
        }
        if let Some(computed) = (reading.check_crcs)
            .then(|| records::crc_mismatch(&header, covered))
            .flatten()
        {
            corrupt = Some(format!(
                "the batch of offsets {}..={last} does not match its CRC-32C ({:#010x} carried, {computed:#010x} computed): corrupted on a disk or the wire",
                header.base_offset, header.crc,
            ));
            break;
        }
        next = next.max(last + 1);
        last_epoch = Some(header.partition_leader_epoch);
        while let Some(&(producer, first)) = aborted.last() {
            if first > last {
                break;
            }
            aborting.insert(producer);
            aborted.pop();
        }
        if header.is_control() {
            // A transaction's marker: read whether it aborts, hand nothing out.
            let marker = match header.compression() {
                records::Compression::None => records::control(header, section).ok(),
                codec => {
                    scratch.clear();
                    compression::decompress(codec, section, scratch)
                        .ok()
                        .and_then(|()| records::control(header, scratch).ok())
                }
            };
            if header.is_transactional() && marker == Some(Control::Abort) {
                aborting.remove(&header.producer_id);
            }
            continue;
        }
        if header.is_transactional() && aborting.contains(&header.producer_id) {
            // Aborted: never decompressed, never handed out.
            continue;
        }
        // Decompressed (or copied) straight into the chunk.
        let at = data.len();
        let read = match header.compression() {
            records::Compression::None => {
                data.extend_from_slice(section);
                Ok(())
            }
            codec => compression::decompress(codec, section, &mut data),
        };
        if let Err(e) = read {
            data.truncate(at);
            data.extend_from_slice(section);
            pieces.push(Piece::Undecodable {
                first_offset: header.base_offset.max(start),
                last_offset: last,
                range: at..data.len(),
                reason: e.to_string(),
            });
            continue;
        }
        // Its records located now, on this task, rather than walked by the reader.
        let first = located.len();
        let mut malformed = None;
        for record in Records::new(header, &data[at..]) {
            match record {
                Ok(record) if record.offset < start => {}
                Ok(record) => located.push(Located {
                    offset: record.offset,
                    timestamp_ms: record.timestamp_ms,
                    key: Place::of(&data, record.key),
                    value: Place::of(&data, record.value),
                }),
                Err(e) => malformed = Some(format!("a malformed record: {e}")),
            }
        }
        pieces.push(Piece::Batch(BatchPiece {
            header,
            range: at..data.len(),
            records: first..located.len(),
            malformed,
        }));
    }
    if pieces.is_empty() {
        budget.recycle(data, located);
        return Built {
            chunk: None,
            next,
            corrupt,
            last_epoch,
        };
    }
    budget.hold(held(&data, &located));
    let chunk = Chunk {
        partition,
        epoch,
        log_end: part.log_end(reading.isolation),
        start,
        pieces,
        data,
        located,
        budget: budget.clone(),
    };
    Built {
        chunk: Some(chunk),
        next,
        corrupt,
        last_epoch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::tests::{batch, header, records_section};

    use crate::protocol::ErrorCode;

    fn budget() -> Arc<Budget> {
        Arc::new(Budget::new(1 << 20))
    }

    fn part(records: &[u8], aborted: Vec<(i64, i64)>) -> FetchPartition<'_> {
        FetchPartition {
            partition: 0,
            error: ErrorCode::NONE,
            high_watermark: 100,
            last_stable_offset: 100,
            log_start_offset: 0,
            aborted,
            diverging: None,
            records,
        }
    }

    fn offsets(chunk: &Chunk) -> Vec<i64> {
        chunk
            .items()
            .map(|i| match i {
                Item::Record(r) => r.offset,
                Item::Undecodable { first_offset, .. } => -first_offset,
            })
            .collect()
    }

    fn plain_batch(base: i64, n: i32, attributes: i16, producer: i64) -> Vec<u8> {
        let recs: Vec<_> = (0..n).map(|i| (i, 0, None, Some(&b"v"[..]))).collect();
        let mut h = header(base, n, attributes);
        h.producer_id = producer;
        batch(&h, &records_section(&recs))
    }

    fn control_batch(offset: i64, producer: i64, kind: i16) -> Vec<u8> {
        let mut key = crate::wire::Writer::default();
        key.i16(0).i16(kind);
        let mut h = header(offset, 1, 0x30);
        h.producer_id = producer;
        batch(
            &h,
            &records_section(&[(0, 0, Some(&key.buf), Some(b"\0\0\0\0\0\0"))]),
        )
    }

    #[test]
    fn records_before_the_fetch_offset_are_not_items() {
        let s = budget();
        let set = [plain_batch(10, 5, 0, -1), plain_batch(15, 2, 0, -1)].concat();
        let built = chunk(
            &s,
            0,
            1,
            12,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        let c = built.chunk.expect("as written");
        assert_eq!(offsets(&c), [12, 13, 14, 15, 16]);
        assert_eq!(built.next, 17);
        assert_eq!(s.held(), c.len_bytes());
        drop(c);
        assert_eq!(s.held(), 0, "a dropped chunk gives its bytes back");
    }

    const CHECKED: Reading = Reading {
        check_crcs: true,
        isolation: Isolation::ReadCommitted,
    };

    #[test]
    fn with_check_crcs_a_corrupt_batch_ends_the_chunk_before_it() {
        let s = budget();
        let mut second = plain_batch(3, 3, 0, -1);
        let last = second.len() - 1;
        second[last] ^= 0x40;
        let set = [plain_batch(0, 3, 0, -1), second, plain_batch(6, 2, 0, -1)].concat();

        let built = chunk(&s, 0, 1, 0, &part(&set, vec![]), CHECKED, &mut Vec::new());
        let c = built.chunk.expect("the batch before it");
        assert_eq!(offsets(&c), [0, 1, 2]);
        assert_eq!(
            built.next, 3,
            "read again from the corrupt batch, never past it"
        );
        let reason = built.corrupt.expect("the corruption is reported");
        assert!(reason.contains("offsets 3..=5"), "{reason}");

        // From the corrupt batch itself: nothing to hand out, and no progress.
        let built = chunk(&s, 0, 1, 3, &part(&set, vec![]), CHECKED, &mut Vec::new());
        assert!(built.chunk.is_none());
        assert_eq!((built.next, built.corrupt.is_some()), (3, true));

        // Without the check the batch is read as it came (librdkafka's default).
        let built = chunk(
            &s,
            0,
            1,
            0,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        assert_eq!(built.next, 8);
        assert!(built.corrupt.is_none());
    }

    #[test]
    fn aborted_transactions_and_markers_are_left_out() {
        let s = budget();
        // Producer 7 aborts offsets 0-1 (marker at 2); producer 8 commits 3-4 (marker at 5);
        // a plain batch at 6.
        let set = [
            plain_batch(0, 2, 0x10, 7),
            control_batch(2, 7, 0),
            plain_batch(3, 2, 0x10, 8),
            control_batch(5, 8, 1),
            plain_batch(6, 1, 0, -1),
        ]
        .concat();
        let built = chunk(
            &s,
            0,
            1,
            0,
            &part(&set, vec![(7, 0)]),
            Reading::default(),
            &mut Vec::new(),
        );
        assert_eq!(offsets(&built.chunk.expect("as written")), [3, 4, 6]);
        assert_eq!(built.next, 7);
    }

    #[test]
    fn a_batch_that_cannot_be_decompressed_is_undecodable_and_reading_goes_on() {
        let s = budget();
        let recs = records_section(&[(0, 0, None, Some(b"v"))]);
        let zstd = batch(&header(4, 1, 4), &recs);
        let set = [plain_batch(3, 1, 0, -1), zstd, plain_batch(5, 1, 0, -1)].concat();
        let built = chunk(
            &s,
            0,
            1,
            3,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        assert_eq!(offsets(&built.chunk.expect("as written")), [3, -4, 5]);
        assert_eq!(built.next, 6);
    }

    #[test]
    fn records_located_at_build_read_back_whole_and_a_malformed_one_ends_its_batch() {
        let s = budget();
        let good = records_section(&[
            (0, 5, Some(&b"k0"[..]), Some(&b"first"[..])),
            (1, 6, None, Some(&b"second"[..])),
            (2, 7, Some(&b"k2"[..]), None),
        ]);
        // The header says four records; the section holds three and a cut-off fourth.
        let cut = [good.as_slice(), &[0x40]].concat();
        let set = [batch(&header(20, 4, 0), &cut), plain_batch(24, 1, 0, -1)].concat();
        let built = chunk(
            &s,
            0,
            1,
            20,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        let c = built.chunk.expect("as written");
        let items: Vec<_> = c
            .items()
            .map(|i| match i {
                Item::Record(r) => (r.offset, r.timestamp_ms, r.key, r.value, None),
                Item::Undecodable {
                    first_offset,
                    last_offset,
                    reason,
                    ..
                } => (first_offset, last_offset, None, None, Some(reason)),
            })
            .collect();
        let reason = items[3].4.clone().expect("the cut-off record is reported");
        assert!(reason.starts_with("a malformed record"), "{reason}");
        assert_eq!(
            items,
            [
                (20, 1_005, Some(&b"k0"[..]), Some(&b"first"[..]), None),
                (21, 1_006, None, Some(&b"second"[..]), None),
                (22, 1_007, Some(&b"k2"[..]), None, None),
                (20, 23, None, None, Some(reason)),
                (24, 1_000, None, Some(&b"v"[..]), None),
            ]
        );
        assert_eq!(built.next, 25);
    }

    #[test]
    fn an_lz4_batch_is_read_like_a_plain_one() {
        use std::io::Write;
        let s = budget();
        let recs: Vec<_> = (0..50)
            .map(|i| (i, i64::from(i), None, Some(&b"{\"counter\":\"c\"}"[..])))
            .collect();
        let section = records_section(&recs);
        let mut lz = lz4_flex::frame::FrameEncoder::new(Vec::new());
        lz.write_all(&section).expect("as written");
        let set = batch(&header(100, 50, 3), &lz.finish().expect("as written"));
        let built = chunk(
            &s,
            0,
            1,
            100,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        let c = built.chunk.expect("as written");
        assert_eq!(offsets(&c), (100..150).collect::<Vec<_>>());
        let Some(Item::Record(r)) = c.items().nth(7) else {
            panic!()
        };
        assert_eq!(
            (r.timestamp_ms, r.value),
            (1_007, Some(&b"{\"counter\":\"c\"}"[..]))
        );
    }
}
