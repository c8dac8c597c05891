//! End to end: JSON events written by a plain Kafka client (as kcat or another language would),
//! mixed with malformed messages. Valid totals are exact, each malformed message lands in the
//! dead-letter topic with its reason, the metric counts them, and offsets move past them.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, assert_committed_to_end, read_dead_letters,
    wait_for_totals,
};

/// Malformed payloads and the reason the aggregator must give for each.
fn malformed() -> Vec<(Vec<u8>, &'static str)> {
    vec![
        (b"not json at all".to_vec(), "undecodable"),
        (b"{\"counter\": \"likes:post:1\"".to_vec(), "undecodable"),
        (
            br#"{"counter":"likes:post:1","detla":5}"#.to_vec(),
            "undecodable",
        ),
        (br#"{"delta":5}"#.to_vec(), "undecodable"),
        (vec![0xB1, 0xFF, 0xFF, 0xFF], "undecodable"),
        (vec![0xB7, 1, 2, 3], "undecodable"),
        (Vec::new(), "undecodable"),
        (
            br#"{"counter":"likes:{post}:1"}"#.to_vec(),
            "invalid_counter",
        ),
        (br#"{"counter":""}"#.to_vec(), "invalid_counter"),
        (
            br#"{"counter":"likes:post:1","delta":0}"#.to_vec(),
            "invalid_delta",
        ),
        (
            br#"{"counter":"likes:post:1","delta":-2000000000000}"#.to_vec(),
            "invalid_delta",
        ),
        (
            format!(
                r#"{{"counter":"likes:post:1","actor":"{}"}}"#,
                "a".repeat(20_000)
            )
            .into_bytes(),
            "oversized",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_events_count_and_malformed_ones_are_dead_lettered() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("json", &redis.url(), 4).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);

    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("plain producer");
    let bad = malformed();
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut sends = Vec::new();
    for i in 0..3_000i64 {
        let counter = format!("views:video:{}", i % 37);
        let (delta, payload) = match i % 3 {
            // delta omitted: it defaults to 1
            0 => (1, format!(r#"{{"counter":"{counter}"}}"#)),
            1 => {
                let delta = if i % 7 == 3 { 4 } else { i % 7 - 3 };
                let json = format!(r#"{{"counter":"{counter}","delta":{delta},"actor":"u{i}"}}"#);
                (delta, json)
            }
            // leading whitespace and an event time
            _ => (
                -2,
                format!(r#"  {{"counter":"{counter}","delta":-2,"ts_ms":1764460800000}}"#),
            ),
        };
        *expected.entry(counter.clone()).or_default() += delta;
        sends.push((Some(counter), payload.into_bytes()));
        if i % 250 == 0 {
            let (payload, _) = &bad[(i / 250) as usize % bad.len()];
            sends.push((None, payload.clone()));
        }
    }
    let bad_sent: Vec<&'static str> = (0..3_000)
        .step_by(250)
        .map(|i| bad[(i / 250) % bad.len()].1)
        .collect();
    let mut deliveries = Vec::new();
    for (key, payload) in &sends {
        let mut record = FutureRecord::<String, Vec<u8>>::to(&setup.topic).payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        deliveries.push(tally_tests::enqueue_raw(&plain, record));
    }
    tally_tests::assert_delivered(deliveries).await;

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    let dead = aggregator
        .wait_metric(
            "tally_events_dead_lettered_total",
            bad_sent.len() as f64,
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(dead, bad_sent.len() as f64);

    // Read the dead-letter topic back: one copy per malformed message, with its reason.
    let letters = read_dead_letters(&setup.dead_letter_topic, bad_sent.len());
    for letter in &letters {
        assert!(!letter.error.is_empty(), "tally-error header");
        assert!(bad.iter().any(|(p, _)| *p == letter.payload), "{letter:?}");
    }
    let mut reasons: Vec<String> = letters.into_iter().map(|l| l.reason).collect();
    let mut want: Vec<String> = bad_sent.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    reasons.sort();
    assert_eq!(reasons, want);

    aggregator.stop_gracefully().await;
    assert_committed_to_end(&setup.group, &setup.topic, 4);
}
