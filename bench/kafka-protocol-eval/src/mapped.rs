//! tally-kafka's `parse_fetch`, `parse_metadata` and `fetch_request` written on the
//! kafka-protocol crate, to count what adopting it would leave of tally's code and to check
//! that both read the captured answers alike. The lines between the `BEGIN` and `END` marks
//! are what would replace the hand-written ones.

use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::fetch_request::{FetchPartition as Wanted, FetchTopic};
use kafka_protocol::messages::{
    BrokerId, FetchRequest, FetchResponse, MetadataResponse, TopicName,
};
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};
use tally_kafka::protocol::{
    BrokerAddress, ErrorCode, FetchLimits, FetchPosition, Isolation, Metadata, PartitionMetadata,
};

/// A partition of a decoded fetch, borrowing its records from the response.
#[derive(Debug, PartialEq, Eq)]
pub struct Part<'a> {
    pub partition: i32,
    pub error: ErrorCode,
    pub high_watermark: i64,
    pub last_stable_offset: i64,
    pub log_start_offset: i64,
    pub aborted: Vec<(i64, i64)>,
    pub diverging: Option<(i32, i64)>,
    pub records: &'a [u8],
}

// BEGIN
pub fn fetch_request(
    version: i16,
    topic: &str,
    positions: &[FetchPosition],
    limits: FetchLimits,
    isolation: Isolation,
) -> anyhow::Result<BytesMut> {
    let partitions = (positions.iter())
        .map(|p| {
            Wanted::default()
                .with_partition(p.partition)
                .with_current_leader_epoch(p.current_leader_epoch)
                .with_fetch_offset(p.offset)
                // A field a version lacks must stay at its default, or encoding fails.
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
                .with_topic(TopicName(StrBytes::from_string(topic.to_owned())))
                .with_partitions(partitions),
        ])
        .with_rack_id(StrBytes::from_static_str(""));
    let mut out = BytesMut::new();
    request.encode(&mut out, version)?;
    Ok(out)
}

pub fn decode_fetch(body: &mut Bytes, version: i16) -> anyhow::Result<FetchResponse> {
    FetchResponse::decode(body, version)
}

pub fn fetch_parts<'a>(response: &'a FetchResponse, topic: &str) -> (ErrorCode, Vec<Part<'a>>) {
    let parts = (response.responses.iter())
        .filter(|t| t.topic.0.as_str() == topic)
        .flat_map(|t| &t.partitions)
        .map(|p| Part {
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
        .collect();
    (ErrorCode(response.error_code), parts)
}

pub fn parse_metadata(body: &[u8], topic: &str) -> anyhow::Result<Metadata> {
    let response = MetadataResponse::decode(&mut Bytes::copy_from_slice(body), 7)?;
    let found = (response.topics.iter())
        .find(|t| t.name.as_ref().is_some_and(|n| n.0.as_str() == topic))
        .ok_or_else(|| anyhow::anyhow!("the topic asked for"))?;
    Ok(Metadata {
        brokers: (response.brokers.iter())
            .map(|b| BrokerAddress {
                node_id: b.node_id.0,
                host: b.host.to_string(),
                port: b.port,
            })
            .collect(),
        topic_error: ErrorCode(found.error_code),
        partitions: (found.partitions.iter())
            .map(|p| PartitionMetadata {
                partition: p.partition_index,
                error: ErrorCode(p.error_code),
                leader: p.leader_id.0,
                leader_epoch: p.leader_epoch,
            })
            .collect(),
    })
}
// END
