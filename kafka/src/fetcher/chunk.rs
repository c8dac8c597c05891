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

/// What a chunk with this data and these records counts against the fetcher's budget: what
/// they hold allocated, whatever they are filled with.
fn held(data: &Vec<u8>, located: &Vec<Located>) -> usize {
    data.capacity() + located.capacity() * std::mem::size_of::<Located>()
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
    spare: Mutex<Spare>,
}

/// Buffers kept for reuse, and the bytes they hold allocated.
#[derive(Debug, Default)]
struct Spare {
    buffers: Vec<(Vec<u8>, Vec<Located>)>,
    bytes: usize,
}

/// Most buffers kept for reuse.
const SPARE_BUFFERS: usize = 16;

/// A chunk stops growing once it holds this share of the budget, so that the next one is read
/// while its reader works through it.
const CHUNK_SHARE: usize = 4;

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
            spare: Mutex::new(Spare::default()),
        }
    }

    /// Empty buffers for a chunk's data and records, reused if some are spare.
    fn buffers(&self) -> (Vec<u8>, Vec<Located>) {
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        let (data, located) = spare.buffers.pop().unwrap_or_default();
        spare.bytes -= held(&data, &located);
        (data, located)
    }

    /// Keeps a chunk's buffers for reuse, if there is room: at most [`SPARE_BUFFERS`] of them,
    /// holding no more than the budget together, so that idle buffers are bounded as chunks are.
    fn recycle(&self, mut data: Vec<u8>, mut located: Vec<Located>) {
        data.clear();
        located.clear();
        let bytes = held(&data, &located);
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        if data.capacity() > 0
            && spare.buffers.len() < SPARE_BUFFERS
            && spare.bytes + bytes <= self.max
        {
            spare.bytes += bytes;
            spare.buffers.push((data, located));
        }
    }

    /// The bytes the spare buffers hold allocated.
    #[cfg(test)]
    fn spare_bytes(&self) -> usize {
        self.spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }

    /// Whether a chunk being read, filled with `data` and `located` so far, is done growing:
    /// it holds its share of the budget, or with the chunks handed out the whole budget. What
    /// it is filled with, not its capacity: a reused buffer's capacity would end every chunk at
    /// its first batch (the chunk is charged its capacity once handed out).
    fn full(&self, data: &[u8], located: &[Located]) -> bool {
        let filled = std::mem::size_of_val(data) + std::mem::size_of_val(located);
        filled >= (self.max / CHUNK_SHARE).max(1) || self.held() + filled >= self.max
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

    /// Waits until there is room for another chunk.
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

/// How records are read: the options that change it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    /// `check.crcs`.
    pub(super) check_crcs: bool,
    /// `isolation.level`.
    pub(super) isolation: Isolation,
    /// The most one batch may hold once read (its records decompressed, and where each lies):
    /// a batch past it is undecodable. Its records are located at 48 bytes each, so a batch of
    /// tiny records that decompresses within [`compression::MAX_DECOMPRESSED_BYTES`] could
    /// otherwise take seven times that.
    pub(super) max_batch_bytes: usize,
}

impl Default for Reading {
    fn default() -> Self {
        Self {
            check_crcs: false,
            isolation: Isolation::default(),
            max_batch_bytes: compression::MAX_DECOMPRESSED_BYTES,
        }
    }
}

/// One partition's records in a fetch answer, read into chunks as the budget makes room for
/// them: each [`PartReader::chunk`] reads on where the last one stopped. A chunk holds whole
/// batches: decompressed, control batches and the batches of aborted transactions left out,
/// what cannot be read noted. With `check_crcs`, a batch that does not match its CRC ends the
/// reading before it.
pub(super) struct PartReader<'a> {
    batches: records::Batches<'a>,
    reading: Reading,
    /// The offset fetched from: records before it (in the first batch) are not items.
    start: i64,
    log_end: i64,
    next: i64,
    /// Aborted transactions not yet reached, by first offset, the last first; a producer is in
    /// `aborting` from its first aborted offset until its abort marker.
    aborted: Vec<(i64, i64)>,
    aborting: HashSet<i64>,
    corrupt: Option<String>,
    last_epoch: Option<i32>,
    done: bool,
}

/// What a chunk being read holds so far.
struct Filling {
    data: Vec<u8>,
    located: Vec<Located>,
    pieces: Vec<Piece>,
}

impl<'a> PartReader<'a> {
    /// A reader of `part`'s records, fetched from `start`.
    pub(super) fn new(part: &FetchPartition<'a>, start: i64, reading: Reading) -> Self {
        let mut aborted = part.aborted.clone();
        aborted.sort_unstable_by_key(|(_, first)| std::cmp::Reverse(*first));
        Self {
            batches: records::batches(part.records),
            reading,
            start,
            log_end: part.log_end(reading.isolation),
            next: start,
            aborted,
            aborting: HashSet::new(),
            corrupt: None,
            last_epoch: None,
            done: false,
        }
    }

    /// Whether every batch was read (or reading stopped at a corrupt one).
    pub(super) fn done(&self) -> bool {
        self.done
    }

    /// The next offset to fetch: after the last one read past.
    pub(super) fn next(&self) -> i64 {
        self.next
    }

    /// The leader epoch of the last batch read past (KIP-320's last fetched epoch), if any was.
    pub(super) fn last_epoch(&self) -> Option<i32> {
        self.last_epoch
    }

    /// With `check.crcs`, a batch whose bytes do not match its CRC: why, once. Reading stopped
    /// before it (`next` is where it starts), so nothing of it or after it was handed out.
    pub(super) fn take_corrupt(&mut self) -> Option<String> {
        self.corrupt.take()
    }

    /// The next chunk: batches until it is [`Budget::full`], at least one so that reading always
    /// moves on; `None` if nothing left holds anything to hand out (then the reader is done).
    pub(super) fn chunk(
        &mut self,
        budget: &Arc<Budget>,
        partition: i32,
        epoch: u64,
        scratch: &mut Vec<u8>,
    ) -> Option<Chunk> {
        let (data, located) = budget.buffers();
        let mut f = Filling {
            data,
            located,
            pieces: Vec::new(),
        };
        while !self.done && (f.pieces.is_empty() || !budget.full(&f.data, &f.located)) {
            self.read_batch(&mut f, scratch);
        }
        if f.pieces.is_empty() {
            budget.recycle(f.data, f.located);
            return None;
        }
        budget.hold(held(&f.data, &f.located));
        Some(Chunk {
            partition,
            epoch,
            log_end: self.log_end,
            start: self.start,
            pieces: f.pieces,
            data: f.data,
            located: f.located,
            budget: budget.clone(),
        })
    }

    /// Reads the next batch into `f`, or finds the end.
    fn read_batch(&mut self, f: &mut Filling, scratch: &mut Vec<u8>) {
        let (start, reading, rest) = (self.start, self.reading, self.batches.rest());
        let Some(batch) = self.batches.next() else {
            self.done = true;
            return;
        };
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                // The rest of the set cannot be split into batches: hand it out as one
                // undecodable stretch. Its offsets are unknown: skip one offset at a time (each
                // fetch from the next one returns the same batch until reading passes it),
                // losing the least.
                let at = f.data.len();
                f.data.extend_from_slice(rest);
                f.pieces.push(Piece::Undecodable {
                    first_offset: self.next,
                    last_offset: self.next,
                    range: at..f.data.len(),
                    reason: e.to_string(),
                });
                self.next += 1;
                self.done = true;
                return;
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
                    let at = f.data.len();
                    f.data.extend_from_slice(bytes);
                    f.pieces.push(Piece::Undecodable {
                        first_offset: offset,
                        last_offset: offset,
                        range: at..f.data.len(),
                        reason: format!("message format v{magic} is not read (only v2)"),
                    });
                }
                self.next = self.next.max(offset + 1);
                return;
            }
        };
        let last = header.last_offset();
        if last < start {
            return;
        }
        if let Some(computed) = (reading.check_crcs)
            .then(|| records::crc_mismatch(&header, covered))
            .flatten()
        {
            self.corrupt = Some(format!(
                "the batch of offsets {}..={last} does not match its CRC-32C ({:#010x} carried, {computed:#010x} computed): corrupted on a disk or the wire",
                header.base_offset, header.crc,
            ));
            self.done = true;
            return;
        }
        self.next = self.next.max(last + 1);
        self.last_epoch = Some(header.partition_leader_epoch);
        while let Some(&(producer, first)) = self.aborted.last() {
            if first > last {
                break;
            }
            self.aborting.insert(producer);
            self.aborted.pop();
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
                self.aborting.remove(&header.producer_id);
            }
            return;
        }
        if header.is_transactional() && self.aborting.contains(&header.producer_id) {
            // Aborted: never decompressed, never handed out.
            return;
        }
        let first_offset = header.base_offset.max(start);
        let undecodable = |f: &mut Filling, at: usize, reason: String| {
            f.data.truncate(at);
            f.data.extend_from_slice(section);
            f.pieces.push(Piece::Undecodable {
                first_offset,
                last_offset: last,
                range: at..f.data.len(),
                reason,
            });
        };
        // Decompressed (or copied) straight into the chunk.
        let at = f.data.len();
        let read = match header.compression() {
            records::Compression::None => {
                f.data.extend_from_slice(section);
                Ok(())
            }
            codec => compression::decompress(codec, section, &mut f.data),
        };
        if let Err(e) = read {
            undecodable(f, at, e.to_string());
            return;
        }
        // Its records located now, on this task, rather than walked by the reader; no more of
        // them than the batch may hold.
        let first = f.located.len();
        let room = reading.max_batch_bytes.saturating_sub(f.data.len() - at);
        let most = room / std::mem::size_of::<Located>();
        let (mut malformed, mut too_large) = (None, false);
        for record in Records::new(header, &f.data[at..]) {
            if f.located.len() - first == most {
                too_large = true;
                break;
            }
            match record {
                Ok(record) if record.offset < start => {}
                Ok(record) => f.located.push(Located {
                    offset: record.offset,
                    timestamp_ms: record.timestamp_ms,
                    key: Place::of(&f.data, record.key),
                    value: Place::of(&f.data, record.value),
                }),
                Err(e) => malformed = Some(format!("a malformed record: {e}")),
            }
        }
        if too_large {
            f.located.truncate(first);
            let max = reading.max_batch_bytes;
            let reason = format!("the batch holds more than {max} bytes once its records are read");
            undecodable(f, at, reason);
            return;
        }
        f.pieces.push(Piece::Batch(BatchPiece {
            header,
            range: at..f.data.len(),
            records: first..f.located.len(),
            malformed,
        }));
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

    /// What reading a partition's records in one chunk gave.
    struct Built {
        chunk: Option<Chunk>,
        next: i64,
        corrupt: Option<String>,
    }

    /// Reads `part`'s records from `start` into one chunk (the budget has room for them all).
    fn chunk(
        budget: &Arc<Budget>,
        partition: i32,
        epoch: u64,
        start: i64,
        part: &FetchPartition<'_>,
        reading: Reading,
        scratch: &mut Vec<u8>,
    ) -> Built {
        let mut reader = PartReader::new(part, start, reading);
        let chunk = reader.chunk(budget, partition, epoch, scratch);
        assert!(reader.done(), "one chunk holds them all");
        Built {
            chunk,
            next: reader.next(),
            corrupt: reader.take_corrupt(),
        }
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

    /// Producer 7 aborts offsets 0-1 (marker at 2); producer 8 commits 3-4 (marker at 5); a
    /// plain batch at 6.
    fn two_transactions() -> Vec<Vec<u8>> {
        vec![
            plain_batch(0, 2, 0x10, 7),
            control_batch(2, 7, 0),
            plain_batch(3, 2, 0x10, 8),
            control_batch(5, 8, 1),
            plain_batch(6, 1, 0, -1),
        ]
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
        max_batch_bytes: compression::MAX_DECOMPRESSED_BYTES,
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
        let set = two_transactions().concat();
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

    /// A plain batch of one record at `offset` whose value is `size` bytes.
    fn big_batch(offset: i64, size: usize) -> Vec<u8> {
        let value = vec![b'x'; size];
        batch(
            &header(offset, 1, 0),
            &records_section(&[(0, 0, None, Some(&value[..]))]),
        )
    }

    #[test]
    fn a_partition_is_read_in_chunks_as_the_budget_makes_room_for_them() {
        // 40 batches of 1,000-byte records, a budget of 16,000 bytes: a chunk stops at a
        // quarter of it, and none is read while the chunks held fill it.
        let s = Arc::new(Budget::new(16_000));
        let set: Vec<u8> = (0..40).flat_map(|o| big_batch(o, 1_000)).collect();
        let part = part(&set, vec![]);
        let mut reader = PartReader::new(&part, 0, Reading::default());
        let (mut held, mut read, mut chunks, mut peak) = (Vec::new(), Vec::new(), 0, 0);
        while !reader.done() {
            // As the fetcher does: a chunk is read only while the budget has room.
            while s.held() >= 16_000 {
                let c: Chunk = held.remove(0);
                read.extend(offsets(&c));
            }
            let Some(c) = reader.chunk(&s, 0, 1, &mut Vec::new()) else {
                break;
            };
            assert!(c.data.len() < 4_000 + 1_100, "{} bytes", c.data.len());
            chunks += 1;
            held.push(c);
            peak = peak.max(s.held());
        }
        read.extend(held.drain(..).flat_map(|c| offsets(&c)));
        assert_eq!(
            read,
            (0..40).collect::<Vec<_>>(),
            "each record once, in order"
        );
        assert_eq!(reader.next(), 40);
        assert!(chunks >= 10, "{chunks} chunks");
        // Held counts what the buffers hold allocated: at most the budget and one chunk's.
        assert!(peak < 16_000 + 2 * (4_000 + 1_100 + 48 * 4), "peak {peak}");
        assert_eq!(s.held(), 0);

        // With other chunks holding all but 2,000 bytes of the budget, a chunk stops at the
        // batch that fills the rest, short of its share.
        let mut reader = PartReader::new(&part, 0, Reading::default());
        s.hold(14_000);
        let c = reader
            .chunk(&s, 0, 1, &mut Vec::new())
            .expect("a batch at least");
        assert_eq!(offsets(&c), [0, 1]);
        drop(c);
        s.release(14_000);
    }

    #[test]
    fn held_bytes_and_spare_buffers_count_what_is_allocated_within_the_budget() {
        let s = Arc::new(Budget::new(10_000));
        // A reused buffer is charged for all it holds, not for what a small chunk fills.
        s.recycle(Vec::with_capacity(6_000), Vec::new());
        assert_eq!(s.spare_bytes(), 6_000);
        let set = plain_batch(0, 1, 0, -1);
        let built = chunk(
            &s,
            0,
            1,
            0,
            &part(&set, vec![]),
            Reading::default(),
            &mut Vec::new(),
        );
        let c = built.chunk.expect("as written");
        assert!(c.data.capacity() >= 6_000 && c.data.len() < 100);
        assert_eq!(s.held(), c.len_bytes());
        assert!(s.held() >= 6_000, "{}", s.held());
        assert_eq!(s.spare_bytes(), 0);
        drop(c);
        // Spare buffers together stay within the budget, however many chunks drop.
        for _ in 0..5 {
            s.recycle(Vec::with_capacity(4_000), Vec::new());
        }
        assert!(s.spare_bytes() <= 10_000, "{}", s.spare_bytes());
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn a_transaction_aborted_in_one_chunk_is_known_in_the_next() {
        // One batch a chunk. Producer 7 aborts offsets 0-1 (marker at 2), then commits 7-8
        // (marker at 9): its later transaction is read, its aborted one never.
        let s = Arc::new(Budget::new(1));
        let mut set = two_transactions();
        set.extend([plain_batch(7, 2, 0x10, 7), control_batch(9, 7, 1)]);
        let set = set.concat();
        let part = part(&set, vec![(7, 0)]);
        let mut reader = PartReader::new(&part, 0, CHECKED);
        let mut read = Vec::new();
        while let Some(c) = reader.chunk(&s, 0, 1, &mut Vec::new()) {
            assert_eq!(c.pieces.len(), 1);
            read.extend(offsets(&c));
        }
        assert_eq!(read, [3, 4, 6, 7, 8]);
        assert_eq!(reader.next(), 10);
    }

    #[test]
    fn a_batch_that_holds_too_much_once_read_is_undecodable_and_reading_goes_on() {
        let s = budget();
        // 200 one-byte records: about 2 KB decompressed, but 9.6 KB where they lie.
        let tiny = plain_batch(10, 200, 0, -1);
        let set = [tiny, plain_batch(210, 1, 0, -1)].concat();
        let reading = Reading {
            max_batch_bytes: 4_000,
            ..Reading::default()
        };
        let built = chunk(&s, 0, 1, 10, &part(&set, vec![]), reading, &mut Vec::new());
        let c = built.chunk.expect("as written");
        assert_eq!(offsets(&c), [-10, 210]);
        let Some(Item::Undecodable {
            last_offset,
            reason,
            ..
        }) = c.items().next()
        else {
            panic!()
        };
        assert_eq!(last_offset, 209);
        assert!(reason.contains("more than 4000 bytes"), "{reason}");
        assert_eq!(built.next, 211);
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
