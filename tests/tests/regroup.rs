//! Growing a live deployment's shard groups: two aggregators count a paced load of 120,000
//! events on four partitions; halfway, `tally regroup --to 32` moves them from the original 16
//! groups to 32 without a restart, and one of them is SIGKILLed right after, so that the other
//! takes its partitions over under the new plan. Throughout, a reader polls the busiest counters:
//! no total it reads ever goes down (every delta is positive), so no read missed a group. In the
//! end every counter is exact, `tally audit` finds no drift, and the counters' later writes sit
//! in the new groups.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, binary, finish_load, seed, start_load, unique,
    wait_for_totals,
};

const PARTITIONS: i32 = 4;
const EVENTS: u64 = 120_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_the_groups_under_load_and_a_sigkill_counts_every_event_once() {
    let _serial = tally_tests::serial().await;
    let dir = TempDir::new("tally-regroup");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("regroup", &redis.url(), PARTITIONS).await;
    let spec = LoadSpec {
        events: EVENTS,
        counters: 2_000,
        rate: 10_000,
        max_delta: 5,
        seed: seed(),
        ..LoadSpec::default()
    };
    let load = start_load(&setup.topic, spec);
    let member = |name: &str| format!("group.instance.id={}", unique(name));
    let (first, second) = (member("first"), member("second"));
    let mut doomed = setup.spawn(dir.path(), &["--kafka-option", &first]);
    let mut survivor = setup.spawn(dir.path(), &["--kafka-option", &second]);
    doomed
        .wait_metric("tally_flushes_total", 1.0, Duration::from_secs(60))
        .await;

    // A reader polls the busiest counters while the groups change under it.
    let watched: Vec<String> = (0..20).map(|i| format!("likes:post:{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let reader = redis.reader(setup.keyspace()).await;
        let (watched, stop) = (watched.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = vec![0; watched.len()];
            let mut reads = 0;
            while !stop.load(Ordering::Relaxed) {
                let totals = reader.get_many(&watched).await.expect("a read");
                for ((counter, total), before) in watched.iter().zip(&totals).zip(&mut last) {
                    assert!(
                        *total >= *before,
                        "{counter} read {total} after {before}: a read missed a group"
                    );
                    *before = *total;
                }
                reads += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            reads
        })
    };

    tokio::time::sleep(Duration::from_secs(4)).await;
    let regroup = Command::new(binary("tally"))
        .args(["regroup", "--to", "32", "--wait", "60"])
        .args(["--redis-url", &setup.redis_url])
        .args(["--key-prefix", &setup.key_prefix])
        .output()
        .expect("tally regroup runs");
    let stdout = String::from_utf8_lossy(&regroup.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&regroup.stderr));
    assert!(
        regroup.status.success(),
        "tally regroup: {}",
        regroup.status
    );
    assert!(stdout.contains("readers sum 32 groups"), "{stdout}");
    assert!(
        stdout.contains("every partition (4) places new offsets in 32 groups"),
        "{stdout}"
    );
    doomed.kill();
    assert!(
        doomed
            .log()
            .contains("re-grouped: taking the partition again"),
        "{}",
        doomed.log()
    );

    let sent = finish_load(load, EVENTS).await;
    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent.totals, Duration::from_secs(90)).await;
    stop.store(true, Ordering::Relaxed);
    let reads = poller.await.expect("no read went down");
    assert!(reads > 50, "the reader polled throughout: {reads} reads");
    assert!(reader.groups().await.expect("the plan") == 32);

    // The load's second half went to the new groups too.
    let mut in_new_groups = 0;
    for counter in sent.totals.keys().take(200) {
        let shares = reader.shares(counter).await.expect("shares");
        assert_eq!(shares.len(), 32);
        in_new_groups += shares[16..].iter().flatten().count();
    }
    assert!(in_new_groups > 0, "no share in groups 16..32");
    survivor.stop_gracefully().await;
    setup.assert_audit_clean(&[], sent.totals.len());

    // A second run is a no-op, and shrinking is refused with a clear error.
    let again = Command::new(binary("tally"))
        .args(["regroup", "--to", "8", "--wait", "0"])
        .args(["--redis-url", &setup.redis_url])
        .args(["--key-prefix", &setup.key_prefix])
        .output()
        .expect("tally regroup runs");
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success());
    assert!(stderr.contains("shrinking from 32 to 8"), "{stderr}");
}
