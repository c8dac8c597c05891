//! Packing a live deployment's shares into small hashes (`tally pack`), under load, on a
//! standalone Redis and on a 3-master Redis Cluster: two aggregators in one consumer group (on
//! the standalone server, one writing through the flush script and one through
//! `WATCH`/`MULTI`/`EXEC` transactions) count a paced storm of 100,000 increments and resets
//! over 300 counters. Mid-stream, `tally pack --buckets 64` has readers sum the packed fields,
//! marks every group, and moves the keys written so far into their fields; then both
//! aggregators are SIGKILLed and started again, so that new incarnations, knowing nothing of
//! the marks, learn them from their writes' answers. In the end every total is exact (what was
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
    let out = Command::new(binary("tally"))
        .arg("pack")
        .args(["--buckets", &buckets.to_string()])
        .args(["--redis-url", redis_url, "--key-prefix", prefix])
        .output()
        .expect("tally pack runs");
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
    let load = tokio::spawn(send_with_resets(topic, 100_000, 300, seed, never));
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
    let (truth, resets) = load.await.expect("load task");
    eprintln!("{} counters, {resets} resets", truth.len());

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

    // Every share is a field: the keys before the marks moved, none written since.
    let (mut shares, mut hashes) = (Vec::new(), 0);
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
        hashes += found.len();
    }
    assert_eq!(shares, Vec::<String>::new(), "counter keys left");
    assert!(hashes > 0, "packed hashes");
    eprintln!("{hashes} packed hashes");

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
