//! Decodes the same `Fetch` responses with tally-kafka's parser and with the kafka-protocol
//! crate (generated from Kafka's message schemas) and prints the time per response of each:
//! a broker's real answer (`kafka/tests/fixtures/kafka-<version>/fetch-v12.bin`), and a large
//! synthetic one (16 partitions of 4 MiB record sets, 64 aborted transactions each) whose
//! records neither parser copies.

mod mapped;

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use kafka_protocol::messages::FetchResponse;
use kafka_protocol::protocol::Decodable;
use tally_kafka::protocol::{FETCH, parse_fetch};
use tally_kafka::wire::Writer;

const VERSION: i16 = 12;

/// A flexible (v12) fetch response of `partitions` partitions of `topic`.
fn synthetic(topic: &str, partitions: i32, records: usize, aborted: usize) -> Vec<u8> {
    let mut w = Writer::default();
    w.i32(0)
        .i16(0)
        .i32(0)
        .compact_array_len(1)
        .compact_string(topic);
    w.compact_array_len(partitions as usize);
    let set = vec![7u8; records];
    for p in 0..partitions {
        w.i32(p).i16(0).i64(1 << 40).i64(1 << 40).i64(0);
        w.compact_array_len(aborted);
        for a in 0..aborted {
            w.i64(a as i64).i64(a as i64 * 10).no_tagged_fields();
        }
        w.i32(-1).uvarint(records as u64 + 1);
        w.buf.extend_from_slice(&set);
        w.no_tagged_fields();
    }
    w.no_tagged_fields().no_tagged_fields();
    w.buf
}

/// Nanoseconds per call of `f`, the best of 5 rounds of `n`.
fn time(n: u32, mut f: impl FnMut() -> usize) -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..n {
                black_box(f());
            }
            start.elapsed().as_nanos() as f64 / f64::from(n)
        })
        .fold(f64::INFINITY, f64::min)
}

fn compare(name: &str, topic: &str, body: &[u8], n: u32) {
    let ours = time(n, || {
        let (_, parts) = parse_fetch(black_box(body), VERSION, topic).expect("tally parses it");
        parts.iter().map(|p| p.records.len()).sum()
    });
    let shared = Bytes::copy_from_slice(body);
    let theirs = time(n, || {
        let mut buf = shared.clone();
        let response = FetchResponse::decode(&mut buf, VERSION).expect("kafka-protocol decodes it");
        (response.responses.iter())
            .flat_map(|t| &t.partitions)
            .map(|p| p.records.as_ref().map_or(0, |r| r.len()))
            .sum()
    });
    println!(
        "{name}: {} bytes; tally-kafka {ours:.0} ns, kafka-protocol {theirs:.0} ns per response ({:.2}x)",
        body.len(),
        theirs / ours
    );
}

/// The hand-written and the mapped code agree on every captured answer, and build the same
/// request bytes.
fn same_reading(dir: &Path, topic: &str) {
    use tally_kafka::protocol::{FetchPosition, Isolation, parse_metadata};
    let metadata = std::fs::read(dir.join("metadata.bin")).expect("metadata.bin");
    assert_eq!(
        parse_metadata(&metadata, topic).expect("tally parses it"),
        mapped::parse_metadata(&metadata, topic).expect("kafka-protocol decodes it"),
    );
    for version in FETCH.oldest..=FETCH.newest {
        let body = std::fs::read(dir.join(format!("fetch-v{version}.bin"))).expect("a fetch");
        let (error, ours) = parse_fetch(&body, version, topic).expect("tally parses it");
        let decoded =
            mapped::decode_fetch(&mut Bytes::from(body.clone()), version).expect("decodes");
        let (their_error, theirs) = mapped::fetch_parts(&decoded, topic);
        assert_eq!(error, their_error);
        let ours: Vec<_> = (ours.iter())
            .map(|p| {
                (
                    p.partition,
                    p.high_watermark,
                    p.last_stable_offset,
                    p.log_start_offset,
                    p.aborted.clone(),
                    p.diverging,
                    p.records,
                )
            })
            .collect();
        let theirs: Vec<_> = (theirs.iter())
            .map(|p| {
                (
                    p.partition,
                    p.high_watermark,
                    p.last_stable_offset,
                    p.log_start_offset,
                    p.aborted.clone(),
                    p.diverging,
                    p.records,
                )
            })
            .collect();
        assert_eq!(ours, theirs, "{} v{version}", dir.display());
        let position = FetchPosition {
            partition: 3,
            offset: 42,
            current_leader_epoch: 8,
            last_fetched_epoch: 9,
        };
        let limits = tally_kafka::config::DEFAULT_LIMITS;
        let mut w = tally_kafka::wire::Writer::default();
        tally_kafka::protocol::fetch_request(
            &mut w,
            version,
            topic,
            &[position],
            limits,
            Isolation::ReadCommitted,
        );
        let built = mapped::fetch_request(
            version,
            topic,
            &[position],
            limits,
            Isolation::ReadCommitted,
        )
        .expect("encodes");
        assert_eq!(w.buf, built.to_vec(), "the v{version} request");
    }
}

fn main() {
    assert!(FETCH.newest >= VERSION);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kafka/tests/fixtures");
    let mut dirs: Vec<_> = std::fs::read_dir(&fixtures)
        .expect("the fixtures")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.join("fetch-v12.bin").exists())
        .collect();
    dirs.sort();
    for dir in dirs {
        let topic = std::fs::read_to_string(dir.join("topic.txt")).expect("topic.txt");
        let body = std::fs::read(dir.join("fetch-v12.bin")).expect("fetch-v12.bin");
        let name = dir
            .file_name()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        same_reading(&dir, topic.trim());
        compare(&name, topic.trim(), &body, 200_000);
    }
    let big = synthetic("tally.events", 16, 4 << 20, 64);
    compare("synthetic 16 x 4 MiB", "tally.events", &big, 2_000);
}
