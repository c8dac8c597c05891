//! The few Kafka requests tally sends, and their responses: `ApiVersions` (v0), `Metadata` (v7),
//! `ListOffsets` (v2), `OffsetForLeaderEpoch` (v3), `Fetch` (v11-v12), `Produce` (v8), `InitProducerId` (v1), `SaslHandshake`
//! (v1) and `SaslAuthenticate` (v1). Each [`Api`] names the versions tally implements; a
//! connection asks the broker for its ranges with `ApiVersions` first and speaks, per API, the
//! newest version both implement ([`Api::negotiate`], `crate::connection`). Every broker from
//! Kafka 2.3 on implements at least the oldest of each; Kafka 4.0 removed nothing tally sends.
//!
//! The message bodies are the `kafka-protocol` crate's, generated from Kafka's own schemas:
//! requests are encoded into a [`Writer`] after the request header, responses decoded from the
//! bytes after the response header, and mapped to the few fields tally reads. A `Fetch`
//! response is decoded from `bytes::Bytes` ([`FetchResponse`]), so that its record sets stay
//! slices of the response ([`FetchPartition::records`]); record batches themselves are read by
//! `crate::records`.

use bytes::Bytes;
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::offset_for_leader_epoch_request::{
    OffsetForLeaderPartition, OffsetForLeaderTopic,
};
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{
    self, ApiVersionsRequest, ApiVersionsResponse, BrokerId, FetchRequest, InitProducerIdRequest,
    InitProducerIdResponse, ListOffsetsRequest, ListOffsetsResponse, MetadataRequest,
    MetadataResponse, OffsetForLeaderEpochRequest, OffsetForLeaderEpochResponse, ProduceRequest,
    ProduceResponse, SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest,
    SaslHandshakeResponse, TopicName,
};
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, StrBytes};

use crate::wire::{Malformed, Writer};

mod fetch;

pub use fetch::{
    FetchLimits, FetchPartition, FetchPosition, FetchResponse, Isolation, fetch_request,
};

/// An API key and the versions of it tally implements.
#[derive(Debug, Clone, Copy)]
pub struct Api {
    /// Kafka's key for the API.
    pub key: i16,
    /// The oldest version tally implements.
    pub oldest: i16,
    /// The newest.
    pub newest: i16,
    /// The request header's version for each version of the API, from Kafka's schemas
    /// (2: flexible, with tagged fields; KIP-482).
    pub request_header: fn(i16) -> i16,
    /// The response header's: 1 ends in tagged fields (`ApiVersions` answers with 0 in every
    /// version, so that an old client can read it).
    pub response_header: fn(i16) -> i16,
    /// Its name, for errors.
    pub name: &'static str,
    /// What a response that does not decode is called in its error.
    pub response_name: &'static str,
}

impl Api {
    /// The newest version both tally and a broker with these `ranges` implement; the broker's
    /// range for this API when there is none in common (`None`: it has none at all).
    pub fn negotiate(self, ranges: &[ApiRange]) -> Result<i16, Option<ApiRange>> {
        let range = *ranges.iter().find(|r| r.key == self.key).ok_or(None)?;
        let newest = self.newest.min(range.max);
        if newest >= self.oldest.max(range.min) {
            Ok(newest)
        } else {
            Err(Some(range))
        }
    }

    /// Whether `version` of this API is flexible (compact encodings, tagged fields).
    pub fn is_flexible(self, version: i16) -> bool {
        (self.request_header)(version) >= 2
    }
}

/// `Produce` v8.
pub const PRODUCE: Api = Api {
    key: 0,
    oldest: 8,
    newest: 8,
    request_header: <ProduceRequest as HeaderVersion>::header_version,
    response_header: <ProduceResponse as HeaderVersion>::header_version,
    name: "Produce",
    response_name: "a Produce response of the version asked for",
};
/// `InitProducerId` v1.
pub const INIT_PRODUCER_ID: Api = Api {
    key: 22,
    oldest: 1,
    newest: 1,
    request_header: <InitProducerIdRequest as HeaderVersion>::header_version,
    response_header: <InitProducerIdResponse as HeaderVersion>::header_version,
    name: "InitProducerId",
    response_name: "an InitProducerId response of the version asked for",
};
/// `Fetch` v11 and v12 (flexible, with the partition's last fetched epoch and the broker's
/// diverging epoch).
pub const FETCH: Api = Api {
    key: 1,
    oldest: 11,
    newest: 12,
    request_header: <FetchRequest as HeaderVersion>::header_version,
    response_header: <messages::FetchResponse as HeaderVersion>::header_version,
    name: "Fetch",
    response_name: "a Fetch response of the version asked for",
};
/// `ListOffsets` v2.
pub const LIST_OFFSETS: Api = Api {
    key: 2,
    oldest: 2,
    newest: 2,
    request_header: <ListOffsetsRequest as HeaderVersion>::header_version,
    response_header: <ListOffsetsResponse as HeaderVersion>::header_version,
    name: "ListOffsets",
    response_name: "a ListOffsets response of the version asked for",
};
/// `OffsetForLeaderEpoch` v3 (the first with a replica id, so a consumer's request is told
/// from a follower's; Kafka 2.3 on).
pub const OFFSET_FOR_LEADER_EPOCH: Api = Api {
    key: 23,
    oldest: 3,
    newest: 3,
    request_header: <OffsetForLeaderEpochRequest as HeaderVersion>::header_version,
    response_header: <OffsetForLeaderEpochResponse as HeaderVersion>::header_version,
    name: "OffsetForLeaderEpoch",
    response_name: "an OffsetForLeaderEpoch response of the version asked for",
};
/// `Metadata` v7.
pub const METADATA: Api = Api {
    key: 3,
    oldest: 7,
    newest: 7,
    request_header: <MetadataRequest as HeaderVersion>::header_version,
    response_header: <MetadataResponse as HeaderVersion>::header_version,
    name: "Metadata",
    response_name: "a Metadata response of the version asked for",
};
/// `SaslHandshake` v1.
pub const SASL_HANDSHAKE: Api = Api {
    key: 17,
    oldest: 1,
    newest: 1,
    request_header: <SaslHandshakeRequest as HeaderVersion>::header_version,
    response_header: <SaslHandshakeResponse as HeaderVersion>::header_version,
    name: "SaslHandshake",
    response_name: "a SaslHandshake response of the version asked for",
};
/// `ApiVersions` v0: what every broker answers, whatever it implements.
pub const API_VERSIONS: Api = Api {
    key: 18,
    oldest: 0,
    newest: 0,
    request_header: <ApiVersionsRequest as HeaderVersion>::header_version,
    response_header: <ApiVersionsResponse as HeaderVersion>::header_version,
    name: "ApiVersions",
    response_name: "a ApiVersions response of the version asked for",
};
/// `SaslAuthenticate` v1.
pub const SASL_AUTHENTICATE: Api = Api {
    key: 36,
    oldest: 1,
    newest: 1,
    request_header: <SaslAuthenticateRequest as HeaderVersion>::header_version,
    response_header: <SaslAuthenticateResponse as HeaderVersion>::header_version,
    name: "SaslAuthenticate",
    response_name: "a SaslAuthenticate response of the version asked for",
};

/// A Kafka error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub i16);

impl ErrorCode {
    /// No error.
    pub const NONE: Self = Self(0);
    /// The offset is before the log's start or after its end.
    pub const OFFSET_OUT_OF_RANGE: Self = Self(1);
    /// The broker does not know the topic or partition (yet).
    pub const UNKNOWN_TOPIC_OR_PARTITION: Self = Self(3);
    /// The partition has no leader right now.
    pub const LEADER_NOT_AVAILABLE: Self = Self(5);
    /// This broker no longer leads the partition.
    pub const NOT_LEADER_OR_FOLLOWER: Self = Self(6);
    /// The topic may not be read with these credentials.
    pub const TOPIC_AUTHORIZATION_FAILED: Self = Self(29);
    /// The mechanism is not enabled on the broker.
    pub const UNSUPPORTED_SASL_MECHANISM: Self = Self(33);
    /// The credentials were refused.
    pub const SASL_AUTHENTICATION_FAILED: Self = Self(58);
    /// The request's leader epoch is older than the broker's.
    pub const FENCED_LEADER_EPOCH: Self = Self(74);
    /// The request's leader epoch is newer than the broker's.
    pub const UNKNOWN_LEADER_EPOCH: Self = Self(75);
    /// The offset is not available yet (a new leader catching up).
    pub const OFFSET_NOT_AVAILABLE: Self = Self(78);

    /// The batch was already written (a retry the broker recognised): a success.
    pub const DUPLICATE_SEQUENCE_NUMBER: Self = Self(46);

    /// Whether a produce that failed with this may be sent again, unchanged: the idempotent
    /// producer's sequence numbers make a retry of a batch that did land a duplicate the broker
    /// recognises.
    pub fn is_retriable_produce(self) -> bool {
        self.is_stale_leadership()
            // REQUEST_TIMED_OUT, NETWORK_EXCEPTION, NOT_ENOUGH_REPLICAS(_AFTER_APPEND),
            // COORDINATOR_LOAD_IN_PROGRESS, CONCURRENT_TRANSACTIONS, THROTTLING_QUOTA_EXCEEDED
            || matches!(self.0, 7 | 13 | 19 | 20 | 14 | 51 | 89)
    }

    /// Whether this is an error.
    pub fn is_error(self) -> bool {
        self != Self::NONE
    }

    /// Whether the partition's leadership moved or is moving: ask the metadata again.
    pub fn is_stale_leadership(self) -> bool {
        matches!(
            self,
            Self::UNKNOWN_TOPIC_OR_PARTITION
                | Self::LEADER_NOT_AVAILABLE
                | Self::NOT_LEADER_OR_FOLLOWER
                | Self::FENCED_LEADER_EPOCH
                | Self::UNKNOWN_LEADER_EPOCH
                | Self::OFFSET_NOT_AVAILABLE
                // REPLICA_NOT_AVAILABLE, KAFKA_STORAGE_ERROR
                | Self(9)
                | Self(56)
        )
    }

    /// Kafka's name for the code, where tally knows it.
    pub fn name(self) -> &'static str {
        match self.0 {
            -1 => "UNKNOWN_SERVER_ERROR",
            0 => "NONE",
            1 => "OFFSET_OUT_OF_RANGE",
            3 => "UNKNOWN_TOPIC_OR_PARTITION",
            5 => "LEADER_NOT_AVAILABLE",
            6 => "NOT_LEADER_OR_FOLLOWER",
            7 => "REQUEST_TIMED_OUT",
            9 => "REPLICA_NOT_AVAILABLE",
            13 => "NETWORK_EXCEPTION",
            29 => "TOPIC_AUTHORIZATION_FAILED",
            31 => "CLUSTER_AUTHORIZATION_FAILED",
            33 => "UNSUPPORTED_SASL_MECHANISM",
            34 => "ILLEGAL_SASL_STATE",
            35 => "UNSUPPORTED_VERSION",
            56 => "KAFKA_STORAGE_ERROR",
            19 => "NOT_ENOUGH_REPLICAS",
            20 => "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
            10 => "MESSAGE_TOO_LARGE",
            45 => "OUT_OF_ORDER_SEQUENCE_NUMBER",
            46 => "DUPLICATE_SEQUENCE_NUMBER",
            47 => "INVALID_PRODUCER_EPOCH",
            58 => "SASL_AUTHENTICATION_FAILED",
            59 => "UNKNOWN_PRODUCER_ID",
            87 => "INVALID_RECORD",
            74 => "FENCED_LEADER_EPOCH",
            75 => "UNKNOWN_LEADER_EPOCH",
            78 => "OFFSET_NOT_AVAILABLE",
            _ => "an error code tally does not name",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// A request's header: its API and version, a correlation id, the client's id (v1), and for a
/// flexible version no tagged fields (v2).
pub fn request_header(api: Api, version: i16, correlation_id: i32, client_id: &str) -> Writer {
    let mut w = Writer::default();
    // Room for the size prefix, filled in by the connection.
    w.i32(0)
        .i16(api.key)
        .i16(version)
        .i32(correlation_id)
        .string(client_id);
    if api.is_flexible(version) {
        // No tagged fields.
        w.uvarint(0);
    }
    w
}

/// The versions a broker supports of one API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiRange {
    /// The API's key.
    pub key: i16,
    /// The oldest version supported.
    pub min: i16,
    /// The newest.
    pub max: i16,
}

/// `ApiVersions` response: the version range the broker supports for each API key.
pub fn parse_api_versions(body: &[u8]) -> Result<(ErrorCode, Vec<ApiRange>), Malformed> {
    let r: ApiVersionsResponse = decode(body, API_VERSIONS, 0)?;
    let ranges = (r.api_keys.iter())
        .map(|k| ApiRange {
            key: k.api_key,
            min: k.min_version,
            max: k.max_version,
        })
        .collect();
    Ok((ErrorCode(r.error_code), ranges))
}

/// A broker, as metadata describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddress {
    /// Its node id.
    pub node_id: i32,
    /// Its advertised host.
    pub host: String,
    /// Its advertised port.
    pub port: i32,
}

/// A partition, as metadata describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionMetadata {
    /// Its index.
    pub partition: i32,
    /// An error for this partition (e.g. no leader right now).
    pub error: ErrorCode,
    /// The node id of its leader, or -1.
    pub leader: i32,
    /// The leader's epoch.
    pub leader_epoch: i32,
}

/// The metadata of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    /// Every broker.
    pub brokers: Vec<BrokerAddress>,
    /// The topic's error (e.g. unknown, not authorized).
    pub topic_error: ErrorCode,
    /// Its partitions, in the order the broker sent them.
    pub partitions: Vec<PartitionMetadata>,
}

/// `Metadata` request for one topic; `create` lets a broker with `auto.create.topics.enable`
/// create it (as a librdkafka producer does; a consumer never creates).
pub fn metadata_request(w: &mut Writer, topic: &str, create: bool) {
    let topic = MetadataRequestTopic::default().with_name(Some(topic_name(topic)));
    let request = MetadataRequest::default()
        .with_topics(Some(vec![topic]))
        .with_allow_auto_topic_creation(create);
    encode(w, &request, METADATA.newest);
}

/// `Metadata` response for the topic asked for.
pub fn parse_metadata(body: &[u8], topic: &str) -> Result<Metadata, Malformed> {
    let r: MetadataResponse = decode(body, METADATA, METADATA.newest)?;
    let found = (r.topics.iter())
        .find(|t| t.name.as_ref().is_some_and(|n| n.as_str() == topic))
        .ok_or(Malformed {
            at: body.len(),
            what: "the topic asked for",
        })?;
    Ok(Metadata {
        brokers: (r.brokers.iter())
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

/// Which end of a log `ListOffsets` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogEnd {
    /// The first offset still in the log.
    Earliest,
    /// The next offset to be written (the last stable offset for a read_committed reader).
    Latest,
}

/// `ListOffsets` request (read_committed) for `partitions` of `topic`.
pub fn list_offsets_request(w: &mut Writer, topic: &str, partitions: &[i32], end: LogEnd) {
    let timestamp = match end {
        LogEnd::Earliest => -2,
        LogEnd::Latest => -1,
    };
    let partitions = (partitions.iter())
        .map(|&p| {
            ListOffsetsPartition::default()
                .with_partition_index(p)
                .with_timestamp(timestamp)
        })
        .collect();
    let request = ListOffsetsRequest::default()
        .with_replica_id(BrokerId(-1))
        .with_isolation_level(1)
        .with_topics(vec![
            ListOffsetsTopic::default()
                .with_name(topic_name(topic))
                .with_partitions(partitions),
        ]);
    encode(w, &request, LIST_OFFSETS.newest);
}

/// `ListOffsets` response: `(partition, error, offset)` for each partition.
pub fn parse_list_offsets(body: &[u8]) -> Result<Vec<(i32, ErrorCode, i64)>, Malformed> {
    let r: ListOffsetsResponse = decode(body, LIST_OFFSETS, LIST_OFFSETS.newest)?;
    Ok((r.topics.iter())
        .flat_map(|t| &t.partitions)
        .map(|p| (p.partition_index, ErrorCode(p.error_code), p.offset))
        .collect())
}

/// A partition whose position is checked against its leader's log (KIP-320): the partition's
/// leader epoch as the client knows it, and the epoch of the last record it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochQuery {
    /// Its index.
    pub partition: i32,
    /// Its leader's epoch, as metadata said: a leader of another epoch refuses the question.
    pub current_leader_epoch: i32,
    /// The epoch whose end is asked for.
    pub leader_epoch: i32,
}

/// One partition's answer to an `OffsetForLeaderEpoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochEnd {
    /// Its index.
    pub partition: i32,
    /// Its error.
    pub error: ErrorCode,
    /// The largest epoch of the leader's log not past the one asked about (-1: none).
    pub leader_epoch: i32,
    /// Where that epoch ends in the leader's log (-1: unknown): a reader past it read records
    /// the log no longer holds.
    pub end_offset: i64,
}

/// `OffsetForLeaderEpoch` request (as a consumer, replica id -1) for `queries` of `topic`.
pub fn offset_for_leader_epoch_request(w: &mut Writer, topic: &str, queries: &[EpochQuery]) {
    let partitions = (queries.iter())
        .map(|q| {
            OffsetForLeaderPartition::default()
                .with_partition(q.partition)
                .with_current_leader_epoch(q.current_leader_epoch)
                .with_leader_epoch(q.leader_epoch)
        })
        .collect();
    let request = OffsetForLeaderEpochRequest::default()
        .with_replica_id(BrokerId(-1))
        .with_topics(vec![
            OffsetForLeaderTopic::default()
                .with_topic(topic_name(topic))
                .with_partitions(partitions),
        ]);
    encode(w, &request, OFFSET_FOR_LEADER_EPOCH.newest);
}

/// `OffsetForLeaderEpoch` response: every partition's answer.
pub fn parse_offset_for_leader_epoch(body: &[u8]) -> Result<Vec<EpochEnd>, Malformed> {
    let api = OFFSET_FOR_LEADER_EPOCH;
    let r: OffsetForLeaderEpochResponse = decode(body, api, api.newest)?;
    Ok((r.topics.iter())
        .flat_map(|t| &t.partitions)
        .map(|p| EpochEnd {
            partition: p.partition,
            error: ErrorCode(p.error_code),
            leader_epoch: p.leader_epoch,
            end_offset: p.end_offset,
        })
        .collect())
}

/// `InitProducerId` request for an idempotent producer (no transactional id).
pub fn init_producer_id_request(w: &mut Writer) {
    let request = InitProducerIdRequest::default()
        .with_transactional_id(None)
        .with_transaction_timeout_ms(60_000);
    encode(w, &request, INIT_PRODUCER_ID.newest);
}

/// `InitProducerId` response: its error, the producer id and its epoch.
pub fn parse_init_producer_id(body: &[u8]) -> Result<(ErrorCode, i64, i16), Malformed> {
    let r: InitProducerIdResponse = decode(body, INIT_PRODUCER_ID, INIT_PRODUCER_ID.newest)?;
    Ok((ErrorCode(r.error_code), r.producer_id.0, r.producer_epoch))
}

/// `Produce` request (`acks = all`, no transactional id): one record batch for each
/// `(partition, batch)` of `topic`.
pub fn produce_request(w: &mut Writer, topic: &str, timeout_ms: i32, batches: &[(i32, &[u8])]) {
    let partitions = (batches.iter())
        .map(|(partition, batch)| {
            PartitionProduceData::default()
                .with_index(*partition)
                .with_records(Some(Bytes::copy_from_slice(batch)))
        })
        .collect();
    let request = ProduceRequest::default()
        .with_transactional_id(None)
        .with_acks(-1)
        .with_timeout_ms(timeout_ms)
        .with_topic_data(vec![
            TopicProduceData::default()
                .with_name(topic_name(topic))
                .with_partition_data(partitions),
        ]);
    encode(w, &request, PRODUCE.newest);
}

/// One partition's answer to a `Produce`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducePartition {
    /// Its index.
    pub partition: i32,
    /// Its error.
    pub error: ErrorCode,
    /// The offset of the batch's first record.
    pub base_offset: i64,
    /// The broker's message, if any.
    pub message: Option<String>,
}

/// `Produce` response: every partition of `topic`.
pub fn parse_produce(body: &[u8], topic: &str) -> Result<Vec<ProducePartition>, Malformed> {
    let r: ProduceResponse = decode(body, PRODUCE, PRODUCE.newest)?;
    Ok((r.responses.iter())
        .filter(|t| t.name.as_str() == topic)
        .flat_map(|t| &t.partition_responses)
        .map(|p| {
            let batch_message =
                (p.record_errors.iter()).find_map(|e| e.batch_index_error_message.as_ref());
            ProducePartition {
                partition: p.index,
                error: ErrorCode(p.error_code),
                base_offset: p.base_offset,
                message: (p.error_message.as_ref())
                    .or(batch_message)
                    .map(ToString::to_string),
            }
        })
        .collect())
}

/// `SaslHandshake` request.
pub fn sasl_handshake_request(w: &mut Writer, mechanism: &str) {
    let request =
        SaslHandshakeRequest::default().with_mechanism(StrBytes::from_string(mechanism.to_owned()));
    encode(w, &request, SASL_HANDSHAKE.newest);
}

/// `SaslHandshake` response: its error and the broker's enabled mechanisms.
pub fn parse_sasl_handshake(body: &[u8]) -> Result<(ErrorCode, Vec<String>), Malformed> {
    let r: SaslHandshakeResponse = decode(body, SASL_HANDSHAKE, SASL_HANDSHAKE.newest)?;
    let mechanisms = r.mechanisms.iter().map(ToString::to_string).collect();
    Ok((ErrorCode(r.error_code), mechanisms))
}

/// `SaslAuthenticate` request.
pub fn sasl_authenticate_request(w: &mut Writer, auth_bytes: &[u8]) {
    let request =
        SaslAuthenticateRequest::default().with_auth_bytes(Bytes::copy_from_slice(auth_bytes));
    encode(w, &request, SASL_AUTHENTICATE.newest);
}

/// `SaslAuthenticate` response: its error, the broker's message, and its bytes.
pub fn parse_sasl_authenticate(
    body: &[u8],
) -> Result<(ErrorCode, Option<String>, Vec<u8>), Malformed> {
    let r: SaslAuthenticateResponse = decode(body, SASL_AUTHENTICATE, SASL_AUTHENTICATE.newest)?;
    let message = r.error_message.as_ref().map(ToString::to_string);
    Ok((ErrorCode(r.error_code), message, r.auth_bytes.to_vec()))
}

/// A topic's name as kafka-protocol takes it.
fn topic_name(topic: &str) -> TopicName {
    TopicName(StrBytes::from_string(topic.to_owned()))
}

/// Appends `message` in `version` to a request. Every field tally sets exists in every
/// version it speaks (the tests build each), so encoding cannot fail.
fn encode(w: &mut Writer, message: &impl Encodable, version: i16) {
    message
        .encode(&mut w.buf, version)
        .expect("every field tally sets exists in the version it speaks");
}

/// `api`'s response in `version`, from a body that must hold nothing more.
fn decode<M: Decodable>(body: &[u8], api: Api, version: i16) -> Result<M, Malformed> {
    decode_bytes(&mut Bytes::copy_from_slice(body), api, version)
}

/// The same from a `Bytes`, whose byte and record fields the decoded message shares.
fn decode_bytes<M: Decodable>(body: &mut Bytes, api: Api, version: i16) -> Result<M, Malformed> {
    let undecodable = Malformed {
        at: 0,
        what: api.response_name,
    };
    let message = M::decode(body, version).map_err(|_| undecodable.clone())?;
    if !body.is_empty() {
        return Err(undecodable);
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kafka-protocol's defaults are not always the wire's nulls (an empty transactional id is
    /// an invalid request): every request tally sends, laid out field by field.
    #[test]
    fn every_request_lays_out_as_its_version_says() {
        let built = |f: &dyn Fn(&mut Writer)| {
            let mut w = Writer::default();
            f(&mut w);
            w.buf
        };
        let expected = |f: &dyn Fn(&mut Writer)| built(f);
        assert_eq!(
            built(&|w| init_producer_id_request(w)),
            expected(&|w| {
                w.nullable_string(None).i32(60_000);
            })
        );
        assert_eq!(
            built(&|w| produce_request(w, "t", 5_000, &[(2, b"batch")])),
            expected(&|w| {
                w.nullable_string(None).i16(-1).i32(5_000);
                w.array_len(1)
                    .string("t")
                    .array_len(1)
                    .i32(2)
                    .bytes(b"batch");
            })
        );
        assert_eq!(
            built(&|w| metadata_request(w, "t", true)),
            expected(&|w| {
                w.array_len(1).string("t").bool(true);
            })
        );
        assert_eq!(
            built(&|w| list_offsets_request(w, "t", &[0, 3], LogEnd::Earliest)),
            expected(&|w| {
                w.i32(-1).i8(1).array_len(1).string("t").array_len(2);
                w.i32(0).i64(-2).i32(3).i64(-2);
            })
        );
        let query = EpochQuery {
            partition: 4,
            current_leader_epoch: 9,
            leader_epoch: 7,
        };
        assert_eq!(
            built(&|w| offset_for_leader_epoch_request(w, "t", &[query])),
            expected(&|w| {
                w.i32(-1).array_len(1).string("t").array_len(1);
                w.i32(4).i32(9).i32(7);
            })
        );
        assert_eq!(
            built(&|w| sasl_handshake_request(w, "PLAIN")),
            expected(&|w| {
                w.string("PLAIN");
            })
        );
        assert_eq!(
            built(&|w| sasl_authenticate_request(w, b"\0u\0p")),
            expected(&|w| {
                w.bytes(b"\0u\0p");
            })
        );
    }

    #[test]
    fn header_versions_come_from_kafkas_schemas() {
        assert!(!FETCH.is_flexible(11) && FETCH.is_flexible(12));
        assert_eq!(
            ((FETCH.response_header)(11), (FETCH.response_header)(12)),
            (0, 1)
        );
        // An ApiVersions answer keeps the classic header even in its flexible versions.
        assert!(API_VERSIONS.is_flexible(3));
        assert_eq!((API_VERSIONS.response_header)(3), 0);
    }

    #[test]
    fn metadata_finds_the_topic_and_its_leaders() {
        let mut w = Writer::default();
        w.i32(0).array_len(2);
        w.i32(1).string("a").i32(9092).nullable_string(None);
        w.i32(2).string("b").i32(9093).nullable_string(Some("r1"));
        w.nullable_string(Some("cluster")).i32(1).array_len(1);
        w.i16(0).string("t").bool(false).array_len(2);
        for (p, leader) in [(0, 2), (1, -1)] {
            w.i16(if leader < 0 { 5 } else { 0 })
                .i32(p)
                .i32(leader)
                .i32(3);
            w.array_len(1).i32(2).array_len(1).i32(2).array_len(0);
        }
        let m = parse_metadata(&w.buf, "t").expect("as written");
        assert_eq!(
            m.brokers[1],
            BrokerAddress {
                node_id: 2,
                host: "b".into(),
                port: 9093
            }
        );
        assert_eq!(m.partitions[0].leader, 2);
        assert_eq!(m.partitions[1].error, ErrorCode::LEADER_NOT_AVAILABLE);
        assert!(parse_metadata(&w.buf, "missing").is_err());
    }

    #[test]
    fn error_codes_name_themselves_and_classify_leadership() {
        assert_eq!(ErrorCode(6).to_string(), "NOT_LEADER_OR_FOLLOWER (6)");
        assert!(ErrorCode::NOT_LEADER_OR_FOLLOWER.is_stale_leadership());
        assert!(!ErrorCode::OFFSET_OUT_OF_RANGE.is_stale_leadership());
        assert!(!ErrorCode::NONE.is_error());
    }
}
