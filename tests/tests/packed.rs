//! Packing a live deployment's shares into small hashes (`tally pack`), under load, on a
//! standalone Redis and on a 3-master Redis Cluster: two aggregators in one consumer group (on
//! the standalone server, one writing through the flush script and one through
//! `WATCH`/`MULTI`/`EXEC` transactions) count a paced storm of 100,000 increments and resets
//! over 300 counters. Mid-stream, `tally pack --buckets 64` has readers sum the packed fields,
//! marks every group, and moves the keys written so far into their fields; then both
//! aggregators are SIGKILLed and started again, so that new incarnations, knowing nothing of
//! the marks, learn them from their writes' answers. The groups then grow to 32 (the new ones
//! keep keys until a second `tally pack` marks them) and shrink back to 16 (the retired groups'
//! fields go back into keys, which the fold moves) under a second storm of 200,000 increments
//! and resets over 500 other counters. In the end every total is exact (what was
//! sent after its counter's last reset: resets clear the packed fields too), no counter key is
//! left (every write after a group's mark packed, in both paths), `tally audit` finds no drift,
//! a second run moves nothing, and another bucket count is refused.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tally_common::{Keyspace, Reader};
use tally_tests::{
    AggregatorSetup, RedisCluster, RedisServer, TempDir, assert_no_crossslot, binary, connect,
    end_offsets, eventually, seed, send_with_resets, unique, wait_for_totals,
};

const PARTITIONS: i32 = 8;

/// `tally pack --buckets <buckets>` over the test's deployment: whether it succeeded, and what
/// it printed.
fn pack(redis_url: &str, prefix: &str, buckets: u32) -> (bool, String) {
    tally(
        &["pack", "--buckets", &buckets.to_string()],
        redis_url,
        prefix,
    )
}

/// `tally <args>` over the test's deployment: whether it succeeded, and what it printed.
fn tally(args: &[&str], redis_url: &str, prefix: &str) -> (bool, String) {
    let out = Command::new(binary("tally"))
        .args(args)
        .args(["--redis-url", redis_url, "--key-prefix", prefix])
        .output()
        .expect("tally runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The number `tally pack` printed after `moved `.
fn moved(text: &str) -> u64 {
    let at = text
        .find("moved ")
        .unwrap_or_else(|| panic!("moved in {text}"));
    let digits: String = (text[at + 6..].chars())
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect("a number")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packing_a_live_deployment_under_load_and_sigkills_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let redis = RedisServer::start().await;
    let reader = |keyspace| redis.reader(keyspace);
    let transactions = ["--redis-atomicity", "transactions"];
    pack_under_load(
        "packed",
        &redis.url(),
        &[redis.url()],
        reader,
        &transactions,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packing_a_live_deployment_on_a_redis_cluster_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let cluster = RedisCluster::start().await;
    let nodes: Vec<String> = (0..3).map(|i| cluster.node_url(i)).collect();
    let reader = |keyspace| cluster.reader(keyspace);
    pack_under_load("packed-cluster", &cluster.url(), &nodes, reader, &[]).await;
}

/// The scenario of the module on the Redis at `redis_url` (its masters at `nodes`), the second
/// aggregator with `second` flags.
async fn pack_under_load<R: Future<Output = Reader>>(
    name: &str,
    redis_url: &str,
    nodes: &[String],
    reader: impl Fn(Keyspace) -> R,
    second: &[&str],
) {
    let seed = seed();
    let dir = TempDir::new(&format!("tally-{name}"));
    let setup = AggregatorSetup::create(name, redis_url, PARTITIONS).await;
    let member = |name: &str| format!("group.instance.id={}", unique(name));
    let (one, two) = (member("first"), member("second"));
    let by_first = ["--kafka-option", &one];
    let by_second = [&["--kafka-option", two.as_str()], second].concat();
    let mut first = setup.spawn(dir.path(), &by_first);
    let mut other = setup.spawn(dir.path(), &by_second);
    let topic = setup.topic.clone();
    let never = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(send_with_resets(
        topic,
        100_000,
        ("views:video:", 300),
        seed,
        never,
    ));
    for aggregator in [&first, &other] {
        aggregator
            .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
            .await;
    }

    let (packed, text) = pack(redis_url, &setup.key_prefix, 64);
    eprintln!("{text}");
    assert!(packed, "tally pack: {text}");
    assert!(moved(&text) > 0, "keys written before the marks: {text}");
    assert!(
        !load.is_finished(),
        "the load ended before the pack: make it longer"
    );
    first.kill();
    other.kill();
    let first = setup.spawn(dir.path(), &by_first);
    let other = setup.spawn(dir.path(), &by_second);
    for aggregator in [&first, &other] {
        aggregator
            .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
            .await;
    }
    assert!(
        !load.is_finished(),
        "the load ended before the kills: make it longer"
    );

    let (mut truth, resets) = load.await.expect("load task");
    eprintln!("{} counters, {resets} resets", truth.len());

    // Grown to 32 groups, the new ones unmarked (keys) until a second pack marks them; then
    // shrunk back: the retired groups' fields go back into keys, which the fold moves, while
    // resets keep coming (a reset reaching a moved counter's groups on either side of its take
    // is neither undone nor undoes the move: `docs/guarantees.md`, "Resets").
    let never = Arc::new(AtomicBool::new(false));
    let topic = setup.topic.clone();
    let more = tokio::spawn(send_with_resets(
        topic,
        200_000,
        ("likes:post:", 500),
        seed ^ 1,
        never,
    ));
    let (grown, text) = tally(&["regroup", "--to", "32"], redis_url, &setup.key_prefix);
    assert!(grown, "tally regroup --to 32: {text}");
    let (packed, text) = pack(redis_url, &setup.key_prefix, 64);
    eprintln!("{text}");
    assert!(
        packed && text.contains("(16 marked now)"),
        "the grown groups marked: {text}"
    );
    let (shrunk, text) = tally(&["regroup", "--to", "16"], redis_url, &setup.key_prefix);
    eprintln!("{text}");
    assert!(shrunk, "tally regroup --to 16: {text}");
    assert!(
        text.contains("back into keys"),
        "the retired groups unpacked: {text}"
    );
    assert!(
        !more.is_finished(),
        "the second load ended before the shrink: make it longer"
    );
    let (more, resets) = more.await.expect("load task");
    eprintln!("{} more counters, {resets} more resets", more.len());
    truth.extend(more);

    // Durable to the log's end (the totals alone may pass through the expected values).
    let reader = reader(setup.keyspace()).await;
    let ends = end_offsets(&setup.topic, PARTITIONS).await;
    eventually(Duration::from_secs(90), "every partition durable", || {
        let (reader, topic, ends) = (&reader, &setup.topic, &ends);
        async move {
            let durable = reader.durable_offsets(topic, PARTITIONS).await.ok()?;
            let done = (durable.iter().zip(ends)).all(|(d, end)| d.is_some_and(|d| d >= *end));
            done.then_some(())
        }
    })
    .await;
    wait_for_totals(&reader, &truth, Duration::from_secs(60)).await;

    // Every share is a field once the keys the fold wrote are packed too (none is written
    // since the marks), and none is left in the retired groups.
    let (packed, text) = pack(redis_url, &setup.key_prefix, 64);
    assert!(packed, "tally pack: {text}");
    let (mut shares, mut hashes) = (Vec::new(), Vec::new());
    for node in nodes {
        let mut conn = connect(node).await;
        let keys = |kind: &str| format!("{}:{{g*}}:{kind}:*", setup.key_prefix);
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(keys("c"))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        shares.extend(found);
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(keys("p"))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        hashes.extend(found);
    }
    assert_eq!(shares, Vec::<String>::new(), "counter keys left");
    assert!(!hashes.is_empty(), "packed hashes");
    let group = |key: &str| -> u32 {
        let tag = key
            .split_once(":{g")
            .and_then(|(_, rest)| rest.split_once('}'));
        tag.and_then(|(g, _)| g.parse().ok()).expect("a group key")
    };
    let retired: Vec<&String> = hashes.iter().filter(|h| group(h) >= 16).collect();
    assert!(
        retired.is_empty(),
        "fields left in retired groups: {retired:?}"
    );
    eprintln!("{} packed hashes", hashes.len());

    setup.assert_audit_clean(&[], truth.len());
    let (again, text) = pack(redis_url, &setup.key_prefix, 64);
    assert!(
        again && moved(&text) == 0,
        "a second run moves nothing: {text}"
    );
    let (other, text) = pack(redis_url, &setup.key_prefix, 128);
    assert!(
        !other && text.contains("already packs its counters into 64 hashes"),
        "another count is refused: {text}"
    );
    assert_no_crossslot(dir.path());
}
