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

/// Runs `tally dead-letters <args>` against `setup`'s dead-letter topic; returns its exit
/// status and standard output.
fn dead_letters(
    setup: &AggregatorSetup,
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new(tally_tests::binary("tally"))
        .arg("dead-letters")
        .args(args)
        .args(["--brokers", &setup.brokers])
        .args(["--dead-letter-topic", &setup.dead_letter_topic])
        .envs(env.iter().copied())
        .output()
        .expect("tally dead-letters runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "tally dead-letters {args:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, stdout)
}

/// The number before `label` on the last line of `stdout` that holds it.
fn count(stdout: &str, label: &str) -> usize {
    let line = (stdout.lines().rev())
        .find(|l| l.contains(label))
        .unwrap_or_else(|| panic!("{label:?} in {stdout}"));
    let before = &line[..line.find(label).expect("label")];
    let digits: String = before
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .chars()
        .rev()
        .collect::<String>()
        .parse()
        .expect("a number")
}

/// A key under tally's prefix written by someone else refuses the deltas of its counter, which
/// are dead-lettered (`not_an_integer`). Once the key is repaired, `tally dead-letters replay`
/// puts them back on the events topic, each exactly once, though the first replay is killed in
/// the middle of its second transaction and the command is run again; a third run replays
/// nothing. The malformed message the filter leaves out is not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_deltas_are_replayed_once_the_key_is_repaired() {
    let dir = TempDir::new("tally-replay");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("replay", &redis.url(), 2).await;
    let mut aggregator = setup.spawn(dir.path(), &[]);
    let ks = setup.keyspace();
    let mut conn = tally_tests::connect(&redis.url()).await;
    let poisoned = ["views:poisoned:1", "views:poisoned:2", "views:poisoned:3"];
    for counter in poisoned {
        for group in 0..ks.groups() {
            redis::cmd("SET")
                .arg(ks.counter_key(group, counter))
                .arg("not a number")
                .exec_async(&mut conn)
                .await
                .expect("SET");
        }
    }

    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", tally_tests::brokers())
        .create()
        .expect("plain producer");
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut deliveries = Vec::new();
    for i in 0..600i64 {
        let counter = if i % 4 == 0 {
            poisoned[(i / 4) as usize % 3].to_owned()
        } else {
            format!("views:fine:{}", i % 11)
        };
        let delta = i % 5 + 1;
        *expected.entry(counter.clone()).or_default() += delta;
        let payload = format!(r#"{{"counter":"{counter}","delta":{delta}}}"#);
        let record = FutureRecord::<String, String>::to(&setup.topic)
            .key(&counter)
            .payload(&payload);
        deliveries.push(tally_tests::enqueue_raw(&plain, record));
    }
    let junk = FutureRecord::<String, [u8]>::to(&setup.topic).payload(b"not json at all");
    deliveries.push(tally_tests::enqueue_raw(&plain, junk));
    tally_tests::assert_delivered(deliveries).await;
    tally_tests::wait_committed_to_end(&setup.group, &setup.topic, 2, Duration::from_secs(60))
        .await;

    let (status, all) = dead_letters(&setup, &["list"], &[]);
    assert!(status.success());
    let (status, refused) = dead_letters(&setup, &["list", "--reason", "not_an_integer"], &[]);
    assert!(status.success());
    let n = count(&refused, " dead letters");
    assert!(
        n >= 3,
        "at least one refused delta per poisoned counter: {refused}"
    );
    assert_eq!(
        count(&all, " dead letters"),
        n + 1,
        "and the malformed message"
    );
    assert!(refused.contains("views:poisoned:1"), "{refused}");

    // Repaired: the foreign keys are gone.
    for counter in poisoned {
        for group in 0..ks.groups() {
            redis::cmd("DEL")
                .arg(ks.counter_key(group, counter))
                .exec_async(&mut conn)
                .await
                .expect("DEL");
        }
    }
    let replay = ["replay", "--reason", "not_an_integer", "--chunk", "1"];
    // Killed in its second transaction: the first one's letter is replayed, the second's not.
    let abort = [("TALLY_FAILPOINT_REPLAY_ABORT_AFTER", "2")];
    let (status, _) = dead_letters(&setup, &replay, &abort);
    assert!(!status.success(), "the failpoint aborted the replay");
    let (status, out) = dead_letters(&setup, &replay, &[]);
    assert!(status.success());
    assert_eq!(count(&out, "; passed over"), n - 1, "the rest replayed");
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    let (status, out) = dead_letters(&setup, &replay, &[]);
    assert!(status.success());
    assert!(out.starts_with("replayed 0;"), "{out}");

    // Nothing counted twice: the aggregator read each replayed event once (the aborted
    // transaction's is never read), and the totals are still exact.
    let consumed = (601 + n) as f64;
    let read = aggregator
        .wait_metric(
            "tally_events_consumed_total",
            consumed,
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(
        read, consumed,
        "events read: the originals, then each replay once"
    );
    for (counter, want) in &expected {
        assert_eq!(reader.get(counter).await.expect("read"), *want, "{counter}");
    }
    aggregator.stop_gracefully().await;
}
