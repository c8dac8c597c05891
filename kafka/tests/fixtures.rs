//! tally-kafka's parsers on bytes real brokers sent (`tests/fixtures/kafka-<version>/`, captured
//! by `tests/fixtures/capture.sh`): `ApiVersions`, `Metadata`, `ListOffsets` and a `Fetch` of a
//! partition holding one batch per codec written by librdkafka. Every record read back equals
//! what was written, in order, and every batch's CRC-32C checks out.

use std::path::{Path, PathBuf};

use tally_kafka::compression::decompress;
use tally_kafka::protocol::{
    self, ErrorCode, FetchResponse, Isolation, parse_api_versions, parse_list_offsets,
    parse_metadata,
};
use tally_kafka::records::{Compression, RawBatch, Records, batches, crc_mismatch};

/// Every captured broker version.
fn versions() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the fixtures directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no fixtures in {}", dir.display());
    found
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()))
}

fn text(dir: &Path, name: &str) -> String {
    String::from_utf8(read(dir, name)).expect("text")
}

#[test]
fn every_captured_response_parses_and_the_records_are_those_written() {
    for dir in versions() {
        let version = dir.display();
        let topic = text(&dir, "topic.txt").trim().to_owned();
        let written: Vec<String> = text(&dir, "messages.txt")
            .lines()
            .map(str::to_owned)
            .collect();

        // ApiVersions: tally and the broker share a version of every API tally sends, and
        // agree on the newest Fetch tally implements.
        let (error, ranges) = parse_api_versions(&read(&dir, "api_versions.bin")).expect("parses");
        assert_eq!(error, ErrorCode::NONE, "{version}");
        for api in [
            protocol::FETCH,
            protocol::METADATA,
            protocol::LIST_OFFSETS,
            protocol::PRODUCE,
            protocol::INIT_PRODUCER_ID,
            protocol::SASL_HANDSHAKE,
            protocol::SASL_AUTHENTICATE,
        ] {
            let agreed = api.negotiate(&ranges);
            assert!(agreed.is_ok(), "{version}: {} {agreed:?}", api.name);
        }
        assert_eq!(
            protocol::FETCH.negotiate(&ranges),
            Ok(protocol::FETCH.newest)
        );

        // Metadata: the topic's one partition, led by a broker the response lists.
        let metadata = parse_metadata(&read(&dir, "metadata.bin"), &topic).expect("parses");
        assert_eq!(metadata.topic_error, ErrorCode::NONE, "{version}");
        let [partition] = metadata.partitions.as_slice() else {
            panic!("{version}: one partition: {metadata:?}");
        };
        assert_eq!((partition.partition, partition.error), (0, ErrorCode::NONE));
        assert!(
            (metadata.brokers.iter()).any(|b| b.node_id == partition.leader),
            "{version}: the leader is a listed broker: {metadata:?}"
        );

        // ListOffsets: the log starts at 0 and ends after the records written.
        let end = written.len() as i64;
        for (name, expected) in [
            ("list_offsets_earliest.bin", 0),
            ("list_offsets_latest.bin", end),
        ] {
            let offsets = parse_list_offsets(&read(&dir, name)).expect("parses");
            assert_eq!(
                offsets,
                [(0, ErrorCode::NONE, expected)],
                "{version} {name}"
            );
        }

        // Fetch, in every version tally implements: one batch per codec, each CRC right, the
        // records as written.
        for fetch_version in protocol::FETCH.oldest..=protocol::FETCH.newest {
            let fetch = read(&dir, &format!("fetch-v{fetch_version}.bin"));
            let version = format!("{version}, Fetch v{fetch_version}");
            let fetched = FetchResponse::decode(&mut bytes::Bytes::from(fetch), fetch_version)
                .expect("decodes");
            assert_eq!(fetched.throttle_time_ms(), 0, "{version}");
            let (error, parts) = (fetched.error(), fetched.partitions(&topic));
            assert_eq!(error, ErrorCode::NONE, "{version}");
            let [part] = parts.as_slice() else {
                panic!("{version}: one partition");
            };
            assert_eq!(part.error, ErrorCode::NONE);
            assert_eq!(part.log_end(Isolation::ReadCommitted), end);
            assert_eq!(part.high_watermark, end);
            let mut codecs = Vec::new();
            let mut read_back = Vec::new();
            for batch in batches(part.records) {
                let Ok(RawBatch::V2 {
                    header,
                    records,
                    covered,
                }) = batch
                else {
                    panic!("{version}: v2 batches only: {batch:?}");
                };
                assert_eq!(
                    crc_mismatch(&header, covered),
                    None,
                    "{version}: CRC of {header:?}"
                );
                codecs.push(header.compression());
                let mut plain = Vec::new();
                let section = match header.compression() {
                    Compression::None => records,
                    codec => {
                        decompress(codec, records, &mut plain).expect("decompresses");
                        &plain
                    }
                };
                for record in Records::new(header, section) {
                    let record = record.expect("a record");
                    let value = std::str::from_utf8(record.value.expect("a value")).expect("UTF-8");
                    read_back.push((record.offset, value.to_owned()));
                }
            }
            assert_eq!(
                codecs,
                [
                    Compression::None,
                    Compression::Gzip,
                    Compression::Snappy,
                    Compression::Lz4,
                    Compression::Zstd
                ],
                "{version}"
            );
            let expected: Vec<(i64, String)> = (0..).zip(written.iter().cloned()).collect();
            assert_eq!(read_back, expected, "{version}");
        }
    }
}
