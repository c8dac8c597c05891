//! `Fetch`, v11 and v12: the request for a topic's partitions and the response whose record
//! sets stay borrowed.

use bytes::Bytes;
use kafka_protocol::messages::fetch_request::{FetchPartition as Wanted, FetchTopic};
use kafka_protocol::messages::{self, BrokerId, FetchRequest};

use super::{ErrorCode, FETCH, decode_bytes, encode, topic_name};
use crate::wire::{Malformed, Writer};

/// Limits of one fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchLimits {
    /// Longest the broker may wait for `min_bytes` to arrive.
    pub max_wait_ms: i32,
    /// Bytes the broker waits for before answering.
    pub min_bytes: i32,
    /// Most bytes in the whole response (the first batch always comes whole).
    pub max_bytes: i32,
    /// Most bytes per partition.
    pub partition_max_bytes: i32,
}

/// Which records a fetch returns (`isolation.level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Up to the last stable offset, with the aborted transactions listed (to leave out).
    #[default]
    ReadCommitted,
    /// Up to the high watermark, aborted transactions included.
    ReadUncommitted,
}

/// One partition a fetch asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchPosition {
    /// Its index.
    pub partition: i32,
    /// The offset to read from.
    pub offset: i64,
    /// The partition's leader epoch as the client knows it (-1: unknown, not checked): a
    /// leader of another epoch refuses the fetch (KIP-320).
    pub current_leader_epoch: i32,
    /// The leader epoch of the record before `offset`, if known (-1): from v12, a broker whose
    /// log diverged from that epoch before `offset` says where ([`FetchPartition::diverging`]).
    pub last_fetched_epoch: i32,
}

/// `Fetch` request (no fetch session) of `version` (v11 or v12) for `positions` of `topic`.
pub fn fetch_request(
    w: &mut Writer,
    version: i16,
    topic: &str,
    positions: &[FetchPosition],
    limits: FetchLimits,
    isolation: Isolation,
) {
    let partitions = (positions.iter())
        .map(|p| {
            Wanted::default()
                .with_partition(p.partition)
                .with_current_leader_epoch(p.current_leader_epoch)
                .with_fetch_offset(p.offset)
                // From v12; a field the version lacks must keep its default, or encoding
                // fails.
                .with_last_fetched_epoch(if version >= 12 {
                    p.last_fetched_epoch
                } else {
                    -1
                })
                .with_partition_max_bytes(limits.partition_max_bytes)
        })
        .collect();
    let request = FetchRequest::default()
        .with_replica_id(BrokerId(-1))
        .with_max_wait_ms(limits.max_wait_ms)
        .with_min_bytes(limits.min_bytes)
        .with_max_bytes(limits.max_bytes)
        .with_isolation_level(i8::from(isolation == Isolation::ReadCommitted))
        .with_session_epoch(-1)
        .with_topics(vec![
            FetchTopic::default()
                .with_topic(topic_name(topic))
                .with_partitions(partitions),
        ]);
    encode(w, &request, version);
}

/// One partition of a fetch response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchPartition<'a> {
    /// Its index.
    pub partition: i32,
    /// Its error.
    pub error: ErrorCode,
    /// The offset after the last one replicated to every in-sync replica.
    pub high_watermark: i64,
    /// The last stable offset: what a read_committed reader can read up to (-1 if unknown).
    pub last_stable_offset: i64,
    /// The first offset still in the log (-1 if unknown).
    pub log_start_offset: i64,
    /// Aborted transactions overlapping this response: `(producer id, first offset)`.
    pub aborted: Vec<(i64, i64)>,
    /// From v12: the log diverged from the request's last fetched epoch; `(epoch, end offset)`
    /// is the broker's last epoch up to it and where that epoch ends (KIP-320/KIP-595).
    pub diverging: Option<(i32, i64)>,
    /// The record set, borrowed from the response.
    pub records: &'a [u8],
}

impl FetchPartition<'_> {
    /// Where a reader's log ends: for read_committed the last stable offset (or the high
    /// watermark where that is unknown), for read_uncommitted the high watermark.
    pub fn log_end(&self, isolation: Isolation) -> i64 {
        if isolation == Isolation::ReadCommitted && self.last_stable_offset >= 0 {
            self.last_stable_offset
        } else {
            self.high_watermark
        }
    }
}

/// A decoded `Fetch` response. Its record sets are slices of the bytes it was decoded from.
#[derive(Debug)]
pub struct FetchResponse(messages::FetchResponse);

impl FetchResponse {
    /// The response of `version` in `body`, which its record sets then share.
    pub fn decode(body: &mut Bytes, version: i16) -> Result<Self, Malformed> {
        decode_bytes(body, FETCH, version).map(Self)
    }

    /// The response's own error (not its partitions').
    pub fn error(&self) -> ErrorCode {
        ErrorCode(self.0.error_code)
    }

    /// How long the broker asks its client to wait before its next request to it, under a
    /// quota (`throttle_time_ms`, KIP-219); 0 if none.
    pub fn throttle_time_ms(&self) -> u32 {
        self.0.throttle_time_ms.max(0) as u32
    }

    /// Every partition of `topic` in the response.
    pub fn partitions(&self, topic: &str) -> Vec<FetchPartition<'_>> {
        (self.0.responses.iter())
            .filter(|t| t.topic.as_str() == topic)
            .flat_map(|t| &t.partitions)
            .map(|p| FetchPartition {
                partition: p.partition_index,
                error: ErrorCode(p.error_code),
                high_watermark: p.high_watermark,
                last_stable_offset: p.last_stable_offset,
                log_start_offset: p.log_start_offset,
                aborted: (p.aborted_transactions.iter().flatten())
                    .map(|a| (a.producer_id.0, a.first_offset))
                    .collect(),
                diverging: (p.diverging_epoch.epoch >= 0)
                    .then_some((p.diverging_epoch.epoch, p.diverging_epoch.end_offset)),
                records: p.records.as_deref().unwrap_or_default(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: FetchLimits = FetchLimits {
        max_wait_ms: 500,
        min_bytes: 1,
        max_bytes: 1 << 20,
        partition_max_bytes: 1 << 16,
    };

    const POSITION: FetchPosition = FetchPosition {
        partition: 3,
        offset: 42,
        current_leader_epoch: 8,
        last_fetched_epoch: 9,
    };

    fn request(version: i16, isolation: Isolation) -> Vec<u8> {
        let mut w = Writer::default();
        fetch_request(&mut w, version, "t", &[POSITION], LIMITS, isolation);
        w.buf
    }

    #[test]
    fn a_fetch_request_lays_out_v11_and_v12() {
        let mut head = Writer::default();
        head.i32(-1)
            .i32(500)
            .i32(1)
            .i32(1 << 20)
            .i8(1)
            .i32(0)
            .i32(-1);

        let mut v11 = Writer {
            buf: head.buf.clone(),
        };
        v11.array_len(1).string("t").array_len(1);
        v11.i32(3).i32(8).i64(42).i64(-1).i32(1 << 16);
        v11.array_len(0).string("");
        assert_eq!(request(11, Isolation::ReadCommitted), v11.buf);

        // Compact lengths, the last fetched epoch, and tagged fields after each structure.
        let mut v12 = Writer { buf: head.buf };
        v12.compact_array_len(1)
            .compact_string("t")
            .compact_array_len(1);
        v12.i32(3).i32(8).i64(42).i32(9).i64(-1).i32(1 << 16);
        v12.no_tagged_fields().no_tagged_fields();
        v12.compact_array_len(0)
            .compact_string("")
            .no_tagged_fields();
        assert_eq!(request(12, Isolation::ReadCommitted), v12.buf);

        for version in [11, 12] {
            let isolation = |i| request(version, i)[16];
            assert_eq!(isolation(Isolation::ReadUncommitted), 0, "read_uncommitted");
            assert_eq!(isolation(Isolation::ReadCommitted), 1, "read_committed");
        }
    }

    /// A response of two topics, the one asked for last, as `version` lays it out.
    fn response(version: i16, diverging: Option<(i32, i64)>) -> Vec<u8> {
        let flexible = FETCH.is_flexible(version);
        let mut w = Writer::default();
        w.i32(0).i16(0).i32(0);
        if flexible {
            w.compact_array_len(2);
        } else {
            w.array_len(2);
        }
        for topic in ["other", "t"] {
            if flexible {
                w.compact_string(topic).compact_array_len(1);
            } else {
                w.string(topic).array_len(1);
            }
            w.i32(5).i16(0).i64(100).i64(90).i64(7);
            if flexible {
                w.compact_array_len(1).i64(4_000).i64(60).no_tagged_fields();
                w.i32(-1).uvarint(11).buf.extend_from_slice(b"record-set");
                match diverging {
                    None => w.no_tagged_fields(),
                    // Tag 0, 13 bytes: the epoch, its end offset, no tagged fields.
                    Some((epoch, end)) => w
                        .uvarint(1)
                        .uvarint(0)
                        .uvarint(13)
                        .i32(epoch)
                        .i64(end)
                        .uvarint(0),
                };
                w.no_tagged_fields();
            } else {
                w.array_len(1).i64(4_000).i64(60);
                w.i32(-1).bytes(b"record-set");
            }
        }
        if flexible {
            w.no_tagged_fields();
        }
        w.buf
    }

    fn parse(body: &[u8], version: i16) -> Result<FetchResponse, Malformed> {
        FetchResponse::decode(&mut Bytes::copy_from_slice(body), version)
    }

    #[test]
    fn a_fetch_response_keeps_its_records_borrowed_in_either_version() {
        for (version, diverging) in [(11, None), (12, None), (12, Some((4, 77)))] {
            let body = Bytes::from(response(version, diverging));
            let fetched = FetchResponse::decode(&mut body.clone(), version).expect("as written");
            assert_eq!(fetched.error(), ErrorCode::NONE);
            let parts = fetched.partitions("t");
            assert_eq!(
                parts,
                [FetchPartition {
                    partition: 5,
                    error: ErrorCode::NONE,
                    high_watermark: 100,
                    last_stable_offset: 90,
                    log_start_offset: 7,
                    aborted: vec![(4_000, 60)],
                    diverging,
                    records: b"record-set",
                }],
                "v{version}"
            );
            // The records are a slice of the response's own bytes, not a copy.
            let within = body.as_ptr_range();
            assert!(within.contains(&parts[0].records.as_ptr()), "v{version}");
            assert_eq!(parts[0].log_end(Isolation::ReadCommitted), 90);
            assert_eq!(parts[0].log_end(Isolation::ReadUncommitted), 100);
            let other = if version == 11 { 12 } else { 11 };
            assert!(
                parse(&body, other).is_err(),
                "v{version} read as v{other} is malformed"
            );
        }
    }

    #[test]
    fn the_throttle_is_read() {
        let body = response(11, None);
        assert_eq!(parse(&body, 11).expect("as written").throttle_time_ms(), 0);
        let mut throttled = body.clone();
        throttled[..4].copy_from_slice(&1_500i32.to_be_bytes());
        assert_eq!(
            parse(&throttled, 11)
                .expect("as written")
                .throttle_time_ms(),
            1_500
        );
        assert!(parse(&[0, 0], 11).is_err(), "too short");
    }
}
