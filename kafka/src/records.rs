//! Record batches (Kafka's message format v2), parsed in place: [`batches`] splits a partition's
//! record set into [`RawBatch`]es, [`Records`] walks a batch's (decompressed) records and yields
//! each [`Record`] as slices of the buffer it reads: no allocation, no copy.
//!
//! A batch on the wire:
//!
//! ```text
//! baseOffset int64 | batchLength int32 | partitionLeaderEpoch int32 | magic int8 (2) | crc uint32
//! attributes int16 | lastOffsetDelta int32 | baseTimestamp int64 | maxTimestamp int64
//! producerId int64 | producerEpoch int16 | baseSequence int32 | recordCount int32 | records...
//! ```
//!
//! and each record: `length varint | attributes int8 | timestampDelta varlong | offsetDelta
//! varint | keyLength varint | key | valueLength varint | value | headerCount varint | headers`.
//! The records section is compressed as a whole when `attributes & 7` names a codec.

use crate::wire::{Malformed, Reader};

/// Bytes before a batch's records: everything up to and including `recordCount`.
pub const BATCH_HEADER_LEN: usize = 61;

/// The bytes of `baseOffset` and `batchLength`, which `batchLength` does not count.
const LOG_OVERHEAD: usize = 12;

/// Where a v2 batch's CRC-32C field ends: it covers everything after it.
const CRC_END: usize = 21;

/// The CRC-32C a v2 batch's bytes have, if it is not the one the batch carries
/// (`check.crcs`): a batch corrupted on a disk or the wire.
pub fn crc_mismatch(header: &BatchHeader, covered: &[u8]) -> Option<u32> {
    Some(crc32c::crc32c(covered)).filter(|computed| *computed != header.crc)
}

/// How a batch's records section is compressed (`attributes & 7`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Not compressed.
    None,
    /// gzip.
    Gzip,
    /// Snappy (raw, or Java's xerial framing).
    Snappy,
    /// LZ4 frames.
    Lz4,
    /// Zstandard.
    Zstd,
    /// A codec id Kafka does not define.
    Unknown(u8),
}

impl Compression {
    fn from_attributes(attributes: i16) -> Self {
        match attributes & 0x07 {
            0 => Self::None,
            1 => Self::Gzip,
            2 => Self::Snappy,
            3 => Self::Lz4,
            4 => Self::Zstd,
            other => Self::Unknown(other as u8),
        }
    }
}

/// A batch's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// The first offset in the batch.
    pub base_offset: i64,
    /// The epoch of the leader that appended it (KIP-101): where a log diverged is found by it.
    pub partition_leader_epoch: i32,
    /// `2`: the only format parsed here.
    pub magic: i8,
    /// Codec, timestamp type, transactional and control bits.
    pub attributes: i16,
    /// The last offset is `base_offset + last_offset_delta`.
    pub last_offset_delta: i32,
    /// The first record's timestamp; records carry deltas from it.
    pub base_timestamp: i64,
    /// The largest timestamp in the batch (the broker's append time under `LogAppendTime`).
    pub max_timestamp: i64,
    /// The producer id, or -1.
    pub producer_id: i64,
    /// How many records the batch holds.
    pub record_count: i32,
    /// The CRC-32C the batch carries, of everything from `attributes` on.
    pub crc: u32,
}

impl BatchHeader {
    /// The records section's codec.
    pub fn compression(&self) -> Compression {
        Compression::from_attributes(self.attributes)
    }

    /// The broker stamped the batch (`LogAppendTime`): every record's time is `max_timestamp`.
    pub fn log_append_time(&self) -> bool {
        self.attributes & 0x08 != 0
    }

    /// Part of a transaction.
    pub fn is_transactional(&self) -> bool {
        self.attributes & 0x10 != 0
    }

    /// A control batch: a transaction's commit or abort marker, not data.
    pub fn is_control(&self) -> bool {
        self.attributes & 0x20 != 0
    }

    /// The batch's last offset.
    pub fn last_offset(&self) -> i64 {
        self.base_offset + i64::from(self.last_offset_delta)
    }
}

/// One batch of a record set: its header, and its records section as it came (compressed or
/// not). A batch in an older message format (magic 0 or 1) is `Legacy`: its offsets are known,
/// its records are not parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawBatch<'a> {
    /// A v2 batch.
    V2 {
        /// Its header.
        header: BatchHeader,
        /// Its records section.
        records: &'a [u8],
        /// The bytes its CRC covers: from `attributes` to its end.
        covered: &'a [u8],
    },
    /// An entry in message format v0 or v1, at `offset` (for a compressed wrapper, its last
    /// inner offset), with all its bytes.
    Legacy {
        /// The entry's offset.
        offset: i64,
        /// Its magic byte.
        magic: i8,
        /// The whole entry.
        bytes: &'a [u8],
    },
}

/// Splits a partition's record set into its batches, in order. A record set may end with a
/// partial batch (the broker cuts at the fetch's byte limit): that is where the iteration ends.
pub fn batches(set: &[u8]) -> Batches<'_> {
    Batches { set, pos: 0 }
}

/// The iterator [`batches`] returns.
#[derive(Debug, Clone)]
pub struct Batches<'a> {
    set: &'a [u8],
    pos: usize,
}

impl<'a> Batches<'a> {
    /// The bytes not split into batches yet.
    pub fn rest(&self) -> &'a [u8] {
        &self.set[self.pos..]
    }
}

impl<'a> Iterator for Batches<'a> {
    type Item = Result<RawBatch<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = &self.set[self.pos..];
        // Too short for a batch's length and magic: a cut-off tail.
        if rest.len() < LOG_OVERHEAD + 5 {
            return None;
        }
        let mut r = Reader::new(rest);
        let parsed = (|| {
            let base_offset = r.i64("baseOffset")?;
            let length = r.i32("batchLength")?;
            let length = usize::try_from(length).map_err(|_| r.malformed("batchLength"))?;
            let total = LOG_OVERHEAD + length;
            if rest.len() < total {
                return Ok(None);
            }
            let partition_leader_epoch = r.i32("partitionLeaderEpoch")?;
            let magic = r.i8("magic")?;
            let bytes = &rest[..total];
            if magic < 2 {
                return Ok(Some((
                    RawBatch::Legacy {
                        offset: base_offset,
                        magic,
                        bytes,
                    },
                    total,
                )));
            }
            if magic > 2 || length + LOG_OVERHEAD < BATCH_HEADER_LEN {
                return Err(r.malformed("a record batch of a known format"));
            }
            let mut h = Reader::new(&bytes[17..BATCH_HEADER_LEN]);
            let crc = h.u32("crc")?;
            let attributes = h.i16("attributes")?;
            let last_offset_delta = h.i32("lastOffsetDelta")?;
            let base_timestamp = h.i64("baseTimestamp")?;
            let max_timestamp = h.i64("maxTimestamp")?;
            let producer_id = h.i64("producerId")?;
            let _producer_epoch = h.i16("producerEpoch")?;
            let _base_sequence = h.i32("baseSequence")?;
            let record_count = h.i32("recordCount")?;
            let header = BatchHeader {
                base_offset,
                partition_leader_epoch,
                magic,
                attributes,
                last_offset_delta,
                base_timestamp,
                max_timestamp,
                producer_id,
                record_count,
                crc,
            };
            let records = &bytes[BATCH_HEADER_LEN..];
            let covered = &bytes[CRC_END..];
            Ok(Some((
                RawBatch::V2 {
                    header,
                    records,
                    covered,
                },
                total,
            )))
        })();
        match parsed {
            Ok(Some((batch, total))) => {
                self.pos += total;
                Some(Ok(batch))
            }
            Ok(None) => None,
            Err(e) => {
                // Nothing after a malformed batch can be trusted.
                self.pos = self.set.len();
                Some(Err(Malformed {
                    at: self.pos + e.at,
                    what: e.what,
                }))
            }
        }
    }
}

/// A record, borrowing its key and value from the buffer it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// Its offset in the partition.
    pub offset: i64,
    /// Its timestamp, milliseconds since the epoch (create time, or the broker's append time).
    pub timestamp_ms: i64,
    /// Its key, if any.
    pub key: Option<&'a [u8]>,
    /// Its value, if any.
    pub value: Option<&'a [u8]>,
}

/// Walks the records of one batch's uncompressed records section.
#[derive(Debug, Clone)]
pub struct Records<'a> {
    reader: Reader<'a>,
    header: BatchHeader,
    left: i32,
}

impl<'a> Records<'a> {
    /// The records of the batch `header`, read from `records` (its records section, after
    /// decompression).
    pub fn new(header: BatchHeader, records: &'a [u8]) -> Self {
        Self {
            reader: Reader::new(records),
            header,
            left: header.record_count.max(0),
        }
    }

    fn read(&mut self) -> Result<Record<'a>, Malformed> {
        let r = &mut self.reader;
        let length = r.varint("record length")?;
        let length = usize::try_from(length).map_err(|_| r.malformed("record length"))?;
        let end = r.position() + length;
        if r.remaining() < length {
            return Err(r.malformed("a whole record"));
        }
        r.skip(1, "record attributes")?;
        let timestamp_delta = r.varlong("timestampDelta")?;
        let offset_delta = r.varint("offsetDelta")?;
        let key = record_bytes(r, "key")?;
        let value = record_bytes(r, "value")?;
        // Headers are not read: skip to the record's end.
        if r.position() > end {
            return Err(r.malformed("a record within its length"));
        }
        r.skip(end - r.position(), "record headers")?;
        let h = &self.header;
        let timestamp_ms = if h.log_append_time() {
            h.max_timestamp
        } else {
            h.base_timestamp.wrapping_add(timestamp_delta)
        };
        Ok(Record {
            offset: h.base_offset + i64::from(offset_delta),
            timestamp_ms,
            key,
            value,
        })
    }
}

fn record_bytes<'a>(r: &mut Reader<'a>, what: &'static str) -> Result<Option<&'a [u8]>, Malformed> {
    match r.varint(what)? {
        n if n < 0 => Ok(None),
        n => r.take(n as usize, what).map(Some),
    }
}

impl<'a> Iterator for Records<'a> {
    type Item = Result<Record<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let read = self.read();
        if read.is_err() {
            self.left = 0;
        }
        Some(read)
    }
}

/// What a control batch marks: the end of its producer's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// The transaction was aborted: its records are not to be read.
    Abort,
    /// The transaction was committed.
    Commit,
    /// A marker of another kind.
    Other(i16),
}

/// The marker a control batch's (uncompressed) records section holds.
pub fn control(header: BatchHeader, records: &[u8]) -> Result<Control, Malformed> {
    let record = Records::new(header, records)
        .next()
        .unwrap_or(Err(Malformed {
            at: 0,
            what: "a control record",
        }))?;
    let key = record.key.unwrap_or_default();
    let mut r = Reader::new(key);
    let _version = r.i16("control record version")?;
    Ok(match r.i16("control record type")? {
        0 => Control::Abort,
        1 => Control::Commit,
        other => Control::Other(other),
    })
}

/// Bytes a zig-zag varint of `v` takes.
fn varlong_len(v: i64) -> usize {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    let mut n = 1;
    while z >= 0x80 {
        z >>= 7;
        n += 1;
    }
    n
}

/// Appends a zig-zag varint.
fn put_varlong(out: &mut Vec<u8>, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

/// Appends one record (no headers) to a records section being built: its offset and timestamp
/// as deltas from the batch's first.
pub fn put_record(
    out: &mut Vec<u8>,
    offset_delta: i32,
    timestamp_delta: i64,
    key: Option<&[u8]>,
    value: &[u8],
) {
    let key_len = key.map_or(-1, |k| k.len() as i64);
    let value_len = value.len() as i64;
    let body = 1
        + varlong_len(timestamp_delta)
        + varlong_len(i64::from(offset_delta))
        + varlong_len(key_len)
        + key.map_or(0, <[u8]>::len)
        + varlong_len(value_len)
        + value.len()
        + 1;
    out.reserve(body + 5);
    put_varlong(out, body as i64);
    out.push(0);
    put_varlong(out, timestamp_delta);
    put_varlong(out, i64::from(offset_delta));
    put_varlong(out, key_len);
    if let Some(key) = key {
        out.extend_from_slice(key);
    }
    put_varlong(out, value_len);
    out.extend_from_slice(value);
    out.push(0);
}

/// What an idempotent producer stamps on a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The producer id.
    pub producer_id: i64,
    /// Its epoch.
    pub producer_epoch: i16,
    /// The sequence number of the batch's first record in its partition.
    pub base_sequence: i32,
}

/// Appends a whole batch to `out`: the header (create times, `attributes` naming the codec of
/// `records`) with its CRC-32C, then `records`, the records section as compressed.
#[allow(clippy::too_many_arguments)]
pub fn put_batch(
    out: &mut Vec<u8>,
    attributes: i16,
    record_count: i32,
    base_timestamp: i64,
    max_timestamp: i64,
    stamp: Stamp,
    records: &[u8],
) {
    let start = out.len();
    let length = (BATCH_HEADER_LEN - LOG_OVERHEAD + records.len()) as i32;
    out.extend_from_slice(&0i64.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(&(-1i32).to_be_bytes());
    out.push(2);
    let crc_at = out.len();
    out.extend_from_slice(&0u32.to_be_bytes());
    out.extend_from_slice(&attributes.to_be_bytes());
    out.extend_from_slice(&(record_count - 1).to_be_bytes());
    out.extend_from_slice(&base_timestamp.to_be_bytes());
    out.extend_from_slice(&max_timestamp.to_be_bytes());
    out.extend_from_slice(&stamp.producer_id.to_be_bytes());
    out.extend_from_slice(&stamp.producer_epoch.to_be_bytes());
    out.extend_from_slice(&stamp.base_sequence.to_be_bytes());
    out.extend_from_slice(&record_count.to_be_bytes());
    out.extend_from_slice(records);
    let crc = crc32c::crc32c(&out[crc_at + 4..]);
    out[crc_at..crc_at + 4].copy_from_slice(&crc.to_be_bytes());
    debug_assert_eq!(out.len() - start, LOG_OVERHEAD + length as usize);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::Writer;

    /// One record as a test writes it: offset delta, timestamp delta, key, value.
    pub(crate) type TestRecord<'a> = (i32, i64, Option<&'a [u8]>, Option<&'a [u8]>);

    /// The records section of a batch.
    pub(crate) fn records_section(records: &[TestRecord<'_>]) -> Vec<u8> {
        let mut out = Writer::default();
        for &(offset_delta, ts_delta, key, value) in records {
            let mut body = Writer::default();
            body.i8(0)
                .varlong(ts_delta)
                .varlong(i64::from(offset_delta));
            for part in [key, value] {
                match part {
                    None => body.varlong(-1),
                    Some(b) => {
                        body.varlong(b.len() as i64);
                        body.buf.extend_from_slice(b);
                        &mut body
                    }
                };
            }
            // One header, which the parser must skip.
            body.varlong(1).varlong(1);
            body.buf.push(b'h');
            body.varlong(2);
            body.buf.extend_from_slice(b"hv");
            out.varlong(body.buf.len() as i64);
            out.buf.extend_from_slice(&body.buf);
        }
        out.buf
    }

    /// A whole batch: header fields from `header`, `section` as its (maybe compressed) records.
    pub(crate) fn batch(header: &BatchHeader, section: &[u8]) -> Vec<u8> {
        let mut w = Writer::default();
        w.i64(header.base_offset)
            .i32((BATCH_HEADER_LEN - LOG_OVERHEAD + section.len()) as i32)
            .i32(header.partition_leader_epoch)
            .i8(2)
            .i32(0)
            .i16(header.attributes)
            .i32(header.last_offset_delta)
            .i64(header.base_timestamp)
            .i64(header.max_timestamp)
            .i64(header.producer_id)
            .i16(0)
            .i32(0)
            .i32(header.record_count);
        w.buf.extend_from_slice(section);
        let crc = crc32c::crc32c(&w.buf[CRC_END..]);
        w.buf[CRC_END - 4..CRC_END].copy_from_slice(&crc.to_be_bytes());
        w.buf
    }

    pub(crate) fn header(base_offset: i64, count: i32, attributes: i16) -> BatchHeader {
        BatchHeader {
            base_offset,
            partition_leader_epoch: 0,
            magic: 2,
            attributes,
            last_offset_delta: count - 1,
            base_timestamp: 1_000,
            max_timestamp: 9_999,
            producer_id: -1,
            record_count: count,
            crc: 0,
        }
    }

    #[test]
    fn a_batch_yields_its_records_in_place() {
        let recs: [TestRecord<'_>; 3] = [
            (0, 0, Some(b"k0"), Some(b"v0")),
            (1, 5, None, Some(b"value one")),
            (2, 7, Some(b"k2"), None),
        ];
        let h = header(100, 3, 0);
        let set = batch(&h, &records_section(&recs));
        let mut it = batches(&set);
        let Some(Ok(RawBatch::V2 {
            header: got,
            records,
            ..
        })) = it.next()
        else {
            panic!("one v2 batch");
        };
        assert_eq!(got, BatchHeader { crc: got.crc, ..h });
        assert!(it.next().is_none());
        let read: Vec<Record<'_>> = Records::new(got, records).map(Result::unwrap).collect();
        assert_eq!(
            read,
            [
                Record {
                    offset: 100,
                    timestamp_ms: 1_000,
                    key: Some(b"k0"),
                    value: Some(b"v0")
                },
                Record {
                    offset: 101,
                    timestamp_ms: 1_005,
                    key: None,
                    value: Some(b"value one")
                },
                Record {
                    offset: 102,
                    timestamp_ms: 1_007,
                    key: Some(b"k2"),
                    value: None
                },
            ]
        );
    }

    #[test]
    fn log_append_time_gives_every_record_the_batch_time() {
        let h = header(0, 2, 0x08);
        let section = records_section(&[(0, 3, None, Some(b"a")), (1, 4, None, Some(b"b"))]);
        let times: Vec<i64> = Records::new(h, &section)
            .map(|r| r.expect("as written").timestamp_ms)
            .collect();
        assert_eq!(times, [9_999, 9_999]);
    }

    #[test]
    fn a_partial_last_batch_ends_the_set() {
        let section = records_section(&[(0, 0, None, Some(b"x"))]);
        let mut set = batch(&header(5, 1, 0), &section);
        let second = batch(&header(6, 1, 0), &section);
        set.extend_from_slice(&second[..second.len() - 3]);
        let all: Vec<_> = batches(&set).collect();
        assert_eq!(all.len(), 1);
        assert!(matches!(all[0], Ok(RawBatch::V2 { header, .. }) if header.base_offset == 5));
    }

    #[test]
    fn a_record_running_past_its_batch_is_malformed() {
        let h = header(0, 2, 0);
        let section = records_section(&[(0, 0, None, Some(b"abc"))]);
        let mut it = Records::new(h, &section[..section.len() - 2]);
        assert!(it.next().expect("as written").is_err());
        assert!(
            it.next().is_none(),
            "nothing is read after a malformed record"
        );
    }

    #[test]
    fn legacy_entries_are_recognised_by_their_magic() {
        let mut w = Writer::default();
        w.i64(42).i32(14).i32(0).i8(1).i8(0).i64(0);
        w.buf.extend_from_slice(&[0u8; 0]);
        let bytes = w.buf.clone();
        let got: Vec<_> = batches(&bytes).collect();
        assert_eq!(got.len(), 1);
        assert!(matches!(
            got[0],
            Ok(RawBatch::Legacy {
                offset: 42,
                magic: 1,
                ..
            })
        ));
    }

    #[test]
    fn a_written_batch_reads_back_and_its_crc_is_kafkas() {
        let mut section = Vec::new();
        put_record(
            &mut section,
            0,
            0,
            Some(b"likes:post:1"),
            b"{\"counter\":\"likes:post:1\"}",
        );
        put_record(&mut section, 1, 300, None, &[7u8; 200]);
        put_record(&mut section, 2, -5, Some(b""), b"");
        let stamp = Stamp {
            producer_id: 4_000,
            producer_epoch: 3,
            base_sequence: 17,
        };
        let mut set = Vec::new();
        put_batch(
            &mut set,
            0,
            3,
            1_700_000_000_000,
            1_700_000_000_300,
            stamp,
            &section,
        );
        let batches: Vec<_> = batches(&set).collect();
        let [
            Ok(RawBatch::V2 {
                header,
                records,
                covered,
            }),
        ] = batches.as_slice()
        else {
            panic!("one batch: {batches:?}");
        };
        assert_eq!(crc_mismatch(header, covered), None, "the CRC checks out");
        let mut corrupt = covered.to_vec();
        corrupt[40] ^= 0x01;
        assert_eq!(
            crc_mismatch(header, &corrupt),
            Some(crc32c::crc32c(&corrupt)),
            "one flipped bit is caught"
        );
        assert_eq!(
            (
                header.record_count,
                header.last_offset(),
                header.producer_id
            ),
            (3, 2, 4_000)
        );
        let read: Vec<Record<'_>> = Records::new(*header, records)
            .map(|r| r.expect("a record"))
            .collect();
        assert_eq!(read[0].key, Some(&b"likes:post:1"[..]));
        assert_eq!(
            (read[1].offset, read[1].timestamp_ms, read[1].key),
            (1, 1_700_000_000_300, None)
        );
        assert_eq!(
            (read[2].key, read[2].value, read[2].timestamp_ms),
            (Some(&b""[..]), Some(&b""[..]), 1_699_999_999_995)
        );
        // Kafka's CRC-32C covers everything from the attributes on.
        let crc = u32::from_be_bytes([set[17], set[18], set[19], set[20]]);
        assert_eq!(crc, crc32c::crc32c(&set[21..]));
        // The Castagnoli check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn varint_lengths_match_what_is_written() {
        for v in [
            0i64,
            63,
            -64,
            64,
            8_191,
            -8_192,
            8_192,
            i64::from(i32::MAX),
            i64::MIN,
        ] {
            let mut out = Vec::new();
            put_varlong(&mut out, v);
            assert_eq!(out.len(), varlong_len(v), "{v}");
        }
    }

    #[test]
    fn control_batches_tell_abort_from_commit() {
        for (kind, expected) in [(0i16, Control::Abort), (1, Control::Commit)] {
            let mut key = Writer::default();
            key.i16(0).i16(kind);
            let section = records_section(&[(0, 0, Some(&key.buf), Some(b"\0\0\0\0\0\0"))]);
            let h = header(10, 1, 0x30);
            assert!(h.is_control() && h.is_transactional());
            assert_eq!(control(h, &section), Ok(expected));
        }
    }
}
